//! CUDA's IPC flavour.
//!
//! - ferrocomm's shareable memory is a cuMem VMM allocation (POSIX fd handle
//!   type) mapped read/write for this device; it exports as a file
//!   descriptor that peers import and map with access for *their* device
//!   (what peer access means under VMM: no `cuCtxEnablePeerAccess`).
//! - Caller memory ([`export_range`](crate::device::Device::export_range)):
//!   a VMM mapping whose allocation was made exportable as a POSIX fd
//!   (ferrocomm's own, PyTorch's expandable segments when so configured)
//!   exports the same way; `cuMemAlloc`/`cudaMalloc` memory exports a legacy
//!   `cuIpcGetMemHandle` of its allocation, opened by peers with
//!   `cuIpcOpenMemHandle` (lazy peer access). Stream-ordered pool memory
//!   (`cudaMallocAsync`) has no handle: it is refused.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{check, error, teardown, Context, BACKEND, DROP_ERRORS};
use super::table::Retained;
use super::Cuda;
use crate::backends::gpu::handle::{HandleKind, ParsedHandle, IPC_HANDLE_BYTES};
use crate::backends::gpu::vendor::{Export, Ipc, PointerInfo};
use crate::device::DevicePtr;
use crate::error::{Error, Result};

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

/// Whether `dev` can make VMM allocations exportable as POSIX fds.
fn can_share(dev: sys::CUdevice) -> Result<bool> {
    use sys::CUdevice_attribute as A;
    let mut vmm = 0;
    let mut fd = 0;
    // SAFETY: valid out-pointers and device handle.
    unsafe {
        check(
            "cuDeviceGetAttribute",
            sys::cuDeviceGetAttribute(
                &mut vmm,
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                dev,
            ),
        )?;
        check(
            "cuDeviceGetAttribute",
            sys::cuDeviceGetAttribute(
                &mut fd,
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                dev,
            ),
        )?;
    }
    Ok(vmm != 0 && fd != 0)
}

/// A physical VMM allocation mapped at a reserved address range of this
/// process, built step by step so that `Drop` undoes exactly what was done.
pub struct Vmm {
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
    fn create(ctx: Arc<Context>, bytes: usize) -> Result<Vmm> {
        let gran = granularity(ctx.dev, true)?;
        let size = bytes
            .max(1)
            .checked_next_multiple_of(gran)
            .ok_or_else(|| Error::invalid(format!("cannot allocate {bytes} bytes")))?;
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
}

/// A new POSIX fd for an allocation handle (owned by the caller).
fn export_fd(handle: sys::CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: for POSIX fd handles the output is an int written through the pointer.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            &mut fd as *mut c_int as *mut c_void,
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    check("cuMemExportToShareableHandle", r)?;
    if fd < 0 {
        return Err(Error::Backend {
            backend: BACKEND,
            call: "cuMemExportToShareableHandle",
            message: format!("returned an invalid fd {fd}"),
        });
    }
    // SAFETY: the driver created this descriptor for us; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_cloexec(&fd);
    Ok(fd)
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
        DROP_ERRORS.record(self.ctx.bind());
        // SAFETY: each step undoes one that succeeded in `create`/`import`/`map`;
        // owners drain the streams that used this memory before dropping it.
        unsafe {
            if self.mapped {
                DROP_ERRORS.record(teardown("cuMemUnmap", sys::cuMemUnmap(self.va, self.size)));
            }
            if self.va != 0 {
                DROP_ERRORS.record(teardown("cuMemAddressFree", sys::cuMemAddressFree(self.va, self.size)));
            }
            if let Some(h) = self.handle.take() {
                let r = teardown("cuMemRelease", sys::cuMemRelease(h));
                crate::fc_log!(
                    tracing::Level::TRACE,
                    "VMM drop: handle {h:#x} at {:#x}+{:#x} (mapped {}): release {r:?}",
                    self.va,
                    self.size,
                    self.mapped
                );
                DROP_ERRORS.record(r);
            }
        }
    }
}

/// A legacy IPC mapping of another process's memory, closed on drop.
pub struct IpcMapping {
    ctx: Arc<Context>,
    ptr: sys::CUdeviceptr,
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        DROP_ERRORS.record(self.ctx.bind());
        // SAFETY: closes the mapping opened in `open`, once.
        DROP_ERRORS.record(teardown("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(self.ptr)
        }));
    }
}

/// A peer's memory mapped into this process.
pub enum CudaMapping {
    Vmm(Vmm),
    Ipc(IpcMapping),
}

impl Ipc for Cuda {
    type Shared = Vmm;
    type Mapping = CudaMapping;

