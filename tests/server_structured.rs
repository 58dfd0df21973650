//! End-to-end tests of structured output: the real binary, SmolLM2 on the CPU, HTTP on
//! loopback. Each asks for a structure the model would not produce by itself (checked for
//! the choice and the regex by the same request without the structure) and validates the
//! answer with an independent parser (serde_json) or by hand.

mod common;

use common::{sse_events, Server};
use serde_json::{json, Value};

fn server() -> Server {
    Server::start(
        "structured",
        "scheduler:\n  max_num_seqs: 16\n  max_num_batched_tokens: 1024\n",
    )
}

fn error_param(server: &Server, body: Value) -> String {
    let (status, v) = server.post_json("/v1/completions", &body);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    v["error"]["param"].as_str().unwrap_or("").to_string()
}

#[test]
fn json_schema_choice_and_regex_are_followed() {
    let s = server();
    // A chat answer under a JSON schema, greedy.
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "population_millions": {"type": "number"},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3}
        },
        "required": ["city", "population_millions", "landmarks"],
        "additionalProperties": false
    });
    let v = s.post_ok(
        "/v1/chat/completions",
        &json!({
            "messages": [{"role": "user", "content": "Describe Paris."}],
            "max_tokens": 120,
            "temperature": 0,
            "response_format": {"type": "json_schema",
                "json_schema": {"name": "city", "schema": schema, "strict": true}}
        }),
    );
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{v}");
    let content = choice["message"]["content"].as_str().expect("content");
    let answer: Value =
        serde_json::from_str(content).unwrap_or_else(|e| panic!("{content:?}: {e}"));
    let o = answer.as_object().expect("an object");
    assert_eq!(o.len(), 3, "{content}");
    assert!(
        o["city"].is_string() && o["population_millions"].is_number(),
        "{content}"
    );
    let landmarks = o["landmarks"].as_array().expect("landmarks");
    assert!(
        landmarks.len() <= 3 && landmarks.iter().all(Value::is_string),
        "{content}"
    );

    // A choice the model would not write by itself, two sampled choices.
    let options = ["purple elephant", "green giraffe"];
    let prompt = "My favourite animal is the";
    let free = s.post_ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
    );
    let free_text = free["choices"][0]["text"]
        .as_str()
        .unwrap_or("")
        .trim()
        .to_string();
    assert!(!options.contains(&free_text.as_str()), "{free_text:?}");
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2,
               "guided_choice": options}),
    );
    for c in v["choices"].as_array().expect("choices") {
        assert!(options.contains(&c["text"].as_str().unwrap_or("")), "{v}");
        assert_eq!(c["finish_reason"], "stop", "{v}");
    }

    // A regex, streamed: the deltas put together match it.
    let body = json!({"prompt": "Order number:", "max_tokens": 16, "temperature": 0.7, "seed": 3,
                      "stream": true, "structured_outputs": {"regex": " [0-9]{3}-[A-Z]{2}"}});
    let r = s
        .request("POST", "/v1/completions", Some(&body.to_string()), &[])
        .expect("request");
    assert_eq!(r.status, 200, "{}", r.body);
    let mut text = String::new();
    for e in sse_events(&r.body) {
        if e == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&e).expect("chunk");
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or(""));
    }
    assert!(
        s.metric("switchyard:structured_output_requests_total")
            .is_some_and(|v| v >= 1.0),
        "the structured-output requests are not counted"
    );
    let b = text.as_bytes();
    assert!(
        b.len() == 7
            && b[0] == b' '
            && b[1..4].iter().all(u8::is_ascii_digit)
            && b[4] == b'-'
            && b[5..].iter().all(u8::is_ascii_uppercase),
        "{text:?}"
    );
}

