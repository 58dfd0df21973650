//! Priority scheduling with preemption and aging.
//!
//! Ranks by effective priority (lower = more urgent, vLLM's convention), where the
//! effective priority improves by one level per `aging_interval_ms` since arrival, so a
//! low-priority request cannot starve behind a stream of urgent ones (vLLM PR #20608 and
//! issue #10101). The lessons of vLLM's open priority bugs are built in:
//!
//! * #40004: a waiting request may preempt running work of strictly worse effective
//!   priority not only when KV blocks run out but also when `max_num_seqs` is reached
//!   (the core asks [`Policy::may_preempt`] in both cases).
//! * #41951: within a priority level a preempted request ranks before fresh ones (a bounded
//!   boost of up to `preempted_boost_cap` preemptions), and victims are chosen with the very
//!   same rank, so a re-admitted request is not the next victim and wasted recompute stays
//!   bounded.
//!
//! Running and waiting requests age alike (from arrival): the difference of two effective
//! priorities only takes two adjacent values over time, so with the strict comparison of
//! [`Policy::may_preempt`] two requests can never preempt each other in turn.

use crate::error::PolicyError;
use crate::policy::params::Params;
use crate::policy::{Policy, Rank};
use crate::sequence::SeqView;
use crate::types::{TierSpec, Timestamp};

/// Registered name.
pub(crate) const NAME: &str = "priority";

/// Priority with preemption and aging.
#[derive(Clone, Debug)]
pub struct PriorityPolicy {
    /// Microseconds of age that improve the effective priority by one level (0 = no aging).
    aging_interval_us: u64,
    /// Whether waiting work may preempt running work of worse effective priority.
    preempt: bool,
    /// Largest preemption count that still boosts re-admission.
    boost_cap: u32,
}

impl PriorityPolicy {
    /// A priority policy; `aging_interval_ms == 0` disables aging.
    pub fn new(aging_interval_ms: f64, preempt: bool, boost_cap: u32) -> Self {
        Self {
            aging_interval_us: (aging_interval_ms * 1e3) as u64,
            preempt,
            boost_cap,
        }
    }

    /// Builds the policy from `{aging_interval_ms, preempt, preempted_boost_cap}`
    /// (defaults 10000, true, 3).
    pub fn create(
        params: &serde_yaml::Value,
        _tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        let p = Params::new(
            NAME,
            params,
            &["aging_interval_ms", "preempt", "preempted_boost_cap"],
        )?;
        let aging = p.f64_in("aging_interval_ms", 10_000.0, 0.0, 1e9)?;
        let preempt = p.bool("preempt", true)?;
        let cap = p.u64_in("preempted_boost_cap", 3, 0, 1000)? as u32;
        Ok(Box::new(Self::new(aging, preempt, cap)))
    }

    /// Priority after aging: one level better per full interval waited since arrival.
    pub fn effective_priority(&self, seq: SeqView<'_>, now: Timestamp) -> i64 {
        let levels = match self.aging_interval_us {
            0 => 0,
            i => (now.saturating_sub(seq.arrival()) / i) as i64,
        };
        i64::from(seq.priority()) - levels
    }
}

impl Policy for PriorityPolicy {
    fn name(&self) -> &str {
        NAME
    }

    fn rank(&self, seq: SeqView<'_>, now: Timestamp) -> Rank {
        Rank {
            class: self.effective_priority(seq, now),
            key: -i64::from(seq.num_preemptions().min(self.boost_cap)),
        }
    }

    fn may_preempt(&self, waiting: SeqView<'_>, running: SeqView<'_>, now: Timestamp) -> bool {
        self.preempt
            && self.effective_priority(waiting, now) < self.effective_priority(running, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testutil::{decoding, seq};

    fn with_prio(id: u64, arrival: u64, prio: i32) -> crate::sequence::Sequence {
        let mut s = seq(id, arrival, 10);
        s.req.priority = prio;
        s
    }

    #[test]
    fn aging_lifts_one_level_per_interval() {
        // Interval 1 ms: priority 5 arriving at t=0 is 5 - 2 = 3 at t = 2.5 ms.
        let p = PriorityPolicy::new(1.0, true, 3);
        let s = with_prio(1, 0, 5);
        assert_eq!(p.effective_priority(SeqView::new(&s), Timestamp(2_500)), 3);
        assert_eq!(p.rank(SeqView::new(&s), Timestamp(999)).class, 5);
    }

    #[test]
    fn old_low_priority_request_overtakes_new_urgent_one() {
        let p = PriorityPolicy::new(1.0, true, 3);
        let old = with_prio(1, 0, 5); // effective 5 - 10 = -5 at t = 10 ms
        let new = with_prio(2, 10_000, 0); // effective 0
        let now = Timestamp(10_000);
        assert!(p.rank(SeqView::new(&old), now) < p.rank(SeqView::new(&new), now));
    }

    #[test]
    fn preempted_request_ranks_first_within_its_level_up_to_the_cap() {
        let p = PriorityPolicy::new(0.0, true, 3);
        let fresh = with_prio(1, 0, 1);
        let mut again = with_prio(2, 50, 1);
        again.num_preemptions = 7;
        let (rf, ra) = (
            p.rank(SeqView::new(&fresh), Timestamp(60)),
            p.rank(SeqView::new(&again), Timestamp(60)),
        );
        assert!(ra < rf);
        assert_eq!(ra, Rank { class: 1, key: -3 });
    }

    #[test]
    fn only_strictly_more_urgent_work_preempts() {
        let p = PriorityPolicy::new(0.0, true, 3);
        let urgent = with_prio(1, 10, 0);
        let same = with_prio(2, 10, 2);
        let running = decoding(with_prio(3, 0, 2), 1, 5);
        let now = Timestamp(20);
        assert!(p.may_preempt(SeqView::new(&urgent), SeqView::new(&running), now));
        assert!(!p.may_preempt(SeqView::new(&same), SeqView::new(&running), now));
        let off = PriorityPolicy::new(0.0, false, 3);
        assert!(!off.may_preempt(SeqView::new(&urgent), SeqView::new(&running), now));
    }
}
