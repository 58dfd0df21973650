//! OpenAI's Responses API (`POST /v1/responses`): the request body, its reading into a chat
//! request (the route answers it on the chat path), and the response object.
//!
//! As vLLM's `serving_responses` does, the request becomes a chat conversation: `instructions`
//! a system message first, `input` (a string: one user message; or items) the messages after
//! it; `message` items (or `role` + `content` shorthand) keep their role (`developer` is read as
//! `system`, as chat reads it), their `input_text` / `output_text` parts their text;
//! `function_call` items become an assistant message's `tool_calls` and `function_call_output`
//! items `tool` messages. `tools` (Responses' shape: `name`, `parameters`, `strict` beside
//! `type`), `tool_choice`, `text.format`, `max_output_tokens` become chat's fields, and chat's
//! validation bounds them; an error it names by a chat field is renamed to the Responses field
//! ([`ResponsesChat::rename`]).
//!
//! `previous_response_id` continues a stored response (see [`crate::response_store`]): its
//! conversation's items (each earlier turn's input, then its output) come before this
//! request's `input`, and, as OpenAI documents, the earlier `instructions` are not carried
//! over. `background: true` runs a stored response in the background (see the route).
//! `conversation` and `prompt` (stored prompts) are refused with a
//! 400 naming the field, as are built-in tools, `reasoning.summary` other than null (no
//! summaries are written; `reasoning.effort` is checked against OpenAI's values and read by no
//! model, as chat's `reasoning_effort`), `include` entries other than
//! `message.output_text.logprobs` (the answer text's token logprobs, with `top_logprobs`
//! alternatives) and `top_logprobs` without it. `truncation: "auto"` fits an input longer than
//! the context by dropping the conversation's oldest messages (see the route and
//! [`super::truncation::drop_oldest_messages`]); `"disabled"` (the default) refuses it.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::chat_extras::{ChatExtras, REASONING_EFFORTS};
use super::ignored::IgnoredFields;
use super::limits::MAX_MESSAGES;
use super::request::{ChatRequest, ContentField, ContentPart, MessageField};
use super::response::PromptTokensDetails;
use super::structured::StructuredFields;
use crate::error::ApiError;
use crate::state::request_id;

/// Most `metadata` pairs (OpenAI's bound).
pub const MAX_METADATA_PAIRS: usize = 16;
/// Longest `metadata` key, in characters (OpenAI's bound).
pub const MAX_METADATA_KEY_CHARS: usize = 64;
/// Longest `metadata` value, in characters (OpenAI's bound).
pub const MAX_METADATA_VALUE_CHARS: usize = 512;

/// Body of `POST /v1/responses`.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    /// Model name; optional (defaults to the served model), 404 if it names another.
    pub model: Option<String>,
    /// A string (one user message) or a list of input items.
    pub input: Value,
    /// A system message put first.
    pub instructions: Option<String>,
    /// Completion length limit.
    pub max_output_tokens: Option<u32>,
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// Functions the model may call, in the Responses shape.
    pub tools: Option<Value>,
    /// `none`, `auto`, `required` or `{"type": "function", "name": ...}`.
    pub tool_choice: Option<Value>,
    /// Whether one answer may hold several calls (default true).
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": ...}`: text, a JSON object, or a JSON Schema.
    pub text: Option<Value>,
    /// Stream the semantic events over SSE.
    pub stream: Option<bool>,
    /// OpenAI's `stream_options` (`include_obfuscation`): read, nothing to obfuscate.
    pub stream_options: Option<Value>,
    /// End-user id; echoed.
    pub user: Option<String>,
    /// Up to 16 string pairs; echoed.
    pub metadata: Option<Map<String, Value>>,
    /// Store the response for retrieval and continuation (default true).
    pub store: Option<bool>,
    /// A stored response (of the same tenant) this one continues.
    pub previous_response_id: Option<Value>,
    /// Refused: conversations are not stored.
    pub conversation: Option<Value>,
    /// `{effort, summary}`: `effort` one of OpenAI's values (checked; as chat's
    /// `reasoning_effort`, read by no model here), `summary` null (none are written); echoed.
    pub reasoning: Option<Value>,
    /// Run in the background: answered at once (`queued`), or with `stream` its events as they
    /// come (resumable with `GET ?stream=true&starting_after=`); read back with `GET` (needs
    /// `store`).
    pub background: Option<bool>,
    /// Refused when not empty: no extra output can be included.
    pub include: Option<Value>,
    /// Refused (other than null): stored prompts are not kept here.
    pub prompt: Option<Value>,
    /// Refused above 0: output logprobs are not offered on this endpoint.
    pub top_logprobs: Option<u32>,
    /// `disabled` only.
    pub truncation: Option<Value>,
    /// OpenAI's service tier; checked as chat checks it.
    pub service_tier: Option<Value>,
    /// Fields no endpoint reads (logged, see [`IgnoredFields`]).
    #[serde(flatten)]
    pub ignored: IgnoredFields,
}

/// A Responses request read as a chat request, with what the response echoes.
#[derive(Debug, Clone)]
pub struct ResponsesChat {
    /// The chat request to validate and run.
    pub chat: ChatRequest,
    /// Per chat message, the Responses field it came from (`instructions`, `input`,
    /// `input[3]`).
    pub sources: Vec<String>,
    /// The settings the response object echoes.
    pub echo: Echo,
    /// Whether to stream.
    pub stream: bool,
    /// This request's own input items as a stored response lists them (`input_items`): a
    /// string input is one user message; each item has an `id` and a `type`, and a message's
    /// string content is one text part.
    pub input_items: Vec<Value>,
}

/// The request's settings as the response object returns them.
#[derive(Debug, Clone, PartialEq)]
pub struct Echo {
    /// `instructions`.
    pub instructions: Option<String>,
    /// `max_output_tokens`.
    pub max_output_tokens: Option<u32>,
    /// `tools`, as given.
    pub tools: Vec<Value>,
    /// `tool_choice` (default `auto`).
    pub tool_choice: Value,
    /// `parallel_tool_calls` (default true).
    pub parallel_tool_calls: bool,
    /// `text` (default `{"format": {"type": "text"}}`).
    pub text: Value,
    /// `metadata` (default `{}`).
    pub metadata: Map<String, Value>,
    /// `store` (default true).
    pub store: bool,
    /// `user`.
    pub user: Option<String>,
    /// `reasoning`, as sent (null when absent).
    pub reasoning: Option<Value>,
    /// `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// `background`: answer at once (`queued`) and run the response, read back by `GET`.
    pub background: bool,
    /// `truncation`: `"auto"` (an input longer than the context loses its oldest messages)
    /// or `"disabled"` (the default: it is refused).
    pub truncation: &'static str,
}

fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

fn set(v: &Option<Value>) -> bool {
    v.as_ref().is_some_and(|v| !v.is_null())
}

/// Longest `previous_response_id` looked up, in bytes (ours are 32 characters; OpenAI's
/// about 50).
pub const MAX_RESPONSE_ID_BYTES: usize = 256;

