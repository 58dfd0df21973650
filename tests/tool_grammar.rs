//! The tool-calling grammar (built by the HTTP layer) compiled by the engine's structured
//! output (llguidance) over SmolLM2's real vocabulary, and read back by the HTTP layer's
//! `ToolStream`: what the grammar lets a model write is what the reader turns into calls.

mod common;

use std::sync::Arc;

use serde_json::{json, Value};
use switchyard_actors::structured::{GrammarCompiler, StructuredOutput};
use switchyard_api::schema::tools::{
    MarkerTokens, ToolFormat, ToolPiece, ToolSetup, ToolStream, ToolUse,
};
use switchyard_gpu::constraint::{is_allowed, Constraint};
use switchyard_gpu::model::{load_model, Tokenizer};

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(
        load_model(&common::model_path(), &switchyard_gpu::progress::NoProgress)
            .expect("SmolLM2 loads")
            .tokenizer,
    )
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12},
                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "now"}},
        // Pydantic-style: a nested model under $defs, referred to from the root.
        {"type": "function", "function": {
            "name": "send",
            "parameters": {"$defs": {"Address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"], "additionalProperties": false}},
                "properties": {"to": {"$ref": "#/$defs/Address"}},
                "required": ["to"], "additionalProperties": false}}},
    ])
}

fn constraint(
    compiler: &GrammarCompiler,
    tok: &Tokenizer,
    choice: Value,
    parallel: bool,
) -> Constraint {
    constraint_in(ToolFormat::Hermes, compiler, tok, choice, parallel)
}

fn constraint_in(
    format: ToolFormat,
    compiler: &GrammarCompiler,
    tok: &Tokenizer,
    choice: Value,
    parallel: bool,
) -> Constraint {
    let tools = tools();
    let tool_use = ToolUse::parse(Some(&tools), Some(&choice), Some(parallel), format)
        .expect("valid tools")
        .expect("tools");
    let grammar = tool_use.grammar().expect("a grammar");
    compiler
        .compile(
            &StructuredOutput::ToolCalls(grammar.to_owned()),
            &[tok.eos_token_ids()[0]],
            1,
        )
        .expect("the grammar compiles")
        .pop()
        .expect("one constraint")
}

/// Feeds `text` as a model could write it (at each step the longest allowed token that starts
/// the rest); returns whether all of it was accepted and the end of sequence may follow.
fn accepts(c: &Constraint, tok: &Tokenizer, text: &str) -> (bool, bool) {
    let vocab = tok.vocab_size();
    let bytes = text.as_bytes();
    let mut at = 0;
    while at < bytes.len() {
        let allowed = c.allowed(vocab);
        let best = (0..vocab)
            .filter(|&t| is_allowed(&allowed, t))
            .filter_map(|t| {
                let b = tok.token_bytes(t as u32)?;
                (!b.is_empty() && bytes[at..].starts_with(b)).then_some((b.len(), t))
            })
            .max();
        let Some((len, t)) = best else {
            return (false, false);
        };
        c.commit(t as u32);
        at += len;
    }
    let allowed = c.allowed(vocab);
    (true, is_allowed(&allowed, tok.eos_token_ids()[0] as usize))
}

fn call(name: &str, arguments: &str) -> String {
    format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {arguments}}}\n</tool_call>")
}

