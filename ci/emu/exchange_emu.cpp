// Runs fc_exchange and fc_reduce_to (kernels-cuda/collectives.cu) on the CPU
// over the emulated prelude (emu_prelude.h): W ranks of several blocks of
// several threads, each rank's launches back to back with no host sync
// between them (so chunks, parities and epochs of consecutive launches
// overlap across ranks as on GPUs), small slots so every call has several
// chunks, odd counts and unaligned addresses (reduce-to inputs and outputs
// at byte offsets not a multiple of the element too), in place, all-to-all-v
// with zeros, premul_sum, and a count mismatch. Results are compared with a
// sequential reference (the reduction rule of docs/protocol.md). The prelude
// aborts with a FAIL line naming the access, the launch and the call site
// on any access a GPU would fault on (N bytes at an address not a multiple
// of N).
// The direct exchange (fc::exchange_direct) writes into receive blocks in
// each rank's symmetric heap (plain memory here, one arena per rank at its
// own base, with a table of the bases as the host passes it): all-to-all and
// all-gather lists (in place too), empty pairs, odd sizes, 1 to 4 blocks, the
// fallback to the inbox exchange when one rank cannot take blocks in place,
// and fc::exchange launches in between on the same receive blocks, each
// launch's output checked by its rank before that rank's next launch.
// The direct reduce-to (fc::reduce_to_direct) reads every source's input in
// place in its heap: reduce-scatter and reduce, in place or not, 16-byte
// aligned (vector loads) or only element aligned, premul_sum and avg, the
// fallback to the inbox reduce-to when one rank's input is outside its heap,
// fc::reduce_to launches on the same inputs in between, and a count
// mismatch from the source's and from the receiver's side.
// The LL twins (fc::exchange_ll, fc::reduce_to_ll) carry small agreed
// blocks on the LL lines of fc::oneshot_ll: all-gather (in place too),
// gather to and scatter from each root (in place on the root), reduce-scatter
// (in place too) and reduce to each root in turn, f32/f16/bf16/i32 with sum,
// avg and max, 1- and 2-byte elements with odd counts at addresses not 4-byte
// aligned, inputs, outputs and send and receive blocks at byte offsets that
// are not a multiple of their element (f32 at +1 to +3, f16/bf16 at odd
// ones, f64 at +5 and +2: the host passes such tensors to the exchange and
// the reduce-to, and a 4-byte access there faults on a GPU; ll_load_any /
// ll_store_any in collectives.cu go byte by byte), on either side or both,
// in place or not, blocks of one line or of a source's whole LL lines, 1 to
// 4 blocks (some with nothing to move), worlds 2 to 4 and 8. Runs of LL launches (so
// launches E and E + 2 reuse one parity's LL lines and records) alternate
// with inbox exchanges and reduce-tos of several chunks, a direct exchange
// and all-reduces (fc::oneshot_ll, fc::oneshot); each LL launch's whole
// buffer (output, guard bytes, send data) and epoch advance of 1 are checked
// before its rank's next launch. A fingerprint mismatch (in either half of the word)
// and a peer that never launches must raise the error naming a peer and
// write nothing.
#include "emu_prelude.h"
#include "../../kernels-cuda/common.cuh"
#include "../../kernels-cuda/collectives.cu"

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <vector>

// src/algo/layout.rs (asserted there: aux right after the flags).
constexpr fc_u64 FP_OFFSET = 256;
constexpr fc_u64 FLAGS_OFFSET = FP_OFFSET + 2ull * FC_MAX_BLOCKS * FC_MAX_RANKS * 8;
constexpr fc_u64 DATA_OFFSET = 131072;

// A rank's symmetric heap (direct exchange): its first bytes hold the table
// of every rank's heap base (p.table; the host keeps it in the heap's sync
// area), its receive blocks lie at HEAP_SYNC + 1024 * rank on (ARENA bytes),
// so the offsets ranks announce differ as well as the bases.
constexpr fc_u64 HEAP_BYTES = 65536;
constexpr fc_u64 HEAP_SYNC = 8192;
constexpr fc_u64 ARENA = 40960;

typedef void (*Kernel)(const FcParams&);

static void launch(Kernel k, const FcParams& p, int nb, int nt, const char* label = nullptr) {
    std::vector<std::unique_ptr<EmuBlock>> blocks;
    for (int b = 0; b < nb; ++b) blocks.emplace_back(new EmuBlock(nt));
    std::vector<std::thread> ts;
    for (int b = 0; b < nb; ++b)
        for (int t = 0; t < nt; ++t)
            ts.emplace_back([&, b, t] {
                emu = EmuThread{(fc_u32)t, (fc_u32)nt, (fc_u32)b, (fc_u32)nb, blocks[b].get(), 0, label};
                k(p);
            });
    for (auto& t : ts) t.join();
}

static unsigned char* alloc(size_t bytes) {
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    std::memset(p, 0, (bytes + 4095) / 4096 * 4096);
    return (unsigned char*)p;
}

// A workspace: exactly the bytes the layout gives it (page multiples here),
// then an inaccessible page, so a kernel that addresses past its end (say
// past the LL lines of parity 1) faults instead of scribbling on the heap.
static unsigned char* alloc_fenced(size_t bytes) {
    const size_t size = (bytes + 4095) / 4096 * 4096;
    void* p = mmap(nullptr, size + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED || mprotect((unsigned char*)p + size, 4096, PROT_NONE) != 0) std::abort();
    return (unsigned char*)p;
}

struct Launch {
    Kernel k;
    FcParams p;
    int nb;
    // On the rank's thread right before the launch, and right after it with
    // how far the launch moved the epoch word (returns the failures found):
    // what the stream's previous and next kernels would do, with no sync
    // with the other ranks.
    std::function<void()> before;
    std::function<int(fc_u32)> then;
    std::string what; // the case's name, for the prelude's messages
};

struct Check {
    std::string what;
    const unsigned char* got;
    std::vector<unsigned char> want;
};

struct Group {
    int world;
    fc_u64 slot;
    std::vector<unsigned char*> ws;
    std::vector<fc_u32*> err;
    std::vector<unsigned char*> heap;    // per rank: HEAP_BYTES, the table first
    std::vector<unsigned char*> outside; // per rank: ARENA bytes outside the heap
    std::vector<std::vector<Launch>> launches; // per rank, in order
    std::vector<Check> checks;
    std::atomic<int> late{0}; // failures the `then` hooks found

    Group(int w, fc_u64 slot_bytes) : world(w), slot(slot_bytes) {
        for (int r = 0; r < w; ++r) {
            // Up to the end of the LL area: 4 slots of parity regions, the LL
            // fingerprint records, then LL lines of both parities
            // (slot / 2 each).
            ws.push_back(alloc_fenced(DATA_OFFSET + 4 * slot + FC_LL_FP_BYTES + slot));
            err.push_back((fc_u32*)alloc(64));
            heap.push_back(alloc(HEAP_BYTES));
            outside.push_back(alloc(ARENA));
        }
        for (int r = 0; r < w; ++r)
            for (int q = 0; q < w; ++q) reinterpret_cast<fc_u64*>(heap[r])[q] = (fc_u64)heap[q];
        launches.resize(w);
    }
    FcParams params(int rank, fc_u32 dtype, fc_u32 op, fc_u64 count, fc_u64 fp) {
        FcParams p;
        std::memset(&p, 0, sizeof p);
        for (int r = 0; r < world; ++r) p.peer_ws[r] = (fc_u64)ws[r];
        p.error_flags = (fc_u64)err[rank];
        p.count = count;
        p.fingerprint = fp;
        p.timeout_ns = 20ull * 1000 * 1000 * 1000;
        p.fp_offset = FP_OFFSET;
        p.flags_offset = FLAGS_OFFSET;
        p.data_offset = DATA_OFFSET;
        p.slot_bytes = slot;
        p.rank = rank;
        p.world = world;
        p.dtype = dtype;
        p.op = op;
        return p;
    }
    void run(int nt) {
        std::vector<std::thread> ranks;
        for (int r = 0; r < world; ++r)
            ranks.emplace_back([this, r, nt] {
                const fc_u32* epoch = reinterpret_cast<const fc_u32*>(ws[r]); // [0] of the ctrl words
                for (auto& l : launches[r]) {
                    if (l.before) l.before();
                    const fc_u32 e = *epoch;
                    const std::string label = "\"" + l.what + "\" rank " + std::to_string(r);
                    launch(l.k, l.p, l.nb, nt, label.c_str());
                    if (l.then) late += l.then(*epoch - e);
                }
            });
        for (auto& t : ranks) t.join();
    }
};

static std::mt19937_64 rng(12345);
static size_t rnd(size_t n) { return (size_t)(rng() % n); }

static void fill(unsigned char* p, size_t bytes, int es) {
    for (size_t i = 0; i < bytes; ++i) p[i] = (unsigned char)rng();
    if (es == 2) // finite f16 and bf16 (NaN payloads are not specified by the rule)
        for (size_t i = 1; i < bytes; i += 2) p[i] &= 0xbf;
    if (es == 4) // finite floats (and fine as i32)
        for (size_t i = 0; i + 4 <= bytes; i += 4) {
            float f = (float)((int)(rng() % 2001) - 1000) / 64.0f + (float)(rng() % 1000) * 1e-5f;
            std::memcpy(p + i, &f, 4);
        }
}

static void set(FcParams& p, int row, int q, fc_u64 v) { p.per_peer[row][q] = v; }

