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
//! request holds and that is not pinned; adapters in use or pinned stay, so while more of them
//! than `max_cpu_loras` exist, more stay in memory, and the excess goes at the manager's next
//! message (a request served from memory while it is over the limit sends it one, as the
//! server's registry flags it). "Recently used" is the registry's clock: it ticks when a
//! request takes an adapter from memory and when a load puts one there.
//!
//! At the start only the pinned adapters are in memory (the server loads them as it
//! registers them); every other adapter is loaded on its first request, as the server loads
//! one found in `lora.adapter_dirs`, or one of `lora.adapters` evicted at start. What the
//! model leaves out: the registry's own bound (`lora.max_adapters`, which unregisters found
//! adapters to make room for others, each found again at the cost of one load), the tiers'
//! shares of memory per tenant (`tiers.<name>.max_cpu_loras_per_tenant`, read with a server
//! configuration's tiers and named in a warning), and a request's name check in `lora.adapter_dirs` before the front end
//! (a look at the directories that reads nothing: the load is the one modelled here).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

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
    /// Time to read one adapter from its files, in microseconds.
    pub load_us: u64,
}

/// A message to the manager's thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Message {
    /// Request `req` needs `adapter`, which was not in memory when it asked.
    Resolve { adapter: u32, req: usize },
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
}

/// The figures of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryCounters {
    /// Adapters read from their files.
    pub loads: u64,
    /// Adapters dropped from memory.
    pub evictions: u64,
}

/// The adapters in memory and the manager's thread.
#[derive(Clone, Debug)]
pub struct LoraMemory {
    config: MemoryConfig,
    /// Adapters in memory, with the registry's clock when last used.
    resident: BTreeMap<u32, u64>,
    /// Requests holding each adapter (entries go with their last request).
    in_use: BTreeMap<u32, u32>,
    /// The registry's clock.
    clock: u64,
    /// Set when an eviction left more than `max_cpu_loras` in memory.
    over_limit: bool,
    /// Messages waiting for the manager's thread, with the time each was sent.
    queue: VecDeque<(u64, Message)>,
    /// The load in progress, if any.
    loading: Option<Load>,
    counters: MemoryCounters,
}

