//! The paged KV cache of the CPU backend (PagedAttention's block layout, Kwon et al., SOSP'23):
//! fixed-size blocks of `block_size` token slots, addressed by the block ids of each
//! sequence's block table, so sequences share prefix blocks and the scheduler's allocator owns
//! placement.
//!
//! Layout, per layer: keys `[num_blocks][kv_heads][head_dim][block_size]` (transposed inside a
//! block) and values `[num_blocks][kv_heads][block_size][head_dim]`, both `f16` (as llama.cpp
//! and vLLM default to). The transposed keys let attention compute the scores of a whole block
//! as `head_dim` multiply-adds of a contiguous `block_size`-lane vector, with no horizontal
//! reduction per key; values are token-major because the weighted sum adds whole `head_dim`
//! rows. Half precision because attention over the cache is bound by memory traffic: with
//! SmolLM2, 32 sequences of 129 tokens read 95 MB of keys and values per step in `f16` (190 MB
//! in `f32`, more than the model's weights), and the conversion is one instruction per 16
//! values (F16C / AVX-512).

use half::f16;

use crate::error::GpuError;

/// The key and value tensors of all layers, block-paged.
#[derive(Debug)]
pub struct KvCache {
    /// Number of layers.
    pub layers: usize,
    /// Number of blocks.
    pub num_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Dimension of a head.
    pub head_dim: usize,
    k: Vec<f16>,
    v: Vec<f16>,
}

/// `n` zeros, allocated zeroed (the pages are the operating system's zero pages until
/// written, so a large cache costs neither start-up time nor memory before it is used);
/// `None` when the memory cannot be had.
fn zeroed_f16(n: usize) -> Option<Vec<f16>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f16>(n).ok()?;
    // SAFETY: `layout` has a non-zero size (n > 0, f16 is 2 bytes). All-zero bits are a valid
    // f16 (+0.0), so the n elements are initialised. The pointer comes from the global
    // allocator with exactly the layout a Vec<f16> of capacity n frees it with.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout).cast::<f16>();
        (!p.is_null()).then(|| Vec::from_raw_parts(p, n, n))
    }
}

/// Bytes of memory this process may still use, where the system says (Linux: `MemAvailable`
/// of /proc/meminfo, and a cgroup v2 limit's headroom when one is set); `None` elsewhere.
pub fn available_memory() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: usize = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let mut available = kib.saturating_mul(1024);
    let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok();
    if let (Some(max), Some(current)) = (read("memory.max"), read("memory.current")) {
        if let (Ok(max), Ok(current)) =
            (max.trim().parse::<usize>(), current.trim().parse::<usize>())
        {
            available = available.min(max.saturating_sub(current));
        }
    }
    Some(available)
}

impl KvCache {
    /// Allocates a zeroed cache; fails (instead of aborting) when the size overflows, when it
    /// is larger than the memory available now (the pages are committed only as the cache
    /// fills, so without this check a cache too large for the machine would start and be
    /// killed for memory hours later), or when the memory cannot be reserved.
    pub fn new(
        layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self, GpuError> {
        if num_blocks == 0 || block_size == 0 || block_size > 4096 {
            return Err(GpuError::InvalidConfig(format!(
                "KV cache needs at least one block and 1..=4096 slots per block (got {num_blocks} x {block_size})"
            )));
        }
        let n = [layers, num_blocks, block_size, kv_heads, head_dim]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|n| n.checked_mul(8).is_some())
            .ok_or_else(|| GpuError::InvalidConfig("KV cache size overflows".into()))?;
        let bytes = n * 4; // keys and values, 2 bytes each
        if let Some(available) = available_memory() {
            if bytes > available {
                return Err(GpuError::InvalidConfig(format!(
                    "the KV cache needs {} MiB but only {} MiB of memory is available: lower \
                     cache.kv_cache_mb",
                    bytes >> 20,
                    available >> 20
                )));
            }
        }
        let alloc = |what: &str| {
            zeroed_f16(n).ok_or_else(|| {
                GpuError::InvalidConfig(format!(
                    "cannot allocate the KV cache ({what}: {} MiB)",
                    (n * 2) >> 20
                ))
            })
        };
        Ok(KvCache {
            layers,
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            k: alloc("keys")?,
            v: alloc("values")?,
        })
    }

