// The rate of one GPU's writes into its peer over NVLink,
// by three engines, each GPU sending to the other at once (as the EP pair
// does) and one way:
// - st:  a warp loads 2 KiB (4 x 16 bytes a lane) and stores it to the peer
//        with st.global.v4, as the EP kernels and the device API's put do;
// - tma: a warp's lane 0 moves `chunk` bytes with cp.async.bulk, global ->
//        shared (mbarrier) then shared -> the peer's global, two stages a warp;
// - ce:  cudaMemcpyPeerAsync (the copy engine).
// Build: nvcc -O3 -arch=sm_90 -o linkbw linkbw.cu
#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e = (x);                                                               \
        if (e != cudaSuccess) {                                                            \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            std::exit(1);                                                                  \
        }                                                                                  \
    } while (0)
#endif

__global__ void put_st(const int4* __restrict__ src, int4* dst, size_t pieces) {
    const unsigned lane = threadIdx.x & 31u;
    const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
    const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
    for (size_t p = warp; p < pieces; p += warps) {
        int4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = src[p * 128 + k * 32 + lane];
#pragma unroll
        for (int k = 0; k < 4; ++k) dst[p * 128 + k * 32 + lane] = v[k];
    }
}

__device__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__global__ void put_tma(const char* src, char* dst, size_t chunks, unsigned chunk) {
    extern __shared__ __align__(128) char stage[];
    __shared__ __align__(8) unsigned long long bar[32][2];
    const unsigned lane = threadIdx.x & 31u, wib = threadIdx.x >> 5;
    const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
    const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
    if (lane != 0) return;
    for (int s = 0; s < 2; ++s)
        asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_u32(&bar[wib][s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    unsigned i = 0;
    for (size_t c = warp; c < chunks; c += warps, ++i) {
        const unsigned s = i & 1u, phase = (i >> 1) & 1u;
        char* buf = stage + ((size_t)wib * 2 + s) * chunk;
        const unsigned b = smem_u32(&bar[wib][s]);
        // The store that last read this stage (two chunks ago) is done reading.
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(b), "r"(chunk) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         smem_u32(buf)),
                     "l"(src + c * chunk), "r"(chunk), "r"(b)
                     : "memory");
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done)
                         : "r"(b), "r"(phase)
                         : "memory");
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * chunk), "r"(smem_u32(buf)),
                     "r"(chunk)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

#ifndef __CUDACC_RTC__
struct Side {
    int dev;
    char *src, *dst; // src on dev, dst on the peer
    cudaStream_t st;
    cudaEvent_t a, b;
};

enum Kind { ST, TMA, CE };

static void launch(const Side& s, Kind k, size_t bytes, int grid, int threads, unsigned chunk) {
    CK(cudaSetDevice(s.dev));
    if (k == ST) {
        put_st<<<grid, threads, 0, s.st>>>((const int4*)s.src, (int4*)s.dst, bytes / 2048);
    } else if (k == TMA) {
        const size_t smem = (size_t)(threads / 32) * 2 * chunk;
        put_tma<<<grid, threads, smem, s.st>>>(s.src, s.dst, bytes / chunk, chunk);
    } else {
        CK(cudaMemcpyPeerAsync(s.dst, 1 - s.dev, s.src, s.dev, bytes, s.st));
    }
    CK(cudaGetLastError());
}

// GB/s of the slower side, median over reps; both = each GPU sends at once.
static double measure(std::vector<Side>& sides, bool both, Kind k, size_t bytes, int grid, int threads, unsigned chunk) {
    const int n = both ? 2 : 1;
    std::vector<double> rates;
    for (int rep = 0; rep < 12; ++rep) {
        for (int i = 0; i < 2; ++i) {
            CK(cudaSetDevice(i));
            CK(cudaDeviceSynchronize());
        }
        for (int i = 0; i < n; ++i) {
            CK(cudaSetDevice(sides[i].dev));
            CK(cudaEventRecord(sides[i].a, sides[i].st));
        }
        for (int i = 0; i < n; ++i) launch(sides[i], k, bytes, grid, threads, chunk);
        for (int i = 0; i < n; ++i) {
            CK(cudaSetDevice(sides[i].dev));
            CK(cudaEventRecord(sides[i].b, sides[i].st));
        }
        float worst = 0;
        for (int i = 0; i < n; ++i) {
            CK(cudaEventSynchronize(sides[i].b));
            float ms;
            CK(cudaEventElapsedTime(&ms, sides[i].a, sides[i].b));
            worst = std::max(worst, ms);
        }
        if (rep >= 2) rates.push_back(bytes / (worst * 1e-3) / 1e9);
    }
    std::sort(rates.begin(), rates.end());
    return rates[rates.size() / 2];
}