// ---- exchange: per-peer counts c[s][d] (elements), each rank's blocks at
// given byte offsets in its own send and receive buffers ----
static void exchange_case(Group& g, const char* what, fc_u32 dtype, int es, std::vector<std::vector<size_t>> c,
                          bool in_place, int nb, fc_u64 fp) {
    const int W = g.world;
    std::vector<unsigned char*> send(W), recv(W);
    std::vector<std::vector<size_t>> soff(W, std::vector<size_t>(W)), roff(W, std::vector<size_t>(W));
    for (int r = 0; r < W; ++r) {
        size_t total_s = 0, total_r = 0;
        for (int q = 0; q < W; ++q) total_s += c[r][q] * es, total_r += c[q][r] * es;
        const size_t mis = in_place ? 0 : rnd(4) * (es == 1 ? 1 : es) + (es == 1 ? rnd(3) : 0);
        send[r] = alloc(total_s + 64) + mis;
        fill(send[r], total_s, es);
        recv[r] = in_place ? send[r] : alloc(total_r + 64) + (mis + 4 * es) % 16;
        size_t a = 0, b = 0;
        for (int q = 0; q < W; ++q) {
            soff[r][q] = a, a += c[r][q] * es;
            roff[r][q] = b, b += c[q][r] * es;
        }
    }
    std::vector<std::vector<unsigned char>> want(W);
    for (int r = 0; r < W; ++r) {
        size_t total_r = 0;
        for (int q = 0; q < W; ++q) total_r += c[q][r] * es;
        want[r].resize(total_r);
        for (int s = 0; s < W; ++s) std::memcpy(want[r].data() + roff[r][s], send[s] + soff[s][r], c[s][r] * es);
    }
    for (int r = 0; r < W; ++r) {
        FcParams p = g.params(r, dtype, FC_OP_SUM, 0, fp);
        for (int q = 0; q < W; ++q) {
            set(p, 0, q, c[r][q]);
            set(p, 1, q, (fc_u64)(send[r] + soff[r][q]));
            set(p, 2, q, c[q][r]);
            set(p, 3, q, (fc_u64)(recv[r] + roff[r][q]));
        }
        g.launches[r].push_back({fc::exchange, p, nb, nullptr, nullptr, what});
        g.checks.push_back({std::string(what) + " rank " + std::to_string(r), recv[r], want[r]});
    }
}

// ---- exchange into symmetric heaps: fc::exchange_direct, or fc::exchange on
// the same receive blocks (so the two kinds' epochs and parities interleave).
// A rank's receive blocks lie in its arena, the same for every such launch
// of the group (an output tensor reused call after call): in its heap, or,
// for the ranks in `no_direct` (no FC_PARAM_DIRECT_OK), in plain memory
// outside it, so every rank falls back to the inbox exchange. Before its
// launch a rank fills its arena with a fresh guard byte (then its send
// blocks, where they are receive blocks); right after it, before its next
// launch, it checks every received byte, the guard around the blocks (gaps
// between blocks catch an overrun), and how far the epoch word moved: 1 the
// direct way, 1 + the chunk count on the fallback, the chunk count for
// fc::exchange. Empty pairs carry addresses nothing may touch. ----
enum Sends {
    SEND_BLOCKS,    // a buffer of one block per peer
    SEND_ONE,       // all-gather: one buffer, the same bytes to every peer
    SEND_OWN_BLOCK, // all-gather in place: that buffer is our own receive block
    SEND_IN_PLACE,  // all-to-all in place: each send block is the pair's receive block (never direct)
};

struct HeapCase {
    std::string what;
    int es;
    std::vector<std::vector<size_t>> c;    // c[s][d]: elements s sends d
    std::vector<std::vector<size_t>> soff; // soff[s][d]: bytes into data[s] of s's block to d
    std::vector<std::vector<size_t>> roff; // roff[d][s]: bytes into d's arena of its block from s
    std::vector<std::vector<unsigned char>> data; // what each rank sends
    std::vector<unsigned char*> arena;
    std::vector<std::vector<char>> in_block; // per rank, per arena byte: inside a receive block
};

static void heap_case(Group& g, const char* what, bool direct, fc_u32 dtype, int es, std::vector<std::vector<size_t>> c,
                      Sends sends, bool aligned, unsigned no_direct, int nb, fc_u64 fp) {
    const int W = g.world;
    auto h = std::make_shared<HeapCase>();
    h->what = what;
    h->es = es;
    h->c = c;
    h->soff.assign(W, std::vector<size_t>(W, 0));
    h->roff = h->soff;
    h->data.resize(W);
    h->arena.resize(W);
    h->in_block.resize(W);
    // Element aligned, and (unless `aligned`) not 16-byte aligned: byte copies.
    auto mis = [&] { return aligned ? (size_t)0 : (size_t)es * (1 + rnd(16 / es - 1)); };
    size_t largest = 0;
    std::vector<unsigned char*> send(W);
    for (int r = 0; r < W; ++r) {
        const bool out = (no_direct >> r & 1) && sends != SEND_IN_PLACE;
        h->arena[r] = out ? g.outside[r] : g.heap[r] + HEAP_SYNC + 1024 * r;
        size_t total = 0;
        for (int q = 0; q < W; ++q) {
            largest = std::max(largest, c[r][q]);
            if (sends == SEND_IN_PLACE && c[r][q] != c[q][r]) std::abort();
            if (sends == SEND_BLOCKS || sends == SEND_IN_PLACE) {
                h->soff[r][q] = total;
                total += c[r][q] * es;
            } else {
                if (c[r][q] != c[r][0]) std::abort(); // an all-gather sends one block
                total = c[r][q] * es;
            }
        }
        h->data[r].resize(total);
        fill(h->data[r].data(), total, es);
        size_t at = mis();
        h->in_block[r].assign(ARENA, 0);
        for (int s = 0; s < W; ++s) {
            const size_t bytes = c[s][r] * es;
            if (at + bytes > ARENA) std::abort();
            h->roff[r][s] = at;
            std::fill(h->in_block[r].begin() + at, h->in_block[r].begin() + at + bytes, 1);
            at += bytes + (aligned ? 16 : es * (1 + rnd(3)));
            if (aligned) at = (at + 15) & ~(size_t)15;
        }
        if (sends == SEND_BLOCKS || sends == SEND_ONE) {
            send[r] = alloc(total + 64) + mis();
            std::memcpy(send[r], h->data[r].data(), total);
        }
    }
    const fc_u64 cap = ((g.slot / W) & ~(fc_u64)63) / es; // fc::exchange's elements a chunk
    const fc_u64 nchunk = std::max<fc_u64>(1, (largest + cap - 1) / cap);
    const fc_u32 advance = !direct ? nchunk : no_direct ? 1 + nchunk : 1;
    for (int r = 0; r < W; ++r) {
        FcParams p = g.params(r, dtype, FC_OP_SUM, 0, fp);
        for (int q = 0; q < W; ++q) {
            const fc_u64 nowhere = 0x1000 * (fc_u64)(1 + q); // an empty pair's: unmapped
            const unsigned char* from = sends == SEND_IN_PLACE    ? h->arena[r] + h->roff[r][q]
                                        : sends == SEND_OWN_BLOCK ? h->arena[r] + h->roff[r][r]
                                                                  : send[r] + h->soff[r][q];
            set(p, 0, q, c[r][q]);
            set(p, 1, q, c[r][q] ? (fc_u64)from : nowhere);
            set(p, 2, q, c[q][r]);
            set(p, 3, q, c[q][r] ? (fc_u64)(h->arena[r] + h->roff[r][q]) : nowhere + 8);
        }
        p.table = (fc_u64)g.heap[r];
        if (!(no_direct >> r & 1)) p.flags |= FC_PARAM_DIRECT_OK;
        Launch l{direct ? fc::exchange_direct : fc::exchange, p, nb, nullptr, nullptr, what};
        const unsigned char guard = (unsigned char)rng();
        l.before = [h, r, W, guard, sends] {
            unsigned char* a = h->arena[r];
            std::memset(a, guard, ARENA);
            for (int q = 0; q < W; ++q)
                if (sends == SEND_IN_PLACE || (sends == SEND_OWN_BLOCK && q == r))
                    std::memcpy(a + h->roff[r][q], h->data[r].data() + h->soff[r][q], h->c[r][q] * h->es);
        };
        l.then = [h, r, W, guard, advance](fc_u32 moved) {
            int bad = 0;
            const unsigned char* a = h->arena[r];
            for (int s = 0; s < W; ++s) {
                const size_t bytes = h->c[s][r] * h->es;
                const unsigned char* got = a + h->roff[r][s];
                const unsigned char* want = h->data[s].data() + h->soff[s][r];
                for (size_t i = 0; i < bytes; ++i)
                    if (got[i] != want[i]) {
                        std::printf("FAIL %s rank %d: block from %d: byte %zu of %zu is %02x, want %02x\n",
                                    h->what.c_str(), r, s, i, bytes, got[i], want[i]);
                        ++bad;
                        break;
                    }
            }
            for (size_t i = 0; i < ARENA; ++i)
                if (!h->in_block[r][i] && a[i] != guard) {
                    std::printf("FAIL %s rank %d: arena byte %zu, outside the receive blocks, written\n",
                                h->what.c_str(), r, i);
                    ++bad;
                    break;
                }
            if (moved != advance) {
                std::printf("FAIL %s rank %d: the epoch word moved by %u, want %u\n", h->what.c_str(), r, moved,
                            advance);
                ++bad;
            }
            return bad;
        };
        g.launches[r].push_back(l);
    }
}

template <class T>
static float to_f(T x) { return (float)x; }

