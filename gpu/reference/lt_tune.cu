// cuBLASLt algorithm probe on a GPU host (nvcc there): for each Llama-3-8B product at the token
// counts of the offline benchmark, the time of the heuristic's first choice (what the backend
// runs, gpu/src/cuda/lt.rs) beside every other algorithm the heuristic returns (up to 16),
// with the same descriptors as the backend (C^T = W^T A^T column-major, bf16 in, f32 compute,
// C f32 or bf16, beta 0 or 1). A measurement for gpu/CUDA_NOTES.md: it tells whether timing the
// candidates once per shape would pay.
//   nvcc -O2 -std=c++17 -arch=sm_90a lt_tune.cu -o /tmp/lt_tune -lcublasLt && /tmp/lt_tune [N ...]
// N: token counts (default 2000 2048 8192 32768; each between 1 and 65536).
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

int main(int argc, char** argv) {
  const Shape shapes[] = {
    {"qkv", 6144, 4096, true, 0.f}, {"o", 4096, 4096, true, 1.f},
    {"gate_up", 28672, 4096, false, 0.f}, {"down", 4096, 14336, true, 1.f},
    {"lm_head", 128256, 4096, true, 0.f},
  };
  std::vector<int> ns = {2000, 2048, 8192, 32768};
  if (argc > 1) {
    ns.clear();
    for (int i = 1; i < argc; i++) {
      const int n = atoi(argv[i]);
      if (n < 1 || n > 65536) { printf("token count %s out of 1..65536\n", argv[i]); return 2; }
      ns.push_back(n);
    }
  }
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
  double total_first = 0, total_best = 0;
  for (int n : ns) for (auto& s : shapes) {
    if (s.m > 100000 && n > 2048) continue;  // the lm_head runs on sampled rows only
    cublasLtMatmulDesc_t d; LK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA));
    LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof tB));
    cudaDataType_t ct = s.c_f32 ? CUDA_R_32F : CUDA_R_16BF;
    cublasLtMatrixLayout_t lw, la, lc;
    LK(cublasLtMatrixLayoutCreate(&lw, CUDA_R_16BF, s.k, s.m, s.k));
    LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.k, n, s.k));
    LK(cublasLtMatrixLayoutCreate(&lc, ct, s.m, n, s.m));
    cublasLtMatmulPreference_t pref; LK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t wsb = ws_bytes;
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t res[16]; int got = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(h, d, lw, la, lc, lc, pref, 16, res, &got));
    const float alpha = 1.f, beta = s.beta;
    const double flop = 2.0 * s.m * (double)n * s.k;
    std::vector<double> us(got, 1e30);
    for (int i = 0; i < got; i++) {
      auto run = [&]() { return cublasLtMatmul(h, d, &alpha, w, lw, a, la, &beta, c, lc, c, lc, &res[i].algo, ws, ws_bytes, st); };
      if (run() != CUBLAS_STATUS_SUCCESS) continue;
      const int reps = n >= 8192 ? 5 : 20;
      std::vector<float> t;
      for (int r = 0; r < 5; r++) {
        CK(cudaEventRecord(e0, st));
        for (int q = 0; q < reps; q++) run();
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms * 1000 / reps);
      }
      std::sort(t.begin(), t.end());
      us[i] = t[t.size() / 2];
    }
    int best = (int)(std::min_element(us.begin(), us.end()) - us.begin());
    printf("%-8s n %5d m %6d k %5d: %2d algos; first %8.1f us %5.0f TFLOP/s; best #%-2d %8.1f us %5.0f TFLOP/s (%.3fx)\n",
           s.name, n, s.m, s.k, got, us[0], flop / us[0] / 1e6, best, us[best], flop / us[best] / 1e6, us[0] / us[best]);
    for (int i = 0; i < got; i++) printf("    #%-2d %8.1f us ws %zu\n", i, us[i], res[i].workspaceSize);
    if (n == 2000 || n == 32768) { total_first += us[0]; total_best += us[best]; }
    cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(lw); cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lc); cublasLtMatmulDescDestroy(d);
  }
  printf("n 2000 + 32768, one of each product: first %.1f us, best %.1f us (%.3fx)\n", total_first, total_best, total_first / total_best);
  CK(cudaDeviceSynchronize());
  return 0;
}
