//! `POST /v1/embeddings` over the in-process app with the echo engine (tests/common), whose
//! vectors are counts of the prompt's bytes modulo `EMBEDDING_SIZE`; responses are also read
//! with async-openai's types to show wire compatibility.

mod common;

use std::sync::atomic::Ordering;

use actix_web::test::TestRequest;
use async_openai::types::embeddings::{CreateBase64EmbeddingResponse, CreateEmbeddingResponse};
use base64::Engine as _;
use common::*;
use serde_json::{json, Value};
use switchyard_api::engine::{LoraAdapterInfo, PromptInput};
use switchyard_api::ApiConfig;

const BAD: &str = "invalid_request_error";

/// The unit vector of `v`, computed here on its own (f64 throughout).
fn unit(v: &[f32]) -> Vec<f64> {
    let norm = v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    v.iter().map(|&x| f64::from(x) / norm).collect()
}

fn bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// The response's vectors, as floats, in `data` order.
fn vectors(body: &Value) -> Vec<Vec<f32>> {
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .unwrap_or_else(|| panic!("{d}"))
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!((f64::from(*g) - w).abs() < 1e-6, "{got:?} vs {want:?}");
    }
}

#[actix_web::test]
async fn a_batch_keeps_its_order_and_sums_its_usage() {
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    let inputs = ["abc", "hello world", "a", "zzzz"];
    let reply = send(
        &app,
        post("/v1/embeddings", &json!({"model": MODEL, "input": inputs})),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let response: CreateEmbeddingResponse = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(response.object, "list");
    assert_eq!(response.model, MODEL);
    assert_eq!(response.data.len(), inputs.len());
    for (i, (data, input)) in response.data.iter().zip(inputs).enumerate() {
        assert_eq!(data.index, i as u32);
        assert_eq!(data.object, "embedding");
        assert_close(&data.embedding, &unit(&echo_embedding(&bytes(input))));
        let norm: f64 = data.embedding.iter().map(|&x| f64::from(x).powi(2)).sum();
        assert!((norm - 1.0).abs() < 1e-6, "{norm}");
    }
    let total: usize = inputs.iter().map(|s| s.len()).sum();
    assert_eq!(response.usage.prompt_tokens, total as u32);
    assert_eq!(response.usage.total_tokens, total as u32);
    let body = reply.json();
    assert!(body["id"].as_str().unwrap().starts_with("embd-"), "{body}");
    assert!(body["created"].as_u64().is_some(), "{body}");
    // One engine request per input, submitted together, each an embedding request.
    let submitted = engine.submitted.lock().unwrap().clone();
    assert_eq!(submitted.len(), inputs.len());
    let id = body["id"].as_str().unwrap();
    for (i, (request, input)) in submitted.iter().zip(inputs).enumerate() {
        assert!(request.embed);
        assert_eq!(request.prompt, PromptInput::Text(input.to_owned()));
        assert_eq!(request.request_id, format!("{id}-{i}"));
        assert_eq!((request.n, request.max_tokens), (1, Some(1)));
        assert_eq!(request.sampling.temperature, 0.0);
        assert!(request.stop.is_empty() && request.structured.is_none());
        assert!(request.logprobs.is_none() && request.prompt_logprobs.is_none());
        assert_eq!(
            (request.tenant.as_str(), request.tier.as_str()),
            ("acme", "premium")
        );
        assert_eq!(request.lora, None);
    }
}

#[actix_web::test]
async fn every_input_shape_gives_the_same_vector_for_the_same_tokens() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let expected = unit(&echo_embedding(&bytes("ab")));
    for input in [
        json!("ab"),
        json!(["ab"]),
        json!([97, 98]),
        json!([[97, 98]]),
    ] {
        let reply = send(&app, post("/v1/embeddings", &json!({"input": input}))).await;
        assert_eq!(reply.status, 200, "{input}: {}", reply.text());
        let body = reply.json();
        let got = vectors(&body);
        assert_eq!(got.len(), 1);
        assert_close(&got[0], &expected);
        assert_eq!(body["usage"]["prompt_tokens"], 2);
        assert_eq!(body["model"], MODEL);
    }
}

