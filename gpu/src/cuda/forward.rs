//! The Llama forward pass on the device: activation buffers sized for the largest step, the
//! paged KV cache, the launch sequence of one step (four matrix products and five kernels per
//! layer; on the GEMV path ([`Gpu::gemv_for`]: steps of at most 64 tokens, fewer at
//! Llama-3-8B's size) the products run on the GEMV kernels, which also take over SiLU x up
//! and, up to 8 tokens, the RMSNorms: see [`Gpu::gemv_fuse_glu`] and [`Gpu::gemv_fuse_norm`]), and CUDA graphs of
//! decode steps, one per batch-size bucket.
//!
//! A decode step of `n` sequences runs in the graph of the smallest bucket `B >= n`: the step
//! buffer is packed with the capacities of `B` (padding tokens write no KV and attend to
//! nothing), so every kernel argument, GEMM shape and buffer address of the capture stays valid
//! on replay; only the contents of the step buffer change.

use std::collections::HashMap;

use cudarc::driver::{sys, CudaGraph};

use super::device::{
    cuda_err, Arg, DevMem, Fp8Scales, GemvInput, GemvLora, GemvOutput, Gpu, Product, RopeOut,
    FP8_MAX_PARTS, GEMV_LORA_MAX_TOKENS,
};
use super::step::{grid_splits, one_warp_tiles, Layout, ATT_SMALL_ROWS, MAX_SPLITS};
use super::weights::{GpuLayer, GpuWeights, Proj};
use crate::error::GpuError;
use crate::lora::LoraTarget;
use crate::model::{LlamaConfig, RopeStyle};

/// Decode batch sizes that get a CUDA graph.
pub(crate) const GRAPH_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// Activation buffers and the KV cache.
pub(crate) struct Buffers {
    pub x: DevMem,
    pub xn: DevMem,
    pub qkv: DevMem,
    pub q: DevMem,
    pub att: DevMem,
    pub gu: DevMem,
    pub act: DevMem,
    pub xs: DevMem,
    pub logits: DevMem,
    pub part_acc: DevMem,
    pub part_ml: DevMem,
    pub step: DevMem,
    pub sampled: DevMem,
    pub kv: DevMem,
    /// With fp8 weights: where each product's activations are quantized.
    pub fp8: Option<Fp8Buffers>,
    /// Tokens per step at most.
    pub max_tokens: usize,
    /// Logit rows per step at most.
    pub max_rows: usize,
    /// Tokens of a step that may use split-K attention.
    pub split_tokens: usize,
    /// Bytes of one layer's keys (values follow), fp8 scales included.
    pub kv_layer_bytes: usize,
    /// With an fp8 cache (e4m3 keys and values, `kv_cache_dtype: fp8`): where a layer's key
    /// (or value) scales start within its part, one f32 per (slot, KV head).
    pub kv_scales_at: Option<usize>,
}

/// Where one layer's keys and values are: `[slots, kv_heads, head_dim]` bf16, or e4m3 bytes
/// followed by their f32 scales `[slots, kv_heads]` (`scales`: keys', values').
#[derive(Clone, Copy, Debug)]
pub(crate) struct KvLayer {
    pub k: u64,
    pub v: u64,
    pub scales: Option<(u64, u64)>,
}

/// The e4m3 copy of a product's activations, their scales (per token, or one), and the
/// partial maxima of per-tensor scaling.
pub(crate) struct Fp8Buffers {
    pub q: DevMem,
    pub scales: DevMem,
    pub parts: DevMem,
}

impl Fp8Buffers {
    /// Bytes for steps of `max_tokens` tokens (the widest product input is the intermediate
    /// activation or the attention output).
    fn bytes(c: &LlamaConfig, max_tokens: usize) -> usize {
        let k = c
            .hidden_size
            .max(c.num_heads * c.head_dim)
            .max(c.intermediate_size);
        max_tokens * k + max_tokens * 4 + FP8_MAX_PARTS * 4
    }

    fn new(gpu: &Gpu, c: &LlamaConfig, max_tokens: usize) -> Result<Self, GpuError> {
        let k = c
            .hidden_size
            .max(c.num_heads * c.head_dim)
            .max(c.intermediate_size);
        Ok(Fp8Buffers {
            q: gpu.alloc(max_tokens * k)?,
            scales: gpu.alloc(max_tokens * 4)?,
            parts: gpu.alloc(FP8_MAX_PARTS * 4)?,
        })
    }
}

/// Bytes of one token slot's keys (or values) in one layer: bf16 values, or (`fp8`) e4m3
/// values and an f32 scale per KV head ([`crate::KvGeometry::slot_bytes`]).
fn kv_slot_bytes(c: &LlamaConfig, fp8: bool) -> usize {
    crate::KvGeometry::of(c, 1, crate::KvStorage::from_fp8(fp8)).slot_bytes()
}

/// Bytes of KV cache per block (`fp8`: `kv_cache_dtype: fp8`), without
/// [`kv_part_layout`]'s alignment padding (at most 512 bytes per layer's keys or values):
/// the host tier's arithmetic ([`crate::KvGeometry::block_bytes`]), so the two cannot disagree.
pub(crate) fn kv_block_bytes(c: &LlamaConfig, block_size: usize, fp8: bool) -> usize {
    crate::KvGeometry::of(c, block_size, crate::KvStorage::from_fp8(fp8)).block_bytes()
}

/// One layer's keys (or values) in a cache of `slots` token slots: (offset of the fp8 scales,
/// bytes in all). Both parts start on 256-byte boundaries (the attention kernels copy 16-byte
/// pieces; an fp8 cache's value bytes would otherwise start wherever the key scales end).
fn kv_part_layout(c: &LlamaConfig, slots: usize, fp8: bool) -> (usize, usize) {
    let round = |b: usize| b.next_multiple_of(256);
    if fp8 {
        let values = round(slots * c.num_kv_heads * c.head_dim);
        (values, values + round(slots * c.num_kv_heads * 4))
    } else {
        let values = round(slots * kv_slot_bytes(c, false));
        (values, values)
    }
}

