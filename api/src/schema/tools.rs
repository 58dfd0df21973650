//! Tool calling on `/v1/chat/completions`: OpenAI's `tools`, `tool_choice` and
//! `parallel_tool_calls`, assistant messages carrying `tool_calls`, and `tool` messages.
//!
//! The model writes calls in one of four formats ([`ToolFormat`]), chosen by the server for the
//! model (by default from its chat template). Where the chat template writes tools by itself, it writes
//! the tools, and the conversation's calls and results, itself ([`ToolSetup::template`]); the
//! placements below are the server's own, for templates that know nothing of tools:
//! - **Hermes**, which Qwen 2.5 and later, Hermes and SmolLM3 are trained on, and the default
//!   for any other model. The tools' signatures go into the system message as JSON lines inside
//!   `<tools></tools>`. A call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`;
//!   several calls are separated by newlines, and text may come before them. A tool's result
//!   goes back as a user turn holding `<tool_response>\n...\n</tool_response>` (consecutive
//!   results share one turn).
//! - **Llama 3 JSON**, Meta's format for Llama 3.1 to 3.3. The tools' signatures go at the head
//!   of the first user message in Meta's words, as JSON. A call is the whole answer,
//!   `{"name": ..., "parameters": {...}}`; several calls are separated by `"; "`. A tool's result
//!   goes back as a `tool` message, which Llama 3's templates render as the `ipython` turn.
//! - **Mistral**, the format of Mistral 7B Instruct v0.3 and the other models of Mistral's v3
//!   tokenizer (`tools/mistral.rs`). The tools go in `[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]`
//!   at the head of the first user message; the calls are one JSON list after `[TOOL_CALLS]`,
//!   `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, and text may come before it. Calls
//!   in the conversation carry their ids as Mistral's templates require them (9 letters and
//!   digits); Mistral's form of a result, naming the id of the call it answers, is
//!   [`render_result`]'s.
//! - **Mistral v11**, the format of Mistral's tokenizers from v11 on (Mistral Small 3.2,
//!   Magistral, Devstral, Ministral 3; `tools/mistral_v11.rs`): each call is `[TOOL_CALLS]name[ARGS]{...}`,
//!   after any text; the tools go in `[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]`, a result in
//!   `[TOOL_RESULTS]...[/TOOL_RESULTS]`.
//!
//! The output is held to the format by a grammar in llguidance's Lark dialect, which the
//! engine runs like any structured output, so a call always parses and its arguments follow
//! the tool's `parameters` schema: `auto` allows either text (which may not contain
//! `<tool_call>` or `[TOOL_CALLS]`, or, in the Llama 3 format, begin with `{`) or calls,
//! `required` and a named function allow only calls. [`ToolStream`] reads the generated text
//! back into content and calls, incrementally for streams.

mod mistral;
mod mistral_v11;

use std::borrow::Cow;
use std::ops::Range;

use serde_json::{Map, Value};

use super::finite::check_finite_schema;
use super::held::{partial_tag, trim_space_end, MAX_HELD_SPACE};
use super::limits::MAX_STRUCTURED_BYTES;
use super::strict::check_strict_schema;
use crate::error::ApiError;

pub use mistral::{call_id as mistral_call_id, TOOL_CALLS};
pub use mistral_v11::{writes_call_ids, ARGS, CALL_ID};

/// A new id for a call the model wrote in `format`: OpenAI's `call_` and 32 hex digits
/// (`random_hex`), or Mistral's 9 letters and digits, which its templates require when the
/// call comes back in a conversation.
pub fn new_call_id(format: ToolFormat, random_hex: impl FnOnce() -> String) -> String {
    match format {
        ToolFormat::Mistral | ToolFormat::MistralV11 => mistral::new_call_id(),
        ToolFormat::Hermes | ToolFormat::Llama3Json => random_hex(),
    }
}

/// How a chat answer with tools is read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolAnswer {
    /// Text, or text then calls (`tool_choice: auto`).
    TextOrCalls,
    /// Calls only (`tool_choice: required`).
    Calls,
    /// The call of the function `tool_choice` names: calls only, and a choice that ends after
    /// it finishes with `stop`, as OpenAI's (and vLLM's) do.
    Named,
}

impl ToolAnswer {
    /// Whether the answer is calls only: no text may come.
    pub fn calls_only(self) -> bool {
        matches!(self, ToolAnswer::Calls | ToolAnswer::Named)
    }
}

/// How a model writes its calls (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, after any text.
    #[default]
    Hermes,
    /// `{"name": ..., "parameters": ...}` as the whole answer, several separated by `"; "`.
    Llama3Json,
    /// `[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]`, after any text.
    Mistral,
    /// `[TOOL_CALLS]name[ARGS]{...}` for each call, after any text.
    MistralV11,
}

impl ToolFormat {
    /// The format a chat template was written for: Mistral's v11 when it writes `[TOOL_CALLS]`
    /// and `[ARGS]`, Mistral's (v3) when it writes `[TOOL_CALLS]` and `[AVAILABLE_TOOLS]`,
    /// Llama 3's when it holds Meta's call instructions (Llama 3.1 to 3.3), Hermes otherwise.
    pub fn for_template(source: &str) -> Self {
        if mistral_v11::is_template(source) {
            Self::MistralV11
        } else if mistral::is_template(source) {
            Self::Mistral
        } else if !source.contains(CALL_OPEN)
            && source.contains("\"parameters\": dictionary of argument name and its value")
        {
            Self::Llama3Json
        } else {
            Self::Hermes
        }
    }

    /// Its name in configurations and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
            Self::MistralV11 => "mistral_v11",
        }
    }

    /// What opens a call: empty for Llama 3, whose calls are the whole answer, and for Mistral,
    /// whose list of calls opens once (read apart: [`mistral::list_open`]).
    fn open(self) -> &'static str {
        match self {
            Self::Hermes => CALL_OPEN,
            Self::MistralV11 => TOOL_CALLS,
            Self::Llama3Json | Self::Mistral => "",
        }
    }

    /// What follows a call's object: Hermes' closing tag, or Llama 3's separator (the last
    /// call has none). Mistral's (`,`, or the list's `]`) is read apart
    /// ([`mistral::after_arguments`]); a Mistral v11 call ends with its arguments.
    fn close(self) -> &'static str {
        match self {
            Self::Hermes => CALL_CLOSE,
            Self::Llama3Json => ";",
            Self::Mistral => ",",
            Self::MistralV11 => "",
        }
    }

    /// What marks the start of calls after text: `<tool_call>`, `[TOOL_CALLS]`; empty for
    /// Llama 3, whose calls are the whole answer.
    fn marker(self) -> &'static str {
        match self {
            Self::Hermes => CALL_OPEN,
            Self::Llama3Json => "",
            Self::Mistral | Self::MistralV11 => TOOL_CALLS,
        }
    }

    /// The markers that may be special tokens of the model's tokenizer (Mistral's), in the
    /// order of [`MarkerTokens`]' fields: `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`.
    pub fn special_markers(self) -> &'static [&'static str] {
        match self {
            Self::Hermes | Self::Llama3Json => &[],
            Self::Mistral => &[TOOL_CALLS],
            Self::MistralV11 => &[TOOL_CALLS, ARGS, CALL_ID],
        }
    }

    /// The key of a call's arguments.
    fn arguments_key(self) -> &'static str {
        match self {
            Self::Hermes | Self::Mistral | Self::MistralV11 => "arguments",
            Self::Llama3Json => "parameters",
        }
    }
}

/// Who writes a model's tools, and its conversation's calls and results, into the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ToolSetup {
    /// How the model writes calls: what the grammar allows and the reader reads.
    pub format: ToolFormat,
    /// Whether the chat template writes them, as Hugging Face's `apply_chat_template` and
    /// vLLM have it do: the callable tools go to its `tools` variable, assistant messages keep
    /// their `tool_calls` (each call's arguments an object) and `tool` messages their
    /// `tool_call_id`. Otherwise the server writes them as text in the model's format
    /// ([`ToolUse::prompt`], [`render_calls`], [`render_response`]), for templates that know
    /// nothing of tools.
    pub template: bool,
    /// The format's markers that are special tokens of the model's tokenizer (Mistral's
    /// `[TOOL_CALLS]`, and v11's `[ARGS]` and `[CALL_ID]`).
    pub markers: MarkerTokens,
    /// The model writes an id with each call (Mistral v11's templates that write calls as
    /// `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`, as some v11 templates do): the grammar has it
    /// write one, 9 letters and digits, as the template writes its calls.
    pub call_ids: bool,
}

impl From<ToolFormat> for ToolSetup {
    /// Calls in `format`, written into prompts by the server, the markers as text.
    fn from(format: ToolFormat) -> Self {
        ToolSetup {
            format,
            template: false,
            markers: MarkerTokens::default(),
            call_ids: false,
        }
    }
}

/// The ids of a format's markers where the model's tokenizer has them as special tokens (as
/// Mistral's do): the grammar writes those tokens (llguidance's `<[id]>`, which text cannot
/// spell), as the model was trained to, and the answer's text keeps those tokens (other special
/// tokens are still skipped) so that the reader sees them. `None`: that marker is text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MarkerTokens {
    /// `[TOOL_CALLS]`, which opens calls (both Mistral formats).
    pub calls: Option<u32>,
    /// `[ARGS]`, before a call's arguments (Mistral v11).
    pub args: Option<u32>,
    /// `[CALL_ID]`, before a call's id (Mistral v11, where a template writes ids).
    pub call_id: Option<u32>,
}

/// The special tokens whose text an answer keeps though special tokens are skipped: a tool
/// format's markers (three at most), then the reasoning's tags (two).
pub type KeptTokens = [Option<u32>; 5];

impl MarkerTokens {
    /// Those of `format`'s markers (the others are `None`).
    pub fn of(self, format: ToolFormat) -> Self {
        let has = |marker: &str| format.special_markers().contains(&marker);
        MarkerTokens {
            calls: self.calls.filter(|_| has(TOOL_CALLS)),
            args: self.args.filter(|_| has(ARGS)),
            call_id: self.call_id.filter(|_| has(CALL_ID)),
        }
    }

    /// The tokens, to keep in an answer's text.
    pub fn kept(self) -> KeptTokens {
        [self.calls, self.args, self.call_id, None, None]
    }
}

/// Opens a call (Hermes).
pub const CALL_OPEN: &str = "<tool_call>";
/// Closes a call (Hermes).
pub const CALL_CLOSE: &str = "</tool_call>";

/// Most tools in one request.
pub const MAX_TOOLS: usize = 128;
/// Longest tool name, in bytes (OpenAI's limit).
pub const MAX_TOOL_NAME: usize = 64;
/// Longest function name of a call in the conversation, in bytes.
pub const MAX_HISTORY_TOOL_NAME: usize = 256;
/// Most tool calls in one assistant message of the conversation.
pub const MAX_TOOL_CALLS: usize = 64;

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name: 1 to 64 of `[A-Za-z0-9_-]`.
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// A JSON Schema for its arguments (an object).
    pub parameters: Value,
    /// The tool as the client wrote it, for a chat template's `tools`.
    pub given: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model may not call a tool (and is not told of them).
    None,
    /// The model answers with text or calls.
    Auto,
    /// The model calls at least one tool.
    Required,
    /// The model calls this tool.
    Function(String),
}

/// Where the tools' description goes, and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolPrompt {
    /// At the end of the system message (Hermes).
    System(String),
    /// At the head of the first user message (Llama 3, as its own template puts custom tools,
    /// the text ending with a blank line; Mistral, `[AVAILABLE_TOOLS]` then the user's text,
    /// next to where Mistral's template puts them: before the last user turn's `[INST]`).
    FirstUser(String),
}

/// The tools of a request and how they may be called.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolUse {
    /// The tools.
    tools: Vec<Tool>,
    /// How they may be called.
    choice: ToolChoice,
    /// Whether one answer may hold several calls.
    parallel: bool,
    /// How the model writes calls.
    format: ToolFormat,
    /// The markers that are special tokens ([`ToolSetup::markers`]).
    markers: MarkerTokens,
    /// Calls carry ids ([`ToolSetup::call_ids`]).
    call_ids: bool,
    /// The output's grammar, built once (its size is checked when the request is read).
    grammar: Option<String>,
}

fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

fn check_name(param: &str, name: &str) -> Result<(), ApiError> {
    let ok = (1..=MAX_TOOL_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            param,
            format!("a function name is 1 to {MAX_TOOL_NAME} of a-z, A-Z, 0-9, _ and -"),
        ))
    }
}