// ---- reduce-to: every rank sends block q (n elements) to rank q
// (reduce-scatter), or block root to the root (reduce). The output `out_mis`
// bytes past a 4096-byte boundary, the input `in_mis` bytes (ANY: 0 in place,
// else a random multiple of the element up to 3 elements) ----
constexpr size_t ANY = ~(size_t)0;
template <class T, int OP>
static void reduce_case(Group& g, const char* what, fc_u32 dtype, size_t n, int root, bool in_place, size_t out_mis,
                        int nb, fc_u64 fp, size_t in_mis = ANY) {
    const int W = g.world;
    const int es = sizeof(typename T::S);
    typedef typename T::S S;
    std::vector<unsigned char*> in(W), out(W);
    std::vector<float> factor(W);
    for (int r = 0; r < W; ++r) {
        in[r] = alloc(W * n * es + 64) + (in_mis != ANY ? in_mis : in_place ? 0 : es * rnd(4));
        fill(in[r], W * n * es, es);
        out[r] = in_place ? in[r] + (root < 0 ? r : root) * n * es : alloc(n * es + 64) + out_mis;
        factor[r] = 0.5f + 0.25f * r;
    }
    auto elem = [&](int s, int blk, size_t i) {
        S x;
        std::memcpy(&x, in[s] + (blk * n + i) * es, es);
        return T::to_acc(x);
    };
    for (int d = 0; d < W; ++d) {
        if (root >= 0 && d != root) continue;
        std::vector<unsigned char> want(n * es);
        for (size_t i = 0; i < n; ++i) {
            typename T::Acc a = elem(0, d, i);
            if (OP == FC_OP_PREMUL) a = fc::premul_scale(a, factor[0]);
            for (int s = 1; s < W; ++s) {
                typename T::Acc x = elem(s, d, i);
                if (OP == FC_OP_PREMUL) x = fc::premul_scale(x, factor[s]);
                a = fc::Op<OP>::apply(a, x);
            }
            if (OP == FC_OP_AVG) a = fc::finish<OP>(a, fc::make_avg(W));
            const S y = T::from_acc(a);
            std::memcpy(want.data() + i * es, &y, es);
        }
        g.checks.push_back({std::string(what) + " rank " + std::to_string(d), out[d], want});
    }
    for (int r = 0; r < W; ++r) {
        FcParams p = g.params(r, dtype, OP, n, fp);
        p.output = (fc_u64)out[r];
        if (OP == FC_OP_PREMUL) p.scalar = fc_f32_as_u32(factor[r]);
        for (int q = 0; q < W; ++q) {
            if (root >= 0 && q != root) continue;
            set(p, 0, q, n);
            set(p, 1, q, (fc_u64)(in[r] + (root < 0 ? q : root) * n * es));
        }
        if (root < 0 || r == root)
            for (int s = 0; s < W; ++s) {
                set(p, 2, s, n);
                set(p, 3, s, (fc_u64)out[r]);
            }
        g.launches[r].push_back({fc::reduce_to<T, OP>, p, nb, nullptr, nullptr, what});
    }
}

// ---- reduce-to on heap inputs: fc::reduce_to_direct, or fc::reduce_to on
// the same inputs (so the two kinds' epochs and parities interleave). A
// rank's input (world blocks of n elements: block q to rank q for a
// reduce-scatter, block root for a reduce) lies in its arena, in its heap,
// or, for the ranks in `no_direct` (no FC_PARAM_DIRECT_OK), in plain memory
// outside it, so every rank falls back to the inbox reduce-to. The output is
// the rank's own block of its input (in place) or a buffer of its own with
// guard bytes around it. Before its launch a rank writes its input (peers
// read it in place, so it must not change until every reader is done: the
// next launch's rewrite comes after this launch's phase 1); right after it,
// it checks its output against the sequential reference, that every other
// input byte is unchanged (readers never write into a source), the guard
// bytes, and how far the epoch word moved: 1 the direct way, 1 + the chunk
// count on the fallback, the chunk count for fc::reduce_to. ----
struct ReduceHeapCase {
    std::string what;
    int es;
    size_t n;
    int root; // -1: reduce-scatter
    bool in_place;
    std::vector<std::vector<unsigned char>> data; // each rank's input
    std::vector<unsigned char*> in, out;
    std::vector<std::vector<unsigned char>> want; // per receiver
};

constexpr size_t GUARD = 32;

template <class T, int OP>
static void reduce_heap_case(Group& g, const char* what, bool direct, fc_u32 dtype, size_t n, int root, bool in_place,
                             bool aligned, unsigned no_direct, int nb, fc_u64 fp) {
    typedef typename T::S S;
    const int W = g.world;
    const int es = sizeof(S);
    auto h = std::make_shared<ReduceHeapCase>();
    h->what = what;
    h->es = es;
    h->n = n;
    h->root = root;
    h->in_place = in_place;
    h->data.resize(W);
    h->in.resize(W);
    h->out.resize(W);
    h->want.resize(W);
    // Element aligned, and (unless `aligned`) not 16-byte aligned: the
    // element-wise path. Aligned inputs with n * es a multiple of 16 take
    // the vector path for every piece.
    auto mis = [&] { return aligned ? (size_t)0 : (size_t)es * (1 + rnd(16 / es - 1)); };
    std::vector<float> factor(W);
    for (int r = 0; r < W; ++r) {
        const size_t bytes = (size_t)W * n * es;
        if (bytes + 16 > ARENA) std::abort();
        const bool out = no_direct >> r & 1;
        h->in[r] = (out ? g.outside[r] : g.heap[r] + HEAP_SYNC + 1024 * r) + mis();
        h->data[r].resize(bytes);
        fill(h->data[r].data(), bytes, es);
        const int own = root < 0 ? r : root;
        h->out[r] = in_place ? h->in[r] + own * n * es : alloc(n * es + 2 * GUARD) + GUARD + mis();
        factor[r] = 0.5f + 0.25f * r;
    }
    auto elem = [&](int s, int blk, size_t i) {
        S x;
        std::memcpy(&x, h->data[s].data() + (blk * n + i) * es, es);
        return T::to_acc(x);
    };
    for (int d = 0; d < W; ++d) {
        if (root >= 0 && d != root) continue;
        h->want[d].resize(n * es);
        for (size_t i = 0; i < n; ++i) {
            typename T::Acc a = elem(0, d, i);
            if (OP == FC_OP_PREMUL) a = fc::premul_scale(a, factor[0]);
            for (int s = 1; s < W; ++s) {
                typename T::Acc x = elem(s, d, i);
                if (OP == FC_OP_PREMUL) x = fc::premul_scale(x, factor[s]);
                a = fc::Op<OP>::apply(a, x);
            }
            if (OP == FC_OP_AVG) a = fc::finish<OP>(a, fc::make_avg(W));
            const S y = T::from_acc(a);
            std::memcpy(h->want[d].data() + i * es, &y, es);
        }
    }
    const fc_u64 cap = ((g.slot / W) & ~(fc_u64)63) / es; // fc::reduce_to's elements a chunk
    const fc_u64 nchunk = std::max<fc_u64>(1, (n + cap - 1) / cap);
    const fc_u32 advance = !direct ? nchunk : no_direct ? 1 + nchunk : 1;
    for (int r = 0; r < W; ++r) {
        FcParams p = g.params(r, dtype, OP, n, fp);
        p.output = (fc_u64)h->out[r];
        if (OP == FC_OP_PREMUL) p.scalar = fc_f32_as_u32(factor[r]);
        for (int q = 0; q < W; ++q) {
            if (root >= 0 && q != root) continue;
            set(p, 0, q, n);
            set(p, 1, q, (fc_u64)(h->in[r] + (root < 0 ? q : root) * n * es));
        }
        const bool receives = root < 0 || r == root;
        if (receives)
            for (int s = 0; s < W; ++s) {
                set(p, 2, s, n);
                set(p, 3, s, (fc_u64)h->out[r]);
            }
        p.table = (fc_u64)g.heap[r];
        if (!(no_direct >> r & 1)) p.flags |= FC_PARAM_DIRECT_OK;
        Launch l{direct ? fc::reduce_to_direct<T, OP> : fc::reduce_to<T, OP>, p, nb, nullptr, nullptr, what};
        const unsigned char guard = (unsigned char)rng();
        l.before = [h, r, guard] {
            std::memcpy(h->in[r], h->data[r].data(), h->data[r].size());
            if (!h->in_place) std::memset(h->out[r] - GUARD, guard, h->n * h->es + 2 * GUARD);
        };
        l.then = [h, r, guard, advance, receives](fc_u32 moved) {
            int bad = 0;
            const size_t bytes = h->n * h->es;
            if (receives)
                for (size_t i = 0; i < bytes; ++i)
                    if (h->out[r][i] != h->want[r][i]) {
                        std::printf("FAIL %s rank %d: output byte %zu of %zu is %02x, want %02x\n", h->what.c_str(), r,
                                    i, bytes, h->out[r][i], h->want[r][i]);
                        ++bad;
                        break;
                    }
            const size_t own = (size_t)(h->root < 0 ? r : h->root) * bytes;
            for (size_t i = 0; i < h->data[r].size(); ++i) {
                if (h->in_place && receives && i >= own && i < own + bytes) continue;
                if (h->in[r][i] != h->data[r][i]) {
                    std::printf("FAIL %s rank %d: input byte %zu written\n", h->what.c_str(), r, i);
                    ++bad;
                    break;
                }
            }
            // Around the output (and all of it on a rank that receives nothing).
            if (!h->in_place)
                for (size_t i = 0; i < bytes + 2 * GUARD; ++i) {
                    const bool inside = i >= GUARD && i < GUARD + bytes;
                    if ((!inside || !receives) && h->out[r][(ptrdiff_t)i - (ptrdiff_t)GUARD] != guard) {
                        std::printf("FAIL %s rank %d: output byte %td, outside what it receives, written\n",
                                    h->what.c_str(), r, (ptrdiff_t)i - (ptrdiff_t)GUARD);
                        ++bad;
                        break;
                    }
                }
            if (moved != advance) {
                std::printf("FAIL %s rank %d: the epoch word moved by %u, want %u\n", h->what.c_str(), r, moved,
                            advance);
                ++bad;
            }
            return bad;
        };
        g.launches[r].push_back(l);
    }
}

