//! Step-cost model: how long one engine step (one batched forward pass) takes.
//!
//! Two models share one interface, [`CostModel::step_time`]:
//!
//! **Roofline** (Williams, Waterman, Patterson, "Roofline: an insightful
//! visual performance model", CACM 2009). A step is bound either by compute or
//! by memory traffic:
//!
//! ```text
//! step_s = max(flops / (peak_flops * compute_eff), bytes / (bandwidth * memory_eff))
//!          + step_overhead_s + layers * layer_overhead_s
//!          + [any adapter] layers * lora_targets * lora_overhead_s
//! flops  = 2 * T * P_layer * L            (every batched token through every GEMM)
//!        + 2 * S * hidden * vocab         (lm_head, sampled positions only)
//!        + 4 * L * q_dim * A              (QK^T and PV; A = Σ keys attended per new token)
//!        + 2 * T_lora * P_lora * L        (adapted tokens through the low-rank products)
//! bytes  = W * bytes_per_weight           (weights read once per step)
//!        + K * kv_bytes_per_token         (K = Σ over sequences of context + new tokens)
//!        + N_lora * P_lora * L * bytes_per_weight   (each adapter's weights read once)
//! ```
//!
//! with `T` batched tokens, `S` sampled sequences, `P_layer` the matrix
//! parameters of one layer (Q, K, V, O, gate, up, down), `W` the parameters read
//! per step (all layers, final norm, lm_head; embedding rows are gathered, not
//! streamed) and `kv_bytes_per_token = 2 * L * kv_heads * head_dim *
//! bytes_per_kv`. LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR
//! 2022; batched as in Punica and S-LoRA): `T_lora` tokens of adapted sequences, `N_lora`
//! distinct adapters in the step, `P_lora = rank * Σ (in + out)` over the adapted projections
//! of one layer ([`LoraSpec`]); the kernels a step with an adapter launches per adapted
//! projection and layer cost `lora_overhead_s` each, which at small batches is nearly all of
//! it (H200, SmolLM2 at batch 1: 0.54 ms base, 1.08-1.10 ms with a rank-4 adapter on all seven
//! projections, (1.09 - 0.54) ms / (30 layers * 7) = 2.6 µs; 0.70-0.72 ms on q and v,
//! 2.7-3.0 µs). Activations are ignored (they are small next to weights and
//! KV at serving batch sizes). This is the level of detail of DistServe's
//! latency model (Zhong et al., OSDI'24, §4: prefill is compute-bound and
//! grows with tokens, decode is bandwidth-bound and grows with batch and
//! context) and a closed-form stand-in for Vidur's profiled per-operator
//! costs (Agrawal et al., MLSys'24), which split a step into GEMMs sized by the
//! batched tokens and attention sized by the context.
//!
//! **Calibrated**: a linear model fitted on the real engine, as Vidur fits
//! operator runtimes:
//!
//! ```text
//! step_s = intercept_s + per_token_s * max(T, token_knee) + per_prefill_token_s * T_prefill
//!        + per_decode_seq_s * D + per_sampled_seq_s * S
//!        + per_kv_token_s * K + per_attention_pair_s * A
//!        + per_lora_token_s * T_lora + per_adapter_s * N_lora + [any adapter] per_lora_step_s
//! ```
//!
//! loaded from a YAML or JSON file that the engine writes; when given, it
//! replaces the roofline.

use crate::error::SimError;
pub use crate::lora_cost::{LoraSpec, Projection, MAX_LORA_RANK};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Shape of a transformer decoder (Llama family).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Name shown in reports.
    pub name: String,
    /// Number of decoder layers.
    pub num_layers: u64,
    /// Hidden (model) dimension.
    pub hidden_size: u64,
    /// Query heads.
    pub num_heads: u64,
    /// Key/value heads (grouped-query attention).
    pub num_kv_heads: u64,
    /// Per-head dimension; defaults to `hidden_size / num_heads`.
    #[serde(default)]
    pub head_dim: Option<u64>,
    /// FFN (intermediate) dimension of the SwiGLU MLP.
    pub ffn_size: u64,
    /// Vocabulary size.
    pub vocab_size: u64,
    /// Whether lm_head shares the embedding matrix.
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Bytes per weight element (2 for bf16).
    pub bytes_per_weight: f64,
    /// Bytes per KV-cache element (2 for bf16).
    pub bytes_per_kv: f64,
    /// The model's context length (`max_position_embeddings` of its config.json): the
    /// longest prompt plus output it serves, and the default `scheduler.max_model_len`. Every
    /// preset has one; a custom model without it is bounded by the KV cache only.
    #[serde(default)]
    pub max_position_embeddings: Option<u64>,
    /// Positions each query attends to when every layer attends over a sliding window (its
    /// config.json's `sliding_window`): steps read only the window's keys, and the scheduler
    /// gives back the blocks behind it while a request runs.
    #[serde(default)]
    pub sliding_window: Option<u64>,
}

/// Keys before a window's start that the modelled backend reads: the CUDA backend's chunked
/// reads (`switchyard_gpu::CUDA_WINDOW_READ_SLACK`; a test of the binary checks they agree).
pub const WINDOW_READ_SLACK: usize = 128;

impl ModelSpec {
    /// Llama-3-8B (Meta, 2024): 32 layers, hidden 4096, 32/8 heads, FFN 14336, vocab 128256, bf16.
    pub fn llama_3_8b() -> Self {
        ModelSpec {
            name: "llama-3-8b".into(),
            num_layers: 32,
            hidden_size: 4096,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: None,
            ffn_size: 14336,
            vocab_size: 128_256,
            tied_embeddings: false,
            bytes_per_weight: 2.0,
            bytes_per_kv: 2.0,
            max_position_embeddings: Some(8192),
            sliding_window: None,
        }
    }

