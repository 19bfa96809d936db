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
#ifndef FC_PRELUDE_INCLUDED
#include "prelude.cuh"
#endif
#ifndef FC_DEVICE_API_INCLUDED
#include "device_api.cuh"
#endif

#define FC_EP_PAYLOAD_BF16 0u
#define FC_EP_PAYLOAD_FP8 1u

// Flag words (u64) at FcEpArgs::flags, see src/ep/layout.rs.
#define FC_EP_FLAG_DISPATCH 0u                  // [s]: blocks of source s's dispatches that landed here
#define FC_EP_FLAG_COMBINE FC_MAX_RANKS         // [r]: blocks of rank r's combines that landed here
#define FC_EP_FLAG_EPOCH (2u * FC_MAX_RANKS)    // this rank's dispatches so far (local)

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
    fc_u64 inbox;        // bf16 [world expert rank][max][hidden]: combine rows sent back here
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
};
static_assert(sizeof(FcEpArgs) == 256, "FcEpArgs must match EpArgs in src/ep/mod.rs");

namespace fc_ep {

// Ranks token t goes to: one bit per rank owning at least one of its experts.
// Ids below 0 mean "no expert"; ids at or past num_experts are ignored.
FC_DEVICE fc_u32 dest_mask(const FcEpArgs& a, fc_u32 t) {
    const fc_i32* idx = fc_ptr<fc_i32>(a.topk_idx) + (fc_u64)t * a.topk;
    const fc_u32 per_rank = a.num_experts / a.ctx.world;
    fc_u32 mask = 0;
    for (fc_u32 k = 0; k < a.topk; ++k) {
        const fc_i32 e = fc_load(idx + k);
        if (e >= 0 && (fc_u32)e < a.num_experts) mask |= 1u << ((fc_u32)e / per_rank);
    }
    return mask;
}

// Warp geometry over the grid: every warp takes whole tokens (rows).
struct Warps {
    fc_u32 lane, id, count;
};
FC_DEVICE Warps grid_warps() {
    const fc_u32 ws = fc_warp_size();
    const fc_u32 per_block = (fc_block_threads() + ws - 1u) / ws;
    Warps w;
    w.lane = fc_lane_id();
    w.id = fc_block_id() * per_block + fc_thread_id() / ws;
    w.count = fc_grid_blocks() * per_block;
    return w;
}

FC_DEVICE fc_u64* flag_words(const FcEpArgs& a) { return fc_ptr<fc_u64>(a.flags); }

// Rows move in pieces of one copy round of a warp (FC_DEVAPI_UNROLL 16-byte
// units a lane, 2 KiB on 32 lanes), a (row, piece) pair per warp, so that a
// small batch still spreads over the whole grid: a warp per row paid a
// 14 KiB row's seven rounds of load latency alone.
FC_DEVICE fc_u64 piece_bytes() { return (fc_u64)FC_DEVAPI_UNROLL * 16u * fc_warp_size(); }
FC_DEVICE fc_u64 pieces_of(fc_u64 row_bytes) { return (row_bytes + piece_bytes() - 1u) / piece_bytes(); }

// Piece p of a row of row_bytes at src, put at dst on rank r.
FC_DEVICE void put_piece(const FcDevCtx& ctx, fc_u32 r, char* dst, const char* src, fc_u64 row_bytes, fc_u64 p) {
    const fc_u64 at = p * piece_bytes();
    const fc_u64 left = row_bytes - at;
    fc_put_warp(ctx, r, dst + at, src + at, left < piece_bytes() ? left : piece_bytes());
}

// Acquire loads before fc_wait_until takes over: peers usually answer within
// microseconds, and a wait answered here never reads the host-mapped error
// word (a round trip over PCIe) or the clock. The deadline still bounds the
// wait: fc_wait_until starts its clock after these.
#ifndef FC_EP_PRESPIN
#define FC_EP_PRESPIN 2048
#endif
FC_DEVICE bool wait_ge(const FcDevCtx& ctx, const fc_u64* sig, fc_u64 v, fc_u32 peer) {
    for (fc_u32 i = 0; i < FC_EP_PRESPIN; ++i)
        if (fc_ld_acquire_sys_u64(sig) >= v) return true;
    return fc_wait_until(ctx, sig, FC_CMP_GE, v, peer);
}

} // namespace fc_ep

