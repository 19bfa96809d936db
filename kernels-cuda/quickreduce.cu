// ferrocomm quick-reduce: a two-shot all-reduce whose payloads cross the
// links quantized (FP8 e4m3fn / e4m3fnuz, INT8, INT6, INT4, FP4 e2m1), for f16/bf16
// sums; and the codec alone (fc_qr_encode_*), so tests can compare encoded
// blocks with the host's bit for bit.
//
// The contract: docs/quick-reduce.md (protocol and layout) and src/codec
// (the wire format and the arithmetic of encoding and decoding, which the
// host backend runs too). Vendor neutral like common.cuh; the module text is
// prelude + common.cuh + this file (src/algo/kernels.rs).
//
// Thread mapping: a thread owns 8 consecutive elements (one 16-byte vector of
// f16/bf16), so 4 consecutive lanes hold one 32-element codec block and share
// its scale through two xor-shuffles. Loops over such groups are warp-uniform
// (every lane runs every iteration, idle ones with zeros), because shuffles
// need the whole warp.

#ifndef FC_COMMON_INCLUDED
#include "common.cuh"
#endif

// Codec ids (template parameter; the kernel names spell them out).
#define FC_QR_FP8 0
#define FC_QR_FP8FNUZ 1
#define FC_QR_INT8 2
#define FC_QR_INT6 3
#define FC_QR_INT4 4
#define FC_QR_FP4 5