    /// Llama-3.1-8B (Meta, 2024): Llama-3-8B's shape with a context of 131,072 tokens (RoPE
    /// scaling changes no cost).
    pub fn llama_3_1_8b() -> Self {
        ModelSpec {
            name: "llama-3.1-8b".into(),
            max_position_embeddings: Some(131_072),
            ..Self::llama_3_8b()
        }
    }

    /// SmolLM2-135M (Hugging Face, 2024): 30 layers, hidden 576, 9/3 heads, FFN 1536, vocab 49152, tied, bf16.
    pub fn smollm2_135m() -> Self {
        ModelSpec {
            name: "smollm2-135m".into(),
            num_layers: 30,
            hidden_size: 576,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: None,
            ffn_size: 1536,
            vocab_size: 49_152,
            tied_embeddings: true,
            bytes_per_weight: 2.0,
            bytes_per_kv: 2.0,
            max_position_embeddings: Some(8192),
            sliding_window: None,
        }
    }

    /// Qwen2.5-0.5B (Alibaba, 2024): 24 layers, hidden 896, 14/2 heads of 64, FFN 4864, vocab
    /// 151936, tied, bf16, context 32,768 (its Q, K and V biases are not counted).
    pub fn qwen2_5_0_5b() -> Self {
        ModelSpec {
            name: "qwen2.5-0.5b".into(),
            num_layers: 24,
            hidden_size: 896,
            num_heads: 14,
            num_kv_heads: 2,
            head_dim: Some(64),
            ffn_size: 4864,
            vocab_size: 151_936,
            tied_embeddings: true,
            bytes_per_weight: 2.0,
            bytes_per_kv: 2.0,
            max_position_embeddings: Some(32_768),
            sliding_window: None,
        }
    }

    /// Qwen3-0.6B (Alibaba, 2025): 28 layers, hidden 1024, 16/8 heads of 128, FFN 3072, vocab
    /// 151936, tied, bf16, context 40,960 (its query and key norms are not counted).
    pub fn qwen3_0_6b() -> Self {
        ModelSpec {
            name: "qwen3-0.6b".into(),
            num_layers: 28,
            hidden_size: 1024,
            num_heads: 16,
            num_kv_heads: 8,
            head_dim: Some(128),
            ffn_size: 3072,
            vocab_size: 151_936,
            tied_embeddings: true,
            bytes_per_weight: 2.0,
            bytes_per_kv: 2.0,
            max_position_embeddings: Some(40_960),
            sliding_window: None,
        }
    }

    /// Phi-3-mini-4k (Microsoft, 2024): 32 layers, hidden 3072, 32/32 heads of 96, FFN 8192,
    /// vocab 32064, untied, bf16, context 4,096, a sliding window of 2,047 positions.
    pub fn phi3_mini() -> Self {
        ModelSpec {
            name: "phi-3-mini".into(),
            num_layers: 32,
            hidden_size: 3072,
            num_heads: 32,
            num_kv_heads: 32,
            head_dim: Some(96),
            ffn_size: 8192,
            vocab_size: 32_064,
            tied_embeddings: false,
            bytes_per_weight: 2.0,
            bytes_per_kv: 2.0,
            max_position_embeddings: Some(4096),
            sliding_window: Some(2047),
        }
    }

    /// Mistral-7B-v0.1 (Mistral AI, 2023): Llama-3-8B's layers (32, hidden 4096, 32/8 heads,
    /// FFN 14336) with a vocabulary of 32000, untied, bf16, context 32,768 over a sliding
    /// window of 4,096 positions.
    pub fn mistral_7b_v0_1() -> Self {
        ModelSpec {
            name: "mistral-7b-v0.1".into(),
            vocab_size: 32_000,
            max_position_embeddings: Some(32_768),
            sliding_window: Some(4096),
            ..Self::llama_3_8b()
        }
    }

    /// The scheduler's view of the model's sliding window, if it has one.
    pub fn window(&self) -> Option<switchyard_policies::SlidingWindow> {
        self.sliding_window
            .map(|w| switchyard_policies::SlidingWindow {
                tokens: usize::try_from(w).unwrap_or(usize::MAX),
                read_slack: WINDOW_READ_SLACK,
            })
    }

    /// Names of the presets, for messages.
    pub const PRESETS: &'static str =
        "llama-3-8b, llama-3.1-8b, smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, phi-3-mini, \
         mistral-7b-v0.1";

