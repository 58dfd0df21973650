//! Server-sent events in OpenAI's framing: `data: {json}\n\n` per chunk, an optional usage
//! chunk, then `data: [DONE]\n\n`. An error after the stream started is sent as an OpenAI error
//! body chunk, then `[DONE]`. The Responses API's writer replaces the ending and the error
//! frames ([`ChunkWriter::closing`], [`ChunkWriter::failed`]): named events, no `[DONE]`.
//!
//! The response body owns the [`Generation`]; when the client disconnects actix-web drops the
//! body, which drops the engine receivers and so aborts the engine requests. actix-web notices a
//! closed connection only when a write to it fails, so a stream with nothing to send for
//! [`HEARTBEAT`] sends an SSE comment (`: keep-alive`, which SSE clients ignore): a client that
//! hung up while its request waits in the queue, runs a long prefill or decodes slowly is noticed
//! within about that long, not at its next token.

use std::collections::VecDeque;
use std::convert::Infallible;

use actix_web::http::header;
use actix_web::HttpResponse;
use bytes::Bytes;
use serde::Serialize;

use crate::error::ApiError;
use crate::generation::{ChoiceDelta, Generation};
use crate::schema::Usage;
use crate::state::InFlight;

/// The last frame of every stream.
pub(crate) const DONE_FRAME: &[u8] = b"data: [DONE]\n\n";

/// How long a stream may send nothing before it sends [`HEARTBEAT_FRAME`].
pub(crate) const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(1);

/// An SSE comment: ignored by clients, it makes a closed connection show up as a failed write.
pub(crate) const HEARTBEAT_FRAME: &[u8] = b": keep-alive\n\n";

/// Endpoint-specific chunk building.
pub(crate) trait ChunkWriter: 'static {
    /// Frames to send before the first delta (chat: the role; completions: echoed prompts).
    fn opening(&mut self, generation: &Generation) -> Vec<Bytes>;
    /// The frame for one delta, or `None` if it carries nothing to send.
    fn delta(&mut self, delta: ChoiceDelta) -> Option<Bytes>;
    /// The final usage frame.
    fn usage(&self, usage: Usage) -> Bytes;
    /// The frames after every choice finished: the usage frame (`include_usage`), then
    /// `[DONE]`. `usage` is the whole request's.
    fn closing(&mut self, usage: Usage, include_usage: bool) -> Vec<Bytes> {
        let mut frames = Vec::with_capacity(2);
        if include_usage {
            frames.push(self.usage(usage));
        }
        frames.push(Bytes::from_static(DONE_FRAME));
        frames
    }
    /// The frames of a failure after the stream started: the error body, then `[DONE]`.
    fn failed(&mut self, error: &ApiError) -> Vec<Bytes> {
        vec![frame(&error.to_body()), Bytes::from_static(DONE_FRAME)]
    }
}

/// vLLM's `stream_options.continuous_usage_stats`: every chunk carries the usage so far of its
/// choice, its prompt's tokens and the tokens the choice generated (vLLM's reading), and the
/// prompt tokens the prefix cache served the choice (0 in chunks before its first token).
pub(crate) struct RunningUsage {
    prompt_tokens: Vec<u32>,
    n: usize,
    completion: Vec<u32>,
}

impl RunningUsage {
    /// Nothing generated yet.
    pub(crate) fn new(generation: &Generation) -> Self {
        Self {
            prompt_tokens: generation.prompt_tokens.clone(),
            n: usize::try_from(generation.n()).unwrap_or(1).max(1),
            completion: vec![0; generation.choices()],
        }
    }

    /// Choice `choice`'s usage after `tokens` more tokens, `cached` of its prompt's tokens
    /// served by the prefix cache.
    pub(crate) fn add(&mut self, choice: u32, tokens: usize, cached: u32) -> Usage {
        let i = usize::try_from(choice).unwrap_or(usize::MAX);
        let prompt = self.prompt_tokens.get(i / self.n).copied().unwrap_or(0);
        let done = self.completion.get_mut(i).map_or(0, |c| {
            *c = c.saturating_add(u32::try_from(tokens).unwrap_or(u32::MAX));
            *c
        });
        Usage::new(prompt, cached.min(prompt), done)
    }
}

