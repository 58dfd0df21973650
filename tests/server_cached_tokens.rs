//! End-to-end tests of `usage.prompt_tokens_details.cached_tokens` (chat, completions) and
//! `usage.input_tokens_details.cached_tokens` (Responses API): the real binary, SmolLM2 on the
//! CPU, HTTP on loopback.
//!
//! The expected counts follow from the prefix cache's rule alone, not from the server: a
//! prompt of `p` tokens whose every full block is cached reuses the whole blocks before its
//! last token, `(p - 1) / B` of them for blocks of `B` tokens (the last token is always
//! computed, so that a token can be sampled: vLLM's rule), and a prompt computed for the first
//! time reuses none.

mod common;

use common::{stream_chunks, Server};
use serde_json::{json, Value};

/// Tokens per KV block of the servers below.
const BLOCK: u64 = 16;

/// Prompt tokens a prompt of `prompt` tokens, all of whose full blocks are cached, reuses.
fn reusable(prompt: u64) -> u64 {
    (prompt - 1) / BLOCK * BLOCK
}

fn server(name: &str, prefix_caching: bool) -> Server {
    Server::start(
        name,
        &format!(
            "cache:\n  block_size: {BLOCK}\n  prefix_caching: {prefix_caching}\nscheduler:\n  max_num_seqs: 16\n  max_num_batched_tokens: 1024\n"
        ),
    )
}

/// `usage`'s prompt tokens and cached prompt tokens.
fn counts(usage: &Value) -> (u64, u64) {
    (
        usage["prompt_tokens"].as_u64().expect("prompt_tokens"),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("prompt_tokens_details.cached_tokens"),
    )
}

fn completion(s: &Server, prompt: Value, extra: Value) -> Value {
    let mut body = json!({"model": s.model_id(), "prompt": prompt, "max_tokens": 2,
        "temperature": 0});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// Completions on token-id prompts (their length is exact): the first request computes its
/// prompt, the same prompt again reuses its whole blocks but the last one, a longer prompt
/// extending it reuses every block of it; streamed usage says what the response's says; `n`
/// counts a prompt once and several prompts add up, as `prompt_tokens`; the counter
/// `prompt_tokens_cached_total` grew by what the responses reported.
#[test]
fn completions_report_the_prompt_tokens_the_prefix_cache_served() {
    let s = &server("cached-completions", true);
    let p96: Vec<u32> = (1000..1096).collect();
    let p100: Vec<u32> = (1000..1100).collect();
    let mut reported = 0;

    let first = s.post_ok("/v1/completions", &completion(s, json!(p96), json!({})));
    assert_eq!(counts(&first["usage"]), (96, 0), "{first}");
    let second = s.post_ok("/v1/completions", &completion(s, json!(p96), json!({})));
    // 96 tokens, 6 full blocks: the 6th holds the last token, so 5 are reused.
    assert_eq!(reusable(96), 80);
    assert_eq!(counts(&second["usage"]), (96, 80), "{second}");
    reported += 80;
    // The cached tokens are part of prompt_tokens, not added to the total.
    assert_eq!(
        second["usage"]["total_tokens"].as_u64(),
        Some(96 + second["usage"]["completion_tokens"].as_u64().unwrap()),
        "{second}"
    );
    // async-openai reads it.
    let typed: async_openai::types::completions::CreateCompletionResponse =
        serde_json::from_value(second.clone()).expect("an OpenAI completion");
    let details = typed.usage.and_then(|u| u.prompt_tokens_details);
    assert_eq!(details.and_then(|d| d.cached_tokens), Some(80));

    // 100 tokens extending the 96: all 6 blocks of the 96 are reused.
    let longer = s.post_ok("/v1/completions", &completion(s, json!(p100), json!({})));
    assert_eq!(counts(&longer["usage"]), (100, reusable(100)), "{longer}");
    assert_eq!(reusable(100), 96);
    reported += 96;

    // Streamed (include_usage and continuous_usage_stats) as non-streamed.
    let options = json!({"include_usage": true, "continuous_usage_stats": true});
    let chunks = stream_chunks(
        s,
        "/v1/completions",
        &completion(
            s,
            json!(p100),
            json!({"stream": true, "stream_options": options}),
        ),
    );
    let (last, rest) = chunks.split_last().expect("chunks");
    assert!(!rest.is_empty());
    for c in rest {
        // Every chunk of the choice's tokens carries the cached prompt tokens it was served.
        assert_eq!(counts(&c["usage"]), (100, 96), "{c}");
    }
    assert_eq!(counts(&last["usage"]), (100, 96), "{last}");
    reported += 96;
    let plain = s.post_ok("/v1/completions", &completion(s, json!(p100), json!({})));
    assert_eq!(counts(&plain["usage"]), counts(&last["usage"]), "{plain}");
    reported += 96;

    // n = 2 shares one prompt: counted once, as prompt_tokens.
    let two = s.post_ok(
        "/v1/completions",
        &completion(
            s,
            json!(p96),
            json!({"n": 2, "temperature": 1.0, "seed": 3}),
        ),
    );
    assert_eq!(counts(&two["usage"]), (96, 80), "{two}");
    reported += 80;
    // Two prompts add up.
    let both = s.post_ok(
        "/v1/completions",
        &completion(s, json!([p96, p100]), json!({})),
    );
    assert_eq!(counts(&both["usage"]), (96 + 100, 80 + 96), "{both}");
    reported += 80 + 96;

    // Every response's cached tokens, counted once each.
    assert_eq!(
        s.metric("switchyard:prompt_tokens_cached_total"),
        Some(reported as f64)
    );
}

/// Without prefix caching nothing is served from a cache: 0, always sent.
#[test]
fn without_prefix_caching_nothing_is_reported_cached() {
    let s = &server("cached-off", false);
    let p96: Vec<u32> = (1000..1096).collect();
    for _ in 0..2 {
        let v = s.post_ok("/v1/completions", &completion(s, json!(p96), json!({})));
        assert_eq!(counts(&v["usage"]), (96, 0), "{v}");
    }
    let chat = json!({"model": s.model_id(), "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello there"}]});
    for _ in 0..2 {
        let v = s.post_ok("/v1/chat/completions", &chat);
        assert_eq!(counts(&v["usage"]).1, 0, "{v}");
    }
    assert_eq!(s.metric("switchyard:prompt_tokens_cached_total"), Some(0.0));
}