    /// A preset by name (see [`ModelSpec::PRESETS`]).
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "llama-3-8b" => Some(Self::llama_3_8b()),
            "llama-3.1-8b" => Some(Self::llama_3_1_8b()),
            "smollm2-135m" => Some(Self::smollm2_135m()),
            "qwen2.5-0.5b" => Some(Self::qwen2_5_0_5b()),
            "qwen3-0.6b" => Some(Self::qwen3_0_6b()),
            "phi-3-mini" => Some(Self::phi3_mini()),
            "mistral-7b-v0.1" => Some(Self::mistral_7b_v0_1()),
            _ => None,
        }
    }

    /// Checks that every dimension is positive and bounded.
    pub fn validate(&self) -> Result<(), String> {
        let dims = [
            ("num_layers", self.num_layers, 1024),
            ("hidden_size", self.hidden_size, 1 << 17),
            ("num_heads", self.num_heads, 1024),
            ("num_kv_heads", self.num_kv_heads, 1024),
            ("head_dim", self.head_dim(), 1 << 12),
            ("ffn_size", self.ffn_size, 1 << 19),
            ("vocab_size", self.vocab_size, 1 << 22),
            (
                "max_position_embeddings",
                self.max_position_embeddings.unwrap_or(1),
                1 << 24,
            ),
        ];
        for (name, v, max) in dims {
            if v == 0 || v > max {
                return Err(format!("model.{name} = {v} outside 1..={max}"));
            }
        }
        if self.num_kv_heads > self.num_heads {
            return Err("model.num_kv_heads exceeds num_heads".into());
        }
        for (name, v) in [
            ("bytes_per_weight", self.bytes_per_weight),
            ("bytes_per_kv", self.bytes_per_kv),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 8.0) {
                return Err(format!(
                    "model.{name} = {} outside (0, 8]",
                    crate::spec::short_number(v)
                ));
            }
        }
        Ok(())
    }

    /// Per-head dimension.
    pub fn head_dim(&self) -> u64 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_heads.max(1))
    }

    /// Query projection width (`num_heads * head_dim`).
    pub fn q_dim(&self) -> u64 {
        self.num_heads * self.head_dim()
    }

    /// Key (or value) projection width (`num_kv_heads * head_dim`).
    pub fn kv_dim(&self) -> u64 {
        self.num_kv_heads * self.head_dim()
    }

    /// Matrix parameters of one layer: Q, K, V, O projections and the SwiGLU MLP.
    pub fn layer_matrix_params(&self) -> u64 {
        let h = self.hidden_size;
        h * (self.q_dim() + 2 * self.kv_dim()) + self.q_dim() * h + 3 * h * self.ffn_size
    }

    /// All parameters of one layer, including its two RMSNorm weight vectors.
    pub fn layer_params(&self) -> u64 {
        self.layer_matrix_params() + 2 * self.hidden_size
    }

    /// Total parameter count (embeddings, layers, final norm, untied lm_head).
    pub fn total_params(&self) -> u64 {
        let embed = self.vocab_size * self.hidden_size;
        let head = if self.tied_embeddings { 0 } else { embed };
        embed + self.num_layers * self.layer_params() + self.hidden_size + head
    }

    /// Parameters streamed from memory in one step: layers, final norm, lm_head.
    pub fn streamed_params(&self) -> u64 {
        self.num_layers * self.layer_params()
            + self.hidden_size
            + self.vocab_size * self.hidden_size
    }

    /// Bytes of all weights resident on the device.
    pub fn weight_bytes(&self) -> f64 {
        self.total_params() as f64 * self.bytes_per_weight
    }

    /// KV-cache bytes per token (keys and values of every layer).
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * (self.num_layers * self.kv_dim()) as f64 * self.bytes_per_kv
    }
}

/// An accelerator's roofline parameters and fixed costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareSpec {
    /// Name shown in reports.
    pub name: String,
    /// Peak dense FLOP/s at the weight precision.
    pub peak_flops: f64,
    /// Memory bandwidth in bytes/s.
    pub memory_bandwidth: f64,
    /// Device memory in bytes (for the KV capacity).
    pub memory_bytes: f64,
    /// Fraction of `peak_flops` a whole step achieves.
    pub compute_efficiency: f64,
    /// Fraction of `memory_bandwidth` a whole step achieves.
    pub memory_efficiency: f64,
    /// Fixed cost per step in seconds (scheduling, launch, sampling).
    pub step_overhead_s: f64,
    /// Fixed cost per layer per step in seconds (kernel launches, syncs).
    pub layer_overhead_s: f64,
    /// Fixed cost per adapted projection per layer in a step with any LoRA adapter, in
    /// seconds (the adapters' kernel launches; 0 when left out).
    #[serde(default)]
    pub lora_overhead_s: f64,
}

impl HardwareSpec {
    /// NVIDIA H200 (141 GB HBM3e) with the figures measured on our test host
    /// (DESIGN.md GPU notes: bf16 GEMM ~790 TFLOP/s, copy ~4.3 TB/s). The
    /// efficiencies (0.8 compute, 0.9 memory) account for non-GEMM work and
    /// small shapes; the overheads (0.5 ms per step, 5 µs per layer) are
    /// assumptions until a calibration file replaces them. The LoRA overhead, 2.6 µs per
    /// adapted projection per layer, is measured (gpu/CUDA_NOTES.md v19: SmolLM2 at batch 1,
    /// 0.54 ms base against 1.09 ms with an adapter on all seven projections of 30 layers).
    pub fn h200() -> Self {
        HardwareSpec {
            name: "h200".into(),
            peak_flops: 790e12,
            memory_bandwidth: 4.3e12,
            memory_bytes: 141e9,
            compute_efficiency: 0.8,
            memory_efficiency: 0.9,
            step_overhead_s: 0.5e-3,
            layer_overhead_s: 5e-6,
            lora_overhead_s: 2.6e-6,
        }
    }

    /// A preset by name (`h200`).
    pub fn preset(name: &str) -> Option<Self> {
        (name == "h200").then(Self::h200)
    }

    /// Checks that every figure is positive, finite and plausible.
    pub fn validate(&self) -> Result<(), String> {
        let checks = [
            ("peak_flops", self.peak_flops, 1e3, 1e18),
            ("memory_bandwidth", self.memory_bandwidth, 1e3, 1e15),
            ("memory_bytes", self.memory_bytes, 1e6, 1e14),
            ("compute_efficiency", self.compute_efficiency, 1e-3, 1.0),
            ("memory_efficiency", self.memory_efficiency, 1e-3, 1.0),
            ("step_overhead_s", self.step_overhead_s, 0.0, 10.0),
            ("layer_overhead_s", self.layer_overhead_s, 0.0, 1.0),
            ("lora_overhead_s", self.lora_overhead_s, 0.0, 1.0),
        ];
        for (name, v, lo, hi) in checks {
            if !(v.is_finite() && v >= lo && v <= hi) {
                return Err(format!(
                    "hardware.{name} = {} outside [{lo}, {hi}]",
                    crate::spec::short_number(v)
                ));
            }
        }
        Ok(())
    }
}

