//! Route handlers.

mod chat;
mod completions;
mod service;

pub(crate) use chat::chat_completions;
pub(crate) use completions::completions;
pub(crate) use service::*;

use actix_web::HttpRequest;

use crate::auth::Principal;
use crate::engine::GenerateRequest;
use crate::error::ApiError;
use crate::schema::Validated;
use crate::state::ApiState;

/// 404 unless `model` is absent or names the served model.
pub(crate) fn check_model(state: &ApiState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(name) if name != state.engine.model_name() => {
            // Bound the echoed name so a huge field cannot bloat the error body.
            let shown: String = name.chars().take(128).collect();
            Err(ApiError::ModelNotFound(shown))
        }
        _ => Ok(()),
    }
}

/// The client's `X-Request-Id`, if it sent one.
pub(crate) fn request_id_header(req: &HttpRequest) -> Option<&str> {
    req.headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
}

/// One engine request per prompt; ids are `id` (one prompt) or `id-<prompt>`.
pub(crate) fn engine_requests(
    id: &str,
    validated: &Validated,
    principal: &Principal,
    prompt_logprobs: Option<u32>,
) -> Vec<GenerateRequest> {
    let many = validated.prompts.len() > 1;
    validated
        .prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| GenerateRequest {
            request_id: if many {
                format!("{id}-{i}")
            } else {
                id.to_owned()
            },
            prompt: prompt.clone(),
            sampling: validated.sampling.clone(),
            stop: validated.stop.clone(),
            n: validated.n,
            max_tokens: validated.max_tokens,
            logprobs: validated.logprobs,
            prompt_logprobs,
            priority: validated.priority,
            tier: principal.tier.clone(),
            tenant: principal.tenant.clone(),
        })
        .collect()
}
