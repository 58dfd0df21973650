//! The prefix cache in the planner: what admissions match and pin, which namespace a block
//! belongs to, and the cached prompt tokens a request reports.

use super::*;

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
