//! The host tier of the prefix cache on the CUDA backend (`cache.kv_offloading_size`, vLLM's
//! CPU KV offloading, SGLang's HiCache): page-locked host memory holding whole KV blocks,
//! copied to and from the paged cache on the compute stream, so each copy is ordered after
//! every step enqueued before it and before every step enqueued after it. The host waits for
//! no DMA; with the kernel it waits, before writing a staging buffer, for the launches that
//! last read it (those of the copy call two before, normally long done).
//!
//! Layout: the cache's own, per layer and per part (keys, values), over the tier's blocks:
//! `[layer][keys | values][block][slot]` with, for an fp8 cache, the part's e4m3 values of
//! every block followed by their f32 scales (as [`super::forward::Buffers`] lays out the
//! cache). A run of consecutive blocks on both sides is then one contiguous range per layer
//! and part: one copy (two with fp8 scales) per layer, part and run.
//!
//! Two ways to copy, and a mix of both ([`KvCopyEngine`]): DMA (`cuMemcpy{DtoH,HtoD}Async`, one
//! per layer, part and run: 64 for one Llama-3-8B block, each a driver call of about 2.3 us, so
//! scattered blocks cost the host far more than the bytes cost the bus), and one launch of the
//! `kv_tier_copy` kernel per list, which reads and writes the tier through its device mapping
//! (the memory is allocated mapped). Measured on an H100 (gpu/CUDA_NOTES.md v51,
//! `benches/cuda_kv_copy.rs`): the kernel offloads at 48.8 GiB/s and loads at 32.2 GiB/s
//! whatever the blocks' layout; DMA moves runs of 256 blocks at 50.6 GiB/s but scattered
//! Llama-3-8B blocks at 10.3 / 9.4 GiB/s and scattered SmolLM2 blocks at 2.4 / 2.1 GiB/s. The
//! default ([`KvCopyEngine::AUTO`]) takes each run of consecutive blocks by DMA when it moves
//! enough bytes a call to pay the call (loads from 256 KiB, offloads from 4 MiB) and the rest
//! by the kernel. The kernel reads its (cache block, tier block) pairs from mapped host memory
//! too: two staging buffers used in turn, each reused only once the event recorded after the
//! launches that read it has completed.

use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaStream, PinnedHostSlice};

use super::device::{cuda_err, Arg, Gpu};
use super::forward::Buffers;
use crate::backend::KvCopy;
use crate::error::GpuError;
use crate::model::LlamaConfig;

/// The block geometry shared by the cache and the tier.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    layers: usize,
    /// Bytes of one block's keys (or values) of one layer, scales excluded.
    values: usize,
    /// Bytes of one block's fp8 scales of one layer's keys (or values); 0 for bf16.
    scales: usize,
}

/// How the tier's copies run (`SWITCHYARD_CUDA_KV_COPY`: `auto`, `dma` or `kernel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCopyEngine {
    /// `cuMemcpy{DtoH,HtoD}Async`, one per layer, part and run of consecutive blocks.
    Dma,
    /// One `kv_tier_copy` launch per list, through the tier's device mapping.
    Kernel,
    /// By run: a run of consecutive blocks whose bytes per DMA call reach its direction's
    /// bound goes by DMA, every other block by one kernel launch per list. [`Self::AUTO`] (the
    /// default) sets the bounds where the two cost the same on an H100.
    Hybrid {
        /// Bytes per DMA call from which an offload run goes by DMA.
        offload_dma_min: usize,
        /// Bytes per DMA call from which a load run goes by DMA.
        load_dma_min: usize,
    },
}

impl KvCopyEngine {
    /// The default. A DMA call costs the host ~2.3 us (gpu/CUDA_NOTES.md v51, H100), after
    /// which it moves 50.6 GiB/s; the kernel loads at 32.2 GiB/s and offloads at 48.8 GiB/s
    /// with no cost per run. So a load run pays by DMA from ~220 KB a call (2.3 us over the
    /// 10.5 ps a byte the kernel is slower), an offload run only from ~3.4 MB (0.7 ps a byte).
    pub const AUTO: KvCopyEngine = KvCopyEngine::Hybrid {
        offload_dma_min: 4 << 20,
        load_dma_min: 256 << 10,
    };

