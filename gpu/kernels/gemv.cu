// Skinny GEMMs for steps of at most 64 tokens: every projection of such a step (decode steps
// of up to 64 sequences, small prefill chunks) and the lm_head of any step with at most 64
// logit rows run here instead of cuBLAS. Compiled after llama.cu, in the same NVRTC unit (its
// typedefs, warp_sum, warp_sumsq, rms_inv, rms_scale, silu_times and pdl_* are used here).
//
//   y[t, r] = sum_k x[t, k] * W[r, k]  (+ beta * y[t, r]),   t < n <= 64, r < m
//
// W is bf16 [m, k] row-major (as the backend stores every projection), x bf16 [n, k], y f32 or
// bf16 [n, m]; f32 accumulation. k must be a multiple of 8 and W, x 16-byte aligned (the host
// checks and falls back to cuBLAS otherwise). The *_f8 variants read W as e4m3 (fp8 layers)
// with f32 scales ws[r * ws_stride] (ws_stride 1: a scale per row; 0: one for the matrix):
// each 8-byte piece becomes the 8 bf16 values it holds (exactly: every e4m3 value is a bf16
// value), the same mma runs, and the epilogue multiplies each row's sum by its scale; half the
// weight bytes of the bf16 kernels for the same work.
//
// Tensor cores. A warp multiplies a tile of 16 rows of W with the tokens 8 at a time:
// mma.m16n8k16 with A = 16 rows x 16 k of W, B = 16 k x 8 tokens (tokens >= n are zeros),
// D = 16 x 8 in f32. A sum over k does not depend on the order in which k is visited, so the k
// slots of the mma fragments are a permutation of the physical k, the same for A and B: lane
// (g = lane / 4, c = lane % 4) loads the 16 bytes W[row g][kb + 8c .. +8] and W[row g + 8][same]
// (A fragment rows g and g + 8) and x[token 8j + g][same] (B fragment column g of token group
// j); the first mma takes elements 0..3 of each piece (slots 2c, 2c+1 and 2c+8, 2c+9), the
// second elements 4..7. So W streams in whole 16-byte loads (64 contiguous bytes per row and
// step, several steps in flight per lane), and up to 64 tokens cost little more than one.
//
// Work split. A block has wpb = blockDim.x / 32 warps (at most GEMV_WARPS); each tile of 16 rows
// (8 for the GLU variants) gets `wpt` of them (wpt divides wpb; both chosen by the host from
// the shape alone), which split k into contiguous ranges; their partial tiles are summed
// through shared memory in warp order. A block takes wpb / wpt consecutive tiles.
//
// Batch invariance. Every output is the same function of its own token's inputs whatever n is:
// columns of an mma do not interact, the k split and the order of k depend only on the shape
// and krot, the warp sum has a fixed order, and fused epilogues and prologues compute what the
// separate kernels would (with the same helpers). So a sequence decodes to the same bits alone
// or batched with up to 63 others, in any step of at most 64 tokens, and runs repeat exactly;
// with krot (large models, where the host routes steps by size anyway: Gpu::gemv_rotate)
// within steps of at most 8 tokens and within steps of 9 to 64.
//
// Variants (one extern "C" kernel each, one signature; suffix _NG = token groups of 8, NG = 1,
// 2, 4 or 8; the norm variants only with NG = 1):
//   gemv        y = x W^T (+ beta y), y f32 (y_f32 = 1) or bf16;
//   gemv_glu    W = [gate; up] with 2m rows: the tile's A rows are gate rows r and up rows
//               m + r (8 of each), and the epilogue writes act[t, r] = silu(g) * u in bf16 with
//               g, u rounded to bf16 first, exactly as silu_mul would from a bf16 gate|up output;
//   *_norm      x is not given: the prologue computes RMSNorm of the f32 residual rows xf with
//               weight nw (one warp per token, as rms_norm) and the B fragments are
//               bf16(nw * (xf * inv)), the value rms_norm would have stored;
//   gemv_rope   W is the fused QKV weight with its Q and K rows in the RoPE pair order (see
//               llama.cu): rows g and g + 8 of a Q or K tile are the two elements of one
//               rotation pair, so the epilogue rotates them (rope_rotate, as rope_store_kv
//               does) and writes Q to rq and K and V to the cache slots rslots[t] (none for a
//               slot < 0), in the checkpoint's element order; y is not written. The rope_*
//               arguments are unused by the other variants.
//   *_lora      (bf16 W, one token group) the step's LoRA updates (LoraUpdate in llama.cu, its
//               fields as the trailing arguments; `u` from lora_shrink) added to each f32 sum
//               where lora_expand or lora_silu_mul would add them after the unfused product:
//               after beta (f32 y), before RoPE, and to the bf16-rounded gate and up values
//               before SiLU (gate row r is column r of the update, up row r column m + r); the
//               same bits as the unfused kernels. Each token's B matrices are looked up before
//               the wait on the previous kernel (the tables are step inputs), so the epilogue
//               only reads B's row and u.

