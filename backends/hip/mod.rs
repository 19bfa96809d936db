//! The HIP (ROCm) backend: the HIP runtime and hipRTC, loaded at run time with
//! libloading through a hand-written table of the entry points it calls, so it
//! builds with no ROCm installed and never links libamdhip64.
//!
//! - **Device binding.** HIP keeps the current device per thread; every method
//!   of a [`HipDevice`] (and every resource's `Drop`) first makes its device
//!   current (`hipSetDevice`), so any thread may call it.
//! - **Memory.** [`MemKind::Plain`] is `hipMalloc`. [`MemKind::Shareable`] is
//!   `hipExtMallocWithFlags(hipDeviceMallocUncached)`: flags and workspaces in
//!   uncached memory, so peers over XGMI never read stale lines. It is rounded
//!   up to a dedicated 2 MiB multiple, exported with `hipIpcGetMemHandle` (the
//!   64-byte handle travels through the store, no file descriptor) and opened
//!   by peers with `hipIpcOpenMemHandle`; a handle that comes back to the
//!   process that made it (ranks as threads) maps the same memory with peer
//!   access instead, since HIP refuses that open. Every allocation is returned
//!   zeroed, like the host backend's.
//! - **Host flags** are `hipHostMalloc(MAPPED | PORTABLE | COHERENT)` words
//!   with their device alias from `hipHostGetDevicePointer`.
//! - **Streams** are `hipStreamNonBlocking`; **events** time; **graphs** are
//!   captured in `hipStreamCaptureModeThreadLocal` mode.
//! - **Kernels** are compiled by hipRTC for the device's gfx target (see
//!   [`arch`](self) for how it is found without `hipDeviceProp_t`) and cached
//!   per process and on disk (see [`module`](self)).
//!
//! Nothing here panics when libamdhip64, hipRTC or a device is missing: the
//! failure comes back as [`Error::LibraryMissing`] or [`Error::NoDevice`].

mod arch;
mod driver;
mod memory;
mod module;
mod stream;

pub use driver::drop_error_count;
pub use memory::{HipBuffer, HipHostFlags, HipPeerBuffer};
pub use module::HipModule;
pub use stream::{HipEvent, HipGraph, HipStream};

use std::ffi::{c_int, c_void};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use driver::{attr, check, runtime, DeviceCtx, Runtime};
use memory::Allocation;

use crate::algo::layout::MAX_BLOCKS;
use crate::device::{
    check_range, BackendKind, Device, DeviceBuffer, DeviceFacts, DevicePtr, ExportedHandle, KernelParams, LaunchConfig,
    MemKind, ModuleSource,
};
use crate::error::{Error, Result};

/// Threads per block of every collective launch. The kernels are compiled with
/// `-DFC_MAX_BLOCK_THREADS` equal to this, so larger blocks are refused.
pub use crate::algo::BLOCK_THREADS;

/// Where the KFD topology lives (see [`arch`](self)).
const KFD_TOPOLOGY: &str = "/sys/class/kfd/kfd/topology/nodes";
/// The wall clock of CDNA GPUs, when the runtime does not report one.
const DEFAULT_WALLCLOCK_KHZ: u32 = 100_000;

/// Number of HIP devices. `Ok(0)` when the runtime loads but finds none;
/// [`Error::LibraryMissing`] when there is no usable libamdhip64.
pub fn device_count() -> Result<usize> {
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            return if driver::runtime_says_no_device() {
                Ok(0)
            } else {
                Err(e)
            }
        }
    };
    let mut n = 0;
    // SAFETY: valid out-pointer; the runtime is loaded and initialised.
    check("hipGetDeviceCount", unsafe { (rt.api.get_device_count)(&mut n) })?;
    Ok(n.max(0) as usize)
}

/// The HIP runtime's version as `(major, minor, patch)` and the file it was
/// loaded from, or [`Error::LibraryMissing`].
/// Needs no device.
pub fn runtime_version() -> Result<((i32, i32, i32), String)> {
    let rt = driver::library()?;
    let v = rt.version;
    Ok(((v / 10_000_000, (v / 100_000) % 100, v % 100_000), rt.path.clone()))
}

