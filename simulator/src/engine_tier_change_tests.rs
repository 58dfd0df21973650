//! A spec's `changes` that set `tiers` (a SIGHUP of an edited `tiers` section) in the loop:
//! the new settings hold for the requests arriving from the change on, the requests queued
//! before keep what they were queued with, and each request is judged by the SLO targets of
//! its arrival. Steps cost 1 ms each and one sequence runs at a time, so every expected time
//! below is counted by hand.

use super::*;

/// One sequence at a time, 1 ms steps, 64 blocks of 16 tokens; the run's policy `policy`,
/// `tiers` the spec's tiers and `changes` its changes (YAML flow).
fn sim(policy: &str, tiers: &str, changes: &str) -> Simulation {
    super::swap_tests::sim_of(policy, tiers, "", changes)
}

/// An 8-token prompt of the given tier (the engine tests' request builder).
fn req(arrival_s: f64, output: u32, tier: &str) -> TraceRequest {
    super::tests::req(arrival_s, 8, output, tier)
}

/// The requests' ids in the order they were first scheduled.
fn order(run: &PolicyRun) -> Vec<u64> {
    let mut v: Vec<(u64, u64)> = run
        .records
        .iter()
        .map(|r| (r.id, (r.first_scheduled_s.unwrap() * 1e6).round() as u64))
        .collect();
    v.sort_by_key(|&(id, at)| (at, id));
    v.into_iter().map(|(id, _)| id).collect()
}

const PRIORITIES: &str = "{hi: {priority: 0}, lo: {priority: 2}}";
/// `PRIORITIES` the other way round, with a tier added.
const SWAPPED: &str = "{hi: {priority: 2}, lo: {priority: 0}, new: {}}";

#[test]
fn new_tier_priorities_order_the_later_arrivals_and_leave_the_queued_ones_as_they_were() {
    // At 0 s four requests (0 lo, 1 hi, 2 lo, 3 hi), two tokens each; at 1.5 ms another lo
    // (4). Under `priority`: 1 and 3 (hi) first, then 0, 2 and 4 by arrival.
    let mut rs: Vec<TraceRequest> = (0..4)
        .map(|i| req(0.0, 2, if i % 2 == 0 { "lo" } else { "hi" }))
        .collect();
    rs.push(req(0.0015, 2, "lo"));
    let before = sim("priority", PRIORITIES, "[]")
        .run_policy(&PolicySpec::named("priority"), &rs, false)
        .unwrap();
    assert_eq!(order(&before), [1, 3, 0, 2, 4]);
    // At 1 ms the tiers' priorities are swapped. The four queued keep theirs (0 and 2 at 2,
    // 3 at 0); 4 arrives as lo at priority 0, before 0 and 2, after 3 (same priority,
    // earlier arrival).
    let changed = sim(
        "priority",
        PRIORITIES,
        &format!("[{{at_s: 0.001, tiers: {SWAPPED}}}]"),
    )
    .run_policy(&PolicySpec::named("priority"), &rs, false)
    .unwrap();
    assert_eq!(order(&changed), [1, 3, 4, 0, 2]);
    assert!(changed.records.iter().all(|r| r.outcome == "length"));
    let c = &changed.changes[0];
    // As the server: the policy in force is rebuilt with the new tiers and swapped in.
    assert_eq!(
        (c.applied_s, c.swapped, c.policy.as_str()),
        (0.001, true, "priority")
    );
    assert_eq!(
        c.what, "tiers hi.priority 0 -> 2, lo.priority 2 -> 0, +new",
        "{c:?}"
    );
    assert_eq!(c.tiers.as_ref().map(|t| t.len()), Some(3));
}

#[test]
fn equal_tiers_change_nothing_and_swap_nothing() {
    let rs: Vec<TraceRequest> = (0..4).map(|i| req(f64::from(i) / 1e3, 2, "lo")).collect();
    let run = sim(
        "fcfs",
        PRIORITIES,
        "[{at_s: 0.001, tiers: {lo: {priority: 2}, hi: {priority: 0}}}]",
    )
    .run_policy(&PolicySpec::named("fcfs"), &rs, false)
    .unwrap();
    let c = &run.changes[0];
    assert_eq!((c.swapped, c.what.as_str()), (false, "tiers unchanged"));
    assert!(c.tiers.is_none());
}

