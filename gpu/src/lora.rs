//! LoRA adapters in the PEFT format, applied per request on top of the base model.
//!
//! An adapter directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, ...)
//! and `adapter_model.safetensors` with a low-rank pair per adapted projection:
//! `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (`r x in`) and
//! `...lora_B.weight` (`out x r`). For a token `x` the projection gains `scale * B (A x)`, with
//! `scale = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA). The seven Llama projections
//! (q, k, v, o, gate, up, down) can be adapted; anything else in the file (embedding or LM-head
//! adapters, biases, DoRA magnitudes, `modules_to_save`, another stack's layers such as a
//! vision tower's `...encoder.layers.N`) is refused, never ignored, since ignoring it would
//! serve a different model than the one trained. The decoder's layers are named
//! `base_model.model.model.layers.N`, `base_model.model.layers.N` or `model.layers.N`.
//! Of the projections' tensors, only those of the modules the configuration selects
//! (`target_modules`, `layers_to_transform`, `exclude_modules`; `crate::lora_targets`) are
//! applied, as PEFT builds only those modules and does not apply the file's other tensors.
//!
//! Adapter files are hostile input like model files: both must be regular files (links are
//! followed), read to a bound and never past it; sizes, ranks, layer indices and shapes are
//! checked against the base model and [`LoraLimits`] before anything is allocated, tensor
//! offsets are validated by the `safetensors` crate, and the weights must stay finite once
//! scaled. Each loaded copy has a [`LoraAdapter::fingerprint`] of what it computes with, so a
//! reload can tell whether the files changed. [`LoraAdapter::check`] runs the load's checks
//! but the values' on the configuration and the weights file's header alone (the same bounds,
//! the same refusals), for a caller that must drop something to make room for a load.
//!
//! The weights are held in f32 with the scale folded into `B`. Q and K rows follow the base
//! model's RoPE layout: for GGUF models (whose Q and K rows llama.cpp's converter permuted so
//! that RoPE rotates adjacent pairs) the rows of the q and k `B` matrices are permuted the same
//! way, so `B (A x)` lands on the rows the base product writes.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;
use safetensors::tensor::{Dtype as StDtype, Metadata, TensorInfo};
use safetensors::{SafeTensorError, SafeTensors};
use sha2::{Digest, Sha256};

#[cfg(target_arch = "x86_64")]
use crate::cpu::matmul::Isa;
use crate::error::GpuError;
use crate::lora_targets::{module_key, ModuleSelection};
use crate::model::{LlamaConfig, RopeStyle};

/// The projections an adapter may adapt, in the order of [`LoraAdapter`]'s per-layer table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl LoraTarget {
    /// Every target, in table order.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// The PEFT module name (`q_proj`, ...).
    pub fn module(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// `(in, out)` widths of the projection in `c`.
    pub(crate) fn dims(self, c: &LlamaConfig) -> (usize, usize) {
        let (h, q, kv, i) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        );
        match self {
            LoraTarget::Q => (h, q),
            LoraTarget::K | LoraTarget::V => (h, kv),
            LoraTarget::O => (q, h),
            LoraTarget::Gate | LoraTarget::Up => (h, i),
            LoraTarget::Down => (i, h),
        }
    }

    /// The module's path in a decoder layer (`self_attn.q_proj`, `mlp.down_proj`).
    fn path(self) -> &'static str {
        match self {
            LoraTarget::Q => "self_attn.q_proj",
            LoraTarget::K => "self_attn.k_proj",
            LoraTarget::V => "self_attn.v_proj",
            LoraTarget::O => "self_attn.o_proj",
            LoraTarget::Gate => "mlp.gate_proj",
            LoraTarget::Up => "mlp.up_proj",
            LoraTarget::Down => "mlp.down_proj",
        }
    }

    /// The target at `path` in a decoder layer (`self_attn.q_proj`); a projection under the
    /// other parent (`mlp.q_proj`) is none.
    fn from_path(path: &str) -> Option<LoraTarget> {
        LoraTarget::ALL.into_iter().find(|t| t.path() == path)
    }
}

/// Bounds on what an adapter file may hold.
#[derive(Clone, Debug)]
pub struct LoraLimits {
    /// Largest rank accepted.
    pub max_rank: usize,
    /// Largest `adapter_model.safetensors` accepted, in bytes.
    pub max_file_bytes: u64,
}

impl Default for LoraLimits {
    fn default() -> Self {
        LoraLimits {
            max_rank: 64,
            max_file_bytes: 4 << 30,
        }
    }
}

/// Largest rank any configuration may allow.
pub const MAX_LORA_RANK: usize = 1024;
/// Largest `adapter_config.json` read, in bytes.
const MAX_CONFIG_JSON: u64 = 1 << 20;
/// Room in `adapter_model.safetensors` for its header (tensor names, `__metadata__`) beside
/// the tensors' bytes.
const HEADER_ALLOWANCE: u64 = 16 << 20;

/// The largest `adapter_model.safetensors` an adapter of rank `rank` for `c` can be: every
/// projection of every layer adapted, `A` and `B` in f32 (the widest type read), and a header.
/// A larger file is refused before it is read, rather than read whole (up to
/// [`LoraLimits::max_file_bytes`]) only to be refused for its tensors.
fn largest_adapter_file(c: &LlamaConfig, rank: usize) -> u64 {
    let per_layer: u64 = LoraTarget::ALL
        .iter()
        .map(|t| {
            let (din, dout) = t.dims(c);
            (din + dout) as u64
        })
        .sum();
    per_layer
        .saturating_mul(c.num_layers as u64)
        .saturating_mul(rank as u64)
        .saturating_mul(4)
        .saturating_add(HEADER_ALLOWANCE)
}

/// One adapted projection: `A` (`rank x in`) and `scale * B` (`out x rank`), row-major f32,
/// and `scale * B` transposed (`rank x out`) for the CPU's update loop.
#[derive(Clone, Debug)]
pub struct LoraPair {
    rank: usize,
    a: Vec<f32>,
    b: Vec<f32>,
    bt: Vec<f32>,
}

impl LoraPair {
    /// The rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// `A`, `rank x in`, row-major.
    pub fn a(&self) -> &[f32] {
        &self.a
    }

    /// `scale * B`, `out x rank`, row-major, rows in the base model's order.
    pub fn b(&self) -> &[f32] {
        &self.b
    }

    /// A pair from `A` and `B` in the Hugging Face layout: `B` scaled, and for GGUF models
    /// (interleaved RoPE) the q and k rows of `B` permuted as the base weights were. Refused
    /// (with the reason) when `A` or the scaled `B` holds a value that is not finite: finite
    /// values of `B` can overflow once scaled.
    fn new(
        c: &LlamaConfig,
        target: LoraTarget,
        rank: usize,
        scale: f32,
        a: Vec<f32>,
        mut b: Vec<f32>,
    ) -> Result<Self, String> {
        if let Some(x) = a.iter().find(|x| !x.is_finite()) {
            return Err(format!(
                "lora_A holds {}",
                crate::short_number::short_number(*x)
            ));
        }
        b.iter_mut().for_each(|x| *x *= scale);
        if let Some(x) = b.iter().find(|x| !x.is_finite()) {
            return Err(format!(
                "lora_B scaled by {} holds {}",
                crate::short_number::short_number(scale),
                crate::short_number::short_number(*x)
            ));
        }
        let heads = match target {
            LoraTarget::Q => c.num_heads,
            LoraTarget::K => c.num_kv_heads,
            _ => 0,
        };
        if heads > 0 && c.rope_style == RopeStyle::Interleaved {
            b = permute_head_rows(&b, heads, &gguf_row_order(c.head_dim), rank);
        } else if heads > 0 && c.rotary_dim < c.head_dim {
            // A partial rotary embedding: the loader moved the base rows alike.
            let order = crate::model::loader::partial_rotary_order(c.head_dim, c.rotary_dim);
            b = permute_head_rows(&b, heads, &order, rank);
        }
        let out = b.len() / rank;
        let bt = (0..rank)
            .flat_map(|j| (0..out).map(move |o| (o, j)))
            .map(|(o, j)| b[o * rank + j])
            .collect();
        Ok(LoraPair { rank, a, b, bt })
    }

