//! SLO-aware scheduling after Niyama (Goel et al., "Niyama: Breaking the Silos of LLM
//! Inference Serving", arXiv 2503.22562), with goodput in DistServe's sense (requests that
//! meet both their TTFT and TPOT targets).
//!
//! Every request with a target has a deadline for its next milestone: the first token is
//! due at `arrival + ttft`, output token *n + 1* at `first_token + n · tpot`. Its slack is
//! that deadline minus now minus the estimated time to reach it (a linear step-cost model:
//! `step_overhead_ms` per step plus `prefill_us_per_token` per prompt token still to feed).
//!
//! * Ordering: least slack first among requests that can still make their deadline.
//! * Relegation: a request whose slack is negative can no longer make it; it moves behind
//!   every feasible request (earliest deadline first among the relegated), so one late
//!   request does not make others late too. Requests without targets follow, FCFS.
//! * Tier priority (a request's `priority`, lower first) orders each class but the feasible
//!   one: relegated requests by priority, then deadline; untargeted ones and preemptible
//!   tiers by priority, then arrival. Among requests that can still make their targets the
//!   slack alone decides (Niyama: a deadline is the tier's promise, whatever its priority).
//!   Running work that cannot make its target (or has none) yields to a waiting request of a
//!   strictly more urgent priority that ranks before it, as under `priority`; work that can
//!   still make its target is never preempted but by the tier flag below.
//! * Tiers marked `preemptible` in the scheduler's config go last, and any request of a tier
//!   that is not preemptible may preempt their running work when admission is blocked,
//!   relegated or untargeted ones included. Relegation orders the requests that are owed
//!   something among themselves (a lost cause goes behind every request that can still make
//!   its target, so it never takes their seats: the planner admits in rank order and stops at
//!   the first request it cannot seat); it does not hand a preemptible tier's seats back to
//!   that tier. A request already past its TTFT target when it arrives (a prompt whose
//!   prefill alone outlasts the target) would otherwise wait for a batch request to finish,
//!   later than under `priority`, which preempts.
//! * Slack-sized chunks: the step's token budget is what the tightest running decode can
//!   afford before its next token is due (at least one TPOT, so a late decode keeps the
//!   target pace), so prefill chunks grow when decodes have slack and shrink when they do
//!   not (never below `min_chunk_tokens` of prefill). The planner hands that budget out in
//!   rank order, waiting requests included, so a shrunk budget slows the lower-ranked
//!   prefills, not a waiting request ranked above them.

use crate::error::PolicyError;
use crate::policy::params::Params;
use crate::policy::{Policy, Rank, StepContext};
use crate::sequence::SeqView;
use crate::types::{TierSpec, Timestamp};

/// Registered name.
pub(crate) const NAME: &str = "slo-aware";

/// Rank class of requests that can still meet their deadline.
const FEASIBLE: i64 = 0;
/// Rank class of requests that missed (or will miss) their deadline.
const RELEGATED: i64 = 1;
/// Rank class of requests without a target (FCFS among themselves).
const NO_TARGET: i64 = 2;
/// Rank class of preemptible tiers.
const PREEMPTIBLE: i64 = 3;

/// Bits of a rank's class below the class itself: the request's priority, offset to be
/// non-negative (every `i32` fits in 33 bits), orders the classes but the feasible one.
const CLASS_SHIFT: u32 = 33;

/// A rank's class: `class` first, then the priority (lower first).
fn class_with_priority(class: i64, priority: i32) -> i64 {
    (class << CLASS_SHIFT) + (i64::from(priority) - i64::from(i32::MIN))
}

/// The class (`FEASIBLE` to `PREEMPTIBLE`) of a rank this policy gave.
fn class_of(rank: Rank) -> i64 {
    rank.class >> CLASS_SHIFT
}

/// Niyama-style deadline scheduling with relegation and slack-sized chunks.
#[derive(Clone, Debug)]
pub struct SloAware {
    /// Estimated fixed cost of one step, in microseconds.
    step_overhead_us: f64,
    /// Estimated prefill cost per token, in microseconds.
    prefill_us_per_token: f64,
    /// Smallest prefill chunk a step keeps room for even when decodes are tight.
    min_chunk_tokens: usize,
    /// Fraction of a decode's time to its next deadline that one step may use (headroom
    /// for cost-model error).
    pace_fraction: f64,
}

