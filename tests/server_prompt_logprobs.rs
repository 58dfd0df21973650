//! vLLM's `prompt_logprobs` end to end: the real binary, SmolLM2 (Q4_1 GGUF) on the CPU, HTTP on
//! loopback. The numbers are checked against transformers' teacher-forced logprobs of the same
//! model (the fixture `gpu/tests/fixtures/smollm2_golden.json`, float32: within the tolerance
//! the other golden tests use) and against `echo` with `logprobs` on the same prompt (equal);
//! the shape is vLLM's: per choice on completions (each its own prompt's, every one of `n`), at
//! the response's top level on chat, refused with alternatives when streamed.

mod common;

use common::{golden, Server};
use serde_json::{json, Map, Value};

fn server(name: &str) -> Server {
    Server::start(name, "")
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("token ids")
        .iter()
        .map(|t| t.as_u64().expect("a token id"))
        .collect()
}

/// The entries of one position of a `prompt_logprobs` list, in the response's order:
/// (token id, logprob, rank, decoded token).
fn entries(position: &Value) -> Vec<(u64, f64, u64, String)> {
    let map: &Map<String, Value> = position.as_object().expect("an object per position");
    map.iter()
        .map(|(id, e)| {
            (
                id.parse().expect("keys are token ids"),
                e["logprob"].as_f64().expect("logprob"),
                e["rank"].as_u64().expect("rank"),
                e["decoded_token"]
                    .as_str()
                    .expect("decoded_token")
                    .to_owned(),
            )
        })
        .collect()
}

/// Checks a `prompt_logprobs` list against its prompt, `k` alternatives asked: null first;
/// then the prompt's token first, the top `k` after it best first with ranks 1..=k, the
/// prompt's token among them only once (so `k` or `k + 1` entries), its rank that of its place
/// among them, else past them.
fn check_shape(list: &Value, prompt: &[u64], k: usize) {
    let list = list.as_array().expect("a prompt_logprobs list");
    assert_eq!(list.len(), prompt.len(), "one per prompt token");
    assert!(list[0].is_null(), "the first token has no context");
    for (p, position) in list.iter().enumerate().skip(1) {
        let e = entries(position);
        assert_eq!(
            e[0].0, prompt[p],
            "position {p}: the prompt's token first: {e:?}"
        );
        let top: Vec<_> = match e.len() {
            n if n == k + 1 => e[1..].to_vec(),
            n if n == k => {
                // Among the top k: its entry is in its place among them, by its rank.
                let mut top = e[1..].to_vec();
                let at = e[0].2 as usize - 1;
                assert!(at < k, "position {p}: {e:?}");
                top.insert(at, e[0].clone());
                top
            }
            _ => panic!("position {p}: {k} alternatives asked: {e:?}"),
        };
        for (i, t) in top.iter().enumerate() {
            assert_eq!(t.2, i as u64 + 1, "position {p}: ranks 1..=k: {e:?}");
            if i > 0 {
                assert!(t.1 <= top[i - 1].1, "position {p}: best first: {e:?}");
            }
        }
        if e.len() == k + 1 {
            assert!(e[0].2 > k as u64, "position {p}: outside the top k: {e:?}");
            assert!(top.last().is_none_or(|t| t.1 >= e[0].1), "{e:?}");
        }
    }
}

/// The prompt's own token's logprob at each position past the first.
fn own_logprobs(list: &Value) -> Vec<f64> {
    list.as_array()
        .expect("list")
        .iter()
        .skip(1)
        .map(|position| entries(position)[0].1)
        .collect()
}

/// `echo` with `logprobs` on the same token ids: the prompt tokens' logprobs (past the first).
fn echoed_logprobs(s: &Server, prompt: &[u64], k: usize) -> Vec<f64> {
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": true,
                "logprobs": k}),
    );
    let lps = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .expect("token_logprobs");
    lps[1..prompt.len()]
        .iter()
        .map(|l| l.as_f64().expect("a logprob"))
        .collect()
}

/// The prompt and the first 8 tokens transformers generated from it, as one prompt: the
/// logprob and rank of each of those 8 positions are the fixture's teacher-forced ones (its
/// top 4 there, with their ranks, where the Q4_1 model's order cannot differ: neighbours more
/// than 0.2 nats apart). The same prompt with `echo` and `logprobs` gives the same numbers.
#[test]
fn prompt_logprobs_match_the_reference_teacher_forced_and_echo() {
    let s = server("plp-golden");
    let g = golden("raw-alphabet");
    let prompt_len = g["prompt_ids"].as_array().unwrap().len();
    let generated = 8;
    let mut prompt = ids(&g["prompt_ids"]);
    prompt.extend(&ids(&g["tokens"])[..generated]);
    let k = 5;
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": k}),
    );
    let list = &v["choices"][0]["prompt_logprobs"];
    check_shape(list, &prompt, k);
    let ours = own_logprobs(list);
    assert_eq!(ours, echoed_logprobs(&s, &prompt, 2), "echo's numbers");
    let mut ranks_checked = 0;
    for i in 0..generated {
        let p = prompt_len + i;
        let step = &g["steps"][i];
        let reference = step["logprob"].as_f64().unwrap();
        let got = entries(&list[p]);
        assert!(
            (got[0].1 - reference).abs() < 0.1,
            "position {p}: {} vs reference {reference}",
            got[0].1
        );
        let top5: Vec<(u64, f64)> = step["top5"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (t[0].as_u64().unwrap(), t[1].as_f64().unwrap()))
            .collect();
        // Less likely tokens are further off under Q4_1 (0.1 nats at -5): 0.2 for them.
        for (r, &(id, lp)) in top5.iter().enumerate() {
            // The fifth's next neighbour is not in the fixture: only the first four qualify.
            let apart = |j: Option<usize>| {
                j.and_then(|j| top5.get(j))
                    .is_none_or(|n| (n.1 - lp).abs() > 0.2)
            };
            if r + 1 == top5.len() || !(apart(r.checked_sub(1)) && apart(Some(r + 1))) {
                continue;
            }
            let (_, ours, rank, _) = got
                .iter()
                .find(|e| e.0 == id)
                .unwrap_or_else(|| panic!("position {p}: token {id} of the top 5: {got:?}"));
            assert!(
                (ours - lp).abs() < 0.2,
                "position {p}, token {id}: {ours} vs {lp}"
            );
            assert_eq!(*rank, r as u64 + 1, "position {p}, token {id}: {got:?}");
            ranks_checked += 1;
        }
    }
    assert!(ranks_checked >= generated, "{ranks_checked} ranks compared");
}

