//! Queue bounds: who is timed out, when, and what is left behind.

use crate::policy::testutil::{request, run_step};
use crate::policy::{Fcfs, Policy, PolicyRegistry};
use crate::types::*;
use crate::{Scheduler, SchedulerError};

/// A tier `bounded` with a 1 ms bound and a tier `open` without; one seat.
fn config(blocks: usize, block_size: usize, default_ms: Option<u64>) -> SchedulerConfig {
    let tier = |name: &str, max_queue_ms| TierSpec {
        name: name.into(),
        ttft_ms: Some(100.0),
        tpot_ms: None,
        weight: 1.0,
        preemptible: true,
        max_queue_ms,
        max_kv_fraction: None,
    };
    SchedulerConfig {
        max_num_seqs: 1,
        max_num_batched_tokens: 64,
        block_size,
        num_gpu_blocks: blocks,
        max_model_len: 64,
        tiers: vec![tier("bounded", Some(1)), tier("open", None)],
        max_queue_ms: default_ms,
        ..SchedulerConfig::default()
    }
}

fn req(id: u64, tier: &str, arrival: u64, prompt: Vec<u32>, max_tokens: u32) -> Request {
    request(id, tier, arrival, prompt, max_tokens)
}

/// Runs one step at `now`, sampling token 7 everywhere; checks the invariants.
fn step(s: &mut Scheduler, now: u64) -> StepPlan {
    run_step(s, now, 7).0
}

fn timed_out(p: &StepPlan) -> Vec<u64> {
    p.timed_out.iter().map(|t| t.id.0).collect()
}

fn policy(name: &str, tiers: &[TierSpec]) -> Box<dyn Policy> {
    PolicyRegistry::with_builtins()
        .create(name, &serde_yaml::Value::Null, tiers)
        .unwrap()
}

/// With every registered policy: request 2 (1 ms bound, arrived at 10 µs) waits behind
/// request 1's seat; it is still waiting at its deadline (1,010 µs) and is ended 1 µs after,
/// holding nothing, while request 3 (no bound) waits on and finishes.
#[test]
fn a_request_is_timed_out_just_past_its_deadline_and_not_before_with_every_policy() {
    for name in PolicyRegistry::with_builtins().names() {
        let c = config(16, 4, None);
        let mut s = Scheduler::new(c.clone(), policy(name, &c.tiers), [1, 2]).unwrap();
        s.add_request(req(1, "open", 0, vec![1; 8], 50)).unwrap();
        step(&mut s, 0);
        s.add_request(req(2, "bounded", 10, vec![2; 8], 4)).unwrap();
        s.add_request(req(3, "open", 10, vec![3; 8], 4)).unwrap();
        assert_eq!(s.next_queue_deadline(), Some(Timestamp(1_010)), "{name}");
        let p = step(&mut s, 1_010);
        assert!(p.timed_out.is_empty(), "{name}: timed out at its deadline");
        assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Waiting));
        let p = step(&mut s, 1_011);
        assert_eq!(
            p.timed_out,
            vec![QueueTimeout {
                id: RequestId(2),
                waited: 1_001,
                max_queue_ms: 1,
                tier_bound: true,
                tier: "bounded".into(),
            }],
            "{name}"
        );
        assert_eq!(
            s.request_state(RequestId(2)),
            Some(RequestState::Finished(FinishReason::QueueTimeout))
        );
        assert_eq!(s.stats().num_waiting, 1, "{name}: request 3 waits on");
        assert!(s.forget(RequestId(2)));
        // Request 1 runs to its end, then request 3, however late.
        let mut t = 1_012;
        while s.has_unfinished() && t < 200_000_000 {
            let p = step(&mut s, t);
            assert!(p.timed_out.is_empty(), "{name}");
            t += 1_000_000;
        }
        for id in [1, 3] {
            assert!(
                matches!(
                    s.request_state(RequestId(id)),
                    Some(RequestState::Finished(FinishReason::Length))
                ),
                "{name}: request {id} {:?}",
                s.request_state(RequestId(id))
            );
        }
        assert_eq!(s.stats().num_free_blocks, 16, "{name}: blocks leaked");
        assert_eq!(s.pool_errors(), 0);
    }
}

