//! Mistral's tool-call format, that of Mistral 7B Instruct v0.3 and the other models of
//! Mistral's v3 tokenizer, as Mistral's own renderer (mistral-common's v3 instruct tokenizer)
//! and chat templates write it: the pieces [`ToolFormat::Mistral`](super::ToolFormat) needs
//! beyond what it shares with the Hermes format (text, then calls after a marker).
//!
//! - The tools: `[AVAILABLE_TOOLS] [{"type": "function", "function": {...}}, ...][/AVAILABLE_TOOLS]`.
//!   Mistral's templates read `tools` and write the block before the last user turn's `[INST]`
//!   themselves (`model.tool_prompt: template`, the default for them); when the server writes
//!   it (`server`), it heads the first user message, inside its `[INST]`.
//! - The calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, one list, after any
//!   text (vLLM's `mistral` reader takes the text before the marker as content). The reader also
//!   takes calls whose keys come in another order or that carry more keys (an `"id"`).
//! - The conversation: a call carries its id, 9 letters and digits, after its arguments
//!   (`{"name": ..., "arguments": {...}, "id": "..."}`), and a result names the call it answers,
//!   `[TOOL_RESULTS] {"content": ..., "call_id": "..."}[/TOOL_RESULTS]`. Mistral's templates
//!   refuse other ids: the calls the model writes get Mistral's ids ([`new_call_id`]), and an
//!   OpenAI id in a conversation becomes one of Mistral's by [`call_id`], the same for a call
//!   and its result, whoever writes them.
//!
//! Mistral's tokenizers from v11 on (Mistral Small 3.2, Magistral, Devstral) call as
//! `[TOOL_CALLS]name[ARGS]{...}`: that is [`ToolFormat::MistralV11`](super::ToolFormat)'s
//! (`mistral_v11.rs`).
//!
//! `[TOOL_CALLS]` is a special token of Mistral's tokenizers. Where it is one, the server tells
//! the grammar its id (`ToolSetup::markers`): the grammar writes that token (llguidance's
//! `<[id]>`, which text cannot spell), as the model was trained to, and such a request's text
//! keeps that one special token (vLLM keeps them all for its Mistral reader, end of sequence
//! included), so the reader finds the marker in the text as it finds `<tool_call>`. Where the tokenizer has no such token, the
//! marker is text.

use serde_json::{Map, Value};

use super::{json_dumps, literal, scan_string, scan_value, skip_ws, Scan};
use super::{MAX_HEADER, MAX_HELD_SPACE};

/// Opens the calls (a special token of Mistral's tokenizers).
pub const TOOL_CALLS: &str = "[TOOL_CALLS]";
/// Opens the tools' block, and its list.
pub(super) const TOOLS_OPEN: &str = "[AVAILABLE_TOOLS] [";
/// Closes the tools' list, and the block.
pub(super) const TOOLS_CLOSE: &str = "][/AVAILABLE_TOOLS]";
/// Length of a Mistral call id (letters and digits).
pub const CALL_ID_LEN: usize = 9;

/// Whether a chat template is Mistral's: it writes calls and tools with Mistral's markers.
pub(super) fn is_template(source: &str) -> bool {
    source.contains(TOOL_CALLS) && source.contains("[AVAILABLE_TOOLS]")
}

