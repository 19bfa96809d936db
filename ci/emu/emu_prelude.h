// A host emulation of the device prelude (kernels-cuda/prelude.cuh), for
// running the protocol kernels of kernels-cuda/collectives.cu and the device
// API (kernels-cuda/device_api.cuh) on the CPU: every GPU thread is a
// std::thread, every rank's workspace or heap is plain memory. It checks the
// protocols' logic (chunks, pieces, flags, epochs, aux words, signals, in
// place, alignment), not the device memory model or float bit-exactness of
// f16/bf16 (the GPU runs check those). Every memory access of N bytes
// (element loads and stores, 16-byte vectors, volatile and atomic words, LL
// units) checks that its address is a multiple of N, as the GPU requires (it
// faults there: CUDA_ERROR_MISALIGNED_ADDRESS), and aborts naming the access
// and its call site. See ci/check-kernels-emu.sh.
#ifndef FC_PRELUDE_INCLUDED
#define FC_PRELUDE_INCLUDED

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <source_location>
#include <thread>
#include <vector>

typedef unsigned char fc_u8;
typedef unsigned short fc_u16;
typedef unsigned int fc_u32;
typedef int fc_i32;
typedef unsigned long long fc_u64;
typedef long long fc_i64;

#define FC_MAX_RANKS 8u
#define FC_MAX_BLOCKS 128u
#define FC_ERR_WORDS 4u
#define FC_ERR_CODE_NONE 0u
#define FC_ERR_CODE_TIMEOUT 1u
#define FC_ERR_CODE_MISMATCH 2u
#define FC_DTYPE_F32 0
#define FC_DTYPE_F16 1
#define FC_DTYPE_BF16 2
#define FC_DTYPE_I32 3
#define FC_OP_SUM 0
#define FC_OP_PROD 1
#define FC_OP_MIN 2
#define FC_OP_MAX 3
#define FC_OP_AVG 4
#define FC_OP_BAND 5
#define FC_OP_BOR 6
#define FC_OP_BXOR 7
#define FC_OP_PREMUL 8
#define FC_PARAM_SCALAR_IS_PTR 1u
#define FC_PARAM_DIRECT_OK 2u

// A copy of `KernelParams` in src/device/params.rs: tests/kernels_emu.rs
// asserts every field's offset and size against it (src/device/abi.rs).
struct FcParams {
    fc_u64 peer_ws[FC_MAX_RANKS];
    fc_u64 input;
    fc_u64 output;
    fc_u64 error_flags;
    fc_u64 count;
    fc_u64 fingerprint;
    fc_u64 timeout_ns;
    fc_u64 fp_offset;
    fc_u64 flags_offset;
    fc_u64 data_offset;
    fc_u64 slot_bytes;
    fc_u32 rank;
    fc_u32 world;
    fc_u32 dtype;
    fc_u32 op;
    fc_u32 root;
    fc_u32 aux;
    fc_u64 scalar;
    fc_u64 table;
    fc_u32 peer;
    fc_u32 flags;
    fc_u64 per_peer[4][FC_MAX_RANKS];
};
static_assert(sizeof(FcParams) == 448, "FcParams must match KernelParams (448 bytes)");

#define FC_DEVICE static inline
// Kernels are plain functions here; the harness calls them once per thread.
#define FC_KERNEL_ARGS(name, ArgsType) extern "C" void name(const ArgsType a)

// Lanes per emulated warp: small, so a block of a few dozen threads has
// several warps (and a last, partial one when the block size is not a multiple).
#ifndef FC_EMU_WARP
#define FC_EMU_WARP 8
#endif

// ---- emulated geometry: set per std::thread by the harness ----
struct EmuBlock {
    std::barrier<> bar;
    std::atomic<int> orv[3];
    std::vector<std::unique_ptr<std::barrier<>>> warp; // one per FC_EMU_WARP threads
    explicit EmuBlock(int n) : bar(n) {
        for (auto& o : orv) o.store(0);
        for (int w = 0; w < n; w += FC_EMU_WARP) warp.emplace_back(new std::barrier<>(std::min(FC_EMU_WARP, n - w)));
    }
};
struct EmuThread {
    fc_u32 tid, ntid, bid, nbid;
    EmuBlock* block;
    unsigned calls; // barrier_or calls so far
    const char* label = nullptr; // the harness's name for the launch (messages only)
};
inline thread_local EmuThread emu;