/// Bytes of the step buffer for `tokens` tokens of at most `seqs` sequences and `rows` logit
/// rows, with block tables of at most `stride` entries.
pub(crate) fn step_bytes(tokens: usize, seqs: usize, rows: usize, stride: usize) -> usize {
    Layout::new(tokens, tokens, rows, rows).tables + 4 * seqs.min(tokens) * stride
}

impl Buffers {
    /// Activation buffers for `max_tokens` tokens of at most `max_seqs` sequences and
    /// `max_rows` logit rows (without the KV cache, which is sized from what is left: see
    /// [`Buffers::with_cache`]); `fp8`: with the fp8 activation buffers.
    pub fn activation_bytes(
        c: &LlamaConfig,
        (max_tokens, max_seqs): (usize, usize),
        max_rows: usize,
        block_size: usize,
        fp8: bool,
    ) -> usize {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qw, kvw, inter) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
        let t = max_tokens;
        let split_t = t.min(GRAPH_BUCKETS[GRAPH_BUCKETS.len() - 1]);
        let stride = c.max_position_embeddings / block_size + 1;
        t * h * 4
            + t * h * 2
            + t * (qw + 2 * kvw) * 4
            + 2 * t * qw * 2
            + t * 2 * inter * 2
            + t * inter * 2
            + max_rows * h * 2
            + max_rows * c.vocab_size * 4
            + split_t * c.num_heads * MAX_SPLITS * (hd + 2) * 4
            + step_bytes(t, max_seqs, max_rows, stride)
            + max_rows * 4
            + if fp8 { Fp8Buffers::bytes(c, t) } else { 0 }
    }

    /// Allocates the buffers for steps of at most `max_tokens` tokens, `max_seqs` sequences
    /// and `max_rows` logit rows (`fp8`: with the fp8 activation buffers) and a cache of
    /// `blocks` blocks (`kv_fp8`: e4m3 with scales).
    pub fn with_cache(
        gpu: &Gpu,
        c: &LlamaConfig,
        (max_tokens, max_seqs, max_rows): (usize, usize, usize),
        blocks: usize,
        block_size: usize,
        (fp8, kv_fp8): (bool, bool),
    ) -> Result<Self, GpuError> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qw, kvw, inter) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
        let t = max_tokens;
        let split_tokens = t.min(GRAPH_BUCKETS[GRAPH_BUCKETS.len() - 1]);
        let stride = c.max_position_embeddings / block_size + 1;
        let kv_slots = blocks * block_size;
        let (kv_scales_at, kv_layer_bytes) = kv_part_layout(c, kv_slots, kv_fp8);
        Ok(Buffers {
            x: gpu.alloc(t * h * 4)?,
            xn: gpu.alloc(t * h * 2)?,
            qkv: gpu.alloc(t * (qw + 2 * kvw) * 4)?,
            q: gpu.alloc(t * qw * 2)?,
            att: gpu.alloc(t * qw * 2)?,
            gu: gpu.alloc(t * 2 * inter * 2)?,
            act: gpu.alloc(t * inter * 2)?,
            xs: gpu.alloc(max_rows * h * 2)?,
            logits: gpu.alloc(max_rows * c.vocab_size * 4)?,
            part_acc: gpu.alloc(split_tokens * c.num_heads * MAX_SPLITS * hd * 4)?,
            part_ml: gpu.alloc(split_tokens * c.num_heads * MAX_SPLITS * 2 * 4)?,
            step: gpu.alloc(step_bytes(t, max_seqs, max_rows, stride))?,
            sampled: gpu.alloc(max_rows * 4)?,
            kv: gpu.alloc(2 * c.num_layers * kv_layer_bytes)?,
            fp8: if fp8 {
                Some(Fp8Buffers::new(gpu, c, t)?)
            } else {
                None
            },
            max_tokens,
            max_rows,
            split_tokens,
            kv_layer_bytes,
            kv_scales_at: kv_fp8.then_some(kv_scales_at),
        })
    }

    /// Layer `li`'s part of the cache.
    pub fn kv_layer(&self, li: usize) -> Result<KvLayer, GpuError> {
        let (k_off, v_off) = (
            2 * li * self.kv_layer_bytes,
            (2 * li + 1) * self.kv_layer_bytes,
        );
        Ok(KvLayer {
            k: self.kv.at(k_off)?,
            v: self.kv.at(v_off)?,
            scales: match self.kv_scales_at {
                Some(at) => Some((self.kv.at(k_off + at)?, self.kv.at(v_off + at)?)),
                None => None,
            },
        })
    }
}

/// Shapes of one forward launch sequence.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Launch {
    /// Tokens (padded to the bucket in a graph).
    pub tokens: usize,
    /// Attention tiles.
    pub tiles: usize,
    /// Of them, the first ones for the one-warp attention blocks (see
    /// [`super::step::one_warp_tiles`]; the four-warp kernel takes any tile).
    pub small_tiles: usize,
    /// Logit rows.
    pub rows: usize,
    /// Attention grid splits (1: no combine step).
    pub z: usize,
    /// Every tile is its sequence's only query token of the step (decode steps) and the step
    /// is small ([`EARLY_KV_MAX_TOKENS`]): the keys before each query were written by earlier
    /// steps, so the attention kernel asks for its first chunk of them before waiting on the
    /// QKV product (programmatic dependent launch).
    pub early_kv: bool,
    /// Where the arrays sit in the step buffer.
    pub layout: Layout,
}

