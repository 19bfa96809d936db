// Runs the fused all-reduce epilogues of kernels-cuda/fused.cu (the push
// one-shot fc::fused_oneshot, the LL one-shot fc::fused_oneshot_ll through
// its Lamport area, the two-shot fc::fused_twoshot, and the
// sequence-parallel form fc::fused_sp, gathered and sharded; every pattern
// FU_PAT_*, f16 and bf16) on the CPU over the emulated prelude
// (emu_prelude.h): worlds 2 and 3, each rank an emulated device of several
// blocks of 32 to 256 threads, the ranks' launches back to back on one
// workspace with no host sync between them, so chunks, parities and epochs
// of consecutive calls (and of different kinds) overlap across ranks as on
// GPUs. Slots are small, so the push kinds run calls of many chunks (the
// two-shot's segments some of them empty, with short last pieces); grids
// follow src/algo/fused.rs (never more blocks than the chunk's rows a block
// may own); blocks own one row (the block walker, fused_rows_block) or many
// (one 32-lane group a row, some groups idle); rows of 1 to 129 packs (a
// lane's packs wrap the 32 lanes, the LL kind's threads hold two packs).
// Every rank's outputs (residual_out, norm_out, allreduce_out, the FP8/INT8
// codes and the per-token scales) are compared bit for bit with a
// sequential reference written from docs/protocol.md ("Fused epilogues")
// alone: the f32 order stated there, true divisions where the kernels use a
// reciprocal, and its own FP8 encoder. Inputs are random f16/bf16 bits with
// zeros, -0.0 and subnormals, some calls in place (residual_out =
// residual_in, allreduce_out = input), some with NaN (non-canonical
// payloads, the Lamport sentinel's bits), infinities, an all-zero row under
// eps = 0 and a row whose sum overflows; rows built so that a sum of
// squares in another order changes the normed output (make_probes). Also
// checked: the inputs and every byte around each tensor are untouched, the
// error words stay 0, each launch moves its rank's epoch by its chunk
// count, and after the last launch the Lamport area is back to "not
// arrived" and every LL record consumed. A mismatch prints a FAIL line
// naming the kernel, shape, geometry, call, rank, tensor and first
// differing element; the exit status is non-zero. `fused_emu SEED -v` also
// lists every call. See ci/check-kernels-emu.sh.
// Sequence-parallel calls take tokens = world * S (S drawn as the plan's
// tokens), each rank's residual its S rows of one residual stream, and
// their reference is the all-reduce form's on the same rows: the shard's
// rows alone (residual_out, allreduce_out, a shard's outputs) or every row
// (the gathered outputs, with the rank's own weight).

// The group butterfly (fu_group_sum) shuffles within 32 lanes: emulated
// warps of 32 make every 32-lane group one warp, as on NVIDIA.
#define FC_EMU_WARP 32
#include "emu_prelude.h"

#include <type_traits>

// What fused.cu takes from the real prelude beyond emu_prelude.h. The
// host's IEEE single operations are the PTX .rn ones (compiled with
// -ffp-contract=off, no flush to zero).
FC_DEVICE float fc_ffma(float a, float b, float c) { return std::fmaf(a, b, c); }
FC_DEVICE float fc_fdiv(float a, float b) { return a / b; }
FC_DEVICE float fc_frcp(float x) { return 1.0f / x; }
FC_DEVICE float fc_fsqrt(float x) { return std::sqrt(x); }
FC_DEVICE float fc_rintf(float x) { return std::nearbyintf(x); }

// Shuffles go through a per-block word per thread, between two barriers
// of the warp: the second keeps a lane from overwriting its word before its
// partner has read it.
inline thread_local fc_u32* emu_shfl_words;
FC_DEVICE fc_u32 fc_shfl_xor(fc_u32 v, fc_u32 mask) {
    emu_shfl_words[emu.tid] = v;
    fc_warp_sync();
    const fc_u32 r = emu_shfl_words[emu.tid ^ mask];
    fc_warp_sync();
    return r;
}

// The launch bound the kernels size their shared arrays by (the real
// prelude's default, algo::BLOCK_THREADS).
#define FC_MAX_BLOCK_THREADS 512

// __shared__ arrays: a block's threads must see one array, and blocks of
// every rank run at once, so a function-local static is not enough. Each
// becomes a static array of arrays, one per emulated block (a rank and
// block slot the harness sets per thread): the declaration's bound is a
// constant expression (EMU_SMEM_SLOTS arrays), every use indexes the running
// block's. Only fused.cu's names fu_shared and fu_row are mapped.
#define EMU_SMEM_SLOTS 32u
inline thread_local unsigned emu_smem_slot;
struct EmuSmemSlot {
    constexpr operator unsigned long() const {
        if (std::is_constant_evaluated()) return EMU_SMEM_SLOTS;
        return emu_smem_slot;
    }
};
#define __shared__ static
#define fu_shared fu_shared_emu[EmuSmemSlot{}]
#define fu_row fu_row_emu[EmuSmemSlot{}]

#include "../../kernels-cuda/common.cuh"
#include "../../kernels-cuda/fused.cu"

#undef fu_shared
#undef fu_row
#undef __shared__

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <vector>

// src/algo/layout.rs (exchange_emu.cpp uses the same values).
constexpr fc_u64 FP_OFFSET = 256;
constexpr fc_u64 FLAGS_OFFSET = FP_OFFSET + 2ull * FC_MAX_BLOCKS * FC_MAX_RANKS * 8;
constexpr fc_u64 DATA_OFFSET = 131072;

typedef void (*Kernel)(const FcParams&);

enum Kind { ONESHOT, ONESHOT_LL, TWOSHOT, SP_GATHER, SP_SHARD };
constexpr int KINDS = 5;
static const char* const KIND_NAME[KINDS] = {"oneshot", "oneshot_ll", "twoshot", "sp_gather", "sp_shard"};
static bool is_sp(Kind k) { return k == SP_GATHER || k == SP_SHARD; }
static const char* const PAT_NAME[6] = {"res", "rms", "rms_fp8", "rms_fp8tok", "rms_i8tok", "rms_nvfp4"};

template <class T>
static Kernel kernel_of(Kind k, int pat) {
    switch (k * 8 + pat) {
#define FU_EMU_KIND(K, F)                                                                                             \
    case K * 8 + FU_PAT_RES: return fc::F<T, FU_PAT_RES>;                                                             \
    case K * 8 + FU_PAT_RMS: return fc::F<T, FU_PAT_RMS>;                                                             \
    case K * 8 + FU_PAT_RMS_FP8: return fc::F<T, FU_PAT_RMS_FP8>;                                                     \
    case K * 8 + FU_PAT_RMS_FP8TOK: return fc::F<T, FU_PAT_RMS_FP8TOK>;                                               \
    case K * 8 + FU_PAT_RMS_I8TOK: return fc::F<T, FU_PAT_RMS_I8TOK>;                                               \
    case K * 8 + FU_PAT_RMS_NVFP4: return fc::F<T, FU_PAT_RMS_NVFP4>;
        FU_EMU_KIND(ONESHOT, fused_oneshot)
        FU_EMU_KIND(ONESHOT_LL, fused_oneshot_ll)
        FU_EMU_KIND(TWOSHOT, fused_twoshot)
#undef FU_EMU_KIND
#define FU_EMU_SP(K, G)                                                                                               \
    case K * 8 + FU_PAT_RES: return fc::fused_sp<T, FU_PAT_RES, G>;                                                   \
    case K * 8 + FU_PAT_RMS: return fc::fused_sp<T, FU_PAT_RMS, G>;                                                   \
    case K * 8 + FU_PAT_RMS_FP8: return fc::fused_sp<T, FU_PAT_RMS_FP8, G>;                                           \
    case K * 8 + FU_PAT_RMS_FP8TOK: return fc::fused_sp<T, FU_PAT_RMS_FP8TOK, G>;                                     \
    case K * 8 + FU_PAT_RMS_I8TOK: return fc::fused_sp<T, FU_PAT_RMS_I8TOK, G>;                                       \
    case K * 8 + FU_PAT_RMS_NVFP4: return fc::fused_sp<T, FU_PAT_RMS_NVFP4, G>;
        FU_EMU_SP(SP_GATHER, true)
        FU_EMU_SP(SP_SHARD, false)
#undef FU_EMU_SP
    }
    std::abort();
}

