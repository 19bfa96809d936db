//! HIP's IPC flavour: shareable memory is uncached
//! (`hipExtMallocWithFlags(hipDeviceMallocUncached)`, so peers over XGMI
//! never read stale lines), rounded up to a dedicated 2 MiB multiple, and
//! exported with `hipIpcGetMemHandle` (the 64-byte handle travels through
//! the store, no file descriptor); peers open it with `hipIpcOpenMemHandle`.
//! Caller memory exports the handle of the allocation that holds it. HIP
//! refuses to open a handle in the process that made it, so those come back
//! by address (the GPU layer's same-process registry).

use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::driver::{
    check, clear_last_error, error, teardown, DeviceCtx, IpcMemHandle, DROP_ERRORS, HIP_DEVICE_MALLOC_UNCACHED,
    HIP_ERROR_INVALID_VALUE, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, HIP_SUCCESS,
};
use super::Hip;
use crate::backends::gpu::handle::{HandleKind, ParsedHandle, IPC_HANDLE_BYTES};
use crate::backends::gpu::vendor::{Export, Ipc, PointerInfo};
use crate::device::DevicePtr;
use crate::error::{Error, Result};

/// Shareable allocations are rounded up to this, so each is a dedicated
/// allocation that the runtime does not suballocate (an IPC handle exports
/// the whole underlying allocation), and the whole of it is zeroed.
pub const SHAREABLE_GRANULARITY: usize = 2 << 20;

/// Uncached device memory that can be exported; freed on drop.
pub struct HipShared {
    ctx: Arc<DeviceCtx>,
    ptr: u64,
    size: usize,
}

impl Drop for HipShared {
    fn drop(&mut self) {
        DROP_ERRORS.record(self.ctx.bind());
        // SAFETY: frees the allocation made in `alloc_shared`, once; owners
        // drain the streams (and peers) that used it before the last drop.
        DROP_ERRORS.record(teardown("hipFree", unsafe {
            (self.ctx.hip().free)(self.ptr as usize as *mut c_void)
        }));
    }
}

/// Another process's memory opened with `hipIpcOpenMemHandle`; closed on drop.
pub struct HipMapping {
    ctx: Arc<DeviceCtx>,
    ptr: u64,
}

impl Drop for HipMapping {
    fn drop(&mut self) {
        DROP_ERRORS.record(self.ctx.bind());
        // SAFETY: closes the mapping opened in `open_handle`, once.
        DROP_ERRORS.record(teardown("hipIpcCloseMemHandle", unsafe {
            (self.ctx.hip().ipc_close_mem_handle)(self.ptr as usize as *mut c_void)
        }));
    }
}

/// The IPC handle of the allocation starting at `base`.
fn ipc_handle(ctx: &DeviceCtx, base: DevicePtr) -> Result<Vec<u8>> {
    let mut handle = IpcMemHandle {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    // SAFETY: valid out-pointer; `base` is the start of a live allocation of
    // the current device (checked by the caller).
    match unsafe { (ctx.hip().ipc_get_mem_handle)(&mut handle, base.0 as usize as *mut c_void) } {
        HIP_SUCCESS => Ok(handle.reserved.to_vec()),
        HIP_ERROR_INVALID_VALUE => {
            clear_last_error();
            Err(Error::Unsupported(format!(
                "the allocation at {:#x} cannot be shared with a HIP IPC handle",
                base.0
            )))
        }
        other => Err(error("hipIpcGetMemHandle", other)),
    }
}

impl Ipc for Hip {
    type Shared = HipShared;
    type Mapping = HipMapping;

    fn alloc_shared(ctx: &Arc<DeviceCtx>, bytes: usize) -> Result<HipShared> {
        let size = bytes
            .max(1)
            .checked_next_multiple_of(SHAREABLE_GRANULARITY)
            .ok_or_else(|| Error::invalid(format!("cannot allocate {bytes} bytes")))?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the caller made the device current.
        check("hipExtMallocWithFlags", unsafe {
            (ctx.hip().ext_malloc_with_flags)(&mut p, size, HIP_DEVICE_MALLOC_UNCACHED)
        })?;
        Ok(HipShared {
            ctx: ctx.clone(),
            ptr: p as usize as u64,
            size,
        })
    }

    fn shared_range(s: &HipShared) -> (DevicePtr, usize) {
        (DevicePtr(s.ptr), s.size)
    }

    fn export_shared(ctx: &DeviceCtx, s: &HipShared) -> Result<Export> {
        Ok(Export {
            kind: HandleKind::HipIpc,
            payload: ipc_handle(ctx, DevicePtr(s.ptr))?,
            fd: None,
            base: DevicePtr(s.ptr),
            size: s.size,
        })
    }

    fn export_caller(
        ctx: &DeviceCtx,
        _ptr: DevicePtr,
        base: DevicePtr,
        size: usize,
        _: &PointerInfo,
    ) -> Result<Export> {
        Ok(Export {
            kind: HandleKind::HipIpc,
            payload: ipc_handle(ctx, base)?,
            fd: None,
            base,
            size,
        })
    }

    fn open_handle(ctx: &Arc<DeviceCtx>, h: &ParsedHandle, _fd: Option<&OwnedFd>) -> Result<HipMapping> {
        if h.kind != HandleKind::HipIpc {
            return Err(Error::invalid(format!(
                "HIP IPC handle: a {:?} handle is not HIP's",
                h.kind
            )));
        }
        let mut handle = IpcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        handle.reserved.copy_from_slice(&h.payload[..IPC_HANDLE_BYTES]);
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the handle is passed by value as the
        // 64-byte struct the runtime expects; the device is current.
        check("hipIpcOpenMemHandle", unsafe {
            (ctx.hip().ipc_open_mem_handle)(&mut p, handle, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        })?;
        Ok(HipMapping {
            ctx: ctx.clone(),
            ptr: p as usize as u64,
        })
    }

    fn mapping_ptr(m: &HipMapping) -> DevicePtr {
        DevicePtr(m.ptr)
    }
}
