//! Errors, auth, admin, limits, readiness, draining, metrics and disconnects over the in-process
//! app with the echo engine (tests/common).

mod common;

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use actix_web::body::MessageBody;
use actix_web::dev::Service;
use actix_web::http::Method;
use actix_web::test::TestRequest;
use actix_web::web::Bytes;
use common::*;
use serde_json::{json, Value};

const BAD: &str = "invalid_request_error";

/// One bad input: the path, the raw body, the expected status and `param`.
async fn check_bad(path: &str, body: &str, status: u16, param: Option<&str>) -> Value {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let request = TestRequest::post()
        .uri(path)
        .insert_header(("authorization", format!("Bearer {KEY}")))
        .set_payload(body.to_owned());
    let body = send(&app, request).await.assert_error(status, BAD, param);
    // The server keeps serving after a bad request.
    let good = send(
        &app,
        post("/v1/completions", &json!({"prompt": "ok", "max_tokens": 1})),
    )
    .await;
    assert_eq!(good.status, 200);
    body
}

#[actix_web::test]
async fn bad_inputs_get_400_with_the_field_named() {
    let bias: serde_json::Map<String, Value> =
        (0..301).map(|t| (t.to_string(), json!(1))).collect();
    let cases: Vec<(&str, String, Option<&str>)> = vec![
        ("/v1/completions", r#"{"prompt": "#.into(), None),
        ("/v1/completions", String::new(), None),
        ("/v1/completions", r#"{"max_tokens": 3}"#.into(), Some("prompt")),
        ("/v1/completions", r#"{"prompt": "x", "temperature": "hot"}"#.into(), Some("temperature")),
        ("/v1/completions", r#"{"prompt": "x", "temperature": 3}"#.into(), Some("temperature")),
        ("/v1/completions", r#"{"prompt": "x", "top_p": 0}"#.into(), Some("top_p")),
        ("/v1/completions", r#"{"prompt": "x", "n": 17}"#.into(), Some("n")),
        ("/v1/completions", r#"{"prompt": "x", "max_tokens": 0}"#.into(), Some("max_tokens")),
        ("/v1/completions", r#"{"prompt": "x", "logprobs": 21}"#.into(), Some("logprobs")),
        ("/v1/completions", r#"{"prompt": "x", "stop": ["a","b","c","d","e"]}"#.into(), Some("stop")),
        ("/v1/completions", json!({"prompt": "x", "logit_bias": bias}).to_string(), Some("logit_bias")),
        ("/v1/completions", r#"{"prompt": "x", "logit_bias": {"5": 150}}"#.into(), Some("logit_bias")),
        ("/v1/completions", r#"{"prompt": "x", "logit_bias": {"999": 1}}"#.into(), Some("logit_bias")),
        ("/v1/completions", r#"{"prompt": "x", "stream": true, "n": 0}"#.into(), Some("n")),
        // One token id named four ways would get four times the bias.
        ("/v1/completions", r#"{"prompt": "x", "logit_bias": {"5": 100, "05": 100, "+5": 100, " 5": 100}}"#.into(), Some("logit_bias")),
        // Refused before the stream opens, not by the scheduler after it.
        ("/v1/completions", r#"{"prompt": "x", "max_tokens": 2, "min_tokens": 3, "stream": true}"#.into(), Some("min_tokens")),
        ("/v1/completions", r#"{"prompt": "x", "min_tokens": 17, "stream": true}"#.into(), Some("min_tokens")),
        ("/v1/completions", r#"{"prompt": ["a", "b"], "echo": true, "logprobs": 20}"#.into(), Some("echo")),
        ("/v1/chat/completions", r#"{"messages": []}"#.into(), Some("messages")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "function", "content": "x"}]}"#.into(), Some("messages[0].role")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}"#.into(), Some("top_logprobs")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}"#.into(), Some("tools[0].function")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": 5}]}"#.into(), Some("messages[0].content")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "min_tokens": 3, "stream": true}"#.into(), Some("min_tokens")),
        // Deprecated function calling and audio output are refused, not ignored.
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f", "parameters": {"type": "object"}}]}"#.into(), Some("functions")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "function_call": "auto"}"#.into(), Some("function_call")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}"#.into(), Some("modalities")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "alloy", "format": "mp3"}}"#.into(), Some("audio")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "service_tier": "premium"}"#.into(), Some("service_tier")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"}"#.into(), Some("reasoning_effort")),
    ];
    for (path, body, param) in cases {
        let error = check_bad(path, &body, 400, param).await;
        assert!(error["error"]["code"].is_null(), "{body}: {error}");
    }
}

/// A structured output the engine cannot compile is a 400 naming the field that carried it,
/// whichever spelling the request used.
#[actix_web::test]
async fn a_structure_the_engine_refuses_names_the_field_that_carried_it() {
    let schema = json!({"type": "no-such-type"});
    let user = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "x", "guided_regex": "(unclosed"}),
            "guided_regex",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}),
            "structured_outputs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "guided_json": schema}),
            "guided_json",
        ),
        (
            "/v1/completions",
            json!({"prompt": ["x", "y"], "guided_grammar": "start: (unclosed"}),
            "guided_grammar",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "response_format": {"type": "json_schema",
                   "json_schema": {"name": "x", "schema": schema}}}),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "stream": true, "tools": [{"type": "function",
                   "function": {"name": "f", "parameters": {"type": "object",
                   "properties": {"a": schema}}}}]}),
            "tools",
        ),
    ];
    for (path, body, field) in cases {
        check_bad(path, &body.to_string(), 400, Some(field)).await;
    }
}

#[actix_web::test]
async fn context_overflow_is_400_context_length_exceeded() {
    let long = "x".repeat(60);
    let error = check_bad(
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 10}).to_string(),
        400,
        Some("prompt"),
    )
    .await;
    assert_eq!(error["error"]["code"], "context_length_exceeded");
    let tokens = vec![1u32; 65];
    let error = check_bad(
        "/v1/completions",
        &json!({"prompt": tokens}).to_string(),
        400,
        Some("prompt"),
    )
    .await;
    assert_eq!(error["error"]["code"], "context_length_exceeded");
    let body = json!({"messages": [{"role": "user", "content": long}], "stream": true});
    let error = check_bad(
        "/v1/chat/completions",
        &body.to_string(),
        400,
        Some("messages"),
    )
    .await;
    assert_eq!(error["error"]["code"], "context_length_exceeded");
}

#[actix_web::test]
async fn unknown_model_is_404_model_not_found() {
    let error = check_bad(
        "/v1/chat/completions",
        r#"{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}"#,
        404,
        Some("model"),
    )
    .await;
    assert_eq!(error["error"]["code"], "model_not_found");
}

#[actix_web::test]
async fn oversized_body_is_413() {
    let body = json!({"prompt": "x".repeat(5000)}).to_string();
    let error = check_bad("/v1/completions", &body, 413, None).await;
    assert_eq!(error["error"]["code"], "request_too_large");
}

#[actix_web::test]
async fn unknown_routes_and_methods_get_openai_bodies() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    send(&app, TestRequest::get().uri("/nope"))
        .await
        .assert_error(404, BAD, None);
    let request = TestRequest::get()
        .uri("/v1/completions")
        .insert_header(("authorization", format!("Bearer {KEY}")));
    let reply = send(&app, request).await;
    reply.assert_error(405, BAD, None);
    // RFC 9110: a 405 lists the methods the path takes.
    assert_eq!(reply.headers.get("allow").unwrap(), "POST");
    let reply = send(&app, TestRequest::post().uri("/health")).await;
    reply.assert_error(405, BAD, None);
    assert_eq!(reply.headers.get("allow").unwrap(), "GET, HEAD");
    // Health probes may use HEAD; so may a scraper's check of /metrics (RFC 9110 9.3.2: HEAD
    // wherever GET is served), answered as its GET is, without the body.
    for path in ["/health", "/ready"] {
        let reply = send(&app, TestRequest::default().method(Method::HEAD).uri(path)).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
    }
    let get = send(&app, TestRequest::get().uri("/metrics")).await;
    let head = send(
        &app,
        TestRequest::default().method(Method::HEAD).uri("/metrics"),
    )
    .await;
    assert_eq!(head.status, get.status, "{}", head.text());
    assert_ne!(head.status, 405);
    // An OpenAI route this server does not serve.
    let request = TestRequest::post()
        .uri("/v1/audio/transcriptions")
        .insert_header(("authorization", format!("Bearer {KEY}")));
    send(&app, request).await.assert_error(404, BAD, None);
}

/// A key with `adapters` patterns sees only the adapters they match: listed, retrieved and
/// served; any other is `model_not_found` to it, the same answer as an adapter that does not
/// exist. The base model stays open to it, and a key without patterns sees every adapter.
/// The adapters the engine's directories hold are listed after the registered ones, filtered
/// the same way, each name once (a registration wins; the base model's name is no adapter's).
#[actix_web::test]
async fn a_key_names_only_the_adapters_its_patterns_allow() {
    const LIMITED: &str = "sk-limited-key-0001";
    let engine = EchoEngine::new();
    *engine.lora_in_directories.lock().unwrap() =
        ["acme-dir", "shared", MODEL, "bob-dir", "acme-sql"]
            .map(String::from)
            .to_vec();
    for name in ["acme-sql", "bob-sql", "shared"] {
        engine
            .lora
            .lock()
            .unwrap()
            .push(switchyard_api::engine::LoraAdapterInfo {
                name: name.into(),
                path: format!("/srv/{name}"),
                rank: 8,
                discovered: false,
                pinned: false,
                base_model: None,
                base_model_differs: false,
            });
    }
    let mut config = api_config();
    config.api_keys.push(switchyard_api::ApiKeyEntry {
        key: LIMITED.into(),
        tenant: "acme".into(),
        tier: "premium".into(),
        adapters: switchyard_api::AdapterAccess::only(vec!["acme-*".into(), "shared".into()]),
    });
    let (_, app) = app(engine, config).await;
    let as_key = |key: &str, request: TestRequest| {
        request.insert_header(("authorization", format!("Bearer {key}")))
    };
    let ids = |v: Value| -> Vec<String> {
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let listed = send(&app, as_key(LIMITED, TestRequest::get().uri("/v1/models")))
        .await
        .json();
    assert_eq!(ids(listed), [MODEL, "acme-sql", "shared", "acme-dir"]);
    let listed = send(&app, as_key(KEY, TestRequest::get().uri("/v1/models")))
        .await
        .json();
    assert_eq!(
        ids(listed.clone()),
        [MODEL, "acme-sql", "bob-sql", "shared", "acme-dir", "bob-dir"]
    );
    // A found adapter's card is a registered one's: the base model is its parent.
    assert_eq!(listed["data"][4]["parent"], MODEL);
    assert_eq!(listed["data"][4]["object"], "model");
    let complete = |key: &'static str, model: &str| {
        as_key(
            key,
            TestRequest::post()
                .uri("/v1/completions")
                .set_json(json!({"model": model, "prompt": "hi", "max_tokens": 2})),
        )
    };
    for model in [MODEL, "acme-sql", "shared"] {
        let reply = send(&app, complete(LIMITED, model)).await;
        assert_eq!(reply.status, 200, "{model}: {}", reply.text());
    }
    let hidden =
        send(&app, complete(LIMITED, "bob-sql"))
            .await
            .assert_error(404, BAD, Some("model"));
    let missing = send(&app, complete(LIMITED, "acme-none"))
        .await
        .assert_error(404, BAD, Some("model"));
    assert_eq!(hidden["error"]["code"], "model_not_found");
    assert_eq!(
        hidden["error"]["message"]
            .as_str()
            .unwrap()
            .replace("bob-sql", "X"),
        missing["error"]["message"]
            .as_str()
            .unwrap()
            .replace("acme-none", "X"),
        "a hidden adapter reads as one that does not exist"
    );
    let reply = send(&app, complete(KEY, "bob-sql")).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    for (key, uri, status) in [
        (LIMITED, "/v1/models/bob-sql", 404),
        (LIMITED, "/v1/models/acme-sql", 200),
        (KEY, "/v1/models/bob-sql", 200),
    ] {
        let reply = send(&app, as_key(key, TestRequest::get().uri(uri))).await;
        assert_eq!(reply.status, status, "{uri}: {}", reply.text());
    }
    // Embeddings and /tokenize check the same way.
    let reply = send(
        &app,
        as_key(
            LIMITED,
            TestRequest::post()
                .uri("/tokenize")
                .set_json(json!({"model": "bob-sql", "prompt": "hi"})),
        ),
    )
    .await;
    reply.assert_error(404, BAD, Some("model"));
}

/// `GET /v1/models/{id}` (the OpenAI SDK's `models.retrieve`) answers the card `GET
/// /v1/models` lists, adapters included; an unknown id is OpenAI's 404.
#[actix_web::test]
async fn a_model_is_retrieved_as_listed() {
    let engine = EchoEngine::new();
    engine
        .lora
        .lock()
        .unwrap()
        .push(switchyard_api::engine::LoraAdapterInfo {
            name: "sql/expert".into(),
            path: "/srv/sql".into(),
            rank: 8,
            discovered: false,
            pinned: false,
            base_model: None,
            base_model_differs: false,
        });
    let (_, app) = app(engine, api_config()).await;
    let get = |uri: &str| {
        TestRequest::get()
            .uri(uri)
            .insert_header(("authorization", format!("Bearer {KEY}")))
    };
    let list = send(&app, get("/v1/models")).await.json();
    let cards = list["data"].as_array().unwrap();
    assert_eq!(cards.len(), 2, "{list}");
    for card in cards {
        let id = card["id"].as_str().unwrap();
        let reply = send(&app, get(&format!("/v1/models/{id}"))).await;
        assert_eq!(reply.status, 200, "{id}: {}", reply.text());
        assert_eq!(&reply.json(), card);
        let model: async_openai::types::models::Model =
            serde_json::from_slice(&reply.body).unwrap_or_else(|e| panic!("{e}: {}", reply.text()));
        assert_eq!(model.id, id);
    }
    let error = send(&app, get("/v1/models/gpt-9"))
        .await
        .assert_error(404, BAD, Some("model"));
    assert_eq!(error["error"]["code"], "model_not_found");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gpt-9"),
        "{error}"
    );
    // Other methods: 405 with the path's methods, as on the other routes.
    let request = TestRequest::delete()
        .uri(&format!("/v1/models/{MODEL}"))
        .insert_header(("authorization", format!("Bearer {KEY}")));
    let reply = send(&app, request).await;
    reply.assert_error(405, BAD, None);
    assert_eq!(reply.headers.get("allow").unwrap(), "GET");
    // Behind the API key, as the list is.
    let request = TestRequest::get().uri(&format!("/v1/models/{MODEL}"));
    send(&app, request).await.assert_error(401, BAD, None);
}

/// Every response carries `x-request-id`: the client's own when sane, else the completion's
/// id where there is one, else a fresh one; errors and streams included.
#[actix_web::test]
async fn every_response_carries_a_request_id() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let id_of = |reply: &Reply| {
        reply
            .headers
            .get("x-request-id")
            .unwrap_or_else(|| panic!("no x-request-id: {:?}", reply.headers))
            .to_str()
            .unwrap()
            .to_owned()
    };
    let completion = json!({"prompt": "ab", "max_tokens": 1});
    // The client's id, even one that is not plain enough to become the completion's id.
    let reply = send(
        &app,
        post("/v1/completions", &completion).insert_header(("x-request-id", "job:7/a=b")),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(id_of(&reply), "job:7/a=b");
    // Without one: the completion's id.
    let reply = send(&app, post("/v1/completions", &completion)).await;
    assert_eq!(id_of(&reply), reply.json()["id"].as_str().unwrap());
    // A stream's head carries the chat completion's id.
    let chat = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "stream": true});
    let reply = send(&app, post("/v1/chat/completions", &chat)).await;
    let first: Value = serde_json::from_str(sse_payloads(reply.text())[0]).unwrap();
    assert!(
        id_of(&reply).starts_with("chatcmpl-"),
        "{:?}",
        reply.headers
    );
    assert_eq!(id_of(&reply), first["id"].as_str().unwrap());
    // An id that is too long or not visible ASCII is ignored.
    for bad in ["x".repeat(129), "a b".to_owned()] {
        let request =
            post("/v1/completions", &completion).insert_header(("x-request-id", bad.as_str()));
        let reply = send(&app, request).await;
        assert_ne!(id_of(&reply), bad);
        assert!(id_of(&reply).starts_with("cmpl-"));
    }
    let longest = "y".repeat(128);
    let request =
        post("/v1/completions", &completion).insert_header(("x-request-id", longest.as_str()));
    assert_eq!(id_of(&send(&app, request).await), longest);
    // Errors: a validation error, an unknown route, a refused key, a wrong method.
    let reply = send(
        &app,
        post("/v1/completions", &json!({"prompt": "x", "n": 99})),
    )
    .await;
    assert_eq!(reply.status, 400);
    // Refused after its body was read: the completion id it was given, which its log lines
    // (an ignored-field warning) carry too.
    assert!(id_of(&reply).starts_with("cmpl-"), "{}", id_of(&reply));
    let a = id_of(&send(&app, TestRequest::get().uri("/nope")).await);
    let b = id_of(&send(&app, TestRequest::get().uri("/nope")).await);
    assert_ne!(a, b);
    let refused = TestRequest::get()
        .uri("/v1/models")
        .insert_header(("x-request-id", "r-401"));
    let reply = send(&app, refused).await;
    assert_eq!(reply.status, 401);
    assert_eq!(id_of(&reply), "r-401");
    let reply = send(&app, TestRequest::post().uri("/health")).await;
    assert_eq!(reply.status, 405);
    assert!(!id_of(&reply).is_empty());
    let reply = send(&app, TestRequest::get().uri("/health")).await;
    assert!(!id_of(&reply).is_empty());
}

#[actix_web::test]
async fn api_key_is_required_and_checked() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    let cases = [
        None,
        Some("Bearer wrong"),
        Some("Bearer sk-test-acm"),
        Some(ADMIN_KEY),
        Some("Basic c2stdGVzdC1hY21l"),
    ];
    for auth in cases {
        let mut request = TestRequest::post()
            .uri("/v1/completions")
            .set_payload(body.clone());
        if let Some(auth) = auth {
            request = request.insert_header(("authorization", auth));
        }
        let error = send(&app, request).await.assert_error(401, BAD, None);
        assert_eq!(error["error"]["code"], "invalid_api_key", "{auth:?}");
    }
    let tokenize = TestRequest::post()
        .uri("/tokenize")
        .set_payload(r#"{"prompt": "x"}"#);
    send(&app, tokenize).await.assert_error(401, BAD, None);
    let lower = TestRequest::post()
        .uri("/v1/completions")
        .insert_header(("authorization", format!("bearer {KEY}")))
        .set_payload(body);
    assert_eq!(send(&app, lower).await.status, 200);
    assert_eq!(
        send(&app, TestRequest::get().uri("/health")).await.status,
        200
    );
}

#[actix_web::test]
async fn open_api_serves_without_key_as_anonymous() {
    let engine = EchoEngine::new();
    let config = switchyard_api::ApiConfig {
        max_body_bytes: 4096,
        ..Default::default()
    };
    let (_, app) = app(engine.clone(), config).await;
    let request = TestRequest::post()
        .uri("/v1/completions")
        .set_payload(r#"{"prompt": "x", "max_tokens": 1}"#);
    assert_eq!(send(&app, request).await.status, 200);
    assert_eq!(engine.last_request().tenant, "anonymous");
}

#[actix_web::test]
async fn admin_policy_needs_the_admin_key_and_swaps() {
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    let admin = |r: TestRequest| r.insert_header(("authorization", format!("Bearer {ADMIN_KEY}")));
    let with_api_key = TestRequest::get()
        .uri("/admin/policy")
        .insert_header(("authorization", format!("Bearer {KEY}")));
    send(&app, with_api_key).await.assert_error(401, BAD, None);
    let reply = send(&app, admin(TestRequest::get().uri("/admin/policy"))).await;
    assert_eq!(reply.json()["name"], "fcfs");
    let swap = admin(TestRequest::put().uri("/admin/policy"))
        .set_payload(r#"{"name": "priority", "params": {"aging_s": 5}}"#);
    let reply = send(&app, swap).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["name"], "priority");
    assert_eq!(reply.json()["changed"], true);
    assert_eq!(engine.policy.lock().unwrap().params, json!({"aging_s": 5}));
    // The policy in force with the same parameters: kept, and said so.
    let again = admin(TestRequest::put().uri("/admin/policy"))
        .set_payload(r#"{"name": "priority", "params": {"aging_s": 5}}"#);
    let reply = send(&app, again).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["name"], "priority");
    assert_eq!(reply.json()["changed"], false);
    assert_eq!(engine.policy_swaps.load(Ordering::SeqCst), 1);
    let unknown =
        admin(TestRequest::put().uri("/admin/policy")).set_payload(r#"{"name": "lottery"}"#);
    send(&app, unknown)
        .await
        .assert_error(400, BAD, Some("name"));
    // A body that is no object is refused, saying what it must be: serde would read an array
    // as the fields in order, `["fcfs"]` as a swap to FCFS.
    for body in [r#"["fcfs"]"#, r#"["fcfs", {}]"#, "[]", r#""fcfs""#, "null"] {
        let put = admin(TestRequest::put().uri("/admin/policy")).set_payload(body);
        let error = send(&app, put).await.assert_error(400, BAD, None);
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("must be a JSON object with `name`")),
            "{body}: {error}"
        );
    }
    assert_eq!(engine.policy_swaps.load(Ordering::SeqCst), 1);
    assert_eq!(engine.policy.lock().unwrap().name, "priority");
    let (_, closed) = app_without_admin().await;
    let request = admin(TestRequest::get().uri("/admin/policy"));
    let error = send(&closed, request).await.assert_error(403, BAD, None);
    assert_eq!(error["error"]["code"], "admin_disabled", "{error}");
}

/// `PUT /admin/speculative` takes the configuration's `speculative:` section as JSON, `method`
/// included, and `GET` shows it back; refusals name the field at fault as `param`, say where a
/// bound came from a default, and a body that is not an object says what it must be.
#[actix_web::test]
async fn admin_speculative_takes_the_config_section_and_names_bad_fields() {
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    let put = |body: &str| {
        TestRequest::put()
            .uri("/admin/speculative")
            .insert_header(("authorization", format!("Bearer {ADMIN_KEY}")))
            .set_payload(body.to_owned())
    };
    let section = json!({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 5, "max_running": 8});
    let reply = send(&app, put(&section.to_string())).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json(), section);
    let get = TestRequest::get()
        .uri("/admin/speculative")
        .insert_header(("authorization", format!("Bearer {ADMIN_KEY}")));
    assert_eq!(send(&app, get).await.json(), section);
    // Without `method`: the one method there is.
    let reply = send(&app, put(r#"{"num_speculative_tokens": 2}"#)).await;
    assert_eq!(reply.json()["method"], "ngram", "{}", reply.text());
    let refused = |body: &'static str, param: Option<&'static str>, says: &'static str| {
        let app = &app;
        async move {
            let error = send(app, put(body)).await.assert_error(400, BAD, param);
            let message = error["error"]["message"].as_str().unwrap().to_owned();
            assert!(message.contains(says), "{body}: {message}");
            assert!(
                !message.contains("SpeculativeSettings"),
                "{body}: {message}"
            );
            assert!(!message.contains("scheduler config"), "{body}: {message}");
        }
    };
    refused(
        r#"{"num_speculative_tokens": 4, "method": "eagle"}"#,
        Some("method"),
        "ngram",
    )
    .await;
    refused(
        r#"{"num_speculative_tokens": 0}"#,
        Some("num_speculative_tokens"),
        "1 to 16, got 0",
    )
    .await;
    refused(
        r#"{"num_speculative_tokens": 4, "prompt_lookup_max": 33}"#,
        Some("prompt_lookup_max"),
        "1 to 32, got 33",
    )
    .await;
    refused(
        r#"{"num_speculative_tokens": 4, "prompt_lookup_min": 9}"#,
        Some("prompt_lookup_min"),
        "prompt_lookup_min (9) must be 1 to prompt_lookup_max (4, the default, as it was not sent)",
    )
    .await;
    refused(
        r#"{"num_speculative_tokens": 4, "prompt_lookup_max": 1}"#,
        Some("prompt_lookup_max"),
        "prompt_lookup_min (2, the default, as it was not sent) must be 1 to prompt_lookup_max (1)",
    )
    .await;
    refused(
        r#"{"num_speculative_tokens": 4, "max_running": 70000}"#,
        Some("max_running"),
        "at most 65536",
    )
    .await;
    refused(
        r#"[]"#,
        None,
        "must be a JSON object with `num_speculative_tokens`",
    )
    .await;
    refused(r#"[4, 2, 4, 0]"#, None, "must be a JSON object").await;
    refused(r#"4"#, None, "must be a JSON object").await;
    // Nothing refused reached the engine.
    assert_eq!(
        engine
            .speculative
            .lock()
            .unwrap()
            .as_ref()
            .map(|s| s.num_speculative_tokens),
        Some(2)
    );
    let reply = send(&app, put("null")).await;
    assert_eq!((reply.status.as_u16(), reply.json()), (200, json!(null)));
}

async fn app_without_admin() -> (
    switchyard_api::ApiState,
    impl Service<
        actix_http::Request,
        Response = actix_web::dev::ServiceResponse<impl MessageBody>,
        Error = actix_web::Error,
    >,
) {
    app(
        EchoEngine::new(),
        switchyard_api::ApiConfig {
            admin_key: None,
            ..api_config()
        },
    )
    .await
}

#[actix_web::test]
async fn health_and_ready_are_503_once_the_engine_cannot_serve() {
    let engine = EchoEngine::new();
    let (_state, app) = app(engine.clone(), api_config()).await;
    for uri in ["/health", "/ready"] {
        assert_eq!(send(&app, TestRequest::get().uri(uri)).await.status, 200);
    }
    engine.alive.store(false, Ordering::SeqCst);
    for uri in ["/health", "/ready"] {
        let reply = send(&app, TestRequest::get().uri(uri)).await;
        let body = reply.assert_error(503, "server_error", None);
        assert_eq!(body["error"]["code"], "unavailable", "{uri}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Restart the server"),
            "{body}"
        );
    }
}

/// A backend call past `scheduler.step_timeout_s`: `/health` and `/ready` answer 503
/// `engine_stalled` naming the call, how long it has run and the setting, and generation
/// requests are refused at the door; once the call returns, all is served again.
#[actix_web::test]
async fn health_ready_and_generation_are_503_while_the_engine_is_stalled() {
    let engine = EchoEngine::new();
    let (_state, app) = app(engine.clone(), api_config()).await;
    *engine.stall.lock().unwrap() = Some(switchyard_api::engine::EngineStall {
        call: "collect",
        running: Duration::from_millis(312_400),
        limit: Duration::from_secs(300),
    });
    let completion = || post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    for request in [
        TestRequest::get().uri("/health"),
        TestRequest::get().uri("/ready"),
        completion(),
    ] {
        let reply = send(&app, request).await;
        assert!(reply.headers.contains_key("retry-after"));
        let body = reply.assert_error(503, "server_error", None);
        assert_eq!(body["error"]["code"], "engine_stalled", "{body}");
        assert_eq!(
            body["error"]["message"],
            "The engine is stalled: its backend's `collect` call has run for 312 s, past \
             scheduler.step_timeout_s = 300 (a GPU or driver hang?). Requests in flight wait \
             for it; the server serves again if it returns, else restart the server."
        );
    }
    assert!(engine.submitted.lock().unwrap().is_empty());
    // A retired backend is the graver state: its answer comes first.
    engine.alive.store(false, Ordering::SeqCst);
    let reply = send(&app, TestRequest::get().uri("/health")).await;
    assert_eq!(
        reply.assert_error(503, "server_error", None)["error"]["code"],
        "unavailable"
    );
    engine.alive.store(true, Ordering::SeqCst);
    // The call returned.
    *engine.stall.lock().unwrap() = None;
    for uri in ["/health", "/ready"] {
        assert_eq!(send(&app, TestRequest::get().uri(uri)).await.status, 200);
    }
    assert_eq!(send(&app, completion()).await.status, 200);
}

#[actix_web::test]
async fn generation_is_503_once_the_engine_cannot_serve() {
    // A retired backend fails every step: refused at the door, before any stream opens.
    let engine = EchoEngine::new();
    let (_state, app) = app(engine.clone(), api_config()).await;
    engine.alive.store(false, Ordering::SeqCst);
    let requests = [
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 1})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "stream": true}),
        ),
    ];
    for (path, body) in requests {
        let reply = send(&app, post(path, &body)).await;
        let body = reply.assert_error(503, "server_error", None);
        assert_eq!(body["error"]["code"], "unavailable", "{path}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Restart the server"),
            "{body}"
        );
    }
    assert!(engine.submitted.lock().unwrap().is_empty());
}

