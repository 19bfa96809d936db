//! The vendor table: everything [`GpuDevice`](super::GpuDevice) needs from a
//! vendor, in three parts that each vendor folder implements for its marker
//! type (`backends::cuda::Cuda`, `backends::hip::Hip`):
//!
//! - [`Driver`]: the library's entry points (context, memory, streams,
//!   events, graphs, modules, launch), one call each, errors already turned
//!   into [`Error`](crate::Error)s with the vendor's text;
//! - [`Ipc`]: the IPC flavour (cuMem VMM fds and legacy cuIpc handles on
//!   CUDA, hipIpc handles on uncached memory on HIP);
//! - [`Rtc`]: the run-time compiler and the target it builds for.
//!
//! Handles cross this boundary as integers ([`RawStream`] and friends), so
//! raw pointers stay inside the vendor folders. Functions that take a handle
//! are `unsafe`: the handle must be live and belong to `ctx` (the generic
//! layer owns every handle it passes, and keeps its context alive).
//! Release functions (`*_destroy`, `*_free`, `*_unload`) report a driver
//! that is already shutting down (process exit) as success.

use std::ffi::CStr;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::Arc;

use super::errors::DropErrors;
use super::handle::{HandleKind, ParsedHandle};
use crate::device::{BackendKind, DeviceFacts, DevicePtr, LaunchConfig};
use crate::error::Result;

macro_rules! raw_handles {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
            pub struct $name(pub u64);

            impl $name {
                pub const NULL: $name = $name(0);

                pub fn is_null(self) -> bool {
                    self.0 == 0
                }
            }
        )*
    };
}

raw_handles!(
    /// `CUstream` / `hipStream_t`.
    RawStream,
    /// `CUevent` / `hipEvent_t`.
    RawEvent,
    /// `CUgraph` / `hipGraph_t`.
    RawGraph,
    /// `CUgraphExec` / `hipGraphExec_t`.
    RawGraphExec,
    /// `CUmodule` / `hipModule_t`.
    RawModule,
    /// `CUfunction` / `hipFunction_t`.
    RawFunction,
);

/// What opening a device found.
pub struct Opened<V: Driver> {
    pub ctx: Arc<V::Context>,
    pub facts: DeviceFacts,
    /// Whether the device can map host memory (host flags need it).
    pub map_host: bool,
    pub extra: V::Extra,
}

/// What kind of memory an address is, as the runtime sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryType {
    Device,
    Host,
    /// An address no allocation of the runtime covers (plain host heap, or garbage).
    Unknown,
}

/// What the runtime says about an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    pub memory: MemoryType,
    /// The ordinal of the device that owns device memory.
    pub device: Option<usize>,
    /// Memory from a stream-ordered pool (`cudaMallocAsync`), which no
    /// handle can export.
    pub pooled: bool,
    /// A VMM mapping: one chunk of a reservation, which the next chunk may
    /// continue (PyTorch's expandable segments), unlike plain allocations.
    pub vmm: bool,
    /// The allocation (or mapped chunk) that holds the address, where the
    /// same query told; `None`: ask `address_range`.
    pub range: Option<(DevicePtr, usize)>,
}

/// How a compiled image is checked before it is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// An ELF object (CUBIN, AMDGPU code object).
    Elf,
    /// NUL-terminated PTX text.
    Ptx,
}

impl ImageKind {
    /// Whether `bytes` look like an image of this kind.
    pub fn accepts(self, bytes: &[u8]) -> bool {
        match self {
            ImageKind::Elf => bytes.len() > 64 && bytes.starts_with(b"\x7fELF"),
            ImageKind::Ptx => bytes.len() > 1 && bytes.last() == Some(&0) && !bytes[..bytes.len() - 1].contains(&0),
        }
    }
}

/// What the run-time compiler builds for one device, and everything that
/// makes its output differ (all of it goes into the cache key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileTarget {
    /// `sm_90`, `compute_120`, `gfx942`: in errors and cache file names.
    pub arch: String,
    pub options: Vec<String>,
    /// Compiler and, where it matters, runtime version (`nvrtc 13.0`).
    pub compiler: String,
    /// Cache file extension (`cubin`, `ptx`, `hsaco`).
    pub extension: &'static str,
    pub image: ImageKind,
}

