//! KV quotas per tier through the planner, on small hand-made cases (expected values derived
//! by hand in the comments).

use std::sync::Arc;

use crate::policy::testutil::{request, run_step};
use crate::policy::Fcfs;
use crate::types::*;
use crate::{Scheduler, SchedulerError};

/// `blocks` blocks of 4 tokens; tiers `inter` (no bound) and `batch` (`batch_fraction`).
fn config(blocks: usize, batch_fraction: Option<f64>) -> SchedulerConfig {
    let tier = |name: &str, max_kv_fraction| TierSpec {
        max_kv_fraction,
        ..TierSpec::named(name)
    };
    SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 1024,
        block_size: 4,
        num_gpu_blocks: blocks,
        enable_prefix_caching: true,
        max_model_len: 1024,
        tiers: vec![tier("inter", None), tier("batch", batch_fraction)],
        max_logit_rows: usize::MAX,
        max_loras: 4,
        speculative: None,
        sliding_window: None,
        max_queue_ms: None,
        num_host_blocks: 0,
        kv_offload_ahead: true,
    }
}

fn sched(c: SchedulerConfig) -> Scheduler {
    Scheduler::new(c, Box::new(Fcfs), [3, 4]).unwrap()
}

fn req(id: u64, tier: &str, prompt_len: usize, max_tokens: u32) -> Request {
    // Distinct tokens per request: no prefix sharing unless a test wants it.
    let prompt = (0..prompt_len as u32)
        .map(|k| 1 + id as u32 * 1000 + k)
        .collect();
    request(id, tier, id, prompt, max_tokens)
}

/// Runs one step at `now`, sampling token 7 for every sampling entry; checks the invariants
/// (a tier over its bound, or a count that disagrees with the block tables, fails them).
fn step(s: &mut Scheduler, now: u64) -> StepPlan {
    run_step(s, now, 7).0
}

fn ids(p: &StepPlan) -> Vec<u64> {
    p.seqs.iter().map(|q| q.id.0).collect()
}

/// Steps until nothing is left (at most 500 steps); returns every preempted id.
fn drain(s: &mut Scheduler, from: u64) -> Vec<u64> {
    let mut preempted = Vec::new();
    for t in from..from + 500 {
        if !s.has_unfinished() {
            return preempted;
        }
        preempted.extend(step(s, t).preempted.iter().map(|id| id.0));
    }
    panic!("requests left after 500 steps");
}

#[test]
fn a_tier_at_its_bound_is_passed_over_and_other_tiers_are_admitted_past_it() {
    // 20 blocks, batch bounded to 10. Batch 1 (24 tokens: 6 blocks) is admitted; batch 2
    // (6 more: 12 > 10) waits; inter 3 (2 blocks) is admitted past it, and so is nothing of
    // batch: batch 4 (1 block, it would fit) keeps its place behind batch 2. The pool has
    // room for all (6 + 6 + 2 + 1 = 15 of 20): only the quota holds them back.
    let mut s = sched(config(20, Some(0.5)));
    s.add_request(req(1, "batch", 24, 4)).unwrap();
    s.add_request(req(2, "batch", 24, 4)).unwrap();
    s.add_request(req(3, "inter", 8, 4)).unwrap();
    s.add_request(req(4, "batch", 4, 2)).unwrap();
    let p = step(&mut s, 10);
    assert_eq!(ids(&p), vec![1, 3]);
    assert!(p.preempted.is_empty());
    assert_eq!(s.tier_kv_blocks(), &[2, 6]);
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Waiting));
    assert_eq!(s.request_state(RequestId(4)), Some(RequestState::Waiting));
    // Nothing is preempted for quota, and every request ends.
    assert!(drain(&mut s, 11).is_empty());
    for id in 1..=4 {
        assert_eq!(
            s.request_state(RequestId(id)),
            Some(RequestState::Finished(FinishReason::Length))
        );
    }
    assert_eq!(s.tier_kv_blocks(), &[0, 0]);
}

#[test]
fn without_a_bound_the_same_workload_admits_everything_at_once() {
    // The control for the test above: the pool alone admits all four.
    let mut s = sched(config(20, None));
    for (id, tier, len, max) in [(1, "batch", 24, 4), (2, "batch", 24, 4), (3, "inter", 8, 4)] {
        s.add_request(req(id, tier, len, max)).unwrap();
    }
    s.add_request(req(4, "batch", 4, 2)).unwrap();
    assert_eq!(ids(&step(&mut s, 10)), vec![1, 2, 3, 4]);
}

