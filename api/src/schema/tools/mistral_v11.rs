//! Mistral's tool-call format from its v11 tokenizers on (Mistral Small 3.2, Magistral,
//! Devstral, Ministral 3), as their chat templates write it: the pieces
//! [`ToolFormat::MistralV11`](super::ToolFormat) needs beyond what it shares with the other
//! formats (text, then calls after a marker).
//!
//! - The tools: `[AVAILABLE_TOOLS][{"type": "function", "function": {...}}, ...][/AVAILABLE_TOOLS]`
//!   (the templates write `tools|tojson` between the markers, with no space). The templates
//!   place the block themselves (`model.tool_prompt: template`, the default for them); when the
//!   server writes it (`server`), it heads the first user message.
//! - The calls: `[TOOL_CALLS]name[ARGS]{...}`, the marker again before each further call, after
//!   any text. Some of these templates (v11's, not v13's) also write a call's id,
//!   `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`: for those the grammar has the model write one
//!   (9 letters and digits), as the template writes its calls ([`writes_call_ids`]), and the
//!   reader passes over it (a call gets the server's id, as in every format).
//! - The results: `[TOOL_RESULTS]...[/TOOL_RESULTS]`, the result's text as it is (v13's form;
//!   v11's templates, which write ids, write `[TOOL_RESULTS]id[TOOL_CONTENT]...` themselves).
//!
//! `[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` are special tokens of these tokenizers. Where they
//! are, the server tells the grammar their ids ([`MarkerTokens`](super::MarkerTokens)): the
//! grammar writes those tokens (llguidance's `<[id]>`, which text cannot spell), as the model was
//! trained to, and the answer's text keeps those three special tokens (and no other) so that the
//! reader finds them. Where the tokenizer has no such token, the marker is text.

use super::{literal, skip_ws, Header, MarkerTokens, TOOL_CALLS};
use super::{MAX_HEADER, MAX_HELD_SPACE};

/// Comes between a call's name (or id) and its arguments.
pub const ARGS: &str = "[ARGS]";
/// Comes between a call's name and its id, where a template writes ids.
pub const CALL_ID: &str = "[CALL_ID]";
/// Opens the tools' block, and its list.
pub(super) const TOOLS_OPEN: &str = "[AVAILABLE_TOOLS][";
/// Closes the tools' list, and the block.
pub(super) const TOOLS_CLOSE: &str = "][/AVAILABLE_TOOLS]";
/// The length of the id a model may write after `[CALL_ID]` (Mistral's ids).
const ID_LEN: usize = super::mistral::CALL_ID_LEN;

/// Whether a chat template is of this format: it writes calls with `[TOOL_CALLS]` and `[ARGS]`.
pub(super) fn is_template(source: &str) -> bool {
    source.contains(TOOL_CALLS) && source.contains(ARGS)
}

/// Whether a chat template of this format writes each call's id (`[CALL_ID]`), as Mistral Small
/// 3.1's does: then its model writes ids too ([`ToolSetup::call_ids`](super::ToolSetup)).
pub fn writes_call_ids(source: &str) -> bool {
    is_template(source) && source.contains(CALL_ID)
}

/// Whether `c` may be part of a function's name as the reader takes it: the names a request
/// may give (`[A-Za-z0-9_-]`) and `.`.
fn name_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.')
}

/// Reads a call's opening in `body`, the text after its `[TOOL_CALLS]`: the name, an optional
/// `[CALL_ID]` and id, `[ARGS]`, and the arguments' opening brace.
pub(super) fn header(body: &str) -> Header {
    let b = &body.as_bytes()[..body.len().min(MAX_HEADER)];
    let read = || -> Result<(String, usize), bool> {
        let name_end = b.iter().position(|&c| !name_byte(c)).ok_or(true)?;
        if name_end == 0 {
            return Err(false);
        }
        let mut i = name_end;
        match literal(b, i, CALL_ID.as_bytes()) {
            Ok(id) => {
                let len = b[id..]
                    .iter()
                    .position(|c| !c.is_ascii_alphanumeric())
                    .ok_or(true)?;
                if len == 0 {
                    return Err(false);
                }
                i = id + len;
            }
            Err(true) => return Err(true),
            Err(false) => {}
        }
        i = literal(b, i, ARGS.as_bytes())?;
        let arguments = skip_ws(b, i);
        if arguments - i > MAX_HELD_SPACE {
            return Err(false);
        }
        literal(b, arguments, b"{")?;
        // ASCII bytes: `..name_end` cuts on a character boundary.
        Ok((body[..name_end].to_owned(), arguments))
    };
    match read() {
        Ok((name, arguments)) => Header::Done { name, arguments },
        Err(true) if body.len() <= MAX_HEADER => Header::More,
        Err(_) => Header::Other,
    }
}

