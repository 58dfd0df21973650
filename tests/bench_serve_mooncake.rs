//! `switchyard bench serve --dataset mooncake` through the real binary against a real server
//! (SmolLM2 on the CPU, loopback): rows that share hash ids are sent as prompts that share
//! their blocks, and the report counts what the server's prefix cache served beside what the
//! trace itself could reuse.
//!
//! The expected counts follow from the trace and the prefix cache's rule alone: a prompt of
//! `p` tokens whose first `s` tokens were sent before reuses the whole KV blocks of them before
//! its last token, `min(s, (p - 1) / B * B)` for blocks of `B` tokens (vLLM's rule, which
//! tests/server_cached_tokens.rs pins on the server).

mod common;

use common::{fails, switchyard, Server, TempDir};
use std::path::Path;

/// Tokens per KV block of the servers below, and per trace block of the runs.
const BLOCK: usize = 16;

fn temp_dir(name: &str) -> TempDir {
    common::temp_dir("bench-mooncake", name)
}

/// A Mooncake trace of four rows at the format's 512 tokens a hash id, which
/// `--mooncake-block-tokens 16` sends at 1/32 the length:
/// - row 1: ids 1, 2, 3, 1536 tokens: 48 sent, nothing before it;
/// - row 2: ids 1, 2, 7, 1200 tokens: 38 sent (16 + 16 + 6), the first 32 as row 1's;
/// - row 3: id 9, 512 tokens: 16 sent, shares nothing;
/// - row 4: row 1 again: 48 sent, all of them row 1's.
const TRACE: &str = r#"{"timestamp": 0, "input_length": 1536, "output_length": 2, "hash_ids": [1, 2, 3]}
{"timestamp": 100, "input_length": 1200, "output_length": 2, "hash_ids": [1, 2, 7]}
{"timestamp": 200, "input_length": 512, "output_length": 2, "hash_ids": [9]}
{"timestamp": 300, "input_length": 1536, "output_length": 2, "hash_ids": [1, 2, 3]}
"#;

/// Prompt tokens of the trace's rows as sent.
const INPUT: usize = 48 + 38 + 16 + 48;

/// Prompt tokens in blocks an earlier row sent: row 2's first two blocks, all of row 4.
const TRACE_REUSABLE: usize = 32 + 48;

/// Prompt tokens a prefix cache that keeps everything serves: row 2 reuses its 32 shared
/// tokens ((38 - 1) / 16 = 2 whole blocks before its last token), row 4 the 2 whole blocks
/// before its last token ((48 - 1) / 16 = 2), not its third.
const SERVED: usize = 32 + (48 - 1) / BLOCK * BLOCK;

fn server(name: &str, prefix_caching: bool) -> Server {
    Server::start(
        name,
        &format!("cache:\n  block_size: {BLOCK}\n  prefix_caching: {prefix_caching}\n"),
    )
}

/// Runs the trace at `path` through `bench serve --dataset mooncake` against `server`, one
/// request at a time (so a row's predecessors are finished and cached), writing `result`;
/// returns stdout.
fn bench(server: &Server, path: &Path, result: &Path) -> String {
    bench_slice(server, path, result, &["--num-prompts", "10"], 4)
}

/// [`bench`] with `args` choosing the rows, checking that `rows` requests were sent.
fn bench_slice(server: &Server, path: &Path, result: &Path, args: &[&str], rows: usize) -> String {
    let out = switchyard()
        .args(["bench", "serve", "--dataset", "mooncake", "--dataset-path"])
        .arg(path)
        .args(["--mooncake-block-tokens", &BLOCK.to_string()])
        .args(args)
        .args(["--max-concurrency", "1"])
        .args(["--num-warmups", "2"])
        .arg("--base-url")
        .arg(format!("http://127.0.0.1:{}", server.port))
        .arg("--result-file")
        .arg(result)
        .output()
        .expect("run switchyard");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}\nlog:\n{}", server.log());
    assert!(
        stderr.contains(&format!("bench serve: {rows}/{rows} requests (0 failed)")),
        "{stderr}"
    );
    stdout
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("the result file")).expect("JSON")
}

/// The line of `stdout` with `label`, its value.
fn value<'a>(stdout: &'a str, label: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(label))
        .unwrap_or_else(|| panic!("no {label} in\n{stdout}"))
        .trim()
}

#[test]
fn bench_serve_mooncake_sends_shared_blocks_the_prefix_cache_serves() {
    let dir = temp_dir("ok");
    let trace = dir.join("trace.jsonl");
    std::fs::write(&trace, TRACE).unwrap();

    let on = server("bench-mooncake-on", true);
    let result = dir.join("on.json");
    let stdout = bench(&on, &trace, &result);
    assert_eq!(value(&stdout, "Total input tokens:"), INPUT.to_string());
    assert_eq!(
        value(&stdout, "Cached prompt tokens:"),
        SERVED.to_string(),
        "{stdout}\nlog:\n{}",
        on.log()
    );
    assert_eq!(
        value(&stdout, "Trace's reusable prompt tokens:"),
        TRACE_REUSABLE.to_string()
    );
    let v = read_json(&result);
    assert_eq!(v["total_input_tokens"], INPUT, "{v}");
    assert_eq!(v["total_cached_prompt_tokens"], SERVED, "{v}");
    let fraction = v["cached_prompt_token_fraction"].as_f64().unwrap();
    assert!(
        (fraction - SERVED as f64 / INPUT as f64).abs() < 1e-12,
        "{v}"
    );
    assert_eq!(v["trace_reusable_prompt_tokens"], TRACE_REUSABLE, "{v}");
    assert_eq!(v["trace_prompt_tokens"], INPUT, "{v}");
    // The warmups' prompts are random: they put none of the run's blocks in the cache, so
    // the first row found nothing (the run's cached tokens are the later rows' alone).
    drop(on);

    // Without prefix caching the server reports none; the trace's own reuse is the same.
    let off = server("bench-mooncake-off", false);
    let result = dir.join("off.json");
    let stdout = bench(&off, &trace, &result);
    assert_eq!(value(&stdout, "Cached prompt tokens:"), "0", "{stdout}");
    let v = read_json(&result);
    assert_eq!(v["total_cached_prompt_tokens"], 0, "{v}");
    assert_eq!(v["trace_reusable_prompt_tokens"], TRACE_REUSABLE, "{v}");
}