/// base64 is the same vector's little-endian f32 bytes, as the OpenAI SDKs decode it.
#[actix_web::test]
async fn base64_decodes_to_the_float_vectors() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let inputs = json!(["The quick brown fox", "jumps", [1, 2, 300]]);
    let float = send(
        &app,
        post(
            "/v1/embeddings",
            &json!({"input": ["The quick brown fox", "jumps"]}),
        ),
    )
    .await;
    assert_eq!(float.status, 200, "{}", float.text());
    let float: CreateEmbeddingResponse = serde_json::from_slice(&float.body).unwrap();
    let reply = send(
        &app,
        post(
            "/v1/embeddings",
            &json!({"input": ["The quick brown fox", "jumps"], "encoding_format": "base64"}),
        ),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(reply.json()["data"][0]["embedding"].is_string());
    let base64: CreateBase64EmbeddingResponse = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(base64.data.len(), 2);
    for (b, f) in base64.data.into_iter().zip(&float.data) {
        assert_eq!(b.index, f.index);
        // As the SDKs decode it: base64, then little-endian f32s.
        let raw = base64::engine::general_purpose::STANDARD
            .decode(&b.embedding.0)
            .unwrap();
        assert_eq!(raw.len(), 4 * EMBEDDING_SIZE);
        let decoded: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&decoded), bits(&f.embedding));
    }
    assert_eq!(base64.usage, float.usage);
    // A mixed list is none of the four shapes.
    let reply = send(&app, post("/v1/embeddings", &json!({"input": inputs}))).await;
    reply.assert_error(400, BAD, Some("input"));
}

#[actix_web::test]
async fn normalize_false_gives_the_engine_s_vector_and_zero_stays_zero() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/embeddings",
            &json!({"input": "aab", "normalize": false}),
        ),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(vectors(&reply.json())[0], echo_embedding(&bytes("aab")));
    // Token ids from 256 on count nothing in the echo engine: a zero vector, kept as zeros.
    for normalize in [true, false] {
        let reply = send(
            &app,
            post(
                "/v1/embeddings",
                &json!({"input": [[300, 301]], "normalize": normalize}),
            ),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(vectors(&reply.json())[0], vec![0.0; EMBEDDING_SIZE]);
    }
}