/// Two token prompts, `n` 2: each choice carries its own prompt's list, every one of its
/// prompt's choices the same list; a prompt whose blocks the prefix cache holds is still
/// scored whole (the request computes every position).
#[test]
fn each_choice_carries_its_own_prompts_logprobs() {
    let s = server("plp-choices");
    let a = ids(&golden("raw-count")["prompt_ids"]);
    let long = ids(&golden("raw-long-text")["prompt_ids"]);
    // Cache the long prompt's blocks first.
    for _ in 0..2 {
        s.post_ok("/v1/completions", &json!({"prompt": long, "max_tokens": 1}));
    }
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": [a, long], "n": 2, "max_tokens": 2, "temperature": 0.8, "seed": 1,
                "prompt_logprobs": 1}),
    );
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4);
    for (i, prompt) in [(0, &a), (1, &a), (2, &long), (3, &long)] {
        check_shape(&choices[i]["prompt_logprobs"], prompt, 1);
    }
    assert_eq!(choices[0]["prompt_logprobs"], choices[1]["prompt_logprobs"]);
    assert_eq!(choices[2]["prompt_logprobs"], choices[3]["prompt_logprobs"]);
    // The same numbers as each prompt alone (batched with others or not: within 1e-4).
    for (prompt, choice) in [(&a, &choices[0]), (&long, &choices[2])] {
        let alone = echoed_logprobs(&s, prompt, 1);
        let ours = own_logprobs(&choice["prompt_logprobs"]);
        assert_eq!(ours.len(), alone.len());
        for (p, (x, y)) in ours.iter().zip(&alone).enumerate() {
            assert!((x - y).abs() < 1e-4, "position {}: {x} vs {y}", p + 1);
        }
    }
    // Not asked: no field.
    let v = s.post_ok("/v1/completions", &json!({"prompt": a, "max_tokens": 1}));
    assert!(v["choices"][0].get("prompt_logprobs").is_none(), "{v}");
}

/// Chat: the rendered prompt's list once, at the response's top level (vLLM's place), the
/// choices without one; its numbers are echo's on the same token ids.
#[test]
fn chat_prompt_logprobs_are_the_rendered_prompts_at_the_top_level() {
    let s = server("plp-chat");
    let messages = json!([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Name a color."}]);
    let tokens = s.post_ok("/tokenize", &json!({"messages": messages}));
    let prompt = ids(&tokens["tokens"]);
    let v = s.post_ok(
        "/v1/chat/completions",
        &json!({"messages": messages, "n": 2, "max_tokens": 3, "prompt_logprobs": 2}),
    );
    check_shape(&v["prompt_logprobs"], &prompt, 2);
    for choice in v["choices"].as_array().expect("choices") {
        assert!(choice.get("prompt_logprobs").is_none(), "{v}");
    }
    assert_eq!(
        own_logprobs(&v["prompt_logprobs"]),
        echoed_logprobs(&s, &prompt, 2)
    );
    let v = s.post_ok(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    );
    assert!(v.get("prompt_logprobs").is_none(), "{v}");
}

/// As vLLM: a streamed request may not ask for alternatives (a 400 naming the field), and
/// `prompt_logprobs: 0` with `stream` is accepted and sends none; beyond 0..=20 (vLLM's -1,
/// the whole vocabulary) is a 400 naming the field and its bound.
#[test]
fn streamed_and_out_of_bound_prompt_logprobs_are_answered_as_vllm_does() {
    let s = server("plp-stream");
    let user = json!([{"role": "user", "content": "hi"}]);
    let refused = [
        (
            "/v1/completions",
            json!({"prompt": "hi", "stream": true, "prompt_logprobs": 1}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "stream": true, "prompt_logprobs": 3}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "prompt_logprobs": -1}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "prompt_logprobs": 21}),
        ),
    ];
    for (path, body) in refused {
        let (status, v) = s.post_json(path, &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], "prompt_logprobs", "{v}");
    }
    let (_, v) = s.post_json(
        "/v1/completions",
        &json!({"prompt": "hi", "prompt_logprobs": -1}),
    );
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("[0, 20]"), "{message}");
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 2, "stream": true,
                                   "prompt_logprobs": 0}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "max_tokens": 2, "stream": true,
                                        "prompt_logprobs": 0}),
        ),
    ] {
        let events = s.post_stream(path, &body);
        assert!(!events.is_empty());
        for e in &events {
            assert!(!e.contains("prompt_logprobs"), "{e}");
        }
    }
}