#[actix_web::test]
async fn ready_is_503_until_the_engine_is_ready_and_while_draining() {
    let engine = EchoEngine::new();
    engine.ready.store(false, Ordering::SeqCst);
    let (state, app) = app(engine.clone(), api_config()).await;
    let reply = send(&app, TestRequest::get().uri("/ready")).await;
    reply.assert_error(503, "server_error", None);
    assert!(reply.headers.contains_key("retry-after"));
    let early = send(&app, post("/v1/completions", &json!({"prompt": "x"}))).await;
    assert_eq!(
        early.assert_error(503, "server_error", None)["error"]["code"],
        "unavailable"
    );
    engine.ready.store(true, Ordering::SeqCst);
    assert_eq!(
        send(&app, TestRequest::get().uri("/ready")).await.status,
        200
    );
    state.begin_drain();
    send(&app, TestRequest::get().uri("/ready"))
        .await
        .assert_error(503, "server_error", None);
    let reply = send(&app, post("/v1/completions", &json!({"prompt": "x"}))).await;
    assert_eq!(
        reply.assert_error(503, "server_error", None)["error"]["code"],
        "shutting_down"
    );
    assert_eq!(
        send(&app, TestRequest::get().uri("/health")).await.status,
        200
    );
}

#[actix_web::test]
async fn overload_is_503_with_retry_after() {
    let engine = EchoEngine::new();
    engine.overloaded.store(true, Ordering::SeqCst);
    let (_, app) = app(engine, api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "stream": true}),
        ),
    )
    .await;
    assert_eq!(
        reply.assert_error(503, "server_error", None)["error"]["code"],
        "overloaded"
    );
    assert_eq!(reply.headers.get("retry-after").unwrap(), "2");
}

