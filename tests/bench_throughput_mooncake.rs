//! `switchyard bench throughput --dataset mooncake` through the real binary on the CPU backend
//! (random SmolLM2 weights): rows that share hash ids run as prompts that share their blocks,
//! and the report counts what the prefix cache served, and with `--kv-offloading-size` what
//! the host tier stored and loaded.
//!
//! The expected counts follow from the trace and the prefix cache's rule alone: with one
//! sequence at a time (`--max-num-seqs 1`), a prompt of `p` tokens whose first `s` tokens are
//! still cached reuses the whole KV blocks of them before its last token,
//! `min(s, (p - 1) / B * B)` for blocks of `B` tokens (vLLM's rule, which
//! tests/server_cached_tokens.rs pins on the server); a cache of 8 blocks holds the cached
//! blocks of at most one row of 4 blocks beside the row running (5 blocks: 64 prompt tokens
//! and 2 output tokens), so four distinct rows evict a row's blocks, which a host tier keeps.

mod common;

use common::{fails, switchyard, TempDir};
use std::path::PathBuf;

/// Tokens per KV block of the benchmark, and per trace block of the runs.
const BLOCK: usize = 16;

/// Eight rows of 4 ids at the format's 512 tokens an id (2048 tokens), which
/// `--mooncake-block-tokens 16` runs as 64 tokens, and 50 output tokens that
/// `--max-output-len 2` clamps to 2:
/// - rows 1 and 2 share ids 1, 2, 3 (48 tokens);
/// - rows 3 to 6 share nothing, and evict rows 1 and 2 from the 8-block cache;
/// - rows 7 and 8 are rows 1 and 2 again.
const TRACE: &str = r#"{"timestamp": 0, "input_length": 2048, "output_length": 50, "hash_ids": [1, 2, 3, 4]}
{"timestamp": 1, "input_length": 2048, "output_length": 50, "hash_ids": [1, 2, 3, 5]}
{"timestamp": 2, "input_length": 2048, "output_length": 50, "hash_ids": [10, 11, 12, 13]}
{"timestamp": 3, "input_length": 2048, "output_length": 50, "hash_ids": [20, 21, 22, 23]}
{"timestamp": 4, "input_length": 2048, "output_length": 50, "hash_ids": [30, 31, 32, 33]}
{"timestamp": 5, "input_length": 2048, "output_length": 50, "hash_ids": [40, 41, 42, 43]}
{"timestamp": 6, "input_length": 2048, "output_length": 50, "hash_ids": [1, 2, 3, 4]}
{"timestamp": 7, "input_length": 2048, "output_length": 50, "hash_ids": [1, 2, 3, 5]}
"#;

/// Prompt tokens: 8 rows of 64.
const INPUT: usize = 8 * 64;

/// Prompt tokens in blocks an earlier row sent: row 2's first three blocks, all of rows 7
/// and 8.
const TRACE_REUSABLE: usize = 48 + 64 + 64;

/// Whole blocks before the last token of a 64-token prompt: 3 blocks, 48 tokens.
const WHOLE: usize = (64 - 1) / BLOCK * BLOCK;

/// Without a tier: row 2 reuses row 1's three blocks, row 8 row 7's; row 7 finds nothing
/// (rows 3 to 6 evicted row 1's blocks).
const CACHED_NO_TIER: usize = 48 + WHOLE;

/// With a tier: row 7 also finds row 1's three whole blocks there and loads them.
const CACHED_TIER: usize = CACHED_NO_TIER + WHOLE;

/// [`TRACE`] written to a file: the file, in the directory that holds it (removed when
/// dropped).
fn trace_file() -> (TempDir, PathBuf) {
    let dir = common::temp_dir("bench-throughput-mooncake", "trace");
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, TRACE).expect("write the trace");
    (dir, path)
}

