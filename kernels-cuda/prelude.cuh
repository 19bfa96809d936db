// ferrocomm CUDA prelude: the vendor primitives that the vendor-neutral
// algorithm bodies (collectives.cu) are written against.
//
// The module text NVRTC compiles is this file + "\n" + collectives.cu (see
// src/algo/kernels.rs). A HIP prelude supplies the same fc_* names for ROCm,
// and collectives.cu is reused unchanged, so everything vendor specific lives
// here: inline PTX, atomics, the timer, vector types, fences, thread indices,
// barriers, and the fp16/bf16 conversions.
//
// No #include at all: NVRTC has no built-in standard headers, so the fixed
// width types, the parameter block and the conversions are defined here.
//
// Compile options this file assumes: none of --use_fast_math, --ftz=true,
// --prec-div=false. (The float arithmetic below is inline PTX without .ftz and
// so is immune to --ftz / --fmad anyway; conversions use explicit .rn PTX.)
// Needs sm_80 or newer (cvt.rn.bf16.f32, cvt.rn.{f16,bf16}x2.f32).

#ifndef FC_PRELUDE_INCLUDED
#define FC_PRELUDE_INCLUDED

// ---------------------------------------------------------------------------
// Fixed-width types (no <cstdint> under NVRTC).
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
// The parameter block, passed by value as the kernel's one argument. A copy
// of `KernelParams` (#[repr(C)]) in src/device/params.rs, the source of the
// layout: the compile checks assert every field's offset and size against it
// (src/device/abi.rs).
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
    fc_u32 aux;                   // quick-reduce: codec blocks per inbox segment
    fc_u64 scalar;                // premul_sum factor: f32 bits, or (flags & 1) the address of one element
    fc_u64 table;                 // direct kinds: every rank's heap base as mapped here (u64[MAX_RANKS]), or 0
    fc_u32 peer;                  // the other rank of a send or receive
    fc_u32 flags;                 // FC_PARAM_* bits
    fc_u64 per_peer[4][FC_MAX_RANKS];  // per-peer counts/offsets/addresses (src/device/params.rs)
};

// The size, for standalone compiles (the compile checks assert each field).
static_assert(sizeof(FcParams) == 448, "FcParams must match KernelParams (448 bytes)");

// ---------------------------------------------------------------------------
// Function and kernel qualifiers.
#define FC_DEVICE static __device__ __forceinline__
// A slow path kept out of line, so that it does not sit between the fast
// path's instructions (see fc_ep::cold_put_warp).
#define FC_DEVICE_COLD static __device__ __noinline__

// Register budget: the host may launch any multiple of 32 threads up to this.
// The default is the block size ferrocomm launches (algo::BLOCK_THREADS, which
// the backend also passes as -DFC_MAX_BLOCK_THREADS and enforces at launch).
#ifndef FC_MAX_BLOCK_THREADS
#define FC_MAX_BLOCK_THREADS 512
#endif

// One entry point: `extern "C" __global__ void NAME(const FcParams p)`.
// __grid_constant__ lets the body index p.peer_ws[] at run time straight from
// the parameter bank instead of copying the block to local memory. At least
// one block per SM (a launch never has more blocks than SMs), so the compiler
// may use up to 65536 / FC_MAX_BLOCK_THREADS registers a thread.
#define FC_KERNEL(name) \
    extern "C" __global__ void __launch_bounds__(FC_MAX_BLOCK_THREADS, 1) name(const __grid_constant__ FcParams p)
// An entry point whose one by-value argument is `const ArgsType a` (heap
// kernels and user kernels: FC_HEAP_KERNEL in device_api.cuh). Same bounds
// and __grid_constant__ as FC_KERNEL, so a.ctx.heap[peer] indexes the
// parameter bank at run time.
#define FC_KERNEL_ARGS(name, ArgsType) \
    extern "C" __global__ void __launch_bounds__(FC_MAX_BLOCK_THREADS, 1) name(const __grid_constant__ ArgsType a)

