// ferrocomm device API: GPU-initiated puts, gets, signals, waits, a
// cross-rank barrier and remote atomics on the symmetric heap, for kernels
// that users write. docs/device-api.md is the reference (ABI, semantics,
// memory model per vendor).
//
// Vendor neutral, like common.cuh: only the prelude's fc_* primitives, so the
// HIP prelude (kernels-hip/device_api.hip) and the CPU emulation
// (ci/emu/device_api_emu.cpp) reuse this file unchanged. ferrocomm compiles
// prelude + this file + the user's source; the include below only serves
// standalone compiles (nvcc -I kernels-cuda).
//
// Addresses "in the heap" are this rank's local addresses of a symmetric
// allocation; a peer's copy is at the same offset from that peer's base.
// Copies move global memory (device or host-mapped), never __shared__ or
// local arrays: the prelude's loads and stores are global-space accesses.

#ifndef FC_DEVICE_API_INCLUDED
#define FC_DEVICE_API_INCLUDED

#ifndef FC_PRELUDE_INCLUDED
#include "prelude.cuh"
#endif

// ---------------------------------------------------------------------------
// ABI. Passed by value to user kernels and first in every heap kernel's
// argument struct; a copy of `ferrocomm::heap::DevCtx` (#[repr(C)], in
// src/heap/ctx.rs), the source of the layout: the compile checks assert every
// field's offset and size against it (src/device/abi.rs).
struct FcDevCtx {
    fc_u64 heap[FC_MAX_RANKS]; // every rank's heap base as mapped in this process; [rank] is ours
    fc_u64 heap_bytes;         // bytes of each rank's heap (equal on all ranks)
    fc_u64 error_flags;        // host-mapped u32[FC_ERR_WORDS] of the communicator
    fc_u64 timeout_ns;         // bound of every wait
    fc_u64 sync_offset;        // offset in the heap of the sync area (barrier words)
    fc_u32 rank;
    fc_u32 world;
};
// The size, for standalone compiles (the compile checks assert each field).
static_assert(sizeof(FcDevCtx) == 104, "FcDevCtx must match ferrocomm::heap::DevCtx (104 bytes)");

// Sync area, at ctx.sync_offset in every rank's heap.
#define FC_SYNC_BARRIER_ARRIVED 0u // u64[FC_MAX_RANKS]: [p] = barriers rank p has entered, written by p
#define FC_SYNC_BARRIER_COUNT 64u  // u64: barriers this rank has entered (local)

// fc_put_signal_* ops and fc_wait_until comparisons (signal value `x`, operand `v`).
#define FC_SIGNAL_SET 0
#define FC_SIGNAL_ADD 1
#define FC_CMP_EQ 0 // x == v
#define FC_CMP_NE 1 // x != v
#define FC_CMP_GT 2 // x > v
#define FC_CMP_GE 3 // x >= v
#define FC_CMP_LT 4 // x < v
#define FC_CMP_LE 5 // x <= v

// Spin iterations between two looks at the clock and at the error word. The
// error word is host memory, one PCIe round trip a look, so not every time.
#ifndef FC_WAIT_POLL
#define FC_WAIT_POLL 64u
#endif

// Copy units in flight per lane: all loads of a round are issued before its
// stores, so a copy from or to a peer pays the link latency once per round.
#ifndef FC_DEVAPI_UNROLL
#define FC_DEVAPI_UNROLL 4
#endif

// A heap kernel's entry point: `extern "C"`, one by-value argument `a` of type
// ArgsType, whose first field is an FcDevCtx by convention.
#define FC_HEAP_KERNEL(name, ArgsType) FC_KERNEL_ARGS(name, ArgsType)

// ---------------------------------------------------------------------------
// Addresses.

FC_DEVICE bool fc_peer_ok(const FcDevCtx& ctx, fc_u32 peer) { return peer < ctx.world; }

// [p, p + bytes) lies inside this rank's heap.
FC_DEVICE bool fc_in_heap(const FcDevCtx& ctx, const void* p, fc_u64 bytes) {
    const fc_u64 off = reinterpret_cast<fc_u64>(p) - ctx.heap[ctx.rank]; // huge when p is below the base
    return off <= ctx.heap_bytes && bytes <= ctx.heap_bytes - off;
}