// Shared memory holds garbage when a GPU block starts. Here a launch takes
// the next free group of 8 slots (at most one launch a rank runs at a time,
// so one of the 4 groups is always free), so a block finds what another
// launch (another rank's, or another kernel) left there, not its own last
// values: a kernel that read shared memory before writing it would see
// values from elsewhere.
static std::mutex smem_lock;
static bool smem_busy[EMU_SMEM_SLOTS / 8];
static unsigned smem_next;
static unsigned smem_acquire() {
    std::lock_guard<std::mutex> hold(smem_lock);
    for (unsigned k = 0;; ++k) {
        const unsigned g = (smem_next + k) % (EMU_SMEM_SLOTS / 8);
        if (!smem_busy[g]) {
            smem_busy[g] = true;
            smem_next = g + 1;
            return g;
        }
    }
}
static void smem_release(unsigned g) {
    std::lock_guard<std::mutex> hold(smem_lock);
    smem_busy[g] = false;
}

// Every thread of one rank's launch; returns when all have.
static void launch(Kernel k, const FcParams& p, int nb, int nt, const char* label) {
    if (nb > 8 || p.world > EMU_SMEM_SLOTS / 8 - 1) std::abort(); // see smem_acquire
    const unsigned group = smem_acquire();
    std::vector<std::unique_ptr<EmuBlock>> blocks;
    std::vector<std::vector<fc_u32>> words(nb, std::vector<fc_u32>(nt));
    for (int b = 0; b < nb; ++b) blocks.emplace_back(new EmuBlock(nt));
    std::vector<std::thread> ts;
    for (int b = 0; b < nb; ++b)
        for (int t = 0; t < nt; ++t)
            ts.emplace_back([&, b, t] {
                emu = EmuThread{(fc_u32)t, (fc_u32)nt, (fc_u32)b, (fc_u32)nb, blocks[b].get(), 0, label};
                emu_shfl_words = words[b].data();
                emu_smem_slot = 8 * group + (unsigned)b;
                k(p);
            });
    for (auto& t : ts) t.join();
    smem_release(group);
}

// A workspace as large as the layout makes it up to the end of the Lamport
// area of parity 1 (the mailboxes after it are the host twins'), then an
// inaccessible page: an address past the end faults instead of landing in
// another allocation.
static unsigned char* alloc_fenced(size_t bytes) {
    const size_t size = (bytes + 4095) / 4096 * 4096;
    void* p = mmap(nullptr, size + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED || mprotect((unsigned char*)p + size, 4096, PROT_NONE) != 0) std::abort();
    return (unsigned char*)p;
}

// A tensor with guard bytes on both sides: a store past either end (a row
// or pack index off by one) changes them.
constexpr size_t GUARD = 64;
constexpr unsigned char GUARD_BYTE = 0xa5;
struct Buf {
    std::vector<unsigned char> mem;
    size_t bytes = 0;
    unsigned char* data = nullptr;
    void make(size_t n, unsigned char fill) {
        bytes = n;
        mem.assign(n + 2 * GUARD + 16, GUARD_BYTE);
        // 16-byte aligned, as the host requires of every fused tensor.
        data = mem.data() + ((16 - (reinterpret_cast<uintptr_t>(mem.data()) & 15)) & 15) + GUARD;
        std::memset(data, fill, n);
    }
    bool guards_intact() const {
        for (size_t i = 1; i <= GUARD; ++i)
            if (data[-(ptrdiff_t)i] != GUARD_BYTE || data[bytes + i - 1] != GUARD_BYTE) return false;
        return true;
    }
};

// ---- the reference (docs/protocol.md, "Fused epilogues") ----

static float widen(bool bf, fc_u16 h) { return bf ? fc_bf16_to_f32(h) : fc_f16_to_f32(h); }
// round(x): nearest even, every NaN the canonical quiet one.
static fc_u16 narrow(bool bf, float x) {
    if (std::isnan(x)) return bf ? 0x7fc0 : 0x7e00;
    return bf ? fc_f32_to_bf16(x) : fc_f32_to_f16(x);
}

