//! The step's token budget is handed out in rank order across running and waiting sequences:
//! a waiting request that outranks a running prefill takes that prefill's planned chunk back
//! (`planner/running.rs`, `reclaimable` and `settle`).

use super::*;
use crate::policy::{Rank, StepContext};
use crate::sequence::SeqView;

/// Lower `priority` first, then arrival; a fixed token budget per step; no preemption.
struct Fixed(usize);

impl Policy for Fixed {
    fn name(&self) -> &str {
        "fixed-budget"
    }
    fn rank(&self, seq: SeqView<'_>, _: Timestamp) -> Rank {
        Rank {
            class: i64::from(seq.priority()),
            key: seq.arrival().0 as i64,
        }
    }
    fn token_budget(&self, _: &StepContext<'_>) -> usize {
        self.0
    }
}

fn chunk_of(p: &StepPlan, id: u64) -> Option<usize> {
    p.seqs
        .iter()
        .find(|q| q.id.0 == id)
        .map(|q| q.num_new_tokens)
}

#[test]
fn a_waiting_request_takes_budget_from_a_lower_ranked_running_prefill() {
    // Budget 16 a step, blocks of 4. Request 1 (priority 2): a 64-token prompt, prefilled 16
    // tokens a step. Request 2 (priority 0) arrives with 8 tokens: the running prefill would
    // take all 16 again and leave it nothing; it gets its 8 and request 1 the other 8.
    let mut s = sched(config(64, 4), Box::new(Fixed(16)));
    s.add_request(with_adapter(req(1, 0, vec![1; 64], 4), None, 2))
        .unwrap();
    let (p, _) = step(&mut s, 0, 3);
    assert_eq!(chunk_of(&p, 1), Some(16));
    s.add_request(with_adapter(req(2, 1, vec![2; 8], 4), None, 0))
        .unwrap();
    let (p, _) = step(&mut s, 2, 3);
    assert_eq!(chunk_of(&p, 2), Some(8));
    assert_eq!(chunk_of(&p, 1), Some(8));
    assert_eq!(p.num_batched_tokens, 16);
    // Request 1's shrunk chunk holds 16 + 8 = 24 tokens: 6 blocks, the two it gave back free.
    let q = p.seqs.iter().find(|q| q.id.0 == 1).unwrap();
    assert_eq!(q.first_new_block + q.new_blocks.len(), 6);
    // Next step: request 2 decodes (1 token), request 1 goes on from 24 with 15.
    let (p, _) = step(&mut s, 3, 3);
    assert_eq!(chunk_of(&p, 2), Some(1));
    assert_eq!(chunk_of(&p, 1), Some(15));
    let q = p.seqs.iter().find(|q| q.id.0 == 1).unwrap();
    assert_eq!(q.num_computed_tokens, 24);
}

#[test]
fn a_prefill_chunk_taken_whole_leaves_the_plan_and_decodes_keep_their_tokens() {
    // Budget 12. Request 1 (priority 2) decodes; request 3 (priority 2) prefills 40 tokens.
    // Request 2 (priority 0, 12 tokens) takes the prefill's whole chunk (11 tokens: the
    // decode's token stays) and gets 11 of its 12.
    let mut s = sched(config(64, 4), Box::new(Fixed(12)));
    s.add_request(with_adapter(req(1, 0, vec![1; 4], 8), None, 2))
        .unwrap();
    step(&mut s, 0, 3);
    s.add_request(with_adapter(req(3, 1, vec![3; 40], 4), None, 2))
        .unwrap();
    let (p, _) = step(&mut s, 1, 3);
    assert_eq!((chunk_of(&p, 1), chunk_of(&p, 3)), (Some(1), Some(11)));
    s.add_request(with_adapter(req(2, 2, vec![2; 12], 4), None, 0))
        .unwrap();
    let (p, _) = step(&mut s, 2, 3);
    assert_eq!(chunk_of(&p, 1), Some(1));
    assert_eq!(chunk_of(&p, 3), None);
    assert_eq!(chunk_of(&p, 2), Some(11));
    assert_eq!(s.request_state(RequestId(3)), Some(RequestState::Running));
    // Request 3 picks up where it was (11 computed) once request 2's prefill is done.
    let (p, _) = step(&mut s, 3, 3);
    assert_eq!(chunk_of(&p, 2), Some(1));
    let q = p.seqs.iter().find(|q| q.id.0 == 3).unwrap();
    assert_eq!((q.num_computed_tokens, q.num_new_tokens), (11, 10));
}

#[test]
fn a_lower_ranked_waiting_request_takes_nothing_from_a_running_prefill() {
    // The same as the first case with the priorities swapped: the running prefill outranks
    // the arrival, keeps its 16 tokens, and the arrival waits for budget.
    let mut s = sched(config(64, 4), Box::new(Fixed(16)));
    s.add_request(with_adapter(req(1, 0, vec![1; 64], 4), None, 0))
        .unwrap();
    step(&mut s, 0, 3);
    s.add_request(with_adapter(req(2, 1, vec![2; 8], 4), None, 2))
        .unwrap();
    let (p, _) = step(&mut s, 2, 3);
    assert_eq!(chunk_of(&p, 1), Some(16));
    assert_eq!(chunk_of(&p, 2), None);
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Waiting));
}

