//! OpenAI request bodies for `/v1/completions` and `/v1/chat/completions`, with vLLM's extra
//! sampler fields, and their validation into the engine's [`GenerateRequest`].
//!
//! Fields follow OpenAI's API reference and vLLM's `CompletionRequest` / `ChatCompletionRequest`
//! extensions (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
//! `stop_token_ids`, `priority`, `include_stop_str_in_output`, `skip_special_tokens`). Unknown
//! fields are ignored, as OpenAI and vLLM do, and named in a warning (see
//! [`IgnoredFields`]); known fields this server cannot honour (`suffix`, and on chat `echo`)
//! are rejected with a 400 naming them when set to anything but their default, rather than
//! silently ignored. Completions take OpenAI's `best_of` ([`super::best_of`]); both endpoints
//! take vLLM's `truncate_prompt_tokens` ([`super::truncation`]). vLLM's `prompt_logprobs` is read as vLLM reads it
//! (`parse_prompt_logprobs`). Chat takes vLLM's `add_generation_prompt` and
//! `continue_final_message` (see [`chat_ending`]). Tool calling is in [`super::tools`]. A
//! `developer` message is read as the system message (see [`parse_messages`]).

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use serde::Deserialize;

use super::best_of::{parse_best_of, BEST_OF};
use super::chat_extras::ChatExtras;
use super::ignored::IgnoredFields;
use super::limits::*;
use super::sampling::SamplerFields;
use super::structured::{Structured, StructuredFields};
use super::tools::{
    render_calls, render_result_marked, template_call_id, template_calls, KeptTokens, ToolAnswer,
    ToolFormat, ToolPrompt, ToolSetup, ToolUse, MAX_TOOL_CALL_ID,
};
use super::truncation::{keep_last, parse_truncate_prompt_tokens};
use crate::engine::{
    BeamSearch, ChatEnding, ChatMessage, ChatRole, EngineError, EngineErrorKind, PromptInput,
    SamplingOptions, StructuredOutputSpec, TemplateKwargs,
};
use crate::error::ApiError;
use crate::objects_only::objects_only;

/// `prompt`: a string, a list of strings, a list of token ids or a list of token-id lists.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(
    untagged,
    expecting = "`prompt` must be a string, an array of strings, an array of token ids \
                 (integers from 0) or an array of arrays of token ids"
)]
pub enum PromptField {
    /// One text prompt.
    Text(String),
    /// One token-id prompt.
    Tokens(Vec<u32>),
    /// Several text prompts.
    Texts(Vec<String>),
    /// Several token-id prompts.
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged, expecting = "`stop` must be a string or an array of strings")]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with the token usage before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
    /// vLLM's usage in every chunk (with `include_usage`): the tokens so far of the chunk's
    /// choice.
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// Body of `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model name; optional (defaults to the served model), 404 if it names another.
    pub model: Option<String>,
    /// The prompt(s).
    pub prompt: PromptField,
    /// Completion length limit; [`DEFAULT_COMPLETION_MAX_TOKENS`] if absent.
    pub max_tokens: Option<u32>,
    /// Choices per prompt.
    pub n: Option<u32>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Number of top logprobs per token (0 ..= 20).
    pub logprobs: Option<u32>,
    /// Prepend the prompt to the completion.
    pub echo: Option<bool>,
    /// Stream over SSE.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Candidates generated per prompt, of which the `n` best are returned (see
    /// [`super::best_of`]); `n` when absent.
    pub best_of: Option<u32>,
    /// vLLM's `truncate_prompt_tokens`: keep only the last this many prompt tokens (-1: as
    /// many as the context takes; see [`super::truncation`]).
    pub truncate_prompt_tokens: Option<i64>,
    /// Not supported (insertion); only empty is accepted.
    pub suffix: Option<String>,
    /// vLLM's beam search: `n` beams instead of `n` samples.
    pub use_beam_search: Option<bool>,
    /// vLLM's beam score: the cumulative logprob over `length ^ length_penalty` (default 1).
    pub length_penalty: Option<f32>,
    /// vLLM's prompt logprobs: each choice's `prompt_logprobs` field holds, per prompt token,
    /// its logprob and rank and this many alternatives (0 ..= 20; see
    /// `parse_prompt_logprobs`).
    pub prompt_logprobs: Option<i64>,
    /// Scheduling priority (vLLM: lower first).
    pub priority: Option<i32>,
    /// End-user id; accepted and ignored (never a metric label).
    pub user: Option<String>,
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `top_k`.
    pub top_k: Option<i64>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `presence_penalty`.
    pub presence_penalty: Option<f32>,
    /// `frequency_penalty`.
    pub frequency_penalty: Option<f32>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
    /// `seed`.
    pub seed: Option<i64>,
    /// `logit_bias`.
    pub logit_bias: Option<HashMap<String, f32>>,
    /// `stop_token_ids`.
    pub stop_token_ids: Option<Vec<u32>>,
    /// `min_tokens`.
    pub min_tokens: Option<u32>,
    /// `ignore_eos`.
    pub ignore_eos: Option<bool>,
    /// vLLM's `allowed_token_ids`: only these tokens may be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words`: words the output may not contain (as tokens).
    pub bad_words: Option<Vec<String>>,
    /// vLLM's `return_tokens_as_token_ids`: logprobs' token strings read `token_id:{id}`.
    pub return_tokens_as_token_ids: Option<bool>,
    /// vLLM's `cache_salt`: cached prefixes are shared only with requests of the same salt.
    pub cache_salt: Option<String>,
    /// vLLM's `include_stop_str_in_output`: keep a matched stop string (or the text of the stop
    /// token that ended the output) in the text.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's `skip_special_tokens` (default true): leave special tokens' text out.
    pub skip_special_tokens: Option<bool>,
    /// vLLM's `spaces_between_special_tokens`: read (a boolean) and without effect, as with
    /// vLLM's fast tokenizers, so it is not reported as an ignored field.
    pub spaces_between_special_tokens: Option<bool>,
    /// Structured output (`response_format`, `structured_outputs`, `guided_*`). Flattened
    /// fields are read from serde's buffer, outside the body's wrapper: [`objects_only`] keeps
    /// a struct among them from being read from an array.
    #[serde(flatten, deserialize_with = "objects_only")]
    pub structured: StructuredFields,
    /// Fields no endpoint reads (logged, see [`IgnoredFields`]); last of the flattened fields.
    #[serde(flatten)]
    pub ignored: IgnoredFields,
}

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Model name; optional (defaults to the served model), 404 if it names another.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<MessageField>,
    /// Completion length limit (deprecated name).
    pub max_tokens: Option<u32>,
    /// Completion length limit (current name; wins over `max_tokens`).
    pub max_completion_tokens: Option<u32>,
    /// Choices.
    pub n: Option<u32>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Return logprobs of the output tokens.
    pub logprobs: Option<bool>,
    /// Alternatives per token (0 ..= 20); requires `logprobs`.
    pub top_logprobs: Option<u32>,
    /// Stream over SSE.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Functions the model may call (see [`super::tools`]).
    pub tools: Option<serde_json::Value>,
    /// `none`, `auto` (the default with tools), `required` or a named function.
    pub tool_choice: Option<serde_json::Value>,
    /// Whether one answer may hold several calls (default true).
    pub parallel_tool_calls: Option<bool>,
    /// More variables for the chat template (vLLM's field; e.g. Qwen3's `enable_thinking`).
    pub chat_template_kwargs: Option<serde_json::Value>,
    /// vLLM's `add_generation_prompt`: open the answer with the template's generation prompt
    /// (default true, false when `continue_final_message` is true).
    pub add_generation_prompt: Option<bool>,
    /// vLLM's `continue_final_message`: leave the final message open for the model to
    /// continue (default false).
    pub continue_final_message: Option<bool>,
    /// vLLM's chat `echo` (prepend the last message); only `false` is accepted.
    pub echo: Option<bool>,
    /// vLLM's `truncate_prompt_tokens`: keep only the last this many tokens of the rendered
    /// conversation (-1: as many as the context takes; see [`super::truncation`]).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's beam search: `n` beams instead of `n` samples.
    pub use_beam_search: Option<bool>,
    /// vLLM's beam score: the cumulative logprob over `length ^ length_penalty` (default 1).
    pub length_penalty: Option<f32>,
    /// vLLM's prompt logprobs: the response's `prompt_logprobs` field (0 ..= 20 alternatives;
    /// see `parse_prompt_logprobs`).
    pub prompt_logprobs: Option<i64>,
    /// Scheduling priority (vLLM: lower first).
    pub priority: Option<i32>,
    /// End-user id; accepted and ignored.
    pub user: Option<String>,
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `top_k`.
    pub top_k: Option<i64>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `presence_penalty`.
    pub presence_penalty: Option<f32>,
    /// `frequency_penalty`.
    pub frequency_penalty: Option<f32>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
    /// `seed`.
    pub seed: Option<i64>,
    /// `logit_bias`.
    pub logit_bias: Option<HashMap<String, f32>>,
    /// `stop_token_ids`.
    pub stop_token_ids: Option<Vec<u32>>,
    /// `min_tokens`.
    pub min_tokens: Option<u32>,
    /// `ignore_eos`.
    pub ignore_eos: Option<bool>,
    /// vLLM's `allowed_token_ids`: only these tokens may be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words`: words the output may not contain (as tokens).
    pub bad_words: Option<Vec<String>>,
    /// vLLM's `return_tokens_as_token_ids`: logprobs' token strings read `token_id:{id}`.
    pub return_tokens_as_token_ids: Option<bool>,
    /// vLLM's `cache_salt`: cached prefixes are shared only with requests of the same salt.
    pub cache_salt: Option<String>,
    /// vLLM's `include_stop_str_in_output`: keep a matched stop string (or the text of the stop
    /// token that ended the output) in the text.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's `skip_special_tokens` (default true): leave special tokens' text out.
    pub skip_special_tokens: Option<bool>,
    /// vLLM's `spaces_between_special_tokens`: read (a boolean) and without effect, as with
    /// vLLM's fast tokenizers, so it is not reported as an ignored field.
    pub spaces_between_special_tokens: Option<bool>,
    /// Structured output (`response_format`, `structured_outputs`, `guided_*`). Flattened
    /// fields are read from serde's buffer, outside the body's wrapper: [`objects_only`] keeps
    /// a struct among them from being read from an array.
    #[serde(flatten, deserialize_with = "objects_only")]
    pub structured: StructuredFields,
    /// OpenAI's fields that are only checked (`functions`, `modalities`, `service_tier`, ...).
    #[serde(flatten, deserialize_with = "objects_only")]
    pub extras: ChatExtras,
    /// Fields no endpoint reads (logged, see [`IgnoredFields`]); last of the flattened fields.
    #[serde(flatten)]
    pub ignored: IgnoredFields,
}

/// One message of `messages`.
#[derive(Debug, Clone, Deserialize)]
pub struct MessageField {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text, or a list of content parts of which only `text` parts are supported.
    pub content: Option<ContentField>,
    /// Participant name: given to a chat template that writes tools itself, else ignored.
    pub name: Option<String>,
    /// An assistant message's tool calls.
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers: given to a chat template that writes tools itself
    /// (Mistral's name the call in a result), and in Mistral's results when the server writes
    /// them.
    pub tool_call_id: Option<String>,
}

/// A message's `content`.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "`content` must be a string or an array of content parts, each an object \
                 with a `type` (`{\"type\": \"text\", \"text\": \"...\"}`)"
)]
pub enum ContentField {
    /// Plain text.
    Text(String),
    /// Content parts. Read through [`objects_only`] (serde reads an untagged enum's variant
    /// from its buffer, outside the body's wrapper): a part is an object, never an array.
    #[serde(deserialize_with = "objects_only")]
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Part type: `text`, or `refusal` in an assistant message.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
    /// The text of a `refusal` part (assistant messages: a refusal the model gave earlier).
    pub refusal: Option<String>,
}

macro_rules! sampler_fields {
    ($req:expr) => {
        SamplerFields {
            temperature: $req.temperature,
            top_p: $req.top_p,
            top_k: $req.top_k,
            min_p: $req.min_p,
            presence_penalty: $req.presence_penalty,
            frequency_penalty: $req.frequency_penalty,
            repetition_penalty: $req.repetition_penalty,
            seed: $req.seed,
            logit_bias: $req.logit_bias.clone(),
            stop_token_ids: $req.stop_token_ids.clone(),
            min_tokens: $req.min_tokens,
            ignore_eos: $req.ignore_eos,
            allowed_token_ids: $req.allowed_token_ids.clone(),
            bad_words: $req.bad_words.clone(),
        }
    };
}