namespace fc {

// ===========================================================================
// Codecs (src/codec/mod.rs). CODE_BYTES: one 32-element block's codes.
// div(): the exact scale is absmax / div() (the most negative code for
// integers, the largest finite value for FP8 and FP4); recip(): 1 / div()
// where that is a power of two, so multiplying by it is the correctly rounded
// division. CODE_BYTES 16 (INT4, FP4): 8 nibbles a thread, one plane.

template <int C>
struct QrCodec;
template <>
struct QrCodec<FC_QR_INT4> {
    enum { INT = 1, FNUZ = 0, CODE_BYTES = 16, QMIN = -8, QMAX = 7, MASK = 0xf };
    FC_DEVICE float div() { return -8.0f; }
    FC_DEVICE float recip() { return -0.125f; }
};
template <>
struct QrCodec<FC_QR_INT6> {
    enum { INT = 1, FNUZ = 0, CODE_BYTES = 24, QMIN = -32, QMAX = 31, MASK = 0x3f };
    FC_DEVICE float div() { return -32.0f; }
    FC_DEVICE float recip() { return -0.03125f; }
};
template <>
struct QrCodec<FC_QR_INT8> {
    enum { INT = 1, FNUZ = 0, CODE_BYTES = 32, QMIN = -128, QMAX = 127, MASK = 0xff };
    FC_DEVICE float div() { return -128.0f; }
    FC_DEVICE float recip() { return -0.0078125f; }
};
template <>
struct QrCodec<FC_QR_FP8> {
    enum { INT = 0, FNUZ = 0, CODE_BYTES = 32, QMIN = 0, QMAX = 0, MASK = 0xff };
    FC_DEVICE float div() { return 448.0f; }
    FC_DEVICE float recip() { return 0.0f; }
};
template <>
struct QrCodec<FC_QR_FP8FNUZ> {
    enum { INT = 0, FNUZ = 1, CODE_BYTES = 32, QMIN = 0, QMAX = 0, MASK = 0xff };
    FC_DEVICE float div() { return 240.0f; }
    FC_DEVICE float recip() { return 0.0f; }
};
template <>
struct QrCodec<FC_QR_FP4> {
    enum { INT = 0, FNUZ = 0, CODE_BYTES = 16, QMIN = 0, QMAX = 0, MASK = 0xf };
    FC_DEVICE float div() { return 6.0f; }
    FC_DEVICE float recip() { return 0.0f; }
};

// The canonical quiet NaN of the 16-bit type (src/codec Half16::NAN_BITS).
FC_DEVICE fc_u32 qr_nan_bits(TF16) { return 0x7e00u; }
FC_DEVICE fc_u32 qr_nan_bits(TBF16) { return 0x7fc0u; }

// rint(y) and float(q) for |y|, |q| < 2^22 with full-rate float adds instead
// of conversions: adding 1.5 * 2^23 rounds y to an integer (to nearest even,
// as rint does) and leaves 0x4B400000 + q in the bits, exactly.
#define FC_QR_MAGIC 12582912.0f
#define FC_QR_MAGIC_BITS 0x4B400000

FC_DEVICE fc_i32 qr_rint_biased(float y) { return (fc_i32)fc_f32_as_u32(fc_fadd(y, FC_QR_MAGIC)); }
FC_DEVICE float qr_int_to_f32(fc_i32 q) { return fc_fadd(fc_u32_as_f32((fc_u32)(FC_QR_MAGIC_BITS + q)), -FC_QR_MAGIC); }
FC_DEVICE fc_i32 qr_max(fc_i32 a, fc_i32 b) { return a > b ? a : b; }
FC_DEVICE fc_i32 qr_min(fc_i32 a, fc_i32 b) { return a < b ? a : b; }

// ---------------------------------------------------------------------------
// FP8 e4m3 in software: round to nearest even, saturate to +-max (what
// cvt.rn.satfinite does); fn keeps the sign of zero, fnuz has no -0. Used
// where the device has no conversion for the flavour (sm_80, fnuz on NVIDIA,
// fn on AMD), and gives the same bits as the hardware and the host.
template <int FNUZ>
FC_DEVICE fc_u32 qr_e4m3_encode_sw(float v) {
    const int bias = FNUZ ? 8 : 7;
    const fc_u32 u = fc_f32_as_u32(v);
    const float a = fc_u32_as_f32(u & 0x7fffffffu);
    const int e = (int)((u >> 23) & 0xffu) - 127; // floor(log2 a) for normal a
    fc_u32 code;
    if (a >= (FNUZ ? 240.0f : 448.0f)) {
        code = FNUZ ? 0x7fu : 0x7eu;
    } else if (e < 1 - bias) {
        // Subnormal: steps of 2^(-bias-2); 8 steps is the smallest normal (code 8).
        code = (fc_u32)fc_rintf(fc_fmul(a, fc_u32_as_f32((fc_u32)(127 + bias + 2) << 23)));
    } else {
        // Normal: a * 2^(3-e) is in [8, 16); 16 carries into the exponent.
        fc_u32 m = (fc_u32)fc_rintf(fc_fmul(a, fc_u32_as_f32((fc_u32)(127 + 3 - e) << 23)));
        fc_u32 ef = (fc_u32)(e + bias);
        if (m == 16u) {
            m = 8u;
            ef += 1u;
        }
        code = (ef << 3) | (m - 8u);
    }
    const bool neg = (u >> 31) != 0;
    if (neg && (!FNUZ || code != 0u)) code |= 0x80u;
    return code;
}

template <int FNUZ>
FC_DEVICE float qr_e4m3_decode_sw(fc_u32 code) {
    const int bias = FNUZ ? 8 : 7;
    const fc_u32 ef = (code >> 3) & 15u;
    const fc_u32 m = code & 7u;
    const float mag = ef == 0u ? fc_fmul(qr_int_to_f32((fc_i32)m), fc_u32_as_f32((fc_u32)(127 - bias - 2) << 23))
                               : fc_u32_as_f32(((ef - bias + 127u) << 23) | (m << 20));
    return (code & 0x80u) ? -mag : mag;
}

// Two FP8 codes (the low byte is `lo`), in hardware where the flavour has it.
template <int FNUZ>
FC_DEVICE fc_u32 qr_fp8_pack2(float lo, float hi) {
#if defined(FC_HW_E4M3FN)
    if (!FNUZ) return fc_e4m3_pack2(lo, hi);
#endif
#if defined(FC_HW_E4M3FNUZ)
    if (FNUZ) return fc_e4m3_pack2(lo, hi);
#endif
    return qr_e4m3_encode_sw<FNUZ>(lo) | (qr_e4m3_encode_sw<FNUZ>(hi) << 8);
}

template <int FNUZ>
FC_DEVICE void qr_fp8_unpack2(fc_u32 two, float& lo, float& hi) {
#if defined(FC_HW_E4M3FN)
    if (!FNUZ) {
        fc_e4m3_unpack2(two, lo, hi);
        return;
    }
#endif
#if defined(FC_HW_E4M3FNUZ)
    if (FNUZ) {
        fc_e4m3_unpack2(two, lo, hi);
        return;
    }
#endif
    lo = qr_e4m3_decode_sw<FNUZ>(two & 0xffu);
    hi = qr_e4m3_decode_sw<FNUZ>((two >> 8) & 0xffu);
}

// ---------------------------------------------------------------------------
// FP4 e2m1 in software (src/codec/fp4.rs): magnitudes 0, 0.5, 1, 1.5, 2, 3,
// 4, 6 are codes 0..7, bit 3 the sign (kept, zero included). Rounded to
// nearest, ties to the even code, saturated to +-6. Each binade's codes are
// consecutive and the grid's step there a power of two, so scaling by
// 1 / step (exact) and rounding to an even integer picks the even code; the
// code's parity is the integer's. Never sees NaN (such a block is NaN whole).
FC_DEVICE fc_u32 qr_e2m1_encode(float v) {
    const fc_u32 u = fc_f32_as_u32(v);
    const float a = fc_u32_as_f32(u & 0x7fffffffu);
    fc_u32 code;
    if (a >= 6.0f) {
        code = 7u; // satfinite
    } else if (a >= 4.0f) {
        code = 4u + (fc_u32)(qr_rint_biased(fc_fmul(a, 0.5f)) - FC_QR_MAGIC_BITS); // rint(a / 2) = 2 or 3: codes 6, 7
    } else if (a >= 2.0f) {
        code = 2u + (fc_u32)(qr_rint_biased(a) - FC_QR_MAGIC_BITS); // rint(a) = 2, 3 or 4: codes 4, 5, 6
    } else {
        code = (fc_u32)(qr_rint_biased(fc_fmul(a, 2.0f)) - FC_QR_MAGIC_BITS); // rint(2a) = 0..4: codes 0..4
    }
    return code | ((u >> 28) & 8u);
}

// The value of a 4-bit code: codes 2..7 are normal (exponent (m >> 1) - 1,
// mantissa bit m & 1), code 1 is 0.5, code 0 is 0.
FC_DEVICE float qr_e2m1_decode(fc_u32 code) {
    const fc_u32 m = code & 7u;
    const fc_u32 mag = m >= 2u ? (((m >> 1) + 126u) << 23) | ((m & 1u) << 22) : (m == 1u ? 0x3f000000u : 0u);
    return fc_u32_as_f32(mag | ((code & 8u) << 28));
}

// ===========================================================================
// One thread's part of a block: 8 elements' codes and the block's scale.
// Thread j of a block holds elements 8j..8j+7: INT4 and FP4 `lo` = 8
// nibbles at byte 4j of the block's codes; 8-bit codecs `lo`, `hi` = 8 bytes at byte
// 8j; INT6 `lo` = the low nibbles at byte 4j of plane 0 (16 bytes a block)
// and `hi` = the high 2-bit parts at byte 2j of plane 1 (8 bytes a block).
struct QrCodes {
    fc_u32 lo, hi, scale;
};

// Encode 8 elements (as f32); the 4 lanes of a block call it together.
template <int C, class T>
FC_DEVICE QrCodes qr_encode(const float (&x)[8]) {
    typedef QrCodec<C> K;
    // Magnitude bits of the largest non-negative and negative elements (0 if
    // none): as integers they order like the magnitudes, NaN and Inf on top.
    fc_i32 pos = 0, neg = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const fc_u32 u = fc_f32_as_u32(x[k]);
        pos = qr_max(pos, (fc_i32)u);
        neg = qr_max(neg, (fc_i32)(u ^ 0x80000000u));
    }
    pos = qr_max(pos, (fc_i32)fc_shfl_xor((fc_u32)pos, 1u));
    neg = qr_max(neg, (fc_i32)fc_shfl_xor((fc_u32)neg, 1u));
    pos = qr_max(pos, (fc_i32)fc_shfl_xor((fc_u32)pos, 2u));
    neg = qr_max(neg, (fc_i32)fc_shfl_xor((fc_u32)neg, 2u));

