//! Loading the CUDA driver and NVRTC without panicking, turning `CUresult`
//! codes into [`Error`]s, and the retained primary context every resource of a
//! device keeps alive.
//!
//! cudarc's dynamically loaded wrappers panic when the library or one of its
//! symbols is missing, so nothing here calls into cudarc before [`driver`] (or
//! [`nvrtc`]) has checked that the library loads and that every symbol this
//! backend uses is exported. Both checks run once per process.

use std::ffi::{c_void, CStr};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc_sys;

use crate::backends::gpu::errors::DropErrors;
use crate::backends::gpu::load::LoadFailure;
use crate::error::{Error, Result};

pub(super) const BACKEND: &str = "cuda";

/// The driver's soname, for messages.
const LIBCUDA: &str = "libcuda.so.1";
/// The NVRTC this build looks for (cudarc is built with `cuda-13000`).
const LIBNVRTC: &str = "libnvrtc.so.13";

/// Every driver entry point this backend calls, spelled as cudarc loads them.
/// `tests` below checks that each `sys::cu*` call in this backend is listed.
pub(super) const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxEnablePeerAccess",
    "cuThreadExchangeStreamCaptureMode",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemRetainAllocationHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemGetAddressRange_v2",
    "cuPointerGetAttribute",
    "cuPointerGetAttributes",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemFreeHost",
    "cuMemsetD8Async",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamGetCtx",
    "cuStreamWaitEvent",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuStreamIsCapturing",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventElapsedTime_v2",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuFuncLoad",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
];

/// NVRTC entry points this backend needs.
pub(super) const NVRTC_SYMBOLS: &[&str] = &[
    "nvrtcVersion",
    "nvrtcGetErrorString",
    "nvrtcCreateProgram",
    "nvrtcDestroyProgram",
    "nvrtcCompileProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
];

/// NVRTC entry points used when present (to pick a target NVRTC can build).
pub(super) const NVRTC_OPTIONAL_SYMBOLS: &[&str] = &["nvrtcGetNumSupportedArchs", "nvrtcGetSupportedArchs"];

static DRIVER: OnceLock<Result<(), LoadFailure>> = OnceLock::new();

/// Load libcuda, check its symbols and run `cuInit` (once per process).
///
/// Errors: [`Error::LibraryMissing`] without a usable driver library,
/// [`Error::NoDevice`] when `cuInit` finds no device, [`Error::Backend`] when
/// `cuInit` fails otherwise.
pub(crate) fn driver() -> Result<()> {
    DRIVER.get_or_init(init_driver).clone().map_err(|f| f.to_error(BACKEND))
}

/// True when the driver loaded but reported that there is no device.
pub(super) fn driver_says_no_device() -> bool {
    matches!(DRIVER.get(), Some(Err(LoadFailure::NoDevice(_))))
}

fn init_driver() -> Result<(), LoadFailure> {
    // SAFETY: only tries `dlopen` on cudarc's candidate names; never panics.
    if !unsafe { sys::is_culib_present() } {
        return Err(LoadFailure::Missing {
            library: LIBCUDA.into(),
            reason: "not found on the library search path (is the NVIDIA driver installed?)".into(),
        });
    }
    // SAFETY: the library is present, so `culib` finds it instead of panicking.
    let lib = unsafe { sys::culib() };
    for name in DRIVER_SYMBOLS {
        // SAFETY: looking a symbol up, typed as an opaque pointer we never call.
        if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
            return Err(LoadFailure::Missing {
                library: LIBCUDA.into(),
                reason: format!("it lacks {name}: the driver is older than this build needs (CUDA 13.0, driver 580+)"),
            });
        }
    }
    // SAFETY: cuInit takes no pointers; every symbol was checked above.
    let r = unsafe { sys::cuInit(0) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_NO_DEVICE => Err(LoadFailure::NoDevice("cuInit found no CUDA device".into())),
        other => Err(LoadFailure::Backend {
            call: "cuInit",
            message: describe(other),
        }),
    }
}

/// NVRTC libraries loaded by absolute path and kept for the life of the
/// process, so that cudarc's `dlopen("libnvrtc.so.13")` finds them by soname.
static NVRTC_PRELOADED: OnceLock<Vec<libloading::Library>> = OnceLock::new();
static NVRTC: OnceLock<Result<(i32, i32), LoadFailure>> = OnceLock::new();