    /// Adds `B (A x)` to `out` for one token (`x`: `in` values, `out`: `out` values): `u = A x`
    /// by dot products along `x`, then `out += u_j B[:, j]` along `out`, both loops the compiler
    /// vectorises.
    #[inline(always)]
    fn apply_row(&self, x: &[f32], out: &mut [f32], u: &mut [f32]) {
        for (uj, a) in u.iter_mut().zip(self.a.chunks_exact(x.len())) {
            *uj = dot(a, x);
        }
        for (&uj, bt) in u.iter().zip(self.bt.chunks_exact(out.len())) {
            for (o, &b) in out.iter_mut().zip(bt) {
                *o += uj * b;
            }
        }
    }
}

/// A dot product the compiler vectorises (eight independent partial sums).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// One layer's pairs for [`LoraAdapter::from_pairs`]: target, `A`, `B`.
pub type LayerPairs = Vec<(LoraTarget, Vec<f32>, Vec<f32>)>;

/// Source of [`LoraAdapter::uid`]: unique per process, never reused.
static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// A loaded LoRA adapter, ready to apply to the base model it was loaded for.
#[derive(Debug)]
pub struct LoraAdapter {
    /// Process-unique id of this loaded copy.
    uid: u64,
    /// SHA-256 of what the adapter computes with (see [`LoraAdapter::fingerprint`]).
    fingerprint: [u8; 32],
    /// The rank of every pair.
    rank: usize,
    /// `lora_alpha / r` (or `/ sqrt(r)`), folded into every `B`.
    scale: f32,
    /// Per layer, per [`LoraTarget`] (table order), the pair if the projection is adapted.
    layers: Vec<[Option<LoraPair>; 7]>,
    /// Shape of the base model: layers, hidden, q width, kv width, intermediate, rope style.
    shape: (usize, usize, usize, usize, usize, RopeStyle),
    /// `base_model_name_or_path` of its `adapter_config.json`, if a non-empty string (cut to
    /// [`MAX_BASE_MODEL_CHARS`]).
    base_model: Option<String>,
}

/// Longest `base_model_name_or_path` kept, in characters (longer ones are cut).
pub const MAX_BASE_MODEL_CHARS: usize = 256;

/// The shape fields of `c` an adapter depends on.
fn shape_of(c: &LlamaConfig) -> (usize, usize, usize, usize, usize, RopeStyle) {
    (
        c.num_layers,
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
        c.rope_style,
    )
}

/// What `adapter_config.json` says, after the checks.
struct AdapterConfig {
    rank: usize,
    scale: f32,
    /// The modules `target_modules`, `layers_to_transform` and `exclude_modules` select.
    modules: ModuleSelection,
    /// `base_model_name_or_path`, if a non-empty string (cut to [`MAX_BASE_MODEL_CHARS`]).
    base_model: Option<String>,
}

fn invalid(path: &Path, reason: impl Into<String>) -> GpuError {
    GpuError::InvalidAdapter {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The bytes of the adapter file at `path`: a regular file of at most `max` bytes
/// ([`crate::model::read_bounded_bytes`]), its refusals as adapter errors.
fn read_regular_file(path: &Path, max: u64) -> Result<Vec<u8>, GpuError> {
    crate::model::read_bounded_bytes(path, max).map_err(as_adapter_error)
}

/// A model file's refusal ([`GpuError::InvalidModelFile`]) as an adapter's.
fn as_adapter_error(e: GpuError) -> GpuError {
    match e {
        GpuError::InvalidModelFile { path, reason } => GpuError::InvalidAdapter { path, reason },
        other => other,
    }
}

/// Whether `dir` holds `name` as a regular file (links followed); anything else under that
/// name (a FIFO, a device, a directory) is refused, never opened.
fn regular_file_in(dir: &Path, name: &str) -> Result<bool, GpuError> {
    match std::fs::metadata(dir.join(name)) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(invalid(dir, format!("{name} cannot be read: {e}"))),
        Ok(m) if !m.is_file() => Err(invalid(dir, format!("{name} is not a regular file"))),
        Ok(_) => Ok(true),
    }
}

/// Reads and checks `adapter_config.json`.
fn read_config(path: &Path, limits: &LoraLimits) -> Result<AdapterConfig, GpuError> {
    let bytes = read_regular_file(path, MAX_CONFIG_JSON)?;
    let text = std::str::from_utf8(&bytes).map_err(|e| invalid(path, format!("not UTF-8: {e}")))?;
    parse_config(path, text, limits)
}

/// A fingerprint's hasher, fed the kind of source (`source`), the rank and the scale.
fn fingerprint_hasher(source: &[u8], rank: usize, scale: f32) -> Sha256 {
    let mut h = Sha256::new();
    h.update((source.len() as u64).to_le_bytes());
    h.update(source);
    h.update((rank as u64).to_le_bytes());
    h.update(scale.to_bits().to_le_bytes());
    h
}

/// The digest of `h` as an array.
fn finish_fingerprint(h: Sha256) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(&h.finalize());
    out
}

/// Checks the text of `adapter_config.json` (`path` names it in errors).
fn parse_config(path: &Path, text: &str, limits: &LoraLimits) -> Result<AdapterConfig, GpuError> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| invalid(path, e.to_string()))?;
    let obj = v
        .as_object()
        .ok_or_else(|| invalid(path, "not a JSON object"))?;
    if let Some(t) = obj.get("peft_type").and_then(|t| t.as_str()) {
        if t != "LORA" {
            return Err(invalid(path, format!("peft_type {t} is not LORA")));
        }
    }
    let rank = obj
        .get("r")
        .and_then(|r| r.as_u64())
        .ok_or_else(|| invalid(path, "\"r\" (the rank) is missing or not a whole number"))?;
    let max_rank = limits.max_rank.min(MAX_LORA_RANK);
    if rank == 0 || rank > max_rank as u64 {
        return Err(invalid(
            path,
            format!("rank {rank} is outside 1..={max_rank} (max_lora_rank)"),
        ));
    }
    let rank = rank as usize;
    let alpha = match obj.get("lora_alpha") {
        None => rank as f64,
        Some(a) => a
            .as_f64()
            .ok_or_else(|| invalid(path, "\"lora_alpha\" is not a number"))?,
    };
    if !alpha.is_finite() || alpha.abs() > 1e6 {
        return Err(invalid(
            path,
            format!(
                "lora_alpha {} is out of range",
                crate::short_number::short_number(alpha)
            ),
        ));
    }
    let flag = |k: &str| obj.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
    let nonempty = |k: &str| match obj.get(k) {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Object(m)) => !m.is_empty(),
        Some(serde_json::Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    for (bad, what) in [
        (flag("use_dora"), "DoRA (use_dora)"),
        (flag("fan_in_fan_out"), "fan_in_fan_out (Conv1D weights)"),
        (nonempty("rank_pattern"), "per-module ranks (rank_pattern)"),
        (
            nonempty("alpha_pattern"),
            "per-module alphas (alpha_pattern)",
        ),
        (nonempty("modules_to_save"), "modules_to_save"),
    ] {
        if bad {
            return Err(invalid(path, format!("{what} is not supported")));
        }
    }
    if let Some(b) = obj.get("bias").and_then(|b| b.as_str()) {
        if b != "none" {
            return Err(invalid(path, format!("bias \"{b}\" is not supported")));
        }
    }
    let scale = if flag("use_rslora") {
        alpha / (rank as f64).sqrt()
    } else {
        alpha / rank as f64
    };
    let modules = ModuleSelection::parse(obj).map_err(|m| invalid(path, m))?;
    // What the adapter was trained on, as PEFT records it: informative only (a hub id, a
    // mirror's or a local path), never checked here.
    let base_model = obj
        .get("base_model_name_or_path")
        .and_then(|b| b.as_str())
        .filter(|b| !b.trim().is_empty())
        .map(|b| b.chars().take(MAX_BASE_MODEL_CHARS).collect());
    Ok(AdapterConfig {
        rank,
        scale: scale as f32,
        modules,
        base_model,
    })
}

/// Where the decoder layers of a Llama model sit in a PEFT adapter's tensor names: PEFT's
/// `base_model.model.` before the model's own `model.layers.` (or before `layers.` for a bare
/// decoder), or the model's names without PEFT's prefix. Anything else before `layers.` is
/// another model's stack (a vision tower's `...encoder.layers.`), never this model's.
const DECODER_LAYER_PREFIXES: [&str; 3] = [
    "base_model.model.model.layers.",
    "base_model.model.layers.",
    "model.layers.",
];

