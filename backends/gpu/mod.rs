//! One implementation of the [`Device`] trait for every GPU vendor:
//! [`GpuDevice<V>`] over a small vendor table (`vendor.rs`) that each vendor
//! folder implements (`backends/cuda` for NVIDIA, `backends/hip` for AMD).
//! What is written once here: the device's methods and their checks
//! (ranges, same-context handles, refusing host copies and synchronisation
//! while a stream captures a graph), buffers, peer mappings and the handle
//! format, host-mapped error flags, streams (owned or borrowed), events,
//! graphs, and kernel modules compiled lazily on a worker pool (`compile/`).
//!
//! The rules every vendor keeps:
//! - every method first makes the device's context current, so any thread
//!   may call it, and refuses handles of another device;
//! - every allocation comes back zeroed (exported memory must not leak old
//!   contents: peers map the whole allocation, rounding included);
//! - streams are non-blocking; graphs are captured in thread-local mode;
//! - releases in `Drop` never panic: failures are counted and logged once;
//! - NVLink/XGMI multicast is never used.

pub(crate) mod compile;
pub(crate) mod errors;
#[cfg(test)]
mod fake;
pub(crate) mod handle;
pub(crate) mod load;
mod local;
mod memory;
mod module;
mod stream;
pub(crate) mod vendor;

pub use memory::{GpuBuffer, GpuHostFlags, GpuPeerBuffer};
pub use module::GpuModule;
// Precompiling is the CUDA worker's (`backends::cuda::precompile`).
#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
pub(crate) use module::precompile;
pub use stream::{GpuEvent, GpuGraph, GpuStream};

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use compile::pool::DeviceInUse;
use memory::{Allocation, Memory};
use vendor::{CompileTarget, MemoryType, PointerInfo, RawStream, Vendor};

use crate::algo::layout::MAX_BLOCKS;
use crate::algo::BLOCK_THREADS;
use crate::device::{
    check_range, Device, DeviceBuffer, DeviceFacts, DevicePtr, ExportedHandle, KernelParams, LaunchConfig, MemKind,
    MemoryInfo, ModuleSource, KERNEL_PARAMS_BYTES,
};
use crate::error::{Error, Result};

/// The public names of one vendor's types: `vendor_aliases!(Cuda: CudaDevice,
/// CudaBuffer, ...)` in the order device, buffer, peer buffer, host flags,
/// stream, event, graph, module.
macro_rules! vendor_aliases {
    ($v:ident: $dev:ident, $buf:ident, $peer:ident, $flags:ident, $stream:ident, $event:ident, $graph:ident, $module:ident) => {
        /// One device of this vendor.
        pub type $dev = $crate::backends::gpu::GpuDevice<$v>;
        /// Device memory owned by this rank.
        pub type $buf = $crate::backends::gpu::GpuBuffer<$v>;
        /// A peer's buffer mapped here.
        pub type $peer = $crate::backends::gpu::GpuPeerBuffer<$v>;
        /// Host-mapped error words.
        pub type $flags = $crate::backends::gpu::GpuHostFlags<$v>;
        /// A non-blocking stream (or a borrowed one).
        pub type $stream = $crate::backends::gpu::GpuStream<$v>;
        /// An event with timing.
        pub type $event = $crate::backends::gpu::GpuEvent<$v>;
        /// An instantiated graph.
        pub type $graph = $crate::backends::gpu::GpuGraph<$v>;
        /// A kernel module whose kernels load in the background.
        pub type $module = $crate::backends::gpu::GpuModule<$v>;
    };
}
pub(crate) use vendor_aliases;

/// How many allocations a range may span in [`Device::check_memory`] (VMM
/// memory is mapped in chunks that can sit back to back).
const MAX_CHUNKS: usize = 4096;

/// One GPU, as seen by one rank.
pub struct GpuDevice<V: Vendor> {
    /// The private stream that zero-fills fresh allocations.
    aux: GpuStream<V>,
    ctx: Arc<V::Context>,
    facts: DeviceFacts,
    map_host: bool,
    extra: V::Extra,
    /// What the compiler builds for this device, once it could be told.
    target: Mutex<Option<Arc<CompileTarget>>>,
    /// Keeps the compile pool running; the last device's drop pauses it.
    _in_use: DeviceInUse,
}

