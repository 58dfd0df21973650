//! RoPE frequency scaling, the ways models stretch their rotary embedding past the context
//! they were pre-trained with: Meta's Llama 3.1 scheme, position interpolation ("linear"),
//! YaRN (Qwen2.5 and Qwen3 past 32K tokens, DeepSeek) and LongRoPE (Phi-3), read from a
//! Hugging Face `config.json` or from GGUF metadata, and the rotary frequencies each gives.
//! "dynamic" (NTK) scaling is refused.
//!
//! LongRoPE divides each frequency by a factor of its own, from one list for contexts within
//! the pre-training context and another for longer ones. transformers picks the list per
//! forward pass by the sequence's length, which a KV cache (and a shared prefix) cannot
//! follow: here it is picked once, by the context the model is served with (the model's,
//! lowered to `model.max_model_len` when that is set: [`super::LlamaConfig::serve_context`]),
//! as llama.cpp picks it by its context size.
//!
//! YaRN also scales the rotated query and key by its attention factor (transformers multiplies
//! cos and sin by it, so the attention logits grow by its square): the CPU backend multiplies
//! its cos/sin table as transformers does, the CUDA backend folds the square into the softmax
//! scale ([`super::LlamaConfig::attention_scale`]), which gives the same logits.

use crate::error::GpuError;

/// RoPE frequency scaling.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1's frequency-dependent scheme.
    Llama3(Llama3Scaling),
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// How many times longer the context is.
        factor: f32,
    },
    /// YaRN (Peng et al. 2023).
    Yarn(YarnScaling),
    /// LongRoPE (Ding et al. 2024), Phi-3's.
    LongRope(LongRopeScaling),
}

/// The most rotary pairs a LongRoPE list holds (heads of up to 256 dimensions).
pub const MAX_ROPE_PAIRS: usize = 128;

/// LongRoPE: each rotary frequency divided by its own factor, from `short` within the
/// pre-training context and from `long` past it (transformers' `_compute_longrope_parameters`).
#[derive(Clone, Debug, PartialEq)]
pub struct LongRopeScaling {
    /// Rotary pairs (`head_dim / 2`): the length of both lists.
    pub pairs: usize,
    /// Divisors within the pre-training context.
    pub short: std::sync::Arc<[f32]>,
    /// Divisors past it.
    pub long: std::sync::Arc<[f32]>,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// Multiplier of the rotated query and key (`sqrt(1 + ln(factor) / ln(original))` for a
    /// context `factor` times the original unless the model says).
    pub attention_factor: f32,
    /// The context the scaling makes room for (the configuration's).
    pub context: usize,
    /// Whether the model is served past the pre-training context: `long` is used.
    pub use_long: bool,
}

impl LongRopeScaling {
    /// LongRoPE with the `short` and `long` divisors (of the same length) for a model of
    /// `context` tokens pre-trained on `original`: the long ones past it, and the attention
    /// factor the model gives or else transformers' default for a stretch of `factor` (the
    /// context over the original unless given): `sqrt(1 + ln(factor) / ln(original))`, 1 when
    /// nothing is stretched.
    pub fn new(
        short: std::sync::Arc<[f32]>,
        long: std::sync::Arc<[f32]>,
        original: usize,
        context: usize,
        factor: Option<f64>,
        attention_factor: Option<f64>,
    ) -> Result<Self, GpuError> {
        if short.len() != long.len() {
            return Err(GpuError::InvalidConfig(format!(
                "LongRoPE's short factors number {} and its long ones {}",
                short.len(),
                long.len()
            )));
        }
        let factor = factor.unwrap_or(context as f64 / original.max(1) as f64);
        let attention_factor = match attention_factor {
            Some(a) => a,
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
        };
        Ok(LongRopeScaling {
            pairs: short.len(),
            short,
            long,
            original_max_position_embeddings: original,
            attention_factor: attention_factor as f32,
            context,
            use_long: context > original,
        })
    }

    /// The divisors in use.
    pub fn factors(&self) -> &[f32] {
        if self.use_long {
            &self.long
        } else {
            &self.short
        }
    }
}

/// Llama 3.1 "llama3" RoPE frequency scaling: wavelengths longer than
/// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, shorter than
/// `.../high_freq_factor` kept, smoothly interpolated between.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Llama3Scaling {
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