/// hipRTC's version `(major, minor)` and the file it was loaded from, or
/// [`Error::LibraryMissing`] when it cannot be found (see
/// `FERROCOMM_HIPRTC_LIB`). Needs no device.
pub fn hiprtc_version() -> Result<((i32, i32), String)> {
    driver::rtc().map(|r| (r.version, r.path.clone()))
}

/// Compile `source` (its `hip` text) for `arch` (e.g. `gfx942`) with hipRTC and
/// return the code object, without a device and without the kernel caches:
/// for checking a ROCm installation or a toolchain. Deadlines use the CDNA
/// wall clock (100 MHz).
///
/// Errors: [`Error::LibraryMissing`] without libamdhip64 or hipRTC,
/// [`Error::Compile`] with hipRTC's log, [`Error::Unsupported`] for a module
/// with no HIP text.
pub fn compile_module(source: &ModuleSource, arch: &str) -> Result<Vec<u8>> {
    module::compile_fresh(source, arch, DEFAULT_WALLCLOCK_KHZ)
}

/// Whether device `a` can read and write device `b`'s memory directly (XGMI
/// or PCIe peer-to-peer). `true` when `a == b`.
pub fn can_access_peer(a: usize, b: usize) -> Result<bool> {
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

/// The stream's `hipStream_t` as an integer, for the RCCL layer (`backends::ccl`).
pub(crate) fn raw_stream(stream: &HipStream) -> u64 {
    stream.raw as usize as u64
}

fn check_ordinal(ordinal: usize) -> Result<()> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::NoDevice {
            backend: driver::BACKEND,
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
        driver::clear_last_error();
    }
    r
}

/// What the device supports beyond the basics.
#[derive(Debug, Clone, Copy)]
struct Caps {
    map_host: bool,
    cc: (i32, i32),
    wallclock_khz: u32,
}

/// One HIP device, as seen by one rank.
pub struct HipDevice {
    aux: HipStream,
    ctx: Arc<DeviceCtx>,
    rt: &'static Runtime,
    facts: DeviceFacts,
    caps: Caps,
}

impl HipDevice {
    /// Open device `ordinal`: load the runtime, read the device's facts and
    /// find its gfx target.
    ///
    /// Errors: [`Error::LibraryMissing`] without libamdhip64,
    /// [`Error::NoDevice`] when the device does not exist, [`Error::Unsupported`]
    /// when its gfx target cannot be told (set `FERROCOMM_HIP_ARCH`),
    /// [`Error::Backend`] when a runtime call fails.
    pub fn new(ordinal: usize) -> Result<Self> {
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
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut total = 0usize;
        // SAFETY: valid out-pointer; the ordinal is in range.
        check("hipDeviceTotalMem", unsafe {
            (rt.api.device_total_mem)(&mut total, ordinal as c_int)
        })?;

        let aux = HipStream::new(ctx.clone())?;
        Ok(HipDevice {
            aux,
            ctx,
            rt,
            facts: DeviceFacts {
                backend: BackendKind::Hip,
                ordinal,
                name,
                arch,
                multiprocessors: cus.max(1) as u32,
                warp_size: warp.max(1) as u32,
                total_memory: total as u64,
            },
            caps: Caps {
                map_host,
                cc: (major, minor),
                wallclock_khz,
            },
        })
    }

    /// Make this device current on the calling thread (what RCCL's
    /// `ncclCommInitRank` and the HIP runtime read as "the device").
    pub fn make_current(&self) -> Result<()> {
        self.ctx.bind()
    }

