//! The registry's choice of the adapter to unregister, and the registry in the adapters'
//! memory: what a registration unregisters, when it is refused (before the read, or after it
//! when the adapters that could go came into use meanwhile), each case counted by hand from
//! the server's `register_held`, `make_read_room` and `make_room`.

use super::*;
use crate::lora_memory::{Answers, LoraMemory, MemoryConfig, MemoryCounters};

/// Time to read one adapter, in microseconds.
const LOAD: u64 = 1_000;

/// Memory of `max_cpu_loras` adapters, `pinned` pinned, in a registry of `max_adapters`.
fn memory(max_cpu_loras: usize, pinned: &[u32], max_adapters: usize) -> LoraMemory {
    configured(max_cpu_loras, pinned, &[], max_adapters)
}

/// [`memory`] with the configuration's unpinned adapters `registered` (in the file's order).
fn configured(
    max_cpu_loras: usize,
    pinned: &[u32],
    registered: &[u32],
    max_adapters: usize,
) -> LoraMemory {
    LoraMemory::new(MemoryConfig {
        max_cpu_loras,
        pinned: pinned.iter().copied().collect(),
        registered: registered.to_vec(),
        load_us: LOAD,
        max_adapters,
    })
}

/// Request `req` (of a tenant without a share) asks for `adapter` at `now`: whether it took
/// it from memory at once, and the answers given at once.
fn ask(m: &mut LoraMemory, now: u64, adapter: u32, req: usize) -> (bool, Answers) {
    let mut out = Answers::default();
    let at_once = m.request(now, adapter, req, ("", None), &mut out);
    (at_once, out)
}

/// Runs the manager up to `now`; its answers.
fn run_to(m: &mut LoraMemory, now: u64) -> Answers {
    let mut out = Answers::default();
    while m.advance(now, &mut out) {}
    out
}

/// Answers serving exactly `served`.
fn served(served: &[(u64, usize)]) -> Answers {
    Answers {
        served: served.to_vec(),
        ..Answers::default()
    }
}

/// Answers refusing exactly `unavailable` for a full registry.
fn unavailable(unavailable: &[(u64, usize)]) -> Answers {
    Answers {
        unavailable: unavailable.to_vec(),
        ..Answers::default()
    }
}

/// Reads `adapter` for request `req` from `at`, serves it one load later, and releases it.
fn read_and_release(m: &mut LoraMemory, at: u64, adapter: u32, req: usize) {
    assert_eq!(ask(m, at, adapter, req), (false, Answers::default()));
    assert_eq!(run_to(m, at + LOAD), served(&[(at + LOAD, req)]));
    m.release(adapter, "");
}

#[test]
fn adapters_not_in_memory_go_first_in_registration_order_then_the_least_recently_used() {
    // Four places, one the configuration's 9: 5, 3 and 7 fill it.
    let mut r = Registry::new(4, [9]);
    assert!(!r.is_full());
    for a in [5, 3, 7] {
        r.register(a);
    }
    assert!(r.is_full() && r.len() == 4 && r.is_registered(3) && !r.is_registered(4));
    assert!(r.is_registered(9) && r.found() == vec![3, 5, 7]);
    let none = BTreeMap::new();
    // 5 is not in memory: it goes before 3 and 7, whatever their use.
    let resident = BTreeMap::from([(3, 10), (7, 4)]);
    assert_eq!(r.victim(&resident, &none), Some(5));
    // All in memory: the least recently used, 7.
    let resident = BTreeMap::from([(5, 9), (3, 10), (7, 4)]);
    assert_eq!(r.victim(&resident, &none), Some(7));
    // 7 held by a request: 5, used before 3.
    let held = BTreeMap::from([(7, 1)]);
    assert_eq!(r.victim(&resident, &held), Some(5));
    assert!(!r.can_go(7, &resident, &held) && r.can_go(3, &resident, &held));
    // Of those not in memory, the first registered goes, not the lowest id.
    r.unregister(5);
    r.unregister(3);
    assert_eq!(r.found(), vec![7]);
    r.register(8);
    r.register(2);
    assert_eq!(r.victim(&BTreeMap::new(), &none), Some(7));
    r.unregister(7);
    assert_eq!(r.victim(&BTreeMap::new(), &none), Some(8));
    // Every found adapter held: none can go.
    let held = BTreeMap::from([(8, 1), (2, 3)]);
    assert_eq!(r.victim(&BTreeMap::new(), &held), None);
}

