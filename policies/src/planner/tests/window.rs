//! Sliding-window models: blocks behind the window given back (and kept in the prefix cache)
//! and the step shape's keys per window.

use super::*;

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
