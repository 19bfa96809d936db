//! The symmetric heap: one shareable reservation per rank, mapped by every
//! peer, with an allocator that gives every rank the same offset for the
//! same allocation (NVSHMEM's and Iris's model). A kernel reaches a peer's
//! copy of a heap buffer by adding the same offset to the peer's base, which
//! the device API (`kernels-cuda/device_api.cuh`, twin: [`DevCtx`]) does.
//!
//! ```text
//! offset 0              sync area (HEAP_RESERVED bytes), ferrocomm's own:
//!   + SYNC_BARRIER_ARRIVED  u64 [MAX_RANKS]  rank p's barrier count, written by p
//!   + SYNC_BARRIER_COUNT    u64              barriers this rank entered (local)
//!   + SYNC_PEER_BASES       u64 [MAX_RANKS]  every rank's heap base as mapped here
//!                                            (written once; the direct kinds read it)
//! HEAP_RESERVED         allocations, HEAP_ALIGN-aligned, symmetric
//! ```
//!
//! The heap is reserved on first use (`Communicator::heap_alloc`), not when a
//! communicator is created, so communicators that never use it cost nothing.
//! It does not grow: its size is fixed by `FERROCOMM_HEAP_BYTES` on every rank,
//! and an allocation past it is an error that says so.

mod alloc;
mod ctx;

pub(crate) use alloc::SymmetricAlloc;
pub use alloc::HEAP_ALIGN;
#[cfg(any(test, feature = "testing"))]
pub(crate) use ctx::DEV_CTX_ABI;
pub(crate) use ctx::{Cmp, ERR_EPOCH_DEVICE_API};
pub use ctx::{DevCtx, DEV_CTX_BYTES};

use std::time::Duration;

use crate::algo::PeerMaps;
use crate::bootstrap::{store_all_gather, Store};
use crate::device::{Device, DeviceBuffer, DevicePtr, MemKind, MAX_RANKS};
use crate::error::{Error, Result};

/// Bytes at the start of every heap that ferrocomm keeps for itself.
pub const HEAP_RESERVED: usize = 64 * 1024;
/// Sync area: `u64 [MAX_RANKS]`, word `p` written by rank `p` at each barrier.
pub(crate) const SYNC_BARRIER_ARRIVED: usize = 0;
/// Sync area: `u64`, this rank's barrier count (local).
pub(crate) const SYNC_BARRIER_COUNT: usize = 8 * MAX_RANKS;
/// Sync area: `u64 [MAX_RANKS]`, every rank's heap base as mapped in this
/// process, so a kernel given only this table can reach into peers' heaps
/// (`KernelParams::table` of the direct kinds).
pub(crate) const SYNC_PEER_BASES: usize = SYNC_BARRIER_COUNT + 8;
const _: () = assert!(SYNC_PEER_BASES + 8 * MAX_RANKS <= HEAP_RESERVED);

/// This rank's heap and every peer's mapping of theirs.
pub(crate) struct Heap<D: Device> {
    // Field order matters for drop: unmap peers before freeing our own buffer.
    maps: PeerMaps<D>,
    own: D::Buffer,
    alloc: SymmetricAlloc,
    /// Unique in the process, so a buffer of a dead heap is never freed
    /// into a new one.
    id: u64,
}

