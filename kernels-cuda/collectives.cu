// ferrocomm collective kernels: one-shot and two-shot all-reduce (pull, push, LL), broadcast.
//
// Vendor neutral (see common.cuh): the HIP module reuses this file unchanged.
// The contract is docs/protocol.md. The module NVRTC compiles is prelude.cuh +
// common.cuh + this file (src/algo/kernels.rs); the include below only serves
// standalone compiles of this file.

#ifndef FC_COMMON_INCLUDED
#include "common.cuh"
#endif

namespace fc {

// ===========================================================================
// The pull protocols.

// One-shot: stage own input range in own region; arrive/wait phase 0; reduce
// the range from every rank's region into the output.
template <class T, int OP>
FC_DEVICE void oneshot(const FcParams& p) {
    const int ES = sizeof(typename T::S);
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 b = fc_block_id();
    const Range r = block_range(p.count, b, fc_grid_blocks());
    const fc_u64 slot = region_offset(p, parity);

    copy_range<ES, 1>(own + slot, fc_ptr<const char>(p.input), r.lo, r.hi, aligned16(p.input));
    if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
    const PeerSrc src = {&p, slot};
    const OutDst dst = {fc_ptr<char>(p.output)};
    reduce_range<T, OP, false>(p, src, dst, r.lo, r.hi, aligned16(p.output));
    complete(own, epoch);
}

// Two-shot: stage every segment's sub-range b in own region (first slot);
// phase 0; reduce own segment's sub-range b into the output and own result
// slot (the region's second slot); phase 1; copy every other segment's
// sub-range b from its owner's result slot into the output.
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
    const fc_u64 stage_slot = region_offset(p, parity);
    const fc_u64 result_slot = stage_slot + p.slot_bytes;
    const bool in_aligned = aligned16(p.input);
    const bool out_aligned = aligned16(p.output);
    char* output = fc_ptr<char>(p.output);

    for (fc_u32 s = 0; s < world; ++s) {
        const Range r = sub_range(p.count, seg, per, s, b);
        copy_range<ES, FC_COPY_UNROLL>(own + stage_slot, fc_ptr<const char>(p.input), r.lo, r.hi, in_aligned);
    }
    if (!arrive_wait(p, own, epoch, parity, 0, b)) return;

    const Range mine = sub_range(p.count, seg, per, p.rank, b);
    const PeerSrc src = {&p, stage_slot};
    const DualDst dst = {output, own + result_slot};
    reduce_range<T, OP, true>(p, src, dst, mine.lo, mine.hi, out_aligned);
    if (!arrive_wait(p, own, epoch, parity, 1, b)) return;

    // Every other segment, in an order staggered by block so that at any time
    // the blocks pull from all peers at once (one peer's links alone would
    // cap the bandwidth).
    for (fc_u32 k = 0; k + 1 < world; ++k) {
        const fc_u32 s = (p.rank + 1 + (k + b) % (world - 1)) % world;
        const Range r = sub_range(p.count, seg, per, s, b);
        copy_range<ES, FC_COPY_UNROLL>(output, fc_ptr<const char>(p.peer_ws[s] + result_slot), r.lo, r.hi,
                                       out_aligned);
    }
    complete(own, epoch);
}

// Broadcast: the root stages its input range in its region; phase 0; every
// rank copies the range from the root's region into its output.
template <int ES>
FC_DEVICE void broadcast(const FcParams& p) {
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 b = fc_block_id();
    const Range r = block_range(p.count, b, fc_grid_blocks());
    const fc_u64 slot = region_offset(p, parity);

    if (p.rank == p.root)
        copy_range<ES, FC_COPY_UNROLL>(own + slot, fc_ptr<const char>(p.input), r.lo, r.hi, aligned16(p.input));
    if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
    copy_range<ES, FC_COPY_UNROLL>(fc_ptr<char>(p.output), fc_ptr<const char>(p.peer_ws[p.root] + slot), r.lo, r.hi,
                                   aligned16(p.output));
    complete(own, epoch);
}

// ===========================================================================
// The push protocols (flags). Data goes out as posted remote stores; the
// block barrier and the system-scope release of the flag in arrive publish
// them, and every read after the wait is local.
//
// One launch carries the whole call: chunk c (of nchunk, each at most a
// workspace's worth) runs with epoch E + c and parity (E + c) & 1, and the
// launch publishes epoch E + nchunk - 1 at the end. With several chunks,
// block b's sub-ranges are cut with the `per` of a full chunk, so block b
// touches the same workspace bytes in every chunk: the reuse argument of
// protocol.md then holds per block (block b's wait for chunk c proves every
// peer's block b is done with chunk c - 2's data).

