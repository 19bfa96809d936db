// Does the link carry more than the copy engine's rate
// when a kernel's writes and the copy engine share it? Each GPU sends 256 MiB
// to its peer, both at once; a fraction f goes by cudaMemcpyPeerAsync on one
// stream while a kernel (st.global.v4, 2 KiB a warp, as linkbw.cu's `st`)
// stores the rest from another stream, the two concurrent. f = 0: the kernel
// alone; f = 1: the copy engine alone. Build: nvcc -O3 -arch=sm_90.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e = (x);                                                                       \
        if (e != cudaSuccess) {                                                                    \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            std::exit(1);                                                                          \
        }                                                                                          \
    } while (0)

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

struct Side {
    int dev;
    char *src, *dst;
    cudaStream_t ce, sm;
    cudaEvent_t start, sm_done, end;
};

int main() {
    const size_t bytes = 256ull << 20;
    std::vector<Side> s(2);
    for (int d = 0; d < 2; ++d) {
        CK(cudaSetDevice(d));
        CK(cudaDeviceEnablePeerAccess(1 - d, 0));
        s[d].dev = d;
        CK(cudaMalloc(&s[d].src, bytes));
        CK(cudaMemset(s[d].src, 0x11 * (d + 1), bytes));
        CK(cudaStreamCreateWithFlags(&s[d].ce, cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&s[d].sm, cudaStreamNonBlocking));
        CK(cudaEventCreate(&s[d].start));
        CK(cudaEventCreate(&s[d].sm_done));
        CK(cudaEventCreate(&s[d].end));
    }
    for (int d = 0; d < 2; ++d) {
        CK(cudaSetDevice(1 - d));
        CK(cudaMalloc(&s[d].dst, bytes));
    }
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    std::printf("# %s, %zu MiB each way, both GPUs sending; GB/s of the slower GPU, median of 10 after 2 warm-ups\n",
                p.name, bytes >> 20);
    std::printf("%6s %6s %9s\n", "f(ce)", "grid", "both");
    const double fs[] = {0.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.3};
    const int grids[] = {128, 64, 32, 16};
    for (double f : fs) {
        for (int grid : grids) {
            if (f == 1.0 && grid != 128) continue;
            const size_t ce_bytes = (size_t)(f * (bytes / 2048)) * 2048, sm_bytes = bytes - ce_bytes;
            std::vector<double> rates;
            for (int rep = 0; rep < 12; ++rep) {
                for (int d = 0; d < 2; ++d) {
                    CK(cudaSetDevice(d));
                    CK(cudaDeviceSynchronize());
                }
                for (int d = 0; d < 2; ++d) {
                    CK(cudaSetDevice(d));
                    CK(cudaEventRecord(s[d].start, s[d].ce));
                    CK(cudaStreamWaitEvent(s[d].sm, s[d].start, 0));
                    if (sm_bytes)
                        put_st<<<grid, 512, 0, s[d].sm>>>((const int4*)(s[d].src + ce_bytes), (int4*)(s[d].dst + ce_bytes),
                                                          sm_bytes / 2048);
                    CK(cudaGetLastError());
                    if (ce_bytes) CK(cudaMemcpyPeerAsync(s[d].dst, 1 - d, s[d].src, d, ce_bytes, s[d].ce));
                    CK(cudaEventRecord(s[d].sm_done, s[d].sm));
                    CK(cudaStreamWaitEvent(s[d].ce, s[d].sm_done, 0));
                    CK(cudaEventRecord(s[d].end, s[d].ce));
                }
                float worst = 0;
                for (int d = 0; d < 2; ++d) {
                    CK(cudaEventSynchronize(s[d].end));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, s[d].start, s[d].end));
                    worst = std::max(worst, ms);
                }
                if (rep >= 2) rates.push_back(bytes / (worst * 1e-3) / 1e9);
            }
            std::sort(rates.begin(), rates.end());
            std::printf("%6.1f %6d %9.1f\n", f, f == 1.0 ? 0 : grid, rates[rates.size() / 2]);
            std::fflush(stdout);
        }
    }
    // Every byte of the last mix arrived.
    for (int d = 0; d < 2; ++d) {
        std::vector<unsigned char> h(bytes);
        CK(cudaSetDevice(1 - d));
        CK(cudaMemcpy(h.data(), s[d].dst, bytes, cudaMemcpyDeviceToHost));
        size_t bad = 0;
        for (unsigned char x : h) bad += x != (unsigned char)(0x11 * (d + 1));
        std::printf("# check GPU %d -> %d: %zu bad bytes of %zu\n", d, 1 - d, bad, bytes);
    }
    return 0;
}
