//! The CUDA backend (cargo feature `cuda`): the [`Backend`] trait on an NVIDIA GPU through
//! cudarc, with bf16 weights, a paged bf16 KV cache, cuBLAS GEMMs and skinny-GEMM (GEMV) kernels
//! for small steps, NVRTC-compiled kernels (`gpu/kernels/llama.cu`, `gpu/kernels/gemv.cu`),
//! CUDA graphs for decode steps and sampling on the GPU.
//!
//! Module map: [`device`] (library probe, context, NVRTC compile and disk cache, memory,
//! launches, GEMM and GEMV), `lt` (cuBLASLt matmul plans, one per shape, algorithm chosen once),
//! `weights` (upload or random init on the device), `step` (batch checks and the packed step
//! buffer), `forward` (buffers, the launch sequence, paged attention, decode graphs),
//! `sampling` (per-sequence state, logit edits, the sampling kernel).
//!
//! One step: check and flatten the batch on the host, copy the packed step buffer to the device
//! in one transfer, run the forward pass (a graph replay for decode-only steps), copy raw logits
//! rows to the host only for logprobs, apply the sparse logit edits, sample on the GPU and copy
//! the sampled token ids back (the step's one synchronisation). `execute` waits for that copy;
//! `submit` returns once the step is queued and `collect` waits for it later, so the engine can
//! queue the next step, fed this one's tokens on the device, before reading them.

pub mod device;
mod forward;
mod host_tier;
mod lora;
mod lt;
mod sampling;
mod step;
#[doc(hidden)]
pub mod testing;
mod timing;
mod weights;

use std::collections::HashMap;
use std::sync::Arc;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::backend::{
    logit_rows_of, prompt_logprobs, takes_pending_tokens, validate_batch, AcceptedDraft, Backend,
    Batch, DraftVerifier, KvCopy, SamplingParams, SeqInput, SeqOutput, CUDA_MAX_BATCH_TOKENS,
    MAX_LOGIT_ROWS, PENDING_TOKEN,
};
use crate::error::GpuError;
use crate::model::{LlamaConfig, ModelWeights};
use crate::sampler::{log_softmax, top_n};
use device::Gpu;
pub use device::{probe, DeviceInfo, Fp8Scaling};
use forward::{bucket_for, bucket_launch, Buffers, Graphs, Launch, GRAPH_BUCKETS};
pub use host_tier::KvCopyEngine;
use sampling::{Edits, SampleArrays, SeqState, TokenMasks};
use step::{grid_splits, Layout, SampleRow};
use weights::GpuWeights;

/// Settings of a [`CudaBackend`].
#[derive(Clone, Debug)]
pub struct CudaBackendConfig {
    /// CUDA device ordinal.
    pub device: usize,
    /// KV cache blocks; `None` sizes the cache from `gpu_memory_utilization`.
    pub num_kv_blocks: Option<usize>,
    /// Fraction of the device memory this process may hold (weights, buffers, KV cache).
    pub gpu_memory_utilization: f64,
    /// Token slots per block.
    pub block_size: usize,
    /// Most tokens per batch.
    pub max_batch_tokens: usize,
    /// Most sequences per batch (decode graphs are captured up to this size).
    pub max_num_seqs: usize,
    /// Capture CUDA graphs for decode-only steps.
    pub cuda_graphs: bool,
    /// Seed of the streams of requests that bring none.
    pub seed: u64,
    /// Quantize the layers' matrices to fp8 at load (e4m3, a scale per output channel; see
    /// `weights`): half the weight bytes once loaded (loading holds one layer in bf16 at a
    /// time), fp8 tensor cores for large steps (activations quantized per token, or per step
    /// where cuBLASLt lacks outer-vector scaling), bf16 activations on the GEMV kernels for
    /// small ones. Needs sm_89 or newer.
    pub fp8: bool,
    /// Keep keys and values in the paged cache as e4m3 with an f32 scale per (token, KV head)
    /// (`kv_cache_dtype: fp8`): about half the cache bytes per token (1.94x the blocks in the
    /// same memory at head dim 128), half the bytes attention reads. The scale is the vector's
    /// max |x| / 448, so no calibration is needed; attention reads the e4m3 rows from shared
    /// memory and widens them to bf16 in registers, just before each product.
    pub kv_fp8: bool,
    /// Bytes of the host KV tier (`cache.kv_offloading_size`; 0: none): page-locked host
    /// memory of whole KV blocks ([`Backend::num_host_kv_blocks`]), see `host_tier`.
    pub host_kv_bytes: usize,
    /// How the host tier's copies run; `None`: `SWITCHYARD_CUDA_KV_COPY` (`auto`, `dma`,
    /// `kernel`), else [`KvCopyEngine::AUTO`].
    pub host_kv_copy: Option<KvCopyEngine>,
    /// Where the user set the KV cache's blocks and the tier's size, for refusals (the
    /// configuration's fields, or a command's flags).
    pub setting_names: crate::KvSettingNames,
}

impl Default for CudaBackendConfig {
    fn default() -> Self {
        CudaBackendConfig {
            device: 0,
            num_kv_blocks: None,
            gpu_memory_utilization: 0.9,
            block_size: 16,
            max_batch_tokens: 8192,
            max_num_seqs: 256,
            cuda_graphs: true,
            seed: 0,
            fp8: false,
            kv_fp8: false,
            host_kv_bytes: 0,
            host_kv_copy: None,
            setting_names: crate::KvSettingNames::CONFIG,
        }
    }
}

/// The fp8 products a model's layers run on cuBLASLt, as (m, k, f32 output, accumulate), and
/// step sizes to check them at: each layer's four projections at 1, 64, 256 tokens and the
/// largest step.
fn fp8_shapes(c: &LlamaConfig, max_tokens: usize) -> device::Fp8Shapes {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q, kv, inter) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
    let products = vec![
        (q + 2 * kv, h, true, false),
        (h, q, true, true),
        (2 * inter, h, false, false),
        (h, inter, true, true),
    ];
    let mut ns: Vec<usize> = [1, 64, 256, max_tokens]
        .into_iter()
        .filter(|&n| n <= max_tokens)
        .collect();
    ns.dedup();
    (products, ns)
}

/// Memory kept free beyond the buffers: cuBLAS, graphs, the driver.
const RESERVE_BYTES: usize = 1 << 30;

