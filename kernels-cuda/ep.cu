// Expert-parallel (MoE) dispatch and combine inside one node (src/ep/),
// written against the device API only, so the HIP prelude runs it unchanged.
// docs/protocol.md, "Expert-parallel dispatch and combine", is the protocol;
// src/ep/twins.rs holds the host backend's Rust twins of these kernels and
// src/ep/layout.rs the heap regions they address.
//
// Every region lives in one symmetric heap allocation per rank; a peer's copy
// is at the same offset, so a kernel names the local address and the device
// API translates it. Counters only grow (device-side epochs): graph replays
// need no host bookkeeping.
//
// Timings below: `ferrocomm-bench --ep --graph` as in BENCHMARKS.md, "EP
// dispatch + combine" (hidden 7168, top-8 of 256 experts), us a dispatch +
// combine unless said, on the machine named, each pair of builds side by
// side in one job ("Method"). The page holds the current figures; these are
// the comparisons that chose the code.
#ifndef FC_PRELUDE_INCLUDED
#include "prelude.cuh"
#endif
#ifndef FC_DEVICE_API_INCLUDED
#include "device_api.cuh"
#endif
#ifndef FC_LAMPORT_INCLUDED
#include "lamport.cuh"
#endif

#define FC_EP_PAYLOAD_BF16 0u
#define FC_EP_PAYLOAD_FP8 1u

// Flag words (u64) at FcEpArgs::flags, see src/ep/layout.rs.
#define FC_EP_FLAG_COMBINE 0u                     // [r]: blocks of rank r's plain combines that landed here
#define FC_EP_FLAG_EPOCH FC_MAX_RANKS             // this rank's dispatches so far (local)
#define FC_EP_FLAG_SEEN (FC_MAX_RANKS + 1u)       // [s]: recv_counts[s] as the last dispatch saw it (local)
#define FC_EP_FLAG_PLAIN (2u * FC_MAX_RANKS + 1u) // this rank's plain (two-kernel) combines so far (local)
#define FC_EP_FLAG_DISPATCH (2u * FC_MAX_RANKS + 2u) // [s * FC_EP_MAX_GRID + b]: block b of source s's last dispatch here
#define FC_EP_MAX_GRID 128u // the most blocks an EP launch takes (MAX_BLOCKS, src/algo/layout.rs)
#define FC_EP_FLAG_TAKEN (FC_EP_FLAG_DISPATCH + FC_MAX_RANKS * FC_EP_MAX_GRID) // low 32 bits: sum units the one-kernel combine took (local; the dispatch zeroes it)
// A dispatch flag word is epoch << FC_EP_COUNT_BITS | rows: block 0's word
// carries the rows its source sent here (other blocks' carry 0), so the
// count arrives with the signal (max_tokens_per_rank < 2^20, EpConfig).
#define FC_EP_COUNT_BITS 20u

// A copy of `EpArgs` in src/ep/mod.rs, the source of the layout: the compile
// checks assert every field's offset and size against it (src/device/abi.rs).
struct FcEpArgs {
    FcDevCtx ctx;
    fc_u64 x;            // dispatch: rows [num_tokens][row_bytes]; combine: expert_out bf16 [world*max][hidden]
    fc_u64 scales;       // dispatch, fp8: f32 [num_tokens][scale_cols]; else 0
    fc_u64 topk_idx;     // i32 [num_tokens][topk]
    fc_u64 topk_weights; // f32 [num_tokens][topk]
    fc_u64 out;          // combine: bf16 [num_tokens][hidden]
    // Heap regions (this rank's local addresses).
    fc_u64 recv_x;       // [world src][max][row_bytes]
    fc_u64 recv_scales;  // f32 [world][max][scale_cols] (fp8)
    fc_u64 recv_idx;     // i32 [world][max][topk]: local expert id, -1 elsewhere
    fc_u64 recv_weights; // f32 [world][max][topk]: 0 where the id is -1
    fc_u64 recv_src;     // i32 [world][max]: the token's index at its source
    fc_u64 recv_counts;  // i32 [FC_MAX_RANKS]: rows received from each source
    fc_u64 inbox;        // bf16 [world expert rank][max][hidden]: combine rows sent back here (Lamport packs)
    fc_u64 flags;        // u64 flag words, above
    fc_u64 slots;        // i32 [max][FC_MAX_RANKS] (local): token t's row at rank r, -1: not sent
    fc_u64 send_counts;  // i32 [FC_MAX_RANKS] (local): tokens this rank sends to each rank
    fc_u32 hidden;
    fc_u32 max_tokens;
    fc_u32 num_experts;
    fc_u32 topk;
    fc_u32 num_tokens;
    fc_u32 payload;      // FC_EP_PAYLOAD_*
    fc_u32 row_bytes;    // hidden * 2 (bf16) or hidden (fp8)
    fc_u32 scale_cols;   // hidden / 128 (fp8), else 0
    fc_u64 rank_recip;   // ceil(2^32 / per_rank), 0 when per_rank is 0 (see ExpertRanks)
    fc_u32 per_rank;     // num_experts / world
    fc_u32 pad;
};
static_assert(sizeof(FcEpArgs) == 272, "FcEpArgs must match EpArgs in src/ep/mod.rs");

