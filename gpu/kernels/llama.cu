// Switchyard's CUDA kernels for the Llama forward pass and GPU sampling, compiled by NVRTC at
// start for the device's architecture (gpu/src/cuda/device.rs). Matrix products are cuBLAS's
// for steps of more than 64 tokens and gemv.cu's (compiled after this file) for smaller ones;
// these kernels are the element-wise, attention and sampling parts around them.
//
// Layouts: activations are row-major [tokens, features]; the residual stream is f32, matrix
// inputs bf16. The paged KV cache of one layer is [slots, kv_heads, head_dim] bf16 for keys and
// the same for values, slot = block * block_size + offset.

#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;
typedef unsigned int u32;

#define NEG_INF (-__int_as_float(0x7f800000))

// Programmatic dependent launch (Hopper). The host may launch every kernel with the
// programmatic-serialization attribute (gpu/src/cuda/device.rs): the next kernel in the stream
// can then be scheduled once every block of this one has run pdl_trigger(), and must run
// pdl_wait() (which returns once the previous kernel has completed and its writes are visible)
// before it reads anything an earlier kernel wrote or writes anything an earlier kernel reads.
// Every kernel here starts with PDL_ENTER(): wait, then trigger, so only the next kernel is
// brought in early, while this one runs (its launch latency and, for the GEMV kernels, the L2
// prefetch of its weights before their wait overlap this kernel). Triggering before the wait
// would let the whole rest of the stream cascade in, every kernel's blocks resident and
// spinning in pdl_wait() while they take the slots the running kernel needs (measured in v2:
// the GEMV path went from 5.96 to 7.64 ms per Llama decode step with the trigger first). Both
// are no-ops without the attribute and below sm_90.
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
        pdl_wait();    \
        pdl_trigger(); \
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

// Rows of at most this many floats are staged in shared memory before their sum of squares
// (rms_norm, the GEMV norm prologue): 16 KB.
#ifndef NORM_STAGE_FLOATS
#define NORM_STAGE_FLOATS 4096
#endif
#define NORM_STAGE_ALLOC (NORM_STAGE_FLOATS > 0 ? NORM_STAGE_FLOATS : 4)

// Copies n floats (n % 4 == 0) from global memory to shared memory `s` with every thread of
// the block, U float4 pieces per thread asked for before the first store, so a row of up to
// 4 U blockDim.x floats arrives in one round trip; warp_sumsq then walks `s` in its own order
// (the same bits as from global memory) without four dependent trips to memory. The caller
// synchronises the block before reading `s`.
template <int U>
__device__ __forceinline__ void stage_floats(const float* __restrict__ src, float* s, int n) {
    const float4* x4 = reinterpret_cast<const float4*>(src);
    float4* s4 = reinterpret_cast<float4*>(s);
    const int n4 = n >> 2, stride = blockDim.x;
    for (int i0 = threadIdx.x; i0 < n4; i0 += U * stride) {
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + u * stride;
            if (i < n4) v[u] = __ldg(x4 + i);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + u * stride;
            if (i < n4) s4[i] = v[u];
        }
    }
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

// ---- The host KV tier (gpu/src/cuda/host_tier.rs; the default copy engine) ----
// Copies whole KV blocks between the paged cache and the tier's page-locked host memory, which
// the kernel reads or writes through its device mapping: one launch for a whole list instead
// of one DMA per layer, part and run of blocks. Block (i, part) copies pair i's block of one
// layer's keys or values (part = 2 layer + {0 keys, 1 values}): `values` bytes at
// dev + part dev_part + d values <-> host + part host_part + h values, and with an fp8 cache
// its `scales` bytes at dev_scales_at / host_scales_at within the part. `pairs` (in mapped host
// memory) holds (device block, host block) for each i.
__device__ __forceinline__ void copy_bytes(unsigned char* dst, const unsigned char* src, u64 len) {
    if ((((u64)dst | (u64)src | len) & 15) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (u64 i = threadIdx.x; i < len / 16; i += blockDim.x) d[i] = s[i];
    } else {
        for (u64 i = threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
    }
}

extern "C" __global__ void kv_tier_copy(unsigned char* dev, u64 dev_part, u64 dev_scales_at,
                                        unsigned char* host, u64 host_part, u64 host_scales_at,
                                        const u32* pairs, int to_host, u64 values, u64 scales,
                                        int n_pairs, int parts) {
    PDL_ENTER();
    // Items (pair, part), n_pairs * parts of them, over however many blocks the grid has: one
    // each with a grid of (n_pairs, parts), several each with fewer (stores beside a step).
    u64 items = (u64)n_pairs * (u64)parts;
    u64 stride = (u64)gridDim.x * gridDim.y;
    for (u64 w = blockIdx.x + (u64)blockIdx.y * gridDim.x; w < items; w += stride) {
        u64 pair = w / parts, part = w % parts;
        u64 d = pairs[2 * pair], h = pairs[2 * pair + 1];
        unsigned char* dv = dev + part * dev_part + d * values;
        unsigned char* hv = host + part * host_part + h * values;
        if (to_host) copy_bytes(hv, dv, values); else copy_bytes(dv, hv, values);
        if (scales > 0) {
            unsigned char* ds = dev + part * dev_part + dev_scales_at + d * scales;
            unsigned char* hs = host + part * host_part + host_scales_at + h * scales;
            if (to_host) copy_bytes(hs, ds, scales); else copy_bytes(ds, hs, scales);
        }
    }
}

// ---- fp8 (e4m3) quantization (`quantization: fp8`) ----
// A bf16 matrix x [rows, k] (k a multiple of 8, x 16-byte aligned) becomes q = e4m3(x / s),
// rounded to nearest even and saturated, so that x ~ s q, with s = amax / 448 (448: e4m3's
// largest finite value) and amax either each row's max |x| (fp8_quant_rows: a scale per row;
// weights per output channel, activations per token, so a token's product does not depend on
// the other tokens of the step; cuBLASLt applies both vectors: outer-vector scaling) or the
// whole tensor's (fp8_amax, then fp8_quant_tensor: one scale, for cuBLASLt builds without
// outer-vector scaling). An all-zero row or tensor gets s = FP8_MIN_SCALE and zeros.
#define FP8_E4M3_MAX 448.f
#define FP8_MIN_SCALE 1e-12f

// Two e4m3 bytes (low byte first, in the low 8 bits of each 16-bit half of `v`) as two bf16
// holding their values times 2^-120, by moving bits: e4m3's sign to bf16's, its 4 exponent and
// 3 mantissa bits to the low exponent and high mantissa bits (exponent bias 7 -> 127: the
// factor 2^-120; e4m3 subnormals become bf16 subnormals, exactly). Integer operations at full
// rate, where the conversion instructions run at a quarter; the user undoes the 2^-120.
__device__ __forceinline__ u32 e4m3x2_bf16x2(u32 v) {
    return ((v << 8) & 0x80008000u) | ((v << 4) & 0x07f007f0u);
}

// 8 e4m3 values (8 bytes, first in the low byte) as 8 bf16 values times 2^-120, in order.
__device__ __forceinline__ uint4 e4m3x8_widen(uint2 v) {
    // Bytes 0, 1 | 2, 3 of each word into the low bytes of the two 16-bit halves.
    return make_uint4(e4m3x2_bf16x2(__byte_perm(v.x, 0u, 0x5140)),
                      e4m3x2_bf16x2(__byte_perm(v.x, 0u, 0x7362)),
                      e4m3x2_bf16x2(__byte_perm(v.y, 0u, 0x5140)),
                      e4m3x2_bf16x2(__byte_perm(v.y, 0u, 0x7362)));
}

// Eight bf16 values (one 16-byte load) times inv, as eight e4m3 bytes.
__device__ __forceinline__ uint2 fp8_pack8(uint4 raw, float inv) {
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&raw);
    u32 w[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        float2 f0 = __bfloat1622float2(b[2 * j]);
        float2 f1 = __bfloat1622float2(b[2 * j + 1]);
        u32 lo = __nv_cvt_float2_to_fp8x2(make_float2(f0.x * inv, f0.y * inv), __NV_SATFINITE,
                                          __NV_E4M3);
        u32 hi = __nv_cvt_float2_to_fp8x2(make_float2(f1.x * inv, f1.y * inv), __NV_SATFINITE,
                                          __NV_E4M3);
        w[j] = lo | (hi << 16);
    }
    return make_uint2(w[0], w[1]);
}

// max |v| over eight bf16 values.
__device__ __forceinline__ float fp8_absmax8(uint4 raw) {
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&raw);
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float2 f = __bfloat1622float2(b[j]);
        m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
    return m;
}

extern "C" __global__ void fp8_quant_rows(const bf16* __restrict__ x, int k,
                                          __nv_fp8_storage_t* __restrict__ q,
                                          float* __restrict__ scales) {
    PDL_ENTER();
    __shared__ float red[32];
    const u64 r = blockIdx.x;
    const uint4* xv = reinterpret_cast<const uint4*>(x + r * k);
    uint2* qv = reinterpret_cast<uint2*>(q + r * k);
    const int nv = k / 8;
    float m = 0.f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) m = fmaxf(m, fp8_absmax8(__ldg(xv + i)));
    m = block_max(m, red);
    const float s = fmaxf(m / FP8_E4M3_MAX, FP8_MIN_SCALE);
    const float inv = 1.f / s;
    if (threadIdx.x == 0) scales[r] = s;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) qv[i] = fp8_pack8(__ldg(xv + i), inv);
}

// Block b writes max |x| over its grid-stride share of the n values (n / 8 vectors) to part[b].
extern "C" __global__ void fp8_amax(const bf16* __restrict__ x, u64 n, float* __restrict__ part) {
    PDL_ENTER();
    __shared__ float red[32];
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    float m = 0.f;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n / 8; i += stride)
        m = fmaxf(m, fp8_absmax8(__ldg(xv + i)));
    m = block_max(m, red);
    if (threadIdx.x == 0) part[blockIdx.x] = m;
}

// Every block reduces the `parts` maxima of fp8_amax to the tensor's scale, quantizes its
// grid-stride share, and block 0 writes the scale.
extern "C" __global__ void fp8_quant_tensor(const bf16* __restrict__ x, u64 n,
                                            const float* __restrict__ part, int parts,
                                            __nv_fp8_storage_t* __restrict__ q,
                                            float* __restrict__ scale) {
    PDL_ENTER();
    __shared__ float red[32];
    float m = 0.f;
    for (int i = threadIdx.x; i < parts; i += blockDim.x) m = fmaxf(m, part[i]);
    m = block_max(m, red);
    const float s = fmaxf(m / FP8_E4M3_MAX, FP8_MIN_SCALE);
    const float inv = 1.f / s;
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale = s;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint2* qv = reinterpret_cast<uint2*>(q);
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n / 8; i += stride)
        qv[i] = fp8_pack8(__ldg(xv + i), inv);
}