/// A marker in the grammar: its special token where the tokenizer has one (llguidance's
/// `<[id]>`), else its text.
fn marker(token: Option<u32>, text: &str) -> String {
    match token {
        Some(id) => format!("<[{id}]>"),
        None => format!("\"{text}\""),
    }
}

/// The grammar's rules around the tools' bodies (`body`, each `"name" args %json{...}`): with
/// `auto`, text without `[TOOL_CALLS]`, or any text up to the marker and calls; calls only
/// (`calls_only`) from the first token. `repeat`: more than one call may come. `call_ids`: each
/// call's name is followed by `[CALL_ID]` and an id before its `[ARGS]`.
pub(super) fn grammar_rules(
    calls_only: bool,
    repeat: bool,
    tokens: MarkerTokens,
    call_ids: bool,
) -> String {
    const TEXT: &str = "TEXT: /(?s:.+)/ & ~/(?s:.*\\[TOOL_CALLS\\].*)/\n";
    let more = if repeat { " call*" } else { "" };
    let start = match (tokens.calls, calls_only) {
        (_, true) => format!("start: call{more}\n"),
        (Some(_), false) => format!("start: TEXT | TEXT? call{more}\n{TEXT}"),
        (None, false) => format!(
            "start: TEXT | pre body{more}\n\
             pre[suffix=\"{TOOL_CALLS}\"]: /(?s:.*)/\n{TEXT}"
        ),
    };
    let open = marker(tokens.calls, TOOL_CALLS);
    let args = marker(tokens.args, ARGS);
    if call_ids {
        format!(
            "{start}call: {open} body\nargs: {call_id} /[A-Za-z0-9]{{{ID_LEN}}}/ {args}\n",
            call_id = marker(tokens.call_id, CALL_ID),
        )
    } else {
        format!("{start}call: {open} body\nargs: {args}\n")
    }
}

/// A call as these templates write it: `[TOOL_CALLS]name[ARGS]` and the arguments.
pub(super) fn render_call(name: &str, arguments: &str) -> String {
    format!("{TOOL_CALLS}{name}{ARGS}{arguments}")
}

/// Opens a tool's result as these templates write it, its text as it is after it.
pub(super) const RESULTS_OPEN: &str = "[TOOL_RESULTS]";
/// Closes a tool's result.
pub(super) const RESULTS_CLOSE: &str = "[/TOOL_RESULTS]";

#[cfg(test)]
mod tests {
    use super::super::reading_tests::{call, check, check_cases};
    use super::super::*;
    use serde_json::json;

