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