// Elements of each block's piece: `per` of n elements over nb blocks.
FC_DEVICE fc_u64 block_per(fc_u64 n, fc_u32 nb) { return round_up8(div_ceil(n, nb)); }

FC_DEVICE Range piece(fc_u64 n, fc_u64 per, fc_u32 b) {
    Range r;
    r.lo = min_u64((fc_u64)b * per, n);
    r.hi = min_u64(r.lo + per, n);
    return r;
}

// One-shot, push. Per chunk c: copy own input range into sub-buffer [rank]
// of every rank's region (peers first, staggered by block so the blocks
// spread over all links; ourselves last); phase 0; reduce the range from our
// own region's sub-buffers 0..world-1 (local) into the output.
template <class T, int OP>
FC_DEVICE void oneshot_push(const FcParams& p) {
    const int ES = sizeof(typename T::S);
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 e0 = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u64 stride = push1_stride(p);
    const fc_u64 cap = stride / ES; // elements of a full chunk
    const fc_u64 nchunk = div_ceil(p.count, cap);
    const fc_u64 per = block_per(nchunk > 1 ? cap : p.count, nb);
    const bool in_aligned = aligned16(p.input);
    const bool out_aligned = aligned16(p.output);

    for (fc_u64 c = 0; c < nchunk; ++c) {
        const fc_u32 epoch = e0 + (fc_u32)c;
        const fc_u32 parity = epoch & 1;
        const fc_u64 first = c * cap;
        const Range r = piece(min_u64(cap, p.count - first), per, b);
        const fc_u64 region = region_offset(p, parity);
        const fc_u64 mine = region + (fc_u64)p.rank * stride;
        const char* input = fc_ptr<const char>(p.input + first * ES);

        for (fc_u32 k = 0; k + 1 < world; ++k) {
            const fc_u32 q = (p.rank + 1 + (k + b) % (world - 1)) % world;
            copy_range<ES, FC_COPY_UNROLL>(fc_ptr<char>(p.peer_ws[q] + mine), input, r.lo, r.hi, in_aligned);
        }
        copy_range<ES, FC_COPY_UNROLL>(own + mine, input, r.lo, r.hi, in_aligned);
        if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
        const StrideSrc src = {p.peer_ws[p.rank] + region, stride};
        const OutDst dst = {fc_ptr<char>(p.output + first * ES)};
        reduce_range<T, OP, true>(p, src, dst, r.lo, r.hi, out_aligned);
    }
    complete(own, e0 + (fc_u32)(nchunk - 1));
}