#[test]
fn slo_aware_seats_a_premium_arrival_ahead_of_batch_prefill_chunks_under_a_tight_budget() {
    // slo-aware sizes the step by a running premium decode's TPOT (1 ms a step, 10 us a
    // token, 8-token minimum chunk: a 2 ms TPOT leaves (1800 - 1000) / 10 = 80 tokens, at
    // least 2 decodes + 8). A batch request prefilling 200 tokens would take all of them
    // before admission; the premium arrival's 20-token prompt goes first now.
    let tier = |name: &str, tpot_ms: Option<f64>, preemptible: bool| TierSpec {
        name: name.into(),
        ttft_ms: None,
        tpot_ms,
        weight: 1.0,
        preemptible,
        max_queue_ms: None,
        max_kv_fraction: None,
    };
    let mut c = config(256, 4);
    c.tiers = vec![tier("premium", Some(2.0), false), tier("batch", None, true)];
    let params = serde_yaml::from_str(
        "{step_overhead_ms: 1, prefill_us_per_token: 10, min_chunk_tokens: 8}",
    )
    .unwrap();
    let p = PolicyRegistry::with_builtins()
        .create("slo-aware", &params, &c.tiers)
        .unwrap();
    let mut s = sched(c, p);
    let mut first = req(1, 0, vec![1; 4], 50);
    first.tier = "premium".into();
    s.add_request(first).unwrap();
    step(&mut s, 0, 3); // prefilled, first token sampled at 0
    let mut batch = req(2, 0, vec![2; 200], 4);
    batch.tier = "batch".into();
    s.add_request(batch).unwrap();
    let (p, _) = step(&mut s, 0, 3);
    assert_eq!((chunk_of(&p, 1), chunk_of(&p, 2)), (Some(1), Some(79)));
    let mut second = req(3, 0, vec![3; 20], 4);
    second.tier = "premium".into();
    s.add_request(second).unwrap();
    // At 0 the decode's third token is due at 4 ms: (3600 - 1000) / 10 = 260, more than the
    // plan needs; at 3 ms it is due in 1 ms, under a TPOT, so one TPOT: 80 tokens again.
    let (p, _) = step(&mut s, 3_000, 3);
    assert_eq!(chunk_of(&p, 1), Some(1));
    assert_eq!(chunk_of(&p, 3), Some(20));
    assert_eq!(chunk_of(&p, 2), Some(59));
    assert_eq!(p.num_batched_tokens, 80);
}

#[test]
fn a_request_that_cannot_be_seated_takes_nothing() {
    // One seat, taken by request 1 (priority 2) prefilling 64 tokens, 16 a step. Request 2
    // (priority 0) outranks it but this policy never preempts: it waits, and request 1's
    // chunks stay whole (taking them would stall it with nothing admitted in its place).
    let mut c = config(64, 4);
    c.max_num_seqs = 1;
    let mut s = sched(c, Box::new(Fixed(16)));
    s.add_request(with_adapter(req(1, 0, vec![1; 64], 4), None, 2))
        .unwrap();
    step(&mut s, 0, 3);
    s.add_request(with_adapter(req(2, 1, vec![2; 8], 4), None, 0))
        .unwrap();
    for (t, computed) in [(2, 16), (3, 32), (4, 48)] {
        let (p, _) = step(&mut s, t, 3);
        assert_eq!(ids(&p), vec![1]);
        assert_eq!(p.seqs[0].num_computed_tokens, computed);
        assert_eq!(p.seqs[0].num_new_tokens, 16);
    }
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Waiting));
}

#[test]
fn slo_aware_keeps_steps_bounded_for_a_window_after_the_last_premium_request_left() {
    // Premium: 20 ms TTFT; 1 ms a step, 10 us a token: half the target affords
    // (20000 / 2 * 0.9 - 1000) / 10 = 800 tokens a step. The scheduler allows 1,024.
    let tier = |name: &str, ttft_ms: Option<f64>, preemptible: bool| TierSpec {
        name: name.into(),
        ttft_ms,
        tpot_ms: None,
        weight: 1.0,
        preemptible,
        max_queue_ms: None,
        max_kv_fraction: None,
    };
    let first_chunk = |window: &str| {
        let mut c = config(1024, 4);
        c.tiers = vec![
            tier("premium", Some(20.0), false),
            tier("batch", None, true),
        ];
        let params = serde_yaml::from_str(&format!(
            "{{step_overhead_ms: 1, prefill_us_per_token: 10, min_chunk_tokens: 8{window}}}"
        ))
        .unwrap();
        let p = PolicyRegistry::with_builtins()
            .create("slo-aware", &params, &c.tiers)
            .unwrap();
        let mut s = sched(c, p);
        // A premium request of one token out arrives, runs and leaves at 0.
        let mut premium = req(1, 0, vec![1; 4], 1);
        premium.tier = "premium".into();
        s.add_request(premium).unwrap();
        step(&mut s, 0, 3);
        assert!(matches!(
            s.request_state(RequestId(1)),
            Some(RequestState::Finished(_))
        ));
        // A batch prompt of 1,000 tokens at 1 ms: the reserve (no idle gap seen yet: its
        // cap, 10 s by default) bounds its first chunk.
        let mut batch = req(2, 1_000, vec![2; 1_000], 4);
        batch.tier = "batch".into();
        s.add_request(batch).unwrap();
        let (p, _) = step(&mut s, 1_000, 3);
        let first = chunk_of(&p, 2);
        // 10 s after the premium request left, the full budget is back: with the reserve, the
        // rest of request 2 and request 3's prompt fill 1,024 tokens.
        let mut later = req(3, 10_000_000, vec![4; 1_000], 4);
        later.tier = "batch".into();
        s.add_request(later).unwrap();
        let (p, _) = step(&mut s, 10_000_000, 3);
        (first, p.num_batched_tokens)
    };
    assert_eq!(first_chunk(""), (Some(800), 1_024));
    // reserve_window_ms 0: no reserve, the whole prompt at once (then request 2 decodes
    // beside request 3's prompt).
    assert_eq!(first_chunk(", reserve_window_ms: 0"), (Some(1_000), 1_001));
}