    QrCodes c;
    c.lo = 0u;
    c.hi = 0u;
    c.scale = 0u;
    const fc_u32 amax = (fc_u32)qr_max(pos, neg);
    if (amax >= 0x7f800000u) { // NaN or Inf in the block: it decodes to NaN
        c.scale = qr_nan_bits(T());
        return c;
    }
    float exact = K::INT ? fc_fmul(fc_u32_as_f32(amax), K::recip()) : fc_fdiv(fc_u32_as_f32(amax), K::div());
    // Integers: the largest magnitude takes the most negative code, so flip
    // the scale's sign when that element is negative (only then).
    if (K::INT && neg > pos) exact = -exact;
    const fc_u16 sb = T::from_acc(exact);
    const float s = T::to_acc(sb);
    const float inv = fc_frcp(s);
    if ((fc_f32_as_u32(inv) & 0x7f800000u) == 0x7f800000u) return c; // scale 0 or tiny: the block is 0
    c.scale = sb;
    if (K::INT) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            fc_i32 r = qr_rint_biased(fc_fmul(x[k], inv));
            r = qr_min(qr_max(r, FC_QR_MAGIC_BITS + K::QMIN), FC_QR_MAGIC_BITS + K::QMAX);
            const fc_u32 q = (fc_u32)r & (fc_u32)K::MASK; // the low bits of the biased value are q's
            if (C == FC_QR_INT4) {
                c.lo |= q << (4 * k);
            } else if (C == FC_QR_INT6) {
                c.lo |= (q & 0xfu) << (4 * k);
                c.hi |= (q >> 4) << (2 * k);
            } else if (k < 4) {
                c.lo |= q << (8 * k);
            } else {
                c.hi |= q << (8 * (k - 4));
            }
        }
    } else if (C == FC_QR_FP4) {
#pragma unroll
        for (int k = 0; k < 8; ++k) c.lo |= qr_e2m1_encode(fc_fmul(x[k], inv)) << (4 * k);
    } else {
        float y[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = fc_fmul(x[k], inv);
        c.lo = qr_fp8_pack2<K::FNUZ>(y[0], y[1]) | (qr_fp8_pack2<K::FNUZ>(y[2], y[3]) << 16);
        c.hi = qr_fp8_pack2<K::FNUZ>(y[4], y[5]) | (qr_fp8_pack2<K::FNUZ>(y[6], y[7]) << 16);
    }
    return c;
}