#[test]
fn bad_structured_requests_are_refused_and_the_server_keeps_serving() {
    let s = server();
    let base = |extra: Value| {
        let mut b = json!({"prompt": "Hello", "max_tokens": 4});
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    };
    assert_eq!(
        error_param(&s, base(json!({"response_format": {"type": "xml"}}))),
        "response_format"
    );
    assert_eq!(
        error_param(
            &s,
            base(json!({"guided_regex": "a", "guided_choice": ["a"]}))
        ),
        "guided_choice"
    );
    assert_eq!(
        error_param(
            &s,
            base(json!({"guided_choice": ["a"], "ignore_eos": true}))
        ),
        "ignore_eos"
    );
    // Compiled by the engine: refused with the grammar's own reason.
    for bad in [
        json!({"guided_regex": "(unclosed"}),
        json!({"guided_json": {"type": "no-such-type"}}),
        json!({"guided_grammar": "start: missing_rule"}),
    ] {
        let (status, v) = s.post_json("/v1/completions", &base(bad.clone()));
        assert_eq!(status, 400, "{bad}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains("structured output"), "{message}");
    }
    let v = s.post_ok(
        "/v1/completions",
        &base(
            json!({"response_format": {"type": "json_object"}, "max_tokens": 64, "temperature": 0}),
        ),
    );
    let text = v["choices"][0]["text"].as_str().unwrap_or("");
    if v["choices"][0]["finish_reason"] == "stop" {
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(parsed.is_object(), "{text}");
    } else {
        assert!(text.starts_with('{'), "{text:?}");
    }
}

/// The reviewer's schema: 20 intersected patterns, 45 s of compiling before the bounds.
fn intersected_patterns(n: usize) -> Value {
    let letters: Vec<char> = ('a'..='z').collect();
    let mut all = vec![json!({"type": "string", "pattern": ".*a.*b.*"})];
    for i in 1..n {
        all.push(json!({"pattern": format!(".*{}.*{}.*", letters[i], letters[i + 1])}));
    }
    json!({"allOf": all})
}

#[test]
fn grammars_beyond_the_bounds_or_that_cannot_start_are_refused() {
    let s = server();
    let refused = |body: Value, why: &str| {
        let (status, v) = s.post_json("/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains(why), "{body}: {message}");
    };
    // Refused before compiling: a bound on the work, not a timeout.
    let schema = intersected_patterns(20);
    refused(
        json!({"prompt": "x", "max_tokens": 4, "guided_json": schema}),
        "at most 8 may meet",
    );
    refused(
        json!({"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": schema}}),
        "at most 8 may meet",
    );
    // Unsatisfiable, or beyond llguidance's limits from the first token: a 400 rather than
    // an empty answer that reads as a normal stop.
    refused(
        json!({"prompt": "x", "max_tokens": 4,
               "guided_json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}),
        "no output satisfies it",
    );
    refused(
        json!({"prompt": "x", "max_tokens": 4, "guided_regex": "(.{1,1000}){1,1000}"}),
        "fails at the first token",
    );
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    );
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
}

/// A schema whose required property leads back to itself has no finite instance: it compiled,
/// its first tokens passed, and then llguidance's parser gave up on the output it forced
/// (`{"a": {"a": ...`), a 500 (or an error event) a few tokens in. It is a 400 before the
/// request starts, as a response format, a vLLM schema or a tool's parameters, streamed or
/// not; a recursive schema with a way out is still followed.
#[test]
fn a_schema_that_only_infinite_json_satisfies_is_refused() {
    let s = server();
    let endless = json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]});
    let messages = json!([{"role": "user", "content": "Give an example"}]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 16, "response_format":
                {"type": "json_schema", "json_schema": {"name": "x", "schema": endless}}}),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 16, "stream": true, "response_format":
                {"type": "json_schema", "json_schema": {"name": "x", "schema": endless}}}),
            "response_format",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 16, "guided_json": endless}),
            "guided_json",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 16, "tool_choice": "required",
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": endless}}]}),
            "tools[0].function.parameters",
        ),
    ];
    for (path, body, param) in cases {
        let (status, v) = s.post_json(path, &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains("no finite instance"), "{message}");
    }
    let tree = json!({"type": "object", "required": ["name", "children"], "properties": {
        "name": {"type": "string", "maxLength": 8},
        "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}}});
    let v = s.post_ok(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 12, "response_format":
            {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}}),
    );
    assert!(
        v["choices"][0]["message"]["content"].as_str().is_some(),
        "{v}"
    );
}

