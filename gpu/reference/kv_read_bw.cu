// Read bandwidth of decode attention's access pattern on the GPU, without the attention maths:
// is the offline run's decode attention (CUDA_NOTES v11: ~76% of the copy rate) held back by
// the pattern itself or by the kernel?
//
// The cache is laid out as the backend's ([slots, kv_heads, head_dim] bf16, keys and values
// apart, slot = block * 16 + offset, blocks dealt out at random); each (sequence, KV head) reads
// its first `keys` keys and values, 256-byte rows 2 KB apart at Llama-3-8B's shape, as the
// attention kernel's blocks do. Variants:
//   contig        one pass over the whole key and value caches, contiguously (the read ceiling)
//   ld_w1         16-byte loads, one warp per (sequence, KV head), occupancy as the hardware
//                 allows (no shared memory)
//   ld_w1_occ6    the same, with 34,816 bytes of shared memory per block: 6 blocks per SM, as
//                 the attention kernel at head dim 128
//   ld_w4         four warps per (sequence, KV head)
//   cp_w1_occ6    cp.async of 64-key chunks (keys, then values) into shared memory, one chunk
//                 of each in flight, 6 blocks per SM: the attention kernel's copies alone
//   cp2_w1_occ6   the same with the next chunk's keys asked for before this chunk's values
//                 are waited on (the kernel's order: one buffer ahead)
// usage: nvcc -O2 -std=c++17 -arch=sm_90a kv_read_bw.cu -o kv_read_bw && ./kv_read_bw [seqs keys]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e = (x);                                                           \
        if (e != cudaSuccess) {                                                        \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));   \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

constexpr int HD = 128, NKV = 8, BS = 16, ROW = HD * 2 / 16;  // uint4 pieces per row
constexpr int SLOTS_PER_SEQ = 256, CHUNK = 64, LD = HD + 8;

__device__ __forceinline__ uint4 ld_nc(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__global__ void contig(const uint4* p, size_t n, unsigned* out) {
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = ld_nc(p + i);
        acc ^= v.x ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

// One block per (sequence, KV head); 16 lanes per row, so a warp reads 2 keys per load.
template <int WARPS>
__global__ void ld_pattern(const uint4* kc, const uint4* vc, const int* tables, int keys,
                           unsigned* out) {
    extern __shared__ char occupancy_only[];
    const int seq = blockIdx.x, kvh = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned acc = 0;
#pragma unroll 8
    for (int key = warp * 2 + lane / 16; key < keys; key += WARPS * 2) {
        const long long slot = (long long)tables[seq * (SLOTS_PER_SEQ / BS) + key / BS] * BS + key % BS;
        const long long off = (slot * NKV + kvh) * ROW + lane % 16;
        const uint4 a = ld_nc(kc + off), b = ld_nc(vc + off);
        acc ^= a.x ^ b.y;
    }
    if (acc == 0x9e3779b9u) out[0] = acc + occupancy_only[0];
}

__device__ __forceinline__ void cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                     (unsigned)__cvta_generic_to_shared(dst)),
                 "l"(src)
                 : "memory");
}

