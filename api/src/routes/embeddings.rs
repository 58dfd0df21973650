//! `POST /v1/embeddings`: one engine request per input, submitted together (admitted all or
//! none, as a completion's prompts are); each gives back the final hidden state at its input's
//! last token ([`crate::engine::GenerateRequest::embed`]), which is normalized and encoded here
//! ([`crate::schema::embeddings`]).

use actix_web::{web, HttpRequest, HttpResponse};

use super::{check_model, prompt_request_id};
use crate::auth::Principal;
use crate::body::read_json;
use crate::engine::{EngineError, EngineErrorKind, GenerateRequest, SamplingOptions};
use crate::error::ApiError;
use crate::generation::{protocol_error, Generation, RequestFields};
use crate::schema::embeddings::{
    l2_normalize, EmbeddingData, EmbeddingJob, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage,
    EmbeddingVector,
};
use crate::schema::truncation::truncate_prompts;
use crate::schema::PromptTokensDetails;
use crate::state::{unix_now, ApiState};

/// Handles `POST /v1/embeddings`.
pub(crate) async fn embeddings(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let in_flight = state.admit()?;
    // Whatever the body, an engine without embeddings answers the same.
    let size = state
        .engine
        .embedding_size()
        .ok_or(ApiError::EmbeddingsNotServed)?;
    let body: EmbeddingRequest = read_json(&req, payload, &state.config()).await?;
    let id = crate::request_id::completion_id(&req, "embd-");
    body.ignored.warn("/v1/embeddings");
    let lora = check_model(&state, &principal, body.model.as_deref()).await?;
    let mut job = body.validate(state.engine.max_model_len(), size)?;
    if let Some(keep) = job.truncate_prompt_tokens {
        truncate_prompts(&*state.engine, &mut job.inputs, keep, "input").await?;
    }
    let requests = embedding_requests(&id, &job, &principal, lora.as_deref());
    // A too-long input is named `input`, whatever the engine names (its one token's
    // `max_tokens` cannot fail otherwise).
    let fields = RequestFields {
        prompt: "input",
        structured: None,
        max_tokens: "input",
    };
    let meter = state
        .rate_limit(&principal, &req, &requests)?
        .prompts_only();
    let generation = Generation::start(&*state.engine, requests, 1, fields, meter).await?;
    let created = unix_now();
    let (vectors, prompt_tokens, cached_tokens) = collect(generation, size).await?;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, mut vector)| {
            if job.normalize {
                l2_normalize(&mut vector);
            }
            EmbeddingData {
                object: "embedding",
                index: u32::try_from(index).unwrap_or(u32::MAX),
                embedding: EmbeddingVector::encode(vector, job.encoding),
            }
        })
        .collect();
    drop(in_flight);
    Ok(HttpResponse::Ok().json(EmbeddingResponse {
        id,
        object: "list",
        created,
        model: lora.unwrap_or_else(|| state.engine.model_name().to_owned()),
        data,
        usage: EmbeddingUsage {
            prompt_tokens,
            total_tokens: prompt_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        },
    }))
}

/// One embedding request per input: one greedy choice, no stop conditions, logprobs or
/// structured output, as the port asks of [`GenerateRequest::embed`].
fn embedding_requests(
    id: &str,
    job: &EmbeddingJob,
    principal: &Principal,
    lora: Option<&str>,
) -> Vec<GenerateRequest> {
    let inputs = job.inputs.len();
    job.inputs
        .iter()
        .enumerate()
        .map(|(i, input)| GenerateRequest {
            request_id: prompt_request_id(id, i, inputs),
            prompt: input.clone(),
            sampling: SamplingOptions {
                temperature: 0.0,
                ..SamplingOptions::default()
            },
            stop: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            keep_special_tokens: Default::default(),
            n: 1,
            max_tokens: Some(1),
            max_tokens_defaulted: false,
            logprobs: None,
            prompt_logprobs: None,
            priority: job.priority,
            tier: principal.tier.clone(),
            tenant: principal.tenant.clone(),
            lora: lora.map(str::to_owned),
            structured: None,
            cache_salt: None,
            sibling_failure: Default::default(),
            embed: true,
            beam_search: None,
        })
        .collect()
}

/// Waits for every input's vector (on its one finishing delta; `size` finite values) and
/// returns them in input order with the inputs' tokens and cached tokens summed. A vector missing or of another
/// length breaks the port's protocol, one with a value that is not finite is a backend
/// failure: either is a 500, and the other inputs end as failed.
async fn collect(
    mut generation: Generation,
    size: usize,
) -> Result<(Vec<Vec<f32>>, u32, u32), ApiError> {
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; generation.choices()];
    while let Some(delta) = generation.next().await {
        let delta = delta?;
        if delta.delta.finish.is_none() {
            continue;
        }
        let problem = match &delta.delta.embedding {
            None => Some(protocol_error(
                "an embedding request finished without its embedding",
            )),
            Some(v) if v.len() != size => Some(protocol_error(&format!(
                "an embedding of {} values where the model's have {size}",
                v.len()
            ))),
            Some(v) if !v.iter().all(|x| x.is_finite()) => {
                Some(ApiError::Engine(EngineError::new(
                    EngineErrorKind::Internal,
                    "the engine computed an embedding with a value that is not finite",
                )))
            }
            Some(_) => None,
        };
        if let Some(problem) = problem {
            generation.fail(EngineErrorKind::Internal);
            return Err(problem);
        }
        if let Some(slot) = usize::try_from(delta.choice)
            .ok()
            .and_then(|c| vectors.get_mut(c))
        {
            *slot = delta.delta.embedding;
        }
    }
    // `next` ends only once every choice finished, and each finish filled its slot.
    let vectors = vectors
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| protocol_error("an embedding request ended without its embedding"))?;
    Ok((
        vectors,
        generation.total_prompt_tokens(),
        generation.total_cached_prompt_tokens(),
    ))
}
