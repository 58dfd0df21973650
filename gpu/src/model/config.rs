//! Llama-family model configuration: [`LlamaConfig`], read from GGUF metadata (`llama.*` keys,
//! or `mistral.*`, `qwen2.*`, `qwen3.*`) or from a Hugging Face `config.json`, and presets for
//! dummy weights. Qwen2 (and Qwen2.5) is a Llama with biases on the Q, K and V projections;
//! Qwen3 is a Llama with an RMSNorm over each query and key head before RoPE.
//!
//! Sliding-window attention is not implemented. A model whose every layer attends over a
//! window (Mistral 7B v0.1: 4,096 tokens) has its context capped at the window, where its
//! attention is exactly full causal attention; models that mix windowed and full layers
//! (Qwen2 or Qwen3 with `use_sliding_window`) are refused.
//!
//! RoPE scaling follows Meta's Llama 3.1 "llama3" frequency-dependent scheme (wavelengths longer
//! than `original_max_position_embeddings / low_freq_factor` are divided by `factor`, shorter
//! than `.../high_freq_factor` kept, smoothly interpolated between).

use serde::Deserialize;

use super::gguf::GgufHeader;
use crate::error::GpuError;

/// Which pairs of a head's dimensions RoPE rotates together.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: llama.cpp's converter permutes the Q and K rows of
    /// Llama models, so GGUF files use this.
    Interleaved,
    /// NeoX-style halves `(x[i], x[i + d/2])`: Hugging Face checkpoints.
    Halves,
}

/// Llama 3.1 "llama3" RoPE frequency scaling.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct RopeScaling {
    /// Divisor of low frequencies.
    pub factor: f32,
    /// Wavelength threshold (as a fraction of the original context) above which frequencies
    /// are scaled fully.
    pub low_freq_factor: f32,
    /// Wavelength threshold below which frequencies are kept.
    pub high_freq_factor: f32,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

/// Architecture hyper-parameters of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Number of transformer blocks.
    pub num_layers: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key/value heads (grouped-query attention).
    pub num_kv_heads: usize,
    /// Dimension of one attention head.
    pub head_dim: usize,
    /// Inner width of the SwiGLU feed-forward block.
    pub intermediate_size: usize,
    /// Number of tokens in the vocabulary (rows of the embedding).
    pub vocab_size: usize,
    /// Epsilon of RMSNorm.
    pub rms_norm_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Llama 3 RoPE scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Which dimension pairs RoPE rotates.
    pub rope_style: RopeStyle,
    /// Context window.
    pub max_position_embeddings: usize,
    /// Whether the output projection reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// Whether the Q, K and V projections add a bias (Qwen2).
    pub qkv_bias: bool,
    /// Whether each query and key head is RMS-normalised (a weight per dimension, shared by
    /// the heads) before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
}

/// Upper bounds on hyper-parameters read from files, so a crafted file cannot make the
/// loader or the backend allocate without bound.
const MAX_LAYERS: usize = 1024;
const MAX_WIDTH: usize = 1 << 20;
const MAX_HEADS: usize = 4096;
const MAX_VOCAB: usize = 1 << 22;
const MAX_CONTEXT: usize = 1 << 24;

impl LlamaConfig {
    /// SmolLM2-135M(-Instruct) as shipped in GGUF (interleaved RoPE).
    pub fn smollm2_135m() -> Self {
        LlamaConfig {
            num_layers: 30,
            hidden_size: 576,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            intermediate_size: 1536,
            vocab_size: 49152,
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            rope_scaling: None,
            rope_style: RopeStyle::Interleaved,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            qkv_bias: false,
            qk_norm: false,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        }
    }

    /// Meta Llama 3 8B (Hugging Face layout, halves RoPE).
    pub fn llama3_8b() -> Self {
        LlamaConfig {
            num_layers: 32,
            hidden_size: 4096,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            intermediate_size: 14336,
            vocab_size: 128_256,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: None,
            rope_style: RopeStyle::Halves,
            max_position_embeddings: 8192,
            tie_word_embeddings: false,
            qkv_bias: false,
            qk_norm: false,
            bos_token_id: Some(128_000),
            eos_token_ids: vec![128_001, 128_009],
        }
    }

