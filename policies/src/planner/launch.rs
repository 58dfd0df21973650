//! The planner's part after a plan is built: its outputs applied at once
//! ([`Scheduler::apply_outputs`]) or the step launched ahead of them ([`Scheduler::launch`]),
//! its pending tokens resolved when the outputs come in ([`Scheduler::resolve`]), accepted drafts
//! kept and the blocks of rejected ones given back, full blocks registered in the prefix cache.

use std::collections::HashMap;

use crate::block_ledger::BlockLedger;
use crate::policy::PolicyEvent;
use crate::prefix_hash::BlockHasher;
use crate::scheduler::Scheduler;
use crate::sequence::{SeqView, Sequence};
use crate::tier_quota::TierQuotas;
use crate::types::{
    RequestId, RequestState, SeqEvent, StepOutput, StepPlan, Timestamp, PENDING_TOKEN,
};

use super::slot_ref;

impl Scheduler {
    /// Applies a step's sampled tokens: advances computed tokens, fills the prefix cache,
    /// appends outputs, finishes sequences that hit a stop condition (freeing their blocks)
    /// and returns what happened.
    ///
    /// `plan` must be the latest plan from [`Scheduler::schedule`]; entries for requests
    /// finished or aborted in between are skipped. A sampling entry without an output is
    /// rolled back so its last position is fed again next step. The same as
    /// [`Scheduler::launch`] then [`Scheduler::resolve`].
    pub fn apply_outputs(
        &mut self,
        plan: &StepPlan,
        outputs: &[StepOutput],
        now: Timestamp,
    ) -> Vec<SeqEvent> {
        self.launch(plan);
        self.resolve(plan, outputs, now)
    }

    /// Records that the latest plan's step is running on the device, before its outputs are
    /// known: computed tokens advance and every sampling entry gets a [`PENDING_TOKEN`], so
    /// the next step can be planned (and fed that token from the device) while this one
    /// runs. [`Scheduler::resolve`] brings the outputs, steps in launch order.
    ///
    /// A sequence is never scheduled with two steps in flight, nor when its pending token
    /// will end it by length; a sequence that stops on a resolved token loses the step
    /// planned after it (its output is dropped as stale).
    pub fn launch(&mut self, plan: &StepPlan) {
        let mut rec = self.spare_launched.pop().unwrap_or_default();
        rec.clear();
        let slots_valid = self.last_slots.len() == plan.seqs.len();
        for (i, sched) in plan.seqs.iter().enumerate() {
            let slot = match self.last_slots.get(i) {
                Some(&s)
                    if slots_valid && slot_ref(&self.seqs, s).is_some_and(|q| q.id == sched.id) =>
                {
                    Some(s)
                }
                _ => self.index.get(&sched.id).copied(),
            };
            let seq = slot.and_then(|s| self.seqs.get_mut(s as usize).and_then(|q| q.as_mut()));
            let (Some(slot), Some(seq)) = (slot, seq) else {
                rec.push(Launched::STALE);
                continue;
            };
            // Drafts are fed past the known tokens; only their verified part is computed.
            let drafts = sched.draft_tokens.len();
            let after = (sched.num_computed_tokens + sched.num_new_tokens).saturating_sub(drafts);
            if seq.id != sched.id
                || seq.state != RequestState::Running
                || seq.num_computed != sched.num_computed_tokens
                || after > seq.num_tokens()
                || seq.block_table.len() < self.ledger.blocks_for(after + drafts)
                || (drafts > 0 && (!sched.samples || after != seq.num_tokens() || seq.pending > 0))
            {
                rec.push(Launched::STALE);
                continue;
            }
            seq.num_computed = after;
            let p = seq.prompt_len;
            let prompt_tokens = after.min(p).saturating_sub(seq.max_computed.min(p));
            seq.max_computed = seq.max_computed.max(after);
            cache_full_blocks(
                self.config.enable_prefix_caching,
                &self.hasher,
                &mut self.ledger,
                seq,
            );
            let samples = sched.samples && after == seq.num_tokens();
            if samples {
                seq.output.push(PENDING_TOKEN);
                seq.pending += 1;
                seq.speculating = drafts > 0;
            }
            rec.push(Launched {
                slot,
                prompt_tokens: prompt_tokens as u32,
                samples,
            });
        }
        self.in_flight.push_back(rec);
    }

