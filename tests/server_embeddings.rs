//! `POST /v1/embeddings` end to end: the real binary, SmolLM2 on the CPU, HTTP on loopback.
//! These check the route's properties (shape, unit length, encodings, determinism, batching,
//! usage, errors) and, for the values, the vectors against transformers' (the fixture of
//! `gpu/reference/make_embedding_golden.py`, normalized here).

mod common;

use common::Server;
use serde_json::{json, Value};

/// SmolLM2-135M's hidden size: the length of its embeddings.
const HIDDEN_SIZE: usize = 576;

/// The context this file's server is given, so that a too-long input is short to send.
const CONTEXT: usize = 256;

/// How far a vector computed in a batch of inputs may be from the same input's vector computed
/// alone, per value (the vectors are unit length). The CPU backend's batched forward pass gives
/// the same bits here (measured: a difference of 0 over the inputs below), so this only leaves
/// room for float noise, should a backend sum in another order for another batch.
const BATCH_TOLERANCE: f32 = 1e-5;

fn server() -> Server {
    Server::start_full(
        "embeddings",
        &format!("  max_model_len: {CONTEXT}\n"),
        "",
        "scheduler:\n  max_num_seqs: 16\n  max_num_batched_tokens: 1024\n",
    )
}

/// POSTs an embeddings request; asserts a 200 and returns the body.
fn embed(s: &Server, body: Value) -> Value {
    let (status, v) = s.post_json("/v1/embeddings", &body);
    assert_eq!(status, 200, "{body}: {v}\nlog:\n{}", s.log());
    v
}

/// The float vectors of a response, in `data` order, checking the indices.
fn vectors(v: &Value) -> Vec<Vec<f32>> {
    let data = v["data"].as_array().expect("data");
    data.iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["index"], i, "{d}");
            assert_eq!(d["object"], "embedding");
            d["embedding"]
                .as_array()
                .expect("a float vector")
                .iter()
                .map(|x| x.as_f64().expect("a number") as f32)
                .collect()
        })
        .collect()
}

fn one_vector(s: &Server, input: Value) -> Vec<f32> {
    let v = embed(s, json!({"model": s.model_id(), "input": input}));
    let mut all = vectors(&v);
    assert_eq!(all.len(), 1, "{v}");
    all.remove(0)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `/tokenize`'s tokens of `text` (special tokens added, as a text input is tokenized).
fn tokens(s: &Server, text: &str) -> Vec<u64> {
    let (status, v) = s.post_json("/tokenize", &json!({"prompt": text}));
    assert_eq!(status, 200, "{v}");
    v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("an id"))
        .collect()
}