/// A request reduced to what the engine needs, shared by both endpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct Validated {
    /// One engine input per prompt (chat has exactly one).
    pub prompts: Vec<PromptInput>,
    /// Sampler settings.
    pub sampling: SamplingOptions,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Choices per prompt.
    pub n: u32,
    /// Candidates generated per prompt (completions' `best_of`; `n` elsewhere), of which the
    /// `n` best are returned; above `n`, never with `stream` or beam search.
    pub best_of: u32,
    /// Prompt tokens kept, the last ones (vLLM's `truncate_prompt_tokens`); `None`: all.
    /// Token prompts are already cut; text and chat prompts are cut once tokenized
    /// ([`super::truncation::truncate_prompts`]).
    pub truncate_prompt_tokens: Option<usize>,
    /// Completion length limit; `None` (chat only) means up to the context window.
    pub max_tokens: Option<u32>,
    /// `max_tokens` is the endpoint's default, not the client's: cut to the room the prompt
    /// leaves rather than refused.
    pub max_tokens_defaulted: bool,
    /// The request field that set `max_tokens` (chat's `max_completion_tokens` or
    /// `max_tokens`): the `param` of the engine's refusals of the limit.
    pub max_tokens_field: &'static str,
    /// Top-logprobs count per sampled token, if asked.
    pub logprobs: Option<u32>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token in the response's
    /// `prompt_logprobs` field, if asked (never with `stream`).
    pub prompt_logprobs: Option<u32>,
    /// Prepend the prompt (completions only).
    pub echo: bool,
    /// Stream over SSE.
    pub stream: bool,
    /// Send a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// Every chunk carries its choice's usage so far (vLLM's `continuous_usage_stats`, with
    /// `include_usage`).
    pub continuous_usage: bool,
    /// Scheduling priority; `None` when the request set none (its tier's applies).
    pub priority: Option<i32>,
    /// What the output must follow.
    pub structured: Option<StructuredOutputSpec>,
    /// The request field that asked for `structured` (`tools` for tool calls): the `param` of
    /// the engine's refusal of it.
    pub structured_field: Option<&'static str>,
    /// How the output is read back into content and tool calls (chat with tools).
    pub tool_calls: Option<ToolAnswer>,
    /// The prefix-cache salt asked for.
    pub cache_salt: Option<String>,
    /// vLLM's beam search, when asked.
    pub beam_search: Option<BeamSearch>,
    /// Keep matched stop strings and stop tokens' text.
    pub include_stop_str_in_output: bool,
    /// vLLM's `return_tokens_as_token_ids`: every token string of the logprobs (completions'
    /// `tokens` and `top_logprobs` keys, chat's `token` and its `bytes`) reads `token_id:{id}`.
    pub return_tokens_as_token_ids: bool,
    /// Leave special tokens' text out.
    pub skip_special_tokens: bool,
    /// Special tokens whose text is kept though special tokens are skipped (the tool-call
    /// markers, where they are special tokens).
    pub keep_special_tokens: KeptTokens,
}

/// A `cache_salt`: 1 to [`MAX_CACHE_SALT_BYTES`] bytes.
fn parse_cache_salt(salt: Option<String>) -> Result<Option<String>, ApiError> {
    match salt {
        Some(s) if s.is_empty() || s.len() > MAX_CACHE_SALT_BYTES => Err(ApiError::invalid(
            "cache_salt",
            format!("cache_salt must be 1 to {MAX_CACHE_SALT_BYTES} bytes"),
        )),
        other => Ok(other),
    }
}

/// The structure asked for, refused together with `ignore_eos` (a finished structure ends
/// the request through its end-of-sequence token).
fn parse_structured(
    fields: &StructuredFields,
    sampling: &SamplingOptions,
) -> Result<Option<Structured>, ApiError> {
    let spec = fields.validate()?;
    if spec.is_some() && sampling.ignore_eos {
        return Err(ApiError::invalid(
            "ignore_eos",
            "ignore_eos cannot be combined with structured output",
        ));
    }
    Ok(spec)
}

fn parse_stop(stop: Option<StopField>) -> Result<Vec<String>, ApiError> {
    let stop = match stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(list)) => list,
    };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings are allowed"),
        ));
    }
    for s in &stop {
        if s.is_empty() || s.len() > MAX_STOP_STRING_BYTES {
            return Err(ApiError::invalid(
                "stop",
                format!("stop strings must be 1 to {MAX_STOP_STRING_BYTES} bytes long"),
            ));
        }
    }
    Ok(stop)
}

fn parse_n(n: Option<u32>) -> Result<u32, ApiError> {
    match n.unwrap_or(1) {
        n @ 1..=MAX_N => Ok(n),
        n => Err(ApiError::invalid(
            "n",
            format!("n must be in [1, {MAX_N}], got {n}"),
        )),
    }
}

fn parse_max_tokens(
    param: &str,
    value: Option<u32>,
    max_model_len: usize,
) -> Result<Option<u32>, ApiError> {
    match value {
        Some(0) => Err(ApiError::invalid(
            param,
            format!("{param} must be at least 1"),
        )),
        // A prompt takes one token of the context at least: a limit of the whole context
        // leaves no room for one (the engine checks the prompt's own length).
        Some(v) if usize::try_from(v).map_or(true, |v| v >= max_model_len) => {
            Err(context_length_exceeded(
                param,
                format!(
                    "'max_tokens' or 'max_completion_tokens' is too large: {v}. This model's \
                     maximum context length is {max_model_len} tokens and a prompt takes at \
                     least one of them ({v} > {max_model_len} - 1)."
                ),
            ))
        }
        v => Ok(v),
    }
}

/// A request too long for the context (`context_length_exceeded`), `param` at fault. The
/// words are the engine's for the same refusals (switchyard-actors' `context_length`
/// module): vLLM's, and a prompt must leave room for one generated token, as vLLM checks.
pub(super) fn context_length_exceeded(param: &str, message: String) -> ApiError {
    ApiError::Engine(
        EngineError::new(EngineErrorKind::ContextLengthExceeded, message).with_param(param),
    )
}

/// A prompt of `prompt_len` tokens (the request's `param`) leaves no room for a generated
/// token in a context of `max_model_len` tokens: the engine's words for the same refusal.
pub(super) fn prompt_too_long(param: &str, prompt_len: usize, max_model_len: usize) -> ApiError {
    context_length_exceeded(
        param,
        format!(
            "This model's maximum context length is {max_model_len} tokens. However, your \
             request has {prompt_len} input tokens, which leaves no room for an output token \
             (a prompt may have at most {} tokens). Please reduce the length of the input.",
            max_model_len.saturating_sub(1)
        ),
    )
}

