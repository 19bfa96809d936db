//! The CUDA driver as the GPU layer's table ([`Driver`]): one cudarc `sys`
//! call per entry, every symbol checked at load time (see `driver.rs`).

use std::cell::Cell;
use std::ffi::{c_int, c_void, CStr};
use std::ptr::{null_mut, NonNull};

use cudarc::driver::sys;

use super::driver::{self, check, error, teardown, Context, BACKEND, DROP_ERRORS};
use super::Cuda;
use crate::backends::gpu::errors::DropErrors;
use crate::backends::gpu::vendor::{
    Driver, MemoryType, Opened, PointerInfo, RawEvent, RawFunction, RawGraph, RawGraphExec, RawModule, RawStream,
};
use crate::device::{BackendKind, DeviceFacts, DevicePtr, LaunchConfig};
use crate::error::{Error, Result};

/// What a CUDA device supports beyond the basics.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Virtual memory management (cuMem*) is supported.
    pub vmm: bool,
    /// VMM allocations can be exported as POSIX file descriptors.
    pub posix_fd: bool,
    /// Compute capability.
    pub cc: (i32, i32),
}

fn stream(s: RawStream) -> sys::CUstream {
    s.0 as usize as sys::CUstream
}

fn event(e: RawEvent) -> sys::CUevent {
    e.0 as usize as sys::CUevent
}

fn raw<T>(p: *mut T) -> u64 {
    p as usize as u64
}

pub(super) fn cu_device(ordinal: usize) -> Result<sys::CUdevice> {
    let count = Cuda::device_count()?;
    if ordinal >= count {
        return Err(Error::NoDevice {
            backend: BACKEND,
            reason: format!("device ordinal {ordinal} requested, but {count} CUDA device(s) are visible"),
        });
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; the ordinal is in range (checked above).
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) })?;
    Ok(dev)
}

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer and device handle.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, dev)
    })?;
    Ok(v)
}

/// A pointer attribute of `T`'s size, or the driver's result code.
fn pointer_attribute<T: Default>(ptr: DevicePtr, attr: sys::CUpointer_attribute) -> Result<T, sys::CUresult> {
    let mut v = T::default();
    // SAFETY: `v` is a valid out-location of the attribute's type (the
    // caller picks T to match the attribute: unsigned int, int, size_t or a
    // pointer-sized handle); the driver validates `ptr`.
    let r = unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut c_void, attr, ptr.0) };
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(v)
    } else {
        Err(r)
    }
}