impl SloAware {
    /// A policy with the given step-cost estimates and `pace_fraction` 0.9.
    pub fn new(step_overhead_ms: f64, prefill_us_per_token: f64, min_chunk_tokens: usize) -> Self {
        Self {
            step_overhead_us: step_overhead_ms * 1e3,
            prefill_us_per_token,
            min_chunk_tokens,
            pace_fraction: 0.9,
        }
    }

    /// Builds the policy from `{step_overhead_ms, prefill_us_per_token, min_chunk_tokens,
    /// pace_fraction}` (defaults 8, 25, 256 and 0.9: roughly Llama-3-8B on one H200).
    pub fn create(
        params: &serde_yaml::Value,
        _tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        let p = Params::new(
            NAME,
            params,
            &[
                "step_overhead_ms",
                "prefill_us_per_token",
                "min_chunk_tokens",
                "pace_fraction",
            ],
        )?;
        let overhead = p.f64_in("step_overhead_ms", 8.0, 0.0, 1e6)?;
        let per_token = p.f64_in("prefill_us_per_token", 25.0, 1e-6, 1e9)?;
        let min_chunk = p.u64_in("min_chunk_tokens", 256, 1, 1 << 24)? as usize;
        let pace = p.f64_in("pace_fraction", 0.9, 0.05, 1.0)?;
        Ok(Box::new(Self {
            pace_fraction: pace,
            ..Self::new(overhead, per_token, min_chunk)
        }))
    }

    /// Deadline of the next milestone (first token or next token), if the request has a target.
    pub fn deadline(&self, seq: SeqView<'_>) -> Option<Timestamp> {
        match seq.first_token_at() {
            None => {
                let ttft = seq.slo().ttft_ms?;
                Some(seq.arrival().saturating_add(ms_to_us(ttft)))
            }
            Some(first) => {
                let tpot = seq.slo().tpot_ms?;
                let n = seq.num_output_tokens() as f64;
                Some(first.saturating_add(ms_to_us(tpot * n)))
            }
        }
    }

    /// Estimated microseconds until the next milestone if served from now on.
    fn work_us(&self, seq: SeqView<'_>) -> f64 {
        let prefill = match seq.num_uncomputed_tokens() {
            0 | 1 => 0.0,
            n => n as f64,
        };
        self.step_overhead_us + prefill * self.prefill_us_per_token
    }

    /// Slack in microseconds (negative when the deadline can no longer be met).
    pub fn slack_us(&self, seq: SeqView<'_>, now: Timestamp) -> Option<i64> {
        let d = self.deadline(seq)?;
        Some(d.0 as i64 - now.0 as i64 - self.work_us(seq) as i64)
    }
}

fn ms_to_us(ms: f64) -> u64 {
    if ms.is_finite() && ms > 0.0 {
        (ms * 1e3).min(u64::MAX as f64) as u64
    } else {
        0
    }
}

impl Policy for SloAware {
    fn name(&self) -> &str {
        NAME
    }

    fn rank(&self, seq: SeqView<'_>, now: Timestamp) -> Rank {
        let priority = seq.priority();
        if seq.preemptible() {
            return Rank {
                class: class_with_priority(PREEMPTIBLE, priority),
                key: 0,
            };
        }
        match (self.slack_us(seq, now), self.deadline(seq)) {
            (Some(slack), _) if slack >= 0 => Rank {
                class: FEASIBLE << CLASS_SHIFT,
                key: slack,
            },
            (Some(_), Some(d)) => Rank {
                class: class_with_priority(RELEGATED, priority),
                key: d.0 as i64,
            },
            _ => Rank {
                class: class_with_priority(NO_TARGET, priority),
                key: 0,
            },
        }
    }

