// ferrocomm collective kernels: one-shot and two-shot all-reduce, broadcast.
//
// Vendor neutral: everything vendor specific (PTX, atomics, the timer, vector
// types, fences, thread indices, barriers, fp16/bf16) comes from the prelude's
// fc_* functions, so a HIP prelude can reuse this file unchanged. No inline
// asm here, and nothing assumes a warp size.
//
// The contract is docs/protocol.md (protocols, epochs, arrive/wait with
// fingerprints, error words, reduction rule, block/range partition), with the
// workspace layout of src/algo/layout.rs and the parameter block of
// src/device/params.rs (FcParams in the prelude). The module NVRTC compiles is
// prelude.cuh + "\n" + this file; the include below only serves standalone
// compiles of this file.

#ifndef FC_PRELUDE_INCLUDED
#include "prelude.cuh"
#endif

// Tuning knobs (may be overridden with -D): 16-byte packs in flight per thread
// in bulk copies, and per rank in the two-shot reduce for worlds of 2 and 4.
#ifndef FC_COPY_UNROLL
#define FC_COPY_UNROLL 4
#endif
#ifndef FC_REDUCE_UNROLL
#define FC_REDUCE_UNROLL 2
#endif

namespace fc {

// ===========================================================================
// Element types: storage S, accumulator Acc, and VEC elements per 16 bytes.

struct TF32 {
    typedef float S;
    typedef float Acc;
    enum { VEC = 4 };
    FC_DEVICE Acc to_acc(S x) { return x; }
    FC_DEVICE S from_acc(Acc a) { return a; }
    FC_DEVICE void unpack(const fc_vec16& v, Acc (&a)[VEC]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) a[k] = fc_u32_as_f32(v.w[k]);
    }
    FC_DEVICE fc_vec16 pack(const Acc (&a)[VEC]) {
        fc_vec16 v;
#pragma unroll
        for (int k = 0; k < 4; ++k) v.w[k] = fc_f32_as_u32(a[k]);
        return v;
    }
};

struct TF16 {
    typedef fc_u16 S;
    typedef float Acc;
    enum { VEC = 8 };
    FC_DEVICE Acc to_acc(S x) { return fc_f16_to_f32(x); }
    FC_DEVICE S from_acc(Acc a) { return fc_f32_to_f16(a); }
    FC_DEVICE void unpack(const fc_vec16& v, Acc (&a)[VEC]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) fc_unpack_f16x2(v.w[k], a[2 * k], a[2 * k + 1]);
    }
    FC_DEVICE fc_vec16 pack(const Acc (&a)[VEC]) {
        fc_vec16 v;
#pragma unroll
        for (int k = 0; k < 4; ++k) v.w[k] = fc_pack_f16x2(a[2 * k], a[2 * k + 1]);
        return v;
    }
};

struct TBF16 {
    typedef fc_u16 S;
    typedef float Acc;
    enum { VEC = 8 };
    FC_DEVICE Acc to_acc(S x) { return fc_bf16_to_f32(x); }
    FC_DEVICE S from_acc(Acc a) { return fc_f32_to_bf16(a); }
    FC_DEVICE void unpack(const fc_vec16& v, Acc (&a)[VEC]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) fc_unpack_bf16x2(v.w[k], a[2 * k], a[2 * k + 1]);
    }
    FC_DEVICE fc_vec16 pack(const Acc (&a)[VEC]) {
        fc_vec16 v;
#pragma unroll
        for (int k = 0; k < 4; ++k) v.w[k] = fc_pack_bf16x2(a[2 * k], a[2 * k + 1]);
        return v;
    }
};

