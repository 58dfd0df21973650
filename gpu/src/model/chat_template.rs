//! Chat templates: the Jinja template a model ships (GGUF `tokenizer.chat_template`, or
//! `chat_template` in a Hugging Face `tokenizer_config.json`) rendered with minijinja the way
//! Hugging Face `apply_chat_template` renders it (`trim_blocks`, `lstrip_blocks`, loop
//! controls, `raise_exception`, `strftime_now`, a `tojson` that writes what Python's
//! `json.dumps` writes, Python string methods).
//!
//! Templates come from model files, so they run in a sandbox: no loader (a template cannot
//! include or import anything, hence no file or network access), a fuel limit on the
//! instructions executed, a recursion limit, bounded builtins, and a bound on the size of the
//! output. Not bounded: the memory of values built inside a rendering. The bounds, how they
//! were chosen and what they leave open are in [`sandbox`].

mod sandbox;

use std::path::Path;

use minijinja::value::{ArgType, Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use super::tokenizer::Tokenizer;
use crate::error::GpuError;

pub use sandbox::{MAX_ITEMS, MAX_PAD, MAX_RENDER_LEN, RECURSION_LIMIT, RENDER_FUEL};

/// Longest template source accepted, in bytes.
pub const MAX_TEMPLATE_LEN: usize = 1 << 20;
/// Largest `tokenizer_config.json` accepted, in bytes.
const MAX_TOKENIZER_CONFIG: u64 = 64 << 20;

const TEMPLATE_NAME: &str = "chat";

/// One message of a conversation, as Hugging Face's `apply_chat_template` hands it to a
/// template: the fields that are not set are absent (a template may ask
/// `'tool_calls' in message`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant message's tool calls in OpenAI's shape
    /// (`[{"id", "type": "function", "function": {"name", "arguments"}}]`), each call's
    /// `arguments` a JSON object as templates write it with `tojson`, or a string: arguments
    /// as the model wrote them that are no JSON object (a call cut short, `{"city":`), which
    /// a template writes as it is, with `tojson` too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The author's name (a tool message's function).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Byte ranges of `content` the server wrote itself (the markers of the tool prompt and
    /// tool results it writes where the template does not, Mistral's `[AVAILABLE_TOOLS]`):
    /// their added tokens stay tokens where the rest of the message's are text
    /// ([`super::content_escape::ContentEscaper::escape_messages`]). Not a template field.
    #[serde(skip)]
    pub server_text: Vec<std::ops::Range<usize>>,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }
}

/// A compiled, sandboxed chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    /// The template has no system role (found when it is compiled): a system message opening
    /// a conversation goes to the head of the first user message.
    folds_system: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn tmpl_err(e: impl std::fmt::Display) -> GpuError {
    GpuError::ChatTemplate(e.to_string())
}