impl ResponsesRequest {
    /// `previous_response_id`: `None` when absent or null; a 400 when it is not a string (or
    /// is longer than any id this server makes).
    pub fn previous_response_id(&self) -> Result<Option<String>, ApiError> {
        match &self.previous_response_id {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(id)) if id.is_empty() || id.len() > MAX_RESPONSE_ID_BYTES => {
                Err(invalid(
                    "previous_response_id",
                    format!(
                        "previous_response_id must be a response id of 1 to \
                         {MAX_RESPONSE_ID_BYTES} bytes"
                    ),
                ))
            }
            Some(Value::String(id)) => Ok(Some(id.clone())),
            Some(_) => Err(invalid(
                "previous_response_id",
                "previous_response_id is a string",
            )),
        }
    }

    /// Refuses what cannot be honoured, naming the field, and reads the rest as a chat
    /// request: `history` (the items of the conversation `previous_response_id` continues,
    /// oldest first; empty without one) before `input`.
    pub fn into_chat(self, history: &[Value]) -> Result<ResponsesChat, ApiError> {
        let previous_response_id = self.previous_response_id()?;
        if set(&self.conversation) {
            return Err(invalid(
                "conversation",
                "conversation is not supported: this server stores no conversations; send the \
                 conversation's items in input",
            ));
        }
        check_reasoning(self.reasoning.as_ref())?;
        let background = self.background == Some(true);
        if background && self.store == Some(false) {
            return Err(invalid(
                "background",
                "background = true needs store = true: a background response is read back with \
                 GET /v1/responses/{id}",
            ));
        }
        if set(&self.prompt) {
            return Err(invalid(
                "prompt",
                "prompt (a stored prompt template) is not supported",
            ));
        }
        let logprobs = check_include(self.include.as_ref())?;
        if !logprobs && self.top_logprobs.is_some_and(|k| k > 0) {
            return Err(invalid(
                "top_logprobs",
                format!("top_logprobs needs include: [{INCLUDE_LOGPROBS:?}]"),
            ));
        }
        let truncation = match &self.truncation {
            None | Some(Value::Null) => "disabled",
            Some(Value::String(s)) if s == "disabled" => "disabled",
            Some(Value::String(s)) if s == "auto" => "auto",
            Some(_) => {
                return Err(invalid(
                    "truncation",
                    "truncation is \"auto\" (an input too long for the context loses its \
                     oldest items) or \"disabled\" (it is refused)",
                ))
            }
        };
        if let Some(options) = &self.stream_options {
            if !(options.is_null() || options.is_object()) {
                return Err(invalid("stream_options", "stream_options is an object"));
            }
        }
        let metadata = check_metadata(self.metadata)?;
        let (response_format, text) = text_format(self.text)?;
        let (tools, given_tools) = chat_tools(self.tools)?;
        let tool_choice = chat_tool_choice(self.tool_choice.as_ref())?;
        let (messages, sources) = messages(self.instructions.as_deref(), history, &self.input)?;
        let input_items = input_items(&self.input);
        let echo = Echo {
            instructions: self.instructions,
            max_output_tokens: self.max_output_tokens,
            tools: given_tools,
            tool_choice: match &self.tool_choice {
                None | Some(Value::Null) => json!("auto"),
                Some(v) => v.clone(),
            },
            parallel_tool_calls: self.parallel_tool_calls.unwrap_or(true),
            text,
            metadata,
            store: self.store.unwrap_or(true),
            user: self.user.clone(),
            reasoning: self.reasoning.clone().filter(|r| !r.is_null()),
            previous_response_id,
            background,
            truncation,
        };
        let stream = self.stream.unwrap_or(false);
        let chat = ChatRequest {
            model: self.model,
            messages,
            max_tokens: None,
            max_completion_tokens: self.max_output_tokens,
            n: None,
            stop: None,
            logprobs: logprobs.then_some(true),
            top_logprobs: self.top_logprobs.filter(|_| logprobs),
            stream: Some(stream),
            stream_options: None,
            tools,
            tool_choice,
            parallel_tool_calls: self.parallel_tool_calls,
            chat_template_kwargs: None,
            add_generation_prompt: None,
            continue_final_message: None,
            echo: None,
            truncate_prompt_tokens: None,
            use_beam_search: None,
            length_penalty: None,
            prompt_logprobs: None,
            priority: None,
            user: self.user,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: None,
            min_p: None,
            presence_penalty: None,
            frequency_penalty: None,
            repetition_penalty: None,
            seed: None,
            logit_bias: None,
            stop_token_ids: None,
            min_tokens: None,
            ignore_eos: None,
            allowed_token_ids: None,
            bad_words: None,
            return_tokens_as_token_ids: None,
            cache_salt: None,
            include_stop_str_in_output: None,
            skip_special_tokens: None,
            spaces_between_special_tokens: None,
            structured: StructuredFields {
                response_format,
                ..StructuredFields::default()
            },
            extras: ChatExtras {
                service_tier: self.service_tier,
                ..ChatExtras::default()
            },
            ignored: IgnoredFields::default(),
        };
        Ok(ResponsesChat {
            chat,
            sources,
            echo,
            stream,
            input_items,
        })
    }
}

impl ResponsesChat {
    /// `e` naming the Responses field where the chat validation named its own: a message's
    /// (`messages[2].content` → `input[1].content`), `max_completion_tokens` →
    /// `max_output_tokens`, `response_format` → `text.format`, a tool's `function` level
    /// dropped (`tools[0].function.parameters` → `tools[0].parameters`).
    pub fn rename(&self, e: ApiError) -> ApiError {
        rename_error(e, &self.sources)
    }
}

/// [`ResponsesChat::rename`]. A message that opens with the chat field's name
/// (`max_completion_tokens must be at least 1`, `tool_call_id "c" answers no ...`) opens
/// with the Responses field's instead.
pub fn rename_error(e: ApiError, sources: &[String]) -> ApiError {
    match e {
        ApiError::InvalidRequest {
            message,
            param: Some(param),
        } => {
            let renamed = rename_param(&param, sources);
            let message = rename_message(message, &param, &renamed);
            ApiError::InvalidRequest {
                message,
                param: Some(renamed),
            }
        }
        ApiError::Engine(mut e) => {
            if let Some(param) = e.param.take() {
                let renamed = rename_param(&param, sources);
                // vLLM's words for a length too large name both chat fields.
                if renamed == "max_output_tokens" {
                    if let Some(rest) = e
                        .message
                        .strip_prefix("'max_tokens' or 'max_completion_tokens' is too large")
                    {
                        e.message = format!("'max_output_tokens' is too large{rest}");
                    }
                }
                e.param = Some(renamed);
            }
            ApiError::Engine(e)
        }
        other => other,
    }
}

/// `message` opening with the field `param` (whole, or its last segment) as opening with
/// `renamed` (whole, or its last segment); any other message as it is.
fn rename_message(message: String, param: &str, renamed: &str) -> String {
    let last = |p: &str| p.rsplit('.').next().unwrap_or(p).to_owned();
    for (from, to) in [
        (param.to_owned(), renamed.to_owned()),
        (last(param), last(renamed)),
    ] {
        if from == to {
            continue;
        }
        if let Some(rest) = message.strip_prefix(from.as_str()) {
            if rest.starts_with(' ') {
                return format!("{to}{rest}");
            }
        }
    }
    message
}

