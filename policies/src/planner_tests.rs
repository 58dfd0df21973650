//! Planner and life-cycle tests on small hand-made cases; expected values derived by hand
//! in the comments.

use std::sync::Arc;

use crate::policy::testutil::{request, run_step};
use crate::policy::{ChunkedPrefill, Fcfs, Policy, PolicyRegistry, PriorityPolicy};
use crate::types::*;
use crate::{Scheduler, SchedulerError, RELEASED_BLOCK};

fn config(blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 1024,
        block_size,
        num_gpu_blocks: blocks,
        enable_prefix_caching: true,
        max_model_len: 1024,
        tiers: Vec::new(),
        max_logit_rows: usize::MAX,
        max_loras: 4,
        speculative: None,
        sliding_window: None,
        max_queue_ms: None,
        num_host_blocks: 0,
    }
}

/// Speculative decoding with `k` drafts and lookups of `min..=max` tokens, no batch limit.
fn drafts(k: usize, min: usize, max: usize) -> Option<SpeculativeConfig> {
    Some(SpeculativeConfig {
        num_speculative_tokens: k,
        prompt_lookup_min: min,
        prompt_lookup_max: max,
        max_running: 0,
    })
}

fn sched(c: SchedulerConfig, p: Box<dyn Policy>) -> Scheduler {
    Scheduler::new(c, p, [11, 22]).unwrap()
}

fn req(id: u64, arrival: u64, prompt: Vec<u32>, max_tokens: u32) -> Request {
    request(id, "", arrival, prompt, max_tokens)
}

/// Runs one step, sampling `token` for every sampling entry.
fn step(s: &mut Scheduler, now: u64, token: u32) -> (StepPlan, Vec<SeqEvent>) {
    run_step(s, now, token)
}

#[test]
fn prefill_then_decode_with_block_growth() {
    let mut s = sched(config(16, 16), Box::new(Fcfs));
    s.add_request(req(1, 0, vec![5; 40], 3)).unwrap();
    // Step 1: 40 prompt tokens in 3 blocks, sampling the first token.
    let (p, ev) = step(&mut s, 1, 9);
    assert_eq!(p.seqs.len(), 1);
    let q = &p.seqs[0];
    assert_eq!((q.num_computed_tokens, q.num_new_tokens), (0, 40));
    assert!(q.is_prefill && q.samples);
    assert_eq!((q.first_new_block, q.new_blocks.len()), (0, 3));
    assert_eq!(
        ev[0],
        SeqEvent::FirstToken {
            id: RequestId(1),
            at: Timestamp(1),
            cached_prompt_tokens: 0,
        }
    );
    // Step 2: decode of token 41, still 3 blocks (41 <= 48).
    let (p, _) = step(&mut s, 2, 9);
    let q = &p.seqs[0];
    assert_eq!(
        (q.num_computed_tokens, q.num_new_tokens, q.is_prefill),
        (40, 1, false)
    );
    assert_eq!((q.first_new_block, q.new_blocks.len()), (3, 0));
    assert_eq!(s.block_table(RequestId(1)).map(|t| t.len()), Some(3));
    // Step 3 samples the third token: max_tokens reached, blocks freed at once.
    let (_, ev) = step(&mut s, 3, 9);
    assert_eq!(
        ev.last(),
        Some(&SeqEvent::Finished {
            id: RequestId(1),
            reason: FinishReason::Length,
            at: Timestamp(3)
        })
    );
    assert_eq!(s.stats().num_free_blocks, 16);
    assert!(!s.has_unfinished());
    assert_eq!(s.output_tokens(RequestId(1)), Some(&[9, 9, 9][..]));
}

#[test]
fn long_prompt_is_chunked_by_the_token_budget() {
    let mut c = config(16, 16);
    c.max_num_batched_tokens = 16;
    let mut s = sched(c, Box::new(Fcfs));
    s.add_request(req(1, 0, vec![5; 40], 1)).unwrap();
    let mut chunks = Vec::new();
    for t in 0..3 {
        let (p, _) = step(&mut s, t, 1);
        chunks.push((p.seqs[0].num_new_tokens, p.seqs[0].samples));
    }
    assert_eq!(chunks, vec![(16, false), (16, false), (8, true)]);
}

#[test]
fn policy_budget_is_applied_and_decodes_go_first() {
    let mut s = sched(config(64, 16), Box::new(ChunkedPrefill::new(10)));
    s.add_request(req(1, 0, vec![1; 4], 5)).unwrap();
    step(&mut s, 0, 1); // request 1 prefilled, now decoding
    s.add_request(req(2, 1, vec![2; 30], 5)).unwrap();
    // Budget 10: the decode of 1 takes 1 token, request 2 gets a 9-token chunk.
    let (p, _) = step(&mut s, 2, 1);
    let got: Vec<_> = p.seqs.iter().map(|q| (q.id.0, q.num_new_tokens)).collect();
    assert_eq!(got, vec![(1, 1), (2, 9)]);
    assert_eq!(p.num_batched_tokens, 10);
}

#[test]
fn prefix_hits_keep_the_last_token_to_recompute() {
    let mut s = sched(config(16, 16), Box::new(Fcfs));
    let prompt: Vec<u32> = (0..40).collect();
    s.add_request(req(1, 0, prompt.clone(), 1)).unwrap();
    step(&mut s, 0, 7);
    // Request 2 shares the 40-token prompt: blocks 0 and 1 (32 tokens) are cached; the
    // third block was never full, so 8 tokens are computed.
    s.add_request(req(2, 1, prompt.clone(), 1)).unwrap();
    let (p, _) = step(&mut s, 1, 7);
    assert_eq!(
        (p.seqs[0].num_computed_tokens, p.seqs[0].num_new_tokens),
        (32, 8)
    );
    // Request 3's 32-token prompt is fully cached, but its last token is recomputed:
    // only one block (16 tokens) may be reused.
    s.add_request(req(3, 2, prompt[..32].to_vec(), 1)).unwrap();
    let (p, _) = step(&mut s, 2, 7);
    assert_eq!(
        (p.seqs[0].num_computed_tokens, p.seqs[0].num_new_tokens),
        (16, 16)
    );
    let st = s.stats();
    assert_eq!((st.prefix_queries, st.prefix_hits), (40 + 40 + 32, 32 + 16));
}

#[test]
fn different_salt_or_adapter_does_not_share_blocks() {
    let mut s = sched(config(16, 16), Box::new(Fcfs));
    let prompt: Vec<u32> = (0..40).collect();
    s.add_request(req(1, 0, prompt.clone(), 1)).unwrap();
    step(&mut s, 0, 7);
    let mut salted = req(2, 1, prompt.clone(), 1);
    salted.cache_salt = Some(99);
    let mut lora = req(3, 1, prompt, 1);
    lora.lora_adapter = Some(4);
    s.add_request(salted).unwrap();
    s.add_request(lora).unwrap();
    let (p, _) = step(&mut s, 1, 7);
    assert!(p.seqs.iter().all(|q| q.num_computed_tokens == 0));
}

#[test]
fn out_of_blocks_preempts_the_newest_and_recomputes_prompt_and_output() {
    // 4 blocks of 4 tokens; two 8-token prompts fill the pool in step 1.
    let mut s = sched(config(4, 4), Box::new(Fcfs));
    s.add_request(req(1, 0, (0..8).collect(), 8)).unwrap();
    s.add_request(req(2, 1, (100..108).collect(), 8)).unwrap();
    let (p, _) = step(&mut s, 0, 50);
    assert_eq!(p.seqs.len(), 2);
    assert_eq!(s.stats().num_free_blocks, 0);
    // Step 2: request 1 needs a third block for token 9, so request 2 (ranked last) goes.
    let (p, _) = step(&mut s, 1, 51);
    assert_eq!(p.preempted, vec![RequestId(2)]);
    assert_eq!(
        p.seqs.iter().map(|q| q.id).collect::<Vec<_>>(),
        vec![RequestId(1)]
    );
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Preempted));
    assert_eq!(s.output_tokens(RequestId(2)), Some(&[50][..]));
    assert_eq!(s.stats().num_preemptions, 1);
    // Abort request 1; request 2 is re-admitted: its 8 prompt tokens were cached as two full
    // blocks, but one was evicted for request 1's third block (LRU: request 2 freed its
    // last block first). 9 tokens (prompt + output) minus the hit are recomputed.
    assert!(s.abort(RequestId(1)));
    let (p, _) = step(&mut s, 2, 52);
    let q = &p.seqs[0];
    assert_eq!(q.id, RequestId(2));
    assert_eq!(
        (q.num_computed_tokens, q.num_new_tokens, q.samples),
        (4, 5, true)
    );
    assert_eq!(s.output_tokens(RequestId(2)), Some(&[50, 52][..]));
}

#[test]
fn abort_and_finish_from_every_state_free_everything() {
    let mut s = sched(config(8, 4), Box::new(Fcfs));
    s.add_request(req(1, 0, vec![1; 8], 4)).unwrap();
    s.add_request(req(2, 0, vec![2; 8], 4)).unwrap();
    step(&mut s, 0, 3);
    s.add_request(req(3, 1, vec![3; 4], 4)).unwrap();
    assert!(s.abort(RequestId(3))); // waiting
    assert!(s.finish(RequestId(1), FinishReason::Stop)); // running
    assert!(!s.finish(RequestId(1), FinishReason::Stop), "already ended");
    assert!(!s.abort(RequestId(77)));
    s.check_invariants().unwrap();
    assert_eq!(s.request_state(RequestId(3)), Some(RequestState::Aborted));
    assert_eq!(
        s.request_state(RequestId(1)),
        Some(RequestState::Finished(FinishReason::Stop))
    );
    assert!(s.finish(RequestId(2), FinishReason::Abort));
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Aborted));
    assert_eq!(s.stats().num_free_blocks, 8);
    assert!(s.forget(RequestId(2)));
    assert_eq!(s.request_state(RequestId(2)), None);
    s.check_invariants().unwrap();
}

