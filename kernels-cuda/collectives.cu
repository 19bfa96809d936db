// ferrocomm collective kernels: one-shot and two-shot all-reduce (pull, push, LL), broadcast,
// and the exchange and reduce-to protocols (all-gather, gather, scatter, all-to-all(-v),
// reduce-scatter, reduce).
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
// The lines, records and handshake are in common.cuh (the fused LL one-shot
// shares them). Thread t of a block handles lines t, t + nt, ... of the
// block's range, so a warp's stores cover contiguous memory.

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
// still missing. A poll loads every pending line before it tests any: with
// each test between the loads (ll_load), the sm_90 code issued one source's
// load only after the previous one had returned, so at world >= 3 a poll
// took a round trip per source (not timed at world >= 3).
FC_DEVICE bool ll_wait(const FcParams& p, const char* line, fc_u64 stride, fc_u32 s0, fc_u32 flag, fc_u32 epoch,
                       fc_u32 pending, fc_vec16 (&v)[4]) {
    const fc_u64 start = fc_globaltimer_ns();
    for (;;) {
        LlLine l[4];
#pragma unroll
        for (int s = 0; s < 4; ++s)
            if ((pending >> s) & 1u) l[s] = ll_fetch(line + (fc_u64)s * stride);
#pragma unroll
        for (int s = 0; s < 4; ++s)
            if (((pending >> s) & 1u) && ll_arrived(l[s], flag)) {
                v[s].w[0] = (fc_u32)l[s].a;
                v[s].w[1] = (fc_u32)l[s].b;
                pending &= ~(1u << s);
            }
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

    ll_send_record(p, parity, b, flag);

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

    bool failed = !ll_check_record(p, own, parity, b, flag, epoch);
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

// ===========================================================================
// Exchange and reduce-to (protocol.md "Data movement and reductions to some
// ranks"): the host protocols of backends/host/collectives.rs, multi-block.
//
// Per-peer lists come by value in the params (per_peer rows: 0 send counts,
// 1 send addresses, 2 receive counts, 3 receive addresses; elements of the
// call's dtype). Every source s has an inbox in slot A of each rank's parity
// region, `stride = push2_stride` bytes at s * stride; chunk c (epoch E + c)
// carries bytes [c*capb, (c+1)*capb) of every block, capb = (stride/ES)*ES.
//
// Pieces: a pair's block of `bytes` is cut, in every chunk, into pieces of
// `per = round_up16(ceil(min(bytes, capb) / gridDim))` bytes, and block b
// moves piece b of every pair. The sender cuts with its send count, the
// receiver with its receive count: equal when the lists agree (and if they do
// not, chunk 0's check below stops the receiver before it reads anything).
// So block b of a receiver reads only what block b of the source wrote before
// the flag it waited for, and block b touches the same inbox bytes in every
// chunk: the reuse argument of the push kinds holds per block. Pieces start
// on 16 bytes from the chunk's start (which is 64-byte aligned in the inbox):
// a user buffer gets the vector path when its address is 16-byte aligned,
// byte copies otherwise (any alignment, any count).
//
// Chunk 0's agreement: thread q < world writes, with the fingerprint, into
// peer q's aux words [parity][b][.][rank] the count we send q and the largest
// block we move (and premul_sum's factor). After its own wait, every thread of
// block b reads the aux words of block b (published by each source's block b
// before its flag) and so every block, on its own, (1) checks that each
// source sends what we expect (else a mismatch naming the source, raised by
// thread 0, and the block leaves without touching any output) and (2) takes
// nchunk = ceil(largest of the group / cap): every block of every rank gets
// the same number of epochs with no exchange between blocks.

FC_DEVICE fc_u64 round_up16(fc_u64 x) { return (x + 15) & ~(fc_u64)15; }

// Element size of a DType code (src/dtype.rs): f32 0, f16 1, bf16 2, i32 3,
// i8 4, u8 5, i64 6, f64 7, fp8 e4m3 8, fp8 e5m2 9.
FC_DEVICE fc_u64 dtype_bytes(fc_u32 code) {
    switch (code) {
        case 0: case 3: return 4;
        case 1: case 2: return 2;
        case 6: case 7: return 8;
        default: return 1;
    }
}

FC_DEVICE fc_u64 send_count(const FcParams& p, fc_u32 q) { return p.per_peer[0][q]; }
FC_DEVICE fc_u64 send_addr(const FcParams& p, fc_u32 q) { return p.per_peer[1][q]; }
FC_DEVICE fc_u64 recv_count(const FcParams& p, fc_u32 s) { return p.per_peer[2][s]; }
FC_DEVICE fc_u64 recv_addr(const FcParams& p, fc_u32 s) { return p.per_peer[3][s]; }

// The largest block (elements) this rank sends or receives.
FC_DEVICE fc_u64 largest_block(const FcParams& p) {
    fc_u64 m = 0;
    for (fc_u32 q = 0; q < p.world; ++q) {
        const fc_u64 a = send_count(p, q), b = recv_count(p, q);
        m = a > m ? a : m;
        m = b > m ? b : m;
    }
    return m;
}

FC_DEVICE fc_u64 pair_per(fc_u64 bytes, fc_u64 capb, fc_u32 nb) { return round_up16(div_ceil(min_u64(bytes, capb), nb)); }

// Piece b (bytes, relative to the chunk's start) of chunk c of a pair's block.
FC_DEVICE Range pair_piece(fc_u64 bytes, fc_u64 capb, fc_u32 nb, fc_u64 c, fc_u32 b) {
    const fc_u64 per = pair_per(bytes, capb, nb);
    const fc_u64 first = c * capb;
    const fc_u64 len = first < bytes ? min_u64(capb, bytes - first) : 0;
    Range r;
    r.lo = min_u64((fc_u64)b * per, len);
    r.hi = min_u64(r.lo + per, len);
    return r;
}

// Push piece b of chunk c of the block we send to q into q's inbox [rank].
FC_DEVICE void push_piece(const FcParams& p, fc_u32 q, fc_u64 region, fc_u64 stride, fc_u64 es, fc_u64 capb, fc_u64 c,
                          fc_u32 b, fc_u32 nb) {
    const fc_u64 addr = send_addr(p, q);
    const Range r = pair_piece(send_count(p, q) * es, capb, nb, c, b);
    if (r.hi <= r.lo) return;
    copy_range<1, FC_COPY_UNROLL>(fc_ptr<char>(p.peer_ws[q] + region + (fc_u64)p.rank * stride),
                                  fc_ptr<const char>(addr + c * capb), r.lo, r.hi, aligned16(addr));
}

// Chunk 0, before the arrive: thread q < world tells peer q (itself included)
// what we send it, what we expect from it, our largest block and our
// premul_sum factor (bits).
FC_DEVICE void announce(const FcParams& p, fc_u32 parity, fc_u32 b, fc_u64 largest, fc_u32 factor_bits) {
    const fc_u32 q = fc_thread_id();
    if (q >= p.world) return;
    char* peer = fc_ptr<char>(p.peer_ws[q]);
    fc_st_volatile_u64(aux_ptr(p, peer, parity, b, FC_AUX_PAIR_COUNT, p.rank), send_count(p, q));
    fc_st_volatile_u64(aux_ptr(p, peer, parity, b, FC_AUX_EXPECTS, p.rank), recv_count(p, q));
    fc_st_volatile_u64(aux_ptr(p, peer, parity, b, FC_AUX_LARGEST, p.rank), largest);
    fc_st_volatile_u64(aux_ptr(p, peer, parity, b, FC_AUX_FACTOR, p.rank), (fc_u64)factor_bits);
}

// Chunk 0, after the wait (every thread of the block computes the same):
// the group's number of chunks, or 0 after a mismatch (raised once, by
// thread 0, naming the first source that disagrees): a source that sends
// us another count than we expect, or expects another than we send it (so
// both ends of a pair that disagree fail).
FC_DEVICE fc_u64 agree_on_chunks(const FcParams& p, char* own, fc_u32 parity, fc_u32 b, fc_u32 epoch, fc_u64 largest,
                                 fc_u64 cap) {
    for (fc_u32 s = 0; s < p.world; ++s) {
        bool bad;
        if (s == p.rank) {
            bad = send_count(p, s) != recv_count(p, s);
        } else {
            const fc_u64 pair = fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_PAIR_COUNT, s));
            const fc_u64 expects = fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_EXPECTS, s));
            const fc_u64 theirs = fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_LARGEST, s));
            bad = pair != recv_count(p, s) || expects != send_count(p, s);
            largest = theirs > largest ? theirs : largest;
        }
        if (bad) {
            if (fc_thread_id() == 0) raise_mismatch(p, s, epoch);
            return 0;
        }
    }
    const fc_u64 n = div_ceil(largest, cap > 0 ? cap : 1);
    return n > 0 ? n : 1;
}