struct TI32 {
    typedef fc_i32 S;
    typedef fc_i32 Acc;
    enum { VEC = 4 };
    FC_DEVICE Acc to_acc(S x) { return x; }
    FC_DEVICE S from_acc(Acc a) { return a; }
    FC_DEVICE void unpack(const fc_vec16& v, Acc (&a)[VEC]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) a[k] = (fc_i32)v.w[k];
    }
    FC_DEVICE fc_vec16 pack(const Acc (&a)[VEC]) {
        fc_vec16 v;
#pragma unroll
        for (int k = 0; k < 4; ++k) v.w[k] = (fc_u32)a[k];
        return v;
    }
};

// ===========================================================================
// Reduction rule (protocol.md): acc = x_0; acc = combine(acc, x_r) for
// r = 1..world-1 in rank order; avg divides by world at the end. Floats
// accumulate in f32 with no FMA contraction; i32 wraps.

template <int OP>
struct Op;
template <>
struct Op<FC_OP_SUM> {
    FC_DEVICE float apply(float a, float b) { return fc_fadd(a, b); }
    FC_DEVICE fc_i32 apply(fc_i32 a, fc_i32 b) { return (fc_i32)((fc_u32)a + (fc_u32)b); }
};
template <>
struct Op<FC_OP_AVG> {
    FC_DEVICE float apply(float a, float b) { return fc_fadd(a, b); }
    FC_DEVICE fc_i32 apply(fc_i32 a, fc_i32 b) { return (fc_i32)((fc_u32)a + (fc_u32)b); }
};
template <>
struct Op<FC_OP_PROD> {
    FC_DEVICE float apply(float a, float b) { return fc_fmul(a, b); }
    FC_DEVICE fc_i32 apply(fc_i32 a, fc_i32 b) { return (fc_i32)((fc_u32)a * (fc_u32)b); }
};
template <>
struct Op<FC_OP_MIN> {
    FC_DEVICE float apply(float a, float b) { return fc_fmin(a, b); }
    FC_DEVICE fc_i32 apply(fc_i32 a, fc_i32 b) { return b < a ? b : a; }
};
template <>
struct Op<FC_OP_MAX> {
    FC_DEVICE float apply(float a, float b) { return fc_fmax(a, b); }
    FC_DEVICE fc_i32 apply(fc_i32 a, fc_i32 b) { return b > a ? b : a; }
};

// avg: acc / world, correctly rounded (as the host's f32 division), without a
// division instruction (its slow path is a call that costs registers):
// - world a power of two: one multiply by 1/world, which is exact scaling;
// - otherwise in f64: y = RN(1/n), q = RN(x*y), r = x - q*n (exact with FMA),
//   q' = RN(q + r*y) is RN64(x/n) (Markstein, no under/overflow in f64 for
//   f32 inputs), and rounding that to f32 is RN32(x/n) since 53 >= 2*24+2.
//   Checked exhaustively against f32 division for all 2^32 inputs, n = 1..8.
//   r == 0 (exact, or x = +-0) and r NaN (x = +-inf or NaN) keep q.
struct AvgDiv {
    double y; // RN(1/n)
    float n;  // exact
};

FC_DEVICE AvgDiv make_avg(fc_u32 world) {
    AvgDiv d;
    d.n = (float)world;
    switch (world) {
        case 3: d.y = 1.0 / 3.0; break;
        case 5: d.y = 1.0 / 5.0; break;
        case 6: d.y = 1.0 / 6.0; break;
        case 7: d.y = 1.0 / 7.0; break;
        case 2: d.y = 0.5; break;
        case 4: d.y = 0.25; break;
        case 8: d.y = 0.125; break;
        default: d.y = 1.0; d.n = 1.0f; break; // world 1 (others are never launched)
    }
    return d;
}

FC_DEVICE float avg_div(float x, const AvgDiv& d) {
    const double xd = fc_f32_to_f64(x);
    const double q = fc_dmul(xd, d.y);
    const double r = fc_dfma(-q, fc_f32_to_f64(d.n), xd);
    const double q2 = fc_dfma(r, d.y, q);
    return fc_f64_to_f32((r == 0.0 || r != r) ? q : q2);
}

