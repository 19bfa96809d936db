//! Device memory: buffers this rank owns (plain or shareable), peers'
//! buffers mapped here, and host-mapped error words.

use std::any::Any;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::handle::{self, ParsedHandle};
use super::local::{self, Keep};
use super::vendor::{Driver, Export, Ipc, Vendor};
use crate::device::{DeviceBuffer, DevicePtr, ExportedHandle, HostFlags};
use crate::error::{Error, Result};

/// Make `ctx` current in a `Drop`: a failure is recorded, not returned.
pub(super) fn bind_for_drop<V: Driver>(ctx: &V::Context) {
    V::drop_errors().record(V::bind(ctx));
}

pub(super) enum Memory<V: Ipc> {
    /// From [`Driver::mem_alloc`]; freed on drop.
    Plain { ptr: DevicePtr, size: usize },
    /// The IPC flavour's own type; it releases itself.
    Shared(V::Shared),
}

/// One allocation, freed (on its device) when the last owner drops: the
/// buffer, or a same-process peer mapping of it.
pub(super) struct Allocation<V: Ipc> {
    pub(super) ctx: Arc<V::Context>,
    pub(super) memory: Memory<V>,
}

impl<V: Ipc> Allocation<V> {
    pub(super) fn ptr(&self) -> DevicePtr {
        match &self.memory {
            Memory::Plain { ptr, .. } => *ptr,
            Memory::Shared(s) => V::shared_range(s).0,
        }
    }

    /// Bytes actually allocated (what a peer maps; all zeroed at creation).
    pub(super) fn size(&self) -> usize {
        match &self.memory {
            Memory::Plain { size, .. } => *size,
            Memory::Shared(s) => V::shared_range(s).1,
        }
    }
}

impl<V: Ipc> Drop for Allocation<V> {
    fn drop(&mut self) {
        local::forget_if_dead(V::KIND, self.ptr());
        if let Memory::Plain { ptr, .. } = self.memory {
            bind_for_drop::<V>(&self.ctx);
            // SAFETY: frees the allocation made in `GpuDevice::alloc`, once;
            // owners drain the streams (and peers) that used it before the last drop.
            V::drop_errors().record(unsafe { V::mem_free(&self.ctx, ptr) });
        }
    }
}

/// Device memory owned by this rank.
pub struct GpuBuffer<V: Vendor> {
    pub(super) alloc: Arc<Allocation<V>>,
    pub(super) len: usize,
}

impl<V: Vendor> GpuBuffer<V> {
    pub(super) fn ctx(&self) -> &V::Context {
        &self.alloc.ctx
    }

    /// Export a shareable buffer for peers, and remember it for handles that
    /// come back to this process.
    pub(super) fn export(&self) -> Result<ExportedHandle> {
        let Memory::Shared(shared) = &self.alloc.memory else {
            return Err(Error::invalid("only MemKind::Shareable buffers can be exported"));
        };
        let export = V::export_shared(&self.alloc.ctx, shared)?;
        let weak: std::sync::Weak<dyn Any + Send + Sync> = {
            let any: Arc<dyn Any + Send + Sync> = self.alloc.clone();
            Arc::downgrade(&any)
        };
        local::register(V::KIND, self.alloc.ptr(), self.alloc.size(), weak);
        Ok(exported::<V>(&self.alloc.ctx, export, true, self.len))
    }
}

/// The handle for an export: the header, the vendor's handle and its fd.
pub(super) fn exported<V: Driver>(ctx: &V::Context, e: Export, own: bool, size: usize) -> ExportedHandle {
    let bytes = handle::encode(
        V::KIND,
        e.kind,
        own,
        V::ordinal(ctx),
        e.base.0,
        e.size as u64,
        &e.payload,
    );
    ExportedHandle { bytes, fd: e.fd, size }
}