// ---------------------------------------------------------------------------
// Thread geometry and block barriers (1-D launches only).
FC_DEVICE fc_u32 fc_thread_id() { return threadIdx.x; }
FC_DEVICE fc_u32 fc_block_threads() { return blockDim.x; }
FC_DEVICE fc_u32 fc_block_id() { return blockIdx.x; }
FC_DEVICE fc_u32 fc_grid_blocks() { return gridDim.x; }
FC_DEVICE void fc_barrier() { __syncthreads(); }
// Barrier that also returns whether any thread of the block passed `pred != 0`.
FC_DEVICE bool fc_barrier_or(bool pred) { return __syncthreads_or(pred ? 1 : 0) != 0; }

// Programmatic dependent launch (sm_90 and up; no-ops below, and on HIP).
// A kernel launched with LaunchConfig::dependent may start while the
// stream's previous kernel still runs: fc_grid_dep_wait() returns once that
// kernel has ended and its writes are visible, so it goes before the first
// memory access. fc_grid_dep_launch() lets the stream's next (dependent)
// kernel be scheduled once every block of this one has run it or exited.
FC_DEVICE void fc_grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
FC_DEVICE void fc_grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------
// Addresses.
template <class T>
FC_DEVICE T* fc_ptr(fc_u64 addr) { return reinterpret_cast<T*>(addr); }