/// Decodes standard base64 (with padding), written here so that the check does not share the
/// server's encoder.
fn decode_base64(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    assert_eq!(text.len() % 4, 0, "unpadded base64");
    let mut out = Vec::new();
    for quad in text.as_bytes().chunks(4) {
        let pad = quad.iter().filter(|&&c| c == b'=').count();
        let n = quad
            .iter()
            .map(|&c| if c == b'=' { 0 } else { value(c) })
            .fold(0u32, |acc, v| (acc << 6) | v);
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    out
}

#[test]
fn one_input_is_a_unit_vector_of_the_hidden_size_with_its_usage() {
    let s = &server();
    let text = "The quick brown fox jumps over the lazy dog.";
    let v = embed(s, json!({"model": s.model_id(), "input": text}));
    assert_eq!(v["object"], "list", "{v}");
    assert_eq!(v["model"], s.model_id());
    assert!(
        v["id"].as_str().unwrap_or_default().starts_with("embd-"),
        "{v}"
    );
    let vector = &vectors(&v)[0];
    assert_eq!(vector.len(), HIDDEN_SIZE);
    assert!(vector.iter().all(|x| x.is_finite()));
    let norm: f64 = vector
        .iter()
        .map(|&x| f64::from(x).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
    // Usage: the input's tokens as /tokenize counts them, nothing generated.
    let count = tokens(s, text).len() as u64;
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(count), "{v}");
    assert_eq!(v["usage"]["total_tokens"].as_u64(), Some(count), "{v}");
    assert!(v["usage"].get("completion_tokens").is_none(), "{v}");
    // A batch's usage sums its inputs'.
    let other = "Embeddings are vectors.";
    let batch = embed(s, json!({"input": [text, other]}));
    let sum = count + tokens(s, other).len() as u64;
    assert_eq!(
        batch["usage"]["prompt_tokens"].as_u64(),
        Some(sum),
        "{batch}"
    );
}

#[test]
fn base64_is_the_float_vector_s_little_endian_bytes() {
    let s = &server();
    let inputs = json!(["Hello there", "General Kenobi"]);
    let float = vectors(&embed(s, json!({"input": inputs})));
    let v = embed(s, json!({"input": inputs, "encoding_format": "base64"}));
    let data = v["data"].as_array().expect("data");
    assert_eq!(data.len(), 2);
    for (d, f) in data.iter().zip(&float) {
        let raw = decode_base64(d["embedding"].as_str().expect("a base64 string"));
        assert_eq!(raw.len(), 4 * HIDDEN_SIZE);
        let decoded: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(bits(&decoded), bits(f));
    }
}

#[test]
fn the_same_text_gives_the_same_vector_and_different_texts_differ() {
    let s = &server();
    let a = one_vector(s, json!("Rust is a systems programming language."));
    let again = one_vector(s, json!("Rust is a systems programming language."));
    assert_eq!(bits(&a), bits(&again));
    let b = one_vector(s, json!("Bananas are yellow."));
    let c = one_vector(s, json!("Rust is a systems programming language!"));
    for other in [&b, &c] {
        assert!(
            max_difference(&a, other) > 1e-3,
            "different texts, same vector"
        );
    }
}

#[test]
fn a_batch_equals_its_inputs_one_by_one() {
    let s = &server();
    let inputs = [
        "A short one.",
        "A somewhat longer input, so that the batch holds prompts of different lengths.",
        "Third.",
    ];
    let batch = vectors(&embed(s, json!({"input": inputs})));
    assert_eq!(batch.len(), 3);
    let mut worst = 0.0f32;
    for (input, batched) in inputs.iter().zip(&batch) {
        let alone = one_vector(s, json!(input));
        worst = worst.max(max_difference(&alone, batched));
    }
    eprintln!("largest difference, batched vs alone: {worst:e}");
    assert!(
        worst <= BATCH_TOLERANCE,
        "batched vectors differ by {worst:e}"
    );
}

#[test]
fn a_text_equals_its_token_ids() {
    let s = &server();
    let text = "Switchyard serves embeddings.";
    let ids = tokens(s, text);
    let from_text = one_vector(s, json!(text));
    let from_ids = one_vector(s, json!(ids));
    assert_eq!(bits(&from_text), bits(&from_ids));
    let listed = vectors(&embed(s, json!({"input": [ids]})));
    assert_eq!(bits(&from_text), bits(&listed[0]));
}

#[test]
fn refusals_name_the_field() {
    let s = &server();
    // Too long for the context: a text (the engine's refusal) and token ids (the route's).
    let long_text = "word ".repeat(CONTEXT);
    assert!(tokens(s, &long_text).len() >= CONTEXT);
    let long_ids: Vec<u32> = vec![1000; CONTEXT];
    for input in [json!(long_text), json!(["ok", long_text]), json!(long_ids)] {
        let (status, v) = s.post_json("/v1/embeddings", &json!({"input": input}));
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "input", "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        // The words of an input to embed, not of a prompt that leaves no room for an output.
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("an input to embed may have at most"),
            "{v}"
        );
    }
    // A token id outside the vocabulary, found by the engine's tokenizer.
    let (status, v) = s.post_json("/v1/embeddings", &json!({"input": [1, 2, 10_000_000]}));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "input", "{v}");
    // Other lengths than the model's.
    let (status, v) = s.post_json("/v1/embeddings", &json!({"input": "x", "dimensions": 256}));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "dimensions", "{v}");
    // The server still serves.
    assert_eq!(one_vector(s, json!("still here")).len(), HIDDEN_SIZE);
}

