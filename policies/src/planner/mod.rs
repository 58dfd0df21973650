//! The step planner: continuous batching with chunked prefill, prefix-aware admission and
//! preemption by recompute, in the shape of vLLM's V1 scheduler.
//!
//! One step:
//! 1. The policy sets the token budget (clamped to `max_num_batched_tokens`).
//! 2. Running sequences get their next chunk (1 token for a decode). If all of them fit in
//!    the budget and the free blocks, they are scheduled in queue order and ranking is
//!    skipped (the outcome cannot depend on the order; this is the steady decode state).
//!    Otherwise they are served in rank order, and when the pool runs dry the lowest-ranked
//!    running sequence not yet scheduled is preempted (possibly the one being scheduled).
//!    If anything was preempted, nothing is admitted.
//! 3. Waiting sequences, in rank order, are admitted while seats, budget and blocks last
//!    (the budget goes in rank order: the prefill chunks planned in step 2 for running
//!    sequences that rank after a waiting one lend it what its first chunk lacks, taken from
//!    them, lowest-ranked first, only once it is admitted; decodes keep their token; see
//!    `running.rs`, `reclaimable` and `settle`)
//!    (a policy that ranks by cached prefixes first gets the longest cached prefix of up to
//!    [`crate::Policy::prefix_lookups`] of them, the earliest arrivals; see `prefix_lookup.rs`):
//!    their longest cached prefix is pinned (at least the last token is always recomputed,
//!    so a token can be sampled), the rest is a prefill chunk. The free blocks must hold the
//!    whole remaining prefill, though only the chunk's are reserved (admitted for its first
//!    chunk alone, a long prompt would preempt itself at a later chunk and come back, over
//!    and over). When a sequence does not fit, the policy may name lower-ranked running
//!    victims (`may_preempt`), preempted only if together they free a seat when one is
//!    needed and the blocks it lacks (blocks it would reuse from them do not count);
//!    otherwise admission stops (no overtaking, so FCFS order is preserved). The one
//!    exception: a sequence whose LoRA adapter would make more than `max_loras` distinct
//!    adapters running is passed over, keeping its place, before anything is preempted for
//!    it, by at most `max_num_seqs` later adapter requests. Likewise a sequence whose tier's
//!    KV quota ([`crate::TierSpec::max_kv_fraction`], see `tier_quota.rs`) cannot hold what
//!    the tier holds, what its running sequences owe and the candidate's whole remaining
//!    prefill (its matched blocks included) is passed over, keeping its place, before anything
//!    is preempted for it, and so are its tier's later requests in that step (no overtaking
//!    within a tier); other tiers' requests pass it.
//!
//! Growth under a quota: when a running sequence's chunk would take its tier over its bound,
//! the tier's own lowest-ranked running sequence not yet scheduled is preempted (possibly the
//! one being scheduled), never another tier's, as when the pool runs dry; drafts stop at the
//! bound. A sequence's charge is the blocks it holds (a block shared through the prefix cache
//! counts for each holder: conservative, and O(1)); the per-tier counts change with every
//! block added to or given back from a table, so every quota check is O(1).
//!
//! Preemption frees every block (full ones stay cached) and keeps the generated tokens, so
//! the recompute covers prompt + output. Under a sliding window
//! ([`crate::SchedulerConfig::sliding_window`]), each step first gives back the running
//! sequences' blocks that hold only keys before every window their next steps read, and
//! admission asks for at most the blocks a sequence holds at once. Per step the planner does O(running) work
//! (O(running · log running) when constrained) plus O(waiting) ranking when something waits
//! (O(waiting · log waiting) when candidates passed over for adapter slots leave the first
//! `max_num_seqs + 1` short), plus, for each admission whose first chunk borrows budget from
//! lower-ranked running prefill chunks (`Scheduler::reclaimable`), one pass over the plan and
//! a sort of its lenders (O(running · log running)), plus, for a policy that asks for cached prefixes, at most
//! `min(prefix_lookups, MAX_PREFIX_LOOKUPS)` hash-chain walks of at most hit length + 1 probes;
//! adapter slots are counted as sequences start and stop running,
//! so a check is O(1). Queue bounds (`queue_deadline.rs`) cost O(1) per step when no waiting
//! request's deadline is due, O(log n) per deadline popped and one O(waiting) pass in a step
//! that times a request out. Block hashes are computed once per block per request. Plans carry only
//! the blocks each sequence gained since it was last scheduled (vLLM V1's `new_block_ids`).
//!
//! With a host KV tier (`host_tier.rs`), admission's prefix match goes on in the tier where
//! the device's ends: those blocks count as computed (and cached), their device blocks are
//! reserved with the chunk's, and once the plan's blocks have ids (`assign_blocks`) the plan
//! gets their loads, then the offloads of the cached blocks its allocations evicted. The tier
//! changes only there, so no rollback of the planner touches it. A later admission of the same
//! plan finds those loads (`plan_loads`) where its device match ends and shares the loaded
//! blocks, as device hits, so a plan loads each tier block at most once.
//!
//! The planner's files, one part of the step each: this one holds the entry points
//! ([`Scheduler::schedule`], [`Scheduler::plan_into`], [`Scheduler::schedule_ahead`]) and the
//! step's outline (`plan_inner`, over the plan being built, `Building`); `running.rs` plans the
//! running sequences (their next chunks, growth, preemption and drafts); `admit.rs` admits
//! waiting sequences (with the blocks the running ones still owe and the sliding-window
//! release); `kv.rs` gives the plan's reserved blocks their ids, resolves the blocks shared as
//! they are loaded and adds the host tier's copies; `launch.rs` follows a plan once built
//! (launch, resolve, `apply_outputs`).

