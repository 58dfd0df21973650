//! `POST /v1/chat/completions`.

use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;

use super::{check_model, engine_requests};
use crate::auth::Principal;
use crate::body::read_json;
use crate::engine::{FinishReason, StructuredOutputSpec, TokenLogprob};
use crate::error::ApiError;
use crate::generation::{ChoiceDelta, Generation, RequestFields};
use crate::schema::reasoning::{ThinkSplitter, ThinkStart};
use crate::schema::tools::{new_call_id, ToolAnswer, ToolFormat, ToolPiece, ToolStream};
use crate::schema::truncation::truncate_prompts;
use crate::schema::{
    render_token_ids, ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatRequest,
    ChatResponse, ChatResponseMessage, FunctionCall, FunctionCallDelta, PromptLogprobs, ToolCall,
    ToolCallDelta, Usage, Validated,
};
use crate::sse::{chunk_usage, frame, sse_response, ChunkWriter, RunningUsage};
use crate::state::{request_id, unix_now, ApiState};

/// Handles `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let in_flight = state.admit()?;
    let body: ChatRequest = read_json(&req, payload, &state.config()).await?;
    let id = crate::request_id::completion_id(&req, "chatcmpl-");
    body.ignored.warn("/v1/chat/completions");
    let lora = check_model(&state, &principal, body.model.as_deref()).await?;
    let mut validated = body.validate(state.engine.max_model_len(), state.config().tools)?;
    if let Some(keep) = validated.truncate_prompt_tokens {
        truncate_prompts(&*state.engine, &mut validated.prompts, keep, "messages").await?;
    }
    // Reasoning tags that are special tokens stay in the text for the splitter.
    if state.config().reasoning.is_some() {
        validated.keep_special_tokens[3..].copy_from_slice(&state.config().reasoning_tokens);
    }
    let requests = engine_requests(
        &id,
        &validated,
        &principal,
        validated.prompt_logprobs,
        lora.as_deref(),
    );
    let fields = RequestFields {
        prompt: "messages",
        structured: validated.structured_field,
        max_tokens: validated.max_tokens_field,
    };
    let meter = state.rate_limit(&principal, &req, &requests)?;
    let generation =
        Generation::start(&*state.engine, requests, validated.n, fields, meter).await?;
    let model = lora.unwrap_or_else(|| state.engine.model_name().to_owned());
    let writer = ChatWriter::new(&state, &validated, &generation, id, model, true);
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

pub(super) struct ChatWriter {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    /// Alternatives per prompt token in vLLM's `prompt_logprobs` field, when asked.
    prompt_logprobs: Option<u32>,
    usage_field: Option<Option<Usage>>,
    /// Every chunk's usage so far, when the client asked for it (`continuous_usage_stats`).
    running: Option<RunningUsage>,
    /// Per choice, when the output is read back into content and tool calls: the reader.
    tools: Option<Vec<ToolStream>>,
    /// Per choice, when reasoning is read apart from the answer: the splitter (before the
    /// tool reader, which reads the answer).
    thinking: Option<Vec<ThinkSplitter>>,
    /// Per choice, the logprobs of the tokens whose text a reader holds back (they go out
    /// with the next chunk that carries text, reasoning or a call).
    held: Vec<Vec<TokenLogprob>>,
    /// The answer is calls only: no content, not even an empty one.
    calls_only: bool,
    /// `tool_choice` names the function: a choice that calls it finishes with `stop`.
    named: bool,
    /// The model's call format, whose ids the calls get.
    call_format: ToolFormat,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name tokens `token_id:{id}`.
    token_ids: bool,
}

