// ferrocomm fused all-reduce epilogues: all-reduce + residual add (+ RMSNorm
// (+ FP8 / INT8 quantization)) in one kernel, for the end of a
// tensor-parallel transformer layer; optionally with a MoE-finalize prologue
// (each token's row computed from its top-k expert rows while it is staged);
// and the sequence-parallel form (fused_sp: reduce-scatter + residual +
// RMSNorm (+ quantization) (+ all-gather)).
//
// Vendor neutral (see common.cuh): the HIP module reuses this file unchanged
// (kernels-hip/fused.hip). The math is defined in docs/protocol.md ("Fused
// epilogues"); the host twin (backends/host/fused.rs) and the unfused
// reference (src/testing/fused.rs) follow the same fp32 order, so results
// are bitwise equal on every backend and rank. The module NVRTC compiles is
// prelude.cuh + common.cuh + this file (src/algo/kernels.rs, FUSED); the
// include below only serves standalone compiles.

#ifndef FC_COMMON_INCLUDED
#include "common.cuh"
#endif

// Patterns (src/algo/fused.rs, FusionPattern::code).
#define FU_PAT_RES 0
#define FU_PAT_RMS 1
#define FU_PAT_RMS_FP8 2
#define FU_PAT_RMS_FP8TOK 3
#define FU_PAT_RMS_I8TOK 4
#define FU_PAT_RMS_NVFP4 5

// The fused arguments in FcParams::per_peer (src/algo/fused.rs ROW_* etc.).
#define FU_ROW_PTRS 0
#define FU_PTR_RESIDUAL_IN 0
#define FU_PTR_RESIDUAL_OUT 1
#define FU_PTR_WEIGHT 2
#define FU_PTR_NORM_OUT 3
#define FU_PTR_QUANT_OUT 4
#define FU_PTR_SCALE 5
#define FU_PTR_ALLREDUCE_OUT 6
#define FU_PTR_SF_OUT 7
#define FU_ROW_SCALARS 1
#define FU_SCALAR_HIDDEN 0
#define FU_SCALAR_EPS 1
#define FU_SCALAR_TOKENS 2
#define FU_SCALAR_SF_LAYOUT 3
// NVFP4 scale-factor layouts (src/algo/nvfp4.rs, SfLayout::code).
#define FU_SF_SWIZZLED 0
#define FU_SF_LINEAR 1
#define FU_ROW_MOE 2
#define FU_MOE_IDX 0
#define FU_MOE_SCALES 1
#define FU_MOE_SHARED 2
#define FU_MOE_TOPK 3
#define FU_MOE_ROWS 4
#define FU_MOE_SCALE_F32 5
// MoE terms whose loads are in flight together (fu_moe_pack's G): four in
// the one-shot; two in the two-shot, whose pipelined chunk loop keeps more
// live across its staging (four spill there on sm_80/sm_90).
#define FU_MOE_GROUP_ONESHOT 4
#define FU_MOE_GROUP_TWOSHOT 2
// Two in the LL one-shot too, whose epilogue holds a row's packs (four
// spilled on sm_80/sm_90).
#define FU_MOE_GROUP_LL 2

// Lanes that share one row: the sum of squares is 32 lane partials combined
// by a fixed butterfly, whatever the vendor's warp size (on wave64 a wave
// holds two groups; the xor masks below 32 never cross them).
#define FU_GROUP 32u
// A block whose rows number at most groups / FU_BLOCK_MODE_DIV works on one
// row at a time with all its threads (fused_rows_block).
#define FU_BLOCK_MODE_DIV 4u

namespace fc {

FC_DEVICE bool fu_isnan(float x) { return (fc_f32_as_u32(x) & 0x7fffffffu) > 0x7f800000u; }
FC_DEVICE float fu_fabs(float x) { return fc_u32_as_f32(fc_f32_as_u32(x) & 0x7fffffffu); }

// The canonical quiet NaN of the 16-bit type: every NaN a fused kernel
// stores is this one, so results do not depend on how a vendor propagates
// NaN payloads through adds and conversions.
FC_DEVICE fc_u32 fu_nan_bits(TF16) { return 0x7e00u; }
FC_DEVICE fc_u32 fu_nan_bits(TBF16) { return 0x7fc0u; }

// Round 8 f32 values to T (nearest even), NaN to the canonical NaN.
template <class T>
FC_DEVICE fc_vec16 fu_pack(const float (&a)[8]) {
    fc_vec16 v = T::pack(a);
    const fc_u32 nan = fu_nan_bits(T());
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        fc_u32 w = v.w[k];
        if (fu_isnan(a[2 * k])) w = (w & 0xffff0000u) | nan;
        if (fu_isnan(a[2 * k + 1])) w = (w & 0x0000ffffu) | (nan << 16);
        v.w[k] = w;
    }
    return v;
}

// FP8 e4m3fn: round to nearest even, saturate to +-448, NaN -> 0x7f (the
// host's codec::Fp8Flavor::E4m3Fn.encode). Software only, so the bits do
// not depend on a hardware conversion's NaN rule.
FC_DEVICE fc_u32 fu_e4m3(float v) {
    const fc_u32 u = fc_f32_as_u32(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fu;
    const float a = fc_u32_as_f32(u & 0x7fffffffu);
    const int e = (int)((u >> 23) & 0xffu) - 127; // floor(log2 a) for normal a
    fc_u32 code;
    if (a >= 448.0f) {
        code = 0x7eu;
    } else if (e < -6) {
        // Subnormal (and zero): steps of 2^-9; 8 steps is the smallest normal.
        code = (fc_u32)fc_rintf(fc_fmul(a, 512.0f));
    } else {
        // Normal: a * 2^(3-e) is in [8, 16); 16 carries into the exponent.
        fc_u32 m = (fc_u32)fc_rintf(fc_fmul(a, fc_u32_as_f32((fc_u32)(127 + 3 - e) << 23)));
        fc_u32 ef = (fc_u32)(e + 7);
        if (m == 16u) {
            m = 8u;
            ef += 1u;
        }
        code = (ef << 3) | (m - 8u);
    }
    if ((u >> 31) != 0) code |= 0x80u;
    return code;
}

// INT8: round to nearest even, clamp to +-127, NaN -> 0.
FC_DEVICE fc_u32 fu_int8(float q) {
    if (fu_isnan(q)) return 0u;
    float r = fc_rintf(q);
    if (r > 127.0f) r = 127.0f;
    if (r < -127.0f) r = -127.0f;
    return ((fc_u32)(fc_i32)r) & 0xffu;
}

// The quantization's quotient q = v / s as the codes need it, from rcp =
// RN(1 / s), for s in [2^-30, 2^30] (fu_store_quant checks). For |v| in
// [2^-50, 2^50]: q = RN(v * rcp) is within an ulp of v / s, e = v - q * s is
// exact (one fma), and RN(q + e * rcp) is the correctly rounded quotient
// (Markstein's theorem; no underflow or overflow in that range): three
// instructions against div.rn's subroutine. Outside it, RN(v * rcp): zeros,
// NaN and infinities come out as the division's, and any other |v| gives
// |q| < 2^-20 (code 0 of either sign) or |q| > 2^20 (saturated), the codes
// of the exact quotient. `markstein_codes_are_the_division_s` (src/algo/fused.rs) checks.
FC_DEVICE float fu_div(float v, float s, float rcp) {
    const float q = fc_fmul(v, rcp);
    const float a = fu_fabs(v);
    if (!(a >= 0x1p-50f && a <= 0x1p50f)) return q;
    return fc_ffma(fc_ffma(-q, s, v), rcp, q);
}

// Quantize a pack and store its 8 bytes (element k at byte k) at an 8-byte
// aligned address: q = y / scale (correctly rounded), then INT8 (nearest
// even, clamped to +-127, NaN 0) or FP8 e4m3fn (nearest even, saturated to
// +-448, NaN 0x7f; in hardware where the arch has it, the same bits).
template <int PAT>
FC_DEVICE fc_u32 fu_code2(float q0, float q1) {
    if (PAT == FU_PAT_RMS_I8TOK) return fu_int8(q0) | (fu_int8(q1) << 8);
#ifdef FC_HW_E4M3FN
    fc_u32 two = fc_e4m3_pack2(q0, q1);
    if (fu_isnan(q0)) two = (two & 0xff00u) | 0x7fu;
    if (fu_isnan(q1)) two = (two & 0x00ffu) | 0x7f00u;
    return two;
#else
    return fu_e4m3(q0) | (fu_e4m3(q1) << 8);
#endif
}
template <int PAT>
FC_DEVICE void fu_store_quant(char* at, const float (&y)[8], float scale) {
    // A scale outside [2^-30, 2^30] (a caller's static one) divides, and
    // so does INT8: measured on 2x H200 (the bench of BENCHMARKS.md, "Fused
    // all-reduce + residual + RMSNorm, beside FlashInfer"), the reciprocal
    // took FP8 rows 1-2048 x 4096 down 10-18%, but 2048 x 8192 INT8 rows up
    // 5% (244.9 -> 257.2 us).
    const bool fast = PAT != FU_PAT_RMS_I8TOK && scale >= 0x1p-30f && scale <= 0x1p30f;
    const float rcp = fast ? fc_frcp(scale) : 0.0f;
    fc_u32 w[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
        const float q0 = fast ? fu_div(y[k], scale, rcp) : fc_fdiv(y[k], scale);
        const float q1 = fast ? fu_div(y[k + 1], scale, rcp) : fc_fdiv(y[k + 1], scale);
        w[k / 4] |= fu_code2<PAT>(q0, q1) << (8 * (k % 4));
    }
    fc_u32* out = reinterpret_cast<fc_u32*>(at);
    fc_store(out, w[0]);
    fc_store(out + 1, w[1]);
}

// Sum of one pack over the sources at `at + r * stride`, r = 0..world-1, in
// rank order (the reduction rule), every rank's load in flight first.
template <class T>
FC_DEVICE void fu_reduce_pack(const char* at, fc_u64 stride, fc_u32 world, float (&a)[8]) {
    fc_vec16 v[FC_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < (int)FC_MAX_RANKS; ++r)
        if ((fc_u32)r < world) v[r] = fc_load16(at + (fc_u64)r * stride);
    T::unpack(v[0], a);
#pragma unroll
    for (int r = 1; r < (int)FC_MAX_RANKS; ++r) {
        if ((fc_u32)r >= world) break;
        float x[8];
        T::unpack(v[r], x);
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] = fc_fadd(a[k], x[k]);
    }
}