/// `reasoning`: null, or an object of `effort` (null or one of OpenAI's values: checked, and
/// as chat's `reasoning_effort` read by no model here; a reasoning model thinks as its template
/// and the request's `chat_template_kwargs` say) and `summary` (or the deprecated
/// `generate_summary`) null, as no summaries are written: the thinking comes whole, as a
/// `reasoning` item's `reasoning_text`.
fn check_reasoning(value: Option<&Value>) -> Result<(), ApiError> {
    let fields = match value {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(fields)) => fields,
        Some(_) => return Err(invalid("reasoning", "reasoning is an object or null")),
    };
    for (key, value) in fields {
        match key.as_str() {
            "effort" => match value {
                Value::Null => {}
                Value::String(e) if REASONING_EFFORTS.contains(&e.as_str()) => {}
                _ => {
                    let allowed: Vec<String> = REASONING_EFFORTS
                        .iter()
                        .map(|e| format!("\"{e}\""))
                        .collect();
                    return Err(invalid(
                        "reasoning.effort",
                        format!("reasoning.effort must be one of {}", allowed.join(", ")),
                    ));
                }
            },
            "summary" | "generate_summary" if value.is_null() => {}
            "summary" | "generate_summary" => {
                return Err(invalid(
                    format!("reasoning.{key}"),
                    "reasoning summaries are not written here (a reasoning model's thinking \
                     comes whole, as a reasoning item's reasoning_text): leave it null",
                ))
            }
            other => {
                let shown: String = other.chars().take(64).collect();
                return Err(invalid(
                    format!("reasoning.{shown}"),
                    "reasoning takes effort and summary",
                ));
            }
        }
    }
    Ok(())
}

/// A chat field's name as the Responses field it came from.
pub fn rename_param(param: &str, sources: &[String]) -> String {
    if let Some(rest) = param.strip_prefix("messages[") {
        if let Some((index, tail)) = rest.split_once(']') {
            if let Some(source) = index.parse::<usize>().ok().and_then(|i| sources.get(i)) {
                if source == "instructions" || source == "input" {
                    return source.clone();
                }
                // A call's fields are its item's; a result's `tool_call_id` is its `call_id`.
                let tail = if tail.starts_with(".tool_calls") {
                    ""
                } else if tail == ".tool_call_id" {
                    ".call_id"
                } else {
                    tail
                };
                return format!("{source}{tail}");
            }
        }
        return "input".to_owned();
    }
    match param {
        "messages" | "prompt" => return "input".to_owned(),
        "max_completion_tokens" | "max_tokens" => return "max_output_tokens".to_owned(),
        _ => {}
    }
    if let Some(rest) = param.strip_prefix("response_format") {
        let rest = rest.strip_prefix(".json_schema").unwrap_or(rest);
        return format!("text.format{rest}");
    }
    if let Some(rest) = param.strip_prefix("tools[") {
        if let Some((index, tail)) = rest.split_once(']') {
            let tail = tail.strip_prefix(".function").unwrap_or(tail);
            return format!("tools[{index}]{tail}");
        }
    }
    if param.starts_with("tool_choice") {
        return "tool_choice".to_owned();
    }
    param.to_owned()
}

/// The one `include` entry this server produces: the answer text's token logprobs.
pub const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// Most `include` entries read.
const MAX_INCLUDE: usize = 16;

/// `include`: a list of at most [`MAX_INCLUDE`] strings, each [`INCLUDE_LOGPROBS`] (every
/// other entry names output this server cannot produce); whether logprobs are asked for.
fn check_include(include: Option<&Value>) -> Result<bool, ApiError> {
    let list = match include {
        None | Some(Value::Null) => return Ok(false),
        Some(Value::Array(list)) if list.len() <= MAX_INCLUDE => list,
        Some(Value::Array(_)) => {
            return Err(invalid(
                "include",
                format!("include holds at most {MAX_INCLUDE} entries"),
            ))
        }
        Some(_) => return Err(invalid("include", "include is a list of strings")),
    };
    for (i, entry) in list.iter().enumerate() {
        if entry.as_str() == Some(INCLUDE_LOGPROBS) {
            continue;
        }
        let shown: String = entry
            .as_str()
            .map_or_else(|| entry.to_string(), str::to_owned)
            .chars()
            .take(64)
            .collect();
        return Err(invalid(
            format!("include[{i}]"),
            format!(
                "include {shown:?} is not supported: only {INCLUDE_LOGPROBS:?} can be included \
                 here (no reasoning, tool results or images)"
            ),
        ));
    }
    Ok(!list.is_empty())
}

/// `metadata`: at most [`MAX_METADATA_PAIRS`] string pairs, keys at most
/// [`MAX_METADATA_KEY_CHARS`] characters, values at most [`MAX_METADATA_VALUE_CHARS`].
fn check_metadata(metadata: Option<Map<String, Value>>) -> Result<Map<String, Value>, ApiError> {
    let Some(map) = metadata else {
        return Ok(Map::new());
    };
    if map.len() > MAX_METADATA_PAIRS {
        return Err(invalid(
            "metadata",
            format!(
                "metadata has at most {MAX_METADATA_PAIRS} pairs, got {}",
                map.len()
            ),
        ));
    }
    for (key, value) in &map {
        if key.chars().count() > MAX_METADATA_KEY_CHARS {
            return Err(invalid(
                "metadata",
                format!("a metadata key is at most {MAX_METADATA_KEY_CHARS} characters"),
            ));
        }
        let shown: String = key.chars().take(MAX_METADATA_KEY_CHARS).collect();
        match value {
            Value::String(s) if s.chars().count() <= MAX_METADATA_VALUE_CHARS => {}
            Value::String(_) => {
                return Err(invalid(
                    format!("metadata.{shown}"),
                    format!("a metadata value is at most {MAX_METADATA_VALUE_CHARS} characters"),
                ))
            }
            _ => {
                return Err(invalid(
                    format!("metadata.{shown}"),
                    "a metadata value is a string",
                ))
            }
        }
    }
    Ok(map)
}

/// `text`: its `format` as chat's `response_format`, and the `text` the response echoes.
fn text_format(text: Option<Value>) -> Result<(Option<Value>, Value), ApiError> {
    let default = json!({"format": {"type": "text"}});
    let obj = match text {
        None | Some(Value::Null) => return Ok((None, default)),
        Some(Value::Object(obj)) => obj,
        Some(_) => return Err(invalid("text", "text is an object")),
    };
    for key in obj.keys() {
        match key.as_str() {
            "format" => {}
            "verbosity" => match obj.get(key) {
                Some(Value::Null) => {}
                Some(Value::String(v)) if v == "medium" => {}
                _ => {
                    return Err(invalid(
                        "text.verbosity",
                        "only text.verbosity \"medium\" (the default) is supported: no model \
                         here reads a verbosity",
                    ))
                }
            },
            other => {
                let shown: String = other.chars().take(64).collect();
                return Err(invalid(
                    format!("text.{shown}"),
                    "text takes format and verbosity",
                ));
            }
        }
    }
    let format = match obj.get("format") {
        None | Some(Value::Null) => None,
        Some(Value::Object(format)) => Some(format),
        Some(_) => return Err(invalid("text.format", "text.format is an object")),
    };
    let response_format = match format {
        None => None,
        Some(format) => match format.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(json!({"type": "json_object"})),
            Some("json_schema") => {
                let schema = format.get("schema").ok_or_else(|| {
                    invalid("text.format.schema", "a json_schema format needs a schema")
                })?;
                let name = match format.get("name") {
                    Some(Value::String(n)) => n.clone(),
                    _ => {
                        return Err(invalid(
                            "text.format.name",
                            "a json_schema format needs a name (a string)",
                        ))
                    }
                };
                let mut json_schema = Map::new();
                json_schema.insert("name".into(), Value::String(name));
                json_schema.insert("schema".into(), schema.clone());
                for key in ["strict", "description"] {
                    if let Some(v) = format.get(key) {
                        json_schema.insert(key.into(), v.clone());
                    }
                }
                Some(json!({"type": "json_schema", "json_schema": json_schema}))
            }
            _ => {
                return Err(invalid(
                    "text.format.type",
                    "text.format.type is \"text\", \"json_object\" or \"json_schema\"",
                ))
            }
        },
    };
    let mut echo = obj;
    if echo.get("format").is_none_or(Value::is_null) {
        echo.insert("format".into(), json!({"type": "text"}));
    }
    Ok((response_format, Value::Object(echo)))
}

