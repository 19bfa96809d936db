// ferrocomm HIP prelude: the vendor primitives that the vendor-neutral
// algorithm bodies (kernels-cuda/collectives.cu) are written against, for AMD
// GPUs (CDNA: gfx90a, gfx942 = MI300, gfx950 = MI350).
//
// The module text hipRTC compiles is this file + "\n" + collectives.cu (see
// src/algo/kernels.rs, ModuleSource::hip): the algorithm body is shared with
// CUDA unchanged, and everything AMD specific lives here: atomics and fences
// of the AMDGPU memory model, the constant-rate wall clock, 16-byte vectors,
// thread geometry, block barriers, and the fp16/bf16 conversions.
// kernels-hip/README.md explains the sharing and the compile checks.
//
// Self-contained: clang builtins only, no #include, no device library calls,
// so it compiles with `clang++ -x hip --cuda-device-only -nogpuinc -nogpulib`
// (Debian ships no oclc_isa_version_942.bc) and under hipRTC, whose own
// built-in declarations it does not depend on.
//
// Wave size: nothing here assumes 32 or 64 lanes (CDNA runs wave64). Block
// barriers are s_barrier; the only cross-lane reduction (fc_barrier_or) goes
// through LDS.
//
// Floating point: every f32/f64 operation below is compiled with FP
// contraction off (pragma, so -ffp-contract=fast cannot fuse a multiply into
// a following add), and the conversions are integer code with explicit
// round-to-nearest-even that keeps subnormals, so results match the Rust host
// reference bit for bit whatever the denormal mode. Do not compile with
// -ffast-math (checked below).
//
// Host test mode: with FC_HIP_PRELUDE_HOST_TEST defined, only the pure
// arithmetic (types, float helpers, conversions, the tick conversion) is
// compiled, as plain C++ for the host. tests/kernels_hip_compile.rs uses it
// to check the conversions exhaustively against the Rust `half` crate.

#ifndef FC_PRELUDE_INCLUDED
#define FC_PRELUDE_INCLUDED

#if defined(__FAST_MATH__)
#error "ferrocomm kernels must not be compiled with -ffast-math (results must match the host reference bit for bit)"
#endif

#if !defined(FC_HIP_PRELUDE_HOST_TEST) && !defined(__AMDGCN__)
#error "prelude.hip.h is AMDGPU device code: compile with --cuda-device-only (hipRTC always does)"
#endif

// ---------------------------------------------------------------------------
// Fixed-width types (no <cstdint>: no headers at all).
typedef unsigned char fc_u8;
typedef unsigned short fc_u16;
typedef unsigned int fc_u32;
typedef int fc_i32;
typedef unsigned long long fc_u64;
typedef long long fc_i64;

static_assert(sizeof(fc_u16) == 2 && sizeof(fc_u32) == 4 && sizeof(fc_u64) == 8, "fc_* integer widths");
static_assert(sizeof(void*) == 8, "64-bit device pointers");

// ---------------------------------------------------------------------------
// Constants shared with src/device/params.rs and src/algo/layout.rs.
#define FC_MAX_RANKS 8u
#define FC_MAX_BLOCKS 128u
#define FC_ERR_WORDS 4u
#define FC_ERR_CODE_NONE 0u
#define FC_ERR_CODE_TIMEOUT 1u
#define FC_ERR_CODE_MISMATCH 2u

// Dtype and op codes (src/dtype.rs: #[repr(u32)] DType / ReduceOp).
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

// FcParams::flags bits (src/device/params.rs).
#define FC_PARAM_SCALAR_IS_PTR 1u
#define FC_PARAM_DIRECT_OK 2u