#[test]
fn entries_of_requests_ended_between_schedule_and_apply_are_skipped() {
    let mut s = sched(config(8, 4), Box::new(Fcfs));
    s.add_request(req(1, 0, vec![1; 4], 4)).unwrap();
    let plan = s.schedule(Timestamp(0));
    assert!(s.abort(RequestId(1)));
    let ev = s.apply_outputs(&plan, &[StepOutput::new(RequestId(1), 5)], Timestamp(1));
    assert!(ev.is_empty());
    s.check_invariants().unwrap();
}

#[test]
fn missing_output_is_rolled_back_and_sampled_again() {
    let mut s = sched(config(8, 4), Box::new(Fcfs));
    s.add_request(req(1, 0, vec![1; 4], 4)).unwrap();
    let plan = s.schedule(Timestamp(0));
    assert!(s.apply_outputs(&plan, &[], Timestamp(0)).is_empty());
    let (p, _) = step(&mut s, 1, 5);
    // The 4-token block is full and cached, but the last prompt token is fed again so that
    // a token can be sampled.
    assert_eq!(
        (p.seqs[0].num_computed_tokens, p.seqs[0].num_new_tokens),
        (3, 1)
    );
    assert_eq!(s.output_tokens(RequestId(1)), Some(&[5][..]));
}

#[test]
fn stop_conditions_end_at_the_sampled_stop_and_ignore_eos() {
    let mut s = sched(config(16, 4), Box::new(Fcfs));
    // min_tokens is the sampler's (it masks the stop ids until then): an EOS it let through
    // before min_tokens is one a grammar forced, and it ends the sequence.
    let mut a = req(1, 0, vec![1; 4], 10);
    a.limits.eos_token_id = Some(0);
    a.limits.min_tokens = 2;
    let mut b = req(2, 0, vec![1; 4], 3);
    b.limits.eos_token_id = Some(0);
    b.limits.ignore_eos = true;
    let mut c = req(3, 0, vec![1; 4], 10);
    c.limits.stop_token_ids = vec![0];
    for r in [a, b, c] {
        s.add_request(r).unwrap();
    }
    let mut ended = Vec::new();
    for t in 0..5 {
        for e in step(&mut s, t, 0).1 {
            if let SeqEvent::Finished { id, reason, .. } = e {
                ended.push((id.0, reason, s.output_tokens(id).map_or(0, |o| o.len())));
            }
        }
    }
    ended.sort_by_key(|e| e.0);
    assert_eq!(
        ended,
        vec![
            (1, FinishReason::Eos, 1),
            (2, FinishReason::Length, 3),
            (3, FinishReason::Stop, 1)
        ]
    );
}

#[test]
fn invalid_requests_are_rejected_with_the_reason() {
    let mut s = sched(config(4, 4), Box::new(Fcfs));
    let too_long = s.add_request(req(1, 0, vec![1; 1000], 100)).err().unwrap();
    assert!(matches!(
        too_long,
        SchedulerError::TooLong {
            max_model_len: 1024,
            ..
        }
    ));
    // 10 + 7 = 17 tokens need 5 blocks of 4; the pool has 4.
    let big = s.add_request(req(2, 0, vec![1; 10], 7)).err().unwrap();
    assert_eq!(
        big,
        SchedulerError::ExceedsKvCapacity {
            id: RequestId(2),
            needed: 5,
            capacity: 4
        }
    );
    assert!(s.add_request(req(3, 0, vec![], 1)).is_err());
    assert!(s.add_request(req(4, 0, vec![1], 0)).is_err());
    s.add_request(req(5, 0, vec![1], 1)).unwrap();
    assert_eq!(
        s.add_request(req(5, 0, vec![1], 1)),
        Err(SchedulerError::DuplicateRequest(RequestId(5)))
    );
    let mut bad_slo = req(6, 0, vec![1], 1);
    bad_slo.slo.ttft_ms = Some(f64::NAN);
    assert!(s
        .add_request(bad_slo)
        .err()
        .unwrap()
        .to_string()
        .contains("slo.ttft_ms"));
}

#[test]
fn config_errors_name_the_field() {
    let mut c = config(4, 4);
    c.block_size = 0;
    let e = Scheduler::new(c, Box::new(Fcfs), [0, 0])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("block_size"), "{e}");
}

/// Policies hear of an admission and of a preemption as the step is planned, before its
/// outputs: what they know at the next arrival is what the plan did.
#[test]
fn policies_hear_of_admissions_and_preemptions_when_they_are_planned() {
    use crate::policy::{PolicyEvent, Rank};
    use crate::sequence::SeqView;
    use std::sync::Mutex;
    /// FCFS that writes down what it hears of.
    struct Listening(Arc<Mutex<Vec<String>>>);
    impl Policy for Listening {
        fn name(&self) -> &str {
            "listening"
        }
        fn rank(&self, seq: SeqView<'_>, _: Timestamp) -> Rank {
            Rank {
                class: 0,
                key: seq.arrival().0 as i64,
            }
        }
        fn observe(&mut self, event: PolicyEvent<'_>) {
            let line = match event {
                PolicyEvent::Admitted(q) => format!("admitted {} {:?}", q.id().0, q.state()),
                PolicyEvent::Preempted(q) => format!("preempted {} {:?}", q.id().0, q.state()),
                _ => return,
            };
            self.0.lock().unwrap().push(line);
        }
    }
    let heard = Arc::new(Mutex::new(Vec::new()));
    let take = || std::mem::take(&mut *heard.lock().unwrap());
    // The case of out_of_blocks_preempts_the_newest_and_recomputes_prompt_and_output.
    let mut s = sched(config(4, 4), Box::new(Listening(heard.clone())));
    s.add_request(req(1, 0, (0..8).collect(), 8)).unwrap();
    s.add_request(req(2, 1, (100..108).collect(), 8)).unwrap();
    let plan = s.schedule(Timestamp(0));
    assert_eq!(take(), ["admitted 1 Running", "admitted 2 Running"]);
    let outs: Vec<StepOutput> = plan
        .seqs
        .iter()
        .map(|q| StepOutput::new(q.id, 50))
        .collect();
    s.apply_outputs(&plan, &outs, Timestamp(0));
    assert_eq!(take(), Vec::<String>::new());
    let plan = s.schedule(Timestamp(1));
    assert_eq!(plan.preempted, vec![RequestId(2)]);
    assert_eq!(take(), ["preempted 2 Preempted"]);
    let outs: Vec<StepOutput> = plan
        .seqs
        .iter()
        .map(|q| StepOutput::new(q.id, 51))
        .collect();
    s.apply_outputs(&plan, &outs, Timestamp(1));
    // Request 1 gone, request 2 runs again.
    assert!(s.abort(RequestId(1)));
    s.schedule(Timestamp(2));
    assert_eq!(take(), ["admitted 2 Running"]);
}

#[test]
fn urgent_request_preempts_at_max_num_seqs() {
    // vLLM #40004: a full running set must not block more urgent waiting work.
    let mut c = config(16, 4);
    c.max_num_seqs = 1;
    let mut s = sched(c, Box::new(PriorityPolicy::new(0.0, true, 3)));
    let mut low = req(1, 0, vec![1; 4], 10);
    low.priority = 5;
    s.add_request(low).unwrap();
    step(&mut s, 0, 3);
    let mut high = req(2, 1, vec![2; 4], 10);
    high.priority = 0;
    s.add_request(high).unwrap();
    let (p, _) = step(&mut s, 1, 3);
    assert_eq!(p.preempted, vec![RequestId(1)]);
    assert_eq!(p.seqs.iter().map(|q| q.id.0).collect::<Vec<_>>(), vec![2]);
    // An equally urgent request does not preempt.
    let mut same = req(3, 2, vec![3; 4], 10);
    same.priority = 0;
    s.add_request(same).unwrap();
    let (p, _) = step(&mut s, 2, 3);
    assert!(p.preempted.is_empty());
    assert_eq!(p.seqs.iter().map(|q| q.id.0).collect::<Vec<_>>(), vec![2]);
}

#[test]
fn a_victim_is_preempted_for_a_seat_only_if_the_blocks_fit_too() {
    // Two seats, 12 blocks of 4 tokens. Request 1 (priority 0, 32 tokens) and request 2
    // (priority 1, 4 tokens) run; request 3 (priority 0, 24 tokens: 6 blocks) needs a seat,
    // which preempting request 2 gives, but its blocks would still be short (request 1 is as
    // urgent as it, so no further victim): nothing is preempted and request 3 waits.
    let mut c = config(12, 4);
    c.max_num_seqs = 2;
    let mut s = sched(c, Box::new(PriorityPolicy::new(0.0, true, 3)));
    s.add_request(with_adapter(req(1, 0, vec![1; 32], 8), None, 0))
        .unwrap();
    s.add_request(with_adapter(req(2, 0, vec![2; 4], 20), None, 1))
        .unwrap();
    step(&mut s, 0, 3);
    s.add_request(with_adapter(req(3, 1, vec![3; 24], 4), None, 0))
        .unwrap();
    let (p, _) = step(&mut s, 1, 3);
    assert!(p.preempted.is_empty(), "{:?}", p.preempted);
    assert_eq!(ids(&p), vec![1, 2]);
    assert_eq!(s.request_state(RequestId(3)), Some(RequestState::Waiting));
    assert_eq!(s.stats().num_preemptions, 0);
}