/// The CUDA backend.
pub struct CudaBackend {
    // Field order is drop order: graphs and buffers before the weights, all before the device.
    graphs: Graphs,
    buf: Buffers,
    /// LoRA adapters on the device and their per-step table.
    loras: lora::DeviceLoras,
    edit_buf: Option<device::DevMem>,
    /// Device copy of a step's token masks (structured output), grown as needed.
    mask_buf: Option<device::DevMem>,
    /// The sampling half of the last submitted step, when its constrained rows wait for the
    /// tokens of the step before (run by that step's `collect`).
    deferred: Option<StepTail>,
    weights: GpuWeights,
    timing: Option<timing::StepTiming>,
    /// The host tier of the prefix cache, if configured.
    host_tier: Option<host_tier::HostKvTier>,
    gpu: Gpu,
    config: LlamaConfig,
    block_size: usize,
    /// Most sequences in one step (`max_num_seqs`): the step buffer holds that many block
    /// tables.
    max_seqs: usize,
    num_blocks: usize,
    max_graph_batch: usize,
    states: HashMap<u64, SeqState>,
    seeds: ChaCha8Rng,
    host_step: Vec<u8>,
    /// Page-locked copies of the step buffer and the sampled ids, so that both transfers are
    /// plain DMA (`None` with `SWITCHYARD_CUDA_PINNED=0`: pageable memory, staged by the
    /// driver).
    staging: Option<Staging>,
    /// Scratch of the split greedy sampling (`None` with `SWITCHYARD_CUDA_SPLIT_ARGMAX=0`: one
    /// `sample_rows` block per row, greedy rows included).
    argmax: Option<sampling::ArgmaxScratch>,
    /// Steps on the stream whose sampled ids are not read yet, oldest first (at most two); a
    /// step whose deferred sampling half failed holds its error, so that its own collect
    /// answers for it (the step collected before it keeps its outputs).
    submitted: std::collections::VecDeque<Result<Submitted, GpuError>>,
    /// Number of the next step submitted (page-locked buffers and timing events alternate by
    /// it).
    next_step: u64,
    /// Steps up to this number (exclusive) have finished on the GPU.
    done_before: u64,
    /// Row of `buf.sampled` each sequence of the last submitted step samples into: where a
    /// [`PENDING_TOKEN`] of the next step is read from.
    last_samples: HashMap<u64, usize>,
    name: String,
}

/// A submitted step: its outputs but the sampled tokens, and where those arrive.
struct Submitted {
    /// Step number.
    step: u64,
    /// Outputs in batch order (prompt logprobs filled in), tokens to come.
    outputs: Vec<SeqOutput>,
    /// Per sampled row, in order: the output it belongs to, its logits row, the request's
    /// sampling parameters, and the draft token that follows the row's position (a draft is
    /// kept when the row samples it).
    samples: Vec<SampledRow>,
    /// Raw logits rows copied for logprobs.
    raw: HashMap<usize, Vec<f32>>,
    /// The sampled ids: already read (pageable copies wait), or on their way into the
    /// page-locked buffer of this step's parity, complete when `ready` has.
    ids: SubmittedIds,
    /// Final hidden states on their way into the page-locked hidden buffer of this step's
    /// parity (with the ids): the first row copied, and per output asking for one, the
    /// output's index and its row.
    hidden: Option<(usize, Vec<(usize, usize)>)>,
}

/// One sampled row of a submitted step.
struct SampledRow {
    /// Index of the output (batch entry) it belongs to.
    output: usize,
    /// Its logits row.
    row: usize,
    sampling: Arc<SamplingParams>,
    /// The draft fed after the row's token, if any.
    draft: Option<u32>,
}

/// Whether the CUDA backend verifies drafts for a request: its rows are sampled in parallel,
/// each with its own draw of the sequence's stream, its penalties computed as if the drafts
/// before it were accepted, and under a grammar that can take commits back, the mask after
/// those drafts; which is what feeding one token per step would give. (A grammar's rows get
/// their edits once the masks are known, after every draft is recorded, so not with
/// penalties.)
fn verifies_drafts(p: &SamplingParams) -> bool {
    p.constraint
        .as_ref()
        .is_none_or(|c| c.can_roll_back() && takes_pending_tokens(p))
}

enum SubmittedIds {
    Read(Vec<i32>),
    Pinned(cudarc::driver::CudaEvent),
}

/// Page-locked host buffers for the per-step copies: the sampled ids (one per logit row), and
/// the packed step buffer, grown to the largest step seen (in powers of two from 64 KiB)
/// rather than sized for the largest possible one (block tables for every token at the
/// longest context: tens of MiB at Llama-3-8B's limits).
///
/// Two of each, used by step number parity, so a step can be submitted while the one before
/// it still runs (its upload may not have happened yet, its ids not arrived).
struct Staging {
    step: [Option<cudarc::driver::PinnedHostSlice<u8>>; 2],
    tokens: [cudarc::driver::PinnedHostSlice<i32>; 2],
    /// The bf16 final hidden states a step's embeddings asked for (allocated at the first
    /// such step, grown as needed, like `step`).
    hidden: [Option<cudarc::driver::PinnedHostSlice<u16>>; 2],
    /// The step whose upload last used each step buffer: the buffer may be rewritten once that
    /// step has finished (`done_before`); otherwise (a step that failed or sampled nothing in
    /// between) the next upload waits for the stream first.
    uploaded: [Option<u64>; 2],
    /// Growing a step buffer failed once: later steps copy from pageable memory.
    step_failed: bool,
}

/// Smallest page-locked step buffer.
const STAGING_MIN_BYTES: usize = 64 << 10;

/// Bytes of a page-locked step buffer for a step of `n` bytes when the device's step buffer
/// holds `cap`: the next power of two, at least [`STAGING_MIN_BYTES`], at most `cap` (never
/// less than `n`).
fn staging_len(n: usize, cap: usize) -> usize {
    n.next_power_of_two().max(STAGING_MIN_BYTES).min(cap.max(n))
}

/// Page-locked host memory of `len` values (no flags: write-combined memory would make the
/// host's reads of the sampled ids slow).
fn alloc_pinned<T: cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    len: usize,
) -> Result<cudarc::driver::PinnedHostSlice<T>, cudarc::driver::DriverError> {
    // SAFETY: plain bytes and integers; every read of them follows a write (the packed step,
    // a finished copy of the sampled ids).
    unsafe { gpu.ctx.alloc_pinned_with_flags::<T>(len.max(1), 0) }
}

impl Staging {
    /// Buffers for steps of up to `rows` sampled rows; `None` (with a warning) where the
    /// driver refuses page-locked memory: the copies then use pageable memory, as with
    /// `SWITCHYARD_CUDA_PINNED=0`.
    fn new(gpu: &Gpu, rows: usize) -> Option<Self> {
        match alloc_pinned::<i32>(gpu, rows).and_then(|a| Ok([a, alloc_pinned::<i32>(gpu, rows)?]))
        {
            Ok(tokens) => Some(Staging {
                step: [None, None],
                tokens,
                hidden: [None, None],
                uploaded: [None, None],
                step_failed: false,
            }),
            Err(e) => {
                tracing::warn!(error = ?e, "no page-locked host memory: per-step copies use pageable memory");
                None
            }
        }
    }