// Exchange: all-gather (list or single), gather, scatter, all-to-all(-v).
// Any dtype: bytes move unchanged. Per chunk c: push piece b of every send
// block's chunk into its receiver's inbox (peers staggered by block so all
// links are busy); arrive/wait phase 0; (chunk 0: agree, and our own block
// goes straight across, piece b of it, once); copy piece b of every inbox's
// chunk into its receive block (local reads).
// In place (all-to-all on one tensor with equal splits, an all-gather whose
// input is its own part): a receive block that is a send block is the same
// pair's, cut into the same pieces, and block b overwrites its piece of chunk
// c only after it pushed that piece (chunk c, before its wait); other chunks
// and pieces are other bytes. Peers never read our buffers, only inboxes.
// `e0`: the first chunk's epoch (the direct exchange falls back to this one
// from its own epoch + 1).
FC_DEVICE void exchange_from(const FcParams& p, fc_u32 e0) {
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u64 es = dtype_bytes(p.dtype);
    const fc_u64 stride = push2_stride(p);
    const fc_u64 cap = stride / es;
    const fc_u64 capb = cap * es;
    const fc_u64 largest = largest_block(p);

    fc_u64 nchunk = 1;
    for (fc_u64 c = 0; c < nchunk; ++c) {
        const fc_u32 epoch = e0 + (fc_u32)c;
        const fc_u32 parity = epoch & 1;
        const fc_u64 region = region_offset(p, parity);
        for (fc_u32 k = 0; k + 1 < world; ++k) {
            const fc_u32 q = (rank + 1 + (k + b) % (world - 1)) % world;
            push_piece(p, q, region, stride, es, capb, c, b, nb);
        }
        if (c == 0) announce(p, parity, b, largest, 0u);
        if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
        if (c == 0) {
            nchunk = agree_on_chunks(p, own, parity, b, epoch, largest, cap);
            if (nchunk == 0) return;
            const fc_u64 from = send_addr(p, rank), to = recv_addr(p, rank);
            const fc_u64 bytes = recv_count(p, rank) * es;
            if (from != to && bytes > 0) {
                // Piece b of the whole block (16-byte multiples: the vector path when both are aligned).
                const fc_u64 per = round_up16(div_ceil(bytes, nb));
                const fc_u64 lo = min_u64((fc_u64)b * per, bytes), hi = min_u64(lo + per, bytes);
                copy_range<1, FC_COPY_UNROLL>(fc_ptr<char>(to), fc_ptr<const char>(from), lo, hi,
                                              aligned16(from) && aligned16(to));
            }
        }
        for (fc_u32 s = 0; s < world; ++s) {
            if (s == rank) continue;
            const fc_u64 addr = recv_addr(p, s);
            const Range r = pair_piece(recv_count(p, s) * es, capb, nb, c, b);
            if (r.hi <= r.lo) continue;
            copy_range<1, FC_COPY_UNROLL>(fc_ptr<char>(addr + c * capb), own + region + (fc_u64)s * stride, r.lo, r.hi,
                                          aligned16(addr));
        }
    }
    complete(own, e0 + (fc_u32)(nchunk - 1));
}