/// Splits a PEFT tensor name into (layer, projection path such as `self_attn.q_proj`, is_b);
/// `None` if it is not a LoRA pair tensor of a decoder layer of this model.
fn parse_name(name: &str) -> Option<(usize, &str, bool)> {
    let rest = DECODER_LAYER_PREFIXES
        .iter()
        .find_map(|p| name.strip_prefix(p))?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if !(rest.starts_with("self_attn.") || rest.starts_with("mlp.")) {
        return None;
    }
    // PEFT drops the adapter name when saving; accept `lora_A.default.weight` too.
    [
        ("lora_A.weight", false),
        ("lora_A.default.weight", false),
        ("lora_B.weight", true),
        ("lora_B.default.weight", true),
    ]
    .into_iter()
    .find_map(|(suffix, is_b)| {
        let module = rest.strip_suffix(suffix)?.strip_suffix('.')?;
        // Exactly `self_attn.<module>` or `mlp.<module>`: one segment after the parent.
        (module.matches('.').count() == 1).then_some((layer, module, is_b))
    })
}

/// The refusal of tensor `name` for its type `dtype` (not F32, F16 or BF16).
fn unsupported_dtype(path: &Path, name: &str, dtype: StDtype) -> GpuError {
    invalid(
        path,
        format!("tensor '{name}' has type {dtype:?} (need F32, F16 or BF16)"),
    )
}

/// A tensor of `adapter_model.safetensors` as its header describes it: name, type, shape.
type TensorHead<'a> = (&'a str, StDtype, &'a [usize]);

/// The adapted projections of an `adapter_model.safetensors`, as its header and the
/// configuration make them ([`layout`]).
struct Layout<'a> {
    /// Per adapted projection, by layer then in table order: the layer, the target and the
    /// names of its `A` and `B` tensors.
    pairs: Vec<(usize, LoraTarget, &'a str, &'a str)>,
    /// Tensors of modules the configuration does not select (not applied, as PEFT does not).
    skipped: usize,
}

/// Checks the tensors of `adapter_model.safetensors` (`path` names it in errors), as its
/// header describes them (`tensors`), against the checked configuration and the model `c`:
/// every name a LoRA half of a decoder layer's projection, each selected one of the rank's and
/// the model's shape, of a type read, once, with its other half. Everything a load checks but
/// the values (finite, once scaled), so [`LoraAdapter::check`] and a load refuse the same
/// headers for the same reasons.
fn layout<'a>(
    path: &Path,
    tensors: &[TensorHead<'a>],
    cfg: &AdapterConfig,
    c: &LlamaConfig,
) -> Result<Layout<'a>, GpuError> {
    if tensors.is_empty() {
        return Err(invalid(path, "holds no tensors"));
    }
    let mut sorted: Vec<&TensorHead<'a>> = tensors.iter().collect();
    sorted.sort_by_key(|(name, ..)| *name);
    // Per layer and target, the names of A and B.
    type Halves<'n> = (Option<&'n str>, Option<&'n str>);
    let mut halves: Vec<[Halves<'a>; 7]> = (0..c.num_layers).map(|_| Default::default()).collect();
    let mut skipped = 0usize;
    for &(name, dtype, shape) in sorted {
        let Some((layer, module, is_b)) = parse_name(name) else {
            return Err(invalid(
                path,
                format!("tensor '{name}' is not a LoRA A/B matrix of a decoder projection (unsupported)"),
            ));
        };
        let target = LoraTarget::from_path(module).ok_or_else(|| {
            invalid(
                path,
                format!("tensor '{name}': module '{module}' is not a Llama projection"),
            )
        })?;
        if layer >= c.num_layers {
            return Err(invalid(
                path,
                format!(
                    "tensor '{name}': layer {layer} but the model has {}",
                    c.num_layers
                ),
            ));
        }
        // PEFT builds only the modules its configuration selects, and does not apply the
        // file's other tensors: neither does this server (once each tensor is known to be
        // one it could apply: what it cannot read is refused, selected or not).
        if !cfg.modules.selects(module_key(name), layer) {
            skipped += 1;
            continue;
        }
        let (din, dout) = target.dims(c);
        let want = if is_b {
            [dout, cfg.rank]
        } else {
            [cfg.rank, din]
        };
        if shape != want {
            return Err(invalid(
                path,
                format!(
                    "tensor '{name}' has shape {shape:?}, expected {want:?} (rank {}, model widths)",
                    cfg.rank
                ),
            ));
        }
        if !matches!(dtype, StDtype::F32 | StDtype::F16 | StDtype::BF16) {
            return Err(unsupported_dtype(path, name, dtype));
        }
        let slot = &mut halves[layer][target.index()];
        let dst = if is_b { &mut slot.1 } else { &mut slot.0 };
        if dst.replace(name).is_some() {
            return Err(invalid(path, format!("tensor '{name}' appears twice")));
        }
    }
    let mut pairs = Vec::new();
    for (li, row) in halves.into_iter().enumerate() {
        for (target, half) in LoraTarget::ALL.into_iter().zip(row) {
            match half {
                (None, None) => {}
                (Some(a), Some(b)) => pairs.push((li, target, a, b)),
                _ => {
                    return Err(invalid(
                        path,
                        format!(
                            "layer {li} {}: lora_A and lora_B must come together",
                            target.module()
                        ),
                    ))
                }
            }
        }
    }
    if pairs.is_empty() {
        let why = if skipped > 0 {
            ": target_modules / layers_to_transform in adapter_config.json select none of its tensors"
        } else {
            ""
        };
        return Err(invalid(path, format!("adapts no projection{why}")));
    }
    Ok(Layout { pairs, skipped })
}

/// The tensors of a header ([`Metadata::tensors`]), as [`layout`] takes them.
fn heads<'a>(infos: &'a HashMap<String, &TensorInfo>) -> Vec<TensorHead<'a>> {
    infos
        .iter()
        .map(|(name, info)| (name.as_str(), info.dtype, info.shape.as_slice()))
        .collect()
}

/// A tensor's values as f32 (f32, f16 or bf16 little-endian).
fn to_f32(path: &Path, name: &str, dtype: StDtype, data: &[u8]) -> Result<Vec<f32>, GpuError> {
    let out = match dtype {
        StDtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        StDtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        StDtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect::<Vec<f32>>(),
        other => return Err(unsupported_dtype(path, name, other)),
    };
    if let Some(x) = out.iter().find(|x: &&f32| !x.is_finite()) {
        return Err(invalid(
            path,
            format!(
                "tensor '{name}' holds {}",
                crate::short_number::short_number(*x)
            ),
        ));
    }
    Ok(out)
}

/// llama.cpp's order of a Q or K head's rows for interleaved RoPE: row `2i + h` holds Hugging
/// Face's row `h * head_dim / 2 + i`.
fn gguf_row_order(head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    (0..head_dim).map(|j| (j % 2) * half + j / 2).collect()
}

/// `B`'s rows (`heads` heads of `order.len()` rows, `rank` values each) with each head's row
/// `i` taken from its row `order[i]`, as the base weights' rows are ordered: llama.cpp's for
/// interleaved RoPE ([`gguf_row_order`]) or a partial rotary embedding's
/// ([`crate::model::loader::partial_rotary_order`]).
fn permute_head_rows(b: &[f32], heads: usize, order: &[usize], rank: usize) -> Vec<f32> {
    let mut out = vec![0f32; b.len()];
    let hd = order.len();
    for h in 0..heads {
        for (j, &o) in order.iter().enumerate() {
            let (src, dst) = (h * hd + o, h * hd + j);
            out[dst * rank..(dst + 1) * rank].copy_from_slice(&b[src * rank..(src + 1) * rank]);
        }
    }
    out
}

/// The checked `adapter_config.json` of the PEFT adapter in `dir` and the path of its
/// `adapter_model.safetensors`, a regular file (not read yet).
fn adapter_files(dir: &Path, limits: &LoraLimits) -> Result<(AdapterConfig, PathBuf), GpuError> {
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(invalid(dir, "does not exist"))
        }
        Err(e) => return Err(invalid(dir, format!("cannot be read: {e}"))),
        Ok(m) if !m.is_dir() => return Err(invalid(dir, "is not a directory")),
        Ok(_) => {}
    }
    let cfg_path = dir.join("adapter_config.json");
    if !regular_file_in(dir, "adapter_config.json")? {
        return Err(invalid(dir, "no adapter_config.json in the directory"));
    }
    let cfg = read_config(&cfg_path, limits)?;
    let path = dir.join("adapter_model.safetensors");
    if !regular_file_in(dir, "adapter_model.safetensors")? {
        let hint = if dir.join("adapter_model.bin").is_file() {
            " (adapter_model.bin, a pickle, is not read: save it with safe_serialization)"
        } else {
            ""
        };
        return Err(invalid(
            dir,
            format!("no adapter_model.safetensors in the directory{hint}"),
        ));
    }
    Ok((cfg, path))
}