impl<V: Vendor> GpuDevice<V> {
    /// Open device `ordinal`: load the vendor library, check the ordinal and
    /// read the device's facts.
    ///
    /// Errors: [`Error::LibraryMissing`] without the vendor library,
    /// [`Error::NoDevice`] when the device does not exist, [`Error::Backend`]
    /// when a call fails (and, on HIP, [`Error::Unsupported`] when the gfx
    /// target cannot be told).
    pub fn new(ordinal: usize) -> Result<Self> {
        let opened = V::open(ordinal)?;
        V::bind(&opened.ctx)?;
        let aux = GpuStream::new(opened.ctx.clone())?;
        Ok(GpuDevice {
            aux,
            ctx: opened.ctx,
            facts: opened.facts,
            map_host: opened.map_host,
            extra: opened.extra,
            target: Mutex::new(None),
            _in_use: DeviceInUse::new(),
        })
    }

    /// Make this device's context current on the calling thread (what
    /// NCCL/RCCL's `ncclCommInitRank` and the vendor runtime read as "the
    /// device").
    pub fn make_current(&self) -> Result<()> {
        V::bind(&self.ctx)
    }

    /// The vendor facts beyond [`DeviceFacts`].
    pub(crate) fn extra(&self) -> &V::Extra {
        &self.extra
    }

    /// What the run-time compiler builds for this device.
    pub(crate) fn compile_target(&self) -> Result<Arc<CompileTarget>> {
        let mut t = self.target.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = t.as_ref() {
            return Ok(t.clone());
        }
        let target = Arc::new(V::compile_target(&self.facts, &self.extra)?);
        *t = Some(target.clone());
        Ok(target)
    }

    /// Refuse handles created by another device (context).
    fn same_ctx(&self, what: &str, other: &V::Context) -> Result<()> {
        if V::context_id(&self.ctx) == V::context_id(other) {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what} belongs to {} device {}, not to device {}",
                V::LABEL,
                V::ordinal(other),
                V::ordinal(&self.ctx)
            )))
        }
    }

    /// Bind the context and check that `stream` is ours.
    fn enter(&self, stream: &GpuStream<V>) -> Result<()> {
        self.same_ctx("stream", &stream.ctx)?;
        V::bind(&self.ctx)
    }

    /// Zero-fill a fresh allocation on the private stream and wait for it, so
    /// the memory is zero before any other stream (or peer) touches it.
    fn zero_fill(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        // SAFETY: `ptr..ptr+bytes` is a live allocation of this context, and
        // the private stream is drained before it is handed out.
        unsafe { V::memset_async(&self.ctx, ptr, 0, bytes, self.aux.raw) }?;
        self.aux.synchronize()
    }

    /// What the runtime says about `ptr`, as an error for memory this
    /// device's kernels cannot use; `None` when the runtime cannot tell.
    fn device_memory(&self, ptr: DevicePtr) -> Result<Option<PointerInfo>> {
        let Some(info) = V::pointer_info(&self.ctx, ptr)? else {
            return Ok(None);
        };
        let me = V::ordinal(&self.ctx);
        match (info.memory, info.device) {
            (MemoryType::Host, _) => Err(Error::invalid(format!(
                "address {:#x} is host memory, not {} device {me}'s",
                ptr.0,
                V::LABEL
            ))),
            (MemoryType::Unknown, _) => Err(Error::invalid(format!(
                "address {:#x} is not in any {} allocation (host heap memory, or freed)",
                ptr.0,
                V::LABEL
            ))),
            (MemoryType::Device, Some(d)) if d != me => Err(Error::invalid(format!(
                "address {:#x} is {} device {d}'s memory, not device {me}'s",
                ptr.0,
                V::LABEL
            ))),
            _ => Ok(Some(info)),
        }
    }

    /// The allocation holding `ptr`, or an error naming why there is none.
    fn allocation_of(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        V::address_range(&self.ctx, ptr)?
            .ok_or_else(|| Error::invalid(format!("address {:#x} is not inside a {} allocation", ptr.0, V::LABEL)))
    }
}