// OCP e4m3fn by search over its 126 finite magnitudes (not the kernel's
// bit arithmetic): nearest, ties to the even code, >= 448 (infinity too)
// saturated, NaN 0x7f, the sign kept (zero included).
static double e4m3_value(int c) {
    const int e = c >> 3, m = c & 7;
    return e == 0 ? std::ldexp((double)m, -9) : std::ldexp(8.0 + m, e - 10);
}
static fc_u8 ref_e4m3(float v) {
    if (std::isnan(v)) return 0x7f;
    const double a = std::fabs((double)v);
    int code = 0x7e;
    if (a < 448.0) {
        int hi = 0;
        while (e4m3_value(hi) < a) ++hi;
        code = hi;
        if (hi > 0 && e4m3_value(hi) != a) {
            const double dlo = a - e4m3_value(hi - 1), dhi = e4m3_value(hi) - a;
            if (dlo < dhi || (dlo == dhi && (hi - 1) % 2 == 0)) code = hi - 1;
        }
    }
    return (fc_u8)(std::signbit(v) ? code | 0x80 : code);
}
// NVFP4 (docs/protocol.md, "NVFP4 outputs"): e2m1 by search over its 8
// magnitudes (nearest, ties to the even code, saturated to 6, sign kept,
// NaN 0x7); the scale factor's byte at row m, block k, in either layout.
static fc_u8 ref_e2m1(float q) {
    static const double MAG[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    if (std::isnan(q)) return 7;
    const double a = std::fabs((double)q);
    int code = 7;
    if (a < 6.0) {
        int hi = 0;
        while (MAG[hi] < a) ++hi;
        code = hi;
        if (hi > 0 && MAG[hi] != a) {
            const double dlo = a - MAG[hi - 1], dhi = MAG[hi] - a;
            if (dlo < dhi || (dlo == dhi && (hi - 1) % 2 == 0)) code = hi - 1;
        }
    }
    return (fc_u8)(std::signbit(q) ? code | 8 : code);
}
static size_t sf_bytes(bool linear, size_t tokens, size_t hidden) {
    const size_t cols = hidden / 16;
    return linear ? tokens * cols : (tokens + 127) / 128 * 128 * ((cols + 3) / 4 * 4);
}
static size_t sf_at(bool linear, size_t m, size_t k, size_t cols) {
    if (linear) return m * cols + k;
    const size_t tile = (m / 128) * ((cols + 3) / 4) + k / 4;
    return tile * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + k % 4;
}
// One row's NVFP4 codes and scale factors from its normed values y.
static void ref_nvfp4_row(const float* y, size_t t, size_t hidden, float gs, bool linear, fc_u8* quant,
                          std::vector<fc_u8>& sf) {
    for (size_t k = 0; k < hidden / 16; ++k) {
        float amax = 0.0f;
        for (int e = 0; e < 16; ++e) amax = std::fmax(amax, std::fabs(y[16 * k + e]));
        const float sfv = gs * (amax * (1.0f / 6.0f));
        const fc_u8 code = ref_e4m3(sfv);
        const float v = (code & 0x7f) == 0x7f ? NAN : (float)((code & 0x80 ? -1 : 1) * e4m3_value(code & 0x7f));
        const float out = v != 0.0f ? 1.0f / (v * (1.0f / gs)) : 0.0f;
        for (int e = 0; e < 16; e += 2)
            quant[8 * k + e / 2] = ref_e2m1(y[16 * k + e] * out) | ref_e2m1(y[16 * k + e + 1] * out) << 4;
        sf[sf_at(linear, t, k, hidden / 16)] = code;
    }
}

static fc_u8 ref_int8(float q) {
    if (std::isnan(q)) return 0;
    float r = std::nearbyintf(q);
    r = std::fmin(std::fmax(r, -127.0f), 127.0f);
    return (fc_u8)(signed char)(int)r;
}

struct Expect {
    std::vector<fc_u16> ar, res, norm;
    std::vector<fc_u8> quant;
    std::vector<fc_u8> sf; // NVFP4: the scale factors in the call's layout, padding as given (0xcd)
    std::vector<float> scales;
    std::vector<float> rstd; // per row (norm patterns)
};

// The row's sum of squares in the stated order (32 lane partials, pack i
// into partial i % 32, then the butterfly m = 16, 8, 4, 2, 1), then rstd.
static float row_rstd(bool bf, const fc_u16* row, size_t hidden, float eps) {
    float p[32] = {};
    for (size_t j = 0; j < hidden; ++j) {
        const float v = widen(bf, row[j]);
        const float sq = v * v;
        p[(j / 8) % 32] = p[(j / 8) % 32] + sq;
    }
    for (int m = 16; m >= 1; m /= 2) {
        float q[32];
        std::memcpy(q, p, sizeof q);
        for (int l = 0; l < 32; ++l) p[l] = q[l] + q[l ^ m];
    }
    return 1.0f / std::sqrt(p[0] / (float)hidden + eps);
}

static fc_u16 ref_res(bool bf, const std::vector<std::vector<fc_u16>>& inputs, const std::vector<fc_u16>& resid,
                      size_t i, fc_u16* ar = nullptr) {
    float acc = widen(bf, inputs[0][i]);
    for (size_t r = 1; r < inputs.size(); ++r) acc = acc + widen(bf, inputs[r][i]);
    const fc_u16 a = narrow(bf, acc);
    if (ar) *ar = a;
    return narrow(bf, widen(bf, a) + widen(bf, resid[i]));
}

static fc_u16 ref_norm(bool bf, fc_u16 x, float rstd, fc_u16 w) {
    return narrow(bf, (widen(bf, x) * rstd) * widen(bf, w));
}

static Expect reference(int pat, bool bf, size_t tokens, size_t hidden, float eps,
                        const std::vector<std::vector<fc_u16>>& inputs, const std::vector<fc_u16>& resid,
                        const std::vector<fc_u16>& weight, float static_scale, bool sf_linear = false) {
    const size_t n = tokens * hidden;
    Expect x;
    x.ar.resize(n);
    x.res.resize(n);
    for (size_t i = 0; i < n; ++i) x.res[i] = ref_res(bf, inputs, resid, i, &x.ar[i]);
    if (pat == FU_PAT_RES) return x;
    x.norm.resize(n);
    std::vector<float> y(n);
    for (size_t t = 0; t < tokens; ++t) {
        const fc_u16* row = &x.res[t * hidden];
        const float rstd = row_rstd(bf, row, hidden, eps);
        x.rstd.push_back(rstd);
        for (size_t j = 0; j < hidden; ++j) {
            x.norm[t * hidden + j] = ref_norm(bf, row[j], rstd, weight[j]);
            y[t * hidden + j] = widen(bf, x.norm[t * hidden + j]);
        }
    }
    if (pat == FU_PAT_RMS) return x;
    if (pat == FU_PAT_RMS_NVFP4) {
        x.quant.resize(n / 2);
        x.sf.assign(sf_bytes(sf_linear, tokens, hidden), 0xcd);
        for (size_t t = 0; t < tokens; ++t)
            ref_nvfp4_row(&y[t * hidden], t, hidden, static_scale, sf_linear, &x.quant[t * hidden / 2], x.sf);
        return x;
    }
    x.quant.resize(n);
    if (pat == FU_PAT_RMS_FP8) {
        for (size_t i = 0; i < n; ++i) x.quant[i] = ref_e4m3(y[i] / static_scale);
        return x;
    }
    const bool int8 = pat == FU_PAT_RMS_I8TOK;
    const float qmax = int8 ? 127.0f : 448.0f;
    for (size_t t = 0; t < tokens; ++t) {
        float amax = 0.0f;
        for (size_t j = 0; j < hidden; ++j) amax = std::fmax(amax, std::fabs(y[t * hidden + j]));
        const float s = std::fmax(amax / qmax, 1.0f / (qmax * 512.0f));
        x.scales.push_back(s);
        for (size_t j = 0; j < hidden; ++j) {
            const float q = y[t * hidden + j] / s;
            x.quant[t * hidden + j] = int8 ? ref_int8(q) : ref_e4m3(q);
        }
    }
    return x;
}

// ---- calls ----

struct Spec {
    Kind kind;
    int pat;
    bool bf;
    size_t tokens, hidden;
    int nb_asked;
    float eps;
    bool ar_out, norm_out, res_in_place, ar_in_place, special, probe;
    float static_scale; // NVFP4: the global scale
    bool sf_linear;     // NVFP4's scale-factor layout
};

// One rank's tensors of a call, and what it must find in them afterwards.
struct RankData {
    Buf input, resid_in, resid_out, weight, norm_out, quant_out, scale, ar_out, sf_out;
    std::vector<fc_u16> in0, resid0, weight0; // as given
    Expect want;
};

struct Call {
    Spec s;
    int nb = 1;
    fc_u32 advance = 1; // epochs the launch moves its rank's epoch by
    std::string name;   // kernel, shape and geometry, for messages
    std::vector<RankData> rank;
    std::vector<FcParams> params;
};

struct Session {
    std::string what;
    int world, nt;
    fc_u64 slot;
    std::vector<Call> calls;
    std::vector<unsigned char*> ws;
    std::vector<fc_u32*> err;
    std::vector<std::vector<fc_u32>> advanced; // [rank][call]
};

static std::mt19937_64 rng(1);
static size_t rnd(size_t n) { return (size_t)(rng() % n); }

// Random 16-bit values: mostly magnitudes 2^-8..2^4 (sums, squares and
// norms stay finite), some far smaller (FP8/INT8 codes near zero, e4m3
// subnormals), and zeros of either sign and subnormals of the dtype.
static fc_u16 rand_half(bool bf, int lo_exp = -8, int hi_exp = 3) {
    const fc_u16 sign = rnd(2) ? 0x8000 : 0;
    const int mbits = bf ? 7 : 10, bias = bf ? 127 : 15;
    const size_t k = rnd(64);
    if (k == 0) return 0;
    if (k == 1) return 0x8000;
    if (k == 2) return sign | (fc_u16)(1 + rnd((1u << mbits) - 1)); // subnormal
    int e = (k < 8 ? lo_exp - 12 : lo_exp) + (int)rnd((size_t)(hi_exp - lo_exp + 1));
    e = std::max(1, std::min(2 * bias, e + bias));
    return sign | (fc_u16)(e << mbits) | (fc_u16)rnd(1u << mbits);
}

static fc_u64 push1_cap(const Session& g, size_t row_bytes) {
    return (((2 * g.slot) / g.world) & ~(fc_u64)63) / row_bytes;
}
static fc_u64 push2_cap(const Session& g, size_t row_bytes) {
    return ((g.slot / g.world) & ~(fc_u64)63) / row_bytes;
}
// src/algo/layout.rs: the LL area (records, then lines of both parities),
// then the Lamport area (both parities), slot_bytes / 4 a parity.
static fc_u64 ll_offset(fc_u64 slot) { return DATA_OFFSET + 4 * slot; }
static fc_u64 lamport_offset(fc_u64 slot) { return ll_offset(slot) + FC_LL_FP_BYTES + slot; }
static fc_u64 workspace_bytes(fc_u64 slot) { return lamport_offset(slot) + slot / 2; }
static fc_u64 lamport_bytes(const Session& g) { return ((g.slot / 4) / g.world) & ~(fc_u64)63; }
static bool fits(const Session& g, Kind k, size_t tokens, size_t hidden) {
    const size_t row = hidden * 2;
    switch (k) {
        case ONESHOT: return push1_cap(g, row) >= 1;
        case TWOSHOT:
        case SP_GATHER:
        case SP_SHARD: return push2_cap(g, row) >= 1;
        case ONESHOT_LL: return tokens * row <= lamport_bytes(g) && hidden <= (size_t)FU_LL_PACKS * 8 * g.nt;
    }
    return false;
}

// The special rows (tokens >= 5): row 1 NaNs (a signaling or negative one,
// not the canonical bits; 0xffff, the Lamport area's "not arrived", which
// the LL kind sends as 0xfffe, and 0xfffe itself) in the inputs, row 2 an
// infinity in the residual, row 3 all zeros everywhere (with eps = 0: rstd
// = inf, the row NaN), row 4 the dtype's largest finite value in every
// rank's input (its sum overflows), row 0 -0.0 in every input and the
// residual (the sum stays -0.0).
static void make_special(bool bf, size_t hidden, int world, std::vector<std::vector<fc_u16>>& in,
                         std::vector<std::vector<fc_u16>>& resid) {
    const fc_u16 maxf = bf ? 0x7f7f : 0x7bff;
    in[1][1 * hidden + 3] = bf ? 0xff81 : 0xfc01;
    in[0][1 * hidden + 4] = 0xffff;
    in[world - 1][1 * hidden + 6] = 0xfffe;
    for (int r = 0; r < world; ++r) {
        resid[r][2 * hidden + 5] = bf ? 0xff80 : 0xfc00;
        for (size_t j = 0; j < hidden; ++j) in[r][3 * hidden + j] = (j % 3 == 0) ? 0x8000 : 0;
        for (size_t j = 0; j < hidden; ++j) resid[r][3 * hidden + j] = 0;
        in[r][4 * hidden + 0] = maxf;
        in[r][0 * hidden + 2] = 0x8000;
        resid[r][0 * hidden + 2] = 0x8000;
    }
}

// Probes of rstd. Every output is rounded to 16 bits (or to FP8/INT8), so
// a sum of squares taken in another order, whose f32 value is only an ulp
// or a few away, almost never shows in them: random rows alone would pass a
// kernel that breaks the stated order. In a probe row each pack's element 0
// lies in [1, 2) and elements 5 to 7 below 2^-12 in magnitude, so their
// squares vanish in the lane partial (less than half of its ulp) and their
// values can be picked once rstd is known: an element (and, in the slots a
// row owns, the weight too) such that y = round((x * rstd) * w) changes when
// rstd moves one ulp up, or one ulp down. As y is monotonic in rstd, a row
// with both kinds of probe shows any other rstd. A lane's partial is only
// part of the sum, and a change of an ulp in it mostly vanishes in the
// butterfly's adds; so in half of the rows wider than 32 packs only one
// lane's packs are large (element 0 in [1, 2), probes there), the others'
// elements all small: the sum is that lane's partial, whose order of adds
// then shows. Few rstds admit such pairs in bf16 (8-bit x and w; most
// admit none), so a row that finds none draws its residual again (a new
// rstd) a few times. Probe elements have zero inputs on every rank, so
// their residual is their residual_in. Up to 8 rows a call are probe rows,
// spread over its chunks and blocks (every `step`-th from `first_row`); the
// others keep their random values.
// Returns the rows (over ranks) that got both kinds; `probed` the rows
// (over ranks) it tried.
static int make_probes(bool bf, size_t tokens, size_t hidden, size_t first_row, float eps, int& probed,
                       std::vector<std::vector<fc_u16>>& in, std::vector<std::vector<fc_u16>>& resid,
                       std::vector<std::vector<fc_u16>>& weight) {
    const int W = (int)in.size();
    const int mbits = bf ? 7 : 10, bias = bf ? 127 : 15;
    const unsigned mants = 1u << mbits;
    const auto val = [&](int e, unsigned m, bool neg) {
        return (fc_u16)((neg ? 0x8000u : 0u) | (unsigned)(e + bias) << mbits | m);
    };
    const size_t packs = hidden / 8, step = (tokens - first_row + 7) / 8;
    std::vector<size_t> prow;
    for (size_t t = first_row; t < tokens; t += step) prow.push_back(t);
    probed += (int)prow.size() * W;
    // Weights of probe slots of magnitude in [1, 4): y stays a normal f16.
    for (int r = 0; r < W; ++r)
        for (size_t i = 0; i < packs; ++i)
            for (int k = 5; k < 8; ++k) weight[r][8 * i + k] = val((int)rnd(2), (unsigned)rnd(mants), rnd(2));
    // The lane whose packs are large, or -1 for every lane.
    std::vector<int> lane(tokens, -1);
    for (size_t t : prow)
        if (packs > 32 && rnd(2)) lane[t] = (int)rnd(32);
    const auto large = [&](size_t t, size_t i) { return lane[t] < 0 || i % 32 == (size_t)lane[t]; };
    // Small enough other elements that rstd stays near 1 (y a normal f16).
    for (size_t t : prow)
        for (size_t i = 0; i < packs; ++i)
            for (int q = 0; q < W; ++q) {
                const size_t j0 = t * hidden + 8 * i;
                for (int k = 0; k < 8; ++k)
                    in[q][j0 + k] = large(t, i) && (k == 0 || k >= 5) ? 0 : rand_half(bf, -5, -2);
            }
    int both = 0;
    for (int r = 0; r < W; ++r) {
        std::vector<float> rstd(tokens);
        std::vector<int> have(tokens, 0); // bit 0: an up probe, bit 1: a down probe
        std::vector<fc_u16> res(hidden);
        const auto rstd_of = [&](size_t t) {
            for (size_t j = 0; j < hidden; ++j) res[j] = ref_res(bf, in, resid[r], t * hidden + j);
            return row_rstd(bf, res.data(), hidden, eps);
        };
        const auto draw_row = [&](size_t t) {
            for (size_t i = 0; i < packs; ++i) {
                const size_t j0 = t * hidden + 8 * i;
                for (int k = 0; k < 8; ++k) resid[r][j0 + k] = rand_half(bf, -5, -2);
                if (!large(t, i)) continue;
                resid[r][j0] = val(0, (unsigned)rnd(mants), rnd(2));
                for (int k = 5; k < 8; ++k) resid[r][j0 + k] = val(-13, 0, false);
            }
            rstd[t] = rstd_of(t);
            have[t] = 0;
        };
        // Which way (bit 0 up, bit 1 down) rstd of row t moving one ulp
        // changes the normed value of (x, w).
        const auto flips = [&](size_t t, fc_u16 x, fc_u16 w) {
            // Only products within a few ulps of a rounding boundary of the
            // dtype (a normal one's: the searches' bulk) can change.
            const float prod = (widen(bf, x) * rstd[t]) * widen(bf, w);
            const fc_u32 low = fc_f32_as_u32(prod) & (bf ? 0xffffu : 0x1fffu), half = bf ? 0x8000u : 0x1000u;
            if ((bf || std::fabs(prod) >= 0x1p-14f) && low - (half - 8) > 16) return 0;
            const fc_u16 y = ref_norm(bf, x, rstd[t], w);
            return (ref_norm(bf, x, std::nextafter(rstd[t], INFINITY), w) != y ? 1 : 0) |
                   (ref_norm(bf, x, std::nextafter(rstd[t], 0.0f), w) != y ? 2 : 0);
        };
        // A probe in slot j of row t: x over every mantissa, w too where
        // `pick_w` (else the column's).
        const auto probe = [&](size_t t, size_t j, bool pick_w) {
            const int want = have[t] == 1 ? 2 : have[t] == 2 ? 1 : 3;
            const unsigned m0 = (unsigned)rnd(mants), w0 = (unsigned)rnd(mants);
            for (unsigned a = 0; a < (pick_w ? std::min(mants, 128u) : 1u); ++a) {
                const fc_u16 w = pick_w ? val(0, (w0 + a) % mants, false) : weight[r][j];
                for (unsigned b = 0; b < mants; ++b) {
                    const fc_u16 x = val(-13, (m0 + b) % mants, false);
                    const int f = flips(t, x, w);
                    if (f & want) {
                        resid[r][t * hidden + j] = x;
                        weight[r][j] = w;
                        have[t] |= f;
                        return;
                    }
                }
            }
        };
        // Slot (i, k) belongs to probe row (3 * i + k - 5) % (probe rows),
        // which picks its weight too, before any other row uses it.
        const auto owner = [&](size_t j) { return prow[(3 * (j / 8) + j % 8 - 5) % prow.size()]; };
        for (size_t t : prow) {
            draw_row(t);
            bool owns = false;
            for (int attempt = 0; attempt < 8 && have[t] != 3; ++attempt) {
                if (attempt > 0) draw_row(t);
                for (size_t j = 0; j < hidden && have[t] != 3; ++j)
                    if (j % 8 >= 5 && large(t, j / 8) && owner(j) == t) owns = true, probe(t, j, true);
                if (!owns) break;
            }
        }
        // Then every row in the other slots, with the weights as they are.
        for (size_t t : prow)
            for (int attempt = 0; attempt < 8 && have[t] != 3; ++attempt) {
                if (attempt > 0) draw_row(t);
                for (size_t j = 0; j < hidden && have[t] != 3; ++j)
                    if (j % 8 >= 5 && large(t, j / 8) && (attempt > 0 || owner(j) != t)) probe(t, j, false);
            }
        for (size_t t : prow) {
            // The probes' squares must have vanished.
            if (rstd_of(t) != rstd[t]) {
                std::printf("FAIL fused_emu itself: a probe's square changed the sum of squares\n");
                std::exit(2);
            }
            both += have[t] == 3;
        }
    }
    return both;
}

// Rows with both kinds of rstd probe, rows probed; norm calls with such a row, norm calls.
static int probed_rows = 0, probe_rows = 0, probed_calls = 0, norm_calls = 0;

static void add_call(Session& g, Spec s) {
    const int W = g.world;
    Call c;
    c.s = s;
    const size_t row = s.hidden * 2;
    // Grids as FusedCall::enqueue sizes them: never more blocks than the
    // rows a block may own in one chunk.
    fc_u64 rows = s.tokens;
    if (s.kind == ONESHOT) {
        const fc_u64 cap = push1_cap(g, row);
        rows = std::min<fc_u64>(cap, s.tokens);
        c.advance = (fc_u32)((s.tokens + cap - 1) / cap);
    } else if (s.kind == TWOSHOT) {
        const fc_u64 cap = push2_cap(g, row);
        rows = std::min<fc_u64>(cap, (s.tokens + W - 1) / W);
        c.advance = (fc_u32)((s.tokens + cap * W - 1) / (cap * W));
    } else if (is_sp(s.kind)) {
        // The two-shot's rule, a shard a segment.
        const fc_u64 cap = push2_cap(g, row);
        rows = std::min<fc_u64>(cap, s.tokens / W);
        c.advance = (fc_u32)((s.tokens / W + cap - 1) / cap);
    }
    c.nb = (int)std::max<fc_u64>(1, std::min<fc_u64>((fc_u64)s.nb_asked, rows));
    char name[256];
    std::snprintf(name, sizeof name,
                  "fc_fused_%s_%s_%s world %d tokens %zu hidden %zu, %d x %d threads, slot %llu"
                  ", %u chunk(s)%s%s%s%s%s%s%s%s",
                  KIND_NAME[s.kind], PAT_NAME[s.pat], s.bf ? "bf16" : "f16", W, s.tokens, s.hidden, c.nb, g.nt,
                  (unsigned long long)g.slot, c.advance, s.ar_out ? ", allreduce_out" : "",
                  s.ar_in_place ? " (= input)" : "", s.res_in_place ? ", residual in place" : "",
                  s.norm_out || s.pat == FU_PAT_RES ? "" : ", no norm_out", s.special ? ", special values" : "",
                  s.eps == 0.0f ? ", eps 0" : "", s.probe ? ", rstd probes" : "",
                  s.pat != FU_PAT_RMS_NVFP4 ? "" : s.sf_linear ? ", linear SFs" : ", swizzled SFs");
    c.name = name;
    const size_t n = s.tokens * s.hidden;
    const bool sp = is_sp(s.kind);
    // Rows of the residual tensors and of the normed / quantized outputs.
    const size_t shard = sp ? s.tokens / W : s.tokens;
    const size_t out_rows = s.kind == SP_SHARD ? shard : s.tokens;
    const size_t ns = shard * s.hidden, no = out_rows * s.hidden;
    std::vector<std::vector<fc_u16>> in(W, std::vector<fc_u16>(n)), resid(W, std::vector<fc_u16>(n));
    std::vector<std::vector<fc_u16>> weight(W, std::vector<fc_u16>(s.hidden));
    for (int r = 0; r < W; ++r) {
        for (auto& v : in[r]) v = rand_half(s.bf);
        for (auto& v : resid[r]) v = rand_half(s.bf);
        for (auto& v : weight[r]) v = rand_half(s.bf, -3, 2);
    }
    // SP: one residual stream (make_special changes every copy alike),
    // rank r holding its rows.
    if (sp)
        for (int r = 1; r < W; ++r) resid[r] = resid[0];
    if (s.special) make_special(s.bf, s.hidden, W, in, resid);
    const size_t first_probe = s.special ? 5 : 0;
    if (s.probe && s.tokens > first_probe) {
        const int both = make_probes(s.bf, s.tokens, s.hidden, first_probe, s.eps, probe_rows, in, resid, weight);
        probed_rows += both;
        probed_calls += both > 0;
    }
    norm_calls += s.pat != FU_PAT_RES;
    const bool norms = s.pat != FU_PAT_RES;
    const bool quant = s.pat == FU_PAT_RMS_FP8 || s.pat == FU_PAT_RMS_FP8TOK || s.pat == FU_PAT_RMS_I8TOK;
    const bool per_token = s.pat == FU_PAT_RMS_FP8TOK || s.pat == FU_PAT_RMS_I8TOK;
    const fc_u64 fp = rng();
    c.rank.resize(W);
    for (int r = 0; r < W; ++r) {
        RankData& d = c.rank[r];
        d.in0 = in[r];
        // SP: the rank's rows of the stream (rows r*S..).
        const size_t r0 = sp ? r * ns : 0;
        d.resid0.assign(resid[r].begin() + r0, resid[r].begin() + r0 + ns);
        d.weight0 = weight[r];
        d.input.make(n * 2, 0);
        std::memcpy(d.input.data, in[r].data(), n * 2);
        d.resid_in.make(ns * 2, 0);
        std::memcpy(d.resid_in.data, d.resid0.data(), ns * 2);
        // Outputs start as bytes no result has in that many places.
        if (!s.res_in_place) d.resid_out.make(ns * 2, 0xcd);
        d.weight.make(s.hidden * 2, 0);
        std::memcpy(d.weight.data, weight[r].data(), s.hidden * 2);
        if (norms && s.norm_out) d.norm_out.make(no * 2, 0xcd);
        if (quant) d.quant_out.make(no, 0xcd);
        if (s.pat == FU_PAT_RMS_NVFP4) {
            d.quant_out.make(no / 2, 0xcd);
            d.sf_out.make(sf_bytes(s.sf_linear, out_rows, s.hidden), 0xcd);
        }
        if (s.pat == FU_PAT_RMS_FP8 || s.pat == FU_PAT_RMS_NVFP4) {
            d.scale.make(4, 0);
            std::memcpy(d.scale.data, &s.static_scale, 4);
        } else if (per_token) {
            d.scale.make(4 * out_rows, 0xcd);
        }
        if (s.ar_out && !s.ar_in_place) d.ar_out.make(ns * 2, 0xcd);
        if (!sp) {
            d.want = reference(s.pat, s.bf, s.tokens, s.hidden, s.eps, in, resid[r], weight[r], s.static_scale,
                               s.sf_linear);
        } else {
            // The shard's rows alone: every input's rows r*S.., the rank's
            // residual; the gathered outputs from every row.
            std::vector<std::vector<fc_u16>> rows_in(W);
            for (int q = 0; q < W; ++q) rows_in[q].assign(in[q].begin() + r0, in[q].begin() + r0 + ns);
            d.want = reference(s.pat, s.bf, shard, s.hidden, s.eps, rows_in, d.resid0, weight[r], s.static_scale,
                               s.sf_linear);
            if (s.kind == SP_GATHER) {
                Expect all = reference(s.pat, s.bf, s.tokens, s.hidden, s.eps, in, resid[r], weight[r],
                                       s.static_scale, s.sf_linear);
                d.want.norm = all.norm;
                d.want.quant = all.quant;
                d.want.sf = all.sf;
                d.want.scales = all.scales;
            }
        }

        FcParams p;
        std::memset(&p, 0, sizeof p);
        for (int q = 0; q < W; ++q) p.peer_ws[q] = (fc_u64)g.ws[q];
        p.input = (fc_u64)d.input.data;
        p.output = (fc_u64)(s.res_in_place ? d.resid_in.data : d.resid_out.data);
        p.error_flags = (fc_u64)g.err[r];
        p.count = n;
        p.fingerprint = fp;
        p.timeout_ns = 20ull * 1000 * 1000 * 1000;
        p.fp_offset = FP_OFFSET;
        p.flags_offset = FLAGS_OFFSET;
        p.data_offset = DATA_OFFSET;
        p.slot_bytes = g.slot;
        p.rank = r;
        p.world = W;
        p.dtype = s.bf ? FC_DTYPE_BF16 : FC_DTYPE_F16;
        fc_u64* ptr = p.per_peer[FU_ROW_PTRS];
        ptr[FU_PTR_RESIDUAL_IN] = (fc_u64)d.resid_in.data;
        ptr[FU_PTR_RESIDUAL_OUT] = p.output;
        ptr[FU_PTR_WEIGHT] = norms ? (fc_u64)d.weight.data : 0;
        ptr[FU_PTR_NORM_OUT] = (fc_u64)d.norm_out.data;
        ptr[FU_PTR_QUANT_OUT] = (fc_u64)d.quant_out.data;
        ptr[FU_PTR_SCALE] = (fc_u64)d.scale.data;
        ptr[FU_PTR_ALLREDUCE_OUT] = !s.ar_out ? 0 : s.ar_in_place ? (fc_u64)d.input.data : (fc_u64)d.ar_out.data;
        ptr[FU_PTR_SF_OUT] = (fc_u64)d.sf_out.data;
        p.per_peer[FU_ROW_SCALARS][FU_SCALAR_SF_LAYOUT] = s.sf_linear ? FU_SF_LINEAR : FU_SF_SWIZZLED;
        p.per_peer[FU_ROW_SCALARS][FU_SCALAR_HIDDEN] = s.hidden;
        fc_u32 eps_bits;
        std::memcpy(&eps_bits, &s.eps, 4);
        p.per_peer[FU_ROW_SCALARS][FU_SCALAR_EPS] = eps_bits;
        p.per_peer[FU_ROW_SCALARS][FU_SCALAR_TOKENS] = s.tokens;
        c.params.push_back(p);
    }
    g.calls.push_back(std::move(c));
}

// Which walkers a push call's epilogue takes (fused_rows): bit 0 the block
// walker (a block with rows, at most a quarter as many as its groups), bit
// 1 the group walker; bit 2: an LL call whose threads hold two packs.
static int walkers(const Session& g, const Call& c) {
    const Spec& s = c.s;
    const fc_u64 ngroups = g.nt / 32, row = s.hidden * 2, nb = c.nb;
    int m = 0;
    const auto note = [&](fc_u64 count) { m |= count * 4 <= ngroups ? 1 : 2; };
    if (s.kind == ONESHOT) {
        const fc_u64 cap = push1_cap(g, row);
        const fc_u64 per = ((c.advance > 1 ? cap : s.tokens) + nb - 1) / nb;
        for (fc_u64 ch = 0; ch < c.advance; ++ch) {
            const fc_u64 n = std::min<fc_u64>(cap, s.tokens - ch * cap);
            for (fc_u64 b = 0; b < nb; ++b)
                if (b * per < n) note(std::min(per, n - b * per));
        }
    } else if (s.kind == TWOSHOT) {
        const fc_u64 cap = push2_cap(g, row);
        note(g.world * (((c.advance > 1 ? cap : (s.tokens + g.world - 1) / g.world) + nb - 1) / nb));
    } else if (is_sp(s.kind)) {
        // Gathered: every shard's piece; a shard: our own piece.
        const fc_u64 cap = push2_cap(g, row);
        const fc_u64 per = ((c.advance > 1 ? cap : s.tokens / g.world) + nb - 1) / nb;
        note(s.kind == SP_GATHER && s.pat != FU_PAT_RES ? g.world * per : per);
    } else if (s.hidden / 8 > (size_t)g.nt) {
        m |= 4;
    }
    return m;
}

static void run(Session& g) {
    const int W = g.world;
    g.advanced.assign(W, std::vector<fc_u32>(g.calls.size(), 0));
    std::vector<std::thread> ranks;
    for (int r = 0; r < W; ++r)
        ranks.emplace_back([&g, r] {
            const fc_u32* epoch = reinterpret_cast<const fc_u32*>(g.ws[r]);
            for (size_t k = 0; k < g.calls.size(); ++k) {
                const Call& c = g.calls[k];
                const fc_u32 e = *epoch;
                const std::string label = "\"" + g.what + "\" call " + std::to_string(k) + " (" + c.name + ") rank " +
                                          std::to_string(r);
                const Kernel kern = c.s.bf ? kernel_of<fc::TBF16>(c.s.kind, c.s.pat)
                                           : kernel_of<fc::TF16>(c.s.kind, c.s.pat);
                launch(kern, c.params[r], c.nb, g.nt, label.c_str());
                // Only this rank's launches write its epoch word.
                g.advanced[r][k] = *epoch - e;
                // After a failure a communicator launches nothing more: the
                // peers time out once and stop too, rather than every call.
                if (__atomic_load_n(g.err[r], __ATOMIC_ACQUIRE) != FC_ERR_CODE_NONE) break;
            }
        });
    for (auto& t : ranks) t.join();
}

// got against want, element for element; the first difference and the count
// are printed (hex, two digits a byte of the element).
template <class E>
static int compare(const std::string& where, const char* what, const E* got, const std::vector<E>& want,
                   size_t hidden) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < want.size(); ++i)
        if (got[i] != want[i] && bad++ == 0) first = i;
    if (bad)
        std::printf("FAIL %s: %s element %zu (row %zu col %zu): got 0x%0*x want 0x%0*x (%zu of %zu differ)\n",
                    where.c_str(), what, first, first / hidden, first % hidden, (int)(2 * sizeof(E)),
                    (unsigned)got[first], (int)(2 * sizeof(E)), (unsigned)want[first], bad, want.size());
    return bad ? 1 : 0;
}