    /// Bytes held by keys and values.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 2
    }

    fn head_block_offset(&self, layer: usize, block: usize, head: usize) -> usize {
        let hb = self.block_size * self.head_dim;
        ((layer * self.num_blocks + block) * self.kv_heads + head) * hb
    }

    /// Stores the keys and values (`kv_heads * head_dim` each) of one token at `slot` of
    /// `block`. The caller validated `block < num_blocks` and `slot < block_size`.
    pub fn write(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let (hd, bs) = (self.head_dim, self.block_size);
        for h in 0..self.kv_heads {
            let base = self.head_block_offset(layer, block, h);
            let kh = &k[h * hd..(h + 1) * hd];
            for (d, &x) in kh.iter().enumerate() {
                self.k[base + d * bs + slot] = f16::from_f32(x);
            }
            let dst = &mut self.v[base + slot * hd..base + (slot + 1) * hd];
            for (o, &x) in dst.iter_mut().zip(&v[h * hd..(h + 1) * hd]) {
                *o = f16::from_f32(x);
            }
        }
    }

    /// Keys of `head` in `block`, `[head_dim][block_size]`.
    pub fn keys(&self, layer: usize, block: usize, head: usize) -> &[f16] {
        let base = self.head_block_offset(layer, block, head);
        &self.k[base..base + self.block_size * self.head_dim]
    }

    /// Values of `head` in `block`, `[block_size][head_dim]`.
    pub fn values(&self, layer: usize, block: usize, head: usize) -> &[f16] {
        let base = self.head_block_offset(layer, block, head);
        &self.v[base..base + self.block_size * self.head_dim]
    }
}

/// The host tier of the prefix cache (`cache.kv_offloading_size`): `num_blocks` blocks in the
/// cache's own per-layer block layout, so a block moves between the two as one contiguous run
/// of keys and one of values per layer. On the CPU backend both live in ordinary memory: the
/// tier is worth it where a larger cache cannot be had (it is not pre-checked against a
/// bound of its own), and it makes the feature testable without a GPU.
#[derive(Debug)]
pub struct HostKvTier {
    /// Number of blocks.
    pub num_blocks: usize,
    /// Keys and values of one block in one layer (`kv_heads * head_dim * block_size` each).
    block_len: usize,
    k: Vec<f16>,
    v: Vec<f16>,
}

impl KvCache {
    /// The shape of this cache's blocks (`f16` values).
    pub fn geometry(&self) -> crate::KvGeometry {
        crate::KvGeometry {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            storage: crate::KvStorage::Half,
        }
    }

    /// Bytes one block takes across all layers (keys and values).
    pub fn block_bytes(&self) -> usize {
        self.geometry().block_bytes()
    }

    /// A host tier of `bytes / block_bytes` blocks for this cache (none below one block);
    /// fails, naming `cache.kv_offloading_size`, when the tier and this cache together are
    /// more than the memory available (the cache's pages are committed only as it fills, so
    /// the memory available now does not count it yet) or the tier cannot be allocated.
    pub fn host_tier(&self, bytes: usize) -> Result<Option<HostKvTier>, GpuError> {
        let num_blocks = self.geometry().blocks_in(bytes);
        if num_blocks == 0 {
            return Ok(None);
        }
        let block_len = self.kv_heads * self.head_dim * self.block_size;
        let n = num_blocks
            .checked_mul(block_len)
            .and_then(|n| n.checked_mul(self.layers))
            .filter(|n| n.checked_mul(4).is_some())
            .ok_or_else(|| {
                GpuError::InvalidConfig("cache.kv_offloading_size: the host tier overflows".into())
            })?;
        crate::kv_size::check_host_memory(n * 4, self.bytes(), available_memory())?;
        let alloc = || {
            zeroed_f16(n).ok_or_else(|| {
                GpuError::InvalidConfig(format!(
                    "cache.kv_offloading_size: cannot allocate the host KV tier ({} MiB)",
                    (n * 4) >> 20
                ))
            })
        };
        Ok(Some(HostKvTier {
            num_blocks,
            block_len,
            k: alloc()?,
            v: alloc()?,
        }))
    }