// The attention kernel's copies without its maths: 64-key chunks of keys and values into
// shared memory through cp.async, one warp per (sequence, KV head). AHEAD: the next chunk's
// keys are asked for before this chunk's values are waited on.
template <bool AHEAD>
__global__ void cp_pattern(const uint4* kc, const uint4* vc, const int* tables, int keys,
                           unsigned* out) {
    __shared__ __align__(16) unsigned short k_s[CHUNK * LD];
    __shared__ __align__(16) unsigned short v_s[CHUNK * LD];
    const int seq = blockIdx.x, kvh = blockIdx.y, lane = threadIdx.x;
    auto chunk = [&](unsigned short* dst, const uint4* src, int kb) {
        for (int u = 0; u < CHUNK / 2; u++) {
            const int key = kb + 2 * u + lane / 16;
            if (key >= keys) break;
            const long long slot =
                (long long)tables[seq * (SLOTS_PER_SEQ / BS) + key / BS] * BS + key % BS;
            cp16(dst + (key - kb) * LD + (lane % 16) * 8, src + (slot * NKV + kvh) * ROW + lane % 16);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    unsigned acc = 0;
    chunk(k_s, kc, 0);
    chunk(v_s, vc, 0);
    for (int kb = 0; kb < keys; kb += CHUNK) {
        const bool more = kb + CHUNK < keys;
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncwarp();
        acc ^= k_s[lane * 4];
        __syncwarp();
        if (AHEAD && more) chunk(k_s, kc, kb + CHUNK);
        if (AHEAD && more)
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        else
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncwarp();
        acc ^= v_s[lane * 4];
        __syncwarp();
        if (more) {
            if (!AHEAD) chunk(k_s, kc, kb + CHUNK);
            chunk(v_s, vc, kb + CHUNK);
        }
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

template <typename F>
float time_ms(F f) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    f();
    CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int r = 0; r < 15; r++) {
        CK(cudaEventRecord(a));
        f();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main(int argc, char** argv) {
    const int seqs = argc > 1 ? atoi(argv[1]) : 2000;
    const int keys = argc > 2 ? atoi(argv[2]) : 192;
    if (seqs < 1 || seqs > 65535 || keys < 1 || keys > SLOTS_PER_SEQ) {
        printf("seqs 1..65535, keys 1..%d\n", SLOTS_PER_SEQ);
        return 2;
    }
    const int nblocks = seqs * SLOTS_PER_SEQ / BS;
    const size_t elems = (size_t)nblocks * BS * NKV * ROW;  // uint4 per tensor
    std::vector<int> perm(nblocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
    uint4 *kc, *vc;
    int* tables;
    unsigned* out;
    CK(cudaMalloc(&kc, elems * 16));
    CK(cudaMalloc(&vc, elems * 16));
    CK(cudaMalloc(&tables, nblocks * sizeof(int)));
    CK(cudaMalloc(&out, 4));
    CK(cudaMemset(kc, 0x3c, elems * 16));
    CK(cudaMemset(vc, 0x5a, elems * 16));
    CK(cudaMemcpy(tables, perm.data(), nblocks * sizeof(int), cudaMemcpyHostToDevice));
    const double bytes = 2.0 * seqs * NKV * keys * HD * 2;  // keys and values read
    const int occ6 = 34816;
    CK(cudaFuncSetAttribute(ld_pattern<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, occ6));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const dim3 grid(seqs, NKV);
    printf("%d sequences x %d KV heads x %d keys: %.3f GB of keys and values per pass\n", seqs,
           NKV, keys, bytes / 1e9);
    auto report = [&](const char* name, double b, float ms) {
        printf("%-12s %8.1f us  %6.3f TB/s\n", name, ms * 1e3, b / (ms * 1e-3) / 1e12);
    };
    report("contig", 2.0 * elems * 16, time_ms([&] {
               contig<<<sms * 8, 512>>>(kc, elems, out);
               contig<<<sms * 8, 512>>>(vc, elems, out);
           }));
    report("ld_w1", bytes, time_ms([&] { ld_pattern<1><<<grid, 32>>>(kc, vc, tables, keys, out); }));
    report("ld_w1_occ6", bytes,
           time_ms([&] { ld_pattern<1><<<grid, 32, occ6>>>(kc, vc, tables, keys, out); }));
    report("ld_w4", bytes, time_ms([&] { ld_pattern<4><<<grid, 128>>>(kc, vc, tables, keys, out); }));
    report("cp_w1_occ6", bytes,
           time_ms([&] { cp_pattern<false><<<grid, 32>>>(kc, vc, tables, keys, out); }));
    report("cp2_w1_occ6", bytes,
           time_ms([&] { cp_pattern<true><<<grid, 32>>>(kc, vc, tables, keys, out); }));
    return 0;
}
