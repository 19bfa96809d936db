//! NCCL and RCCL underneath: one table of NCCL-API entry points, loaded with
//! libloading at run time from `libnccl.so.2` or `librccl.so.1` (RCCL exports
//! NCCL's C API), or from `$FERROCOMM_NCCL_PATH`.
//!
//! # Not hanging
//! [`CclComm::init`] bounds every wait by its `timeout`: the unique id comes
//! through the store with that timeout, and when the library has
//! `ncclCommInitRankConfig` (NCCL >= 2.14) the communicator is created
//! *non-blocking* and its state is polled with `ncclCommGetAsyncError` until
//! it is ready or the deadline passes, when it is aborted. Libraries without it
//! fall back to `ncclCommInitRank`, which can block for as long as a peer that
//! died during init keeps it waiting.
//!
//! On a non-blocking communicator any call may answer `ncclInProgress`; every
//! method here then polls until the communicator settles (bounded by the same
//! timeout), so callers see only success or an error. Dropping a communicator
//! finalizes it with the same bound and destroys it, or aborts it when an
//! error is pending or finalizing does not finish in time.
//!
//! # Devices and threads
//! NCCL binds a communicator to the *current* device of the thread that
//! creates it: make the right device current first (for CUDA,
//! `CudaDevice::make_current`). Calls on one communicator are serialised by an
//! internal lock; a group (`group_start` .. `group_end`) must be issued from one
//! thread, as NCCL's group state is per thread.

mod ffi;

#[cfg(all(test, feature = "cuda"))]
mod gpu_tests;

pub use ffi::UNIQUE_ID_BYTES;

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use ffi::{Api, NcclResult, RawComm, RawStream, UniqueId, NCCL_IN_PROGRESS, NCCL_SUCCESS};

use crate::bootstrap::Store;
use crate::device::DevicePtr;
use crate::dtype::{check_supported, DType, ReduceOp};
use crate::error::{Error, Result};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Which vendor library serves the NCCL API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CclFlavor {
    /// NVIDIA NCCL, `libnccl.so.2`.
    Nccl,
    /// AMD RCCL, `librccl.so.1`.
    Rccl,
}

impl CclFlavor {
    /// `"nccl"` or `"rccl"` (the `backend` of errors).
    pub const fn name(self) -> &'static str {
        match self {
            CclFlavor::Nccl => "nccl",
            CclFlavor::Rccl => "rccl",
        }
    }

    /// Library names tried in order when `FERROCOMM_NCCL_PATH` is not set.
    pub const fn default_libraries(self) -> &'static [&'static str] {
        match self {
            CclFlavor::Nccl => &["libnccl.so.2", "libnccl.so"],
            CclFlavor::Rccl => &["librccl.so.1", "librccl.so"],
        }
    }
}

/// A loaded NCCL-API library. Loaded once per (flavor, path) and never
/// unloaded (NCCL keeps threads and handlers that must not lose their code).
pub struct CclLibrary {
    flavor: CclFlavor,
    path: PathBuf,
    version: i32,
    api: Api,
    _lib: libloading::Library,
}

type LibraryCache = Mutex<HashMap<(CclFlavor, PathBuf), Arc<CclLibrary>>>;
static LIBRARIES: OnceLock<LibraryCache> = OnceLock::new();

impl CclLibrary {
    /// Load the flavor's library: `$FERROCOMM_NCCL_PATH` when set (a path or a
    /// name for `dlopen`), else its default names. [`Error::LibraryMissing`]
    /// when none loads or a required symbol is missing.
    pub fn load(flavor: CclFlavor) -> Result<Arc<Self>> {
        if let Some(p) = std::env::var_os("FERROCOMM_NCCL_PATH").filter(|p| !p.is_empty()) {
            return Self::load_path(flavor, Path::new(&p));
        }
        let mut reasons = Vec::new();
        for name in flavor.default_libraries() {
            match Self::load_path(flavor, Path::new(name)) {
                Ok(lib) => return Ok(lib),
                Err(Error::LibraryMissing { reason, .. }) => reasons.push(format!("{name}: {reason}")),
                Err(e) => return Err(e),
            }
        }
        Err(Error::LibraryMissing {
            library: flavor.default_libraries()[0].to_string(),
            reason: format!("{} (set FERROCOMM_NCCL_PATH to its location)", reasons.join("; ")),
        })
    }