/// A request preempted after its first admission has produced work: however long it then
/// waits, it is never timed out.
#[test]
fn a_preempted_request_is_never_timed_out() {
    // Two seats, 4 blocks of 4 tokens: two 8-token prompts fill the pool, and request 1's
    // first decode block preempts request 2 (the newest), which then waits past its bound.
    let mut c = config(4, 4, Some(1));
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(c, Box::new(Fcfs), [1, 2]).unwrap();
    s.add_request(req(1, "open", 0, (0..8).collect(), 8))
        .unwrap();
    s.add_request(req(2, "bounded", 0, (100..108).collect(), 8))
        .unwrap();
    assert_eq!(step(&mut s, 0).seqs.len(), 2);
    let p = step(&mut s, 1);
    assert_eq!(p.preempted, vec![RequestId(2)]);
    let mut t = 10_000;
    while s.has_unfinished() && t < 1_000_000_000 {
        assert!(step(&mut s, t).timed_out.is_empty());
        t += 100_000;
    }
    assert_eq!(
        s.request_state(RequestId(2)),
        Some(RequestState::Finished(FinishReason::Length))
    );
    assert_eq!(s.stats().num_free_blocks, 4);
}

/// A request queued without a bound (a beam search's later step) waits as long as it takes.
#[test]
fn an_unbounded_request_is_never_timed_out() {
    let mut s = Scheduler::new(config(16, 4, Some(1)), Box::new(Fcfs), [1, 2]).unwrap();
    s.add_request(req(1, "open", 0, vec![1; 8], 50)).unwrap();
    step(&mut s, 0);
    s.add_unbounded_request(req(2, "bounded", 0, vec![2; 8], 4))
        .unwrap();
    s.add_request(req(3, "bounded", 0, vec![3; 8], 4)).unwrap();
    assert_eq!(timed_out(&step(&mut s, 1_000_000)), vec![3]);
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Waiting));
}

/// The scheduler's bound is the default of a tier without its own and of unknown tiers; a
/// tier's own bound wins over it.
#[test]
fn the_scheduler_bound_is_the_default_and_a_tier_bound_wins() {
    let mut s = Scheduler::new(config(16, 4, Some(5)), Box::new(Fcfs), [1, 2]).unwrap();
    s.add_request(req(1, "open", 0, vec![1; 8], 50)).unwrap();
    step(&mut s, 0);
    s.add_request(req(2, "bounded", 0, vec![2; 8], 4)).unwrap();
    s.add_request(req(3, "open", 0, vec![3; 8], 4)).unwrap();
    s.add_request(req(4, "", 0, vec![4; 8], 4)).unwrap();
    assert_eq!(timed_out(&step(&mut s, 1_001)), vec![2]);
    assert!(step(&mut s, 5_000).timed_out.is_empty());
    let p = step(&mut s, 5_001);
    let mut ids = timed_out(&p);
    ids.sort_unstable();
    assert_eq!(ids, vec![3, 4]);
    assert!(p
        .timed_out
        .iter()
        .all(|t| !t.tier_bound && t.max_queue_ms == 5));
    assert!(!s.abort(RequestId(3)), "already ended");
}

/// A policy swapped in while requests wait keeps their bounds: the deadlines are the core's.
#[test]
fn a_policy_swap_keeps_the_bounds() {
    let c = config(16, 4, None);
    let mut s = Scheduler::new(c.clone(), Box::new(Fcfs), [1, 2]).unwrap();
    s.add_request(req(1, "open", 0, vec![1; 8], 50)).unwrap();
    step(&mut s, 0);
    s.add_request(req(2, "bounded", 0, vec![2; 8], 4)).unwrap();
    s.swap_policy(policy("fair-share", &c.tiers));
    assert_eq!(timed_out(&step(&mut s, 1_001)), vec![2]);
}

/// Requests admitted at once leave stale deadlines behind; they are compacted so the heap
/// stays within twice the live requests plus a constant.
#[test]
fn stale_deadlines_are_compacted() {
    let mut c = config(64, 4, Some(3_600_000));
    c.max_num_seqs = 4;
    let mut s = Scheduler::new(c, Box::new(Fcfs), [1, 2]).unwrap();
    for i in 0..1_000u64 {
        s.add_request(req(i, "open", i, vec![1; 4], 1)).unwrap();
        step(&mut s, i);
        s.forget(RequestId(i));
        assert!(s.deadlines.len() <= 2 + super::COMPACT_SLACK + 1);
    }
}