/// Formats a minijinja error with its cause chain (template line, detail).
fn render_err(e: &Error) -> GpuError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    GpuError::ChatTemplate(msg)
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts of those tokens, exposed
    /// to the template as variables.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, GpuError> {
        if source.len() > MAX_TEMPLATE_LEN {
            return Err(tmpl_err(format!(
                "template of {} bytes is too long",
                source.len()
            )));
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        sandbox::configure(&mut env);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| -> Result<String, Error> {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64);
            strftime(&format, now)
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| render_err(&e))?;
        let mut template = ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            folds_system: false,
        };
        template.folds_system = template.refuses_system_role();
        Ok(template)
    }

    /// Whether the template has no system role: it refuses a system message before a user
    /// message, and takes the same text folded into the user message (Gemma 2's and the
    /// first Mistral's templates raise an exception on a system message).
    fn refuses_system_role(&self) -> bool {
        let none = serde_json::Map::new();
        let given = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hello"),
        ];
        self.render_as_given(&given, true, &none, MAX_RENDER_LEN)
            .is_err()
            && fold_system(&given).is_some_and(|f| {
                self.render_as_given(&f, true, &none, MAX_RENDER_LEN)
                    .is_ok()
            })
    }

    /// Reads and compiles the Jinja template file at `path` as [`ChatTemplate::from_file`]
    /// does, without a model (`bos_token` and `eos_token` empty): what `config check` and
    /// `serve` check of `model.chat_template` before the model loads, so that a missing file
    /// or a syntax error is refused at once rather than after a long load.
    pub fn check_file(path: &Path) -> Result<(), GpuError> {
        let source = super::read_bounded(path, MAX_TEMPLATE_LEN as u64)?;
        Self::new(&source, "", "").map(drop)
    }

    /// Reads a Jinja template file (at most [`MAX_TEMPLATE_LEN`] bytes) to replace `model`'s
    /// template, taking the texts of `bos_token` and `eos_token` from it (a Hugging Face
    /// model's `tokenizer_config.json` names the end of a turn there), or from `tokenizer`
    /// when the model has none.
    pub fn from_file(
        path: &Path,
        model: Option<&ChatTemplate>,
        tokenizer: &Tokenizer,
    ) -> Result<Self, GpuError> {
        let source = super::read_bounded(path, MAX_TEMPLATE_LEN as u64)?;
        if let Some(model) = model {
            return Self::new(&source, &model.bos_token, &model.eos_token);
        }
        let text = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_bytes(i))
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        Self::new(
            &source,
            &text(tokenizer.bos_token_id()),
            &text(tokenizer.eos_token_ids().first().copied()),
        )
    }

    /// What of a request's tools and its conversation's calls and results the template
    /// writes itself, found by rendering a probe: a conversation with a call of a tool, its
    /// result (the call's id 9 letters and digits, as Mistral's templates demand), an answer
    /// and a new question, the tool in `tools`. Qwen 2.5 and later, Llama 3.1, Hermes and
    /// Mistral's templates write all three, in the words the model was trained on.
    pub fn tool_support(&self) -> ToolSupport {
        const TOOL: &str = "switchyard_probe_tool";
        const CALLED: &str = "switchyard_probe_called";
        const RESULT: &str = "switchyard_probe_result";
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([{"id": "probe0001", "type": "function",
            "function": {"name": CALLED, "arguments": {"q": 1}}}]));
        let mut result = ChatMessage::new("tool", RESULT);
        result.tool_call_id = Some("probe0001".into());
        let messages = [
            ChatMessage::new("user", "What is it?"),
            call,
            result,
            ChatMessage::new("assistant", "It is."),
            ChatMessage::new("user", "And now?"),
        ];
        let mut extra = serde_json::Map::new();
        extra.insert(
            "tools".into(),
            serde_json::json!([{"type": "function", "function": {"name": TOOL,
                "description": "A probe", "parameters": {"type": "object", "properties": {}}}}]),
        );
        match self.render_as_given(&messages, true, &extra, MAX_RENDER_LEN) {
            Ok(text) => ToolSupport {
                tools: text.contains(TOOL),
                calls: text.contains(CALLED),
                results: text.contains(RESULT),
            },
            Err(_) => ToolSupport::default(),
        }
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Reads `chat_template`, `bos_token` and `eos_token` from a Hugging Face
    /// `tokenizer_config.json`; `Ok(None)` when it has no template.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>, GpuError> {
        let text = super::read_bounded(path, MAX_TOKENIZER_CONFIG)?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| tmpl_err(format!("{}: {e}", path.display())))?;
        let source = match v.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            // A list of named templates: take the one called "default".
            Some(serde_json::Value::Array(list)) => match list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            {
                Some(t) => t
                    .get("template")
                    .and_then(|s| s.as_str())
                    .ok_or_else(|| tmpl_err("default chat template is not a string"))?
                    .to_string(),
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        let token = |k: &str| -> String {
            match v.get(k) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(obj) => obj
                    .get("content")
                    .and_then(|c| c.as_str())
                    .unwrap_or_default()
                    .to_string(),
                None => String::new(),
            }
        };
        Self::new(&source, &token("bos_token"), &token("eos_token")).map(Some)
    }

    /// Renders a conversation; `add_generation_prompt` appends the assistant turn header.
    ///
    /// A template without a system role (Gemma 2's and Mistral's first raise an exception on
    /// a system message before a user message; found once, when the template is compiled) gets
    /// a conversation's opening system text at the head of the first user message instead, as
    /// Gemma 3's template places it itself. Any other refusal is the template's error.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, GpuError> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`ChatTemplate::render`] with more variables in the template's context (a request's
    /// `chat_template_kwargs`); the variables the server sets (`messages`,
    /// `add_generation_prompt`, `bos_token`, `eos_token`) take precedence.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, GpuError> {
        let ending = if add_generation_prompt {
            ChatEnding::GenerationPrompt
        } else {
            ChatEnding::Closed
        };
        self.render_ending(messages, ending, extra)
    }

    /// [`ChatTemplate::render_with`] for any [`ChatEnding`]: with
    /// [`ChatEnding::ContinueFinal`], the rendering is cut after the final message's text, as
    /// Hugging Face's `apply_chat_template(continue_final_message=True)` cuts it.
    pub fn render_ending(
        &self,
        messages: &[ChatMessage],
        ending: ChatEnding,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, GpuError> {
        self.render_within(messages, ending, extra, MAX_RENDER_LEN)
    }

    /// [`ChatTemplate::render_ending`], the rendering at most `max_len` bytes (the longest
    /// prompt text the caller could take): one that passes it stops there with
    /// [`GpuError::ChatTemplateTooLong`].
    pub fn render_within(
        &self,
        messages: &[ChatMessage],
        ending: ChatEnding,
        extra: &serde_json::Map<String, serde_json::Value>,
        max_len: usize,
    ) -> Result<String, GpuError> {
        let add_generation_prompt = ending == ChatEnding::GenerationPrompt;
        // A template without a system role gets the system text in the first user message;
        // any other template's refusal of a conversation is the template's error.
        let folded = if self.folds_system {
            fold_system(messages)
        } else {
            None
        };
        let text = self.render_as_given(
            folded.as_deref().unwrap_or(messages),
            add_generation_prompt,
            extra,
            max_len,
        )?;
        match ending {
            ChatEnding::ContinueFinal => {
                let last = messages.last().map_or("", |m| m.content.as_str());
                open_final_message(text, last)
            }
            _ => Ok(text),
        }
    }

    fn render_as_given(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
        max_len: usize,
    ) -> Result<String, GpuError> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| render_err(&e))?;
        // The keys written out win the merge over the request's variables spread after them.
        let ctx = minijinja::context! {
            messages => template_messages(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..minijinja::Value::from_serialize(extra)
        };
        sandbox::render(&tmpl, ctx, max_len)
    }
}

