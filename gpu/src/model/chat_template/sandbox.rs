//! The bounds of the chat-template sandbox, and what they leave unbounded.
//!
//! A rendering runs a model file's template (hostile input) over a request's conversation
//! (hostile input too). Besides having no loader (no file or network access), it is bounded
//! in:
//! - **output**: at most the bound its caller sets, the longest prompt text the model could
//!   still take (the tokenizer actors pass `Tokenizer::max_text_len`: the context times the
//!   most bytes one token stands for, at most `MAX_ENCODE_LEN`, 64 MiB, the longest text the
//!   tokenizer encodes), [`MAX_RENDER_LEN`] without one. A rendering stops as it passes the
//!   bound, with [`GpuError::ChatTemplateTooLong`]: a longer prompt could not be encoded
//!   anyway, so the bound refuses nothing that would have been served.
//! - **instructions**: [`RENDER_FUEL`] (minijinja's fuel: one unit per instruction). A
//!   Llama 3.1-style template spends about 35 per message, so the API's longest conversation
//!   (1024 messages, with its 128 tools) takes about 35 000: the fuel leaves a factor of 280.
//!   It bounds loops (minijinja itself refuses `range` beyond 100 000 items) and with them the
//!   time of a rendering whose steps are small.
//! - **recursion**: [`RECURSION_LIMIT`] nested macro calls, includes and recursive loops.
//! - **counts**: the builtins that allocate from a number refuse large ones, which would abort
//!   the process (a failed allocation is not a panic): `indent`'s width and the widths and
//!   precisions of `format` and `str.format` at most [`MAX_PAD`], the count of `batch` and
//!   `slice` at most [`MAX_ITEMS`]. minijinja refuses a string repeated with `*` past 100 MB
//!   itself, and this sandbox's `tojson` writes at most [`MAX_RENDER_LEN`] bytes.
//! - **panics**: a panic inside minijinja is an error of that rendering, not of the thread.
//!
//! A rendering that passes a bound fails with an error, which the server answers with 400:
//! the template is the operator's file, but which bound a rendering reaches depends on the
//! request (its messages, tools and `chat_template_kwargs`), and a template that fails every
//! request is found by the first one.
//!
//! **Not bounded: the memory of the values a rendering builds.** An instruction costs one unit
//! of fuel whatever the size of its operands, and `~`, `+` and lists repeated with `*` (lazily,
//! so that `"" ~ [x] * n` or `|join` builds them) make values from values with no size check:
//! a template can double a string in each of a few dozen steps. Only the template can do it:
//! a request's values are data, never template code, and templates that only place them (every
//! known chat template) build values linear in them. One that doubles a fixed number of times
//! aborts the process at load (a rendering probes whether it takes a system message; a failed
//! allocation aborts), one that doubles per message at a request with enough of them. Bounding
//! it needs minijinja to check sizes in its operators (2.24 has no such hook), or renderings in
//! a memory-limited process.

use std::cell::Cell;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};

use minijinja::value::{Kwargs, Rest, StringInput, Value};
use minijinja::{Environment, Error, ErrorKind, FormatStyle, State, Template};

use super::super::tokenizer::MAX_ENCODE_LEN;
use crate::error::GpuError;

/// Longest rendering when the caller sets no bound: the longest text the tokenizer encodes.
pub const MAX_RENDER_LEN: usize = MAX_ENCODE_LEN;
/// Instructions one rendering may execute (minijinja fuel); see the module's documentation.
pub const RENDER_FUEL: u64 = 10_000_000;
/// Deepest nesting of macro calls, includes and recursive loops.
pub const RECURSION_LIMIT: usize = 64;
/// Largest width `indent` indents by, and largest width or precision in a `format` or
/// `str.format` field: paddings that size are already far beyond any prompt's layout.
pub const MAX_PAD: usize = 1024;
/// Largest count of `batch` and `slice` (which allocate that many slots): the number of
/// items minijinja's `range` makes at most.
pub const MAX_ITEMS: usize = 100_000;

/// Sets the sandbox's bounds on `env` and replaces the builtins that allocate from a number
/// with bounded ones.
pub(super) fn configure(env: &mut Environment<'static>) {
    env.set_fuel(Some(RENDER_FUEL));
    env.set_recursion_limit(RECURSION_LIMIT);
    env.set_unknown_method_callback(|state, value, method, args| {
        if method == "format" {
            if let Some(format) = value.as_str() {
                check_format(format, FormatStyle::StrFormat)?;
            }
        }
        minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
    });
    env.add_filter("indent", indent);
    env.add_filter("batch", batch);
    env.add_filter("slice", slice);
    env.add_filter("format", format);
}