static int verify(const Session& g) {
    int bad = 0;
    for (size_t k = 0; k < g.calls.size(); ++k) {
        const Call& c = g.calls[k];
        const Spec& s = c.s;
        for (int r = 0; r < g.world; ++r) {
            const RankData& d = c.rank[r];
            const std::string where =
                g.what + " call " + std::to_string(k) + " " + c.name + " rank " + std::to_string(r);
            const auto u16 = [](const Buf& b) { return reinterpret_cast<const fc_u16*>(b.data); };
            int b = 0;
            if (g.advanced[r][k] != c.advance) {
                std::printf("FAIL %s: the epoch moved by %u, not %u\n", where.c_str(), g.advanced[r][k], c.advance);
                ++b;
            }
            const Buf& res = s.res_in_place ? d.resid_in : d.resid_out;
            b += compare(where, "residual_out", u16(res), d.want.res, s.hidden);
            if (!s.res_in_place) b += compare(where, "residual_in (an input)", u16(d.resid_in), d.resid0, s.hidden);
            if (s.ar_out) b += compare(where, "allreduce_out", u16(s.ar_in_place ? d.input : d.ar_out), d.want.ar,
                                         s.hidden);
            if (!s.ar_in_place) b += compare(where, "input", u16(d.input), d.in0, s.hidden);
            if (s.pat != FU_PAT_RES) {
                b += compare(where, "weight (an input)", u16(d.weight), d.weight0, s.hidden);
                if (s.norm_out) b += compare(where, "norm_out", u16(d.norm_out), d.want.norm, s.hidden);
            }
            if (s.pat == FU_PAT_RMS_NVFP4) {
                b += compare(where, "quant_out (nvfp4)", d.quant_out.data, d.want.quant, s.hidden / 2);
                b += compare(where, "sf_out", d.sf_out.data, d.want.sf, s.sf_linear ? s.hidden / 16 : 512);
            } else if (s.pat >= FU_PAT_RMS_FP8) {
                b += compare(where, "quant_out", d.quant_out.data, d.want.quant, s.hidden);
            }
            if ((s.pat == FU_PAT_RMS_FP8 || s.pat == FU_PAT_RMS_NVFP4) &&
                std::memcmp(d.scale.data, &s.static_scale, 4) != 0) {
                std::printf("FAIL %s: the static scale (an input) changed\n", where.c_str());
                ++b;
            }
            if (s.pat == FU_PAT_RMS_FP8TOK || s.pat == FU_PAT_RMS_I8TOK) {
                for (size_t t = 0; t < d.want.scales.size(); ++t) {
                    fc_u32 got, want;
                    std::memcpy(&got, d.scale.data + 4 * t, 4);
                    std::memcpy(&want, &d.want.scales[t], 4);
                    if (got != want) {
                        std::printf("FAIL %s: scale of row %zu: got 0x%08x want 0x%08x\n", where.c_str(), t, got,
                                    want);
                        ++b;
                        break;
                    }
                }
            }
            for (const Buf* t : {&d.input, &d.resid_in, &d.resid_out, &d.weight, &d.norm_out, &d.quant_out, &d.scale,
                                 &d.ar_out, &d.sf_out})
                if (t->data && !t->guards_intact()) {
                    std::printf("FAIL %s: a store landed next to a tensor (guard bytes changed)\n", where.c_str());
                    ++b;
                    break;
                }
            bad += b;
        }
    }
    // Every launch leaves the Lamport area as it found it (0xff in every
    // byte) and consumes every LL record sent to it (the lines, which the
    // fused kernels no longer use, stay 0).
    for (int r = 0; r < g.world; ++r) {
        const unsigned char* ll = g.ws[r] + ll_offset(g.slot);
        const unsigned char* lamport = g.ws[r] + lamport_offset(g.slot);
        for (fc_u64 i = 0; i < FC_LL_FP_BYTES + g.slot; ++i)
            if (ll[i] != 0) {
                std::printf("FAIL %s rank %d: byte %llu of the LL area is 0x%02x after every launch, not 0\n",
                            g.what.c_str(), r, (unsigned long long)i, ll[i]);
                ++bad;
                break;
            }
        for (fc_u64 i = 0; i < g.slot / 2; ++i)
            if (lamport[i] != 0xff) {
                std::printf("FAIL %s rank %d: byte %llu of the Lamport area is 0x%02x after every launch, not "
                            "0xff (\"not arrived\")\n",
                            g.what.c_str(), r, (unsigned long long)i, lamport[i]);
                ++bad;
                break;
            }
    }
    for (int r = 0; r < g.world; ++r)
        if (g.err[r][0] || g.err[r][1] || g.err[r][2] || g.err[r][3]) {
            std::printf("FAIL %s rank %d: error words %u %u %u %u\n", g.what.c_str(), r, g.err[r][0], g.err[r][1],
                        g.err[r][2], g.err[r][3]);
            ++bad;
        }
    return bad;
}

