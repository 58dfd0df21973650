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
//! * #41951: within a priority level a preempted request waiting for re-admission ranks
//!   before fresh ones (a bounded boost of up to `preempted_boost_cap` preemptions), so its
//!   recompute is not postponed behind later arrivals. The boost only orders the waiting
//!   queue: running requests rank by effective priority, then arrival, so a victim is the
//!   newest running request of the worst level and a re-admitted, barely prefilled request
//!   never makes an older request of its level the victim in its place.
//!
//! Running and waiting requests age alike (from arrival): the difference of two effective
//! priorities only takes two adjacent values over time, so with the strict comparison of
//! [`Policy::may_preempt`] two requests can never preempt each other in turn.

use crate::error::PolicyError;
use crate::policy::params::{aged_levels, aging_interval_us, Params};
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
    /// A priority policy; `aging_interval_ms == 0` disables aging. The interval is rounded
    /// to whole microseconds, at least one when it is positive (so aging never switches off
    /// by rounding).
    pub fn new(aging_interval_ms: f64, preempt: bool, boost_cap: u32) -> Self {
        Self {
            aging_interval_us: aging_interval_us(aging_interval_ms),
            preempt,
            boost_cap,
        }
    }

    /// Builds the policy from `{aging_interval_ms, preempt, preempted_boost_cap}`
    /// (defaults 10000, true, 3). `aging_interval_ms` is 0 (no aging) or at least 0.001 (one
    /// microsecond, the clock's resolution).
    pub fn create(
        params: &serde_yaml::Value,
        _tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        let p = Params::new(
            NAME,
            params,
            &["aging_interval_ms", "preempt", "preempted_boost_cap"],
        )?;
        let aging = p.aging_interval_ms("aging_interval_ms", 10_000.0)?;
        let preempt = p.bool("preempt", true)?;
        let cap = p.u64_in("preempted_boost_cap", 3, 0, 1000)? as u32;
        Ok(Box::new(Self::new(aging, preempt, cap)))
    }

    /// Priority after aging: one level better per full interval waited since arrival.
    pub fn effective_priority(&self, seq: SeqView<'_>, now: Timestamp) -> i64 {
        let levels = aged_levels(self.aging_interval_us, seq.arrival(), now);
        i64::from(seq.priority()) - levels
    }
}

impl Policy for PriorityPolicy {
    fn name(&self) -> &str {
        NAME
    }

    fn rank(&self, seq: SeqView<'_>, now: Timestamp) -> Rank {
        // The re-admission boost orders the waiting queue only: among running requests
        // (service order, and victims in reverse) arrival decides within a level.
        let boost = if seq.is_running() {
            0
        } else {
            seq.num_preemptions().min(self.boost_cap)
        };
        Rank {
            class: self.effective_priority(seq, now),
            key: -i64::from(boost),
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
    use crate::policy::testutil::{decoding, prefilling, seq};

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
    fn boost_orders_the_waiting_queue_only() {
        let p = PriorityPolicy::new(0.0, true, 3);
        let mut again = with_prio(2, 50, 1);
        again.num_preemptions = 1;
        let running = |s: crate::sequence::Sequence| prefilling(s, 2);
        // Running, the re-admitted request ranks like any other of its level (arrival then
        // decides, so it is preempted before an older request).
        let older = decoding(with_prio(1, 0, 1), 5, 10);
        let again = running(again);
        assert_eq!(
            p.rank(SeqView::new(&again), Timestamp(60)),
            p.rank(SeqView::new(&older), Timestamp(60))
        );
    }

    #[test]
    fn sub_microsecond_aging_interval_is_refused() {
        let create = |v: &str| {
            let v: serde_yaml::Value = serde_yaml::from_str(v).unwrap();
            PriorityPolicy::create(&v, &[])
        };
        let e = create("{aging_interval_ms: 0.0005}")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("aging_interval_ms") && e.contains("0.001"),
            "{e}"
        );
        assert!(create("{aging_interval_ms: 0}").is_ok());
        assert!(create("{aging_interval_ms: 0.001}").is_ok());
        // Built directly, a positive interval never rounds down to "no aging".
        let p = PriorityPolicy::new(0.0004, true, 3);
        let s = with_prio(1, 0, 5);
        assert_eq!(p.effective_priority(SeqView::new(&s), Timestamp(3)), 2);
        // Rounded, not truncated: 4.35 ms is 4350 us (4349.999... in binary).
        assert_eq!(PriorityPolicy::new(4.35, true, 3).aging_interval_us, 4350);
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

#[cfg(test)]
mod through_the_scheduler {
    use std::sync::Arc;

    use super::*;
    use crate::types::{
        Request, RequestId, SamplingLimits, SchedulerConfig, SloTargets, StepOutput,
    };
    use crate::Scheduler;

    fn req(id: u64, arrival: u64, prio: i32, prompt: usize, max_tokens: u32) -> Request {
        Request {
            id: RequestId(id),
            tenant: String::new(),
            tier: String::new(),
            priority: prio,
            lora_adapter: None,
            arrival: Timestamp(arrival),
            slo: SloTargets::default(),
            prompt: Arc::from(vec![3u32; prompt]),
            limits: SamplingLimits {
                max_tokens,
                ..SamplingLimits::default()
            },
            cache_salt: None,
        }
    }

    /// Review finding 6: D (arrival 0) and R (arrival 1) decode at the same priority in 12
    /// blocks of 4 tokens. At step 14 urgent U preempts R (the newest); U ends, R is
    /// re-admitted and recomputed; at step 23 the blocks run out again. The victim must be R
    /// again, the newer of the two: with the re-admission boost in the running order, R
    /// outranked D and the older D was preempted instead (once per boosted preemption).
    #[test]
    fn readmitted_request_does_not_make_an_older_one_the_victim() {
        let c = SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 1024,
            block_size: 4,
            num_gpu_blocks: 12,
            enable_prefix_caching: false,
            max_model_len: 256,
            ..SchedulerConfig::default()
        };
        let policy = Box::new(PriorityPolicy::new(0.0, true, 3));
        let mut s = Scheduler::new(c, policy, [1, 2]).unwrap();
        s.add_request(req(1, 0, 1, 4, 40)).unwrap(); // D
        s.add_request(req(2, 1, 1, 4, 30)).unwrap(); // R
        let mut victims = Vec::new();
        for now in 2..200u64 {
            if now == 14 {
                s.add_request(req(3, now, 0, 20, 1)).unwrap(); // U
            }
            let plan = s.schedule(Timestamp(now));
            victims.extend(plan.preempted.iter().map(|id| (now, id.0)));
            let outs: Vec<StepOutput> = plan
                .seqs
                .iter()
                .filter(|q| q.samples)
                .map(|q| StepOutput::new(q.id, 7))
                .collect();
            s.apply_outputs(&plan, &outs, Timestamp(now));
            s.check_invariants().unwrap();
            if !s.has_unfinished() {
                break;
            }
        }
        assert_eq!(victims, [(14, 2), (23, 2)]);
    }
}