    /// A page-locked buffer of at least `n` bytes (at most `cap`), grown if needed; `None`
    /// when growing failed (once, with a warning), so the caller copies from pageable memory.
    /// The caller has made sure no copy from the current buffer is running. Takes the fields
    /// `step` and `step_failed` so the caller may set `uploaded` while it holds the buffer.
    fn step_buffer<'a>(
        step: &'a mut Option<cudarc::driver::PinnedHostSlice<u8>>,
        step_failed: &mut bool,
        gpu: &Gpu,
        n: usize,
        cap: usize,
    ) -> Option<&'a mut [u8]> {
        if *step_failed {
            return None;
        }
        if step.as_ref().is_none_or(|b| b.len() < n) {
            let len = staging_len(n, cap);
            *step = None;
            match alloc_pinned::<u8>(gpu, len) {
                Ok(b) => *step = Some(b),
                Err(e) => {
                    tracing::warn!(error = ?e, bytes = len, "no page-locked step buffer: steps copy from pageable memory");
                    *step_failed = true;
                    return None;
                }
            }
        }
        step.as_mut()?.as_mut_slice().ok()?.get_mut(..n)
    }

    /// A page-locked buffer of at least `n` bf16 values for hidden states (at most `cap`),
    /// grown if needed; `None` when that failed (the caller then copies synchronously). The
    /// caller has made sure no copy into the current buffer is running.
    fn hidden_buffer<'a>(
        buf: &'a mut Option<cudarc::driver::PinnedHostSlice<u16>>,
        gpu: &Gpu,
        n: usize,
        cap: usize,
    ) -> Option<&'a mut [u16]> {
        if buf.as_ref().is_none_or(|b| b.len() < n) {
            let len = staging_len(n, cap);
            *buf = None;
            match alloc_pinned::<u16>(gpu, len) {
                Ok(b) => *buf = Some(b),
                Err(e) => {
                    tracing::warn!(error = ?e, values = len, "no page-locked hidden-state buffer: copied synchronously");
                    return None;
                }
            }
        }
        buf.as_mut()?.as_mut_slice().ok()?.get_mut(..n)
    }
}

/// The hidden state of row `r` from `v`, a copy of bf16 rows of `h` values from row `lo`.
fn hidden_row(v: &[u16], lo: usize, h: usize, r: usize) -> Option<Vec<f32>> {
    let at = r.checked_sub(lo)? * h;
    Some(
        v.get(at..at + h)?
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect(),
    )
}

/// Where the weights come from.
pub enum WeightSource<'a> {
    /// Loaded tensors (canonical GGUF names).
    Loaded(&'a ModelWeights),
    /// Random weights generated on the device from a seed.
    Dummy(u64),
}

impl CudaBackend {
    /// Opens the GPU, uploads (or generates) the weights and sizes the KV cache.
    pub fn new(
        config: &LlamaConfig,
        source: WeightSource<'_>,
        cfg: &CudaBackendConfig,
    ) -> Result<Self, GpuError> {
        config.validate()?;
        if device::attention_kernel_index(config.head_dim).is_none() {
            return Err(GpuError::InvalidConfig(format!(
                "the CUDA backend runs head dimensions {:?}, not {}",
                device::ATTENTION_HEAD_DIMS,
                config.head_dim
            )));
        }
        // Callers check the user's setting first and name it (`bench --max-num-batched-tokens`,
        // `scheduler.max_num_batched_tokens`); this names the setting as the server's config.
        if cfg.max_batch_tokens == 0 || cfg.max_batch_tokens > CUDA_MAX_BATCH_TOKENS {
            return Err(GpuError::InvalidConfig(format!(
                "the tokens of one step (scheduler.max_num_batched_tokens) must be in \
                 1..={CUDA_MAX_BATCH_TOKENS} on the CUDA backend, not {}",
                cfg.max_batch_tokens
            )));
        }
        if cfg.block_size == 0 || cfg.block_size > 1024 || cfg.max_num_seqs == 0 {
            return Err(GpuError::InvalidConfig(
                "block_size must be in 1..=1024 and max_num_seqs at least 1".into(),
            ));
        }
        if !(cfg.gpu_memory_utilization > 0.0 && cfg.gpu_memory_utilization <= 1.0) {
            return Err(GpuError::InvalidConfig(
                "gpu_memory_utilization must be in (0, 1]".into(),
            ));
        }
        let mut gpu = Gpu::open(cfg.device)?;
        gpu.gemv_rotate = device::gemv_rotation(config.hidden_size);
        if cfg.fp8 && gpu.info.compute_capability < (8, 9) {
            return Err(GpuError::InvalidConfig(format!(
                "quantization fp8 needs fp8 tensor cores (sm_89 or newer); this GPU is sm_{}{}",
                gpu.info.compute_capability.0, gpu.info.compute_capability.1
            )));
        }
        let fp8 = if cfg.fp8 {
            let scaling = gpu.fp8_scaling(&fp8_shapes(config, cfg.max_batch_tokens)).ok_or_else(|| {
                GpuError::InvalidConfig(
                    "quantization fp8: cuBLASLt has no fp8 matrix products for this model on this system".into(),
                )
            })?;
            tracing::info!(?scaling, "fp8 layers");
            Some(scaling)
        } else {
            None
        };
        let quantizer = match fp8 {
            Some(s) => Some(weights::Fp8Quantizer::new(&gpu, config, s)?),
            None => None,
        };
        let weights = match source {
            WeightSource::Loaded(w) => weights::from_model(&gpu, config, w, quantizer.as_ref())?,
            WeightSource::Dummy(seed) => weights::dummy(&gpu, config, seed, quantizer.as_ref())?,
        };
        drop(quantizer);
        let max_tokens = cfg.max_batch_tokens;
        let max_rows = max_tokens.min(MAX_LOGIT_ROWS.max(cfg.max_num_seqs));
        let bs = cfg.block_size;
        let per_block = forward::kv_block_bytes(config, bs, cfg.kv_fp8);
        let max_seqs = cfg.max_num_seqs.min(max_tokens);
        let act = Buffers::activation_bytes(config, (max_tokens, max_seqs), max_rows, bs, cfg.fp8)
            + sampling::ArgmaxScratch::bytes(max_rows);
        let num_blocks = match cfg.num_kv_blocks {
            Some(n) => {
                // A count the free memory cannot hold would fail in the allocation with the
                // driver's bare out-of-memory error: refuse it naming where it was set.
                let (free, _) = gpu.mem_info()?;
                let need = n.saturating_mul(per_block).saturating_add(act);
                if need > free {
                    return Err(GpuError::InvalidConfig(format!(
                        "{}: {n} KV blocks of {per_block} bytes and {} MiB of step buffers need \
                         {} MiB of GPU memory, but {} MiB are free after the weights ({} MiB): \
                         at most {} blocks",
                        cfg.setting_names.blocks,
                        act >> 20,
                        need >> 20,
                        free >> 20,
                        weights.bytes() >> 20,
                        free.saturating_sub(act) / per_block.max(1)
                    )));
                }
                n
            }
            None => {
                let (free, total) = gpu.mem_info()?;
                let allowed = (total as f64 * cfg.gpu_memory_utilization) as usize;
                let used = total - free;
                let budget = allowed
                    .saturating_sub(used)
                    .saturating_sub(act + RESERVE_BYTES);
                budget / per_block
            }
        };
        let blocks_cap = (i32::MAX as usize) / bs;
        if num_blocks == 0 || num_blocks > blocks_cap {
            return Err(GpuError::InvalidConfig(format!(
                "{num_blocks} KV blocks: too little GPU memory for the KV cache (weights {} MiB, buffers {} MiB)",
                weights.bytes() >> 20,
                act >> 20
            )));
        }
        let buf = Buffers::with_cache(
            &gpu,
            config,
            (max_tokens, max_seqs, max_rows),
            num_blocks,
            bs,
            (cfg.fp8, cfg.kv_fp8),
        )?;
        // Profiling times every launch on its own, so it runs without graphs.
        let max_graph_batch = if cfg.cuda_graphs && gpu.prof.is_none() {
            cfg.max_num_seqs
                .min(max_tokens)
                .min(max_rows)
                .min(buf.split_tokens)
                .min(GRAPH_BUCKETS[GRAPH_BUCKETS.len() - 1])
        } else {
            0
        };
        let name = format!(
            "cuda ({}, sm_{}{}, {} MiB {} weights, {} {} KV blocks)",
            gpu.info.name,
            gpu.info.compute_capability.0,
            gpu.info.compute_capability.1,
            weights.bytes() >> 20,
            match fp8 {
                Some(device::Fp8Scaling::Row) => "fp8 (row-scaled)",
                Some(device::Fp8Scaling::Tensor) => "fp8 (tensor-scaled)",
                None => "bf16",
            },
            num_blocks,
            if cfg.kv_fp8 { "fp8" } else { "bf16" }
        );
        let copy_engine = match cfg.host_kv_copy {
            Some(e) => e,
            None => host_tier::KvCopyEngine::from_env()?,
        };
        let host_tier = host_tier::HostKvTier::new(
            &gpu,
            config,
            bs,
            cfg.kv_fp8,
            num_blocks,
            host_tier::TierRequest {
                bytes: cfg.host_kv_bytes,
                engine: copy_engine,
                names: cfg.setting_names,
            },
        )?;
        let timing = timing::StepTiming::from_env(&gpu.ctx)?;
        let argmax = if device::env_switch("SWITCHYARD_CUDA_SPLIT_ARGMAX", true) {
            Some(sampling::ArgmaxScratch::new(&gpu, max_rows)?)
        } else {
            None
        };
        let staging = if device::env_switch("SWITCHYARD_CUDA_PINNED", true) {
            Staging::new(&gpu, max_rows)
        } else {
            None
        };
        Ok(CudaBackend {
            graphs: Graphs::default(),
            buf,
            loras: lora::DeviceLoras::default(),
            edit_buf: None,
            mask_buf: None,
            deferred: None,
            weights,
            timing,
            host_tier,
            gpu,
            config: config.clone(),
            block_size: bs,
            max_seqs,
            num_blocks,
            max_graph_batch,
            states: HashMap::new(),
            seeds: ChaCha8Rng::seed_from_u64(cfg.seed),
            host_step: Vec::new(),
            staging,
            argmax,
            submitted: std::collections::VecDeque::new(),
            next_step: 0,
            done_before: 0,
            last_samples: HashMap::new(),
            name,
        })
    }