// Decode 8 elements to f32 (code times scale; a NaN scale gives NaN).
template <int C, class T>
FC_DEVICE void qr_decode(const QrCodes& c, float (&y)[8]) {
    typedef QrCodec<C> K;
    const float s = T::to_acc((fc_u16)c.scale);
    if (K::INT) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            fc_u32 q;
            if (C == FC_QR_INT4) {
                q = c.lo >> (4 * k);
            } else if (C == FC_QR_INT6) {
                q = ((c.lo >> (4 * k)) & 0xfu) | (((c.hi >> (2 * k)) & 3u) << 4);
            } else {
                q = (k < 4 ? c.lo : c.hi) >> (8 * (k & 3));
            }
            const int bits = C == FC_QR_INT4 ? 4 : C == FC_QR_INT6 ? 6 : 8;
            const fc_i32 v = (fc_i32)(q << (32 - bits)) >> (32 - bits); // sign-extend
            y[k] = fc_fmul(qr_int_to_f32(v), s);
        }
    } else if (C == FC_QR_FP4) {
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = fc_fmul(qr_e2m1_decode(c.lo >> (4 * k)), s);
    } else {
        float v[8];
        qr_fp8_unpack2<K::FNUZ>(c.lo & 0xffffu, v[0], v[1]);
        qr_fp8_unpack2<K::FNUZ>(c.lo >> 16, v[2], v[3]);
        qr_fp8_unpack2<K::FNUZ>(c.hi & 0xffffu, v[4], v[5]);
        qr_fp8_unpack2<K::FNUZ>(c.hi >> 16, v[6], v[7]);
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = fc_fmul(v[k], s);
    }
}