// x * rstd * w for one pack of residual_out, rounded to T (the normed
// output), and its values as f32 again (what quantization sees).
template <class T>
FC_DEVICE fc_vec16 fu_norm_vals(const fc_vec16& res, const fc_vec16& weight, float rstd, float (&y)[8]) {
    float x[8], w[8];
    T::unpack(res, x);
    T::unpack(weight, w);
#pragma unroll
    for (int k = 0; k < 8; ++k) y[k] = fc_fmul(fc_fmul(x[k], rstd), w[k]);
    const fc_vec16 n = fu_pack<T>(y);
    T::unpack(n, y);
    return n;
}
template <class T>
FC_DEVICE fc_vec16 fu_norm_pack(const char* res, const char* weight, float rstd, float (&y)[8]) {
    return fu_norm_vals<T>(fc_load16(res), fc_load16(weight), rstd, y);
}

// The 32-lane butterfly: after it every lane of the group holds the same
// value, combined in a fixed order (lane l adds lane l ^ m for m = 16, 8,
// 4, 2, 1; the add commutes, so partners agree bit for bit).
FC_DEVICE float fu_group_sum(float v) {
#pragma unroll
    for (fc_u32 m = FU_GROUP / 2; m >= 1; m >>= 1) v = fc_fadd(v, fc_u32_as_f32(fc_shfl_xor(fc_f32_as_u32(v), m)));
    return v;
}
FC_DEVICE float fu_group_max(float v) {
#pragma unroll
    for (fc_u32 m = FU_GROUP / 2; m >= 1; m >>= 1) v = fc_fmax(v, fc_u32_as_f32(fc_shfl_xor(fc_f32_as_u32(v), m)));
    return v;
}

// A fused call's row operands (per_peer rows FU_ROW_SCALARS and
// FU_ROW_PTRS), read once per launch; both row walkers below take them.
struct FuRows {
    fc_u64 hidden;
    fc_u64 packs; // 8-element packs a row
    fc_u64 row_bytes;
    float eps;
    const char* resid_in;
    char* resid_out;
    const char* weight;
    char* norm_out;
    char* quant_out;
    float* scale; // static FP8: the given scale; NVFP4: the global scale; per-token patterns: one a row, written
    char* ar_out;
    char* sf_out; // NVFP4's scale factors
    bool sf_linear;
};

template <class T>
FC_DEVICE FuRows fu_rows(const FcParams& p) {
    const fc_u64* ptr = p.per_peer[FU_ROW_PTRS];
    FuRows w;
    w.hidden = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_HIDDEN];
    w.packs = w.hidden / 8;
    w.row_bytes = w.hidden * sizeof(typename T::S);
    w.eps = fc_u32_as_f32((fc_u32)p.per_peer[FU_ROW_SCALARS][FU_SCALAR_EPS]);
    w.resid_in = fc_ptr<const char>(ptr[FU_PTR_RESIDUAL_IN]);
    w.resid_out = fc_ptr<char>(ptr[FU_PTR_RESIDUAL_OUT]);
    w.weight = fc_ptr<const char>(ptr[FU_PTR_WEIGHT]);
    w.norm_out = fc_ptr<char>(ptr[FU_PTR_NORM_OUT]);
    w.quant_out = fc_ptr<char>(ptr[FU_PTR_QUANT_OUT]);
    w.scale = fc_ptr<float>(ptr[FU_PTR_SCALE]);
    w.ar_out = fc_ptr<char>(ptr[FU_PTR_ALLREDUCE_OUT]);
    w.sf_out = fc_ptr<char>(ptr[FU_PTR_SF_OUT]);
    w.sf_linear = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_SF_LAYOUT] == FU_SF_LINEAR;
    return w;
}

// Pass 1's steps after the loads, on the pack at byte `off` of row `rb`
// (byte offset of the row in the caller's tensors), from `a`, the sum of its
// sources in rank order, and its residual_in pack: the all-reduce rounded
// and its optional output, the residual add and its store. Returns the
// stored residual pack (the sum of squares is taken from these rounded
// values).
template <class T>
FC_DEVICE fc_vec16 fu_residual_vals(const FuRows& w, float (&a)[8], const fc_vec16& resid, fc_u64 rb, fc_u64 off) {
    float r[8];
    const fc_vec16 arp = fu_pack<T>(a);
    if (w.ar_out != nullptr) fc_store16(w.ar_out + rb + off, arp);
    T::unpack(arp, a);
    T::unpack(resid, r);
#pragma unroll
    for (int k = 0; k < 8; ++k) r[k] = fc_fadd(a[k], r[k]);
    const fc_vec16 resp = fu_pack<T>(r);
    fc_store16(w.resid_out + rb + off, resp);
    return resp;
}

// Pass 1 on one pack, its sources at `src + off + r * stride`, r = 0..world-1.
template <class T>
FC_DEVICE fc_vec16 fu_residual_pack(const FuRows& w, const char* src, fc_u64 stride, fc_u32 world, fc_u64 rb,
                                    fc_u64 off) {
    float a[8];
    fu_reduce_pack<T>(src + off, stride, world, a);
    return fu_residual_vals<T>(w, a, fc_load16(w.resid_in + rb + off), rb, off);
}

// ss + the squares of a pack's 8 values, in order (fc_fmul then fc_fadd).
template <class T>
FC_DEVICE float fu_add_squares(float ss, const fc_vec16& pack) {
    float x[8];
    T::unpack(pack, x);
#pragma unroll
    for (int k = 0; k < 8; ++k) ss = fc_fadd(ss, fc_fmul(x[k], x[k]));
    return ss;
}

// rstd = 1 / sqrt(sum / hidden + eps), correctly rounded steps.
FC_DEVICE float fu_rstd(float ss, const FuRows& w) {
    const float mean = fc_fdiv(ss, (float)w.hidden);
    return fc_fdiv(1.0f, fc_fsqrt(fc_fadd(mean, w.eps)));
}

// Per-token scale = max(amax / QMAX, 1 / (QMAX * 512)).
template <int PAT>
FC_DEVICE float fu_token_scale(float amax) {
    const float qmax = PAT == FU_PAT_RMS_I8TOK ? 127.0f : 448.0f;
    return fc_fmax(fc_fdiv(amax, qmax), fc_fdiv(1.0f, fc_fmul(qmax, 512.0f)));
}

// ---------------------------------------------------------------- NVFP4
// (docs/protocol.md, "NVFP4 outputs"; src/algo/nvfp4.rs is the host's
// twin.) A block of 16 elements is two packs, 2b and 2b + 1, which every
// walker gives to lanes l and l ^ 1 of one warp in the same step: each
// lane takes its pack's maximum, one shuffle joins the pair, and each lane
// stores its own 8 codes (4 bytes); the even lane stores the scale factor.
// Every lane of a warp reaches the shuffle (callers loop uniformly and pass
// `on` = the lane has a pack).

