//! `y = W x` for a batch of tokens over the weight formats of [`super::quant`].
//!
//! Work is split over output rows (rayon, in the caller's thread pool); inside a chunk of rows
//! the kernels walk one group of 16 interleaved rows (see [`super::quant`]) against a tile of
//! up to 8 tokens, block by block: a block of weights is unpacked into registers once and used
//! by every token of the tile, so weights stream from memory once per step for the whole batch
//! while the quantized activations stay in L1/L2. Kernels: AVX-512 VNNI (`vpdpbusd`, 16 rows
//! per instruction), AVX2 (`vpmaddubsw`, 8 rows), and a portable scalar reference that the
//! unit tests compare the SIMD paths against. The ISA is detected at run time.

use rayon::prelude::*;

use super::quant::{FMatrix, QActs, QMatrix, QPacking, Weight, ROW_GROUP};
use crate::error::GpuError;
use crate::model::quant_blocks::QK;

/// The instruction set a kernel runs with.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F/BW with VNNI integer dot products.
    Avx512Vnni,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// Portable Rust.
    Scalar,
}

impl Isa {
    /// The best instruction set this machine supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            // The AVX-512 level includes the AVX2 one (its paths fall back to AVX2 kernels,
            // and `Isa::Avx2.is_supported()` holds there): every real AVX-512 CPU has AVX2,
            // FMA and F16C, a virtual one may be configured without, so both are checked.
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
            {
                return Isa::Avx512Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Whether this machine can run kernels of this instruction set.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => matches!(Isa::detect(), Isa::Avx2 | Isa::Avx512Vnni),
            Isa::Avx512Vnni => Isa::detect() == Isa::Avx512Vnni,
        }
    }
}

/// Rows per parallel work item (a multiple of [`ROW_GROUP`]).
const ROW_CHUNK: usize = 32;

/// A token-major output matrix shared by the workers; each work item writes a disjoint set of
/// columns, which is what makes the concurrent writes sound.
#[derive(Copy, Clone)]
struct OutPtr {
    ptr: *mut f32,
    ld: usize,
}
// SAFETY: the pointer is only dereferenced by `store`, at (token, column) pairs that belong to
// exactly one work item, while the `&mut [f32]` it came from is borrowed by `linear`.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Writes `v` at (`t`, `c`).
    ///
    /// # Safety
    /// `t * ld + c` lies in the output slice and no other thread writes it.
    #[inline(always)]
    unsafe fn store(self, t: usize, c: usize, v: f32) {
        *self.ptr.add(t * self.ld + c) = v;
    }

    /// Address of (`t`, `c`).
    ///
    /// # Safety
    /// As for [`OutPtr::store`], for every element written through the pointer.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn at(self, t: usize, c: usize) -> *mut f32 {
        self.ptr.add(t * self.ld + c)
    }
}

/// Multiplies the row-concatenation of `parts` by each of `tokens` activation rows:
/// `out[t * R + c] = (parts[0] ++ parts[1] ++ ...)[c] . x[t]`, with `R` the total row count.
/// `x` holds the activations in `f32` (`tokens * cols`) and `xq` the same quantized (used by
/// quantized parts; quantize with [`QActs::quantize`]).
pub fn linear(
    parts: &[&Weight],
    x: &[f32],
    xq: &QActs,
    tokens: usize,
    out: &mut [f32],
    isa: Isa,
) -> Result<(), GpuError> {
    let total: usize = parts.iter().map(|w| w.rows()).sum();
    let cols = parts.first().map_or(0, |w| w.cols());
    let shape_err = |what: &str| Err(GpuError::Internal(format!("linear: {what}")));
    if parts.iter().any(|w| w.cols() != cols) {
        return shape_err("parts differ in input size");
    }
    if x.len() != tokens * cols || out.len() != tokens * total {
        return shape_err("activation or output size");
    }
    let any_quant = parts.iter().any(|w| matches!(w, Weight::Quant(_)));
    if any_quant && (xq.tokens != tokens || xq.blocks * QK != cols || !xq.is_consistent()) {
        return shape_err("quantized activations do not match");
    }
    if parts
        .iter()
        .any(|w| matches!(w, Weight::Quant(q) if !q.is_consistent()))
    {
        return shape_err("a quantized weight's buffers do not match its shape");
    }
    if !isa.is_supported() {
        return shape_err("instruction set not supported by this CPU");
    }
    let mut items = Vec::new();
    let mut col0 = 0;
    for (i, w) in parts.iter().enumerate() {
        let rows = w.rows();
        for lo in (0..rows).step_by(ROW_CHUNK) {
            items.push((i, col0, lo, (lo + ROW_CHUNK).min(rows)));
        }
        col0 += rows;
    }
    let dst = OutPtr {
        ptr: out.as_mut_ptr(),
        ld: total,
    };
    items
        .into_par_iter()
        .for_each(|(i, col0, lo, hi)| match parts[i] {
            Weight::Quant(q) => quant_rows(q, xq, lo, hi, dst, col0, isa),
            Weight::Float(f) => float_rows(f, x, tokens, lo, hi, dst, col0, isa),
        });
    Ok(())
}

