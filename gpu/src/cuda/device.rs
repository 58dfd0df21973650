//! The CUDA device: library checks that never panic, the context and its one stream, cuBLAS,
//! the kernels of `gpu/kernels/llama.cu` and `gpu/kernels/gemv.cu` compiled by NVRTC for the
//! device's architecture and cached on disk, device memory that frees itself, raw kernel
//! launches, and the matrix products (cuBLASLt with an algorithm cached per shape, see `lt`,
//! or cublasGemmEx; or the GEMV kernels for steps of at most [`GEMV_MAX_TOKENS`] tokens of
//! models on the GEMV path: see [`GemvMode`]).
//!
//! cudarc loads libcuda, libnvrtc, libcublas and libcublasLt at run time (`dynamic-loading`), so
//! a binary built on a machine without CUDA runs on one with it; a missing library would panic
//! inside cudarc, so [`probe`] checks for each before anything touches them (libcublasLt is
//! optional: without it the products run on cublasGemmEx).

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{result as drv, sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::lt;
use sha2::{Digest, Sha256};

use super::step::MAX_SPLITS;
use crate::error::GpuError;

/// The CUDA C source of every kernel: one NVRTC unit (gemv.cu uses llama.cu's helpers).
const KERNELS: &str = concat!(
    include_str!("../../kernels/llama.cu"),
    "\n",
    include_str!("../../kernels/gemv.cu")
);

/// Most tokens (rows of the activations) that a matrix product may have to run on the GEMV
/// kernels; larger ones go to cuBLAS. Up to this size every token's result is independent of
/// the other tokens of the step (see gemv.cu), so decodes of up to 64 sequences, alone or
/// batched with small prefill chunks, give the same bits.
pub(crate) const GEMV_MAX_TOKENS: usize = 64;

/// Most tokens for the RMSNorm prologue (every block re-reads the residual rows).
pub(crate) const GEMV_NORM_MAX_TOKENS: usize = 8;

/// Warps per multiprocessor that the GEMV grids aim for (2 resident blocks of 8 warps): a
/// tile's warps split k only as far as needed to reach it, so large outputs run in about one
/// wave of long-lived blocks instead of many short ones.
const GEMV_WARPS_PER_SM: usize = 16;

/// Most warps in a GEMV block (`GEMV_WARPS` in gemv.cu).
const GEMV_BLOCK_WARPS: usize = 8;

/// k-steps per batch of weight loads in the GEMV kernels (`STEPS` in gemv.cu's `gemv_body`:
/// 4, and `GEMV_F8_STEPS` = 4 in the fp8 kernels).
const GEMV_BATCH_STEPS: usize = 4;

/// Largest hidden size for which mode `auto` runs the projections of every step of up to
/// [`GEMV_MAX_TOKENS`] tokens, and the lm_head, on the GEMV kernels (with SiLU x up in the
/// gate|up epilogue and, up to 8 tokens, RMSNorm in the QKV and gate|up prologues). Measured on
/// the H200 (gpu/CUDA_NOTES.md): at SmolLM2-135M's sizes (576) a step is launch-bound and the
/// fused GEMV path cut batch-1 decode from 1.06 to 0.85 ms (v2). Larger models keep the lm_head
/// on cuBLAS (it streams 1 GB at Llama-3-8B's size 7% faster than the GEMV kernels, v5) and
/// route by step size ([`GemvRoute`], measured at Llama-3-8B's size, CUDA_NOTES v6).
const GEMV_AUTO_MAX_HIDDEN: usize = 2048;

/// The GEMV blocks' starting batch multiplier for large models ([`Gpu::gemv_rotate`]):
/// Llama-3-8B batch-1 decode 4.467-4.471 ms against 4.523-4.524 without (one lease; 4.457
/// against 4.502 at batch 4), 4.469-4.504 against 4.507-4.538 (the final build, another
/// lease); batch 16, which does not rotate, unchanged. Per warp instead of per block ran the
/// same at batch 1; rotating the two-group kernels too cost batch 16 3-6% (CUDA_NOTES v8).
pub(crate) const GEMV_ROTATE: u32 = 7;

/// Above [`GEMV_AUTO_MAX_HIDDEN`], mode `auto` runs steps of up to this many tokens on the
/// fused GEMV path: batch-1 decode 4.59-4.64 ms on the seven H200s measured against 4.50-4.74
/// for the hybrid route (faster on six), batches 2 and 4 4.58-4.63 against 4.66-4.80.
const GEMV_LARGE_FUSED_MAX_TOKENS: usize = 4;

/// Above [`GEMV_AUTO_MAX_HIDDEN`], mode `auto` runs steps of more than
/// [`GEMV_NORM_MAX_TOKENS`] and up to this many tokens on the GEMV kernels without the norm
/// prologue (batch 16: 5.10-5.13 ms against cuBLAS's 5.29-5.34; batch 32: 7.19-7.24 against
/// 5.61-5.62, so larger steps stay on cuBLAS). Between the two, steps take the hybrid route
/// (batch 8, same leases: 4.73-4.78 against 4.77-4.82 on the fused path).
const GEMV_LARGE_MAX_TOKENS: usize = 16;

/// The launch shape of a GEMV over `tiles` tiles: blocks of `warps_per_block` warps (at most
/// 8, `GEMV_WARPS` in gemv.cu), each tile's k range split over `warps_per_tile` of them (a
/// divisor of `warps_per_block`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GemvGrid {
    pub blocks: usize,
    pub warps_per_block: usize,
    pub warps_per_tile: usize,
}

/// The launch shape of a GEMV over `tiles` tiles of `k_steps` k-steps each (32 values of k, 64
/// for fp8 weights). A function of the shape and the device alone, never of the number of
/// tokens, so the k split (and with it every output's bits) is the same for every step.
///
/// The grids considered fit one wave of resident blocks ([`GEMV_WARPS_PER_SM`] warps per
/// multiprocessor, so `16 / warps_per_block` blocks of a shape): for each number of warps per
/// tile (1 to 8), blocks of one tile where that is 3 or more, else of as many tiles as fit (8
/// warps where that is one wave). Among them the fewest batches of [`GEMV_BATCH_STEPS`] k-steps
/// per warp (the chain of dependent loads a warp waits through), and among those the most warps
/// per tile that is a power of two (the shapes before v34), else the most. Beyond one wave,
/// blocks of 8 tiles of one warp.
///
/// Measured on the H200 (CUDA_NOTES v34, against the powers of two alone, interleaved in one
/// lease): Phi-3-mini's QKV product (576 tiles, 96 k-steps) took 2 warps per tile in 144 blocks
/// of 8, two blocks on 12 multiprocessors and one on the other 120, 12 batches per warp; 3 warps
/// in 576 blocks of 3 make 8 batches: batch-1 decode 2.58 -> 2.44 ms. Llama-3-8B's (384 tiles,
/// 128 k-steps): 5 warps per tile, 7 batches instead of 8: 4.31 -> 4.25 ms. Qwen3-0.6B's
/// gate|up (384 tiles of 32 k-steps) would take 5 warps per tile for the same 2 batches as 4,
/// and ran batch 64 2.5-4% slower that way, hence the tie to the powers of two. One-tile blocks
/// from 3 warps per tile on: Llama-3-8B's QKV product ran 1.1 us faster in blocks of 4 warps
/// than of 8 with the RMSNorm prologue (v5), whose every block normalises the step's rows once;
/// below, blocks of several tiles (Phi-3-mini's gate|up with the prologue, 1,024 tiles: 29.3 us
/// in blocks of 8 warps, 32.2 in blocks of 2).
pub(crate) fn gemv_grid(tiles: usize, k_steps: usize, sm_count: usize) -> GemvGrid {
    static POW2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *POW2
        .get_or_init(|| std::env::var_os("SWITCHYARD_CUDA_GEMV_GRID").is_some_and(|v| v == "pow2"))
    {
        return gemv_grid_pow2(tiles, sm_count);
    }
    let batches =
        |warps_per_tile: usize| k_steps.div_ceil(warps_per_tile).div_ceil(GEMV_BATCH_STEPS);
    // The block shape a number of warps per tile takes, if its blocks fit one wave: one tile
    // per block from 3 warps on, else the most tiles per block that fit. Arithmetic only: this
    // runs at every launch outside the CUDA graphs.
    let fits = |warps_per_tile: usize| {
        let most_tiles = if warps_per_tile >= 3 {
            1
        } else {
            GEMV_BLOCK_WARPS / warps_per_tile
        };
        (1..=most_tiles).rev().find_map(|tiles_per_block| {
            let warps_per_block = tiles_per_block * warps_per_tile;
            let blocks = tiles.div_ceil(tiles_per_block);
            (blocks <= GEMV_WARPS_PER_SM / warps_per_block * sm_count).then_some(GemvGrid {
                blocks,
                warps_per_block,
                warps_per_tile,
            })
        })
    };
    let fewest = (1..=GEMV_BLOCK_WARPS)
        .filter_map(fits)
        .map(|g| batches(g.warps_per_tile))
        .min();
    (1..=GEMV_BLOCK_WARPS)
        .filter_map(fits)
        .filter(|g| Some(batches(g.warps_per_tile)) == fewest)
        .max_by_key(|g| (g.warps_per_tile.is_power_of_two(), g.warps_per_tile))
        .unwrap_or(GemvGrid {
            blocks: tiles.div_ceil(GEMV_BLOCK_WARPS),
            warps_per_block: GEMV_BLOCK_WARPS,
            warps_per_tile: 1,
        })
}

