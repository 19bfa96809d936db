//! Workspace layout shared by every backend's kernels. Each rank owns one
//! shareable workspace that all peers map. Offsets are passed to kernels in
//! [`KernelParams`](crate::device::KernelParams), so kernels hard-code none
//! (the LL area follows the data slots, at `data_offset + 4 * slot_bytes`).
//!
//! ```text
//! offset 0          control (local): u32 epoch, u32 blocks_done
//! FP_OFFSET         fingerprints  u64 [2 parity][MAX_BLOCKS][MAX_RANKS]   written by peers
//! FLAGS_OFFSET      flags         u32 [2 phase ][MAX_BLOCKS][MAX_RANKS]   written by peers
//! AUX_OFFSET        aux words     u64 [2 parity][MAX_BLOCKS][AUX_WORDS][MAX_RANKS]   written by peers
//! P2P_CTRL_OFFSET   send/recv control (see below)
//! DATA_OFFSET       parity region 0: slots 0, 1  (2 * slot_bytes)
//!                   parity region 1: slots 2, 3  (parity = epoch & 1)
//! ll_offset(s)      LL fingerprint records  [2 parity][MAX_BLOCKS][MAX_RANKS] x 16 B
//!                   LL lines, parity 0, then parity 1 (slot_bytes / 2 each)
//! lamport_offset(s) Lamport area, parity 0, then parity 1 (slot_bytes / 4 each):
//!                   the fused LL one-shot's rows, filled with 0xff at creation
//! p2p_offset(s)     send/recv mailboxes [MAX_RANKS sources][2 halves] x p2p_half_bytes(s)
//! ```
//!
//! The aux words carry what a source tells a receiver at phase 0 besides its
//! fingerprint: the exchange's and reduce-to's chunk-0 agreement (the count
//! it sends the receiver, its largest block) and premul_sum's factor. They are
//! per block, like the fingerprints: block `b` of a source writes them into
//! the receiver's `[parity][b]` before the flag of block `b`, so each
//! receiving block reads them after its own wait, with no order between
//! blocks needed (every block of a source writes the same values). The area
//! follows the flags directly (`AUX_OFFSET = FLAGS_OFFSET + FLAGS_BYTES`), which
//! is how the device code finds it (`flags_offset` + flags' size) without a
//! field of its own in the parameter block.
//!
//! Sends and receives involve two ranks, so they cannot use the epochs every
//! rank advances together. Each ordered pair has its own chunk sequence
//! numbers instead (docs/protocol.md, "Send and receive"):
//!
//! ```text
//! P2P_CTRL_OFFSET + 0     u32 [MAX_RANKS] delivered: last chunk source s put in our mailbox [s]   (written by s)
//!                 + 64    u32 [MAX_RANKS] consumed: last chunk of ours rank d took from its mailbox (written by d)
//!                 + 128   u64 [MAX_RANKS][2] header per mailbox half: bytes of the message           (written by s)
//!                 + 512   u32 [MAX_RANKS] sent: chunks we put at rank d, ever                         (local)
//!                 + 576   u32 [MAX_RANKS] received: chunks we took from source s, ever                (local)
//! ```
//!
//! A launch with epoch `E` touches only parity region `E & 1` (of any rank)
//! and the LL area of parity `E & 1`; see docs/protocol.md for how each kind
//! uses its region.

use crate::device::MAX_RANKS;

/// Most blocks one collective launch may use (flags are per block).
pub const MAX_BLOCKS: usize = 128;