/// Load NVRTC (once per process) and return its version `(major, minor)`.
///
/// cudarc only tries bare library names. When none loads, this preloads
/// `libnvrtc.so.13` from `$FERROCOMM_NVRTC_LIB` or `$FERROCOMM_NVRTC_PATH` (a file), or from
/// `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64` and
/// `/usr/local/cuda-13*/lib64`, then tries again.
pub(crate) fn nvrtc() -> Result<(i32, i32)> {
    NVRTC.get_or_init(init_nvrtc).clone().map_err(|f| f.to_error(BACKEND))
}

fn nvrtc_candidates() -> Vec<std::path::PathBuf> {
    use std::path::PathBuf;
    let mut out = Vec::new();
    // FERROCOMM_NVRTC_LIB is the name ci/check-kernels-cuda.sh and the HIP
    // backend's FERROCOMM_HIPRTC_LIB use; FERROCOMM_NVRTC_PATH the older one.
    for var in ["FERROCOMM_NVRTC_LIB", "FERROCOMM_NVRTC_PATH"] {
        if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            out.push(PathBuf::from(p));
        }
    }
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(dir) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            out.push(PathBuf::from(&dir).join("lib64").join(LIBNVRTC));
            out.push(PathBuf::from(&dir).join("lib").join(LIBNVRTC));
        }
    }
    for dir in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda-13/lib64",
        "/usr/local/cuda-13.0/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
    ] {
        out.push(std::path::Path::new(dir).join(LIBNVRTC));
    }
    out
}

fn init_nvrtc() -> Result<(i32, i32), LoadFailure> {
    // SAFETY: only tries `dlopen` on cudarc's candidate names; never panics.
    let mut present = unsafe { nvrtc_sys::is_culib_present() };
    let mut tried = Vec::new();
    if !present {
        let mut loaded = Vec::new();
        for path in nvrtc_candidates() {
            if !path.is_file() {
                continue;
            }
            // SAFETY: loading NVRTC runs its (trusted, vendor) initialisers only.
            match unsafe { libloading::Library::new(&path) } {
                Ok(lib) => {
                    loaded.push(lib);
                    break;
                }
                Err(e) => tried.push(format!("{}: {e}", path.display())),
            }
        }
        if !loaded.is_empty() {
            let _ = NVRTC_PRELOADED.set(loaded);
            // SAFETY: as above.
            present = unsafe { nvrtc_sys::is_culib_present() };
        }
    }
    if !present {
        return Err(LoadFailure::missing(
            LIBNVRTC,
            "not found on the library search path, in $FERROCOMM_NVRTC_LIB, $CUDA_HOME/lib64 or /usr/local/cuda/lib64",
            &tried,
        ));
    }
    // SAFETY: the library is present, so `culib` finds it instead of panicking.
    let lib = unsafe { nvrtc_sys::culib() };
    for name in NVRTC_SYMBOLS {
        // SAFETY: looking a symbol up, typed as an opaque pointer we never call.
        if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
            return Err(LoadFailure::Missing {
                library: LIBNVRTC.into(),
                reason: format!("it lacks {name}"),
            });
        }
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; the symbol was checked above.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(LoadFailure::Backend {
            call: "nvrtcVersion",
            message: nvrtc_describe(r),
        });
    }
    Ok((major, minor))
}

/// Whether an optional NVRTC symbol exists (only after [`nvrtc`] succeeded).
pub(super) fn nvrtc_has(name: &str) -> bool {
    if nvrtc().is_err() {
        return false;
    }
    // SAFETY: NVRTC is present (checked by `nvrtc`), so `culib` does not panic;
    // the symbol is only looked up, never called here.
    unsafe { nvrtc_sys::culib().get::<*const c_void>(name.as_bytes()).is_ok() }
}

