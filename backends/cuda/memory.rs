//! CUDA memory: plain `cuMemAlloc` buffers, cuMem VMM allocations that can be
//! exported as POSIX file descriptors and mapped by peers, and host-mapped
//! error words.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{check, drop_check, Context};
use crate::device::{DeviceBuffer, DevicePtr, ExportedHandle, HostFlags};
use crate::error::{Error, Result};

/// Header of an exported handle's `bytes`: magic, format version, then the
/// size of the physical allocation (a multiple of the VMM granularity).
const HANDLE_MAGIC: &[u8; 4] = b"FCCU";
const HANDLE_VERSION: u32 = 1;
const HANDLE_BYTES: usize = 16;
/// Refuse to map anything larger than this from a peer's handle.
const MAX_IMPORT_BYTES: u64 = 1 << 40;

/// Allocation properties of a shareable (POSIX fd) pinned allocation on `dev`.
fn vmm_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is a
    // valid value (null pointer, zero flags); the fields that matter are set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop
}

/// The VMM granularity for `dev` (`recommended` or minimum).
fn granularity(dev: sys::CUdevice, recommended: bool) -> Result<usize> {
    let prop = vmm_prop(dev);
    let flag = if recommended {
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    } else {
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    };
    let mut g = 0usize;
    // SAFETY: valid out-pointer and property struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut g, &prop, flag)
    })?;
    Ok(g.max(1))
}

/// A physical VMM allocation mapped at a reserved address range of this
/// process, built step by step so that `Drop` undoes exactly what was done.
pub(super) struct Vmm {
    ctx: Arc<Context>,
    handle: Option<sys::CUmemGenericAllocationHandle>,
    va: sys::CUdeviceptr,
    size: usize,
    mapped: bool,
}

impl Vmm {
    fn empty(ctx: Arc<Context>, size: usize) -> Vmm {
        Vmm {
            ctx,
            handle: None,
            va: 0,
            size,
            mapped: false,
        }
    }

    /// A new allocation of at least `bytes` on `ctx`'s device, mapped read/write
    /// for that device. Not zeroed: the caller fills it.
    pub(super) fn create(ctx: Arc<Context>, bytes: usize) -> Result<Vmm> {
        let gran = granularity(ctx.dev, true)?;
        let size = bytes.max(1).div_ceil(gran) * gran;
        let prop = vmm_prop(ctx.dev);
        let mut v = Vmm::empty(ctx, size);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and property struct; `size` is a multiple
        // of the granularity.
        check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) })?;
        v.handle = Some(handle);
        v.map(gran)?;
        Ok(v)
    }

    /// Import a peer's allocation of `size` bytes from its exported fd and map it
    /// read/write for `ctx`'s device.
    fn import(ctx: Arc<Context>, fd: &OwnedFd, size: usize) -> Result<Vmm> {
        let gran = granularity(ctx.dev, false)?;
        if size == 0 || size % gran != 0 {
            return Err(Error::invalid(format!(
                "imported allocation size {size} is not a multiple of the VMM granularity {gran}"
            )));
        }
        let mut v = Vmm::empty(ctx, size);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX fd handles the "OS handle" argument is the fd value
        // itself cast to a pointer (CUDA driver API docs); `fd` stays open for
        // the call, and the driver does not take ownership of it.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        check("cuMemImportFromShareableHandle", r)?;
        v.handle = Some(handle);
        v.map(gran)?;
        Ok(v)
    }

    /// Reserve an address range, map the allocation there, and grant this
    /// context's device read/write access (what peer access needs under VMM).
    fn map(&mut self, align: usize) -> Result<()> {
        let handle = self
            .handle
            .ok_or_else(|| Error::invalid("mapping a VMM allocation without a handle"))?;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; size and alignment are granularity multiples.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut va, self.size, align, 0, 0)
        })?;
        self.va = va;
        // SAFETY: maps the whole allocation onto the range reserved just above.
        check("cuMemMap", unsafe { sys::cuMemMap(va, self.size, 0, handle, 0) })?;
        self.mapped = true;
        // SAFETY: all-zero is a valid CUmemAccessDesc; fields set below.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = self.ctx.dev;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range is mapped; one valid descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(va, self.size, &desc, 1)
        })
    }

    /// Bytes of the physical allocation (a multiple of the granularity).
    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// A new POSIX fd for the allocation (owned by the caller).
    fn export_fd(&self) -> Result<OwnedFd> {
        let handle = self
            .handle
            .ok_or_else(|| Error::invalid("exporting a VMM allocation without a handle"))?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for POSIX fd handles the output is an int written through the pointer.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut std::ffi::c_int as *mut c_void,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        check("cuMemExportToShareableHandle", r)?;
        if fd < 0 {
            return Err(Error::Backend {
                backend: super::driver::BACKEND,
                call: "cuMemExportToShareableHandle",
                message: format!("returned an invalid fd {fd}"),
            });
        }
        // SAFETY: the driver created this descriptor for us; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        set_cloexec(&fd);
        Ok(fd)
    }
}