    /// HIP's compute capability `(major, minor)` (the gfx major and minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.caps.cc
    }

    /// The wall-clock rate the kernels' deadlines are computed with, in kHz.
    pub fn wallclock_khz(&self) -> u32 {
        self.caps.wallclock_khz
    }

    /// Refuse handles created on another device.
    fn same_ctx(&self, what: &str, other: &DeviceCtx) -> Result<()> {
        if self.ctx.same(other) {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what} belongs to HIP device {}, not to device {}",
                other.ordinal, self.ctx.ordinal
            )))
        }
    }

    /// Bind the device and check that `stream` is ours.
    fn enter(&self, stream: &HipStream) -> Result<()> {
        self.same_ctx("stream", &stream.ctx)?;
        self.ctx.bind()
    }

    /// Zero-fill a fresh allocation on the private stream and wait for it, so
    /// the memory is zero before any other stream (or peer) touches it.
    fn zero_fill(&self, ptr: *mut c_void, bytes: usize) -> Result<()> {
        // SAFETY: `ptr..ptr+bytes` is a live allocation of this device.
        check("hipMemsetAsync", unsafe {
            (self.rt.api.memset_async)(ptr, 0, bytes, self.aux.raw)
        })?;
        self.aux.synchronize()
    }
}

impl Device for HipDevice {
    type Buffer = HipBuffer;
    type PeerBuffer = HipPeerBuffer;
    type Flags = HipHostFlags;
    type Stream = HipStream;
    type Event = HipEvent;
    type Graph = HipGraph;
    type Module = HipModule;

    fn facts(&self) -> &DeviceFacts {
        &self.facts
    }

    fn alloc(&self, bytes: usize, kind: MemKind) -> Result<HipBuffer> {
        self.ctx.bind()?;
        let alloc = match kind {
            MemKind::Plain => Allocation::plain(self.ctx.clone(), bytes)?,
            MemKind::Shareable => Allocation::shareable(self.ctx.clone(), bytes)?,
        };
        let buf = HipBuffer {
            alloc: Arc::new(alloc),
            len: bytes,
        };
        // Exported memory must not leak old contents (peers map the whole
        // allocation, rounding included); plain memory is zeroed too, as the
        // host backend's is.
        self.zero_fill(buf.raw(), buf.allocated())?;
        Ok(buf)
    }

    fn alloc_host_flags(&self, words: usize) -> Result<HipHostFlags> {
        if !self.caps.map_host {
            return Err(Error::Unsupported(format!(
                "HIP device {} cannot map host memory",
                self.ctx.ordinal
            )));
        }
        self.ctx.bind()?;
        HipHostFlags::new(self.ctx.clone(), words)
    }

    fn memset(&self, buf: &HipBuffer, offset: usize, len: usize, value: u8, stream: &HipStream) -> Result<()> {
        check_range("memset", buf.len(), offset, len)?;
        self.same_ctx("buffer", buf.ctx())?;
        self.enter(stream)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the range was checked against the live buffer; stream-ordered.
        check("hipMemsetAsync", unsafe {
            (self.rt.api.memset_async)(
                (buf.raw() as *mut u8).add(offset) as *mut c_void,
                value as c_int,
                len,
                stream.raw,
            )
        })
    }

    fn copy_from_host(&self, buf: &HipBuffer, offset: usize, src: &[u8], stream: &HipStream) -> Result<()> {
        check_range("copy_from_host", buf.len(), offset, src.len())?;
        self.same_ctx("buffer", buf.ctx())?;
        self.enter(stream)?;
        // A captured copy would read `src` at replay time, after it is gone.
        stream.refuse_in_capture("copy_from_host")?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: destination range checked; `src` stays borrowed until the
        // stream is synchronised below, so the copy never outlives it.
        check("hipMemcpyAsync", unsafe {
            (self.rt.api.memcpy_async)(
                (buf.raw() as *mut u8).add(offset) as *mut c_void,
                src.as_ptr() as *const c_void,
                src.len(),
                driver::HIP_MEMCPY_HOST_TO_DEVICE,
                stream.raw,
            )
        })?;
        stream.synchronize()
    }

