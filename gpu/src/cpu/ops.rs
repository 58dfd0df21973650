//! Element-wise pieces of the Llama block: RMSNorm (Zhang & Sennrich 2019), rotary position
//! embeddings (RoFormer, Su et al. 2021; Llama 3.1 frequency scaling), SwiGLU (Shazeer 2020),
//! all in `f32` with the operation order of Hugging Face transformers' Llama.

use crate::model::{LlamaConfig, RopeStyle};

/// `out = x / sqrt(mean(x^2) + eps) * w`, row by row (`x.len()` a multiple of `w.len()`).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = g * (v * inv);
        }
    }
}

/// [`rms_norm`] in place: each `w.len()`-long row of `x` (Qwen3's query and key heads).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for xr in x.chunks_exact_mut(n) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = g * (*v * inv);
        }
    }
}

/// `e^x` to within 1e-6 relative error, in straight-line code the compiler vectorises (libm's
/// `expf` is a call per element): `x = n ln 2 + r` with `|r| <= ln 2 / 2`, a degree-6 Taylor
/// polynomial for `e^r`, and `2^n` built in the exponent bits. Inputs are clamped to
/// [-87, 88], so the result is always finite and positive.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p: f32 = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `gate_up` holds rows of `[gate (n) | up (n)]`; writes `silu(gate) * up` rows of `n` to `out`.
pub fn swiglu(gate_up: &[f32], n: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match super::matmul::Isa::detect() {
        // SAFETY: the CPU has AVX-512F.
        super::matmul::Isa::Avx512Vnni => return unsafe { swiglu_avx512(gate_up, n, out) },
        // SAFETY: the CPU has AVX2 and FMA. (Without FMA enabled, exp_approx's `mul_add`
        // is a call into the software `fmaf`: 10% of an AVX2 machine's prefill. Both give
        // the correctly rounded fused result, so the bits are the same.)
        super::matmul::Isa::Avx2 => return unsafe { swiglu_avx2(gate_up, n, out) },
        super::matmul::Isa::Scalar => {}
    }
    swiglu_body(gate_up, n, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn swiglu_avx512(gate_up: &[f32], n: usize, out: &mut [f32]) {
    swiglu_body(gate_up, n, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_avx2(gate_up: &[f32], n: usize, out: &mut [f32]) {
    swiglu_body(gate_up, n, out)
}

#[inline(always)]
fn swiglu_body(gate_up: &[f32], n: usize, out: &mut [f32]) {
    for (gu, o) in gate_up.chunks_exact(2 * n).zip(out.chunks_exact_mut(n)) {
        let (g, u) = gu.split_at(n);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + exp_approx(-g)) * u;
        }
    }
}

/// Rotary embedding frequencies of a model, including Llama 3 scaling.
#[derive(Clone, Debug)]
pub struct Rope {
    /// Inverse frequency of each of the `head_dim / 2` pairs: the `rotary_dim / 2` rotated
    /// ones, then 0 for the pairs a partial rotary embedding leaves as they are (moved there
    /// by the loader: `LlamaConfig::rotary_dim`).
    pub inv_freq: Vec<f32>,
    /// Which dimensions form a pair.
    pub style: RopeStyle,
    /// Multiplier of cos and sin (YaRN's attention factor; 1 otherwise), as transformers
    /// applies it: to the rotated pairs only.
    pub scale: f32,
    /// Pairs rotated (`rotary_dim / 2`); the others keep their values exactly.
    pub rotated: usize,
}

impl Rope {
    /// Frequencies for `cfg` (transformers' `_compute_default_rope_parameters` over the
    /// rotated dimensions, in `f32`, then its scaling, [`crate::model::rope`]).
    pub fn new(cfg: &LlamaConfig) -> Self {
        let r = cfg.rotary_dim.min(cfg.head_dim);
        let mut inv_freq: Vec<f32> = (0..r / 2)
            .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f32 / r as f32))
            .collect();
        if let Some(s) = &cfg.rope_scaling {
            s.apply(&mut inv_freq, cfg.rope_theta);
        }
        inv_freq.resize(cfg.head_dim / 2, 0.0);
        Rope {
            inv_freq,
            style: cfg.rope_style,
            scale: cfg.rope_attention_factor(),
            rotated: r / 2,
        }
    }

    /// Cosines and sines for `pos`, `head_dim / 2` each, written to `cs` as `[cos.., sin..]`
    /// (1 and 0 for the pairs not rotated).
    pub fn table(&self, pos: usize, cs: &mut [f32]) {
        let h = self.inv_freq.len();
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let (c, s) = if i < self.rotated {
                let a = pos as f32 * f;
                (a.cos() * self.scale, a.sin() * self.scale)
            } else {
                (1.0, 0.0)
            };
            cs[i] = c;
            cs[h + i] = s;
        }
    }

    /// Rotates every head (`head_dim` values each) of `x` with the table from [`Rope::table`].
    pub fn apply(&self, x: &mut [f32], cs: &[f32]) {
        let h = self.inv_freq.len();
        let (cos, sin) = cs.split_at(h);
        for head in x.chunks_exact_mut(2 * h) {
            for i in 0..h {
                let (a, b) = match self.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + h),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x1 * cos[i] + x0 * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Llama3Scaling, RopeScaling};

    #[test]
    fn rms_norm_by_hand() {
        let mut out = [0f32; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        // mean square = 12.5
        let r = 12.5f32.sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn exp_approx_is_accurate() {
        let mut worst = 0f64;
        for i in -8700..=8800 {
            let x = i as f32 * 0.01;
            let want = f64::from(x).exp();
            let rel = ((f64::from(exp_approx(x)) - want) / want).abs();
            worst = worst.max(rel);
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        assert!(exp_approx(f32::NEG_INFINITY) > 0.0 && exp_approx(1e9).is_finite());
    }

    #[test]
    fn swiglu_by_hand() {
        let mut out = [0f32; 1];
        swiglu(&[1.0, 3.0], 1, &mut out);
        assert!((out[0] - 3.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    fn cfg(style: RopeStyle) -> LlamaConfig {
        let mut c = LlamaConfig::smollm2_135m();
        c.head_dim = 4;
        c.rotary_dim = 4;
        c.rope_theta = 100.0;
        c.rope_style = style;
        c
    }

    #[test]
    fn rope_rotates_the_right_pairs() {
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            let rope = Rope::new(&cfg(style));
            assert_eq!(rope.inv_freq, vec![1.0, 0.1]);
            let mut cs = [0f32; 4];
            rope.table(2, &mut cs);
            let mut x = [1.0, 2.0, 3.0, 4.0];
            rope.apply(&mut x, &cs);
            let (p0, p1) = match style {
                RopeStyle::Interleaved => ((0, 1), (2, 3)),
                RopeStyle::Halves => ((0, 2), (1, 3)),
            };
            let orig = [1.0f32, 2.0, 3.0, 4.0];
            for ((a, b), ang) in [(p0, 2.0f32), (p1, 0.2f32)] {
                let (x0, x1) = (orig[a], orig[b]);
                assert!(
                    (x[a] - (x0 * ang.cos() - x1 * ang.sin())).abs() < 1e-6,
                    "{style:?}"
                );
                assert!(
                    (x[b] - (x1 * ang.cos() + x0 * ang.sin())).abs() < 1e-6,
                    "{style:?}"
                );
            }
        }
    }

    #[test]
    fn llama3_scaling_divides_low_frequencies_only() {
        let mut c = cfg(RopeStyle::Halves);
        c.head_dim = 128;
        c.rotary_dim = 128;
        c.rope_theta = 500_000.0;
        c.rope_scaling = Some(RopeScaling::Llama3(Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }));
        let scaled = Rope::new(&c).inv_freq;
        c.rope_scaling = None;
        let plain = Rope::new(&c).inv_freq;
        assert_eq!(scaled[0], plain[0]); // wavelength 2*pi, far below 8192/4
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12); // longest wavelength
        let mid = (0..64).filter(|&i| scaled[i] != plain[i] && scaled[i] != plain[i] / 8.0);
        assert!(mid.count() > 0, "some frequencies are interpolated");
    }
}