// A session: one workspace per rank (slot bytes given), every call on it in
// order. Calls cycle through the three kinds for every pattern and dtype,
// with shapes drawn from `tokens` and `hiddens` (the kind's limits
// permitting: an LL call takes the most tokens its Lamport area holds).
struct Plan {
    const char* what;
    int world, nt;
    fc_u64 slot;
    std::vector<size_t> tokens, hiddens;
    std::vector<int> nbs;
    // Only the norm patterns in f16, every call probed (the order session:
    // f16 rows take probes easily, and the kernels' sum of squares is the
    // same template code for both dtypes).
    bool order = false;
};

static Session make_session(const Plan& pl) {
    Session g;
    g.what = pl.what;
    g.world = pl.world;
    g.nt = pl.nt;
    g.slot = pl.slot;
    for (int r = 0; r < pl.world; ++r) {
        g.ws.push_back(alloc_fenced(workspace_bytes(pl.slot)));
        // As Workspace::create leaves it: "not arrived" in every half.
        std::memset(g.ws.back() + lamport_offset(pl.slot), 0xff, pl.slot / 2);
        g.err.push_back((fc_u32*)std::calloc(16, sizeof(fc_u32)));
    }
    static const float SCALES[4] = {0.009f, 0.25f, 3.0e-3f, 1e-10f}; // the last below 2^-30: the division
    // NVFP4 global scales: scale factors mid-range, saturated, and small.
    static const float NVFP4_SCALES[4] = {336.0f, 4096.0f, 1.0f, 0.02f};
    int j = 0;
    for (int round = 0; round < (pl.order ? 2 : 1); ++round)
    for (int pat = pl.order ? FU_PAT_RMS : FU_PAT_RES; pat <= FU_PAT_RMS_NVFP4; ++pat)
        for (int bf = 0; bf < (pl.order ? 1 : 2); ++bf)
            for (int ki = 0; ki < KINDS; ++ki, ++j) {
                Kind kind = (Kind)((ki + pat + bf) % KINDS);
                // Nothing to gather without a norm (the host refuses it).
                if (kind == SP_GATHER && pat == FU_PAT_RES) kind = SP_SHARD;
                Spec s{};
                s.kind = kind;
                s.pat = pat;
                s.bf = bf;
                // NVFP4 takes whole 16-element blocks: odd pack counts grow by one.
                const auto width = [&](size_t h) { return pat == FU_PAT_RMS_NVFP4 ? (h + 15) / 16 * 16 : h; };
                s.hidden = width(pl.hiddens[(j + rnd(2)) % pl.hiddens.size()]);
                s.tokens = pl.tokens[(j + rnd(3)) % pl.tokens.size()];
                // SP: the plan's tokens are the rows of a shard.
                if (is_sp(kind)) s.tokens *= (size_t)pl.world;
                if (kind == ONESHOT_LL && !fits(g, kind, s.tokens, s.hidden)) {
                    // The most tokens (of the plan's, or 1) whose rows fit the
                    // area at this hidden, else at the smallest.
                    const auto most = [&](size_t h) {
                        size_t best = fits(g, kind, 1, h) ? 1 : 0;
                        for (size_t t : pl.tokens)
                            if (fits(g, kind, t, h)) best = std::max(best, t);
                        return best;
                    };
                    if (most(s.hidden) == 0) s.hidden = width(*std::min_element(pl.hiddens.begin(), pl.hiddens.end()));
                    s.tokens = most(s.hidden);
                    if (s.tokens == 0) continue; // no LL call at this slot
                }
                if (!fits(g, kind, s.tokens, s.hidden)) std::abort(); // the plan's rows fit the push kinds
                s.nb_asked = pl.nbs[(j + rnd(2)) % pl.nbs.size()];
                s.special = s.tokens >= 5 && rnd(2) == 0;
                s.eps = s.special && rnd(2) ? 0.0f : 1e-6f;
                s.ar_out = rnd(2);
                // (SP: allreduce_out is the shard's; the host refuses the input.)
                s.ar_in_place = s.ar_out && !is_sp(kind) && rnd(3) == 0;
                s.res_in_place = rnd(3) == 0;
                s.norm_out = pat == FU_PAT_RMS || rnd(4) != 0;
                // SP rows take the same walkers (fused_rows); probes need
                // each rank's own residual of every row.
                s.probe = pat != FU_PAT_RES && !is_sp(kind) && (pl.order || rnd(3) != 0);
                s.static_scale = SCALES[rnd(4)];
                if (pat == FU_PAT_RMS_NVFP4) s.static_scale = NVFP4_SCALES[rnd(4)];
                s.sf_linear = rnd(2);
                add_call(g, s);
            }
    return g;
}

