//! The host (CPU) backend: always built, the reference implementation, and the
//! default that runs anywhere.
//!
//! "Device memory" is a memfd mapped shared, so a peer process can map the same
//! pages after receiving the fd (IPC). A stream is a worker thread that runs
//! its queue in order; events are markers in that queue; graph capture
//! records the queued work, and replay queues it again. Kernels are Rust
//! functions in `kernels.rs` that follow `docs/protocol.md` exactly.

mod collectives;
mod copy;
mod fused;
// Also the broadcaster's ring (`comm::broadcaster`) sleeps on these.
pub(crate) mod futex;
pub(crate) mod heap_kernels;
mod kernels;
mod ll;
mod memory;
mod quickreduce;
mod reduce;
mod stream;

pub use memory::{HostBuffer, HostErrorFlags, HostPeerBuffer};
pub use stream::{HostEvent, HostGraph, HostStream};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::device::{
    check_range, BackendKind, Device, DeviceBuffer, DeviceFacts, DevicePtr, ExportedHandle, KernelParams, LaunchConfig,
    MemKind, MemoryInfo, ModuleSource,
};
use crate::error::{Error, Result};

/// A loaded host "module": the Rust kernels, by entry-point name.
pub struct HostModule {
    kernels: HashMap<String, kernels::HostKernel>,
    /// Heap kernels (`launch_raw`), by name.
    raw: HashMap<&'static str, heap_kernels::RawKernel>,
}

/// Launches per kernel name, in this process (every host device).
fn launch_counts() -> &'static Mutex<HashMap<String, u64>> {
    static COUNTS: OnceLock<Mutex<HashMap<String, u64>>> = OnceLock::new();
    COUNTS.get_or_init(Default::default)
}

/// How many launches of `kernel` (an entry-point name such as
/// `fc_exchange_ll`) the host backend has queued in this process, over every
/// device. It shows which protocol a call took: tests compare it before and
/// after their calls (other threads' launches only add to it). For the
/// tests alone.
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub fn launches(kernel: &str) -> u64 {
    launch_counts()
        .lock()
        .map_or(0, |m| m.get(kernel).copied().unwrap_or(0))
}

/// One host rank's device.
pub struct HostDevice {
    facts: DeviceFacts,
}

impl HostDevice {
    /// A host device; `ordinal` only labels it (any number of ranks share the CPU).
    pub fn new(ordinal: usize) -> Result<Self> {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        Ok(HostDevice {
            facts: DeviceFacts {
                backend: BackendKind::Host,
                ordinal,
                name: "host".to_string(),
                arch: "host".to_string(),
                multiprocessors: threads,
                warp_size: 1,
                total_memory: 0,
            },
        })
    }
}

impl Device for HostDevice {
    type Buffer = HostBuffer;
    type PeerBuffer = HostPeerBuffer;
    type Flags = HostErrorFlags;
    type Stream = HostStream;
    type Event = HostEvent;
    type Graph = HostGraph;
    type Module = HostModule;

    fn facts(&self) -> &DeviceFacts {
        &self.facts
    }

    fn alloc(&self, bytes: usize, _kind: MemKind) -> Result<HostBuffer> {
        // Every host allocation is a fresh (zeroed) memfd, so any buffer can be shared.
        HostBuffer::new(bytes)
    }

    fn alloc_host_flags(&self, words: usize) -> Result<HostErrorFlags> {
        Ok(HostErrorFlags::new(words))
    }

    fn memset(&self, buf: &HostBuffer, offset: usize, len: usize, value: u8, stream: &HostStream) -> Result<()> {
        check_range("memset", buf.len(), offset, len)?;
        let dst = buf.ptr().offset(offset);
        stream.submit(Arc::new(move || {
            // SAFETY: the range was checked against the live buffer above; the
            // buffer outlives queued work because owners synchronize before drop.
            unsafe { memory::fill(dst, len, value) }
        }))
    }