/// The vectors the server returns for the golden fixture's token ids (all in one request, and
/// so in one batch with each other) against transformers' `last_hidden_state` at the last token
/// of the same GGUF, normalized here (`gpu/tests/fixtures/smollm2_embeddings.json`, made by
/// `gpu/reference/make_embedding_golden.py`): cosine similarity at least 0.999 (the CPU
/// backend measured 0.99985 at worst), and each input's nearest reference vector is its own.
#[test]
fn vectors_match_transformers() {
    let s = &server();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/gpu/tests/fixtures/smollm2_embeddings.json"
    );
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("the fixture")).expect("JSON");
    let cases = fixture["cases"].as_array().expect("cases");
    let inputs: Vec<Value> = cases.iter().map(|c| c["ids"].clone()).collect();
    let ours = vectors(&embed(s, json!({"input": inputs})));
    let reference: Vec<Vec<f64>> = cases
        .iter()
        .map(|c| {
            let v: Vec<f64> = c["hidden"]
                .as_array()
                .expect("hidden")
                .iter()
                .map(|x| x.as_f64().expect("a float"))
                .collect();
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            v.iter().map(|x| x / norm).collect()
        })
        .collect();
    let cosine =
        |a: &[f32], b: &[f64]| -> f64 { a.iter().zip(b).map(|(&x, &y)| f64::from(x) * y).sum() };
    for (i, (v, c)) in ours.iter().zip(cases).enumerate() {
        let sims: Vec<f64> = reference.iter().map(|r| cosine(v, r)).collect();
        assert!(
            sims[i] >= 0.999,
            "{}: cosine {} with transformers",
            c["name"],
            sims[i]
        );
        let nearest = (0..sims.len())
            .max_by(|&a, &b| sims[a].total_cmp(&sims[b]))
            .expect("cases");
        assert_eq!(nearest, i, "{}: nearest reference {sims:?}", c["name"]);
    }
}

/// `server.embeddings: false` turns the route off (404 `embeddings_not_served`) and nothing
/// else: chat still answers.
#[test]
fn embeddings_can_be_switched_off() {
    let s = Server::start_with("embeddings-off", "  embeddings: false\n", "");
    let (status, v) = s.post_json("/v1/embeddings", &json!({"input": "hello"}));
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], "embeddings_not_served", "{v}");
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
}

/// An input embedded again is served from the prefix cache (every whole block before its
/// last token: the metric grows by exactly that) and gives the same vector as the first time,
/// when every position was computed; so does the same input prefilled in chunks by a server
/// whose step budget is smaller than it (the vector comes from the final chunk, over keys and
/// values the earlier chunks left), and with another input's blocks cached before it.
#[test]
fn an_input_served_from_the_prefix_cache_gives_the_same_vector() {
    const BLOCK: usize = 16;
    let config = |budget: usize| {
        format!(
            "cache:\n  block_size: {BLOCK}\n  prefix_caching: true\nscheduler:\n  \
             max_num_seqs: 16\n  max_num_batched_tokens: {budget}\n"
        )
    };
    let model = format!("  max_model_len: {CONTEXT}\n");
    let s = &Server::start_full("embeddings-cached", &model, "", &config(1024));
    let cached = |s: &Server| {
        s.metric("switchyard:prompt_tokens_cached_total")
            .unwrap_or(0.0)
    };
    // 100 token ids: 6 whole blocks before the last token are reusable, 96 tokens.
    let ids: Vec<u64> = (1000..1100).collect();
    let before = cached(s);
    let answer = embed(s, json!({"model": s.model_id(), "input": ids}));
    let first = vectors(&answer).remove(0);
    assert_eq!(cached(s), before, "nothing was cached the first time");
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let answer = embed(s, json!({"model": s.model_id(), "input": ids}));
    let second = vectors(&answer).remove(0);
    let reused = (ids.len() - 1) / BLOCK * BLOCK;
    assert_eq!(
        cached(s) - before,
        reused as f64,
        "the second time, the whole blocks before the last token came from the cache"
    );
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"], reused,
        "the answer's usage says so as completions' does: {answer}"
    );
    let diff = max_difference(&first, &second);
    eprintln!(
        "cached vs computed: largest difference {diff:e}, same bits: {}",
        bits(&first) == bits(&second)
    );
    assert!(
        diff <= 1e-6,
        "the vector over cached blocks differs by {diff:e}"
    );
    // A prefix of it, its 4 whole blocks before its last token served by the longer input's.
    let prefix: Vec<u64> = ids[..70].to_vec();
    let cached_prefix = one_vector(s, json!(prefix));

    // Chunks of 32 tokens: the prefill runs in 4 steps; the prefix in 3.
    let chunked = &Server::start_full("embeddings-chunked", &model, "", &config(32));
    let before = cached(chunked);
    let in_chunks = one_vector(chunked, json!(ids));
    let prefix_in_chunks = one_vector(chunked, json!(prefix));
    assert_eq!(
        cached(chunked) - before,
        64.0,
        "the prefix's 4 whole blocks"
    );
    for (what, a, b) in [
        ("chunked", &first, &in_chunks),
        (
            "prefix, chunked vs cached",
            &cached_prefix,
            &prefix_in_chunks,
        ),
    ] {
        let diff = max_difference(a, b);
        eprintln!("{what}: largest difference {diff:e}");
        assert!(diff <= 1e-5, "{what}: the vectors differ by {diff:e}");
    }
}