#[test]
fn a_victim_frees_the_blocks_it_still_owes_its_prefill() {
    // 12 blocks of 4 tokens, three spare logit rows: request 1 (priority 1, prompt logprobs,
    // 44 tokens) runs chunks of at most 4 tokens, holding 2 blocks after step 1 and owing 9.
    // Urgent request 2 (16 tokens: 4 blocks) finds 1 block free of what is owed; preempting
    // request 1 frees its 2 held blocks and the 9 it owes, so it is preempted at once.
    let mut c = config(12, 4);
    c.max_logit_rows = c.max_num_seqs + 3;
    let mut s = sched(c, Box::new(PriorityPolicy::new(0.0, true, 3)));
    let mut low = with_adapter(req(1, 0, vec![1; 44], 1), None, 1);
    low.limits.prompt_logits = true;
    s.add_request(low).unwrap();
    step(&mut s, 0, 3);
    s.add_request(with_adapter(req(2, 1, vec![2; 16], 1), None, 0))
        .unwrap();
    let (p, _) = step(&mut s, 1, 3);
    assert_eq!(p.preempted, vec![RequestId(1)]);
    assert_eq!(ids(&p), vec![2]);
}

#[test]
fn a_request_whose_prefill_does_not_fit_waits_instead_of_preempting_itself() {
    // 10 blocks of 4 tokens, 8 tokens per step. Request 1 (16 tokens, 8 more) grows to 6
    // blocks; request 2 (28 tokens: 7 blocks) would fit its first chunk beside it but not its
    // whole prompt: admitted, it would preempt itself at every later chunk that finds no
    // blocks and be admitted again. It waits for request 1 to finish instead.
    let mut c = config(10, 4);
    c.max_num_batched_tokens = 8;
    let mut s = sched(c, Box::new(Fcfs));
    s.add_request(req(1, 0, vec![1; 16], 8)).unwrap();
    step(&mut s, 0, 3);
    step(&mut s, 1, 3);
    s.add_request(req(2, 1, vec![2; 28], 2)).unwrap();
    let mut done = false;
    for t in 2..40 {
        let (_, ev) = step(&mut s, t, 3);
        done |= ev.iter().any(|e| {
            matches!(
                e,
                SeqEvent::Finished {
                    id: RequestId(2),
                    ..
                }
            )
        });
        if done {
            break;
        }
    }
    assert!(done, "request 2 finished");
    assert_eq!(s.stats().num_preemptions, 0);
}

#[test]
fn swapping_policy_keeps_every_request() {
    let mut s = sched(config(16, 4), Box::new(Fcfs));
    for i in 0..4 {
        s.add_request(req(i, i, vec![1; 6], 3)).unwrap();
    }
    step(&mut s, 0, 1);
    let old = s.swap_policy(Box::new(ChunkedPrefill::new(4)));
    assert_eq!(old.name(), "fcfs");
    assert_eq!(s.policy_name(), "chunked-prefill");
    let mut done = 0;
    for t in 1..100 {
        done += step(&mut s, t, 1)
            .1
            .iter()
            .filter(|e| matches!(e, SeqEvent::Finished { .. }))
            .count();
        if !s.has_unfinished() {
            break;
        }
    }
    assert_eq!(done, 4);
}

#[test]
fn fair_share_admits_the_least_served_tenant_first() {
    let mut c = config(64, 4);
    c.max_num_seqs = 1;
    let fs = PolicyRegistry::with_builtins()
        .create("fair-share", &serde_yaml::Value::Null, &[])
        .unwrap();
    let mut s = sched(c, fs);
    let mut a1 = req(1, 0, vec![1; 8], 1);
    a1.tenant = "a".into();
    s.add_request(a1).unwrap();
    // b waits (backlogged) while a is served: 8 prompt + 2 * 1 output = 10 virtual tokens.
    let mut b1 = req(3, 2, vec![2; 4], 1);
    b1.tenant = "b".into();
    s.add_request(b1).unwrap();
    let (p, _) = step(&mut s, 0, 3);
    assert_eq!(p.seqs.iter().map(|q| q.id.0).collect::<Vec<_>>(), vec![1]);
    // a's next request finds nothing of a's waiting: a is lifted to max(10, the smallest
    // backlogged counter, b's 0) = 10, so b (0) goes before a although a's request is older.
    let mut a2 = req(2, 1, vec![1; 4], 1);
    a2.tenant = "a".into();
    s.add_request(a2).unwrap();
    let (p, _) = step(&mut s, 3, 3);
    assert_eq!(p.seqs.iter().map(|q| q.id.0).collect::<Vec<_>>(), vec![3]);
}

#[test]
fn slo_aware_preempts_preemptible_tier_for_feasible_work() {
    let mut c = config(64, 4);
    c.max_num_seqs = 1;
    c.tiers = vec![
        TierSpec {
            name: "premium".into(),
            ttft_ms: Some(1000.0),
            tpot_ms: None,
            weight: 1.0,
            preemptible: false,
            max_queue_ms: None,
            max_kv_fraction: None,
        },
        TierSpec {
            name: "batch".into(),
            ttft_ms: None,
            tpot_ms: None,
            weight: 1.0,
            preemptible: true,
            max_queue_ms: None,
            max_kv_fraction: None,
        },
    ];
    let p = PolicyRegistry::with_builtins()
        .create("slo-aware", &serde_yaml::Value::Null, &c.tiers)
        .unwrap();
    let mut s = sched(c, p);
    let mut batch = req(1, 0, vec![1; 4], 50);
    batch.tier = "batch".into();
    s.add_request(batch).unwrap();
    step(&mut s, 0, 3);
    let mut premium = req(2, 1_000, vec![2; 4], 5);
    premium.tier = "premium".into();
    s.add_request(premium).unwrap();
    let (p, _) = step(&mut s, 2_000, 3);
    assert_eq!(p.preempted, vec![RequestId(1)]);
    assert_eq!(p.seqs.iter().map(|q| q.id.0).collect::<Vec<_>>(), vec![2]);
    // The premium request sets no SLO itself: it is feasible through its tier's TTFT.
    assert_eq!(s.request_state(RequestId(1)), Some(RequestState::Preempted));
}

