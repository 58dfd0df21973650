//! End-to-end tests of vLLM's `allowed_token_ids`, `bad_words` and
//! `return_tokens_as_token_ids`: the real binary, SmolLM2 on the CPU, HTTP on loopback. Token
//! ids are read back through `return_tokens_as_token_ids` and checked against `/tokenize`.

mod common;

use common::Server;
use serde_json::{json, Value};

const PROMPT: &str = "The capital of France is";

fn server() -> Server {
    Server::start(
        "sampling",
        "scheduler:\n  max_num_seqs: 16\n  max_num_batched_tokens: 1024\n",
    )
}

/// The id of a `token_id:{id}` string.
fn id_of(token: &str) -> u64 {
    token
        .strip_prefix("token_id:")
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("{token:?} is not token_id:{{id}}"))
}

/// A completion's token ids, read from its logprobs' `token_id:{id}` strings.
fn completion_ids(v: &Value, choice: usize) -> Vec<u64> {
    v["choices"][choice]["logprobs"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no tokens: {v}"))
        .iter()
        .map(|t| id_of(t.as_str().expect("a string")))
        .collect()
}

fn tokenize(server: &Server, text: &str) -> Vec<u64> {
    let v = server.post_ok(
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    );
    v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("an id"))
        .collect()
}

fn find(haystack: &[u64], needle: &[u64]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn error_param(server: &Server, path: &str, body: Value) -> String {
    let (status, v) = server.post_json(path, &body);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    v["error"]["param"].as_str().unwrap_or("").to_string()
}

/// Every sampled token, of every choice, on both endpoints, is one of `allowed_token_ids`;
/// the end of sequence is not added (the answers run to `max_tokens`), and logprobs stay
/// those of the raw distribution (the greedy token, not allowed, is still the top one).
#[test]
fn allowed_token_ids_bound_every_sampled_token() {
    let s = server();
    let greedy = s.post_ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1,
               "return_tokens_as_token_ids": true}),
    );
    let top = completion_ids(&greedy, 0)[0];
    let allowed = tokenize(&s, " the big red cat sat on a mat and");
    assert!(!allowed.contains(&top), "{allowed:?} holds {top}");
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 2,
               "logprobs": 1, "return_tokens_as_token_ids": true,
               "allowed_token_ids": allowed}),
    );
    for choice in 0..2 {
        let ids = completion_ids(&v, choice);
        assert_eq!(ids.len(), 12, "{v}");
        assert!(
            ids.iter().all(|t| allowed.contains(t)),
            "{ids:?} vs {allowed:?}"
        );
        assert_eq!(v["choices"][choice]["finish_reason"], "length", "{v}");
    }
    // The first position's alternatives are the raw distribution's: the greedy token leads.
    let first = v["choices"][0]["logprobs"]["top_logprobs"][0]
        .as_object()
        .expect("top_logprobs");
    assert!(first.contains_key(&format!("token_id:{top}")), "{v}");

    // Chat, greedy, streamed.
    let events = s.post_stream(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
                "temperature": 0, "stream": true, "logprobs": true,
                "return_tokens_as_token_ids": true, "allowed_token_ids": allowed}),
    );
    let mut ids = Vec::new();
    for e in &events {
        let chunk: Value = serde_json::from_str(e).expect("a JSON chunk");
        for lp in chunk["choices"][0]["logprobs"]["content"]
            .as_array()
            .into_iter()
            .flatten()
        {
            ids.push(id_of(lp["token"].as_str().expect("token")));
        }
    }
    assert_eq!(ids.len(), 8, "{events:?}");
    assert!(ids.iter().all(|t| allowed.contains(t)), "{ids:?}");
}