fn too_large(what: &str, value: usize, limit: usize) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("{what} {value} is larger than the chat template sandbox allows ({limit})"),
    )
}

fn check_count(what: &str, value: usize, limit: usize) -> Result<(), Error> {
    if value > limit {
        return Err(too_large(what, value, limit));
    }
    Ok(())
}

/// minijinja's `indent`, its width at most [`MAX_PAD`].
fn indent(
    value: StringInput<'_>,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let named = match width {
        Some(_) => None,
        None => kwargs.peek::<Option<usize>>("width")?,
    };
    check_count("indent: a width of", width.or(named).unwrap_or(0), MAX_PAD)?;
    minijinja::filters::indent(value, width, first, blank, kwargs)
}

/// minijinja's `batch`, its count at most [`MAX_ITEMS`].
fn batch(
    state: &State,
    value: Value,
    count: usize,
    fill_with: Option<Value>,
) -> Result<Value, Error> {
    check_count("batch: a count of", count, MAX_ITEMS)?;
    minijinja::filters::batch(state, value, count, fill_with)
}

/// minijinja's `slice`, its count at most [`MAX_ITEMS`].
fn slice(
    state: &State,
    value: Value,
    count: usize,
    fill_with: Option<Value>,
) -> Result<Value, Error> {
    check_count("slice: a count of", count, MAX_ITEMS)?;
    minijinja::filters::slice(state, value, count, fill_with)
}

/// minijinja's `format` (printf style), its widths and precisions at most [`MAX_PAD`].
fn format(state: &State, format: &Value, args: Rest<Value>) -> Result<Value, Error> {
    if let Some(text) = format.as_str() {
        check_format(text, FormatStyle::Printf)?;
    }
    minijinja::filters::format(state, format, args)
}

/// Refuses a format string with a field whose width or precision exceeds [`MAX_PAD`]: every
/// number in the specification of a field (`%…` up to its type, or what follows `:` in
/// `{…}`) counts, a digit of fill included, so nothing larger can slip through.
fn check_format(format: &str, style: FormatStyle) -> Result<(), Error> {
    let largest = match style {
        FormatStyle::Printf => largest_printf_number(format),
        _ => largest_str_format_number(format),
    };
    check_count("format: a width or precision of", largest, MAX_PAD)
}

/// The value of each run of ASCII digits in `spec` (`usize::MAX` for one that overflows).
fn numbers(spec: &str) -> impl Iterator<Item = usize> + '_ {
    spec.split(|c: char| !c.is_ascii_digit())
        .filter(|run| !run.is_empty())
        .map(|run| run.parse().unwrap_or(usize::MAX))
}

fn largest_printf_number(format: &str) -> usize {
    let mut largest = 0;
    let mut rest = format;
    while let Some(at) = rest.find('%') {
        rest = &rest[at + 1..];
        if let Some(after) = rest.strip_prefix('%') {
            rest = after;
            continue;
        }
        // A mapping key, then flags, width, precision and length modifiers, up to the type.
        if rest.starts_with('(') {
            rest = rest.find(')').map_or("", |end| &rest[end + 1..]);
        }
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || "#0- +.hlL".contains(c)))
            .unwrap_or(rest.len());
        largest = numbers(&rest[..end]).fold(largest, usize::max);
        rest = &rest[end..];
    }
    largest
}

fn largest_str_format_number(format: &str) -> usize {
    let mut largest = 0;
    let mut rest = format;
    while let Some(at) = rest.find('{') {
        rest = &rest[at + 1..];
        if let Some(after) = rest.strip_prefix('{') {
            rest = after;
            continue;
        }
        let end = rest.find('}').unwrap_or(rest.len());
        if let Some((_, spec)) = rest[..end].split_once(':') {
            largest = numbers(spec).fold(largest, usize::max);
        }
        rest = &rest[end..];
    }
    largest
}

thread_local! {
    /// The output bound of the rendering running on this thread.
    static BOUND: Cell<usize> = const { Cell::new(MAX_RENDER_LEN) };
}

/// The output bound of the rendering running on this thread ([`MAX_RENDER_LEN`] outside
/// one), for the filters that build text.
pub(super) fn output_bound() -> usize {
    BOUND.with(Cell::get)
}