/// Mark a descriptor close-on-exec (the driver may not), best effort.
fn set_cloexec(fd: &OwnedFd) {
    // SAFETY: fcntl on a descriptor we own; failures leave it as it was.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFD);
        if flags >= 0 {
            libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, flags | libc::FD_CLOEXEC);
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        // SAFETY: each step undoes one that succeeded in `create`/`import`/`map`;
        // owners drain the streams that used this memory before dropping it.
        unsafe {
            if self.mapped {
                drop_check("cuMemUnmap", sys::cuMemUnmap(self.va, self.size));
            }
            if self.va != 0 {
                drop_check("cuMemAddressFree", sys::cuMemAddressFree(self.va, self.size));
            }
            if let Some(h) = self.handle.take() {
                drop_check("cuMemRelease", sys::cuMemRelease(h));
            }
        }
    }
}

/// A `cuMemAlloc` allocation.
pub(super) struct Plain {
    ctx: Arc<Context>,
    ptr: sys::CUdeviceptr,
}

impl Plain {
    /// `bytes` (at least 1, so that empty buffers still have an address). Not zeroed.
    pub(super) fn new(ctx: Arc<Context>, bytes: usize) -> Result<Plain> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the context is current (the caller bound it).
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) })?;
        Ok(Plain { ctx, ptr })
    }
}

impl Drop for Plain {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        // SAFETY: frees the allocation made in `Plain::new`, once.
        drop_check("cuMemFree", unsafe { sys::cuMemFree_v2(self.ptr) });
    }
}

pub(super) enum Storage {
    Plain(Plain),
    Vmm(Vmm),
}

/// Device memory owned by this rank.
pub struct CudaBuffer {
    pub(super) storage: Storage,
    pub(super) len: usize,
}

impl CudaBuffer {
    pub(super) fn ctx(&self) -> &Context {
        match &self.storage {
            Storage::Plain(p) => &p.ctx,
            Storage::Vmm(v) => &v.ctx,
        }
    }

    pub(super) fn raw(&self) -> sys::CUdeviceptr {
        match &self.storage {
            Storage::Plain(p) => p.ptr,
            Storage::Vmm(v) => v.va,
        }
    }

    /// Export a shareable buffer: a fresh fd plus a 16-byte header.
    pub(super) fn export(&self) -> Result<ExportedHandle> {
        let Storage::Vmm(v) = &self.storage else {
            return Err(Error::invalid("only MemKind::Shareable buffers can be exported"));
        };
        let fd = v.export_fd()?;
        let mut bytes = Vec::with_capacity(HANDLE_BYTES);
        bytes.extend_from_slice(HANDLE_MAGIC);
        bytes.extend_from_slice(&HANDLE_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(v.size as u64).to_le_bytes());
        Ok(ExportedHandle {
            bytes,
            fd: Some(fd),
            size: self.len,
        })
    }
}

