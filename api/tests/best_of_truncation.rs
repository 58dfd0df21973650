//! Completions' `best_of` and vLLM's `truncate_prompt_tokens` over the in-process app with the
//! echo engine (tests/common): its tokens are bytes, choice `i` repeats the prompt rotated left
//! by `i` characters, and every sampled token has logprob -0.5, so its candidates tie and keep
//! their generation order. The ranking itself is tested in the library
//! (`schema::best_of`) and through the real model in tests/server_best_of.rs.

mod common;

use common::*;
use serde_json::json;
use switchyard_api::engine::PromptInput;

const BAD: &str = "invalid_request_error";

/// `best_of` 4, `n` 2: the engine generates 4 candidates with their logprobs though none were
/// asked; the response holds 2 choices numbered 0 and 1, without logprobs, and its usage
/// counts all 4 candidates' tokens.
#[actix_web::test]
async fn best_of_generates_every_candidate_and_returns_n() {
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    let body = json!({"prompt": "abcdef", "n": 2, "best_of": 4, "max_tokens": 3});
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let request = engine.last_request();
    assert_eq!((request.n, request.logprobs), (4, Some(0)));
    let body = reply.json();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{body}");
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i, "{body}");
        assert!(choice["logprobs"].is_null(), "{body}");
    }
    // Equal scores keep generation order: candidates 0 ("abc") and 1 ("bcd").
    assert_eq!(choices[0]["text"], "abc");
    assert_eq!(choices[1]["text"], "bcd");
    assert_eq!(body["usage"]["completion_tokens"], 12, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 6, "{body}");

    // Asked for, the logprobs stay, as many top alternatives as asked.
    let body = json!({"prompt": ["abcdef", "uvwxyz"], "best_of": 3, "max_tokens": 2,
        "logprobs": 1});
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(engine.last_request().logprobs, Some(1));
    let body = reply.json();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{body}");
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[0]["text"], "ab");
    assert_eq!(choices[1]["index"], 1);
    assert_eq!(choices[1]["text"], "uv");
    assert_eq!(
        choices[1]["logprobs"]["token_logprobs"],
        json!([-0.5, -0.5])
    );
    assert_eq!(body["usage"]["completion_tokens"], 12, "{body}");
}

#[actix_web::test]
async fn best_of_refusals_name_it() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    for body in [
        json!({"prompt": "a", "n": 3, "best_of": 2}),
        json!({"prompt": "a", "best_of": 17}),
        json!({"prompt": "a", "best_of": 2, "stream": true}),
        json!({"prompt": "a", "best_of": 2, "use_beam_search": true}),
    ] {
        let reply = send(&app, post("/v1/completions", &body)).await;
        reply.assert_error(400, BAD, Some("best_of"));
    }
    // best_of equal to n streams as n does.
    let body = json!({"prompt": "a", "n": 2, "best_of": 2, "stream": true, "max_tokens": 1});
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// A prompt longer than the context (64 tokens, bytes here) is refused; with
/// `truncate_prompt_tokens` it is cut to its last k tokens before the engine sees it, and
/// `usage.prompt_tokens` counts the kept ones: text and token prompts on completions, the
/// rendered conversation on chat, and embedding inputs.
#[actix_web::test]
async fn truncate_prompt_tokens_keeps_the_end_of_a_long_prompt() {
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    let long = "x".repeat(90) + "tail";
    let refused = json!({"prompt": long, "max_tokens": 1});
    let reply = send(&app, post("/v1/completions", &refused)).await;
    assert_eq!(reply.status, 400, "{}", reply.text());

    let cases = [
        ("/v1/completions", json!({"prompt": long, "max_tokens": 1})),
        (
            "/v1/completions",
            json!({"prompt": long.bytes().map(u32::from).collect::<Vec<_>>(), "max_tokens": 1}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": long}], "max_tokens": 1}),
        ),
        ("/v1/embeddings", json!({"input": long})),
    ];
    for (path, mut body) in cases {
        body["truncate_prompt_tokens"] = json!(6);
        let reply = send(&app, post(path, &body)).await;
        assert_eq!(reply.status, 200, "{path} {body}: {}", reply.text());
        let kept = match engine.last_request().prompt {
            PromptInput::Tokens(ids) => String::from_utf8(ids.iter().map(|&t| t as u8).collect()),
            other => panic!("{path}: {other:?}"),
        }
        .unwrap();
        // The echo engine renders a chat as `role: content` lines, then `assistant:`.
        let rendered = format!("user: {long}\nassistant:");
        let whole = if path.contains("chat") {
            &rendered
        } else {
            &long
        };
        let want = &whole[whole.len() - 6..];
        assert_eq!(kept, want, "{path}");
        assert_eq!(reply.json()["usage"]["prompt_tokens"], 6, "{path}");
    }

    // -1 keeps what the context takes with room for one token: 63 of 64.
    let body = json!({"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": -1});
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["usage"]["prompt_tokens"], 63);

    // A short prompt is left as it is; `echo` shows a cut prompt's kept tokens.
    let body = json!({"prompt": "abc", "max_tokens": 1, "truncate_prompt_tokens": 6});
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.json()["usage"]["prompt_tokens"], 3);
    assert_eq!(
        engine.last_request().prompt,
        PromptInput::Text("abc".into())
    );
    let body = json!({"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": 6,
        "echo": true});
    let reply = send(&app, post("/v1/completions", &body)).await;
    let text = reply.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(text.starts_with("xxtail"), "{text}");

    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "a", "truncate_prompt_tokens": 65}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "truncate_prompt_tokens": 0}),
        ),
        (
            "/v1/embeddings",
            json!({"input": "a", "truncate_prompt_tokens": -2}),
        ),
    ] {
        let reply = send(&app, post(path, &body)).await;
        reply.assert_error(400, BAD, Some("truncate_prompt_tokens"));
    }
}