FC_DEVICE void exchange(const FcParams& p) {
    const fc_u32 e0 = fc_ld_volatile(reinterpret_cast<const fc_u32*>(fc_ptr<char>(p.peer_ws[p.rank]))) + 1;
    exchange_from(p, e0);
}

// The copy route's handshake (protocol.md "Copy route"): the copy engines
// move the data between two launches of this one-block kernel, which moves
// none. p.aux is the phase: 0 before the pushes (every peer entered the
// call, with our fingerprint), 1 after them (every peer's pushes landed; it
// publishes the epoch). Phase 0 runs at E = epoch + 1, as every kind's first
// handshake, so a crossed call meets it there. The copies' addresses are
// fixed when queued (or captured), so the route's inboxes are always parity
// region 0, and phase 1 ends the call at an even epoch (E rounded up, alike
// on every rank): the next launch, at an odd epoch, writes only region 1
// before its first wait.
FC_DEVICE void copy_sync(const FcParams& p) {
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    if (p.aux == 1u) epoch += epoch & 1u;
    if (!arrive_wait(p, own, epoch, epoch & 1u, p.aux, 0u)) return;
    if (p.aux == 1u) complete(own, epoch);
}

// Phase 0 of the direct kinds, by thread t != rank of every block: tell peer
// t the count we send it, the count we expect from it (aux word 1, which
// these kinds do not use for the largest block: each side checks the
// other's before a byte moves) and `at`, where the block of the pair that
// lives in our heap sits (an offset; 0 for an empty block, so no address can
// read as FC_AUX_NOT_DIRECT; FC_AUX_NOT_DIRECT when we cannot go direct).
FC_DEVICE void direct_announce(const FcParams& p, fc_u32 parity, fc_u32 b, fc_u32 t, fc_u64 at) {
    char* peer = fc_ptr<char>(p.peer_ws[t]);
    fc_st_volatile_u64(aux_ptr(p, peer, parity, b, FC_AUX_PAIR_COUNT, p.rank), send_count(p, t));
    fc_st_volatile_u64(aux_ptr(p, peer, parity, b, FC_AUX_LARGEST, p.rank), recv_count(p, t));
    fc_st_volatile_u64(aux_ptr(p, peer, parity, b, FC_AUX_RECV_AT, p.rank), at);
}

// After the phase-0 wait (every thread of the block computes the same): 1
// when every rank can go direct, 0 when every rank falls back, -1 after a
// count mismatch on either side of a pair (raised once, by thread 0, naming
// the peer; the block then leaves without touching anyone's memory).
FC_DEVICE int direct_agree(const FcParams& p, char* own, fc_u32 parity, fc_u32 b, fc_u32 epoch, bool direct_ok) {
    bool all_direct = direct_ok;
    for (fc_u32 s = 0; s < p.world; ++s) {
        bool bad;
        if (s == p.rank) {
            bad = send_count(p, s) != recv_count(p, s);
        } else {
            bad = fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_PAIR_COUNT, s)) != recv_count(p, s) ||
                  fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_LARGEST, s)) != send_count(p, s);
            all_direct = all_direct && fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_RECV_AT, s)) != FC_AUX_NOT_DIRECT;
        }
        if (bad) {
            if (fc_thread_id() == 0) raise_mismatch(p, s, epoch);
            return -1;
        }
    }
    return all_direct ? 1 : 0;
}