#[test]
fn the_grammar_admits_calls_and_text_as_the_choice_says() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
    let paris = call("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#);
    let now = call("now", "{}");
    let two = format!("{paris}\n{now}");
    let named = json!({"type": "function", "function": {"name": "now"}});
    // (choice, parallel, text, accepted whole, may end there)
    let cases: Vec<(Value, bool, String, bool, bool)> = vec![
        (
            json!("auto"),
            true,
            "It is sunny, <b>22</b> C.".into(),
            true,
            true,
        ),
        (json!("auto"), true, paris.clone(), true, true),
        (json!("auto"), true, two.clone(), true, true),
        // Text may come before calls (a model thinking or explaining first), not after them,
        // and no stray newlines after them either.
        (
            json!("auto"),
            true,
            format!("Let me look.\n{paris}"),
            true,
            true,
        ),
        (
            json!("auto"),
            true,
            format!("<think>rain?</think>\n\n{two}"),
            true,
            true,
        ),
        (
            json!("auto"),
            true,
            call("send", r#"{"to": {"city": "Paris"}}"#),
            true,
            true,
        ),
        (json!("auto"), true, format!("{paris} done"), false, false),
        (json!("auto"), true, format!("{paris}\n\n"), false, false),
        (json!("required"), true, "It is sunny.".into(), false, false),
        (json!("required"), true, two.clone(), true, true),
        (json!("required"), false, paris.clone(), true, true),
        (json!("required"), false, two.clone(), false, false),
        (
            json!("required"),
            true,
            format!("Sure.\n{paris}"),
            false,
            false,
        ),
        (
            json!("required"),
            true,
            call("send", r#"{"to": {"town": "Paris"}}"#),
            false,
            false,
        ),
        // Arguments follow the schema: an unknown unit, a missing one, an extra field.
        (
            json!("required"),
            true,
            call("get_weather", r#"{"city": "Paris", "unit": "kelvin"}"#),
            false,
            false,
        ),
        (
            json!("required"),
            true,
            call("get_weather", r#"{"city": "Paris"}"#),
            false,
            false,
        ),
        (
            json!("required"),
            true,
            call("now", r#"{"x": 1}"#),
            false,
            false,
        ),
        (
            json!("required"),
            true,
            call("get_time", "{}"),
            false,
            false,
        ),
        (named.clone(), true, now.clone(), true, true),
        (named, true, paris.clone(), false, false),
        // A call not yet closed may not end.
        (
            json!("required"),
            true,
            paris.trim_end_matches("\n</tool_call>").to_string(),
            true,
            false,
        ),
    ];
    check_cases(ToolFormat::Hermes, &compiler, &tok, cases);
}

/// (choice, parallel, text, accepted whole, may end there) cases, each against its grammar in
/// `format`.
fn check_cases(
    format: ToolFormat,
    compiler: &GrammarCompiler,
    tok: &Tokenizer,
    cases: Vec<(Value, bool, String, bool, bool)>,
) {
    for (choice, parallel, text, whole, end) in cases {
        let c = constraint_in(format, compiler, tok, choice.clone(), parallel);
        assert_eq!(
            accepts(&c, tok, &text),
            (whole, end),
            "{format:?}, choice {choice} parallel {parallel}: {text:?}"
        );
    }
}

#[test]
fn whatever_the_required_grammar_lets_a_model_write_reads_back_as_valid_calls() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
    let vocab = tok.vocab_size();
    let eos = tok.eos_token_ids()[0];
    let mut ended = 0;
    for seed in 0..48u64 {
        // Llama 3 for one walk in four; Mistral for one in four, and one in eight with
        // parallel calls; Mistral v11 for one in eight, with parallel calls; Hermes for the
        // others.
        let format = if seed % 4 == 3 {
            ToolFormat::Llama3Json
        } else if seed % 4 == 1 || seed % 8 == 2 {
            ToolFormat::Mistral
        } else if seed % 8 == 6 {
            ToolFormat::MistralV11
        } else {
            ToolFormat::Hermes
        };
        let parallel = seed % 2 == 0;
        let auto = seed % 3 == 0;
        let choice = if auto {
            json!("auto")
        } else {
            json!("required")
        };
        let c = constraint_in(format, &compiler, &tok, choice, parallel);
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut out = Vec::new();
        let mut finished = false;
        for _ in 0..300 {
            let allowed = c.allowed(vocab);
            let ids: Vec<u32> = (0..vocab)
                .filter(|&t| is_allowed(&allowed, t))
                .map(|t| t as u32)
                .collect();
            assert!(!ids.is_empty(), "nothing allowed after {out:?}");
            let others: Vec<u32> = ids.iter().copied().filter(|&t| t != eos).collect();
            if ids.contains(&eos) && (others.is_empty() || next() % 2 == 0) {
                finished = true;
                break;
            }
            let t = others[(next() % others.len() as u64) as usize];
            c.commit(t);
            out.push(t);
        }
        if !finished {
            // A random walk can wander into a long string; it must never leave the grammar.
            continue;
        }
        ended += 1;
        let text = tok.decode(&out, true).expect("decode");
        // Read as it streams, a token at a time.
        let mut stream = ToolStream::new(format);
        let mut pieces = Vec::new();
        let mut written = String::new();
        for k in 1..=out.len() {
            let now = tok.decode(&out[..k], true).expect("decode");
            // A character still incomplete waits for its next token.
            if now.ends_with('\u{FFFD}') {
                continue;
            }
            let new = now.strip_prefix(written.as_str()).expect("decoding grows");
            pieces.extend(stream.push(new));
            written = now;
        }
        let rest = text.strip_prefix(written.as_str()).expect("decoding grows");
        pieces.extend(stream.push(rest));
        pieces.extend(stream.finish());
        // Text comes only before calls, and only where it may.
        let mut opened = false;
        for piece in &pieces {
            match piece {
                ToolPiece::Text(t) => {
                    assert!(
                        auto && !opened,
                        "text {t:?} where only calls may be: {text:?}"
                    );
                    match format {
                        ToolFormat::Hermes => assert!(!t.contains("<tool_call>"), "{text:?}"),
                        ToolFormat::Llama3Json => {
                            assert!(!t.trim_start().starts_with('{'), "{text:?}")
                        }
                        ToolFormat::Mistral | ToolFormat::MistralV11 => {
                            assert!(!t.contains("[TOOL_CALLS]"), "{text:?}")
                        }
                    }
                }
                _ => opened = true,
            }
        }
        let (_, calls) = ToolPiece::join(pieces.clone());
        assert_eq!(ToolPiece::join(pieces), ToolStream::read_all(format, &text));
        assert!(parallel || calls.len() <= 1, "{text:?}");
        assert!(auto || !calls.is_empty(), "{text:?}");
        for call in calls {
            let args: Value = serde_json::from_str(&call.arguments).expect("arguments are JSON");
            match call.name.as_str() {
                "now" => assert_eq!(args, json!({}), "{text:?}"),
                "send" => {
                    let to = args["to"].as_object().expect("an address");
                    assert_eq!(to.len(), 1, "{text:?}");
                    assert!(to["city"].as_str().is_some_and(|c| c.chars().count() <= 12));
                }
                "get_weather" => {
                    let city = args["city"].as_str().expect("a city");
                    assert!(city.chars().count() <= 12, "{text:?}");
                    assert!(
                        ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or(""))
                    );
                    assert_eq!(args.as_object().map(|o| o.len()), Some(2), "{text:?}");
                }
                other => panic!("called {other:?}: {text:?}"),
            }
        }
    }
    assert!(ended >= 16, "only {ended} of 48 walks ended");
}

#[test]
fn the_llama3_grammar_admits_calls_as_the_whole_answer() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
    let call = |name: &str, arguments: &str| {
        format!("{{\"name\": \"{name}\", \"parameters\": {arguments}}}")
    };
    let paris = call("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#);
    let now = call("now", "{}");
    let two = format!("{paris}; {now}");
    // (choice, parallel, text, accepted whole, may end there)
    let cases: Vec<(Value, bool, String, bool, bool)> = vec![
        (
            json!("auto"),
            true,
            "It is sunny {22 C}.".into(),
            true,
            true,
        ),
        (json!("auto"), true, paris.clone(), true, true),
        (json!("auto"), true, two.clone(), true, true),
        // No text before a call, none after it; text may not open with a brace.
        (json!("auto"), true, format!("Sure. {paris}"), true, true),
        (json!("auto"), true, format!("{paris} done"), false, false),
        (json!("auto"), true, "{\"a\": 1}".into(), false, false),
        (json!("auto"), true, format!(" {paris}"), false, false),
        (json!("required"), true, "It is sunny.".into(), false, false),
        (json!("required"), true, two.clone(), true, true),
        (json!("required"), false, two.clone(), false, false),
        // OpenAI's and Hermes' key is not Llama 3's.
        (
            json!("required"),
            true,
            "{\"name\": \"now\", \"arguments\": {}}".to_string(),
            false,
            false,
        ),
        (
            json!("required"),
            true,
            call("get_weather", r#"{"city": "Paris", "unit": "kelvin"}"#),
            false,
            false,
        ),
        (
            json!({"type": "function", "function": {"name": "now"}}),
            true,
            now.clone(),
            true,
            true,
        ),
        // A call not yet closed may not end.
        (
            json!("required"),
            true,
            paris[..paris.len() - 1].to_string(),
            true,
            false,
        ),
    ];
    check_cases(ToolFormat::Llama3Json, &compiler, &tok, cases);
}

#[test]
fn the_mistral_grammar_admits_one_list_of_calls_after_the_marker() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
    let call = |name: &str, arguments: &str| {
        format!("{{\"name\": \"{name}\", \"arguments\": {arguments}}}")
    };
    let paris = call("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#);
    let now = call("now", "{}");
    let one = format!("[TOOL_CALLS] [{paris}]");
    let two = format!("[TOOL_CALLS] [{paris}, {now}]");
    let named = json!({"type": "function", "function": {"name": "now"}});
    // (choice, parallel, text, accepted whole, may end there)
    let cases: Vec<(Value, bool, String, bool, bool)> = vec![
        (
            json!("auto"),
            true,
            "It is sunny [22 C], {dry}.".into(),
            true,
            true,
        ),
        (json!("auto"), true, one.clone(), true, true),
        (json!("auto"), true, two.clone(), true, true),
        // Text may come before the list, not after it; the marker is the list's.
        (
            json!("auto"),
            true,
            format!("Let me look.{one}"),
            true,
            true,
        ),
        (json!("auto"), true, format!("{one} done"), false, false),
        (json!("auto"), true, format!("{one}\n"), false, false),
        (json!("auto"), true, "a [TOOL_CALLS] b".into(), false, false),
        (json!("required"), true, "It is sunny.".into(), false, false),
        (json!("required"), true, format!("[{paris}]"), false, false),
        (json!("required"), true, two.clone(), true, true),
        (json!("required"), false, one.clone(), true, true),
        (json!("required"), false, two.clone(), false, false),
        (json!("required"), true, format!("Sure.{one}"), false, false),
        // Arguments follow the schema; the key is "arguments"; the grammar writes no ids.
        (
            json!("required"),
            true,
            format!(
                "[TOOL_CALLS] [{}]",
                call("get_weather", r#"{"city": "Paris", "unit": "kelvin"}"#)
            ),
            false,
            false,
        ),
        (
            json!("required"),
            true,
            "[TOOL_CALLS] [{\"name\": \"now\", \"parameters\": {}}]".into(),
            false,
            false,
        ),
        (
            json!("required"),
            true,
            "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}, \"id\": \"123456789\"}]".into(),
            false,
            false,
        ),
        (
            named.clone(),
            true,
            format!("[TOOL_CALLS] [{now}]"),
            true,
            true,
        ),
        (named.clone(), true, one.clone(), false, false),
        (
            named,
            true,
            format!("[TOOL_CALLS] [{now}, {now}]"),
            false,
            false,
        ),
        // A list not yet closed may not end.
        (
            json!("required"),
            true,
            one[..one.len() - 1].to_string(),
            true,
            false,
        ),
    ];
    check_cases(ToolFormat::Mistral, &compiler, &tok, cases);
}

/// SmolLM2's tokenizer with `markers` added as special tokens, as in Mistral's tokenizers; and
/// their ids.
fn tokenizer_with_special(markers: &[&str]) -> (Arc<Tokenizer>, Vec<u32>) {
    let base = tokenizer();
    let mut json: Value = serde_json::from_str(&base.to_json().expect("json")).expect("JSON");
    for (k, marker) in markers.iter().enumerate() {
        json["added_tokens"]
            .as_array_mut()
            .expect("added tokens")
            .push(
                json!({"id": base.vocab_size() + k, "content": marker, "single_word": false,
                         "lstrip": false, "rstrip": false, "normalized": false,
                         "special": true}),
            );
    }
    let mut tok =
        Tokenizer::from_json_bytes(json.to_string().as_bytes()).expect("the tokenizer loads");
    tok.set_special_ids(base.bos_token_id(), base.eos_token_ids().to_vec());
    let ids = markers
        .iter()
        .map(|m| {
            let id = tok.token_to_id(m).expect("the marker");
            assert!(tok.is_special(id));
            id
        })
        .collect();
    (Arc::new(tok), ids)
}

/// SmolLM2's tokenizer with `[TOOL_CALLS]` added as a special token; and the marker's id.
fn tokenizer_with_special_marker() -> (Arc<Tokenizer>, u32) {
    let (tok, ids) = tokenizer_with_special(&["[TOOL_CALLS]"]);
    (tok, ids[0])
}

/// The Mistral grammar of `choice` over a tokenizer whose `[TOOL_CALLS]` is the special token
/// `marker`, told it as `serve` tells it (`ToolSetup::markers`).
fn special_marker_constraint(
    compiler: &GrammarCompiler,
    tok: &Tokenizer,
    marker: u32,
    choice: &Value,
) -> Constraint {
    let setup = ToolSetup {
        format: ToolFormat::Mistral,
        template: false,
        markers: MarkerTokens {
            calls: Some(marker),
            ..Default::default()
        },
        call_ids: false,
    };
    let tool_use = ToolUse::parse(Some(&tools()), Some(choice), Some(true), setup)
        .expect("valid tools")
        .expect("tools");
    assert_eq!(
        tool_use.kept_special_tokens(),
        [Some(marker), None, None, None, None]
    );
    compiler
        .compile(
            &StructuredOutput::ToolCalls(tool_use.grammar().expect("a grammar").to_owned()),
            &[tok.eos_token_ids()[0]],
            1,
        )
        .expect("the grammar compiles")
        .pop()
        .expect("one constraint")
}

/// Where `[TOOL_CALLS]` is a special token (Mistral's tokenizers), the grammar writes that
/// token, as the model was trained to: forced when the answer is calls only, allowed at the
/// start or after text with `auto`, never spelled as text. Decoded with special tokens (the
/// server turns skipping them off for such requests), the answer reads back as the calls.
#[test]
fn a_mistral_marker_that_is_a_special_token_is_written_as_that_token() {
    let (tok, marker) = tokenizer_with_special_marker();
    let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
    let vocab = tok.vocab_size();
    let eos = tok.eos_token_ids()[0] as usize;
    // In a prompt the marker is the special token, and a decoding that skips special tokens
    // leaves its text out.
    assert_eq!(tok.encode("[TOOL_CALLS]", false).expect("encode"), [marker]);
    assert_eq!(tok.decode(&[marker], true).expect("decode"), "");
    let list = " [{\"name\": \"now\", \"arguments\": {}}]";
    let read = |ids: &[u32]| {
        let text = tok.decode(ids, false).expect("decode");
        let (content, calls) = ToolStream::read_all(ToolFormat::Mistral, &text);
        assert_eq!(calls.len(), 1, "{text:?}");
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("now", "{}")
        );
        (text, content)
    };
    let named = json!({"type": "function", "function": {"name": "now"}});
    for choice in [json!("required"), named] {
        let c = special_marker_constraint(&compiler, &tok, marker, &choice);
        let allowed = c.allowed(vocab);
        let first: Vec<usize> = (0..vocab).filter(|&t| is_allowed(&allowed, t)).collect();
        assert_eq!(first, [marker as usize], "{choice}");
        c.commit(marker);
        let mut ids = vec![marker];
        ids.extend(path(&c, &tok, list));
        assert!(is_allowed(&c.allowed(vocab), eos), "{choice}");
        let (text, content) = read(&ids);
        assert_eq!(text, format!("[TOOL_CALLS]{list}"));
        assert_eq!(content, "");
    }
    let auto = json!("auto");
    let c = special_marker_constraint(&compiler, &tok, marker, &auto);
    assert!(is_allowed(&c.allowed(vocab), marker as usize));
    let mut ids = path(&c, &tok, "Let me look.");
    assert!(!ids.contains(&marker));
    let allowed = c.allowed(vocab);
    assert!(is_allowed(&allowed, marker as usize) && is_allowed(&allowed, eos));
    c.commit(marker);
    ids.push(marker);
    ids.extend(path(&c, &tok, list));
    assert!(is_allowed(&c.allowed(vocab), eos));
    assert_eq!(read(&ids).1, "Let me look.");
    // The marker's text written as text is not a way in.
    let c = special_marker_constraint(&compiler, &tok, marker, &auto);
    assert!(!accepts(&c, &tok, "a [TOOL_CALLS] b").0);
}

#[test]
fn the_mistral_v11_grammar_admits_calls_each_after_the_marker() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
    let paris = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}"#;
    let now = "[TOOL_CALLS]now[ARGS]{}";
    let two = format!("{paris}{now}");
    let named = json!({"type": "function", "function": {"name": "now"}});
    // (choice, parallel, text, accepted whole, may end there)
    let cases: Vec<(Value, bool, String, bool, bool)> = vec![
        (
            json!("auto"),
            true,
            "It is sunny [22 C], {dry}.".into(),
            true,
            true,
        ),
        (json!("auto"), true, paris.into(), true, true),
        (json!("auto"), true, two.clone(), true, true),
        (
            json!("auto"),
            true,
            format!("Let me look.{two}"),
            true,
            true,
        ),
        // Text may come before the calls, not after them; the marker is the calls'.
        (json!("auto"), true, format!("{now} done"), false, false),
        (
            json!("auto"),
            true,
            format!(
                "{now}
"
            ),
            false,
            false,
        ),
        (json!("auto"), true, "a [TOOL_CALLS] b".into(), false, false),
        (json!("auto"), false, two.clone(), false, false),
        (json!("required"), true, "It is sunny.".into(), false, false),
        (json!("required"), true, two.clone(), true, true),
        (json!("required"), false, now.into(), true, true),
        (json!("required"), true, format!("Sure.{now}"), false, false),
        // No id where the template writes none (ToolSetup::call_ids).
        (
            json!("required"),
            true,
            "[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}".into(),
            false,
            false,
        ),
        // Arguments follow the schema; names are the tools'.
        (
            json!("required"),
            true,
            r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "kelvin"}"#.into(),
            false,
            false,
        ),
        (
            json!("required"),
            true,
            "[TOOL_CALLS]later[ARGS]{}".into(),
            false,
            false,
        ),
        (named.clone(), true, now.into(), true, true),
        (named.clone(), true, format!("{now}{now}"), false, false),
        (named, true, paris.into(), false, false),
        // Cut inside the arguments: not an end.
        (
            json!("required"),
            true,
            paris[..paris.len() - 2].to_string(),
            true,
            false,
        ),
    ];
    check_cases(ToolFormat::MistralV11, &compiler, &tok, cases);
}

/// Where Mistral v11's markers are special tokens (as in its tokenizers), the grammar writes
/// those tokens and never their text; decoded with those tokens kept (as the server keeps them
/// for such requests, other special tokens skipped), the answer reads back as its calls.
#[test]
fn mistral_v11_markers_that_are_special_tokens_are_written_as_those_tokens() {
    let (tok, ids) = tokenizer_with_special(&["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]);
    let (calls, args, call_id) = (ids[0], ids[1], ids[2]);
    let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
    let vocab = tok.vocab_size();
    let eos = tok.eos_token_ids()[0];
    let constraint = |choice: &Value, call_ids: bool| {
        let setup = ToolSetup {
            format: ToolFormat::MistralV11,
            template: true,
            markers: MarkerTokens {
                calls: Some(calls),
                args: Some(args),
                call_id: Some(call_id),
            },
            call_ids,
        };
        let tool_use = ToolUse::parse(Some(&tools()), Some(choice), Some(true), setup)
            .expect("valid tools")
            .expect("tools");
        assert_eq!(
            tool_use.kept_special_tokens(),
            [Some(calls), Some(args), Some(call_id), None, None]
        );
        compiler
            .compile(
                &StructuredOutput::ToolCalls(tool_use.grammar().expect("a grammar").to_owned()),
                &[eos],
                1,
            )
            .expect("the grammar compiles")
            .pop()
            .expect("one constraint")
    };
    // The text a detokenizer keeping only the markers writes.
    let text_of = |ids: &[u32]| {
        let mut text = String::new();
        for &t in ids {
            if [calls, args, call_id].contains(&t) || !tok.is_special(t) {
                text.push_str(&tok.decode(&[t], false).expect("decode"));
            }
        }
        text
    };
    let only = |c: &Constraint| {
        let allowed = c.allowed(vocab);
        (0..vocab)
            .filter(|&t| is_allowed(&allowed, t))
            .collect::<Vec<_>>()
    };
    let read = |text: &str| {
        let (content, calls) = ToolStream::read_all(ToolFormat::MistralV11, text);
        let calls: Vec<(String, String)> =
            calls.into_iter().map(|c| (c.name, c.arguments)).collect();
        (content, calls)
    };
    let weather = r#"{"city": "Paris", "unit": "celsius"}"#;
    // Calls only: the marker token first, then the name, then `[ARGS]` as a token, never as
    // text; another call, or the end.
    let c = constraint(&json!("required"), false);
    assert_eq!(only(&c), [calls as usize]);
    c.commit(calls);
    let mut ids = vec![calls];
    ids.extend(path(&c, &tok, "now"));
    assert_eq!(only(&c), [args as usize]);
    c.commit(args);
    ids.push(args);
    ids.extend(path(&c, &tok, "{}"));
    let allowed = c.allowed(vocab);
    assert!(is_allowed(&allowed, calls as usize) && is_allowed(&allowed, eos as usize));
    c.commit(calls);
    ids.push(calls);
    ids.extend(path(&c, &tok, "get_weather"));
    c.commit(args);
    ids.push(args);
    ids.extend(path(&c, &tok, weather));
    assert!(is_allowed(&c.allowed(vocab), eos as usize));
    let text = text_of(&ids);
    assert_eq!(
        text,
        format!("[TOOL_CALLS]now[ARGS]{{}}[TOOL_CALLS]get_weather[ARGS]{weather}")
    );
    let both = vec![
        ("now".to_owned(), "{}".to_owned()),
        ("get_weather".to_owned(), weather.to_owned()),
    ];
    assert_eq!(read(&text), (String::new(), both.clone()));
    // Where the template writes ids, each call has `[CALL_ID]` and an id before `[ARGS]`.
    let c = constraint(&json!("required"), true);
    c.commit(calls);
    let mut ids = vec![calls];
    ids.extend(path(&c, &tok, "now"));
    assert_eq!(only(&c), [call_id as usize]);
    c.commit(call_id);
    ids.push(call_id);
    ids.extend(path(&c, &tok, "a1B2c3D4e"));
    assert_eq!(only(&c), [args as usize]);
    c.commit(args);
    ids.push(args);
    ids.extend(path(&c, &tok, "{}"));
    c.commit(calls);
    ids.push(calls);
    ids.extend(path(&c, &tok, "get_weather"));
    assert_eq!(only(&c), [call_id as usize]);
    c.commit(call_id);
    ids.push(call_id);
    ids.extend(path(&c, &tok, "Zz9Zz9Zz9"));
    c.commit(args);
    ids.push(args);
    ids.extend(path(&c, &tok, weather));
    assert!(is_allowed(&c.allowed(vocab), eos as usize));
    let text = text_of(&ids);
    assert_eq!(
        text,
        format!(
            "[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{{}}\
             [TOOL_CALLS]get_weather[CALL_ID]Zz9Zz9Zz9[ARGS]{weather}"
        )
    );
    assert_eq!(read(&text), (String::new(), both));
    // Auto: text, then the marker token; the marker's text is not a way in.
    let c = constraint(&json!("auto"), false);
    let mut ids = path(&c, &tok, "Let me look.");
    assert!(is_allowed(&c.allowed(vocab), calls as usize));
    c.commit(calls);
    ids.push(calls);
    ids.extend(path(&c, &tok, "now"));
    c.commit(args);
    ids.push(args);
    ids.extend(path(&c, &tok, "{}"));
    assert_eq!(
        read(&text_of(&ids)),
        (
            "Let me look.".to_owned(),
            vec![("now".to_owned(), "{}".to_owned())]
        )
    );
    let c = constraint(&json!("auto"), false);
    assert!(!accepts(&c, &tok, "a [TOOL_CALLS]now[ARGS]{}").0);
}

/// The tokens a model could write for `text` (at each step the longest allowed token that
/// starts the rest).
fn path(c: &Constraint, tok: &Tokenizer, text: &str) -> Vec<u32> {
    let vocab = tok.vocab_size();
    let bytes = text.as_bytes();
    let mut at = 0;
    let mut ids = Vec::new();
    while at < bytes.len() {
        let allowed = c.allowed(vocab);
        let (len, t) = (0..vocab)
            .filter(|&t| is_allowed(&allowed, t))
            .filter_map(|t| {
                let b = tok.token_bytes(t as u32)?;
                (!b.is_empty() && bytes[at..].starts_with(b)).then_some((b.len(), t as u32))
            })
            .max()
            .unwrap_or_else(|| panic!("{text:?} is not allowed at byte {at}"));
        c.commit(t);
        ids.push(t);
        at += len;
    }
    ids
}

#[test]
fn masks_through_drafts_equal_masks_one_token_at_a_time_across_a_call() {
    // Speculative decoding asks for the masks after each draft and takes the drafts back:
    // across text, the opening tag and a call, that must give what one token at a time gives,
    // and leave the state as it was.
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
    let vocab = tok.vocab_size();
    let text = format!(
        "Let me look.\n{}",
        call("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#)
    );
    let tokens = path(
        &constraint(&compiler, &tok, json!("auto"), true),
        &tok,
        &text,
    );
    for k in 0..tokens.len() {
        let drafts = &tokens[k..(k + 5).min(tokens.len())];
        let (a, b) = (
            constraint(&compiler, &tok, json!("auto"), true),
            constraint(&compiler, &tok, json!("auto"), true),
        );
        for &t in &tokens[..k] {
            a.commit(t);
            b.commit(t);
        }
        let before = a.allowed(vocab);
        let through = a.allowed_through(vocab, drafts);
        let mut one_by_one = Vec::new();
        for &d in drafts {
            one_by_one.push(b.allowed(vocab));
            b.commit(d);
        }
        one_by_one.push(b.allowed(vocab));
        assert!(
            through == one_by_one,
            "drafts from token {k} of {}",
            tokens.len()
        );
        assert!(
            a.allowed(vocab) == before,
            "drafts from token {k} not taken back"
        );
        // And the rest of the text is still allowed after the drafts were taken back.
        for &t in &tokens[k..] {
            assert!(is_allowed(&a.allowed(vocab), t as usize), "token {k}");
            a.commit(t);
        }
    }
}