// Decode and round to T, as the output is written: a NaN block is the
// canonical NaN of T (the host's `S::from_f32(f32::NAN)`), whatever NaN bits
// the device's arithmetic made.
template <int C, class T>
FC_DEVICE fc_vec16 qr_decode_out(const QrCodes& c) {
    const float s = T::to_acc((fc_u16)c.scale);
    fc_vec16 v;
    if (s != s) {
        const fc_u32 nan = qr_nan_bits(T());
#pragma unroll
        for (int k = 0; k < 4; ++k) v.w[k] = nan | (nan << 16);
        return v;
    }
    float y[8];
    qr_decode<C, T>(c, y);
    return T::pack(y);
}

// ===========================================================================
// Encoded runs in memory (src/codec): each code plane of `blocks` blocks in
// turn, then their scales (`run` is 16-byte aligned). Thread j (0..3) of
// block k; a warp's lanes touch contiguous bytes of every plane.

template <int C>
FC_DEVICE QrCodes qr_load_codes(const char* run, fc_u64 blocks, fc_u64 k, fc_u32 j) {
    typedef QrCodec<C> K;
    const char* at = run + k * K::CODE_BYTES;
    QrCodes c;
    if (K::CODE_BYTES == 16) {
        c.lo = fc_load(reinterpret_cast<const fc_u32*>(at + 4u * j));
        c.hi = 0u;
    } else if (C == FC_QR_INT6) {
        c.lo = fc_load(reinterpret_cast<const fc_u32*>(run + k * 16u + 4u * j));
        c.hi = fc_load(reinterpret_cast<const fc_u16*>(run + blocks * 16u + k * 8u + 2u * j));
    } else {
        const fc_u64 w = fc_load(reinterpret_cast<const fc_u64*>(at + 8u * j));
        c.lo = (fc_u32)w;
        c.hi = (fc_u32)(w >> 32);
    }
    c.scale = fc_load(reinterpret_cast<const fc_u16*>(run + blocks * K::CODE_BYTES + 2u * k));
    return c;
}

template <int C>
FC_DEVICE void qr_store_codes(char* run, fc_u64 blocks, fc_u64 k, fc_u32 j, const QrCodes& c) {
    typedef QrCodec<C> K;
    char* at = run + k * K::CODE_BYTES;
    if (K::CODE_BYTES == 16) {
        fc_store(reinterpret_cast<fc_u32*>(at + 4u * j), c.lo);
    } else if (C == FC_QR_INT6) {
        fc_store(reinterpret_cast<fc_u32*>(run + k * 16u + 4u * j), c.lo);
        fc_store(reinterpret_cast<fc_u16*>(run + blocks * 16u + k * 8u + 2u * j), (fc_u16)c.hi);
    } else {
        fc_store(reinterpret_cast<fc_u64*>(at + 8u * j), (fc_u64)c.lo | ((fc_u64)c.hi << 32));
    }
    if (j == 0u) fc_store(reinterpret_cast<fc_u16*>(run + blocks * K::CODE_BYTES + 2u * k), (fc_u16)c.scale);
}

// Elements e..e+7 of a 16-bit array as f32; those at or past `hi` (and all
// of them when !active) read as +0.
template <class T>
FC_DEVICE void qr_load_x(const char* base, fc_u64 e, fc_u64 hi, bool aligned, bool active, float (&x)[8]) {
    if (active && aligned && e + 8u <= hi) {
        T::unpack(fc_load16(base + e * 2u), x);
        return;
    }
    const fc_u16* b = reinterpret_cast<const fc_u16*>(base);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = (active && e + k < hi) ? T::to_acc(fc_load(b + e + k)) : 0.0f;
}

// Store elements e..e+7 (those below `hi`) of a 16-bit array.
FC_DEVICE void qr_store_y(char* base, fc_u64 e, fc_u64 hi, bool aligned, const fc_vec16& v) {
    if (aligned && e + 8u <= hi) {
        fc_store16(base + e * 2u, v);
        return;
    }
    fc_u16* b = reinterpret_cast<fc_u16*>(base);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (e + k < hi) fc_store(b + e + k, (fc_u16)(v.w[k / 2] >> (16 * (k & 1))));
    }
}