/// A call id as Mistral's templates require it (9 ASCII letters and digits): one that is kept;
/// a longer one whose last 9 bytes are letters and digits is cut to them (vLLM's rule for
/// Mistral models: OpenAI's `call_…` ids keep their end); any other becomes 9 characters drawn
/// from its FNV-1a hash. A call and the result that names it get the same id.
pub fn call_id(id: &str) -> String {
    let b = id.as_bytes();
    if b.len() >= CALL_ID_LEN
        && b[b.len() - CALL_ID_LEN..]
            .iter()
            .all(u8::is_ascii_alphanumeric)
    {
        // ASCII bytes: a character boundary.
        return id[id.len() - CALL_ID_LEN..].to_owned();
    }
    const DIGITS: &[u8; 62] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in b {
        h ^= u64::from(c);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (0..CALL_ID_LEN)
        .map(|_| {
            let d = DIGITS[(h % 62) as usize] as char;
            h /= 62;
            d
        })
        .collect()
}

/// A new id for a call the model wrote: 9 random letters and digits, as Mistral's templates
/// require when the call comes back in a conversation.
pub fn new_call_id() -> String {
    const DIGITS: &[u8; 62] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut bytes = [0u8; CALL_ID_LEN];
    if getrandom::fill(&mut bytes).is_err() {
        // Without OS randomness: unique within the process, merely guessable.
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return call_id(&format!("fallback-{n}"));
    }
    // 62 * 4 = 248 of 256 byte values map evenly; the slight bias of the rest is harmless
    // for an id.
    bytes
        .iter()
        .map(|&b| char::from(DIGITS[usize::from(b) % 62]))
        .collect()
}

/// Opens a tool's result (a special token of Mistral's tokenizers).
pub(super) const RESULTS_OPEN: &str = "[TOOL_RESULTS] ";
/// Closes a tool's result.
pub(super) const RESULTS_CLOSE: &str = "[/TOOL_RESULTS]";

/// A tool's result as Mistral's models read it (mistral-common's v3 rendering) between
/// [`RESULTS_OPEN`] and [`RESULTS_CLOSE`]: its content as JSON when it parses, else as a JSON
/// string, and the id of the call it answers.
pub(super) fn result_json(content: &str, tool_call_id: Option<&str>) -> String {
    let content = serde_json::from_str::<Value>(content)
        .unwrap_or_else(|_| Value::String(content.to_owned()));
    let mut result = Map::new();
    result.insert("content".into(), content);
    if let Some(id) = tool_call_id {
        result.insert("call_id".into(), Value::String(call_id(id)));
    }
    json_dumps(&Value::Object(result))
}

/// The grammar's start: text without `[TOOL_CALLS]`, or any text up to the marker and the
/// list of calls (`auto`); or the marker and the list from the first token (`calls_only`).
/// The marker is the special token `marker` where the tokenizer has one (llguidance's
/// `<[id]>`, which text cannot spell), else text.
pub(super) fn grammar_start(calls_only: bool, marker: Option<u32>) -> String {
    const TEXT: &str = "TEXT: /(?s:.+)/ & ~/(?s:.*\\[TOOL_CALLS\\].*)/\n";
    match (marker, calls_only) {
        (Some(id), true) => format!("start: <[{id}]> list\n"),
        (Some(id), false) => format!("start: TEXT | TEXT? <[{id}]> list\n{TEXT}"),
        (None, true) => format!("start: \"{TOOL_CALLS}\" list\n"),
        (None, false) => format!(
            "start: TEXT | pre list\n\
             pre[suffix=\"{TOOL_CALLS}\"]: /(?s:.*)/\n{TEXT}"
        ),
    }
}

/// Reads the list's opening at `b[i..]`: `[TOOL_CALLS]`, whitespace, `[`. `Ok`: the offset past
/// the `[`; `Err(true)`: `b` ends inside it; `Err(false)`: it is not there.
pub(super) fn list_open(b: &[u8], i: usize) -> Result<usize, bool> {
    let after = literal(b, i, TOOL_CALLS.as_bytes())?;
    let at = skip_ws(b, after);
    if at - after > MAX_HELD_SPACE {
        return Err(false);
    }
    literal(b, at, b"[")
}

/// What follows a call's arguments in the list.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum After {
    /// The call, and what separates it from the next, end at this offset: `true` after a `,`
    /// (another call follows), `false` after the list's `]`.
    Next(usize, bool),
    /// The text ends before it tells.
    More,
    /// Something else: the call ends at this offset (past its brace, if it closed), the rest
    /// is text.
    Other(usize),
}

