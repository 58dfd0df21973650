//! Rate limits over the in-process app with the echo engine (tests/common): requests and tokens
//! per minute per tenant of a tier, the 429 in OpenAI's shape with `Retry-After`, OpenAI's
//! `x-ratelimit-*` headers on every answer of a limited tenant, tokens charged as `usage`
//! counts them (streamed or not; an embedding's prompt only), other tenants and unlimited
//! tiers untouched.

mod common;

use std::collections::HashMap;

use common::*;
use serde_json::json;
use switchyard_api::rate_limit::TierLimits;
use switchyard_api::{ApiConfig, ApiKeyEntry};

const BOB: &str = "sk-test-bob";
const CAROL: &str = "sk-test-carol";

/// acme's key (tests/common, tier premium), bob's of the same tier, carol's of tier free
/// (not limited); premium limited to `limits`.
fn config(limits: TierLimits) -> ApiConfig {
    let mut config = api_config();
    config.api_keys.push(ApiKeyEntry {
        key: BOB.into(),
        tenant: "bob".into(),
        tier: "premium".into(),
        adapters: switchyard_api::AdapterAccess::all(),
    });
    config.api_keys.push(ApiKeyEntry {
        key: CAROL.into(),
        tenant: "carol".into(),
        tier: "free".into(),
        adapters: switchyard_api::AdapterAccess::all(),
    });
    config.tiers = vec!["premium".into(), "free".into()];
    config.rate_limits = HashMap::from([("premium".to_owned(), limits)]);
    config
}

fn as_key(key: &str, path: &str, body: &serde_json::Value) -> actix_web::test::TestRequest {
    actix_web::test::TestRequest::post()
        .uri(path)
        .insert_header(("authorization", format!("Bearer {key}")))
        .set_payload(body.to_string())
}

fn header<'a>(reply: &'a Reply, name: &str) -> Option<&'a str> {
    reply.headers.get(name).and_then(|v| v.to_str().ok())
}

/// The tokens left as the reply's header states them: `want`, or one more when the budget
/// refilled a token while the test ran (at 0.5 tokens a second: a stall of 2 s).
fn assert_tokens_left(reply: &Reply, want: u64) {
    let left: u64 = header(reply, "x-ratelimit-remaining-tokens")
        .expect("x-ratelimit-remaining-tokens")
        .parse()
        .expect("a count");
    assert!(
        left == want || left == want + 1,
        "{left} tokens left, want {want}"
    );
}

