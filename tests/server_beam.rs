//! Beam search (`use_beam_search: true`, vLLM's fields) end to end: the real binary, SmolLM2 on
//! the CPU, HTTP on loopback. The search's bookkeeping is checked against the reference's own
//! searches in `actors/src/beam.rs`; here, that the server runs it as a user would use it: the
//! answers of transformers where the two models' numbers agree, ranking, usage and metrics
//! counted once per request, streaming, chat, refusals naming the field and a client that
//! leaves mid-search.

mod common;

use std::time::{Duration, Instant};

use common::{choice_texts, Server};
use serde_json::{json, Value};

fn server(name: &str) -> Server {
    Server::start(name, "")
}

/// vLLM's score of a choice: its cumulative logprob over `(prompt + generated) ^ penalty`.
/// The choice must hold its end token (`include_stop_str_in_output`), whose logprob counts
/// while its place does not.
fn score(choice: &Value, prompt_tokens: usize, penalty: f64) -> f64 {
    let lps = choice["logprobs"]["token_logprobs"]
        .as_array()
        .expect("logprobs");
    let cum: f64 = lps.iter().map(|x| x.as_f64().unwrap()).sum();
    let ended = usize::from(choice["finish_reason"] == "stop");
    cum / ((prompt_tokens + lps.len() - ended) as f64).powf(penalty)
}

/// Runs the reference's beam searches (`gpu/tests/fixtures/smollm2_beam_search.json`:
/// vLLM's algorithm over transformers' float32 logprobs of the same GGUF) on `s`: those marked
/// `end_to_end`, or with `min_margin` those whose best beams' scores are at least that far
/// from the first that would change the answer (the fixture's `margin`), and checks each
/// answer beam for beam (text, each beam's cumulative logprob within 0.3 nats, its end
/// token's included, finish reason); returns how many were compared.
fn compare_with_transformers(s: &Server, min_margin: Option<f64>) -> usize {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/gpu/tests/fixtures/smollm2_beam_search.json"
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut compared = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let chosen = match min_margin {
            Some(m) => case["margin"].as_f64().unwrap() >= m,
            None => case["end_to_end"] == true,
        };
        if !chosen {
            continue;
        }
        let v = s.post_ok(
            "/v1/completions",
            &json!({"prompt": case["prompt_ids"], "n": case["width"],
                   "max_tokens": case["max_tokens"], "use_beam_search": true,
                   "length_penalty": case["length_penalty"], "ignore_eos": case["ignore_eos"],
                   "logprobs": 0, "include_stop_str_in_output": true}),
        );
        let ours = choice_texts(&v);
        for (i, beam) in case["beams"].as_array().unwrap().iter().enumerate() {
            let (status, d) = s.post_json("/detokenize", &json!({"tokens": beam["tokens"]}));
            assert_eq!(status, 200, "{d}");
            assert_eq!(
                ours[i],
                d["prompt"].as_str().unwrap(),
                "{}: beam {i}: {v}",
                case["name"]
            );
            let choice = &v["choices"][i];
            let cum: f64 = choice["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .sum();
            // The Q4_1 kernels against float32: a few hundredths of a nat per token. A beam
            // that ended holds its end token (`include_stop_str_in_output`, no text: special),
            // whose logprob the reference's cumulative one counts, as vLLM's does.
            let theirs = beam["cum_logprob"].as_f64().unwrap();
            assert!(
                (cum - theirs).abs() < 0.3,
                "{}: {cum} vs {theirs}",
                case["name"]
            );
            assert_eq!(choice["finish_reason"], beam["finish"], "{v}");
        }
        compared += 1;
    }
    compared
}

#[test]
fn answers_are_transformers_where_the_models_agree() {
    let s = server("beam-golden");
    assert!(compare_with_transformers(&s, None) >= 2);
}

/// With `model.cpu_precision: precise` (activations in about 15 bits in every product) the
/// CPU backend keeps near-equal beams in transformers' order: beam for beam in the 11
/// reference cases whose margin is at least 0.001 nats (all 13 on the AVX-512 build machine
/// when measured; the two under it are within what kernels for other instruction sets may
/// move), where the default `mixed` of AVX-512 machines gets 7 of the 13.
#[test]
fn answers_are_transformers_with_precise_activations() {
    let s = Server::start_full("beam-precise", "  cpu_precision: precise\n", "", "");
    s.assert_logged(&["backend ready", "Precise"]);
    assert_eq!(compare_with_transformers(&s, Some(0.001)), 11);
}