// Direct exchange (zero copy into symmetric-heap blocks; host twin:
// backends/host/collectives.rs `exchange_direct`). Phase 0: thread q < world
// tells peer q what we send it and where q's block to us lands, as an offset
// in our heap (FC_AUX_RECV_AT), or FC_AUX_NOT_DIRECT when the host found our
// receive blocks outside our heap or overlapping what we send. Passing the
// wait proves every receiver entered the launch (its stream is done with
// those blocks). If every rank can take blocks in place (each rank told
// every other, so all decide alike), piece b of every send block goes
// straight to table[q] + offset (peers staggered by block), our own block is
// copied across, and phase 1 tells receivers their blocks have landed.
// Otherwise every rank runs the inbox exchange from the next epoch, whose
// parity region the previous launch's last chunk used: passing this wait
// proves every peer's block b is done with it, as between chunks.
FC_DEVICE void exchange_direct(const FcParams& p) {
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u64 es = dtype_bytes(p.dtype);
    const fc_u64* bases = fc_ptr<const fc_u64>(p.table);
    const bool direct_ok = (p.flags & FC_PARAM_DIRECT_OK) != 0 && p.table != 0;

    // Where each peer's block to us lands in our heap.
    const fc_u32 t = fc_thread_id();
    if (t < world && t != rank)
        direct_announce(p, parity, b, t,
                        !direct_ok ? FC_AUX_NOT_DIRECT : recv_count(p, t) == 0 ? 0 : recv_addr(p, t) - bases[rank]);
    if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
    const int way = direct_agree(p, own, parity, b, epoch, direct_ok);
    if (way < 0) return;
    if (way == 0) {
        exchange_from(p, epoch + 1);
        return;
    }

    for (fc_u32 k = 0; k + 1 < world; ++k) {
        const fc_u32 q = (rank + 1 + (k + b) % (world - 1)) % world;
        const fc_u64 bytes = send_count(p, q) * es;
        if (bytes == 0) continue;
        const fc_u64 at = fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_RECV_AT, q));
        const fc_u64 from = send_addr(p, q), to = bases[q] + at;
        const fc_u64 per = round_up16(div_ceil(bytes, nb));
        const fc_u64 lo = min_u64((fc_u64)b * per, bytes), hi = min_u64(lo + per, bytes);
        copy_range<1, FC_COPY_UNROLL>(fc_ptr<char>(to), fc_ptr<const char>(from), lo, hi,
                                      aligned16(from) && aligned16(to));
    }
    const fc_u64 from = send_addr(p, rank), to = recv_addr(p, rank);
    const fc_u64 bytes = recv_count(p, rank) * es;
    if (from != to && bytes > 0) {
        const fc_u64 per = round_up16(div_ceil(bytes, nb));
        const fc_u64 lo = min_u64((fc_u64)b * per, bytes), hi = min_u64(lo + per, bytes);
        copy_range<1, FC_COPY_UNROLL>(fc_ptr<char>(to), fc_ptr<const char>(from), lo, hi,
                                      aligned16(from) && aligned16(to));
    }
    if (!arrive_wait(p, own, epoch, parity, 1, b)) return;
    complete(own, epoch);
}

// premul_sum's own factor: f32 bits in `scalar`, or the address of one
// element of the call's dtype (FC_PARAM_SCALAR_IS_PTR); 1.0 for other ops.
template <class T, int OP>
FC_DEVICE float own_factor(const FcParams& p) {
    if (OP != FC_OP_PREMUL) return 1.0f;
    if ((p.flags & FC_PARAM_SCALAR_IS_PTR) == 0) return fc_u32_as_f32((fc_u32)p.scalar);
    return (float)T::to_acc(fc_load(fc_ptr<const typename T::S>(p.scalar)));
}

FC_DEVICE float premul_scale(float x, float f) { return fc_fmul(x, f); }
FC_DEVICE fc_i32 premul_scale(fc_i32 x, float) { return x; }

// premul_sum over the inboxes (or, direct, the sources' blocks): acc =
// x_0 * f_0; acc = acc + x_r * f_r in rank order (each product and sum
// rounded to f32: no FMA), then narrowed once, as the host's Tiles. Factors
// (and DirectSrc's addresses) come in registers: constant indices, ranks
// unrolled in both loops. `out_aligned`: the vector path, for which every
// source must be 16-byte aligned at element lo too.
template <class T, class Src>
FC_DEVICE void reduce_premul(const FcParams& p, const Src& src, char* out, fc_u64 lo, fc_u64 hi, bool out_aligned,
                             const float (&f)[FC_MAX_RANKS]) {
    typedef typename T::S S;
    typedef typename T::Acc Acc;
    const fc_u32 nt = fc_block_threads();
    const fc_u32 world = p.world;
    fc_u64 tail = lo;
    if (out_aligned) {
        const fc_u64 nvec = (hi - lo) / T::VEC;
        const fc_u64 byte0 = lo * sizeof(S);
        for (fc_u64 i = fc_thread_id(); i < nvec; i += nt) {
            const fc_u64 off = byte0 + i * 16;
            Acc a[T::VEC];
            T::unpack(fc_load16(fc_ptr<const char>(src_base(src, 0) + off)), a);
#pragma unroll
            for (int k = 0; k < T::VEC; ++k) a[k] = premul_scale(a[k], f[0]);
#pragma unroll
            for (int r = 1; r < (int)FC_MAX_RANKS; ++r) {
                if ((fc_u32)r >= world) break;
                Acc x[T::VEC];
                T::unpack(fc_load16(fc_ptr<const char>(src_base(src, r) + off)), x);
#pragma unroll
                for (int k = 0; k < T::VEC; ++k) a[k] = Op<FC_OP_SUM>::apply(a[k], premul_scale(x[k], f[r]));
            }
            fc_store16(out + off, T::pack(a));
        }
        tail = lo + nvec * T::VEC;
    }
    for (fc_u64 e = tail + fc_thread_id(); e < hi; e += nt) {
        const fc_u64 off = e * sizeof(S);
        Acc a = premul_scale(T::to_acc(fc_load(fc_ptr<const S>(src_base(src, 0) + off))), f[0]);
#pragma unroll
        for (int r = 1; r < (int)FC_MAX_RANKS; ++r) {
            if ((fc_u32)r >= world) break;
            a = Op<FC_OP_SUM>::apply(a, premul_scale(T::to_acc(fc_load(fc_ptr<const S>(src_base(src, r) + off))), f[r]));
        }
        fc_store(reinterpret_cast<S*>(out + off), T::from_acc(a));
    }
}