impl ChatWriter {
    /// The writer of a chat answer to `validated`, started as `generation`; `reasoning`: read
    /// a reasoning block apart from the answer (where the server reads reasoning at all).
    pub(super) fn new(
        state: &ApiState,
        validated: &Validated,
        generation: &Generation,
        id: String,
        model: String,
        reasoning: bool,
    ) -> Self {
        let tool_format = state.config().tools.format;
        let free_text = match &validated.structured {
            None | Some(StructuredOutputSpec::ToolCalls(_)) => {
                !validated.tool_calls.is_some_and(ToolAnswer::calls_only)
            }
            // A client's own regex or grammar may write the block (its closing tag in it, escaped
            // or not: Mistral's brackets are escaped in a regex).
            Some(StructuredOutputSpec::Regex(g) | StructuredOutputSpec::Grammar(g)) => state
                .config()
                .reasoning
                .is_some_and(|tags| g.replace('\\', "").contains(tags.close)),
            Some(_) => false,
        };
        ChatWriter {
            id,
            created: unix_now(),
            model,
            logprobs: validated.logprobs.is_some(),
            prompt_logprobs: validated.prompt_logprobs,
            usage_field: validated.include_usage.then_some(None),
            running: validated
                .continuous_usage
                .then(|| RunningUsage::new(generation)),
            tools: validated.tool_calls.map(|answer| {
                (0..generation.choices())
                    .map(|_| ToolStream::new(tool_format).calls_only(answer.calls_only()))
                    .collect()
            }),
            // A grammar that holds the answer from its first token (a schema, a choice, calls
            // only, a regex or grammar that does not write </think>) leaves the model no room to
            // think: what it writes is the answer, even where the generation prompt opened a
            // <think> block.
            thinking: state
                .config()
                .reasoning
                .filter(|_| free_text && reasoning)
                .map(|tags| {
                    // A chat request has one prompt: its template opened the block, or the model may.
                    let start = if generation.opens_thinking.first() == Some(&true) {
                        ThinkStart::Prompt
                    } else {
                        ThinkStart::Model
                    };
                    (0..generation.choices())
                        .map(|_| ThinkSplitter::with_tags(start, tags))
                        .collect()
                }),
            held: vec![Vec::new(); generation.choices()],
            calls_only: validated.tool_calls.is_some_and(ToolAnswer::calls_only),
            named: validated.tool_calls == Some(ToolAnswer::Named),
            call_format: tool_format,
            token_ids: validated.return_tokens_as_token_ids,
        }
    }
}

/// What a choice's new text is, read.
pub(super) struct Reading {
    /// Reasoning text.
    pub(super) reasoning: String,
    /// Answer text.
    pub(super) content: String,
    /// Calls opened and arguments written.
    pub(super) calls: Vec<ToolCallDelta>,
    /// The logprobs to send with them.
    pub(super) logprobs: Vec<TokenLogprob>,
}

impl ChatWriter {
    /// The `usage` of a chunk of `choice` carrying `tokens` new tokens, `cached` of its
    /// prompt's tokens served by the prefix cache.
    fn usage_for(&mut self, choice: u32, tokens: usize, cached: u32) -> Option<Option<Usage>> {
        chunk_usage(&mut self.running, self.usage_field, choice, tokens, cached)
    }