/// YaRN: the frequencies that turn fewer than `beta_slow` times over the original context are
/// divided by `factor`, those that turn more than `beta_fast` times kept, a linear ramp
/// between (over the rotary dimensions, transformers' `_compute_yarn_parameters`).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct YarnScaling {
    /// How many times longer the context is.
    pub factor: f32,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// Rotations over the original context above which a frequency is kept (32).
    pub beta_fast: f32,
    /// Rotations below which a frequency is divided by `factor` (1).
    pub beta_slow: f32,
    /// Multiplier of the rotated query and key (`0.1 ln(factor) + 1` unless the model says).
    pub attention_factor: f32,
    /// Whether the ramp's ends are rounded out to whole dimensions (transformers' `truncate`,
    /// true unless the model says).
    pub truncate: bool,
}

/// Most a context may be stretched (Llama 3.2's 32 and DeepSeek-V3's 40 are the largest
/// published); with the cap on the context itself, keeps every derived length finite.
const MAX_FACTOR: f32 = 1024.0;

/// YaRN's attention factor for a stretch of `scale` (`mscale` 1 unless given): transformers'
/// and the YaRN paper's `0.1 mscale ln(scale) + 1`.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// How many times longer the context is.
    pub fn factor(&self) -> f32 {
        match self {
            RopeScaling::Llama3(s) => s.factor,
            RopeScaling::Linear { factor } => *factor,
            RopeScaling::Yarn(y) => y.factor,
            RopeScaling::LongRope(l) => {
                l.context as f32 / l.original_max_position_embeddings.max(1) as f32
            }
        }
    }

    /// The multiplier of the rotated query and key (1 except under YaRN).
    pub fn attention_factor(&self) -> f32 {
        match self {
            RopeScaling::Yarn(y) => y.attention_factor,
            RopeScaling::LongRope(l) => l.attention_factor,
            _ => 1.0,
        }
    }

    /// The context the scaling makes room for, given the configuration's own: Llama 3.1's
    /// configurations already state theirs; YaRN's the original context times the factor,
    /// linear's the stated one times the factor (vLLM's reading); never less than stated, at
    /// most `cap`.
    pub fn context(&self, stated: usize, cap: usize) -> usize {
        let stretched = match self {
            RopeScaling::Llama3(_) => stated as f64,
            RopeScaling::Linear { factor } => stated as f64 * f64::from(*factor),
            RopeScaling::Yarn(y) => y.original_max_position_embeddings as f64 * f64::from(y.factor),
            // Phi-3's configurations state the stretched context.
            RopeScaling::LongRope(_) => stated as f64,
        };
        (stretched.round().min(cap as f64) as usize).max(stated.min(cap))
    }

    /// Checks the parameters (finite, in range).
    pub fn validate(&self) -> Result<(), GpuError> {
        let factor_ok = |f: f32| f.is_finite() && (1.0..=MAX_FACTOR).contains(&f);
        let ok = match self {
            RopeScaling::Llama3(s) => {
                factor_ok(s.factor)
                    && s.low_freq_factor > 0.0
                    && s.high_freq_factor > s.low_freq_factor
                    && s.high_freq_factor.is_finite()
                    && s.original_max_position_embeddings > 0
            }
            RopeScaling::Linear { factor } => factor_ok(*factor),
            RopeScaling::Yarn(y) => {
                factor_ok(y.factor)
                    && y.original_max_position_embeddings > 0
                    && y.beta_fast.is_finite()
                    && y.beta_slow > 0.0
                    && y.beta_fast > y.beta_slow
                    && y.attention_factor.is_finite()
                    && y.attention_factor > 0.0
                    && y.attention_factor <= 16.0
            }
            RopeScaling::LongRope(l) => {
                let list_ok = |v: &[f32]| {
                    v.len() == l.pairs
                        && v.iter()
                            .all(|f| f.is_finite() && (1e-3..=MAX_FACTOR).contains(f))
                };
                (1..=MAX_ROPE_PAIRS).contains(&l.pairs)
                    && list_ok(&l.short)
                    && list_ok(&l.long)
                    && l.original_max_position_embeddings > 0
                    && l.attention_factor.is_finite()
                    && l.attention_factor > 0.0
                    && l.attention_factor <= 16.0
            }
        };
        if ok {
            Ok(())
        } else {
            Err(GpuError::InvalidConfig(format!(
                "invalid rope scaling {self:?}"
            )))
        }
    }

    /// Scales the default inverse frequencies `inv_freq` (`head_dim / 2` of them, for
    /// `rope_theta`) in place, as transformers computes them.
    pub fn apply(&self, inv_freq: &mut [f32], rope_theta: f32) {
        match self {
            RopeScaling::Llama3(s) => {
                let old = s.original_max_position_embeddings as f32;
                let low_wavelen = old / s.low_freq_factor;
                let high_wavelen = old / s.high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= s.factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                    }
                }
            }
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::LongRope(l) => {
                let dim = (2 * inv_freq.len()) as f32;
                for (i, (f, d)) in inv_freq.iter_mut().zip(l.factors()).enumerate() {
                    // transformers' 1 / (factor * base^(2i/d)), in f32.
                    *f = 1.0 / (d * rope_theta.powf((2 * i) as f32 / dim));
                }
            }
            RopeScaling::Yarn(y) => {
                let dim = 2 * inv_freq.len();
                let (low, high) = yarn_ramp_ends(y, dim, rope_theta);
                let span = if low == high { 0.001 } else { high - low };
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    // 1 where the frequency is divided by the factor, 0 where it is kept.
                    let ramp = ((i as f64 - low) / span).clamp(0.0, 1.0);
                    let interpolated = f64::from(*f) / f64::from(y.factor);
                    let kept = 1.0 - ramp;
                    *f = (interpolated * (1.0 - kept) + f64::from(*f) * kept) as f32;
                }
            }
        }
    }
}