impl<V: Vendor> Device for GpuDevice<V> {
    type Buffer = GpuBuffer<V>;
    type PeerBuffer = GpuPeerBuffer<V>;
    type Flags = GpuHostFlags<V>;
    type Stream = GpuStream<V>;
    type Event = GpuEvent<V>;
    type Graph = GpuGraph<V>;
    type Module = GpuModule<V>;

    fn facts(&self) -> &DeviceFacts {
        &self.facts
    }

    fn alloc(&self, bytes: usize, kind: MemKind) -> Result<GpuBuffer<V>> {
        V::bind(&self.ctx)?;
        let memory = match kind {
            MemKind::Plain => {
                let size = bytes.max(1);
                Memory::Plain {
                    ptr: V::mem_alloc(&self.ctx, size)?,
                    size,
                }
            }
            MemKind::Shareable => Memory::Shared(V::alloc_shared(&self.ctx, bytes)?),
        };
        let buf = GpuBuffer {
            alloc: Arc::new(Allocation {
                ctx: self.ctx.clone(),
                memory,
            }),
            len: bytes,
        };
        self.zero_fill(buf.alloc.ptr(), buf.alloc.size())?;
        Ok(buf)
    }

    fn alloc_host_flags(&self, words: usize) -> Result<GpuHostFlags<V>> {
        if !self.map_host {
            return Err(Error::Unsupported(format!(
                "{} device {} cannot map host memory",
                V::LABEL,
                self.facts.ordinal
            )));
        }
        V::bind(&self.ctx)?;
        GpuHostFlags::new(self.ctx.clone(), words)
    }

    fn memset(&self, buf: &GpuBuffer<V>, offset: usize, len: usize, value: u8, stream: &GpuStream<V>) -> Result<()> {
        check_range("memset", buf.len(), offset, len)?;
        self.same_ctx("buffer", buf.ctx())?;
        self.enter(stream)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the range was checked against the live buffer; stream-ordered.
        unsafe { V::memset_async(&self.ctx, buf.ptr().offset(offset), value, len, stream.raw) }
    }

    fn copy_from_host(&self, buf: &GpuBuffer<V>, offset: usize, src: &[u8], stream: &GpuStream<V>) -> Result<()> {
        check_range("copy_from_host", buf.len(), offset, src.len())?;
        self.same_ctx("buffer", buf.ctx())?;
        self.upload(buf.ptr().offset(offset), src, stream)
    }

    fn copy_to_host(&self, buf: &GpuBuffer<V>, offset: usize, dst: &mut [u8], stream: &GpuStream<V>) -> Result<()> {
        check_range("copy_to_host", buf.len(), offset, dst.len())?;
        self.same_ctx("buffer", buf.ctx())?;
        self.download(dst, buf.ptr().offset(offset), stream)
    }

    fn upload(&self, dst: DevicePtr, src: &[u8], stream: &GpuStream<V>) -> Result<()> {
        self.enter(stream)?;
        // A captured copy would read `src` at replay time, after it is gone.
        stream.refuse_in_capture("copy_from_host")?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller checked the destination range; `src` stays
        // borrowed until the stream is synchronised below, so the copy never
        // outlives it.
        unsafe { V::copy_to_device_async(&self.ctx, dst, src.as_ptr(), src.len(), stream.raw) }?;
        stream.synchronize()
    }

    fn download(&self, dst: &mut [u8], src: DevicePtr, stream: &GpuStream<V>) -> Result<()> {
        self.enter(stream)?;
        stream.refuse_in_capture("copy_to_host")?;
        if dst.is_empty() {
            return stream.synchronize();
        }
        // Ordered after everything already on `stream` (so it "waits for the
        // stream first"), and on that stream rather than the legacy default
        // stream, which would also wait for unrelated blocking streams.
        // SAFETY: the caller checked the source range; `dst` is borrowed
        // mutably until the stream is synchronised below.
        unsafe { V::copy_to_host_async(&self.ctx, dst.as_mut_ptr(), src, dst.len(), stream.raw) }?;
        stream.synchronize()
    }