// x[t] = table[tokens[t]] as f32. Grid: one block per token. A negative entry -(i + 1) is the
// token the previous step sampled into row i of `prev` (still on the device when the host
// submitted this step; the host checked i against the previous step's sampled rows).
extern "C" __global__ void embed(const bf16* table, const int* tokens, const int* prev, float* x,
                                 int h) {
    PDL_ENTER();
    int t = blockIdx.x;
    int tok = tokens[t];
    if (tok < 0) tok = prev[-tok - 1];
    const bf16* row = table + (u64)tok * h;
    float* xt = x + (u64)t * h;
    if ((h & 7) == 0) {
        // 16-byte pieces (8 values), every piece of a thread asked for before the first store:
        // one round trip to memory for a row of up to 8192 values at 256 threads.
        constexpr int U = 4;
        const int step = 8 * blockDim.x;
        for (int i0 = 8 * threadIdx.x; i0 < h; i0 += U * step) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int i = i0 + u * step;
                v[u] = i < h ? *reinterpret_cast<const uint4*>(row + i) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int i = i0 + u * step;
                if (i >= h) break;
                const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
                const float2 a0 = __bfloat1622float2(b[0]), a1 = __bfloat1622float2(b[1]);
                const float2 a2 = __bfloat1622float2(b[2]), a3 = __bfloat1622float2(b[3]);
                reinterpret_cast<float4*>(xt + i)[0] = make_float4(a0.x, a0.y, a1.x, a1.y);
                reinterpret_cast<float4*>(xt + i)[1] = make_float4(a2.x, a2.y, a3.x, a3.y);
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < h; i += blockDim.x) xt[i] = __bfloat162float(row[i]);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: out[r] = w * x[src] / sqrt(mean(x[src]^2) + eps), src = rows ? rows[r] : r.
// Grid: one block per row; warp 0 sums the squares (warp_sumsq), every thread writes. Rows of
// up to NORM_STAGE_FLOATS (h % 4 == 0) are first staged in shared memory by the whole block
// (one trip to memory instead of warp 0's four dependent ones; the same sums in the same order).
extern "C" __global__ void rms_norm(const float* x, const float* w, bf16* out, const int* rows,
                                    int h, float eps) {
    PDL_ENTER();
    __shared__ float inv_s;
    __shared__ __align__(16) float row_s[NORM_STAGE_ALLOC];
    int r = blockIdx.x;
    int src = rows ? rows[r] : r;
    const float* xg = x + (u64)src * h;
    bf16* o = out + (u64)r * h;
    const bool staged = (h & 3) == 0 && h <= NORM_STAGE_FLOATS;
    if (staged) {
        stage_floats<4>(xg, row_s, h);
        __syncthreads();
    }
    const float* xr = staged ? row_s : xg;
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
// RoPE. The backend stores the Q and K rows of the fused QKV weight permuted within each head
// (gpu/src/cuda/weights.rs, `rope_row_order`): the two rows of rotation pair j (j, j + hd/2, or
// 2j, 2j + 1 for interleaved checkpoints) sit at rows 16 (j / 8) + j % 8 and that + 8, so in
// one 16-row tile of the GEMV kernels, whose epilogue then rotates them in place (gemv.cu).
// Both RoPE paths use rope_rotate, so a pair is rotated to the same bits by either.

// Row of the first element of rotation pair j in a head of the permuted QKV weight (the second
// is 8 rows further).
__device__ __forceinline__ int rope_pair_row(int j) { return 16 * (j >> 3) + (j & 7); }

// (x0, x1) rotated by the angle whose sine and cosine are s and c, times am, each operation
// rounded once. am: the pair's amplitude, the table's second half (inv_freq[hd / 2 + j]): 1
// (exact), or for a partial rotary embedding with an attention factor (LongRoPE, YaRN) the
// factor on the rotated pairs and 1 on the others, which the softmax scale then leaves out
// (`LlamaConfig::attention_scale`).
__device__ __forceinline__ void rope_apply(float x0, float x1, float s, float c, float am,
                                           float* y0, float* y1) {
    *y0 = __fmul_rn(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)), am);
    *y1 = __fmul_rn(__fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s)), am);
}

// (x0, x1) rotated by the angle pos * freq, times am.
__device__ __forceinline__ void rope_rotate(float x0, float x1, float pos, float freq, float am,
                                            float* y0, float* y1) {
    float s, c;
    sincosf(__fmul_rn(pos, freq), &s, &c);
    rope_apply(x0, x1, s, c, am, y0, y1);
}

// RoPE on the Q and K parts of `qkv` (f32 [T, (nh + 2 nkv) hd], Q and K rows in the permuted
// order above), Q written to `q` (bf16), K and V written to the cache slots (slot < 0: a padding
// token, nothing written); q and the cache hold every head in the checkpoint's order. `bias`
// (null, or f32 [(nh + 2 nkv) hd] in the rows' order: Qwen2's Q, K and V biases) is added to
// every token's row first. inv_freq: hd / 2 frequencies, then hd / 2 amplitudes (rope_apply).
// Grid: one block per token. Thread i takes rotation pair j = i % (hd / 2) of every
// (blockDim.x / (hd / 2))-th head from head i / (hd / 2) on, so it computes the pair's sine
// and cosine once (rope_rotate's, the same bits) for all heads, and a warp reads whole rows.
//
// F8 (`kv_cache_dtype: fp8`, rope_store_kv_f8): the cache holds e4m3 bytes with a scale per
// (slot, KV head), written by kv_store_f8; Q as above.

// Value `i` of a token's QKV row, with its bias when there is one.
__device__ __forceinline__ float qkv_at(const float* row, const float* bias, int i) {
    return bias ? row[i] + bias[i] : row[i];
}

// One token's keys (rotated as rope_store_kv_body rotates them) and values into an fp8 cache
// slot: each (slot, KV head) vector rounded to bf16 (what a bf16 cache would hold), then
// quantized as fp8_quant_rows quantizes a row: s = max(amax / 448, FP8_MIN_SCALE) into
// ksc / vsc [slot * nkv + head], e4m3(x / s) (nearest even, saturating) into the cache. One
// warp per vector (K heads, then V heads); lane l takes pairs (or values) l, l + 32, ... below
// hd / 2 (or hd): the attention kernels' 64, 96 or 128.
__device__ __forceinline__ void kv_store_f8(const float* row, const float* bias,
                                            __nv_fp8_storage_t* kc, __nv_fp8_storage_t* vc,
                                            float* ksc, float* vsc, long long slot, float p,
                                            const float* inv_freq, int nh, int nkv, int hd,
                                            int interleaved) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int half = hd / 2;
    for (int vec = warp; vec < 2 * nkv; vec += warps) {
        const bool key = vec < nkv;
        const int head = key ? vec : vec - nkv;
        // Up to 4 values: pairs (a, b) for keys, every 32nd value for values; the loops
        // unrolled to 4 with the bound as a predicate, so x and at stay in registers. at < 0:
        // no value (hd 96 leaves half the lanes' second pair, and a third of their values).
        float x[4] = {0.f, 0.f, 0.f, 0.f};
        int at[4] = {-1, -1, -1, -1};
        if (key) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int j = lane + 32 * i;
                if (j >= half) break;
                float sn, cs;
                sincosf(__fmul_rn(p, inv_freq[j]), &sn, &cs);
                const int r = (nh + head) * hd + rope_pair_row(j);
                float y0, y1;
                rope_apply(qkv_at(row, bias, r), qkv_at(row, bias, r + 8), sn, cs,
                           inv_freq[half + j], &y0, &y1);
                x[2 * i] = __bfloat162float(__float2bfloat16(y0));
                x[2 * i + 1] = __bfloat162float(__float2bfloat16(y1));
                at[2 * i] = interleaved ? 2 * j : j;
                at[2 * i + 1] = interleaved ? 2 * j + 1 : j + half;
            }
        } else {
            const int v = (nh + nkv + head) * hd;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (lane + 32 * i >= hd) break;
                x[i] = __bfloat162float(__float2bfloat16(qkv_at(row, bias, v + lane + 32 * i)));
                at[i] = lane + 32 * i;
            }
        }
        float m = 0.f;
        bool nan = false;
#pragma unroll
        for (int i = 0; i < 4; i++) {  // zeros past per
            m = fmaxf(m, fabsf(x[i]));
            nan |= x[i] != x[i];
        }
        m = warp_max(m);
        // A NaN makes the vector's scale NaN, so it reaches attention as it would from a bf16
        // cache (fmaxf drops NaNs, and e4m3's NaN byte would widen to a finite value).
        const float s = __any_sync(0xffffffffu, nan) ? __int_as_float(0x7fffffff)
                                                     : fmaxf(m / FP8_E4M3_MAX, FP8_MIN_SCALE);
        const float inv = 1.f / s;
        const u64 base = ((u64)slot * nkv + head);
        __nv_fp8_storage_t* o = (key ? kc : vc) + base * hd;
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (at[i] >= 0) o[at[i]] = __nv_cvt_float_to_fp8(x[i] * inv, __NV_SATFINITE, __NV_E4M3);
        if (lane == 0) (key ? ksc : vsc)[base] = s;
    }
}

template <bool F8>
__device__ __forceinline__ void rope_store_kv_body(const float* qkv, const float* bias, bf16* q,
                                                   void* kc, void* vc, float* ksc, float* vsc,
                                                   const int* pos, const long long* slots,
                                                   const float* inv_freq, int nh, int nkv,
                                                   int hd, int interleaved) {
    PDL_ENTER();
    const int t = blockIdx.x;
    const int half = hd / 2;
    const int width = (nh + 2 * nkv) * hd;
    const float* row = qkv + (u64)t * width;
    const long long slot = slots[t];
    // Heads rotated by the loop below: Q and K, or Q alone (fp8 keys: kv_store_f8).
    const int rotated = F8 ? nh : nh + nkv;
    // (With fewer threads than pairs, one group walks the pairs.)
    const bool wide = (int)blockDim.x >= half;
    const int groups = wide ? blockDim.x / half : 1;
    const int first = wide ? threadIdx.x / half : 0;
    const int jstep = wide ? half : blockDim.x;
    for (int j = wide ? threadIdx.x % half : threadIdx.x; first < groups && j < half; j += jstep) {
        float sn, cs;
        sincosf(__fmul_rn((float)pos[t], inv_freq[j]), &sn, &cs);
        const float am = inv_freq[half + j];
        const int a = interleaved ? 2 * j : j;
        const int b = interleaved ? 2 * j + 1 : j + half;
        const int pr = rope_pair_row(j);
        // Q heads then K heads.
        for (int head = first; head < rotated; head += groups) {
            const int r = head * hd + pr;
            float y0, y1;
            rope_apply(qkv_at(row, bias, r), qkv_at(row, bias, r + 8), sn, cs, am, &y0, &y1);
            bf16* o;
            if (head < nh)
                o = q + ((u64)t * nh + head) * hd;
            else if (slot >= 0)
                o = static_cast<bf16*>(kc) + ((u64)slot * nkv + (head - nh)) * hd;
            else
                break;
            o[a] = __float2bfloat16(y0);
            o[b] = __float2bfloat16(y1);
        }
    }
    if (slot < 0) return;
    if (F8) {
        kv_store_f8(row, bias, static_cast<__nv_fp8_storage_t*>(kc),
                    static_cast<__nv_fp8_storage_t*>(vc), ksc, vsc, slot, (float)pos[t],
                    inv_freq, nh, nkv, hd, interleaved);
        return;
    }
    const float* v = row + (nh + nkv) * hd;
    bf16* vo = static_cast<bf16*>(vc) + (u64)slot * nkv * hd;
    const int nv = nkv * hd;
    if (bias) {
        const float* vb = bias + (nh + nkv) * hd;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) vo[i] = __float2bfloat16(v[i] + vb[i]);
    } else if ((nv & 3) == 0) {
        for (int i = threadIdx.x; i < (nv >> 2); i += blockDim.x) {
            const float4 f = reinterpret_cast<const float4*>(v)[i];
            reinterpret_cast<__nv_bfloat162*>(vo)[2 * i] = __floats2bfloat162_rn(f.x, f.y);
            reinterpret_cast<__nv_bfloat162*>(vo)[2 * i + 1] = __floats2bfloat162_rn(f.z, f.w);
        }
    } else {
        for (int i = threadIdx.x; i < nv; i += blockDim.x) vo[i] = __float2bfloat16(v[i]);
    }
}

extern "C" __global__ void rope_store_kv(const float* qkv, const float* bias, bf16* q, bf16* kc,
                                         bf16* vc, const int* pos, const long long* slots,
                                         const float* inv_freq, int nh, int nkv, int hd,
                                         int interleaved) {
    rope_store_kv_body<false>(qkv, bias, q, kc, vc, nullptr, nullptr, pos, slots, inv_freq, nh,
                              nkv, hd, interleaved);
}

extern "C" __global__ void rope_store_kv_f8(const float* qkv, const float* bias, bf16* q,
                                            __nv_fp8_storage_t* kc, __nv_fp8_storage_t* vc,
                                            float* ksc, float* vsc, const int* pos,
                                            const long long* slots, const float* inv_freq,
                                            int nh, int nkv, int hd, int interleaved) {
    rope_store_kv_body<true>(qkv, bias, q, kc, vc, ksc, vsc, pos, slots, inv_freq, nh, nkv, hd,
                             interleaved);
}