impl DeviceBuffer for CudaBuffer {
    fn ptr(&self) -> DevicePtr {
        DevicePtr(self.raw())
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A peer's exported buffer mapped into this process for this device.
/// Unmapped and released on drop.
pub struct CudaPeerBuffer {
    vmm: Vmm,
    len: usize,
}

impl CudaPeerBuffer {
    pub(super) fn import(ctx: Arc<Context>, handle: ExportedHandle) -> Result<CudaPeerBuffer> {
        let bad = |why: &str| Error::invalid(format!("CUDA IPC handle: {why}"));
        let b = &handle.bytes;
        if b.len() != HANDLE_BYTES || &b[..4] != HANDLE_MAGIC {
            return Err(bad("not a ferrocomm CUDA handle (wrong magic or length)"));
        }
        let version = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        if version != HANDLE_VERSION {
            return Err(bad(&format!("format version {version}, expected {HANDLE_VERSION}")));
        }
        let mut size_bytes = [0u8; 8];
        size_bytes.copy_from_slice(&b[8..16]);
        let alloc = u64::from_le_bytes(size_bytes);
        if alloc == 0 || alloc > MAX_IMPORT_BYTES || (handle.size as u64) > alloc {
            return Err(bad(&format!(
                "allocation of {alloc} bytes cannot hold {} bytes",
                handle.size
            )));
        }
        let fd = handle
            .fd
            .as_ref()
            .ok_or_else(|| bad("no file descriptor came with it"))?;
        let vmm = Vmm::import(ctx, fd, alloc as usize)?;
        Ok(CudaPeerBuffer { vmm, len: handle.size })
    }
}

impl DeviceBuffer for CudaPeerBuffer {
    fn ptr(&self) -> DevicePtr {
        DevicePtr(self.vmm.va)
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Host-mapped, pinned words (`cuMemHostAlloc` with DEVICEMAP | PORTABLE) that
/// kernels write with system-scope atomics while the host polls them.
pub struct CudaHostFlags {
    ctx: Arc<Context>,
    host: *mut AtomicU32,
    words: usize,
    dev: sys::CUdeviceptr,
}

// SAFETY: the pointer is to pinned host memory owned by this value and only
// accessed through atomics; the driver handle is thread-safe.
unsafe impl Send for CudaHostFlags {}
// SAFETY: as above: shared access is atomic loads and stores only.
unsafe impl Sync for CudaHostFlags {}

impl CudaHostFlags {
    pub(super) fn new(ctx: Arc<Context>, words: usize) -> Result<CudaHostFlags> {
        let bytes = words.max(1) * 4;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        let r = unsafe {
            sys::cuMemHostAlloc(
                &mut p,
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        };
        check("cuMemHostAlloc", r)?;
        // SAFETY: `p` points at `bytes` writable bytes of pinned memory, page aligned.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
        // Owned from here on, so an error below frees it.
        let mut flags = CudaHostFlags {
            ctx,
            host: p as *mut AtomicU32,
            words,
            dev: 0,
        };
        // SAFETY: `p` was returned by cuMemHostAlloc with DEVICEMAP.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut flags.dev, p, 0)
        })?;
        Ok(flags)
    }

    fn word(&self, index: usize) -> Option<&AtomicU32> {
        // SAFETY: in bounds (checked), 4-byte aligned, live until drop; AtomicU32
        // has u32's layout.
        (index < self.words).then(|| unsafe { &*self.host.add(index) })
    }
}

impl HostFlags for CudaHostFlags {
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

impl Drop for CudaHostFlags {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        // SAFETY: frees the allocation made in `new`, once; kernels that wrote
        // it were drained by the owner before dropping.
        drop_check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(self.host as *mut c_void) });
    }
}