    /// Load the library at `path` (or by `dlopen` name) as `flavor`.
    pub fn load_path(flavor: CclFlavor, path: &Path) -> Result<Arc<Self>> {
        let key = (flavor, path.to_path_buf());
        let mut libs = lock(LIBRARIES.get_or_init(Default::default));
        if let Some(lib) = libs.get(&key) {
            return Ok(lib.clone());
        }
        let shown = path.display().to_string();
        // SAFETY: loading the vendor's collective library runs its initialisers,
        // which we trust as we trust any NCCL user does.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| Error::LibraryMissing {
            library: shown.clone(),
            reason: e.to_string(),
        })?;
        let api = Api::resolve(&lib, &shown)?;
        let mut version: c_int = 0;
        // SAFETY: valid out-pointer; the entry point was resolved above.
        let r = unsafe { (api.get_version)(&mut version) };
        if r != NCCL_SUCCESS {
            return Err(Error::Backend {
                backend: flavor.name(),
                call: "ncclGetVersion",
                message: ffi::result_name(r).to_string(),
            });
        }
        let lib = Arc::new(CclLibrary {
            flavor,
            path: path.to_path_buf(),
            version,
            api,
            _lib: lib,
        });
        libs.insert(key, lib.clone());
        Ok(lib)
    }

    /// `NCCL_VERSION_CODE` of the loaded library (e.g. 22805 for 2.28.5).
    pub fn version(&self) -> i32 {
        self.version
    }

    pub fn flavor(&self) -> CclFlavor {
        self.flavor
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether communicators can be created non-blocking (bounded init).
    pub fn supports_nonblocking_init(&self) -> bool {
        self.api.comm_init_rank_config.is_some()
    }

    fn result_string(&self, r: NcclResult) -> String {
        // SAFETY: returns a pointer to a static string (or null).
        let p = unsafe { (self.api.get_error_string)(r) };
        let text = if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        format!("{} ({text})", ffi::result_name(r))
    }

    fn error(&self, call: &'static str, r: NcclResult, comm: RawComm) -> Error {
        let mut message = self.result_string(r);
        if let Some(last) = self.api.get_last_error {
            // SAFETY: `comm` is live or null (both accepted); returns a static
            // or library-owned NUL-terminated string, or null.
            let p = unsafe { last(comm) };
            if !p.is_null() {
                // SAFETY: non-null, NUL-terminated.
                let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
                if !s.trim().is_empty() {
                    message.push_str(&format!("; last error: {}", s.trim()));
                }
            }
        }
        Error::Backend {
            backend: self.flavor.name(),
            call,
            message,
        }
    }
}

/// `ncclDataType_t` for a ferrocomm dtype.
fn nccl_dtype(dtype: DType) -> c_int {
    match dtype {
        DType::F32 => ffi::dtype::FLOAT32,
        DType::F16 => ffi::dtype::FLOAT16,
        DType::BF16 => ffi::dtype::BFLOAT16,
        DType::I32 => ffi::dtype::INT32,
        DType::I8 => ffi::dtype::INT8,
        DType::U8 => ffi::dtype::UINT8,
        DType::I64 => ffi::dtype::INT64,
        DType::F64 => ffi::dtype::FLOAT64,
        DType::F8E4M3 => ffi::dtype::FLOAT8E4M3,
        DType::F8E5M2 => ffi::dtype::FLOAT8E5M2,
    }
}