template <int OP>
FC_DEVICE float finish(float acc, const AvgDiv& d) {
    return OP == FC_OP_AVG ? avg_div(acc, d) : acc;
}
template <int OP>
FC_DEVICE fc_i32 finish(fc_i32 acc, const AvgDiv&) {
    return acc;
}

template <int W>
FC_DEVICE float avg_pow2(float acc) {
    return fc_fmul(acc, 1.0f / (float)W);
}
template <int W>
FC_DEVICE fc_i32 avg_pow2(fc_i32 acc) {
    return acc;
}

// acc[k] = combine(acc[k], pack r[k]) for the packs of ranks r0..r0+N-1 (those
// below `world` when GEN), in rank order.
template <class T, int OP, int N, bool GEN>
FC_DEVICE void accumulate(typename T::Acc (&a)[T::VEC], const fc_vec16 (&v)[N], int r0, fc_u32 world) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        if (GEN && (fc_u32)(r0 + j) >= world) break;
        typename T::Acc x[T::VEC];
        T::unpack(v[j], x);
#pragma unroll
        for (int k = 0; k < T::VEC; ++k) a[k] = Op<OP>::apply(a[k], x[k]);
    }
}

// The avg division (no-op for the other ops), then narrowing to storage.
template <class T, int OP, int W, bool GEN>
FC_DEVICE fc_vec16 finish_pack(typename T::Acc (&a)[T::VEC], const AvgDiv& avg) {
    if (OP == FC_OP_AVG) {
        if (!GEN && (W & (W - 1)) == 0) {
#pragma unroll
            for (int k = 0; k < T::VEC; ++k) a[k] = avg_pow2<W>(a[k]);
        } else {
#pragma unroll
            for (int k = 0; k < T::VEC; ++k) a[k] = finish<OP>(a[k], avg);
        }
    }
    return T::pack(a);
}

// Reduce the packs of ranks 0..W-1 element-wise, in rank order.
template <class T, int OP, int W>
FC_DEVICE fc_vec16 reduce_pack(const fc_vec16 (&v)[W], const AvgDiv& avg) {
    typename T::Acc a[T::VEC];
    T::unpack(v[0], a);
    fc_vec16 rest[W - 1 > 0 ? W - 1 : 1];
#pragma unroll
    for (int r = 1; r < W; ++r) rest[r - 1] = v[r];
    if (W > 1) accumulate<T, OP, (W - 1 > 0 ? W - 1 : 1), false>(a, rest, 1, W);
    return finish_pack<T, OP, W, false>(a, avg);
}

// ===========================================================================
// Geometry (protocol.md "Kernels").

struct Range {
    fc_u64 lo, hi;
};

FC_DEVICE fc_u64 div_ceil(fc_u64 a, fc_u64 b) { return (a + b - 1) / b; }
FC_DEVICE fc_u64 round_up8(fc_u64 x) { return (x + 7) & ~(fc_u64)7; }
FC_DEVICE fc_u64 min_u64(fc_u64 a, fc_u64 b) { return a < b ? a : b; }
FC_DEVICE bool aligned16(fc_u64 addr) { return (addr & 15) == 0; }

// Block b of nb over [0, n): [b*per, min((b+1)*per, n)), per = ceil(n/nb) rounded up to 8.
FC_DEVICE Range block_range(fc_u64 n, fc_u32 b, fc_u32 nb) {
    const fc_u64 per = round_up8(div_ceil(n, nb));
    Range r;
    r.lo = min_u64((fc_u64)b * per, n);
    r.hi = min_u64(r.lo + per, n);
    return r;
}