/// Reads tool `i` of the list `list_param` names (`tools`, `chat_template_kwargs.tools`).
fn parse_tool(list_param: &str, i: usize, v: &Value) -> Result<Tool, ApiError> {
    let at = |field: &str| format!("{list_param}[{i}]{field}");
    let obj = v
        .as_object()
        .ok_or_else(|| invalid(at(""), "a tool is an object"))?;
    match obj.get("type").and_then(Value::as_str) {
        Some("function") => {}
        _ => {
            return Err(invalid(
                at(".type"),
                "only tools of type \"function\" are supported",
            ))
        }
    }
    let function = obj
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(at(".function"), "a tool needs a function object"))?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(at(".function.name"), "a function needs a name"))?;
    check_name(&at(".function.name"), name)?;
    let description = match function.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(invalid(
                at(".function.description"),
                "a description is a string",
            ))
        }
    };
    let parameters = match function.get("parameters") {
        // No parameters: the function takes none.
        None | Some(Value::Null) => serde_json::json!({
            "type": "object",
            "properties": {},
            "additionalProperties": false,
        }),
        Some(Value::Object(p)) => {
            let mut p = p.clone();
            // Arguments are an object (OpenAI's contract): a schema without a type gets it.
            match p.get("type") {
                None => {
                    p.insert("type".into(), Value::String("object".into()));
                }
                Some(Value::String(t)) if t == "object" => {}
                Some(_) => {
                    return Err(invalid(
                        at(".function.parameters"),
                        "parameters must be a JSON Schema object with \"type\": \"object\"",
                    ))
                }
            }
            Value::Object(p)
        }
        Some(_) => {
            return Err(invalid(
                at(".function.parameters"),
                "parameters must be a JSON Schema object with \"type\": \"object\"",
            ))
        }
    };
    // OpenAI's strict mode: the arguments' schema must close every object.
    match function.get("strict") {
        None | Some(Value::Null | Value::Bool(false)) => {}
        Some(Value::Bool(true)) => check_strict_schema(&at(".function.parameters"), &parameters)?,
        Some(_) => return Err(invalid(at(".function.strict"), "strict must be a boolean")),
    }
    check_finite_schema(&at(".function.parameters"), &parameters)?;
    Ok(Tool {
        name: name.to_owned(),
        description,
        parameters,
        given: v.clone(),
    })
}

/// Reads a list of tools at `param` (absent or `null`: none): at most [`MAX_TOOLS`], each a
/// function of a distinct, valid name with an object schema ([`parse_tool`]).
fn parse_tools(param: &str, tools: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(list)) => list.as_slice(),
        Some(_) => return Err(invalid(param, format!("{param} is a list"))),
    };
    if list.len() > MAX_TOOLS {
        return Err(invalid(
            param,
            format!("at most {MAX_TOOLS} tools are allowed"),
        ));
    }
    let mut parsed: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, v) in list.iter().enumerate() {
        let tool = parse_tool(param, i, v)?;
        if parsed.iter().any(|t| t.name == tool.name) {
            return Err(invalid(
                format!("{param}[{i}].function.name"),
                format!("two tools are named {:?}", tool.name),
            ));
        }
        parsed.push(tool);
    }
    Ok(parsed)
}

/// Checks the tools a client hands the chat template itself through
/// `chat_template_kwargs.tools` (the server hands the template a request's `tools`, and then
/// refuses that variable): they meet the bounds of `tools` ([`parse_tools`]; their schemas,
/// as JSON, at most [`MAX_STRUCTURED_BYTES`] together, as the grammar built from `tools`'
/// schemas is bounded), `param` naming the variable.
pub fn check_template_tools(param: &str, tools: &Value) -> Result<(), ApiError> {
    let parsed = parse_tools(param, Some(tools))?;
    let mut bytes = 0usize;
    for t in &parsed {
        bytes = bytes.saturating_add(json_dumps(&t.parameters).len());
    }
    if bytes > MAX_STRUCTURED_BYTES {
        return Err(invalid(
            param,
            format!(
                "the tools' schemas take {bytes} bytes; at most {MAX_STRUCTURED_BYTES} are allowed"
            ),
        ));
    }
    Ok(())
}

impl ToolUse {
    /// Reads the request's tool fields; `None` when it has no tools (then `tool_choice` may
    /// only be `none`).
    pub fn parse(
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
        parallel_tool_calls: Option<bool>,
        setup: impl Into<ToolSetup>,
    ) -> Result<Option<ToolUse>, ApiError> {
        let setup = setup.into();
        let parsed = parse_tools("tools", tools)?;
        let choice = match tool_choice {
            None | Some(Value::Null) => {
                if parsed.is_empty() {
                    ToolChoice::None
                } else {
                    ToolChoice::Auto
                }
            }
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                _ => {
                    return Err(invalid(
                        "tool_choice",
                        "tool_choice is \"none\", \"auto\", \"required\" or a function",
                    ))
                }
            },
            Some(Value::Object(o)) => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| {
                        invalid(
                            "tool_choice",
                            "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        )
                    })?;
                if !parsed.iter().any(|t| t.name == name) {
                    let shown: String = name.chars().take(MAX_TOOL_NAME).collect();
                    return Err(invalid(
                        "tool_choice",
                        format!("tool_choice names {shown:?}, which is not among the tools"),
                    ));
                }
                ToolChoice::Function(name.to_owned())
            }
            Some(_) => {
                return Err(invalid(
                    "tool_choice",
                    "tool_choice is a string or an object",
                ))
            }
        };
        if parsed.is_empty() {
            return match choice {
                ToolChoice::None => Ok(None),
                _ => Err(invalid(
                    "tool_choice",
                    "tool_choice other than \"none\" needs tools",
                )),
            };
        }
        let mut tool_use = ToolUse {
            tools: parsed,
            choice,
            parallel: parallel_tool_calls.unwrap_or(true),
            format: setup.format,
            markers: setup.markers.of(setup.format),
            call_ids: setup.call_ids && setup.format == ToolFormat::MistralV11,
            grammar: None,
        };
        tool_use.grammar = tool_use.build_grammar();
        if let Some(grammar) = &tool_use.grammar {
            if grammar.len() > MAX_STRUCTURED_BYTES {
                return Err(invalid(
                    "tools",
                    format!(
                        "the tools' schemas take {} bytes; at most {MAX_STRUCTURED_BYTES} are allowed",
                        grammar.len()
                    ),
                ));
            }
        }
        Ok(Some(tool_use))
    }

    /// Whether the model may call a tool (`tool_choice` is not `none`).
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The tools the model may call.
    fn callable(&self) -> impl Iterator<Item = &Tool> {
        self.tools.iter().filter(move |t| match &self.choice {
            ToolChoice::None => false,
            ToolChoice::Auto | ToolChoice::Required => true,
            ToolChoice::Function(name) => &t.name == name,
        })
    }

    /// What the prompt gains: the callable tools and how to call them; `None` when no tool
    /// may be called.
    pub fn prompt(&self) -> Option<ToolPrompt> {
        self.prompt_marked().map(|(prompt, _)| prompt)
    }

    /// [`ToolUse::prompt`], and the byte ranges of its text the server writes itself: all but
    /// the tools' listing (the client's names, descriptions and schemas), whose added tokens
    /// are text where the server's (Mistral's `[AVAILABLE_TOOLS]`) stay tokens
    /// ([`crate::engine::ChatMessage::server_text`]).
    pub fn prompt_marked(&self) -> Option<(ToolPrompt, Vec<Range<usize>>)> {
        if !self.active() {
            return None;
        }
        let mut out = String::from(match self.format {
            ToolFormat::Hermes => {
                "# Tools\n\nYou can call functions to help with the answer. Their signatures, as \
                 JSON, are inside <tools></tools>:\n<tools>\n"
            }
            // Meta's words, where Llama 3.1's own template puts the tools by default.
            ToolFormat::Llama3Json => {
                "Given the following functions, please respond with a JSON for a function call \
                 with its proper arguments that best answers the given prompt.\n\n\
                 Respond in the format {\"name\": function name, \"parameters\": dictionary of \
                 argument name and its value}. Do not use variables.\n\n"
            }
            // Mistral's own block: the tools as one JSON list.
            ToolFormat::Mistral => mistral::TOOLS_OPEN,
            ToolFormat::MistralV11 => mistral_v11::TOOLS_OPEN,
        });
        let listing_start = out.len();
        for (i, t) in self.callable().enumerate() {
            let mut function = Map::new();
            function.insert("name".into(), Value::String(t.name.clone()));
            if let Some(d) = &t.description {
                function.insert("description".into(), Value::String(d.clone()));
            }
            function.insert("parameters".into(), t.parameters.clone());
            let mut tool = Map::new();
            tool.insert("type".into(), Value::String("function".into()));
            tool.insert("function".into(), Value::Object(function));
            let tool = Value::Object(tool);
            match self.format {
                ToolFormat::Hermes => {
                    out.push_str(&json_dumps(&tool));
                    out.push('\n');
                }
                ToolFormat::Llama3Json => {
                    out.push_str(&json_indented(&tool));
                    out.push_str("\n\n");
                }
                ToolFormat::Mistral | ToolFormat::MistralV11 => {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(&json_dumps(&tool));
                }
            }
        }
        let listing_end = out.len();
        // How several calls are written; Mistral's list needs no words.
        let several = match self.format {
            ToolFormat::Hermes => {
                out.push_str(
                    "</tools>\n\nTo call a function, answer with a JSON object holding its name \
                     and its arguments inside <tool_call></tool_call> tags:\n<tool_call>\n\
                     {\"name\": <function-name>, \"arguments\": <arguments-json-object>}\n\
                     </tool_call>",
                );
                Some("one <tool_call> block each")
            }
            ToolFormat::Llama3Json => {
                out.truncate(out.len() - 2);
                Some("the calls separated by \"; \"")
            }
            ToolFormat::Mistral => {
                out.push_str(mistral::TOOLS_CLOSE);
                None
            }
            ToolFormat::MistralV11 => {
                out.push_str(mistral_v11::TOOLS_CLOSE);
                None
            }
        };
        // What the choice asks for; nothing when Mistral's model may call as it was trained to.
        let ask = match (&self.choice, self.parallel) {
            (ToolChoice::Function(name), _) => Some(format!("Call the function {name:?} now.")),
            (ToolChoice::Required, true) => Some(match several {
                Some(several) => format!("Call at least one function now, {several}."),
                None => "Call at least one function now.".to_owned(),
            }),
            (ToolChoice::Required, false) => Some("Call one function now.".to_owned()),
            (_, true) => {
                several.map(|several| format!("You may call several functions, {several}."))
            }
            (_, false) => Some("Call at most one function.".to_owned()),
        };
        // Llama 3's listing lost its last blank line; the ask names a tool by its checked
        // name only.
        let listing_end = listing_end.min(out.len());
        let written = |out: &String| {
            [0..listing_start, listing_end..out.len()]
                .into_iter()
                .filter(|r| !r.is_empty())
                .collect()
        };
        Some(match self.format {
            ToolFormat::Hermes => {
                out.push_str(&format!("\n\n{}", ask.unwrap_or_default()));
                let server = written(&out);
                (ToolPrompt::System(out), server)
            }
            ToolFormat::Llama3Json => {
                out.push_str(&format!("\n\n{}\n\n", ask.unwrap_or_default()));
                let server = written(&out);
                (ToolPrompt::FirstUser(out), server)
            }
            // The user's text follows the block directly, as it follows it in Mistral's prompts.
            ToolFormat::Mistral | ToolFormat::MistralV11 => {
                if let Some(ask) = ask {
                    out.push_str(&format!("{ask}\n\n"));
                }
                let server = written(&out);
                (ToolPrompt::FirstUser(out), server)
            }
        })
    }

    /// The request's tools as the client wrote them, for a chat template's `tools` variable
    /// (Hugging Face's `apply_chat_template(tools=...)` hands a template the caller's
    /// dictionaries): all of them, whatever `tool_choice` names (as vLLM gives them, so that
    /// the prompt, and its cached prefix, do not change with the choice; the grammar holds the
    /// answer to the named tool); none with `tool_choice: none` (vLLM's
    /// `--exclude-tools-when-tool-choice-none`: a model not told of tools does not write calls
    /// into its text).
    pub fn template_tools(&self) -> Vec<Value> {
        if !self.active() {
            return Vec::new();
        }
        self.tools.iter().map(|t| t.given.clone()).collect()
    }

    /// The special tokens the answer's text keeps though special tokens are skipped: the
    /// format's markers, where they are special tokens.
    pub fn kept_special_tokens(&self) -> KeptTokens {
        if self.active() {
            self.markers.kept()
        } else {
            KeptTokens::default()
        }
    }

    /// Whether the answer is calls only (`required`, a named function): no text may come.
    pub fn calls_only(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_))
    }

    /// How the answer is read back; `None` when no tool may be called.
    pub fn answer(&self) -> Option<ToolAnswer> {
        match self.choice {
            ToolChoice::None => None,
            ToolChoice::Auto => Some(ToolAnswer::TextOrCalls),
            ToolChoice::Required => Some(ToolAnswer::Calls),
            ToolChoice::Function(_) => Some(ToolAnswer::Named),
        }
    }

    /// The grammar (llguidance's Lark dialect) the output must follow; `None` when no tool
    /// may be called.
    pub fn grammar(&self) -> Option<&str> {
        self.grammar.as_deref()
    }

    /// Builds [`ToolUse::grammar`].
    ///
    /// Each tool has a rule of its own whose arguments are a `%json` schema at its own root,
    /// so the tool's `$ref`s resolve in its schema. With `auto` the answer is text without
    /// `<tool_call>` (`TEXT`), or any text up to the first `<tool_call>` (a lazy rule ending at
    /// the tag: a model may think or explain first) and calls; calls end the answer. Mistral's
    /// is built the same way around `[TOOL_CALLS]` and its list (`list`); Llama 3's answer is
    /// text that does not begin with `{`, or calls.
    fn build_grammar(&self) -> Option<String> {
        if !self.active() {
            return None;
        }
        let mut rules = String::new();
        let mut bodies = Vec::new();
        for (k, t) in self.callable().enumerate() {
            let mut schema = t.parameters.clone();
            if let Some(obj) = schema.as_object_mut() {
                // Formatted as `json_dumps` writes it, with no free whitespace (as other
                // structured output): a small model cannot wander into endless newlines.
                // Ours, whatever the client's: the reader expects this format.
                obj.insert(
                    "x-guidance".into(),
                    serde_json::json!({
                        "whitespace_flexible": false,
                        "item_separator": ", ",
                        "key_separator": ": ",
                    }),
                );
            }
            // The name is of [A-Za-z0-9_-] (checked), so it needs no escaping in a literal.
            if self.format == ToolFormat::MistralV11 {
                rules.push_str(&format!(
                    "body_{k}: \"{name}\" args %json{schema}\n",
                    name = t.name
                ));
            } else {
                rules.push_str(&format!(
                    "body_{k}: \"{{\\\"name\\\": \\\"{name}\\\", \\\"{key}\\\": \" %json{schema} \"}}{close}\"\n",
                    name = t.name,
                    key = self.format.arguments_key(),
                    close = match self.format {
                        ToolFormat::Hermes => "\\n</tool_call>",
                        ToolFormat::Llama3Json | ToolFormat::Mistral | ToolFormat::MistralV11 => "",
                    },
                ));
            }
            bodies.push(format!("body_{k}"));
        }
        // A named function is called once (as OpenAI does), whatever parallel_tool_calls says.
        let repeat = self.parallel && !matches!(self.choice, ToolChoice::Function(_));
        if self.format == ToolFormat::MistralV11 {
            // Each call opens with the marker: no separator.
            return Some(format!(
                "{}body: {}\n{rules}",
                mistral_v11::grammar_rules(self.calls_only(), repeat, self.markers, self.call_ids),
                bodies.join(" | "),
            ));
        }
        let separator = match self.format {
            ToolFormat::Hermes => "\\n",
            ToolFormat::Llama3Json => "; ",
            ToolFormat::Mistral | ToolFormat::MistralV11 => ", ",
        };
        let more = if repeat {
            format!(" (\"{separator}\" call)*")
        } else {
            String::new()
        };
        let start = match (self.format, self.calls_only()) {
            (ToolFormat::Mistral, calls_only) => {
                mistral::grammar_start(calls_only, self.markers.calls)
            }
            (_, true) => format!("start: call{more}\n"),
            // Built above.
            (ToolFormat::MistralV11, false) => return None,
            (ToolFormat::Hermes, false) => format!(
                "start: TEXT | pre \"\\n\" body{more}\n\
                 pre[suffix=\"{CALL_OPEN}\"]: /(?s:.*)/\n\
                 TEXT: /(?s:.+)/ & ~/(?s:.*{CALL_OPEN}.*)/\n"
            ),
            // Text, or calls from the first character: text may not begin with `{`.
            (ToolFormat::Llama3Json, false) => format!(
                "start: TEXT | call{more}\n\
                 TEXT: /(?s:.+)/ & ~/(?s:[ \\t\\r\\n]*\\{{.*)/\n"
            ),
        };
        let open = match self.format {
            ToolFormat::Hermes => "\"<tool_call>\\n\" ",
            ToolFormat::Llama3Json | ToolFormat::Mistral | ToolFormat::MistralV11 => "",
        };
        // Mistral's calls are one list: `[TOOL_CALLS]`, then `" ["`, the calls, `"]"`.
        let list = match self.format {
            ToolFormat::Mistral => format!("list: \" [\" call{more} \"]\"\n"),
            ToolFormat::Hermes | ToolFormat::Llama3Json | ToolFormat::MistralV11 => String::new(),
        };
        Some(format!(
            "{start}{list}call: {open}body\nbody: {bodies}\n{rules}",
            bodies = bodies.join(" | "),
        ))
    }
}