#[actix_web::test]
async fn bad_fields_are_400_naming_them() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let cases = [
        (json!({"input": ""}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": ["a", ""]}), "input"),
        (json!({"input": [[]]}), "input"),
        (json!({"input": [[1], []]}), "input"),
        (json!({"input": {"text": "a"}}), "input"),
        (json!({"model": MODEL}), "input"),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": "a", "dimensions": 4}), "dimensions"),
        (json!({"input": "a", "dimensions": 0}), "dimensions"),
        (
            json!({"input": "a", "truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"input": "a", "embed_dtype": "bfloat16"}),
            "embed_dtype",
        ),
    ];
    for (body, param) in cases {
        let reply = send(&app, post("/v1/embeddings", &body)).await;
        let error = reply.assert_error(400, BAD, Some(param));
        assert!(error["error"]["code"].is_null(), "{body}: {error}");
    }
    // The model's own length is accepted.
    let reply = send(
        &app,
        post(
            "/v1/embeddings",
            &json!({"input": "a", "dimensions": EMBEDDING_SIZE, "user": "u"}),
        ),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let message = send(
        &app,
        post("/v1/embeddings", &json!({"input": "a", "dimensions": 4})),
    )
    .await
    .json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("Matryoshka"), "{message}");
}

/// An input too long for the context is the engine's context-length error, naming `input`
/// (a text input, found by the engine) or the same error found before submitting (token ids).
#[actix_web::test]
async fn a_too_long_input_is_a_context_length_error_naming_input() {
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    let long = "x".repeat(engine.max_model_len);
    for input in [
        json!(long),
        json!(["ok", long]),
        json!(vec![120u32; engine.max_model_len]),
        json!([[120], vec![120u32; engine.max_model_len]]),
    ] {
        let reply = send(&app, post("/v1/embeddings", &json!({"input": input}))).await;
        let body = reply.assert_error(400, BAD, Some("input"));
        assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    }
    // One token shorter fits (the engine runs the input as a one-token request).
    let fits = "x".repeat(engine.max_model_len - 1);
    let reply = send(&app, post("/v1/embeddings", &json!({"input": fits}))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// At most 2048 inputs, as OpenAI: refused before any is submitted.
#[actix_web::test]
async fn the_input_limit_is_openai_s() {
    let config = ApiConfig {
        max_body_bytes: 1 << 16,
        ..api_config()
    };
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), config).await;
    let most = vec!["x"; 2048];
    let reply = send(&app, post("/v1/embeddings", &json!({"input": most}))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let body = reply.json();
    assert_eq!(body["data"].as_array().unwrap().len(), 2048);
    assert_eq!(body["data"][2047]["index"], 2047);
    assert_eq!(body["usage"]["prompt_tokens"], 2048);
    let before = engine.submitted.lock().unwrap().len();
    let reply = send(
        &app,
        post("/v1/embeddings", &json!({"input": vec!["x"; 2049]})),
    )
    .await;
    let body = reply.assert_error(400, BAD, Some("input"));
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 2048 inputs"),
        "{body}"
    );
    assert_eq!(engine.submitted.lock().unwrap().len(), before);
}

#[actix_web::test]
async fn a_lora_adapter_is_a_model_and_an_unknown_model_is_404() {
    let engine = EchoEngine::new();
    engine.lora.lock().unwrap().push(LoraAdapterInfo {
        name: "sql/expert".into(),
        path: "/srv/sql".into(),
        rank: 8,
        discovered: false,
        pinned: false,
        base_model: None,
        base_model_differs: false,
    });
    let (_, app) = app(engine.clone(), api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/embeddings",
            &json!({"model": "sql/expert", "input": "a"}),
        ),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["model"], "sql/expert");
    assert_eq!(engine.last_request().lora.as_deref(), Some("sql/expert"));
    let reply = send(
        &app,
        post(
            "/v1/embeddings",
            &json!({"model": "text-embedding-3-small", "input": "a"}),
        ),
    )
    .await;
    let body = reply.assert_error(404, BAD, Some("model"));
    assert_eq!(body["error"]["code"], "model_not_found");
}

#[actix_web::test]
async fn an_engine_without_embeddings_answers_404_saying_so() {
    let engine = EchoEngine::new();
    *engine.embedding_size.lock().unwrap() = None;
    let (_, app) = app(engine.clone(), api_config()).await;
    // Whatever the body.
    for body in [json!({"input": "a"}), json!({"input": 5})] {
        let reply = send(&app, post("/v1/embeddings", &body)).await;
        let body = reply.assert_error(404, BAD, None);
        assert_eq!(body["error"]["code"], "embeddings_not_served");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("does not support the Embeddings API"),
            "{body}"
        );
    }
    assert!(engine.submitted.lock().unwrap().is_empty());
}

/// A finishing delta without its vector, or with one of the wrong length or not finite, is
/// the engine's failure: a 500 with the detail kept out of the body.
#[actix_web::test]
async fn a_faulty_vector_is_a_500() {
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    for faulty in [
        None,
        Some(vec![1.0; EMBEDDING_SIZE - 1]),
        Some(vec![f32::NAN; EMBEDDING_SIZE]),
        Some(vec![f32::INFINITY; EMBEDDING_SIZE]),
    ] {
        *engine.embedding_override.lock().unwrap() = Some(faulty.clone());
        let reply = send(&app, post("/v1/embeddings", &json!({"input": ["a", "b"]}))).await;
        let body = reply.assert_error(500, "server_error", None);
        assert_eq!(
            body["error"]["message"], "The server had an internal error.",
            "{faulty:?}"
        );
    }
    *engine.embedding_override.lock().unwrap() = None;
    let reply = send(&app, post("/v1/embeddings", &json!({"input": "a"}))).await;
    assert_eq!(reply.status, 200);
}

/// Keys, request ids, draining, overload, methods and metrics as on the other generation
/// routes.
#[actix_web::test]
async fn the_route_shares_the_generation_routes_plumbing() {
    let engine = EchoEngine::new();
    let (state, app) = app(engine.clone(), api_config()).await;
    let body = json!({"input": "abc"});
    // The API key.
    let anonymous = TestRequest::post()
        .uri("/v1/embeddings")
        .set_payload(body.to_string());
    send(&app, anonymous).await.assert_error(401, BAD, None);
    // The client's X-Request-Id is the response's id, with the route's prefix.
    let reply = send(
        &app,
        post("/v1/embeddings", &body).insert_header(("x-request-id", "job-7")),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.headers.get("x-request-id").unwrap(), "job-7");
    assert_eq!(reply.json()["id"], "embd-job-7");
    assert_eq!(engine.last_request().request_id, "embd-job-7");
    // Without one: a fresh `embd-` id, the same in the header and the body.
    let reply = send(&app, post("/v1/embeddings", &body)).await;
    let header = reply.headers.get("x-request-id").unwrap().to_str().unwrap();
    assert!(header.starts_with("embd-"), "{header}");
    assert_eq!(reply.json()["id"], header);
    // Other methods.
    let reply = send(
        &app,
        TestRequest::get()
            .uri("/v1/embeddings")
            .insert_header(("authorization", format!("Bearer {KEY}"))),
    )
    .await;
    reply.assert_error(405, BAD, None);
    assert_eq!(reply.headers.get("allow").unwrap(), "POST");
    // The body limit (4096 bytes here).
    let reply = send(
        &app,
        post("/v1/embeddings", &json!({"input": "x".repeat(5000)})),
    )
    .await;
    reply.assert_error(413, BAD, None);
    // Overload.
    engine.overloaded.store(true, Ordering::SeqCst);
    let reply = send(&app, post("/v1/embeddings", &body)).await;
    assert_eq!(
        reply.assert_error(503, "server_error", None)["error"]["code"],
        "overloaded"
    );
    engine.overloaded.store(false, Ordering::SeqCst);
    // Metrics by route template.
    let text = send(&app, TestRequest::get().uri("/metrics")).await;
    let text = text.text();
    for series in [
        r#"switchyard:http_requests_total{route="/v1/embeddings",status="200"}"#,
        r#"switchyard:http_requests_total{route="/v1/embeddings",status="401"}"#,
        r#"switchyard:http_requests_total{route="/v1/embeddings",status="503"}"#,
    ] {
        assert!(text.contains(series), "{series} missing:\n{text}");
    }
    // Draining.
    state.begin_drain();
    let reply = send(&app, post("/v1/embeddings", &body)).await;
    assert_eq!(
        reply.assert_error(503, "server_error", None)["error"]["code"],
        "shutting_down"
    );
    assert!(reply.headers.contains_key("retry-after"));
}

/// The engine names an out-of-vocabulary token id `prompt`; the request's field is `input`,
/// and completions still hear `prompt`.
#[actix_web::test]
async fn an_engine_refusal_of_a_token_id_names_input() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/embeddings",
            &json!({"input": [[1, 2], [3, VOCAB_SIZE]]}),
        ),
    )
    .await;
    let body = reply.assert_error(400, BAD, Some("input"));
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("outside the vocabulary"),
        "{body}"
    );
    let reply = send(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": [VOCAB_SIZE], "max_tokens": 1}),
        ),
    )
    .await;
    reply.assert_error(400, BAD, Some("prompt"));
}

/// Refused at the door until the engine is ready.
#[actix_web::test]
async fn an_engine_not_ready_is_503() {
    let engine = EchoEngine::new();
    engine.ready.store(false, Ordering::SeqCst);
    let (_, app) = app(engine.clone(), api_config()).await;
    let reply = send(&app, post("/v1/embeddings", &json!({"input": "a"}))).await;
    assert_eq!(
        reply.assert_error(503, "server_error", None)["error"]["code"],
        "unavailable"
    );
    engine.ready.store(true, Ordering::SeqCst);
    let reply = send(&app, post("/v1/embeddings", &json!({"input": "a"}))).await;
    assert_eq!(reply.status, 200);
    assert!(engine.submitted.lock().unwrap().len() == 1);
}
