//! HIP memory: plain `hipMalloc` buffers, shareable uncached buffers
//! (`hipExtMallocWithFlags(hipDeviceMallocUncached)`) exported with
//! `hipIpcGetMemHandle`, peers' buffers opened with `hipIpcOpenMemHandle`,
//! and host-mapped error words.
//!
//! An exported handle's `bytes` carry the 64-byte `hipIpcMemHandle_t` and no
//! file descriptor. HIP refuses to open a handle in the process that created
//! it, so the bytes also carry a random per-process id and the address: a
//! handle that comes back to its own process (ranks as threads) is served from
//! a registry of this process's exports, never from the address in the bytes
//! alone, and the importing device gets peer access to the exporting one.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_int, c_void};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use super::driver::{
    check, drop_check, error, DeviceCtx, IpcMemHandle, HIP_DEVICE_MALLOC_UNCACHED,
    HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED, HIP_HOST_MALLOC_COHERENT, HIP_HOST_MALLOC_MAPPED, HIP_HOST_MALLOC_PORTABLE,
    HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, HIP_SUCCESS, IPC_HANDLE_BYTES,
};
use crate::device::{DeviceBuffer, DevicePtr, ExportedHandle, HostFlags};
use crate::error::{Error, Result};

/// Header of an exported handle's `bytes`: magic, format version, size of the
/// allocation, exporting process id, exporting device, reserved, address,
/// then the runtime's IPC handle.
const HANDLE_MAGIC: &[u8; 4] = b"FCHP";
const HANDLE_VERSION: u32 = 1;
const NONCE_BYTES: usize = 16;
pub(super) const HANDLE_BYTES: usize = 4 + 4 + 8 + NONCE_BYTES + 4 + 4 + 8 + IPC_HANDLE_BYTES;
/// Refuse to map anything larger than this from a peer's handle.
const MAX_IMPORT_BYTES: u64 = 1 << 40;
/// Shareable allocations are rounded up to this, so each is a dedicated
/// allocation that the runtime does not suballocate (an IPC handle exports
/// the whole underlying allocation), and the whole of it is zeroed.
pub(super) const SHAREABLE_GRANULARITY: usize = 2 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A random id for this process, in every handle it exports.
fn process_nonce() -> [u8; NONCE_BYTES] {
    static NONCE: OnceLock<[u8; NONCE_BYTES]> = OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut out = [0u8; NONCE_BYTES];
        for (i, chunk) in out.chunks_mut(8).enumerate() {
            // RandomState is seeded from the OS's random source.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.write_usize(i);
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            chunk.copy_from_slice(&h.finish().to_le_bytes());
        }
        out
    })
}

/// One device allocation, freed (on its device) when the last owner drops.
pub(super) struct Allocation {
    pub(super) ctx: Arc<DeviceCtx>,
    pub(super) ptr: *mut c_void,
    /// Bytes allocated (for shareable memory, rounded up to the granularity).
    pub(super) size: usize,
    shareable: bool,
}

// SAFETY: a device address owned by this value; the runtime is thread-safe and
// the pointer is never dereferenced on the host.
unsafe impl Send for Allocation {}
// SAFETY: as above.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// `bytes` (at least 1) of plain device memory on the current device. Not zeroed.
    pub(super) fn plain(ctx: Arc<DeviceCtx>, bytes: usize) -> Result<Allocation> {
        let size = bytes.max(1);
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the caller made the device current.
        check("hipMalloc", unsafe { (ctx.hip().malloc)(&mut ptr, size) })?;
        Ok(Allocation {
            ctx,
            ptr,
            size,
            shareable: false,
        })
    }

    /// Uncached device memory that can be exported, rounded up to
    /// [`SHAREABLE_GRANULARITY`]. Not zeroed.
    pub(super) fn shareable(ctx: Arc<DeviceCtx>, bytes: usize) -> Result<Allocation> {
        let size = bytes
            .max(1)
            .checked_next_multiple_of(SHAREABLE_GRANULARITY)
            .ok_or_else(|| Error::invalid(format!("cannot allocate {bytes} bytes")))?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the caller made the device current.
        check("hipExtMallocWithFlags", unsafe {
            (ctx.hip().ext_malloc_with_flags)(&mut ptr, size, HIP_DEVICE_MALLOC_UNCACHED)
        })?;
        Ok(Allocation {
            ctx,
            ptr,
            size,
            shareable: true,
        })
    }

    pub(super) fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if self.shareable {
            let mut exports = lock(exports());
            if exports.get(&self.addr()).is_some_and(|w| w.strong_count() == 0) {
                exports.remove(&self.addr());
            }
        }
        self.ctx.bind_for_drop();
        // SAFETY: frees the allocation made in `plain`/`shareable`, once; owners
        // drain the streams (and peers) that used it before the last drop.
        drop_check("hipFree", unsafe { (self.ctx.hip().free)(self.ptr) });
    }
}

