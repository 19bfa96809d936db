// Runs the device API (kernels-cuda/device_api.cuh) and the example
// all-gather (kernels-cuda/examples/user_allgather.cu) on the CPU over the
// emulated prelude (emu_prelude.h): worlds of 2, 3 and 4 ranks, each rank's
// heap plain memory, a few blocks of threads per launch (warps of
// FC_EMU_WARP lanes, some partial). Checked:
// - the all-gather called back to back with new data, sizes and grids each
//   call and no host sync between ranks (the "consumer" of each call's output
//   runs between two launches of that rank, as a later kernel would), exact;
// - puts and gets at thread, warp and block granularity, odd sizes, every
//   relative alignment, nothing written outside the pieces;
// - fc_signal_add from every block of every rank, the comparisons;
// - fc_barrier_all_block many times in a row, over two launches;
// - remote fc_atomic_add (tickets unique) and fc_atomic_cas / fetch;
// - address helpers, with FC_DEVICE_API_CHECKS;
// - a peer that never signals: the wait and the barrier return false and the
//   error words hold TIMEOUT, the missing ranks and 0xFFFFFFFF; a failed
//   communicator ends a wait at once.
// See ci/check-kernels-emu.sh (also under ThreadSanitizer).
#define FC_DEVICE_API_CHECKS 1
#include "emu_prelude.h"
#include "../../kernels-cuda/device_api.cuh"
#include "../../kernels-cuda/examples/user_allgather.cu"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <thread>

static std::atomic<int> g_failures{0};

static void fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::printf("FAIL ");
    std::vprintf(fmt, ap);
    std::printf("\n");
    va_end(ap);
    g_failures.fetch_add(1);
}

template <class Args>
static void launch(void (*k)(const Args), const Args& a, int nb, int nt) {
    std::vector<std::unique_ptr<EmuBlock>> blocks;
    for (int b = 0; b < nb; ++b) blocks.emplace_back(new EmuBlock(nt));
    std::vector<std::thread> ts;
    for (int b = 0; b < nb; ++b)
        for (int t = 0; t < nt; ++t)
            ts.emplace_back([&, b, t] {
                emu = EmuThread{(fc_u32)t, (fc_u32)nt, (fc_u32)b, (fc_u32)nb, blocks[b].get(), 0};
                k(a);
            });
    for (auto& t : ts) t.join();
}

static unsigned char* zalloc(size_t bytes) {
    const size_t n = (bytes + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, n);
    std::memset(p, 0, n);
    return (unsigned char*)p;
}

constexpr fc_u64 HEAP_BYTES = 2u << 20;
constexpr fc_u64 HEAP_RESERVED = 65536; // the sync area

static std::mt19937_64 rng(1);

// W ranks' heaps and error words, and a symmetric bump allocator.
struct World {
    int W;
    std::vector<unsigned char*> heap;
    std::vector<fc_u32*> err;
    fc_u64 next = HEAP_RESERVED;
    explicit World(int w) : W(w) {
        for (int r = 0; r < W; ++r) {
            heap.push_back(zalloc(HEAP_BYTES));
            err.push_back((fc_u32*)zalloc(64));
        }
    }
    ~World() {
        for (int r = 0; r < W; ++r) std::free(heap[r]), std::free(err[r]);
    }
    fc_u64 alloc(fc_u64 bytes) {
        const fc_u64 off = next;
        next = (next + bytes + 255) & ~(fc_u64)255;
        if (next > HEAP_BYTES) std::abort();
        return off;
    }
    template <class T>
    T* at(int r, fc_u64 off) {
        return reinterpret_cast<T*>(heap[r] + off);
    }
    fc_u64 addr(int r, fc_u64 off) { return (fc_u64)(heap[r] + off); }
    FcDevCtx ctx(int r, fc_u64 timeout_ns = 20ull * 1000 * 1000 * 1000) {
        FcDevCtx c;
        std::memset(&c, 0, sizeof c);
        for (int q = 0; q < W; ++q) c.heap[q] = (fc_u64)heap[q];
        c.heap_bytes = HEAP_BYTES;
        c.error_flags = (fc_u64)err[r];
        c.timeout_ns = timeout_ns;
        c.sync_offset = 0;
        c.rank = r;
        c.world = W;
        return c;
    }
    // f(r) on one host thread per rank, all at once.
    void each_rank(const std::function<void(int)>& f) {
        std::vector<std::thread> ts;
        for (int r = 0; r < W; ++r) ts.emplace_back(f, r);
        for (auto& t : ts) t.join();
    }
    void expect_clean_errors(const char* what) {
        for (int r = 0; r < W; ++r)
            if (err[r][0] || err[r][1] || err[r][2] || err[r][3])
                fail("%s: world %d rank %d error words %u %u %u %u", what, W, r, err[r][0], err[r][1], err[r][2],
                     err[r][3]);
    }
};

