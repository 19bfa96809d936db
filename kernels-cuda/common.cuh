// ferrocomm device code shared by every kernel module: element types, the
// reduction rule, geometry, workspace addresses, errors, arrive/wait,
// copies and reductions.
//
// Vendor neutral: everything vendor specific (PTX, atomics, the timer, vector
// types, fences, thread indices, barriers, fp16/bf16) comes from the prelude's
// fc_* functions, so the HIP prelude reuses this file unchanged. No inline
// asm here, and nothing assumes a warp size.
//
// The contract is docs/protocol.md, with the workspace layout of
// src/algo/layout.rs and the parameter block of src/device/params.rs (FcParams
// in the prelude). A module's text is prelude + lamport.cuh + this file + the
// module's kernels, joined by newlines (src/algo/kernels.rs); the includes
// below only serve standalone compiles.

#ifndef FC_COMMON_INCLUDED
#define FC_COMMON_INCLUDED

#ifndef FC_PRELUDE_INCLUDED
#include "prelude.cuh"
#endif
#ifndef FC_LAMPORT_INCLUDED
#include "lamport.cuh"
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
// The bitwise ops are integer only (DType::supports); no float entry point
// instantiates their float overload.
template <>
struct Op<FC_OP_BAND> {
    FC_DEVICE float apply(float a, float) { return a; }
    FC_DEVICE fc_i32 apply(fc_i32 a, fc_i32 b) { return a & b; }
};
template <>
struct Op<FC_OP_BOR> {
    FC_DEVICE float apply(float a, float) { return a; }
    FC_DEVICE fc_i32 apply(fc_i32 a, fc_i32 b) { return a | b; }
};
template <>
struct Op<FC_OP_BXOR> {
    FC_DEVICE float apply(float a, float) { return a; }
    FC_DEVICE fc_i32 apply(fc_i32 a, fc_i32 b) { return a ^ b; }
};