    fn copy_device(&self, dst: DevicePtr, src: DevicePtr, bytes: usize, stream: &GpuStream<V>) -> Result<()> {
        self.enter(stream)?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: callers (the algorithms) pass addresses inside live buffers
        // mapped for this device and keep them alive until the stream drains;
        // the driver reports an invalid address as an error.
        unsafe { V::copy_device_async(&self.ctx, dst, src, bytes, stream.raw) }
    }

    fn export(&self, buf: &GpuBuffer<V>) -> Result<ExportedHandle> {
        self.same_ctx("buffer", buf.ctx())?;
        V::bind(&self.ctx)?;
        buf.export()
    }

    fn import(&self, handle: ExportedHandle) -> Result<GpuPeerBuffer<V>> {
        V::bind(&self.ctx)?;
        GpuPeerBuffer::import(&self.ctx, handle)
    }

    fn export_range(&self, ptr: DevicePtr, bytes: usize) -> Result<(ExportedHandle, usize)> {
        V::bind(&self.ctx)?;
        self.check_memory(ptr, bytes)?;
        let info = self.device_memory(ptr)?.ok_or_else(|| {
            Error::Unsupported(format!(
                "this {} runtime cannot tell what memory {:#x} is, so it cannot be shared",
                V::LABEL,
                ptr.0
            ))
        })?;
        let (base, size) = self.allocation_of(ptr)?;
        if ptr.0 + bytes as u64 > base.0 + size as u64 {
            return Err(Error::Unsupported(format!(
                "{:#x}+{bytes} spans several allocations; one handle exports one",
                ptr.0
            )));
        }
        let export = V::export_caller(&self.ctx, ptr, base, size, &info)?;
        let offset = (ptr.0 - export.base.0) as usize;
        let mapped = export.size;
        Ok((memory::exported::<V>(&self.ctx, export, false, mapped), offset))
    }

    fn check_memory(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        V::bind(&self.ctx)?;
        let Some(info) = self.device_memory(ptr)? else {
            return Ok(());
        };
        let end = ptr
            .0
            .checked_add(bytes as u64)
            .ok_or_else(|| Error::invalid(format!("range {:#x}+{bytes} wraps around", ptr.0)))?;
        // A VMM range may continue into the chunk mapped right after it (of
        // this device, VMM too); a plain allocation ends where it ends, even
        // when another one happens to follow.
        let mut at = ptr;
        let mut vmm = info.vmm;
        let mut known = info.range;
        for _ in 0..MAX_CHUNKS {
            let (base, size) = match known.take() {
                Some(range) => range,
                None => self.allocation_of(at)?,
            };
            let alloc_end = base.0 + size as u64;
            if end <= alloc_end {
                return Ok(());
            }
            let next = DevicePtr(alloc_end);
            let followed = vmm
                && V::address_range(&self.ctx, next)?.is_some()
                && matches!(self.device_memory(next), Ok(Some(i)) if i.vmm);
            if !followed {
                return Err(Error::invalid(format!(
                    "range {:#x}+{bytes} runs {} bytes past the end of its allocation ({:#x}+{size})",
                    ptr.0,
                    end - alloc_end,
                    base.0
                )));
            }
            at = next;
            vmm = true;
        }
        Err(Error::invalid(format!(
            "range {:#x}+{bytes} spans more than {MAX_CHUNKS} allocations",
            ptr.0
        )))
    }

    unsafe fn borrow_stream(&self, raw: u64) -> Result<GpuStream<V>> {
        V::bind(&self.ctx)?;
        // SAFETY: the caller guarantees a live stream of this device that
        // outlives the wrapper (this method's contract).
        unsafe { GpuStream::borrow(self.ctx.clone(), RawStream(raw)) }
    }