// Two-shot, push. A full chunk is world segments of `cap` elements (cap =
// inbox stride / ES); chunk c's segment d is [d*seg, min((d+1)*seg, n)) of
// the chunk's n elements, seg = round_up8(ceil(n / world)), and block b owns
// piece b (of `per`) of every segment. Positions: element e of segment d sits
// at inbox [src] + (e - d*seg)*ES of rank d, and at result + d*stride +
// (e - d*seg)*ES of every rank, whatever the chunk.
// Per chunk c, pipelined with the next chunk's first stage:
//   S1(c): for every rank d (staggered by block), copy own piece b of segment
//          d into inbox [rank] of rank d's region; arrive phase 0.
//   W0(c): wait phase 0. S2(c): reduce own segment's piece b from own inboxes
//          0..world-1 (local) into the output and into every peer's result
//          slot; arrive phase 1.
//   S1(c+1) (if any), then W1(c): wait phase 1. S3(c): copy every other
//          segment's piece b from own result slot into the output (local).
// S1(c+1) before W1(c) is safe: W0(c) proved every peer's block b arrived at
// phase 0 of chunk c, after its S2(c-1), the last reader of the inboxes that
// S1(c+1) fills; S2(c) writes result slots last read by S3(c-2), which every
// peer's block b finished before arriving at phase 0 of chunk c.
template <class T, int OP>
FC_DEVICE void twoshot_push(const FcParams& p) {
    const int ES = sizeof(typename T::S);
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 e0 = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u64 stride = push2_stride(p);
    const fc_u64 cap = stride / ES;
    const fc_u64 chunk = cap * world;
    const fc_u64 nchunk = div_ceil(p.count, chunk);
    const fc_u64 per = block_per(nchunk > 1 ? cap : round_up8(div_ceil(p.count, world)), nb);
    const bool in_aligned = aligned16(p.input);
    const bool out_aligned = aligned16(p.output);

    // S1(c): own pieces of chunk c into every owner's inbox, then arrive.
    auto stage1 = [&](fc_u64 c) {
        const fc_u32 epoch = e0 + (fc_u32)c;
        const fc_u32 parity = epoch & 1;
        const fc_u64 first = c * chunk;
        const fc_u64 n = min_u64(chunk, p.count - first);
        const fc_u64 seg = round_up8(div_ceil(n, world));
        const fc_u64 region = region_offset(p, parity);
        const char* input = fc_ptr<const char>(p.input + first * ES);
        for (fc_u32 k = 0; k < world; ++k) {
            const fc_u32 d = (rank + 1 + k + b) % world;
            const Range r = sub_range(n, seg, per, d, b);
            // Element e of the chunk lands at inbox + (e - d*seg)*ES.
            char* inbox = fc_ptr<char>(p.peer_ws[d] + region + (fc_u64)rank * stride - (fc_u64)d * seg * ES);
            copy_range<ES, FC_COPY_UNROLL>(inbox, input, r.lo, r.hi, in_aligned);
        }
        arrive(p, epoch, parity, 0, b);
    };

    stage1(0);
    for (fc_u64 c = 0; c < nchunk; ++c) {
        const fc_u32 epoch = e0 + (fc_u32)c;
        const fc_u32 parity = epoch & 1;
        const fc_u64 first = c * chunk;
        const fc_u64 n = min_u64(chunk, p.count - first);
        const fc_u64 seg = round_up8(div_ceil(n, world));
        const fc_u64 region = region_offset(p, parity);
        const fc_u64 result = region + p.slot_bytes;
        char* output = fc_ptr<char>(p.output + first * ES);

        if (!wait_phase(p, own, epoch, parity, 0, b)) return;
        const Range mine = sub_range(n, seg, per, rank, b);
        const StrideSrc src = {p.peer_ws[rank] + region - (fc_u64)rank * seg * ES, stride};
        const PushDst dst = {&p, output, result + (fc_u64)rank * stride - (fc_u64)rank * seg * ES};
        reduce_range<T, OP, true>(p, src, dst, mine.lo, mine.hi, out_aligned);
        arrive(p, epoch, parity, 1, b);
        if (c + 1 < nchunk) stage1(c + 1);
        if (!wait_phase(p, own, epoch, parity, 1, b)) return;

        for (fc_u32 s = 0; s < world; ++s) {
            if (s == rank) continue;
            const Range r = sub_range(n, seg, per, s, b);
            copy_range<ES, FC_COPY_UNROLL>(output, own + result + (fc_u64)s * stride - (fc_u64)s * seg * ES, r.lo,
                                           r.hi, out_aligned);
        }
    }
    complete(own, e0 + (fc_u32)(nchunk - 1));
}

// ===========================================================================
// One-shot, LL (barrier-free, Lamport-style; protocol.md "One-shot, LL").
//
// Data travels in 16-byte lines of two 8-byte units {data word, flag}: 8 data
// bytes a line, flag = E | 1. Each unit is one 64-bit access (single-copy
// atomic), so a unit whose flag matches this launch's carries this launch's
// data; readers clear what they read to 0, which no launch writes. No fence,
// flag or block barrier sits between the data and its reader. Thread t of a
// block handles lines t, t + nt, ... of the block's range, so a warp's stores
// cover contiguous memory.

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

FC_DEVICE fc_u64 ll_unit(fc_u32 word, fc_u32 flag) { return ((fc_u64)flag << 32) | (fc_u64)word; }

// One line; true when both units carry `flag`.
FC_DEVICE bool ll_load(const char* line, fc_u32 flag, fc_u32& w0, fc_u32& w1) {
    fc_u64 a, b;
    fc_ld_volatile_v2u64(line, a, b);
    w0 = (fc_u32)a;
    w1 = (fc_u32)b;
    return ((fc_u32)(a >> 32) == flag) & ((fc_u32)(b >> 32) == flag);
}

// 8 data bytes at element e0 of a user buffer (zero padded past hi; two
// 4-byte loads when the buffer is 4-byte aligned and the line is whole).
template <int ES>
FC_DEVICE void load_line(const char* buf, fc_u64 e0, fc_u64 hi, bool aligned4, fc_u32& w0, fc_u32& w1) {
    const int H = 8 / ES;
    if (aligned4 && e0 + H <= hi) {
        const fc_u32* q = reinterpret_cast<const fc_u32*>(buf + e0 * ES);
        w0 = fc_load(q);
        w1 = fc_load(q + 1);
        return;
    }
    typedef typename Elem<ES>::T E;
    fc_u32 w[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < H; ++k)
        if (e0 + k < hi) w[(k * ES) / 4] |= (fc_u32)fc_load(reinterpret_cast<const E*>(buf) + e0 + k) << (8 * ((k * ES) % 4));
    w0 = w[0];
    w1 = w[1];
}