/// `messages` as a template reads them, each call's `arguments` given as a string made a safe
/// string: the text as it was written, which `tojson` writes as it is (a template that writes
/// a string as it is, or one that writes arguments with `tojson`, both give back what the
/// model wrote, not a quoted string). Chat templates render with no auto-escaping, so the
/// flag changes nothing else; only `tojson` of a string a template made safe itself (`|safe`)
/// is written unquoted, where Jinja2 would quote it.
fn template_messages(messages: &[ChatMessage]) -> Value {
    let raw = |call: &serde_json::Value| {
        call.pointer("/function/arguments")
            .is_some_and(serde_json::Value::is_string)
    };
    messages
        .iter()
        .map(|m| match &m.tool_calls {
            Some(serde_json::Value::Array(calls)) if calls.iter().any(raw) => {
                let calls: Value = calls.iter().map(template_call).collect();
                let mut fields = vec![
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                    ("tool_calls", calls),
                ];
                if let Some(id) = &m.tool_call_id {
                    fields.push(("tool_call_id", Value::from(id.as_str())));
                }
                if let Some(name) = &m.name {
                    fields.push(("name", Value::from(name.as_str())));
                }
                fields.into_iter().collect()
            }
            _ => Value::from_serialize(m),
        })
        .collect()
}

/// One call of [`template_messages`]: its `function.arguments`, where a string, safe.
fn template_call(call: &serde_json::Value) -> Value {
    let Some(fields) = call.as_object() else {
        return Value::from_serialize(call);
    };
    fields
        .iter()
        .map(|(key, value)| {
            let value = match (key.as_str(), value.as_object()) {
                ("function", Some(function)) => function
                    .iter()
                    .map(|(k, v)| match (k.as_str(), v) {
                        ("arguments", serde_json::Value::String(text)) => {
                            (k.as_str(), Value::from_safe_string(text.clone()))
                        }
                        _ => (k.as_str(), Value::from_serialize(v)),
                    })
                    .collect(),
                _ => Value::from_serialize(value),
            };
            (key.as_str(), value)
        })
        .collect()
}

/// What a chat template writes of tools ([`ChatTemplate::tool_support`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ToolSupport {
    /// The `tools` it is given.
    pub tools: bool,
    /// Assistant messages' `tool_calls`.
    pub calls: bool,
    /// `tool` messages.
    pub results: bool,
}

impl ToolSupport {
    /// All three: the template can write a conversation with tools by itself.
    pub fn complete(self) -> bool {
        self.tools && self.calls && self.results
    }
}

/// How a rendered conversation ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChatEnding {
    /// With the template's generation prompt: the model answers in a new assistant turn
    /// (`add_generation_prompt: true`, the default).
    #[default]
    GenerationPrompt,
    /// As the template closes the last message (`add_generation_prompt: false`).
    Closed,
    /// The final message left open, so that the model continues it (vLLM's and Hugging
    /// Face's `continue_final_message`): the rendering ends with that message's text.
    ContinueFinal,
}

/// Cuts `rendered` after the last occurrence of the final message's text, as Hugging Face's
/// `apply_chat_template(continue_final_message=True)` does: after the text as given when the
/// template kept it so (and it starts with no whitespace), else after the text without its
/// surrounding whitespace (which the template trimmed).
fn open_final_message(mut rendered: String, last: &str) -> Result<String, GpuError> {
    let trimmed = last.trim();
    if trimmed.is_empty() {
        return Err(tmpl_err(
            "continue_final_message needs a final message with text to continue",
        ));
    }
    let Some(at) = rendered.rfind(trimmed) else {
        return Err(tmpl_err(
            "continue_final_message: the chat template does not write the final message's \
             text as given, so it cannot be continued",
        ));
    };
    let kept_as_given = last.len() == last.trim_start().len() && rendered[at..].starts_with(last);
    let end = at
        + if kept_as_given {
            last.len()
        } else {
            trimmed.len()
        };
    rendered.truncate(end);
    Ok(rendered)
}

/// Python's `time.strftime(format)` at `secs` seconds since the Unix epoch, in UTC (Hugging
/// Face renders `strftime_now` in the server's local time; servers usually run in UTC).
/// The codes templates use are supported: `%Y %m %d %B %b %H %M %S %A %a %j %y %e %%`, and
/// glibc's unpadded `%-d %-m %-H %-M %-S %-j`; any other is an error.
fn strftime(format: &str, secs: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (tod / 3600, tod / 60 % 60, tod % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let yday = before + day + i64::from(leap && month > 2);
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut code = chars.next();
        let unpadded = code == Some('-');
        if unpadded {
            code = chars.next();
        }
        let num = |v: i64, width: usize| {
            if unpadded {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        let text = match (code, unpadded) {
            (Some('Y'), false) => year.to_string(),
            (Some('y'), false) => format!("{:02}", year.rem_euclid(100)),
            (Some('m'), _) => num(month, 2),
            (Some('d'), _) => num(day, 2),
            (Some('e'), false) => format!("{day:>2}"),
            (Some('j'), _) => num(yday, 3),
            (Some('H'), _) => num(hour, 2),
            (Some('M'), _) => num(minute, 2),
            (Some('S'), _) => num(second, 2),
            (Some('B'), false) => MONTHS[month as usize - 1].to_string(),
            (Some('b'), false) => MONTHS[month as usize - 1][..3].to_string(),
            (Some('A'), false) => DAYS[weekday].to_string(),
            (Some('a'), false) => DAYS[weekday][..3].to_string(),
            (Some('%'), false) => "%".to_string(),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported format in {format:?}"),
                ))
            }
        };
        out.push_str(&text);
    }
    Ok(out)
}

