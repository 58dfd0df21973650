//! Queue timeouts through the real binary on loopback: with one seat taken by a long
//! request, a request of a tier with `max_queue_ms: 300` fails with 503 `queue_timeout`
//! (a streamed one with the error event, then `[DONE]`; one of two prompts as a whole),
//! counted in
//! `request_failed_total{reason="queue_timeout"}` (its prompt not in its tenant's
//! `prompt_tokens_total`: never computed) and logged at WARN, while a request of a
//! tier without a bound waits for the seat and is served.

mod common;

use std::time::{Duration, Instant};

use common::{api_key_lines, sse_events, Server};
use serde_json::{json, Value};

const FREE: &str = "Bearer free-tier-queue-bound-key-1";
const PAID: &str = "Bearer paid-tier-no-queue-bound-k1";

#[test]
fn a_request_past_its_tiers_queue_bound_gets_a_503_and_others_wait() {
    let keys = api_key_lines(&[(FREE, "acme", "free"), (PAID, "globex", "paid")]);
    let rest = "scheduler:\n  max_num_seqs: 1\n\
                tiers:\n  free: { max_queue_ms: 300 }\n  paid: {}\n";
    let s = Server::start_with("queue-timeout", &keys, rest);
    let post = |auth: &str, body: &Value| s.complete_as(auth, body);

    // The one seat: a long stream, read to its end on a thread of its own.
    let reader = s.hold_stream(PAID, 1000);

    std::thread::scope(|scope| {
        // A request of the unbounded tier waits behind it and is served.
        let waiting = scope.spawn(|| {
            let t0 = Instant::now();
            let r = post(PAID, &json!({"prompt": "Hi", "max_tokens": 2}));
            (r, t0.elapsed())
        });
        // The bounded tier's request is ended after 300 ms in the queue.
        let t0 = Instant::now();
        let r = post(FREE, &json!({"prompt": "Hi", "max_tokens": 2}));
        let waited = t0.elapsed();
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.header("retry-after"), Some("1"));
        let v: Value = serde_json::from_str(&r.body).expect("json");
        assert_eq!(v["error"]["code"], "queue_timeout", "{v}");
        assert_eq!(v["error"]["type"], "server_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(
                "in the queue without being admitted, longer than tiers.free.max_queue_ms = 300"
            ),
            "{v}"
        );
        assert!(waited >= Duration::from_millis(300), "{waited:?}");

        // Two prompts: the request fails as a whole (each choice counts).
        let r = post(FREE, &json!({"prompt": ["Hi", "Yo"], "max_tokens": 2}));
        assert_eq!(r.status, 503, "{}", r.body);
        let v: Value = serde_json::from_str(&r.body).expect("json");
        assert_eq!(v["error"]["code"], "queue_timeout", "{v}");

        // Streamed: the response has started (the prompt was accepted), so the error comes
        // as an event, then `[DONE]`.
        let r = s
            .request(
                "POST",
                "/v1/completions",
                Some(&json!({"prompt": "Hi", "max_tokens": 2, "stream": true}).to_string()),
                &[("authorization", FREE)],
            )
            .expect("request");
        assert_eq!(r.status, 200, "{}", r.body);
        let mut events = sse_events(&r.body);
        assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{}", r.body);
        let error: Value = serde_json::from_str(events.last().expect("an event")).expect("json");
        assert_eq!(error["error"]["code"], "queue_timeout", "{error}");

        let (r, waited) = waiting.join().expect("the waiting request");
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(waited > Duration::from_millis(600), "{waited:?}");
    });
    let rest = reader.join().expect("the long stream");
    assert!(rest.contains("data: [DONE]"), "the long stream did not end");

    let metrics = s
        .request("GET", "/metrics", None, &[])
        .expect("metrics")
        .body;
    let failed = |tier: &str, tenant: &str| -> Vec<&str> {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("switchyard:request_failed_total{")
                    && l.contains("reason=\"queue_timeout\"")
                    && l.contains(&format!("tier=\"{tier}\",tenant=\"{tenant}\""))
            })
            .collect()
    };
    // The free tier's four choices; the paid tier's series exists at zero.
    let free = failed("free", "acme");
    assert_eq!(free.len(), 1, "{metrics}");
    assert!(free[0].ends_with(" 4"), "{}", free[0]);
    let paid = failed("paid", "globex");
    assert_eq!(paid.len(), 1, "{metrics}");
    assert!(paid[0].ends_with(" 0"), "{}", paid[0]);
    // No prompt of the free tier was computed, so none counts in its tenant's usage (as its
    // token budget gets them back); the paid tier's served prompts do.
    let prompt_tokens = |tenant: &str| -> f64 {
        let line = format!("switchyard:prompt_tokens_total{{tenant=\"{tenant}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {line}in {metrics}"))
    };
    assert_eq!(prompt_tokens("acme"), 0.0, "{metrics}");
    assert!(prompt_tokens("globex") > 0.0, "{metrics}");
    s.assert_logged(&[
        "WARN",
        "requests timed out in the queue",
        "tiers.free.max_queue_ms",
    ]);
}