// Layout: one block. Bumps this rank's epoch and gives every token its row at
// each destination, in token order: slot[t][r] = number of earlier tokens that
// go to r (a block-wide inclusive scan per chunk of block-size tokens, four
// ranks' 16-bit counts packed per u64, so two scans cover eight ranks).
FC_HEAP_KERNEL(fc_ep_layout, FcEpArgs) {
    __shared__ fc_u64 scan[2][FC_MAX_BLOCK_THREADS];
    __shared__ fc_u32 base[FC_MAX_RANKS];
    const fc_u32 t = fc_thread_id(), nt = fc_block_threads();
    const fc_u32 world = a.ctx.world;
    fc_i32* slots = fc_ptr<fc_i32>(a.slots);
    if (t < FC_MAX_RANKS) base[t] = 0;
    if (t == 0) {
        fc_u64* epoch = fc_ep::flag_words(a) + FC_EP_FLAG_EPOCH;
        fc_st_volatile_u64(epoch, fc_ld_volatile_u64(epoch) + 1u);
    }
    fc_barrier();
    for (fc_u32 chunk = 0; chunk < a.num_tokens; chunk += nt) {
        const fc_u32 tok = chunk + t;
        const fc_u32 mask = tok < a.num_tokens ? fc_ep::dest_mask(a, tok) : 0u;
        fc_u64 lo = 0, hi = 0;
        for (fc_u32 r = 0; r < 4u; ++r) {
            lo |= (fc_u64)((mask >> r) & 1u) << (16u * r);
            hi |= (fc_u64)((mask >> (r + 4u)) & 1u) << (16u * r);
        }
        scan[0][t] = lo;
        scan[1][t] = hi;
        fc_barrier();
        for (fc_u32 off = 1; off < nt; off <<= 1) {
            fc_u64 plo = 0, phi = 0;
            if (t >= off) {
                plo = scan[0][t - off];
                phi = scan[1][t - off];
            }
            fc_barrier();
            lo += plo;
            hi += phi;
            scan[0][t] = lo;
            scan[1][t] = hi;
            fc_barrier();
        }
        if (tok < a.num_tokens) {
            for (fc_u32 r = 0; r < FC_MAX_RANKS; ++r) {
                const fc_u64 word = r < 4u ? lo : hi;
                const fc_u32 inclusive = (fc_u32)(word >> (16u * (r & 3u))) & 0xFFFFu;
                const bool sent = r < world && ((mask >> r) & 1u);
                fc_store(slots + (fc_u64)tok * FC_MAX_RANKS + r, sent ? (fc_i32)(base[r] + inclusive - 1u) : -1);
            }
        }
        // Everyone has read base[] for this chunk before it moves on.
        fc_barrier();
        if (t < FC_MAX_RANKS) {
            const fc_u64 word = t < 4u ? scan[0][nt - 1u] : scan[1][nt - 1u];
            base[t] += (fc_u32)(word >> (16u * (t & 3u))) & 0xFFFFu;
        }
        fc_barrier();
    }
    if (t < FC_MAX_RANKS) fc_store(fc_ptr<fc_i32>(a.send_counts) + t, t < world ? (fc_i32)base[t] : 0);
}