    /// The model's architecture.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Number of decode graphs captured so far.
    pub fn graphs_captured(&self) -> usize {
        self.graphs.len()
    }

    /// Number of decode graphs captured for steps with LoRA adapters.
    pub fn lora_graphs_captured(&self) -> usize {
        self.graphs.lora_len()
    }

    /// Number of LoRA adapters with a copy on the device.
    pub fn lora_device_copies(&self) -> usize {
        self.loras.len()
    }

    /// Waits for everything enqueued so far: the compute stream (the copies of
    /// [`Backend::copy_kv`] included) and the host tier's copy stream (those of
    /// [`Backend::store_kv`]); for benchmarks and tests that time or check asynchronous work.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.gpu.bind()?;
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| device::cuda_err("synchronizing the stream", e))?;
        match &self.host_tier {
            Some(t) => t.synchronize_stores(),
            None => Ok(()),
        }
    }

    /// Before a step is enqueued on the compute stream: it waits for the host tier's stores
    /// that the step before it may have run with (see `host_tier`).
    fn before_step(&mut self) -> Result<(), GpuError> {
        match &mut self.host_tier {
            Some(t) => t.before_step(),
            None => Ok(()),
        }
    }

    /// Runs the forward pass only and returns the logits of the last token of every sequence
    /// (`seqs.len() * vocab_size`), touching no sampler state; for tests and benchmarks.
    pub fn logits(&mut self, batch: &Batch) -> Result<Vec<f32>, GpuError> {
        self.logits_rows(batch, |s| vec![s.tokens.len() - 1])
    }

    /// The logits of the chosen chunk rows of every sequence (rows of each sequence in order).
    pub fn logits_rows(
        &mut self,
        batch: &Batch,
        rows: impl Fn(&crate::backend::SeqInput) -> Vec<usize>,
    ) -> Result<Vec<f32>, GpuError> {
        self.gpu.bind()?;
        validate_batch(
            batch,
            &self.config,
            self.num_blocks,
            self.block_size,
            self.buf.max_tokens,
            false,
        )?;
        if !self.submitted.is_empty() {
            return Err(GpuError::Internal(
                "logits with submitted steps not collected".into(),
            ));
        }
        let group = self.config.num_heads / self.config.num_kv_heads;
        let d = step::flatten(batch, group, self.block_size, |i| rows(&batch.seqs[i]))?;
        let launch = self.eager_launch(&d);
        let n = self.next_step;
        self.next_step += 1;
        let lora = self
            .loras
            .prepare(&self.gpu, &self.config, batch, d.tokens.len(), n, None)?;
        self.before_step()?;
        self.upload_step(n, &d, &[], &launch)?;
        self.enqueue(&launch, lora.as_ref().map(|l| &l.0))?;
        let vocab = self.config.vocab_size;
        let mut out = vec![0f32; d.logit_rows.len() * vocab];
        self.gpu.download(&mut out, self.buf.logits.ptr())?;
        self.done_before = n + 1;
        Ok(out)
    }

    /// Enqueues the forward pass of the uploaded step without a graph, with the step's LoRA
    /// adapters if it has any.
    fn enqueue(&self, launch: &Launch, lora: Option<&forward::LoraStep>) -> Result<(), GpuError> {
        forward::enqueue(
            &self.gpu,
            &self.config,
            &self.weights,
            &self.buf,
            self.block_size,
            launch,
            lora,
        )
    }

    /// The launch shape of a step run without a graph.
    fn eager_launch(&self, d: &step::StepData) -> Launch {
        let t = d.tokens.len();
        let tiles = d.tile_qn.len();
        let z = if t <= self.buf.split_tokens {
            grid_splits(tiles, self.config.num_kv_heads, self.gpu.att_max_splits)
        } else {
            1
        };
        let rows = d.logit_rows.len();
        Launch {
            tokens: t,
            tiles,
            small_tiles: step::one_warp_tiles(d.small_tiles, self.config.num_kv_heads),
            rows,
            z,
            early_kv: t <= forward::EARLY_KV_MAX_TOKENS && d.one_token_per_seq(),
            layout: Layout::new(t, tiles, rows, rows),
        }
    }

    /// Packs and uploads the step buffer.
    fn upload_step(
        &mut self,
        n: u64,
        d: &step::StepData,
        samples: &[step::SampleRow],
        l: &Launch,
    ) -> Result<(), GpuError> {
        if l.rows > self.buf.max_rows || l.tokens > self.buf.max_tokens {
            return Err(GpuError::Internal(format!(
                "{} tokens and {} logit rows exceed the buffers",
                l.tokens, l.rows
            )));
        }
        if let Some(t) = &mut self.timing {
            t.start(&self.gpu.stream, n)?;
        }
        let caps = (l.tokens, l.tiles, l.rows, l.rows);
        step::pack(d, samples, &l.layout, caps, l.z, &mut self.host_step);
        if self.host_step.len() > self.buf.step.bytes() {
            return Err(GpuError::Internal(format!(
                "step buffer of {} bytes exceeds {}",
                self.host_step.len(),
                self.buf.step.bytes()
            )));
        }
        if let Some(st) = &mut self.staging {
            let k = (n % 2) as usize;
            // The upload two steps back used this buffer: wait unless that step finished.
            if st.uploaded[k].is_some_and(|u| u >= self.done_before) {
                self.gpu.sync()?;
                self.done_before = n;
            }
            let len = self.host_step.len();
            let cap = self.buf.step.bytes();
            let Staging {
                step,
                uploaded,
                step_failed,
                ..
            } = st;
            if let Some(pinned) =
                Staging::step_buffer(&mut step[k], step_failed, &self.gpu, len, cap)
            {
                pinned.copy_from_slice(&self.host_step);
                uploaded[k] = Some(n);
                return self.gpu.upload(self.buf.step.ptr(), pinned);
            }
        }
        self.gpu.upload(self.buf.step.ptr(), &self.host_step)
    }

    fn wants_prompt_logprobs(&self, s: &crate::backend::SeqInput) -> bool {
        s.sampling.prompt_logprobs.is_some()
            && self.states.get(&s.seq_id).is_none_or(|st| st.in_prompt)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Queued work may still read the buffers, graphs and adapters freed after this (a
        // backend retired after a failed step): let it finish first, the host tier's stores
        // (which read the KV cache, freed before the tier) included.
        if let Err(e) = self.gpu.sync() {
            tracing::warn!(error = %e, "CUDA backend dropped with the device in error");
        }
        if let Some(Err(e)) = self.host_tier.as_ref().map(|t| t.synchronize_stores()) {
            tracing::warn!(error = %e, "CUDA backend dropped with its KV stores in error");
        }
        if let Some(report) = self.gpu.profile_report() {
            eprintln!("{report}");
        }
        if let Some(t) = &self.timing {
            eprintln!("{}", t.report());
        }
    }
}