    #[test]
    fn calls_read_as_vllm_reads_v11_output_however_the_text_is_cut() {
        // vLLM's tests of its `mistral` reader with a v11 tokenizer (Mistral Small 3.2), with
        // the `[ARGS]` token its decoding leaves out put back, and what they read; then
        // Switchyard's own cases, read as in its other formats (vLLM keeps the space before the
        // marker in the content and drops text after the calls, which the grammar rules out).
        let weather = "{\"city\": \"San Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}";
        let cases: Vec<(&str, &str, Vec<ParsedCall>)> = vec![
            ("This is a test", "This is a test", vec![]),
            (
                "[TOOL_CALLS]add_this_and_that[ARGS]{\"a\": 3.5, \"b\": 4}",
                "",
                vec![call("add_this_and_that", "{\"a\": 3.5, \"b\": 4}")],
            ),
            (
                "[TOOL_CALLS]get_current_weather[ARGS]{\"city\": \"San Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}",
                "",
                vec![call("get_current_weather", weather)],
            ),
            (
                "[TOOL_CALLS]add[ARGS]{\"a\": 3.5, \"b\": 4}[TOOL_CALLS]multiply[ARGS]{\"a\": 3, \"b\": 6}",
                "",
                vec![
                    call("add", "{\"a\": 3.5, \"b\": 4}"),
                    call("multiply", "{\"a\": 3, \"b\": 6}"),
                ],
            ),
            (
                "[TOOL_CALLS]bash[ARGS]{\"command\": \"print(\\\"hello world!\\\")\\nre.compile(r'{}')\"}",
                "",
                vec![call(
                    "bash",
                    "{\"command\": \"print(\\\"hello world!\\\")\\nre.compile(r'{}')\"}",
                )],
            ),
            // Text before the calls is content (its trailing space trimmed); a call's id (the
            // templates that write ids) is passed over.
            (
                "Let me check. [TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{\"city\": \"Paris\"}",
                "Let me check.",
                vec![call("get_weather", "{\"city\": \"Paris\"}")],
            ),
            // Characters of several bytes wherever a cut may land, and markers inside strings.
            (
                "¡Olé! ✓[TOOL_CALLS]f[ARGS]{\"s\": \"}[TOOL_CALLS]g[ARGS]{✓\"}",
                "¡Olé! ✓",
                vec![call("f", "{\"s\": \"}[TOOL_CALLS]g[ARGS]{✓\"}")],
            ),
            // What follows the calls and is no call is content, after them.
            (
                "[TOOL_CALLS]now[ARGS]{}\nextra trailing data",
                "\nextra trailing data",
                vec![call("now", "{}")],
            ),
        ];
        check_cases(ToolFormat::MistralV11, cases);
    }

    #[test]
    fn malformed_calls_are_text_as_in_the_other_formats() {
        let now = || call("now", "{}");
        // (text, content, calls)
        let cases: Vec<(&str, &str, Vec<ParsedCall>)> = vec![
            // Not a call after the marker: all of it is text.
            (
                "[TOOL_CALLS] now[ARGS]{}",
                "[TOOL_CALLS] now[ARGS]{}",
                vec![],
            ),
            ("[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS][ARGS]{}", vec![]),
            ("[TOOL_CALLS]now{}", "[TOOL_CALLS]now{}", vec![]),
            ("[TOOL_CALLS]now[ARGS]3", "[TOOL_CALLS]now[ARGS]3", vec![]),
            (
                "[TOOL_CALLS]now[CALL_ID][ARGS]{}",
                "[TOOL_CALLS]now[CALL_ID][ARGS]{}",
                vec![],
            ),
            ("[TOOL_CALL]now", "[TOOL_CALL]now", vec![]),
            ("a [TOOL", "a [TOOL", vec![]),
            // Cut short (max_tokens) before the first call's arguments: text.
            ("[TOOL_CALLS]now[AR", "[TOOL_CALLS]now[AR", vec![]),
            ("[TOOL_CALLS]", "[TOOL_CALLS]", vec![]),
            // After a call: text that is not a call is content, the call stands.
            ("[TOOL_CALLS]now[ARGS]{} and so", " and so", vec![now()]),
            (
                "[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS] x",
                "[TOOL_CALLS] x",
                vec![now()],
            ),
            // Cut short in a later call, before its arguments: dropped after a call.
            ("[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]no", "", vec![now()]),
            // Cut short in its arguments: a call, with what was written.
            (
                "[TOOL_CALLS]f[ARGS]{\"a\": [\"b}",
                "",
                vec![call("f", "{\"a\": [\"b}")],
            ),
        ];
        check_cases(ToolFormat::MistralV11, cases);
        // Calls only: an opening cut short is no content.
        for text in ["[TOOL_CA", "[TOOL_CALLS]", "[TOOL_CALLS]now[ARG"] {
            check(ToolFormat::MistralV11, true, text, &(String::new(), vec![]));
        }
        // A name longer than a call's opening may be is text.
        let long = format!("[TOOL_CALLS]{}[ARGS]{{}}", "n".repeat(MAX_HEADER));
        check(
            ToolFormat::MistralV11,
            false,
            &long,
            &(long.clone(), vec![]),
        );
    }

