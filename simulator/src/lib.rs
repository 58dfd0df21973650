//! switchyard-simulator: a discrete-event simulator that replays request
//! traces against Switchyard's scheduling core (`switchyard-policies`) with a
//! virtual clock and a step-cost model, and reports latency, throughput and
//! SLO attainment per policy.
//!
//! ```no_run
//! use std::path::Path;
//! use switchyard_simulator::{run, SimulationSpec};
//!
//! let spec = SimulationSpec::from_yaml_file(Path::new("config/examples/sim-azure-tiers.yaml"))?;
//! let (comparison, _files) = run(&spec, Path::new("out"), true)?;
//! print!("{}", comparison.to_text());
//! # Ok::<(), switchyard_simulator::SimError>(())
//! ```

pub mod calibrate;
pub mod changes;
pub mod cost;
pub mod engine;
pub mod error;
pub mod front_end;
mod in_flight;
pub mod lora_cost;
pub mod lora_memory;
pub mod lora_registry;
pub mod outputs;
pub mod phases;
pub mod plot;
pub mod progress;
pub mod report;
#[cfg(test)]
#[path = "../../testsupport/scratch.rs"]
mod scratch;
#[path = "../../support/short_number.rs"]
mod short_number;
pub mod slo_params;
pub mod spec;
pub mod trace;

pub use cost::WINDOW_READ_SLACK;
pub use engine::{PolicyRun, Simulation, Workload};
pub use error::SimError;
pub use outputs::OutputFiles;
pub use report::Comparison;
pub use spec::{CliOptions, SimulationSpec};
pub use trace::TraceFormat;

use report::PolicySummary;
use std::path::Path;

/// A warning when `scheduler.lora_memory.pinned` names adapters that no request of
/// `requests` names: each holds one of `max_cpu_loras`' places for nothing (adapter ids are
/// `1..=workload.adapters.count`, or a jsonl record's own `adapter`; a `0`, or an id past the
/// count, is a likely slip).
fn unused_pinned(pinned: &[u32], requests: &[trace::TraceRequest]) -> Option<String> {
    unused_configured(("pinned", "one of max_cpu_loras'"), pinned, requests)
}

/// [`unused_pinned`] for `scheduler.lora_memory.registered`, whose adapters each hold one of
/// `max_adapters`' places (in the registry) for nothing.
fn unused_registered(registered: &[u32], requests: &[trace::TraceRequest]) -> Option<String> {
    unused_configured(("registered", "one of max_adapters'"), registered, requests)
}

/// The warning of [`unused_pinned`] for the ids of `scheduler.lora_memory.<field>`, each of
/// which holds `places` places.
fn unused_configured(
    (field, places): (&str, &str),
    ids: &[u32],
    requests: &[trace::TraceRequest],
) -> Option<String> {
    let named: std::collections::BTreeSet<u32> =
        requests.iter().filter_map(|r| r.adapter).collect();
    let unused: Vec<String> = ids
        .iter()
        .filter(|a| !named.contains(a))
        .map(u32::to_string)
        .collect();
    if unused.is_empty() {
        return None;
    }
    Some(format!(
        "scheduler.lora_memory.{field}: no request names adapter {} (adapters are the ids \
         1..=workload.adapters.count, or a jsonl record's own `adapter`): {field}, {} \
         {places} places for nothing",
        unused.join(", "),
        if unused.len() == 1 {
            "it holds"
        } else {
            "each holds"
        }
    ))
}

/// A warning when requests of `requests` reach a context (prompt plus output) longer than
/// any `c` measured: their steps' times are the fit's extrapolation (its attention term grows
/// with the square of the context, so a short calibration can price a long prompt far off).
/// With a sliding `window` a step reads at most the window's keys, on the server that measured
/// the calibration as in the simulator, so a context counts up to the window.
fn beyond_calibration(
    c: &cost::Calibration,
    requests: &[trace::TraceRequest],
    window: Option<u64>,
) -> Option<String> {
    let max = c.max_context?;
    let context = |r: &trace::TraceRequest| {
        let context = r.prompt.len() as u64 + u64::from(r.output_len);
        window.map_or(context, |w| context.min(w))
    };
    let beyond = requests.iter().filter(|r| context(r) > max).count();
    let longest = requests.iter().map(context).max()?;
    (beyond > 0).then(|| {
        format!(
            "{beyond} of {} requests reach a context (prompt + output) beyond the {max} tokens \
             the calibration measured (the longest: {longest}): their steps' times are \
             extrapolated from the fit; calibrate with a --max-context of at least {longest} \
             (within the model's and the KV cache's) to measure them",
            requests.len()
        )
    })
}