/// Enqueues the forward pass of one step (no synchronisation, so it can be captured).
/// A step's LoRA adapters on the device (see `lora_shrink`, `lora_expand` and `lora_silu_mul`
/// in the kernels).
pub(crate) struct LoraStep {
    /// `i32` per token: the token's adapter slot, or -1.
    pub row_slot: u64,
    /// `i32` per slot: its rank.
    pub ranks: u64,
    /// `u64` per (slot, layer, target, A|B): device addresses, 0 for targets not adapted.
    pub ptrs: u64,
    /// f32 scratch, three parts of `max_rank` per token (one per target of a launch).
    pub u: u64,
    /// The largest rank of the step's adapters (a part of `u`).
    pub max_rank: usize,
    /// The projections any of the step's adapters adapts (bit `LoraTarget::index`): the
    /// others run as in steps without adapters.
    pub targets: u8,
}

/// The kernels' code for "no target".
const NO_TARGET: i32 = -1;

fn target_code(t: Option<LoraTarget>) -> i32 {
    t.map_or(NO_TARGET, |t| t as i32)
}

fn target_arg(t: Option<LoraTarget>) -> Arg {
    Arg::I32(target_code(t))
}

/// The targets of the three products whose updates one shrink computes, with the widths of
/// their outputs side by side.
type Parts = [(Option<LoraTarget>, usize); 3];

impl LoraStep {
    /// Whether any of the step's adapters adapts one of `targets`.
    fn adapts(&self, targets: &[LoraTarget]) -> bool {
        self.targets & super::lora::target_mask(targets) != 0
    }

    /// `u = A x` for up to three `targets` of one input `din` wide, target `i` in part `i` of
    /// a token's `u`: bf16 rows `x_stride` apart, or ([`GemvInput::Norm`], `x_stride` unused)
    /// the f32 residual rows normalised as `rms_norm` would.
    fn shrink(
        &self,
        gpu: &Gpu,
        c: &LlamaConfig,
        (t, layer): (usize, usize),
        targets: [Option<LoraTarget>; 3],
        (input, x_stride, din): (GemvInput, usize, usize),
    ) -> Result<(), GpuError> {
        let i32v = |v: usize| Arg::I32(v as i32);
        let (x, xf, nw, eps) = match input {
            GemvInput::Bf16(x) => (x, 0, 0, 0.0),
            GemvInput::Norm { x, weight, eps } => (0, x, weight, eps),
        };
        // A warp per (token, target, rank index), four per block.
        let blocks = (t * 3 * self.max_rank).div_ceil(4).min(1 << 20) as u32;
        gpu.timed("lora_shrink", || {
            gpu.launch(
                &gpu.k.lora_shrink,
                (blocks, 1, 1),
                128,
                &[
                    Arg::Ptr(x),
                    i32v(x_stride),
                    i32v(din),
                    Arg::Ptr(xf),
                    Arg::Ptr(nw),
                    Arg::F32(eps),
                    Arg::Ptr(self.row_slot),
                    Arg::Ptr(self.ptrs),
                    Arg::Ptr(self.ranks),
                    i32v(c.num_layers),
                    i32v(layer),
                    target_arg(targets[0]),
                    target_arg(targets[1]),
                    target_arg(targets[2]),
                    Arg::Ptr(self.u),
                    i32v(3 * self.max_rank),
                    i32v(self.max_rank),
                    i32v(t),
                ],
            )
        })
    }

    /// The updates `B u` of `parts` in a GEMV epilogue, after [`LoraStep::shrink`] of the same
    /// targets.
    fn epilogue(&self, c: &LlamaConfig, layer: usize, parts: Parts) -> GemvLora {
        GemvLora {
            u: self.u,
            u_stride: 3 * self.max_rank,
            u_part: self.max_rank,
            row_slot: self.row_slot,
            ptrs: self.ptrs,
            ranks: self.ranks,
            layers: c.num_layers,
            layer,
            parts: parts.map(|(t, w)| (target_code(t), w)),
        }
    }

    /// Adds the updates `B u` of up to three targets, whose outputs sit side by side (widths
    /// `parts[i].1`) from column 0 of the f32 `out` (`out_stride` per token), after
    /// [`LoraStep::shrink`] of the same targets from the bf16 rows `x` (for products on
    /// cuBLAS).
    fn update(
        &self,
        gpu: &Gpu,
        c: &LlamaConfig,
        (t, layer): (usize, usize),
        parts: Parts,
        (x, x_stride, din): (u64, usize, usize),
        (out, out_stride): (u64, usize),
    ) -> Result<(), GpuError> {
        let x = (GemvInput::Bf16(x), x_stride, din);
        self.shrink(gpu, c, (t, layer), parts.map(|p| p.0), x)?;
        let i32v = |v: usize| Arg::I32(v as i32);
        let dout: usize = parts.iter().map(|p| p.1).sum();
        gpu.timed("lora_expand", || {
            gpu.launch(
                &gpu.k.lora_expand,
                (dout.div_ceil(256) as u32, t.min(65_535) as u32, 1),
                256,
                &[
                    Arg::Ptr(self.u),
                    i32v(3 * self.max_rank),
                    i32v(self.max_rank),
                    Arg::Ptr(self.row_slot),
                    Arg::Ptr(self.ptrs),
                    Arg::Ptr(self.ranks),
                    i32v(c.num_layers),
                    i32v(layer),
                    target_arg(parts[0].0),
                    i32v(parts[0].1),
                    target_arg(parts[1].0),
                    i32v(parts[1].1),
                    target_arg(parts[2].0),
                    i32v(parts[2].1),
                    Arg::Ptr(out),
                    i32v(out_stride),
                    i32v(t),
                ],
            )
        })
    }
}