    fn alloc_shared(ctx: &Arc<Context>, bytes: usize) -> Result<Vmm> {
        if !can_share(ctx.dev)? {
            return Err(Error::Unsupported(format!(
                "CUDA device {} lacks VMM or POSIX fd handles, so it cannot share memory",
                ctx.ordinal
            )));
        }
        Vmm::create(ctx.clone(), bytes)
    }

    fn shared_range(v: &Vmm) -> (DevicePtr, usize) {
        (DevicePtr(v.va), v.size)
    }

    fn export_shared(_ctx: &Context, v: &Vmm) -> Result<Export> {
        let handle = v
            .handle
            .ok_or_else(|| Error::invalid("exporting a VMM allocation without a handle"))?;
        Ok(Export {
            kind: HandleKind::VmmFd,
            payload: Vec::new(),
            fd: Some(export_fd(handle)?),
            base: DevicePtr(v.va),
            size: v.size,
        })
    }

    fn export_caller(
        _ctx: &Context,
        ptr: DevicePtr,
        base: DevicePtr,
        size: usize,
        info: &PointerInfo,
    ) -> Result<Export> {
        if info.pooled {
            return Err(Error::Unsupported(format!(
                "{:#x} is stream-ordered pool memory (cudaMallocAsync / cuMemAllocAsync), which CUDA cannot export; \
                 allocate shared buffers with ferrocomm's allocator or cudaMalloc",
                ptr.0
            )));
        }
        if info.vmm {
            let h = Retained::of(ptr).ok_or_else(|| {
                Error::Unsupported(format!(
                    "{:#x} is VMM memory whose allocation handle CUDA does not give",
                    ptr.0
                ))
            })?;
            let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
            if h.handle_types()? & posix == 0 {
                return Err(Error::Unsupported(format!(
                    "{:#x} is a VMM allocation created without POSIX fd handles, so it cannot be shared \
                     (PyTorch: expandable segments need IPC handles enabled)",
                    ptr.0
                )));
            }
            // The importer maps the whole physical allocation from its start:
            // the mapping holding `ptr` is taken to be all of it, as the
            // allocators that export VMM memory map it.
            return Ok(Export {
                kind: HandleKind::VmmFd,
                payload: Vec::new(),
                fd: Some(export_fd(h.0)?),
                base,
                size,
            });
        }
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: valid out-pointer; `base` is the start of a live cuMemAlloc
        // allocation of the current context (checked by the caller).
        match unsafe { sys::cuIpcGetMemHandle(&mut handle, base.0) } {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_INVALID_VALUE | sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => {
                return Err(Error::Unsupported(format!(
                    "the allocation at {:#x} cannot be shared with a legacy CUDA IPC handle",
                    base.0
                )))
            }
            other => return Err(error("cuIpcGetMemHandle", other)),
        }
        Ok(Export {
            kind: HandleKind::CudaIpc,
            payload: handle.reserved.iter().map(|&c| c as u8).collect(),
            fd: None,
            base,
            size,
        })
    }

    fn open_handle(ctx: &Arc<Context>, h: &ParsedHandle, fd: Option<&OwnedFd>) -> Result<CudaMapping> {
        match h.kind {
            HandleKind::VmmFd => {
                let fd = fd.ok_or_else(|| Error::invalid("CUDA IPC handle: no file descriptor came with it"))?;
                let size = usize::try_from(h.alloc_size)
                    .map_err(|_| Error::invalid("CUDA IPC handle: allocation too large"))?;
                Ok(CudaMapping::Vmm(Vmm::import(ctx.clone(), fd, size)?))
            }
            HandleKind::CudaIpc => {
                let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
                for (d, s) in handle.reserved.iter_mut().zip(&h.payload[..IPC_HANDLE_BYTES]) {
                    *d = *s as std::ffi::c_char;
                }
                let mut ptr: sys::CUdeviceptr = 0;
                let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
                // SAFETY: valid out-pointer; the handle is passed by value as
                // the 64-byte struct the driver expects; the context is current.
                check("cuIpcOpenMemHandle", unsafe {
                    sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags)
                })?;
                Ok(CudaMapping::Ipc(IpcMapping { ctx: ctx.clone(), ptr }))
            }
            HandleKind::HipIpc => Err(Error::invalid("CUDA IPC handle: it is a HIP handle")),
        }
    }

    fn mapping_ptr(m: &CudaMapping) -> DevicePtr {
        match m {
            CudaMapping::Vmm(v) => DevicePtr(v.va),
            CudaMapping::Ipc(i) => DevicePtr(i.ptr),
        }
    }
}