// Qwen3's query and key norms, in place on the f32 QKV product before rope_store_kv: each of a
// token's nh Q and nkv K heads scaled by rms_inv over its hd values and by its weight (w: the
// query weights, then the key weights, hd each, in the rows' stored order), as rms_norm scales
// a row. Grid: one block per token; one warp per head.
extern "C" __global__ void qk_norm(float* qkv, const float* w, int nh, int nkv, int hd,
                                   float eps) {
    PDL_ENTER();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* row = qkv + (u64)blockIdx.x * (nh + 2 * nkv) * hd;
    for (int head = warp; head < nh + nkv; head += warps) {
        float* x = row + head * hd;
        const float* g = w + (head < nh ? 0 : hd);
        const float inv = rms_inv(warp_sumsq(x, hd, lane), hd, eps);
        for (int i = lane; i < hd; i += 32) x[i] = rms_scale(x[i], g[i], inv);
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: gu is [T, 2 inter] (gate | up); out[t, i] = silu(gate) * up. When inter is a
// multiple of 8, each thread takes 8 consecutive outputs (16-byte loads and store) of token
// blockIdx.y (+ gridDim.y, ...): grid (ceil(inter / 8 / blockDim.x), min(T, 65535)), no index
// division. Otherwise a grid-stride loop over the T x inter outputs. Every output is
// silu_times of its own two inputs either way.
extern "C" __global__ void silu_mul(const bf16* gu, bf16* out, int inter, u64 total) {
    PDL_ENTER();
    if ((inter & 7) == 0) {
        const u64 tokens = total / (u64)inter;
        const int j = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
        if (j >= inter) return;
        for (u64 t = blockIdx.y; t < tokens; t += gridDim.y) {
            const uint4 g8 = *reinterpret_cast<const uint4*>(gu + t * 2 * inter + j);
            const uint4 u8 = *reinterpret_cast<const uint4*>(gu + t * 2 * inter + inter + j);
            const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g8);
            const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u8);
            uint4 r;
            __nv_bfloat162* r2 = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
            for (int e = 0; e < 4; e++)
                r2[e] = __floats2bfloat162_rn(
                    silu_times(__low2float(g2[e]), __low2float(u2[e])),
                    silu_times(__high2float(g2[e]), __high2float(u2[e])));
            *reinterpret_cast<uint4*>(out + t * inter + j) = r;
        }
        return;
    }
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        u64 t = i / inter, j = i % inter;
        float g = __bfloat162float(gu[t * 2 * inter + j]);
        float u = __bfloat162float(gu[t * 2 * inter + inter + j]);
        out[i] = __float2bfloat16(silu_times(g, u));
    }
}

// ---------------------------------------------------------------------------------------------
// LoRA adapters. A step's adapters are slots 0..K; `row_slot[row]` is a token's slot or -1;
// `ptrs` holds, per slot, layer and target (q, k, v, o, gate, up, down), the device addresses of
// A (rank x in, bf16) and of B (out x rank, bf16, scaled, rows in the base weight's stored
// order), 0 for targets the adapter leaves alone; `ranks[slot]` is the slot's rank. An adapted
// product is `u = A x` (lora_shrink, before the product) and then `B u` added to its f32 output:
// in the GEMV kernels' epilogue (small steps: before RoPE or SiLU, so those stay fused), or by
// lora_expand and lora_silu_mul after a cuBLAS product.

__device__ __forceinline__ const bf16* lora_matrix(const u64* ptrs, int slot, int layers, int layer,
                                                   int target, int which) {
    return reinterpret_cast<const bf16*>(
        ptrs[(((u64)slot * layers + layer) * 7 + target) * 2 + which]);
}

// Where one product's updates come from: up to three targets side by side in its output
// (targets t0, t1, t2, -1: none, of w0, w1, w2 columns from column 0), target i reading the
// part i * u_part of a row's `u` (u_stride floats per row). row_slot null: no updates.
// (Scalars rather than arrays: indexed at run time, arrays would sit on the stack.)
struct LoraUpdate {
    const float* u;
    int u_stride, u_part;
    const int* row_slot;
    const u64* ptrs;
    const int* ranks;
    int layers, layer;
    int t0, w0, t1, w1, t2, w2;
};

// Output column `col` of an update: its part i (-1: beyond the parts) and column o in it.
__device__ __forceinline__ int lora_part(const LoraUpdate& L, int col, int& o) {
    o = col;
    if (o < L.w0) return 0;
    if ((o -= L.w0) < L.w1) return 1;
    if ((o -= L.w1) < L.w2) return 2;
    return -1;
}

// B of part i for token `row` (null: no update), and its rank in r.
__device__ __forceinline__ const bf16* lora_b(const LoraUpdate& L, int row, int i, int& r) {
    const int target = i == 0 ? L.t0 : (i == 1 ? L.t1 : L.t2);
    if (i < 0 || target < 0) return nullptr;
    const int s = L.row_slot[row];
    if (s < 0) return nullptr;
    r = L.ranks[s];
    return lora_matrix(L.ptrs, s, L.layers, L.layer, target, 1);
}

// Adds to v the update of column o of part i of token `row` with that part's B (rank r; none
// when null): B[o, :] . u[row, part i], the rank's terms in order.
__device__ __forceinline__ void lora_dot(const LoraUpdate& L, const bf16* B, int r, int row, int i,
                                         int o, float& v) {
    if (B == nullptr) return;
    const float* ur = L.u + (u64)row * L.u_stride + i * L.u_part;
    const bf16* b = B + (u64)o * r;
    float acc = 0.f;
    for (int j = 0; j < r; j++) acc = fmaf(__bfloat162float(b[j]), ur[j], acc);
    v += acc;
}

// Adds to v the update of output column `col` of token `row`, when the token has an adapter
// that adapts the column's target.
__device__ __forceinline__ void lora_add(const LoraUpdate& L, int row, int col, float& v) {
    int o, r = 0;
    const int i = lora_part(L, col, o);
    lora_dot(L, lora_b(L, row, i, r), r, row, i, o, v);
}

// A shrink's input row: bf16 values, or (the norm variant) the f32 residual row RMS-normalised
// with weight w, each value bf16(rms_scale(x, w, inv)) as rms_norm stores it.
struct LoraRowBf16 {
    const bf16* x;
    __device__ bool aligned() const { return ((u64)x & 15) == 0; }
    __device__ void piece(int k8, float (&f)[8]) const {
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x) + k8);
        const u32 xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xw[h]));
            f[2 * h] = p.x;
            f[2 * h + 1] = p.y;
        }
    }
    __device__ float at(int k) const { return __bfloat162float(x[k]); }
};
struct LoraRowNorm {
    const float* x;
    const float* w;
    float inv;
    __device__ bool aligned() const { return (((u64)x | (u64)w) & 15) == 0; }
    __device__ float one(float xv, float wv) const {
        return __bfloat162float(__float2bfloat16(rms_scale(xv, wv, inv)));
    }
    __device__ void piece(int k8, float (&f)[8]) const {
        const float4* x4 = reinterpret_cast<const float4*>(x + 8 * k8);
        const float4* w4 = reinterpret_cast<const float4*>(w + 8 * k8);
        const float4 x0 = __ldg(x4), x1 = __ldg(x4 + 1), w0 = __ldg(w4), w1 = __ldg(w4 + 1);
        f[0] = one(x0.x, w0.x), f[1] = one(x0.y, w0.y), f[2] = one(x0.z, w0.z);
        f[3] = one(x0.w, w0.w), f[4] = one(x1.x, w1.x), f[5] = one(x1.y, w1.y);
        f[6] = one(x1.z, w1.z), f[7] = one(x1.w, w1.w);
    }
    __device__ float at(int k) const { return one(x[k], w[k]); }
};

// The dot product of n bf16 values at a with the row x, summed over the warp (every lane gets
// it): 16-byte pieces when n is a multiple of 8 and both start on 16 bytes, each lane's loads
// issued together; else one value per lane at a time. The same sums in the same order for either
// kind of row holding the same values.
template <class Row>
__device__ __forceinline__ float warp_dot_bf16(const bf16* __restrict__ a, const Row& x, int n,
                                               int lane) {
    float acc = 0.f;
    if ((n & 7) == 0 && ((u64)a & 15) == 0 && x.aligned()) {
        const uint4* a4 = reinterpret_cast<const uint4*>(a);
#pragma unroll 4
        for (int k = lane; k < n / 8; k += 32) {
            const uint4 av = __ldg(a4 + k);
            float xf[8];
            x.piece(k, xf);
            const u32 aw[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
            for (int h = 0; h < 4; h++) {
                const float2 af = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&aw[h]));
                acc = fmaf(af.x, xf[2 * h], acc);
                acc = fmaf(af.y, xf[2 * h + 1], acc);
            }
        }
    } else {
        for (int k = lane; k < n; k += 32) acc = fmaf(__bfloat162float(a[k]), x.at(k), acc);
    }
    return warp_sum(acc);
}

// A of (row, target i of t0, t1, t2, rank index j) for a shrink (null: nothing to compute).
__device__ __forceinline__ const bf16* lora_shrink_a(const int* row_slot, const u64* ptrs,
                                                     const int* ranks, int layers, int layer,
                                                     int target, int row, int j) {
    const int s = row_slot[row];
    if (s < 0 || target < 0 || j >= ranks[s]) return nullptr;
    return lora_matrix(ptrs, s, layers, layer, target, 0);
}

// u[row, i * u_part + j] = A_i[j, :] . x[row, :] for the rows with an adapter, target i of t0,
// t1, t2 (-1: none); a warp per (row, target i, rank index j < u_part), so that a small step's
// few products all run at once (grid: rows x 3 x u_part warps). With xf (the norm variant, for
// the GEMV kernels' norm prologue) x is not read: row `row` is the f32 residual xf[row]
// normalised with nw as rms_norm would (warp_sumsq and rms_inv over din values), so u is what
// it would be from rms_norm's output. A warp looks up its first item's A before the wait on the
// previous kernel (the tables are step inputs), so only x and A's row are read after it.
extern "C" __global__ void lora_shrink(const bf16* x, int x_stride, int din, const float* xf,
                                       const float* nw, float eps, const int* row_slot,
                                       const u64* ptrs, const int* ranks, int layers, int layer,
                                       int t0, int t1, int t2, float* u, int u_stride, int u_part,
                                       int rows) {
    const int lane = threadIdx.x & 31, nw_ = blockDim.x >> 5;
    const long long per_row = 3LL * u_part, total = (long long)rows * per_row;
    auto a_of = [&](long long w, int& row, int& i, int& j) {
        row = (int)(w / per_row);
        const int rem = (int)(w % per_row);
        i = rem / u_part, j = rem % u_part;
        const int target = i == 0 ? t0 : (i == 1 ? t1 : t2);
        return lora_shrink_a(row_slot, ptrs, ranks, layers, layer, target, row, j);
    };
    const long long w0 = (long long)blockIdx.x * nw_ + (threadIdx.x >> 5);
    int row0 = 0, i0 = 0, j0 = 0;
    const bf16* A0 = w0 < total ? a_of(w0, row0, i0, j0) : nullptr;
    PDL_ENTER();
    for (long long w = w0; w < total; w += (long long)gridDim.x * nw_) {
        int row = row0, i = i0, j = j0;
        const bf16* A = w == w0 ? A0 : a_of(w, row, i, j);
        if (A == nullptr) continue;
        float acc;
        if (xf != nullptr) {
            const float* xr = xf + (u64)row * din;
            const LoraRowNorm r{xr, nw, rms_inv(warp_sumsq(xr, din, lane), din, eps)};
            acc = warp_dot_bf16(A + (u64)j * din, r, din, lane);
        } else {
            acc = warp_dot_bf16(A + (u64)j * din, LoraRowBf16{x + (u64)row * x_stride}, din, lane);
        }
        if (lane == 0) u[(u64)row * u_stride + i * u_part + j] = acc;
    }
}