// The attention kernels read a sliding window's keys from the chunk holding its first key.
const _: () = assert!(step::ATT_KEYS <= crate::backend::CUDA_WINDOW_READ_SLACK);

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn num_kv_blocks(&self) -> usize {
        self.num_blocks
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn max_batch_tokens(&self) -> usize {
        self.buf.max_tokens
    }

    fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
        if !self.submitted.is_empty() {
            return Err(GpuError::Internal(
                "execute with submitted steps not collected".into(),
            ));
        }
        self.submit_step(batch, false)?;
        self.collect()
    }

    fn release(&mut self, seq_id: u64) {
        self.states.remove(&seq_id);
    }

    fn window_read_slack(&self) -> usize {
        crate::backend::CUDA_WINDOW_READ_SLACK
    }

    fn lora_slots(&self) -> usize {
        lora::MAX_DEVICE_ADAPTERS
    }

    fn draft_verifier(&self) -> Option<DraftVerifier> {
        Some(verifies_drafts)
    }

    fn pipelines(&self) -> bool {
        true
    }

    fn overlaps_host(&self) -> bool {
        true
    }

    fn num_host_kv_blocks(&self) -> usize {
        self.host_tier.as_ref().map_or(0, |t| t.num_blocks)
    }

    /// The copies go on the compute stream: after the forward passes of every step submitted
    /// before (a step's sampling held back for the tokens of the one before it reads no KV
    /// block), before every step submitted after. The stream first waits for every store
    /// enqueued before ([`Backend::store_kv`]): a copy after the step that follows a store may
    /// name its cache or host block.
    fn copy_kv(&mut self, offloads: &[KvCopy], loads: &[KvCopy]) -> Result<(), GpuError> {
        if offloads.is_empty() && loads.is_empty() {
            return Ok(());
        }
        let Some(tier) = self.host_tier.as_mut() else {
            return Err(GpuError::BadBatch(format!(
                "the {} backend has no host KV tier",
                self.name
            )));
        };
        tier.copy(&self.gpu, &self.buf, self.num_blocks, offloads, loads)
    }

    /// The stores go on the host tier's own copy stream, so that they run alongside the next
    /// step rather than before it (by DMA and the `kv_tier_copy` kernel as offloads are):
    ///
    /// - on the copy stream they wait for an event recorded on the compute stream now: the
    ///   steps and copies enqueued before, which wrote the stored blocks, are done first;
    /// - the step after the next one waits (on the compute stream, before its upload) for an
    ///   event recorded after them: it may evict and rewrite their cache blocks;
    /// - so does the next [`Backend::copy_kv`] (before its copies): it may name their cache
    ///   or host blocks once the next step is enqueued.
    ///
    /// The next step itself does not wait: the caller promised it writes none of their cache
    /// blocks. Every id is checked before anything is enqueued; a failure after that waits for
    /// the copy stream before it returns. [`CudaBackend::synchronize`] waits for the stores
    /// too.
    fn store_kv(&mut self, stores: &[KvCopy]) -> Result<(), GpuError> {
        if stores.is_empty() {
            return Ok(());
        }
        let Some(tier) = self.host_tier.as_mut() else {
            return Err(GpuError::BadBatch(format!(
                "the {} backend has no host KV tier",
                self.name
            )));
        };
        tier.store(&self.gpu, &self.buf, self.num_blocks, stores)
    }

    fn submit(&mut self, batch: &Batch) -> Result<(), GpuError> {
        if self.submitted.len() > 1 || self.deferred.is_some() {
            return Err(GpuError::Internal(
                "a step submitted more than one ahead of its outputs".into(),
            ));
        }
        self.submit_step(batch, true)
    }

    fn collect(&mut self) -> Result<Vec<SeqOutput>, GpuError> {
        // The deferred sampling below launches kernels: the context must be this thread's.
        self.gpu.bind()?;
        let Some(sub) = self.submitted.pop_front() else {
            return Err(GpuError::Internal("no submitted step to collect".into()));
        };
        let outputs = sub.and_then(|sub| self.collect_step(sub));
        // The step submitted after this one waited for its tokens (structured output): its
        // sampling goes now, while its forward pass runs. If that fails, the failure is the
        // next step's, reported by its collect; this step's outputs stand.
        if let Some(tail) = self.deferred.take() {
            if let Err(e) = self.finish_step(tail) {
                self.submitted.push_back(Err(e));
            }
        }
        outputs
    }
}

