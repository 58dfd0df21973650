//! Llama-family model configuration: [`LlamaConfig`], read from GGUF metadata (`llama.*` keys,
//! or `mistral.*`, `qwen2.*`, `qwen3.*`) or from a Hugging Face `config.json`, and presets for
//! dummy weights. Qwen2 (and Qwen2.5) is a Llama with biases on the Q, K and V projections;
//! Qwen3 is a Llama with an RMSNorm over each query and key head before RoPE.
//!
//! A model whose every layer attends over a sliding window (Mistral 7B v0.1: 4,096 tokens,
//! Phi-3-mini-4k: 2,047) keeps its context and states the window
//! ([`LlamaConfig::sliding_window`]), which both backends' attention honours; models that mix
//! windowed and full layers (Qwen2 or Qwen3 with `use_sliding_window`) are refused. A partial
//! rotary embedding (Phi-4-mini) is [`LlamaConfig::rotary_dim`].
//!
//! RoPE scaling (Llama 3.1's, linear, YaRN, LongRoPE) is read by [`super::rope`].

use serde::Deserialize;

use super::gguf::GgufHeader;
use super::rope::{self, RopeScaling};
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
    /// RoPE frequency scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Which dimension pairs RoPE rotates.
    pub rope_style: RopeStyle,
    /// Dimensions of each query and key head that RoPE rotates: `head_dim`, or fewer for a
    /// partial rotary embedding (Phi-4-mini: 96 of 128, transformers' `partial_rotary_factor`,
    /// GGUF's `rope.dimension_count`), which rotates the pairs `(i, i + rotary_dim / 2)` and
    /// leaves the dimensions from `rotary_dim` on as they are. The loader moves those
    /// dimensions of the query and key rows to the end of each half of the head, so that the
    /// backends rotate the usual halves' pairs, the moved ones at frequency 0
    /// ([`crate::model::loader`]).
    pub rotary_dim: usize,
    /// Context window.
    pub max_position_embeddings: usize,
    /// Sliding-window attention: every layer's query at position `p` attends to the keys at
    /// positions `p - w + 1 ..= p` only (transformers' `sliding_window`, Mistral 7B v0.1's
    /// 4,096 and Phi-3-mini-4k's 2,047); `None` for full causal attention. Set only when
    /// shorter than the context (where it is shorter than every sequence it is the same).
    pub sliding_window: Option<usize>,
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
/// Most distinct end-of-sequence ids (every request's stop ids include them).
pub(crate) const MAX_EOS_IDS: usize = 64;