// Two-shot: sub-range b (of size per) of segment s = [s*seg, min((s+1)*seg, count)).
FC_DEVICE Range sub_range(fc_u64 count, fc_u64 seg, fc_u64 per, fc_u32 s, fc_u32 b) {
    const fc_u64 start = (fc_u64)s * seg;
    const fc_u64 len = start < count ? min_u64(seg, count - start) : 0;
    Range r;
    r.lo = start + min_u64((fc_u64)b * per, len);
    r.hi = start + min_u64((fc_u64)b * per + per, len);
    return r;
}

// ===========================================================================
// Workspace addresses (src/algo/layout.rs; offsets come in the params).

FC_DEVICE fc_u32* flag_ptr(const FcParams& p, char* ws, fc_u32 phase, fc_u32 b, fc_u32 src) {
    return reinterpret_cast<fc_u32*>(ws + p.flags_offset + ((phase * FC_MAX_BLOCKS + b) * FC_MAX_RANKS + src) * 4u);
}
FC_DEVICE fc_u64* fp_ptr(const FcParams& p, char* ws, fc_u32 parity, fc_u32 b, fc_u32 src) {
    return reinterpret_cast<fc_u64*>(ws + p.fp_offset + ((parity * FC_MAX_BLOCKS + b) * FC_MAX_RANKS + src) * 8u);
}
FC_DEVICE fc_u64 slot_offset(const FcParams& p, fc_u32 slot) { return p.data_offset + (fc_u64)slot * p.slot_bytes; }

// ===========================================================================
// Errors (params.rs: [0] code, first writer wins; [1] mask of ranks that
// never arrived; [2] 1 + rank whose fingerprint differed; [3] failed epoch).
// The detail words are written before the code, so a host that sees a
// nonzero code also sees them.

FC_DEVICE void raise_timeout(const FcParams& p, fc_u32 src, fc_u32 epoch) {
    if (p.error_flags == 0) return;
    fc_u32* err = fc_ptr<fc_u32>(p.error_flags);
    fc_atomic_or_sys(err + 1, 1u << src);
    fc_atomic_exch_sys(err + 3, epoch);
    fc_fence_sys();
    fc_atomic_cas_sys(err + 0, FC_ERR_CODE_NONE, FC_ERR_CODE_TIMEOUT);
}

FC_DEVICE void raise_mismatch(const FcParams& p, fc_u32 src, fc_u32 epoch) {
    if (p.error_flags == 0) return;
    fc_u32* err = fc_ptr<fc_u32>(p.error_flags);
    fc_atomic_cas_sys(err + 2, 0u, src + 1);
    fc_atomic_exch_sys(err + 3, epoch);
    fc_fence_sys();
    fc_atomic_cas_sys(err + 0, FC_ERR_CODE_NONE, FC_ERR_CODE_MISMATCH);
}

// ===========================================================================
// Arrive / wait for phase `phase` of block b. Returns false (for the whole
// block) on a timeout or a fingerprint mismatch; the caller then returns at
// once, without touching the epoch.
//
// Thread q < world does the work for peer q / source q, so the world release
// stores and spins run side by side in one warp (same stores and loads as a
// single thread doing them in a loop).

FC_DEVICE bool arrived(fc_u32 flag, fc_u32 epoch) { return (fc_i32)(flag - epoch) >= 0; }

FC_DEVICE bool arrive_wait(const FcParams& p, char* own, fc_u32 epoch, fc_u32 parity, fc_u32 phase, fc_u32 b) {
    fc_barrier(); // every write of this block is issued before the release
    const fc_u32 q = fc_thread_id();
    bool failed = false;
    if (q < p.world) {
        char* peer = fc_ptr<char>(p.peer_ws[q]);
        if (phase == 0) fc_st_volatile_u64(fp_ptr(p, peer, parity, b, p.rank), p.fingerprint);
        fc_st_release_sys(flag_ptr(p, peer, phase, b, p.rank), epoch);

        const fc_u32* flag = flag_ptr(p, own, phase, b, q);
        if (!arrived(fc_ld_acquire_sys(flag), epoch)) {
            const fc_u64 start = fc_globaltimer_ns();
            for (;;) {
                if (arrived(fc_ld_acquire_sys(flag), epoch)) break;
                if (fc_globaltimer_ns() - start >= p.timeout_ns) {
                    raise_timeout(p, q, epoch);
                    failed = true;
                    break;
                }
            }
        }
        if (!failed && phase == 0 && fc_ld_volatile_u64(fp_ptr(p, own, parity, b, q)) != p.fingerprint) {
            raise_mismatch(p, q, epoch);
            failed = true;
        }
    }
    return !fc_barrier_or(failed);
}