/// `--skip-rows 3 --num-prompts 3` sends rows 3 to 5 alone: the skipped rows are not read (the
/// first line, a CSV header, is no row at all and passes the start check as a skipped row;
/// row 2 is one the run would refuse, as is row 6 after the slice), and reuse counts within
/// the slice (row 4 repeats row 1, which was skipped, so it is neither the trace's reusable
/// tokens nor in the server's cache). With `--mooncake-block-tokens 16`:
/// - row 3: id 9, 512 tokens: 16 sent;
/// - row 4: ids 1, 2, 3, 1536 tokens: 48 sent, nothing of the slice before it;
/// - row 5: ids 9, 10, 1024 tokens: 32 sent, its first 16 row 3's, which the cache serves
///   (`min(16, (32 - 1) / 16 * 16)`).
#[test]
fn bench_serve_mooncake_skip_rows_sends_the_slice_alone() {
    let dir = temp_dir("skip");
    let trace = dir.join("trace.jsonl");
    let bad = r#"{"timestamp": 100, "input_length": 5000, "output_length": 2, "hash_ids": [4]}"#;
    std::fs::write(
        &trace,
        format!(
            r#"timestamp,input_length,output_length
{{"timestamp": 0, "input_length": 1536, "output_length": 2, "hash_ids": [1, 2, 3]}}
{bad}
{{"timestamp": 200, "input_length": 512, "output_length": 2, "hash_ids": [9]}}
{{"timestamp": 300, "input_length": 1536, "output_length": 2, "hash_ids": [1, 2, 3]}}
{{"timestamp": 400, "input_length": 1024, "output_length": 2, "hash_ids": [9, 10]}}
{bad}
"#
        ),
    )
    .unwrap();
    let input = 16 + 48 + 32;
    let on = server("bench-mooncake-skip", true);
    let result = dir.join("skip.json");
    let args = ["--skip-rows", "3", "--num-prompts", "3"];
    let stdout = bench_slice(&on, &trace, &result, &args, 3);
    assert_eq!(value(&stdout, "Total input tokens:"), input.to_string());
    assert_eq!(
        value(&stdout, "Cached prompt tokens:"),
        "16",
        "{stdout}\nlog:\n{}",
        on.log()
    );
    assert_eq!(value(&stdout, "Trace's reusable prompt tokens:"), "16");
    let v = read_json(&result);
    assert_eq!(v["completed"], 3, "{v}");
    assert_eq!(v["total_input_tokens"], input, "{v}");
    assert_eq!(v["trace_prompt_tokens"], input, "{v}");
    assert_eq!(v["trace_reusable_prompt_tokens"], 16, "{v}");
    assert_eq!(v["total_cached_prompt_tokens"], 16, "{v}");
}

/// A bad row stops the run before any request (nothing listens at the URL: a run that went
/// on would fail to connect instead), naming the file, line and field.
#[test]
fn bench_serve_mooncake_refuses_a_bad_row_by_file_and_line() {
    let dir = temp_dir("bad");
    let trace = dir.join("bad.jsonl");
    let bad = r#"{"timestamp": 400, "input_length": 5000, "output_length": 2, "hash_ids": [4]}"#;
    std::fs::write(&trace, format!("{TRACE}{bad}\n")).unwrap();
    let err = fails(
        switchyard()
            .args(["bench", "serve", "--dataset", "mooncake", "--dataset-path"])
            .arg(&trace)
            .args(["--base-url", "http://127.0.0.1:1"]),
    );
    assert!(
        err.contains(&format!(
            "{}:5: field hash_ids: 1 ids for 5000 tokens",
            trace.display()
        )),
        "{err}"
    );
    // A first line that is no row, read as one: refused at the start check, by its line;
    // skipped, it passes that check and the run reads on (to the bad row).
    std::fs::write(&trace, format!("timestamp,input_length\n{TRACE}{bad}\n")).unwrap();
    let run = |skip: &str| {
        fails(
            switchyard()
                .args(["bench", "serve", "--dataset", "mooncake", "--dataset-path"])
                .arg(&trace)
                .args(["--skip-rows", skip, "--base-url", "http://127.0.0.1:1"]),
        )
    };
    let err = run("0");
    assert!(
        err.contains(&format!(
            "{}:1: not JSON Lines of objects (its first character is `t`, not `{{`)",
            trace.display()
        )),
        "{err}"
    );
    let err = run("1");
    assert!(
        err.contains(&format!(
            "{}:6: field hash_ids: 1 ids for 5000 tokens",
            trace.display()
        )),
        "{err}"
    );
    let err = fails(switchyard().args([
        "bench",
        "serve",
        "--dataset",
        "mooncake",
        "--mooncake-block-tokens",
        "4097",
    ]));
    assert!(
        err.contains("--mooncake-block-tokens must be 1..=4096, not 4097"),
        "{err}"
    );
}
