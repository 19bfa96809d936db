//! The per-communicator workspace: one shareable buffer per rank, mapped by
//! every peer, laid out as in [`super::layout`].

use std::os::fd::AsFd;
use std::time::Duration;

use super::layout;
use crate::bootstrap::{store_all_gather, Store};
use crate::device::{fd_exchange, Device, DeviceBuffer, DevicePtr, ExportedHandle, MemKind, MAX_RANKS};
use crate::error::{Error, Result};

/// This rank's workspace and its mappings of every peer's.
pub struct Workspace<D: Device> {
    // Field order matters for drop: unmap peers before freeing our own buffer.
    peers: Vec<Option<D::PeerBuffer>>,
    own: D::Buffer,
    ptrs: [DevicePtr; MAX_RANKS],
    slot_bytes: usize,
}

impl<D: Device> Workspace<D> {
    /// Allocate, fill the Lamport area (on `stream`, waited for before any
    /// peer can map the buffer), export, swap handles through `store`, and
    /// import every peer's. Collective: every rank must call it with the same
    /// `key_prefix`.
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        dev: &D,
        stream: &D::Stream,
        store: &dyn Store,
        key_prefix: &str,
        rank: usize,
        world: usize,
        slot_bytes: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if world == 0 || world > MAX_RANKS || rank >= world {
            return Err(Error::invalid(format!(
                "workspace for rank {rank} of {world}: world must be 1..={MAX_RANKS}"
            )));
        }
        if slot_bytes == 0 || slot_bytes % 4096 != 0 {
            return Err(Error::invalid(format!(
                "slot size {slot_bytes} must be a non-zero multiple of 4096"
            )));
        }
        let own = dev.alloc(layout::workspace_bytes(slot_bytes), MemKind::Shareable)?;
        // Every other area starts zeroed (alloc's promise); the Lamport area
        // starts "not arrived" in every half. Peers write into it only after
        // the exchange below, which comes after this wait.
        let (at, len) = (
            layout::lamport_offset(slot_bytes),
            2 * layout::lamport_parity_bytes(slot_bytes),
        );
        dev.memset(&own, at, len, 0xff, stream)?;
        dev.synchronize(stream)?;
        let PeerMaps { peers, ptrs } = PeerMaps::exchange(dev, store, key_prefix, "ws", &own, rank, world, timeout)?;
        Ok(Workspace {
            peers,
            own,
            ptrs,
            slot_bytes,
        })
    }

    /// Every rank's workspace base as mapped here; `[rank]` is our own.
    pub fn peer_ptrs(&self) -> [DevicePtr; MAX_RANKS] {
        self.ptrs
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn own(&self) -> &D::Buffer {
        &self.own
    }

    pub fn world(&self) -> usize {
        self.peers.len()
    }
}

/// Every peer's mapping of one shareable buffer per rank: what the workspace
/// and the symmetric heap (`crate::heap`) are built on.
pub(crate) struct PeerMaps<D: Device> {
    /// `[rank]` is `None`: our own buffer is not imported.
    pub(crate) peers: Vec<Option<D::PeerBuffer>>,
    /// Every rank's buffer as mapped here; `[rank]` is our own.
    pub(crate) ptrs: [DevicePtr; MAX_RANKS],
}

impl<D: Device> PeerMaps<D> {
    /// Export `own`, swap handles through `store` under `key_prefix/what`,
    /// and import every peer's. Collective over the `world` ranks.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn exchange(
        dev: &D,
        store: &dyn Store,
        key_prefix: &str,
        what: &str,
        own: &D::Buffer,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let exported = dev.export(own)?;
        // Small part through the store; fds (if the backend uses them) over a Unix socket.
        let mut blob = (exported.size as u64).to_le_bytes().to_vec();
        blob.push(exported.fd.is_some() as u8);
        blob.extend_from_slice(&exported.bytes);
        let blobs = store_all_gather(store, &format!("{key_prefix}/{what}"), rank, world, &blob, timeout)?;
        let mut fds = match &exported.fd {
            Some(fd) => fd_exchange::exchange_fds(
                store,
                &format!("{key_prefix}/{what}-fd"),
                rank,
                world,
                &[fd.as_fd()],
                timeout,
            )?,
            None => (0..world).map(|_| Vec::new()).collect(),
        };
        drop(exported);

        let mut peers = Vec::with_capacity(world);
        let mut ptrs = [DevicePtr::NULL; MAX_RANKS];
        for (peer, blob) in blobs.iter().enumerate() {
            if peer == rank {
                peers.push(None);
                ptrs[peer] = own.ptr();
                continue;
            }
            let handle = decode_handle(peer, blob, &mut fds[peer])?;
            let mapped = dev.import(handle)?;
            ptrs[peer] = mapped.ptr();
            peers.push(Some(mapped));
        }
        Ok(PeerMaps { peers, ptrs })
    }
}

fn decode_handle(peer: usize, blob: &[u8], fds: &mut Vec<std::os::fd::OwnedFd>) -> Result<ExportedHandle> {
    let bad = || Error::Store(format!("malformed buffer handle from rank {peer}"));
    let size = u64::from_le_bytes(blob.get(..8).ok_or_else(bad)?.try_into().map_err(|_| bad())?) as usize;
    let has_fd = *blob.get(8).ok_or_else(bad)? != 0;
    let fd = if has_fd {
        Some(
            fds.pop()
                .ok_or_else(|| Error::Store(format!("rank {peer} sent no buffer fd")))?,
        )
    } else {
        None
    };
    Ok(ExportedHandle {
        bytes: blob[9..].to_vec(),
        fd,
        size,
    })
}
