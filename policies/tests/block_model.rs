//! Model-based property test of the block allocator on its own: random interleavings of
//! reservations, prefix hits, registrations, frees of whole tables and of their tails, cache
//! clears and commits, played on a [`BlockLedger`] and the [`BlockPool`] it mirrors (detached,
//! as the engine's allocator actor holds it), against a reference model of which owner holds
//! which block and what each block holds. After every commit: the ledger equals the pool, the
//! refcounts are the owners' references, free + used = total, every prefix the cache maps holds
//! what it was registered with, and no block is held by two owners unless it is a cached
//! prefix both matched; at the end, with every owner gone, every block is free.

use std::collections::HashMap;

use proptest::prelude::*;
use switchyard_policies::*;

#[derive(Clone, Debug)]
enum Op {
    /// Owner reserves this many fresh blocks (as many as are free).
    Reserve(usize, usize),
    /// Owner matches this chain of hashes in the cache and pins what it finds.
    Hit(usize, u8),
    /// Owner registers its `k`-th block (a real one, not yet cached) under a chain hash.
    Register(usize, usize, u8),
    /// Owner gives back its last block (drafts it did not keep, a shrunk chunk).
    FreeLast(usize),
    /// Owner ends or is preempted: its whole table goes, last block first.
    FreeAll(usize),
    /// A failed step: every registration dropped.
    Clear,
    /// The step's changes go to the allocator; the reserved blocks get their ids.
    Commit,
}

fn op(owners: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..owners, 1usize..4).prop_map(|(o, n)| Op::Reserve(o, n)),
        3 => (0..owners, 0u8..6).prop_map(|(o, h)| Op::Hit(o, h)),
        4 => (0..owners, 0usize..6, 0u8..6).prop_map(|(o, k, h)| Op::Register(o, k, h)),
        2 => (0..owners).prop_map(Op::FreeLast),
        2 => (0..owners).prop_map(Op::FreeAll),
        1 => Just(Op::Clear),
        4 => Just(Op::Commit),
    ]
}

/// The hash of a chain of `len + 1` blocks (chains 0..=5 all extend one another, as prefixes
/// of one prompt do).
fn chain(len: u8) -> Vec<PrefixHash> {
    (0..=len).map(|i| PrefixHash(1000 + i as u128)).collect()
}

/// What the model knows: each owner's table (real ids, or [`PENDING_BLOCK`] until the commit),
/// and what each block holds (the prefix it was registered with, while that registration is
/// in force).
struct Model {
    tables: Vec<Vec<BlockId>>,
    /// Per block, the owners' references taken by a prefix hit.
    hits: HashMap<BlockId, u32>,
    holds: HashMap<BlockId, PrefixHash>,
}

fn check(
    ledger: &BlockLedger,
    pool: &BlockPool,
    model: &Model,
    num_blocks: usize,
) -> Result<(), TestCaseError> {
    let fail = |e: SchedulerError| TestCaseError::fail(e.to_string());
    pool.check_invariants().map_err(fail)?;
    ledger.check_invariants().map_err(fail)?;
    ledger.check_against(pool).map_err(fail)?;
    let mut refs = vec![0u32; num_blocks];
    for t in &model.tables {
        for &b in t {
            prop_assert_ne!(b, PENDING_BLOCK, "an id not assigned by the commit");
            refs[b as usize] += 1;
        }
    }
    let used = refs.iter().filter(|&&r| r > 0).count();
    prop_assert_eq!(pool.num_free() + used, num_blocks, "free + used != total");
    for (b, &r) in refs.iter().enumerate() {
        prop_assert_eq!(
            pool.ref_count(b as BlockId),
            Some(r),
            "block {} refcount",
            b
        );
        // Shared only through prefix hits: at most one holder got it otherwise.
        let hits = model.hits.get(&(b as BlockId)).copied().unwrap_or(0);
        prop_assert!(
            r <= hits + 1,
            "block {} held {} times, {} of them by a prefix hit",
            b,
            r,
            hits
        );
    }
    for len in 0..6u8 {
        for h in chain(len) {
            if let Some(b) = pool.lookup(h) {
                prop_assert_eq!(
                    model.holds.get(&b),
                    Some(&h),
                    "the cache maps {:?} to block {}, which holds otherwise",
                    h,
                    b
                );
            }
        }
    }
    Ok(())
}

/// Forgets the hit reference of `o`'s entry just popped (`b`), if it was one.
fn drop_hit(model: &mut Model, hit_len: &mut [usize], o: usize, b: BlockId) {
    if model.tables[o].len() < hit_len[o] {
        hit_len[o] = model.tables[o].len();
        if let Some(n) = model.hits.get_mut(&b) {
            *n -= 1;
        }
    }
}