// ===========================================================================
// Quick-reduce all-reduce (docs/quick-reduce.md), shaped like the push
// two-shot (protocol.md): whole call, chunks of `world` segments, one epoch
// per chunk, the next chunk's first stage overlapping this chunk's gather.
//
// Geometry: inbox stride S = (slot_bytes / world) & ~255 bytes holds one
// encoded segment of up to `capb` = p.aux blocks (the host's choice, at most
// S / (CODE_BYTES + 2); a run of capb blocks: fixed positions whatever the
// chunk, so a block touches the same bytes in every chunk). A launch of count elements runs nchunk =
// ceil(count / (world * 32 * capb)) chunks of `chunk` = ceil(count / nchunk)
// rounded up to world * 32 elements (the last may be shorter). Chunk c of n
// elements has segments of seg = round_up(ceil(n / world), 32); block b owns
// elements [b*per, (b+1)*per) of every segment, per =
// round_up(ceil(chunk / world / nb), 32).
//
// Per chunk c:
//   S1(c): for every rank d, encode our piece of segment d into inbox [rank]
//          of rank d (first slot of the parity region); arrive phase 0.
//   W0(c); S2(c): decode our piece of our segment from every inbox, sum in
//          rank order in f32, round to T, encode; write the decoded result to
//          our output and the codes to result [rank] of every peer (second
//          slot); arrive phase 1.
//   S1(c + 1) if any; W1(c); S3(c): decode every other segment's piece from
//          our result slot into the output.

FC_DEVICE fc_u64 round_up32(fc_u64 x) { return (x + 31u) & ~(fc_u64)31; }
FC_DEVICE fc_u64 qr_stride(const FcParams& p) { return (p.slot_bytes / p.world) & ~(fc_u64)255; }

// Elements of segment d in a chunk of n: [lo, hi) of its piece b, relative
// to the segment's start; empty when lo >= hi.
FC_DEVICE Range qr_piece(fc_u64 n, fc_u64 seg, fc_u64 per, fc_u32 d, fc_u32 b) {
    const fc_u64 start = (fc_u64)d * seg;
    const fc_u64 len = start < n ? min_u64(seg, n - start) : 0;
    Range r;
    r.lo = min_u64((fc_u64)b * per, len);
    r.hi = min_u64(r.lo + per, len);
    return r;
}

// Groups (8 elements) of a piece: whole blocks, so the 4 lanes of a block
// are all busy or all idle.
FC_DEVICE fc_u64 qr_groups(const Range& r) { return round_up32(r.hi - r.lo) / 8u; }

// How many groups a thread handles per loop trip (loads issued together).
#define FC_QR_UNROLL 4

template <int C, class T>
FC_DEVICE void qr_stage1(const FcParams& p, fc_u64 first, fc_u64 n, fc_u64 seg, fc_u64 per, fc_u64 capb,
                         fc_u64 region, bool in_aligned) {
    const fc_u32 b = fc_block_id(), t = fc_thread_id(), nt = fc_block_threads(), lane = fc_lane_id();
    const fc_u32 world = p.world, rank = p.rank;
    const fc_u64 stride = qr_stride(p);
    for (fc_u32 k = 0; k < world; ++k) {
        const fc_u32 d = (rank + 1 + k + b) % world;
        const Range r = qr_piece(n, seg, per, d, b);
        if (r.lo >= r.hi) continue;
        const fc_u64 ng = qr_groups(r);
        const char* in = fc_ptr<const char>(p.input + (first + (fc_u64)d * seg) * 2u);
        char* run = fc_ptr<char>(p.peer_ws[d] + region + (fc_u64)rank * stride);
        for (fc_u64 g0 = t - lane; g0 < ng; g0 += (fc_u64)nt * FC_QR_UNROLL) {
            float x[FC_QR_UNROLL][8];
#pragma unroll
            for (int u = 0; u < FC_QR_UNROLL; ++u) {
                const fc_u64 g = g0 + (fc_u64)u * nt + lane;
                qr_load_x<T>(in, r.lo + g * 8u, r.hi, in_aligned, g < ng, x[u]);
            }
#pragma unroll
            for (int u = 0; u < FC_QR_UNROLL; ++u) {
                const fc_u64 g = g0 + (fc_u64)u * nt + lane;
                const QrCodes c = qr_encode<C, T>(x[u]);
                if (g < ng) qr_store_codes<C>(run, capb, (r.lo + g * 8u) / 32u, lane & 3u, c);
            }
        }
    }
}