#[test]
fn a_request_is_judged_by_the_targets_of_its_arrival() {
    // Tier gold's TTFT target is 2.5 ms until 5 ms, then 100 ms. Three requests at 0 s, one
    // step each (one token): first tokens at 1, 2 and 3 ms; the third misses 2.5 ms. Three
    // more at 6 ms have the same TTFTs and are judged by 100 ms: the third meets it.
    let mut rs: Vec<TraceRequest> = (0..3).map(|_| req(0.0, 1, "gold")).collect();
    rs.extend((0..3).map(|_| req(0.006, 1, "gold")));
    let tiers = "{gold: {ttft_ms: 2.5}}";
    let s = sim(
        "fcfs",
        tiers,
        "[{at_s: 0.005, tiers: {gold: {ttft_ms: 100}}}]",
    );
    let run = s
        .run_policy(&PolicySpec::named("fcfs"), &rs, false)
        .unwrap();
    let ttft: Vec<(f64, Option<bool>)> = run
        .records
        .iter()
        .map(|r| (r.ttft_ms.unwrap(), r.met_ttft))
        .collect();
    assert_eq!(
        ttft,
        [
            (1.0, Some(true)),
            (2.0, Some(true)),
            (3.0, Some(false)),
            (1.0, Some(true)),
            (2.0, Some(true)),
            (3.0, Some(true))
        ]
    );
    // Each phase's tier row is against the targets in force in it.
    let phases = crate::phases::phase_summaries(&run.records, &run.changes, "fcfs", &s.spec.tiers);
    let rows: Vec<(u64, Option<f64>, Option<f64>)> = phases
        .iter()
        .map(|p| {
            (
                p.tiers[0].requests,
                p.tiers[0].ttft_target_ms,
                p.slo_attainment,
            )
        })
        .collect();
    assert_eq!(
        rows,
        [(3, Some(2.5), Some(2.0 / 3.0)), (3, Some(100.0), Some(1.0))]
    );
    let text = crate::phases::phases_text(&[crate::report::PolicySummary {
        policy: "fcfs".into(),
        phases,
        ..Default::default()
    }]);
    assert!(
        text.contains("change 1 at 0.005 s: tiers gold.ttft_ms 2.5 -> 100.0"),
        "{text}"
    );
}

#[test]
fn a_new_bound_on_a_tiers_requests_in_flight_refuses_its_later_arrivals() {
    // From 0.5 ms tier lo holds at most 2 in flight: the four at 0 s were admitted; at 1 ms
    // none of lo's finds a seat, hi's (no bound) does.
    let mut rs: Vec<TraceRequest> = (0..4).map(|_| req(0.0, 2, "lo")).collect();
    rs.extend([req(0.001, 2, "lo"), req(0.001, 2, "hi")]);
    let run = sim(
        "fcfs",
        PRIORITIES,
        "[{at_s: 0.0005, tiers: {hi: {priority: 0}, lo: {priority: 2, \
         max_pending_requests: 2}}}]",
    )
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
            "length"
        ]
    );
}

#[test]
fn a_kv_bound_below_what_a_queued_request_needs_is_held_up_and_said() {
    // Request 0 (lo) needs 48 tokens, 3 blocks; at 1 ms lo is bounded to 1 block (0.02 of
    // 64): the scheduling core holds the bound at what it needs until it ends, and the
    // change says so, as the server warns of it. It still ends with all its tokens.
    let rs = vec![req(0.0, 40, "lo"), req(0.002, 2, "lo")];
    let run = sim(
        "fcfs",
        PRIORITIES,
        "[{at_s: 0.001, tiers: {hi: {priority: 0}, lo: {priority: 2, max_kv_fraction: 0.02}}}]",
    )
    .run_policy(&PolicySpec::named("fcfs"), &rs, false)
    .unwrap();
    let outcomes: Vec<&str> = run.records.iter().map(|r| r.outcome.as_str()).collect();
    assert_eq!(outcomes, ["length", "length"]);
    let notes = &run.changes[0].notes;
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].starts_with("tier `lo`'s KV bound is held at"),
        "{notes:?}"
    );
}