mod admit;
mod kv;
mod launch;
mod running;

pub(crate) use launch::Launched;

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::block_ledger::KvCommit;
use crate::block_pool::PassThroughHasher;
use crate::policy::StepContext;
use crate::prefix_hash::PrefixHash;
use crate::scheduler::{Ranked, Scheduler};
use crate::sequence::{SeqView, Sequence};
use crate::types::{RequestState, ScheduledSeq, StepPlan, Timestamp};

/// The host-tier loads decided in the plan being built: for each prefix loaded, the slot of
/// the sequence whose admission decided the load and the index in its table of the device
/// block it fills ([`Scheduler`]'s `plan_loads`).
pub(crate) type PlanLoads = HashMap<PrefixHash, (u32, u32), BuildHasherDefault<PassThroughHasher>>;

/// A table entry of the plan being built that shares a block another sequence admitted in
/// the same plan loads from the host tier (a
/// [`SHARED_LOAD_BLOCK`](crate::block_ledger::SHARED_LOAD_BLOCK) until the plan's blocks get
/// their ids).
#[derive(Copy, Clone, Debug)]
pub(crate) struct PlanShare {
    /// The sharing sequence's entry in the plan.
    entry: u32,
    /// The sharing sequence's slot.
    slot: u32,
    /// The entry's index in the sharing sequence's table.
    at: u32,
    /// The loading sequence's slot.
    owner: u32,
    /// The loaded block's index in the loading sequence's table.
    owner_at: u32,
}

/// Writes entry `n` of `plan.seqs`, reusing its allocation, with the blocks the sequence
/// gained since it was last sent.
fn write_entry(plan: &mut StepPlan, n: usize, seq: &mut Sequence, num_new: usize) {
    let computed = seq.num_computed;
    let total = seq.num_tokens();
    let first = seq.blocks_sent.min(seq.block_table.len());
    let fresh = &seq.block_table[first..];
    let entry = ScheduledSeq {
        id: seq.id,
        num_computed_tokens: computed,
        num_new_tokens: num_new,
        first_new_block: first,
        new_blocks: Vec::new(),
        is_prefill: total - computed > 1,
        samples: computed + num_new == total,
        draft_tokens: Vec::new(),
        lora_adapter: seq.req.lora_adapter,
    };
    match plan.seqs.get_mut(n) {
        Some(slot) => {
            let mut blocks = std::mem::take(&mut slot.new_blocks);
            blocks.clear();
            blocks.extend_from_slice(fresh);
            let mut drafts = std::mem::take(&mut slot.draft_tokens);
            drafts.clear();
            *slot = ScheduledSeq {
                new_blocks: blocks,
                draft_tokens: drafts,
                ..entry
            };
        }
        None => plan.seqs.push(ScheduledSeq {
            new_blocks: fresh.to_vec(),
            ..entry
        }),
    }
    seq.blocks_sent = seq.block_table.len();
    plan.num_batched_tokens += num_new;
}