int main(int argc, char** argv) {
    const unsigned long seed = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1;
    const bool verbose = argc > 2 && std::strcmp(argv[2], "-v") == 0; // every call's line
    rng.seed(seed);
    // Hundreds of emulated threads on a few cores: waiters yield.
    emu_poll_yield = true;
    // A block that misses a barrier hangs the emulation: give up loudly
    // when one session runs 300 s (a few seconds here, a minute or two
    // under ThreadSanitizer).
    static std::atomic<const char*> running{"setup"};
    static std::atomic<long> started{0}; // steady-clock seconds of the session's start
    const auto now_s = [] {
        const auto t = std::chrono::steady_clock::now().time_since_epoch();
        return (long)std::chrono::duration_cast<std::chrono::seconds>(t).count();
    };
    started = now_s();
    std::thread([now_s] {
        for (;;) {
            std::this_thread::sleep_for(std::chrono::seconds(1));
            if (now_s() - started.load() < 300) continue;
            std::printf("FAIL fused_emu: session \"%s\" still running after 300 s: a hang\n", running.load());
            std::fflush(stdout);
            std::_Exit(2);
        }
    }).detach();
    // Slots sized so calls run many chunks (one-shot chunks of `(2 * slot /
    // world) & ~63` bytes of rows, two-shot segments of `(slot / world) &
    // ~63`) and LL calls fit only where they should.
    const std::vector<Plan> plans = {
        // 2 to 16 chunks either push kind; LL calls of 1 to 4 rows.
        {"w2 small slot", 2, 64, 512, {3, 17, 64}, {8, 24}, {1, 2, 3}},
        // Some two-shot calls with fewer rows than ranks; up to 13 chunks.
        {"w3 small slot", 3, 96, 1024, {1, 3, 17, 40}, {8, 24, 64}, {2, 3, 4}},
        // One group a block: many rows a block, every pass wraps the lanes
        // (33 packs a row), LL threads with two packs.
        {"w3 one-group blocks", 3, 32, 8192, {1, 3, 17, 64}, {24, 264}, {1, 4}},
        // Four groups a block: one-row blocks take the block walker, others
        // leave groups idle; LL rows of 1 to 3 tokens.
        {"w2 four-group blocks", 2, 128, 16384, {1, 3, 17}, {64, 264}, {1, 2, 4}},
        // Eight groups: the two-shot's one-row pieces take the block walker;
        // rows of 129 packs (five a lane for lane 0).
        {"w2 eight-group blocks", 2, 256, 8192, {1, 2, 3, 5}, {64, 1032}, {1, 2}},
        // Many rows a block in the two-shot, on rows of 129 packs.
        {"w3 wide rows", 3, 64, 16384, {5, 17}, {1032, 24}, {1, 2}},
        // The sum of squares' order where lanes hold several packs: group
        // and block walkers (both kinds) and the LL kind on rows of 65 and
        // 129 packs, twice over.
        {"w2 order", 2, 256, 65536, {1, 2, 9}, {520, 1032}, {1, 3}, true},
    };
    int bad = 0, calls = 0, launches = 0, walked[3] = {0, 0, 0};
    unsigned most_chunks[KINDS] = {0, 0, 0, 0, 0};
    for (const Plan& pl : plans) {
        const auto t0 = std::chrono::steady_clock::now();
        running = pl.what;
        started = now_s();
        Session g = make_session(pl);
        const auto t1 = std::chrono::steady_clock::now();
        run(g);
        const auto t2 = std::chrono::steady_clock::now();
        const int b = verify(g);
        for (const Call& c : g.calls) {
            most_chunks[c.s.kind] = std::max(most_chunks[c.s.kind], c.advance);
            launches += g.world;
            const int w = walkers(g, c);
            for (int k = 0; k < 3; ++k) walked[k] += w >> k & 1;
            if (verbose)
                std::printf("  %s%s%s%s\n", c.name.c_str(), w & 1 ? ", block walker" : "",
                            w & 2 ? ", group walker" : "", w & 4 ? ", two packs a thread" : "");
        }
        calls += (int)g.calls.size();
        const auto ms = [](auto d) { return (long)std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); };
        std::printf("%s (world %d, %d threads a block, slot %llu): %zu calls, %d failed (%ld ms data, %ld ms run)\n",
                    pl.what, pl.world, pl.nt, (unsigned long long)pl.slot, g.calls.size(), b, ms(t1 - t0),
                    ms(t2 - t1));
        bad += b;
    }
    std::printf("seed %lu: %d calls (%d launches), most chunks a call: one-shot %u, two-shot %u, sp gathered %u, sp "
                "shard %u; calls with the block walker %d, the group walker %d, LL threads of two packs %d; rows "
                "whose every rstd change shows: %d of %d probed, in %d of %d norm calls\n",
                seed, calls, launches, most_chunks[ONESHOT], most_chunks[TWOSHOT], most_chunks[SP_GATHER],
                most_chunks[SP_SHARD], walked[0], walked[1], walked[2], probed_rows, probe_rows, probed_calls,
                norm_calls);
    if (bad) {
        std::printf("%d failures\n", bad);
        return 1;
    }
    std::printf("all ok\n");
    return 0;
}