    #[test]
    fn arguments_stream_as_they_are_written() {
        let mut s = ToolStream::new(ToolFormat::MistralV11);
        assert_eq!(s.push("Sure. [TOOL_"), [ToolPiece::Text("Sure.".into())]);
        assert_eq!(s.push("CALLS]now[AR"), []);
        assert_eq!(
            s.push("GS]{\"a\": [1"),
            [
                ToolPiece::Call {
                    index: 0,
                    name: "now".into()
                },
                ToolPiece::Arguments {
                    index: 0,
                    text: "{\"a\": [1".into()
                }
            ]
        );
        assert_eq!(
            s.push("]}[TOOL_CALLS]f[ARGS]{}"),
            [
                ToolPiece::Arguments {
                    index: 0,
                    text: "]}".into()
                },
                ToolPiece::Call {
                    index: 1,
                    name: "f".into()
                },
                ToolPiece::Arguments {
                    index: 1,
                    text: "{}".into()
                }
            ]
        );
        assert_eq!(s.finish(), []);
        assert!(!s.cut_short());
    }

    #[test]
    fn the_format_is_chosen_for_v11_templates_and_writes_what_they_write() {
        // The lines that write calls in Ministral 3's template and in a v11 template that
        // writes ids; the v3 template's.
        let v11 = "{{- '[AVAILABLE_TOOLS]' + (tools| tojson) + '[/AVAILABLE_TOOLS]' }}{{- '[TOOL_CALLS]' + tool['function']['name'] + '[ARGS]' + arguments }}";
        let v11_ids = "{{- '[TOOL_CALLS]' + tool_call.function.name }}{{- '[CALL_ID]' + tool_call.id }}{{- '[ARGS]' + tool_call['function']['arguments']|tojson }}";
        let v3 = "{%- set available_tools = '[AVAILABLE_TOOLS] ' + (tools| tojson) + '[/AVAILABLE_TOOLS]' %}{{- '[TOOL_CALLS] [' }}";
        assert_eq!(ToolFormat::for_template(v11), ToolFormat::MistralV11);
        assert_eq!(ToolFormat::for_template(v11_ids), ToolFormat::MistralV11);
        assert!(writes_call_ids(v11_ids) && !writes_call_ids(v11) && !writes_call_ids(v3));
        assert_eq!(ToolFormat::for_template(v3), ToolFormat::Mistral);
        assert_eq!(ToolFormat::MistralV11.name(), "mistral_v11");

        let tools = json!([{"type": "function", "function": {"name": "now"}},
                           {"type": "function", "function": {"name": "f"}}]);
        let t = ToolUse::parse(Some(&tools), None, None, ToolFormat::MistralV11)
            .unwrap()
            .unwrap();
        assert_eq!(
            t.prompt(),
            Some(ToolPrompt::FirstUser(
                "[AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"now\", \
                 \"parameters\": {\"type\": \"object\", \"properties\": {}, \
                 \"additionalProperties\": false}}}, {\"type\": \"function\", \"function\": \
                 {\"name\": \"f\", \"parameters\": {\"type\": \"object\", \"properties\": {}, \
                 \"additionalProperties\": false}}}][/AVAILABLE_TOOLS]"
                    .into()
            ))
        );
        let calls = json!([
            {"id": "call_0123456789abcdef", "function": {"name": "a", "arguments": "{\"x\":1}"}},
            {"function": {"name": "b", "arguments": {"y": [2]}}},
        ]);
        assert_eq!(
            render_calls("m", calls.as_array().unwrap(), ToolFormat::MistralV11).unwrap(),
            "[TOOL_CALLS]a[ARGS]{\"x\": 1}[TOOL_CALLS]b[ARGS]{\"y\": [2]}"
        );
        assert_eq!(
            render_result(ToolFormat::MistralV11, "22 \"C\"", Some("123456789")),
            "[TOOL_RESULTS]22 \"C\"[/TOOL_RESULTS]"
        );
        // Ids in a conversation become Mistral's (the templates that write them take 9).
        assert_eq!(
            template_call_id("call_0123456789abcdef", ToolFormat::MistralV11),
            "789abcdef"
        );
        assert_eq!(
            new_call_id(ToolFormat::MistralV11, || unreachable!()).len(),
            9
        );
    }