/// Rows `lo..hi` of a quantized matrix for all tokens.
fn quant_rows(w: &QMatrix, a: &QActs, lo: usize, hi: usize, out: OutPtr, col0: usize, isa: Isa) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => {
            // SAFETY: `linear` checked that the CPU has these features and that the shapes of
            // `w`, `a` and the output agree.
            unsafe { x86::rows_avx512(w, a, lo, hi, out, col0) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: as above.
            unsafe { x86::rows_avx2(w, a, lo, hi, out, col0) }
        }
        _ => {
            for r in lo..hi {
                for t in 0..a.tokens {
                    // SAFETY: (t, col0 + r) belongs to this work item.
                    unsafe { out.store(t, col0 + r, dot_scalar(w, r, a, t)) };
                }
            }
        }
    }
}

/// The reference dot product of row `r` with activation row `t`.
pub fn dot_scalar(w: &QMatrix, r: usize, a: &QActs, t: usize) -> f32 {
    let nb = w.blocks;
    let mut total = 0f32;
    let dot = |lo: usize, hi: usize| -> i32 {
        (lo..hi)
            .map(|i| i32::from(w.quant(r, i)) * i32::from(a.qs[t * nb * QK + i]))
            .sum()
    };
    for b in 0..nb {
        let ab = t * nb + b;
        if w.packing == QPacking::Byte16 {
            let sums = [a.qsum_lo[ab], a.qsum[ab] - a.qsum_lo[ab]];
            for (h, &qsum) in sums.iter().enumerate() {
                let lo = b * QK + 16 * h;
                let isum = dot(lo, lo + 16) - 128 * qsum;
                let (d, m) = w.scale(r, lo);
                total += d * a.d[ab] * isum as f32 + m * a.d[ab] * qsum as f32;
            }
            continue;
        }
        let mut isum = dot(b * QK, (b + 1) * QK);
        let (d, m) = w.scale(r, b * QK);
        if w.packing == QPacking::Byte {
            isum -= 128 * a.qsum[ab];
        }
        total += d * a.d[ab] * isum as f32 + m * a.s[ab];
    }
    total
}