/// The `usage` field of a chunk of choice `choice` with `tokens` new tokens (`cached` prompt
/// tokens served by the prefix cache): the running usage when asked for, else `field` (absent,
/// or null with `include_usage`).
pub(crate) fn chunk_usage(
    running: &mut Option<RunningUsage>,
    field: Option<Option<Usage>>,
    choice: u32,
    tokens: usize,
    cached: u32,
) -> Option<Option<Usage>> {
    match running {
        Some(r) => Some(Some(r.add(choice, tokens, cached))),
        None => field,
    }
}

/// One SSE event named `event` (`event:` line) holding `value` as JSON, as OpenAI's Responses
/// API frames its events.
pub(crate) fn event_frame<T: Serialize>(event: &str, value: &T) -> Bytes {
    let mut out = format!("event: {event}\n").into_bytes();
    out.extend_from_slice(&frame(value));
    Bytes::from(out)
}

/// One `data:` frame holding `value` as JSON.
pub(crate) fn frame<T: Serialize>(value: &T) -> Bytes {
    let mut out = b"data: ".to_vec();
    if serde_json::to_writer(&mut out, value).is_err() {
        out.truncate(6);
        out.extend_from_slice(
            br#"{"error":{"message":"failed to encode a chunk","type":"server_error","param":null,"code":null}}"#,
        );
    }
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

struct SseState<W> {
    generation: Generation,
    writer: W,
    queue: VecDeque<Bytes>,
    include_usage: bool,
    completion_tokens: u32,
    done: bool,
    _in_flight: InFlight,
    /// The request's log span (request id, tenant, tier).
    span: tracing::Span,
}

/// Streams a started generation as an SSE response.
pub(crate) fn sse_response<W: ChunkWriter>(
    generation: Generation,
    mut writer: W,
    include_usage: bool,
    in_flight: InFlight,
) -> HttpResponse {
    let queue = writer.opening(&generation).into();
    let state = SseState {
        generation,
        writer,
        queue,
        include_usage,
        completion_tokens: 0,
        done: false,
        _in_flight: in_flight,
        // The body is polled outside the handler: its lines join the request's span here.
        span: tracing::Span::current(),
    };
    let body = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(frame) = st.queue.pop_front() {
                return Some((Ok::<_, Infallible>(frame), st));
            }
            if st.done {
                return None;
            }
            // `Generation::next` is cancel-safe: it awaits only the channels' receive.
            let Ok(next) = tokio::time::timeout(HEARTBEAT, st.generation.next()).await else {
                return Some((Ok(Bytes::from_static(HEARTBEAT_FRAME)), st));
            };
            match next {
                Some(Ok(delta)) => {
                    if let Some(finish) = delta.delta.finish {
                        st.completion_tokens = st
                            .completion_tokens
                            .saturating_add(finish.completion_tokens);
                    }
                    if let Some(frame) = st.writer.delta(delta) {
                        st.queue.push_back(frame);
                    }
                }
                Some(Err(error)) => {
                    st.span.in_scope(|| {
                        tracing::warn!(error = %error, "generation failed mid-stream");
                    });
                    st.queue.extend(st.writer.failed(&error));
                    st.done = true;
                }
                None => {
                    let usage = Usage::new(
                        st.generation.total_prompt_tokens(),
                        st.generation.total_cached_prompt_tokens(),
                        st.completion_tokens,
                    );
                    st.queue.extend(st.writer.closing(usage, st.include_usage));
                    st.done = true;
                }
            }
        }
    });
    HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, "text/event-stream"))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_data_lines_with_blank_line() {
        let f = frame(&serde_json::json!({"a": 1}));
        assert_eq!(&f[..], b"data: {\"a\":1}\n\n");
    }
}
