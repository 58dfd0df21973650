//! The LoRA adapters in host memory, as the server's LoRA manager keeps them
//! (`actors/src/actors/lora.rs`), on the simulator's virtual clock.
//!
//! The server keeps at most `lora.max_cpu_loras` adapters in memory. A request names its
//! adapter once its prompt is encoded (after the front end, holding its seat, before the
//! scheduler sees it): an adapter in memory is taken from the registry at once, without the
//! manager; any other is resolved by the manager's one thread, which handles its messages one
//! at a time in the order they came (FIFO) and reads an adapter's files when the adapter is
//! still not in memory as its message is handled. So loads are serialized; a second request
//! for an adapter being loaded queues behind that load (and behind whatever other messages
//! came between) and finds it in memory when its turn comes. The request holds the adapter
//! from then until it ends. After each message (a load or not) the manager evicts: while more
//! than `max_cpu_loras` adapters are in memory it drops the least recently used one that no
//! request holds and that is not pinned; before a read into full memory it drops them down to
//! one fewer, so that the adapter being read fits too (the server's `make_read_room`, which
//! makes the tenant's room in its share first then); adapters in use or pinned stay, so while
//! more of them than `max_cpu_loras` exist, more stay in memory, and the excess goes at the
//! manager's next message (a request served from memory while it is over the limit sends it
//! one, as the server's registry flags it). "Recently used" is the registry's clock: it ticks
//! when a request takes an adapter from memory and when a load puts one there.
//!
//! A load is charged to the tenant of the request whose message started it, within the
//! share of its tier (`tiers.<name>.max_cpu_loras_per_tenant`), as the server's manager
//! charges it (`make_share_room`): when the adapters charged to the tenant fill its share and
//! every one of them is in use, the request is refused before the read (the server's 429,
//! outcome `tenant_busy`); else, once the adapter has been read (before, when memory is full),
//! the tenant's least recently used adapter that no request holds is dropped (never another
//! tenant's) to make room, and
//! should its adapters have all come into use during the read, the request is refused then
//! (the adapter read and not kept). An adapter in memory serves every request, whoever it is
//! charged to, and a request taking one from memory is charged nothing. Pinned adapters,
//! never loaded, are no tenant's. A tenant is its name, whatever its tier; each load uses its request's tier's
//! share (a load in a tier without one is charged all the same).
//!
//! The charge follows use when the share needs room, as the server's `share_step` moves it:
//! an adapter charged to the tenant that none of its requests holds but other tenants'
//! requests do is charged to the one of those with the most room in its share (the share of
//! its latest request's tier; a tier without one: all the room; ties: the first by name),
//! when that one has room, before any of the tenant's adapters is dropped; with none unused
//! to drop, such an adapter's charge moves all the same, its user then beyond its share
//! (refused while its requests use all of its adapters; its unused adapters dropped at its
//! next load). A refusal is left only for a share that the adapters the tenant's own
//! requests use fill, decided before the read for all the steps (`share_fits`). The eviction for `max_cpu_loras` drops the unused adapters of tenants beyond their
//! share first, then the least recently used.
//!
//! At the start memory holds what the server's start leaves there: it registers the
//! adapters of `lora.adapters` in the file's order, reading each, and evicts after each
//! registration, so the pinned ones stay and, of the others (the spec's `registered`, in their
//! order), the last `max_cpu_loras - pinned` do, the earlier ones being the least recently
//! used; those are in memory from the start, charged to no tenant (an operator's), and go as
//! any other when memory needs room. The reads of the start, before the first request, are
//! not counted (nor are the pinned ones'). Every other adapter is loaded on its first
//! request, as the server loads one found in `lora.adapter_dirs`, or one of `lora.adapters`
//! evicted (charged to its request's tenant either way, as the server charges a reload). The
//! registry's bound (`lora.max_adapters`) is modelled beside memory
//! ([`crate::lora_registry`]): the configured adapters, pinned or not, hold their places from
//! the start and are never unregistered; an adapter not registered is registered as it is
//! read (a found adapter unregistered for it when the registry is full), or refused
//! (`unavailable`, the server's 503) when the registry is full of configured adapters and
//! found ones in use; an adapter evicted but still registered (a configured one, or a found
//! one not unregistered since) is only read again.
//! What the model leaves out: a request's name
//! check in `lora.adapter_dirs` before the front end (a look at the directories that reads
//! nothing: the load is the one modelled here). Loads never fail here: every adapter's files
//! are taken to be sound. On the server, files a load would refuse for their configuration or
//! the header of their weights (a check of kilobytes, before `make_read_room` makes room)
//! drop nothing; only a read that passes that check and still fails (values that are not
//! finite, files changed in between) leaves the room it made free.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::lora_registry::Registry;

/// Most adapters `max_cpu_loras` may keep (the server's bound on `lora.max_cpu_loras`).
pub const MAX_CPU_LORAS: usize = 4096;
/// Longest time to read one adapter's files, in milliseconds (10 minutes).
pub const MAX_LOAD_MS: f64 = 600_000.0;

/// Checks a time to read one adapter, in milliseconds (`what` names it in the message).
pub fn check_load_ms(what: &str, ms: f64) -> Result<(), String> {
    if (0.0..=MAX_LOAD_MS).contains(&ms) {
        Ok(())
    } else {
        Err(format!(
            "{what} {} outside 0..={MAX_LOAD_MS} (milliseconds to read one adapter from its \
             files)",
            crate::spec::short_number(ms)
        ))
    }
}

/// The settings of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryConfig {
    /// Most adapters kept in memory, those in use included (`lora.max_cpu_loras`).
    pub max_cpu_loras: usize,
    /// Adapters never evicted (at most `max_cpu_loras`), in memory from the start.
    pub pinned: BTreeSet<u32>,
    /// The configuration's adapters that are not pinned (`lora.adapters` entries without
    /// `pinned: true`), in the file's order, none of them pinned too: registered from the
    /// start and never unregistered; the last `max_cpu_loras - pinned` of them are in memory
    /// from the start, and each is evicted, and read again, as any other.
    pub registered: Vec<u32>,
    /// Time to read one adapter from its files, in microseconds.
    pub load_us: u64,
    /// Most adapters registered at once, the pinned and `registered` ones included
    /// (`lora.max_adapters`, [`crate::lora_registry`]).
    pub max_adapters: usize,
}

/// The tenant a load is charged to (its id in [`LoraMemory`]'s table) and the share of its
/// request's tier (`None`: unbounded; the load is charged all the same, as on the server).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Charge {
    tenant: u32,
    share: Option<usize>,
}

/// A message to the manager's thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Message {
    /// Request `req` needs `adapter`, which was not in memory when it asked; a load is
    /// charged to `charge`.
    Resolve {
        adapter: u32,
        req: usize,
        charge: Charge,
    },
    /// Evict again (the registry was left over the limit).
    Evict,
}