/// A Lark grammar with no finite sentence (`start: "{" start "}"`) was accepted, then failed a
/// few tokens in when the output it forced outgrew llguidance's item limit: a 500 (a stream: 200
/// then an error event), which openai-python retries. It is a 400 naming the request's grammar
/// field before the request starts, streamed or not; a recursion with a way out is served.
#[test]
fn a_grammar_with_no_finite_sentence_is_refused() {
    let s = server();
    let endless = "start: \"{\" start \"}\"";
    let through = "start: a\na: \"(\" b \")\"\nb: \"[\" a \"]\" | a \"x\"";
    let messages = json!([{"role": "user", "content": "Give an example"}]);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 16, "guided_grammar": endless}),
            "guided_grammar",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 16, "stream": true,
                   "structured_outputs": {"grammar": through}}),
            "structured_outputs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 16, "stream": true,
                   "structured_outputs": {"grammar": endless}}),
            "structured_outputs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 16, "guided_grammar": through}),
            "guided_grammar",
        ),
    ];
    for (path, body, param) in cases {
        let (status, v) = s.post_json(path, &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains("no finite output"), "{message}");
    }
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 12, "temperature": 0,
                "guided_grammar": "start: \"{\" start \"}\" | \"x\""}),
    );
    let text = v["choices"][0]["text"].as_str().expect("text");
    assert!(text.chars().all(|c| "{x}".contains(c)), "{v}");
    if v["choices"][0]["finish_reason"] == "stop" {
        let depth = text.chars().take_while(|&c| c == '{').count();
        assert_eq!(
            text,
            format!("{}x{}", "{".repeat(depth), "}".repeat(depth)),
            "{v}"
        );
    }
}

/// A Lark grammar of `rules` rules that each double the next (`a0: a1 a1`, ...), the last
/// `"x"`, after `prefix`: 2^(rules - 1) forced `x`s.
fn doubling_grammar(prefix: &str, rules: usize) -> String {
    let mut g = format!("start: {prefix} a0\n");
    for i in 0..rules - 1 {
        g.push_str(&format!("a{i}: a{0} a{0}\n", i + 1));
    }
    g.push_str(&format!("a{}: \"x\"\n", rules - 1));
    g
}

/// The JSON schema of [`doubling_grammar`]: `["a", [[...["x", "x"]...]]]` (or `"b"` first),
/// pairs of pairs 24 times over after a free first item.
fn doubling_schema(rules: usize) -> Value {
    let pair = |item: String| {
        json!({"type": "array", "prefixItems": [{"$ref": item}, {"$ref": item}],
               "items": false, "minItems": 2})
    };
    let mut defs = serde_json::Map::new();
    for i in 0..rules - 1 {
        defs.insert(format!("a{i}"), pair(format!("#/$defs/a{}", i + 1)));
    }
    defs.insert(format!("a{}", rules - 1), json!({"const": "x"}));
    json!({"$defs": defs, "type": "array", "items": false, "minItems": 2,
           "prefixItems": [{"enum": ["a", "b"]}, {"$ref": "#/$defs/a0"}]})
}

/// Checks that `v`, an OpenAI error body, is the request's own error naming `param` and says
/// that the grammar exceeded the parser's limits after its free first token and the forced one
/// the parser gave up on (within `max_tokens`, 16).
fn assert_past_the_limits(v: &Value, param: &str) {
    let e = &v["error"];
    assert_eq!(e["type"], "invalid_request_error", "{v}");
    assert_eq!(e["param"], param, "{v}");
    let message = e["message"].as_str().unwrap_or("");
    let after = message
        .strip_prefix("structured output: the grammar exceeded the parser's limits after ")
        .unwrap_or_else(|| panic!("{v}"));
    let (n, rest) = after.split_once(' ').unwrap_or_default();
    let n: usize = n.parse().unwrap_or_else(|_| panic!("{v}"));
    assert!((2..=16).contains(&n), "{v}");
    assert!(
        rest.starts_with("generated tokens (parser error: Too many items (limit 50000"),
        "{v}"
    );
}