// p's twin in peer's heap. With FC_DEVICE_API_CHECKS, nullptr for a bad peer
// or a p outside the heap, so a wrong address faults at once instead of
// landing in some other allocation of the peer.
template <class T>
FC_DEVICE T* fc_remote_ptr(const FcDevCtx& ctx, fc_u32 peer, const T* p) {
#ifdef FC_DEVICE_API_CHECKS
    if (!fc_peer_ok(ctx, peer) || !fc_in_heap(ctx, p, 1)) return nullptr;
#endif
    if (peer == ctx.rank) return const_cast<T*>(p);
    return reinterpret_cast<T*>(ctx.heap[peer] + (reinterpret_cast<fc_u64>(p) - ctx.heap[ctx.rank]));
}

namespace fc_detail {

// The peer's twin of a whole range (checked like fc_remote_ptr, to its end).
FC_DEVICE void* remote_range(const FcDevCtx& ctx, fc_u32 peer, const void* p, fc_u64 bytes) {
#ifdef FC_DEVICE_API_CHECKS
    if (!fc_in_heap(ctx, p, bytes)) return nullptr;
#endif
    return fc_remote_ptr(ctx, peer, p);
}

// ---------------------------------------------------------------------------
// Copies. Units of U bytes, U-aligned on both sides.
template <int U>
struct Unit;
template <>
struct Unit<16> {
    typedef fc_vec16 T;
    FC_DEVICE T load(const char* s) { return fc_load16(s); }
    FC_DEVICE void store(char* d, const T& v) { fc_store16(d, v); }
};
template <>
struct Unit<4> {
    typedef fc_u32 T;
    FC_DEVICE T load(const char* s) { return fc_load(reinterpret_cast<const fc_u32*>(s)); }
    FC_DEVICE void store(char* d, T v) { fc_store(reinterpret_cast<fc_u32*>(d), v); }
};
template <>
struct Unit<1> {
    typedef fc_u8 T;
    FC_DEVICE T load(const char* s) { return fc_load(reinterpret_cast<const fc_u8*>(s)); }
    FC_DEVICE void store(char* d, T v) { fc_store(reinterpret_cast<fc_u8*>(d), v); }
};

// Bytes [0, n) from s to d, split over `lanes` lanes; d and s are equally
// aligned modulo U. Head and tail (under U bytes each) go byte by byte.
template <int U>
FC_DEVICE void copy_units(char* d, const char* s, fc_u64 n, fc_u32 lane, fc_u32 lanes) {
    fc_u64 head = (U - (reinterpret_cast<fc_u64>(d) & (U - 1))) & (U - 1);
    if (head > n) head = n;
    const fc_u64 units = (n - head) / U;
    const fc_u64 body_end = head + units * U;
    for (fc_u64 i = lane; i < head; i += lanes) Unit<1>::store(d + i, Unit<1>::load(s + i));
    for (fc_u64 i = body_end + lane; i < n; i += lanes) Unit<1>::store(d + i, Unit<1>::load(s + i));
    char* db = d + head;
    const char* sb = s + head;
    fc_u64 i = lane;
    for (; i + (fc_u64)(FC_DEVAPI_UNROLL - 1) * lanes < units; i += (fc_u64)FC_DEVAPI_UNROLL * lanes) {
        typename Unit<U>::T v[FC_DEVAPI_UNROLL];
#pragma unroll
        for (int k = 0; k < FC_DEVAPI_UNROLL; ++k) v[k] = Unit<U>::load(sb + (i + (fc_u64)k * lanes) * U);
#pragma unroll
        for (int k = 0; k < FC_DEVAPI_UNROLL; ++k) Unit<U>::store(db + (i + (fc_u64)k * lanes) * U, v[k]);
    }
    for (; i < units; i += lanes) Unit<U>::store(db + i * U, Unit<U>::load(sb + i * U));
}

// The widest unit both addresses allow: 16-byte vectors when they agree
// modulo 16 (then only an unaligned head and tail go in bytes), else words,
// else bytes.
FC_DEVICE void copy(void* dst, const void* src, fc_u64 n, fc_u32 lane, fc_u32 lanes) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    const fc_u64 skew = reinterpret_cast<fc_u64>(d) ^ reinterpret_cast<fc_u64>(s);
    if ((skew & 15u) == 0)
        copy_units<16>(d, s, n, lane, lanes);
    else if ((skew & 3u) == 0)
        copy_units<4>(d, s, n, lane, lanes);
    else
        copy_units<1>(d, s, n, lane, lanes);
}

