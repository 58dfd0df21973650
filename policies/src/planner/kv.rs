//! The planner's KV part, once a plan is built: the ids the allocator gave the plan's reserved
//! blocks go into the block tables and the plan's block deltas (`assign_blocks`,
//! `fill_tables`), the table entries that share a block the same plan loads get its id
//! (`resolve_shares`, `commit_shares`), and with a host KV tier the plan gets its loads and
//! offloads (`host_copies`, see `host_tier.rs`).

use crate::block_ledger::{PENDING_BLOCK, RELEASED_BLOCK, SHARED_LOAD_BLOCK};
use crate::error::SchedulerError;
use crate::scheduler::Scheduler;
use crate::types::{BlockCopy, BlockId, StepPlan};

use super::slot_ref;

impl Scheduler {
    /// With the scheduler's own pool: commits at once the references [`Scheduler::assign_blocks`]
    /// added for the blocks sequences of the plan share as they are loaded (an allocator
    /// actor gets them with the next commit instead). False when the pool refuses them.
    pub(super) fn commit_shares(&mut self) -> bool {
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
    /// (`kv_loads`, `kv_offloads`, `kv_stores`). `plan` is the one [`Scheduler::plan_into`] just built.
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
            self.host_copies(plan, 0);
            return Ok(());
        }
        let filled = self
            .fill_tables(plan, ids)
            .and_then(|()| self.resolve_shares(plan));
        // The evictions happened whatever the tables: their offloads belong to this plan.
        self.host_copies(plan, ids.len());
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

    /// With a host tier, once the plan's blocks have their ids (`allocated` of them): the
    /// loads of the prefixes its admissions found in the host tier (their sources pinned for
    /// the plan first), then the offloads of the cached blocks its allocations evicted, in
    /// device order, then the stores ahead of eviction (see `host_tier.rs`).
    fn host_copies(&mut self, plan: &mut StepPlan, allocated: usize) {
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
        // A plan that runs nothing (the last step of the last request, planned while it runs)
        // leaves its stores queued: a backend would make them before the next step's copies,
        // on the critical path, while the next plan that runs a step makes them beside it.
        if self.config.kv_offload_ahead && !plan.seqs.is_empty() {
            self.host_stores(plan, allocated);
        }
    }

    /// The plan's stores ahead of eviction: blocks registered in the prefix cache, oldest
    /// first, that still hold their prefix and that the host tier lacks, at most
    /// [`STORES_PER_PLAN`] plus twice the blocks this plan allocated (so stores keep pace with
    /// the blocks being filled, and a burst is spread over several steps). Every one was
    /// computed by a step launched before this plan's: blocks are registered when a step is
    /// launched ([`Scheduler::launch`]) or resolved, so after its plan's copies were decided;
    /// the property tests check that no store reads a block before the step that fills it.
    ///
    /// A block is stored once it is computed, not once it is freed: in a busy cache a freed
    /// block is evicted within a step or two (on an H200, Llama-3-8B on the Mooncake trace with
    /// a 2,048-block cache, stores of freed blocks caught 3,922 of 79,528 before their
    /// eviction), while a block is computed a whole request's life before it can be evicted.
    fn host_stores(&mut self, plan: &mut StepPlan, allocated: usize) {
        let Some(host) = self.host.as_mut() else {
            return;
        };
        let budget = STORES_PER_PLAN.saturating_add(allocated.saturating_mul(2));
        let mut chosen = std::mem::take(&mut self.store_scratch);
        chosen.clear();
        self.ledger.take_registered(&mut chosen);
        self.store_queue.extend(chosen.drain(..));
        // At most one entry a block holds its registration: past one a block, drop the
        // others (evicted, or cleared after a failed step).
        if self.store_queue.len() > self.ledger.num_blocks() {
            let ledger = &self.ledger;
            self.store_queue.retain(|f| ledger.holds(f));
        }
        while chosen.len() < budget {
            let Some(f) = self.store_queue.pop_front() else {
                break;
            };
            // Evicted since (its eviction offloaded it), or already in the tier (loaded from
            // there, or its prefix stored from another block before): nothing to copy.
            if self.ledger.holds(&f) && host.lookup(f.hash).is_none() {
                chosen.push(f);
            }
        }
        // In device order, as the offloads: consecutive blocks pair with consecutive host
        // blocks given in turn, one transfer a run.
        chosen.sort_unstable_by_key(|f| f.block);
        chosen.dedup_by_key(|f| f.block);
        for f in &chosen {
            if let Some(dst) = host.offload(f.hash) {
                plan.kv_stores.push(BlockCopy {
                    device: f.block,
                    host: dst,
                });
                self.kv_offloaded += 1;
                self.kv_stored_ahead += 1;
            }
        }
        chosen.clear();
        self.store_scratch = chosen;
    }
}

/// Stores ahead of eviction a plan makes at least (when that many wait), whatever it
/// allocates: a decode step allocates few blocks, and a step's copies of a few blocks take
/// microseconds beside its compute.
pub(crate) const STORES_PER_PLAN: usize = 32;