/// The launch shape before v34 (`SWITCHYARD_CUDA_GEMV_GRID=pow2`, for measurements): per tile
/// the most warps (1, 2, 4 or 8) that keep the grid within [`GEMV_WARPS_PER_SM`] warps per
/// multiprocessor in all; blocks of one tile where that is 4 or 8 warps, else of 8 warps.
pub(crate) fn gemv_grid_pow2(tiles: usize, sm_count: usize) -> GemvGrid {
    let budget = GEMV_WARPS_PER_SM * sm_count;
    let warps_per_tile = [8usize, 4, 2, 1]
        .into_iter()
        .find(|&w| tiles * w <= budget)
        .unwrap_or(1);
    let warps_per_block = if warps_per_tile >= 4 {
        warps_per_tile
    } else {
        8
    };
    GemvGrid {
        blocks: tiles.div_ceil(warps_per_block / warps_per_tile),
        warps_per_block,
        warps_per_tile,
    }
}

/// Where mode `auto` runs the products of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemvRoute {
    /// The GEMV kernels, fused as far as the step size allows, for the products of steps that
    /// fit them ([`Gpu::gemv_fits`]: at most [`GEMV_MAX_TOKENS`] tokens) and, at hidden sizes up
    /// to [`GEMV_AUTO_MAX_HIDDEN`], for the lm_head whenever its rows fit (so a sequence's
    /// logits do not depend on the size of the step it was sampled in).
    Gemv,
    /// QKV and the output projection on the GEMV kernels, the rest on cuBLAS.
    Hybrid,
    /// cuBLAS.
    Cublas,
}

/// [`Gpu::gemv_rotate`] for a model of hidden size `hidden`: [`GEMV_ROTATE`] where mode `auto`
/// routes steps by size (above [`GEMV_AUTO_MAX_HIDDEN`]) unless `SWITCHYARD_CUDA_GEMV_ROTATE=0`,
/// else 0.
pub(crate) fn gemv_rotation(hidden: usize) -> u32 {
    if hidden > GEMV_AUTO_MAX_HIDDEN && env_switch("SWITCHYARD_CUDA_GEMV_ROTATE", true) {
        GEMV_ROTATE
    } else {
        0
    }
}

/// Mode `auto`'s route for a step of `n` tokens of a model of hidden size `hidden`.
pub(crate) fn auto_route(hidden: usize, n: usize) -> GemvRoute {
    if hidden <= GEMV_AUTO_MAX_HIDDEN
        || n <= GEMV_LARGE_FUSED_MAX_TOKENS
        || (GEMV_NORM_MAX_TOKENS < n && n <= GEMV_LARGE_MAX_TOKENS)
    {
        GemvRoute::Gemv
    } else if n <= GEMV_NORM_MAX_TOKENS {
        GemvRoute::Hybrid
    } else {
        GemvRoute::Cublas
    }
}

/// Which path the matrix products of steps of at most [`GEMV_MAX_TOKENS`] tokens take
/// (`SWITCHYARD_CUDA_GEMV`): `auto` (the default: the GEMV kernels with both fusions for
/// hidden sizes up to [`GEMV_AUTO_MAX_HIDDEN`]; above, a route by step size, [`auto_route`],
/// with the lm_head on cuBLAS), `off` (cuBLAS always,
/// as in v1), `hybrid` (at every hidden size: for steps of at most
/// [`GEMV_NORM_MAX_TOKENS`] tokens the QKV product with the RMSNorm prologue and the output
/// projection on the GEMV kernels, the rest on cuBLAS), or, at every hidden size, `plain` (GEMV
/// kernels, no fusion), `glu` (plus SiLU x up in the gate|up epilogue) or `norm` (plus the
/// RMSNorm prologue). A benchmark and debugging switch; within the GEMV path all modes compute
/// the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemvMode {
    Off,
    Plain,
    Glu,
    Auto,
    Norm,
    Hybrid,
}

impl GemvMode {
    /// Reads `SWITCHYARD_CUDA_GEMV` (unknown values: `auto`, with a warning).
    fn from_env() -> Self {
        match std::env::var("SWITCHYARD_CUDA_GEMV").as_deref() {
            Err(_) | Ok("") | Ok("auto") => GemvMode::Auto,
            Ok("off") => GemvMode::Off,
            Ok("plain") => GemvMode::Plain,
            Ok("glu") => GemvMode::Glu,
            Ok("norm") => GemvMode::Norm,
            Ok("hybrid") => GemvMode::Hybrid,
            Ok(other) => {
                tracing::warn!(
                    value = other,
                    "SWITCHYARD_CUDA_GEMV is off, plain, glu, auto, norm or hybrid; using auto"
                );
                GemvMode::Auto
            }
        }
    }
}

/// One matrix product `C[n, m] = A[n, k] · W[m, k]^T + beta · C`, row-major: W (the weights)
/// and A (the activations) bf16, or both e4m3 with a scale per row (`fp8`), C f32 or bf16
/// (`c_f32`), accumulation in f32. The pointers are device addresses of buffers of these shapes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Product {
    pub w: u64,
    pub a: u64,
    pub c: u64,
    /// Rows of W (output features).
    pub m: usize,
    /// Rows of A (tokens).
    pub n: usize,
    /// The inner size.
    pub k: usize,
    pub beta: f32,
    pub c_f32: bool,
    /// W and A hold e4m3 values scaled by these (runs on cuBLASLt only).
    pub fp8: Option<Fp8Scales>,
}

/// Device addresses of the f32 scales of an fp8 product's operands: with [`Fp8Scaling::Row`]
/// `w` has one per row of W (`m`) and `a` one per row of A (`n`), the product being
/// `(diag(a) A) (diag(w) W)^T`; with [`Fp8Scaling::Tensor`] each holds one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fp8Scales {
    pub w: u64,
    pub a: u64,
    pub scaling: Fp8Scaling,
}

/// How fp8 values are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Scaling {
    /// A scale per row (weights per output channel, activations per token): cuBLASLt's
    /// outer-vector scaling (cuBLAS 12.9 and later on Hopper).
    Row,
    /// One scale per tensor (activations: per step).
    Tensor,
}

/// fp8 products to check with cuBLASLt's heuristic: (m, k, f32 output, accumulate) of each,
/// and the step sizes (n) to check them at.
pub(crate) type Fp8Shapes = (Vec<(usize, usize, bool, bool)>, Vec<usize>);

/// Most blocks of `fp8_amax` (the partial maxima `fp8_quant_tensor` reduces).
pub(crate) const FP8_MAX_PARTS: usize = 264;

/// The activations of a GEMV launch.
#[derive(Clone, Copy, Debug)]
pub(crate) enum GemvInput {
    /// bf16 rows `[n, k]`.
    Bf16(u64),
    /// The f32 residual rows `[n, k]`, RMS-normalised with `weight` (f32, k) in the prologue.
    Norm { x: u64, weight: u64, eps: f32 },
}

/// What a GEMV launch writes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum GemvOutput {
    /// `C[n, m] = A · W^T + beta C`, f32 or bf16.
    Plain { beta: f32, f32_out: bool },
    /// `W` holds gate rows then up rows (`2m` rows); `act[n, m] = silu(gate) * up`, bf16.
    Glu,
    /// `W` is a fused QKV weight with its Q and K rows in RoPE pair order (`rope_row_order` in
    /// weights.rs): the epilogue rotates Q and K and writes Q and the cache, as
    /// `rope_store_kv` would from the f32 product; the output address is not written.
    Rope(RopeOut),
}

/// A step's LoRA updates of one product, added by the GEMV kernels' epilogue to each sum before
/// its output stage (`LoraUpdate` in the kernels; `u` written by `lora_shrink` first).
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemvLora {
    /// f32 `u`, `u_stride` per token, target `i` of the product at `i * u_part`.
    pub u: u64,
    pub u_stride: usize,
    pub u_part: usize,
    /// `i32` per token: its adapter slot, or -1.
    pub row_slot: u64,
    /// The adapters' `(slot, layer, target, A|B)` address table and `i32` ranks per slot.
    pub ptrs: u64,
    pub ranks: u64,
    pub layers: usize,
    pub layer: usize,
    /// Up to three targets (`LoraTarget as i32`, -1: none) with the widths of their columns,
    /// side by side from column 0 (for [`GemvOutput::Glu`], gate row `r` is column `r` and up
    /// row `r` column `m + r`).
    pub parts: [(i32, usize); 3],
}

