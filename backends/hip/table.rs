//! The HIP runtime as the GPU layer's table ([`Driver`]): one call through
//! the hand-written entry-point table (`driver.rs`) per entry.

use std::cell::Cell;
use std::ffi::{c_int, c_void, CStr};
use std::path::Path;
use std::ptr::NonNull;

use super::driver::{
    self, attr, check, clear_last_error, error, memory_type, runtime, teardown, version_string, DeviceCtx,
    PointerAttributes, Runtime, BACKEND, DROP_ERRORS, HIP_ERROR_ILLEGAL_STATE, HIP_ERROR_INVALID_DEVICE_FUNCTION,
    HIP_ERROR_INVALID_HANDLE, HIP_ERROR_INVALID_VALUE, HIP_ERROR_NOT_FOUND, HIP_ERROR_NOT_READY,
    HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED, HIP_EVENT_DEFAULT, HIP_HOST_MALLOC_COHERENT, HIP_HOST_MALLOC_MAPPED,
    HIP_HOST_MALLOC_PORTABLE, HIP_MEMCPY_DEFAULT, HIP_MEMCPY_DEVICE_TO_HOST, HIP_MEMCPY_HOST_TO_DEVICE,
    HIP_STREAM_CAPTURE_MODE_RELAXED, HIP_STREAM_CAPTURE_MODE_THREAD_LOCAL, HIP_STREAM_CAPTURE_STATUS_NONE,
    HIP_STREAM_NON_BLOCKING, HIP_SUCCESS,
};
use super::{arch, Hip};
use crate::backends::gpu::errors::DropErrors;
use crate::backends::gpu::vendor::{
    Driver, MemoryType, Opened, PointerInfo, RawEvent, RawFunction, RawGraph, RawGraphExec, RawModule, RawStream,
};
use crate::device::{BackendKind, DeviceFacts, DevicePtr, LaunchConfig};
use crate::error::{Error, Result};

/// Where the KFD topology lives (see `arch.rs`).
const KFD_TOPOLOGY: &str = "/sys/class/kfd/kfd/topology/nodes";
/// The wall clock of CDNA GPUs, when the runtime does not report one.
pub(super) const DEFAULT_WALLCLOCK_KHZ: u32 = 100_000;

/// What a HIP device is beyond [`DeviceFacts`].
#[derive(Debug, Clone, Copy)]
pub struct HipCaps {
    /// HIP's compute capability (the gfx major and minor).
    pub cc: (i32, i32),
    /// The wall-clock rate the kernels' deadlines are computed with, in kHz.
    pub wallclock_khz: u32,
    /// `hipRuntimeGetVersion`'s number.
    pub runtime_version: i32,
}

fn ptr(p: DevicePtr) -> *mut c_void {
    p.0 as usize as *mut c_void
}

fn handle(h: u64) -> *mut c_void {
    h as usize as *mut c_void
}

fn raw(p: *mut c_void) -> u64 {
    p as usize as u64
}

fn check_ordinal(ordinal: usize) -> Result<()> {
    let count = Hip::device_count()?;
    if ordinal >= count {
        return Err(Error::NoDevice {
            backend: BACKEND,
            reason: format!("device ordinal {ordinal} requested, but {count} HIP device(s) are visible"),
        });
    }
    Ok(())
}

fn attribute(rt: &Runtime, ordinal: usize, a: i32) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer; the ordinal is in range.
    check("hipDeviceGetAttribute", unsafe {
        (rt.api.device_get_attribute)(&mut v, a, ordinal as c_int)
    })?;
    Ok(v)
}

/// An attribute that older runtimes may not know: `None` instead of an error.
fn optional_attribute(rt: &Runtime, ordinal: usize, a: i32) -> Option<i32> {
    let r = attribute(rt, ordinal, a).ok();
    if r.is_none() {
        clear_last_error();
    }
    r
}

impl Driver for Hip {
    const KIND: BackendKind = BackendKind::Hip;
    const LABEL: &'static str = "HIP";
    type Context = DeviceCtx;
    type Extra = HipCaps;