/// The most bytes `adapter_model.safetensors` at `path` is read to: [`LoraLimits::max_file_bytes`]
/// or, when smaller, the largest file of an adapter of its rank for `c`
/// ([`largest_adapter_file`]); a larger file is refused here, before it is read.
fn file_bound(
    path: &Path,
    cfg: &AdapterConfig,
    c: &LlamaConfig,
    limits: &LoraLimits,
) -> Result<u64, GpuError> {
    let largest = largest_adapter_file(c, cfg.rank);
    if let Ok(m) = std::fs::metadata(path) {
        if m.len() > largest && largest < limits.max_file_bytes {
            return Err(invalid(
                path,
                format!(
                    "is {} bytes, more than an adapter of rank {} for this model holds \
                     ({largest} bytes: every projection adapted, in f32)",
                    m.len(),
                    cfg.rank
                ),
            ));
        }
    }
    Ok(limits.max_file_bytes.min(largest))
}

/// The header of the safetensors file at `path` (a regular file of at most `max` bytes, as
/// its full read is bounded), read alone: its length (8 bytes), then that many bytes of
/// JSON, checked as the `safetensors` crate checks a whole file's (the same refusals: a
/// length past the file, offsets that are not contiguous, sizes that do not match shapes and
/// types, data that does not end where the file does), without reading the tensors' data.
fn read_header(path: &Path, max: u64) -> Result<Metadata, GpuError> {
    let bad = |e: SafeTensorError| invalid(path, e.to_string());
    let mut file = crate::model::open_regular(path).map_err(as_adapter_error)?;
    let len = file.metadata().map_err(|e| GpuError::io(path, e))?.len();
    if len > max {
        return Err(invalid(path, format!("too large: more than {max} bytes")));
    }
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => bad(SafeTensorError::HeaderTooSmall),
        _ => GpuError::io(path, e),
    })?;
    // The safetensors crate's own bound on a header (100 MB), and the file's length.
    let n = u64::from_le_bytes(prefix);
    if n > 100_000_000 {
        return Err(bad(SafeTensorError::HeaderTooLarge));
    }
    if n.saturating_add(8) > len {
        return Err(bad(SafeTensorError::InvalidHeaderLength));
    }
    let mut header = Vec::new();
    header
        .try_reserve_exact(n as usize)
        .map_err(|e| invalid(path, format!("cannot hold its {n}-byte header: {e}")))?;
    file.take(n)
        .read_to_end(&mut header)
        .map_err(|e| GpuError::io(path, e))?;
    if header.len() as u64 != n {
        // Shorter than its length says: the file shrank since its length was read.
        return Err(bad(SafeTensorError::InvalidHeaderLength));
    }
    let text = std::str::from_utf8(&header).map_err(|e| bad(SafeTensorError::InvalidHeader(e)))?;
    // Parsed, then checked (offsets, sizes), as `SafeTensors::read_metadata` does it, so that
    // a header of valid JSON but wrong figures is refused with the load's words, not as JSON.
    // Named as the crate's own (private) header struct is: serde's messages name the Rust
    // type ("invalid type: integer `0`, expected struct HashMetadata"; a `serde(rename)` does
    // not reach them), and the check's must read as the load's.
    #[derive(serde::Deserialize)]
    struct HashMetadata {
        #[serde(rename = "__metadata__")]
        metadata: Option<HashMap<String, String>>,
        #[serde(flatten)]
        tensors: HashMap<String, TensorInfo>,
    }
    let parsed: HashMetadata = serde_json::from_str(text)
        .map_err(|e| bad(SafeTensorError::InvalidHeaderDeserialization(e)))?;
    let mut tensors: Vec<(String, TensorInfo)> = parsed.tensors.into_iter().collect();
    tensors.sort_by_key(|(_, a)| a.data_offsets);
    let meta = Metadata::new(parsed.metadata, tensors).map_err(bad)?;
    if (meta.data_len() as u64).saturating_add(8 + n) != len {
        return Err(bad(SafeTensorError::MetadataIncompleteBuffer));
    }
    Ok(meta)
}

impl LoraAdapter {
    /// Loads the PEFT adapter in `dir` for the base model `c`.
    pub fn load(dir: &Path, c: &LlamaConfig, limits: &LoraLimits) -> Result<Self, GpuError> {
        let (cfg, path) = adapter_files(dir, limits)?;
        // Read, not mapped: the bytes parsed and fingerprinted are the bytes read once, whatever
        // happens to the file meanwhile (a mapping would show later writes, or fault on a
        // truncation).
        let max = file_bound(&path, &cfg, c, limits)?;
        let bytes = read_regular_file(&path, max)?;
        Self::from_safetensors(&path, &bytes, &cfg, c)
    }

    /// Checks the PEFT adapter in `dir` for the base model `c` as far as can be done without
    /// its weights, refusing what [`LoraAdapter::load`] would refuse for the same reason: its
    /// `adapter_config.json` (read and checked whole) and the header of its
    /// `adapter_model.safetensors` (the tensors' names, types and shapes, and the file's
    /// length, read to the bounds a load reads to, the tensors' data never read). A few
    /// kilobytes read where a load reads megabytes or more, so that a load into full memory
    /// is refused before anything is dropped to make room for it. Passing it promises no
    /// load: the values may not be finite (once scaled), and the files may change in between.
    /// Checks the PEFT adapter in `dir` as far as can be done without the base model: the
    /// directory, its `adapter_config.json` (a regular file of at most 1 MiB, read and checked
    /// whole as [`LoraAdapter::load`] checks it: the rank within `limits.max_rank`, the scale,
    /// the selected modules, what is not supported) and that `adapter_model.safetensors` is a
    /// regular file (not opened). Returns the rank. `config check` and `serve` call it before
    /// the model loads, so that an adapter a load would refuse for these reasons is refused
    /// minutes earlier; the weights' names and shapes against the model are checked as it
    /// loads ([`LoraAdapter::check`] with the model's configuration).
    pub fn check_files(dir: &Path, limits: &LoraLimits) -> Result<usize, GpuError> {
        adapter_files(dir, limits).map(|(cfg, _)| cfg.rank)
    }

    pub fn check(dir: &Path, c: &LlamaConfig, limits: &LoraLimits) -> Result<(), GpuError> {
        let (cfg, path) = adapter_files(dir, limits)?;
        let max = file_bound(&path, &cfg, c, limits)?;
        let meta = read_header(&path, max)?;
        let infos = meta.tensors();
        layout(&path, &heads(&infos), &cfg, c).map(drop)
    }

    /// Builds the adapter from the bytes of `adapter_model.safetensors` (`path` names it in
    /// errors) and the checked configuration; the fingerprint hashes those bytes, the rank and
    /// the scale.
    fn from_safetensors(
        path: &Path,
        bytes: &[u8],
        cfg: &AdapterConfig,
        c: &LlamaConfig,
    ) -> Result<Self, GpuError> {
        let (n, meta) =
            SafeTensors::read_metadata(bytes).map_err(|e| invalid(path, e.to_string()))?;
        let data = bytes.get(8 + n..).unwrap_or_default();
        let infos = meta.tensors();
        let layout = layout(path, &heads(&infos), cfg, c)?;
        // The values of tensor `name`, checked finite.
        let values = |name: &str| -> Result<Vec<f32>, GpuError> {
            let info = infos
                .get(name)
                .ok_or_else(|| invalid(path, format!("tensor '{name}' is missing")))?;
            let (start, end) = info.data_offsets;
            let raw = data
                .get(start..end)
                .ok_or_else(|| invalid(path, format!("tensor '{name}' lies outside the file")))?;
            to_f32(path, name, info.dtype, raw)
        };
        let mut layers: Vec<[Option<LoraPair>; 7]> =
            (0..c.num_layers).map(|_| Default::default()).collect();
        for &(li, target, a, b) in &layout.pairs {
            let (a, b) = (values(a)?, values(b)?);
            let pair = LoraPair::new(c, target, cfg.rank, cfg.scale, a, b)
                .map_err(|m| invalid(path, format!("layer {li} {}: {m}", target.module())))?;
            layers[li][target.index()] = Some(pair);
        }
        if layout.skipped > 0 {
            tracing::warn!(
                path = %path.display(),
                skipped = layout.skipped,
                "LoRA adapter: tensors of modules that adapter_config.json does not select \
                 (target_modules, layers_to_transform) are not applied, as PEFT does not"
            );
        }
        let mut h = fingerprint_hasher(b"safetensors", cfg.rank, cfg.scale);
        h.update(bytes);
        Ok(LoraAdapter {
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            fingerprint: finish_fingerprint(h),
            rank: cfg.rank,
            scale: cfg.scale,
            layers,
            shape: shape_of(c),
            base_model: cfg.base_model.clone(),
        })
    }