// e2m1 code of q: nearest, ties to the even code, saturated to 6, sign kept,
// NaN 0x7 (software only: the same bits on every arch).
FC_DEVICE fc_u32 fu_e2m1(float q) {
    if (fu_isnan(q)) return 0x7u;
    const float a = fu_fabs(q);
    const fc_u32 mag = a <= 0.25f   ? 0u
                       : a < 0.75f  ? 1u
                       : a <= 1.25f ? 2u
                       : a < 1.75f  ? 3u
                       : a <= 2.5f  ? 4u
                       : a < 3.5f   ? 5u
                       : a <= 5.0f  ? 6u
                                    : 7u;
    return mag | ((fc_f32_as_u32(q) >> 28) & 0x8u);
}

// The value of an e4m3fn code (exact; 0x7f / 0xff NaN).
FC_DEVICE float fu_e4m3_value(fc_u32 c) {
    if ((c & 0x7fu) == 0x7fu) return fc_u32_as_f32(0x7fc00000u);
    const fc_u32 e = (c >> 3) & 0xfu;
    const float m = (float)(c & 7u);
    const float mag = e == 0u ? fc_fmul(m, 0x1p-9f)
                              : fc_fmul(fc_fadd(8.0f, m), fc_u32_as_f32((fc_u32)(127 + (int)e - 10) << 23));
    return (c & 0x80u) != 0u ? -mag : mag;
}

// Byte offset of the scale factor of row m, block column k (cols a row).
FC_DEVICE fc_u64 fu_sf_offset(const FuRows& w, fc_u64 m, fc_u64 k) {
    const fc_u64 cols = w.hidden / 16u;
    if (w.sf_linear) return m * cols + k;
    return (m / 128u) * ((cols + 3u) / 4u) * 512u + (k / 4u) * 512u + (m % 32u) * 16u + ((m % 128u) / 32u) * 4u +
           k % 4u;
}

// Quantize pack i of row g (its normed values y; `on` false: no pack, but
// the lane joins the shuffle) with global scale gs: sf = e4m3(gs * (amax *
// (1 / 6))), out = f32(sf) != 0 ? 1 / (f32(sf) * (1 / gs)) : 0, codes
// e2m1(y * out), element 2k in the low nibble of byte k.
FC_DEVICE void fu_nvfp4_store(const FuRows& w, fc_u64 g, fc_u64 i, const float (&y)[8], float gs, bool on) {
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) amax = fc_fmax(amax, fu_fabs(y[k]));
    amax = fc_fmax(amax, fc_u32_as_f32(fc_shfl_xor(fc_f32_as_u32(amax), 1u)));
    if (!on) return;
    const fc_u32 sf = fu_e4m3(fc_fmul(gs, fc_fmul(amax, fc_fdiv(1.0f, 6.0f))));
    const float v = fu_e4m3_value(sf);
    const float out = v != 0.0f ? fc_fdiv(1.0f, fc_fmul(v, fc_fdiv(1.0f, gs))) : 0.0f;
    fc_u32 word = 0u;
#pragma unroll
    for (int k = 0; k < 8; ++k) word |= fu_e2m1(fc_fmul(y[k], out)) << (4 * k);
    fc_store(reinterpret_cast<fc_u32*>(w.quant_out + g * (w.hidden / 2u) + i * 4u), word);
    if ((i & 1u) == 0u) *reinterpret_cast<fc_u8*>(w.sf_out + fu_sf_offset(w, g, i / 2u)) = (fc_u8)sf;
}