// Lanes of the calling warp (the block's last warp may be partial on AMD).
FC_DEVICE fc_u32 warp_lanes() {
    const fc_u32 left = fc_block_threads() - (fc_thread_id() - fc_lane_id());
    return left < fc_warp_size() ? left : fc_warp_size();
}

} // namespace fc_detail

// ---------------------------------------------------------------------------
// Puts (dst in the heap, src any global memory of this rank) and gets (src in
// the heap, dst any global memory). The warp and block forms are collective:
// every thread of the warp / block calls with the same arguments, and on
// return the whole warp's / block's part is issued (src may be reused, and a
// release by any one thread covers it).

FC_DEVICE void fc_put_thread(const FcDevCtx& ctx, fc_u32 peer, void* dst, const void* src, fc_u64 bytes) {
    fc_detail::copy(fc_detail::remote_range(ctx, peer, dst, bytes), src, bytes, 0u, 1u);
}
FC_DEVICE void fc_put_warp(const FcDevCtx& ctx, fc_u32 peer, void* dst, const void* src, fc_u64 bytes) {
    fc_detail::copy(fc_detail::remote_range(ctx, peer, dst, bytes), src, bytes, fc_lane_id(), fc_detail::warp_lanes());
    fc_warp_sync();
}
FC_DEVICE void fc_put_block(const FcDevCtx& ctx, fc_u32 peer, void* dst, const void* src, fc_u64 bytes) {
    fc_detail::copy(fc_detail::remote_range(ctx, peer, dst, bytes), src, bytes, fc_thread_id(), fc_block_threads());
    fc_barrier();
}

FC_DEVICE void fc_get_thread(const FcDevCtx& ctx, fc_u32 peer, void* dst, const void* src, fc_u64 bytes) {
    fc_detail::copy(dst, fc_detail::remote_range(ctx, peer, src, bytes), bytes, 0u, 1u);
}
FC_DEVICE void fc_get_warp(const FcDevCtx& ctx, fc_u32 peer, void* dst, const void* src, fc_u64 bytes) {
    fc_detail::copy(dst, fc_detail::remote_range(ctx, peer, src, bytes), bytes, fc_lane_id(), fc_detail::warp_lanes());
    fc_warp_sync();
}
FC_DEVICE void fc_get_block(const FcDevCtx& ctx, fc_u32 peer, void* dst, const void* src, fc_u64 bytes) {
    fc_detail::copy(dst, fc_detail::remote_range(ctx, peer, src, bytes), bytes, fc_thread_id(), fc_block_threads());
    fc_barrier();
}

// ---------------------------------------------------------------------------
// Ordering of this thread's puts. Puts are plain stores, so there is nothing
// to wait for but the stores themselves: both are a system-scope fence.
FC_DEVICE void fc_fence() { fc_fence_sys(); }
FC_DEVICE void fc_quiet() { fc_fence_sys(); }

// ---------------------------------------------------------------------------
// Signals: u64 words in the heap, written at system scope with release
// semantics, so a peer whose acquire (fc_wait_until) sees the value also sees
// every write this thread made before, and, when a block barrier came first
// (fc_put_block ends with one), every write of the block.

FC_DEVICE void fc_signal_set(const FcDevCtx& ctx, fc_u32 peer, fc_u64* sig, fc_u64 v) {
    fc_st_release_sys_u64(fc_remote_ptr(ctx, peer, sig), v);
}
FC_DEVICE void fc_signal_add(const FcDevCtx& ctx, fc_u32 peer, fc_u64* sig, fc_u64 v) {
    fc_fence_sys(); // the prelude's atomic is relaxed: the fence before it makes it a release
    fc_atomic_add_sys_u64(fc_remote_ptr(ctx, peer, sig), v);
}