/// The proleptic Gregorian (year, month, day) of a day count from 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Deepest nesting `tojson` writes.
const MAX_JSON_DEPTH: usize = 128;

/// How `tojson` writes JSON (Python's `json.dumps` arguments).
struct JsonStyle {
    indent: Option<String>,
    ensure_ascii: bool,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// The `tojson` filter of Hugging Face's template environment: `json.dumps(x,
/// ensure_ascii=False, indent=None, separators=None, sort_keys=False)` with those arguments
/// in that order, positional or by name. Unlike minijinja's, nothing is HTML-escaped and
/// the separators are Python's (`", "` and `": "`; `","` between items when indenting).
fn tojson(value: Value, args: Rest<Value>) -> Result<String, Error> {
    let invalid = |m: String| Error::new(ErrorKind::InvalidOperation, format!("tojson: {m}"));
    let (positional, kwargs) = match args.split_last() {
        Some((last, rest)) if last.is_kwargs() => (rest, Kwargs::from_value(Some(last))?),
        _ => (
            &args[..],
            Kwargs::from_iter(std::iter::empty::<(&str, Value)>()),
        ),
    };
    if positional.len() > 4 {
        return Err(invalid(format!(
            "takes at most 4 arguments, {} given",
            positional.len()
        )));
    }
    let mut positional = positional.iter().cloned();
    let (ensure_ascii, indent, separators, sort_keys) = (
        positional.next(),
        positional.next(),
        positional.next(),
        positional.next(),
    );
    let arg = |pos: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        match (pos, named) {
            (Some(_), Some(_)) => Err(invalid(format!("{name} given twice"))),
            (p, n) => Ok(p.or(n).filter(|v| !v.is_none() && !v.is_undefined())),
        }
    };
    let ensure_ascii = arg(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let sort_keys = arg(sort_keys, "sort_keys")?.is_some_and(|v| v.is_true());
    let indent = match arg(indent, "indent")? {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => match v.as_i64() {
            // Python indents by that many spaces; none for 0 or less, but still new lines.
            Some(n) => Some(" ".repeat(n.clamp(0, 64) as usize)),
            None => return Err(invalid(format!("indent must be an integer, not {v}"))),
        },
    };
    let (item_sep, key_sep) = match arg(separators, "separators")? {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some(v) => {
            let parts: Vec<Value> = v
                .try_iter()
                .map_err(|_| invalid("separators must be an (item, key) pair".into()))?
                .collect();
            match parts.as_slice() {
                [i, k] if i.as_str().is_some() && k.as_str().is_some() => (
                    i.as_str().unwrap_or_default().to_string(),
                    k.as_str().unwrap_or_default().to_string(),
                ),
                _ => return Err(invalid("separators must be an (item, key) pair".into())),
            }
        }
    };
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        ensure_ascii,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, &value, &style, 0)?;
    Ok(out)
}

/// Writes `v` as Python's `json.dumps` would, failing once `out` holds more than the
/// rendering's bound (so a long lazy list is never collected).
fn write_json(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) -> Result<(), Error> {
    let invalid = |m: String| Error::new(ErrorKind::InvalidOperation, format!("tojson: {m}"));
    if depth > MAX_JSON_DEPTH {
        return Err(invalid(format!("nested deeper than {MAX_JSON_DEPTH}")));
    }
    let bound = sandbox::output_bound();
    if out.len() > bound {
        return Err(invalid(format!("the JSON exceeds {bound} bytes")));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(v)),
        // Arguments as written ([`template_messages`]): the text as it is.
        ValueKind::String if v.is_safe() => out.push_str(v.as_str().unwrap_or_default()),
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            let mut empty = true;
            for item in v.try_iter()? {
                if !empty {
                    out.push_str(&style.item_sep);
                }
                empty = false;
                newline(out, depth + 1);
                write_json(out, &item, style, depth + 1)?;
            }
            if !empty {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in v.try_iter()? {
                let value = v.get_item(&key)?;
                let key = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".to_string(),
                    ValueKind::Bool | ValueKind::Number => {
                        let mut k = String::new();
                        write_json(&mut k, &key, style, depth + 1)?;
                        k
                    }
                    _ => return Err(invalid(format!("keys must be strings, not {key}"))),
                };
                entries.push((key, value));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, value)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                write_json_str(out, key, style);
                out.push_str(&style.key_sep);
                write_json(out, value, style, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Undefined => return Err(invalid("an undefined value".into())),
        _ => return Err(invalid(format!("{v} is not JSON serializable"))),
    }
    Ok(())
}

/// A number as Python's `json.dumps` writes it: integers whole, floats by `repr` (`1.0`,
/// `1e+16`, `1e-05`), `NaN`, `Infinity`, `-Infinity`.
fn json_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let x = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = x.abs();
    if a == 0.0 || (1e-4..1e16).contains(&a) {
        let s = format!("{x}");
        return if s.contains('.') { s } else { s + ".0" };
    }
    // Shortest digits in exponent form, the exponent signed and of two digits at least.
    let s = format!("{x:e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let (sign, digits) = match exp.strip_prefix('-') {
        Some(d) => ('-', d),
        None => ('+', exp),
    };
    format!("{mantissa}e{sign}{digits:0>2}")
}