#[test]
fn a_registration_into_a_full_registry_unregisters_the_least_recently_used_found_adapter() {
    // Room in memory for 8, in the registry for 2.
    let mut m = memory(8, &[], 2);
    read_and_release(&mut m, 0, 1, 0);
    read_and_release(&mut m, LOAD, 2, 1);
    assert_eq!(m.registered(), vec![1, 2]);
    // 1 used again: 2 is the least recently used, and goes for 3 once 3 has been read.
    assert_eq!(ask(&mut m, 2 * LOAD, 1, 2), (true, Answers::default()));
    m.release(1, "");
    assert!(!ask(&mut m, 2 * LOAD, 3, 3).0);
    assert_eq!(
        m.registered(),
        vec![1, 2],
        "unregistered only once 3 is read"
    );
    assert_eq!(run_to(&mut m, 3 * LOAD), served(&[(3 * LOAD, 3)]));
    m.release(3, "");
    assert_eq!((m.registered(), m.resident()), (vec![1, 3], vec![1, 3]));
    // 2 is found again and read again; 1, used before 3, goes for it.
    read_and_release(&mut m, 3 * LOAD, 2, 4);
    assert_eq!((m.registered(), m.resident()), (vec![2, 3], vec![2, 3]));
    assert_eq!(
        m.counters(),
        MemoryCounters {
            loads: 4,
            evictions: 2,
            unregistrations: 2,
            ..MemoryCounters::default()
        }
    );
}

#[test]
fn an_evicted_adapter_stays_registered_is_read_again_as_such_and_goes_first() {
    // Room in memory for 1, in the registry for 2.
    let mut m = memory(1, &[], 2);
    read_and_release(&mut m, 0, 1, 0);
    // 1 is evicted from memory for 2, and stays registered.
    read_and_release(&mut m, LOAD, 2, 1);
    assert_eq!((m.registered(), m.resident()), (vec![1, 2], vec![2]));
    // 1 is read again (2 evicted for it): no registration, nothing unregistered.
    read_and_release(&mut m, 2 * LOAD, 1, 2);
    assert_eq!((m.registered(), m.resident()), (vec![1, 2], vec![1]));
    assert_eq!(m.counters().unregistrations, 0);
    // 3: 2, not in memory, is the one unregistered, though 1 was used after it; 1 is
    // evicted from memory to make room for the read.
    read_and_release(&mut m, 3 * LOAD, 3, 3);
    assert_eq!((m.registered(), m.resident()), (vec![1, 3], vec![3]));
    assert_eq!(
        m.counters(),
        MemoryCounters {
            loads: 4,
            evictions: 3,
            unregistrations: 1,
            ..MemoryCounters::default()
        }
    );
}

#[test]
fn a_registry_full_of_adapters_in_use_or_pinned_refuses_before_the_read() {
    // Two places, one for the pinned 9.
    let mut m = memory(8, &[9], 2);
    assert!(!ask(&mut m, 0, 1, 0).0);
    assert_eq!(run_to(&mut m, LOAD), served(&[(LOAD, 0)]));
    // 1 is held: 2 is refused as its message is handled, and nothing is read.
    assert_eq!(ask(&mut m, LOAD, 2, 1), (false, unavailable(&[(LOAD, 1)])));
    assert_eq!(m.next_event(), None);
    // The pinned adapter is registered and in memory: served at once.
    assert_eq!(ask(&mut m, LOAD, 9, 2), (true, Answers::default()));
    // Once 1 is released, 2 takes its place.
    m.release(1, "");
    assert!(!ask(&mut m, LOAD, 2, 3).0);
    assert_eq!(run_to(&mut m, 2 * LOAD), served(&[(2 * LOAD, 3)]));
    assert_eq!((m.registered(), m.resident()), (vec![2], vec![2, 9]));
    assert_eq!(
        m.counters(),
        MemoryCounters {
            loads: 2,
            evictions: 1,
            unregistrations: 1,
            registry_refusals: 1,
            ..MemoryCounters::default()
        }
    );
    // A registry of the pinned adapter alone refuses every other.
    let mut m = memory(8, &[9], 1);
    assert_eq!(ask(&mut m, 0, 1, 0), (false, unavailable(&[(0, 0)])));
}