impl CudaBackend {
    /// The outputs of a collected step: its sampled ids read back and committed.
    fn collect_step(&mut self, sub: Submitted) -> Result<Vec<SeqOutput>, GpuError> {
        let tokens = match sub.ids {
            SubmittedIds::Read(t) => t,
            SubmittedIds::Pinned(ready) => {
                ready
                    .synchronize()
                    .map_err(|e| device::cuda_err("wait for the sampled ids", e))?;
                let st = self
                    .staging
                    .as_mut()
                    .ok_or_else(|| GpuError::Internal("page-locked ids without staging".into()))?;
                let pinned = st.tokens[(sub.step % 2) as usize]
                    .as_slice()
                    .map_err(|e| device::cuda_err("page-locked sampled ids", e))?;
                pinned
                    .get(..sub.samples.len())
                    .ok_or_else(|| GpuError::Internal("sampled rows exceed the buffers".into()))?
                    .to_vec()
            }
        };
        self.done_before = self.done_before.max(sub.step + 1);
        if let Some(t) = &mut self.timing {
            t.finish(sub.step)?;
        }
        let vocab = self.config.vocab_size;
        let mut outputs = sub.outputs;
        if let Some((lo, rows)) = &sub.hidden {
            // Copied with the ids, which are in (page-locked: `ready` was waited for above).
            let st = self.staging.as_ref().ok_or_else(|| {
                GpuError::Internal("page-locked hidden states without staging".into())
            })?;
            let pinned = st.hidden[(sub.step % 2) as usize]
                .as_ref()
                .ok_or_else(|| GpuError::Internal("no page-locked hidden-state buffer".into()))?
                .as_slice()
                .map_err(|e| device::cuda_err("page-locked hidden states", e))?;
            let h = self.config.hidden_size;
            for &(o, r) in rows {
                let out = outputs
                    .get_mut(o)
                    .ok_or_else(|| GpuError::Internal("hidden state of no output".into()))?;
                out.hidden = Some(hidden_row(pinned, *lo, h, r).ok_or_else(|| {
                    GpuError::Internal("hidden-state row outside its copy".into())
                })?);
            }
        }
        // (output, its constraint, its tokens in order): a sequence's rows are consecutive.
        let mut commits: Vec<(usize, &crate::Constraint, Vec<u32>)> = Vec::new();
        for (s, &tok) in sub.samples.iter().zip(&tokens) {
            let tok = u32::try_from(tok)
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| GpuError::Internal(format!("sampled token {tok}")))?;
            let (p, out) = (&s.sampling, &mut outputs[s.output]);
            let st = self.states.get_mut(&out.seq_id);
            if out.token.is_some() {
                // A row after a rejected draft: its draw was never used, so the stream
                // goes back by one (sampled rows are counted at submit), and its draft was
                // never an output.
                if let Some(st) = st {
                    st.sampled -= 1;
                    if let Some(d) = s.draft {
                        st.unrecord(d, p);
                    }
                }
                continue;
            }
            let (logprob, top_logprobs) = match (p.logprobs, sub.raw.get(&s.row)) {
                (Some(n), Some(row)) => {
                    let lp = log_softmax(row);
                    (lp.get(tok as usize).copied(), top_n(&lp, n as usize))
                }
                _ => (None, Vec::new()),
            };
            if let Some(c) = &p.constraint {
                match commits.last_mut() {
                    Some((o, _, toks)) if *o == s.output => toks.push(tok),
                    _ => commits.push((s.output, c, vec![tok])),
                }
            }
            // A kept draft was recorded at submit; a rejected one is taken back. A sequence
            // released since the submit (it ended) keeps no state.
            if let Some(st) = st {
                match s.draft {
                    Some(d) if d == tok => {}
                    Some(d) => {
                        st.unrecord(d, p);
                        st.record(tok, p);
                    }
                    None => st.record(tok, p),
                }
            }
            if s.draft == Some(tok) {
                out.accepted.push(AcceptedDraft {
                    token: tok,
                    logprob,
                    top_logprobs,
                });
                continue;
            }
            out.token = Some(tok);
            out.logprob = logprob;
            out.top_logprobs = top_logprobs;
        }
        if tokens.len() != sub.samples.len() {
            return Err(GpuError::Internal("missing sampled token".into()));
        }
        // Structured output: each constraint takes its tokens (a few microseconds each; one
        // constraint per sequence, so in parallel).
        commits
            .par_iter()
            .for_each(|(_, c, toks)| c.commit_all(toks));
        Ok(outputs)
    }
}