// ---- The LL kinds: fc::exchange_ll, fc::reduce_to_ll and fc::oneshot_ll
// (whose LL area, records and lines, the first two share). One epoch a
// launch, no chunks, and the host's contract (comm::collectives::takes_ll):
// every non-empty pair carries exactly n = p.count elements, n * es at most
// ll_stride / 2, the same grid on every rank, no premul_sum. Each case gives
// every rank one buffer holding all the launch may touch: its send blocks
// (or input) and its receive blocks (or output), apart, with guard bytes
// between them (at least one, so an overrun by a byte shows) and around
// them (placed as a Place says): each 16-byte aligned, or only element
// aligned (then never 4-byte aligned for 1- and 2-byte elements: the byte
// paths of load_line and store_line), or at a given byte offset from a
// 16-byte boundary, for the exchange and the reduce-to one that need not be
// a multiple of the element (reduce-scatter and reduce take tensors at any
// byte offset, and the exchange moves bytes; the all-reduce's host stages
// such tensors first). The prelude aborts on an access the GPU would fault
// on (an element load or store at an address not a multiple of its size).
// Before its launch a rank writes the buffer's image: a fresh
// guard byte everywhere, its send data at its send blocks. Right after it,
// before its next launch, it compares the whole buffer with what it must
// hold: the image with each receive block replaced by the sequential
// reference (an in-place block holds its own send data, which is what it
// receives). One pass checks the output, that nothing outside the receive
// blocks was written (send data included), and, for a launch that must
// fail, that nothing was written at all. The epoch word must move by exactly
// 1 (by 0 on a failure: the block exits before complete). Empty pairs carry
// unmapped addresses. ----
struct LLBlock {
    size_t off, bytes;
    std::string name;
};

struct LLCase {
    std::string what;
    bool fails = false; // set by a failure test: nothing may be written
    std::vector<unsigned char*> mem;
    std::vector<std::vector<unsigned char>> image, want;
    std::vector<std::vector<LLBlock>> blocks; // per rank: its receive blocks, for messages
};

// Bytes each source's LL lines carry (fc::ll_stride / 2): the largest n * es.
static fc_u64 ll_cap_bytes(const Group& g) { return (((g.slot / 2) / g.world) & ~(fc_u64)63) / 2; }

// Where a case places its blocks, as a byte offset from a 16-byte boundary
// (0: aligned, the vector-friendly case), or ELEM: a random one that is a
// multiple of the element but not of 16 (nor of 4 when es < 4). `in`: send
// blocks (or input), `out`: receive blocks (or output). A bool is the older
// choice: true 16-byte aligned, false ELEM for both.
struct Place {
    static constexpr int ELEM = -1;
    int in, out;
    Place(bool aligned) : in(aligned ? 0 : ELEM), out(in) {}
    Place(int in_at, int out_at) : in(in_at), out(out_at) {}
};

// Places blocks one after another, each at offset `mis` (Place) from a
// 16-byte boundary, then a gap.
struct LLLayout {
    size_t at = GUARD;
    size_t put(size_t bytes, int es, int mis) {
        size_t off = (at + 15) & ~(size_t)15;
        if (mis == Place::ELEM) {
            std::vector<size_t> ks;
            for (size_t k = es; k < 16; k += es)
                if (es >= 4 || k % 4 != 0) ks.push_back(k);
            off += ks[rnd(ks.size())];
        } else {
            if (mis < 0 || mis > 15) std::abort();
            off += mis;
        }
        at = off + bytes + 1 + rnd(24);
        return off;
    }
    size_t size() const { return at + GUARD; }
};

static void ll_launch(Group& g, std::shared_ptr<LLCase> h, Kernel k, int r, const FcParams& p, int nb) {
    Launch l{k, p, nb, nullptr, nullptr, h->what};
    l.before = [h, r] { std::memcpy(h->mem[r], h->image[r].data(), h->image[r].size()); };
    l.then = [h, r](fc_u32 moved) {
        int bad = 0;
        const unsigned char* got = h->mem[r];
        const std::vector<unsigned char>& want = h->fails ? h->image[r] : h->want[r];
        for (size_t i = 0; i < want.size(); ++i)
            if (got[i] != want[i]) {
                std::string where = "outside the receive blocks";
                for (auto& b : h->blocks[r])
                    if (i >= b.off && i < b.off + b.bytes)
                        where = b.name + ", byte " + std::to_string(i - b.off) + " of " + std::to_string(b.bytes);
                std::printf("FAIL %s rank %d: %s (buffer byte %zu) is %02x, want %02x%s\n", h->what.c_str(), r,
                            where.c_str(), i, got[i], want[i], h->fails ? " (a failed launch writes nothing)" : "");
                ++bad;
                break;
            }
        const fc_u32 advance = h->fails ? 0 : 1;
        if (moved != advance) {
            std::printf("FAIL %s rank %d: the epoch word moved by %u, want %u\n", h->what.c_str(), r, moved, advance);
            ++bad;
        }
        return bad;
    };
    g.launches[r].push_back(l);
}

static std::shared_ptr<LLCase> ll_new(const Group& g, const char* what) {
    auto h = std::make_shared<LLCase>();
    h->what = what;
    h->mem.resize(g.world);
    h->image.resize(g.world);
    h->want.resize(g.world);
    h->blocks.resize(g.world);
    return h;
}

// Allocates rank r's buffer of `size` bytes, its image all one guard byte.
static void ll_buffer(LLCase& h, int r, size_t size) {
    h.mem[r] = alloc(size);
    h.image[r].assign(size, (unsigned char)rng());
}

// The reduction rule over every source's block (src[s]: n elements), as the
// reduce cases' reference: to_acc, combine in rank order, avg at the end.
template <class T, int OP>
static std::vector<unsigned char> ll_reference(const std::vector<const unsigned char*>& src, size_t n) {
    typedef typename T::S S;
    const int es = sizeof(S);
    const int W = (int)src.size();
    auto elem = [&](int s, size_t i) {
        S x;
        std::memcpy(&x, src[s] + i * es, es);
        return T::to_acc(x);
    };
    std::vector<unsigned char> out(n * es);
    for (size_t i = 0; i < n; ++i) {
        typename T::Acc a = elem(0, i);
        for (int s = 1; s < W; ++s) a = fc::Op<OP>::apply(a, elem(s, i));
        if (OP == FC_OP_AVG) a = fc::finish<OP>(a, fc::make_avg(W));
        const S y = T::from_acc(a);
        std::memcpy(out.data() + i * es, &y, es);
    }
    return out;
}

// ---- fc::exchange_ll: every rank sends n elements to every rank (an
// all-gather: one send buffer for all, or in place: its own receive block),
// every rank to `root` (gather), or `root` block q of one buffer to rank q
// (scatter). In place, the root's own block is its send block (gather: its
// receive block from itself, which it sends; scatter: block root of its send
// buffer, which it receives). ----
enum LLSends { LL_ALL_GATHER, LL_GATHER, LL_SCATTER };

static std::shared_ptr<LLCase> ll_exchange_case(Group& g, const char* what, fc_u32 dtype, int es, LLSends kind,
                                                int root, size_t n, bool in_place, Place at, int nb, fc_u64 fp) {
    const int W = g.world;
    const size_t bytes = n * es;
    if (n == 0 || bytes > ll_cap_bytes(g)) std::abort(); // outside the host's contract
    auto h = ll_new(g, what);
    std::vector<std::vector<char>> c(W, std::vector<char>(W)); // c[s][d]: s sends d n elements
    for (int s = 0; s < W; ++s)
        for (int d = 0; d < W; ++d)
            c[s][d] = kind == LL_ALL_GATHER || (kind == LL_GATHER && d == root) || (kind == LL_SCATTER && s == root);
    // soff[s][d]: bytes into s's buffer of its block to d; roff[d][s]: of d's block from s.
    std::vector<std::vector<size_t>> soff(W, std::vector<size_t>(W, 0)), roff = soff;
    for (int r = 0; r < W; ++r) {
        LLLayout L;
        const bool own_in_place = in_place && c[r][r];
        for (int s = 0; s < W; ++s)
            if (c[s][r] && !(own_in_place && kind == LL_SCATTER && s == r)) roff[r][s] = L.put(bytes, es, at.out);
        size_t send_bytes = 0, base = 0;
        if (kind == LL_ALL_GATHER || kind == LL_GATHER) {
            send_bytes = bytes;
            base = own_in_place ? roff[r][r] : L.put(bytes, es, at.in);
        } else if (r == root) {
            send_bytes = (size_t)W * bytes; // one buffer, block q at q * bytes
            base = L.put(send_bytes, es, at.in);
        }
        for (int q = 0; q < W; ++q)
            if (c[r][q]) soff[r][q] = kind == LL_SCATTER ? base + q * bytes : base;
        if (own_in_place && kind == LL_SCATTER) roff[r][r] = soff[r][r];
        ll_buffer(*h, r, L.size());
        fill(h->image[r].data() + base, send_bytes, es);
        for (int s = 0; s < W; ++s)
            if (c[s][r])
                h->blocks[r].push_back({roff[r][s], bytes, "receive block from " + std::to_string(s)});
    }
    for (int d = 0; d < W; ++d) {
        h->want[d] = h->image[d];
        for (int s = 0; s < W; ++s)
            if (c[s][d]) std::memcpy(h->want[d].data() + roff[d][s], h->image[s].data() + soff[s][d], bytes);
    }
    for (int r = 0; r < W; ++r) {
        FcParams p = g.params(r, dtype, FC_OP_SUM, n, fp);
        for (int q = 0; q < W; ++q) {
            const fc_u64 nowhere = 0x1000 * (fc_u64)(1 + q); // an empty pair's: unmapped
            set(p, 0, q, c[r][q] ? n : 0);
            set(p, 1, q, c[r][q] ? (fc_u64)(h->mem[r] + soff[r][q]) : nowhere);
            set(p, 2, q, c[q][r] ? n : 0);
            set(p, 3, q, c[q][r] ? (fc_u64)(h->mem[r] + roff[r][q]) : nowhere + 8);
        }
        ll_launch(g, h, fc::exchange_ll, r, p, nb);
    }
    return h;
}