/// One exported allocation, before the generic layer adds its header.
pub struct Export {
    pub kind: HandleKind,
    /// The vendor handle (64 bytes for IPC handles, empty for fds).
    pub payload: Vec<u8>,
    pub fd: Option<OwnedFd>,
    /// Start and size of what the importer maps.
    pub base: DevicePtr,
    pub size: usize,
}

pub(crate) mod sealed {
    /// Only the vendor folders of this crate implement the table.
    pub trait Sealed {}
}

/// The vendor library: devices, memory, streams, events, graphs, modules.
pub trait Driver: sealed::Sealed + Sized + Send + Sync + 'static {
    const KIND: BackendKind;
    /// `CUDA` / `HIP`, in messages.
    const LABEL: &'static str;
    /// A device's context (CUDA: the retained primary context; HIP: the
    /// ordinal). Every resource holds an `Arc` of it.
    type Context: Send + Sync + 'static;
    /// Vendor facts beyond [`DeviceFacts`] (compute capability, clock rate).
    type Extra: Send + Sync + 'static;

    /// Where this vendor's release failures are counted.
    fn drop_errors() -> &'static DropErrors;

    // ---- devices and contexts ----
    fn device_count() -> Result<usize>;
    /// Load the library, check `ordinal` and read the device's facts.
    fn open(ordinal: usize) -> Result<Opened<Self>>;
    /// Make `ctx` current on the calling thread.
    fn bind(ctx: &Self::Context) -> Result<()>;
    fn ordinal(ctx: &Self::Context) -> usize;
    /// Equal for handles that name the same context.
    fn context_id(ctx: &Self::Context) -> u64;
    fn can_access_peer(a: usize, b: usize) -> Result<bool>;
    /// Let `ctx`'s device (current) reach device `peer`'s plain allocations;
    /// already enabled is success.
    fn enable_peer_access(ctx: &Self::Context, peer: usize) -> Result<()>;
    /// Let the calling (worker) thread load modules while other threads
    /// capture graphs, whatever capture mode they chose.
    fn relax_thread_capture_mode();
    /// Driver and runtime versions, for logs.
    fn runtime_info() -> String;

    // ---- memory ----
    /// Free and total bytes of the device (`ctx` is current).
    fn mem_info(ctx: &Self::Context) -> Result<(usize, usize)>;
    /// `bytes` (at least 1) of plain device memory, not zeroed.
    fn mem_alloc(ctx: &Self::Context, bytes: usize) -> Result<DevicePtr>;
    /// # Safety
    /// `ptr` came from [`Driver::mem_alloc`] on `ctx` and is freed once, after
    /// the work that used it.
    unsafe fn mem_free(ctx: &Self::Context, ptr: DevicePtr) -> Result<()>;
    /// Pinned host memory mapped for the device, zeroed: host and device address.
    fn host_alloc_mapped(ctx: &Self::Context, bytes: usize) -> Result<(NonNull<u8>, DevicePtr)>;
    /// # Safety
    /// `host` came from [`Driver::host_alloc_mapped`] on `ctx` and is freed once.
    unsafe fn host_free(ctx: &Self::Context, host: NonNull<u8>) -> Result<()>;
    /// # Safety
    /// `stream` is live; `dst..dst+bytes` stays allocated until the stream drains.
    unsafe fn memset_async(
        ctx: &Self::Context,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()>;
    /// # Safety
    /// As `memset_async`, and `src..src+bytes` stays readable until the stream drains.
    unsafe fn copy_to_device_async(
        ctx: &Self::Context,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()>;
    /// # Safety
    /// As `memset_async`, and `dst..dst+bytes` stays writable until the stream drains.
    unsafe fn copy_to_host_async(
        ctx: &Self::Context,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()>;
    /// # Safety
    /// `stream` is live; both ranges stay mapped until the stream drains.
    unsafe fn copy_device_async(
        ctx: &Self::Context,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()>;
    /// What the runtime knows about `ptr`; `None` when it cannot tell
    /// (an old runtime).
    fn pointer_info(ctx: &Self::Context, ptr: DevicePtr) -> Result<Option<PointerInfo>>;
    /// The allocation (or VMM mapping) that holds `ptr`: its start and
    /// size; `None` when no allocation does.
    fn address_range(ctx: &Self::Context, ptr: DevicePtr) -> Result<Option<(DevicePtr, usize)>>;

    // ---- streams ----
    /// A new non-blocking stream.
    fn stream_create(ctx: &Self::Context) -> Result<RawStream>;
    /// # Safety
    /// A live stream created on `ctx`, destroyed once.
    unsafe fn stream_destroy(ctx: &Self::Context, stream: RawStream) -> Result<()>;
    /// # Safety
    /// A live stream of `ctx`.
    unsafe fn stream_synchronize(ctx: &Self::Context, stream: RawStream) -> Result<()>;
    /// Whether the stream is in graph capture (active or invalidated).
    /// # Safety
    /// A live stream of `ctx`.
    unsafe fn stream_is_capturing(ctx: &Self::Context, stream: RawStream) -> Result<bool>;
    /// An [`Error::InvalidArgument`](crate::Error::InvalidArgument) when a
    /// caller's stream belongs to another device or context (where the API
    /// can tell; `ctx` is current).
    /// # Safety
    /// `stream` is a live stream handle (possibly of another context).
    unsafe fn stream_check_owner(ctx: &Self::Context, stream: RawStream) -> Result<()>;
    /// # Safety
    /// Live stream and event of `ctx`.
    unsafe fn stream_wait_event(ctx: &Self::Context, stream: RawStream, event: RawEvent) -> Result<()>;
    /// Begin capture in thread-local mode.
    /// # Safety
    /// A live stream of `ctx`.
    unsafe fn begin_capture(ctx: &Self::Context, stream: RawStream) -> Result<()>;
    /// End capture; a stream that was not capturing is an
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument).
    /// # Safety
    /// A live stream of `ctx`.
    unsafe fn end_capture(ctx: &Self::Context, stream: RawStream) -> Result<RawGraph>;
    /// # Safety
    /// A live graph of `ctx`.
    unsafe fn graph_instantiate(ctx: &Self::Context, graph: RawGraph) -> Result<RawGraphExec>;
    /// # Safety
    /// Live executable graph and stream of `ctx`.
    unsafe fn graph_launch(ctx: &Self::Context, exec: RawGraphExec, stream: RawStream) -> Result<()>;
    /// # Safety
    /// Released once.
    unsafe fn graph_exec_destroy(ctx: &Self::Context, exec: RawGraphExec) -> Result<()>;
    /// # Safety
    /// Released once.
    unsafe fn graph_destroy(ctx: &Self::Context, graph: RawGraph) -> Result<()>;

    // ---- events ----
    /// A new event with timing enabled.
    fn event_create(ctx: &Self::Context) -> Result<RawEvent>;
    /// # Safety
    /// Released once.
    unsafe fn event_destroy(ctx: &Self::Context, event: RawEvent) -> Result<()>;
    /// # Safety
    /// Live event and stream of `ctx`.
    unsafe fn event_record(ctx: &Self::Context, event: RawEvent, stream: RawStream) -> Result<()>;
    /// True once the work before the last record has finished.
    /// # Safety
    /// A live event of `ctx` that was recorded.
    unsafe fn event_query(ctx: &Self::Context, event: RawEvent) -> Result<bool>;
    /// # Safety
    /// Two live, recorded events of `ctx`.
    unsafe fn event_elapsed_ms(ctx: &Self::Context, start: RawEvent, end: RawEvent) -> Result<f32>;

    // ---- modules and launches ----
    /// Load an image into `ctx` (current).
    fn module_load(ctx: &Self::Context, image: &[u8]) -> Result<RawModule>;
    /// # Safety
    /// A live module of `ctx`, unloaded once, after the kernels that ran from it.
    unsafe fn module_unload(ctx: &Self::Context, module: RawModule) -> Result<()>;
    /// The entry point `name` (`None` when the module has none), loaded so
    /// that a first launch inside a graph capture loads nothing.
    /// # Safety
    /// A live module of `ctx` (current).
    unsafe fn module_function(ctx: &Self::Context, module: RawModule, name: &CStr) -> Result<Option<RawFunction>>;
    /// Launch with `args`: one pointer to the parameter block, which the
    /// driver copies (the kernel takes it by value) before returning.
    /// # Safety
    /// `function`'s single parameter is `FcParams` (the ABI twin of
    /// [`KernelParams`](crate::device::KernelParams)) and `args[0]` points at a live `KernelParams`; its
    /// module and `stream` are live and of `ctx`.
    unsafe fn launch(
        ctx: &Self::Context,
        function: RawFunction,
        config: LaunchConfig,
        args: &mut [*mut std::ffi::c_void; 1],
        stream: RawStream,
    ) -> Result<()>;
}

/// The IPC flavour: memory peers can map, and mapping theirs.
pub trait Ipc: Driver {
    /// A [`MemKind::Shareable`](crate::device::MemKind::Shareable)
    /// allocation; released on drop.
    type Shared: Send + Sync + 'static;
    /// A peer's memory mapped into this process; unmapped on drop.
    type Mapping: Send + Sync + 'static;

    /// At least `bytes` of shareable memory (rounded up as the flavour
    /// needs), not zeroed. `ctx` is current.
    fn alloc_shared(ctx: &Arc<Self::Context>, bytes: usize) -> Result<Self::Shared>;
    /// Address and allocated bytes of a shareable allocation.
    fn shared_range(shared: &Self::Shared) -> (DevicePtr, usize);
    /// Export one of our shareable allocations.
    fn export_shared(ctx: &Self::Context, shared: &Self::Shared) -> Result<Export>;
    /// Export memory the caller allocated: `base..base+size` is the
    /// allocation (or mapping) that holds `ptr`, on this device, already
    /// checked. [`Error::Unsupported`](crate::Error::Unsupported) when it
    /// cannot be shared.
    fn export_caller(
        ctx: &Self::Context,
        ptr: DevicePtr,
        base: DevicePtr,
        size: usize,
        info: &PointerInfo,
    ) -> Result<Export>;
    /// Map a handle from another process (or, for fd handles, any process).
    fn open_handle(ctx: &Arc<Self::Context>, handle: &ParsedHandle, fd: Option<&OwnedFd>) -> Result<Self::Mapping>;
    fn mapping_ptr(mapping: &Self::Mapping) -> DevicePtr;
}

/// The run-time compiler.
pub trait Rtc: Driver {
    /// How many compiles may run at once in a process.
    fn max_parallel_compiles() -> usize;
    /// What to build for this device. Errors when the compiler cannot be loaded.
    fn compile_target(facts: &DeviceFacts, extra: &Self::Extra) -> Result<CompileTarget>;
    /// Compile `text` (one unit, named `unit` in errors) into an image.
    fn compile(target: &CompileTarget, unit: &str, text: &str) -> Result<Vec<u8>>;
    /// Compiler version and origin, for logs.
    fn rtc_info() -> String;
}

/// A whole vendor: what [`GpuDevice`](super::GpuDevice) is generic over.
pub trait Vendor: Driver + Ipc + Rtc {}

impl<V: Driver + Ipc + Rtc> Vendor for V {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_checked_by_kind() {
        let mut elf = b"\x7fELF".to_vec();
        elf.resize(200, 1);
        assert!(ImageKind::Elf.accepts(&elf));
        assert!(!ImageKind::Elf.accepts(b"\x7fELF"));
        assert!(!ImageKind::Elf.accepts(&[0u8; 200]));
        assert!(ImageKind::Ptx.accepts(b".version 9.0\n.target sm_90\0"));
        assert!(!ImageKind::Ptx.accepts(b".version 9.0"));
        assert!(!ImageKind::Ptx.accepts(b".ver\0sion\0"));
        assert!(!ImageKind::Ptx.accepts(b"\0"));
    }
}