#define GEMV_WARPS 8
// k-steps of each warp's rows asked of L2 before pdl_wait (see gemv_body; 16 and 32 were
// slower at Llama-3-8B batch 1, 0 a little slower: CUDA_NOTES v8).
#ifndef GEMV_PF_STEPS
#define GEMV_PF_STEPS 8
#endif
// Whether the first batch of W loads is issued before pdl_wait (see gemv_body), in the plain
// and the norm kernels (whose prologue holds more registers): 1 or 0. Two batches measured
// slower than one (CUDA_NOTES v10).
#ifndef GEMV_W_EARLY
#define GEMV_W_EARLY 1
#endif
// k-steps per batch of loads in the fp8 kernels (the bf16 ones take 4).
#ifndef GEMV_F8_STEPS
#define GEMV_F8_STEPS 4
#endif
#ifndef GEMV_W_EARLY_NORM
#define GEMV_W_EARLY_NORM 1
#endif
static_assert((GEMV_W_EARLY == 0 || GEMV_W_EARLY == 1) &&
                  (GEMV_W_EARLY_NORM == 0 || GEMV_W_EARLY_NORM == 1),
              "GEMV_W_EARLY and GEMV_W_EARLY_NORM are 0 or 1");
__device__ __forceinline__ void gemv_mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 gemv_pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

// e4m3 weights are widened by e4m3x8_widen (llama.cu): their values times 2^-120, which the
// epilogue undoes.
#define GEMV_F8_UNSCALE 0x1p120f

