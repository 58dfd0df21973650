//! The figures of a run's phases, with `changes` in its spec ([`crate::changes`]): phase 0
//! holds the requests arriving before the first change, phase k those arriving from the
//! k-th change's time to the next one's. A request belongs to the phase it arrived in
//! (when it was sent, for a closed-loop client's), wherever it ran: the requests queued at a
//! change are the earlier phase's, and what the new policy does to them shows there. A
//! request is judged by its tier's SLO targets when it arrived (those it was queued with), so
//! a phase's per-tier attainment is against the targets in force in that phase, which its
//! tier rows show beside it.

use crate::changes::AppliedChange;
use crate::report::{fmt_ms, stats_of, tier_summary, LatencyStats, RequestRecord, TierSummary};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The change a phase starts with.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseStart {
    /// What it does: `policy slo-aware`, `server.max_pending_requests 64`.
    pub change: String,
    /// Its time in the spec, in seconds.
    pub at_s: f64,
    /// When it took effect: the first step boundary from `at_s` on, in seconds.
    pub applied_s: f64,
    /// Whether it swapped the policy: for another one, or the one in force rebuilt with new
    /// tiers (`false`: it set none, or the one in force with the tiers unchanged, which the
    /// server leaves running).
    pub swapped: bool,
    /// Requests in the scheduler's queue when it took effect (those the new policy found).
    pub waiting: u64,
    /// Requests running then.
    pub running: u64,
    /// How the tiers' new KV bounds took where not as asked (a tier over its new bound, or
    /// one held up by a request queued before), as the server warns of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// The figures of one phase.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseSummary {
    /// 0 before the first change, k from the k-th on.
    pub phase: u64,
    /// The policy in force during the phase (its name).
    pub policy: String,
    /// The change the phase starts with (`None` for phase 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<PhaseStart>,
    /// The phase's first arrival time (0, or its change's `at_s`), in seconds.
    pub from_s: f64,
    /// The next change's time (`None` for the last phase), in seconds.
    pub to_s: Option<f64>,
    /// Requests arriving in the phase.
    pub requests: u64,
    /// Of which finished.
    pub finished: u64,
    /// Time to first token of its finished requests.
    pub ttft_ms: LatencyStats,
    /// Time per output token.
    pub tpot_ms: LatencyStats,
    /// End-to-end latency.
    pub e2e_ms: LatencyStats,
    /// Arrival to first scheduled.
    pub queue_ms: LatencyStats,
    /// Requests whose tier sets a TTFT or TPOT target.
    pub slo_requests: u64,
    /// Fraction of those meeting every target of their tier (`None`: none has a target).
    pub slo_attainment: Option<f64>,
    /// Per-tier SLO results, by tier name, with the targets of the tiers in force in the
    /// phase (the spec's, or those of the last change that set them).
    pub tiers: Vec<TierSummary>,
}

/// The phases of a run whose `records` saw the changes `applied` (in time order), from
/// `first_policy`, the run's own policy (its name), and `tiers`, the spec's.
pub fn phase_summaries(
    records: &[RequestRecord],
    applied: &[AppliedChange],
    first_policy: &str,
    tiers: &BTreeMap<String, crate::spec::TierConf>,
) -> Vec<PhaseSummary> {
    if applied.is_empty() {
        return Vec::new();
    }
    let bounds: Vec<f64> = applied.iter().map(|c| c.at_s).collect();
    let mut by_phase: Vec<Vec<&RequestRecord>> = vec![Vec::new(); applied.len() + 1];
    for r in records {
        // The number of changes made by the request's arrival.
        let k = bounds.partition_point(|&t| t <= r.arrival_s);
        by_phase[k].push(r);
    }
    by_phase
        .into_iter()
        .enumerate()
        .map(|(k, rs)| {
            let start = k.checked_sub(1).map(|j| &applied[j]);
            let tiers = applied[..k]
                .iter()
                .rev()
                .find_map(|c| c.tiers.as_ref())
                .unwrap_or(tiers);
            let first = rs.iter().map(|r| r.arrival_s).fold(f64::INFINITY, f64::min);
            let last = rs
                .iter()
                .filter_map(|r| r.finish_s)
                .fold(f64::NEG_INFINITY, f64::max);
            let duration_s = if last > first { last - first } else { 0.0 };
            let slo_requests = rs.iter().filter(|r| r.met_slo().is_some()).count();
            let met = rs.iter().filter(|r| r.met_slo() == Some(true)).count();
            let mut by_tier: BTreeMap<&str, Vec<&RequestRecord>> = BTreeMap::new();
            for r in &rs {
                by_tier.entry(r.tier.as_str()).or_default().push(r);
            }
            let tier_rows = by_tier
                .into_iter()
                .map(|(tier, rs)| {
                    let mut t = tier_summary(tier, &rs, duration_s);
                    let conf = tiers.get(tier);
                    t.ttft_target_ms = conf.and_then(|c| c.ttft_ms);
                    t.tpot_target_ms = conf.and_then(|c| c.tpot_ms);
                    t
                })
                .collect();
            PhaseSummary {
                phase: k as u64,
                policy: start
                    .map_or(first_policy, |c| c.policy.as_str())
                    .to_string(),
                start: start.map(|c| PhaseStart {
                    change: c.what.clone(),
                    at_s: c.at_s,
                    applied_s: c.applied_s,
                    swapped: c.swapped,
                    waiting: c.waiting,
                    running: c.running,
                    notes: c.notes.clone(),
                }),
                from_s: start.map_or(0.0, |c| c.at_s),
                to_s: bounds.get(k).copied(),
                requests: rs.len() as u64,
                finished: rs.iter().filter(|r| r.finish_s.is_some()).count() as u64,
                ttft_ms: stats_of(rs.iter().copied(), |r| r.ttft_ms),
                tpot_ms: stats_of(rs.iter().copied(), |r| r.tpot_ms),
                e2e_ms: stats_of(rs.iter().copied(), |r| r.e2e_ms),
                queue_ms: stats_of(rs.iter().copied(), |r| {
                    r.first_scheduled_s.map(|s| (s - r.arrival_s) * 1e3)
                }),
                slo_requests: slo_requests as u64,
                slo_attainment: (slo_requests > 0).then(|| met as f64 / slo_requests as f64),
                tiers: tier_rows,
            }
        })
        .collect()
}