/// `value` as Python's `json.dumps(value, indent=4)` writes it (Hugging Face's `tojson(indent=4)`
/// in Llama 3's templates): an item per line, four spaces a level, `": "` after keys.
pub fn json_indented(value: &Value) -> String {
    let mut out = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    // Serializing a `Value` into memory cannot fail.
    serde::Serialize::serialize(value, &mut ser).expect("a JSON value serializes");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// `value` as Python's `json.dumps` writes it (`", "` and `": "` between items): the format
/// the grammar makes the model write, used for the calls and tools shown to it too.
pub fn json_dumps(value: &Value) -> String {
    /// `", "` before every item but the first.
    fn separate<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }
    struct Spaced;
    impl serde_json::ser::Formatter for Spaced {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            writer: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            separate(writer, first)
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            writer: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            separate(writer, first)
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            writer: &mut W,
        ) -> std::io::Result<()> {
            writer.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Spaced);
    // Serializing a `Value` into memory cannot fail.
    serde::Serialize::serialize(value, &mut ser).expect("a JSON value serializes");
    String::from_utf8(out).expect("JSON is UTF-8")
}

/// One call in the conversation or in the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
}

/// One call of an assistant message in the conversation, read and checked.
struct HistoryCall<'a> {
    /// Its id, as the client gave it.
    id: Option<&'a str>,
    /// The function's name.
    name: &'a str,
    /// Its arguments.
    arguments: HistoryArguments,
}

/// A called function's arguments.
enum HistoryArguments {
    /// An object (what serde_json reads).
    Object(Value),
    /// Text that is not a JSON object serde_json reads, as written: a call cut short by
    /// `max_tokens` (`{"city":`), or an object holding what serde_json refuses (numbers out
    /// of f64's range, lone surrogate escapes). The model reads it back as it wrote it.
    Raw(String),
}

/// The longest id of a call in the conversation, in bytes.
pub const MAX_TOOL_CALL_ID: usize = 256;

/// Reads an assistant message's `tool_calls` (OpenAI's shape); `param` names the field.
fn read_calls<'a>(param: &str, calls: &'a [Value]) -> Result<Vec<HistoryCall<'a>>, ApiError> {
    if calls.len() > MAX_TOOL_CALLS {
        return Err(invalid(
            param,
            format!("at most {MAX_TOOL_CALLS} tool calls per message are allowed"),
        ));
    }
    let mut out = Vec::with_capacity(calls.len());
    for (j, call) in calls.iter().enumerate() {
        let at = |field: &str| format!("{param}[{j}]{field}");
        let id = match call.get("id") {
            // An empty id is no id.
            None | Some(Value::Null) => None,
            Some(Value::String(id)) if id.is_empty() => None,
            Some(Value::String(id)) if id.len() <= MAX_TOOL_CALL_ID => Some(id.as_str()),
            Some(_) => {
                return Err(invalid(
                    at(".id"),
                    format!("a call's id is a string of at most {MAX_TOOL_CALL_ID} bytes"),
                ))
            }
        };
        let function = call
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(at(".function"), "a tool call needs a function object"))?;
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(at(".function.name"), "a tool call needs a name"))?;
        // Earlier calls may name tools this request does not offer, named by other rules:
        // only the length is bounded (the name is written JSON-escaped).
        if name.is_empty() || name.len() > MAX_HISTORY_TOOL_NAME {
            return Err(invalid(
                at(".function.name"),
                format!("a called function's name is 1 to {MAX_HISTORY_TOOL_NAME} bytes"),
            ));
        }
        let arguments = match function.get("arguments") {
            None | Some(Value::Null) => HistoryArguments::Object(Value::Object(Map::new())),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => HistoryArguments::Object(v),
                // An empty string is no arguments (as vLLM reads it).
                _ if s.trim().is_empty() => HistoryArguments::Object(Value::Object(Map::new())),
                // Any other text stays as written (OpenAI takes any string): a call cut short
                // by `max_tokens` (`{"city":`), or what serde_json refuses but this server
                // wrote (numbers out of f64's range, lone surrogate escapes).
                _ => HistoryArguments::Raw(s.clone()),
            },
            // Some clients send the object itself.
            Some(v @ Value::Object(_)) => HistoryArguments::Object(v.clone()),
            Some(_) => {
                return Err(invalid(
                    at(".function.arguments"),
                    "arguments is a string (JSON text, as the model wrote it) or an object",
                ))
            }
        };
        out.push(HistoryCall {
            id,
            name,
            arguments,
        });
    }
    Ok(out)
}

/// Renders an assistant message's `tool_calls` (OpenAI's shape) as the model writes calls
/// (Mistral: with each call's id, made one of Mistral's by [`mistral_call_id`]; Mistral v11:
/// as its templates write calls, without ids).
pub fn render_calls(param: &str, calls: &[Value], format: ToolFormat) -> Result<String, ApiError> {
    let mut out = String::new();
    for call in read_calls(param, calls)? {
        let arguments = match &call.arguments {
            HistoryArguments::Object(v) => json_dumps(v),
            HistoryArguments::Raw(raw) => raw.clone(),
        };
        if format == ToolFormat::MistralV11 {
            out.push_str(&mistral_v11::render_call(call.name, &arguments));
            continue;
        }
        // Mistral's calls carry their ids after the arguments (as mistral-common writes them).
        let id = match (format, call.id) {
            (ToolFormat::Mistral, Some(id)) if !id.is_empty() => {
                format!(", \"id\": \"{}\"", mistral_call_id(id))
            }
            _ => String::new(),
        };
        let call = format!(
            "{{\"name\": {name}, \"{key}\": {arguments}{id}}}",
            name = json_dumps(&Value::String(call.name.to_owned())),
            key = format.arguments_key(),
        );
        match format {
            ToolFormat::Hermes => {
                if !out.is_empty() {
                    out.push('\n');
                }
                out.push_str(&format!("{CALL_OPEN}\n{call}\n{CALL_CLOSE}"));
            }
            ToolFormat::Llama3Json => {
                if !out.is_empty() {
                    out.push_str("; ");
                }
                out.push_str(&call);
            }
            ToolFormat::Mistral | ToolFormat::MistralV11 => {
                if out.is_empty() {
                    out.push_str(TOOL_CALLS);
                    out.push_str(" [");
                } else {
                    out.push_str(", ");
                }
                out.push_str(&call);
            }
        }
    }
    if format == ToolFormat::Mistral && !out.is_empty() {
        out.push(']');
    }
    Ok(out)
}

/// An assistant message's `tool_calls` as a chat template reads them: OpenAI's shape, each
/// call's `arguments` an object (vLLM parses them so for templates, which write them with
/// `tojson`; other arguments stay the text they were, which the template writes as it is, with
/// `tojson` too), ids as the client gave
/// them (Mistral's format: made Mistral's by [`mistral_call_id`], as its templates require);
/// `None` when there are none.
pub fn template_calls(
    param: &str,
    calls: &[Value],
    format: ToolFormat,
) -> Result<Option<Value>, ApiError> {
    let calls = read_calls(param, calls)?;
    if calls.is_empty() {
        return Ok(None);
    }
    let calls = calls
        .into_iter()
        .map(|call| {
            let mut function = Map::new();
            function.insert("name".into(), Value::String(call.name.to_owned()));
            function.insert(
                "arguments".into(),
                match call.arguments {
                    HistoryArguments::Object(v) => v,
                    HistoryArguments::Raw(raw) => Value::String(raw),
                },
            );
            let mut out = Map::new();
            if let Some(id) = call.id {
                out.insert("id".into(), Value::String(template_call_id(id, format)));
            }
            out.insert("type".into(), Value::String("function".into()));
            out.insert("function".into(), Value::Object(function));
            Value::Object(out)
        })
        .collect();
    Ok(Some(Value::Array(calls)))
}