pub const CONTROL_BYTES: usize = 256;
pub const FP_OFFSET: usize = CONTROL_BYTES;
pub const FP_BYTES: usize = 2 * MAX_BLOCKS * MAX_RANKS * 8;
pub const FLAGS_OFFSET: usize = FP_OFFSET + FP_BYTES;
pub const FLAGS_BYTES: usize = 2 * MAX_BLOCKS * MAX_RANKS * 4;
/// Aux words per (parity, block, source): see the module docs.
pub const AUX_WORDS: usize = 5;
/// Aux word: the count (elements) a source sends this rank (exchange, reduce-to; chunk 0).
pub const AUX_PAIR_COUNT: usize = 0;
/// Aux word: the largest block (elements) a source sends or receives (chunk
/// 0); the direct kinds: the count a source expects from this rank.
pub const AUX_LARGEST: usize = 1;
/// Aux word: premul_sum's factor of a source (f32 bits).
pub const AUX_FACTOR: usize = 2;
/// Aux word (direct kinds), as an offset in the writer's symmetric heap, or
/// [`AUX_NOT_DIRECT`]: the direct exchange, where the reader's block to the
/// writer lands; the direct reduce-to, where the writer's block to the
/// reader lies.
pub const AUX_RECV_AT: usize = 3;
/// Aux word (exchange, reduce-to; chunk 0): the count (elements) a source
/// expects from this rank, so that a sender learns of a receiver's
/// different split as the receiver does (both raise the mismatch).
pub const AUX_EXPECTS: usize = 4;
/// [`AUX_RECV_AT`] of a rank whose blocks cannot all be used in place.
pub const AUX_NOT_DIRECT: u64 = u64::MAX;
/// The aux area, right after the flags (the device code relies on that).
pub const AUX_OFFSET: usize = FLAGS_OFFSET + FLAGS_BYTES;
pub const AUX_BYTES: usize = 2 * MAX_BLOCKS * AUX_WORDS * MAX_RANKS * 8;
/// Send/receive control words (see the module docs), after the aux words.
pub const P2P_CTRL_OFFSET: usize = (AUX_OFFSET + AUX_BYTES).next_multiple_of(4096);
pub const P2P_DELIVERED: usize = 0;
pub const P2P_CONSUMED: usize = 64;
pub const P2P_HEADER: usize = 128;
pub const P2P_SENT: usize = 512;
pub const P2P_RECEIVED: usize = 576;
pub const P2P_CTRL_BYTES: usize = 1024;
/// Data starts on a 64 KiB boundary so 16-byte vector access is always aligned.
pub const DATA_OFFSET: usize = (P2P_CTRL_OFFSET + P2P_CTRL_BYTES).next_multiple_of(64 * 1024);
/// Number of data slots: two per parity region.
pub const SLOTS: usize = 4;
/// LL fingerprint records: 16 bytes (two LL units) per (parity, block, source).
pub const LL_FP_BYTES: usize = 2 * MAX_BLOCKS * MAX_RANKS * 16;

/// Byte offset, inside a workspace, of aux word `k` from `src` for block `b`
/// and parity `parity`.
pub const fn aux_offset(parity: usize, block: usize, k: usize, src: usize) -> usize {
    AUX_OFFSET + (((parity * MAX_BLOCKS + block) * AUX_WORDS + k) * MAX_RANKS + src) * 8
}

/// The largest per-peer block (bytes) one source's LL lines carry: 8 data
/// bytes per 16-byte line, in a quarter of a slot over the world. What the
/// LL kinds can run at all, whatever a table or an option asks.
pub(crate) const fn ll_capacity(slot_bytes: usize, world: usize) -> usize {
    ll_stride(slot_bytes, world) / 2
}

/// Offset of the LL area (right after the data slots).
pub const fn ll_offset(slot_bytes: usize) -> usize {
    DATA_OFFSET + SLOTS * slot_bytes
}

/// Bytes of LL lines per parity (every source's lines together).
pub const fn ll_parity_bytes(slot_bytes: usize) -> usize {
    slot_bytes / 2
}

/// Offset of the Lamport area (after the LL lines): the fused LL one-shot's
/// rows travel there as they are, a 16-bit half of 0xffff meaning "not
/// arrived" (kernels-cuda/common.cuh, `lamport_offset`). It must hold 0xff
/// in every byte before the first launch (`Workspace::create`
/// fills it); every launch leaves it so.
pub const fn lamport_offset(slot_bytes: usize) -> usize {
    ll_offset(slot_bytes) + LL_FP_BYTES + 2 * ll_parity_bytes(slot_bytes)
}

/// Bytes of the Lamport area per parity.
pub const fn lamport_parity_bytes(slot_bytes: usize) -> usize {
    slot_bytes / 4
}

/// Per-source stride (bytes) inside one parity of the Lamport area.
pub const fn lamport_stride(slot_bytes: usize, world: usize) -> usize {
    (lamport_parity_bytes(slot_bytes) / world) & !63
}