/// Where [`GemvOutput::Rope`] writes, and what it rotates with (all null and zero for the
/// other outputs, whose kernels ignore it).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RopeOut {
    /// Q, bf16 `[n, heads, head_dim]`.
    pub q: u64,
    /// The layer's key and value cache, bf16 `[slots, kv_heads, head_dim]`.
    pub k_cache: u64,
    pub v_cache: u64,
    /// Each token's position (`i32`) and cache slot (`i64`, < 0: none).
    pub pos: u64,
    pub slots: u64,
    /// The rotation frequencies (`f32`, head_dim / 2), then each pair's amplitude (head_dim
    /// / 2: `LlamaConfig::rope_amplitudes`).
    pub inv_freq: u64,
    /// (heads, kv heads, head dim).
    pub heads: (usize, usize, usize),
    /// Pairs (2j, 2j + 1) rather than (j, j + head_dim / 2).
    pub interleaved: bool,
    /// The Q, K and V biases (f32, one QKV row, Q and K rows in the stored order), 0 for none:
    /// only `rope_store_kv` adds them (the forward pass keeps biased layers off the GEMV
    /// epilogue).
    pub bias: u64,
}

/// Wraps any CUDA-side error.
pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::Cuda(format!("{what}: {e:?}"))
}

/// What [`probe`] found.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// The GPU's name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
}

/// Whether a CUDA GPU and the libraries the backend needs (driver, NVRTC, cuBLAS) are present;
/// never panics. Returns why not as the error.
pub fn probe() -> Result<DeviceInfo, GpuError> {
    // SAFETY: each check only tries to open the shared library with libloading.
    let (cuda, nvrtc, cublas) = unsafe {
        (
            sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            blas_sys::is_culib_present(),
        )
    };
    let missing: Vec<&str> = [
        (cuda, "libcuda (the NVIDIA driver)"),
        (nvrtc, "libnvrtc"),
        (cublas, "libcublas"),
    ]
    .iter()
    .filter(|(present, _)| !present)
    .map(|(_, n)| *n)
    .collect();
    if !missing.is_empty() {
        return Err(GpuError::Cuda(format!("not found: {}", missing.join(", "))));
    }
    let count = CudaContext::device_count().map_err(|e| cuda_err("cuDeviceGetCount", e))?;
    if count < 1 {
        return Err(GpuError::Cuda("no CUDA device".into()));
    }
    let ctx = CudaContext::new(0).map_err(|e| cuda_err("creating a context", e))?;
    Ok(DeviceInfo {
        name: ctx.name().map_err(|e| cuda_err("device name", e))?,
        compute_capability: ctx
            .compute_capability()
            .map_err(|e| cuda_err("compute capability", e))?,
        total_memory: ctx.total_mem().map_err(|e| cuda_err("total memory", e))?,
    })
}

/// Device memory that frees itself.
pub(crate) struct DevMem {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevMem {
    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The address `offset` bytes in (checked against the size).
    pub(crate) fn at(&self, offset: usize) -> Result<u64, GpuError> {
        if offset > self.bytes {
            return Err(GpuError::Internal(format!(
                "offset {offset} past a {}-byte buffer",
                self.bytes
            )));
        }
        Ok(self.ptr + offset as u64)
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        if self.ptr != 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
            let _ = unsafe { drv::free_sync(self.ptr) };
        }
    }
}

/// One kernel argument.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Arg {
    /// A device address (or 0 for null).
    Ptr(u64),
    /// A 32-bit integer.
    I32(i32),
    /// A 64-bit unsigned integer.
    U64(u64),
    /// A float.
    F32(f32),
}

/// The head dimensions the attention kernels are built for (`Kernels::attention_w1` and the
/// others hold one kernel per entry, in this order).
pub(crate) const ATTENTION_HEAD_DIMS: [usize; 3] = [64, 96, 128];

/// The index of `head_dim` in [`ATTENTION_HEAD_DIMS`], if the kernels run it.
pub(crate) fn attention_kernel_index(head_dim: usize) -> Option<usize> {
    ATTENTION_HEAD_DIMS.iter().position(|&d| d == head_dim)
}

/// The kernels, by name.
pub(crate) struct Kernels {
    pub init_uniform_bf16: CudaFunction,
    pub fill_f32: CudaFunction,
    /// Block copies between the KV cache and the host tier (`host_tier.rs`).
    pub kv_tier_copy: CudaFunction,
    pub fp8_quant_rows: CudaFunction,
    pub fp8_amax: CudaFunction,
    pub fp8_quant_tensor: CudaFunction,
    pub embed: CudaFunction,
    pub rms_norm: CudaFunction,
    pub rope_store_kv: CudaFunction,
    /// `rope_store_kv` into an fp8 cache (`kv_cache_dtype: fp8`).
    pub rope_store_kv_f8: CudaFunction,
    /// Qwen3's query and key head norms.
    pub qk_norm: CudaFunction,
    pub silu_mul: CudaFunction,
    pub lora_shrink: CudaFunction,
    pub lora_expand: CudaFunction,
    pub lora_silu_mul: CudaFunction,
    /// Paged attention in one-warp blocks (tiles of at most 16 rows), one kernel per head
    /// dimension of [`ATTENTION_HEAD_DIMS`].
    pub attention_w1: [CudaFunction; 3],
    /// Paged attention in four-warp blocks (larger tiles).
    pub attention_w4: [CudaFunction; 3],
    /// The same over an fp8 cache.
    pub attention_w1_f8: [CudaFunction; 3],
    pub attention_w4_f8: [CudaFunction; 3],
    pub attention_combine: CudaFunction,
    pub apply_logit_edits: CudaFunction,
    pub apply_token_masks: CudaFunction,
    pub sample_rows: CudaFunction,
    pub argmax_split: CudaFunction,
    pub sample_partials: CudaFunction,
    /// The GEMV kernels over bf16 weights.
    pub gemv: GemvKernels,
    /// The same over e4m3 weights with their scales.
    pub gemv_f8: GemvKernels,
    /// The bf16 ones of one token group with LoRA updates in the epilogue.
    pub gemv_lora: GemvLoraKernels,
    _module: Arc<CudaModule>,
}

/// One weight type's GEMV kernels (gpu/kernels/gemv.cu).
pub(crate) struct GemvKernels {
    /// By token groups of 8: at most 8, 16, 32 and 64 tokens.
    pub plain: [CudaFunction; 4],
    pub glu: [CudaFunction; 4],
    pub norm: CudaFunction,
    pub norm_glu: CudaFunction,
    /// The QKV product with RoPE and the KV store in its epilogue (token groups of 8 as
    /// `plain`), and with the RMSNorm prologue.
    pub rope: [CudaFunction; 4],
    pub norm_rope: CudaFunction,
}

impl GemvKernels {
    /// The kernels whose names end in `suffix` (`""` or `"_f8"`) before the group size.
    fn load(
        f: &impl Fn(&str) -> Result<CudaFunction, GpuError>,
        suffix: &str,
    ) -> Result<Self, GpuError> {
        let groups = |name: &str| -> Result<[CudaFunction; 4], GpuError> {
            Ok([
                f(&format!("{name}{suffix}_1"))?,
                f(&format!("{name}{suffix}_2"))?,
                f(&format!("{name}{suffix}_4"))?,
                f(&format!("{name}{suffix}_8"))?,
            ])
        };
        Ok(GemvKernels {
            plain: groups("gemv")?,
            glu: groups("gemv_glu")?,
            norm: f(&format!("gemv_norm{suffix}_1"))?,
            norm_glu: f(&format!("gemv_norm_glu{suffix}_1"))?,
            rope: groups("gemv_rope")?,
            norm_rope: f(&format!("gemv_norm_rope{suffix}_1"))?,
        })
    }
}

/// The GEMV kernels that add LoRA updates in their epilogue (`*_lora` in gpu/kernels/gemv.cu):
/// bf16 weights, steps of at most [`GEMV_LORA_MAX_TOKENS`] tokens.
pub(crate) struct GemvLoraKernels {
    pub plain: CudaFunction,
    pub glu: CudaFunction,
    pub rope: CudaFunction,
    pub norm: CudaFunction,
    pub norm_glu: CudaFunction,
    pub norm_rope: CudaFunction,
}

/// The most tokens of a step whose adapted products add their LoRA updates in the GEMV
/// epilogue (one token group); larger steps add them after the product (`lora_expand`), which
/// spreads the work over more blocks.
pub(crate) const GEMV_LORA_MAX_TOKENS: usize = 8;

/// Time per kernel class, measured with CUDA events around each launch (each one waited for,
/// like `CUDA_LAUNCH_BLOCKING=1`): a breakdown of where a step's time goes, not a speed.
#[derive(Default)]
pub(crate) struct Profile {
    /// Milliseconds and launches by kernel class.
    pub totals: std::collections::BTreeMap<&'static str, (f64, u64)>,
}