#[test]
fn growth_at_the_bound_preempts_the_tiers_own_lowest_ranked_never_another_tier() {
    // 20 blocks, batch bounded to 10. Batches 1 and 2 and inter 3 each start with 16 tokens
    // (4 blocks) and decode up to 20 more. At 21 tokens, batch 1 needs its 6th block (batch
    // would hold 11): batch 2, the tier's lowest-ranked, gives way, though the pool has room
    // (16 of 20 held). Without the bound the pool runs dry at 25 tokens and preempts inter 3,
    // the lowest-ranked overall.
    let mut s = sched(config(20, Some(0.5)));
    s.add_request(req(1, "batch", 16, 20)).unwrap();
    s.add_request(req(2, "batch", 16, 20)).unwrap();
    s.add_request(req(3, "inter", 16, 20)).unwrap();
    assert_eq!(ids(&step(&mut s, 10)), vec![1, 2, 3]);
    let mut t = 11;
    let first = loop {
        let p = step(&mut s, t);
        t += 1;
        if !p.preempted.is_empty() {
            break p;
        }
        assert!(t < 40, "no preemption");
    };
    assert_eq!(first.preempted, vec![RequestId(2)]);
    assert_eq!(s.block_table(RequestId(1)).map(<[_]>::len), Some(6));
    assert_eq!(s.tier_kv_blocks()[1], 6);
    let rest = drain(&mut s, t);
    assert!(!rest.contains(&3), "inter was preempted: {rest:?}");
    assert_eq!(s.tier_kv_blocks(), &[0, 0]);
    assert_eq!(s.stats().num_free_blocks, 20);
}

#[test]
fn a_tier_bounded_below_two_prompts_runs_them_one_after_the_other() {
    // Batch bounded to 3 blocks (3/16 of 16). Batches 1 and 2 hold 3 blocks at most (12
    // tokens) each; admitted together they would hold 4 blocks of prompt (2 + 2), so batch 2
    // waits (admission counts the whole prompt) until batch 1 ends.
    let mut s = sched(config(16, Some(0.1875)));
    s.add_request(req(1, "batch", 8, 4)).unwrap();
    s.add_request(req(2, "batch", 8, 4)).unwrap();
    assert_eq!(ids(&step(&mut s, 10)), vec![1]);
    assert!(drain(&mut s, 11).is_empty());
    assert_eq!(s.tier_kv_blocks(), &[0, 0]);
}

#[test]
fn the_lowest_ranked_sequence_at_the_bound_preempts_itself() {
    // Batch bounded to 4 blocks (1/4 of 16). Batch 1 (4 tokens, 1 block) and batch 2 (7
    // tokens, 2 blocks) run. Step 1: batch 1's 5th token takes a 2nd block (4 held). Step 2:
    // batch 2's 9th token needs a 3rd block (5 > 4); batch 1, ranked higher, was scheduled
    // already, so batch 2 gives way itself, and is admitted again once batch 1 ends.
    let mut s = sched(config(16, Some(0.25)));
    s.add_request(req(1, "batch", 4, 12)).unwrap();
    s.add_request(req(2, "batch", 7, 9)).unwrap();
    assert_eq!(ids(&step(&mut s, 10)), vec![1, 2]);
    assert!(step(&mut s, 11).preempted.is_empty());
    assert_eq!(s.tier_kv_blocks(), &[0, 4]);
    let p = step(&mut s, 12);
    assert_eq!(
        (ids(&p), p.preempted.clone()),
        (vec![1], vec![RequestId(2)])
    );
    assert_eq!(s.tier_kv_blocks(), &[0, 2]);
    assert_eq!(drain(&mut s, 13), Vec::<u64>::new());
    assert_eq!(
        s.output_tokens(RequestId(2)).map(<[_]>::len),
        Some(9),
        "batch 2 ran to its end after the recompute"
    );
}

#[test]
fn blocks_shared_through_the_prefix_cache_count_for_each_holder() {
    // Two batch requests with the same 16-token prompt. Batch 1 is prefilled (4 blocks), then
    // decodes its 17th token (5 blocks) while batch 2 matches 3 of its full blocks (the last
    // token is recomputed, in a block of its own): 6 blocks in use, 5 + 4 charged.
    let mut s = sched(config(40, Some(0.5)));
    let mut a = req(1, "batch", 16, 8);
    let mut b = req(2, "batch", 16, 8);
    let prompt: Arc<[u32]> = Arc::from((1..=16).collect::<Vec<u32>>());
    a.prompt = prompt.clone();
    b.prompt = prompt;
    s.add_request(a).unwrap();
    step(&mut s, 10);
    s.add_request(b).unwrap();
    step(&mut s, 11);
    assert_eq!(s.ledger().num_blocks() - s.stats().num_free_blocks, 6);
    assert_eq!(s.tier_kv_blocks(), &[0, 9]);
    drain(&mut s, 12);
    assert_eq!(s.tier_kv_blocks(), &[0, 0]);
}