/// Mutable state of the plan being built.
struct Building<'p> {
    /// The plan (entries past `len` are stale buffers kept for reuse).
    plan: &'p mut StepPlan,
    /// Valid entries.
    len: usize,
    /// Tokens left in the budget.
    budget: usize,
    /// The step's whole budget (the policy's, clamped): the most a waiting request's first
    /// chunk takes back from lower-ranked running prefills (`reclaimable` and `settle`).
    step_budget: usize,
    /// Entries of sequences that were running before this step's admissions (the plan's
    /// first ones): the only chunks that lend budget to a waiting sequence.
    running_len: usize,
    /// Logit rows left beyond the one every seat keeps: the rest of the prompt-logprob
    /// chunks' rows, and the drafts'.
    logit_rows: usize,
    /// Planning ahead of a step in flight: nothing may be preempted.
    ahead: bool,
    /// Blocks the running sequences still owe their known tokens (see `blocks_owed`), once
    /// counted in this step: kept up to date as sequences are admitted, recounted after a
    /// preemption.
    owed: Option<usize>,
}

impl Building<'_> {
    /// Most new tokens `seq` may get from the logit-row budget. A prompt-logprob chunk needs
    /// a row per token: one is its seat's own, the others come from `logit_rows`. So such a
    /// request's decodes (and its 1-token chunks) take nothing from the shared rows.
    fn logit_cap(&self, seq: &Sequence) -> usize {
        if seq.req.limits.prompt_logits {
            self.logit_rows.saturating_add(1)
        } else {
            usize::MAX
        }
    }

    /// Shared logit rows a chunk of `num_new` tokens of `seq` takes (see
    /// [`Building::logit_cap`]).
    fn logit_charge(seq: &Sequence, num_new: usize) -> usize {
        if seq.req.limits.prompt_logits {
            num_new.saturating_sub(1)
        } else {
            0
        }
    }

    /// Whether a running sequence's planned prefill chunk could lend budget to a waiting one
    /// (`Scheduler::reclaimable`): O(running).
    fn may_lend(&self) -> bool {
        self.plan.seqs[..self.running_len]
            .iter()
            .any(|e| e.is_prefill && e.num_new_tokens > 0)
    }

    /// Charges a scheduled chunk to the budgets.
    fn charge(&mut self, seq: &Sequence, num_new: usize) {
        self.budget -= num_new;
        self.logit_rows -= Self::logit_charge(seq, num_new);
    }

    /// Refunds an unscheduled chunk.
    fn refund(&mut self, seq: &Sequence, num_new: usize) {
        self.budget += num_new;
        self.logit_rows += Self::logit_charge(seq, num_new);
    }
}

impl Scheduler {
    /// Plans the next step at `now`.
    pub fn schedule(&mut self, now: Timestamp) -> StepPlan {
        let mut plan = StepPlan::default();
        self.schedule_into(now, &mut plan);
        plan
    }

    /// Like [`Scheduler::schedule`], reusing `plan`'s allocations: plans, then commits the
    /// block changes to the scheduler's own pool. With the pool detached, use
    /// [`Scheduler::plan_into`] and [`Scheduler::assign_blocks`] instead.
    pub fn schedule_into(&mut self, now: Timestamp, plan: &mut StepPlan) {
        if self.allocator.is_none() {
            // A caller bug: the plan would carry reserved, unassigned blocks.
            self.pool_errors += 1;
            plan.seqs.clear();
            plan.preempted.clear();
            plan.kv_offloads.clear();
            plan.kv_loads.clear();
            plan.kv_stores.clear();
            plan.num_batched_tokens = 0;
            return;
        }
        let commit = self.plan_into(now, plan);
        let mut ids = std::mem::take(&mut self.assigned);
        ids.clear();
        let committed = match self.allocator.as_mut() {
            Some(pool) => pool.commit(&commit, &mut ids).is_ok(),
            None => false,
        };
        if !committed || self.assign_blocks(plan, &ids).is_err() || !self.commit_shares() {
            self.pool_errors += 1;
        }
        self.assigned = ids;
    }

    /// Plans the next step against the ledger and returns the block changes to commit to the
    /// allocator; fresh blocks appear as [`PENDING_BLOCK`](crate::PENDING_BLOCK) until
    /// [`Scheduler::assign_blocks`].
    pub fn plan_into(&mut self, now: Timestamp, plan: &mut StepPlan) -> KvCommit {
        self.plan_inner(now, plan, false).unwrap_or_default()
    }

