//! The device trait: the only way the vendor-neutral core touches a GPU (or the
//! host backend that stands in for one).
//!
//! Modelled on wgpu-hal: one trait with associated types per backend, and an
//! always-built backend with no hardware (`backends/host`). Raw device
//! addresses never leave a backend as Rust pointers: the core only sees
//! [`DevicePtr`], an opaque address token it may offset and hand back to the
//! same backend (in a [`KernelParams`] or a copy), never dereference.

testing_pub! { mod abi; }
pub(crate) mod fd_exchange;
mod params;

#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) use params::KERNEL_PARAMS_BYTES;
pub use params::{KernelParams, MAX_RANKS};
pub(crate) use params::{
    ERR_CODE_ABORTED, ERR_CODE_MISMATCH, ERR_CODE_NONE, ERR_CODE_TIMEOUT, ERR_WORDS, PARAM_DIRECT_OK,
    PARAM_SCALAR_IS_PTR,
};

use std::os::fd::OwnedFd;
use std::time::Duration;

use crate::error::Result;

/// An address in a device's (or, for the host backend, this process's) address space.
/// Opaque to the core: it is only offset and passed back to the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null address: no buffer (an absent operand or table).
    pub const NULL: DevicePtr = DevicePtr(0);

    /// The address `bytes` further on.
    #[must_use]
    pub const fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes as u64)
    }
}

/// Which backend a device belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The CPU backend (`backends::host`): ranks are threads or processes of
    /// this host, device memory is host memory.
    Host,
    /// NVIDIA GPUs through the CUDA driver API (`backends::cuda`).
    Cuda,
    /// AMD GPUs through the HIP runtime (`backends::hip`).
    Hip,
}

impl BackendKind {
    /// The backend's name as the options and logs spell it: `host`, `cuda`
    /// or `hip`.
    pub const fn name(self) -> &'static str {
        match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
            BackendKind::Hip => "hip",
        }
    }
}

/// What the algorithms need to know about a device.
#[derive(Debug, Clone)]
pub struct DeviceFacts {
    /// The backend the device belongs to.
    pub backend: BackendKind,
    /// Index of the device among the backend's devices on this host.
    pub ordinal: usize,
    /// The device's product name as the driver reports it (`host` on the
    /// host backend).
    pub name: String,
    /// `sm_90`, `gfx942`, or `host`.
    pub arch: String,
    /// SMs (CUDA), CUs (HIP), or worker threads (host).
    pub multiprocessors: u32,
    /// 32 on NVIDIA, 64 on CDNA, 1 on host.
    pub warp_size: u32,
    /// Bytes of device memory (host memory on the host backend).
    pub total_memory: u64,
}

/// Device memory as the driver counts it ([`Device::memory_info`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes that can be allocated now.
    pub free: u64,
    /// Bytes of the device in all.
    pub total: u64,
}

/// Kinds of device memory an algorithm asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    /// Ordinary device memory, private to this process.
    Plain,
    /// Memory that can be exported to peers (cuMem VMM / hipExtMalloc / memfd).
    /// Always returned zeroed: an exported buffer must not leak old contents.
    Shareable,
}

/// A buffer exported for a peer. `bytes` travel through the store; `fd`, when
/// present, travels over a Unix socket with SCM_RIGHTS.
#[derive(Debug)]
pub struct ExportedHandle {
    /// The backend's description of the buffer (IPC handle, ids, offsets),
    /// for the peer's [`Device::import`].
    pub bytes: Vec<u8>,
    /// The file descriptor behind the memory, where the backend shares it
    /// that way (VMM and memfd handles).
    pub fd: Option<OwnedFd>,
    /// Bytes the peer maps.
    pub size: usize,
}