/// A JSON string as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other
/// control characters as `\u00XX`; with `ensure_ascii`, DEL and every non-ASCII character
/// as `\uXXXX` (UTF-16, surrogate pairs past U+FFFF).
fn write_json_str(out: &mut String, s: &str, style: &JsonStyle) {
    use std::fmt::Write as _;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (style.ensure_ascii && (c as u32) >= 0x7f) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `messages` with the system message it opens with moved to the head of the first user
/// message (a user message of its own when none follows it); `None` when it opens otherwise.
fn fold_system(messages: &[ChatMessage]) -> Option<Vec<ChatMessage>> {
    let (system, rest) = messages.split_first()?;
    if system.role != "system" {
        return None;
    }
    let mut out = rest.to_vec();
    match out.first_mut() {
        Some(m) if m.role == "user" => m.content = format!("{}\n\n{}", system.content, m.content),
        _ => out.insert(0, ChatMessage::new("user", system.content.clone())),
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's template, as embedded in its GGUF file.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn render(src: &str, msgs: &[ChatMessage], gen: bool) -> Result<String, GpuError> {
        ChatTemplate::new(src, "<s>", "</s>")?.render(msgs, gen)
    }

    /// `continue_final_message` as Hugging Face's `apply_chat_template` cuts the rendering:
    /// after the final message's text, without the turn's end and without a generation
    /// prompt; after the trimmed text when the template trims it; refused when the text is
    /// empty or the template does not write it.
    /// What a template writes of tools is what a probe rendering shows: all of tools, calls
    /// and results, some, or none (a template that fails on the probe writes none).
    #[test]
    fn what_a_template_writes_of_tools_is_found_by_rendering() {
        let support = |src: &str| ChatTemplate::new(src, "", "").unwrap().tool_support();
        let all = "{% set tools = tools or [] %}{{ tools | tojson }}{% for m in messages %}\
                   {{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function | tojson }}\
                   {% endfor %}{% endfor %}";
        assert!(support(all).complete());
        // Reads `tools` but writes only the messages' text (the calls' turn is empty).
        let text_only = "{% if tools is defined and tools is not none %}[tools]{% endif %}\
                         {% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(
            support(text_only),
            ToolSupport {
                tools: false,
                calls: false,
                results: true
            }
        );
        assert!(!support(SMOLLM2).tools);
        assert!(!support(SMOLLM2).complete());
        let refuses = "{% for m in messages %}{% if m.role == 'tool' %}\
                       {{ raise_exception('no tools') }}{% endif %}{% endfor %}";
        assert_eq!(support(refuses), ToolSupport::default());
    }

    /// Fields not set are absent from a message, as a template asking
    /// `'tool_calls' in message` (Llama 3.1's) expects; set ones are there.
    #[test]
    fn unset_message_fields_are_absent() {
        let src = "{% for m in messages %}{{ 'tool_calls' in m }} {{ m.tool_call_id is defined }} \
                   {{ m.tool_calls[0].function.arguments.city if m.tool_calls }};{% endfor %}";
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([
            {"type": "function", "function": {"name": "f", "arguments": {"city": "Rome"}}}]));
        let mut result = ChatMessage::new("tool", "18");
        result.tool_call_id = Some("a".into());
        let text = render(src, &[ChatMessage::new("user", "hi"), call, result], false).unwrap();
        assert_eq!(text, "False False ;True False Rome;False True ;");
    }

    /// Arguments that are no JSON object (a call cut short) reach the template as the text
    /// the model wrote, and come out as written whether the template writes a string as it is
    /// (Qwen's, Mistral v11's) or applies `tojson` to the arguments or to the whole function
    /// (Llama 3.1's, Mistral v3's); objects and other strings are written as before.
    #[test]
    fn arguments_as_written_render_as_written() {
        let cut = r#"{"city":"#;
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": cut}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": {"x": 1}}}]));
        call.name = Some("bot".into());
        let messages = [ChatMessage::new("user", "hi"), call];
        let qwen = "{% for m in messages %}{% for c in m.tool_calls or [] %}\
                    {% if c.function.arguments is string %}{{ c.function.arguments }}\
                    {% else %}{{ c.function.arguments | tojson }}{% endif %};{% endfor %}{% endfor %}";
        assert_eq!(
            render(qwen, &messages, false).unwrap(),
            format!("{cut};{{\"x\": 1}};")
        );
        let llama = "{% for m in messages %}{% for c in m.tool_calls or [] %}\
                     {{ c.function.arguments | tojson }};{% endfor %}{% endfor %}";
        assert_eq!(
            render(llama, &messages, false).unwrap(),
            format!("{cut};{{\"x\": 1}};")
        );
        let mistral = "{% for m in messages %}{% for c in m.tool_calls or [] %}\
                       {{ c.function | tojson }};{% endfor %}{% endfor %}";
        assert_eq!(
            render(mistral, &messages, false).unwrap(),
            format!(
                "{{\"name\": \"f\", \"arguments\": {cut}}};\
                     {{\"name\": \"g\", \"arguments\": {{\"x\": 1}}}};"
            )
        );
        let v11 = "{% for m in messages %}{% for c in m.tool_calls or [] %}\
                   {% set a = c.function.arguments %}{% if a is not string %}\
                   {% set a = a | tojson | safe %}{% endif %}{{ '[ARGS]' + a }}{% endfor %}\
                   {% endfor %}";
        assert_eq!(
            render(v11, &messages, false).unwrap(),
            format!("[ARGS]{cut}[ARGS]{{\"x\": 1}}")
        );
        // The message keeps its other fields, in order; other strings are quoted as before.
        let fields = "{% for m in messages %}{{ m | tojson }};{% endfor %}";
        let text = render(fields, &messages, false).unwrap();
        assert!(
            text.ends_with(&format!(
                "{{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{{\"id\": \"a\", \
                 \"type\": \"function\", \"function\": {{\"name\": \"f\", \"arguments\": {cut}}}}}, \
                 {{\"id\": \"b\", \"type\": \"function\", \"function\": {{\"name\": \"g\", \
                 \"arguments\": {{\"x\": 1}}}}}}], \"name\": \"bot\"}};"
            )),
            "{text}"
        );
        assert!(
            text.starts_with(r#"{"role": "user", "content": "hi"};"#),
            "{text}"
        );
    }

    #[test]
    fn a_continued_final_message_ends_the_rendering_at_its_text() {
        let t = ChatTemplate::new(SMOLLM2, "", "").unwrap();
        let none = serde_json::Map::new();
        let conversation = |last: &str| {
            vec![
                ChatMessage::new("user", "What is 2+2?"),
                ChatMessage::new("assistant", last),
            ]
        };
        let head = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
                    Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
                    <|im_start|>assistant\n";
        let open = t
            .render_ending(
                &conversation("The answer is"),
                ChatEnding::ContinueFinal,
                &none,
            )
            .unwrap();
        assert_eq!(open, format!("{head}The answer is"));
        // Closed: the turn ends and no new one opens.
        let closed = t
            .render_ending(&conversation("The answer is"), ChatEnding::Closed, &none)
            .unwrap();
        assert_eq!(closed, format!("{head}The answer is<|im_end|>\n"));
        // Whitespace the template keeps stays, at the end as given.
        let spaced = t
            .render_ending(
                &conversation("The answer is "),
                ChatEnding::ContinueFinal,
                &none,
            )
            .unwrap();
        assert_eq!(spaced, format!("{head}The answer is "));
        // Leading whitespace: cut after the trimmed text, as transformers does.
        let led = t
            .render_ending(&conversation(" Four \n"), ChatEnding::ContinueFinal, &none)
            .unwrap();
        assert_eq!(led, format!("{head} Four"));
        // A template that trims the content: cut after the trimmed text.
        let trims = ChatTemplate::new(
            "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}</s>{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            trims
                .render_ending(&conversation("It is  "), ChatEnding::ContinueFinal, &none)
                .unwrap(),
            "[user] What is 2+2?</s>[assistant] It is"
        );
        // Nothing to continue, or a template that does not write the text.
        let e = t
            .render_ending(&conversation("  "), ChatEnding::ContinueFinal, &none)
            .unwrap_err();
        assert!(e.to_string().contains("final message with text"), "{e}");
        let hides =
            ChatTemplate::new("{% for m in messages %}{{ m.role }};{% endfor %}", "", "").unwrap();
        let e = hides
            .render_ending(&conversation("Four"), ChatEnding::ContinueFinal, &none)
            .unwrap_err();
        assert!(e.to_string().contains("cannot be continued"), "{e}");
    }

    #[test]
    fn a_template_file_replaces_the_model_s_and_keeps_its_special_texts() {
        let dir = crate::scratch::ScratchDir::new("template");
        let file = dir.join("chat.jinja");
        std::fs::write(
            &file,
            "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
        )
        .unwrap();
        let model = ChatTemplate::new(SMOLLM2, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        let tokenizer = Tokenizer::from_json_bytes(
            br#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_file(&file, Some(&model), &tokenizer).unwrap();
        assert_eq!(
            t.source(),
            "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
        );
        assert_eq!(
            t.render(&[ChatMessage::new("user", "hi")], false).unwrap(),
            "<|begin_of_text|>hi<|eot_id|>"
        );
        // Too large, or not a template: refused with the reason.
        std::fs::write(&file, vec![b'x'; MAX_TEMPLATE_LEN + 1]).unwrap();
        let e = ChatTemplate::from_file(&file, Some(&model), &tokenizer).unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        std::fs::write(&file, "{% for %}").unwrap();
        assert!(ChatTemplate::from_file(&file, None, &tokenizer).is_err());
    }

    #[test]
    fn request_variables_reach_the_template_and_never_replace_the_server_s() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}{{ messages[0].content }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let m = [ChatMessage::new("user", "hi")];
        let kwargs = |v: serde_json::Value| v.as_object().unwrap().clone();
        assert_eq!(t.render(&m, false).unwrap(), "<s>hi");
        assert_eq!(
            t.render_with(
                &m,
                false,
                &kwargs(serde_json::json!({"enable_thinking": false}))
            )
            .unwrap(),
            "<s>/no_think hi"
        );
        assert_eq!(
            t.render_with(
                &m,
                false,
                &kwargs(serde_json::json!({"bos_token": "x", "messages": []}))
            )
            .unwrap(),
            "<s>hi"
        );
    }

    #[test]
    fn smollm2_template_adds_default_system_prompt() {
        let out = render(SMOLLM2, &[ChatMessage::new("user", "hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = render(
            SMOLLM2,
            &[
                ChatMessage::new("system", "S"),
                ChatMessage::new("user", "U"),
            ],
            false,
        )
        .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
    }

    #[test]
    fn blocks_are_trimmed_like_hugging_face() {
        let src = "{% for m in messages %}\n  {{ m.content }}\n{% endfor %}";
        let out = render(
            src,
            &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
            false,
        );
        assert_eq!(out.unwrap(), "  a\n  b\n");
    }

    #[test]
    fn python_methods_and_special_variables() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip() }}{% if m.role.startswith('as') %}{{ eos_token }}{% endif %}{% endfor %}";
        let out = render(
            src,
            &[
                ChatMessage::new("user", "  q "),
                ChatMessage::new("assistant", "a"),
            ],
            false,
        );
        assert_eq!(out.unwrap(), "<s>qa</s>");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok";
        let e = render(src, &[ChatMessage::new("assistant", "x")], false).unwrap_err();
        assert!(e.to_string().contains("first must be user"), "{e}");
        assert_eq!(
            render(src, &[ChatMessage::new("user", "x")], false).unwrap(),
            "ok"
        );
    }

    /// Gemma 2's template (google/gemma-2-2b-it's `tokenizer_config.json`), which refuses a
    /// system message.
    const GEMMA2: &str = "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}";

    #[test]
    fn a_system_message_a_template_refuses_opens_the_first_user_turn() {
        let t = ChatTemplate::new(GEMMA2, "<bos>", "<eos>").unwrap();
        let system = ChatMessage::new("system", "Answer in French.");
        let user = ChatMessage::new("user", "Hello");
        // What Gemma 3's template writes for the same conversation (it folds the system
        // message itself): the system text, a blank line, the user's.
        assert_eq!(
            t.render(&[system.clone(), user.clone()], true).unwrap(),
            "<bos><start_of_turn>user\nAnswer in French.\n\nHello<end_of_turn>\n<start_of_turn>model\n"
        );
        // A system message alone becomes the user turn.
        assert_eq!(
            t.render(std::slice::from_ref(&system), true).unwrap(),
            "<bos><start_of_turn>user\nAnswer in French.<end_of_turn>\n<start_of_turn>model\n"
        );
        // Before an assistant message, too.
        assert_eq!(
            t.render(&[system.clone(), ChatMessage::new("assistant", "Bonjour")], false)
                .unwrap(),
            "<bos><start_of_turn>user\nAnswer in French.<end_of_turn>\n<start_of_turn>model\nBonjour<end_of_turn>\n"
        );
        // Other refusals stand, with the template's error.
        let e = t
            .render(&[system, user.clone(), user.clone()], true)
            .unwrap_err();
        assert!(e.to_string().contains("must alternate"), "{e}");
        let e = t.render(&[user.clone(), user], true).unwrap_err();
        assert!(e.to_string().contains("must alternate"), "{e}");
    }

    /// A template with a system role keeps its own refusals: a conversation it refuses is not
    /// retried with the system text moved (Llama 3.1's raises without a user message to put
    /// the tools in; folding the system text into one would answer what transformers
    /// refuses).
    #[test]
    fn a_template_with_a_system_role_keeps_its_refusals() {
        let src = "{% for m in messages %}{% if m.role == 'system' and messages | length == 1 %}\
                   {{ raise_exception('needs a user message') }}{% endif %}\
                   {{ m.role }}: {{ m.content }}\n{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let system = ChatMessage::new("system", "Be brief.");
        let e = t.render(std::slice::from_ref(&system), true).unwrap_err();
        assert!(e.to_string().contains("needs a user message"), "{e}");
        assert_eq!(
            t.render(&[system, ChatMessage::new("user", "Hi")], true)
                .unwrap(),
            "system: Be brief.\nuser: Hi\n"
        );
    }

    #[test]
    fn sandbox_has_no_file_access() {
        let e = render("{% include '/etc/passwd' %}", &[], false).unwrap_err();
        assert!(e.to_string().contains("passwd"), "{e}");
        assert!(render("{% import 'x' as y %}", &[], false).is_err());
    }

    #[test]
    fn runaway_loops_run_out_of_fuel() {
        let src =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let e = render(src, &[], false).unwrap_err();
        assert!(e.to_string().contains("fuel"), "{e}");
    }

    /// (year, month, day) of now in UTC, counted year by year and month by month (not the
    /// code under test's arithmetic).
    fn today_utc() -> (i64, i64, i64) {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let mut days = secs / 86_400;
        let mut year = 1970;
        let leap = |y: i64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
        while days >= 365 + i64::from(leap(year)) {
            days -= 365 + i64::from(leap(year));
            year += 1;
        }
        let mut month = 1;
        for len in [
            31,
            28 + i64::from(leap(year)),
            31,
            30,
            31,
            30,
            31,
            31,
            30,
            31,
            30,
            31,
        ] {
            if days < len {
                break;
            }
            days -= len;
            month += 1;
        }
        (year, month, days + 1)
    }

    #[test]
    fn strftime_now_writes_today() {
        // Mistral Small 3.1 calls it unguarded; Llama 3.x after `is defined`.
        let src = "{% if strftime_now is defined %}{{ strftime_now('%Y-%m-%d') }}{% else %}none{% endif %}";
        let before = today_utc();
        let out = render(src, &[], false).unwrap();
        let after = today_utc();
        let expect = |(y, m, d): (i64, i64, i64)| format!("{y:04}-{m:02}-{d:02}");
        assert!(
            out == expect(before) || out == expect(after),
            "{out} is not {before:?} or {after:?}"
        );
        let e = render("{{ strftime_now('%Y %Q') }}", &[], false).unwrap_err();
        assert!(e.to_string().contains("unsupported"), "{e}");
        assert!(render("{{ strftime_now('%') }}", &[], false).is_err());
    }

    #[test]
    fn strftime_codes_match_python() {
        // time.strftime(f, time.gmtime(1709211909)), a leap day.
        assert_eq!(
            strftime("%Y %m %d %B %b %H %M %S %A %a %j %y %e %%", 1_709_211_909).unwrap(),
            "2024 02 29 February Feb 13 05 09 Thursday Thu 060 24 29 %"
        );
        assert_eq!(
            strftime("%d %b %Y, %-d/%-m %e|%j", 0).unwrap(),
            "01 Jan 1970, 1/1  1|001"
        );
        // 2000-12-31 (leap year, day 366) and 2100-03-01 (not a leap year).
        assert_eq!(
            strftime("%Y-%m-%d %j %a", 978_264_000).unwrap(),
            "2000-12-31 366 Sun"
        );
        assert_eq!(
            strftime("%Y-%m-%d %j %A", 4_107_542_400).unwrap(),
            "2100-03-01 060 Monday"
        );
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let r = |src: &str| render(src, &[], false);
        // json.dumps(x, ensure_ascii=False): Python's separators, insertion order, no
        // HTML escaping.
        assert_eq!(
            r(r#"{{ {"b":1,"a":[1,2],"s":"it's < 5 & > 2"}|tojson }}"#).unwrap(),
            r#"{"b": 1, "a": [1, 2], "s": "it's < 5 & > 2"}"#
        );
        assert_eq!(
            r(r#"{{ {"b":1,"a":[1,2],"e":{},"l":[]}|tojson(indent=2) }}"#).unwrap(),
            "{\n  \"b\": 1,\n  \"a\": [\n    1,\n    2\n  ],\n  \"e\": {},\n  \"l\": []\n}"
        );
        assert_eq!(
            r(r#"{{ {"b":1,"a":[1,2.5,1e20,0.00001,none,true]}|tojson(sort_keys=true, separators=(",", ":")) }}"#)
                .unwrap(),
            r#"{"a":[1,2.5,1e+20,1e-05,null,true],"b":1}"#
        );
        // Hugging Face's argument order: ensure_ascii, indent, separators, sort_keys.
        assert_eq!(
            r(r#"{{ "é😀\x01"|tojson }} {{ "é😀"|tojson(true) }} {{ "é"|tojson(ensure_ascii=true) }}"#)
                .unwrap(),
            "\"é😀\\u0001\" \"\\u00e9\\ud83d\\ude00\" \"\\u00e9\""
        );
        assert_eq!(
            r(r#"{{ ["q\"\\", 1.0, {"k": "v"}]|tojson(false, 1, ("; ", " = ")) }}"#).unwrap(),
            "[\n \"q\\\"\\\\\"; \n 1.0; \n {\n  \"k\" = \"v\"\n }\n]"
        );
        // What Python refuses is refused.
        assert!(r("{{ 1|tojson(foo=1) }}").is_err());
        assert!(r("{{ 1|tojson(true, ensure_ascii=true) }}").is_err());
        assert!(r("{{ 1|tojson(indent='x', separators=1) }}").is_err());
        assert!(r("{{ undefined_thing|tojson }}").is_err());
    }

    #[test]
    fn request_values_keep_their_key_order() {
        let t = ChatTemplate::new(
            "{{ tools|tojson }}|{% for k, v in tools[0]|items %}{{ k }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let extra =
            serde_json::json!({"tools": [{"name": "f", "description": "d", "parameters": {}}]});
        assert_eq!(
            t.render_with(&[], false, extra.as_object().unwrap())
                .unwrap(),
            r#"[{"name": "f", "description": "d", "parameters": {}}]|namedescriptionparameters"#
        );
    }

    #[test]
    fn syntax_errors_are_reported() {
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
        assert!(ChatTemplate::new(&"x".repeat(MAX_TEMPLATE_LEN + 1), "", "").is_err());
    }

    #[test]
    fn tokenizer_config_template_and_tokens() {
        let dir = crate::scratch::ScratchDir::new("tmpl");
        let p = dir.join("tokenizer_config.json");
        std::fs::write(
            &p,
            r#"{"bos_token": {"content": "<B>"}, "eos_token": "<E>",
                "chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}]}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_tokenizer_config(&p).unwrap().unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "m")], false).unwrap(),
            "<B>m<E>"
        );
        std::fs::write(&p, r#"{"eos_token": "<E>"}"#).unwrap();
        assert!(ChatTemplate::from_tokenizer_config(&p).unwrap().is_none());
    }
}