#[test]
fn beams_come_best_first_with_usage_and_metrics_counted_once() {
    let s = server("beam-usage");
    let before = |name: &str| s.metric(name).unwrap_or(0.0);
    let success = before("switchyard:request_success_total");
    let prompt = before("switchyard:prompt_tokens_total");
    let generated = before("switchyard:generation_tokens_total");
    let e2e = before("switchyard:e2e_request_latency_seconds_count");
    let queued = before("switchyard:request_queue_time_seconds_count");
    for penalty in [0.0, 1.0, 2.0] {
        let v = s.post_ok(
            "/v1/completions",
            &json!({"prompt": "The three primary colors are", "n": 4, "max_tokens": 8,
                   "use_beam_search": true, "length_penalty": penalty, "logprobs": 1,
                   "include_stop_str_in_output": true}),
        );
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 4, "{v}");
        let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        let scores: Vec<f64> = choices
            .iter()
            .map(|c| score(c, prompt_tokens, penalty))
            .collect();
        assert!(
            scores.windows(2).all(|w| w[0] >= w[1] - 1e-6),
            "penalty {penalty}: not best first: {scores:?}"
        );
        // Four distinct answers.
        let mut t = choice_texts(&v);
        t.sort();
        t.dedup();
        assert_eq!(t.len(), 4, "{v}");
        // Each token's logprob entry has the one alternative asked for, and usage counts
        // every choice's tokens (an end token that ended one, kept here, included).
        let listed: usize = choices
            .iter()
            .map(|c| {
                let top = c["logprobs"]["top_logprobs"].as_array().unwrap();
                assert!(top.iter().all(|t| t.as_object().unwrap().len() <= 2), "{c}");
                top.len()
            })
            .sum();
        assert_eq!(
            v["usage"]["completion_tokens"].as_u64().unwrap() as usize,
            listed,
            "{v}"
        );
    }
    // Three requests of four beams: twelve successes, three prompts, one latency per beam.
    assert_eq!(
        s.metric("switchyard:request_success_total").unwrap() - success,
        12.0
    );
    assert_eq!(
        s.metric("switchyard:e2e_request_latency_seconds_count")
            .unwrap()
            - e2e,
        12.0
    );
    // The queue time too, from the first step only (the later steps' waits are not the
    // client request's).
    assert_eq!(
        s.metric("switchyard:request_queue_time_seconds_count")
            .unwrap()
            - queued,
        12.0
    );
    let prompt_tokens = s.metric("switchyard:prompt_tokens_total").unwrap() - prompt;
    let (_, tok) = s.post_json(
        "/tokenize",
        &json!({"prompt": "The three primary colors are"}),
    );
    assert_eq!(prompt_tokens, 3.0 * tok["count"].as_f64().unwrap());
    let tokens = s.metric("switchyard:generation_tokens_total").unwrap() - generated;
    assert!(tokens > 0.0 && tokens <= 3.0 * 4.0 * 8.0, "{tokens}");
    // vLLM's per-request histograms: each beam a finished request of the prompt's length,
    // its tokens and max_tokens 8; the request's width (its n) and longest beam once each; no
    // prefill, decode or inference time (the steps are engine requests of their own).
    let per_prompt = tok["count"].as_f64().unwrap();
    for (name, want) in [
        ("switchyard:request_prompt_tokens_count", 12.0),
        ("switchyard:request_prompt_tokens_sum", 12.0 * per_prompt),
        ("switchyard:request_generation_tokens_count", 12.0),
        ("switchyard:request_generation_tokens_sum", tokens),
        ("switchyard:request_params_max_tokens_sum", 12.0 * 8.0),
        ("switchyard:request_params_n_count", 3.0),
        ("switchyard:request_params_n_sum", 12.0),
        ("switchyard:request_max_num_generation_tokens_count", 3.0),
        ("switchyard:request_prefill_time_seconds_count", 0.0),
    ] {
        assert_eq!(s.metric(name), Some(want), "{name}");
    }
    // Without include_stop_str_in_output an end token is not listed, and usage still counts it.
    let v = s.post_ok(
        "/v1/completions",
        &json!({"prompt": "The three primary colors are", "n": 4, "max_tokens": 8,
               "use_beam_search": true, "logprobs": 0}),
    );
    let listed: usize = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let n = c["logprobs"]["tokens"].as_array().unwrap().len();
            n + usize::from(c["finish_reason"] == "stop")
        })
        .sum();
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap() as usize,
        listed,
        "{v}"
    );
}

#[test]
fn one_beam_is_greedy_decoding() {
    let s = server("beam-greedy");
    for prompt in [
        "The capital of France is",
        "def add(a, b):",
        "Once upon a time",
    ] {
        let beam = s.post_ok("/v1/completions", &json!({"prompt": prompt, "max_tokens": 16, "use_beam_search": true, "ignore_eos": true}));
        let greedy = s.post_ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
        );
        assert_eq!(choice_texts(&beam), choice_texts(&greedy), "{prompt}");
        assert_eq!(beam["usage"], greedy["usage"]);
    }
}

