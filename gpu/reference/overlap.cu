// Does splitting a large decode step into two nano-batches on two streams pay on the H200?
//
// The offline run (CUDA_NOTES v11-v12) spends ~10.9 s in compute-bound products and ~3 s in
// memory-bound kernels (decode attention, the element-wise passes), one after another, at the
// 700 W power cap. Two half-batches on two streams let one half's attention run beside the
// other half's products (NanoFlow's intra-device overlap). Whether that wins under a power cap
// is the question: the products already hold the card at its limit, so the overlap gains only
// the power the memory-bound phases leave unused, and it pays with products at half the rows.
//
// One Llama-3-8B decode layer at TOKENS tokens (default 2000), LAYERS x STEPS times:
//   rms_norm (f32 residual -> bf16) -> qkv (cuBLASLt, C f32) -> rope_like (f32 -> bf16 q)
//   -> attention stand-in (each (sequence, KV head) reads KEYS keys and values, 512 bytes
//      each, and does 4 query heads' worth of FMAs per key) -> o (+= residual)
//   -> rms_norm -> gate|up (C bf16) -> silu_mul -> down (+= residual)
// Modes: serial (one stream, all tokens), split2 (two streams, half the tokens each, each half
// its own chain), split2s (the same, the second half started one attention later).
// Then each piece alone, in a loop of ~1 s: time per launch and, from NVML's energy counter,
// the mean power and the energy per launch (which part of a step's energy goes where).
// usage: nvcc -O2 -std=c++17 -arch=sm_90a overlap.cu -o overlap -lcublasLt -lnvidia-ml &&
//        ./overlap [TOKENS KEYS STEPS ROUNDS SM_TARGET]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvml.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e = (x);                                                                    \
        if (e != cudaSuccess) {                                                                 \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));            \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)
#define LK(x)                                                                                   \
    do {                                                                                        \
        cublasStatus_t s_ = (x);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                      \
            printf("%s:%d %s: cuBLASLt %d\n", __FILE__, __LINE__, #x, (int)s_);                 \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

constexpr int H = 4096, QKV = 6144, FF = 14336, NKV = 8, HD = 128, LAYERS = 32;
constexpr size_t WS = 32 << 20;

__global__ void fill(__nv_bfloat16* p, size_t n, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(((int)((i * 2654435761u) & 0xffff) - 32768) / 32768.f * scale);
}

// One block of 256 threads per row: x = bf16(r / rms(r) * g).
__global__ void rms_norm(const float* __restrict__ r, const __nv_bfloat16* __restrict__ g,
                         __nv_bfloat16* __restrict__ x) {
    const float* row = r + (size_t)blockIdx.x * H;
    float v[H / 256], ss = 0.f;
#pragma unroll
    for (int i = 0; i < H / 256; i++) {
        v[i] = row[threadIdx.x + i * 256];
        ss += v[i] * v[i];
    }
    __shared__ float red[8];
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(~0u, ss, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) ss += red[i];
    const float inv = rsqrtf(ss / H + 1e-5f);
#pragma unroll
    for (int i = 0; i < H / 256; i++) {
        const int c = threadIdx.x + i * 256;
        x[(size_t)blockIdx.x * H + c] = __float2bfloat16(v[i] * inv * __bfloat162float(g[c]));
    }
}

// Stand-in for rope_store_kv: reads the f32 QKV row, writes q (bf16) and this token's key and
// value into the cache row `kv_row` (as the real kernel writes one slot).
__global__ void rope_like(const float* __restrict__ qkv, __nv_bfloat16* __restrict__ q,
                          __nv_bfloat16* __restrict__ kv_new) {
    const size_t t = blockIdx.x;
    for (int c = threadIdx.x; c < QKV; c += blockDim.x) {
        const float v = qkv[t * QKV + c];
        if (c < H)
            q[t * H + c] = __float2bfloat16(v * 0.7f);
        else
            kv_new[t * (QKV - H) + (c - H)] = __float2bfloat16(v);
    }
}

// Attention stand-in: one warp per (sequence, KV head); reads `keys` keys and values (256
// bytes each) from the sequence's region of the cache with 16-byte loads and does, per key,
// the FMAs of 4 query heads' scores and P V (in f32 on CUDA cores: more maths than the mma
// kernel's, so this errs on the side of a busier kernel). Writes 4 heads x 128 outputs.
__global__ void attention_like(const uint4* __restrict__ kv, const __nv_bfloat16* __restrict__ q,
                               __nv_bfloat16* __restrict__ out, int keys) {
    const int seq = blockIdx.x / NKV, head = blockIdx.x % NKV, lane = threadIdx.x;
    // 16 lanes cover a 256-byte row; a warp reads two keys per load.
    const size_t base = ((size_t)seq * NKV + head) * (size_t)keys * 2 * 16;
    const float qv = __bfloat162float(q[(size_t)seq * H + head * HD + lane]);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k = lane >> 4; k < keys; k += 2) {
        const uint4 kk = kv[base + (size_t)k * 16 + (lane & 15)];
        const uint4 vv = kv[base + ((size_t)keys + k) * 16 + (lane & 15)];
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&kk.x));
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vv.y));
#pragma unroll
        for (int h = 0; h < 4; h++) {
            float s = qv * a.x + acc[h] * 1e-3f;
            s = fmaf(qv, a.y, s);
            acc[h] = fmaf(__expf(s * 1e-3f), b.x + b.y, acc[h]);
        }
    }
