//! The host tier of the prefix cache on the CUDA backend (`cache.kv_offloading_size`, vLLM's
//! CPU KV offloading, SGLang's HiCache): page-locked host memory holding whole KV blocks.
//!
//! Two streams. Offloads and loads ([`HostKvTier::copy`], `Backend::copy_kv`) go on the
//! compute stream, so each is ordered after every step enqueued before it and before every
//! step enqueued after it. Stores ([`HostKvTier::store`], `Backend::store_kv`: blocks whose KV
//! is final, copied ahead of their eviction) go on the tier's own copy stream, so that they run
//! alongside the next step instead of before it (on an H100, Llama-3-8B's eviction-time
//! offloads took ~3.2 s of a 40 s run on the compute stream). Their order is kept by events:
//!
//! - a store waits (on the copy stream) for an event recorded on the compute stream when it is
//!   enqueued: every step and copy enqueued before it, the steps that wrote its blocks among
//!   them, is done before it reads them;
//! - an event recorded on the copy stream after each call's stores is `pending` (it covers the
//!   stores of earlier calls too, one stream); before a step is enqueued the compute stream
//!   waits for `due`, then `pending` becomes `due`. So the step right after a store may run
//!   with it (the caller promised that step writes none of its cache blocks), and the step
//!   after that, which may evict and rewrite them, waits for it;
//! - before an offload or load the compute stream waits for the latest of `pending` and `due`
//!   (a copy after the next step may name a stored block on either side), and both are
//!   cleared: everything after on the compute stream follows those stores.
//!
//! The host waits for no DMA; with the kernel it waits, before writing a staging buffer, for the
//! launches that last read it (those of the copy call two before on the same stream, normally
//! long done). Dropping the tier (and the backend) waits for both streams.
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
//! enough bytes a call to pay the call (loads from 256 KiB, offloads and stores from 4 MiB) and
//! the rest by the kernel. The kernel reads its (cache block, tier block) pairs from mapped host
//! memory too: each stream has two staging buffers used in turn, each reused only once the
//! event recorded after the launches that read it has completed.

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

/// `SWITCHYARD_CUDA_KV_STORE`: `dma` (stores by DMA whatever their runs) or `auto` (the
/// default: as offloads); anything else is refused naming the variable.
fn stores_by_dma() -> Result<bool, GpuError> {
    match std::env::var("SWITCHYARD_CUDA_KV_STORE").as_deref() {
        Ok("dma") => Ok(true),
        Err(_) | Ok("auto") => Ok(false),
        Ok(v) => Err(GpuError::InvalidConfig(format!(
            "SWITCHYARD_CUDA_KV_STORE: {v:?} is not one of auto, dma"
        ))),
    }
}

/// The most thread blocks a store's `kv_tier_copy` launch takes by default. Stores run beside
/// a step, and a launch of a block per (pair, layer part) fills SMs the step could use while
/// they wait on PCIe writes: on an H100 (gpu/CUDA_NOTES.md v53, Llama-3-8B on the Mooncake
/// trace, 82,110 blocks stored), 4 blocks took the run from 39.74 s to 38.62 s (16: 39.02 s),
/// and 4 blocks move the 4 GiB/s the run's stores need.
const STORE_BLOCKS: u32 = 4;