/// Refuses a `min_tokens` the request can never reach, so that it fails with a 400 rather
/// than in the scheduler once a stream has begun: above the completion length limit
/// (`limit`: the value and how the request set it), or, without a limit, at or above the
/// context length (the prompt takes at least one of its tokens).
fn check_min_tokens(
    min_tokens: u32,
    limit: Option<(&str, u32)>,
    max_model_len: usize,
) -> Result<(), ApiError> {
    match limit {
        Some((name, max)) if min_tokens > max => Err(ApiError::invalid(
            "min_tokens",
            format!("min_tokens ({min_tokens}) must be at most {name} ({max})"),
        )),
        None if usize::try_from(min_tokens).map_or(true, |m| m >= max_model_len) => {
            Err(ApiError::invalid(
                "min_tokens",
                format!(
                    "min_tokens must be less than the context length {max_model_len}, \
                     got {min_tokens}"
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// Bounds the prompt logprobs of a request with `echo` and `logprobs`: every choice carries
/// `logprobs + 1` entries per token of its prompt, so prompts × n × (logprobs + 1) is at most
/// [`MAX_ECHO_LOGPROB_ENTRIES`] (prompts are at most the context length each).
fn check_echo_logprobs(prompts: usize, n: u32, logprobs: u32) -> Result<(), ApiError> {
    let per_position = prompts
        .saturating_mul(usize::try_from(n).unwrap_or(usize::MAX))
        .saturating_mul(usize::try_from(logprobs).map_or(usize::MAX, |k| k.saturating_add(1)));
    if per_position > MAX_ECHO_LOGPROB_ENTRIES {
        return Err(ApiError::invalid(
            "echo",
            format!(
                "echo with logprobs returns logprobs + 1 entries per prompt token for every \
                 choice; prompts × n × (logprobs + 1) must be at most \
                 {MAX_ECHO_LOGPROB_ENTRIES}, got {prompts} × {n} × ({logprobs} + 1)"
            ),
        ));
    }
    Ok(())
}

/// Bounds the generated tokens' logprobs of a non-streaming request (a streamed one is
/// written as it goes): choices × `max_tokens` × (`logprobs` + 1) is at most
/// [`MAX_GENERATED_LOGPROB_ENTRIES`]. `max_tokens` is `None` for a chat answer without a
/// limit, which may take the room the shortest prompt leaves (the context length less one).
fn check_generated_logprobs(
    param: &str,
    choices: usize,
    max_tokens: Option<u32>,
    logprobs: u32,
    max_model_len: usize,
    ranked: bool,
) -> Result<(), ApiError> {
    let length = max_tokens.map_or(max_model_len.saturating_sub(1), |m| {
        usize::try_from(m).unwrap_or(usize::MAX)
    });
    let per_token = usize::try_from(logprobs).map_or(usize::MAX, |k| k.saturating_add(1));
    let entries = choices.saturating_mul(length).saturating_mul(per_token);
    if entries > MAX_GENERATED_LOGPROB_ENTRIES {
        let length_name = if max_tokens.is_some() {
            "max_tokens"
        } else {
            "max_tokens (absent: the context length less one)"
        };
        // Candidates ranked by best_of hold their logprobs whether or not asked, and cannot
        // be streamed: the way out is fewer of them.
        let message = if ranked {
            format!(
                "best_of ranks its candidates by their logprobs (computed whether or not \
                 asked), which holds candidates (prompts × best_of) × {length_name} × (top \
                 logprobs + 1) entries, at most {MAX_GENERATED_LOGPROB_ENTRIES}; got {choices} \
                 × {length} × {per_token} = {entries}. best_of above n cannot be streamed: \
                 lower best_of, max_tokens or the number of top logprobs"
            )
        } else {
            format!(
                "a response with logprobs holds choices × {length_name} × (top logprobs + 1) \
                 entries, at most {MAX_GENERATED_LOGPROB_ENTRIES} unless streamed; got \
                 {choices} × {length} × {per_token} = {entries}. Set stream to true, or lower \
                 n, max_tokens or the number of top logprobs"
            )
        };
        return Err(ApiError::invalid(param, message));
    }
    Ok(())
}

/// Refuses a known field set to a value the server cannot honour (`set`), naming it.
fn refuse_unsupported(param: &str, set: bool, what: &str) -> Result<(), ApiError> {
    if set {
        return Err(ApiError::invalid(
            param,
            format!("{param} {what} is not supported"),
        ));
    }
    Ok(())
}

/// How a chat prompt ends, from vLLM's `add_generation_prompt` (default true) and
/// `continue_final_message` (default false). Both true is refused, as vLLM refuses it; unlike
/// vLLM, `continue_final_message` alone turns the generation prompt off (vLLM asks for
/// `add_generation_prompt: false` beside it: accepted too).
pub fn chat_ending(
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
) -> Result<ChatEnding, ApiError> {
    match (add_generation_prompt, continue_final_message) {
        (Some(true), Some(true)) => Err(ApiError::invalid(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true: the first \
             continues the final message, the second opens a new one",
        )),
        (_, Some(true)) => Ok(ChatEnding::ContinueFinal),
        (Some(false), _) => Ok(ChatEnding::Closed),
        _ => Ok(ChatEnding::GenerationPrompt),
    }
}

/// A conversation whose final message is continued must end with text to continue.
pub fn check_continued(messages: &[ChatMessage], ending: ChatEnding) -> Result<(), ApiError> {
    if ending == ChatEnding::ContinueFinal
        && messages.last().is_none_or(|m| m.content.trim().is_empty())
    {
        return Err(ApiError::invalid(
            "continue_final_message",
            "continue_final_message needs a final message with text to continue",
        ));
    }
    Ok(())
}

/// vLLM's beam search (`use_beam_search: true`, `length_penalty`), checked against the rest
/// of the request: `n` beams (at most [`MAX_BEAM_WIDTH`]) ranked by the model's logprobs, so
/// the settings that shape sampling (`top_p`, `top_k`, `min_p`, the penalties, `logit_bias`)
/// are refused rather than silently ignored as vLLM does; `temperature` and `seed` are
/// accepted and change nothing (vLLM's logprobs are the raw logits' too). Stop strings,
/// structured output and prompt logprobs are refused. `length_penalty` is checked whether or
/// not the search is on (vLLM accepts it on any request).
struct BeamFields<'a> {
    use_beam_search: Option<bool>,
    length_penalty: Option<f32>,
    n: u32,
    sampling: &'a SamplingOptions,
    stop: &'a [String],
    structured_field: Option<&'static str>,
    /// Completions' `echo` with `logprobs` (the prompt's logprobs).
    echo_logprobs: bool,
    /// vLLM's `prompt_logprobs`.
    prompt_logprobs: bool,
}

impl BeamFields<'_> {
    fn parse(self) -> Result<Option<BeamSearch>, ApiError> {
        let length_penalty = self.length_penalty.unwrap_or(1.0);
        if !length_penalty.is_finite() || length_penalty.abs() > MAX_LENGTH_PENALTY {
            return Err(ApiError::invalid(
                "length_penalty",
                format!(
                    "length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, \
                     {MAX_LENGTH_PENALTY}]"
                ),
            ));
        }
        if self.use_beam_search != Some(true) {
            return Ok(None);
        }
        if self.n > MAX_BEAM_WIDTH {
            return Err(ApiError::invalid(
                "n",
                format!(
                    "beam search keeps at most {MAX_BEAM_WIDTH} beams (n), got {}",
                    self.n
                ),
            ));
        }
        let s = self.sampling;
        let shaping = [
            ("top_p", s.top_p != 1.0),
            ("top_k", s.top_k != 0),
            ("min_p", s.min_p != 0.0),
            ("presence_penalty", s.presence_penalty != 0.0),
            ("frequency_penalty", s.frequency_penalty != 0.0),
            ("repetition_penalty", s.repetition_penalty != 1.0),
            ("logit_bias", !s.logit_bias.is_empty()),
            ("allowed_token_ids", s.allowed_token_ids.is_some()),
            ("bad_words", !s.bad_words.is_empty()),
        ];
        if let Some((field, _)) = shaping.iter().find(|(_, set)| *set) {
            return Err(ApiError::invalid(
                *field,
                format!(
                    "{field} does not apply to beam search, which ranks beams by the model's \
                     logprobs; leave it out or turn use_beam_search off"
                ),
            ));
        }
        let other = [
            ("stop", !self.stop.is_empty(), "stop strings"),
            (
                "echo",
                self.echo_logprobs,
                "echo with logprobs (the prompt's logprobs)",
            ),
            ("prompt_logprobs", self.prompt_logprobs, "prompt logprobs"),
        ];
        if let Some((field, _, what)) = other.iter().find(|(_, set, _)| *set) {
            return Err(ApiError::invalid(
                *field,
                format!("beam search does not take {what}"),
            ));
        }
        if let Some(field) = self.structured_field {
            return Err(ApiError::invalid(
                field,
                "beam search does not take structured output or tools",
            ));
        }
        Ok(Some(BeamSearch { length_penalty }))
    }
}

/// vLLM's `prompt_logprobs` (both endpoints): the number of alternatives per prompt token
/// (0 ..= [`MAX_LOGPROBS`]; vLLM's -1, the whole vocabulary, is refused), `None` when the
/// response carries none. As vLLM, a streamed request may not ask for alternatives (a 400) and
/// `0` with `stream` is accepted and sends nothing. The response carries
/// `prompt_logprobs + 1` entries per prompt token (the alternatives and the token itself) for
/// each of `copies` (completions: every choice, `n` per prompt; chat: once), bounded as the
/// generated tokens' logprobs are: at most [`MAX_GENERATED_LOGPROB_ENTRIES`] over the
/// `prompt_tokens` (per prompt; a text prompt counts as the context length less one, its
/// length known only once tokenized).
fn parse_prompt_logprobs(
    value: Option<i64>,
    stream: bool,
    prompt_tokens: impl IntoIterator<Item = usize>,
    copies: u32,
) -> Result<Option<u32>, ApiError> {
    let Some(value) = value else {
        return Ok(None);
    };
    let k = u32::try_from(value)
        .ok()
        .filter(|&k| k <= MAX_LOGPROBS)
        .ok_or_else(|| {
            ApiError::invalid(
                "prompt_logprobs",
                format!(
                    "prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {value} (vLLM's -1, \
                     the whole vocabulary, is not supported)"
                ),
            )
        })?;
    if stream {
        return match k {
            0 => Ok(None),
            _ => Err(ApiError::invalid(
                "prompt_logprobs",
                "prompt_logprobs are not available when stream is true (0 is accepted and \
                 returns none)",
            )),
        };
    }
    let tokens = prompt_tokens
        .into_iter()
        .fold(0usize, |sum, len| sum.saturating_add(len));
    let copies_n = usize::try_from(copies).unwrap_or(usize::MAX);
    let per_token = usize::try_from(k).map_or(usize::MAX, |k| k.saturating_add(1));
    let entries = tokens.saturating_mul(copies_n).saturating_mul(per_token);
    if entries > MAX_GENERATED_LOGPROB_ENTRIES {
        return Err(ApiError::invalid(
            "prompt_logprobs",
            format!(
                "a response with prompt_logprobs holds prompt tokens × lists per prompt (n on \
                 completions, 1 on chat) × \
                 (prompt_logprobs + 1) entries, at most {MAX_GENERATED_LOGPROB_ENTRIES} (a \
                 prompt given as text counts as the context length less one); got {tokens} × \
                 {copies} × ({k} + 1) = {entries}. Lower prompt_logprobs or n, or send fewer \
                 or shorter prompts"
            ),
        ));
    }
    Ok(Some(k))
}

fn check_token_prompt(tokens: Vec<u32>, max_model_len: usize) -> Result<PromptInput, ApiError> {
    if tokens.is_empty() {
        return Err(ApiError::invalid("prompt", "prompt must not be empty"));
    }
    // The prompt must leave room for one generated token at least, as the engine checks.
    if tokens.len() >= max_model_len {
        return Err(prompt_too_long("prompt", tokens.len(), max_model_len));
    }
    Ok(PromptInput::Tokens(tokens))
}

fn check_text_prompt(text: String) -> Result<PromptInput, ApiError> {
    if text.is_empty() {
        return Err(ApiError::invalid("prompt", "prompt must not be empty"));
    }
    Ok(PromptInput::Text(text))
}

impl CompletionRequest {
    /// Validates the request against the limits and the context window.
    pub fn validate(self, max_model_len: usize) -> Result<Validated, ApiError> {
        let sampling = sampler_fields!(self).validate()?;
        let structured = parse_structured(&self.structured, &sampling)?;
        let (structured_field, structured) = match structured {
            Some(s) => (Some(s.field), Some(s.spec)),
            None => (None, None),
        };
        let n = parse_n(self.n)?;
        let stream = self.stream.unwrap_or(false);
        let best_of = parse_best_of(self.best_of, n, stream, self.use_beam_search == Some(true))?;
        let candidates_field = if best_of > n { BEST_OF } else { "n" };
        let truncate = parse_truncate_prompt_tokens(self.truncate_prompt_tokens, max_model_len)?;
        // Token prompts are cut before their length is checked; text ones once tokenized.
        let cut = |tokens: Vec<u32>| match truncate {
            Some(keep) => keep_last(tokens, keep),
            None => tokens,
        };
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "suffix is not supported"));
        }
        if let Some(k) = self.logprobs.filter(|&k| k > MAX_LOGPROBS) {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be in [0, {MAX_LOGPROBS}], got {k}"),
            ));
        }
        let prompts = match self.prompt {
            PromptField::Text(text) => vec![check_text_prompt(text)?],
            PromptField::Tokens(tokens) => vec![check_token_prompt(cut(tokens), max_model_len)?],
            PromptField::Texts(texts) => {
                check_prompt_count(texts.len(), best_of, candidates_field)?;
                texts
                    .into_iter()
                    .map(check_text_prompt)
                    .collect::<Result<_, _>>()?
            }
            PromptField::TokenLists(lists) => {
                check_prompt_count(lists.len(), best_of, candidates_field)?;
                lists
                    .into_iter()
                    .map(|t| check_token_prompt(cut(t), max_model_len))
                    .collect::<Result<_, _>>()?
            }
        };
        let echo = self.echo.unwrap_or(false);
        if let Some(k) = self.logprobs.filter(|_| echo) {
            check_echo_logprobs(prompts.len(), best_of, k)?;
        }
        let (limit_name, max_tokens) =
            match parse_max_tokens("max_tokens", self.max_tokens, max_model_len)? {
                Some(max) => ("max_tokens", max),
                None => (
                    "the default max_tokens",
                    u32::try_from(max_model_len).map_or(DEFAULT_COMPLETION_MAX_TOKENS, |len| {
                        len.min(DEFAULT_COMPLETION_MAX_TOKENS)
                    }),
                ),
            };
        check_min_tokens(
            sampling.min_tokens,
            Some((limit_name, max_tokens)),
            max_model_len,
        )?;
        // Candidates beyond n are ranked by their logprobs, computed whether or not asked.
        let generated_logprobs = self.logprobs.or((best_of > n).then_some(0));
        if let Some(k) = generated_logprobs.filter(|_| !stream) {
            let choices = prompts
                .len()
                .saturating_mul(usize::try_from(best_of).unwrap_or(usize::MAX));
            let param = if self.logprobs.is_some() {
                "logprobs"
            } else {
                BEST_OF
            };
            check_generated_logprobs(
                param,
                choices,
                Some(max_tokens),
                k,
                max_model_len,
                best_of > n,
            )?;
        }
        let prompt_logprobs = parse_prompt_logprobs(
            self.prompt_logprobs,
            stream,
            prompts.iter().map(|p| match p {
                PromptInput::Tokens(tokens) => tokens.len(),
                _ => max_model_len.saturating_sub(1),
            }),
            best_of,
        )?;
        let stop = parse_stop(self.stop)?;
        let beam_search = BeamFields {
            use_beam_search: self.use_beam_search,
            length_penalty: self.length_penalty,
            n,
            sampling: &sampling,
            stop: &stop,
            structured_field,
            echo_logprobs: echo && self.logprobs.is_some(),
            prompt_logprobs: prompt_logprobs.is_some(),
        }
        .parse()?;
        Ok(Validated {
            prompts,
            sampling,
            stop,
            beam_search,
            n,
            best_of,
            truncate_prompt_tokens: truncate,
            max_tokens: Some(max_tokens),
            max_tokens_defaulted: self.max_tokens.is_none(),
            max_tokens_field: "max_tokens",
            logprobs: self.logprobs,
            prompt_logprobs,
            echo,
            stream,
            include_usage: stream_usage(stream, &self.stream_options)?,
            continuous_usage: continuous_usage(&self.stream_options),
            priority: self.priority,
            structured,
            structured_field,
            tool_calls: None,
            cache_salt: parse_cache_salt(self.cache_salt)?,
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            return_tokens_as_token_ids: self.return_tokens_as_token_ids.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            keep_special_tokens: KeptTokens::default(),
        })
    }
}

/// Bounds a list of `count` prompts, each generating `n` candidates (the request's `field`:
/// `n`, or `best_of` when more).
fn check_prompt_count(count: usize, n: u32, field: &str) -> Result<(), ApiError> {
    if count == 0 {
        return Err(ApiError::invalid("prompt", "prompt must not be empty"));
    }
    if count > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!("a request may have at most {MAX_PROMPTS} prompts, got {count}"),
        ));
    }
    // With at most MAX_PROMPTS prompts, only `n` above 1 can pass the bound on choices.
    let choices = count.saturating_mul(usize::try_from(n).unwrap_or(usize::MAX));
    if choices > MAX_CHOICES {
        return Err(ApiError::invalid(
            field,
            format!(
                "a request may have at most {MAX_CHOICES} choices (prompts × {field}), got \
                 {count} prompts × {field} {n} = {choices}"
            ),
        ));
    }
    Ok(())
}

fn stream_usage(stream: bool, options: &Option<StreamOptions>) -> Result<bool, ApiError> {
    match options {
        Some(_) if !stream => Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed when stream is true",
        )),
        options => Ok(options.as_ref().is_some_and(|o| o.include_usage)),
    }
}

/// vLLM's reading: `continuous_usage_stats` counts only together with `include_usage`.
fn continuous_usage(options: &Option<StreamOptions>) -> bool {
    options
        .as_ref()
        .is_some_and(|o| o.include_usage && o.continuous_usage_stats)
}

impl ChatRequest {
    /// Validates the request against the limits and the context window; tools are offered,
    /// and calls in the conversation written, as `tools` says.
    pub fn validate(self, max_model_len: usize, tools: ToolSetup) -> Result<Validated, ApiError> {
        let setup = tools;
        self.extras.validate()?;
        let sampling = sampler_fields!(self).validate()?;
        let (mut structured_field, mut structured) =
            match parse_structured(&self.structured, &sampling)? {
                Some(s) => (Some(s.field), Some(s.spec)),
                None => (None, None),
            };
        let n = parse_n(self.n)?;
        let tools = ToolUse::parse(
            self.tools.as_ref(),
            self.tool_choice.as_ref(),
            self.parallel_tool_calls,
            setup,
        )?
        .filter(ToolUse::active);
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (_, Some(k)) if k > MAX_LOGPROBS => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}"),
                ))
            }
            // vLLM refuses only alternatives asked without logprobs; 0 asks for none.
            (false, Some(k)) if k > 0 => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "top_logprobs requires logprobs to be true",
                ))
            }
            (true, k) => Some(k.unwrap_or(0)),
            (false, _) => None,
        };
        let ending = chat_ending(self.add_generation_prompt, self.continue_final_message)?;
        refuse_unsupported(
            "echo",
            self.echo == Some(true),
            "= true on chat completions",
        )?;
        let mut messages = parse_messages(self.messages, setup)?;
        check_continued(&messages, ending)?;
        let mut template_kwargs = parse_template_kwargs(self.chat_template_kwargs)?;
        let client_kwargs = template_kwargs.keys().cloned().collect();
        offer_tools(tools.as_ref(), setup, &mut messages, &mut template_kwargs)?;
        if let Some(tools) = &tools {
            if structured.is_some() {
                return Err(ApiError::invalid(
                    "tools",
                    "tools cannot be combined with structured output (response_format and \
                     the like) unless tool_choice is \"none\"",
                ));
            }
            if sampling.ignore_eos {
                return Err(ApiError::invalid(
                    "ignore_eos",
                    "ignore_eos cannot be combined with tools",
                ));
            }
            if let Some(grammar) = tools.grammar() {
                structured = Some(StructuredOutputSpec::ToolCalls(grammar.to_owned()));
                structured_field = Some("tools");
            }
        }
        let (limit_name, max_tokens) = match self.max_completion_tokens {
            Some(v) => (
                "max_completion_tokens",
                parse_max_tokens("max_completion_tokens", Some(v), max_model_len)?,
            ),
            None => (
                "max_tokens",
                parse_max_tokens("max_tokens", self.max_tokens, max_model_len)?,
            ),
        };
        check_min_tokens(
            sampling.min_tokens,
            max_tokens.map(|max| (limit_name, max)),
            max_model_len,
        )?;
        let stream = self.stream.unwrap_or(false);
        if let Some(k) = logprobs.filter(|_| !stream) {
            let choices = usize::try_from(n).unwrap_or(usize::MAX);
            check_generated_logprobs("logprobs", choices, max_tokens, k, max_model_len, false)?;
        }
        // One list at the response's top level (vLLM's place), whatever `n`.
        let prompt_logprobs = parse_prompt_logprobs(
            self.prompt_logprobs,
            stream,
            [max_model_len.saturating_sub(1)],
            1,
        )?;
        let stop = parse_stop(self.stop)?;
        let beam_search = BeamFields {
            use_beam_search: self.use_beam_search,
            length_penalty: self.length_penalty,
            n,
            sampling: &sampling,
            stop: &stop,
            // Tools without a grammar (`tool_choice: "none"`) still ask for tool calls read
            // back from the text: refused too.
            structured_field: structured_field.or(tools.as_ref().map(|_| "tools")),
            echo_logprobs: false,
            prompt_logprobs: prompt_logprobs.is_some(),
        }
        .parse()?;
        Ok(Validated {
            prompts: vec![PromptInput::Chat {
                messages,
                template_kwargs,
                client_kwargs,
                ending,
            }],
            sampling,
            stop,
            beam_search,
            n,
            best_of: n,
            truncate_prompt_tokens: parse_truncate_prompt_tokens(
                self.truncate_prompt_tokens,
                max_model_len,
            )?,
            max_tokens,
            max_tokens_defaulted: false,
            max_tokens_field: limit_name,
            logprobs,
            prompt_logprobs,
            echo: false,
            stream,
            include_usage: stream_usage(stream, &self.stream_options)?,
            continuous_usage: continuous_usage(&self.stream_options),
            priority: self.priority,
            structured,
            structured_field,
            tool_calls: tools.as_ref().and_then(ToolUse::answer),
            cache_salt: parse_cache_salt(self.cache_salt)?,
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            return_tokens_as_token_ids: self.return_tokens_as_token_ids.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            // A marker that is a special token must reach the tool reader (vLLM turns
            // skipping off altogether for Mistral's tool parser; only the marker is kept here,
            // so that an end-of-sequence text is not taken for content).
            keep_special_tokens: tools
                .as_ref()
                .map(ToolUse::kept_special_tokens)
                .unwrap_or_default(),
        })
    }
}

