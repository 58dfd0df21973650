//! Skip-join multi-level feedback queue (FastServe, Wu et al. 2023): least attained service
//! first, without knowing how long an answer will be.
//!
//! Output lengths are unknown when a request arrives, so shortest-job-first cannot be applied
//! directly; a multi-level feedback queue approximates it from what each request has been
//! given so far. Level 0 is served first. A request that has generated its level's quantum of
//! output tokens moves down a level, and each level's quantum is twice the one above
//! (`quantum_tokens` × 2^level), so short answers finish in the top levels while long ones
//! sink and yield to newcomers, as a time-sharing scheduler does with CPU-bound jobs. Within
//! a level, requests go in arrival order.
//!
//! *Skip-join*: a request does not always join at level 0. Its prompt is work it brings
//! along (a long prefill delays everything batched with it), so it joins the level
//! `floor(log2(1 + prompt / prompt_tokens_per_level))`: with the default 1,024, prompts of
//! fewer than 1,024 tokens join level 0, those up to 3,071 level 1, up to 7,167 level 2.
//! Then it moves down from there.
//!
//! *Starvation*: every request rises one level per `aging_interval_ms` since its arrival,
//! waiting or running alike, so that under a stream of short requests a long one that waits
//! still runs: it outranks a newcomer `k` levels better than its own once it is `k` intervals
//! older (a tie goes to the earlier arrival). As in the
//! `priority` policy, aging alike keeps the order of two requests fixed but for what they are
//! served (the difference of their aging takes two adjacent values over time), so with the
//! strict comparison of [`Policy::may_preempt`] two requests never evict each other in turn
//! without one of them having moved down a level in between (a quantum of tokens generated):
//! every eviction is paid for by progress. (Aging from the latest time it was queued instead
//! would lift a waiting request and drop it again once admitted, so the request it evicted
//! would evict it back at the next step, and neither would finish.)
//!
//! *Preemption* (`preempt`, default off): a waiting request of a strictly better level may
//! evict a running request of a worse one when seats or KV blocks run out (the core asks
//! [`Policy::may_preempt`] only then, and only for running requests that rank after it). The
//! eviction is by recompute, as everywhere in this engine: the victim keeps its output and
//! recomputes its KV when re-admitted, at its level (its attained service is kept), so a
//! long answer that is preempted waits behind the short ones until it ages back in.

use crate::error::PolicyError;
use crate::policy::params::{aged_levels, aging_interval_us, Params};
use crate::policy::{Policy, Rank};
use crate::sequence::SeqView;
use crate::types::{TierSpec, Timestamp};

/// Registered name.
pub(crate) const NAME: &str = "mlfq";

/// Most levels a queue may have.
const MAX_LEVELS: u64 = 32;

/// Skip-join multi-level feedback queue.
#[derive(Clone, Debug)]
pub struct Mlfq {
    /// Levels (at least 1); the last one keeps what sinks to it.
    levels: u32,
    /// Output tokens a request generates at level 0 before it moves down; doubled per level.
    quantum_tokens: u64,
    /// Prompt tokens per skip-join step (see the module documentation).
    prompt_tokens_per_level: u64,
    /// Microseconds of waiting that lift a waiting request one level (0 = no aging).
    aging_interval_us: u64,
    /// Whether a waiting request may evict running work of a worse level.
    preempt: bool,
}

impl Mlfq {
    /// A queue of `levels` levels (at least 1) with a level-0 quantum of `quantum_tokens`
    /// output tokens (at least 1), skip-join by `prompt_tokens_per_level` (at least 1), and
    /// aging by `aging_interval_ms` (0 = none; rounded to whole microseconds, at least one).
    pub fn new(
        levels: u32,
        quantum_tokens: u64,
        prompt_tokens_per_level: u64,
        aging_interval_ms: f64,
        preempt: bool,
    ) -> Self {
        Self {
            levels: levels.max(1),
            quantum_tokens: quantum_tokens.max(1),
            prompt_tokens_per_level: prompt_tokens_per_level.max(1),
            aging_interval_us: aging_interval_us(aging_interval_ms),
            preempt,
        }
    }

