//! NCCL and RCCL underneath: one table of NCCL-API entry points, loaded with
//! libloading at run time from `libnccl.so.2` or `librccl.so.1` (RCCL exports
//! NCCL's C API), or from `$FERROCOMM_NCCL_PATH`.
//!
//! # Not hanging, and not paying for it per call
//! [`CclComm::init`] bounds every wait by its `timeout`: the unique id comes
//! through the store with that timeout. By default the communicator is
//! *blocking* (every call returns once queued, with no polling, as
//! PyTorch's ProcessGroupNCCL uses it), and its init runs on a thread of its
//! own that the caller waits for up to the timeout: a peer that never
//! arrives gives the caller [`Error::Timeout`] while that thread stays
//! behind in NCCL. With `FERROCOMM_NCCL_NONBLOCKING=1` (and NCCL >= 2.14)
//! the communicator is *non-blocking* instead: init and every call are
//! polled with `ncclCommGetAsyncError` until they settle (bounded by the
//! same timeout), which costs tens of microseconds per eager call.
//!
//! Deadlines of running collectives are the communicator's: a wait that
//! times out aborts this communicator (`ncclCommAbort`), which ends NCCL's
//! kernels that wait on a dead peer, as ProcessGroupNCCL's watchdog does.
//! Dropping a communicator finalizes it (non-blocking: bounded) and
//! destroys it, or aborts it when an error is pending.
//!
//! # Devices and threads
//! NCCL binds a communicator to the *current* device of the thread that
//! creates it: make the right device current first (for CUDA,
//! `CudaDevice::make_current`). Calls on one communicator are serialised by an
//! internal lock; a group (`group_start` .. `group_end`) must be issued from one
//! thread, as NCCL's group state is per thread.

mod current;
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

/// A communicator pointer crossing from the init thread.
struct SendComm(RawComm);
// SAFETY: an ncclComm_t may be handed to another thread; it is used by one
// thread at a time (the caller, once init is done).
unsafe impl Send for SendComm {}

/// Create a blocking communicator on a thread of its own, with the caller's
/// current device, waiting for it at most `within`.
fn blocking_init(lib: &Arc<CclLibrary>, id: UniqueId, rank: usize, world: usize, within: Duration) -> Result<RawComm> {
    let current = current::Current::capture(lib.flavor);
    let (tx, rx) = std::sync::mpsc::channel::<(NcclResult, SendComm)>();
    let for_thread = lib.clone();
    std::thread::Builder::new()
        .name("ferrocomm-nccl-init".into())
        .spawn(move || {
            current.restore(for_thread.flavor);
            let mut raw: RawComm = std::ptr::null_mut();
            let r = match for_thread.api.comm_init_rank_config {
                Some(init) => {
                    let mut config = ffi::Config::new(true);
                    // SAFETY: valid out-pointer, id by value, config points at
                    // a live, NCCL_CONFIG_INITIALIZER-shaped struct for the call.
                    unsafe { init(&mut raw, world as c_int, id, rank as c_int, &mut config) }
                }
                // SAFETY: valid out-pointer, id by value.
                None => unsafe { (for_thread.api.comm_init_rank)(&mut raw, world as c_int, id, rank as c_int) },
            };
            // The caller may have given up (timeout); then the comm leaks, by design.
            let _ = tx.send((r, SendComm(raw)));
        })
        .map_err(|e| Error::io("spawning the NCCL init thread", e))?;
    match rx.recv_timeout(within) {
        Ok((r, SendComm(raw))) if r == NCCL_SUCCESS && !raw.is_null() => Ok(raw),
        Ok((r, SendComm(raw))) => {
            let err = lib.error("ncclCommInitRank", r, raw);
            if !raw.is_null() {
                // SAFETY: a communicator NCCL returned with an error; released once.
                let _ = unsafe { (lib.api.comm_abort)(raw) };
            }
            Err(err)
        }
        Err(_) => Err(Error::Timeout {
            what: format!(
                "{} communicator init of rank {rank} of {world} (a peer did not join)",
                lib.flavor.name()
            ),
            after: within,
            missing: Vec::new(),
        }),
    }
}

/// A reduction as NCCL takes it: a built-in op, or premul_sum with its factor.
#[derive(Debug, Clone, Copy)]
pub enum CclReduction {
    Op(ReduceOp),
    /// The factor as a host value (converted to the call's dtype).
    PreMulHost(f64),
    /// The address of the factor, one element of the call's dtype, in device memory.
    PreMulDevice(DevicePtr),
}