// A lane's piece of W for one k-step, streamed: 16 bytes, 8 bf16 values or 16 e4m3 values (see
// gemv_body), not kept in L1 (x is), with an L2 prefetch of the next bytes. `p` is a byte
// address.
__device__ __forceinline__ uint4 gemv_ld_w(const char* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// bf16(nw * (x * inv)) for 8 consecutive values, packed as the B fragment expects.
__device__ __forceinline__ uint4 gemv_norm_piece(const float* __restrict__ xr,
                                                 const float* __restrict__ nw, float inv) {
    float4 x0 = __ldg(reinterpret_cast<const float4*>(xr));
    float4 x1 = __ldg(reinterpret_cast<const float4*>(xr + 4));
    float4 w0 = __ldg(reinterpret_cast<const float4*>(nw));
    float4 w1 = __ldg(reinterpret_cast<const float4*>(nw + 4));
    uint4 r;
    r.x = gemv_pack(rms_scale(x0.x, w0.x, inv), rms_scale(x0.y, w0.y, inv));
    r.y = gemv_pack(rms_scale(x0.z, w0.z, inv), rms_scale(x0.w, w0.w, inv));
    r.z = gemv_pack(rms_scale(x1.x, w1.x, inv), rms_scale(x1.y, w1.y, inv));
    r.w = gemv_pack(rms_scale(x1.z, w1.z, inv), rms_scale(x1.w, w1.w, inv));
    return r;
}

// Where the RoPE variants write (see gemv_rope above): Q [T, nh, hd], the layer's K and V cache
// [slots, nkv, hd], each token's position and slot, the rotation frequencies (then the pairs'
// amplitudes: rope_apply), and the head shape; interleaved: pairs (2j, 2j + 1) rather than
// (j, j + hd / 2).
struct GemvRope {
    bf16* q;
    bf16* kc;
    bf16* vc;
    const int* pos;
    const long long* slots;
    const float* inv_freq;
    int nh, nkv, hd, interleaved;
};

// The RoPE epilogue for rows ra and ra + 8 (values v0, v1) of token t.
__device__ __forceinline__ void gemv_rope_out(const GemvRope& r, int t, int ra, float v0,
                                              float v1) {
    const int qk = (r.nh + r.nkv) * r.hd;
    const long long slot = r.slots[t];
    if (ra < qk) {
        const int head = ra / r.hd, p = ra % r.hd;  // p % 16 < 8: the pair's first row
        const int j = 8 * (p >> 4) + (p & 7);
        const int a = r.interleaved ? 2 * j : j;
        const int b = r.interleaved ? 2 * j + 1 : j + r.hd / 2;
        float y0, y1;
        rope_rotate(v0, v1, (float)r.pos[t], r.inv_freq[j], r.inv_freq[r.hd / 2 + j], &y0, &y1);
        bf16* o;
        if (head < r.nh)
            o = r.q + ((u64)t * r.nh + head) * r.hd;
        else if (slot >= 0)
            o = r.kc + ((u64)slot * r.nkv + (head - r.nh)) * r.hd;
        else
            return;
        o[a] = __float2bfloat16(y0);
        o[b] = __float2bfloat16(y1);
    } else if (slot >= 0) {
        bf16* o = r.vc + (u64)slot * r.nkv * r.hd + (ra - qk);
        o[0] = __float2bfloat16(v0);
        o[8] = __float2bfloat16(v1);
    }
}

// What a lane's loads and products need (see gemv_body).
struct GemvLane {
    const char* wa;  // W row g (this lane's column of 8 values), a byte address
    const char* wb;  // W row g + 8 (gate|up: the up row)
    const bf16* x;
    const float* xf;
    const float* nw;
    const float* inv_s;
    int n, k, kc, g;
    bool ok_a, ok_b;
    int s_end;
};

// Values of k per lane and k-step: 8 (bf16 W) or 16 (e4m3 W: the same 16 bytes per load). A
// k-step covers 4 lanes' worth, 32 or 64 values of k.
template <bool F8>
struct GemvK {
    static constexpr int PER_LANE = F8 ? 16 : 8;
    static constexpr int STEP = 4 * PER_LANE;
    static constexpr int XP = PER_LANE / 8;  // 16-byte x pieces per lane and step
};

// Issues the W loads of the batch of STEPS k-steps from step s: loads past the warp's range
// (or of rows that do not exist) read the lane's first piece instead, a valid address, and are
// replaced by zeros in gemv_compute, so no load sits behind a branch.
template <bool F8, int STEPS>
__device__ __forceinline__ void gemv_load_w(const GemvLane& L, int s, uint4 (&P)[STEPS],
                                            uint4 (&Q)[STEPS], bool (&in)[STEPS]) {
    constexpr int ESZ = F8 ? 1 : 2;  // bytes per value of W
#pragma unroll
    for (int u = 0; u < STEPS; u++) {
        const int off = (s + u) * GemvK<F8>::STEP;
        in[u] = s + u < L.s_end && off + L.kc < L.k;
        const int o = in[u] ? off : 0;
        P[u] = gemv_ld_w(L.wa + ESZ * o);
        Q[u] = gemv_ld_w(L.wb + ESZ * o);
    }
}

// x piece i (8 values from k offset kc + o + 8 i) of token t.
template <bool NORM>
__device__ __forceinline__ uint4 gemv_x_piece(const GemvLane& L, int t, int o, bool ok) {
    const int tg = ok ? t : 0;
    if (NORM)
        return gemv_norm_piece(L.xf + (u64)tg * L.k + L.kc + o, L.nw + L.kc + o,
                               ok ? L.inv_s[t] : 0.f);
    return __ldg(reinterpret_cast<const uint4*>(L.x + (u64)tg * L.k + L.kc + o));
}

// The x pieces of the same batch (one token group: NG == 1; the others load theirs in
// gemv_compute).
template <bool F8, bool NORM, int NG, int STEPS>
__device__ __forceinline__ void gemv_load_x(const GemvLane& L, int s,
                                            uint4 (&X1)[STEPS][GemvK<F8>::XP],
                                            const bool (&in)[STEPS]) {
#pragma unroll
    for (int u = 0; u < STEPS; u++) {
        const int o = in[u] ? (s + u) * GemvK<F8>::STEP : 0;
        if (NG == 1) {
#pragma unroll
            for (int i = 0; i < GemvK<F8>::XP; i++)
                X1[u][i] = gemv_x_piece<NORM>(L, L.g, o + 8 * i, L.g < L.n);
        }
    }
}

// The products of a loaded batch, step after step, into d.
template <bool F8, bool NORM, int NG, int STEPS>
__device__ __forceinline__ void gemv_compute(const GemvLane& L, int s, const uint4 (&P)[STEPS],
                                             const uint4 (&Q)[STEPS],
                                             const uint4 (&X1)[STEPS][GemvK<F8>::XP],
                                             const bool (&in)[STEPS], float (&d)[NG][4]) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int u = 0; u < STEPS; u++) {
        const int o = in[u] ? (s + u) * GemvK<F8>::STEP : 0;
#pragma unroll
        for (int i = 0; i < GemvK<F8>::XP; i++) {
            // The 8 values of piece i of the lane's W rows (e4m3: bytes 8i..8i+7, widened).
            uint4 p = P[u], q = Q[u];
            if (F8) {
                p = e4m3x8_widen(i == 0 ? make_uint2(P[u].x, P[u].y) : make_uint2(P[u].z, P[u].w));
                q = e4m3x8_widen(i == 0 ? make_uint2(Q[u].x, Q[u].y) : make_uint2(Q[u].z, Q[u].w));
            }
            if (!(in[u] && L.ok_a)) p = zero;
            if (!(in[u] && L.ok_b)) q = zero;
#pragma unroll
            for (int j = 0; j < NG; j++) {
                const int t = 8 * j + L.g;
                uint4 xv = NG == 1 ? X1[u][i] : gemv_x_piece<NORM>(L, t, o + 8 * i, t < L.n);
                if (!(in[u] && t < L.n)) xv = zero;
                // A registers: (row g, slots 2c..), (row g+8, 2c..), (row g, 2c+8..), (row g+8,
                // 2c+8..); B: (slots 2c.., token 8j+g), (2c+8.., token 8j+g).
                gemv_mma(d[j], p.x, q.x, p.y, q.y, xv.x, xv.y);
                gemv_mma(d[j], p.z, q.z, p.w, q.w, xv.z, xv.w);
            }
        }
    }
}