/// What the manager's thread is doing.
#[derive(Clone, Copy, Debug)]
struct Load {
    /// When it ends.
    end: u64,
    /// The adapter being read.
    adapter: u32,
    /// The request whose message started it.
    req: usize,
    /// Who it is charged to.
    charge: Charge,
    /// The adapter is not registered: it is registered once read, a found adapter
    /// unregistered for it when the registry is full.
    registers: bool,
    /// The found adapter chosen to be unregistered for it before the read (dropped from
    /// memory then), if one was.
    unregisters: Option<u32>,
}

/// Where a tenant's share stands before one more load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ShareRoom {
    /// The share has room (or there is no share).
    Room,
    /// The share is full; this adapter's charge moves to the tenant given (one whose requests
    /// use it, and none of the charged tenant's).
    Move(u32, Charge),
    /// The share is full; this adapter of the tenant's, the least recently used that no
    /// request holds, would go.
    Drop(u32),
    /// The share is full of adapters in use: the request is refused.
    Full,
}

/// What the memory answered, at the times it did: the requests that got their adapter, those
/// refused by their tenant's full share (`tenant_busy`) and those refused by a full registry
/// (`unavailable`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answers {
    /// (time, request) of the requests that now hold their adapter.
    pub served: Vec<(u64, usize)>,
    /// (time, request) of the requests refused by their tenant's share (the server's 429).
    pub refused: Vec<(u64, usize)>,
    /// (time, request) of the requests refused because their adapter was not registered and
    /// the registry was full of adapters that could not go (the server's 503).
    pub unavailable: Vec<(u64, usize)>,
}

impl Answers {
    /// Empties the lists.
    pub fn clear(&mut self) {
        self.served.clear();
        self.refused.clear();
        self.unavailable.clear();
    }
}

/// The figures of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryCounters {
    /// Adapters read from their files.
    pub loads: u64,
    /// Adapters dropped from memory (those of `share_evictions` included).
    pub evictions: u64,
    /// Of which dropped to make room in their tenant's share.
    pub share_evictions: u64,
    /// Requests refused because their tenant's share was full of adapters in use.
    pub share_refusals: u64,
    /// Adapters whose charge moved to a tenant whose requests used them, to make room in the
    /// share of the tenant charged (whose requests did not).
    pub share_transfers: u64,
    /// Found adapters unregistered to make room in the full registry for another (those in
    /// memory then dropped from it, and counted in `evictions` too).
    pub unregistrations: u64,
    /// Requests refused because their adapter was not registered and the registry was full
    /// of adapters in use or configured (pinned or `registered`: `unavailable`).
    pub registry_refusals: u64,
}

/// The adapters in memory and the manager's thread.
#[derive(Clone, Debug)]
pub struct LoraMemory {
    config: MemoryConfig,
    /// Adapters in memory, with the registry's clock when last used.
    resident: BTreeMap<u32, u64>,
    /// Requests holding each adapter (entries go with their last request).
    in_use: BTreeMap<u32, u32>,
    /// Per adapter and tenant, the requests of the tenant holding it, with the tenant's
    /// share as its latest request's tier gave it (entries go with their last request).
    users: BTreeMap<(u32, u32), (u32, Option<usize>)>,
    /// The tenant each adapter in memory is charged to, with the share of the tier it was
    /// charged under (pinned ones are no tenant's).
    owner: BTreeMap<u32, Charge>,
    /// The registered adapters (`max_adapters`).
    registry: Registry,
    /// Tenants' ids, by name.
    tenants: BTreeMap<String, u32>,
    /// The registry's clock.
    clock: u64,
    /// Set when an eviction left more than `max_cpu_loras` in memory.
    over_limit: bool,
    /// Messages waiting for the manager's thread, with the time each was sent.
    queue: VecDeque<(u64, Message)>,
    /// The load in progress, if any.
    loading: Option<Load>,
    counters: MemoryCounters,
    /// At each read's start, the adapters in memory and whether one could have been dropped.
    #[cfg(test)]
    read_starts: Vec<(usize, bool)>,
}

