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
//! * A reserve for targeted arrivals (requests with a TTFT target, of a tier that is not
//!   preemptible): a request that arrives during a step waits it out, so while a targeted
//!   request is present, and for a window after the last one arrived or left, steps are
//!   bounded. While targeted requests wait for their first token, a step may last until the
//!   tightest of them is due (Niyama's TTFT-sized chunks: a loose target lets a long step of
//!   batch prefills run before the first token rather than between its decodes); otherwise
//!   half the tightest recent TTFT target, so that the step an arrival waits out and its own
//!   first step share the target, but never less than the estimated first step of the
//!   shortest recent targeted prompt (from its admission on, what its prefix-cache hit left
//!   to compute; where half the target cannot hold that step, the target
//!   is missed whatever the bound, and shorter steps only multiply the fixed cost per step for
//!   the batch work). Both times `pace_fraction`, and never below the whole
//!   remaining prompts of the targeted requests still waiting for their first token (a
//!   bounded step does not chunk them) or `min_chunk_tokens`, plus the decodes. The window is
//!   three times the mean idle gap seen so far (from the moment no targeted request was
//!   present to the next targeted arrival, smoothed; for Poisson arrivals the next one comes
//!   within it 95 % of the time), at least the tightest TTFT target (a closed-loop client's
//!   turnaround) and at most `reserve_window_ms` (also the window before any idle gap is
//!   seen; 0 turns the reserve off), so a steady stream of targeted requests keeps its short
//!   steps between requests while a period without them gets the full budget. Times come
//!   from the events the policy observes (an arrival at its arrival time, a departure at its
//!   last token, or its arrival if it had none) and the planning clock: the policy holds no
//!   clock. The bound looks at the waiting queue, O(waiting) a step, only while it is active.

use crate::error::PolicyError;
use crate::policy::params::Params;
use crate::policy::{Policy, PolicyEvent, Rank, StepContext};
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

/// Mean idle gaps (no targeted request present until the next targeted arrival) that the
/// reserve outlasts the last targeted arrival or departure by (capped by `reserve_window_ms`).
const RESERVE_GAPS: f64 = 3.0;
/// Weight of the newest idle gap in the smoothed one.
const GAP_SMOOTHING: f64 = 0.25;
/// Default `reserve_window_ms`.
const DEFAULT_RESERVE_WINDOW_MS: f64 = 10_000.0;
/// Largest `reserve_window_ms` (an hour).
const MAX_RESERVE_WINDOW_MS: f64 = 3_600_000.0;

/// What the policy remembers of the requests the reserve keeps room for: those with a TTFT
/// target, of a tier that is not preemptible ("targeted" below).
#[derive(Clone, Debug, Default)]
struct Reserve {
    /// Targeted requests that arrived and have not departed.
    live: usize,
    /// Latest arrival or departure of a targeted request.
    last_event: Option<Timestamp>,
    /// Smoothed idle gap (from the last targeted departure with none left to the next targeted
    /// arrival), in microseconds.
    mean_idle_us: Option<f64>,
    /// Tightest TTFT target (ms) of the targeted requests since the reserve last lapsed.
    ttft_ms: f64,
    /// Shortest prompt (tokens; from a request's admission, those its prefix-cache hit left
    /// to compute) of the targeted requests since the reserve last lapsed.
    prompt_tokens: usize,
}

/// The TTFT target the reserve keeps room for, if `seq` is targeted.
fn reserve_ttft_ms(seq: SeqView<'_>) -> Option<f64> {
    if seq.preemptible() {
        return None;
    }
    seq.slo().ttft_ms.filter(|t| t.is_finite() && *t > 0.0)
}

/// Niyama-style deadline scheduling with relegation, slack-sized chunks and a reserve for
/// targeted arrivals.
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
    /// Longest the reserve outlasts the last targeted arrival or departure, in microseconds
    /// (0: no reserve).
    reserve_window_us: u64,
    /// What the reserve knows of targeted requests.
    reserve: Reserve,
}

impl SloAware {
    /// A policy with the given step-cost estimates, `pace_fraction` 0.9 and `reserve_window_ms`
    /// 10,000.
    pub fn new(step_overhead_ms: f64, prefill_us_per_token: f64, min_chunk_tokens: usize) -> Self {
        Self {
            step_overhead_us: step_overhead_ms * 1e3,
            prefill_us_per_token,
            min_chunk_tokens,
            pace_fraction: 0.9,
            reserve_window_us: ms_to_us(DEFAULT_RESERVE_WINDOW_MS),
            reserve: Reserve::default(),
        }
    }