#pragma unroll
    for (int h = 0; h < 4; h++)
        out[(size_t)seq * H + (head * 4 + h) * HD / 4 + lane] = __float2bfloat16(acc[h]);
}

__global__ void silu_mul(const __nv_bfloat16* __restrict__ gu, __nv_bfloat16* __restrict__ h,
                         size_t tokens) {
    const size_t n = tokens * FF;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n / 2;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = (2 * i) / FF, c = (2 * i) % FF;
        const __nv_bfloat162 g = *reinterpret_cast<const __nv_bfloat162*>(gu + t * 2 * FF + c);
        const __nv_bfloat162 u = *reinterpret_cast<const __nv_bfloat162*>(gu + t * 2 * FF + FF + c);
        const float2 gf = __bfloat1622float2(g), uf = __bfloat1622float2(u);
        const float2 r = make_float2(gf.x / (1.f + __expf(-gf.x)) * uf.x,
                                     gf.y / (1.f + __expf(-gf.y)) * uf.y);
        *reinterpret_cast<__nv_bfloat162*>(h + t * FF + c) = __float22bfloat162_rn(r);
    }
}

// C^T = W^T A^T column-major as the backend (gpu/src/cuda/lt.rs): W [m, k] rows, A [n, k].
struct Gemm {
    cublasLtMatmulDesc_t d;
    cublasLtMatrixLayout_t lw, la, lc;
    cublasLtMatmulAlgo_t algo;
    float beta;
    void init(cublasLtHandle_t h, int m, int k, int n, bool c_f32, float b, int sm_target) {
        beta = b;
        LK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
        LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        if (sm_target > 0)
            LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_target,
                                              sizeof sm_target));
        LK(cublasLtMatrixLayoutCreate(&lw, CUDA_R_16BF, k, m, k));
        LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
        LK(cublasLtMatrixLayoutCreate(&lc, c_f32 ? CUDA_R_32F : CUDA_R_16BF, m, n, m));
        cublasLtMatmulPreference_t p;
        LK(cublasLtMatmulPreferenceCreate(&p));
        uint64_t ws = WS;
        LK(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                sizeof ws));
        cublasLtMatmulHeuristicResult_t r[1];
        int got = 0;
        LK(cublasLtMatmulAlgoGetHeuristic(h, d, lw, la, lc, lc, p, 1, r, &got));
        if (got < 1) {
            printf("no algorithm for m %d k %d n %d\n", m, k, n);
            exit(1);
        }
        algo = r[0].algo;
        cublasLtMatmulPreferenceDestroy(p);
    }
    void run(cublasLtHandle_t h, const void* w, const void* a, void* c, void* ws,
             cudaStream_t s) const {
        const float alpha = 1.f;
        LK(cublasLtMatmul(h, d, &alpha, w, lw, a, la, &beta, c, lc, c, lc, &algo, ws, WS, s));
    }
};

struct Weights {
    __nv_bfloat16 *qkv, *o, *gu, *down, *g1, *g2;
};