/// `tools` in chat's shape (`{"type": "function", "function": {...}}`), and as given (for the
/// echo). Built-in tools are refused, naming their `type`.
fn chat_tools(tools: Option<Value>) -> Result<(Option<Value>, Vec<Value>), ApiError> {
    let list = match tools {
        None | Some(Value::Null) => return Ok((None, Vec::new())),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(invalid("tools", "tools is a list")),
    };
    // Chat's validation bounds the count; a list longer than any bound is not copied.
    if list.len() > MAX_MESSAGES {
        return Err(invalid("tools", "too many tools"));
    }
    let mut chat = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let obj = tool
            .as_object()
            .ok_or_else(|| invalid(format!("tools[{i}]"), "a tool is an object"))?;
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                let shown: String = other.chars().take(64).collect();
                return Err(invalid(
                    format!("tools[{i}].type"),
                    format!(
                        "tools of type {shown:?} are not supported: only \"function\" tools \
                         (built-in tools such as web_search or file_search run at OpenAI)"
                    ),
                ));
            }
            None => return Err(invalid(format!("tools[{i}].type"), "a tool needs a type")),
        }
        if obj.contains_key("function") {
            return Err(invalid(
                format!("tools[{i}].function"),
                "a Responses tool has name, description, parameters and strict beside its \
                 type, not under \"function\" (that is the chat completions shape)",
            ));
        }
        let mut function = Map::new();
        for (key, value) in obj {
            match key.as_str() {
                "type" => {}
                "name" | "description" | "parameters" | "strict" => {
                    function.insert(key.clone(), value.clone());
                }
                other => {
                    let shown: String = other.chars().take(64).collect();
                    return Err(invalid(
                        format!("tools[{i}].{shown}"),
                        "a function tool takes name, description, parameters and strict",
                    ));
                }
            }
        }
        chat.push(json!({"type": "function", "function": function}));
    }
    Ok((Some(Value::Array(chat)), list))
}

/// `tool_choice` in chat's shape.
fn chat_tool_choice(choice: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if matches!(s.as_str(), "none" | "auto" | "required") => {
            Ok(Some(Value::String(s.clone())))
        }
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                invalid(
                    "tool_choice",
                    "a named tool_choice is {\"type\": \"function\", \"name\": ...}",
                )
            })?;
            Ok(Some(
                json!({"type": "function", "function": {"name": name}}),
            ))
        }
        Some(Value::Object(o)) => {
            let shown: String = o
                .get("type")
                .map(|t| t.as_str().map_or_else(|| t.to_string(), str::to_owned))
                .unwrap_or_default()
                .chars()
                .take(64)
                .collect();
            Err(invalid(
                "tool_choice",
                format!(
                    "tool_choice of type {shown:?} is not supported: only \"none\", \"auto\", \
                     \"required\" or {{\"type\": \"function\", \"name\": ...}}"
                ),
            ))
        }
        Some(_) => Err(invalid(
            "tool_choice",
            "tool_choice is \"none\", \"auto\", \"required\" or {\"type\": \"function\", \
             \"name\": ...}",
        )),
    }
}

/// The chat messages of `instructions`, a continued conversation's `history` and `input`,
/// each with the field it came from (`previous_response_id` for the history's).
fn messages(
    instructions: Option<&str>,
    history: &[Value],
    input: &Value,
) -> Result<(Vec<MessageField>, Vec<String>), ApiError> {
    let mut messages = Vec::new();
    let mut sources = Vec::new();
    if let Some(text) = instructions {
        messages.push(message("system", ContentField::Text(text.to_owned())));
        sources.push("instructions".to_owned());
    }
    let given = match input {
        Value::Array(items) => items.len(),
        _ => 1,
    };
    // The input alone past the bound is the input's fault, not a continued conversation's.
    if given > MAX_MESSAGES {
        return Err(invalid(
            "input",
            format!("at most {MAX_MESSAGES} input items are allowed, got {given}"),
        ));
    }
    if history.len().saturating_add(given) > MAX_MESSAGES {
        return Err(invalid(
            "previous_response_id",
            format!(
                "the conversation would hold {} items with this input: at most {MAX_MESSAGES} \
                 are allowed",
                history.len().saturating_add(given)
            ),
        ));
    }
    for (i, item) in history.iter().enumerate() {
        let before = sources.len();
        read_item(i, item, &mut messages, &mut sources)?;
        for source in &mut sources[before..] {
            "previous_response_id".clone_into(source);
        }
    }
    // The input's items are numbered from 0 (their own field), after the history's messages.
    match input {
        Value::String(text) => {
            messages.push(message("user", ContentField::Text(text.clone())));
            sources.push("input".to_owned());
        }
        Value::Array(items) => {
            if items.is_empty() {
                return Err(invalid("input", "input must not be empty"));
            }
            for (i, item) in items.iter().enumerate() {
                read_item(i, item, &mut messages, &mut sources)?;
            }
        }
        _ => {
            return Err(invalid(
                "input",
                "input is a string or a list of input items",
            ))
        }
    }
    Ok((messages, sources))
}

/// `input` as a stored response's `input_items` (see [`ResponsesChat::input_items`]); `input`
/// was read by [`messages`] already.
fn input_items(input: &Value) -> Vec<Value> {
    let items = match input {
        Value::String(text) => vec![json!({
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        })],
        Value::Array(items) => items.clone(),
        _ => Vec::new(),
    };
    items
        .into_iter()
        .map(|mut item| {
            if let Value::Object(obj) = &mut item {
                if obj.get("type").is_none_or(Value::is_null) {
                    obj.insert("type".into(), json!("message"));
                }
                let kind = obj.get("type").and_then(Value::as_str).unwrap_or("");
                let prefix = match kind {
                    "message" => "msg_",
                    "function_call" => "fc_",
                    "function_call_output" => "fco_",
                    "reasoning" => "rs_",
                    _ => "item_",
                };
                if kind == "message" {
                    let assistant = obj.get("role").and_then(Value::as_str) == Some("assistant");
                    if let Some(Value::String(text)) = obj.get("content") {
                        let part = if assistant {
                            json!({"type": "output_text", "text": text, "annotations": []})
                        } else {
                            json!({"type": "input_text", "text": text})
                        };
                        obj.insert("content".into(), json!([part]));
                    }
                }
                if obj.get("id").is_none_or(|id| !id.is_string()) {
                    obj.insert("id".into(), json!(request_id(prefix, None)));
                }
            }
            item
        })
        .collect()
}

