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
//! `max_num_seqs + 1` short), plus, for a policy that asks for cached prefixes, at most
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

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasherDefault;

use crate::block_ledger::{
    BlockLedger, KvCommit, PENDING_BLOCK, RELEASED_BLOCK, SHARED_LOAD_BLOCK,
};
use crate::block_pool::PassThroughHasher;
use crate::error::SchedulerError;
use crate::policy::{PolicyEvent, StepContext};
use crate::prefix_hash::{BlockHasher, PrefixHash};
use crate::scheduler::{Ranked, Scheduler};
use crate::sequence::{SeqView, Sequence};
use crate::tier_quota::{TierQuotas, NO_TIER};
use crate::types::{
    BlockCopy, BlockId, RequestId, RequestState, ScheduledSeq, SeqEvent, StepOutput, StepPlan,
    Timestamp, PENDING_TOKEN,
};

/// The host-tier loads decided in the plan being built: for each prefix loaded, the slot of
/// the sequence whose admission decided the load and the index in its table of the device
/// block it fills ([`Scheduler`]'s `plan_loads`).
pub(crate) type PlanLoads = HashMap<PrefixHash, (u32, u32), BuildHasherDefault<PassThroughHasher>>;

/// A table entry of the plan being built that shares a block another sequence admitted in
/// the same plan loads from the host tier (a [`SHARED_LOAD_BLOCK`] until the plan's blocks
/// get their ids).
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

/// Why a waiting sequence was not admitted.
#[derive(Copy, Clone, Debug)]
struct Shortfall {
    /// Blocks missing for its whole remaining prefill.
    blocks: usize,
    /// Tokens of that chunk.
    num_new: usize,
    /// Its tier's KV quota, not the pool, is what it lacks: it is passed over, and nothing is
    /// preempted for it.
    quota: bool,
}

/// What admitting a waiting sequence takes (see `admission`).
struct Admission {
    /// Tokens its prefix match covers.
    computed: usize,
    /// Tokens of its first chunk.
    num_new: usize,
    /// Blocks to reserve for that chunk.
    need_new: usize,
    /// Blocks its whole remaining prefill takes (those of the chunk included).
    need_all: usize,
}