/// The context, its stream, cuBLAS and the kernels.
pub(crate) struct Gpu {
    /// Per-kernel timing, when `SWITCHYARD_CUDA_PROFILE` is set.
    pub prof: Option<std::cell::RefCell<Profile>>,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub k: Kernels,
    pub info: DeviceInfo,
    /// Which path the matrix products of small steps take.
    pub gemv_mode: GemvMode,
    /// Multiprocessors of the device.
    pub sm_count: usize,
    /// Decode steps' attention asks for its first keys before waiting on the QKV product
    /// (`Launch::early_kv`); `SWITCHYARD_CUDA_EARLY_KV=0` turns it off.
    pub early_kv: bool,
    /// Most splits of an attention grid's key range (`SWITCHYARD_CUDA_ATT_SPLITS`, 1 to
    /// [`MAX_SPLITS`], default [`MAX_SPLITS`]): an experiment switch for small steps, where
    /// the split count decides between parallel blocks plus a combine launch and fewer,
    /// longer blocks.
    pub att_max_splits: usize,
    /// Attention grids with the KV heads as the fastest index (`SWITCHYARD_CUDA_ATT_HEADS_INNER=1`,
    /// an experiment): blocks that run together then read all heads of the same cache slots,
    /// which lie side by side in the [slots, kv_heads, head_dim] cache.
    pub att_heads_inner: bool,
    /// Launch kernels with programmatic dependent launch (sm_90 and newer, unless
    /// `SWITCHYARD_CUDA_PDL=0`): a kernel may start while the previous one finishes; every
    /// kernel waits for its predecessor (`pdl_wait` in the CUDA source) before touching data,
    /// so only independent work (the GEMV kernels' weight prefetch) overlaps.
    pub pdl: bool,
    /// Where the blocks of the one-group GEMV kernels (steps of at most 8 tokens) start along
    /// k: 0 from the start, else each block at batch (block index x this) of its range, so the
    /// blocks running together read different parts of their rows. [`GEMV_ROTATE`] for models
    /// of hidden size above [`GEMV_AUTO_MAX_HIDDEN`] (set by the backend; 0 with
    /// `SWITCHYARD_CUDA_GEMV_ROTATE=0`), where mode `auto` routes steps by size anyway, so
    /// sums in a different order for steps of 1-8 and 9-64 tokens cost no batch invariance
    /// the engine had; 0 for smaller models, whose steps of up to 64 tokens all stay on the
    /// GEMV kernels and decode to the same bits whatever the batch.
    pub gemv_rotate: u32,
    /// Whether QKV products on the GEMV kernels apply RoPE and store K and V in their epilogue
    /// (unless `SWITCHYARD_CUDA_ROPE_EPILOGUE=0`: then the f32 product and `rope_store_kv`).
    pub rope_epilogue: bool,
    /// cuBLASLt with its per-shape plan cache (`None` without libcublasLt).
    lt: Option<lt::Lt>,
    /// Whether [`Gpu::gemm_cublas`] takes cuBLASLt (unless `SWITCHYARD_CUDA_BLASLT=0`).
    blaslt: bool,
    /// cuBLAS and cuBLASLt workspace (set explicitly so that GEMMs can be captured in CUDA
    /// graphs; shared, as both enqueue on the one stream). Dropped after both handles.
    _workspace: DevMem,
}

/// Bytes of cuBLAS workspace (Hopper wants 32 MiB for its best kernels).
const CUBLAS_WORKSPACE: usize = 32 << 20;

