//! Speculative decoding: drafts proposed from what the step leaves over, verified, and the
//! blocks of rejected drafts given back.

use super::*;

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

/// A request told to take no more drafts (`stop_drafts`, the engine's answer to a grammar
/// whose drafts became costly) gets none from the next plan on while the others keep theirs;
/// its outputs go on one per step. Unknown and ended requests are refused.
#[test]
fn a_request_stopped_from_drafting_gets_no_more_drafts() {
    let c = SchedulerConfig {
        speculative: drafts(2, 1, 2),
        ..config(64, 4)
    };
    let mut s = sched(c, Box::new(Fcfs));
    // Outputs are all 5, so after the first output every suffix matches.
    s.add_request(req(1, 0, vec![5, 5, 5], 8)).unwrap();
    s.add_request(req(2, 0, vec![5, 5, 5], 8)).unwrap();
    step(&mut s, 0, 5);
    let all_accepted = |plan: &StepPlan| -> Vec<StepOutput> {
        plan.seqs
            .iter()
            .map(|q| StepOutput {
                id: q.id,
                token: 5,
                accepted: q.draft_tokens.len() as u32,
            })
            .collect()
    };
    let plan = s.schedule(Timestamp(1));
    assert_eq!(plan.seqs[0].draft_tokens, vec![5, 5]);
    assert_eq!(plan.seqs[1].draft_tokens, vec![5, 5]);
    s.apply_outputs(&plan, &all_accepted(&plan), Timestamp(1));
    assert!(s.stop_drafts(RequestId(1)));
    assert!(!s.stop_drafts(RequestId(3)));
    let (mut outputs_after, mut others_drafted) = (0, false);
    while s.has_unfinished() {
        let plan = s.schedule(Timestamp(2));
        for q in &plan.seqs {
            if q.id == RequestId(1) {
                assert!(q.draft_tokens.is_empty(), "{:?}", q.draft_tokens);
                assert_eq!(q.num_new_tokens, 1);
                outputs_after += 1;
            } else {
                others_drafted |= !q.draft_tokens.is_empty();
            }
        }
        s.apply_outputs(&plan, &all_accepted(&plan), Timestamp(2));
        s.check_invariants().unwrap();
    }
    // One output per step after the stop: 8 - (1 + 3) of them.
    assert_eq!(outputs_after, 4);
    assert!(others_drafted);
    assert_eq!(s.output_tokens(RequestId(1)).map(<[u32]>::len), Some(8));
    assert!(!s.stop_drafts(RequestId(1)), "an ended request");
    assert_eq!(s.stats().num_free_blocks, 64);
}

/// A step planned with drafts before `stop_drafts` (the engine stops a request's drafts as it
/// applies the outputs of the step that fed them, a launched step's included) resolves as
/// planned: its accepted drafts and the token after them are the request's outputs, its
/// blocks as for any draft step; the plans after it feed the request no drafts.
#[test]
fn a_step_planned_with_drafts_before_stop_drafts_resolves_as_planned() {
    for launched in [false, true] {
        let c = SchedulerConfig {
            speculative: drafts(2, 1, 2),
            ..config(64, 4)
        };
        let mut s = sched(c, Box::new(Fcfs));
        // Outputs are all 5, so after the first output every suffix matches.
        s.add_request(req(1, 0, vec![5, 5, 5], 8)).unwrap();
        step(&mut s, 0, 5);
        let plan = s.schedule(Timestamp(1));
        assert_eq!(plan.seqs[0].draft_tokens, vec![5, 5], "launched {launched}");
        if launched {
            s.launch(&plan);
        }
        assert!(s.stop_drafts(RequestId(1)));
        // One draft accepted, the other rejected: the token sampled after the first is 6.
        let out = [StepOutput {
            id: RequestId(1),
            token: 6,
            accepted: 1,
        }];
        if launched {
            s.resolve(&plan, &out, Timestamp(1));
        } else {
            s.apply_outputs(&plan, &out, Timestamp(1));
        }
        s.check_invariants().unwrap();
        assert_eq!(
            s.output_tokens(RequestId(1)),
            Some(&[5, 5, 6][..]),
            "launched {launched}"
        );
        let mut outputs = 3;
        while s.has_unfinished() {
            let plan = s.schedule(Timestamp(2));
            for q in &plan.seqs {
                assert!(q.draft_tokens.is_empty(), "launched {launched}: {q:?}");
            }
            let outs: Vec<StepOutput> = plan
                .seqs
                .iter()
                .map(|q| StepOutput {
                    id: q.id,
                    token: 5,
                    accepted: 0,
                })
                .collect();
            s.apply_outputs(&plan, &outs, Timestamp(2));
            s.check_invariants().unwrap();
            outputs += 1;
        }
        assert_eq!(outputs, 8, "launched {launched}");
        assert_eq!(s.stats().num_free_blocks, 64);
    }
}