// Dispatch: a warp per piece of a token's row puts it into every destination
// rank's region of this source, at the token's slot; the warp of piece 0 also
// puts the fp8 scales, the top-k ids and weights as the destination sees
// them, and the token's index. Block 0 also
// writes the row counts. Each block then adds 1 to every rank's flag for this
// source (after a block barrier: the release covers the block's puts), and
// block 0 waits until every source's flag reaches epoch * grid, so the stream's
// next work sees every row.
FC_HEAP_KERNEL(fc_ep_dispatch, FcEpArgs) {
    const FcDevCtx& ctx = a.ctx;
    const fc_u32 me = ctx.rank, world = ctx.world;
    const fc_u32 per_rank = a.num_experts / world;
    fc_u64* flags = fc_ep::flag_words(a);
    const fc_u64 epoch = fc_ld_volatile_u64(flags + FC_EP_FLAG_EPOCH);
    const fc_ep::Warps w = fc_ep::grid_warps();
    const fc_i32* slots = fc_ptr<fc_i32>(a.slots);
    const fc_i32* idx = fc_ptr<fc_i32>(a.topk_idx);
    const fc_u32* weights = fc_ptr<fc_u32>(a.topk_weights); // f32 bits, passed through
    const fc_u64 scale_bytes = (fc_u64)a.scale_cols * 4u;
    const fc_u64 pieces = fc_ep::pieces_of(a.row_bytes);
    const fc_u64 units = (fc_u64)a.num_tokens * pieces;
    for (fc_u64 u = w.id; u < units; u += w.count) {
        const fc_u32 tok = (fc_u32)(u / pieces);
        const fc_u64 piece = u % pieces;
        for (fc_u32 r = 0; r < world; ++r) {
            const fc_i32 slot = fc_load(slots + (fc_u64)tok * FC_MAX_RANKS + r);
            if (slot < 0) continue;
            const fc_u64 row = (fc_u64)me * a.max_tokens + (fc_u32)slot;
            fc_ep::put_piece(ctx, r, fc_ptr<char>(a.recv_x) + row * a.row_bytes,
                             fc_ptr<const char>(a.x) + (fc_u64)tok * a.row_bytes, a.row_bytes, piece);
            if (piece != 0) continue;
            if (a.payload == FC_EP_PAYLOAD_FP8)
                fc_put_warp(ctx, r, fc_ptr<char>(a.recv_scales) + row * scale_bytes,
                            fc_ptr<const char>(a.scales) + (fc_u64)tok * scale_bytes, scale_bytes);
            // The ids as rank r sees them: its own experts' local ids, -1 elsewhere.
            for (fc_u32 k = w.lane; k < a.topk; k += fc_warp_size()) {
                const fc_i32 e = fc_load(idx + (fc_u64)tok * a.topk + k);
                const bool mine = e >= 0 && (fc_u32)e < a.num_experts && (fc_u32)e / per_rank == r;
                const fc_u32 wbits = fc_load(weights + (fc_u64)tok * a.topk + k);
                fc_store(fc_remote_ptr(ctx, r, fc_ptr<fc_i32>(a.recv_idx) + row * a.topk + k),
                         mine ? (fc_i32)((fc_u32)e - r * per_rank) : -1);
                fc_store(fc_remote_ptr(ctx, r, fc_ptr<fc_u32>(a.recv_weights) + row * a.topk + k), mine ? wbits : 0u);
            }
            if (w.lane == 0) fc_store(fc_remote_ptr(ctx, r, fc_ptr<fc_i32>(a.recv_src) + row), (fc_i32)tok);
        }
    }
    const fc_u32 t = fc_thread_id();
    if (fc_block_id() == 0 && t < world)
        fc_store(fc_remote_ptr(ctx, t, fc_ptr<fc_i32>(a.recv_counts) + me), fc_load(fc_ptr<fc_i32>(a.send_counts) + t));
    fc_barrier();
    if (t < world) fc_signal_add(ctx, t, flags + FC_EP_FLAG_DISPATCH + me, 1u);
    if (fc_block_id() == 0 && t < world)
        fc_ep::wait_ge(ctx, flags + FC_EP_FLAG_DISPATCH + t, epoch * fc_grid_blocks(), t);
}

// Combine, first kernel: a warp per piece of a received row sends the expert
// output back to the row's source, into the source's inbox for this rank at
// the token's own index; each block adds 1 to every rank's combine flag for this
// rank (after a block barrier: the release covers the block's puts), and block
// 0 waits until every rank's flag reaches epoch * grid. Only block 0 waits, so
// no kernel here needs its blocks resident together.
FC_HEAP_KERNEL(fc_ep_combine, FcEpArgs) {
    const FcDevCtx& ctx = a.ctx;
    const fc_u32 me = ctx.rank, world = ctx.world;
    fc_u64* flags = fc_ep::flag_words(a);
    const fc_u64 epoch = fc_ld_volatile_u64(flags + FC_EP_FLAG_EPOCH);
    const fc_ep::Warps w = fc_ep::grid_warps();
    const fc_u64 row_bytes = (fc_u64)a.hidden * 2u;
    const fc_i32* counts = fc_ptr<fc_i32>(a.recv_counts);
    const fc_i32* src = fc_ptr<fc_i32>(a.recv_src);
    const fc_u64 pieces = fc_ep::pieces_of(row_bytes);
    for (fc_u32 s = 0; s < world; ++s) {
        const fc_i32 n = fc_load(counts + s);
        const fc_u64 units = n > 0 ? (fc_u64)n * pieces : 0u;
        for (fc_u64 u = w.id; u < units; u += w.count) {
            const fc_u64 row = (fc_u64)s * a.max_tokens + u / pieces;
            const fc_i32 tok = fc_load(src + row);
            if (tok < 0 || (fc_u32)tok >= a.max_tokens) continue; // never: the source wrote it
            fc_ep::put_piece(ctx, s, fc_ptr<char>(a.inbox) + ((fc_u64)me * a.max_tokens + (fc_u32)tok) * row_bytes,
                             fc_ptr<const char>(a.x) + row * row_bytes, row_bytes, u % pieces);
        }
    }
    fc_barrier();
    const fc_u32 t = fc_thread_id();
    if (t < world) fc_signal_add(ctx, t, flags + FC_EP_FLAG_COMBINE + me, 1u);
    if (fc_block_id() == 0 && t < world)
        fc_ep::wait_ge(ctx, flags + FC_EP_FLAG_COMBINE + t, epoch * fc_grid_blocks(), t);
}