template <bool F8, bool GLU, bool NORM, bool ROPE, int NG, bool LORA>
__device__ __forceinline__ void gemv_body(const void* __restrict__ w, const bf16* __restrict__ x,
                                          const float* __restrict__ xf,
                                          const float* __restrict__ nw, float eps,
                                          void* __restrict__ y, int m, int n, int k, float beta,
                                          int y_f32, int wpt, const GemvRope& rope, int krot,
                                          const float* __restrict__ ws, int ws_stride,
                                          const LoraUpdate& lora) {
    constexpr int ESZ = F8 ? 1 : 2;  // bytes per value of W
    // k-steps of 32 per batch of loads: each lane has 2 x STEPS pieces of W in flight. With the
    // minimum of one block per multiprocessor in __launch_bounds__, ptxas issues the whole
    // batch of loads before the first mma; without it, it interleaves them with the mmas and a
    // warp has only one step's loads in flight. 4 rather than 8: at every Llama-3-8B shape the
    // plain products ran 9-22% faster (fewer registers, more warps resident: CUDA_NOTES v5).
    // The fp8 kernels' steps cover twice the k (16 e4m3 values per 16-byte piece).
    constexpr int STEPS = F8 ? GEMV_F8_STEPS : 4;
    constexpr int XP = GemvK<F8>::XP;
    __shared__ float4 red[GEMV_WARPS][NG][32];
    __shared__ float inv_s[8 * NG];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int wpb = blockDim.x >> 5;  // warps per block
    const int tpb = wpb / wpt;        // tiles per block
    const int tile = blockIdx.x * tpb + warp / wpt;
    const int kw = warp % wpt;        // this warp's part of k

    // The tile's A rows: g and g + 8.
    int row_a, row_b;
    if (GLU) {
        row_a = tile * 8 + g;
        row_b = m + row_a;
    } else {
        row_a = tile * 16 + g;
        row_b = row_a + 8;
    }
    const bool ok_a = row_a < m;
    const bool ok_b = GLU ? ok_a : row_b < m;

    const int steps = (k + GemvK<F8>::STEP - 1) / GemvK<F8>::STEP;
    const int per = (steps + wpt - 1) / wpt;
    const int s_begin = kw * per;
    const int s_end = min(steps, s_begin + per);
    const int kc = GemvK<F8>::PER_LANE * c;
    const char* wa = reinterpret_cast<const char*>(w) + ESZ * ((u64)(ok_a ? row_a : 0) * k + kc);
    const char* wb = reinterpret_cast<const char*>(w) + ESZ * ((u64)(ok_b ? row_b : 0) * k + kc);
    // The warp's batches of STEPS k-steps, visited from batch b0 on (wrapping). With krot > 0
    // (the host passes it for steps of at most 8 tokens of large models, see
    // Gpu::gemv_rotate; only the one-group kernels take it) each block starts at its own
    // batch, (block index x krot) mod the batches, so the blocks running together read
    // different offsets of their rows instead of all streaming in step: Llama-3-8B batch 1
    // 0.03-0.06 ms faster per step (CUDA_NOTES v8). The order of k depends only on the shape,
    // the block and krot, never on n within a group.
    const int nbatch = s_end > s_begin ? (s_end - s_begin + STEPS - 1) / STEPS : 0;
    const bool rotate = NG == 1 && krot > 0 && nbatch > 1;
    const int b0 = rotate ? (int)((blockIdx.x * (u32)krot) % (u32)nbatch) : 0;

    // Weights do not depend on earlier kernels: with programmatic dependent launch this block
    // may start while the previous kernel still runs, so it asks for the first GEMV_PF_STEPS
    // k-steps (from where it starts) of its W rows (a 128-byte line per two steps) in L2
    // before waiting for that kernel, and lets the next kernel in only after the wait (see
    // PDL_ENTER in llama.cu).
    if (c == 0) {
#pragma unroll 4
        for (int u = 0; u < GEMV_PF_STEPS; u += 2) {
            if (s_begin + STEPS * b0 + u >= s_end) break;
            const int off = ESZ * (s_begin + STEPS * b0 + u) * GemvK<F8>::STEP;
            if (ok_a) asm volatile("prefetch.global.L2 [%0];" ::"l"(wa + off));
            if (ok_b) asm volatile("prefetch.global.L2 [%0];" ::"l"(wb + off));
        }
    }
    const GemvLane L{wa, wb, x, xf, nw, inv_s, n, k, kc, g, ok_a, ok_b, s_end};
    // The first batch's W pieces (in the block's order) are asked for before the wait too, so
    // they are on their way while the block waits and, with the norm prologue, while it
    // reduces (one token group only: the larger kernels would hold the registers in every
    // batch, for steps whose products are long enough to hide the start).
    constexpr bool EARLY = NG == 1 && (NORM ? GEMV_W_EARLY_NORM : GEMV_W_EARLY);
    const bool early = EARLY && nbatch > 0;
    uint4 PE[STEPS], QE[STEPS];
    bool inE[STEPS];
    if (early) gemv_load_w<F8, STEPS>(L, s_begin + STEPS * b0, PE, QE, inE);
    // LoRA: each token's B of each part, and its rank (one token group: n <= 8).
    __shared__ const bf16* lora_bs[LORA ? 8 : 1][3];
    __shared__ int lora_rs[LORA ? 8 : 1][3];
    if constexpr (LORA) {
        static_assert(NG == 1, "the LoRA epilogue takes one token group");
        if (threadIdx.x < 24) {
            const int t = threadIdx.x / 3, i = threadIdx.x % 3;
            int r = 0;
            lora_bs[t][i] = t < n ? lora_b(lora, t, i, r) : nullptr;
            lora_rs[t][i] = r;
        }
    }
    pdl_wait();
    pdl_trigger();

    if constexpr (NORM) {
        // The inverse RMS of each token, one warp per token. When the n rows fit, the block
        // first stages them in shared memory (one trip to memory; warp_sumsq then reads them
        // there, the same sums in the same order) instead of each warp making four dependent
        // trips for its row.
        __shared__ __align__(16) float xs[NORM_STAGE_ALLOC];
        const bool staged = (k & 3) == 0 && n * k <= NORM_STAGE_FLOATS;
        if (staged) {
            stage_floats<4>(xf, xs, n * k);
            __syncthreads();
        }
        for (int t = warp; t < n; t += wpb) {
            const float ss = warp_sumsq((staged ? xs : xf) + (u64)t * k, k, lane);
            if (lane == 0) inv_s[t] = rms_inv(ss, k, eps);
        }
        __syncthreads();
    }

    float d[NG][4];
#pragma unroll
    for (int j = 0; j < NG; j++) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.f;
    auto batch = [&](int s) {
        // Every W load of the batch is issued before the first mma.
        uint4 P[STEPS], Q[STEPS];  // W rows g, g + 8
        uint4 X1[STEPS][XP];       // x token g (NG == 1)
        bool in[STEPS];
        gemv_load_w<F8, STEPS>(L, s, P, Q, in);
        gemv_load_x<F8, NORM, NG, STEPS>(L, s, X1, in);
        gemv_compute<F8, NORM, NG, STEPS>(L, s, P, Q, X1, in, d);
    };
    // From batch b0 (the early one) to the end of the range, then from its start to b0.
    if (early) {
        uint4 X1[STEPS][XP];
        gemv_load_x<F8, NORM, NG, STEPS>(L, s_begin + STEPS * b0, X1, inE);
        gemv_compute<F8, NORM, NG, STEPS>(L, s_begin + STEPS * b0, PE, QE, X1, inE, d);
    }
    // The first loop starts past s_end when b0 is the last batch, and the second starts at
    // s_begin. Both bounds are kept in their general form (n_early and max() below): ptxas
    // schedules the loops differently with the simplified ones, which measured 0.01 ms slower
    // at Llama batch 1 (CUDA_NOTES v11).
    const int n_early = min(EARLY ? 1 : 0, nbatch);
    const int s_rot = s_begin + STEPS * b0;
    for (int s = s_begin + STEPS * (b0 + n_early); s < s_end; s += STEPS) batch(s);
    for (int s = s_begin + STEPS * max(0, b0 + n_early - nbatch); s < s_rot; s += STEPS) batch(s);

    // d[j]: (row g, tokens 8j + 2c, 8j + 2c + 1), (row g + 8, same tokens).
#pragma unroll
    for (int j = 0; j < NG; j++) red[warp][j][lane] = make_float4(d[j][0], d[j][1], d[j][2], d[j][3]);
    __syncthreads();
    // One output pair per item: (tile of the block, token group, lane of the fragment, which
    // of its two tokens); the tile's warps are summed in order.
    // Adds the LoRA update of output column col of token t to v.
    auto lora_out = [&](int t, int col, float& v) {
        int o;
        const int i = lora_part(lora, col, o);
        if (i >= 0) lora_dot(lora, lora_bs[t][i], lora_rs[t][i], t, i, o, v);
    };
    const int items = tpb * NG * 64;
    for (int idx = threadIdx.x; idx < items; idx += blockDim.x) {
        const int tl = idx / (NG * 64), rem = idx % (NG * 64);
        const int j = rem >> 6, L = (rem & 63) >> 1, h = rem & 1;
        float r0 = 0.f, r1 = 0.f;
        for (int q = 0; q < wpt; q++) {
            const float4 v = red[tl * wpt + q][j][L];
            r0 = __fadd_rn(r0, h ? v.y : v.x);
            r1 = __fadd_rn(r1, h ? v.w : v.z);
        }
        const int gg = L >> 2, t = 8 * j + 2 * (L & 3) + h;
        const int tile_o = blockIdx.x * tpb + tl;
        if (t >= n) continue;
        if (GLU) {
            const int r = tile_o * 8 + gg;
            if (r < m) {
                if (F8) {
                    r0 = r0 * GEMV_F8_UNSCALE * ws[(u64)r * ws_stride];
                    r1 = r1 * GEMV_F8_UNSCALE * ws[(u64)(m + r) * ws_stride];
                }
                float gv = __bfloat162float(__float2bfloat16(r0));
                float uv = __bfloat162float(__float2bfloat16(r1));
                if (LORA) {
                    lora_out(t, r, gv);
                    lora_out(t, m + r, uv);
                }
                reinterpret_cast<bf16*>(y)[(u64)t * m + r] = __float2bfloat16(silu_times(gv, uv));
            }
            continue;
        }
        const int ra = tile_o * 16 + gg, rb = ra + 8;
        if (F8) {
            if (ra < m) r0 = r0 * GEMV_F8_UNSCALE * ws[(u64)ra * ws_stride];
            if (rb < m) r1 = r1 * GEMV_F8_UNSCALE * ws[(u64)rb * ws_stride];
        }
        if (ROPE) {
            if (ra < m) {
                if (LORA) {
                    lora_out(t, ra, r0);
                    lora_out(t, rb, r1);
                }
                gemv_rope_out(rope, t, ra, r0, r1);
            }
            continue;
        }
        if (y_f32) {
            float* yo = reinterpret_cast<float*>(y) + (u64)t * m;
            if (ra < m) {
                float v = beta != 0.f ? __fmaf_rn(beta, yo[ra], r0) : r0;
                if (LORA) lora_out(t, ra, v);
                yo[ra] = v;
            }
            if (rb < m) {
                float v = beta != 0.f ? __fmaf_rn(beta, yo[rb], r1) : r1;
                if (LORA) lora_out(t, rb, v);
                yo[rb] = v;
            }
        } else {
            bf16* yo = reinterpret_cast<bf16*>(y) + (u64)t * m;
            if (ra < m)
                yo[ra] = __float2bfloat16(
                    beta != 0.f ? __fmaf_rn(beta, __bfloat162float(yo[ra]), r0) : r0);
            if (rb < m)
                yo[rb] = __float2bfloat16(
                    beta != 0.f ? __fmaf_rn(beta, __bfloat162float(yo[rb]), r1) : r1);
        }
    }
}