// out[row, col] += the update of column col (lora_add) for the rows with an adapter, the parts
// of widths w0, w1, w2 side by side from column 0 (targets t0, t1, t2; -1: none), f32 out.
extern "C" __global__ void lora_expand(const float* u, int u_stride, int u_part,
                                       const int* row_slot, const u64* ptrs, const int* ranks,
                                       int layers, int layer, int t0, int w0, int t1, int w1,
                                       int t2, int w2, float* out, int out_stride, int rows) {
    PDL_ENTER();
    const LoraUpdate L{u, u_stride, u_part, row_slot, ptrs, ranks, layers, layer, t0, w0, t1,
                       w1, t2, w2};
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= w0 + w1 + w2) return;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        if (row_slot[row] < 0) continue;
        float* o = out + (u64)row * out_stride + col;
        float v = *o;
        lora_add(L, row, col, v);
        *o = v;
    }
}

// silu_mul for LoRA steps on cuBLAS: act = silu(g + dg) * (up + dup), the gate's and up's
// updates (their u in parts 0 and 1 of a row's, up_off floats apart) added in f32 to the bf16
// product, so a value is rounded once, as in silu_mul (and the GEMV kernels' GLU epilogue).
extern "C" __global__ void lora_silu_mul(const bf16* gu, bf16* act, int inter, const float* u,
                                         int u_stride, int up_off, const int* row_slot,
                                         const u64* ptrs, const int* ranks, int layers, int layer,
                                         int rows) {
    PDL_ENTER();
    const LoraUpdate L{u, u_stride, up_off, row_slot, ptrs, ranks, layers, layer, 4, inter, 5,
                       inter, -1, 0};
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= inter) return;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        float g = __bfloat162float(gu[(u64)row * 2 * inter + j]);
        float up = __bfloat162float(gu[(u64)row * 2 * inter + inter + j]);
        lora_add(L, row, j, g);
        lora_add(L, row, inter + j, up);
        act[(u64)row * inter + j] = __float2bfloat16(silu_times(g, up));
    }
}

// ---------------------------------------------------------------------------------------------
// Paged attention on the tensor cores (flash-attention 2 style), for prefill chunks and decodes
// in one launch.
//
// Work is cut into tiles: a tile is up to MMA_ROWS / group consecutive query tokens of one
// sequence (their positions increase by one), and a block handles one tile, one KV head (all
// query heads of its group: rows = tokens x group, row r = token r / group, head r % group)
// and one split of the key range; its warps own 16 rows each. Tiles of at most 16 rows
// (decodes, small chunks) run in one-warp blocks (`attention_w1_*`), the others in four-warp
// blocks (`attention_w4_*`): memory-bound decodes get many small resident blocks, and every
// row is computed by the same instructions either way, so a row's bits never depend on which
// kernel ran it. `tile_base`: the kernel's first tile in the step's list. Row r's query at position p
// attends keys 0..=p, so cached prefix blocks (prefix-cache hits, earlier chunks) are read
// through the block table like any other. Keys and values come through shared memory
// MMA_KEYS at a time (cp.async, the values landing while the scores are computed). Before
// the kernel waits on the QKV product (pdl_wait), it reads only the host's step buffer and,
// in decode steps (early_kv), asks for its first chunk of keys and values, those of earlier
// positions, which this step does not write. S = Q K^T and O += P V run as mma.m16n8k16
// (bf16 in, f32 accumulate), Q's fragments read from global memory, K's and V's by ldmatrix,
// the online softmax in registers (exp2, the scale folded in). P enters the second
// product rounded to bf16, as FlashAttention does (the row sums stay f32). ATT_P_SPLIT=1
// (through SWITCHYARD_CUDA_DEFINES) feeds it as two bf16 terms (hi + lo), about 16 bits of
// the f32 p, at twice the P V products: the default until CUDA_NOTES v10, which measured the
// single term faster at large batches (SmolLM2 batch 256 -7%, Llama -2%, offline +1%) and
// closer to transformers and the CPU backend on SmolLM2 (top-1 100% against 99.65%).
//
// Split-K: with gridDim.z > 1, each block takes keys [split * len, (split + 1) * len) and writes
// its unnormalised result and (max, sum) in log2 units; `attention_combine` merges them. A
// row's result depends only on its own inputs and the split length (a multiple of MMA_KEYS),
// never on the other rows of its tile or step. meta[0] = block-table stride, meta[1] = split
// length, meta[2] = splits in use (at most gridDim.z).

#define MMA_ROWS 64
// Keys per shared-memory chunk of the main kernels (overridable for experiments:
// SWITCHYARD_CUDA_DEFINES). Split lengths (ATT_KEYS = 64 in gpu/src/cuda/step.rs) must be
// multiples of it, and the score tiles come 16 keys at a time.
#ifndef MMA_KEYS
#define MMA_KEYS 64
#endif
#ifndef ATT_P_SPLIT
#define ATT_P_SPLIT 0
#endif
#ifndef ATT_L2_PREFETCH
#define ATT_L2_PREFETCH 0
#endif
static_assert(ATT_P_SPLIT == 0 || ATT_P_SPLIT == 1, "ATT_P_SPLIT must be 0 or 1");
static_assert(MMA_KEYS >= 16 && MMA_KEYS % 16 == 0 && 64 % MMA_KEYS == 0,
              "MMA_KEYS must be 16, 32 or 64");
// Keys per chunk of the one-warp kernels over an fp8 cache (overridable for experiments; a
// warp copies 32 keys per lookup register, so a multiple of 32). A chunk may run past its
// split's end: the keys past kend are masked like keys past a query's position. 64 measured
// best (CUDA_NOTES v18: 32 and 128 keys lose at SmolLM2 batch 256 and offline).
#ifndef ATT_F8_KEYS
#define ATT_F8_KEYS 64
#endif
static_assert(ATT_F8_KEYS == 32 || ATT_F8_KEYS == 64 || ATT_F8_KEYS == 96 || ATT_F8_KEYS == 128,
              "ATT_F8_KEYS must be 32, 64, 96 or 128");

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldsm_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// 16 bytes global -> shared, zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

// 4 bytes global -> shared (through L1), zero-filled when !valid.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The cache slots of the keys [kb, kb + KEYS) warp `warp` copies: warp w copies keys
// w * KPW .. (w + 1) * KPW - 1 of the chunk (KPW = KEYS / WARPS), and lane l looks up key
// l + 32 r of that share in s[r] (-1 past kend). One or two block-table lookups per lane and
// chunk, shared by the key and the value copies. The lookups are split in two so that a
// kernel can ask for the table entries (`chunk_entries`, every index clamped to the table's
// `stride` entries) before it knows kend (`entries_to_slots`).
template <int WARPS, int KEYS>
__device__ __forceinline__ void chunk_entries(int* e, const int* __restrict__ table, int kb,
                                              int block_size, int stride, int warp) {
    constexpr int KPW = KEYS / WARPS;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < (KPW + 31) / 32; r++)
        e[r] = table[min((kb + warp * KPW + lane + 32 * r) / block_size, stride - 1)];
}

template <int WARPS, int KEYS>
__device__ __forceinline__ void entries_to_slots(long long* s, const int* e, int kb, int kend,
                                                 int block_size, int warp) {
    constexpr int KPW = KEYS / WARPS;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < (KPW + 31) / 32; r++) {
        const int lk = lane + 32 * r, kp = kb + warp * KPW + lk;
        s[r] = lk < KPW && kp < kend ? (long long)e[r] * block_size + kp % block_size : -1;
    }
}

template <int WARPS, int KEYS>
__device__ __forceinline__ void chunk_slots(long long* s, const int* __restrict__ table, int kb,
                                            int kend, int block_size, int stride, int warp) {
    int e[(KEYS / WARPS + 31) / 32];
    chunk_entries<WARPS, KEYS>(e, table, kb, block_size, stride, warp);
    entries_to_slots<WARPS, KEYS>(s, e, kb, kend, block_size, warp);
}

// This warp's share of the keys (or values) of the chunk starting at key kb, from KV head kvh of
// one layer's paged cache into shared rows of LD elements: each instruction copies
// 32 / (HD / 8) whole keys of 16-byte pieces; keys without a slot are zero-filled. Only the keys
// in [lo, hi) are issued with FILTER (the caller splits a decode step's first chunk into the
// part cached by earlier steps and the rest; the test costs every chunk's copies otherwise:
// CUDA_NOTES v7); the caller commits the cp.async group.
template <int HD, int LD, int WARPS, int KEYS, bool FILTER>
__device__ __forceinline__ void load_kv_chunk(bf16* dst, const bf16* __restrict__ cache,
                                              const long long* s, int nkv, int kvh, int kb,
                                              int lo, int hi, int warp) {
    constexpr int PIECES = HD / 8, KPI = 32 / PIECES, KPW = KEYS / WARPS;
    constexpr int PER = KPW < 32 ? KPW : 32;  // keys per lookup register
    const int lane = threadIdx.x & 31;
    const int c = lane % PIECES;
    // Lanes past KPI whole keys (HD 96: 8 of 32) copy nothing (RAGGED: a test folded away for
    // HD 64 and 128).
    constexpr bool RAGGED = KPI * PIECES < 32;
    const bool copies = lane < KPI * PIECES;
#pragma unroll
    for (int r = 0; r < (KPW + 31) / 32; r++) {
#pragma unroll 4
        for (int u = 0; u < (PER + KPI - 1) / KPI; u++) {
            const int lk = u * KPI + lane / PIECES;  // the key within this register's 32
            const long long slot = __shfl_sync(0xffffffffu, s[r], RAGGED ? lk & 31 : lk);
            const int key = warp * KPW + 32 * r + lk, kp = kb + key;
            if ((RAGGED && (!copies || lk >= PER)) || (FILTER && (kp < lo || kp >= hi))) continue;
            const bool ok = slot >= 0;
            cp_async16(dst + key * LD + c * 8, cache + (ok ? (slot * nkv + kvh) * HD + c * 8 : 0),
                       ok);
        }
    }
}

// The same from an fp8 cache (`kv_cache_dtype: fp8`: e4m3 [slots, kv_heads, HD] bytes and a
// float scale per (slot, KV head)) into shared rows of LD8 = HD + 16 bytes (ldmatrix rows hit
// distinct banks), and each key's scale into sdst[key].
template <int HD, int WARPS, int KEYS, bool FILTER>
__device__ __forceinline__ void load_kv_chunk_f8(unsigned char* dst, float* sdst,
                                                 const __nv_fp8_storage_t* __restrict__ cache,
                                                 const float* __restrict__ scales,
                                                 const long long* s, int nkv, int kvh, int kb,
                                                 int lo, int hi, int warp) {
    constexpr int PIECES = HD / 16, KPI = 32 / PIECES, KPW = KEYS / WARPS;
    constexpr int PER = KPW < 32 ? KPW : 32;  // keys per lookup register
    constexpr int LD8 = HD + 16;
    const int lane = threadIdx.x & 31;
    const int c = lane % PIECES;
    // Lanes past KPI whole keys (HD 96: 2 of 32) copy nothing.
    constexpr bool RAGGED = KPI * PIECES < 32;
    const bool copies = lane < KPI * PIECES;
#pragma unroll
    for (int r = 0; r < (KPW + 31) / 32; r++) {
#pragma unroll 4
        for (int u = 0; u < (PER + KPI - 1) / KPI; u++) {
            const int lk = u * KPI + lane / PIECES;  // the key within this register's 32
            const long long slot = __shfl_sync(0xffffffffu, s[r], lk & 31);
            const int key = warp * KPW + 32 * r + lk, kp = kb + key;
            if ((RAGGED && !copies) || lk >= PER || (FILTER && (kp < lo || kp >= hi))) continue;
            const bool ok = slot >= 0;
            const long long vec = ok ? slot * nkv + kvh : 0;
            cp_async16(dst + key * LD8 + c * 16, cache + vec * HD + c * 16, ok);
            if (c == 0) cp_async4(sdst + key, scales + vec, ok);
        }
    }
}