    /// Qwen2.5-0.5B(-Instruct) (Hugging Face layout: halves RoPE; Q, K and V biases).
    pub fn qwen25_05b() -> Self {
        LlamaConfig {
            num_layers: 24,
            hidden_size: 896,
            num_heads: 14,
            num_kv_heads: 2,
            head_dim: 64,
            intermediate_size: 4864,
            vocab_size: 151_936,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            rope_style: RopeStyle::Halves,
            max_position_embeddings: 32_768,
            tie_word_embeddings: true,
            qkv_bias: true,
            qk_norm: false,
            bos_token_id: Some(151_643),
            eos_token_ids: vec![151_645],
        }
    }

    /// Qwen3-0.6B (Hugging Face layout: halves RoPE; query and key norms; 16 heads of 128
    /// dimensions over a residual stream of 1024).
    pub fn qwen3_06b() -> Self {
        LlamaConfig {
            num_layers: 28,
            hidden_size: 1024,
            num_heads: 16,
            num_kv_heads: 8,
            head_dim: 128,
            intermediate_size: 3072,
            vocab_size: 151_936,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            rope_style: RopeStyle::Halves,
            max_position_embeddings: 40_960,
            tie_word_embeddings: true,
            qkv_bias: false,
            qk_norm: true,
            bos_token_id: Some(151_643),
            eos_token_ids: vec![151_645],
        }
    }

