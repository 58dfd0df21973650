//! End-to-end test of the host KV tier (`cache.kv_offloading_size`): the real binary, SmolLM2
//! on the CPU backend, HTTP on loopback. A KV cache of 24 blocks of 16 tokens is too small to
//! keep a prompt's blocks cached across three other long prompts; with a host tier they are
//! copied there when evicted and copied back when the prompt comes again.
//!
//! The expected counts follow from the prefix cache's rule alone: a prompt of `p` tokens whose
//! every full block is cached reuses the whole blocks before its last token, `(p - 1) / B` of
//! them for blocks of `B` tokens (vLLM's rule).

mod common;

use common::Server;
use serde_json::{json, Value};

/// Tokens per KV block of the servers below.
const BLOCK: u64 = 16;

/// A cache of 24 blocks (384 tokens); `host_gib` of host tier (0: none). SmolLM2-135M's block
/// is 30 layers x 3 KV heads x 64 x 16 slots x 2 (keys, values) x 2 bytes = 368,640 bytes, so
/// 0.02 GiB holds 58 blocks: every block the requests below compute (A's 6 and 10 of each
/// other prompt, stored ahead of eviction once computed) fits.
fn server(name: &str, host_gib: f64) -> Server {
    server_with(name, host_gib, "off")
}

/// [`server`] with `scheduler.async_scheduling` set to `async_scheduling`.
fn server_with(name: &str, host_gib: f64, async_scheduling: &str) -> Server {
    Server::start(
        name,
        &format!(
            "cache:\n  block_size: {BLOCK}\n  num_blocks: 24\n  kv_offloading_size: {host_gib}\n\
             scheduler:\n  max_num_seqs: 4\n  max_num_batched_tokens: 512\n  \
             async_scheduling: {async_scheduling}\n"
        ),
    )
}