    /// An adapter from explicit pairs: `pairs[layer][target]` = `(A, B)` in the Hugging Face
    /// layout (`A`: `rank x in`, `B`: `out x rank`, unscaled), for tests and tools.
    pub fn from_pairs(
        c: &LlamaConfig,
        rank: usize,
        scale: f32,
        pairs: Vec<LayerPairs>,
    ) -> Result<Self, GpuError> {
        let bad = |m: String| Err(GpuError::InvalidConfig(format!("LoRA adapter: {m}")));
        if rank == 0 || rank > MAX_LORA_RANK || pairs.len() != c.num_layers {
            return bad(format!("rank {rank}, {} layers", pairs.len()));
        }
        let mut h = fingerprint_hasher(b"pairs", rank, scale);
        let mut layers: Vec<[Option<LoraPair>; 7]> = Vec::with_capacity(c.num_layers);
        for (li, layer) in pairs.into_iter().enumerate() {
            let mut row: [Option<LoraPair>; 7] = Default::default();
            for (target, a, b) in layer {
                let (din, dout) = target.dims(c);
                if a.len() != rank * din || b.len() != dout * rank {
                    return bad(format!("{} pair has the wrong size", target.module()));
                }
                h.update((li as u64).to_le_bytes());
                h.update((target.index() as u64).to_le_bytes());
                for x in a.iter().chain(&b) {
                    h.update(x.to_le_bytes());
                }
                match LoraPair::new(c, target, rank, scale, a, b) {
                    Ok(p) => row[target.index()] = Some(p),
                    Err(m) => return bad(format!("layer {li} {}: {m}", target.module())),
                }
            }
            layers.push(row);
        }
        Ok(LoraAdapter {
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            fingerprint: finish_fingerprint(h),
            rank,
            scale,
            layers,
            shape: shape_of(c),
            base_model: None,
        })
    }

    /// A process-unique id of this loaded copy (a reload is a new copy with a new id).
    pub fn uid(&self) -> u64 {
        self.uid
    }

    /// A SHA-256 digest of what this copy computes with: the bytes of
    /// `adapter_model.safetensors` as read, the rank and the scale (for
    /// [`LoraAdapter::from_pairs`], the pairs). Loads of unchanged files give the same
    /// fingerprint; a reload whose fingerprint differs from the first load's runs other
    /// weights, so it must not share that load's prefix-cache key.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// The model the adapter was trained on, as its `adapter_config.json` names it
    /// (`base_model_name_or_path`: a hub id, or a path); `None` when it names none.
    pub fn base_model(&self) -> Option<&str> {
        self.base_model.as_deref()
    }

    /// Bytes of weights held.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|p| (p.a.len() + p.b.len() + p.bt.len()) * 4)
            .sum()
    }

    /// The adapted projections (each once).
    pub fn targets(&self) -> Vec<LoraTarget> {
        LoraTarget::ALL
            .into_iter()
            .filter(|t| self.layers.iter().any(|l| l[t.index()].is_some()))
            .collect()
    }

    /// Whether the adapter was loaded for a model of `c`'s shape.
    pub fn fits(&self, c: &LlamaConfig) -> bool {
        self.shape == shape_of(c)
    }

    /// The pair of `target` in `layer`, if adapted.
    pub fn pair(&self, layer: usize, target: LoraTarget) -> Option<&LoraPair> {
        self.layers.get(layer)?[target.index()].as_ref()
    }
}

/// Adds the adapters' deltas of one layer's fused product to its output.
///
/// `x` holds `t` input rows of width `din`; `out` holds `t` rows of the fused product, whose
/// parts are `parts` (targets with their column offsets and widths in a row of `out`, e.g. q,
/// k, v side by side). `row_adapter[i]` is token `i`'s adapter, if any. Rows are processed in
/// parallel (on the caller's rayon pool).
pub(crate) fn add_deltas(
    layer: usize,
    parts: &[(LoraTarget, usize, usize)],
    x: &[f32],
    din: usize,
    out: &mut [f32],
    row_adapter: &[Option<&LoraAdapter>],
) {
    let t = row_adapter.len();
    if t == 0 || row_adapter.iter().all(|a| a.is_none()) {
        return;
    }
    let width = out.len() / t;
    #[cfg(target_arch = "x86_64")]
    let avx2 = matches!(Isa::detect(), Isa::Avx2 | Isa::Avx512Vnni);
    // A row's update is small (rank x (in + out) products): rows go to threads in groups, and
    // a decode step's few rows stay on the caller's thread.
    out.par_chunks_mut(width)
        .zip(x.par_chunks(din))
        .zip(row_adapter.par_iter())
        .with_min_len(8)
        .for_each_init(
            || vec![0f32; MAX_LORA_RANK],
            |u, ((o, xr), a)| {
                let Some(a) = a else { return };
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: the CPU has AVX2 and FMA (`Isa::detect`).
                    unsafe { update_row_avx2(a, layer, parts, xr, o, u) };
                    return;
                }
                update_row(a, layer, parts, xr, o, u);
            },
        );
}

/// One token's updates of the `parts` of a fused product.
#[inline(always)]
fn update_row(
    a: &LoraAdapter,
    layer: usize,
    parts: &[(LoraTarget, usize, usize)],
    x: &[f32],
    out: &mut [f32],
    u: &mut [f32],
) {
    for &(target, off, w) in parts {
        if let Some(p) = a.pair(layer, target) {
            p.apply_row(x, &mut out[off..off + w], &mut u[..p.rank]);
        }
    }
}