/// Grid shape for a launch. Kernels are 1-D.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in the grid.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// Programmatic dependent launch, where the device takes it (CUDA,
    /// compute capability 9.0 and up; the backend launches plainly
    /// elsewhere, and HIP and the host ignore it, so a caller may always
    /// ask): the kernel's blocks may be scheduled before the stream's
    /// previous kernel ends, once that kernel's blocks have all run
    /// `fc_grid_dep_launch()` (or exited), and the kernel must run
    /// `fc_grid_dep_wait()` before it touches memory.
    /// Between two EP kernels of a graph it took the gap from ~1.3 to ~0.7
    /// us (2x H200). A kernel without the wait must not be launched so.
    pub dependent: bool,
}

impl LaunchConfig {
    /// A plain launch of `grid` blocks of `block` threads.
    pub const fn new(grid: u32, block: u32) -> Self {
        LaunchConfig {
            grid,
            block,
            dependent: false,
        }
    }

    /// An error unless `1 <= grid <= max_grid` and `1 <= block <= max_block`.
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    pub(crate) fn check_within(&self, kernel: &str, max_grid: usize, max_block: u32) -> Result<()> {
        if self.grid == 0 || self.grid as usize > max_grid || self.block == 0 || self.block > max_block {
            return Err(crate::error::Error::invalid(format!(
                "launch of {kernel} with grid {} x block {}: the grid must be 1..={max_grid} and the block 1..={max_block}",
                self.grid, self.block
            )));
        }
        Ok(())
    }
}

/// An error unless `offset..offset+len` lies inside a buffer of `buf_len` bytes.
pub(crate) fn check_range(what: &str, buf_len: usize, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= buf_len => Ok(()),
        _ => Err(crate::error::Error::invalid(format!(
            "{what}: range {offset}+{len} is outside a buffer of {buf_len} bytes"
        ))),
    }
}

/// Embedded kernel sources for one module: the same algorithm written for
/// each vendor. The host backend runs its Rust twin, looked up by kernel name.
///
/// `cuda` and `hip` hold the vendor prelude, the shared device code and the
/// module's templates, without entry points; [`ModuleSource::text`] appends
/// the entry points asked for, so a compile can hold one kernel or all.
#[derive(Debug, Clone, Copy)]
pub struct ModuleSource {
    /// The module's name, in logs, errors and the kernel cache's keys.
    pub name: &'static str,
    /// The CUDA C++ text (prelude, shared device code, templates).
    pub cuda: &'static str,
    /// The HIP C++ text (prelude, shared device code, templates).
    pub hip: &'static str,
    /// Every entry point of the module.
    pub kernels: fn() -> Vec<String>,
    /// The C++ definition of one entry point (`FC_KERNEL(name) { ... }`).
    pub entry: fn(&str) -> Option<String>,
}

fn no_kernels() -> Vec<String> {
    Vec::new()
}

fn no_entry(_: &str) -> Option<String> {
    None
}

impl ModuleSource {
    /// A module whose text already holds its entry points (tests, user
    /// kernels): `text` then adds nothing.
    pub const fn raw(name: &'static str, cuda: &'static str, hip: &'static str) -> ModuleSource {
        ModuleSource {
            name,
            cuda,
            hip,
            kernels: no_kernels,
            entry: no_entry,
        }
    }

    /// The body for a vendor (`Host` has none: it runs Rust twins).
    pub fn body(&self, backend: BackendKind) -> &'static str {
        match backend {
            BackendKind::Cuda => self.cuda,
            BackendKind::Hip => self.hip,
            BackendKind::Host => "",
        }
    }

    /// The body plus the entry points `names`, ready to compile.
    pub fn text(&self, backend: BackendKind, names: &[&str]) -> Result<String> {
        let mut text = self.body(backend).to_string();
        text.push_str("\n// Entry points (generated by ferrocomm::algo::kernels).\n");
        for name in names {
            let entry = (self.entry)(name).ok_or_else(|| {
                crate::error::Error::invalid(format!("kernel module {} has no kernel named {name}", self.name))
            })?;
            text.push_str(&entry);
        }
        Ok(text)
    }

    /// The body plus every entry point (compile checks, precompiling).
    pub fn full_text(&self, backend: BackendKind) -> String {
        let names = (self.kernels)();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        // Every name of `kernels()` has an entry (checked by the tests), so
        // this cannot fail; an empty tail would fail the compile loudly.
        self.text(backend, &names)
            .unwrap_or_else(|_| self.body(backend).to_string())
    }
}