// ===========================================================================
// The example all-gather, called back to back.

static unsigned char pattern(fc_u64 seed, int r, int call, fc_u64 i) {
    fc_u64 x = seed * 0x9E3779B97F4A7C15ull + (fc_u64)r * 0x100000001B3ull + (fc_u64)call * 0xC2B2AE3Dull + i;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    return (unsigned char)(x >> 32);
}

static void test_allgather(World& w, fc_u64 seed) {
    const fc_u64 sizes[] = {1000, 4096, 1, 0, 3333, 77, 2053, 64};
    const int calls = sizeof sizes / sizeof sizes[0];
    const fc_u64 max_n = 4096;
    const fc_u64 signal = w.alloc(2 * FC_MAX_RANKS * 8);
    const fc_u64 epoch = w.alloc(8);
    const fc_u64 out = w.alloc(w.W * max_n);
    w.each_rank([&](int r) {
        unsigned char* in = zalloc(max_n + 64);
        for (int c = 0; c < calls; ++c) {
            const fc_u64 n = sizes[c];
            unsigned char* input = in + (r + c) % 3 * 5; // aligned, or not
            for (fc_u64 i = 0; i < n; ++i) input[i] = pattern(seed, r, c, i);
            UserAllgatherArgs a;
            a.ctx = w.ctx(r);
            a.input = (fc_u64)input;
            a.heap_out = w.addr(r, out);
            a.bytes_per_rank = n;
            a.signal = w.addr(r, signal);
            a.epoch_word = w.addr(r, epoch);
            // Grids differ per rank and per call; blocks of 24 or 20 threads.
            launch(user_allgather, a, 1 + (r + 2 * c) % 4, c % 2 ? 20 : 24);
            // The consumer: reads this call's output before the next launch.
            const unsigned char* o = w.at<unsigned char>(r, out);
            int bad = 0;
            for (int q = 0; q < w.W && !bad; ++q)
                for (fc_u64 i = 0; i < n; ++i)
                    if (o[q * n + i] != pattern(seed, q, c, i)) {
                        fail("allgather world %d call %d rank %d: slot %d byte %llu is %02x, want %02x", w.W, c, r,
                             q, (unsigned long long)i, o[q * n + i], pattern(seed, q, c, i));
                        bad = 1;
                        break;
                    }
        }
        std::free(in);
    });
    for (int r = 0; r < w.W; ++r) {
        const fc_u64* s = w.at<fc_u64>(r, signal);
        for (int q = 0; q < w.W; ++q)
            if (s[q] != 0 || s[FC_MAX_RANKS + q] != (fc_u64)calls)
                fail("allgather world %d rank %d: signal words of %d are %llu %llu", w.W, r, q,
                     (unsigned long long)s[q], (unsigned long long)s[FC_MAX_RANKS + q]);
        if (*w.at<fc_u64>(r, epoch) != (fc_u64)calls << 32)
            fail("allgather world %d rank %d: epoch word %llx", w.W, r,
                 (unsigned long long)*w.at<fc_u64>(r, epoch));
    }
    w.expect_clean_errors("allgather");
}