    fn upload(&self, dst: DevicePtr, src: &[u8], stream: &HostStream) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let data: Arc<[u8]> = Arc::from(src);
        stream.submit(Arc::new(move || {
            // SAFETY: the caller checked the destination range against live
            // memory it keeps until the stream drains; `data` is the closure's.
            unsafe { memory::copy(dst, DevicePtr(data.as_ptr() as u64), data.len()) }
        }))
    }

    fn download(&self, dst: &mut [u8], src: DevicePtr, stream: &HostStream) -> Result<()> {
        stream.synchronize()?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller checked the source range; the stream is idle, so
        // nothing queued writes it now.
        unsafe { memory::copy(DevicePtr(dst.as_mut_ptr() as u64), src, dst.len()) };
        Ok(())
    }

    fn copy_device(&self, dst: DevicePtr, src: DevicePtr, bytes: usize, stream: &HostStream) -> Result<()> {
        stream.submit(Arc::new(move || {
            // SAFETY: callers (the algorithms) pass addresses inside live buffers
            // of this device that they keep alive until the stream drains.
            unsafe { memory::copy(dst, src, bytes) }
        }))
    }

    fn export(&self, buf: &HostBuffer) -> Result<ExportedHandle> {
        buf.export()
    }

    fn import(&self, handle: ExportedHandle) -> Result<HostPeerBuffer> {
        HostPeerBuffer::import(handle)
    }

    fn export_range(&self, ptr: DevicePtr, bytes: usize) -> Result<(ExportedHandle, usize)> {
        memory::export_range(ptr, bytes)
    }

    fn create_stream(&self) -> Result<HostStream> {
        HostStream::new()
    }

    /// A host stream's handle is what [`Device::raw_stream`] gives for it;
    /// it is looked up, not dereferenced, so a stale one is an error.
    unsafe fn borrow_stream(&self, raw: u64) -> Result<HostStream> {
        HostStream::borrow(raw)
    }

    fn raw_stream(&self, stream: &HostStream) -> Option<u64> {
        Some(stream.raw())
    }

    fn synchronize(&self, stream: &HostStream) -> Result<()> {
        stream.synchronize()
    }

    fn create_event(&self) -> Result<HostEvent> {
        Ok(HostEvent::new())
    }

    fn record(&self, event: &HostEvent, stream: &HostStream) -> Result<()> {
        stream.record(event)
    }

    fn query(&self, event: &HostEvent) -> Result<bool> {
        Ok(event.is_done())
    }

    fn duplicate(&self) -> Result<Self> {
        HostDevice::new(self.facts.ordinal)
    }

    fn runtime_info(&self) -> String {
        format!("host kernels (Rust), {} CPU threads", self.facts.multiprocessors)
    }

    fn versions(&self) -> String {
        "host kernels (Rust)".into()
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        memory::system_memory()
    }

    fn wait_event_for(&self, event: &HostEvent, timeout: std::time::Duration) -> Result<bool> {
        Ok(event.wait_for(timeout))
    }

    fn wait_event(&self, stream: &HostStream, event: &HostEvent) -> Result<()> {
        stream.wait_event(event)
    }

    fn elapsed_ms(&self, start: &HostEvent, end: &HostEvent) -> Result<f32> {
        HostEvent::elapsed_ms(start, end)
    }

    fn begin_capture(&self, stream: &HostStream) -> Result<()> {
        stream.begin_capture()
    }

    fn end_capture(&self, stream: &HostStream) -> Result<HostGraph> {
        stream.end_capture()
    }

    fn is_capturing(&self, stream: &HostStream) -> Result<bool> {
        Ok(stream.is_capturing())
    }

    fn launch_graph(&self, graph: &HostGraph, stream: &HostStream) -> Result<()> {
        stream.launch_graph(graph)
    }

    fn load_module(&self, source: &ModuleSource) -> Result<HostModule> {
        if let Some(raw) = heap_kernels::raw_kernels(source.name) {
            return Ok(HostModule {
                kernels: HashMap::new(),
                raw,
            });
        }
        Ok(HostModule {
            kernels: kernels::module_kernels(source.name)?,
            raw: HashMap::new(),
        })
    }

    fn launch(
        &self,
        module: &HostModule,
        kernel: &str,
        _config: LaunchConfig,
        params: &KernelParams,
        stream: &HostStream,
    ) -> Result<()> {
        let Some(&k) = module.kernels.get(kernel) else {
            return Err(Error::invalid(format!("host module has no kernel named {kernel}")));
        };
        if let Ok(mut m) = launch_counts().lock() {
            *m.entry(kernel.to_owned()).or_default() += 1;
        }
        let params = *params;
        stream.submit(Arc::new(move || {
            // SAFETY: the algorithm layer built `params` from live workspaces and
            // buffers it keeps alive until the stream drains (docs/protocol.md).
            unsafe { k.call(&params) }
        }))
    }

    fn launch_raw(
        &self,
        module: &HostModule,
        kernel: &str,
        _config: LaunchConfig,
        args: &[u8],
        stream: &HostStream,
    ) -> Result<()> {
        let Some(&k) = module.raw.get(kernel) else {
            return Err(Error::invalid(format!("host module has no heap kernel named {kernel}")));
        };
        let args = args.to_vec();
        stream.submit(Arc::new(move || {
            // SAFETY: the host API built `args` as the kernel's struct from
            // live buffers it keeps alive until the stream drains.
            unsafe { k(&args) }
        }))
    }
}
