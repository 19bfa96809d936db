//! The communicator's symmetric heap (`crate::heap`): allocation, address
//! translation and the device API's context for kernels.

use super::communicator::{Communicator, Resources};
use crate::bootstrap::store_all_gather;
use crate::device::{Device, DevicePtr, HostFlags, ModuleSource};
use crate::error::{Error, Result};
use crate::heap::{DevCtx, Heap, HeapBuffer};

impl<D: Device> Communicator<D> {
    /// Allocate `bytes` of the symmetric heap: every rank gets the same
    /// offset, so peers' copies are reachable from kernels
    /// ([`Communicator::device_ctx`]) and from the host
    /// ([`Communicator::translate`]). Collective: every rank calls it, in the
    /// same order, with the same size (the sizes and offsets are checked
    /// across ranks). The first call reserves the heap
    /// (`FERROCOMM_HEAP_BYTES`). The memory comes back zeroed, on every rank
    /// before any rank's call returns, so signal words in it start at zero
    /// even where an earlier allocation left counts behind.
    pub fn heap_alloc(&self, bytes: usize) -> Result<HeapBuffer> {
        let inner = &*self.inner;
        if !inner.kernels {
            return Err(Error::Unsupported(format!(
                "symmetric heap on communicator {}: it spans {} and peers' memory cannot be mapped across nodes",
                inner.name,
                inner.topology.describe()
            )));
        }
        let (rank, world, timeout) = (inner.rank, inner.world, inner.opts.timeout);
        if inner.device.is_capturing(&inner.stream)? {
            return Err(Error::invalid(
                "heap_alloc while the communicator's stream is capturing a graph: allocate before the capture",
            ));
        }
        // The key and the reservation are taken under the communicator's
        // lock, so threads of one rank that race take them in one order.
        type Taken = (Result<usize>, DevicePtr, String, u64);
        let (offset, base, key, heap_id) = self.with_resources(|res| -> Result<Taken> {
            let key = inner.next_key("heap");
            if res.heap.is_none() {
                let bytes = inner.opts.heap_bytes_for(inner.device.facts().backend);
                let heap = Heap::create(&inner.device, inner.store.as_ref(), &key, rank, world, bytes, timeout)?;
                // A failure is reported to the peers below, as an allocation's.
                let table = heap.write_peer_bases(&inner.device, &inner.stream);
                let (base, id) = (heap.bases()[rank], heap.id());
                res.heap = Some(heap);
                if let Err(e) = table {
                    return Ok((Err(e), base, key, id));
                }
            }
            let heap = res.heap.as_mut().expect("reserved above");
            let offset = heap.alloc().alloc(bytes);
            if let Ok(o) = offset {
                // Zeroed before this rank reports below, so no peer (which
                // waits for the reports) can write into it first.
                let zeroed = inner
                    .device
                    .memset(heap.own(), o, bytes, 0, &inner.stream)
                    .and_then(|()| inner.device.synchronize(&inner.stream));
                if let Err(e) = zeroed {
                    let _ = heap.alloc().free(o);
                    return Ok((Err(e), heap.bases()[rank], key, heap.id()));
                }
            }
            Ok((offset, heap.bases()[rank], key, heap.id()))
        })??;
        // Every rank reports what it got, so a rank that took a different
        // sequence of allocations is named instead of reading a wrong offset.
        let mine = match &offset {
            Ok(o) => [*o as u64, bytes as u64],
            Err(_) => [u64::MAX, bytes as u64],
        };
        let blob: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
        let all = store_all_gather(
            inner.store.as_ref(),
            &format!("{key}/check"),
            rank,
            world,
            &blob,
            timeout,
        );
        let release = |o: usize| {
            let _ = self.with_resources(|res| res.heap.as_mut().map(|h| h.alloc().free(o)));
        };
        let all = match all {
            Ok(all) => all,
            Err(e) => {
                if let Ok(o) = offset {
                    release(o);
                }
                return Err(e);
            }
        };
        let offset = offset?;
        if let Some(peer) = all.iter().position(|b| b.as_slice() != blob.as_slice()) {
            release(offset);
            let theirs = |i: usize| {
                all[peer]
                    .get(8 * i..8 * i + 8)
                    .map_or(0, |w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            };
            let at = match theirs(0) {
                u64::MAX => "no offset (its allocation failed; its own error says why)".to_string(),
                o => format!("offset {o}"),
            };
            return Err(Error::Mismatch {
                rank,
                peer,
                detail: format!(
                    "heap_alloc of communicator {}: this rank allocated {bytes} bytes at offset {offset}, rank {peer} \
                     asked for {} bytes and got {at} (every rank must allocate and free the same sizes in the same \
                     order)",
                    inner.name,
                    theirs(1),
                ),
            });
        }
        Ok(HeapBuffer {
            ptr: base.offset(offset),
            offset,
            bytes,
            heap_id,
        })
    }

    /// Return a heap allocation. Every rank must free the same allocations in
    /// the same order (it is local, but later offsets depend on it), and only
    /// once no kernel of any rank uses it any more.
    pub fn heap_free(&self, buf: HeapBuffer) -> Result<()> {
        if buf.heap_id != self.heap_id() {
            return Err(Error::invalid(
                "heap_free: the buffer belongs to another communicator's heap",
            ));
        }
        self.with_resources(|res| match res.heap.as_mut() {
            Some(h) => h.alloc().free(buf.offset),
            None => Err(Error::invalid("heap_free: this communicator has no heap")),
        })?
    }

    /// `ptr` (an address in this rank's heap) as mapped in `peer`'s heap,
    /// for host-side copies or kernels of this process.
    pub fn translate(&self, ptr: DevicePtr, peer: usize) -> Result<DevicePtr> {
        let world = self.size();
        if peer >= world {
            return Err(Error::invalid(format!(
                "translate: rank {peer} is not in a world of {world}"
            )));
        }
        self.with_resources(|res| {
            let heap = res
                .heap
                .as_ref()
                .ok_or_else(|| Error::invalid("translate: this communicator has no heap (heap_alloc reserves it)"))?;
            let offset = heap
                .offset_of(ptr, 1)
                .ok_or_else(|| Error::invalid(format!("translate: {ptr:?} is not in this rank's heap")))?;
            Ok(heap.bases()[peer].offset(offset))
        })?
    }

    /// The device API's context (`FcDevCtx`), to pass by value to kernels
    /// that include `kernels-cuda/device_api.cuh`. Valid while the
    /// communicator is. A kernel's deadline is the communicator's timeout
    /// (`timeout_ns`; lower it in the copy to match a shorter
    /// `Call::timeout`): a wait past it makes the launch's `Work::wait`
    /// fail with an [`Error::Timeout`] naming the rank that never
    /// signalled, and aborts the communicator.
    pub fn device_ctx(&self) -> Result<DevCtx> {
        let inner = &*self.inner;
        self.with_resources(|res| {
            let heap = res.heap.as_ref().ok_or_else(|| {
                Error::invalid("device_ctx: this communicator has no heap yet (heap_alloc reserves it)")
            })?;
            Ok(DevCtx {
                heap: heap.bases(),
                heap_bytes: heap.bytes() as u64,
                error_flags: inner.flags.device_ptr(),
                timeout_ns: DevCtx::timeout_ns_of(inner.opts.timeout),
                sync_offset: 0,
                rank: inner.rank as u32,
                world: inner.world as u32,
            })
        })?
    }

    /// Copy host bytes into `buf` at `offset`, ordered on the communicator's stream.
    pub fn heap_write(&self, buf: &HeapBuffer, offset: usize, data: &[u8]) -> Result<()> {
        crate::device::check_range("heap_write", buf.bytes, offset, data.len())?;
        self.with_heap_own(buf, |dev, own, stream| {
            dev.copy_from_host(own, buf.offset + offset, data, stream)
        })
    }

    /// Set `len` bytes of `buf` at `offset` to `value`, ordered on the
    /// communicator's stream.
    pub(crate) fn heap_fill(&self, buf: &HeapBuffer, offset: usize, len: usize, value: u8) -> Result<()> {
        crate::device::check_range("heap_fill", buf.bytes, offset, len)?;
        self.with_heap_own(buf, |dev, own, stream| {
            dev.memset(own, buf.offset + offset, len, value, stream)
        })
    }

    /// Wait for the communicator's stream, then copy `buf[offset..]` into `out`.
    pub fn heap_read(&self, buf: &HeapBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        crate::device::check_range("heap_read", buf.bytes, offset, out.len())?;
        self.with_heap_own(buf, |dev, own, stream| {
            dev.copy_to_host(own, buf.offset + offset, out, stream)
        })
    }

    fn with_heap_own(&self, buf: &HeapBuffer, f: impl FnOnce(&D, &D::Buffer, &D::Stream) -> Result<()>) -> Result<()> {
        if buf.heap_id != self.heap_id() {
            return Err(Error::invalid("the buffer belongs to another communicator's heap"));
        }
        let inner = &*self.inner;
        self.with_resources(|res| match res.heap.as_ref() {
            Some(h) => f(&inner.device, h.own(), &inner.stream),
            None => Err(Error::invalid("this communicator has no heap")),
        })?
    }

    /// This communicator's heap's id, or 0 before it is reserved.
    fn heap_id(&self) -> u64 {
        self.with_resources(|res| res.heap.as_ref().map_or(0, |h| h.id()))
            .unwrap_or(0)
    }
}

/// A heap-kernel module (windows, EP), loaded once and kept with the
/// communicator's other modules (so `Communicator::prepare` covers it).
pub(crate) fn heap_module<'a, D: Device>(
    res: &'a mut Resources<D>,
    device: &D,
    source: &ModuleSource,
) -> Result<&'a D::Module> {
    let at = match res.heap_modules.iter().position(|(n, _)| *n == source.name) {
        Some(i) => i,
        None => {
            res.heap_modules.push((source.name, device.load_module(source)?));
            res.heap_modules.len() - 1
        }
    };
    Ok(&res.heap_modules[at].1)
}
