// GEMV bandwidth sweep on a GPU host (nvcc there; gpu/reference/gemv_sweep.sh builds and runs
// it): the backend's own GEMV kernels (gpu/kernels/gemv.cu, or a variant of it named by
// GEMV_SRC) at every projection shape of a model (SWEEP_MODEL, below; Llama-3-8B by default),
// n = 1 and 8, with every launch shape (warps per block, warps per tile) they take,
// beside cublasGemmEx on the same product and two probes of the memory system alone: a
// contiguous streaming read, and the GEMV kernels' access pattern (a warp owning 16 rows)
// without the maths. Weights rotate through four copies so that nothing is served from L2.
// A measurement for gpu/CUDA_NOTES.md, not a check.
#include "../kernels/llama.cu"
#include GEMV_SRC
// The RoPE epilogue arguments of every GEMV kernel, unused by the plain products timed here,
// krot (SWEEP_KROT, default 0: blocks start at the first batch of their k range; the backend
// passes GEMV_ROTATE = 7 to steps of at most 8 tokens above a hidden size of 2,048), no fp8
// scales.
#include "sweep_common.cuh"
static int g_krot = 0;
#define NOROPE nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 0, g_krot, nullptr, 1

// Pure streaming read, 8 x 16 B in flight per thread.
__global__ void __launch_bounds__(256) probe_contig(const uint4* p, size_t n16, u32* out) {
  u32 acc = 0;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; u++) { size_t j = i + u * stride; v[u] = j < n16 ? gemv_ld_w((const char*)(p + j)) : make_uint4(0,0,0,0); }
#pragma unroll
    for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678) out[0] = acc;
}
// The GEMV access pattern without the maths: a warp owns 16 rows (k elements each); LPR lanes
// share a row (16 B each), so a lane covers RPL = 16 * LPR / 32 rows; per batch it issues LOADS
// loads (rows fastest), then consumes them.
// ROT: each warp starts at its own batch of loads (warp index x 7, wrapping), as GEMV_KROT.
template <int LPR, int LOADS, int ROT = 0>
__global__ void __launch_bounds__(256) probe_rows(const bf16* w, int m, int k, u32* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = blockIdx.x * 8 + warp;
  constexpr int RPI = 32 / LPR, RPL = 16 / RPI, SPB = LOADS / RPL;  // steps per batch
  const int r = lane / LPR, c = lane % LPR;
  u32 acc = 0;
  const bf16* wr = w + (size_t)(tile * 16 + r) * k + 8 * c;
  if (tile * 16 >= m) return;
  const int per = 8 * LPR * SPB, nb = (k + per - 1) / per, b0 = ROT ? (tile * 7) % nb : 0;
  for (int bi = 0; bi < nb; bi++) {
    const int s = ((bi + b0) % nb) * per;
    uint4 v[LOADS];
#pragma unroll
    for (int u = 0; u < LOADS; u++) {
      const int ri = u % RPL, st = u / RPL;
      int o = s + st * 8 * LPR;
      v[u] = gemv_ld_w((const char*)(wr + (size_t)ri * RPI * k + (o < k ? o : 0)));
    }
#pragma unroll
    for (int u = 0; u < LOADS; u++) acc ^= v[u].x ^ v[u].w;
  }
  if (acc == 0x12345678) out[0] = acc;
}