// One chunk's keys or values from the cache, bf16 or (F8) fp8 with scales.
template <int HD, int LD, int WARPS, int KEYS, bool FILTER, bool F8>
__device__ __forceinline__ void load_kv(void* dst, float* sdst, const void* cache,
                                        const float* scales, const long long* s, int nkv, int kvh,
                                        int kb, int lo, int hi, int warp) {
    if (F8)
        load_kv_chunk_f8<HD, WARPS, KEYS, FILTER>(
            static_cast<unsigned char*>(dst), sdst,
            static_cast<const __nv_fp8_storage_t*>(cache), scales, s, nkv, kvh, kb, lo, hi, warp);
    else
        load_kv_chunk<HD, LD, WARPS, KEYS, FILTER>(static_cast<bf16*>(dst),
                                                   static_cast<const bf16*>(cache), s, nkv, kvh,
                                                   kb, lo, hi, warp);
}

// The A fragments of Q for rows r_lo and r_lo + 8 of the tile (zeros past `rows`), straight
// from global memory: lane (g, t4) holds, per k-step kk, (row g, columns 16 kk + 2 t4, +1),
// (row g + 8, same), (row g, + 8), (row g + 8, + 8), as ldmatrix would give them; with F8
// (an fp8 cache, att_scores_f8's pairing) columns 16 kk + 4 t4, +1 and 16 kk + 4 t4 + 2, +3
// instead (one 8-byte load).
template <int HD, bool F8>
__device__ __forceinline__ void load_q_frags(u32 (&qf)[HD / 16][4], const bf16* __restrict__ q,
                                             int q0, int group, int nh, int kvh, int rows,
                                             int r_lo) {
    const int t4 = (threadIdx.x & 31) & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = r_lo + 8 * half;
        const bool ok = r < rows;
        const bf16* qr =
            q + ((long long)(q0 + (ok ? r : 0) / group) * nh + kvh * group + (ok ? r : 0) % group) *
                    HD +
            (F8 ? 4 : 2) * t4;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            if (F8) {
                const uint2 v =
                    ok ? *reinterpret_cast<const uint2*>(qr + 16 * kk) : make_uint2(0u, 0u);
                qf[kk][half] = v.x;
                qf[kk][2 + half] = v.y;
            } else {
                qf[kk][half] = ok ? *reinterpret_cast<const u32*>(qr + 16 * kk) : 0u;
                qf[kk][2 + half] = ok ? *reinterpret_cast<const u32*>(qr + 16 * kk + 8) : 0u;
            }
        }
    }
}

// The steps of one chunk, shared by the attention kernels so that a row's bits never depend on
// which kernel ran it (explicitly rounded operations: no contraction that could differ between
// instantiations). Fragments: s[n] holds (row g, keys 8n + 2t4 + {0, 1}), then row g + 8, as
// the m16n8 accumulator layout gives them; o[n] the same for output columns.

// S = Q K^T for the chunk's KEYS keys in k_s (shared rows of HD + 8 elements).
template <int HD, int KEYS>
__device__ __forceinline__ void att_scores(float (&s)[KEYS / 8][4], const u32 (&qf)[HD / 16][4],
                                           const bf16* k_s, int lane) {
    constexpr int LD = HD + 8, KT = HD / 16, NS = KEYS / 8;
#pragma unroll
    for (int n = 0; n < NS; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    const int kr = (lane & 7) + 8 * (lane >> 4), kcol = 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < KT; kk++) {
#pragma unroll
        for (int jj = 0; jj < KEYS / 16; jj++) {
            u32 b[4];
            ldsm_x4(b, k_s + (jj * 16 + kr) * LD + kk * 16 + kcol);
            mma_bf16(s[2 * jj], qf[kk], b[0], b[1]);
            mma_bf16(s[2 * jj + 1], qf[kk], b[2], b[3]);
        }
    }
}

// fp8 cache: the maths reads e4m3 rows of LD8 = HD + 16 bytes straight from shared memory,
// ldmatrix treating two e4m3 values as one 16-bit element, each register widened to bf16 pairs
// times 2^-120 (e4m3x2_bf16x2) just before its mma. In S = Q K^T a lane's register holds dims
// 4 t4 .. 4 t4 + 3 of its key within a 16-dim step: the first two stand in the mma for k = 2 t4,
// 2 t4 + 1, the last two for k = 2 t4 + 8, 2 t4 + 9, so Q's fragments are read in the same
// order (load_q_frags; a dot product does not care in which order its terms come). In
// O += P V the values come transposed (ldmatrix .trans): a register holds dims 2g, 2g + 1 of
// keys 2 t4, 2 t4 + 1, split into an even-dim and an odd-dim n-tile, so o[2 G] holds the even
// dims of dims 16 G .. 16 G + 15 and o[2 G + 1] the odd ones (att_store writes them there).
// P enters as one bf16 term (ATT_P_SPLIT does not apply).

// Two e4m3 pairs of a 32-bit register: bytes 0, 1 and bytes 2, 3 as bf16 pairs (x 2^-120).
__device__ __forceinline__ void widen4_e4m3(u32 r, u32& lo, u32& hi) {
    lo = e4m3x2_bf16x2(__byte_perm(r, 0u, 0x5140));
    hi = e4m3x2_bf16x2(__byte_perm(r, 0u, 0x7362));
}

template <int HD, int KEYS>
__device__ __forceinline__ void att_scores_f8(float (&s)[KEYS / 8][4],
                                              const u32 (&qf)[HD / 16][4],
                                              const unsigned char* k8, int lane) {
    constexpr int LD8 = HD + 16, KT = HD / 16, NS = KEYS / 8;
#pragma unroll
    for (int n = 0; n < NS; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    // Matrices: keys 0-7 and 8-15 of the 16, at steps kk and kk + 1.
    const int row = (lane & 7) + 8 * ((lane >> 3) & 1), col = 16 * (lane >> 4);
#pragma unroll
    for (int kk = 0; kk < KT; kk += 2) {
#pragma unroll
        for (int jj = 0; jj < KEYS / 16; jj++) {
            u32 r[4], b0, b1;
            ldsm_x4(r, k8 + (jj * 16 + row) * LD8 + kk * 16 + col);
            widen4_e4m3(r[0], b0, b1);
            mma_bf16(s[2 * jj], qf[kk], b0, b1);
            widen4_e4m3(r[1], b0, b1);
            mma_bf16(s[2 * jj + 1], qf[kk], b0, b1);
            widen4_e4m3(r[2], b0, b1);
            mma_bf16(s[2 * jj], qf[kk + 1], b0, b1);
            widen4_e4m3(r[3], b0, b1);
            mma_bf16(s[2 * jj + 1], qf[kk + 1], b0, b1);
        }
    }
}

template <int HD, int KEYS>
__device__ __forceinline__ void att_pv_f8(float (&o)[HD / 8][4], const u32 (&pa)[KEYS / 16][4],
                                          const unsigned char* v8, int lane) {
    constexpr int LD8 = HD + 16;
    // Matrices: keys 0-7 and 8-15 of the step, at dims 16 G .. and 16 (G + 1) ...
    const int row = (lane & 7) + 8 * ((lane >> 3) & 1), col = 16 * (lane >> 4);
#pragma unroll
    for (int j = 0; j < KEYS / 16; j++) {
#pragma unroll
        for (int G = 0; G < HD / 16; G += 2) {
            u32 r[4];
            ldsm_x4_t(r, v8 + (j * 16 + row) * LD8 + G * 16 + col);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u32 lo = r[2 * h], hi = r[2 * h + 1];  // keys 2t4.. and 2t4 + 8..
                mma_bf16(o[2 * (G + h)], pa[j], e4m3x2_bf16x2(__byte_perm(lo, 0u, 0x4240)),
                         e4m3x2_bf16x2(__byte_perm(hi, 0u, 0x4240)));
                mma_bf16(o[2 * (G + h) + 1], pa[j], e4m3x2_bf16x2(__byte_perm(lo, 0u, 0x4341)),
                         e4m3x2_bf16x2(__byte_perm(hi, 0u, 0x4341)));
            }
        }
    }
}

// The causal mask (rows at positions p_lo, p_hi; -1 past the tile's rows) and the online
// softmax of the chunk starting at key kb: s becomes exp2 of the scaled scores less the new
// running maxima (m_lo, m_hi, updated), c_* the factors for the earlier sums and outputs, sum_*
// this lane's share of the chunk's row sums.
template <int KEYS, bool WINDOW>
__device__ __forceinline__ void att_softmax(float (&s)[KEYS / 8][4], int kb, int p_lo, int p_hi,
                                            int w_lo, int w_hi, float sl2, int t4,
                                            float& m_lo, float& m_hi,
                                            float& c_lo, float& c_hi, float& sum_lo,
                                            float& sum_hi) {
    constexpr int NS = KEYS / 8;
    float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
    for (int n = 0; n < NS; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int kp = kb + 8 * n + 2 * t4 + e;
            // WINDOW (a chunk holding keys before some row's sliding window): p - w < kp <= p
            // in one unsigned comparison (w: the row's window; p = -1 for rows past the tile's
            // masks every key); otherwise kp <= p.
            const bool in_lo = WINDOW ? (unsigned)(p_lo - kp) < (unsigned)w_lo : kp <= p_lo;
            const bool in_hi = WINDOW ? (unsigned)(p_hi - kp) < (unsigned)w_hi : kp <= p_hi;
            s[n][e] = in_lo ? __fmul_rn(s[n][e], sl2) : NEG_INF;
            s[n][2 + e] = in_hi ? __fmul_rn(s[n][2 + e], sl2) : NEG_INF;
            mx_lo = fmaxf(mx_lo, s[n][e]);
            mx_hi = fmaxf(mx_hi, s[n][2 + e]);
        }
    }
    const float mn_lo = fmaxf(m_lo, quad_max(mx_lo));
    const float mn_hi = fmaxf(m_hi, quad_max(mx_hi));
    const float b_lo = mn_lo == NEG_INF ? 0.f : mn_lo;
    const float b_hi = mn_hi == NEG_INF ? 0.f : mn_hi;
    c_lo = exp2f(__fsub_rn(m_lo, b_lo));
    c_hi = exp2f(__fsub_rn(m_hi, b_hi));
    m_lo = mn_lo;
    m_hi = mn_hi;
    sum_lo = 0.f;
    sum_hi = 0.f;
#pragma unroll
    for (int n = 0; n < NS; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            s[n][e] = exp2f(__fsub_rn(s[n][e], b_lo));
            s[n][2 + e] = exp2f(__fsub_rn(s[n][2 + e], b_hi));
            sum_lo = __fadd_rn(sum_lo, s[n][e]);
            sum_hi = __fadd_rn(sum_hi, s[n][2 + e]);
        }
    }
}

template <int HD>
__device__ __forceinline__ void att_rescale(float (&o)[HD / 8][4], float c_lo, float c_hi) {
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        o[n][0] = __fmul_rn(o[n][0], c_lo);
        o[n][1] = __fmul_rn(o[n][1], c_lo);
        o[n][2] = __fmul_rn(o[n][2], c_hi);
        o[n][3] = __fmul_rn(o[n][3], c_hi);
    }
}

// fp8 cache: scores or probabilities times their key's factor sc[key] * mul (sc: the chunk's
// key or value scales in shared memory), rows g and g + 8 alike.
template <int KEYS>
__device__ __forceinline__ void att_scale_keys(float (&s)[KEYS / 8][4], const float* sc,
                                               float mul, int t4) {
#pragma unroll
    for (int n = 0; n < KEYS / 8; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float f = __fmul_rn(sc[8 * n + 2 * t4 + e], mul);
            s[n][e] = __fmul_rn(s[n][e], f);
            s[n][2 + e] = __fmul_rn(s[n][2 + e], f);
        }
    }
}