/// A grammar whose output is finite but forced for a huge stretch (rules that double each
/// other 24 times over) passed every check when it compiled, then failed past llguidance's
/// per-step parser limits a token or two in: a 500 `server_error` (a stream: an error event
/// of that type), which openai-python retries three times at the same cost. It is the
/// request's own error: forced from the first token it is a 400 before the request starts;
/// after a free first token (`"a" | "b"`) a 400 naming the grammar's field when it fails
/// (a stream: an `invalid_request_error` event), on completions, chat and the Responses API,
/// counted as `invalid_request`.
#[test]
fn a_grammar_past_the_parser_limits_is_the_requests_error() {
    let s = server();
    let messages = json!([{"role": "user", "content": "Give an example"}]);
    let forced = doubling_grammar("", 24);
    for (path, body, param) in [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 16, "guided_grammar": forced}),
            "guided_grammar",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 16, "stream": true,
                   "structured_outputs": {"grammar": forced}}),
            "structured_outputs",
        ),
    ] {
        let (status, v) = s.post_json(path, &body);
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(
            message.contains("the output it forces from its start exceeds the parser's limits"),
            "{v}"
        );
    }
    let failed_before = s.labelled_metric(
        "switchyard:request_failed_total",
        &["reason=\"invalid_request\""],
    );
    let late = doubling_grammar("(\"a\" | \"b\")", 24);
    let schema = doubling_schema(24);
    let plain = [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 16, "guided_grammar": late}),
            "guided_grammar",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 16,
                   "structured_outputs": {"grammar": late}}),
            "structured_outputs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 16, "response_format":
                {"type": "json_schema", "json_schema": {"name": "pairs", "schema": schema}}}),
            "response_format",
        ),
        (
            "/v1/responses",
            json!({"input": "Give an example", "max_output_tokens": 16, "text":
                {"format": {"type": "json_schema", "name": "pairs", "schema": schema}}}),
            "text.format",
        ),
    ];
    for (path, body, param) in &plain {
        let (status, v) = s.post_json(path, body);
        assert_eq!(status, 400, "{path} {body}: {v}");
        assert_past_the_limits(&v, param);
    }
    // Streamed: the text so far, then the error event (chat and completions: then `[DONE]`).
    for (path, body, param) in &plain {
        let mut body = body.clone();
        body["stream"] = json!(true);
        let r = s
            .request("POST", path, Some(&body.to_string()), &[])
            .expect("a streamed response");
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        if *path == "/v1/responses" {
            let data = r
                .body
                .split_terminator("\n\n")
                .find_map(|frame| frame.strip_prefix("event: error\ndata: "))
                .unwrap_or_else(|| panic!("no error event: {}", r.body));
            let e: Value = serde_json::from_str(data).expect("the error event's JSON");
            assert_eq!(e["code"], "invalid_request_error", "{e}");
            assert_past_the_limits(
                &json!({"error": {"type": e["code"], "param": e["param"],
                                                     "message": e["message"]}}),
                param,
            );
            continue;
        }
        let mut events = sse_events(&r.body);
        assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{}", r.body);
        let last: Value =
            serde_json::from_str(&events.pop().expect("the error event")).expect("JSON");
        assert_past_the_limits(&last, param);
    }
    let failed = s.labelled_metric(
        "switchyard:request_failed_total",
        &["reason=\"invalid_request\""],
    );
    assert_eq!(failed - failed_before, 2.0 * plain.len() as f64);
    assert_eq!(
        s.labelled_metric(
            "switchyard:request_failed_total",
            &["reason=\"structured_output\""]
        ),
        0.0
    );
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 4, "guided_grammar": doubling_grammar("", 11)}),
    );
    // Within the limits (1,024 forced `x`s): served, cut at `max_tokens`.
    let text = v["choices"][0]["text"].as_str().unwrap_or("");
    assert!(!text.is_empty() && text.chars().all(|c| c == 'x'), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
}

