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

#[path = "../../testsupport/scratch.rs"]
mod scratch;

/// A test's output directory, `sy-sim-{tag}-{pid}` in the temporary directory: not there
/// when made (a run creates it), removed with all it holds when dropped, so that a test leaves
/// nothing behind whether it passes or fails.
fn temp_dir(tag: &str) -> scratch::ScratchDir {
    scratch::ScratchDir::unmade(&format!("sim-{tag}"))
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
}

#[test]
fn every_example_spec_runs_on_its_trace() {
    for name in [
        "sim-azure-tiers.yaml",
        "sim-mooncake.yaml",
        "sim-sharegpt.yaml",
        "sim-jsonl.yaml",
        "sim-mlfq.yaml",
        "sim-lora-pinning.yaml",
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
            // Its adapters are loaded, some requests wait, and the pinned ones are served.
            if name == "sim-lora-pinning.yaml" {
                let m = p.lora_memory.as_ref().expect("lora_memory");
                assert!(m.loads > 0 && m.waited > 0, "{m:?}");
                assert!(
                    m.pinned_ttft_ms.count > 0 && m.unpinned_ttft_ms.count > 0,
                    "{m:?}"
                );
            } else {
                assert!(p.lora_memory.is_none());
            }
        }
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
    // Refused as the spec is read, at the line that names it.
    let err = SimulationSpec::from_yaml_file(&spec_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("spec.yaml:1: policies: unknown scheduling policy `lifo`")
            && err.contains("fair-share"),
        "{err}"
    );
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

/// `sim-kv-offload.yaml`'s host KV tier: prefixes its small device cache evicts are found
/// there and loaded back, for every policy; the same spec with the tier off reports none.
/// Its blocks are stored ahead of their eviction (the default): with the copies made at
/// eviction instead, the evictions copy more.
#[test]
fn the_host_kv_tier_example_loads_evicted_prefixes_back() {
    let mut spec = SimulationSpec::from_yaml_file(&example("sim-kv-offload.yaml")).unwrap();
    spec.workload.limit = Some(400);
    let (on, _) = switchyard_simulator::simulate(&spec, false).unwrap();
    spec.cache.kv_offloading_ahead = false;
    let (at_eviction, _) = switchyard_simulator::simulate(&spec, false).unwrap();
    let text = on.to_text();
    for (a, e) in on.policies.iter().zip(&at_eviction.policies) {
        let (h, he) = (a.host_kv.as_ref().unwrap(), e.host_kv.as_ref().unwrap());
        assert!(h.stored_ahead_blocks > 0, "{}: {h:?}", a.policy);
        assert_eq!(he.stored_ahead_blocks, 0);
        assert!(
            h.offload_copy_s < he.offload_copy_s,
            "{}: {h:?} against {he:?}",
            a.policy
        );
        assert!(
            text.contains(&format!(
                "{}: host KV tier (32768 blocks, 50 GB/s to the host and 50 GB/s back \
                 assumed): {} blocks offloaded ({} of them stored ahead of eviction)",
                a.policy, h.offloaded_blocks, h.stored_ahead_blocks
            )),
            "{text}"
        );
    }
    spec.cache.kv_offloading_ahead = true;
    spec.cache.kv_offloading_size = 0.0;
    let (off, _) = switchyard_simulator::simulate(&spec, false).unwrap();
    for (a, b) in on.policies.iter().zip(&off.policies) {
        let h = a.host_kv.as_ref().expect("host_kv");
        // 64 GiB of Llama-3.1-8B's 2 MiB blocks.
        assert_eq!(h.host_blocks, 32_768);
        assert!(
            h.offloaded_blocks > 0 && h.loaded_blocks > 0,
            "{}: {h:?}",
            a.policy
        );
        assert_eq!(h.host_hit_tokens, 16 * h.loaded_blocks, "{}", a.policy);
        assert!(b.host_kv.is_none());
        assert!(
            a.counters.prefix_hits > b.counters.prefix_hits,
            "{}: {} hits with the tier, {} without",
            a.policy,
            a.counters.prefix_hits,
            b.counters.prefix_hits
        );
    }
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

/// With tiers, each tier some request has gets a TTFT and a TPOT plot: a curve per policy,
/// its target a labelled vertical line, file names safe whatever the tier's name, and
/// `summary.json` says which file shows which tier. A run without tiers writes none, and
/// removes an earlier run's.
#[test]
fn each_tier_gets_plots_with_its_targets_whatever_its_name() {
    let dir = temp_dir("tierplots");
    std::fs::create_dir_all(&dir).unwrap();
    let tiers = ["../../etc/passwd", "<b>&\"gold\"", "premium", "spare"];
    let mut trace = String::new();
    for i in 0..12 {
        // Nobody is in `spare`.
        let tier = tiers[i % 3];
        let line = serde_json::json!({
            "arrival_s": 0.01 * i as f64, "prompt_len": 64, "output_len": 8, "tier": tier,
        });
        trace.push_str(&format!("{line}\n"));
    }
    std::fs::write(dir.join("t.jsonl"), trace).unwrap();
    let spec_path = dir.join("spec.yaml");
    let write_spec = |tiers_yaml: &str| {
        std::fs::write(
            &spec_path,
            format!(
                "model: smollm2-135m\nhardware: h200\n\
                 policies: [{{name: fcfs}}, {{name: slo-aware}}]\n{tiers_yaml}\
                 workload: {{trace: t.jsonl, format: jsonl}}\n"
            ),
        )
        .unwrap();
        SimulationSpec::from_yaml_file(&spec_path).unwrap()
    };
    let spec = write_spec(
        "tiers:\n  \"../../etc/passwd\": {ttft_ms: 250, tpot_ms: 12.5}\n  \
         \"<b>&\\\"gold\\\"\": {ttft_ms: 40}\n  premium: {tpot_ms: 30}\n  spare: {ttft_ms: 1}\n",
    );
    let out = dir.join("out");
    let (comparison, written) = run(&spec, &out, false).unwrap();
    // In name order: "../../etc/passwd" (0), "<b>&\"gold\"" (1), premium (2), spare (3).
    let plots = &comparison.tier_plots;
    let names: Vec<(&str, &str, &str)> = plots
        .iter()
        .map(|t| (t.tier.as_str(), t.ttft_cdf.as_str(), t.tpot_cdf.as_str()))
        .collect();
    assert_eq!(
        names,
        [
            (
                "../../etc/passwd",
                "ttft_cdf-tier0-______etc_passwd.svg",
                "tpot_cdf-tier0-______etc_passwd.svg"
            ),
            (
                "<b>&\"gold\"",
                "ttft_cdf-tier1-_b___gold_.svg",
                "tpot_cdf-tier1-_b___gold_.svg"
            ),
            (
                "premium",
                "ttft_cdf-tier2-premium.svg",
                "tpot_cdf-tier2-premium.svg"
            ),
        ]
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["tier_plots"][0]["tier"], "../../etc/passwd");
    assert_eq!(summary["tier_plots"][0]["ttft_target_ms"], 250.0);
    assert_eq!(summary["tier_plots"][0]["tpot_target_ms"], 12.5);
    assert_eq!(
        summary["tier_plots"][1]["ttft_cdf"],
        "ttft_cdf-tier1-_b___gold_.svg"
    );
    assert!(summary["tier_plots"][2]["ttft_target_ms"].is_null());
    // Every file is in the directory itself (nothing reached ../../etc) and in the manifest.
    let listing: Vec<String> = files(&out).into_iter().map(|f| f.0).collect();
    for t in plots {
        for f in [&t.ttft_cdf, &t.tpot_cdf] {
            assert!(listing.contains(f), "{f} missing from {listing:?}");
            assert!(written.written.contains(f), "{f} not recorded");
            let svg = std::fs::read_to_string(out.join(f)).unwrap();
            assert!(svg.starts_with("<svg"), "{f}");
            // A legend entry and a curve per policy (the palette's first two colours; a
            // curve, and its sample in the legend).
            for (policy, colour) in [("fcfs", "#E6194B"), ("slo-aware", "#3CB44B")] {
                assert!(
                    svg.contains(&format!(">\n{policy}\n</text>")),
                    "{f}: no {policy}"
                );
                let stroke = format!("<polyline fill=\"none\" opacity=\"1\" stroke=\"{colour}\"");
                assert_eq!(svg.matches(&stroke).count(), 2, "{f}: {policy}'s curve");
            }
        }
    }
    let read = |f: &str| std::fs::read_to_string(out.join(f)).unwrap();
    // The targets are marked where the tier sets them; the names are escaped in the titles.
    let first = read("ttft_cdf-tier0-______etc_passwd.svg");
    assert!(first.contains("ttft target 250 ms"), "{first}");
    assert!(first.contains("Tier &quot;../../etc/passwd&quot;: time to first token"));
    assert!(read("tpot_cdf-tier0-______etc_passwd.svg").contains("tpot target 12.5 ms"));
    let gold = read("ttft_cdf-tier1-_b___gold_.svg");
    assert!(gold.contains("ttft target 40 ms"));
    assert!(
        !gold.contains("<b>") && gold.contains("&lt;b&gt;&amp;"),
        "escaped"
    );
    assert!(!read("tpot_cdf-tier1-_b___gold_.svg").contains("target"));
    assert!(!read("ttft_cdf-tier2-premium.svg").contains("target"));
    assert!(read("tpot_cdf-tier2-premium.svg").contains("tpot target 30 ms"));
    assert!(!listing.iter().any(|f| f.contains("spare")), "{listing:?}");
    // The same run without tiers (its trace's tiers dropped): no tier plots, the earlier
    // ones removed, and summary.json without the key.
    let mut untiered = String::new();
    for i in 0..12 {
        let line =
            serde_json::json!({"arrival_s": 0.01 * i as f64, "prompt_len": 64, "output_len": 8});
        untiered.push_str(&format!("{line}\n"));
    }
    std::fs::write(dir.join("t.jsonl"), untiered).unwrap();
    let (comparison, second) = run(&write_spec(""), &out, false).unwrap();
    assert!(comparison.tier_plots.is_empty());
    assert_eq!(second.removed.len(), 6, "{:?}", second.removed);
    assert!(!std::fs::read_to_string(out.join("summary.json"))
        .unwrap()
        .contains("tier_plots"));
    let listing: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(!listing.iter().any(|f| f.contains("-tier")), "{listing:?}");
}

/// A `slo-aware` policy whose spec leaves its step-cost parameters unset takes those the
/// calibration's fit implies (and says so in the summary); parameters the spec sets win.
#[test]
fn slo_aware_takes_its_step_costs_from_the_calibration_unless_the_spec_sets_them() {
    let dir = temp_dir("sloparams");
    std::fs::create_dir_all(&dir).unwrap();
    // 1 ms a step and 1 ms more per prompt token: the fit implies step_overhead_ms 1 (a
    // decode step) and prefill_us_per_token 1000.
    std::fs::write(
        dir.join("cal.yaml"),
        "intercept_s: 0.001\nper_prefill_token_s: 0.001\nnum_gpu_blocks: 100\nblock_size: 16\n",
    )
    .unwrap();
    // One seat. `long` (100 prompt tokens, gold: TTFT 80 ms) and `short` (4 tokens, silver:
    // 150 ms) arrive together. At 1 ms a prompt token `long` cannot make its 80 ms, so it is
    // relegated and `short` runs first; with the defaults (8 ms, 25 us) `long` has the
    // least slack and runs first.
    std::fs::write(
        dir.join("t.jsonl"),
        "{\"arrival_s\": 0, \"prompt_len\": 100, \"output_len\": 2, \"tier\": \"gold\"}\n\
         {\"arrival_s\": 0, \"prompt_len\": 4, \"output_len\": 2, \"tier\": \"silver\"}\n",
    )
    .unwrap();
    let spec_path = dir.join("spec.yaml");
    std::fs::write(
        &spec_path,
        "model: smollm2-135m\ncalibration: cal.yaml\nscheduler: {max_num_seqs: 1}\n\
         policies:\n\
         - {name: slo-aware}\n\
         - {name: slo-aware, label: explicit, params: {step_overhead_ms: 1, prefill_us_per_token: 1000}}\n\
         - {name: slo-aware, label: defaults, params: {step_overhead_ms: 8, prefill_us_per_token: 25}}\n\
         - {name: slo-aware, label: half, params: {prefill_us_per_token: 25}}\n\
         tiers: {gold: {ttft_ms: 80}, silver: {ttft_ms: 150}}\n\
         workload: {trace: t.jsonl, format: jsonl}\n",
    )
    .unwrap();
    let spec = SimulationSpec::from_yaml_file(&spec_path).unwrap();
    let (comparison, runs) = switchyard_simulator::simulate(&spec, false).unwrap();
    let taken: Vec<_> = comparison
        .policies
        .iter()
        .map(|p| p.params_from_calibration.clone())
        .collect();
    let cal = taken[0].as_ref().expect("slo-aware took the calibration's");
    assert!(cal.calibration.ends_with("cal.yaml"), "{cal:?}");
    assert_eq!(
        (cal.step_overhead_ms, cal.prefill_us_per_token),
        (Some(1.0), Some(1000.0))
    );
    assert_eq!((&taken[1], &taken[2]), (&None, &None), "the spec's own win");
    let half = taken[3].as_ref().expect("the one it leaves unset");
    assert_eq!(
        (half.step_overhead_ms, half.prefill_us_per_token),
        (Some(1.0), None)
    );
    // It ran with them: as with the same values given explicitly, not as with the defaults.
    let first_scheduled = |i: usize| -> Vec<Option<f64>> {
        runs[i]
            .records
            .iter()
            .map(|r| r.first_scheduled_s)
            .collect()
    };
    assert_eq!(runs[0].records, runs[1].records);
    assert_eq!(first_scheduled(0)[1], Some(0.0), "short first");
    assert_eq!(
        first_scheduled(2)[0],
        Some(0.0),
        "long first with the defaults"
    );
    assert_ne!(runs[0].records, runs[2].records);
    // The summary says which values came from where.
    let text = comparison.to_text();
    assert!(
        text.contains("slo-aware: step_overhead_ms 1, prefill_us_per_token 1000 from calibration ")
            && text.contains("(derived from its fit; the spec's params leave them unset)"),
        "{text}"
    );
    assert!(
        text.contains("half: step_overhead_ms 1 from calibration"),
        "{text}"
    );
    let json = serde_json::to_value(&comparison).unwrap();
    assert_eq!(
        json["policies"][0]["params_from_calibration"]["prefill_us_per_token"],
        1000.0
    );
    assert!(json["policies"][1].get("params_from_calibration").is_none());
}

/// Every simulation spec shipped in config/examples (`sim-*.yaml`, the ones the README and
/// `config check`'s hint send users to) loads and runs with each of its policies on the
/// first requests of its trace, so an example cannot rot unnoticed when the schema, a
/// policy's parameters or a trace reader change.
#[test]
fn every_shipped_simulation_spec_loads_and_runs() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/examples");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("sim-") && n.ends_with(".yaml"))
        .collect();
    names.sort();
    assert!(names.len() >= 10, "examples went missing: {names:?}");
    for name in &names {
        let mut spec = SimulationSpec::from_yaml_file(&example(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            spec.workload.trace.is_file(),
            "{name}: trace {} is missing",
            spec.workload.trace.display()
        );
        // A spec with changes keeps its own limit: its changes' times lie within it.
        if spec.changes.is_empty() {
            spec.workload.limit = Some(40);
        }
        let out = temp_dir(&format!("example-{name}"));
        let (comparison, _) = run(&spec, &out, false).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            comparison.policies.len(),
            spec.policies.len(),
            "{name}: a policy did not run"
        );
        assert!(out.join("summary.json").is_file(), "{name}: no summary");
    }
}

/// `sim-policy-swap.yaml`: every policy's run has a phase per change and one before them, the
/// phases together hold every request, each change took effect at its time or the step
/// boundary after it, the swaps happened, and the text and JSON reports show the phases.
#[test]
fn the_policy_swap_example_reports_each_phase() {
    let spec = SimulationSpec::from_yaml_file(&example("sim-policy-swap.yaml")).unwrap();
    assert_eq!(spec.changes.len(), 2);
    let out = temp_dir("policy-swap");
    let (cmp, _) = run(&spec, &out, false).unwrap();
    for p in &cmp.policies {
        let phases = &p.phases;
        assert_eq!(phases.len(), 3, "{}", p.policy);
        assert_eq!(
            phases.iter().map(|ph| ph.requests).sum::<u64>(),
            p.requests,
            "{}",
            p.policy
        );
        assert_eq!(
            phases.iter().map(|ph| ph.finished).sum::<u64>(),
            p.finished,
            "{}",
            p.policy
        );
        let names: Vec<&str> = phases.iter().map(|ph| ph.policy.as_str()).collect();
        assert_eq!(names, [p.policy.as_str(), "slo-aware", "priority"]);
        for (ph, change) in phases[1..].iter().zip(&spec.changes) {
            let start = ph.start.as_ref().expect("a change starts the phase");
            assert_eq!(start.at_s, change.at_s);
            assert_eq!(ph.from_s, change.at_s);
            // Within a step of its time (steps of this model last well under a second).
            assert!(
                start.applied_s >= start.at_s && start.applied_s < start.at_s + 1.0,
                "{start:?}"
            );
            assert!(start.swapped, "{}: {start:?}", p.policy);
            assert!(ph.requests > 0 && ph.ttft_ms.p50.is_some(), "{ph:?}");
            // Every tier of the mix, with its targets.
            assert_eq!(ph.tiers.len(), 3, "{ph:?}");
        }
        assert!(phases[0].start.is_none());
        assert_eq!(phases[0].to_s, Some(50.0));
        assert_eq!(phases[2].to_s, None);
    }
    let text = cmp.to_text();
    assert!(text.contains("\nphases: "), "{text}");
    assert!(
        text.contains("change 1 at 50 s: policy slo-aware"),
        "{text}"
    );
    assert!(
        text.contains(
            "change 2 at 100 s: policy priority {\"aging_interval_ms\":60000}, \
             server.max_pending_requests 2048"
        ),
        "{text}"
    );
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let phase = &json["policies"][0]["phases"][1];
    assert_eq!(phase["start"]["change"], "policy slo-aware");
    // The tiers by name: batch (no target), premium, standard.
    assert_eq!(phase["tiers"][1]["tier"], "premium");
    assert!(phase["tiers"][1]["slo_attainment"].is_number(), "{phase}");
}

/// `sim-tier-change.yaml`: every policy's run has a phase per tier change and one before
/// them; each change rebuilt the policy in force with the new tiers (a swap, the policy
/// kept); each phase's tier rows carry the targets in force in it, and each request was
/// judged by those of its arrival (its phase's); the text report names what changed.
#[test]
fn the_tier_change_example_judges_each_phase_by_its_targets() {
    let spec = SimulationSpec::from_yaml_file(&example("sim-tier-change.yaml")).unwrap();
    assert_eq!(spec.changes.len(), 2);
    let (cmp, runs) = switchyard_simulator::simulate(&spec, false).unwrap();
    for (p, r) in cmp.policies.iter().zip(&runs) {
        let phases = &p.phases;
        assert_eq!(phases.len(), 3, "{}", p.policy);
        assert_eq!(phases.iter().map(|ph| ph.requests).sum::<u64>(), p.requests);
        for ph in &phases[1..] {
            let start = ph.start.as_ref().expect("a change starts the phase");
            assert!(start.swapped && ph.policy == p.policy, "{start:?}");
            assert!(ph.requests > 0, "{ph:?}");
        }
        // The targets in force per phase: premium's TTFT 200 ms, then 150 ms; standard's
        // 1 s, then 2 s from the second change.
        let target = |k: usize, tier: &str| {
            let t = phases[k].tiers.iter().find(|t| t.tier == tier).unwrap();
            t.ttft_target_ms
        };
        assert_eq!(
            [0, 1, 2].map(|k| (target(k, "premium"), target(k, "standard"))),
            [
                (Some(200.0), Some(1000.0)),
                (Some(150.0), Some(1000.0)),
                (Some(150.0), Some(2000.0))
            ]
        );
        // Each premium request met its TTFT target by the phase it arrived in.
        for rec in r.records.iter().filter(|rec| rec.tier == "premium") {
            let limit = if rec.arrival_s < 50.0 { 200.0 } else { 150.0 };
            let met = rec.finish_s.is_some() && rec.ttft_ms.is_some_and(|t| t <= limit);
            assert_eq!(rec.met_ttft, Some(met), "{rec:?}");
        }
    }
    let text = cmp.to_text();
    assert!(
        text.contains(
            "change 1 at 50 s: tiers batch.max_kv_fraction none -> 0.33, premium.ttft_ms \
             200.0 -> 150.0"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "change 2 at 100 s: tiers batch.max_pending_requests none -> 64, \
             standard.ttft_ms 1000.0 -> 2000.0"
        ),
        "{text}"
    );
    assert!(text.contains("ttft tgt"), "{text}");
}