    /// Whether launched steps wait for [`Scheduler::resolve`].
    pub fn has_in_flight(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// Forgets every launched step without applying it: for a caller that ended (aborted)
    /// every request of those steps after the device failed them.
    pub fn forget_launched(&mut self) {
        while let Some(rec) = self.in_flight.pop_front() {
            self.spare_launched.push(rec);
        }
    }

    /// Applies the outputs of the oldest launched step (`plan` is the plan it was launched
    /// with): pending tokens become the sampled ones, stop conditions are checked (a stopped
    /// sequence is finished and its blocks freed) and the events are returned. An entry
    /// whose sequence ended or was preempted since its launch is skipped; a sampling entry
    /// without an output is rolled back so its last position is fed again.
    pub fn resolve(
        &mut self,
        plan: &StepPlan,
        outputs: &[StepOutput],
        now: Timestamp,
    ) -> Vec<SeqEvent> {
        let mut events = Vec::with_capacity(outputs.len() + outputs.len() / 8);
        let Some(rec) = self.in_flight.pop_front() else {
            self.pool_errors += 1; // a caller bug: nothing launched
            return events;
        };
        if rec.len() != plan.seqs.len() {
            self.pool_errors += 1; // a caller bug: not the launched plan
            self.spare_launched.push(rec);
            return events;
        }
        let mut cursor = 0usize;
        let mut by_id: Option<HashMap<RequestId, StepOutput>> = None;
        let mut any_ended = false;
        for (sched, l) in plan.seqs.iter().zip(&rec) {
            if l.slot == Launched::STALE.slot {
                continue;
            }
            let Some(seq) = self.seqs.get_mut(l.slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            if seq.id != sched.id || seq.state != RequestState::Running {
                continue; // ended or preempted since the launch
            }
            let drafts = &sched.draft_tokens;
            let after =
                (sched.num_computed_tokens + sched.num_new_tokens).saturating_sub(drafts.len());
            // The pending token's place in `output`; only a sampling entry has one (a chunk
            // that ends inside the prompt has `after < prompt_len`).
            let idx = if l.samples {
                match after.checked_sub(seq.prompt_len) {
                    Some(i) if seq.output.get(i) == Some(&PENDING_TOKEN) => Some(i),
                    _ => continue, // rolled back since the launch
                }
            } else {
                None
            };
            seq.speculating = false;
            let mut output_tokens = 0;
            // The stop reason, with the end of the outputs resolved here.
            let mut stop = None;
            if let Some(idx) = idx {
                let out = match outputs.get(cursor) {
                    Some(o) if o.id == sched.id => {
                        cursor += 1;
                        Some(*o)
                    }
                    _ => by_id
                        .get_or_insert_with(|| outputs.iter().map(|o| (o.id, *o)).collect())
                        .get(&sched.id)
                        .copied(),
                };
                match out {
                    Some(o) if o.token != PENDING_TOKEN => {
                        // The accepted drafts, then the sampled token; the drafts' KV is
                        // valid up to the last accepted one.
                        let accepted = (o.accepted as usize).min(drafts.len());
                        seq.pending -= 1;
                        if seq.first_token_at.is_none() {
                            seq.first_token_at = Some(now);
                            events.push(SeqEvent::FirstToken {
                                id: sched.id,
                                at: now,
                                cached_prompt_tokens: seq.first_cached.unwrap_or(0),
                            });
                        }
                        seq.last_token_at = Some(now);
                        let mut end = idx + 1;
                        for (m, &t) in drafts[..accepted].iter().chain([&o.token]).enumerate() {
                            // Drafts are only fed with no other step in flight: the extra
                            // tokens go at the end.
                            if m == 0 {
                                seq.output[idx] = t;
                            } else {
                                seq.output.insert(idx + m, t);
                            }
                            end = idx + m + 1;
                            output_tokens += 1;
                            events.push(SeqEvent::Token {
                                id: sched.id,
                                token: t,
                                at: now,
                            });
                            if let Some(reason) = seq.stop_reason_at(t, end) {
                                stop = Some((reason, end));
                                break;
                            }
                        }
                        // The accepted drafts' KV counts as computed, up to the last output
                        // before a stop (the sequence ends then; the last output stays the one
                        // to feed, as always).
                        seq.num_computed += accepted.min(end - idx - 1);
                        seq.max_computed = seq.max_computed.max(seq.num_computed);
                        if !drafts.is_empty() {
                            trim_blocks(
                                &mut self.ledger,
                                &mut self.quotas,
                                seq,
                                &mut self.pool_errors,
                            );
                        }
                        // The resolved tokens may complete blocks.
                        cache_full_blocks(
                            self.config.enable_prefix_caching,
                            &self.hasher,
                            &mut self.ledger,
                            seq,
                        );
                    }
                    _ => {
                        // No token: feed the last known position again (a step launched
                        // after this one becomes stale).
                        seq.output.truncate(idx);
                        seq.pending = 0;
                        seq.num_computed = seq.num_computed.min(after - 1);
                        if !drafts.is_empty() {
                            trim_blocks(
                                &mut self.ledger,
                                &mut self.quotas,
                                seq,
                                &mut self.pool_errors,
                            );
                        }
                    }
                }
            }
            self.policy.observe(PolicyEvent::Served {
                seq: SeqView::new(seq),
                prompt_tokens: l.prompt_tokens as usize,
                output_tokens,
            });
            if let Some((reason, end)) = stop {
                // Tokens sampled after the stop (a step in flight) are dropped.
                seq.output.truncate(end);
                seq.pending = 0;
                self.release(l.slot, RequestState::Finished(reason));
                events.push(SeqEvent::Finished {
                    id: sched.id,
                    reason,
                    at: now,
                });
                any_ended = true;
            }
        }
        self.spare_launched.push(rec);
        if any_ended {
            let seqs = &self.seqs;
            self.running
                .retain(|&s| slot_ref(seqs, s).is_some_and(|q| q.state == RequestState::Running));
        }
        events
    }
}

/// Registers the leading full, computed blocks of `seq` in the prefix cache (never a block
/// holding a pending token: its hash needs the real one); nothing without prefix caching
/// (nothing would read them).
#[inline]
fn cache_full_blocks(
    caching: bool,
    hasher: &BlockHasher,
    pool: &mut BlockLedger,
    seq: &mut Sequence,
) {
    if !caching {
        return;
    }
    let full = pool.full_blocks(seq.num_computed.min(seq.num_known_tokens()));
    if full <= seq.num_cached_blocks {
        return;
    }
    let extras = seq.hash_extras();
    let mut hashes = std::mem::take(&mut seq.hashes);
    hasher.extend_chain(&mut hashes, seq.tokens(), pool.block_size(), full, extras);
    let start = seq.num_cached_blocks;
    let end = full.min(hashes.len()).min(seq.block_table.len());
    if start < end {
        for (&b, &h) in seq.block_table[start..end].iter().zip(&hashes[start..end]) {
            pool.cache_block(b, h);
        }
    }
    seq.hashes = hashes;
    seq.num_cached_blocks = full;
}

/// Gives back the blocks past what a running sequence's tokens need (those reserved for drafts
/// it did not keep).
fn trim_blocks(
    ledger: &mut BlockLedger,
    quotas: &mut TierQuotas,
    seq: &mut Sequence,
    pool_errors: &mut u64,
) {
    let keep = ledger.blocks_for(seq.num_tokens());
    while seq.block_table.len() > keep {
        if let Some(blk) = seq.block_table.pop() {
            quotas.sub(seq.tier, 1);
            if ledger.free(blk).is_err() {
                *pool_errors += 1;
            }
        }
    }
    seq.blocks_sent = seq.blocks_sent.min(seq.block_table.len());
}

/// One entry of a launched step, kept until [`Scheduler::resolve`].
#[derive(Copy, Clone, Debug)]
pub(crate) struct Launched {
    /// The sequence's slot (`u32::MAX`: the entry was stale at launch).
    slot: u32,
    /// Prompt tokens computed for the first time (charged to the policy on resolve).
    prompt_tokens: u32,
    /// Whether the entry appended a pending token.
    samples: bool,
}

impl Launched {
    const STALE: Launched = Launched {
        slot: u32::MAX,
        prompt_tokens: 0,
        samples: false,
    };
}