    /// Running work of a preemptible tier yields to any request of a tier that is not: the
    /// waiting request's slack does not matter (see the module's notes on relegation). Running
    /// work that cannot make its target (or has none) yields to a request of a strictly more
    /// urgent priority that ranks before it. A request that can still make its target is
    /// never a victim but of a preemptible tier, and since both rules need the waiting request
    /// to be the more urgent one (by tier flag or by priority), two requests never preempt
    /// each other in turn.
    fn may_preempt(&self, waiting: SeqView<'_>, running: SeqView<'_>, now: Timestamp) -> bool {
        if running.preemptible() && !waiting.preemptible() {
            return true;
        }
        if waiting.priority() >= running.priority() {
            return false;
        }
        let r = self.rank(running, now);
        class_of(r) != FEASIBLE && self.rank(waiting, now) < r
    }

    fn token_budget(&self, ctx: &StepContext<'_>) -> usize {
        let mut decodes = 0usize;
        let mut tightest: Option<f64> = None;
        for s in ctx.running() {
            if s.is_prefill() {
                continue;
            }
            decodes += 1;
            if s.preemptible() {
                continue;
            }
            let (Some(d), Some(tpot)) = (self.deadline(s), s.slo().tpot_ms) else {
                continue;
            };
            // Time this step may take: until the next token is due, but never less than one
            // TPOT, so a decode that is already late keeps the target pace from now on.
            let left = (d.0 as f64 - ctx.now.0 as f64).max(tpot * 1e3) * self.pace_fraction;
            tightest = Some(tightest.map_or(left, |t| t.min(left)));
        }
        let Some(left) = tightest else {
            return ctx.max_num_batched_tokens;
        };
        // Every token of the step (decodes included) costs `prefill_us_per_token`.
        let affordable = ((left - self.step_overhead_us) / self.prefill_us_per_token).max(0.0);
        (affordable as usize)
            .max(decodes.saturating_add(self.min_chunk_tokens))
            .min(ctx.max_num_batched_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testutil::{decoding, seq};
    use crate::sequence::Sequence;
    use crate::types::{RequestState, SloTargets};

    fn policy() -> SloAware {
        // 1 ms per step, 10 us per prefill token, chunks of at least 8 tokens.
        SloAware::new(1.0, 10.0, 8)
    }

    fn with_slo(mut s: Sequence, ttft: Option<f64>, tpot: Option<f64>) -> Sequence {
        s.slo = SloTargets {
            ttft_ms: ttft,
            tpot_ms: tpot,
        };
        s
    }

    #[test]
    fn ttft_slack_counts_prefill_work() {
        // Arrives at 0 with 101 prompt tokens and a 10 ms TTFT; at t = 2 ms the slack is
        // 10000 - 2000 - (1000 + 101 * 10) = 5990 us.
        let s = with_slo(seq(1, 0, 101), Some(10.0), None);
        assert_eq!(
            policy().slack_us(SeqView::new(&s), Timestamp(2_000)),
            Some(5_990)
        );
    }

    #[test]
    fn tpot_deadline_follows_first_token() {
        // First token at 5 ms, 3 outputs, 20 ms TPOT: the 4th token is due at 65 ms.
        let s = with_slo(decoding(seq(1, 0, 10), 3, 5_000), Some(10.0), Some(20.0));
        assert_eq!(policy().deadline(SeqView::new(&s)), Some(Timestamp(65_000)));
    }

    #[test]
    fn orders_feasible_by_slack_then_relegated_then_untargeted_then_preemptible() {
        let p = policy();
        let now = Timestamp(10_000);
        let tight = with_slo(seq(1, 0, 1), Some(13.0), None); // slack 13000-10000-1000 = 2000
        let loose = with_slo(seq(2, 0, 1), Some(50.0), None); // slack 39000
        let late = with_slo(seq(3, 0, 1), Some(5.0), None); // deadline passed
        let none = seq(4, 0, 1);
        let mut batch = with_slo(seq(5, 0, 1), Some(100.0), None);
        batch.preemptible = true;
        let ranks: Vec<Rank> = [&tight, &loose, &late, &none, &batch]
            .iter()
            .map(|s| p.rank(SeqView::new(s), now))
            .collect();
        assert_eq!((class_of(ranks[0]), ranks[0].key), (FEASIBLE, 2_000));
        assert_eq!((class_of(ranks[1]), ranks[1].key), (FEASIBLE, 39_000));
        assert_eq!((class_of(ranks[2]), ranks[2].key), (RELEGATED, 5_000));
        assert_eq!(class_of(ranks[3]), NO_TARGET);
        assert_eq!(class_of(ranks[4]), PREEMPTIBLE);
        assert!(ranks.windows(2).all(|w| w[0] < w[1]), "{ranks:?}");
    }

    #[test]
    fn any_request_of_a_tier_that_is_not_preemptible_may_preempt_preemptible_tiers() {
        let p = policy();
        let now = Timestamp(50_000);
        // Feasible: due at 100 ms, 1 ms of work (a step; its one token is not prefill).
        let feasible = with_slo(seq(1, 0, 1), Some(100.0), None);
        // Relegated: 128 prompt tokens at 10 us each and 1 ms a step outlast its 2 ms TTFT
        // from arrival (a premium prompt whose prefill alone is longer than the target).
        let relegated = with_slo(seq(2, 50_000, 128), Some(2.0), None);
        let untargeted = seq(3, 0, 1);
        assert_eq!(class_of(p.rank(SeqView::new(&feasible), now)), FEASIBLE);
        assert_eq!(class_of(p.rank(SeqView::new(&relegated), now)), RELEGATED);
        assert_eq!(class_of(p.rank(SeqView::new(&untargeted), now)), NO_TARGET);
        let mut batch = decoding(seq(4, 0, 1), 1, 0);
        batch.preemptible = true;
        // A running request of a tier that is not preemptible, with a target or without.
        let other = with_slo(decoding(seq(5, 0, 1), 1, 0), None, Some(1000.0));
        let plain = decoding(seq(6, 0, 1), 1, 0);
        for w in [&feasible, &relegated, &untargeted] {
            let w = SeqView::new(w);
            assert!(p.may_preempt(w, SeqView::new(&batch), now));
            assert!(!p.may_preempt(w, SeqView::new(&other), now));
            assert!(!p.may_preempt(w, SeqView::new(&plain), now));
        }
        // A preemptible tier's waiting work preempts nothing, its own tier's included.
        let mut waiting_batch = with_slo(seq(7, 0, 1), Some(100.0), None);
        waiting_batch.preemptible = true;
        for r in [&batch, &other, &plain] {
            assert!(!p.may_preempt(SeqView::new(&waiting_batch), SeqView::new(r), now));
        }
    }

    proptest::proptest! {
        /// Whatever the targets, priorities, arrivals, progress and clock: a request may preempt
        /// exactly the running work of a preemptible tier when its own tier is not preemptible,
        /// and running work without a feasible target of a strictly worse priority that ranks
        /// after it; a victim always ranks after it (the planner only takes victims that rank
        /// after the waiting request), and no two requests may preempt each other.
        #[test]
        fn preemption_follows_the_tier_flag_and_the_rank(
            specs in proptest::collection::vec(
                (
                    proptest::bool::ANY,
                    proptest::option::of(1u32..5_000),
                    proptest::option::of(1u32..500),
                    0u64..10_000_000,
                    1usize..4096,
                    proptest::option::of((0usize..64, 0u64..10_000_000)),
                    -2i32..3,
                ),
                2..8,
            ),
            now in 0u64..20_000_000,
        ) {
            let p = policy();
            let now = Timestamp(now);
            let seqs: Vec<Sequence> = specs
                .iter()
                .enumerate()
                .map(|(i, &(preemptible, ttft, tpot, arrival, prompt, progress, priority))| {
                    let s = seq(i as u64 + 1, arrival, prompt);
                    let mut s = match progress {
                        Some((outputs, first)) => decoding(s, outputs + 1, arrival + first),
                        None => s,
                    };
                    s.preemptible = preemptible;
                    s.req.priority = priority;
                    with_slo(s, ttft.map(f64::from), tpot.map(f64::from))
                })
                .collect();
            for w in &seqs {
                for r in &seqs {
                    let (wv, rv) = (SeqView::new(w), SeqView::new(r));
                    let may = p.may_preempt(wv, rv, now);
                    let (wr, rr) = (p.rank(wv, now), p.rank(rv, now));
                    let by_priority = w.req.priority < r.req.priority
                        && class_of(rr) != FEASIBLE
                        && wr < rr;
                    proptest::prop_assert_eq!(
                        may,
                        (r.preemptible && !w.preemptible) || by_priority
                    );
                    if class_of(rr) == FEASIBLE && !r.preemptible {
                        // Work that can still make its target is never a victim.
                        proptest::prop_assert!(!may);
                    }
                    if may {
                        proptest::prop_assert!(p.rank(wv, now) < p.rank(rv, now));
                        proptest::prop_assert!(!p.may_preempt(rv, wv, now));
                    }
                }
            }
        }
    }

    #[test]
    fn tier_priority_orders_every_class_but_the_feasible_one() {
        let p = policy();
        let now = Timestamp(10_000);
        let with_priority = |mut s: Sequence, priority: i32| {
            s.req.priority = priority;
            s
        };
        // Feasible: slack decides, whatever the priority.
        let tight_low = with_priority(with_slo(seq(1, 0, 1), Some(13.0), None), 5);
        let loose_high = with_priority(with_slo(seq(2, 0, 1), Some(50.0), None), 0);
        // Relegated: priority first, then the deadline.
        let late_high = with_priority(with_slo(seq(3, 0, 1), Some(8.0), None), 0);
        let later_low = with_priority(with_slo(seq(4, 0, 1), Some(5.0), None), 1);
        // Untargeted and preemptible: priority, then arrival (the planner's tie-break).
        let none_high = with_priority(seq(5, 9_000, 1), 0);
        let none_low = with_priority(seq(6, 0, 1), 1);
        let mut batch_high = with_priority(seq(7, 9_000, 1), 2);
        batch_high.preemptible = true;
        let mut batch_low = with_priority(seq(8, 0, 1), 3);
        batch_low.preemptible = true;
        let order = [
            &tight_low,
            &loose_high,
            &late_high,
            &later_low,
            &none_high,
            &none_low,
            &batch_high,
            &batch_low,
        ];
        let ranks: Vec<Rank> = order.iter().map(|s| p.rank(SeqView::new(s), now)).collect();
        assert!(ranks.windows(2).all(|w| w[0] < w[1]), "{ranks:?}");
        let classes: Vec<i64> = ranks.iter().map(|&r| class_of(r)).collect();
        assert_eq!(
            classes,
            [
                FEASIBLE,
                FEASIBLE,
                RELEGATED,
                RELEGATED,
                NO_TARGET,
                NO_TARGET,
                PREEMPTIBLE,
                PREEMPTIBLE
            ]
        );
        // The most and least urgent priorities keep the classes apart.
        let extreme = |priority, preemptible| {
            let mut s = with_priority(seq(9, 0, 1), priority);
            s.preemptible = preemptible;
            p.rank(SeqView::new(&s), now)
        };
        assert!(extreme(i32::MAX, false) < extreme(i32::MIN, true));
        let relegated_worst = with_priority(with_slo(seq(10, 0, 1), Some(5.0), None), i32::MAX);
        assert!(p.rank(SeqView::new(&relegated_worst), now) < extreme(i32::MIN, false));
    }

    #[test]
    fn a_more_urgent_tier_preempts_late_or_untargeted_work_never_feasible_work() {
        let p = policy();
        let now = Timestamp(50_000);
        let with_priority = |mut s: Sequence, priority: i32| {
            s.req.priority = priority;
            s
        };
        // Waiting premium (priority 0), relegated: its 2 ms target is past.
        let premium = with_priority(with_slo(seq(1, 40_000, 128), Some(2.0), None), 0);
        // Running standard-tier work (priority 1, not preemptible): untargeted, relegated
        // (its next token was due at 20 ms) and feasible (due at 1 s).
        let untargeted = with_priority(decoding(seq(2, 0, 1), 1, 0), 1);
        let late = with_priority(with_slo(decoding(seq(3, 0, 1), 2, 0), None, Some(10.0)), 1);
        let feasible = with_priority(
            with_slo(decoding(seq(4, 0, 1), 1, 0), None, Some(1000.0)),
            1,
        );
        let w = SeqView::new(&premium);
        assert!(p.may_preempt(w, SeqView::new(&untargeted), now));
        assert!(p.may_preempt(w, SeqView::new(&late), now));
        assert!(!p.may_preempt(w, SeqView::new(&feasible), now));
        // The same priority preempts nothing, nor does a less urgent one.
        let peer = with_priority(with_slo(seq(5, 40_000, 128), Some(2.0), None), 1);
        assert!(!p.may_preempt(SeqView::new(&peer), SeqView::new(&untargeted), now));
        assert!(!p.may_preempt(SeqView::new(&untargeted), SeqView::new(&premium), now));
    }

    #[test]
    fn every_documented_parameter_is_taken() {
        // README's policy table: step_overhead_ms, prefill_us_per_token, min_chunk_tokens,
        // pace_fraction (this one was refused as unknown).
        let v: serde_yaml::Value = serde_yaml::from_str(
            "{step_overhead_ms: 2, prefill_us_per_token: 4, min_chunk_tokens: 16, \
             pace_fraction: 0.5}",
        )
        .unwrap();
        let p = SloAware::create(&v, &[]).unwrap();
        assert_eq!(p.name(), NAME);
        let want = SloAware {
            pace_fraction: 0.5,
            ..SloAware::new(2.0, 4.0, 16)
        };
        // The parameters only show through the budget: a decode due in 10 ms at t = 0, 5 ms
        // TPOT: (10000 * 0.5 - 2000) / 4 = 750 tokens.
        let a = with_slo(decoding(seq(1, 0, 4), 2, 0), None, Some(5.0));
        let seqs = vec![Some(a)];
        let ctx = StepContext {
            now: Timestamp(0),
            max_num_batched_tokens: 8192,
            max_num_seqs: 8,
            seqs: &seqs,
            running: &[0],
        };
        assert_eq!(p.token_budget(&ctx), 750);
        assert_eq!(want.token_budget(&ctx), 750);
        // min_chunk_tokens: when nothing is affordable, one decode plus 16.
        let late = StepContext {
            now: Timestamp(100_000),
            ..ctx
        };
        let v: serde_yaml::Value =
            serde_yaml::from_str("{step_overhead_ms: 50, min_chunk_tokens: 16}").unwrap();
        let tight = SloAware::create(&v, &[]).unwrap();
        assert_eq!(tight.token_budget(&late), 1 + 16);
        // Out of range is refused, naming the field.
        let bad: serde_yaml::Value = serde_yaml::from_str("{pace_fraction: 2}").unwrap();
        let e = SloAware::create(&bad, &[]).err().unwrap().to_string();
        assert!(e.contains("pace_fraction"), "{e}");
    }

    #[test]
    fn budget_is_sized_by_the_tightest_decode() {
        let p = policy();
        // a: first token at 0, 2 outputs, 5 ms TPOT: the next token is due at 10 ms.
        // At t = 2 ms it has 8000 us, 0.9 of it usable: (7200 - 1000) / 10 = 620 tokens.
        let a = with_slo(decoding(seq(1, 0, 4), 2, 0), None, Some(5.0));
        let b = with_slo(decoding(seq(2, 0, 4), 1, 0), None, Some(50.0));
        let seqs = vec![Some(a), Some(b)];
        let running = [0u32, 1];
        let ctx = StepContext {
            now: Timestamp(2_000),
            max_num_batched_tokens: 8192,
            max_num_seqs: 8,
            seqs: &seqs,
            running: &running,
        };
        assert_eq!(p.token_budget(&ctx), 620);
        // At 20 ms a is late: the step may take 0.9 TPOT, (4500 - 1000) / 10 = 350.
        let late = StepContext {
            now: Timestamp(20_000),
            ..ctx
        };
        assert_eq!(p.token_budget(&late), 350);
        // When even one TPOT does not cover the step overhead, the minimum chunk remains.
        let slow = SloAware::new(6.0, 10.0, 8);
        assert_eq!(slow.token_budget(&late), 2 + 8);
        // Without running decodes with a TPOT target the configured limit applies.
        let none = StepContext {
            running: &[],
            ..ctx
        };
        assert_eq!(p.token_budget(&none), 8192);
        assert_eq!(
            seqs[0].as_ref().map(|s| s.state),
            Some(RequestState::Running)
        );
    }
}