/// The work of one step, as the cost models read it: the scheduling core computes it from a
/// plan ([`switchyard_policies::StepPlan::shape`]), for the simulator and the real engine alike.
pub use switchyard_policies::StepShape;

/// Fitted coefficients of the linear step-time model (all in seconds).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// Model the fit was made on (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Hardware the fit was made on (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<String>,
    /// Constant cost per step.
    #[serde(default)]
    pub intercept_s: f64,
    /// Cost per batched token.
    #[serde(default)]
    pub per_token_s: f64,
    /// Extra cost per prefill token.
    #[serde(default)]
    pub per_prefill_token_s: f64,
    /// Cost per decoding sequence.
    #[serde(default)]
    pub per_decode_seq_s: f64,
    /// Cost per sampled sequence.
    #[serde(default)]
    pub per_sampled_seq_s: f64,
    /// Cost per KV token read or written.
    #[serde(default)]
    pub per_kv_token_s: f64,
    /// Cost per attention (query, key) pair.
    #[serde(default)]
    pub per_attention_pair_s: f64,
    /// Extra cost per token of a sequence with a LoRA adapter (`switchyard calibrate --lora`
    /// fits it; 0 otherwise).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub per_lora_token_s: f64,
    /// Extra cost per distinct LoRA adapter in a step.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub per_adapter_s: f64,
    /// Extra cost of a step that runs any LoRA adapter, whatever its batch: the LoRA kernels
    /// launched per adapted projection and layer (the roofline's `lora_overhead_s` per
    /// projection and layer; on the H200 it is most of an adapted decode step's extra time).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub per_lora_step_s: f64,
    /// The per-token cost is paid on at least this many tokens (the roofline's knee: below
    /// it a step streams the weights whatever it computes). `None`: on the tokens fed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_knee: Option<u64>,
    /// KV blocks of the engine that was calibrated (its log and `/metrics` show them too):
    /// the simulated cache when the spec sets no `cache.num_gpu_blocks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_gpu_blocks: Option<usize>,
    /// Tokens per KV block of that engine: a spec's `cache.block_size` must match it, or its
    /// `num_gpu_blocks` would hold another number of tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// The engine's host time per step in microseconds (planning and applying outputs,
    /// outside the backend's time, measured in one thread: the server's actor hand-offs are
    /// not in it, see README): the simulated `scheduler.host_overhead_us` when the spec sets
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_overhead_us: Option<f64>,
    /// The server's fixed time per request outside the engine's steps, in microseconds
    /// (`switchyard calibrate` times the tokenizer; the server's
    /// `switchyard:request_front_end_seconds` measures the whole way to its queue): the
    /// simulated `scheduler.front_end_us` when the spec sets none ([`crate::front_end`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub front_end_us: Option<f64>,
    /// The server's time per prompt token outside the engine's steps, in microseconds: the
    /// simulated `scheduler.front_end_per_token_us` when the spec sets none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub front_end_per_token_us: Option<f64>,
    /// The longest context (tokens in KV plus new ones) a measured step's sequence had
    /// ([`crate::calibrate::longest_context`]): the simulator warns of requests beyond it,
    /// whose steps the fit prices by extrapolation (its attention term grows with the square
    /// of the context). `None` in files written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_context: Option<u64>,
    /// The `slo-aware` policy's step-cost parameters the fit implies, as `switchyard
    /// calibrate` derived them ([`crate::slo_params`]), to copy into a server's
    /// `scheduler.policy.params`. Informational: the simulator derives them from the
    /// coefficients above, so an edit here changes nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_aware: Option<crate::slo_params::SloAwareParams>,
    /// The time to read the adapter of `switchyard calibrate --lora` from its directory, in
    /// milliseconds (the median of its loads through the server's loader): the simulated
    /// `scheduler.lora_memory.load_ms` when the spec sets none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_load_ms: Option<f64>,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// Shortest step the calibrated model returns (every coefficient may be zero).
const MIN_STEP_S: f64 = 1e-6;

impl Calibration {
    /// Loads a calibration file (YAML or JSON).
    pub fn load(path: &Path) -> Result<Self, SimError> {
        // Named as a calibration, as its other errors are: a bare "No such file" did not say
        // which of the spec's files was missing.
        let text =
            crate::spec::read_text(path, crate::spec::MAX_SPEC_BYTES).map_err(|e| match e {
                SimError::Io { path, error } => SimError::Calibration {
                    path,
                    message: error.to_string(),
                },
                other => other,
            })?;
        let cal: Calibration = serde_yaml::from_str(&text).map_err(|e| {
            let at = e
                .location()
                .map(|l| format!("line {}: ", l.line()))
                .unwrap_or_default();
            SimError::Calibration {
                path: path.to_path_buf(),
                message: format!("{at}{e}"),
            }
        })?;
        cal.validate().map_err(|message| SimError::Calibration {
            path: path.to_path_buf(),
            message,
        })?;
        Ok(cal)
    }

