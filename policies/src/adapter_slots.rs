//! LoRA adapter slots: how many running sequences use each adapter, kept up to date as
//! sequences enter and leave the running set, so that admission checks
//! [`crate::SchedulerConfig::max_loras`] in O(1) and without allocating.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::scheduler::IdHasher;

/// Per-adapter counts of running sequences, and of live requests that name an adapter.
#[derive(Debug, Default)]
pub(crate) struct AdapterSlots {
    /// Running sequences per adapter; only adapters with at least one (so `len()` is the
    /// number of distinct adapters in the running set).
    running: HashMap<u32, u32, BuildHasherDefault<IdHasher>>,
    /// Running sequences that name an adapter (the sum of `running`'s values).
    running_seqs: usize,
    /// Live (waiting or running) requests that name an adapter.
    live: usize,
}

impl AdapterSlots {
    /// Empty, with room for `max_loras` adapters (capped, the map grows if ever needed).
    pub(crate) fn new(max_loras: usize) -> Self {
        Self {
            running: HashMap::with_capacity_and_hasher(max_loras.min(64), Default::default()),
            running_seqs: 0,
            live: 0,
        }
    }

    /// Whether a sequence using `adapter` may join the running set without more than
    /// `max_loras` distinct adapters in it: no adapter, one already running, or a free slot.
    #[inline]
    pub(crate) fn admits(&self, adapter: Option<u32>, max_loras: usize) -> bool {
        match adapter {
            None => true,
            Some(a) => self.running.len() < max_loras || self.running.contains_key(&a),
        }
    }

    /// A request entered the scheduler (waiting).
    pub(crate) fn arrived(&mut self, adapter: Option<u32>) {
        if adapter.is_some() {
            self.live += 1;
        }
    }

    /// A request ended (from any live state; call [`AdapterSlots::stopped`] first if it
    /// was running).
    pub(crate) fn ended(&mut self, adapter: Option<u32>) {
        if adapter.is_some() {
            self.live -= 1;
        }
    }

    /// A sequence joined the running set.
    pub(crate) fn started(&mut self, adapter: Option<u32>) {
        if let Some(a) = adapter {
            *self.running.entry(a).or_insert(0) += 1;
            self.running_seqs += 1;
        }
    }

    /// A sequence left the running set (preempted, finished or aborted); its adapter's
    /// slot is free once no running sequence uses it.
    pub(crate) fn stopped(&mut self, adapter: Option<u32>) {
        let Some(a) = adapter else { return };
        if let Some(n) = self.running.get_mut(&a) {
            *n -= 1;
            if *n == 0 {
                self.running.remove(&a);
            }
            self.running_seqs -= 1;
        }
    }

    /// Distinct adapters among the running sequences.
    pub(crate) fn num_running_adapters(&self) -> usize {
        self.running.len()
    }

    /// Waiting requests that name an adapter.
    pub(crate) fn num_waiting_requests(&self) -> usize {
        self.live - self.running_seqs
    }

    /// Running sequences using `adapter`.
    pub(crate) fn running_count(&self, adapter: u32) -> u32 {
        self.running.get(&adapter).copied().unwrap_or(0)
    }

    /// Compares the counts with a recount: `running` and `waiting` are the adapters of the
    /// running and the waiting sequences. Returns what differs.
    pub(crate) fn check(
        &self,
        running: impl Iterator<Item = Option<u32>>,
        waiting: impl Iterator<Item = Option<u32>>,
    ) -> Result<(), String> {
        let mut recount: HashMap<u32, u32> = HashMap::new();
        let mut running_seqs = 0usize;
        for a in running.flatten() {
            *recount.entry(a).or_insert(0) += 1;
            running_seqs += 1;
        }
        let waiting_seqs = waiting.flatten().count();
        if recount.len() != self.running.len()
            || recount.iter().any(|(&a, &n)| self.running_count(a) != n)
        {
            return Err(format!(
                "adapter counts {:?}, running sequences use {:?}",
                self.running, recount
            ));
        }
        if running_seqs != self.running_seqs || running_seqs + waiting_seqs != self.live {
            return Err(format!(
                "{} running and {} live adapter requests counted, {running_seqs} running and \
                 {waiting_seqs} waiting found",
                self.running_seqs, self.live
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_free_when_the_last_sequence_of_an_adapter_stops() {
        let mut s = AdapterSlots::new(2);
        for a in [Some(1), Some(1), Some(2), None] {
            s.arrived(a);
            s.started(a);
        }
        s.arrived(Some(3));
        assert_eq!(s.num_running_adapters(), 2);
        assert_eq!(s.num_waiting_requests(), 1);
        assert!(s.admits(None, 2) && s.admits(Some(1), 2) && s.admits(Some(2), 2));
        assert!(!s.admits(Some(3), 2));
        s.stopped(Some(1));
        assert!(
            !s.admits(Some(3), 2),
            "adapter 1 still has a running sequence"
        );
        s.stopped(Some(1));
        s.ended(Some(1));
        assert!(s.admits(Some(3), 2));
        assert_eq!(s.running_count(1), 0);
        s.check([Some(2), None].into_iter(), [Some(3), Some(1)].into_iter())
            .unwrap();
        assert!(s.check([Some(2)].into_iter(), [None].into_iter()).is_err());
    }
}
