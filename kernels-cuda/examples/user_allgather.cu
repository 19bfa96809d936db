// user_allgather: an all-gather written the way a user would, against the
// device API (kernels-cuda/device_api.cuh, docs/device-api.md). Rank r's
// input lands at heap_out + r * bytes_per_rank on every rank.
//
// Entry point `user_allgather` (extern "C"); its one by-value argument
// (144 bytes, no padding):
//
//   struct UserAllgatherArgs {
//       FcDevCtx ctx;          // the communicator's device context
//       fc_u64 input;          // bytes_per_rank bytes, any device memory of this rank
//       fc_u64 heap_out;       // symmetric heap buffer, world * bytes_per_rank bytes (local address)
//       fc_u64 bytes_per_rank; // equal on every rank within one call (may change between calls)
//       fc_u64 signal;         // symmetric heap u64[2 * FC_MAX_RANKS] (local address), zeroed once
//       fc_u64 epoch_word;     // heap u64 that only this rank's user_allgather uses, zeroed once
//   };
//
// Any grid size, and a different one per rank or per call. Launches back to
// back and graph replays need no host reset: the counters live on the device.
//
// Protocol of a rank's e-th launch (e counted on the device in epoch_word):
// - signal[FC_MAX_RANKS + q] = launches q has started. A rank starts launch e
//   only after the work before it on its stream (the readers of launch e-1's
//   output) is done, so once q announces e, q's heap_out may be overwritten.
//   Every block announces (the same value; any block running is enough).
// - signal[q] = bytes of q's slot delivered and not yet consumed; every block
//   adds the size of its share after putting it. Block 0 waits for all
//   bytes_per_rank bytes from every peer, then takes them back out.
// - epoch_word = launches done << 32 | blocks of this launch done; the last
//   block to finish moves it to e << 32. Every block read it at its start, so
//   none can see the new value early.

#ifndef FC_DEVICE_API_INCLUDED
#include "../device_api.cuh"
#endif

struct UserAllgatherArgs {
    FcDevCtx ctx;
    fc_u64 input;
    fc_u64 heap_out;
    fc_u64 bytes_per_rank;
    fc_u64 signal;
    fc_u64 epoch_word;
};
static_assert(sizeof(UserAllgatherArgs) == 144, "UserAllgatherArgs is 144 bytes");

FC_HEAP_KERNEL(user_allgather, UserAllgatherArgs) {
    const FcDevCtx& ctx = a.ctx;
    const fc_u32 t = fc_thread_id(), b = fc_block_id(), nb = fc_grid_blocks();
    fc_u64* delivered = fc_ptr<fc_u64>(a.signal);
    fc_u64* started = delivered + FC_MAX_RANKS;
    fc_u64* epoch_word = fc_ptr<fc_u64>(a.epoch_word);
    const fc_u64 e = (fc_ld_volatile_u64(epoch_word) >> 32) + 1u;

    // This block's share of the input: 16-byte multiples, so the pieces stay
    // as aligned as the buffers are.
    const fc_u64 n = a.bytes_per_rank;
    const fc_u64 per = ((n + nb - 1u) / nb + 15u) & ~(fc_u64)15u;
    const fc_u64 lo = b * per < n ? b * per : n;
    const fc_u64 len = n - lo < per ? n - lo : per;
    const char* src = fc_ptr<const char>(a.input) + lo;
    char* dst = fc_ptr<char>(a.heap_out) + ctx.rank * n + lo;

    if (t < ctx.world) fc_signal_set(ctx, t, started + ctx.rank, e); // release: our readers are done
    fc_put_block(ctx, ctx.rank, dst, src, len);                      // our own slot
    for (fc_u32 k = 1; k < ctx.world; ++k) {
        const fc_u32 q = (ctx.rank + k) % ctx.world; // peers in a rotated order: no hot spot
        const bool ok = t != 0 || fc_wait_until(ctx, started + q, FC_CMP_GE, e, q);
        if (fc_barrier_or(!ok)) return; // failed communicator: give up (the error words say why)
        if (len > 0) fc_put_signal_block(ctx, q, dst, src, len, delivered + ctx.rank, len, FC_SIGNAL_ADD);
    }

    // Block 0 waits for every peer's whole slot, then gives the count back
    // (an atomic, so the count stays exact whatever else is in flight).
    if (b == 0 && t < ctx.world && t != ctx.rank && fc_wait_until(ctx, delivered + t, FC_CMP_GE, n, t))
        fc_atomic_add(ctx, ctx.rank, delivered + t, (fc_u64)0 - n);

    fc_barrier(); // the block's reads of epoch_word come before its count below
    if (t == 0 && (fc_atomic_add(ctx, ctx.rank, epoch_word, 1u) & 0xFFFFFFFFu) == nb - 1u)
        fc_st_volatile_u64(epoch_word, e << 32);
}
