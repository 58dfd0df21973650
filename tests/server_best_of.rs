//! Completions' `best_of` and vLLM's `truncate_prompt_tokens` end to end: the real binary,
//! SmolLM2 on the CPU (a context of 64 tokens), HTTP on loopback.
//!
//! `best_of`: a request of `n` 4 with a seed generates the same four samples as a request of
//! `best_of` 4 with that seed (choice `i` samples with `seed + i`), so the second's two choices
//! must be the first's two of the highest mean logprob per token, best first, which is checked
//! from the logprobs the first returns. `truncate_prompt_tokens`: a prompt longer than the
//! context is served on its last k tokens, exactly as the prompt of those k tokens is.

mod common;

use common::{choice_texts, Server};
use serde_json::{json, Value};

fn server(name: &str) -> Server {
    Server::start_full(name, "  max_model_len: 64\n", "", "")
}

/// A choice's mean logprob per generated token, from its returned `token_logprobs`.
fn per_token(choice: &Value) -> f64 {
    let lps = choice["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs: {choice}"));
    let sum: f64 = lps.iter().map(|x| x.as_f64().unwrap()).sum();
    if lps.is_empty() {
        f64::NEG_INFINITY
    } else {
        sum / lps.len() as f64
    }
}

/// The positions of the `n` best of `scores`, best first, ties in order (computed here on its
/// own, not with the server's code).
fn top(scores: &[f64], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap());
    order.truncate(n);
    order
}

#[test]
fn best_of_returns_the_best_candidates_by_logprob_per_token() {
    let s = server("best-of");
    let sampled = |seed: u64, extra: Value| {
        let mut body = json!({"prompt": "Once upon a time, in a small village,", "max_tokens": 8,
            "temperature": 1.0, "seed": seed});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s.post_ok("/v1/completions", &body)
    };
    // A seed whose four samples' best two are not the first two in order: a server that
    // returned candidates in generation order would fail below.
    let (seed, all, best) = (1..40)
        .find_map(|seed| {
            let all = sampled(seed, json!({"n": 4, "logprobs": 0}));
            let scores: Vec<f64> = all["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(per_token)
                .collect();
            let best = top(&scores, 2);
            (best != [0, 1] && scores[best[0]] > scores[best[1]]).then_some((seed, all, best))
        })
        .expect("a seed whose best two samples are not the first two");
    let candidates = all["choices"].as_array().unwrap();
    let all_texts = choice_texts(&all);

    let ranked = sampled(seed, json!({"n": 2, "best_of": 4, "logprobs": 0}));
    let choices = ranked["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{ranked}");
    assert_eq!(
        choice_texts(&ranked),
        best.iter()
            .map(|&i| all_texts[i].clone())
            .collect::<Vec<_>>(),
        "best of {all}\nreturned {ranked}"
    );
    // Best first, and no candidate left out scores higher than one returned.
    let returned: Vec<f64> = choices.iter().map(per_token).collect();
    assert!(returned[0] >= returned[1], "{returned:?}");
    for (i, c) in candidates.iter().enumerate() {
        if !best.contains(&i) {
            assert!(per_token(c) <= returned[1] + 1e-6, "{all}\n{ranked}");
        }
    }
    // Usage counts all four candidates, as OpenAI bills them.
    assert_eq!(
        ranked["usage"]["completion_tokens"], all["usage"]["completion_tokens"],
        "{ranked}"
    );

    // Without logprobs asked, the same choices come without them, and each candidate counts as
    // a request in the metrics, as each choice of n > 1 does.
    let success = s.metric("switchyard:request_success_total").unwrap_or(0.0);
    let plain = sampled(seed, json!({"n": 2, "best_of": 4}));
    assert_eq!(choice_texts(&plain), choice_texts(&ranked), "{plain}");
    for c in plain["choices"].as_array().unwrap() {
        assert!(c["logprobs"].is_null(), "{plain}");
    }
    assert_eq!(
        s.metric("switchyard:request_success_total").unwrap() - success,
        4.0
    );
}

#[test]
fn best_of_refusals_name_the_field() {
    let s = server("best-of-refusals");
    for body in [
        json!({"prompt": "Hi", "n": 3, "best_of": 2}),
        json!({"prompt": "Hi", "best_of": 17}),
        json!({"prompt": "Hi", "best_of": 3, "stream": true}),
        json!({"prompt": "Hi", "best_of": 3, "use_beam_search": true}),
    ] {
        let (status, v) = s.post_json("/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], "best_of", "{body}: {v}");
    }
}

#[test]
fn truncate_prompt_tokens_serves_a_prompt_longer_than_the_context() {
    let s = server("truncate");
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(12);
    let (status, tok) = s.post_json("/tokenize", &json!({"prompt": text}));
    assert_eq!(status, 200, "{tok}");
    let ids: Vec<u64> = tok["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert!(ids.len() > 64, "{} tokens", ids.len());
    let last = |k: usize| ids[ids.len() - k..].to_vec();

    // Refused without the field.
    let (status, v) = s.post_json("/v1/completions", &json!({"prompt": text, "max_tokens": 4}));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");

    // Served on the last 10 tokens, text or ids, as the prompt of those 10 tokens is.
    let greedy = |prompt: Value, truncate: Value| {
        s.post_ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                    "truncate_prompt_tokens": truncate}),
        )
    };
    let reference = greedy(json!(last(10)), Value::Null);
    for prompt in [json!(text), json!(ids)] {
        let v = greedy(prompt, json!(10));
        assert_eq!(v["usage"]["prompt_tokens"], 10, "{v}");
        assert_eq!(
            choice_texts(&v),
            choice_texts(&reference),
            "{v}\n{reference}"
        );
    }
    // -1: as many as the context takes, leaving one token for the answer.
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": -1}),
    );
    assert_eq!(v["usage"]["prompt_tokens"], 63, "{v}");

    // Chat: the rendered conversation is cut.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2,
                "truncate_prompt_tokens": 12}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 12, "{v}");

    // Embeddings: the vector of the last 10 tokens.
    let (status, cut) = s.post_json(
        "/v1/embeddings",
        &json!({"input": text, "truncate_prompt_tokens": 10}),
    );
    assert_eq!(status, 200, "{cut}");
    assert_eq!(cut["usage"]["prompt_tokens"], 10, "{cut}");
    let (_, whole) = s.post_json("/v1/embeddings", &json!({"input": last(10)}));
    let a = cut["data"][0]["embedding"].as_array().unwrap();
    let b = whole["data"][0]["embedding"].as_array().unwrap();
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x.as_f64().unwrap() - y.as_f64().unwrap()).abs() < 1e-5,
            "{x} {y}"
        );
    }

    // Bounded: 0 and more than the context are refused naming the field.
    for k in [0, 65] {
        let (status, v) = s.post_json(
            "/v1/completions",
            &json!({"prompt": "Hi", "truncate_prompt_tokens": k}),
        );
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "truncate_prompt_tokens", "{v}");
    }
}