/// Dot product in 16 independent lanes (vectorised by the compiler when inlined into a
/// function compiled for a SIMD target).
#[inline(always)]
pub fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..16 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn float_rows_body(
    f: &FMatrix,
    x: &[f32],
    tokens: usize,
    lo: usize,
    hi: usize,
    out: OutPtr,
    c0: usize,
) {
    for r in lo..hi {
        let row = &f.w[r * f.cols..(r + 1) * f.cols];
        for t in 0..tokens {
            let v = dot_lanes(row, &x[t * f.cols..(t + 1) * f.cols]);
            // SAFETY: (t, c0 + r) belongs to this work item.
            unsafe { out.store(t, c0 + r, v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_rows_avx2(
    f: &FMatrix,
    x: &[f32],
    t: usize,
    lo: usize,
    hi: usize,
    o: OutPtr,
    c: usize,
) {
    float_rows_body(f, x, t, lo, hi, o, c)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn float_rows_avx512(
    f: &FMatrix,
    x: &[f32],
    t: usize,
    lo: usize,
    hi: usize,
    o: OutPtr,
    c: usize,
) {
    float_rows_body(f, x, t, lo, hi, o, c)
}

#[allow(clippy::too_many_arguments)]
fn float_rows(
    f: &FMatrix,
    x: &[f32],
    tokens: usize,
    lo: usize,
    hi: usize,
    out: OutPtr,
    c0: usize,
    isa: Isa,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `linear` checked the CPU features.
        Isa::Avx512Vnni => unsafe { float_rows_avx512(f, x, tokens, lo, hi, out, c0) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `linear` checked the CPU features.
        Isa::Avx2 => unsafe { float_rows_avx2(f, x, tokens, lo, hi, out, c0) },
        _ => float_rows_body(f, x, tokens, lo, hi, out, c0),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{OutPtr, QActs, QMatrix, QPacking, QK, ROW_GROUP};

    /// Reads four activation bytes as one `i32` (to broadcast to every lane).
    #[inline(always)]
    unsafe fn four(p: *const i8) -> i32 {
        std::ptr::read_unaligned(p as *const i32)
    }

    /// Rows `lo..hi` (`lo` a multiple of 16) × all tokens, 8 tokens per tile (AVX-512 VNNI).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn rows_avx512(
        w: &QMatrix,
        a: &QActs,
        lo: usize,
        hi: usize,
        o: OutPtr,
        c0: usize,
    ) {
        for g in lo / ROW_GROUP..hi.div_ceil(ROW_GROUP) {
            let valid = (w.rows - g * ROW_GROUP).min(ROW_GROUP);
            let mask: __mmask16 = if valid == 16 {
                0xffff
            } else {
                (1u16 << valid) - 1
            };
            let mut t = 0;
            while t < a.tokens {
                let nt = (a.tokens - t).min(8);
                match nt {
                    8 => group512::<8>(w, g, a, t, o, c0, mask),
                    7 => group512::<7>(w, g, a, t, o, c0, mask),
                    6 => group512::<6>(w, g, a, t, o, c0, mask),
                    5 => group512::<5>(w, g, a, t, o, c0, mask),
                    4 => group512::<4>(w, g, a, t, o, c0, mask),
                    3 => group512::<3>(w, g, a, t, o, c0, mask),
                    2 => group512::<2>(w, g, a, t, o, c0, mask),
                    _ => group512::<1>(w, g, a, t, o, c0, mask),
                }
                t += nt;
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn group512<const NT: usize>(
        w: &QMatrix,
        g: usize,
        a: &QActs,
        t0: usize,
        o: OutPtr,
        c0: usize,
        mask: __mmask16,
    ) {
        let nb = w.blocks;
        let gbb = w.packing.group_block_bytes();
        let nib = w.packing == QPacking::Nibble;
        let b16 = w.packing == QPacking::Byte16;
        let halves = w.packing.scales_per_block();
        let m4 = _mm512_set1_epi8(0x0f);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); NT];
        for b in 0..nb {
            let gb = g * nb + b;
            let src = w.qs.as_ptr().add(gb * gbb);
            let mut wv = [zero; 8];
            if nib {
                for k in 0..4 {
                    let z = _mm512_loadu_si512(src.add(64 * k) as *const __m512i);
                    wv[k] = _mm512_and_si512(z, m4);
                    wv[k + 4] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
                }
            } else {
                for (k, v) in wv.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(src.add(64 * k) as *const __m512i);
                }
            }
            let at = gb * halves * ROW_GROUP;
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(at) as *const __m256i));
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(w.m.as_ptr().add(at) as *const __m256i));
            if b16 {
                // The second half-block's scales and offsets follow the first's.
                let at = at + ROW_GROUP;
                let dh =
                    _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(at) as *const __m256i));
                let mh =
                    _mm512_cvtph_ps(_mm256_loadu_si256(w.m.as_ptr().add(at) as *const __m256i));
                for (t, acc) in acc.iter_mut().enumerate() {
                    let ab = (t0 + t) * nb + b;
                    let xp = a.qs.as_ptr().add(ab * QK);
                    let (mut lo, mut hi) = (zero, zero);
                    for k in 0..4 {
                        lo = _mm512_dpbusd_epi32(lo, wv[k], _mm512_set1_epi32(four(xp.add(4 * k))));
                        hi = _mm512_dpbusd_epi32(
                            hi,
                            wv[k + 4],
                            _mm512_set1_epi32(four(xp.add(16 + 4 * k))),
                        );
                    }
                    let ql = *a.qsum_lo.as_ptr().add(ab);
                    let qh = *a.qsum.as_ptr().add(ab) - ql;
                    lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(128 * ql));
                    hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(128 * qh));
                    let ad = *a.d.as_ptr().add(ab);
                    let adv = _mm512_set1_ps(ad);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(dw, adv), *acc);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(dh, adv), *acc);
                    *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(ad * ql as f32), *acc);
                    *acc = _mm512_fmadd_ps(mh, _mm512_set1_ps(ad * qh as f32), *acc);
                }
                continue;
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let ab = (t0 + t) * nb + b;
                let xp = a.qs.as_ptr().add(ab * QK);
                let mut isum = zero;
                for (k, &wk) in wv.iter().enumerate() {
                    isum = _mm512_dpbusd_epi32(isum, wk, _mm512_set1_epi32(four(xp.add(4 * k))));
                }
                if nib {
                    *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*a.s.as_ptr().add(ab)), *acc);
                } else {
                    isum =
                        _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * *a.qsum.as_ptr().add(ab)));
                }
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*a.d.as_ptr().add(ab)));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc);
            }
        }
        for (t, &v) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(o.at(t0 + t, c0 + g * ROW_GROUP), mask, v);
        }
    }

    /// Rows `lo..hi` × all tokens, 8 rows × 4 tokens per tile (AVX2).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_avx2(
        w: &QMatrix,
        a: &QActs,
        lo: usize,
        hi: usize,
        o: OutPtr,
        c0: usize,
    ) {
        for g in lo / ROW_GROUP..hi.div_ceil(ROW_GROUP) {
            for half in 0..2 {
                let first = g * ROW_GROUP + 8 * half;
                if first >= w.rows {
                    break;
                }
                let valid = (w.rows - first).min(8);
                let mut t = 0;
                while t < a.tokens {
                    let nt = (a.tokens - t).min(4);
                    match nt {
                        4 => half256::<4>(w, g, half, a, t, o, c0, valid),
                        3 => half256::<3>(w, g, half, a, t, o, c0, valid),
                        2 => half256::<2>(w, g, half, a, t, o, c0, valid),
                        _ => half256::<1>(w, g, half, a, t, o, c0, valid),
                    }
                    t += nt;
                }
            }
        }
    }

    #[inline]
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half256<const NT: usize>(
        w: &QMatrix,
        g: usize,
        half: usize,
        a: &QActs,
        t0: usize,
        o: OutPtr,
        c0: usize,
        valid: usize,
    ) {
        let nb = w.blocks;
        let gbb = w.packing.group_block_bytes();
        let nib = w.packing == QPacking::Nibble;
        let b16 = w.packing == QPacking::Byte16;
        let halves = w.packing.scales_per_block();
        let m4 = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let gb = g * nb + b;
            let src = w.qs.as_ptr().add(gb * gbb + 32 * half);
            let mut wv = [_mm256_setzero_si256(); 8];
            if nib {
                for k in 0..4 {
                    let z = _mm256_loadu_si256(src.add(64 * k) as *const __m256i);
                    wv[k] = _mm256_and_si256(z, m4);
                    wv[k + 4] = _mm256_and_si256(_mm256_srli_epi16(z, 4), m4);
                }
            } else {
                for (k, v) in wv.iter_mut().enumerate() {
                    // Back to signed weights: `vpmaddubsw` would saturate on bytes up to 255.
                    let z = _mm256_loadu_si256(src.add(64 * k) as *const __m256i);
                    *v = _mm256_xor_si256(z, _mm256_set1_epi8(-128));
                }
            }
            let at = gb * halves * ROW_GROUP + 8 * half;
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(at) as *const __m128i));
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr().add(at) as *const __m128i));
            if b16 {
                // The second half-block's scales and offsets follow the first's.
                let at = at + ROW_GROUP;
                let dh = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(at) as *const __m128i));
                let mh = _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr().add(at) as *const __m128i));
                for (t, acc) in acc.iter_mut().enumerate() {
                    let ab = (t0 + t) * nb + b;
                    let xp = a.qs.as_ptr().add(ab * QK);
                    let mut sums = [_mm256_setzero_si256(); 2];
                    for (k, &wk) in wv.iter().enumerate() {
                        let x = _mm256_set1_epi32(four(xp.add(4 * k)));
                        let prod =
                            _mm256_maddubs_epi16(_mm256_sign_epi8(wk, wk), _mm256_sign_epi8(x, wk));
                        sums[k / 4] = _mm256_add_epi32(sums[k / 4], _mm256_madd_epi16(prod, ones));
                    }
                    let ql = *a.qsum_lo.as_ptr().add(ab);
                    let qh = *a.qsum.as_ptr().add(ab) - ql;
                    let ad = *a.d.as_ptr().add(ab);
                    let adv = _mm256_set1_ps(ad);
                    *acc =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[0]), _mm256_mul_ps(dw, adv), *acc);
                    *acc =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[1]), _mm256_mul_ps(dh, adv), *acc);
                    *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(ad * ql as f32), *acc);
                    *acc = _mm256_fmadd_ps(mh, _mm256_set1_ps(ad * qh as f32), *acc);
                }
                continue;
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let ab = (t0 + t) * nb + b;
                let xp = a.qs.as_ptr().add(ab * QK);
                let isum = if nib {
                    // 4-bit weights: each 16-bit lane of a product is at most 2 * 15 * 128 =
                    // 3,840 in magnitude, so the block's 8 products add up in 16 bits (at most
                    // 30,720) and widen once: the same integer sums with 7 `vpmaddwd` fewer.
                    let mut s16 = _mm256_setzero_si256();
                    for (k, &wk) in wv.iter().enumerate() {
                        let x = _mm256_set1_epi32(four(xp.add(4 * k)));
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wk, x));
                    }
                    _mm256_madd_epi16(s16, ones)
                } else {
                    let mut s32 = _mm256_setzero_si256();
                    for (k, &wk) in wv.iter().enumerate() {
                        let x = _mm256_set1_epi32(four(xp.add(4 * k)));
                        let prod =
                            _mm256_maddubs_epi16(_mm256_sign_epi8(wk, wk), _mm256_sign_epi8(x, wk));
                        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(prod, ones));
                    }
                    s32
                };
                if nib {
                    *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(*a.s.as_ptr().add(ab)), *acc);
                }
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*a.d.as_ptr().add(ab)));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc);
            }
        }
        for (t, &v) in acc.iter().enumerate() {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), v);
            for (i, &x) in lanes.iter().enumerate().take(valid) {
                o.store(t0 + t, c0 + g * ROW_GROUP + 8 * half + i, x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;
    use crate::model::tensor::{DType, TensorView};

    fn lcg(s: &mut u64) -> u32 {
        *s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (*s >> 33) as u32
    }

    fn random_tensor(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut out = Vec::new();
        if dtype == DType::F32 {
            for _ in 0..rows * cols {
                out.extend_from_slice(&((lcg(&mut s) % 2000) as f32 / 1000.0 - 1.0).to_le_bytes());
            }
            return out;
        }
        for _ in 0..rows * cols / 32 {
            out.extend_from_slice(
                &f16::from_f32(0.001 * (lcg(&mut s) % 50 + 1) as f32).to_le_bytes(),
            );
            if dtype == DType::Q4_1 {
                out.extend_from_slice(
                    &f16::from_f32(-0.01 * (lcg(&mut s) % 9) as f32).to_le_bytes(),
                );
            }
            let n = if dtype == DType::Q8_0 { 32 } else { 16 };
            for _ in 0..n {
                out.push(lcg(&mut s) as u8);
            }
        }
        out
    }

    /// Every ISA this machine supports gives the dequantized `f32` product up to rounding,
    /// for odd row/token counts and a row length that is not a whole number of pairs, in
    /// every packing (the 5-bit and K-quant types take all three).
    #[test]
    fn simd_kernels_match_the_dequantized_reference() {
        let mut cases: Vec<(DType, [usize; 3])> = Vec::new();
        for dtype in [DType::Q4_1, DType::Q4_0, DType::Q8_0, DType::F32] {
            for shape in [[37, 96, 5], [8, 64, 1], [70, 576, 19], [16, 32, 8]] {
                cases.push((dtype, shape));
            }
        }
        for dtype in DType::FIVE_BIT_AND_K {
            for shape in [[37, 256, 5], [70, 512, 19], [16, 256, 1]] {
                cases.push((dtype, shape));
            }
        }
        for (dtype, [rows, cols, tokens]) in cases {
            {
                let seed = rows as u64 * 31 + cols as u64;
                let data = if DType::FIVE_BIT_AND_K.contains(&dtype) {
                    let n = rows * cols / dtype.block_len();
                    crate::cpu::quant::tests::random_blocks(dtype, n, seed)
                } else {
                    random_tensor(dtype, rows, cols, seed)
                };
                let view = TensorView {
                    dtype,
                    shape: vec![rows, cols],
                    data: &data,
                };
                let w = Weight::from_view("w", &view).unwrap();
                // The weights as the kernels hold them (the file's values, up to the K-quants'
                // scales rounded to f16: checked in `quant`).
                let mut wf = vec![0f32; rows * cols];
                for (r, row) in wf.chunks_exact_mut(cols).enumerate() {
                    w.row_f32(r, row);
                }
                let mut s = 99u64;
                let x: Vec<f32> = (0..tokens * cols)
                    .map(|_| (lcg(&mut s) % 1000) as f32 / 250.0 - 2.0)
                    .collect();
                let xq = QActs::quantize(&x, tokens, cols);
                // The reference uses the quantized activations, dequantized, in f64.
                let mut reference = vec![0f64; tokens * rows];
                for t in 0..tokens {
                    for r in 0..rows {
                        let mut acc = 0f64;
                        for c in 0..cols {
                            let xv = if matches!(w, Weight::Quant(_)) {
                                f64::from(xq.d[t * xq.blocks + c / 32])
                                    * f64::from(xq.qs[t * xq.blocks * 32 + c])
                            } else {
                                f64::from(x[t * cols + c])
                            };
                            acc += f64::from(wf[r * cols + c]) * xv;
                        }
                        reference[t * rows + r] = acc;
                    }
                }
                for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni] {
                    if !isa.is_supported() {
                        continue;
                    }
                    let mut out = vec![0f32; tokens * rows];
                    linear(&[&w], &x, &xq, tokens, &mut out, isa).unwrap();
                    for (i, (&got, &want)) in out.iter().zip(&reference).enumerate() {
                        let tol = 1e-3 * (1.0 + want.abs());
                        assert!(
                            (f64::from(got) - want).abs() < tol,
                            "{dtype} {isa:?} {rows}x{cols}x{tokens} [{i}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn concatenated_parts_fill_their_columns() {
        let a = random_tensor(DType::Q4_1, 5, 64, 1);
        let b = random_tensor(DType::Q8_0, 3, 64, 2);
        let wa = Weight::from_view(
            "a",
            &TensorView {
                dtype: DType::Q4_1,
                shape: vec![5, 64],
                data: &a,
            },
        )
        .unwrap();
        let wb = Weight::from_view(
            "b",
            &TensorView {
                dtype: DType::Q8_0,
                shape: vec![3, 64],
                data: &b,
            },
        )
        .unwrap();
        let x: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
        let xq = QActs::quantize(&x, 2, 64);
        let isa = Isa::detect();
        let mut both = vec![0f32; 16];
        linear(&[&wa, &wb], &x, &xq, 2, &mut both, isa).unwrap();
        let mut only_b = vec![0f32; 6];
        linear(&[&wb], &x, &xq, 2, &mut only_b, isa).unwrap();
        for t in 0..2 {
            assert_eq!(both[t * 8 + 5..t * 8 + 8], only_b[t * 3..t * 3 + 3]);
        }
        assert!(linear(&[&wa], &x, &xq, 2, &mut only_b, isa).is_err());
        // Buffers that do not hold the shape their fields claim are refused before the kernels
        // read them through raw pointers (the fields are public).
        let hollow = QActs {
            tokens: 2,
            blocks: 2,
            ..QActs::default()
        };
        assert!(linear(&[&wb], &x, &hollow, 2, &mut only_b, isa).is_err());
        let Weight::Quant(mut short) = wb.clone() else {
            panic!("a quantized weight")
        };
        short.qs.truncate(short.qs.len() / 2);
        let short = Weight::Quant(short);
        assert!(linear(&[&short], &x, &xq, 2, &mut only_b, isa).is_err());
    }
}
