// Row-streaming GEMV probe on a GPU host (nvcc there; `bash gpu/reference/fgemv_sweep.sh`):
// a GEMV without tensor cores for steps of at most 4 tokens, where LPR lanes (8 or 16) share
// a weight row instead of the mma kernels' 4, so every load instruction reads 128-256
// contiguous bytes per row, and warps sweep the rows in address order over a one-wave grid
// (the access pattern the probes of CUDA_NOTES v5 timed at 58.9-59.4 us for gate|up's bytes
// against 63 us for the mma kernels' pattern). x (or, for the norm variants, the normalised x,
// computed once per block) sits in shared memory as bf16. Timed beside the backend's mma GEMV
// kernels at the launch shapes the host picks and cublasGemmEx, at every Llama-3-8B product,
// n = 1, 2, 4; every output is checked against cuBLAS (plain, GLU) or the mma norm kernels.
// A measurement for gpu/CUDA_NOTES.md, not a check.
#include "../kernels/llama.cu"
#include "../kernels/gemv.cu"
#include "sweep_common.cuh"
#define NOROPE nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 0, 0, nullptr, 1

__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}

__device__ __forceinline__ uint4 fg_ld_w(const bf16* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// y[t, r] = sum_k x[t, k] W[r, k] for t < n <= NT. A unit is two weight rows (GLU: gate row
// r and up row m + r; otherwise rows 16 (u / 8) + u % 8 and that + 8, the pairing of the RoPE
// layout), each read by LPR lanes, 16 bytes per lane per load, U loads in flight per lane. A
// warp takes 16 / LPR units at a time (a group). Warp w of the grid takes group w first, then
// (DYN) the next free group from an atomic counter (reset by the last warp to finish), or
// (static) groups w + W, w + 2W, ... The first batch of W loads is issued before x is staged
// (PRE); with PIPE each batch's loads are issued before the previous batch's products.
// NORM: 0 x as given; 1 RMSNorm first (one warp's sum of squares, then x normalised into
// shared memory, as the backend's norm kernels compute it); 2 RMSNorm late: nw * x is staged
// while each thread adds up its squares, and the 1 / rms factor scales the sums at the end, so
// no warp waits on a reduction before the products (other rounding than 1: bf16(nw x) rather
// than bf16(nw (x inv))).
template <int NT, int LPR, int U, bool GLU, int NORM, bool DYN, bool PIPE>
__global__ void __launch_bounds__(256, 1) fgemv(const bf16* __restrict__ w, const bf16* __restrict__ x,
                                                const float* __restrict__ xf, const float* __restrict__ nw,
                                                float eps, void* __restrict__ y, int m, int n, int k,
                                                float beta, int y_f32, int* ctr) {
    extern __shared__ __align__(16) unsigned char fsm[];
    bf16* xs = reinterpret_cast<bf16*>(fsm);  // [NT][k]
    __shared__ float inv_s[NT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    constexpr int UPI = 16 / LPR;
    const int grp = lane / LPR, c = lane % LPR;
    const int sub = grp >> 1, which = grp & 1;
    const int units = GLU ? m : 8 * ((m + 15) / 16);
    const int groups = (units + UPI - 1) / UPI;
    const int gw = blockIdx.x * wpb + warp, GW = gridDim.x * wpb;
    const int kstep = 8 * LPR;
    const int nb = (k + kstep * U - 1) / (kstep * U);  // batches per unit

    auto row_of = [&](int ug, int& u, bool& ok) {
        u = ug * UPI + sub;
        int row;
        if (GLU) {
            ok = u < m;
            row = which ? m + u : u;
        } else {
            row = 16 * (u >> 3) + (u & 7) + 8 * which;
            ok = u < units && row < m;
        }
        return ok ? row : 0;
    };
    auto load = [&](uint4 (&P)[U], int ug, int b) {
        int u;
        bool ok;
        const bf16* wr = w + (u64)row_of(ug, u, ok) * k + 8 * c;
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int o = b * kstep * U + kstep * i;
            P[i] = fg_ld_w(wr + (o + 8 * c < k ? o : 0));
        }
    };

    int ug = gw;
    uint4 P[U];
    if (ug < groups) load(P, ug, 0);

    // x (normalised for NORM) into shared memory; rows n..NT-1 zero.
    if (NORM == 1) {
        for (int t = warp; t < n; t += wpb) {
            const float ss = warp_sumsq(xf + (u64)t * k, k, lane);
            if (lane == 0) inv_s[t] = rms_inv(ss, k, eps);
        }
        __syncthreads();
    }
    __shared__ float red_ss[NT][8];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < (k >> 3); i += blockDim.x) {
            const int o = 8 * i;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (t < n) {
                if (NORM == 1) {
                    v = gemv_norm_piece(xf + (u64)t * k + o, nw + o, inv_s[t]);
                } else if (NORM == 2) {
                    const float4 x0 = __ldg(reinterpret_cast<const float4*>(xf + (u64)t * k + o));
                    const float4 x1 = __ldg(reinterpret_cast<const float4*>(xf + (u64)t * k + o + 4));
                    const float4 w0 = __ldg(reinterpret_cast<const float4*>(nw + o));
                    const float4 w1 = __ldg(reinterpret_cast<const float4*>(nw + o + 4));
                    v.x = gemv_pack(w0.x * x0.x, w0.y * x0.y);
                    v.y = gemv_pack(w0.z * x0.z, w0.w * x0.w);
                    v.z = gemv_pack(w1.x * x1.x, w1.y * x1.y);
                    v.w = gemv_pack(w1.z * x1.z, w1.w * x1.w);
                    ss += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w + x1.x * x1.x +
                          x1.y * x1.y + x1.z * x1.z + x1.w * x1.w;
                } else {
                    v = __ldg(reinterpret_cast<const uint4*>(x + (u64)t * k + o));
                }
            }
            *reinterpret_cast<uint4*>(xs + (u64)t * k + o) = v;
        }
        if (NORM == 2) {
            ss = warp_sum(ss);
            if (lane == 0) red_ss[t][warp] = ss;
        }
    }
    __syncthreads();
    float inv_l[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        inv_l[t] = 1.f;
        if (NORM == 2) {
            float ss = 0.f;
            for (int q = 0; q < wpb; q++) ss += red_ss[t][q];
            inv_l[t] = rms_inv(ss, k, eps);
        }
    }

    int grabbed = 0;  // lane 0: the next group (DYN), fetched one unit ahead
    if (DYN && lane == 0) grabbed = GW + atomicAdd(ctr, 1);
    while (ug < groups) {
        int next = DYN ? __shfl_sync(0xffffffffu, grabbed, 0) : ug + GW;
        if (DYN && lane == 0 && next < groups) grabbed = GW + atomicAdd(ctr, 1);
        int u;
        bool ok;
        row_of(ug, u, ok);
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = 0.f;
        for (int b = 0; b < nb; b++) {
            uint4 Q[U];
            const int nug = b + 1 < nb ? ug : next, nbb = b + 1 < nb ? b + 1 : 0;
            if (PIPE && nug < groups) load(Q, nug, nbb);
#pragma unroll
            for (int i = 0; i < U; i++) {
                const int o = b * kstep * U + kstep * i + 8 * c;
                if (o >= k) continue;
                float wv[8];
                unpack8(P[i], wv);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    float xv[8];
                    unpack8(*reinterpret_cast<const uint4*>(xs + (u64)t * k + o), xv);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[t] = __fmaf_rn(wv[e], xv[e], acc[t]);
                }
            }
            if (PIPE) {
#pragma unroll
                for (int i = 0; i < U; i++) P[i] = Q[i];
            } else if (nug < groups) {
                load(P, nug, nbb);
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
#pragma unroll
            for (int off = LPR / 2; off > 0; off >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
            if (NORM == 2) acc[t] *= inv_l[t];
        }
        if (GLU) {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float other = __shfl_xor_sync(0xffffffffu, acc[t], LPR);
                if (ok && which == 0 && c == 0 && t < n) {
                    const float gv = __bfloat162float(__float2bfloat16(acc[t]));
                    const float uv = __bfloat162float(__float2bfloat16(other));
                    reinterpret_cast<bf16*>(y)[(u64)t * m + u] = __float2bfloat16(silu_times(gv, uv));
                }
            }
        } else if (ok && c == 0) {
            const int row = 16 * (u >> 3) + (u & 7) + 8 * which;
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= n) continue;
                if (y_f32) {
                    float* yo = reinterpret_cast<float*>(y) + (u64)t * m + row;
                    *yo = beta != 0.f ? __fmaf_rn(beta, *yo, acc[t]) : acc[t];
                } else {
                    bf16* yo = reinterpret_cast<bf16*>(y) + (u64)t * m + row;
                    *yo = __float2bfloat16(beta != 0.f ? __fmaf_rn(beta, __bfloat162float(*yo), acc[t]) : acc[t]);
                }
            }
        }
        ug = next;
    }
    if (DYN && lane == 0) {
        __threadfence();
        // Every warp's last grab has returned once the done count reaches GW: reset for the
        // next launch.
        if (atomicAdd(ctr + 1, 1) == GW - 1) {
            ctr[0] = 0;
            ctr[1] = 0;
        }
    }
}