    /// Builds the policy from `{levels, quantum_tokens, prompt_tokens_per_level,
    /// aging_interval_ms, preempt}` (defaults 6, 32, 1024, 10000, false).
    pub fn create(
        params: &serde_yaml::Value,
        _tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        let p = Params::new(
            NAME,
            params,
            &[
                "levels",
                "quantum_tokens",
                "prompt_tokens_per_level",
                "aging_interval_ms",
                "preempt",
            ],
        )?;
        let levels = p.u64_in("levels", 6, 1, MAX_LEVELS)? as u32;
        let quantum = p.u64_in("quantum_tokens", 32, 1, 1 << 20)?;
        let prompt_unit = p.u64_in("prompt_tokens_per_level", 1024, 1, 1 << 24)?;
        let aging = p.aging_interval_ms("aging_interval_ms", 10_000.0)?;
        let preempt = p.bool("preempt", false)?;
        Ok(Box::new(Self::new(
            levels,
            quantum,
            prompt_unit,
            aging,
            preempt,
        )))
    }

    /// The level a prompt of `prompt_len` tokens joins: `floor(log2(1 + prompt / unit))`,
    /// at most the last.
    fn join_level(&self, prompt_len: usize) -> u32 {
        let units = prompt_len as u64 / self.prompt_tokens_per_level;
        // floor(log2(1 + units)) for units >= 0.
        let level = u64::BITS - 1 - (units + 1).leading_zeros();
        level.min(self.levels - 1)
    }

    /// The level of a request that joined at `join` and has generated `output` tokens: it
    /// moves down a level for each quantum it used up (level `l`'s quantum is
    /// `quantum_tokens` × 2^l), and stays at the last.
    fn level_after(&self, join: u32, output: usize) -> u32 {
        let mut level = join;
        let mut left = output as u64;
        while level + 1 < self.levels {
            let quantum = self.quantum_tokens.saturating_mul(1 << level.min(62));
            if left < quantum {
                break;
            }
            left -= quantum;
            level += 1;
        }
        level
    }

    /// The request's level now: where its prompt and its output put it, less one per aging
    /// interval since its arrival; lower is served first (it may go below 0).
    pub fn effective_level(&self, seq: SeqView<'_>, now: Timestamp) -> i64 {
        let level = self.level_after(self.join_level(seq.prompt_len()), seq.num_output_tokens());
        let lift = aged_levels(self.aging_interval_us, seq.arrival(), now);
        i64::from(level) - lift
    }
}

impl Policy for Mlfq {
    fn name(&self) -> &str {
        NAME
    }

    fn rank(&self, seq: SeqView<'_>, now: Timestamp) -> Rank {
        Rank {
            class: self.effective_level(seq, now),
            key: 0,
        }
    }

    fn may_preempt(&self, waiting: SeqView<'_>, running: SeqView<'_>, now: Timestamp) -> bool {
        self.preempt && self.effective_level(waiting, now) < self.effective_level(running, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testutil::{request, run_step, seq};
    use crate::types::{RequestId, SchedulerConfig, StepPlan};
    use crate::Scheduler;

    fn mlfq() -> Mlfq {
        // Levels 0..4, quanta 4, 8, 16, 32 tokens; skip-join per 100 prompt tokens; aging
        // one level per millisecond waited.
        Mlfq::new(5, 4, 100, 1.0, true)
    }

    #[test]
    fn skip_join_places_longer_prompts_lower() {
        let m = mlfq();
        // floor(log2(1 + prompt / 100)).
        let joins: Vec<u32> = [0, 99, 100, 299, 300, 699, 700, 1_499, 1_500, 1_000_000]
            .iter()
            .map(|&p| m.join_level(p))
            .collect();
        assert_eq!(joins, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]);
    }

    #[test]
    fn a_request_moves_down_a_level_per_quantum_used_doubling_per_level() {
        let m = mlfq();
        // From level 0: 4 tokens at level 0, 8 at 1, 16 at 2, then 3 for ever after 28.
        let levels: Vec<u32> = [0, 3, 4, 11, 12, 27, 28, 59, 60, 10_000]
            .iter()
            .map(|&o| m.level_after(0, o))
            .collect();
        assert_eq!(levels, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]);
        // Joined at level 2: 16 tokens there, then 32 at 3.
        assert_eq!(m.level_after(2, 15), 2);
        assert_eq!(m.level_after(2, 16), 3);
        assert_eq!(m.level_after(2, 48), 4);
        // One level: nothing moves.
        let flat = Mlfq::new(1, 4, 100, 0.0, true);
        assert_eq!(flat.level_after(flat.join_level(10_000), 10_000), 0);
    }