impl Gpu {
    /// Opens device `ordinal` (after [`probe`] succeeded) and compiles or loads the kernels.
    pub fn open(ordinal: usize) -> Result<Self, GpuError> {
        let info = probe()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("creating a context", e))?;
        // One stream, ordered by us: cudarc's per-buffer event tracking is not needed.
        // SAFETY: every launch and copy of this backend goes to `stream`, in order.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating a stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_err("cublasCreate", e))?;
        let workspace = alloc(&ctx, CUBLAS_WORKSPACE)?;
        // SAFETY: the workspace outlives the handle (both are fields of `Gpu`; the handle is
        // destroyed first because fields drop in declaration order).
        unsafe {
            blas_sys::cublasSetWorkspace_v2(
                *blas.handle(),
                workspace.ptr() as *mut c_void,
                CUBLAS_WORKSPACE,
            )
            .result()
            .map_err(|e| cuda_err("cublasSetWorkspace", e))?;
        }
        let lt = lt::Lt::new(workspace.ptr(), CUBLAS_WORKSPACE);
        let blaslt = env_switch("SWITCHYARD_CUDA_BLASLT", true);
        let defines = match std::env::var("SWITCHYARD_CUDA_DEFINES") {
            Ok(v) => parse_defines(&v)
                .map_err(|e| GpuError::InvalidConfig(format!("SWITCHYARD_CUDA_DEFINES: {e}")))?,
            Err(_) => Vec::new(),
        };
        if !defines.is_empty() {
            tracing::warn!(
                ?defines,
                "kernels compiled with extra definitions (an experiment)"
            );
        }
        let module = load_kernels(&ctx, info.compute_capability, &defines)?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| cuda_err(&format!("kernel {name}"), e))
        };
        let k = Kernels {
            init_uniform_bf16: f("init_uniform_bf16")?,
            fill_f32: f("fill_f32")?,
            kv_tier_copy: f("kv_tier_copy")?,
            fp8_quant_rows: f("fp8_quant_rows")?,
            fp8_amax: f("fp8_amax")?,
            fp8_quant_tensor: f("fp8_quant_tensor")?,
            embed: f("embed")?,
            rms_norm: f("rms_norm")?,
            rope_store_kv: f("rope_store_kv")?,
            rope_store_kv_f8: f("rope_store_kv_f8")?,
            qk_norm: f("qk_norm")?,
            silu_mul: f("silu_mul")?,
            lora_shrink: f("lora_shrink")?,
            lora_expand: f("lora_expand")?,
            lora_silu_mul: f("lora_silu_mul")?,
            attention_w1: [
                f("attention_w1_64")?,
                f("attention_w1_96")?,
                f("attention_w1_128")?,
            ],
            attention_w4: [
                f("attention_w4_64")?,
                f("attention_w4_96")?,
                f("attention_w4_128")?,
            ],
            attention_w1_f8: [
                f("attention_w1_64_f8")?,
                f("attention_w1_96_f8")?,
                f("attention_w1_128_f8")?,
            ],
            attention_w4_f8: [
                f("attention_w4_64_f8")?,
                f("attention_w4_96_f8")?,
                f("attention_w4_128_f8")?,
            ],
            attention_combine: f("attention_combine")?,
            apply_logit_edits: f("apply_logit_edits")?,
            apply_token_masks: f("apply_token_masks")?,
            sample_rows: f("sample_rows")?,
            argmax_split: f("argmax_split")?,
            sample_partials: f("sample_partials")?,
            gemv: GemvKernels::load(&f, "")?,
            gemv_f8: GemvKernels::load(&f, "_f8")?,
            gemv_lora: GemvLoraKernels {
                plain: f("gemv_lora")?,
                glu: f("gemv_glu_lora")?,
                rope: f("gemv_rope_lora")?,
                norm: f("gemv_norm_lora")?,
                norm_glu: f("gemv_norm_glu_lora")?,
                norm_rope: f("gemv_norm_rope_lora")?,
            },
            _module: module,
        };
        let gemv_mode = GemvMode::from_env();
        let pdl = info.compute_capability.0 >= 9 && env_switch("SWITCHYARD_CUDA_PDL", true);
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| cuda_err("multiprocessor count", e))?
            .max(1) as usize;
        let rope_epilogue = env_switch("SWITCHYARD_CUDA_ROPE_EPILOGUE", true);
        let early_kv = env_switch("SWITCHYARD_CUDA_EARLY_KV", true);
        let att_heads_inner = env_switch("SWITCHYARD_CUDA_ATT_HEADS_INNER", false);
        let att_max_splits = match std::env::var("SWITCHYARD_CUDA_ATT_SPLITS") {
            Err(_) => MAX_SPLITS,
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=MAX_SPLITS).contains(n))
                .ok_or_else(|| {
                    GpuError::InvalidConfig(format!(
                        "SWITCHYARD_CUDA_ATT_SPLITS={v}: expected 1 to {MAX_SPLITS}"
                    ))
                })?,
        };
        tracing::info!(
            pdl,
            rope_epilogue,
            early_kv,
            att_max_splits,
            att_heads_inner,
            gemv = ?gemv_mode,
            sm_count,
            gemm = if blaslt && lt.is_some() { "cublasLt" } else { "cublasGemmEx" },
            "CUDA launch settings"
        );

        let prof = std::env::var_os("SWITCHYARD_CUDA_PROFILE")
            .map(|_| std::cell::RefCell::new(Profile::default()));
        Ok(Gpu {
            prof,
            ctx,
            stream,
            blas,
            k,
            info,
            gemv_mode,
            sm_count,
            early_kv,
            att_max_splits,
            att_heads_inner,
            pdl,
            rope_epilogue,
            gemv_rotate: 0,
            lt,
            blaslt,
            _workspace: workspace,
        })
    }

    /// Runs `f` (which enqueues work); with profiling on, times it with events and waits.
    pub fn timed(
        &self,
        name: &'static str,
        f: impl FnOnce() -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        let Some(prof) = &self.prof else {
            return f();
        };
        let ev = || {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda_err("event", e))
        };
        let (start, end) = (ev()?, ev()?);
        start
            .record(&self.stream)
            .map_err(|e| cuda_err("event record", e))?;
        f()?;
        end.record(&self.stream)
            .map_err(|e| cuda_err("event record", e))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| cuda_err("event time", e))?;
        let mut p = prof.borrow_mut();
        let e = p.totals.entry(name).or_insert((0.0, 0));
        e.0 += f64::from(ms);
        e.1 += 1;
        Ok(())
    }

    /// The profile as text lines, largest first.
    pub fn profile_report(&self) -> Option<String> {
        let p = self.prof.as_ref()?.borrow();
        let total: f64 = p.totals.values().map(|v| v.0).sum();
        let mut rows: Vec<_> = p.totals.iter().collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let mut out = format!("CUDA kernel time by class (total {total:.1} ms):\n");
        for (name, (ms, n)) in rows {
            out.push_str(&format!(
                "  {name:<22} {ms:>10.2} ms {:>5.1}% {n:>8} launches {:>9.1} us each\n",
                100.0 * ms / total.max(1e-9),
                1000.0 * ms / (*n).max(1) as f64
            ));
        }
        Some(out)
    }

    /// Makes the context current on the calling thread (the backend may move between threads).
    pub fn bind(&self) -> Result<(), GpuError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))
    }

    /// Allocates `bytes` of device memory.
    pub fn alloc(&self, bytes: usize) -> Result<DevMem, GpuError> {
        alloc(&self.ctx, bytes)
    }

    /// Free and total device memory.
    pub fn mem_info(&self) -> Result<(usize, usize), GpuError> {
        self.ctx
            .mem_get_info()
            .map_err(|e| cuda_err("cuMemGetInfo", e))
    }

    /// Launches `f` on the stream (with programmatic dependent launch when [`Self::pdl`]).
    pub fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        self.launch_on(&self.stream, self.pdl, f, grid, block, args)
    }

    /// Launches `f` on `stream` (one of this context's), with programmatic dependent launch
    /// when `pdl` (which only [`Self::pdl`] allows: every kernel waits for its predecessor).
    pub fn launch_on(
        &self,
        stream: &CudaStream,
        pdl: bool,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let mut vals: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut b = [0u8; 8];
                match *a {
                    Arg::Ptr(p) | Arg::U64(p) => b.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::F32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                }
                b
            })
            .collect();
        let mut params: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v.as_mut_ptr() as *mut c_void)
            .collect();
        if pdl && self.pdl {
            // SAFETY: a zeroed attribute is valid plain data; id and value are set below.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: 0,
                hStream: stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as below; `config` and `attr` outlive the call, and every kernel of
            // this backend waits for its predecessor before touching memory (see `pdl`).
            return unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    f.cu_function(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
            .map_err(|e| cuda_err("kernel launch (programmatic dependent launch)", e));
        }
        // SAFETY: the argument list matches the kernel's signature (each call site passes the
        // parameters of the kernel it names); every pointer is a live device allocation.
        unsafe {
            drv::launch_kernel(
                f.cu_function(),
                grid,
                (block, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| cuda_err("kernel launch", e))
    }

    /// Copies `src` to device address `dst` (asynchronous on the stream; `src` must stay alive
    /// and unchanged until the stream is synchronised).
    pub fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> Result<(), GpuError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller sized `dst` for `src`.
        unsafe { drv::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| cuda_err("copy to the device", e))
    }

    /// Copies from device address `src` into `dst` and waits for it.
    pub fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), GpuError> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` holds at least `dst.len()` values of `T`.
        unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| cuda_err("copy from the device", e))?;
        self.sync()
    }

    /// Enqueues a copy from device address `src` into `dst` without waiting for it.
    ///
    /// # Safety
    /// `dst` must be page-locked memory that stays alive and is neither read nor written
    /// until the stream has passed the copy (an event recorded after it has completed).
    pub unsafe fn download_async<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), GpuError> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` holds at least `dst.len()` values of `T`; the caller keeps `dst`.
        unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| cuda_err("copy from the device", e))
    }

    /// An event without timing, for waiting on a point of the stream.
    pub fn event(&self) -> Result<cudarc::driver::CudaEvent, GpuError> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| cuda_err("event", e))
    }

    /// Waits for the stream.
    pub fn sync(&self) -> Result<(), GpuError> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("stream synchronise", e))
    }

    /// Whether a product with `n` activation rows and inner size `k` over the device addresses
    /// `ptrs` (weights, activations) runs on the GEMV kernels: GEMV on, 1 <= n <= 64, k a
    /// multiple of 8 (16-byte pieces) within i32, every address 16-byte aligned.
    pub fn gemv_fits(&self, n: usize, k: usize, ptrs: &[u64]) -> bool {
        self.gemv_mode != GemvMode::Off
            && (1..=GEMV_MAX_TOKENS).contains(&n)
            && k.is_multiple_of(8)
            && k > 0
            && k <= i32::MAX as usize
            && ptrs.iter().all(|p| p % 16 == 0)
    }

    /// Whether the gate|up product of small steps writes SiLU x up itself.
    pub fn gemv_fuse_glu(&self) -> bool {
        matches!(
            self.gemv_mode,
            GemvMode::Glu | GemvMode::Auto | GemvMode::Norm
        )
    }

    /// Whether a step of `n` tokens (at most [`GEMV_MAX_TOKENS`]) of a model of hidden size
    /// `hidden` runs its projections on the GEMV kernels (see [`GemvMode`]).
    pub fn gemv_for(&self, hidden: usize, n: usize) -> bool {
        match self.gemv_mode {
            GemvMode::Off | GemvMode::Hybrid => false,
            GemvMode::Auto => auto_route(hidden, n) == GemvRoute::Gemv,
            GemvMode::Plain | GemvMode::Glu | GemvMode::Norm => true,
        }
    }

    /// Whether a step on the GEMV path ([`Gpu::gemv_for`]) runs the lm_head on the GEMV
    /// kernels too (in mode `auto` only for hidden sizes up to [`GEMV_AUTO_MAX_HIDDEN`]).
    pub fn gemv_lm_head(&self, hidden: usize) -> bool {
        self.gemv_mode != GemvMode::Auto || hidden <= GEMV_AUTO_MAX_HIDDEN
    }

    /// Whether a step of `n` tokens of a model of hidden size `hidden` takes the hybrid route:
    /// QKV (with the RMSNorm prologue) and the output projection on the GEMV kernels, gate|up,
    /// down and the lm_head on cuBLAS (see [`GemvMode`]).
    pub fn gemv_hybrid(&self, hidden: usize, n: usize) -> bool {
        match self.gemv_mode {
            GemvMode::Hybrid => n <= GEMV_NORM_MAX_TOKENS,
            GemvMode::Auto => auto_route(hidden, n) == GemvRoute::Hybrid,
            _ => false,
        }
    }

    /// Whether the QKV and gate|up products of a step of `n` tokens on the GEMV path normalise
    /// the residual themselves.
    pub fn gemv_fuse_norm(&self, n: usize) -> bool {
        n <= GEMV_NORM_MAX_TOKENS && matches!(self.gemv_mode, GemvMode::Auto | GemvMode::Norm)
    }

    /// `rope_store_kv` over the f32 QKV product `qkv` of `tokens` tokens (Q and K rows in RoPE
    /// pair order): rotates Q and K and writes Q and the cache where `out` says; with the fp8
    /// cache's key and value `scales`, `rope_store_kv_f8` quantizes each stored vector.
    pub(crate) fn rope_store(
        &self,
        qkv: u64,
        tokens: usize,
        out: &RopeOut,
        scales: Option<(u64, u64)>,
    ) -> Result<(), GpuError> {
        let (nh, nkv, hd) = out.heads;
        let mut args = vec![
            Arg::Ptr(qkv),
            Arg::Ptr(out.bias),
            Arg::Ptr(out.q),
            Arg::Ptr(out.k_cache),
            Arg::Ptr(out.v_cache),
        ];
        let kernel = match scales {
            Some((ks, vs)) => {
                args.extend([Arg::Ptr(ks), Arg::Ptr(vs)]);
                &self.k.rope_store_kv_f8
            }
            None => &self.k.rope_store_kv,
        };
        args.extend([
            Arg::Ptr(out.pos),
            Arg::Ptr(out.slots),
            Arg::Ptr(out.inv_freq),
            Arg::I32(nh as i32),
            Arg::I32(nkv as i32),
            Arg::I32(hd as i32),
            Arg::I32(out.interleaved as i32),
        ]);
        self.launch(kernel, (tokens as u32, 1, 1), 256, &args)
    }

    /// `qk_norm` over the f32 QKV product `qkv` of `tokens` tokens: each Q and K head of
    /// `heads` (nh, nkv, hd) RMS-normalised in place with its weight from `w` (the query
    /// weights, then the key weights, in the rows' stored order).
    pub(crate) fn qk_norm(
        &self,
        qkv: u64,
        tokens: usize,
        w: u64,
        (nh, nkv, hd): (usize, usize, usize),
        eps: f32,
    ) -> Result<(), GpuError> {
        self.launch(
            &self.k.qk_norm,
            (tokens as u32, 1, 1),
            256,
            &[
                Arg::Ptr(qkv),
                Arg::Ptr(w),
                Arg::I32(nh as i32),
                Arg::I32(nkv as i32),
                Arg::I32(hd as i32),
                Arg::F32(eps),
            ],
        )
    }

    /// The GEMV kernels (`gpu/kernels/gemv.cu`): `W` bf16 `[m, k]` (`[2m, k]` for
    /// [`GemvOutput::Glu`]), or e4m3 with `fp8`'s weight scales (its activation scales are not
    /// used: the activations stay bf16; k a multiple of 16), times `n` rows of activations,
    /// f32 accumulation. The caller checks [`Gpu::gemv_fits`] with the input's addresses. With
    /// `lora`, the epilogue adds those updates first (bf16 weights, at most
    /// [`GEMV_LORA_MAX_TOKENS`] tokens, and f32, [`GemvOutput::Glu`] or [`GemvOutput::Rope`]
    /// outputs only).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        (w, fp8): (u64, Option<Fp8Scales>),
        input: GemvInput,
        out: u64,
        m: usize,
        n: usize,
        k: usize,
        output: GemvOutput,
        lora: Option<&GemvLora>,
    ) -> Result<(), GpuError> {
        if m == 0 {
            return Ok(());
        }
        let addrs = match input {
            GemvInput::Bf16(a) => [w, a, 0],
            GemvInput::Norm { x, weight, .. } => [w, x, weight],
        };
        if !self.gemv_fits(n, k, &addrs) || (fp8.is_some() && !k.is_multiple_of(16)) {
            return Err(GpuError::Internal(format!(
                "GEMV of {n} x {k} does not fit the kernels (mode {:?})",
                self.gemv_mode
            )));
        }
        if lora.is_some()
            && (fp8.is_some()
                || n > GEMV_LORA_MAX_TOKENS
                || matches!(output, GemvOutput::Plain { f32_out: false, .. }))
        {
            return Err(GpuError::Internal(format!(
                "LoRA updates in a GEMV epilogue need bf16 weights, at most \
                 {GEMV_LORA_MAX_TOKENS} tokens and an f32, GLU or RoPE output ({n} tokens)"
            )));
        }
        let rows_per_tile = match output {
            GemvOutput::Plain { .. } | GemvOutput::Rope(_) => 16,
            GemvOutput::Glu => 8,
        };
        if let GemvOutput::Rope(r) = output {
            let (nh, nkv, hd) = r.heads;
            if r.bias != 0 {
                return Err(GpuError::Internal(
                    "the RoPE epilogue adds no biases: biased layers go through rope_store_kv"
                        .into(),
                ));
            }
            if hd % 16 != 0 || m != (nh + 2 * nkv) * hd {
                return Err(GpuError::Internal(format!(
                    "the RoPE epilogue needs a QKV product of (heads + 2 kv heads) x head_dim \
                     rows with head_dim a multiple of 16, not {m} rows for {nh}/{nkv} x {hd}"
                )));
            }
        }
        let tiles = m.div_ceil(rows_per_tile);
        if m > i32::MAX as usize / 2 {
            return Err(GpuError::Internal(format!("GEMV with {m} rows")));
        }
        // k-steps of 32 values of k (bf16 weights) or 64 (e4m3: 16 per 16-byte load).
        let k_steps = k.div_ceil(if fp8.is_some() { 64 } else { 32 });
        let grid = gemv_grid(tiles, k_steps, self.sm_count);
        let group = match n {
            0..=8 => 0,
            9..=16 => 1,
            17..=32 => 2,
            _ => 3,
        };
        let norm_input = matches!(input, GemvInput::Norm { .. });
        if norm_input && n > GEMV_NORM_MAX_TOKENS {
            return Err(GpuError::Internal(format!(
                "the GEMV norm prologue takes at most {GEMV_NORM_MAX_TOKENS} tokens, not {n}"
            )));
        }
        let kernels = if fp8.is_some() {
            &self.k.gemv_f8
        } else {
            &self.k.gemv
        };
        let (ws, ws_stride) = match fp8 {
            Some(s) => (s.w, i32::from(s.scaling == Fp8Scaling::Row)),
            None => (0, 0),
        };
        let (mut f, x, xf, nw, eps) = match (input, output) {
            (GemvInput::Bf16(a), GemvOutput::Plain { .. }) => (&kernels.plain[group], a, 0, 0, 0.0),
            (GemvInput::Bf16(a), GemvOutput::Glu) => (&kernels.glu[group], a, 0, 0, 0.0),
            (GemvInput::Norm { x, weight, eps }, GemvOutput::Plain { .. }) => {
                (&kernels.norm, 0, x, weight, eps)
            }
            (GemvInput::Norm { x, weight, eps }, GemvOutput::Glu) => {
                (&kernels.norm_glu, 0, x, weight, eps)
            }
            (GemvInput::Bf16(a), GemvOutput::Rope(_)) => (&kernels.rope[group], a, 0, 0, 0.0),
            (GemvInput::Norm { x, weight, eps }, GemvOutput::Rope(_)) => {
                (&kernels.norm_rope, 0, x, weight, eps)
            }
        };
        if lora.is_some() {
            let l = &self.k.gemv_lora;
            f = match (input, output) {
                (GemvInput::Bf16(_), GemvOutput::Plain { .. }) => &l.plain,
                (GemvInput::Bf16(_), GemvOutput::Glu) => &l.glu,
                (GemvInput::Bf16(_), GemvOutput::Rope(_)) => &l.rope,
                (GemvInput::Norm { .. }, GemvOutput::Plain { .. }) => &l.norm,
                (GemvInput::Norm { .. }, GemvOutput::Glu) => &l.norm_glu,
                (GemvInput::Norm { .. }, GemvOutput::Rope(_)) => &l.norm_rope,
            };
        }
        let (beta, f32_out) = match output {
            GemvOutput::Plain { beta, f32_out } => (beta, f32_out),
            GemvOutput::Glu | GemvOutput::Rope(_) => (0.0, false),
        };
        let rope = match output {
            GemvOutput::Rope(r) => r,
            _ => RopeOut::default(),
        };
        let i32v = |v: usize| Arg::I32(v as i32);
        let mut args = vec![
            Arg::Ptr(w),
            Arg::Ptr(x),
            Arg::Ptr(xf),
            Arg::Ptr(nw),
            Arg::F32(eps),
            Arg::Ptr(out),
            Arg::I32(m as i32),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::F32(beta),
            Arg::I32(i32::from(f32_out)),
            Arg::I32(grid.warps_per_tile as i32),
            Arg::Ptr(rope.q),
            Arg::Ptr(rope.k_cache),
            Arg::Ptr(rope.v_cache),
            Arg::Ptr(rope.pos),
            Arg::Ptr(rope.slots),
            Arg::Ptr(rope.inv_freq),
            i32v(rope.heads.0),
            i32v(rope.heads.1),
            i32v(rope.heads.2),
            Arg::I32(i32::from(rope.interleaved)),
            Arg::I32(if n <= 8 { self.gemv_rotate as i32 } else { 0 }),
            Arg::Ptr(ws),
            Arg::I32(ws_stride),
        ];
        if let Some(lo) = lora {
            let [(t0, w0), (t1, w1), (t2, w2)] = lo.parts;
            args.extend([
                Arg::Ptr(lo.u),
                i32v(lo.u_stride),
                i32v(lo.u_part),
                Arg::Ptr(lo.row_slot),
                Arg::Ptr(lo.ptrs),
                Arg::Ptr(lo.ranks),
                i32v(lo.layers),
                i32v(lo.layer),
                Arg::I32(t0),
                i32v(w0),
                Arg::I32(t1),
                i32v(w1),
                Arg::I32(t2),
                i32v(w2),
            ]);
        }
        self.launch(
            f,
            (grid.blocks as u32, 1, 1),
            32 * grid.warps_per_block as u32,
            &args,
        )
    }

    /// The product `p`: steps of at most [`GEMV_MAX_TOKENS`] rows run on the GEMV kernels
    /// (when [`Gpu::gemv_fits`]), larger ones on cuBLAS.
    pub fn gemm(&self, p: Product) -> Result<(), GpuError> {
        self.gemm_with(true, p)
    }

    /// Quantizes the bf16 matrix at `x` (`rows x k`, k a multiple of 8, 16-byte aligned) to
    /// e4m3 at `q`, with the f32 scales written to `scales`: one per row (`fp8_quant_rows`) or
    /// one for the whole matrix (`fp8_amax` into `parts`, [`FP8_MAX_PARTS`] f32, then
    /// `fp8_quant_tensor`). Capturable: nothing needs resetting.
    pub fn quantize_fp8(
        &self,
        x: u64,
        (rows, k): (usize, usize),
        (q, scales, parts): (u64, u64, u64),
        scaling: Fp8Scaling,
    ) -> Result<(), GpuError> {
        if rows == 0 {
            return Ok(());
        }
        if k == 0
            || !k.is_multiple_of(8)
            || !x.is_multiple_of(16)
            || !q.is_multiple_of(8)
            || rows > i32::MAX as usize
        {
            return Err(GpuError::Internal(format!(
                "fp8 quantization of {rows} x {k} at {x:#x} -> {q:#x}: k must be a multiple of 8, the buffers aligned"
            )));
        }
        match scaling {
            Fp8Scaling::Row => self.launch(
                &self.k.fp8_quant_rows,
                (rows as u32, 1, 1),
                if k >= 2048 { 256 } else { 128 },
                &[
                    Arg::Ptr(x),
                    Arg::I32(k as i32),
                    Arg::Ptr(q),
                    Arg::Ptr(scales),
                ],
            ),
            Fp8Scaling::Tensor => {
                let n = rows * k;
                let vecs = (n / 8).div_ceil(256);
                let parts_used = vecs.min(FP8_MAX_PARTS);
                self.launch(
                    &self.k.fp8_amax,
                    (parts_used as u32, 1, 1),
                    256,
                    &[Arg::Ptr(x), Arg::U64(n as u64), Arg::Ptr(parts)],
                )?;
                self.launch(
                    &self.k.fp8_quant_tensor,
                    (vecs.min(4 * 1024) as u32, 1, 1),
                    256,
                    &[
                        Arg::Ptr(x),
                        Arg::U64(n as u64),
                        Arg::Ptr(parts),
                        Arg::I32(parts_used as i32),
                        Arg::Ptr(q),
                        Arg::Ptr(scales),
                    ],
                )
            }
        }
    }

    /// Whether cuBLASLt has fp8 algorithms with `scaling` for `products` (m, k, f32 output,
    /// accumulate) at each step size of `ns` (see [`lt::Lt::fp8_supported`]).
    pub fn fp8_supported(
        &self,
        scaling: Fp8Scaling,
        (products, ns): &Fp8Shapes,
    ) -> Result<(), GpuError> {
        let lt = self
            .lt
            .as_ref()
            .ok_or_else(|| GpuError::Cuda("libcublasLt is not loaded".into()))?;
        lt.fp8_supported(scaling, products, ns)
    }

    /// The fp8 scaling this GPU's cuBLASLt runs for `shapes` (see [`Gpu::fp8_supported`]):
    /// [`Fp8Scaling::Row`] when it has outer-vector-scaled algorithms for every one (asked of
    /// the heuristic; nothing runs), else
    /// [`Fp8Scaling::Tensor`]; `SWITCHYARD_CUDA_FP8_SCALING=tensor` forces the latter. `None`
    /// without cuBLASLt or any fp8 algorithm.
    pub fn fp8_scaling(&self, shapes: &Fp8Shapes) -> Option<Fp8Scaling> {
        let forced = std::env::var("SWITCHYARD_CUDA_FP8_SCALING").ok();
        let mut order = vec![Fp8Scaling::Row, Fp8Scaling::Tensor];
        if forced.as_deref() == Some("tensor") {
            order.remove(0);
        }
        for scaling in order {
            match self.fp8_supported(scaling, shapes) {
                Ok(()) => return Some(scaling),
                Err(e) => {
                    tracing::info!(?scaling, error = %e, "cuBLASLt has no fp8 algorithm with this scaling")
                }
            }
        }
        None
    }

    /// [`Gpu::gemm`], on the GEMV kernels only when `gemv` (and they fit).
    pub fn gemm_with(&self, gemv: bool, p: Product) -> Result<(), GpuError> {
        if p.m == 0 || p.n == 0 {
            return Ok(());
        }
        if gemv && p.fp8.is_none() && self.gemv_fits(p.n, p.k, &[p.w, p.a]) {
            return self.gemv(
                (p.w, None),
                GemvInput::Bf16(p.a),
                p.c,
                p.m,
                p.n,
                p.k,
                GemvOutput::Plain {
                    beta: p.beta,
                    f32_out: p.c_f32,
                },
                None,
            );
        }
        self.gemm_cublas(p)
    }

    /// [`Gpu::gemm`] on cuBLAS whatever the size: cuBLASLt with the algorithm cached per shape
    /// (`lt`), or cublasGemmEx for shapes cuBLASLt declines, without libcublasLt, or with
    /// `SWITCHYARD_CUDA_BLASLT=0`. Capturable in a CUDA graph either way.
    pub fn gemm_cublas(&self, p: Product) -> Result<(), GpuError> {
        if (self.blaslt || p.fp8.is_some()) && self.gemm_lt(p)? {
            return Ok(());
        }
        self.gemm_ex(p)
    }

    /// [`Gpu::gemm_cublas`] on cuBLASLt whatever `SWITCHYARD_CUDA_BLASLT` says. Returns false,
    /// having enqueued nothing, when cuBLASLt is not loaded or declines the shape (no algorithm,
    /// plan cache full): the caller runs it on [`Gpu::gemm_ex`].
    pub fn gemm_lt(&self, p: Product) -> Result<bool, GpuError> {
        if p.m == 0 || p.n == 0 {
            return Ok(true);
        }
        let Some(lt) = &self.lt else {
            return Ok(false);
        };
        // Asked only when a shape is first seen: failures while capturing are not remembered.
        let capturing = || {
            !matches!(
                self.stream.capture_status(),
                Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
            )
        };
        let outcome = lt.gemm(self.stream.cu_stream() as _, capturing, &p)?;
        Ok(outcome == lt::LtOutcome::Ran)
    }

    /// Shapes in the cuBLASLt plan cache (0 without cuBLASLt).
    pub fn lt_cached_shapes(&self) -> usize {
        self.lt.as_ref().map_or(0, |lt| lt.cached())
    }

    /// [`Gpu::gemm_cublas`] on cublasGemmEx (the algorithm chosen by cuBLAS on every call).
    pub fn gemm_ex(&self, p: Product) -> Result<(), GpuError> {
        let Product {
            w,
            a,
            c,
            m,
            n,
            k,
            beta,
            c_f32,
            fp8,
        } = p;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if fp8.is_some() {
            return Err(GpuError::Cuda(format!(
                "cuBLASLt has no fp8 algorithm for a {m} x {n} x {k} product (fp8 needs cuBLASLt and sm_89 or newer)"
            )));
        }
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| GpuError::Internal(format!("GEMM size {v}")));
        let (mi, ni, ki) = (dim(m)?, dim(n)?, dim(k)?);
        let alpha = 1.0f32;
        let c_type = if c_f32 {
            blas_sys::cudaDataType::CUDA_R_32F
        } else {
            blas_sys::cudaDataType::CUDA_R_16BF
        };
        // Column-major view: C^T (m x n) = W (k x m)^T · A^T (k x n).
        // SAFETY: the pointers are live device buffers of the stated shapes.
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                mi,
                ni,
                ki,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16BF,
                ki,
                a as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16BF,
                ki,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                c_type,
                mi,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| cuda_err("cublasGemmEx", e))
    }
}

fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevMem, GpuError> {
    ctx.bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    // SAFETY: a plain allocation; freed by DevMem's Drop.
    let ptr = unsafe { drv::malloc_sync(bytes.max(16)) }
        .map_err(|e| cuda_err(&format!("allocating {bytes} bytes"), e))?;
    Ok(DevMem {
        ptr,
        bytes,
        ctx: ctx.clone(),
    })
}

/// NVRTC's include directory for `cuda_bf16.h`: `$CUDA_HOME/include`, else
/// `/usr/local/cuda/include`.
fn cuda_include_dir() -> PathBuf {
    std::env::var_os("CUDA_HOME")
        .or_else(|| std::env::var_os("CUDA_PATH"))
        .map(|h| PathBuf::from(h).join("include"))
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda/include"))
}

/// Where compiled kernels are cached: `$SWITCHYARD_KERNEL_CACHE`, else
/// `~/.cache/switchyard/kernels`.
fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("SWITCHYARD_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/switchyard/kernels"))
}

/// An on/off switch's value: `0`, `off` or `false` turn it off, `1`, `on` or `true` on (any
/// case, surrounding spaces ignored); anything else (or nothing) leaves `default`.
pub(crate) fn switch_on(value: Option<&str>, default: bool) -> bool {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        Some("0") | Some("off") | Some("false") => false,
        Some("1") | Some("on") | Some("true") => true,
        _ => default,
    }
}

