//! Allocator and prefix-cache micro-benchmarks.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use switchyard_policies::{BlockHasher, BlockPool, HashExtras, PrefixHash};

fn allocate_free(c: &mut Criterion) {
    let mut pool = BlockPool::new(65_536, 16).unwrap();
    c.bench_function("block_pool/allocate+free one block", |b| {
        b.iter(|| {
            let blk = pool.allocate().unwrap();
            pool.free(black_box(blk)).unwrap();
        })
    });
    let mut blocks = Vec::with_capacity(256);
    c.bench_function("block_pool/allocate+free 256 blocks", |b| {
        b.iter(|| {
            for _ in 0..256 {
                blocks.push(pool.allocate().unwrap());
            }
            for &blk in blocks.iter().rev() {
                pool.free(blk).unwrap();
            }
            blocks.clear();
        })
    });
}

fn prefix(c: &mut Criterion) {
    // A 2048-token prompt: 128 full blocks of 16.
    let prompt: Vec<u32> = (0..2048).map(|i| (i * 7919 % 32_000) as u32).collect();
    let hasher = BlockHasher::new([0x1234, 0x5678]);
    c.bench_function("prefix/hash chain of a 2048-token prompt", |b| {
        let mut hashes: Vec<PrefixHash> = Vec::with_capacity(128);
        b.iter(|| {
            hashes.clear();
            hasher.extend_chain(
                &mut hashes,
                black_box(&prompt[..]),
                16,
                usize::MAX,
                HashExtras::default(),
            );
            black_box(hashes.len())
        })
    });
    let mut hashes = Vec::new();
    hasher.extend_chain(
        &mut hashes,
        &prompt[..],
        16,
        usize::MAX,
        HashExtras::default(),
    );
    let mut pool = BlockPool::new(4096, 16).unwrap();
    for &h in &hashes {
        let blk = pool.allocate().unwrap();
        pool.cache_block(blk, h);
        pool.free(blk).unwrap();
    }
    let mut out = Vec::with_capacity(128);
    c.bench_function("prefix/match 128 cached blocks", |b| {
        b.iter(|| {
            out.clear();
            black_box(pool.match_prefix(black_box(&hashes), &mut out))
        })
    });
}

criterion_group!(benches, allocate_free, prefix);
criterion_main!(benches);
