//! LoRA adapter slots (`max_loras`): requests of an adapter without a slot are passed over,
//! keeping their place, and slots free as sequences stop running.

use super::*;

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