// ---------------------------------------------------------------------------
// Memory model.
// Acquire load at system scope (flag spins: peers write over NVLink / PCIe).
FC_DEVICE fc_u32 fc_ld_acquire_sys(const fc_u32* p) {
    fc_u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Release store at system scope (flags). Cumulative: with a block barrier
// before it, it publishes every write of the block that came before.
FC_DEVICE void fc_st_release_sys(fc_u32* p, fc_u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Relaxed (volatile) access to words that only change between launches, or
// whose ordering is given by a fence or a release that follows.
FC_DEVICE fc_u32 fc_ld_volatile(const fc_u32* p) { return *reinterpret_cast<const volatile fc_u32*>(p); }
FC_DEVICE void fc_st_volatile(fc_u32* p, fc_u32 v) { *reinterpret_cast<volatile fc_u32*>(p) = v; }
FC_DEVICE fc_u64 fc_ld_volatile_u64(const fc_u64* p) { return *reinterpret_cast<const volatile fc_u64*>(p); }
FC_DEVICE void fc_st_volatile_u64(fc_u64* p, fc_u64 v) { *reinterpret_cast<volatile fc_u64*>(p) = v; }
// LL units: one 16-byte access as two 8-byte halves. Each half is a scalar
// 64-bit access of its own, and so single-copy atomic (PTX memory model:
// vector accesses are per element), which is what LL relies on: a unit's data
// word and flag word are always seen together. Volatile = relaxed at system
// scope, and never hoisted out of a spin loop.
FC_DEVICE void fc_ld_volatile_v2u64(const void* p, fc_u64& a, fc_u64& b) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
FC_DEVICE void fc_st_volatile_v2u64(void* p, fc_u64 a, fc_u64 b) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
// Fences.
FC_DEVICE void fc_fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
FC_DEVICE void fc_fence_gpu() { __threadfence(); }

// Atomics. _sys: system scope (host-mapped error words); _gpu: device scope.
FC_DEVICE fc_u32 fc_atomic_cas_sys(fc_u32* p, fc_u32 cmp, fc_u32 val) { return atomicCAS_system(p, cmp, val); }
FC_DEVICE fc_u32 fc_atomic_or_sys(fc_u32* p, fc_u32 v) { return atomicOr_system(p, v); }
FC_DEVICE fc_u32 fc_atomic_exch_sys(fc_u32* p, fc_u32 v) { return atomicExch_system(p, v); }
FC_DEVICE fc_u32 fc_atomic_add_gpu(fc_u32* p, fc_u32 v) { return atomicAdd(p, v); }

// 64-bit words at system scope (device API signals and barrier counts,
// device_api.cuh). The load and store are acquire / release like the u32
// pair above; the atomics are relaxed like the u32 ones (a caller that needs
// release puts fc_fence_sys() before).
FC_DEVICE fc_u64 fc_ld_acquire_sys_u64(const fc_u64* p) {
    fc_u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
FC_DEVICE void fc_st_release_sys_u64(fc_u64* p, fc_u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
FC_DEVICE fc_u64 fc_atomic_add_sys_u64(fc_u64* p, fc_u64 v) { return atomicAdd_system(p, v); }
FC_DEVICE fc_u64 fc_atomic_cas_sys_u64(fc_u64* p, fc_u64 cmp, fc_u64 val) { return atomicCAS_system(p, cmp, val); }

// Nanoseconds from a free-running global clock (same on every SM).
FC_DEVICE fc_u64 fc_globaltimer_ns() {
    fc_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---------------------------------------------------------------------------
// 16-byte vectors. `fc_vec16` is four 32-bit words; element k of a 2-byte type
// is half (k & 1) of word k / 2, the low half first (little endian).
struct fc_vec16 {
    fc_u32 w[4];
};

// Requires a 16-byte-aligned global address. The .cg forms (cache in L2, not
// L1) are explicitly global, so they compile to LDG/STG.E.128 although the
// addresses come from integers in the params, and data read once (peers'
// slots over NVLink) does not pollute L1.
FC_DEVICE fc_vec16 fc_load16(const void* p) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    fc_vec16 r;
    r.w[0] = v.x;
    r.w[1] = v.y;
    r.w[2] = v.z;
    r.w[3] = v.w;
    return r;
}
FC_DEVICE void fc_store16(void* p, const fc_vec16& r) {
    uint4 v;
    v.x = r.w[0];
    v.y = r.w[1];
    v.z = r.w[2];
    v.w = r.w[3];
    __stcg(reinterpret_cast<uint4*>(p), v);
}

// Plain element access to global memory (tails and unaligned fallbacks);
// T is one of fc_u16, fc_u32, fc_i32, float.
template <class T>
FC_DEVICE T fc_load(const T* p) {
    return __ldcg(p);
}
template <class T>
FC_DEVICE void fc_store(T* p, T v) {
    __stcg(p, v);
}

// ---------------------------------------------------------------------------
// Float arithmetic. Explicit round-to-nearest PTX: never contracted into FMA,
// never flushed to zero (matches the Rust host reference bit for bit).
FC_DEVICE float fc_fadd(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
FC_DEVICE float fc_fmul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
// a * b + c with one rounding (fused.cu's quotients by a row's scale).
FC_DEVICE float fc_ffma(float a, float b, float c) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}
// fminf / fmaxf semantics: a NaN operand loses to a number.
FC_DEVICE float fc_fmin(float a, float b) {
    float r;
    asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
FC_DEVICE float fc_fmax(float a, float b) {
    float r;
    asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// f64 helpers (exact division by a small integer, see collectives.cu avg_div).
FC_DEVICE double fc_f32_to_f64(float f) {
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(f));
    return d;
}
FC_DEVICE float fc_f64_to_f32(double d) {
    float f;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(d));
    return f;
}
FC_DEVICE double fc_dmul(double a, double b) {
    double r;
    asm("mul.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
    return r;
}
FC_DEVICE double fc_dfma(double a, double b, double c) {
    double r;
    asm("fma.rn.f64 %0, %1, %2, %3;" : "=d"(r) : "d"(a), "d"(b), "d"(c));
    return r;
}

FC_DEVICE float fc_u32_as_f32(fc_u32 u) { return __uint_as_float(u); }
FC_DEVICE fc_u32 fc_f32_as_u32(float f) { return __float_as_uint(f); }

// ---------------------------------------------------------------------------
// fp16 / bf16 over raw 16-bit storage. Widening is exact; narrowing rounds to
// nearest even (cvt.rn), keeping subnormals.
FC_DEVICE float fc_f16_to_f32(fc_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
FC_DEVICE fc_u16 fc_f32_to_f16(float f) {
    fc_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// bf16 is the high half of an f32: widening is a shift (exact; valid on sm_80,
// where cvt.f32.bf16 does not exist yet).
FC_DEVICE float fc_bf16_to_f32(fc_u16 h) { return __uint_as_float(((fc_u32)h) << 16); }
FC_DEVICE fc_u16 fc_f32_to_bf16(float f) {
    fc_u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two packed elements in one 32-bit word: `lo` is the element at the lower address.
FC_DEVICE void fc_unpack_f16x2(fc_u32 w, float& lo, float& hi) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
        : "=f"(lo), "=f"(hi)
        : "r"(w));
}
FC_DEVICE fc_u32 fc_pack_f16x2(float lo, float hi) {
    fc_u32 w;
    // cvt.rn.f16x2.f32 d, a, b: d.hi = a, d.lo = b.
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}
FC_DEVICE void fc_unpack_bf16x2(fc_u32 w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}
FC_DEVICE fc_u32 fc_pack_bf16x2(float lo, float hi) {
    fc_u32 w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}

// ---------------------------------------------------------------------------
// Quick-reduce primitives (kernels-cuda/quickreduce.cu).

// Lane inside the warp.
FC_DEVICE fc_u32 fc_lane_id() { return threadIdx.x & 31u; }
// Lanes per warp, and a barrier of the calling warp that also orders its
// lanes' memory accesses (__syncwarp), so one lane's release that follows
// covers the whole warp's writes (device_api.cuh's warp-level puts). Every
// lane of the warp must call it; blocks are whole warps.
FC_DEVICE fc_u32 fc_warp_size() { return 32u; }
FC_DEVICE void fc_warp_sync() { __syncwarp(); }
// The value of lane (lane ^ mask). Every lane of the warp must call it.
FC_DEVICE fc_u32 fc_shfl_xor(fc_u32 v, fc_u32 mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
// The value of lane (lane - delta); a lane below delta gets its own. Every
// lane of the warp must call it.
FC_DEVICE fc_u32 fc_shfl_up(fc_u32 v, fc_u32 delta) { return __shfl_up_sync(0xffffffffu, v, delta); }
// Lane 0's value. Every lane of the warp must call it.
FC_DEVICE fc_u32 fc_shfl_lane0(fc_u32 v) { return __shfl_sync(0xffffffffu, v, 0); }
// Correctly rounded f32 division, whatever --prec-div says.
FC_DEVICE float fc_fdiv(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
// Correctly rounded f32 reciprocal (1.0f / x), cheaper than the division.
FC_DEVICE float fc_frcp(float x) {
    float r;
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// Correctly rounded f32 square root, whatever --prec-sqrt says (fused.cu).
FC_DEVICE float fc_fsqrt(float x) {
    float r;
    asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// Round to the nearest integer, ties to even (rintf).
FC_DEVICE float fc_rintf(float x) {
    float r;
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// FP8 e4m3fn in hardware (sm_89+): two values per conversion, rounded to
// nearest even and saturated to +-448 (a NaN input never reaches it).
// `lo` is the byte at the lower address. Older archs use the body's
// software codec, which gives the same bits.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FC_HW_E4M3FN 1
FC_DEVICE fc_u32 fc_e4m3_pack2(float lo, float hi) {
    fc_u16 r;
    // cvt ... d, a, b: d's upper byte from a, lower byte from b.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
// Exact: every e4m3 value is an f16 value, and every f16 an f32.
FC_DEVICE void fc_e4m3_unpack2(fc_u32 two, float& lo, float& hi) {
    fc_u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((fc_u16)two));
    fc_unpack_f16x2(h2, lo, hi);
}
#endif

#endif // FC_PRELUDE_INCLUDED