template <int C, class T>
FC_DEVICE void qr_stage2(const FcParams& p, char* output, fc_u64 n, fc_u64 seg, fc_u64 per, fc_u64 capb,
                         fc_u64 region, bool out_aligned) {
    const fc_u32 b = fc_block_id(), t = fc_thread_id(), nt = fc_block_threads(), lane = fc_lane_id();
    const fc_u32 world = p.world, rank = p.rank;
    const fc_u64 stride = qr_stride(p);
    const Range r = qr_piece(n, seg, per, rank, b);
    if (r.lo >= r.hi) return;
    const fc_u64 ng = qr_groups(r);
    const char* inbox = fc_ptr<const char>(p.peer_ws[rank] + region);
    const fc_u64 result = region + p.slot_bytes + (fc_u64)rank * stride;
    char* out = output + (fc_u64)rank * seg * 2u;
    for (fc_u64 g0 = t - lane; g0 < ng; g0 += nt) {
        const fc_u64 g = g0 + lane;
        const bool active = g < ng;
        const fc_u64 e = r.lo + g * 8u;
        const fc_u64 k = e / 32u;
        QrCodes in[FC_MAX_RANKS];
#pragma unroll
        for (fc_u32 s = 0; s < FC_MAX_RANKS; ++s) {
            in[s].lo = in[s].hi = in[s].scale = 0u;
            if (s < world && active) in[s] = qr_load_codes<C>(inbox + s * stride, capb, k, lane & 3u);
        }
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
#pragma unroll
        for (fc_u32 s = 0; s < FC_MAX_RANKS; ++s) {
            if (s >= world || !active) break;
            float y[8];
            qr_decode<C, T>(in[s], y);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = s == 0 ? y[i] : fc_fadd(acc[i], y[i]);
        }
        // Round the sum to T; elements past the data are +0, as on the host.
        float mid[8];
        T::unpack(T::pack(acc), mid);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (e + i >= r.hi) mid[i] = 0.0f;
        }
        const QrCodes c = qr_encode<C, T>(mid);
        if (!active) continue;
        qr_store_y(out, e, r.hi, out_aligned, qr_decode_out<C, T>(c));
        // Peers only (staggered by block, so blocks spread over the links).
        for (fc_u32 q = 0; q + 1 < world; ++q) {
            const fc_u32 d = (rank + 1 + (q + b) % (world - 1)) % world;
            qr_store_codes<C>(fc_ptr<char>(p.peer_ws[d] + result), capb, k, lane & 3u, c);
        }
    }
}

template <int C, class T>
FC_DEVICE void qr_stage3(const FcParams& p, char* output, fc_u64 n, fc_u64 seg, fc_u64 per, fc_u64 capb,
                         fc_u64 region, bool out_aligned) {
    const fc_u32 b = fc_block_id(), t = fc_thread_id(), nt = fc_block_threads(), lane = fc_lane_id();
    const fc_u32 world = p.world, rank = p.rank;
    const fc_u64 stride = qr_stride(p);
    for (fc_u32 s = 0; s < world; ++s) {
        if (s == rank) continue;
        const Range r = qr_piece(n, seg, per, s, b);
        if (r.lo >= r.hi) continue;
        const fc_u64 ng = qr_groups(r);
        const char* run = fc_ptr<const char>(p.peer_ws[rank] + region + p.slot_bytes + (fc_u64)s * stride);
        char* out = output + (fc_u64)s * seg * 2u;
        // No shuffles here: a plain per-thread loop.
        for (fc_u64 g = t; g < ng; g += nt) {
            const fc_u64 e = r.lo + g * 8u;
            const QrCodes c = qr_load_codes<C>(run, capb, e / 32u, (fc_u32)(g & 3u));
            qr_store_y(out, e, r.hi, out_aligned, qr_decode_out<C, T>(c));
        }
    }
}