#[test]
fn a_registry_whose_adapters_came_into_use_during_the_read_refuses_after_it() {
    let mut m = memory(8, &[], 2);
    read_and_release(&mut m, 0, 1, 0);
    read_and_release(&mut m, LOAD, 2, 1);
    // 1 and 2 could go as 3's read starts; both are taken from memory during it.
    assert!(!ask(&mut m, 2 * LOAD, 3, 2).0);
    assert!(ask(&mut m, 2 * LOAD + 500, 1, 3).0);
    assert!(ask(&mut m, 2 * LOAD + 500, 2, 4).0);
    // Read, not kept: the request is refused once the read ends.
    assert_eq!(run_to(&mut m, 3 * LOAD), unavailable(&[(3 * LOAD, 2)]));
    assert_eq!((m.registered(), m.resident()), (vec![1, 2], vec![1, 2]));
    assert_eq!(
        m.counters(),
        MemoryCounters {
            loads: 3,
            registry_refusals: 1,
            ..MemoryCounters::default()
        }
    );
}

#[test]
fn into_full_memory_the_adapter_to_unregister_is_dropped_before_the_read() {
    // Room for 2 in memory and in the registry: 1 used after 2.
    let mut m = memory(2, &[], 2);
    read_and_release(&mut m, 0, 1, 0);
    read_and_release(&mut m, LOAD, 2, 1);
    assert!(ask(&mut m, 2 * LOAD, 1, 2).0);
    m.release(1, "");
    // 2 goes from memory as 3's read starts (memory holds 1 while it reads), and from the
    // registry once it ends.
    assert!(!ask(&mut m, 2 * LOAD, 3, 3).0);
    assert_eq!((m.registered(), m.resident()), (vec![1, 2], vec![1]));
    assert_eq!(run_to(&mut m, 3 * LOAD), served(&[(3 * LOAD, 3)]));
    assert_eq!((m.registered(), m.resident()), (vec![1, 3], vec![1, 3]));
    assert_eq!(
        (m.counters().evictions, m.counters().unregistrations),
        (1, 1)
    );
}

/// The configuration's adapters as the server's start leaves them (`lora.adapters` read in
/// the file's order, each registration evicting beyond `max_cpu_loras`): the pinned ones and
/// the last unpinned ones that fit, the earlier ones the least recently used.
#[test]
fn configured_adapters_start_in_memory_as_the_server_s_start_leaves_them() {
    let mut m = configured(3, &[9], &[1, 2, 3, 4], 8);
    assert_eq!((m.resident(), m.registered()), (vec![3, 4, 9], vec![]));
    assert_eq!(m.counters(), MemoryCounters::default());
    // 1, evicted at the start, is read again, not registered: 3, read before 4, goes.
    read_and_release(&mut m, 0, 1, 0);
    assert_eq!((m.resident(), m.registered()), (vec![1, 4, 9], vec![]));
    read_and_release(&mut m, LOAD, 2, 1);
    assert_eq!(m.resident(), vec![1, 2, 9]);
    assert_eq!(
        m.counters(),
        MemoryCounters {
            loads: 2,
            evictions: 2,
            ..MemoryCounters::default()
        }
    );
    // Memory of none: every unpinned one was dropped at the start.
    let m = configured(0, &[], &[1, 2], 8);
    assert_eq!(m.resident(), Vec::<u32>::new());
    // Memory of the pinned ones alone: the same.
    let m = configured(2, &[8, 9], &[1, 2], 8);
    assert_eq!(m.resident(), vec![8, 9]);
}