#[actix_web::test]
async fn an_error_mid_stream_is_an_error_chunk_then_done() {
    let engine = EchoEngine::new();
    engine.fail_mid_stream.store(true, Ordering::SeqCst);
    let (_, app) = app(engine, api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": "ab", "max_tokens": 2, "stream": true}),
        ),
    )
    .await;
    assert_eq!(reply.status, 200);
    let payloads = sse_payloads(reply.text());
    assert_eq!(payloads.len(), 3, "{payloads:?}");
    assert_eq!(
        serde_json::from_str::<Value>(payloads[0]).unwrap()["choices"][0]["text"],
        "a"
    );
    let error: Value = serde_json::from_str(payloads[1]).unwrap();
    assert_eq!(
        error,
        json!({"error": {"message": "The engine is shutting down.", "type": "server_error", "param": null, "code": "unavailable"}})
    );
}

/// Posts a streaming request to an engine that never finishes it: the engine, the server state
/// and the open response body (status 200 checked).
async fn hanging_stream(
    path: &str,
    request: &Value,
) -> (
    std::sync::Arc<EchoEngine>,
    switchyard_api::ApiState,
    Pin<Box<impl MessageBody>>,
) {
    let engine = EchoEngine::new();
    engine.hang.store(true, Ordering::SeqCst);
    let (state, app) = app(engine.clone(), api_config()).await;
    let response = app.call(post(path, request).to_request()).await.unwrap();
    assert_eq!(response.status(), 200);
    (engine, state, Box::pin(response.into_body()))
}