/// `ncclRedOp_t` for a ferrocomm op (NCCL orders max before min). NCCL has
/// no bitwise ops, and premul_sum is a per-call op it must create.
fn nccl_op(op: ReduceOp) -> Result<c_int> {
    Ok(match op {
        ReduceOp::Sum => ffi::redop::SUM,
        ReduceOp::Prod => ffi::redop::PROD,
        ReduceOp::Min => ffi::redop::MIN,
        ReduceOp::Max => ffi::redop::MAX,
        ReduceOp::Avg => ffi::redop::AVG,
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor | ReduceOp::PreMulSum => {
            return Err(Error::Unsupported(format!("NCCL/RCCL have no {op} reduction")))
        }
    })
}

struct Handle(RawComm);

// SAFETY: an ncclComm_t may be used from any thread as long as calls on it do
// not overlap; every use goes through the mutex in CclComm.
unsafe impl Send for Handle {}

/// One rank's NCCL/RCCL communicator.
pub struct CclComm {
    lib: Arc<CclLibrary>,
    /// `None` after `abort`.
    comm: Mutex<Option<Handle>>,
    rank: usize,
    world: usize,
    nonblocking: bool,
    timeout: Duration,
}

impl CclComm {
    /// Create this rank's communicator. Collective: every rank calls it with
    /// the same `key_prefix` (unique per communicator) and `world`. Rank 0
    /// makes the unique id and publishes it at `{key_prefix}/ncclUniqueId`;
    /// the others wait for it up to `timeout`. Init itself is bounded by
    /// `timeout` when the library supports non-blocking init (see the module docs).
    ///
    /// The calling thread's current device is the one the communicator uses.
    pub fn init(
        lib: Arc<CclLibrary>,
        store: &dyn Store,
        key_prefix: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if world == 0 || rank >= world || world > c_int::MAX as usize {
            return Err(Error::invalid(format!(
                "{} communicator for rank {rank} of {world}",
                lib.flavor.name()
            )));
        }
        let start = Instant::now();
        let key = format!("{key_prefix}/ncclUniqueId");
        let mut id = UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        if rank == 0 {
            // SAFETY: valid out-pointer to a 128-byte ncclUniqueId.
            let r = unsafe { (lib.api.get_unique_id)(&mut id) };
            if r != NCCL_SUCCESS {
                return Err(lib.error("ncclGetUniqueId", r, std::ptr::null_mut()));
            }
            store.set(&key, &id.internal)?;
        } else {
            let bytes = store.get(&key, timeout)?;
            if bytes.len() != UNIQUE_ID_BYTES {
                return Err(Error::Store(format!(
                    "{key} holds {} bytes, not a {UNIQUE_ID_BYTES}-byte unique id",
                    bytes.len()
                )));
            }
            id.internal.copy_from_slice(&bytes);
        }

        let mut raw: RawComm = std::ptr::null_mut();
        let nonblocking = lib.api.comm_init_rank_config.is_some();
        let r = match lib.api.comm_init_rank_config {
            Some(init) => {
                let mut config = ffi::Config::new(false);
                // SAFETY: valid out-pointer, id by value, config points at a
                // live, NCCL_CONFIG_INITIALIZER-shaped struct for the call.
                unsafe { init(&mut raw, world as c_int, id, rank as c_int, &mut config) }
            }
            // SAFETY: valid out-pointer, id by value. May block (documented).
            None => unsafe { (lib.api.comm_init_rank)(&mut raw, world as c_int, id, rank as c_int) },
        };
        let comm = CclComm {
            lib,
            comm: Mutex::new((!raw.is_null()).then_some(Handle(raw))),
            rank,
            world,
            nonblocking,
            timeout,
        };
        if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
            let err = comm.lib.error("ncclCommInitRank", r, raw);
            comm.abort_quietly();
            return Err(err);
        }
        if raw.is_null() {
            return Err(comm.lib.error("ncclCommInitRank", r, raw));
        }
        let deadline = start + timeout;
        if let Err(e) = comm.wait_ready(raw, "ncclCommInitRank", r, deadline) {
            comm.abort_quietly();
            return Err(e);
        }
        Ok(comm)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn library(&self) -> &Arc<CclLibrary> {
        &self.lib
    }