    /// Checks that the values are consistent and within the loader's safety bounds.
    pub fn validate(&self) -> Result<(), GpuError> {
        let bad = |m: String| Err(GpuError::InvalidConfig(m));
        let ranges = [
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("num_heads", self.num_heads, MAX_HEADS),
            ("num_kv_heads", self.num_kv_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_CONTEXT,
            ),
        ];
        for (name, v, max) in ranges {
            if v == 0 || v > max {
                return bad(format!("{name} = {v} is outside 1..={max}"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.qkv_bias && self.qk_norm {
            return bad("Q, K and V biases with query and key norms".into());
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} is odd", self.head_dim));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps {} is not positive",
                self.rms_norm_eps
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad(format!("rope_theta {} is not > 1", self.rope_theta));
        }
        if let Some(s) = &self.rope_scaling {
            let ok = s.factor.is_finite()
                && s.factor >= 1.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor
                && s.high_freq_factor.is_finite()
                && s.original_max_position_embeddings > 0;
            if !ok {
                return bad(format!("invalid rope scaling {s:?}"));
            }
        }
        for id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if *id as usize >= self.vocab_size {
                return bad(format!(
                    "special token id {id} >= vocab_size {}",
                    self.vocab_size
                ));
            }
        }
        Ok(())
    }

    /// Reads a Hugging Face `config.json` (Llama / Mistral / SmolLM2 / Qwen2 / Qwen3
    /// architectures).
    pub fn from_hf_json(json: &str) -> Result<Self, GpuError> {
        let c: HfConfig = serde_json::from_str(json)
            .map_err(|e| GpuError::InvalidConfig(format!("config.json: {e}")))?;
        let (qwen2, qwen3) = match c.model_type.as_deref() {
            None | Some("llama" | "mistral") => (false, false),
            Some("qwen2") => (true, false),
            Some("qwen3") => (false, true),
            Some(other) => return Err(GpuError::UnsupportedArchitecture(other.to_owned())),
        };
        let unsupported = |what: &str| {
            Err(GpuError::UnsupportedArchitecture(format!(
                "{} with {what}",
                c.model_type.as_deref().unwrap_or("llama")
            )))
        };
        // Llama's (and Qwen3's) `attention_bias` also puts a bias on the output projection,
        // which no backend has.
        if c.attention_bias == Some(true) {
            return unsupported("attention_bias");
        }
        if c.mlp_bias == Some(true) {
            return unsupported("mlp_bias");
        }
        let sliding_layers = c
            .layer_types
            .iter()
            .flatten()
            .any(|t| t == "sliding_attention");
        if c.use_sliding_window == Some(true) || sliding_layers {
            return unsupported("use_sliding_window");
        }
        let need = |v: Option<usize>, k: &str| {
            v.ok_or_else(|| GpuError::InvalidConfig(format!("config.json lacks {k}")))
        };
        let hidden_size = need(c.hidden_size, "hidden_size")?;
        let num_heads = need(c.num_attention_heads, "num_attention_heads")?;
        if num_heads == 0 {
            return Err(GpuError::InvalidConfig("num_attention_heads is 0".into()));
        }
        // transformers 5 writes the base inside `rope_parameters`.
        let rope_theta = c.rope_theta.or_else(|| {
            let p = c.rope_parameters.as_ref()?;
            Some(p.get("rope_theta")?.as_f64()? as f32)
        });
        let rope_scaling = match c.rope_scaling.or(c.rope_parameters) {
            Some(r) => parse_hf_rope_scaling(&r)?,
            None => None,
        };
        // transformers' Mistral attends over `sliding_window` tokens (4,096 when the key is
        // absent; `null` for none); Llama and Qwen2 (without `use_sliding_window`) do not.
        let window = match (c.model_type.as_deref(), &c.sliding_window) {
            (Some("mistral"), None) => Some(4096),
            (Some("mistral"), Some(serde_json::Value::Null)) => None,
            (Some("mistral"), Some(w)) => Some(
                w.as_u64()
                    .and_then(|w| usize::try_from(w).ok())
                    .ok_or_else(|| {
                        GpuError::InvalidConfig(format!("sliding_window is {w}, not a count"))
                    })?,
            ),
            _ => None,
        };
        let eos_token_ids = match c.eos_token_id {
            Some(IdOrIds::One(i)) => vec![i],
            Some(IdOrIds::Many(v)) => v,
            None => Vec::new(),
        };
        let cfg = LlamaConfig {
            num_layers: need(c.num_hidden_layers, "num_hidden_layers")?,
            hidden_size,
            num_heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(num_heads),
            // transformers' Qwen3Config defaults to 128 (not hidden / heads).
            head_dim: c
                .head_dim
                .unwrap_or(if qwen3 { 128 } else { hidden_size / num_heads }),
            intermediate_size: need(c.intermediate_size, "intermediate_size")?,
            vocab_size: need(c.vocab_size, "vocab_size")?,
            rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            rope_style: RopeStyle::Halves,
            max_position_embeddings: capped_at_window(
                c.max_position_embeddings.unwrap_or(2048),
                window,
            )?,
            tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
            qkv_bias: qwen2,
            qk_norm: qwen3,
            bos_token_id: c.bos_token_id,
            eos_token_ids,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

impl LlamaConfig {
    /// Reads the `llama.*` (or `{general.architecture}.*`) keys of a GGUF header.
    pub fn from_gguf(h: &GgufHeader) -> Result<Self, GpuError> {
        let arch = h
            .get_str("general.architecture")
            .ok_or_else(|| GpuError::InvalidConfig("GGUF lacks general.architecture".into()))?;
        if !matches!(arch, "llama" | "mistral" | "qwen2" | "qwen3") {
            return Err(GpuError::UnsupportedArchitecture(arch.to_string()));
        }
        let qwen2 = arch == "qwen2";
        let qwen3 = arch == "qwen3";
        // Biases nothing would add (on a Llama's projections, or Qwen2's output or FFN):
        // refused, not ignored.
        if let Some(t) = h.tensors.iter().find(|t| {
            t.name.ends_with(".bias")
                && !(qwen2
                    && ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
                        .iter()
                        .any(|b| t.name.ends_with(b)))
        }) {
            return Err(GpuError::UnsupportedArchitecture(format!(
                "{arch} with the bias {}",
                t.name
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| {
            h.get_usize(&key(k))
                .ok_or_else(|| GpuError::InvalidConfig(format!("GGUF lacks integer {arch}.{k}")))
        };
        let hidden_size = need("embedding_length")?;
        let num_heads = need("attention.head_count")?;
        if num_heads == 0 {
            return Err(GpuError::InvalidConfig("attention.head_count is 0".into()));
        }
        let n_tokens = h.get_array("tokenizer.ggml.tokens").map(<[_]>::len);
        let vocab_size = h
            .get_usize(&key("vocab_size"))
            .or(n_tokens)
            .ok_or_else(|| GpuError::InvalidConfig("GGUF has no vocabulary size".into()))?;
        let head_dim = h
            .get_usize(&key("attention.key_length"))
            .or_else(|| h.get_usize(&key("rope.dimension_count")))
            .unwrap_or(hidden_size / num_heads);
        let rope_scaling = match h.get_str(&key("rope.scaling.type")) {
            None | Some("none") => None,
            Some(other) => {
                return Err(GpuError::InvalidConfig(format!(
                    "unsupported GGUF rope scaling type '{other}'"
                )))
            }
        };
        let token_id = |k: &str| {
            h.get_usize(k)
                .map(|v| {
                    u32::try_from(v).map_err(|_| GpuError::InvalidConfig(format!("{k} = {v}")))
                })
                .transpose()
        };
        let mut eos_token_ids = Vec::new();
        for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Some(id) = token_id(k)? {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        let cfg = LlamaConfig {
            num_layers: need("block_count")?,
            hidden_size,
            num_heads,
            num_kv_heads: h
                .get_usize(&key("attention.head_count_kv"))
                .unwrap_or(num_heads),
            head_dim,
            intermediate_size: need("feed_forward_length")?,
            vocab_size,
            rms_norm_eps: h
                .get_f32(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5),
            rope_theta: h.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_scaling,
            // llama.cpp's converter permutes Llama's Q and K rows for adjacent pairs, and
            // leaves Qwen2's and Qwen3's as they are (llama.cpp rotates them in the NeoX
            // layout).
            rope_style: if qwen2 || qwen3 {
                RopeStyle::Halves
            } else {
                RopeStyle::Interleaved
            },
            // A window on a Llama-family file (Qwen2's is only used with its
            // `use_sliding_window`, which GGUF does not record).
            max_position_embeddings: capped_at_window(
                h.get_usize(&key("context_length")).unwrap_or(2048),
                h.get_usize(&key("attention.sliding_window"))
                    .filter(|_| !(qwen2 || qwen3)),
            )?,
            // GGUF files omit `output.weight` when the embedding is tied.
            tie_word_embeddings: !h.tensors.iter().any(|t| t.name == "output.weight"),
            // Qwen2's files hold `blk.N.attn_{q,k,v}.bias` (checked with the weights).
            qkv_bias: qwen2,
            // Qwen3's files hold `blk.N.attn_{q,k}_norm.weight` (checked with the weights).
            qk_norm: qwen3,
            bos_token_id: token_id("tokenizer.ggml.bos_token_id")?,
            eos_token_ids,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// The context of a model whose every layer attends over the last `window` tokens: within
/// the window that is full causal attention, which both backends run, so the context stops
/// there (sliding-window attention is not implemented). A window of 0 is none (llama.cpp
/// writes 0 for none).
fn capped_at_window(context: usize, window: Option<usize>) -> Result<usize, GpuError> {
    match window {
        Some(w) if w > 0 && w < context => {
            tracing::warn!(
                window = w,
                context,
                "the model attends over a sliding window, which Switchyard does not implement: \
                 its context is capped at the window"
            );
            Ok(w)
        }
        _ => Ok(context),
    }
}

/// Recovers Llama 3 RoPE scaling from llama.cpp's `rope_freqs.weight` tensor, which stores
/// one divisor per rotary frequency instead of the scaling parameters. In the transition band
/// the divisor `r` satisfies `1/r = (1 - s)/factor + s` with
/// `s = (original_context / wavelength - low) / (high - low)`, linear in `1 / wavelength`; a
/// least-squares line through the band gives `low` and `high` for the given
/// `original_context`. The result is checked by recomputing every divisor.
pub fn rope_scaling_from_freq_factors(
    factors: &[f32],
    rope_theta: f32,
    head_dim: usize,
    original_context: usize,
) -> Result<Option<RopeScaling>, GpuError> {
    let bad = |m: &str| Err(GpuError::InvalidConfig(format!("rope_freqs.weight: {m}")));
    if factors.len() != head_dim / 2 || factors.is_empty() {
        return bad("length is not head_dim / 2");
    }
    if factors.iter().any(|f| !f.is_finite() || *f < 0.999) {
        return bad("divisors must be finite and >= 1");
    }
    let factor = f64::from(factors.iter().fold(1.0f32, |a, &b| a.max(b)));
    if factor < 1.0001 {
        return Ok(None);
    }
    let inv_wavelen = |i: usize| {
        let freq = 1.0 / f64::from(rope_theta).powf(2.0 * i as f64 / head_dim as f64);
        freq / (2.0 * std::f64::consts::PI)
    };
    let band: Vec<(f64, f64)> = factors
        .iter()
        .enumerate()
        .filter(|(_, &r)| f64::from(r) > 1.0001 && f64::from(r) < factor * 0.9999)
        .map(|(i, &r)| {
            let s = (1.0 / f64::from(r) - 1.0 / factor) / (1.0 - 1.0 / factor);
            (inv_wavelen(i), s)
        })
        .collect();
    if band.len() < 2 {
        return bad("too few frequencies in the transition band to recover the scaling");
    }
    // Fit s = a * x - b.
    let n = band.len() as f64;
    let (sx, sy) = band
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = band.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    let sxy: f64 = band.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    if sxx <= 0.0 {
        return bad("degenerate transition band");
    }
    let a = sxy / sxx;
    let b = a * mx - my;
    let orig = original_context as f64;
    let width = orig / a;
    let low = b * width;
    let scaling = RopeScaling {
        factor: factor as f32,
        low_freq_factor: low as f32,
        high_freq_factor: (low + width) as f32,
        original_max_position_embeddings: original_context,
    };
    if !(a > 0.0 && low > 0.0 && low.is_finite() && width.is_finite()) {
        return bad("divisors do not follow the Llama 3 scheme");
    }
    let recomputed = llama3_freq_factors(&scaling, rope_theta, head_dim);
    let worst = factors
        .iter()
        .zip(&recomputed)
        .map(|(&f, &g)| ((f - g) / f).abs())
        .fold(0.0f32, f32::max);
    if worst > 1e-3 {
        return bad(&format!(
            "divisors do not follow the Llama 3 scheme (relative error {worst})"
        ));
    }
    Ok(Some(scaling))
}

/// The divisor of each rotary frequency under Llama 3 scaling (as llama.cpp stores them).
pub fn llama3_freq_factors(s: &RopeScaling, rope_theta: f32, head_dim: usize) -> Vec<f32> {
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / f64::from(s.low_freq_factor);
    let high_wavelen = old / f64::from(s.high_freq_factor);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / f64::from(rope_theta).powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = f64::from(s.factor);
            let r = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                f
            } else {
                let smooth = (old / wavelen - f64::from(s.low_freq_factor))
                    / f64::from(s.high_freq_factor - s.low_freq_factor);
                1.0 / ((1.0 - smooth) / f + smooth)
            };
            r as f32
        })
        .collect()
}

/// The subset of a Hugging Face `config.json` this crate reads.
#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    num_hidden_layers: Option<usize>,
    hidden_size: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_scaling: Option<serde_json::Value>,
    rope_parameters: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    use_sliding_window: Option<bool>,
    /// Absent (`None`), or present (`null`, or a window; read for Mistral only).
    #[serde(default, deserialize_with = "present")]
    sliding_window: Option<serde_json::Value>,
    layer_types: Option<Vec<String>>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<IdOrIds>,
}

/// A field that is present, `null` or not, as told apart from one that is absent.
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// `eos_token_id` is an integer or a list of integers.
#[derive(Deserialize)]
#[serde(untagged)]
enum IdOrIds {
    One(u32),
    Many(Vec<u32>),
}

fn parse_hf_rope_scaling(v: &serde_json::Value) -> Result<Option<RopeScaling>, GpuError> {
    if v.is_null() {
        return Ok(None);
    }
    let ty = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    match ty {
        "default" => Ok(None),
        "llama3" => {
            let f = |k: &str| {
                v.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
                    GpuError::InvalidConfig(format!("rope_scaling lacks numeric {k}"))
                })
            };
            Ok(Some(RopeScaling {
                factor: f("factor")? as f32,
                low_freq_factor: f("low_freq_factor")? as f32,
                high_freq_factor: f("high_freq_factor")? as f32,
                original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
            }))
        }
        other => Err(GpuError::InvalidConfig(format!(
            "unsupported rope_scaling type '{other}'"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_metadata_config() {
        use crate::model::gguf::tests::GgufWriter;
        let mut w = GgufWriter::default();
        w.string("general.architecture", "llama")
            .u32("llama.block_count", 2)
            .u32("llama.embedding_length", 64)
            .u32("llama.attention.head_count", 4)
            .u32("llama.attention.head_count_kv", 2)
            .u32("llama.feed_forward_length", 128)
            .u32("llama.context_length", 256)
            .f32("llama.rope.freq_base", 100000.0)
            .f32("llama.attention.layer_norm_rms_epsilon", 1e-6)
            .str_array("tokenizer.ggml.tokens", &["a", "b", "c"])
            .u32("tokenizer.ggml.bos_token_id", 1)
            .u32("tokenizer.ggml.eos_token_id", 2);
        let h = crate::model::gguf::parse_header(&w.build(), std::path::Path::new("t")).unwrap();
        let c = LlamaConfig::from_gguf(&h).unwrap();
        assert_eq!(c.vocab_size, 3);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.num_kv_heads, 2);
        assert_eq!(c.rope_theta, 100000.0);
        assert_eq!(c.rope_style, RopeStyle::Interleaved);
        assert!(c.tie_word_embeddings);
        assert_eq!((c.bos_token_id, c.eos_token_ids), (Some(1), vec![2]));
        assert_eq!(c.max_position_embeddings, 256);
        // A sliding window shorter than the context caps it.
        let mut windowed = w.clone();
        windowed.u32("llama.attention.sliding_window", 64);
        let h =
            crate::model::gguf::parse_header(&windowed.build(), std::path::Path::new("t")).unwrap();
        assert_eq!(
            LlamaConfig::from_gguf(&h).unwrap().max_position_embeddings,
            64
        );
        // llama.cpp writes 0 for no window.
        let mut none = w.clone();
        none.u32("llama.attention.sliding_window", 0);
        let h = crate::model::gguf::parse_header(&none.build(), std::path::Path::new("t")).unwrap();
        assert_eq!(
            LlamaConfig::from_gguf(&h).unwrap().max_position_embeddings,
            256
        );

        // A bias no Llama adds: refused, not ignored.
        let mut biased = w.clone();
        biased.tensor("blk.0.attn_q.bias", &[64], 0, vec![0; 256]);
        let h =
            crate::model::gguf::parse_header(&biased.build(), std::path::Path::new("t")).unwrap();
        let e = LlamaConfig::from_gguf(&h).unwrap_err().to_string();
        assert!(e.contains("blk.0.attn_q.bias"), "{e}");

        w.u32("tokenizer.ggml.eot_token_id", 7);
        let h = crate::model::gguf::parse_header(&w.build(), std::path::Path::new("t")).unwrap();
        assert!(LlamaConfig::from_gguf(&h).is_err(), "eot id 7 >= vocab 3");
    }

    #[test]
    fn llama3_scaling_recovered_from_rope_freqs() {
        // Llama 3.1 8B and Llama 3.2 1B parameters (Meta's published configs).
        for (factor, theta, hd) in [(8.0, 500_000.0, 128), (32.0, 500_000.0, 64)] {
            let want = RopeScaling {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            };
            let factors = llama3_freq_factors(&want, theta, hd);
            let got = rope_scaling_from_freq_factors(&factors, theta, hd, 8192)
                .unwrap()
                .unwrap();
            assert_eq!(got.factor, factor);
            assert!((got.low_freq_factor - 1.0).abs() < 1e-3, "{got:?}");
            assert!((got.high_freq_factor - 4.0).abs() < 1e-3, "{got:?}");
        }
        assert_eq!(
            rope_scaling_from_freq_factors(&[1.0; 64], 5e5, 128, 8192).unwrap(),
            None
        );
        assert!(rope_scaling_from_freq_factors(&[1.0; 3], 5e5, 128, 8192).is_err());
        let mut noisy = vec![1.0f32; 32];
        noisy[5] = 3.0;
        noisy[9] = 2.0;
        noisy[20] = 5.0;
        assert!(rope_scaling_from_freq_factors(&noisy, 5e5, 64, 8192).is_err());
    }

    #[test]
    fn presets_validate() {
        LlamaConfig::smollm2_135m().validate().unwrap();
        LlamaConfig::llama3_8b().validate().unwrap();
    }

    #[test]
    fn hf_llama31_config_with_rope_scaling() {
        let json = r#"{"model_type":"llama","num_hidden_layers":32,"hidden_size":4096,
            "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,
            "vocab_size":128256,"rms_norm_eps":1e-5,"rope_theta":500000.0,
            "max_position_embeddings":131072,"bos_token_id":128000,
            "eos_token_id":[128001,128008,128009],
            "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
              "original_max_position_embeddings":8192,"rope_type":"llama3"}}"#;
        let c = LlamaConfig::from_hf_json(json).unwrap();
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.rope_style, RopeStyle::Halves);
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        let s = c.rope_scaling.unwrap();
        assert_eq!(s.factor, 8.0);
        assert_eq!(s.original_max_position_embeddings, 8192);
    }

    #[test]
    fn hf_config_explicit_head_dim_and_tied() {
        let json = r#"{"model_type":"llama","num_hidden_layers":2,"hidden_size":64,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
            "intermediate_size":128,"vocab_size":100,"tie_word_embeddings":true,
            "eos_token_id":2}"#;
        let c = LlamaConfig::from_hf_json(json).unwrap();
        assert_eq!(c.head_dim, 32);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![2]);
    }

    #[test]
    fn mistral_sliding_windows_cap_the_context() {
        // Mistral 7B v0.1's config.json (the fields this reader takes).
        let v01 = r#"{"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
            "max_position_embeddings": 32768, "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 32000}"#;
        let window = |json: &str| {
            LlamaConfig::from_hf_json(json)
                .unwrap()
                .max_position_embeddings
        };
        assert_eq!(window(v01), 4096);
        // v0.2 and later: no window.
        assert_eq!(
            window(&v01.replace("window\": 4096", "window\": null")),
            32768
        );
        // Absent: transformers' default window.
        assert_eq!(window(&v01.replace(r#""sliding_window": 4096,"#, "")), 4096);
        // A window at least the context changes nothing.
        assert_eq!(
            window(&v01.replace("window\": 4096", "window\": 65536")),
            32768
        );
        assert_eq!(window(&v01.replace("window\": 4096", "window\": 0")), 32768);
        assert!(LlamaConfig::from_hf_json(&v01.replace("window\": 4096", "window\": -1")).is_err());
        // Other architectures' windows are not read at all.
        let llama = v01.replace("mistral", "llama");
        assert_eq!(
            window(&llama.replace("window\": 4096", "window\": \"x\"")),
            32768
        );
        // Llama and Qwen2 configs carry no window of their own.
        assert_eq!(window(&v01.replace("mistral", "llama")), 32768);
        assert_eq!(
            LlamaConfig::from_hf_json(QWEN25_05B)
                .unwrap()
                .max_position_embeddings,
            32768
        );
    }

    #[test]
    fn hf_config_rejects_bad_values() {
        let base = r#"{"model_type":"llama","num_hidden_layers":2,"hidden_size":64,
            "num_attention_heads":HEADS,"num_key_value_heads":3,"intermediate_size":128,
            "vocab_size":100}"#;
        assert!(LlamaConfig::from_hf_json(&base.replace("HEADS", "4")).is_err());
        assert!(LlamaConfig::from_hf_json(&base.replace("HEADS", "0")).is_err());
        assert!(LlamaConfig::from_hf_json(r#"{"model_type":"gpt2"}"#).is_err());
        assert!(LlamaConfig::from_hf_json("not json").is_err());
    }

    /// Qwen2.5-0.5B-Instruct's `config.json` (transformers 4.x layout).
    const QWEN25_05B: &str = r#"{"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
        "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": true,
        "use_sliding_window": false, "vocab_size": 151936}"#;

    #[test]
    fn qwen3_configs_have_head_norms_and_wide_heads() {
        // Qwen3-0.6B's config.json (transformers 4.51 layout).
        let json = r#"{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
            "initializer_range": 0.02, "intermediate_size": 3072,
            "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
            "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
            "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
            "vocab_size": 151936}"#;
        let c = LlamaConfig::from_hf_json(json).unwrap();
        assert_eq!(c, LlamaConfig::qwen3_06b());
        assert!(c.qk_norm && !c.qkv_bias);
        // Without head_dim, transformers' default of 128.
        let bare = json.replace(r#""head_dim": 128, "#, "");
        assert_eq!(LlamaConfig::from_hf_json(&bare).unwrap().head_dim, 128);
        // Refused, not run wrong: biases (also on the output projection), sliding windows.
        for (from, to) in [
            (r#""attention_bias": false"#, r#""attention_bias": true"#),
            (
                r#""use_sliding_window": false"#,
                r#""use_sliding_window": true"#,
            ),
        ] {
            assert!(
                LlamaConfig::from_hf_json(&json.replace(from, to)).is_err(),
                "{to}"
            );
        }
    }

    #[test]
    fn qwen2_configs_have_qkv_biases_and_halves_rope() {
        let c = LlamaConfig::from_hf_json(QWEN25_05B).unwrap();
        assert_eq!(c, LlamaConfig::qwen25_05b());
        assert!(c.qkv_bias && c.tie_word_embeddings);
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (14, 2, 64));
        assert_eq!((c.rope_theta, c.rope_style), (1e6, RopeStyle::Halves));
        assert_eq!(c.eos_token_ids, [151_645]);
        // transformers 5 writes the base inside rope_parameters.
        let v5 = QWEN25_05B.replace(
            r#""rope_theta": 1000000.0"#,
            r#""rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}"#,
        );
        assert_eq!(LlamaConfig::from_hf_json(&v5).unwrap(), c);
        // Sliding-window attention is not implemented: refused, not run wrong.
        let sliding = QWEN25_05B.replace(
            r#""use_sliding_window": false"#,
            r#""use_sliding_window": true"#,
        );
        let e = LlamaConfig::from_hf_json(&sliding).unwrap_err().to_string();
        assert!(e.contains("use_sliding_window"), "{e}");
        let layers = QWEN25_05B.replace(
            r#""use_sliding_window": false"#,
            r#""layer_types": ["full_attention", "sliding_attention"]"#,
        );
        let e = LlamaConfig::from_hf_json(&layers).unwrap_err().to_string();
        assert!(e.contains("use_sliding_window"), "{e}");
        // Llama's attention_bias puts a bias on the output projection too: refused.
        let llama = r#"{"model_type":"llama","num_hidden_layers":2,"hidden_size":64,
            "num_attention_heads":4,"intermediate_size":128,"vocab_size":100,
            "attention_bias":true}"#;
        let e = LlamaConfig::from_hf_json(llama).unwrap_err().to_string();
        assert!(e.contains("attention_bias"), "{e}");
        assert!(
            !LlamaConfig::from_hf_json(&llama.replace("true", "false"))
                .unwrap()
                .qkv_bias
        );
    }
}