/// `SWITCHYARD_CUDA_KV_STORE_BLOCKS`: the most thread blocks a store's `kv_tier_copy` launch
/// takes (1..=65535, or `all`: one per block and layer part, as offloads and loads); unset:
/// [`STORE_BLOCKS`].
fn store_blocks() -> Result<Option<u32>, GpuError> {
    match std::env::var("SWITCHYARD_CUDA_KV_STORE_BLOCKS").as_deref() {
        Err(_) => Ok(Some(STORE_BLOCKS)),
        Ok("all") => Ok(None),
        Ok(v) => match v.parse::<u32>() {
            Ok(n) if (1..=65_535).contains(&n) => Ok(Some(n)),
            _ => Err(GpuError::InvalidConfig(format!(
                "SWITCHYARD_CUDA_KV_STORE_BLOCKS: {v:?} is not a count in 1..=65535 or all"
            ))),
        },
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

/// A stream the tier's copies go on, with the kernel's pair buffers of its own (a buffer is
/// rewritten only after the launches that read it, which the stream orders).
struct Lane {
    stream: Arc<CudaStream>,
    /// Whether its kernels launch with programmatic dependent launch (the compute stream's, as
    /// every kernel there; the copy stream's launches follow event waits and DMA, which it
    /// would not overlap).
    pdl: bool,
    /// The kernel's pair buffers, used in turn (empty with DMA).
    staging: Vec<PairStaging>,
    /// The next of `staging` to use.
    turn: usize,
    /// Most thread blocks a `kv_tier_copy` launch takes (`None`: one per block and layer
    /// part). The copy stream's (`SWITCHYARD_CUDA_KV_STORE_BLOCKS`) leaves the other SMs to
    /// the step its stores run beside.
    max_blocks: Option<u32>,
}

impl Lane {
    /// A lane on `stream` with two pair buffers of `most` pairs a list (none with DMA).
    fn new(
        gpu: &Gpu,
        stream: Arc<CudaStream>,
        pdl: bool,
        engine: KvCopyEngine,
        most: usize,
    ) -> Result<Self, GpuError> {
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
        Ok(Lane {
            stream,
            pdl,
            staging,
            turn: 0,
            max_blocks: None,
        })
    }
}

/// Where the tier's bytes are, for one call's copies.
#[derive(Clone, Copy)]
struct TierMem {
    /// The host address of the tier (null when no DMA of the call needs it).
    host: *mut u8,
    /// The device address of its mapping (0 with DMA).
    dev: u64,
    geometry: Geometry,
    num_blocks: usize,
}

/// The host tier: `num_blocks` blocks of page-locked memory.
pub(crate) struct HostKvTier {
    mem: PinnedHostSlice<u8>,
    /// The device address of `mem` (its mapping; 0 with DMA, which does not use it).
    mem_dev: u64,
    engine: KvCopyEngine,
    /// Whether stores go by DMA whatever their runs (`SWITCHYARD_CUDA_KV_STORE=dma`): the copy
    /// engines leave the SMs to the step the stores run beside, at ~2.3 us of host time a
    /// call; by default they follow the offloads' rules.
    stores_by_dma: bool,
    /// Offloads and loads: the compute stream.
    compute: Lane,
    /// Stores: the tier's copy stream.
    stores: Lane,
    /// Recorded on the compute stream when stores are enqueued; the copy stream waits for it.
    /// One event, recorded again by each store (a wait takes the event as it is then).
    enqueued: CudaEvent,
    /// Recorded on the copy stream after the latest stores (and so after every earlier one).
    pending: Option<CudaEvent>,
    /// After the stores the next step waits for: those enqueued before the step before it.
    due: Option<CudaEvent>,
    /// Events `pending` and `due` no longer hold, recorded again by later stores (a wait
    /// enqueued before takes the event as it was then), so a store creates none once the
    /// tier has made two or three.
    spare: Vec<CudaEvent>,
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
        let stores_by_dma = stores_by_dma()?;
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
        // destination, a store's source). The scheduler also loads each tier block at most
        // once a plan (`one_plan_loads_a_tier_block_once_for_every_request_that_needs_it`),
        // but the bound by cache blocks does not rely on it: a list holds at most
        // `cache_blocks`.
        let most = cache_blocks;
        let compute = Lane::new(gpu, gpu.stream.clone(), gpu.pdl, engine, most)?;
        // Non-blocking (with respect to the legacy default stream, which this backend does
        // not use); ordered against the compute stream only by the events below.
        let copy_stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| cuda_err("creating the host KV tier's copy stream", e))?;
        let mut stores = Lane::new(gpu, copy_stream, false, engine, most)?;
        stores.max_blocks = store_blocks()?;
        let enqueued = gpu.event()?;
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
            stores_by_dma,
            compute,
            stores,
            enqueued,
            pending: None,
            due: None,
            spare: Vec::new(),
            geometry: Geometry {
                layers: c.num_layers,
                values,
                scales,
            },
            num_blocks,
        }))
    }

    /// Checks every id of `lists` against the cache's `cache_blocks` and the tier's blocks.
    fn check(&self, cache_blocks: usize, lists: &[&[KvCopy]]) -> Result<(), GpuError> {
        for c in lists.iter().flat_map(|l| l.iter()) {
            if c.device as usize >= cache_blocks || c.host as usize >= self.num_blocks {
                return Err(GpuError::BadBatch(format!(
                    "KV copy between cache block {} and host block {}: out of range ({} cache \
                     blocks, {} host blocks)",
                    c.device, c.host, cache_blocks, self.num_blocks
                )));
            }
        }
        Ok(())
    }

    /// Enqueues the copies on the compute stream: every `offloads` block from the cache to the
    /// tier, then every `loads` block from the tier to the cache, after every store enqueued
    /// before (their blocks may be these copies' sources or destinations). Every id is checked
    /// (against the cache's `cache_blocks` and the tier's blocks) before anything is enqueued.
    pub fn copy(
        &mut self,
        gpu: &Gpu,
        buf: &Buffers,
        cache_blocks: usize,
        offloads: &[KvCopy],
        loads: &[KvCopy],
    ) -> Result<(), GpuError> {
        self.check(cache_blocks, &[offloads, loads])?;
        gpu.bind()?;
        // `pending`, when some, follows `due` on the copy stream: one wait covers both.
        if let Some(e) = self.pending.as_ref().or(self.due.as_ref()) {
            self.compute
                .stream
                .wait(e)
                .map_err(|e| cuda_err("host KV tier: waiting for the stores", e))?;
        }
        self.spare.extend(self.pending.take());
        self.spare.extend(self.due.take());
        self.enqueue(gpu, buf, false, offloads, loads)
    }

    /// Enqueues `stores` (cache to tier, as offloads) on the copy stream, after everything
    /// enqueued on the compute stream so far; the step after the next one waits for them
    /// ([`Self::before_step`]), and so does the next offload or load. Every id is checked
    /// before anything is enqueued. If a copy cannot be enqueued, the copy stream is waited
    /// for before the error returns, so no store of the call is left running unordered.
    pub fn store(
        &mut self,
        gpu: &Gpu,
        buf: &Buffers,
        cache_blocks: usize,
        stores: &[KvCopy],
    ) -> Result<(), GpuError> {
        self.check(cache_blocks, &[stores])?;
        if stores.is_empty() {
            return Ok(());
        }
        gpu.bind()?;
        let done = match self.spare.pop() {
            Some(event) => event,
            None => gpu.event()?,
        };
        // The steps that wrote the stored blocks are on the compute stream, before this point.
        self.enqueued
            .record(&self.compute.stream)
            .map_err(|e| cuda_err("host KV tier event", e))?;
        self.stores
            .stream
            .wait(&self.enqueued)
            .map_err(|e| cuda_err("host KV tier: waiting for the compute stream", e))?;
        let enqueued = self.enqueue(gpu, buf, true, stores, &[]).and_then(|()| {
            done.record(&self.stores.stream)
                .map_err(|e| cuda_err("host KV tier event", e))
        });
        if let Err(e) = enqueued {
            // Some of the stores may be queued with no event after them for a step to wait
            // for: let them finish now.
            let _ = self.stores.stream.synchronize();
            self.spare.push(done);
            return Err(e);
        }
        // An earlier call's event, if any, is behind this one on the copy stream.
        self.spare.extend(self.pending.replace(done));
        Ok(())
    }

    /// Called before a step is enqueued on the compute stream: the compute stream waits for
    /// the stores enqueued before the previous step (`due`), and those enqueued since (which
    /// may run with this step, whose writes the caller keeps off their blocks) become due for
    /// the next one. When the wait cannot be enqueued nothing changes.
    pub fn before_step(&mut self) -> Result<(), GpuError> {
        if let Some(e) = &self.due {
            self.compute
                .stream
                .wait(e)
                .map_err(|e| cuda_err("host KV tier: waiting for the stores", e))?;
        }
        self.spare
            .extend(std::mem::replace(&mut self.due, self.pending.take()));
        Ok(())
    }

    /// Waits for every store enqueued so far (the copy stream).
    pub fn synchronize_stores(&self) -> Result<(), GpuError> {
        self.stores
            .stream
            .synchronize()
            .map_err(|e| cuda_err("host KV tier: synchronizing the copy stream", e))
    }

    /// Enqueues `offloads` then `loads` on the copy stream (`on_copy_stream`) or the compute
    /// stream, DMA and kernel by the engine's bounds. The ids were checked.
    fn enqueue(
        &mut self,
        gpu: &Gpu,
        buf: &Buffers,
        on_copy_stream: bool,
        offloads: &[KvCopy],
        loads: &[KvCopy],
    ) -> Result<(), GpuError> {
        let g = self.geometry;
        // Bytes a DMA call moves per block of a run, on average: a part's values, and with
        // fp8 its scales by a call of their own.
        let per_call = if g.scales > 0 {
            (g.values + g.scales) / 2
        } else {
            g.values
        };
        let (offload_min, load_min) = match self.engine.dma_min() {
            (_, load_min) if on_copy_stream && self.stores_by_dma => (0, load_min),
            bounds => bounds,
        };
        let (offload_runs, offload_pairs) = split_runs(offloads, per_call, offload_min);
        let (load_runs, load_pairs) = split_runs(loads, per_call, load_min);
        let host = if offload_runs.is_empty() && load_runs.is_empty() {
            std::ptr::null_mut()
        } else {
            self.mem
                .as_mut_ptr()
                .map_err(|e| cuda_err("host KV tier", e))?
        };
        let tier = TierMem {
            host,
            dev: self.mem_dev,
            geometry: g,
            num_blocks: self.num_blocks,
        };
        let lane = if on_copy_stream {
            &mut self.stores
        } else {
            &mut self.compute
        };
        // Every offload before every load (one stream): DMA offloads, the kernel's offloads
        // and loads, DMA loads.
        copy_by_dma(&lane.stream, buf, tier, true, &offload_runs)?;
        if !offload_pairs.is_empty() || !load_pairs.is_empty() {
            lane.copy_by_kernel(gpu, buf, tier, &offload_pairs, &load_pairs)?;
        }
        copy_by_dma(&lane.stream, buf, tier, false, &load_runs)
    }
}