// End of a launch: the last block to finish resets blocks_done and publishes
// epoch = E. Every thread of this block read the epoch before the first
// arrive_wait barrier, so no block can still be about to read it.
FC_DEVICE void complete(char* own, fc_u32 epoch) {
    if (fc_thread_id() != 0) return;
    fc_u32* ctrl = reinterpret_cast<fc_u32*>(own); // [0] epoch, [1] blocks_done
    if (fc_atomic_add_gpu(ctrl + 1, 1u) == fc_grid_blocks() - 1) {
        fc_st_volatile(ctrl + 1, 0u);
        fc_fence_gpu();
        fc_st_volatile(ctrl + 0, epoch);
    }
}

// ===========================================================================
// Copy elements [lo, hi) of size ES from src to dst (both indexed from element
// 0). 16-byte vectors, U in flight per thread, when both sides are aligned;
// element-wise otherwise and for the tail.

template <int ES>
struct Elem;
template <>
struct Elem<2> {
    typedef fc_u16 T;
};
template <>
struct Elem<4> {
    typedef fc_u32 T;
};

template <int ES>
FC_DEVICE void copy_scalar(char* dst, const char* src, fc_u64 lo, fc_u64 hi) {
    typedef typename Elem<ES>::T E;
    const fc_u32 nt = fc_block_threads();
    E* d = reinterpret_cast<E*>(dst);
    const E* s = reinterpret_cast<const E*>(src);
    for (fc_u64 e = lo + fc_thread_id(); e < hi; e += nt) fc_store(d + e, fc_load(s + e));
}

template <int ES, int U>
FC_DEVICE void copy_range(char* dst, const char* src, fc_u64 lo, fc_u64 hi, bool aligned) {
    const fc_u64 VEC = 16 / ES;
    fc_u64 tail = lo;
    if (aligned) {
        const fc_u32 nt = fc_block_threads();
        const fc_u64 nvec = (hi - lo) / VEC;
        char* d = dst + lo * ES; // lo is a multiple of 8 elements: 16-byte aligned
        const char* s = src + lo * ES;
        fc_u64 i = fc_thread_id();
        if (U > 1) {
            for (; i + (fc_u64)(U - 1) * nt < nvec; i += (fc_u64)U * nt) {
                fc_vec16 v[U];
#pragma unroll
                for (int u = 0; u < U; ++u) v[u] = fc_load16(s + (i + (fc_u64)u * nt) * 16);
#pragma unroll
                for (int u = 0; u < U; ++u) fc_store16(d + (i + (fc_u64)u * nt) * 16, v[u]);
            }
        }
        for (; i < nvec; i += nt) fc_store16(d + i * 16, fc_load16(s + i * 16));
        tail = lo + nvec * VEC;
    }
    copy_scalar<ES>(dst, src, tail, hi);
}

// ===========================================================================
// Reduce elements [lo, hi) over every rank's workspace at byte offset src_off
// (rule above), writing to out and, if DUAL, also to out2 (a workspace slot).