/// Restores, when dropped, the bound in force before.
struct BoundInForce(usize);

impl Drop for BoundInForce {
    fn drop(&mut self) {
        BOUND.with(|b| b.set(self.0));
    }
}

/// Renders `template` with `ctx`, at most `limit` bytes; a panic inside the rendering is
/// its error.
pub(super) fn render(template: &Template, ctx: Value, limit: usize) -> Result<String, GpuError> {
    let _restore = BoundInForce(BOUND.with(|b| b.replace(limit)));
    let mut out = BoundedWriter {
        buf: Vec::new(),
        limit,
        overflowed: false,
    };
    let rendered = catch_unwind(AssertUnwindSafe(|| {
        template.render_captured_to(ctx, &mut out).map(drop)
    }));
    match rendered {
        Ok(Ok(())) => String::from_utf8(out.buf).map_err(super::tmpl_err),
        Ok(Err(_)) if out.overflowed => Err(GpuError::ChatTemplateTooLong { limit }),
        Ok(Err(e)) => Err(super::render_err(&e)),
        Err(panic) => {
            let reason = panic
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("a panic");
            Err(super::tmpl_err(format!("the rendering failed: {reason}")))
        }
    }
}

/// An in-memory writer that fails once more than `limit` bytes would be written.
struct BoundedWriter {
    buf: Vec<u8>,
    limit: usize,
    /// A write was refused for the bound.
    overflowed: bool,
}

impl Write for BoundedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if data.len() > self.limit - self.buf.len() {
            self.overflowed = true;
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
    use super::super::{ChatEnding, ChatMessage, ChatTemplate};
    use super::*;

    fn render(src: &str) -> Result<String, GpuError> {
        ChatTemplate::new(src, "", "")?.render(&[], false)
    }

    fn refused(src: &str, why: &str) {
        let e = render(src).expect_err(src);
        assert!(e.to_string().contains(why), "{src}: {e}");
    }

    /// The builtins that allocate from a number refuse numbers that would abort the
    /// process (a failed allocation) or hold it for long; the sizes templates use pass.
    #[test]
    fn builtins_that_allocate_from_a_number_are_bounded() {
        const HUGE: &str = "1099511627776"; // 2^40: each of these would allocate a TiB or more
        for src in [
            format!("{{{{ 'a\nb'|indent({HUGE}) }}}}"),
            format!("{{{{ 'a\nb'|indent(width={HUGE}, first=true) }}}}"),
            format!("{{{{ [1, 2]|batch({HUGE})|list }}}}"),
            format!("{{{{ [1, 2]|slice({HUGE})|list }}}}"),
            format!("{{{{ '%{HUGE}s'|format('x') }}}}"),
            format!("{{{{ '%(a).{HUGE}f'|format(a=1.5) }}}}"),
            format!("{{{{ '{{:>{HUGE}}}'.format('x') }}}}"),
            format!("{{{{ '{{0:.{HUGE}}}'.format(1.5) }}}}"),
        ] {
            refused(&src, "larger than the chat template sandbox allows");
        }
        assert_eq!(
            render("{{ 'a\nb'|indent(4, true) }}").unwrap(),
            "    a\n    b"
        );
        assert_eq!(render("{{ 'a\nb'|indent(width=2) }}").unwrap(), "a\n  b");
        assert_eq!(
            render("{{ [1, 2, 3]|batch(2)|list }}|{{ [1, 2, 3]|slice(2)|list }}").unwrap(),
            "[[1, 2], [3]]|[[1, 2], [3]]"
        );
        assert_eq!(
            render("{{ '%5s|%-3d|%.2f|%%'|format('x', 7, 1.234) }}").unwrap(),
            "    x|7  |1.23|%"
        );
        assert_eq!(
            render("{{ '{:>4}|{:0>3}|{:.2f}'.format(7, 5, 1.234) }}").unwrap(),
            "   7|005|1.23"
        );
    }

    /// What minijinja bounds itself: `*` repeats a string to 100 MB at most, `range` makes
    /// 100 000 items at most, and loops run out of fuel.
    #[test]
    fn repetitions_and_loops_are_bounded() {
        refused("{{ 'x' * 1000000000 }}", "too large");
        refused("{{ 'x' * 1099511627776 }}", "too large");
        refused(
            "{% for i in range(1000000000) %}{% endfor %}",
            "too many elements",
        );
        refused(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "fuel",
        );
    }