// P as A fragments: key step j = score tiles 2j (keys 2t4..) and 2j + 1 (+8); the bf16 value
// in pa (with ATT_P_SPLIT, the rest in pl).
template <int KEYS>
__device__ __forceinline__ void att_pack_p(u32 (&pa)[KEYS / 16][4], u32 (&pl)[KEYS / 16][4],
                                           const float (&s)[KEYS / 8][4]) {
#pragma unroll
    for (int j = 0; j < KEYS / 16; j++) {
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const float* sv = s[2 * j + (h >> 1)] + 2 * (h & 1);
            pa[j][h] = pack_bf16(sv[0], sv[1]);
            const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&pa[j][h]);
            if (ATT_P_SPLIT)
                pl[j][h] = pack_bf16(__fsub_rn(sv[0], __low2float(hi)),
                                     __fsub_rn(sv[1], __high2float(hi)));
        }
    }
}

// O += P V for the chunk's values in v_s.
template <int HD, int KEYS>
__device__ __forceinline__ void att_pv(float (&o)[HD / 8][4], const u32 (&pa)[KEYS / 16][4],
                                       const u32 (&pl)[KEYS / 16][4], const bf16* v_s, int lane) {
    constexpr int LD = HD + 8;
    const int vr = (lane & 7) + 8 * ((lane >> 3) & 1), vcol = 8 * (lane >> 4);
#pragma unroll
    for (int j = 0; j < KEYS / 16; j++) {
#pragma unroll
        for (int dn = 0; dn < HD / 16; dn++) {
            u32 b[4];
            ldsm_x4_t(b, v_s + (j * 16 + vr) * LD + dn * 16 + vcol);
            mma_bf16(o[2 * dn], pa[j], b[0], b[1]);
            mma_bf16(o[2 * dn + 1], pa[j], b[2], b[3]);
            if (ATT_P_SPLIT) {
                mma_bf16(o[2 * dn], pl[j], b[0], b[1]);
                mma_bf16(o[2 * dn + 1], pl[j], b[2], b[3]);
            }
        }
    }
}

// Rows r_lo and r_lo + 8's results (l_*: this lane's share of the row sums): normalised into
// `out`, or with several splits (gridDim.z > 1) unnormalised into part_acc
// [(token, head) * gridDim.z + split][HD] with (m, l) beside in part_ml.
// Output pair n of a lane's row half (0: row g, 1: g + 8) and the first of its two dims: o[n]'s
// two columns at 8 n + 2 t4, or (F8, att_pv_f8's tiles) o[2 G][e] and o[2 G + 1][e] at
// 16 G + 4 t4 + 2 e for n = 2 G + e.
template <int HD, bool F8>
__device__ __forceinline__ float2 att_out_pair(const float (&o)[HD / 8][4], int n, int half,
                                               int t4, int& dim) {
    if (F8) {
        const int G = n / 2, e = n % 2;
        dim = 16 * G + 4 * t4 + 2 * e;
        return make_float2(o[2 * G][2 * half + e], o[2 * G + 1][2 * half + e]);
    }
    dim = 8 * n + 2 * t4;
    return make_float2(o[n][2 * half], o[n][2 * half + 1]);
}

template <int HD, bool F8>
__device__ __forceinline__ void att_store(const float (&o)[HD / 8][4], float l_lo, float l_hi,
                                          float m_lo, float m_hi, int rows, int r_lo, int q0,
                                          int group, int nh, int kvh, int split, int t4,
                                          float* __restrict__ part_acc,
                                          float* __restrict__ part_ml, bf16* __restrict__ out) {
    constexpr int NO = HD / 8;
    const int r_hi = r_lo + 8;
    l_lo = quad_sum(l_lo);
    l_hi = quad_sum(l_hi);
    if (gridDim.z > 1) {
        // Partial results: acc [(token, head) * gridDim.z + split][HD], (m, l) beside.
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = half ? r_hi : r_lo;
            if (r >= rows) continue;
            const int t = q0 + r / group, head = kvh * group + r % group;
            const long long base = ((long long)t * nh + head) * gridDim.z + split;
            float* a = part_acc + base * HD;
#pragma unroll
            for (int n = 0; n < NO; n++) {
                int dim;
                const float2 v = att_out_pair<HD, F8>(o, n, half, t4, dim);
                *reinterpret_cast<float2*>(a + dim) = v;
            }
            if (t4 == 0) {
                part_ml[base * 2] = half ? m_hi : m_lo;
                part_ml[base * 2 + 1] = half ? l_hi : l_lo;
            }
        }
        return;
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = half ? r_hi : r_lo;
        const float l = half ? l_hi : l_lo;
        if (r >= rows) continue;
        const float inv = l > 0.f ? __frcp_rn(l) : 0.f;
        const int t = q0 + r / group, head = kvh * group + r % group;
        bf16* dst = out + ((long long)t * nh + head) * HD;
#pragma unroll
        for (int n = 0; n < NO; n++) {
            int dim;
            const float2 v = att_out_pair<HD, F8>(o, n, half, t4, dim);
            *reinterpret_cast<__nv_bfloat162*>(dst + dim) =
                __floats2bfloat162_rn(__fmul_rn(v.x, inv), __fmul_rn(v.y, inv));
        }
    }
}

template <int HD, int WARPS, int KEYS, bool F8>
__device__ void attention_body(const bf16* __restrict__ q, const void* __restrict__ kc,
                                   const void* __restrict__ vc, const float* __restrict__ ksc,
                                   const float* __restrict__ vsc, const int* __restrict__ pos,
                                   const int* __restrict__ tile_seq,
                                   const int* __restrict__ tile_q0,
                                   const int* __restrict__ tile_qn,
                                   const int* __restrict__ block_tables,
                                   const int* __restrict__ meta, float* __restrict__ part_acc,
                                   float* __restrict__ part_ml, bf16* __restrict__ out, int nh,
                                   int nkv, int block_size, float scale, int tile_base,
                                   int early_kv, int heads_inner, int window) {
    constexpr int LD = HD + 8;  // shared row stride in bf16: ldmatrix rows hit distinct banks
    constexpr int KT = HD / 16;       // k-steps of Q K^T
    constexpr int NS = KEYS / 8;  // score n-tiles
    constexpr int NO = HD / 8;        // output n-tiles
    constexpr int LD8 = HD + 16;  // F8: shared row stride in bytes
    // The chunk's keys and values: bf16 rows, or (F8) e4m3 rows with their scales.
    __shared__ __align__(16) bf16 k_s[F8 ? 8 : KEYS * LD];
    __shared__ __align__(16) bf16 v_s[F8 ? 8 : KEYS * LD];
    __shared__ __align__(16) unsigned char k8_s[F8 ? KEYS * LD8 : 16];
    __shared__ __align__(16) unsigned char v8_s[F8 ? KEYS * LD8 : 16];
    __shared__ float ksc_s[F8 ? KEYS : 1];
    __shared__ float vsc_s[F8 ? KEYS : 1];
    void* const kdst = F8 ? static_cast<void*>(k8_s) : static_cast<void*>(k_s);
    void* const vdst = F8 ? static_cast<void*>(v8_s) : static_cast<void*>(v_s);

    // Until pdl_wait() only what earlier steps and the host wrote is read: the step buffer,
    // the block table and, with early_kv (every tile is its sequence's only query token of
    // the step, as in decode steps), the keys and values of the positions before the tile's
    // query, which this step's QKV product does not write. Their first chunk is asked for
    // here, while the QKV product still runs; a block with nothing to do leaves at once.
    // heads_inner: the grid is (tiles x KV heads, 1, splits) with the KV heads fastest, so the
    // blocks that run together read every head of the same cache slots (one contiguous run of
    // nkv * HD values per slot); otherwise (tiles, KV heads, splits).
    const int tile = tile_base + (heads_inner ? (int)blockIdx.x / nkv : (int)blockIdx.x);
    const int kvh = heads_inner ? (int)blockIdx.x % nkv : (int)blockIdx.y;
    const int split = blockIdx.z;
    // The loads before the first copies come in two rounds: the tile's entries in the step
    // buffer, then its positions beside the first chunk's block-table entries. (The compiler
    // does not hoist a load above a branch, and sinks one below a branch that does not need it.)
    const int qn = tile_qn[tile], q0 = tile_q0[tile], seq = tile_seq[tile];
    const int stride = meta[0], split_len = meta[1], splits = meta[2];
    // (seq | stride) < 0 never holds for a step buffer the host wrote; it makes the branch need
    // both, so they are loaded with the others rather than after it.
    if (qn <= 0 || split >= splits || (seq | stride) < 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = nh / nkv, rows = qn * group;
    const int* table = block_tables + (long long)seq * stride;
    const int kstart = split * split_len;
    int entries[(KEYS / WARPS + 31) / 32];
    chunk_entries<WARPS, KEYS>(entries, table, kstart, block_size, stride, warp);
    const int last = pos[q0 + qn - 1];
    const int cached = early_kv ? pos[q0] : kstart;  // keys before it are ready now
    const int kend = min(kstart + split_len, last + 1);
    // Splits past this tile's keys: the combine step never reads them.
    if (kstart >= kend) return;
    // A sliding window (window > 0): the tile's first row attends from pos[q0] - window + 1 on
    // and the others from later, so the chunks before it are skipped. A split wholly before it
    // leaves (the combine step reads only the splits from each token's window on).
    int kfirst = kstart;
    if (window > 0) {
        const int wlo = pos[q0] - window + 1;
        if (wlo > kstart) kfirst = kstart + (wlo - kstart) / KEYS * KEYS;
        if (kfirst >= kend) return;
        if (kfirst != kstart)
            chunk_entries<WARPS, KEYS>(entries, table, kfirst, block_size, stride, warp);
    }
    const int g = lane >> 2, t4 = lane & 3;

    long long slots[(KEYS / WARPS + 31) / 32];
    entries_to_slots<WARPS, KEYS>(slots, entries, kfirst, kend, block_size, warp);
    if (early_kv) {
        load_kv<HD, LD, WARPS, KEYS, true, F8>(kdst, ksc_s, kc, ksc, slots, nkv, kvh, kfirst,
                                               kfirst, cached, warp);
        load_kv<HD, LD, WARPS, KEYS, true, F8>(vdst, vsc_s, vc, vsc, slots, nkv, kvh, kfirst,
                                               kfirst, cached, warp);
#if ATT_L2_PREFETCH
        // The later chunks' cached keys and values into L2 (a split of several chunks: their
        // copies follow the wait one chunk at a time). An experiment for few splits
        // (SWITCHYARD_CUDA_ATT_SPLITS), off by default.
        const int pf_end = min(kend, cached);
        for (int kp = kfirst + KEYS + threadIdx.x; kp < pf_end; kp += blockDim.x) {
            const long long slot =
                (long long)table[kp / block_size] * block_size + kp % block_size;
            constexpr int VB = HD * (F8 ? 1 : 2);  // bytes per vector
            const char* kr = static_cast<const char*>(kc) + (slot * nkv + kvh) * VB;
            const char* vr = static_cast<const char*>(vc) + (slot * nkv + kvh) * VB;
#pragma unroll
            for (int b = 0; b < VB; b += 128) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(kr + b));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(vr + b));
            }
        }