impl CudaBackend {
    /// Checks, uploads and enqueues one step through its sampling, and the copy of the
    /// sampled ids; `pending_ok`: the batch may feed [`PENDING_TOKEN`]s of the step submitted
    /// before.
    fn submit_step(&mut self, batch: &Batch, pending_ok: bool) -> Result<(), GpuError> {
        self.gpu.bind()?;
        if batch.seqs.len() > self.max_seqs {
            return Err(GpuError::BadBatch(format!(
                "{} sequences in one step exceed max_num_seqs {}",
                batch.seqs.len(),
                self.max_seqs
            )));
        }
        let c = &self.config;
        validate_batch(
            batch,
            c,
            self.num_blocks,
            self.block_size,
            self.buf.max_tokens,
            pending_ok,
        )?;
        let prompt_lp: Vec<bool> = batch
            .seqs
            .iter()
            .map(|s| self.wants_prompt_logprobs(s))
            .collect();
        let group = c.num_heads / c.num_kv_heads;
        let mut d = step::flatten(batch, group, self.block_size, |i| {
            logit_rows_of(&batch.seqs[i], prompt_lp[i])
        })?;
        // Pending tokens: -(row + 1) of the previous step's sampled ids (the embedding reads
        // them on the device).
        let mut at = 0usize;
        for s in &batch.seqs {
            if s.tokens.first() == Some(&PENDING_TOKEN) {
                let row = self.last_samples.get(&s.seq_id).ok_or_else(|| {
                    GpuError::BadBatch(format!(
                        "sequence {} feeds a pending token but the previous step sampled none for it",
                        s.seq_id
                    ))
                })?;
                d.tokens[at] = -(*row as i32) - 1;
            }
            at += s.tokens.len();
        }
        // Sequence states (new ones get their seed now, in batch order) and the rows to sample.
        let mut samples = Vec::new();
        let mut edits = Edits::default();
        let mut constrained = Vec::new();
        let mut waits = false;
        let mut first_row = Vec::with_capacity(batch.seqs.len());
        let mut hidden_row = Vec::with_capacity(batch.seqs.len());
        let mut row = 0usize;
        for (i, s) in batch.seqs.iter().enumerate() {
            let st = match self.states.get_mut(&s.seq_id) {
                Some(st) => st,
                None => {
                    let seed = s.sampling.seed.unwrap_or_else(|| self.seeds.next_u64());
                    self.states.entry(s.seq_id).or_insert(SeqState::new(seed))
                }
            };
            st.observe(s);
            first_row.push(row);
            let n = if prompt_lp[i] {
                s.tokens.len()
            } else if s.sample {
                1 + s.num_drafts
            } else {
                0
            };
            if s.num_drafts > 0 && !verifies_drafts(&s.sampling) {
                return Err(GpuError::BadBatch(format!(
                    "sequence {}: drafts under a grammar that cannot take commits back, or \
                     with penalties, are not verified here",
                    s.seq_id
                )));
            }
            let drafts = &s.tokens[s.tokens.len() - s.num_drafts..];
            // Its rows are row..end: the drafts' rows, then the sampled one (a chunk that
            // samples nothing has none, and no drafts).
            let end = row + n;
            let first = end.saturating_sub(1 + s.num_drafts);
            // The last known token's row (the one sampled before any drafts).
            hidden_row.push((s.sample && s.sampling.hidden_state).then_some(first));
            if s.sample && s.sampling.constraint.is_some() {
                // Its edits wait for its allowed sets (one per row: the drafts committed in
                // turn, then taken back), computed while the step runs.
                constrained.push(ConstrainedRows {
                    seq_id: s.seq_id,
                    row: first,
                    sampled: st.sampled,
                    sampling: s.sampling.clone(),
                    drafts: drafts.to_vec(),
                });
                waits |= s.tokens.first() == Some(&PENDING_TOKEN);
            }
            // One row per draft position, each the next draw of the stream and with the
            // penalties of the drafts before it, as if fed one token per step (collect takes
            // back the draws and the drafts of rows after a rejection).
            for (r, &d) in (first..end.saturating_sub(1)).zip(drafts) {
                if s.sampling.constraint.is_none() {
                    st.edits(r, &s.sampling, None, &mut edits);
                }
                samples.push(st.sample_row(r, &s.sampling));
                st.record(d, &s.sampling);
            }
            if s.sample {
                let r = end - 1;
                if s.sampling.constraint.is_some() {
                    // Edits with the masks (above).
                } else {
                    st.edits(r, &s.sampling, None, &mut edits);
                }
                samples.push(st.sample_row(r, &s.sampling));
            }
            row += n;
        }
        let n_step = self.next_step;
        self.next_step += 1;
        // Decode steps replay a graph (with LoRA adapters, one of its own, when their ranks fit
        // its buffers), and so do verify steps (every sequence a token and its drafts) without
        // adapters, by bucket and longest entry.
        let per_seq = batch.seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(1);
        let decode_only = batch.seqs.iter().all(|s| s.tokens.len() == 1 && s.sample);
        let verify = per_seq > 1
            && batch
                .seqs
                .iter()
                .all(|s| s.sample && s.tokens.len() == 1 + s.num_drafts && s.adapter.is_none())
            && per_seq <= step::ATT_ROWS / group;
        let bucket = if decode_only || verify {
            bucket_for(batch.seqs.len(), self.max_graph_batch).filter(|&b| {
                // A verify graph computes its padding too: worth it while the products stay on
                // the GEMV kernels (whose cost is reading the weights) or the padding is at
                // most as large as the step (H200, SmolLM2 at 24 sequences: a graph padded to
                // 32 x 5 tokens ran 0.87x the step without drafts, the eager step 1.0x).
                let t = b * per_seq;
                per_seq == 1
                    || (t <= self.buf.split_tokens
                        && t <= self.buf.max_rows
                        && t <= self.buf.max_tokens
                        && (t <= device::GEMV_MAX_TOKENS || t <= 2 * d.tokens.len()))
            })
        } else {
            None
        };
        let lora = self.loras.prepare(
            &self.gpu,
            &self.config,
            batch,
            d.tokens.len(),
            n_step,
            bucket,
        )?;
        let bucket = bucket.filter(|_| lora.as_ref().is_none_or(|l| l.1));
        let lora = lora.map(|l| l.0);
        // The step's first operation on the compute stream (its upload) waits for the stores
        // it must not run with (`before_step`, by field: `c` borrows the configuration).
        if let Some(t) = &mut self.host_tier {
            t.before_step()?;
        }
        let mut ran_graph = false;
        let mut launch = self.eager_launch(&d);
        if let Some(b) = bucket {
            let l = bucket_launch(b, per_seq, c, self.gpu.att_max_splits);
            self.upload_step(n_step, &d, &samples, &l)?;
            ran_graph = self.graphs.run(
                &self.gpu,
                &self.config,
                &self.weights,
                &self.buf,
                self.block_size,
                b,
                per_seq,
                lora.as_ref(),
            )?;
            if ran_graph {
                launch = l;
            }
        }
        if !ran_graph {
            self.upload_step(n_step, &d, &samples, &launch)?;
            self.enqueue(&launch, lora.as_ref())?;
        }
        let arrays = SampleArrays::at(&launch.layout, |off| self.buf.step.at(off))?;
        let seqs = batch
            .seqs
            .iter()
            .enumerate()
            .map(|(i, s)| SeqTail {
                seq_id: s.seq_id,
                sample: s.sample,
                sampling: s.sampling.clone(),
                first_row: first_row[i],
                prompt: prompt_lp[i].then(|| s.clone()),
                drafts: s.tokens[s.tokens.len() - s.num_drafts..].to_vec(),
                hidden_row: hidden_row[i],
            })
            .collect();
        let tail = StepTail {
            step: n_step,
            arrays,
            samples,
            edits,
            constrained,
            seqs,
        };
        // A constrained row whose sequence feeds a pending token needs that token in its
        // constraint before its mask: its sampling waits for the previous step's collect (the
        // forward pass, queued above, does not).
        // Without a step before it (nothing to collect), it cannot wait: it goes now.
        if waits && !self.submitted.is_empty() {
            self.deferred = Some(tail);
            Ok(())
        } else {
            self.finish_step(tail)
        }
    }