/// Reads what follows a call's arguments, `b` starting just past them: any more members (such
/// as an `"id"`), the call's `}`, then `,` or `]`. Whitespace runs longer than
/// [`MAX_HELD_SPACE`], and more members longer than [`MAX_HEADER`], are not a call's end.
pub(super) fn after_arguments(b: &[u8]) -> After {
    let mut i = skip_ws(b, 0);
    if i > MAX_HELD_SPACE {
        return After::Other(0);
    }
    while b.get(i) == Some(&b',') {
        let key = skip_ws(b, i + 1);
        let member = match b.get(key) {
            None => Scan::More,
            Some(b'"') => match scan_string(b, key) {
                Scan::Done(end) => {
                    let colon = skip_ws(b, end);
                    match b.get(colon) {
                        None => Scan::More,
                        Some(b':') => scan_value(b, skip_ws(b, colon + 1), 1),
                        Some(_) => Scan::Bad,
                    }
                }
                other => other,
            },
            Some(_) => Scan::Bad,
        };
        match member {
            Scan::Done(end) if end <= MAX_HEADER => i = skip_ws(b, end),
            Scan::More if b.len() <= MAX_HEADER => return After::More,
            _ => return After::Other(0),
        }
    }
    match b.get(i) {
        None => return After::More,
        Some(b'}') => {}
        Some(_) => return After::Other(0),
    }
    let end = i + 1;
    let next = skip_ws(b, end);
    if next - end > MAX_HELD_SPACE {
        return After::Other(end);
    }
    match b.get(next) {
        None => After::More,
        Some(b',') => After::Next(next + 1, true),
        Some(b']') => After::Next(next + 1, false),
        Some(_) => After::Other(end),
    }
}

#[cfg(test)]
mod tests {
    use super::super::reading_tests::{call, check, check_cases};
    use super::super::*;
    use super::*;
    use serde_json::json;

    fn weather_tool() -> Value {
        // mistral-common's test tool (its expected renderings are the golden values below).
        json!({"type": "function", "function": {
            "name": "get_current_weather",
            "description": "Get the current weather",
            "parameters": {"type": "object", "properties": {
                "location": {"type": "string",
                             "description": "The city and state, e.g. San Francisco, CA"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"],
                           "description": "The temperature unit to use. Infer this from the users location."}},
                "required": ["location", "format"]}}})
    }