/// A word of the greedy answer, banned, is no longer generated as its tokens (neither with
/// nor without its leading space), and the answer is the greedy one up to where the word's
/// last token was.
#[test]
fn bad_words_change_the_greedy_answer_where_the_word_was() {
    let s = server();
    let body = |extra: Value| {
        let mut b = json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                           "logprobs": 0, "return_tokens_as_token_ids": true});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let greedy = s.post_ok("/v1/completions", &body(json!({})));
    let text = greedy["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_owned();
    let g = completion_ids(&greedy, 0);
    // The first word of the answer whose spaced tokens are in the greedy tokens.
    let (word, spaced, at) = text
        .split(|c: char| !c.is_alphabetic())
        .filter(|w| w.len() > 2)
        .find_map(|w| {
            let ids = tokenize(&s, &format!(" {w}"));
            // Past the first token, so that the answers share a prefix.
            find(&g, &ids)
                .filter(|&at| at > 0)
                .map(|at| (w.to_owned(), ids, at))
        })
        .unwrap_or_else(|| panic!("no word of {text:?} found in {g:?}"));
    let plain = tokenize(&s, &word);
    let banned = s.post_ok("/v1/completions", &body(json!({"bad_words": [word]})));
    let b = completion_ids(&banned, 0);
    let last = at + spaced.len() - 1;
    assert_eq!(b[..last], g[..last], "{text:?} vs {banned}");
    assert_ne!(b[last], g[last], "{banned}");
    assert_eq!(find(&b, &spaced), None, "{word:?} {spaced:?} in {b:?}");
    assert_eq!(find(&b, &plain), None, "{word:?} {plain:?} in {b:?}");

    // The same on chat, n = 2 (each choice its own state), a leading space in the word.
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "max_tokens": 12, "temperature": 0, "n": 2, "logprobs": true,
                           "return_tokens_as_token_ids": true});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s.post_ok("/v1/chat/completions", &b)
    };
    let chat_ids = |v: &Value, i: usize| -> Vec<u64> {
        v["choices"][i]["logprobs"]["content"]
            .as_array()
            .expect("content")
            .iter()
            .map(|lp| id_of(lp["token"].as_str().expect("token")))
            .collect()
    };
    let free = chat(json!({}));
    let answer = free["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    let f = chat_ids(&free, 0);
    let word = answer
        .split(|c: char| !c.is_alphabetic())
        .filter(|w| w.len() > 2)
        .find(|w| {
            find(&f, &tokenize(&s, &format!(" {w}"))).is_some()
                || find(&f, &tokenize(&s, w)).is_some()
        })
        .unwrap_or_else(|| panic!("no word of {answer:?} found in {f:?}"))
        .to_owned();
    let v = chat(json!({"bad_words": [format!(" {word}")]}));
    for i in 0..2 {
        let ids = chat_ids(&v, i);
        assert_eq!(find(&ids, &tokenize(&s, &format!(" {word}"))), None, "{v}");
        assert_eq!(find(&ids, &tokenize(&s, &word)), None, "{v}");
    }
}

/// vLLM's shapes: completions' `tokens` and `top_logprobs` keys read `token_id:{id}`, their
/// `text_offset`s counting those strings; chat's `token`s and its alternatives' `bytes` (the
/// sampled token's bytes stay its own); streamed and not.
#[test]
fn return_tokens_as_token_ids_renders_every_token_string() {
    let s = server();
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2,
               "return_tokens_as_token_ids": true}),
    );
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), 4);
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    for (i, t) in tokens.iter().enumerate() {
        id_of(t);
        let keys = lp["top_logprobs"][i].as_object().expect("an object");
        assert!(keys.len() >= 2 && keys.contains_key(*t), "{v}");
        keys.keys().for_each(|k| {
            id_of(k);
        });
        if i > 0 {
            assert_eq!(
                offsets[i] - offsets[i - 1],
                tokens[i - 1].len() as u64,
                "{v}"
            );
        }
    }
    // Without the field, the token texts (the answer's first token is " Paris").
    let plain = s.post_ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2}),
    );
    let first = plain["choices"][0]["logprobs"]["tokens"][0]
        .as_str()
        .unwrap();
    assert!(!first.starts_with("token_id:"), "{plain}");
    assert_eq!(tokenize(&s, first), [id_of(tokens[0])], "{plain} vs {v}");

    // Chat, streamed: every token and alternative reads `token_id:{id}`; an alternative's
    // bytes are those of the string, the sampled token's its own (vLLM's `bytes` of the
    // decoded token): those the same request gets without the field.
    let chat = |token_ids: bool| {
        s.post_stream(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                    "temperature": 0, "stream": true, "logprobs": true, "top_logprobs": 2,
                    "return_tokens_as_token_ids": token_ids}),
        )
    };
    let bytes_of = |entry: &Value| -> Vec<u8> {
        entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect()
    };
    let sampled_bytes = |events: &[String], token_ids: bool| -> Vec<Vec<u8>> {
        let mut sampled = Vec::new();
        for e in events {
            let chunk: Value = serde_json::from_str(e).expect("a JSON chunk");
            for lp in chunk["choices"][0]["logprobs"]["content"]
                .as_array()
                .into_iter()
                .flatten()
            {
                if token_ids {
                    id_of(lp["token"].as_str().unwrap());
                    for top in lp["top_logprobs"].as_array().unwrap() {
                        let token = top["token"].as_str().unwrap();
                        id_of(token);
                        assert_eq!(bytes_of(top), token.as_bytes(), "{chunk}");
                    }
                }
                sampled.push(bytes_of(lp));
            }
        }
        sampled
    };
    let events = chat(true);
    let rendered = sampled_bytes(&events, true);
    assert_eq!(rendered.len(), 4, "{events:?}");
    assert_eq!(rendered, sampled_bytes(&chat(false), false), "{events:?}");
    // Not streamed, echo: the prompt's tokens too.
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 0,
               "echo": true, "return_tokens_as_token_ids": true}),
    );
    let ids = completion_ids(&v, 0);
    let prompt = tokenize(&s, PROMPT);
    assert_eq!(ids[..ids.len() - 1], prompt[..], "{v}");
}

