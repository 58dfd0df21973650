//! `switchyard bench serve --endpoint embeddings` through the real binary against a real
//! server (SmolLM2 on the CPU, loopback): what it reports, what it counts and how a failing
//! server shows.

mod common;

use common::{fails, succeeds, switchyard, Server, TempDir};
use std::path::Path;

/// SmolLM2-135M's hidden size: the length of its embeddings.
const HIDDEN_SIZE: u64 = 576;

fn temp_dir(name: &str) -> TempDir {
    common::temp_dir("bench-embed", name)
}

/// Runs `bench serve --endpoint embeddings` with `extra` against `server`, writing
/// `result`; returns the status, stdout and stderr.
fn bench(server: &Server, extra: &[&str], result: &Path) -> (bool, String, String) {
    let out = switchyard()
        .args(["bench", "serve", "--endpoint", "embeddings"])
        .args(extra)
        .arg("--base-url")
        .arg(format!("http://127.0.0.1:{}", server.port))
        .arg("--result-file")
        .arg(result)
        .output()
        .expect("run switchyard");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("the result file")).expect("JSON")
}

#[test]
fn bench_serve_embeddings_reports_vllm_labels_tokens_and_the_vectors_length() {
    let server = Server::start("bench-embed", "");
    let dir = temp_dir("ok");
    let result = dir.join("one.json");
    let tokens = || {
        server
            .metric("switchyard:prompt_tokens_total")
            .expect("prompt_tokens_total")
    };
    let tokens_before = tokens();
    let (ok, stdout, stderr) = bench(
        &server,
        &[
            "--num-prompts",
            "8",
            "--input-len",
            "16",
            "--max-concurrency",
            "4",
            "--num-warmups",
            "2",
        ],
        &result,
    );
    assert!(ok, "{stderr}\nlog:\n{}", server.log());
    assert!(
        stderr.contains("bench serve: 8/8 requests (0 failed), done in "),
        "{stderr:?}"
    );
    for label in [
        "Successful requests:",
        "Failed requests:",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Request throughput (req/s):",
        "Total Token throughput (tok/s):",
        "Embedding dimension:",
        "Mean E2EL (ms):",
        "Median E2EL (ms):",
        "P99 E2EL (ms):",
    ] {
        assert!(stdout.contains(label), "missing {label} in\n{stdout}");
    }
    // Nothing is generated: no token timings, no output tokens.
    for label in ["TTFT", "TPOT", "ITL", "generated tokens"] {
        assert!(!stdout.contains(label), "{label} in\n{stdout}");
    }
    let v = read_json(&result);
    assert_eq!(v["endpoint"], "embeddings", "{v}");
    assert_eq!(v["completed"], 8, "{v}");
    assert_eq!(v["failed"], 0, "{v}");
    assert_eq!(v["completed_inputs"], 8, "{v}");
    assert_eq!(v["total_input_tokens"], 8 * 16, "{v}");
    assert_eq!(v["embedding_dimension"], HIDDEN_SIZE, "{v}");
    assert_eq!(v["embedding_batch"], 1, "{v}");
    let e2el = v["median_e2el_ms"].as_f64().expect("median E2EL");
    assert!(
        e2el > 0.0 && e2el <= v["p99_e2el_ms"].as_f64().unwrap(),
        "{v}"
    );
    // The server computed the test request's, the warmups' and the run's prompts.
    assert_eq!(tokens() - tokens_before, ((1 + 2 + 8) * 16) as f64);

    // Four prompts a request: 10 prompts are 3 requests (4, 4 and 2), every prompt counted.
    let result = dir.join("four.json");
    let (ok, stdout, stderr) = bench(
        &server,
        &[
            "--num-prompts",
            "10",
            "--input-len",
            "16",
            "--embedding-batch",
            "4",
            "--max-concurrency",
            "2",
        ],
        &result,
    );
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("bench serve: 3/3 requests (0 failed)"),
        "{stderr}"
    );
    assert!(stdout.contains("Embedded inputs:"), "{stdout}");
    let v = read_json(&result);
    assert_eq!(v["completed"], 3, "{v}");
    assert_eq!(v["completed_inputs"], 10, "{v}");
    assert_eq!(v["total_input_tokens"], 10 * 16, "{v}");
    assert_eq!(v["embedding_dimension"], HIDDEN_SIZE, "{v}");
    assert_eq!(v["embedding_batch"], 4, "{v}");
}