/// [`update_row`] compiled for AVX2 and FMA (eight lanes instead of SSE's four).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn update_row_avx2(
    a: &LoraAdapter,
    layer: usize,
    parts: &[(LoraTarget, usize, usize)],
    x: &[f32],
    out: &mut [f32],
    u: &mut [f32],
) {
    update_row(a, layer, parts, x, out, u)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    /// Tensors to write: name, shape, values.
    type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;
    /// A change to a valid adapter's tensors.
    type Edit = dyn Fn(&mut Tensors);

    /// A small model shape: 2 layers, hidden 32, 4 query heads and 2 KV heads of 8, FFN 48.
    fn tiny(style: RopeStyle) -> LlamaConfig {
        let mut c = LlamaConfig::smollm2_135m();
        c.num_layers = 2;
        c.hidden_size = 32;
        c.num_heads = 4;
        c.num_kv_heads = 2;
        c.head_dim = 8;
        c.rotary_dim = 8;
        c.intermediate_size = 48;
        c.rope_style = style;
        c
    }

    const CONFIG: &str = r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 6, "bias": "none",
        "target_modules": ["q_proj", "v_proj"], "modules_to_save": null, "rank_pattern": {}}"#;

    fn values(n: usize, salt: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.37 + salt).sin()) * 0.1)
            .collect()
    }

    /// `values` as little-endian bf16 bytes.
    fn bf16_bytes(values: &[f32]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect()
    }

    /// The safetensors bytes of `tensors` (name, shape, f32 values) stored as bf16.
    fn file(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
        let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| bf16_bytes(v)).collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, shape, _), b)| {
                (
                    n.clone(),
                    TensorView::new(StDtype::BF16, shape.clone(), b).expect("view"),
                )
            })
            .collect();
        safetensors::serialize(views, None).expect("serialize")
    }

    fn name(layer: usize, module: &str, half: &str) -> String {
        let part = if module.ends_with("_proj") && ["q", "k", "v", "o"].contains(&&module[..1]) {
            "self_attn"
        } else {
            "mlp"
        };
        format!("base_model.model.model.layers.{layer}.{part}.{module}.lora_{half}.weight")
    }

    /// q and v adapted in both layers, rank 2.
    fn valid(c: &LlamaConfig) -> Tensors {
        let mut t = Vec::new();
        for l in 0..c.num_layers {
            for (m, out) in [("q_proj", 32), ("v_proj", 16)] {
                t.push((name(l, m, "A"), vec![2, 32], values(64, l as f32)));
                t.push((
                    name(l, m, "B"),
                    vec![out, 2],
                    values(out * 2, 1.0 + l as f32),
                ));
            }
        }
        t
    }

    fn parse(c: &LlamaConfig, config: &str, bytes: &[u8]) -> Result<LoraAdapter, GpuError> {
        let path = Path::new("adapter");
        let cfg = parse_config(path, config, &LoraLimits::default())?;
        LoraAdapter::from_safetensors(path, bytes, &cfg, c)
    }

    fn err(c: &LlamaConfig, config: &str, bytes: &[u8]) -> String {
        match parse(c, config, bytes) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        }
    }

    /// A tensor of another model's layers (a vision tower's), or a projection under the wrong
    /// parent (`mlp.q_proj`), was applied to the decoder's projection of that name: refused.
    #[test]
    fn tensors_outside_the_decoder_projections_are_refused() {
        let c = tiny(RopeStyle::Halves);
        let cases = [
            (
                "base_model.model.model.layers.0",
                "base_model.model.vision_tower.encoder.layers.0",
                "is not a LoRA A/B matrix of a decoder projection",
            ),
            ("self_attn.q_proj", "mlp.q_proj", "module 'mlp.q_proj'"),
        ];
        for (from, to, needle) in cases {
            let t: Tensors = valid(&c)
                .into_iter()
                .map(|(n, s, v)| (n.replacen(from, to, 1), s, v))
                .collect();
            let e = err(&c, CONFIG, &file(&t));
            assert!(e.contains(needle), "{to}: {e}");
        }
    }

    #[test]
    fn a_valid_adapter_loads_with_its_scale() {
        let c = tiny(RopeStyle::Halves);
        let a = parse(&c, CONFIG, &file(&valid(&c))).expect("valid adapter");
        assert_eq!((a.rank(), a.scale()), (2, 3.0));
        assert_eq!(a.targets(), vec![LoraTarget::Q, LoraTarget::V]);
        assert!(a.fits(&c) && !a.fits(&tiny(RopeStyle::Interleaved)));
        // Per layer: q's A and B (and B transposed), v's.
        assert_eq!(
            a.bytes(),
            2 * (2 * 32 + 2 * 32 * 2 + 2 * 32 + 2 * 16 * 2) * 4
        );
        let rs = CONFIG.replace("\"bias\"", "\"use_rslora\": true, \"bias\"");
        let a = parse(&c, &rs, &file(&valid(&c))).expect("rslora");
        assert!((a.scale() - 6.0 / 2f32.sqrt()).abs() < 1e-6);
    }

    #[test]
    fn bad_configs_are_refused_with_a_reason() {
        let c = tiny(RopeStyle::Halves);
        let f = file(&valid(&c));
        for (config, needle) in [
            (r#"{"lora_alpha": 8}"#, "rank"),
            (r#"{"r": 0}"#, "rank 0"),
            (r#"{"r": 65}"#, "rank 65"),
            (r#"{"r": 2, "lora_alpha": "x"}"#, "lora_alpha"),
            // Echoed short: `{}` wrote 1e300 as 301 digits.
            (
                r#"{"r": 2, "lora_alpha": 1e300}"#,
                "lora_alpha 1e300 is out of range",
            ),
            (r#"{"r": 2, "use_dora": true}"#, "DoRA"),
            (r#"{"r": 2, "fan_in_fan_out": true}"#, "fan_in_fan_out"),
            (r#"{"r": 2, "rank_pattern": {"q_proj": 8}}"#, "rank_pattern"),
            (
                r#"{"r": 2, "alpha_pattern": {"q_proj": 8}}"#,
                "alpha_pattern",
            ),
            (
                r#"{"r": 2, "modules_to_save": ["lm_head"]}"#,
                "modules_to_save",
            ),
            (r#"{"r": 2, "bias": "all"}"#, "bias"),
            (r#"{"r": 2, "peft_type": "IA3"}"#, "IA3"),
            (r#"[1, 2]"#, "object"),
            (r#"{"r": 2"#, "EOF"),
        ] {
            let e = err(&c, config, &f);
            assert!(e.contains(needle), "{config}: {e}");
        }
        // A number of 300 digits is not echoed whole either.
        let long = format!(r#"{{"r": 2, "lora_alpha": 1{}}}"#, "0".repeat(299));
        let e = err(&c, &long, &f);
        assert!(
            e.contains("lora_alpha 1e299 is out of range") && e.len() < 200,
            "{e}"
        );
    }

    #[test]
    fn bad_tensors_are_refused_with_a_reason() {
        let c = tiny(RopeStyle::Halves);
        let with = |edit: &Edit| {
            let mut t = valid(&c);
            edit(&mut t);
            err(&c, CONFIG, &file(&t))
        };
        let cases: [(&Edit, &str); 7] = [
            (
                &|t| {
                    t[0].1 = vec![2, 31];
                    t[0].2.truncate(62)
                },
                "shape",
            ),
            (
                &|t| {
                    t[1].1 = vec![32, 3];
                    t[1].2 = values(96, 0.5)
                },
                "shape",
            ),
            (&|t| t[0].0 = name(2, "q_proj", "A"), "layer 2"),
            (
                &|t| t[0].0 = "base_model.model.lm_head.lora_A.weight".into(),
                "not a LoRA",
            ),
            (
                &|t| t[0].0 = name(0, "x_proj", "A"),
                "not a Llama projection",
            ),
            (&|t| drop(t.remove(1)), "come together"),
            (&|t| t[0].2[3] = f32::NAN, "NaN"),
        ];
        for (edit, needle) in cases {
            let e = with(edit);
            assert!(e.contains(needle), "{needle}: {e}");
        }
        assert!(err(&c, CONFIG, &file(&[])).contains("no tensors"));
        assert!(err(&c, CONFIG, b"not a safetensors file").contains("adapter"));
    }

    /// Flips bytes all over a valid file, mostly in its header: every result must be an `Ok`
    /// or an `Err`, never a panic.
    #[test]
    fn byte_mutations_never_panic() {
        let c = tiny(RopeStyle::Interleaved);
        let base = file(&valid(&c));
        crate::fuzz::byte_mutations(&base, 5_000, 0x2545_f491_4f6c_dd1d, Some(1024), |b| {
            let _ = parse(&c, CONFIG, b);
        });
    }

    #[test]
    fn deltas_are_scale_times_b_a_x_on_the_right_rows() {
        for style in [RopeStyle::Halves, RopeStyle::Interleaved] {
            let c = tiny(style);
            let t = valid(&c);
            let a = parse(&c, CONFIG, &file(&t)).expect("adapter");
            // Values as stored (bf16).
            let r = |v: &[f32]| -> Vec<f32> {
                v.iter()
                    .map(|x| half::bf16::from_f32(*x).to_f32())
                    .collect()
            };
            let (qa, qb) = (r(&t[4].2), r(&t[5].2)); // layer 1 q
            let x: Vec<f32> = (0..2 * 32).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut out = vec![1f32; 2 * 48];
            let rows = [Some(&a), None];
            add_deltas(
                1,
                &[(LoraTarget::Q, 0, 32), (LoraTarget::K, 32, 16)],
                &x,
                32,
                &mut out,
                &rows,
            );
            // Row 0: q part gains 3 * B (A x) in HF order, permuted for GGUF; k part untouched.
            let u: Vec<f32> = (0..2)
                .map(|j| (0..32).map(|k| qa[j * 32 + k] * x[k]).sum())
                .collect();
            let hf: Vec<f32> = (0..32)
                .map(|o| 3.0 * (qb[o * 2] * u[0] + qb[o * 2 + 1] * u[1]))
                .collect();
            for (j, o) in out[..32].iter().enumerate() {
                let (h, d) = (j / 8, j % 8);
                let src = match style {
                    RopeStyle::Halves => j,
                    RopeStyle::Interleaved => h * 8 + (d % 2) * 4 + d / 2,
                };
                assert!((o - 1.0 - hf[src]).abs() < 1e-5, "{style:?} row {j}");
            }
            assert!(out[32..48].iter().all(|&v| v == 1.0), "k has no pair");
            assert!(out[48..].iter().all(|&v| v == 1.0), "row 1 has no adapter");
        }
    }

    /// Regression: `B` was checked for finiteness before it was scaled, so finite values
    /// times a large `lora_alpha / r` reached the model as infinities.
    #[test]
    fn b_that_overflows_once_scaled_is_refused() {
        let c = tiny(RopeStyle::Halves);
        let mut t = valid(&c);
        t[1].2[0] = 1e36;
        let config = CONFIG.replace("\"lora_alpha\": 6", "\"lora_alpha\": 1000000");
        let e = err(&c, &config, &file(&t));
        assert!(e.contains("lora_B scaled by") && e.contains("inf"), "{e}");
    }

    /// A scratch directory for one test.
    fn scratch(tag: &str) -> crate::scratch::ScratchDir {
        crate::scratch::ScratchDir::new(&format!("lora-{tag}"))
    }

    /// An adapter file is read only if it is a regular file (a directory, a link to
    /// `/dev/zero` or a FIFO is refused before it is opened), and never past its bound.
    #[test]
    fn adapter_files_must_be_regular_and_are_read_to_a_bound() {
        let (d, irregular) = crate::model::testing::irregular_paths("lora");
        for p in irregular {
            let e = read_regular_file(&p, 1 << 20).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{}: {e}", p.display());
            assert!(e.contains("invalid LoRA adapter"), "{e}");
        }
        let p = d.join("ten");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_regular_file(&p, 10).unwrap(), b"0123456789");
        let e = read_regular_file(&p, 9).unwrap_err().to_string();
        assert!(e.contains("more than 9 bytes"), "{e}");
    }

    #[test]
    fn fingerprints_follow_the_files() {
        let c = tiny(RopeStyle::Halves);
        let d = scratch("fingerprint");
        std::fs::write(d.join("adapter_config.json"), CONFIG).unwrap();
        std::fs::write(d.join("adapter_model.safetensors"), file(&valid(&c))).unwrap();
        let limits = LoraLimits::default();
        let a = LoraAdapter::load(&d, &c, &limits).expect("adapter");
        let again = LoraAdapter::load(&d, &c, &limits).expect("adapter");
        assert_ne!(a.uid(), again.uid());
        assert_eq!(a.fingerprint(), again.fingerprint(), "unchanged files");
        let mut t = valid(&c);
        t[1].2[0] += 0.25;
        std::fs::write(d.join("adapter_model.safetensors"), file(&t)).unwrap();
        let changed = LoraAdapter::load(&d, &c, &limits).expect("adapter");
        assert_ne!(a.fingerprint(), changed.fingerprint(), "other weights");
        std::fs::write(d.join("adapter_model.safetensors"), file(&valid(&c))).unwrap();
        let alpha = CONFIG.replace("\"lora_alpha\": 6", "\"lora_alpha\": 8");
        std::fs::write(d.join("adapter_config.json"), alpha).unwrap();
        let rescaled = LoraAdapter::load(&d, &c, &limits).expect("adapter");
        assert_ne!(a.fingerprint(), rescaled.fingerprint(), "another scale");
    }

    /// A file larger than any adapter of its rank for the model is refused before it is
    /// read (it was read whole, up to `max_file_bytes`, 4 GiB, before its tensors were
    /// checked); the test adapter's file is well within the bound.
    #[test]
    fn a_file_larger_than_any_adapter_of_its_rank_is_refused_unread() {
        let c = tiny(RopeStyle::Halves);
        // Per layer: q 32+32, k and v 32+16, o 32+32, gate and up 32+48, down 48+32.
        let largest = largest_adapter_file(&c, 2);
        assert_eq!(largest, 464 * 2 * 2 * 4 + HEADER_ALLOWANCE);
        let d = scratch("largest");
        std::fs::write(d.join("adapter_config.json"), CONFIG).unwrap();
        let f = std::fs::File::create(d.join("adapter_model.safetensors")).unwrap();
        f.set_len(largest + 1).unwrap();
        let e = LoraAdapter::load(&d, &c, &LoraLimits::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("is {} bytes", largest + 1))
                && e.contains("more than an adapter of rank 2"),
            "{e}"
        );
        let smollm2 = LlamaConfig::smollm2_135m();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/lora/smollm2-r4/adapter_model.safetensors");
        let len = std::fs::metadata(fixture).unwrap().len();
        assert!(len < largest_adapter_file(&smollm2, 4), "{len}");
    }

    /// `config` and the safetensors `bytes` written as an adapter in `d`: what
    /// [`LoraAdapter::check`] and a load say of it (errors as text).
    fn check_and_load(
        d: &Path,
        c: &LlamaConfig,
        config: &str,
        bytes: &[u8],
    ) -> (Result<(), String>, Result<(), String>) {
        std::fs::write(d.join("adapter_config.json"), config).unwrap();
        std::fs::write(d.join("adapter_model.safetensors"), bytes).unwrap();
        let limits = LoraLimits::default();
        (
            LoraAdapter::check(d, c, &limits).map_err(|e| e.to_string()),
            LoraAdapter::load(d, c, &limits)
                .map(drop)
                .map_err(|e| e.to_string()),
        )
    }

    /// The check before a load into full memory refuses, for the load's reason, every adapter
    /// a load refuses for its configuration, its header or its tensors' names, types and
    /// shapes; only values (not finite, once scaled) are left to the load.
    #[test]
    fn the_header_check_refuses_what_a_load_refuses_but_values() {
        let c = tiny(RopeStyle::Halves);
        let d = scratch("check");
        let ok = file(&valid(&c));
        let (check, load) = check_and_load(&d, &c, CONFIG, &ok);
        assert_eq!((check, load), (Ok(()), Ok(())));
        let edited = |edit: &Edit| {
            let mut t = valid(&c);
            edit(&mut t);
            file(&t)
        };
        // An F64 tensor of the right shape, in place of layer 0's q A.
        let f64_file = {
            let mut t = valid(&c);
            t.remove(0);
            let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
            let bf16: Vec<Vec<u8>> = t.iter().map(|(_, _, v)| bf16_bytes(v)).collect();
            let f64s: Vec<u8> = values(64, 0.0)
                .iter()
                .flat_map(|x| f64::from(*x).to_le_bytes())
                .collect();
            views.push((
                name(0, "q_proj", "A"),
                TensorView::new(StDtype::F64, vec![2, 32], &f64s).unwrap(),
            ));
            for ((n, shape, _), b) in t.iter().zip(&bf16) {
                views.push((
                    n.clone(),
                    TensorView::new(StDtype::BF16, shape.clone(), b).unwrap(),
                ));
            }
            safetensors::serialize(views, None).unwrap()
        };
        let mut truncated = ok.clone();
        truncated.truncate(ok.len() - 1);
        let mut long_header = ok.clone();
        long_header[..8].copy_from_slice(&(ok.len() as u64).to_le_bytes());
        let twice = edited(&|t| {
            let mut again = t[0].clone();
            again.0 = again.0.replace("lora_A.weight", "lora_A.default.weight");
            t.push(again)
        });
        let o_only = CONFIG.replace(r#"["q_proj", "v_proj"]"#, r#"["o_proj"]"#);
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("{not json", ok.clone(), "adapter_config.json"),
            (r#"{"r": 65}"#, ok.clone(), "rank 65"),
            (r#"{"r": 2, "use_dora": true}"#, ok.clone(), "DoRA"),
            (CONFIG, b"not safetensors".to_vec(), "safetensors"),
            (CONFIG, b"short".to_vec(), "safetensors"),
            (CONFIG, truncated, "safetensors"),
            (CONFIG, long_header, "safetensors"),
            (CONFIG, file(&[]), "no tensors"),
            (
                CONFIG,
                edited(&|t| {
                    t[0].1 = vec![2, 16];
                    t[0].2.truncate(32)
                }),
                "shape",
            ),
            (
                CONFIG,
                edited(&|t| t[0].0 = name(2, "q_proj", "A")),
                "layer 2",
            ),
            (
                CONFIG,
                edited(&|t| t[0].0 = "base_model.model.lm_head.lora_A.weight".into()),
                "not a LoRA",
            ),
            (CONFIG, edited(&|t| drop(t.remove(1))), "come together"),
            (CONFIG, twice, "appears twice"),
            (CONFIG, f64_file, "F64"),
            (&o_only, ok.clone(), "select none of its tensors"),
        ];
        for (config, bytes, needle) in cases {
            let (check, load) = check_and_load(&d, &c, config, &bytes);
            let (check, load) = (check.unwrap_err(), load.unwrap_err());
            assert!(check.contains(needle), "{needle}: {check}");
            assert!(load.contains(needle), "{needle}: {load}");
        }
        // A file larger than its rank allows, and a missing one, are refused unread.
        let (check, load) = check_and_load(&d, &c, CONFIG, &ok);
        assert!(check.is_ok() && load.is_ok());
        std::fs::remove_file(d.join("adapter_model.safetensors")).unwrap();
        let limits = LoraLimits::default();
        let e = LoraAdapter::check(&d, &c, &limits).unwrap_err().to_string();
        assert!(e.contains("no adapter_model.safetensors"), "{e}");
        let f = std::fs::File::create(d.join("adapter_model.safetensors")).unwrap();
        f.set_len(largest_adapter_file(&c, 2) + 1).unwrap();
        let e = LoraAdapter::check(&d, &c, &limits).unwrap_err().to_string();
        assert!(e.contains("more than an adapter of rank 2"), "{e}");
        // Values are the load's to check: a NaN passes the check and fails the load.
        let (check, load) = check_and_load(&d, &c, CONFIG, &edited(&|t| t[0].2[3] = f32::NAN));
        assert_eq!(check, Ok(()));
        assert!(load.unwrap_err().contains("NaN"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Whatever is written over a valid file's length field and JSON header, the check
        /// before a load into full memory refuses nothing a load accepts, and what it refuses
        /// a load refuses for the same reason.
        #[test]
        fn the_header_check_refuses_nothing_a_load_accepts(
            edits in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 1..4),
            printable in proptest::prelude::any::<bool>(),
        ) {
            let c = tiny(RopeStyle::Halves);
            let d = scratch("check-prop");
            let mut bytes = file(&valid(&c));
            let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            // Printable: anywhere in the JSON; else a digit of it for another (the shapes'
            // and offsets' numbers: JSON still, wrong figures).
            let digits: Vec<usize> = (8..header).filter(|&i| bytes[i].is_ascii_digit()).collect();
            for (at, b) in edits {
                if printable {
                    bytes[8 + at % (header - 8)] = b' ' + b % 95;
                } else {
                    bytes[digits[at % digits.len()]] = b'0' + b % 10;
                }
            }
            let (check, load) = check_and_load(&d, &c, CONFIG, &bytes);
            if let Err(e) = &check {
                // Of tensors whose offsets an edit made equal, safetensors names whichever its
                // hash map put first (its own tests say so): the name is not the reason.
                let unnamed = |m: &str| match m.find("invalid offset for tensor `") {
                    Some(at) => m[..at].to_string() + "invalid offset for tensor",
                    None => m.to_string(),
                };
                proptest::prop_assert_eq!(
                    load.as_ref().err().map(|m| unnamed(m)),
                    Some(unnamed(e)),
                    "check {:?}",
                    check
                );
            }
        }
    }

    /// A header whose length field says more than the file's bound is refused before that
    /// many bytes are read or held; a FIFO in place of the file is never opened.
    #[test]
    fn the_header_check_reads_to_the_load_s_bounds() {
        let c = tiny(RopeStyle::Halves);
        let d = scratch("check-bounds");
        let mut huge = file(&valid(&c));
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let (check, _) = check_and_load(&d, &c, CONFIG, &huge);
        assert!(check.unwrap_err().contains("too large"));
        let e = read_header(&d.join("adapter_model.safetensors"), 10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 10 bytes"), "{e}");
        let (_irregular, paths) = crate::model::testing::irregular_paths("lora-check");
        for p in paths {
            let e = read_header(&p, 1 << 20).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{}: {e}", p.display());
        }
    }

    /// The check without the model (`config check`, `serve` before its load) reads
    /// `adapter_config.json` as a load does: it returns the rank, and refuses a rank above the
    /// configured bound, a file that is not a JSON object or is past the 1 MiB bound, and a
    /// directory without the weights' file, for a load's reasons; the weights are not read.
    #[test]
    fn the_files_check_reads_the_configuration_as_a_load_does() {
        let d = scratch("check-files");
        let config = d.join("adapter_config.json");
        let weights = d.join("adapter_model.safetensors");
        let limits = |max_rank| LoraLimits {
            max_rank,
            ..LoraLimits::default()
        };
        std::fs::write(&config, CONFIG).unwrap();
        let e = LoraAdapter::check_files(&d, &limits(64)).unwrap_err();
        assert!(
            e.to_string().contains("no adapter_model.safetensors"),
            "{e}"
        );
        // Not a safetensors file at all: its content is left to the load.
        std::fs::write(&weights, b"not read").unwrap();
        assert_eq!(LoraAdapter::check_files(&d, &limits(64)).unwrap(), 2);
        let e = LoraAdapter::check_files(&d, &limits(1)).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("rank 2 is outside 1..=1 (max_lora_rank)"),
            "{e}"
        );
        for (text, why) in [
            ("[]".to_string(), "not a JSON object"),
            (" ".repeat(2 << 20), "too large"),
            ("{\"r\": 4, \"use_dora\": true}".into(), "DoRA"),
        ] {
            std::fs::write(&config, text).unwrap();
            let e = LoraAdapter::check_files(&d, &limits(64)).unwrap_err();
            assert!(e.to_string().contains(why), "{why}: {e}");
        }
        std::fs::remove_file(&config).unwrap();
        let e = LoraAdapter::check_files(&d, &limits(64)).unwrap_err();
        assert!(e.to_string().contains("no adapter_config.json"), "{e}");
    }

    #[test]
    fn gguf_row_permutation_matches_llama_cpp() {
        // llama.cpp: w.reshape(heads, 2, d/2, ...).swapaxes(1, 2).reshape(...): GGUF row
        // h*d + 2i + s holds HF row h*d + s*d/2 + i.
        let (heads, d, rank) = (2, 4, 1);
        let b: Vec<f32> = (0..heads * d).map(|i| i as f32).collect();
        let p = permute_head_rows(&b, heads, &gguf_row_order(d), rank);
        assert_eq!(p, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
    }

    /// A partial rotary embedding (4 of 8 dimensions): the rotated pairs (0, 2) and (1, 3) of
    /// each head become the halves' pairs (0, 4) and (1, 5), the unrotated dimensions 4 to 7
    /// the pairs (2, 6) and (3, 7); rank-2 rows move whole.
    #[test]
    fn partial_rotary_rows_move_as_the_loader_moves_them() {
        let order = crate::model::loader::partial_rotary_order(8, 4);
        assert_eq!(order, vec![0, 1, 4, 5, 2, 3, 6, 7]);
        let (heads, rank) = (2, 2);
        let b: Vec<f32> = (0..heads * 8 * rank).map(|i| i as f32).collect();
        let p = permute_head_rows(&b, heads, &order, rank);
        for h in 0..heads {
            for (j, &o) in order.iter().enumerate() {
                let (dst, src) = ((h * 8 + j) * rank, (h * 8 + o) * rank);
                assert_eq!(p[dst..dst + rank], b[src..src + rank]);
            }
        }
    }

    #[test]
    fn names_parse() {
        assert_eq!(
            parse_name("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight"),
            Some((12, "self_attn.q_proj", false))
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight"),
            Some((0, "mlp.down_proj", true))
        );
        assert_eq!(
            parse_name("model.layers.3.mlp.up_proj.lora_B.weight"),
            Some((3, "mlp.up_proj", true))
        );
        // Another stack's layers (a vision tower's) are not the decoder's.
        assert_eq!(
            parse_name(
                "base_model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight"
            ),
            None
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.0.self_attn.q_proj.extra.lora_A.weight"),
            None
        );
        assert_eq!(parse_name("base_model.model.lm_head.lora_A.weight"), None);
        assert_eq!(
            parse_name("base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector"),
            None
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.x.mlp.up_proj.lora_A.weight"),
            None
        );
    }
}