impl LoraMemory {
    /// Memory as the server's start leaves it, the manager idle: the pinned adapters, and
    /// the last of the `registered` ones that fit beside them in `max_cpu_loras`, each used
    /// after the one before it (the server reads them in the file's order, each evicting the
    /// least recently used beyond its bound).
    pub fn new(config: MemoryConfig) -> Self {
        let room = config.max_cpu_loras.saturating_sub(config.pinned.len());
        let kept = &config.registered[config.registered.len().saturating_sub(room)..];
        let mut clock = 0;
        let resident = config
            .pinned
            .iter()
            .chain(kept)
            .map(|&a| {
                clock += 1;
                (a, clock)
            })
            .collect();
        let configured = config.pinned.iter().chain(&config.registered).copied();
        LoraMemory {
            registry: Registry::new(config.max_adapters, configured),
            config,
            resident,
            in_use: BTreeMap::new(),
            users: BTreeMap::new(),
            owner: BTreeMap::new(),
            tenants: BTreeMap::new(),
            clock,
            over_limit: false,
            queue: VecDeque::new(),
            loading: None,
            counters: MemoryCounters::default(),
            #[cfg(test)]
            read_starts: Vec::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &MemoryConfig {
        &self.config
    }

    /// Loads and evictions so far.
    pub fn counters(&self) -> MemoryCounters {
        self.counters
    }

    /// Whether `adapter` is in memory.
    pub fn is_resident(&self, adapter: u32) -> bool {
        self.resident.contains_key(&adapter)
    }

    /// The adapters in memory, in id order.
    pub fn resident(&self) -> Vec<u32> {
        self.resident.keys().copied().collect()
    }

    /// The adapters some request holds, in id order.
    pub fn in_use(&self) -> Vec<u32> {
        self.in_use.keys().copied().collect()
    }

    /// The adapters registered on a request (the pinned ones aside), in id order.
    pub fn registered(&self) -> Vec<u32> {
        self.registry.found()
    }

    /// Request `req` of `tenant` asks for `adapter` at `now` (its prompt encoded), its tier's
    /// share being `share` (`max_cpu_loras_per_tenant`; `None`: unbounded): `true` when it
    /// took the adapter from memory at once; else it waits, and [`LoraMemory::advance`]
    /// reports when it has it or is refused. Requests the manager answers at once (it was
    /// idle) are reported in `out` at `now`.
    pub fn request(
        &mut self,
        now: u64,
        adapter: u32,
        req: usize,
        (tenant, share): (&str, Option<usize>),
        out: &mut Answers,
    ) -> bool {
        let next = self.tenants.len() as u32;
        let charge = Charge {
            tenant: *self.tenants.entry(tenant.to_owned()).or_insert(next),
            share,
        };
        if self.resident.contains_key(&adapter) {
            self.take(adapter, charge);
            if std::mem::take(&mut self.over_limit) {
                self.send(now, Message::Evict, out);
            }
            return true;
        }
        self.send(
            now,
            Message::Resolve {
                adapter,
                req,
                charge,
            },
            out,
        );
        false
    }

    /// A request of `tenant` holding `adapter` ended.
    pub fn release(&mut self, adapter: u32, tenant: &str) {
        if let Some(n) = self.in_use.get_mut(&adapter) {
            *n -= 1;
            if *n == 0 {
                self.in_use.remove(&adapter);
            }
        }
        let Some(&t) = self.tenants.get(tenant) else {
            return;
        };
        if let Some((n, _)) = self.users.get_mut(&(adapter, t)) {
            *n -= 1;
            if *n == 0 {
                self.users.remove(&(adapter, t));
            }
        }
    }

    /// When the load in progress ends, if one is.
    pub fn next_event(&self) -> Option<u64> {
        self.loading.map(|l| l.end)
    }

    /// Ends the load in progress if it ends by `now`, and handles the messages queued behind
    /// it that need no load; the requests served or refused, with the time they were, go to
    /// `out`. Returns whether a load ended.
    pub fn advance(&mut self, now: u64, out: &mut Answers) -> bool {
        let Some(load) = self.loading.filter(|l| l.end <= now) else {
            return false;
        };
        self.loading = None;
        self.counters.loads += 1;
        // Room in the share, then in the registry, is made once the adapter has been read.
        if !self.make_share_room(load.charge) {
            self.counters.share_refusals += 1;
            out.refused.push((load.end, load.req));
        } else if load.registers && !self.make_registry_room(load.unregisters) {
            self.counters.registry_refusals += 1;
            out.unavailable.push((load.end, load.req));
        } else {
            if load.registers {
                self.registry.register(load.adapter);
            }
            self.owner.insert(load.adapter, load.charge);
            self.take(load.adapter, load.charge);
            out.served.push((load.end, load.req));
        }
        self.evict();
        self.run_queue(load.end, out);
        true
    }

    /// Queues `msg` sent at `now`, handling it at once if the manager is idle.
    fn send(&mut self, now: u64, msg: Message, out: &mut Answers) {
        self.queue.push_back((now, msg));
        if self.loading.is_none() {
            self.run_queue(now, out);
        }
    }

    /// The idle manager handles its queued messages from `now` until one needs a load.
    fn run_queue(&mut self, now: u64, out: &mut Answers) {
        while self.loading.is_none() {
            let Some((sent, msg)) = self.queue.pop_front() else {
                return;
            };
            let at = now.max(sent);
            match msg {
                Message::Evict => self.evict(),
                Message::Resolve {
                    adapter,
                    req,
                    charge,
                } if self.resident.contains_key(&adapter) => {
                    self.take(adapter, charge);
                    self.evict();
                    out.served.push((at, req));
                }
                // Not registered (found in a directory, registered as it is read): refused
                // before anything else when the registry is full of adapters that cannot go
                // (the server's `register_held`, before the share's check). A registered one
                // (configured, or found and not unregistered since) is only read again.
                Message::Resolve { adapter, req, .. }
                    if !self.registry.is_registered(adapter)
                        && self.registry.is_full()
                        && self.registry_victim().is_none() =>
                {
                    self.counters.registry_refusals += 1;
                    self.evict();
                    out.unavailable.push((at, req));
                }
                // Refused before the read: the tenant's share is full of adapters that no
                // step of `make_share_room` can move or drop.
                Message::Resolve { req, charge, .. } if !self.share_fits(charge) => {
                    self.counters.share_refusals += 1;
                    self.evict();
                    out.refused.push((at, req));
                }
                Message::Resolve {
                    adapter,
                    req,
                    charge,
                } => {
                    let registers = !self.registry.is_registered(adapter);
                    // Room made before the read when memory is full (the server's
                    // `make_read_room`); refused should the share have filled since the check.
                    let Some(unregisters) = self.make_read_room(charge, registers) else {
                        self.counters.share_refusals += 1;
                        self.evict();
                        out.refused.push((at, req));
                        continue;
                    };
                    #[cfg(test)]
                    self.note_read_start();
                    self.loading = Some(Load {
                        end: at.saturating_add(self.config.load_us),
                        adapter,
                        req,
                        charge,
                        registers,
                        unregisters,
                    });
                }
            }
        }
    }

    /// A request of `charge`'s tenant takes `adapter` from memory, marking it used.
    fn take(&mut self, adapter: u32, charge: Charge) {
        self.clock += 1;
        self.resident.insert(adapter, self.clock);
        *self.in_use.entry(adapter).or_default() += 1;
        let user = self.users.entry((adapter, charge.tenant)).or_default();
        *user = (user.0 + 1, charge.share);
    }

    /// `tenant`'s name (the server breaks ties between tenants by name).
    fn name_of(&self, tenant: u32) -> Option<&str> {
        self.tenants
            .iter()
            .find(|(_, &t)| t == tenant)
            .map(|(name, _)| name.as_str())
    }

    /// The adapters charged to `tenant`.
    fn charged(&self, tenant: u32) -> usize {
        self.owner.values().filter(|o| o.tenant == tenant).count()
    }

    /// Where `charge`'s tenant's share stands: the adapters in memory charged to it against
    /// its share (pinned adapters, never loaded, are no tenant's), and what makes room next
    /// (the server's `share_step`).
    fn share_room(&self, charge: Charge) -> ShareRoom {
        let Some(share) = charge.share else {
            return ShareRoom::Room;
        };
        let theirs: Vec<u32> = self
            .owner
            .iter()
            .filter(|(_, o)| o.tenant == charge.tenant)
            .map(|(a, _)| *a)
            .collect();
        if theirs.len() < share {
            return ShareRoom::Room;
        }
        let used = |a: &u32| self.resident.get(a).copied().unwrap_or(0);
        // Per adapter only other tenants' requests use: the user with the most room, and it.
        let movable: Vec<(i64, u64, u32, Charge)> = theirs
            .iter()
            .filter_map(|&a| {
                let users: Vec<Charge> = self
                    .users
                    .range((a, 0)..=(a, u32::MAX))
                    .map(|(&(_, tenant), &(_, share))| Charge { tenant, share })
                    .collect();
                if users.iter().any(|u| u.tenant == charge.tenant) {
                    return None;
                }
                let room = |u: &Charge| match u.share {
                    Some(s) => s as i64 - self.charged(u.tenant) as i64,
                    None => i64::MAX,
                };
                let (room, to) = users
                    .into_iter()
                    .map(|u| (room(&u), u))
                    .min_by_key(|(room, u)| (std::cmp::Reverse(*room), self.name_of(u.tenant)))?;
                Some((room, used(&a), a, to))
            })
            .collect();
        if let Some(&(_, _, a, to)) = movable
            .iter()
            .filter(|(room, ..)| *room > 0)
            .min_by_key(|(_, used, ..)| *used)
        {
            return ShareRoom::Move(a, to);
        }
        if let Some(a) = theirs
            .iter()
            .filter(|a| !self.in_use.contains_key(a))
            .min_by_key(|a| used(a))
        {
            return ShareRoom::Drop(*a);
        }
        movable
            .into_iter()
            .min_by_key(|(room, used, ..)| (std::cmp::Reverse(*room), *used))
            .map_or(ShareRoom::Full, |(_, _, a, to)| ShareRoom::Move(a, to))
    }

    /// Whether [`Self::make_share_room`] ends with room in `charge`'s tenant's share (the
    /// server's `share_fits`): each of its steps moves or drops one of the tenant's adapters,
    /// and every one that no request holds, or that only other tenants' requests hold, can go;
    /// so there is room unless those held by the tenant's own requests fill the share.
    fn share_fits(&self, charge: Charge) -> bool {
        let Some(share) = charge.share else {
            return true;
        };
        let stay = self
            .owner
            .iter()
            .filter(|(a, o)| {
                o.tenant == charge.tenant
                    && self.in_use.contains_key(a)
                    && (self
                        .users
                        .range((**a, 0)..=(**a, u32::MAX))
                        .next()
                        .is_none()
                        || self.users.contains_key(&(**a, charge.tenant)))
            })
            .count();
        stay < share
    }

    /// Makes room in `charge`'s tenant's share for one more adapter, as [`Self::share_room`]
    /// says, step by step: charges moved to other tenants using adapters, the tenant's least
    /// recently used adapters that no request holds dropped; `false` (the request refused)
    /// when every one left is in use by the tenant's own requests.
    fn make_share_room(&mut self, charge: Charge) -> bool {
        loop {
            match self.share_room(charge) {
                ShareRoom::Room => return true,
                ShareRoom::Full => return false,
                ShareRoom::Move(adapter, to) => {
                    self.owner.insert(adapter, to);
                    self.counters.share_transfers += 1;
                }
                ShareRoom::Drop(victim) => {
                    self.resident.remove(&victim);
                    self.owner.remove(&victim);
                    self.counters.evictions += 1;
                    self.counters.share_evictions += 1;
                }
            }
        }
    }

    /// Makes room for an adapter about to be read, as the server's `make_read_room` does, so
    /// that the adapters in memory and the one being read are at most `max_cpu_loras`: once
    /// memory is full, the tenant's share makes its room first (before the read, where it is
    /// otherwise made once the adapter has been read), then, for an adapter to be registered
    /// (`registers`) into a full registry, the found adapter it will unregister is chosen
    /// and dropped from memory (returned: it is unregistered once the read ends), then the
    /// least recently used adapters that no request holds go as [`Self::evict`] drops them;
    /// adapters in use and pinned ones stay, and the read goes ahead all the same. `None`:
    /// the share could not make room (the request is refused).
    fn make_read_room(&mut self, charge: Charge, registers: bool) -> Option<Option<u32>> {
        let max = self.config.max_cpu_loras;
        if self.resident.len() < max {
            return Some(None);
        }
        if !self.make_share_room(charge) {
            return None;
        }
        let mut unregisters = None;
        if registers && self.resident.len() >= max && self.registry.is_full() {
            unregisters = self.registry_victim();
            if let Some(victim) = unregisters {
                self.drop_from_memory(victim);
            }
        }
        self.evict_to(max.saturating_sub(1));
        Some(unregisters)
    }

    /// The found adapter a registration into the full registry unregisters next (the least
    /// recently used that no request holds, those not in memory first), if any can go.
    fn registry_victim(&self) -> Option<u32> {
        self.registry.victim(&self.resident, &self.in_use)
    }

    /// Makes room in the registry for one more adapter, just read, as the server's
    /// `make_room` does: while it is full, `first` (the adapter chosen before the read, if it
    /// can still go), else [`Self::registry_victim`], is unregistered (dropped from memory
    /// too); `false` (the request refused) when none can go.
    fn make_registry_room(&mut self, mut first: Option<u32>) -> bool {
        while self.registry.is_full() {
            let first = first
                .take()
                .filter(|&f| self.registry.can_go(f, &self.resident, &self.in_use));
            let Some(victim) = first.or_else(|| self.registry_victim()) else {
                return false;
            };
            self.registry.unregister(victim);
            self.drop_from_memory(victim);
            self.counters.unregistrations += 1;
        }
        true
    }

    /// Drops `adapter` from memory (and its charge) if it is there, counting an eviction.
    fn drop_from_memory(&mut self, adapter: u32) {
        if self.resident.remove(&adapter).is_some() {
            self.owner.remove(&adapter);
            self.counters.evictions += 1;
        }
    }

    /// Records what memory holds as a read starts: the adapters in memory and whether one of
    /// them could have been dropped.
    #[cfg(test)]
    fn note_read_start(&mut self) {
        let droppable = self
            .resident
            .keys()
            .any(|a| !self.in_use.contains_key(a) && !self.config.pinned.contains(a));
        self.read_starts.push((self.resident.len(), droppable));
    }

    /// Drops the least recently used adapters that no request holds and that are not pinned
    /// while more than `max_cpu_loras` are in memory, those of tenants charged beyond their
    /// share (the share of the tier each adapter was charged under) first.
    fn evict(&mut self) {
        self.evict_to(self.config.max_cpu_loras);
    }

    /// [`Self::evict`] down to `limit` adapters (`max_cpu_loras` or fewer); `over_limit` is
    /// set against `max_cpu_loras`.
    fn evict_to(&mut self, limit: usize) {
        while self.resident.len() > limit {
            let beyond = |a: &u32| {
                self.owner
                    .get(a)
                    .is_some_and(|o| o.share.is_some_and(|s| self.charged(o.tenant) > s))
            };
            let victim = self
                .resident
                .iter()
                .filter(|(a, _)| !self.in_use.contains_key(a) && !self.config.pinned.contains(a))
                .min_by_key(|(a, used)| (!beyond(a), **used))
                .map(|(a, _)| *a);
            let Some(victim) = victim else { break };
            self.resident.remove(&victim);
            self.owner.remove(&victim);
            self.counters.evictions += 1;
        }
        self.over_limit = self.resident.len() > self.config.max_cpu_loras;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LOAD: u64 = 1_000;

    fn memory(max: usize, pinned: &[u32]) -> LoraMemory {
        registry_of(max, pinned, crate::lora_registry::MAX_ADAPTERS)
    }

    /// [`memory`] with a registry of at most `max_adapters` adapters.
    fn registry_of(max: usize, pinned: &[u32], max_adapters: usize) -> LoraMemory {
        configured_of(max, pinned, &[], max_adapters)
    }

    /// [`registry_of`] with the configuration's unpinned adapters `registered` too.
    fn configured_of(
        max: usize,
        pinned: &[u32],
        registered: &[u32],
        max_adapters: usize,
    ) -> LoraMemory {
        LoraMemory::new(MemoryConfig {
            max_cpu_loras: max,
            pinned: pinned.iter().copied().collect(),
            registered: registered.to_vec(),
            load_us: LOAD,
            max_adapters,
        })
    }

    /// Asks for `adapter` for `req` at `now`, of a tenant without a share; the requests
    /// served at once.
    fn ask(m: &mut LoraMemory, now: u64, adapter: u32, req: usize) -> (bool, Vec<(u64, usize)>) {
        let (now_resident, out) = ask_as(m, now, adapter, req, ("", None));
        assert!(out.refused.is_empty());
        (now_resident, out.served)
    }

    /// Asks for `adapter` for `req` of `tenant` (with its share) at `now`; the answers given
    /// at once.
    fn ask_as(
        m: &mut LoraMemory,
        now: u64,
        adapter: u32,
        req: usize,
        tenant: (&str, Option<usize>),
    ) -> (bool, Answers) {
        let mut out = Answers::default();
        let now_resident = m.request(now, adapter, req, tenant, &mut out);
        (now_resident, out)
    }

    /// Reads each of `loads` (an adapter, for a request numbered as it, of a tenant) in turn,
    /// one load time apart, starting at 0; the reads keep their requests.
    fn read_in_turn(m: &mut LoraMemory, loads: &[(u32, (&str, Option<usize>))]) {
        for (i, &(adapter, tenant)) in loads.iter().enumerate() {
            let t = i as u64 * LOAD;
            assert!(!ask_as(m, t, adapter, adapter as usize, tenant).0);
            run_to(m, t + LOAD);
        }
    }

    /// Runs the manager up to `now`; the requests served.
    fn run_to(m: &mut LoraMemory, now: u64) -> Vec<(u64, usize)> {
        let out = answers_to(m, now);
        assert!(out.refused.is_empty());
        out.served
    }

    /// Runs the manager up to `now`; its answers.
    fn answers_to(m: &mut LoraMemory, now: u64) -> Answers {
        let mut out = Answers::default();
        while m.advance(now, &mut out) {}
        out
    }

    #[test]
    fn the_least_recently_used_adapter_no_request_holds_is_evicted() {
        let mut m = memory(2, &[]);
        for (t, a) in [(0, 1), (LOAD, 2)] {
            assert_eq!(ask(&mut m, t, a, a as usize), (false, vec![]));
            assert_eq!(run_to(&mut m, t + LOAD), vec![(t + LOAD, a as usize)]);
            m.release(a, "");
        }
        // 1 used again, after 2: 2 is the least recently used.
        assert_eq!(ask(&mut m, 3 * LOAD, 1, 10), (true, vec![]));
        m.release(1, "");
        assert!(!ask(&mut m, 3 * LOAD, 3, 11).0);
        assert_eq!(run_to(&mut m, 4 * LOAD), vec![(4 * LOAD, 11)]);
        assert_eq!(m.resident(), vec![1, 3]);
        assert_eq!(
            m.counters(),
            MemoryCounters {
                loads: 3,
                evictions: 1,
                ..MemoryCounters::default()
            }
        );
    }

    #[test]
    fn pinned_adapters_start_in_memory_and_are_never_evicted() {
        let mut m = memory(2, &[7]);
        assert_eq!(m.resident(), vec![7]);
        assert_eq!(ask(&mut m, 0, 7, 0), (true, vec![]));
        m.release(7, "");
        // 7 is the least recently used each time, yet 1 and then 2 go.
        for (i, a) in [1u32, 2, 3].into_iter().enumerate() {
            let t = i as u64 * LOAD;
            assert!(!ask(&mut m, t, a, a as usize).0);
            assert_eq!(run_to(&mut m, t + LOAD), vec![(t + LOAD, a as usize)]);
            m.release(a, "");
        }
        assert_eq!(m.resident(), vec![3, 7]);
        assert_eq!(m.counters().evictions, 2);
    }

    #[test]
    fn adapters_in_use_are_never_evicted_and_the_excess_goes_once_released() {
        let mut m = memory(1, &[]);
        assert!(!ask(&mut m, 0, 1, 0).0);
        run_to(&mut m, LOAD);
        assert!(!ask(&mut m, LOAD, 2, 1).0);
        run_to(&mut m, 2 * LOAD);
        // Both held: both stay, over the limit.
        assert_eq!(m.resident(), vec![1, 2]);
        m.release(1, "");
        // The next request served from memory sends the manager an eviction.
        assert_eq!(ask(&mut m, 2 * LOAD, 2, 2), (true, vec![]));
        assert_eq!(m.resident(), vec![2]);
        assert_eq!(m.counters().evictions, 1);
    }

    #[test]
    fn loads_are_serialized_in_the_order_asked() {
        let mut m = memory(8, &[]);
        assert!(!ask(&mut m, 0, 1, 0).0);
        assert!(!ask(&mut m, 10, 2, 1).0);
        assert!(!ask(&mut m, 20, 3, 2).0);
        // One load at a time: each starts when the one before ends.
        assert_eq!(m.next_event(), Some(LOAD));
        assert_eq!(run_to(&mut m, LOAD), vec![(LOAD, 0)]);
        assert_eq!(m.next_event(), Some(2 * LOAD));
        assert_eq!(
            run_to(&mut m, 10 * LOAD),
            vec![(2 * LOAD, 1), (3 * LOAD, 2)]
        );
        assert_eq!(m.counters().loads, 3);
        assert_eq!(m.next_event(), None);
    }

    #[test]
    fn a_request_for_an_adapter_being_loaded_waits_for_that_load() {
        let mut m = memory(8, &[]);
        assert!(!ask(&mut m, 0, 1, 0).0);
        // Asked during the load: not in memory yet, so it queues, and finds it loaded.
        assert!(!ask(&mut m, 400, 1, 1).0);
        assert_eq!(run_to(&mut m, LOAD), vec![(LOAD, 0), (LOAD, 1)]);
        assert_eq!(m.counters().loads, 1);
        assert_eq!(m.in_use(), vec![1]);
        // Behind another adapter's load, it waits for that one too, as on the manager's
        // one thread.
        let mut m = memory(8, &[]);
        ask(&mut m, 0, 1, 0);
        ask(&mut m, 1, 2, 1);
        ask(&mut m, 2, 1, 2);
        assert_eq!(
            run_to(&mut m, 5 * LOAD),
            vec![(LOAD, 0), (2 * LOAD, 1), (2 * LOAD, 2)]
        );
    }

    #[test]
    fn a_full_share_drops_the_tenant_s_own_least_recently_used_adapter_never_another_s() {
        let mut m = memory(8, &[]);
        let (a, b) = (("a", Some(2)), ("b", Some(2)));
        // b's 10 is the oldest in memory, then a's 1 and 2; a uses 1 again.
        for (t, (adapter, tenant)) in [(10, b), (1, a), (2, a)].into_iter().enumerate() {
            let t = t as u64 * LOAD;
            assert!(!ask_as(&mut m, t, adapter, adapter as usize, tenant).0);
            assert_eq!(run_to(&mut m, t + LOAD), vec![(t + LOAD, adapter as usize)]);
            m.release(adapter, tenant.0);
        }
        assert!(ask_as(&mut m, 3 * LOAD, 1, 20, a).0);
        m.release(1, "a");
        // a's share is full: its own least recently used (2) goes, once 3 has been read,
        // though memory has room and b's 10 is older.
        assert!(!ask_as(&mut m, 3 * LOAD, 3, 21, a).0);
        assert_eq!(m.resident(), vec![1, 2, 10]);
        assert_eq!(run_to(&mut m, 4 * LOAD), vec![(4 * LOAD, 21)]);
        assert_eq!(m.resident(), vec![1, 3, 10]);
        assert_eq!(
            m.counters(),
            MemoryCounters {
                loads: 4,
                evictions: 1,
                share_evictions: 1,
                share_refusals: 0,
                share_transfers: 0,
                ..MemoryCounters::default()
            }
        );
        // In a tier without a share, a's load drops nothing, yet is charged to a: its next
        // load within the share of 2 drops two of its three, the least recently used that
        // no request holds (1, then 4; 3 is still held by request 21).
        assert!(!ask_as(&mut m, 4 * LOAD, 4, 22, ("a", None)).0);
        run_to(&mut m, 5 * LOAD);
        assert_eq!(m.resident(), vec![1, 3, 4, 10]);
        m.release(4, "a");
        assert!(!ask_as(&mut m, 5 * LOAD, 5, 23, a).0);
        run_to(&mut m, 6 * LOAD);
        assert_eq!(m.resident(), vec![3, 5, 10]);
        assert_eq!(m.counters().share_evictions, 3);
    }

    #[test]
    fn a_share_full_of_adapters_in_use_is_refused_before_the_read() {
        let mut m = memory(8, &[]);
        let a = ("a", Some(1));
        assert!(!ask_as(&mut m, 0, 1, 0, a).0);
        run_to(&mut m, LOAD);
        // 1 is held: a's next load is refused when its message is handled, reading nothing.
        let (now_resident, out) = ask_as(&mut m, LOAD, 2, 1, a);
        assert!(!now_resident);
        assert_eq!(out.refused, vec![(LOAD, 1)]);
        assert!(out.served.is_empty());
        assert_eq!(m.next_event(), None);
        // Another tenant loads 2; in memory, it serves a too, uncharged.
        assert!(!ask_as(&mut m, LOAD, 2, 2, ("b", Some(1))).0);
        assert_eq!(run_to(&mut m, 2 * LOAD), vec![(2 * LOAD, 2)]);
        assert!(ask_as(&mut m, 2 * LOAD, 2, 3, a).0);
        // Behind a load, a refusal comes when the manager reaches the message.
        assert!(!ask_as(&mut m, 2 * LOAD, 3, 4, ("b", None)).0);
        assert!(!ask_as(&mut m, 2 * LOAD + 1, 4, 5, a).0);
        let out = answers_to(&mut m, 3 * LOAD);
        assert_eq!(
            (out.served, out.refused),
            (vec![(3 * LOAD, 4)], vec![(3 * LOAD, 5)])
        );
        // Once 1 is released, a's load drops it from its share.
        m.release(1, "a");
        assert!(!ask_as(&mut m, 3 * LOAD, 5, 6, a).0);
        assert_eq!(run_to(&mut m, 4 * LOAD), vec![(4 * LOAD, 6)]);
        assert_eq!(m.resident(), vec![2, 3, 5]);
        assert_eq!(
            m.counters(),
            MemoryCounters {
                loads: 4,
                evictions: 1,
                share_evictions: 1,
                share_refusals: 2,
                share_transfers: 0,
                ..MemoryCounters::default()
            }
        );
    }

    #[test]
    fn a_share_whose_adapters_came_into_use_during_the_read_is_refused_after_it() {
        let mut m = memory(8, &[]);
        let a = ("a", Some(1));
        assert!(!ask_as(&mut m, 0, 1, 0, a).0);
        run_to(&mut m, LOAD);
        m.release(1, "a");
        // 1 is unused when the message is handled: 2 is read...
        assert!(!ask_as(&mut m, LOAD, 2, 1, a).0);
        assert_eq!(m.next_event(), Some(2 * LOAD));
        // ...but a's own request takes 1 from memory meanwhile: nothing of a's can go, so
        // the request is refused once the read ends, and 2 is not kept.
        assert!(ask_as(&mut m, LOAD + 1, 1, 2, a).0);
        let out = answers_to(&mut m, 2 * LOAD);
        assert_eq!((out.served, out.refused), (vec![], vec![(2 * LOAD, 1)]));
        assert_eq!(m.resident(), vec![1]);
        assert_eq!(m.counters().loads, 2);
        assert_eq!(m.counters().share_refusals, 1);
        assert_eq!(m.counters().evictions, 0);
        // Taken meanwhile by another tenant's request only, 1 is charged to that tenant
        // once the read ends, and a's request is served.
        m.release(1, "a");
        assert!(!ask_as(&mut m, 2 * LOAD, 2, 3, a).0);
        assert!(ask_as(&mut m, 2 * LOAD + 1, 1, 4, ("b", Some(1))).0);
        let out = answers_to(&mut m, 3 * LOAD);
        assert_eq!((out.served, out.refused), (vec![(3 * LOAD, 3)], vec![]));
        assert_eq!(m.resident(), vec![1, 2]);
        assert_eq!(m.owner[&1].tenant, m.tenants["b"]);
        assert_eq!(m.counters().share_transfers, 1);
    }

    /// Regression: a tenant whose charged adapters were all in use only by other tenants'
    /// requests was refused for as long as they used them; the charge now moves to a user
    /// with room in its share, and the user's share bounds it from then on.
    #[test]
    fn an_adapter_only_other_tenants_use_is_charged_to_them_and_never_keeps_its_loader_out() {
        let mut m = memory(8, &[]);
        let (a, b) = (("a", Some(1)), ("b", Some(1)));
        assert!(!ask_as(&mut m, 0, 1, 0, a).0);
        run_to(&mut m, LOAD);
        m.release(1, "a");
        // b keeps 1 busy; a's requests hold nothing: a's next load is served, 1 is b's.
        assert!(ask_as(&mut m, LOAD, 1, 1, b).0);
        assert!(!ask_as(&mut m, LOAD, 2, 2, a).0);
        assert_eq!(run_to(&mut m, 2 * LOAD), vec![(2 * LOAD, 2)]);
        assert_eq!(m.owner[&1].tenant, m.tenants["b"]);
        // b's share holds 1, which its request uses: b's own next load is refused.
        let (_, out) = ask_as(&mut m, 2 * LOAD, 3, 3, b);
        assert_eq!(out.refused, vec![(2 * LOAD, 3)]);
        // One a's own request uses stays a's: a is refused while it holds 2, though b
        // uses 2 too.
        assert!(ask_as(&mut m, 2 * LOAD, 2, 4, b).0);
        let (_, out) = ask_as(&mut m, 2 * LOAD, 4, 5, a);
        assert_eq!(out.refused, vec![(2 * LOAD, 5)]);
        assert_eq!(
            m.counters(),
            MemoryCounters {
                loads: 2,
                evictions: 0,
                share_evictions: 0,
                share_refusals: 2,
                share_transfers: 1,
                ..MemoryCounters::default()
            }
        );
    }

    /// With its own share full of adapters in use, a tenant keeping another's adapter busy is
    /// charged for it beyond its share (it cannot keep the other out so); once released, its
    /// adapters beyond its share are the first dropped from full memory.
    #[test]
    fn a_tenant_keeping_another_s_adapter_busy_is_charged_beyond_its_share() {
        let mut m = memory(3, &[]);
        let (a, b, c) = (("a", Some(1)), ("b", Some(1)), ("c", Some(1)));
        read_in_turn(&mut m, &[(30, c), (20, b), (1, a)]);
        m.release(30, "c");
        m.release(1, "a");
        // b holds its 20 and a's 1; a holds nothing: a's load of 2 is served, 1 goes to b
        // beyond its share, and c's unused 30 makes way (memory holds 3).
        assert!(ask_as(&mut m, 3 * LOAD, 1, 10, b).0);
        assert!(!ask_as(&mut m, 3 * LOAD, 2, 11, a).0);
        assert_eq!(run_to(&mut m, 4 * LOAD), vec![(4 * LOAD, 11)]);
        assert_eq!(m.resident(), vec![1, 2, 20]);
        assert_eq!(m.charged(m.tenants["b"]), 2);
        // b's own loads are refused while its requests use both.
        let (_, out) = ask_as(&mut m, 4 * LOAD, 3, 12, b);
        assert_eq!(out.refused, vec![(4 * LOAD, 12)]);
        // Released, 1 used last: c reads 30 back, and b's 1, beyond b's share, goes before
        // a's older 2.
        m.release(1, "b");
        m.release(2, "a");
        assert!(ask_as(&mut m, 4 * LOAD, 1, 13, b).0);
        m.release(1, "b");
        assert!(!ask_as(&mut m, 4 * LOAD, 30, 14, c).0);
        run_to(&mut m, 5 * LOAD);
        assert_eq!(m.resident(), vec![2, 20, 30]);
        assert_eq!(m.charged(m.tenants["b"]), 1);
        assert_eq!(m.counters().share_transfers, 1);
    }

    /// Regression (as the server's): the check before a read looked at the first step only,
    /// so a tenant beyond its share whose one movable adapter would not make room (its other
    /// one in use by its own request) had its adapter read and was refused after the read. It
    /// is refused before the read now.
    #[test]
    fn a_share_that_moving_charges_cannot_free_is_refused_before_the_read() {
        let mut m = memory(8, &[]);
        let (a, b, c) = (("a", Some(1)), ("b", Some(1)), ("c", Some(1)));
        // b holds its 20, c its 30; a reads 1, then b and c keep it busy.
        read_in_turn(&mut m, &[(20, b), (30, c), (1, a)]);
        m.release(1, "a");
        assert!(ask_as(&mut m, 3 * LOAD, 1, 10, b).0);
        assert!(ask_as(&mut m, 3 * LOAD, 1, 11, c).0);
        // Both users' shares are full: 1 moves beyond b's (first by name) for a's load of 2.
        assert!(!ask_as(&mut m, 3 * LOAD, 2, 12, a).0);
        assert_eq!(run_to(&mut m, 4 * LOAD), vec![(4 * LOAD, 12)]);
        assert_eq!(m.owner[&1].tenant, m.tenants["b"]);
        // Only c uses 1 now; b uses 20: moving 1 would leave 20 filling b's share.
        m.release(1, "b");
        let loads = m.counters().loads;
        let (_, out) = ask_as(&mut m, 4 * LOAD, 3, 13, b);
        assert_eq!(out.refused, vec![(4 * LOAD, 13)]);
        assert_eq!(m.next_event(), None, "no read");
        assert_eq!(m.owner[&1].tenant, m.tenants["b"]);
        // With 20 released the same load makes room (1 to c, beyond; 20 dropped).
        m.release(20, "b");
        assert!(!ask_as(&mut m, 4 * LOAD, 3, 14, b).0);
        assert_eq!(run_to(&mut m, 5 * LOAD), vec![(5 * LOAD, 14)]);
        assert_eq!(m.counters().loads, loads + 1);
        assert_eq!(m.owner[&1].tenant, m.tenants["c"]);
    }

    /// Regression: between users with as little room, the charge moved to the one seen first
    /// (the lowest id), where the server's `share_step` takes the first by name.
    #[test]
    fn a_tie_between_users_goes_to_the_first_by_name_as_on_the_server() {
        let mut m = memory(8, &[]);
        let (a, b, z) = (("a", Some(1)), ("b", Some(1)), ("z", Some(1)));
        // b is seen before a; both fill their shares.
        read_in_turn(&mut m, &[(20, b), (30, a), (1, z)]);
        m.release(1, "z");
        assert!(ask_as(&mut m, 3 * LOAD, 1, 10, b).0);
        assert!(ask_as(&mut m, 3 * LOAD, 1, 11, a).0);
        assert!(!ask_as(&mut m, 3 * LOAD, 2, 12, z).0);
        assert_eq!(run_to(&mut m, 4 * LOAD), vec![(4 * LOAD, 12)]);
        assert_eq!(m.owner[&1].tenant, m.tenants["a"]);
    }

    /// Whether memory held at most `max` adapters, the one being read included, as each read
    /// started, unless none could have been dropped (all in use or pinned).
    fn bounded_while_read(m: &LoraMemory, max: usize) -> bool {
        m.read_starts
            .iter()
            .all(|&(in_memory, droppable)| in_memory < max || !droppable)
    }

    /// Regression (as the server's): a read into full memory started beside the
    /// `max_cpu_loras` adapters there, the least recently used one no request held dropped
    /// only once the read ended, so memory held one more than its bound while it read. Room
    /// is made before the read now: in the tenant's full share first (its own adapter goes,
    /// not another tenant's older one), then the least recently used; loads asked for at once
    /// each find room; memory full of adapters in use reads all the same.
    #[test]
    fn memory_holds_at_most_max_cpu_loras_adapters_while_one_is_read() {
        let mut m = memory(2, &[]);
        let (a, b) = (("a", Some(1)), ("b", Some(1)));
        read_in_turn(&mut m, &[(10, b), (1, a)]);
        m.release(10, "b");
        m.release(1, "a");
        // Memory full, a's share full of its unused 1: 1 goes before 2 is read.
        assert!(!ask_as(&mut m, 2 * LOAD, 2, 2, a).0);
        assert_eq!(m.resident(), vec![10]);
        // Asked during that read: 10, unused, goes before 3 is read.
        assert!(!ask_as(&mut m, 2 * LOAD, 3, 3, ("c", None)).0);
        assert_eq!(run_to(&mut m, 4 * LOAD), vec![(3 * LOAD, 2), (4 * LOAD, 3)]);
        assert_eq!(m.resident(), vec![2, 3]);
        assert_eq!(
            (m.counters().evictions, m.counters().share_evictions),
            (2, 1)
        );
        // Full of adapters in use: 4 is read and served, memory over its bound meanwhile.
        assert!(!ask_as(&mut m, 4 * LOAD, 4, 4, ("c", None)).0);
        assert_eq!(run_to(&mut m, 5 * LOAD), vec![(5 * LOAD, 4)]);
        assert_eq!(m.resident(), vec![2, 3, 4]);
        assert!(bounded_while_read(&m, 2), "{:?}", m.read_starts);
        assert_eq!(m.read_starts.len(), 5);
        assert_eq!(m.read_starts.last(), Some(&(2, false)));
    }

    /// An operation of the property test.
    #[derive(Clone, Debug)]
    enum Op {
        /// An adapter, for a tenant.
        Ask(u32, usize),
        Release(usize),
        Wait(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..12, 0usize..3).prop_map(|(a, t)| Op::Ask(a, t)),
            (0usize..64).prop_map(Op::Release),
            (0u64..3 * LOAD).prop_map(Op::Wait),
        ]
    }

    proptest! {
        /// After every manager message, memory holds at most `max_cpu_loras` adapters or the
        /// adapters held and pinned, and as each read starts, at most `max_cpu_loras` with the
        /// one being read, unless all are held or pinned; pinned and held adapters are always
        /// in memory; no tenant has more adapters charged to it than its share; every request
        /// is served or refused once, refused by the share only with a share; the registry
        /// holds at most `max_adapters`, every adapter in memory among them and the
        /// configured ones (pinned or not) always, and refuses only while full, and never a
        /// configured adapter's request.
        #[test]
        fn memory_stays_within_its_bound(
            max in 0usize..5,
            max_adapters in 1usize..7,
            pinned in proptest::collection::btree_set(0u32..12, 0..3),
            registered in proptest::collection::vec(0u32..12, 0..4),
            shares in proptest::collection::vec(proptest::option::of(1usize..3), 3),
            ops in proptest::collection::vec(op(), 1..200),
        ) {
            let names = ["t0", "t1", "t2"];
            let pinned: Vec<u32> = pinned.into_iter().take(max.min(max_adapters)).collect();
            // The configuration's others: each once, none pinned, all within max_adapters.
            let mut configured: Vec<u32> = Vec::new();
            for a in registered {
                if !pinned.contains(&a) && !configured.contains(&a) {
                    configured.push(a);
                }
            }
            configured.truncate(max_adapters - pinned.len());
            let mut m = configured_of(max, &pinned, &configured, max_adapters);
            // The start leaves the pinned ones and the last configured ones that fit.
            let room = max - pinned.len();
            let mut at_start: Vec<u32> = pinned.clone();
            at_start.extend(configured.iter().rev().take(room));
            at_start.sort_unstable();
            prop_assert_eq!(m.resident(), at_start);
            let mut unavailable = 0;
            let mut now = 0;
            let mut next_req = 0;
            let mut asked: BTreeMap<usize, u32> = BTreeMap::new();
            let mut holding: Vec<(usize, u32, usize)> = Vec::new();
            // Adapters whose charge came by a move (not their tenant's own load), and the
            // (adapter, tenant) pairs whose requests took the adapter while in memory.
            let mut moved: BTreeSet<u32> = BTreeSet::new();
            let mut took: BTreeSet<(u32, u32)> = BTreeSet::new();
            let mut answered = BTreeSet::new();
            let mut tenant_of: BTreeMap<usize, usize> = BTreeMap::new();
            let mut refusals = 0;
            let mut out = Answers::default();
            for op in ops {
                out.clear();
                let before = m.owner.clone();
                match op {
                    Op::Ask(a, t) => {
                        asked.insert(next_req, a);
                        tenant_of.insert(next_req, t);
                        if m.request(now, a, next_req, (names[t], shares[t]), &mut out) {
                            out.served.push((now, next_req));
                        }
                        next_req += 1;
                    }
                    Op::Release(k) if !holding.is_empty() => {
                        let (_, a, t) = holding.remove(k % holding.len());
                        m.release(a, names[t]);
                    }
                    Op::Release(_) => {}
                    Op::Wait(dt) => {
                        now += dt;
                        while m.advance(now, &mut out) {}
                    }
                }
                for &(at, req) in &out.served {
                    prop_assert!(at <= now && answered.insert(req));
                    let (a, t) = (asked[&req], tenant_of[&req]);
                    holding.push((req, a, t));
                    took.insert((a, m.tenants[names[t]]));
                }
                took.retain(|(a, _)| m.is_resident(*a));
                for (a, o) in &m.owner {
                    match before.get(a) {
                        None => {
                            moved.remove(a);
                        }
                        Some(p) if p.tenant != o.tenant => {
                            moved.insert(*a);
                        }
                        Some(_) => {}
                    }
                    // A charge lands only on a tenant whose requests took the adapter.
                    prop_assert!(took.contains(&(*a, o.tenant)), "{a} charged to {o:?}");
                }
                moved.retain(|a| m.owner.contains_key(a));
                let id = |t: usize| m.tenants.get(names[t]).copied();
                let charged_to = |t: usize| {
                    m.owner
                        .iter()
                        .filter(|(_, o)| Some(o.tenant) == id(t))
                        .map(|(a, _)| *a)
                        .collect::<Vec<u32>>()
                };
                for &(at, req) in &out.refused {
                    prop_assert!(at <= now && answered.insert(req));
                    let t = tenant_of[&req];
                    let share = shares[t];
                    prop_assert!(share.is_some());
                    // Refused only with a share full of adapters its own requests hold
                    // (others, which moves would free, may be charged to it beside them).
                    let theirs = charged_to(t);
                    let own = theirs
                        .iter()
                        .filter(|&&a| holding.iter().any(|h| h.1 == a && h.2 == t))
                        .count();
                    prop_assert!(
                        own >= share.unwrap_or(0),
                        "t{t} refused, {own} of its {theirs:?} held by its requests"
                    );
                    refusals += 1;
                }
                prop_assert_eq!(m.counters().share_refusals, refusals);
                for &(at, req) in &out.unavailable {
                    prop_assert!(at <= now && answered.insert(req));
                    // Refused by a full registry; its adapter was not registered then, so
                    // not a configured one.
                    prop_assert!(m.registry.is_full());
                    let a = asked[&req];
                    prop_assert!(!pinned.contains(&a) && !configured.contains(&a), "{a}");
                    unavailable += 1;
                }
                prop_assert_eq!(m.counters().registry_refusals, unavailable);
                prop_assert!(m.registry.len() <= max_adapters);
                // The configured adapters are registered from the start, never as found.
                for a in m.registered() {
                    prop_assert!(!pinned.contains(&a) && !configured.contains(&a), "{a}");
                }
                for a in m.resident.keys() {
                    prop_assert!(
                        m.registry.is_registered(*a),
                        "{a} in memory, not registered"
                    );
                }
                for (t, share) in shares.iter().enumerate() {
                    // A tenant's own loads stay within its share; it is charged beyond it
                    // only for adapters whose charge moved to it.
                    let own = charged_to(t).iter().filter(|a| !moved.contains(a)).count();
                    prop_assert!(own <= share.unwrap_or(usize::MAX), "t{t}: {own}");
                }
                prop_assert!(m.owner.keys().all(|a| m.is_resident(*a)));
                let held: BTreeSet<u32> = holding.iter().map(|h| h.1).collect();
                let kept: BTreeSet<u32> = held.iter().chain(&pinned).copied().collect();
                for a in &kept {
                    prop_assert!(m.is_resident(*a), "{a} held or pinned, not in memory");
                }
                // Over the limit only while the adapters held or pinned at the last message
                // outnumbered it (those released since go at the next message), or while
                // the eviction a request asked for waits behind a load.
                let evict_queued = m.queue.iter().any(|(_, msg)| *msg == Message::Evict);
                prop_assert!(m.over_limit || evict_queued || m.resident.len() <= max);
                prop_assert!(bounded_while_read(&m, max), "{:?}", m.read_starts);
                prop_assert_eq!(
                    m.in_use.values().map(|&n| n as usize).sum::<usize>(),
                    holding.len()
                );
            }
        }
    }
}