/// Enqueues one step's forward pass. With `lora`, the products take their route by size as in
/// other steps; an adapted product on the GEMV kernels (small steps) gets its updates `B u` in
/// the epilogue, before RoPE or SiLU, after `lora_shrink` computed `u` (from the normalised
/// residual itself where the product has the norm prologue), so it keeps its fused stages; on
/// cuBLAS, the updates follow the product (`lora_expand`), and an adapted QKV or gate|up
/// product runs with separate norm and RoPE kernels and SiLU x up with the gate's and up's
/// updates inside (`lora_silu_mul`). Products no adapter of the step adapts run as in steps
/// without adapters.
pub(crate) fn enqueue(
    gpu: &Gpu,
    c: &LlamaConfig,
    w: &GpuWeights,
    b: &Buffers,
    block_size: usize,
    l: &Launch,
    lora: Option<&LoraStep>,
) -> Result<(), GpuError> {
    let k = &gpu.k;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (nh, nkv, inter) = (c.num_heads, c.num_kv_heads, c.intermediate_size);
    let (qw, kvw) = (nh * hd, nkv * hd);
    let t = l.tokens;
    let s = |off: usize| b.step.at(off);
    let lay = &l.layout;
    let ti = t as u32;
    let i32v = |v: usize| Arg::I32(v as i32);
    gpu.timed("embed", || {
        gpu.launch(
            &k.embed,
            (ti, 1, 1),
            256,
            &[
                Arg::Ptr(w.embed.ptr()),
                Arg::Ptr(s(lay.tokens)?),
                Arg::Ptr(b.sampled.ptr()),
                Arg::Ptr(b.x.ptr()),
                i32v(h),
            ],
        )
    })?;
    let norm = |src_rows: u64, weight: u64, out: u64, rows: usize| {
        gpu.timed("rms_norm", || {
            gpu.launch(
                &k.rms_norm,
                (rows as u32, 1, 1),
                256,
                &[
                    Arg::Ptr(b.x.ptr()),
                    Arg::Ptr(weight),
                    Arg::Ptr(out),
                    Arg::Ptr(src_rows),
                    i32v(h),
                    Arg::F32(c.rms_norm_eps),
                ],
            )
        })
    };
    let interleaved = i32::from(c.rope_style == RopeStyle::Interleaved);
    // Small steps on the GEMV path (`Gpu::gemv_for`): the GEMV kernels, with SiLU x up in the
    // gate|up epilogue and, up to 8 tokens, RMSNorm in the QKV and gate|up prologues (the same
    // bits as the separate kernels, fewer launches).
    // The hybrid route (`Gpu::gemv_hybrid`): only the QKV product (with the norm prologue) and
    // the output projection on the GEMV kernels; the wide gate|up and down products and the
    // lm_head on cuBLAS.
    let model_gemv = gpu.gemv_for(h, t);
    let hybrid = !model_gemv && gpu.gemv_hybrid(h, t);
    let first = w.layers.first();
    let fits = (model_gemv || hybrid)
        && first.is_some_and(|f| {
            gpu.gemv_fits(t, h, &[f.qkv.ptr(), f.gate_up.ptr(), b.x.ptr(), b.xn.ptr()])
                && gpu.gemv_fits(t, qw, &[f.o.ptr(), b.att.ptr()])
                && gpu.gemv_fits(t, inter, &[f.down.ptr(), b.act.ptr()])
        });
    // `small`: gate|up and down on the GEMV kernels; `qkv_o`: QKV and o.
    let small = fits && model_gemv;
    let qkv_o = fits;
    // The adapters' updates of each product (none where no adapter of the step adapts it): in
    // the GEMV epilogue for steps of at most GEMV_LORA_MAX_TOKENS tokens on bf16 weights
    // (`*_in`: the product keeps its fused stages), else after the product (`*_after`: an
    // adapted QKV or gate|up product then loses its fused norm prologue and RoPE or SiLU
    // epilogue, which the updates must precede).
    let adapted = |targets: &[LoraTarget]| lora.filter(|l| l.adapts(targets));
    let (lora_qkv, lora_o) = (
        adapted(&[LoraTarget::Q, LoraTarget::K, LoraTarget::V]),
        adapted(&[LoraTarget::O]),
    );
    let (lora_gu, lora_down) = (
        adapted(&[LoraTarget::Gate, LoraTarget::Up]),
        adapted(&[LoraTarget::Down]),
    );
    let epi_ok =
        t <= GEMV_LORA_MAX_TOKENS && first.is_some_and(|f| f.fp8_scales(Proj::Qkv, 0).is_none());
    fn split(lo: Option<&LoraStep>, inside: bool) -> (Option<&LoraStep>, Option<&LoraStep>) {
        (lo.filter(|_| inside), lo.filter(|_| !inside))
    }
    let (qkv_in, qkv_after) = split(lora_qkv, qkv_o && epi_ok);
    let (o_in, o_after) = split(lora_o, qkv_o && epi_ok);
    // (gate|up's updates in the epilogue only where SiLU x up is in it too.)
    let (gu_in, gu_after) = split(lora_gu, small && epi_ok && gpu.gemv_fuse_glu());
    let (down_in, down_after) = split(lora_down, small && epi_ok);
    let fuse_glu = gu_after.is_none() && small && gpu.gemv_fuse_glu();
    let qkv_parts = [
        (Some(LoraTarget::Q), qw),
        (Some(LoraTarget::K), kvw),
        (Some(LoraTarget::V), kvw),
    ];
    let o_parts = [(Some(LoraTarget::O), h), (None, 0), (None, 0)];
    let gu_parts = [
        (Some(LoraTarget::Gate), inter),
        (Some(LoraTarget::Up), inter),
        (None, 0),
    ];
    let down_parts = [(Some(LoraTarget::Down), h), (None, 0), (None, 0)];
    // `u` of a product whose updates its GEMV epilogue adds, and those updates.
    let pre = |lo: Option<&LoraStep>, li: usize, parts: Parts, x: (GemvInput, usize, usize)| {
        lo.map(|lo| {
            lo.shrink(gpu, c, (t, li), parts.map(|p| p.0), x)
                .map(|()| lo.epilogue(c, li, parts))
        })
        .transpose()
    };
    let fuse_norm = (small && gpu.gemv_fuse_norm(t)) || (fits && hybrid);
    let normed = |weight: &DevMem| GemvInput::Norm {
        x: b.x.ptr(),
        weight: weight.ptr(),
        eps: c.rms_norm_eps,
    };
    // A projection of a layer timed as `class`: on the GEMV kernels when `gemv` and they fit
    // (fp8 weights widened in the kernel, activations bf16), else on cuBLAS (fp8 layers: the
    // activations quantized to e4m3 first, a scale per token).
    // With `epi`, the product must take the GEMV route (the caller checked `fits`), whose
    // epilogue adds those LoRA updates.
    let project = |class: &'static str,
                   gemv: bool,
                   layer: &GpuLayer,
                   proj: Proj,
                   p: Product,
                   epi: Option<GemvLora>| {
        if p.m == 0 || p.n == 0 {
            return Ok(());
        }
        let f = layer.fp8_scales(proj, 0);
        if gemv && gpu.gemv_fits(p.n, p.k, &[p.w, p.a]) {
            let out = GemvOutput::Plain {
                beta: p.beta,
                f32_out: p.c_f32,
            };
            let input = GemvInput::Bf16(p.a);
            return gpu.timed(class, || {
                gpu.gemv((p.w, f), input, p.c, p.m, p.n, p.k, out, epi.as_ref())
            });
        }
        if epi.is_some() {
            return Err(GpuError::Internal(format!(
                "{class}: LoRA updates for a GEMV epilogue, but the product runs on cuBLAS"
            )));
        }
        let Some(f) = f else {
            return gpu.timed(class, || gpu.gemm_cublas(p));
        };
        let q8 = b
            .fp8
            .as_ref()
            .ok_or_else(|| GpuError::Internal("fp8 layers without fp8 buffers".into()))?;
        let to = (q8.q.ptr(), q8.scales.ptr(), q8.parts.ptr());
        gpu.timed("fp8_quant", || {
            gpu.quantize_fp8(p.a, (p.n, p.k), to, f.scaling)
        })?;
        let scales = Fp8Scales {
            a: q8.scales.ptr(),
            ..f
        };
        gpu.timed(class, || {
            gpu.gemm_cublas(Product {
                a: q8.q.ptr(),
                fp8: Some(scales),
                ..p
            })
        })
    };
    for (li, layer) in w.layers.iter().enumerate() {
        let kv = b.kv_layer(li)?;
        // Steps on the GEMV kernels rotate Q and K and store K and V in the QKV product's
        // epilogue (unless `SWITCHYARD_CUDA_ROPE_EPILOGUE=0`, or the cache is fp8: its scales
        // need a whole KV head's values); the others write the f32 product for rope_store_kv.
        let rope_out = RopeOut {
            q: b.q.ptr(),
            k_cache: kv.k,
            v_cache: kv.v,
            pos: s(lay.pos)?,
            slots: s(lay.slots)?,
            inv_freq: w.inv_freq.ptr(),
            heads: (nh, nkv, hd),
            interleaved: interleaved != 0,
            bias: layer.qkv_bias.as_ref().map_or(0, DevMem::ptr),
        };
        let rope = GemvOutput::Rope(rope_out);
        // (Layers with biases add them in rope_store_kv; head norms run before it.)
        let rope_in_gemv = qkv_after.is_none()
            && qkv_o
            && gpu.rope_epilogue
            && kv.scales.is_none()
            && rope_out.bias == 0
            && layer.qk_norm.is_none();
        let f32_qkv = GemvOutput::Plain {
            beta: 0.0,
            f32_out: true,
        };
        if fuse_norm && qkv_after.is_none() {
            let epi = pre(qkv_in, li, qkv_parts, (normed(&layer.attn_norm), h, h))?;
            let (class, output) = if rope_in_gemv {
                ("norm+gemv_qkv+rope", rope)
            } else {
                ("norm+gemv_qkv", f32_qkv)
            };
            gpu.timed(class, || {
                gpu.gemv(
                    (layer.qkv.ptr(), layer.fp8_scales(Proj::Qkv, 0)),
                    normed(&layer.attn_norm),
                    b.qkv.ptr(),
                    qw + 2 * kvw,
                    t,
                    h,
                    output,
                    epi.as_ref(),
                )
            })?;
        } else {
            norm(0, layer.attn_norm.ptr(), b.xn.ptr(), t)?;
            let epi = pre(qkv_in, li, qkv_parts, (GemvInput::Bf16(b.xn.ptr()), h, h))?;
            if rope_in_gemv {
                gpu.timed("gemv_qkv+rope", || {
                    gpu.gemv(
                        (layer.qkv.ptr(), layer.fp8_scales(Proj::Qkv, 0)),
                        GemvInput::Bf16(b.xn.ptr()),
                        b.qkv.ptr(),
                        qw + 2 * kvw,
                        t,
                        h,
                        rope,
                        epi.as_ref(),
                    )
                })?;
            } else {
                project(
                    if qkv_o { "gemv_qkv" } else { "gemm_qkv" },
                    qkv_o,
                    layer,
                    Proj::Qkv,
                    Product {
                        w: layer.qkv.ptr(),
                        a: b.xn.ptr(),
                        c: b.qkv.ptr(),
                        m: qw + 2 * kvw,
                        n: t,
                        k: h,
                        beta: 0.0,
                        c_f32: true,
                        fp8: None,
                    },
                    epi,
                )?;
            }
        }
        if let Some(lo) = qkv_after {
            let out = (b.qkv.ptr(), qw + 2 * kvw);
            lo.update(gpu, c, (t, li), qkv_parts, (b.xn.ptr(), h, h), out)?;
        }
        if let Some(qk) = &layer.qk_norm {
            gpu.timed("qk_norm", || {
                gpu.qk_norm(b.qkv.ptr(), t, qk.ptr(), (nh, nkv, hd), c.rms_norm_eps)
            })?;
        }
        if !rope_in_gemv {
            gpu.timed("rope_store_kv", || {
                gpu.rope_store(b.qkv.ptr(), t, &rope_out, kv.scales)
            })?;
        }
        attention(
            gpu,
            &AttentionIo {
                q: b.q.ptr(),
                kv,
                out: b.att.ptr(),
                part_acc: b.part_acc.ptr(),
                part_ml: b.part_ml.ptr(),
                step: &b.step,
            },
            l,
            (nh, nkv, hd),
            block_size,
            c.attention_scale(),
            c.sliding_window,
        )?;
        // The output projection adds onto the residual stream (beta = 1, f32).
        let epi = pre(o_in, li, o_parts, (GemvInput::Bf16(b.att.ptr()), qw, qw))?;
        project(
            if qkv_o { "gemv_o" } else { "gemm_o" },
            qkv_o,
            layer,
            Proj::O,
            Product {
                w: layer.o.ptr(),
                a: b.att.ptr(),
                c: b.x.ptr(),
                m: h,
                n: t,
                k: qw,
                beta: 1.0,
                c_f32: true,
                fp8: None,
            },
            epi,
        )?;
        if let Some(lo) = o_after {
            let x = (b.att.ptr(), qw, qw);
            lo.update(gpu, c, (t, li), o_parts, x, (b.x.ptr(), h))?;
        }
        if fuse_glu {
            // act = silu(gate) * up straight from the product.
            let (input, class) = if fuse_norm {
                (normed(&layer.ffn_norm), "norm+gemv_gate_up+silu")
            } else {
                norm(0, layer.ffn_norm.ptr(), b.xn.ptr(), t)?;
                (GemvInput::Bf16(b.xn.ptr()), "gemv_gate_up+silu")
            };
            let epi = pre(gu_in, li, gu_parts, (input, h, h))?;
            gpu.timed(class, || {
                gpu.gemv(
                    (layer.gate_up.ptr(), layer.fp8_scales(Proj::GateUp, 0)),
                    input,
                    b.act.ptr(),
                    inter,
                    t,
                    h,
                    GemvOutput::Glu,
                    epi.as_ref(),
                )
            })?;
        } else {
            norm(0, layer.ffn_norm.ptr(), b.xn.ptr(), t)?;
            project(
                if small {
                    "gemv_gate_up"
                } else {
                    "gemm_gate_up"
                },
                small,
                layer,
                Proj::GateUp,
                Product {
                    w: layer.gate_up.ptr(),
                    a: b.xn.ptr(),
                    c: b.gu.ptr(),
                    m: 2 * inter,
                    n: t,
                    k: h,
                    beta: 0.0,
                    c_f32: false,
                    fp8: None,
                },
                None,
            )?;
            if let Some(lo) = gu_after {
                // The gate's and up's `u`, then both updates inside SiLU x up.
                let x = (GemvInput::Bf16(b.xn.ptr()), h, h);
                lo.shrink(gpu, c, (t, li), gu_parts.map(|p| p.0), x)?;
                gpu.timed("lora_silu_mul", || {
                    gpu.launch(
                        &k.lora_silu_mul,
                        (inter.div_ceil(256) as u32, t.min(65_535) as u32, 1),
                        256,
                        &[
                            Arg::Ptr(b.gu.ptr()),
                            Arg::Ptr(b.act.ptr()),
                            i32v(inter),
                            Arg::Ptr(lo.u),
                            i32v(3 * lo.max_rank),
                            i32v(lo.max_rank),
                            Arg::Ptr(lo.row_slot),
                            Arg::Ptr(lo.ptrs),
                            Arg::Ptr(lo.ranks),
                            i32v(c.num_layers),
                            i32v(li),
                            i32v(t),
                        ],
                    )
                })?;
            } else {
                let total = t * inter;
                // 8 outputs per thread and a row of blocks per token when inter allows (see the
                // kernel), else a grid-stride loop.
                let grid = if inter % 8 == 0 {
                    ((inter / 8).div_ceil(256) as u32, t.min(65_535) as u32, 1)
                } else {
                    (total.div_ceil(256).min(65_536) as u32, 1, 1)
                };
                gpu.timed("silu_mul", || {
                    gpu.launch(
                        &k.silu_mul,
                        grid,
                        256,
                        &[
                            Arg::Ptr(b.gu.ptr()),
                            Arg::Ptr(b.act.ptr()),
                            i32v(inter),
                            Arg::U64(total as u64),
                        ],
                    )
                })?;
            }
        }
        let epi = pre(
            down_in,
            li,
            down_parts,
            (GemvInput::Bf16(b.act.ptr()), inter, inter),
        )?;
        project(
            if small { "gemv_down" } else { "gemm_down" },
            small,
            layer,
            Proj::Down,
            Product {
                w: layer.down.ptr(),
                a: b.act.ptr(),
                c: b.x.ptr(),
                m: h,
                n: t,
                k: inter,
                beta: 1.0,
                c_f32: true,
                fp8: None,
            },
            epi,
        )?;
        if let Some(lo) = down_after {
            let x = (b.act.ptr(), inter, inter);
            lo.update(gpu, c, (t, li), down_parts, x, (b.x.ptr(), h))?;
        }
    }
    norm(s(lay.logit_rows)?, w.norm.ptr(), b.xs.ptr(), l.rows)?;
    let head_gemv =
        model_gemv && gpu.gemv_lm_head(h) && gpu.gemv_fits(l.rows, h, &[w.lm_head(), b.xs.ptr()]);
    gpu.timed(
        if head_gemv {
            "gemv_lm_head"
        } else {
            "gemm_lm_head"
        },
        || {
            gpu.gemm_with(
                head_gemv,
                Product {
                    w: w.lm_head(),
                    a: b.xs.ptr(),
                    c: b.logits.ptr(),
                    m: c.vocab_size,
                    n: l.rows,
                    k: h,
                    beta: 0.0,
                    c_f32: true,
                    fp8: None,
                },
            )
        },
    )
}