/// What `pointer_info` reads, the allocation's range with it, in one
/// driver call: every collective checks its tensors, and asked one by one
/// the attributes cost seven calls a tensor on the eager path. `None` where
/// the driver refuses the query as a whole; the one-by-one path answers then.
fn pointer_info_at_once(ptr: DevicePtr) -> Option<PointerInfo> {
    use sys::CUpointer_attribute as P;
    let mut attrs = [
        P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        P::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
        P::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        P::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
        P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        P::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    // Zeroed 8-byte slots hold every attribute's type (unsigned int, int,
    // bool, pointers, size_t), read back in its width below.
    let mut vals = [0u64; 7];
    let base = vals.as_mut_ptr();
    let mut data: [*mut c_void; 7] = std::array::from_fn(|i| base.wrapping_add(i) as *mut c_void);
    // SAFETY: `data[i]` points at `vals[i]`, 8 writable bytes, for each of
    // the `attrs.len()` attributes; the driver validates `ptr` (an address it
    // does not know gets zeros, not an error).
    let r = unsafe { sys::cuPointerGetAttributes(attrs.len() as u32, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr.0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    let [kind, ordinal, pool, legacy_ipc, mapping, start, size] = vals;
    let memory = match kind as u32 {
        t if t == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => MemoryType::Host,
        t if t == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemoryType::Device,
        t if t == sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32 => MemoryType::Device,
        _ => MemoryType::Unknown,
    };
    let device_memory = memory == MemoryType::Device;
    let pooled = device_memory && pool != 0;
    Some(PointerInfo {
        memory,
        device: device_memory
            .then(|| usize::try_from(ordinal as u32 as i32).ok())
            .flatten(),
        pooled,
        // As below: cuMemAlloc memory is legacy-IPC capable, a VMM mapping is not.
        vmm: device_memory && !pooled && legacy_ipc as u8 == 0 && mapping != 0,
        range: (start != 0 && size > 0).then_some((DevicePtr(start), size as usize)),
    })
}

/// `CUmemAllocationProp` as the driver fills it, with plain integers where
/// the bindings have Rust enums: a value the bindings do not know (a newer
/// driver's) must not become an invalid enum.
#[repr(C)]
struct FilledProp {
    type_: u32,
    requested_handle_types: u32,
    location_type: u32,
    location_id: c_int,
    win32_metadata: *mut c_void,
    alloc_flags: [u8; 8],
}

const _: () = assert!(std::mem::size_of::<FilledProp>() == std::mem::size_of::<sys::CUmemAllocationProp>());

/// A retained allocation handle of a caller's VMM mapping, released on drop.
pub(super) struct Retained(pub(super) sys::CUmemGenericAllocationHandle);

impl Retained {
    /// The handle behind `ptr`, when `ptr` is in a VMM mapping.
    pub(super) fn of(ptr: DevicePtr) -> Option<Retained> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer; the driver fails for addresses that are
        // not VMM-mapped (cuMemAlloc memory, host memory).
        let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, ptr.0 as usize as *mut c_void) };
        crate::fc_log!(
            tracing::Level::TRACE,
            "cuMemRetainAllocationHandle({:#x}) = {r:?}, handle {h:#x}",
            ptr.0
        );
        (r == sys::CUresult::CUDA_SUCCESS).then_some(Retained(h))
    }

    /// The handle types the allocation was created exportable as.
    pub(super) fn handle_types(&self) -> Result<u32> {
        // SAFETY: all-zero is a valid FilledProp (integers and a null pointer).
        let mut prop: FilledProp = unsafe { std::mem::zeroed() };
        // SAFETY: `FilledProp` has CUmemAllocationProp's size and layout, with
        // integers where the bindings have enums; valid live handle.
        check("cuMemGetAllocationPropertiesFromHandle", unsafe {
            sys::cuMemGetAllocationPropertiesFromHandle(
                &mut prop as *mut FilledProp as *mut sys::CUmemAllocationProp,
                self.0,
            )
        })?;
        Ok(prop.requested_handle_types)
    }
}

impl Drop for Retained {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `Retained::of`, once.
        let r = teardown("cuMemRelease", unsafe { sys::cuMemRelease(self.0) });
        crate::fc_log!(tracing::Level::TRACE, "cuMemRelease(retained {:#x}): {r:?}", self.0);
        DROP_ERRORS.record(r);
    }
}

impl Driver for Cuda {
    const KIND: BackendKind = BackendKind::Cuda;
    const LABEL: &'static str = "CUDA";
    type Context = Context;
    type Extra = Caps;

    fn device_count() -> Result<usize> {
        if let Err(e) = driver::driver() {
            return if driver::driver_says_no_device() { Ok(0) } else { Err(e) };
        }
        let mut n = 0;
        // SAFETY: valid out-pointer; the driver is loaded and initialised.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        Ok(n.max(0) as usize)
    }

