//! The bytes of a KV block, and so the blocks a host KV tier of some size holds
//! (`cache.kv_offloading_size`): one place for the arithmetic, which both backends use to size
//! their tier and `serve` uses to check the tier before any backend is built (so the number the
//! scheduler is told and the number a backend allocates cannot disagree).

use crate::error::GpuError;
use crate::model::LlamaConfig;

/// How a backend stores keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvStorage {
    /// Two bytes a value: `f16` on the CPU backend, `bf16` on the CUDA backend.
    Half,
    /// One e4m3 byte a value and an `f32` scale per head and token (the CUDA backend with
    /// `kv_cache_dtype: fp8`).
    Fp8,
}

impl KvStorage {
    /// `Fp8` when `fp8` (`kv_cache_dtype: fp8`), else `Half`.
    pub fn from_fp8(fp8: bool) -> Self {
        if fp8 {
            KvStorage::Fp8
        } else {
            KvStorage::Half
        }
    }
}

/// The shape of one KV block: keys and values of every layer for `block_size` token slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Layers.
    pub layers: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Dimension of a head.
    pub head_dim: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// How the values are stored.
    pub storage: KvStorage,
}

impl KvGeometry {
    /// The blocks of the model `c` at `block_size` slots a block.
    pub fn of(c: &LlamaConfig, block_size: usize, storage: KvStorage) -> Self {
        KvGeometry {
            layers: c.num_layers,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size,
            storage,
        }
    }

    /// Bytes of one token's keys (or values) in one layer, fp8 scales included.
    pub fn slot_bytes(&self) -> usize {
        match self.storage {
            KvStorage::Half => self
                .kv_heads
                .saturating_mul(self.head_dim)
                .saturating_mul(2),
            KvStorage::Fp8 => self
                .kv_heads
                .saturating_mul(self.head_dim.saturating_add(4)),
        }
    }

    /// Bytes of one block: keys and values of every layer (saturating: a shape this large
    /// holds no block in any size of memory).
    pub fn block_bytes(&self) -> usize {
        [2, self.layers, self.block_size]
            .iter()
            .fold(self.slot_bytes(), |a, &d| a.saturating_mul(d))
    }

    /// Whole blocks in `bytes` (0 for an empty shape).
    pub fn blocks_in(&self, bytes: usize) -> usize {
        match self.block_bytes() {
            0 => 0,
            per_block => bytes / per_block,
        }
    }
}

/// The settings a refusal of the host KV tier names: where the user set the tier's size and
/// the KV cache's (a configuration's fields, or a command's flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSettingNames {
    /// The tier's size (`cache.kv_offloading_size`).
    pub tier: &'static str,
    /// The KV cache's size (`cache.kv_cache_mb or cache.num_blocks`).
    pub cache: &'static str,
    /// The KV cache's block count where it is given as one (`cache.num_blocks`).
    pub blocks: &'static str,
}

impl KvSettingNames {
    /// The server configuration's fields.
    pub const CONFIG: KvSettingNames = KvSettingNames {
        tier: "cache.kv_offloading_size",
        cache: "cache.kv_cache_mb or cache.num_blocks",
        blocks: "cache.num_blocks",
    };
}

/// Refuses a host tier of `tier_bytes` beside a KV cache of `cache_bytes` in the same memory
/// (the CPU backend's cache; 0 where the cache is on a device) when together they are more
/// than `available` ([`crate::cpu::kv_cache::available_memory`]; `None`: unknown, allowed).
/// The cache's pages are committed only as it fills, so the memory available when the tier is
/// allocated does not yet count the cache: it is counted here. The refusal names the
/// configuration's fields ([`check_host_memory_named`] names others).
pub fn check_host_memory(
    tier_bytes: usize,
    cache_bytes: usize,
    available: Option<usize>,
) -> Result<(), GpuError> {
    check_host_memory_named(tier_bytes, cache_bytes, available, KvSettingNames::CONFIG)
}

