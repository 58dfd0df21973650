//! The registry of LoRA adapter names, as the server's LoRA manager bounds it
//! (`lora.max_adapters`, `actors/src/actors/lora.rs`), beside the adapters' host memory
//! ([`crate::lora_memory`]), which only ever holds registered adapters.
//!
//! On the server at most `max_adapters` names are registered at once: the configuration's
//! adapters from the start and those found in `lora.adapter_dirs` from their first request,
//! which registers them. The simulator's configured adapters are the configuration's
//! `lora.adapters`: the spec's `pinned` ones (`pinned: true`: registered, in memory and never
//! dropped) and its `registered` ones (entries without `pinned`: registered from the start,
//! and dropped from memory as any other, then read again on their next request, the server's
//! `reload`, without registering them again). Neither kind is ever unregistered to make room:
//! the server's `room_victim` only picks adapters found in a directory (`discovered`), so the
//! configured ones hold their places for the whole run. Every other adapter is taken to be one
//! found in a directory. A found adapter stays registered after it is evicted from memory,
//! holding its place, until a registration into the full registry needs it: then the manager
//! unregisters the one that `room_victim` names, the least recently used found adapter that no
//! request holds, those not in memory first (by registration order, as the server walks its
//! list), and the unregistered adapter is found again, and read again, on its next request.
//! The manager decides this for a request whose adapter is not registered, as its message
//! comes up (`register_held`, called through `discover`):
//!
//! - the registry is full and every found adapter in it is held by a request (or there are
//!   none, all its places the configuration's): refused before any read, with
//!   `LoraError::Busy`, the client's 503 `unavailable` (outcome [`crate::report::UNAVAILABLE`]);
//! - else, before a read into full memory (`make_read_room`), once the tenant's share has made
//!   its room, the victim is chosen and dropped from memory (it stays registered until the
//!   read ends), then memory is made room in as for any read;
//! - once the adapter has been read (and its tenant's share has room), that victim (if it can
//!   still go), else the next, is unregistered (`make_room`); should none be left (all came
//!   into use during the read), the request is refused then, the adapter read and not kept.
//!
//! So memory never holds more than `max_adapters` adapters, in use or not: below
//! `max_cpu_loras` the registry is memory's bound, and the adapters a workload holds at once
//! beyond it are refused rather than kept. A registered adapter that was evicted (a configured
//! one or a found one) is read again for its request without any of this (the manager's
//! `reload`): a configured adapter's requests are never refused for the registry, and each
//! configured adapter leaves one place fewer for the found ones.

use std::collections::{BTreeMap, BTreeSet};

/// Most adapters `max_adapters` may register (the server's bound on `lora.max_adapters`).
pub const MAX_ADAPTERS: usize = 4096;

/// `max_adapters` when a spec leaves it out: the server's default for `lora.max_adapters`.
pub fn default_max_adapters() -> usize {
    switchyard_config::LoraSection::default().max_adapters
}

/// The registered adapters: the configuration's and the found ones, with the order of their
/// registration.
#[derive(Clone, Debug)]
pub(crate) struct Registry {
    /// Most adapters registered at once (`max_adapters`).
    max: usize,
    /// The configuration's adapters (`lora.adapters`, pinned or not), registered from the
    /// start and never unregistered.
    configured: BTreeSet<u32>,
    /// The adapters registered on their first request, with their registration's number.
    found: BTreeMap<u32, u64>,
    /// The next registration's number.
    next: u64,
}

impl Registry {
    /// A registry of at most `max` adapters holding the configuration's `configured` ones
    /// (at most `max`, as the server's configuration check has it).
    pub(crate) fn new(max: usize, configured: impl IntoIterator<Item = u32>) -> Self {
        Registry {
            max,
            configured: configured.into_iter().collect(),
            found: BTreeMap::new(),
            next: 0,
        }
    }

    /// Whether `adapter` is registered: one of the configuration's, or one found on a
    /// request and not unregistered since.
    pub(crate) fn is_registered(&self, adapter: u32) -> bool {
        self.configured.contains(&adapter) || self.found.contains_key(&adapter)
    }

    /// Whether one more registration needs a found adapter to go.
    pub(crate) fn is_full(&self) -> bool {
        self.configured.len() + self.found.len() >= self.max
    }

    /// The registered adapters, the configuration's included.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.configured.len() + self.found.len()
    }

    /// The found adapters registered, in id order.
    pub(crate) fn found(&self) -> Vec<u32> {
        self.found.keys().copied().collect()
    }

    /// Registers `adapter`, found on a request (not registered), after the others.
    pub(crate) fn register(&mut self, adapter: u32) {
        debug_assert!(!self.is_registered(adapter), "{adapter} registered twice");
        self.found.insert(adapter, self.next);
        self.next += 1;
    }

    /// Unregisters the found adapter `adapter`.
    pub(crate) fn unregister(&mut self, adapter: u32) {
        self.found.remove(&adapter);
    }

    /// The found adapters that may be unregistered to make room (none of `in_use`, the
    /// adapters requests hold), each with its order of choice: not in memory (`resident` has
    /// each adapter in memory with when it was last used, a time above 0) before in memory,
    /// then the least recently used, then the first registered.
    fn victims<'a>(
        &'a self,
        resident: &'a BTreeMap<u32, u64>,
        in_use: &'a BTreeMap<u32, u32>,
    ) -> impl Iterator<Item = ((u64, u64), u32)> + 'a {
        self.found
            .iter()
            .filter(|(a, _)| !in_use.contains_key(a))
            .map(|(a, order)| ((resident.get(a).copied().unwrap_or(0), *order), *a))
    }

    /// The found adapter a registration into the full registry unregisters next (the
    /// server's `room_victim`), if any can go.
    pub(crate) fn victim(
        &self,
        resident: &BTreeMap<u32, u64>,
        in_use: &BTreeMap<u32, u32>,
    ) -> Option<u32> {
        self.victims(resident, in_use).min().map(|(_, a)| a)
    }

    /// Whether `adapter` is one that may be unregistered to make room.
    pub(crate) fn can_go(
        &self,
        adapter: u32,
        resident: &BTreeMap<u32, u64>,
        in_use: &BTreeMap<u32, u32>,
    ) -> bool {
        self.victims(resident, in_use).any(|(_, a)| a == adapter)
    }
}

#[cfg(test)]
#[path = "lora_registry_tests.rs"]
mod tests;