namespace fc_ep {

// Warp geometry over the grid. A batch of more units than one block has
// warps, but no more than the grid has, takes warp ids round the blocks
// first (warp k of block b is k * blocks + b), so it spreads over every
// multiprocessor: filling blocks in turn left a 128-token dispatch on 56 of
// 128 blocks, each to signal after its 16 warps' puts, and a dispatch +
// combine took ~1.1 us longer (2x H200). Otherwise a block's
// warps take neighbouring units:
// - a larger batch: going round the blocks gave a block the same piece of
//   every row, so with fp8's half last piece some blocks did half the work
//   of others (4096 tokens: 288 against 281 us);
// - a batch within one block's warps stays in block 0: spread over 7
//   blocks, a 1-token bf16 batch took 0.3 us longer (2x H100).
FC_DEVICE fc_u32 warp_id(fc_u32 block, fc_u32 warp_in_block, fc_u32 blocks, fc_u32 per_block, fc_u64 units) {
    const bool spread = units > per_block && units <= (fc_u64)blocks * per_block;
    return spread ? warp_in_block * blocks + block : block * per_block + warp_in_block;
}
struct Warps {
    fc_u32 lane, id, count;
};
// For a kernel of `units` units over the whole grid.
FC_DEVICE Warps grid_warps(fc_u64 units) {
    const fc_u32 ws = fc_warp_size();
    const fc_u32 per_block = (fc_block_threads() + ws - 1u) / ws;
    Warps w;
    w.lane = fc_lane_id();
    w.id = warp_id(fc_block_id(), fc_thread_id() / ws, fc_grid_blocks(), per_block, units);
    w.count = fc_grid_blocks() * per_block;
    return w;
}

FC_DEVICE fc_u64* flag_words(const FcEpArgs& a) { return fc_ptr<fc_u64>(a.flags); }

// Every EP kernel's first step. The host launches them as programmatic
// dependents where it can (LaunchConfig::dependent): the stream's next
// kernel may be scheduled at once, and this one waits for the previous to
// end before it touches memory. The gap from a kernel's last block to the
// next one's first went from ~1.3 to ~0.7 us, ~1-1.4 us a dispatch + combine
// up to 128 tokens (2x H200).
//
// Before the wait, thread 0 of each block reads one byte of each of the
// inputs the kernel starts with (`first`, `second`; 0: none) and drops it:
// the previous kernel may still write them, so only the address
// translation and the line in L2 carry over into the kernel, never
// a value (a volatile byte load, which keeps nothing in L1). 2x H100, three
// rounds each, 128 tokens: bf16 20.78-20.83 against 20.86-20.93 us, fp8
// 17.92-18.00 against 18.14-18.30; from 512 tokens level. Prefetching the
// regions written at every rank, peers' included, cost 2-4 us.
FC_DEVICE void touch(fc_u64 p) {
    if (p != 0) (void)*reinterpret_cast<const volatile fc_u8*>(p); // a byte: views may start anywhere
}
FC_DEVICE void begin(fc_u64 first = 0, fc_u64 second = 0) {
    fc_grid_dep_launch();
    if (fc_thread_id() == 0) {
        touch(first);
        touch(second);
    }
    fc_grid_dep_wait();
}

// A block is done putting: every thread of it made its puts before a block
// barrier; thread r < world then adds v to rank r's flag word `word` + this
// rank (the release covers the block's puts). Not the kernel's last block
// signalling for all (a local count, then one signal a rank): its extra
// fences and count made a 1-token dispatch + combine 9.6 us slower on 2x
// H100.
FC_DEVICE void block_signal(const FcEpArgs& a, fc_u32 word, fc_u64 v) {
    const fc_u32 t = fc_thread_id();
    if (t < a.ctx.world) fc_signal_add(a.ctx, t, flag_words(a) + word + a.ctx.rank, v);
}

// Work unit u of `pieces` a row: its row and piece. In 32 bits where u fits
// (always, short of 2^32 units): a u64 division is a long software routine,
// and every unit's loads wait for it.
struct Unit {
    fc_u64 row, piece;
};
FC_DEVICE Unit unit_of(fc_u64 u, fc_u64 pieces) {
    Unit x;
    if (((u | pieces) >> 32) == 0) {
        const fc_u32 q = (fc_u32)u / (fc_u32)pieces;
        x.row = q;
        x.piece = (fc_u32)u - q * (fc_u32)pieces;
    } else {
        x.row = u / pieces;
        x.piece = u - x.row * pieces;
    }
    return x;
}

// Rows move in pieces of one copy round of a warp (FC_DEVAPI_UNROLL 16-byte
// units a lane, 2 KiB on 32 lanes), a (row, piece) pair per warp, so that a
// small batch still spreads over the whole grid: a warp per row paid a
// 14 KiB row's seven rounds of load latency alone.
FC_DEVICE fc_u64 piece_bytes() { return (fc_u64)FC_DEVAPI_UNROLL * 16u * fc_warp_size(); }
FC_DEVICE fc_u64 pieces_of(fc_u64 row_bytes) { return (row_bytes + piece_bytes() - 1u) / piece_bytes(); }

// The dispatch's slow paths (rows or scales not in 16-byte units), out of
// line (CUDA; the HIP prelude inlines them). Inlined at each of
// FC_MAX_RANKS destinations, fc_put_warp's three unit sizes made
// fc_ep_dispatch_layout 183 KB of sm_90 code, its fast path spread among
// them; with these out of line and the destination loop not unrolled, 78
// KB, and a 128-token dispatch + combine 20.08-20.10 against 20.28-20.43 us
// (2x H200; 4096 tokens level).
FC_DEVICE_COLD void cold_put_warp(const FcDevCtx& ctx, fc_u32 r, char* dst, const char* src, fc_u64 bytes) {
    fc_put_warp(ctx, r, dst, src, bytes);
}
// Piece p of a row of row_bytes at src, put at dst on rank r.
FC_DEVICE void put_piece(const FcDevCtx& ctx, fc_u32 r, char* dst, const char* src, fc_u64 row_bytes, fc_u64 p) {
    const fc_u64 at = p * piece_bytes();
    const fc_u64 left = row_bytes - at;
    cold_put_warp(ctx, r, dst + at, src + at, left < piece_bytes() ? left : piece_bytes());
}

// Acquire loads before fc_wait_until takes over: peers usually answer within
// microseconds, and a wait answered here never reads the host-mapped error
// word (a round trip over PCIe) or the clock. The deadline still bounds the
// wait: fc_wait_until starts its clock after these.
#ifndef FC_EP_PRESPIN
#define FC_EP_PRESPIN 2048
#endif
FC_DEVICE bool wait_ge(const FcDevCtx& ctx, const fc_u64* sig, fc_u64 v, fc_u32 peer, fc_u64& seen) {
    for (fc_u32 i = 0; i < FC_EP_PRESPIN; ++i)
        if ((seen = fc_ld_acquire_sys_u64(sig)) >= v) return true;
    if (!fc_wait_until(ctx, sig, FC_CMP_GE, v, peer)) return false;
    seen = fc_ld_acquire_sys_u64(sig);
    return true;
}
FC_DEVICE bool wait_ge(const FcDevCtx& ctx, const fc_u64* sig, fc_u64 v, fc_u32 peer) {
    fc_u64 seen;
    return wait_ge(ctx, sig, v, peer, seen);
}

// The k-th rank after `me`, round past the last (me + k < 2 * world): the
// order in which the dispatch and the combine's puts take the ranks. By a
// compare, not a remainder (see unit_of).
FC_DEVICE fc_u32 rank_after(fc_u32 me, fc_u32 k, fc_u32 world) { return me + k < world ? me + k : me + k - world; }

// Token t's row at every rank (slots[t], FC_MAX_RANKS i32: 32 bytes, aligned
// in the region), in two loads issued together.
struct Slots {
    fc_vec16 lo, hi;
};
FC_DEVICE Slots load_slots(const FcEpArgs& a, fc_u32 t) {
    const char* at = fc_ptr<const char>(a.slots) + (fc_u64)t * FC_MAX_RANKS * 4u;
    Slots s;
    s.lo = fc_load16(at);
    s.hi = fc_load16(at + 16);
    return s;
}
// Rank r's entry, by selects (no indexing into the vectors, which would put
// them in local memory when r is not a constant).
FC_DEVICE fc_u32 word_at(const fc_vec16& v, fc_u32 k) {
    return k == 0 ? v.w[0] : k == 1 ? v.w[1] : k == 2 ? v.w[2] : v.w[3];
}
FC_DEVICE fc_i32 slot_at(const Slots& s, fc_u32 r) {
    return (fc_i32)(r < 4u ? word_at(s.lo, r & 3u) : word_at(s.hi, r & 3u));
}

} // namespace fc_ep

// Layout: one block. Bumps this rank's epoch and gives every token its row at
// each destination, in token order: slot[t][r] = number of earlier tokens that
// go to r. Per chunk of RUN * block-size tokens:
// 1. each thread finds the ranks of RUN tokens strided by the block size
//    (neighbouring threads load neighbouring ids), every id loaded before
//    one is used, into a byte per token in shared memory;
// 2. each thread takes RUN tokens in a row: their bytes in one 8-byte
//    shared load, and their counts per rank (four ranks' 16-bit counts
//    packed per u64, two words for eight ranks);
// 3. one block-wide inclusive scan over the threads' counts: shuffles
//    within each warp, then, past one warp's threads (256 tokens), the
//    warps' totals scanned by the first warp;
// 4. each thread writes its tokens' slots.
// One thread per token with a scan per 512 tokens took 41 us at 4096 tokens
// on H200; a thread walking its 8 tokens' ids one by one, 10.6 us at 8
// tokens on H100 (a chain of shared-memory read-modify-writes). A scan
// through shared memory, two barriers a step, left 2.4 us from a 128-token
// dispatch's start to its first put (2x H200).
#define FC_EP_LAYOUT_RUN 8u // tokens per thread: a run's bytes are one u64

namespace fc_ep {

// Expert ids to ranks, e / per_rank, as a multiply by the rounded-up
// reciprocal and one correction (exact for every id below 2^31), not a
// division: a u32 division is ~20 dependent instructions, and a layout thread
// takes 64 ids in a row (a lane taking 8 tokens spent ~5 us on its divisions,
// 2x H200). The host computes the reciprocal (EpArgs): taken here, its u64
// division cost a dispatch + combine ~0.5 us up to 128 tokens (2x H200).
struct ExpertRanks {
    fc_u32 num, per_rank;
    fc_u64 recip;
};
FC_DEVICE ExpertRanks expert_ranks(const FcEpArgs& a) {
    ExpertRanks x;
    x.num = a.num_experts;
    x.per_rank = a.per_rank;
    x.recip = a.rank_recip;
    return x;
}

// The destination bit of one top-k id: rank e / per_rank; none for ids below
// 0 or at or past num_experts. No branch: with a branch per id the layout
// and the dispatch's metadata took longer (2x H200: 4096 tokens bf16
// 351.5-351.6 against 352.8-353.4 us, 128 tokens 20.00-20.02 against
// 20.08-20.10).
FC_DEVICE fc_u32 dest_bit(fc_i32 e, const ExpertRanks& x) {
    const fc_u32 u = (fc_u32)e; // a negative id is past num as well
    fc_u32 r = (fc_u32)(((fc_u64)u * x.recip) >> 32); // e / per_rank or one more
    r -= r * x.per_rank > u ? 1u : 0u;
    return u < x.num ? 1u << (r & 31u) : 0u;
}

// Step 1 for tokens chunk + i * nt + t (i < RUN): byte i * nt + t of masks.
// Neighbouring threads take neighbouring tokens, so a small batch's ids are
// a load a thread: a lane taking 8 tokens in a row spent ~2.7 us more at 8
// tokens (2x H200).
FC_DEVICE void chunk_masks(const FcEpArgs& a, fc_u32 chunk, fc_u8* masks) {
    const fc_u32 t = fc_thread_id(), nt = fc_block_threads();
    const ExpertRanks x = expert_ranks(a);
    const fc_i32* idx = fc_ptr<const fc_i32>(a.topk_idx);
    // Top-4 and top-8 rows of ids are one or two 16-byte vectors. (Loading
    // the last token's ids in place of those past the end, to skip the
    // branches, sent every block's threads to one L2 line: 5.7 us at 1 token,
    // 2x H200.)
    if ((a.topk == 4u || a.topk == 8u) && (a.topk_idx & 15u) == 0) {
        // Runs past the last token (the same for every thread) are skipped
        // whole; within the others a missing id reads as -1 (no rank), so
        // the masks take no branch per token or per id (a branch around each
        // top-8 half and each token: 128 tokens 20.00-20.02 against
        // 19.88-19.91 us a dispatch + combine, 2x H200).
        const fc_u32 left = a.num_tokens - chunk;
        const fc_u32 runs = left >= FC_EP_LAYOUT_RUN * nt ? FC_EP_LAYOUT_RUN : (left + nt - 1u) / nt;
        const bool top8 = a.topk == 8u;
        fc_vec16 none;
#pragma unroll
        for (int k = 0; k < 4; ++k) none.w[k] = 0xFFFFFFFFu;
        fc_vec16 v[FC_EP_LAYOUT_RUN][2];
#pragma unroll
        for (fc_u32 i = 0; i < FC_EP_LAYOUT_RUN; ++i) {
            if (i >= runs) break;
            const fc_u32 tok = chunk + i * nt + t;
            v[i][0] = none;
            v[i][1] = none;
            if (tok < a.num_tokens) {
                v[i][0] = fc_load16(idx + (fc_u64)tok * a.topk);
                if (top8) v[i][1] = fc_load16(idx + (fc_u64)tok * a.topk + 4u);
            }
        }
#pragma unroll
        for (fc_u32 i = 0; i < FC_EP_LAYOUT_RUN; ++i) {
            if (i >= runs) break;
            fc_u32 m = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) m |= dest_bit((fc_i32)v[i][0].w[k], x) | dest_bit((fc_i32)v[i][1].w[k], x);
            masks[i * nt + t] = (fc_u8)m;
        }
    } else {
        for (fc_u32 i = 0; i < FC_EP_LAYOUT_RUN; ++i) {
            const fc_u32 tok = chunk + i * nt + t;
            fc_u32 m = 0;
            for (fc_u32 k = 0; tok < a.num_tokens && k < a.topk; ++k)
                m |= dest_bit(fc_load(idx + (fc_u64)tok * a.topk + k), x);
            masks[i * nt + t] = (fc_u8)m;
        }
    }
}