#[test]
fn prompt_logprob_chunks_fit_the_logit_row_budget() {
    // 8 seats keep 8 of the 20 rows; a chunk of the prompt-logprob request takes its seat's
    // row and at most the 12 left: 30 prompt tokens go as 13 + 13 + 4, while an ordinary
    // request beside it is prefilled whole.
    let c = SchedulerConfig {
        max_logit_rows: 20,
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    let mut r = req(1, 0, vec![3; 30], 2);
    r.limits.prompt_logits = true;
    s.add_request(r).unwrap();
    s.add_request(req(2, 0, vec![4; 30], 2)).unwrap();
    let mut chunks = Vec::new();
    for now in 1..=3 {
        let (p, _) = step(&mut s, now, 7);
        for q in &p.seqs {
            if q.id == RequestId(1) {
                chunks.push(q.num_new_tokens);
            } else if now == 1 {
                assert_eq!(q.num_new_tokens, 30, "the ordinary request is not capped");
            }
        }
    }
    assert_eq!(chunks, vec![13, 13, 4]);

    // With no row to spare beyond the seats, such a request still runs, on its seat's row:
    // a token of its prompt per step.
    let c = SchedulerConfig {
        max_logit_rows: 8,
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    let mut r = req(3, 0, vec![3; 5], 2);
    r.limits.prompt_logits = true;
    s.add_request(r).unwrap();
    let mut chunks = Vec::new();
    for now in 1..=5 {
        let (p, _) = step(&mut s, now, 7);
        chunks.extend(p.seqs.iter().map(|q| q.num_new_tokens));
    }
    assert_eq!(chunks, vec![1, 1, 1, 1, 1]);
}

fn with_adapter(mut r: Request, adapter: Option<u32>, priority: i32) -> Request {
    r.lora_adapter = adapter;
    r.priority = priority;
    r
}

fn ids(p: &StepPlan) -> Vec<u64> {
    p.seqs.iter().map(|q| q.id.0).collect()
}

#[test]
fn request_of_a_third_adapter_waits_while_others_pass_it() {
    // max_loras 2: adapters 1 and 2 take both slots in step 1. Request 3 (adapter 3) waits,
    // and requests 4 (no adapter), 5 (adapter 1) and 6 (adapter 2), all behind it in FCFS
    // order, are admitted past it. Adapter 2's requests end by length after 2 (request 2)
    // and 3 (request 6) tokens; adapter 1's run for 10.
    let c = SchedulerConfig {
        max_loras: 2,
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    let specs = [
        (1, Some(1), 10),
        (2, Some(2), 2),
        (3, Some(3), 2),
        (4, None, 10),
        (5, Some(1), 10),
        (6, Some(2), 3),
    ];
    for (id, adapter, max_tokens) in specs {
        let r = req(id, id, vec![id as u32; 6], max_tokens);
        s.add_request(with_adapter(r, adapter, 0)).unwrap();
    }
    let (p, _) = step(&mut s, 10, 7);
    assert_eq!(ids(&p), vec![1, 2, 4, 5, 6]);
    assert!(p.preempted.is_empty());
    assert_eq!(s.request_state(RequestId(3)), Some(RequestState::Waiting));
    let st = s.stats();
    assert_eq!(
        (st.num_running_adapters, st.num_waiting_adapter_requests),
        (2, 1)
    );
    // Step 2 ends request 2, but request 6 still holds adapter 2's slot.
    let (p, ev) = step(&mut s, 11, 7);
    assert_eq!(ids(&p), vec![1, 2, 4, 5, 6]);
    assert!(ev.contains(&SeqEvent::Finished {
        id: RequestId(2),
        reason: FinishReason::Length,
        at: Timestamp(11)
    }));
    // Step 3 still leaves request 3 out; it ends request 6, adapter 2's last request.
    let (p, ev) = step(&mut s, 12, 7);
    assert_eq!(ids(&p), vec![1, 4, 5, 6]);
    assert!(ev.iter().any(|e| matches!(
        e,
        SeqEvent::Finished {
            id: RequestId(6),
            ..
        }
    )));
    assert_eq!(s.request_state(RequestId(3)), Some(RequestState::Waiting));
    assert_eq!(s.stats().num_running_adapters, 1);
    // Step 4 admits request 3, its prompt whole, into the freed slot.
    let (p, _) = step(&mut s, 13, 7);
    assert_eq!(ids(&p), vec![1, 4, 5, 3]);
    let q = &p.seqs[3];
    assert_eq!((q.num_computed_tokens, q.num_new_tokens), (0, 6));
    let st = s.stats();
    assert_eq!(
        (st.num_running_adapters, st.num_waiting_adapter_requests),
        (2, 0)
    );
}

#[test]
fn a_request_waiting_for_an_adapter_slot_is_passed_at_most_max_num_seqs_times() {
    // One adapter slot, four seats; adapter 1 gets a new request every step, each running 3
    // tokens, so adapter 1 always has running sequences. Request 2 (adapter 2) waits; at most
    // four of adapter 1's later requests pass it, then they wait too, adapter 1 drains and
    // request 2 gets the slot (it waited as long as the traffic lasted before the bound).
    let c = SchedulerConfig {
        max_num_seqs: 4,
        max_loras: 1,
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    s.add_request(with_adapter(req(1, 0, vec![1; 4], 3), Some(1), 0))
        .unwrap();
    step(&mut s, 5, 7);
    s.add_request(with_adapter(req(2, 10, vec![2; 4], 3), Some(2), 0))
        .unwrap();
    let (mut passed, mut admitted_at) = (0, None);
    for t in 1..40u64 {
        s.add_request(with_adapter(
            req(100 + t, 10 * t + 10, vec![3; 4], 3),
            Some(1),
            0,
        ))
        .unwrap();
        let (p, _) = step(&mut s, 10 * t + 15, 7);
        if ids(&p).contains(&2) {
            admitted_at = Some(t);
            break;
        }
        passed += p
            .seqs
            .iter()
            .filter(|q| q.id.0 >= 100 && q.num_computed_tokens == 0)
            .count();
    }
    let t = admitted_at.expect("request 2 got the slot");
    assert_eq!(passed, 4, "requests that passed it");
    assert!(t <= 8, "admitted at step {t}");
    // The rest of adapter 1's requests wait behind it now.
    assert_eq!(s.stats().num_running_adapters, 1);
}

#[test]
fn nothing_is_preempted_for_a_request_whose_adapter_has_no_slot() {
    // One seat, one adapter slot, and a priority policy that preempts for more urgent work:
    // without the slot rule, urgent request 2 (adapter 2) would preempt request 1 (adapter
    // 1), as in `urgent_request_preempts_at_max_num_seqs`.
    let c = SchedulerConfig {
        max_num_seqs: 1,
        max_loras: 1,
        ..config(16, 4)
    };
    let mut s = sched(c, Box::new(PriorityPolicy::new(0.0, true, 3)));
    s.add_request(with_adapter(req(1, 0, vec![1; 4], 3), Some(1), 5))
        .unwrap();
    step(&mut s, 0, 3);
    s.add_request(with_adapter(req(2, 1, vec![2; 4], 3), Some(2), 0))
        .unwrap();
    let (p, _) = step(&mut s, 1, 3);
    assert!(p.preempted.is_empty());
    assert_eq!(ids(&p), vec![1]);
    assert_eq!(s.stats().num_preemptions, 0);
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Waiting));
    // Nor for blocks: with seats to spare, request 4 (adapter 4) does not fit in the blocks
    // left by request 3 (adapter 3) and would preempt it, but has no adapter slot either.
    let c = SchedulerConfig {
        max_loras: 1,
        ..config(4, 4)
    };
    let mut s = sched(c, Box::new(PriorityPolicy::new(0.0, true, 3)));
    s.add_request(with_adapter(req(3, 0, vec![3; 12], 4), Some(3), 5))
        .unwrap();
    step(&mut s, 0, 3);
    s.add_request(with_adapter(req(4, 1, vec![4; 8], 4), Some(4), 0))
        .unwrap();
    let (p, _) = step(&mut s, 1, 3);
    assert!(p.preempted.is_empty());
    assert_eq!(ids(&p), vec![3]);
    assert_eq!(s.stats().num_preemptions, 0);
    // The same urgent request without an adapter does preempt request 3.
    s.add_request(with_adapter(req(5, 2, vec![4; 8], 4), None, 0))
        .unwrap();
    let (p, _) = step(&mut s, 2, 3);
    assert_eq!(p.preempted, vec![RequestId(3)]);
    assert_eq!(ids(&p), vec![5]);
}

#[test]
fn preempting_the_only_sequence_of_an_adapter_frees_its_slot() {
    // 4 blocks of 4 tokens, one adapter slot. Requests 1 (no adapter) and 2 (adapter 1,
    // least urgent) fill the pool in step 1; in step 2 request 1 needs a third block, so
    // request 2 is preempted and adapter 1's slot is free again.
    let c = SchedulerConfig {
        max_loras: 1,
        ..config(4, 4)
    };
    let mut s = sched(c, Box::new(PriorityPolicy::new(0.0, false, 3)));
    s.add_request(with_adapter(req(1, 0, (0..8).collect(), 8), None, 0))
        .unwrap();
    s.add_request(with_adapter(req(2, 0, (100..108).collect(), 8), Some(1), 5))
        .unwrap();
    step(&mut s, 0, 50);
    assert_eq!(s.stats().num_running_adapters, 1);
    s.add_request(with_adapter(req(3, 1, (200..204).collect(), 1), Some(2), 1))
        .unwrap();
    let (p, _) = step(&mut s, 1, 51);
    assert_eq!(p.preempted, vec![RequestId(2)]);
    let st = s.stats();
    assert_eq!(
        (st.num_running_adapters, st.num_waiting_adapter_requests),
        (0, 2)
    );
    // Step 3: request 3 (adapter 2, more urgent) takes the slot and the last free block;
    // request 2 now waits for the slot.
    let (p, _) = step(&mut s, 2, 52);
    assert_eq!(ids(&p), vec![1, 3]);
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Preempted));
    // Aborting request 1 frees blocks but no adapter slot (it has none); request 3 ended by
    // length in step 3, so adapter 1's request 2 is re-admitted.
    assert!(s.abort(RequestId(1)));
    let (p, _) = step(&mut s, 3, 53);
    assert_eq!(ids(&p), vec![2]);
    assert_eq!(s.stats().num_running_adapters, 1);
}