    fn create_stream(&self) -> Result<GpuStream<V>> {
        V::bind(&self.ctx)?;
        GpuStream::new(self.ctx.clone())
    }

    fn synchronize(&self, stream: &GpuStream<V>) -> Result<()> {
        self.enter(stream)?;
        // Synchronising a capturing stream would invalidate the capture.
        stream.refuse_in_capture("synchronize")?;
        stream.synchronize()
    }

    fn create_event(&self) -> Result<GpuEvent<V>> {
        V::bind(&self.ctx)?;
        GpuEvent::new(self.ctx.clone())
    }

    fn record(&self, event: &GpuEvent<V>, stream: &GpuStream<V>) -> Result<()> {
        self.same_ctx("event", &event.ctx)?;
        self.enter(stream)?;
        // Like the host backend: an event recorded into a graph cannot be
        // queried or timed from outside it.
        stream.refuse_in_capture("recording an event")?;
        event.record(stream)
    }

    fn query(&self, event: &GpuEvent<V>) -> Result<bool> {
        self.same_ctx("event", &event.ctx)?;
        V::bind(&self.ctx)?;
        event.query()
    }

    fn wait_event(&self, stream: &GpuStream<V>, event: &GpuEvent<V>) -> Result<()> {
        self.same_ctx("event", &event.ctx)?;
        self.enter(stream)?;
        // SAFETY: live stream and event of this context (checked above).
        unsafe { V::stream_wait_event(&self.ctx, stream.raw, event.raw) }
    }

    fn elapsed_ms(&self, start: &GpuEvent<V>, end: &GpuEvent<V>) -> Result<f32> {
        self.same_ctx("event", &start.ctx)?;
        self.same_ctx("event", &end.ctx)?;
        V::bind(&self.ctx)?;
        GpuEvent::elapsed_ms(start, end)
    }

    fn begin_capture(&self, stream: &GpuStream<V>) -> Result<()> {
        self.enter(stream)?;
        if stream.capturing()? {
            return Err(Error::invalid("stream is already capturing"));
        }
        // THREAD_LOCAL: calls that would break a capture (allocations,
        // synchronisation) are refused only on the capturing thread. Other
        // threads (other ranks of this process, the engine, the compile
        // pool) keep allocating, loading and synchronising their own
        // streams; GLOBAL mode would make their calls fail, and RELAXED
        // would let this thread's mistakes through.
        // SAFETY: live stream of this context.
        unsafe { V::begin_capture(&self.ctx, stream.raw) }
    }

    fn end_capture(&self, stream: &GpuStream<V>) -> Result<GpuGraph<V>> {
        self.enter(stream)?;
        GpuGraph::end_capture(stream)
    }

    fn is_capturing(&self, stream: &GpuStream<V>) -> Result<bool> {
        self.enter(stream)?;
        stream.capturing()
    }

    fn launch_graph(&self, graph: &GpuGraph<V>, stream: &GpuStream<V>) -> Result<()> {
        self.same_ctx("graph", &graph.ctx)?;
        self.enter(stream)?;
        graph.launch(stream)
    }

    fn load_module(&self, source: &ModuleSource) -> Result<GpuModule<V>> {
        if source.body(V::KIND).is_empty() {
            return Err(Error::Unsupported(format!(
                "kernel module {} has no {} source",
                source.name,
                V::LABEL
            )));
        }
        let target = self.compile_target()?;
        GpuModule::load(self.ctx.clone(), source, target)
    }

    fn prepare(&self, module: &GpuModule<V>, kernels: &[&str]) -> Result<()> {
        self.same_ctx("module", module.ctx())?;
        V::bind(&self.ctx)?;
        module.prepare(kernels)
    }

