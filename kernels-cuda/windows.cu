// Window signals (src/comm/window.rs), written against the device API.
//
// A window's signal words, in the symmetric heap: u64 [FC_MAX_RANKS] that each
// rank adds to when it signals us, then u64 [FC_MAX_RANKS] counting the waits
// this rank has done on each peer. Both only grow, so graph replays of a
// signal/wait pair need no host bookkeeping: the n-th wait waits for the n-th
// signal.
#ifndef FC_PRELUDE_INCLUDED
#include "prelude.cuh"
#endif
// In the run-time module the header precedes this text (src/comm/window.rs).
#ifndef FC_DEVICE_API_INCLUDED
#include "device_api.cuh"
#endif

struct FcWinArgs {
    FcDevCtx ctx;
    fc_u64 signals;  // this rank's signal words (local heap address)
    fc_u32 peer;     // whom to signal / whose signal to wait for
    fc_u32 pad;
};
static_assert(sizeof(FcWinArgs) == 120, "FcWinArgs must match WinArgs in src/comm/window.rs");

// One thread is enough. The stream's earlier puts are copy-engine copies
// into the peer's memory: stream order finishes them before this kernel
// starts, so the release add publishes a count only after the data landed.
// The fence orders this kernel's own earlier writes (none today) as well.
FC_HEAP_KERNEL(fc_win_signal, FcWinArgs) {
    if (fc_thread_id() != 0 || fc_block_id() != 0) return;
    fc_fence();
    fc_u64* sig = fc_ptr<fc_u64>(a.signals) + a.ctx.rank;
    fc_signal_add(a.ctx, a.peer, sig, 1);
}

FC_HEAP_KERNEL(fc_win_wait, FcWinArgs) {
    if (fc_thread_id() != 0 || fc_block_id() != 0) return;
    fc_u64* sig = fc_ptr<fc_u64>(a.signals);
    fc_u64* waits = sig + FC_MAX_RANKS;
    const fc_u64 expected = fc_atomic_add(a.ctx, a.ctx.rank, waits + a.peer, 1) + 1;
    fc_wait_until(a.ctx, sig + a.peer, FC_CMP_GE, expected, a.peer);
}

// The chunked reduce-scatter's reduction (src/comm/overlap/reduce_scatter.rs).
// The inbox holds one slot of `count` elements per rank, slot r written by
// rank r. out[i] = inbox[0][i] (+) inbox[1][i] (+) ... in rank order, floats
// widened to f32 (no FMA contraction), i32 wrapping; avg divides the f32 sum
// by world once, correctly rounded (RN32(RN64(x / n)) is RN32(x / n), as for
// collectives.cu's avg), then the result is narrowed once. These are the
// reference's bits (src/dtype.rs), so the chunked reduce-scatter matches a
// plain reduce_scatter bit for bit.
struct FcWinReduceArgs {
    FcDevCtx ctx;
    fc_u64 inbox;   // world slots of `count` elements (local address)
    fc_u64 out;     // `count` elements
    fc_u64 count;
    fc_u32 world;
    fc_u32 dtype;   // FC_DTYPE_{F32,F16,BF16,I32}
    fc_u32 op;      // FC_OP_SUM or FC_OP_AVG
    fc_u32 pad;
};
static_assert(sizeof(FcWinReduceArgs) == 144, "FcWinReduceArgs must match ReduceArgs in src/comm/overlap/mod.rs");

FC_DEVICE float fc_win_load_f(const char* slot, fc_u64 i, fc_u32 dtype) {
    if (dtype == FC_DTYPE_F32) return fc_load(reinterpret_cast<const float*>(slot) + i);
    const fc_u16 h = fc_load(reinterpret_cast<const fc_u16*>(slot) + i);
    return dtype == FC_DTYPE_F16 ? fc_f16_to_f32(h) : fc_bf16_to_f32(h);
}

// Grid-stride over elements, one element a thread a step: the reduction is a
// small part of a reduce-scatter whose chunks come from GEMMs.
FC_HEAP_KERNEL(fc_win_reduce, FcWinReduceArgs) {
    const fc_u64 esize = (a.dtype == FC_DTYPE_F32 || a.dtype == FC_DTYPE_I32) ? 4 : 2;
    const fc_u64 slot = a.count * esize;
    const char* inbox = fc_ptr<const char>(a.inbox);
    const fc_u64 stride = (fc_u64)fc_grid_blocks() * fc_block_threads();
    for (fc_u64 i = (fc_u64)fc_block_id() * fc_block_threads() + fc_thread_id(); i < a.count; i += stride) {
        if (a.dtype == FC_DTYPE_I32) {
            fc_u32 acc = 0;
            for (fc_u32 r = 0; r < a.world; ++r)
                acc += (fc_u32)fc_load(reinterpret_cast<const fc_i32*>(inbox + r * slot) + i);
            fc_store(fc_ptr<fc_i32>(a.out) + i, (fc_i32)acc);
            continue;
        }
        float acc = fc_win_load_f(inbox, i, a.dtype);
        for (fc_u32 r = 1; r < a.world; ++r) acc = fc_fadd(acc, fc_win_load_f(inbox + r * slot, i, a.dtype));
        if (a.op == FC_OP_AVG) acc = fc_f64_to_f32(fc_f32_to_f64(acc) / (double)a.world);
        if (a.dtype == FC_DTYPE_F32) {
            fc_store(fc_ptr<float>(a.out) + i, acc);
        } else {
            const fc_u16 h = a.dtype == FC_DTYPE_F16 ? fc_f32_to_f16(acc) : fc_f32_to_bf16(acc);
            fc_store(fc_ptr<fc_u16>(a.out) + i, h);
        }
    }
}