#endif
    }
    pdl_wait();
    pdl_trigger();

    const int r_lo = warp * 16 + g, r_hi = r_lo + 8;
    u32 qf[KT][4];
    load_q_frags<HD, F8>(qf, q, q0, group, nh, kvh, rows, r_lo);
    // The last key a row attends to in this split: its position, or the split's last key (a
    // chunk may be longer than the split).
    const int a_lo = r_lo < rows ? pos[q0 + r_lo / group] : -1;
    const int a_hi = r_hi < rows ? pos[q0 + r_hi / group] : -1;
    const int p_lo = r_lo < rows ? min(a_lo, kend - 1) : -1;
    const int p_hi = r_hi < rows ? min(a_hi, kend - 1) : -1;
    // How many keys from p_* back a row attends to: its window less the keys this split cut
    // from the window's end (none past it: 0), or all of them. Only the chunks before the
    // last row's window start (wend) hold keys some row does not attend to: the others take
    // the causal mask alone (att_softmax's WINDOW), as every chunk does without a window.
    const int w_lo = window > 0 ? max(0, window - (a_lo - p_lo)) : 0x7fffffff;
    const int w_hi = window > 0 ? max(0, window - (a_hi - p_hi)) : 0x7fffffff;
    const int wend = window > 0 ? last - window + 1 : 0;
    const bool active = warp * 16 < rows;  // warp-uniform
    // An fp8 cache (F8): keys and values enter the products widened to their e4m3 values
    // times 2^-120 (att_scores_f8, att_pv_f8), Q times 2^60 (exact), so a score comes out as the e4m3
    // dot product times 2^-60, which its key's scale and 2^60 (in sl2) turn into the score;
    // the probabilities enter P V times their value's scale and 2^64, and the output is
    // multiplied by 2^56 at the end. Every factor is a power of two or a scale, and no
    // operand or product comes near f32's or bf16's limits.
    const float sl2 = F8 ? scale * 1.4426950408889634f * 0x1p60f : scale * 1.4426950408889634f;
    if (F8) {
        const __nv_bfloat162 up = __floats2bfloat162_rn(0x1p60f, 0x1p60f);
#pragma unroll
        for (int kk = 0; kk < KT; kk++)
#pragma unroll
            for (int h = 0; h < 4; h++) {
                __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&qf[kk][h]);
                v = __hmul2(v, up);
                qf[kk][h] = *reinterpret_cast<u32*>(&v);
            }
    }

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;

    // The copies run one buffer ahead of the maths: the next chunk's keys are asked for as soon
    // as this chunk's scores are computed (they land during the softmax and P V), its values as
    // soon as P V is done (they land during the next scores). cp.async groups complete in
    // order: K(c), V(c), K(c + 1), V(c + 1), ...
    // The rest of the first chunk (the keys from `cached` on, and zeros past kend): K(0) is
    // the group of every first-chunk copy issued so far, V(0) the rest of the values.
    if (early_kv) {
        load_kv<HD, LD, WARPS, KEYS, true, F8>(kdst, ksc_s, kc, ksc, slots, nkv, kvh, kfirst,
                                               cached, 0x7fffffff, warp);
        cp_async_commit();
        load_kv<HD, LD, WARPS, KEYS, true, F8>(vdst, vsc_s, vc, vsc, slots, nkv, kvh, kfirst,
                                               cached, 0x7fffffff, warp);
    } else {
        load_kv<HD, LD, WARPS, KEYS, false, F8>(kdst, ksc_s, kc, ksc, slots, nkv, kvh, kfirst, 0,
                                                0, warp);
        cp_async_commit();
        load_kv<HD, LD, WARPS, KEYS, false, F8>(vdst, vsc_s, vc, vsc, slots, nkv, kvh, kfirst, 0,
                                                0, warp);
    }
    cp_async_commit();
    for (int kb = kfirst; kb < kend; kb += KEYS) {
        const bool more = kb + KEYS < kend;  // block-uniform
        cp_async_wait<1>();  // K(c); V(c) may still be in flight
        __syncthreads();

        u32 pa[KEYS / 16][4], pl[KEYS / 16][4];
        float s[NS][4];
        if (active) {
            if (F8)
                att_scores_f8<HD, KEYS>(s, qf, k8_s, lane);
            else
                att_scores<HD, KEYS>(s, qf, k_s, lane);
        }
        // (The key scales are read before the next chunk's copies overwrite them.)
        if (F8 && active) att_scale_keys<KEYS>(s, ksc_s, 1.f, t4);
        if (more) {
            __syncthreads();  // every warp is done with k_s
            chunk_slots<WARPS, KEYS>(slots, table, kb + KEYS, kend, block_size, stride, warp);
            load_kv<HD, LD, WARPS, KEYS, false, F8>(kdst, ksc_s, kc, ksc, slots, nkv, kvh,
                                                    kb + KEYS, 0, 0, warp);
            cp_async_commit();  // K(c + 1)
        }
        if (active) {
            float c_lo, c_hi, sum_lo, sum_hi;
            if (kb < wend)  // block-uniform
                att_softmax<KEYS, true>(s, kb, p_lo, p_hi, w_lo, w_hi, sl2, t4, m_lo, m_hi,
                                        c_lo, c_hi, sum_lo, sum_hi);
            else
                att_softmax<KEYS, false>(s, kb, p_lo, p_hi, w_lo, w_hi, sl2, t4, m_lo, m_hi,
                                         c_lo, c_hi, sum_lo, sum_hi);
            // Per-lane partial sums, summed over the quad at the end.
            l_lo = __fmaf_rn(l_lo, c_lo, sum_lo);
            l_hi = __fmaf_rn(l_hi, c_hi, sum_hi);
            att_rescale<HD>(o, c_lo, c_hi);
            if (!F8) att_pack_p<KEYS>(pa, pl, s);
        }
        if (more)
            cp_async_wait<1>();  // V(c); K(c + 1) may still be in flight
        else
            cp_async_wait<0>();
        __syncthreads();
        if (F8 && active) {
            // The value scales have landed with the values (the row sums above stay unscaled).
            att_scale_keys<KEYS>(s, vsc_s, 0x1p64f, t4);
            att_pack_p<KEYS>(pa, pl, s);
            att_pv_f8<HD, KEYS>(o, pa, v8_s, lane);
        } else if (active) {
            att_pv<HD, KEYS>(o, pa, pl, v_s, lane);
        }
        if (more) {
            __syncthreads();  // every warp is done with v_s
            load_kv<HD, LD, WARPS, KEYS, false, F8>(vdst, vsc_s, vc, vsc, slots, nkv, kvh,
                                                    kb + KEYS, 0, 0, warp);
            cp_async_commit();  // V(c + 1)
        }
    }

    if (F8) att_rescale<HD>(o, 0x1p56f, 0x1p56f);
    att_store<HD, F8>(o, l_lo, l_hi, m_lo, m_hi, rows, r_lo, q0, group, nh, kvh, split, t4,
                  part_acc, part_ml, out);
}

// Grid (tiles, kv heads, splits), or (tiles x kv heads, 1, splits) with heads_inner; 32 * W
// threads, KEYS keys per chunk. ksc, vsc: the fp8 cache's scales (F8; not read otherwise).
// window: a sliding window (each query attends to its last `window` positions), 0 for none.
#define ATTENTION_KERNEL(NAME, HD, W, KEYS, F8)                                                  \
    extern "C" __global__ void __launch_bounds__(32 * W) NAME(                                  \
        const bf16* q, const void* kc, const void* vc, const float* ksc, const float* vsc,      \
        const int* pos, const int* tile_seq, const int* tile_q0, const int* tile_qn,            \
        const int* block_tables, const int* meta, float* part_acc, float* part_ml, bf16* out,   \
        int nh, int nkv, int block_size, float scale, int tile_base, int early_kv,              \
        int heads_inner, int window) {                                                          \
        attention_body<HD, W, KEYS, F8>(q, kc, vc, ksc, vsc, pos, tile_seq, tile_q0, tile_qn,   \
                                        block_tables, meta, part_acc, part_ml, out, nh, nkv,    \
                                        block_size, scale, tile_base, early_kv, heads_inner,    \
                                        window);                                                \
    }

ATTENTION_KERNEL(attention_w1_64, 64, 1, MMA_KEYS, false)
ATTENTION_KERNEL(attention_w1_128, 128, 1, MMA_KEYS, false)
ATTENTION_KERNEL(attention_w4_64, 64, 4, MMA_KEYS, false)
ATTENTION_KERNEL(attention_w4_128, 128, 4, MMA_KEYS, false)
ATTENTION_KERNEL(attention_w1_64_f8, 64, 1, ATT_F8_KEYS, true)
ATTENTION_KERNEL(attention_w1_128_f8, 128, 1, ATT_F8_KEYS, true)
ATTENTION_KERNEL(attention_w4_64_f8, 64, 4, MMA_KEYS, true)
ATTENTION_KERNEL(attention_w4_128_f8, 128, 4, MMA_KEYS, true)
ATTENTION_KERNEL(attention_w1_96, 96, 1, MMA_KEYS, false)
ATTENTION_KERNEL(attention_w4_96, 96, 4, MMA_KEYS, false)
ATTENTION_KERNEL(attention_w1_96_f8, 96, 1, ATT_F8_KEYS, true)
ATTENTION_KERNEL(attention_w4_96_f8, 96, 4, MMA_KEYS, true)


#ifndef COMBINE_BATCH
#define COMBINE_BATCH 8
#endif

// Merges the splits of every (token, head) of the step's tiles: grid (tiles, heads), block hd
// threads. `pos` gives each token's position, so splits past it (never written in this
// step) are skipped, and with a sliding window (window > 0) the splits before its window
// (which the attention kernel may have left unwritten).
extern "C" __global__ void attention_combine(const float* part_acc, const float* part_ml,
                                             const int* pos, const int* tile_q0,
                                             const int* tile_qn, const int* meta, bf16* out,
                                             int nh, int hd, int max_splits, int window) {
    // The step buffer is the host's: read before the wait.
    int tile = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    int q0 = tile_q0[tile], qn = tile_qn[tile];
    int nsplit = meta[2], split_len = meta[1];
    PDL_ENTER();
    // Partials are read COMBINE_BATCH splits at a time, every load of a batch issued before the
    // first is used: a step that splits its keys over at most COMBINE_BATCH blocks (every
    // decode step of a short context) reads them all in one round trip and merges them from
    // registers; in split order either way.
    constexpr int CB = COMBINE_BATCH;
    for (int t = q0; t < q0 + qn; t++) {
        const int used = min(nsplit, pos[t] / split_len + 1);
        const int first = window > 0 ? max(0, pos[t] - window + 1) / split_len : 0;
        long long base = ((long long)t * nh + head) * max_splits;
        float ms[CB], ls[CB], as[CB];
        auto load = [&](int s0, bool all) {
#pragma unroll
            for (int j = 0; j < CB; j++) {
                const bool ok = s0 + j < used;
                const long long sj = base + s0 + j;
                ms[j] = ok ? part_ml[sj * 2] : NEG_INF;
                if (all) {
                    ls[j] = ok ? part_ml[sj * 2 + 1] : 0.f;
                    as[j] = ok && d < hd ? part_acc[sj * hd + d] : 0.f;
                }
            }
        };
        float mx = NEG_INF;
        for (int s0 = first; s0 < used; s0 += CB) {
            load(s0, used - first <= CB);
#pragma unroll
            for (int j = 0; j < CB; j++) mx = fmaxf(mx, ms[j]);
        }
        float num = 0.f, den = 0.f;
        if (mx != NEG_INF) {
            for (int s0 = first; s0 < used; s0 += CB) {
                if (used - first > CB) load(s0, true);
#pragma unroll
                for (int j = 0; j < CB; j++) {
                    if (ms[j] == NEG_INF) continue;
                    const float w = exp2f(ms[j] - mx);  // (max, sum) in log2 units
                    den += w * ls[j];
                    num += w * as[j];
                }
            }
        }
        if (d < hd) out[((long long)t * nh + head) * hd + d] = __float2bfloat16(den > 0.f ? num / den : 0.f);
    }
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

// Structured output: the logits of the tokens outside a row's allowed set (bit t % 32 of word
// t / 32 of the row's mask) become -inf. Grid (vocab / 256, masked rows).
extern "C" __global__ void apply_token_masks(float* logits, u64 vocab, const int* rows,
                                             const u32* masks, int words, int n) {
    PDL_ENTER();
    const int r = blockIdx.y;
    const u64 t = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (r >= n || t >= vocab) return;
    if (!((masks[(u64)r * words + t / 32] >> (t % 32)) & 1u)) logits[(u64)rows[r] * vocab + t] = NEG_INF;
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

// The warp's (value, index) pair with the largest value and, among equal values, the lowest
// index, in every lane. An index past the row (a lane that saw only NaN) loses to any other:
// its value is -inf, and a real index is lower.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) {
            v = ov;
            i = oi;
        }
    }
}

