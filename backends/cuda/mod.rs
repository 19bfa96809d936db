//! The CUDA backend: the driver API through cudarc's raw `sys` layer (loaded
//! at run time) and NVRTC for kernels, so we control every call.
//!
//! - **Context.** Each [`CudaDevice`] retains its device's primary context
//!   and makes it current (`cuCtxSetCurrent`) at the start of every method, so
//!   any thread may call it. Every resource holds the context alive.
//! - **Memory.** [`MemKind::Plain`] is `cuMemAlloc`. [`MemKind::Shareable`] is
//!   a cuMem VMM allocation (POSIX fd handle type) mapped read/write for this
//!   device; it exports as a file descriptor that peers import and map with
//!   access for *their* device (what peer access means under VMM; no
//!   `cuCtxEnablePeerAccess` is needed). Every allocation is returned zeroed,
//!   like the host backend's.
//! - **Streams** are `CU_STREAM_NON_BLOCKING`; **events** time; **graphs** are
//!   captured in `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL` mode.
//! - **Kernels** are compiled by NVRTC to a CUBIN for the exact arch and
//!   cached per process and on disk (see [`module`](self)).
//!
//! Nothing here panics when libcuda, libnvrtc or a device is missing: the
//! libraries are probed before cudarc is called (cudarc panics on a missing
//! library or symbol), and the failure comes back as
//! [`Error::LibraryMissing`] or [`Error::NoDevice`].
//!
//! Never uses NVLink multicast (no `cuMulticast*`).

mod driver;
mod memory;
mod module;
mod stream;

pub use driver::drop_error_count;
pub use memory::{CudaBuffer, CudaHostFlags, CudaPeerBuffer};
pub use module::{precompile, CudaModule};
pub use stream::{CudaEvent, CudaGraph, CudaStream};

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;

use driver::{check, Context};
use memory::{Plain, Storage, Vmm};

use crate::algo::layout::MAX_BLOCKS;
use crate::device::{
    check_range, BackendKind, Device, DeviceBuffer, DeviceFacts, DevicePtr, ExportedHandle, KernelParams, LaunchConfig,
    MemKind, ModuleSource,
};
use crate::error::{Error, Result};

/// Threads per block of every collective launch. The kernels are compiled with
/// `-DFC_MAX_BLOCK_THREADS` equal to this, so larger blocks are refused.
pub use crate::algo::BLOCK_THREADS;

/// Number of CUDA devices. `Ok(0)` when the driver loads but finds none;
/// [`Error::LibraryMissing`] when there is no usable libcuda.
pub fn device_count() -> Result<usize> {
    if let Err(e) = driver::driver() {
        return if driver::driver_says_no_device() { Ok(0) } else { Err(e) };
    }
    let mut n = 0;
    // SAFETY: valid out-pointer; the driver is loaded and initialised.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n.max(0) as usize)
}

/// NVRTC's version `(major, minor)`, or [`Error::LibraryMissing`] when
/// `libnvrtc.so.13` cannot be found (see `FERROCOMM_NVRTC_PATH`).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    driver::nvrtc()
}

