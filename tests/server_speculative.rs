//! End-to-end tests of speculative decoding: the real binary, SmolLM2 on the CPU, HTTP on
//! loopback. A server with `speculative:` must answer exactly as one without it (greedy and
//! seeded sampling, logprobs, streaming, structured output, bad words), while its metrics show drafts
//! proposed and accepted.

mod common;

use common::{sse_events, Server};
use serde_json::{json, Value};

const SPECULATIVE: &str =
    "speculative:\n  num_speculative_tokens: 4\n  prompt_lookup_min: 2\n  prompt_lookup_max: 4\n";

/// Requests whose answers repeat their prompts (prompt lookup finds drafts) and one that
/// does not.
fn requests() -> Vec<(&'static str, Value)> {
    let text = "The river runs through the old town, past the mill and the stone bridge, and on to the sea.";
    let code = "def average(values):\n    total = 0\n    for value in values:\n        total = total + value\n    return total / len(values)";
    vec![
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": format!("Repeat the following text exactly:\n{text}")}],
                   "max_tokens": 48, "temperature": 0}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": format!("Rename the function `average` to `mean` and return the whole code:\n{code}")}],
                   "max_tokens": 64, "temperature": 0.8, "seed": 5, "logprobs": true, "top_logprobs": 2}),
        ),
        (
            "/v1/completions",
            json!({"prompt": format!("{code}\n\n{code}"), "max_tokens": 40, "temperature": 0,
                   "frequency_penalty": 0.3, "n": 2, "seed": 3}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12", "max_tokens": 24, "temperature": 0,
                   "structured_outputs": {"regex": "( [0-9]+)+"}}),
        ),
        // Bad words the drafts (the prompt's own words) propose: rejected drafts are taken
        // back from each choice's bad-words state.
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": format!("Repeat the following text exactly:\n{text}")}],
                   "max_tokens": 48, "temperature": 0, "n": 2, "bad_words": ["stone", "mill and"]}),
        ),
    ]
}

/// The parts of an answer that must not depend on speculation.
fn answer(v: &Value) -> Value {
    let choices: Vec<Value> = v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| {
            json!({
                "text": c.get("text").cloned().unwrap_or_else(|| c["message"]["content"].clone()),
                "finish_reason": c["finish_reason"],
                "logprobs": c["logprobs"],
            })
        })
        .collect();
    // The prompt tokens the prefix cache served depend on the requests before, not on
    // speculation.
    let mut usage = v["usage"].clone();
    if let Some(u) = usage.as_object_mut() {
        u.remove("prompt_tokens_details");
    }
    json!({"choices": choices, "usage": usage})
}

#[test]
fn speculative_answers_equal_plain_ones_and_drafts_are_accepted() {
    let plain = Server::start("spec-plain", "");
    let spec = Server::start("spec-on", SPECULATIVE);
    for (path, body) in requests() {
        let a = answer(&plain.post_ok(path, &body));
        let b = answer(&spec.post_ok(path, &body));
        assert_eq!(a, b, "{path} {body}");
    }
    // Streaming through the speculative server: the same text, token by token.
    let (path, body) = &requests()[0];
    let whole = answer(&spec.post_ok(path, body))["choices"][0]["text"].clone();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = spec
        .request("POST", path, Some(&streamed.to_string()), &[])
        .expect("stream");
    assert_eq!(r.status, 200);
    let mut text = String::new();
    for e in sse_events(&r.body) {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).expect("event");
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    assert_eq!(Value::String(text), whole);
    let drafted = spec
        .metric("switchyard:spec_decode_num_draft_tokens_total")
        .unwrap_or(0.0);
    let accepted = spec
        .metric("switchyard:spec_decode_num_accepted_tokens_total")
        .unwrap_or(0.0);
    assert!(
        accepted > 0.0 && accepted <= drafted,
        "{accepted} of {drafted}"
    );
    // Without speculative decoding nothing is drafted (the counter is listed, at zero).
    assert_eq!(
        plain.metric("switchyard:spec_decode_num_draft_tokens_total"),
        Some(0.0)
    );
}

/// Speculative decoding turned on, changed and off through the admin API while the server
/// runs; bad settings are refused and change nothing.
#[test]
fn speculative_decoding_is_set_through_the_admin_api() {
    let s = Server::start_with("spec-admin", "  admin_key: admin-secret-key\n", "");
    let admin = [("Authorization", "Bearer admin-secret-key")];
    let call = |method: &str, body: Option<&str>| {
        let r = s
            .request(method, "/admin/speculative", body, &admin)
            .expect("admin call");
        let v: Value = serde_json::from_str(&r.body).unwrap_or(Value::Null);
        (r.status, v)
    };
    let drafted = || {
        s.metric("switchyard:spec_decode_num_draft_tokens_total")
            .unwrap_or(0.0)
    };
    let (path, body) = &requests()[0];
    let before = answer(&s.post_ok(path, body));
    assert_eq!(call("GET", None), (200, Value::Null));
    assert_eq!(drafted(), 0.0);
    // On.
    // The configuration's section as JSON, `method` included.
    let (status, v) = call(
        "PUT",
        Some(r#"{"method": "ngram", "num_speculative_tokens": 3, "max_running": 8}"#),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["method"], "ngram");
    assert_eq!(v["num_speculative_tokens"], 3);
    assert_eq!(v["prompt_lookup_min"], 2);
    assert_eq!(call("GET", None).1, v);
    assert_eq!(answer(&s.post_ok(path, body)), before);
    let after_on = drafted();
    assert!(after_on > 0.0);
    // Refused: out of range, unknown field; nothing changes.
    for (bad, param) in [
        (r#"{"num_speculative_tokens": 0}"#, "num_speculative_tokens"),
        (
            r#"{"num_speculative_tokens": 4, "prompt_lookup_min": 9}"#,
            "prompt_lookup_min",
        ),
        (
            r#"{"num_speculative_tokens": 4, "method": "eagle"}"#,
            "method",
        ),
    ] {
        let (status, e) = call("PUT", Some(bad));
        assert_eq!(status, 400, "{bad}: {e}");
        assert_eq!(e["error"]["param"], param, "{bad}: {e}");
    }
    assert_eq!(call("GET", None).1, v);
    // Without the admin key: refused.
    let r = s
        .request("PUT", "/admin/speculative", Some("null"), &[])
        .expect("call");
    assert_eq!(r.status, 401);
    // Off.
    assert_eq!(call("PUT", Some("null")), (200, Value::Null));
    assert_eq!(answer(&s.post_ok(path, body)), before);
    assert_eq!(drafted(), after_on);
}
