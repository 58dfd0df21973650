//! Preemption by recompute, when the pool runs dry and for admissions a policy asks for, and
//! what the policies hear of it and of admissions.

use super::*;

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

/// A request already past its TTFT target (slo-aware's default costs, 8 ms a step, exceed a
/// 5 ms target from arrival) still preempts a preemptible tier, as `priority` would; a
/// request that can still make its target goes first and takes the seat when both wait.
#[test]
fn slo_aware_preempts_preemptible_tier_for_relegated_work_after_feasible_work() {
    let tier = |name: &str, ttft_ms: Option<f64>, preemptible: bool| TierSpec {
        name: name.into(),
        ttft_ms,
        tpot_ms: None,
        weight: 1.0,
        preemptible,
        max_queue_ms: None,
        max_kv_fraction: None,
    };
    let setup = || {
        let mut c = config(64, 4);
        c.max_num_seqs = 1;
        c.tiers = vec![
            tier("premium", Some(5.0), false),
            tier("gold", Some(10_000.0), false),
            tier("batch", None, true),
        ];
        let p = PolicyRegistry::with_builtins()
            .create("slo-aware", &serde_yaml::Value::Null, &c.tiers)
            .unwrap();
        let mut s = sched(c, p);
        let mut batch = req(1, 0, vec![1; 4], 50);
        batch.tier = "batch".into();
        s.add_request(batch).unwrap();
        step(&mut s, 0, 3);
        s
    };
    let premium = || {
        let mut r = req(2, 1_000, vec![2; 4], 5);
        r.tier = "premium".into();
        r
    };
    // Alone, the relegated premium request preempts the batch request.
    let mut s = setup();
    s.add_request(premium()).unwrap();
    let (p, _) = step(&mut s, 2_000, 3);
    assert_eq!(p.preempted, vec![RequestId(1)]);
    assert_eq!(ids(&p), vec![2]);
    assert_eq!(s.request_state(RequestId(1)), Some(RequestState::Preempted));
    // With a feasible gold request waiting too (arrived later), gold ranks first: it takes
    // the one seat and the relegated request waits.
    let mut s = setup();
    s.add_request(premium()).unwrap();
    let mut gold = req(3, 1_500, vec![3; 4], 5);
    gold.tier = "gold".into();
    s.add_request(gold).unwrap();
    let (p, _) = step(&mut s, 2_000, 3);
    assert_eq!(p.preempted, vec![RequestId(1)]);
    assert_eq!(ids(&p), vec![3]);
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Waiting));
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

/// Under `slo-aware`, a request of a more urgent priority preempts running work of a tier
/// that is not preemptible when that work has no target (or can no longer make it); with the
/// same priority it waits for the seat.
#[test]
fn slo_aware_preempts_a_less_urgent_untargeted_tier_by_priority() {
    let tier = |name: &str, ttft_ms: Option<f64>| TierSpec {
        name: name.into(),
        ttft_ms,
        tpot_ms: None,
        weight: 1.0,
        preemptible: false,
        max_queue_ms: None,
        max_kv_fraction: None,
    };
    let run = |premium_priority: i32| {
        let mut c = config(64, 4);
        c.max_num_seqs = 1;
        c.tiers = vec![tier("premium", Some(5.0)), tier("standard", None)];
        let p = PolicyRegistry::with_builtins()
            .create("slo-aware", &serde_yaml::Value::Null, &c.tiers)
            .unwrap();
        let mut s = sched(c, p);
        let mut standard = with_adapter(req(1, 0, vec![1; 4], 50), None, 1);
        standard.tier = "standard".into();
        s.add_request(standard).unwrap();
        step(&mut s, 0, 3);
        // Relegated from its arrival: 8 ms a step (the default) outlasts its 5 ms target.
        let mut premium = with_adapter(req(2, 1_000, vec![2; 4], 5), None, premium_priority);
        premium.tier = "premium".into();
        s.add_request(premium).unwrap();
        let (p, _) = step(&mut s, 2_000, 3);
        (p, s)
    };
    let (p, s) = run(0);
    assert_eq!(p.preempted, vec![RequestId(1)]);
    assert_eq!(ids(&p), vec![2]);
    assert_eq!(s.request_state(RequestId(1)), Some(RequestState::Preempted));
    let (p, s) = run(1);
    assert!(p.preempted.is_empty());
    assert_eq!(ids(&p), vec![1]);
    assert_eq!(s.request_state(RequestId(2)), Some(RequestState::Waiting));
}