// ===========================================================================
// Puts and gets at every granularity. Piece k of a kind has its own 1 KiB
// region; its offsets inside cover every relative alignment of the two
// sides (equal modulo 16, equal modulo 4 only, neither).

enum { KIND_THREAD = 0, KIND_WARP = 1, KIND_BLOCK = 2 };
constexpr fc_u64 REGION = 1024;
constexpr fc_u64 MAX_PIECES = 128; // per kind

struct Piece {
    fc_u64 heap, local, len; // offsets in the heap area and in the local buffer
};
static Piece piece(int kind, fc_u64 k) {
    const fc_u64 base = ((fc_u64)kind * MAX_PIECES + k) * REGION;
    const fc_u64 hm = (k * 5 + kind) % 16;
    const fc_u64 lm = k % 3 == 0 ? hm : k % 3 == 1 ? (hm + 4) % 16 : (hm + 7) % 16;
    const fc_u64 len = kind == KIND_THREAD ? 1 + (k * 37) % 200
                       : kind == KIND_WARP ? 150 + (k * 131) % 700
                                           : 700 + (k * 97) % 290;
    return Piece{base + 8 + hm, base + 8 + lm, len};
}
constexpr fc_u64 AREA = 3 * MAX_PIECES * REGION;

struct GranArgs {
    FcDevCtx ctx;
    fc_u64 src;     // local buffer (not in the heap): what this rank puts
    fc_u64 got;     // local buffer: what this rank gets
    fc_u64 put_off; // heap area the puts of rank - 1 land in
    fc_u64 pat_off; // heap area every rank filled before: the gets read rank + 1's
    fc_u64 cnt_off; // heap u64[2][FC_MAX_RANKS]: thread / warp pieces received from each rank (ADD)
    fc_u64 set_off; // heap u64[FC_MAX_RANKS][MAX_PIECES]: block pieces received (SET)
    fc_u64 from_src;    // rank - 1's src buffer: what block 0 checks once the signals are in
    fc_u64 from_threads; // threads, warps and blocks of rank - 1
    fc_u64 from_warps;
    fc_u64 from_blocks;
};

static fc_u32 warps_per_block(fc_u32 nt) { return (nt + FC_EMU_WARP - 1) / FC_EMU_WARP; }