    #[test]
    fn calls_read_as_vllm_reads_mistral_output_however_the_text_is_cut() {
        // Model outputs and their readings from vLLM's tests of its `mistral` reader (pre-v11
        // tokenizer): names and arguments as written, the text before the marker as content.
        let weather = "{\"city\": \"San Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}";
        let cases: Vec<(&str, &str, Vec<ParsedCall>)> = vec![
            ("This is a test", "This is a test", vec![]),
            (
                "[TOOL_CALLS][{\"name\": \"add\", \"arguments\":{\"a\": 3.5, \"b\": 4}}]",
                "",
                vec![call("add", "{\"a\": 3.5, \"b\": 4}")],
            ),
            (
                "[TOOL_CALLS] [{\"name\": \"get_current_weather\", \"arguments\":{\"city\": \"San Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}}]",
                "",
                vec![call("get_current_weather", weather)],
            ),
            // Arguments before the name (read whole), and a name among the arguments.
            (
                "[TOOL_CALLS] [{\"arguments\":{\"city\": \"San Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}, \"name\": \"get_current_weather\"}]",
                "",
                vec![call("get_current_weather", weather)],
            ),
            (
                "[TOOL_CALLS] [{\"arguments\":{\"name\": \"John Doe\"}, \"name\": \"get_age\"}]",
                "",
                vec![call("get_age", "{\"name\": \"John Doe\"}")],
            ),
            (
                "[TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": 3.5, \"b\": 4}}, {\"name\": \"get_current_weather\", \"arguments\":{\"city\": \"San Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}}]",
                "",
                vec![
                    call("add", "{\"a\": 3.5, \"b\": 4}"),
                    call("get_current_weather", weather),
                ],
            ),
            (
                "Hello[TOOL_CALLS] [{\"name\": \"add\", \"arguments\":{\"a\": 1, \"b\": 2}}]",
                "Hello",
                vec![call("add", "{\"a\": 1, \"b\": 2}")],
            ),
            // vLLM's streamed reading: what follows the list is content.
            (
                "[TOOL_CALLS] [{\"name\": \"get_current_weather\", \"arguments\":{\"city\": \"Dallas\", \"state\": \"TX\", \"unit\": \"fahrenheit\"}}]\nextra trailing data",
                "\nextra trailing data",
                vec![call(
                    "get_current_weather",
                    "{\"city\": \"Dallas\", \"state\": \"TX\", \"unit\": \"fahrenheit\"}",
                )],
            ),
            (
                "[TOOL_CALLS]  [ {\"name\":\"add\" , \"arguments\" : {\"a\": 3, \"b\": 4} } ]",
                "",
                vec![call("add", "{\"a\": 3, \"b\": 4}")],
            ),
            // A call with its id after the arguments, as mistral-common writes calls in the
            // conversation, streamed or read whole.
            (
                "[TOOL_CALLS] [{\"name\": \"get_current_weather\", \"arguments\": {\"location\": \"Paris, France\", \"format\": \"celsius\"}, \"id\": \"123456789\"}]",
                "",
                vec![call(
                    "get_current_weather",
                    "{\"location\": \"Paris, France\", \"format\": \"celsius\"}",
                )],
            ),
            (
                "[TOOL_CALLS] [{\"id\": \"123456789\", \"name\": \"now\", \"arguments\": {}}, {\"name\": \"now\", \"arguments\": {}}]",
                "",
                vec![call("now", "{}"), call("now", "{}")],
            ),
            // Characters of several bytes wherever a cut may land.
            (
                "¡Olé! ✓ [TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"s\": \"]}, [TOOL_CALLS] ✓\"}}]",
                "¡Olé! ✓",
                vec![call("f", "{\"s\": \"]}, [TOOL_CALLS] ✓\"}")],
            ),
            // Two lists (vLLM refuses a second marker): both read.
            (
                "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}] [TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}}]",
                "",
                vec![call("now", "{}"), call("f", "{}")],
            ),
        ];
        check_cases(ToolFormat::Mistral, cases);
    }