    /// Whether init (and every call) is bounded by the timeout.
    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking
    }

    /// Poll `ncclCommGetAsyncError` until `comm` leaves `ncclInProgress`.
    fn wait_ready(&self, comm: RawComm, call: &'static str, r: NcclResult, deadline: Instant) -> Result<()> {
        if r == NCCL_SUCCESS {
            return Ok(());
        }
        if r != NCCL_IN_PROGRESS {
            return Err(self.lib.error(call, r, comm));
        }
        let mut spins = 0u32;
        loop {
            let mut state: NcclResult = NCCL_IN_PROGRESS;
            // SAFETY: live communicator, valid out-pointer.
            let q = unsafe { (self.lib.api.comm_get_async_error)(comm, &mut state) };
            if q != NCCL_SUCCESS {
                return Err(self.lib.error("ncclCommGetAsyncError", q, comm));
            }
            match state {
                NCCL_SUCCESS => return Ok(()),
                NCCL_IN_PROGRESS => {}
                other => return Err(self.lib.error(call, other, comm)),
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "{} {call} (rank {} of {})",
                        self.lib.flavor.name(),
                        self.rank,
                        self.world
                    ),
                    after: self.timeout,
                    missing: Vec::new(),
                });
            }
            // A non-blocking communicator answers most enqueues with
            // ncclInProgress for a few microseconds; sleeping here (the timer
            // slack alone is ~50 us) made eager NCCL calls cost ~100 us.
            spins += 1;
            if spins < 100_000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Run one NCCL call on the live communicator and settle its result.
    fn call(&self, name: &'static str, f: impl FnOnce(RawComm) -> NcclResult) -> Result<()> {
        let guard = lock(&self.comm);
        let Some(Handle(comm)) = guard.as_ref() else {
            return Err(Error::Aborted(format!(
                "the {} communicator was aborted",
                self.lib.flavor.name()
            )));
        };
        let comm = *comm;
        let r = f(comm);
        self.wait_ready(comm, name, r, Instant::now() + self.timeout)
    }

    /// All-reduce `count` elements from `send` into `recv` (may be equal) on `stream`.
    ///
    /// # Safety
    /// `send` and `recv` must be device addresses of this communicator's device
    /// holding `count` elements of `dtype`, kept alive until the stream has run
    /// the operation; `stream` must be a live stream of that device (or 0).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<()> {
        check_supported(dtype, op)?;
        let nop = nccl_op(op)?;
        let api = &self.lib.api;
        self.call("ncclAllReduce", |comm| {
            // SAFETY: forwarded from the caller's contract.
            unsafe {
                (api.all_reduce)(
                    send.0 as *const c_void,
                    recv.0 as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    nop,
                    comm,
                    stream as RawStream,
                )
            }
        })
    }

    /// Copy `count` elements of `send` on `root` into `recv` on every rank.
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`] (`send` is only read on the root).
    pub unsafe fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
        stream: u64,
    ) -> Result<()> {
        if root >= self.world {
            return Err(Error::invalid(format!(
                "broadcast root {root} is not in a world of {}",
                self.world
            )));
        }
        let api = &self.lib.api;
        self.call("ncclBroadcast", |comm| {
            // SAFETY: forwarded from the caller's contract.
            unsafe {
                (api.broadcast)(
                    send.0 as *const c_void,
                    recv.0 as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    root as c_int,
                    comm,
                    stream as RawStream,
                )
            }
        })
    }

    /// Reduce `world * recv_count` elements of `send` across ranks; rank `r`
    /// receives block `r` (`recv_count` elements) in `recv`.
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`], with `send` holding `world * recv_count`
    /// elements and `recv` holding `recv_count`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<()> {
        check_supported(dtype, op)?;
        let api = &self.lib.api;
        let nop = nccl_op(op)?;
        self.call("ncclReduceScatter", |comm| {
            // SAFETY: forwarded from the caller's contract.
            unsafe {
                (api.reduce_scatter)(
                    send.0 as *const c_void,
                    recv.0 as *mut c_void,
                    recv_count,
                    nccl_dtype(dtype),
                    nop,
                    comm,
                    stream as RawStream,
                )
            }
        })
    }

    /// Gather `send_count` elements from every rank into `recv`, in rank order.
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`], with `send` holding `send_count`
    /// elements and `recv` holding `world * send_count`.
    pub unsafe fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DType,
        stream: u64,
    ) -> Result<()> {
        let api = &self.lib.api;
        self.call("ncclAllGather", |comm| {
            // SAFETY: forwarded from the caller's contract.
            unsafe {
                (api.all_gather)(
                    send.0 as *const c_void,
                    recv.0 as *mut c_void,
                    send_count,
                    nccl_dtype(dtype),
                    comm,
                    stream as RawStream,
                )
            }
        })
    }

    /// Send `count` elements to `peer` (pair with its `recv`, usually in a group).
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`], for `buf` alone.
    pub unsafe fn send(&self, buf: DevicePtr, count: usize, dtype: DType, peer: usize, stream: u64) -> Result<()> {
        self.check_peer(peer)?;
        let api = &self.lib.api;
        self.call("ncclSend", |comm| {
            // SAFETY: forwarded from the caller's contract.
            unsafe {
                (api.send)(
                    buf.0 as *const c_void,
                    count,
                    nccl_dtype(dtype),
                    peer as c_int,
                    comm,
                    stream as RawStream,
                )
            }
        })
    }

    /// Receive `count` elements from `peer`.
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`], for `buf` alone.
    pub unsafe fn recv(&self, buf: DevicePtr, count: usize, dtype: DType, peer: usize, stream: u64) -> Result<()> {
        self.check_peer(peer)?;
        let api = &self.lib.api;
        self.call("ncclRecv", |comm| {
            // SAFETY: forwarded from the caller's contract.
            unsafe {
                (api.recv)(
                    buf.0 as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    peer as c_int,
                    comm,
                    stream as RawStream,
                )
            }
        })
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.world {
            return Err(Error::invalid(format!(
                "peer {peer} is not in a world of {}",
                self.world
            )));
        }
        Ok(())
    }

    /// Start a group on the calling thread (`ncclGroupStart`).
    pub fn group_start(&self) -> Result<()> {
        // SAFETY: takes no arguments; group state is per thread.
        let r = unsafe { (self.lib.api.group_start)() };
        if r == NCCL_SUCCESS {
            Ok(())
        } else {
            Err(self.lib.error("ncclGroupStart", r, std::ptr::null_mut()))
        }
    }

    /// End the calling thread's group (`ncclGroupEnd`) and wait until this
    /// communicator has accepted it.
    pub fn group_end(&self) -> Result<()> {
        let api = &self.lib.api;
        // SAFETY: takes no arguments; ends this thread's group.
        self.call("ncclGroupEnd", |_| unsafe { (api.group_end)() })
    }

    /// `Ok(())` while the communicator is healthy (or still settling);
    /// the pending asynchronous error otherwise.
    pub fn async_error(&self) -> Result<()> {
        let guard = lock(&self.comm);
        let Some(Handle(comm)) = guard.as_ref() else {
            return Err(Error::Aborted(format!(
                "the {} communicator was aborted",
                self.lib.flavor.name()
            )));
        };
        let mut state: NcclResult = NCCL_SUCCESS;
        // SAFETY: live communicator, valid out-pointer.
        let q = unsafe { (self.lib.api.comm_get_async_error)(*comm, &mut state) };
        if q != NCCL_SUCCESS {
            return Err(self.lib.error("ncclCommGetAsyncError", q, *comm));
        }
        match state {
            NCCL_SUCCESS | NCCL_IN_PROGRESS => Ok(()),
            other => Err(self.lib.error("async error", other, *comm)),
        }
    }

    /// Abort: kernels of this communicator exit, its resources are freed, and
    /// later calls return [`Error::Aborted`] (a second abort too).
    pub fn abort(&self) -> Result<()> {
        let Some(Handle(comm)) = lock(&self.comm).take() else {
            return Err(Error::Aborted(format!(
                "the {} communicator was already aborted",
                self.lib.flavor.name()
            )));
        };
        // SAFETY: live communicator, released exactly once (taken out above).
        let r = unsafe { (self.lib.api.comm_abort)(comm) };
        if r == NCCL_SUCCESS || r == NCCL_IN_PROGRESS {
            Ok(())
        } else {
            Err(self.lib.error("ncclCommAbort", r, std::ptr::null_mut()))
        }
    }

    fn abort_quietly(&self) {
        let _ = self.abort();
    }
}

impl Drop for CclComm {
    fn drop(&mut self) {
        let Some(Handle(comm)) = lock(&self.comm).take() else {
            return;
        };
        let api = &self.lib.api;
        let mut state: NcclResult = NCCL_SUCCESS;
        // SAFETY: live communicator, valid out-pointer.
        let q = unsafe { (api.comm_get_async_error)(comm, &mut state) };
        let healthy = q == NCCL_SUCCESS && (state == NCCL_SUCCESS || state == NCCL_IN_PROGRESS);
        let finished = healthy
            && match (self.nonblocking, api.comm_finalize) {
                // Bounded: finalize flushes outstanding work asynchronously.
                (true, Some(finalize)) => {
                    // SAFETY: live communicator.
                    let r = unsafe { finalize(comm) };
                    self.wait_ready(comm, "ncclCommFinalize", r, Instant::now() + self.timeout)
                        .is_ok()
                }
                _ => true,
            };
        // SAFETY: live communicator, released exactly once (taken out above).
        let r = unsafe {
            if finished {
                (api.comm_destroy)(comm)
            } else {
                (api.comm_abort)(comm)
            }
        };
        if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
            // Nobody receives a Result from Drop: the one place this is told.
            crate::fc_log!(
                tracing::Level::ERROR,
                "{} {} failed while dropping a communicator: {}",
                self.lib.flavor.name(),
                if finished { "ncclCommDestroy" } else { "ncclCommAbort" },
                self.lib.result_string(r)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_and_op_codes_match_nccl_h() {
        assert_eq!(nccl_dtype(DType::F32), 7);
        assert_eq!(nccl_dtype(DType::F16), 6);
        assert_eq!(nccl_dtype(DType::BF16), 9);
        assert_eq!(nccl_dtype(DType::I32), 2);
        assert_eq!(nccl_op(ReduceOp::Sum).ok(), Some(0));
        assert_eq!(nccl_op(ReduceOp::Prod).ok(), Some(1));
        assert_eq!(nccl_op(ReduceOp::Max).ok(), Some(2));
        assert_eq!(nccl_op(ReduceOp::Min).ok(), Some(3));
        assert_eq!(nccl_op(ReduceOp::Avg).ok(), Some(4));
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        let e = CclLibrary::load_path(CclFlavor::Nccl, Path::new("/nonexistent/ferrocomm/libnccl.so.2"));
        assert!(matches!(e, Err(Error::LibraryMissing { .. })), "{:?}", e.err());
        let e = CclLibrary::load_path(CclFlavor::Rccl, Path::new("librccl-does-not-exist.so.1"));
        assert!(matches!(e, Err(Error::LibraryMissing { .. })), "{:?}", e.err());
    }

    #[test]
    fn a_library_without_the_api_is_refused() {
        // libc loads but exports no NCCL symbols.
        let e = CclLibrary::load_path(CclFlavor::Nccl, Path::new("libc.so.6"));
        match e {
            Err(Error::LibraryMissing { reason, .. }) => assert!(reason.contains("ncclGetVersion"), "{reason}"),
            other => panic!("expected LibraryMissing, got {:?}", other.err()),
        }
    }
}