// ---------------------------------------------------------------------------
// The parameter block, passed by value as the kernel's one argument (it lives
// in the kernarg segment, so run-time indexing of peer_ws[] reads it there).
// A copy of `KernelParams` (#[repr(C)]) in src/device/params.rs, the source
// of the layout: the compile checks assert every field's offset and size
// against it (src/device/abi.rs).
struct FcParams {
    fc_u64 peer_ws[FC_MAX_RANKS]; // every rank's workspace as mapped here; [rank] is ours
    fc_u64 input;                 // this rank's input
    fc_u64 output;                // this rank's output (may equal input)
    fc_u64 error_flags;           // host-mapped u32[FC_ERR_WORDS]
    fc_u64 count;                 // elements in this launch
    fc_u64 fingerprint;           // hash of (collective, dtype, op, total count, chunk)
    fc_u64 timeout_ns;            // bound on every spin wait
    fc_u64 fp_offset;             // byte offsets inside a workspace
    fc_u64 flags_offset;
    fc_u64 data_offset;
    fc_u64 slot_bytes;            // bytes of one data slot
    fc_u32 rank;
    fc_u32 world;
    fc_u32 dtype;
    fc_u32 op;
    fc_u32 root;                  // broadcast root
    fc_u32 aux;    // quick-reduce: codec blocks per inbox segment
    fc_u64 scalar;                // premul_sum factor: f32 bits, or (flags & 1) the address of one element
    fc_u64 table;                 // direct kinds: every rank's heap base as mapped here (u64[MAX_RANKS]), or 0
    fc_u32 peer;                  // the other rank of a send or receive
    fc_u32 flags;                 // FC_PARAM_* bits
    fc_u64 per_peer[4][FC_MAX_RANKS];  // per-peer counts/offsets/addresses (src/device/params.rs)
};

// The size, for standalone compiles (the compile checks assert each field).
static_assert(sizeof(FcParams) == 448, "FcParams must match KernelParams (448 bytes)");

// ---------------------------------------------------------------------------
// Qualifiers. hipRTC predefines __global__ / __device__ / __shared__ as these
// same attributes; offline compiles with -nogpuinc do not.
#ifndef FC_HIP_PRELUDE_HOST_TEST
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
#define FC_DEVICE static __device__ inline __attribute__((always_inline))
#else
#define FC_DEVICE static inline
#endif
// The CUDA prelude keeps these slow paths out of line; inlined here: on
// AMDGPU a call takes scratch memory for its frame.
#define FC_DEVICE_COLD FC_DEVICE

// Most threads the host launches per block. Lower it with
// -DFC_MAX_BLOCK_THREADS=512 (the backend does) to give the compiler more
// registers: it is the kernels' flat work-group size bound.
#ifndef FC_MAX_BLOCK_THREADS
#define FC_MAX_BLOCK_THREADS 1024
#endif

// Frequency of the constant wall clock read by fc_globaltimer_ns, in kHz
// (hipDeviceAttributeWallClockRate; 100 MHz on CDNA). The backend defines it
// from the device attribute.
#ifndef FC_WALLCLOCK_KHZ
#define FC_WALLCLOCK_KHZ 100000
#endif
static_assert(FC_WALLCLOCK_KHZ > 0, "FC_WALLCLOCK_KHZ must be positive");

#ifndef FC_HIP_PRELUDE_HOST_TEST
// One entry point: `extern "C" __global__ void NAME(const FcParams p)`.
// amdgpu_flat_work_group_size is what HIP's __launch_bounds__ expands to.
#define FC_KERNEL(name)                                                                          \
    extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, FC_MAX_BLOCK_THREADS))) \
        name(const FcParams p)
// An entry point whose one by-value argument is `const ArgsType a` (heap
// kernels and user kernels: FC_HEAP_KERNEL in device_api.cuh).
#define FC_KERNEL_ARGS(name, ArgsType)                                                           \
    extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, FC_MAX_BLOCK_THREADS))) \
        name(const ArgsType a)

// ---------------------------------------------------------------------------
// Thread geometry (1-D launches only).
FC_DEVICE fc_u32 fc_thread_id() { return __builtin_amdgcn_workitem_id_x(); }
FC_DEVICE fc_u32 fc_block_threads() { return __builtin_amdgcn_workgroup_size_x(); }
FC_DEVICE fc_u32 fc_block_id() { return __builtin_amdgcn_workgroup_id_x(); }
// The dispatch packet holds the grid in work-items; launches are whole blocks.
FC_DEVICE fc_u32 fc_grid_blocks() { return __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(); }