#[test]
fn bounds_out_of_range_name_the_field() {
    let check =
        |c: SchedulerConfig, field: &str| match Scheduler::new(c, Box::new(Fcfs), [1, 2]).err() {
            Some(SchedulerError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{other:?}"),
        };
    check(config(16, 4, Some(0)), "max_queue_ms");
    check(config(16, 4, Some(MAX_QUEUE_MS + 1)), "max_queue_ms");
    let mut c = config(16, 4, None);
    c.tiers[1].max_queue_ms = Some(0);
    check(c, "tiers.max_queue_ms");
    assert!(Scheduler::new(config(16, 4, Some(MAX_QUEUE_MS)), Box::new(Fcfs), [1, 2]).is_ok());
}

/// New tier settings (a reload) apply to the requests queued from then on: a bound given to
/// `open` times its next request out, while a request queued before keeps the bound it was
/// queued with; invalid settings are refused, changing nothing.
#[test]
fn new_tier_settings_apply_to_requests_queued_after_them() {
    let c = config(16, 4, None);
    let mut s = Scheduler::new(c.clone(), policy("fcfs", &c.tiers), [1, 2]).unwrap();
    s.add_request(req(1, "open", 0, vec![1; 8], 50)).unwrap();
    step(&mut s, 0);
    // Queued before the change: no bound.
    s.add_request(req(2, "open", 10, vec![2; 8], 4)).unwrap();
    let mut tiers = c.tiers.clone();
    tiers[1].max_queue_ms = Some(2);
    // Refused: a bound out of range, a tier twice; nothing changes.
    let mut zero = tiers.clone();
    zero[1].max_queue_ms = Some(0);
    assert!(s.set_tiers(zero).is_err());
    let mut twice = tiers.clone();
    twice[0].name = twice[1].name.clone();
    assert!(s.set_tiers(twice).is_err());
    assert_eq!(s.config().tiers, c.tiers);
    s.set_tiers(tiers.clone()).unwrap();
    assert_eq!(s.config().tiers, tiers);
    s.add_request(req(3, "open", 20, vec![3; 8], 4)).unwrap();
    assert_eq!(s.next_queue_deadline(), Some(Timestamp(2_020)));
    let p = step(&mut s, 2_021);
    assert_eq!(timed_out(&p), [3]);
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Waiting));
}

/// A timeout reports the bound its request was queued with, which a reload may have changed
/// or removed since: request 2 (tier `bounded`, 1 ms) is timed out at its deadline after a
/// reload raised the tier's bound to 5 s, and request 3 after one removed the tier; both
/// name the 1 ms of `tiers.bounded.max_queue_ms` they waited past (the bound now in force
/// said 5,000 ms, then "scheduler.max_queue_ms = 0", which is not set).
#[test]
fn a_timeout_reports_the_bound_its_request_was_queued_with_across_reloads() {
    let c = config(16, 4, None);
    let mut s = Scheduler::new(c.clone(), policy("fcfs", &c.tiers), [1, 2]).unwrap();
    s.add_request(req(1, "open", 0, vec![1; 8], 50)).unwrap();
    step(&mut s, 0);
    s.add_request(req(2, "bounded", 10, vec![2; 8], 4)).unwrap();
    let mut raised = c.tiers.clone();
    raised[0].max_queue_ms = Some(5_000);
    s.set_tiers(raised).unwrap();
    let p = step(&mut s, 1_011);
    assert_eq!(timed_out(&p), [2]);
    assert_eq!(
        (p.timed_out[0].max_queue_ms, p.timed_out[0].tier_bound),
        (1, true)
    );
    s.set_tiers(c.tiers.clone()).unwrap();
    s.add_request(req(3, "bounded", 2_000, vec![3; 8], 4))
        .unwrap();
    s.set_tiers(vec![c.tiers[1].clone()]).unwrap();
    let p = step(&mut s, 3_001);
    assert_eq!(timed_out(&p), [3]);
    let t = &p.timed_out[0];
    assert_eq!(
        (t.max_queue_ms, t.tier_bound, t.tier.as_str()),
        (1, true, "bounded")
    );
    assert!(t.waited > t.max_queue_ms * 1000);
}
