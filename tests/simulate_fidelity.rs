//! `switchyard simulate` through the real binary: the inputs an operator gets wrong or pastes
//! from elsewhere (a time scale, an empty or exported trace, an unknown tier, a ShareGPT trace
//! without a rate) behave as the server and `bench serve` would have them.

mod common;

use common::{fails, succeeds, switchyard, TempDir};
use std::path::{Path, PathBuf};

fn temp_dir(tag: &str) -> TempDir {
    common::temp_dir("fidelity", tag)
}

/// Writes `spec` as `dir/spec.yaml` and simulates it into `dir/out`.
fn simulate_spec(dir: &Path, spec: &str, out: &str) {
    std::fs::write(dir.join("spec.yaml"), spec).unwrap();
    succeeds(
        switchyard()
            .args(["simulate", "--config"])
            .arg(dir.join("spec.yaml"))
            .arg("--out")
            .arg(dir.join(out)),
    );
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
    simulate_spec(
        &dir,
        "model: smollm2-135m\npolicies: [{name: fcfs}]\n\
         workload: {trace: two.jsonl, format: jsonl, time_scale: 2}\n",
        "yaml",
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
}

/// A field of the per-request records of a run.
fn record_field(out: &Path, field: &str) -> Vec<f64> {
    std::fs::read_to_string(out.join("requests-fcfs.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v[field].as_f64().unwrap()
        })
        .collect()
}

#[test]
fn a_front_end_time_adds_to_each_requests_ttft_and_e2e() {
    // Two requests 4 s apart never meet: each one's TTFT and E2E latency grow by the front
    // end's 2,500 us plus 10 us for each of its 8 prompt tokens, 2.58 ms.
    let dir = temp_dir("front-end");
    std::fs::write(dir.join("two.jsonl"), TWO).unwrap();
    let base = "model: smollm2-135m\npolicies: [{name: fcfs}]\n\
                workload: {trace: two.jsonl, format: jsonl}\n";
    simulate_spec(&dir, base, "without");
    simulate_spec(
        &dir,
        &format!("{base}scheduler: {{front_end_us: 2500, front_end_per_token_us: 10}}\n"),
        "with",
    );
    for field in ["ttft_ms", "e2e_ms"] {
        let without = record_field(&dir.join("without"), field);
        let with = record_field(&dir.join("with"), field);
        assert_eq!(without.len(), 2);
        for (a, b) in without.iter().zip(&with) {
            assert!((b - a - 2.58).abs() < 1e-9, "{field}: {a} -> {b}");
        }
    }
    // Out of its bounds, the spec is refused by the field's name.
    std::fs::write(
        dir.join("bad.yaml"),
        format!("{base}scheduler: {{front_end_us: -1}}\n"),
    )
    .unwrap();
    let err = fails(
        switchyard()
            .args(["simulate", "--config"])
            .arg(dir.join("bad.yaml"))
            .arg("--out")
            .arg(dir.join("bad")),
    );
    assert!(err.contains("scheduler.front_end_us -1 outside"), "{err}");
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
    // A trace tier the run does not define is an error, as the server refuses an unknown
    // tier, also when the command line defines none; `--tiers FILE` reads a `tiers` section.
    std::fs::write(
        dir.join("tier.jsonl"),
        "{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 2, \"tier\": \"premuim\"}\n",
    )
    .unwrap();
    let err = fails(&mut simulate("tier.jsonl", "jsonl"));
    assert!(
        err.contains("tier.jsonl:1") && err.contains("`premuim` is not defined"),
        "{err}"
    );
    std::fs::write(
        dir.join("tiers.yaml"),
        "tiers:\n  premuim: { ttft_ms: 60000 }\n",
    )
    .unwrap();
    succeeds(
        simulate("tier.jsonl", "jsonl")
            .arg("--tiers")
            .arg(dir.join("tiers.yaml")),
    );
    let summary = std::fs::read_to_string(dir.join("out").join("summary.json")).unwrap();
    assert!(summary.contains("premuim"), "{summary}");
    // ShareGPT has no timestamps: a rate or a load must be given.
    std::fs::write(
        dir.join("sg.csv"),
        "num_prefill_tokens,num_decode_tokens\n74,918\n290,905\n",
    )
    .unwrap();
    let err = fails(&mut simulate("sg.csv", "sharegpt"));
    assert!(err.contains("--rate") && err.contains("--load"), "{err}");
    succeeds(simulate("sg.csv", "sharegpt").args(["--rate", "2"]));
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
}

/// The `key: number` lines of a calibration file.
fn calibration_values(path: &Path) -> std::collections::HashMap<String, f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(": "))
        .filter_map(|(k, v)| Some((k.to_string(), v.trim().parse().ok()?)))
        .collect()
}