#[test]
fn a_sighup_puts_the_files_policy_back_over_an_admin_swap() {
    // As the server's reload: the file's policy (the run's, fcfs) replaces the one set
    // through PUT /admin/policy (priority) on a SIGHUP that sets only the tiers.
    let rs: Vec<TraceRequest> = (0..6).map(|i| req(f64::from(i) / 1e3, 2, "lo")).collect();
    let run = sim(
        "fcfs",
        PRIORITIES,
        &format!(
            "[{{at_s: 0.001, policy: {{name: priority}}}}, {{at_s: 0.003, tiers: {SWAPPED}}}, \
             {{at_s: 0.004, server: {{max_pending_requests: 100}}}}]"
        ),
    )
    .run_policy(&PolicySpec::named("fcfs"), &rs, false)
    .unwrap();
    let got: Vec<(&str, bool)> = run
        .changes
        .iter()
        .map(|c| (c.policy.as_str(), c.swapped))
        .collect();
    // The last SIGHUP finds the file's policy in force: left running.
    assert_eq!(got, [("priority", true), ("fcfs", true), ("fcfs", false)]);
}

#[test]
fn the_workload_must_name_tiers_in_force_at_each_arrival() {
    let dir = super::tests::temp("tier-change-trace");
    let trace = dir.join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 1, \"tier\": \"lo\"}\n\
         {\"arrival_s\": 2, \"prompt_len\": 8, \"output_len\": 1, \"tier\": \"new\"}\n\
         {\"arrival_s\": 4, \"prompt_len\": 8, \"output_len\": 1, \"tier\": \"hi\"}\n",
    )
    .unwrap();
    let spec_file = dir.join("s.yaml");
    let check = |changes: &str| {
        std::fs::write(
            &spec_file,
            format!(
                "policies: [{{name: fcfs}}]\ntiers: {PRIORITIES}\n\
                 workload: {{trace: t.jsonl, format: jsonl}}\nchanges:\n{changes}"
            ),
        )
        .unwrap();
        let spec = SimulationSpec::from_yaml_file(&spec_file).unwrap();
        Simulation::new(&spec)
            .unwrap()
            .load_workload()
            .map(|w| w.requests.len())
            .map_err(|e| e.to_string())
    };
    let s = spec_file.display();
    // `new` is defined from 1 s on, and hi throughout.
    assert_eq!(
        check(&format!("  - at_s: 1\n    tiers: {SWAPPED}\n")),
        Ok(3)
    );
    // `new` defined only from 3 s: the request at 2 s names a tier not in force yet; the
    // change that defines it is named, at its line.
    assert_eq!(
        check(&format!(
            "  - at_s: 1\n    policy: {{name: priority}}\n  - at_s: 3\n    tiers: {SWAPPED}\n"
        )),
        Err(format!(
            "{s}:7: changes[1] (at_s 3): tiers: a request arriving at 2.000 s names tier \
             `new`, which the spec's tiers in force then do not define (the server serves no \
             key of a tier its file does not define): keep the tier in every change's `tiers` \
             while the workload names it"
        ))
    );
    // hi removed at 3 s while a request at 4 s names it.
    let err = check(&format!(
        "  - at_s: 1\n    tiers: {SWAPPED}\n  - at_s: 3\n    tiers: {{lo: {{}}, new: {{}}}}\n"
    ))
    .unwrap_err();
    assert!(
        err.starts_with(&format!(
            "{s}:7: changes[1] (at_s 3): tiers: a request arriving at 4.000 s names tier `hi`, \
             which changes[1] (at_s 3)'s tiers in force then do not define"
        )),
        "{err}"
    );
    // A change after the last arrival (4 s) is found as the workload is loaded, in the run's
    // words.
    let err = check(&format!(
        "  - at_s: 1\n    tiers: {SWAPPED}\n  - at_s: 4.5\n    policy: {{name: priority}}\n"
    ))
    .unwrap_err();
    assert_eq!(
        err,
        format!(
            "{s}:7: changes[1] (at_s 4.5): after the workload's last arrival (4.000 s): a \
             change's time lies within the trace's arrivals as shaped (time_scale, rate or \
             load, limit)"
        )
    );
}