impl<V: Vendor> DeviceBuffer for GpuBuffer<V> {
    fn ptr(&self) -> DevicePtr {
        self.alloc.ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

enum PeerMemory<V: Ipc> {
    /// Mapped by the vendor (a VMM import, an opened IPC handle).
    Mapped(V::Mapping),
    /// Memory of this process, by address.
    Local { addr: DevicePtr, _keep: Option<Keep> },
}

/// A peer's exported buffer mapped into this process for this device.
/// Unmapped (or let go) on drop.
pub struct GpuPeerBuffer<V: Vendor> {
    memory: PeerMemory<V>,
    len: usize,
}

impl<V: Vendor> GpuPeerBuffer<V> {
    /// Map `handle` for `ctx`'s device, which the caller made current.
    pub(super) fn import(ctx: &Arc<V::Context>, handle: ExportedHandle) -> Result<GpuPeerBuffer<V>> {
        let h: ParsedHandle = handle::decode(&handle.bytes, handle.size, V::KIND)?;
        let fd: Option<&OwnedFd> = handle.fd.as_ref();
        let memory = if h.kind.is_address_based() && h.is_from_this_process() {
            let (addr, keep) = local::resolve::<V>(ctx, &h)?;
            PeerMemory::Local { addr, _keep: keep }
        } else {
            PeerMemory::Mapped(V::open_handle(ctx, &h, fd)?)
        };
        Ok(GpuPeerBuffer {
            memory,
            len: handle.size,
        })
    }
}

impl<V: Vendor> DeviceBuffer for GpuPeerBuffer<V> {
    fn ptr(&self) -> DevicePtr {
        match &self.memory {
            PeerMemory::Mapped(m) => V::mapping_ptr(m),
            PeerMemory::Local { addr, .. } => *addr,
        }
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Host-mapped, pinned words that kernels write with system-scope atomics
/// while the host polls them.
pub struct GpuHostFlags<V: Vendor> {
    ctx: Arc<V::Context>,
    host: NonNull<AtomicU32>,
    words: usize,
    dev: DevicePtr,
}

// SAFETY: the pointer is to pinned host memory owned by this value and only
// accessed through atomics; the vendor handle is thread-safe.
unsafe impl<V: Vendor> Send for GpuHostFlags<V> {}
// SAFETY: as above: shared access is atomic loads and stores only.
unsafe impl<V: Vendor> Sync for GpuHostFlags<V> {}

impl<V: Vendor> GpuHostFlags<V> {
    /// `words` zeroed words on `ctx` (current).
    pub(super) fn new(ctx: Arc<V::Context>, words: usize) -> Result<GpuHostFlags<V>> {
        let (host, dev) = V::host_alloc_mapped(&ctx, words.max(1) * 4)?;
        Ok(GpuHostFlags {
            ctx,
            host: host.cast(),
            words,
            dev,
        })
    }

    fn word(&self, index: usize) -> Option<&AtomicU32> {
        // SAFETY: in bounds (checked), 4-byte aligned (page-aligned pinned
        // memory), live until drop; AtomicU32 has u32's layout.
        (index < self.words).then(|| unsafe { &*self.host.as_ptr().add(index) })
    }
}

impl<V: Vendor> HostFlags for GpuHostFlags<V> {
    fn device_ptr(&self) -> DevicePtr {
        self.dev
    }
    fn load(&self, index: usize) -> u32 {
        self.word(index).map_or(0, |w| w.load(Ordering::Acquire))
    }
    fn store(&self, index: usize, value: u32) {
        if let Some(w) = self.word(index) {
            w.store(value, Ordering::Release);
        }
    }
}

impl<V: Vendor> Drop for GpuHostFlags<V> {
    fn drop(&mut self) {
        bind_for_drop::<V>(&self.ctx);
        // SAFETY: frees the allocation made in `new`, once; kernels that wrote
        // it were drained by the owner before dropping.
        V::drop_errors().record(unsafe { V::host_free(&self.ctx, self.host.cast()) });
    }
}