// Grid: ceil(tiles / (wpb / wpt)) blocks of 32 wpb threads (wpb <= GEMV_WARPS, wpt dividing
// wpb), tiles = ceil(m / 16)
// (gemv, gemv_norm) or ceil(m / 8) (the glu variants, m = rows of act). Unused pointers may be
// null.
#define GEMV_PARAMS                                                                              \
    const void *w, const bf16 *x, const float *xf, const float *nw, float eps, void *y, int m,     \
        int n, int k, float beta, int y_f32, int wpt, bf16 *rope_q, bf16 *rope_kc, bf16 *rope_vc, \
        const int *rope_pos, const long long *rope_slots, const float *rope_freq, int rope_nh,    \
        int rope_nkv, int rope_hd, int rope_interleaved, int krot, const float *ws, int ws_stride
#define GEMV_ROPE_ARG                                                                  \
    GemvRope {                                                                         \
        rope_q, rope_kc, rope_vc, rope_pos, rope_slots, rope_freq, rope_nh, rope_nkv, \
            rope_hd, rope_interleaved                                                  \
    }
#define GEMV_KERNEL(NAME, F8, GLU, NORM, ROPE, NG, MINB)                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB)                        \
        NAME##_##NG(GEMV_PARAMS) {                                                             \
        gemv_body<F8, GLU, NORM, ROPE, NG, false>(w, x, xf, nw, eps, y, m, n, k, beta, y_f32, \
                                                  wpt, GEMV_ROPE_ARG, krot, ws, ws_stride,    \
                                                  LoraUpdate{});                              \
    }