/// [`check_host_memory`], its refusal naming the settings `names`.
pub fn check_host_memory_named(
    tier_bytes: usize,
    cache_bytes: usize,
    available: Option<usize>,
    names: KvSettingNames,
) -> Result<(), GpuError> {
    let Some(available) = available else {
        return Ok(());
    };
    let total = tier_bytes.saturating_add(cache_bytes);
    if total <= available {
        return Ok(());
    }
    Err(GpuError::InvalidConfig(if cache_bytes == 0 {
        format!(
            "{}: the host KV tier needs {} MiB but only {} MiB of memory is available",
            names.tier,
            tier_bytes >> 20,
            available >> 20
        )
    } else {
        format!(
            "{}: the host KV tier needs {} MiB and the KV cache beside it ({}) {} MiB, {} MiB \
             in all, but only {} MiB of memory is available",
            names.tier,
            tier_bytes >> 20,
            names.cache,
            cache_bytes >> 20,
            total >> 20,
            available >> 20
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_blocks_worked_by_hand() {
        // SmolLM2-135M: 30 layers, 3 KV heads of 64. A 16-slot block in 2-byte values (the
        // CPU cache's f16, the GPU's bf16): 2 (keys, values) x 30 x 3 x 64 x 16 x 2 =
        // 368,640 bytes. In fp8: 3 x (64 + 4) = 204 bytes a slot, x 2 x 30 x 16 = 195,840.
        let c = LlamaConfig::smollm2_135m();
        let half = KvGeometry::of(&c, 16, KvStorage::Half);
        assert_eq!(half.block_bytes(), 368_640);
        assert_eq!(
            KvGeometry::of(&c, 16, KvStorage::Fp8).block_bytes(),
            195_840
        );
        // 0.01 GiB = 10,737,418 bytes: 29 blocks (29 x 368,640 = 10,690,560). 1 GiB: 2,912.
        assert_eq!(half.blocks_in((0.01 * f64::from(1u32 << 30)) as usize), 29);
        assert_eq!(half.blocks_in(1 << 30), 2_912);
        assert_eq!(half.blocks_in(368_639), 0);
        assert_eq!(KvGeometry::of(&c, 1, KvStorage::Half).block_bytes(), 23_040);
    }

    #[test]
    fn the_tiny_shape_and_impossible_shapes() {
        // The tiny test model: 2 x 2 layers x 2 heads x 16 x 16 slots x 2 bytes = 4,096, so
        // 1024 GiB makes 2^40 / 2^12 = 2^28 blocks.
        let g = KvGeometry::of(&LlamaConfig::tiny(), 16, KvStorage::Half);
        assert_eq!(g.block_bytes(), 4_096);
        assert_eq!(g.blocks_in(1 << 40), 1 << 28);
        let empty = KvGeometry { layers: 0, ..g };
        assert_eq!(empty.blocks_in(1 << 30), 0);
        let huge = KvGeometry {
            layers: usize::MAX,
            ..g
        };
        assert_eq!(huge.block_bytes(), usize::MAX);
        assert_eq!(huge.blocks_in(1 << 40), 0);
    }

    #[test]
    fn the_memory_check_counts_the_cache_beside_the_tier() {
        let mib = 1 << 20;
        assert!(check_host_memory(600 * mib, 300 * mib, Some(1000 * mib)).is_ok());
        assert!(check_host_memory(600 * mib, 0, None).is_ok());
        // Each fits alone, not both.
        assert!(check_host_memory(600 * mib, 0, Some(1000 * mib)).is_ok());
        let e = check_host_memory(600 * mib, 500 * mib, Some(1000 * mib))
            .expect_err("1100 MiB in 1000")
            .to_string();
        for part in [
            "cache.kv_offloading_size",
            "600 MiB",
            "KV cache beside it",
            "500 MiB",
            "1100 MiB in all",
            "only 1000 MiB",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
        let e = check_host_memory(2000 * mib, 0, Some(1000 * mib))
            .expect_err("too big")
            .to_string();
        assert!(e.contains("needs 2000 MiB but only 1000 MiB"), "{e}");
        assert!(check_host_memory(usize::MAX, usize::MAX, Some(usize::MAX - 1)).is_err());
    }
}