// kind 0 plain, 1 glu, 2 norm glu, 3 norm plain, 4 late-norm glu, 5 late-norm plain (the mma
// norm kernels are their references, and their mma timing).
struct Shape { const char* name; int m, k; int kind; int wpb, wpt; };

static double rel_err(const std::vector<float>& got, const std::vector<float>& ref) {
    double dmax = 0, rmax = 0;
    for (size_t i = 0; i < got.size(); i++) {
        dmax = fmax(dmax, fabs((double)got[i] - ref[i]));
        rmax = fmax(rmax, fabs((double)ref[i]));
    }
    return rmax > 0 ? dmax / rmax : dmax;
}

static int* g_ctr;
template <int NT, int LPR, int U, bool DYN, bool PIPE>
static void run_fma(const Shape& s, int n, int sms, const bf16* W, size_t maxw, size_t copies, int& rot,
                    const bf16* X, const float* XF, const float* NW, void* Y, const std::vector<float>& ref,
                    double gb, cudaStream_t st) {
    const bool glu = s.kind == 1 || s.kind == 2 || s.kind == 4;
    void (*fn)(const bf16*, const bf16*, const float*, const float*, float, void*, int, int, int, float, int, int*) =
        s.kind == 0 ? fgemv<NT, LPR, U, false, 0, DYN, PIPE>
        : s.kind == 1 ? fgemv<NT, LPR, U, true, 0, DYN, PIPE>
        : s.kind == 2 ? fgemv<NT, LPR, U, true, 1, DYN, PIPE>
        : s.kind == 3 ? fgemv<NT, LPR, U, false, 1, DYN, PIPE>
        : s.kind == 4 ? fgemv<NT, LPR, U, true, 2, DYN, PIPE> : fgemv<NT, LPR, U, false, 2, DYN, PIPE>;
    const size_t smem = (size_t)NT * s.k * 2;
    CK(cudaFuncSetAttribute((const void*)fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int bps = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, (const void*)fn, 256, smem));
    const int units = glu ? s.m : 8 * ((s.m + 15) / 16);
    const int groups = (units + 16 / LPR - 1) / (16 / LPR);
    for (int want : {2, 3, 4, 6, 8}) {
        if (want > bps) break;
        int blocks = sms * want;
        if (blocks * 8 > groups) blocks = (groups + 7) / 8;
        auto launch = [&](const bf16* w) {
            fn<<<blocks, 256, smem, st>>>(w, X, XF, NW, 1e-5f, Y, s.m, n, s.k, 0.f, glu ? 0 : 1, g_ctr);
        };
        float t = time_us(st, 20, [&] { launch(W + (rot++ % copies) * maxw); });
        CK(cudaGetLastError());
        launch(W);
        CK(cudaDeviceSynchronize());
        const double err = rel_err(fetch(Y, (size_t)n * s.m, glu), ref);
        printf("%-18s n %d fma NT %d LPR %2d U %2d dyn %d pipe %d blocks/SM %d (max %d) %8.1f us %6.2f TB/s err %.1e%s\n",
               s.name, n, NT, LPR, U, (int)DYN, (int)PIPE, want, bps, t, gb / t * 1e3, err, err > 2e-2 ? " WRONG" : "");
    }
}