/// `switchyard calibrate --from-samples steps --output out`: its report.
fn refit(steps: &Path, out: &Path) -> String {
    succeeds(
        switchyard()
            .args(["calibrate", "--from-samples"])
            .arg(steps)
            .arg("--output")
            .arg(out),
    )
}

/// The step shapes a calibration saved in `dir/steps.json`.
fn saved_shapes(dir: &Path) -> Vec<serde_json::Value> {
    let steps: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("steps.json")).unwrap()).unwrap();
    steps["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["shape"].clone())
        .collect()
}

/// `switchyard calibrate` of a small engine (4 sequences a step, a 16 MiB KV cache), one run
/// per step, contexts up to 128, writing `cal.yaml` and `steps.json` in `dir`.
fn small_calibration(dir: &Path) -> std::process::Command {
    let mut cmd = switchyard();
    cmd.args(["calibrate", "--repeats", "1", "--max-context", "128"])
        .args(["--max-kv-tokens", "512"])
        .args(["--set", "scheduler.max_num_seqs=4"])
        .args(["--set", "cache.kv_cache_mb=16", "--output"])
        .arg(dir.join("cal.yaml"))
        .arg("--samples")
        .arg(dir.join("steps.json"));
    cmd
}

/// `switchyard calibrate` measures the embedded model on the CPU over a small sweep, writes a
/// calibration that the simulator runs on (its step times are the fitted model's, plus the
/// engine's host time; its KV cache is the engine's), and refits the very same coefficients
/// from the steps it saved.
#[test]
fn calibrate_fits_the_engine_and_the_simulator_runs_on_the_fit() {
    let dir = temp_dir("calibrate");
    let stdout = succeeds(&mut small_calibration(&dir));
    assert!(stdout.contains("Fit error"), "{stdout}");
    let cal = calibration_values(&dir.join("cal.yaml"));
    // SmolLM2-135M keeps 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 2 bytes (f16) per
    // token: 16 MiB hold 45 blocks of 16 tokens.
    assert_eq!(
        (cal["num_gpu_blocks"], cal["block_size"]),
        (45.0, 16.0),
        "{cal:?}"
    );
    assert!(cal["host_overhead_us"] >= 0.0, "{cal:?}");
    // The chat template and tokenizer were timed on prompts of 16 to 4,096 tokens (below the
    // model's 8,192 of context), and fitted into the front end's two parts.
    let steps: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("steps.json")).unwrap()).unwrap();
    let timed = steps["front_end"].as_array().expect("front_end timings");
    let tokens: Vec<u64> = timed.iter().map(|t| t[0].as_u64().unwrap()).collect();
    assert_eq!(tokens.len(), 5, "{timed:?}");
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]) && tokens[0] >= 16,
        "{tokens:?}"
    );
    assert!(
        timed.iter().all(|t| t[1].as_f64().unwrap() > 0.0),
        "{timed:?}"
    );
    let front_end_us = |prompt: f64| cal["front_end_us"] + cal["front_end_per_token_us"] * prompt;
    assert!(front_end_us(1000.0) > 0.0, "{cal:?}");
    // Decode and prefill steps were measured, none beyond the engine's limits.
    let shapes = saved_shapes(&dir);
    assert!(shapes.iter().all(|s| s["num_seqs"].as_u64().unwrap() <= 4));
    assert!(shapes
        .iter()
        .any(|s| s["num_decode_seqs"].as_u64() == Some(4)));
    assert!(shapes
        .iter()
        .any(|s| s["num_prefill_tokens"].as_u64() == Some(127)));
    // Refitting the saved steps gives the same coefficients.
    refit(&dir.join("steps.json"), &dir.join("refit.yaml"));
    assert_eq!(calibration_values(&dir.join("refit.yaml")), cal);
    // One request of 8 prompt tokens and 2 output tokens: a prefill step (8 tokens, 36
    // attention pairs) and a decode step (9 keys), each with the host's time.
    std::fs::write(dir.join("one.jsonl"), TWO.lines().next().unwrap()).unwrap();
    simulate_spec(
        &dir,
        "model: smollm2-135m\ncalibration: cal.yaml\npolicies: [{name: fcfs}]\n\
         workload: {trace: one.jsonl, format: jsonl}\n",
        "sim",
    );
    let step = |tokens: f64, prefill: f64, decodes: f64, kv: f64, pairs: f64| {
        let knee = cal.get("token_knee").copied().unwrap_or(0.0);
        let s = cal["intercept_s"]
            + cal["per_token_s"] * tokens.max(knee)
            + cal["per_prefill_token_s"] * prefill
            + cal["per_decode_seq_s"] * decodes
            + cal["per_sampled_seq_s"]
            + cal["per_kv_token_s"] * kv
            + cal["per_attention_pair_s"] * pairs;
        (s * 1e6).round() + cal["host_overhead_us"].round()
    };
    // The request reaches the queue after the front end's time for its 8 prompt tokens.
    let want_ms = (front_end_us(8.0).round()
        + step(8.0, 8.0, 0.0, 8.0, 36.0)
        + step(1.0, 0.0, 1.0, 9.0, 9.0))
        / 1e3;
    let record: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(dir.join("sim/requests-fcfs.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let e2e = record["e2e_ms"].as_f64().unwrap();
    assert!(
        (e2e - want_ms).abs() < 0.01,
        "e2e {e2e} ms, the fit says {want_ms}"
    );
    // Bad inputs are refused with the flag named.
    let err = fails(switchyard().args(["calibrate", "--repeats", "0"]));
    assert!(err.contains("--repeats must be 1..="), "{err}");
    std::fs::write(dir.join("bad.json"), "{\"samples\": 3}").unwrap();
    let err = fails(
        switchyard()
            .args(["calibrate", "--from-samples"])
            .arg(dir.join("bad.json")),
    );
    assert!(err.contains("bad.json"), "{err}");
    // The calibration itself given for its steps (the YAML, not the .steps.json): the error
    // names the flag and the file it takes, not only serde's "expected value at line 1".
    std::fs::write(dir.join("cal.yaml"), "intercept_s: 0.001\n").unwrap();
    let err = fails(
        switchyard()
            .args(["calibrate", "--from-samples"])
            .arg(dir.join("cal.yaml")),
    );
    assert!(
        err.contains("--from-samples ")
            && err
                .contains("cal.yaml: not the measured steps that calibrate writes with --samples")
            && err.contains("NAME.steps.json"),
        "{err}"
    );
}

/// `switchyard calibrate` prints and records the `slo-aware` parameters its fit implies: for
/// steps measured as exactly 2 ms + 10 us per token + 5 us more per prompt token, a decode
/// step of 32 sequences takes 2.32 ms (of 8, for an engine of 8 sequences, 2.08 ms) and a
/// prompt token costs 15 us at the margin, whatever the steps a refit leaves out (a
/// standard error of 0). The longest context measured is the 3-sequence step's, 2048 prompt
/// tokens and 2 decodes over 3 sequences, 684 rounded up, and 688 rounded up to 16 tokens:
/// the decode step's context is 688.
#[test]
fn calibrate_prints_and_records_the_slo_aware_parameters_its_fit_implies() {
    let dir = temp_dir("slo-params");
    let mut samples = Vec::new();
    let shape = |seqs: u64, tokens: u64, prefill: u64, context: u64| {
        serde_json::json!({
            "num_seqs": seqs, "num_tokens": tokens, "num_prefill_tokens": prefill,
            "num_decode_seqs": seqs - u64::from(prefill > 0), "num_sampled": seqs,
            "kv_tokens": context + tokens, "attention_pairs": (context + 1) * tokens,
        })
    };
    for (seqs, prefill, context) in [
        (1, 0, 64),
        (4, 0, 512),
        (16, 0, 256),
        (64, 0, 1024),
        (1, 128, 0),
        (1, 512, 0),
        (2, 256, 128),
        (8, 1024, 64),
        (3, 2048, 0),
        (32, 64, 2048),
        (2, 0, 300),
        (1, 64, 32),
    ] {
        let tokens = prefill + seqs - u64::from(prefill > 0);
        let seconds = 2e-3 + 10e-6 * tokens as f64 + 5e-6 * prefill as f64;
        samples.push(
            serde_json::json!({"shape": shape(seqs, tokens, prefill, context), "seconds": seconds}),
        );
    }
    let file = serde_json::json!({
        "model": "test", "hardware": "test", "num_gpu_blocks": 100, "block_size": 16,
        "host_overhead_us": 0.0, "repeats": 1, "samples": samples,
    });
    std::fs::write(dir.join("steps.json"), file.to_string()).unwrap();
    let stdout = refit(&dir.join("steps.json"), &dir.join("cal.yaml"));
    assert!(
        stdout.contains(
            "The fit implies the slo-aware policy's step_overhead_ms 2.32 (±0.0%) (a decode \
             step of 32 sequences at 688 tokens of context) and prefill_us_per_token 15 (±0.0%) \
             (the marginal cost of a 512-token prompt chunk joining it); ± the jackknife's \
             standard error over 10 refits"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("params: {step_overhead_ms: 2.32, prefill_us_per_token: 15}"),
        "{stdout}"
    );
    let cal = std::fs::read_to_string(dir.join("cal.yaml")).unwrap();
    assert!(
        cal.contains("slo_aware:\n  step_overhead_ms: 2.32\n  prefill_us_per_token: 15.0\n"),
        "{cal}"
    );
    // The simulator takes them for a slo-aware policy that leaves them unset.
    std::fs::write(dir.join("one.jsonl"), TWO.lines().next().unwrap()).unwrap();
    simulate_spec(
        &dir,
        "model: smollm2-135m\ncalibration: cal.yaml\npolicies: [{name: slo-aware}]\n\
         workload: {trace: one.jsonl, format: jsonl}\n",
        "sim",
    );
    let summary = std::fs::read_to_string(dir.join("sim/summary.txt")).unwrap();
    assert!(
        summary
            .contains("slo-aware: step_overhead_ms 2.32, prefill_us_per_token 15 from calibration"),
        "{summary}"
    );
    // An engine of 8 sequences never runs a decode step of 32: its reference step is one of 8,
    // 2 ms + 8 x 10 us = 2.08 ms, in calibrate (the samples' max_num_seqs) and in the
    // simulator (the spec's).
    let mut file = file;
    file["max_num_seqs"] = 8.into();
    file["max_num_batched_tokens"] = 2048.into();
    std::fs::write(dir.join("steps8.json"), file.to_string()).unwrap();
    let stdout = refit(&dir.join("steps8.json"), &dir.join("cal8.yaml"));
    assert!(
        stdout.contains(
            "The fit implies the slo-aware policy's step_overhead_ms 2.08 (±0.0%) (a decode \
             step of 8 sequences at 688 tokens of context) and prefill_us_per_token 15"
        ),
        "{stdout}"
    );
    simulate_spec(
        &dir,
        "model: smollm2-135m\ncalibration: cal.yaml\npolicies: [{name: slo-aware}]\n\
         scheduler: {max_num_seqs: 8}\nworkload: {trace: one.jsonl, format: jsonl}\n",
        "sim8",
    );
    let summary = std::fs::read_to_string(dir.join("sim8/summary.txt")).unwrap();
    assert!(
        summary
            .contains("slo-aware: step_overhead_ms 2.08, prefill_us_per_token 15 from calibration"),
        "{summary}"
    );
}

/// `switchyard calibrate --lora DIR` adds steps whose every sequence runs the adapter, loaded as
/// 1, 2 and 4 distinct adapters; the fit reports them apart and prices them, and the simulator
/// charges a request naming an adapter the fitted LoRA terms.
#[test]
fn calibrate_with_lora_measures_adapted_steps_and_the_simulator_prices_them() {
    let dir = temp_dir("calibrate-lora");
    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("gpu/tests/fixtures/lora/smollm2-r4");
    let stdout = succeeds(small_calibration(&dir).arg("--lora").arg(&fixture));
    for want in [
        "LoRA steps ran",
        "rank 4 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        "per_lora_token_s",
        "per_adapter_s",
        "per_lora_step_s",
        "LoRA decode",
        "LoRA prefill",
        "LoRA mixed",
        "Loading the --lora adapter from its directory took",
    ] {
        assert!(stdout.contains(want), "{want}: {stdout}");
    }
    let shapes = saved_shapes(&dir);
    let count = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap();
    // Adapted steps are wholly adapted, over 1, 2 and 4 distinct adapters (and 3, while a
    // mixed measurement's prefill has not joined its decodes); the others have none.
    let mut adapters: Vec<u64> = shapes.iter().map(|s| count(s, "lora_adapters")).collect();
    adapters.sort_unstable();
    adapters.dedup();
    assert!(
        [0, 1, 2, 4].iter().all(|n| adapters.contains(n)) && adapters.last() == Some(&4),
        "{adapters:?}"
    );
    for s in &shapes {
        let lora = count(s, "lora_tokens");
        assert!(lora == 0 || lora == count(s, "num_tokens"), "{s}");
        assert_eq!(lora == 0, count(s, "lora_adapters") == 0, "{s}");
    }
    assert!(
        shapes
            .iter()
            .filter(|s| count(s, "lora_tokens") == 0)
            .count()
            > 10
    );
    // Refitting the saved steps gives the same coefficients.
    refit(&dir.join("steps.json"), &dir.join("refit.yaml"));
    let cal = calibration_values(&dir.join("cal.yaml"));
    assert_eq!(calibration_values(&dir.join("refit.yaml")), cal);
    // One request of 8 prompt tokens and 2 output tokens naming adapter 3, and the same
    // without: the adapted one's steps cost the LoRA terms more (0 where the fit left them).
    let term = |k: &str| cal.get(k).copied().unwrap_or(0.0);
    let lora_step = |tokens: f64| {
        ((term("per_lora_token_s") * tokens + term("per_adapter_s") + term("per_lora_step_s"))
            * 1e6)
            .round()
    };
    let e2e = |adapter: &str| {
        let one = TWO.lines().next().unwrap().replace('}', adapter);
        std::fs::write(dir.join("one.jsonl"), one).unwrap();
        simulate_spec(
            &dir,
            "model: smollm2-135m\ncalibration: cal.yaml\npolicies: [{name: fcfs}]\n\
             workload: {trace: one.jsonl, format: jsonl}\n",
            "sim",
        );
        let record: serde_json::Value = serde_json::from_str(
            std::fs::read_to_string(dir.join("sim/requests-fcfs.jsonl"))
                .unwrap()
                .lines()
                .next()
                .unwrap(),
        )
        .unwrap();
        record["e2e_ms"].as_f64().unwrap()
    };
    let (base, adapted) = (e2e("}"), e2e(", \"adapter\": 3}"));
    // The adapter's load time, measured, is the simulator's where a spec's lora_memory sets
    // none: the one request waits for its adapter that long.
    let load_ms = term("lora_load_ms");
    assert!(load_ms > 0.0, "{cal:?}");
    let one = TWO
        .lines()
        .next()
        .unwrap()
        .replace('}', ", \"adapter\": 3}");
    std::fs::write(dir.join("one.jsonl"), one).unwrap();
    simulate_spec(
        &dir,
        "model: smollm2-135m\ncalibration: cal.yaml\npolicies: [{name: fcfs}]\n\
         scheduler: {lora_memory: {max_cpu_loras: 1}}\n\
         workload: {trace: one.jsonl, format: jsonl}\n",
        "sim-memory",
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("sim-memory/summary.json")).unwrap(),
    )
    .unwrap();
    let memory = &summary["policies"][0]["lora_memory"];
    assert_eq!(memory["load_ms"].as_f64(), Some(load_ms), "{memory}");
    assert_eq!(memory["loads"].as_u64(), Some(1), "{memory}");
    assert_eq!(memory["wait_ms"]["p50"].as_f64(), Some(load_ms), "{memory}");
    assert!(
        memory["load_ms_from"]
            .as_str()
            .unwrap()
            .starts_with("calibration "),
        "{memory}"
    );
    let want = (lora_step(8.0) + lora_step(1.0)) / 1e3;
    assert!(
        (adapted - base - want).abs() < 0.005,
        "adapted {adapted} ms, base {base} ms: the fit says {want} more"
    );
    // --lora measures: it has nothing to add to a refit, and a directory without an adapter is
    // refused naming the flag.
    let err = fails(
        switchyard()
            .args(["calibrate", "--from-samples"])
            .arg(dir.join("steps.json"))
            .arg("--lora")
            .arg(&fixture),
    );
    assert!(err.contains("--lora"), "{err}");
    let err = fails(
        switchyard()
            .args(["calibrate", "--max-context", "128", "--lora"])
            .arg(&dir)
            .arg("--output")
            .arg(dir.join("never.yaml")),
    );
    assert!(err.contains("--lora"), "{err}");
    // ... and not blamed on the rank bound: the directory has no adapter at all.
    assert!(!err.contains("max_lora_rank"), "{err}");
}

/// Regression: `calibrate --lora` took an adapter of any rank up to the largest any
/// configuration allows, though the server it calibrates refuses ranks past its
/// `lora.max_lora_rank`; such an adapter is refused, the message naming the flag and the bound
/// (once: the loader's own error names it; a missing file is not blamed on the rank),
/// and nothing is written.
#[test]
fn calibrate_refuses_an_adapter_past_the_configured_max_lora_rank() {
    let dir = temp_dir("calibrate-lora-rank");
    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("gpu/tests/fixtures/lora/smollm2-r4");
    let stderr = fails(
        small_calibration(&dir)
            .args(["--set", "lora.max_lora_rank=2", "--lora"])
            .arg(&fixture),
    );
    for want in ["--lora", "rank 4 is outside 1..=2 (max_lora_rank)"] {
        assert!(stderr.contains(want), "{want}: {stderr}");
    }
    assert!(!dir.join("cal.yaml").exists());
}

/// Steps measured on the H200 (`switchyard calibrate --dummy smollm2-135m --lora
/// gpu/tests/fixtures/lora/smollm2-r4 --repeats 2` with `model.backend: cuda`, 363 distinct
/// steps): an adapted decode costs ~0.55 ms more than a plain one at batch 1, 4 and 16 alike
/// (the LoRA kernels launched per projection and layer). The step term prices it; with
/// per-token and per-adapter terms alone the fit missed the adapted decodes by 18% at the
/// median.
#[test]
fn refitting_h200_steps_prices_adapted_decodes() {
    let dir = temp_dir("calibrate-h200");
    let steps = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/calibrate/h200-smollm2-r4.steps.json");
    let stdout = refit(&steps, &dir.join("cal.yaml"));
    // "  LoRA decode      98: median 2.4%, worst 5.8%" -> (2.4, 5.8)
    let errors = |kind: &str| -> (f64, f64) {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(kind))
            .unwrap_or_else(|| panic!("no {kind} line: {stdout}"));
        let number = |label: &str| -> f64 {
            let at = line.find(label).expect(label) + label.len();
            line[at..].split('%').next().unwrap().parse().unwrap()
        };
        (number("median "), number("worst "))
    };
    let (median, worst) = errors("LoRA decode");
    assert!(median <= 5.0 && worst <= 10.0, "{stdout}");
    let cal = calibration_values(&dir.join("cal.yaml"));
    // The adapted step's extra cost is the measured one (1.11 - 0.555 ms at batch 1), less the
    // per-adapter and per-token shares the fit gives the rest of it.
    let step = cal["per_lora_step_s"];
    assert!((3.5e-4..6.5e-4).contains(&step), "per_lora_step_s {step}");
}