// Pass 2 of NVFP4 on pack i of row g from its stored residual and weight
// packs: the normed values, their optional output, the codes.
template <class T>
FC_DEVICE void fu_nvfp4_vals_store(const FuRows& w, fc_u64 g, fc_u64 rb, fc_u64 i, const fc_vec16& res,
                                   const fc_vec16& wt, float rstd, float gs, bool on) {
    float y[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (on) {
        const fc_vec16 n = fu_norm_vals<T>(res, wt, rstd, y);
        if (w.norm_out != nullptr) fc_store16(w.norm_out + rb + i * 16u, n);
    }
    fu_nvfp4_store(w, g, i, y, gs, on);
}
// (`row`: the row's residual values, residual_out's row or, in the
// sequence-parallel gathered form, the gathered row.)
template <class T>
FC_DEVICE void fu_nvfp4_step(const FuRows& w, const char* row, fc_u64 g, fc_u64 rb, fc_u64 i, float rstd, float gs,
                             bool on) {
    fc_vec16 res = {{0u, 0u, 0u, 0u}}, wt = {{0u, 0u, 0u, 0u}};
    if (on) {
        res = fc_load16(row + i * 16u);
        wt = fc_load16(w.weight + i * 16u);
    }
    fu_nvfp4_vals_store<T>(w, g, rb, i, res, wt, rstd, gs, on);
}

// Pass 2's steps after the loads, on pack i of row g (`res` its stored
// residual, `wt` the weight's): the normed values and their optional output;
// static FP8 quantizes here (with `scale`), per-token patterns fold the
// values' magnitudes into `amax`.
template <class T, int PAT>
FC_DEVICE void fu_norm_vals_store(const FuRows& w, fc_u64 g, fc_u64 rb, fc_u64 i, const fc_vec16& res,
                                  const fc_vec16& wt, float rstd, float scale, float& amax) {
    float y[8];
    const fc_vec16 n = fu_norm_vals<T>(res, wt, rstd, y);
    if (w.norm_out != nullptr) fc_store16(w.norm_out + rb + i * 16u, n);
    if (PAT == FU_PAT_RMS_FP8) {
        fu_store_quant<PAT>(w.quant_out + g * w.hidden + i * 8u, y, scale);
    } else if (PAT == FU_PAT_RMS_FP8TOK || PAT == FU_PAT_RMS_I8TOK) {
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = fc_fmax(amax, fu_fabs(y[k]));
    }
}

// Pass 2 on pack i of row g, its residual values at `row`.
template <class T, int PAT>
FC_DEVICE void fu_norm_step(const FuRows& w, const char* row, fc_u64 g, fc_u64 rb, fc_u64 i, float rstd, float scale,
                            float& amax) {
    const fc_u64 off = i * 16u;
    fu_norm_vals_store<T, PAT>(w, g, rb, i, fc_load16(row + off), fc_load16(w.weight + off), rstd, scale, amax);
}

// Pass 3 on pack i of row g (per-token patterns): the normed values
// recomputed (same bits) and quantized with the row's scale.
template <class T, int PAT>
FC_DEVICE void fu_quant_vals_store(const FuRows& w, fc_u64 g, fc_u64 i, const fc_vec16& res, const fc_vec16& wt,
                                   float rstd, float scale) {
    float y[8];
    fu_norm_vals<T>(res, wt, rstd, y);
    fu_store_quant<PAT>(w.quant_out + g * w.hidden + i * 8u, y, scale);
}
template <class T, int PAT>
FC_DEVICE void fu_quant_step(const FuRows& w, const char* row, fc_u64 g, fc_u64 i, float rstd, float scale) {
    const fc_u64 off = i * 16u;
    fu_quant_vals_store<T, PAT>(w, g, i, fc_load16(row + off), fc_load16(w.weight + off), rstd, scale);
}

// Where a walker finds a block's row v (v < fu_count(map), fu_row_at): its sources (source
// 0's row; source r at + r * stride) and its row in the caller's tensors.
// False for a row the block does not have (a short last piece); the answer
// is the same on every thread.
//
// The one-shot: rows [lo, lo + n) of the chunk whose first row is `first`,
// row j's sources at region + j * row_bytes.
struct FuSpan {
    const char* region;
    fc_u64 first, lo, n;
};
FC_DEVICE fc_u64 fu_count(const FuSpan& m) { return m.n; }
FC_DEVICE bool fu_row_at(const FuSpan& m, fc_u64 row_bytes, fc_u64 v, const char*& src, fc_u64& g) {
    src = m.region + (m.lo + v) * row_bytes;
    g = m.first + m.lo + v;
    return true;
}

// Rows piece b (of `per` rows) of segment d (of `seg` rows) of a chunk of n rows.
FC_DEVICE Range fu_piece(fc_u64 n, fc_u64 seg, fc_u64 per, fc_u32 d, fc_u32 b) {
    Range r;
    const fc_u64 start = min_u64((fc_u64)d * seg, n);
    const fc_u64 len = min_u64(seg, n - start);
    r.lo = start + min_u64((fc_u64)b * per, len);
    r.hi = start + min_u64((fc_u64)b * per + per, len);
    return r;
}

// The two-shot's epilogue: piece b of every segment d of a chunk of n rows
// at row `first`, v = d * per + k, row j of segment d (all-reduced, one
// source) at result + d * stride + (j - d * seg) * row_bytes. One walk over
// every segment's piece, not a walk a segment: at 2048 x 4096 on world 2 a
// segment's piece is 8 rows, which kept half of a block's 16 groups idle.
// (Row counts in 32 bits: a chunk's rows fit one workspace slot. Every
// register counts here: the two-shot's chunk loop keeps its own state live
// across the walk, and a wider map spilled on sm_80/sm_90.)
struct FuPieces {
    const char* result;
    fc_u64 stride, first;
    fc_u32 n, seg, per, world;
};
FC_DEVICE fc_u64 fu_count(const FuPieces& m) { return (fc_u64)m.world * m.per; }
FC_DEVICE bool fu_row_at(const FuPieces& m, fc_u64 row_bytes, fc_u64 v, const char*& src, fc_u64& g) {
    const fc_u32 d = (fc_u32)v / m.per;
    const Range r = fu_piece(m.n, m.seg, m.per, d, fc_block_id());
    const fc_u64 row = r.lo + ((fc_u32)v - d * m.per);
    if (row >= r.hi) return false;
    src = m.result + (fc_u64)d * m.stride + (row - (fc_u64)d * m.seg) * row_bytes;
    g = m.first + row;
    return true;
}

// The epilogue with the whole block on one row at a time, for blocks that
// own few rows (one group per row would leave most of the block idle and
// walk each row in a chain of dependent loads: 13.9 us for one 4096-wide
// row on H200). Same results bit for bit: the elementwise steps
// (all-reduce in rank order, residual add, norm, quantization) may run on
// any thread; the sum of squares keeps its order (group 0, lane l over packs
// l, l + 32, ... of the stored residual, then the butterfly); the row's
// absolute maximum is a max, the same in any order. Every thread of the
// block runs every barrier and shuffle. ADD false (the sequence-parallel
// gathered form): the map's row is the row's final residual (one source,
// already added), normed and quantized without pass 1's stores.
template <class T, int PAT, class Map, bool ADD = true>
FC_DEVICE void fused_rows_block(const FuRows& w, const Map& map, fc_u64 stride, fc_u32 world) {
    __shared__ float fu_shared[FC_MAX_BLOCK_THREADS / FU_GROUP + 1];
    const fc_u32 tid = fc_thread_id();
    const fc_u32 nt = fc_block_threads();
    const fc_u32 lane = tid % FU_GROUP;
    const fc_u32 group = tid / FU_GROUP;
    const fc_u32 ngroups = nt / FU_GROUP;

    for (fc_u64 v = 0; v < fu_count(map); ++v) {
        const char* src = nullptr;
        fc_u64 g = 0;
        if (!fu_row_at(map, w.row_bytes, v, src, g)) continue; // the same on every thread
        const fc_u64 rb = g * w.row_bytes;
        const char* row = ADD ? w.resid_out + rb : src;
        // All-reduce and residual add, every thread a pack at a time.
        if (ADD)
            for (fc_u64 i = tid; i < w.packs; i += nt) fu_residual_pack<T>(w, src, stride, world, rb, i * 16u);
        if (PAT == FU_PAT_RES) continue;
        fc_barrier();
        // The sum of squares in its fixed order, from the stored residual
        // (no store in this loop, so its loads can all be in flight).
        if (group == 0) {
            float ss = 0.0f;
#pragma unroll 4
            for (fc_u64 i = lane; i < w.packs; i += FU_GROUP) ss = fu_add_squares<T>(ss, fc_load16(row + i * 16u));
            ss = fu_group_sum(ss);
            if (lane == 0) fu_shared[0] = fu_rstd(ss, w);
        }
        fc_barrier();
        const float rstd = fu_shared[0];
        float scale = 1.0f;
        if (PAT == FU_PAT_RMS_FP8 || PAT == FU_PAT_RMS_NVFP4) scale = fc_load(w.scale);
        float amax = 0.0f;
        if (PAT == FU_PAT_RMS_NVFP4) {
            // Uniform steps: pack pairs share a shuffle (fu_nvfp4_store).
            for (fc_u64 b = 0; b < w.packs; b += nt)
                fu_nvfp4_step<T>(w, row, g, rb, b + tid, rstd, scale, b + tid < w.packs);
        } else {
            for (fc_u64 i = tid; i < w.packs; i += nt) fu_norm_step<T, PAT>(w, row, g, rb, i, rstd, scale, amax);
        }
        if (PAT == FU_PAT_RMS_FP8TOK || PAT == FU_PAT_RMS_I8TOK) {
            // The row's maximum over the block, then the per-token scale
            // and the quantized row.
            amax = fu_group_max(amax);
            fc_barrier();
            if (lane == 0) fu_shared[1 + group] = amax;
            fc_barrier();
            if (tid == 0) {
                float m = fu_shared[1];
                for (fc_u32 k = 1; k < ngroups; ++k) m = fc_fmax(m, fu_shared[1 + k]);
                const float sc = fu_token_scale<PAT>(m);
                fu_shared[0] = sc;
                fc_store(w.scale + g, sc);
            }
            fc_barrier();
            scale = fu_shared[0];
            for (fc_u64 i = tid; i < w.packs; i += nt) fu_quant_step<T, PAT>(w, row, g, i, rstd, scale);
        }
        // The next row reuses the shared words.
        fc_barrier();
    }
}

// The epilogue of the block's rows (`map`), reduced from `world` sources in
// our own workspace (the two-shot passes one source, the already reduced
// rows, whose "sum" is the identity). One group of 32 lanes per row; lane l
// takes the row's 8-element packs l, l + 32, ... in every pass, so it
// re-reads only what it wrote itself. The row loop runs the
// same number of times in every group (inactive groups join the shuffles),
// so every lane of a warp or wave reaches every shuffle. ADD false: the
// norm and quantization of rows that are already the final residual
// (fused_rows_block's).
template <class T, int PAT, class Map, bool ADD = true>
FC_DEVICE void fused_rows(const FcParams& p, const Map& map, fc_u64 stride, fc_u32 world) {
    const fc_u32 lane = fc_thread_id() % FU_GROUP;
    const fc_u32 group = fc_thread_id() / FU_GROUP;
    const fc_u32 ngroups = fc_block_threads() / FU_GROUP;
    const FuRows w = fu_rows<T>(p);
    const fc_u64 count = fu_count(map);

    // Few rows for this block: all its threads on each row in turn.
    if (count * FU_BLOCK_MODE_DIV <= ngroups) {
        fused_rows_block<T, PAT, Map, ADD>(w, map, stride, world);
        return;
    }
    for (fc_u64 base = 0; base < count; base += ngroups) {
        const fc_u64 v = base + group;
        const char* src = nullptr;
        fc_u64 g = 0; // the row in the caller's tensors
        const bool active = v < count && fu_row_at(map, w.row_bytes, v, src, g);
        const fc_u64 rb = g * w.row_bytes;
        const char* row = ADD ? w.resid_out + rb : src;

        // Pass 1: all-reduce, residual add, lane partial of the sum of
        // squares (ADD false: the partial alone, from the row).
        float ss = 0.0f;
        if (active) {
            for (fc_u64 i = lane; i < w.packs; i += FU_GROUP) {
                const fc_vec16 resp =
                    ADD ? fu_residual_pack<T>(w, src, stride, world, rb, i * 16u) : fc_load16(row + i * 16u);
                if (PAT != FU_PAT_RES) ss = fu_add_squares<T>(ss, resp);
            }
        }
        if (PAT == FU_PAT_RES) continue;
        const float rstd = fu_rstd(fu_group_sum(ss), w);

        // Pass 2: the normed row; static FP8 quantizes here, per-token
        // patterns take the row's absolute maximum.
        float scale = 1.0f;
        if (PAT == FU_PAT_RMS_FP8 || PAT == FU_PAT_RMS_NVFP4) scale = fc_load(w.scale);
        float amax = 0.0f;
        if (PAT == FU_PAT_RMS_NVFP4) {
            // Every group steps alike (pack pairs share a shuffle).
            for (fc_u64 b = 0; b < w.packs; b += FU_GROUP)
                fu_nvfp4_step<T>(w, row, g, rb, b + lane, rstd, scale, active && b + lane < w.packs);
            continue;
        }
        if (active)
            for (fc_u64 i = lane; i < w.packs; i += FU_GROUP)
                fu_norm_step<T, PAT>(w, row, g, rb, i, rstd, scale, amax);
        if (PAT != FU_PAT_RMS_FP8TOK && PAT != FU_PAT_RMS_I8TOK) continue;

        // Pass 3: the per-token scale, then the quantized row.
        scale = fu_token_scale<PAT>(fu_group_max(amax));
        if (active) {
            if (lane == 0) fc_store(w.scale + g, scale);
            for (fc_u64 i = lane; i < w.packs; i += FU_GROUP) fu_quant_step<T, PAT>(w, row, g, i, rstd, scale);
        }
    }
}

// MoE finalize (docs/protocol.md, "MoE finalize"): the 16-byte pack at byte
// `off` of token t's row, x = round(acc) with acc = shared[t] (or +0), then
// acc = acc + scale[t][k] * expert_out[perm[t][k]] for k = 0..topk-1 in
// order (product rounded, then the add: fc_fmul / fc_fadd, never an FMA);
// a permuted index outside [0, permuted_rows) skips its term. The experts'
// output is the call's input (p.input). G terms' loads are in flight at once.
template <class T, int G>
FC_DEVICE fc_vec16 fu_moe_pack(const FcParams& p, fc_u64 t, fc_u64 off, fc_u64 row_bytes) {
    const fc_u64* m = p.per_peer[FU_ROW_MOE];
    const fc_u64 topk = m[FU_MOE_TOPK];
    const fc_u64 rows = m[FU_MOE_ROWS];
    const fc_i32* idx = fc_ptr<const fc_i32>(m[FU_MOE_IDX]) + t * topk;
    const bool scale_f32 = m[FU_MOE_SCALE_F32] != 0;
    const char* expert = fc_ptr<const char>(p.input);
    float a[8];
    if (m[FU_MOE_SHARED] != 0) {
        T::unpack(fc_load16(fc_ptr<const char>(m[FU_MOE_SHARED]) + t * row_bytes + off), a);
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] = 0.0f;
    }
    // Terms in groups of G: the group's index, weight and row loads are all
    // in flight before its adds, which keep k order.
    for (fc_u64 k0 = 0; k0 < topk; k0 += G) {
        fc_vec16 v[G];
        float s[G];
        bool ok[G];
#pragma unroll
        for (int u = 0; u < G; ++u) {
            const fc_u64 k = k0 + (fc_u64)u;
            ok[u] = false;
            s[u] = 0.0f;
            if (k < topk) {
                const fc_i32 r = fc_load(idx + k);
                // Device data: an index the host could not check is
                // skipped, never read.
                ok[u] = r >= 0 && (fc_u64)r < rows;
                if (ok[u]) {
                    const fc_u64 e = t * topk + k;
                    // The weight's bits, then its value (exact either way).
                    // (As one select of two typed loads, hipcc reserved
                    // scratch in the two-shot on gfx950.)
                    const fc_u32 bits = scale_f32 ? fc_load(fc_ptr<const fc_u32>(m[FU_MOE_SCALES]) + e)
                                                  : (fc_u32)fc_load(fc_ptr<const fc_u16>(m[FU_MOE_SCALES]) + e);
                    s[u] = scale_f32 ? fc_u32_as_f32(bits) : T::to_acc((fc_u16)bits);
                    v[u] = fc_load16(expert + (fc_u64)r * row_bytes + off);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < G; ++u) {
            if (ok[u]) {
                float x[8];
                T::unpack(v[u], x);
#pragma unroll
                for (int j = 0; j < 8; ++j) a[j] = fc_fadd(a[j], fc_fmul(s[u], x[j]));
            }
        }
    }
    return fu_pack<T>(a);
}

// Stage rows [lo, hi) of the chunk whose first row is `first` (global) with
// the MoE prologue: row j's finalized row goes to peer_ws[q] + off + j *
// row_bytes for q = (q0 + n) % world, n = 0..nq-1 (each pack computed once,
// stored nq times). The whole block walks the rows' packs flat, so a short
// row does not leave threads idle.
template <class T, int G>
FC_DEVICE void fu_moe_stage(const FcParams& p, fc_u64 first, fc_u64 lo, fc_u64 hi, fc_u64 off, fc_u32 q0,
                            fc_u32 nq) {
    const fc_u64 hidden = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_HIDDEN];
    const fc_u64 row_bytes = hidden * sizeof(typename T::S);
    // 32-bit pack counts: a chunk's rows fit one workspace slot, far below
    // 2^32 packs (64-bit division would cost registers the epilogue needs).
    const fc_u32 packs = (fc_u32)(hidden / 8);
    const fc_u32 nt = fc_block_threads();
    const fc_u32 end = (fc_u32)((hi - lo) * packs);
    q0 %= p.world;
    for (fc_u32 k = fc_thread_id(); k < end; k += nt) {
        const fc_u32 jr = k / packs;
        const fc_u64 j = lo + jr;
        const fc_u64 o = (fc_u64)(k - jr * packs) * 16u;
        const fc_vec16 v = fu_moe_pack<T, G>(p, first + j, o, row_bytes);
        // Unrolled to the rank bound: a loop of run-time length here made
        // hipcc reserve scratch (gfx942/gfx950) for the norm patterns.
        fc_u32 q = q0;
#pragma unroll
        for (int n = 0; n < (int)FC_MAX_RANKS; ++n) {
            if ((fc_u32)n >= nq) break;
            fc_store16(fc_ptr<char>(p.peer_ws[q] + off + j * row_bytes + o), v);
            q = q + 1 == p.world ? 0u : q + 1;
        }
    }
}

// One-shot fused (whole call, push): chunks of `cap` whole rows, one push
// one-shot sub-buffer each (cap = stride / row_bytes), chunk c with epoch
// E + c. Block b owns rows [b*per, (b+1)*per) of every chunk (per of a full
// chunk when there are several, so it touches the same workspace bytes in
// every chunk, as oneshot_push). Per chunk: copy own rows into sub-buffer
// [rank] of every rank's region (peers staggered by block, ourselves last);
// arrive/wait phase 0; fused_rows from our own region (local reads). With
// MOE the rows are computed by the MoE prologue as they are staged (once
// per pack, stored to every rank, the order of ranks staggered by block).
template <class T, int PAT, bool MOE = false>
FC_DEVICE void fused_oneshot(const FcParams& p) {
    const int ES = sizeof(typename T::S);
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 e0 = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u64 hidden = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_HIDDEN];
    const fc_u64 tokens = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_TOKENS];
    const fc_u64 row_bytes = hidden * ES;
    const fc_u64 stride = push1_stride(p);
    const fc_u64 cap = stride / row_bytes; // >= 1: the host refuses rows that do not fit
    const fc_u64 nchunk = div_ceil(tokens, cap);
    const fc_u64 per = div_ceil(nchunk > 1 ? cap : tokens, nb);
    const bool in_aligned = aligned16(p.input);

    for (fc_u64 c = 0; c < nchunk; ++c) {
        const fc_u32 epoch = e0 + (fc_u32)c;
        const fc_u32 parity = epoch & 1;
        const fc_u64 first = c * cap;
        const fc_u64 n = min_u64(cap, tokens - first);
        const fc_u64 rlo = min_u64((fc_u64)b * per, n);
        const fc_u64 rhi = min_u64(rlo + per, n);
        const fc_u64 region = region_offset(p, parity);
        const fc_u64 mine = region + (fc_u64)p.rank * stride;
        const char* input = fc_ptr<const char>(p.input + first * row_bytes);

        if (MOE) {
            fu_moe_stage<T, FU_MOE_GROUP_ONESHOT>(p, first, rlo, rhi, mine, p.rank + 1 + b, world);
        } else {
            for (fc_u32 k = 0; k + 1 < world; ++k) {
                const fc_u32 q = (p.rank + 1 + (k + b) % (world - 1)) % world;
                copy_range<ES, FC_COPY_UNROLL>(fc_ptr<char>(p.peer_ws[q] + mine), input, rlo * hidden, rhi * hidden,
                                               in_aligned);
            }
            copy_range<ES, FC_COPY_UNROLL>(own + mine, input, rlo * hidden, rhi * hidden, in_aligned);
        }
        if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
        const FuSpan span = {own + region, first, rlo, rhi - rlo};
        fused_rows<T, PAT>(p, span, stride, world);
    }
    complete(own, e0 + (fc_u32)(nchunk - 1));
}