/// The on/off switch in environment variable `name` ([`switch_on`]).
pub(crate) fn env_switch(name: &str, default: bool) -> bool {
    switch_on(std::env::var(name).ok().as_deref(), default)
}

/// Most `NAME=VALUE` pairs in `SWITCHYARD_CUDA_DEFINES`.
const MAX_DEFINES: usize = 8;

/// Parses `SWITCHYARD_CUDA_DEFINES`: comma-separated `NAME=VALUE` pairs (NAME: an upper-case
/// letter, then up to 31 of `[A-Z0-9_]`; VALUE: a 32-bit integer), at most [`MAX_DEFINES`],
/// passed to NVRTC as `-DNAME=VALUE` (and so part of the kernel cache key). A switch for
/// experiments on kernel source variants (e.g. `MMA_KEYS=32`); the kernels check what they
/// accept with static assertions, so an unsupported value fails the compilation, loudly.
pub(crate) fn parse_defines(v: &str) -> Result<Vec<(String, i32)>, String> {
    let mut out = Vec::new();
    for item in v.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (name, value) = item
            .split_once('=')
            .ok_or_else(|| format!("`{item}` is not NAME=VALUE"))?;
        let ok_name = name.len() <= 32
            && name.chars().next().is_some_and(|c| c.is_ascii_uppercase())
            && name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
        if !ok_name {
            return Err(format!(
                "`{name}` is not a macro name ([A-Z][A-Z0-9_]*, 32 at most)"
            ));
        }
        let value: i32 = value
            .parse()
            .map_err(|_| format!("`{value}` is not a 32-bit integer"))?;
        if out.len() == MAX_DEFINES {
            return Err(format!("more than {MAX_DEFINES} definitions"));
        }
        out.push((name.to_string(), value));
    }
    Ok(out)
}

