//! `POST /v1/chat/completions`.

use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;

use super::{check_model, engine_requests, request_id_header};
use crate::auth::Principal;
use crate::body::read_json;
use crate::error::ApiError;
use crate::generation::{ChoiceDelta, Generation};
use crate::schema::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatRequest, ChatResponse,
    ChatResponseMessage, Usage,
};
use crate::sse::{frame, sse_response, ChunkWriter};
use crate::state::{request_id, unix_now, ApiState};

/// Handles `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let in_flight = state.admit()?;
    let body: ChatRequest = read_json(&req, payload, state.config.max_body_bytes).await?;
    let lora = check_model(&state, body.model.as_deref())?;
    let validated = body.validate(state.engine.max_model_len())?;
    let id = request_id("chatcmpl-", request_id_header(&req));
    let requests = engine_requests(&id, &validated, &principal, None, lora.as_deref());
    let generation = Generation::start(&*state.engine, requests, validated.n, "messages").await?;
    let writer = ChatWriter {
        id,
        created: unix_now(),
        model: lora.unwrap_or_else(|| state.engine.model_name().to_owned()),
        logprobs: validated.logprobs.is_some(),
        usage_field: validated.include_usage.then_some(None),
    };
    if validated.stream {
        return Ok(sse_response(
            generation,
            writer,
            validated.include_usage,
            in_flight,
        ));
    }
    let response = collect(generation, writer).await?;
    drop(in_flight);
    Ok(HttpResponse::Ok().json(response))
}

struct ChatWriter {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    usage_field: Option<Option<Usage>>,
}

impl ChatWriter {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Option<Usage>>) -> ChatChunk {
        ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

impl ChunkWriter for ChatWriter {
    fn opening(&mut self, generation: &Generation) -> Vec<Bytes> {
        (0..generation.choices())
            .map(|i| {
                let choice = ChatChunkChoice {
                    index: u32::try_from(i).unwrap_or(u32::MAX),
                    delta: ChatDelta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                    },
                    logprobs: None,
                    finish_reason: None,
                };
                frame(&self.chunk(vec![choice], self.usage_field))
            })
            .collect()
    }

    fn delta(&mut self, delta: ChoiceDelta) -> Option<Bytes> {
        let d = delta.delta;
        if d.text.is_empty() && d.finish.is_none() && d.logprobs.is_empty() {
            return None;
        }
        let choice = ChatChunkChoice {
            index: delta.choice,
            delta: ChatDelta {
                role: None,
                content: (!d.text.is_empty() || d.finish.is_none()).then_some(d.text),
            },
            logprobs: self
                .logprobs
                .then(|| ChatLogprobs::from_engine(&d.logprobs)),
            finish_reason: d.finish.map(|f| f.reason.as_str()),
        };
        Some(frame(&self.chunk(vec![choice], self.usage_field)))
    }

    fn usage(&self, usage: Usage) -> Bytes {
        frame(&self.chunk(Vec::new(), Some(Some(usage))))
    }
}

async fn collect(mut generation: Generation, writer: ChatWriter) -> Result<ChatResponse, ApiError> {
    let mut choices: Vec<ChatChoice> = (0..generation.choices())
        .map(|i| ChatChoice {
            index: u32::try_from(i).unwrap_or(u32::MAX),
            message: ChatResponseMessage {
                role: "assistant",
                content: String::new(),
            },
            logprobs: writer.logprobs.then(ChatLogprobs::default),
            finish_reason: None,
        })
        .collect();
    let mut completion_tokens = 0u32;
    while let Some(delta) = generation.next().await {
        let delta = delta?;
        let Some(choice) = usize::try_from(delta.choice)
            .ok()
            .and_then(|i| choices.get_mut(i))
        else {
            continue;
        };
        choice.message.content.push_str(&delta.delta.text);
        if let Some(all) = choice.logprobs.as_mut() {
            all.content
                .extend(ChatLogprobs::from_engine(&delta.delta.logprobs).content);
        }
        if let Some(finish) = delta.delta.finish {
            choice.finish_reason = Some(finish.reason.as_str());
            completion_tokens = completion_tokens.saturating_add(finish.completion_tokens);
        }
    }
    Ok(ChatResponse {
        id: writer.id,
        object: "chat.completion",
        created: writer.created,
        model: writer.model,
        choices,
        usage: Usage::new(generation.total_prompt_tokens(), completion_tokens),
    })
}