FC_HEAP_KERNEL(emu_granularity, GranArgs) {
    const FcDevCtx& ctx = a.ctx;
    const fc_u32 to = (ctx.rank + 1) % ctx.world, from = (ctx.rank + ctx.world - 1) % ctx.world;
    const fc_u32 t = fc_thread_id(), b = fc_block_id(), nt = fc_block_threads();
    char* heap = fc_ptr<char>(ctx.heap[ctx.rank]);
    char* put_area = heap + a.put_off;
    const char* pat = heap + a.pat_off;
    char* src = fc_ptr<char>(a.src);
    char* got = fc_ptr<char>(a.got);
    fc_u64* cnt = fc_ptr<fc_u64>(ctx.heap[ctx.rank] + a.cnt_off);
    fc_u64* set = fc_ptr<fc_u64>(ctx.heap[ctx.rank] + a.set_off);

    const fc_u64 thread_k = (fc_u64)b * nt + t;
    const fc_u64 warp_k = (fc_u64)b * warps_per_block(nt) + t / fc_warp_size();
    Piece p = piece(KIND_THREAD, thread_k);
    fc_put_signal_thread(ctx, to, put_area + p.heap, src + p.local, p.len, cnt + ctx.rank, 1, FC_SIGNAL_ADD);
    fc_get_thread(ctx, to, got + p.local, pat + p.heap, p.len);
    p = piece(KIND_WARP, warp_k);
    fc_put_signal_warp(ctx, to, put_area + p.heap, src + p.local, p.len, cnt + FC_MAX_RANKS + ctx.rank, 1,
                       FC_SIGNAL_ADD);
    fc_get_warp(ctx, to, got + p.local, pat + p.heap, p.len);
    p = piece(KIND_BLOCK, b);
    fc_put_signal_block(ctx, to, put_area + p.heap, src + p.local, p.len, set + ctx.rank * MAX_PIECES + b, 1000 + b,
                        FC_SIGNAL_SET);
    fc_get_block(ctx, to, got + p.local, pat + p.heap, p.len);

    // Block 0 waits for each kind of piece rank - 1 sends, then reads those
    // pieces before waiting for the next kind: a signal released before all
    // the bytes it covers shows up as a data race under TSan. (The host
    // checks the bytes and the guards again after the join.)
    if (b != 0) return;
    const char* from_src = fc_ptr<const char>(a.from_src);
    const fc_u64 count[3] = {a.from_threads, a.from_warps, a.from_blocks};
    for (int kind = 0; kind < 3; ++kind) {
        bool ok = true;
        if (t == 0 && kind < 2) ok = fc_wait_until(ctx, cnt + kind * FC_MAX_RANKS + from, FC_CMP_EQ, count[kind], from);
        for (fc_u32 k = 0; t == 0 && kind == 2 && k < a.from_blocks; ++k)
            ok = ok && fc_wait_until(ctx, set + from * MAX_PIECES + k, FC_CMP_EQ, 1000 + k, from);
        if (fc_barrier_or(!ok)) {
            if (t == 0) fail("granularity: rank %u: pieces of kind %d from %u never arrived", ctx.rank, kind, from);
            return;
        }
        for (fc_u64 k = t; k < count[kind]; k += nt) {
            const Piece q = piece(kind, k);
            if (std::memcmp(put_area + q.heap, from_src + q.local, q.len) != 0)
                fail("granularity: rank %u: kind %d piece %llu from %u differs in the kernel", ctx.rank, kind,
                     (unsigned long long)k, from);
        }
    }
}

// The bytes of every piece equal the source's; the bytes around them are still zero.
static void check_pieces(const char* what, const unsigned char* dst, bool dst_is_heap_side, const unsigned char* src,
                         int kind, fc_u64 count) {
    for (fc_u64 k = 0; k < count; ++k) {
        const Piece p = piece(kind, k);
        const fc_u64 d = dst_is_heap_side ? p.heap : p.local, s = dst_is_heap_side ? p.local : p.heap;
        if (std::memcmp(dst + d, src + s, p.len) != 0) fail("%s: kind %d piece %llu differs", what, kind, (unsigned long long)k);
        if (dst[d - 1] != 0 || dst[d + p.len] != 0)
            fail("%s: kind %d piece %llu: bytes written outside it", what, kind, (unsigned long long)k);
    }
}