// Inclusive sum over lanes 0..lane of the warp. Every lane must call it.
FC_DEVICE fc_u64 warp_scan(fc_u64 v) {
    const fc_u32 lane = fc_lane_id();
    for (fc_u32 off = 1; off < fc_warp_size(); off <<= 1) {
        const fc_u64 lo = fc_shfl_up((fc_u32)v, off), hi = fc_shfl_up((fc_u32)(v >> 32), off);
        if (lane >= off) v += lo | (hi << 32);
    }
    return v;
}

// Tokens of a run (a byte each) that go to rank r.
FC_DEVICE fc_u32 run_count(fc_u64 run, fc_u32 r) {
    return (fc_u32)((((run >> r) & 0x0101010101010101ull) * 0x0101010101010101ull) >> 56);
}

// Packed counts: rank r's 16 bits at 16 * (r % 4) of lo for r < 4, of hi above.
FC_DEVICE fc_u32 count_of(fc_u64 lo, fc_u64 hi, fc_u32 r) {
    return (fc_u32)((r < 4u ? lo : hi) >> (16u * (r & 3u))) & 0xFFFFu;
}

} // namespace fc_ep

namespace fc_ep {

// The layout's shared memory.
struct LayoutShared {
    fc_u64 scan[2][FC_MAX_BLOCK_THREADS]; // per thread, inclusive packed counts
    fc_u64 runs[FC_MAX_BLOCK_THREADS];    // step 1: a byte per token of the chunk
    fc_u64 warps[2][FC_MAX_BLOCK_THREADS / 32u]; // per warp, packed counts of the warps before it
};

// Steps 1-3 for the chunk at `chunk`. Returns the threads that hold its
// tokens; `run` gets this thread's bytes, `lo`/`hi` its inclusive counts,
// `own_lo`/`own_hi` its own. Every thread of the block calls it.
FC_DEVICE fc_u32 layout_scan(const FcEpArgs& a, fc_u32 chunk, LayoutShared& sh, fc_u64& run, fc_u64& lo, fc_u64& hi,
                             fc_u64& own_lo, fc_u64& own_hi) {
    const fc_u32 t = fc_thread_id(), nt = fc_block_threads(), ws = fc_warp_size();
    const fc_u32 left = a.num_tokens - chunk;
    const fc_u32 active = left >= FC_EP_LAYOUT_RUN * nt ? nt : (left + FC_EP_LAYOUT_RUN - 1u) / FC_EP_LAYOUT_RUN;
    chunk_masks(a, chunk, reinterpret_cast<fc_u8*>(sh.runs));
    fc_barrier();
    run = t < active ? sh.runs[t] : 0u;
    own_lo = 0;
    own_hi = 0;
#pragma unroll
    for (fc_u32 r = 0; r < 4u; ++r) {
        own_lo |= (fc_u64)run_count(run, r) << (16u * r);
        own_hi |= (fc_u64)run_count(run, r + 4u) << (16u * r);
    }
    lo = warp_scan(own_lo);
    hi = warp_scan(own_hi);
    if (active > ws) {
        // The warps' totals, scanned by the first warp, then added in.
        const fc_u32 warp = t / ws, warps = (nt + ws - 1u) / ws;
        if (fc_lane_id() == ws - 1u) {
            sh.warps[0][warp] = lo;
            sh.warps[1][warp] = hi;
        }
        fc_barrier();
        if (warp == 0) {
            const fc_u64 wlo = t < warps ? sh.warps[0][t] : 0u, whi = t < warps ? sh.warps[1][t] : 0u;
            const fc_u64 slo = warp_scan(wlo), shi = warp_scan(whi);
            if (t < warps) {
                sh.warps[0][t] = slo - wlo;
                sh.warps[1][t] = shi - whi;
            }
        }
        fc_barrier();
        lo += sh.warps[0][warp];
        hi += sh.warps[1][warp];
    }
    if (t < active) {
        sh.scan[0][t] = lo;
        sh.scan[1][t] = hi;
    }
    fc_barrier();
    return active;
}

// Token tok's slots from a scanned single chunk (the dispatch's own layout):
// the counts of the threads before its own, plus its run's earlier tokens.
FC_DEVICE Slots chunk_slots(const LayoutShared& sh, fc_u32 tok, fc_u32 world) {
    const fc_u32 th = tok / FC_EP_LAYOUT_RUN, j = tok % FC_EP_LAYOUT_RUN;
    const fc_u64 run = sh.runs[th];
    const fc_u32 mask = (fc_u32)(run >> (8u * j)) & 0xFFu;
    const fc_u64 before = j == 0 ? 0u : run & ((1ull << (8u * j)) - 1u);
    const fc_u64 lo = th == 0 ? 0u : sh.scan[0][th - 1u], hi = th == 0 ? 0u : sh.scan[1][th - 1u];
    Slots s;
#pragma unroll
    for (fc_u32 r = 0; r < FC_MAX_RANKS; ++r) {
        const bool sent = r < world && ((mask >> r) & 1u);
        const fc_u32 slot = sent ? count_of(lo, hi, r) + run_count(before, r) : 0xFFFFFFFFu; // -1: not sent
        (r < 4u ? s.lo : s.hi).w[r % 4u] = slot;
    }
    return s;
}

FC_DEVICE void store_slots(const FcEpArgs& a, fc_u32 tok, const Slots& s) {
    char* at = fc_ptr<char>(a.slots) + (fc_u64)tok * FC_MAX_RANKS * 4u;
    fc_store16(at, s.lo);
    fc_store16(at + 16, s.hi);
}

} // namespace fc_ep

FC_HEAP_KERNEL(fc_ep_layout, FcEpArgs) {
    fc_ep::begin();
    __shared__ fc_ep::LayoutShared sh;
    __shared__ fc_u32 base[FC_MAX_RANKS];
    const fc_u32 t = fc_thread_id(), nt = fc_block_threads();
    const fc_u32 world = a.ctx.world;
    if (t < FC_MAX_RANKS) base[t] = 0;
    if (t == 0) {
        fc_u64* epoch = fc_ep::flag_words(a) + FC_EP_FLAG_EPOCH;
        fc_st_volatile_u64(epoch, fc_ld_volatile_u64(epoch) + 1u);
    }
    for (fc_u32 chunk = 0; chunk < a.num_tokens; chunk += FC_EP_LAYOUT_RUN * nt) {
        fc_u64 run, lo, hi, own_lo, own_hi;
        const fc_u32 active = fc_ep::layout_scan(a, chunk, sh, run, lo, hi, own_lo, own_hi);
        // Step 4. Exclusive: the tokens of earlier threads and chunks; then
        // this thread's own, in order.
        fc_u32 at_rank[FC_MAX_RANKS];
#pragma unroll
        for (fc_u32 r = 0; r < FC_MAX_RANKS; ++r) at_rank[r] = base[r] + fc_ep::count_of(lo - own_lo, hi - own_hi, r);
        const fc_u32 tok0 = chunk + t * FC_EP_LAYOUT_RUN;
#pragma unroll
        for (fc_u32 j = 0; j < FC_EP_LAYOUT_RUN; ++j) {
            if (t >= active || tok0 + j >= a.num_tokens) continue;
            const fc_u32 mask = (fc_u32)(run >> (8u * j)) & 0xFFu;
            fc_ep::Slots out;
#pragma unroll
            for (fc_u32 r = 0; r < FC_MAX_RANKS; ++r) {
                const bool sent = r < world && ((mask >> r) & 1u);
                (r < 4u ? out.lo : out.hi).w[r % 4u] = sent ? at_rank[r] : 0xFFFFFFFFu; // -1: not sent
                at_rank[r] += sent ? 1u : 0u;
            }
            fc_ep::store_slots(a, tok0 + j, out);
        }
        // Everyone has read base[] and the shared chunk before they change.
        fc_barrier();
        if (t < FC_MAX_RANKS) base[t] += fc_ep::count_of(sh.scan[0][active - 1u], sh.scan[1][active - 1u], t);
        fc_barrier();
    }
    if (t < FC_MAX_RANKS) fc_store(fc_ptr<fc_i32>(a.send_counts) + t, t < world ? (fc_i32)base[t] : 0);
}