    /// Copies blocks between the cache and `tier`: first every `offloads` pair (cache block,
    /// tier block) from the cache to the tier, then every `loads` pair from the tier to the
    /// cache, each block's keys and values of every layer. Every id is checked before anything
    /// is copied.
    pub fn copy_blocks(
        &mut self,
        tier: &mut HostKvTier,
        offloads: &[(usize, usize)],
        loads: &[(usize, usize)],
    ) -> Result<(), GpuError> {
        for &(device, host) in offloads.iter().chain(loads) {
            if device >= self.num_blocks || host >= tier.num_blocks {
                return Err(GpuError::BadBatch(format!(
                    "KV copy between cache block {device} and host block {host}: out of range \
                     ({} cache blocks, {} host blocks)",
                    self.num_blocks, tier.num_blocks
                )));
            }
        }
        let len = tier.block_len;
        let at = |blocks: usize, layer: usize, block: usize| (layer * blocks + block) * len;
        for layer in 0..self.layers {
            for &(device, host) in offloads {
                let (d, h) = (
                    at(self.num_blocks, layer, device),
                    at(tier.num_blocks, layer, host),
                );
                tier.k[h..h + len].copy_from_slice(&self.k[d..d + len]);
                tier.v[h..h + len].copy_from_slice(&self.v[d..d + len]);
            }
        }
        for layer in 0..self.layers {
            for &(device, host) in loads {
                let (d, h) = (
                    at(self.num_blocks, layer, device),
                    at(tier.num_blocks, layer, host),
                );
                self.k[d..d + len].copy_from_slice(&tier.k[h..h + len]);
                self.v[d..d + len].copy_from_slice(&tier.v[h..h + len]);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    /// A cache larger than the machine's memory is refused at once (its pages would only be
    /// committed as it fills, and the process killed for memory then).
    #[test]
    fn a_cache_larger_than_the_memory_available_is_refused() {
        // 2^50 halves of keys and as many of values: 4 PiB.
        let e = KvCache::new(1024, 1 << 20, 4096, 1, 256).expect_err("refused");
        let e = e.to_string();
        if cfg!(target_os = "linux") {
            assert!(
                e.contains("of memory is available: lower cache.kv_cache_mb"),
                "{e}"
            );
        } else {
            assert!(e.contains("cannot allocate"), "{e}");
        }
    }

    #[test]
    fn a_new_cache_reads_zeros_everywhere() {
        let c = KvCache::new(2, 3, 4, 2, 8).unwrap();
        assert_eq!(c.bytes(), 2 * 2 * 3 * 4 * 2 * 8 * 2);
        assert!(c.k.iter().chain(c.v.iter()).all(|x| x.to_bits() == 0));
        assert_eq!(c.k.len(), 2 * 3 * 4 * 2 * 8);
    }

    use super::*;

    #[test]
    fn writes_land_in_the_addressed_slot() {
        let mut c = KvCache::new(2, 3, 4, 2, 3).unwrap();
        let k = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let v = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0];
        c.write(1, 2, 3, &k, &v);
        let keys = c.keys(1, 2, 1);
        let f = |x: f16| x.to_f32();
        assert_eq!(
            [f(keys[3]), f(keys[4 + 3]), f(keys[8 + 3])],
            [4.0, 5.0, 6.0]
        );
        let vals: Vec<f32> = c.values(1, 2, 0)[9..12].iter().map(|&x| f(x)).collect();
        assert_eq!(vals, [-1.0, -2.0, -3.0]);
        assert!(c.keys(0, 2, 1).iter().all(|&x| f(x) == 0.0));
        assert!(c.keys(1, 1, 1).iter().all(|&x| f(x) == 0.0));
    }

    /// A block offloaded, overwritten in the cache and loaded into another block reads as it
    /// was, in every layer, keys and values; other blocks are untouched.
    #[test]
    fn blocks_go_to_the_host_tier_and_back() {
        let mut c = KvCache::new(2, 4, 2, 2, 3).unwrap();
        assert_eq!(c.block_bytes(), 2 * 2 * 3 * 2 * 4);
        let mut t = c.host_tier(3 * c.block_bytes() + 1).unwrap().unwrap();
        assert_eq!(t.num_blocks, 3);
        let kv = |x: f32| ([x, x + 1.0, x + 2.0, x + 3.0, x + 4.0, x + 5.0], [-x; 6]);
        for layer in 0..2 {
            for slot in 0..2 {
                let (k, v) = kv((10 * layer + slot) as f32 + 1.0);
                c.write(layer, 1, slot, &k, &v);
            }
        }
        let before: Vec<Vec<f16>> = (0..2)
            .flat_map(|l| (0..2).map(move |h| (l, h)))
            .flat_map(|(l, h)| [c.keys(l, 1, h).to_vec(), c.values(l, 1, h).to_vec()])
            .collect();
        c.copy_blocks(&mut t, &[(1, 2)], &[]).unwrap();
        let (k, v) = kv(99.0);
        for layer in 0..2 {
            for slot in 0..2 {
                c.write(layer, 1, slot, &k, &v);
            }
        }
        c.copy_blocks(&mut t, &[], &[(3, 2)]).unwrap();
        let after: Vec<Vec<f16>> = (0..2)
            .flat_map(|l| (0..2).map(move |h| (l, h)))
            .flat_map(|(l, h)| [c.keys(l, 3, h).to_vec(), c.values(l, 3, h).to_vec()])
            .collect();
        assert_eq!(before, after);
        assert!(c.keys(1, 1, 1).iter().all(|x| x.to_f32() != 0.0));
        assert!(c.keys(0, 0, 0).iter().all(|x| x.to_bits() == 0));
        assert!(c.values(1, 2, 1).iter().all(|x| x.to_bits() == 0));
    }

    #[test]
    fn host_tier_ids_out_of_range_are_errors_and_copy_nothing() {
        let mut c = KvCache::new(1, 2, 2, 1, 2).unwrap();
        let mut t = c.host_tier(2 * c.block_bytes()).unwrap().unwrap();
        c.write(0, 0, 0, &[1.0, 2.0], &[3.0, 4.0]);
        for (off, load) in [
            (vec![(2, 0)], vec![]),
            (vec![(0, 2)], vec![]),
            (vec![], vec![(0, 2)]),
            (vec![(0, 0)], vec![(5, 0)]),
        ] {
            let e = c
                .copy_blocks(&mut t, &off, &load)
                .expect_err("out of range");
            assert!(e.to_string().contains("out of range"), "{e}");
        }
        // The valid offload before the bad load was not made either.
        assert!(t.k.iter().all(|x| x.to_bits() == 0));
        assert!(c.host_tier(c.block_bytes() - 1).unwrap().is_none());
        let e = c.host_tier(usize::MAX).expect_err("too big").to_string();
        assert!(e.contains("cache.kv_offloading_size"), "{e}");
    }

    #[test]
    fn impossible_sizes_are_errors() {
        assert!(KvCache::new(1, 0, 16, 1, 1).is_err());
        assert!(KvCache::new(usize::MAX, 2, 16, 1, 1).is_err());
    }
}
