// Lamport packs: receive areas whose data carries its own arrival, so a
// reader needs no flag and no round trip before it reads. Used by the fused
// LL one-shot (common.cuh, "Lamport area") and the EP combine (ep.cu).
//
// An area starts empty (every byte 0xff, filled by the host at creation). A
// 16-bit half equal to FC_LAMPORT_EMPTY means "not arrived". A writer never
// stores EMPTY: that bit pattern is a NaN in f16 and bf16, and it sends
// another NaN (0xfffe) in its place; every result the kernels compute from a
// NaN is the one canonical NaN, so no result changes. A reader that took a
// pack stores EMPTY back, so every launch leaves the area as it found it.
// Each half is written whole, so a pack with no EMPTY half is the current
// writer's; when the area may be written again is each user's protocol.
//
// Vendor neutral (prelude fc_* only). A module's text places this file after
// the prelude (src/algo/kernels.rs, src/ep/mod.rs); the include below only
// serves standalone compiles.

#ifndef FC_LAMPORT_INCLUDED
#define FC_LAMPORT_INCLUDED

#ifndef FC_PRELUDE_INCLUDED
#include "prelude.cuh"
#endif

#define FC_LAMPORT_EMPTY 0xffffu

// A pack as it travels: EMPTY halves become 0xfffe (a NaN too).
FC_DEVICE fc_vec16 lamport_send_pack(fc_vec16 v) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        fc_u32 w = v.w[k];
        if ((w & 0xffffu) == FC_LAMPORT_EMPTY) w ^= 1u;
        if ((w >> 16) == FC_LAMPORT_EMPTY) w ^= 1u << 16;
        v.w[k] = w;
    }
    return v;
}

// Store a pack (already through lamport_send_pack) at `at`, a peer's area.
FC_DEVICE void lamport_store(char* at, const fc_vec16& l) {
    fc_st_volatile_v2u64(at, ((fc_u64)l.w[1] << 32) | l.w[0], ((fc_u64)l.w[3] << 32) | l.w[2]);
}

// One pack as it is now, and whether it has arrived (none of its halves
// EMPTY), apart: a reader of several packs issues every load before it looks
// at any, or each look waits for its load before the next load issues.
FC_DEVICE fc_vec16 lamport_fetch(const char* at) {
    fc_u64 a, b;
    fc_ld_volatile_v2u64(at, a, b);
    fc_vec16 v;
    v.w[0] = (fc_u32)a;
    v.w[1] = (fc_u32)(a >> 32);
    v.w[2] = (fc_u32)b;
    v.w[3] = (fc_u32)(b >> 32);
    return v;
}
FC_DEVICE bool lamport_full(const fc_vec16& v) {
    bool full = true;
#pragma unroll
    for (int k = 0; k < 4; ++k)
        full = full && (v.w[k] & 0xffffu) != FC_LAMPORT_EMPTY && (v.w[k] >> 16) != FC_LAMPORT_EMPTY;
    return full;
}
// One pack; true when it has arrived.
FC_DEVICE bool lamport_load(const char* at, fc_vec16& v) {
    v = lamport_fetch(at);
    return lamport_full(v);
}

// Give a pack that was read back to the area.
FC_DEVICE void lamport_clear(char* at) { fc_st_volatile_v2u64(at, ~0ull, ~0ull); }

#endif // FC_LAMPORT_INCLUDED