/// The server's `room_victim` picks found adapters only (`discovered`): a configured one,
/// pinned or not, holds its place in the registry for good; a request for it after its
/// eviction reads it again (`reload`) and is never refused for the registry, even while the
/// registry is full of it and found adapters in use, when a new adapter's request is.
#[test]
fn configured_adapters_hold_their_places_and_are_read_again_never_refused() {
    // Room for 1 in memory, for 2 in the registry, one of them the configured 1.
    let mut m = configured(1, &[], &[1], 2);
    assert_eq!(m.resident(), vec![1]);
    read_and_release(&mut m, 0, 2, 0);
    assert_eq!((m.resident(), m.registered()), (vec![2], vec![2]));
    // Full: 2 goes for 3, though 1 is out of memory and older.
    read_and_release(&mut m, LOAD, 3, 1);
    assert_eq!((m.resident(), m.registered()), (vec![3], vec![3]));
    // 1 is read again, registering nothing and unregistering nothing; 3 stays registered.
    read_and_release(&mut m, 2 * LOAD, 1, 2);
    assert_eq!((m.resident(), m.registered()), (vec![1], vec![3]));
    assert_eq!(m.counters().unregistrations, 1);
    // 3 read again and held: a new adapter, 4, is refused as its message comes up...
    assert_eq!(ask(&mut m, 3 * LOAD, 3, 3), (false, Answers::default()));
    assert_eq!(run_to(&mut m, 4 * LOAD), served(&[(4 * LOAD, 3)]));
    assert_eq!(
        ask(&mut m, 4 * LOAD, 4, 4),
        (false, unavailable(&[(4 * LOAD, 4)]))
    );
    // ...but the configured 1 is read again and served, memory over its bound while both
    // are held.
    assert_eq!(ask(&mut m, 4 * LOAD, 1, 5), (false, Answers::default()));
    assert_eq!(run_to(&mut m, 5 * LOAD), served(&[(5 * LOAD, 5)]));
    assert_eq!((m.resident(), m.registered()), (vec![1, 3], vec![3]));
    assert_eq!(
        m.counters(),
        MemoryCounters {
            loads: 5,
            evictions: 4,
            unregistrations: 1,
            registry_refusals: 1,
            ..MemoryCounters::default()
        }
    );
    // A registry the configuration fills, pinned and not: every other adapter is refused,
    // the configured ones served.
    let mut m = configured(8, &[9], &[1], 2);
    assert_eq!(ask(&mut m, 0, 2, 0), (false, unavailable(&[(0, 0)])));
    assert_eq!(ask(&mut m, 0, 1, 1), (true, Answers::default()));
    assert_eq!(ask(&mut m, 0, 9, 2), (true, Answers::default()));
}

/// An operator's adapter in memory from the start is no tenant's (the server charges its
/// registrations to no one), so a tenant whose share is full takes it; read again after its
/// eviction, it is charged to its request's tenant (the server's `reload`).
#[test]
fn a_configured_adapter_is_charged_to_no_one_until_a_request_reads_it_again() {
    let mut m = configured(2, &[], &[1], 64);
    let a = ("a", Some(1));
    let mut out = Answers::default();
    // a reads 2 and holds it: its share of 1 is full.
    assert!(!m.request(0, 2, 0, a, &mut out));
    assert_eq!(run_to(&mut m, LOAD), served(&[(LOAD, 0)]));
    // The configured 1, in memory from the start, is a's at once all the same.
    assert!(m.request(LOAD, 1, 1, a, &mut out));
    m.release(1, "a");
    // b's 3 drops 1, the least recently used no request holds.
    assert!(!m.request(LOAD, 3, 2, ("b", None), &mut out));
    assert_eq!(run_to(&mut m, 2 * LOAD), served(&[(2 * LOAD, 2)]));
    m.release(3, "b");
    assert_eq!(m.resident(), vec![2, 3]);
    // Read again, 1 would be charged to a, whose share its own 2 fills: refused, unread.
    assert!(!m.request(2 * LOAD, 1, 3, a, &mut out));
    assert_eq!(out.refused, vec![(2 * LOAD, 3)]);
    assert_eq!(m.next_event(), None);
    assert_eq!((m.counters().loads, m.counters().share_refusals), (2, 1));
}

/// The server's configuration takes `lora.max_adapters` within the bounds a spec's
/// `max_adapters` has, and the same default.
#[test]
fn the_bounds_and_default_are_the_server_s() {
    let config = |n: usize| {
        switchyard_config::Config::from_yaml_str(&format!("lora:\n  max_adapters: {n}\n"), "c.yaml")
    };
    assert!(config(MAX_ADAPTERS).is_ok());
    assert!(config(1).is_ok());
    assert!(config(MAX_ADAPTERS + 1).is_err());
    assert!(config(0).is_err());
    assert_eq!(default_max_adapters(), 64);
}