    /// `SWITCHYARD_CUDA_KV_COPY`, else [`Self::AUTO`]; an unknown value is refused naming the
    /// variable.
    pub fn from_env() -> Result<Self, GpuError> {
        match std::env::var("SWITCHYARD_CUDA_KV_COPY").as_deref() {
            Ok("dma") => Ok(KvCopyEngine::Dma),
            Ok("kernel") => Ok(KvCopyEngine::Kernel),
            Err(_) | Ok("auto") => Ok(KvCopyEngine::AUTO),
            Ok(v) => Err(GpuError::InvalidConfig(format!(
                "SWITCHYARD_CUDA_KV_COPY: {v:?} is not one of auto, dma, kernel"
            ))),
        }
    }

    /// The bytes per DMA call from which a run goes by DMA: (offloads, loads).
    fn dma_min(self) -> (usize, usize) {
        match self {
            KvCopyEngine::Dma => (0, 0),
            KvCopyEngine::Kernel => (usize::MAX, usize::MAX),
            KvCopyEngine::Hybrid {
                offload_dma_min,
                load_dma_min,
            } => (offload_dma_min, load_dma_min),
        }
    }
}

/// The kernel's (cache block, tier block) pairs: mapped page-locked memory, written by the
/// host, read by one call's launches.
struct PairStaging {
    pairs: PinnedHostSlice<u32>,
    /// The device address of `pairs`.
    dev: u64,
    /// Recorded after the last launches that read `pairs`.
    read: Option<CudaEvent>,
}

/// The host tier: `num_blocks` blocks of page-locked memory.
pub(crate) struct HostKvTier {
    mem: PinnedHostSlice<u8>,
    /// The device address of `mem` (its mapping; 0 with DMA, which does not use it).
    mem_dev: u64,
    engine: KvCopyEngine,
    /// The kernel's pair buffers, used in turn (empty with DMA).
    staging: Vec<PairStaging>,
    /// The next of `staging` to use.
    turn: usize,
    /// The compute stream, synchronised before the memory is freed.
    stream: Arc<CudaStream>,
    geometry: Geometry,
    /// Number of blocks.
    pub num_blocks: usize,
}

/// The tier a backend is asked for: `bytes` of host memory, copied by `engine`; `names`: where
/// the user set its size, for refusals.
pub(crate) struct TierRequest {
    pub bytes: usize,
    pub engine: KvCopyEngine,
    pub names: crate::KvSettingNames,
}

