//! Per-tenant bounds on requests in flight through the real binary on loopback: with a tier's
//! `max_pending_per_tenant: 1`, a tenant whose one request is running gets 429
//! `rate_limit_exceeded` (with `Retry-After`) for a second one, while another tenant of the
//! same tier is served; the refusal is counted in
//! `request_failed_total{reason="tenant_busy"}` and logged at WARN, and the tenant is served
//! again once its request ends; a refused request takes nothing from the tenant's
//! `requests_per_minute`.

mod common;

use common::{api_key_lines, Server};
use serde_json::{json, Value};

const ACME: &str = "Bearer free-tier-tenant-acme-key-01";
const BETA: &str = "Bearer free-tier-tenant-beta-key-01";

#[test]
fn a_tenant_at_its_bound_gets_a_429_while_its_tier_neighbour_is_served() {
    let keys = api_key_lines(&[(ACME, "acme", "free"), (BETA, "beta", "free")]);
    // Two requests a minute per tenant: acme's stream takes one; the refusal for want of
    // room takes none (given back), so its request after the stream takes the second.
    let rest = "tiers:\n  free: { max_pending_per_tenant: 1, requests_per_minute: 2 }\n";
    let s = Server::start_with("tenant-limit", &keys, rest);

    // Acme's one seat: a long stream, read to its end on a thread of its own.
    let reader = s.hold_stream(ACME, 400);

    let r = s.complete_as(ACME, &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    let v: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("tenant `acme`")
            && message.contains("(tiers.free.max_pending_per_tenant is 1)"),
        "{v}"
    );
    // Two choices can never fit a bound of one: a 400, not a 429.
    let r = s.complete_as(BETA, &json!({"prompt": "Hi", "max_tokens": 2, "n": 2}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("too_many_choices"), "{}", r.body);
    // The tier's other tenant is served meanwhile.
    let r = s.complete_as(BETA, &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.body);

    let rest = reader.join().expect("the long stream");
    assert!(rest.contains("data: [DONE]"), "the long stream did not end");
    // Its request ended, acme is served again: the second of its two requests a minute
    // (a 429 rate_limit_exceeded on requests per min were the refused one charged).
    let r = s.complete_as(ACME, &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("2"));

    let metrics = s
        .request("GET", "/metrics", None, &[])
        .expect("metrics")
        .body;
    let busy = |tenant: &str| -> Vec<&str> {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("switchyard:request_failed_total{")
                    && l.contains("reason=\"tenant_busy\"")
                    && l.contains(&format!("tier=\"free\",tenant=\"{tenant}\""))
            })
            .collect()
    };
    let acme = busy("acme");
    assert_eq!(acme.len(), 1, "{metrics}");
    assert!(acme[0].ends_with(" 1"), "{}", acme[0]);
    let beta = busy("beta");
    assert_eq!(beta.len(), 1, "{metrics}");
    assert!(beta[0].ends_with(" 0"), "{}", beta[0]);
    s.assert_logged(&[
        "WARN",
        "their tenant is at its tier's",
        "max_pending_per_tenant",
    ]);
}

/// Sends `body` to `path` as `auth`; the whole response.
fn post_as(s: &Server, auth: &str, path: &str, body: &Value) -> common::Response {
    s.request(
        "POST",
        path,
        Some(&body.to_string()),
        &[("authorization", auth)],
    )
    .expect("request")
}

/// Opens a long stream of `n` choices as `auth` once the tenant has the seats for it (429s
/// retried for up to 30 s): a seat that never comes back fails here.
fn hold_when_free(s: &Server, auth: &str, n: u32) -> std::net::TcpStream {
    let body = json!({"prompt": "Count:", "max_tokens": 400, "ignore_eos": true, "stream": true,
                      "n": n})
    .to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let mut stream = s.open_with(
            "POST",
            "/v1/completions",
            Some(&body),
            &[("authorization", auth)],
        );
        match common::read_status(&mut stream) {
            200 => return stream,
            429 if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            status => panic!("a long stream got {status}; log:\n{}", s.log()),
        }
    }
}

/// Every way a request ends gives its tenant's seats back exactly once: finished by length or
/// stop with n = 2, several prompts, a stream its client leaves mid-way, a request refused
/// after its seats were taken (over the context), embeddings of two inputs, beam search and a
/// background response. Afterwards the tenant holds its whole bound (2) again, and no more.
#[test]
fn every_way_a_request_ends_gives_its_tenants_seats_back() {
    let keys = api_key_lines(&[(ACME, "acme", "free")]);
    let rest = "tiers:\n  free: { max_pending_per_tenant: 2 }\n";
    let s = Server::start_with("tenant-release", &keys, rest);
    let ok = |path: &str, body: Value| {
        let r = post_as(&s, ACME, path, &body);
        assert_eq!(r.status, 200, "{path} {body}: {}", r.body);
        serde_json::from_str::<Value>(&r.body).expect("json")
    };
    ok(
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 3, "n": 2, "ignore_eos": true}),
    );
    ok(
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 8, "n": 2, "stop": [" ", "\n", "."]}),
    );
    ok(
        "/v1/completions",
        json!({"prompt": ["Hi", "Bye"], "max_tokens": 3}),
    );
    ok(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    );
    // Refused after admission: the prompt fits, max_tokens does not.
    let r = post_as(
        &s,
        ACME,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 1000000}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    ok("/v1/embeddings", json!({"input": ["Hi", "Bye"]}));
    ok(
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 3, "n": 2, "use_beam_search": true}),
    );
    // A background response, polled until it ends.
    let v = ok(
        "/v1/responses",
        json!({"input": "Hi", "background": true, "max_output_tokens": 4}),
    );
    let id = v["id"].as_str().expect("id").to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let r = s
            .request(
                "GET",
                &format!("/v1/responses/{id}"),
                None,
                &[("authorization", ACME)],
            )
            .expect("poll");
        let v: Value = serde_json::from_str(&r.body).expect("json");
        if v["status"] != "queued" && v["status"] != "in_progress" {
            assert!(
                v["status"] == "completed" || v["status"] == "incomplete",
                "{v}"
            );
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{v}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    // A stream of two choices its client leaves after the first bytes.
    let mut left = hold_when_free(&s, ACME, 2);
    let mut first = [0u8; 64];
    let _ = std::io::Read::read(&mut left, &mut first);
    drop(left);

    // Both seats are free again (the left stream's within the detokenizer's sweep), and the
    // bound still holds.
    let a = hold_when_free(&s, ACME, 1);
    let b = hold_when_free(&s, ACME, 1);
    let r = s.complete_as(ACME, &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(r.status, 429, "{}", r.body);
    drop((a, b));
}