    /// The same policy with the reserve's longest window (0: no reserve).
    pub fn with_reserve_window_ms(mut self, ms: f64) -> Self {
        self.reserve_window_us = ms_to_us(ms);
        self
    }

    /// Builds the policy from `{step_overhead_ms, prefill_us_per_token, min_chunk_tokens,
    /// pace_fraction, reserve_window_ms}` (defaults 8, 25, 256, 0.9 and 10,000: the first two
    /// roughly Llama-3-8B on one H200).
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
                "reserve_window_ms",
            ],
        )?;
        let overhead = p.f64_in("step_overhead_ms", 8.0, 0.0, 1e6)?;
        let per_token = p.f64_in("prefill_us_per_token", 25.0, 1e-6, 1e9)?;
        let min_chunk = p.u64_in("min_chunk_tokens", 256, 1, 1 << 24)? as usize;
        let pace = p.f64_in("pace_fraction", 0.9, 0.05, 1.0)?;
        let window = p.f64_in(
            "reserve_window_ms",
            DEFAULT_RESERVE_WINDOW_MS,
            0.0,
            MAX_RESERVE_WINDOW_MS,
        )?;
        Ok(Box::new(Self {
            pace_fraction: pace,
            ..Self::new(overhead, per_token, min_chunk).with_reserve_window_ms(window)
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
        self.first_step_us(seq.num_uncomputed_tokens())
    }

    /// Estimated microseconds of a step that feeds `uncomputed` prompt tokens of one request
    /// (none when at most its next token is left).
    fn first_step_us(&self, uncomputed: usize) -> f64 {
        let prefill = match uncomputed {
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

    /// Tokens a step that may take `left_us` affords (every token, decodes included, at
    /// `prefill_us_per_token`).
    fn affordable(&self, left_us: f64) -> usize {
        ((left_us - self.step_overhead_us) / self.prefill_us_per_token).max(0.0) as usize
    }

    /// How long the reserve outlasts the last targeted arrival or departure, in microseconds.
    fn reserve_window_us(&self) -> u64 {
        let cap = self.reserve_window_us;
        match self.reserve.mean_idle_us {
            Some(idle) => ((idle * RESERVE_GAPS) as u64)
                .max(ms_to_us(self.reserve.ttft_ms))
                .min(cap),
            None => cap,
        }
    }

    /// Whether the reserve bounds a step planned at `now`.
    fn reserve_active(&self, now: Timestamp) -> bool {
        if self.reserve_window_us == 0 {
            return false;
        }
        let r = &self.reserve;
        r.live > 0
            || r.last_event
                .is_some_and(|t| now.0 < t.0.saturating_add(self.reserve_window_us()))
    }

    /// The reserve's bound on a step planned at `ctx.now` with `decodes` running decodes, if
    /// it is active. While targeted requests wait for their first token, the step may last
    /// until the tightest of them is due (times `pace_fraction`); otherwise half the tightest
    /// recent TTFT target, or the first step of the shortest recent targeted prompt if that is
    /// longer (times `pace_fraction`). Either way it keeps room for the whole remaining
    /// prompts of those requests (or `min_chunk_tokens`, if more) besides the decodes.
    fn reserve_budget(&self, ctx: &StepContext<'_>, decodes: usize) -> Option<usize> {
        if !self.reserve_active(ctx.now) {
            return None;
        }
        let mut pending = 0usize;
        let mut due: Option<f64> = None;
        for s in ctx.running().chain(ctx.waiting()) {
            if s.first_token_at().is_some() || reserve_ttft_ms(s).is_none() {
                continue;
            }
            pending = pending.saturating_add(s.num_uncomputed_tokens());
            if let Some(d) = self.deadline(s) {
                let left = (d.0 as f64 - ctx.now.0 as f64).max(0.0);
                due = Some(due.map_or(left, |t| t.min(left)));
            }
        }
        let left = due.unwrap_or_else(|| self.idle_bound_us()) * self.pace_fraction;
        Some(
            self.affordable(left)
                .max(decodes.saturating_add(pending.max(self.min_chunk_tokens))),
        )
    }

    /// How long a step may last while no targeted request waits for its first token (before
    /// `pace_fraction`): half the tightest recent TTFT target, so that the step an arrival
    /// waits out and its own first step share the target; but never below the first step of
    /// the shortest recent targeted prompt. When half the target cannot hold that step, the
    /// target is missed whatever the bound (the wait and the arrival's own step outlast it),
    /// and shorter steps only multiply their fixed cost for the batch work: an arrival then
    /// waits out at most a step as long as its own.
    fn idle_bound_us(&self) -> f64 {
        let r = &self.reserve;
        (r.ttft_ms * 1e3 * 0.5).max(self.first_step_us(r.prompt_tokens))
    }

    /// A targeted request arrived.
    fn reserve_arrived(&mut self, seq: SeqView<'_>, ttft_ms: f64) {
        let at = seq.arrival();
        let lapsed = !self.reserve_active(at);
        let r = &mut self.reserve;
        if let (0, Some(last)) = (r.live, r.last_event) {
            let idle = at.0.saturating_sub(last.0) as f64;
            r.mean_idle_us = Some(match r.mean_idle_us {
                Some(m) => m + GAP_SMOOTHING * (idle - m),
                None => idle,
            });
        }
        r.last_event = Some(r.last_event.map_or(at, |t| t.max(at)));
        (r.ttft_ms, r.prompt_tokens) = if lapsed || r.ttft_ms <= 0.0 {
            (ttft_ms, seq.prompt_len())
        } else {
            (
                r.ttft_ms.min(ttft_ms),
                r.prompt_tokens.min(seq.prompt_len()),
            )
        };
        r.live = r.live.saturating_add(1);
    }

    /// A targeted request departed: at its last token (or its arrival if it had none).
    fn reserve_departed(&mut self, seq: SeqView<'_>) {
        let at = [seq.first_token_at(), seq.last_token_at()]
            .into_iter()
            .flatten()
            .fold(seq.arrival(), Timestamp::max);
        let r = &mut self.reserve;
        r.live = r.live.saturating_sub(1);
        r.last_event = Some(r.last_event.map_or(at, |t| t.max(at)));
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
        let paced = tightest.map(|left| {
            self.affordable(left)
                .max(decodes.saturating_add(self.min_chunk_tokens))
        });
        let reserved = self.reserve_budget(ctx, decodes);
        paced
            .into_iter()
            .chain(reserved)
            .min()
            .unwrap_or(ctx.max_num_batched_tokens)
            .min(ctx.max_num_batched_tokens)
    }

    /// Keeps the reserve's account of targeted requests (see the module's notes).
    fn observe(&mut self, event: PolicyEvent<'_>) {
        match event {
            PolicyEvent::Arrived(seq) => {
                if let Some(ttft) = reserve_ttft_ms(seq) {
                    self.reserve_arrived(seq, ttft);
                }
            }
            PolicyEvent::Admitted(seq) if reserve_ttft_ms(seq).is_some() => {
                // Its prefix-cache hit is known now: the first step is what the prompt left
                // to compute (a long cached system prompt or conversation makes it short).
                let r = &mut self.reserve;
                if r.live > 0 {
                    r.prompt_tokens = r.prompt_tokens.min(seq.num_uncomputed_tokens());
                }
            }
            PolicyEvent::Departed(seq) if reserve_ttft_ms(seq).is_some() => {
                self.reserve_departed(seq);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testutil::{decoding, prefilling, seq};
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
            waiting: &[],
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
        for (bad, field) in [
            ("{pace_fraction: 2}", "pace_fraction"),
            ("{reserve_window_ms: -1}", "reserve_window_ms"),
            ("{reserve_window_ms: 3600001}", "reserve_window_ms"),
        ] {
            let bad: serde_yaml::Value = serde_yaml::from_str(bad).unwrap();
            let e = SloAware::create(&bad, &[]).err().unwrap().to_string();
            assert!(e.contains(field), "{e}");
        }
        // reserve_window_ms: 0 keeps no reserve after a targeted request left.
        let v: serde_yaml::Value = serde_yaml::from_str("{reserve_window_ms: 0}").unwrap();
        let mut off = SloAware::create(&v, &[]).unwrap();
        let mut on = SloAware::create(&serde_yaml::Value::Null, &[]).unwrap();
        let premium = with_slo(seq(2, 0, 4), Some(100.0), None);
        for p in [&mut off, &mut on] {
            p.observe(PolicyEvent::Arrived(SeqView::new(&premium)));
            p.observe(PolicyEvent::Departed(SeqView::new(&premium)));
        }
        let empty: Vec<Option<Sequence>> = Vec::new();
        let idle = StepContext {
            now: Timestamp(1_000),
            max_num_batched_tokens: 8192,
            max_num_seqs: 8,
            seqs: &empty,
            running: &[],
            waiting: &[],
        };
        assert_eq!(off.token_budget(&idle), 8192);
        // Defaults (8 ms a step, 25 us a token): (100 ms / 2 * 0.9 - 8 ms) / 25 us = 1,480.
        assert_eq!(on.token_budget(&idle), 1_480);
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
            waiting: &[],
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

    /// A step context at `now` (microseconds) with `max` tokens a step.
    fn ctx_at<'a>(
        seqs: &'a [Option<Sequence>],
        running: &'a [u32],
        waiting: &'a [u32],
        now: u64,
        max: usize,
    ) -> StepContext<'a> {
        StepContext {
            now: Timestamp(now),
            max_num_batched_tokens: max,
            max_num_seqs: 8,
            seqs,
            running,
            waiting,
        }
    }

    /// `s` departs having produced its first token at `at_us`.
    fn depart(p: &mut SloAware, s: &Sequence, at_us: u64) {
        let done = decoding(s.clone(), 1, at_us);
        p.observe(PolicyEvent::Departed(SeqView::new(&done)));
    }

    #[test]
    fn the_reserve_keeps_short_steps_for_a_window_after_the_last_targeted_request() {
        let mut p = policy();
        let none: Vec<Option<Sequence>> = Vec::new();
        let idle = |now| ctx_at(&none, &[], &[], now, 32_768);
        // Nothing targeted seen yet: the full budget.
        assert_eq!(p.token_budget(&idle(0)), 32_768);
        // Requests without a TTFT target, or of a preemptible tier, keep no reserve.
        let plain = seq(1, 0, 4);
        let tpot_only = with_slo(seq(2, 0, 4), None, Some(5.0));
        let mut batch = with_slo(seq(3, 0, 4), Some(100.0), None);
        batch.preemptible = true;
        for s in [&plain, &tpot_only, &batch] {
            p.observe(PolicyEvent::Arrived(SeqView::new(s)));
        }
        assert_eq!(p.token_budget(&idle(1_000)), 32_768);
        // A premium request (100 ms TTFT) arrives at 0: while it is present (here it is not
        // among the step's sequences, as once it has its first token) a step may take half
        // its target: (100 ms / 2 * 0.9 - 1 ms) / 10 us = 4,400 tokens.
        let premium = with_slo(seq(4, 0, 4), Some(100.0), None);
        p.observe(PolicyEvent::Arrived(SeqView::new(&premium)));
        assert_eq!(p.token_budget(&idle(5_000)), 4_400);
        // It never raises a budget the decodes' pace shrank: a decode with a 5 ms TPOT due at
        // 10 ms affords 620 tokens at 2 ms (see budget_is_sized_by_the_tightest_decode).
        let fast = with_slo(decoding(seq(5, 0, 4), 2, 0), None, Some(5.0));
        // A targeted request waiting for its first token sizes the step by its own deadline
        // (100 ms): at 5 ms, (95 ms * 0.9 - 1 ms) / 10 us = 8,450 tokens; and it keeps room for
        // its whole prompt when that is more: at 95 ms, 6,000 tokens, not 350.
        let long = with_slo(seq(6, 0, 6_000), Some(100.0), None);
        p.observe(PolicyEvent::Arrived(SeqView::new(&long)));
        let seqs = vec![Some(fast), Some(long.clone())];
        assert_eq!(
            p.token_budget(&ctx_at(&seqs, &[0], &[], 2_000, 32_768)),
            620
        );
        assert_eq!(
            p.token_budget(&ctx_at(&seqs, &[], &[1], 5_000, 32_768)),
            8_450
        );
        assert_eq!(
            p.token_budget(&ctx_at(&seqs, &[], &[1], 95_000, 32_768)),
            6_000
        );
        // Running (a prefill chunk done) it counts the same way, its remaining prompt only.
        let mut seqs = seqs;
        seqs[1] = Some(prefilling(long.clone(), 1_000));
        assert_eq!(
            p.token_budget(&ctx_at(&seqs, &[1], &[], 95_000, 32_768)),
            5_000
        );
        // Both leave, the last with its first token at 300 ms. No idle gap is known yet (no
        // targeted request arrived after the last one left), so the reserve lasts the cap, 10 s.
        depart(&mut p, &long, 200_000);
        depart(&mut p, &premium, 300_000);
        assert_eq!(p.reserve.live, 0);
        assert_eq!(p.token_budget(&idle(10_299_999)), 4_400);
        assert_eq!(p.token_budget(&idle(10_300_000)), 32_768);
    }

    #[test]
    fn the_window_follows_the_idle_gaps_between_its_floor_and_cap() {
        let none: Vec<Option<Sequence>> = Vec::new();
        let idle = |now| ctx_at(&none, &[], &[], now, 32_768);
        // Each request (100 ms TTFT) stays 100 ms and the next arrives 1 s after it left.
        let serve = |p: &mut SloAware, starts: &[u64]| {
            for (i, &at) in starts.iter().enumerate() {
                let s = with_slo(seq(i as u64 + 1, at, 4), Some(100.0), None);
                p.observe(PolicyEvent::Arrived(SeqView::new(&s)));
                depart(p, &s, at + 100_000);
            }
        };
        let mut p = policy();
        serve(&mut p, &[0, 1_100_000, 2_200_000]);
        // Idle gaps of 1 s: the window is 3 s from the last departure (2.3 s).
        assert_eq!(p.token_budget(&idle(5_299_999)), 4_400);
        assert_eq!(p.token_budget(&idle(5_300_000)), 32_768);
        // The reserve lapsed: the next arrival's target sizes it alone (400 ms:
        // (200 ms * 0.9 - 1 ms) / 10 us = 17,900), and a tighter one while it lasts wins.
        let loose = with_slo(seq(9, 20_000_000, 4), Some(400.0), None);
        p.observe(PolicyEvent::Arrived(SeqView::new(&loose)));
        assert_eq!(p.token_budget(&idle(20_000_000)), 17_900);
        let tight = with_slo(seq(10, 20_000_000, 4), Some(100.0), None);
        p.observe(PolicyEvent::Arrived(SeqView::new(&tight)));
        assert_eq!(p.token_budget(&idle(20_000_000)), 4_400);
        // Closed-loop clients sending again 10 ms after an answer: the window is the TTFT
        // target (100 ms), not 30 ms.
        let mut p = policy();
        serve(&mut p, &[0, 110_000, 220_000]);
        assert_eq!(p.token_budget(&idle(419_999)), 4_400);
        assert_eq!(p.token_budget(&idle(420_000)), 32_768);
        // With a cap below the gaps' window, the cap decides.
        let mut p = policy().with_reserve_window_ms(500.0);
        serve(&mut p, &[0, 1_100_000]);
        assert_eq!(p.token_budget(&idle(1_699_999)), 4_400);
        assert_eq!(p.token_budget(&idle(1_700_000)), 32_768);
    }

    /// What `p` lets a step take at `now` with nothing running or waiting, out of 65,536
    /// tokens.
    fn idle_budget(p: &SloAware, now: u64) -> usize {
        p.token_budget(&ctx_at(&[], &[], &[], now, 65_536))
    }

    /// A policy that saw a 20,000-token prompt with a 100 ms TTFT target arrive at 0, and
    /// that prompt.
    fn after_a_long_targeted_arrival() -> (SloAware, Sequence) {
        let mut p = policy();
        let long = with_slo(seq(1, 0, 20_000), Some(100.0), None);
        p.observe(PolicyEvent::Arrived(SeqView::new(&long)));
        (p, long)
    }

    #[test]
    fn the_reserve_never_bounds_a_step_below_the_shortest_recent_targeted_prompts_own() {
        // A 20,000-token prompt with a 100 ms TTFT target: its own first step, 1 ms + 200 ms,
        // outlasts half the target, so no bound meets the target; a step may last as long as
        // that step: (201 ms * 0.9 - 1 ms) / 10 us = 17,990 tokens, not 4,400.
        let (mut p, long) = after_a_long_targeted_arrival();
        assert_eq!(idle_budget(&p, 5_000), 17_990);
        // A 2,000-token prompt (21 ms, within half the target) arrives while it lasts: half the
        // target bounds the steps again.
        let short = with_slo(seq(2, 10_000, 2_000), Some(100.0), None);
        p.observe(PolicyEvent::Arrived(SeqView::new(&short)));
        assert_eq!(idle_budget(&p, 20_000), 4_400);
        // Both leave at 300 ms; the reserve lapses after the cap (10 s), and the next arrival's
        // prompt sizes it alone.
        depart(&mut p, &long, 300_000);
        depart(&mut p, &short, 300_000);
        assert_eq!(idle_budget(&p, 10_300_000), 65_536);
        let again = with_slo(seq(3, 20_000_000, 20_000), Some(100.0), None);
        p.observe(PolicyEvent::Arrived(SeqView::new(&again)));
        assert_eq!(idle_budget(&p, 20_000_000), 17_990);
        // Where half the target is the longer (1,000 ms: 500 ms against 201), it decides:
        // (500 ms * 0.9 - 1 ms) / 10 us = 44,900 tokens.
        let mut p = policy();
        let loose = with_slo(seq(4, 0, 20_000), Some(1_000.0), None);
        p.observe(PolicyEvent::Arrived(SeqView::new(&loose)));
        assert_eq!(idle_budget(&p, 5_000), 44_900);
    }

    /// The shortest recent targeted prompt counts what its admission left to compute: a
    /// 20,000-token prompt of which the prefix cache holds 19,000 has a first step of 1,000
    /// tokens (11 ms), within half the target, so half the target bounds the steps again.
    #[test]
    fn the_reserves_idle_bound_counts_a_targeted_prompts_cache_hit_at_its_admission() {
        let (mut p, long) = after_a_long_targeted_arrival();
        assert_eq!(idle_budget(&p, 5_000), 17_990);
        let hit = prefilling(long, 19_000);
        p.observe(PolicyEvent::Admitted(SeqView::new(&hit)));
        assert_eq!(idle_budget(&p, 20_000), 4_400);
    }

    proptest::proptest! {
        /// Whatever the arrivals and departures: the reserve counts exactly the targeted
        /// requests present, only ever lowers the budget (never below `min_chunk_tokens` or
        /// the configured limit, whichever is less), and is gone once none is present and the
        /// cap has passed since the last one arrived or left.
        #[test]
        fn the_reserve_only_bounds_and_lapses(
            events in proptest::collection::vec(
                (0u64..3_000_000, 0u8..4, 1u32..2_000, proptest::bool::ANY),
                1..24,
            ),
            max in 1usize..8_192,
            after in 0u64..20_000_000,
        ) {
            let mut p = policy();
            let mut live: Vec<Sequence> = Vec::new();
            let mut now = 0u64;
            let mut last = 0u64;
            let mut targeted = 0usize;
            for (i, &(dt, kind, ttft, leave)) in events.iter().enumerate() {
                now += dt;
                if leave && !live.is_empty() {
                    let s = live.remove(0);
                    depart(&mut p, &s, now);
                    if reserve_ttft_ms(SeqView::new(&s)).is_some() {
                        targeted -= 1;
                        last = now;
                    }
                    continue;
                }
                let mut s = seq(i as u64 + 1, now, 4);
                match kind {
                    0 => s = with_slo(s, Some(f64::from(ttft)), None),
                    1 => s = with_slo(s, None, Some(f64::from(ttft))),
                    2 => {
                        s = with_slo(s, Some(f64::from(ttft)), None);
                        s.preemptible = true;
                    }
                    _ => {}
                }
                p.observe(PolicyEvent::Arrived(SeqView::new(&s)));
                if kind == 0 {
                    targeted += 1;
                    last = now;
                }
                live.push(s);
            }
            proptest::prop_assert_eq!(p.reserve.live, targeted);
            let none: Vec<Option<Sequence>> = Vec::new();
            let at = now + after;
            let budget = p.token_budget(&ctx_at(&none, &[], &[], at, max));
            proptest::prop_assert!(budget <= max);
            proptest::prop_assert!(budget >= p.min_chunk_tokens.min(max));
            if targeted == 0 && at >= last + 10_000_000 {
                proptest::prop_assert_eq!(budget, max);
            }
            let off = p.clone().with_reserve_window_ms(0.0);
            proptest::prop_assert_eq!(off.token_budget(&ctx_at(&none, &[], &[], at, max)), max);
        }
    }
}