/// A call's id as a chat template for `format` reads it (in a call, and in the `tool`
/// message that answers it): Mistral's templates take only their own 9-character ids.
pub fn template_call_id(id: &str, format: ToolFormat) -> String {
    match format {
        ToolFormat::Mistral | ToolFormat::MistralV11 => mistral_call_id(id),
        ToolFormat::Hermes | ToolFormat::Llama3Json => id.to_owned(),
    }
}

/// A tool's result as a Hermes model reads it, in a user turn.
pub fn render_response(content: &str) -> String {
    format!("{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}")
}

/// Opens a tool's result as a Hermes model reads it.
const RESPONSE_OPEN: &str = "<tool_response>\n";
/// Closes it.
const RESPONSE_CLOSE: &str = "\n</tool_response>";

/// A tool's result as a model of `format` reads it: Hermes' `<tool_response>` block (in a user
/// turn), Mistral's `[TOOL_RESULTS]` block naming the call it answers (`tool_call_id`, made
/// one of Mistral's ids as the call's is), or Llama 3's `tool` message text as it is.
pub fn render_result(format: ToolFormat, content: &str, tool_call_id: Option<&str>) -> String {
    render_result_marked(format, content, tool_call_id).0
}

/// [`render_result`], and the byte ranges of it the server writes itself (the format's
/// markers around the result, not the client's text): their added tokens stay tokens where
/// the client's are text ([`crate::engine::ChatMessage::server_text`]).
pub fn render_result_marked(
    format: ToolFormat,
    content: &str,
    tool_call_id: Option<&str>,
) -> (String, Vec<Range<usize>>) {
    let (open, body, close) = match format {
        ToolFormat::Hermes => (RESPONSE_OPEN, Cow::Borrowed(content), RESPONSE_CLOSE),
        ToolFormat::Llama3Json => ("", Cow::Borrowed(content), ""),
        ToolFormat::Mistral => (
            mistral::RESULTS_OPEN,
            Cow::Owned(mistral::result_json(content, tool_call_id)),
            mistral::RESULTS_CLOSE,
        ),
        ToolFormat::MistralV11 => (
            mistral_v11::RESULTS_OPEN,
            Cow::Borrowed(content),
            mistral_v11::RESULTS_CLOSE,
        ),
    };
    let text = format!("{open}{body}{close}");
    let server = [0..open.len(), text.len() - close.len()..text.len()]
        .into_iter()
        .filter(|r| !r.is_empty())
        .collect();
    (text, server)
}

/// What [`ToolStream`] makes of generated text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolPiece {
    /// Text for `content`.
    Text(String),
    /// A call opens: its position among the choice's calls, and the function's name.
    Call {
        /// The call's position among the choice's calls.
        index: usize,
        /// The function's name.
        name: String,
    },
    /// More of call `index`'s arguments, JSON text as the model writes it, given out as it
    /// comes: the pieces of a call cut short (`max_tokens`) do not make a whole object.
    Arguments {
        /// The call's position among the choice's calls.
        index: usize,
        /// The next part of the arguments.
        text: String,
    },
}

impl ToolPiece {
    /// Joins the pieces of a whole answer into its content and its calls.
    pub fn join(pieces: impl IntoIterator<Item = ToolPiece>) -> (String, Vec<ParsedCall>) {
        let mut text = String::new();
        let mut calls: Vec<ParsedCall> = Vec::new();
        for piece in pieces {
            match piece {
                ToolPiece::Text(t) => text.push_str(&t),
                ToolPiece::Call { name, .. } => calls.push(ParsedCall {
                    name,
                    arguments: String::new(),
                }),
                ToolPiece::Arguments { index, text } => {
                    if let Some(call) = calls.get_mut(index) {
                        call.arguments.push_str(&text);
                    }
                }
            }
        }
        (text, calls)
    }
}

#[derive(Debug)]
enum StreamState {
    /// Text, passed through except what may be the start of a call: trailing ASCII
    /// whitespace (up to [`MAX_HELD_SPACE`] bytes) and a prefix of `<tool_call>` (Mistral:
    /// `[TOOL_CALLS]`) are held back until the next text tells. Llama 3: the answer's start,
    /// its leading whitespace held back until a character tells text from a call.
    Text,
    /// At a call's `<tool_call>` (Mistral: at `[TOOL_CALLS] [`, or after the `,` of its list),
    /// or between calls, until the call's opening `{"name": ..., "arguments": ` tells its
    /// name. `whole`: the call does not open that way (the grammar writes no other; kept for
    /// safety), so it is read whole once its JSON has closed, which `end` finds.
    Call { end: BodyEnd, whole: bool },
    /// In call `index`'s arguments, which go out as they come, until `nesting` closes.
    Arguments { index: usize, nesting: Nesting },
    /// After a streamed call's arguments: the call's own `}`, then `</tool_call>` (Llama 3:
    /// `;` before the next call, or the end; Mistral: any more members, such as an `"id"`,
    /// then `,` before the next call of the list or `]` after the last).
    Close,
    /// After text that is not a call where a call had to be (the grammar rules it out; kept
    /// for safety): everything is text, passed through.
    Plain,
}

/// Where a bracketed JSON value ends, found byte by byte as its text arrives (strings and
/// their escapes skipped), so that reading stays linear in the text however it is cut.
#[derive(Debug, Default)]
struct Nesting {
    depth: usize,
    deepest: usize,
    in_string: bool,
    escaped: bool,
}

impl Nesting {
    /// Scans `b`, the value's next bytes (its first byte an opening bracket); returns the
    /// offset just past the bracket that closes the value, when it is in `b`.
    fn scan(&mut self, b: &[u8]) -> Option<usize> {
        for (i, &c) in b.iter().enumerate() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if c == b'\\' {
                    self.escaped = true;
                } else if c == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match c {
                b'"' => self.in_string = true,
                b'{' | b'[' => {
                    self.depth += 1;
                    self.deepest = self.deepest.max(self.depth);
                }
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return Some(i + 1);
                    }
                }
                _ => {}
            }
        }
        None
    }
}

/// Where a call's JSON body ends, for a call read whole: its text is looked at again only
/// when its braces have closed.
#[derive(Debug, Default)]
struct BodyEnd {
    /// Bytes of the kept text already scanned.
    pos: usize,
    opened: bool,
    nesting: Nesting,
    /// Just past the body's closing brace, once found.
    end: Option<usize>,
}

impl BodyEnd {
    /// Scans `b` on from where it stopped (from `start` at first). `Err`: not a JSON object,
    /// or nested deeper than [`MAX_DEPTH`].
    fn advance(&mut self, b: &[u8], start: usize) -> Result<Option<usize>, ()> {
        if self.end.is_some() {
            return Ok(self.end);
        }
        let mut i = self.pos.max(start);
        if !self.opened {
            i = skip_ws(b, i);
            match b.get(i) {
                None => {
                    self.pos = i;
                    return Ok(None);
                }
                Some(b'{') => self.opened = true,
                Some(_) => return Err(()),
            }
        }
        let found = self.nesting.scan(&b[i..]);
        if self.nesting.deepest > MAX_DEPTH {
            return Err(());
        }
        self.pos = found.map_or(b.len(), |n| i + n);
        self.end = found.map(|n| i + n);
        Ok(self.end)
    }
}

/// What a call's opening says.
enum Header {
    /// `{"name": "...", "arguments": ` was read: the name, and the offset of the arguments'
    /// opening brace.
    Done { name: String, arguments: usize },
    /// Not complete yet.
    More,
    /// A call that does not open that way (or opens longer than [`MAX_HEADER`]).
    Other,
}

/// Longest call opening streamed (the grammar's are under 100 bytes); a call that opens
/// longer is read whole.
const MAX_HEADER: usize = 512;

/// Matches `lit` at `b[i..]`: `Ok` past it, `Err(true)` when `b` ends inside it,
/// `Err(false)` when it is not there.
fn literal(b: &[u8], i: usize, lit: &[u8]) -> Result<usize, bool> {
    let have = b.get(i..).unwrap_or_default();
    let n = have.len().min(lit.len());
    if have[..n] != lit[..n] {
        Err(false)
    } else if n < lit.len() {
        Err(true)
    } else {
        Ok(i + lit.len())
    }
}

/// Reads a call's opening in `body` (the text after `<tool_call>`, or a Llama 3 call's),
/// whose arguments are under `key`.
fn header(body: &str, key: &str) -> Header {
    let b = &body.as_bytes()[..body.len().min(MAX_HEADER)];
    let read = || -> Result<(String, usize), bool> {
        let mut i = literal(b, skip_ws(b, 0), b"{")?;
        i = literal(b, skip_ws(b, i), b"\"name\"")?;
        i = literal(b, skip_ws(b, i), b":")?;
        let at = skip_ws(b, i);
        literal(b, at, b"\"")?;
        let end = match scan_string(b, at) {
            Scan::Done(e) => e,
            Scan::More => return Err(true),
            Scan::Bad => return Err(false),
        };
        // Both ends are quotes, so `at..end` cuts on character boundaries.
        let name: String = serde_json::from_str(&body[at..end]).map_err(|_| false)?;
        i = literal(b, skip_ws(b, end), b",")?;
        i = literal(b, skip_ws(b, i), b"\"")?;
        i = literal(b, i, key.as_bytes())?;
        i = literal(b, i, b"\"")?;
        i = literal(b, skip_ws(b, i), b":")?;
        let arguments = skip_ws(b, i);
        literal(b, arguments, b"{")?;
        Ok((name, arguments))
    };
    match read() {
        Ok((name, arguments)) => Header::Done { name, arguments },
        Err(true) if body.len() <= MAX_HEADER => Header::More,
        Err(_) => Header::Other,
    }
}

/// Reads one choice's generated text, in pieces as it streams, into content and calls: text
/// up to the first `<tool_call>` (its trailing whitespace dropped), then calls, whose
/// arguments go out as they are written; in the Llama 3 format, text or calls, as the first
/// character that is not whitespace tells.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    state: StreamState,
    /// Text read and not given out yet: held back, or kept until a call's form tells.
    buf: String,
    /// The whitespace before the first `<tool_call>`: dropped once a call is read, given back
    /// if none is.
    lead: String,
    calls: usize,
    /// The text ended inside a call's arguments.
    cut: bool,
    /// The answer is calls only (`required`, a named function).
    calls_only: bool,
    /// Mistral: inside a list of calls (its `[TOOL_CALLS] [` read and a call opened in it, its
    /// `]` not yet read).
    listed: bool,
}

/// How much of the end of `text` to hold back in case a call starts there: trailing
/// whitespace (at most [`MAX_HELD_SPACE`] bytes of it), and a part of `marker` (`<tool_call>`,
/// `[TOOL_CALLS]`) after it.
fn held_suffix(text: &str, marker: &str) -> usize {
    let keep = partial_tag(text, marker);
    let before = &text[..text.len() - keep];
    keep + (before.len() - trim_space_end(before).len()).min(MAX_HELD_SPACE)
}