/// A greedy completion of token-id `prompt`: (its text, its prompt tokens, its cached ones).
fn complete(s: &Server, prompt: &[u32]) -> (String, u64, u64) {
    let body = json!({"model": s.model_id(), "prompt": prompt, "max_tokens": 8,
        "temperature": 0});
    let (status, v) = s.post_json("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let usage: &Value = &v["usage"];
    (
        v["choices"][0]["text"].as_str().expect("text").to_owned(),
        usage["prompt_tokens"].as_u64().expect("prompt_tokens"),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens"),
    )
}

/// Prompt A (96 tokens), then three prompts of 160 tokens that each take 10 of the 24 blocks
/// (the cache evicts A's blocks, least recently used first), then A again. Returns the two
/// answers to A and the second one's cached tokens.
fn a_after_evictions(s: &Server) -> (String, String, u64) {
    let a: Vec<u32> = (2000..2096).collect();
    let (first, n, cached) = complete(s, &a);
    assert_eq!((n, cached), (96, 0), "A computed the first time");
    for k in 0..3u32 {
        let other: Vec<u32> = (0..160).map(|i| 5000 + 1000 * k + i).collect();
        let (_, n, cached) = complete(s, &other);
        assert_eq!((n, cached), (160, 0));
    }
    let (again, n, cached) = complete(s, &a);
    assert_eq!(n, 96);
    (first, again, cached)
}

/// With a host tier, A's evicted blocks come back from host memory: its whole blocks but the
/// last are served cached, the answer is the one it got when computed, and `/metrics` counts
/// the offloads, the loads and the host hits. Without one, the same requests recompute A.
#[test]
fn a_prefix_evicted_from_the_cache_is_served_from_the_host_tier() {
    let reusable = (96 - 1) / BLOCK * BLOCK;
    assert_eq!(reusable, 80);

    let s = server("kv-offload-on", 0.02);
    let (first, again, cached) = a_after_evictions(&s);
    assert_eq!(cached, reusable, "A's blocks served from the host tier");
    assert_eq!(again, first, "the greedy answer over loaded blocks");
    let loaded = s.metric("switchyard:kv_offload_loaded_blocks_total");
    assert_eq!(loaded, Some((reusable / BLOCK) as f64), "blocks loaded");
    let hits = s.metric("switchyard:kv_offload_prefix_hits_total");
    assert_eq!(hits, Some(reusable as f64), "host hit tokens");
    let stored = s
        .metric("switchyard:kv_offload_stored_blocks_total")
        .expect("stored");
    assert!(
        stored >= (reusable / BLOCK) as f64,
        "{stored} blocks stored"
    );
    let usage = s.metric("switchyard:kv_offload_usage_perc").expect("usage");
    assert!(usage > 0.0 && usage <= 1.0, "host tier usage {usage}");
    s.assert_logged(&["host KV tier", "host_blocks=58"]);

    let off = server("kv-offload-off", 0.0);
    let (first_off, again_off, cached_off) = a_after_evictions(&off);
    assert_eq!(cached_off, 0, "without a host tier A is recomputed");
    assert_eq!(again_off, first_off);
    assert_eq!(first_off, first, "the same model answers the same");
    assert_eq!(
        off.metric("switchyard:kv_offload_loaded_blocks_total"),
        Some(0.0)
    );
}

/// The same with each step planned and submitted while the one before runs: the copies go
/// with the submitted step, after the one in flight.
#[test]
fn the_host_tier_serves_the_same_with_pipelined_steps() {
    let s = server_with("kv-offload-async", 0.02, "on");
    let (first, again, cached) = a_after_evictions(&s);
    assert_eq!(cached, 80);
    assert_eq!(again, first);
    assert_eq!(
        s.metric("switchyard:kv_offload_loaded_blocks_total"),
        Some(5.0)
    );
}

/// Two sequences admitted together (`n: 2`) that find the same prefix in the host tier: the
/// prefix is loaded once (5 blocks, not 10: the second shares the first's loaded blocks as a
/// device cache hit), and both answers are the one A got when computed.
#[test]
fn a_prefix_wanted_twice_at_once_is_loaded_from_the_host_tier_once() {
    for mode in ["off", "on"] {
        wanted_twice(mode);
    }
}

/// [`a_prefix_wanted_twice_at_once_is_loaded_from_the_host_tier_once`] with
/// `scheduler.async_scheduling` `mode`; then a prompt that needs all 24 blocks is served, so
/// the shared blocks were all given back.
fn wanted_twice(mode: &str) {
    let s = server_with(&format!("kv-offload-twice-{mode}"), 0.02, mode);
    let a: Vec<u32> = (2000..2096).collect();
    let (first, _, _) = complete(&s, &a);
    for k in 0..3u32 {
        let other: Vec<u32> = (0..160).map(|i| 5000 + 1000 * k + i).collect();
        complete(&s, &other);
    }
    let body = json!({"model": s.model_id(), "prompt": &a, "n": 2, "max_tokens": 8,
        "temperature": 0});
    let (status, v) = s.post_json("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 2, "{v}");
    for c in choices {
        assert_eq!(c["text"].as_str(), Some(first.as_str()), "{mode}: {v}");
    }
    // The prompt is counted once in `usage`, as vLLM does for `n`.
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(80),
        "{v}"
    );
    assert_eq!(
        s.metric("switchyard:kv_offload_loaded_blocks_total"),
        Some(5.0),
        "{mode}: A's 5 blocks loaded once"
    );
    assert_eq!(
        s.metric("switchyard:kv_offload_prefix_hits_total"),
        Some(80.0),
        "{mode}: the tier's tokens counted once"
    );
    let whole: Vec<u32> = (0..370).map(|i| 9000 + i).collect();
    let (_, n, _) = complete(&s, &whole);
    assert_eq!(n, 370, "{mode}: a prompt of the whole cache");
}

/// A size refused at start names the setting: more than the limit, and (through `config
/// check` too) with prefix caching off.
#[test]
fn bad_offloading_sizes_are_refused_naming_the_field() {
    let dir = common::temp_dir("kv-offload", "bad");
    for (yaml, expect) in [
        (
            "cache:\n  kv_offloading_size: 2000\n",
            "cache.kv_offloading_size: 2000 must be a size in GiB",
        ),
        (
            "cache:\n  kv_offloading_size: -0.5\n",
            "cache.kv_offloading_size: -0.5 must be a size in GiB",
        ),
        (
            "cache:\n  kv_offloading_size: 1\n  prefix_caching: false\n",
            "cache.kv_offloading_size",
        ),
    ] {
        let path = dir.join("c.yaml");
        std::fs::write(&path, yaml).expect("write");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .args(["config", "check"])
            .arg(&path)
            .output()
            .expect("run config check");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{yaml} accepted");
        assert!(err.contains(expect), "{yaml}: {err}");
    }
}

/// A tier larger than the memory available is refused at start, naming the setting (1024 GiB,
/// the largest size accepted, is more than any machine this runs on has free), before the
/// backend is built: the refusal names the blocks worked out from the model's geometry
/// (1024 GiB / 368,640 bytes = 2,982,616 of SmolLM2's), and no backend came up.
#[test]
fn serve_refuses_a_tier_larger_than_the_memory_available() {
    let dir = common::temp_dir("kv-offload", "too-big");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "model:\n  path: {}\n  threads: 2\nserver:\n  host: 127.0.0.1\n  port: 0\n\
             cache:\n  kv_offloading_size: 1024\n",
            common::model_path().display(),
        ),
    )
    .expect("write config");
    let mut child = common::serve(&config, &dir)
        .spawn()
        .expect("start switchyard serve");
    let status = common::wait_exit(
        &mut child,
        std::time::Duration::from_secs(120),
        "serve did not refuse the host tier",
    );
    let log = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
    assert!(!status.success(), "serve started:\n{log}");
    assert!(
        log.contains("cache.kv_offloading_size") && log.contains("of memory is available"),
        "{log}"
    );
    assert!(log.contains("2982616 host KV blocks"), "{log}");
    assert!(!log.contains("backend ready"), "{log}");
}