/// Mutable state of the plan being built.
struct Building<'p> {
    /// The plan (entries past `len` are stale buffers kept for reuse).
    plan: &'p mut StepPlan,
    /// Valid entries.
    len: usize,
    /// Tokens left in the budget.
    budget: usize,
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

    /// With the scheduler's own pool: commits at once the references [`Scheduler::assign_blocks`]
    /// added for the blocks sequences of the plan share as they are loaded (an allocator
    /// actor gets them with the next commit instead). False when the pool refuses them.
    fn commit_shares(&mut self) -> bool {
        if !self.ledger.has_uncommitted() {
            return true;
        }
        let c = self.ledger.take_commit();
        let mut none = Vec::new();
        match self.allocator.as_mut() {
            Some(pool) => pool.commit(&c, &mut none).is_ok() && none.is_empty(),
            None => false,
        }
    }

    /// Writes the ids the allocator gave this step's reserved blocks into the block tables
    /// and the plan's block deltas, and with a host KV tier adds the plan's copies
    /// (`kv_loads`, `kv_offloads`). `plan` is the one [`Scheduler::plan_into`] just built.
    pub fn assign_blocks(
        &mut self,
        plan: &mut StepPlan,
        ids: &[BlockId],
    ) -> Result<(), SchedulerError> {
        if let Err(e) = self.ledger.assign(ids) {
            // A core bug: evictions recorded before the error must not be offloaded by a
            // later plan, whose steps may have overwritten those blocks.
            let mut stale = std::mem::take(&mut self.evicted);
            self.ledger.take_evicted(&mut stale);
            stale.clear();
            self.evicted = stale;
            self.plan_shares.clear();
            self.plan_loads.clear();
            return Err(e);
        }
        if ids.is_empty() {
            // A share needs a load, and a load a reserved block: no share to resolve.
            self.plan_shares.clear();
            self.plan_loads.clear();
            return Ok(());
        }
        let filled = self
            .fill_tables(plan, ids)
            .and_then(|()| self.resolve_shares(plan));
        // The evictions happened whatever the tables: their offloads belong to this plan.
        self.host_copies(plan);
        filled
    }

    /// Gives every table entry that shares a block loaded in this plan (see
    /// [`Scheduler::assign_blocks`]'s `plan_shares`) that block's id, now in the loading
    /// sequence's table, and a reference of its own: the ledger records it now, the
    /// allocator's pool with the next commit (pins come first there, so the pool never
    /// frees the block early).
    fn resolve_shares(&mut self, plan: &mut StepPlan) -> Result<(), SchedulerError> {
        let mut shares = std::mem::take(&mut self.plan_shares);
        let mut result = Ok(());
        for sh in &shares {
            let dev = slot_ref(&self.seqs, sh.owner)
                .and_then(|q| q.block_table.get(sh.owner_at as usize).copied())
                .filter(|&d| self.ledger.ref_count(d).is_some_and(|r| r > 0) && d != PENDING_BLOCK);
            let target = self
                .seqs
                .get_mut(sh.slot as usize)
                .and_then(|s| s.as_mut())
                .and_then(|q| q.block_table.get_mut(sh.at as usize))
                .filter(|e| **e == SHARED_LOAD_BLOCK);
            let (Some(dev), Some(target)) = (dev, target) else {
                result = Err(SchedulerError::Invariant(
                    "a shared load's block is gone".into(),
                ));
                continue;
            };
            *target = dev;
            if let Some(entry) = plan.seqs.get_mut(sh.entry as usize) {
                let k = (sh.at as usize).wrapping_sub(entry.first_new_block);
                if let Some(e) = entry.new_blocks.get_mut(k) {
                    *e = dev;
                }
            }
            if let Err(e) = self.ledger.touch(dev) {
                result = Err(e);
            }
        }
        shares.clear();
        self.plan_shares = shares;
        result
    }

    /// Writes `ids` into the reserved entries of the tables of the plan's sequences.
    fn fill_tables(&mut self, plan: &mut StepPlan, ids: &[BlockId]) -> Result<(), SchedulerError> {
        if self.last_slots.len() != plan.seqs.len() {
            return Err(SchedulerError::Invariant(
                "plan does not match the last step".into(),
            ));
        }
        let mut next = ids.iter();
        for (entry, &slot) in plan.seqs.iter_mut().zip(&self.last_slots) {
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            let first = entry.first_new_block.min(seq.block_table.len());
            for b in &mut seq.block_table[first..] {
                if *b == PENDING_BLOCK {
                    *b = *next.next().ok_or_else(|| {
                        SchedulerError::Invariant("fewer ids than reserved blocks".into())
                    })?;
                }
            }
            entry.new_blocks.clear();
            entry
                .new_blocks
                .extend_from_slice(&seq.block_table[first..]);
        }
        if next.next().is_some() {
            return Err(SchedulerError::Invariant(
                "more ids than reserved blocks".into(),
            ));
        }
        Ok(())
    }

    /// With a host tier, once the plan's blocks have their ids: the loads of the prefixes its
    /// admissions found in the host tier (their sources pinned for the plan first), then the
    /// offloads of the cached blocks its allocations evicted, in device order (see
    /// `host_tier.rs`).
    fn host_copies(&mut self, plan: &mut StepPlan) {
        let Some(host) = self.host.as_mut() else {
            return;
        };
        host.begin_plan();
        for &slot in &self.last_slots {
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            if seq.host_loads.is_empty() {
                continue;
            }
            for (k, &src) in seq.host_loads.iter().enumerate() {
                match seq.block_table.get(seq.load_at + k) {
                    Some(&dst)
                        if dst != PENDING_BLOCK
                            && dst != RELEASED_BLOCK
                            && dst != SHARED_LOAD_BLOCK
                            && host.pin(src).is_ok() =>
                    {
                        plan.kv_loads.push(BlockCopy {
                            device: dst,
                            host: src,
                        });
                        self.kv_loaded += 1;
                    }
                    // Unreachable: the host tier only changes here, and the admission
                    // reserved the blocks.
                    _ => self.pool_errors += 1,
                }
            }
            seq.host_loads.clear();
        }
        self.plan_loads.clear();
        let mut evicted = std::mem::take(&mut self.evicted);
        evicted.clear();
        self.ledger.take_evicted(&mut evicted);
        // In device order, so that host blocks given in turn pair a run of consecutive device
        // blocks with one of host blocks, which a backend copies as one transfer (a request's
        // table is freed back to front, so the allocator evicts it in descending order: one
        // transfer a block). The offloads are independent: their order is free.
        evicted.sort_unstable_by_key(|&(device, _)| device);
        for &(device, hash) in &evicted {
            if let Some(dst) = host.offload(hash) {
                plan.kv_offloads.push(BlockCopy { device, host: dst });
                self.kv_offloaded += 1;
            }
        }
        self.evicted = evicted;
    }

    /// Plans the next step against the ledger and returns the block changes to commit to the
    /// allocator; fresh blocks appear as [`PENDING_BLOCK`] until [`Scheduler::assign_blocks`].
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
        };
        let budget = self
            .policy
            .token_budget(&ctx)
            .clamp(1, self.config.max_num_batched_tokens);
        let mut b = Building {
            plan,
            len: 0,
            budget,
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

    /// Speculative decoding: gives the plan's decode entries draft tokens from what the step
    /// left over (budget, logit rows, free blocks), in plan order. Never while steps are in
    /// flight (a sequence's drafts follow its known tokens) and never at the expense of
    /// anything already planned.
    fn add_drafts(&mut self, b: &mut Building<'_>) {
        let Some(cfg) = self.config.speculative.as_ref() else {
            return;
        };
        if cfg.max_running != 0 && self.running.len() > cfg.max_running {
            return;
        }
        for (n, &slot) in self.last_slots.iter().enumerate().take(b.len) {
            if b.budget == 0 || b.logit_rows == 0 {
                break;
            }
            let entry = &mut b.plan.seqs[n];
            if !entry.samples || entry.is_prefill || entry.num_new_tokens != 1 {
                continue;
            }
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            // Not on a sequence's first sampling step (its backend state still takes fed
            // tokens as prompt tokens) nor for prompt logprobs (every fed row is scored).
            if seq.pending != 0
                || !seq.req.limits.speculate
                || seq.id != entry.id
                || seq.output.is_empty()
                || seq.req.limits.prompt_logits
            {
                continue;
            }
            // At most every output but the one sampled after the drafts.
            let room = (seq.max_tokens as usize).saturating_sub(seq.output.len() + 1);
            let k = cfg
                .num_speculative_tokens
                .min(room)
                .min(b.budget)
                .min(b.logit_rows);
            if k == 0 {
                continue;
            }
            let drafts = &mut entry.draft_tokens;
            drafts.clear();
            match self.draft_source.as_mut() {
                Some(source) => {
                    source.propose(SeqView::new(seq), k, drafts);
                    drafts.truncate(k);
                }
                None => seq.ngrams.get_or_insert_with(Box::default).propose(
                    crate::prefix_hash::PromptAndOutput {
                        prompt: &seq.req.prompt,
                        output: &seq.output,
                    },
                    cfg,
                    k,
                    drafts,
                ),
            }
            // As many as the free blocks (and its tier's KV quota) can hold.
            let have = seq.block_table.len();
            let room = self.ledger.num_free().min(self.quotas.room(seq.tier));
            while !drafts.is_empty()
                && self
                    .ledger
                    .blocks_for(seq.num_computed + 1 + drafts.len())
                    .saturating_sub(have)
                    > room
            {
                drafts.pop();
            }
            let k = drafts.len();
            if k == 0 {
                continue;
            }
            let need = self
                .ledger
                .blocks_for(seq.num_computed + 1 + k)
                .saturating_sub(have);
            for _ in 0..need {
                match self.ledger.reserve() {
                    Some(blk) => {
                        seq.block_table.push(blk);
                        self.quotas.add(seq.tier, 1);
                    }
                    None => self.pool_errors += 1, // unreachable: checked above
                }
            }
            let first = entry.first_new_block.min(seq.block_table.len());
            entry.new_blocks.clear();
            entry
                .new_blocks
                .extend_from_slice(&seq.block_table[first..]);
            seq.blocks_sent = seq.block_table.len();
            entry.num_new_tokens += k;
            b.plan.num_batched_tokens += k;
            b.budget -= k;
            b.logit_rows -= k;
        }
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

    /// Schedules every running sequence's whole next chunk in queue order, in one pass.
    ///
    /// When everything fits, rank order cannot change the outcome, so ranking is skipped.
    /// Returns false, with the plan and the allocations rolled back, as soon as the budget
    /// or the free blocks would run out. (At the start of a step every running sequence
    /// has sent its whole table, so the blocks past `first_new_block` are this step's.)
    fn schedule_all_running(&mut self, b: &mut Building<'_>) -> bool {
        let (budget, logit_rows) = (b.budget, b.logit_rows);
        let mut fits = true;
        for &slot in &self.running {
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            let num_new = seq.schedulable_tokens();
            if num_new == 0 {
                continue;
            }
            let total = seq.num_computed + num_new;
            let need = self
                .ledger
                .blocks_for(total)
                .saturating_sub(seq.block_table.len());
            if num_new > b.budget.min(b.logit_cap(seq))
                || need > self.ledger.num_free()
                || need > self.quotas.room(seq.tier)
            {
                fits = false;
                break;
            }
            for _ in 0..need {
                match self.ledger.reserve() {
                    Some(blk) => {
                        seq.block_table.push(blk);
                        self.quotas.add(seq.tier, 1);
                    }
                    None => self.pool_errors += 1,
                }
            }
            write_entry(b.plan, b.len, seq, num_new);
            b.len += 1;
            b.charge(seq, num_new);
            self.last_slots.push(slot);
        }
        if !fits {
            self.unplan(b, budget, logit_rows);
        }
        fits
    }

    /// Takes back everything planned so far in this step (only running sequences' chunks: no
    /// preemption, no admission), restoring the budget and logit rows it started with.
    fn unplan(&mut self, b: &mut Building<'_>, budget: usize, logit_rows: usize) {
        for (entry, &slot) in b.plan.seqs[..b.len].iter().zip(&self.last_slots) {
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            while seq.block_table.len() > entry.first_new_block {
                if let Some(blk) = seq.block_table.pop() {
                    self.quotas.sub(seq.tier, 1);
                    if self.ledger.free(blk).is_err() {
                        self.pool_errors += 1;
                    }
                }
            }
            seq.blocks_sent = entry.first_new_block;
        }
        self.last_slots.clear();
        b.len = 0;
        b.budget = budget;
        b.logit_rows = logit_rows;
        b.plan.num_batched_tokens = 0;
    }

    /// Ahead of a step in flight, when [`Scheduler::schedule_all_running`] found the whole
    /// chunks too large: schedules the running sequences in rank order, each a chunk within
    /// what the budget leaves, as [`Scheduler::schedule_running`] does (so a long prefill
    /// does not force in-order planning). Returns false, with everything rolled back, when
    /// the blocks run out: that takes a preemption, which only an in-order plan makes.
    fn schedule_ranked_ahead(
        &mut self,
        now: Timestamp,
        order: &mut Vec<Ranked>,
        b: &mut Building<'_>,
    ) -> bool {
        let (budget, logit_rows) = (b.budget, b.logit_rows);
        self.rank_into(&self.running, now, order);
        order.sort_unstable();
        for slot in order.iter().map(|r| r.slot) {
            let Some((num_new, need)) = self.next_chunk(slot, b) else {
                continue;
            };
            if self.ledger.num_free() < need || self.quotas.room(self.tier_of(slot)) < need {
                self.unplan(b, budget, logit_rows);
                return false;
            }
            self.grow_and_emit(slot, need, num_new, b);
        }
        true
    }

    /// Schedules running sequences. Returns `Some(n)` when `order` holds them ranked (the
    /// first `n` still running), `None` when the fast path skipped ranking.
    fn schedule_running(
        &mut self,
        now: Timestamp,
        order: &mut Vec<Ranked>,
        b: &mut Building<'_>,
    ) -> Option<usize> {
        order.clear();
        if self.schedule_all_running(b) {
            return None;
        }
        self.rank_into(&self.running, now, order);
        order.sort_unstable();
        let mut end = order.len();
        let mut i = 0;
        while i < end {
            let slot = order[i].slot;
            i += 1;
            let Some((num_new, need)) = self.next_chunk(slot, b) else {
                continue;
            };
            let tier = self.tier_of(slot);
            loop {
                if self.ledger.num_free() >= need {
                    if self.quotas.room(tier) >= need {
                        self.grow_and_emit(slot, need, num_new, b);
                        break;
                    }
                    // Its tier is at its KV bound: the tier's own lowest-ranked sequence not
                    // yet scheduled gives way (possibly this one), never another tier's.
                    let j = (i..end)
                        .rev()
                        .find(|&j| self.tier_of(order[j].slot) == tier)
                        .unwrap_or(i - 1);
                    let victim = order[j].slot;
                    order[j..end].rotate_left(1);
                    end -= 1;
                    self.preempt(victim, now, b);
                    if victim == slot {
                        // The next one moved into its place.
                        i -= 1;
                        break;
                    }
                    continue;
                }
                end -= 1;
                let victim = order[end].slot;
                self.preempt(victim, now, b);
                if victim == slot {
                    break;
                }
            }
        }
        Some(end)
    }

    /// The tier position of the sequence in `slot` (see `tier_quota.rs`).
    fn tier_of(&self, slot: u32) -> u8 {
        self.seq(slot)
            .map_or(crate::tier_quota::NO_TIER, |q| q.tier)
    }

    /// A running sequence's next chunk within what the budget and the logit rows leave, and
    /// the blocks it needs beyond its table; `None` when it has nothing to schedule.
    fn next_chunk(&self, slot: u32, b: &Building<'_>) -> Option<(usize, usize)> {
        let seq = self.seq(slot)?;
        let num_new = seq.schedulable_tokens().min(b.budget).min(b.logit_cap(seq));
        if num_new == 0 {
            return None;
        }
        let need = self
            .ledger
            .blocks_for(seq.num_computed + num_new)
            .saturating_sub(seq.block_table.len());
        Some((num_new, need))
    }

    /// Allocates `need` more blocks for a running sequence and adds it to the plan.
    fn grow_and_emit(&mut self, slot: u32, need: usize, num_new: usize, b: &mut Building<'_>) {
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            return;
        };
        for _ in 0..need {
            match self.ledger.reserve() {
                Some(blk) => {
                    seq.block_table.push(blk);
                    self.quotas.add(seq.tier, 1);
                }
                None => {
                    // Unreachable: the caller checked num_free.
                    self.pool_errors += 1;
                    return;
                }
            }
        }
        write_entry(b.plan, b.len, seq, num_new);
        b.len += 1;
        b.charge(seq, num_new);
        self.last_slots.push(slot);
    }

    /// Preempts a running sequence by recompute, unscheduling it if it was planned.
    fn preempt(&mut self, slot: u32, now: Timestamp, b: &mut Building<'_>) {
        b.owed = None;
        if let Some(pos) = self.last_slots.iter().position(|&s| s == slot) {
            let removed = b.plan.seqs[pos].num_new_tokens;
            b.plan.seqs[pos..b.len].rotate_left(1);
            b.len -= 1;
            if let Some(seq) = slot_ref(&self.seqs, slot) {
                b.refund(seq, removed);
            }
            b.plan.num_batched_tokens -= removed;
            self.last_slots.remove(pos);
        }
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            return;
        };
        self.quotas.sub(seq.tier, seq.held_blocks().len());
        for &blk in seq.held_blocks().iter().rev() {
            if self.ledger.free(blk).is_err() {
                self.pool_errors += 1;
            }
        }
        seq.clear_blocks();
        seq.num_computed = 0;
        seq.drop_pending();
        seq.state = RequestState::Preempted;
        self.adapters.stopped(seq.req.lora_adapter);
        seq.queued_at = now;
        seq.num_preemptions = seq.num_preemptions.saturating_add(1);
        self.num_preemptions += 1;
        self.waiting.push(slot);
        b.plan.preempted.push(seq.id);
        self.policy
            .observe(PolicyEvent::Preempted(SeqView::new(seq)));
    }

    /// Admits waiting sequences in rank order. `order[..ranked]` is the step's ranked
    /// running set (victim candidates for policy preemption), ranked here on first need.
    fn admit_waiting(
        &mut self,
        now: Timestamp,
        order: &mut Vec<Ranked>,
        ranked: &mut Option<usize>,
        b: &mut Building<'_>,
    ) {
        if self.waiting.is_empty() || b.budget == 0 {
            return;
        }
        let step_running = self.running.len();
        self.look_up_cached_prefixes();
        let mut worder = std::mem::take(&mut self.wait_order);
        self.rank_into(&self.waiting, now, &mut worder);
        // At most max_num_seqs admissions, plus the one that fails, are ever examined, not
        // counting candidates passed over for want of an adapter slot: only when some were
        // and the first k ran out is the rest ranked too.
        let mut k = worder.len().min(self.config.max_num_seqs.saturating_add(1));
        if k > 0 && k < worder.len() {
            worder.select_nth_unstable(k - 1);
        }
        worder[..k].sort_unstable();
        let mut num_running = self.running.len();
        let mut passed_over = false;
        // The best-ranked request waiting for a LoRA adapter slot: later adapter requests may
        // pass it (as in vLLM, so that the running adapters keep their batches), but at most
        // max_num_seqs of them in all; then they wait too, the running adapters drain, and a
        // slot frees for it. Without the bound, steady traffic for the running adapters keeps
        // it waiting for as long as the traffic lasts.
        let mut slot_waiter: Option<u32> = None;
        let pass_limit = u32::try_from(self.config.max_num_seqs).unwrap_or(u32::MAX);
        // Tiers (bit = position) one of whose requests was passed over in this step for want
        // of KV quota: their later requests are passed over too, so that small requests of
        // a tier cannot keep overtaking a large one (FCFS within the tier). Other tiers'
        // requests pass: they do not take from its quota.
        let mut quota_blocked: u64 = 0;
        let tier_bit = |tier: u8| {
            if tier == NO_TIER {
                0
            } else {
                1u64.checked_shl(u32::from(tier)).unwrap_or(0)
            }
        };
        let mut i = 0;
        while i < worder.len() && b.budget > 0 {
            if i == k {
                if !passed_over {
                    break;
                }
                worder[k..].sort_unstable();
                k = worder.len();
            }
            let cand = worder[i];
            i += 1;
            // A request whose adapter would exceed max_loras distinct adapters among the
            // running sequences waits, keeping its place, and the next ones may pass it (as in
            // vLLM): decided before any preemption, so nothing is preempted on its behalf.
            // Admissions earlier in this step count; preemptions only free slots.
            let adapter = slot_ref(&self.seqs, cand.slot).and_then(|q| q.req.lora_adapter);
            if !self.adapters.admits(adapter, self.config.max_loras) {
                passed_over = true;
                slot_waiter.get_or_insert(cand.slot);
                continue;
            }
            let passes = match (adapter, slot_waiter) {
                (Some(_), Some(w)) => Some(w),
                _ => None,
            };
            if passes.is_some_and(|w| {
                slot_ref(&self.seqs, w).is_some_and(|q| q.lora_passes >= pass_limit)
            }) {
                passed_over = true;
                continue;
            }
            // A request its tier's KV quota cannot hold now waits, keeping its place, and
            // requests of other tiers may pass it; decided (in `admission`) before any
            // preemption, so nothing is preempted for quota, and only its own tier's
            // sequences ending (or being preempted) make room.
            let bit = tier_bit(self.tier_of(cand.slot));
            if quota_blocked & bit != 0 {
                continue;
            }
            if num_running >= self.config.max_num_seqs {
                let end = *ranked.get_or_insert_with(|| {
                    self.rank_into(&self.running[..step_running], now, order);
                    order.sort_unstable();
                    order.len()
                });
                // A seat and the blocks it lacks, from the same victims, or nothing: a victim
                // preempted for the seat alone is lost when the blocks then come up short.
                let short = match self.admission(cand.slot, usize::MAX, b) {
                    Ok(a) => Shortfall {
                        blocks: 0,
                        num_new: a.num_new,
                        quota: false,
                    },
                    Err(short) => short,
                };
                if short.quota {
                    passed_over = true;
                    quota_blocked |= bit;
                    continue;
                }
                let admitted =
                    self.preempt_for(cand, short.blocks, &order[..end], now, b, &mut num_running)
                        && self.try_admit(cand.slot, short.num_new, b).is_ok();
                if !admitted {
                    break;
                }
                self.admitted(cand.slot, passes, &mut num_running);
                continue;
            }
            let admitted = match self.try_admit(cand.slot, usize::MAX, b) {
                Ok(()) => true,
                Err(short) if short.quota => {
                    passed_over = true;
                    quota_blocked |= bit;
                    continue;
                }
                Err(short) => {
                    let end = *ranked.get_or_insert_with(|| {
                        self.rank_into(&self.running[..step_running], now, order);
                        order.sort_unstable();
                        order.len()
                    });
                    // The retry plans the same chunk: preempted victims give back budget
                    // (and logit rows), which would otherwise grow the chunk, and with it
                    // the blocks it needs, past what the victims were chosen to free.
                    self.preempt_for(cand, short.blocks, &order[..end], now, b, &mut num_running)
                        && self.try_admit(cand.slot, short.num_new, b).is_ok()
                }
            };
            if !admitted {
                break;
            }
            self.admitted(cand.slot, passes, &mut num_running);
        }
        self.wait_order = worder;
    }

    /// Books an admission: one more running, and one more pass of the request waiting for an
    /// adapter slot that it overtook (`passed`).
    fn admitted(&mut self, slot: u32, passed: Option<u32>, num_running: &mut usize) {
        *num_running += 1;
        if let Some(q) = self.seqs.get_mut(slot as usize).and_then(Option::as_mut) {
            q.lora_passes = 0;
            self.policy.observe(PolicyEvent::Admitted(SeqView::new(q)));
        }
        if let Some(q) = passed.and_then(|w| self.seqs.get_mut(w as usize)?.as_mut()) {
            q.lora_passes = q.lora_passes.saturating_add(1);
        }
    }

    /// Whether a waiting sequence can be admitted with a first chunk of at most `max_new`
    /// tokens: its prefix match (left in `self.matched`), and the chunk, or what is missing.
    ///
    /// The free blocks must hold its whole remaining prefill, though only the first chunk's
    /// are reserved: a request admitted for its first chunk alone preempts itself when a later
    /// chunk finds no blocks, and is admitted again the next step, over and over (vLLM V0's
    /// whole-prompt `can_allocate` check).
    fn admission(
        &mut self,
        slot: u32,
        max_new: usize,
        b: &mut Building<'_>,
    ) -> Result<Admission, Shortfall> {
        let caching = self.config.enable_prefix_caching;
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            // Not a live sequence: nothing to admit, and nothing to preempt for.
            return Ok(Admission {
                computed: 0,
                num_new: 0,
                need_new: 0,
                need_all: 0,
            });
        };
        let bs = self.ledger.block_size();
        let total = seq.num_tokens();
        let tier = seq.tier;
        self.matched.clear();
        self.shared_matched.clear();
        self.host_matched.clear();
        if caching {
            // Leave at least the last token to compute, so that a token can be sampled.
            let max_blocks = (total - 1) / bs;
            if seq.hashes.len() < max_blocks {
                let extras = seq.hash_extras();
                let mut hashes = std::mem::take(&mut seq.hashes);
                self.hasher
                    .extend_chain(&mut hashes, seq.tokens(), bs, max_blocks, extras);
                seq.hashes = hashes;
            }
            let upto = max_blocks.min(seq.hashes.len());
            self.ledger
                .match_prefix(&seq.hashes[..upto], &mut self.matched);
            // The chain goes on in the host tier: those blocks are copied back, not computed.
            // First among the loads an earlier admission of this plan decided (shared: the
            // copy runs before the step's compute), then in the tier itself, up to a block
            // this plan loads already (unreachable: a plan's loads of one chain start where
            // the device match ends, the same for every request on it).
            if let Some(host) = self.host.as_ref() {
                let mut at = self.matched.len().min(upto);
                while let Some(&owner) = seq.hashes[..upto]
                    .get(at)
                    .and_then(|h| self.plan_loads.get(h))
                {
                    self.shared_matched.push(owner);
                    at += 1;
                }
                for h in &seq.hashes[at..upto] {
                    match host.lookup(*h) {
                        Some(b) if !self.plan_loads.contains_key(h) => self.host_matched.push(b),
                        _ => break,
                    }
                }
            }
        }
        if let (Some(quota), Some(_)) = (self.quotas.cap(tier), self.config.sliding_window) {
            // Under a sliding window its tier's bound may hold a request of any length (see
            // `add_request`), but admission pins every matched block (those behind the window
            // go back a step later): a hit longer than the bound would keep it waiting
            // forever, so it uses no more of the hit than the bound holds with a first chunk
            // of the largest size (the same however the step's budget moves, so that the retry
            // after a preemption plans what the victims were chosen for).
            let chunk = self.config.max_num_batched_tokens;
            while let Some(k) =
                (self.matched.len() + self.shared_matched.len() + self.host_matched.len())
                    .checked_sub(1)
            {
                let tokens = (k + 1) * bs;
                if self.ledger.blocks_for(tokens + (total - tokens).min(chunk)) <= quota {
                    break;
                }
                if self.host_matched.pop().is_none() && self.shared_matched.pop().is_none() {
                    self.matched.truncate(k);
                }
            }
        }
        // Blocks it holds without reserving them: those the device cache holds and those an
        // earlier admission of this plan loads.
        let held = self.matched.len() + self.shared_matched.len();
        let computed = (held + self.host_matched.len()) * bs;
        let num_new = (total - computed)
            .min(b.budget)
            .min(b.logit_cap(seq))
            .min(max_new);

        let need_new = self.ledger.blocks_for(computed + num_new) - held;
        let mut need_all = self.ledger.blocks_for(total) - held;
        if let Some(cap) = self.window_cap() {
            // Under a sliding window the prefill holds at most `cap` blocks at once (the
            // matched ones count: the first steps give back those behind the window).
            need_all = need_all.min(cap.saturating_sub(held).max(need_new));
        }
        // Matched blocks nobody references are counted free but are pinned, not allocated.
        let evictable = self
            .matched
            .iter()
            .filter(|&&blk| self.ledger.ref_count(blk) == Some(0))
            .count();
        // The running sequences' own known tokens come first: blocks they will take for the
        // rest of their prefills (admitted for a first chunk) are not free for this one.
        let owed = match b.owed {
            Some(owed) => owed,
            None => *b.owed.insert(self.blocks_owed()),
        };
        if let Some(quota) = self.quotas.cap(tier) {
            // Its tier's bound: what the tier holds, what its running sequences owe, and
            // every block this one will hold for its prefill (the matched ones too).
            let tier_owed = self.tier_owed.get(usize::from(tier)).copied().unwrap_or(0);
            let want = held + need_all;
            if self.quotas.held(tier) + tier_owed + want > quota {
                return Err(Shortfall {
                    blocks: 0,
                    num_new,
                    quota: true,
                });
            }
        }
        let available = self
            .ledger
            .num_free()
            .saturating_sub(evictable)
            .saturating_sub(owed);
        if available < need_all {
            return Err(Shortfall {
                blocks: need_all - available,
                num_new,
                quota: false,
            });
        }
        Ok(Admission {
            computed,
            num_new,
            need_new,
            need_all,
        })
    }

    /// Blocks the running sequences still need for the tokens they hold (the rest of a prefill
    /// admitted for its first chunk, a token past a full block): O(running), and only when
    /// something waits. Leaves each tier's share in `self.tier_owed`.
    fn blocks_owed(&mut self) -> usize {
        let mut tier_owed = std::mem::take(&mut self.tier_owed);
        tier_owed.iter_mut().for_each(|o| *o = 0);
        let mut total = 0;
        for q in self
            .running
            .iter()
            .filter_map(|&slot| slot_ref(&self.seqs, slot))
            .filter(|q| q.state == RequestState::Running)
        {
            let owed = self.owed_by(q);
            total += owed;
            if let Some(o) = tier_owed.get_mut(usize::from(q.tier)) {
                *o += owed;
            }
        }
        self.tier_owed = tier_owed;
        total
    }

    /// Blocks a running sequence still needs for the tokens it holds: the rest of its table
    /// or, under a sliding window, at most what it may hold at once less what it holds.
    fn owed_by(&self, q: &Sequence) -> usize {
        let rest = self
            .ledger
            .blocks_for(q.num_tokens())
            .saturating_sub(q.block_table.len());
        match self.window_cap() {
            Some(cap) => rest.min(cap.saturating_sub(q.held_blocks().len())),
            None => rest,
        }
    }

    /// Under a sliding window, the most blocks a sequence holds at once: those of its window
    /// and the keys read before it (see [`Scheduler::release_out_of_window`]) and of a chunk
    /// of `max_num_batched_tokens`, each span's partial blocks at both ends included.
    pub(crate) fn window_cap(&self) -> Option<usize> {
        let w = self.config.sliding_window?;
        Some(w.blocks_held(self.ledger.block_size(), self.config.max_num_batched_tokens))
    }

    /// Gives back the leading blocks of running sequences that hold only keys before every
    /// window their next steps read: the next query of a sequence at `num_computed` attends
    /// from `num_computed + 1 - window` on, the backend may read `read_slack` keys before
    /// that, and a step that fails (or several in flight) moves a sequence back by at most
    /// `WINDOW_MARGIN` positions. Prefix-cached blocks are given back once registered, so
    /// they stay in the cache (evictable) for requests with the same prefix. O(running).
    ///
    /// A step launched earlier may still read a block given back here: the allocator hands
    /// it to a sequence in a later step, whose writes the device orders after that step's
    /// reads (the executors run steps in order).
    fn release_out_of_window(&mut self) {
        let Some(w) = self.config.sliding_window else {
            return;
        };
        let bs = self.ledger.block_size();
        let caching = self.config.enable_prefix_caching;
        let behind = w.tokens_kept();
        for &slot in &self.running {
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            if seq.state != RequestState::Running {
                continue;
            }
            let mut upto = (seq.num_computed.saturating_sub(behind) / bs)
                .min(seq.blocks_sent)
                .min(seq.block_table.len());
            if caching {
                upto = upto.min(seq.num_cached_blocks);
            }
            while seq.released_blocks < upto {
                let i = seq.released_blocks;
                let blk = std::mem::replace(&mut seq.block_table[i], RELEASED_BLOCK);
                if blk == PENDING_BLOCK || self.ledger.free(blk).is_err() {
                    self.pool_errors += 1;
                }
                self.quotas.sub(seq.tier, 1);
                seq.released_blocks += 1;
            }
        }
    }

    /// Admits one waiting sequence with a first chunk of at most `max_new` tokens if
    /// [`Scheduler::admission`] allows it; otherwise returns what was missing, leaving the
    /// sequence's prefix match in `self.matched` (for `preempt_for`).
    fn try_admit(
        &mut self,
        slot: u32,
        max_new: usize,
        b: &mut Building<'_>,
    ) -> Result<(), Shortfall> {
        let Admission {
            mut computed,
            num_new,
            mut need_new,
            mut need_all,
        } = self.admission(slot, max_new, b)?;
        let caching = self.config.enable_prefix_caching;
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            return Ok(());
        };
        let total = seq.num_tokens();
        seq.clear_blocks();
        for &blk in &self.matched {
            if self.ledger.touch(blk).is_err() {
                // Unreachable (the prefix index only holds ids of the pool): the ledger is
                // corrupt. The prefix stops before the block, so that the table stays aligned
                // with positions: what follows is computed again, and counted as not cached.
                self.pool_errors += 1;
                break;
            }
            seq.block_table.push(blk);
        }
        let pinned = seq.block_table.len();
        if pinned < self.matched.len() {
            // The chunk starts earlier but spans as many blocks (the prefix is whole blocks);
            // the rest of the prefill needs the blocks left out.
            computed = pinned * self.ledger.block_size();
            need_all += self.matched.len() - pinned;
            self.matched.truncate(pinned);
            // The host hits (loaded here or by another admission) no longer follow the
            // pinned prefix: computed too.
            need_all += self.shared_matched.len();
            self.shared_matched.clear();
            self.host_matched.clear();
            need_new = self.ledger.blocks_for(computed + num_new) - pinned;
        }
        // Blocks another admission of this plan loads: shared, resolved with the block ids.
        for &(owner, owner_at) in &self.shared_matched {
            self.plan_shares.push(PlanShare {
                entry: b.len as u32,
                slot,
                at: seq.block_table.len() as u32,
                owner,
                owner_at,
            });
            seq.block_table.push(SHARED_LOAD_BLOCK);
        }
        // Running now, it owes the rest of its prefill's blocks.
        if let Some(owed) = b.owed.as_mut() {
            *owed += need_all - need_new;
            if let Some(o) = self.tier_owed.get_mut(usize::from(seq.tier)) {
                *o += need_all - need_new;
            }
        }
        for _ in 0..need_new {
            match self.ledger.reserve() {
                Some(blk) => seq.block_table.push(blk),
                None => self.pool_errors += 1,
            }
        }
        self.quotas.add(seq.tier, seq.block_table.len());
        if !self.host_matched.is_empty() {
            // Copied in with this plan (`host_copies`), and registered in the device cache
            // when launched, as the blocks it computes. Until then the plan's later
            // admissions find them in `plan_loads` and share them. The tier's tokens count
            // once, for the admission that loads them (a sharer's are device hits).
            seq.load_at = self.matched.len() + self.shared_matched.len();
            seq.host_loads.extend_from_slice(&self.host_matched);
            for k in 0..self.host_matched.len() {
                let at = seq.load_at + k;
                if let Some(&h) = seq.hashes.get(at) {
                    self.plan_loads.insert(h, (slot, at as u32));
                }
            }
            self.host_hit_tokens += (self.host_matched.len() * self.ledger.block_size()) as u64;
        }
        seq.num_computed = computed;
        seq.num_cached_blocks = self.matched.len();
        seq.cached_prefix = None;
        // Reported once, as vLLM's `num_cached_tokens`: the recompute after a preemption
        // reuses blocks the request computed itself, which the client was not spared.
        seq.first_cached
            .get_or_insert(u32::try_from(computed.min(seq.prompt_len)).unwrap_or(u32::MAX));
        seq.state = RequestState::Running;
        self.adapters.started(seq.req.lora_adapter);
        if caching {
            self.prefix_queries += total as u64;
            self.prefix_hits += computed as u64;
        }
        write_entry(b.plan, b.len, seq, num_new);
        b.len += 1;
        b.charge(seq, num_new);
        self.last_slots.push(slot);
        self.running.push(slot);
        Ok(())
    }

    /// Preempts running sequences the policy allows (lowest rank first, only ranks after
    /// `cand`) if together they free a seat and `blocks` blocks; otherwise preempts nothing.
    ///
    /// With `blocks > 0`, `self.matched` must hold `cand`'s prefix match (from the
    /// `try_admit` that came up short). A block counts as freed when the victims
    /// hold all its references, unless `cand` matched it: such a block only turns from pinned
    /// into evictable-but-matched, which `try_admit` does not count as available, so counting
    /// it would preempt victims for an admission that then fails.
    fn preempt_for(
        &mut self,
        cand: Ranked,
        blocks: usize,
        running: &[Ranked],
        now: Timestamp,
        b: &mut Building<'_>,
        num_running: &mut usize,
    ) -> bool {
        let mut victims = std::mem::take(&mut self.victims);
        victims.clear();
        let mut freed = 0usize;
        let reused: HashSet<BlockId> = if blocks > 0 {
            self.matched.iter().copied().collect()
        } else {
            HashSet::new()
        };
        // References the victims chosen so far hold to blocks shared with other sequences.
        let mut shared: HashMap<BlockId, u32> = HashMap::new();
        if let Some(w) = slot_ref(&self.seqs, cand.slot) {
            for r in running.iter().rev() {
                if *r <= cand {
                    break;
                }
                let Some(v) = slot_ref(&self.seqs, r.slot) else {
                    continue;
                };
                if v.state != RequestState::Running
                    || !self
                        .policy
                        .may_preempt(SeqView::new(w), SeqView::new(v), now)
                {
                    continue;
                }
                if blocks > 0 {
                    // Blocks it still owes its known tokens were counted as taken (see
                    // `blocks_owed`): preempted, it owes nothing.
                    freed += self.owed_by(v);
                    for &blk in v.held_blocks() {
                        let last_ref = match self.ledger.ref_count(blk) {
                            Some(1) => true,
                            Some(refs) if refs > 1 => {
                                let held = shared.entry(blk).or_insert(0);
                                *held += 1;
                                *held == refs
                            }
                            _ => false,
                        };
                        if last_ref && !reused.contains(&blk) {
                            freed += 1;
                        }
                    }
                }
                victims.push(r.slot);
                if freed >= blocks {
                    break;
                }
            }
        }
        let mut ok = !victims.is_empty() && freed >= blocks;
        if ok && b.ahead {
            // No preemption while steps are in flight: the caller plans again after them.
            self.preemption_wanted = true;
            ok = false;
        }
        if ok {
            for &v in &victims {
                self.preempt(v, now, b);
                *num_running = num_running.saturating_sub(1);
            }
        }
        self.victims = victims;
        ok
    }

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

fn slot_ref(seqs: &[Option<Sequence>], slot: u32) -> Option<&Sequence> {
    seqs.get(slot as usize).and_then(|s| s.as_ref())
}

#[cfg(test)]
#[path = "planner_tests.rs"]
mod tests;