    fn copy_to_host(&self, buf: &HipBuffer, offset: usize, dst: &mut [u8], stream: &HipStream) -> Result<()> {
        check_range("copy_to_host", buf.len(), offset, dst.len())?;
        self.same_ctx("buffer", buf.ctx())?;
        self.enter(stream)?;
        stream.refuse_in_capture("copy_to_host")?;
        if dst.is_empty() {
            return stream.synchronize();
        }
        // Ordered after everything already on `stream` ("waits for the stream
        // first"), and on that stream rather than the null stream.
        // SAFETY: source range checked; `dst` is borrowed mutably until the
        // stream is synchronised below.
        check("hipMemcpyAsync", unsafe {
            (self.rt.api.memcpy_async)(
                dst.as_mut_ptr() as *mut c_void,
                (buf.raw() as *const u8).add(offset) as *const c_void,
                dst.len(),
                driver::HIP_MEMCPY_DEVICE_TO_HOST,
                stream.raw,
            )
        })?;
        stream.synchronize()
    }

    fn copy_device(&self, dst: DevicePtr, src: DevicePtr, bytes: usize, stream: &HipStream) -> Result<()> {
        self.enter(stream)?;
        if bytes == 0 {
            return Ok(());
        }
        // The direction is inferred: either side may be a peer's mapping or
        // host-mapped flags.
        // SAFETY: callers (the algorithms) pass addresses inside live buffers
        // mapped for this device and keep them alive until the stream drains;
        // the runtime reports an invalid address as an error.
        check("hipMemcpyAsync", unsafe {
            (self.rt.api.memcpy_async)(
                dst.0 as usize as *mut c_void,
                src.0 as usize as *const c_void,
                bytes,
                driver::HIP_MEMCPY_DEFAULT,
                stream.raw,
            )
        })
    }

    fn export(&self, buf: &HipBuffer) -> Result<ExportedHandle> {
        self.same_ctx("buffer", buf.ctx())?;
        self.ctx.bind()?;
        buf.export()
    }

    fn import(&self, handle: ExportedHandle) -> Result<HipPeerBuffer> {
        self.ctx.bind()?;
        HipPeerBuffer::import(self.ctx.clone(), handle)
    }

    fn create_stream(&self) -> Result<HipStream> {
        self.ctx.bind()?;
        HipStream::new(self.ctx.clone())
    }

    unsafe fn borrow_stream(&self, raw: u64) -> Result<HipStream> {
        // SAFETY: forwarded from the caller (a live stream of this device
        // that outlives the wrapper and its work).
        Ok(unsafe { HipStream::borrowed(self.ctx.clone(), raw) })
    }

    fn synchronize(&self, stream: &HipStream) -> Result<()> {
        self.enter(stream)?;
        // Synchronising a capturing stream would invalidate the capture.
        stream.refuse_in_capture("synchronize")?;
        stream.synchronize()
    }

    fn create_event(&self) -> Result<HipEvent> {
        self.ctx.bind()?;
        HipEvent::new(self.ctx.clone())
    }

    fn record(&self, event: &HipEvent, stream: &HipStream) -> Result<()> {
        self.same_ctx("event", &event.ctx)?;
        self.enter(stream)?;
        // Like the host backend: an event recorded into a graph cannot be
        // queried or timed from outside it.
        stream.refuse_in_capture("recording an event")?;
        event.record(stream)
    }

    fn query(&self, event: &HipEvent) -> Result<bool> {
        self.same_ctx("event", &event.ctx)?;
        self.ctx.bind()?;
        event.query()
    }

    fn wait_event(&self, stream: &HipStream, event: &HipEvent) -> Result<()> {
        self.same_ctx("event", &event.ctx)?;
        self.enter(stream)?;
        // SAFETY: live stream and event of this device.
        check("hipStreamWaitEvent", unsafe {
            (self.rt.api.stream_wait_event)(stream.raw, event.raw, 0)
        })
    }

    fn elapsed_ms(&self, start: &HipEvent, end: &HipEvent) -> Result<f32> {
        self.same_ctx("event", &start.ctx)?;
        self.same_ctx("event", &end.ctx)?;
        self.ctx.bind()?;
        HipEvent::elapsed_ms(start, end)
    }