#[test]
fn chat_and_streams_answer_with_whole_beams() {
    let s = server("beam-chat");
    let body = json!({"messages": [{"role": "user", "content": "Name a fruit."}],
                      "n": 2, "max_tokens": 6, "use_beam_search": true});
    let (status, v) = s.post_json("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let answers: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(answers.len(), 2);
    assert_ne!(answers[0], answers[1]);
    // Streamed: the same answers (the search is deterministic), each in its choice's chunks.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = common::stream_chunks(&s, "/v1/chat/completions", &streamed);
    for (i, answer) in answers.iter().enumerate() {
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"].as_array())
            .flatten()
            .filter(|c| c["index"] == i)
            .filter_map(|c| c["delta"]["content"].as_str())
            .collect();
        assert_eq!(&text, answer, "choice {i}");
    }
}

#[test]
fn refusals_name_the_field() {
    let s = server("beam-refusals");
    let cases = [
        (
            json!({"prompt": "x", "use_beam_search": true, "top_p": 0.5}),
            "top_p",
        ),
        (
            json!({"prompt": "x", "use_beam_search": true, "n": 11}),
            "n",
        ),
        (
            json!({"prompt": "x", "use_beam_search": true, "stop": ["."]}),
            "stop",
        ),
        (
            json!({"prompt": "x", "use_beam_search": true, "presence_penalty": 1}),
            "presence_penalty",
        ),
        (
            json!({"prompt": "x", "use_beam_search": true, "echo": true, "logprobs": 1}),
            "echo",
        ),
        (
            json!({"prompt": "x", "use_beam_search": true, "length_penalty": 1000}),
            "length_penalty",
        ),
        (
            json!({"prompt": "x", "length_penalty": -1000}),
            "length_penalty",
        ),
        (
            json!({"prompt": "x", "use_beam_search": true, "structured_outputs": {"regex": "[a-z]+"}}),
            "structured_outputs",
        ),
    ];
    for (body, field) in cases {
        let (status, v) = s.post_json("/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], field, "{body}: {v}");
    }
    let tools = json!({"messages": [{"role": "user", "content": "hi"}], "use_beam_search": true,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]});
    let (status, v) = s.post_json("/v1/chat/completions", &tools);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tools", "{v}");
    let format = json!({"messages": [{"role": "user", "content": "hi"}], "use_beam_search": true,
        "response_format": {"type": "json_object"}});
    let (status, v) = s.post_json("/v1/chat/completions", &format);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "response_format", "{v}");
    // The context is checked for the whole search before it starts.
    let (status, v) = s.post_json(
        "/v1/completions",
        &json!({"prompt": "x", "use_beam_search": true, "max_tokens": 100000}),
    );
    assert_eq!(status, 400, "{v}");
    s.assert_serves();
}

#[test]
fn a_client_leaving_ends_the_search_and_frees_everything() {
    let s = server("beam-hangup");
    let body = json!({"model": s.model_id(), "prompt": "Tell me a very long story",
        "n": 4, "max_tokens": 400, "ignore_eos": true, "use_beam_search": true});
    for round in 0..3 {
        let queried = s
            .metric("switchyard:prefix_cache_queries_total")
            .unwrap_or(0.0);
        let stream = s.open("POST", "/v1/completions", Some(&body.to_string()));
        // A step's requests last one step (the running gauge, sampled between steps, reads 0):
        // the search runs once its steps look the prefix cache up, several steps' worth.
        let deadline = Instant::now() + Duration::from_secs(60);
        while s
            .metric("switchyard:prefix_cache_queries_total")
            .unwrap_or(0.0)
            < queried + 12.0
        {
            assert!(
                Instant::now() < deadline,
                "round {round}: the search never ran"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(stream);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let running = s.metric("switchyard:num_requests_running");
            let waiting = s.metric("switchyard:num_requests_waiting");
            let http = s.metric("switchyard:http_requests_in_flight");
            if running == Some(0.0) && waiting == Some(0.0) && http == Some(0.0) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: running={running:?} waiting={waiting:?} http={http:?}\n{}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // Each beam of each search counts as aborted once; none as a success.
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("switchyard:request_aborted_total") != Some(12.0) {
        assert!(
            Instant::now() < deadline,
            "aborted {:?}",
            s.metric("switchyard:request_aborted_total")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.metric("switchyard:request_success_total"), Some(0.0));
    s.assert_serves();
}