static void test_granularity(World& w) {
    const int W = w.W;
    const fc_u64 put_off = w.alloc(AREA), pat_off = w.alloc(AREA);
    const fc_u64 cnt_off = w.alloc(2 * FC_MAX_RANKS * 8), set_off = w.alloc(FC_MAX_RANKS * MAX_PIECES * 8);
    std::vector<unsigned char*> src(W), got(W);
    std::vector<int> nb(W), nt(W);
    for (int r = 0; r < W; ++r) {
        src[r] = zalloc(AREA);
        got[r] = zalloc(AREA);
        for (fc_u64 i = 0; i < AREA; ++i) src[r][i] = (unsigned char)(rng() | 1); // never zero: guards stay visible
        unsigned char* pat = w.at<unsigned char>(r, pat_off);
        for (fc_u64 i = 0; i < AREA; ++i) pat[i] = (unsigned char)(rng() | 1);
        nb[r] = 1 + (r + W) % 3;
        nt[r] = r % 2 ? 20 : 24; // 20: a partial last warp
    }
    w.each_rank([&](int r) {
        const int f = (r + W - 1) % W;
        GranArgs a;
        a.ctx = w.ctx(r);
        a.src = (fc_u64)src[r];
        a.got = (fc_u64)got[r];
        a.put_off = put_off;
        a.pat_off = pat_off;
        a.cnt_off = cnt_off;
        a.set_off = set_off;
        a.from_src = (fc_u64)src[f];
        a.from_threads = (fc_u64)nb[f] * nt[f];
        a.from_warps = (fc_u64)nb[f] * warps_per_block(nt[f]);
        a.from_blocks = nb[f];
        launch(emu_granularity, a, nb[r], nt[r]);
    });
    for (int r = 0; r < W; ++r) {
        const int f = (r + W - 1) % W, to = (r + 1) % W;
        const std::string what = "granularity world " + std::to_string(W) + " rank " + std::to_string(r);
        const unsigned char* area = w.at<unsigned char>(r, put_off);
        check_pieces((what + " put").c_str(), area, true, src[f], KIND_THREAD, (fc_u64)nb[f] * nt[f]);
        check_pieces((what + " put").c_str(), area, true, src[f], KIND_WARP, (fc_u64)nb[f] * warps_per_block(nt[f]));
        check_pieces((what + " put").c_str(), area, true, src[f], KIND_BLOCK, nb[f]);
        const unsigned char* pat = w.at<unsigned char>(to, pat_off);
        check_pieces((what + " get").c_str(), got[r], false, pat, KIND_THREAD, (fc_u64)nb[r] * nt[r]);
        check_pieces((what + " get").c_str(), got[r], false, pat, KIND_WARP, (fc_u64)nb[r] * warps_per_block(nt[r]));
        check_pieces((what + " get").c_str(), got[r], false, pat, KIND_BLOCK, nb[r]);
    }
    for (int r = 0; r < W; ++r) std::free(src[r]), std::free(got[r]);
    w.expect_clean_errors("granularity");
}

// ===========================================================================
// fc_signal_add from every block of every rank into one word on every rank.

struct SigArgs {
    FcDevCtx ctx;
    fc_u64 acc_off;
    fc_u64 expect;
};

FC_HEAP_KERNEL(emu_signal_add, SigArgs) {
    const FcDevCtx& ctx = a.ctx;
    fc_u64* acc = fc_ptr<fc_u64>(ctx.heap[ctx.rank] + a.acc_off);
    const fc_u32 b = fc_block_id();
    if (fc_thread_id() == 0)
        for (fc_u32 q = 0; q < ctx.world; ++q) fc_signal_add(ctx, q, acc, (ctx.rank + 1u) * (b + 1u));
    if (b == 0 && fc_thread_id() == 0) {
        const fc_u64 v = a.expect;
        const bool ok = fc_wait_until(ctx, acc, FC_CMP_EQ, v, ctx.rank) && fc_wait_until(ctx, acc, FC_CMP_GE, v, 0) &&
                        fc_wait_until(ctx, acc, FC_CMP_LE, v, 0) && fc_wait_until(ctx, acc, FC_CMP_NE, v + 1, 0) &&
                        fc_wait_until(ctx, acc, FC_CMP_GT, v - 1, 0) && fc_wait_until(ctx, acc, FC_CMP_LT, v + 1, 0);
        if (!ok) fail("signal_add: rank %u: the sum never reached %llu", ctx.rank, (unsigned long long)v);
    }
}

static void test_signal_add(World& w) {
    const fc_u64 acc = w.alloc(8);
    fc_u64 expect = 0;
    for (int r = 0; r < w.W; ++r) {
        const fc_u64 nb = 1 + r % 3;
        expect += (fc_u64)(r + 1) * nb * (nb + 1) / 2;
    }
    w.each_rank([&](int r) {
        SigArgs a{w.ctx(r), acc, expect};
        launch(emu_signal_add, a, 1 + r % 3, 16);
    });
    for (int r = 0; r < w.W; ++r)
        if (*w.at<fc_u64>(r, acc) != expect)
            fail("signal_add world %d rank %d: %llu, want %llu", w.W, r, (unsigned long long)*w.at<fc_u64>(r, acc),
                 (unsigned long long)expect);
    w.expect_clean_errors("signal_add");
}

// ===========================================================================
// fc_barrier_all_block in a loop: put a row to every rank, barrier, check every
// rank's row, barrier (nobody overwrites a row before all have read it).