#[test]
fn a_request_arriving_during_the_step_a_change_falls_in_gets_the_new_tiers() {
    // The server's HTTP layer takes a SIGHUP's tiers at once (`Engine::set_tiers`: requests
    // submitted from then on get the new targets; the rate limits and bounds of
    // `apply_access`), its scheduler at its next step boundary. Request 0 runs ten 1 ms
    // steps from 0 s; at 4.5 ms, during its fifth step, a change adds tier `new` (TTFT
    // target 50 ms) and bounds tier `lo` to 1 request in flight; at 4.6 ms a request of
    // `new` arrives and at 4.7 ms one of `lo`. The first has its tier's target (its first
    // token at 11 ms: TTFT 6.4 ms, met) and its priority; the second is refused, as the
    // bound holds from 4.5 ms on (request 0 of `lo` is still in flight).
    let rs = vec![
        req(0.0, 10, "lo"),
        req(0.0046, 1, "new"),
        req(0.0047, 1, "lo"),
    ];
    let run = sim(
        "fcfs",
        PRIORITIES,
        "[{at_s: 0.0045, tiers: {hi: {priority: 0}, lo: {priority: 2, \
         max_pending_requests: 1}, new: {ttft_ms: 50, priority: 1}}}]",
    )
    .run_policy(&PolicySpec::named("fcfs"), &rs, false)
    .unwrap();
    let r = &run.records[1];
    assert_eq!(r.outcome, "length");
    assert!((r.ttft_ms.unwrap() - 6.4).abs() < 1e-9, "{r:?}");
    assert_eq!(r.met_ttft, Some(true), "{r:?}");
    assert_eq!(run.records[2].outcome, "overloaded");
    // The scheduler takes the tiers at the first step boundary from 4.5 ms: 5 ms.
    assert_eq!(run.changes[0].applied_s, 0.005);
}

#[test]
fn tiers_changed_only_in_what_the_scheduler_is_not_given_leave_the_policy_running() {
    // The server's reload compares the tiers as the scheduler and the policies take them
    // (`TierSpec`: targets, weight, preemptible, max_queue_ms, max_kv_fraction); a SIGHUP
    // that changes only a tier's priority, bounds on requests in flight, rate limits or
    // share of adapter memory (the HTTP layer's settings) neither calls `Engine::set_tiers`
    // nor swaps the policy: it is left running with its state. The bound still holds for
    // the later arrivals.
    let mut rs: Vec<TraceRequest> = (0..4).map(|_| req(0.0, 2, "lo")).collect();
    rs.push(req(0.001, 2, "lo"));
    let run = sim(
        "fair-share",
        PRIORITIES,
        "[{at_s: 0.0005, tiers: {hi: {priority: 1}, lo: {priority: 2, \
         max_pending_requests: 2, requests_per_minute: 600}}}]",
    )
    .run_policy(&PolicySpec::named("fair-share"), &rs, false)
    .unwrap();
    let c = &run.changes[0];
    assert_eq!(
        (c.swapped, c.policy.as_str()),
        (false, "fair-share"),
        "{c:?}"
    );
    assert!(c.tiers.is_some(), "{c:?}");
    assert_eq!(run.records[4].outcome, "overloaded");
}

#[test]
fn a_request_arriving_at_a_change_s_own_time_is_of_its_phase_everywhere() {
    // 4.1 as an f64 is a hair below 4.1 (4.1 * 1e6 = 4099999.9999999995): read by truncation
    // the arrival fell on 4,099,999 µs and the change (rounded) on 4,100,000, so the loop ran
    // the request before the change, with no tier, and its phase was 0, while the workload
    // check (comparing seconds) took it as after the change and let its new tier through.
    // Both are now the nearest microsecond: it arrives with the change's tiers, in phase 1.
    let rs = vec![req(0.0, 1, "lo"), req(4.1, 1, "new")];
    let s = sim(
        "fcfs",
        PRIORITIES,
        "[{at_s: 4.1, tiers: {hi: {priority: 0}, lo: {priority: 2}, \
         new: {ttft_ms: 50, priority: 1}}}]",
    );
    let run = s
        .run_policy(&PolicySpec::named("fcfs"), &rs, false)
        .unwrap();
    let r = &run.records[1];
    assert_eq!(r.arrival_s, 4.1);
    assert_eq!(r.met_ttft, Some(true), "{r:?}");
    let phases = crate::phases::phase_summaries(&run.records, &run.changes, "fcfs", &s.spec.tiers);
    let counts: Vec<u64> = phases.iter().map(|p| p.requests).collect();
    assert_eq!(counts, [1, 1]);
}
