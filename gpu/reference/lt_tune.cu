// cuBLASLt algorithm probe on a GPU host (nvcc there): for each Llama-3-8B product at token
// counts of the offline benchmark, the time of the heuristic's first choice (what the backend
// runs, gpu/src/cuda/lt.rs) beside the best of every algorithm the heuristic returns (up to
// LT_TUNE_CANDIDATES, default 64) and the best of the algorithms that won at the other token
// counts (checked with cublasLtMatmulAlgoCheck), with the same descriptors as the backend
// (C^T = W^T A^T column-major, bf16 in, f32 compute, C f32 or bf16, beta 0 or 1). A measurement
// for gpu/CUDA_NOTES.md: it tells whether timing candidates once per shape would pay.
//   nvcc -O2 -std=c++17 -arch=sm_90a lt_tune.cu -o /tmp/lt_tune -lcublasLt && /tmp/lt_tune
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
#define LK(x) do { cublasStatus_t st_ = (x); if (st_ != CUBLAS_STATUS_SUCCESS) { printf("cuBLASLt %d at %d\n", (int)st_, __LINE__); exit(1);} } while (0)

struct Shape { const char* name; int m, k; bool c_f32; float beta; };

__global__ void fill(__nv_bfloat16* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16(((int)((i * 2654435761u) & 0xffff) - 32768) / 32768.f * 0.05f);
}

struct Prob {
  cublasLtMatmulDesc_t d;
  cublasLtMatrixLayout_t lw, la, lc;
};

static Prob make(const Shape& s, int n) {
  Prob p;
  LK(cublasLtMatmulDescCreate(&p.d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
  LK(cublasLtMatmulDescSetAttribute(p.d, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA));
  LK(cublasLtMatmulDescSetAttribute(p.d, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof tB));
  LK(cublasLtMatrixLayoutCreate(&p.lw, CUDA_R_16BF, s.k, s.m, s.k));
  LK(cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, s.k, n, s.k));
  LK(cublasLtMatrixLayoutCreate(&p.lc, s.c_f32 ? CUDA_R_32F : CUDA_R_16BF, s.m, n, s.m));
  return p;
}

static void drop(Prob& p) {
  cublasLtMatrixLayoutDestroy(p.lw); cublasLtMatrixLayoutDestroy(p.la);
  cublasLtMatrixLayoutDestroy(p.lc); cublasLtMatmulDescDestroy(p.d);
}

int main() {
  const Shape shapes[] = {
    {"qkv", 6144, 4096, true, 0.f}, {"o", 4096, 4096, true, 1.f},
    {"gate_up", 28672, 4096, false, 0.f}, {"down", 4096, 14336, true, 1.f},
    {"lm_head", 128256, 4096, true, 0.f},
  };
  const std::vector<int> ns = {2000, 2048, 4096, 8192, 16384, 32768};
  const int want = getenv("LT_TUNE_CANDIDATES") ? atoi(getenv("LT_TUNE_CANDIDATES")) : 64;
  const size_t ws_bytes = 32 << 20;
  size_t max_w = 0, max_a = 0, max_c = 0;
  for (auto& s : shapes) max_w = std::max(max_w, (size_t)s.m * s.k);
  for (int n : ns) for (auto& s : shapes) {
    if (s.m > 100000 && n > 2048) continue;
    max_a = std::max(max_a, (size_t)n * s.k);
    max_c = std::max(max_c, (size_t)n * s.m * (s.c_f32 ? 4 : 2));
  }
  __nv_bfloat16 *w, *a; void *c, *ws;
  CK(cudaMalloc(&w, max_w * 2)); CK(cudaMalloc(&a, max_a * 2)); CK(cudaMalloc(&c, max_c)); CK(cudaMalloc(&ws, ws_bytes));
  fill<<<1024, 256>>>(w, max_w); fill<<<1024, 256>>>(a, max_a); CK(cudaMemset(c, 0, max_c));
  cublasLtHandle_t h; LK(cublasLtCreate(&h));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  cublasLtMatmulPreference_t pref; LK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsb = ws_bytes;
  LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
  std::vector<cublasLtMatmulHeuristicResult_t> res(want);
  // Median microseconds of one product with `algo` (1e30 if it does not run).
  auto timeit = [&](const Shape& s, int n, Prob& p, const cublasLtMatmulAlgo_t& algo) {
    const float alpha = 1.f, beta = s.beta;
    auto run = [&]() { return cublasLtMatmul(h, p.d, &alpha, w, p.lw, a, p.la, &beta, c, p.lc, c, p.lc, &algo, ws, ws_bytes, st); };
    if (run() != CUBLAS_STATUS_SUCCESS) { cudaGetLastError(); return 1e30; }
    const int reps = n >= 8192 ? 2 : 10;
    std::vector<float> t;
    for (int r = 0; r < 3; r++) {
      CK(cudaEventRecord(e0, st));
      for (int q = 0; q < reps; q++) run();
      CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms * 1000 / reps);
    }
    std::sort(t.begin(), t.end());
    return (double)t[1];
  };
  for (auto& s : shapes) {
    std::vector<int> sn;
    for (int n : ns) if (!(s.m > 100000 && n > 2048)) sn.push_back(n);
    std::vector<cublasLtMatmulAlgo_t> winners;
    std::vector<double> first(sn.size()), best(sn.size());
    std::vector<int> best_i(sn.size()), got_n(sn.size());
    for (size_t j = 0; j < sn.size(); j++) {
      Prob p = make(s, sn[j]);
      int got = 0;
      LK(cublasLtMatmulAlgoGetHeuristic(h, p.d, p.lw, p.la, p.lc, p.lc, pref, want, res.data(), &got));
      got_n[j] = got;
      best[j] = 1e30;
      for (int i = 0; i < got; i++) {
        double us = timeit(s, sn[j], p, res[i].algo);
        if (i == 0) first[j] = us;
        if (us < best[j]) { best[j] = us; best_i[j] = i; }
      }
      winners.push_back(res[best_i[j]].algo);
      drop(p);
    }
    for (size_t j = 0; j < sn.size(); j++) {
      const int n = sn[j];
      Prob p = make(s, n);
      double cross = 1e30; int cross_from = -1;
      for (size_t q = 0; q < winners.size(); q++) {
        if (q == j) continue;
        cublasLtMatmulHeuristicResult_t chk;
        if (cublasLtMatmulAlgoCheck(h, p.d, p.lw, p.la, p.lc, p.lc, &winners[q], &chk) != CUBLAS_STATUS_SUCCESS) continue;
        if (chk.workspaceSize > ws_bytes) continue;
        double us = timeit(s, n, p, winners[q]);
        if (us < cross) { cross = us; cross_from = sn[q]; }
      }
      const double flop = 2.0 * s.m * (double)n * s.k;
      auto tf = [&](double us) { return flop / us / 1e6; };
      printf("%-8s n %5d: %2d algos; first %8.1f us %4.0f TF/s; best #%-2d %8.1f us %4.0f TF/s (%.3fx); other n's winners: %8.1f us %4.0f TF/s (from n %d)\n",
             s.name, n, got_n[j], first[j], tf(first[j]), best_i[j], best[j], tf(best[j]), first[j] / best[j], cross, tf(cross), cross_from);
      drop(p);
    }
    fflush(stdout);
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