constexpr int ROW = 16; // u32 per row

struct BarArgs {
    FcDevCtx ctx;
    fc_u64 rows_off; // heap u32[FC_MAX_RANKS][ROW]
    fc_u64 stage;    // local u32[ROW]
    fc_u32 iters;
    fc_u32 launch_no;
};

static fc_u32 row_value(fc_u32 r, fc_u32 launch_no, fc_u32 i, fc_u32 j) {
    return r * 1000000u + launch_no * 100000u + i * 100u + j;
}

FC_HEAP_KERNEL(emu_barrier, BarArgs) {
    const FcDevCtx& ctx = a.ctx;
    if (fc_block_id() != 0) return; // one block per rank takes part
    const fc_u32 t = fc_thread_id();
    fc_u32* rows = fc_ptr<fc_u32>(ctx.heap[ctx.rank] + a.rows_off);
    fc_u32* stage = fc_ptr<fc_u32>(a.stage);
    for (fc_u32 i = 0; i < a.iters; ++i) {
        for (fc_u32 j = t; j < ROW; j += fc_block_threads()) stage[j] = row_value(ctx.rank, a.launch_no, i, j);
        fc_barrier();
        for (fc_u32 q = 0; q < ctx.world; ++q) fc_put_block(ctx, q, rows + ctx.rank * ROW, stage, ROW * 4);
        if (!fc_barrier_all_block(ctx)) {
            if (t == 0) fail("barrier: rank %u iteration %u: timed out", ctx.rank, i);
            return;
        }
        for (fc_u32 k = t; k < ctx.world * ROW; k += fc_block_threads())
            if (rows[k] != row_value(k / ROW, a.launch_no, i, k % ROW))
                fail("barrier: rank %u iteration %u: word %u is %u", ctx.rank, i, k, rows[k]);
        if (!fc_barrier_all_block(ctx)) return;
    }
}

static void test_barrier(World& w) {
    const fc_u64 rows = w.alloc(FC_MAX_RANKS * ROW * 4);
    const fc_u32 iters = 25;
    w.each_rank([&](int r) {
        fc_u32* stage = (fc_u32*)zalloc(ROW * 4);
        for (fc_u32 l = 0; l < 2; ++l) {
            BarArgs a{w.ctx(r), rows, (fc_u64)stage, iters, l};
            launch(emu_barrier, a, 2, 12);
        }
        std::free(stage);
    });
    for (int r = 0; r < w.W; ++r) {
        const fc_u64* sync = w.at<fc_u64>(r, 0);
        const fc_u64 want = 2ull * 2 * iters;
        const fc_u64 count = sync[FC_SYNC_BARRIER_COUNT / 8];
        if (count != want) fail("barrier: rank %d count %llu", r, (unsigned long long)count);
        for (int q = 0; q < w.W; ++q)
            if (sync[FC_SYNC_BARRIER_ARRIVED / 8 + q] != want)
                fail("barrier: rank %d arrived[%d] = %llu", r, q,
                     (unsigned long long)sync[FC_SYNC_BARRIER_ARRIVED / 8 + q]);
    }
    w.expect_clean_errors("barrier");
}

// ===========================================================================
// Remote atomics: every thread of every rank takes a ticket from rank 0's
// counter; thread 0 of every block adds rank + 1 to rank W-1's word by CAS.

struct AtomArgs {
    FcDevCtx ctx;
    fc_u64 ctr_off;
    fc_u64 cas_off;
    fc_u64 tickets; // host u64[], this rank's threads from `first`
};

