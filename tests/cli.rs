//! The command line as a user runs it: `config check`, `simulate` and `bench serve` through
//! the real binary.

mod common;

use common::Server;
use std::path::PathBuf;
use std::process::Command;

fn switchyard() -> Command {
    Command::new(env!("CARGO_BIN_EXE_switchyard"))
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("switchyard-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn config_check_prints_the_effective_config_and_locates_errors() {
    let out = switchyard()
        .args([
            "config",
            "check",
            "config/examples/multi-tenant.yaml",
            "--set",
            "server.port=9123",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml = String::from_utf8_lossy(&out.stdout);
    assert!(yaml.contains("port: 9123"), "{yaml}");
    assert!(yaml.contains("slo-aware"), "{yaml}");

    let dir = temp_dir("config");
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "server:\n  port: 80\ncache:\n  block_size: 0\n").unwrap();
    let out = switchyard()
        .args(["config", "check"])
        .arg(&bad)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:4", bad.display())),
        "error does not name file and line: {err}"
    );
    assert!(
        err.contains("block_size"),
        "error does not name the field: {err}"
    );
}

#[test]
fn simulate_writes_summary_requests_and_plots_for_each_policy() {
    let dir = temp_dir("simulate");
    let trace = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/traces/AzureLLMInferenceTrace_code.csv");
    assert!(
        trace.exists(),
        "{} is missing (CI has ../shared beside the checkout)",
        trace.display()
    );
    let out = switchyard()
        .args([
            "simulate",
            "--format",
            "azure",
            "--policies",
            "fcfs,slo-aware",
            "--limit",
            "300",
            "--seed",
            "3",
            "--trace",
        ])
        .arg(&trace)
        .arg("--out")
        .arg(&dir)
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("fcfs") && table.contains("slo-aware"),
        "{table}"
    );
    for file in [
        "summary.json",
        "summary.txt",
        "requests-fcfs.jsonl",
        "requests-slo-aware.jsonl",
        "ttft_cdf.svg",
        "e2e_cdf.svg",
        "queue.svg",
        "kv_usage.svg",
    ] {
        assert!(dir.join(file).exists(), "{file} was not written");
    }
    let lines = std::fs::read_to_string(dir.join("requests-fcfs.jsonl"))
        .unwrap()
        .lines()
        .count();
    assert_eq!(lines, 300);

    let out = switchyard()
        .args([
            "simulate",
            "--format",
            "azure",
            "--policies",
            "fcfs,nope",
            "--trace",
        ])
        .arg(&trace)
        .arg("--out")
        .arg(&dir)
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("known policies: fcfs"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bench_serve_reports_vllm_labels_against_a_live_server() {
    let server = Server::start("bench", "");
    let dir = temp_dir("bench");
    let result = dir.join("result.json");
    let out = switchyard()
        .args([
            "bench",
            "serve",
            "--max-concurrency",
            "4",
            "--num-prompts",
            "6",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--base-url",
        ])
        .arg(format!("http://127.0.0.1:{}", server.port))
        .arg("--result-file")
        .arg(&result)
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for label in [
        "Successful requests:",
        "Benchmark duration (s):",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Median TTFT (ms):",
        "P99 TPOT (ms):",
        "Mean ITL (ms):",
    ] {
        assert!(stdout.contains(label), "missing {label} in\n{stdout}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&result).unwrap()).unwrap();
    assert_eq!(v["completed"], 6);
    assert_eq!(v["total_output_tokens"], 48);
}