/// `CUDA_ERROR_X: description` for a driver result code.
pub(super) fn describe(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: out-pointers are valid; the driver returns pointers to static
    // strings or leaves them null for unknown codes (checked below).
    unsafe {
        let _ = sys::cuGetErrorName(r, &mut name);
        let _ = sys::cuGetErrorString(r, &mut text);
    }
    // SAFETY: non-null results point at NUL-terminated static strings.
    let s = |p: *const std::ffi::c_char| {
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    match (s(name), s(text)) {
        (Some(n), Some(t)) => format!("{n}: {t}"),
        (Some(n), None) => n,
        _ => format!("CUresult {}", r as i64),
    }
}

/// `NVRTC_ERROR_X` text for an NVRTC result code.
pub(super) fn nvrtc_describe(r: nvrtc_sys::nvrtcResult) -> String {
    // SAFETY: returns a pointer to a static string (or null).
    let p = unsafe { nvrtc_sys::nvrtcGetErrorString(r) };
    if p.is_null() {
        format!("nvrtcResult {}", r as i64)
    } else {
        // SAFETY: non-null, NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// [`Error::Backend`] for a failed driver call.
pub(super) fn error(call: &'static str, r: sys::CUresult) -> Error {
    Error::Backend {
        backend: BACKEND,
        call,
        message: describe(r),
    }
}

/// Turn a driver result into `Ok(())` or [`Error::Backend`] naming the call.
pub(super) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(error(call, r))
    }
}

/// Release failures of the CUDA backend in this process.
pub(super) static DROP_ERRORS: DropErrors = DropErrors::new();

/// A release's result, with a driver that is already shutting down (process
/// exit) counted as success.
pub(super) fn teardown(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_ERROR_DEINITIALIZED {
        return Ok(());
    }
    check(call, r)
}

/// A device's retained primary context. Every resource of the device holds an
/// `Arc` of it, so the context outlives whatever was created in it.
pub struct Context {
    raw: sys::CUcontext,
    pub(super) dev: sys::CUdevice,
    pub(super) ordinal: usize,
    /// The device takes programmatic dependent launches (compute capability
    /// 9.0 and up): decided once here, so a launch asking for one where the
    /// device cannot is a plain launch (see `LaunchConfig::dependent`).
    pub(super) programmatic: bool,
}

// SAFETY: a CUcontext is a driver handle usable from any thread (the driver is
// thread-safe); we never dereference it.
unsafe impl Send for Context {}
// SAFETY: as above; shared use only passes the handle to the driver.
unsafe impl Sync for Context {}

impl Context {
    /// Retain `dev`'s primary context; `programmatic`: the device takes
    /// programmatic dependent launches.
    pub(super) fn retain(dev: sys::CUdevice, ordinal: usize, programmatic: bool) -> Result<Arc<Context>> {
        let mut raw: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `dev` came from cuDeviceGet.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw, dev)
        })?;
        Ok(Arc::new(Context {
            raw,
            dev,
            ordinal,
            programmatic,
        }))
    }

    /// Make this context current on the calling thread.
    pub(super) fn bind(&self) -> Result<()> {
        // SAFETY: `raw` is a retained, live context.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })
    }

    /// The context handle as an integer (equal for the same context).
    pub(super) fn id(&self) -> u64 {
        self.raw as usize as u64
    }

    /// The context handle, for calls that name a context.
    pub(super) fn raw(&self) -> sys::CUcontext {
        self.raw
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `Context::retain`; every resource made
        // in this context held an Arc of it and is gone.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        DROP_ERRORS.record(teardown("cuDevicePrimaryCtxRelease", r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `sys::cu*` / `nvrtc_sys::nvrtc*` call in this backend must be in the
    /// symbol lists, or a driver that lacks it would make cudarc panic.
    #[test]
    fn symbol_lists_cover_every_call() {
        let sources = [
            include_str!("driver.rs"),
            include_str!("table.rs"),
            include_str!("ipc.rs"),
            include_str!("rtc.rs"),
            include_str!("mod.rs"),
        ];
        let mut missing = Vec::new();
        for src in sources {
            for (prefix, list) in [("sys::cu", DRIVER_SYMBOLS), ("nvrtc_sys::nvrtc", NVRTC_SYMBOLS)] {
                for (i, _) in src.match_indices(prefix) {
                    let start = i + prefix.len() - if prefix.ends_with("cu") { 2 } else { 5 };
                    let name: String = src[start..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    // Only calls count (a name followed by an opening parenthesis).
                    if name.len() <= 4 || !src[start + name.len()..].starts_with('(') {
                        continue;
                    }
                    let known = list.contains(&name.as_str())
                        || NVRTC_OPTIONAL_SYMBOLS.contains(&name.as_str())
                        || name == "is_culib_present"
                        || name == "culib";
                    if !known {
                        missing.push(name);
                    }
                }
            }
        }
        assert!(missing.is_empty(), "calls not in the symbol lists: {missing:?}");
    }
}