/// Closed-loop clients started together send in step unless their think times or start
/// jitter spread them: a record's `think_s` delays a client's next request after the one
/// before it ended (scaled with the arrivals by `time_scale`), and `workload.clients` draws
/// think times and start jitter from the seed; a think time out of bounds is refused.
#[test]
fn closed_loop_clients_think_and_start_apart() {
    let dir = temp_dir("clients");
    // 4 clients of 3 requests each, all at 0 s; c0's last request with its own think time.
    let mut trace = String::new();
    for i in 0..3 {
        for c in 0..4 {
            let think = if (c, i) == (0, 2) {
                r#", "think_s": 2"#
            } else {
                ""
            };
            trace.push_str(&format!(
                "{{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 2, \
                 \"client\": \"c{c}\"{think}}}\n"
            ));
        }
    }
    std::fs::write(dir.join("clients.jsonl"), trace).unwrap();
    let spec = |extra: &str| {
        format!(
            "seed: 5\nmodel: smollm2-135m\npolicies: [{{name: fcfs}}]\n\
             workload: {{trace: clients.jsonl, format: jsonl{extra}}}\n"
        )
    };
    simulate_spec(&dir, &spec(""), "plain");
    let plain = arrivals(&dir.join("plain"));
    // The clients' i-th requests go together, c0's last 2 s after its second ended.
    for i in 0..3 {
        let first = if i == 2 { 1 } else { 0 };
        let group = &plain[4 * i + first..4 * i + 4];
        assert!(group.iter().all(|&t| t == group[0]), "{plain:?}");
    }
    assert!(plain[8] >= plain[4] + 2.0, "{plain:?}");
    // Half as fast: the think time doubles with the trace's timeline.
    simulate_spec(&dir, &spec(", time_scale: 0.5"), "slow");
    let slow = arrivals(&dir.join("slow"));
    assert!(slow[8] >= slow[4] + 4.0, "{slow:?}");

    simulate_spec(
        &dir,
        &spec(", clients: {think_s: 0.5, start_jitter_s: 3}"),
        "spread",
    );
    let spread = arrivals(&dir.join("spread"));
    let mut distinct = spread.clone();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup();
    assert_eq!(distinct.len(), 12, "{spread:?}");
    assert!(
        spread[..4].iter().all(|t| (0.0..3.0).contains(t)),
        "{spread:?}"
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("spread").join("summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["arrival_rate_of"], "trace");
    assert!(summary["policies"][0]["offered_rate"].as_f64().unwrap() > 0.0);

    for (bad, want) in [
        (
            ", clients: {think_s: -1}",
            "workload.clients.think_s -1 outside [0, 3600]",
        ),
        (
            ", clients: {start_jitter_s: .nan}",
            "workload.clients.start_jitter_s NaN outside",
        ),
    ] {
        std::fs::write(dir.join("bad.yaml"), spec(bad)).unwrap();
        let err = fails(
            switchyard()
                .args(["simulate", "--config"])
                .arg(dir.join("bad.yaml"))
                .arg("--out")
                .arg(dir.join("bad")),
        );
        assert!(err.contains(want), "{err}");
    }
    std::fs::write(
        dir.join("huge.jsonl"),
        "{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 2, \"client\": \"c\", \
         \"think_s\": 1e300}\n",
    )
    .unwrap();
    let err = fails(
        switchyard()
            .args(["simulate", "--format", "jsonl", "--trace"])
            .arg(dir.join("huge.jsonl"))
            .arg("--out")
            .arg(dir.join("huge")),
    );
    assert!(
        err.contains("huge.jsonl:1: field `think_s`: expected seconds between 0 and 3600"),
        "{err}"
    );
}
