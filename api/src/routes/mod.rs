//! Route handlers.

mod chat;
mod completions;
mod embeddings;
mod responses;
mod service;

pub(crate) use chat::chat_completions;
pub(crate) use completions::completions;
pub(crate) use embeddings::embeddings;
pub(crate) use responses::{
    cancel_response, create_response, delete_response, list_input_items, retrieve_response,
};
pub(crate) use service::*;

use crate::auth::Principal;
use crate::engine::GenerateRequest;
use crate::error::ApiError;
use crate::schema::Validated;
use crate::state::ApiState;

/// What `model` names: `Ok(None)` for the base model (or no `model`), `Ok(Some(adapter))` for
/// a LoRA adapter the engine serves (registered, or found now in `lora.adapter_dirs`) that
/// the caller's key may name, 404 `model_not_found` otherwise.
pub(crate) async fn check_model(
    state: &ApiState,
    principal: &Principal,
    model: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let Some(name) = model else {
        return Ok(None);
    };
    if name == state.engine.model_name() {
        return Ok(None);
    }
    // An adapter the key may not name does not exist for it (the same 404, and nothing is
    // looked up, so its existence does not show in the time taken either).
    if principal.adapters.allows(name)
        && (state.engine.has_lora_adapter(name)
            || state.engine.find_lora_adapter(name.to_owned()).await?)
    {
        return Ok(Some(name.to_owned()));
    }
    // Bound the echoed name so a huge field cannot bloat the error body.
    let shown: String = name.chars().take(128).collect();
    Err(ApiError::ModelNotFound(shown))
}

/// The id of the engine request of prompt `i` of `prompts`: `id` for one prompt, `id-<i>`
/// for several.
fn prompt_request_id(id: &str, i: usize, prompts: usize) -> String {
    if prompts > 1 {
        format!("{id}-{i}")
    } else {
        id.to_owned()
    }
}

/// One engine request per prompt, each generating the request's `best_of` candidates (its `n`
/// unless completions' `best_of` asks for more, then with their logprobs, which rank them);
/// ids are `id` (one prompt) or `id-<prompt>`.
pub(crate) fn engine_requests(
    id: &str,
    validated: &Validated,
    principal: &Principal,
    prompt_logprobs: Option<u32>,
    lora: Option<&str>,
) -> Vec<GenerateRequest> {
    let prompts = validated.prompts.len();
    validated
        .prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| GenerateRequest {
            request_id: prompt_request_id(id, i, prompts),
            prompt: prompt.clone(),
            sampling: validated.sampling.clone(),
            stop: validated.stop.clone(),
            // Every candidate of `best_of`, with the logprobs that rank them.
            n: validated.best_of,
            max_tokens: validated.max_tokens,
            max_tokens_defaulted: validated.max_tokens_defaulted,
            logprobs: validated
                .logprobs
                .or((validated.best_of > validated.n).then_some(0)),
            prompt_logprobs,
            priority: validated.priority,
            tier: principal.tier.clone(),
            tenant: principal.tenant.clone(),
            lora: lora.map(str::to_owned),
            structured: validated.structured.clone(),
            cache_salt: validated.cache_salt.clone(),
            include_stop_str_in_output: validated.include_stop_str_in_output,
            skip_special_tokens: validated.skip_special_tokens,
            keep_special_tokens: validated.keep_special_tokens,
            sibling_failure: Default::default(),
            embed: false,
            beam_search: validated.beam_search,
        })
        .collect()
}
