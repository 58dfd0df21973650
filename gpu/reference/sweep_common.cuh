// Helpers shared by the GEMV sweeps (gemv_sweep.cu, fgemv_sweep.cu), included after
// ../kernels/llama.cu (bf16, u64, mix64): error checks, weight and activation fills, the
// timing loop (median of 5 batches of `reps` back-to-back calls, after 3 warm-up calls), and the
// cuBLAS reference the kernels' outputs are checked against.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <cublas_v2.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

// Uniform in (-0.05, 0.05) (weights) and (-1, 1) (f32 activations), pure functions of (seed, i).
__global__ void fill(bf16* p, size_t n, u64 seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u64 z = mix64(seed + i);
        p[i] = __float2bfloat16(((int)(z & 0xffff) - 32768) / 32768.f * 0.05f);
    }
}
__global__ void fillf(float* p, size_t n, u64 seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u64 z = mix64(seed + i);
        p[i] = ((int)(z & 0xffff) - 32768) / 32768.f;
    }
}

static float time_us(cudaStream_t st, int reps, const std::function<void()>& f) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 3; i++) f();
    std::vector<float> v;
    for (int rep = 0; rep < 5; rep++) {
        cudaEventRecord(a, st);
        for (int i = 0; i < reps; i++) f();
        cudaEventRecord(b, st); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); v.push_back(ms * 1000.f / reps);
    }
    std::sort(v.begin(), v.end());
    return v[2];
}

// n values from the device as f32 (bf = the buffer holds bf16).
static std::vector<float> fetch(const void* p, size_t n, bool bf) {
    std::vector<float> out(n);
    if (bf) {
        std::vector<bf16> b(n);
        CK(cudaMemcpy(b.data(), p, n * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) out[i] = __bfloat162float(b[i]);
    } else {
        CK(cudaMemcpy(out.data(), p, n * 4, cudaMemcpyDeviceToHost));
    }
    return out;
}

// y = x W^T by cublasGemmEx for n tokens (W [rows, k], x [n, k], bf16), through scratch yr;
// with glu, W holds m gate rows then m up rows, the product is rounded to bf16 and the result
// is silu(gate) * up on the host. Returns [n, m] f32.
static std::vector<float> cublas_reference(cublasHandle_t h, const bf16* w, const bf16* x, void* yr,
                                           int m, int n, int k, bool glu) {
    const int rows = glu ? 2 * m : m;
    float one = 1.f, zero = 0.f;
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, k, &one, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k,
                 &zero, yr, glu ? CUDA_R_16BF : CUDA_R_32F, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    CK(cudaDeviceSynchronize());
    if (!glu) return fetch(yr, (size_t)n * m, false);
    const std::vector<float> gu = fetch(yr, (size_t)n * rows, true);
    std::vector<float> ref((size_t)n * m);
    for (int t = 0; t < n; t++)
        for (int r = 0; r < m; r++) {
            const float g = gu[(size_t)t * rows + r], u = gu[(size_t)t * rows + m + r];
            ref[(size_t)t * m + r] = g / (1.f + expf(-g)) * u;
        }
    return ref;
}
