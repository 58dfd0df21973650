//! The Llama forward pass (Touvron et al. 2023; Llama 3 RoPE scaling) for one batch that mixes
//! prefill chunks and decode tokens of different sequences: the tokens are flattened, every
//! token carries its position and sequence, keys and values go to the paged KV cache at the
//! slots named by the sequence's block table, and logits are computed only for the rows asked
//! for. The projections of a layer that read the same input run as one parallel matrix
//! multiply (Q|K|V and gate|up), so a step costs 4 parallel regions per layer.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::attention::{attention, AttentionBatch, QueryPos};
use super::kv_cache::KvCache;
use super::matmul::{linear, Isa};
use super::ops::{rms_norm, rms_norm_in_place, swiglu, Rope};
use super::quant::{QActs, Weight};
use crate::error::GpuError;
use crate::lora::{add_deltas, LoraAdapter, LoraTarget};
use crate::model::{DType, LlamaConfig, ModelWeights};

/// The weights of one transformer block.
struct Layer {
    attn_norm: Vec<f32>,
    q: Weight,
    k: Weight,
    v: Weight,
    o: Weight,
    ffn_norm: Vec<f32>,
    gate: Weight,
    up: Weight,
    down: Weight,
    /// Q, K and V biases side by side (Qwen2), as one QKV row.
    qkv_bias: Option<Vec<f32>>,
    /// The query and the key heads' norm weights (Qwen3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
}

/// How precisely the activations entering the quantized matrix multiplies are represented.
///
/// Measured on the golden fixture (SmolLM2 Q4_1, teacher-forced against transformers in
/// `f32` over 288 positions): with the AVX-512 kernels `Int8` agrees on the top token at 98.3%
/// of positions (mean |logprob error| 0.029 nats), `Mixed` at 100% (0.016), `Precise` at 100%
/// (0.0003). `Mixed` sits close to the 99% bar, so the kernels' summation order decides: the
/// scalar kernels agree at 99.3% (0.015), the AVX2 kernels at 98.96% (0.019), below it; with
/// `Precise` the AVX2 kernels agree at 100% (0.0004). The default is therefore per
/// instruction set ([`ActivationPrecision::default_for`]). With `Int8`, the errors concentrate
/// in the Q/K/V projections (normalised inputs with outlier channels) and the FFN down
/// projection (SwiGLU outputs with a heavy tail).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ActivationPrecision {
    /// int8 per 32-value block everywhere (llama.cpp's choice): fastest.
    Int8,
    /// Two-level int8 (about 15 bits) for the Q/K/V and down projections, int8 elsewhere:
    /// about a third more multiply work than `Int8`.
    Mixed,
    /// Two-level int8 for every projection: close to `f32`, about twice the multiply work.
    Precise,
}

impl ActivationPrecision {
    /// The fastest precision that meets the golden test's 99% top-1 bar with `isa`'s kernels
    /// (measurements above): `Mixed`, except `Precise` with the AVX2 kernels.
    pub fn default_for(isa: Isa) -> Self {
        match isa {
            Isa::Avx2 => ActivationPrecision::Precise,
            Isa::Scalar | Isa::Avx512Vnni => ActivationPrecision::Mixed,
        }
    }
}

impl Default for ActivationPrecision {
    /// [`ActivationPrecision::default_for`] this machine's kernels ([`Isa::detect`]).
    fn default() -> Self {
        Self::default_for(Isa::detect())
    }
}

/// A Llama-family model ready to run on the CPU (weights repacked for the kernels).
pub struct LlamaModel {
    /// Architecture.
    pub config: LlamaConfig,
    embed: Weight,
    lm_head: Option<Weight>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: Rope,
    isa: Isa,
    precision: ActivationPrecision,
}

/// The flattened tokens of one step.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    /// Token ids, all sequences' tokens one after the other.
    pub tokens: &'a [u32],
    /// Position and sequence of each token.
    pub queries: &'a [QueryPos],
    /// Block table of each sequence.
    pub tables: &'a [&'a [u32]],
    /// LoRA adapter of each sequence (empty: none anywhere).
    pub adapters: &'a [Option<&'a LoraAdapter>],
}