/// `runs` (first cache block, first tier block, length) as one DMA on `stream` per layer, part
/// and run (two with fp8 scales). The ids were checked by [`HostKvTier::check`].
fn copy_by_dma(
    stream: &CudaStream,
    buf: &Buffers,
    tier: TierMem,
    to_host: bool,
    runs: &[(usize, usize, usize)],
) -> Result<(), GpuError> {
    if runs.is_empty() {
        return Ok(());
    }
    if tier.host.is_null() {
        return Err(GpuError::Internal("host KV tier: no host address".into()));
    }
    let g = tier.geometry;
    let host_part = tier.num_blocks * (g.values + g.scales);
    let host_values = tier.num_blocks * g.values;
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
                // SAFETY: the ids were checked, so the device range lies inside the cache's
                // part and the host range inside the tier, which lives until both streams are
                // synchronised (`Drop`) and which the host never reads or writes itself.
                unsafe {
                    let h = tier.host.add(h);
                    if to_host {
                        sys::cuMemcpyDtoHAsync_v2(h.cast(), d, len, stream.cu_stream())
                    } else {
                        sys::cuMemcpyHtoDAsync_v2(d, h.cast(), len, stream.cu_stream())
                    }
                }
                .result()
                .map_err(|e| cuda_err("host KV tier copy", e))?;
            }
        }
    }
    Ok(())
}