// Dispatch: a warp per piece of a token's row puts it into every destination
// rank's region of this source, at the token's slot; the warp of its last
// piece also puts the fp8 scales, the top-k ids and weights as the
// destination sees them, and the token's index (the last piece: an fp8 row
// of 7168 bytes ends in half a piece, and with a block's warps on
// neighbouring units, 2048 warps over 4 pieces a row, a warp keeps one piece
// of every row it takes; the metadata on the first, full piece made those
// warps the slowest: 4096 tokens, the dispatch alone 100.33-100.38 against
// 100.81-100.82 us, 2x H200). Each block then sets its flag word for this
// source at every rank to the epoch, block 0's with the rows it sent there
// (FC_EP_COUNT_BITS; after a block barrier: the release covers the block's
// puts), and block 0 waits until every source's every block's word reaches
// the epoch, so the stream's next work sees every row.
//
// When the rows allow 16-byte units (the usual case), a warp loads its piece
// and the token's slots once, together, and stores the piece to every
// destination from registers; otherwise fc_put_warp copies it per
// destination.
namespace fc_ep {

template <bool LAYOUT>
FC_DEVICE void dispatch(const FcEpArgs& a) {
    __shared__ LayoutShared sh;
    const FcDevCtx& ctx = a.ctx;
    const fc_u32 me = ctx.rank, world = ctx.world;
    const ExpertRanks xr = expert_ranks(a);
    fc_u64* flags = flag_words(a);
    fc_u64 epoch = fc_ld_volatile_u64(flags + FC_EP_FLAG_EPOCH);
    const fc_u32 t = fc_thread_id();
    // Block 0's thread r < world signals rank r with the rows this rank
    // sends it (FC_EP_COUNT_BITS): no count travels on its own. A count
    // stored to a peer before the puts held up the warp that made it for
    // ~1-1.5 us (phase stamps, 2x H200), and each receiver read
    // recv_counts after the signals, one more load at the dispatch's end.
    const bool counter = fc_block_id() == 0 && t < world;
    fc_u32 sends = 0;
    if (!LAYOUT && counter) sends = (fc_u32)fc_load(fc_ptr<const fc_i32>(a.send_counts) + t);
    if (LAYOUT) {
        // This kernel's own layout (one chunk): every block scans every
        // token; block 0 bumps the epoch (after all its threads read it:
        // the scan's barriers) and keeps the counts; the warp of a token's
        // last piece stores its slots, for the combine.
        fc_u64 run, lo, hi, own_lo, own_hi;
        const fc_u32 active = layout_scan(a, 0u, sh, run, lo, hi, own_lo, own_hi);
        epoch += 1u;
        if (fc_block_id() == 0 && t == 0) fc_st_volatile_u64(flags + FC_EP_FLAG_EPOCH, epoch);
        if (fc_block_id() == 0 && t < FC_MAX_RANKS) {
            const fc_u32 n = active != 0 && t < world ? count_of(sh.scan[0][active - 1u], sh.scan[1][active - 1u], t) : 0u;
            fc_store(fc_ptr<fc_i32>(a.send_counts) + t, (fc_i32)n); // for the caller
            sends = n;
        }
    }
    const fc_i32* idx = fc_ptr<fc_i32>(a.topk_idx);
    const fc_u32* weights = fc_ptr<fc_u32>(a.topk_weights); // f32 bits, passed through
    const fc_u64 scale_bytes = (fc_u64)a.scale_cols * 4u;
    const fc_u64 pieces = pieces_of(a.row_bytes);
    const fc_u64 units = (fc_u64)a.num_tokens * pieces;
    const Warps w = grid_warps(units);
    const bool vec = ((a.x | a.row_bytes) & 15u) == 0;
    // fp8 scales a warp moves in one 16-byte unit a lane.
    const bool sc16 =
        a.payload == FC_EP_PAYLOAD_FP8 && ((a.scales | scale_bytes) & 15u) == 0 && scale_bytes <= 16u * fc_warp_size();
    for (fc_u64 u = w.id; u < units; u += w.count) {
        const Unit un = unit_of(u, pieces);
        const fc_u32 tok = (fc_u32)un.row;
        const fc_u64 piece = un.piece;
        const Slots sl = LAYOUT ? chunk_slots(sh, tok, world) : load_slots(a, tok);
        const bool meta = piece == pieces - 1u; // this warp also moves the token's metadata
        if (LAYOUT && meta && w.lane == 0) store_slots(a, tok, sl);
        const fc_u64 at = piece * piece_bytes();
        const char* src = fc_ptr<const char>(a.x) + (fc_u64)tok * a.row_bytes;
        fc_vec16 v[FC_DEVAPI_UNROLL];
        const fc_u64 vecs = vec ? ((a.row_bytes - at < piece_bytes() ? a.row_bytes - at : piece_bytes()) / 16u) : 0u;
#pragma unroll
        for (int k = 0; k < FC_DEVAPI_UNROLL; ++k) {
            const fc_u64 i = (fc_u64)k * fc_warp_size() + w.lane;
            if (i < vecs) v[k] = fc_load16(src + at + i * 16u);
        }
        // The last piece's warp: the token's first warp-wide run of ids and
        // weights, and its fp8 scales, loaded once with the piece, not
        // again for each destination.
        fc_i32 e0 = -1;
        fc_u32 w0 = 0;
        fc_vec16 sc = {};
        if (meta) {
            if (w.lane < a.topk) {
                e0 = fc_load(idx + (fc_u64)tok * a.topk + w.lane);
                w0 = fc_load(weights + (fc_u64)tok * a.topk + w.lane);
            }
            if (sc16 && w.lane * 16u < scale_bytes)
                sc = fc_load16(fc_ptr<const char>(a.scales) + (fc_u64)tok * scale_bytes + w.lane * 16u);
        }
        // Destinations from the next rank round, this rank's own last, so
        // that the ranks' first stores go to different ranks: from rank 0
        // up, every rank's warps put to rank 0 first. At world 4, a
        // dispatch + combine at 128 / 512 / 4096 tokens bf16 took 41.3-41.6
        // / 132.1 / 928.8-929.0 against 48.3 / 149.6-149.8 / 945.0-945.2
        // us (4x H200).
#pragma unroll 1 // unrolled over FC_MAX_RANKS, the loop's code kept the fast path apart (see cold_put_warp)
        for (fc_u32 i = 1; i <= world; ++i) {
            const fc_u32 r = rank_after(me, i, world);
            const fc_i32 slot = slot_at(sl, r);
            if (slot < 0) continue;
            const fc_u64 row = (fc_u64)me * a.max_tokens + (fc_u32)slot;
            char* dst = fc_ptr<char>(a.recv_x) + row * a.row_bytes;
            if (vec) {
                char* far = fc_remote_ptr(ctx, r, dst);
#pragma unroll
                for (int k = 0; k < FC_DEVAPI_UNROLL; ++k) {
                    const fc_u64 i = (fc_u64)k * fc_warp_size() + w.lane;
                    if (i < vecs) fc_store16(far + at + i * 16u, v[k]);
                }
            } else {
                put_piece(ctx, r, dst, src, a.row_bytes, piece);
            }
            if (!meta) continue;
            if (sc16) {
                if (w.lane * 16u < scale_bytes)
                    fc_store16(fc_remote_ptr(ctx, r, fc_ptr<char>(a.recv_scales) + row * scale_bytes + w.lane * 16u), sc);
            } else if (a.payload == FC_EP_PAYLOAD_FP8) {
                cold_put_warp(ctx, r, fc_ptr<char>(a.recv_scales) + row * scale_bytes,
                              fc_ptr<const char>(a.scales) + (fc_u64)tok * scale_bytes, scale_bytes);
            }
            // The ids as rank r sees them: its own experts' local ids, -1 elsewhere.
            for (fc_u32 k = w.lane; k < a.topk; k += fc_warp_size()) {
                const bool first_run = k == w.lane;
                const fc_i32 e = first_run ? e0 : fc_load(idx + (fc_u64)tok * a.topk + k);
                const bool mine = dest_bit(e, xr) == 1u << r; // the layout's own test
                const fc_u32 wbits = first_run ? w0 : fc_load(weights + (fc_u64)tok * a.topk + k);
                fc_store(fc_remote_ptr(ctx, r, fc_ptr<fc_i32>(a.recv_idx) + row * a.topk + k),
                         mine ? (fc_i32)((fc_u32)e - r * xr.per_rank) : -1);
                fc_store(fc_remote_ptr(ctx, r, fc_ptr<fc_u32>(a.recv_weights) + row * a.topk + k), mine ? wbits : 0u);
            }
            if (w.lane == 0) fc_store(fc_remote_ptr(ctx, r, fc_ptr<fc_i32>(a.recv_src) + row), (fc_i32)tok);
        }
    }
    // Each block sets its own word at every rank to the epoch, after a
    // block barrier (the release covers the block's puts). One word per
    // source that every block added 1 to took 0.1-0.5 us longer up to 128
    // tokens (2x H200), we think because a peer's adds to one
    // word queue at its L2 behind each other (not measured apart).
    fc_barrier();
    const fc_u64 mark = epoch << FC_EP_COUNT_BITS;
    if (t < world) // sends is 0 outside block 0
        fc_signal_set(ctx, t, flags + FC_EP_FLAG_DISPATCH + me * FC_EP_MAX_GRID + fc_block_id(), mark | sends);
    if (fc_block_id() != 0) return;
    // Block 0 waits for every source's every block, a word a thread, so the
    // stream's next work sees every row; the thread of a source's block 0
    // keeps the count its word carries.
    __shared__ fc_u32 missing[FC_MAX_RANKS]; // 1: a wait on source s failed
    __shared__ fc_u32 rows[FC_MAX_RANKS];
    if (t < FC_MAX_RANKS) missing[t] = 0;
    fc_barrier();
    const fc_u32 g = fc_grid_blocks();
    for (fc_u32 i = t; i < world * g; i += fc_block_threads()) {
        const fc_u32 s = i / g;
        fc_u64 seen = 0;
        if (!wait_ge(ctx, flags + FC_EP_FLAG_DISPATCH + s * FC_EP_MAX_GRID + (i - s * g), mark, s, seen)) missing[s] = 1;
        if (i == s * g) rows[s] = (fc_u32)(seen & ((1ull << FC_EP_COUNT_BITS) - 1u));
    }
    fc_barrier(); // the acquires above come before every thread's reads below
    // The next combine's sums take units from 0 (see combine_roles); it
    // starts after this kernel ends.
    if (t == 0) fc_st_volatile_u64(flags + FC_EP_FLAG_TAKEN, 0u);
    if (t < world) {
        const fc_u32 n = missing[t] == 0 ? rows[t] : 0u;
        fc_store(fc_ptr<fc_i32>(a.recv_counts) + t, (fc_i32)n); // for the caller
        // The combine counts rows from this copy (see FC_EP_FLAG_SEEN).
        fc_st_volatile_u64(flags + FC_EP_FLAG_SEEN + t, n);
    }
}

} // namespace fc_ep