fn vector(weights: &ModelWeights, name: &str, len: usize) -> Result<Vec<f32>, GpuError> {
    let t = weights.get(name)?;
    if t.num_elements() != len || t.dtype.is_quantized() {
        return Err(GpuError::BadTensor {
            tensor: name.into(),
            reason: format!("expected {len} float values, got {:?} {}", t.shape, t.dtype),
        });
    }
    Ok(t.to_f32_vec())
}

fn matrix(
    weights: &ModelWeights,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Weight, GpuError> {
    let t = weights.get(name)?;
    if t.shape != [rows, cols] {
        return Err(GpuError::BadTensor {
            tensor: name.into(),
            reason: format!("expected shape [{rows}, {cols}], got {:?}", t.shape),
        });
    }
    Weight::from_view(name, &t)
}

impl LlamaModel {
    /// Builds the model from its tensors (canonical GGUF names), checking every shape.
    pub fn from_weights(config: &LlamaConfig, weights: &ModelWeights) -> Result<Self, GpuError> {
        config.validate()?;
        let c = config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        if c.num_kv_heads == 0
            || !c.num_heads.is_multiple_of(c.num_kv_heads)
            || !hd.is_multiple_of(2)
        {
            return Err(GpuError::InvalidConfig(format!(
                "{} heads, {} KV heads, head dimension {hd}",
                c.num_heads, c.num_kv_heads
            )));
        }
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(weights, &n("attn_norm"), h)?,
                q: matrix(weights, &n("attn_q"), c.num_heads * hd, h)?,
                k: matrix(weights, &n("attn_k"), c.num_kv_heads * hd, h)?,
                v: matrix(weights, &n("attn_v"), c.num_kv_heads * hd, h)?,
                o: matrix(weights, &n("attn_output"), h, c.num_heads * hd)?,
                ffn_norm: vector(weights, &n("ffn_norm"), h)?,
                gate: matrix(weights, &n("ffn_gate"), c.intermediate_size, h)?,
                up: matrix(weights, &n("ffn_up"), c.intermediate_size, h)?,
                down: matrix(weights, &n("ffn_down"), h, c.intermediate_size)?,
                qkv_bias: if c.qkv_bias {
                    let b =
                        |s: &str, len: usize| vector(weights, &format!("blk.{i}.{s}.bias"), len);
                    let mut bias = b("attn_q", c.num_heads * hd)?;
                    bias.extend(b("attn_k", c.num_kv_heads * hd)?);
                    bias.extend(b("attn_v", c.num_kv_heads * hd)?);
                    Some(bias)
                } else {
                    None
                },
                qk_norm: if c.qk_norm {
                    Some((
                        vector(weights, &n("attn_q_norm"), hd)?,
                        vector(weights, &n("attn_k_norm"), hd)?,
                    ))
                } else {
                    None
                },
            });
        }
        let embed = matrix(weights, "token_embd.weight", c.vocab_size, h)?;
        let lm_head = if weights.contains("output.weight") {
            Some(matrix(weights, "output.weight", c.vocab_size, h)?)
        } else if c.tie_word_embeddings {
            None
        } else {
            return Err(GpuError::TensorNotFound("output.weight".into()));
        };
        Ok(LlamaModel {
            config: c.clone(),
            embed,
            lm_head,
            norm: vector(weights, "output_norm.weight", h)?,
            layers,
            rope: Rope::new(c),
            isa: Isa::detect(),
            precision: ActivationPrecision::default(),
        })
    }

    /// Random weights of the shape of `config` (Q4_1 projections, Q8_0 embeddings as in the
    /// SmolLM2 GGUF, unit norms), reproducible from `seed`; for benchmarks and shape tests.
    pub fn dummy(config: &LlamaConfig, seed: u64) -> Result<Self, GpuError> {
        Self::from_weights(config, &dummy_weights(config, seed)?)
    }

    /// Forces an instruction set (tests compare them); fails if the CPU lacks it.
    pub fn set_isa(&mut self, isa: Isa) -> Result<(), GpuError> {
        if !isa.is_supported() {
            return Err(GpuError::InvalidConfig(format!(
                "this CPU cannot run {isa:?} kernels"
            )));
        }
        self.isa = isa;
        Ok(())
    }

    /// Sets the activation precision.
    pub fn set_precision(&mut self, precision: ActivationPrecision) {
        self.precision = precision;
    }

    /// The activation precision.
    pub fn precision(&self) -> ActivationPrecision {
        self.precision
    }

    /// The instruction set the kernels use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Bytes of weights held (after repacking).
    pub fn weight_bytes(&self) -> usize {
        let w = |w: &Weight| match w {
            Weight::Quant(q) => q.bytes(),
            Weight::Float(f) => f.w.len() * 4,
        };
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                    .iter()
                    .map(|x| w(x))
                    .sum::<usize>()
            })
            .sum();
        layers + w(&self.embed) + self.lm_head.as_ref().map_or(0, w)
    }

    /// Checks that every token is in the vocabulary and every position has a valid cache slot.
    fn validate(&self, cache: &KvCache, step: &StepInput<'_>) -> Result<(), GpuError> {
        let bad = |m: String| Err(GpuError::BadBatch(m));
        if step.tokens.len() != step.queries.len() {
            return bad("tokens and positions differ in length".into());
        }
        if let Some(&t) = step
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return bad(format!(
                "token {t} is outside the vocabulary ({})",
                self.config.vocab_size
            ));
        }
        for q in step.queries {
            let Some(table) = step.tables.get(q.seq) else {
                return bad(format!("no block table for sequence {}", q.seq));
            };
            if q.pos >= self.config.max_position_embeddings {
                return bad(format!("position {} exceeds the context window", q.pos));
            }
            let need = q.pos / cache.block_size + 1;
            if table.len() < need {
                return bad(format!(
                    "block table of {} blocks cannot hold position {}",
                    table.len(),
                    q.pos
                ));
            }
            if let Some(&b) = table[..need]
                .iter()
                .find(|&&b| b as usize >= cache.num_blocks)
            {
                return bad(format!(
                    "block id {b} out of range (cache has {})",
                    cache.num_blocks
                ));
            }
        }
        Ok(())
    }

    /// Runs one step: writes the keys and values of every token into `cache` and returns the
    /// logits (`logit_rows.len() * vocab_size`) of the flattened tokens `logit_rows`.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        step: &StepInput<'_>,
        logit_rows: &[usize],
    ) -> Result<Vec<f32>, GpuError> {
        self.forward_rows(cache, step, logit_rows)
            .map(|(logits, _)| logits)
    }

    /// [`LlamaModel::forward`], also returning the final hidden states of the rows
    /// (`logit_rows.len() * hidden_size`, after the last normalization: what the LM head
    /// multiplies, and what embeddings are made of).
    pub fn forward_rows(
        &self,
        cache: &mut KvCache,
        step: &StepInput<'_>,
        logit_rows: &[usize],
    ) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
        self.validate(cache, step)?;
        let c = &self.config;
        if cache.layers != c.num_layers
            || cache.kv_heads != c.num_kv_heads
            || cache.head_dim != c.head_dim
        {
            return Err(GpuError::Internal(
                "KV cache shape does not match the model".into(),
            ));
        }
        if let Some(&r) = logit_rows.iter().find(|&&r| r >= step.tokens.len()) {
            return Err(GpuError::Internal(format!("logit row {r} out of range")));
        }
        let t = step.tokens.len();
        let (h, hd, isa) = (c.hidden_size, c.head_dim, self.isa);
        let (qw, kvw, inter) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
        let qkv_w = qw + 2 * kvw;
        let mut x = vec![0f32; t * h];
        for (row, &tok) in x.chunks_exact_mut(h).zip(step.tokens) {
            self.embed.row_f32(tok as usize, row);
        }
        let mut cs = vec![0f32; t * hd];
        for (q, row) in step.queries.iter().zip(cs.chunks_exact_mut(hd)) {
            self.rope.table(q.pos, row);
        }
        let mut xn = vec![0f32; t * h];
        let mut xq = QActs::default();
        let mut ps = PreciseScratch::default();
        let mut qkv = vec![0f32; t * qkv_w];
        let mut qbuf = vec![0f32; t * qw];
        let mut att = vec![0f32; t * qw];
        let mut tmp = vec![0f32; t * h];
        let mut gu = vec![0f32; t * 2 * inter];
        let mut act = vec![0f32; t * inter];
        let batch = AttentionBatch {
            queries: step.queries,
            tables: step.tables,
            num_heads: c.num_heads,
            window: c.sliding_window,
        };
        // Each token's adapter (empty when the step has none).
        let row_adapter: Vec<Option<&LoraAdapter>> = if step.adapters.iter().any(|a| a.is_some()) {
            step.queries
                .iter()
                .map(|q| step.adapters.get(q.seq).copied().flatten())
                .collect()
        } else {
            Vec::new()
        };
        // With `Mixed`, the rows of sequences with an adapter take the two-level activations in
        // every projection (see `MixedProjector`); other rows are unaffected.
        let proj = MixedProjector {
            precision: self.precision,
            precise_rows: if self.precision == ActivationPrecision::Mixed {
                row_adapter.iter().map(|a| a.is_some()).collect()
            } else {
                Vec::new()
            },
        };
        let lora_qkv = [
            (LoraTarget::Q, 0, qw),
            (LoraTarget::K, qw, kvw),
            (LoraTarget::V, qw + kvw, kvw),
        ];
        let lora_gu = [(LoraTarget::Gate, 0, inter), (LoraTarget::Up, inter, inter)];
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&x, &l.attn_norm, c.rms_norm_eps, &mut xn);
            // Each projection quantizes its input only in the form it uses.
            if self.precision != ActivationPrecision::Int8 {
                precise_linear(&[&l.q, &l.k, &l.v], &xn, t, &mut qkv, isa, &mut ps)?;
            } else {
                xq.quantize_into(&xn, t, h);
                linear(&[&l.q, &l.k, &l.v], &xn, &xq, t, &mut qkv, isa)?;
            }
            add_deltas(li, &lora_qkv, &xn, h, &mut qkv, &row_adapter);
            for (i, row) in qkv.chunks_exact_mut(qkv_w).enumerate() {
                let q = step.queries[i];
                if let Some(bias) = &l.qkv_bias {
                    row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
                }
                let (qpart, rest) = row.split_at_mut(qw);
                let (kpart, vpart) = rest.split_at_mut(kvw);
                if let Some((qn, kn)) = &l.qk_norm {
                    rms_norm_in_place(qpart, qn, c.rms_norm_eps);
                    rms_norm_in_place(kpart, kn, c.rms_norm_eps);
                }
                self.rope.apply(qpart, &cs[i * hd..(i + 1) * hd]);
                self.rope.apply(kpart, &cs[i * hd..(i + 1) * hd]);
                let table = step.tables[q.seq];
                let block = table[q.pos / cache.block_size] as usize;
                cache.write(li, block, q.pos % cache.block_size, kpart, vpart);
                qbuf[i * qw..(i + 1) * qw].copy_from_slice(qpart);
            }
            attention(li, &qbuf, cache, &batch, &mut att, isa);
            proj.linear(&[&l.o], &att, None, &mut tmp, isa, &mut xq, &mut ps)?;
            add_deltas(
                li,
                &[(LoraTarget::O, 0, h)],
                &att,
                qw,
                &mut tmp,
                &row_adapter,
            );
            x.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
            rms_norm(&x, &l.ffn_norm, c.rms_norm_eps, &mut xn);
            proj.linear(&[&l.gate, &l.up], &xn, None, &mut gu, isa, &mut xq, &mut ps)?;
            add_deltas(li, &lora_gu, &xn, h, &mut gu, &row_adapter);
            swiglu(&gu, inter, &mut act);
            if self.precision != ActivationPrecision::Int8 {
                precise_linear(&[&l.down], &act, t, &mut tmp, isa, &mut ps)?;
            } else {
                xq.quantize_into(&act, t, inter);
                linear(&[&l.down], &act, &xq, t, &mut tmp, isa)?;
            }
            add_deltas(
                li,
                &[(LoraTarget::Down, 0, h)],
                &act,
                inter,
                &mut tmp,
                &row_adapter,
            );
            x.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
        }
        let r = logit_rows.len();
        let mut sel = Vec::with_capacity(r * h);
        for &i in logit_rows {
            sel.extend_from_slice(&x[i * h..(i + 1) * h]);
        }
        let mut normed = vec![0f32; r * h];
        rms_norm(&sel, &self.norm, c.rms_norm_eps, &mut normed);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut logits = vec![0f32; r * c.vocab_size];
        proj.linear(
            &[head],
            &normed,
            Some(logit_rows),
            &mut logits,
            isa,
            &mut xq,
            &mut ps,
        )?;
        Ok((logits, normed))
    }
}