template <class T, int OP, bool DUAL>
FC_DEVICE void reduce_scalar(const FcParams& p, fc_u64 src_off, fc_u64 lo, fc_u64 hi, char* out, char* out2) {
    typedef typename T::S S;
    typedef typename T::Acc Acc;
    const fc_u32 nt = fc_block_threads();
    const fc_u32 world = p.world;
    const AvgDiv avg = make_avg(world);
    for (fc_u64 e = lo + fc_thread_id(); e < hi; e += nt) {
        const fc_u64 off = src_off + e * sizeof(S);
        Acc a = T::to_acc(fc_load(fc_ptr<const S>(p.peer_ws[0] + off)));
        for (fc_u32 r = 1; r < world; ++r) a = Op<OP>::apply(a, T::to_acc(fc_load(fc_ptr<const S>(p.peer_ws[r] + off))));
        const S s = T::from_acc(finish<OP>(a, avg));
        fc_store(reinterpret_cast<S*>(out) + e, s);
        if (DUAL) fc_store(reinterpret_cast<S*>(out2) + e, s);
    }
}

// Vector reduce of packs [0, nvec) starting at element lo, for W ranks known
// at compile time: each thread issues U packs x W ranks of 16-byte loads
// before the first add.
template <class T, int OP, bool DUAL, int W, int U>
FC_DEVICE void reduce_vec(const FcParams& p, fc_u64 src_off, fc_u64 lo, fc_u64 nvec, char* out, char* out2) {
    const fc_u32 nt = fc_block_threads();
    const AvgDiv avg = make_avg(W);
    const fc_u64 byte0 = lo * sizeof(typename T::S);
    // Rank r's pack i is at p.peer_ws[r] + src0 + i*16; the bases stay in the
    // parameter bank instead of taking 2*W registers.
    const fc_u64 src0 = src_off + byte0;
    char* dst = out + byte0;
    char* dst2 = DUAL ? out2 + byte0 : out2;

    fc_u64 i = fc_thread_id();
    if (U > 1) {
        for (; i + (fc_u64)(U - 1) * nt < nvec; i += (fc_u64)U * nt) {
            fc_vec16 v[U][W];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int r = 0; r < W; ++r)
                    v[u][r] = fc_load16(fc_ptr<const char>(p.peer_ws[r] + src0 + (i + (fc_u64)u * nt) * 16));
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const fc_vec16 res = reduce_pack<T, OP, W>(v[u], avg);
                fc_store16(dst + (i + (fc_u64)u * nt) * 16, res);
                if (DUAL) fc_store16(dst2 + (i + (fc_u64)u * nt) * 16, res);
            }
        }
    }
    for (; i < nvec; i += nt) {
        fc_vec16 v[W];
#pragma unroll
        for (int r = 0; r < W; ++r) v[r] = fc_load16(fc_ptr<const char>(p.peer_ws[r] + src0 + i * 16));
        const fc_vec16 res = reduce_pack<T, OP, W>(v, avg);
        fc_store16(dst + i * 16, res);
        if (DUAL) fc_store16(dst2 + i * 16, res);
    }
}