FC_HEAP_KERNEL(fc_ep_dispatch, FcEpArgs) {
    fc_ep::begin();
    fc_ep::dispatch<false>(a);
}
// The dispatch with its own layout, for up to FC_EP_LAYOUT_RUN tokens a
// thread (one chunk): no layout kernel before it (3.7 to 4.4 us up to 128
// tokens on 2x H100).
FC_HEAP_KERNEL(fc_ep_dispatch_layout, FcEpArgs) {
    // Inputs of an empty batch may be empty views: nothing to touch.
    fc_ep::begin(a.num_tokens != 0 ? a.topk_idx : 0, a.num_tokens != 0 ? a.x : 0);
    fc_ep::dispatch<true>(a);
}

// Combine. Each expert rank sends every received row back to its source,
// into the source's inbox for that rank at the token's own index; the source
// sums each token's rows over the ranks it went to, in rank order, in f32
// (the first term as it is), rounded to bf16 once; 0 for a token that went
// nowhere. The inbox holds Lamport packs (lamport.cuh): it is all 0xff
// between calls.
//
// fc_ep_combine_ll, when rows and tensors allow 16-byte packs (the usual
// case), is the whole combine in one kernel: rows travel as Lamport packs, so
// a block reduces as soon as the packs it reads have arrived, with no flag
// round trip and no second launch between the puts and the sum; a token's row
// at this rank is read from expert_out where it lies, never copied. Its
// blocks wait for each other's rows, so they must be resident together: the
// host caps the grid at the multiprocessors, and putting blocks never wait
// for rows. Otherwise fc_ep_combine puts plain rows (this
// rank's own too), block 0 waits for every rank's flag, and
// fc_ep_combine_reduce, next on the stream, sums them and gives the packs
// back to the inbox.
//
// The one-kernel combine ends when its sums do: no flag, no wait. A rank's
// sums need every pack its peers send it, and a peer loads what it sends
// (expert_out's rows, recv_src) before the pack leaves, so once a rank's
// combine ends its peers have read all they will of the regions its next
// dispatch writes; the row counts they combine from are their own copies
// (FC_EP_FLAG_SEEN, taken by the dispatch), which no peer writes. A rank's
// next combine puts into a peer's inbox only after that peer's next
// dispatch, which follows its sums that emptied the inbox. A flag round
// trip to end this kernel would cost ~3 us of a 26 us dispatch + combine at
// 128 tokens (phase stamps, 2x H200).
//
// The plain combine ends as the dispatch does: after a block barrier, each
// block adds 1 to every rank's combine flag for this rank, and block 0
// waits until every rank's flag reaches (plain combines so far) * grid, so
// fc_ep_combine_reduce, next on the stream, finds every row in the inbox.