/// Writes the callable tools into a chat prompt: into the chat template's `tools` variable
/// (`setup.template`; `none` when no tool may be called, as Hugging Face and vLLM define it),
/// or as the server's text in the model's format (Hermes: at the end of the system message;
/// Llama 3: at the head of the first user message).
pub fn offer_tools(
    tools: Option<&ToolUse>,
    setup: ToolSetup,
    messages: &mut Vec<ChatMessage>,
    template_kwargs: &mut TemplateKwargs,
) -> Result<(), ApiError> {
    let tools = tools.filter(|t| t.active());
    if !setup.template {
        // As transformers and vLLM render: `tools` is defined, as none, where the template is
        // not given tools (a client may set it through chat_template_kwargs).
        template_kwargs
            .entry("tools")
            .or_insert(serde_json::Value::Null);
    }
    if setup.template {
        match tools {
            Some(_) if template_kwargs.contains_key("tools") => {
                return Err(ApiError::invalid(
                    "chat_template_kwargs",
                    "\"tools\" is set by the server from the request's tools",
                ))
            }
            Some(tools) => {
                let list = serde_json::Value::Array(tools.template_tools());
                template_kwargs.insert("tools".into(), list);
            }
            None => {
                template_kwargs
                    .entry("tools")
                    .or_insert(serde_json::Value::Null);
            }
        }
        return Ok(());
    }
    match tools.and_then(ToolUse::prompt_marked) {
        Some((ToolPrompt::System(text), server)) => add_to_system(messages, &text, &server),
        Some((ToolPrompt::FirstUser(text), server)) => add_to_first_user(messages, &text, &server),
        None => {}
    }
    Ok(())
}

/// Appends `text` to the conversation's first system (or developer) message, or puts a system
/// message holding it first.
fn add_to_system(messages: &mut Vec<ChatMessage>, text: &str, server: &[Range<usize>]) {
    match messages.first_mut() {
        Some(m) if matches!(m.role, ChatRole::System | ChatRole::Developer) => {
            if !m.content.is_empty() {
                m.content.push_str("\n\n");
            }
            m.push_marked(text, server);
        }
        _ => {
            let mut m = ChatMessage::text(ChatRole::System, "");
            m.push_marked(text, server);
            messages.insert(0, m);
        }
    }
}

/// Validates `chat_template_kwargs`: an object of at most [`MAX_TEMPLATE_KWARGS`] entries, none
/// named as a variable the server sets itself; `tools`, which a chat template writes into the
/// prompt as it would the request's `tools`, meets `tools`' bounds
/// ([`super::tools::check_template_tools`]).
pub fn parse_template_kwargs(v: Option<serde_json::Value>) -> Result<TemplateKwargs, ApiError> {
    const PARAM: &str = "chat_template_kwargs";
    let map = match v {
        None | Some(serde_json::Value::Null) => return Ok(TemplateKwargs::new()),
        Some(serde_json::Value::Object(map)) => map,
        Some(_) => {
            return Err(ApiError::invalid(
                PARAM,
                "chat_template_kwargs is an object",
            ))
        }
    };
    if map.len() > MAX_TEMPLATE_KWARGS {
        return Err(ApiError::invalid(
            PARAM,
            format!("at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs are allowed"),
        ));
    }
    for name in map.keys() {
        if name.is_empty() || name.len() > MAX_TEMPLATE_KWARG_NAME {
            return Err(ApiError::invalid(
                PARAM,
                format!("a chat_template_kwargs name is 1 to {MAX_TEMPLATE_KWARG_NAME} bytes"),
            ));
        }
        if [
            "messages",
            "add_generation_prompt",
            "bos_token",
            "eos_token",
        ]
        .contains(&name.as_str())
        {
            return Err(ApiError::invalid(
                PARAM,
                format!("{name:?} is set by the server, not by chat_template_kwargs"),
            ));
        }
    }
    if let Some(tools) = map.get("tools") {
        super::tools::check_template_tools("chat_template_kwargs.tools", tools)?;
    }
    Ok(map)
}

/// Puts `text` at the head of the conversation's first user message; with none, it goes to
/// the system message.
fn add_to_first_user(messages: &mut Vec<ChatMessage>, text: &str, server: &[Range<usize>]) {
    match messages.iter_mut().find(|m| m.role == ChatRole::User) {
        Some(m) => m.prepend_marked(text, server),
        None => {
            let text = text.trim_end();
            let server: Vec<Range<usize>> = server
                .iter()
                .map(|r| r.start.min(text.len())..r.end.min(text.len()))
                .filter(|r| !r.is_empty())
                .collect();
            add_to_system(messages, text, &server)
        }
    }
}

/// Reads `messages`: roles, text, and the conversation's tool calls and results, which the
/// chat template receives as fields (`setup.template`: `tool_calls` with each call's
/// arguments an object, `tool_call_id`, `name`) or the server writes as text in the model's
/// format (Hermes: results join a user turn; Llama 3: each is a `tool` message).
///
/// A `developer` message is a `system` message, as OpenAI reads it for models without a
/// developer role: chat templates know `system` (and fold it into the first user turn where
/// they have no system role) but would write `developer` as a foreign turn, or refuse it.
/// The route cannot see the template, so the mapping is unconditional.
pub fn parse_messages(
    messages: Vec<MessageField>,
    setup: ToolSetup,
) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(
            "messages",
            format!("at most {MAX_MESSAGES} messages are allowed"),
        ));
    }
    check_conversation(&messages)?;
    if setup.template {
        return messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| template_message(i, m, setup.format))
            .collect();
    }
    let tool_format = setup.format;
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    // Whether the last message of `out` holds tool results (consecutive ones share a turn).
    let mut in_results = false;
    for (i, m) in messages.into_iter().enumerate() {
        let content = message_text(i, m.role == "assistant", m.content)?;
        let role = match m.role.as_str() {
            "tool" if tool_format == ToolFormat::Llama3Json => ChatRole::Tool,
            "tool" => {
                let id = call_id_field(i, m.tool_call_id)?;
                let (result, server) = render_result_marked(tool_format, &content, id.as_deref());
                match out.last_mut() {
                    // Results join the user turn before them (earlier results, or a user
                    // message), so roles still alternate for templates that insist.
                    Some(last) if in_results || last.role == ChatRole::User => {
                        if !last.content.is_empty() {
                            last.content.push('\n');
                        }
                        last.push_marked(&result, &server);
                    }
                    _ => {
                        let mut m = ChatMessage::text(ChatRole::User, "");
                        m.push_marked(&result, &server);
                        out.push(m);
                    }
                }
                in_results = true;
                continue;
            }
            other => chat_role(i, other)?,
        };
        let after_results = std::mem::take(&mut in_results);
        let content = match m.tool_calls {
            None | Some(serde_json::Value::Null) => content,
            Some(serde_json::Value::Array(calls)) if role == ChatRole::Assistant => {
                let calls =
                    render_calls(&format!("messages[{i}].tool_calls"), &calls, tool_format)?;
                match (content.is_empty(), calls.is_empty(), tool_format) {
                    (_, true, _) => content,
                    // A Llama 3 call is the whole answer: as Meta's template renders such a
                    // turn, its text is left out (and Mistral's templates leave it out).
                    (true, false, _)
                    | (false, false, ToolFormat::Llama3Json | ToolFormat::Mistral) => calls,
                    (false, false, ToolFormat::Hermes) => format!("{content}\n{calls}"),
                    // Mistral v11's templates write the text, then the calls.
                    (false, false, ToolFormat::MistralV11) => format!("{content}{calls}"),
                }
            }
            Some(_) => return Err(calls_not_a_list(i)),
        };
        match out.last_mut() {
            // A user message after tool results joins their turn.
            Some(last) if after_results && role == ChatRole::User => {
                last.content.push('\n');
                last.content.push_str(&content);
            }
            _ => out.push(ChatMessage::text(role, content)),
        }
    }
    Ok(out)
}

/// A message's role; `tool` is read by the caller.
fn chat_role(i: usize, role: &str) -> Result<ChatRole, ApiError> {
    Ok(match role {
        "system" | "developer" => ChatRole::System,
        "user" => ChatRole::User,
        "assistant" => ChatRole::Assistant,
        "tool" => ChatRole::Tool,
        other => {
            let shown: String = other.chars().take(64).collect();
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!("role {shown:?} is not supported"),
            ));
        }
    })
}

fn calls_not_a_list(i: usize) -> ApiError {
    ApiError::invalid(
        format!("messages[{i}].tool_calls"),
        "tool_calls is a list, on assistant messages only",
    )
}

/// An optional string field of message `i`, at most [`MAX_TOOL_CALL_ID`] bytes.
fn short_field(i: usize, field: &str, v: Option<String>) -> Result<Option<String>, ApiError> {
    match v {
        Some(s) if s.len() > MAX_TOOL_CALL_ID => Err(ApiError::invalid(
            format!("messages[{i}].{field}"),
            format!("{field} is at most {MAX_TOOL_CALL_ID} bytes"),
        )),
        v => Ok(v),
    }
}

/// A `tool` message's `tool_call_id`: at most [`MAX_TOOL_CALL_ID`] bytes, an empty one none.
fn call_id_field(i: usize, v: Option<String>) -> Result<Option<String>, ApiError> {
    Ok(short_field(i, "tool_call_id", v)?.filter(|id| !id.is_empty()))
}

/// Message `i` as the chat template reads it: calls and results stay fields of their
/// messages (Hugging Face's and vLLM's shape).
fn template_message(
    i: usize,
    m: MessageField,
    format: ToolFormat,
) -> Result<ChatMessage, ApiError> {
    let role = chat_role(i, &m.role)?;
    let content = message_text(i, role == ChatRole::Assistant, m.content)?;
    let tool_calls = match m.tool_calls {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::Array(calls)) if role == ChatRole::Assistant => {
            template_calls(&format!("messages[{i}].tool_calls"), &calls, format)?
        }
        Some(_) => return Err(calls_not_a_list(i)),
    };
    let tool_call_id = match role {
        ChatRole::Tool => call_id_field(i, m.tool_call_id)?.map(|id| template_call_id(&id, format)),
        _ => None,
    };
    Ok(ChatMessage {
        role,
        content,
        tool_calls,
        tool_call_id,
        name: short_field(i, "name", m.name)?,
        server_text: Vec::new(),
    })
}

/// The 400 of content part `j` of message `i`, of type `field`, without its `field`.
fn part_without(i: usize, j: usize, field: &str) -> ApiError {
    ApiError::invalid(
        format!("messages[{i}].content[{j}].{field}"),
        format!("a `{field}` content part needs `{field}`, a string; it is missing"),
    )
}

/// A message's text: its string, or its text parts joined with newlines. An assistant's
/// `refusal` parts are its text, as OpenAI reads a refusal in the history.
fn message_text(
    i: usize,
    assistant: bool,
    content: Option<ContentField>,
) -> Result<String, ApiError> {
    Ok(match content {
        None => String::new(),
        Some(ContentField::Text(text)) => text,
        Some(ContentField::Parts(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.into_iter().enumerate() {
                match (part.kind.as_str(), part.text, part.refusal) {
                    ("text", Some(text), _) => texts.push(text),
                    ("refusal", _, Some(refusal)) if assistant => texts.push(refusal),
                    // A part of a supported type without its text: the field is missing.
                    ("text", None, _) => return Err(part_without(i, j, "text")),
                    ("refusal", _, None) if assistant => return Err(part_without(i, j, "refusal")),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}]"),
                            if assistant {
                                "only text and refusal content parts are supported"
                            } else {
                                "only text content parts are supported"
                            },
                        ))
                    }
                }
            }
            texts.join("\n")
        }
    })
}