template <int ES>
FC_DEVICE void store_line(char* buf, fc_u64 e0, fc_u64 hi, bool aligned4, fc_u32 w0, fc_u32 w1) {
    const int H = 8 / ES;
    if (aligned4 && e0 + H <= hi) {
        fc_u32* q = reinterpret_cast<fc_u32*>(buf + e0 * ES);
        fc_store(q, w0);
        fc_store(q + 1, w1);
        return;
    }
    typedef typename Elem<ES>::T E;
    const fc_u32 w[2] = {w0, w1};
#pragma unroll
    for (int k = 0; k < H; ++k)
        if (e0 + k < hi) fc_store(reinterpret_cast<E*>(buf) + e0 + k, (E)(w[(k * ES) / 4] >> (8 * ((k * ES) % 4))));
}

// Wait for the lines of the sources in `pending` (bit s: source s0 + s, at
// line + s*stride) into v. False after raising a timeout for the sources
// still missing.
FC_DEVICE bool ll_wait(const FcParams& p, const char* line, fc_u64 stride, fc_u32 s0, fc_u32 flag, fc_u32 epoch,
                       fc_u32 pending, fc_vec16 (&v)[4]) {
    const fc_u64 start = fc_globaltimer_ns();
    for (;;) {
#pragma unroll
        for (int s = 0; s < 4; ++s)
            if ((pending >> s) & 1u)
                if (ll_load(line + (fc_u64)s * stride, flag, v[s].w[0], v[s].w[1])) pending &= ~(1u << s);
        if (pending == 0) return true;
        if (fc_globaltimer_ns() - start >= p.timeout_ns) {
            for (fc_u32 s = 0; s < 4; ++s)
                if ((pending >> s) & 1u) raise_timeout(p, s0 + s, epoch);
            return false;
        }
    }
}

// Wait for line i of every peer and reduce it with our own (w0, w1) in rank
// order, sources four at a time (their loads in flight together). The line's
// 8 bytes sit in words 0 and 1 of a pack whose words 2 and 3 are 0 and never
// stored. False after a timeout.
template <class T, int OP>
FC_DEVICE bool ll_reduce_line(const FcParams& p, fc_u32 flag, fc_u32 epoch, char* at, fc_u64 stride, fc_u32 w0,
                              fc_u32 w1, const AvgDiv& avg, fc_u32& r0, fc_u32& r1) {
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    typename T::Acc a[T::VEC];
#pragma unroll
    for (int g = 0; g < (int)FC_MAX_RANKS; g += 4) {
        if ((fc_u32)g >= world) break;
        fc_vec16 v[4];
        fc_u32 pending = 0;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const fc_u32 src = (fc_u32)(g + s);
            v[s].w[2] = v[s].w[3] = 0;
            if (src >= world) {
                v[s].w[0] = v[s].w[1] = 0;
            } else if (src == rank) {
                v[s].w[0] = w0;
                v[s].w[1] = w1;
            } else if (!ll_load(at + (fc_u64)src * stride, flag, v[s].w[0], v[s].w[1])) {
                pending |= 1u << s;
            }
        }
        if (pending != 0 && !ll_wait(p, at + (fc_u64)g * stride, stride, (fc_u32)g, flag, epoch, pending, v))
            return false;
        if (g == 0) {
            T::unpack(v[0], a);
            fc_vec16 w3[3] = {v[1], v[2], v[3]};
            accumulate<T, OP, 3, true>(a, w3, 1, world);
        } else {
            accumulate<T, OP, 4, true>(a, v, g, world);
        }
    }
    const fc_vec16 res = finish_pack<T, OP, FC_MAX_RANKS, true>(a, avg);
    r0 = res.w[0];
    r1 = res.w[1];
    return true;
}

FC_DEVICE void ll_clear_lines(char* at, fc_u64 stride, fc_u32 world, fc_u32 rank) {
    for (fc_u32 s = 0; s < world; ++s)
        if (s != rank) fc_st_volatile_v2u64(at + (fc_u64)s * stride, 0ull, 0ull);
}