namespace fc_ep {

// The combine's blocks in two roles, so that the sums run while the puts do:
// the first put_eighths() eighths of the grid put rows, the rest sum (a
// grid of one block does both, in turn). Whole blocks, not half of each
// block's warps: a putting warp's stores to a peer drain at the link's
// pace, and a summing warp's loads on the same multiprocessor queued behind
// them, so at 4096 tokens the sums ended ~100 us after the puts (2x H200,
// phase stamps). Ids and counts span the role's blocks.
// Eighths of the grid that put: fewer putting blocks still keep the link
// busy, and more summing blocks keep up with it. 2x H200, 4096 tokens a
// rank, bf16 / fp8: 2/8 355.35 / 284.64 against 3/8 363.22 / 291.26 and
// 4/8 370.46 / 296.84; below 512 tokens all level. World 4 (4x H200; the
// puts go round the sources, see combine_ll), 2/8 against 1/8 at 512 and
// 1024 tokens: bf16 150.3 / 267.0-267.3 against 154.5-154.8 / 277.9-278.8
// us, fp8 117.8 / 209.2-209.3 against 123.8-124.1 / 223.0.
//
// Large batches up to world 4 (fc_ep_combine_ll_take, which the host
// launches from TAKE_TOKENS a rank) take their sums in a different way: 5/8 of
// the grid put, and every summing warp takes its next unit from a counter
// (FC_EP_FLAG_TAKEN, in unit order, which is about the order the rows
// arrive in), the putting blocks too once their puts are done. A putting
// block's stores to a peer drain at a rate of its own: with the sums
// skipped (a diagnostic), 4096 tokens took 343.1-343.7 us with 32 putting
// blocks and 334.3 with 64 (bf16; fp8 268.7-269.7 and 260.8-260.9, against
// 346.6-346.7 and 272.3-272.4 with the sums). With the sums, fixed shares
// of more putting blocks lost (64: 357.2-357.6 / 286.5-286.6): fewer
// summing warps each took every Nth unit and fell behind the rows. Taken
// from the counter, with 64 / 80 putting blocks, 340.7-341.1 / 340.3-340.4
// bf16, 268.1-268.3 / 267.0-267.4 fp8 (2x H200);
// from 1024 tokens down level or slower, and 0.7-2 us slower at 128
// tokens (an atomic a unit, and fewer summing warps).
// The roles are this rank's own affair (nothing counts blocks), so they may
// follow its own token count.
#ifndef FC_EP_PUT_EIGHTHS
#define FC_EP_PUT_EIGHTHS 2u
#endif
// Eighths of the grid that put in fc_ep_combine_ll_take, at every world
// that takes units: 5, as 6 was level and 4 or 7 slower. 4096 tokens bf16,
// us: world 2 (2x H200), 5 / 6 / 7 eighths 339.7-340.0 / 339.3-339.4 /
// 347.7-348.0 (fp8 and 2048 tokens alike; 4 eighths 340.7-341.1, in
// another job); world 4 (4x H200), 5 / 4 eighths 918.5-918.6 / 922.8-923.3,
// fp8 710.2-710.7 / 715.4-715.6 (BENCHMARKS.md, "EP dispatch + combine",
// the world-4 note on the take kernel's share), fewer eighths slower still;
// world 3 (192 experts, 4x H200), 5 / 4 / 6 eighths 649.9-650.1 /
// 654.1-654.2 / 649.8-649.9 (fp8 and 2048 tokens alike).
#ifndef FC_EP_TAKE_EIGHTHS
#define FC_EP_TAKE_EIGHTHS 5u
#endif
// From 512 tokens a rank a summing warp's lanes meet after their looks, so
// that each store of the sums and the packs given back is one of the whole
// warp, not of the lanes that happened to finish their polls together: 512
// and 1024 tokens 52.3 / 94.4-94.5 against 54.1-54.4 / 96.1-96.4 us bf16,
// 41.8-41.9 / 75.5 against 43.4-43.6 / 76.6-77.2 fp8; at 128 tokens 20.1
// against 19.3-19.5, the slowest lane's wait (2x H200).
#ifndef FC_EP_WHOLE_TOKENS
#define FC_EP_WHOLE_TOKENS 512u
#endif
FC_DEVICE fc_u32 put_eighths(bool take) { return take ? FC_EP_TAKE_EIGHTHS : FC_EP_PUT_EIGHTHS; }
struct Roles {
    bool put, sum;
    bool whole; // a summing warp's lanes meet before its stores
    fc_u32 lane, put_id, put_count, sum_id, sum_count;
};
FC_DEVICE Roles combine_roles(const FcEpArgs& a, bool take) {
    const fc_u32 ws = fc_warp_size();
    const fc_u32 per_block = (fc_block_threads() + ws - 1u) / ws;
    const fc_u32 wib = fc_thread_id() / ws;
    const fc_u32 g = fc_grid_blocks(), b = fc_block_id();
    fc_u32 gp = g * put_eighths(take) / 8u; // putting blocks: at least one, and one left to sum
    gp = g < 2u ? g : gp < 1u ? 1u : gp > g - 1u ? g - 1u : gp;
    Roles r;
    r.lane = fc_lane_id();
    r.put = g < 2u || b < gp;
    r.sum = g < 2u || b >= gp || take; // taking, the putting blocks sum once their puts are done
    r.whole = take || a.num_tokens >= FC_EP_WHOLE_TOKENS;
    const fc_u32 sum_blocks = g < 2u ? g : g - gp;
    // Both roles take rows in 2 KiB units; this rank's own token count
    // stands in for the rows it sends back.
    const fc_u64 units = (fc_u64)a.num_tokens * pieces_of((fc_u64)a.hidden * 2u);
    r.put_id = warp_id(r.put ? b : 0u, wib, gp, per_block, units);
    r.put_count = gp * per_block;
    r.sum_id = warp_id(g < 2u ? b : (r.sum ? b - gp : 0u), wib, sum_blocks, per_block, units);
    r.sum_count = sum_blocks * per_block;
    return r;
}

// The plain combine's end, every thread of every block: block barrier,
// signal, and block 0 waits until every rank's combine flag for us reaches
// (plain combines so far, this one included) * grid, then counts this one.
FC_DEVICE void plain_combine_end(const FcEpArgs& a) {
    fc_barrier();
    block_signal(a, FC_EP_FLAG_COMBINE, 1u);
    if (fc_block_id() != 0) return;
    const FcDevCtx& ctx = a.ctx;
    const fc_u32 t = fc_thread_id();
    fc_u64* flags = flag_words(a);
    const fc_u64 n = fc_ld_volatile_u64(flags + FC_EP_FLAG_PLAIN) + 1u;
    if (t < ctx.world) wait_ge(ctx, flags + FC_EP_FLAG_COMBINE + t, n * fc_grid_blocks(), t);
    fc_barrier(); // every thread has read the count before it changes
    if (t == 0) fc_st_volatile_u64(flags + FC_EP_FLAG_PLAIN, n);
}

// Rows received from source s by the last dispatch (its copy, see above).
FC_DEVICE fc_u64 seen_rows(const FcEpArgs& a, fc_u32 s) { return fc_ld_volatile_u64(flag_words(a) + FC_EP_FLAG_SEEN + s); }

// The ranks token t's rows come back from (its slots' bits).
FC_DEVICE fc_u32 sent_mask(const Slots& sl, fc_u32 world) {
    fc_u32 mask = 0;
#pragma unroll
    for (fc_u32 r = 0; r < FC_MAX_RANKS; ++r)
        if (r < world && slot_at(sl, r) >= 0) mask |= 1u << r;
    return mask;
}

// Add a pack's eight bf16 to acc (the first term as it is).
FC_DEVICE void add_pack(float (&acc)[8], const fc_vec16& v, bool first) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float lo, hi;
        fc_unpack_bf16x2(v.w[k], lo, hi);
        acc[2 * k] = first ? lo : fc_fadd(acc[2 * k], lo);
        acc[2 * k + 1] = first ? hi : fc_fadd(acc[2 * k + 1], hi);
    }
}
// 16 bytes at p, 16-byte aligned (`aligned`) or only 2-byte aligned (a
// tensor view at an odd element): the one-kernel combine serves both, so
// the kind of combine never depends on a rank's own pointers.
FC_DEVICE fc_vec16 load16_any(const char* p, bool aligned) {
    if (aligned) return fc_load16(p);
    fc_vec16 v;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const fc_u16* h = reinterpret_cast<const fc_u16*>(p + 4 * k);
        v.w[k] = (fc_u32)fc_load(h) | ((fc_u32)fc_load(h + 1) << 16);
    }
    return v;
}
FC_DEVICE void store16_any(char* p, const fc_vec16& v, bool aligned) {
    if (aligned) {
        fc_store16(p, v);
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        fc_u16* h = reinterpret_cast<fc_u16*>(p + 4 * k);
        fc_store(h, (fc_u16)(v.w[k] & 0xFFFFu));
        fc_store(h + 1, (fc_u16)(v.w[k] >> 16));
    }
}

// 16-byte packs a lane of a summing warp takes per unit (each rank's loads
// of a unit are issued together).
#define FC_EP_SUM_PACKS 4

// Look at the Lamport packs k of `pending` (pack k at rows + k * step) and
// take those that have arrived into v[k]; the bits of those still missing.
// One look is all the loads of a unit at once: the first look, then polls.
// Every load issues before the first check: with the check between them
// each load waited for the one before (four round trips a look); issued
// together, a dispatch + combine at 128 tokens took 19.44-19.48 against
// 19.72-19.87 us, at 4096 346 against 349.5 (2x H200).
// (v[k] of a pack still missing holds what the last look saw.)
FC_DEVICE fc_u32 take_packs(const char* rows, fc_u64 step, fc_vec16 (&v)[FC_EP_SUM_PACKS], fc_u32 pending) {
#pragma unroll
    for (int k = 0; k < FC_EP_SUM_PACKS; ++k)
        if ((pending >> k) & 1u) v[k] = lamport_fetch(rows + (fc_u64)k * step);
#pragma unroll
    for (int k = 0; k < FC_EP_SUM_PACKS; ++k)
        if (((pending >> k) & 1u) && lamport_full(v[k])) pending &= ~(1u << k);
    return pending;
}

// Whether b holds on any lane. Every lane of the warp must call it.
FC_DEVICE bool warp_any(bool b) {
    fc_u32 v = b ? 1u : 0u;
    for (fc_u32 m = fc_warp_size() / 2u; m > 0u; m >>= 1) v |= fc_shfl_xor(v, m);
    return v != 0u;
}

// The next sum unit from the counter: lane 0 takes it, the warp shares it.
FC_DEVICE fc_u64 take_unit(fc_u32* taken) {
    fc_warp_sync();
    fc_u32 u = 0;
    if (fc_lane_id() == 0) u = fc_atomic_add_gpu(taken, 1u);
    return fc_shfl_lane0(u);
}

FC_DEVICE fc_vec16 round_pack(const float (&acc)[8], bool none) {
    fc_vec16 o;
#pragma unroll
    for (int k = 0; k < 4; ++k) o.w[k] = none ? 0u : fc_pack_bf16x2(acc[2 * k], acc[2 * k + 1]);
    return o;
}

// What a combine's putting warp loads for one unit: the token's index at its
// source s and the piece of its row in expert_out (at byte `at` of the row,
// `vecs` 16-byte units).
struct BackLoad {
    fc_vec16 v[FC_DEVAPI_UNROLL];
    fc_i32 tok;
    fc_u64 at, vecs;
};
FC_DEVICE void load_back(const FcEpArgs& a, fc_u32 s, const Unit& un, fc_u64 row_bytes, bool x16, fc_u32 lane,
                         BackLoad& l) {
    const fc_u64 row = (fc_u64)s * a.max_tokens + un.row;
    l.at = un.piece * piece_bytes();
    l.vecs = (row_bytes - l.at < piece_bytes() ? row_bytes - l.at : piece_bytes()) / 16u;
    const char* expert = fc_ptr<const char>(a.x) + row * row_bytes + l.at;
    l.tok = fc_load(fc_ptr<const fc_i32>(a.recv_src) + row);
#pragma unroll
    for (int k = 0; k < FC_DEVAPI_UNROLL; ++k) {
        const fc_u64 i = (fc_u64)k * fc_warp_size() + lane;
        if (i < l.vecs) l.v[k] = load16_any(expert + i * 16u, x16);
    }
}

