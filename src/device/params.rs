//! The parameter block every collective kernel receives, by value, as its one
//! argument. [`KernelParams`] is the source of its layout; `struct FcParams`
//! in `kernels-cuda/prelude.cuh`, `kernels-hip/prelude.hip.h` and
//! `ci/emu/emu_prelude.h` are its C copies, and the compile checks hold each
//! to `KERNEL_PARAMS_ABI` field by field (see `device::abi`).

use super::abi::{abi_struct, AbiStruct};
use super::DevicePtr;

/// Most ranks one communicator's custom kernels serve.
pub const MAX_RANKS: usize = 8;

/// Words of host-mapped error state per communicator.
/// `[0]` code (first writer wins), `[1]` bitmask of ranks that never arrived,
/// `[2]` 1 + the rank whose fingerprint differed, `[3]` the epoch that failed.
pub const ERR_WORDS: usize = 4;
pub const ERR_CODE_NONE: u32 = 0;
pub const ERR_CODE_TIMEOUT: u32 = 1;
pub const ERR_CODE_MISMATCH: u32 = 2;
/// Set by the host when it aborts a communicator: queued kernels exit at once.
pub const ERR_CODE_ABORTED: u32 = 3;

/// Kernel parameter block (`struct FcParams` on the device side).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub struct KernelParams {
    /// Every rank's workspace, as mapped in this process. `[rank]` is our own.
    pub peer_ws: [DevicePtr; MAX_RANKS],
    /// This rank's input (may equal `output`: in place).
    pub input: DevicePtr,
    /// This rank's output.
    pub output: DevicePtr,
    /// Host-mapped error words (`ERR_WORDS` of them: code, missing ranks,
    /// mismatched rank, failed epoch).
    pub error_flags: DevicePtr,
    /// Elements in this launch.
    pub count: u64,
    /// Hash of (collective, dtype, op, total count, chunk); peers compare it.
    pub fingerprint: u64,
    /// Bound on every spin wait, in nanoseconds.
    pub timeout_ns: u64,
    /// Byte offset of the fingerprint area inside a workspace (see
    /// `algo::layout`).
    pub fp_offset: u64,
    /// Byte offset of the flag area inside a workspace.
    pub flags_offset: u64,
    /// Byte offset of the data slots inside a workspace.
    pub data_offset: u64,
    /// Bytes of one data slot.
    pub slot_bytes: u64,
    /// This rank in the communicator.
    pub rank: u32,
    /// Ranks in the communicator.
    pub world: u32,
    /// The element type's code (`DType as u32`).
    pub dtype: u32,
    /// The reduction's code (`ReduceOp as u32`).
    pub op: u32,
    /// Root rank for broadcast; unused elsewhere.
    pub root: u32,
    /// Quick-reduce: codec blocks per inbox segment (`algo::layout::qr_segment_blocks`).
    pub aux: u32,
    /// premul_sum's factor: its f32 bits, or (with `PARAM_SCALAR_IS_PTR`)
    /// the address of one element of the call's dtype in device memory.
    pub scalar: u64,
    /// A table in memory the kernel can read, or null. The direct kinds:
    /// every rank's symmetric heap base as mapped here (`u64 [MAX_RANKS]`, in
    /// our heap's sync area, `heap::SYNC_PEER_BASES`).
    pub table: DevicePtr,
    /// The other rank of a send or receive.
    pub peer: u32,
    /// `PARAM_*` bits (the scalar is an address; the direct kinds may read or
    /// write peers' heap buffers in place).
    pub flags: u32,
    /// Four per-peer lists, in elements or addresses; their meaning depends on
    /// the collective (`algo::launch`): all-to-all-v: send counts, send
    /// offsets, receive counts, receive offsets; a batch of sends and
    /// receives: send counts, send addresses, receive counts, receive
    /// addresses. Carried by value, so graph replays see the call's lists.
    pub per_peer: [[u64; MAX_RANKS]; 4],
}

/// [`KernelParams::flags`]: `scalar` is an address, not the factor's bits.
pub const PARAM_SCALAR_IS_PTR: u32 = 1;
/// [`KernelParams::flags`], direct kinds. Direct exchange: every block this
/// rank receives from a peer lies in its symmetric heap and overlaps none it
/// sends, so peers may write them in place. Direct reduce-to: every block
/// this rank sends a peer lies in its heap and overlaps none it writes, so
/// peers may read them in place (and its blocks and output are aligned to
/// their element).
pub const PARAM_DIRECT_OK: u32 = 2;

/// Size of the ABI struct.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub const KERNEL_PARAMS_BYTES: usize = std::mem::size_of::<KernelParams>();

/// Every field of [`KernelParams`] with its offset and size, which each
/// `struct FcParams` must match.
pub const KERNEL_PARAMS_ABI: AbiStruct = abi_struct!(KernelParams as "FcParams" {
    peer_ws, input, output, error_flags, count, fingerprint, timeout_ns, fp_offset, flags_offset, data_offset,
    slot_bytes, rank, world, dtype, op, root, aux, scalar, table, peer, flags, per_peer,
});
const _: () = KERNEL_PARAMS_ABI.assert_packed();