#[test]
fn a_request_its_tier_could_never_hold_is_refused_at_admission() {
    // Batch bounded to 10 blocks of 4 tokens: 40 tokens fit, 41 never could.
    let mut s = sched(config(20, Some(0.5)));
    assert_eq!(
        s.add_request(req(1, "batch", 30, 11)),
        Err(SchedulerError::ExceedsTierKvQuota {
            id: RequestId(1),
            tier: "batch".into(),
            needed: 11,
            quota: 10,
        })
    );
    s.add_request(req(2, "batch", 30, 10)).unwrap();
    // Other tiers are bounded by the pool only.
    s.add_request(req(3, "inter", 30, 50)).unwrap();
    assert!(drain(&mut s, 0).is_empty());
    // The smallest bound is one block.
    let mut s = sched(config(20, Some(0.01)));
    s.add_request(req(4, "batch", 2, 2)).unwrap();
    assert!(matches!(
        s.add_request(req(5, "batch", 4, 1)),
        Err(SchedulerError::ExceedsTierKvQuota { quota: 1, .. })
    ));
}

#[test]
fn a_fraction_outside_zero_to_one_is_refused_naming_the_field() {
    for f in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
        let e = Scheduler::new(config(20, Some(f)), Box::new(Fcfs), [0, 0])
            .err()
            .unwrap();
        assert!(
            matches!(&e, SchedulerError::InvalidConfig { field: "tiers.max_kv_fraction", reason } if reason.contains("tier `batch`")),
            "{f}: {e}"
        );
    }
    assert!(Scheduler::new(config(20, Some(1.0)), Box::new(Fcfs), [0, 0]).is_ok());
}

#[test]
fn a_long_prefix_hit_under_a_sliding_window_is_admitted_within_the_bound() {
    // A window of 4 tokens, no read slack, chunks of 8, blocks of 4: a sequence holds at most
    // (4 + 4 + 8) / 4 + 3 = 7 blocks at once, so batch's bound of 8 blocks (1/8 of 64) holds
    // a request of any length. Batch 1 (80 tokens, 20 blocks) runs to its end; its blocks
    // behind the window stay in the prefix cache. Batch 2, the same prompt, matches 19 of
    // them: pinning all of them at admission would hold 20 blocks, over the bound, so it
    // must not wait for that (it would wait forever: nothing else runs to free the tier);
    // it uses as much of the hit as the bound holds with a first chunk.
    let mut c = config(64, Some(0.125));
    c.max_num_batched_tokens = 8;
    c.sliding_window = Some(SlidingWindow {
        tokens: 4,
        read_slack: 0,
    });
    let mut s = sched(c);
    let prompt: Arc<[u32]> = Arc::from((1..=80).collect::<Vec<u32>>());
    let mut a = req(1, "batch", 80, 2);
    a.prompt = prompt.clone();
    s.add_request(a).unwrap();
    assert!(drain(&mut s, 0).is_empty());
    let mut b = req(2, "batch", 80, 2);
    b.prompt = prompt;
    s.add_request(b).unwrap();
    assert!(drain(&mut s, 100).is_empty());
    assert_eq!(
        s.request_state(RequestId(2)),
        Some(RequestState::Finished(FinishReason::Length))
    );
    // It used the hit's first 6 blocks: 24 tokens and a chunk of 8 fill the bound's 32.
    assert_eq!(s.stats().prefix_hits, 24);
    assert_eq!(s.tier_kv_blocks(), &[0, 0]);
}

/// The tiers of [`config`] with `batch` bounded to `fraction` (a reload's new settings).
fn with_batch(c: &SchedulerConfig, fraction: Option<f64>) -> Vec<TierSpec> {
    let mut tiers = c.tiers.clone();
    tiers[1].max_kv_fraction = fraction;
    tiers
}