// The same for a world known only at run time (1..MAX_RANKS; used for 3, 5,
// 6, 7): ranks 0..3 are loaded together, then ranks 4..world-1 together.
template <class T, int OP, bool DUAL>
FC_DEVICE void reduce_vec_any(const FcParams& p, fc_u64 src_off, fc_u64 lo, fc_u64 nvec, char* out, char* out2) {
    const fc_u32 nt = fc_block_threads();
    const fc_u32 world = p.world;
    const AvgDiv avg = make_avg(world);
    const fc_u64 byte0 = lo * sizeof(typename T::S);
    const fc_u64 src0 = src_off + byte0;
    char* dst = out + byte0;
    char* dst2 = DUAL ? out2 + byte0 : out2;

    for (fc_u64 i = fc_thread_id(); i < nvec; i += nt) {
        const fc_u64 off = src0 + i * 16;
        fc_vec16 v[4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
            if ((fc_u32)r < world) v[r] = fc_load16(fc_ptr<const char>(p.peer_ws[r] + off));
        typename T::Acc a[T::VEC];
        T::unpack(v[0], a);
        fc_vec16 w3[3] = {v[1], v[2], v[3]};
        accumulate<T, OP, 3, true>(a, w3, 1, world);
        if (world > 4) {
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if ((fc_u32)(4 + r) < world) v[r] = fc_load16(fc_ptr<const char>(p.peer_ws[4 + r] + off));
            accumulate<T, OP, 4, true>(a, v, 4, world);
        }
        const fc_vec16 res = finish_pack<T, OP, FC_MAX_RANKS, true>(a, avg);
        fc_store16(dst + i * 16, res);
        if (DUAL) fc_store16(dst2 + i * 16, res);
    }
}

// BW: bandwidth mode (two-shot): two packs per thread in flight for small
// worlds. Worlds 2, 4 and 8 get exact code; 3, 5, 6, 7 share one variant that
// loads from up to 8 ranks under a run-time bound.
template <class T, int OP, bool DUAL, bool BW>
FC_DEVICE void reduce_range(const FcParams& p, fc_u64 src_off, fc_u64 lo, fc_u64 hi, char* out, char* out2,
                            bool out_aligned) {
    fc_u64 tail = lo;
    if (out_aligned && p.world >= 2 && p.world <= FC_MAX_RANKS) {
        const fc_u64 nvec = (hi - lo) / T::VEC;
        switch (p.world) {
            case 2: reduce_vec<T, OP, DUAL, 2, BW ? FC_REDUCE_UNROLL : 1>(p, src_off, lo, nvec, out, out2); break;
            case 4: reduce_vec<T, OP, DUAL, 4, BW ? FC_REDUCE_UNROLL : 1>(p, src_off, lo, nvec, out, out2); break;
            case 8: reduce_vec<T, OP, DUAL, 8, 1>(p, src_off, lo, nvec, out, out2); break;
            default: reduce_vec_any<T, OP, DUAL>(p, src_off, lo, nvec, out, out2); break;
        }
        tail = lo + nvec * T::VEC;
    }
    reduce_scalar<T, OP, DUAL>(p, src_off, tail, hi, out, out2);
}

// ===========================================================================
// The protocols.

// One-shot: stage own input range in own slot `parity`; arrive/wait phase 0;
// reduce the range from every rank's slot `parity` into the output.
template <class T, int OP>
FC_DEVICE void oneshot(const FcParams& p) {
    const int ES = sizeof(typename T::S);
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 b = fc_block_id();
    const Range r = block_range(p.count, b, fc_grid_blocks());
    const fc_u64 slot = slot_offset(p, parity);

    copy_range<ES, 1>(own + slot, fc_ptr<const char>(p.input), r.lo, r.hi, aligned16(p.input));
    if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
    reduce_range<T, OP, false, false>(p, slot, r.lo, r.hi, fc_ptr<char>(p.output), nullptr, aligned16(p.output));
    complete(own, epoch);
}

// Two-shot: stage every segment's sub-range b in own slot `parity`; phase 0;
// reduce own segment's sub-range b into the output and own slot 2+parity;
// phase 1; copy every other segment's sub-range b from its owner's slot
// 2+parity into the output.
template <class T, int OP>
FC_DEVICE void twoshot(const FcParams& p) {
    const int ES = sizeof(typename T::S);
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 world = p.world;
    const fc_u64 seg = round_up8(div_ceil(p.count, world));
    const fc_u64 per = round_up8(div_ceil(seg, fc_grid_blocks()));
    const fc_u64 stage_slot = slot_offset(p, parity);
    const fc_u64 result_slot = slot_offset(p, 2 + parity);
    const bool in_aligned = aligned16(p.input);
    const bool out_aligned = aligned16(p.output);
    char* output = fc_ptr<char>(p.output);

    for (fc_u32 s = 0; s < world; ++s) {
        const Range r = sub_range(p.count, seg, per, s, b);
        copy_range<ES, FC_COPY_UNROLL>(own + stage_slot, fc_ptr<const char>(p.input), r.lo, r.hi, in_aligned);
    }
    if (!arrive_wait(p, own, epoch, parity, 0, b)) return;

    const Range mine = sub_range(p.count, seg, per, p.rank, b);
    reduce_range<T, OP, true, true>(p, stage_slot, mine.lo, mine.hi, output, own + result_slot, out_aligned);
    if (!arrive_wait(p, own, epoch, parity, 1, b)) return;

    // Every other segment, in an order staggered by block so that at any time
    // the blocks pull from all peers at once (one peer's links alone would
    // cap the bandwidth).
    for (fc_u32 k = 0; k + 1 < world; ++k) {
        const fc_u32 s = (p.rank + 1 + (k + b) % (world - 1)) % world;
        const Range r = sub_range(p.count, seg, per, s, b);
        copy_range<ES, FC_COPY_UNROLL>(output, fc_ptr<const char>(p.peer_ws[s] + result_slot), r.lo, r.hi, out_aligned);
    }
    complete(own, epoch);
}

// Broadcast: the root stages its input range in its slot `parity`; phase 0;
// every rank copies the range from the root's slot into its output.
template <int ES>
FC_DEVICE void broadcast(const FcParams& p) {
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 b = fc_block_id();
    const Range r = block_range(p.count, b, fc_grid_blocks());
    const fc_u64 slot = slot_offset(p, parity);

    if (p.rank == p.root) copy_range<ES, FC_COPY_UNROLL>(own + slot, fc_ptr<const char>(p.input), r.lo, r.hi, aligned16(p.input));
    if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
    copy_range<ES, FC_COPY_UNROLL>(fc_ptr<char>(p.output), fc_ptr<const char>(p.peer_ws[p.root] + slot), r.lo, r.hi,
                      aligned16(p.output));
    complete(own, epoch);
}

} // namespace fc