// One chain: `tokens` tokens, its own activations, cache region, workspace and stream.
struct Chain {
    int tokens, keys;
    cudaStream_t s;
    float *res, *qkv;
    __nv_bfloat16 *x, *q, *att, *gu, *h, *kv_new;
    uint4* kv;
    void* ws;
    Gemm g_qkv, g_o, g_gu, g_down;
    void init(cublasLtHandle_t lt, int n, int k, uint4* cache, int sm_target) {
        tokens = n;
        keys = k;
        kv = cache;
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CK(cudaMalloc(&res, (size_t)n * H * 4));
        CK(cudaMalloc(&qkv, (size_t)n * QKV * 4));
        CK(cudaMalloc(&x, (size_t)n * H * 2));
        CK(cudaMalloc(&q, (size_t)n * H * 2));
        CK(cudaMalloc(&att, (size_t)n * H * 2));
        CK(cudaMalloc(&gu, (size_t)n * 2 * FF * 2));
        CK(cudaMalloc(&h, (size_t)n * FF * 2));
        CK(cudaMalloc(&kv_new, (size_t)n * (QKV - H) * 2));
        CK(cudaMalloc(&ws, WS));
        CK(cudaMemset(res, 0, (size_t)n * H * 4));
        fill<<<1024, 256>>>(x, (size_t)n * H, 1.f);
        fill<<<1024, 256>>>(att, (size_t)n * H, 1.f);
        g_qkv.init(lt, QKV, H, n, true, 0.f, sm_target);
        g_o.init(lt, H, H, n, true, 1.f, sm_target);
        g_gu.init(lt, 2 * FF, H, n, false, 0.f, sm_target);
        g_down.init(lt, H, FF, n, true, 1.f, sm_target);
    }
    void attention_half(cublasLtHandle_t lt, const Weights& w) {
        rms_norm<<<tokens, 256, 0, s>>>(res, w.g1, x);
        g_qkv.run(lt, w.qkv, x, qkv, ws, s);
        rope_like<<<tokens, 256, 0, s>>>(qkv, q, kv_new);
        attention_like<<<tokens * NKV, 32, 0, s>>>(kv, q, att, keys);
        g_o.run(lt, w.o, att, res, ws, s);
    }
    void mlp_half(cublasLtHandle_t lt, const Weights& w) {
        rms_norm<<<tokens, 256, 0, s>>>(res, w.g2, x);
        g_gu.run(lt, w.gu, x, gu, ws, s);
        silu_mul<<<132 * 8, 256, 0, s>>>(gu, h, tokens);
        g_down.run(lt, w.down, h, res, ws, s);
    }
};

static double elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