/// A dynamic premul_sum op, destroyed on drop.
struct DynOp<'a> {
    comm: &'a CclComm,
    raw: RawComm,
    op: c_int,
}

impl Drop for DynOp<'_> {
    fn drop(&mut self) {
        if let Some(destroy) = self.comm.lib.api.red_op_destroy {
            // SAFETY: an op created on this communicator, destroyed once, after
            // the collective that uses it was queued (NCCL allows that).
            let _ = unsafe { destroy(self.op, self.raw) };
        }
    }
}

/// A host factor as bytes of `dtype` (what `ncclScalarHostImmediate` reads),
/// converted as the kernels take it: to f32 first (`KernelParams::scalar`),
/// then rounded to nearest even into a half type.
fn factor_bytes(f: f64, dtype: DType) -> Result<[u8; 8]> {
    let mut out = [0u8; 8];
    let single = f as f32;
    match dtype {
        DType::F32 => out[..4].copy_from_slice(&single.to_le_bytes()),
        DType::F64 => out.copy_from_slice(&f.to_le_bytes()),
        DType::F16 => out[..2].copy_from_slice(&half::f16::from_f32(single).to_bits().to_le_bytes()),
        DType::BF16 => out[..2].copy_from_slice(&half::bf16::from_f32(single).to_bits().to_le_bytes()),
        other => return Err(Error::invalid(format!("premul_sum takes a float dtype, not {other}"))),
    }
    Ok(out)
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
    /// Set once work of this communicator was captured into a CUDA/HIP
    /// graph: the library's destroy then waits for every such graph to be
    /// destroyed first, forever if the caller keeps one (seen on NCCL 2.28),
    /// so the communicator is aborted instead.
    captured: std::sync::atomic::AtomicBool,
}

impl CclComm {
    /// Note that work of this communicator went into a graph capture.
    pub fn note_capture(&self) {
        self.captured.store(true, std::sync::atomic::Ordering::Relaxed);
    }

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