/// Offset of the send/receive mailboxes (after the Lamport area).
pub const fn p2p_offset(slot_bytes: usize) -> usize {
    lamport_offset(slot_bytes) + 2 * lamport_parity_bytes(slot_bytes)
}

/// Bytes of one half of one source's send/receive mailbox: the mailboxes
/// together take one slot.
pub const fn p2p_half_bytes(slot_bytes: usize) -> usize {
    (slot_bytes / MAX_RANKS / 2) & !63
}

/// Bytes of a whole workspace for a given slot size.
pub const fn workspace_bytes(slot_bytes: usize) -> usize {
    p2p_offset(slot_bytes) + 2 * MAX_RANKS * p2p_half_bytes(slot_bytes)
}

/// Elements per two-shot segment: ceil(count / world), rounded up to 8 elements
/// so every segment starts 16-byte aligned for 2-byte types.
pub const fn segment_elems(count: usize, world: usize) -> usize {
    count.div_ceil(world).next_multiple_of(8)
}

/// Per-source sub-buffer stride (bytes) of a push one-shot inside a parity
/// region (`2 * slot_bytes` shared by `world` sources).
pub const fn push_oneshot_stride(slot_bytes: usize, world: usize) -> usize {
    (2 * slot_bytes / world) & !63
}

/// Per-source inbox stride (bytes) of a push two-shot: the first slot of the
/// parity region is split among `world` sources; the second holds results.
pub const fn push_twoshot_stride(slot_bytes: usize, world: usize) -> usize {
    (slot_bytes / world) & !63
}

/// Per-source inbox stride (bytes) of quick-reduce: like the push two-shot's,
/// on a 256-byte boundary (docs/quick-reduce.md).
pub const fn qr_stride(slot_bytes: usize, world: usize) -> usize {
    (slot_bytes / world) & !255
}

/// Codec blocks per quick-reduce segment (a run of them fills at most one
/// inbox): what fits the inbox, and no more than a chunk of `chunk_bytes`
/// encoded bytes (all segments together) holds. Smaller chunks keep a
/// chunk's inboxes and results in L2 (measured on H200: BENCHMARKS.md,
/// "Quick-reduce", paragraph "Chunk cap").
pub const fn qr_segment_blocks(code_bytes: usize, slot_bytes: usize, world: usize, chunk_bytes: usize) -> usize {
    let fit = qr_stride(slot_bytes, world) / (code_bytes + 2);
    let want = chunk_bytes / world / (code_bytes + 2);
    if fit < want {
        fit
    } else if want > 0 {
        want
    } else {
        1
    }
}

/// Quick-reduce's chunks for `count` elements when a chunk holds at most
/// `cap` (a multiple of `32 * world`): (elements per chunk, chunks). The
/// chunks are equal (the last may be shorter), so every GPU block has work in
/// every chunk; a chunk is a multiple of `32 * world` elements.
pub const fn qr_chunking(count: usize, cap: usize, world: usize) -> (usize, usize) {
    let nchunk = count.div_ceil(cap);
    if nchunk == 0 {
        return (cap, 0);
    }
    (count.div_ceil(nchunk).next_multiple_of(32 * world), nchunk)
}

/// Per-source stride (bytes) of LL lines inside one parity's LL area.
pub const fn ll_stride(slot_bytes: usize, world: usize) -> usize {
    (ll_parity_bytes(slot_bytes) / world) & !63
}

const _: () = assert!(DATA_OFFSET % 4096 == 0);
const _: () = assert!(
    AUX_OFFSET % 8 == 0
        && AUX_FACTOR < AUX_WORDS
        && AUX_LARGEST < AUX_WORDS
        && AUX_RECV_AT < AUX_WORDS
        && AUX_EXPECTS < AUX_WORDS
);
const _: () = assert!(P2P_CTRL_OFFSET >= AUX_OFFSET + AUX_BYTES && P2P_CTRL_OFFSET + P2P_CTRL_BYTES <= DATA_OFFSET);
const _: () = assert!(P2P_RECEIVED + 4 * MAX_RANKS <= P2P_CTRL_BYTES && P2P_HEADER + 16 * MAX_RANKS <= P2P_SENT);
const _: () = assert!(LL_FP_BYTES % 64 == 0);