    /// What a choice's new text is: content, and the calls it opens and writes. `finished`:
    /// the choice's last text (what was held back comes out).
    pub(super) fn read(
        &mut self,
        choice: u32,
        text: String,
        mut logprobs: Vec<TokenLogprob>,
        finished: bool,
    ) -> Reading {
        let at = usize::try_from(choice).unwrap_or(usize::MAX);
        if self.token_ids {
            render_token_ids(&mut logprobs);
        }
        let (reasoning, text) = match self.thinking.as_mut().and_then(|t| t.get_mut(at)) {
            Some(splitter) => {
                let mut split = splitter.push(&text);
                if finished {
                    let last = splitter.finish();
                    split.reasoning.push_str(&last.reasoning);
                    split.content.push_str(&last.content);
                }
                (split.reasoning, split.content)
            }
            None => (String::new(), text),
        };
        let pieces = match self.tools.as_mut().and_then(|t| t.get_mut(at)) {
            Some(stream) => {
                let mut pieces = stream.push(&text);
                if finished {
                    pieces.extend(stream.finish());
                }
                pieces
            }
            None if text.is_empty() => Vec::new(),
            None => vec![ToolPiece::Text(text)],
        };
        // A token's logprobs go out with the first chunk that carries any of its text,
        // reasoning or call: held while the readers give out nothing (a possible tag's, or a
        // call's closing tokens' until the next call or the end).
        if self.tools.is_some() || self.thinking.is_some() {
            if let Some(held) = self.held.get_mut(at) {
                if pieces.is_empty() && reasoning.is_empty() && !finished {
                    held.append(&mut logprobs);
                } else if !held.is_empty() {
                    held.append(&mut logprobs);
                    logprobs = std::mem::take(held);
                }
            }
        }
        let index = |i: usize| u32::try_from(i).unwrap_or(u32::MAX);
        let mut content = String::new();
        let mut calls: Vec<ToolCallDelta> = Vec::new();
        for piece in pieces {
            match piece {
                ToolPiece::Text(t) => content.push_str(&t),
                ToolPiece::Call { index: i, name } => calls.push(ToolCallDelta {
                    index: index(i),
                    id: Some(new_call_id(self.call_format, || request_id("call_", None))),
                    kind: Some("function"),
                    function: FunctionCallDelta {
                        name: Some(name),
                        arguments: String::new(),
                    },
                }),
                ToolPiece::Arguments { index: i, text } => match calls.last_mut() {
                    Some(call) if call.index == index(i) => call.function.arguments.push_str(&text),
                    _ => calls.push(ToolCallDelta {
                        index: index(i),
                        id: None,
                        kind: None,
                        function: FunctionCallDelta {
                            name: None,
                            arguments: text,
                        },
                    }),
                },
            }
        }
        Reading {
            reasoning,
            content,
            calls,
            logprobs,
        }
    }

    /// A choice's reader, when the output is read back into content and tool calls.
    fn reader(&self, choice: u32) -> Option<&ToolStream> {
        self.tools.as_ref()?.get(usize::try_from(choice).ok()?)
    }

    /// Whether a choice's output opened with `<think>`.
    fn reasoned(&self, choice: u32) -> bool {
        self.thinking
            .as_ref()
            .and_then(|t| t.get(usize::try_from(choice).ok()?))
            .is_some_and(ThinkSplitter::reasoned)
    }

    /// Whether the answer is calls only (`tool_choice` `required` or a named function).
    pub(super) fn calls_only(&self) -> bool {
        self.calls_only
    }

    /// Whether a choice's answer is calls from here on: calls only, or a call has opened.
    fn calling(&self, choice: u32) -> bool {
        self.calls_only || self.reader(choice).is_some_and(|s| s.calls() > 0)
    }