// Block barrier with the same guarantee as CUDA's bar.sync before a
// system-scope release: every write of every wave of the block is complete
// before any thread passes, so one thread's release that follows publishes
// them all. A workgroup-scope release fence alone does not wait for the
// stores of the other waves on gfx9, and a system-scope release in one wave
// only waits for that wave's own stores, so each wave waits for its memory
// counters here (s_waitcnt 0: vmcnt, expcnt, lgkmcnt), then meets the others.
FC_DEVICE void fc_barrier() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
#if defined(__GFX9__)
    __builtin_amdgcn_s_waitcnt(0);
#else
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "agent");
#endif
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// Barrier that also returns whether any thread of the block passed
// `pred != 0` (CUDA's __syncthreads_or), through one LDS word. Three barriers:
// the first also orders the previous call's reads of the word before its reset.
FC_DEVICE bool fc_barrier_or(bool pred) {
    __shared__ fc_u32 fc_barrier_or_word;
    fc_barrier();
    if (fc_thread_id() == 0) fc_barrier_or_word = 0u;
    fc_barrier();
    if (pred) __hip_atomic_fetch_or(&fc_barrier_or_word, 1u, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
    fc_barrier();
    return __hip_atomic_load(&fc_barrier_or_word, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP) != 0u;
}

// Programmatic dependent launch is CUDA's (prelude.cuh); HIP launches every
// kernel after the previous one ends, so both are no-ops.
FC_DEVICE void fc_grid_dep_wait() {}
FC_DEVICE void fc_grid_dep_launch() {}

// ---------------------------------------------------------------------------
// Addresses. Integers from the params become generic (flat) pointers; the
// loads and stores below cast them to the global address space.
template <class T>
FC_DEVICE T* fc_ptr(fc_u64 addr) {
    return reinterpret_cast<T*>(addr);
}

#define FC_GLOBAL __attribute__((address_space(1)))

// ---------------------------------------------------------------------------
// Memory model (LLVM AMDGPU memory model, system scope = every agent and the
// host: peers over XGMI / PCIe and host-mapped memory). Flags and workspaces
// live in uncached (hipDeviceMallocUncached) memory; a system-scope acquire
// also invalidates this CU's L1 and its XCD's L2 for what follows, and a
// system-scope release writes the L2 back first.
FC_DEVICE fc_u32 fc_ld_acquire_sys(const fc_u32* p) {
    return __hip_atomic_load((FC_GLOBAL fc_u32*)p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Release store at system scope (flags). Cumulative for the whole block when
// an fc_barrier() comes before it (see there).
FC_DEVICE void fc_st_release_sys(fc_u32* p, fc_u32 v) {
    __hip_atomic_store((FC_GLOBAL fc_u32*)p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Relaxed (volatile) access to words that only change between launches, or
// whose ordering is given by a fence or a release that follows.
FC_DEVICE fc_u32 fc_ld_volatile(const fc_u32* p) { return *(const volatile FC_GLOBAL fc_u32*)p; }
FC_DEVICE void fc_st_volatile(fc_u32* p, fc_u32 v) { *(volatile FC_GLOBAL fc_u32*)p = v; }
FC_DEVICE fc_u64 fc_ld_volatile_u64(const fc_u64* p) { return *(const volatile FC_GLOBAL fc_u64*)p; }
FC_DEVICE void fc_st_volatile_u64(fc_u64* p, fc_u64 v) { *(volatile FC_GLOBAL fc_u64*)p = v; }
// LL units: one 16-byte line as two 8-byte halves, each a relaxed 64-bit
// atomic at system scope: single-copy atomic (a unit's data word and flag
// word are always seen together, which is what LL relies on; RCCL's LL does
// the same two 8-byte accesses), coherent across devices, and never merged
// or hoisted out of a spin loop. `p` is 16-byte aligned.
FC_DEVICE void fc_ld_volatile_v2u64(const void* p, fc_u64& a, fc_u64& b) {
    FC_GLOBAL fc_u64* q = (FC_GLOBAL fc_u64*)p;
    a = __hip_atomic_load(q, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    b = __hip_atomic_load(q + 1, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
FC_DEVICE void fc_st_volatile_v2u64(void* p, fc_u64 a, fc_u64 b) {
    FC_GLOBAL fc_u64* q = (FC_GLOBAL fc_u64*)p;
    __hip_atomic_store(q, a, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    __hip_atomic_store(q + 1, b, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Fences: system scope ("" is the system scope), and agent (one GPU) scope.
FC_DEVICE void fc_fence_sys() { __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, ""); }
FC_DEVICE void fc_fence_gpu() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }

// Atomics, relaxed like CUDA's atomic*_system / atomicAdd. _sys: system scope
// (host-mapped error words: PCIe atomics on discrete GPUs); _gpu: agent scope.
FC_DEVICE fc_u32 fc_atomic_cas_sys(fc_u32* p, fc_u32 cmp, fc_u32 val) {
    __hip_atomic_compare_exchange_strong((FC_GLOBAL fc_u32*)p, &cmp, val, __ATOMIC_RELAXED, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    return cmp; // the old value, whether or not it was replaced
}
FC_DEVICE fc_u32 fc_atomic_or_sys(fc_u32* p, fc_u32 v) {
    return __hip_atomic_fetch_or((FC_GLOBAL fc_u32*)p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
FC_DEVICE fc_u32 fc_atomic_exch_sys(fc_u32* p, fc_u32 v) {
    return __hip_atomic_exchange((FC_GLOBAL fc_u32*)p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
FC_DEVICE fc_u32 fc_atomic_add_gpu(fc_u32* p, fc_u32 v) {
    return __hip_atomic_fetch_add((FC_GLOBAL fc_u32*)p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}

// 64-bit words at system scope (device API signals and barrier counts,
// device_api.cuh): acquire load and release store like the u32 pair above,
// relaxed atomics like the u32 ones (a caller that needs release puts
// fc_fence_sys() before). 64-bit system-scope atomics on host-mapped memory
// need PCIe atomics; between GPUs they go over XGMI.
FC_DEVICE fc_u64 fc_ld_acquire_sys_u64(const fc_u64* p) {
    return __hip_atomic_load((FC_GLOBAL fc_u64*)p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
FC_DEVICE void fc_st_release_sys_u64(fc_u64* p, fc_u64 v) {
    __hip_atomic_store((FC_GLOBAL fc_u64*)p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
FC_DEVICE fc_u64 fc_atomic_add_sys_u64(fc_u64* p, fc_u64 v) {
    return __hip_atomic_fetch_add((FC_GLOBAL fc_u64*)p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
FC_DEVICE fc_u64 fc_atomic_cas_sys_u64(fc_u64* p, fc_u64 cmp, fc_u64 val) {
    __hip_atomic_compare_exchange_strong((FC_GLOBAL fc_u64*)p, &cmp, val, __ATOMIC_RELAXED, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    return cmp; // the old value, whether or not it was replaced
}
#endif // !FC_HIP_PRELUDE_HOST_TEST

// Ticks of the FC_WALLCLOCK_KHZ clock to nanoseconds, exact and without
// overflow for any 64-bit tick count.
FC_DEVICE fc_u64 fc_ticks_to_ns(fc_u64 t) {
    if (1000000ull % (fc_u64)FC_WALLCLOCK_KHZ == 0) return t * (1000000ull / (fc_u64)FC_WALLCLOCK_KHZ);
    const fc_u64 k = (fc_u64)FC_WALLCLOCK_KHZ;
    return (t / k) * 1000000ull + ((t % k) * 1000000ull) / k;
}

#ifndef FC_HIP_PRELUDE_HOST_TEST
// Nanoseconds from the constant-rate wall clock, which is the same on every
// CU (s_memrealtime on gfx8/gfx9; the steady counter elsewhere). Only
// differences are used, for deadlines.
FC_DEVICE fc_u64 fc_globaltimer_ns() {
#if defined(__GFX9__) || defined(__GFX8__)
    return fc_ticks_to_ns(__builtin_amdgcn_s_memrealtime());
#else
    return fc_ticks_to_ns(__builtin_readsteadycounter());
#endif
}

// ---------------------------------------------------------------------------
// 16-byte vectors. `fc_vec16` is four 32-bit words; element k of a 2-byte type
// is half (k & 1) of word k / 2, the low half first (little endian).
struct fc_vec16 {
    fc_u32 w[4];
};
typedef fc_u32 fc_u32x4 __attribute__((ext_vector_type(4)));

// Requires a 16-byte-aligned global address: one global_load/store_dwordx4.
FC_DEVICE fc_vec16 fc_load16(const void* p) {
    const fc_u32x4 v = *(const FC_GLOBAL fc_u32x4*)p;
    fc_vec16 r;
    r.w[0] = v.x;
    r.w[1] = v.y;
    r.w[2] = v.z;
    r.w[3] = v.w;
    return r;
}
FC_DEVICE void fc_store16(void* p, const fc_vec16& r) {
    fc_u32x4 v;
    v.x = r.w[0];
    v.y = r.w[1];
    v.z = r.w[2];
    v.w = r.w[3];
    *(FC_GLOBAL fc_u32x4*)p = v;
}

// Plain element access to global memory (tails and unaligned fallbacks);
// T is one of fc_u16, fc_u32, fc_i32, float.
template <class T>
FC_DEVICE T fc_load(const T* p) {
    return *(const FC_GLOBAL T*)p;
}
template <class T>
FC_DEVICE void fc_store(T* p, T v) {
    *(FC_GLOBAL T*)p = v;
}
#endif // !FC_HIP_PRELUDE_HOST_TEST

// ---------------------------------------------------------------------------
// Bit casts.
FC_DEVICE float fc_u32_as_f32(fc_u32 u) { return __builtin_bit_cast(float, u); }
FC_DEVICE fc_u32 fc_f32_as_u32(float f) { return __builtin_bit_cast(fc_u32, f); }

// ---------------------------------------------------------------------------
// Float arithmetic: IEEE round to nearest, never contracted into FMA.
FC_DEVICE float fc_fadd(float a, float b) {
#pragma clang fp contract(off)
    return a + b;
}
FC_DEVICE float fc_fmul(float a, float b) {
#pragma clang fp contract(off)
    return a * b;
}
// a * b + c with one rounding (v_fma_f32; no libm call).
FC_DEVICE float fc_ffma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
// fminf / fmaxf semantics: a NaN operand loses to a number.
FC_DEVICE float fc_fmin(float a, float b) { return __builtin_fminf(a, b); }
FC_DEVICE float fc_fmax(float a, float b) { return __builtin_fmaxf(a, b); }

// f64 helpers (exact division by a small integer, see collectives.cu avg_div).
FC_DEVICE double fc_f32_to_f64(float f) { return (double)f; }
FC_DEVICE float fc_f64_to_f32(double d) { return (float)d; }
FC_DEVICE double fc_dmul(double a, double b) {
#pragma clang fp contract(off)
    return a * b;
}
// Fused multiply-add, one rounding (v_fma_f64; no libm call).
FC_DEVICE double fc_dfma(double a, double b, double c) { return __builtin_fma(a, b, c); }

// ---------------------------------------------------------------------------
// fp16 / bf16 over raw 16-bit storage, by integer arithmetic. Widening is
// exact; narrowing rounds to nearest even and keeps subnormals; overflow
// gives infinity; NaN stays NaN (quiet, sign and top payload bits kept), as
// the Rust `half` crate does.

FC_DEVICE float fc_f16_to_f32(fc_u16 h) {
    const fc_u32 sign = ((fc_u32)h & 0x8000u) << 16;
    const fc_u32 e = ((fc_u32)h >> 10) & 0x1fu;
    const fc_u32 m = (fc_u32)h & 0x3ffu;
    fc_u32 bits;
    if (e == 0x1fu) {
        bits = m == 0u ? 0x7f800000u : (0x7fc00000u | (m << 13)); // inf, or NaN made quiet
    } else if (e != 0u) {
        bits = ((e + 112u) << 23) | (m << 13); // rebias 15 -> 127
    } else if (m == 0u) {
        bits = 0u;
    } else {
        // Subnormal m * 2^-24 with its leading one at bit p (0..9):
        // 1.f * 2^(p-24), biased exponent p + 103, fraction m << (23 - p).
        const fc_u32 p = 31u - (fc_u32)__builtin_clz(m);
        bits = ((p + 103u) << 23) | ((m << (23u - p)) & 0x7fffffu);
    }
    return fc_u32_as_f32(sign | bits);
}

FC_DEVICE fc_u16 fc_f32_to_f16(float f) {
    const fc_u32 x = fc_f32_as_u32(f);
    const fc_u32 sign = (x >> 16) & 0x8000u;
    const fc_u32 ax = x & 0x7fffffffu;
    fc_u32 h;
    if (ax > 0x7f800000u) {
        h = 0x7e00u | ((ax >> 13) & 0x3ffu); // NaN: quiet, top payload bits
    } else if (ax >= 0x47800000u) {
        h = 0x7c00u; // >= 65536 (and inf): infinity
    } else if (ax >= 0x38800000u) {
        // Normal f16 range (>= 2^-14): rebias 127 -> 15, then round the 13
        // dropped bits to nearest even. A carry out of the fraction bumps
        // the exponent, up to infinity at 65520.
        const fc_u32 r = ax - 0x38000000u;
        h = (r + 0x0fffu + ((r >> 13) & 1u)) >> 13;
    } else {
        // Subnormal f16 (or zero): the value in units of 2^-24 is
        // m * 2^(e - 126) for the f32 significand m with its hidden bit.
        const fc_u32 e = ax >> 23;
        if (e < 102u) {
            h = 0u; // below 2^-25: rounds to zero
        } else {
            const fc_u32 m = (ax & 0x7fffffu) | 0x800000u;
            const fc_u32 shift = 126u - e; // 14..24
            const fc_u32 q = m >> shift;
            const fc_u32 rem = m & ((1u << shift) - 1u);
            const fc_u32 half = 1u << (shift - 1u);
            h = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
        }
    }
    return (fc_u16)(sign | h);
}

// bf16 is the high half of an f32: widening is a shift.
FC_DEVICE float fc_bf16_to_f32(fc_u16 h) { return fc_u32_as_f32(((fc_u32)h) << 16); }
FC_DEVICE fc_u16 fc_f32_to_bf16(float f) {
    const fc_u32 x = fc_f32_as_u32(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (fc_u16)((x >> 16) | 0x0040u); // NaN: quiet
    return (fc_u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Two packed elements in one 32-bit word: `lo` is the element at the lower address.
FC_DEVICE void fc_unpack_f16x2(fc_u32 w, float& lo, float& hi) {
    lo = fc_f16_to_f32((fc_u16)(w & 0xffffu));
    hi = fc_f16_to_f32((fc_u16)(w >> 16));
}
FC_DEVICE fc_u32 fc_pack_f16x2(float lo, float hi) {
    return (fc_u32)fc_f32_to_f16(lo) | ((fc_u32)fc_f32_to_f16(hi) << 16);
}
FC_DEVICE void fc_unpack_bf16x2(fc_u32 w, float& lo, float& hi) {
    lo = fc_u32_as_f32(w << 16);
    hi = fc_u32_as_f32(w & 0xffff0000u);
}
FC_DEVICE fc_u32 fc_pack_bf16x2(float lo, float hi) {
    return (fc_u32)fc_f32_to_bf16(lo) | ((fc_u32)fc_f32_to_bf16(hi) << 16);
}

#ifndef FC_HIP_PRELUDE_HOST_TEST
// ---------------------------------------------------------------------------
// Quick-reduce primitives (kernels-cuda/quickreduce.cu).

// Lane inside the wave (64 lanes on CDNA).
FC_DEVICE fc_u32 fc_lane_id() { return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u)); }
// Lanes per wave (64 on CDNA), and a barrier of the calling wave that orders
// its lanes' memory accesses. A wave is one instruction stream, so no
// instruction is needed: the wavefront-scope fences only keep the compiler
// from moving accesses across it. A system-scope release by one lane that
// follows waits (s_waitcnt) for the memory counters of the whole wave, so it
// covers every lane's writes.
// (ROCm 5.x hipRTC's clang predates the builtin; its macro is the same number.)
FC_DEVICE fc_u32 fc_warp_size() {
#if __has_builtin(__builtin_amdgcn_wavefrontsize)
    return __builtin_amdgcn_wavefrontsize();
#else
    return __AMDGCN_WAVEFRONT_SIZE;
#endif
}
FC_DEVICE void fc_warp_sync() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
// The value of lane (lane ^ mask), through ds_bpermute (byte addresses).
// Every lane of the wave must call it.
FC_DEVICE fc_u32 fc_shfl_xor(fc_u32 v, fc_u32 mask) {
    return (fc_u32)__builtin_amdgcn_ds_bpermute((int)((fc_lane_id() ^ mask) << 2), (int)v);
}
// The value of lane (lane - delta); a lane below delta gets its own. Every
// lane of the wave must call it.
FC_DEVICE fc_u32 fc_shfl_up(fc_u32 v, fc_u32 delta) {
    const fc_u32 lane = fc_lane_id();
    return (fc_u32)__builtin_amdgcn_ds_bpermute((int)((lane >= delta ? lane - delta : lane) << 2), (int)v);
}
// Lane 0's value. Every lane of the wave must call it.
FC_DEVICE fc_u32 fc_shfl_lane0(fc_u32 v) { return (fc_u32)__builtin_amdgcn_ds_bpermute(0, (int)v); }
// Correctly rounded f32 division (clang's HIP default; -ffast-math is refused above).
FC_DEVICE float fc_fdiv(float a, float b) {
#pragma clang fp contract(off)
    return a / b;
}
// Correctly rounded f32 reciprocal (1.0f / x).
FC_DEVICE float fc_frcp(float x) { return fc_fdiv(1.0f, x); }
// Correctly rounded f32 square root (fused.cu): llvm.sqrt.f32 with no
// !fpmath metadata, which HIP's default -fhip-fp32-correctly-rounded-divide-sqrt
// keeps, is expanded to a correctly rounded sequence.
FC_DEVICE float fc_fsqrt(float x) { return __builtin_sqrtf(x); }
// Round to the nearest integer, ties to even (v_rndne_f32).
FC_DEVICE float fc_rintf(float x) { return __builtin_rintf(x); }

// FP8 e4m3fnuz in hardware on MI300 (gfx942: v_cvt_pk_fp8_f32 converts to
// the fnuz flavour, rounding to nearest even). The input is clamped to +-240
// first, so the conversion saturates as the host codec does (a NaN input
// never reaches it). `lo` is the byte at the lower address. Other archs use
// the body's software codec, which gives the same bits. (Compiled in CI; not
// yet run on an MI300.)
#if defined(__gfx942__)
#define FC_HW_E4M3FNUZ 1
FC_DEVICE fc_u32 fc_e4m3_pack2(float lo, float hi) {
    lo = __builtin_fminf(__builtin_fmaxf(lo, -240.0f), 240.0f);
    hi = __builtin_fminf(__builtin_fmaxf(hi, -240.0f), 240.0f);
    return (fc_u32)__builtin_amdgcn_cvt_pk_fp8_f32(lo, hi, 0, false) & 0xffffu;
}
FC_DEVICE void fc_e4m3_unpack2(fc_u32 two, float& lo, float& hi) {
    lo = __builtin_amdgcn_cvt_f32_fp8((int)two, 0);
    hi = __builtin_amdgcn_cvt_f32_fp8((int)two, 1);
}
#endif
#endif // !FC_HIP_PRELUDE_HOST_TEST

#endif // FC_PRELUDE_INCLUDED