    fn begin_capture(&self, stream: &HipStream) -> Result<()> {
        self.enter(stream)?;
        if stream.capturing()? {
            return Err(Error::invalid("stream is already capturing"));
        }
        // THREAD_LOCAL: calls that would break a capture are refused only on
        // the capturing thread, so other threads (other ranks of this process,
        // the engine) keep allocating and synchronising their own streams.
        // SAFETY: live stream of this device.
        check("hipStreamBeginCapture", unsafe {
            (self.rt.api.stream_begin_capture)(stream.raw, driver::HIP_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        })
    }

    fn end_capture(&self, stream: &HipStream) -> Result<HipGraph> {
        self.enter(stream)?;
        HipGraph::end_capture(stream)
    }

    fn is_capturing(&self, stream: &HipStream) -> Result<bool> {
        self.enter(stream)?;
        stream.capturing()
    }

    fn launch_graph(&self, graph: &HipGraph, stream: &HipStream) -> Result<()> {
        self.same_ctx("graph", &graph.ctx)?;
        self.enter(stream)?;
        graph.launch(stream)
    }

    fn load_module(&self, source: &ModuleSource) -> Result<HipModule> {
        self.ctx.bind()?;
        HipModule::load(
            self.ctx.clone(),
            source,
            &self.facts.arch,
            self.caps.wallclock_khz,
            self.rt.version,
        )
    }

    fn launch(
        &self,
        module: &HipModule,
        kernel: &str,
        config: LaunchConfig,
        params: &KernelParams,
        stream: &HipStream,
    ) -> Result<()> {
        config.check_within(kernel, MAX_BLOCKS, BLOCK_THREADS)?;
        self.same_ctx("module", &module.ctx)?;
        self.enter(stream)?;
        let f = module.function(kernel)?;
        // The one kernel argument, passed by value: the runtime copies the
        // 192-byte block (sized by the kernel's metadata) out of `p` before
        // hipModuleLaunchKernel returns.
        let mut p: KernelParams = *params;
        let mut args = [&mut p as *mut KernelParams as *mut c_void];
        // SAFETY: `f` is an entry point of a module loaded on this device whose
        // single parameter is `FcParams` (the ABI twin of KernelParams); `args`
        // holds one pointer to a live KernelParams; the stream is ours.
        check("hipModuleLaunchKernel", unsafe {
            (self.rt.api.module_launch_kernel)(
                f,
                config.grid,
                1,
                1,
                config.block,
                1,
                1,
                0,
                stream.raw,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    fn duplicate(&self) -> Result<Self> {
        HipDevice::new(self.facts.ordinal)
    }

    fn bind_thread(&self) -> Result<()> {
        self.make_current()
    }

    fn raw_stream(&self, stream: &HipStream) -> Option<u64> {
        Some(raw_stream(stream))
    }

    fn poll_interval(&self) -> Duration {
        Duration::from_micros(5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::KERNEL_PARAMS_BYTES;

    #[test]
    fn params_block_is_the_abi_size() {
        assert_eq!(KERNEL_PARAMS_BYTES, 192);
        // The HIP prelude pins the same size.
        let prelude = include_str!("../../kernels-hip/prelude.hip.h");
        assert!(prelude.contains("static_assert(sizeof(FcParams) == 192"));
    }

    #[test]
    fn range_checks_reject_overflow() {
        assert!(check_range("x", 10, 5, 5).is_ok());
        assert!(check_range("x", 10, 5, 6).is_err());
        assert!(check_range("x", 10, usize::MAX, 2).is_err());
    }

    /// Without ROCm (CI), opening a device is a clean error, never a panic.
    #[test]
    fn no_runtime_or_no_device_is_a_clean_error() {
        match device_count() {
            Ok(0) => assert!(matches!(HipDevice::new(0), Err(Error::NoDevice { .. }))),
            Ok(n) => assert!(matches!(HipDevice::new(n), Err(Error::NoDevice { .. }))),
            Err(e) => {
                assert!(matches!(e, Error::LibraryMissing { .. } | Error::Backend { .. }), "{e}");
                assert!(HipDevice::new(0).is_err());
            }
        }
    }
}