template <int C, class T>
FC_DEVICE void quickreduce(const FcParams& p) {
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 e0 = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u64 capb = p.aux; // codec blocks per segment (algo::layout::qr_segment_blocks)
    // Equal chunks of at most world * 32 * capb elements (algo::layout::qr_chunking),
    // so every block has work in every chunk.
    const fc_u64 nchunk = p.count == 0 ? 1 : div_ceil(p.count, (fc_u64)world * 32u * capb);
    const fc_u64 chunk = div_ceil(div_ceil(p.count, nchunk), (fc_u64)world * 32u) * world * 32u;
    const fc_u64 per = round_up32(div_ceil(chunk / world, nb));
    const bool in_aligned = aligned16(p.input);
    const bool out_aligned = aligned16(p.output);

    qr_stage1<C, T>(p, 0, min_u64(chunk, p.count), round_up32(div_ceil(min_u64(chunk, p.count), world)), per, capb,
                    region_offset(p, e0 & 1), in_aligned);
    arrive(p, e0, e0 & 1, 0, b);
    for (fc_u64 c = 0; c < nchunk; ++c) {
        const fc_u32 epoch = e0 + (fc_u32)c;
        const fc_u32 parity = epoch & 1;
        const fc_u64 first = c * chunk;
        const fc_u64 n = min_u64(chunk, p.count - first);
        const fc_u64 seg = round_up32(div_ceil(n, world));
        const fc_u64 region = region_offset(p, parity);
        char* output = fc_ptr<char>(p.output + first * 2u);

        if (!wait_phase(p, own, epoch, parity, 0, b)) return;
        qr_stage2<C, T>(p, output, n, seg, per, capb, region, out_aligned);
        arrive(p, epoch, parity, 1, b);
        if (c + 1 < nchunk) {
            const fc_u64 first1 = first + chunk;
            const fc_u64 n1 = min_u64(chunk, p.count - first1);
            qr_stage1<C, T>(p, first1, n1, round_up32(div_ceil(n1, world)), per, capb, region_offset(p, (epoch + 1) & 1),
                            in_aligned);
            arrive(p, epoch + 1, (epoch + 1) & 1, 0, b);
        }
        if (!wait_phase(p, own, epoch, parity, 1, b)) return;
        qr_stage3<C, T>(p, output, n, seg, per, capb, region, out_aligned);
    }
    complete(own, e0 + (fc_u32)(nchunk - 1));
}

// The codec alone: encode p.count elements of p.input into p.output as one
// run of ceil(count / 32) blocks (codes, then scales). No workspace, no peers.
template <int C, class T>
FC_DEVICE void qr_encode_run(const FcParams& p) {
    const fc_u32 t = fc_thread_id(), nt = fc_block_threads(), lane = fc_lane_id();
    const fc_u64 blocks = div_ceil(p.count, 32u);
    const fc_u64 ng = blocks * 4u;
    const fc_u64 step = (fc_u64)nt * fc_grid_blocks();
    const char* in = fc_ptr<const char>(p.input);
    char* run = fc_ptr<char>(p.output);
    const bool aligned = aligned16(p.input);
    for (fc_u64 g0 = (fc_u64)fc_block_id() * nt + t - lane; g0 < ng; g0 += step) {
        const fc_u64 g = g0 + lane;
        float x[8];
        qr_load_x<T>(in, g * 8u, p.count, aligned, g < ng, x);
        const QrCodes c = qr_encode<C, T>(x);
        if (g < ng) qr_store_codes<C>(run, blocks, g / 4u, lane & 3u, c);
    }
}

} // namespace fc

// ===========================================================================
// Entry points are generated by ferrocomm::algo::kernels (collective_entry,
// quick_reduce_entry), one FC_KERNEL per name, so a compile can hold any
// subset of the module.