impl Lane {
    /// The copies as `kv_tier_copy` launches on this lane's stream: the offloads, then the
    /// loads, each list one launch of a block per (pair, layer part). The ids were checked by
    /// [`HostKvTier::check`].
    fn copy_by_kernel(
        &mut self,
        gpu: &Gpu,
        buf: &Buffers,
        tier: TierMem,
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
        let g = tier.geometry;
        let host_part = tier.num_blocks * (g.values + g.scales);
        let host_values = tier.num_blocks * g.values;
        let (stream, pdl, max_blocks) = (&self.stream, self.pdl, self.max_blocks);
        let mut enqueue = || -> Result<(), GpuError> {
            for (to_host, n, at) in [(true, offloads.len(), 0), (false, loads.len(), cap)] {
                if n == 0 {
                    continue;
                }
                let n_pairs = i32::try_from(n)
                    .map_err(|_| GpuError::BadBatch(format!("{n} KV copies in one list")))?;
                let parts = i32::try_from(2 * g.layers)
                    .map_err(|_| GpuError::Internal("host KV tier: too many layers".into()))?;
                // A block per (pair, part), or at most `max_blocks` looping over them.
                let items = n as u64 * (2 * g.layers) as u64;
                let grid = match max_blocks {
                    Some(m) => (items.min(u64::from(m)).max(1) as u32, 1, 1),
                    None => (n_pairs as u32, parts as u32, 1),
                };
                gpu.launch_on(
                    stream,
                    pdl,
                    &gpu.k.kv_tier_copy,
                    grid,
                    256,
                    &[
                        Arg::Ptr(buf.kv.ptr()),
                        Arg::U64(buf.kv_layer_bytes as u64),
                        Arg::U64(buf.kv_scales_at.unwrap_or(0) as u64),
                        Arg::Ptr(tier.dev),
                        Arg::U64(host_part as u64),
                        Arg::U64(host_values as u64),
                        Arg::Ptr(st.dev + (2 * at * std::mem::size_of::<u32>()) as u64),
                        Arg::I32(i32::from(to_host)),
                        Arg::U64(g.values as u64),
                        Arg::U64(g.scales as u64),
                        Arg::I32(n_pairs),
                        Arg::I32(parts),
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
                .record(stream)
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
            let _ = self.stream.synchronize();
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
        // Copies still queued on either stream may not outlive the memory (nor the pair
        // buffers, freed with the lanes after this).
        let _ = self.stores.stream.synchronize();
        let _ = self.compute.stream.synchronize();
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