// A tempered row with neither a top-k nor a top-p cut: its chunk sums do not depend on a
// threshold, so they can be computed before sample_rows runs (sample_partials).
__device__ __forceinline__ bool plain_tempered(float T, int k, float tp, int n) {
    return T > 0.f && !(k > 0 && k < n) && !(tp < 1.f);
}

// The min-p floor on the logits (tokens below it are cut); -inf without min-p.
__device__ __forceinline__ float minp_floor(float mx, float T, float mp) {
    return mp > 0.f ? __fmaf_rn(T, logf(mp), mx) : NEG_INF;
}

// The unnormalised probability of logit v that sample_rows keeps (0 when the threshold key or
// the min-p floor cuts it), written with explicitly rounded operations so every kernel that
// computes it gets the same bits.
__device__ __forceinline__ float kept_prob(float v, float mx, float inv_t, u32 thr,
                                           float floor_logit) {
    return fkey(v) >= thr && v >= floor_logit ? __expf(__fmul_rn(__fsub_rn(v, mx), inv_t)) : 0.f;
}

// Thread t's contiguous chunk [lo, hi) of a row of n logits among SAMPLE_THREADS chunks (a
// multiple of 4 values with vec4, read as float4).
__device__ __forceinline__ void sample_chunk(int n, bool vec4, int t, int* lo, int* hi) {
    const int chunk = vec4 ? (n + 4 * SAMPLE_THREADS - 1) / (4 * SAMPLE_THREADS) * 4
                           : (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    *lo = min(n, t * chunk);
    *hi = min(n, *lo + chunk);
}

// Sum of the kept probabilities over thread t's chunk, in index order.
__device__ __forceinline__ float chunk_sum(const float* __restrict__ l, int n, bool vec4, int t,
                                           float mx, float inv_t, u32 thr, float floor_logit) {
    int lo, hi;
    sample_chunk(n, vec4, t, &lo, &hi);
    float part = 0.f;
    if (vec4) {
#pragma unroll 4
        for (int i = lo; i < hi; i += 4) {
            const float4 v4 = *reinterpret_cast<const float4*>(l + i);
            part += kept_prob(v4.x, mx, inv_t, thr, floor_logit);
            part += kept_prob(v4.y, mx, inv_t, thr, floor_logit);
            part += kept_prob(v4.z, mx, inv_t, thr, floor_logit);
            part += kept_prob(v4.w, mx, inv_t, thr, floor_logit);
        }
    } else {
        for (int i = lo; i < hi; i++) part += kept_prob(l[i], mx, inv_t, thr, floor_logit);
    }
    return part;
}

// One block per sampled row: greedy (temperature 0) or temperature sampling with top-k, top-p
// and min-p, one uniform draw from the counter-based stream (seed, counter). Ties in greedy go
// to the lowest id; top-k and top-p keep every token tied with the threshold. With row_max
// (steps of few rows), plain tempered rows take their max from argmax_split and their chunk
// sums from sample_partials, which compute them as this kernel does, over several blocks.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 2)
    sample_rows(const float* logits, u64 vocab, const int* rows, const float* temperature,
                const int* top_k, const float* top_p, const float* min_p, const u64* seeds,
                const u64* counters, int* out_tokens, int skip_greedy, const float* row_max,
                const float* parts) {
    PDL_ENTER();
    __shared__ float red[32];
    __shared__ float scan[SAMPLE_THREADS];
    __shared__ int found;
    int s = blockIdx.x;
    const float* l = logits + (u64)rows[s] * vocab;
    int tid = threadIdx.x, n = (int)vocab;
    float T = temperature[s];
    // Greedy rows that argmax_split took (launched before this kernel in the same stream).
    if (T == 0.f && skip_greedy) return;

    // Rows of a vocabulary that is a multiple of 4 are read as float4 (16-byte aligned).
    const bool vec4 = (n & 3) == 0;
    const bool pre = row_max != nullptr && plain_tempered(T, top_k[s], top_p[s], n);

    // Max and the lowest index holding it, in one pass: each thread keeps its first index of
    // its largest value (NaN never wins: comparisons with it are false, as fmaxf skips it; a
    // -inf row keeps its first -inf), then the block keeps the largest value and, among equal
    // ones, the lowest index. Four float4 loads in flight per thread (at most 32 registers,
    // so two blocks fit a multiprocessor): one block reads the row, so at batch 1 its latency
    // is the step's.
    float mx = NEG_INF;
    int mi = n;
    auto take = [&](float v, int i) {
        if (v > mx || (v == mx && mi == n)) {
            mx = v;
            mi = i;
        }
    };
    if (pre) {
        // argmax_split wrote token 0 for a row without a finite logit.
        mx = row_max[s];
        if (!(mx > NEG_INF)) return;
    } else if (vec4) {
        const float4* l4 = reinterpret_cast<const float4*>(l);
        const int n4 = n >> 2;
        for (int i0 = tid; i0 < n4; i0 += 4 * blockDim.x) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int i = i0 + u * blockDim.x;
                v[u] = i < n4 ? l4[i] : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int i = i0 + u * blockDim.x;
                if (i >= n4) break;
                take(v[u].x, 4 * i);
                take(v[u].y, 4 * i + 1);
                take(v[u].z, 4 * i + 2);
                take(v[u].w, 4 * i + 3);
            }
        }
    } else {
        for (int i = tid; i < n; i += blockDim.x) take(l[i], i);
    }
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    if (!pre) {
        warp_argmax(mx, mi);
        const int lane = tid & 31, warp = tid >> 5, nw = (blockDim.x + 31) >> 5;
        if (lane == 0) {
            red_v[warp] = mx;
            red_i[warp] = mi;
        }
        __syncthreads();
        mx = lane < nw ? red_v[lane] : NEG_INF;
        mi = lane < nw ? red_i[lane] : n;
        warp_argmax(mx, mi);
        if (T == 0.f || !(mx > NEG_INF)) {
            if (tid == 0) out_tokens[s] = T == 0.f && mi < n ? mi : 0;
            return;
        }
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
    const float floor_logit = minp_floor(mx, T, min_p[s]);
    float tp = top_p[s];
    if (tp < 1.f) {
        // Over the tokens min-p keeps (vLLM applies min-p before top-p).
        float total = 0.f;
        for (int i = tid; i < n; i += blockDim.x) {
            float v = l[i];
            if (fkey(v) >= thr && v >= floor_logit) total += __expf((v - mx) * inv_t);
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
                if (fkey(v) >= lim && v >= floor_logit) mass += __expf((v - mx) * inv_t);
            }
            if (block_sum(mass, red) >= target) res = cand;
        }
        thr = max(res, thr);
    }
    // Sum of the kept probabilities over each thread's contiguous chunk (a multiple of 4 with
    // vec4, read as float4, in index order either way), then an inclusive scan.
    int lo, hi;
    sample_chunk(n, vec4, tid, &lo, &hi);
    const float part = pre ? parts[(u64)s * SAMPLE_THREADS + tid]
                           : chunk_sum(l, n, vec4, tid, mx, inv_t, thr, floor_logit);
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
            const float v = l[i];
            if (fkey(v) >= thr && v >= floor_logit) {
                pick = i;
                acc += kept_prob(v, mx, inv_t, thr, floor_logit);
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

// Greedy rows split across blocks, for steps with few rows (where one block per row leaves
// most of the GPU idle and the row's read is one multiprocessor's latency-bound stream): grid
// (rows, splits), ARGMAX_THREADS threads. Each block takes the largest value of its slice of a
// temperature-0 row and, among equal values, the lowest index, as one 64-bit key (fkey(value)
// above, the complement of the index below, so a larger key is a larger value, then a lower
// index; NaN never enters, a row of -inf keeps index 0, as in sample_rows), and publishes it in
// `part`; the row's last block to finish (a ticket per row, which that block resets for the
// next launch) writes the token: the same token sample_rows picks. Rows with a temperature
// return at once (sample_rows with skip_greedy samples them).
#define ARGMAX_THREADS 256
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_split(const float* logits, u64 vocab, const int* rows, const float* temperature,
                 const int* top_k, const float* top_p, unsigned long long* part,
                 unsigned* tickets, int* out_tokens, float* row_max) {
    PDL_ENTER();
    const int s = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int n = (int)vocab;
    const float T = temperature[s];
    // Plain tempered rows (with row_max): the max only, for sample_partials and sample_rows.
    const bool greedy = T == 0.f;
    if (!greedy && !(row_max != nullptr && plain_tempered(T, top_k[s], top_p[s], n))) return;
    const float* l = logits + (u64)rows[s] * vocab;
    // Slices of a multiple of 4 values, so rows of a vocabulary that is a multiple of 4 are
    // read as float4 (16-byte aligned) in every slice.
    const int chunk = ((n + splits - 1) / splits + 3) & ~3;
    const int lo = min(n, split * chunk), hi = min(n, lo + chunk);
    unsigned long long best = 0;
    auto take = [&](float v, int i) {
        if (v == v) {
            const unsigned long long key = ((unsigned long long)fkey(v) << 32) | (u32)~(u32)i;
            best = key > best ? key : best;
        }
    };
    if ((n & 3) == 0) {
        const float4* l4 = reinterpret_cast<const float4*>(l);
        for (int i0 = lo / 4 + threadIdx.x; i0 < hi / 4; i0 += 4 * ARGMAX_THREADS) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int i = i0 + u * ARGMAX_THREADS;
                const float nan = __int_as_float(0x7fffffff);  // skipped by take
                v[u] = i < hi / 4 ? l4[i] : make_float4(nan, nan, nan, nan);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int i = 4 * (i0 + u * ARGMAX_THREADS);
                take(v[u].x, i);
                take(v[u].y, i + 1);
                take(v[u].z, i + 2);
                take(v[u].w, i + 3);
            }
        }
    } else {
        for (int i = lo + threadIdx.x; i < hi; i += ARGMAX_THREADS) take(l[i], i);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    __shared__ unsigned long long warp_best[ARGMAX_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 0; w < ARGMAX_THREADS / 32; w++) best = warp_best[w] > best ? warp_best[w] : best;
    part[(u64)s * splits + split] = best;
    __threadfence();
    if (atomicAdd(&tickets[s], 1u) != (unsigned)splits - 1) return;
    // The last block: every other block's key is visible (each fenced before its ticket).
    __threadfence();
    unsigned long long m = 0;
    const volatile unsigned long long* ps = part + (u64)s * splits;
    for (int j = 0; j < splits; j++) m = ps[j] > m ? ps[j] : m;
    if (greedy) {
        out_tokens[s] = m ? (int)~(u32)m : 0;
    } else {
        // The max value back from its key (fkey inverted); a row without a finite logit
        // samples token 0, as in sample_rows.
        const u32 k = (u32)(m >> 32);
        const float v = m ? __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k) : NEG_INF;
        row_max[s] = v;
        if (!(v > NEG_INF)) out_tokens[s] = 0;
    }
    tickets[s] = 0;
}

// Split tempered sampling: the SAMPLE_THREADS chunk sums of sample_rows for the plain tempered
// rows whose max argmax_split left in row_max, computed as sample_rows computes them (so the
// token is the same bits as one block's), over SAMPLE_THREADS / 32 one-warp blocks per row:
// grid (rows, SAMPLE_THREADS / 32), 32 threads, thread = chunk.
extern "C" __global__ void __launch_bounds__(32)
    sample_partials(const float* logits, u64 vocab, const int* rows, const float* temperature,
                    const int* top_k, const float* top_p, const float* min_p,
                    const float* row_max, float* parts) {
    PDL_ENTER();
    const int s = blockIdx.x, n = (int)vocab;
    const float T = temperature[s];
    if (!plain_tempered(T, top_k[s], top_p[s], n)) return;
    const float mx = row_max[s];
    if (!(mx > NEG_INF)) return;
    const float inv_t = 1.f / T;
    const int t = blockIdx.y * 32 + threadIdx.x;
    parts[(u64)s * SAMPLE_THREADS + t] = chunk_sum(logits + (u64)rows[s] * vocab, n, (n & 3) == 0,
                                                   t, mx, inv_t, 0u, minp_floor(mx, T, min_p[s]));
}
