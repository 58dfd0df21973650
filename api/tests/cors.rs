//! CORS over the in-process app with the echo engine (tests/common): preflights answered
//! without an API key, real requests still needing theirs, origins not allowed left without
//! `Access-Control-Allow-Origin`, and no CORS header at all without settings.

mod common;

use actix_web::http::Method;
use actix_web::test::TestRequest;
use common::*;
use serde_json::json;
use switchyard_api::cors::{AllowList, CorsSettings};
use switchyard_api::ApiConfig;

const ALLOWED: &str = "https://app.example.com";

fn settings(origins: AllowList, credentials: bool) -> CorsSettings {
    CorsSettings {
        allowed_origins: origins,
        allowed_methods: AllowList::Only(vec!["GET".into(), "POST".into(), "OPTIONS".into()]),
        allowed_headers: AllowList::Only(vec!["authorization".into(), "content-type".into()]),
        allow_credentials: credentials,
        max_age_s: 600,
    }
}

/// The test API (keys required) with `cors`.
fn config(cors: Option<CorsSettings>) -> ApiConfig {
    ApiConfig {
        cors,
        ..api_config()
    }
}

/// A browser's preflight for a POST with `Authorization` and `Content-Type`, from `origin`.
fn preflight(path: &str, origin: &str) -> TestRequest {
    TestRequest::default()
        .method(Method::OPTIONS)
        .uri(path)
        .insert_header(("origin", origin))
        .insert_header(("access-control-request-method", "POST"))
        .insert_header((
            "access-control-request-headers",
            "authorization, content-type",
        ))
}

fn completion() -> serde_json::Value {
    json!({"prompt": "x", "max_tokens": 1})
}

fn header<'a>(reply: &'a Reply, name: &str) -> Option<&'a str> {
    reply.headers.get(name).and_then(|v| v.to_str().ok())
}