/// A device allocation the core holds (owned or imported).
pub trait DeviceBuffer: Send + Sync {
    /// The buffer's first byte, in the device's address space.
    fn ptr(&self) -> DevicePtr;
    /// The buffer's size in bytes.
    fn len(&self) -> usize;
    /// Whether the buffer holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Host-mapped words that kernels write (error flags) and the host reads while
/// a kernel may still be running.
pub trait HostFlags: Send + Sync {
    /// The words' address as kernels see it.
    fn device_ptr(&self) -> DevicePtr;
    /// Read word `index` (a volatile load: kernels may write it meanwhile).
    fn load(&self, index: usize) -> u32;
    /// Write word `index` (a volatile store that running kernels see).
    fn store(&self, index: usize, value: u32);
}

/// One device. Implemented by every backend.
///
/// Copies and launches are stream-ordered. Methods that return data to the
/// host (`copy_to_host`) wait for the stream first. Every allocation comes
/// back zeroed. On a stream that is capturing a graph, `record`, the host
/// copies and `synchronize` return errors rather than break the capture.
pub trait Device: Send + Sync + Sized + 'static {
    /// Device memory this rank owns (freed on drop).
    type Buffer: DeviceBuffer;
    /// A peer's buffer mapped into this process ([`Device::import`]; unmapped
    /// on drop).
    type PeerBuffer: DeviceBuffer;
    /// Host-mapped words kernels write ([`Device::alloc_host_flags`]).
    type Flags: HostFlags;
    /// A stream: the device's own, or a borrowed one ([`Device::borrow_stream`]).
    type Stream: Send + Sync;
    /// A stream event, for ordering, completion polls and timing.
    type Event: Send + Sync;
    /// A captured, instantiated graph ([`Device::end_capture`]).
    type Graph: Send + Sync;
    /// A loaded kernel module ([`Device::load_module`]).
    type Module: Send + Sync;

    /// What the device is: backend, ordinal, arch, multiprocessors, memory.
    fn facts(&self) -> &DeviceFacts;

    // ---- memory ----
    /// Allocate `bytes` of device memory of `kind`, zeroed.
    fn alloc(&self, bytes: usize, kind: MemKind) -> Result<Self::Buffer>;
    /// Allocate `words` host-mapped `u32` words, zeroed, that kernels can
    /// write while the host reads them.
    fn alloc_host_flags(&self, words: usize) -> Result<Self::Flags>;
    /// Stream-ordered byte fill of `buf[offset..offset+len]`.
    fn memset(&self, buf: &Self::Buffer, offset: usize, len: usize, value: u8, stream: &Self::Stream) -> Result<()>;
    /// Copies `src` into `buf` at `offset`, ordered on `stream`; returns once
    /// `src` may be reused.
    fn copy_from_host(&self, buf: &Self::Buffer, offset: usize, src: &[u8], stream: &Self::Stream) -> Result<()> {
        check_range("copy_from_host", buf.len(), offset, src.len())?;
        self.upload(buf.ptr().offset(offset), src, stream)
    }
    /// Waits for `stream`, then copies `buf[offset..]` into `dst`.
    fn copy_to_host(&self, buf: &Self::Buffer, offset: usize, dst: &mut [u8], stream: &Self::Stream) -> Result<()> {
        check_range("copy_to_host", buf.len(), offset, dst.len())?;
        self.download(dst, buf.ptr().offset(offset), stream)
    }
    /// Copies `src` to `dst..dst+src.len()` of this device's memory, ordered
    /// on `stream`; returns once `src` may be reused (GPUs: once the copy has
    /// run). The caller checked the range ([`Device::check_memory`]).
    fn upload(&self, dst: DevicePtr, src: &[u8], stream: &Self::Stream) -> Result<()>;
    /// Waits for `stream`, then copies `src..src+dst.len()` into `dst`.
    fn download(&self, dst: &mut [u8], src: DevicePtr, stream: &Self::Stream) -> Result<()>;
    /// Stream-ordered device-to-device copy between two addresses of this device.
    fn copy_device(&self, dst: DevicePtr, src: DevicePtr, bytes: usize, stream: &Self::Stream) -> Result<()>;

