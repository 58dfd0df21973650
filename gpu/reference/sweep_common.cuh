// Helpers shared by the GEMV sweeps (gemv_sweep.cu, fgemv_sweep.cu), included after
// ../kernels/llama.cu (bf16, u64, mix64): error checks, weight and activation fills, and the
// timing loop (median of 5 batches of `reps` back-to-back calls, after 3 warm-up calls).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
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
