//! A spec's `changes` in the loop: a policy swapped at a simulated time changes the
//! scheduling decisions from the first step boundary after it on, never before, and carries
//! every queued request into the new policy. Steps cost 1 ms each, so every expected time
//! below is counted by hand.

use super::*;
use crate::cost::Calibration;
use proptest::prelude::*;
use std::path::Path;

/// One sequence at a time, 1 ms steps; tiers `hi` (priority 0) and `lo` (priority 2);
/// `changes` is the spec's `changes:` (YAML flow), `async_scheduling` its flag.
fn sim(changes: &str, async_scheduling: bool) -> Simulation {
    sim_of(
        "fcfs",
        "{hi: {priority: 0}, lo: {priority: 2}}",
        &format!(", async_scheduling: {async_scheduling}"),
        changes,
    )
}

/// One sequence at a time, 1 ms steps, 64 blocks of 16 tokens: the run's policy `policy`,
/// `tiers` the spec's tiers, `scheduler` more of its scheduler section (YAML flow entries
/// after a comma, or empty) and `changes` its changes (YAML flow).
pub(super) fn sim_of(policy: &str, tiers: &str, scheduler: &str, changes: &str) -> Simulation {
    let yaml = format!(
        "policies: [{{name: {policy}}}]\ntiers: {tiers}\n\
         scheduler: {{max_num_seqs: 1, max_model_len: 100{scheduler}}}\n\
         cache: {{num_gpu_blocks: 64}}\nworkload: {{trace: unused.csv, format: azure}}\n\
         changes: {changes}\n"
    );
    let spec = SimulationSpec::from_yaml_str(&yaml, Path::new("t.yaml")).unwrap();
    let mut sim = Simulation::new(&spec).unwrap();
    sim.cost = CostModel::Calibrated(Calibration {
        intercept_s: 1e-3,
        ..Default::default()
    });
    sim
}

/// An 8-token prompt of the given tier (the engine tests' request builder).
fn req(arrival_s: f64, output: u32, tier: &str) -> TraceRequest {
    super::tests::req(arrival_s, 8, output, tier)
}

/// Eight requests at 0 s, `lo` and `hi` in turn (ids 0, 2, 4, 6 `lo`), two tokens each: two
/// 1 ms steps apiece, one at a time; and one more at 30 s, after they have all ended (a
/// change's time lies within the trace's arrivals).
fn alternating() -> Vec<TraceRequest> {
    let mut rs: Vec<TraceRequest> = (0..8)
        .map(|i| req(0.0, 2, if i % 2 == 0 { "lo" } else { "hi" }))
        .collect();
    rs.push(req(30.0, 2, "lo"));
    rs
}

/// The requests' ids in the order they were first scheduled, with those times in ms.
fn order(run: &PolicyRun) -> Vec<(u64, f64)> {
    let mut v: Vec<(u64, f64)> = run
        .records
        .iter()
        .map(|r| (r.id, (r.first_scheduled_s.unwrap() * 1e3).round()))
        .collect();
    v.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    v
}

fn ids(order: &[(u64, f64)]) -> Vec<u64> {
    order.iter().map(|o| o.0).collect()
}

/// Every request of `rs` finished once, with all its tokens.
fn all_served(run: &PolicyRun, rs: &[TraceRequest]) {
    assert_eq!(run.records.len(), rs.len());
    for (r, t) in run.records.iter().zip(rs) {
        assert_eq!(r.outcome, "length", "request {}", r.id);
        assert_eq!(r.generated, u64::from(t.output_len), "request {}", r.id);
    }
}

