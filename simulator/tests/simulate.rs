//! End-to-end runs of the simulator through its public entry point.

use std::path::{Path, PathBuf};
use switchyard_simulator::{run, SimulationSpec};

fn example(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../config/examples")
        .join(name);
    assert!(path.is_file(), "example spec {} is missing", path.display());
    path
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sy-sim-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn same_spec_and_seed_give_byte_identical_outputs() {
    let mut spec = SimulationSpec::from_yaml_file(&example("sim-azure-tiers.yaml")).unwrap();
    spec.workload.limit = Some(600);
    let (a, b) = (temp_dir("det-a"), temp_dir("det-b"));
    let first = run(&spec, &a, false).unwrap();
    let second = run(&spec, &b, false).unwrap();
    assert_eq!(first, second);
    let (fa, fb) = (files(&a), files(&b));
    let names: Vec<&str> = fa.iter().map(|f| f.0.as_str()).collect();
    for want in [
        "summary.json",
        "summary.txt",
        "requests-fcfs.jsonl",
        "requests-slo-aware.jsonl",
        "ttft_cdf.svg",
        "e2e_cdf.svg",
        "queue.svg",
        "kv_usage.svg",
        "simulate-manifest.json",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    assert!(fa == fb, "outputs differ between two identical runs");
    // A different seed draws a different tier mix.
    spec.seed += 1;
    let c = temp_dir("det-c");
    run(&spec, &c, false).unwrap();
    assert_ne!(files(&c), fa);
    for d in [a, b, c] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn every_example_spec_runs_on_its_trace() {
    for name in [
        "sim-azure-tiers.yaml",
        "sim-mooncake.yaml",
        "sim-sharegpt.yaml",
        "sim-jsonl.yaml",
        "sim-mlfq.yaml",
    ] {
        let mut spec = SimulationSpec::from_yaml_file(&example(name)).unwrap();
        spec.workload.limit = Some(300);
        let dir = temp_dir(name);
        let (cmp, _) = run(&spec, &dir, false).unwrap();
        assert_eq!(cmp.policies.len(), spec.policies.len(), "{name}");
        let n = if name == "sim-jsonl.yaml" { 24 } else { 300 };
        // One of Mooncake's first 300 requests is longer than Llama-3.1-8B's context.
        let rejected = u64::from(name == "sim-mooncake.yaml");
        for p in &cmp.policies {
            assert_eq!(
                (p.requests, p.finished, p.rejected),
                (n, n - rejected, rejected),
                "{name} {}",
                p.policy
            );
            assert!(
                p.request_throughput > 0.0 && p.ttft_ms.p50.is_some_and(|t| t > 0.0),
                "{name} {}",
                p.policy
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn malformed_spec_and_trace_are_reported_with_locations() {
    let dir = temp_dir("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("bad.jsonl");
    std::fs::write(&trace, "{\"arrival_s\": 0, \"prompt_len\": 4, \"output_len\": 1}\n{\"arrival_s\": 1, \"prompt_len\": \"x\", \"output_len\": 1}\n").unwrap();
    let spec_path = dir.join("spec.yaml");
    std::fs::write(
        &spec_path,
        "policies: [{name: fcfs}]\nworkload: {trace: bad.jsonl, format: jsonl}\n",
    )
    .unwrap();
    let spec = SimulationSpec::from_yaml_file(&spec_path).unwrap();
    let err = run(&spec, &dir.join("out"), false).unwrap_err().to_string();
    assert!(
        err.ends_with("bad.jsonl:2: field `prompt_len`: expected a non-negative integer"),
        "{err}"
    );
    std::fs::write(
        &spec_path,
        "policies: [{name: fcfs}]\nworkload: {trace: bad.jsonl, format: jsonl}\nsed: 1\n",
    )
    .unwrap();
    let err = SimulationSpec::from_yaml_file(&spec_path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("spec.yaml:3:") && err.contains("sed"), "{err}");
    // A bare name is told the mapping it should be, not a Rust type's name.
    std::fs::write(
        &spec_path,
        "policies: [fcfs]\nworkload: {trace: bad.jsonl, format: jsonl}\n",
    )
    .unwrap();
    let err = SimulationSpec::from_yaml_file(&spec_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("spec.yaml:1:")
            && err.contains("expected a policy as a mapping, `{name: fcfs}`"),
        "{err}"
    );
    std::fs::write(
        &spec_path,
        "policies: [{name: lifo}]\nworkload: {trace: bad.jsonl, format: jsonl}\n",
    )
    .unwrap();
    std::fs::write(
        &trace,
        "{\"arrival_s\": 0, \"prompt_len\": 4, \"output_len\": 1}\n",
    )
    .unwrap();
    let spec = SimulationSpec::from_yaml_file(&spec_path).unwrap();
    let err = run(&spec, &dir.join("out"), false).unwrap_err().to_string();
    assert!(err.contains("lifo") && err.contains("fair-share"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn mooncake_reuse_reaches_the_prefix_cache() {
    // With room for every block, the hit rate must reach the trace's own prefix
    // reuse among the requests served (the 10 longer than Llama-3.1-8B's 131,072 tokens are
    // rejected): 64.6% of prompt tokens, computed in Python from `hash_ids` alone (longest
    // previously seen id prefix, keeping the last token to compute); 65.1% over all requests.
    let mut spec = SimulationSpec::from_yaml_file(&example("sim-mooncake.yaml")).unwrap();
    spec.policies.truncate(1);
    spec.cache.num_gpu_blocks = Some(4_000_000);
    // The recorded arrivals, four times slower.
    spec.workload.arrival = None;
    spec.workload.time_scale = Some(0.25);
    let (cmp, _) = switchyard_simulator::simulate(&spec, false).unwrap();
    assert_eq!(cmp.policies[0].rejected, 10);
    let hit = cmp.policies[0].prefix_cache_hit_rate;
    assert!((hit - 0.646).abs() < 0.002, "hit rate {hit}");
}

/// Speculative decoding, modelled with a fixed acceptance rate: the same requests end with the
/// same tokens; at low load (decode steps bound by memory) accepted drafts cut the time per
/// output token; drafts that are never accepted only add work; runs are reproducible.
#[test]
fn speculative_decoding_is_modelled_with_an_acceptance_rate() {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv");
    let yaml = |speculative: &str| {
        format!(
            "seed: 3\nmodel: llama-3-8b\nhardware: h200\npolicies:\n  - name: fcfs\n\
             scheduler:\n  max_num_seqs: 64\n{speculative}\
             workload:\n  trace: {}\n  format: sharegpt\n  limit: 120\n  arrival: {{ process: poisson, rate: 1.0 }}\n",
            trace.display()
        )
    };
    // (summary, tokens generated per request)
    let sim = |speculative: &str| {
        let spec = SimulationSpec::from_yaml_str(&yaml(speculative), Path::new("spec.yaml"))
            .unwrap_or_else(|e| panic!("{e}"));
        let (comparison, runs) = switchyard_simulator::simulate(&spec, false).unwrap();
        let generated: Vec<u64> = runs[0].records.iter().map(|r| r.generated).collect();
        (comparison.policies[0].clone(), generated)
    };
    let plain = sim("");
    let drafts = |rate: f64| {
        format!("  speculative: {{ num_speculative_tokens: 4, acceptance_rate: {rate} }}\n")
    };
    let good = sim(&drafts(0.8));
    let useless = sim(&drafts(0.0));
    assert_eq!(plain.1, good.1);
    assert_eq!(plain.1, useless.1);
    let (p, g, u) = (&plain.0, &good.0, &useless.0);
    assert_eq!(p.finished, 120);
    assert_eq!((g.finished, u.finished), (120, 120));
    assert_eq!(p.counters.draft_tokens, 0);
    assert!(g.counters.accepted_tokens > 0 && g.counters.accepted_tokens < g.counters.draft_tokens);
    assert!(g.counters.steps < p.counters.steps);
    let tpot = |s: &switchyard_simulator::report::PolicySummary| s.tpot_ms.p50.unwrap();
    assert!(
        tpot(g) < 0.6 * tpot(p),
        "tpot p50 {} with drafts, {} without",
        tpot(g),
        tpot(p)
    );
    assert_eq!(u.counters.accepted_tokens, 0);
    assert!(tpot(u) >= tpot(p));
    assert_eq!(good, sim(&drafts(0.8)), "not reproducible");
    // Out-of-range settings are refused.
    let bad = yaml("  speculative: { num_speculative_tokens: 4, acceptance_rate: 1.5 }\n");
    assert!(SimulationSpec::from_yaml_str(&bad, Path::new("spec.yaml")).is_err());
}

/// A calibration file records the model and hardware it was fitted on: used with a spec for
/// another model it warns, and the header names both instead of "smollm2-135m on calibrated on
/// a100".
#[test]
fn a_calibration_of_another_model_warns_and_is_named_in_the_header() {
    let dir = temp_dir("calmodel");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("t.jsonl"),
        "{\"arrival_s\": 0, \"prompt_len\": 16, \"output_len\": 2}\n\
         {\"arrival_s\": 1, \"prompt_len\": 16, \"output_len\": 2}\n",
    )
    .unwrap();
    let cal = |model: &str| {
        std::fs::write(
            dir.join("cal.yaml"),
            format!(
                "model: {model}\nhardware: a100\nintercept_s: 0.001\nnum_gpu_blocks: 100\n\
                 block_size: 16\n"
            ),
        )
        .unwrap();
        let spec_path = dir.join("spec.yaml");
        std::fs::write(
            &spec_path,
            "model: smollm2-135m\ncalibration: cal.yaml\npolicies: [{name: fcfs}]\n\
             workload: {trace: t.jsonl, format: jsonl}\n",
        )
        .unwrap();
        let spec = SimulationSpec::from_yaml_file(&spec_path).unwrap();
        switchyard_simulator::simulate(&spec, false).unwrap().0
    };
    let other = cal("Meta-Llama-3-8B-Instruct");
    let header = other.to_text().lines().next().unwrap().to_string();
    assert!(
        header.starts_with(
            "smollm2-135m, calibrated (file's model Meta-Llama-3-8B-Instruct on a100): 2 requests"
        ),
        "{header}"
    );
    assert_eq!(other.warnings.len(), 1, "{:?}", other.warnings);
    assert!(
        other.warnings[0].contains("cal.yaml was fitted on model `Meta-Llama-3-8B-Instruct` on a100, not on the spec's `smollm2-135m`"),
        "{:?}",
        other.warnings
    );
    // Its own model, however the file spells it: no warning.
    let same = cal("SmolLM2 135M Instruct");
    assert!(same.warnings.is_empty(), "{:?}", same.warnings);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Tiers given to a trace none of whose requests has one (an Azure trace with `--tiers`)
/// measure no SLO: the run says so instead of leaving every slo% n/a unexplained.
#[test]
fn tiers_that_no_request_has_are_warned_about() {
    let dir = temp_dir("untiered");
    std::fs::create_dir_all(&dir).unwrap();
    let spec_for = |trace: &str| {
        std::fs::write(dir.join("t.jsonl"), trace).unwrap();
        let spec_path = dir.join("spec.yaml");
        std::fs::write(
            &spec_path,
            "model: smollm2-135m\npolicies: [{name: fcfs}]\n\
             tiers: {premium: {ttft_ms: 200}, batch: {}}\n\
             workload: {trace: t.jsonl, format: jsonl}\n",
        )
        .unwrap();
        let spec = SimulationSpec::from_yaml_file(&spec_path).unwrap();
        switchyard_simulator::simulate(&spec, false).unwrap().0
    };
    let untiered = spec_for(
        "{\"arrival_s\": 0, \"prompt_len\": 16, \"output_len\": 2}\n\
         {\"arrival_s\": 1, \"prompt_len\": 16, \"output_len\": 2}\n",
    );
    assert_eq!(untiered.policies[0].slo_attainment, None);
    assert_eq!(untiered.warnings.len(), 1, "{:?}", untiered.warnings);
    assert!(
        untiered.warnings[0].starts_with(
            "tiers are defined (batch, premium) but no request has one, so no SLO is measured"
        ),
        "{:?}",
        untiered.warnings
    );
    let tiered = spec_for(
        "{\"arrival_s\": 0, \"prompt_len\": 16, \"output_len\": 2, \"tier\": \"premium\"}\n\
         {\"arrival_s\": 1, \"prompt_len\": 16, \"output_len\": 2}\n",
    );
    assert!(tiered.warnings.is_empty(), "{:?}", tiered.warnings);
    assert!(tiered.policies[0].slo_attainment.is_some());
}