    fn drop_errors() -> &'static DropErrors {
        &DROP_ERRORS
    }

    fn open(ordinal: usize) -> Result<Opened<Cuda>> {
        driver::driver()?;
        let dev = cu_device(ordinal)?;
        use sys::CUdevice_attribute as A;
        let sms = attribute(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let major = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let warp = attribute(dev, A::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?;
        let caps = Caps {
            vmm: attribute(dev, A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)? != 0,
            posix_fd: attribute(dev, A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)? != 0,
            cc: (major, minor),
        };
        let map_host = attribute(dev, A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)? != 0;
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev)
        })?;
        // SAFETY: NUL-terminated within the buffer (written by the driver, zero-initialised).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        let mut total = 0usize;
        // SAFETY: valid out-pointer and device handle.
        check("cuDeviceTotalMem", unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) })?;
        Ok(Opened {
            ctx: Context::retain(dev, ordinal, major >= 9)?,
            facts: DeviceFacts {
                backend: BackendKind::Cuda,
                ordinal,
                name,
                arch: format!("sm_{major}{minor}"),
                multiprocessors: sms.max(1) as u32,
                warp_size: warp.max(1) as u32,
                total_memory: total as u64,
            },
            map_host,
            extra: caps,
        })
    }

    fn bind(ctx: &Context) -> Result<()> {
        ctx.bind()
    }

    fn ordinal(ctx: &Context) -> usize {
        ctx.ordinal
    }

    fn context_id(ctx: &Context) -> u64 {
        ctx.id()
    }

    fn can_access_peer(a: usize, b: usize) -> Result<bool> {
        let (da, db) = (cu_device(a)?, cu_device(b)?);
        if a == b {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: valid out-pointer and device handles.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, da, db)
        })?;
        Ok(can != 0)
    }

    fn enable_peer_access(ctx: &Context, peer: usize) -> Result<()> {
        // The peer's primary context, retained for the life of the process:
        // releasing it could destroy it and silently end the access.
        // Never launched on: its launch capability does not matter.
        let peer_ctx = Context::retain(cu_device(peer)?, peer, false)?;
        let raw_peer = peer_ctx.raw();
        std::mem::forget(peer_ctx);
        ctx.bind()?;
        // SAFETY: a live, retained context; the current context is `ctx`.
        match unsafe { sys::cuCtxEnablePeerAccess(raw_peer, 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            other => Err(error("cuCtxEnablePeerAccess", other)),
        }
    }

    fn relax_thread_capture_mode() {
        thread_local!(static RELAXED: Cell<bool> = const { Cell::new(false) });
        if RELAXED.get() || driver::driver().is_err() {
            return;
        }
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a valid in/out pointer; applies to the calling thread only.
        // A failure leaves the thread in the default mode, which only matters
        // while another thread captures in global mode.
        if unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) } == sys::CUresult::CUDA_SUCCESS {
            RELAXED.set(true);
        }
    }

    fn runtime_info() -> String {
        let mut v = 0;
        // SAFETY: valid out-pointer (the driver is loaded: a device exists).
        let ok = driver::driver().is_ok() && unsafe { sys::cuDriverGetVersion(&mut v) } == sys::CUresult::CUDA_SUCCESS;
        if ok {
            format!("CUDA driver {}.{}", v / 1000, (v % 1000) / 10)
        } else {
            "CUDA driver unknown".into()
        }
    }

    fn mem_info(_ctx: &Context) -> Result<(usize, usize)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the context is current (the caller bound it).
        check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok((free, total))
    }

    fn mem_alloc(_ctx: &Context, bytes: usize) -> Result<DevicePtr> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the context is current (the caller bound it).
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) })?;
        Ok(DevicePtr(ptr))
    }

    unsafe fn mem_free(_ctx: &Context, ptr: DevicePtr) -> Result<()> {
        // SAFETY: the caller passes an allocation of `mem_alloc`, freed once.
        teardown("cuMemFree", unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    fn host_alloc_mapped(_ctx: &Context, bytes: usize) -> Result<(NonNull<u8>, DevicePtr)> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: valid out-pointer; the context is current.
        check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut p, bytes, flags) })?;
        let host = NonNull::new(p as *mut u8).ok_or_else(|| Error::Backend {
            backend: BACKEND,
            call: "cuMemHostAlloc",
            message: "returned a null pointer".into(),
        })?;
        // SAFETY: `p` points at `bytes` writable bytes of pinned memory.
        unsafe { std::ptr::write_bytes(host.as_ptr(), 0, bytes) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `p` was returned by cuMemHostAlloc with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) };
        if let Err(e) = check("cuMemHostGetDevicePointer", r) {
            // SAFETY: frees the allocation made above, once.
            DROP_ERRORS.record(teardown("cuMemFreeHost", unsafe { sys::cuMemFreeHost(p) }));
            return Err(e);
        }
        Ok((host, DevicePtr(dev)))
    }

    unsafe fn host_free(_ctx: &Context, host: NonNull<u8>) -> Result<()> {
        // SAFETY: the caller passes an allocation of `host_alloc_mapped`, freed once.
        teardown("cuMemFreeHost", unsafe {
            sys::cuMemFreeHost(host.as_ptr() as *mut c_void)
        })
    }

    unsafe fn memset_async(_ctx: &Context, dst: DevicePtr, value: u8, bytes: usize, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (live stream, live range).
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst.0, value, bytes, stream(s))
        })
    }

    unsafe fn copy_to_device_async(
        _ctx: &Context,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        s: RawStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract (live stream and ranges until it drains).
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.0, src as *const c_void, bytes, stream(s))
        })
    }

    unsafe fn copy_to_host_async(
        _ctx: &Context,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        s: RawStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract (live stream and ranges until it drains).
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src.0, bytes, stream(s))
        })
    }

    unsafe fn copy_device_async(
        _ctx: &Context,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        s: RawStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract; the driver reports an invalid address.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes, stream(s))
        })
    }

    fn pointer_info(_ctx: &Context, ptr: DevicePtr) -> Result<Option<PointerInfo>> {
        if let Some(info) = pointer_info_at_once(ptr) {
            return Ok(Some(info));
        }
        use sys::CUpointer_attribute as P;
        let memory = match pointer_attribute::<u32>(ptr, P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE) {
            Ok(t) if t == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => MemoryType::Host,
            Ok(t) if t == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemoryType::Device,
            Ok(t) if t == sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32 => MemoryType::Device,
            Ok(_) | Err(sys::CUresult::CUDA_ERROR_INVALID_VALUE) => MemoryType::Unknown,
            Err(other) => return Err(error("cuPointerGetAttribute", other)),
        };
        let device = match memory {
            MemoryType::Device => pointer_attribute::<i32>(ptr, P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
                .ok()
                .and_then(|d| usize::try_from(d).ok()),
            _ => None,
        };
        let pooled = memory == MemoryType::Device
            && pointer_attribute::<usize>(ptr, P::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE).is_ok_and(|h| h != 0);
        // VMM without touching the allocation's reference count: cuMemAlloc
        // memory is legacy-IPC capable, a VMM mapping is not. (Retaining a
        // handle here, as this did first, unbalanced releases on driver 580.)
        let vmm = memory == MemoryType::Device
            && !pooled
            && pointer_attribute::<u32>(ptr, P::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE) == Ok(0)
            && pointer_attribute::<usize>(ptr, P::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR).is_ok_and(|b| b != 0);
        crate::fc_log!(
            tracing::Level::TRACE,
            "cuda pointer {:#x}: {memory:?} device {device:?} pooled {pooled} vmm {vmm}",
            ptr.0
        );
        Ok(Some(PointerInfo {
            memory,
            device,
            pooled,
            vmm,
            range: None,
        }))
    }

    fn address_range(_ctx: &Context, ptr: DevicePtr) -> Result<Option<(DevicePtr, usize)>> {
        // The range attributes answer whichever context is current (the
        // importing device's, for a handle coming back to this process).
        use sys::CUpointer_attribute as P;
        if let (Ok(b), Ok(n)) = (
            pointer_attribute::<u64>(ptr, P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR),
            pointer_attribute::<usize>(ptr, P::CU_POINTER_ATTRIBUTE_RANGE_SIZE),
        ) {
            if b != 0 && n > 0 {
                return Ok(Some((DevicePtr(b), n)));
            }
        }
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; the driver validates `ptr`.
        if unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr.0) } == sys::CUresult::CUDA_SUCCESS
            && size > 0
        {
            return Ok(Some((DevicePtr(base), size)));
        }
        // A VMM mapping the calls above do not cover: the driver's view of the mapping.
        let base = pointer_attribute::<usize>(ptr, P::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR);
        let size = pointer_attribute::<usize>(ptr, P::CU_POINTER_ATTRIBUTE_MAPPING_SIZE);
        Ok(match (base, size) {
            (Ok(b), Ok(s)) if b != 0 && s > 0 => Some((DevicePtr(b as u64), s)),
            _ => None,
        })
    }

    fn stream_create(_ctx: &Context) -> Result<RawStream> {
        let mut s: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; the context is current.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, flags) })?;
        Ok(RawStream(raw(s)))
    }

    unsafe fn stream_destroy(_ctx: &Context, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (a live stream, destroyed once).
        teardown("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(stream(s)) })
    }

    unsafe fn stream_synchronize(_ctx: &Context, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (a live stream).
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream(s)) })
    }

    unsafe fn stream_is_capturing(_ctx: &Context, s: RawStream) -> Result<bool> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller's contract (a live stream); valid out-pointer.
        check("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(stream(s), &mut status)
        })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    unsafe fn stream_check_owner(ctx: &Context, s: RawStream) -> Result<()> {
        let mut owner: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the caller's contract (a live stream handle, or one of the
        // special handles 0/1/2, which name the current context's); valid out-pointer.
        match unsafe { sys::cuStreamGetCtx(stream(s), &mut owner) } {
            sys::CUresult::CUDA_SUCCESS if owner == ctx.raw() => Ok(()),
            sys::CUresult::CUDA_SUCCESS => Err(Error::invalid(format!(
                "stream {:#x} belongs to another CUDA context than device {}'s primary context",
                s.0, ctx.ordinal
            ))),
            sys::CUresult::CUDA_ERROR_INVALID_HANDLE | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                Err(Error::invalid(format!("{:#x} is not a live CUDA stream", s.0)))
            }
            other => Err(error("cuStreamGetCtx", other)),
        }
    }

    unsafe fn stream_wait_event(_ctx: &Context, s: RawStream, e: RawEvent) -> Result<()> {
        // SAFETY: the caller's contract (live stream and event).
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream(s), event(e), 0)
        })
    }

    unsafe fn begin_capture(_ctx: &Context, s: RawStream) -> Result<()> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the caller's contract (a live stream).
        check("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(stream(s), mode)
        })
    }

    unsafe fn end_capture(_ctx: &Context, s: RawStream) -> Result<RawGraph> {
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the caller's contract (a live stream); valid out-pointer.
        let r = unsafe { sys::cuStreamEndCapture(stream(s), &mut graph) };
        if r == sys::CUresult::CUDA_SUCCESS {
            return Ok(RawGraph(raw(graph)));
        }
        if !graph.is_null() {
            // SAFETY: a graph the driver handed us despite the error; destroyed once.
            DROP_ERRORS.record(teardown("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) }));
        }
        Err(match r {
            sys::CUresult::CUDA_ERROR_ILLEGAL_STATE => Error::invalid("end_capture on a stream that is not capturing"),
            other => error("cuStreamEndCapture", other),
        })
    }

    unsafe fn graph_instantiate(_ctx: &Context, graph: RawGraph) -> Result<RawGraphExec> {
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: the caller's contract (a live graph); valid out-pointer.
        check("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph.0 as usize as sys::CUgraph, 0)
        })?;
        Ok(RawGraphExec(raw(exec)))
    }

    unsafe fn graph_launch(_ctx: &Context, exec: RawGraphExec, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (live executable graph and stream).
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(exec.0 as usize as sys::CUgraphExec, stream(s))
        })
    }

    unsafe fn graph_exec_destroy(_ctx: &Context, exec: RawGraphExec) -> Result<()> {
        // SAFETY: the caller's contract (released once).
        teardown("cuGraphExecDestroy", unsafe {
            sys::cuGraphExecDestroy(exec.0 as usize as sys::CUgraphExec)
        })
    }

    unsafe fn graph_destroy(_ctx: &Context, graph: RawGraph) -> Result<()> {
        // SAFETY: the caller's contract (released once).
        teardown("cuGraphDestroy", unsafe {
            sys::cuGraphDestroy(graph.0 as usize as sys::CUgraph)
        })
    }

    fn event_create(_ctx: &Context) -> Result<RawEvent> {
        let mut e: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT as u32;
        // SAFETY: valid out-pointer; the context is current.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, flags) })?;
        Ok(RawEvent(raw(e)))
    }

    unsafe fn event_destroy(_ctx: &Context, e: RawEvent) -> Result<()> {
        // SAFETY: the caller's contract (released once).
        teardown("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event(e)) })
    }

    unsafe fn event_record(_ctx: &Context, e: RawEvent, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (live event and stream).
        check("cuEventRecord", unsafe { sys::cuEventRecord(event(e), stream(s)) })
    }

    unsafe fn event_query(_ctx: &Context, e: RawEvent) -> Result<bool> {
        // SAFETY: the caller's contract (a live event).
        match unsafe { sys::cuEventQuery(event(e)) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(error("cuEventQuery", other)),
        }
    }

    unsafe fn event_elapsed_ms(_ctx: &Context, start: RawEvent, end: RawEvent) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: the caller's contract (two live events of one context).
        match unsafe { sys::cuEventElapsedTime_v2(&mut ms, event(start), event(end)) } {
            sys::CUresult::CUDA_SUCCESS => Ok(ms),
            sys::CUresult::CUDA_ERROR_NOT_READY => Err(Error::invalid("elapsed_ms on an event that has not completed")),
            sys::CUresult::CUDA_ERROR_INVALID_HANDLE => Err(Error::invalid(
                "elapsed_ms on an event that was never recorded (or was recorded inside graph capture)",
            )),
            other => Err(error("cuEventElapsedTime", other)),
        }
    }

    fn module_load(_ctx: &Context, image: &[u8]) -> Result<RawModule> {
        let mut m: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is a CUBIN or NUL-terminated PTX image (checked when
        // compiled or read from disk) that outlives the call (the driver
        // copies it); the caller made the context current.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut m, image.as_ptr() as *const c_void)
        })?;
        Ok(RawModule(raw(m)))
    }

    unsafe fn module_unload(_ctx: &Context, m: RawModule) -> Result<()> {
        // SAFETY: the caller's contract (a live module, unloaded once).
        teardown("cuModuleUnload", unsafe {
            sys::cuModuleUnload(m.0 as usize as sys::CUmodule)
        })
    }

    unsafe fn module_function(_ctx: &Context, m: RawModule, name: &CStr) -> Result<Option<RawFunction>> {
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: the caller's contract (a live module); NUL-terminated name;
        // valid out-pointer.
        match unsafe { sys::cuModuleGetFunction(&mut f, m.0 as usize as sys::CUmodule, name.as_ptr()) } {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_NOT_FOUND => return Ok(None),
            other => return Err(error("cuModuleGetFunction", other)),
        }
        // Under lazy loading (the default since CUDA 12.2) the code would
        // otherwise load at its first launch, which may be inside a capture.
        // SAFETY: a function just returned by the driver.
        check("cuFuncLoad", unsafe { sys::cuFuncLoad(f) })?;
        Ok(Some(RawFunction(raw(f))))
    }

    unsafe fn launch(
        ctx: &Context,
        f: RawFunction,
        c: LaunchConfig,
        args: &mut [*mut c_void; 1],
        s: RawStream,
    ) -> Result<()> {
        let func = f.0 as usize as sys::CUfunction;
        if c.dependent && ctx.programmatic {
            // SAFETY: as below; the attribute array lives across the call,
            // which reads it before returning.
            return unsafe { launch_dependent(func, c, args, s) };
        }
        // SAFETY: the caller's contract (function, arguments, module and stream).
        let r = unsafe {
            sys::cuLaunchKernel(
                func,
                c.grid,
                1,
                1,
                c.block,
                1,
                1,
                0,
                stream(s),
                args.as_mut_ptr(),
                null_mut(),
            )
        };
        check("cuLaunchKernel", r)
    }
}

/// `cuLaunchKernelEx` with programmatic stream serialization allowed: the
/// kernel may start before the stream's previous kernel ends (see
/// [`LaunchConfig::dependent`]), on a device of compute capability 9.0 and
/// up (`Context::programmatic`).
///
/// # Safety
/// As `Driver::launch`'s (backends/gpu/vendor.rs).
unsafe fn launch_dependent(
    func: sys::CUfunction,
    c: LaunchConfig,
    args: &mut [*mut c_void; 1],
    s: RawStream,
) -> Result<()> {
    // SAFETY: a plain C struct and union; all zeros is a valid value of each.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: c.grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: c.block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream(s),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the caller's contract (function, arguments, module and
    // stream); `config` and `attr` outlive the call.
    let r = unsafe { sys::cuLaunchKernelEx(&config, func, args.as_mut_ptr(), null_mut()) };
    check("cuLaunchKernelEx", r)
}