    // ---- IPC ----
    /// Export a [`MemKind::Shareable`] buffer for peers on the same host.
    fn export(&self, buf: &Self::Buffer) -> Result<ExportedHandle>;
    /// Map a peer's exported buffer into this process.
    fn import(&self, handle: ExportedHandle) -> Result<Self::PeerBuffer>;
    /// Export the allocation that holds `ptr..ptr+bytes`, memory the caller
    /// allocated (ferrocomm's allocator, or the vendor's where it can be
    /// shared), for peers on the same host: the handle, which [`Device::import`]
    /// maps, and the offset of `ptr` inside what it maps. Memory that cannot
    /// be shared (a stream-ordered pool, plain host heap) is an
    /// [`Error::Unsupported`](crate::Error::Unsupported) naming why.
    fn export_range(&self, ptr: DevicePtr, bytes: usize) -> Result<(ExportedHandle, usize)> {
        let _ = (ptr, bytes);
        Err(crate::error::Error::Unsupported(format!(
            "the {} backend cannot share caller memory",
            self.facts().backend.name()
        )))
    }

    // ---- caller memory and streams ----
    /// Check, before anything is launched, that `ptr..ptr+bytes` is memory
    /// this device's kernels can use: an [`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// for host memory, another device's memory, or a range past the end of
    /// its allocation. Backends that cannot tell accept.
    fn check_memory(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        let _ = (ptr, bytes);
        Ok(())
    }

    /// Wrap a stream the caller owns (`CUstream` / `hipStream_t`, or a host
    /// stream's [`Device::raw_stream`], as an integer) so collectives can be
    /// queued on it; the wrapper never destroys it. Every backend has both
    /// this and [`Device::create_stream`].
    ///
    /// # Safety
    /// `raw` is a live stream of this device, and it outlives the wrapper and
    /// the work queued through it.
    unsafe fn borrow_stream(&self, raw: u64) -> Result<Self::Stream> {
        let _ = raw;
        Err(crate::error::Error::Unsupported(format!(
            "the {} backend has no vendor streams to borrow; use its own streams",
            self.facts().backend.name()
        )))
    }