FC_DEVICE fc_u32 fc_thread_id() { return emu.tid; }
FC_DEVICE fc_u32 fc_block_threads() { return emu.ntid; }
FC_DEVICE fc_u32 fc_block_id() { return emu.bid; }
FC_DEVICE fc_u32 fc_grid_blocks() { return emu.nbid; }
FC_DEVICE void fc_barrier() { emu.block->bar.arrive_and_wait(); }
// Slot k % 3 for call k; after the barrier thread 0 clears the slot of call
// k - 1 (every thread read it before this barrier; call k + 2 writes it next).
FC_DEVICE bool fc_barrier_or(bool pred) {
    const unsigned k = emu.calls++;
    if (pred) emu.block->orv[k % 3].store(1);
    emu.block->bar.arrive_and_wait();
    const bool r = emu.block->orv[k % 3].load() != 0;
    if (emu.tid == 0) emu.block->orv[(k + 2) % 3].store(0);
    return r;
}

FC_DEVICE fc_u32 fc_lane_id() { return emu.tid % FC_EMU_WARP; }
FC_DEVICE fc_u32 fc_warp_size() { return FC_EMU_WARP; }
FC_DEVICE void fc_warp_sync() { emu.block->warp[emu.tid / FC_EMU_WARP]->arrive_and_wait(); }

template <class T>
FC_DEVICE T* fc_ptr(fc_u64 addr) { return reinterpret_cast<T*>(addr); }

// ---- alignment: a GPU access of N bytes (N = 2, 4, 8, 16) must be N-byte
// aligned, or the kernel faults (misaligned address). Each access below
// checks it and, where it is not, prints a FAIL line naming the access, the
// address, the launch (where the harness names it), the emulated block and
// thread and the call site (file, line and function: in collectives.cu, say
// load_line<4>), then aborts as the launch would. One thread prints (the
// others wait for the abort). The line goes to stdout, where the harnesses
// print (and tests/kernels_emu.rs shows) their FAIL lines. ----
typedef std::source_location EmuSite;
[[noreturn, gnu::noinline, gnu::cold]] static void emu_misaligned(const char* access, unsigned long n, const void* p,
                                                                 const EmuSite& at) {
    static std::mutex one;
    one.lock(); // never unlocked: the first thread here reports, then aborts
    std::printf("FAIL misaligned %s: %lu bytes at %p (address %% %lu = %lu)%s%s, block %u thread %u, from %s:%u in "
                "%s: a GPU faults there (misaligned address)\n",
                access, n, p, n, (unsigned long)(reinterpret_cast<fc_u64>(p) % n), emu.label ? " in " : "",
                emu.label ? emu.label : "", emu.bid, emu.tid, at.file_name(), (unsigned)at.line(), at.function_name());
    std::fflush(stdout);
    std::abort();
}
FC_DEVICE void emu_aligned(const void* p, unsigned long n, const char* access, const EmuSite& at) {
    if (reinterpret_cast<fc_u64>(p) % n) emu_misaligned(access, n, p, at);
}
#define FC_EMU_SITE const EmuSite& at = EmuSite::current()