// Wait until the pack at `at` (one source's, in the Lamport area) has
// arrived, into v. False after raising a timeout for source `src`.
FC_DEVICE bool fu_lamport_pack(const FcParams& p, const char* at, fc_u32 epoch, fc_u32 src, fc_vec16& v) {
    if (lamport_load(at, v)) return true;
    const fc_u64 start = fc_globaltimer_ns();
    for (;;) {
        if (lamport_load(at, v)) return true;
        if (fc_globaltimer_ns() - start >= p.timeout_ns) {
            raise_timeout(p, src, epoch);
            return false;
        }
    }
}

// Packs of a row one thread of the LL one-shot holds in registers: the
// kernel serves rows of at most FU_LL_PACKS * blockDim * 8 elements (the
// host's FUSED_LL_MAX_HIDDEN: 8192 at 512 threads).
#define FU_LL_PACKS 2

// The block's row maximum of `amax` (every thread's), as fused_rows_block
// combines it; every thread runs its barriers.
FC_DEVICE float fu_block_max(float amax, float* shared) {
    const fc_u32 tid = fc_thread_id();
    amax = fu_group_max(amax);
    fc_barrier();
    if (tid % FU_GROUP == 0) shared[1 + tid / FU_GROUP] = amax;
    fc_barrier();
    if (tid == 0) {
        float m = shared[1];
        for (fc_u32 k = 1; k < fc_block_threads() / FU_GROUP; ++k) m = fc_fmax(m, shared[1 + k]);
        shared[0] = m;
    }
    fc_barrier();
    return shared[0];
}