// The *_lora variants: the same arguments, then LoraUpdate's fields.
#define GEMV_LORA_KERNEL(NAME, GLU, NORM, ROPE, MINB)                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB) NAME##_lora(           \
        GEMV_PARAMS, const float* lora_u, int lora_u_stride, int lora_u_part,                   \
        const int* lora_row_slot, const u64* lora_ptrs, const int* lora_ranks, int lora_layers, \
        int lora_layer, int lora_t0, int lora_w0, int lora_t1, int lora_w1, int lora_t2,        \
        int lora_w2) {                                                                          \
        const LoraUpdate lora{lora_u,      lora_u_stride, lora_u_part, lora_row_slot,          \
                              lora_ptrs,   lora_ranks,    lora_layers, lora_layer,             \
                              lora_t0,     lora_w0,       lora_t1,     lora_w1,                \
                              lora_t2,     lora_w2};                                           \
        gemv_body<false, GLU, NORM, ROPE, 1, true>(w, x, xf, nw, eps, y, m, n, k, beta, y_f32, \
                                                   wpt, GEMV_ROPE_ARG, krot, ws, ws_stride,    \
                                                   lora);                                      \
    }

#define GEMV_VARIANTS(NG)                                   \
    GEMV_KERNEL(gemv, false, false, false, false, NG, 1)       \
    GEMV_KERNEL(gemv_glu, false, true, false, false, NG, 1)    \
    GEMV_KERNEL(gemv_rope, false, false, false, true, NG, 1)   \
    GEMV_KERNEL(gemv_f8, true, false, false, false, NG, 1)     \
    GEMV_KERNEL(gemv_glu_f8, true, true, false, false, NG, 1)  \
    GEMV_KERNEL(gemv_rope_f8, true, false, false, true, NG, 1)