/// Where one layer's attention reads and writes.
pub(crate) struct AttentionIo<'a> {
    pub q: u64,
    pub kv: KvLayer,
    pub out: u64,
    pub part_acc: u64,
    pub part_ml: u64,
    /// The step buffer (positions, tiles, block tables, meta at `l.layout`).
    pub step: &'a DevMem,
}

/// Decode steps of at most this many sequences let attention ask for its first keys before
/// the QKV product ends ([`Launch::early_kv`]). Small steps' attention is a chain of latencies
/// that this shortens (batch 1: Llama-3-8B 4.54 against 4.61 ms, SmolLM2 0.63 against 0.69,
/// CUDA_NOTES v7); in large ones the blocks that start early are a small part of the grid, and
/// batch 8 measured the same either way.
pub(crate) const EARLY_KV_MAX_TOKENS: usize = 8;

/// One layer's paged attention: the one-warp kernel over the small tiles and the four-warp
/// kernel over the others, each split `z` ways along the keys, then the combine step when
/// `z > 1`. `scale` multiplies the logits (`LlamaConfig::attention_scale`); `window`, a
/// sliding window (`LlamaConfig::sliding_window`).
pub(crate) fn attention(
    gpu: &Gpu,
    io: &AttentionIo,
    l: &Launch,
    (nh, nkv, hd): (usize, usize, usize),
    block_size: usize,
    scale: f32,
    window: Option<usize>,
) -> Result<(), GpuError> {
    let k = &gpu.k;
    let which = super::device::attention_kernel_index(hd).ok_or_else(|| {
        GpuError::InvalidConfig(format!(
            "the CUDA backend runs head dimensions {:?}, not {hd}",
            super::device::ATTENTION_HEAD_DIMS
        ))
    })?;
    let lay = &l.layout;
    let s = |off: usize| io.step.at(off);
    let i32v = |v: usize| Arg::I32(v as i32);
    let (w1, w4, (ks, vs)) = match io.kv.scales {
        Some(scales) => (&k.attention_w1_f8, &k.attention_w4_f8, scales),
        None => (&k.attention_w1, &k.attention_w4, (0, 0)),
    };
    let parts = [
        (&w1[which], 0, l.small_tiles, 32),
        (&w4[which], l.small_tiles, l.tiles - l.small_tiles, 128),
    ];
    for (kernel, first, tiles, threads) in parts {
        if tiles == 0 {
            continue;
        }
        let grid = if gpu.att_heads_inner {
            ((tiles * nkv) as u32, 1, l.z as u32)
        } else {
            (tiles as u32, nkv as u32, l.z as u32)
        };
        gpu.timed("attention", || {
            gpu.launch(
                kernel,
                grid,
                threads,
                &[
                    Arg::Ptr(io.q),
                    Arg::Ptr(io.kv.k),
                    Arg::Ptr(io.kv.v),
                    Arg::Ptr(ks),
                    Arg::Ptr(vs),
                    Arg::Ptr(s(lay.pos)?),
                    Arg::Ptr(s(lay.tile_seq)?),
                    Arg::Ptr(s(lay.tile_q0)?),
                    Arg::Ptr(s(lay.tile_qn)?),
                    Arg::Ptr(s(lay.tables)?),
                    Arg::Ptr(s(lay.meta)?),
                    Arg::Ptr(io.part_acc),
                    Arg::Ptr(io.part_ml),
                    Arg::Ptr(io.out),
                    i32v(nh),
                    i32v(nkv),
                    i32v(block_size),
                    Arg::F32(scale),
                    i32v(first),
                    Arg::I32((l.early_kv && gpu.early_kv) as i32),
                    Arg::I32(gpu.att_heads_inner as i32),
                    i32v(window.unwrap_or(0)),
                ],
            )
        })?;
    }
    if l.z > 1 && l.tiles > 0 {
        gpu.timed("attention_combine", || {
            gpu.launch(
                &k.attention_combine,
                (l.tiles as u32, nh as u32, 1),
                hd as u32,
                &[
                    Arg::Ptr(io.part_acc),
                    Arg::Ptr(io.part_ml),
                    Arg::Ptr(s(lay.pos)?),
                    Arg::Ptr(s(lay.tile_q0)?),
                    Arg::Ptr(s(lay.tile_qn)?),
                    Arg::Ptr(s(lay.meta)?),
                    Arg::Ptr(io.out),
                    i32v(nh),
                    i32v(hd),
                    i32v(l.z),
                    i32v(window.unwrap_or(0)),
                ],
            )
        })?;
    }
    Ok(())
}