/// Each bad value is a 400 naming its field.
#[test]
fn bad_values_are_refused_naming_the_field() {
    let s = server();
    let cases = [
        (json!({"allowed_token_ids": []}), "allowed_token_ids"),
        (
            json!({"allowed_token_ids": [1, 10_000_000]}),
            "allowed_token_ids",
        ),
        (json!({"bad_words": ["  "]}), "bad_words"),
        (json!({"bad_words": ["x".repeat(257)]}), "bad_words"),
        (
            json!({"bad_words": ["Paris"], "use_beam_search": true, "n": 2}),
            "bad_words",
        ),
        (
            json!({"allowed_token_ids": [1], "use_beam_search": true, "n": 2}),
            "allowed_token_ids",
        ),
    ];
    for (extra, param) in cases {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let mut body = if path == "/v1/completions" {
                json!({"prompt": PROMPT, "max_tokens": 2})
            } else {
                json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            };
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            assert_eq!(error_param(&s, path, body), param, "{extra} on {path}");
        }
    }
    // Not named in the ignored-fields warning.
    s.post_ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 1, "bad_words": ["x"],
               "allowed_token_ids": [1, 2], "return_tokens_as_token_ids": false}),
    );
    assert!(!s.log().contains("\"bad_words\""), "{}", s.log());
}

/// With structured output the grammar and the allowed ids must both allow a token: a choice
/// list under ids of its other choice's text gives that choice (the end of sequence, not in
/// the list, ends it all the same: where nothing is left in common, the end ids are). Only
/// the structured requests count as structured output.
#[test]
fn allowed_token_ids_narrow_a_structured_choice() {
    let s = server();
    let metric = "switchyard:structured_output_requests_total";
    let options = ["purple elephant", "green giraffe"];
    let body = |extra: Value| {
        let mut b = json!({"prompt": "My favourite animal is the", "max_tokens": 8,
                           "temperature": 0, "guided_choice": options});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let free = s.post_ok("/v1/completions", &body(json!({})));
    let pick = free["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_owned();
    let other = options
        .iter()
        .find(|o| **o != pick)
        .unwrap_or_else(|| panic!("{pick:?} is not a choice"));
    let v = s.post_ok(
        "/v1/completions",
        &body(json!({"allowed_token_ids": tokenize(&s, other)})),
    );
    assert_eq!(v["choices"][0]["text"], *other, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(s.metric(metric), Some(2.0));
    s.post_ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 2, "bad_words": ["Paris"],
               "allowed_token_ids": [1, 2, 3]}),
    );
    assert_eq!(s.metric(metric), Some(2.0));
}