/// This process's exported allocations by address, for handles that come back.
fn exports() -> &'static Mutex<HashMap<u64, Weak<Allocation>>> {
    static EXPORTS: OnceLock<Mutex<HashMap<u64, Weak<Allocation>>>> = OnceLock::new();
    EXPORTS.get_or_init(Default::default)
}

/// Device memory owned by this rank.
pub struct HipBuffer {
    pub(super) alloc: Arc<Allocation>,
    pub(super) len: usize,
}

impl HipBuffer {
    pub(super) fn ctx(&self) -> &DeviceCtx {
        &self.alloc.ctx
    }

    pub(super) fn raw(&self) -> *mut c_void {
        self.alloc.ptr
    }

    /// Bytes actually allocated (what a peer maps; all zeroed at creation).
    pub(super) fn allocated(&self) -> usize {
        self.alloc.size
    }

    /// Export a shareable buffer: the IPC handle plus the header (see the module docs).
    pub(super) fn export(&self) -> Result<ExportedHandle> {
        if !self.alloc.shareable {
            return Err(Error::invalid("only MemKind::Shareable buffers can be exported"));
        }
        let mut handle = IpcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: valid out-pointer; the pointer is the base of a live allocation
        // of the current device (the caller bound it).
        check("hipIpcGetMemHandle", unsafe {
            (self.alloc.ctx.hip().ipc_get_mem_handle)(&mut handle, self.alloc.ptr)
        })?;
        lock(exports()).insert(self.alloc.addr(), Arc::downgrade(&self.alloc));
        let mut bytes = Vec::with_capacity(HANDLE_BYTES);
        bytes.extend_from_slice(HANDLE_MAGIC);
        bytes.extend_from_slice(&HANDLE_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(self.alloc.size as u64).to_le_bytes());
        bytes.extend_from_slice(&process_nonce());
        bytes.extend_from_slice(&(self.alloc.ctx.ordinal as u32).to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&self.alloc.addr().to_le_bytes());
        bytes.extend_from_slice(&handle.reserved);
        debug_assert_eq!(bytes.len(), HANDLE_BYTES);
        Ok(ExportedHandle {
            bytes,
            fd: None,
            size: self.len,
        })
    }
}