/// Whether device `a` can read and write device `b`'s memory directly
/// (NVLink or PCIe peer-to-peer). `true` when `a == b`.
pub fn can_access_peer(a: usize, b: usize) -> Result<bool> {
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

/// The stream's `CUstream` as an integer, for the NCCL layer (`backends::ccl`).
pub(crate) fn raw_stream(stream: &CudaStream) -> u64 {
    stream.raw as usize as u64
}

fn cu_device(ordinal: usize) -> Result<sys::CUdevice> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::NoDevice {
            backend: driver::BACKEND,
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

/// What the device supports beyond the basics.
#[derive(Debug, Clone, Copy)]
struct Caps {
    vmm: bool,
    posix_fd: bool,
    map_host: bool,
    cc: (i32, i32),
}

/// One CUDA device, as seen by one rank.
pub struct CudaDevice {
    // Declared before `ctx` only for readability: every resource holds its
    // own Arc of the context, so drop order does not matter.
    aux: CudaStream,
    ctx: Arc<Context>,
    facts: DeviceFacts,
    caps: Caps,
}

impl CudaDevice {
    /// Open device `ordinal`: load the driver, retain its primary context and
    /// read its facts.
    ///
    /// Errors: [`Error::LibraryMissing`] without libcuda, [`Error::NoDevice`]
    /// when the device does not exist, [`Error::Backend`] when a driver call fails.
    pub fn new(ordinal: usize) -> Result<Self> {
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
            map_host: attribute(dev, A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)? != 0,
            cc: (major, minor),
        };
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev)
        })?;
        // SAFETY: NUL-terminated within the buffer (written by the driver, zero-initialised).
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut total = 0usize;
        // SAFETY: valid out-pointer and device handle.
        check("cuDeviceTotalMem", unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) })?;

        let ctx = Context::retain(dev, ordinal)?;
        ctx.bind()?;
        let aux = CudaStream::new(ctx.clone())?;
        Ok(CudaDevice {
            aux,
            ctx,
            facts: DeviceFacts {
                backend: BackendKind::Cuda,
                ordinal,
                name,
                arch: format!("sm_{major}{minor}"),
                multiprocessors: sms.max(1) as u32,
                warp_size: warp.max(1) as u32,
                total_memory: total as u64,
            },
            caps,
        })
    }

    /// Make this device's primary context current on the calling thread (what
    /// NCCL's `ncclCommInitRank` and the CUDA runtime read as "the device").
    pub fn make_current(&self) -> Result<()> {
        self.ctx.bind()
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.caps.cc
    }

    /// Refuse handles created by another device (context).
    fn same_ctx(&self, what: &str, other: &Context) -> Result<()> {
        if self.ctx.same(other) {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what} belongs to CUDA device {}, not to device {}",
                other.ordinal, self.ctx.ordinal
            )))
        }
    }

    /// Bind the context and check that `stream` is ours.
    fn enter(&self, stream: &CudaStream) -> Result<()> {
        self.same_ctx("stream", &stream.ctx)?;
        self.ctx.bind()
    }

    /// Zero-fill a fresh allocation on the private stream and wait for it, so
    /// the memory is zero before any other stream (or peer) touches it.
    fn zero_fill(&self, ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
        // SAFETY: `ptr..ptr+bytes` is a live allocation of this context.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr, 0, bytes, self.aux.raw)
        })?;
        self.aux.synchronize()
    }
}

impl Device for CudaDevice {
    type Buffer = CudaBuffer;
    type PeerBuffer = CudaPeerBuffer;
    type Flags = CudaHostFlags;
    type Stream = CudaStream;
    type Event = CudaEvent;
    type Graph = CudaGraph;
    type Module = CudaModule;

    fn facts(&self) -> &DeviceFacts {
        &self.facts
    }

    fn alloc(&self, bytes: usize, kind: MemKind) -> Result<CudaBuffer> {
        self.ctx.bind()?;
        let storage = match kind {
            MemKind::Plain => Storage::Plain(Plain::new(self.ctx.clone(), bytes)?),
            MemKind::Shareable => {
                if !(self.caps.vmm && self.caps.posix_fd) {
                    return Err(Error::Unsupported(format!(
                        "CUDA device {} lacks VMM or POSIX fd handles, so it cannot share memory",
                        self.ctx.ordinal
                    )));
                }
                Storage::Vmm(Vmm::create(self.ctx.clone(), bytes)?)
            }
        };
        // Exported memory must not leak old contents (peers map the whole
        // allocation, rounding included); plain memory is zeroed too, as the
        // host backend's is.
        let fill = match &storage {
            Storage::Plain(_) => bytes.max(1),
            Storage::Vmm(v) => v.size(),
        };
        let buf = CudaBuffer { storage, len: bytes };
        self.zero_fill(buf.raw(), fill)?;
        Ok(buf)
    }