fn message(role: &str, content: ContentField) -> MessageField {
    MessageField {
        role: role.to_owned(),
        content: Some(content),
        name: None,
        tool_calls: None,
        tool_call_id: None,
    }
}

/// A string field of item `i`.
fn item_str<'a>(i: usize, item: &'a Map<String, Value>, field: &str) -> Result<&'a str, ApiError> {
    item.get(field).and_then(Value::as_str).ok_or_else(|| {
        invalid(
            format!("input[{i}].{field}"),
            format!("{field} is a string"),
        )
    })
}

/// Reads input item `i` into chat messages.
fn read_item(
    i: usize,
    item: &Value,
    messages: &mut Vec<MessageField>,
    sources: &mut Vec<String>,
) -> Result<(), ApiError> {
    let at = |field: &str| format!("input[{i}]{field}");
    let obj = item
        .as_object()
        .ok_or_else(|| invalid(at(""), "an input item is an object"))?;
    let kind = match obj.get("type") {
        None | Some(Value::Null) => "message",
        Some(Value::String(t)) => t.as_str(),
        Some(_) => return Err(invalid(at(".type"), "type is a string")),
    };
    match kind {
        "message" => {
            let role = item_str(i, obj, "role")?;
            let assistant = match role {
                "user" | "system" | "developer" => false,
                "assistant" => true,
                other => {
                    let shown: String = other.chars().take(32).collect();
                    return Err(invalid(
                        at(".role"),
                        format!(
                            "role {shown:?} is not supported: user, system, developer or \
                             assistant"
                        ),
                    ));
                }
            };
            let content = match obj.get("content") {
                Some(Value::String(s)) => ContentField::Text(s.clone()),
                Some(Value::Array(parts)) => {
                    let mut out = Vec::with_capacity(parts.len());
                    for (j, part) in parts.iter().enumerate() {
                        out.push(content_part(i, j, part, assistant)?);
                    }
                    ContentField::Parts(out)
                }
                _ => {
                    return Err(invalid(
                        at(".content"),
                        "content is a string or a list of content parts",
                    ))
                }
            };
            messages.push(message(role, content));
            sources.push(at(""));
        }
        "function_call" => {
            let call_id = item_str(i, obj, "call_id")?;
            let name = item_str(i, obj, "name")?;
            let arguments = item_str(i, obj, "arguments")?;
            let call = json!({
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            });
            // Calls in a row (after the assistant's text, or after each other) are one
            // assistant turn, as the model wrote them.
            match messages.last_mut() {
                Some(last) if last.role == "assistant" => match &mut last.tool_calls {
                    Some(Value::Array(calls)) => calls.push(call),
                    _ => last.tool_calls = Some(Value::Array(vec![call])),
                },
                _ => {
                    messages.push(MessageField {
                        role: "assistant".to_owned(),
                        content: None,
                        name: None,
                        tool_calls: Some(Value::Array(vec![call])),
                        tool_call_id: None,
                    });
                    sources.push(at(""));
                }
            }
        }
        "function_call_output" => {
            let call_id = item_str(i, obj, "call_id")?;
            let output = match obj.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut texts = Vec::with_capacity(parts.len());
                    for (j, part) in parts.iter().enumerate() {
                        match part.get("type").and_then(Value::as_str) {
                            Some("input_text") => match part.get("text").and_then(Value::as_str) {
                                Some(t) => texts.push(t),
                                None => {
                                    return Err(invalid(
                                        at(&format!(".output[{j}].text")),
                                        "an input_text part needs its text",
                                    ))
                                }
                            },
                            _ => {
                                return Err(invalid(
                                    at(&format!(".output[{j}].type")),
                                    "only input_text output parts are supported",
                                ))
                            }
                        }
                    }
                    texts.join("\n")
                }
                _ => {
                    return Err(invalid(
                        at(".output"),
                        "output is a string or a list of input_text parts",
                    ))
                }
            };
            messages.push(MessageField {
                role: "tool".to_owned(),
                content: Some(ContentField::Text(output)),
                name: None,
                tool_calls: None,
                tool_call_id: Some(call_id.to_owned()),
            });
            sources.push(at(""));
        }
        // A reasoning item of an earlier answer, sent back with the rest of its output (as
        // OpenAI asks clients managing the conversation themselves to do): accepted, and not
        // rendered. The messages carry no reasoning to a chat template here, and templates of
        // reasoning models (Qwen3's) leave earlier turns' thinking out of the prompt.
        "reasoning" => {}
        other => {
            let shown: String = other.chars().take(64).collect();
            return Err(invalid(
                at(".type"),
                format!(
                    "input items of type {shown:?} are not supported: message, function_call, \
                     function_call_output and reasoning"
                ),
            ));
        }
    }
    Ok(())
}

/// Content part `j` of message item `i` as chat's text part.
fn content_part(
    i: usize,
    j: usize,
    part: &Value,
    assistant: bool,
) -> Result<ContentPart, ApiError> {
    let at = |field: &str| format!("input[{i}].content[{j}]{field}");
    let (expected, field) = if assistant {
        ("output_text", "text")
    } else {
        ("input_text", "text")
    };
    match part.get("type").and_then(Value::as_str) {
        Some(t) if t == expected => {}
        Some("refusal") if assistant => {
            let refusal = part
                .get("refusal")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(at(".refusal"), "a refusal part needs its refusal"))?;
            return Ok(ContentPart {
                kind: "refusal".to_owned(),
                text: None,
                refusal: Some(refusal.to_owned()),
            });
        }
        _ => {
            return Err(invalid(
                at(".type"),
                if assistant {
                    "only output_text and refusal parts are supported in an assistant message"
                } else {
                    "only input_text parts are supported (no images, files or audio)"
                },
            ))
        }
    }
    let text = part
        .get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(at(".text"), format!("an {expected} part needs its text")))?;
    Ok(ContentPart {
        kind: "text".to_owned(),
        text: Some(text.to_owned()),
        refusal: None,
    })
}

/// `usage` of a response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseUsage {
    /// Prompt tokens.
    pub input_tokens: u32,
    /// `{"cached_tokens": ...}`: the prompt tokens the prefix cache served (as chat's
    /// `usage.prompt_tokens_details`).
    pub input_tokens_details: PromptTokensDetails,
    /// Generated tokens.
    pub output_tokens: u32,
    /// `{"reasoning_tokens": 0}`: a reasoning item's tokens are not counted apart.
    pub output_tokens_details: Value,
    /// Input and output.
    pub total_tokens: u32,
}

impl ResponseUsage {
    /// The usage of `input` prompt tokens, `cached` of them served by the prefix cache, and
    /// `output` generated ones.
    pub fn new(input: u32, cached: u32, output: u32) -> Self {
        Self {
            input_tokens: input,
            input_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
            output_tokens: output,
            output_tokens_details: json!({"reasoning_tokens": 0}),
            total_tokens: input.saturating_add(output),
        }
    }
}

/// An `output_text` content part.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputText {
    /// `output_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The text.
    pub text: String,
    /// Always empty: no citations are made here.
    pub annotations: Vec<Value>,
    /// The text's tokens' logprobs, with `include: ["message.output_text.logprobs"]` (empty
    /// otherwise, as OpenAI sends it).
    pub logprobs: Vec<OutputLogprob>,
}

impl OutputText {
    /// A part holding `text`.
    pub fn new(text: String) -> Self {
        Self {
            kind: "output_text",
            text,
            annotations: Vec::new(),
            logprobs: Vec::new(),
        }
    }
}