/// A right recursion that twenty rules make at once after a free first letter
/// (`s: s0 | ... | s19`, `s0: "x" s0 | "x"`): each `x` deepens all twenty, and the parser's row
/// of items grows with the output until it passes llguidance's 2,000 items a row, some
/// hundred `x`s in (`min_tokens` keeps the model from ending sooner). A limit only the output
/// reaches, found when a token is consumed: the request's error, as the other limits are.
#[test]
fn a_right_recursion_past_the_parsers_row_limit_is_the_requests_error() {
    let s = server();
    let mut grammar = String::from("start: (\"a\" | \"b\") s\ns: ");
    grammar.push_str(
        &(0..20)
            .map(|i| format!("s{i}"))
            .collect::<Vec<_>>()
            .join(" | "),
    );
    grammar.push('\n');
    for i in 0..20 {
        grammar.push_str(&format!("s{i}: \"x\" s{i} | \"x\"\n"));
    }
    let failed_before = s.labelled_metric(
        "switchyard:request_failed_total",
        &["reason=\"invalid_request\""],
    );
    let body = json!({"prompt": "axxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", "max_tokens": 600,
                      "min_tokens": 600, "temperature": 0, "guided_grammar": grammar});
    let check = |v: &Value| {
        let e = &v["error"];
        assert_eq!(e["type"], "invalid_request_error", "{v}");
        assert_eq!(e["param"], "guided_grammar", "{v}");
        let message = e["message"].as_str().unwrap_or("");
        assert!(
            message
                .starts_with("structured output: the grammar exceeded the parser's limits after ")
                && message.contains(" generated tokens (Parser Error: Current row has ")
                && message.contains("; max is 2000; consider making your grammar left-recursive"),
            "{v}"
        );
    };
    let (status, v) = s.post_json("/v1/completions", &body);
    assert_eq!(status, 400, "{v}");
    check(&v);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = s
        .request("POST", "/v1/completions", Some(&streamed.to_string()), &[])
        .expect("a streamed response");
    assert_eq!(r.status, 200, "{}", r.body);
    let mut events = sse_events(&r.body);
    assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{}", r.body);
    check(&serde_json::from_str(&events.pop().expect("the error event")).expect("JSON"));
    let failed = s.labelled_metric(
        "switchyard:request_failed_total",
        &["reason=\"invalid_request\""],
    );
    assert_eq!(failed - failed_before, 2.0);
    assert_eq!(
        s.labelled_metric(
            "switchyard:request_failed_total",
            &["reason=\"structured_output\""]
        ),
        0.0
    );
}

#[test]
fn an_end_token_ends_a_finished_grammar_before_min_tokens() {
    let s = server();
    // 104 is `x`: the prompt makes the model want it; the grammar holds the output to "abc".
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": "abcxabcxabcxabcxabcxabcx", "guided_regex": "abc",
               "stop_token_ids": [104], "min_tokens": 6, "temperature": 0}),
    );
    assert_eq!(v["choices"][0]["text"], "abc", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    // The end of sequence only, special tokens shown: none of them follows the five letters.
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": "abcxabcxabcxabcxabcxabcx", "guided_regex": "[a-z]{5}",
               "min_tokens": 8, "temperature": 0, "skip_special_tokens": false}),
    );
    let text = v["choices"][0]["text"].as_str().unwrap_or("");
    assert!(
        text.len() == 5 && text.bytes().all(|b| b.is_ascii_lowercase()),
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
}

#[test]
fn vllm_json_options_are_accepted_with_their_meaning() {
    let s = server();
    let schema = json!({"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "inhabitants": {"type": "integer", "minimum": 0, "maximum": 100000000}},
        "required": ["city", "inhabitants"]});
    let ask = |options: Value| {
        let mut so = options;
        so["json"] = schema.clone();
        let v = s.post_ok(
            "/v1/completions",
            &json!({"prompt": "Paris, as JSON:", "max_tokens": 48, "temperature": 0,
                   "structured_outputs": so}),
        );
        let text = v["choices"][0]["text"].as_str().unwrap_or("").to_string();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        (text, parsed)
    };
    // Closed objects: exactly the two properties, written without free whitespace.
    let (text, parsed) = ask(json!({"disable_any_whitespace": true,
                                    "disable_additional_properties": true,
                                    "disable_fallback": true}));
    let o = parsed.as_object().expect("an object");
    assert_eq!(o.len(), 2, "{text}");
    assert!(o["city"].is_string() && o["inhabitants"].is_u64(), "{text}");
    assert_eq!(text, tool_json(&parsed), "{text}");
    // A whitespace pattern that allows none: compact JSON, separators without spaces.
    let (text, parsed) = ask(json!({"whitespace_pattern": "[ ]{0}",
                                    "disable_additional_properties": true}));
    assert_eq!(text, parsed.to_string(), "{text}");
}

/// `v` as Python's `json.dumps` writes it.
fn tool_json(v: &Value) -> String {
    match v {
        Value::Object(o) => format!(
            "{{{}}}",
            o.iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), tool_json(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(tool_json).collect::<Vec<_>>().join(", ")
        ),
        other => other.to_string(),
    }
}