/// The window over which [`peak_rate`] counts arrivals, in seconds.
pub const PEAK_WINDOW_S: f64 = 10.0;

/// The most requests arriving within any [`PEAK_WINDOW_S`] of `times` (arrival or send times
/// in seconds, in any order), per second; `None` for times spanning less than two windows
/// (their mean says as much). A bursty trace's peak is many times its mean, which a load
/// given as a fraction of capacity (the mean) hides.
fn peak_rate(times: &[f64], span: f64) -> Option<f64> {
    if span < 2.0 * PEAK_WINDOW_S {
        return None;
    }
    let mut times = times.to_vec();
    times.sort_by(f64::total_cmp);
    let mut start = 0;
    let mut most = 0;
    for (end, &t) in times.iter().enumerate() {
        while times[start] <= t - PEAK_WINDOW_S {
            start += 1;
        }
        most = most.max(end + 1 - start);
    }
    Some(most as f64 / PEAK_WINDOW_S)
}

/// The mean rate of `times` (requests/s over their span: 0 for less than two distinct
/// times) and their [`peak_rate`].
fn rates(times: &[f64]) -> (f64, Option<f64>) {
    let first = times.iter().copied().fold(f64::INFINITY, f64::min);
    let last = times.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let span = if last > first { last - first } else { 0.0 };
    let mean = if span > 0.0 {
        (times.len() - 1) as f64 / span
    } else {
        0.0
    };
    (mean, peak_rate(times, span))
}

/// The per-tier plots of a run: one entry per tier of `tiers` that some request of
/// `requests` has, its files named by its place among `tiers` (in name order).
fn tier_plots(
    tiers: &std::collections::BTreeMap<String, spec::TierConf>,
    requests: &[trace::TraceRequest],
) -> Vec<report::TierPlots> {
    let present: std::collections::BTreeSet<&str> =
        requests.iter().map(|r| r.tier.as_str()).collect();
    tiers
        .iter()
        .enumerate()
        .filter(|(_, (name, _))| present.contains(name.as_str()))
        .map(|(i, (name, t))| report::TierPlots {
            tier: name.clone(),
            ttft_target_ms: t.ttft_ms,
            tpot_target_ms: t.tpot_ms,
            ttft_cdf: outputs::tier_plot_file(outputs::TierMetric::Ttft, i, name),
            tpot_cdf: outputs::tier_plot_file(outputs::TierMetric::Tpot, i, name),
        })
        .collect()
}