    /// Whether the file's `model` names `model`, compared on letters and digits without case
    /// ("Meta-Llama-3-8B-Instruct" and "llama-3-8b (random weights)" name `llama-3-8b`,
    /// "SmolLM2 135M Instruct" names `smollm2-135m`); true when the file records no model.
    pub fn is_for_model(&self, model: &str) -> bool {
        let key = |s: &str| -> String {
            s.chars()
                .filter(char::is_ascii_alphanumeric)
                .map(|c| c.to_ascii_lowercase())
                .collect()
        };
        match &self.model {
            None => true,
            Some(recorded) => {
                let (recorded, wanted) = (key(recorded), key(model));
                !wanted.is_empty() && recorded.contains(&wanted)
            }
        }
    }

    /// Checks that every coefficient is finite, not negative and below an hour: a
    /// negative cost would make a step cheaper the more it does.
    pub fn validate(&self) -> Result<(), String> {
        let c = [
            ("intercept_s", self.intercept_s),
            ("per_token_s", self.per_token_s),
            ("per_prefill_token_s", self.per_prefill_token_s),
            ("per_decode_seq_s", self.per_decode_seq_s),
            ("per_sampled_seq_s", self.per_sampled_seq_s),
            ("per_kv_token_s", self.per_kv_token_s),
            ("per_attention_pair_s", self.per_attention_pair_s),
            ("per_lora_token_s", self.per_lora_token_s),
            ("per_adapter_s", self.per_adapter_s),
            ("per_lora_step_s", self.per_lora_step_s),
        ];
        for (name, v) in c {
            if !(v.is_finite() && (0.0..3600.0).contains(&v)) {
                return Err(format!(
                    "{name} = {v} must be a cost in seconds, at least 0 (a negative cost would \
                     make a step cheaper the more it does: `switchyard calibrate` fits none) and \
                     below an hour"
                ));
            }
        }
        let max_knee = crate::calibrate::MAX_TOKEN_KNEE;
        if self.token_knee.is_some_and(|k| k > max_knee) {
            return Err(format!("token_knee outside 0..={max_knee} (tokens)"));
        }
        if self.num_gpu_blocks.is_some_and(|n| n == 0 || n > 1 << 26) {
            return Err("num_gpu_blocks outside 1..=67108864".into());
        }
        if self.block_size.is_some_and(|n| !(1..=1024).contains(&n)) {
            return Err("block_size outside 1..=1024".into());
        }
        let max = crate::spec::MAX_HOST_OVERHEAD_US;
        if self
            .host_overhead_us
            .is_some_and(|us| !(0.0..=max).contains(&us))
        {
            return Err(format!(
                "host_overhead_us outside 0..={max} (microseconds per step)"
            ));
        }
        if let Some(us) = self.front_end_us {
            crate::front_end::check_fixed_us("front_end_us", us)?;
        }
        if let Some(us) = self.front_end_per_token_us {
            crate::front_end::check_per_token_us("front_end_per_token_us", us)?;
        }
        if let Some(ms) = self.lora_load_ms {
            crate::lora_memory::check_load_ms("lora_load_ms", ms)?;
        }
        Ok(())
    }

    pub(crate) fn step_time(&self, s: &StepShape) -> f64 {
        let t = self.intercept_s
            + self.per_token_s * s.num_tokens.max(self.token_knee.unwrap_or(0)) as f64
            + self.per_prefill_token_s * s.num_prefill_tokens as f64
            + self.per_decode_seq_s * s.num_decode_seqs as f64
            + self.per_sampled_seq_s * s.num_sampled as f64
            + self.per_kv_token_s * s.kv_tokens as f64
            + self.per_attention_pair_s * s.attention_pairs as f64
            + self.per_lora_token_s * s.lora_tokens as f64
            + self.per_adapter_s * s.lora_adapters as f64
            + if s.lora_adapters > 0 {
                self.per_lora_step_s
            } else {
                0.0
            };
        t.max(MIN_STEP_S)
    }
}

/// A step-time model.
#[derive(Clone, Debug, PartialEq)]
pub enum CostModel {
    /// The analytical roofline.
    Roofline {
        /// The model's shape.
        model: ModelSpec,
        /// The accelerator.
        hardware: HardwareSpec,
        /// The LoRA adapters' shape, priced in steps with adapted sequences.
        lora: LoraSpec,
    },
    /// A linear model fitted on the real engine.
    Calibrated(Calibration),
}

/// The roofline's two bounds for one step, for reports and tests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RooflineTerms {
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes moved.
    pub bytes: f64,
    /// Compute-bound time in seconds.
    pub compute_s: f64,
    /// Memory-bound time in seconds.
    pub memory_s: f64,
    /// Fixed costs in seconds.
    pub fixed_s: f64,
}

impl CostModel {
    /// Seconds one step of this shape takes. An empty step costs only the fixed overheads.
    pub fn step_time(&self, shape: &StepShape) -> f64 {
        match self {
            CostModel::Roofline {
                model,
                hardware,
                lora,
            } => {
                let t = roofline_terms(model, hardware, lora, shape);
                t.compute_s.max(t.memory_s) + t.fixed_s
            }
            CostModel::Calibrated(c) => c.step_time(shape),
        }
    }
}