#[actix_web::test]
async fn dropping_a_stream_drops_the_engine_receiver() {
    let request = json!({"messages": [{"role": "user", "content": "x"}], "stream": true});
    let (engine, state, mut body) = hanging_stream("/v1/chat/completions", &request).await;
    let first = match futures_util::future::poll_fn(|cx| body.as_mut().poll_next(cx)).await {
        Some(Ok(bytes)) => bytes,
        _ => panic!("the stream must open with the role chunk"),
    };
    assert!(first.starts_with(b"data: {"), "{first:?}");
    let sender = engine.held.lock().unwrap().pop().unwrap();
    assert!(!sender.is_closed());
    assert_eq!(state.in_flight(), 1);
    drop(body);
    assert!(sender.is_closed(), "the engine must see the abort");
    assert_eq!(state.in_flight(), 0);
}

/// The next chunk of a response body, waiting at most 10 s (errors flattened for printing).
async fn next_frame<B: MessageBody>(mut body: Pin<&mut B>) -> Option<Result<Bytes, ()>> {
    tokio::time::timeout(
        Duration::from_secs(10),
        futures_util::future::poll_fn(|cx| body.as_mut().poll_next(cx)),
    )
    .await
    .expect("a frame within 10 s")
    .map(|r| r.map_err(|_| ()))
}

