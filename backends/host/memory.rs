//! Host "device memory": memfd-backed shared mappings that a peer process can
//! map after receiving the fd, plus host-mapped error words.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::device::{DeviceBuffer, DevicePtr, ExportedHandle, HostFlags, MemoryInfo};
use crate::error::{Error, Result};

/// A shared mapping of `len` bytes (at least one page is mapped so that
/// zero-sized buffers still have a valid, unique address).
struct Mapping {
    addr: usize,
    map_len: usize,
}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize) -> Result<Mapping> {
        let map_len = len.max(1);
        // SAFETY: mapping a file descriptor we own with a fresh address chosen by
        // the kernel; the result is checked before use.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mmap of {len} bytes"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Mapping {
            addr: addr as usize,
            map_len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the region this Mapping created; no Rust
        // references into it outlive the Mapping (only addresses in queued work,
        // which owners drain before dropping).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.map_len) };
    }
}

fn memfd(len: usize) -> Result<OwnedFd> {
    // SAFETY: memfd_create with a static NUL-terminated name; checked below.
    let fd = unsafe { libc::memfd_create(c"ferrocomm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::io("memfd_create", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on a descriptor we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len.max(1) as libc::off_t) } != 0 {
        return Err(Error::io(
            format!("sizing shared memory to {len} bytes"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(fd)
}

/// An allocation owned by this rank (zero-filled, shareable).
pub struct HostBuffer {
    map: Mapping,
    len: usize,
    fd: Arc<OwnedFd>,
}

/// Live host allocations by address, so caller memory inside one can be
/// exported (`Device::export_range`): start -> (length, its fd).
type Live = BTreeMap<usize, (usize, Weak<OwnedFd>)>;

fn live() -> &'static Mutex<Live> {
    static LIVE: OnceLock<Mutex<Live>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

fn lock_live() -> std::sync::MutexGuard<'static, Live> {
    live().lock().unwrap_or_else(|e| e.into_inner())
}

impl HostBuffer {
    pub(super) fn new(len: usize) -> Result<HostBuffer> {
        let fd = Arc::new(memfd(len)?);
        let map = Mapping::new(&fd, len)?;
        lock_live().insert(map.addr, (len, Arc::downgrade(&fd)));
        Ok(HostBuffer { map, len, fd })
    }

    pub(super) fn export(&self) -> Result<ExportedHandle> {
        export_fd(&self.fd, self.len)
    }
}

fn export_fd(fd: &OwnedFd, len: usize) -> Result<ExportedHandle> {
    let fd = fd
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| Error::io("duplicating a buffer fd for export", e))?;
    Ok(ExportedHandle {
        bytes: (len as u64).to_le_bytes().to_vec(),
        fd: Some(fd),
        size: len,
    })
}

/// Export the host allocation holding `ptr..ptr+bytes`: its handle and the
/// offset of `ptr` in it. Only memory from this backend's allocator can be
/// mapped by another process.
pub(super) fn export_range(ptr: DevicePtr, bytes: usize) -> Result<(ExportedHandle, usize)> {
    let at = ptr.0 as usize;
    let live = lock_live();
    let found = live.range(..=at).next_back().and_then(|(&start, (len, fd))| {
        let end = at.checked_add(bytes)?;
        (end <= start + len).then(|| (start, *len, fd.upgrade()))
    });
    match found {
        Some((start, len, Some(fd))) => Ok((export_fd(&fd, len)?, at - start)),
        _ => Err(Error::Unsupported(format!(
            "{bytes} bytes at {at:#x} are not inside one buffer of the host backend's allocator \
             (Communicator::alloc); only that memory can be shared with other processes"
        ))),
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let mut live = lock_live();
        if live
            .get(&self.map.addr)
            .is_some_and(|(_, w)| w.ptr_eq(&Arc::downgrade(&self.fd)))
        {
            live.remove(&self.map.addr);
        }
    }
}

impl DeviceBuffer for HostBuffer {
    fn ptr(&self) -> DevicePtr {
        DevicePtr(self.map.addr as u64)
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A peer's buffer mapped into this process.
pub struct HostPeerBuffer {
    map: Mapping,
    len: usize,
}

impl HostPeerBuffer {
    pub(super) fn import(handle: ExportedHandle) -> Result<HostPeerBuffer> {
        let fd = handle
            .fd
            .ok_or_else(|| Error::invalid("host IPC handle carries no file descriptor"))?;
        // The fd's real size bounds what we may map: a peer cannot make us map
        // past the end of its file.
        // SAFETY: fstat on a descriptor we own into a zeroed stat struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::io(
                "fstat on an imported buffer",
                std::io::Error::last_os_error(),
            ));
        }
        if (st.st_size as usize) < handle.size.max(1) {
            return Err(Error::invalid(format!(
                "imported buffer is {} bytes, handle claims {}",
                st.st_size, handle.size
            )));
        }
        let map = Mapping::new(&fd, handle.size)?;
        Ok(HostPeerBuffer { map, len: handle.size })
    }
}

impl DeviceBuffer for HostPeerBuffer {
    fn ptr(&self) -> DevicePtr {
        DevicePtr(self.map.addr as u64)
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Error words that kernels set and the host polls.
pub struct HostErrorFlags {
    words: Box<[AtomicU32]>,
}

impl HostErrorFlags {
    pub(super) fn new(words: usize) -> Self {
        HostErrorFlags {
            words: (0..words).map(|_| AtomicU32::new(0)).collect(),
        }
    }
}

impl HostFlags for HostErrorFlags {
    fn device_ptr(&self) -> DevicePtr {
        DevicePtr(self.words.as_ptr() as u64)
    }
    fn load(&self, index: usize) -> u32 {
        self.words.get(index).map_or(0, |w| w.load(Ordering::Acquire))
    }
    fn store(&self, index: usize, value: u32) {
        if let Some(w) = self.words.get(index) {
            w.store(value, Ordering::Release);
        }
    }
}

/// Byte fill at a host "device" address.
///
/// # Safety
/// `dst..dst+len` must be a live, writable mapping.
pub(super) unsafe fn fill(dst: DevicePtr, len: usize, value: u8) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::write_bytes(dst.0 as *mut u8, value, len) }
}

/// Byte copy between host "device" addresses (ranges may overlap).
///
/// # Safety
/// Both ranges must be live mappings, `dst` writable.
pub(super) unsafe fn copy(dst: DevicePtr, src: DevicePtr, len: usize) {
    // SAFETY: guaranteed by the caller; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, len) }
}

/// The host backend's device memory is the system's: `MemAvailable` and
/// `MemTotal` of `/proc/meminfo`.
pub(super) fn system_memory() -> Result<MemoryInfo> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| Error::io("reading /proc/meminfo", e))?;
    let field = |name: &str| -> Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .ok_or_else(|| Error::Unsupported(format!("/proc/meminfo has no {name} line")))
    };
    Ok(MemoryInfo {
        free: field("MemAvailable")?,
        total: field("MemTotal")?,
    })
}