int main() {
    const size_t bytes = 256ull << 20;
    std::vector<Side> sides(2);
    for (int d = 0; d < 2; ++d) {
        CK(cudaSetDevice(d));
        CK(cudaDeviceEnablePeerAccess(1 - d, 0));
        CK(cudaFuncSetAttribute(put_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    }
    for (int d = 0; d < 2; ++d) {
        CK(cudaSetDevice(d));
        sides[d].dev = d;
        CK(cudaMalloc(&sides[d].src, bytes));
        CK(cudaMemset(sides[d].src, 0x11 * (d + 1), bytes));
        CK(cudaStreamCreateWithFlags(&sides[d].st, cudaStreamNonBlocking));
        CK(cudaEventCreate(&sides[d].a));
        CK(cudaEventCreate(&sides[d].b));
    }
    for (int d = 0; d < 2; ++d) {
        CK(cudaSetDevice(1 - d));
        CK(cudaMalloc(&sides[d].dst, bytes)); // on the peer
    }
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    std::printf("# %s, %d SMs, %zu MiB each way, GB/s (median of 10 after 2 warm-ups; the slower GPU when both send)\n",
                p.name, p.multiProcessorCount, bytes >> 20);
    std::printf("%-5s %6s %7s %6s %9s %9s\n", "kind", "grid", "threads", "chunk", "one-way", "both");
    struct Cfg {
        Kind k;
        int grid, threads;
        unsigned chunk;
    };
    const int sms = p.multiProcessorCount;
    std::vector<Cfg> cfgs = {
        {CE, 0, 0, 0},           {ST, 64, 512, 0},        {ST, 128, 512, 0},       {ST, sms, 512, 0},
        {ST, 2 * sms, 512, 0},   {TMA, 32, 512, 4096},    {TMA, 64, 512, 4096},    {TMA, 128, 512, 4096},
        {TMA, sms, 512, 4096},   {TMA, 128, 256, 8192},   {TMA, sms, 256, 8192},   {TMA, 128, 128, 16384},
        {TMA, sms, 128, 16384},  {TMA, 128, 512, 2048},   {TMA, sms, 1024, 2048},  {CE, 0, 0, 0},
    };
    const char* names[] = {"st", "tma", "ce"};
    // Each engine's bytes arrive whole: the destination zeroed, one copy each way, every byte compared.
    for (Kind k : {ST, TMA}) {
        for (int d = 0; d < 2; ++d) {
            CK(cudaSetDevice(1 - d));
            CK(cudaMemset(sides[d].dst, 0, bytes));
            CK(cudaDeviceSynchronize());
        }
        for (int d = 0; d < 2; ++d) launch(sides[d], k, bytes, 128, k == TMA ? 256 : 512, 8192);
        for (int d = 0; d < 2; ++d) {
            CK(cudaSetDevice(d));
            CK(cudaDeviceSynchronize());
        }
        for (int d = 0; d < 2; ++d) {
            std::vector<unsigned char> h(bytes);
            CK(cudaSetDevice(1 - d));
            CK(cudaMemcpy(h.data(), sides[d].dst, bytes, cudaMemcpyDeviceToHost));
            size_t bad = 0;
            for (unsigned char x : h) bad += x != (unsigned char)(0x11 * (d + 1));
            std::printf("# check %s GPU %d -> %d: %zu bad bytes of %zu\n", names[k], d, 1 - d, bad, bytes);
        }
    }
    for (const Cfg& c : cfgs) {
        const double one = measure(sides, false, c.k, bytes, c.grid, c.threads, c.chunk);
        const double two = measure(sides, true, c.k, bytes, c.grid, c.threads, c.chunk);
        std::printf("%-5s %6d %7d %6u %9.1f %9.1f\n", names[c.k], c.grid, c.threads, c.chunk, one, two);
        std::fflush(stdout);
    }
    return 0;
}
#endif