/// The prompt tokens the server's prefix cache served (its answers' `usage`) and, with the
/// mooncake dataset, the trace's own reuse are reported for embeddings as for completions:
/// the `Prefix Reuse` section and its `--result-file` fields (they used to be left out of an
/// embeddings run's report).
#[test]
fn bench_serve_embeddings_reports_the_prefix_cache_and_the_traces_reuse() {
    let server = Server::start("bench-embed-reuse", "");
    let dir = temp_dir("reuse");
    let cached = || {
        server
            .metric("switchyard:prompt_tokens_cached_total")
            .expect("prompt_tokens_cached_total")
    };
    let args = [
        "--num-prompts",
        "4",
        "--input-len",
        "48",
        "--max-concurrency",
        "1",
    ];
    // Four random prompts, none seen before; then the same four again, each served from the
    // cache but for its last block: 32 of its 48 tokens. The server also counts the test
    // request, the same one in both runs (its own prompt, not in the report).
    for (name, expected, test_request) in [("first", 0u64, 0u64), ("again", 4 * 32, 32)] {
        let result = dir.join(format!("{name}.json"));
        let before = cached();
        let (ok, stdout, stderr) = bench(&server, &args, &result);
        assert!(ok, "{stderr}");
        assert!(stdout.contains("Prefix Reuse"), "{stdout}");
        assert!(
            stdout.contains(&format!(
                "Cached prompt tokens:                   {expected}\n"
            )),
            "{stdout}"
        );
        let v = read_json(&result);
        assert_eq!(v["total_cached_prompt_tokens"], expected, "{v}");
        let fraction = v["cached_prompt_token_fraction"]
            .as_f64()
            .expect("fraction");
        assert!(
            (fraction - expected as f64 / (4.0 * 48.0)).abs() < 1e-9,
            "{v}"
        );
        assert_eq!(
            cached() - before,
            (expected + test_request) as f64,
            "the server's counter"
        );
    }

    // A mooncake slice: row 2 repeats row 1's block (16 tokens a block), which the trace
    // could reuse and the server's cache serves.
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [71]}\n\
         {\"timestamp\": 10, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [71, 72]}\n",
    )
    .expect("write the trace");
    let result = dir.join("mooncake.json");
    let trace_arg = trace.display().to_string();
    let (ok, stdout, stderr) = bench(
        &server,
        &[
            "--dataset",
            "mooncake",
            "--dataset-path",
            &trace_arg,
            "--mooncake-block-tokens",
            "16",
            "--num-prompts",
            "2",
            "--max-concurrency",
            "1",
        ],
        &result,
    );
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("Trace's reusable prompt tokens:"),
        "{stdout}"
    );
    let v = read_json(&result);
    assert_eq!(v["total_input_tokens"], 16 + 32, "{v}");
    assert_eq!(v["trace_prompt_tokens"], 16 + 32, "{v}");
    assert_eq!(v["trace_reusable_prompt_tokens"], 16, "{v}");
    assert_eq!(v["total_cached_prompt_tokens"], 16, "{v}");
}

/// Prompts longer than the server's context are refused (400): those requests count as
/// failed, with the server's reason; a test request that fails stops the run before it starts.
#[test]
fn bench_serve_embeddings_counts_refused_requests_as_failed() {
    let server = Server::start_full("bench-embed-fail", "  max_model_len: 64\n", "", "");
    let dir = temp_dir("fail");
    // A trace keeps its rows in order: 16 tokens, then 100 (too long), and so on.
    let trace = dir.join("trace.csv");
    let mut csv = String::from("ContextTokens,GeneratedTokens,TIMESTAMP\n");
    for i in 0..8 {
        let tokens = if i % 2 == 0 { 16 } else { 100 };
        csv.push_str(&format!("{tokens},1,2023-11-16 18:15:46.0000000\n"));
    }
    std::fs::write(&trace, csv).unwrap();
    let dataset = [
        "--dataset",
        "trace",
        "--dataset-path",
        trace.to_str().unwrap(),
    ];
    let result = dir.join("result.json");
    let mut args = dataset.to_vec();
    args.extend(["--num-prompts", "8", "--max-concurrency", "4"]);
    let (ok, stdout, stderr) = bench(&server, &args, &result);
    // Some succeeded: the run reports, and exits 0.
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("bench serve: 8/8 requests (4 failed)")
            && stderr.contains("first failure: HTTP 400"),
        "{stderr}"
    );
    assert!(stdout.contains("Failed requests:"), "{stdout}");
    let v = read_json(&result);
    assert_eq!(
        (v["completed"].as_u64(), v["failed"].as_u64()),
        (Some(4), Some(4)),
        "{v}"
    );
    assert_eq!(v["total_input_tokens"], 4 * 16, "{v}");

    // In pairs, every request holds a prompt too long: the test request fails, with why.
    let mut args = dataset.to_vec();
    args.extend(["--num-prompts", "8", "--embedding-batch", "2"]);
    let (ok, _, stderr) = bench(&server, &args, &dir.join("pairs.json"));
    assert!(!ok);
    assert!(
        stderr.contains("initial test request failed")
            && stderr.contains("HTTP 400")
            && stderr.contains("context length"),
        "{stderr}"
    );
    assert!(!dir.join("pairs.json").exists());
}

/// Flags that make no sense together are refused before anything is sent (nothing listens
/// at the URL: a run that went on would fail to connect instead).
#[test]
fn bench_serve_refuses_an_embedding_batch_without_the_embeddings_endpoint() {
    let base = ["bench", "serve", "--base-url", "http://127.0.0.1:1"];
    let err = fails(switchyard().args(base).args(["--embedding-batch", "4"]));
    assert!(
        err.contains("--embedding-batch needs --endpoint embeddings"),
        "{err}"
    );
    let err = fails(switchyard().args(base).args([
        "--endpoint",
        "embeddings",
        "--embedding-batch",
        "4096",
    ]));
    assert!(err.contains("--embedding-batch must be 1..=2048"), "{err}");
    let err = fails(switchyard().args(base).args(["--endpoint", "embedding"]));
    assert!(
        err.contains("completions") && err.contains("embeddings"),
        "{err}"
    );
    // The help says what --num-prompts counts.
    let help = succeeds(switchyard().args(["bench", "serve", "--help"]));
    assert!(
        help.contains("--embedding-batch") && help.contains("counts prompts, not requests"),
        "{help}"
    );
}