template <int NT>
static void run_all_fma(const Shape& s, int n, int sms, const bf16* W, size_t maxw, size_t copies, int& rot,
                        const bf16* X, const float* XF, const float* NW, void* Y, const std::vector<float>& ref,
                        double gb, cudaStream_t st) {
#define RF(L, U_, D, P) run_fma<NT, L, U_, D, P>(s, n, sms, W, maxw, copies, rot, X, XF, NW, Y, ref, gb, st);
    RF(8, 4, false, false) RF(16, 8, false, false)
    RF(8, 4, true, false) RF(8, 8, true, false) RF(16, 4, true, false) RF(16, 8, true, false)
    RF(8, 4, true, true) RF(16, 4, true, true) RF(16, 8, true, true)
#undef RF
}

int main() {
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const size_t COPIES = 4;
    const size_t maxw = (size_t)28672 * 4096;
    bf16* W; CK(cudaMalloc(&W, maxw * 2 * COPIES));
    bf16* X; CK(cudaMalloc(&X, 64 * 14336 * 2));
    float* XF; CK(cudaMalloc(&XF, 64 * 14336 * 4));
    float* NW; CK(cudaMalloc(&NW, 14336 * 4));
    fill<<<1024, 256>>>(W, maxw * COPIES, 1);
    fill<<<64, 256>>>(X, 64 * 14336, 2);
    fillf<<<64, 256>>>(XF, 64 * 14336, 3);
    fillf<<<64, 256>>>(NW, 14336, 4);
    void* Y; CK(cudaMalloc(&Y, (size_t)64 * 28672 * 4)); CK(cudaMemset(Y, 0, (size_t)64 * 28672 * 4));
    void* YR; CK(cudaMalloc(&YR, (size_t)64 * 28672 * 4));
    CK(cudaDeviceSynchronize());
    CK(cudaMalloc(&g_ctr, 8));
    CK(cudaMemset(g_ctr, 0, 8));
    cudaStream_t st = 0;
    cublasHandle_t h; cublasCreate(&h);
    printf("SMs %d\n", sms);
    // The mma kernels at the launch shape the host picks (CUDA_NOTES v5).
    Shape shapes[] = {{"qkv", 6144, 4096, 0, 4, 4}, {"qkv+norm", 6144, 4096, 3, 4, 4}, {"o", 4096, 4096, 0, 8, 8},
                      {"gate_up+silu", 14336, 4096, 1, 8, 1}, {"gate_up+norm+silu", 14336, 4096, 2, 8, 1},
                      {"gate_up+lnorm+silu", 14336, 4096, 4, 8, 1}, {"qkv+lnorm", 6144, 4096, 5, 4, 4},
                      {"down", 4096, 14336, 0, 8, 8}, {"lm_head/4", 128256 / 4, 4096, 0, 8, 1}};
    int rot = 0;
    const char* only = getenv("FGEMV_ONLY");
    for (auto& s : shapes) {
        if (only && !strstr(only, s.name)) continue;
        const bool glu = s.kind == 1 || s.kind == 2 || s.kind == 4, norm = s.kind >= 2;
        const int wrows = glu ? 2 * s.m : s.m;
        const double gb = (double)wrows * s.k * 2 / 1e9;
        const int tiles = glu ? s.m / 8 : (s.m + 15) / 16;
        for (int n : {1, 2}) {
            auto mma = [&](const bf16* w, void* y) {
                const int tpb = s.wpb / s.wpt, blocks = (tiles + tpb - 1) / tpb;
                if (s.kind == 0) gemv_1<<<blocks, 32 * s.wpb>>>(w, X, nullptr, nullptr, 0.f, y, s.m, n, s.k, 0.f, 1, s.wpt, NOROPE);
                else if (s.kind == 1) gemv_glu_1<<<blocks, 32 * s.wpb>>>(w, X, nullptr, nullptr, 0.f, y, s.m, n, s.k, 0.f, 0, s.wpt, NOROPE);
                else if (s.kind == 2 || s.kind == 4) gemv_norm_glu_1<<<blocks, 32 * s.wpb>>>(w, nullptr, XF, NW, 1e-5f, y, s.m, n, s.k, 0.f, 0, s.wpt, NOROPE);
                else gemv_norm_1<<<blocks, 32 * s.wpb>>>(w, nullptr, XF, NW, 1e-5f, y, s.m, n, s.k, 0.f, 1, s.wpt, NOROPE);
            };
            // Reference: cuBLAS (plain, GLU with SiLU on the host) or the mma norm kernels.
            std::vector<float> ref;
            if (!norm) {
                ref = cublas_reference(h, W, X, YR, s.m, n, s.k, glu);
            } else {
                mma(W, YR);
                CK(cudaDeviceSynchronize());
                ref = fetch(YR, (size_t)n * s.m, glu);
            }
            float t = time_us(st, 20, [&] { mma(W + (rot++ % COPIES) * maxw, Y); });
            mma(W, Y);
            CK(cudaDeviceSynchronize());
            double err = rel_err(fetch(Y, (size_t)n * s.m, glu), ref);
            printf("%-18s n %d mma wpb %d wpt %d              %8.1f us %6.2f TB/s err %.1e\n", s.name, n, s.wpb, s.wpt, t,
                   gb / t * 1e3, err);
            if (!norm) {
                float one = 1.f, zero = 0.f;
                float tc = time_us(st, 20, [&] {
                    const bf16* w = W + (rot++ % COPIES) * maxw;
                    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, wrows, n, s.k, &one, w, CUDA_R_16BF, s.k, X, CUDA_R_16BF, s.k,
                                 &zero, Y, glu ? CUDA_R_16BF : CUDA_R_32F, wrows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
                });
                printf("%-18s n %d cuBLAS                          %8.1f us %6.2f TB/s\n", s.name, n, tc, gb / tc * 1e3);
            }
            if (n == 1) run_all_fma<1>(s, n, sms, W, maxw, COPIES, rot, X, XF, NW, Y, ref, gb, st);
            else run_all_fma<2>(s, n, sms, W, maxw, COPIES, rot, X, XF, NW, Y, ref, gb, st);
        }
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