// One-shot fused, LL: the push one-shot's data flow with data that carries
// its own arrival (common.cuh, "Lamport area"), so no flag round trip and
// no grid barrier sit between a rank's rows and the epilogue that reads them
// (the push one-shot's arrive_wait was most of its time at a few tokens).
// The rows travel as they are: the LL all-reduce's lines carry 8 data bytes
// in 16, and from 32 rows of 4096 a kernel on them was bound by those bytes
// (2x H200). The whole call is one
// epoch: the host takes this kind only when every row fits one source's
// part of the area (tokens * row_bytes <= lamport_stride) and a row fits
// FU_LL_PACKS packs a thread. Block b owns rows [b*per, (b+1)*per), one row
// at a time, pack i of a row always on thread i % nt (its m-th pack,
// m = i / nt).
// 1. Our record to every peer (ll_send_record). Every pack of our rows (or,
//    with MOE, the pack the MoE prologue computes) goes to our part of every
//    peer's Lamport area, and to our staging area (the push one-shot's
//    region of this parity, row j at j * row_bytes: nothing else writes it
//    during this epoch; peers' push kinds use the other parity at E + 1),
//    where the same thread finds it again in 3.
// 2. Every peer's record (ll_check_record); on a failure, exit.
// 3. Per row, per pack held: the residual and weight loads first, then
//    every peer's pack (emptied for E + 2 once read), the sum in rank
//    order (fu_reduce_pack's), allreduce_out, the residual add and
//    residual_out (fu_residual_pack's steps): the residual stays in
//    registers and, for the norm, in shared memory, where group 0 takes the
//    sum of squares in the lane order; then the normed pack and the
//    quantization from registers. Every value is the push one-shot's, bit
//    for bit (a NaN sent as another NaN sums to the same canonical NaN);
//    only where it lives between the steps differs.
template <class T, int PAT, bool MOE = false>
FC_DEVICE void fused_oneshot_ll(const FcParams& p) {
    __shared__ fc_vec16 fu_row[FU_LL_PACKS * FC_MAX_BLOCK_THREADS];
    __shared__ float fu_shared[FC_MAX_BLOCK_THREADS / FU_GROUP + 1];
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 flag = epoch | 1u;
    const fc_u32 b = fc_block_id();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u32 tid = fc_thread_id();
    const fc_u32 nt = fc_block_threads();
    const fc_u64 hidden = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_HIDDEN];
    const fc_u64 row_bytes = hidden * sizeof(typename T::S);
    const fc_u32 packs = (fc_u32)(hidden / 8);
    const fc_u64 tokens = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_TOKENS];
    const fc_u64 per = div_ceil(tokens, fc_grid_blocks());
    const fc_u64 rlo = min_u64((fc_u64)b * per, tokens);
    const fc_u64 rhi = min_u64(rlo + per, tokens);
    const fc_u64 stride = lamport_stride(p);
    const fc_u64 area = lamport_offset(p, parity);
    char* staging = own + region_offset(p, parity);

    ll_send_record(p, parity, b, flag);
    for (fc_u64 j = rlo; j < rhi; ++j) {
        for (fc_u32 i = tid; i < packs; i += nt) {
            const fc_u64 at = j * row_bytes + (fc_u64)i * 16u;
            fc_vec16 v;
            if (MOE) {
                v = fu_moe_pack<T, FU_MOE_GROUP_LL>(p, j, (fc_u64)i * 16u, row_bytes);
            } else {
                v = fc_load16(fc_ptr<const char>(p.input) + at);
            }
            fc_store16(staging + at, v);
            const fc_vec16 l = lamport_send_pack(v);
            for (fc_u32 n = 1; n < world; ++n) {
                fc_u32 q = rank + n;
                if (q >= world) q -= world;
                lamport_store(fc_ptr<char>(p.peer_ws[q] + area + (fc_u64)rank * stride + at), l);
            }
        }
    }

    bool failed = !ll_check_record(p, own, parity, b, flag, epoch);
    if (fc_barrier_or(failed)) return;

    // The epilogue's operands only now: live across the MoE prologue above
    // they cost it spills.
    const FuRows w = fu_rows<T>(p);
    for (fc_u64 j = rlo; j < rhi; ++j) {
        const fc_u64 rb = j * row_bytes;
        fc_vec16 res[FU_LL_PACKS], wt[FU_LL_PACKS];
        // (Guards, not breaks, in the loops over m: each must unroll to
        // constant indices into res and wt.)
#pragma unroll
        for (int m = 0; m < FU_LL_PACKS; ++m) {
            const fc_u32 i = tid + (fc_u32)m * nt;
            // Loads that do not wait for peers go first.
            if (i < packs) {
                res[m] = fc_load16(w.resid_in + rb + (fc_u64)i * 16u);
                if (PAT != FU_PAT_RES) wt[m] = fc_load16(w.weight + (fc_u64)i * 16u);
            }
        }
#pragma unroll
        for (int m = 0; m < FU_LL_PACKS; ++m) {
            const fc_u32 i = tid + (fc_u32)m * nt;
            if (i >= packs || failed) continue;
            const fc_u64 at = rb + (fc_u64)i * 16u;
            const char* mine = own + area + at; // source 0's copy of this pack
            // Sources one at a time, added in rank order as they come: no
            // array of every source's pack (with one, the registers the
            // row's packs need spilled).
            float a[8], r[8];
            for (fc_u32 s = 0; s < world; ++s) {
                fc_vec16 v;
                if (s == rank) {
                    v = fc_load16(staging + at);
                } else if (!fu_lamport_pack(p, mine + (fc_u64)s * stride, epoch, s, v)) {
                    failed = true;
                    break;
                }
                if (s == 0) {
                    T::unpack(v, a);
                } else {
                    float x[8];
                    T::unpack(v, x);
#pragma unroll
                    for (int e = 0; e < 8; ++e) a[e] = fc_fadd(a[e], x[e]);
                }
            }
            if (failed) continue;
            const fc_vec16 arp = fu_pack<T>(a);
            if (w.ar_out != nullptr) fc_store16(w.ar_out + at, arp);
            T::unpack(arp, a);
            T::unpack(res[m], r);
#pragma unroll
            for (int e = 0; e < 8; ++e) r[e] = fc_fadd(a[e], r[e]);
            res[m] = fu_pack<T>(r);
            fc_store16(w.resid_out + at, res[m]);
            if (PAT != FU_PAT_RES) fu_row[i] = res[m];
            for (fc_u32 s = 0; s < world; ++s)
                if (s != rank) lamport_clear(own + area + (fc_u64)s * stride + at);
        }
        if (PAT == FU_PAT_RES) continue;
        if (fc_barrier_or(failed)) return;
        // The sum of squares in its fixed order (fused_rows_block's), from
        // the row in shared memory.
        if (tid < FU_GROUP) {
            float ss = 0.0f;
            for (fc_u32 i = tid; i < packs; i += FU_GROUP) ss = fu_add_squares<T>(ss, fu_row[i]);
            ss = fu_group_sum(ss);
            if (tid == 0) fu_shared[0] = fu_rstd(ss, w);
        }
        fc_barrier();
        const float rstd = fu_shared[0];
        float scale = 1.0f;
        if (PAT == FU_PAT_RMS_FP8 || PAT == FU_PAT_RMS_NVFP4) scale = fc_load(w.scale);
        float amax = 0.0f;
        if (PAT == FU_PAT_RMS_NVFP4) {
            // Every thread steps alike (pack pairs share a shuffle).
#pragma unroll
            for (int m = 0; m < FU_LL_PACKS; ++m) {
                const fc_u32 i = tid + (fc_u32)m * nt;
                fu_nvfp4_vals_store<T>(w, j, rb, i, res[m], wt[m], rstd, scale, i < packs);
            }
            fc_barrier();
            continue;
        }
#pragma unroll
        for (int m = 0; m < FU_LL_PACKS; ++m) {
            const fc_u32 i = tid + (fc_u32)m * nt;
            if (i >= packs) continue;
            float y[8];
            const fc_vec16 n = fu_norm_vals<T>(res[m], wt[m], rstd, y);
            if (w.norm_out != nullptr) fc_store16(w.norm_out + rb + (fc_u64)i * 16u, n);
            if (PAT == FU_PAT_RMS_FP8) {
                fu_store_quant<PAT>(w.quant_out + j * w.hidden + (fc_u64)i * 8u, y, scale);
            } else if (PAT == FU_PAT_RMS_FP8TOK || PAT == FU_PAT_RMS_I8TOK) {
#pragma unroll
                for (int k = 0; k < 8; ++k) amax = fc_fmax(amax, fu_fabs(y[k]));
            }
        }
        if (PAT == FU_PAT_RMS_FP8TOK || PAT == FU_PAT_RMS_I8TOK) {
            scale = fu_token_scale<PAT>(fu_block_max(amax, fu_shared));
            if (tid == 0) fc_store(w.scale + j, scale);
#pragma unroll
            for (int m = 0; m < FU_LL_PACKS; ++m) {
                const fc_u32 i = tid + (fc_u32)m * nt;
                if (i >= packs) continue;
                float y[8];
                fu_norm_vals<T>(res[m], wt[m], rstd, y);
                fu_store_quant<PAT>(w.quant_out + j * w.hidden + (fc_u64)i * 8u, y, scale);
            }
        }
        // The next row reuses the shared row and words.
        fc_barrier();
    }
    if (fc_barrier_or(failed)) return;
    complete(own, epoch);
}