/// A captured graph, movable to the executor thread.
struct SendGraph(CudaGraph);

// SAFETY: CUDA graph and graph-exec handles are plain driver handles usable from any thread
// whose current context is theirs (the backend binds its context before every use); the
// backend owns them exclusively and uses them from one thread at a time (`&mut self`).
unsafe impl Send for SendGraph {}

/// A graph's key: bucket size, tokens per sequence and, for steps with LoRA adapters, the
/// projections they adapt (`LoraStep::targets`: the launch sequence depends on them).
type GraphKey = (usize, usize, Option<u8>);

/// Captured graphs by [`GraphKey`]: decode steps
/// (one token per sequence) and speculative decoding's verify steps (a token and its drafts,
/// at most `per_seq`, per sequence), for base-model steps and decode steps with LoRA adapters
/// (whose table and scratch sit at fixed addresses: `DeviceLoras`).
#[derive(Default)]
pub(crate) struct Graphs {
    graphs: HashMap<GraphKey, SendGraph>,
    /// Graphs whose capture failed (run eagerly from then on).
    failed: Vec<GraphKey>,
}

/// The launch shape of the graph of `bucket` sequences of at most `per_seq` tokens each, all
/// sampled at every token: one tile per sequence (`per_seq` at most the tile's tokens), as
/// [`super::step::flatten`] makes them for decodes (`per_seq` 1) and verify steps. A step with
/// fewer sequences or tokens runs in it padded: tokens without a KV slot, empty tiles.
pub(crate) fn bucket_launch(
    bucket: usize,
    per_seq: usize,
    c: &LlamaConfig,
    max_splits: usize,
) -> Launch {
    let group = c.num_heads / c.num_kv_heads;
    let tokens = bucket * per_seq;
    Launch {
        tokens,
        tiles: bucket,
        small_tiles: if group * per_seq <= ATT_SMALL_ROWS {
            one_warp_tiles(bucket, c.num_kv_heads)
        } else {
            0
        },
        rows: tokens,
        z: grid_splits(bucket, c.num_kv_heads, max_splits),
        // A verify step's queries attend to keys of this step (the earlier drafts).
        early_kv: per_seq == 1 && bucket <= EARLY_KV_MAX_TOKENS,
        layout: Layout::new(tokens, bucket, tokens, tokens),
    }
}