#[test]
fn a_bound_lowered_below_what_its_tier_holds_gives_it_no_block_until_it_is_within() {
    // 20 blocks, batch unbounded. Batch 1 and 2 (24 tokens: 6 blocks each, 8 at their end)
    // are prefilled: batch holds 12. A reload bounds batch to 8 (0.4 of 20): over by 4, it
    // may keep them but takes no block. Next step both need a 7th block: batch 2, ranked
    // lower, gives way (6 back: 6 held), batch 1 grows to 7. Batch 3 (1 block) is not
    // admitted while batch 1 and its bound leave no room for batch 2 first. Everything ends.
    let c = config(20, None);
    let mut s = sched(c.clone());
    s.add_request(req(1, "batch", 24, 8)).unwrap();
    s.add_request(req(2, "batch", 24, 8)).unwrap();
    assert_eq!(ids(&step(&mut s, 10)), vec![1, 2]);
    assert_eq!(s.tier_kv_blocks(), &[0, 12]);
    let changes = s.set_tiers(with_batch(&c, Some(0.4))).unwrap();
    assert_eq!(
        changes,
        [crate::QuotaChange::Over {
            tier: "batch".into(),
            held: 12,
            bound: 8,
        }]
    );
    // The invariants hold over the bound (run_step checks them after each step too): what
    // the tier holds above it only comes down.
    s.check_invariants().unwrap();
    s.add_request(req(3, "batch", 4, 1)).unwrap();
    let p = step(&mut s, 11);
    assert_eq!(
        (ids(&p), p.preempted.clone()),
        (vec![1], vec![RequestId(2)])
    );
    assert_eq!(s.tier_kv_blocks(), &[0, 7]);
    assert_eq!(drain(&mut s, 12), Vec::<u64>::new());
    for id in 1..=3 {
        assert_eq!(
            s.request_state(RequestId(id)),
            Some(RequestState::Finished(FinishReason::Length)),
            "{id}"
        );
    }
    assert_eq!(s.tier_kv_blocks(), &[0, 0]);
    // Raised again: room at once.
    s.set_tiers(with_batch(&c, Some(1.0))).unwrap();
    s.add_request(req(4, "batch", 60, 4)).unwrap();
    assert_eq!(ids(&step(&mut s, 100)), vec![4]);
}

#[test]
fn a_bound_lowered_below_a_queued_requests_need_is_held_until_it_ends() {
    // 20 blocks, batch unbounded. Batch 1 (24 + 16 tokens: 10 blocks at its end) runs and
    // batch 2 (the same) waits behind it... in the queue as the reload bounds batch to 5
    // blocks (0.25): they could never run under 5, so the bound is held at 10 until both
    // have ended; a new request is held to 5 (refused above it).
    let c = config(20, None);
    let mut s = sched(c.clone());
    s.add_request(req(1, "batch", 24, 16)).unwrap();
    assert_eq!(ids(&step(&mut s, 10)), vec![1]);
    s.add_request(req(2, "batch", 24, 16)).unwrap();
    let changes = s.set_tiers(with_batch(&c, Some(0.25))).unwrap();
    assert_eq!(
        changes,
        [crate::QuotaChange::Held {
            tier: "batch".into(),
            bound: 10,
            configured: 5,
        }]
    );
    assert!(matches!(
        s.add_request(req(3, "batch", 24, 1)),
        Err(SchedulerError::ExceedsTierKvQuota { quota: 5, .. })
    ));
    s.add_request(req(4, "batch", 8, 4)).unwrap();
    assert_eq!(s.quotas.cap(1), Some(10));
    assert_eq!(drain(&mut s, 11), Vec::<u64>::new());
    for id in [1, 2, 4] {
        assert_eq!(
            s.request_state(RequestId(id)),
            Some(RequestState::Finished(FinishReason::Length)),
            "{id}"
        );
    }
    assert_eq!(s.quotas.cap(1), Some(5), "relaxed once they ended");
}

#[test]
fn tiers_added_and_removed_take_the_requests_of_their_names() {
    // Batch 1 runs bounded (10 of 20 blocks). The reload removes batch and adds gold (0.25:
    // 5 blocks): batch 1 runs on unbounded, and gold 2, queued before under a name no tier
    // had, counts in gold from now on; its 2 blocks fit gold's 5.
    let c = config(20, Some(0.5));
    let mut s = sched(c.clone());
    s.add_request(req(1, "batch", 8, 30)).unwrap();
    s.add_request(req(2, "gold", 8, 4)).unwrap();
    assert_eq!(ids(&step(&mut s, 10)), vec![1, 2]);
    assert_eq!(s.tier_kv_blocks(), &[0, 2]);
    let gold = TierSpec {
        max_kv_fraction: Some(0.25),
        ..TierSpec::named("gold")
    };
    let changes = s.set_tiers(vec![c.tiers[0].clone(), gold]).unwrap();
    assert!(changes.is_empty(), "{changes:?}");
    assert_eq!(s.tier_kv_blocks(), &[0, 2]);
    step(&mut s, 11);
    // Gold 2 grew to its 9th token (3 blocks); batch 1's blocks count nowhere.
    assert_eq!(s.tier_kv_blocks(), &[0, 3]);
    assert_eq!(drain(&mut s, 12), Vec::<u64>::new());
    assert_eq!(s.tier_kv_blocks(), &[0, 0]);
}