// One-shot, LL. Block b owns block_range(count, b, nb): lines of 8 data bytes
// from its first element, line i handled by thread i % nt.
// 1. Thread q < world (q != rank) stores our fingerprint record
//    {fp_lo, flag}, {fp_hi, flag} at peer q's record [parity][b][rank]; every
//    line of our range goes to our lines at every peer.
// 2. Thread s < world (s != rank) waits for record [parity][b][s], clears it
//    and compares it. Block barrier: on a timeout or a mismatch, exit without
//    writing output.
// 3. Every line: wait for every peer's, reduce with our own input in rank
//    order, write the output, clear the lines read. Our own line is our
//    input, re-read by the thread that pushed it and that writes it (so in
//    place is safe).
// (Measured on 4x H200: letting every thread poll its first line while the
// record is awaited was ~0.3 us (w2) to ~1 us (w4) slower than this order.)
template <class T, int OP>
FC_DEVICE void oneshot_ll(const FcParams& p) {
    const int ES = sizeof(typename T::S);
    const fc_u64 H = 8 / ES;
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 flag = epoch | 1u;
    const fc_u32 b = fc_block_id();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u32 t = fc_thread_id();
    const fc_u32 nt = fc_block_threads();
    const Range r = block_range(p.count, b, fc_grid_blocks());
    const fc_u64 stride = ll_stride(p);
    const fc_u64 lines = ll_lines_offset(p, parity);
    const fc_u64 nline = div_ceil(r.hi - r.lo, H);
    const fc_u64 line0 = r.lo / H;
    const char* input = fc_ptr<const char>(p.input);
    char* output = fc_ptr<char>(p.output);
    const bool in_aligned = (p.input & 3) == 0;
    const bool out_aligned = (p.output & 3) == 0;

    if (t < world && t != rank)
        fc_st_volatile_v2u64(fc_ptr<char>(p.peer_ws[t] + ll_fp_offset(p, parity, b, rank)),
                             ll_unit((fc_u32)p.fingerprint, flag), ll_unit((fc_u32)(p.fingerprint >> 32), flag));

    const fc_u64 mine = lines + (fc_u64)rank * stride + line0 * 16u;
    for (fc_u64 i = t; i < nline; i += nt) {
        fc_u32 w0, w1;
        load_line<ES>(input, r.lo + i * H, r.hi, in_aligned, w0, w1);
        const fc_u64 u0 = ll_unit(w0, flag), u1 = ll_unit(w1, flag);
        for (fc_u32 k = 1; k < world; ++k) {
            fc_u32 q = rank + k;
            if (q >= world) q -= world;
            fc_st_volatile_v2u64(fc_ptr<char>(p.peer_ws[q] + mine + i * 16u), u0, u1);
        }
    }

    bool failed = false;
    if (t < world && t != rank) {
        char* rec = own + ll_fp_offset(p, parity, b, t);
        fc_u64 lo, hi;
        fc_ld_volatile_v2u64(rec, lo, hi);
        if ((fc_u32)(lo >> 32) != flag || (fc_u32)(hi >> 32) != flag) {
            const fc_u64 start = fc_globaltimer_ns();
            for (;;) {
                fc_ld_volatile_v2u64(rec, lo, hi);
                if ((fc_u32)(lo >> 32) == flag && (fc_u32)(hi >> 32) == flag) break;
                if (fc_globaltimer_ns() - start >= p.timeout_ns) {
                    raise_timeout(p, t, epoch);
                    failed = true;
                    break;
                }
            }
        }
        if (!failed) {
            fc_st_volatile_v2u64(rec, 0ull, 0ull);
            if (((lo & 0xffffffffull) | (hi << 32)) != p.fingerprint) {
                raise_mismatch(p, t, epoch);
                failed = true;
            }
        }
    }
    if (fc_barrier_or(failed)) return;

    const AvgDiv avg = make_avg(world);
    char* own_lines = own + lines + line0 * 16u;
    for (fc_u64 i = t; i < nline; i += nt) {
        fc_u32 w0, w1, r0, r1;
        load_line<ES>(input, r.lo + i * H, r.hi, in_aligned, w0, w1);
        if (!ll_reduce_line<T, OP>(p, flag, epoch, own_lines + i * 16u, stride, w0, w1, avg, r0, r1)) {
            failed = true;
            break;
        }
        store_line<ES>(output, r.lo + i * H, r.hi, out_aligned, r0, r1);
        ll_clear_lines(own_lines + i * 16u, stride, world, rank);
    }
    if (fc_barrier_or(failed)) return;
    complete(own, epoch);
}

} // namespace fc

// ===========================================================================
// Entry points are generated by ferrocomm::algo::kernels (collective_entry,
// quick_reduce_entry), one FC_KERNEL per name, so a compile can hold any
// subset of the module.
