//! `switchyard simulate` through the real binary: the inputs an operator gets wrong or pastes
//! from elsewhere (a time scale, an empty or exported trace, an unknown tier, a ShareGPT trace
//! without a rate) behave as the server and `bench serve` would have them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn switchyard() -> Command {
    Command::new(env!("CARGO_BIN_EXE_switchyard"))
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sy-fidelity-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("run switchyard")
}

fn succeeds(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fails(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(!out.status.success(), "{cmd:?} should have failed");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Arrival times (s) of the per-request records of a run.
fn arrivals(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("requests-fcfs.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["arrival_s"].as_f64().unwrap()
        })
        .collect()
}

const TWO: &str = "{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 2}\n\
                   {\"arrival_s\": 4, \"prompt_len\": 8, \"output_len\": 2}\n";

#[test]
fn yaml_and_flag_time_scales_both_divide_arrival_times() {
    let dir = temp_dir("scale");
    std::fs::write(dir.join("two.jsonl"), TWO).unwrap();
    std::fs::write(
        dir.join("spec.yaml"),
        "model: smollm2-135m\npolicies: [{name: fcfs}]\n\
         workload: {trace: two.jsonl, format: jsonl, time_scale: 2}\n",
    )
    .unwrap();
    succeeds(
        switchyard()
            .args(["simulate", "--config"])
            .arg(dir.join("spec.yaml"))
            .arg("--out")
            .arg(dir.join("yaml")),
    );
    succeeds(
        switchyard()
            .args(["simulate", "--format", "jsonl", "--model", "smollm2-135m"])
            .args(["--time-scale", "2", "--trace"])
            .arg(dir.join("two.jsonl"))
            .arg("--out")
            .arg(dir.join("flag")),
    );
    assert_eq!(
        arrivals(&dir.join("yaml")),
        vec![0.0, 2.0],
        "2 = twice as fast"
    );
    assert_eq!(arrivals(&dir.join("flag")), vec![0.0, 2.0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inputs_without_requests_or_with_unknown_tiers_are_errors() {
    let dir = temp_dir("inputs");
    let simulate = |trace: &str, format: &str| {
        let mut cmd = switchyard();
        cmd.args(["simulate", "--format", format, "--trace"])
            .arg(dir.join(trace))
            .arg("--out")
            .arg(dir.join("out"));
        cmd
    };
    std::fs::write(dir.join("empty.jsonl"), "").unwrap();
    let err = fails(&mut simulate("empty.jsonl", "jsonl"));
    assert!(err.contains("the trace has no requests"), "{err}");
    std::fs::write(
        dir.join("hdr.csv"),
        "TIMESTAMP,ContextTokens,GeneratedTokens\n",
    )
    .unwrap();
    let err = fails(simulate("hdr.csv", "azure").args(["--load", "0.5"]));
    assert!(err.contains("the trace has no requests"), "{err}");
    // The command line defines no tiers: a trace's tiers are labels without targets, and no
    // request counts as meeting an SLO it does not have (a spec that defines tiers refuses
    // one it does not define: the simulator's unit tests).
    std::fs::write(
        dir.join("tier.jsonl"),
        "{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 2, \"tier\": \"premuim\"}\n",
    )
    .unwrap();
    succeeds(&mut simulate("tier.jsonl", "jsonl"));
    let summary = std::fs::read_to_string(dir.join("out").join("summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    assert!(
        summary.to_string().contains("\"slo_attainment\":null"),
        "{summary}"
    );
    // ShareGPT has no timestamps: a rate or a load must be given.
    std::fs::write(
        dir.join("sg.csv"),
        "num_prefill_tokens,num_decode_tokens\n74,918\n290,905\n",
    )
    .unwrap();
    let err = fails(&mut simulate("sg.csv", "sharegpt"));
    assert!(err.contains("--rate") && err.contains("--load"), "{err}");
    succeeds(simulate("sg.csv", "sharegpt").args(["--rate", "2"]));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn exported_csv_and_iso_timestamps_are_read_and_long_requests_refused() {
    let dir = temp_dir("csv");
    // A spreadsheet's byte order mark, ISO 8601 times, and a request longer than
    // Llama-3-8B's 8,192 tokens of context.
    std::fs::write(
        dir.join("t.csv"),
        "\u{feff}TIMESTAMP,ContextTokens,GeneratedTokens\n\
         2023-11-16T18:17:03Z,100,10\n2023-11-16T18:17:04.5Z,9000,10\n",
    )
    .unwrap();
    let table = succeeds(
        switchyard()
            .args(["simulate", "--format", "azure", "--trace"])
            .arg(dir.join("t.csv"))
            .arg("--out")
            .arg(dir.join("out")),
    );
    assert!(table.contains("max_model_len 8192"), "{table}");
    assert!(table.contains("1 of 2 requests rejected"), "{table}");
    assert_eq!(arrivals(&dir.join("out")), vec![0.0, 1.5]);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("out/summary.json")).unwrap())
            .unwrap();
    let p = &summary["policies"][0];
    assert_eq!(
        (p["finished"].as_u64(), p["rejected"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(p["slo_attainment"].is_null(), "no tier has targets: {p}");
    std::fs::remove_dir_all(&dir).unwrap();
}