impl DeviceBuffer for HipBuffer {
    fn ptr(&self) -> DevicePtr {
        DevicePtr(self.alloc.addr())
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// The fields of an exported handle's bytes.
pub(super) struct ParsedHandle {
    pub(super) alloc_size: u64,
    pub(super) nonce: [u8; NONCE_BYTES],
    pub(super) exporter: u32,
    pub(super) addr: u64,
    pub(super) ipc: IpcMemHandle,
}

/// Check and split a handle's bytes; `size` is the length the peer exported.
pub(super) fn parse_handle(b: &[u8], size: usize) -> Result<ParsedHandle> {
    let bad = |why: &str| Error::invalid(format!("HIP IPC handle: {why}"));
    if b.len() != HANDLE_BYTES || &b[..4] != HANDLE_MAGIC {
        return Err(bad("not a ferrocomm HIP handle (wrong magic or length)"));
    }
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let u64_at = |o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    };
    let version = u32_at(4);
    if version != HANDLE_VERSION {
        return Err(bad(&format!("format version {version}, expected {HANDLE_VERSION}")));
    }
    let alloc_size = u64_at(8);
    if alloc_size == 0 || alloc_size > MAX_IMPORT_BYTES || (size as u64) > alloc_size {
        return Err(bad(&format!(
            "allocation of {alloc_size} bytes cannot hold {size} bytes"
        )));
    }
    let mut nonce = [0u8; NONCE_BYTES];
    nonce.copy_from_slice(&b[16..16 + NONCE_BYTES]);
    let o = 16 + NONCE_BYTES;
    let mut ipc = IpcMemHandle {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    ipc.reserved.copy_from_slice(&b[o + 16..o + 16 + IPC_HANDLE_BYTES]);
    Ok(ParsedHandle {
        alloc_size,
        nonce,
        exporter: u32_at(o),
        addr: u64_at(o + 8),
        ipc,
    })
}

/// Importer/exporter device pairs that already have peer access.
fn peer_enabled() -> &'static Mutex<HashSet<(usize, usize)>> {
    static ENABLED: OnceLock<Mutex<HashSet<(usize, usize)>>> = OnceLock::new();
    ENABLED.get_or_init(Default::default)
}

/// Let `ctx`'s device (made current by the caller) access `peer`'s memory.
fn enable_peer_access(ctx: &DeviceCtx, peer: usize) -> Result<()> {
    if ctx.ordinal == peer || lock(peer_enabled()).contains(&(ctx.ordinal, peer)) {
        return Ok(());
    }
    let mut can = 0;
    // SAFETY: valid out-pointer and device ordinals (checked by the runtime).
    check("hipDeviceCanAccessPeer", unsafe {
        (ctx.hip().device_can_access_peer)(&mut can, ctx.ordinal as c_int, peer as c_int)
    })?;
    if can == 0 {
        return Err(Error::Unsupported(format!(
            "HIP device {} cannot access device {peer}'s memory (no XGMI or PCIe peer-to-peer path)",
            ctx.ordinal
        )));
    }
    // SAFETY: plain integer arguments; applies to the current device.
    match unsafe { (ctx.hip().device_enable_peer_access)(peer as c_int, 0) } {
        HIP_SUCCESS => {}
        HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED => super::driver::clear_last_error(),
        other => return Err(error("hipDeviceEnablePeerAccess", other)),
    }
    lock(peer_enabled()).insert((ctx.ordinal, peer));
    Ok(())
}

enum Peer {
    /// Opened with hipIpcOpenMemHandle; closed on drop.
    Ipc { ctx: Arc<DeviceCtx>, ptr: *mut c_void },
    /// An allocation of this process (another thread rank's device); kept
    /// alive by this mapping, like an IPC mapping keeps its memory.
    Local(Arc<Allocation>),
}

/// A peer's exported buffer mapped into this process for this device.
pub struct HipPeerBuffer {
    peer: Peer,
    len: usize,
}

// SAFETY: device addresses only, never dereferenced on the host; the runtime
// is thread-safe.
unsafe impl Send for HipPeerBuffer {}
// SAFETY: as above.
unsafe impl Sync for HipPeerBuffer {}

impl HipPeerBuffer {
    /// Map `handle` for `ctx`'s device, which the caller made current.
    pub(super) fn import(ctx: Arc<DeviceCtx>, handle: ExportedHandle) -> Result<HipPeerBuffer> {
        let h = parse_handle(&handle.bytes, handle.size)?;
        if h.nonce == process_nonce() {
            // The registry lock is released before upgrading: dropping the
            // upgraded Arc (when the filter refuses it) may run Allocation::drop,
            // which takes the lock.
            let weak = lock(exports()).get(&h.addr).cloned();
            let alloc = weak
                .and_then(|w| w.upgrade())
                .filter(|a| a.size as u64 == h.alloc_size && a.ctx.ordinal as u64 == u64::from(h.exporter))
                .ok_or_else(|| {
                    Error::invalid(
                        "HIP IPC handle names an allocation of this process that is gone or was never exported",
                    )
                })?;
            enable_peer_access(&ctx, alloc.ctx.ordinal)?;
            return Ok(HipPeerBuffer {
                peer: Peer::Local(alloc),
                len: handle.size,
            });
        }
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the handle is passed by value as the
        // 64-byte struct the runtime expects; the device is current.
        check("hipIpcOpenMemHandle", unsafe {
            (ctx.hip().ipc_open_mem_handle)(&mut ptr, h.ipc, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        })?;
        Ok(HipPeerBuffer {
            peer: Peer::Ipc { ctx, ptr },
            len: handle.size,
        })
    }

    fn addr(&self) -> u64 {
        match &self.peer {
            Peer::Ipc { ptr, .. } => *ptr as u64,
            Peer::Local(a) => a.addr(),
        }
    }
}

impl DeviceBuffer for HipPeerBuffer {
    fn ptr(&self) -> DevicePtr {
        DevicePtr(self.addr())
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HipPeerBuffer {
    fn drop(&mut self) {
        if let Peer::Ipc { ctx, ptr } = &self.peer {
            ctx.bind_for_drop();
            // SAFETY: closes the mapping opened in `import`, once.
            drop_check("hipIpcCloseMemHandle", unsafe {
                (ctx.hip().ipc_close_mem_handle)(*ptr)
            });
        }
    }
}

/// Host-mapped, pinned, coherent words (`hipHostMalloc` with MAPPED | PORTABLE
/// | COHERENT) that kernels write with system-scope atomics while the host
/// polls them.
pub struct HipHostFlags {
    ctx: Arc<DeviceCtx>,
    host: *mut AtomicU32,
    words: usize,
    dev: u64,
}

// SAFETY: the pointer is to pinned host memory owned by this value and only
// accessed through atomics; the runtime is thread-safe.
unsafe impl Send for HipHostFlags {}
// SAFETY: as above: shared access is atomic loads and stores only.
unsafe impl Sync for HipHostFlags {}

impl HipHostFlags {
    pub(super) fn new(ctx: Arc<DeviceCtx>, words: usize) -> Result<HipHostFlags> {
        let bytes = words.max(1) * 4;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = HIP_HOST_MALLOC_MAPPED | HIP_HOST_MALLOC_PORTABLE | HIP_HOST_MALLOC_COHERENT;
        // SAFETY: valid out-pointer; the device is current.
        check("hipHostMalloc", unsafe {
            (ctx.hip().host_malloc)(&mut p, bytes, flags)
        })?;
        // SAFETY: `p` points at `bytes` writable bytes of pinned memory, page aligned.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
        // Owned from here on, so an error below frees it.
        let mut f = HipHostFlags {
            ctx,
            host: p as *mut AtomicU32,
            words,
            dev: 0,
        };
        let mut d: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` was returned by hipHostMalloc with the MAPPED flag.
        check("hipHostGetDevicePointer", unsafe {
            (f.ctx.hip().host_get_device_pointer)(&mut d, p, 0)
        })?;
        f.dev = d as u64;
        Ok(f)
    }

    fn word(&self, index: usize) -> Option<&AtomicU32> {
        // SAFETY: in bounds (checked), 4-byte aligned, live until drop; AtomicU32
        // has u32's layout.
        (index < self.words).then(|| unsafe { &*self.host.add(index) })
    }
}

impl HostFlags for HipHostFlags {
    fn device_ptr(&self) -> DevicePtr {
        DevicePtr(self.dev)
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

impl Drop for HipHostFlags {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        // SAFETY: frees the allocation made in `new`, once; kernels that wrote
        // it were drained by the owner before dropping.
        drop_check("hipHostFree", unsafe {
            (self.ctx.hip().host_free)(self.host as *mut c_void)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle_bytes(size: u64, nonce: [u8; NONCE_BYTES]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(HANDLE_MAGIC);
        b.extend_from_slice(&HANDLE_VERSION.to_le_bytes());
        b.extend_from_slice(&size.to_le_bytes());
        b.extend_from_slice(&nonce);
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0xdead_0000u64.to_le_bytes());
        b.extend((0..IPC_HANDLE_BYTES).map(|i| i as u8));
        b
    }

    #[test]
    fn handles_round_trip_and_bad_ones_are_refused() {
        assert_eq!(HANDLE_BYTES, 112);
        let b = handle_bytes(4 << 20, [7; NONCE_BYTES]);
        let h = parse_handle(&b, 1000).unwrap();
        assert_eq!(h.alloc_size, 4 << 20);
        assert_eq!(h.exporter, 3);
        assert_eq!(h.addr, 0xdead_0000);
        assert_eq!(h.nonce, [7; NONCE_BYTES]);
        assert_eq!(h.ipc.reserved[63], 63);
        assert!(parse_handle(&b, (4 << 20) + 1).is_err(), "larger than the allocation");
        assert!(parse_handle(&b[..100], 10).is_err());
        let mut wrong = b.clone();
        wrong[0] = b'X';
        assert!(parse_handle(&wrong, 10).is_err());
        let mut v2 = b.clone();
        v2[4] = 2;
        assert!(parse_handle(&v2, 10).is_err());
        assert!(parse_handle(&handle_bytes(0, [0; NONCE_BYTES]), 0).is_err());
        assert!(parse_handle(&handle_bytes(MAX_IMPORT_BYTES + 1, [0; NONCE_BYTES]), 0).is_err());
    }

    #[test]
    fn the_process_nonce_is_stable_and_not_trivial() {
        assert_eq!(process_nonce(), process_nonce());
        assert_ne!(process_nonce(), [0; NONCE_BYTES]);
    }
}