/// One token's logprob in an `output_text` part (the openai SDK's `Logprob`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputLogprob {
    /// The token's text.
    pub token: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Its log probability (see [`shortest`]).
    pub logprob: f64,
    /// The most likely alternatives, best first (`top_logprobs` of them).
    pub top_logprobs: Vec<OutputTopLogprob>,
}

/// One alternative of an [`OutputLogprob`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputTopLogprob {
    /// The token's text.
    pub token: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Its log probability (see [`shortest`]).
    pub logprob: f64,
}

/// `x` as the f64 of its shortest decimal form: the events are JSON values (where an f32
/// becomes its exact f64, `-2.223909378051758`), the response object is serialized directly
/// (`-2.2239094`); both print the same number this way.
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

impl OutputLogprob {
    /// The engine's logprobs of generated tokens in this shape (the chat shape's values).
    pub fn from_engine(logprobs: &[crate::engine::TokenLogprob]) -> Vec<Self> {
        super::response::ChatLogprobs::from_engine(logprobs)
            .content
            .into_iter()
            .map(|t| Self {
                token: t.token,
                bytes: t.bytes,
                logprob: shortest(t.logprob),
                top_logprobs: t
                    .top_logprobs
                    .into_iter()
                    .map(|a| OutputTopLogprob {
                        token: a.token,
                        bytes: a.bytes,
                        logprob: shortest(a.logprob),
                    })
                    .collect(),
            })
            .collect()
    }
}

/// One item of a response's `output`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The assistant's text.
    Message {
        /// `msg_...`.
        id: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
        /// `assistant`.
        role: &'static str,
        /// One `output_text` part.
        content: Vec<OutputText>,
    },
    /// A call of one of the request's functions.
    FunctionCall {
        /// `fc_...`.
        id: String,
        /// The id a `function_call_output` item answers.
        call_id: String,
        /// The function.
        name: String,
        /// Its arguments, a JSON object's text.
        arguments: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
    },
    /// A reasoning model's thinking (its `<think>` block), read apart from the answer as chat's
    /// `reasoning_content` is.
    Reasoning {
        /// `rs_...`.
        id: String,
        /// Always empty: no summaries are written here.
        summary: Vec<Value>,
        /// One `reasoning_text` part.
        content: Vec<ReasoningText>,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
    },
}

/// A `reasoning_text` content part: a reasoning item's text.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReasoningText {
    /// `reasoning_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The text.
    pub text: String,
}

impl ReasoningText {
    /// A part holding `text`.
    pub fn new(text: String) -> Self {
        Self {
            kind: "reasoning_text",
            text,
        }
    }
}

/// `incomplete_details`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: &'static str,
}