// S2 of the two-shot: bytes [lo, hi) (whole packs) of our segment, reduced
// in rank order from our inboxes (source r at src + r * stride) and rounded
// (NaN canonical, as every fused store), go to offset `off` of every rank's
// workspace (ourselves included).
template <class T>
FC_DEVICE void fu_reduce_push(const FcParams& p, const char* src, fc_u64 stride, fc_u64 off, fc_u64 lo, fc_u64 hi) {
    const fc_u32 world = p.world;
    const fc_u32 nt = fc_block_threads();
    for (fc_u64 at = lo + (fc_u64)fc_thread_id() * 16u; at < hi; at += (fc_u64)nt * 16u) {
        float a[8];
        fu_reduce_pack<T>(src + at, stride, world, a);
        const fc_vec16 v = fu_pack<T>(a);
        for (fc_u32 q = 0; q < world; ++q) fc_store16(fc_ptr<char>(p.peer_ws[q] + off + at), v);
    }
}

// S1 of the two-shot for the chunk of n rows at row `first` (epoch, parity):
// own rows piece b of every segment d into inbox [rank] of rank d, then
// arrive phase 0. (A function, not a lambda: captured references would put
// the captured locals in scratch memory on AMD.) With MOE each row is
// computed by the MoE prologue on its way to the inbox.
template <class T, bool MOE>
FC_DEVICE void fu_twoshot_stage1(const FcParams& p, fc_u32 epoch, fc_u64 first, fc_u64 n, fc_u64 hidden,
                                 fc_u64 stride, fc_u64 per, bool in_aligned) {
    const int ES = sizeof(typename T::S);
    const fc_u32 parity = epoch & 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u64 row_bytes = hidden * ES;
    const fc_u64 seg = div_ceil(n, world);
    const fc_u64 region = region_offset(p, parity);
    const char* input = fc_ptr<const char>(p.input + first * row_bytes);
    for (fc_u32 k = 0; k < world; ++k) {
        const fc_u32 d = (rank + 1 + k + b) % world;
        const Range r = fu_piece(n, seg, per, d, b);
        // Row j of the chunk lands at inbox + (j - d*seg)*row_bytes.
        const fc_u64 at = region + (fc_u64)rank * stride - (fc_u64)d * seg * row_bytes;
        if (MOE) {
            fu_moe_stage<T, FU_MOE_GROUP_TWOSHOT>(p, first, r.lo, r.hi, at, d, 1u);
        } else {
            copy_range<ES, FC_COPY_UNROLL>(fc_ptr<char>(p.peer_ws[d] + at), input, r.lo * hidden, r.hi * hidden,
                                           in_aligned);
        }
    }
    arrive(p, epoch, parity, 0, b);
}

// Two-shot fused (whole call, push): reduce-scatter by rows, then every rank
// applies the epilogue to every row from the gathered all-reduced rows. The
// all-reduce is twoshot_push's by whole rows: a full chunk is world
// segments of `cap` rows (cap = inbox stride / row_bytes); chunk c's segment
// d is rows [d*seg, min((d+1)*seg, n)), seg = ceil(n / world), and block b
// owns rows piece b (of `per` rows) of every segment. Row j of segment d sits
// at inbox [src] + (j - d*seg)*row_bytes of rank d, and at result +
// d*stride + (j - d*seg)*row_bytes of every rank. Per chunk c:
//   S1(c): for every rank d (staggered by block), copy own rows piece b of
//          segment d into inbox [rank] of rank d; arrive phase 0.
//   W0(c): wait phase 0. S2(c): reduce own segment's piece b from own
//          inboxes 0..world-1 (rank order) into every rank's result slot
//          (ourselves included); arrive phase 1.
//   S1(c+1) (if any), then W1(c): wait phase 1. S3(c): the epilogue of
//          every segment's piece b from our own result slot (local reads;
//          the all-reduced rows are the only source, so their sum is the
//          identity), with our own residual, weight and outputs.
// Every rank computes the epilogue of every row, with its own residual_in:
// the results are those of the one-shot, row for row. The reuse argument is
// twoshot_push's: S2(c) writes result slots last read by S3(c-2). With MOE,
// S1 stages rows computed by the MoE prologue (fu_twoshot_stage1).
template <class T, int PAT, bool MOE = false>
FC_DEVICE void fused_twoshot(const FcParams& p) {
    const int ES = sizeof(typename T::S);
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 e0 = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u64 hidden = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_HIDDEN];
    const fc_u64 tokens = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_TOKENS];
    const fc_u64 row_bytes = hidden * ES;
    const fc_u64 stride = push2_stride(p);
    const fc_u64 cap = stride / row_bytes; // rows of one segment; >= 1 (validated)
    const fc_u64 chunk = cap * world;
    const fc_u64 nchunk = div_ceil(tokens, chunk);
    const fc_u64 per = div_ceil(nchunk > 1 ? cap : div_ceil(tokens, world), nb);
    const bool in_aligned = aligned16(p.input);

    fu_twoshot_stage1<T, MOE>(p, e0, 0, min_u64(chunk, tokens), hidden, stride, per, in_aligned);
    for (fc_u64 c = 0; c < nchunk; ++c) {
        const fc_u32 epoch = e0 + (fc_u32)c;
        const fc_u32 parity = epoch & 1;
        const fc_u64 first = c * chunk;
        const fc_u64 n = min_u64(chunk, tokens - first);
        const fc_u64 seg = div_ceil(n, world);
        const fc_u64 region = region_offset(p, parity);
        const fc_u64 result = region + p.slot_bytes;

        if (!wait_phase(p, own, epoch, parity, 0, b)) return;
        const Range mine = fu_piece(n, seg, per, rank, b);
        const fc_u64 base = (fc_u64)rank * seg * row_bytes;
        fu_reduce_push<T>(p, own + (region - base), stride, result + (fc_u64)rank * stride - base, mine.lo * row_bytes,
                          mine.hi * row_bytes);
        arrive(p, epoch, parity, 1, b);
        if (c + 1 < nchunk) {
            const fc_u64 next = first + chunk;
            fu_twoshot_stage1<T, MOE>(p, epoch + 1, next, min_u64(chunk, tokens - next), hidden, stride, per, in_aligned);
        }
        if (!wait_phase(p, own, epoch, parity, 1, b)) return;

        const FuPieces pieces = {own + result, stride, first, (fc_u32)n, (fc_u32)seg, (fc_u32)per, world};
        fused_rows<T, PAT>(p, pieces, 0, 1u);
    }
    complete(own, e0 + (fc_u32)(nchunk - 1));
}

// ---------------------------------------------------------------- sequence parallel
// (docs/protocol.md, "Sequence-parallel form".) S = tokens / world rows a
// rank, rank d owning rows [d*S, (d+1)*S); the residual tensors and
// allreduce_out hold the rank's S rows. Chunks are the two-shot's (cap rows
// an inbox, ceil(S / cap) of them, so epochs advance alike on every
// backend), but chunk c holds shard rows [c*cap, c*cap + n) of every shard:
// row d*S + c*cap + i sits at inbox [src] + i*row_bytes of rank d, and at
// result + d*stride + i*row_bytes of every rank. Block b owns rows
// [b*per, (b+1)*per) of the chunk's n (per of a full chunk when there are
// several, as the two-shot).