impl HostKvTier {
    /// A tier of `bytes / block_bytes` blocks for the cache of `c` (`block_size` slots a
    /// block, `kv_fp8`: e4m3 with scales); `None` below one block. Refused, naming the tier's
    /// setting (`cache.kv_offloading_size` or the flag that set it), when the host memory is
    /// not available or cannot be locked.
    pub fn new(
        gpu: &Gpu,
        c: &LlamaConfig,
        block_size: usize,
        kv_fp8: bool,
        cache_blocks: usize,
        req: TierRequest,
    ) -> Result<Option<Self>, GpuError> {
        let TierRequest {
            bytes,
            engine,
            names,
        } = req;
        // The arithmetic `serve` checks the tier with before any backend is built.
        let geometry = crate::KvGeometry::of(c, block_size, crate::KvStorage::from_fp8(kv_fp8));
        let num_blocks = geometry.blocks_in(bytes);
        if num_blocks == 0 {
            return Ok(None);
        }
        let total = num_blocks * geometry.block_bytes();
        let refuse = |why: String| {
            GpuError::InvalidConfig(format!(
                "{}: the host KV tier needs {} MiB {why}",
                names.tier,
                total >> 20
            ))
        };
        // The device cache is not in host memory: only the tier counts.
        crate::kv_size::check_host_memory_named(
            total,
            0,
            crate::cpu::kv_cache::available_memory(),
            names,
        )?;
        // SAFETY: bytes, read back only after the DMA of an offload wrote them (the scheduler
        // loads only blocks it offloaded).
        let mut mem = unsafe {
            gpu.ctx
                .alloc_pinned_with_flags::<u8>(total, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        }
        .map_err(|e| {
            refuse(format!(
                "of page-locked memory, which the driver refused: {e:?}"
            ))
        })?;
        let mem_dev = match engine {
            KvCopyEngine::Dma => 0,
            _ => mapped(&mut mem)?,
        };
        // A list names each cache block at most once (an offload's source, a load's
        // destination). The scheduler also loads each tier block at most once a plan
        // (`one_plan_loads_a_tier_block_once_for_every_request_that_needs_it`), but the
        // bound by cache blocks does not rely on it: a list holds at most `cache_blocks`.
        let most = cache_blocks;
        let mut staging = Vec::new();
        if engine != KvCopyEngine::Dma {
            for _ in 0..2 {
                // SAFETY: written by the host before each launch that reads it.
                let mut pairs = unsafe {
                    gpu.ctx
                        .alloc_pinned_with_flags::<u32>(4 * most, sys::CU_MEMHOSTALLOC_DEVICEMAP)
                }
                .map_err(|e| cuda_err("host KV tier copy lists", e))?;
                let dev = mapped(&mut pairs)?;
                staging.push(PairStaging {
                    pairs,
                    dev,
                    read: None,
                });
            }
        }
        let values = if kv_fp8 {
            c.num_kv_heads * c.head_dim
        } else {
            c.num_kv_heads * c.head_dim * 2
        } * block_size;
        let scales = if kv_fp8 {
            c.num_kv_heads * 4 * block_size
        } else {
            0
        };
        Ok(Some(HostKvTier {
            mem,
            mem_dev,
            engine,
            staging,
            turn: 0,
            stream: gpu.stream.clone(),
            geometry: Geometry {
                layers: c.num_layers,
                values,
                scales,
            },
            num_blocks,
        }))
    }

    /// Enqueues the copies on the compute stream: every `offloads` block from the cache to the
    /// tier, then every `loads` block from the tier to the cache. Every id is checked (against
    /// the cache's `cache_blocks` and the tier's blocks) before anything is enqueued.
    pub fn copy(
        &mut self,
        gpu: &Gpu,
        buf: &Buffers,
        cache_blocks: usize,
        offloads: &[KvCopy],
        loads: &[KvCopy],
    ) -> Result<(), GpuError> {
        for c in offloads.iter().chain(loads) {
            if c.device as usize >= cache_blocks || c.host as usize >= self.num_blocks {
                return Err(GpuError::BadBatch(format!(
                    "KV copy between cache block {} and host block {}: out of range ({} cache \
                     blocks, {} host blocks)",
                    c.device, c.host, cache_blocks, self.num_blocks
                )));
            }
        }
        gpu.bind()?;
        let g = self.geometry;
        // Bytes a DMA call moves per block of a run, on average: a part's values, and with
        // fp8 its scales by a call of their own.
        let per_call = if g.scales > 0 {
            (g.values + g.scales) / 2
        } else {
            g.values
        };
        let (offload_min, load_min) = self.engine.dma_min();
        let (offload_runs, offload_pairs) = split_runs(offloads, per_call, offload_min);
        let (load_runs, load_pairs) = split_runs(loads, per_call, load_min);
        // Every offload before every load (one stream): DMA offloads, the kernel's offloads
        // and loads, DMA loads.
        self.copy_by_dma(gpu, buf, true, &offload_runs)?;
        if !offload_pairs.is_empty() || !load_pairs.is_empty() {
            self.copy_by_kernel(gpu, buf, &offload_pairs, &load_pairs)?;
        }
        self.copy_by_dma(gpu, buf, false, &load_runs)
    }

    /// `runs` (first cache block, first tier block, length) as one DMA per layer, part and
    /// run (two with fp8 scales). The ids were checked by [`Self::copy`].
    fn copy_by_dma(
        &mut self,
        gpu: &Gpu,
        buf: &Buffers,
        to_host: bool,
        runs: &[(usize, usize, usize)],
    ) -> Result<(), GpuError> {
        if runs.is_empty() {
            return Ok(());
        }
        let host = self
            .mem
            .as_mut_ptr()
            .map_err(|e| cuda_err("host KV tier", e))?;
        let g = self.geometry;
        let host_part = self.num_blocks * (g.values + g.scales);
        let host_values = self.num_blocks * g.values;
        for &(device, hb, n) in runs {
            for part in 0..2 * g.layers {
                let dev = buf.kv.ptr() + (part * buf.kv_layer_bytes) as u64;
                let at = part * host_part;
                let mut ranges = vec![(
                    dev + (device * g.values) as u64,
                    at + hb * g.values,
                    n * g.values,
                )];
                if let Some(scales_at) = buf.kv_scales_at {
                    ranges.push((
                        dev + (scales_at + device * g.scales) as u64,
                        at + host_values + hb * g.scales,
                        n * g.scales,
                    ));
                }
                for (d, h, len) in ranges {
                    // SAFETY: the ids were checked by `copy`, so the device range lies inside
                    // the cache's part and the host range inside the tier, which lives until
                    // the stream is synchronised (`Drop`) and which the host never reads or
                    // writes itself.
                    unsafe {
                        let h = host.add(h);
                        if to_host {
                            sys::cuMemcpyDtoHAsync_v2(h.cast(), d, len, gpu.stream.cu_stream())
                        } else {
                            sys::cuMemcpyHtoDAsync_v2(d, h.cast(), len, gpu.stream.cu_stream())
                        }
                    }
                    .result()
                    .map_err(|e| cuda_err("host KV tier copy", e))?;
                }
            }
        }
        Ok(())
    }
}

impl HostKvTier {
    /// The copies as `kv_tier_copy` launches: the offloads, then the loads, each list one
    /// launch of a block per (pair, layer part). The ids were checked by [`Self::copy`].
    fn copy_by_kernel(
        &mut self,
        gpu: &Gpu,
        buf: &Buffers,
        offloads: &[KvCopy],
        loads: &[KvCopy],
    ) -> Result<(), GpuError> {
        let turn = self.turn;
        self.turn = (turn + 1) % self.staging.len().max(1);
        let Some(st) = self.staging.get_mut(turn) else {
            return Err(GpuError::Internal("host KV tier: no copy lists".into()));
        };
        // Room for two lists of `cap` pairs: the offloads', then the loads'.
        let cap = st.pairs.len() / 4;
        if offloads.len() > cap || loads.len() > cap {
            return Err(GpuError::BadBatch(format!(
                "KV copies of {} and {} blocks exceed the {cap} a list can hold",
                offloads.len(),
                loads.len()
            )));
        }
        // The launches that last read this buffer must be done before it is written again.
        if let Some(e) = &st.read {
            e.synchronize()
                .map_err(|e| cuda_err("host KV tier copy lists", e))?;
        }
        let pairs = st
            .pairs
            .as_mut_slice()
            .map_err(|e| cuda_err("host KV tier copy lists", e))?;
        for (i, c) in offloads.iter().enumerate() {
            pairs[2 * i] = c.device;
            pairs[2 * i + 1] = c.host;
        }
        for (i, c) in loads.iter().enumerate() {
            pairs[2 * (cap + i)] = c.device;
            pairs[2 * (cap + i) + 1] = c.host;
        }
        let g = self.geometry;
        let host_part = self.num_blocks * (g.values + g.scales);
        let host_values = self.num_blocks * g.values;
        let mem_dev = self.mem_dev;
        let mut enqueue = || -> Result<(), GpuError> {
            for (to_host, n, at) in [(true, offloads.len(), 0), (false, loads.len(), cap)] {
                if n == 0 {
                    continue;
                }
                let grid_x = u32::try_from(n)
                    .map_err(|_| GpuError::BadBatch(format!("{n} KV copies in one list")))?;
                gpu.launch(
                    &gpu.k.kv_tier_copy,
                    (grid_x, (2 * g.layers) as u32, 1),
                    256,
                    &[
                        Arg::Ptr(buf.kv.ptr()),
                        Arg::U64(buf.kv_layer_bytes as u64),
                        Arg::U64(buf.kv_scales_at.unwrap_or(0) as u64),
                        Arg::Ptr(mem_dev),
                        Arg::U64(host_part as u64),
                        Arg::U64(host_values as u64),
                        Arg::Ptr(st.dev + (2 * at * std::mem::size_of::<u32>()) as u64),
                        Arg::I32(i32::from(to_host)),
                        Arg::U64(g.values as u64),
                        Arg::U64(g.scales as u64),
                    ],
                )?;
            }
            let event = match st.read.take() {
                Some(e) => e,
                None => gpu
                    .ctx
                    .new_event(None)
                    .map_err(|e| cuda_err("host KV tier event", e))?,
            };
            event
                .record(&gpu.stream)
                .map_err(|e| cuda_err("host KV tier event", e))?;
            st.read = Some(event);
            Ok(())
        };
        let enqueued = enqueue();
        if enqueued.is_err() {
            // The offloads' launch may be queued when the loads' fails, or both when the event
            // cannot be recorded: no event guards this buffer then, and its next use (two
            // calls on) would rewrite the pairs under a launch still reading them. Wait for
            // the stream instead.
            let _ = gpu.stream.synchronize();
        }
        enqueued
    }
}

/// The device address of mapped page-locked memory.
fn mapped<T>(mem: &mut PinnedHostSlice<T>) -> Result<u64, GpuError>
where
    T: cudarc::driver::ValidAsZeroBits,
{
    let host = mem.as_mut_ptr().map_err(|e| cuda_err("host KV tier", e))?;
    let mut dev: sys::CUdeviceptr = 0;
    // SAFETY: `host` is the start of a live page-locked allocation made with DEVICEMAP.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) }
        .result()
        .map_err(|e| cuda_err("mapping the host KV tier", e))?;
    Ok(dev)
}

impl Drop for HostKvTier {
    fn drop(&mut self) {
        // Copies still queued may not outlive the memory.
        let _ = self.stream.synchronize();
    }
}

/// `copies` split by run: the runs (first cache block, first tier block, length) of blocks
/// consecutive on both sides that move at least `dma_min` bytes per DMA call (`per_block` a
/// block; a `dma_min` of `usize::MAX`: none), and the blocks of the others, in order.
fn split_runs(
    copies: &[KvCopy],
    per_block: usize,
    dma_min: usize,
) -> (Vec<(usize, usize, usize)>, Vec<KvCopy>) {
    let mut dma = Vec::new();
    let mut single = Vec::new();
    for (device, host, n) in runs(copies) {
        // `usize::MAX` (the kernel engine's bound): never, however large the run.
        if dma_min != usize::MAX && n.saturating_mul(per_block) >= dma_min {
            dma.push((device, host, n));
        } else {
            single.extend((0..n).map(|i| KvCopy {
                device: (device + i) as u32,
                host: (host + i) as u32,
            }));
        }
    }
    (dma, single)
}

/// Copies as runs (first cache block, first tier block, length) of blocks consecutive on both
/// sides, in order.
fn runs(copies: &[KvCopy]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for c in copies {
        let (d, h) = (c.device as usize, c.host as usize);
        match out.last_mut() {
            Some((d0, h0, n)) if *d0 + *n == d && *h0 + *n == h => *n += 1,
            _ => out.push((d, h, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_copies_on_both_sides_make_one_run() {
        let c = |device, host| KvCopy { device, host };
        let got = runs(&[c(4, 0), c(5, 1), c(6, 2), c(7, 9), c(9, 10), c(1, 1)]);
        assert_eq!(got, [(4, 0, 3), (7, 9, 1), (9, 10, 1), (1, 1, 1)]);
        assert!(runs(&[]).is_empty());
    }

    #[test]
    fn runs_that_move_enough_bytes_a_call_go_by_dma_the_rest_by_the_kernel() {
        let c = |device, host| KvCopy { device, host };
        let list = [
            c(4, 0),
            c(5, 1),
            c(6, 2),
            c(7, 9),
            c(9, 10),
            c(10, 11),
            c(1, 1),
        ];
        // Runs of 3, 1, 2 and 1 blocks of 100 bytes: from 200 bytes a call, the runs of 3
        // and 2 by DMA.
        let (dma, single) = split_runs(&list, 100, 200);
        assert_eq!(dma, [(4, 0, 3), (9, 10, 2)]);
        assert_eq!(single, [c(7, 9), c(1, 1)]);
        let (dma, single) = split_runs(&list, 100, 301);
        assert!(dma.is_empty());
        assert_eq!(single, list);
        // The DMA engine's bound (0) and the kernel's (usize::MAX), a huge block included.
        assert_eq!(split_runs(&list, 100, 0).0.len(), 4);
        assert!(split_runs(&list, 100, usize::MAX).0.is_empty());
        assert!(split_runs(&list, usize::MAX, usize::MAX).0.is_empty());
    }

    #[test]
    fn each_engine_sends_runs_by_dma_from_its_bound() {
        assert_eq!(KvCopyEngine::Dma.dma_min(), (0, 0));
        assert_eq!(KvCopyEngine::Kernel.dma_min(), (usize::MAX, usize::MAX));
        assert_eq!(KvCopyEngine::AUTO.dma_min(), (4 << 20, 256 << 10));
    }
}