impl ToolStream {
    /// A stream at the start of a choice whose calls are written in `format`.
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            state: StreamState::Text,
            buf: String::new(),
            lead: String::new(),
            calls: 0,
            cut: false,
            calls_only: false,
            listed: false,
        }
    }

    /// A stream of an answer that is calls only (`required`, a named function): a call's
    /// opening cut short at the end is dropped even before the first call.
    pub fn calls_only(mut self, calls_only: bool) -> Self {
        self.calls_only = calls_only;
        self
    }

    /// Reads a whole answer into its content and its calls.
    pub fn read_all(format: ToolFormat, text: &str) -> (String, Vec<ParsedCall>) {
        let mut stream = Self::new(format);
        let mut pieces = stream.push(text);
        pieces.extend(stream.finish());
        ToolPiece::join(pieces)
    }

    /// Calls opened so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Whether the text ended inside a call's arguments (known after [`ToolStream::finish`]).
    pub fn cut_short(&self) -> bool {
        self.cut
    }

    /// Whether text read is held back (it may yet be part of a call).
    pub fn holding(&self) -> bool {
        !self.buf.is_empty() || !self.lead.is_empty()
    }

    /// Takes the next generated text; returns what is known from it.
    pub fn push(&mut self, text: &str) -> Vec<ToolPiece> {
        let mut out = Vec::new();
        match self.state {
            StreamState::Plain => {
                if !text.is_empty() {
                    out.push(ToolPiece::Text(text.to_owned()));
                }
                return out;
            }
            StreamState::Arguments { .. } => self.arguments(text, &mut out),
            _ => self.buf.push_str(text),
        }
        self.pump(&mut out, false);
        out
    }

    /// The end of the choice: what was held back comes out. A call whose closing tag is
    /// missing (a stop string took it) still counts; so does one cut short in its arguments
    /// (`max_tokens`), whose arguments are what was written. A call cut short before its
    /// arguments begin (`{"name": "...", "arguments": {` not all written, or only part of
    /// `<tool_call>`) is dropped once a call was read or when the answer is calls only (as
    /// vLLM's Hermes reader puts no text after the first `<tool_call>` into the content), and
    /// is text otherwise.
    pub fn finish(&mut self) -> Vec<ToolPiece> {
        let mut out = Vec::new();
        self.pump(&mut out, true);
        out
    }

    /// Passes `text`, the next of an open call's arguments, out up to where they end; what
    /// follows is kept for [`StreamState::Close`].
    fn arguments(&mut self, text: &str, out: &mut Vec<ToolPiece>) {
        let StreamState::Arguments { index, nesting } = &mut self.state else {
            return;
        };
        let index = *index;
        let end = nesting.scan(text.as_bytes());
        // The arguments end after a `}` or `]`, on a character boundary.
        let (args, rest) = text.split_at(end.unwrap_or(text.len()));
        if !args.is_empty() {
            out.push(ToolPiece::Arguments {
                index,
                text: args.to_owned(),
            });
        }
        if end.is_some() {
            self.buf.push_str(rest);
            self.state = StreamState::Close;
        }
    }

    /// Opens call number `self.calls`.
    fn open(&mut self, name: String, out: &mut Vec<ToolPiece>) -> usize {
        let index = self.calls;
        self.calls += 1;
        self.lead.clear();
        // (Read by the Mistral format only: its calls open inside a list.)
        self.listed = true;
        out.push(ToolPiece::Call { index, name });
        index
    }

    /// At the end, a call's opening cut short: dropped where the answer is calls from here on
    /// (a call was read, or calls only), text otherwise.
    fn unfinished_call(&mut self, out: &mut Vec<ToolPiece>) {
        if self.calls > 0 || self.calls_only {
            self.buf.clear();
            self.lead.clear();
        } else {
            self.not_a_call(out);
        }
    }

    /// Not a call after all: everything kept is text from here on.
    fn not_a_call(&mut self, out: &mut Vec<ToolPiece>) {
        let text = std::mem::take(&mut self.lead) + &std::mem::take(&mut self.buf);
        if !text.is_empty() {
            out.push(ToolPiece::Text(text));
        }
        self.state = StreamState::Plain;
    }

    /// Reads what the kept text tells, moving from state to state while it can; `last`: no
    /// more text will come, so nothing stays kept.
    fn pump(&mut self, out: &mut Vec<ToolPiece>, last: bool) {
        loop {
            match &mut self.state {
                // Llama 3: calls are the whole answer, so the first character that is not
                // whitespace tells; the whitespace before it is held back meanwhile.
                StreamState::Text if self.format == ToolFormat::Llama3Json => {
                    // The grammar's whitespace (not a form feed, which text may open with).
                    let start = skip_ws(self.buf.as_bytes(), 0);
                    if start > MAX_HELD_SPACE {
                        return self.not_a_call(out);
                    }
                    match self.buf.as_bytes().get(start) {
                        None if !last => return,
                        // Calls only, cut before the first call opens: no content.
                        None if self.calls_only => return self.unfinished_call(out),
                        Some(b'{') => {
                            self.lead = self.buf[..start].to_owned();
                            self.buf.drain(..start);
                            self.state = StreamState::Call {
                                end: BodyEnd::default(),
                                whole: false,
                            };
                        }
                        _ => return self.not_a_call(out),
                    }
                }
                StreamState::Text => {
                    let marker = self.format.marker();
                    // Only the held-back end and the new text are searched.
                    if let Some(at) = self.buf.find(marker) {
                        // As held_suffix holds it back: whitespace beyond the last
                        // MAX_HELD_SPACE bytes before the tag is text.
                        let before = trim_space_end(&self.buf[..at])
                            .len()
                            .max(at.saturating_sub(MAX_HELD_SPACE));
                        if before > 0 {
                            out.push(ToolPiece::Text(self.buf[..before].to_owned()));
                        }
                        self.lead = self.buf[before..at].to_owned();
                        self.buf.drain(..at);
                        self.state = StreamState::Call {
                            end: BodyEnd::default(),
                            whole: false,
                        };
                        continue;
                    }
                    if last && self.calls_only {
                        // Calls only, cut inside the first `<tool_call>`: no content.
                        let tag = partial_tag(&self.buf, marker);
                        let text = trim_space_end(&self.buf[..self.buf.len() - tag]).len();
                        self.buf.truncate(text);
                        self.lead.clear();
                    }
                    let keep = if last {
                        0
                    } else {
                        held_suffix(&self.buf, marker)
                    };
                    if keep < self.buf.len() {
                        let rest = self.buf.split_off(self.buf.len() - keep);
                        out.push(ToolPiece::Text(std::mem::replace(&mut self.buf, rest)));
                    }
                    return;
                }
                StreamState::Call { end, whole } => {
                    let start = self.buf.len()
                        - self
                            .buf
                            .trim_start_matches(|c: char| c.is_ascii_whitespace())
                            .len();
                    let rest = &self.buf[start..];
                    if start > MAX_HELD_SPACE {
                        return self.not_a_call(out);
                    }
                    if rest.is_empty() {
                        // Whitespace after the last call.
                        if last {
                            self.buf.clear();
                        }
                        return;
                    }
                    let body = if self.format == ToolFormat::Mistral && !self.listed {
                        // `[TOOL_CALLS]`, whitespace, `[`: kept until a call opens in the list,
                        // so that it comes back as text if none does.
                        match mistral::list_open(self.buf.as_bytes(), start) {
                            Ok(body) => body,
                            Err(true) if !last => return,
                            Err(true) => return self.unfinished_call(out),
                            Err(false) => return self.not_a_call(out),
                        }
                    } else {
                        let open = self.format.open();
                        if !rest.starts_with(open) {
                            if open.starts_with(rest) {
                                if !last {
                                    return;
                                }
                                return self.unfinished_call(out);
                            }
                            return self.not_a_call(out);
                        }
                        start + open.len()
                    };
                    if !*whole {
                        let opening = &self.buf[body..];
                        let read = match self.format {
                            ToolFormat::MistralV11 => mistral_v11::header(opening),
                            _ => header(opening, self.format.arguments_key()),
                        };
                        match read {
                            Header::Done { name, arguments } => {
                                let index = self.open(name, out);
                                let args = self.buf.split_off(body + arguments);
                                self.buf.clear();
                                self.state = StreamState::Arguments {
                                    index,
                                    nesting: Nesting::default(),
                                };
                                self.arguments(&args, out);
                                continue;
                            }
                            Header::More if !last => return,
                            Header::More => return self.unfinished_call(out),
                            // A v11 call has no other form.
                            Header::Other if self.format == ToolFormat::MistralV11 => {
                                return self.not_a_call(out)
                            }
                            Header::Other => *whole = true,
                        }
                    }
                    match end.advance(self.buf.as_bytes(), body) {
                        Ok(Some(_)) => {}
                        // Braces still open: wait (at the end, a call cut short).
                        Ok(None) if !last => return,
                        Ok(None) => return self.unfinished_call(out),
                        Err(()) => return self.not_a_call(out),
                    }
                    match read_call(&self.buf[body..], last, self.format) {
                        Read::Call(call, used) => {
                            let index = self.open(call.name, out);
                            out.push(ToolPiece::Arguments {
                                index,
                                text: call.arguments,
                            });
                            self.buf.drain(..body + used);
                            self.state = match self.format {
                                // What follows the call's brace, which is left in place.
                                ToolFormat::Mistral => StreamState::Close,
                                ToolFormat::Hermes
                                | ToolFormat::Llama3Json
                                | ToolFormat::MistralV11 => StreamState::Call {
                                    end: BodyEnd::default(),
                                    whole: false,
                                },
                            };
                        }
                        Read::More if !last => return,
                        Read::More => return self.unfinished_call(out),
                        Read::Bad => return self.not_a_call(out),
                    }
                }
                // At the end, a call cut short in its arguments: they went out as they came.
                StreamState::Arguments { .. } => {
                    self.cut = last;
                    return;
                }
                // A v11 call ends with its arguments; the next opens with the marker.
                StreamState::Close if self.format == ToolFormat::MistralV11 => {
                    self.state = StreamState::Call {
                        end: BodyEnd::default(),
                        whole: false,
                    };
                }
                StreamState::Close if self.format == ToolFormat::Mistral => {
                    match mistral::after_arguments(self.buf.as_bytes()) {
                        mistral::After::Next(n, more) => {
                            self.buf.drain(..n);
                            self.listed = more;
                            self.state = StreamState::Call {
                                end: BodyEnd::default(),
                                whole: false,
                            };
                        }
                        mistral::After::More if !last => return,
                        // The call's brace or the list's `]` taken by a stop string or cut by
                        // `max_tokens`: the call stands.
                        mistral::After::More => {
                            self.buf.clear();
                            return;
                        }
                        // Something else (the grammar rules it out): the call stands, the rest
                        // (after its brace, if it closed) is text.
                        mistral::After::Other(end) => {
                            self.buf.drain(..end);
                            return self.not_a_call(out);
                        }
                    }
                }
                StreamState::Close => {
                    let b = self.buf.as_bytes();
                    let i = skip_ws(b, 0);
                    let closed = match b.get(i) {
                        _ if i > MAX_HELD_SPACE => Err(false),
                        None => Err(true),
                        Some(b'}') => {
                            let j = skip_ws(b, i + 1);
                            if j - (i + 1) > MAX_HELD_SPACE {
                                Err(false)
                            } else {
                                literal(b, j, self.format.close().as_bytes())
                            }
                        }
                        Some(_) => Err(false),
                    };
                    match closed {
                        Ok(n) => {
                            self.buf.drain(..n);
                            self.state = StreamState::Call {
                                end: BodyEnd::default(),
                                whole: false,
                            };
                        }
                        Err(true) if !last => return,
                        // The closing tag (or the call's last brace and the tag) taken by a
                        // stop string or cut by `max_tokens`: the call stands.
                        Err(true) => {
                            self.buf.clear();
                            return;
                        }
                        // Something else after the arguments (the grammar rules it out): the
                        // call stands, the rest is text. A Llama 3 call ends at its brace, a
                        // Hermes call at its tag.
                        Err(false) => {
                            if self.format == ToolFormat::Llama3Json
                                && i <= MAX_HELD_SPACE
                                && b.get(i) == Some(&b'}')
                            {
                                self.buf.drain(..=i);
                            }
                            return self.not_a_call(out);
                        }
                    }
                }
                StreamState::Plain => {
                    if !self.buf.is_empty() {
                        out.push(ToolPiece::Text(std::mem::take(&mut self.buf)));
                    }
                    return;
                }
            }
        }
    }
}

/// What [`read_call`] found.
enum Read {
    /// A call, and the bytes it took (through its closing tag).
    Call(ParsedCall, usize),
    /// Not complete yet.
    More,
    /// Not a call.
    Bad,
}

/// How a JSON value scans.
enum Scan {
    /// It ends at this byte offset.
    Done(usize),
    /// The text ends inside it.
    More,
    /// Not JSON.
    Bad,
}

/// Deepest JSON nesting read (serde_json's own limit).
const MAX_DEPTH: usize = 128;

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\n' | b'\r' | b'\t') {
        i += 1;
    }
    i
}

/// Finds where the JSON value at `i` ends, without interpreting it (so arguments pass through
/// as the model wrote them: no number is rounded, no escape rejected).
fn scan_value(b: &[u8], i: usize, depth: usize) -> Scan {
    let Some(&c) = b.get(i) else {
        return Scan::More;
    };
    match c {
        b'"' => scan_string(b, i),
        b'{' | b'[' if depth < MAX_DEPTH => scan_container(b, i, depth + 1),
        b't' | b'f' | b'n' | b'-' | b'0'..=b'9' => {
            let mut j = i;
            while j < b.len()
                && matches!(b[j], b'a'..=b'z' | b'0'..=b'9' | b'+' | b'-' | b'.' | b'E')
            {
                j += 1;
            }
            if j == b.len() {
                Scan::More
            } else {
                Scan::Done(j)
            }
        }
        _ => Scan::Bad,
    }
}

fn scan_string(b: &[u8], i: usize) -> Scan {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Scan::Done(j + 1),
            c if c < 0x20 => return Scan::Bad,
            _ => j += 1,
        }
    }
    Scan::More
}