/// The roofline terms of one step whose adapted sequences' adapters are of shape `lora`.
pub fn roofline_terms(
    model: &ModelSpec,
    hw: &HardwareSpec,
    lora: &LoraSpec,
    s: &StepShape,
) -> RooflineTerms {
    let layers = model.num_layers as f64;
    let gemm = 2.0 * s.num_tokens as f64 * model.layer_matrix_params() as f64 * layers
        + 2.0 * s.num_sampled as f64 * (model.hidden_size * model.vocab_size) as f64;
    let attention = 4.0 * layers * model.q_dim() as f64 * s.attention_pairs as f64;
    let lora_params = lora.params_per_layer(model) as f64 * layers;
    let flops = gemm + attention + 2.0 * s.lora_tokens as f64 * lora_params;
    let bytes = if s.num_seqs == 0 {
        0.0
    } else {
        model.streamed_params() as f64 * model.bytes_per_weight
            + s.kv_tokens as f64 * model.kv_bytes_per_token()
            + s.lora_adapters as f64 * lora_params * model.bytes_per_weight
    };
    let lora_fixed = if s.lora_adapters > 0 {
        layers * lora.targets.len() as f64 * hw.lora_overhead_s
    } else {
        0.0
    };
    RooflineTerms {
        flops,
        bytes,
        compute_s: flops / (hw.peak_flops * hw.compute_efficiency),
        memory_s: bytes / (hw.memory_bandwidth * hw.memory_efficiency),
        fixed_s: hw.step_overhead_s + layers * hw.layer_overhead_s + lora_fixed,
    }
}