    /// Like [`Scheduler::schedule`], while steps are in flight ([`Scheduler::launch`]ed, not
    /// yet resolved): the plan may feed pending tokens, but it never preempts. When the
    /// running sequences do not all fit, it plans nothing and returns `None` (that step is
    /// planned after the outputs are in); when an admission would have needed a preemption,
    /// it admits no further and [`Scheduler::take_preemption_wanted`] says so.
    pub fn schedule_ahead(&mut self, now: Timestamp) -> Option<StepPlan> {
        if self.allocator.is_none() {
            self.pool_errors += 1; // a caller bug, as in `schedule_into`
            return None;
        }
        let mut plan = StepPlan::default();
        let commit = self.plan_inner(now, &mut plan, true)?;
        let mut ids = std::mem::take(&mut self.assigned);
        ids.clear();
        let committed = match self.allocator.as_mut() {
            Some(pool) => pool.commit(&commit, &mut ids).is_ok(),
            None => false,
        };
        if !committed || self.assign_blocks(&mut plan, &ids).is_err() || !self.commit_shares() {
            self.pool_errors += 1;
        }
        self.assigned = ids;
        Some(plan)
    }

    /// [`Scheduler::schedule_ahead`] against the ledger, for a detached allocator (see
    /// [`Scheduler::plan_into`]).
    pub fn plan_ahead_into(&mut self, now: Timestamp, plan: &mut StepPlan) -> Option<KvCommit> {
        self.plan_inner(now, plan, true)
    }

    /// Whether a plan made ahead held back an admission that needed a preemption (cleared by
    /// the call): the caller should resolve its steps in flight before planning the next.
    pub fn take_preemption_wanted(&mut self) -> bool {
        std::mem::take(&mut self.preemption_wanted)
    }

    fn plan_inner(&mut self, now: Timestamp, plan: &mut StepPlan, ahead: bool) -> Option<KvCommit> {
        plan.preempted.clear();
        plan.timed_out.clear();
        plan.kv_offloads.clear();
        plan.kv_loads.clear();
        plan.kv_stores.clear();
        plan.num_batched_tokens = 0;
        self.last_slots.clear();
        self.plan_loads.clear();
        self.plan_shares.clear();
        self.release_out_of_window();
        let ctx = StepContext {
            now,
            max_num_batched_tokens: self.config.max_num_batched_tokens,
            max_num_seqs: self.config.max_num_seqs,
            seqs: &self.seqs,
            running: &self.running,
            waiting: &self.waiting,
        };
        let budget = self
            .policy
            .token_budget(&ctx)
            .clamp(1, self.config.max_num_batched_tokens);
        let mut b = Building {
            plan,
            len: 0,
            budget,
            step_budget: budget,
            running_len: 0,
            logit_rows: self
                .config
                .max_logit_rows
                .saturating_sub(self.config.max_num_seqs),
            ahead,
            owed: None,
        };
        let mut order = std::mem::take(&mut self.order);
        let mut ranked = if ahead {
            if self.schedule_all_running(&mut b) {
                None
            } else if self.schedule_ranked_ahead(now, &mut order, &mut b) {
                Some(order.len())
            } else {
                // Rolled back: nothing planned, nothing changed.
                self.order = order;
                b.plan.seqs.truncate(0);
                return None;
            }
        } else {
            self.schedule_running(now, &mut order, &mut b)
        };
        b.running_len = b.len;
        // Requests that waited past their queue bound end before anything is admitted (after
        // the rollback above, so that none is lost with a plan made ahead that is dropped).
        self.expire_queued(now, &mut b.plan.timed_out);
        let running_before = self.running.len();
        if b.plan.preempted.is_empty() {
            self.admit_waiting(now, &mut order, &mut ranked, &mut b);
        }
        if !ahead {
            self.add_drafts(&mut b);
        }
        self.order = order;
        b.plan.seqs.truncate(b.len);
        let seqs = &self.seqs;
        let admitted_any = self.running.len() != running_before;
        if !b.plan.preempted.is_empty() {
            self.running
                .retain(|&s| slot_ref(seqs, s).is_some_and(|q| q.state == RequestState::Running));
        }
        // Admissions push to `running` (their waiting entries are dropped here).
        if admitted_any || !b.plan.preempted.is_empty() {
            self.waiting.retain(|&s| {
                slot_ref(seqs, s).is_some_and(|q| {
                    matches!(q.state, RequestState::Waiting | RequestState::Preempted)
                })
            });
        }
        Some(self.ledger.take_commit())
    }

    fn rank_into(&self, slots: &[u32], now: Timestamp, out: &mut Vec<Ranked>) {
        out.clear();
        for &slot in slots {
            if let Some(s) = self.seq(slot) {
                out.push(Ranked {
                    rank: self.policy.rank(SeqView::new(s), now),
                    arrival: s.req.arrival,
                    id: s.id,
                    slot,
                });
            }
        }
    }
}

fn slot_ref(seqs: &[Option<Sequence>], slot: u32) -> Option<&Sequence> {
    seqs.get(slot as usize).and_then(|s| s.as_ref())
}

#[cfg(test)]
mod tests;