// The same warps and rows as probe_rows, read in address order: a warp takes its 16 rows (one
// contiguous span) RPI = 32 / LPR rows at a time, each group to the end of its rows before
// the next, LOADS loads in flight per lane along k.
template <int LPR, int LOADS, int ROT = 0>
__global__ void __launch_bounds__(256) probe_span(const bf16* w, int m, int k, u32* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = blockIdx.x * 8 + warp;
  constexpr int RPI = 32 / LPR;
  const int r = lane / LPR, c = lane % LPR;
  u32 acc = 0;
  if (tile * 16 >= m) return;
  for (int r0 = 0; r0 < 16; r0 += RPI) {
    const bf16* wr = w + (size_t)(tile * 16 + r0 + r) * k + 8 * c;
    const int per = 8 * LPR * LOADS, nb = (k + per - 1) / per, b0 = ROT ? (tile * 7) % nb : 0;
    for (int bi = 0; bi < nb; bi++) {
      const int s = ((bi + b0) % nb) * per;
      uint4 v[LOADS];
#pragma unroll
      for (int u = 0; u < LOADS; u++) {
        const int o = s + u * 8 * LPR;
        v[u] = gemv_ld_w((const char*)(wr + (o < k ? o : 0)));
      }
#pragma unroll
      for (int u = 0; u < LOADS; u++) acc ^= v[u].x ^ v[u].w;
    }
  }
  if (acc == 0x12345678) out[0] = acc;
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (getenv("SWEEP_KROT")) g_krot = atoi(getenv("SWEEP_KROT"));
  const size_t COPIES = 4;  // rotate weights so that nothing is served from L2
  struct Shape { const char* name; int m, k; int kind; };  // kind 0 plain f32 out, 1 glu, 2 norm glu, 3 norm plain
  // SWEEP_MODEL: whose projections (the fused QKV, o, gate|up, down, lm_head): llama-3-8b (the
  // default; its lm_head a quarter of the rows), phi-3-mini (hidden 3,072, no GQA),
  // llama-3.2-3b (hidden 3,072, 8 KV heads), qwen2.5-7b (hidden 3,584, 4 KV heads).
  struct Model { const char* name; int hidden, heads, kv_heads, head_dim, inter, lm_rows; };
  const Model models[] = {{"llama-3-8b", 4096, 32, 8, 128, 14336, 128256 / 4},
                          {"phi-3-mini", 3072, 32, 32, 96, 8192, 32064},
                          {"llama-3.2-3b", 3072, 24, 8, 128, 8192, 128256 / 4},
                          {"qwen2.5-7b", 3584, 28, 4, 128, 18944, 152064 / 4}};
  const char* want = getenv("SWEEP_MODEL") ? getenv("SWEEP_MODEL") : "llama-3-8b";
  const Model* md = nullptr;
  for (auto& x : models) if (strcmp(x.name, want) == 0) md = &x;
  if (!md) { printf("unknown SWEEP_MODEL %s\n", want); return 1; }
  const int qkv_rows = (md->heads + 2 * md->kv_heads) * md->head_dim;
  std::vector<Shape> shapes = {{"qkv", qkv_rows, md->hidden, 0}, {"qkv+norm", qkv_rows, md->hidden, 3},
                               {"o", md->hidden, md->heads * md->head_dim, 0},
                               {"gate_up+silu", md->inter, md->hidden, 1},
                               {"gate_up+norm+silu", md->inter, md->hidden, 2},
                               {"down", md->hidden, md->inter, 0}, {"lm_head", md->lm_rows, md->hidden, 0}};
  size_t maxw = (size_t)28672 * 4096, maxk = 0, maxrows = 0;  // at least the probes' bytes
  for (auto& x : shapes) {
    const size_t rows = x.kind == 1 || x.kind == 2 ? 2 * (size_t)x.m : x.m;
    maxw = std::max(maxw, rows * x.k);
    maxk = std::max(maxk, (size_t)x.k);
    maxrows = std::max(maxrows, rows);
  }
  bf16* W; CK(cudaMalloc(&W, maxw * 2 * COPIES));
  fill<<<1024, 256>>>(W, maxw * COPIES, 1);
  bf16* X; CK(cudaMalloc(&X, 64 * maxk * 2)); fill<<<64, 256>>>(X, 64 * maxk, 2);
  float* XF; CK(cudaMalloc(&XF, 64 * maxk * 4)); fillf<<<64, 256>>>(XF, 64 * maxk, 3);
  float* NW; CK(cudaMalloc(&NW, maxk * 4)); fillf<<<64, 256>>>(NW, maxk, 4);
  float* Y; CK(cudaMalloc(&Y, 64 * maxrows * 4)); CK(cudaMemset(Y, 0, 64 * maxrows * 4));
  float* YR; CK(cudaMalloc(&YR, 64 * maxrows * 4));
  u32* out; CK(cudaMalloc(&out, 4));
  CK(cudaDeviceSynchronize());
  cudaStream_t st = 0;
  cublasHandle_t h; cublasCreate(&h);
  printf("SMs %d, GEMV_SRC %s, SWEEP_MODEL %s, krot %d\n", sms, GEMV_SRC, md->name, g_krot);

  int rot = 0;
  // probes on the bytes of Llama-3-8B's gate|up (SWEEP_NO_PROBES=1 leaves them out)
  if (!getenv("SWEEP_NO_PROBES")) {
    size_t n = (size_t)28672 * 4096;
    double gb = n * 2 / 1e9;
    float t = time_us(st, 20, [&] { probe_contig<<<sms * 8, 256>>>((const uint4*)(W + (rot++ % COPIES) * maxw), n / 8, out); });
    printf("probe contig            %8.1f us %6.2f TB/s\n", t, gb / t * 1e3);
#define PR(L, S, R) { float t = time_us(st, 20, [&] { probe_rows<L, S, R><<<28672 / 128, 256>>>(W + (rot++ % COPIES) * maxw, 28672, 4096, out); }); \
    printf("probe rows LPR %2d LOADS %2d rot %d %8.1f us %6.2f TB/s\n", L, S, R, t, gb / t * 1e3); }
    PR(4, 16, 0) PR(4, 16, 1) PR(4, 32, 0) PR(4, 32, 1) PR(8, 16, 0) PR(8, 16, 1) PR(16, 16, 0) PR(16, 16, 1)
    PR(32, 16, 0) PR(32, 16, 1)
#define PS(L, S, R) { float t = time_us(st, 20, [&] { probe_span<L, S, R><<<28672 / 128, 256>>>(W + (rot++ % COPIES) * maxw, 28672, 4096, out); }); \
    printf("probe span LPR %2d LOADS %2d rot %d %8.1f us %6.2f TB/s\n", L, S, R, t, gb / t * 1e3); }
    PS(4, 8, 0) PS(4, 8, 1) PS(8, 8, 0) PS(8, 8, 1) PS(16, 8, 0) PS(16, 8, 1) PS(32, 8, 0) PS(32, 8, 1)
    PS(32, 16, 0) PS(32, 16, 1)
  }
  if (getenv("SWEEP_PROBES_ONLY")) return 0;
  // SWEEP_ONLY: space-separated shape names to run (default all).
  const char* only = getenv("SWEEP_ONLY");
  for (auto& s : shapes) {
    if (only) {
      bool hit = false;
      for (const char* p = only; *p;) {
        const char* e = strchr(p, ' ');
        const size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == strlen(s.name) && strncmp(p, s.name, len) == 0) hit = true;
        p += len + (e ? 1 : 0);
      }
      if (!hit) continue;
    }
    const bool glu = s.kind == 1 || s.kind == 2, norm = s.kind >= 2;
    const int wrows = glu ? 2 * s.m : s.m;
    const double gb = (double)wrows * s.k * 2 / 1e9;
    const int tiles = glu ? s.m / 8 : (s.m + 15) / 16;
    for (int n : {1, 8}) {
      // The reference for the plain and GLU products: cublasGemmEx on weight copy 0, then
      // (GLU) silu(gate) * up on the host; every launch shape is checked against it.
      std::vector<float> ref;
      if (!norm) ref = cublas_reference(h, W, X, YR, s.m, n, s.k, glu);
      // Every launch shape the kernels take: wpb warps per block, wpt of them per tile (wpt
      // divides wpb). "max/avg" is the most warps any SM gets in the first wave against the
      // average (1.00: balanced), from the occupancy API.
      // SWEEP_HOST=1: only the launch shape the host picks (gemv_grid in device.rs, 132 SMs).
      const int host_wpt = tiles * 8 <= 16 * sms ? 8 : tiles * 4 <= 16 * sms ? 4 : tiles * 2 <= 16 * sms ? 2 : 1;
      const int host_wpb = host_wpt >= 4 ? host_wpt : 8;
      for (int wpb = 1; wpb <= 8; wpb++) {
        for (int wpt = 1; wpt <= wpb; wpt++) {
          if (wpb % wpt != 0) continue;
          if (getenv("SWEEP_HOST") && (wpb != host_wpb || wpt != host_wpt)) continue;
          const int tpb = wpb / wpt, blocks = (tiles + tpb - 1) / tpb;
          const void* fn = s.kind == 0 ? (const void*)gemv_1 : s.kind == 1 ? (const void*)gemv_glu_1
                           : s.kind == 2 ? (const void*)gemv_norm_glu_1 : (const void*)gemv_norm_1;
          int bps = 0;
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, fn, 32 * wpb, 0);
          const int first = blocks < bps * sms ? blocks : bps * sms;
          const double avg = (double)first * wpb / sms, mx = (double)((first + sms - 1) / sms) * wpb;
          auto launch = [&](const bf16* w) {
            if (s.kind == 0) gemv_1<<<blocks, 32 * wpb>>>(w, X, nullptr, nullptr, 0.f, Y, s.m, n, s.k, 0.f, 1, wpt, NOROPE);
            else if (s.kind == 1) gemv_glu_1<<<blocks, 32 * wpb>>>(w, X, nullptr, nullptr, 0.f, Y, s.m, n, s.k, 0.f, 0, wpt, NOROPE);
            else if (s.kind == 2) gemv_norm_glu_1<<<blocks, 32 * wpb>>>(w, nullptr, XF, NW, 1e-5f, Y, s.m, n, s.k, 0.f, 0, wpt, NOROPE);
            else gemv_norm_1<<<blocks, 32 * wpb>>>(w, nullptr, XF, NW, 1e-5f, Y, s.m, n, s.k, 0.f, 1, wpt, NOROPE);
          };
          auto f = [&] { launch(W + (rot++ % COPIES) * maxw); };
          float t = time_us(st, 20, f);
          CK(cudaGetLastError());
          // Max |ours - reference| over max |reference| (bf16 inputs, f32 sums in another
          // order: ~1e-3 expected; the GLU output is bf16).
          double err = -1;
          if (!norm) {
            launch(W);
            CK(cudaDeviceSynchronize());
            std::vector<float> got((size_t)n * s.m);
            if (glu) {
              std::vector<bf16> gb16(got.size());
              CK(cudaMemcpy(gb16.data(), Y, gb16.size() * 2, cudaMemcpyDeviceToHost));
              for (size_t i = 0; i < got.size(); i++) got[i] = __bfloat162float(gb16[i]);
            } else {
              CK(cudaMemcpy(got.data(), Y, got.size() * 4, cudaMemcpyDeviceToHost));
            }
            double dmax = 0, rmax = 0;
            for (size_t i = 0; i < got.size(); i++) {
              dmax = fmax(dmax, fabs((double)got[i] - ref[i]));
              rmax = fmax(rmax, fabs((double)ref[i]));
            }
            err = rmax > 0 ? dmax / rmax : dmax;
          }
          printf("%-18s n %d wpb %d wpt %d blocks %5d per-SM %d waves %.2f warps/SM %5.2f max/avg %.2f %8.1f us %6.2f TB/s err %.1e%s\n",
                 s.name, n, wpb, wpt, blocks, bps, (double)blocks / (bps * sms), avg, mx / avg, t, gb / t * 1e3,
                 err, err > 2e-2 ? " WRONG" : "");
        }
      }
      if (!norm) {
        float one = 1.f, zero = 0.f;
        auto f = [&] {
          const bf16* w = W + (rot++ % COPIES) * maxw;
          cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, wrows, n, s.k, &one, w, CUDA_R_16BF, s.k, X, CUDA_R_16BF, s.k,
                       &zero, Y, glu ? CUDA_R_16BF : CUDA_R_32F, wrows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        };
        float t = time_us(st, 20, f);
        printf("%-18s n %d cuBLAS                         %8.1f us %6.2f TB/s\n", s.name, n, t, gb / t * 1e3);
      }
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