/// The response object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseObject {
    /// `resp_...`.
    pub id: String,
    /// `response`.
    pub object: &'static str,
    /// Unix seconds.
    pub created_at: u64,
    /// Unix seconds, once the response completed (absent before, and when incomplete).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<u64>,
    /// `in_progress`, `completed` or `incomplete`; a background response `queued` until it
    /// ends, or `failed` or `cancelled`.
    pub status: &'static str,
    /// Null, but for a failed background response (`code`, `message`); a foreground failure
    /// is an HTTP error or a stream's `error` event.
    pub error: Option<Value>,
    /// Why the response is incomplete.
    pub incomplete_details: Option<IncompleteDetails>,
    /// The request's `instructions`.
    pub instructions: Option<String>,
    /// The request's `max_output_tokens`.
    pub max_output_tokens: Option<u32>,
    /// The model (or adapter) that answered.
    pub model: String,
    /// The output items.
    pub output: Vec<OutputItem>,
    /// The request's `parallel_tool_calls`.
    pub parallel_tool_calls: bool,
    /// The request's `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// The request's `reasoning`.
    pub reasoning: Option<Value>,
    /// Whether the response is stored (the request's `store`, false where storing is off).
    pub store: bool,
    /// The temperature used.
    pub temperature: f32,
    /// The request's `text`.
    pub text: Value,
    /// The request's `tool_choice`.
    pub tool_choice: Value,
    /// The request's `tools`.
    pub tools: Vec<Value>,
    /// The top_p used.
    pub top_p: f32,
    /// The request's `truncation`: `disabled` or `auto`.
    pub truncation: &'static str,
    /// Null until the response is done.
    pub usage: Option<ResponseUsage>,
    /// The request's `user`.
    pub user: Option<String>,
    /// The request's `metadata`.
    pub metadata: Map<String, Value>,
    /// The request's `background`.
    pub background: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: Value) -> Result<ResponsesChat, ApiError> {
        let request: ResponsesRequest = serde_json::from_value(body).unwrap();
        request.into_chat(&[])
    }

    fn refused(body: Value) -> String {
        match read(body) {
            Err(ApiError::InvalidRequest { param, .. }) => param.expect("a named field"),
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    fn texts(chat: &ChatRequest) -> Vec<(String, String)> {
        chat.messages
            .iter()
            .map(|m| {
                let text = match &m.content {
                    None => String::new(),
                    Some(ContentField::Text(t)) => t.clone(),
                    Some(ContentField::Parts(parts)) => parts
                        .iter()
                        .map(|p| p.text.clone().or(p.refusal.clone()).unwrap_or_default())
                        .collect::<Vec<_>>()
                        .join("|"),
                };
                (m.role.clone(), text)
            })
            .collect()
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    /// OpenAI's and vLLM's reading: instructions first as a system message, a string input
    /// one user message.
    #[test]
    fn a_string_input_is_one_user_message_after_the_instructions() {
        let r = read(json!({"model": "m", "input": "Hi", "instructions": "Be brief"})).unwrap();
        assert_eq!(
            texts(&r.chat),
            pairs(&[("system", "Be brief"), ("user", "Hi")])
        );
        assert_eq!(r.sources, ["instructions", "input"]);
        assert_eq!(r.echo.tool_choice, json!("auto"));
        assert_eq!(r.echo.text, json!({"format": {"type": "text"}}));
        assert!(r.echo.store && r.echo.parallel_tool_calls);
    }

    #[test]
    fn message_items_keep_roles_and_part_texts() {
        let r = read(json!({"input": [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "c", "annotations": []}]},
            {"role": "user", "content": "d"},
        ]}))
        .unwrap();
        assert_eq!(
            texts(&r.chat),
            pairs(&[
                ("developer", "rules"),
                ("user", "a|b"),
                ("assistant", "c"),
                ("user", "d")
            ])
        );
        assert_eq!(r.sources, ["input[0]", "input[1]", "input[2]", "input[3]"]);
    }

    /// An earlier answer's output sent back whole, its reasoning item included (as OpenAI
    /// asks of clients that manage the conversation): the reasoning is not rendered, and the
    /// call after it still joins the assistant's turn.
    #[test]
    fn reasoning_items_sent_back_are_accepted_and_not_rendered() {
        let r = read(json!({"input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "The user wants weather."}],
             "status": "completed"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]}))
        .unwrap();
        assert_eq!(
            texts(&r.chat),
            pairs(&[
                ("user", "weather?"),
                ("assistant", "Checking."),
                ("tool", "sunny")
            ])
        );
        assert!(r.chat.messages[1].tool_calls.is_some());
        assert_eq!(r.sources, ["input[0]", "input[2]", "input[4]"]);
    }

    /// A tool round trip: the call item joins the assistant's turn as chat's `tool_calls`,
    /// its output a `tool` message answering the call id.
    #[test]
    fn function_call_items_become_tool_calls_and_tool_messages() {
        let r = read(json!({"input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
             "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "noon"}]},
        ]}))
        .unwrap();
        let m = &r.chat.messages;
        assert_eq!(m.len(), 4);
        assert_eq!(m[1].role, "assistant");
        assert_eq!(
            m[1].tool_calls,
            Some(json!([
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_2", "type": "function",
                 "function": {"name": "get_time", "arguments": "{}"}},
            ]))
        );
        assert_eq!(m[2].role, "tool");
        assert_eq!(m[2].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(texts(&r.chat)[2].1, "sunny");
        assert_eq!(texts(&r.chat)[3].1, "noon");
        assert_eq!(r.sources, ["input[0]", "input[1]", "input[3]", "input[4]"]);
    }

    /// Responses' tool shape (name and parameters beside type) becomes chat's.
    #[test]
    fn tools_and_tool_choice_take_the_chat_shape() {
        let tool = json!({"type": "function", "name": "f", "description": "d",
                          "parameters": {"type": "object"}, "strict": true});
        let r = read(json!({"input": "x", "tools": [tool],
                            "tool_choice": {"type": "function", "name": "f"}}))
        .unwrap();
        assert_eq!(
            r.chat.tools,
            Some(
                json!([{"type": "function", "function": {"name": "f", "description": "d",
                         "parameters": {"type": "object"}, "strict": true}}])
            )
        );
        assert_eq!(
            r.chat.tool_choice,
            Some(json!({"type": "function", "function": {"name": "f"}}))
        );
        assert_eq!(r.echo.tools, vec![tool]);
        assert_eq!(r.echo.tool_choice, json!({"type": "function", "name": "f"}));
    }

    #[test]
    fn text_format_becomes_response_format() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let r = read(
            json!({"input": "x", "text": {"format": {"type": "json_schema",
            "name": "s", "schema": schema, "strict": true}}}),
        )
        .unwrap();
        assert_eq!(
            r.chat.structured.response_format,
            Some(json!({"type": "json_schema",
                        "json_schema": {"name": "s", "schema": schema, "strict": true}}))
        );
        let r = read(json!({"input": "x", "text": {"format": {"type": "json_object"}}})).unwrap();
        assert_eq!(
            r.chat.structured.response_format,
            Some(json!({"type": "json_object"}))
        );
        let r = read(json!({"input": "x", "text": {"format": {"type": "text"}}})).unwrap();
        assert_eq!(r.chat.structured.response_format, None);
    }

    /// A continued conversation: the stored turns' items come first (their input, then their
    /// output as it was sent), the earlier instructions are not carried over, and the new
    /// input follows; messages from the history are named by `previous_response_id`.
    #[test]
    fn a_continued_conversation_puts_the_history_before_the_input() {
        let history = [
            json!({"id": "msg_1", "type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "My name is Ada."}]}),
            json!({"id": "rs_1", "type": "reasoning", "summary": [],
                   "content": [{"type": "reasoning_text", "text": "greet"}],
                   "status": "completed"}),
            json!({"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "Hello Ada.", "annotations": []}]}),
            json!({"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f",
                   "arguments": "{}", "status": "completed"}),
        ];
        let request: ResponsesRequest = serde_json::from_value(json!({
            "input": [{"type": "function_call_output", "call_id": "call_1", "output": "42"},
                      {"role": "user", "content": "And my name?"}],
            "instructions": "Be brief.",
            "previous_response_id": "resp_0",
        }))
        .unwrap();
        let r = request.into_chat(&history).unwrap();
        assert_eq!(
            texts(&r.chat),
            pairs(&[
                ("system", "Be brief."),
                ("user", "My name is Ada."),
                ("assistant", "Hello Ada."),
                ("tool", "42"),
                ("user", "And my name?"),
            ])
        );
        // The earlier answer's call joined its text: one assistant turn.
        assert_eq!(
            r.chat.messages[2].tool_calls,
            Some(json!([{"id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]))
        );
        assert_eq!(
            r.sources,
            [
                "instructions",
                "previous_response_id",
                "previous_response_id",
                "input[0]",
                "input[1]"
            ]
        );
        assert_eq!(r.echo.previous_response_id.as_deref(), Some("resp_0"));
        // Only this request's input is its own input_items.
        assert_eq!(r.input_items.len(), 2);
    }

    #[test]
    fn a_conversation_longer_than_the_bound_is_refused() {
        let item = json!({"role": "user", "content": "x"});
        let history = vec![item; MAX_MESSAGES];
        let request: ResponsesRequest =
            serde_json::from_value(json!({"input": "y", "previous_response_id": "resp_0"}))
                .unwrap();
        match request.into_chat(&history) {
            Err(ApiError::InvalidRequest { param, .. }) => {
                assert_eq!(param.as_deref(), Some("previous_response_id"))
            }
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    /// An input with more items than the bound is refused naming `input`, with or without a
    /// continued conversation (it named `previous_response_id`, a field the client may not
    /// have sent).
    #[test]
    fn an_input_longer_than_the_bound_is_refused_naming_input() {
        let item = json!({"role": "user", "content": "x"});
        let input = vec![item.clone(); MAX_MESSAGES + 1];
        for (body, history) in [
            (json!({"input": input}), vec![]),
            (
                json!({"input": input, "previous_response_id": "resp_0"}),
                vec![item],
            ),
        ] {
            let request: ResponsesRequest = serde_json::from_value(body).unwrap();
            match request.into_chat(&history) {
                Err(ApiError::InvalidRequest { param, .. }) => {
                    assert_eq!(param.as_deref(), Some("input"))
                }
                other => panic!("expected a 400, got {other:?}"),
            }
        }
    }

    /// `input_items` as OpenAI lists them: typed items with ids, string contents as parts.
    #[test]
    fn input_items_are_typed_with_ids_and_parts() {
        let one = read(json!({"input": "hi"})).unwrap().input_items;
        assert_eq!(one.len(), 1);
        assert_eq!(one[0]["type"], "message");
        assert_eq!(one[0]["role"], "user");
        assert_eq!(
            one[0]["content"],
            json!([{"type": "input_text", "text": "hi"}])
        );
        assert!(one[0]["id"].as_str().unwrap().starts_with("msg_"));
        let items = read(json!({"input": [
            {"role": "assistant", "content": "earlier"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
             "id": "fc_given"},
            {"type": "function_call_output", "call_id": "c", "output": "1"},
        ]}))
        .unwrap()
        .input_items;
        assert_eq!(
            items[0]["content"],
            json!([{"type": "output_text", "text": "earlier", "annotations": []}])
        );
        assert_eq!(items[1]["id"], "fc_given");
        assert!(items[2]["id"].as_str().unwrap().starts_with("fco_"));
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_by_name() {
        let cases = [
            (
                json!({"input": "x", "previous_response_id": 7}),
                "previous_response_id",
            ),
            (
                json!({"input": "x", "previous_response_id": ""}),
                "previous_response_id",
            ),
            (
                json!({"input": "x", "previous_response_id": "r".repeat(MAX_RESPONSE_ID_BYTES + 1)}),
                "previous_response_id",
            ),
            (
                json!({"input": "x", "conversation": "conv_1"}),
                "conversation",
            ),
            (
                json!({"input": "x", "reasoning": {"effort": "extreme"}}),
                "reasoning.effort",
            ),
            (
                json!({"input": "x", "reasoning": {"summary": "auto"}}),
                "reasoning.summary",
            ),
            (
                json!({"input": "x", "reasoning": {"effort": "low", "budget": 3}}),
                "reasoning.budget",
            ),
            (json!({"input": "x", "reasoning": "high"}), "reasoning"),
            (
                json!({"input": "x", "background": true, "store": false}),
                "background",
            ),
            (json!({"input": "x", "prompt": {"id": "p"}}), "prompt"),
            (
                json!({"input": "x", "include": ["reasoning.encrypted_content"]}),
                "include[0]",
            ),
            (
                json!({"input": "x", "include": [INCLUDE_LOGPROBS, "file_search_call.results"]}),
                "include[1]",
            ),
            (json!({"input": "x", "include": "x"}), "include"),
            (json!({"input": "x", "top_logprobs": 2}), "top_logprobs"),
            (json!({"input": "x", "truncation": "middle"}), "truncation"),
            (json!({"input": "x", "truncation": true}), "truncation"),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools[0].type",
            ),
            (
                json!({"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}),
                "tools[0].function",
            ),
            (
                json!({"input": "x", "tool_choice": {"type": "file_search"}}),
                "tool_choice",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "xml"}}}),
                "text.format.type",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}),
                "text.format.schema",
            ),
            (
                json!({"input": "x", "text": {"verbosity": "low"}}),
                "text.verbosity",
            ),
            (json!({"input": []}), "input"),
            (json!({"input": 3}), "input"),
            (
                json!({"input": [{"type": "web_search_call", "id": "ws_1"}]}),
                "input[0].type",
            ),
            (
                json!({"input": [{"role": "tool", "content": "x"}]}),
                "input[0].role",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                "input[0].content[0].type",
            ),
            (
                json!({"input": [{"role": "assistant", "content": [{"type": "input_text", "text": "a"}]}]}),
                "input[0].content[0].type",
            ),
            (
                json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "input[0].call_id",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
                "input[0].output",
            ),
        ];
        for (body, param) in cases {
            assert_eq!(refused(body.clone()), param, "{body}");
        }
        // `store` either way, and an empty include, are accepted.
        for body in [
            json!({"input": "x", "store": true}),
            json!({"input": "x", "store": false}),
            json!({"input": "x", "include": [], "reasoning": null, "background": false}),
            // An effort is checked and, as chat's reasoning_effort, read by no model here;
            // empty settings mean what null does.
            json!({"input": "x", "reasoning": {"effort": "low"}}),
            json!({"input": "x", "reasoning": {}}),
            json!({"input": "x", "reasoning": {"effort": null, "summary": null}}),
        ] {
            assert!(read(body.clone()).is_ok(), "{body}");
        }
        let r = read(json!({"input": "x", "reasoning": {"effort": "high"}})).unwrap();
        assert_eq!(r.echo.reasoning, Some(json!({"effort": "high"})));
    }

    /// OpenAI's bounds: 16 pairs, keys of 64 characters, string values of 512.
    #[test]
    fn metadata_is_bounded_as_openai_bounds_it() {
        let many: Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        assert_eq!(refused(json!({"input": "x", "metadata": many})), "metadata");
        let fits: Map<String, Value> = (0..16).map(|i| (format!("k{i}"), json!("v"))).collect();
        assert_eq!(
            read(json!({"input": "x", "metadata": fits.clone()}))
                .unwrap()
                .echo
                .metadata,
            fits
        );
        let long_key = "k".repeat(65);
        assert_eq!(
            refused(json!({"input": "x", "metadata": {long_key: "v"}})),
            "metadata"
        );
        assert!(read(json!({"input": "x", "metadata": {"k".repeat(64): "v".repeat(512)}})).is_ok());
        assert_eq!(
            refused(json!({"input": "x", "metadata": {"a": "v".repeat(513)}})),
            "metadata.a"
        );
        assert_eq!(
            refused(json!({"input": "x", "metadata": {"a": 1}})),
            "metadata.a"
        );
    }

    /// Chat's validation names chat's fields; the client hears its own.
    #[test]
    fn chat_fields_are_renamed_to_the_responses_fields() {
        let sources = [
            "instructions".to_owned(),
            "input[0]".to_owned(),
            "input[2]".to_owned(),
        ];
        for (chat, responses) in [
            ("messages[1].content", "input[0].content"),
            ("messages[2].tool_call_id", "input[2].call_id"),
            ("messages[2].tool_calls[0].function.arguments", "input[2]"),
            ("messages[0].content", "instructions"),
            ("messages", "input"),
            ("prompt", "input"),
            ("max_completion_tokens", "max_output_tokens"),
            ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format", "text.format"),
            ("tools[1].function.parameters", "tools[1].parameters"),
            ("tools", "tools"),
            ("temperature", "temperature"),
        ] {
            assert_eq!(rename_param(chat, &sources), responses);
        }
    }

    /// A message that names chat's field names the Responses field (`max_output_tokens: 0`
    /// was "max_completion_tokens must be at least 1"); other messages are kept.
    #[test]
    fn a_message_naming_a_chat_field_names_the_responses_field() {
        let sources = ["input[0]".to_owned()];
        // The engine's refusal of a length too large, in vLLM's words for chat.
        let engine = crate::engine::EngineError::new(
            crate::engine::EngineErrorKind::ContextLengthExceeded,
            "'max_tokens' or 'max_completion_tokens' is too large: 100000. This model's maximum \
             context length is 8192 tokens",
        )
        .with_param("max_completion_tokens");
        match rename_error(ApiError::Engine(engine), &sources) {
            ApiError::Engine(e) => assert_eq!(
                (e.message.as_str(), e.param.as_deref()),
                (
                    "'max_output_tokens' is too large: 100000. This model's maximum context \
                     length is 8192 tokens",
                    Some("max_output_tokens")
                )
            ),
            other => panic!("not an engine error: {other:?}"),
        }
        let message = |param: &str, text: &str| {
            let renamed = rename_error(ApiError::invalid(param, text.to_owned()), &sources);
            match renamed {
                ApiError::InvalidRequest { message, param } => (message, param),
                other => panic!("not an invalid request: {other:?}"),
            }
        };
        assert_eq!(
            message(
                "max_completion_tokens",
                "max_completion_tokens must be at least 1"
            ),
            (
                "max_output_tokens must be at least 1".to_owned(),
                Some("max_output_tokens".to_owned())
            )
        );
        assert_eq!(
            message("messages", "messages must not be empty").0,
            "input must not be empty"
        );
        assert_eq!(
            message(
                "messages[0].tool_call_id",
                "tool_call_id \"c1\" answers no tool call of an earlier assistant message"
            ),
            (
                "call_id \"c1\" answers no tool call of an earlier assistant message".to_owned(),
                Some("input[0].call_id".to_owned())
            )
        );
        assert_eq!(
            message("max_completion_tokens", "max_completion_tokens_x is odd").0,
            "max_completion_tokens_x is odd"
        );
        assert_eq!(
            message("temperature", "temperature must be in [0, 2], got 3").0,
            "temperature must be in [0, 2], got 3"
        );
    }
}