FC_DEVICE fc_u32 fc_ld_acquire_sys(const fc_u32* p, FC_EMU_SITE) {
    emu_aligned(p, 4, "fc_ld_acquire_sys", at);
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
FC_DEVICE void fc_st_release_sys(fc_u32* p, fc_u32 v, FC_EMU_SITE) {
    emu_aligned(p, 4, "fc_st_release_sys", at);
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
FC_DEVICE fc_u32 fc_ld_volatile(const fc_u32* p, FC_EMU_SITE) {
    emu_aligned(p, 4, "fc_ld_volatile", at);
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}
FC_DEVICE void fc_st_volatile(fc_u32* p, fc_u32 v, FC_EMU_SITE) {
    emu_aligned(p, 4, "fc_st_volatile", at);
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
FC_DEVICE fc_u64 fc_ld_volatile_u64(const fc_u64* p, FC_EMU_SITE) {
    emu_aligned(p, 8, "fc_ld_volatile_u64", at);
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}
FC_DEVICE void fc_st_volatile_u64(fc_u64* p, fc_u64 v, FC_EMU_SITE) {
    emu_aligned(p, 8, "fc_st_volatile_u64", at);
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
// LL units: ld/st.volatile.global.v2.u64 on the GPU, one 16-byte access.
FC_DEVICE void fc_ld_volatile_v2u64(const void* p, fc_u64& a, fc_u64& b, FC_EMU_SITE) {
    emu_aligned(p, 16, "fc_ld_volatile_v2u64 (LL unit)", at);
    a = __atomic_load_n(reinterpret_cast<const fc_u64*>(p), __ATOMIC_RELAXED);
    b = __atomic_load_n(reinterpret_cast<const fc_u64*>(p) + 1, __ATOMIC_RELAXED);
}
FC_DEVICE void fc_st_volatile_v2u64(void* p, fc_u64 a, fc_u64 b, FC_EMU_SITE) {
    emu_aligned(p, 16, "fc_st_volatile_v2u64 (LL unit)", at);
    __atomic_store_n(reinterpret_cast<fc_u64*>(p), a, __ATOMIC_RELAXED);
    __atomic_store_n(reinterpret_cast<fc_u64*>(p) + 1, b, __ATOMIC_RELAXED);
}
FC_DEVICE void fc_fence_sys() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
FC_DEVICE void fc_fence_gpu() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
FC_DEVICE fc_u32 fc_atomic_cas_sys(fc_u32* p, fc_u32 cmp, fc_u32 val, FC_EMU_SITE) {
    emu_aligned(p, 4, "fc_atomic_cas_sys", at);
    __atomic_compare_exchange_n(p, &cmp, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return cmp;
}
FC_DEVICE fc_u32 fc_atomic_or_sys(fc_u32* p, fc_u32 v, FC_EMU_SITE) {
    emu_aligned(p, 4, "fc_atomic_or_sys", at);
    return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
FC_DEVICE fc_u32 fc_atomic_exch_sys(fc_u32* p, fc_u32 v, FC_EMU_SITE) {
    emu_aligned(p, 4, "fc_atomic_exch_sys", at);
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
FC_DEVICE fc_u32 fc_atomic_add_gpu(fc_u32* p, fc_u32 v, FC_EMU_SITE) {
    emu_aligned(p, 4, "fc_atomic_add_gpu", at);
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
// 64-bit system-scope words. The atomics are seq_cst rather than relaxed
// plus the caller's fence: ThreadSanitizer does not model fences, so the
// ordering a GPU gets from fence + atomic has to sit on the atomic here.
FC_DEVICE fc_u64 fc_ld_acquire_sys_u64(const fc_u64* p, FC_EMU_SITE) {
    emu_aligned(p, 8, "fc_ld_acquire_sys_u64", at);
    return std::atomic_ref<fc_u64>(*const_cast<fc_u64*>(p)).load(std::memory_order_acquire);
}
FC_DEVICE void fc_st_release_sys_u64(fc_u64* p, fc_u64 v, FC_EMU_SITE) {
    emu_aligned(p, 8, "fc_st_release_sys_u64", at);
    std::atomic_ref<fc_u64>(*p).store(v, std::memory_order_release);
}
FC_DEVICE fc_u64 fc_atomic_add_sys_u64(fc_u64* p, fc_u64 v, FC_EMU_SITE) {
    emu_aligned(p, 8, "fc_atomic_add_sys_u64", at);
    return std::atomic_ref<fc_u64>(*p).fetch_add(v);
}
FC_DEVICE fc_u64 fc_atomic_cas_sys_u64(fc_u64* p, fc_u64 cmp, fc_u64 val, FC_EMU_SITE) {
    emu_aligned(p, 8, "fc_atomic_cas_sys_u64", at);
    std::atomic_ref<fc_u64>(*p).compare_exchange_strong(cmp, val);
    return cmp;
}
// Every wait of the protocols reads the timer once a poll. While a program
// sets emu_poll_yield (before it starts the threads), the poll also yields
// the CPU: with hundreds of emulated threads on a few cores, a waiter that
// spins out its timeslice keeps the threads it waits for from running, and
// a world of 8 takes many times as long. Off, waiters preempted only by the
// scheduler give other interleavings.
inline bool emu_poll_yield = false;
// The largest world a program's world loops run: FC_EMU_MAX_WORLD if set
// (`cargo test --test kernels_emu` sets 3 unless FERROCOMM_TEST_FULL=1: an
// even and an odd world, the threads of the larger ones being most of the
// run time), else every world.
inline int emu_max_world() {
    const char* v = std::getenv("FC_EMU_MAX_WORLD");
    return v && *v ? std::atoi(v) : 1 << 30;
}
FC_DEVICE fc_u64 fc_globaltimer_ns() {
    if (emu_poll_yield) std::this_thread::yield();
    return (fc_u64)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

struct fc_vec16 {
    fc_u32 w[4];
};
FC_DEVICE fc_vec16 fc_load16(const void* p, FC_EMU_SITE) {
    emu_aligned(p, 16, "fc_load16", at);
    fc_vec16 r;
    std::memcpy(&r, p, 16);
    return r;
}
FC_DEVICE void fc_store16(void* p, const fc_vec16& r, FC_EMU_SITE) {
    emu_aligned(p, 16, "fc_store16", at);
    std::memcpy(p, &r, 16);
}
template <class T>
FC_DEVICE T fc_load(const T* p, FC_EMU_SITE) {
    emu_aligned(p, sizeof(T), "fc_load (element)", at);
    return *p;
}
template <class T>
FC_DEVICE void fc_store(T* p, T v, FC_EMU_SITE) {
    emu_aligned(p, sizeof(T), "fc_store (element)", at);
    *p = v;
}

// Arithmetic (compile with -ffp-contract=off: no FMA contraction).
FC_DEVICE float fc_fadd(float a, float b) { return a + b; }
FC_DEVICE float fc_fmul(float a, float b) { return a * b; }
FC_DEVICE float fc_fmin(float a, float b) { return std::fmin(a, b); }
FC_DEVICE float fc_fmax(float a, float b) { return std::fmax(a, b); }
FC_DEVICE double fc_f32_to_f64(float f) { return f; }
FC_DEVICE float fc_f64_to_f32(double d) { return (float)d; }
FC_DEVICE double fc_dmul(double a, double b) { return a * b; }
FC_DEVICE double fc_dfma(double a, double b, double c) { return std::fma(a, b, c); }
FC_DEVICE float fc_u32_as_f32(fc_u32 u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
FC_DEVICE fc_u32 fc_f32_as_u32(float f) {
    fc_u32 u;
    std::memcpy(&u, &f, 4);
    return u;
}
FC_DEVICE float fc_f16_to_f32(fc_u16 h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}
FC_DEVICE fc_u16 fc_f32_to_f16(float f) {
    _Float16 x = (_Float16)f;
    fc_u16 h;
    std::memcpy(&h, &x, 2);
    return h;
}
FC_DEVICE float fc_bf16_to_f32(fc_u16 h) { return fc_u32_as_f32(((fc_u32)h) << 16); }
FC_DEVICE fc_u16 fc_f32_to_bf16(float f) {
    const fc_u32 u = fc_f32_as_u32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (fc_u16)((u >> 16) | 0x40u);
    return (fc_u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
FC_DEVICE void fc_unpack_f16x2(fc_u32 w, float& lo, float& hi) {
    lo = fc_f16_to_f32((fc_u16)w);
    hi = fc_f16_to_f32((fc_u16)(w >> 16));
}
FC_DEVICE fc_u32 fc_pack_f16x2(float lo, float hi) {
    return (fc_u32)fc_f32_to_f16(lo) | ((fc_u32)fc_f32_to_f16(hi) << 16);
}
FC_DEVICE void fc_unpack_bf16x2(fc_u32 w, float& lo, float& hi) {
    lo = fc_bf16_to_f32((fc_u16)w);
    hi = fc_bf16_to_f32((fc_u16)(w >> 16));
}
FC_DEVICE fc_u32 fc_pack_bf16x2(float lo, float hi) {
    return (fc_u32)fc_f32_to_bf16(lo) | ((fc_u32)fc_f32_to_bf16(hi) << 16);
}

#endif // FC_PRELUDE_INCLUDED