/// Scratch buffers of [`precise_linear`] and [`MixedProjector`].
#[derive(Default)]
struct PreciseScratch {
    acts: QActs,
    x2: Vec<f32>,
    out2: Vec<f32>,
    /// The rows of one precision gathered, and their outputs.
    xs: Vec<f32>,
    outs: Vec<f32>,
}

/// The projections that `Mixed` runs on int8 activations (O, gate|up, the LM head; Q/K/V and
/// down always take two-level ones), each row at its own precision: the rows in `precise_rows`
/// (tokens of sequences with a LoRA adapter) take the two-level activations, so an adapter's
/// outputs follow the reference as closely as `Precise` (teacher-forced on the test adapter:
/// 100% top-1 against 97.5% with int8 there; tests/forward_golden.rs), at no cost to the other
/// rows. A row's result depends only on its own inputs and precision, so a sequence computes
/// the same bits alone or beside others.
struct MixedProjector {
    precision: ActivationPrecision,
    /// Per token of the step; empty when no row is precise beyond `precision`.
    precise_rows: Vec<bool>,
}

impl MixedProjector {
    /// `out = parts . x` for the rows of `x` (`rows[i]` is row i's token; None: row i is token
    /// i), at `Precise` for every row with `Precise`, for none with `Int8`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        parts: &[&Weight],
        x: &[f32],
        rows: Option<&[usize]>,
        out: &mut [f32],
        isa: Isa,
        xq: &mut QActs,
        s: &mut PreciseScratch,
    ) -> Result<(), GpuError> {
        let cols = parts.first().map_or(0, |w| w.cols());
        let t = x.len().checked_div(cols).unwrap_or(0);
        let precise = |i: usize| {
            let tok = rows.map_or(i, |r| r[i]);
            self.precise_rows.get(tok).copied().unwrap_or(false)
        };
        let n_precise = (0..t).filter(|&i| precise(i)).count();
        if self.precision == ActivationPrecision::Precise || (n_precise == t && t > 0) {
            return precise_linear(parts, x, t, out, isa, s);
        }
        if n_precise == 0 {
            xq.quantize_into(x, t, cols);
            return linear(parts, x, xq, t, out, isa);
        }
        let width = out.len() / t;
        for want in [true, false] {
            let sel: Vec<usize> = (0..t).filter(|&i| precise(i) == want).collect();
            s.xs.clear();
            for &i in &sel {
                s.xs.extend_from_slice(&x[i * cols..(i + 1) * cols]);
            }
            let mut outs = std::mem::take(&mut s.outs);
            outs.clear();
            outs.resize(sel.len() * width, 0.0);
            let xs = std::mem::take(&mut s.xs);
            let r = if want {
                precise_linear(parts, &xs, sel.len(), &mut outs, isa, s)
            } else {
                xq.quantize_into(&xs, sel.len(), cols);
                linear(parts, &xs, xq, sel.len(), &mut outs, isa)
            };
            s.xs = xs;
            r?;
            for (&i, o) in sel.iter().zip(outs.chunks_exact(width)) {
                out[i * width..(i + 1) * width].copy_from_slice(o);
            }
            s.outs = outs;
        }
        Ok(())
    }
}