// Reduce-to: reduce-scatter, reduce. As the exchange, but our own block goes
// into our own inbox [rank] too (last), and each receiver reduces piece b of
// the chunk from its inboxes 0..world-1 (local, 16-byte aligned) in rank
// order into the output (the receive count's chunk; rule of protocol.md).
// An output not aligned to its element gets the result in our own inbox
// [rank] first (each element read and written by one thread), then a byte
// copy. In place (the output is our own send block): as the exchange's.
// `e0`: the first chunk's epoch (the direct reduce-to falls back to this one
// from its own epoch + 1).
template <class T, int OP>
FC_DEVICE void reduce_to_from(const FcParams& p, fc_u32 e0) {
    typedef typename T::S S;
    const fc_u64 es = sizeof(S);
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u64 stride = push2_stride(p);
    const fc_u64 cap = stride / es;
    const fc_u64 capb = cap * es;
    const fc_u64 largest = largest_block(p);
    // What we receive: every source's block of n elements (counts agreed).
    fc_u64 n = 0;
    for (fc_u32 s = 0; s < world; ++s) n = recv_count(p, s) > n ? recv_count(p, s) : n;
    const fc_u64 out_addr = p.output;
    const bool out_elem = (out_addr % es) == 0;
    const bool out_aligned = aligned16(out_addr);
    float f[FC_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < (int)FC_MAX_RANKS; ++r) f[r] = 1.0f;

    fc_u64 nchunk = 1;
    for (fc_u64 c = 0; c < nchunk; ++c) {
        const fc_u32 epoch = e0 + (fc_u32)c;
        const fc_u32 parity = epoch & 1;
        const fc_u64 region = region_offset(p, parity);
        for (fc_u32 k = 0; k + 1 < world; ++k) {
            const fc_u32 q = (rank + 1 + (k + b) % (world - 1)) % world;
            push_piece(p, q, region, stride, es, capb, c, b, nb);
        }
        push_piece(p, rank, region, stride, es, capb, c, b, nb);
        if (c == 0) announce(p, parity, b, largest, fc_f32_as_u32(own_factor<T, OP>(p)));
        if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
        if (c == 0) {
            nchunk = agree_on_chunks(p, own, parity, b, epoch, largest, cap);
            if (nchunk == 0) return;
            if (OP == FC_OP_PREMUL) {
#pragma unroll
                for (int r = 0; r < (int)FC_MAX_RANKS; ++r)
                    if ((fc_u32)r < world)
                        f[r] = fc_u32_as_f32((fc_u32)fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_FACTOR, r)));
            }
        }
        const Range r = pair_piece(n * es, capb, nb, c, b);
        if (r.hi <= r.lo) continue;
        const StrideSrc src = {p.peer_ws[rank] + region, stride};
        char* mine = own + region + (fc_u64)rank * stride;
        char* dst = out_elem ? fc_ptr<char>(out_addr + c * capb) : mine;
        const bool dst_aligned = out_elem ? out_aligned : true;
        if (OP == FC_OP_PREMUL) {
            reduce_premul<T>(p, src, dst, r.lo / es, r.hi / es, dst_aligned, f);
        } else {
            const OutDst d = {dst};
            reduce_range<T, OP, true>(p, src, d, r.lo / es, r.hi / es, dst_aligned);
        }
        if (!out_elem) {
            fc_barrier(); // the piece's results, written by all threads, before the copy
            copy_range<1, FC_COPY_UNROLL>(fc_ptr<char>(out_addr + c * capb), mine, r.lo, r.hi, false);
        }
    }
    complete(own, e0 + (fc_u32)(nchunk - 1));
}

template <class T, int OP>
FC_DEVICE void reduce_to(const FcParams& p) {
    const fc_u32 e0 = fc_ld_volatile(reinterpret_cast<const fc_u32*>(fc_ptr<char>(p.peer_ws[p.rank]))) + 1;
    reduce_to_from<T, OP>(p, e0);
}