/// KV blocks that fit in `memory_utilization` of the device after the weights,
/// or `None` when the weights alone do not fit.
pub fn kv_capacity_blocks(
    model: &ModelSpec,
    hw: &HardwareSpec,
    memory_utilization: f64,
    block_size: usize,
) -> Option<usize> {
    let free = hw.memory_bytes * memory_utilization - model.weight_bytes();
    let per_block = model.kv_bytes_per_token() * block_size as f64;
    (free > 0.0 && per_block > 0.0).then(|| (free / per_block).floor() as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A missing calibration file is named as the spec's calibration, as its other errors are.
    #[test]
    fn a_missing_calibration_file_is_named_as_one() {
        let err = Calibration::load(Path::new("/nonexistent/cal.yaml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("/nonexistent/cal.yaml: calibration: "),
            "{err}"
        );
    }

    fn toy() -> (ModelSpec, HardwareSpec) {
        let m = ModelSpec {
            name: "toy".into(),
            num_layers: 2,
            hidden_size: 4,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: None,
            ffn_size: 8,
            vocab_size: 10,
            tied_embeddings: false,
            bytes_per_weight: 2.0,
            bytes_per_kv: 2.0,
            max_position_embeddings: Some(64),
            sliding_window: None,
        };
        let h = HardwareSpec {
            name: "toy".into(),
            peak_flops: 1000.0,
            memory_bandwidth: 100.0,
            memory_bytes: 1e6,
            compute_efficiency: 1.0,
            memory_efficiency: 1.0,
            step_overhead_s: 0.5,
            layer_overhead_s: 0.25,
            lora_overhead_s: 0.0,
        };
        (m, h)
    }

    #[test]
    fn published_parameter_counts() {
        // Hugging Face model cards / safetensors metadata: 8,030,261,248 and 134,515,008.
        assert_eq!(ModelSpec::llama_3_8b().total_params(), 8_030_261_248);
        assert_eq!(ModelSpec::smollm2_135m().total_params(), 134_515_008);
        // Phi-3-mini-4k-instruct's safetensors metadata: 3,821,079,552.
        assert_eq!(ModelSpec::phi3_mini().total_params(), 3_821_079_552);
        // Mistral-7B-v0.1's model card: 7.24B; its safetensors metadata: 7,241,732,096.
        assert_eq!(ModelSpec::mistral_7b_v0_1().total_params(), 7_241_732_096);
        // Llama-3-8B: 2 (K,V) * 32 layers * 8 heads * 128 dims * 2 bytes = 128 KiB per token.
        assert_eq!(ModelSpec::llama_3_8b().kv_bytes_per_token(), 131_072.0);
    }

    #[test]
    fn roofline_matches_hand_computation() {
        // By hand: layer matrix params 4*(4+2+2) + 4*4 + 3*4*8 = 144, norms 8 -> 152.
        // One 3-token prefill from empty, sampled: pairs 1+2+3 = 6.
        // flops = 2*3*144*2 + 2*1*4*10 + 4*2*4*6 = 1728 + 80 + 192 = 2000 -> 2 s.
        // bytes = (2*152 + 4 + 10*4)*2 + 3 * (2*2*2*2) = 696 + 48 = 744 -> 7.44 s.
        // fixed = 0.5 + 2*0.25 = 1.0; step = 8.44 s.
        let (m, h) = toy();
        let mut s = StepShape::default();
        s.add_seq(0, 3, true, true);
        let t = roofline_terms(&m, &h, &LoraSpec::default(), &s);
        assert_eq!(t.flops, 2000.0);
        assert_eq!(t.bytes, 744.0);
        let cost = CostModel::Roofline {
            model: m,
            hardware: h,
            lora: LoraSpec::default(),
        };
        assert!((cost.step_time(&s) - 8.44).abs() < 1e-12);
        assert_eq!(cost.step_time(&StepShape::default()), 1.0);
    }

    #[test]
    fn llama_on_h200_is_memory_bound_in_decode_and_compute_bound_in_prefill() {
        let (m, h) = (ModelSpec::llama_3_8b(), HardwareSpec::h200());
        let mut decode = StepShape::default();
        decode.add_seq(1000, 1, false, true);
        let t = roofline_terms(&m, &h, &LoraSpec::default(), &decode);
        assert!(t.memory_s > 10.0 * t.compute_s);
        // 7,504,924,672 params * 2 B + 1001 tokens * 128 KiB = 15.141 GB at
        // 0.9 * 4.3 TB/s = 3.912 ms, plus 0.5 + 32 * 0.005 = 0.66 ms fixed.
        let step = CostModel::Roofline {
            model: m.clone(),
            hardware: h.clone(),
            lora: LoraSpec::default(),
        }
        .step_time(&decode);
        assert!((step - 4.5724e-3).abs() < 0.001e-3, "{step}");
        let mut prefill = StepShape::default();
        prefill.add_seq(0, 4096, true, true);
        let t = roofline_terms(&m, &h, &LoraSpec::default(), &prefill);
        assert!(t.compute_s > 5.0 * t.memory_s);
    }

    /// One adapted sequence and one not, in one step.
    fn lora_step() -> StepShape {
        let mut s = StepShape::default();
        s.add_seq(0, 3, true, true);
        s.add_seq(5, 1, false, true);
        s.lora_tokens = 3;
        s.lora_adapters = 1;
        s
    }

    #[test]
    fn roofline_prices_lora_by_hand() {
        // Toy model, rank 2 on q (4 -> 4) and down (8 -> 4): P_lora = 2 * (8 + 12) = 40 per
        // layer, 80 over the two layers.
        let (m, mut h) = toy();
        h.lora_overhead_s = 0.125;
        let lora = LoraSpec {
            rank: 2,
            targets: vec![Projection::Q, Projection::Down],
        };
        assert_eq!(lora.params_per_layer(&m), 40);
        let s = lora_step();
        let base = roofline_terms(
            &m,
            &h,
            &lora,
            &StepShape {
                lora_tokens: 0,
                lora_adapters: 0,
                ..s
            },
        );
        let t = roofline_terms(&m, &h, &lora, &s);
        // flops: 2 * 3 tokens * 80; bytes: one adapter's 80 weights of 2 bytes; launches:
        // 2 layers * 2 projections * 0.125 s.
        assert_eq!(t.flops - base.flops, 480.0);
        assert_eq!(t.bytes - base.bytes, 160.0);
        assert_eq!(t.fixed_s - base.fixed_s, 0.5);
        // A second adapter reads its weights too, launches nothing more.
        let two = roofline_terms(
            &m,
            &h,
            &lora,
            &StepShape {
                lora_adapters: 2,
                ..s
            },
        );
        assert_eq!(two.bytes - t.bytes, 160.0);
        assert_eq!(two.fixed_s, t.fixed_s);
        let cost = CostModel::Roofline {
            model: m,
            hardware: h,
            lora,
        };
        let without = StepShape {
            lora_tokens: 0,
            lora_adapters: 0,
            ..s
        };
        assert!(cost.step_time(&s) > cost.step_time(&without) + 0.5);
    }

    /// The H200 preset's LoRA overhead gives the measured batch-1 decode of SmolLM2 with an
    /// adapter on all seven projections (gpu/CUDA_NOTES.md v19: 0.54 ms base, 1.08-1.10 ms):
    /// the roofline's own base differs, the LoRA share is what is checked.
    #[test]
    fn h200_lora_overhead_matches_the_measured_smollm2_decode() {
        let (m, h) = (ModelSpec::smollm2_135m(), HardwareSpec::h200());
        let lora = LoraSpec {
            rank: 4,
            targets: Projection::ALL.to_vec(),
        };
        let mut s = StepShape::default();
        s.add_seq(100, 1, false, true);
        let cost = CostModel::Roofline {
            model: m,
            hardware: h,
            lora,
        };
        let base = cost.step_time(&s);
        s.lora_tokens = 1;
        s.lora_adapters = 1;
        let extra = cost.step_time(&s) - base;
        assert!((0.54e-3..0.57e-3).contains(&extra), "{extra}");
    }

    #[test]
    fn calibrated_lora_terms_are_priced_and_old_files_price_as_before() {
        let dir = crate::scratch::ScratchDir::new("cal-lora");
        let path = dir.join("cal.yaml");
        let old = "intercept_s: 0.001\nper_token_s: 1.0e-5\nper_kv_token_s: 1.0e-8\n";
        std::fs::write(&path, old).unwrap();
        let mut h = HardwareSpec::h200();
        h.lora_overhead_s = -1e-6;
        assert!(h.validate().unwrap_err().contains("lora_overhead_s"));
        let cal = Calibration::load(&path).unwrap();
        assert_eq!((cal.per_lora_token_s, cal.per_adapter_s), (0.0, 0.0));
        let s = lora_step();
        let without = StepShape {
            lora_tokens: 0,
            lora_adapters: 0,
            ..s
        };
        // An old file prices an adapted step as the same step without adapters.
        assert_eq!(cal.step_time(&s), cal.step_time(&without));
        // Written back, a file without LoRA terms has none.
        assert!(!serde_yaml::to_string(&cal).unwrap().contains("lora"));
        std::fs::write(
            &path,
            format!("{old}per_lora_token_s: 2.0e-4\nper_adapter_s: 3.0e-3\n"),
        )
        .unwrap();
        let lora = Calibration::load(&path).unwrap();
        // 3 adapted tokens * 2e-4 + 1 adapter * 3e-3.
        let extra = lora.step_time(&s) - lora.step_time(&without);
        assert!((extra - 3.6e-3).abs() < 1e-12, "{extra}");
        // The step term: once per step with any adapter, whatever its counts.
        std::fs::write(&path, format!("{old}per_lora_step_s: 5.0e-4\n")).unwrap();
        let step = Calibration::load(&path).unwrap();
        let extra = step.step_time(&s) - step.step_time(&without);
        assert!((extra - 5.0e-4).abs() < 1e-12, "{extra}");
        assert_eq!(step.step_time(&without), cal.step_time(&without));
        std::fs::write(&path, format!("{old}per_adapter_s: -1.0e-3\n")).unwrap();
        let err = Calibration::load(&path).unwrap_err().to_string();
        assert!(err.contains("per_adapter_s = -0.001"), "{err}");
        // A hostile step term is refused as the other coefficients are, never priced.
        for bad in ["-1.0e-3", ".nan", ".inf", "1.0e9"] {
            std::fs::write(&path, format!("{old}per_lora_step_s: {bad}\n")).unwrap();
            let err = Calibration::load(&path).unwrap_err().to_string();
            assert!(err.contains("per_lora_step_s = "), "{bad}: {err}");
        }
    }

    #[test]
    fn front_end_fields_round_trip_and_old_files_have_none() {
        let old = Calibration {
            intercept_s: 1e-3,
            ..Default::default()
        };
        let text = serde_yaml::to_string(&old).unwrap();
        assert!(!text.contains("front_end"), "{text}");
        let back: Calibration = serde_yaml::from_str(&text).unwrap();
        assert_eq!(
            (back.front_end_us, back.front_end_per_token_us),
            (None, None)
        );
        let new = Calibration {
            front_end_us: Some(412.5),
            front_end_per_token_us: Some(0.875),
            ..old
        };
        let text = serde_yaml::to_string(&new).unwrap();
        assert!(
            text.contains("front_end_us: 412.5") && text.contains("front_end_per_token_us: 0.875"),
            "{text}"
        );
        assert_eq!(serde_yaml::from_str::<Calibration>(&text).unwrap(), new);
        new.validate().unwrap();
        // Bounded as a hostile file may not be.
        for (fixed, per_token, name) in [
            (Some(-1.0), None, "front_end_us"),
            (Some(f64::INFINITY), None, "front_end_us"),
            (Some(2e7), None, "front_end_us"),
            (None, Some(-0.5), "front_end_per_token_us"),
            (None, Some(f64::NAN), "front_end_per_token_us"),
            (None, Some(1e5), "front_end_per_token_us"),
        ] {
            let bad = Calibration {
                front_end_us: fixed,
                front_end_per_token_us: per_token,
                ..new.clone()
            };
            let err = bad.validate().unwrap_err();
            assert!(err.starts_with(&format!("{name} ")), "{err}");
        }
    }

    #[test]
    fn calibration_overrides_and_rejects_bad_files() {
        let dir = crate::scratch::ScratchDir::new("cal");
        let good = dir.join("cal.json");
        std::fs::write(
            &good,
            r#"{"intercept_s": 0.001, "per_token_s": 1e-5, "per_kv_token_s": 1e-8}"#,
        )
        .unwrap();
        let cal = Calibration::load(&good).unwrap();
        let mut s = StepShape::default();
        s.add_seq(100, 10, true, false);
        // 0.001 + 10 * 1e-5 + 110 * 1e-8
        assert!((CostModel::Calibrated(cal).step_time(&s) - 0.0011011).abs() < 1e-12);
        let bad = dir.join("bad.yaml");
        std::fs::write(&bad, "intercept_s: 0.001\nper_tokn_s: 2\n").unwrap();
        let err = Calibration::load(&bad).unwrap_err().to_string();
        assert!(
            err.contains("bad.yaml") && err.contains("line 2") && err.contains("per_tokn_s"),
            "{err}"
        );
        std::fs::write(&bad, "intercept_s: .nan\n").unwrap();
        assert!(Calibration::load(&bad).is_err());
        // A negative coefficient is refused by name, not clamped into a 1 us step.
        std::fs::write(&bad, "intercept_s: 0.001\nper_kv_token_s: -2e-9\n").unwrap();
        let err = Calibration::load(&bad).unwrap_err().to_string();
        assert!(
            err.contains("bad.yaml") && err.contains("per_kv_token_s = -0.000000002"),
            "{err}"
        );
    }

    #[test]
    fn presets_carry_their_context_lengths() {
        // config.json `max_position_embeddings` of each model (gpu/src/model/config.rs).
        let ctx = |n: &str| {
            ModelSpec::preset(n)
                .unwrap()
                .max_position_embeddings
                .unwrap()
        };
        assert_eq!(ctx("llama-3-8b"), 8192);
        assert_eq!(ctx("llama-3.1-8b"), 131_072);
        assert_eq!(ctx("smollm2-135m"), 8192);
        assert_eq!(ctx("qwen2.5-0.5b"), 32_768);
        assert_eq!(ctx("qwen3-0.6b"), 40_960);
        assert_eq!(ctx("phi-3-mini"), 4096);
        assert_eq!(ctx("mistral-7b-v0.1"), 32_768);
        // And the sliding windows of their config.json.
        let window = |n: &str| ModelSpec::preset(n).unwrap().sliding_window;
        assert_eq!(window("phi-3-mini"), Some(2047));
        assert_eq!(window("mistral-7b-v0.1"), Some(4096));
        assert_eq!(window("llama-3-8b"), None);
        for n in ModelSpec::PRESETS.split(", ") {
            let m = ModelSpec::preset(n).unwrap();
            assert_eq!(m.name, n);
            m.validate().unwrap();
        }
        // Qwen2.5-0.5B: 494,032,768 parameters less its 24 * (896 + 2 * 128) biases.
        assert_eq!(
            ModelSpec::qwen2_5_0_5b().total_params(),
            494_032_768 - 24 * (896 + 256)
        );
    }

    #[test]
    fn kv_capacity_of_llama_on_h200() {
        // (141e9 * 0.9 - 8,030,261,248 * 2) / (131,072 * 16) = 52,852.38 -> 52,852 blocks.
        let n = kv_capacity_blocks(&ModelSpec::llama_3_8b(), &HardwareSpec::h200(), 0.9, 16);
        assert_eq!(n, Some(52_852));
        assert!(ModelSpec::llama_3_8b().validate().is_ok());
        let mut bad = ModelSpec::smollm2_135m();
        bad.num_heads = 0;
        assert!(bad.validate().is_err());
    }
}