/// Runs every policy of `spec` on its workload without writing files.
/// With `progress`, each policy's run reports its progress on stderr: a bar on a terminal,
/// else a plain line every [`progress::LINE_INTERVAL`] and one when it ends.
pub fn simulate(
    spec: &SimulationSpec,
    progress: bool,
) -> Result<(Comparison, Vec<PolicyRun>), SimError> {
    let sim = Simulation::new(spec)?;
    let workload = sim.load_workload()?;
    let requests = &workload.requests;
    let mut runs = Vec::with_capacity(spec.policies.len());
    for policy in &spec.policies {
        runs.push(sim.run_policy(policy, requests, progress)?);
    }
    let arrivals: Vec<f64> = requests.iter().map(|r| r.arrival_s).collect();
    let (arrival_rate, peak) = rates(&arrivals);
    let clients = requests
        .iter()
        .filter(|r| !r.client.is_empty())
        .map(|r| r.client.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .len() as u64;
    let mut warnings = sim.warnings.clone();
    if !spec.tiers.is_empty() && requests.iter().all(|r| r.tier.is_empty()) {
        // Else the tier table is missing and every slo% n/a, with no word why.
        let names: Vec<&str> = spec.tiers.keys().map(String::as_str).collect();
        warnings.push(format!(
            "tiers are defined ({}) but no request has one, so no SLO is measured (slo% n/a): \
             only jsonl traces name a tier; assign them with workload.mix.tiers in a \
             simulation spec (`simulate --config`)",
            names.join(", ")
        ));
    }
    if let Some(m) = &spec.scheduler.lora_memory {
        warnings.extend(unused_pinned(&m.pinned, requests));
        warnings.extend(unused_registered(&m.registered, requests));
    }
    if let Some(m) = spec
        .scheduler
        .lora_memory
        .as_ref()
        .filter(|m| m.max_adapters < m.max_cpu_loras)
    {
        warnings.push(format!(
            "scheduler.lora_memory.max_adapters {} is below max_cpu_loras {}: only registered \
             adapters are in memory, so memory holds at most {} adapters (as the server's \
             lora.max_adapters bounds its lora.max_cpu_loras), and requests for more \
             adapters in use at once are refused (unavailable)",
            m.max_adapters, m.max_cpu_loras, m.max_adapters
        ));
    }
    if let cost::CostModel::Calibrated(c) = &sim.cost {
        if let Some(w) = beyond_calibration(c, requests, sim.model.sliding_window) {
            warnings.push(w);
        }
    }
    let comparison = Comparison {
        tier_plots: tier_plots(&spec.tiers, requests),
        model: sim.model.name.clone(),
        calibrated: matches!(sim.cost, cost::CostModel::Calibrated(_)),
        hardware: match sim.cost {
            // The file's own model and hardware: the spec's hardware preset prices nothing.
            cost::CostModel::Calibrated(c) => match (&c.model, &c.hardware) {
                (Some(m), Some(h)) => format!("calibrated (file's model {m} on {h})"),
                (Some(m), None) => format!("calibrated (file's model {m})"),
                (None, Some(h)) => format!("calibrated (on {h})"),
                (None, None) => "calibrated".into(),
            },
            cost::CostModel::Roofline { .. } => sim.hardware.name.clone(),
        },
        warnings,
        requests: requests.len() as u64,
        clients,
        arrival_rate_of: if clients > 0 {
            report::RATE_OF_TRACE
        } else {
            report::RATE_OF_SENT
        }
        .into(),
        arrival_rate,
        estimated_capacity_rps: workload.estimated_capacity_rps,
        peak_rate: peak,
        max_model_len: sim.scheduler.max_model_len as u64,
        policies: runs
            .iter_mut()
            .map(|r| {
                let mut s =
                    PolicySummary::new(&r.label, &r.records, &mut r.itls_ms, r.counters.clone());
                s.set_tier_targets(&spec.tiers);
                s.params_from_calibration = r.params_from_calibration.clone();
                s.lora_memory = r.lora_memory.clone();
                s.host_kv = r.host_kv.clone();
                s.phases =
                    phases::phase_summaries(&r.records, &r.changes, &r.policy_name, &spec.tiers);
                // When each request was sent in this run: its trace arrival, or for a
                // closed-loop client's, its release.
                let sent: Vec<f64> = r.records.iter().map(|r| r.arrival_s).collect();
                (s.offered_rate, s.offered_peak_rate) = rates(&sent);
                s
            })
            .collect(),
    };
    Ok((comparison, runs))
}

/// Runs every policy of `spec` and writes into `out_dir` (created if needed):
/// `summary.json`, `summary.txt`, `requests-<policy>.jsonl` per policy, the
/// plots `ttft_cdf.svg`, `e2e_cdf.svg`, `queue.svg`, `kv_usage.svg`, with tiers a TTFT and a
/// TPOT plot per tier (`Comparison::tier_plots` names them), and
/// `simulate-manifest.json`; an earlier run's files it does not rewrite are removed
/// (see [`outputs`]).
pub fn run(
    spec: &SimulationSpec,
    out_dir: &Path,
    progress: bool,
) -> Result<(Comparison, OutputFiles), SimError> {
    // An --out that cannot take the outputs is refused before the run, not after it.
    outputs::check(out_dir)?;
    let (comparison, runs) = simulate(spec, progress)?;
    let files = write_outputs(out_dir, &comparison, &runs)?;
    Ok((comparison, files))
}

/// Writes the summary, per-request JSONL and plots of a finished run, and removes the files
/// an earlier run recorded in `out_dir` that this one does not rewrite; never any other file.
pub fn write_outputs(
    out_dir: &Path,
    comparison: &Comparison,
    runs: &[PolicyRun],
) -> Result<OutputFiles, SimError> {
    let files: std::collections::BTreeSet<String> = outputs::FIXED_FILES
        .iter()
        .map(|f| f.to_string())
        .chain(runs.iter().map(|r| outputs::requests_file(&r.label)))
        .chain(
            comparison
                .tier_plots
                .iter()
                .flat_map(|t| [t.ttft_cdf.clone(), t.tpot_cdf.clone()]),
        )
        .collect();
    let removed = outputs::prepare(out_dir, &files)?;
    comparison.write(out_dir)?;
    for r in runs {
        outputs::write_replacing(out_dir, &outputs::requests_file(&r.label), |p| {
            report::write_requests_jsonl(p, &r.records)
        })?;
    }
    let cdf = |f: fn(&report::RequestRecord) -> Option<f64>| -> Vec<(String, Vec<(f64, f64)>)> {
        runs.iter()
            .map(|r| {
                let mut v: Vec<f64> = r.records.iter().filter_map(f).collect();
                (r.label.clone(), plot::cdf_points(&mut v))
            })
            .collect()
    };
    outputs::write_replacing(out_dir, outputs::TTFT_CDF_SVG, |p| {
        plot::plot_cdfs(p, "Time to first token (CDF)", &cdf(|r| r.ttft_ms))
    })?;
    outputs::write_replacing(out_dir, outputs::E2E_CDF_SVG, |p| {
        plot::plot_cdfs(p, "End-to-end latency (CDF)", &cdf(|r| r.e2e_ms))
    })?;
    // Every run has one record per trace request, in trace order: the indices of each
    // tier's requests are the same in all of them, found once.
    let mut by_tier: std::collections::BTreeMap<&str, Vec<usize>> = Default::default();
    for (i, r) in runs
        .first()
        .map_or(&[][..], |r| &r.records)
        .iter()
        .enumerate()
    {
        by_tier.entry(r.tier.as_str()).or_default().push(i);
    }
    for t in &comparison.tier_plots {
        let indices = by_tier.get(t.tier.as_str()).map_or(&[][..], Vec::as_slice);
        write_tier_plots(out_dir, t, indices, runs)?;
    }
    let series = |f: fn(&engine::StepSample) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        runs.iter()
            .map(|r| {
                (
                    r.label.clone(),
                    r.samples.iter().map(|s| (s.t_s, f(s))).collect(),
                )
            })
            .collect()
    };
    outputs::write_replacing(out_dir, outputs::QUEUE_SVG, |p| {
        plot::plot_series(
            p,
            "Waiting requests",
            "requests",
            &series(|s| f64::from(s.waiting)),
        )
    })?;
    outputs::write_replacing(out_dir, outputs::KV_USAGE_SVG, |p| {
        plot::plot_series(
            p,
            "KV cache usage",
            "fraction of blocks",
            &series(|s| s.kv_usage),
        )
    })?;
    outputs::finish(out_dir, &files)?;
    let mut written: Vec<String> = files.into_iter().collect();
    written.push(outputs::MANIFEST.to_string());
    Ok(OutputFiles { written, removed })
}