        let nonblocking = lib.api.comm_init_rank_config.is_some()
            && std::env::var("FERROCOMM_NCCL_NONBLOCKING").is_ok_and(|v| v.trim() == "1");
        let deadline = start + timeout;
        let raw = if nonblocking {
            let mut raw: RawComm = std::ptr::null_mut();
            let mut config = ffi::Config::new(false);
            let init = lib
                .api
                .comm_init_rank_config
                .ok_or_else(|| Error::invalid("no ncclCommInitRankConfig"))?;
            // SAFETY: valid out-pointer, id by value, config points at a
            // live, NCCL_CONFIG_INITIALIZER-shaped struct for the call.
            let r = unsafe { init(&mut raw, world as c_int, id, rank as c_int, &mut config) };
            let comm = CclComm {
                lib: lib.clone(),
                comm: Mutex::new((!raw.is_null()).then_some(Handle(raw))),
                rank,
                world,
                nonblocking,
                timeout,
                captured: Default::default(),
            };
            if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
                let err = comm.lib.error("ncclCommInitRank", r, raw);
                comm.abort_quietly();
                return Err(err);
            }
            if raw.is_null() {
                return Err(comm.lib.error("ncclCommInitRank", r, raw));
            }
            if let Err(e) = comm.wait_ready(raw, "ncclCommInitRank", r, deadline) {
                comm.abort_quietly();
                return Err(e);
            }
            return Ok(comm);
        } else {
            blocking_init(
                &lib,
                id,
                rank,
                world,
                deadline.saturating_duration_since(Instant::now()),
            )?
        };
        Ok(CclComm {
            lib,
            comm: Mutex::new(Some(Handle(raw))),
            rank,
            world,
            nonblocking,
            timeout,
            captured: Default::default(),
        })
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

    /// Whether the communicator is non-blocking (`FERROCOMM_NCCL_NONBLOCKING=1`).
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
        self.call_with(name, |comm| Ok(f(comm)))
    }

    /// [`CclComm::call`] for calls that may fail before reaching NCCL.
    /// Blocking communicators return once the call is queued: no polling.
    fn call_with(&self, name: &'static str, f: impl FnOnce(RawComm) -> Result<NcclResult>) -> Result<()> {
        let guard = lock(&self.comm);
        let Some(Handle(comm)) = guard.as_ref() else {
            return Err(Error::Aborted(format!(
                "the {} communicator was aborted",
                self.lib.flavor.name()
            )));
        };
        let comm = *comm;
        let r = f(comm)?;
        if !self.nonblocking {
            return match r {
                NCCL_SUCCESS => Ok(()),
                other => Err(self.lib.error(name, other, comm)),
            };
        }
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

    /// The op of a reduction, and for premul_sum the dynamic op that must
    /// outlive the call (destroyed when dropped, after the call is queued).
    fn op_for<'a>(&'a self, comm: RawComm, red: CclReduction, dtype: DType) -> Result<(c_int, Option<DynOp<'a>>)> {
        let (factor, residence) = match red {
            CclReduction::Op(op) => {
                check_supported(dtype, op)?;
                return Ok((nccl_op(op)?, None));
            }
            CclReduction::PreMulHost(f) => (Some(factor_bytes(f, dtype)?), ffi::SCALAR_HOST_IMMEDIATE),
            CclReduction::PreMulDevice(_) => (None, ffi::SCALAR_DEVICE),
        };
        let create = self.lib.api.red_op_create_premul_sum.ok_or_else(|| {
            Error::Unsupported(format!(
                "{} {} has no ncclRedOpCreatePreMulSum (premul_sum needs NCCL 2.11+)",
                self.lib.flavor.name(),
                self.lib.version
            ))
        })?;
        let mut bytes = factor.unwrap_or([0; 8]);
        let scalar = match red {
            CclReduction::PreMulDevice(p) => p.0 as *mut c_void,
            _ => bytes.as_mut_ptr() as *mut c_void,
        };
        let mut op: c_int = 0;
        // SAFETY: valid out-pointer; `scalar` is a host value of `dtype` that
        // lives across the call (NCCL copies it for HostImmediate) or a device
        // address the caller keeps alive; live communicator.
        let r = unsafe { create(&mut op, scalar, nccl_dtype(dtype), residence, comm) };
        if r != NCCL_SUCCESS {
            return Err(self.lib.error("ncclRedOpCreatePreMulSum", r, comm));
        }
        Ok((
            op,
            Some(DynOp {
                comm: self,
                raw: comm,
                op,
            }),
        ))
    }

    /// All-reduce with any reduction (premul_sum through a dynamic op).
    ///
    /// # Safety
    /// As [`CclComm::all_reduce`]; a device factor's address too.
    pub unsafe fn all_reduce_with(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        red: CclReduction,
        stream: u64,
    ) -> Result<()> {
        let api = &self.lib.api;
        self.call_with("ncclAllReduce", |comm| {
            let (op, _dyn) = self.op_for(comm, red, dtype)?;
            // SAFETY: forwarded from the caller's contract.
            Ok(unsafe {
                (api.all_reduce)(
                    send.0 as *const c_void,
                    recv.0 as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    op,
                    comm,
                    stream as RawStream,
                )
            })
        })
    }

    /// Reduce-scatter with any reduction.
    ///
    /// # Safety
    /// As [`CclComm::reduce_scatter`]; a device factor's address too.
    pub unsafe fn reduce_scatter_with(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        red: CclReduction,
        stream: u64,
    ) -> Result<()> {
        let api = &self.lib.api;
        self.call_with("ncclReduceScatter", |comm| {
            let (op, _dyn) = self.op_for(comm, red, dtype)?;
            // SAFETY: forwarded from the caller's contract.
            Ok(unsafe {
                (api.reduce_scatter)(
                    send.0 as *const c_void,
                    recv.0 as *mut c_void,
                    recv_count,
                    nccl_dtype(dtype),
                    op,
                    comm,
                    stream as RawStream,
                )
            })
        })
    }

    /// Reduce `count` elements of every rank's `send` into `recv` on `root`.
    ///
    /// # Safety
    /// As [`CclComm::all_reduce`] (`recv` is only written on the root).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        red: CclReduction,
        root: usize,
        stream: u64,
    ) -> Result<()> {
        self.check_peer(root)?;
        let api = &self.lib.api;
        self.call_with("ncclReduce", |comm| {
            let (op, _dyn) = self.op_for(comm, red, dtype)?;
            // SAFETY: forwarded from the caller's contract.
            Ok(unsafe {
                (api.reduce)(
                    send.0 as *const c_void,
                    recv.0 as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    op,
                    root as c_int,
                    comm,
                    stream as RawStream,
                )
            })
        })
    }

    /// Sends and receives with every listed peer as one group (`None`:
    /// nothing with that peer): all-to-all(-v), gather, scatter, batches of
    /// point-to-point calls. A group cannot deadlock on its own order.
    ///
    /// # Safety
    /// As [`CclComm::all_reduce`], for every listed (count, address).
    pub unsafe fn exchange(
        &self,
        sends: &[Option<(usize, DevicePtr)>],
        recvs: &[Option<(usize, DevicePtr)>],
        dtype: DType,
        stream: u64,
    ) -> Result<()> {
        // Lists may be longer than the world (fixed-size tables), never name
        // a rank past it.
        let beyond = |l: &[Option<(usize, DevicePtr)>]| l.iter().skip(self.world).any(Option::is_some);
        if beyond(sends) || beyond(recvs) {
            return Err(Error::invalid(format!("a peer past the world of {}", self.world)));
        }
        let api = &self.lib.api;
        self.call_with("ncclGroupEnd", |comm| {
            // SAFETY: no arguments; group state is per thread, and the
            // communicator lock keeps other threads' calls out of the group.
            let r = unsafe { (api.group_start)() };
            if r != NCCL_SUCCESS {
                return Ok(r);
            }
            let mut first_error = NCCL_SUCCESS;
            for (peer, item) in sends.iter().enumerate() {
                if let Some((count, buf)) = item {
                    // SAFETY: forwarded from the caller's contract.
                    let r = unsafe {
                        (api.send)(
                            buf.0 as *const c_void,
                            *count,
                            nccl_dtype(dtype),
                            peer as c_int,
                            comm,
                            stream as RawStream,
                        )
                    };
                    if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS && first_error == NCCL_SUCCESS {
                        first_error = r;
                    }
                }
            }
            for (peer, item) in recvs.iter().enumerate() {
                if let Some((count, buf)) = item {
                    // SAFETY: forwarded from the caller's contract.
                    let r = unsafe {
                        (api.recv)(
                            buf.0 as *mut c_void,
                            *count,
                            nccl_dtype(dtype),
                            peer as c_int,
                            comm,
                            stream as RawStream,
                        )
                    };
                    if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS && first_error == NCCL_SUCCESS {
                        first_error = r;
                    }
                }
            }
            // The group must end whatever happened inside it.
            // SAFETY: ends the group started above on this thread.
            let end = unsafe { (api.group_end)() };
            Ok(if first_error != NCCL_SUCCESS { first_error } else { end })
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
        let captured = self.captured.load(std::sync::atomic::Ordering::Relaxed);
        let finished = healthy
            && !captured
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

    /// The half-precision factor is the one nearest (ties to even) to the
    /// f32 factor the kernels and the host reference scale by, found here
    /// by search: every finite f16 for a few factors, and for bf16 the two
    /// neighbours the f32's upper bits give, over many factors (half's
    /// `bf16::from_f64` rounds about 1 in 20,000 of them otherwise).
    #[test]
    fn half_factors_round_like_the_kernels() {
        fn nearest(x: f32, candidates: impl Iterator<Item = u16>, to_f32: impl Fn(u16) -> f32) -> u16 {
            let mut best: Option<(f64, u16)> = None;
            for bits in candidates {
                let v = to_f32(bits);
                if !v.is_finite() {
                    continue;
                }
                let d = (v as f64 - x as f64).abs();
                let better = match best {
                    None => true,
                    Some((bd, bb)) => d < bd || (d == bd && bits & 1 == 0 && bb & 1 == 1),
                };
                if better {
                    best = Some((d, bits));
                }
            }
            best.map_or(0, |(_, b)| b)
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for k in 0..60_000u64 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            // Positive factors over many binades, with all 52 fraction bits.
            let f = f64::from_bits((state >> 12) | 0x3ff0_0000_0000_0000) * 2f64.powi((k % 30) as i32 - 15);
            let single = f as f32;
            let b = factor_bytes(f, DType::BF16).unwrap();
            let upper = (single.to_bits() >> 16) as u16;
            let want = nearest(single, [upper, upper + 1].into_iter(), |b| {
                half::bf16::from_bits(b).to_f32()
            });
            assert_eq!(u16::from_le_bytes([b[0], b[1]]), want, "bf16 factor of {f:e}");
            if k < 40 {
                let h = factor_bytes(f, DType::F16).unwrap();
                let want = nearest(single, 0..=u16::MAX, |b| half::f16::from_bits(b).to_f32());
                assert_eq!(u16::from_le_bytes([h[0], h[1]]), want, "f16 factor of {f:e}");
            }
        }
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