/// Runs the trace through `bench throughput --dataset mooncake --json` with `extra`
/// arguments; returns the JSON report.
fn bench(path: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let out = switchyard()
        .args([
            "bench",
            "throughput",
            "--backend",
            "cpu",
            "--dummy",
            "smollm2-135m",
        ])
        .args(["--threads", "2", "--dataset", "mooncake", "--dataset-path"])
        .arg(path)
        .args(["--mooncake-block-tokens", &BLOCK.to_string()])
        .args(["--num-prompts", "24", "--max-input-len", "256"])
        .args([
            "--max-output-len",
            "2",
            "--num-kv-blocks",
            "8",
            "--max-num-seqs",
            "1",
        ])
        .args(["--json"])
        .args(extra)
        .output()
        .expect("run switchyard");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn count(report: &serde_json::Value, key: &str) -> u64 {
    report[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in {report}"))
}

#[test]
fn mooncake_rows_hit_the_prefix_cache_and_the_host_tier() {
    let (_dir, path) = trace_file();
    let plain = bench(&path, &[]);
    let tier = bench(&path, &["--kv-offloading-size", "0.01"]);
    for r in [&plain, &tier] {
        // 8 rows, though 24 were asked: the file ends.
        assert_eq!(count(r, "num_requests"), 8, "{r}");
        assert_eq!(count(r, "total_prompt_tokens"), INPUT as u64, "{r}");
        assert_eq!(count(r, "total_output_tokens"), 8 * 2, "{r}");
        assert_eq!(count(r, "kv_cache_blocks"), 8, "{r}");
        assert_eq!(
            count(r, "trace_reusable_prompt_tokens"),
            TRACE_REUSABLE as u64
        );
        let cached = count(r, "cached_prompt_tokens") as f64;
        assert_eq!(
            r["cached_prompt_fraction"].as_f64(),
            Some(cached / INPUT as f64),
            "{r}"
        );
    }
    assert_eq!(
        count(&plain, "cached_prompt_tokens"),
        CACHED_NO_TIER as u64,
        "{plain}"
    );
    assert!(plain.get("kv_offload_loaded_blocks").is_none(), "{plain}");
    // The tier holds row 1's evicted blocks (at least its 4 prompt blocks were stored) and
    // gives back its 3 whole blocks before the last token for row 7.
    assert_eq!(
        count(&tier, "cached_prompt_tokens"),
        CACHED_TIER as u64,
        "{tier}"
    );
    assert_eq!(count(&tier, "kv_offload_loaded_blocks"), 3, "{tier}");
    assert_eq!(
        count(&tier, "kv_offload_prefix_hit_tokens"),
        WHOLE as u64,
        "{tier}"
    );
    assert!(count(&tier, "kv_offload_stored_blocks") >= 4, "{tier}");
    assert!(count(&tier, "kv_offload_blocks") > 0, "{tier}");
    // The same with every block copied at its eviction instead of ahead of it: the same
    // blocks come back, none was stored ahead.
    let evicting = bench(
        &path,
        &[
            "--kv-offloading-size",
            "0.01",
            "--kv-offloading-on-eviction",
        ],
    );
    assert_eq!(
        count(&evicting, "cached_prompt_tokens"),
        CACHED_TIER as u64,
        "{evicting}"
    );
    assert_eq!(
        count(&evicting, "kv_offload_loaded_blocks"),
        3,
        "{evicting}"
    );
    assert_eq!(
        count(&evicting, "kv_offload_stored_ahead_blocks"),
        0,
        "{evicting}"
    );
    assert!(
        count(&evicting, "kv_offload_stored_blocks") >= 4,
        "{evicting}"
    );
    // By default the rows' blocks are stored ahead once computed (the 8-block cache evicts
    // most of them later).
    let ahead = count(&tier, "kv_offload_stored_ahead_blocks");
    assert!(
        ahead > 0 && ahead <= count(&tier, "kv_offload_stored_blocks"),
        "{tier}"
    );
}

/// `--skip-rows` counts the rows it skips without reading them, and the start check (before
/// the model loads) agrees: a first line that is no row (here a CSV header) passes it when
/// skipped, and the run reads the rows after it; not skipped, it is refused at once, by its
/// line, before the model loads (there is no model at the path given: a check after the load
/// would name that instead).
#[test]
fn a_skipped_first_line_that_is_no_row_passes_the_start_check() {
    let dir = common::temp_dir("bench-throughput-mooncake", "skip");
    let path = dir.join("trace.jsonl");
    std::fs::write(
        &path,
        format!("timestamp,input_length,output_length\n{TRACE}"),
    )
    .expect("write the trace");
    let run = |skip: &str| {
        let mut cmd = switchyard();
        cmd.args(["bench", "throughput", "--backend", "cpu", "--threads", "2"])
            .args(["--dataset", "mooncake", "--dataset-path"])
            .arg(&path)
            .args(["--skip-rows", skip, "--mooncake-block-tokens", "16"])
            .args(["--num-prompts", "2", "--max-output-len", "2", "--json"]);
        cmd
    };
    let out = run("1")
        .args(["--dummy", "smollm2-135m"])
        .output()
        .expect("run switchyard");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    // The trace's rows 1 and 2: 64 prompt tokens each, the second sharing three blocks.
    assert_eq!(count(&report, "num_requests"), 2, "{report}");
    assert_eq!(count(&report, "total_prompt_tokens"), 2 * 64, "{report}");
    assert_eq!(
        count(&report, "trace_reusable_prompt_tokens"),
        48,
        "{report}"
    );
    let e = fails(run("0").args(["--model", "/nonexistent/model.gguf"]));
    assert!(
        e.contains(&format!(
            "{}:1: not JSON Lines of objects (its first character is `t`, not `{{`)",
            path.display()
        )),
        "{e}"
    );
    assert!(!e.contains("nonexistent"), "{e}");
}

/// The cache flags are refused before the model loads, naming the flag and the setting.
#[test]
fn cache_flags_out_of_range_are_refused() {
    let e = fails(switchyard().args([
        "bench",
        "throughput",
        "--backend",
        "cpu",
        "--kv-offloading-size",
        "2000",
    ]));
    assert!(
        e.contains("--kv-offloading-size 2000 must be a size in GiB in 0..=1024"),
        "{e}"
    );
    let e = fails(switchyard().args([
        "bench",
        "throughput",
        "--backend",
        "cpu",
        "--num-kv-blocks",
        "0",
    ]));
    assert!(e.contains("--num-kv-blocks must be 1..=16777216"), "{e}");
}