// premul_sum (reduce-to only): sources are scaled by their factors before
// they reach the combine, which is then a sum (see reduce_premul).
template <>
struct Op<FC_OP_PREMUL> {
    FC_DEVICE float apply(float a, float b) { return fc_fadd(a, b); }
    FC_DEVICE fc_i32 apply(fc_i32 a, fc_i32 b) { return (fc_i32)((fc_u32)a + (fc_u32)b); }
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
// Aux words (layout.rs, AUX_OFFSET): u64 [2 parity][MAX_BLOCKS][AUX_WORDS][MAX_RANKS],
// right after the flags, written by sources at phase 0 next to their fingerprint.
#define FC_FLAGS_BYTES (2ull * FC_MAX_BLOCKS * FC_MAX_RANKS * 4ull)
#define FC_AUX_WORDS 5u
#define FC_AUX_PAIR_COUNT 0u
#define FC_AUX_LARGEST 1u
#define FC_AUX_FACTOR 2u
#define FC_AUX_RECV_AT 3u
#define FC_AUX_EXPECTS 4u
#define FC_AUX_NOT_DIRECT 0xffffffffffffffffull
FC_DEVICE fc_u64* aux_ptr(const FcParams& p, char* ws, fc_u32 parity, fc_u32 b, fc_u32 k, fc_u32 src) {
    return reinterpret_cast<fc_u64*>(
        ws + p.flags_offset + FC_FLAGS_BYTES +
        ((((fc_u64)parity * FC_MAX_BLOCKS + b) * FC_AUX_WORDS + k) * FC_MAX_RANKS + src) * 8u);
}
// Parity region of a launch: slots 2*parity and 2*parity + 1.
FC_DEVICE fc_u64 region_offset(const FcParams& p, fc_u32 parity) {
    return p.data_offset + (fc_u64)parity * 2u * p.slot_bytes;
}
// Push one-shot: one sub-buffer per source in the whole parity region.
FC_DEVICE fc_u64 push1_stride(const FcParams& p) { return ((2u * p.slot_bytes) / p.world) & ~(fc_u64)63; }
// Push two-shot: one inbox per source in the region's first slot.
FC_DEVICE fc_u64 push2_stride(const FcParams& p) { return (p.slot_bytes / p.world) & ~(fc_u64)63; }

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

// arrive: after the block barrier, thread q < world stores (phase 0) our
// fingerprint and releases flag E at peer q.
FC_DEVICE void arrive(const FcParams& p, fc_u32 epoch, fc_u32 parity, fc_u32 phase, fc_u32 b) {
    fc_barrier(); // every write of this block is issued before the release
    const fc_u32 q = fc_thread_id();
    if (q < p.world) {
        char* peer = fc_ptr<char>(p.peer_ws[q]);
        if (phase == 0) fc_st_volatile_u64(fp_ptr(p, peer, parity, b, p.rank), p.fingerprint);
        fc_st_release_sys(flag_ptr(p, peer, phase, b, p.rank), epoch);
    }
}

FC_DEVICE bool ll_crossed(const FcParams& p, char* own, fc_u32 parity, fc_u32 b, fc_u32 src, fc_u32 epoch);

// A wait that has spun this long looks, every as long again, at what a
// quick wait never needs: whether the host aborted the communicator (the
// error word, host-mapped: a read over the bus), and whether the source it
// waits for started this epoch with the other protocol of a launch's first
// handshake (a different call: a mismatch, not a timeout).
#define FC_SLOW_WAIT_NS 100000ull

FC_DEVICE bool host_aborted(const FcParams& p) {
    return p.error_flags != 0 && fc_ld_volatile(fc_ptr<fc_u32>(p.error_flags)) != FC_ERR_CODE_NONE;
}

// wait: thread q < world spins on source q's flag (and checks its
// fingerprint in phase 0); false for the whole block on a failure.
FC_DEVICE bool wait_phase(const FcParams& p, char* own, fc_u32 epoch, fc_u32 parity, fc_u32 phase, fc_u32 b) {
    const fc_u32 q = fc_thread_id();
    bool failed = false;
    if (q < p.world) {
        const fc_u32* flag = flag_ptr(p, own, phase, b, q);
        if (!arrived(fc_ld_acquire_sys(flag), epoch)) {
            const fc_u64 start = fc_globaltimer_ns();
            fc_u64 look = start + FC_SLOW_WAIT_NS;
            for (;;) {
                if (arrived(fc_ld_acquire_sys(flag), epoch)) break;
                const fc_u64 now = fc_globaltimer_ns();
                if (now - start >= p.timeout_ns) {
                    raise_timeout(p, q, epoch);
                    failed = true;
                    break;
                }
                if (now >= look) {
                    look = now + FC_SLOW_WAIT_NS;
                    if (phase == 0 && ll_crossed(p, own, parity, b, q, epoch)) {
                        raise_mismatch(p, q, epoch);
                        failed = true;
                        break;
                    }
                    if (host_aborted(p)) {
                        failed = true;
                        break;
                    }
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

FC_DEVICE bool arrive_wait(const FcParams& p, char* own, fc_u32 epoch, fc_u32 parity, fc_u32 phase, fc_u32 b) {
    arrive(p, epoch, parity, phase, b);
    return wait_phase(p, own, epoch, parity, phase, b);
}

// End of a launch: the last block to finish resets blocks_done and publishes
// epoch = E. Every thread of this block read the epoch before the first
// arrive_wait barrier, so no block can still be about to read it. A grid of
// one block is trivially the last (blocks_done stays 0).
FC_DEVICE void complete(char* own, fc_u32 epoch) {
    if (fc_thread_id() != 0) return;
    fc_u32* ctrl = reinterpret_cast<fc_u32*>(own); // [0] epoch, [1] blocks_done
    if (fc_grid_blocks() == 1) {
        fc_st_volatile(ctrl + 0, epoch);
        return;
    }
    if (fc_atomic_add_gpu(ctrl + 1, 1u) == fc_grid_blocks() - 1) {
        fc_st_volatile(ctrl + 1, 0u);
        fc_fence_gpu();
        fc_st_volatile(ctrl + 0, epoch);
    }
}

// ===========================================================================
// LL lines (protocol.md "One-shot, LL"), shared by the LL collectives and the
// fused LL one-shot. Data travels in 16-byte lines of two 8-byte units
// {data word, flag}: 8 data bytes a line, flag = E | 1. Each unit is one
// 64-bit access (single-copy atomic), so a unit whose flag matches this
// launch's carries this launch's data; readers clear what they read to 0,
// which no launch writes. No fence, flag or block barrier sits between the
// data and its reader.

#define FC_LL_FP_BYTES (2ull * FC_MAX_BLOCKS * FC_MAX_RANKS * 16ull)

FC_DEVICE fc_u64 ll_offset(const FcParams& p) { return p.data_offset + 4u * p.slot_bytes; }
FC_DEVICE fc_u64 ll_fp_offset(const FcParams& p, fc_u32 parity, fc_u32 b, fc_u32 src) {
    return ll_offset(p) + ((fc_u64)(parity * FC_MAX_BLOCKS + b) * FC_MAX_RANKS + src) * 16u;
}
FC_DEVICE fc_u64 ll_stride(const FcParams& p) { return ((p.slot_bytes / 2u) / p.world) & ~(fc_u64)63; }
// Lines from source 0 of this parity; source s's start s * ll_stride later.
FC_DEVICE fc_u64 ll_lines_offset(const FcParams& p, fc_u32 parity) {
    return ll_offset(p) + FC_LL_FP_BYTES + (fc_u64)parity * (p.slot_bytes / 2u);
}

// The Lamport area (the fused LL one-shot's rows), after the LL lines:
// [2 parity][world source] x lamport_stride, slot_bytes / 4 a parity. Rows
// travel as they are, in 16-byte Lamport packs (lamport.cuh), half the LL
// lines' bytes. The reuse of a parity at E + 2 rests on the LL handshake
// records, as the LL lines' does.
FC_DEVICE fc_u64 lamport_offset(const FcParams& p, fc_u32 parity) {
    return ll_offset(p) + FC_LL_FP_BYTES + p.slot_bytes + (fc_u64)parity * (p.slot_bytes / 4u);
}
FC_DEVICE fc_u64 lamport_stride(const FcParams& p) { return ((p.slot_bytes / 4u) / p.world) & ~(fc_u64)63; }

FC_DEVICE fc_u64 ll_unit(fc_u32 word, fc_u32 flag) { return ((fc_u64)flag << 32) | (fc_u64)word; }

// A line as loaded (ll_fetch), and whether both its units carry `flag`
// (ll_arrived), apart: a reader of several lines issues every load before
// it tests any, or each test waits for its load before the next load
// issues (ll_wait's compiled polls did).
struct LlLine {
    fc_u64 a, b;
};
FC_DEVICE LlLine ll_fetch(const char* line) {
    LlLine l;
    fc_ld_volatile_v2u64(line, l.a, l.b);
    return l;
}
FC_DEVICE bool ll_arrived(const LlLine& l, fc_u32 flag) {
    return ((fc_u32)(l.a >> 32) == flag) & ((fc_u32)(l.b >> 32) == flag);
}
// One line into (w0, w1); true when it has arrived.
FC_DEVICE bool ll_load(const char* line, fc_u32 flag, fc_u32& w0, fc_u32& w1) {
    const LlLine l = ll_fetch(line);
    w0 = (fc_u32)l.a;
    w1 = (fc_u32)l.b;
    return ll_arrived(l, flag);
}

// The LL kinds' handshake, per block: thread q < world (q != rank) stores
// our fingerprint record {fp_lo, flag}, {fp_hi, flag} at peer q's record
// [parity][b][rank]. Every LL kind sends and awaits it with every peer, also
// one it moves no data with: it is the evidence that each peer started this
// launch, on which the reuse of the LL area at E + 2 rests.
FC_DEVICE void ll_send_record(const FcParams& p, fc_u32 parity, fc_u32 b, fc_u32 flag) {
    const fc_u32 t = fc_thread_id();
    if (t < p.world && t != p.rank)
        fc_st_volatile_v2u64(fc_ptr<char>(p.peer_ws[t] + ll_fp_offset(p, parity, b, p.rank)),
                             ll_unit((fc_u32)p.fingerprint, flag), ll_unit((fc_u32)(p.fingerprint >> 32), flag));
}

// Whether source `src` sent this launch's LL record (epoch's flag) with
// another fingerprint than ours: it runs an LL kind where we run one on the
// flags (wait_phase's slow path).
FC_DEVICE bool ll_crossed(const FcParams& p, char* own, fc_u32 parity, fc_u32 b, fc_u32 src, fc_u32 epoch) {
    if (src == p.rank) return false;
    const fc_u32 flag = epoch | 1u;
    fc_u64 lo, hi;
    fc_ld_volatile_v2u64(own + ll_fp_offset(p, parity, b, src), lo, hi);
    return (fc_u32)(lo >> 32) == flag && (fc_u32)(hi >> 32) == flag &&
           ((lo & 0xffffffffull) | (hi << 32)) != p.fingerprint;
}

// Thread s < world (s != rank) waits for record [parity][b][s], clears it and
// compares it with our fingerprint. False (this thread) after raising a
// timeout or a mismatch for s; callers combine with fc_barrier_or.
FC_DEVICE bool ll_check_record(const FcParams& p, char* own, fc_u32 parity, fc_u32 b, fc_u32 flag, fc_u32 epoch) {
    const fc_u32 t = fc_thread_id();
    if (t >= p.world || t == p.rank) return true;
    char* rec = own + ll_fp_offset(p, parity, b, t);
    fc_u64 lo, hi;
    fc_ld_volatile_v2u64(rec, lo, hi);
    if ((fc_u32)(lo >> 32) != flag || (fc_u32)(hi >> 32) != flag) {
        const fc_u64 start = fc_globaltimer_ns();
        fc_u64 look = start + FC_SLOW_WAIT_NS;
        for (;;) {
            fc_ld_volatile_v2u64(rec, lo, hi);
            if ((fc_u32)(lo >> 32) == flag && (fc_u32)(hi >> 32) == flag) break;
            const fc_u64 now = fc_globaltimer_ns();
            if (now - start >= p.timeout_ns) {
                raise_timeout(p, t, epoch);
                return false;
            }
            if (now >= look) {
                look = now + FC_SLOW_WAIT_NS;
                // The source started this epoch (exactly: one already past it
                // left another launch's fingerprint in this parity's slot) on
                // the flags with another fingerprint: a different call.
                if (fc_ld_acquire_sys(flag_ptr(p, own, 0, b, t)) == epoch &&
                    fc_ld_volatile_u64(fp_ptr(p, own, parity, b, t)) != p.fingerprint) {
                    raise_mismatch(p, t, epoch);
                    return false;
                }
                if (host_aborted(p)) return false;
            }
        }
    }
    fc_st_volatile_v2u64(rec, 0ull, 0ull);
    if (((lo & 0xffffffffull) | (hi << 32)) != p.fingerprint) {
        raise_mismatch(p, t, epoch);
        return false;
    }
    return true;
}

// ===========================================================================
// Copy elements [lo, hi) of size ES from src to dst (both indexed from element
// 0). 16-byte vectors, U in flight per thread, when both sides are aligned;
// element-wise otherwise and for the tail.

template <int ES>
struct Elem;
// Bytes: the exchange moves any dtype as bytes (copy_range<1, U>; `lo` then
// a multiple of 16 where `aligned`).
template <>
struct Elem<1> {
    typedef fc_u8 T;
};
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
// Reduce elements [lo, hi): rank r's element e is at src_base(src, r) + e*ES
// (rule above); the result goes wherever dst puts element e.
//
// Sources: PeerSrc (pull: every rank's workspace at one offset; the bases stay
// in the parameter bank), StrideSrc (push: sub-buffers of our own
// workspace) or DirectSrc (direct reduce-to: every rank's block wherever it
// lies; registers, so only the vector paths take it, whose rank loops unroll
// to constant indices: a run-time index would put the array in scratch). Destinations: the output only, the output and one more buffer
// (pull two-shot: our result slot), or the output and every peer's buffer at
// one offset (push two-shot).

struct PeerSrc {
    const FcParams* p;
    fc_u64 off;
};
FC_DEVICE fc_u64 src_base(const PeerSrc& s, fc_u32 r) { return s.p->peer_ws[r] + s.off; }

struct StrideSrc {
    fc_u64 b0, stride;
};
FC_DEVICE fc_u64 src_base(const StrideSrc& s, fc_u32 r) { return s.b0 + (fc_u64)r * s.stride; }

struct DirectSrc {
    fc_u64 a[FC_MAX_RANKS];
};
FC_DEVICE fc_u64 src_base(const DirectSrc& s, fc_u32 r) { return s.a[r]; }

struct OutDst {
    char* out;
};
FC_DEVICE void dst_vec(const OutDst& d, fc_u64 byte, const fc_vec16& v) { fc_store16(d.out + byte, v); }
template <class S>
FC_DEVICE void dst_elem(const OutDst& d, fc_u64 byte, S s) {
    fc_store(reinterpret_cast<S*>(d.out + byte), s);
}

struct DualDst {
    char* out;
    char* out2;
};
FC_DEVICE void dst_vec(const DualDst& d, fc_u64 byte, const fc_vec16& v) {
    fc_store16(d.out + byte, v);
    fc_store16(d.out2 + byte, v);
}
template <class S>
FC_DEVICE void dst_elem(const DualDst& d, fc_u64 byte, S s) {
    fc_store(reinterpret_cast<S*>(d.out + byte), s);
    fc_store(reinterpret_cast<S*>(d.out2 + byte), s);
}

struct PushDst {
    const FcParams* p;
    char* out;
    fc_u64 off; // offset in every peer's workspace of element 0
};
FC_DEVICE void dst_vec(const PushDst& d, fc_u64 byte, const fc_vec16& v) {
    fc_store16(d.out + byte, v);
    const fc_u32 world = d.p->world;
    for (fc_u32 k = 1; k < world; ++k) {
        fc_u32 q = d.p->rank + k;
        if (q >= world) q -= world;
        fc_store16(fc_ptr<char>(d.p->peer_ws[q] + d.off + byte), v);
    }
}
template <class S>
FC_DEVICE void dst_elem(const PushDst& d, fc_u64 byte, S s) {
    fc_store(reinterpret_cast<S*>(d.out + byte), s);
    const fc_u32 world = d.p->world;
    for (fc_u32 k = 1; k < world; ++k) {
        fc_u32 q = d.p->rank + k;
        if (q >= world) q -= world;
        fc_store(fc_ptr<S>(d.p->peer_ws[q] + d.off + byte), s);
    }
}

template <class T, int OP, class Src, class Dst>
FC_DEVICE void reduce_scalar(const FcParams& p, const Src& src, const Dst& dst, fc_u64 lo, fc_u64 hi) {
    typedef typename T::S S;
    typedef typename T::Acc Acc;
    const fc_u32 nt = fc_block_threads();
    const fc_u32 world = p.world;
    const AvgDiv avg = make_avg(world);
    for (fc_u64 e = lo + fc_thread_id(); e < hi; e += nt) {
        const fc_u64 off = e * sizeof(S);
        Acc a = T::to_acc(fc_load(fc_ptr<const S>(src_base(src, 0) + off)));
        for (fc_u32 r = 1; r < world; ++r) a = Op<OP>::apply(a, T::to_acc(fc_load(fc_ptr<const S>(src_base(src, r) + off))));
        dst_elem(dst, off, T::from_acc(finish<OP>(a, avg)));
    }
}

// Vector reduce of packs [0, nvec) starting at element lo, for W ranks known
// at compile time: each thread issues U packs x W ranks of 16-byte loads
// before the first add.
template <class T, int OP, int W, int U, class Src, class Dst>
FC_DEVICE void reduce_vec(const Src& src, const Dst& dst, fc_u64 lo, fc_u64 nvec) {
    const fc_u32 nt = fc_block_threads();
    const AvgDiv avg = make_avg(W);
    const fc_u64 byte0 = lo * sizeof(typename T::S);

    fc_u64 i = fc_thread_id();
    if (U > 1) {
        for (; i + (fc_u64)(U - 1) * nt < nvec; i += (fc_u64)U * nt) {
            fc_vec16 v[U][W];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int r = 0; r < W; ++r)
                    v[u][r] = fc_load16(fc_ptr<const char>(src_base(src, r) + byte0 + (i + (fc_u64)u * nt) * 16));
#pragma unroll
            for (int u = 0; u < U; ++u) dst_vec(dst, byte0 + (i + (fc_u64)u * nt) * 16, reduce_pack<T, OP, W>(v[u], avg));
        }
    }
    for (; i < nvec; i += nt) {
        fc_vec16 v[W];
#pragma unroll
        for (int r = 0; r < W; ++r) v[r] = fc_load16(fc_ptr<const char>(src_base(src, r) + byte0 + i * 16));
        dst_vec(dst, byte0 + i * 16, reduce_pack<T, OP, W>(v, avg));
    }
}

// The same for a world known only at run time (1..MAX_RANKS; used for 3, 5,
// 6, 7): ranks 0..3 are loaded together, then ranks 4..world-1 together.
template <class T, int OP, class Src, class Dst>
FC_DEVICE void reduce_vec_any(const FcParams& p, const Src& src, const Dst& dst, fc_u64 lo, fc_u64 nvec) {
    const fc_u32 nt = fc_block_threads();
    const fc_u32 world = p.world;
    const AvgDiv avg = make_avg(world);
    const fc_u64 byte0 = lo * sizeof(typename T::S);

    for (fc_u64 i = fc_thread_id(); i < nvec; i += nt) {
        const fc_u64 off = byte0 + i * 16;
        fc_vec16 v[4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
            if ((fc_u32)r < world) v[r] = fc_load16(fc_ptr<const char>(src_base(src, r) + off));
        typename T::Acc a[T::VEC];
        T::unpack(v[0], a);
        fc_vec16 w3[3] = {v[1], v[2], v[3]};
        accumulate<T, OP, 3, true>(a, w3, 1, world);
        if (world > 4) {
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if ((fc_u32)(4 + r) < world) v[r] = fc_load16(fc_ptr<const char>(src_base(src, 4 + r) + off));
            accumulate<T, OP, 4, true>(a, v, 4, world);
        }
        dst_vec(dst, off, finish_pack<T, OP, FC_MAX_RANKS, true>(a, avg));
    }
}

// BW: bandwidth mode (two-shot): two packs per thread in flight for small
// worlds. Worlds 2, 4 and 8 get exact code; 3, 5, 6, 7 share one variant that
// loads from up to 8 ranks under a run-time bound. The vector path needs
// every source and destination 16-byte aligned at element lo (sources are
// workspaces, lo a multiple of 8 elements; `dst_aligned` says the rest).
template <class T, int OP, bool BW, class Src, class Dst>
FC_DEVICE void reduce_range(const FcParams& p, const Src& src, const Dst& dst, fc_u64 lo, fc_u64 hi,
                            bool dst_aligned) {
    fc_u64 tail = lo;
    if (dst_aligned && p.world >= 2 && p.world <= FC_MAX_RANKS) {
        const fc_u64 nvec = (hi - lo) / T::VEC;
        switch (p.world) {
            case 2: reduce_vec<T, OP, 2, BW ? FC_REDUCE_UNROLL : 1>(src, dst, lo, nvec); break;
            case 4: reduce_vec<T, OP, 4, BW ? FC_REDUCE_UNROLL : 1>(src, dst, lo, nvec); break;
            case 8: reduce_vec<T, OP, 8, 1>(src, dst, lo, nvec); break;
            default: reduce_vec_any<T, OP>(p, src, dst, lo, nvec); break;
        }
        tail = lo + nvec * T::VEC;
    }
    reduce_scalar<T, OP>(p, src, dst, tail, hi);
}

} // namespace fc

#endif // FC_COMMON_INCLUDED
