// Switchyard's CUDA kernels for the Llama forward pass and GPU sampling, compiled by NVRTC at
// start for the device's architecture (gpu/src/cuda/device.rs). Matrix products are cuBLAS's
// for steps of more than 64 tokens and gemv.cu's (compiled after this file) for smaller ones;
// these kernels are the element-wise, attention and sampling parts around them.
//
// Layouts: activations are row-major [tokens, features]; the residual stream is f32, matrix
// inputs bf16. The paged KV cache of one layer is [slots, kv_heads, head_dim] bf16 for keys and
// the same for values, slot = block * block_size + offset.

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;
typedef unsigned int u32;

#define NEG_INF (-__int_as_float(0x7f800000))

// Programmatic dependent launch (Hopper). The host may launch every kernel with the
// programmatic-serialization attribute (gpu/src/cuda/device.rs): the next kernel in the stream
// can then be scheduled once every block of this one has run pdl_trigger(), and must run
// pdl_wait() (which returns once the previous kernel has completed and its writes are visible)
// before it reads anything an earlier kernel wrote or writes anything an earlier kernel reads.
// Every kernel here starts with PDL_ENTER(), or, like the GEMV kernels, does only independent
// work (prefetching weights) between the trigger and the wait. Both are no-ops without the
// attribute and below sm_90.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#define PDL_ENTER() \
    do {            \
        pdl_trigger(); \
        pdl_wait();    \
    } while (0)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `red` holds 32 floats.
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.f;
    return warp_sum(t);
}

__device__ float block_max(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : NEG_INF;
    return warp_max(t);
}

// Sum of squares of h floats by one warp: lane-strided (float4 pieces when h % 4 == 0),
// sequential per lane with explicit fused multiply-adds, then the butterfly. rms_norm and the
// GEMV norm prologue (gemv.cu) both use it and rms_inv, so a token is normalised to the same
// bits whichever kernel does it.
__device__ __forceinline__ float warp_sumsq(const float* __restrict__ xr, int h, int lane) {
    float ss = 0.f;
    if ((h & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
#pragma unroll 8
        for (int i = lane; i < (h >> 2); i += 32) {
            float4 v = x4[i];
            ss = __fmaf_rn(v.x, v.x, ss);
            ss = __fmaf_rn(v.y, v.y, ss);
            ss = __fmaf_rn(v.z, v.z, ss);
            ss = __fmaf_rn(v.w, v.w, ss);
        }
    } else {
        for (int i = lane; i < h; i += 32) ss = __fmaf_rn(xr[i], xr[i], ss);
    }
    return warp_sum(ss);
}

// 1 / sqrt(ss / h + eps), each operation rounded once.
__device__ __forceinline__ float rms_inv(float ss, int h, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)h), eps)));
}

// The normalised value w * (x * inv) (two rounded products).
__device__ __forceinline__ float rms_scale(float x, float w, float inv) {
    return __fmul_rn(w, __fmul_rn(x, inv));
}

// SwiGLU of a bf16 gate and up value, as f32: silu(g) * u (silu_mul and the GEMV epilogue).
__device__ __forceinline__ float silu_times(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), u);
}

// ---------------------------------------------------------------------------------------------
// Weights initialisation (load_format: dummy) and embedding.

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// p[i] = scale * uniform(-1, 1), a pure function of (seed, i).
extern "C" __global__ void init_uniform_bf16(bf16* p, u64 n, u64 seed, float scale) {
    PDL_ENTER();
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 z = mix64(seed ^ mix64(i + 0x9e3779b97f4a7c15ull));
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        p[i] = __float2bfloat16((2.f * u - 1.f) * scale);
    }
}

extern "C" __global__ void fill_f32(float* p, u64 n, float v) {
    PDL_ENTER();
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) p[i] = v;
}