impl LlamaConfig {
    /// A small shape for tests on random weights: SmolLM2-135M's settings with 2 layers, hidden
    /// 64, 4 query heads and 2 KV heads of 16, an FFN of 96 and a vocabulary of 256.
    pub fn tiny() -> Self {
        LlamaConfig {
            num_layers: 2,
            hidden_size: 64,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            rotary_dim: 16,
            intermediate_size: 96,
            vocab_size: 256,
            ..Self::smollm2_135m()
        }
    }

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
            rotary_dim: 64,
            max_position_embeddings: 8192,
            sliding_window: None,
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
            rotary_dim: 128,
            max_position_embeddings: 8192,
            sliding_window: None,
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
            rotary_dim: 64,
            max_position_embeddings: 32_768,
            sliding_window: None,
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
            rotary_dim: 128,
            max_position_embeddings: 40_960,
            sliding_window: None,
            tie_word_embeddings: true,
            qkv_bias: false,
            qk_norm: true,
            bos_token_id: Some(151_643),
            eos_token_ids: vec![151_645],
        }
    }

    /// Microsoft Phi-3-mini-4k(-instruct) with its projections split as the loader splits them
    /// (halves RoPE; 32 heads of 96 dimensions, no grouping; a sliding window of 2,047 over a
    /// context of 4,096).
    pub fn phi3_mini() -> Self {
        LlamaConfig {
            num_layers: 32,
            hidden_size: 3072,
            num_heads: 32,
            num_kv_heads: 32,
            head_dim: 96,
            intermediate_size: 8192,
            vocab_size: 32_064,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rope_style: RopeStyle::Halves,
            rotary_dim: 96,
            max_position_embeddings: 4096,
            sliding_window: Some(2047),
            tie_word_embeddings: false,
            qkv_bias: false,
            qk_norm: false,
            bos_token_id: Some(1),
            eos_token_ids: vec![32_000],
        }
    }

    /// Mistral-7B-v0.1 as its config.json gives it: Llama-3-8B's layers (32 heads, 8 KV heads
    /// of 128) with a vocabulary of 32,000, RoPE base 10,000 and a sliding window of 4,096 over
    /// a context of 32,768.
    pub fn mistral_7b_v0_1() -> Self {
        LlamaConfig {
            vocab_size: 32_000,
            rope_theta: 10_000.0,
            max_position_embeddings: 32_768,
            sliding_window: Some(4096),
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            ..Self::llama3_8b()
        }
    }

    /// Picks the RoPE scaling's variant for the context the model is served with (LongRoPE's
    /// long factors past the pre-training context, its short ones within it: see
    /// [`crate::model::rope`]); the context itself is left as it is.
    pub fn serve_context(&mut self, context: usize) {
        if let Some(RopeScaling::LongRope(l)) = &mut self.rope_scaling {
            let use_long = context > l.original_max_position_embeddings;
            if use_long != l.use_long {
                tracing::info!(
                    context,
                    original = l.original_max_position_embeddings,
                    use_long,
                    "LongRoPE factors for the served context"
                );
            }
            l.use_long = use_long;
        }
    }

    /// The multiplier of the rotated queries and keys: YaRN's attention factor, else 1.
    pub fn rope_attention_factor(&self) -> f32 {
        self.rope_scaling
            .as_ref()
            .map_or(1.0, RopeScaling::attention_factor)
    }

    /// The softmax scale of attention logits: `1 / sqrt(head_dim)`, times the square of
    /// [`Self::rope_attention_factor`] for a backend that leaves the rotated queries and keys
    /// unscaled (the same logits as scaling both). With a partial rotary embedding the factor
    /// scales only the rotated dimensions' products, so it stays out of this scale and goes on
    /// the rotated pairs instead ([`Self::rope_amplitudes`]).
    pub fn attention_scale(&self) -> f32 {
        let m = if self.rotary_dim < self.head_dim {
            1.0
        } else {
            self.rope_attention_factor()
        };
        m * m / (self.head_dim as f32).sqrt()
    }

    /// The factor a backend that uses [`Self::attention_scale`] multiplies each rotated pair
    /// by (`head_dim / 2` of them): 1 throughout, except with a partial rotary embedding,
    /// where the rotated pairs take [`Self::rope_attention_factor`] (transformers scales cos
    /// and sin by it, and the unrotated dimensions pass unscaled).
    pub fn rope_amplitudes(&self) -> Vec<f32> {
        let m = if self.rotary_dim < self.head_dim {
            self.rope_attention_factor()
        } else {
            1.0
        };
        (0..self.head_dim / 2)
            .map(|i| if i < self.rotary_dim / 2 { m } else { 1.0 })
            .collect()
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
        // The query and key widths size buffers built from the config alone, before any tensor
        // is checked (the partial-rotary row orders): bounded like every other width.
        for (name, heads) in [
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
        ] {
            if heads.saturating_mul(self.head_dim) > MAX_WIDTH {
                return bad(format!(
                    "{name} x head_dim = {heads} x {} is more than {MAX_WIDTH}",
                    self.head_dim
                ));
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
            return bad(format!(
                "rope_theta {} is not > 1",
                crate::short_number::short_number(self.rope_theta)
            ));
        }
        if let Some(s) = &self.rope_scaling {
            s.validate()?;
            if let RopeScaling::LongRope(l) = s {
                if l.pairs != self.rotary_dim / 2 {
                    return bad(format!(
                        "LongRoPE lists of {} factors for {} rotated dimensions",
                        l.pairs, self.rotary_dim
                    ));
                }
            }
        }
        if self.rotary_dim < 2
            || self.rotary_dim > self.head_dim
            || !self.rotary_dim.is_multiple_of(2)
        {
            return bad(format!(
                "rotary_dim {} is not an even count of at most head_dim {}",
                self.rotary_dim, self.head_dim
            ));
        }
        if self.rotary_dim < self.head_dim && (self.qkv_bias || self.qk_norm) {
            return bad("a partial rotary embedding with Q and K biases or norms".into());
        }
        if let Some(w) = self.sliding_window {
            if w == 0 || w >= self.max_position_embeddings {
                return bad(format!(
                    "sliding_window {w} is outside 1..{}",
                    self.max_position_embeddings
                ));
            }
        }
        if self.eos_token_ids.len() > MAX_EOS_IDS {
            return bad(format!(
                "{} end-of-sequence ids (at most {MAX_EOS_IDS})",
                self.eos_token_ids.len()
            ));
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
            // Phi-3 is Llama with Q, K and V in one matrix and gate and up in another (the
            // loader splits them) and LongRoPE.
            None | Some("llama" | "mistral" | "phi3") => (false, false),
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
        let stated_context = c.max_position_embeddings.unwrap_or(2048);
        let mut rope_object = c.rope_scaling.or(c.rope_parameters);
        // Phi-3 states its pre-training context at the top level (transformers 5 copies it
        // into `rope_parameters`).
        if let (Some(serde_json::Value::Object(r)), Some(original)) =
            (&mut rope_object, c.original_max_position_embeddings)
        {
            r.entry("original_max_position_embeddings")
                .or_insert(serde_json::Value::from(original));
        }
        // transformers' Qwen3Config defaults to 128 (not hidden / heads).
        let head_dim = c
            .head_dim
            .unwrap_or(if qwen3 { 128 } else { hidden_size / num_heads });
        // Only part of each head rotated (Phi-4-mini: 0.75): transformers' Phi-3 rotates
        // int(head_dim * factor) dimensions; its Llama, Mistral and Qwen models rotate all.
        let partial = c
            .partial_rotary_factor
            .or_else(|| rope_object.as_ref()?.get("partial_rotary_factor")?.as_f64());
        let rotary_dim = match partial {
            None | Some(1.0) => head_dim,
            Some(_) if c.model_type.as_deref() != Some("phi3") => {
                return unsupported("partial_rotary_factor");
            }
            Some(p) if p > 0.0 && p < 1.0 => (head_dim as f64 * p) as usize,
            Some(p) => {
                return Err(GpuError::InvalidConfig(format!(
                    "partial_rotary_factor {p} is outside (0, 1]"
                )))
            }
        };
        let rope_scaling = match rope_object {
            Some(r) => rope::from_hf(&r, stated_context)?,
            None => None,
        };
        // transformers' Mistral attends over `sliding_window` tokens (4,096 when the key is
        // absent; `null` for none); Llama and Qwen2 (without `use_sliding_window`) do not.
        // transformers' Phi-3 attends over `sliding_window` tokens when it is set (Phi-3-mini-4k:
        // 2,047).
        let window = match (c.model_type.as_deref(), &c.sliding_window) {
            (Some("mistral"), None) => Some(4096),
            (Some("mistral" | "phi3"), Some(serde_json::Value::Null)) | (Some("phi3"), None) => {
                None
            }
            (Some("mistral" | "phi3"), Some(w)) => Some(
                w.as_u64()
                    .and_then(|w| usize::try_from(w).ok())
                    .ok_or_else(|| {
                        GpuError::InvalidConfig(format!("sliding_window is {w}, not a count"))
                    })?,
            ),
            _ => None,
        };
        let context = scaled_context(stated_context, rope_scaling.as_ref());
        let mut eos_token_ids = match c.eos_token_id {
            Some(IdOrIds::One(i)) => vec![i],
            Some(IdOrIds::Many(v)) => v,
            None => Vec::new(),
        };
        let mut seen = std::collections::HashSet::new();
        eos_token_ids.retain(|id| seen.insert(*id));
        let cfg = LlamaConfig {
            num_layers: need(c.num_hidden_layers, "num_hidden_layers")?,
            hidden_size,
            num_heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(num_heads),
            head_dim,
            intermediate_size: need(c.intermediate_size, "intermediate_size")?,
            vocab_size: need(c.vocab_size, "vocab_size")?,
            rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope_theta.unwrap_or(10_000.0),
            rope_scaling: rope_scaling.clone(),
            rope_style: RopeStyle::Halves,
            rotary_dim,
            max_position_embeddings: context,
            sliding_window: window_within(window, context),
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
        if !matches!(arch, "llama" | "mistral" | "qwen2" | "qwen3" | "phi3") {
            return Err(GpuError::UnsupportedArchitecture(arch.to_string()));
        }
        let qwen2 = arch == "qwen2";
        let qwen3 = arch == "qwen3";
        let phi3 = arch == "phi3";
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
            .or_else(|| h.get_usize(&key("rope.dimension_count")).filter(|_| !phi3))
            .unwrap_or(hidden_size / num_heads);
        // Phi-4-mini rotates part of each head, which llama.cpp's converter writes as the
        // rotary dimensions (other architectures' files state the head size there).
        let rotary_dim = if phi3 {
            h.get_usize(&key("rope.dimension_count"))
                .unwrap_or(head_dim)
        } else {
            head_dim
        };
        let stated_context = h.get_usize(&key("context_length")).unwrap_or(2048);
        let rope_scaling = rope::from_gguf(h, arch, stated_context)?;
        let context = scaled_context(stated_context, rope_scaling.as_ref());
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
            rope_scaling: rope_scaling.clone(),
            // llama.cpp's converter permutes Llama's Q and K rows for adjacent pairs, and
            // leaves Qwen2's, Qwen3's and Phi-3's as they are (llama.cpp rotates them in the
            // NeoX layout).
            rope_style: if qwen2 || qwen3 || phi3 {
                RopeStyle::Halves
            } else {
                RopeStyle::Interleaved
            },
            rotary_dim,
            max_position_embeddings: context,
            // A window on a Llama-family file (Qwen2's is only used with its
            // `use_sliding_window`, which GGUF does not record).
            sliding_window: window_within(
                h.get_usize(&key("attention.sliding_window"))
                    .filter(|_| !(qwen2 || qwen3)),
                context,
            ),
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

/// The context a configuration states, stretched as its RoPE scaling allows (logged when it
/// is).
fn scaled_context(stated: usize, scaling: Option<&RopeScaling>) -> usize {
    let Some(s) = scaling else {
        return stated;
    };
    let context = s.context(stated, MAX_CONTEXT);
    if context != stated {
        tracing::info!(
            stated,
            context,
            scaling = ?s,
            "the context is the one the RoPE scaling makes room for"
        );
    }
    context
}

/// The sliding window of a model whose every layer attends over the last `window` tokens, if
/// it is shorter than the context (a longer one never applies). A window of 0 is none
/// (llama.cpp writes 0 for none).
fn window_within(window: Option<usize>, context: usize) -> Option<usize> {
    window.filter(|&w| w > 0 && w < context)
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
    /// Phi-3's pre-training context (LongRoPE's switch point).
    original_max_position_embeddings: Option<usize>,
    /// The fraction of each head that is rotated.
    partial_rotary_factor: Option<f64>,
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
        assert_eq!(c.sliding_window, None);
        // A sliding window shorter than the context.
        let mut windowed = w.clone();
        windowed.u32("llama.attention.sliding_window", 64);
        let h =
            crate::model::gguf::parse_header(&windowed.build(), std::path::Path::new("t")).unwrap();
        let c = LlamaConfig::from_gguf(&h).unwrap();
        assert_eq!(
            (c.sliding_window, c.max_position_embeddings),
            (Some(64), 256)
        );
        // llama.cpp writes 0 for no window.
        let mut none = w.clone();
        none.u32("llama.attention.sliding_window", 0);
        let h = crate::model::gguf::parse_header(&none.build(), std::path::Path::new("t")).unwrap();
        let c = LlamaConfig::from_gguf(&h).unwrap();
        assert_eq!((c.sliding_window, c.max_position_embeddings), (None, 256));

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

    /// The query and key widths bound what is built from the config alone: a few bytes of
    /// metadata asking for 4,096 heads of 2^20 dimensions (each within its own bound) would
    /// make the partial-rotary row orders 32 GiB before any tensor was looked at.
    #[test]
    fn query_and_key_widths_are_bounded() {
        let mut c = LlamaConfig::phi3_mini();
        (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) = (4096, 4096, 1 << 20, 2);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("num_heads x head_dim"), "{e}");
        c.num_heads = 1;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("num_kv_heads x head_dim"), "{e}");
    }

    #[test]
    fn presets_validate() {
        LlamaConfig::smollm2_135m().validate().unwrap();
        LlamaConfig::llama3_8b().validate().unwrap();
        LlamaConfig::phi3_mini().validate().unwrap();
        LlamaConfig::mistral_7b_v0_1().validate().unwrap();
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
        let Some(RopeScaling::Llama3(s)) = c.rope_scaling else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(s.factor, 8.0);
        assert_eq!(s.original_max_position_embeddings, 8192);
        // Llama 3.1 states its stretched context itself.
        assert_eq!(c.max_position_embeddings, 131072);
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
        // End ids are kept once each, and a list longer than the bound is refused (each
        // request's stop ids include them).
        let twice = json.replace("\"eos_token_id\":2", "\"eos_token_id\":[2,1,2,2,1]");
        assert_eq!(
            LlamaConfig::from_hf_json(&twice).unwrap().eos_token_ids,
            vec![2, 1]
        );
        let ids: Vec<String> = (0..65).map(|i| i.to_string()).collect();
        let many = json.replace(
            "\"eos_token_id\":2",
            &format!("\"eos_token_id\":[{}]", ids.join(",")),
        );
        let e = LlamaConfig::from_hf_json(&many).unwrap_err().to_string();
        assert!(e.contains("65 end-of-sequence ids"), "{e}");
    }

    #[test]
    fn mistral_configs_read_their_sliding_windows() {
        // Mistral 7B v0.1's config.json (the fields this reader takes).
        let v01 = r#"{"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
            "max_position_embeddings": 32768, "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 32000}"#;
        // (window, context)
        let window = |json: &str| {
            let c = LlamaConfig::from_hf_json(json).unwrap();
            (c.sliding_window, c.max_position_embeddings)
        };
        assert_eq!(window(v01), (Some(4096), 32768));
        // The dummy-weights preset is that config.
        let mut read = LlamaConfig::from_hf_json(v01).unwrap();
        read.bos_token_id = Some(1);
        read.eos_token_ids = vec![2];
        assert_eq!(read, LlamaConfig::mistral_7b_v0_1());
        // v0.2 and later: no window.
        assert_eq!(
            window(&v01.replace("window\": 4096", "window\": null")),
            (None, 32768)
        );
        // Absent: transformers' default window.
        assert_eq!(
            window(&v01.replace(r#""sliding_window": 4096,"#, "")),
            (Some(4096), 32768)
        );
        // A window at least the context changes nothing.
        assert_eq!(
            window(&v01.replace("window\": 4096", "window\": 65536")),
            (None, 32768)
        );
        assert_eq!(
            window(&v01.replace("window\": 4096", "window\": 0")),
            (None, 32768)
        );
        assert!(LlamaConfig::from_hf_json(&v01.replace("window\": 4096", "window\": -1")).is_err());
        // Other architectures' windows are not read at all.
        let llama = v01.replace("mistral", "llama");
        assert_eq!(
            window(&llama.replace("window\": 4096", "window\": \"x\"")),
            (None, 32768)
        );
        // Llama and Qwen2 configs carry no window of their own.
        assert_eq!(window(&v01.replace("mistral", "llama")), (None, 32768));
        assert_eq!(window(QWEN25_05B), (None, 32768));
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

    /// Phi-3's configurations (transformers 4's form: `rope_scaling` of type `longrope` or
    /// `su`, the original context at the top level): Llama with LongRoPE, the long factors
    /// when served past the original context; a partial rotary embedding (Phi-4-mini) rotates
    /// its share of each head, with lists for those pairs; a sliding window is read as one.
    #[test]
    fn phi3_configs_read_longrope() {
        let json = |ty: &str, extra: &str| {
            format!(
                r#"{{"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
                "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32064,
                "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 262144,
                "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 32000,
                "rope_scaling": {{"type": "{ty}",
                  "short_factor": [{short}], "long_factor": [{long}]}}{extra}}}"#,
                short = vec!["1.05"; 48].join(","),
                long = vec!["2.5"; 48].join(","),
            )
        };
        for ty in ["longrope", "su"] {
            let mut c = LlamaConfig::from_hf_json(&json(ty, "")).unwrap();
            let Some(RopeScaling::LongRope(l)) = c.rope_scaling.clone() else {
                panic!("{:?}", c.rope_scaling)
            };
            assert_eq!((c.head_dim, c.max_position_embeddings), (96, 131_072));
            assert_eq!((l.pairs, l.original_max_position_embeddings), (48, 4096));
            assert!(l.use_long && l.factors().iter().all(|&f| f == 2.5));
            // sqrt(1 + ln(32) / ln(4096)), Phi-3.5's 1.1902.
            assert!((l.attention_factor - 1.190_239).abs() < 1e-5, "{l:?}");
            assert_eq!(c.rope_attention_factor(), l.attention_factor);
            c.serve_context(4096);
            let Some(RopeScaling::LongRope(l)) = c.rope_scaling.clone() else {
                unreachable!()
            };
            assert!(!l.use_long && l.factors().iter().all(|&f| f == 1.05));
        }
        // A partial rotary embedding (Phi-4-mini's factor, at the top level as its config.json
        // has it): LongRoPE's lists then hold the rotated pairs only (72 of 96 dimensions: 36).
        let partial = |lists: usize, factor: &str| {
            json(
                "longrope",
                &format!(r#", "partial_rotary_factor": {factor}"#),
            )
            .replace(&vec!["1.05"; 48].join(","), &vec!["1.05"; lists].join(","))
            .replace(&vec!["2.5"; 48].join(","), &vec!["2.5"; lists].join(","))
        };
        let c = LlamaConfig::from_hf_json(&partial(36, "0.75")).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (96, 72));
        // Lists for the whole head, a factor out of range, or another architecture: refused.
        assert!(LlamaConfig::from_hf_json(&partial(48, "0.75")).is_err());
        for bad in ["0", "1.5", "-0.5"] {
            let e = LlamaConfig::from_hf_json(&partial(36, bad))
                .unwrap_err()
                .to_string();
            assert!(e.contains("partial_rotary_factor"), "{e}");
        }
        let e = LlamaConfig::from_hf_json(&partial(36, "0.75").replace("\"phi3\"", "\"llama\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("partial_rotary_factor"), "{e}");
        let windowed =
            LlamaConfig::from_hf_json(&json("longrope", "").replace("262144", "2047")).unwrap();
        assert_eq!(
            (windowed.sliding_window, windowed.max_position_embeddings),
            (Some(2047), 131_072)
        );
        // Lists of the wrong length for the heads are refused.
        let short_lists = json("longrope", "").replace(&vec!["2.5"; 48].join(","), "2.5");
        assert!(LlamaConfig::from_hf_json(&short_lists).is_err());
    }

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