fn scan_container(b: &[u8], i: usize, depth: usize) -> Scan {
    let (object, close) = if b[i] == b'{' {
        (true, b'}')
    } else {
        (false, b']')
    };
    let mut j = skip_ws(b, i + 1);
    match b.get(j) {
        None => return Scan::More,
        Some(&c) if c == close => return Scan::Done(j + 1),
        _ => {}
    }
    loop {
        if object {
            match b.get(j) {
                None => return Scan::More,
                Some(b'"') => {}
                Some(_) => return Scan::Bad,
            }
            j = match scan_string(b, j) {
                Scan::Done(e) => skip_ws(b, e),
                other => return other,
            };
            match b.get(j) {
                None => return Scan::More,
                Some(b':') => j = skip_ws(b, j + 1),
                Some(_) => return Scan::Bad,
            }
        }
        j = match scan_value(b, j, depth) {
            Scan::Done(e) => skip_ws(b, e),
            other => return other,
        };
        match b.get(j) {
            None => return Scan::More,
            Some(b',') => j = skip_ws(b, j + 1),
            Some(&c) if c == close => return Scan::Done(j + 1),
            Some(_) => return Scan::Bad,
        }
    }
}

/// Reads a call's body (after `<tool_call>`): `{"name": ..., "arguments": {...}}` then
/// `</tool_call>` (Llama 3: `{"name": ..., "parameters": {...}}` then `;`); at the `last` text
/// a complete body without its closing tag (or separator) counts. A Mistral call is its object
/// (any keys, in any order), up to its closing brace.
fn read_call(body: &str, last: bool, format: ToolFormat) -> Read {
    let close = format.close();
    let b = body.as_bytes();
    let i = skip_ws(b, 0);
    if b.get(i).is_some_and(|&c| c != b'{') {
        return Read::Bad;
    }
    let end = match scan_value(b, i, 0) {
        Scan::Done(e) => e,
        Scan::More => return Read::More,
        Scan::Bad => return Read::Bad,
    };
    let Some(call) = call_fields(&body[i..end], format) else {
        return Read::Bad;
    };
    if format == ToolFormat::Mistral {
        // Its brace is left for what follows a call in the list (StreamState::Close).
        return Read::Call(call, end - 1);
    }
    let after = skip_ws(b, end);
    let tail = &body[after..];
    let spaced = after - end > MAX_HELD_SPACE;
    if !spaced && tail.starts_with(close) {
        return Read::Call(call, after + close.len());
    }
    if !spaced && last && close.starts_with(tail) {
        // The closing tag (or its end) was taken by a stop string; or the last Llama 3 call.
        return Read::Call(call, body.len());
    }
    if !spaced && close.starts_with(tail) && !last {
        return Read::More;
    }
    match format {
        ToolFormat::Hermes => Read::Bad,
        // A Llama 3 call ends at its brace: what follows, not its separator, is the caller's to
        // read (text), as when its arguments are streamed. (Mistral's was read above.)
        ToolFormat::Llama3Json | ToolFormat::Mistral | ToolFormat::MistralV11 => {
            Read::Call(call, end)
        }
    }
}

/// The name and the raw arguments of a complete call object (under `arguments`, or the
/// format's own key).
fn call_fields(object: &str, format: ToolFormat) -> Option<ParsedCall> {
    let b = object.as_bytes();
    let mut name = None;
    let mut arguments = None;
    let mut j = skip_ws(b, 1);
    if b.get(j) == Some(&b'}') {
        return None;
    }
    loop {
        let Scan::Done(key_end) = scan_string(b, j) else {
            return None;
        };
        let key: String = serde_json::from_str(&object[j..key_end]).ok()?;
        j = skip_ws(b, key_end);
        if b.get(j) != Some(&b':') {
            return None;
        }
        let value_start = skip_ws(b, j + 1);
        let Scan::Done(value_end) = scan_value(b, value_start, 1) else {
            return None;
        };
        let raw = &object[value_start..value_end];
        match key.as_str() {
            "name" => name = Some(serde_json::from_str::<String>(raw).ok()?),
            k if k == "arguments" || k == format.arguments_key() => {
                if !raw.starts_with('{') {
                    return None;
                }
                arguments = Some(raw.to_owned());
            }
            _ => {}
        }
        j = skip_ws(b, value_end);
        match b.get(j) {
            Some(b',') => j = skip_ws(b, j + 1),
            Some(b'}') => break,
            _ => return None,
        }
    }
    Some(ParsedCall {
        name: name?,
        arguments: arguments.unwrap_or_else(|| "{}".to_owned()),
    })
}

/// What the formats' reader tests share.
#[cfg(test)]
mod reading_tests {
    use super::{ParsedCall, ToolFormat, ToolPiece, ToolStream};

    /// A call with `name` and `arguments`.
    pub(super) fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    /// Reads `text` in `format` cut in two at every character boundary, and one character at
    /// a time (and whole, unless the answer is calls only): each reading must give `want`.
    pub(super) fn check(
        format: ToolFormat,
        calls_only: bool,
        text: &str,
        want: &(String, Vec<ParsedCall>),
    ) {
        let read = |chunks: &[&str]| {
            let mut s = ToolStream::new(format).calls_only(calls_only);
            let mut pieces = Vec::new();
            for c in chunks {
                pieces.extend(s.push(c));
            }
            pieces.extend(s.finish());
            assert!(!s.holding(), "{text:?}");
            assert_eq!(s.calls(), ToolPiece::join(pieces.clone()).1.len());
            ToolPiece::join(pieces)
        };
        for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
            assert_eq!(
                &read(&[&text[..cut], &text[cut..]]),
                want,
                "{text:?} cut at {cut}"
            );
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(&read(&refs), want, "{text:?} by chars");
        if !calls_only {
            assert_eq!(&ToolStream::read_all(format, text), want, "{text:?} whole");
        }
    }