/// One row of the phases table: its labels (policy, phase, from, applied, in force, queue),
/// its requests, TTFT, TPOT and E2E percentiles, and its SLO attainment.
fn phase_row(
    s: &mut String,
    labels: [&str; 6],
    requests: u64,
    [ttft, tpot, e2e]: [&LatencyStats; 3],
    slo: &str,
) {
    let [policy, phase, from, applied, in_force, queue] = labels;
    let _ = writeln!(
        s,
        "{policy:<18} {phase:>5} {from:>9} {applied:>9} {in_force:<18} {queue:>9} {requests:>6} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {slo:>6}",
        fmt_ms(ttft.p50, 1),
        fmt_ms(ttft.p99, 1),
        fmt_ms(tpot.p50, 2),
        fmt_ms(tpot.p99, 2),
        fmt_ms(e2e.p50, 1),
        fmt_ms(e2e.p99, 1),
    );
}

/// The phases' table of the text report (empty when no policy has phases): one row per
/// policy and phase, then its whole run's row (`all`) and what each change did; with tiers,
/// one row per policy, phase and tier.
pub fn phases_text(policies: &[crate::report::PolicySummary]) -> String {
    let mut s = String::new();
    if policies.iter().all(|p| p.phases.is_empty()) {
        return s;
    }
    let pct = |x: Option<f64>| x.map_or("n/a".to_string(), |v| format!("{:.1}", 100.0 * v));
    // A tier's target in force in the phase (`-`: none), as written.
    let target = |x: Option<f64>| x.map_or("-".to_string(), |v| v.to_string());
    let _ = writeln!(
        s,
        "\nphases: the requests arriving before the first change (phase 0), then from each \
         change to the next; a change takes effect at the first step boundary from its time \
         (applied), the scheduler's queue then shown as waiting/running; `all` is the whole \
         run; a policy equal to the one in force is left running (kept)"
    );
    let _ = writeln!(
        s,
        "{:<18} {:>5} {:>9} {:>9} {:<18} {:>9} {:>6} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>6}",
        "policy",
        "phase",
        "from s",
        "applied",
        "in force",
        "queue",
        "reqs",
        "ttft p50",
        "ttft p99",
        "tpot p50",
        "tpot p99",
        "e2e p50",
        "e2e p99",
        "slo%"
    );
    for p in policies.iter().filter(|p| !p.phases.is_empty()) {
        for ph in &p.phases {
            let (applied, queue, in_force) = match &ph.start {
                Some(st) => (
                    format!("{:.3}", st.applied_s),
                    format!("{}/{}", st.waiting, st.running),
                    if st.swapped {
                        ph.policy.clone()
                    } else {
                        format!("{} (kept)", ph.policy)
                    },
                ),
                None => ("-".into(), "-".into(), ph.policy.clone()),
            };
            let from = format!("{:.3}", ph.from_s);
            let phase = ph.phase.to_string();
            let labels = [
                p.policy.as_str(),
                &phase,
                &from,
                &applied,
                &in_force,
                &queue,
            ];
            let stats = [&ph.ttft_ms, &ph.tpot_ms, &ph.e2e_ms];
            phase_row(&mut s, labels, ph.requests, stats, &pct(ph.slo_attainment));
        }
        let labels = [p.policy.as_str(), "all", "-", "-", "-", "-"];
        let stats = [&p.ttft_ms, &p.tpot_ms, &p.e2e_ms];
        phase_row(&mut s, labels, p.requests, stats, &pct(p.slo_attainment));
        for (k, c) in p
            .phases
            .iter()
            .filter_map(|ph| Some((ph.phase, ph.start.as_ref()?)))
        {
            let _ = writeln!(
                s,
                "{:<18} change {k} at {} s: {}",
                p.policy, c.at_s, c.change
            );
            for note in &c.notes {
                let _ = writeln!(s, "{:<18}   {note}", p.policy);
            }
        }
    }
    let tiered = policies.iter().any(|p| {
        p.phases
            .iter()
            .any(|ph| ph.tiers.iter().any(|t| !t.tier.is_empty()))
    });
    if tiered {
        let _ = writeln!(
            s,
            "\n{:<18} {:>5} {:<10} {:>6} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9}",
            "policy",
            "phase",
            "tier",
            "reqs",
            "ttft%",
            "tpot%",
            "slo%",
            "ttft p99",
            "tpot p99",
            "ttft tgt",
            "tpot tgt"
        );
        for p in policies {
            let rows = p.phases.iter().map(|ph| (ph.phase.to_string(), &ph.tiers));
            for (phase, tiers) in rows.chain(std::iter::once(("all".to_string(), &p.tiers))) {
                if p.phases.is_empty() {
                    break;
                }
                for t in tiers {
                    let _ = writeln!(
                        s,
                        "{:<18} {:>5} {:<10} {:>6} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9}",
                        p.policy,
                        phase,
                        t.tier,
                        t.requests,
                        pct(t.ttft_attainment),
                        pct(t.tpot_attainment),
                        pct(t.slo_attainment),
                        fmt_ms(t.ttft_ms.p99, 1),
                        fmt_ms(t.tpot_ms.p99, 2),
                        target(t.ttft_target_ms),
                        target(t.tpot_target_ms)
                    );
                }
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(arrival_s: f64, ttft_ms: f64, tier: &str, met: bool) -> RequestRecord {
        RequestRecord {
            arrival_s,
            tier: tier.into(),
            first_scheduled_s: Some(arrival_s),
            first_token_s: Some(arrival_s + ttft_ms / 1e3),
            finish_s: Some(arrival_s + 1.0),
            ttft_ms: Some(ttft_ms),
            e2e_ms: Some(1000.0),
            met_ttft: Some(met),
            outcome: "length".into(),
            ..Default::default()
        }
    }

    fn change(at_s: f64, policy: &str) -> AppliedChange {
        AppliedChange {
            at_s,
            applied_s: at_s + 0.001,
            what: format!("policy {policy}"),
            swapped: true,
            policy: policy.into(),
            waiting: 3,
            running: 2,
            tiers: None,
            notes: Vec::new(),
        }
    }

    #[test]
    fn requests_fall_in_the_phase_of_their_arrival() {
        let records = [
            record(0.0, 10.0, "gold", true),
            record(4.999, 20.0, "gold", false),
            // At a change's time: the later phase's.
            record(5.0, 30.0, "gold", true),
            record(9.0, 40.0, "", true),
            record(10.0, 50.0, "gold", false),
        ];
        let changes = [change(5.0, "priority"), change(10.0, "slo-aware")];
        let phases = phase_summaries(&records, &changes, "fcfs", &BTreeMap::new());
        let got: Vec<(u64, &str, f64, Option<f64>, u64)> = phases
            .iter()
            .map(|p| (p.phase, p.policy.as_str(), p.from_s, p.to_s, p.requests))
            .collect();
        assert_eq!(
            got,
            [
                (0, "fcfs", 0.0, Some(5.0), 2),
                (1, "priority", 5.0, Some(10.0), 2),
                (2, "slo-aware", 10.0, None, 1)
            ]
        );
        // Linear interpolation between the phase's two TTFTs (10 and 20 ms).
        assert_eq!(phases[0].ttft_ms.p50, Some(15.0));
        assert_eq!(phases[0].slo_attainment, Some(0.5));
        assert_eq!(phases[1].slo_attainment, Some(1.0));
        assert_eq!(phases[2].slo_attainment, Some(0.0));
        assert_eq!(
            phases[1].start.as_ref().map(|s| (s.waiting, s.running)),
            Some((3, 2))
        );
        assert!(phases[0].start.is_none());
        let tiers: Vec<&str> = phases[1].tiers.iter().map(|t| t.tier.as_str()).collect();
        assert_eq!(tiers, ["", "gold"]);
    }

    #[test]
    fn a_run_without_changes_has_no_phases() {
        let records = [record(0.0, 10.0, "", true)];
        assert!(phase_summaries(&records, &[], "fcfs", &BTreeMap::new()).is_empty());
        assert_eq!(phases_text(&[crate::report::PolicySummary::default()]), "");
    }
}