// Reduce elements [lo, hi) of every rank's block (DirectSrc) into out, with
// the arithmetic of reduce_range (the reduce-to's): its vector paths when
// `aligned` (every source and out 16-byte aligned at lo), then the rest
// element by element with the ranks unrolled (constant indices keep the
// addresses in registers).
template <class T, int OP>
FC_DEVICE void reduce_direct(const FcParams& p, const DirectSrc& src, char* out, fc_u64 lo, fc_u64 hi, bool aligned) {
    typedef typename T::S S;
    typedef typename T::Acc Acc;
    const fc_u32 world = p.world;
    fc_u64 tail = lo;
    if (aligned && world >= 2 && world <= FC_MAX_RANKS) {
        const OutDst d = {out};
        const fc_u64 nvec = (hi - lo) / T::VEC;
        switch (world) {
            case 2: reduce_vec<T, OP, 2, FC_REDUCE_UNROLL>(src, d, lo, nvec); break;
            case 4: reduce_vec<T, OP, 4, FC_REDUCE_UNROLL>(src, d, lo, nvec); break;
            case 8: reduce_vec<T, OP, 8, 1>(src, d, lo, nvec); break;
            default: reduce_vec_any<T, OP>(p, src, d, lo, nvec); break;
        }
        tail = lo + nvec * T::VEC;
    }
    const fc_u32 nt = fc_block_threads();
    const AvgDiv avg = make_avg(world);
    for (fc_u64 e = tail + fc_thread_id(); e < hi; e += nt) {
        const fc_u64 off = e * sizeof(S);
        Acc a = T::to_acc(fc_load(fc_ptr<const S>(src.a[0] + off)));
#pragma unroll
        for (int r = 1; r < (int)FC_MAX_RANKS; ++r) {
            if ((fc_u32)r >= world) break;
            a = Op<OP>::apply(a, T::to_acc(fc_load(fc_ptr<const S>(src.a[r] + off))));
        }
        fc_store(reinterpret_cast<S*>(out + off), T::from_acc(finish<OP>(a, avg)));
    }
}

// Direct reduce-to (pull; host twin: backends/host/collectives.rs
// `reduce_to_direct`). Phase 0: thread t < world, t != rank, tells peer t
// what we send it, what we expect from it, our premul_sum factor, and where
// our block to it lies, as an offset in our heap (FC_AUX_RECV_AT), or
// FC_AUX_NOT_DIRECT when the host found our blocks to peers outside our
// heap, overlapping our output or not aligned to their element. Passing
// the wait proves every source entered the launch (its stream is done
// writing what it sends) and lets both sides of every pair check its
// counts before anyone reads. If every rank's blocks can be read in place
// (each rank told every other, so all decide alike), block b reduces piece
// b of our output straight from table[s] + offset for every source s (our
// own block from our send list), in rank order with the reduce-to's
// arithmetic, and phase 1 tells every source its blocks have been read, so
// no source's launch ends (and its stream reuses its input) before its
// readers are done. In place (the output is our own send block, which no
// peer reads): each element is read and then written by the same thread.
// Otherwise every rank runs the inbox reduce-to from the next epoch, whose
// parity region the previous launch's last chunk used: passing this wait
// proves every peer's block b is done with it, as between chunks.
template <class T, int OP>
FC_DEVICE void reduce_to_direct(const FcParams& p) {
    typedef typename T::S S;
    const fc_u64 es = sizeof(S);
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 b = fc_block_id();
    const fc_u32 nb = fc_grid_blocks();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u64* bases = fc_ptr<const fc_u64>(p.table);
    fc_u64 n = 0;
    for (fc_u32 s = 0; s < world; ++s) n = recv_count(p, s) > n ? recv_count(p, s) : n;
    // A receiver reads n elements of every source: with receive counts that
    // differ it would read past a shorter block, so it takes the inbox way.
    bool uniform = true;
    for (fc_u32 s = 0; s < world; ++s) uniform = uniform && recv_count(p, s) == n;
    const bool direct_ok = (p.flags & FC_PARAM_DIRECT_OK) != 0 && p.table != 0 && uniform;
    const float factor = own_factor<T, OP>(p);

    // Where our block to each peer sits in our heap, and our premul factor.
    const fc_u32 t = fc_thread_id();
    if (t < world && t != rank) {
        direct_announce(p, parity, b, t,
                        !direct_ok ? FC_AUX_NOT_DIRECT : send_count(p, t) == 0 ? 0 : send_addr(p, t) - bases[rank]);
        fc_st_volatile_u64(aux_ptr(p, fc_ptr<char>(p.peer_ws[t]), parity, b, FC_AUX_FACTOR, rank),
                           (fc_u64)fc_f32_as_u32(factor));
    }
    if (!arrive_wait(p, own, epoch, parity, 0, b)) return;
    const int way = direct_agree(p, own, parity, b, epoch, direct_ok);
    if (way < 0) return;
    if (way == 0) {
        reduce_to_from<T, OP>(p, epoch + 1);
        return;
    }

    const fc_u64 bytes = n * es;
    const fc_u64 per = round_up16(div_ceil(bytes, nb));
    const fc_u64 lo = min_u64((fc_u64)b * per, bytes), hi = min_u64(lo + per, bytes);
    if (hi > lo) {
        DirectSrc src;
        float f[FC_MAX_RANKS];
        bool aligned = aligned16(p.output);
#pragma unroll
        for (int r = 0; r < (int)FC_MAX_RANKS; ++r) {
            src.a[r] = 0;
            f[r] = 1.0f;
            if ((fc_u32)r >= world) continue;
            if ((fc_u32)r == rank) {
                src.a[r] = send_addr(p, rank);
                f[r] = factor;
            } else {
                src.a[r] = bases[r] + fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_RECV_AT, r));
                if (OP == FC_OP_PREMUL)
                    f[r] = fc_u32_as_f32((fc_u32)fc_ld_volatile_u64(aux_ptr(p, own, parity, b, FC_AUX_FACTOR, r)));
            }
            aligned = aligned && aligned16(src.a[r]);
        }
        char* out = fc_ptr<char>(p.output);
        if (OP == FC_OP_PREMUL) {
            reduce_premul<T>(p, src, out, lo / es, hi / es, aligned, f);
        } else {
            reduce_direct<T, OP>(p, src, out, lo / es, hi / es, aligned);
        }
    }
    if (!arrive_wait(p, own, epoch, parity, 1, b)) return;
    complete(own, epoch);
}

