//! Per-tenant bounds on requests in flight through the real binary on loopback: with a tier's
//! `max_pending_per_tenant: 1`, a tenant whose one request is running gets 429
//! `rate_limit_exceeded` (with `Retry-After`) for a second one, while another tenant of the
//! same tier is served; the refusal is counted in
//! `request_failed_total{reason="tenant_busy"}` and logged at WARN, and the tenant is served
//! again once its request ends.

mod common;

use common::{api_key_lines, Server};
use serde_json::{json, Value};

const ACME: &str = "Bearer free-tier-tenant-acme-key-01";
const BETA: &str = "Bearer free-tier-tenant-beta-key-01";

#[test]
fn a_tenant_at_its_bound_gets_a_429_while_its_tier_neighbour_is_served() {
    let keys = api_key_lines(&[(ACME, "acme", "free"), (BETA, "beta", "free")]);
    let rest = "tiers:\n  free: { max_pending_per_tenant: 1 }\n";
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
    // Its request ended, acme is served again.
    let r = s.complete_as(ACME, &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.body);

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