// A combine's putting unit u over `sources` sources (world - 1: the other
// ranks; world: `me` too, last): the source it goes back to, the
// (u % sources + 1)-th rank after `me`, and its row and piece there (piece
// u / sources of its rows). See combine_ll.
FC_DEVICE fc_u32 source_of(fc_u64 u, fc_u32 me, fc_u32 world, fc_u32 sources, fc_u64 pieces, Unit& un) {
    const Unit pk = sources == 1u ? Unit{u, 0u} : unit_of(u, sources);
    un = unit_of(pk.row, pieces);
    return rank_after(me + 1u, (fc_u32)pk.piece, world);
}
// The most and the fewest rows this rank sends back to one of the
// `sources` ranks after it (their copies, see seen_rows).
struct RowSpan {
    fc_u64 most, least;
};
FC_DEVICE RowSpan row_span(const FcEpArgs& a, fc_u32 sources) {
    const fc_u32 me = a.ctx.rank, world = a.ctx.world;
    RowSpan r = {0u, ~0ull};
    for (fc_u32 k = 1; k <= sources; ++k) {
        const fc_u64 n = seen_rows(a, rank_after(me, k, world));
        r.most = n > r.most ? n : r.most;
        r.least = n < r.least ? n : r.least;
    }
    return r;
}

} // namespace fc_ep

namespace fc_ep {

// The one-kernel combine's body, compiled apart: ALIGNED when expert_out and
// out are 16-byte aligned (the usual case), with no alignment test per pack,
// and for any alignment, out of line (combine_ll_any). 4096 tokens bf16
// 349.0-349.4 against 350.4-351.1 us, fp8 275.4-275.6 against 277.1-277.8;
// 128 tokens level (2x H200). TAKE (aligned only): the
// sums take units from the counter (see combine_roles), in a kernel of its
// own (fc_ep_combine_ll_take).
template <bool ALIGNED, bool TAKE>
FC_DEVICE void combine_ll(const FcEpArgs& a) {
    const FcDevCtx& ctx = a.ctx;
    const fc_u32 me = ctx.rank, world = ctx.world;
    const fc_ep::Roles w = fc_ep::combine_roles(a, TAKE);
    const fc_u64 row_bytes = (fc_u64)a.hidden * 2u;
    const char* expert = fc_ptr<const char>(a.x);
    const bool x16 = ALIGNED || (a.x & 15u) == 0, out16 = ALIGNED || (a.out & 15u) == 0;
    char* inbox = fc_ptr<char>(a.inbox);
    const fc_u64 rank_stride = (fc_u64)a.max_tokens * row_bytes;

    if (w.put) {
        // A warp per 2 KiB piece of a row received from another source (this
        // rank's own rows stay where they are); the token's index and the
        // piece are loaded together, before the source's row count is
        // known: rows below max_tokens are always there to read (expert_out
        // holds world * max rows), and the loads are dropped when the count
        // does not reach the row. A warp's first unit goes out before the
        // counts that bound the loop: 0.05-0.15 us off a 128-token dispatch +
        // combine, in each of three jobs on 2x H100. Plain 16-byte stores, as the
        // dispatch's: each 32-bit element is single-copy atomic, which is
        // all a Lamport reader needs (it checks every 16-bit half).
        //
        // Neighbouring units go to different sources, the next rank first
        // (unit u: the (u % (world - 1) + 1)-th rank after this one, piece
        // u / (world - 1) of its rows there; source_of), so every source gets its rows
        // back from every rank at one pace, and no rank is the destination
        // of all the others at once. Source by source (every rank putting
        // to rank 0 first, then to rank 1, ...), a dispatch + combine at
        // 4096 tokens took 1313-1317 against 963-964 us at world 4 and 834
        // against 657.5 at world 3 (bf16; 4x H200).
        const fc_u64 pieces = fc_ep::pieces_of(row_bytes);
        const fc_u32 peers = world - 1u;
        fc_ep::BackLoad cur;
        bool have = false;
        fc_u32 s;
        fc_ep::Unit un;
        if (peers != 0u) {
            s = fc_ep::source_of(w.put_id, me, world, peers, pieces, un);
            have = un.row < a.max_tokens;
            if (have) fc_ep::load_back(a, s, un, row_bytes, x16, w.lane, cur);
        }
        // Only rows past the fewest any source gets test their own source's
        // count (at world 2, none: a count a unit cost 0.1-0.2 us up to 512
        // tokens, 2x H200).
        const fc_ep::RowSpan span = fc_ep::row_span(a, peers);
        const fc_u64 units = span.most * pieces * peers;
        for (fc_u64 u = w.put_id; u < units; u += w.put_count) {
            if (!have) {
                s = fc_ep::source_of(u, me, world, peers, pieces, un);
                fc_ep::load_back(a, s, un, row_bytes, x16, w.lane, cur);
            }
            have = false;
            if (un.row >= span.least && un.row >= fc_ep::seen_rows(a, s)) continue; // past this source's rows
            const fc_i32 tok = cur.tok;
            if (tok >= 0 && (fc_u32)tok < a.max_tokens) { // always: the source wrote it
                char* far = fc_remote_ptr(ctx, s, inbox + (fc_u64)me * rank_stride + (fc_u32)tok * row_bytes + cur.at);
#pragma unroll
                for (int k = 0; k < FC_DEVAPI_UNROLL; ++k) {
                    const fc_u64 i = (fc_u64)k * fc_warp_size() + w.lane;
                    if (i < cur.vecs) fc_store16(far + i * 16u, lamport_send_pack(cur.v[k]));
                }
            }
        }
    }

    if (w.sum) {
        // A warp per FC_EP_SUM_PACKS * 512 bytes of a token's row: per rank
        // in rank order, every pack of the unit loaded at once (rank me's
        // from expert_out), then only the packs not there yet polled, with
        // the deadline (FC_EP_PRESPIN looks first, then fc_detail's clock
        // and error word). A warp that gives up skips its later units.
        const fc_u64 step = (fc_u64)fc_warp_size() * 16u;
        const fc_u64 piece = step * FC_EP_SUM_PACKS;
        const fc_u64 pieces = (row_bytes + piece - 1u) / piece;
        const fc_u64 units = (fc_u64)a.num_tokens * pieces;
        bool failed = false;
        // A unit's slots are loaded one unit ahead; a taken unit is taken
        // one ahead too, and its slots loaded once the unit before is done
        // (the atomic's round trip behind that unit's work).
        fc_u32* taken = reinterpret_cast<fc_u32*>(fc_ep::flag_words(a) + FC_EP_FLAG_TAKEN);
        fc_ep::Slots sl_next;
        fc_u64 u = TAKE ? fc_ep::take_unit(taken) : w.sum_id;
        if (u < units) sl_next = fc_ep::load_slots(a, (fc_u32)fc_ep::unit_of(u, pieces).row);
        while (u < units && !failed) {
            const fc_ep::Unit un = fc_ep::unit_of(u, pieces);
            const fc_u32 tok = (fc_u32)un.row;
            const fc_u64 c0 = un.piece * piece + (fc_u64)w.lane * 16u;
            const fc_ep::Slots sl = sl_next;
            const fc_u64 next = TAKE ? fc_ep::take_unit(taken) : u + w.sum_count;
            if (!TAKE && next < units) sl_next = fc_ep::load_slots(a, (fc_u32)fc_ep::unit_of(next, pieces).row);
            const fc_u32 mask = fc_ep::sent_mask(sl, world);
            // This rank's own packs and the first other rank's first look
            // are issued together, before the sum in rank order takes them
            // (at world 2, every load of the unit at once).
            fc_u32 other = world; // the lowest rank of the mask but this one
#pragma unroll
            for (fc_u32 r = FC_MAX_RANKS; r-- > 0;)
                if (r != me && ((mask >> r) & 1u)) other = r;
            fc_u32 packs = 0; // the unit's packs inside the row
#pragma unroll
            for (int k = 0; k < FC_EP_SUM_PACKS; ++k)
                if (c0 + (fc_u64)k * step < row_bytes) packs |= 1u << k;
            fc_vec16 own[FC_EP_SUM_PACKS], pre[FC_EP_SUM_PACKS];
            fc_u32 pre_pending = 0;
            if ((mask >> me) & 1u) {
                const char* rows = expert + ((fc_u64)me * a.max_tokens + (fc_u32)fc_ep::slot_at(sl, me)) * row_bytes;
#pragma unroll
                for (int k = 0; k < FC_EP_SUM_PACKS; ++k)
                    if ((packs >> k) & 1u) own[k] = fc_ep::load16_any(rows + c0 + (fc_u64)k * step, x16);
            }
            if (other < world)
                pre_pending = fc_ep::take_packs(inbox + (fc_u64)other * rank_stride + (fc_u64)tok * row_bytes + c0, step,
                                                pre, packs);
            float acc[FC_EP_SUM_PACKS][8];
            bool first = true;
#pragma unroll 1
            for (fc_u32 r = 0; r < world && !failed; ++r) {
                if (!((mask >> r) & 1u)) continue;
                if (r == me) {
#pragma unroll
                    for (int k = 0; k < FC_EP_SUM_PACKS; ++k)
                        if ((packs >> k) & 1u) fc_ep::add_pack(acc[k], own[k], first);
                    first = false;
                    continue;
                }
                // `pre` holds the first other rank's look; later ranks reuse it.
                const char* rows = inbox + (fc_u64)r * rank_stride + (fc_u64)tok * row_bytes + c0;
                if (r != other) pre_pending = fc_ep::take_packs(rows, step, pre, packs);
                fc_detail::Spin spin;
                for (fc_u32 i = 0; pre_pending != 0; ++i) {
                    if (i == FC_EP_PRESPIN) spin = fc_detail::spin_start();
                    if (i >= FC_EP_PRESPIN && fc_detail::give_up(ctx, spin, fc_detail::rank_bit(r))) {
                        failed = true;
                        break;
                    }
                    pre_pending = fc_ep::take_packs(rows, step, pre, pre_pending);
                }
#pragma unroll
                for (int k = 0; k < FC_EP_SUM_PACKS; ++k)
                    if ((packs >> k) & 1u) fc_ep::add_pack(acc[k], pre[k], first);
                first = false;
            }
            // From FC_EP_WHOLE_TOKENS a lane's timeout stops its whole warp
            // (which takes units together), and the warp's lanes meet here,
            // so each store below is one of the whole warp.
            if (w.whole) failed = fc_ep::warp_any(failed);
            if (failed) break;
#pragma unroll
            for (int k = 0; k < FC_EP_SUM_PACKS; ++k) {
                const fc_u64 c = c0 + (fc_u64)k * step;
                if (c >= row_bytes) continue;
                fc_ep::store16_any(fc_ptr<char>(a.out) + (fc_u64)tok * row_bytes + c, fc_ep::round_pack(acc[k], first), out16);
                for (fc_u32 r = 0; r < world; ++r)
                    if (r != me && ((mask >> r) & 1u)) lamport_clear(inbox + (fc_u64)r * rank_stride + (fc_u64)tok * row_bytes + c);
            }
            if (TAKE && next < units) sl_next = fc_ep::load_slots(a, (fc_u32)fc_ep::unit_of(next, pieces).row);
            u = next;
        }
    }
    // No signal and no wait: see "The one-kernel combine ends when its sums
    // do" above.
}

FC_DEVICE_COLD void combine_ll_any(const FcEpArgs& a) { combine_ll<false, false>(a); }

} // namespace fc_ep