// ===========================================================================
// Exchange and reduce-to, LL (protocol.md "Exchange and reduce-to, LL"):
// the small-message twins of the two kinds above, on the LL lines of
// oneshot_ll instead of inboxes and flags. The host takes them only when
// every non-empty block of the call is the agreed p.count elements (the
// fingerprint covers it) and fits one source's lines (ll_stride / 2 bytes),
// so there are no chunks and no counts to agree on. Block b owns the lines
// of block_range(p.count, b, gridDim) of every pair's block; the sender and
// the receiver cut alike, and every line is cleared by the thread that
// read it. Sources are awaited four at a time, their loads in flight
// together. Every rank sends and awaits the fingerprint record with every
// peer, also one it moves nothing with (gather, scatter, reduce), so the
// reuse argument of oneshot_ll holds.

// Exchange, LL: all-gather, gather, scatter (bytes of any dtype, unchanged).
// Every line of a send block goes to its receiver as soon as the thread has
// loaded it; after the records, thread t writes line i of every received
// block (and of our own, straight across, unless in place), so a receive
// block that is its own pair's send block is overwritten only after the
// same thread pushed that line.
FC_DEVICE void exchange_ll(const FcParams& p) {
    char* own = fc_ptr<char>(p.peer_ws[p.rank]);
    const fc_u32 epoch = fc_ld_volatile(reinterpret_cast<const fc_u32*>(own)) + 1;
    const fc_u32 parity = epoch & 1;
    const fc_u32 flag = epoch | 1u;
    const fc_u32 b = fc_block_id();
    const fc_u32 world = p.world;
    const fc_u32 rank = p.rank;
    const fc_u32 t = fc_thread_id();
    const fc_u32 nt = fc_block_threads();
    const fc_u64 es = dtype_bytes(p.dtype);
    // Bytes: a range of whole elements, 8-element multiples, so whole lines.
    Range r = block_range(p.count, b, fc_grid_blocks());
    r.lo *= es;
    r.hi *= es;
    const fc_u64 nline = div_ceil(r.hi - r.lo, 8);
    const fc_u64 stride = ll_stride(p);
    const fc_u64 lines = ll_lines_offset(p, parity) + (r.lo / 8) * 16u;

    ll_send_record(p, parity, b, flag);
    for (fc_u64 i = t; i < nline; i += nt) {
        const fc_u64 e0 = r.lo + i * 8;
        for (fc_u32 k = 1; k < world; ++k) {
            fc_u32 q = rank + k;
            if (q >= world) q -= world;
            const fc_u64 n = send_count(p, q) * es;
            if (n <= e0) continue;
            const fc_u64 addr = send_addr(p, q);
            fc_u32 w0, w1;
            load_line<1>(fc_ptr<const char>(addr), e0, min_u64(r.hi, n), (addr & 3) == 0, w0, w1);
            fc_st_volatile_v2u64(fc_ptr<char>(p.peer_ws[q] + lines + (fc_u64)rank * stride + i * 16u),
                                 ll_unit(w0, flag), ll_unit(w1, flag));
        }
    }
    bool failed = !ll_check_record(p, own, parity, b, flag, epoch);
    if (fc_barrier_or(failed)) return;

    const fc_u64 from = send_addr(p, rank), to = recv_addr(p, rank);
    const fc_u64 n_own = from != to ? recv_count(p, rank) * es : 0;
    char* at = own + lines;
    for (fc_u64 i = t; i < nline; i += nt) {
        const fc_u64 e0 = r.lo + i * 8;
        if (e0 < n_own) {
            fc_u32 w0, w1;
            load_line<1>(fc_ptr<const char>(from), e0, min_u64(r.hi, n_own), (from & 3) == 0, w0, w1);
            store_line<1>(fc_ptr<char>(to), e0, min_u64(r.hi, n_own), (to & 3) == 0, w0, w1);
        }
#pragma unroll
        for (int g = 0; g < (int)FC_MAX_RANKS; g += 4) {
            if ((fc_u32)g >= world) break;
            fc_vec16 v[4];
            fc_u32 take = 0, pending = 0;
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const fc_u32 src = (fc_u32)(g + s);
                if (src >= world || src == rank || recv_count(p, src) * es <= e0) continue;
                take |= 1u << s;
                if (!ll_load(at + i * 16u + (fc_u64)src * stride, flag, v[s].w[0], v[s].w[1])) pending |= 1u << s;
            }
            if (pending != 0 && !ll_wait(p, at + i * 16u + (fc_u64)g * stride, stride, (fc_u32)g, flag, epoch, pending, v)) {
                failed = true;
                break;
            }
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                if (((take >> s) & 1u) == 0) continue;
                const fc_u32 src = (fc_u32)(g + s);
                const fc_u64 addr = recv_addr(p, src);
                store_line<1>(fc_ptr<char>(addr), e0, min_u64(r.hi, recv_count(p, src) * es), (addr & 3) == 0,
                              v[s].w[0], v[s].w[1]);
                fc_st_volatile_v2u64(at + i * 16u + (fc_u64)src * stride, 0ull, 0ull);
            }
        }
        if (failed) break;
    }
    if (fc_barrier_or(failed)) return;
    complete(own, epoch);
}

