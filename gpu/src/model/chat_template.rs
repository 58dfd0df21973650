//! Chat templates: the Jinja template a model ships (GGUF `tokenizer.chat_template`, or
//! `chat_template` in a Hugging Face `tokenizer_config.json`) rendered with minijinja the way
//! Hugging Face `apply_chat_template` renders it (`trim_blocks`, `lstrip_blocks`, loop
//! controls, `raise_exception`, Python string methods).
//!
//! Templates come from model files, so they run in a sandbox: no loader (a template cannot
//! include or import anything, hence no file or network access), a fuel limit on the
//! instructions executed, a recursion limit, and a bound on the size of the output. Not bounded:
//! the memory of values built inside a render (minijinja caps one string repetition at 100 MB,
//! not repeated `~` concatenation), see ARCHITECTURE.md.

use std::io::Write;
use std::path::Path;

use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use super::tokenizer::Tokenizer;
use crate::error::GpuError;

/// Longest template source accepted, in bytes.
pub const MAX_TEMPLATE_LEN: usize = 1 << 20;
/// Most bytes one rendering may produce.
pub const MAX_RENDER_LEN: usize = 16 << 20;
/// Instructions one rendering may execute (minijinja fuel).
pub const RENDER_FUEL: u64 = 10_000_000;
/// Largest `tokenizer_config.json` accepted, in bytes.
const MAX_TOKENIZER_CONFIG: u64 = 64 << 20;

const TEMPLATE_NAME: &str = "chat";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled, sandboxed chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
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
        env.set_fuel(Some(RENDER_FUEL));
        env.set_recursion_limit(64);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| render_err(&e))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
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
    /// A template that refuses a conversation opening with a system message (Gemma 2's and
    /// Mistral's first raise an exception: they have no system role) gets the system text at
    /// the head of the first user message instead, as Gemma 3's template places it itself.
    /// Should that fail too, the first error is returned.
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
        let first = match self.render_as_given(messages, add_generation_prompt, extra) {
            Err(e) => e,
            done => return done,
        };
        let Some(folded) = fold_system(messages) else {
            return Err(first);
        };
        let text = self
            .render_as_given(&folded, add_generation_prompt, extra)
            .map_err(|_| first)?;
        tracing::debug!(
            "the chat template refused a system message: rendered it in the first user message"
        );
        Ok(text)
    }

    fn render_as_given(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, GpuError> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| render_err(&e))?;
        // The keys written out win the merge over the request's variables spread after them.
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..minijinja::Value::from_serialize(extra)
        };
        let mut out = BoundedWriter {
            buf: Vec::new(),
            limit: MAX_RENDER_LEN,
        };
        match tmpl.render_captured_to(ctx, &mut out) {
            Ok(_) => {}
            Err(e) if out.buf.len() >= MAX_RENDER_LEN => {
                return Err(tmpl_err(format!(
                    "output exceeds {MAX_RENDER_LEN} bytes ({e})"
                )))
            }
            Err(e) => return Err(render_err(&e)),
        }
        String::from_utf8(out.buf).map_err(tmpl_err)
    }
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

/// An in-memory writer that fails once `limit` bytes have been written.
struct BoundedWriter {
    buf: Vec<u8>,
    limit: usize,
}

impl Write for BoundedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.limit {
            let room = self.limit - self.buf.len();
            self.buf.extend_from_slice(&data[..room]);
            return Err(std::io::Error::other("chat template output too long"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's template, as embedded in its GGUF file.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn render(src: &str, msgs: &[ChatMessage], gen: bool) -> Result<String, GpuError> {
        ChatTemplate::new(src, "<s>", "</s>")?.render(msgs, gen)
    }

    #[test]
    fn a_template_file_replaces_the_model_s_and_keeps_its_special_texts() {
        let dir = std::env::temp_dir().join(format!("sy-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
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
        std::fs::remove_dir_all(&dir).unwrap();
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
        // Other refusals stand, with the template's first error.
        let e = t
            .render(&[system, user.clone(), user.clone()], true)
            .unwrap_err();
        assert!(e.to_string().contains("System role not supported"), "{e}");
        let e = t.render(&[user.clone(), user], true).unwrap_err();
        assert!(e.to_string().contains("must alternate"), "{e}");
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

    #[test]
    fn output_size_is_bounded() {
        // 20 messages of 1 MiB each exceed the 16 MiB bound within the fuel.
        let big = "x".repeat(1 << 20);
        let msgs = vec![ChatMessage::new("user", big); 20];
        let e = render(
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            &msgs,
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("exceeds"), "{e}");
    }

    #[test]
    fn syntax_errors_are_reported() {
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
        assert!(ChatTemplate::new(&"x".repeat(MAX_TEMPLATE_LEN + 1), "", "").is_err());
    }

    #[test]
    fn tokenizer_config_template_and_tokens() {
        let dir = std::env::temp_dir().join(format!("sy-tmpl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
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
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