// ---- fc::reduce_to_ll<T, OP>: a reduce-scatter (input: world blocks of n,
// block q to rank q) or a reduce to `root` (input: one block of n). Every
// rank has an output, the root's only is written (non-roots: guard bytes
// that must stay); in place it is the rank's own block of its input (a
// non-root's output is its input, which it must not write either). ----
template <class T, int OP>
static std::shared_ptr<LLCase> ll_reduce_case(Group& g, const char* what, fc_u32 dtype, size_t n, int root,
                                              bool in_place, Place at, int nb, fc_u64 fp) {
    static_assert(OP != FC_OP_PREMUL, "the LL reduce-to takes no premul_sum");
    const int W = g.world;
    const int es = sizeof(typename T::S);
    const size_t bytes = n * es;
    if (n == 0 || bytes > ll_cap_bytes(g)) std::abort();
    auto h = ll_new(g, what);
    const size_t nin = root < 0 ? (size_t)W : 1; // blocks of input
    std::vector<size_t> in(W), out(W);
    for (int r = 0; r < W; ++r) {
        LLLayout L;
        in[r] = L.put(nin * bytes, es, at.in);
        out[r] = in_place ? in[r] + (root < 0 ? r : 0) * bytes : L.put(bytes, es, at.out);
        ll_buffer(*h, r, L.size());
        fill(h->image[r].data() + in[r], nin * bytes, es);
        if (root < 0 || r == root) h->blocks[r].push_back({out[r], bytes, "output"});
    }
    for (int d = 0; d < W; ++d) {
        h->want[d] = h->image[d];
        if (root >= 0 && d != root) continue;
        std::vector<const unsigned char*> src(W);
        for (int s = 0; s < W; ++s) src[s] = h->image[s].data() + in[s] + (root < 0 ? d : 0) * bytes;
        const std::vector<unsigned char> y = ll_reference<T, OP>(src, n);
        std::memcpy(h->want[d].data() + out[d], y.data(), bytes);
    }
    for (int r = 0; r < W; ++r) {
        FcParams p = g.params(r, dtype, OP, n, fp);
        p.output = (fc_u64)(h->mem[r] + out[r]);
        const bool receives = root < 0 || r == root;
        for (int q = 0; q < W; ++q) {
            const fc_u64 nowhere = 0x1000 * (fc_u64)(1 + q);
            const bool sends = root < 0 || q == root;
            set(p, 0, q, sends ? n : 0);
            set(p, 1, q, sends ? (fc_u64)(h->mem[r] + in[r] + (root < 0 ? q : 0) * bytes) : nowhere);
            set(p, 2, q, receives ? n : 0);
            set(p, 3, q, receives ? p.output : nowhere + 8);
        }
        ll_launch(g, h, fc::reduce_to_ll<T, OP>, r, p, nb);
    }
    return h;
}

// ---- fc::oneshot_ll<T, OP>: an all-reduce of n elements (in place: the
// output is the input), between the LL exchanges and reduce-tos on the same
// LL area; or (`pull`) fc::oneshot, on the parity regions, checked alike. ----
template <class T, int OP>
static void ll_allreduce_case(Group& g, const char* what, fc_u32 dtype, size_t n, bool in_place, bool aligned, int nb,
                              fc_u64 fp, bool pull = false) {
    const int W = g.world;
    const int es = sizeof(typename T::S);
    const size_t bytes = n * es;
    if (n == 0 || bytes > (pull ? g.slot : ll_cap_bytes(g))) std::abort();
    auto h = ll_new(g, what);
    std::vector<size_t> in(W), out(W);
    for (int r = 0; r < W; ++r) {
        LLLayout L;
        in[r] = L.put(bytes, es, aligned ? 0 : Place::ELEM);
        out[r] = in_place ? in[r] : L.put(bytes, es, aligned ? 0 : Place::ELEM);
        ll_buffer(*h, r, L.size());
        fill(h->image[r].data() + in[r], bytes, es);
        h->blocks[r].push_back({out[r], bytes, "output"});
    }
    std::vector<const unsigned char*> src(W);
    for (int s = 0; s < W; ++s) src[s] = h->image[s].data() + in[s];
    const std::vector<unsigned char> y = ll_reference<T, OP>(src, n);
    for (int r = 0; r < W; ++r) {
        h->want[r] = h->image[r];
        std::memcpy(h->want[r].data() + out[r], y.data(), bytes);
        FcParams p = g.params(r, dtype, OP, n, fp);
        p.input = (fc_u64)(h->mem[r] + in[r]);
        p.output = (fc_u64)(h->mem[r] + out[r]);
        ll_launch(g, h, pull ? fc::oneshot<T, OP> : fc::oneshot_ll<T, OP>, r, p, nb);
    }
}

// A failure test's outcome: every rank in `expect` (mask) raised `code`
// naming a peer in its allowed set (mismatch: err[2] = 1 + the peer; timeout:
// err[1] = exactly the ranks given), at epoch 1; the others raised nothing.
struct LLErr {
    fc_u32 code;
    fc_u32 mask;        // timeout: err[1]
    unsigned named = 0; // mismatch: the peers err[2] may name (bit s)
};

static int ll_failure(Group& g, const char* what, const std::vector<LLErr>& expect) {
    int bad = g.late.load();
    for (int r = 0; r < g.world; ++r) {
        const fc_u32* e = g.err[r];
        const LLErr& x = expect[r];
        bool ok;
        if (x.code == FC_ERR_CODE_NONE)
            ok = e[0] == 0 && e[1] == 0 && e[2] == 0 && e[3] == 0;
        else if (x.code == FC_ERR_CODE_TIMEOUT)
            ok = e[0] == x.code && e[1] == x.mask && e[2] == 0 && e[3] == 1;
        else
            ok = e[0] == x.code && e[1] == 0 && e[2] >= 1 && (x.named >> (e[2] - 1) & 1) && e[3] == 1;
        std::printf("%s: rank %d error words %u %#x %u %u (%s)\n", what, r, e[0], e[1], e[2], e[3], ok ? "ok" : "FAIL");
        bad += !ok;
    }
    return bad;
}

static int verify(Group& g) {
    int bad = g.late.load();
    for (auto& c : g.checks) {
        size_t first = c.want.size();
        for (size_t i = 0; i < c.want.size(); ++i)
            if (c.got[i] != c.want[i]) {
                first = i;
                break;
            }
        if (first < c.want.size()) {
            std::printf("FAIL %s: first differing byte %zu of %zu (got %02x %02x, want %02x %02x)\n", c.what.c_str(),
                        first, c.want.size(), c.got[first & ~1], c.got[first | 1], c.want[first & ~1],
                        c.want[first | 1]);
            ++bad;
        }
    }
    for (int r = 0; r < g.world; ++r)
        if (g.err[r][0] != 0) {
            std::printf("FAIL rank %d error words %u %u %u %u\n", r, g.err[r][0], g.err[r][1], g.err[r][2],
                        g.err[r][3]);
            ++bad;
        }
    return bad;
}