#[actix_web::test]
async fn an_idle_stream_sends_keep_alive_comments() {
    // A stream with nothing to send writes an SSE comment every second, so that a client that
    // hung up (which actix-web sees only as a failed write) is noticed without waiting for a
    // token.
    let request = json!({"prompt": "x", "stream": true});
    let (engine, _, mut body) = hanging_stream("/v1/completions", &request).await;
    let started = std::time::Instant::now();
    match next_frame(body.as_mut()).await {
        Some(Ok(bytes)) => assert_eq!(&bytes[..], b": keep-alive\n\n"),
        other => panic!("expected a keep-alive comment, got {other:?}"),
    }
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "the keep-alive must wait for the stream to be idle"
    );
    // The engine's events still come through after it.
    let sender = engine.held.lock().unwrap().pop().unwrap();
    drop(sender);
    let rest = next_frame(body.as_mut()).await;
    assert!(
        matches!(rest, Some(Ok(ref b)) if b.starts_with(b"data: ")),
        "{rest:?}"
    );
}

#[actix_web::test]
async fn dropping_a_pending_request_drops_the_engine_receiver() {
    let engine = EchoEngine::new();
    engine.hang.store(true, Ordering::SeqCst);
    let (state, app) = app(engine.clone(), api_config()).await;
    let call = app.call(post("/v1/completions", &json!({"prompt": "x"})).to_request());
    // The engine never finishes, so the call cannot complete; the timeout drops it.
    assert!(tokio::time::timeout(Duration::from_millis(50), call)
        .await
        .is_err());
    let sender = engine.held.lock().unwrap().pop().unwrap();
    assert!(sender.is_closed());
    assert_eq!(state.in_flight(), 0);
    tokio::time::timeout(Duration::from_secs(5), state.wait_idle())
        .await
        .unwrap();
}

#[actix_web::test]
async fn metrics_render_http_counters() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    assert_eq!(
        send(
            &app,
            post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}))
        )
        .await
        .status,
        200
    );
    let reply = send(&app, TestRequest::get().uri("/metrics")).await;
    assert_eq!(reply.status, 200);
    assert!(reply
        .headers
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = reply.text();
    assert!(
        text.contains("# TYPE switchyard:http_requests_total counter"),
        "{text}"
    );
    assert!(
        text.contains(r#"switchyard:http_requests_total{route="/v1/completions",status="200"}"#),
        "{text}"
    );
    assert!(text.contains("switchyard:http_request_duration_seconds_bucket{route=\"/v1/completions\",le=\"0.0005\"}"), "{text}");
}