/// `linear` with two-level int8 activations (see [`QActs::quantize_residual_into`]).
fn precise_linear(
    parts: &[&Weight],
    x: &[f32],
    t: usize,
    out: &mut [f32],
    isa: Isa,
    s: &mut PreciseScratch,
) -> Result<(), GpuError> {
    let cols = parts.first().map_or(0, |w| w.cols());
    let rows = out.len() / t.max(1);
    s.acts.quantize_residual_into(x, t, cols, &mut s.x2);
    s.out2.clear();
    s.out2.resize(2 * t * rows, 0.0);
    linear(parts, &s.x2, &s.acts, 2 * t, &mut s.out2, isa)?;
    for (o, pair) in out
        .chunks_exact_mut(rows)
        .zip(s.out2.chunks_exact(2 * rows))
    {
        let (a, b) = pair.split_at(rows);
        for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
            *o = a + b;
        }
    }
    Ok(())
}

/// Random tensors for [`LlamaModel::dummy`].
pub fn dummy_weights(c: &LlamaConfig, seed: u64) -> Result<ModelWeights, GpuError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut bias_rng = ChaCha8Rng::seed_from_u64(seed ^ 0xb1a5);
    let mut norm_rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9a05);
    let mut w = ModelWeights::new();
    let mut quant = |w: &mut ModelWeights, name: String, rows: usize, cols: usize, dtype: DType| {
        let blocks = rows * (cols / 32);
        let bb = dtype.block_bytes();
        let mut data = vec![0u8; blocks * bb];
        rng.fill_bytes(&mut data);
        // Scales giving values of standard deviation ~ 1/sqrt(cols); offsets centre them.
        let d = if dtype == DType::Q8_0 {
            1.0 / 73.0
        } else {
            1.0 / 4.6
        } / (cols as f32).sqrt();
        for b in data.chunks_exact_mut(bb) {
            b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            if dtype == DType::Q4_1 {
                b[2..4].copy_from_slice(&half::f16::from_f32(-7.5 * d).to_le_bytes());
            }
        }
        w.insert_owned(name, dtype, vec![rows, cols], data)
    };
    let ones = |n: usize| (0..n).flat_map(|_| 1f32.to_le_bytes()).collect::<Vec<u8>>();
    let (h, hd) = (c.hidden_size, c.head_dim);
    quant(
        &mut w,
        "token_embd.weight".into(),
        c.vocab_size,
        h,
        DType::Q8_0,
    )?;
    if !c.tie_word_embeddings {
        quant(&mut w, "output.weight".into(), c.vocab_size, h, DType::Q8_0)?;
    }
    w.insert_owned("output_norm.weight", DType::F32, vec![h], ones(h))?;
    for i in 0..c.num_layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        w.insert_owned(n("attn_norm"), DType::F32, vec![h], ones(h))?;
        w.insert_owned(n("ffn_norm"), DType::F32, vec![h], ones(h))?;
        quant(&mut w, n("attn_q"), c.num_heads * hd, h, DType::Q4_1)?;
        quant(&mut w, n("attn_k"), c.num_kv_heads * hd, h, DType::Q4_1)?;
        quant(&mut w, n("attn_v"), c.num_kv_heads * hd, h, DType::Q4_1)?;
        quant(&mut w, n("attn_output"), h, c.num_heads * hd, DType::Q4_1)?;
        quant(&mut w, n("ffn_gate"), c.intermediate_size, h, DType::Q4_1)?;
        quant(&mut w, n("ffn_up"), c.intermediate_size, h, DType::Q4_1)?;
        quant(&mut w, n("ffn_down"), h, c.intermediate_size, DType::Q4_1)?;
        if c.qkv_bias {
            for (name, len) in [
                ("attn_q", c.num_heads * hd),
                ("attn_k", c.num_kv_heads * hd),
                ("attn_v", c.num_kv_heads * hd),
            ] {
                let bias = (0..len)
                    .flat_map(|_| {
                        (bias_rng.next_u32() as f32 / u32::MAX as f32 - 0.5).to_le_bytes()
                    })
                    .collect();
                w.insert_owned(format!("blk.{i}.{name}.bias"), DType::F32, vec![len], bias)?;
            }
        }
        if c.qk_norm {
            // Weights in [0.5, 1.5): each dimension scaled its own way, so the order of a
            // head's dimensions shows.
            for name in ["attn_q_norm", "attn_k_norm"] {
                let weight = (0..hd)
                    .flat_map(|_| {
                        (0.5 + norm_rng.next_u32() as f32 / u32::MAX as f32).to_le_bytes()
                    })
                    .collect();
                w.insert_owned(n(name), DType::F32, vec![hd], weight)?;
            }
        }
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank-2 adapter on every projection with values of about 0.1.
    fn adapter(c: &LlamaConfig) -> LoraAdapter {
        let mut k = 0u32;
        let mut vals = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    k += 1;
                    (k as f32 * 0.61).sin() * 0.1
                })
                .collect()
        };
        let pairs = (0..c.num_layers)
            .map(|_| {
                LoraTarget::ALL
                    .iter()
                    .map(|&t| {
                        let (din, dout) = t.dims(c);
                        (t, vals(2 * din), vals(dout * 2))
                    })
                    .collect()
            })
            .collect();
        LoraAdapter::from_pairs(c, 2, 2.0, pairs).expect("adapter")
    }

    /// The logits of every token of `seqs` (prompt, adapter), run as one step.
    fn logits(model: &LlamaModel, seqs: &[(Vec<u32>, Option<&LoraAdapter>)]) -> Vec<Vec<f32>> {
        let c = &model.config;
        let block = 16;
        let per_seq = seqs
            .iter()
            .map(|s| s.0.len().div_ceil(block))
            .max()
            .unwrap_or(1);
        let mut cache = KvCache::new(
            c.num_layers,
            per_seq * seqs.len(),
            block,
            c.num_kv_heads,
            c.head_dim,
        )
        .expect("cache");
        let tables: Vec<Vec<u32>> = (0..seqs.len())
            .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
            .collect();
        let tables: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
        let mut tokens = Vec::new();
        let mut queries = Vec::new();
        for (seq, (p, _)) in seqs.iter().enumerate() {
            tokens.extend_from_slice(p);
            queries.extend((0..p.len()).map(|pos| QueryPos { pos, seq }));
        }
        let adapters: Vec<Option<&LoraAdapter>> = seqs.iter().map(|s| s.1).collect();
        let step = StepInput {
            tokens: &tokens,
            queries: &queries,
            tables: &tables,
            adapters: &adapters,
        };
        let rows: Vec<usize> = (0..tokens.len()).collect();
        let out = model.forward(&mut cache, &step, &rows).expect("forward");
        out.chunks_exact(c.vocab_size).map(|r| r.to_vec()).collect()
    }

    fn run(
        model: &mut LlamaModel,
        p: ActivationPrecision,
        seqs: &[(Vec<u32>, Option<&LoraAdapter>)],
    ) -> Vec<Vec<f32>> {
        model.set_precision(p);
        logits(model, seqs)
    }

    fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// Under `Mixed`, the tokens of a sequence with an adapter compute what `Precise` computes
    /// for them, the others what `Mixed` computes alone, whatever they are batched with.
    #[test]
    fn mixed_precision_runs_adapter_rows_precisely_and_the_rest_as_mixed() {
        let c = LlamaConfig::tiny();
        let mut model = LlamaModel::dummy(&c, 7).expect("model");
        let a = adapter(&c);
        let p0: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 256).collect();
        let p1: Vec<u32> = (0..13).map(|i| (i * 91 + 2) % 256).collect();
        let batched = run(
            &mut model,
            ActivationPrecision::Mixed,
            &[(p0.clone(), Some(&a)), (p1.clone(), None)],
        );
        let (b0, b1) = batched.split_at(p0.len());
        let precise0 = run(
            &mut model,
            ActivationPrecision::Precise,
            &[(p0.clone(), Some(&a))],
        );
        let mixed0 = run(
            &mut model,
            ActivationPrecision::Mixed,
            &[(p0.clone(), Some(&a))],
        );
        let mixed1 = run(
            &mut model,
            ActivationPrecision::Mixed,
            &[(p1.clone(), None)],
        );
        let precise1 = run(
            &mut model,
            ActivationPrecision::Precise,
            &[(p1.clone(), None)],
        );
        assert!(
            max_diff(b0, &precise0) <= 1e-5,
            "{}",
            max_diff(b0, &precise0)
        );
        assert!(max_diff(&mixed0, &precise0) <= 1e-5);
        assert!(max_diff(b1, &mixed1) <= 1e-5, "{}", max_diff(b1, &mixed1));
        // The precisions differ on this model, so the checks above tell them apart.
        let gap = max_diff(&mixed1, &precise1);
        assert!(gap > 1e-3, "Mixed and Precise differ by only {gap}");
        // `Int8` stays int8 for adapter rows too.
        let int8 = run(&mut model, ActivationPrecision::Int8, &[(p0, Some(&a))]);
        assert!(max_diff(&int8, &precise0) > 1e-3);
    }
}