namespace fc_detail {
FC_DEVICE void signal(const FcDevCtx& ctx, fc_u32 peer, fc_u64* sig, fc_u64 v, int op) {
    if (op == FC_SIGNAL_ADD)
        fc_signal_add(ctx, peer, sig, v);
    else
        fc_signal_set(ctx, peer, sig, v);
}
} // namespace fc_detail

// Put, then one signal (op FC_SIGNAL_SET or FC_SIGNAL_ADD) written by one
// thread after the whole warp / block has issued its part.
FC_DEVICE void fc_put_signal_thread(const FcDevCtx& ctx, fc_u32 peer, void* dst, const void* src, fc_u64 bytes,
                                    fc_u64* sig, fc_u64 v, int op) {
    fc_put_thread(ctx, peer, dst, src, bytes);
    fc_detail::signal(ctx, peer, sig, v, op);
}
FC_DEVICE void fc_put_signal_warp(const FcDevCtx& ctx, fc_u32 peer, void* dst, const void* src, fc_u64 bytes,
                                  fc_u64* sig, fc_u64 v, int op) {
    fc_put_warp(ctx, peer, dst, src, bytes); // ends with fc_warp_sync: lane 0's release covers the warp
    if (fc_lane_id() == 0) fc_detail::signal(ctx, peer, sig, v, op);
}
FC_DEVICE void fc_put_signal_block(const FcDevCtx& ctx, fc_u32 peer, void* dst, const void* src, fc_u64 bytes,
                                   fc_u64* sig, fc_u64 v, int op) {
    fc_put_block(ctx, peer, dst, src, bytes); // ends with a block barrier: thread 0's release covers the block
    if (fc_thread_id() == 0) fc_detail::signal(ctx, peer, sig, v, op);
}

// ---------------------------------------------------------------------------
// Waits. Spin on acquire loads; every FC_WAIT_POLL spins (the first one
// included) look at error word [0] (give up if the communicator failed or
// was aborted) and at the clock (give up past ctx.timeout_ns, reporting it).

namespace fc_detail {

FC_DEVICE bool compare(fc_u64 x, int cmp, fc_u64 v) {
    switch (cmp) {
    case FC_CMP_EQ: return x == v;
    case FC_CMP_NE: return x != v;
    case FC_CMP_GT: return x > v;
    case FC_CMP_GE: return x >= v;
    case FC_CMP_LT: return x < v;
    case FC_CMP_LE: return x <= v;
    default: return false;
    }
}

FC_DEVICE fc_u32 rank_bit(fc_u32 r) { return r < 32u ? 1u << r : 0u; }

// Error words of src/device/params.rs, as the collectives write them: the
// details ([1] ranks waited for, [3] 0xFFFFFFFF = "a device-API wait")
// before the code, so a host that sees the code sees them too.
FC_DEVICE void raise_timeout(const FcDevCtx& ctx, fc_u32 ranks) {
    if (ctx.error_flags == 0) return;
    fc_u32* err = fc_ptr<fc_u32>(ctx.error_flags);
    // An earlier error keeps its own details (a narrow window remains: two
    // failures at once may merge their rank bits).
    if (fc_ld_volatile(err) != FC_ERR_CODE_NONE) return;
    fc_atomic_or_sys(err + 1, ranks);
    fc_atomic_exch_sys(err + 3, 0xFFFFFFFFu);
    fc_fence_sys();
    fc_atomic_cas_sys(err + 0, FC_ERR_CODE_NONE, FC_ERR_CODE_TIMEOUT);
}

struct Spin {
    fc_u64 start;
    fc_u32 iter;
};
FC_DEVICE Spin spin_start() {
    Spin s;
    s.start = fc_globaltimer_ns();
    s.iter = 0;
    return s;
}
// Whether the spin must stop: the communicator failed, or the deadline passed
// (then `pending`, the ranks still awaited, goes into the error words).
FC_DEVICE bool give_up(const FcDevCtx& ctx, Spin& s, fc_u32 pending) {
    if (s.iter++ % FC_WAIT_POLL != 0) return false;
    if (ctx.error_flags != 0 && fc_ld_volatile(fc_ptr<fc_u32>(ctx.error_flags)) != FC_ERR_CODE_NONE) return true;
    if (fc_globaltimer_ns() - s.start < ctx.timeout_ns) return false;
    raise_timeout(ctx, pending);
    return true;
}

} // namespace fc_detail