FC_HEAP_KERNEL(emu_atomics, AtomArgs) {
    const FcDevCtx& ctx = a.ctx;
    fc_u64* ctr = fc_ptr<fc_u64>(ctx.heap[ctx.rank] + a.ctr_off);
    fc_u64* word = fc_ptr<fc_u64>(ctx.heap[ctx.rank] + a.cas_off);
    fc_ptr<fc_u64>(a.tickets)[fc_block_id() * fc_block_threads() + fc_thread_id()] = fc_atomic_add(ctx, 0, ctr, 1);
    if (fc_thread_id() == 0) {
        const fc_u32 last = ctx.world - 1;
        fc_u64 seen = fc_atomic_fetch(ctx, last, word);
        for (;;) {
            const fc_u64 old = fc_atomic_cas(ctx, last, word, seen, seen + ctx.rank + 1);
            if (old == seen) break;
            seen = old;
        }
    }
}

static void test_atomics(World& w) {
    const fc_u64 ctr = w.alloc(8), cas = w.alloc(8);
    const int nt = 16;
    std::vector<std::vector<fc_u64>> tickets(w.W);
    fc_u64 total = 0, cas_want = 0;
    for (int r = 0; r < w.W; ++r) {
        const int nb = 1 + r % 2;
        tickets[r].resize(nb * nt);
        total += nb * nt;
        cas_want += (fc_u64)nb * (r + 1);
    }
    w.each_rank([&](int r) {
        AtomArgs a{w.ctx(r), ctr, cas, (fc_u64)tickets[r].data()};
        launch(emu_atomics, a, 1 + r % 2, nt);
    });
    std::vector<fc_u64> all;
    for (auto& v : tickets) all.insert(all.end(), v.begin(), v.end());
    std::sort(all.begin(), all.end());
    for (fc_u64 i = 0; i < all.size(); ++i)
        if (all[i] != i) {
            fail("atomics world %d: tickets are not 0..%llu (position %llu holds %llu)", w.W,
                 (unsigned long long)total - 1, (unsigned long long)i, (unsigned long long)all[i]);
            break;
        }
    if (*w.at<fc_u64>(0, ctr) != total) fail("atomics world %d: counter %llu", w.W, (unsigned long long)*w.at<fc_u64>(0, ctr));
    if (*w.at<fc_u64>(w.W - 1, cas) != cas_want)
        fail("atomics world %d: CAS word %llu, want %llu", w.W, (unsigned long long)*w.at<fc_u64>(w.W - 1, cas),
             (unsigned long long)cas_want);
    w.expect_clean_errors("atomics");
}

// ===========================================================================
// Address helpers (host calls: FC_DEVICE is plain inline here).

static void test_addresses(World& w) {
    const FcDevCtx c = w.ctx(1);
    unsigned char* h0 = w.heap[0];
    unsigned char* h1 = w.heap[1];
    if (!fc_peer_ok(c, 0) || fc_peer_ok(c, w.W)) fail("fc_peer_ok");
    if (!fc_in_heap(c, h1, HEAP_BYTES) || fc_in_heap(c, h1, HEAP_BYTES + 1) || !fc_in_heap(c, h1 + HEAP_BYTES - 8, 8) ||
        fc_in_heap(c, h1 + HEAP_BYTES - 8, 9) || fc_in_heap(c, h1 - 1, 1) || fc_in_heap(c, h0, 1))
        fail("fc_in_heap");
    if (fc_remote_ptr(c, 0, h1 + 100) != h0 + 100 || fc_remote_ptr(c, 1, h1 + 100) != h1 + 100)
        fail("fc_remote_ptr");
    if (fc_remote_ptr(c, w.W, h1 + 100) != nullptr || fc_remote_ptr(c, 0, h0 + 100) != nullptr ||
        fc_remote_ptr(c, 0, h1 + HEAP_BYTES) != nullptr)
        fail("fc_remote_ptr with FC_DEVICE_API_CHECKS: a bad address must give nullptr");
}

// ===========================================================================
// Timeouts and failed communicators.

struct WaitArgs {
    FcDevCtx ctx;
    fc_u64 sig_off;
    fc_u64 result; // host int: 1 true, 0 false
    fc_u64 barrier;
};