    #[test]
    fn the_grammar_writes_the_markers_before_each_call() {
        let tools = json!([{"type": "function", "function": {"name": "now"}},
                           {"type": "function", "function": {"name": "f"}}]);
        let grammar = |choice: Value, parallel: bool, tokens: MarkerTokens| {
            let setup = ToolSetup {
                format: ToolFormat::MistralV11,
                template: true,
                markers: tokens,
                call_ids: tokens.call_id.is_some(),
            };
            ToolUse::parse(Some(&tools), Some(&choice), Some(parallel), setup)
                .unwrap()
                .unwrap()
                .grammar()
                .unwrap()
                .to_owned()
        };
        let text = MarkerTokens::default();
        let auto = grammar(json!("auto"), true, text);
        assert!(
            auto.starts_with(
                "start: TEXT | pre body call*\npre[suffix=\"[TOOL_CALLS]\"]: /(?s:.*)/\n\
                 TEXT: /(?s:.+)/ & ~/(?s:.*\\[TOOL_CALLS\\].*)/\n\
                 call: \"[TOOL_CALLS]\" body\nargs: \"[ARGS]\"\nbody: body_0 | body_1\n"
            ),
            "{auto}"
        );
        assert!(auto.contains("body_1: \"f\" args %json{"), "{auto}");
        let one = grammar(json!("required"), false, text);
        assert!(one.starts_with("start: call\ncall: "), "{one}");
        let tokens = MarkerTokens {
            calls: Some(7),
            args: Some(8),
            call_id: Some(9),
        };
        let special = grammar(json!("auto"), true, tokens);
        assert!(
            special.starts_with(
                "start: TEXT | TEXT? call call*\n\
                 TEXT: /(?s:.+)/ & ~/(?s:.*\\[TOOL_CALLS\\].*)/\n\
                 call: <[7]> body\nargs: <[9]> /[A-Za-z0-9]{9}/ <[8]>\nbody: body_0 | body_1\n"
            ),
            "{special}"
        );
        let named = grammar(
            json!({"type": "function", "function": {"name": "f"}}),
            true,
            tokens,
        );
        assert!(
            named.starts_with("start: call\ncall: <[7]> body\n"),
            "{named}"
        );
        assert!(!named.contains("\"now\""), "{named}");
    }

    #[test]
    fn a_call_opening_is_read_within_bounds() {
        let done = |body: &str| match super::header(body) {
            Header::Done { name, arguments } => Some((name, arguments)),
            _ => None,
        };
        assert_eq!(done("now[ARGS]{}"), Some(("now".into(), 9)));
        assert_eq!(
            done("a.b-c_1[CALL_ID]x9[ARGS] {"),
            Some(("a.b-c_1".into(), 25))
        );
        assert!(matches!(super::header("now[ARGS]"), Header::More));
        assert!(matches!(super::header("now[CALL_"), Header::More));
        assert!(matches!(super::header("now"), Header::More));
        assert!(matches!(super::header("now [ARGS]{"), Header::Other));
        assert!(matches!(super::header("[ARGS]{"), Header::Other));
        assert!(matches!(super::header("now[ARGS]x"), Header::Other));
        let spaced = format!("now[ARGS]{}{{", " ".repeat(MAX_HELD_SPACE + 1));
        assert!(matches!(super::header(&spaced), Header::Other));
        let long = "n".repeat(MAX_HEADER + 1);
        assert!(matches!(super::header(&long), Header::Other));
    }
}