// x[t] = table[tokens[t]] as f32. Grid: one block per token.
extern "C" __global__ void embed(const bf16* table, const int* tokens, float* x, int h) {
    PDL_ENTER();
    int t = blockIdx.x;
    const bf16* row = table + (u64)tokens[t] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) x[(u64)t * h + i] = __bfloat162float(row[i]);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: out[r] = w * x[src] / sqrt(mean(x[src]^2) + eps), src = rows ? rows[r] : r.
// Grid: one block per row; warp 0 sums the squares (warp_sumsq), every thread writes.
extern "C" __global__ void rms_norm(const float* x, const float* w, bf16* out, const int* rows,
                                    int h, float eps) {
    PDL_ENTER();
    __shared__ float inv_s;
    int r = blockIdx.x;
    int src = rows ? rows[r] : r;
    const float* xr = x + (u64)src * h;
    bf16* o = out + (u64)r * h;
    if (threadIdx.x < 32) {
        float ss = warp_sumsq(xr, h, threadIdx.x);
        if (threadIdx.x == 0) inv_s = rms_inv(ss, h, eps);
    }
    __syncthreads();
    float inv = inv_s;
    if ((h & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll 4
        for (int i = threadIdx.x; i < (h >> 2); i += blockDim.x) {
            float4 v = x4[i], g = w4[i];
            reinterpret_cast<__nv_bfloat162*>(o)[2 * i] =
                __floats2bfloat162_rn(rms_scale(v.x, g.x, inv), rms_scale(v.y, g.y, inv));
            reinterpret_cast<__nv_bfloat162*>(o)[2 * i + 1] =
                __floats2bfloat162_rn(rms_scale(v.z, g.z, inv), rms_scale(v.w, g.w, inv));
        }
        return;
    }
    for (int i = threadIdx.x; i < h; i += blockDim.x)
        o[i] = __float2bfloat16(rms_scale(xr[i], w[i], inv));
}

// ---------------------------------------------------------------------------------------------
// RoPE on the Q and K parts of `qkv` (f32 [T, (nh + 2 nkv) hd]), Q written to `q` (bf16), K and
// V written to the cache slots (slot < 0: a padding token, nothing written).
extern "C" __global__ void rope_store_kv(const float* qkv, bf16* q, bf16* kc, bf16* vc,
                                         const int* pos, const long long* slots,
                                         const float* inv_freq, int nh, int nkv, int hd,
                                         int interleaved) {
    PDL_ENTER();
    int t = blockIdx.x;
    int half = hd / 2;
    int width = (nh + 2 * nkv) * hd;
    const float* row = qkv + (u64)t * width;
    float p = (float)pos[t];
    long long slot = slots[t];
    // Pairs of Q heads then K heads.
    int pairs = (nh + nkv) * half;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        int head = i / half, j = i % half;
        int a = interleaved ? 2 * j : j;
        int b = interleaved ? 2 * j + 1 : j + half;
        float ang = p * inv_freq[j];
        float s, c;
        sincosf(ang, &s, &c);
        float x0 = row[head * hd + a], x1 = row[head * hd + b];
        float y0 = x0 * c - x1 * s;
        float y1 = x1 * c + x0 * s;
        if (head < nh) {
            bf16* qo = q + (u64)t * nh * hd + head * hd;
            qo[a] = __float2bfloat16(y0);
            qo[b] = __float2bfloat16(y1);
        } else if (slot >= 0) {
            bf16* ko = kc + slot * nkv * hd + (head - nh) * hd;
            ko[a] = __float2bfloat16(y0);
            ko[b] = __float2bfloat16(y1);
        }
    }
    if (slot >= 0) {
        const float* v = row + (nh + nkv) * hd;
        bf16* vo = vc + slot * nkv * hd;
        for (int i = threadIdx.x; i < nkv * hd; i += blockDim.x) vo[i] = __float2bfloat16(v[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: gu is [T, 2 inter] (gate | up); out[t, i] = silu(gate) * up.
extern "C" __global__ void silu_mul(const bf16* gu, bf16* out, int inter, u64 total) {
    PDL_ENTER();
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        u64 t = i / inter, j = i % inter;
        float g = __bfloat162float(gu[t * 2 * inter + j]);
        float u = __bfloat162float(gu[t * 2 * inter + inter + j]);
        out[i] = __float2bfloat16(silu_times(g, u));
    }
}

// ---------------------------------------------------------------------------------------------
// Paged attention for prefill chunks and decodes in one launch.
//
// Work is cut into tiles: a tile is up to `qn` consecutive query tokens of one sequence (their
// positions increase by one), and a block handles one tile, one KV head (all query heads of its
// group: rows = tokens x group) and one split of the key range. Keys are streamed 32 at a time
// through shared memory (flash-attention-style online softmax, one warp per row); row r's query
// at position p attends keys 0..=p, so cached prefix blocks (prefix-cache hits, earlier chunks)
// are read through the block table like any other. With more than one split, each block writes
// its unnormalised partial result and `attention_combine` merges them (split-K decoding for long
// contexts; a launch with gridDim.z > 1 always goes through the combine step). meta[0] =
// block-table stride, meta[1] = split length (a multiple of 32), meta[2] = number of splits in
// use (at most gridDim.z).

#define ATT_WARPS 4
#define ATT_ROWS 32
#define ATT_RPW (ATT_ROWS / ATT_WARPS)
#define ATT_KEYS 32

template <int HD>
__device__ void attention_body(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                               const bf16* __restrict__ vc, const int* __restrict__ pos,
                               const int* __restrict__ tile_seq, const int* __restrict__ tile_q0,
                               const int* __restrict__ tile_qn,
                               const int* __restrict__ block_tables, const int* __restrict__ meta,
                               float* __restrict__ part_acc, float* __restrict__ part_ml,
                               bf16* __restrict__ out, int nh, int nkv, int block_size,
                               float scale) {
    constexpr int DPL = HD / 32;  // dimensions per lane
    __shared__ float q_s[ATT_ROWS][HD];
    __shared__ float k_s[ATT_KEYS][HD + 1];
    __shared__ bf16 v_s[ATT_KEYS][HD];

    int tile = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    int qn = tile_qn[tile];
    int nsplit = meta[2];
    if (qn <= 0 || split >= nsplit) return;
    int q0 = tile_q0[tile];
    int seq = tile_seq[tile];
    int group = nh / nkv;
    int rows = qn * group;
    int stride = meta[0], split_len = meta[1];
    const int* table = block_tables + (long long)seq * stride;
    int pmax = pos[q0 + qn - 1];
    int kstart = split * split_len;
    int kend = min(kstart + split_len, pmax + 1);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // Queries of the tile, f32 in shared memory.
    for (int i = threadIdx.x; i < rows * HD; i += blockDim.x) {
        int r = i / HD, d = i % HD;
        int t = q0 + r / group, head = kvh * group + r % group;
        q_s[r][d] = __bfloat162float(q[((long long)t * nh + head) * HD + d]);
    }

    float m[ATT_RPW], l[ATT_RPW], acc[ATT_RPW][DPL];
    int rpos[ATT_RPW];
#pragma unroll
    for (int i = 0; i < ATT_RPW; i++) {
        m[i] = NEG_INF;
        l[i] = 0.f;
        int r = warp + i * ATT_WARPS;
        rpos[i] = r < rows ? pos[q0 + r / group] : -1;
#pragma unroll
        for (int d = 0; d < DPL; d++) acc[i][d] = 0.f;
    }

    for (int kb = kstart; kb < kend; kb += ATT_KEYS) {
        __syncthreads();
        // Load 32 keys and values: 16-byte pieces, HD / 8 per key.
        constexpr int PIECES = HD / 8;
        for (int i = threadIdx.x; i < ATT_KEYS * PIECES; i += blockDim.x) {
            int j = i / PIECES, c = i % PIECES;
            int kp = kb + j;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (kp < kend) {
                long long slot = (long long)table[kp / block_size] * block_size + kp % block_size;
                long long off = (slot * nkv + kvh) * HD + c * 8;
                kv4 = *reinterpret_cast<const uint4*>(kc + off);
                vv4 = *reinterpret_cast<const uint4*>(vc + off);
            }
            const bf16* kh = reinterpret_cast<const bf16*>(&kv4);
#pragma unroll
            for (int e = 0; e < 8; e++) k_s[j][c * 8 + e] = __bfloat162float(kh[e]);
            *reinterpret_cast<uint4*>(&v_s[j][c * 8]) = vv4;
        }
        __syncthreads();
        int kp = kb + lane;
#pragma unroll
        for (int i = 0; i < ATT_RPW; i++) {
            int r = warp + i * ATT_WARPS;
            if (r >= rows) continue;  // warp-uniform
            float s = 0.f;
#pragma unroll 8
            for (int d = 0; d < HD; d++) s += q_s[r][d] * k_s[lane][d];
            s *= scale;
            bool ok = kp < kend && kp <= rpos[i];
            s = ok ? s : NEG_INF;
            float cm = warp_max(s);
            float mn = fmaxf(m[i], cm);
            if (mn == NEG_INF) continue;  // nothing visible yet (warp-uniform)
            float p = ok ? __expf(s - mn) : 0.f;
            float corr = m[i] == NEG_INF ? 0.f : __expf(m[i] - mn);
            l[i] = l[i] * corr + warp_sum(p);
            m[i] = mn;
#pragma unroll
            for (int d = 0; d < DPL; d++) acc[i][d] *= corr;
#pragma unroll 4
            for (int j = 0; j < ATT_KEYS; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int d = 0; d < DPL; d++)
                    acc[i][d] += pj * __bfloat162float(v_s[j][lane + 32 * d]);
            }
        }
    }

#pragma unroll
    for (int i = 0; i < ATT_RPW; i++) {
        int r = warp + i * ATT_WARPS;
        if (r >= rows) continue;
        int t = q0 + r / group, head = kvh * group + r % group;
        if (gridDim.z == 1) {
            float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
            bf16* o = out + ((long long)t * nh + head) * HD;
#pragma unroll
            for (int d = 0; d < DPL; d++) o[lane + 32 * d] = __float2bfloat16(acc[i][d] * inv);
        } else {
            long long base = ((long long)t * nh + head) * gridDim.z + split;
            float* a = part_acc + base * HD;
#pragma unroll
            for (int d = 0; d < DPL; d++) a[lane + 32 * d] = acc[i][d];
            if (lane == 0) {
                part_ml[base * 2] = m[i];
                part_ml[base * 2 + 1] = l[i];
            }
        }
    }
    // Splits past this tile's keys still report an empty result for the combine step.
}

#define ATTENTION_KERNEL(HD)                                                                     \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attention_##HD(                \
        const bf16* q, const bf16* kc, const bf16* vc, const int* pos, const int* tile_seq,      \
        const int* tile_q0, const int* tile_qn, const int* block_tables, const int* meta,        \
        float* part_acc, float* part_ml, bf16* out, int nh, int nkv, int block_size,             \
        float scale) {                                                                           \
        PDL_ENTER();                                                                             \
        attention_body<HD>(q, kc, vc, pos, tile_seq, tile_q0, tile_qn, block_tables, meta,       \
                           part_acc, part_ml, out, nh, nkv, block_size, scale);                  \
    }

ATTENTION_KERNEL(64)
ATTENTION_KERNEL(128)

// Merges the splits of every (token, head): grid (tokens, heads), block hd threads. `pos`
// gives each token's position, so splits past it (never written in this step) are skipped.
extern "C" __global__ void attention_combine(const float* part_acc, const float* part_ml,
                                             const int* pos, const int* meta, bf16* out, int nh,
                                             int hd, int max_splits) {
    PDL_ENTER();
    int t = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    int nsplit = meta[2], split_len = meta[1];
    int used = min(nsplit, pos[t] / split_len + 1);
    long long base = ((long long)t * nh + head) * max_splits;
    float mx = NEG_INF;
    for (int s = 0; s < used; s++) mx = fmaxf(mx, part_ml[(base + s) * 2]);
    float num = 0.f, den = 0.f;
    if (mx != NEG_INF) {
        for (int s = 0; s < used; s++) {
            float ms = part_ml[(base + s) * 2];
            if (ms == NEG_INF) continue;
            float w = __expf(ms - mx);
            den += w * part_ml[(base + s) * 2 + 1];
            if (d < hd) num += w * part_acc[(base + s) * hd + d];
        }
    }
    if (d < hd) out[((long long)t * nh + head) * hd + d] = __float2bfloat16(den > 0.f ? num / den : 0.f);
}

// ---------------------------------------------------------------------------------------------
// Sampling.

// Sparse logit edits of one (row, token), merged on the host in the CPU sampler's order:
// bias, then the min_tokens mask, then the repetition penalty, then presence/frequency.
extern "C" __global__ void apply_logit_edits(float* logits, u64 vocab, const int* rows,
                                             const int* tokens, const float* bias,
                                             const int* mask, const float* rep, const float* sub,
                                             int n) {
    PDL_ENTER();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float* l = logits + (u64)rows[i] * vocab + tokens[i];
    float v = *l + bias[i];
    if (mask[i]) v = NEG_INF;
    float r = rep[i];
    if (r != 1.f) v = v > 0.f ? v / r : v * r;
    v -= sub[i];
    *l = v;
}

// Orders floats as unsigned integers (larger float, larger key).
__device__ __forceinline__ u32 fkey(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ u32 block_count(u32 v, u32* redu) {
    // Counts fit f32 exactly below 2^24 (vocabularies are bounded by 2^22).
    return (u32)block_sum((float)v, reinterpret_cast<float*>(redu));
}

#define SAMPLE_THREADS 1024

// One block per sampled row: greedy (temperature 0) or temperature sampling with top-k, top-p
// and min-p, one uniform draw from the counter-based stream (seed, counter). Ties in greedy go
// to the lowest id; top-k and top-p keep every token tied with the threshold.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* logits, u64 vocab, const int* rows, const float* temperature,
                const int* top_k, const float* top_p, const float* min_p, const u64* seeds,
                const u64* counters, int* out_tokens) {
    PDL_ENTER();
    __shared__ float red[32];
    __shared__ float scan[SAMPLE_THREADS];
    __shared__ int found;
    int s = blockIdx.x;
    const float* l = logits + (u64)rows[s] * vocab;
    int tid = threadIdx.x, n = (int)vocab;
    float T = temperature[s];

    // Rows of a vocabulary that is a multiple of 4 are read as float4 (16-byte aligned).
    const bool vec4 = (n & 3) == 0;

    // Max and the lowest index holding it.
    float mx = NEG_INF;
    if (vec4) {
        const float4* l4 = reinterpret_cast<const float4*>(l);
#pragma unroll 4
        for (int i = tid; i < (n >> 2); i += blockDim.x) {
            float4 v = l4[i];
            mx = fmaxf(mx, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
        }
    } else {
        for (int i = tid; i < n; i += blockDim.x) mx = fmaxf(mx, l[i]);
    }
    mx = block_max(mx, red);
    if (tid == 0) found = n;
    __syncthreads();
    if (T == 0.f || !(mx > NEG_INF)) {
        if (!(mx > NEG_INF) && T != 0.f) {
            if (tid == 0) out_tokens[s] = 0;
            return;
        }
        for (int i = tid; i < n; i += blockDim.x)
            if (l[i] == mx) atomicMin(&found, i);
        __syncthreads();
        if (tid == 0) out_tokens[s] = found < n ? found : 0;
        return;
    }
    float inv_t = 1.f / T;
    // Threshold on the float key: keep tokens with key >= thr.
    u32 thr = 0;
    int k = top_k[s];
    if (k > 0 && k < n) {
        u32 res = 0;
        for (int bit = 31; bit >= 0; bit--) {
            u32 cand = res | (1u << bit);
            u32 c = 0;
            for (int i = tid; i < n; i += blockDim.x) c += fkey(l[i]) >= cand;
            if (block_count(c, reinterpret_cast<u32*>(red)) >= (u32)k) res = cand;
        }
        thr = res;
    }
    float mp = min_p[s];
    float floor_logit = mp > 0.f ? mx + T * logf(mp) : NEG_INF;
    float tp = top_p[s];
    if (tp < 1.f) {
        float total = 0.f;
        for (int i = tid; i < n; i += blockDim.x) {
            float v = l[i];
            if (fkey(v) >= thr) total += __expf((v - mx) * inv_t);
        }
        total = block_sum(total, red);
        float target = tp * total;
        // The largest key x whose tokens (key >= max(x, thr)) still hold top_p of the mass;
        // the predicate falls as x grows, so bits are fixed from the top.
        u32 res = 0;
        for (int bit = 31; bit >= 0; bit--) {
            u32 cand = res | (1u << bit);
            u32 lim = max(cand, thr);
            float mass = 0.f;
            for (int i = tid; i < n; i += blockDim.x) {
                float v = l[i];
                if (fkey(v) >= lim) mass += __expf((v - mx) * inv_t);
            }
            if (block_sum(mass, red) >= target) res = cand;
        }
        thr = max(res, thr);
    }
    // Sum of the kept probabilities over each thread's contiguous chunk (a multiple of 4 with
    // vec4, read as float4, in index order either way), then an inclusive scan.
    int bd = blockDim.x;
    int chunk = vec4 ? (n + 4 * bd - 1) / (4 * bd) * 4 : (n + bd - 1) / bd;
    int lo = min(n, tid * chunk), hi = min(n, lo + chunk);
    float part = 0.f;
    if (vec4) {
#pragma unroll 4
        for (int i = lo; i < hi; i += 4) {
            float4 v4 = *reinterpret_cast<const float4*>(l + i);
            float vs[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (fkey(vs[e]) >= thr && vs[e] >= floor_logit) part += __expf((vs[e] - mx) * inv_t);
        }
    } else {
        for (int i = lo; i < hi; i++) {
            float v = l[i];
            if (fkey(v) >= thr && v >= floor_logit) part += __expf((v - mx) * inv_t);
        }
    }
    scan[tid] = part;
    __syncthreads();
    for (int off = 1; off < blockDim.x; off <<= 1) {
        float add = tid >= off ? scan[tid - off] : 0.f;
        __syncthreads();
        scan[tid] += add;
        __syncthreads();
    }
    float total = scan[blockDim.x - 1];
    u64 z = mix64(seeds[s] ^ mix64(counters[s] + 0x632be59bd9b4e019ull));
    double u = (double)(z >> 11) * (1.0 / 9007199254740992.0);
    float target = (float)(u * (double)total);
    float before = tid > 0 ? scan[tid - 1] : 0.f;
    if (tid == 0) found = -1;
    __syncthreads();
    // The thread whose interval holds the target walks its chunk; rounding at the end of the
    // chunk falls back to its last kept token.
    if (part > 0.f && target >= before && (target < scan[tid] || tid == blockDim.x - 1 ||
                                           scan[tid] >= total)) {
        float acc = before;
        int pick = -1;
        for (int i = lo; i < hi; i++) {
            float v = l[i];
            if (fkey(v) >= thr && v >= floor_logit) {
                pick = i;
                acc += __expf((v - mx) * inv_t);
                if (target < acc) break;
            }
        }
        atomicMax(&found, pick);
    }
    __syncthreads();
    if (tid == 0) {
        int tok = found;
        if (tok < 0) {
            // Only reachable through rounding: take the most likely token.
            tok = 0;
            for (int i = 0; i < n; i++)
                if (l[i] == mx) { tok = i; break; }
        }
        out_tokens[s] = tok;
    }
}