    /// A request's text is data: Jinja written in a message is not run.
    #[test]
    fn message_text_is_never_template_code() {
        let t = ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}", "", "")
            .unwrap();
        let text = "{{ 'x' * 1000000000 }}{% for i in range(1000000000) %}{% endfor %}";
        let out = t.render(&[ChatMessage::new("user", text)], false).unwrap();
        assert_eq!(out, text);
    }

    /// The longest conversation the API takes (1024 messages, 128 tools) renders through a
    /// Llama 3.1-style template well within the fuel.
    #[test]
    fn the_longest_conversation_renders_within_the_fuel() {
        let src = "{{- bos_token }}\
            {%- if messages[0].role == 'system' %}{%- set system = messages[0].content|trim %}\
            {%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}\
            {{- '<|start_header_id|>system<|end_header_id|>\n\n' }}\
            {%- if tools is defined %}{%- for t in tools %}{{- t|tojson(indent=4) }}\
            {{- '\n\n' }}{%- endfor %}{%- endif %}{{- system }}{{- '<|eot_id|>' }}\
            {%- for message in messages %}\
            {%- if not (message.role == 'ipython' or message.role == 'tool') %}\
            {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' \
                + message.content|trim + '<|eot_id|>' }}\
            {%- else %}{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' \
                + message.content + '<|eot_id|>' }}{%- endif %}{%- endfor %}\
            {%- if add_generation_prompt %}\
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}\
            {{- fuel_used() }}";
        let mut t = ChatTemplate::new(src, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        t.env.add_function("fuel_used", |state: &State| {
            state.fuel_levels().map_or(0, |(used, _)| used)
        });
        let roles = ["user", "assistant", "tool"];
        let messages: Vec<ChatMessage> = std::iter::once(ChatMessage::new("system", "Be brief."))
            .chain((1..1024).map(|i| ChatMessage::new(roles[i % 3], "Some words of text.")))
            .collect();
        let tools: Vec<serde_json::Value> = (0..128)
            .map(|i| {
                serde_json::json!({"type": "function", "function": {"name": format!("f{i}"),
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}})
            })
            .collect();
        let extra = serde_json::json!({ "tools": tools });
        let out = t
            .render_ending(
                &messages,
                ChatEnding::GenerationPrompt,
                extra.as_object().unwrap(),
            )
            .unwrap();
        let used: u64 = out
            .rsplit("\n\n")
            .next()
            .and_then(|n| n.parse().ok())
            .expect("the fuel used");
        assert!(used * 100 < RENDER_FUEL, "{used} of {RENDER_FUEL}");
    }

    /// The caller's bound stops a rendering as it passes it, with an error of its own; the
    /// rendering at the bound passes.
    #[test]
    fn a_rendering_stops_at_the_callers_bound() {
        let t = ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}", "", "")
            .unwrap();
        let none = serde_json::Map::new();
        let messages = vec![ChatMessage::new("user", "x".repeat(600)); 2];
        let e = t
            .render_within(&messages, ChatEnding::Closed, &none, 1000)
            .unwrap_err();
        assert!(
            matches!(e, GpuError::ChatTemplateTooLong { limit: 1000 }),
            "{e}"
        );
        let out = t
            .render_within(&messages, ChatEnding::Closed, &none, 1200)
            .unwrap();
        assert_eq!(out.len(), 1200);
    }

    /// A panic inside a rendering is that rendering's error; the template renders again.
    #[test]
    fn a_panic_while_rendering_is_an_error() {
        let mut t = ChatTemplate::new("{{ messages[0].content }}{{ boom() }}", "", "").unwrap();
        t.env.add_function("boom", || -> String { panic!("boom") });
        let m = [ChatMessage::new("user", "hi")];
        let e = t.render(&m, false).unwrap_err();
        assert!(e.to_string().contains("boom"), "{e}");
        let e = t.render(&m, false).unwrap_err();
        assert!(e.to_string().contains("boom"), "{e}");
    }

    /// `tojson` writes no more than the rendering's bound, without collecting a long list
    /// first (a list of 2^40 items would not fit in memory).
    #[test]
    fn tojson_of_a_huge_list_stops_at_the_bound() {
        let t = ChatTemplate::new("{{ ([1] * 1099511627776)|tojson }}", "", "").unwrap();
        let none = serde_json::Map::new();
        let e = t
            .render_within(&[], ChatEnding::Closed, &none, 1000)
            .unwrap_err();
        assert!(e.to_string().contains("1000 bytes"), "{e}");
    }
}
