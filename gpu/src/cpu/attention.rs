//! Grouped-query attention (Ainslie et al. 2023) over the paged KV cache: each query token
//! attends causally to every cached position of its sequence up to its own (earlier chunks,
//! prefix-cache hits and the tokens of its own chunk written just before), or with a sliding
//! window to the last `window` of them, walking the sequence's block table as PagedAttention
//! does.

use rayon::prelude::*;

use super::kv_cache::KvCache;
use super::matmul::Isa;
use super::ops::exp_approx;

/// Where one query token of the flattened batch sits.
#[derive(Copy, Clone, Debug)]
pub struct QueryPos {
    /// Position in its sequence (attends to positions `0..=pos`).
    pub pos: usize,
    /// Index of its sequence in the batch (into the block tables).
    pub seq: usize,
}

/// Computes attention for layer `layer`: `q` and `out` are `[tokens][num_heads * head_dim]`,
/// token `t` at `queries[t]`. The block tables must cover every position (checked by the
/// caller). Panics when the shapes disagree (the SIMD paths write whole heads through raw
/// stores); an instruction set this CPU lacks runs the portable path.
pub fn attention(
    layer: usize,
    q: &[f32],
    cache: &KvCache,
    batch: &AttentionBatch<'_>,
    out: &mut [f32],
    isa: Isa,
) {
    let AttentionBatch {
        queries,
        tables,
        num_heads,
        window,
    } = *batch;
    // The first position a query at `pos` attends to.
    let first = |pos: usize| window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let hd = cache.head_dim;
    let width = queries.len() * num_heads * hd;
    assert!(
        q.len() == width && out.len() == width && num_heads.is_multiple_of(cache.kv_heads),
        "attention: q {} and out {} for {} tokens of {num_heads} heads of {hd} over {} KV heads",
        q.len(),
        out.len(),
        queries.len(),
        cache.kv_heads
    );
    let isa = if isa.is_supported() { isa } else { Isa::Scalar };
    let group = num_heads / cache.kv_heads;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni
        && hd == 64
        && cache.block_size.is_multiple_of(L)
        && (2..=4).contains(&group)
    {
        // The query heads sharing a KV head in one pass: each key and value is loaded once.
        out.par_chunks_mut(group * hd)
            .enumerate()
            .for_each(|(c, o)| {
                let (t, h) = (c / cache.kv_heads, c % cache.kv_heads);
                let qp = queries[t];
                let qg = &q[c * group * hd..(c + 1) * group * hd];
                let job = HeadJob {
                    layer,
                    cache,
                    kv_head: h,
                    table: tables[qp.seq],
                    first: first(qp.pos),
                    ctx: qp.pos + 1,
                };
                // SAFETY: the caller checked that the CPU supports AVX-512; shapes checked above.
                unsafe {
                    match group {
                        2 => x86::attend_group::<2>(&job, qg, o),
                        3 => x86::attend_group::<3>(&job, qg, o),
                        _ => x86::attend_group::<4>(&job, qg, o),
                    }
                }
            });
        return;
    }
    out.par_chunks_mut(hd).enumerate().for_each(|(c, o)| {
        let (t, h) = (c / num_heads, c % num_heads);
        let qp = queries[t];
        let qh = &q[c * hd..(c + 1) * hd];
        let job = HeadJob {
            layer,
            cache,
            kv_head: h / group,
            table: tables[qp.seq],
            first: first(qp.pos),
            ctx: qp.pos + 1,
        };
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller checked that the CPU supports `isa`.
            Isa::Avx512Vnni => unsafe { attend_avx512(&job, qh, o) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { attend_avx2(&job, qh, o) },
            _ => attend(&job, qh, o),
        }
    });
}

/// Where the query tokens of a step sit and how many query heads they have.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBatch<'a> {
    /// Position and sequence of each query token.
    pub queries: &'a [QueryPos],
    /// Block table of each sequence.
    pub tables: &'a [&'a [u32]],
    /// Query heads per token.
    pub num_heads: usize,
    /// Sliding window: each query attends to its last `window` positions (its own included).
    pub window: Option<usize>,
}