    fn drop_errors() -> &'static DropErrors {
        &DROP_ERRORS
    }

    fn device_count() -> Result<usize> {
        let rt = match runtime() {
            Ok(rt) => rt,
            Err(_) if driver::runtime_says_no_device() => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut n = 0;
        // SAFETY: valid out-pointer; the runtime is loaded and initialised.
        check("hipGetDeviceCount", unsafe { (rt.api.get_device_count)(&mut n) })?;
        Ok(n.max(0) as usize)
    }

    fn open(ordinal: usize) -> Result<Opened<Hip>> {
        let rt = runtime()?;
        check_ordinal(ordinal)?;
        let ctx = DeviceCtx::new(ordinal, rt);
        ctx.bind()?;
        let cus = attribute(rt, ordinal, attr::MULTIPROCESSOR_COUNT)?;
        let warp = attribute(rt, ordinal, attr::WARP_SIZE)?;
        let major = attribute(rt, ordinal, attr::COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(rt, ordinal, attr::COMPUTE_CAPABILITY_MINOR)?;
        let map_host = attribute(rt, ordinal, attr::CAN_MAP_HOST_MEMORY)? != 0;
        let wallclock_khz = optional_attribute(rt, ordinal, attr::WALL_CLOCK_RATE)
            .filter(|&k| k > 0)
            .map_or(DEFAULT_WALLCLOCK_KHZ, |k| k as u32);
        let pci = match (
            optional_attribute(rt, ordinal, attr::PCI_DOMAIN_ID),
            optional_attribute(rt, ordinal, attr::PCI_BUS_ID),
            optional_attribute(rt, ordinal, attr::PCI_DEVICE_ID),
        ) {
            (Some(d), Some(b), Some(s)) if d >= 0 && b >= 0 && s >= 0 => Some((d as u32, b as u32, s as u32)),
            _ => None,
        };
        let (arch, _source) = arch::resolve(Path::new(KFD_TOPOLOGY), pci, (major, minor))
            .map_err(|why| Error::Unsupported(format!("HIP device {ordinal}: {why}")))?;
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds `len` bytes; the runtime NUL-terminates.
        check("hipDeviceGetName", unsafe {
            (rt.api.device_get_name)(name.as_mut_ptr(), name.len() as c_int - 1, ordinal as c_int)
        })?;
        // SAFETY: NUL-terminated within the buffer (zero-initialised, last byte never written).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        let mut total = 0usize;
        // SAFETY: valid out-pointer; the ordinal is in range.
        check("hipDeviceTotalMem", unsafe {
            (rt.api.device_total_mem)(&mut total, ordinal as c_int)
        })?;
        Ok(Opened {
            ctx,
            facts: DeviceFacts {
                backend: BackendKind::Hip,
                ordinal,
                name,
                arch,
                multiprocessors: cus.max(1) as u32,
                warp_size: warp.max(1) as u32,
                total_memory: total as u64,
            },
            map_host,
            extra: HipCaps {
                cc: (major, minor),
                wallclock_khz,
                runtime_version: rt.version,
            },
        })
    }

    fn bind(ctx: &DeviceCtx) -> Result<()> {
        ctx.bind()
    }

    fn ordinal(ctx: &DeviceCtx) -> usize {
        ctx.ordinal
    }

    fn context_id(ctx: &DeviceCtx) -> u64 {
        ctx.ordinal as u64
    }

    fn can_access_peer(a: usize, b: usize) -> Result<bool> {
        let rt = runtime()?;
        check_ordinal(a)?;
        check_ordinal(b)?;
        if a == b {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: valid out-pointer; ordinals in range.
        check("hipDeviceCanAccessPeer", unsafe {
            (rt.api.device_can_access_peer)(&mut can, a as c_int, b as c_int)
        })?;
        Ok(can != 0)
    }

    fn enable_peer_access(ctx: &DeviceCtx, peer: usize) -> Result<()> {
        ctx.bind()?;
        // SAFETY: plain integer arguments; applies to the current device.
        match unsafe { (ctx.hip().device_enable_peer_access)(peer as c_int, 0) } {
            HIP_SUCCESS => Ok(()),
            HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                clear_last_error();
                Ok(())
            }
            other => Err(error("hipDeviceEnablePeerAccess", other)),
        }
    }

    fn relax_thread_capture_mode() {
        thread_local!(static RELAXED: Cell<bool> = const { Cell::new(false) });
        let Ok(rt) = runtime() else {
            return;
        };
        if RELAXED.get() {
            return;
        }
        let mut mode = HIP_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a valid in/out pointer; applies to the calling thread only.
        // A failure leaves the thread in the default mode, which only matters
        // while another thread captures in global mode.
        if unsafe { (rt.api.thread_exchange_stream_capture_mode)(&mut mode) } == HIP_SUCCESS {
            RELAXED.set(true);
        } else {
            clear_last_error();
        }
    }

    fn runtime_info() -> String {
        match driver::library() {
            Ok(rt) => format!("HIP runtime {} from {}", version_string(rt.version), rt.path),
            Err(e) => format!("no HIP runtime ({e})"),
        }
    }

    fn mem_info(ctx: &DeviceCtx) -> Result<(usize, usize)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the caller made the device current.
        check("hipMemGetInfo", unsafe {
            (ctx.hip().mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    fn mem_alloc(ctx: &DeviceCtx, bytes: usize) -> Result<DevicePtr> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the caller made the device current.
        check("hipMalloc", unsafe { (ctx.hip().malloc)(&mut p, bytes.max(1)) })?;
        Ok(DevicePtr(raw(p)))
    }

    unsafe fn mem_free(ctx: &DeviceCtx, p: DevicePtr) -> Result<()> {
        // SAFETY: the caller passes an allocation of `mem_alloc`, freed once.
        teardown("hipFree", unsafe { (ctx.hip().free)(ptr(p)) })
    }

    fn host_alloc_mapped(ctx: &DeviceCtx, bytes: usize) -> Result<(NonNull<u8>, DevicePtr)> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = HIP_HOST_MALLOC_MAPPED | HIP_HOST_MALLOC_PORTABLE | HIP_HOST_MALLOC_COHERENT;
        // SAFETY: valid out-pointer; the device is current.
        check("hipHostMalloc", unsafe {
            (ctx.hip().host_malloc)(&mut p, bytes, flags)
        })?;
        let host = NonNull::new(p as *mut u8).ok_or_else(|| Error::Backend {
            backend: BACKEND,
            call: "hipHostMalloc",
            message: "returned a null pointer".into(),
        })?;
        // SAFETY: `p` points at `bytes` writable bytes of pinned memory.
        unsafe { std::ptr::write_bytes(host.as_ptr(), 0, bytes) };
        let mut d: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` was returned by hipHostMalloc with the MAPPED flag.
        let r = unsafe { (ctx.hip().host_get_device_pointer)(&mut d, p, 0) };
        if let Err(e) = check("hipHostGetDevicePointer", r) {
            // SAFETY: frees the allocation made above, once.
            DROP_ERRORS.record(teardown("hipHostFree", unsafe { (ctx.hip().host_free)(p) }));
            return Err(e);
        }
        Ok((host, DevicePtr(raw(d))))
    }

    unsafe fn host_free(ctx: &DeviceCtx, host: NonNull<u8>) -> Result<()> {
        // SAFETY: the caller passes an allocation of `host_alloc_mapped`, freed once.
        teardown("hipHostFree", unsafe {
            (ctx.hip().host_free)(host.as_ptr() as *mut c_void)
        })
    }

    unsafe fn memset_async(ctx: &DeviceCtx, dst: DevicePtr, value: u8, bytes: usize, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (live stream, live range).
        check("hipMemsetAsync", unsafe {
            (ctx.hip().memset_async)(ptr(dst), value as c_int, bytes, handle(s.0))
        })
    }

    unsafe fn copy_to_device_async(
        ctx: &DeviceCtx,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        s: RawStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract (live stream and ranges until it drains).
        check("hipMemcpyAsync", unsafe {
            (ctx.hip().memcpy_async)(
                ptr(dst),
                src as *const c_void,
                bytes,
                HIP_MEMCPY_HOST_TO_DEVICE,
                handle(s.0),
            )
        })
    }

    unsafe fn copy_to_host_async(
        ctx: &DeviceCtx,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        s: RawStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract (live stream and ranges until it drains).
        check("hipMemcpyAsync", unsafe {
            (ctx.hip().memcpy_async)(
                dst as *mut c_void,
                ptr(src),
                bytes,
                HIP_MEMCPY_DEVICE_TO_HOST,
                handle(s.0),
            )
        })
    }

    unsafe fn copy_device_async(
        ctx: &DeviceCtx,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        s: RawStream,
    ) -> Result<()> {
        // The direction is inferred: either side may be a peer's mapping or
        // host-mapped flags.
        // SAFETY: the caller's contract; the runtime reports an invalid address.
        check("hipMemcpyAsync", unsafe {
            (ctx.hip().memcpy_async)(ptr(dst), ptr(src), bytes, HIP_MEMCPY_DEFAULT, handle(s.0))
        })
    }

    fn pointer_info(ctx: &DeviceCtx, p: DevicePtr) -> Result<Option<PointerInfo>> {
        // ROCm 5 numbered hipMemoryType differently; its answers are not read.
        if ctx.runtime_version() < 60_000_000 {
            return Ok(None);
        }
        // SAFETY: all-zero is a valid PointerAttributes (integers, null pointers).
        let mut a: PointerAttributes = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer of the runtime's struct layout; the runtime
        // validates the address.
        let r = unsafe { (ctx.hip().pointer_get_attributes)(&mut a, ptr(p) as *const c_void) };
        let memory = match r {
            HIP_SUCCESS => match a.memory_type {
                memory_type::HOST => MemoryType::Host,
                memory_type::DEVICE | memory_type::MANAGED => MemoryType::Device,
                memory_type::UNREGISTERED => MemoryType::Unknown,
                _ => MemoryType::Unknown,
            },
            HIP_ERROR_INVALID_VALUE => {
                clear_last_error();
                MemoryType::Unknown
            }
            other => return Err(error("hipPointerGetAttributes", other)),
        };
        let device = (memory == MemoryType::Device)
            .then(|| usize::try_from(a.device).ok())
            .flatten();
        Ok(Some(PointerInfo {
            memory,
            device,
            pooled: false,
            vmm: false,
            range: None,
        }))
    }

    fn address_range(ctx: &DeviceCtx, p: DevicePtr) -> Result<Option<(DevicePtr, usize)>> {
        let mut base: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: valid out-pointers; the runtime validates the address.
        match unsafe { (ctx.hip().mem_get_address_range)(&mut base, &mut size, ptr(p)) } {
            HIP_SUCCESS if size > 0 && !base.is_null() => Ok(Some((DevicePtr(raw(base)), size))),
            HIP_SUCCESS => Ok(None),
            HIP_ERROR_INVALID_VALUE | HIP_ERROR_NOT_FOUND => {
                clear_last_error();
                Ok(None)
            }
            other => Err(error("hipMemGetAddressRange", other)),
        }
    }

    fn stream_create(ctx: &DeviceCtx) -> Result<RawStream> {
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device is current.
        check("hipStreamCreateWithFlags", unsafe {
            (ctx.hip().stream_create_with_flags)(&mut s, HIP_STREAM_NON_BLOCKING)
        })?;
        Ok(RawStream(raw(s)))
    }

    unsafe fn stream_destroy(ctx: &DeviceCtx, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (a live stream, destroyed once).
        teardown("hipStreamDestroy", unsafe { (ctx.hip().stream_destroy)(handle(s.0)) })
    }

    unsafe fn stream_synchronize(ctx: &DeviceCtx, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (a live stream).
        check("hipStreamSynchronize", unsafe {
            (ctx.hip().stream_synchronize)(handle(s.0))
        })
    }

    unsafe fn stream_is_capturing(ctx: &DeviceCtx, s: RawStream) -> Result<bool> {
        let mut status: c_int = HIP_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller's contract (a live stream); valid out-pointer.
        check("hipStreamIsCapturing", unsafe {
            (ctx.hip().stream_is_capturing)(handle(s.0), &mut status)
        })?;
        Ok(status != HIP_STREAM_CAPTURE_STATUS_NONE)
    }

    unsafe fn stream_check_owner(ctx: &DeviceCtx, s: RawStream) -> Result<()> {
        // ROCm 5 cannot tell; the stream is taken on trust there.
        let Some(get_device) = ctx.hip().stream_get_device else {
            return Ok(());
        };
        let mut dev: c_int = -1;
        // SAFETY: the caller's contract (a live stream handle); valid out-pointer.
        match unsafe { get_device(handle(s.0), &mut dev) } {
            HIP_SUCCESS if dev as i64 == ctx.ordinal as i64 => Ok(()),
            HIP_SUCCESS => Err(Error::invalid(format!(
                "stream {:#x} belongs to HIP device {dev}, not to device {}",
                s.0, ctx.ordinal
            ))),
            HIP_ERROR_INVALID_HANDLE | HIP_ERROR_INVALID_VALUE => {
                clear_last_error();
                Err(Error::invalid(format!("{:#x} is not a live HIP stream", s.0)))
            }
            other => Err(error("hipStreamGetDevice", other)),
        }
    }

    unsafe fn stream_wait_event(ctx: &DeviceCtx, s: RawStream, e: RawEvent) -> Result<()> {
        // SAFETY: the caller's contract (live stream and event).
        check("hipStreamWaitEvent", unsafe {
            (ctx.hip().stream_wait_event)(handle(s.0), handle(e.0), 0)
        })
    }

    unsafe fn begin_capture(ctx: &DeviceCtx, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (a live stream).
        check("hipStreamBeginCapture", unsafe {
            (ctx.hip().stream_begin_capture)(handle(s.0), HIP_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        })
    }

    unsafe fn end_capture(ctx: &DeviceCtx, s: RawStream) -> Result<RawGraph> {
        // Some ROCm versions crash ending a capture that never began.
        // SAFETY: the caller's contract (a live stream).
        if !unsafe { Self::stream_is_capturing(ctx, s) }? {
            return Err(Error::invalid("end_capture on a stream that is not capturing"));
        }
        let hip = ctx.hip();
        let mut graph: *mut c_void = std::ptr::null_mut();
        // SAFETY: the caller's contract (a live stream); valid out-pointer.
        let r = unsafe { (hip.stream_end_capture)(handle(s.0), &mut graph) };
        if r != HIP_SUCCESS {
            if !graph.is_null() {
                // SAFETY: a graph the runtime handed us despite the error; destroyed once.
                DROP_ERRORS.record(teardown("hipGraphDestroy", unsafe { (hip.graph_destroy)(graph) }));
            }
            return Err(match r {
                HIP_ERROR_ILLEGAL_STATE => {
                    clear_last_error();
                    Error::invalid("end_capture on a stream that is not capturing")
                }
                other => error("hipStreamEndCapture", other),
            });
        }
        if graph.is_null() {
            return Err(Error::Backend {
                backend: BACKEND,
                call: "hipStreamEndCapture",
                message: "returned no graph".into(),
            });
        }
        Ok(RawGraph(raw(graph)))
    }

    unsafe fn graph_instantiate(ctx: &DeviceCtx, graph: RawGraph) -> Result<RawGraphExec> {
        let mut exec: *mut c_void = std::ptr::null_mut();
        // SAFETY: the caller's contract (a live graph); valid out-pointer; no
        // error node or log buffer requested.
        check("hipGraphInstantiate", unsafe {
            (ctx.hip().graph_instantiate)(
                &mut exec,
                handle(graph.0),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        })?;
        Ok(RawGraphExec(raw(exec)))
    }

    unsafe fn graph_launch(ctx: &DeviceCtx, exec: RawGraphExec, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (live executable graph and stream).
        check("hipGraphLaunch", unsafe {
            (ctx.hip().graph_launch)(handle(exec.0), handle(s.0))
        })
    }

    unsafe fn graph_exec_destroy(ctx: &DeviceCtx, exec: RawGraphExec) -> Result<()> {
        // SAFETY: the caller's contract (released once).
        teardown("hipGraphExecDestroy", unsafe {
            (ctx.hip().graph_exec_destroy)(handle(exec.0))
        })
    }

    unsafe fn graph_destroy(ctx: &DeviceCtx, graph: RawGraph) -> Result<()> {
        // SAFETY: the caller's contract (released once).
        teardown("hipGraphDestroy", unsafe { (ctx.hip().graph_destroy)(handle(graph.0)) })
    }

    fn event_create(ctx: &DeviceCtx) -> Result<RawEvent> {
        let mut e: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device is current.
        check("hipEventCreateWithFlags", unsafe {
            (ctx.hip().event_create_with_flags)(&mut e, HIP_EVENT_DEFAULT)
        })?;
        Ok(RawEvent(raw(e)))
    }

    unsafe fn event_destroy(ctx: &DeviceCtx, e: RawEvent) -> Result<()> {
        // SAFETY: the caller's contract (released once).
        teardown("hipEventDestroy", unsafe { (ctx.hip().event_destroy)(handle(e.0)) })
    }

    unsafe fn event_record(ctx: &DeviceCtx, e: RawEvent, s: RawStream) -> Result<()> {
        // SAFETY: the caller's contract (live event and stream).
        check("hipEventRecord", unsafe {
            (ctx.hip().event_record)(handle(e.0), handle(s.0))
        })
    }

    unsafe fn event_query(ctx: &DeviceCtx, e: RawEvent) -> Result<bool> {
        // SAFETY: the caller's contract (a live event).
        match unsafe { (ctx.hip().event_query)(handle(e.0)) } {
            HIP_SUCCESS => Ok(true),
            HIP_ERROR_NOT_READY => {
                clear_last_error();
                Ok(false)
            }
            other => Err(error("hipEventQuery", other)),
        }
    }

    unsafe fn event_elapsed_ms(ctx: &DeviceCtx, start: RawEvent, end: RawEvent) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: the caller's contract (two live events of one device).
        match unsafe { (ctx.hip().event_elapsed_time)(&mut ms, handle(start.0), handle(end.0)) } {
            HIP_SUCCESS => Ok(ms),
            HIP_ERROR_NOT_READY => {
                clear_last_error();
                Err(Error::invalid("elapsed_ms on an event that has not completed"))
            }
            HIP_ERROR_INVALID_HANDLE | HIP_ERROR_INVALID_VALUE => {
                clear_last_error();
                Err(Error::invalid("elapsed_ms on events the runtime cannot time"))
            }
            other => Err(error("hipEventElapsedTime", other)),
        }
    }

    fn module_load(ctx: &DeviceCtx, image: &[u8]) -> Result<RawModule> {
        let mut m: *mut c_void = std::ptr::null_mut();
        // SAFETY: `image` is an ELF code object (checked when compiled or read
        // from disk) that outlives the call (the runtime copies it); the
        // caller made the device current.
        check("hipModuleLoadData", unsafe {
            (ctx.hip().module_load_data)(&mut m, image.as_ptr() as *const c_void)
        })?;
        Ok(RawModule(raw(m)))
    }

    unsafe fn module_unload(ctx: &DeviceCtx, m: RawModule) -> Result<()> {
        // SAFETY: the caller's contract (a live module, unloaded once).
        teardown("hipModuleUnload", unsafe { (ctx.hip().module_unload)(handle(m.0)) })
    }

    unsafe fn module_function(ctx: &DeviceCtx, m: RawModule, name: &CStr) -> Result<Option<RawFunction>> {
        let mut f: *mut c_void = std::ptr::null_mut();
        // SAFETY: the caller's contract (a live module); NUL-terminated name;
        // valid out-pointer.
        match unsafe { (ctx.hip().module_get_function)(&mut f, handle(m.0), name.as_ptr()) } {
            HIP_SUCCESS if !f.is_null() => Ok(Some(RawFunction(raw(f)))),
            HIP_SUCCESS | HIP_ERROR_NOT_FOUND | HIP_ERROR_INVALID_DEVICE_FUNCTION => {
                clear_last_error();
                Ok(None)
            }
            other => Err(error("hipModuleGetFunction", other)),
        }
    }

    unsafe fn launch(
        ctx: &DeviceCtx,
        f: RawFunction,
        c: LaunchConfig,
        args: &mut [*mut c_void; 1],
        s: RawStream,
    ) -> Result<()> {
        let launch = ctx.hip().module_launch_kernel;
        let (func, stream) = (handle(f.0), handle(s.0));
        // SAFETY: the caller's contract (function, arguments, module and stream).
        let r = unsafe {
            launch(
                func,
                c.grid,
                1,
                1,
                c.block,
                1,
                1,
                0,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check("hipModuleLaunchKernel", r)
    }
}