/// NVRTC options for an architecture and extra macro definitions.
fn compile_options(arch: &str, defines: &[(String, i32)]) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={}", cuda_include_dir().display()),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ];
    o.extend(defines.iter().map(|(n, v)| format!("-D{n}={v}")));
    o
}

/// Compiles the kernels to PTX for `cc` (or reads them from the disk cache, keyed by a hash of
/// source, options and architecture) and loads the module.
fn load_kernels(
    ctx: &Arc<CudaContext>,
    cc: (i32, i32),
    defines: &[(String, i32)],
) -> Result<Arc<CudaModule>, GpuError> {
    let ptx = compile_ptx_with(cc, defines)?;
    ctx.load_module(Ptx::from_src(ptx))
        .map_err(|e| cuda_err("loading the kernel module", e))
}

/// The PTX of the kernels for compute capability `cc`, compiled or from the cache.
pub fn compile_ptx(cc: (i32, i32)) -> Result<String, GpuError> {
    compile_ptx_with(cc, &[])
}

/// [`compile_ptx`] with extra macro definitions (see [`parse_defines`]).
pub fn compile_ptx_with(cc: (i32, i32), defines: &[(String, i32)]) -> Result<String, GpuError> {
    let arch = format!("sm_{}{}", cc.0, cc.1);
    let opts = compile_options(&arch, defines);
    let mut h = Sha256::new();
    h.update(KERNELS.as_bytes());
    for o in &opts {
        h.update([0u8]);
        h.update(o.as_bytes());
    }
    let key: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let cached = cache_dir().map(|d| d.join(format!("llama-{arch}-{key}.ptx")));
    if let Some(p) = &cached {
        if let Ok(text) = std::fs::read_to_string(p) {
            if text.contains(".entry sample_partials") && text.contains(".entry gemv_norm_glu_1") {
                tracing::debug!(path = %p.display(), "kernels from the cache");
                return Ok(text);
            }
        }
    }
    let started = std::time::Instant::now();
    // SAFETY: only opens the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError::Cuda("libnvrtc not found".into()));
    }
    let options = CompileOptions {
        options: opts,
        name: Some("switchyard-kernels.cu".into()),
        ..CompileOptions::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, options)
        .map_err(|e| GpuError::Cuda(format!("NVRTC failed to compile the kernels: {e}")))?
        .to_src();
    tracing::info!(
        arch,
        ms = started.elapsed().as_millis() as u64,
        "kernels compiled by NVRTC"
    );
    if let Some(p) = &cached {
        // A cache that cannot be written only costs a recompilation next time.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(ptx)
}

#[cfg(test)]
mod tests {
    use super::{
        auto_route, gemv_grid, gemv_grid_pow2, gemv_rotation, parse_defines, switch_on, GemvGrid,
        GemvRoute, GEMV_AUTO_MAX_HIDDEN, GEMV_BATCH_STEPS, GEMV_ROTATE, GEMV_WARPS_PER_SM,
        MAX_DEFINES,
    };

    #[test]
    fn only_models_routed_by_step_size_rotate() {
        // (SWITCHYARD_CUDA_GEMV_ROTATE is not set in the test environment.)
        assert_eq!(gemv_rotation(576), 0);
        assert_eq!(gemv_rotation(GEMV_AUTO_MAX_HIDDEN), 0);
        assert_eq!(gemv_rotation(4096), GEMV_ROTATE);
    }

    #[test]
    fn switches_turn_off_with_0_or_off_and_on_with_1_or_on() {
        for default in [false, true] {
            assert!(!switch_on(Some("0"), default) && !switch_on(Some("off"), default));
            assert!(switch_on(Some("1"), default) && switch_on(Some("on"), default));
            assert_eq!(switch_on(None, default), default);
            assert_eq!(switch_on(Some("maybe"), default), default);
        }
        // SWITCHYARD_CUDA_BLASLT's spellings (its own parser before): empty leaves the
        // default, `false` and any case turn off.
        assert!(switch_on(None, true));
        assert!(switch_on(Some(""), true));
        assert!(switch_on(Some("1"), true));
        assert!(switch_on(Some("on"), true));
        assert!(!switch_on(Some("0"), true));
        assert!(!switch_on(Some("off"), true));
        assert!(!switch_on(Some(" OFF "), true));
        assert!(!switch_on(Some("false"), true));
    }

    #[test]
    fn kernel_definitions_are_validated() {
        assert_eq!(parse_defines(""), Ok(vec![]));
        assert_eq!(
            parse_defines(" MMA_KEYS=32, GEMV_PAIRED=1 ,"),
            Ok(vec![("MMA_KEYS".into(), 32), ("GEMV_PAIRED".into(), 1)])
        );
        assert_eq!(parse_defines("X=-5"), Ok(vec![("X".into(), -5)]));
        for bad in [
            "MMA_KEYS",
            "mma_keys=32",
            "1X=1",
            "_X=1",
            "X-Y=1",
            "X=1.5",
            "X=",
            "X=99999999999",
            "X=1;rm",
            "X=1 -DY",
            "X Y=1",
        ] {
            assert!(parse_defines(bad).is_err(), "{bad}");
        }
        assert!(parse_defines(&format!("{}=1", "A".repeat(33))).is_err());
        let many: Vec<String> = (0..=MAX_DEFINES).map(|i| format!("D{i}=1")).collect();
        assert!(parse_defines(&many.join(",")).is_err());
        assert!(parse_defines(&many[..MAX_DEFINES].join(",")).is_ok());
    }

    #[test]
    fn auto_routes_by_hidden_size_and_step_size() {
        use GemvRoute::*;
        // SmolLM2-sized models: the GEMV path at every step size (its products take the GEMV
        // kernels up to 64 tokens, `gemv_fits`; the lm_head whenever its rows fit).
        for n in [1, 8, 64, 65, 4096] {
            assert_eq!(auto_route(576, n), Gemv, "{n}");
            assert_eq!(auto_route(2048, n), Gemv, "{n}");
        }
        // Llama-3-8B-sized: fused GEMV up to 4, hybrid 5-8, GEMV 9-16, cuBLAS above.
        let llama: Vec<GemvRoute> = (1..=20).map(|n| auto_route(4096, n)).collect();
        let mut want = vec![Gemv; 4];
        want.extend([Hybrid; 4]);
        want.extend([Gemv; 8]);
        want.extend([Cublas; 4]);
        assert_eq!(llama, want);
        assert_eq!(auto_route(4096, 64), Cublas);
        assert_eq!(auto_route(4096, 4096), Cublas);
        assert_eq!(auto_route(8192, 1), Gemv);
    }

    #[test]
    fn gemv_grid_covers_every_tile_within_a_wave_where_it_can() {
        // Products on an H200 (132 SMs): tiles (16 rows, 8 of gate and 8 of up for gate|up),
        // k-steps of 32.
        let g = |tiles, k_steps| gemv_grid(tiles, k_steps, 132);
        let grid = |blocks, warps_per_block, warps_per_tile| GemvGrid {
            blocks,
            warps_per_block,
            warps_per_tile,
        };
        // Llama-3-8B: qkv (5 warps per tile: 7 batches of loads each instead of 8), o, down,
        // gate|up, lm_head.
        assert_eq!(g(384, 128), grid(384, 5, 5));
        assert_eq!(g(256, 128), grid(256, 8, 8));
        assert_eq!(g(256, 448), grid(256, 8, 8));
        assert_eq!(g(1792, 128), grid(224, 8, 1));
        assert_eq!(g(8016, 128), grid(1002, 8, 1));
        // Phi-3-mini: qkv (144 blocks of 8 warps before, not one per SM), gate|up.
        assert_eq!(g(576, 96), grid(576, 3, 3));
        assert_eq!(g(1024, 96), grid(256, 8, 2));
        // Qwen3-0.6B's gate|up: 5 warps per tile would make as many batches as 4.
        assert_eq!(g(384, 32), grid(384, 4, 4));
        // SmolLM2's qkv: one batch from 5 warps per tile on; 8 as before.
        assert_eq!(g(60, 18), grid(60, 8, 8));
        for tiles in 1..5000 {
            for k_steps in [1, 18, 28, 32, 96, 128, 448] {
                let r = g(tiles, k_steps);
                assert_eq!(r.warps_per_block % r.warps_per_tile, 0);
                let per_block = r.warps_per_block / r.warps_per_tile;
                assert!(r.blocks * per_block >= tiles && (r.blocks - 1) * per_block < tiles);
                assert!(r.warps_per_block <= 8);
                // One wave of resident blocks wherever one-warp tiles in blocks of 8 make one.
                let resident = GEMV_WARPS_PER_SM / r.warps_per_block * 132;
                assert!(
                    r.blocks <= resident || tiles > 8 * resident,
                    "{tiles}: {r:?}"
                );
                // Never fewer warps per tile than the powers of two alone would give, and more
                // only where that shortens every warp's chain of loads.
                let old = gemv_grid_pow2(tiles, 132).warps_per_tile;
                let batches = |w: usize| k_steps.div_ceil(w).div_ceil(GEMV_BATCH_STEPS);
                assert!(r.warps_per_tile >= old, "{tiles} {k_steps}");
                assert!(
                    r.warps_per_tile == old || batches(r.warps_per_tile) < batches(old),
                    "{tiles} {k_steps}: {r:?}"
                );
            }
        }
    }
}