/// Writes the TTFT and TPOT plots of the tier `t`, whose requests are the records at
/// `indices` of each run: a CDF per policy of their latencies, the tier's targets as
/// vertical lines.
fn write_tier_plots(
    out_dir: &Path,
    t: &report::TierPlots,
    indices: &[usize],
    runs: &[PolicyRun],
) -> Result<(), SimError> {
    let cdf = |f: fn(&report::RequestRecord) -> Option<f64>| -> Vec<(String, Vec<(f64, f64)>)> {
        runs.iter()
            .map(|r| {
                let mut v: Vec<f64> = indices
                    .iter()
                    .filter_map(|&i| r.records.get(i))
                    .filter(|q| q.tier == t.tier)
                    .filter_map(f)
                    .collect();
                (r.label.clone(), plot::cdf_points(&mut v))
            })
            .collect()
    };
    let target = |what: &str, ms: Option<f64>| {
        ms.map(|ms| plot::Target {
            ms,
            label: format!("{what} target {ms} ms"),
        })
    };
    // Debug quotes the name and escapes what a title should not hold (a newline).
    outputs::write_replacing(out_dir, &t.ttft_cdf, |p| {
        plot::plot_cdfs_with_target(
            p,
            &format!("Tier {:?}: time to first token (CDF)", t.tier),
            &cdf(|r| r.ttft_ms),
            target("ttft", t.ttft_target_ms).as_ref(),
        )
    })?;
    outputs::write_replacing(out_dir, &t.tpot_cdf, |p| {
        plot::plot_cdfs_with_target(
            p,
            &format!("Tier {:?}: time per output token (CDF)", t.tier),
            &cdf(|r| r.tpot_ms),
            target("tpot", t.tpot_target_ms).as_ref(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_rate_counts_the_busiest_window() {
        // One a second for 60 s, and a burst of 50 within [30, 31).
        let mut ts: Vec<f64> = (0..=60).map(f64::from).collect();
        ts.extend((0..50).map(|i| 30.0 + f64::from(i) / 50.0));
        // The busiest 10 s: the burst and 10 of the others (a window (t - 10, t]).
        assert_eq!(peak_rate(&ts, 60.0), Some(6.0));
        // In any order.
        ts.reverse();
        assert_eq!(peak_rate(&ts, 60.0), Some(6.0));
        // Too short a span for a window to say more than the mean.
        let even: Vec<f64> = (0..=60).map(f64::from).collect();
        assert_eq!(peak_rate(&even[..15], 14.0), None);
        assert_eq!(peak_rate(&even, 60.0), Some(1.0));
        assert_eq!(rates(&even), (1.0, Some(1.0)));
        assert_eq!(rates(&[3.0, 3.0]), (0.0, None));
        assert_eq!(rates(&[]), (0.0, None));
    }

    #[test]
    fn pinned_adapters_no_request_names_are_warned_of() {
        let request = |adapter: Option<u32>| trace::TraceRequest {
            arrival_s: 0.0,
            prompt: vec![7u32; 4].into(),
            output_len: 1,
            tenant: String::new(),
            tier: String::new(),
            priority: None,
            adapter,
            client: String::new(),
            think_s: None,
        };
        let rs = [request(Some(1)), request(None), request(Some(3))];
        assert_eq!(unused_pinned(&[], &rs), None);
        assert_eq!(unused_pinned(&[3, 1], &rs), None);
        // Ids are 1-based: a 0 (and an id past the trace's adapters) pins nothing used.
        let w = unused_pinned(&[0, 1], &rs).expect("a warning");
        assert!(
            w.starts_with("scheduler.lora_memory.pinned: no request names adapter 0 "),
            "{w}"
        );
        assert!(w.contains("it holds one of max_cpu_loras"), "{w}");
        let w = unused_pinned(&[0, 2, 3], &rs).expect("a warning");
        assert!(
            w.contains("adapter 0, 2 ") && w.contains("each holds"),
            "{w}"
        );
        assert!(!w.contains("  "), "one line of prose: {w}");
        // Registered ones hold places in the registry.
        assert_eq!(unused_registered(&[1], &rs), None);
        let w = unused_registered(&[1, 4], &rs).expect("a warning");
        assert_eq!(
            w,
            "scheduler.lora_memory.registered: no request names adapter 4 (adapters are the ids \
             1..=workload.adapters.count, or a jsonl record's own `adapter`): registered, it \
             holds one of max_adapters' places for nothing"
        );
    }

    #[test]
    fn requests_beyond_the_calibrations_longest_context_are_warned_of() {
        let request = |prompt: usize, output: u32| trace::TraceRequest {
            arrival_s: 0.0,
            prompt: vec![7u32; prompt].into(),
            output_len: output,
            tenant: String::new(),
            tier: String::new(),
            priority: None,
            adapter: None,
            client: String::new(),
            think_s: None,
        };
        let rs = [request(40, 10), request(100, 50), request(290, 10)];
        let mut c = cost::Calibration::default();
        // A file written before the field: no warning.
        assert_eq!(beyond_calibration(&c, &rs, None), None);
        c.max_context = Some(100);
        let w = beyond_calibration(&c, &rs, None).expect("a warning");
        assert!(
            w.starts_with(
                "2 of 3 requests reach a context (prompt + output) beyond the 100 tokens"
            ),
            "{w}"
        );
        assert!(
            w.contains("the longest: 300") && w.contains("--max-context of at least 300"),
            "{w}"
        );
        assert!(!w.contains("  "), "one line of prose: {w}");
        c.max_context = Some(300);
        assert_eq!(beyond_calibration(&c, &rs, None), None);
        // A sliding window of 128: a calibration that reached it measured every context's
        // steps (they read no more than the window's keys); one short of it did not.
        c.max_context = Some(128);
        assert_eq!(beyond_calibration(&c, &rs, Some(128)), None);
        c.max_context = Some(100);
        let w = beyond_calibration(&c, &rs, Some(128)).expect("a warning");
        assert!(w.contains("the longest: 128"), "{w}");
    }
}