#[test]
fn aborting_a_running_adapter_request_frees_its_slot() {
    let c = SchedulerConfig {
        max_loras: 1,
        ..config(16, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    s.add_request(with_adapter(req(1, 0, vec![1; 4], 8), Some(1), 0))
        .unwrap();
    s.add_request(with_adapter(req(2, 1, vec![2; 4], 8), Some(2), 0))
        .unwrap();
    let (p, _) = step(&mut s, 0, 3);
    assert_eq!(ids(&p), vec![1]);
    assert!(s.abort(RequestId(1)));
    s.check_invariants().unwrap();
    let (p, _) = step(&mut s, 1, 3);
    assert_eq!(ids(&p), vec![2]);
    // Ending a waiting adapter request keeps the counts right too.
    s.add_request(with_adapter(req(3, 2, vec![3; 4], 8), Some(3), 0))
        .unwrap();
    assert_eq!(s.stats().num_waiting_adapter_requests, 1);
    assert!(s.finish(RequestId(3), FinishReason::Stop));
    s.check_invariants().unwrap();
    assert_eq!(s.stats().num_waiting_adapter_requests, 0);
}

#[test]
fn max_loras_is_bounded() {
    for bad in [0, crate::scheduler::MAX_LORAS + 1] {
        let c = SchedulerConfig {
            max_loras: bad,
            ..config(4, 4)
        };
        let e = Scheduler::new(c, Box::new(Fcfs), [0, 0])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("max_loras"), "{e}");
    }
    assert_eq!(SchedulerConfig::default().max_loras, 4);
}

#[test]
fn requests_passed_over_for_adapters_do_not_use_up_the_candidates_examined() {
    // Two seats: at most max_num_seqs + 1 = 3 waiting requests are ranked first. Requests
    // 2-4 all need a second adapter slot, so the rest is ranked too and request 5 (no
    // adapter) takes the free seat.
    let c = SchedulerConfig {
        max_num_seqs: 2,
        max_loras: 1,
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    s.add_request(with_adapter(req(1, 0, vec![1; 4], 8), Some(1), 0))
        .unwrap();
    step(&mut s, 0, 3);
    for (id, adapter) in [(2, Some(2)), (3, Some(3)), (4, Some(4)), (5, None)] {
        let r = req(id, id, vec![id as u32; 4], 8);
        s.add_request(with_adapter(r, adapter, 0)).unwrap();
    }
    let (p, _) = step(&mut s, 10, 3);
    assert_eq!(ids(&p), vec![1, 5]);
    assert_eq!(s.stats().num_waiting_adapter_requests, 3);
}

/// Speculative decoding: a sequence repeating its prompt gets the prompt's continuation as
/// drafts, accepted drafts become outputs in order with their KV counted as computed, the
/// blocks reserved for rejected drafts go back, and drafts never pass `max_tokens`.
#[test]
fn drafts_are_proposed_verified_and_their_rejected_blocks_freed() {
    let c = SchedulerConfig {
        speculative: drafts(3, 2, 3),
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    // Prompt "10 11 12 13 14 15 16 10 11"; the model goes on "12 13 99 ...".
    let prompt = vec![10, 11, 12, 13, 14, 15, 16, 10, 11];
    s.add_request(req(1, 0, prompt.clone(), 7)).unwrap();
    let model = [12u32, 13, 99, 98, 97, 96, 95];
    let run = |s: &mut Scheduler| {
        let plan = s.schedule(Timestamp(0));
        let outs: Vec<StepOutput> = plan
            .seqs
            .iter()
            .filter(|q| q.samples)
            .map(|q| {
                let first = q.num_computed_tokens + q.num_new_tokens - q.draft_tokens.len();
                let at = |p: usize| model[p - prompt.len()];
                let accepted = q
                    .draft_tokens
                    .iter()
                    .enumerate()
                    .take_while(|&(i, &d)| d == at(first + i))
                    .count();
                StepOutput {
                    id: q.id,
                    token: at(first + accepted),
                    accepted: accepted as u32,
                }
            })
            .collect();
        let ev = s.apply_outputs(&plan, &outs, Timestamp(0));
        s.check_invariants().unwrap();
        (plan, ev)
    };
    // Prefill: no drafts; samples 12.
    let (plan, _) = run(&mut s);
    assert!(plan.seqs[0].draft_tokens.is_empty());
    // Decode of "... 10 11 12": the suffix "11 12" matched at the start, drafts "13 14 15";
    // the model agrees with 13 only: outputs 13, 99.
    let (plan, ev) = run(&mut s);
    assert_eq!(plan.seqs[0].draft_tokens, vec![13, 14, 15]);
    assert_eq!(plan.seqs[0].num_new_tokens, 4);
    assert_eq!(plan.num_batched_tokens, 4);
    let tokens: Vec<u32> = ev
        .iter()
        .filter_map(|e| match e {
            SeqEvent::Token { token, .. } => Some(*token),
            _ => None,
        })
        .collect();
    assert_eq!(tokens, vec![13, 99]);
    assert_eq!(s.output_tokens(RequestId(1)), Some(&[12, 13, 99][..]));
    // Prompt 9 + outputs 3 = 12 tokens, 11 computed (the last one is fed next): three blocks
    // of 4, the fourth reserved for the drafts given back.
    assert_eq!(s.block_table(RequestId(1)).map(<[u32]>::len), Some(3));
    assert_eq!(s.stats().num_free_blocks, 64 - 3);
    // "13 99" never occurred before: a plain decode, then the outputs run to max_tokens.
    let (plan, _) = run(&mut s);
    assert!(plan.seqs[0].draft_tokens.is_empty());
    while s.has_unfinished() {
        let (plan, _) = run(&mut s);
        for q in &plan.seqs {
            let out = s.output_tokens(q.id).map_or(7, <[u32]>::len);
            assert!(out <= 7);
        }
    }
    assert_eq!(s.stats().num_free_blocks, 64);
}

/// Drafts only take what the step leaves over and stop at `max_tokens`.
#[test]
fn drafts_take_only_leftover_budget_and_stop_at_max_tokens() {
    let c = SchedulerConfig {
        max_num_batched_tokens: 6,
        speculative: drafts(8, 1, 2),
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    // Outputs are all 5, so after the first output every suffix matches.
    s.add_request(req(1, 0, vec![5, 5, 5], 4)).unwrap();
    s.add_request(req(2, 0, vec![5, 5, 5], 10)).unwrap();
    step(&mut s, 0, 5); // both prefills (6 tokens)
    let plan = s.schedule(Timestamp(1));
    // Two decodes take 2 of the 6 tokens: 4 left for drafts, in plan order. Request 1 may
    // have at most 4 - 1 - 1 = 2 drafts (one output so far, one sampled after the drafts);
    // request 2 gets the other 2.
    assert_eq!(plan.seqs[0].draft_tokens, vec![5, 5]);
    assert_eq!(plan.seqs[1].draft_tokens, vec![5, 5]);
    assert_eq!(plan.num_batched_tokens, 6);
    let outs: Vec<StepOutput> = plan
        .seqs
        .iter()
        .map(|q| StepOutput {
            id: q.id,
            token: 5,
            accepted: q.draft_tokens.len() as u32,
        })
        .collect();
    let ev = s.apply_outputs(&plan, &outs, Timestamp(1));
    s.check_invariants().unwrap();
    assert!(ev.iter().any(|e| matches!(
        e,
        SeqEvent::Finished {
            id: RequestId(1),
            reason: FinishReason::Length,
            ..
        }
    )));
    assert_eq!(s.output_tokens(RequestId(1)), Some(&[5, 5, 5, 5][..]));
    assert_eq!(s.output_tokens(RequestId(2)), Some(&[5, 5, 5, 5][..]));
}

/// A stop token among the accepted drafts ends the sequence there: later accepted drafts are
/// not outputs, and what policies observe stays consistent (no more computed tokens than
/// tokens); no drafts on a sequence's first sampling step.
#[test]
fn a_stop_inside_accepted_drafts_ends_the_sequence_there() {
    use crate::policy::{PolicyEvent, Rank};
    use crate::sequence::SeqView;
    /// FCFS that checks every sequence it is shown.
    struct Checking;
    impl Policy for Checking {
        fn name(&self) -> &str {
            "checking"
        }
        fn rank(&self, seq: SeqView<'_>, _: Timestamp) -> Rank {
            Rank {
                class: 0,
                key: seq.arrival().0 as i64,
            }
        }
        fn observe(&mut self, event: PolicyEvent<'_>) {
            if let PolicyEvent::Served { seq, .. } = event {
                assert!(
                    seq.num_computed_tokens() <= seq.prompt_len() + seq.num_output_tokens(),
                    "{} computed of {} + {}",
                    seq.num_computed_tokens(),
                    seq.prompt_len(),
                    seq.num_output_tokens()
                );
            }
        }
    }
    let c = SchedulerConfig {
        speculative: drafts(4, 1, 2),
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Checking));
    // EOS is 9; the prompt holds "5 9 1 2 4" so after a 5 the lookup drafts "9 1 2 4".
    let mut r = req(1, 0, vec![3, 5, 9, 1, 2, 4], 10);
    r.limits.eos_token_id = Some(9);
    s.add_request(r).unwrap();
    // Prefill samples 5: no drafts on the first sampling step (nothing generated yet).
    let plan = s.schedule(Timestamp(0));
    assert!(plan.seqs[0].draft_tokens.is_empty());
    s.apply_outputs(&plan, &[StepOutput::new(RequestId(1), 5)], Timestamp(0));
    let plan = s.schedule(Timestamp(1));
    assert_eq!(plan.seqs[0].draft_tokens, vec![9, 1, 2, 4]);
    // The model agrees with three drafts; EOS is the first of them.
    let out = StepOutput {
        id: RequestId(1),
        token: 7,
        accepted: 3,
    };
    let ev = s.apply_outputs(&plan, &[out], Timestamp(1));
    s.check_invariants().unwrap();
    assert!(ev.iter().any(|e| matches!(
        e,
        SeqEvent::Finished {
            reason: FinishReason::Eos,
            ..
        }
    )));
    let tokens: Vec<u32> = ev
        .iter()
        .filter_map(|e| match e {
            SeqEvent::Token { token, .. } => Some(*token),
            _ => None,
        })
        .collect();
    assert_eq!(tokens, vec![9]);
    assert_eq!(s.output_tokens(RequestId(1)), Some(&[5, 9][..]));
    assert_eq!(s.stats().num_free_blocks, 64);
}

/// Regression: blocks of a victim that the waiting request matched in the prefix cache do not
/// count as freed for it. Preempting the victim only makes them evictable, and admission
/// pins such blocks rather than counting them as available, so counting them preempted the
/// victim and then failed the admission anyway (its KV lost for nothing).
#[test]
fn preemption_for_admission_does_not_count_blocks_the_candidate_reuses() {
    // 6 blocks of 4 tokens. Step 1 prefills request 1 (priority 0) and request 2 (priority 5,
    // prompt 0..8): two blocks each, request 2's both cached.
    let priority = || Box::new(PriorityPolicy::new(0.0, true, 3));
    let mut s = sched(config(6, 4), priority());
    s.add_request(with_adapter(req(1, 0, (100..108).collect(), 8), None, 0))
        .unwrap();
    s.add_request(with_adapter(req(2, 0, (0..8).collect(), 8), None, 5))
        .unwrap();
    step(&mut s, 0, 50);
    // Request 3 (priority 1) starts with request 2's prompt: it reuses request 2's two blocks
    // and needs two more. Step 2's decodes take the last two free blocks (a third block
    // each). Preempting request 2 would free its three blocks, but two of them are the ones
    // request 3 reuses: one block for the two needed, so nothing is preempted.
    let prompt: Vec<u32> = (0..8).chain(200..208).collect();
    s.add_request(with_adapter(req(3, 1, prompt.clone(), 4), None, 1))
        .unwrap();
    let (p, _) = step(&mut s, 1, 51);
    assert!(p.preempted.is_empty(), "{:?}", p.preempted);
    assert_eq!(ids(&p), vec![1, 2]);
    assert_eq!(s.stats().num_preemptions, 0);
    assert_eq!(s.request_state(RequestId(3)), Some(RequestState::Waiting));
    // Once request 1 ends, request 3 is admitted on request 2's blocks, still shared.
    assert!(s.abort(RequestId(1)));
    let (p, _) = step(&mut s, 2, 52);
    assert_eq!(ids(&p), vec![2, 3]);
    let q = &p.seqs[1];
    assert_eq!((q.num_computed_tokens, q.num_new_tokens), (8, 8));

    // With a request of priority 3 to preempt as well (one block, a second for its decode),
    // the two victims free the two blocks request 3 needs beyond the ones it reuses: both
    // go, and request 3 is admitted in the same step.
    let mut s = sched(config(8, 4), priority());
    s.add_request(with_adapter(req(1, 0, (100..108).collect(), 8), None, 0))
        .unwrap();
    s.add_request(with_adapter(req(2, 0, (0..8).collect(), 8), None, 5))
        .unwrap();
    s.add_request(with_adapter(req(4, 0, (300..304).collect(), 8), None, 3))
        .unwrap();
    step(&mut s, 0, 50);
    s.add_request(with_adapter(req(3, 1, prompt, 4), None, 1))
        .unwrap();
    let (p, _) = step(&mut s, 1, 51);
    assert_eq!(p.preempted, vec![RequestId(2), RequestId(4)]);
    assert_eq!(ids(&p), vec![1, 3]);
    let q = &p.seqs[1];
    assert_eq!((q.num_computed_tokens, q.num_new_tokens), (8, 8));
}

/// Regression: a prefill chunk that ends one token before the end of the prompt (17 tokens,
/// a 16-token budget) does not sample, and resolving it took `after - prompt_len` with a
/// wrapping subtraction and then added one: an overflow, which panics with overflow checks
/// on (this crate's tests may run optimised, where it went unnoticed).
#[test]
fn a_chunk_ending_one_token_before_the_prompt_end_resolves() {
    let budget_16 = || SchedulerConfig {
        max_num_batched_tokens: 16,
        ..config(16, 16)
    };
    let mut s = sched(budget_16(), Box::new(Fcfs));
    s.add_request(req(1, 0, (0..17).collect(), 2)).unwrap();
    let (p, ev) = step(&mut s, 0, 7);
    let q = &p.seqs[0];
    assert_eq!(
        (q.num_computed_tokens, q.num_new_tokens, q.samples),
        (0, 16, false)
    );
    assert!(ev.is_empty());
    // The last prompt token alone, sampling the first output.
    let (p, ev) = step(&mut s, 1, 7);
    let q = &p.seqs[0];
    assert_eq!(
        (
            q.num_computed_tokens,
            q.num_new_tokens,
            q.samples,
            q.is_prefill
        ),
        (16, 1, true, false)
    );
    assert_eq!(
        ev.first(),
        Some(&SeqEvent::FirstToken {
            id: RequestId(1),
            at: Timestamp(1),
            cached_prompt_tokens: 0,
        })
    );
    let (_, ev) = step(&mut s, 2, 8);
    assert!(ev.contains(&SeqEvent::Finished {
        id: RequestId(1),
        reason: FinishReason::Length,
        at: Timestamp(2)
    }));
    assert_eq!(s.output_tokens(RequestId(1)), Some(&[7, 8][..]));

    // The same, pipelined: the last prompt token is planned while the first chunk runs, and
    // the first chunk resolves while the second is in flight.
    let mut s = sched(budget_16(), Box::new(Fcfs));
    s.add_request(req(1, 0, (0..17).collect(), 2)).unwrap();
    let first = s.schedule(Timestamp(0));
    s.launch(&first);
    let second = s.schedule_ahead(Timestamp(1)).expect("planned ahead");
    let q = &second.seqs[0];
    assert_eq!(
        (q.num_computed_tokens, q.num_new_tokens, q.samples),
        (16, 1, true)
    );
    s.launch(&second);
    assert!(s.resolve(&first, &[], Timestamp(1)).is_empty());
    let ev = s.resolve(&second, &[StepOutput::new(RequestId(1), 7)], Timestamp(2));
    assert!(ev.contains(&SeqEvent::Token {
        id: RequestId(1),
        token: 7,
        at: Timestamp(2)
    }));
    assert_eq!(s.output_tokens(RequestId(1)), Some(&[7][..]));
    s.check_invariants().unwrap();
}

#[test]
fn a_prefill_longer_than_the_budget_is_planned_ahead_in_chunks() {
    // Budget 16, a 40-token prompt: its second chunk is planned while the first runs (an
    // ahead plan used to take whole remaining prefills only, and gave up on this one).
    let c = SchedulerConfig {
        max_num_batched_tokens: 16,
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    s.add_request(req(1, 0, (0..40).collect(), 2)).unwrap();
    let first = s.schedule(Timestamp(0));
    s.launch(&first);
    let second = s.schedule_ahead(Timestamp(1)).expect("planned ahead");
    let q = &second.seqs[0];
    assert_eq!(
        (q.num_computed_tokens, q.num_new_tokens, q.samples),
        (16, 16, false)
    );
    s.launch(&second);
    assert!(s.resolve(&first, &[], Timestamp(1)).is_empty());
    assert!(s.resolve(&second, &[], Timestamp(2)).is_empty());
    s.check_invariants().unwrap();
}

/// Regression: a prompt-logprob request's decode uses its seat's own row of logits. Charging
/// it to the shared rows let two such decodes use them all up, and a prompt-logprob request
/// at the head of the queue then held back every admission.
#[test]
fn decodes_of_prompt_logprob_requests_take_no_shared_logit_rows() {
    // 8 seats and 10 rows: 2 shared.
    let c = SchedulerConfig {
        max_logit_rows: 10,
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    for id in [1, 2] {
        let mut r = req(id, 0, vec![id as u32], 8);
        r.limits.prompt_logits = true;
        s.add_request(r).unwrap();
    }
    let (p, _) = step(&mut s, 0, 7);
    assert_eq!(ids(&p), vec![1, 2]);
    // Two decodes, then a prompt-logprob request (3 prompt tokens: its seat's row and the 2
    // shared ones) and an ordinary request behind it.
    let mut r = req(3, 1, vec![3; 3], 8);
    r.limits.prompt_logits = true;
    s.add_request(r).unwrap();
    s.add_request(req(4, 2, vec![4; 3], 8)).unwrap();
    let (p, _) = step(&mut s, 1, 7);
    assert_eq!(ids(&p), vec![1, 2, 3, 4]);
    let chunks: Vec<usize> = p.seqs.iter().map(|q| q.num_new_tokens).collect();
    assert_eq!(chunks, vec![1, 1, 3, 3]);
}

#[test]
fn max_num_seqs_must_fit_the_logit_rows() {
    // Every sequence that samples needs a row of logits: more seats than rows would send the
    // backend steps it refuses.
    let c = SchedulerConfig {
        max_num_seqs: 16,
        max_logit_rows: 8,
        ..config(4, 4)
    };
    let e = Scheduler::new(c, Box::new(Fcfs), [0, 0])
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("max_num_seqs") && e.contains("max_logit_rows"),
        "{e}"
    );
    let c = SchedulerConfig {
        max_num_seqs: 8,
        max_logit_rows: 8,
        ..config(4, 4)
    };
    assert!(Scheduler::new(c, Box::new(Fcfs), [0, 0]).is_ok());
}

#[test]
fn without_prefix_caching_no_block_is_registered() {
    let mut c = config(16, 4);
    c.enable_prefix_caching = false;
    let mut s = sched(c, Box::new(Fcfs));
    s.add_request(req(1, 0, (0..20).collect(), 6)).unwrap();
    for now in 1..=6 {
        step(&mut s, now, 7);
    }
    assert_eq!(s.ledger().num_cached(), 0);
    // With caching, the same run registers its full blocks.
    let mut s = sched(config(16, 4), Box::new(Fcfs));
    s.add_request(req(1, 0, (0..20).collect(), 6)).unwrap();
    for now in 1..=6 {
        step(&mut s, now, 7);
    }
    assert!(s.ledger().num_cached() >= 5);
}

/// A sliding window of 8 tokens, the backend reading 4 keys before it, blocks of 4 and chunks
/// of at most 8 tokens: a sequence keeps the blocks of its last 16 positions (window, slack
/// and the margin of 4) and holds at most 9 blocks at once.
fn windowed(blocks: usize) -> SchedulerConfig {
    let mut c = config(blocks, 4);
    c.max_num_batched_tokens = 8;
    c.sliding_window = Some(SlidingWindow {
        tokens: 8,
        read_slack: 4,
    });
    c
}

#[test]
fn a_sliding_window_gives_back_the_blocks_behind_it() {
    let c = windowed(10);
    let held = c
        .sliding_window
        .map(|w| w.blocks_held(c.block_size, c.max_num_batched_tokens));
    assert_eq!(held, Some(9));
    assert_eq!(c.kv_capacity_tokens(), usize::MAX);
    let mut s = sched(c, Box::new(Fcfs));
    // 100 tokens need 25 blocks; the pool has 10.
    s.add_request(req(1, 0, vec![5; 20], 80)).unwrap();
    let mut t = 0;
    while s.has_unfinished() {
        let (p, _) = step(&mut s, t, 9);
        t += 1;
        let Some(q) = p.seqs.first() else { continue };
        if s.request_state(RequestId(1)) != Some(RequestState::Running) {
            continue; // finished: its blocks went back
        }
        let table = s.block_table(RequestId(1)).unwrap_or(&[]);
        let released = table.iter().take_while(|&&b| b == RELEASED_BLOCK).count();
        // Given back: the blocks wholly before position computed - 16.
        assert_eq!(
            released,
            q.num_computed_tokens.saturating_sub(16) / 4,
            "step {t}"
        );
        assert!(table.len() - released <= 9, "step {t}: {table:?}");
        assert!(!table[released..].contains(&RELEASED_BLOCK));
        assert!(t < 200, "no progress");
    }
    assert_eq!(s.output_tokens(RequestId(1)).map(<[u32]>::len), Some(80));
    assert_eq!(s.stats().num_free_blocks, 10);
    assert_eq!(s.stats().num_preemptions, 0);

    // Without the window the same request does not fit in the pool.
    let mut c = windowed(10);
    c.sliding_window = None;
    let mut s = sched(c, Box::new(Fcfs));
    assert!(matches!(
        s.add_request(req(1, 0, vec![5; 20], 80)),
        Err(SchedulerError::ExceedsKvCapacity { .. })
    ));
}

#[test]
fn blocks_given_back_behind_a_window_stay_in_the_prefix_cache() {
    let mut s = sched(windowed(64), Box::new(Fcfs));
    let prompt: Vec<u32> = (0..40).collect();
    s.add_request(req(1, 0, prompt.clone(), 4)).unwrap();
    let mut t = 0;
    // The 40-token prompt in chunks of 8; the first blocks go back as the prefill moves on.
    while s.request_state(RequestId(1)) == Some(RequestState::Waiting)
        || s.output_tokens(RequestId(1)).is_some_and(|o| o.is_empty())
    {
        step(&mut s, t, 9);
        t += 1;
    }
    let table = s.block_table(RequestId(1)).unwrap();
    assert!(table.starts_with(&[RELEASED_BLOCK; 4]), "{table:?}");
    // The same prompt again: its whole prefix is found in the cache, the blocks given back
    // included (they were registered before they went back).
    s.add_request(req(2, t, prompt, 4)).unwrap();
    let (p, _) = step(&mut s, t, 9);
    let q = p.seqs.iter().find(|q| q.id == RequestId(2)).unwrap();
    assert_eq!(q.num_computed_tokens, 36);
    while s.has_unfinished() {
        t += 1;
        step(&mut s, t, 9);
    }
    assert_eq!(s.stats().num_free_blocks, 64);
}

#[test]
fn a_windowed_step_shape_counts_the_keys_of_each_window() {
    // Against a count key by key: token j (0-based) of a chunk after `computed` tokens sits at
    // position computed + j and attends to min(computed + j + 1, window) keys; the step reads
    // the keys from its first token's window on.
    for window in [1usize, 3, 8, 50] {
        for (computed, new) in [(0u64, 1u64), (0, 20), (5, 1), (5, 9), (100, 1), (100, 30)] {
            let w = SlidingWindow {
                tokens: window,
                read_slack: 0,
            };
            let mut s = StepShape::default();
            s.add_seq_within(computed, new, new > 1, true, Some(w));
            let pairs: u64 = (0..new)
                .map(|j| (computed + j + 1).min(window as u64))
                .sum();
            let first_key = (computed + 1).saturating_sub(window as u64);
            assert_eq!(
                s.attention_pairs, pairs,
                "window {window} at {computed}+{new}"
            );
            assert_eq!(s.kv_tokens, computed + new - first_key);
            // A window longer than the sequence changes nothing.
            let mut full = StepShape::default();
            full.add_seq(computed, new, new > 1, true);
            let mut wide = StepShape::default();
            let huge = SlidingWindow {
                tokens: 1 << 20,
                read_slack: 0,
            };
            wide.add_seq_within(computed, new, new > 1, true, Some(huge));
            assert_eq!(wide, full);
        }
    }
}

/// The cached prompt tokens a request's `FirstToken` reports (its `usage`'s `cached_tokens`).
fn cached_reported(events: &[SeqEvent], id: u64) -> Option<u32> {
    events.iter().find_map(|e| match *e {
        SeqEvent::FirstToken {
            id: i,
            cached_prompt_tokens,
            ..
        } if i == RequestId(id) => Some(cached_prompt_tokens),
        _ => None,
    })
}

#[test]
fn first_token_reports_the_prompt_tokens_the_prefix_cache_served() {
    // Blocks of 16. A 40-token prompt: the first request computes it all (0 cached) and
    // leaves blocks 0 and 1 full and cached. The same prompt again reuses at most
    // (40 - 1) / 16 = 2 blocks: 32 tokens. A 32-token prefix of it reuses at most
    // (32 - 1) / 16 = 1 block (its last token, at the end of block 1, is recomputed): 16.
    let prompt: Vec<u32> = (0..40).collect();
    let mut s = sched(config(16, 16), Box::new(Fcfs));
    s.add_request(req(1, 0, prompt.clone(), 1)).unwrap();
    let (_, ev) = step(&mut s, 0, 7);
    assert_eq!(cached_reported(&ev, 1), Some(0));
    s.add_request(req(2, 1, prompt.clone(), 1)).unwrap();
    let (_, ev) = step(&mut s, 1, 7);
    assert_eq!(cached_reported(&ev, 2), Some(32));
    s.add_request(req(3, 2, prompt[..32].to_vec(), 1)).unwrap();
    let (_, ev) = step(&mut s, 2, 7);
    assert_eq!(cached_reported(&ev, 3), Some(16));
    // A prompt sharing only the first block (tokens 0..16) reports that block.
    let mut other: Vec<u32> = (0..16).collect();
    other.extend(500..530);
    s.add_request(req(4, 3, other, 1)).unwrap();
    let (_, ev) = step(&mut s, 3, 7);
    assert_eq!(cached_reported(&ev, 4), Some(16));

    // Without prefix caching nothing is ever reported cached.
    let mut c = config(16, 16);
    c.enable_prefix_caching = false;
    let mut s = sched(c, Box::new(Fcfs));
    s.add_request(req(1, 0, prompt.clone(), 1)).unwrap();
    step(&mut s, 0, 7);
    s.add_request(req(2, 1, prompt, 1)).unwrap();
    let (p, ev) = step(&mut s, 1, 7);
    assert_eq!(p.seqs[0].num_computed_tokens, 0);
    assert_eq!(cached_reported(&ev, 2), Some(0));
}

#[test]
fn cached_prompt_tokens_are_those_of_the_first_admission_after_a_preemption() {
    // 5 blocks of 4, chunks of 12. Low-priority request 1 (16-token prompt) computes its
    // first chunk (3 full blocks, cached); urgent request 2 (8 tokens, 2 blocks) then finds
    // too few blocks and preempts it before its first token. Re-admitted, request 1 reuses its
    // own 3 blocks (12 tokens computed), but as vLLM's `num_cached_tokens` it reports what
    // the cache served at its first admission: 0.
    let mut c = config(5, 4);
    c.max_num_batched_tokens = 12;
    let mut s = sched(c, Box::new(PriorityPolicy::new(0.0, true, 3)));
    let mut low = req(1, 0, (0..16).collect(), 2);
    low.priority = 5;
    s.add_request(low).unwrap();
    let (p, ev) = step(&mut s, 0, 3);
    assert_eq!(
        (p.seqs[0].num_computed_tokens, p.seqs[0].num_new_tokens),
        (0, 12)
    );
    assert!(ev.is_empty());
    let mut high = req(2, 1, vec![9; 8], 1);
    high.priority = 0;
    s.add_request(high).unwrap();
    let mut events = Vec::new();
    let mut preempted = false;
    let mut readmitted_at = None;
    for now in 1..12 {
        let (p, ev) = step(&mut s, now, 3);
        preempted |= p.preempted.contains(&RequestId(1));
        if let Some(q) = p.seqs.iter().find(|q| q.id == RequestId(1)) {
            if preempted {
                readmitted_at.get_or_insert(q.num_computed_tokens);
            }
        }
        events.extend(ev);
        if cached_reported(&events, 1).is_some() {
            break;
        }
    }
    assert!(preempted, "request 1 was preempted before its first token");
    assert_eq!(cached_reported(&events, 2), Some(0));
    assert_eq!(
        readmitted_at,
        Some(12),
        "re-admitted past its own cached blocks"
    );
    assert_eq!(cached_reported(&events, 1), Some(0));
}

/// A prefix match naming a block the pool does not have (a corrupt ledger: the prefix index
/// only ever holds the pool's ids, so `touch` cannot fail otherwise) ends the match before
/// it: the block table stays aligned with the positions, the tokens from there on are
/// computed again and not reported cached, and the error shows in `check_invariants`. The
/// block used to be left out of the table while its tokens still counted as computed (and
/// cached): the table was one block short of the positions, so the step was dropped as stale.
#[test]
fn a_matched_block_the_pool_lacks_ends_the_prefix_there() {
    let prompt: Vec<u32> = (0..40).collect();
    let mut s = sched(config(16, 16), Box::new(Fcfs));
    s.add_request(req(1, 0, prompt.clone(), 1)).unwrap();
    let (p, _) = step(&mut s, 0, 7);
    // 3 blocks, the first 2 full and cached; the second's entry now names no block.
    let blocks = p.seqs[0].new_blocks.clone();
    assert_eq!(blocks.len(), 3);
    s.ledger.corrupt_cache_entry(blocks[1], 1000);
    s.add_request(req(2, 1, prompt, 1)).unwrap();
    let plan = s.schedule(Timestamp(1));
    let q = &plan.seqs[0];
    // The chunk planned for the 2-block match (8 tokens), from the end of the 1 block kept.
    assert_eq!(
        (q.num_computed_tokens, q.num_new_tokens, q.samples),
        (16, 8, false)
    );
    assert_eq!(q.new_blocks.len(), 2);
    assert_eq!(q.new_blocks[0], blocks[0]);
    assert!(s.check_invariants().is_err(), "the pool error is reported");
    assert_eq!(s.stats().pool_errors, 1, "and counted in the stats");
    let mut events = s.apply_outputs(&plan, &[], Timestamp(1));
    let plan = s.schedule(Timestamp(2));
    let q = &plan.seqs[0];
    assert_eq!(
        (q.num_computed_tokens, q.num_new_tokens, q.samples),
        (24, 16, true)
    );
    assert_eq!(s.block_table(RequestId(2)).map(<[_]>::len), Some(3));
    events.extend(s.apply_outputs(&plan, &[StepOutput::new(RequestId(2), 7)], Timestamp(2)));
    assert_eq!(cached_reported(&events, 2), Some(16));
    assert_eq!(s.output_tokens(RequestId(2)), Some(&[7][..]));
}

/// Cached prompt tokens come only from a request's own namespace: blocks computed under
/// another cache salt, another LoRA adapter or none are neither matched nor reported; a salt
/// of 0 is the shared namespace.
#[test]
fn cached_prompt_tokens_never_come_from_another_namespace() {
    let prompt: Vec<u32> = (0..40).collect();
    let mut s = sched(config(64, 16), Box::new(Fcfs));
    let namespaces = [
        (None, None),
        (Some(7), None),
        (Some(8), None),
        (None, Some(1)),
        (Some(7), Some(1)),
        (None, Some(2)),
    ];
    // Each namespace computes the prompt first (0 cached), then finds its own 2 blocks.
    let rounds = [
        (0u32, &namespaces[..]),
        (32, &namespaces[..]),
        (32, &[(Some(0), None)]),
    ];
    let mut id = 0;
    for (want, spaces) in rounds {
        for &(salt, adapter) in spaces {
            id += 1;
            let mut r = req(id, id, prompt.clone(), 1);
            r.cache_salt = salt;
            r.lora_adapter = adapter;
            s.add_request(r).unwrap();
            let (p, ev) = step(&mut s, id, 7);
            assert_eq!(p.seqs[0].num_computed_tokens, want as usize);
            assert_eq!(
                cached_reported(&ev, id),
                Some(want),
                "request {id}: salt {salt:?}, adapter {adapter:?}"
            );
        }
    }
}

/// With speculative decoding on, a one-token request (an embedding's shape) is never given
/// drafts, and a request whose decodes accept drafts reports its cached prompt tokens once,
/// before its first token.
#[test]
fn speculative_decoding_reports_cached_tokens_once_and_drafts_nothing_for_one_token() {
    let c = SchedulerConfig {
        speculative: drafts(4, 1, 2),
        ..config(64, 16)
    };
    let mut s = sched(c, Box::new(Fcfs));
    let prompt = vec![5u32; 40];
    s.add_request(req(1, 0, prompt.clone(), 1)).unwrap();
    s.add_request(req(2, 1, prompt.clone(), 12)).unwrap();
    let mut events = Vec::new();
    let mut drafted = 0;
    for now in 0..40 {
        if now == 2 {
            s.add_request(req(3, 2, prompt.clone(), 1)).unwrap();
        }
        let plan = s.schedule(Timestamp(now));
        for q in &plan.seqs {
            if q.id == RequestId(1) || q.id == RequestId(3) {
                assert!(q.draft_tokens.is_empty(), "drafts for {:?}", q.id);
            }
            drafted += q.draft_tokens.len();
        }
        let outs: Vec<StepOutput> = plan
            .seqs
            .iter()
            .filter(|q| q.samples)
            .map(|q| StepOutput {
                id: q.id,
                token: 5,
                accepted: q.draft_tokens.len() as u32,
            })
            .collect();
        events.extend(s.apply_outputs(&plan, &outs, Timestamp(now)));
        s.check_invariants().unwrap();
        if !s.has_unfinished() && now > 2 {
            break;
        }
    }
    assert!(drafted > 0, "request 2 was given drafts");
    assert_eq!(s.output_tokens(RequestId(2)).map(<[_]>::len), Some(12));
    for (id, want) in [(1, 0), (2, 0), (3, 32)] {
        let firsts: Vec<u32> = events
            .iter()
            .filter_map(|e| match *e {
                SeqEvent::FirstToken {
                    id: i,
                    cached_prompt_tokens,
                    ..
                } if i == RequestId(id) => Some(cached_prompt_tokens),
                _ => None,
            })
            .collect();
        assert_eq!(firsts, vec![want], "request {id}");
        let first_at = events
            .iter()
            .position(|e| matches!(*e, SeqEvent::FirstToken { id: i, .. } if i == RequestId(id)));
        let token_at = events
            .iter()
            .position(|e| matches!(*e, SeqEvent::Token { id: i, .. } if i == RequestId(id)));
        assert!(
            first_at < token_at,
            "request {id}: first token event after a token"
        );
    }
}

/// Planned ahead of a step in flight, an admission that matches cached blocks nobody holds
/// keeps them: the commit pins them before it allocates the blocks another admission of the
/// same plan reserved, so the allocation (least recently used first) cannot evict them between
/// planning and execution, and the cached tokens reported are the blocks the table holds.
#[test]
fn blocks_matched_in_a_plan_made_ahead_are_not_evicted_by_its_allocations() {
    // 7 blocks of 16. Request 1 computes a 40-token prompt (3 blocks, 2 cached) and ends:
    // its blocks are free, the cached ones the least recently used after the fresh ones.
    let prompt: Vec<u32> = (0..40).collect();
    let mut s = sched(config(7, 16), Box::new(Fcfs));
    s.add_request(req(1, 0, prompt.clone(), 1)).unwrap();
    let (p, _) = step(&mut s, 0, 7);
    let cached: Vec<u32> = p.seqs[0].new_blocks[..2].to_vec();
    // Request 2 (1 block) runs; while its step is in flight, request 3 (the same prompt)
    // and request 4 (3 blocks of its own) are admitted in a plan made ahead. The 6 free
    // blocks include the 2 cached: request 3 pins them and takes 1, request 4 takes 3.
    s.add_request(req(2, 1, (100..110).collect(), 3)).unwrap();
    let first = s.schedule(Timestamp(1));
    s.launch(&first);
    s.add_request(req(3, 2, prompt, 1)).unwrap();
    s.add_request(req(4, 2, (200..240).collect(), 1)).unwrap();
    let ahead = s.schedule_ahead(Timestamp(2)).expect("planned ahead");
    s.check_invariants().unwrap();
    let entry = |id: u64| {
        ahead
            .seqs
            .iter()
            .find(|q| q.id == RequestId(id))
            .unwrap_or_else(|| panic!("request {id} planned"))
    };
    let (three, four) = (entry(3), entry(4));
    assert_eq!(three.num_computed_tokens, 32);
    assert_eq!(&three.new_blocks[..2], &cached[..]);
    assert_eq!(three.new_blocks.len(), 3);
    assert_eq!(four.new_blocks.len(), 3);
    let mut all: Vec<u32> = three
        .new_blocks
        .iter()
        .chain(&four.new_blocks)
        .copied()
        .collect();
    all.extend(s.block_table(RequestId(2)).unwrap_or_default());
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 7, "a block is in two tables");
    s.launch(&ahead);
    let outs = |p: &StepPlan| -> Vec<StepOutput> {
        p.seqs
            .iter()
            .filter(|q| q.samples)
            .map(|q| StepOutput::new(q.id, 7))
            .collect()
    };
    let mut events = s.resolve(&first, &outs(&first), Timestamp(2));
    events.extend(s.resolve(&ahead, &outs(&ahead), Timestamp(3)));
    s.check_invariants().unwrap();
    assert_eq!(cached_reported(&events, 3), Some(32));
    assert_eq!(cached_reported(&events, 4), Some(0));
}