FC_HEAP_KERNEL(fc_ep_combine_ll, FcEpArgs) {
    fc_ep::begin(a.x, a.recv_src); // expert_out holds world * max rows (the host checks)
    if (((a.x | a.out) & 15u) != 0)
        fc_ep::combine_ll_any(a);
    else
        fc_ep::combine_ll<true, false>(a);
}

// The same combine with the sums taking units (see combine_roles): the host
// launches it from TAKE_TOKENS a rank up to world 4 (src/ep/mod.rs). A
// kernel of its own, because either way inside one kernel cost: one body
// choosing at run time took 0.3-0.4 us longer at 128 tokens, where it never
// takes, and the take body out of line (a call) lost its gain (4096 tokens
// bf16 346.8-347.0 against 346.1-346.9 us inline, fp8 273.1-273.3 against
// 272.4-273.0; 2x H200).
FC_HEAP_KERNEL(fc_ep_combine_ll_take, FcEpArgs) {
    fc_ep::begin(a.x, a.recv_src);
    if (((a.x | a.out) & 15u) != 0)
        fc_ep::combine_ll_any(a); // the host launches this kernel for aligned buffers only
    else
        fc_ep::combine_ll<true, true>(a);
}

// The plain combine's puts (see above): a warp per piece of a received row,
// this rank's own rows included.
FC_HEAP_KERNEL(fc_ep_combine, FcEpArgs) {
    fc_ep::begin();
    const FcDevCtx& ctx = a.ctx;
    const fc_u32 me = ctx.rank, world = ctx.world;
    const fc_u64 row_bytes = (fc_u64)a.hidden * 2u;
    const fc_i32* src = fc_ptr<fc_i32>(a.recv_src);
    const fc_u64 pieces = fc_ep::pieces_of(row_bytes);
    const fc_ep::Warps w = fc_ep::grid_warps((fc_u64)a.num_tokens * pieces); // this rank's count stands in for the rows
    // Round the sources as fc_ep_combine_ll's puts, this rank last.
    const fc_ep::RowSpan span = fc_ep::row_span(a, world);
    const fc_u64 units = span.most * pieces * world;
    for (fc_u64 u = w.id; u < units; u += w.count) {
        fc_ep::Unit un;
        const fc_u32 s = fc_ep::source_of(u, me, world, world, pieces, un);
        if (un.row >= span.least && un.row >= fc_ep::seen_rows(a, s)) continue; // past this source's rows
        const fc_u64 row = (fc_u64)s * a.max_tokens + un.row;
        const fc_i32 tok = fc_load(src + row);
        if (tok < 0 || (fc_u32)tok >= a.max_tokens) continue; // never: the source wrote it
        fc_ep::put_piece(ctx, s, fc_ptr<char>(a.inbox) + ((fc_u64)me * a.max_tokens + (fc_u32)tok) * row_bytes,
                         fc_ptr<const char>(a.x) + row * row_bytes, row_bytes, un.piece);
    }
    fc_ep::plain_combine_end(a);
}

// The plain combine's sums (see above): a warp per warp-wide piece of a
// token's row (16 bytes a lane when rows and tensors allow, else one bf16),
// every rank's piece loaded at once, with the slots; the inbox rows read are
// filled with 0xff again.
FC_HEAP_KERNEL(fc_ep_combine_reduce, FcEpArgs) {
    fc_ep::begin();
    const fc_u32 world = a.ctx.world;
    const fc_u64 row_bytes = (fc_u64)a.hidden * 2u;
    char* inbox = fc_ptr<char>(a.inbox);
    const fc_u64 rank_stride = (fc_u64)a.max_tokens * row_bytes;
    const bool vec = ((a.out | a.inbox | row_bytes) & 15u) == 0;
    const fc_u64 lane_bytes = vec ? 16u : 2u;
    const fc_u64 piece = (fc_u64)fc_warp_size() * lane_bytes;
    const fc_u64 pieces = (row_bytes + piece - 1u) / piece;
    const fc_u64 units = (fc_u64)a.num_tokens * pieces;
    const fc_ep::Warps w = fc_ep::grid_warps(units);
    for (fc_u64 u = w.id; u < units; u += w.count) {
        const fc_ep::Unit un = fc_ep::unit_of(u, pieces);
        const fc_u32 tok = (fc_u32)un.row;
        const fc_u64 c = un.piece * piece + (fc_u64)w.lane * lane_bytes;
        if (c >= row_bytes) continue;
        const fc_u32 mask = fc_ep::sent_mask(fc_ep::load_slots(a, tok), world);
        char* rows = inbox + (fc_u64)tok * row_bytes + c;
        char* out = fc_ptr<char>(a.out) + (fc_u64)tok * row_bytes + c;
        if (vec) {
            fc_vec16 v[FC_MAX_RANKS];
#pragma unroll
            for (fc_u32 r = 0; r < FC_MAX_RANKS; ++r)
                if ((mask >> r) & 1u) v[r] = fc_load16(rows + (fc_u64)r * rank_stride);
            float acc[8];
            bool first = true;
#pragma unroll
            for (fc_u32 r = 0; r < FC_MAX_RANKS; ++r) {
                if (!((mask >> r) & 1u)) continue;
                fc_ep::add_pack(acc, v[r], first);
                first = false;
            }
            fc_store16(out, fc_ep::round_pack(acc, first));
#pragma unroll
            for (fc_u32 r = 0; r < FC_MAX_RANKS; ++r)
                if ((mask >> r) & 1u) lamport_clear(rows + (fc_u64)r * rank_stride);
        } else {
            float acc = 0.0f;
            bool first = true;
            for (fc_u32 r = 0; r < world; ++r) {
                if (!((mask >> r) & 1u)) continue;
                fc_u16* at = reinterpret_cast<fc_u16*>(rows + r * rank_stride);
                const float v = fc_bf16_to_f32(fc_load(at));
                fc_store(at, (fc_u16)FC_LAMPORT_EMPTY);
                acc = first ? v : fc_fadd(acc, v);
                first = false;
            }
            fc_store(reinterpret_cast<fc_u16*>(out), first ? (fc_u16)0 : fc_f32_to_bf16(acc));
        }
    }
}