// Waits until `*sig cmp v` holds for the local signal word sig (acquire at
// system scope: the writes the signaller released are visible afterwards).
// `peer` is who is expected to signal, for the error words. False on the
// deadline or a failed communicator; a condition that already holds returns
// true without looking at either.
FC_DEVICE bool fc_wait_until(const FcDevCtx& ctx, const fc_u64* sig, int cmp, fc_u64 v, fc_u32 peer) {
    if (fc_detail::compare(fc_ld_acquire_sys_u64(sig), cmp, v)) return true;
    fc_detail::Spin s = fc_detail::spin_start();
    do {
        if (fc_detail::give_up(ctx, s, fc_detail::rank_bit(peer))) return false;
    } while (!fc_detail::compare(fc_ld_acquire_sys_u64(sig), cmp, v));
    return true;
}

// Barrier of all ranks: every thread of ONE block per rank calls it. On
// return (true) every write the participating blocks made before it is
// visible to every thread of them. False for the whole block on the deadline
// (error word [1] then names every rank that had not arrived) or a failed
// communicator. The count lives on the device (sync area), so graph replays
// continue it.
FC_DEVICE bool fc_barrier_all_block(const FcDevCtx& ctx) {
    char* sync = fc_ptr<char>(ctx.heap[ctx.rank] + ctx.sync_offset);
    fc_u64* arrived = reinterpret_cast<fc_u64*>(sync + FC_SYNC_BARRIER_ARRIVED);
    fc_u64* count_word = reinterpret_cast<fc_u64*>(sync + FC_SYNC_BARRIER_COUNT);
    const fc_u64 count = fc_ld_volatile_u64(count_word) + 1u;
    // Every thread has read the count before thread 0 bumps it, and has issued
    // its earlier writes: the releases below publish them for the whole block
    // (cumulativity through the barrier).
    fc_barrier();
    const fc_u32 t = fc_thread_id();
    if (t == 0) fc_st_volatile_u64(count_word, count);
    for (fc_u32 p = t; p < ctx.world; p += fc_block_threads()) fc_signal_set(ctx, p, arrived + ctx.rank, count);
    bool failed = false;
    if (t == 0) {
        // One thread watches every rank, so a timeout reports all the missing ones.
        fc_u32 pending = (1u << ctx.world) - 1u;
        fc_detail::Spin s = fc_detail::spin_start();
        for (;;) {
            for (fc_u32 p = 0; p < ctx.world; ++p)
                if ((pending >> p & 1u) && fc_ld_acquire_sys_u64(arrived + p) >= count) pending &= ~(1u << p);
            if (pending == 0) break;
            if (fc_detail::give_up(ctx, s, pending)) {
                failed = true;
                break;
            }
        }
    }
    // Thread 0's acquires, then a block barrier: the peers' writes are
    // visible to every thread of the block.
    return !fc_barrier_or(failed);
}

// ---------------------------------------------------------------------------
// Remote atomics on u64 words in the heap, at system scope. Add and CAS are
// relaxed (put fc_fence() before to order earlier puts); fetch is an acquire.
FC_DEVICE fc_u64 fc_atomic_add(const FcDevCtx& ctx, fc_u32 peer, fc_u64* p, fc_u64 v) {
    return fc_atomic_add_sys_u64(fc_remote_ptr(ctx, peer, p), v);
}
FC_DEVICE fc_u64 fc_atomic_cas(const FcDevCtx& ctx, fc_u32 peer, fc_u64* p, fc_u64 cmp, fc_u64 v) {
    return fc_atomic_cas_sys_u64(fc_remote_ptr(ctx, peer, p), cmp, v);
}
FC_DEVICE fc_u64 fc_atomic_fetch(const FcDevCtx& ctx, fc_u32 peer, const fc_u64* p) {
    return fc_ld_acquire_sys_u64(fc_remote_ptr(ctx, peer, p));
}

#endif // FC_DEVICE_API_INCLUDED