    /// [`check`]s each `(text, content, calls)` of `cases` in `format`, with text allowed.
    pub(super) fn check_cases(format: ToolFormat, cases: Vec<(&str, &str, Vec<ParsedCall>)>) {
        for (text, content, calls) in cases {
            check(format, false, text, &(content.to_owned(), calls));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Value {
        json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}
        }})
    }

    fn param(r: Result<Option<ToolUse>, ApiError>) -> String {
        match r {
            Err(ApiError::InvalidRequest { param, .. }) => param.unwrap_or_default(),
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn tool_fields_are_read_and_defaults_follow_openai() {
        let tools = json!([weather()]);
        let t = ToolUse::parse(Some(&tools), None, None, ToolFormat::Hermes)
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.parallel && t.active());
        assert_eq!(t.tools[0].name, "get_weather");
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = ToolUse::parse(Some(&tools), Some(&named), Some(false), ToolFormat::Hermes)
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Function("get_weather".into()));
        assert!(!t.parallel);
        let none = json!("none");
        let t = ToolUse::parse(Some(&tools), Some(&none), None, ToolFormat::Hermes)
            .unwrap()
            .unwrap();
        assert!(!t.active() && t.grammar().is_none() && t.prompt().is_none());
        // No tools: nothing, unless tool_choice asks for a call.
        assert_eq!(
            ToolUse::parse(None, Some(&none), None, ToolFormat::Hermes).unwrap(),
            None
        );
        assert_eq!(
            ToolUse::parse(Some(&json!([])), None, None, ToolFormat::Hermes).unwrap(),
            None
        );
        assert_eq!(
            param(ToolUse::parse(
                None,
                Some(&json!("required")),
                None,
                ToolFormat::Hermes
            )),
            "tool_choice"
        );
        // A function without parameters takes none.
        let bare = json!([{"type": "function", "function": {"name": "now"}}]);
        let t = ToolUse::parse(Some(&bare), None, None, ToolFormat::Hermes)
            .unwrap()
            .unwrap();
        assert_eq!(t.tools[0].parameters["additionalProperties"], json!(false));
    }

    /// A strict tool's parameters must close every object (OpenAI's strict mode); a tool's
    /// parameters must describe an object, and the message says so plainly.
    #[test]
    fn strict_tools_and_non_object_parameters_are_refused_plainly() {
        let refusal = |function: Value| {
            let tools = json!([{"type": "function", "function": function}]);
            match ToolUse::parse(Some(&tools), None, None, ToolFormat::Hermes) {
                Err(ApiError::InvalidRequest { message, param }) => (param.unwrap(), message),
                other => panic!("{function}: {other:?}"),
            }
        };
        let (param, message) = refusal(json!({"name": "f", "parameters": {"type": "nope"}}));
        assert_eq!(param, "tools[0].function.parameters");
        assert_eq!(
            message,
            "parameters must be a JSON Schema object with \"type\": \"object\""
        );
        let open = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let (param, message) = refusal(json!({"name": "f", "parameters": open, "strict": true}));
        assert_eq!(param, "tools[0].function.parameters");
        assert!(message.contains("at # must set"), "{message}");
        let (param, _) = refusal(json!({"name": "f", "parameters": open, "strict": 1}));
        assert_eq!(param, "tools[0].function.strict");
        // Closed, every property required, or no parameters at all: accepted.
        for function in [
            json!({"name": "f", "strict": true, "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"],
                "additionalProperties": false}}),
            json!({"name": "f", "strict": true}),
            json!({"name": "f", "parameters": open, "strict": false}),
        ] {
            let tools = json!([{"type": "function", "function": function}]);
            assert!(
                ToolUse::parse(Some(&tools), None, None, ToolFormat::Hermes).is_ok(),
                "{function}"
            );
        }
    }

    #[test]
    fn bad_tool_fields_name_the_field() {
        let cases = [
            (json!({"a": 1}), None, "tools"),
            (json!([1]), None, "tools[0]"),
            (
                json!([{"type": "code", "function": {"name": "f"}}]),
                None,
                "tools[0].type",
            ),
            (json!([{"type": "function"}]), None, "tools[0].function"),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                None,
                "tools[0].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "x".repeat(65)}}]),
                None,
                "tools[0].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
                None,
                "tools[0].function.parameters",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "description": 3}}]),
                None,
                "tools[0].function.description",
            ),
            (
                json!([weather(), weather()]),
                None,
                "tools[1].function.name",
            ),
            (json!([weather()]), Some(json!("always")), "tool_choice"),
            (
                json!([weather()]),
                Some(json!({"type": "function", "function": {"name": "other"}})),
                "tool_choice",
            ),
            (
                json!([weather()]),
                Some(json!({"type": "function"})),
                "tool_choice",
            ),
            (json!([weather()]), Some(json!(3)), "tool_choice"),
        ];
        for (tools, choice, expected) in cases {
            assert_eq!(
                param(ToolUse::parse(
                    Some(&tools),
                    choice.as_ref(),
                    None,
                    ToolFormat::Hermes
                )),
                expected,
                "{tools} {choice:?}"
            );
        }
        let many: Vec<Value> = (0..=MAX_TOOLS)
            .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
            .collect();
        assert_eq!(
            param(ToolUse::parse(
                Some(&json!(many)),
                None,
                None,
                ToolFormat::Hermes
            )),
            "tools"
        );
        let huge = json!([{"type": "function", "function": {"name": "f", "parameters":
            {"type": "object", "description": "x".repeat(MAX_STRUCTURED_BYTES)}}}]);
        assert_eq!(
            param(ToolUse::parse(Some(&huge), None, None, ToolFormat::Hermes)),
            "tools"
        );
    }

    #[test]
    fn the_grammar_and_prompt_follow_the_choice() {
        let tools = json!([weather(), {"type": "function", "function": {"name": "now"}}]);
        let auto = ToolUse::parse(Some(&tools), None, None, ToolFormat::Hermes)
            .unwrap()
            .unwrap();
        let g = auto.grammar().unwrap();
        assert!(
            g.starts_with("start: TEXT | pre \"\\n\" body (\"\\n\" call)*\n"),
            "{g}"
        );
        assert!(g.contains("body: body_0 | body_1\n"), "{g}");
        assert!(
            g.contains(r#"body_0: "{\"name\": \"get_weather\", \"arguments\": " %json{"#),
            "{g}"
        );
        assert!(
            g.contains(r#"body_1: "{\"name\": \"now\", \"arguments\": " %json{"#),
            "{g}"
        );
        let Some(ToolPrompt::System(prompt)) = auto.prompt() else {
            panic!("a Hermes prompt goes to the system message");
        };
        assert!(prompt.contains(
            "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \
             \"Current weather in a city\", \"parameters\": {\"type\": \"object\", \"properties\": \
             {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n"
        ));
        let named = json!({"type": "function", "function": {"name": "now"}});
        let one = ToolUse::parse(Some(&tools), Some(&named), Some(false), ToolFormat::Hermes)
            .unwrap()
            .unwrap();
        let g = one.grammar().unwrap();
        assert!(g.starts_with("start: call\ncall: "), "{g}");
        // A named function is called once, even with parallel calls on.
        let once = ToolUse::parse(Some(&tools), Some(&named), Some(true), ToolFormat::Hermes)
            .unwrap()
            .unwrap();
        assert!(once.grammar().unwrap().starts_with("start: call\ncall: "));
        // The client's own x-guidance cannot change the format the reader expects.
        let odd = json!([{"type": "function", "function": {"name": "f", "parameters":
            {"type": "object", "x-guidance": {"item_separator": ";"}}}}]);
        let odd = ToolUse::parse(Some(&odd), None, None, ToolFormat::Hermes)
            .unwrap()
            .unwrap();
        let g = odd.grammar().unwrap();
        assert!(
            !g.contains(r#""item_separator":";""#) && g.contains(r#""item_separator":", ""#),
            "{g}"
        );
        assert!(!g.contains("get_weather"), "only the named tool: {g}");
        let Some(ToolPrompt::System(prompt)) = one.prompt() else {
            panic!("a Hermes prompt goes to the system message");
        };
        assert!(!prompt.contains("get_weather"), "{prompt}");
    }

    #[test]
    fn json_dumps_spaces_like_python() {
        let v = json!({"a": [1, 2, {"b": "c, d: e"}], "f": {}});
        assert_eq!(
            json_dumps(&v),
            r#"{"a": [1, 2, {"b": "c, d: e"}], "f": {}}"#
        );
    }

    #[test]
    fn conversation_calls_render_as_the_model_writes_them() {
        let calls = json!([
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
            {"id": "call_2", "type": "function",
             "function": {"name": "now", "arguments": {}}},
        ]);
        let text = render_calls(
            "messages[1].tool_calls",
            calls.as_array().unwrap(),
            ToolFormat::Hermes,
        )
        .unwrap();
        assert_eq!(
            text,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n\
             </tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"
        );
        // What this server wrote comes back as written, even where serde_json refuses it.
        let odd =
            json!([{"function": {"name": "f", "arguments": "{\"n\": 1e400, \"s\": \"\\ud800\"}"}}]);
        assert_eq!(
            render_calls("m", odd.as_array().unwrap(), ToolFormat::Hermes).unwrap(),
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 1e400, \"s\": \"\\ud800\"}}\n</tool_call>"
        );
        // Any other text too (OpenAI takes any string): a call cut short by `max_tokens`
        // comes back as this server answered it, and is written back as it was written.
        for args in [r#"{"city":"#, "{oops", "[1]", "3"] {
            let v = json!([{"function": {"name": "f", "arguments": args}}]);
            assert_eq!(
                render_calls("m", v.as_array().unwrap(), ToolFormat::Hermes).unwrap(),
                format!("<tool_call>\n{{\"name\": \"f\", \"arguments\": {args}}}\n</tool_call>")
            );
            let template = template_calls("m", v.as_array().unwrap(), ToolFormat::Hermes);
            assert_eq!(
                template.unwrap().unwrap()[0]["function"]["arguments"],
                json!(args)
            );
        }
        // An empty string is no arguments, as vLLM reads it.
        let empty = json!([{"function": {"name": "f", "arguments": " "}}]);
        assert_eq!(
            render_calls("m", empty.as_array().unwrap(), ToolFormat::Hermes).unwrap(),
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"
        );
        let bad = json!([{"function": {"name": "f", "arguments": 3}}]);
        match render_calls(
            "messages[1].tool_calls",
            bad.as_array().unwrap(),
            ToolFormat::Hermes,
        ) {
            Err(ApiError::InvalidRequest { param, .. }) => assert_eq!(
                param.as_deref(),
                Some("messages[1].tool_calls[0].function.arguments")
            ),
            other => panic!("{other:?}"),
        }
        let many = vec![json!({"function": {"name": "f"}}); MAX_TOOL_CALLS + 1];
        assert!(render_calls("m", &many, ToolFormat::Hermes).is_err());
    }

    fn read_all(chunks: &[&str]) -> (String, Vec<ParsedCall>) {
        read_in(ToolFormat::Hermes, chunks)
    }

    /// Reads `chunks` as one stream in `format`, checking what any reading must hold.
    fn read_in(format: ToolFormat, chunks: &[&str]) -> (String, Vec<ParsedCall>) {
        read_answer(format, false, chunks)
    }

    /// [`read_in`] for an answer that is calls only, or not.
    fn read_answer(
        format: ToolFormat,
        calls_only: bool,
        chunks: &[&str],
    ) -> (String, Vec<ParsedCall>) {
        let mut s = ToolStream::new(format).calls_only(calls_only);
        let mut pieces = Vec::new();
        for c in chunks {
            pieces.extend(s.push(c));
        }
        pieces.extend(s.finish());
        assert!(!s.holding());
        // Calls open in order; arguments go to the call opened last.
        let mut opened = 0;
        for p in &pieces {
            match p {
                ToolPiece::Call { index, .. } => {
                    assert_eq!(*index, opened);
                    opened += 1;
                }
                ToolPiece::Arguments { index, .. } => assert_eq!(index + 1, opened),
                ToolPiece::Text(_) => {}
            }
        }
        let (text, calls) = ToolPiece::join(pieces.clone());
        // Cut short: the last call's arguments are not a whole JSON value.
        assert_eq!(
            s.cut_short(),
            calls.last().is_some_and(|c| {
                !matches!(scan_value(c.arguments.as_bytes(), 0, 0), Scan::Done(n) if n == c.arguments.len())
            }),
            "{text:?} {calls:?}"
        );
        assert_eq!(s.calls(), opened);
        ToolPiece::join(pieces)
    }

    /// Text a model could write, made of pieces that trouble a reader: tags, whole and broken
    /// calls, JSON fragments, characters of several bytes, whitespace.
    fn model_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let piece = prop_oneof![
            Just("<tool_call>".to_string()),
            Just("</tool_call>".to_string()),
            Just(
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"¡é✓\"}}\n</tool_call>"
                    .to_string()
            ),
            Just("{\"name\": \"g\", \"arguments\": {}}".to_string()),
            Just("{\"name\": \"h\", \"parameters\": {\"x\": [1, \"}\"]}}".to_string()),
            Just("; ".to_string()),
            Just("[TOOL_CALLS]".to_string()),
            Just("[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": \"¡é✓\"}}]".to_string()),
            Just(", \"id\": \"123456789\"}".to_string()),
            Just(", ".to_string()),
            Just("]".to_string()),
            Just("\"\\\"}".to_string()),
            Just("{[".to_string()),
            Just("]}".to_string()),
            Just("1e4".to_string()),
            "[ \n\t]{1,3}",
            // Longer than the whitespace the reader holds back.
            "[ \n]{250,300}",
            "[a-z<>/_{}\",:¡é✓😀]{1,6}",
        ];
        proptest::collection::vec(piece, 0..12).prop_map(|v| v.concat())
    }

    proptest::proptest! {
        #[test]
        fn the_reader_never_panics_and_loses_no_text_however_it_is_cut(
            text in model_text(),
            cuts in proptest::collection::vec(0usize..200, 0..6),
            format in 0..3u8,
        ) {
            let format = match format {
                0 => ToolFormat::Hermes,
                1 => ToolFormat::Llama3Json,
                _ => ToolFormat::Mistral,
            };
            let mut points: Vec<usize> = cuts
                .into_iter()
                .map(|c| c % (text.len() + 1))
                .filter(|&c| text.is_char_boundary(c))
                .collect();
            points.sort_unstable();
            points.dedup();
            let mut chunks = Vec::new();
            let mut last = 0;
            for p in points {
                chunks.push(&text[last..p]);
                last = p;
            }
            chunks.push(&text[last..]);
            let (read, calls) = read_in(format, &chunks);
            // Cut or whole, the same reading.
            proptest::prop_assert_eq!(
                &(read.clone(), calls.clone()),
                &read_in(format, &[&text])
            );
            // Without calls, every byte of text comes back as it was.
            if calls.is_empty() {
                proptest::prop_assert_eq!(read, text);
            }
        }
    }

    #[test]
    fn arguments_go_out_as_they_are_written() {
        let mut s = ToolStream::new(ToolFormat::Hermes);
        let mut pieces = s.push("Sure.\n<tool_call>\n{\"name\": \"get_weather\", ");
        assert_eq!(pieces, [ToolPiece::Text("Sure.".into())]);
        assert!(s.holding());
        pieces = s.push("\"arguments\": {\"city\": \"Par");
        assert_eq!(
            pieces,
            [
                ToolPiece::Call {
                    index: 0,
                    name: "get_weather".into()
                },
                ToolPiece::Arguments {
                    index: 0,
                    text: "{\"city\": \"Par".into()
                }
            ]
        );
        assert!(!s.holding());
        pieces = s.push("is\"}}\n</tool");
        assert_eq!(
            pieces,
            [ToolPiece::Arguments {
                index: 0,
                text: "is\"}".into()
            }]
        );
        assert!(s.holding());
        pieces = s.push("_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}");
        assert_eq!(
            pieces,
            [
                ToolPiece::Call {
                    index: 1,
                    name: "now".into()
                },
                ToolPiece::Arguments {
                    index: 1,
                    text: "{}".into()
                }
            ]
        );
        assert!(s.finish().is_empty());
        assert_eq!(s.calls(), 2);
    }

    #[test]
    fn the_stream_reads_calls_and_text_however_the_text_is_cut() {
        let two = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"</tool_call>\", \
                   \"n\": 1e400, \"s\": \"\\ud800\"}}\n</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"now\"}\n</tool_call>";
        let expected = vec![
            ParsedCall {
                name: "get_weather".into(),
                // As written: no number rounded, no escape rejected.
                arguments: "{\"city\": \"</tool_call>\", \"n\": 1e400, \"s\": \"\\ud800\"}".into(),
            },
            ParsedCall {
                name: "now".into(),
                arguments: "{}".into(),
            },
        ];
        let think = format!("<think>hmm, the weather</think>\n\n{two}");
        // Characters of several bytes everywhere a cut or a search may land.
        let wide = "¡Olé! ✓\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Ta¡rbopia ✓✓\"}}\n</tool_call>";
        let prose = format!(
            "Let me look. \n{}",
            &two[..two.find("\n<tool_call>").unwrap()]
        );
        let no_close = two.trim_end_matches("</tool_call>").trim_end().to_string();
        let partial_close = two.trim_end_matches("call>").to_string();
        // A long run of whitespace (more than is held back) then text: nothing lost.
        let spaced = format!("a{}b <tool", "\n".repeat(600));
        // Many closing tags inside an argument.
        let inner = "</tool_call>".repeat(40);
        let tags_in_string = format!(
            "<tool_call>\n{{\"name\": \"now\", \"arguments\": {{\"s\": \"{inner}\"}}}}\n</tool_call>"
        );
        let lead_space_call = format!(
            "a{}<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}\n</tool_call>",
            "\n".repeat(600)
        );
        let spaced_close = format!(
            "<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}{}</tool_call>",
            " ".repeat(300)
        );
        let many_tags = ParsedCall {
            name: "now".into(),
            arguments: format!("{{\"s\": \"{inner}\"}}"),
        };
        let cases: Vec<(&str, String, Vec<ParsedCall>)> =
            vec![
            (two, String::new(), expected.clone()),
            (&think, "<think>hmm, the weather</think>".into(), expected.clone()),
            (&prose, "Let me look.".into(), vec![expected[0].clone()]),
            (
                wide,
                "¡Olé! ✓".into(),
                vec![ParsedCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\": \"Ta¡rbopia ✓✓\"}".into(),
                }],
            ),
            // The closing tag taken by a stop string: the complete call still counts.
            (&no_close, String::new(), expected.clone()),
            (&partial_close, String::new(), expected.clone()),
            (&spaced, spaced.clone(), Vec::new()),
            (&tags_in_string, String::new(), vec![many_tags.clone()]),
            ("Hello <tool", "Hello <tool".into(), Vec::new()),
            ("Hello <toolbox> \n", "Hello <toolbox> \n".into(), Vec::new()),
            ("<tool", "<tool".into(), Vec::new()),
            // Cut short (max_tokens) before its arguments begin: the unfinished call is text.
            (
                "<tool_call>\n{\"name\": \"now\", \"argu",
                "<tool_call>\n{\"name\": \"now\", \"argu".into(),
                Vec::new(),
            ),
            // A complete call, then one cut short (max_tokens) before its arguments: dropped,
            // no text comes after a call.
            (
                "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{",
                String::new(),
                vec![expected[1].clone()],
            ),
            // Not a call after the tag, or arguments that are no object: text.
            ("<tool_call>\nhello</tool_call>", "<tool_call>\nhello</tool_call>".into(), Vec::new()),
            (
                "<tool_call>\n{\"name\": \"now\", \"arguments\": 3}\n</tool_call>",
                "<tool_call>\n{\"name\": \"now\", \"arguments\": 3}\n</tool_call>".into(),
                Vec::new(),
            ),
            // Text after the calls is text.
            (
                "<tool_call>\n{\"name\": \"now\"}\n</tool_call> and so",
                " and so".into(),
                vec![expected[1].clone()],
            ),
            // Cut short in its arguments: a call, with the arguments written.
            (
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [\"b}",
                String::new(),
                vec![ParsedCall {
                    name: "f".into(),
                    arguments: "{\"a\": [\"b}".into(),
                }],
            ),
            // The call's last brace and its tag taken by a stop string.
            (
                "<tool_call>\n{\"name\": \"now\", \"arguments\": {}",
                String::new(),
                vec![expected[1].clone()],
            ),
            // Something else after streamed arguments: the call stands, the rest is text.
            (
                "<tool_call>\n{\"name\": \"now\", \"arguments\": {}, \"x\": 1}\n</tool_call>",
                ", \"x\": 1}\n</tool_call>".into(),
                vec![expected[1].clone()],
            ),
            // Whitespace before a call beyond what is held back is text, however it is cut.
            (
                &lead_space_call,
                format!("a{}", "\n".repeat(600 - MAX_HELD_SPACE)),
                vec![expected[1].clone()],
            ),
            // Too much whitespace between a streamed call's arguments and its end: the rest is
            // text, however it is cut.
            (
                &spaced_close,
                format!("}}{}</tool_call>", " ".repeat(300)),
                vec![expected[1].clone()],
            ),
            ("", String::new(), Vec::new()),
        ];
        for (text, want_text, want_calls) in cases {
            // Every way of cutting the text in two, and one character at a time.
            for cut in 0..=text.len() {
                if !text.is_char_boundary(cut) {
                    continue;
                }
                let got = read_all(&[&text[..cut], &text[cut..]]);
                assert_eq!(
                    got,
                    (want_text.clone(), want_calls.clone()),
                    "{text:?} cut at {cut}"
                );
            }
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(
                read_all(&refs),
                (want_text, want_calls),
                "{text:?} by chars"
            );
        }
    }

    #[test]
    fn a_call_opening_cut_short_at_the_end_is_dropped_once_the_answer_is_calls() {
        let now = |format: ToolFormat| ParsedCall {
            name: "now".into(),
            arguments: match format {
                ToolFormat::Hermes | ToolFormat::Mistral | ToolFormat::MistralV11 => "{}".into(),
                ToolFormat::Llama3Json => "{\"a\": 1}".into(),
            },
        };
        let hermes_call = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let llama_call = "{\"name\": \"now\", \"parameters\": {\"a\": 1}}";
        let mistral_call = "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}";
        // (format, calls only, text, the calls read): no text in any of them.
        let mut cases: Vec<(ToolFormat, bool, String, usize)> = Vec::new();
        for calls_only in [false, true] {
            // After a call (max_tokens 54/56/58 of the reviewer's two-tool request).
            for tail in [
                "\n<",
                "\n<tool_",
                "\n<tool_call>",
                "\n<tool_call>\n{\"name\": \"ge",
            ] {
                cases.push((
                    ToolFormat::Hermes,
                    calls_only,
                    format!("{hermes_call}{tail}"),
                    1,
                ));
            }
            for tail in ["; ", "; {", "; {\"name\": \"now\", \"param"] {
                cases.push((
                    ToolFormat::Llama3Json,
                    calls_only,
                    format!("{llama_call}{tail}"),
                    1,
                ));
            }
            for tail in [", ", ", {", ", {\"name\": \"now\", \"argu"] {
                cases.push((
                    ToolFormat::Mistral,
                    calls_only,
                    format!("{mistral_call}{tail}"),
                    1,
                ));
            }
            for tail in ["[", "[TOOL_CALLS]", "[TOOL_CALLS]now[AR", "\n"] {
                cases.push((
                    ToolFormat::MistralV11,
                    calls_only,
                    format!("[TOOL_CALLS]now[ARGS]{{}}{tail}"),
                    1,
                ));
            }
        }
        // Calls only, cut before the first call is whole: nothing at all.
        for text in [
            "<",
            "<tool_call",
            "\n<tool_call>\n{\"name\": \"now\", \"argu",
            "",
        ] {
            cases.push((ToolFormat::Hermes, true, text.into(), 0));
        }
        for text in [" \n", "{", "{\"name\": \"now\", \"para"] {
            cases.push((ToolFormat::Llama3Json, true, text.into(), 0));
        }
        for text in [
            "[",
            "[TOOL_CALLS",
            "\n[TOOL_CALLS] [{\"name\": \"now\", \"argu",
        ] {
            cases.push((ToolFormat::Mistral, true, text.into(), 0));
        }
        for text in ["[", "[TOOL_CALLS", " [TOOL_CALLS]now[ARGS]"] {
            cases.push((ToolFormat::MistralV11, true, text.into(), 0));
        }
        for (format, calls_only, text, calls) in cases {
            let want = (String::new(), vec![now(format); calls]);
            for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
                assert_eq!(
                    read_answer(format, calls_only, &[&text[..cut], &text[cut..]]),
                    want,
                    "{format:?} {calls_only} {text:?} cut at {cut}"
                );
            }
        }
        // With auto, a first call cut short is text, as vLLM's reader gives it back.
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
            ToolFormat::MistralV11,
        ] {
            let text = match format {
                ToolFormat::Hermes => "<tool_call>\n{\"name\": \"now\", \"argu",
                ToolFormat::Llama3Json => "{\"name\": \"now\", \"para",
                ToolFormat::Mistral => "[TOOL_CALLS] [{\"name\": \"now\", \"argu",
                ToolFormat::MistralV11 => "[TOOL_CALLS]now[AR",
            };
            assert_eq!(
                read_answer(format, false, &[text]),
                (text.into(), Vec::new())
            );
        }
    }

    #[test]
    fn llama3_calls_are_the_whole_answer_however_it_is_cut() {
        let call = |name: &str, arguments: &str| ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        };
        let weather = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Pa; ris ✓\"}}";
        let now = "{\"name\": \"now\", \"parameters\": {}}";
        let two = format!("{weather}; {now}");
        let expected = vec![
            call("get_weather", "{\"city\": \"Pa; ris ✓\"}"),
            call("now", "{}"),
        ];
        let lead = format!("{}{now}", "\n".repeat(600));
        let cases: Vec<(String, String, Vec<ParsedCall>)> = vec![
            (two.clone(), String::new(), expected.clone()),
            // Leading whitespace before a call is dropped; text is text from its first
            // character, braces and all.
            (format!(" \n{two}"), String::new(), expected.clone()),
            (
                format!("Sure: {weather}"),
                format!("Sure: {weather}"),
                Vec::new(),
            ),
            (" \n".into(), " \n".into(), Vec::new()),
            // Too much whitespace before the brace: text.
            (lead.clone(), lead, Vec::new()),
            // The call's `arguments` key is read too (a model that writes OpenAI's name).
            (
                "{\"name\": \"now\", \"arguments\": {\"a\": 1}}".into(),
                String::new(),
                vec![call("now", "{\"a\": 1}")],
            ),
            // A separator with nothing after it (a stop string took the rest).
            (format!("{now}; "), String::new(), vec![call("now", "{}")]),
            // Cut short in the second call's arguments: a call, with what was written.
            (
                format!("{now}; {{\"name\": \"f\", \"parameters\": {{\"a\": [\"b}}"),
                String::new(),
                vec![call("now", "{}"), call("f", "{\"a\": [\"b}")],
            ),
            // Cut short before the arguments begin: text.
            (
                "{\"name\": \"now\", \"para".into(),
                "{\"name\": \"now\", \"para".into(),
                Vec::new(),
            ),
            // Not a call: a JSON object without the call's fields is text.
            ("{\"a\": 1}".into(), "{\"a\": 1}".into(), Vec::new()),
            // Something other than a separator after a call: the call stands, the rest is text,
            // whether its arguments were streamed or (another key) the call read whole.
            (
                format!("{now} and so"),
                " and so".into(),
                vec![call("now", "{}")],
            ),
            (
                "{\"name\": \"now\", \"arguments\": {}} and so".into(),
                " and so".into(),
                vec![call("now", "{}")],
            ),
            (
                format!("{now}{}x", " ".repeat(300)),
                format!("{}x", " ".repeat(300)),
                vec![call("now", "{}")],
            ),
            (
                format!(
                    "{{\"arguments\": {{}}, \"name\": \"now\"}}{}x",
                    " ".repeat(300)
                ),
                format!("{}x", " ".repeat(300)),
                vec![call("now", "{}")],
            ),
            // A form feed is not the grammar's whitespace: text.
            (format!("\x0c{now}"), format!("\x0c{now}"), Vec::new()),
            // Hermes tags mean nothing here.
            (
                "<tool_call>\n{}\n</tool_call>".into(),
                "<tool_call>\n{}\n</tool_call>".into(),
                Vec::new(),
            ),
        ];
        for (text, want_text, want_calls) in cases {
            for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
                assert_eq!(
                    read_in(ToolFormat::Llama3Json, &[&text[..cut], &text[cut..]]),
                    (want_text.clone(), want_calls.clone()),
                    "{text:?} cut at {cut}"
                );
            }
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(
                read_in(ToolFormat::Llama3Json, &refs),
                (want_text, want_calls),
                "{text:?} by chars"
            );
        }
        // Arguments go out as they are written, after the call opens.
        let mut s = ToolStream::new(ToolFormat::Llama3Json);
        assert_eq!(s.push(" {\"name\": \"now\", \"param"), []);
        assert_eq!(
            s.push("eters\": {\"a\""),
            [
                ToolPiece::Call {
                    index: 0,
                    name: "now".into()
                },
                ToolPiece::Arguments {
                    index: 0,
                    text: "{\"a\"".into()
                }
            ]
        );
        assert_eq!(
            s.push(": 1}}"),
            [ToolPiece::Arguments {
                index: 0,
                text: ": 1}".into()
            }]
        );
        assert_eq!(s.finish(), []);
        assert!(!s.cut_short());
    }

    #[test]
    fn llama3_prompts_grammars_and_history_follow_meta() {
        let tools = json!([weather(), {"type": "function", "function": {"name": "now"}}]);
        let parse = |choice: Option<Value>, parallel: Option<bool>| {
            ToolUse::parse(
                Some(&tools),
                choice.as_ref(),
                parallel,
                ToolFormat::Llama3Json,
            )
            .unwrap()
            .unwrap()
        };
        let auto = parse(None, None);
        // Meta's words and Python's json.dumps(indent=4), as Llama 3.1's template writes custom
        // tools at the head of the first user message.
        let expected = r#"Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.

{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {
                    "type": "string"
                }
            },
            "required": [
                "city"
            ]
        }
    }
}