// ===========================================================================
// Entry points: every name in ferrocomm::algo::kernels::all_kernel_names().

#define FC_REDUCE_KERNELS(DT, TYPE, OPNAME, OP)                        \
    FC_KERNEL(fc_oneshot_##DT##_##OPNAME) { fc::oneshot<TYPE, OP>(p); } \
    FC_KERNEL(fc_twoshot_##DT##_##OPNAME) { fc::twoshot<TYPE, OP>(p); }

#define FC_BROADCAST_KERNEL(DT, TYPE) \
    FC_KERNEL(fc_broadcast_##DT##_sum) { fc::broadcast<(int)sizeof(TYPE::S)>(p); }

#define FC_FLOAT_KERNELS(DT, TYPE)                   \
    FC_REDUCE_KERNELS(DT, TYPE, sum, FC_OP_SUM)      \
    FC_REDUCE_KERNELS(DT, TYPE, prod, FC_OP_PROD)    \
    FC_REDUCE_KERNELS(DT, TYPE, min, FC_OP_MIN)      \
    FC_REDUCE_KERNELS(DT, TYPE, max, FC_OP_MAX)      \
    FC_REDUCE_KERNELS(DT, TYPE, avg, FC_OP_AVG)      \
    FC_BROADCAST_KERNEL(DT, TYPE)

FC_FLOAT_KERNELS(f32, fc::TF32)
FC_FLOAT_KERNELS(f16, fc::TF16)
FC_FLOAT_KERNELS(bf16, fc::TBF16)

// i32: sum, min, max (prod and avg are not defined for i32; see DType::supports).
FC_REDUCE_KERNELS(i32, fc::TI32, sum, FC_OP_SUM)
FC_REDUCE_KERNELS(i32, fc::TI32, min, FC_OP_MIN)
FC_REDUCE_KERNELS(i32, fc::TI32, max, FC_OP_MAX)
FC_BROADCAST_KERNEL(i32, fc::TI32)