#[actix_web::test]
async fn a_preflight_from_an_allowed_origin_needs_no_key_and_gets_the_headers() {
    let only = AllowList::Only(vec![ALLOWED.into(), "http://localhost:3000".into()]);
    let (_, app) = app(EchoEngine::new(), config(Some(settings(only, false)))).await;
    for path in ["/v1/completions", "/v1/chat/completions", "/tokenize"] {
        let reply = send(&app, preflight(path, ALLOWED)).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
        assert_eq!(header(&reply, "access-control-allow-origin"), Some(ALLOWED));
        let methods = header(&reply, "access-control-allow-methods").unwrap_or_default();
        assert!(methods.contains("POST"), "{methods}");
        let headers = header(&reply, "access-control-allow-headers").unwrap_or_default();
        assert!(
            headers.contains("authorization") && headers.contains("content-type"),
            "{headers}"
        );
        assert_eq!(header(&reply, "access-control-max-age"), Some("600"));
        assert_eq!(header(&reply, "access-control-allow-credentials"), None);
        // Answered inside the request-id middleware.
        assert!(header(&reply, "x-request-id").is_some());
    }
    // The real request from that origin: still needs its key, and the refusal carries the
    // CORS headers (so the page can read the 401).
    let reply = send(
        &app,
        TestRequest::post()
            .uri("/v1/completions")
            .insert_header(("origin", ALLOWED))
            .set_payload(completion().to_string()),
    )
    .await;
    reply.assert_error(401, "invalid_request_error", None);
    assert_eq!(header(&reply, "access-control-allow-origin"), Some(ALLOWED));
    // With its key it is served, with the CORS headers.
    let reply = send(
        &app,
        post("/v1/completions", &completion()).insert_header(("origin", ALLOWED)),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(header(&reply, "access-control-allow-origin"), Some(ALLOWED));
    assert_eq!(
        header(&reply, "access-control-expose-headers"),
        Some("x-request-id")
    );
}

#[actix_web::test]
async fn an_origin_not_allowed_gets_no_allow_origin_header() {
    let only = AllowList::Only(vec![ALLOWED.into()]);
    let (_, app) = app(EchoEngine::new(), config(Some(settings(only, false)))).await;
    for origin in [
        "https://evil.example",
        "https://app.example.com.evil.example",
    ] {
        // Refused in OpenAI's error shape, naming the origin and the setting.
        let reply = send(&app, preflight("/v1/completions", origin)).await;
        let body = reply.assert_error(400, "invalid_request_error", None);
        assert_eq!(body["error"]["code"], "cors_origin_not_allowed", "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!("`{origin}`"))
                && message.contains("server.cors.allowed_origins"),
            "{message}"
        );
        assert_eq!(header(&reply, "content-type"), Some("application/json"));
        assert_eq!(header(&reply, "access-control-allow-origin"), None);
        assert!(header(&reply, "x-request-id").is_some());
        // The request itself is served as without CORS, but the browser hides the answer.
        let reply = send(
            &app,
            post("/v1/completions", &completion()).insert_header(("origin", origin)),
        )
        .await;
        assert_eq!(reply.status, 200);
        assert_eq!(header(&reply, "access-control-allow-origin"), None);
    }
    // A method not allowed is refused at preflight, as are headers not allowed and a
    // malformed preflight, each with its code.
    let reply = send(
        &app,
        preflight("/v1/completions", ALLOWED)
            .insert_header(("access-control-request-method", "DELETE")),
    )
    .await;
    let body = reply.assert_error(400, "invalid_request_error", None);
    assert_eq!(body["error"]["code"], "cors_method_not_allowed", "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("`DELETE`"));
    let reply = send(
        &app,
        preflight("/v1/completions", ALLOWED)
            .insert_header(("access-control-request-headers", "authorization, x-secret")),
    )
    .await;
    let body = reply.assert_error(400, "invalid_request_error", None);
    assert_eq!(body["error"]["code"], "cors_headers_not_allowed", "{body}");
    let reply = send(
        &app,
        preflight("/v1/completions", ALLOWED)
            .insert_header(("access-control-request-headers", "a b")),
    )
    .await;
    let body = reply.assert_error(400, "invalid_request_error", None);
    assert_eq!(body["error"]["code"], "cors_invalid_preflight", "{body}");
    // A huge origin is quoted cut short.
    let long = format!("https://{}.example", "a".repeat(4000));
    let reply = send(&app, preflight("/v1/completions", &long)).await;
    let body = reply.assert_error(400, "invalid_request_error", None);
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.len() < 600 && message.contains("..."), "{message}");
}

#[actix_web::test]
async fn any_origin_is_answered_with_a_wildcard_and_credentials_with_the_origin() {
    let (_, any) = app(
        EchoEngine::new(),
        config(Some(settings(AllowList::Any, false))),
    )
    .await;
    let reply = send(&any, preflight("/v1/models", "https://anywhere.example")).await;
    assert_eq!(reply.status, 200);
    assert_eq!(header(&reply, "access-control-allow-origin"), Some("*"));
    let only = AllowList::Only(vec![ALLOWED.into()]);
    let (_, app) = app(EchoEngine::new(), config(Some(settings(only, true)))).await;
    let reply = send(&app, preflight("/v1/models", ALLOWED)).await;
    assert_eq!(header(&reply, "access-control-allow-origin"), Some(ALLOWED));
    assert_eq!(
        header(&reply, "access-control-allow-credentials"),
        Some("true")
    );
}

#[actix_web::test]
async fn without_settings_no_cors_header_is_sent_and_a_preflight_is_not_answered() {
    let (_, app) = app(EchoEngine::new(), config(None)).await;
    let reply = send(&app, preflight("/v1/completions", ALLOWED)).await;
    // The key check answers it, as any request without a key: the browser gets no grant.
    assert_eq!(reply.status, 401, "{}", reply.text());
    assert!(
        !reply
            .headers
            .keys()
            .any(|k| k.as_str().starts_with("access-control-")),
        "{:?}",
        reply.headers
    );
    let reply = send(
        &app,
        post("/v1/completions", &completion()).insert_header(("origin", ALLOWED)),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(header(&reply, "access-control-allow-origin"), None);
}