#[test]
fn a_swap_changes_the_order_only_after_its_time_and_keeps_every_request() {
    let rs = alternating();
    let fcfs = sim("[]", false)
        .run_policy(&PolicySpec::named("fcfs"), &rs, false)
        .unwrap();
    let priority = sim("[]", false)
        .run_policy(&PolicySpec::named("priority"), &rs, false)
        .unwrap();
    // The trace tells the two apart: arrival order, and `hi` (odd ids) first.
    assert_eq!(ids(&order(&fcfs)), [0, 1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(ids(&order(&priority)), [1, 3, 5, 7, 0, 2, 4, 6, 8]);
    // Swapped to priority at 6.5 ms: requests 0-2 have run (0-6 ms), 3 runs from 6 ms, and
    // the swap comes at the next step boundary, 7 ms, with 4-7 waiting. From 8 ms on the
    // `hi` ones (5, 7) go first.
    let swapped = sim("[{at_s: 0.0065, policy: {name: priority}}]", false)
        .run_policy(&PolicySpec::named("fcfs"), &rs, false)
        .unwrap();
    let got = order(&swapped);
    assert_eq!(ids(&got), [0, 1, 2, 3, 5, 7, 4, 6, 8]);
    // Before the swap, the decisions are fcfs's to the millisecond.
    assert_eq!(got[..4], order(&fcfs)[..4]);
    assert_eq!(
        got[4..].iter().map(|o| o.1).collect::<Vec<_>>(),
        [8.0, 10.0, 12.0, 14.0, 30_000.0]
    );
    all_served(&swapped, &rs);
    assert_eq!(
        swapped.changes,
        [crate::changes::AppliedChange {
            at_s: 0.0065,
            applied_s: 0.007,
            what: "policy priority".into(),
            swapped: true,
            policy: "priority".into(),
            waiting: 4,
            running: 1,
            tiers: None,
            notes: Vec::new(),
        }]
    );
}

#[test]
fn a_swap_to_the_policy_in_force_leaves_it_running() {
    // As the server: the same name and parameters swap nothing, and change no decision.
    let rs = alternating();
    let run = sim(
        "[{at_s: 0.0065, scheduler: {policy: {name: fcfs, params: {}}}}]",
        false,
    )
    .run_policy(&PolicySpec::named("fcfs"), &rs, false)
    .unwrap();
    assert_eq!(ids(&order(&run)), [0, 1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(run.changes.len(), 1);
    assert!(!run.changes[0].swapped);
    assert_eq!(run.changes[0].policy, "fcfs");
}

#[test]
fn a_swap_while_idle_takes_effect_at_its_own_time() {
    // Nothing runs between 0.002 s and 0.010 s: the change at 0.005 s is applied then, with
    // an empty queue, and the later requests are ordered by priority.
    let mut rs = vec![req(0.0, 2, "lo")];
    rs.extend((0..4).map(|i| req(0.010, 2, if i % 2 == 0 { "lo" } else { "hi" })));
    let run = sim("[{at_s: 0.005, policy: {name: priority}}]", false)
        .run_policy(&PolicySpec::named("fcfs"), &rs, false)
        .unwrap();
    assert_eq!(ids(&order(&run)), [0, 2, 4, 1, 3]);
    let c = &run.changes[0];
    assert_eq!((c.applied_s, c.waiting, c.running), (0.005, 0, 0));
}

#[test]
fn a_lowered_bound_on_requests_in_flight_refuses_later_arrivals() {
    // server.max_pending_requests 2 from 0.0005 s: the four at 0 s were admitted; of the four
    // at 0.001 s none finds a seat (four are in flight), as the server's 503.
    let mut rs: Vec<TraceRequest> = (0..4).map(|_| req(0.0, 2, "lo")).collect();
    rs.extend((0..4).map(|_| req(0.001, 2, "lo")));
    let run = sim("[{at_s: 0.0005, server: {max_pending_requests: 2}}]", false)
        .run_policy(&PolicySpec::named("fcfs"), &rs, false)
        .unwrap();
    let outcomes: Vec<&str> = run.records.iter().map(|r| r.outcome.as_str()).collect();
    assert_eq!(
        outcomes,
        [
            "length",
            "length",
            "length",
            "length",
            "overloaded",
            "overloaded",
            "overloaded",
            "overloaded"
        ]
    );
    assert!(!run.changes[0].swapped);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Whatever the arrivals, lengths and swap times, with steps planned in order or ahead,
    /// and changes that swap the policy or set new tiers (priorities, targets, KV bounds,
    /// a tier added or removed: a SIGHUP, which also puts the file's policy back): every
    /// request ends once with all its tokens, and each change is applied once, in order, no
    /// earlier than its time.
    #[test]
    fn swaps_lose_and_duplicate_no_request(
        reqs in proptest::collection::vec((0u32..20, 1u32..6, any::<bool>()), 1..24),
        times in proptest::collection::btree_set(0u32..20, 0..4),
        kinds in proptest::collection::vec((any::<bool>(), 0i32..3, 0i32..3, 1u32..=20, any::<bool>()), 4),
        async_scheduling in any::<bool>(),
    ) {
        let mut rs: Vec<TraceRequest> = reqs
            .iter()
            .map(|&(ms, out, hi)| req(f64::from(ms) / 1e3, out, if hi { "hi" } else { "lo" }))
            .collect();
        rs.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
        let last_ms = reqs.iter().map(|r| r.0).max().unwrap_or(0);
        let policies = ["priority", "slo-aware", "fair-share", "mlfq", "fcfs", "chunked-prefill"];
        let changes: Vec<String> = times
            .iter()
            .filter(|&&t| t <= last_ms)
            .enumerate()
            .map(|(k, t)| {
                let at_s = f64::from(*t) / 1e3;
                let (tiers, hi, lo, kv, extra) = kinds[k];
                if !tiers {
                    return format!("{{at_s: {at_s}, policy: {{name: {}}}}}", policies[k]);
                }
                // A request needs at most one block: a bound of 0.05 of 64 blocks holds it.
                let kv = f64::from(kv) / 20.0;
                let extra = if extra { ", extra: {weight: 3}" } else { "" };
                format!(
                    "{{at_s: {at_s}, tiers: {{hi: {{priority: {hi}, ttft_ms: {kv}, \
                     max_kv_fraction: {kv}}}, lo: {{priority: {lo}, preemptible: true}}{extra}}}}}"
                )
            })
            .collect();
        let sim = sim(&format!("[{}]", changes.join(", ")), async_scheduling);
        let run = sim.run_policy(&PolicySpec::named("fcfs"), &rs, false).unwrap();
        prop_assert_eq!(run.records.len(), rs.len());
        for (r, t) in run.records.iter().zip(&rs) {
            prop_assert_eq!(r.outcome.as_str(), "length");
            prop_assert_eq!(r.generated, u64::from(t.output_len));
        }
        prop_assert_eq!(run.changes.len(), changes.len());
        for (c, next) in run.changes.iter().zip(run.changes.iter().skip(1)) {
            prop_assert!(c.at_s < next.at_s);
        }
        for c in &run.changes {
            prop_assert!(c.applied_s >= c.at_s);
        }
    }
}
