//! Workspace layout shared by every backend's kernels. Each rank owns one
//! shareable workspace that all peers map. Offsets are passed to kernels in
//! [`KernelParams`](crate::device::KernelParams), so kernels hard-code none.
//!
//! ```text
//! offset 0          control (local): u32 epoch, u32 blocks_done
//! FP_OFFSET         fingerprints  u64 [2 parity][MAX_BLOCKS][MAX_RANKS]   written by peers
//! FLAGS_OFFSET      flags         u32 [2 phase ][MAX_BLOCKS][MAX_RANKS]   written by peers
//! DATA_OFFSET       slot 0,1: staged input  (parity = epoch & 1)
//!                   slot 2,3: reduced result (two-shot), parity likewise
//! ```

use crate::device::MAX_RANKS;

/// Most blocks one collective launch may use (flags are per block).
pub const MAX_BLOCKS: usize = 128;

pub const CONTROL_BYTES: usize = 256;
pub const FP_OFFSET: usize = CONTROL_BYTES;
pub const FP_BYTES: usize = 2 * MAX_BLOCKS * MAX_RANKS * 8;
pub const FLAGS_OFFSET: usize = FP_OFFSET + FP_BYTES;
pub const FLAGS_BYTES: usize = 2 * MAX_BLOCKS * MAX_RANKS * 4;
/// Data starts on a 64 KiB boundary so 16-byte vector access is always aligned.
pub const DATA_OFFSET: usize = (FLAGS_OFFSET + FLAGS_BYTES).next_multiple_of(64 * 1024);
/// Number of data slots: two staging, two result.
pub const SLOTS: usize = 4;

/// Bytes of a whole workspace for a given slot size.
pub const fn workspace_bytes(slot_bytes: usize) -> usize {
    DATA_OFFSET + SLOTS * slot_bytes
}

/// Elements per two-shot segment: ceil(count / world), rounded up to 8 elements
/// so every segment starts 16-byte aligned for 2-byte types.
pub const fn segment_elems(count: usize, world: usize) -> usize {
    count.div_ceil(world).next_multiple_of(8)
}

const _: () = assert!(DATA_OFFSET % 4096 == 0);