    fn alloc_host_flags(&self, words: usize) -> Result<CudaHostFlags> {
        if !self.caps.map_host {
            return Err(Error::Unsupported(format!(
                "CUDA device {} cannot map host memory",
                self.ctx.ordinal
            )));
        }
        self.ctx.bind()?;
        CudaHostFlags::new(self.ctx.clone(), words)
    }

    fn memset(&self, buf: &CudaBuffer, offset: usize, len: usize, value: u8, stream: &CudaStream) -> Result<()> {
        check_range("memset", buf.len(), offset, len)?;
        self.same_ctx("buffer", buf.ctx())?;
        self.enter(stream)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the range was checked against the live buffer; stream-ordered.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(buf.raw() + offset as u64, value, len, stream.raw)
        })
    }

    fn copy_from_host(&self, buf: &CudaBuffer, offset: usize, src: &[u8], stream: &CudaStream) -> Result<()> {
        check_range("copy_from_host", buf.len(), offset, src.len())?;
        self.same_ctx("buffer", buf.ctx())?;
        self.enter(stream)?;
        // A captured copy would read `src` at replay time, after it is gone.
        stream.refuse_in_capture("copy_from_host")?;
        if src.is_empty() {
            return Ok(());
        }
        let dst = buf.raw() + offset as u64;
        // SAFETY: destination range checked; `src` stays borrowed until the
        // stream is synchronised below, so the copy never outlives it.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), stream.raw)
        })?;
        stream.synchronize()
    }

    fn copy_to_host(&self, buf: &CudaBuffer, offset: usize, dst: &mut [u8], stream: &CudaStream) -> Result<()> {
        check_range("copy_to_host", buf.len(), offset, dst.len())?;
        self.same_ctx("buffer", buf.ctx())?;
        self.enter(stream)?;
        stream.refuse_in_capture("copy_to_host")?;
        if dst.is_empty() {
            return stream.synchronize();
        }
        let src = buf.raw() + offset as u64;
        // Ordered after everything already on `stream` (so it "waits for the
        // stream first"), and on that stream rather than the legacy default
        // stream, which would also wait for unrelated blocking streams.
        // SAFETY: source range checked; `dst` is borrowed mutably until the
        // stream is synchronised below.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len(), stream.raw)
        })?;
        stream.synchronize()
    }

    fn copy_device(&self, dst: DevicePtr, src: DevicePtr, bytes: usize, stream: &CudaStream) -> Result<()> {
        self.enter(stream)?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: callers (the algorithms) pass addresses inside live buffers
        // mapped for this device and keep them alive until the stream drains;
        // the driver reports an invalid address as an error.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes, stream.raw)
        })
    }

    fn export(&self, buf: &CudaBuffer) -> Result<ExportedHandle> {
        self.same_ctx("buffer", buf.ctx())?;
        self.ctx.bind()?;
        buf.export()
    }

    fn import(&self, handle: ExportedHandle) -> Result<CudaPeerBuffer> {
        self.ctx.bind()?;
        CudaPeerBuffer::import(self.ctx.clone(), handle)
    }

    fn create_stream(&self) -> Result<CudaStream> {
        self.ctx.bind()?;
        CudaStream::new(self.ctx.clone())
    }

    unsafe fn borrow_stream(&self, raw: u64) -> Result<CudaStream> {
        // SAFETY: forwarded from the caller (a live stream of this device
        // that outlives the wrapper and its work).
        Ok(unsafe { CudaStream::borrowed(self.ctx.clone(), raw) })
    }

    fn synchronize(&self, stream: &CudaStream) -> Result<()> {
        self.enter(stream)?;
        // Synchronising a capturing stream would invalidate the capture.
        stream.refuse_in_capture("synchronize")?;
        stream.synchronize()
    }

    fn create_event(&self) -> Result<CudaEvent> {
        self.ctx.bind()?;
        CudaEvent::new(self.ctx.clone())
    }

    fn record(&self, event: &CudaEvent, stream: &CudaStream) -> Result<()> {
        self.same_ctx("event", &event.ctx)?;
        self.enter(stream)?;
        // Like the host backend: an event recorded into a graph cannot be
        // queried or timed from outside it.
        stream.refuse_in_capture("recording an event")?;
        // SAFETY: live event and stream of this context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event.raw, stream.raw) })
    }

    fn query(&self, event: &CudaEvent) -> Result<bool> {
        self.same_ctx("event", &event.ctx)?;
        self.ctx.bind()?;
        event.query()
    }

    fn wait_event(&self, stream: &CudaStream, event: &CudaEvent) -> Result<()> {
        self.same_ctx("event", &event.ctx)?;
        self.enter(stream)?;
        // SAFETY: live stream and event of this context.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream.raw, event.raw, 0)
        })
    }

    fn elapsed_ms(&self, start: &CudaEvent, end: &CudaEvent) -> Result<f32> {
        self.same_ctx("event", &start.ctx)?;
        self.same_ctx("event", &end.ctx)?;
        self.ctx.bind()?;
        CudaEvent::elapsed_ms(start, end)
    }

    fn begin_capture(&self, stream: &CudaStream) -> Result<()> {
        self.enter(stream)?;
        if stream.capturing()? {
            return Err(Error::invalid("stream is already capturing"));
        }
        // THREAD_LOCAL: calls that would break a capture (allocations,
        // synchronisation) are refused only on the capturing thread. Other
        // threads (other ranks of this process, the engine) keep allocating
        // and synchronising their own streams; GLOBAL mode would make their
        // calls fail, and RELAXED would let this thread's mistakes through.
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: live stream of this context.
        check("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(stream.raw, mode)
        })
    }

    fn end_capture(&self, stream: &CudaStream) -> Result<CudaGraph> {
        self.enter(stream)?;
        CudaGraph::end_capture(stream)
    }

    fn is_capturing(&self, stream: &CudaStream) -> Result<bool> {
        self.enter(stream)?;
        stream.capturing()
    }

    fn launch_graph(&self, graph: &CudaGraph, stream: &CudaStream) -> Result<()> {
        self.same_ctx("graph", &graph.ctx)?;
        self.enter(stream)?;
        graph.launch(stream)
    }

    fn load_module(&self, source: &ModuleSource) -> Result<CudaModule> {
        self.ctx.bind()?;
        CudaModule::load(self.ctx.clone(), source, self.caps.cc)
    }

    fn launch(
        &self,
        module: &CudaModule,
        kernel: &str,
        config: LaunchConfig,
        params: &KernelParams,
        stream: &CudaStream,
    ) -> Result<()> {
        config.check_within(kernel, MAX_BLOCKS, BLOCK_THREADS)?;
        self.same_ctx("module", &module.ctx)?;
        self.enter(stream)?;
        let f = module.function(kernel)?;
        // The one kernel argument, passed by value: the driver copies the
        // 192-byte block out of `p` before cuLaunchKernel returns.
        let mut p: KernelParams = *params;
        let mut args = [&mut p as *mut KernelParams as *mut c_void];
        // SAFETY: `f` is an entry point of a module loaded in this context whose
        // single parameter is `FcParams` (the ABI twin of KernelParams); `args`
        // holds one pointer to a live KernelParams; the stream is ours.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
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
        CudaDevice::new(self.facts.ordinal)
    }

    fn bind_thread(&self) -> Result<()> {
        self.make_current()
    }

    fn raw_stream(&self, stream: &CudaStream) -> Option<u64> {
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
    }

    #[test]
    fn range_checks_reject_overflow() {
        assert!(check_range("x", 10, 5, 5).is_ok());
        assert!(check_range("x", 10, 5, 6).is_err());
        assert!(check_range("x", 10, usize::MAX, 2).is_err());
    }
}
