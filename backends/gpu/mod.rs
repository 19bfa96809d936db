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
        for _ in 0..MAX_CHUNKS {
            let (base, size) = self.allocation_of(at)?;
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
mod tests {
    use super::fake::{log, Fake, COMPILE_TIME};
    use super::*;
    use crate::device::{check_range, KERNEL_PARAMS_BYTES};
    use std::thread::ThreadId;

    #[test]
    fn params_block_is_the_abi_size() {
        assert_eq!(KERNEL_PARAMS_BYTES, 448);
        // Both preludes pin the same size.
        assert!(include_str!("../../kernels-cuda/prelude.cuh").contains("static_assert(sizeof(FcParams) == 448"));
        let prelude = include_str!("../../kernels-hip/prelude.hip.h");
        assert!(prelude.contains("static_assert(sizeof(FcParams) == 448"));
    }

    #[test]
    fn range_checks_reject_overflow() {
        assert!(check_range("x", 10, 5, 5).is_ok());
        assert!(check_range("x", 10, 5, 6).is_err());
        assert!(check_range("x", 10, usize::MAX, 2).is_err());
    }

    fn test_kernels() -> Vec<String> {
        ["a", "b", "c", "d", "e", "broken"]
            .iter()
            .map(|k| format!("fc_t_{k}"))
            .collect()
    }

    fn test_entry(name: &str) -> Option<String> {
        let k = name.strip_prefix("fc_t_")?;
        Some(if k == "broken" {
            format!("FC_KERNEL({name}) {{ this_is_not_defined(); }}\n")
        } else {
            format!("FC_KERNEL({name}) {{ }}\n")
        })
    }

    /// A per-kernel module no other test compiled.
    fn lazy_source(tag: &str) -> ModuleSource {
        let name: &'static str = Box::leak(format!("fake_{tag}_{:?}", Instant::now()).into_boxed_str());
        let body: &'static str = Box::leak(format!("// body of {name}\n").into_boxed_str());
        ModuleSource {
            name,
            cuda: "",
            hip: body,
            kernels: test_kernels,
            entry: test_entry,
        }
    }

    fn compiles_of(module: &str) -> Vec<(String, ThreadId)> {
        log()
            .compiles
            .iter()
            .filter(|(u, _)| u.starts_with(module))
            .cloned()
            .collect()
    }

    const CFG: LaunchConfig = LaunchConfig::new(1, 64);

    #[test]
    fn modules_load_in_the_background_and_a_captured_launch_waits() {
        let dev = GpuDevice::<Fake>::new(0).unwrap();
        let src = lazy_source("capture");
        let started = Instant::now();
        let m = dev.load_module(&src).unwrap();
        assert!(started.elapsed() < COMPILE_TIME, "load_module waited for a compile");
        assert_eq!(m.unit_count(), 6);
        assert!(m.ready_count() < m.unit_count());

        // The first launch of a kernel, inside a capture: it waits, then is queued.
        let s = dev.create_stream().unwrap();
        dev.begin_capture(&s).unwrap();
        dev.launch(&m, "fc_t_e", CFG, &KernelParams::default(), &s).unwrap();
        let broken = dev.launch(&m, "fc_t_broken", CFG, &KernelParams::default(), &s);
        assert!(
            matches!(&broken, Err(Error::Compile { module, log, .. })
                if module.ends_with("/fc_t_broken") && log.contains("this_is_not_defined")),
            "{broken:?}"
        );
        assert!(
            dev.is_capturing(&s).unwrap(),
            "a failed launch leaves the capture alone"
        );
        dev.end_capture(&s).unwrap();
        assert!(log().launches.contains(&"fc_t_e".to_string()));
        // Bumped: `e` was compiled before the kernels queued ahead of it
        // finished (at most the one compiling when the launch came).
        let order: Vec<String> = compiles_of(src.name).into_iter().map(|c| c.0).collect();
        let e = order.iter().position(|u| u.ends_with("fc_t_e")).unwrap();
        assert!(e <= 1, "fc_t_e compiled at position {e}: {order:?}");

        // Nothing was compiled or loaded on this thread.
        let me = std::thread::current().id();
        assert!(compiles_of(src.name).iter().all(|(_, t)| *t != me));
        assert!(!log().loads.contains(&me));

        dev.prepare(&m, &["fc_t_a", "fc_t_b"]).unwrap();
        assert!(matches!(dev.prepare(&m, &[]), Err(Error::Compile { .. })));
        assert!(matches!(dev.prepare(&m, &["fc_t_zz"]), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            dev.launch(&m, "fc_t_zz", CFG, &KernelParams::default(), &s),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(m.ready_count(), 5);
        assert_eq!(compiles_of(src.name).len(), 6, "each kernel compiled once");
        assert!(dev.runtime_info().contains("fakecc"));
    }

    #[test]
    fn devices_share_compiles_and_reuse_loaded_kernels() {
        let src = lazy_source("shared");
        let (a, b) = (GpuDevice::<Fake>::new(0).unwrap(), GpuDevice::<Fake>::new(1).unwrap());
        let ma = a.load_module(&src).unwrap();
        let mb = b.load_module(&src).unwrap();
        a.prepare(&ma, &["fc_t_a", "fc_t_b", "fc_t_c", "fc_t_d", "fc_t_e"])
            .unwrap();
        b.prepare(&mb, &["fc_t_a", "fc_t_b", "fc_t_c", "fc_t_d", "fc_t_e"])
            .unwrap();
        let compiled: Vec<String> = compiles_of(src.name).into_iter().map(|c| c.0).collect();
        let unique: std::collections::HashSet<&String> = compiled.iter().collect();
        assert_eq!(
            unique.len(),
            compiled.len(),
            "two devices, one compile per kernel: {compiled:?}"
        );
        assert!(compiled.len() >= 5);
        // Another handle on a device that has the kernels loaded is ready at once.
        let again = a.load_module(&src).unwrap();
        assert_eq!(again.ready_count(), 5, "the five good kernels, reused");
        let s = a.create_stream().unwrap();
        a.launch(&again, "fc_t_c", CFG, &KernelParams::default(), &s).unwrap();
        // Another device's module is refused.
        assert!(matches!(
            a.launch(&mb, "fc_t_c", CFG, &KernelParams::default(), &s),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn a_whole_module_compiles_before_load_returns() {
        let dev = GpuDevice::<Fake>::new(0).unwrap();
        let good = ModuleSource::raw("fake_raw_good", "", "FC_KERNEL(fill) {}\n// raw");
        let m = dev.load_module(&good).unwrap();
        assert_eq!((m.unit_count(), m.ready_count()), (1, 1));
        assert!(m.has_kernel("fill") && !m.has_kernel("nope"));
        let broken = ModuleSource::raw("fake_raw_broken", "", "this_is_not_defined();");
        match dev.load_module(&broken) {
            Err(Error::Compile { module, arch, .. }) => {
                assert_eq!((module.as_str(), arch.as_str()), ("fake_raw_broken", "fake1"))
            }
            other => panic!("{:?}", other.err()),
        }
        let empty = ModuleSource::raw("fake_raw_empty", "x", "");
        assert!(matches!(dev.load_module(&empty), Err(Error::Unsupported(_))));
    }

    #[test]
    fn caller_memory_is_checked_and_shared() {
        let (a, b) = (GpuDevice::<Fake>::new(0).unwrap(), GpuDevice::<Fake>::new(1).unwrap());
        let buf = a.alloc(1 << 20, MemKind::Plain).unwrap();
        a.check_memory(buf.ptr(), 1 << 20).unwrap();
        a.check_memory(buf.ptr().offset(10), (1 << 20) - 10).unwrap();
        a.check_memory(DevicePtr(3), 0).unwrap();
        let past = a.check_memory(buf.ptr(), (1 << 20) + 1);
        assert!(
            matches!(&past, Err(Error::InvalidArgument(m)) if m.contains("past the end")),
            "{past:?}"
        );
        let unknown = a.check_memory(DevicePtr(0x7), 4);
        assert!(
            matches!(&unknown, Err(Error::InvalidArgument(m)) if m.contains("not in any")),
            "{unknown:?}"
        );
        let theirs = b.alloc(64, MemKind::Plain).unwrap();
        let other = a.check_memory(theirs.ptr(), 64);
        assert!(
            matches!(&other, Err(Error::InvalidArgument(m)) if m.contains("device 1")),
            "{other:?}"
        );

        // Caller memory: exported at an offset, served by address in this process.
        let (h, offset) = a.export_range(buf.ptr().offset(4096), 100).unwrap();
        assert_eq!((offset, h.size), (4096, 1 << 20));
        let peer = b.import(h).unwrap();
        assert_eq!(peer.ptr(), buf.ptr());
        assert!(a.export_range(buf.ptr(), (1 << 20) + 1).is_err());
        assert!(a.export_range(DevicePtr(0x7), 4).is_err());

        // Own shareable buffers: the mapping keeps the allocation alive.
        let own = a.alloc(5000, MemKind::Shareable).unwrap();
        let h = a.export(&own).unwrap();
        assert_eq!(h.size, 5000);
        let bytes = h.bytes.clone();
        let p1 = b.import(h).unwrap();
        assert_eq!(p1.ptr(), own.ptr());
        drop(own);
        let again = ExportedHandle {
            bytes: bytes.clone(),
            fd: None,
            size: 5000,
        };
        let p2 = b.import(again).unwrap();
        drop((p1, p2));
        let gone = b.import(ExportedHandle {
            bytes,
            fd: None,
            size: 5000,
        });
        assert!(
            matches!(&gone, Err(Error::InvalidArgument(m)) if m.contains("gone")),
            "{:?}",
            gone.err()
        );
    }

    #[test]
    fn borrowed_streams_are_checked_and_usable() {
        let dev = GpuDevice::<Fake>::new(0).unwrap();
        // SAFETY: the fake driver has no real streams to outlive.
        let s = unsafe { dev.borrow_stream(0x1234) }.unwrap();
        assert_eq!(dev.raw_stream(&s), Some(0x1234));
        dev.synchronize(&s).unwrap();
        // SAFETY: as above.
        assert!(matches!(
            unsafe { dev.borrow_stream(0xbad) },
            Err(Error::InvalidArgument(_))
        ));
        let e = dev.create_event().unwrap();
        assert!(dev.wait_event_for(&e, Duration::from_millis(1)).unwrap());
    }

    /// Ranks that are threads of one process load every kernel (the fused
    /// module's too) before `Communicator::new` returns: no module load may
    /// race a peer's spinning kernel (`Communicator::preload_kernels`).
    #[test]
    fn thread_ranks_load_every_kernel_at_creation() {
        use crate::comm::{CommOptions, Communicator};
        use crate::testing::harness::run_thread_ranks;

        let results = run_thread_ranks(2, |rank, world, store| -> Result<(usize, usize, usize, usize)> {
            let dev = GpuDevice::<Fake>::new(rank)?;
            let opts = CommOptions::default()
                .with_timeout(Duration::from_secs(120))
                .with_slot_bytes(64 << 10)
                .with_autotune(false);
            let comm = Communicator::new(dev, store, rank, world, opts)?;
            let counts = comm.with_resources(|r| {
                let fused = r
                    .fused_module
                    .as_ref()
                    .map_or((0, 1), |m| (m.ready_count(), m.unit_count()));
                (r.module.ready_count(), r.module.unit_count(), fused.0, fused.1)
            })?;
            comm.finalize()?;
            Ok(counts)
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (ready, units, fused_ready, fused_units) = r.unwrap();
            assert_eq!(ready, units, "rank {rank}: collectives module");
            assert_eq!(fused_ready, fused_units, "rank {rank}: fused module");
            assert!(units > 0 && fused_units > 1, "rank {rank}");
        }
    }

    /// The data-moving collectives on a GPU communicator without NCCL/RCCL
    /// (this build): the exchange / reduce-to kernels, with the per-peer
    /// lists, the agreed count and the output by value in the params.
    #[test]
    fn data_collectives_enqueue_the_exchange_kernels_with_their_lists() {
        use crate::comm::{Call, CommOptions, Communicator, Reduction, Tensor};
        use crate::dtype::{DType, ReduceOp};
        use crate::testing::harness::run_thread_ranks;

        /// The last launch of `name` by `rank` whose params satisfy `pred`.
        fn launched(name: &str, rank: usize, pred: impl Fn(&KernelParams) -> bool) -> (LaunchConfig, KernelParams) {
            log()
                .launched
                .iter()
                .rev()
                .find(|(n, _, p)| n == name && p.rank as usize == rank && pred(p))
                .map(|(_, c, p)| (*c, *p))
                .unwrap_or_else(|| panic!("rank {rank}: no launch of {name}"))
        }

        let results = run_thread_ranks(2, |rank, world, store| -> Result<()> {
            let dev = GpuDevice::<Fake>::new(rank)?;
            // Small slots: the fake's allocations are 4 MiB apart. LL off:
            // these blocks would take the LL kinds, and the lists checked
            // here are the inbox kinds' (the LL kinds get the same params).
            let opts = CommOptions::default()
                .with_timeout(Duration::from_secs(30))
                .with_slot_bytes(64 << 10)
                .with_coll_ll_bytes(0)
                // The fake compiles each kernel in 40 ms, one at a time, and
                // places allocations 4 MiB apart: autotune's buffers would
                // overlap.
                .with_preload_kernels(false)
                .with_autotune(false);
            let comm = Communicator::new(dev, store, rank, world, opts)?;
            assert!(!comm.has_vendor_library());
            let dev = comm.device();
            let (a, b) = (dev.alloc(4096, MemKind::Plain)?, dev.alloc(4096, MemKind::Plain)?);
            let (ta, tb) = (Tensor::of(&a, DType::F32), Tensor::of(&b, DType::F32));
            let call = Call::new();
            let at = |t: &Tensor, k: usize| t.ptr().0 + 4 * k as u64;

            // All-gather (single): 16 elements to and from every peer.
            comm.all_gather_single(tb.slice(0, 32)?, ta.slice(0, 16)?, &call)?
                .wait(None)?;
            let (cfg, p) = launched("fc_exchange", rank, |p| p.per_peer[1][0] == at(&ta, 0));
            assert_eq!((p.count, p.world, p.dtype), (16, 2, DType::F32 as u32));
            assert_eq!(p.per_peer[0][..2], [16, 16]);
            assert_eq!(p.per_peer[1][..2], [at(&ta, 0), at(&ta, 0)]);
            assert_eq!(p.per_peer[2][..2], [16, 16]);
            assert_eq!(p.per_peer[3][..2], [at(&tb, 0), at(&tb, 16)]);
            assert_eq!(cfg.grid, 1, "64-byte blocks take one GPU block");

            // All-to-all-v: no agreed count (0), whatever the splits.
            // Rank s sends 1 + s + 2d elements to rank d.
            let (ins, outs) = ([1 + rank, 3 + rank], [1 + 2 * rank, 2 + 2 * rank]);
            comm.all_to_all_v_single(
                tb.slice(100, outs[0] + outs[1])?,
                ta.slice(100, ins[0] + ins[1])?,
                &outs,
                &ins,
                &call,
            )?
            .wait(None)?;
            let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[1][0] == at(&ta, 100));
            assert_eq!(p.count, 0);
            assert_eq!(p.per_peer[0][..2], [ins[0] as u64, ins[1] as u64]);
            assert_eq!(p.per_peer[1][..2], [at(&ta, 100), at(&ta, 100 + ins[0])]);
            assert_eq!(p.per_peer[2][..2], [outs[0] as u64, outs[1] as u64]);
            assert_eq!(p.per_peer[3][..2], [at(&tb, 100), at(&tb, 100 + outs[0])]);

            // All-to-all in place, equal splits: the same tensor, no staging.
            let t = ta.slice(200, 8)?;
            comm.all_to_all_single(t, t, &call)?.wait(None)?;
            let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[1][0] == at(&ta, 200));
            assert_eq!(p.per_peer[1][..2], [at(&ta, 200), at(&ta, 204)]);
            assert_eq!(p.per_peer[3][..2], p.per_peer[1][..2]);

            // A list whose output aliases another peer's input: the sends are staged.
            let (i0, i1) = (ta.slice(300, 4)?, ta.slice(304, 4)?);
            comm.all_to_all(&[i1, tb.slice(300, 4)?], &[i0, i1], &call)?
                .wait(None)?;
            let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[3][0] == at(&ta, 304));
            assert!(p.per_peer[1][..2].iter().all(|&x| x < at(&ta, 0) || x >= at(&ta, 1024)));

            // Reduce-scatter (single): every peer's block of 16 into our 16.
            comm.reduce_scatter_single(tb.slice(400, 16)?, ta.slice(400, 32)?, ReduceOp::Sum, &call)?
                .wait(None)?;
            let (_, p) = launched("fc_reduce_to_f32_sum", rank, |p| p.output.0 == at(&tb, 400));
            assert_eq!(p.count, 16);
            assert_eq!(p.per_peer[0][..2], [16, 16]);
            assert_eq!(p.per_peer[1][..2], [at(&ta, 400), at(&ta, 416)]);
            assert_eq!(p.per_peer[2][..2], [16, 16]);

            // Reduce-scatter of a list: the kernel takes the list as it is (no staging).
            let (i0, i1) = (ta.slice(450, 5)?, ta.slice(460, 5)?);
            comm.reduce_scatter(tb.slice(450, 5)?, &[i0, i1], ReduceOp::Max, &call)?
                .wait(None)?;
            let (_, p) = launched("fc_reduce_to_f32_max", rank, |p| p.output.0 == at(&tb, 450));
            assert_eq!(p.per_peer[1][..2], [at(&ta, 450), at(&ta, 460)]);

            // Reduce to rank 1 with premul_sum: only the root receives.
            let t = ta.slice(500, 8)?;
            comm.reduce(t, Reduction::premul_sum(0.5), 1, &call)?.wait(None)?;
            let (_, p) = launched("fc_reduce_to_f32_premul_sum", rank, |p| p.output.0 == at(&ta, 500));
            assert_eq!(p.per_peer[0][..2], [0, 8]);
            assert_eq!(p.per_peer[1][1], at(&ta, 500));
            let expect = if rank == 1 { [8, 8] } else { [0, 0] };
            assert_eq!(p.per_peer[2][..2], expect);
            assert_eq!(p.scalar, 0.5f32.to_bits() as u64);

            // Gather to 0 and scatter from 0.
            let outs = [tb.slice(600, 4)?, tb.slice(604, 4)?];
            let gathered: &[Tensor] = if rank == 0 { &outs } else { &[] };
            comm.gather(gathered, ta.slice(600, 4)?, 0, &call)?.wait(None)?;
            let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[1][0] == at(&ta, 600));
            assert_eq!((p.count, p.per_peer[0][..2].to_vec()), (4, vec![4, 0]));
            let ins = [ta.slice(700, 4)?, ta.slice(704, 4)?];
            let scattered: &[Tensor] = if rank == 0 { &ins } else { &[] };
            comm.scatter(tb.slice(700, 4)?, scattered, 0, &call)?.wait(None)?;
            let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[3][0] == at(&tb, 700));
            assert_eq!(p.per_peer[2][..2], [4, 0]);
            comm.finalize()
        });
        for (rank, r) in results.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
    }
}
