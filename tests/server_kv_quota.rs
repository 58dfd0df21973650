//! KV-cache quotas per tier through the real binary on loopback: with the `batch` tier held to
//! 1/8 of a 64-block cache (8 blocks of 16 tokens), a batch request that could never fit is
//! refused with 400 `context_length_exceeded` (streamed or not) while the same request of the
//! unbounded tier is served, and a batch chat request without `max_tokens` is cut to what the
//! tier holds; two batch requests that fit alone but not together take turns (a preemption, with
//! 50 blocks of the pool free), and `switchyard:kv_cache_blocks_used{tier}` never shows the
//! tier above its 8 blocks and is back at 0 at the end.

mod common;

use std::time::{Duration, Instant};

use common::{api_key_lines, Server};
use serde_json::{json, Value};

const INTER: &str = "Bearer inter-tier-kv-quota-key-0001";
const BATCH: &str = "Bearer batch-tier-kv-quota-key-0001";

/// The tier's `switchyard:kv_cache_blocks_used` sample, if listed.
fn blocks_used(s: &Server, tier: &str) -> Option<f64> {
    let body = s.request("GET", "/metrics", None, &[]).ok()?.body;
    let label = format!("tier=\"{tier}\"");
    body.lines()
        .find(|l| l.starts_with("switchyard:kv_cache_blocks_used{") && l.contains(&label))
        .and_then(|l| l.rsplit_once(' ')?.1.parse().ok())
}

#[test]
fn a_tiers_kv_quota_holds_its_requests_back_and_is_reported_per_tier() {
    let keys = api_key_lines(&[(INTER, "acme", "inter"), (BATCH, "globex", "batch")]);
    let rest = "cache:\n  num_blocks: 64\n  block_size: 16\n\
                tiers:\n  inter: {}\n  batch: { max_kv_fraction: 0.125 }\n";
    let s = Server::start_with("kv-quota", &keys, rest);
    // Listed at zero for every configured tier from the start.
    assert_eq!(blocks_used(&s, "batch"), Some(0.0));
    assert_eq!(blocks_used(&s, "inter"), Some(0.0));

    // 200 tokens need 13 blocks: more than the batch tier may ever hold.
    let long = json!({"prompt": "Hi", "max_tokens": 200, "ignore_eos": true});
    let r = s.complete_as(BATCH, &long);
    assert_eq!(r.status, 400, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("this request's tier may hold at most 128 tokens"),
        "{v}"
    );
    assert_eq!(v["error"]["param"], "max_tokens", "{v}");
    // Streamed, it is refused before the stream opens.
    let mut streamed = long.clone();
    streamed["stream"] = json!(true);
    let r = s.complete_as(BATCH, &streamed);
    assert_eq!(r.status, 400, "{}", r.body);
    // The unbounded tier is bounded by the whole cache only.
    let r = s.complete_as(INTER, &long);
    assert_eq!(r.status, 200, "{}", r.body);
    // Without max_tokens a chat request may fill what its tier holds (128 tokens), no more.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": true});
    let r = s
        .request(
            "POST",
            "/v1/chat/completions",
            Some(&chat.to_string()),
            &[("authorization", BATCH)],
        )
        .expect("request");
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(v["usage"]["total_tokens"], 128, "{v}");

    // Two batch requests of ~100 tokens (7 blocks each): one at a time under the quota.
    let preemptions = s.metric("switchyard:num_preemptions_total").unwrap_or(0.0);
    let body = json!({"prompt": "Hi", "max_tokens": 100, "ignore_eos": true});
    let mut seen = 0.0f64;
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..2)
            .map(|_| scope.spawn(|| s.complete_as(BATCH, &body)))
            .collect();
        while !runs.iter().all(|r| r.is_finished()) {
            let used = blocks_used(&s, "batch").expect("the batch tier's gauge");
            assert!(used <= 8.0, "the batch tier holds {used} blocks");
            seen = seen.max(used);
            std::thread::sleep(Duration::from_millis(10));
        }
        for run in runs {
            let r = run.join().expect("a batch request");
            assert_eq!(r.status, 200, "{}", r.body);
            let v: Value = serde_json::from_str(&r.body).expect("json");
            assert_eq!(v["usage"]["completion_tokens"], 100, "{v}");
        }
    });
    assert!(seen > 0.0, "the gauge never moved");
    let after = s.metric("switchyard:num_preemptions_total").unwrap_or(0.0);
    assert!(
        after > preemptions,
        "no preemption: the quota did not hold the second request back"
    );
    let t0 = Instant::now();
    while blocks_used(&s, "batch") != Some(0.0) {
        assert!(t0.elapsed() < Duration::from_secs(60), "blocks left held");
        std::thread::sleep(Duration::from_millis(20));
    }
}