/// Chat and the Responses API: the same long conversation twice reports the reused blocks the
/// second time, streamed as non-streamed, and async-openai reads both shapes.
#[test]
fn chat_and_responses_report_cached_prompt_tokens() {
    let s = &server("cached-chat", true);
    let text = "The quick brown fox jumps over the lazy dog near the quiet river bank. ".repeat(8);
    let chat = json!({"model": s.model_id(), "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": text}]});
    let first = s.post_ok("/v1/chat/completions", &chat);
    let (p, cached) = counts(&first["usage"]);
    assert!(p > 4 * BLOCK, "a prompt of several blocks: {first}");
    assert_eq!(cached, 0, "{first}");
    let second = s.post_ok("/v1/chat/completions", &chat);
    assert_eq!(counts(&second["usage"]), (p, reusable(p)), "{second}");
    let typed: async_openai::types::chat::CreateChatCompletionResponse =
        serde_json::from_value(second.clone()).expect("an OpenAI chat completion");
    let details = typed.usage.and_then(|u| u.prompt_tokens_details);
    assert_eq!(
        details.and_then(|d| d.cached_tokens),
        Some(reusable(p) as u32)
    );
    // Streamed with include_usage: the usage chunk says the same.
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = stream_chunks(s, "/v1/chat/completions", &streamed);
    let last = chunks.last().expect("the usage chunk");
    assert_eq!(counts(&last["usage"]), counts(&second["usage"]), "{last}");

    // The Responses API: a conversation of its own, twice.
    let body = json!({"model": s.model_id(), "max_output_tokens": 2, "temperature": 0,
        "input": format!("Summarise: {text}")});
    let input = |v: &Value| {
        (
            v["usage"]["input_tokens"].as_u64().expect("input_tokens"),
            v["usage"]["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("input_tokens_details.cached_tokens"),
        )
    };
    let first = s.post_ok("/v1/responses", &body);
    let (p, _) = input(&first);
    assert!(p > 4 * BLOCK, "{first}");
    let second = s.post_ok("/v1/responses", &body);
    assert_eq!(input(&second), (p, reusable(p)), "{second}");
    let typed: async_openai::types::responses::Response =
        serde_json::from_value(second.clone()).expect("an OpenAI response");
    assert_eq!(
        typed.usage.map(|u| u.input_tokens_details.cached_tokens),
        Some(reusable(p) as u32)
    );
    // Streamed: the closing event (`response.incomplete` at `max_output_tokens`) carries the
    // same usage.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = s
        .request("POST", "/v1/responses", Some(&streamed.to_string()), &[])
        .expect("stream");
    assert_eq!(r.status, 200, "{}", r.body);
    let completed: Value = r
        .body
        .split_terminator("\n\n")
        .filter_map(|frame| frame.split_once("data: "))
        .filter_map(|(_, data)| serde_json::from_str::<Value>(data).ok())
        .find(|e| e["type"] == "response.completed" || e["type"] == "response.incomplete")
        .expect("the closing event");
    assert_eq!(
        input(&completed["response"]),
        (p, reusable(p)),
        "{completed}"
    );
}