impl LoraMemory {
    /// Memory holding the pinned adapters only, the manager idle.
    pub fn new(config: MemoryConfig) -> Self {
        let mut clock = 0;
        let resident = config
            .pinned
            .iter()
            .map(|&a| {
                clock += 1;
                (a, clock)
            })
            .collect();
        LoraMemory {
            config,
            resident,
            in_use: BTreeMap::new(),
            clock,
            over_limit: false,
            queue: VecDeque::new(),
            loading: None,
            counters: MemoryCounters::default(),
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

    /// Request `req` asks for `adapter` at `now` (its prompt encoded): `true` when it took the
    /// adapter from memory at once; else it waits, and [`LoraMemory::advance`] reports when it
    /// has it. Requests the manager serves at once (it was idle and the adapter came into
    /// memory since) are reported in `resolved` at `now`.
    pub fn request(
        &mut self,
        now: u64,
        adapter: u32,
        req: usize,
        resolved: &mut Vec<(u64, usize)>,
    ) -> bool {
        if self.resident.contains_key(&adapter) {
            self.take(adapter);
            if std::mem::take(&mut self.over_limit) {
                self.send(now, Message::Evict, resolved);
            }
            return true;
        }
        self.send(now, Message::Resolve { adapter, req }, resolved);
        false
    }

    /// A request holding `adapter` ended.
    pub fn release(&mut self, adapter: u32) {
        if let Some(n) = self.in_use.get_mut(&adapter) {
            *n -= 1;
            if *n == 0 {
                self.in_use.remove(&adapter);
            }
        }
    }

    /// When the load in progress ends, if one is.
    pub fn next_event(&self) -> Option<u64> {
        self.loading.map(|l| l.end)
    }

    /// Ends the load in progress if it ends by `now`, and handles the messages queued behind
    /// it that need no load; the requests served, with the time they were, go to `resolved`.
    /// Returns whether a load ended.
    pub fn advance(&mut self, now: u64, resolved: &mut Vec<(u64, usize)>) -> bool {
        let Some(load) = self.loading.filter(|l| l.end <= now) else {
            return false;
        };
        self.loading = None;
        self.counters.loads += 1;
        self.clock += 1;
        self.resident.insert(load.adapter, self.clock);
        *self.in_use.entry(load.adapter).or_default() += 1;
        self.evict();
        resolved.push((load.end, load.req));
        self.run_queue(load.end, resolved);
        true
    }

    /// Queues `msg` sent at `now`, handling it at once if the manager is idle.
    fn send(&mut self, now: u64, msg: Message, resolved: &mut Vec<(u64, usize)>) {
        self.queue.push_back((now, msg));
        if self.loading.is_none() {
            self.run_queue(now, resolved);
        }
    }

    /// The idle manager handles its queued messages from `now` until one needs a load.
    fn run_queue(&mut self, now: u64, resolved: &mut Vec<(u64, usize)>) {
        while self.loading.is_none() {
            let Some((sent, msg)) = self.queue.pop_front() else {
                return;
            };
            let at = now.max(sent);
            match msg {
                Message::Evict => self.evict(),
                Message::Resolve { adapter, req } if self.resident.contains_key(&adapter) => {
                    self.take(adapter);
                    self.evict();
                    resolved.push((at, req));
                }
                Message::Resolve { adapter, req } => {
                    self.loading = Some(Load {
                        end: at.saturating_add(self.config.load_us),
                        adapter,
                        req,
                    });
                }
            }
        }
    }

    /// A request takes `adapter` from memory, marking it used.
    fn take(&mut self, adapter: u32) {
        self.clock += 1;
        self.resident.insert(adapter, self.clock);
        *self.in_use.entry(adapter).or_default() += 1;
    }

    /// Drops the least recently used adapters that no request holds and that are not pinned
    /// while more than `max_cpu_loras` are in memory.
    fn evict(&mut self) {
        while self.resident.len() > self.config.max_cpu_loras {
            let victim = self
                .resident
                .iter()
                .filter(|(a, _)| !self.in_use.contains_key(a) && !self.config.pinned.contains(a))
                .min_by_key(|(_, used)| **used)
                .map(|(a, _)| *a);
            let Some(victim) = victim else { break };
            self.resident.remove(&victim);
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
        LoraMemory::new(MemoryConfig {
            max_cpu_loras: max,
            pinned: pinned.iter().copied().collect(),
            load_us: LOAD,
        })
    }

    /// Asks for `adapter` for `req` at `now`; the requests served at once.
    fn ask(m: &mut LoraMemory, now: u64, adapter: u32, req: usize) -> (bool, Vec<(u64, usize)>) {
        let mut out = Vec::new();
        let now_resident = m.request(now, adapter, req, &mut out);
        (now_resident, out)
    }

    /// Runs the manager up to `now`; the requests served.
    fn run_to(m: &mut LoraMemory, now: u64) -> Vec<(u64, usize)> {
        let mut out = Vec::new();
        while m.advance(now, &mut out) {}
        out
    }

    #[test]
    fn the_least_recently_used_adapter_no_request_holds_is_evicted() {
        let mut m = memory(2, &[]);
        for (t, a) in [(0, 1), (LOAD, 2)] {
            assert_eq!(ask(&mut m, t, a, a as usize), (false, vec![]));
            assert_eq!(run_to(&mut m, t + LOAD), vec![(t + LOAD, a as usize)]);
            m.release(a);
        }
        // 1 used again, after 2: 2 is the least recently used.
        assert_eq!(ask(&mut m, 3 * LOAD, 1, 10), (true, vec![]));
        m.release(1);
        assert!(!ask(&mut m, 3 * LOAD, 3, 11).0);
        assert_eq!(run_to(&mut m, 4 * LOAD), vec![(4 * LOAD, 11)]);
        assert_eq!(m.resident(), vec![1, 3]);
        assert_eq!(
            m.counters(),
            MemoryCounters {
                loads: 3,
                evictions: 1
            }
        );
    }

    #[test]
    fn pinned_adapters_start_in_memory_and_are_never_evicted() {
        let mut m = memory(2, &[7]);
        assert_eq!(m.resident(), vec![7]);
        assert_eq!(ask(&mut m, 0, 7, 0), (true, vec![]));
        m.release(7);
        // 7 is the least recently used each time, yet 1 and then 2 go.
        for (i, a) in [1u32, 2, 3].into_iter().enumerate() {
            let t = i as u64 * LOAD;
            assert!(!ask(&mut m, t, a, a as usize).0);
            assert_eq!(run_to(&mut m, t + LOAD), vec![(t + LOAD, a as usize)]);
            m.release(a);
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
        m.release(1);
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

    /// An operation of the property test.
    #[derive(Clone, Debug)]
    enum Op {
        Ask(u32),
        Release(usize),
        Wait(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..12).prop_map(Op::Ask),
            (0usize..64).prop_map(Op::Release),
            (0u64..3 * LOAD).prop_map(Op::Wait),
        ]
    }

    proptest! {
        /// After every manager message, memory holds at most `max_cpu_loras` adapters or the
        /// adapters held and pinned; pinned and held adapters are always in memory; every
        /// request is served once.
        #[test]
        fn memory_stays_within_its_bound(
            max in 0usize..5,
            pinned in proptest::collection::btree_set(0u32..12, 0..3),
            ops in proptest::collection::vec(op(), 1..200),
        ) {
            let pinned: Vec<u32> = pinned.into_iter().take(max).collect();
            let mut m = memory(max, &pinned);
            let mut now = 0;
            let mut next_req = 0;
            let mut asked: BTreeMap<usize, u32> = BTreeMap::new();
            let mut holding: Vec<(usize, u32)> = Vec::new();
            let mut served = BTreeSet::new();
            let mut out = Vec::new();
            for op in ops {
                out.clear();
                match op {
                    Op::Ask(a) => {
                        asked.insert(next_req, a);
                        if m.request(now, a, next_req, &mut out) {
                            out.push((now, next_req));
                        }
                        next_req += 1;
                    }
                    Op::Release(k) if !holding.is_empty() => {
                        let (_, a) = holding.remove(k % holding.len());
                        m.release(a);
                    }
                    Op::Release(_) => {}
                    Op::Wait(dt) => {
                        now += dt;
                        while m.advance(now, &mut out) {}
                    }
                }
                for &(at, req) in &out {
                    prop_assert!(at <= now && served.insert(req));
                    holding.push((req, asked[&req]));
                }
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
                prop_assert_eq!(
                    m.in_use.values().map(|&n| n as usize).sum::<usize>(),
                    holding.len()
                );
            }
        }
    }
}