fn play(num_blocks: usize, owners: usize, ops: &[Op]) -> Result<(), TestCaseError> {
    let fail = |e: SchedulerError| TestCaseError::fail(e.to_string());
    let mut ledger = BlockLedger::new(num_blocks, 4).unwrap();
    let mut pool = BlockPool::new(num_blocks, 4).unwrap();
    ledger.track_evictions(true);
    let mut model = Model {
        tables: vec![Vec::new(); owners],
        hits: HashMap::new(),
        holds: HashMap::new(),
    };
    let commit = |ledger: &mut BlockLedger, pool: &mut BlockPool, model: &mut Model| {
        let c = ledger.take_commit();
        let mut ids = Vec::new();
        pool.commit(&c, &mut ids).map_err(fail)?;
        ledger.assign(&ids).map_err(fail)?;
        // The blocks the allocations evicted, with what they held: exactly the fresh ids that
        // held a registration in force (a host tier offloads those).
        let mut evicted = Vec::new();
        ledger.take_evicted(&mut evicted);
        let want: Vec<(BlockId, PrefixHash)> = ids
            .iter()
            .filter_map(|b| model.holds.get(b).map(|&h| (*b, h)))
            .collect();
        prop_assert_eq!(evicted, want, "evictions");
        // Ids fill the reserved entries in order (owners in order, as a plan's entries).
        let mut next = ids.iter();
        for t in &mut model.tables {
            for b in t.iter_mut().filter(|b| **b == PENDING_BLOCK) {
                let Some(&id) = next.next() else {
                    return Err(TestCaseError::fail("fewer ids than reserved entries"));
                };
                // A fresh block: whatever it held is overwritten.
                model.holds.remove(&id);
                *b = id;
            }
        }
        prop_assert!(next.next().is_none(), "more ids than reserved entries");
        Ok(())
    };
    // Per owner, how many leading entries of its table came from prefix hits.
    let mut hit_len = vec![0usize; owners];
    for op in ops {
        match *op {
            Op::Reserve(o, n) => {
                for _ in 0..n {
                    match ledger.reserve() {
                        Some(b) => model.tables[o].push(b),
                        None => prop_assert_eq!(ledger.num_free(), 0),
                    }
                }
            }
            Op::Hit(o, len) => {
                // Only a sequence with no blocks starts from a cached prefix.
                if !model.tables[o].is_empty() {
                    continue;
                }
                let mut found = Vec::new();
                ledger.match_prefix(&chain(len), &mut found);
                // A matched block nobody references is counted free: the planner pins it only
                // while the free count still covers it (reservations may have claimed it).
                let evictable = found
                    .iter()
                    .filter(|&&b| ledger.ref_count(b) == Some(0))
                    .count();
                if evictable > ledger.num_free() {
                    continue;
                }
                for &b in &found {
                    ledger.touch(b).map_err(fail)?;
                    model.tables[o].push(b);
                    *model.hits.entry(b).or_default() += 1;
                }
                // Hits mark the start of the table: its first blocks are those.
                hit_len[o] = found.len();
            }
            Op::Register(o, k, len) => {
                let Some(&b) = model.tables[o].get(k) else {
                    continue;
                };
                // A block is registered with the prefix it holds: the chain position of its
                // table index (a prefix is registered block by block, in order).
                let h = chain(len.max(k as u8))[k];
                if b == PENDING_BLOCK {
                    continue;
                }
                let fresh = ledger.ref_count(b).is_some_and(|r| r > 0)
                    && !ledger.is_cached(h)
                    && !model.holds.contains_key(&b);
                let registered = ledger.cache_block(b, h);
                if registered {
                    prop_assert!(fresh, "block {} registered twice", b);
                    model.holds.insert(b, h);
                }
            }
            Op::FreeLast(o) => {
                if let Some(b) = model.tables[o].pop() {
                    ledger.free(b).map_err(fail)?;
                    drop_hit(&mut model, &mut hit_len, o, b);
                }
            }
            Op::FreeAll(o) => {
                while let Some(b) = model.tables[o].pop() {
                    ledger.free(b).map_err(fail)?;
                    drop_hit(&mut model, &mut hit_len, o, b);
                }
            }
            Op::Clear => {
                ledger.clear_cache();
                model.holds.clear();
            }
            Op::Commit => {
                commit(&mut ledger, &mut pool, &mut model)?;
                check(&ledger, &pool, &model, num_blocks)?;
            }
        }
        ledger.check_invariants().map_err(fail)?;
    }
    for o in 0..owners {
        while let Some(b) = model.tables[o].pop() {
            ledger.free(b).map_err(fail)?;
            drop_hit(&mut model, &mut hit_len, o, b);
        }
    }
    commit(&mut ledger, &mut pool, &mut model)?;
    check(&ledger, &pool, &model, num_blocks)?;
    prop_assert_eq!(pool.num_free(), num_blocks, "blocks leaked");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn the_pool_and_the_ledger_keep_every_owners_blocks(
        num_blocks in 1usize..12,
        ops in prop::collection::vec(op(4), 1..120),
    ) {
        play(num_blocks, 4, &ops)?;
    }
}