    #[test]
    fn requests_age_from_their_arrival_waiting_or_running() {
        let m = mlfq();
        let mut s = seq(1, 1_000, 10);
        s.output = vec![7; 12];
        // 12 tokens: level 2. 2.5 ms after its arrival: level 0; 4 ms after: -2.
        assert_eq!(m.effective_level(SeqView::new(&s), Timestamp(1_000)), 2);
        assert_eq!(m.effective_level(SeqView::new(&s), Timestamp(3_500)), 0);
        s.state = crate::types::RequestState::Running;
        assert_eq!(m.effective_level(SeqView::new(&s), Timestamp(5_000)), -2);
        let off = Mlfq::new(5, 4, 100, 0.0, true);
        assert_eq!(off.effective_level(SeqView::new(&s), Timestamp(1 << 40)), 2);
    }

    #[test]
    fn parameters_are_bounded_and_named() {
        let create = |y: &str| Mlfq::create(&serde_yaml::from_str(y).unwrap(), &[]);
        assert!(create("{levels: 8, quantum_tokens: 64, prompt_tokens_per_level: 512, aging_interval_ms: 0, preempt: false}").is_ok());
        for (y, field) in [
            ("{levels: 0}", "levels"),
            ("{levels: 33}", "levels"),
            ("{quantum_tokens: 0}", "quantum_tokens"),
            ("{prompt_tokens_per_level: 0}", "prompt_tokens_per_level"),
            ("{aging_interval_ms: 0.0001}", "aging_interval_ms"),
            ("{aging_interval_ms: -1}", "aging_interval_ms"),
            ("{preempt: 1}", "preempt"),
            ("{quantum: 4}", "quantum"),
        ] {
            match create(y) {
                Err(PolicyError::InvalidParam { field: f, .. }) => assert_eq!(f, field, "{y}"),
                Err(e) => panic!("{y}: {e}"),
                Ok(_) => panic!("{y}: accepted"),
            }
        }
    }

    /// Through the scheduler: one seat. A long answer (request 1) runs alone and sinks; a
    /// short request arriving later joins level 0, evicts it, and finishes first; the long
    /// one then runs to its end with its output kept.
    /// One seat; request 1 (a 3-token prompt, up to 40 tokens) has run 10 steps when request 2
    /// (3 tokens, 3 at most) arrives: the plan of the step it arrives in.
    fn arrival_beside_a_sunk_answer(preempt: bool) -> (Scheduler, StepPlan) {
        let config = SchedulerConfig {
            max_num_seqs: 1,
            num_gpu_blocks: 64,
            block_size: 4,
            ..SchedulerConfig::default()
        };
        let aging_off = Mlfq::new(5, 4, 100, 0.0, preempt);
        let mut s = Scheduler::new(config, Box::new(aging_off), [1, 2]).unwrap();
        s.add_request(request(1, "", 0, vec![1, 2, 3], 40)).unwrap();
        for t in 0..10 {
            run_step(&mut s, t, 7);
        }
        // 10 tokens: level 1 (4 at level 0, 6 of 8 at level 1).
        s.add_request(request(2, "", 10, vec![4, 5, 6], 3)).unwrap();
        let (plan, _) = run_step(&mut s, 10, 7);
        (s, plan)
    }

    /// Through the scheduler: a long answer runs alone and sinks; a short request arriving
    /// later joins level 0, evicts it, and finishes first; the long one then runs to its end
    /// with its output kept. Without preemption the short one waits for the seat.
    #[test]
    fn a_short_request_overtakes_a_long_answer_that_has_sunk() {
        let (mut s, plan) = arrival_beside_a_sunk_answer(true);
        assert_eq!(plan.preempted, vec![RequestId(1)]);
        assert_eq!(
            plan.seqs.iter().map(|q| q.id).collect::<Vec<_>>(),
            [RequestId(2)]
        );
        let mut t = 11;
        while s
            .request_state(RequestId(2))
            .is_some_and(|st| !st.is_terminal())
        {
            run_step(&mut s, t, 7);
            t += 1;
        }
        assert!(s
            .request_state(RequestId(1))
            .is_some_and(|st| !st.is_terminal()));
        while s.has_unfinished() {
            run_step(&mut s, t, 7);
            t += 1;
            assert!(t < 200, "request 1 never finished");
        }
        assert_eq!(s.output_tokens(RequestId(1)).map(<[_]>::len), Some(40));
        let (_, plan) = arrival_beside_a_sunk_answer(false);
        assert!(plan.preempted.is_empty());
        assert_eq!(
            plan.seqs.iter().map(|q| q.id).collect::<Vec<_>>(),
            [RequestId(1)]
        );
    }
}