// load_line / store_line for a buffer of any alignment: element accesses
// when it is aligned to its element, byte accesses otherwise (the same 8
// bytes either way). Reduce-scatter and reduce take tensors at any byte
// offset; a 4-byte access to an f32 at an odd address faults.
template <int ES>
FC_DEVICE void ll_load_any(const char* buf, fc_u64 e0, fc_u64 hi, fc_u32& w0, fc_u32& w1) {
    const fc_u64 a = (fc_u64)buf;
    if (a % ES == 0)
        load_line<ES>(buf, e0, hi, (a & 3) == 0, w0, w1);
    else
        load_line<1>(buf, e0 * ES, hi * ES, false, w0, w1);
}

template <int ES>
FC_DEVICE void ll_store_any(char* buf, fc_u64 e0, fc_u64 hi, fc_u32 w0, fc_u32 w1) {
    const fc_u64 a = (fc_u64)buf;
    if (a % ES == 0)
        store_line<ES>(buf, e0, hi, (a & 3) == 0, w0, w1);
    else
        store_line<1>(buf, e0 * ES, hi * ES, false, w0, w1);
}

// Reduce-to, LL: reduce-scatter, reduce (every op but premul_sum, whose
// per-source factors have no place in a line). A receiver gets p.count
// elements from every source; line i of its output is our own block's line
// (re-read by the thread that writes the output line, so in place is safe)
// reduced with every peer's in rank order (ll_reduce_line: the same
// arithmetic as every other path, so the same bits).
template <class T, int OP>
FC_DEVICE void reduce_to_ll(const FcParams& p) {
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
    const fc_u64 nline = div_ceil(r.hi - r.lo, H);
    const fc_u64 stride = ll_stride(p);
    const fc_u64 lines = ll_lines_offset(p, parity) + (r.lo / H) * 16u;

    ll_send_record(p, parity, b, flag);
    for (fc_u64 i = t; i < nline; i += nt) {
        const fc_u64 e0 = r.lo + i * H;
        for (fc_u32 k = 1; k < world; ++k) {
            fc_u32 q = rank + k;
            if (q >= world) q -= world;
            const fc_u64 n = send_count(p, q);
            if (n <= e0) continue;
            fc_u32 w0, w1;
            ll_load_any<ES>(fc_ptr<const char>(send_addr(p, q)), e0, min_u64(r.hi, n), w0, w1);
            fc_st_volatile_v2u64(fc_ptr<char>(p.peer_ws[q] + lines + (fc_u64)rank * stride + i * 16u),
                                 ll_unit(w0, flag), ll_unit(w1, flag));
        }
    }
    bool failed = !ll_check_record(p, own, parity, b, flag, epoch);
    if (fc_barrier_or(failed)) return;

    if (recv_count(p, rank) > 0) {
        const AvgDiv avg = make_avg(world);
        char* at = own + lines;
        const char* input = fc_ptr<const char>(send_addr(p, rank));
        char* output = fc_ptr<char>(p.output);
        for (fc_u64 i = t; i < nline; i += nt) {
            fc_u32 w0, w1, r0, r1;
            ll_load_any<ES>(input, r.lo + i * H, r.hi, w0, w1);
            if (!ll_reduce_line<T, OP>(p, flag, epoch, at + i * 16u, stride, w0, w1, avg, r0, r1)) {
                failed = true;
                break;
            }
            ll_store_any<ES>(output, r.lo + i * H, r.hi, r0, r1);
            ll_clear_lines(at + i * 16u, stride, world, rank);
        }
    }
    if (fc_barrier_or(failed)) return;
    complete(own, epoch);
}

} // namespace fc

// ===========================================================================
// Entry points are generated by ferrocomm::algo::kernels (collective_entry,
// quick_reduce_entry), one FC_KERNEL per name, so a compile can hold any
// subset of the module.
