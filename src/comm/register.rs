//! Registering caller memory with every peer (`Communicator::register`),
//! and the peers' tensors it maps; the registrations themselves are kept in
//! `registry.rs`.

use std::os::fd::AsFd;

use super::communicator::Communicator;
use super::registry::{Entry, Registration};
use super::tensor::Tensor;
use crate::bootstrap::store_all_gather;
use crate::device::{fd_exchange, Device, DeviceBuffer, DevicePtr, ExportedHandle, MAX_RANKS};
use crate::error::{Error, Result};

impl<D: Device> Communicator<D> {
    /// Register `t` with every peer: each rank exports the allocation that
    /// holds its tensor and maps every peer's. Collective: every rank calls
    /// it (tensors may differ in size). Memory from [`Communicator::alloc`]
    /// can always be registered; other memory where the backend can share
    /// it (`Device::export_range` says why not otherwise).
    pub fn register(&self, t: Tensor) -> Result<Registration> {
        let inner = &*self.inner;
        if !inner.kernels {
            // Registration maps peers' memory for ferrocomm's kernels; across
            // nodes nothing is mapped, and NCCL/RCCL uses the tensor in place.
            return Err(Error::Unsupported(format!(
                "register on communicator {}: it spans {} ({} ranks) and has no kernels to serve; its calls use \
                 the tensor in place already",
                inner.name,
                inner.topology.describe(),
                inner.world
            )));
        }
        let bytes = t.bytes()?;
        inner.device.check_memory(t.ptr(), bytes)?;
        let (rank, world, timeout) = (inner.rank, inner.world, inner.opts.timeout);
        // Every rank takes part even when its own export fails, so the
        // others get an error instead of a timeout.
        let exported = inner.device.export_range(t.ptr(), bytes.max(1));
        let key = self.inner.next_key("reg");
        let mut blob = vec![exported.is_ok() as u8];
        if let Ok((h, offset)) = &exported {
            blob.extend_from_slice(&(h.size as u64).to_le_bytes());
            blob.extend_from_slice(&(*offset as u64).to_le_bytes());
            blob.extend_from_slice(&(t.count() as u64).to_le_bytes());
            blob.push(h.fd.is_some() as u8);
            blob.extend_from_slice(&h.bytes);
        }
        let blobs = store_all_gather(inner.store.as_ref(), &format!("{key}/h"), rank, world, &blob, timeout)?;
        if let Some(bad) = blobs.iter().position(|b| b.first() != Some(&1)) {
            return match exported {
                Err(e) => Err(e),
                Ok(_) => Err(Error::Unsupported(format!(
                    "rank {bad} could not export its tensor for registration (its own error says why)"
                ))),
            };
        }
        let (handle, _) = exported?;
        let has_fds = blobs.iter().all(|b| b.get(25) == Some(&1));
        let mut fds = match (&handle.fd, has_fds) {
            (Some(fd), true) => fd_exchange::exchange_fds(
                inner.store.as_ref(),
                &format!("{key}/fd"),
                rank,
                world,
                &[fd.as_fd()],
                timeout,
            )?,
            _ => (0..world).map(|_| Vec::new()).collect(),
        };
        let mut peer_ptrs = [DevicePtr::NULL; MAX_RANKS];
        let mut peer_counts = [0usize; MAX_RANKS];
        let mut mapped = Vec::new();
        for (peer, b) in blobs.iter().enumerate() {
            let bad = || Error::Store(format!("malformed registration from rank {peer}"));
            let word = |i: usize| -> Result<u64> {
                Ok(u64::from_le_bytes(
                    b.get(1 + 8 * i..9 + 8 * i)
                        .ok_or_else(bad)?
                        .try_into()
                        .map_err(|_| bad())?,
                ))
            };
            let (size, offset, count) = (word(0)? as usize, word(1)? as usize, word(2)? as usize);
            peer_counts[peer] = count;
            if peer == rank {
                peer_ptrs[peer] = t.ptr();
                continue;
            }
            let fd = match b.get(25) {
                Some(1) => Some(
                    fds[peer]
                        .pop()
                        .ok_or_else(|| Error::Store(format!("rank {peer} sent no fd")))?,
                ),
                _ => None,
            };
            let buf = inner.device.import(ExportedHandle {
                bytes: b.get(26..).ok_or_else(bad)?.to_vec(),
                fd,
                size,
            })?;
            if offset > buf.len() {
                return Err(bad());
            }
            peer_ptrs[peer] = buf.ptr().offset(offset);
            mapped.push(buf);
        }
        self.with_resources(|res| {
            let reg = &mut res.registry;
            let id = reg.next;
            reg.next += 1;
            reg.entries.push(Entry {
                id,
                local: t,
                peer_ptrs,
                peer_counts,
                _mapped: mapped,
            });
            Registration { id, tensor: t }
        })
    }

    /// Unmap the peers' buffers of a registration here (local, not collective).
    pub fn deregister(&self, r: Registration) -> Result<()> {
        self.with_resources(|res| {
            let before = res.registry.entries.len();
            res.registry.entries.retain(|e| e.id != r.id);
            if res.registry.entries.len() == before {
                return Err(Error::invalid("deregister: not a registration of this communicator"));
            }
            Ok(())
        })?
    }

    /// `rank`'s registered tensor as mapped here: load and store through it
    /// from kernels of this device (torchcomms' `map_remote_tensor`).
    pub fn peer_tensor(&self, r: &Registration, rank: usize) -> Result<Tensor> {
        if rank >= self.size() {
            return Err(Error::invalid(format!(
                "rank {rank} is not in a world of {}",
                self.size()
            )));
        }
        self.with_resources(|res| {
            let e = res
                .registry
                .entries
                .iter()
                .find(|e| e.id == r.id)
                .ok_or_else(|| Error::invalid("peer_tensor: not a registration of this communicator"))?;
            // SAFETY: the mapping stays alive while the registration does.
            Ok(unsafe { Tensor::from_raw(e.peer_ptrs[rank].0, e.peer_counts[rank], e.local.dtype()) })
        })?
    }
}