    /// The sampling half of a step queued by [`CudaBackend::submit_step`]: structured-output
    /// masks, raw logits for logprobs, logit edits, sampling, the copy of the sampled ids, and
    /// the step's entry in `submitted`.
    fn finish_step(&mut self, t: StepTail) -> Result<(), GpuError> {
        let vocab = self.config.vocab_size;
        let StepTail {
            step: n_step,
            arrays,
            samples,
            mut edits,
            constrained,
            seqs,
        } = t;
        // Structured output: the constrained rows' allowed sets (a grammar's mask takes tens of
        // microseconds), computed in parallel while the device runs the step.
        let allowed: Vec<Vec<Vec<u32>>> = constrained
            .par_iter()
            .map(|c| match &c.sampling.constraint {
                Some(g) if c.drafts.is_empty() => vec![g.allowed(vocab)],
                Some(g) => g.allowed_through(vocab, &c.drafts),
                None => Vec::new(),
            })
            .collect();
        let mut masks = TokenMasks::default();
        for (c, sets) in constrained.iter().zip(&allowed) {
            let st = self.states.get(&c.seq_id).ok_or_else(|| {
                GpuError::Internal(format!("no sampling state for sequence {}", c.seq_id))
            })?;
            for (i, a) in sets.iter().enumerate() {
                st.edits_at(
                    c.row + i,
                    &c.sampling,
                    Some(a),
                    c.sampled + i as u64,
                    &mut edits,
                );
                masks.push(c.row + i, a);
            }
        }
        // Raw logits rows for logprobs, before any edit (these copies wait for the step).
        let mut raw: HashMap<usize, Vec<f32>> = HashMap::new();
        for s in &seqs {
            let rows = usize::from(s.sample) + s.drafts.len();
            let (n, end) = match &s.prompt {
                Some(input) => (input.tokens.len(), s.first_row + input.tokens.len()),
                None if s.sample && s.sampling.logprobs.is_some() => (rows, s.first_row + rows),
                None => (0, s.first_row + rows),
            };
            for r in end - n..end {
                let mut v = vec![0f32; vocab];
                self.gpu
                    .download(&mut v, self.buf.logits.at(r * vocab * 4)?)?;
                raw.insert(r, v);
            }
        }
        // Final hidden states asked for (embeddings): the normalized bf16 rows the LM head
        // read, one copy of the rows from the first to the last asked for; into page-locked
        // memory with the sampled ids (read on collect), else now (the copy waits).
        let h = self.config.hidden_size;
        let hidden_rows: Vec<(usize, usize)> = seqs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.hidden_row?)))
            .collect();
        let span = hidden_rows
            .iter()
            .map(|&(_, r)| r)
            .min()
            .zip(hidden_rows.iter().map(|&(_, r)| r).max())
            .map(|(lo, hi)| (lo, (hi - lo + 1) * h));
        let mut hidden_pinned = false;
        let mut hidden_now: Vec<u16> = Vec::new();
        if let Some((lo, n)) = span {
            let src = self.buf.xs.at(lo * h * 2)?;
            let cap = self.buf.max_rows.max(1) * h;
            let pinned = self.staging.as_mut().and_then(|st| {
                Staging::hidden_buffer(&mut st.hidden[(n_step % 2) as usize], &self.gpu, n, cap)
            });
            match pinned {
                Some(dst) => {
                    // SAFETY: the buffer of this step's parity is read only in `collect` after
                    // the ids' `ready` event (recorded after this copy) completes, and
                    // rewritten only by the step two later, submitted after this one was
                    // collected (at most one step is submitted ahead).
                    unsafe { self.gpu.download_async(dst, src)? };
                    hidden_pinned = true;
                }
                None => {
                    hidden_now = vec![0u16; n];
                    self.gpu.download(&mut hidden_now, src)?;
                }
            }
        }
        let lo = span.map_or(0, |(lo, _)| lo);
        edits.apply(&self.gpu, &mut self.edit_buf, self.buf.logits.ptr(), vocab)?;
        masks.apply(&self.gpu, &mut self.mask_buf, self.buf.logits.ptr(), vocab)?;
        self.gpu.timed("sample_rows", || {
            sampling::sample(
                &self.gpu,
                self.buf.logits.ptr(),
                vocab,
                &arrays,
                &samples,
                self.buf.sampled.ptr(),
                self.argmax.as_ref(),
            )
        })?;
        if let Some(t) = &mut self.timing {
            t.end(&self.gpu.stream, n_step)?;
        }
        let ids = match &mut self.staging {
            Some(st) => {
                let pinned = st.tokens[(n_step % 2) as usize]
                    .as_mut_slice()
                    .map_err(|e| device::cuda_err("page-locked sampled ids", e))?;
                let pinned = pinned.get_mut(..samples.len()).ok_or_else(|| {
                    GpuError::Internal(format!("{} sampled rows exceed the buffers", samples.len()))
                })?;
                // SAFETY: the buffer of this step's parity is read only in `collect` after
                // `ready` completes, and rewritten only by the step two later, submitted after
                // this one was collected (at most one step is submitted ahead).
                unsafe { self.gpu.download_async(pinned, self.buf.sampled.ptr())? };
                let ready = self.gpu.event()?;
                ready
                    .record(&self.gpu.stream)
                    .map_err(|e| device::cuda_err("event record", e))?;
                SubmittedIds::Pinned(ready)
            }
            None => {
                let mut t = vec![0i32; samples.len()];
                self.gpu.download(&mut t, self.buf.sampled.ptr())?;
                SubmittedIds::Read(t)
            }
        };
        drop(edits);
        drop(masks);
        // Outputs in batch order; prompt logprobs now (their rows are here), tokens on collect.
        let mut outputs = Vec::with_capacity(seqs.len());
        let mut sampled = Vec::with_capacity(samples.len());
        self.last_samples.clear();
        for (i, s) in seqs.iter().enumerate() {
            let Some(st) = self.states.get_mut(&s.seq_id) else {
                return Err(GpuError::Internal("sequence state vanished".into()));
            };
            let mut out = SeqOutput {
                seq_id: s.seq_id,
                accepted: Vec::new(),
                token: None,
                logprob: None,
                top_logprobs: Vec::new(),
                prompt_logprobs: Vec::new(),
                hidden: s.hidden_row.and_then(|r| hidden_row(&hidden_now, lo, h, r)),
            };
            if let Some(input) = &s.prompt {
                out.prompt_logprobs = prompt_logprobs(
                    input,
                    &mut st.pending,
                    (0..input.tokens.len())
                        .map(|j| log_softmax(raw.get(&(s.first_row + j)).map_or(&[][..], |v| v))),
                );
            }
            if s.sample {
                st.pending = None;
                // The drafts' rows, then the last one.
                for j in 0..=s.drafts.len() {
                    let k = sampled.len();
                    let Some(row) = samples.get(k) else {
                        return Err(GpuError::Internal("missing sampled row".into()));
                    };
                    if s.drafts.is_empty() {
                        self.last_samples.insert(s.seq_id, k);
                    }
                    sampled.push(SampledRow {
                        output: i,
                        row: row.row as usize,
                        sampling: s.sampling.clone(),
                        draft: s.drafts.get(j).copied(),
                    });
                }
            }
            outputs.push(out);
        }
        self.submitted.push_back(Ok(Submitted {
            step: n_step,
            outputs,
            samples: sampled,
            raw,
            ids,
            hidden: hidden_pinned.then_some((lo, hidden_rows)),
        }));
        Ok(())
    }
}

/// What [`CudaBackend::finish_step`] needs of one sequence of the step.
struct SeqTail {
    seq_id: u64,
    sample: bool,
    sampling: Arc<SamplingParams>,
    /// Its first logits row.
    first_row: usize,
    /// The entry itself when it asked for prompt logprobs.
    prompt: Option<SeqInput>,
    /// The draft tokens fed after its last known token.
    drafts: Vec<u32>,
    /// Its last known token's row, when it asked for the final hidden state there.
    hidden_row: Option<usize>,
}

/// A constrained sequence's rows of a step: `drafts.len() + 1` logits rows from `row`.
struct ConstrainedRows {
    seq_id: u64,
    /// Its first sampled row.
    row: usize,
    /// Tokens it had sampled before that row.
    sampled: u64,
    sampling: Arc<SamplingParams>,
    /// The drafts fed after its last known token.
    drafts: Vec<u32>,
}

/// The sampling half of a step whose forward pass is queued (see
/// [`CudaBackend::finish_step`]).
struct StepTail {
    step: u64,
    arrays: SampleArrays,
    samples: Vec<SampleRow>,
    edits: Edits,
    /// The constrained sequences' rows.
    constrained: Vec<ConstrainedRows>,
    seqs: Vec<SeqTail>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_locked_step_buffers_grow_in_powers_of_two_within_the_device_buffer() {
        let cap = 64 << 20;
        assert_eq!(staging_len(1, cap), 64 << 10);
        assert_eq!(staging_len(64 << 10, cap), 64 << 10);
        assert_eq!(staging_len((64 << 10) + 1, cap), 128 << 10);
        assert_eq!(staging_len(240_016, cap), 256 << 10);
        assert_eq!(staging_len(cap - 1, cap), cap);
        // A device buffer below the minimum, or a step at its very size.
        assert_eq!(staging_len(10, 1000), 1000);
        assert_eq!(staging_len(1000, 1000), 1000);
    }
}
