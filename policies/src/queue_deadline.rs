//! Queue bounds (load shedding), as Triton's `default_timeout_microseconds` with
//! `timeout_action: REJECT`: a request not admitted for the first time within its bound
//! (its tier's `max_queue_ms`, else the scheduler's) of its arrival is ended with
//! [`FinishReason::QueueTimeout`] when the next step is planned, so that capacity goes to
//! requests whose clients still wait for them. A request admitted once, preempted ones
//! included, is never timed out: it has produced work.
//!
//! Deadlines sit in a min-heap with lazy deletion: an entry whose request was admitted or
//! ended stays until its deadline comes up (or until a compaction drops it). Per step the
//! check costs O(1) when nothing is due, O(log n) per entry popped, and one O(waiting) pass
//! over the waiting queue in a step that times something out. Entries are compacted when the
//! heap holds more than twice the live requests (plus a constant): O(1) amortized per
//! request.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::scheduler::Scheduler;
use crate::types::{FinishReason, Micros, QueueTimeout, RequestId, RequestState, Timestamp};

/// Entries kept beyond twice the live requests before a compaction.
const COMPACT_SLACK: usize = 64;

/// A request's deadline: (deadline, request, slot, the bound in milliseconds, whether it is
/// the tier's own). The bound is the one the request was queued with, which a timeout reports
/// (a reload may have changed or removed it since).
type Deadline = (Timestamp, RequestId, u32, u64, bool);

/// Deadlines of requests waiting for their first admission, earliest first.
#[derive(Default)]
pub(crate) struct QueueDeadlines {
    /// The deadlines; stale entries are skipped when popped.
    heap: BinaryHeap<Reverse<Deadline>>,
}

impl QueueDeadlines {
    /// The earliest deadline held (possibly a stale entry's).
    pub(crate) fn earliest(&self) -> Option<Timestamp> {
        self.heap.peek().map(|Reverse((t, ..))| *t)
    }

    /// Entries held, stale ones included.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }
}

/// Microseconds of a bound in milliseconds.
fn micros(ms: u64) -> Micros {
    ms.saturating_mul(1000)
}

impl Scheduler {
    /// The queue bound of a request of tier `tier`, in milliseconds, and whether it is the
    /// tier's own.
    pub(crate) fn queue_bound(&self, tier: &str) -> Option<(u64, bool)> {
        let own = self
            .config
            .tiers
            .iter()
            .find(|t| t.name == tier)
            .and_then(|t| t.max_queue_ms);
        match own {
            Some(ms) => Some((ms, true)),
            None => self.config.max_queue_ms.map(|ms| (ms, false)),
        }
    }

    /// Records the deadline of the request just queued in `slot`, if its tier or the
    /// scheduler bounds its wait.
    pub(crate) fn track_deadline(&mut self, slot: u32) {
        let Some(seq) = self.seq(slot) else {
            return;
        };
        let Some((ms, own)) = self.queue_bound(&seq.req.tier) else {
            return;
        };
        let entry = (
            seq.req.arrival.saturating_add(micros(ms)),
            seq.id,
            slot,
            ms,
            own,
        );
        let live = self.running.len() + self.waiting.len();
        if self.deadlines.heap.len() > 2 * live + COMPACT_SLACK {
            let seqs = &self.seqs;
            self.deadlines.heap.retain(|Reverse((_, id, s, ..))| {
                seqs.get(*s as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|q| q.id == *id && q.state == RequestState::Waiting)
            });
        }
        self.deadlines.heap.push(Reverse(entry));
    }

    /// Ends every request still waiting for its first admission whose deadline is before
    /// `now` (it waited longer than its bound), appending them to `out`.
    pub(crate) fn expire_queued(&mut self, now: Timestamp, out: &mut Vec<QueueTimeout>) {
        let mut any = false;
        while let Some(&Reverse((deadline, id, slot, max_queue_ms, tier_bound))) =
            self.deadlines.heap.peek()
        {
            if deadline >= now {
                break;
            }
            self.deadlines.heap.pop();
            let Some(seq) = self.seq(slot) else {
                continue;
            };
            if seq.id != id || seq.state != RequestState::Waiting {
                continue; // admitted, or ended, since it was queued
            }
            let waited = now.saturating_sub(seq.req.arrival);
            let tier = seq.req.tier.clone();
            self.release(slot, RequestState::Finished(FinishReason::QueueTimeout));
            out.push(QueueTimeout {
                id,
                waited,
                max_queue_ms,
                tier_bound,
                tier,
            });
            any = true;
        }
        if any {
            let seqs = &self.seqs;
            self.waiting.retain(|&s| {
                seqs.get(s as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|q| !q.state.is_terminal())
            });
        }
    }

    /// When the earliest queue bound runs out (possibly that of a request admitted since):
    /// a caller that plans steps only on events should plan one then, so that a request
    /// waiting while nothing runs is still timed out. `None` when no request is bounded.
    pub fn next_queue_deadline(&self) -> Option<Timestamp> {
        self.deadlines.earliest()
    }
}

#[cfg(test)]
#[path = "queue_deadline_tests.rs"]
mod tests;