// Combine, second kernel (after the first on the stream, so every rank's rows
// are in the inbox): each token's rows summed over the ranks it was sent to,
// in rank order, in f32 (the first term as it is), rounded to bf16 once; 0 for
// a token that went nowhere. The unit of work is one warp-wide piece of one
// token's row (32 lanes x 16 bytes), spread over every warp of the grid: with
// a warp per token, one token's 14 KiB row took a single warp 28 dependent
// load rounds (17 us on H200 for a one-token batch).
FC_HEAP_KERNEL(fc_ep_combine_reduce, FcEpArgs) {
    const fc_u32 world = a.ctx.world;
    const fc_ep::Warps w = fc_ep::grid_warps();
    const fc_u64 row_bytes = (fc_u64)a.hidden * 2u;
    const fc_i32* slots = fc_ptr<fc_i32>(a.slots);
    const char* inbox = fc_ptr<const char>(a.inbox);
    const fc_u64 rank_stride = (fc_u64)a.max_tokens * row_bytes;
    // 16-byte vectors (eight bf16) when every row and the output allow them,
    // else one bf16 a lane.
    const bool vec = ((a.out | a.inbox | row_bytes) & 15u) == 0;
    const fc_u64 lane_bytes = vec ? 16u : 2u;
    const fc_u64 piece = (fc_u64)fc_warp_size() * lane_bytes;
    const fc_u64 pieces = (row_bytes + piece - 1u) / piece;
    const fc_u64 units = (fc_u64)a.num_tokens * pieces;
    for (fc_u64 u = w.id; u < units; u += w.count) {
        const fc_u32 tok = (fc_u32)(u / pieces);
        const fc_u64 c = (u % pieces) * piece + (fc_u64)w.lane * lane_bytes;
        if (c >= row_bytes) continue;
        fc_u32 mask = 0;
        for (fc_u32 r = 0; r < world; ++r)
            if (fc_load(slots + (fc_u64)tok * FC_MAX_RANKS + r) >= 0) mask |= 1u << r;
        const char* rows = inbox + (fc_u64)tok * row_bytes + c;
        char* out = fc_ptr<char>(a.out) + (fc_u64)tok * row_bytes + c;
        if (vec) {
            // Every rank's piece loaded at once, with the slots above (the
            // inbox holds a row per rank, stale where the token went
            // elsewhere; the mask skips those), so a unit pays one load
            // latency, not one for the slots and another for the rows.
            fc_vec16 v[FC_MAX_RANKS];
#pragma unroll
            for (int r = 0; r < (int)FC_MAX_RANKS; ++r)
                if ((fc_u32)r < world) v[r] = fc_load16(rows + (fc_u64)r * rank_stride);
            float acc[8];
            bool first = true;
#pragma unroll
            for (int r = 0; r < (int)FC_MAX_RANKS; ++r) {
                if ((fc_u32)r >= world || !((mask >> r) & 1u)) continue;
                for (int k = 0; k < 4; ++k) {
                    float lo, hi;
                    fc_unpack_bf16x2(v[r].w[k], lo, hi);
                    acc[2 * k] = first ? lo : fc_fadd(acc[2 * k], lo);
                    acc[2 * k + 1] = first ? hi : fc_fadd(acc[2 * k + 1], hi);
                }
                first = false;
            }
            fc_vec16 o;
            for (int k = 0; k < 4; ++k) o.w[k] = first ? 0u : fc_pack_bf16x2(acc[2 * k], acc[2 * k + 1]);
            fc_store16(out, o);
        } else {
            float acc = 0.0f;
            bool first = true;
            for (fc_u32 r = 0; r < world; ++r) {
                if (!((mask >> r) & 1u)) continue;
                const float v = fc_bf16_to_f32(fc_load(reinterpret_cast<const fc_u16*>(rows + r * rank_stride)));
                acc = first ? v : fc_fadd(acc, v);
                first = false;
            }
            fc_store(reinterpret_cast<fc_u16*>(out), first ? (fc_u16)0 : fc_f32_to_bf16(acc));
        }
    }
}