#[actix_web::test]
async fn requests_per_minute_refuse_the_fourth_request_with_a_429_and_its_wait() {
    let limits = TierLimits {
        requests_per_minute: Some(3),
        tokens_per_minute: None,
    };
    let (_, app) = app(EchoEngine::new(), config(limits)).await;
    let body = json!({"prompt": "abcd", "max_tokens": 2});
    for remaining in ["2", "1", "0"] {
        let reply = send(&app, post("/v1/completions", &body)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(header(&reply, "x-ratelimit-limit-requests"), Some("3"));
        assert_eq!(
            header(&reply, "x-ratelimit-remaining-requests"),
            Some(remaining)
        );
        assert!(header(&reply, "x-ratelimit-reset-requests").is_some());
        assert_eq!(header(&reply, "x-ratelimit-limit-tokens"), None);
    }
    // Chat counts against the same budget.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let reply = send(&app, post("/v1/chat/completions", &chat)).await;
    let body429 = reply.assert_error(429, "requests", None);
    assert_eq!(body429["error"]["code"], "rate_limit_exceeded");
    let message = body429["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "Rate limit reached for tenant acme (tier premium) on requests per min (RPM): \
             Limit 3, Used 3. Please try again in"
        ),
        "{message}"
    );
    // One request refills every 20 s.
    let wait: u64 = header(&reply, "retry-after").unwrap().parse().unwrap();
    assert!((19..=20).contains(&wait), "{wait}");
    assert_eq!(header(&reply, "x-ratelimit-remaining-requests"), Some("0"));
    // Another tenant of the tier has its own budget; an unlimited tier gets no headers.
    let reply = send(&app, as_key(BOB, "/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(header(&reply, "x-ratelimit-remaining-requests"), Some("2"));
    let reply = send(&app, as_key(CAROL, "/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(header(&reply, "x-ratelimit-limit-requests"), None);
    // Routes that generate nothing are not limited.
    let tokenize = json!({"prompt": "abcd"});
    let reply = send(&app, post("/tokenize", &tokenize)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // The refusal is counted.
    let metrics = metrics_handle().render();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("switchyard:rate_limited_total")
                && l.contains("limit=\"requests\"")
                && l.contains("tenant=\"acme\"")
                && l.contains("tier=\"premium\"")),
        "{metrics}"
    );
}

#[actix_web::test]
async fn tokens_are_charged_as_usage_counts_them_until_the_budget_is_spent() {
    let limits = TierLimits {
        requests_per_minute: None,
        tokens_per_minute: Some(30),
    };
    let (_, app) = app(EchoEngine::new(), config(limits)).await;
    // 4 prompt tokens + 2 × 3 generated (n = 2): 10 tokens.
    let body = json!({"prompt": "abcd", "max_tokens": 3, "n": 2});
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["usage"]["total_tokens"], 10);
    // The headers show the budget as the request was admitted (the prompt's estimate, 1,
    // held): 29.
    assert_eq!(header(&reply, "x-ratelimit-remaining-tokens"), Some("29"));
    // Streamed: 4 + 5 = 9 more; the budget stood at 20 when admitted.
    let stream = json!({"prompt": "abcd", "max_tokens": 5, "stream": true});
    let reply = send(&app, post("/v1/completions", &stream)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_tokens_left(&reply, 19);
    // An embedding counts its prompt only: 5 tokens (the echo engine's delta has none).
    let embed = json!({"input": "abcde"});
    let reply = send(&app, post("/v1/embeddings", &embed)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["usage"]["total_tokens"], 5);
    // 24 used: 6 left, so a request of 4 + 20 is admitted and takes the budget below zero.
    let big = json!({"prompt": "abcd", "max_tokens": 20});
    let reply = send(&app, post("/v1/completions", &big)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_tokens_left(&reply, 5);
    // 48 used of 30: 18 below zero, so the next waits ~19 / 0.5 per second = ~38 s.
    let reply = send(&app, post("/v1/completions", &body)).await;
    let error = reply.assert_error(429, "tokens", None);
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");
    let wait: u64 = header(&reply, "retry-after").unwrap().parse().unwrap();
    assert!((37..=39).contains(&wait), "{wait}");
    assert_eq!(header(&reply, "x-ratelimit-remaining-tokens"), Some("0"));
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("tokens per min (TPM): Limit 30, Used 30"),
        "{message}"
    );
    // Bob's budget is his own.
    let reply = send(&app, as_key(BOB, "/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(header(&reply, "x-ratelimit-remaining-tokens"), Some("29"));
}

#[actix_web::test]
async fn a_request_the_engine_refuses_gives_its_estimate_back() {
    let limits = TierLimits {
        requests_per_minute: None,
        tokens_per_minute: Some(100),
    };
    let (_, app) = app(EchoEngine::new(), config(limits)).await;
    // 20 token ids: an estimate of 20 tokens, then refused by the engine (ids outside its
    // vocabulary), after admission.
    let outside = json!({"prompt": vec![VOCAB_SIZE; 20], "max_tokens": 1});
    let reply = send(&app, post("/v1/completions", &outside)).await;
    reply.assert_error(400, "invalid_request_error", Some("prompt"));
    assert_eq!(header(&reply, "x-ratelimit-remaining-tokens"), Some("80"));
    let body = json!({"prompt": "abcd", "max_tokens": 1});
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // The estimate came back: only this request's own estimate (1) is held.
    assert_eq!(header(&reply, "x-ratelimit-remaining-tokens"), Some("99"));
}

fn admin(method: actix_web::http::Method, path: &str) -> actix_web::test::TestRequest {
    actix_web::test::TestRequest::default()
        .method(method)
        .uri(path)
        .insert_header(("authorization", format!("Bearer {ADMIN_KEY}")))
}

#[actix_web::test]
async fn the_admin_api_shows_each_tenants_budget_and_resets_one() {
    use actix_web::http::Method;
    let limits = TierLimits {
        requests_per_minute: Some(2),
        tokens_per_minute: Some(60),
    };
    let (_, app) = app(EchoEngine::new(), config(limits)).await;
    let body = json!({"prompt": "abcd", "max_tokens": 6});
    for _ in 0..2 {
        let reply = send(&app, post("/v1/completions", &body)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    assert_eq!(send(&app, post("/v1/completions", &body)).await.status, 429);
    let reply = send(&app, admin(Method::GET, "/admin/rate_limits")).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let v = reply.json();
    assert_eq!(
        v["tiers"],
        json!({"premium": {"requests_per_minute": 2, "tokens_per_minute": 60}})
    );
    let tenants = v["tenants"].as_array().unwrap();
    assert_eq!(tenants.len(), 1, "{v}");
    let acme = &tenants[0];
    assert_eq!(
        (acme["tier"].as_str(), acme["tenant"].as_str()),
        (Some("premium"), Some("acme"))
    );
    assert_eq!(acme["requests"]["limit"], 2);
    assert_eq!(acme["requests"]["remaining"], 0);
    // One request refills every 30 s.
    let wait = acme["requests"]["wait_s"].as_f64().unwrap();
    assert!(wait > 29.0 && wait <= 30.0, "{acme}");
    // Two requests of 4 + 6 tokens (one more if the test stalled a second: a token a second).
    let left = acme["tokens"]["remaining"].as_u64().unwrap();
    assert!(left == 40 || left == 41, "{acme}");
    // Reset: the next request finds a full budget.
    let reply = send(
        &app,
        admin(Method::DELETE, "/admin/rate_limits/premium/acme"),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["reset"], true);
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(header(&reply, "x-ratelimit-remaining-requests"), Some("1"));
    // A tenant never limited has nothing to reset; a tier without limits is a 404; the admin
    // key is needed.
    let reply = send(
        &app,
        admin(Method::DELETE, "/admin/rate_limits/premium/bob"),
    )
    .await;
    assert_eq!(reply.json()["reset"], false);
    let reply = send(&app, admin(Method::DELETE, "/admin/rate_limits/free/carol")).await;
    let body = reply.assert_error(404, "invalid_request_error", None);
    assert_eq!(body["error"]["message"], "Tier 'free' has no rate limits.");
    // A name no tier has says so.
    let reply = send(&app, admin(Method::DELETE, "/admin/rate_limits/gold/carol")).await;
    let body = reply.assert_error(404, "invalid_request_error", None);
    assert_eq!(body["error"]["message"], "No tier 'gold' is configured.");
    let reply = send(&app, post("/admin/rate_limits", &json!({}))).await;
    assert_eq!(reply.status, 401, "{}", reply.text());
}

#[actix_web::test]
async fn a_reload_swaps_the_keys_and_the_tiers_limits_while_serving() {
    let limits = |rpm| TierLimits {
        requests_per_minute: Some(rpm),
        tokens_per_minute: None,
    };
    let (state, app) = app(EchoEngine::new(), config(limits(2))).await;
    let body = json!({"prompt": "abcd", "max_tokens": 2});
    for _ in 0..2 {
        let reply = send(&app, post("/v1/completions", &body)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    send(&app, post("/v1/completions", &body))
        .await
        .assert_error(429, "requests", None);
    // bob's key revoked, dave's added (tier free), acme's kept; premium raised to 5 a minute.
    let mut keys = api_config().api_keys;
    keys.push(ApiKeyEntry {
        key: "sk-test-dave".into(),
        tenant: "dave".into(),
        tier: "free".into(),
        adapters: switchyard_api::AdapterAccess::all(),
    });
    keys.push(ApiKeyEntry {
        key: CAROL.into(),
        tenant: "carol".into(),
        tier: "premium".into(),
        adapters: switchyard_api::AdapterAccess::all(),
    });
    let change = state
        .reload_access(
            keys,
            HashMap::from([("premium".to_owned(), limits(5))]),
            vec!["premium".into(), "free".into()],
        )
        .unwrap();
    assert_eq!(
        change,
        switchyard_api::AccessChange {
            keys_added: 1,
            keys_removed: 1,
            keys_changed: 1,
            limits_changed: vec!["premium".into()],
        }
    );
    send(&app, as_key(BOB, "/v1/completions", &body))
        .await
        .assert_error(401, "invalid_request_error", None);
    let reply = send(&app, as_key("sk-test-dave", "/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(header(&reply, "x-ratelimit-limit-requests"), None);
    // acme used 2 of its 5 now: 3 more, then refused at the new limit.
    for remaining in ["2", "1", "0"] {
        let reply = send(&app, post("/v1/completions", &body)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(header(&reply, "x-ratelimit-limit-requests"), Some("5"));
        assert_eq!(
            header(&reply, "x-ratelimit-remaining-requests"),
            Some(remaining)
        );
    }
    send(&app, post("/v1/completions", &body))
        .await
        .assert_error(429, "requests", None);
    // carol moved to premium: limited from now on, with a budget of her own.
    let reply = send(&app, as_key(CAROL, "/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(header(&reply, "x-ratelimit-remaining-requests"), Some("4"));
    // A reload never opens the API: no keys is refused and changes nothing.
    assert_eq!(
        state.reload_access(Vec::new(), HashMap::new(), Vec::new()),
        Err(switchyard_api::AccessRefusal::WouldOpenApi)
    );
    let reply = send(&app, as_key("sk-test-dave", "/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    send(&app, post("/v1/completions", &body))
        .await
        .assert_error(429, "requests", None);
}

#[actix_web::test]
async fn a_reload_does_not_put_keys_on_an_api_started_open() {
    let mut open = config(TierLimits::default());
    open.api_keys.clear();
    let (state, app) = app(EchoEngine::new(), open).await;
    let keys = api_config().api_keys;
    assert_eq!(
        state.reload_access(keys, HashMap::new(), Vec::new()),
        Err(switchyard_api::AccessRefusal::WouldCloseOpenApi)
    );
    let body = json!({"prompt": "abcd", "max_tokens": 2});
    let reply = send(
        &app,
        actix_web::test::TestRequest::post()
            .uri("/v1/completions")
            .set_payload(body.to_string()),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// A request the server refuses for want of room before queueing it (503 overloaded) gives
/// its request and its prompt's estimate back; the refusal's headers say what is left after
/// that, not what was left at its admission (one request and its estimate fewer).
#[actix_web::test]
async fn a_refusal_for_room_reports_the_budget_after_the_give_back() {
    let limits = TierLimits {
        requests_per_minute: Some(3),
        tokens_per_minute: Some(100),
    };
    let engine = EchoEngine::new();
    engine
        .overloaded
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (_, app) = app(engine, config(limits)).await;
    // 80 bytes: an estimate of 20 tokens.
    let body = json!({"prompt": "abcd".repeat(20), "max_tokens": 1});
    for _ in 0..2 {
        let reply = send(&app, post("/v1/completions", &body)).await;
        reply.assert_error(503, "server_error", None);
        assert_eq!(header(&reply, "x-ratelimit-remaining-requests"), Some("3"));
        assert_eq!(header(&reply, "x-ratelimit-remaining-tokens"), Some("100"));
    }
}
