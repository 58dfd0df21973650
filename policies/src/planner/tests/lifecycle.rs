//! A request's life through the planner: prefill chunks and decodes, the token and logit-row
//! budgets, outputs applied or rolled back, stop conditions, aborts and validation.

use super::*;

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