{
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {
            "type": "object",
            "properties": {},
            "additionalProperties": false
        }
    }
}

You may call several functions, the calls separated by "; ".

"#;
        assert_eq!(auto.prompt(), Some(ToolPrompt::FirstUser(expected.into())));
        let grammar = auto.grammar().unwrap();
        assert!(
            grammar.starts_with("start: TEXT | call (\"; \" call)*\n"),
            "{grammar}"
        );
        assert!(
            grammar.contains("\\\"parameters\\\": \" %json"),
            "{grammar}"
        );
        assert!(!grammar.contains("tool_call"), "{grammar}");
        let one = parse(Some(json!("required")), Some(false));
        assert!(one
            .grammar()
            .unwrap()
            .starts_with("start: call\ncall: body\n"));
        let Some(ToolPrompt::FirstUser(text)) = one.prompt() else {
            panic!("a Llama 3 prompt goes to the first user message");
        };
        assert!(text.ends_with("Call one function now.\n\n"), "{text}");
        // Calls in the conversation are written as the model writes them.
        let calls = json!([
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
            {"id": "b", "type": "function", "function": {"name": "now", "arguments": {}}},
        ]);
        assert_eq!(
            render_calls("m", calls.as_array().unwrap(), ToolFormat::Llama3Json).unwrap(),
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"now\", \"parameters\": {}}"
        );
    }

    #[test]
    fn the_format_follows_the_chat_template() {
        // Meta's Llama 3.1 template (the lines that name the format), Qwen 2.5's, SmolLM2's.
        let llama31 = "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}{{- \"<|python_tag|>\" }}";
        let qwen25 = "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags\" }}";
        let smollm2 = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}";
        assert_eq!(ToolFormat::for_template(llama31), ToolFormat::Llama3Json);
        assert_eq!(ToolFormat::for_template(qwen25), ToolFormat::Hermes);
        assert_eq!(ToolFormat::for_template(smollm2), ToolFormat::Hermes);
        assert_eq!(ToolFormat::Llama3Json.name(), "llama3_json");
    }
}