GEMV_VARIANTS(1)
GEMV_VARIANTS(2)
GEMV_VARIANTS(4)
GEMV_VARIANTS(8)
// The norm prologue re-reads the residual rows in every block: only for steps of at most 8
// tokens (and, by default, small hidden sizes: see gpu/src/cuda/device.rs).
// (At most 128 registers, so that 2 blocks fit per SM: the batch of loads stays whole.)
GEMV_KERNEL(gemv_norm, false, false, true, false, 1, 2)
GEMV_KERNEL(gemv_norm_glu, false, true, true, false, 1, 2)
GEMV_KERNEL(gemv_norm_rope, false, false, true, true, 1, 2)
GEMV_KERNEL(gemv_norm_f8, true, false, true, false, 1, 2)
GEMV_KERNEL(gemv_norm_glu_f8, true, true, true, false, 1, 2)
GEMV_KERNEL(gemv_norm_rope_f8, true, false, true, true, 1, 2)
// LoRA steps of at most 8 tokens on bf16 weights (see *_lora above).
GEMV_LORA_KERNEL(gemv, false, false, false, 1)
GEMV_LORA_KERNEL(gemv_glu, true, false, false, 1)
GEMV_LORA_KERNEL(gemv_rope, false, false, true, 1)
GEMV_LORA_KERNEL(gemv_norm, false, true, false, 2)
GEMV_LORA_KERNEL(gemv_norm_glu, true, true, false, 2)
GEMV_LORA_KERNEL(gemv_norm_rope, false, true, true, 2)