/// The rotary pairs where YaRN's ramp starts and ends, for `dim` rotated dimensions.
fn yarn_ramp_ends(y: &YarnScaling, dim: usize, base: f32) -> (f64, f64) {
    let (d, base) = (dim as f64, f64::from(base));
    let orig = y.original_max_position_embeddings as f64;
    // The dimension whose frequency turns `rotations` times over the original context.
    let dim_of = |rotations: f32| {
        d * (orig / (f64::from(rotations) * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let (mut low, mut high) = (dim_of(y.beta_fast), dim_of(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    (low.max(0.0), high.min(d - 1.0))
}

/// A number field of a scaling object.
fn number(v: &serde_json::Value, k: &str) -> Result<Option<f64>, GpuError> {
    match v.get(k) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| {
            GpuError::InvalidConfig(format!("rope_scaling.{k} is {x}, not a number"))
        }),
    }
}

/// A context length field of a scaling object.
fn length(v: &serde_json::Value, k: &str) -> Result<Option<usize>, GpuError> {
    match number(v, k)? {
        None => Ok(None),
        Some(x) if x >= 1.0 && x <= (1u64 << 40) as f64 && x.fract() == 0.0 => Ok(Some(x as usize)),
        Some(x) => Err(GpuError::InvalidConfig(format!(
            "rope_scaling.{k} is {x}, not a length"
        ))),
    }
}

/// Reads a Hugging Face `rope_scaling` (or transformers 5's `rope_parameters`) object;
/// `max_position_embeddings` is the configuration's (YaRN's default original context).
pub fn from_hf(
    v: &serde_json::Value,
    max_position_embeddings: usize,
) -> Result<Option<RopeScaling>, GpuError> {
    if v.is_null() {
        return Ok(None);
    }
    if !v.is_object() {
        return Err(GpuError::InvalidConfig(format!(
            "rope_scaling is {v}, not an object"
        )));
    }
    let ty = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let required = |k: &str| {
        number(v, k)?
            .ok_or_else(|| GpuError::InvalidConfig(format!("rope_scaling lacks numeric {k}")))
    };
    let scaling = match ty {
        "default" => return Ok(None),
        "llama3" => RopeScaling::Llama3(Llama3Scaling {
            factor: required("factor")? as f32,
            low_freq_factor: required("low_freq_factor")? as f32,
            high_freq_factor: required("high_freq_factor")? as f32,
            original_max_position_embeddings: length(v, "original_max_position_embeddings")?
                .ok_or_else(|| {
                    GpuError::InvalidConfig(
                        "rope_scaling lacks numeric original_max_position_embeddings".into(),
                    )
                })?,
        }),
        "linear" => RopeScaling::Linear {
            factor: required("factor")? as f32,
        },
        "yarn" => {
            let original =
                length(v, "original_max_position_embeddings")?.unwrap_or(max_position_embeddings);
            // DeepSeek-V3's form: no factor, the stated context over the original one.
            let factor = match number(v, "factor")? {
                Some(f) => f,
                None => max_position_embeddings as f64 / original as f64,
            };
            let attention_factor = match number(v, "attention_factor")? {
                Some(a) => a,
                None => match (number(v, "mscale")?, number(v, "mscale_all_dim")?) {
                    (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        yarn_mscale(factor, m) / yarn_mscale(factor, all)
                    }
                    _ => yarn_mscale(factor, 1.0),
                },
            };
            // transformers reads `beta_fast or 32`: 0 is the default too.
            let beta = |k: &str, default: f64| -> Result<f64, GpuError> {
                Ok(number(v, k)?.filter(|b| *b != 0.0).unwrap_or(default))
            };
            let truncate = match v.get("truncate") {
                None | Some(serde_json::Value::Null) => true,
                Some(t) => t.as_bool().ok_or_else(|| {
                    GpuError::InvalidConfig(format!("rope_scaling.truncate is {t}, not a bool"))
                })?,
            };
            RopeScaling::Yarn(YarnScaling {
                factor: factor as f32,
                original_max_position_embeddings: original,
                beta_fast: beta("beta_fast", 32.0)? as f32,
                beta_slow: beta("beta_slow", 1.0)? as f32,
                attention_factor: attention_factor as f32,
                truncate,
            })
        }
        "longrope" | "su" => {
            let original = length(v, "original_max_position_embeddings")?.ok_or_else(|| {
                GpuError::InvalidConfig(
                    "LongRoPE scaling lacks original_max_position_embeddings".into(),
                )
            })?;
            RopeScaling::LongRope(LongRopeScaling::new(
                factor_list(v, "short_factor")?,
                factor_list(v, "long_factor")?,
                original,
                max_position_embeddings,
                number(v, "factor")?,
                number(v, "attention_factor")?,
            )?)
        }
        other => {
            return Err(GpuError::InvalidConfig(format!(
                "unsupported rope_scaling type '{other}' (supported: llama3, linear, yarn, \
                 longrope)"
            )))
        }
    };
    scaling.validate()?;
    Ok(Some(scaling))
}

/// A LongRoPE factor list of a scaling object (1 to [`MAX_ROPE_PAIRS`] numbers).
fn factor_list(v: &serde_json::Value, k: &str) -> Result<std::sync::Arc<[f32]>, GpuError> {
    let bad = |m: &str| Err(GpuError::InvalidConfig(format!("rope_scaling.{k} {m}")));
    let Some(list) = v.get(k).and_then(|x| x.as_array()) else {
        return bad("is not a list");
    };
    if list.is_empty() || list.len() > MAX_ROPE_PAIRS {
        return bad(&format!(
            "has {} entries (1 to {MAX_ROPE_PAIRS})",
            list.len()
        ));
    }
    match list.iter().map(|x| x.as_f64().map(|f| f as f32)).collect() {
        Some(out) => Ok(out),
        None => bad("holds something other than numbers"),
    }
}

/// Reads GGUF's `{arch}.rope.scaling.*` keys (llama.cpp's converter writes the type, the
/// factor and, for YaRN, the original context; Llama 3.1's scaling comes as the
/// `rope_freqs.weight` tensor instead, see [`from_freq_factors`]). `context` is the file's
/// `context_length`. YaRN variants llama.cpp marks with other keys (DeepSeek's log
/// multiplier, an attention or extension factor of its own) are refused.
pub fn from_gguf(
    h: &super::gguf::GgufHeader,
    arch: &str,
    context: usize,
) -> Result<Option<RopeScaling>, GpuError> {
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    let factor = || {
        h.get_f32(&key("factor")).ok_or_else(|| {
            GpuError::InvalidConfig(format!("GGUF rope scaling without {}", key("factor")))
        })
    };
    let scaling = match h.get_str(&key("type")) {
        None | Some("none") => return Ok(None),
        Some("linear") => RopeScaling::Linear { factor: factor()? },
        Some("yarn") => {
            for (k, default) in [
                ("attn_factor", 1.0),
                ("yarn_attn_factor", 1.0),
                ("yarn_ext_factor", 1.0),
                ("yarn_log_multiplier", 0.0),
            ] {
                // llama.cpp's -1 for the extension factor means "the default" (1 for YaRN).
                match h.get_f32(&key(k)) {
                    Some(v) if v == default || (k == "yarn_ext_factor" && v < 0.0) => {}
                    Some(v) => {
                        return Err(GpuError::InvalidConfig(format!(
                            "unsupported GGUF YaRN variant: {} = {v}",
                            key(k)
                        )))
                    }
                    None => {}
                }
            }
            let factor = factor()?;
            RopeScaling::Yarn(YarnScaling {
                factor,
                original_max_position_embeddings: h
                    .get_usize(&key("original_context_length"))
                    .unwrap_or(context),
                beta_fast: h.get_f32(&key("yarn_beta_fast")).unwrap_or(32.0),
                beta_slow: h.get_f32(&key("yarn_beta_slow")).unwrap_or(1.0),
                attention_factor: yarn_mscale(f64::from(factor), 1.0) as f32,
                truncate: true,
            })
        }
        Some(other) => {
            return Err(GpuError::InvalidConfig(format!(
                "unsupported GGUF rope scaling type '{other}' (supported: linear, yarn)"
            )))
        }
    };
    scaling.validate()?;
    Ok(Some(scaling))
}

/// Recovers Llama 3 RoPE scaling from llama.cpp's `rope_freqs.weight` tensor, which stores
/// one divisor per rotary frequency instead of the scaling parameters. In the transition band
/// the divisor `r` satisfies `1/r = (1 - s)/factor + s` with
/// `s = (original_context / wavelength - low) / (high - low)`, linear in `1 / wavelength`; a
/// least-squares line through the band gives `low` and `high` for the given
/// `original_context`. The result is checked by recomputing every divisor.
pub fn from_freq_factors(
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
    let scaling = Llama3Scaling {
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
    Ok(Some(RopeScaling::Llama3(scaling)))
}

/// The divisor of each rotary frequency under Llama 3 scaling (as llama.cpp stores them).
pub fn llama3_freq_factors(s: &Llama3Scaling, rope_theta: f32, head_dim: usize) -> Vec<f32> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(json: &str, stated: usize) -> Result<Option<RopeScaling>, GpuError> {
        from_hf(&serde_json::from_str(json).unwrap(), stated)
    }

    #[test]
    fn llama3_scaling_recovered_from_rope_freqs() {
        // Llama 3.1 8B and Llama 3.2 1B parameters (Meta's published configs).
        for (factor, theta, hd) in [(8.0, 500_000.0, 128), (32.0, 500_000.0, 64)] {
            let want = Llama3Scaling {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            };
            let factors = llama3_freq_factors(&want, theta, hd);
            let Some(RopeScaling::Llama3(got)) =
                from_freq_factors(&factors, theta, hd, 8192).unwrap()
            else {
                panic!("no scaling recovered")
            };
            assert_eq!(got.factor, factor);
            assert!((got.low_freq_factor - 1.0).abs() < 1e-3, "{got:?}");
            assert!((got.high_freq_factor - 4.0).abs() < 1e-3, "{got:?}");
        }
        assert_eq!(from_freq_factors(&[1.0; 64], 5e5, 128, 8192).unwrap(), None);
        assert!(from_freq_factors(&[1.0; 3], 5e5, 128, 8192).is_err());
        let mut noisy = vec![1.0f32; 32];
        noisy[5] = 3.0;
        noisy[9] = 2.0;
        noisy[20] = 5.0;
        assert!(from_freq_factors(&noisy, 5e5, 64, 8192).is_err());
    }

    #[test]
    fn yarn_as_qwen_documents_it() {
        // Qwen2.5's and Qwen3's model cards: add this to config.json past 32,768 tokens.
        let qwen = r#"{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#;
        let Some(RopeScaling::Yarn(y)) = hf(qwen, 32768).unwrap() else {
            panic!()
        };
        assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 32768));
        assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (32.0, 1.0, true));
        assert!((y.attention_factor - (1.0 + 0.1 * 4f32.ln())).abs() < 1e-6);
        let s = RopeScaling::Yarn(y);
        assert_eq!(s.context(32768, 1 << 24), 131072);
        assert_eq!(s.context(32768, 100_000), 100_000);
        // transformers 5's form, in `rope_parameters` with the base.
        let v5 = r#"{"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
            "original_max_position_embeddings": 32768}"#;
        assert_eq!(hf(v5, 32768).unwrap(), Some(s));
        // DeepSeek-V3's: no factor (the stated context over the original), an explicit
        // attention factor from mscale and mscale_all_dim (equal: 1).
        let ds = r#"{"type": "yarn", "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}"#;
        let Some(RopeScaling::Yarn(y)) = hf(ds, 163840).unwrap() else {
            panic!()
        };
        assert_eq!((y.factor, y.attention_factor), (40.0, 1.0));
        let explicit = r#"{"type": "yarn", "factor": 2.0, "attention_factor": 0.5,
            "beta_fast": 0, "truncate": false}"#;
        let Some(RopeScaling::Yarn(y)) = hf(explicit, 4096).unwrap() else {
            panic!()
        };
        assert_eq!(
            (y.attention_factor, y.beta_fast, y.truncate),
            (0.5, 32.0, false)
        );
        assert_eq!(y.original_max_position_embeddings, 4096);
    }

    #[test]
    fn yarn_frequencies_follow_the_ramp() {
        // 16 rotary dimensions, base 1e6, original context 16: beta_fast's dimension is
        // 16 ln(16 / 64 pi) / (2 ln 1e6) = -1.47 (floor -2, clamped to 0), beta_slow's
        // 16 ln(16 / 2 pi) / (2 ln 1e6) = 0.54 (ceil 1): the first pair keeps its frequency,
        // every other one is divided by the factor.
        let y = RopeScaling::Yarn(YarnScaling {
            factor: 4.0,
            original_max_position_embeddings: 16,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.0 + 0.1 * 4f32.ln(),
            truncate: true,
        });
        let base: Vec<f32> = (0..8).map(|i| 1.0 / 1e6f32.powf(i as f32 / 8.0)).collect();
        let mut f = base.clone();
        y.apply(&mut f, 1e6);
        assert_eq!(f[0], base[0]);
        for i in 1..8 {
            assert!((f[i] - base[i] / 4.0).abs() <= base[i] * 1e-6, "{i}: {f:?}");
        }
        // A longer original context moves the ramp up: at 128 dimensions, base 1e4 and 4,096
        // tokens (Llama 2's), pairs up to beta_fast's (floor 20.9 = 20) keep their frequency,
        // from beta_slow's (ceil 45.0 = 46 after rounding up) on they are divided, between
        // they are mixed.
        let y = RopeScaling::Yarn(YarnScaling {
            original_max_position_embeddings: 4096,
            ..match y {
                RopeScaling::Yarn(y) => y,
                _ => unreachable!(),
            }
        });
        let base: Vec<f32> = (0..64)
            .map(|i| 1.0 / 1e4f32.powf(i as f32 / 64.0))
            .collect();
        let mut f = base.clone();
        y.apply(&mut f, 1e4);
        let (low, high) = match &y {
            RopeScaling::Yarn(y) => yarn_ramp_ends(y, 128, 1e4),
            _ => unreachable!(),
        };
        assert_eq!((low, high), (20.0, 46.0));
        for i in 0..64 {
            let r = base[i] / f[i];
            if i <= 20 {
                assert_eq!(r, 1.0, "{i}");
            } else if i >= 46 {
                assert!((r - 4.0).abs() < 1e-5, "{i}: {r}");
            } else {
                assert!(r > 1.0 && r < 4.0, "{i}: {r}");
            }
        }
    }

    #[test]
    fn linear_divides_every_frequency() {
        let s = hf(r#"{"type": "linear", "factor": 2.0}"#, 4096)
            .unwrap()
            .unwrap();
        assert_eq!(s, RopeScaling::Linear { factor: 2.0 });
        let mut f = vec![1.0, 0.5, 0.25];
        s.apply(&mut f, 1e4);
        assert_eq!(f, [0.5, 0.25, 0.125]);
        assert_eq!(s.context(4096, 1 << 24), 8192);
        assert_eq!(s.attention_factor(), 1.0);
    }

    #[test]
    fn unsupported_or_bad_scaling_is_refused_by_name() {
        for (json, want) in [
            (r#"{"type": "dynamic", "factor": 2.0}"#, "'dynamic'"),
            (
                r#"{"rope_type": "longrope", "factor": 2.0}"#,
                "lacks original_max_position_embeddings",
            ),
            (
                r#"{"rope_type": "longrope", "original_max_position_embeddings": 16,
                    "short_factor": [1, 1], "long_factor": [2]}"#,
                "short factors number 2 and its long ones 1",
            ),
            (
                r#"{"rope_type": "longrope", "original_max_position_embeddings": 16,
                    "short_factor": [1, "x"], "long_factor": [2, 2]}"#,
                "other than numbers",
            ),
            (
                r#"{"rope_type": "su", "original_max_position_embeddings": 16,
                    "short_factor": [1, 0], "long_factor": [2, 2]}"#,
                "invalid rope scaling",
            ),
            (r#"{"type": "linear"}"#, "lacks numeric factor"),
            (r#"{"type": "linear", "factor": "2"}"#, "not a number"),
            (
                r#"{"type": "linear", "factor": 0.5}"#,
                "invalid rope scaling",
            ),
            (r#"{"type": "yarn", "factor": 1e9}"#, "invalid rope scaling"),
            (
                r#"{"type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 2}"#,
                "invalid",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "original_max_position_embeddings": -3}"#,
                "not a length",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "truncate": 1}"#,
                "not a bool",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "attention_factor": -1}"#,
                "invalid",
            ),
            ("[1]", "not an object"),
        ] {
            let e = hf(json, 4096).unwrap_err().to_string();
            assert!(e.contains(want), "{json}: {e}");
        }
        assert_eq!(hf("null", 4096).unwrap(), None);
        assert_eq!(
            hf(r#"{"rope_type": "default", "rope_theta": 1e6}"#, 4096).unwrap(),
            None
        );
    }

    #[test]
    fn gguf_keys_as_llama_cpp_writes_them() {
        use crate::model::gguf::tests::GgufWriter;
        let header = |w: &GgufWriter| {
            crate::model::gguf::parse_header(&w.build(), std::path::Path::new("t")).unwrap()
        };
        let mut w = GgufWriter::default();
        w.string("general.architecture", "qwen2");
        assert_eq!(from_gguf(&header(&w), "qwen2", 32768).unwrap(), None);
        w.string("qwen2.rope.scaling.type", "yarn")
            .f32("qwen2.rope.scaling.factor", 4.0)
            .u32("qwen2.rope.scaling.original_context_length", 32768);
        let Some(RopeScaling::Yarn(y)) = from_gguf(&header(&w), "qwen2", 32768).unwrap() else {
            panic!()
        };
        assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 32768));
        assert!((y.attention_factor - (1.0 + 0.1 * 4f32.ln())).abs() < 1e-6);
        // llama.cpp's "default" extension factor passes; a log multiplier (DeepSeek's) does not.
        let mut ext = w.clone();
        ext.f32("qwen2.rope.scaling.yarn_ext_factor", -1.0);
        assert!(from_gguf(&header(&ext), "qwen2", 32768).is_ok());
        w.f32("qwen2.rope.scaling.yarn_log_multiplier", 0.1);
        let e = from_gguf(&header(&w), "qwen2", 32768)
            .unwrap_err()
            .to_string();
        assert!(e.contains("yarn_log_multiplier"), "{e}");

        let mut lin = GgufWriter::default();
        lin.string("llama.rope.scaling.type", "linear");
        let e = from_gguf(&header(&lin), "llama", 4096)
            .unwrap_err()
            .to_string();
        assert!(e.contains("llama.rope.scaling.factor"), "{e}");
        lin.f32("llama.rope.scaling.factor", 8.0);
        assert_eq!(
            from_gguf(&header(&lin), "llama", 4096).unwrap(),
            Some(RopeScaling::Linear { factor: 8.0 })
        );
        let mut bad = GgufWriter::default();
        bad.string("llama.rope.scaling.type", "longrope");
        let e = from_gguf(&header(&bad), "llama", 4096)
            .unwrap_err()
            .to_string();
        assert!(e.contains("'longrope'"), "{e}");
    }
}