// Range of the chunk's n shard rows that block b owns.
FC_DEVICE Range fu_sp_piece(fc_u64 n, fc_u64 per) {
    Range r;
    r.lo = min_u64((fc_u64)fc_block_id() * per, n);
    r.hi = min_u64(r.lo + per, n);
    return r;
}

// S1 of chunk (epoch, first shard row `first`, n rows): our rows piece b of
// every rank d's shard into inbox [rank] of rank d (ranks staggered by
// block), then arrive phase 0.
template <class T>
FC_DEVICE void fu_sp_stage1(const FcParams& p, fc_u32 epoch, fc_u64 first, fc_u64 n, fc_u64 shard, fc_u64 hidden,
                            fc_u64 stride, fc_u64 per, bool in_aligned) {
    const int ES = sizeof(typename T::S);
    const fc_u32 parity = epoch & 1;
    const fc_u32 b = fc_block_id();
    const fc_u64 row_bytes = hidden * ES;
    const fc_u64 at = region_offset(p, parity) + (fc_u64)p.rank * stride;
    const Range r = fu_sp_piece(n, per);
    for (fc_u32 k = 0; k < p.world; ++k) {
        const fc_u32 d = (p.rank + 1 + k + b) % p.world;
        const char* input = fc_ptr<const char>(p.input + ((fc_u64)d * shard + first) * row_bytes);
        copy_range<ES, FC_COPY_UNROLL>(fc_ptr<char>(p.peer_ws[d] + at), input, r.lo * hidden, r.hi * hidden,
                                       in_aligned);
    }
    arrive(p, epoch, parity, 0, b);
}

// S2 of the gathered form: bytes [lo, hi) of our chunk rows, reduced in rank
// order from our inboxes (source r at inbox + r * stride), the all-reduce
// value rounded (allreduce_out), the residual add with our shard's rows at
// byte `rb` (residual_out; fu_residual_pack's steps), and the new residual
// pack into every rank's result slot at `off` (ourselves included).
template <class T>
FC_DEVICE void fu_sp_reduce_push(const FcParams& p, const char* inbox, fc_u64 stride, fc_u64 rb, fc_u64 off, fc_u64 lo,
                                 fc_u64 hi) {
    const FuRows w = fu_rows<T>(p);
    const fc_u32 world = p.world;
    const fc_u32 nt = fc_block_threads();
    for (fc_u64 at = lo + (fc_u64)fc_thread_id() * 16u; at < hi; at += (fc_u64)nt * 16u) {
        const fc_vec16 v = fu_residual_pack<T>(w, inbox, stride, world, rb, at);
        for (fc_u32 q = 0; q < world; ++q) fc_store16(fc_ptr<char>(p.peer_ws[q] + off + at), v);
    }
}

// The gathered form's epilogue rows: piece b of every shard d of the chunk,
// v = d * per + k, row i = b * per + k of shard d (one source, the final
// residual) at result + d * stride + i * row_bytes, global row d * shard +
// first + i.
struct FuSpRows {
    const char* result;
    fc_u64 stride, first, shard;
    fc_u32 n, per, world;
};
FC_DEVICE fc_u64 fu_count(const FuSpRows& m) { return (fc_u64)m.world * m.per; }
FC_DEVICE bool fu_row_at(const FuSpRows& m, fc_u64 row_bytes, fc_u64 v, const char*& src, fc_u64& g) {
    const fc_u32 d = (fc_u32)v / m.per;
    const fc_u64 i = (fc_u64)fc_block_id() * m.per + ((fc_u32)v - d * m.per);
    if (i >= m.n) return false;
    src = m.result + (fc_u64)d * m.stride + i * row_bytes;
    g = (fc_u64)d * m.shard + m.first + i;
    return true;
}

// Sequence-parallel fused (whole call, push): reduce-scatter + residual +
// RMSNorm (+ quantization) (+ all-gather). Per chunk c (epoch E + c):
// Shard form (GATHER false, or nothing to gather: PAT_RES):
//   S1(c): our rows piece b of every shard into its owner's inbox [rank];
//          arrive phase 0. W0(c).
//   E(c):  the whole epilogue (fused_rows, the one-shot's walk) of our
//          chunk rows piece b from our inboxes, sources in rank order, with
//          our residual shard; every output at the shard's row c*cap + i.
//   One handshake a chunk: a peer's S1(c + 2) writes our inboxes of this
//   parity only after its W0(c + 1), i.e. after our S1(c + 1), which
//   follows our E(c) (so S1 is not pipelined here).
// Gathered form (the two-shot's buffers):
//   S1(c), arrive 0. W0(c). S2(c): fu_sp_reduce_push of piece b (residual
//   shard rows written), new residual rows to every rank's result slot;
//   arrive 1. W1(c). S3(c): RMSNorm and quantization (no residual add: the
//   rows are the residual) of piece b of every shard from our own result
//   slot; outputs at global rows d*S + c*cap + i. Then S1(c + 1) (if any).
//   Reuse: a peer's S1(c + 2) (after its W1(c + 1), so after our S2(c + 1))
//   writes our inboxes of this parity after our S2(c) read them; its S2(c
//   + 2) (after its W0(c + 2), so after our S1(c + 2), which follows our
//   S3(c + 1)) writes our result slot of this parity after our S3(c) read
//   it. S1(c + 1) comes after S3(c), not before W1(c) as in the two-shot:
//   pipelined there, hipcc gave the NVFP4 kernels a 68-byte stack frame
//   (gfx942 and gfx950).
// Every value is the all-reduce form's on the same row (the same steps in
// the same fp32 order: the one-shot's walk, or pass 1's sum of squares on
// the stored residual values).
template <class T, int PAT, bool GATHER>
FC_DEVICE void fused_sp(const FcParams& p) {
    const int ES = sizeof(typename T::S);
    constexpr bool gather = GATHER && PAT != FU_PAT_RES;
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 e0 = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u64 hidden = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_HIDDEN];
    const fc_u64 shard = p.per_peer[FU_ROW_SCALARS][FU_SCALAR_TOKENS] / world;
    const fc_u64 row_bytes = hidden * ES;
    const fc_u64 stride = push2_stride(p);
    const fc_u64 cap = stride / row_bytes; // >= 1 (validated)
    const fc_u64 nchunk = div_ceil(shard, cap);
    const fc_u64 per = div_ceil(nchunk > 1 ? cap : shard, nb);
    const bool in_aligned = aligned16(p.input);

    if (gather) fu_sp_stage1<T>(p, e0, 0, min_u64(cap, shard), shard, hidden, stride, per, in_aligned);
    for (fc_u64 c = 0; c < nchunk; ++c) {
        const fc_u32 epoch = e0 + (fc_u32)c;
        const fc_u32 parity = epoch & 1;
        const fc_u64 first = c * cap;
        const fc_u64 n = min_u64(cap, shard - first);
        const fc_u64 region = region_offset(p, parity);
        const Range mine = fu_sp_piece(n, per);
        if (!gather) {
            fu_sp_stage1<T>(p, epoch, first, n, shard, hidden, stride, per, in_aligned);
            if (!wait_phase(p, own, epoch, parity, 0, b)) return;
            const FuSpan span = {own + region, first, mine.lo, mine.hi - mine.lo};
            fused_rows<T, PAT>(p, span, stride, world);
            continue;
        }
        if (!wait_phase(p, own, epoch, parity, 0, b)) return;
        const fc_u64 result = region + p.slot_bytes;
        fu_sp_reduce_push<T>(p, own + region, stride, first * row_bytes, result + (fc_u64)p.rank * stride,
                             mine.lo * row_bytes, mine.hi * row_bytes);
        arrive(p, epoch, parity, 1, b);
        if (!wait_phase(p, own, epoch, parity, 1, b)) return;
        const FuSpRows rows = {own + result, stride, first, shard, (fc_u32)n, (fc_u32)per, world};
        fused_rows<T, PAT, FuSpRows, false>(p, rows, 0, 1u);
        if (c + 1 < nchunk) {
            const fc_u64 next = first + cap;
            fu_sp_stage1<T>(p, epoch + 1, next, min_u64(cap, shard - next), shard, hidden, stride, per, in_aligned);
        }
    }
    complete(own, e0 + (fc_u32)(nchunk - 1));
}

} // namespace fc

// ===========================================================================
// Entry points are generated by ferrocomm::algo::fused (fused_entry), one
// FC_KERNEL per name: fc_fused_<kind>_[moe_]<pattern>_<dtype> (the SP kinds
// sp_gather / sp_shard take no MoE prologue).
