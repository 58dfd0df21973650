//! Rate limits through the real binary on loopback: a tier's tokens and requests per minute
//! applied to its tenant, OpenAI's `x-ratelimit-*` headers on the tenant's answers, the 429
//! with `Retry-After` once the tokens it used (as `usage` reports them) spend the budget, a
//! tenant of an unlimited tier untouched, and the refusal counted in `/metrics`.

mod common;

use common::{api_key_lines, Server};
use serde_json::{json, Value};
use std::time::Instant;

const ACME: &str = "Bearer acme-rate-limited-key-01";
const GLOBEX: &str = "Bearer globex-unlimited-key-001";

#[test]
fn a_tenant_that_used_its_tokens_per_minute_waits_and_others_do_not() {
    let keys = api_key_lines(&[(ACME, "acme", "gold"), (GLOBEX, "globex", "silver")]);
    let tiers =
        "tiers:\n  gold: { requests_per_minute: 3, tokens_per_minute: 100 }\n  silver: {}\n";
    let s = Server::start_with("rate-limits", &keys, tiers);
    let post = |auth: &str, body: &Value| s.complete_as(auth, body);
    let usage = |r: &common::Response| -> f64 {
        let v: Value = serde_json::from_str(&r.body).expect("json");
        v["usage"]["total_tokens"].as_f64().expect("usage")
    };

    // The budgets refill as the test runs (100 tokens and 3 requests a minute): what the
    // answers below may say depends on how long it took, measured from before the first.
    let started = Instant::now();
    // 24 bytes of prompt: an estimate of 6 tokens held at admission.
    let first = post(
        ACME,
        &json!({"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": true}),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-ratelimit-limit-requests"), Some("3"));
    assert_eq!(first.header("x-ratelimit-remaining-requests"), Some("2"));
    assert_eq!(first.header("x-ratelimit-limit-tokens"), Some("100"));
    assert_eq!(first.header("x-ratelimit-remaining-tokens"), Some("94"));
    let used_first = usage(&first);

    // Admitted with budget left; its 150 generated tokens take the budget ~60 below zero,
    // more than refills (100 a minute) while a loaded machine serves the requests.
    let second = post(
        ACME,
        &json!({"prompt": "Count:", "max_tokens": 150, "ignore_eos": true}),
    );
    assert_eq!(second.status, 200, "{}", second.body);
    let used = used_first + usage(&second);
    assert!(used > 160.0, "{used}");

    let third = post(ACME, &json!({"prompt": "Hi", "max_tokens": 1}));
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(third.status, 429, "{}", third.body);
    let error: Value = serde_json::from_str(&third.body).expect("json");
    assert_eq!(error["error"]["type"], "tokens", "{error}");
    assert_eq!(error["error"]["code"], "rate_limit_exceeded", "{error}");
    // Back to one token at 100 a minute: (used - 100 + 1) / (100 / 60) seconds, less what
    // refilled while the requests ran: at most `elapsed` seconds' worth (a second of it for
    // the two roundings up).
    let wait: f64 = third
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("seconds");
    let full = ((used - 100.0 + 1.0) * 0.6).ceil();
    assert!(
        wait <= full && wait >= full - elapsed.ceil() - 1.0,
        "{wait} vs {full} after {elapsed} s"
    );
    assert_eq!(third.header("x-ratelimit-remaining-tokens"), Some("0"));
    // The refused request took nothing from the requests budget: one left, and one more for
    // each 20 s the test took (3 a minute refill).
    let remaining: f64 = third
        .header("x-ratelimit-remaining-requests")
        .expect("x-ratelimit-remaining-requests")
        .parse()
        .expect("a count");
    assert!(
        remaining >= 1.0 && remaining <= (1.0 + (elapsed / 20.0).floor()).min(3.0),
        "{remaining} requests left after {elapsed} s"
    );

    // Another tier's tenant is served, without rate-limit headers.
    let other = post(GLOBEX, &json!({"prompt": "Hi", "max_tokens": 1}));
    assert_eq!(other.status, 200, "{}", other.body);
    assert_eq!(other.header("x-ratelimit-limit-tokens"), None);

    let metrics = s
        .request("GET", "/metrics", None, &[])
        .expect("GET /metrics")
        .body;
    // Every limit of the tenant exists from the start; the tokens one counted the refusal.
    let series = |limit: &str| -> Vec<&str> {
        metrics
            .lines()
            .filter(|l| l.starts_with("switchyard:rate_limited_total{"))
            .filter(|l| l.contains(&format!("limit=\"{limit}\"")))
            .collect()
    };
    for (limit, count) in [("tokens", "} 1"), ("requests", "} 0")] {
        let lines = series(limit);
        assert_eq!(lines.len(), 1, "{metrics}");
        for part in ["tenant=\"acme\"", "tier=\"gold\"", count] {
            assert!(lines[0].contains(part), "{}", lines[0]);
        }
    }
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("switchyard:rate_limited_total{") && l.contains("globex")),
        "{metrics}"
    );
    s.assert_logged(&["rate limit reached", "limit=\"tokens\"", "refused=1"]);
}