int main(int argc, char** argv) {
    if (argc > 1) rng.seed(std::strtoull(argv[1], nullptr, 10));
    int bad = 0;
    for (int W : {2, 3, 4}) {
        if (W > emu_max_world()) continue;
        Group g(W, 8192); // inboxes of (8192 / W) & ~63 bytes: several chunks a call
        const int nb = W == 3 ? 3 : 2, nt = 32;
        // All-to-all-v, f32 elements, random splits with zeros, unaligned buffers.
        std::vector<std::vector<size_t>> c(W, std::vector<size_t>(W));
        for (auto& row : c)
            for (auto& x : row) x = rnd(3) == 0 ? 0 : rnd(1500);
        exchange_case(g, "all_to_all_v f32", FC_DTYPE_F32, 4, c, false, nb, 1);
        // Bytes (u8), odd counts and byte offsets.
        for (auto& row : c)
            for (auto& x : row) x = rnd(5000);
        exchange_case(g, "all_to_all_v u8", 5, 1, c, false, nb, 2);
        // In place, equal splits (i32).
        for (auto& row : c)
            for (auto& x : row) x = 777;
        exchange_case(g, "all_to_all in place i32", FC_DTYPE_I32, 4, c, true, nb, 3);
        // All-gather (f16 payload moved as bytes): everyone sends n to everyone.
        for (auto& row : c)
            for (auto& x : row) x = 1001;
        exchange_case(g, "all_gather f16", FC_DTYPE_F16, 2, c, false, nb, 4);
        // Gather to rank 1 (f64-sized elements).
        for (int s = 0; s < W; ++s)
            for (int d = 0; d < W; ++d) c[s][d] = d == 1 ? 333 : 0;
        exchange_case(g, "gather f64", 7, 8, c, false, nb, 5);
        // Nothing at all (one chunk, nothing moved).
        for (auto& row : c)
            for (auto& x : row) x = 0;
        exchange_case(g, "empty", FC_DTYPE_F32, 4, c, false, nb, 6);
        // A direct exchange between the inbox kinds (its epoch, then the reduce-to's).
        for (auto& row : c)
            for (auto& x : row) x = 1203;
        heap_case(g, "direct all_to_all f16", true, FC_DTYPE_F16, 2, c, SEND_BLOCKS, false, 0, nb, 14);

        reduce_case<fc::TF32, FC_OP_SUM>(g, "reduce_scatter f32 sum", FC_DTYPE_F32, 1999, -1, false, 0, nb, 7);
        reduce_case<fc::TF32, FC_OP_AVG>(g, "reduce_scatter f32 avg in place", FC_DTYPE_F32, 1003, -1, true, 0, nb, 8);
        reduce_case<fc::TBF16, FC_OP_SUM>(g, "reduce_scatter bf16 sum", FC_DTYPE_BF16, 2501, -1, false, 2, nb, 9);
        reduce_case<fc::TF16, FC_OP_MAX>(g, "reduce_scatter f16 max", FC_DTYPE_F16, 999, -1, false, 6, nb, 10);
        reduce_case<fc::TI32, FC_OP_SUM>(g, "reduce i32 sum to 0 in place", FC_DTYPE_I32, 3000, 0, true, 0, nb, 11);
        reduce_case<fc::TF32, FC_OP_PREMUL>(g, "reduce_scatter f32 premul", FC_DTYPE_F32, 1500, -1, false, 8, nb, 12);
        reduce_case<fc::TF32, FC_OP_SUM>(g, "reduce f32 to last, output not element aligned", FC_DTYPE_F32, 2222,
                                          W - 1, false, 2, nb, 13);
        // Inputs not aligned to their element either (the host passes
        // reduce-scatter and reduce tensors at any byte offset).
        reduce_case<fc::TF32, FC_OP_SUM>(g, "reduce_scatter f32 sum, input +1, output +3", FC_DTYPE_F32, 1201, -1,
                                          false, 3, nb, 15, 1);
        reduce_case<fc::TBF16, FC_OP_SUM>(g, "reduce_scatter bf16 sum in place at +1", FC_DTYPE_BF16, 1501, -1, true,
                                           0, nb, 16, 1);
        reduce_case<fc::TF32, FC_OP_MAX>(g, "reduce f32 max to 0 in place at +2", FC_DTYPE_F32, 1999, 0, true, 0, nb,
                                          17, 2);
        g.run(nt);
        const int b = verify(g);
        std::printf("world %d: %zu checks, %d failed\n", W, g.checks.size(), b);
        bad += b;
    }
    for (int W : {2, 3, 4}) {
        if (W > emu_max_world()) continue;
        // Direct and inbox exchanges into the same heap blocks, back to back:
        // epoch advances of 1, chunk counts and 1 + chunk counts, so each kind
        // starts on either parity after the other. Grids differ per launch
        // (the same on every rank), sizes are not multiples of 16 bytes except
        // where noted.
        Group g(W, 8192); // inboxes of (8192 / W) & ~63 bytes
        std::vector<std::vector<size_t>> c(W, std::vector<size_t>(W));
        auto all = [&](size_t n) {
            for (auto& row : c)
                for (auto& x : row) x = n;
        };
        const unsigned last = 1u << (W - 1), every = (1u << W) - 1;
        all(1001);
        heap_case(g, "direct all_to_all f32, aligned", true, FC_DTYPE_F32, 4, c, SEND_BLOCKS, true, 0, 2, 21);
        all(2999);
        heap_case(g, "inbox all_to_all u8 into the heap", false, 5, 1, c, SEND_BLOCKS, false, 0, 3, 22);
        all(3333);
        heap_case(g, "direct all_gather u8", true, 5, 1, c, SEND_ONE, false, 0, 4, 23);
        all(777);
        heap_case(g, "direct all_gather in place f16", true, FC_DTYPE_F16, 2, c, SEND_OWN_BLOCK, false, 0, 1, 24);
        heap_case(g, "direct all_gather in place f16, again", true, FC_DTYPE_F16, 2, c, SEND_OWN_BLOCK, true, 0, 3, 25);
        all(1500); // several chunks on the fallback
        heap_case(g, "fallback all_to_all f32: last rank's blocks outside its heap", true, FC_DTYPE_F32, 4, c,
                  SEND_BLOCKS, false, last, 3, 26);
        for (int s = 0; s < W; ++s)
            for (int d = 0; d < W; ++d) c[s][d] = d == 1 ? 333 : 0;
        heap_case(g, "direct gather to 1 f64", true, 7, 8, c, SEND_BLOCKS, false, 0, 2, 27);
        all(2500); // more than a slot: no chunks the direct way (16-byte multiples)
        heap_case(g, "direct all_to_all bf16, aligned", true, FC_DTYPE_BF16, 2, c, SEND_BLOCKS, true, 0, 4, 28);
        all(301);
        heap_case(g, "fallback all_to_all in place i32 (never direct)", true, FC_DTYPE_I32, 4, c, SEND_IN_PLACE, false,
                  every, 2, 29);
        all(200);
        heap_case(g, "inbox all_gather f32, aligned", false, FC_DTYPE_F32, 4, c, SEND_ONE, true, 0, 1, 30);
        all(55);
        heap_case(g, "fallback all_gather u8: rank 0 outside its heap", true, 5, 1, c, SEND_ONE, false, 1, 2, 31);
        all(0);
        heap_case(g, "direct empty", true, FC_DTYPE_F32, 4, c, SEND_BLOCKS, false, 0, 3, 32);
        all(4097);
        heap_case(g, "direct all_to_all u8", true, 5, 1, c, SEND_BLOCKS, false, 0, 3, 33);
        heap_case(g, "fallback all_to_all u8: last rank outside", true, 5, 1, c, SEND_BLOCKS, false, last, 1, 34);
        heap_case(g, "direct all_to_all u8, again", true, 5, 1, c, SEND_BLOCKS, false, 0, 2, 35);
        heap_case(g, "inbox all_to_all u8, again", false, 5, 1, c, SEND_BLOCKS, false, 0, 4, 36);
        heap_case(g, "direct all_to_all u8, last", true, 5, 1, c, SEND_BLOCKS, false, 0, 1, 37);
        g.run(32);
        const int b = verify(g);
        std::printf("heap exchanges, world %d: %zu launches a rank, %d failed\n", W, g.launches[0].size(), b);
        bad += b;
    }
    for (int W : {2, 3, 4}) {
        if (W > emu_max_world()) continue;
        // Direct and inbox reduce-tos on the same heap inputs, back to back
        // (epoch advances of 1, chunk counts and 1 + chunk counts, so each
        // kind starts on either parity after the other), interleaved with a
        // direct exchange. Counts are odd unless noted; grids differ per
        // launch (the same on every rank).
        Group g(W, 8192); // inboxes of (8192 / W) & ~63 bytes: fallbacks of several chunks
        const unsigned last = 1u << (W - 1), first = 1;
        const size_t big = 9000 / W; // f32: W * big * 4 bytes fit an arena
        reduce_heap_case<fc::TF32, FC_OP_SUM>(g, "direct reduce_scatter f32 sum", true, FC_DTYPE_F32, big + 1, -1,
                                              false, false, 0, 2, 41);
        reduce_heap_case<fc::TF32, FC_OP_SUM>(g, "direct reduce_scatter f32 sum, aligned", true, FC_DTYPE_F32, 1024,
                                              -1, false, true, 0, 3, 42);
        reduce_heap_case<fc::TF32, FC_OP_AVG>(g, "direct reduce_scatter f32 avg in place", true, FC_DTYPE_F32, big - 3,
                                              -1, true, false, 0, 4, 43);
        reduce_heap_case<fc::TBF16, FC_OP_SUM>(g, "inbox reduce_scatter bf16 on heap inputs", false, FC_DTYPE_BF16,
                                               2 * big + 1, -1, false, false, 0, 2, 44);
        reduce_heap_case<fc::TBF16, FC_OP_SUM>(g, "direct reduce_scatter bf16, aligned", true, FC_DTYPE_BF16, 2048, -1,
                                               false, true, 0, 1, 45);
        reduce_heap_case<fc::TF16, FC_OP_MAX>(g, "fallback reduce_scatter f16 max: last rank outside its heap", true,
                                              FC_DTYPE_F16, 2 * big - 1, -1, false, false, last, 3, 46);
        reduce_heap_case<fc::TI32, FC_OP_SUM>(g, "direct reduce i32 sum to 0 in place", true, FC_DTYPE_I32, big + 3, 0,
                                              true, false, 0, 2, 47);
        reduce_heap_case<fc::TF32, FC_OP_PREMUL>(g, "direct reduce_scatter f32 premul", true, FC_DTYPE_F32, big, -1,
                                                 false, false, 0, 4, 48);
        reduce_heap_case<fc::TF32, FC_OP_PREMUL>(g, "direct reduce_scatter f32 premul, aligned in place", true,
                                                 FC_DTYPE_F32, 1024, -1, true, true, 0, 2, 49);
        std::vector<std::vector<size_t>> c(W, std::vector<size_t>(W, 1001));
        heap_case(g, "direct all_to_all f32 between reduce-tos", true, FC_DTYPE_F32, 4, c, SEND_BLOCKS, false, 0, 3, 50);
        reduce_heap_case<fc::TI32, FC_OP_BXOR>(g, "fallback reduce i32 bxor to last: rank 0 outside", true,
                                               FC_DTYPE_I32, big, W - 1, false, false, first, 2, 51);
        reduce_heap_case<fc::TF32, FC_OP_MIN>(g, "direct reduce f32 min to 1, aligned", true, FC_DTYPE_F32, 1024, 1,
                                              false, true, 0, 3, 52);
        reduce_heap_case<fc::TF32, FC_OP_SUM>(g, "direct reduce_scatter f32 sum, one element", true, FC_DTYPE_F32, 1,
                                              -1, false, false, 0, 2, 53);
        reduce_heap_case<fc::TF32, FC_OP_SUM>(g, "direct reduce_scatter f32, nothing", true, FC_DTYPE_F32, 0, -1,
                                              false, false, 0, 1, 54);
        reduce_heap_case<fc::TF32, FC_OP_SUM>(g, "inbox reduce_scatter f32, again", false, FC_DTYPE_F32, big + 1, -1,
                                              false, false, 0, 3, 55);
        reduce_heap_case<fc::TF32, FC_OP_SUM>(g, "direct reduce_scatter f32, last", true, FC_DTYPE_F32, big + 1, -1,
                                              false, false, 0, 2, 56);
        g.run(32);
        const int b = verify(g);
        std::printf("heap reduce-tos, world %d: %zu launches a rank, %d failed\n", W, g.launches[0].size(), b);
        bad += b;
    }
    {
        // A count mismatch: rank 0 expects 10 elements from rank 1, which sends 12.
        Group g(2, 8192);
        std::vector<std::vector<size_t>> c = {{5, 10}, {12, 5}};
        exchange_case(g, "mismatch", FC_DTYPE_F32, 4, c, false, 2, 1);
        g.launches[0][0].p.per_peer[2][1] = 10;
        for (auto& l : g.launches) l[0].p.timeout_ns = 200ull * 1000 * 1000;
        g.run(32);
        const bool ok = g.err[0][0] == FC_ERR_CODE_MISMATCH && g.err[0][2] == 2;
        std::printf("mismatch: rank 0 error words %u %u %u %u (%s)\n", g.err[0][0], g.err[0][1], g.err[0][2],
                    g.err[0][3], ok ? "ok" : "FAIL");
        bad += !ok;
    }
    {
        // The same, the direct way: rank 0 expects 12 elements from rank 1,
        // which sends 14. Both sides see it at phase 0 and write nothing:
        // rank 0 names rank 1, and rank 1 (the sender, which would
        // otherwise write past rank 0's block) names rank 0.
        Group g(2, 8192);
        std::vector<std::vector<size_t>> c = {{5, 12}, {12, 5}};
        heap_case(g, "direct mismatch", true, FC_DTYPE_F32, 4, c, SEND_BLOCKS, false, 0, 2, 1);
        g.launches[1][0].p.per_peer[0][0] = 14;
        for (auto& l : g.launches) {
            l[0].p.timeout_ns = 200ull * 1000 * 1000;
            l[0].then = nullptr; // no output to check
        }
        g.run(32);
        const bool ok = g.err[0][0] == FC_ERR_CODE_MISMATCH && g.err[0][2] == 2 &&
                        g.err[1][0] == FC_ERR_CODE_MISMATCH && g.err[1][2] == 1;
        std::printf("direct mismatch: rank 0 error words %u %u %u %u, rank 1 %u %u %u %u (%s)\n", g.err[0][0],
                    g.err[0][1], g.err[0][2], g.err[0][3], g.err[1][0], g.err[1][1], g.err[1][2], g.err[1][3],
                    ok ? "ok" : "FAIL");
        bad += !ok;
    }
    for (int receiver_short : {0, 1}) {
        // A count mismatch the direct reduce-to way, from either side: rank
        // 1 sends 14 elements to rank 0, which expects 12 (the source sends
        // more), or sends 12 where rank 0 expects 14 from it (the receiver
        // would read past the block). Both sides see it at phase 0 and read
        // and write nothing: rank 0 names rank 1, rank 1 names rank 0.
        Group g(2, 8192);
        reduce_heap_case<fc::TF32, FC_OP_SUM>(g, "direct reduce-to mismatch", true, FC_DTYPE_F32, 12, -1, false, false,
                                              0, 2, 1);
        if (receiver_short) {
            g.launches[0][0].p.per_peer[2][1] = 14;
        } else {
            g.launches[1][0].p.per_peer[0][0] = 14;
        }
        for (auto& l : g.launches) {
            l[0].p.timeout_ns = 200ull * 1000 * 1000;
            l[0].then = nullptr; // no output to check
        }
        g.run(32);
        const bool ok = g.err[0][0] == FC_ERR_CODE_MISMATCH && g.err[0][2] == 2 &&
                        g.err[1][0] == FC_ERR_CODE_MISMATCH && g.err[1][2] == 1;
        std::printf("direct reduce-to mismatch (%s): rank 0 error words %u %u %u %u, rank 1 %u %u %u %u (%s)\n",
                    receiver_short ? "receiver expects more" : "source sends more", g.err[0][0], g.err[0][1],
                    g.err[0][2], g.err[0][3], g.err[1][0], g.err[1][1], g.err[1][2], g.err[1][3], ok ? "ok" : "FAIL");
        bad += !ok;
    }
    for (int W : {2, 3, 4, 8}) {
        if (W > emu_max_world()) continue;
        // The LL kinds back to back: runs of LL launches (epochs E, E + 1,
        // E + 2...: E and E + 2 use one parity's LL records and lines),
        // between inbox exchanges and reduce-tos of several chunks (so the
        // next run starts on either parity), a direct exchange (one epoch),
        // one-shot LL all-reduces on the same LL area and a pull one-shot
        // on the parity regions. Grids of 1 to 4 blocks differ per launch
        // (the same on every rank); blocks of one element leave some blocks
        // nothing to move. Counts are random within their kind (odd stays
        // odd), sizes up to a source's whole LL lines.
        Group g(W, 16384); // LL lines of (8192 / W) & ~63 bytes a source: 512 (w8) to 2048 (w2) data bytes
        const int nt = W == 8 ? 16 : 32;
        emu_poll_yield = W == 8; // 8 ranks' threads on a few cores: waiters yield (emu_prelude.h)
        const size_t cap = ll_cap_bytes(g); // a multiple of 32
        const size_t odd = 2 * rnd(4);      // odd counts stay odd
        std::vector<std::vector<size_t>> c(W, std::vector<size_t>(W));
        ll_exchange_case(g, "ll all_gather u8, odd, unaligned", 5, 1, LL_ALL_GATHER, 0, cap - 1 - odd, false, false, 3,
                         0x5111000000000001ull);
        ll_exchange_case(g, "ll all_gather f16 in place, odd, unaligned", FC_DTYPE_F16, 2, LL_ALL_GATHER, 0,
                         cap / 2 - 1 - odd, true, false, 1, 0x5111000000000002ull);
        ll_exchange_case(g, "ll gather to 0 f32, aligned, full lines", FC_DTYPE_F32, 4, LL_GATHER, 0, cap / 4, false,
                         true, 2, 0x5111000000000003ull);
        ll_exchange_case(g, "ll scatter from last u8, one byte", 5, 1, LL_SCATTER, W - 1, 1, false, false, 4,
                         0x5111000000000004ull);
        for (auto& row : c)
            for (auto& x : row) x = rnd(3) == 0 ? 0 : rnd(10000 / W); // f32: up to 3 chunks
        exchange_case(g, "inbox all_to_all_v f32 between LL runs", FC_DTYPE_F32, 4, c, false, 2, 0x5111000000000005ull);
        ll_reduce_case<fc::TF32, FC_OP_SUM>(g, "ll reduce_scatter f32 sum, odd", FC_DTYPE_F32, cap / 4 - 1 - odd, -1,
                                            false, false, 2, 0x5111000000000006ull);
        ll_reduce_case<fc::TBF16, FC_OP_SUM>(g, "ll reduce_scatter bf16 sum in place, odd, unaligned", FC_DTYPE_BF16,
                                             cap / 2 - 3 - odd, -1, true, false, 3, 0x5111000000000007ull);
        reduce_case<fc::TF32, FC_OP_SUM>(g, "inbox reduce_scatter f32 sum between LL runs", FC_DTYPE_F32,
                                         (2000 + rnd(8000)) / W, -1, false, 0, 2, 0x5111000000000008ull);
        ll_allreduce_case<fc::TF32, FC_OP_SUM>(g, "oneshot_ll f32 sum", FC_DTYPE_F32, cap / 4 - 5, false, false, 2,
                                               0x5111000000000009ull);
        ll_allreduce_case<fc::TF32, FC_OP_SUM>(g, "oneshot (pull) f32 sum", FC_DTYPE_F32, 1000 + rnd(1000), false,
                                               false, 3, 0x5111000000000015ull, true);
        for (int root = 0; root < W; ++root) {
            const int nb = 1 + root % 4;
            const fc_u64 fp = 0x5111000000000100ull + root;
            const std::string to = "ll reduce to " + std::to_string(root);
            switch (root % 4) {
                case 0:
                    ll_reduce_case<fc::TF32, FC_OP_SUM>(g, (to + " f32 sum in place").c_str(), FC_DTYPE_F32,
                                                        cap / 4 - 3, root, true, false, nb, fp);
                    break;
                case 1:
                    ll_reduce_case<fc::TBF16, FC_OP_SUM>(g, (to + " bf16 sum, odd, unaligned").c_str(), FC_DTYPE_BF16,
                                                         cap / 2 - 1 - odd, root, false, false, nb, fp);
                    break;
                case 2:
                    ll_reduce_case<fc::TF32, FC_OP_MAX>(g, (to + " f32 max, aligned").c_str(), FC_DTYPE_F32, cap / 8,
                                                        root, false, true, nb, fp);
                    break;
                default:
                    ll_reduce_case<fc::TI32, FC_OP_SUM>(g, (to + " i32 sum in place, odd").c_str(), FC_DTYPE_I32,
                                                        7 + odd, root, true, false, nb, fp);
                    break;
            }
        }
        ll_reduce_case<fc::TF32, FC_OP_AVG>(g, "ll reduce_scatter f32 avg", FC_DTYPE_F32, cap / 4 - odd, -1, false,
                                            false, 2, 0x511100000000000aull);
        ll_reduce_case<fc::TF16, FC_OP_MAX>(g, "ll reduce_scatter f16 max, odd, unaligned", FC_DTYPE_F16,
                                            cap / 2 - 1 - odd, -1, false, false, 4, 0x511100000000000bull);
        ll_reduce_case<fc::TF16, FC_OP_SUM>(g, "ll reduce_scatter f16 sum in place, aligned", FC_DTYPE_F16, cap / 2,
                                            -1, true, true, 1, 0x511100000000000cull);
        ll_reduce_case<fc::TI32, FC_OP_SUM>(g, "ll reduce_scatter i32 sum in place, tiny", FC_DTYPE_I32, 5, -1, true,
                                            false, 4, 0x511100000000000dull);
        ll_reduce_case<fc::TBF16, FC_OP_AVG>(g, "ll reduce_scatter bf16 avg, one element", FC_DTYPE_BF16, 1, -1,
                                             false, false, 3, 0x511100000000000eull);
        for (auto& row : c)
            for (auto& x : row) x = 301;
        heap_case(g, "direct all_gather in place f16 between LL runs", true, FC_DTYPE_F16, 2, c, SEND_OWN_BLOCK, false,
                  0, 2, 0x511100000000000full);
        for (int root = 0; root < W; ++root) {
            const int nb = 1 + (root + 1) % 4;
            const fc_u64 fp = 0x5111000000000200ull + 2 * root;
            const int es = root % 3 == 0 ? 1 : root % 3 == 1 ? 2 : 8; // u8, bf16, f64
            const fc_u32 dt = es == 1 ? 5 : es == 2 ? FC_DTYPE_BF16 : 7;
            const size_t n = es == 8 ? cap / 8 - rnd(3) : cap / es - 1 - odd - 2 * rnd(8);
            const std::string at = std::to_string(root) + " " + std::to_string(es) + "-byte";
            ll_exchange_case(g, ("ll gather to " + at + (root % 2 ? ", in place" : "")).c_str(), dt, es, LL_GATHER,
                             root, n, root % 2, false, nb, fp);
            ll_exchange_case(g, ("ll scatter from " + at + (root % 2 ? "" : ", in place")).c_str(), dt, es,
                             LL_SCATTER, root, n, root % 2 == 0, root == 1, nb, fp + 1);
        }
        ll_exchange_case(g, "ll all_gather f64, aligned, full lines", 7, 8, LL_ALL_GATHER, 0, cap / 8, false, true, 4,
                         0x5111000000000010ull);
        ll_allreduce_case<fc::TBF16, FC_OP_SUM>(g, "oneshot_ll bf16 sum in place", FC_DTYPE_BF16, cap / 2 - 1, true,
                                                false, 1, 0x5111000000000011ull);
        for (auto& row : c)
            for (auto& x : row) x = 1001;
        exchange_case(g, "inbox all_gather f16 between LL runs", FC_DTYPE_F16, 2, c, false, 3, 0x5111000000000012ull);
        ll_exchange_case(g, "ll all_gather in place i32, aligned", FC_DTYPE_I32, 4, LL_ALL_GATHER, 0, cap / 4 - 1, true,
                         true, 2, 0x5111000000000013ull);
        ll_exchange_case(g, "ll all_gather u8, three bytes, last", 5, 1, LL_ALL_GATHER, 0, 3, false, false, 2,
                         0x5111000000000014ull);
        // Blocks at byte offsets that are not a multiple of the element
        // (Place(in, out): the offsets from a 16-byte boundary of the input
        // or send blocks and of the output or receive blocks). Reduce-scatter
        // and reduce take tensors at any byte offset (a reduce-scatter's
        // output at offset 3 made fc_reduce_to_ll_f32_sum store 4-byte words
        // there, which faults on a GPU; now ll_load_any / ll_store_any go
        // byte by byte there). Every f32 offset 1..3 and odd ones for
        // f16/bf16, on input or output or both, in place and not, whole
        // lines and a tail, reduce-scatter and reduce to each root; the
        // exchange's 2-, 4- and 8-byte elements at odd addresses.
        const size_t n4 = cap / 4 - 1 - odd, n2 = cap / 2 - 1 - odd; // odd counts: a partial last line
        ll_reduce_case<fc::TF32, FC_OP_SUM>(g, "ll reduce_scatter f32 sum, input +1, output +3", FC_DTYPE_F32, n4, -1,
                                            false, Place(1, 3), 2, 0x5111000000000300ull);
        ll_reduce_case<fc::TF32, FC_OP_SUM>(g, "ll reduce_scatter f32 sum, input aligned, output +3", FC_DTYPE_F32,
                                            cap / 4, -1, false, Place(0, 3), 3, 0x5111000000000301ull);
        ll_reduce_case<fc::TI32, FC_OP_SUM>(g, "ll reduce_scatter i32 sum, input +2, output aligned", FC_DTYPE_I32,
                                            n4, -1, false, Place(2, 0), 1, 0x5111000000000302ull);
        ll_reduce_case<fc::TF32, FC_OP_AVG>(g, "ll reduce_scatter f32 avg in place at +2", FC_DTYPE_F32, n4, -1, true,
                                            Place(2, 2), 4, 0x5111000000000303ull);
        ll_reduce_case<fc::TF32, FC_OP_MAX>(g, "ll reduce_scatter f32 max in place at +1, one element", FC_DTYPE_F32,
                                            1, -1, true, Place(1, 1), 2, 0x5111000000000304ull);
        ll_reduce_case<fc::TBF16, FC_OP_SUM>(g, "ll reduce_scatter bf16 sum, input +1, output +5", FC_DTYPE_BF16, n2,
                                             -1, false, Place(1, 5), 3, 0x5111000000000305ull);
        ll_reduce_case<fc::TF16, FC_OP_MAX>(g, "ll reduce_scatter f16 max in place at +3", FC_DTYPE_F16, n2, -1, true,
                                            Place(3, 3), 2, 0x5111000000000306ull);
        ll_reduce_case<fc::TF16, FC_OP_SUM>(g, "ll reduce_scatter f16 sum, input aligned, output +1, three elements",
                                            FC_DTYPE_F16, 3, -1, false, Place(0, 1), 1, 0x5111000000000307ull);
        for (int root = 0; root < W; ++root) {
            const int nb = 1 + (root + 2) % 4;
            const fc_u64 fp = 0x5111000000000400ull + root;
            const std::string to = "ll reduce to " + std::to_string(root);
            switch (root % 4) {
                case 0:
                    ll_reduce_case<fc::TF32, FC_OP_SUM>(g, (to + " f32 sum, input +3, output +1").c_str(),
                                                        FC_DTYPE_F32, n4, root, false, Place(3, 1), nb, fp);
                    break;
                case 1:
                    ll_reduce_case<fc::TBF16, FC_OP_SUM>(g, (to + " bf16 sum in place at +1").c_str(), FC_DTYPE_BF16,
                                                         n2, root, true, Place(1, 1), nb, fp);
                    break;
                case 2:
                    ll_reduce_case<fc::TF32, FC_OP_MAX>(g, (to + " f32 max in place at +3").c_str(), FC_DTYPE_F32,
                                                        cap / 4, root, true, Place(3, 3), nb, fp);
                    break;
                default:
                    ll_reduce_case<fc::TF16, FC_OP_AVG>(g, (to + " f16 avg, input +7, output aligned").c_str(),
                                                        FC_DTYPE_F16, n2, root, false, Place(7, 0), nb, fp);
                    break;
            }
        }
        ll_exchange_case(g, "ll all_gather f32, send +1, receive +3", FC_DTYPE_F32, 4, LL_ALL_GATHER, 0, n4, false,
                         Place(1, 3), 3, 0x5111000000000500ull);
        ll_exchange_case(g, "ll gather to last f16 in place at +1", FC_DTYPE_F16, 2, LL_GATHER, W - 1, n2, true,
                         Place(1, 1), 2, 0x5111000000000501ull);
        ll_exchange_case(g, "ll scatter from 0 f64, send +5, receive +2", 7, 8, LL_SCATTER, 0, cap / 8 - 1, false,
                         Place(5, 2), 4, 0x5111000000000502ull);
        ll_exchange_case(g, "ll all_gather in place i32 at +3", FC_DTYPE_I32, 4, LL_ALL_GATHER, 0, n4, true,
                         Place(3, 3), 1, 0x5111000000000503ull);
        g.run(nt);
        const int b = verify(g);
        std::printf("LL kinds, world %d: %zu launches a rank, %d failed\n", W, g.launches[0].size(), b);
        bad += b;
    }
    emu_poll_yield = false;
    {
        // A fingerprint mismatch on the LL way: rank 2's differs from the
        // others' in the high half only (the second unit of the record).
        // Every rank raises the mismatch (ranks 0 and 1 name rank 2; rank 2
        // names 0 or 1, whichever thread is first) and writes nothing.
        Group g(3, 16384);
        auto h = ll_exchange_case(g, "ll all_gather mismatch", 5, 1, LL_ALL_GATHER, 0, 301, false, false, 2,
                                  0x5222000000000001ull);
        h->fails = true;
        g.launches[2][0].p.fingerprint ^= 1ull << 45;
        g.run(32);
        bad += ll_failure(g, "ll exchange mismatch", {{FC_ERR_CODE_MISMATCH, 0, 4}, {FC_ERR_CODE_MISMATCH, 0, 4},
                                                      {FC_ERR_CODE_MISMATCH, 0, 3}});
    }
    {
        // The same for a reduce to rank 1, rank 0's fingerprint different in
        // the low half: the non-root sees it too (every rank awaits every
        // record), and the root writes no output.
        Group g(2, 16384);
        auto h = ll_reduce_case<fc::TF32, FC_OP_SUM>(g, "ll reduce mismatch", FC_DTYPE_F32, 77, 1, false, false, 2,
                                                     0x5222000000000002ull);
        h->fails = true;
        g.launches[0][0].p.fingerprint ^= 1ull << 3;
        g.run(32);
        bad += ll_failure(g, "ll reduce-to mismatch", {{FC_ERR_CODE_MISMATCH, 0, 2}, {FC_ERR_CODE_MISMATCH, 0, 1}});
    }
    {
        // A peer that never launches: rank 1 of a gather to rank 0. The root
        // and the other source time out on rank 1's record (short deadline),
        // naming it alone, and write nothing.
        Group g(3, 16384);
        auto h = ll_exchange_case(g, "ll gather timeout", FC_DTYPE_F16, 2, LL_GATHER, 0, 99, false, false, 2,
                                  0x5222000000000003ull);
        h->fails = true;
        g.launches[1].clear();
        for (auto& l : g.launches)
            for (auto& x : l) x.p.timeout_ns = 250ull * 1000 * 1000;
        g.run(32);
        bad += ll_failure(g, "ll exchange timeout",
                          {{FC_ERR_CODE_TIMEOUT, 2}, {FC_ERR_CODE_NONE, 0}, {FC_ERR_CODE_TIMEOUT, 2}});
    }
    {
        // The same for a reduce-scatter whose rank 0 never launches.
        Group g(3, 16384);
        auto h = ll_reduce_case<fc::TBF16, FC_OP_SUM>(g, "ll reduce_scatter timeout", FC_DTYPE_BF16, 55, -1, true,
                                                      false, 3, 0x5222000000000004ull);
        h->fails = true;
        g.launches[0].clear();
        for (auto& l : g.launches)
            for (auto& x : l) x.p.timeout_ns = 250ull * 1000 * 1000;
        g.run(32);
        bad += ll_failure(g, "ll reduce-to timeout",
                          {{FC_ERR_CODE_NONE, 0}, {FC_ERR_CODE_TIMEOUT, 1}, {FC_ERR_CODE_TIMEOUT, 1}});
    }
    std::printf("%s\n", bad ? "FAILED" : "all ok");
    return bad ? 1 : 0;
}