FC_HEAP_KERNEL(emu_wait, WaitArgs) {
    const FcDevCtx& ctx = a.ctx;
    bool ok;
    if (a.barrier) {
        ok = fc_barrier_all_block(ctx);
    } else {
        const bool failed =
            fc_thread_id() == 0 && !fc_wait_until(ctx, fc_ptr<fc_u64>(ctx.heap[ctx.rank] + a.sig_off), FC_CMP_GE, 1, 2);
        ok = !fc_barrier_or(failed);
    }
    if (fc_thread_id() == 0) *fc_ptr<int>(a.result) = ok;
}

static fc_u64 now_ns() { return fc_globaltimer_ns(); }

static void test_timeouts() {
    const fc_u64 short_ns = 50ull * 1000 * 1000;
    {
        // Rank 0 waits for a signal rank 2 never sends.
        World w(3);
        const fc_u64 sig = w.alloc(8);
        int result = -1;
        WaitArgs a{w.ctx(0, short_ns), sig, (fc_u64)&result, 0};
        const fc_u64 t0 = now_ns();
        launch(emu_wait, a, 1, 8);
        const double ms = (now_ns() - t0) / 1e6;
        const fc_u32* e = w.err[0];
        if (result != 0 || e[0] != FC_ERR_CODE_TIMEOUT || e[1] != 1u << 2 || e[3] != 0xFFFFFFFFu || ms < 40)
            fail("wait timeout: result %d after %.1f ms, error words %u %x %u %x", result, ms, e[0], e[1], e[2], e[3]);
        else
            std::printf("wait timeout: false after %.1f ms, error words %u %#x %u %#x\n", ms, e[0], e[1], e[2], e[3]);
    }
    {
        // Ranks 0 and 1 enter a barrier, rank 2 never does.
        World w(3);
        int result[2] = {-1, -1};
        w.each_rank([&](int r) {
            if (r == 2) return;
            WaitArgs a{w.ctx(r, short_ns), 0, (fc_u64)&result[r], 1};
            launch(emu_wait, a, 1, 8);
        });
        for (int r = 0; r < 2; ++r) {
            const fc_u32* e = w.err[r];
            if (result[r] != 0 || e[0] != FC_ERR_CODE_TIMEOUT || e[1] != 1u << 2 || e[3] != 0xFFFFFFFFu)
                fail("barrier timeout rank %d: result %d, error words %u %x %u %x", r, result[r], e[0], e[1], e[2],
                     e[3]);
        }
        std::printf("barrier timeout: false on ranks 0 and 1, error words %u %#x %u %#x\n", w.err[0][0], w.err[0][1],
                    w.err[0][2], w.err[0][3]);
    }
    {
        // A communicator that already failed: the wait gives up at once and
        // reports nothing of its own.
        World w(3);
        const fc_u64 sig = w.alloc(8);
        w.err[0][0] = FC_ERR_CODE_MISMATCH;
        int result = -1;
        WaitArgs a{w.ctx(0), sig, (fc_u64)&result, 0};
        const fc_u64 t0 = now_ns();
        launch(emu_wait, a, 1, 8);
        const double ms = (now_ns() - t0) / 1e6;
        const fc_u32* e = w.err[0];
        if (result != 0 || e[0] != FC_ERR_CODE_MISMATCH || e[1] != 0 || e[3] != 0 || ms > 5000)
            fail("failed communicator: result %d after %.1f ms, error words %u %x %u %x", result, ms, e[0], e[1], e[2],
                 e[3]);
    }
}

int main(int argc, char** argv) {
    const fc_u64 seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1;
    rng.seed(seed);
    for (int W : {2, 3, 4}) {
        if (W > emu_max_world()) continue;
        World w(W);
        const int before = g_failures.load();
        test_allgather(w, seed);
        test_granularity(w);
        test_signal_add(w);
        test_barrier(w);
        test_atomics(w);
        test_addresses(w);
        std::printf("world %d: %s\n", W, g_failures.load() == before ? "ok" : "FAILED");
    }
    test_timeouts();
    const int bad = g_failures.load();
    std::printf("%s\n", bad ? "FAILED" : "all ok");
    return bad ? 1 : 0;
}