static NEXT_HEAP_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl<D: Device> Heap<D> {
    /// Reserve `bytes`, map every peer's heap. Collective over `world` ranks.
    pub(crate) fn create(
        dev: &D,
        store: &dyn Store,
        key: &str,
        rank: usize,
        world: usize,
        bytes: usize,
        timeout: Duration,
    ) -> Result<Heap<D>> {
        let own = if bytes <= HEAP_RESERVED || bytes % 4096 != 0 {
            Err(Error::invalid(format!(
                "symmetric heap of {bytes} bytes: FERROCOMM_HEAP_BYTES must be a multiple of 4096 above {HEAP_RESERVED}"
            )))
        } else {
            dev.alloc(bytes, MemKind::Shareable).map_err(|e| {
                Error::invalid(format!(
                    "reserving a symmetric heap of {bytes} bytes failed ({e}); lower FERROCOMM_HEAP_BYTES on every rank"
                ))
            })
        };
        // Every rank says whether it got its heap, and its size, before any
        // waits for the others' handles: one rank's failure or a size that
        // differs is every rank's error now, not the others' timeout.
        let mut blob = vec![own.is_ok() as u8];
        blob.extend_from_slice(&(bytes as u64).to_le_bytes());
        let all = store_all_gather(store, &format!("{key}/reserved"), rank, world, &blob, timeout)?;
        let own = own?;
        if let Some(bad) = all.iter().position(|b| b.first() != Some(&1)) {
            return Err(Error::invalid(format!(
                "rank {bad} could not reserve its symmetric heap (its own error says why)"
            )));
        }
        if let Some(bad) = all.iter().position(|b| b.get(1..9) != Some(&blob[1..9])) {
            return Err(Error::Mismatch {
                rank,
                peer: bad,
                detail: format!(
                    "symmetric heap of {bytes} bytes here, another size at rank {bad}: set the same \
                     FERROCOMM_HEAP_BYTES on every rank"
                ),
            });
        }
        let maps = PeerMaps::exchange(dev, store, key, "heap", &own, rank, world, timeout)?;
        Ok(Heap {
            maps,
            alloc: SymmetricAlloc::new(HEAP_RESERVED, bytes - HEAP_RESERVED),
            own,
            id: NEXT_HEAP_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Every rank's heap base as mapped here; `[rank]` is our own.
    pub(crate) fn bases(&self) -> [DevicePtr; MAX_RANKS] {
        self.maps.ptrs
    }

    /// [`SYNC_PEER_BASES`] in device memory, written and synchronized.
    pub(crate) fn write_peer_bases(&self, dev: &D, stream: &D::Stream) -> Result<()> {
        let table: Vec<u8> = self.maps.ptrs.iter().flat_map(|p| p.0.to_le_bytes()).collect();
        dev.copy_from_host(&self.own, SYNC_PEER_BASES, &table, stream)?;
        dev.synchronize(stream)
    }

    /// The address of [`SYNC_PEER_BASES`] in our heap.
    pub(crate) fn peer_bases_table(&self) -> DevicePtr {
        self.own.ptr().offset(SYNC_PEER_BASES)
    }

    pub(crate) fn bytes(&self) -> usize {
        self.own.len()
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn own(&self) -> &D::Buffer {
        &self.own
    }

    pub(crate) fn alloc(&mut self) -> &mut SymmetricAlloc {
        &mut self.alloc
    }

    /// The offset in the heap of `[ptr, ptr + bytes)`, or `None` outside it.
    pub(crate) fn offset_of(&self, ptr: DevicePtr, bytes: usize) -> Option<usize> {
        let base = self.own.ptr().0;
        let end = ptr.0.checked_add(bytes as u64)?;
        (ptr.0 >= base && end <= base + self.own.len() as u64).then(|| (ptr.0 - base) as usize)
    }
}

/// A symmetric allocation: what `Communicator::heap_alloc` returns. Every
/// rank holds one at the same offset; [`HeapBuffer::ptr`] is ours, a peer's
/// is `Communicator::translate(ptr, peer)`.
#[derive(Debug, PartialEq, Eq)]
pub struct HeapBuffer {
    pub(crate) ptr: DevicePtr,
    pub(crate) offset: usize,
    pub(crate) bytes: usize,
    /// Which heap (`Heap`'s process-unique id), so a buffer cannot be
    /// freed into another.
    pub(crate) heap_id: u64,
}

impl HeapBuffer {
    /// Offset from the heap's base, the same on every rank.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl DeviceBuffer for HeapBuffer {
    fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    fn len(&self) -> usize {
        self.bytes
    }
}