/// One query head of one token; query head `h` reads KV head `h / group` (as transformers'
/// `repeat_kv`).
struct HeadJob<'a> {
    layer: usize,
    cache: &'a KvCache,
    kv_head: usize,
    table: &'a [u32],
    /// The first position attended to (0, or the sliding window's start).
    first: usize,
    /// One past the last position attended to (the query's own).
    ctx: usize,
}

impl HeadJob<'_> {
    /// The position of the first block attended to: scores are kept from it on, so a sliding
    /// window's job holds its window's (plus at most a block), not the whole context's.
    fn base(&self) -> usize {
        self.first - self.first % self.cache.block_size
    }

    /// Scores kept: from [`HeadJob::base`] to the last position attended to.
    fn span(&self) -> usize {
        self.ctx - self.base()
    }

    /// Blocks holding attended positions: (index of the block's first slot among the scores,
    /// block, first slot attended, slots up to the last attended one).
    fn blocks(&self) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        let bs = self.cache.block_size;
        let lo = self.first / bs;
        self.table
            .iter()
            .enumerate()
            .take(self.ctx.div_ceil(bs))
            .skip(lo)
            .map(move |(bi, &block)| {
                let from = if bi == lo { self.first - bi * bs } else { 0 };
                (
                    (bi - lo) * bs,
                    block as usize,
                    from,
                    bs.min(self.ctx - bi * bs),
                )
            })
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attend_avx512(job: &HeadJob<'_>, q: &[f32], out: &mut [f32]) {
    let c = job.cache;
    if c.block_size.is_multiple_of(L) && matches!(c.head_dim, 64 | 96 | 128) {
        let mut scores = vec![0f32; job.span()];
        x86::scores(job, q, &mut scores);
        let inv = softmax_unnormalised(&mut scores[job.first - job.base()..]);
        match c.head_dim {
            64 => x86::weighted_values::<4>(job, &scores, inv, out),
            96 => x86::weighted_values::<6>(job, &scores, inv, out),
            _ => x86::weighted_values::<8>(job, &scores, inv, out),
        }
    } else {
        attend(job, q, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(job: &HeadJob<'_>, q: &[f32], out: &mut [f32]) {
    let c = job.cache;
    if c.block_size.is_multiple_of(x86::L8) && c.head_dim.is_multiple_of(32) {
        let mut scores = vec![0f32; job.span()];
        x86::scores_avx2(job, q, &mut scores);
        let inv = softmax_unnormalised(&mut scores[job.first - job.base()..]);
        // 64 dimensions per pass over the values, then the last 32 (heads of 96).
        let mut d0 = 0;
        while d0 + 64 <= c.head_dim {
            x86::weighted_values_avx2::<8>(job, &scores, inv, d0, &mut out[d0..]);
            d0 += 64;
        }
        if d0 < c.head_dim {
            x86::weighted_values_avx2::<4>(job, &scores, inv, d0, &mut out[d0..]);
        }
    } else {
        attend(job, q, out)
    }
}

/// Lanes of a 512-bit vector of `f32`.
const L: usize = 16;

/// Replaces `scores` by `exp(score - max)` and returns `1 / sum` (vectorisable loops: the
/// exponentials in one pass, the sum in `L` lanes).
#[inline(always)]
fn softmax_unnormalised(scores: &mut [f32]) -> f32 {
    let m = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for s in scores.iter_mut() {
        *s = exp_approx(*s - m);
    }
    let mut lanes = [0f32; L];
    let mut chunks = scores.chunks_exact(L);
    for c in &mut chunks {
        for k in 0..L {
            lanes[k] += c[k];
        }
    }
    1.0 / (lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>())
}

/// Softmax attention of one head, portable: converts each cached value as it reads it.
#[inline(always)]
fn attend(job: &HeadJob<'_>, q: &[f32], out: &mut [f32]) {
    let c = job.cache;
    let (hd, bs) = (c.head_dim, c.block_size);
    let scale = 1.0 / (hd as f32).sqrt();
    // Indexed by position from the first block attended to; the slots before the window's
    // first position are left out.
    let mut scores = vec![0f32; job.span()];
    for (at, block, from, n) in job.blocks() {
        let kt = c.keys(job.layer, block, job.kv_head);
        for (j, s) in scores[at..at + n].iter_mut().enumerate().skip(from) {
            let dot: f32 = q
                .iter()
                .enumerate()
                .map(|(d, &qd)| qd * kt[d * bs + j].to_f32())
                .sum();
            *s = dot * scale;
        }
    }
    let inv = softmax_unnormalised(&mut scores[job.first - job.base()..]);
    out.fill(0.0);
    for (at, block, from, n) in job.blocks() {
        let vb = c.values(job.layer, block, job.kv_head);
        for (j, &p) in scores[at..at + n].iter().enumerate().skip(from) {
            for (o, &v) in out.iter_mut().zip(&vb[j * hd..(j + 1) * hd]) {
                *o += p * inv * v.to_f32();
            }
        }
    }
}

/// AVX-512 loops for 16-slot-multiple blocks and heads of 64, 96 or 128 dimensions (AVX2:
/// 8-slot-multiple blocks, heads of a multiple of 32).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{HeadJob, L};

    /// 16 half-precision values at `p`, widened.
    #[inline(always)]
    unsafe fn load16(p: *const half::f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }

    /// `scores[j] = q . k_j / sqrt(head_dim)`, 16 keys per step with four independent chains.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores(job: &HeadJob<'_>, q: &[f32], scores: &mut [f32]) {
        let c = job.cache;
        let (hd, bs) = (c.head_dim, c.block_size);
        let scale = _mm512_set1_ps(1.0 / (hd as f32).sqrt());
        let mut lanes = [0f32; L];
        // Whole blocks: the slots before the window's first are scored and left unused.
        for (at, block, _, n) in job.blocks() {
            let kt = c.keys(job.layer, block, job.kv_head).as_ptr();
            for j0 in (0..n).step_by(L) {
                let mut acc = [_mm512_setzero_ps(); 4];
                for d0 in (0..hd).step_by(4) {
                    for (i, a) in acc.iter_mut().enumerate() {
                        let d = d0 + i;
                        let k = load16(kt.add(d * bs + j0));
                        *a = _mm512_fmadd_ps(_mm512_set1_ps(*q.get_unchecked(d)), k, *a);
                    }
                }
                let sum =
                    _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
                _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_mul_ps(sum, scale));
                let take = L.min(n - j0);
                scores[at + j0..at + j0 + take].copy_from_slice(&lanes[..take]);
            }
        }
    }

    /// Attention of the `G` query heads (of 64 dimensions) sharing one KV head.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn attend_group<const G: usize>(
        job: &HeadJob<'_>,
        q: &[f32],
        out: &mut [f32],
    ) {
        const HD: usize = 64;
        let c = job.cache;
        let (bs, span) = (c.block_size, job.span());
        let scale = _mm512_set1_ps(1.0 / (HD as f32).sqrt());
        let mut scores = vec![0f32; G * span];
        let mut lanes = [0f32; L];
        // Whole blocks: the slots before the window's first are scored and left unused.
        for (at, block, _, n) in job.blocks() {
            let kt = c.keys(job.layer, block, job.kv_head).as_ptr();
            for j0 in (0..n).step_by(L) {
                let mut acc = [[_mm512_setzero_ps(); 2]; G];
                for d0 in (0..HD).step_by(2) {
                    for i in 0..2 {
                        let d = d0 + i;
                        let k = load16(kt.add(d * bs + j0));
                        for (g, a) in acc.iter_mut().enumerate() {
                            a[i] = _mm512_fmadd_ps(
                                _mm512_set1_ps(*q.get_unchecked(g * HD + d)),
                                k,
                                a[i],
                            );
                        }
                    }
                }
                let take = L.min(n - j0);
                for (g, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(
                        lanes.as_mut_ptr(),
                        _mm512_mul_ps(_mm512_add_ps(a[0], a[1]), scale),
                    );
                    let dst = g * span + at + j0;
                    scores[dst..dst + take].copy_from_slice(&lanes[..take]);
                }
            }
        }
        let mut inv = [0f32; G];
        for (g, i) in inv.iter_mut().enumerate() {
            let first = g * span + job.first - job.base();
            *i = super::softmax_unnormalised(&mut scores[first..(g + 1) * span]);
        }
        let mut acc = [[_mm512_setzero_ps(); 4]; G];
        for (at, block, from, n) in job.blocks() {
            let vb = c.values(job.layer, block, job.kv_head).as_ptr();
            for j in from..n {
                let v = [0, 1, 2, 3].map(|ci| load16(vb.add(j * HD + ci * L)));
                for (g, a) in acc.iter_mut().enumerate() {
                    let p = _mm512_set1_ps(*scores.get_unchecked(g * span + at + j));
                    for ci in 0..4 {
                        a[ci] = _mm512_fmadd_ps(p, v[ci], a[ci]);
                    }
                }
            }
        }
        for (g, a) in acc.iter().enumerate() {
            let s = _mm512_set1_ps(inv[g]);
            for (ci, &v) in a.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(g * HD + ci * L), _mm512_mul_ps(v, s));
            }
        }
    }

    /// Lanes of a 256-bit vector of `f32`.
    pub(super) const L8: usize = 8;

    /// 8 half-precision values at `p`, widened.
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// `scores` as [`scores`] does, 8 keys per step (AVX2; blocks of a multiple of 8 slots,
    /// head dimensions a multiple of 4).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores_avx2(job: &HeadJob<'_>, q: &[f32], scores: &mut [f32]) {
        let c = job.cache;
        let (hd, bs) = (c.head_dim, c.block_size);
        let scale = _mm256_set1_ps(1.0 / (hd as f32).sqrt());
        let mut lanes = [0f32; L8];
        // Whole blocks: the slots before the window's first are scored and left unused.
        for (at, block, _, n) in job.blocks() {
            let kt = c.keys(job.layer, block, job.kv_head).as_ptr();
            for j0 in (0..n).step_by(L8) {
                let mut acc = [_mm256_setzero_ps(); 4];
                for d0 in (0..hd).step_by(4) {
                    for (i, a) in acc.iter_mut().enumerate() {
                        let d = d0 + i;
                        let k = load8(kt.add(d * bs + j0));
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(*q.get_unchecked(d)), k, *a);
                    }
                }
                let sum =
                    _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
                _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(sum, scale));
                let take = L8.min(n - j0);
                scores[at + j0..at + j0 + take].copy_from_slice(&lanes[..take]);
            }
        }
    }

    /// `out[..8 C] = inv * sum_j p_j v_j[d0..d0 + 8 C]` (AVX2, `C` independent chains).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weighted_values_avx2<const C: usize>(
        job: &HeadJob<'_>,
        p: &[f32],
        inv: f32,
        d0: usize,
        out: &mut [f32],
    ) {
        let c = job.cache;
        let hd = c.head_dim;
        let mut acc = [_mm256_setzero_ps(); C];
        for (at, block, from, n) in job.blocks() {
            let vb = c.values(job.layer, block, job.kv_head).as_ptr();
            for j in from..n {
                let pj = _mm256_set1_ps(p[at + j]);
                for (ci, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(pj, load8(vb.add(j * hd + d0 + ci * L8)), *a);
                }
            }
        }
        let scale = _mm256_set1_ps(inv);
        for (ci, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(ci * L8), _mm256_mul_ps(*a, scale));
        }
    }

    /// `out = inv * sum_j p_j v_j` for heads of `C * 16` dimensions, `C` independent chains.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_values<const C: usize>(
        job: &HeadJob<'_>,
        p: &[f32],
        inv: f32,
        out: &mut [f32],
    ) {
        let c = job.cache;
        let hd = c.head_dim;
        let mut acc = [_mm512_setzero_ps(); C];
        for (at, block, from, n) in job.blocks() {
            let vb = c.values(job.layer, block, job.kv_head).as_ptr();
            for j in from..n {
                let pj = _mm512_set1_ps(p[at + j]);
                for (ci, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(pj, load16(vb.add(j * hd + ci * L)), *a);
                }
            }
        }
        let scale = _mm512_set1_ps(inv);
        for (ci, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(ci * L), _mm512_mul_ps(*a, scale));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> f32 {
        half::f16::from_f32(x).to_f32()
    }

    fn batch1<'a>(queries: &'a [QueryPos], tables: &'a [&'a [u32]]) -> AttentionBatch<'a> {
        AttentionBatch {
            queries,
            tables,
            num_heads: 1,
            window: None,
        }
    }

    /// An output one head short panics before the grouped path's whole-head stores run
    /// past it.
    #[test]
    #[should_panic(expected = "attention: q 256 and out 192")]
    fn shapes_that_disagree_are_refused() {
        let (hd, bs, kvh) = (64, 16, 1);
        let cache = KvCache::new(1, 2, bs, kvh, hd).unwrap();
        let queries = [QueryPos { pos: 0, seq: 0 }];
        let table = [0u32];
        let batch = AttentionBatch {
            queries: &queries,
            tables: &[&table],
            num_heads: 4,
            window: None,
        };
        let q = vec![0.1f32; 4 * hd];
        let mut out = vec![0f32; 3 * hd];
        attention(0, &q, &cache, &batch, &mut out, Isa::detect());
    }

    /// Three query heads per KV head, 64 dimensions, 16-slot blocks: the grouped AVX-512 path
    /// against the portable one.
    #[test]
    fn grouped_heads_match_single_heads() {
        let (hd, bs, kvh, group, ctx) = (64, 16, 2, 3, 45);
        let mut cache = KvCache::new(1, 4, bs, kvh, hd).unwrap();
        let table = [2u32, 0, 3];
        for i in 0..ctx {
            let k: Vec<f32> = (0..kvh * hd)
                .map(|d| ((i * 7 + d * 3) % 17) as f32 * 0.05 - 0.4)
                .collect();
            let v: Vec<f32> = (0..kvh * hd)
                .map(|d| ((i * 5 + d) % 13) as f32 * 0.2 - 1.0)
                .collect();
            cache.write(0, table[i / bs] as usize, i % bs, &k, &v);
        }
        let nh = kvh * group;
        let queries = [
            QueryPos {
                pos: ctx - 1,
                seq: 0,
            },
            QueryPos { pos: 20, seq: 0 },
        ];
        let q: Vec<f32> = (0..2 * nh * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let batch = AttentionBatch {
            queries: &queries,
            tables: &[&table],
            num_heads: nh,
            window: None,
        };
        let mut fast = vec![0f32; 2 * nh * hd];
        let mut plain = vec![0f32; 2 * nh * hd];
        attention(0, &q, &cache, &batch, &mut fast, Isa::detect());
        attention(0, &q, &cache, &batch, &mut plain, Isa::Scalar);
        for (i, (a, b)) in fast.iter().zip(&plain).enumerate() {
            assert!((a - b).abs() < 1e-5, "{i}: {a} vs {b}");
        }
    }

    /// (head dimension, block size, query heads per KV head) of the window checks: the grouped
    /// AVX-512 path at 64 dimensions and 3 heads per KV head, the one-head vector loops at 96
    /// and 128, AVX2 at 32, the plain loops for 8-slot blocks under AVX-512 and odd block sizes.
    const WINDOW_SHAPES: [(usize, usize, usize); 5] = [
        (64, 16, 3),
        (96, 16, 1),
        (128, 16, 2),
        (32, 8, 1),
        (64, 5, 2),
    ];

    /// A sliding window: each query attends to its last `window` positions only, on every
    /// path (the grouped AVX-512 one at 64 dimensions and 3 heads per KV head, the one-head
    /// vector loops at 96 and 128, AVX2 at 32, the plain loops for 8-slot blocks under
    /// AVX-512 and odd block sizes), against a dense softmax over those positions; windows
    /// starting inside a block, on a block's first slot, of one position and past the start.
    #[test]
    fn a_sliding_window_attends_to_the_last_positions_only() {
        for (hd, bs, group) in WINDOW_SHAPES {
            let (kvh, ctx) = (2, 70);
            let nh = kvh * group;
            let mut cache = KvCache::new(1, 32, bs, kvh, hd).unwrap();
            let table: Vec<u32> = (0..32).rev().collect();
            let key = |i: usize, d: usize| h(((i * 7 + d * 3) % 17) as f32 * 0.08 - 0.6);
            let val = |i: usize, d: usize| h(((i * 5 + d) % 13) as f32 * 0.2 - 1.0);
            for i in 0..ctx {
                let k: Vec<f32> = (0..kvh * hd).map(|d| key(i, d)).collect();
                let v: Vec<f32> = (0..kvh * hd).map(|d| val(i, d)).collect();
                cache.write(0, table[i / bs] as usize, i % bs, &k, &v);
            }
            let positions = [ctx - 1, 40, 16, 3, 0];
            let queries: Vec<QueryPos> = positions
                .iter()
                .map(|&pos| QueryPos { pos, seq: 0 })
                .collect();
            let q: Vec<f32> = (0..positions.len() * nh * hd)
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            for window in [1, 16, 17, 33, 69] {
                for isa in [Isa::Avx512Vnni, Isa::Avx2, Isa::Scalar] {
                    let batch = AttentionBatch {
                        queries: &queries,
                        tables: &[&table],
                        num_heads: nh,
                        window: Some(window),
                    };
                    let mut out = vec![0f32; q.len()];
                    attention(0, &q, &cache, &batch, &mut out, isa);
                    for (t, &pos) in positions.iter().enumerate() {
                        for head in 0..nh {
                            let kv = head / group;
                            let at = (t * nh + head) * hd;
                            let qh = &q[at..at + hd];
                            let keys = (pos + 1).saturating_sub(window)..=pos;
                            let logits: Vec<f32> = keys
                                .clone()
                                .map(|i| {
                                    (0..hd).map(|d| qh[d] * key(i, kv * hd + d)).sum::<f32>()
                                        / (hd as f32).sqrt()
                                })
                                .collect();
                            let m = logits.iter().cloned().fold(f32::MIN, f32::max);
                            let z: f32 = logits.iter().map(|l| (l - m).exp()).sum();
                            for d in 0..hd {
                                let want: f32 = keys
                                    .clone()
                                    .zip(&logits)
                                    .map(|(i, l)| (l - m).exp() / z * val(i, kv * hd + d))
                                    .sum();
                                let got = out[at + d];
                                assert!(
                                    (got - want).abs() < 1e-4,
                                    "{isa:?} hd {hd} bs {bs} group {group} window {window} \
                                     pos {pos} head {head} d {d}: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// What the scheduler relies on when it gives back a running sequence's blocks behind a
    /// sliding window (`Backend::window_read_slack`: a block for this backend): a query reads
    /// no key more than a block before its window, so those slots may hold anything, NaN
    /// included, on every path and instruction set.
    #[test]
    fn no_key_more_than_a_block_before_the_window_is_read() {
        for (hd, bs, group) in WINDOW_SHAPES {
            let (kvh, ctx) = (2, 70);
            let nh = kvh * group;
            let table: Vec<u32> = (0..32).rev().collect();
            let fill = |poison_below: usize| {
                let mut cache = KvCache::new(1, 32, bs, kvh, hd).unwrap();
                for i in 0..ctx {
                    let (k, v): (Vec<f32>, Vec<f32>) = (0..kvh * hd)
                        .map(|d| match i < poison_below {
                            true => (f32::NAN, f32::NAN),
                            false => (
                                ((i * 7 + d * 3) % 17) as f32 * 0.08 - 0.6,
                                ((i * 5 + d) % 13) as f32 * 0.2 - 1.0,
                            ),
                        })
                        .unzip();
                    cache.write(0, table[i / bs] as usize, i % bs, &k, &v);
                }
                cache
            };
            let clean = fill(0);
            for window in [1, 7, 16, 33] {
                for pos in [ctx - 1, 40, 23] {
                    let first = (pos + 1).saturating_sub(window);
                    let poisoned = fill(first.saturating_sub(bs));
                    let queries = [QueryPos { pos, seq: 0 }];
                    let q: Vec<f32> = (0..nh * hd).map(|i| (i as f32 * 0.37).sin()).collect();
                    let batch = AttentionBatch {
                        queries: &queries,
                        tables: &[&table],
                        num_heads: nh,
                        window: Some(window),
                    };
                    for isa in [Isa::Avx512Vnni, Isa::Avx2, Isa::Scalar] {
                        let mut want = vec![0f32; q.len()];
                        let mut got = vec![0f32; q.len()];
                        attention(0, &q, &clean, &batch, &mut want, isa);
                        attention(0, &q, &poisoned, &batch, &mut got, isa);
                        assert_eq!(
                            got, want,
                            "{isa:?} hd {hd} bs {bs} group {group} window {window} pos {pos}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn vector_path_matches_plain_path() {
        // Head dimensions 64, 96 and 128 with 16-slot blocks take the vector loops (AVX2: any
        // multiple of 32); others the plain ones.
        for (hd, bs) in [(64, 16), (128, 16), (96, 16), (32, 16), (64, 3), (6, 16)] {
            let ctx = 37;
            let mut cache = KvCache::new(1, 16, bs, 1, hd).unwrap();
            let table: Vec<u32> = (0..16).rev().collect();
            for i in 0..ctx {
                let k: Vec<f32> = (0..hd)
                    .map(|d| ((i * 7 + d * 3) % 11) as f32 * 0.1 - 0.5)
                    .collect();
                let v: Vec<f32> = (0..hd)
                    .map(|d| ((i * 5 + d) % 13) as f32 * 0.2 - 1.0)
                    .collect();
                cache.write(0, table[i / bs] as usize, i % bs, &k, &v);
            }
            let q: Vec<f32> = (0..hd).map(|d| (d as f32 * 0.37).sin()).collect();
            let queries = [QueryPos {
                pos: ctx - 1,
                seq: 0,
            }];
            // Every instruction set this machine runs (`attention` falls back to the plain
            // loops for one it does not).
            let isas = [Isa::Avx512Vnni, Isa::Avx2, Isa::Scalar];
            let outs = isas.map(|isa| {
                let mut out = vec![0f32; hd];
                attention(0, &q, &cache, &batch1(&queries, &[&table]), &mut out, isa);
                out
            });
            // A dense reference.
            let keys: Vec<Vec<f32>> = (0..ctx)
                .map(|i| {
                    (0..hd)
                        .map(|d| h(((i * 7 + d * 3) % 11) as f32 * 0.1 - 0.5))
                        .collect()
                })
                .collect();
            let logits: Vec<f32> = keys
                .iter()
                .map(|k| k.iter().zip(&q).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt())
                .collect();
            let m = logits.iter().cloned().fold(f32::MIN, f32::max);
            let z: f32 = logits.iter().map(|l| (l - m).exp()).sum();
            for d in 0..hd {
                let want: f32 = (0..ctx)
                    .map(|i| (logits[i] - m).exp() / z * h(((i * 5 + d) % 13) as f32 * 0.2 - 1.0))
                    .sum();
                for (isa, out) in isas.iter().zip(&outs) {
                    assert!(
                        (out[d] - want).abs() < 1e-5,
                        "{isa:?}: hd {hd} bs {bs} d {d}"
                    );
                }
            }
        }
    }

    /// Two query heads sharing one KV head, context split over two non-adjacent blocks,
    /// against a direct softmax-weighted sum.
    #[test]
    fn paged_gqa_matches_dense_attention() {
        let (hd, bs, ctx) = (4, 2, 3);
        let mut cache = KvCache::new(1, 4, bs, 1, hd).unwrap();
        let keys: Vec<[f32; 4]> = (0..ctx)
            .map(|i| [i as f32, 1.0, -0.5 * i as f32, 0.25])
            .collect();
        let vals: Vec<[f32; 4]> = (0..ctx)
            .map(|i| [1.0 + i as f32, 2.0, 3.0 * i as f32, -1.0])
            .collect();
        let table = [3u32, 1];
        for i in 0..ctx {
            cache.write(0, table[i / bs] as usize, i % bs, &keys[i], &vals[i]);
        }
        let q = [0.5f32, -1.0, 2.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        for isa in [Isa::Scalar, Isa::detect()] {
            let mut out = vec![0f32; 8];
            let queries = [QueryPos {
                pos: ctx - 1,
                seq: 0,
            }];
            let batch = AttentionBatch {
                queries: &queries,
                tables: &[&table],
                num_heads: 2,
                window: None,
            };
            attention(0, &q, &cache, &batch, &mut out, isa);
            for g in 0..2 {
                let qg = &q[g * 4..g * 4 + 4];
                let logits: Vec<f32> = keys
                    .iter()
                    .map(|k| k.iter().zip(qg).map(|(a, b)| a * b).sum::<f32>() / 2.0)
                    .collect();
                let m = logits.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = logits.iter().map(|l| (l - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for d in 0..hd {
                    let want: f32 = (0..ctx).map(|i| e[i] / z * vals[i][d]).sum();
                    assert!((out[g * 4 + d] - want).abs() < 1e-5, "{isa:?} g{g} d{d}");
                }
            }
        }
    }
}