/// OpenAI's checks of a conversation: a system, developer or user message has content (not
/// null, not an empty list of parts), and a `tool` message names, in `tool_call_id`, a call
/// of an earlier assistant message. An assistant message may have no content (its calls are
/// its answer).
fn check_conversation(messages: &[MessageField]) -> Result<(), ApiError> {
    let mut call_ids: HashSet<&str> = HashSet::new();
    for (i, m) in messages.iter().enumerate() {
        match m.role.as_str() {
            "system" | "developer" | "user" => match &m.content {
                None => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].content"),
                        format!("a {} message needs content", m.role),
                    ))
                }
                Some(ContentField::Parts(parts)) if parts.is_empty() => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].content"),
                        format!("the content of a {} message must not be empty", m.role),
                    ))
                }
                Some(_) => {}
            },
            "assistant" => {
                if let Some(serde_json::Value::Array(calls)) = &m.tool_calls {
                    call_ids.extend(
                        calls
                            .iter()
                            .filter_map(|c| c.get("id").and_then(serde_json::Value::as_str)),
                    );
                }
            }
            "tool" => {
                let param = || format!("messages[{i}].tool_call_id");
                let Some(id) = m.tool_call_id.as_deref().filter(|id| !id.is_empty()) else {
                    return Err(ApiError::invalid(
                        param(),
                        "a tool message needs the tool_call_id of the call it answers",
                    ));
                };
                if !call_ids.contains(id) {
                    let shown: String = id.chars().take(64).collect();
                    return Err(ApiError::invalid(
                        param(),
                        format!(
                            "tool_call_id {shown:?} answers no tool call of an earlier \
                             assistant message"
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(json: serde_json::Value) -> Result<Validated, ApiError> {
        let req: CompletionRequest = serde_json::from_value(json).unwrap();
        req.validate(128)
    }

    /// A chat template's variables without tools: `tools` is none, as transformers has it.
    fn without_tools() -> TemplateKwargs {
        let mut kwargs = TemplateKwargs::new();
        kwargs.insert("tools".into(), serde_json::Value::Null);
        kwargs
    }

    fn param_of(result: Result<Validated, ApiError>) -> Option<String> {
        match result {
            Err(ApiError::InvalidRequest { param, .. }) => param,
            Err(ApiError::Engine(e)) => e.param,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_openai_defaults() {
        let v = completion(serde_json::json!({"prompt": "hi"})).unwrap();
        assert_eq!(v.n, 1);
        assert_eq!(v.sampling, SamplingOptions::default());
        assert!(!v.stream && !v.echo && !v.include_usage);
        assert_eq!(v.prompts, vec![PromptInput::Text("hi".into())]);
        // Completions stop at 16 tokens by default (OpenAI, vLLM); chat runs to the context.
        assert_eq!(v.max_tokens, Some(DEFAULT_COMPLETION_MAX_TOKENS));
        let v = completion(serde_json::json!({"prompt": "hi", "max_tokens": 100})).unwrap();
        assert_eq!(v.max_tokens, Some(100));
        let chat: ChatRequest = serde_json::from_value(
            serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .unwrap();
        assert_eq!(
            chat.validate(128, ToolFormat::Hermes.into())
                .unwrap()
                .max_tokens,
            None
        );
    }

    #[test]
    fn min_tokens_above_max_tokens_is_refused_before_generation() {
        let chat = |extra: serde_json::Value| {
            let mut json = serde_json::json!({"messages": [{"role": "user", "content": "x"}]});
            if let (Some(body), Some(extra)) = (json.as_object_mut(), extra.as_object()) {
                body.extend(extra.clone());
            }
            let req: ChatRequest = serde_json::from_value(json).unwrap();
            req.validate(128, ToolFormat::Hermes.into())
        };
        let refused = [
            completion(serde_json::json!({"prompt": "x", "max_tokens": 4, "min_tokens": 5})),
            completion(serde_json::json!({"prompt": "x", "min_tokens": 17, "stream": true})),
            chat(serde_json::json!({"max_tokens": 4, "min_tokens": 5})),
            chat(serde_json::json!({"max_tokens": 9, "max_completion_tokens": 4, "min_tokens": 5})),
            chat(serde_json::json!({"min_tokens": 128})),
        ];
        for result in refused {
            assert_eq!(param_of(result).as_deref(), Some("min_tokens"));
        }
        let accepted = [
            completion(serde_json::json!({"prompt": "x", "max_tokens": 4, "min_tokens": 4})),
            completion(serde_json::json!({"prompt": "x", "min_tokens": 16})),
            chat(serde_json::json!({"max_completion_tokens": 9, "max_tokens": 4, "min_tokens": 5})),
            chat(serde_json::json!({"min_tokens": 127})),
        ];
        for result in accepted {
            assert!(result.is_ok(), "{result:?}");
        }
    }

    /// A field of several accepted shapes (serde's untagged enums) that matches none says
    /// what it accepts, with its field, and names no type of the server's.
    #[test]
    fn fields_of_several_shapes_say_what_they_accept() {
        let refused = |body: &str, chat: bool| {
            let result = if chat {
                crate::body::parse_json::<ChatRequest>(body.as_bytes()).map(drop)
            } else {
                crate::body::parse_json::<CompletionRequest>(body.as_bytes()).map(drop)
            };
            match result {
                Err(ApiError::InvalidRequest { message, param }) => {
                    assert!(
                        !message.contains("untagged") && !message.contains("Field"),
                        "{message}"
                    );
                    (message, param.unwrap_or_default())
                }
                other => panic!("{body}: {other:?}"),
            }
        };
        for prompt in ["5", "[[\"a\"]]", "[-1]", "{\"a\": 1}"] {
            let (message, param) = refused(&format!("{{\"prompt\": {prompt}}}"), false);
            assert_eq!(param, "prompt");
            assert!(
                message.contains(
                    "`prompt` must be a string, an array of strings, an array of token ids \
                     (integers from 0) or an array of arrays of token ids"
                ),
                "{message}"
            );
        }
        let (message, param) = refused(r#"{"prompt": "x", "stop": 5}"#, false);
        assert_eq!(param, "stop");
        assert!(
            message.contains("`stop` must be a string or an array of strings"),
            "{message}"
        );
        let (message, param) = refused(
            r#"{"messages": [{"role": "user", "content": "a"}], "stop": [1]}"#,
            true,
        );
        assert_eq!(param, "stop");
        assert!(message.contains("`stop` must be"), "{message}");
        let (message, param) = refused(r#"{"messages": [{"role": "user", "content": 5}]}"#, true);
        assert_eq!(param, "messages[0].content");
        assert!(
            message.contains("`content` must be a string or an array of content parts"),
            "{message}"
        );
    }

    /// The limits on prompts and choices say which one was passed, and name its field.
    #[test]
    fn the_prompt_and_choice_limits_name_the_one_passed() {
        let refused = |json: serde_json::Value| match completion(json) {
            Err(ApiError::InvalidRequest { message, param }) => (message, param.unwrap()),
            other => panic!("{other:?}"),
        };
        let (message, param) = refused(serde_json::json!({"prompt": vec!["x"; MAX_PROMPTS + 1]}));
        assert_eq!(param, "prompt");
        assert_eq!(message, "a request may have at most 32 prompts, got 33");
        let (message, param) = refused(serde_json::json!({"prompt": vec!["x"; 5], "n": 16}));
        assert_eq!(param, "n");
        assert_eq!(
            message,
            "a request may have at most 64 choices (prompts × n), got 5 prompts × n 16 = 80"
        );
        assert!(completion(serde_json::json!({"prompt": vec!["x"; 4], "n": 16})).is_ok());
    }

    /// A content part of type `text` without its `text` is told the field is missing, not
    /// that the type is unsupported (and an assistant's `refusal` part likewise).
    #[test]
    fn a_text_part_without_text_names_the_missing_field() {
        let refused = |messages: serde_json::Value| match chat_at(
            128,
            serde_json::json!({ "messages": messages }),
        ) {
            Err(ApiError::InvalidRequest { message, param }) => (message, param.unwrap()),
            other => panic!("{other:?}"),
        };
        let (message, param) =
            refused(serde_json::json!([{"role": "user", "content": [{"type": "text"}]}]));
        assert_eq!(param, "messages[0].content[0].text");
        assert_eq!(
            message,
            "a `text` content part needs `text`, a string; it is missing"
        );
        let (message, param) = refused(serde_json::json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "refusal"}]},
        ]));
        assert_eq!(param, "messages[1].content[1].refusal");
        assert!(message.contains("`refusal`"), "{message}");
        // Other types are still unsupported, as they were.
        let (message, param) = refused(serde_json::json!([
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        ]));
        assert_eq!(param, "messages[0].content[0]");
        assert_eq!(message, "only text content parts are supported");
    }

    #[test]
    fn echo_with_logprobs_is_bounded_per_prompt_position() {
        let prompts = |count: usize| serde_json::json!(vec!["x"; count]);
        let refused = [
            serde_json::json!({"prompt": ["a", "b"], "echo": true, "logprobs": 20}),
            serde_json::json!({"prompt": "x", "n": 16, "echo": true, "logprobs": 1}),
            serde_json::json!({"prompt": prompts(MAX_ECHO_LOGPROB_ENTRIES + 1), "echo": true,
                "logprobs": 0}),
        ];
        for json in refused {
            assert_eq!(
                param_of(completion(json.clone())).as_deref(),
                Some("echo"),
                "{json}"
            );
        }
        let accepted = [
            // Scoring one prompt with every alternative.
            serde_json::json!({"prompt": "x", "echo": true, "logprobs": MAX_LOGPROBS}),
            serde_json::json!({"prompt": [1, 2], "n": 16, "echo": true, "logprobs": 0}),
            serde_json::json!({"prompt": ["a", "b"], "n": 2, "echo": true, "logprobs": 4}),
            serde_json::json!({"prompt": prompts(MAX_ECHO_LOGPROB_ENTRIES), "echo": true,
                "logprobs": 0}),
            // Either alone is unbounded by this.
            serde_json::json!({"prompt": prompts(MAX_PROMPTS), "echo": true}),
            serde_json::json!({"prompt": ["a", "b"], "n": 16, "logprobs": MAX_LOGPROBS}),
        ];
        for json in accepted {
            assert!(completion(json.clone()).is_ok(), "{json}");
        }
    }

    #[test]
    fn prompt_shapes_are_all_accepted() {
        let v = completion(serde_json::json!({"prompt": ["a", "b"]})).unwrap();
        assert_eq!(v.prompts.len(), 2);
        let v = completion(serde_json::json!({"prompt": [1, 2, 3]})).unwrap();
        assert_eq!(v.prompts, vec![PromptInput::Tokens(vec![1, 2, 3])]);
        let v = completion(serde_json::json!({"prompt": [[1], [2, 3]]})).unwrap();
        assert_eq!(v.prompts[1], PromptInput::Tokens(vec![2, 3]));
    }

    #[test]
    fn out_of_range_fields_name_their_param() {
        let cases = [
            (
                serde_json::json!({"prompt": "x", "temperature": 2.5}),
                "temperature",
            ),
            (serde_json::json!({"prompt": "x", "top_p": 0.0}), "top_p"),
            (serde_json::json!({"prompt": "x", "top_k": -2}), "top_k"),
            (serde_json::json!({"prompt": "x", "n": 17}), "n"),
            (serde_json::json!({"prompt": "x", "n": 0}), "n"),
            (
                serde_json::json!({"prompt": "x", "logprobs": 21}),
                "logprobs",
            ),
            (
                serde_json::json!({"prompt": "x", "max_tokens": 0}),
                "max_tokens",
            ),
            (
                serde_json::json!({"prompt": "x", "max_tokens": 129}),
                "max_tokens",
            ),
            (
                serde_json::json!({"prompt": "x", "stop": ["a","b","c","d","e"]}),
                "stop",
            ),
            (serde_json::json!({"prompt": "x", "stop": [""]}), "stop"),
            (
                serde_json::json!({"prompt": "x", "logit_bias": {"abc": 1}}),
                "logit_bias",
            ),
            (
                serde_json::json!({"prompt": "x", "logit_bias": {"5": 101}}),
                "logit_bias",
            ),
            (
                serde_json::json!({"prompt": "x", "logit_bias": {"5": 100, "05": 100}}),
                "logit_bias",
            ),
            (
                serde_json::json!({"prompt": "x", "cache_salt": ""}),
                "cache_salt",
            ),
            (
                serde_json::json!({"prompt": "x", "cache_salt": "s".repeat(257)}),
                "cache_salt",
            ),
            (serde_json::json!({"prompt": ""}), "prompt"),
            (serde_json::json!({"prompt": []}), "prompt"),
            (serde_json::json!({"prompt": vec![1u32; 129]}), "prompt"),
            (
                serde_json::json!({"prompt": "x", "n": 2, "best_of": 1}),
                "best_of",
            ),
            (serde_json::json!({"prompt": "x", "best_of": 17}), "best_of"),
            (
                serde_json::json!({"prompt": "x", "best_of": 2, "stream": true}),
                "best_of",
            ),
            (
                serde_json::json!({"prompt": "x", "best_of": 2, "use_beam_search": true}),
                "best_of",
            ),
            (
                serde_json::json!({"prompt": ["a", "b", "c", "d", "e"], "best_of": 16}),
                "best_of",
            ),
            (
                serde_json::json!({"prompt": "x", "truncate_prompt_tokens": 0}),
                "truncate_prompt_tokens",
            ),
            (
                serde_json::json!({"prompt": "x", "stream_options": {"include_usage": true}}),
                "stream_options",
            ),
        ];
        for (json, param) in cases {
            assert_eq!(
                param_of(completion(json.clone())).as_deref(),
                Some(param),
                "{json}"
            );
        }
    }

    #[test]
    fn chat_template_kwargs_reach_the_prompt_bounded() {
        let chat = |kwargs: serde_json::Value| {
            let req: ChatRequest = serde_json::from_value(serde_json::json!({
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": kwargs}))
            .unwrap();
            req.validate(128, ToolFormat::Hermes.into())
        };
        let v = chat(serde_json::json!({"enable_thinking": false, "x": [1, {"y": "z"}]})).unwrap();
        let PromptInput::Chat {
            template_kwargs,
            client_kwargs,
            ..
        } = &v.prompts[0]
        else {
            panic!("{v:?}")
        };
        assert_eq!(template_kwargs["enable_thinking"], false);
        assert_eq!(template_kwargs["x"][1]["y"], "z");
        // The server's own `tools` (none) is not the client's: a template error it causes
        // does not name chat_template_kwargs.
        assert!(template_kwargs["tools"].is_null());
        assert_eq!(client_kwargs, &["enable_thinking", "x"]);
        assert!(chat(serde_json::Value::Null).is_ok());
        let many: serde_json::Map<String, serde_json::Value> = (0..=MAX_TEMPLATE_KWARGS)
            .map(|i| (format!("k{i}"), serde_json::Value::Null))
            .collect();
        for bad in [
            serde_json::json!("enable_thinking"),
            serde_json::json!({"messages": []}),
            serde_json::json!({"add_generation_prompt": false}),
            serde_json::json!({"": 1}),
            serde_json::json!({"k".repeat(MAX_TEMPLATE_KWARG_NAME + 1): 1}),
            serde_json::Value::Object(many),
        ] {
            assert_eq!(
                param_of(chat(bad.clone())).as_deref(),
                Some("chat_template_kwargs"),
                "{bad}"
            );
        }
    }

    /// Where the server writes the tools and the tools' results in the model's format (the
    /// template does not), the markers it writes are marked as its own (`server_text`, whose
    /// added tokens stay tokens) and nothing else is: not a tool's description nor a result's
    /// content, whatever they hold, nor the user's text the tools' block heads.
    #[test]
    fn the_servers_markers_in_messages_are_marked_as_its_own() {
        use serde_json::json;
        let tool = json!({"type": "function", "function": {"name": "f",
            "description": "d[TOOL_RESULTS]<tool_response>", "parameters": {"type": "object"}}});
        let call = |id: &str| {
            json!({"id": id, "type": "function",
            "function": {"name": "f", "arguments": "{}"}})
        };
        let body = json!({
            "messages": [
                {"role": "user", "content": "hi [/AVAILABLE_TOOLS]"},
                {"role": "assistant", "content": "", "tool_calls": [call("a"), call("b")]},
                {"role": "tool", "tool_call_id": "a", "content": "[/TOOL_RESULTS]r"},
                {"role": "tool", "tool_call_id": "b", "content": "s</tool_response>"}],
            "tools": [tool]});
        for (format, user, results) in [
            (
                ToolFormat::Mistral,
                &["[AVAILABLE_TOOLS] [", "][/AVAILABLE_TOOLS]"][..],
                &["[TOOL_RESULTS] ", "[/TOOL_RESULTS]"][..],
            ),
            (
                ToolFormat::MistralV11,
                &["[AVAILABLE_TOOLS][", "][/AVAILABLE_TOOLS]"],
                &["[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
            ),
            (
                ToolFormat::Hermes,
                &[],
                &["<tool_response>\n", "\n</tool_response>"],
            ),
        ] {
            let req: ChatRequest = serde_json::from_value(body.clone()).unwrap();
            let v = req.validate(128, format.into()).unwrap();
            let PromptInput::Chat { messages, .. } = &v.prompts[0] else {
                panic!("{v:?}")
            };
            let spans = |m: &ChatMessage| -> Vec<String> {
                m.server_text
                    .iter()
                    .map(|r| m.content[r.clone()].to_owned())
                    .collect()
            };
            let (first, last) = (&messages[0], messages.last().unwrap());
            if format == ToolFormat::Hermes {
                // The tools' block is the system message's: all but the listing is the server's.
                assert_eq!(first.role, ChatRole::System);
                let s = spans(first);
                assert_eq!(s.len(), 2, "{s:?}");
                assert!(
                    s[0].ends_with("<tools>\n") && s[1].starts_with("</tools>"),
                    "{s:?}"
                );
                assert!(
                    !first.content[first.server_text[0].end..first.server_text[1].start].is_empty()
                );
                assert!(spans(&messages[1]).is_empty());
            } else {
                assert_eq!(first.role, ChatRole::User);
                let s = spans(first);
                assert_eq!(s.len(), 2, "{s:?}");
                assert!(s[0] == user[0] && s[1].starts_with(user[1]), "{s:?}");
                assert!(first.content.ends_with("hi [/AVAILABLE_TOOLS]"));
                assert!(
                    first.server_text.last().unwrap().end <= first.content.find("hi [").unwrap()
                );
            }
            for s in spans(first) {
                assert!(
                    !s.contains("d[TOOL") && !s.contains(r#""parameters""#),
                    "{s:?}"
                );
            }
            // Both results, one turn: each one's markers, shifted to where it stands.
            assert_eq!(last.role, ChatRole::User);
            let want: Vec<&str> = results.iter().chain(results).copied().collect();
            assert_eq!(spans(last), want, "{format:?}: {:?}", last.content);
        }
    }

    /// Tools handed to the chat template through `chat_template_kwargs` (no top-level `tools`)
    /// meet the bounds of `tools`: count, names, schemas' size, strict schemas' depth.
    #[test]
    fn chat_template_kwargs_tools_meet_the_bounds_of_tools() {
        use serde_json::json;
        let chat = |tools: serde_json::Value| {
            let req: ChatRequest = serde_json::from_value(json!({
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"tools": tools}}))
            .unwrap();
            req.validate(128, ToolFormat::Hermes.into())
        };
        let tool = |name: &str| json!({"type": "function", "function": {"name": name}});
        let v = chat(json!([tool("f"), tool("g")])).unwrap();
        let PromptInput::Chat {
            template_kwargs, ..
        } = &v.prompts[0]
        else {
            panic!("{v:?}")
        };
        assert_eq!(template_kwargs["tools"][1]["function"]["name"], "g");
        assert!(chat(serde_json::Value::Null).is_ok());
        use super::super::tools::{MAX_TOOLS, MAX_TOOL_NAME};
        let many: Vec<_> = (0..=MAX_TOOLS).map(|i| tool(&format!("f{i}"))).collect();
        let mut deep = json!({"type": "object", "properties": {}, "additionalProperties": false});
        for _ in 0..=super::super::strict::MAX_STRICT_DEPTH {
            deep = json!({"type": "object", "properties": {"a": deep}, "required": ["a"],
                "additionalProperties": false});
        }
        let huge = json!({"type": "object",
            "description": "x".repeat(MAX_STRUCTURED_BYTES)});
        for (tools, param) in [
            (json!("f"), "chat_template_kwargs.tools"),
            (json!(many), "chat_template_kwargs.tools"),
            (
                json!([tool(&"f".repeat(MAX_TOOL_NAME + 1))]),
                "chat_template_kwargs.tools[0].function.name",
            ),
            (
                json!([tool("f"), tool("a b")]),
                "chat_template_kwargs.tools[1].function.name",
            ),
            (
                json!([tool("f"), tool("f")]),
                "chat_template_kwargs.tools[1].function.name",
            ),
            (
                json!([{"type": "retrieval"}]),
                "chat_template_kwargs.tools[0].type",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": huge}}]),
                "chat_template_kwargs.tools",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": deep,
                "strict": true}}]),
                "chat_template_kwargs.tools[0].function.parameters",
            ),
        ] {
            assert_eq!(
                param_of(chat(tools.clone())).as_deref(),
                Some(param),
                "{tools}"
            );
        }
    }

    #[test]
    fn chat_maps_logprobs_and_max_completion_tokens() {
        let req: ChatRequest = serde_json::from_value(serde_json::json!({
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "logprobs": true, "top_logprobs": 3, "max_tokens": 5, "max_completion_tokens": 7
        }))
        .unwrap();
        let v = req.validate(128, ToolFormat::Hermes.into()).unwrap();
        assert_eq!(v.logprobs, Some(3));
        assert_eq!(v.max_tokens, Some(7));
        assert_eq!(
            v.prompts,
            vec![PromptInput::Chat {
                messages: vec![ChatMessage::text(ChatRole::User, "hi")],
                template_kwargs: without_tools(),
                client_kwargs: Vec::new(),
                ending: ChatEnding::GenerationPrompt,
            }]
        );
    }

    #[test]
    fn tools_reach_the_system_message_and_the_output_grammar() {
        let tools = serde_json::json!([{"type": "function", "function": {"name": "now"}}]);
        let chat = |messages: serde_json::Value, choice: serde_json::Value| {
            let req: ChatRequest = serde_json::from_value(serde_json::json!({
                "messages": messages, "tools": tools, "tool_choice": choice}))
            .unwrap();
            req.validate(128, ToolFormat::Hermes.into()).unwrap()
        };
        let v = chat(
            serde_json::json!([{"role": "user", "content": "time?"}]),
            serde_json::Value::Null,
        );
        assert_eq!(v.tool_calls, Some(ToolAnswer::TextOrCalls));
        assert!(
            matches!(&v.structured, Some(StructuredOutputSpec::ToolCalls(g)) if g.contains("\\\"now\\\""))
        );
        let PromptInput::Chat { messages: m, .. } = &v.prompts[0] else {
            panic!("{v:?}")
        };
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].role, ChatRole::System);
        assert!(m[0].content.starts_with("# Tools\n"), "{}", m[0].content);
        // An existing system message gains the tools after its own text.
        let v = chat(
            serde_json::json!([{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "time?"}]),
            serde_json::json!("required"),
        );
        let PromptInput::Chat { messages: m, .. } = &v.prompts[0] else {
            panic!("{v:?}")
        };
        assert_eq!(m.len(), 2);
        assert!(
            m[0].content.starts_with("Be brief.\n\n# Tools\n"),
            "{}",
            m[0].content
        );
        // tool_choice none: no tools in the prompt, no grammar, plain content.
        let v = chat(
            serde_json::json!([{"role": "user", "content": "time?"}]),
            serde_json::json!("none"),
        );
        assert!(v.tool_calls.is_none() && v.structured.is_none());
        assert_eq!(
            v.prompts,
            vec![PromptInput::Chat {
                messages: vec![ChatMessage::text(ChatRole::User, "time?")],
                template_kwargs: without_tools(),
                client_kwargs: Vec::new(),
                ending: ChatEnding::GenerationPrompt,
            }]
        );
    }

    #[test]
    fn llama3_tools_head_the_first_user_message_and_results_are_tool_turns() {
        let tools = serde_json::json!([{"type": "function", "function": {"name": "now"}}]);
        let chat = |messages: serde_json::Value| {
            let req: ChatRequest = serde_json::from_value(serde_json::json!({
                "messages": messages, "tools": tools, "tool_choice": "required"}))
            .unwrap();
            let v = req.validate(128, ToolFormat::Llama3Json.into()).unwrap();
            match v.prompts.into_iter().next() {
                Some(PromptInput::Chat { messages, .. }) => messages,
                other => panic!("{other:?}"),
            }
        };
        let m = chat(serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "a",
                "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "12:00"},
            {"role": "user", "content": "and now?"},
        ]));
        let roles: Vec<ChatRole> = m.iter().map(|m| m.role).collect();
        use ChatRole::*;
        assert_eq!(roles, [System, User, Assistant, Tool, User]);
        assert_eq!(m[0].content, "Be brief.");
        assert!(
            m[1].content.starts_with("Given the following functions")
                && m[1].content.ends_with(
                    "Call at least one function now, the calls separated by \"; \".\n\ntime?"
                ),
            "{}",
            m[1].content
        );
        assert_eq!(m[2].content, "{\"name\": \"now\", \"parameters\": {}}");
        assert_eq!(m[3].content, "12:00");
        assert_eq!(m[4].content, "and now?");
        // No user message: the tools go to the system message.
        let m = chat(serde_json::json!([{"role": "system", "content": "Be brief."}]));
        assert!(
            m[0].content
                .starts_with("Be brief.\n\nGiven the following functions")
                && m[0].content.ends_with("separated by \"; \"."),
            "{}",
            m[0].content
        );
    }

    #[test]
    fn tool_calls_and_results_in_the_conversation_become_text() {
        let messages: Vec<MessageField> = serde_json::from_value(serde_json::json!([
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "b", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "18 C"},
            {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "21 C"}]},
            {"role": "assistant", "content": "Paris 18 C, Rome 21 C."},
            {"role": "tool", "tool_call_id": "a", "content": "late"},
            {"role": "user", "content": "And now?"},
            {"role": "tool", "tool_call_id": "b", "content": "later"},
        ]))
        .unwrap();
        let m = parse_messages(messages, ToolFormat::Hermes.into()).unwrap();
        let call = |city: &str| {
            format!(
                "<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"{city}\"}}}}\n</tool_call>"
            )
        };
        let expected =
            vec![
            (ChatRole::User, "Weather in Paris and Rome?".to_string()),
            (ChatRole::Assistant, format!("{}\n{}", call("Paris"), call("Rome"))),
            (
                ChatRole::User,
                "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n</tool_response>"
                    .into(),
            ),
            (ChatRole::Assistant, "Paris 18 C, Rome 21 C.".into()),
            (
                ChatRole::User,
                "<tool_response>\nlate\n</tool_response>\nAnd now?\n<tool_response>\nlater\n\
                 </tool_response>"
                    .into(),
            ),
        ];
        let got: Vec<(ChatRole, String)> = m.into_iter().map(|m| (m.role, m.content)).collect();
        assert_eq!(got, expected);
    }

    /// OpenAI's checks of a conversation, in both modes (the server or the template writes
    /// calls and results): content where it is required, results that answer an earlier call.
    #[test]
    fn conversations_are_checked_as_openai_checks_them() {
        let call = serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let user = serde_json::json!({"role": "user", "content": "x"});
        let cases = [
            (serde_json::json!([{"role": "user"}]), "messages[0].content"),
            (
                serde_json::json!([{"role": "user", "content": null}]),
                "messages[0].content",
            ),
            (
                serde_json::json!([{"role": "system", "content": []}, user]),
                "messages[0].content",
            ),
            (
                serde_json::json!([user, {"role": "developer"}]),
                "messages[1].content",
            ),
            (
                serde_json::json!([user, call, {"role": "tool", "content": "r"}]),
                "messages[2].tool_call_id",
            ),
            (
                serde_json::json!([user, call, {"role": "tool", "tool_call_id": "", "content": "r"}]),
                "messages[2].tool_call_id",
            ),
            (
                serde_json::json!([user, call, {"role": "tool", "tool_call_id": "c2", "content": "r"}]),
                "messages[2].tool_call_id",
            ),
            // The call must come before its result.
            (
                serde_json::json!([user, {"role": "tool", "tool_call_id": "c1", "content": "r"}, call]),
                "messages[1].tool_call_id",
            ),
            // A refusal is an assistant's part only.
            (
                serde_json::json!([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]),
                "messages[0].content[0]",
            ),
        ];
        for template in [false, true] {
            let setup = ToolSetup {
                format: ToolFormat::Hermes,
                template,
                ..Default::default()
            };
            for (messages, param) in &cases {
                let parsed: Vec<MessageField> = serde_json::from_value(messages.clone()).unwrap();
                match parse_messages(parsed, setup) {
                    Err(ApiError::InvalidRequest { param: p, .. }) => {
                        assert_eq!(p.as_deref(), Some(*param), "{messages}")
                    }
                    other => panic!("{messages}: {other:?}"),
                }
            }
            // Valid: an assistant without content beside its calls, a result answering an
            // earlier call (not only the latest message's), an empty assistant text, and a
            // refusal in an assistant's parts, which is its text.
            let good = serde_json::json!([
                {"role": "system", "content": ""},
                user,
                call,
                {"role": "assistant", "content": ""},
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
                {"role": "user", "content": [{"type": "text", "text": "why?"}]},
            ]);
            let parsed: Vec<MessageField> = serde_json::from_value(good.clone()).unwrap();
            let m = parse_messages(parsed, setup).unwrap_or_else(|e| panic!("{e:?}"));
            assert!(
                m.iter()
                    .any(|m| m.role == ChatRole::Assistant && m.content == "I can't."),
                "{m:?}"
            );
        }
    }

    /// With a template that writes tools, messages keep their calls (arguments parsed to
    /// objects, in the client's key order), results and ids as fields, nothing is merged,
    /// and the tools go to the `tools` variable (`null` when none may be called).
    #[test]
    fn a_template_that_writes_tools_gets_them_as_fields() {
        let setup = ToolSetup {
            format: ToolFormat::Hermes,
            template: true,
            ..Default::default()
        };
        let messages: Vec<MessageField> = serde_json::from_value(serde_json::json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"unit\": \"c\", \"city\": \"Paris\"}"}},
                {"id": "b", "type": "function", "function": {"name": "now"}}]},
            {"role": "tool", "tool_call_id": "a", "name": "get_weather", "content": "18 C"},
            {"role": "tool", "tool_call_id": "b", "content": "09:30"},
            {"role": "assistant", "content": "Sunny.", "tool_calls": []},
        ]))
        .unwrap();
        let m = parse_messages(messages, setup).unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(
            m[1].tool_calls,
            Some(serde_json::json!([
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}},
                {"id": "b", "type": "function", "function": {"name": "now", "arguments": {}}}]))
        );
        let keys: Vec<&String> = m[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(keys, ["unit", "city"]);
        assert_eq!(
            (m[1].role, m[1].content.as_str()),
            (ChatRole::Assistant, "")
        );
        assert_eq!(
            (
                m[2].role,
                m[2].tool_call_id.as_deref(),
                m[2].name.as_deref()
            ),
            (ChatRole::Tool, Some("a"), Some("get_weather"))
        );
        assert_eq!(
            (m[3].role, m[3].content.as_str()),
            (ChatRole::Tool, "09:30")
        );
        // An empty list is no calls: the field is absent, as for a message without calls.
        assert_eq!(m[4].tool_calls, None);
        let json = serde_json::to_value(&m[4]).unwrap();
        assert!(json.get("tool_calls").is_none(), "{json}");

        let long = "x".repeat(MAX_TOOL_CALL_ID + 1);
        for (bad, param) in [
            (
                serde_json::json!({"role": "tool", "tool_call_id": long, "content": "x"}),
                "messages[0].tool_call_id",
            ),
            (
                serde_json::json!({"role": "user", "name": long, "content": "x"}),
                "messages[0].name",
            ),
            (
                serde_json::json!({"role": "assistant", "tool_calls": [{"id": 7,
                    "function": {"name": "f"}}]}),
                "messages[0].tool_calls[0].id",
            ),
            (
                serde_json::json!({"role": "user", "content": "x", "tool_calls": []}),
                "messages[0].tool_calls",
            ),
        ] {
            let messages: Vec<MessageField> =
                serde_json::from_value(serde_json::json!([bad])).unwrap();
            match parse_messages(messages, setup) {
                Err(ApiError::InvalidRequest { param: p, .. }) => {
                    assert_eq!(p.as_deref(), Some(param))
                }
                other => panic!("{other:?}"),
            }
        }

        let chat = |extra: serde_json::Value| {
            let mut body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            serde_json::from_value::<ChatRequest>(body)
                .unwrap()
                .validate(128, setup)
        };
        let tools = serde_json::json!([
            {"function": {"name": "f", "parameters": {"properties": {}}}, "type": "function"},
            {"type": "function", "function": {"name": "g"}}]);
        let kwargs = |v: Validated| match &v.prompts[0] {
            PromptInput::Chat {
                template_kwargs,
                messages,
                ..
            } => {
                // The server's text is not added: the template writes the tools.
                assert_eq!(messages.len(), 1);
                template_kwargs.clone()
            }
            other => panic!("{other:?}"),
        };
        let v = chat(serde_json::json!({"tools": tools})).unwrap();
        assert!(matches!(
            v.structured,
            Some(StructuredOutputSpec::ToolCalls(_))
        ));
        // As the client wrote them.
        assert_eq!(kwargs(v)["tools"], tools);
        let named = serde_json::json!({"type": "function", "function": {"name": "g"}});
        // A named choice: every tool still (the grammar holds the answer to the one).
        let v = chat(serde_json::json!({"tools": tools, "tool_choice": named})).unwrap();
        assert_eq!(kwargs(v)["tools"], tools);
        let v = chat(serde_json::json!({"tools": tools, "tool_choice": "none"})).unwrap();
        assert_eq!(kwargs(v)["tools"], serde_json::Value::Null);
        let v = chat(serde_json::json!({})).unwrap();
        assert_eq!(kwargs(v)["tools"], serde_json::Value::Null);
        // Without tools a client may set the variable itself (tools as `tools` bounds them);
        // with them it is the server's.
        let v = chat(serde_json::json!({"chat_template_kwargs": {"tools": tools}})).unwrap();
        assert_eq!(kwargs(v)["tools"], tools);
        let e = chat(serde_json::json!({"chat_template_kwargs": {"tools": [1]}}));
        assert_eq!(
            param_of(e).as_deref(),
            Some("chat_template_kwargs.tools[0]")
        );
        let e = chat(serde_json::json!({"tools": tools, "chat_template_kwargs": {"tools": []}}));
        assert_eq!(param_of(e).as_deref(), Some("chat_template_kwargs"));
    }

    /// A call marker that is a special token (Mistral's `[TOOL_CALLS]`) is decoded into the
    /// answer's text for the tool reader: such requests keep that token's text (only it).
    #[test]
    fn a_special_call_marker_keeps_its_text_in_the_answer() {
        let chat = |format: ToolFormat, extra: serde_json::Value| {
            let mut body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f"}}]});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let setup = ToolSetup {
                format,
                template: false,
                markers: crate::schema::tools::MarkerTokens {
                    calls: Some(7),
                    args: Some(8),
                    call_id: Some(9),
                },
                call_ids: true,
            };
            serde_json::from_value::<ChatRequest>(body)
                .unwrap()
                .validate(128, setup)
                .unwrap()
        };
        let v = chat(ToolFormat::Mistral, serde_json::json!({}));
        assert_eq!(
            (v.skip_special_tokens, v.keep_special_tokens),
            (true, [Some(7), None, None, None, None])
        );
        let Some(StructuredOutputSpec::ToolCalls(grammar)) = &v.structured else {
            panic!("{:?}", v.structured)
        };
        assert!(
            grammar.contains("<[7]>") && !grammar.contains("<[8]>"),
            "{grammar}"
        );
        // Mistral v11 writes all three.
        let v = chat(ToolFormat::MistralV11, serde_json::json!({}));
        assert_eq!(
            v.keep_special_tokens,
            [Some(7), Some(8), Some(9), None, None]
        );
        let Some(StructuredOutputSpec::ToolCalls(grammar)) = &v.structured else {
            panic!("{:?}", v.structured)
        };
        assert!(
            ["<[7]>", "<[8]>", "<[9]>"]
                .iter()
                .all(|t| grammar.contains(t)),
            "{grammar}"
        );
        let v = chat(
            ToolFormat::Mistral,
            serde_json::json!({"tool_choice": "none"}),
        );
        assert_eq!(v.keep_special_tokens, [None; 5]);
        // Only Mistral's markers are tokens; Hermes' is text.
        let v = chat(ToolFormat::Hermes, serde_json::json!({}));
        assert_eq!(v.keep_special_tokens, [None; 5]);
    }

    #[test]
    fn chat_rejects_bad_tools_and_unknown_roles() {
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let bad = [
            (
                serde_json::json!({"messages": [{"role": "function", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                serde_json::json!({"messages": user, "tools": [{}]}),
                "tools[0].type",
            ),
            (
                serde_json::json!({"messages": user, "tools": tools,
                    "response_format": {"type": "json_object"}}),
                "tools",
            ),
            (
                serde_json::json!({"messages": user, "tools": tools, "ignore_eos": true}),
                "ignore_eos",
            ),
            (
                serde_json::json!({"messages": [{"role": "user", "content": "x",
                    "tool_calls": [{"function": {"name": "f"}}]}]}),
                "messages[0].tool_calls",
            ),
            (
                serde_json::json!({"messages": [{"role": "assistant", "tool_calls": {}}]}),
                "messages[0].tool_calls",
            ),
            (serde_json::json!({"messages": []}), "messages"),
            (
                serde_json::json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
                "top_logprobs",
            ),
            (
                serde_json::json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content[0]",
            ),
        ];
        for (json, param) in bad {
            let req: ChatRequest = serde_json::from_value(json.clone()).unwrap();
            assert_eq!(
                param_of(req.validate(128, ToolFormat::Hermes.into())).as_deref(),
                Some(param),
                "{json}"
            );
        }
    }

    fn chat_at(max_model_len: usize, json: serde_json::Value) -> Result<Validated, ApiError> {
        let req: ChatRequest = serde_json::from_value(json).unwrap();
        req.validate(max_model_len, ToolFormat::Hermes.into())
    }

    fn completion_at(max_model_len: usize, json: serde_json::Value) -> Result<Validated, ApiError> {
        let req: CompletionRequest = serde_json::from_value(json).unwrap();
        req.validate(max_model_len)
    }

    /// A prompt must leave room for one generated token, token ids as text (the engine's
    /// check): a prompt of the context's length, or a `max_tokens` of it, is refused with the
    /// context-length code and the engine's words, whatever field carried the limit.
    #[test]
    fn what_cannot_fit_the_context_is_a_context_length_error() {
        let code = |r: Result<Validated, ApiError>| match r {
            Err(e) => (
                e.to_body().error.code,
                e.to_body().error.param,
                e.to_string(),
            ),
            Ok(_) => panic!("accepted"),
        };
        let ids = |n: usize| serde_json::json!(vec![7u32; n]);
        assert!(completion_at(16, serde_json::json!({"prompt": ids(15)})).is_ok());
        let (c, param, message) = code(completion_at(16, serde_json::json!({"prompt": ids(16)})));
        assert_eq!(c, Some("context_length_exceeded"));
        assert_eq!(param.as_deref(), Some("prompt"));
        assert_eq!(
            message,
            "This model's maximum context length is 16 tokens. However, your request has 16 \
             input tokens, which leaves no room for an output token (a prompt may have at most \
             15 tokens). Please reduce the length of the input."
        );
        let (c, param, _) = code(completion_at(
            16,
            serde_json::json!({"prompt": [ids(3), ids(17)]}),
        ));
        assert_eq!(
            (c, param.as_deref()),
            (Some("context_length_exceeded"), Some("prompt"))
        );
        for max_tokens in [u32::MAX, 16] {
            let json = serde_json::json!({"prompt": "hi", "max_tokens": max_tokens});
            let (c, param, message) = code(completion_at(16, json));
            assert_eq!(c, Some("context_length_exceeded"));
            assert_eq!(param.as_deref(), Some("max_tokens"));
            assert_eq!(
                message,
                format!(
                    "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This \
                     model's maximum context length is 16 tokens and a prompt takes at least \
                     one of them ({max_tokens} > 16 - 1)."
                )
            );
        }
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let (c, param, _) = code(chat_at(
            16,
            serde_json::json!({"messages": user, "max_completion_tokens": 4294967295u32}),
        ));
        assert_eq!(
            (c, param.as_deref()),
            (
                Some("context_length_exceeded"),
                Some("max_completion_tokens")
            )
        );
        assert!(completion_at(16, serde_json::json!({"prompt": "hi", "max_tokens": 15})).is_ok());
    }

    #[test]
    fn generated_logprobs_are_bounded_unless_streamed() {
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let four = serde_json::json!(["a", "b", "c", "d"]);
        let refused = [
            // The review's cases: 4 prompts × n 16 × 8191 × 21, chat n 16 to an 8k context.
            completion_at(
                8192,
                serde_json::json!({"prompt": four, "n": 16,
                "max_tokens": 8191, "logprobs": 20}),
            ),
            chat_at(
                8192,
                serde_json::json!({"messages": user, "n": 16, "logprobs": true,
                "top_logprobs": 20}),
            ),
            // Without max_tokens a chat answer may run to the context: 2 × 8191 × 21.
            chat_at(
                8192,
                serde_json::json!({"messages": user, "n": 2, "logprobs": true,
                "top_logprobs": 20}),
            ),
            // One past the bound: 16 × 16385 × 1.
            completion_at(
                1 << 20,
                serde_json::json!({"prompt": "x", "n": 16,
                "max_tokens": 16385, "logprobs": 0}),
            ),
            chat_at(
                1 << 17,
                serde_json::json!({"messages": user, "logprobs": true,
                "top_logprobs": 2}),
            ),
        ];
        for result in refused {
            let Err(ApiError::InvalidRequest { param, message }) = result else {
                panic!("{result:?}")
            };
            assert_eq!(param.as_deref(), Some("logprobs"));
            assert!(message.contains("stream"), "{message}");
        }
        let accepted = [
            // The same, streamed.
            completion_at(
                8192,
                serde_json::json!({"prompt": four, "n": 16,
                "max_tokens": 8191, "logprobs": 20, "stream": true}),
            ),
            chat_at(
                8192,
                serde_json::json!({"messages": user, "n": 16, "logprobs": true,
                "top_logprobs": 20, "stream": true}),
            ),
            // Every alternative of one choice to an 8k context.
            chat_at(
                8192,
                serde_json::json!({"messages": user, "logprobs": true,
                "top_logprobs": 20}),
            ),
            completion_at(
                8192,
                serde_json::json!({"prompt": "x", "max_tokens": 8191,
                "logprobs": 20}),
            ),
            chat_at(
                8192,
                serde_json::json!({"messages": user, "n": 2, "logprobs": true,
                "top_logprobs": 20, "max_tokens": 1000}),
            ),
            // Exactly the bound: 16 × 16384 × 1; one alternative to a 128k context.
            completion_at(
                1 << 20,
                serde_json::json!({"prompt": "x", "n": 16,
                "max_tokens": 16384, "logprobs": 0}),
            ),
            chat_at(
                1 << 17,
                serde_json::json!({"messages": user, "logprobs": true,
                "top_logprobs": 1}),
            ),
            // No logprobs, no bound.
            chat_at(1 << 20, serde_json::json!({"messages": user, "n": 16})),
            // Completions' default max_tokens (16) counts, not the context.
            completion_at(
                1 << 20,
                serde_json::json!({"prompt": four, "n": 16,
                "logprobs": 20}),
            ),
        ];
        for result in accepted {
            assert!(result.is_ok(), "{result:?}");
        }
    }

    #[test]
    fn developer_messages_are_system_messages() {
        let messages: Vec<MessageField> = serde_json::from_value(serde_json::json!([
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "hi"},
        ]))
        .unwrap();
        let m = parse_messages(messages, ToolFormat::Hermes.into()).unwrap();
        let roles: Vec<ChatRole> = m.iter().map(|m| m.role).collect();
        assert_eq!(roles, [ChatRole::System, ChatRole::User]);
        // Tools join the developer message as they join a system message.
        let v = chat_at(
            128,
            serde_json::json!({"messages": [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "now"}}]}),
        )
        .unwrap();
        let PromptInput::Chat { messages: m, .. } = &v.prompts[0] else {
            panic!("{v:?}")
        };
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].role, ChatRole::System);
        assert!(
            m[0].content.starts_with("Be brief.\n\n# Tools\n"),
            "{}",
            m[0].content
        );
    }

    /// vLLM's `add_generation_prompt` and `continue_final_message` choose how the prompt
    /// ends; continuing needs text at the end to continue.
    #[test]
    fn a_chat_prompt_ends_as_add_generation_prompt_and_continue_final_message_say() {
        let ending = |extra: serde_json::Value, last: &str| {
            let mut body = serde_json::json!({"messages": [
                {"role": "user", "content": "x"}, {"role": "assistant", "content": last}]});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            chat_at(128, body).map(|v| match &v.prompts[0] {
                PromptInput::Chat { ending, .. } => *ending,
                other => panic!("{other:?}"),
            })
        };
        assert_eq!(
            ending(serde_json::json!({}), "a").unwrap(),
            ChatEnding::GenerationPrompt
        );
        assert_eq!(
            ending(serde_json::json!({"add_generation_prompt": false}), "a").unwrap(),
            ChatEnding::Closed
        );
        for extra in [
            serde_json::json!({"continue_final_message": true}),
            serde_json::json!({"continue_final_message": true, "add_generation_prompt": false}),
        ] {
            assert_eq!(ending(extra, "a").unwrap(), ChatEnding::ContinueFinal);
        }
        match ending(serde_json::json!({"continue_final_message": true}), " \n") {
            Err(ApiError::InvalidRequest { param, .. }) => {
                assert_eq!(param.as_deref(), Some("continue_final_message"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn fields_that_would_change_the_output_are_refused_unless_default() {
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let chat_refused = [
            (
                serde_json::json!({"continue_final_message": true, "add_generation_prompt": true}),
                "continue_final_message",
            ),
            (serde_json::json!({"echo": true}), "echo"),
            (
                serde_json::json!({"use_beam_search": true, "top_k": 5}),
                "top_k",
            ),
            (
                serde_json::json!({"use_beam_search": true, "prompt_logprobs": 0}),
                "prompt_logprobs",
            ),
        ];
        for (extra, param) in chat_refused {
            let mut body = serde_json::json!({"messages": user});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            assert_eq!(
                param_of(chat_at(128, body)).as_deref(),
                Some(param),
                "{extra}"
            );
        }
        for (json, param) in [
            (
                serde_json::json!({"prompt": "x", "use_beam_search": true, "logit_bias": {"1": 1}}),
                "logit_bias",
            ),
            (
                serde_json::json!({"prompt": "x", "use_beam_search": true, "prompt_logprobs": 1}),
                "prompt_logprobs",
            ),
        ] {
            assert_eq!(
                param_of(completion(json.clone())).as_deref(),
                Some(param),
                "{json}"
            );
        }
        // Their defaults, spelt out, are accepted.
        assert!(chat_at(
            128,
            serde_json::json!({"messages": user, "add_generation_prompt": true,
                "continue_final_message": false, "echo": false, "use_beam_search": false,
                "prompt_logprobs": null})
        )
        .is_ok());
        assert!(
            completion(serde_json::json!({"prompt": "x", "use_beam_search": false,
            "prompt_logprobs": null}))
            .is_ok()
        );
    }

    /// vLLM's `prompt_logprobs`: 0 to 20 alternatives (its -1, the whole vocabulary, and
    /// anything outside refused naming the field and the bound), not with `stream` but for 0
    /// (accepted, nothing returned, as vLLM), the response's entries bounded.
    #[test]
    fn prompt_logprobs_are_read_as_vllm_reads_them() {
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let read = |json: serde_json::Value| completion(json).map(|v| v.prompt_logprobs);
        let read_chat = |extra: serde_json::Value| {
            let mut body = serde_json::json!({"messages": user});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            chat_at(128, body).map(|v| v.prompt_logprobs)
        };
        assert_eq!(read(serde_json::json!({"prompt": "x"})).unwrap(), None);
        for k in [0, 1, 20] {
            let json = serde_json::json!({"prompt": "x", "prompt_logprobs": k});
            assert_eq!(read(json).unwrap(), Some(k));
            assert_eq!(
                read_chat(serde_json::json!({"prompt_logprobs": k})).unwrap(),
                Some(k)
            );
        }
        assert_eq!(
            read(serde_json::json!({"prompt": "x", "prompt_logprobs": null})).unwrap(),
            None
        );
        for k in [-1, -2, 21, 1i64 << 40] {
            for result in [
                completion(serde_json::json!({"prompt": "x", "prompt_logprobs": k})),
                chat_at(
                    128,
                    serde_json::json!({"messages": user, "prompt_logprobs": k}),
                ),
            ] {
                match result {
                    Err(ApiError::InvalidRequest { param, message }) => {
                        assert_eq!(param.as_deref(), Some("prompt_logprobs"));
                        assert!(message.contains("[0, 20]"), "{message}");
                    }
                    other => panic!("{k}: {other:?}"),
                }
            }
        }
        // Streamed: alternatives refused, 0 accepted and nothing returned (vLLM's rules).
        let streamed = serde_json::json!({"prompt": "x", "stream": true, "prompt_logprobs": 1});
        assert_eq!(
            param_of(completion(streamed)).as_deref(),
            Some("prompt_logprobs")
        );
        let streamed = serde_json::json!({"messages": user, "stream": true, "prompt_logprobs": 2});
        assert_eq!(
            param_of(chat_at(128, streamed)).as_deref(),
            Some("prompt_logprobs")
        );
        assert_eq!(
            read(serde_json::json!({"prompt": "x", "stream": true, "prompt_logprobs": 0})).unwrap(),
            None
        );
        assert_eq!(
            read_chat(serde_json::json!({"stream": true, "prompt_logprobs": 0})).unwrap(),
            None
        );
    }

    /// Prompt logprobs count prompt tokens × lists × (alternatives + 1) against the bound of
    /// logprob entries: token prompts by their length (summed over prompts, every choice a
    /// list), text and chat prompts as the context length less one (chat: one list).
    #[test]
    fn prompt_logprobs_are_bounded_by_the_entries_they_return() {
        let tokens = |prompts: usize, len: usize, n: u32, k: u32| {
            serde_json::json!({"prompt": vec![vec![1u32; len]; prompts], "n": n,
                "prompt_logprobs": k})
        };
        // 2 prompts × 2048 tokens × n 4 × (15 + 1) = 262,144: the bound exactly.
        assert_eq!(
            completion_at(8192, tokens(2, 2048, 4, 15))
                .unwrap()
                .prompt_logprobs,
            Some(15)
        );
        let refused = completion_at(8192, tokens(2, 2048, 4, 16));
        match refused {
            Err(ApiError::InvalidRequest { param, message }) => {
                assert_eq!(param.as_deref(), Some("prompt_logprobs"));
                assert!(message.contains("4096 × 4 × (16 + 1)"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // A text prompt counts as the context less one: 65,535 × (3 + 1) fits, × (4 + 1) not.
        let text = |k: u32| serde_json::json!({"prompt": "x", "prompt_logprobs": k});
        assert!(completion_at(1 << 16, text(3)).is_ok());
        assert_eq!(
            param_of(completion_at(1 << 16, text(4))).as_deref(),
            Some("prompt_logprobs")
        );
        // Chat returns one list whatever n.
        let chat = |k: u32| {
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "n": 16,
                "prompt_logprobs": k})
        };
        assert!(chat_at(1 << 16, chat(3)).is_ok());
        assert_eq!(
            param_of(chat_at(1 << 16, chat(4))).as_deref(),
            Some("prompt_logprobs")
        );
        // Streamed with 0, nothing is returned: nothing to bound.
        let mut streamed = text(0);
        streamed["stream"] = serde_json::json!(true);
        streamed["prompt"] = serde_json::json!(vec![vec![1u32; 8191]; 32]);
        assert!(completion_at(8192, streamed).is_ok());
    }

    #[test]
    fn beam_search_is_read_with_its_length_penalty_and_the_fields_it_takes() {
        let beam = |json: serde_json::Value| completion(json).map(|v| v.beam_search);
        assert_eq!(beam(serde_json::json!({"prompt": "x"})).unwrap(), None);
        // vLLM reads length_penalty on any request; only beam search uses it.
        assert_eq!(
            beam(serde_json::json!({"prompt": "x", "length_penalty": 2.0})).unwrap(),
            None
        );
        assert_eq!(
            beam(
                serde_json::json!({"prompt": "x", "use_beam_search": true, "n": 3,
                "temperature": 0.7, "seed": 1, "ignore_eos": true, "min_tokens": 2,
                "stop_token_ids": [5], "logprobs": 2})
            )
            .unwrap(),
            Some(BeamSearch {
                length_penalty: 1.0
            })
        );
        assert_eq!(
            beam(serde_json::json!({"prompt": "x", "use_beam_search": true,
                "length_penalty": -0.5}))
            .unwrap(),
            Some(BeamSearch {
                length_penalty: -0.5
            })
        );
        for (json, param) in [
            (
                serde_json::json!({"prompt": "x", "use_beam_search": true, "n": MAX_BEAM_WIDTH + 1}),
                "n",
            ),
            (
                serde_json::json!({"prompt": "x", "length_penalty": MAX_LENGTH_PENALTY * 2.0}),
                "length_penalty",
            ),
            (
                serde_json::json!({"prompt": "x", "use_beam_search": true, "min_p": 0.1}),
                "min_p",
            ),
            (
                serde_json::json!({"prompt": "x", "use_beam_search": true, "repetition_penalty": 1.1}),
                "repetition_penalty",
            ),
            (
                serde_json::json!({"prompt": "x", "use_beam_search": true, "frequency_penalty": 0.5}),
                "frequency_penalty",
            ),
            (
                serde_json::json!({"prompt": "x", "use_beam_search": true, "stop": "\n"}),
                "stop",
            ),
            (
                serde_json::json!({"prompt": "x", "use_beam_search": true, "guided_regex": "[a-z]"}),
                "guided_regex",
            ),
        ] {
            assert_eq!(
                param_of(completion(json.clone())).as_deref(),
                Some(param),
                "{json}"
            );
        }
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let chat = chat_at(
            128,
            serde_json::json!({"messages": user, "use_beam_search": true, "n": 2}),
        )
        .unwrap();
        assert_eq!(
            chat.beam_search,
            Some(BeamSearch {
                length_penalty: 1.0
            })
        );
    }

    #[test]
    fn top_logprobs_zero_without_logprobs_is_accepted() {
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let v = chat_at(
            128,
            serde_json::json!({"messages": user, "top_logprobs": 0}),
        )
        .unwrap();
        assert_eq!(v.logprobs, None);
        let v = chat_at(
            128,
            serde_json::json!({"messages": user, "logprobs": false, "top_logprobs": 0}),
        )
        .unwrap();
        assert_eq!(v.logprobs, None);
        assert_eq!(
            param_of(chat_at(
                128,
                serde_json::json!({"messages": user, "logprobs": false, "top_logprobs": 1})
            ))
            .as_deref(),
            Some("top_logprobs")
        );
    }
}