    /// `tool_calls` for a choice that called tools and stopped after its last call's
    /// arguments (not inside them, at a stop string); otherwise the engine's reason. A call of
    /// the function `tool_choice` names finishes with `stop`, as OpenAI's and vLLM's do.
    pub(super) fn finish_reason(&self, choice: u32, reason: FinishReason) -> &'static str {
        let called = !self.named
            && self
                .reader(choice)
                .is_some_and(|s| s.calls() > 0 && !s.cut_short());
        match reason {
            FinishReason::Stop if called => "tool_calls",
            reason => reason.as_str(),
        }
    }

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
                        content: (!self.calls_only).then(String::new),
                        reasoning_content: None,
                        tool_calls: None,
                    },
                    logprobs: None,
                    finish_reason: None,
                };
                let usage = self.usage_for(choice.index, 0, 0);
                frame(&self.chunk(vec![choice], usage))
            })
            .collect()
    }

    fn delta(&mut self, delta: ChoiceDelta) -> Option<Bytes> {
        let d = delta.delta;
        let usage = self.usage_for(delta.choice, d.token_ids.len(), d.cached_prompt_tokens);
        let Reading {
            reasoning,
            content: text,
            calls,
            logprobs,
        } = self.read(delta.choice, d.text, d.logprobs, d.finish.is_some());
        if text.is_empty()
            && reasoning.is_empty()
            && calls.is_empty()
            && d.finish.is_none()
            && logprobs.is_empty()
        {
            return None;
        }
        let choice = ChatChunkChoice {
            index: delta.choice,
            delta: ChatDelta {
                role: None,
                // An empty content only where text may still come (and no reasoning came).
                content: (!text.is_empty()
                    || (d.finish.is_none()
                        && calls.is_empty()
                        && reasoning.is_empty()
                        && !self.calling(delta.choice)))
                .then_some(text),
                reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
                tool_calls: (!calls.is_empty()).then_some(calls),
            },
            logprobs: self.logprobs.then(|| ChatLogprobs::from_engine(&logprobs)),
            finish_reason: d.finish.map(|f| self.finish_reason(delta.choice, f.reason)),
        };
        Some(frame(&self.chunk(vec![choice], usage)))
    }

    fn usage(&self, usage: Usage) -> Bytes {
        frame(&self.chunk(Vec::new(), Some(Some(usage))))
    }
}

async fn collect(
    mut generation: Generation,
    mut writer: ChatWriter,
) -> Result<ChatResponse, ApiError> {
    let mut choices: Vec<ChatChoice> = (0..generation.choices())
        .map(|i| ChatChoice {
            index: u32::try_from(i).unwrap_or(u32::MAX),
            message: ChatResponseMessage {
                role: "assistant",
                content: Some(String::new()),
                reasoning_content: None,
                tool_calls: Vec::new(),
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
        let d = delta.delta;
        let read = writer.read(delta.choice, d.text, d.logprobs, d.finish.is_some());
        choice
            .message
            .content
            .get_or_insert_with(String::new)
            .push_str(&read.content);
        if writer.reasoned(delta.choice) {
            choice
                .message
                .reasoning_content
                .get_or_insert_with(String::new)
                .push_str(&read.reasoning);
        }
        let tool_calls = &mut choice.message.tool_calls;
        for call in read.calls {
            match call.id {
                Some(id) => tool_calls.push(ToolCall {
                    id,
                    kind: "function",
                    function: FunctionCall {
                        name: call.function.name.unwrap_or_default(),
                        arguments: call.function.arguments,
                    },
                }),
                None => {
                    if let Some(open) = usize::try_from(call.index)
                        .ok()
                        .and_then(|i| tool_calls.get_mut(i))
                    {
                        open.function.arguments.push_str(&call.function.arguments);
                    }
                }
            }
        }
        if let Some(all) = choice.logprobs.as_mut() {
            all.content
                .extend(ChatLogprobs::from_engine(&read.logprobs).content);
        }
        if let Some(finish) = d.finish {
            choice.finish_reason = Some(writer.finish_reason(delta.choice, finish.reason));
            completion_tokens = completion_tokens.saturating_add(finish.completion_tokens);
        }
    }
    // An answer of calls alone (or of reasoning alone) has no content.
    for choice in &mut choices {
        let beside =
            !choice.message.tool_calls.is_empty() || choice.message.reasoning_content.is_some();
        if beside && choice.message.content.as_deref().is_some_and(str::is_empty) {
            choice.message.content = None;
        }
    }
    Ok(ChatResponse {
        id: writer.id,
        object: "chat.completion",
        created: writer.created,
        model: writer.model,
        choices,
        usage: Usage::new(
            generation.total_prompt_tokens(),
            generation.total_cached_prompt_tokens(),
            completion_tokens,
        ),
        prompt_logprobs: writer.prompt_logprobs.and_then(|k| {
            let list = generation.prompt_logprobs.first()?.as_deref()?;
            Some(PromptLogprobs::from_engine(list, k))
        }),
    })
}