    fn launch(
        &self,
        module: &GpuModule<V>,
        kernel: &str,
        config: LaunchConfig,
        params: &KernelParams,
        stream: &GpuStream<V>,
    ) -> Result<()> {
        config.check_within(kernel, MAX_BLOCKS, BLOCK_THREADS)?;
        self.same_ctx("module", module.ctx())?;
        self.enter(stream)?;
        let f = module.function(kernel)?;
        // The one kernel argument, passed by value: the driver copies the
        // KERNEL_PARAMS_BYTES block out of `p` before the launch call returns.
        let mut p: KernelParams = *params;
        let mut args = [&mut p as *mut KernelParams as *mut std::ffi::c_void];
        // SAFETY: `f` is an entry point of a module loaded in this context
        // whose single parameter is `FcParams` (the ABI twin of KernelParams);
        // `args` holds one pointer to the live `p`; the module outlives the
        // launch (owners drain streams before dropping modules); the stream
        // is ours (checked above).
        unsafe { V::launch(&self.ctx, f, config, &mut args, stream.raw) }
    }

    fn launch_raw(
        &self,
        module: &GpuModule<V>,
        kernel: &str,
        config: LaunchConfig,
        args: &[u8],
        stream: &GpuStream<V>,
    ) -> Result<()> {
        config.check_within(kernel, MAX_BLOCKS, BLOCK_THREADS)?;
        if args.len() > 4096 {
            return Err(Error::invalid(format!(
                "launch of {kernel}: {} bytes of arguments; kernels take at most 4096",
                args.len()
            )));
        }
        self.same_ctx("module", module.ctx())?;
        self.enter(stream)?;
        let f = module.function(kernel)?;
        // 8-byte aligned (the struct's fields are), and zero-padded to at
        // least a parameter block: the driver copies the parameter's size,
        // and the test vendor table reads a whole KernelParams.
        let mut words = vec![0u64; args.len().div_ceil(8).max(KERNEL_PARAMS_BYTES / 8)];
        // SAFETY: `words` holds at least `args.len()` bytes; u64 has no invalid bit patterns.
        unsafe { std::ptr::copy_nonoverlapping(args.as_ptr(), words.as_mut_ptr().cast::<u8>(), args.len()) };
        let mut args = [words.as_mut_ptr().cast::<std::ffi::c_void>()];
        // SAFETY: `f` is an entry point of a module loaded in this context;
        // the caller vouches that its one parameter is `args`'s struct;
        // `words` lives across the call, which copies it; the stream is ours.
        unsafe { V::launch(&self.ctx, f, config, &mut args, stream.raw) }
    }

    fn poll_interval(&self) -> Duration {
        Duration::from_micros(5)
    }

    /// Polls the event: back to back for the first 50 us (a small collective
    /// completes in a few, and a yield or sleep would add more than that),
    /// then yielding for 2 ms, then sleeping [`Device::poll_interval`].
    /// Never blocks in the driver, so the timeout always holds.
    fn wait_event_for(&self, event: &GpuEvent<V>, timeout: Duration) -> Result<bool> {
        self.same_ctx("event", &event.ctx)?;
        V::bind(&self.ctx)?;
        let start = Instant::now();
        loop {
            if event.query()? {
                return Ok(true);
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Ok(false);
            }
            if waited < Duration::from_micros(50) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(self.poll_interval());
            }
        }
    }

    fn runtime_info(&self) -> String {
        let stats = compile::images::stats(V::KIND);
        let cache = compile::disk::cache_dir().map_or_else(|| "off".to_string(), |d| d.display().to_string());
        format!(
            "{}; kernel cache {cache}: {} kernels from disk, {} compiled, {} shared in memory",
            self.versions(),
            stats.from_disk,
            stats.compiled,
            stats.shared
        )
    }

    fn versions(&self) -> String {
        format!("{}; {}", V::runtime_info(), V::rtc_info())
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        V::bind(&self.ctx)?;
        let (free, total) = V::mem_info(&self.ctx)?;
        Ok(MemoryInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn duplicate(&self) -> Result<Self> {
        Self::new(self.facts.ordinal)
    }

    fn bind_thread(&self) -> Result<()> {
        self.make_current()
    }

    fn raw_stream(&self, stream: &GpuStream<V>) -> Option<u64> {
        Some(stream.raw.0)
    }
}

#[cfg(test)]
mod tests;