    #[test]
    fn malformed_calls_are_text_as_in_the_other_formats() {
        let now = || call("now", "{}");
        // (text, content, calls)
        let cases: Vec<(&str, &str, Vec<ParsedCall>)> = vec![
            // Not a list of calls after the marker: all of it is text (vLLM drops the marker).
            (
                "[TOOL_CALLS] not json at all",
                "[TOOL_CALLS] not json at all",
                vec![],
            ),
            ("[TOOL_CALLS] []", "[TOOL_CALLS] []", vec![]),
            (
                "[TOOL_CALLS] {\"name\": \"now\", \"arguments\": {}}",
                "[TOOL_CALLS] {\"name\": \"now\", \"arguments\": {}}",
                vec![],
            ),
            (
                "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": 3}]",
                "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": 3}]",
                vec![],
            ),
            ("[TOOL_CALL] [", "[TOOL_CALL] [", vec![]),
            ("a [TOOL", "a [TOOL", vec![]),
            // Cut short (max_tokens) before the first call's arguments: text.
            (
                "[TOOL_CALLS] [{\"name\": \"now\", \"argu",
                "[TOOL_CALLS] [{\"name\": \"now\", \"argu",
                vec![],
            ),
            ("[TOOL_CALLS] [", "[TOOL_CALLS] [", vec![]),
            // After a call: anything but `,` or `]` is text, the call stands.
            (
                "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}} and so",
                " and so",
                vec![now()],
            ),
            (
                "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}, 3}]",
                ", 3}]",
                vec![now()],
            ),
            (
                "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}, x]",
                " x]",
                vec![now()],
            ),
            // Cut short in a later call, before its arguments: dropped after a call.
            (
                "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}, {\"na",
                "",
                vec![now()],
            ),
            // The list's end (or the call's brace and the end) taken by a stop string.
            (
                "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}",
                "",
                vec![now()],
            ),
            (
                "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}",
                "",
                vec![now()],
            ),
            // Cut short in its arguments: a call, with what was written.
            (
                "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": [\"b}",
                "",
                vec![call("f", "{\"a\": [\"b}")],
            ),
        ];
        check_cases(ToolFormat::Mistral, cases);
        // Calls only: an opening cut short is no content.
        for text in [
            "[TOOL_CA",
            "[TOOL_CALLS] [",
            "[TOOL_CALLS] [{\"name\": \"now\", \"ar",
        ] {
            check(ToolFormat::Mistral, true, text, &(String::new(), vec![]));
        }
    }

    #[test]
    fn arguments_stream_as_they_are_written() {
        let mut s = ToolStream::new(ToolFormat::Mistral);
        assert_eq!(s.push("Sure. [TOOL_"), [ToolPiece::Text("Sure.".into())]);
        assert_eq!(s.push("CALLS] [{\"name\": \"now\", \"arg"), []);
        assert_eq!(
            s.push("uments\": {\"a\": [1"),
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
            s.push("]}}, {\"name\": \"f\", \"arguments\": {}}]"),
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
    fn tools_calls_and_results_render_as_mistral_common_renders_them() {
        // Golden values: mistral-common's expected rendering of its weather conversation with
        // the v3 tokenizer (tests/data/expected/chat-sample-weather-full-spm-v3), with
        // SentencePiece's `▁` read as a space.
        let tools = json!([weather_tool()]);
        let t = ToolUse::parse(Some(&tools), None, None, ToolFormat::Mistral)
            .unwrap()
            .unwrap();
        let expected = "[AVAILABLE_TOOLS] [{\"type\": \"function\", \"function\": {\"name\": \
            \"get_current_weather\", \"description\": \"Get the current weather\", \"parameters\": \
            {\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", \
            \"description\": \"The city and state, e.g. San Francisco, CA\"}, \"format\": \
            {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"], \"description\": \"The \
            temperature unit to use. Infer this from the users location.\"}}, \"required\": \
            [\"location\", \"format\"]}}}][/AVAILABLE_TOOLS]";
        assert_eq!(t.prompt(), Some(ToolPrompt::FirstUser(expected.into())));
        let calls = json!([{"id": "123456789", "type": "function", "function": {
            "name": "get_current_weather",
            "arguments": "{\"location\": \"Paris, France\", \"format\": \"celsius\"}"}}]);
        assert_eq!(
            render_calls("m", calls.as_array().unwrap(), ToolFormat::Mistral).unwrap(),
            "[TOOL_CALLS] [{\"name\": \"get_current_weather\", \"arguments\": {\"location\": \
             \"Paris, France\", \"format\": \"celsius\"}, \"id\": \"123456789\"}]"
        );
        assert_eq!(
            render_result(ToolFormat::Mistral, "22", Some("123456789")),
            "[TOOL_RESULTS] {\"content\": 22, \"call_id\": \"123456789\"}[/TOOL_RESULTS]"
        );
        assert_eq!(
            render_result(
                ToolFormat::Mistral,
                "{\"2024-05-22\": \"22\", \"2024-05-23\": \"23\"}",
                Some("123456789")
            ),
            "[TOOL_RESULTS] {\"content\": {\"2024-05-22\": \"22\", \"2024-05-23\": \"23\"}, \
             \"call_id\": \"123456789\"}[/TOOL_RESULTS]"
        );
        // Text that is not JSON is a JSON string; no id, no call_id (mistral-common's v2).
        assert_eq!(
            render_result(ToolFormat::Mistral, "18 \"C\"", None),
            "[TOOL_RESULTS] {\"content\": \"18 \\\"C\\\"\"}[/TOOL_RESULTS]"
        );
        // Several calls share one list; a call without an id has none.
        let two = json!([
            {"id": "call_0123456789abcdef", "function": {"name": "a", "arguments": "{}"}},
            {"function": {"name": "b", "arguments": {"x": 1}}},
        ]);
        assert_eq!(
            render_calls("m", two.as_array().unwrap(), ToolFormat::Mistral).unwrap(),
            "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {}, \"id\": \"789abcdef\"}, \
             {\"name\": \"b\", \"arguments\": {\"x\": 1}}]"
        );
        assert_eq!(
            render_calls("m", &[], ToolFormat::Mistral).unwrap(),
            String::new()
        );
    }

    #[test]
    fn call_ids_become_mistral_ids_the_same_for_a_call_and_its_result() {
        assert_eq!(call_id("123456789"), "123456789");
        assert_eq!(call_id("aBc123XyZ"), "aBc123XyZ");
        // Longer ids keep their last 9 characters (vLLM's rule), as OpenAI's and ours do.
        assert_eq!(
            call_id("call_0123456789abcdef0123456789abcdef"),
            "789abcdef"
        );
        for id in ["a", "call_1", "", "id-with-dashes--", "✓✓✓✓✓✓✓✓✓✓"] {
            let m = call_id(id);
            assert_eq!(m.len(), CALL_ID_LEN, "{id:?}");
            assert!(m.bytes().all(|b| b.is_ascii_alphanumeric()), "{id:?} {m}");
            assert_eq!(m, call_id(id), "{id:?}");
        }
        assert_ne!(call_id("a"), call_id("b"));
        assert_ne!(call_id("call_1"), call_id("call_2"));
    }

    #[test]
    fn the_format_is_chosen_for_mistral_templates_and_its_prompt_follows_the_choice() {
        // mistral-common's v3 template and Mistral 7B Instruct v0.3's (the lines that write the
        // markers); Mistral 7B Instruct v0.2's has neither.
        let v3 = "{%- set available_tools = '[AVAILABLE_TOOLS] ' + (tools| tojson) + '[/AVAILABLE_TOOLS]' %}{{- '[TOOL_CALLS] [' }}";
        let v03 =
            "{{- \"[AVAILABLE_TOOLS] [\" }}{{- \"[/AVAILABLE_TOOLS]\" }}{{- \"[TOOL_CALLS] [\" }}";
        let v02 = "{{ bos_token }}{% for message in messages %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endfor %}";
        assert_eq!(ToolFormat::for_template(v3), ToolFormat::Mistral);
        assert_eq!(ToolFormat::for_template(v03), ToolFormat::Mistral);
        assert_eq!(ToolFormat::for_template(v02), ToolFormat::Hermes);
        assert_eq!(ToolFormat::Mistral.name(), "mistral");

        let tools = json!([{"type": "function", "function": {"name": "now"}},
                           {"type": "function", "function": {"name": "f"}}]);
        let prompt = |choice: Value, parallel: bool| {
            let t = ToolUse::parse(
                Some(&tools),
                Some(&choice),
                Some(parallel),
                ToolFormat::Mistral,
            )
            .unwrap()
            .unwrap();
            match t.prompt() {
                Some(ToolPrompt::FirstUser(text)) => text,
                other => panic!("{other:?}"),
            }
        };
        let ends = |text: &str, tail: &str| assert!(text.ends_with(tail), "{text:?}");
        ends(&prompt(json!("auto"), true), "}}][/AVAILABLE_TOOLS]");
        ends(
            &prompt(json!("auto"), false),
            "[/AVAILABLE_TOOLS]Call at most one function.\n\n",
        );
        ends(
            &prompt(json!("required"), true),
            "[/AVAILABLE_TOOLS]Call at least one function now.\n\n",
        );
        ends(
            &prompt(json!("required"), false),
            "[/AVAILABLE_TOOLS]Call one function now.\n\n",
        );
        let named = prompt(json!({"type": "function", "function": {"name": "f"}}), true);
        assert_eq!(
            named,
            "[AVAILABLE_TOOLS] [{\"type\": \"function\", \"function\": {\"name\": \"f\", \
             \"parameters\": {\"type\": \"object\", \"properties\": {}, \"additionalProperties\": \
             false}}}][/AVAILABLE_TOOLS]Call the function \"f\" now.\n\n"
        );
    }

    #[test]
    fn the_grammar_holds_calls_to_one_list_after_the_marker() {
        let tools = json!([{"type": "function", "function": {"name": "now"}},
                           {"type": "function", "function": {"name": "f"}}]);
        let grammar = |choice: Value, parallel: bool| {
            ToolUse::parse(
                Some(&tools),
                Some(&choice),
                Some(parallel),
                ToolFormat::Mistral,
            )
            .unwrap()
            .unwrap()
            .grammar()
            .unwrap()
            .to_owned()
        };
        let auto = grammar(json!("auto"), true);
        assert!(
            auto.starts_with(
                "start: TEXT | pre list\npre[suffix=\"[TOOL_CALLS]\"]: /(?s:.*)/\n\
                 TEXT: /(?s:.+)/ & ~/(?s:.*\\[TOOL_CALLS\\].*)/\n\
                 list: \" [\" call (\", \" call)* \"]\"\ncall: body\nbody: body_0 | body_1\n"
            ),
            "{auto}"
        );
        assert!(
            auto.contains("body_1: \"{\\\"name\\\": \\\"f\\\", \\\"arguments\\\": \" %json{"),
            "{auto}"
        );
        let one = grammar(json!("required"), false);
        assert!(
            one.starts_with("start: \"[TOOL_CALLS]\" list\nlist: \" [\" call \"]\"\n"),
            "{one}"
        );
        let named = grammar(json!({"type": "function", "function": {"name": "f"}}), true);
        assert!(
            named.starts_with("start: \"[TOOL_CALLS]\" list\nlist: \" [\" call \"]\"\n"),
            "{named}"
        );
        assert!(!named.contains("\\\"now\\\""), "{named}");
    }

    #[test]
    fn what_follows_arguments_is_read_within_bounds() {
        assert_eq!(after_arguments(b"} ]"), After::Next(3, false));
        assert_eq!(after_arguments(b"}, {"), After::Next(2, true));
        assert_eq!(
            after_arguments(b", \"id\": \"123456789\"}]"),
            After::Next(21, false)
        );
        assert_eq!(after_arguments(b", \"id\": \"1234"), After::More);
        assert_eq!(after_arguments(b"}"), After::More);
        assert_eq!(after_arguments(b"} x"), After::Other(1));
        assert_eq!(after_arguments(b", 3}"), After::Other(0));
        let long = format!(", \"id\": \"{}", "x".repeat(MAX_HEADER));
        assert_eq!(after_arguments(long.as_bytes()), After::Other(0));
        let spaced = format!("}}{}]", " ".repeat(MAX_HELD_SPACE + 1));
        assert_eq!(after_arguments(spaced.as_bytes()), After::Other(1));
        assert_eq!(list_open(b"[TOOL_CALLS] [", 0), Ok(14));
        assert_eq!(list_open(b"[TOOL_CALLS]", 0), Err(true));
        assert_eq!(list_open(b"[TOOL_CALLS] {", 0), Err(false));
    }
}