    // ---- streams and events ----
    /// A new non-blocking stream, owned by the wrapper.
    fn create_stream(&self) -> Result<Self::Stream>;
    /// Block until everything queued on `stream` has finished.
    fn synchronize(&self, stream: &Self::Stream) -> Result<()>;
    /// A new event (with timing).
    fn create_event(&self) -> Result<Self::Event>;
    /// Record `event` at the current end of `stream`.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;
    /// True once everything before the record has finished.
    fn query(&self, event: &Self::Event) -> Result<bool>;
    /// Make later work on `stream` wait for `event` (on the device, without
    /// blocking the host).
    fn wait_event(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;
    /// Milliseconds between two completed events.
    fn elapsed_ms(&self, start: &Self::Event, end: &Self::Event) -> Result<f32>;

    // ---- graphs ----
    /// Start capturing the work queued on `stream` into a graph (thread-local
    /// capture mode) instead of running it.
    fn begin_capture(&self, stream: &Self::Stream) -> Result<()>;
    /// End the capture begun on `stream` and instantiate what it captured.
    fn end_capture(&self, stream: &Self::Stream) -> Result<Self::Graph>;
    /// Whether `stream` is capturing a graph now.
    fn is_capturing(&self, stream: &Self::Stream) -> Result<bool>;
    /// Queue one replay of `graph` on `stream`.
    fn launch_graph(&self, graph: &Self::Graph, stream: &Self::Stream) -> Result<()>;

    // ---- kernels ----
    /// A module for this device's arch. GPU backends return at once and
    /// compile its kernels in the background (or fetch them from the cache),
    /// one kernel per compile; `launch` waits for the kernel it needs.
    fn load_module(&self, source: &ModuleSource) -> Result<Self::Module>;
    /// Block until `kernels` of `module` are compiled and loaded (all of
    /// them when empty), so that later launches, captured ones included,
    /// never wait for a compiler. Compile errors surface here.
    fn prepare(&self, module: &Self::Module, kernels: &[&str]) -> Result<()> {
        let _ = (module, kernels);
        Ok(())
    }
    /// Launch `kernel` from `module` with the collective parameter block.
    fn launch(
        &self,
        module: &Self::Module,
        kernel: &str,
        config: LaunchConfig,
        params: &KernelParams,
        stream: &Self::Stream,
    ) -> Result<()>;

    /// Launch `kernel`, whose one by-value parameter is a struct with the
    /// bytes `args` (heap kernels: their argument structs start with the
    /// device API's context, `crate::heap::DevCtx`). GPU backends hand the
    /// bytes to the driver as they are; the host backend runs the Rust twin
    /// registered under the kernel's name. The caller vouches that `args`
    /// is what the kernel's parameter type expects.
    fn launch_raw(
        &self,
        module: &Self::Module,
        kernel: &str,
        config: LaunchConfig,
        args: &[u8],
        stream: &Self::Stream,
    ) -> Result<()>;

    /// Another handle to the same device (a split communicator needs its
    /// own). Backends whose handles own nothing device-wide just reopen it.
    fn duplicate(&self) -> Result<Self>;

    /// Sleep granularity for host-side polling of this device's events.
    fn poll_interval(&self) -> Duration {
        Duration::from_micros(20)
    }

    /// Wait at most `timeout` for `event`; true once it has completed. The
    /// default polls [`Device::query`]: yields first (a sleep rounds up to the
    /// timer slack, ~50 us on Linux, which would dominate a small collective),
    /// then sleeps [`Device::poll_interval`]. Backends that can block on the
    /// event itself override it.
    fn wait_event_for(&self, event: &Self::Event, timeout: Duration) -> Result<bool> {
        let start = std::time::Instant::now();
        let mut polls = 0u32;
        loop {
            if self.query(event)? {
                return Ok(true);
            }
            if start.elapsed() >= timeout {
                return Ok(false);
            }
            polls += 1;
            if polls < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(self.poll_interval());
            }
        }
    }

    /// One line about the runtime underneath (driver and compiler versions,
    /// the kernel cache), for the communicator's init log line.
    fn runtime_info(&self) -> String {
        self.versions()
    }

    /// The driver and compiler versions alone: the same for the whole
    /// process, so caches of what was measured on this device (autotune's
    /// tables) can be keyed by it.
    fn versions(&self) -> String {
        String::new()
    }

    /// Free and total device memory, in bytes, as the driver counts them
    /// now (the host backend: the system's available and total memory).
    /// Engines size their caches from it.
    fn memory_info(&self) -> Result<MemoryInfo>;

    /// Make this device current on the calling thread, for vendor libraries
    /// (NCCL) that use the thread's current device.
    fn bind_thread(&self) -> Result<()> {
        Ok(())
    }

    /// The stream's handle as an integer: the vendor's (`CUstream`,
    /// `hipStream_t`, which NCCL/RCCL calls take), or a host queue's. What
    /// [`Device::borrow_stream`] takes back; `None` where there is none.
    fn raw_stream(&self, _stream: &Self::Stream) -> Option<u64> {
        None
    }
}