/// The smallest bucket holding `n` sequences.
pub(crate) fn bucket_for(n: usize, max: usize) -> Option<usize> {
    GRAPH_BUCKETS.iter().copied().find(|&b| b >= n && b <= max)
}

impl Graphs {
    /// Replays the graph of `bucket` (with `lora`'s table, which a LoRA step's graph reads at
    /// the same addresses every time), capturing it first if needed. Returns false when the
    /// bucket cannot be captured (the caller runs the step eagerly).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        gpu: &Gpu,
        c: &LlamaConfig,
        w: &GpuWeights,
        b: &Buffers,
        block_size: usize,
        bucket: usize,
        per_seq: usize,
        lora: Option<&LoraStep>,
    ) -> Result<bool, GpuError> {
        let key = (bucket, per_seq, lora.map(|l| l.targets));
        if self.failed.contains(&key) {
            return Ok(false);
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = self.graphs.entry(key) {
            let l = bucket_launch(bucket, per_seq, c, gpu.att_max_splits);
            gpu.stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| cuda_err("begin capture", e))?;
            let enq = enqueue(gpu, c, w, b, block_size, &l, lora);
            let end = gpu.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            match (enq, end) {
                (Ok(()), Ok(Some(g))) => {
                    tracing::debug!(bucket, per_seq, lora = ?key.2, "captured a graph");
                    slot.insert(SendGraph(g));
                }
                (enq, end) => {
                    tracing::warn!(
                        bucket,
                        enqueue = ?enq.err(),
                        capture = ?end.err(),
                        "CUDA graph capture failed; this bucket runs without a graph"
                    );
                    self.failed.push(key);
                    return Ok(false);
                }
            }
        }
        match self.graphs.get(&key) {
            Some(g) => {
                g.0.launch().map_err(|e| cuda_err("graph launch", e))?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Number of captured graphs.
    pub fn len(&self) -> usize {
        self.graphs.len()
    }

    /// Number of captured graphs of steps with LoRA adapters.
    pub fn lora_len(&self) -> usize {
        self.graphs.keys().filter(|k| k.2.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every part of the cache starts where the attention kernels' 16-byte copies may read it
    /// (odd slot counts and head counts included: SmolLM2 has 3 KV heads), the scales sit after
    /// the values they scale, and the padding stays within what `kv_block_bytes` leaves out.
    #[test]
    fn cache_parts_are_aligned_and_sized_for_any_slot_count() {
        for c in [LlamaConfig::smollm2_135m(), LlamaConfig::llama3_8b()] {
            let (nkv, hd) = (c.num_kv_heads, c.head_dim);
            for slots in [1usize, 2, 3, 5, 6, 16, 17, 1000, 12_345] {
                for fp8 in [false, true] {
                    let (scales_at, part) = kv_part_layout(&c, slots, fp8);
                    let layer_pair = 2 * part;
                    assert_eq!(
                        part % 256,
                        0,
                        "{slots} slots, fp8 {fp8}: part of {part} bytes"
                    );
                    let data = slots * nkv * hd * if fp8 { 1 } else { 2 };
                    assert!(scales_at >= data && scales_at % 256 == 0);
                    if fp8 {
                        assert!(part >= scales_at + slots * nkv * 4);
                    }
                    // At most 256 bytes of padding per part (two with fp8), per layer's pair.
                    let unpadded = 2 * slots * kv_slot_bytes(&c, fp8);
                    let pad = layer_pair - unpadded;
                    assert!(pad < if fp8 { 1024 } else { 512 }, "{pad} bytes of padding");
                }
            }
            // The per-block size the cache is budgeted by counts the scales.
            assert_eq!(
                kv_block_bytes(&c, 16, true),
                2 * c.num_layers * 16 * nkv * (hd + 4)
            );
            assert_eq!(
                kv_block_bytes(&c, 16, false),
                2 * c.num_layers * 16 * nkv * hd * 2
            );
        }
    }
}