int main(int argc, char** argv) {
    const int tokens = argc > 1 ? atoi(argv[1]) : 2000;
    const int keys = argc > 2 ? atoi(argv[2]) : 192;
    const int steps = argc > 3 ? atoi(argv[3]) : 30;
    const int rounds = argc > 4 ? atoi(argv[4]) : 3;
    const int sm_target = argc > 5 ? atoi(argv[5]) : 0;
    if (tokens < 2 || tokens > 65536 || keys < 2 || keys > 4096 || steps < 1 || steps > 1000 ||
        rounds < 1 || rounds > 20) {
        printf("usage: overlap [TOKENS 2..65536] [KEYS 2..4096] [STEPS 1..1000] [ROUNDS 1..20] [SM_TARGET]\n");
        return 2;
    }
    cublasLtHandle_t lt;
    LK(cublasLtCreate(&lt));
    Weights w;
    const size_t nw[] = {(size_t)QKV * H, (size_t)H * H, (size_t)2 * FF * H, (size_t)H * FF, H, H};
    __nv_bfloat16** pw[] = {&w.qkv, &w.o, &w.gu, &w.down, &w.g1, &w.g2};
    for (int i = 0; i < 6; i++) {
        CK(cudaMalloc(pw[i], nw[i] * 2));
        fill<<<1024, 256>>>(*pw[i], nw[i], i < 4 ? 0.02f : 1.f);
    }
    // The cache: every (sequence, KV head) has `keys` keys then `keys` values, 256 bytes each.
    const size_t kv_u4 = (size_t)tokens * NKV * keys * 2 * 16;
    uint4* kv;
    CK(cudaMalloc(&kv, kv_u4 * 16));
    fill<<<4096, 256>>>(reinterpret_cast<__nv_bfloat16*>(kv), kv_u4 * 8, 1.f);
    printf("tokens %d, keys %d, %d steps x %d layers per measurement, cache %.2f GB, sm_target %d\n",
           tokens, keys, steps, LAYERS, kv_u4 * 16 / 1e9, sm_target);

    Chain whole, a, b;
    whole.init(lt, tokens, keys, kv, 0);
    const int ta = tokens / 2;
    a.init(lt, ta, keys, kv, sm_target);
    b.init(lt, tokens - ta, keys, kv + (size_t)ta * NKV * keys * 2 * 16, sm_target);
    CK(cudaDeviceSynchronize());

    cudaEvent_t e0, e1, eb, ev[2 * LAYERS];
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventCreate(&eb));
    for (auto& evt : ev) CK(cudaEventCreateWithFlags(&evt, cudaEventDisableTiming));

    auto serial = [&]() {
        CK(cudaEventRecord(e0, whole.s));
        for (int st = 0; st < steps; st++)
            for (int l = 0; l < LAYERS; l++) {
                whole.attention_half(lt, w);
                whole.mlp_half(lt, w);
            }
        CK(cudaEventRecord(e1, whole.s));
        CK(cudaEventSynchronize(e1));
        return elapsed_ms(e0, e1);
    };
    // Two chains; with `stagger`, b's first layer starts after a's first attention half, so
    // that a's products tend to meet b's attention and the other way round.
    auto split = [&](bool stagger) {
        CK(cudaEventRecord(e0, a.s));
        CK(cudaStreamWaitEvent(b.s, e0));
        for (int st = 0; st < steps; st++)
            for (int l = 0; l < LAYERS; l++) {
                a.attention_half(lt, w);
                if (stagger && st == 0 && l == 0) {
                    CK(cudaEventRecord(ev[0], a.s));
                    CK(cudaStreamWaitEvent(b.s, ev[0]));
                }
                b.attention_half(lt, w);
                a.mlp_half(lt, w);
                b.mlp_half(lt, w);
            }
        CK(cudaEventRecord(eb, b.s));
        CK(cudaStreamWaitEvent(a.s, eb));
        CK(cudaEventRecord(e1, a.s));
        CK(cudaEventSynchronize(e1));
        return elapsed_ms(e0, e1);
    };
    // Warm up (clocks, power state, cuBLASLt's first-call work).
    serial();
    split(false);
    const char* names[] = {"serial", "split2", "split2s"};
    std::vector<double> t[3];
    for (int r = 0; r < rounds; r++)
        for (int m = 0; m < 3; m++) {
            const double ms = m == 0 ? serial() : split(m == 2);
            t[m].push_back(ms);
            printf("round %d %-8s %9.1f ms total, %7.3f ms per step, %8.0f tok/s\n", r, names[m],
                   ms, ms / steps, tokens * steps / (ms / 1e3));
            fflush(stdout);
        }
    for (int m = 0; m < 3; m++) {
        std::sort(t[m].begin(), t[m].end());
        const double med = t[m][t[m].size() / 2];
        printf("median %-8s %7.3f ms per step (%.3fx serial)\n", names[m], med / steps,
               [&] {
                   std::vector<double> s = t[0];
                   return s[s.size() / 2] / med;
               }());
    }
    // Each piece alone: a ~1 s loop of launches after a warm-up loop; time per launch from
    // events, energy from NVML's counter (mJ), the SM clock sampled at the end of the loop.
    nvmlDevice_t dev;
    const bool nvml = nvmlInit() == NVML_SUCCESS && nvmlDeviceGetHandleByIndex(0, &dev) == NVML_SUCCESS;
    auto piece = [&](const char* name, auto&& f) {
        auto loop = [&](int n) {
            for (int i = 0; i < n; i++) f();
        };
        CK(cudaEventRecord(e0, whole.s));
        loop(20);
        CK(cudaEventRecord(e1, whole.s));
        CK(cudaEventSynchronize(e1));
        const int n = std::max(20, (int)(1000.0 / elapsed_ms(e0, e1) * 20));
        loop(n / 2);  // into the power state of a long run
        CK(cudaStreamSynchronize(whole.s));
        unsigned long long mj0 = 0, mj1 = 0;
        if (nvml) nvmlDeviceGetTotalEnergyConsumption(dev, &mj0);
        CK(cudaEventRecord(e0, whole.s));
        loop(n);
        CK(cudaEventRecord(e1, whole.s));
        CK(cudaEventSynchronize(e1));
        unsigned clock = 0;
        if (nvml) {
            nvmlDeviceGetTotalEnergyConsumption(dev, &mj1);
            nvmlDeviceGetClockInfo(dev, NVML_CLOCK_SM, &clock);
        }
        const double ms = elapsed_ms(e0, e1), j = (mj1 - mj0) / 1e3;
        printf("piece %-10s %8.1f us  %6.1f W  %8.2f mJ per launch  SM %4u MHz (%d launches)\n", name,
               ms * 1e3 / n, j / (ms / 1e3), j * 1e3 / n, clock, n);
        fflush(stdout);
    };
    Chain& c = whole;
    piece("rms_norm", [&] { rms_norm<<<c.tokens, 256, 0, c.s>>>(c.res, w.g1, c.x); });
    piece("qkv", [&] { c.g_qkv.run(lt, w.qkv, c.x, c.qkv, c.ws, c.s); });
    piece("rope_like", [&] { rope_like<<<c.tokens, 256, 0, c.s>>>(c.qkv, c.q, c.kv_new); });
    piece("attention", [&] { attention_like<<<c.tokens * NKV, 32, 0, c.s>>>(c.kv, c.q, c.att, c.keys); });
    piece("o", [&] { c.g_o.run(lt, w.o, c.att, c.res, c.ws, c.s); });
    piece("gate_up", [&] { c.g_gu.run(lt, w.gu, c.x, c.gu, c.ws, c.s); });
    piece("silu_mul", [&] { silu_mul<<<132 * 8, 256, 0, c.s>>>(c.gu, c.h, c.tokens); });
    piece("down", [&] { c.g_down.run(lt, w.down, c.h, c.res, c.ws, c.s); });
    piece("layer", [&] {
        c.attention_half(lt, w);
        c.mlp_half(lt, w);
    });
    CK(cudaDeviceSynchronize());
    return 0;
}
