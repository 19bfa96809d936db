//! Loading the HIP runtime and hipRTC at run time without panicking, the
//! hand-written table of the entry points this backend calls, turning
//! `hipError_t` codes into [`Error`]s, and the device binding every resource
//! keeps.
//!
//! Only opaque handles, integers and the 64-byte `hipIpcMemHandle_t` cross the
//! boundary: no `hipDeviceProp_t` (its layout changed in ROCm 6.0), and device
//! facts come from `hipDeviceGetAttribute` (enum values unchanged since ROCm
//! 5.0). Both libraries are loaded once per process and never unloaded.
//!
//! Library search, first hit wins:
//! - HIP runtime: `$FERROCOMM_HIP_LIB` (a file); a `libamdhip64.so*` already
//!   loaded into the process (by PyTorch or RCCL, so there is one runtime);
//!   `$ROCM_PATH/lib`, `$HIP_PATH/lib`; the sonames `libamdhip64.so.7`,
//!   `.so.6`, `libamdhip64.so`, `.so.5` on the library search path;
//!   `/opt/rocm/lib`.
//! - hipRTC: `$FERROCOMM_HIPRTC_LIB`; an already loaded `libhiprtc.so*`;
//!   `libhiprtc.so.<runtime major>` next to the runtime, in `$ROCM_PATH/lib`,
//!   `$HIP_PATH/lib` and on the search path; then the other majors; last the
//!   runtime itself (ROCm 5 shipped hipRTC inside libamdhip64).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use libloading::os::unix::{Library as UnixLibrary, RTLD_GLOBAL, RTLD_LAZY, RTLD_NOW};

use crate::backends::gpu::errors::DropErrors;
use crate::backends::gpu::load::LoadFailure;
use crate::error::{Error, Result};

pub(super) const BACKEND: &str = "hip";

// ---- HIP types and constants (ROCm 6.x / 7.x headers; stable since 5.x) ----

pub(super) type HipError = c_int;
pub(super) type HipStream = *mut c_void;
pub(super) type HipEvent = *mut c_void;
pub(super) type HipGraph = *mut c_void;
pub(super) type HipGraphExec = *mut c_void;
pub(super) type HipGraphNode = *mut c_void;
pub(super) type HipModule = *mut c_void;
pub(super) type HipFunction = *mut c_void;
pub(super) type HiprtcProgram = *mut c_void;
pub(super) type HiprtcResult = c_int;

/// `hipIpcMemHandle_t`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IpcMemHandle {
    pub(super) reserved: [u8; IPC_HANDLE_BYTES],
}
pub(super) const IPC_HANDLE_BYTES: usize = 64;
const _: () = assert!(std::mem::size_of::<IpcMemHandle>() == 64);

/// `hipPointerAttribute_t` (the layout of ROCm 5 to 7; the values of its
/// memory type changed in ROCm 6, see [`memory_type`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct PointerAttributes {
    pub(super) memory_type: c_int,
    pub(super) device: c_int,
    pub(super) device_pointer: *mut c_void,
    pub(super) host_pointer: *mut c_void,
    pub(super) is_managed: c_int,
    pub(super) allocation_flags: c_uint,
}

/// `hipMemoryType` values of ROCm 6 and later (CUDA's numbering).
pub(super) mod memory_type {
    pub const UNREGISTERED: i32 = 0;
    pub const HOST: i32 = 1;
    pub const DEVICE: i32 = 2;
    pub const MANAGED: i32 = 3;
}

pub(super) const HIP_SUCCESS: HipError = 0;
pub(super) const HIP_ERROR_INVALID_VALUE: HipError = 1;
pub(super) const HIP_ERROR_DEINITIALIZED: HipError = 4;
pub(super) const HIP_ERROR_INVALID_DEVICE_FUNCTION: HipError = 98;
pub(super) const HIP_ERROR_NO_DEVICE: HipError = 100;
pub(super) const HIP_ERROR_INVALID_DEVICE: HipError = 101;
pub(super) const HIP_ERROR_INVALID_HANDLE: HipError = 400;
pub(super) const HIP_ERROR_ILLEGAL_STATE: HipError = 401;
pub(super) const HIP_ERROR_NOT_FOUND: HipError = 500;
pub(super) const HIP_ERROR_NOT_READY: HipError = 600;
pub(super) const HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED: HipError = 704;
pub(super) const HIP_ERROR_CONTEXT_IS_DESTROYED: HipError = 709;
pub(super) const HIPRTC_SUCCESS: HiprtcResult = 0;

/// `hipDeviceAttribute_t` values (CUDA-compatible block from 0, AMD block from 10000).
pub(super) mod attr {
    pub const CAN_MAP_HOST_MEMORY: i32 = 3;
    pub const COMPUTE_CAPABILITY_MAJOR: i32 = 23;
    pub const COMPUTE_CAPABILITY_MINOR: i32 = 61;
    pub const MULTIPROCESSOR_COUNT: i32 = 63;
    pub const PCI_BUS_ID: i32 = 67;
    pub const PCI_DEVICE_ID: i32 = 68;
    pub const PCI_DOMAIN_ID: i32 = 69;
    pub const WARP_SIZE: i32 = 87;
    pub const WALL_CLOCK_RATE: i32 = 10017;
}

/// `hipExtMallocWithFlags`: uncached device memory (flags and workspaces).
pub(super) const HIP_DEVICE_MALLOC_UNCACHED: c_uint = 0x3;
pub(super) const HIP_HOST_MALLOC_PORTABLE: c_uint = 0x1;
pub(super) const HIP_HOST_MALLOC_MAPPED: c_uint = 0x2;
pub(super) const HIP_HOST_MALLOC_COHERENT: c_uint = 0x4000_0000;
pub(super) const HIP_STREAM_NON_BLOCKING: c_uint = 0x1;
pub(super) const HIP_EVENT_DEFAULT: c_uint = 0x0;
pub(super) const HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 0x1;
pub(super) const HIP_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
pub(super) const HIP_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
pub(super) const HIP_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub(super) const HIP_MEMCPY_HOST_TO_DEVICE: c_int = 1;
pub(super) const HIP_MEMCPY_DEVICE_TO_HOST: c_int = 2;
/// Direction inferred from the pointers (unified addressing): device memory,
/// a peer's mapped memory and host-mapped words alike.
pub(super) const HIP_MEMCPY_DEFAULT: c_int = 4;

/// The first of `names` that `lib` exports, typed as `F`.
///
/// # Safety
/// `F` is the C prototype of every one of `names` (the tables below are
/// checked against the ROCm 6.x/7.x headers), and the symbol is only called
/// through that type.
unsafe fn lookup<F: Copy>(lib: &UnixLibrary, names: &[&str]) -> Option<F> {
    for name in names {
        let c = format!("{name}\0");
        // SAFETY: the caller's contract on `F`.
        if let Ok(s) = unsafe { lib.get::<F>(c.as_bytes()) } {
            return Some(*s);
        }
    }
    None
}

/// Declares a table: one field per entry point, with the exported names
/// tried in order (the first is the current name, later ones older
/// aliases). Entry points under `optional` are `None` on runtimes without them.
macro_rules! api_table {
    (@first $first:literal $(, $rest:literal)*) => { $first };
    ($(#[$meta:meta])* $vis:vis struct $table:ident {
        required { $( $field:ident = [$($sym:literal),+] : fn($($arg:ty),*) $(-> $ret:ty)?; )* }
        $( optional { $( $ofield:ident = [$($osym:literal),+] : fn($($oarg:ty),*) $(-> $oret:ty)?; )* } )?
    }) => {
        $(#[$meta])*
        $vis struct $table {
            $( pub(super) $field: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            $( $( pub(super) $ofield: Option<unsafe extern "C" fn($($oarg),*) $(-> $oret)?>, )* )?
        }

        impl $table {
            /// Resolve every entry point, or name the first required one missing.
            fn resolve(lib: &UnixLibrary) -> std::result::Result<$table, String> {
                Ok($table {
                    $( $field: {
                        let names: &[&str] = &[$($sym),+];
                        // SAFETY: the field's type is the symbol's prototype.
                        unsafe { lookup::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(lib, names) }
                            .ok_or_else(|| format!("it lacks {}", names.join(" / ")))?
                    }, )*
                    $( $( $ofield: {
                        // SAFETY: the field's type is the symbol's prototype.
                        unsafe { lookup::<unsafe extern "C" fn($($oarg),*) $(-> $oret)?>(lib, &[$($osym),+]) }
                    }, )* )?
                })
            }

            /// Every required symbol name of the table (first spellings), for tests.
            #[allow(dead_code)]
            pub(super) const SYMBOLS: &'static [&'static str] = &[$( api_table!(@first $($sym),+) ),*];
        }
    };
}

api_table! {
    /// The HIP runtime entry points this backend calls.
    pub(super) struct Hip {
        required {
            init = ["hipInit"]: fn(c_uint) -> HipError;
            runtime_get_version = ["hipRuntimeGetVersion"]: fn(*mut c_int) -> HipError;
            get_error_name = ["hipGetErrorName"]: fn(HipError) -> *const c_char;
            get_error_string = ["hipGetErrorString"]: fn(HipError) -> *const c_char;
            get_last_error = ["hipGetLastError"]: fn() -> HipError;
            get_device_count = ["hipGetDeviceCount"]: fn(*mut c_int) -> HipError;
            set_device = ["hipSetDevice"]: fn(c_int) -> HipError;
            device_get_attribute = ["hipDeviceGetAttribute"]: fn(*mut c_int, c_int, c_int) -> HipError;
            device_get_name = ["hipDeviceGetName"]: fn(*mut c_char, c_int, c_int) -> HipError;
            device_total_mem = ["hipDeviceTotalMem"]: fn(*mut usize, c_int) -> HipError;
            device_can_access_peer = ["hipDeviceCanAccessPeer"]: fn(*mut c_int, c_int, c_int) -> HipError;
            device_enable_peer_access = ["hipDeviceEnablePeerAccess"]: fn(c_int, c_uint) -> HipError;
            mem_get_info = ["hipMemGetInfo"]: fn(*mut usize, *mut usize) -> HipError;
            malloc = ["hipMalloc"]: fn(*mut *mut c_void, usize) -> HipError;
            ext_malloc_with_flags = ["hipExtMallocWithFlags"]: fn(*mut *mut c_void, usize, c_uint) -> HipError;
            free = ["hipFree"]: fn(*mut c_void) -> HipError;
            host_malloc = ["hipHostMalloc", "hipHostAlloc"]: fn(*mut *mut c_void, usize, c_uint) -> HipError;
            host_free = ["hipHostFree", "hipFreeHost"]: fn(*mut c_void) -> HipError;
            host_get_device_pointer = ["hipHostGetDevicePointer"]: fn(*mut *mut c_void, *mut c_void, c_uint) -> HipError;
            memset_async = ["hipMemsetAsync"]: fn(*mut c_void, c_int, usize, HipStream) -> HipError;
            memcpy_async = ["hipMemcpyAsync"]: fn(*mut c_void, *const c_void, usize, c_int, HipStream) -> HipError;
            ipc_get_mem_handle = ["hipIpcGetMemHandle"]: fn(*mut IpcMemHandle, *mut c_void) -> HipError;
            ipc_open_mem_handle = ["hipIpcOpenMemHandle"]: fn(*mut *mut c_void, IpcMemHandle, c_uint) -> HipError;
            ipc_close_mem_handle = ["hipIpcCloseMemHandle"]: fn(*mut c_void) -> HipError;
            stream_create_with_flags = ["hipStreamCreateWithFlags"]: fn(*mut HipStream, c_uint) -> HipError;
            stream_destroy = ["hipStreamDestroy"]: fn(HipStream) -> HipError;
            stream_synchronize = ["hipStreamSynchronize"]: fn(HipStream) -> HipError;
            stream_wait_event = ["hipStreamWaitEvent"]: fn(HipStream, HipEvent, c_uint) -> HipError;
            stream_begin_capture = ["hipStreamBeginCapture"]: fn(HipStream, c_int) -> HipError;
            stream_end_capture = ["hipStreamEndCapture"]: fn(HipStream, *mut HipGraph) -> HipError;
            stream_is_capturing = ["hipStreamIsCapturing"]: fn(HipStream, *mut c_int) -> HipError;
            event_create_with_flags = ["hipEventCreateWithFlags"]: fn(*mut HipEvent, c_uint) -> HipError;
            event_destroy = ["hipEventDestroy"]: fn(HipEvent) -> HipError;
            event_record = ["hipEventRecord"]: fn(HipEvent, HipStream) -> HipError;
            event_query = ["hipEventQuery"]: fn(HipEvent) -> HipError;
            event_elapsed_time = ["hipEventElapsedTime"]: fn(*mut f32, HipEvent, HipEvent) -> HipError;
            graph_instantiate = ["hipGraphInstantiate"]: fn(*mut HipGraphExec, HipGraph, *mut HipGraphNode, *mut c_char, usize) -> HipError;
            graph_launch = ["hipGraphLaunch"]: fn(HipGraphExec, HipStream) -> HipError;
            graph_exec_destroy = ["hipGraphExecDestroy"]: fn(HipGraphExec) -> HipError;
            graph_destroy = ["hipGraphDestroy"]: fn(HipGraph) -> HipError;
            module_load_data = ["hipModuleLoadData"]: fn(*mut HipModule, *const c_void) -> HipError;
            module_unload = ["hipModuleUnload"]: fn(HipModule) -> HipError;
            module_get_function = ["hipModuleGetFunction"]: fn(*mut HipFunction, HipModule, *const c_char) -> HipError;
            module_launch_kernel = ["hipModuleLaunchKernel"]: fn(HipFunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, HipStream, *mut *mut c_void, *mut *mut c_void) -> HipError;
            mem_get_address_range = ["hipMemGetAddressRange"]: fn(*mut *mut c_void, *mut usize, *mut c_void) -> HipError;
            pointer_get_attributes = ["hipPointerGetAttributes"]: fn(*mut PointerAttributes, *const c_void) -> HipError;
            thread_exchange_stream_capture_mode = ["hipThreadExchangeStreamCaptureMode"]: fn(*mut c_int) -> HipError;
        }
        optional {
            stream_get_device = ["hipStreamGetDevice"]: fn(HipStream, *mut c_int) -> HipError;
        }
    }
}

api_table! {
    /// The hipRTC entry points this backend calls.
    pub(super) struct Hiprtc {
        required {
            version = ["hiprtcVersion"]: fn(*mut c_int, *mut c_int) -> HiprtcResult;
            get_error_string = ["hiprtcGetErrorString"]: fn(HiprtcResult) -> *const c_char;
            create_program = ["hiprtcCreateProgram"]: fn(*mut HiprtcProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> HiprtcResult;
            destroy_program = ["hiprtcDestroyProgram"]: fn(*mut HiprtcProgram) -> HiprtcResult;
            compile_program = ["hiprtcCompileProgram"]: fn(HiprtcProgram, c_int, *const *const c_char) -> HiprtcResult;
            get_program_log_size = ["hiprtcGetProgramLogSize"]: fn(HiprtcProgram, *mut usize) -> HiprtcResult;
            get_program_log = ["hiprtcGetProgramLog"]: fn(HiprtcProgram, *mut c_char) -> HiprtcResult;
            get_code_size = ["hiprtcGetCodeSize"]: fn(HiprtcProgram, *mut usize) -> HiprtcResult;
            get_code = ["hiprtcGetCode"]: fn(HiprtcProgram, *mut c_char) -> HiprtcResult;
        }
    }
}

/// The loaded runtime: its table, where it came from, its version.
pub(super) struct Runtime {
    pub(super) api: Hip,
    pub(super) path: String,
    /// `hipRuntimeGetVersion`: major * 10^7 + minor * 10^5 + patch.
    pub(super) version: i32,
    /// Keeps the library mapped for the life of the process.
    _lib: UnixLibrary,
}

/// The loaded hipRTC.
pub(super) struct Rtc {
    pub(super) api: Hiprtc,
    pub(super) path: String,
    pub(super) version: (i32, i32),
    _lib: UnixLibrary,
}

/// Sonames of the HIP runtime, newest first.
const RUNTIME_SONAMES: &[&str] = &[
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "libamdhip64.so",
    "libamdhip64.so.5",
];
const RTC_MAJORS: &[u32] = &[7, 6];

fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// `$ROCM_PATH/lib`, `$HIP_PATH/lib` (each also `lib64`), then `/opt/rocm/lib`.
fn rocm_lib_dirs(include_default: bool) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["ROCM_PATH", "HIP_PATH"] {
        if let Some(root) = env_path(var) {
            dirs.push(root.join("lib"));
            dirs.push(root.join("lib64"));
        }
    }
    if include_default {
        dirs.push(PathBuf::from("/opt/rocm/lib"));
    }
    dirs
}

/// An already loaded library with one of `names`, without loading anything.
fn already_loaded(names: &[String]) -> Option<(UnixLibrary, String)> {
    for n in names {
        // SAFETY: RTLD_NOLOAD only returns a handle to a library that is
        // already mapped (its initialisers have run); nothing new is loaded.
        if let Ok(lib) = unsafe { UnixLibrary::open(Some(n.as_str()), RTLD_LAZY | libc::RTLD_NOLOAD) } {
            return Some((lib, n.clone()));
        }
    }
    None
}

/// The first candidate that loads, as (library, description); the failures otherwise.
fn open_first(candidates: &[String]) -> std::result::Result<(UnixLibrary, String), Vec<String>> {
    let mut tried = Vec::new();
    for c in candidates {
        let is_path = c.contains('/');
        if is_path && !Path::new(c).exists() {
            continue;
        }
        // SAFETY: loading the vendor runtime runs its (trusted) initialisers.
        // RTLD_GLOBAL so that a later RCCL or hipRTC load resolves to the same
        // runtime instead of mapping a second copy.
        match unsafe { UnixLibrary::open(Some(c.as_str()), RTLD_NOW | RTLD_GLOBAL) } {
            Ok(lib) => return Ok((lib, c.clone())),
            Err(e) => {
                let msg = e.to_string();
                // A bare soname that is simply not installed is not worth reporting.
                if is_path || !msg.contains("No such file") {
                    tried.push(format!("{c}: {msg}"));
                }
            }
        }
    }
    Err(tried)
}

/// The file a loaded library was mapped from, found through one of its symbols.
fn library_file(sym: *const c_void) -> Option<PathBuf> {
    let mut info: libc::Dl_info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables; `info` is a valid out-pointer.
    if unsafe { libc::dladdr(sym, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the loader.
    let s = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    std::fs::canonicalize(&s).ok().or(Some(PathBuf::from(s)))
}

static LIBRARY: OnceLock<std::result::Result<Runtime, LoadFailure>> = OnceLock::new();
static INIT: OnceLock<std::result::Result<(), LoadFailure>> = OnceLock::new();

/// Load the HIP runtime library and resolve its entry points (once per
/// process), without touching any device: enough for hipRTC.
pub(super) fn library() -> Result<&'static Runtime> {
    match LIBRARY.get_or_init(load_runtime) {
        Ok(r) => Ok(r),
        Err(f) => Err(f.to_error(BACKEND)),
    }
}

/// Load the HIP runtime and initialise it (once per process).
///
/// Errors: [`Error::LibraryMissing`] without a usable libamdhip64,
/// [`Error::NoDevice`] when it finds no AMD GPU, [`Error::Backend`] when
/// `hipInit` fails otherwise.
pub(crate) fn runtime() -> Result<&'static Runtime> {
    let rt = library()?;
    INIT.get_or_init(|| init_devices(rt))
        .clone()
        .map_err(|f| f.to_error(BACKEND))?;
    Ok(rt)
}

/// True when the runtime loaded but reported that there is no device.
pub(super) fn runtime_says_no_device() -> bool {
    matches!(INIT.get(), Some(Err(LoadFailure::NoDevice(_))))
}

fn runtime_candidates() -> Vec<String> {
    let mut out = Vec::new();
    if let Some(p) = env_path("FERROCOMM_HIP_LIB") {
        out.push(p.to_string_lossy().into_owned());
    }
    for dir in rocm_lib_dirs(false) {
        for so in RUNTIME_SONAMES {
            out.push(dir.join(so).to_string_lossy().into_owned());
        }
    }
    out.extend(RUNTIME_SONAMES.iter().map(|s| s.to_string()));
    for so in RUNTIME_SONAMES {
        out.push(Path::new("/opt/rocm/lib").join(so).to_string_lossy().into_owned());
    }
    out
}

fn load_runtime() -> std::result::Result<Runtime, LoadFailure> {
    const LIB: &str = "libamdhip64.so";
    let explicit = env_path("FERROCOMM_HIP_LIB").is_some();
    let loaded = if explicit {
        None
    } else {
        already_loaded(&RUNTIME_SONAMES.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    };
    let (lib, origin) = match loaded {
        Some(l) => l,
        None => open_first(&runtime_candidates()).map_err(|tried| {
            LoadFailure::missing(
                LIB,
                "not found in $FERROCOMM_HIP_LIB, $ROCM_PATH/lib, $HIP_PATH/lib, the library search path or \
                 /opt/rocm/lib (is ROCm installed?)",
                &tried,
            )
        })?,
    };
    let api = Hip::resolve(&lib).map_err(|why| LoadFailure::Missing {
        library: origin.clone(),
        reason: format!("{why}: this ROCm is older than ferrocomm needs (ROCm 6.0+)"),
    })?;
    let path = library_file(api.init as *const c_void)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or(origin);
    let mut version = 0;
    // SAFETY: valid out-pointer; no initialisation needed.
    let _ = unsafe { (api.runtime_get_version)(&mut version) };
    Ok(Runtime {
        api,
        path,
        version,
        _lib: lib,
    })
}

fn init_devices(rt: &Runtime) -> std::result::Result<(), LoadFailure> {
    // SAFETY: hipInit takes no pointers. The runtime initialises lazily, and
    // without a GPU (no /dev/kfd, or no agent) answers NoDevice or InvalidDevice.
    let r = unsafe { (rt.api.init)(0) };
    match r {
        HIP_SUCCESS => {}
        HIP_ERROR_NO_DEVICE | HIP_ERROR_INVALID_DEVICE => {
            return Err(LoadFailure::NoDevice(format!(
                "hipInit found no AMD GPU ({}, runtime {} from {})",
                describe_with(&rt.api, r),
                version_string(rt.version),
                rt.path
            )))
        }
        other => {
            return Err(LoadFailure::Backend {
                call: "hipInit",
                message: describe_with(&rt.api, other),
            })
        }
    }
    let mut n = 0;
    // SAFETY: valid out-pointer; the runtime is initialised.
    match unsafe { (rt.api.get_device_count)(&mut n) } {
        HIP_SUCCESS if n > 0 => Ok(()),
        HIP_SUCCESS | HIP_ERROR_NO_DEVICE | HIP_ERROR_INVALID_DEVICE => Err(LoadFailure::NoDevice(format!(
            "hipGetDeviceCount found no AMD GPU (runtime {} from {})",
            version_string(rt.version),
            rt.path
        ))),
        other => Err(LoadFailure::Backend {
            call: "hipGetDeviceCount",
            message: describe_with(&rt.api, other),
        }),
    }
}

/// `6.4.1` from `hipRuntimeGetVersion`'s number.
pub(super) fn version_string(v: i32) -> String {
    if v <= 0 {
        return "unknown".into();
    }
    format!("{}.{}.{}", v / 10_000_000, (v / 100_000) % 100, v % 100_000)
}

static RTC: OnceLock<std::result::Result<Rtc, LoadFailure>> = OnceLock::new();

/// Load hipRTC (once per process). Needs the runtime library, not a device.
pub(crate) fn rtc() -> Result<&'static Rtc> {
    let rt = library()?;
    match RTC.get_or_init(|| init_rtc(rt)) {
        Ok(r) => Ok(r),
        Err(f) => Err(f.to_error(BACKEND)),
    }
}

fn rtc_candidates(rt: &Runtime) -> Vec<String> {
    let major = (rt.version / 10_000_000).max(0) as u32;
    let mut majors: Vec<u32> = vec![major];
    majors.extend(RTC_MAJORS.iter().copied().filter(|&m| m != major));
    let mut names: Vec<String> = majors.iter().map(|m| format!("libhiprtc.so.{m}")).collect();
    names.push("libhiprtc.so".into());
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = Path::new(&rt.path).parent() {
        dirs.push(d.to_path_buf());
    }
    dirs.extend(rocm_lib_dirs(true));
    let mut out = Vec::new();
    if let Some(p) = env_path("FERROCOMM_HIPRTC_LIB") {
        out.push(p.to_string_lossy().into_owned());
    }
    for d in &dirs {
        for n in &names {
            out.push(d.join(n).to_string_lossy().into_owned());
        }
    }
    out.extend(names);
    out
}

fn init_rtc(rt: &Runtime) -> std::result::Result<Rtc, LoadFailure> {
    const LIB: &str = "libhiprtc.so";
    let explicit = env_path("FERROCOMM_HIPRTC_LIB").is_some();
    let loaded = if explicit {
        None
    } else {
        let names: Vec<String> = RTC_MAJORS
            .iter()
            .map(|m| format!("libhiprtc.so.{m}"))
            .chain(std::iter::once("libhiprtc.so".to_string()))
            .collect();
        already_loaded(&names)
    };
    let mut errors = Vec::new();
    let found = match loaded {
        Some(l) => Some(l),
        None => match open_first(&rtc_candidates(rt)) {
            Ok(l) => Some(l),
            Err(tried) => {
                errors = tried;
                None
            }
        },
    };
    let (lib, origin) = match found {
        Some(l) => l,
        None if !explicit => {
            // ROCm 5 shipped hipRTC inside the runtime.
            // SAFETY: the runtime is already loaded; this only takes another handle to it.
            match unsafe { UnixLibrary::open(Some(rt.path.as_str()), RTLD_NOW | RTLD_GLOBAL) } {
                Ok(l) if Hiprtc::resolve(&l).is_ok() => (l, rt.path.clone()),
                _ => {
                    return Err(LoadFailure::missing(
                        LIB,
                        "not found next to the HIP runtime, in $FERROCOMM_HIPRTC_LIB, $ROCM_PATH/lib, \
                         $HIP_PATH/lib, /opt/rocm/lib or on the library search path",
                        &errors,
                    ))
                }
            }
        }
        None => {
            return Err(LoadFailure::Missing {
                library: LIB.into(),
                reason: format!("$FERROCOMM_HIPRTC_LIB does not load: {}", errors.join("; ")),
            })
        }
    };
    let api = Hiprtc::resolve(&lib).map_err(|why| LoadFailure::Missing {
        library: origin.clone(),
        reason: why,
    })?;
    let path = library_file(api.version as *const c_void)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or(origin);
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    let r = unsafe { (api.version)(&mut major, &mut minor) };
    if r != HIPRTC_SUCCESS {
        return Err(LoadFailure::Backend {
            call: "hiprtcVersion",
            message: format!("hiprtcResult {r}"),
        });
    }
    Ok(Rtc {
        api,
        path,
        version: (major, minor),
        _lib: lib,
    })
}

/// `hipErrorX: description` for a result code, through the given table.
fn describe_with(api: &Hip, r: HipError) -> String {
    // SAFETY: both return pointers to static strings (or null for unknown codes).
    let (name, text) = unsafe { ((api.get_error_name)(r), (api.get_error_string)(r)) };
    // SAFETY: non-null results point at NUL-terminated static strings.
    let s = |p: *const c_char| (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
    match (s(name), s(text)) {
        (Some(n), Some(t)) if n != t => format!("{n}: {t}"),
        (Some(n), _) => format!("{n} ({r})"),
        _ => format!("hipError_t {r}"),
    }
}

/// `hipErrorX: description` for a result code.
pub(super) fn describe(r: HipError) -> String {
    match LIBRARY.get() {
        Some(Ok(rt)) => describe_with(&rt.api, r),
        _ => format!("hipError_t {r}"),
    }
}

/// Clear the thread's sticky HIP error after a failure this backend handled
/// (reported as an [`Error`] or expected, like "not ready"), so an engine's
/// own `hipGetLastError` check does not trip over it later.
pub(super) fn clear_last_error() {
    if let Some(Ok(rt)) = LIBRARY.get() {
        // SAFETY: no arguments.
        let _ = unsafe { (rt.api.get_last_error)() };
    }
}

/// [`Error::Backend`] for a failed call.
pub(super) fn error(call: &'static str, r: HipError) -> Error {
    clear_last_error();
    Error::Backend {
        backend: BACKEND,
        call,
        message: describe(r),
    }
}

/// Turn a result into `Ok(())` or [`Error::Backend`] naming the call.
pub(super) fn check(call: &'static str, r: HipError) -> Result<()> {
    if r == HIP_SUCCESS {
        Ok(())
    } else {
        Err(error(call, r))
    }
}

/// Release failures of the HIP backend in this process.
pub(super) static DROP_ERRORS: DropErrors = DropErrors::new();

/// A release's result, with a runtime that is already shutting down
/// (process exit) counted as success.
pub(super) fn teardown(call: &'static str, r: HipError) -> Result<()> {
    if r == HIP_ERROR_DEINITIALIZED || r == HIP_ERROR_CONTEXT_IS_DESTROYED {
        clear_last_error();
        return Ok(());
    }
    check(call, r)
}

/// One device, as every resource made on it remembers it: HIP keeps the
/// current device per thread, so each call first makes this one current.
pub struct DeviceCtx {
    pub(super) ordinal: usize,
    hip: &'static Hip,
    version: i32,
}

impl DeviceCtx {
    pub(super) fn new(ordinal: usize, rt: &'static Runtime) -> Arc<DeviceCtx> {
        Arc::new(DeviceCtx {
            ordinal,
            hip: &rt.api,
            version: rt.version,
        })
    }

    /// `hipRuntimeGetVersion`'s number.
    pub(super) fn runtime_version(&self) -> i32 {
        self.version
    }

    /// The runtime's entry points.
    pub(super) fn hip(&self) -> &'static Hip {
        self.hip
    }

    /// Make this device current on the calling thread.
    pub(super) fn bind(&self) -> Result<()> {
        // SAFETY: plain integer argument.
        check("hipSetDevice", unsafe { (self.hip.set_device)(self.ordinal as c_int) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_print_like_rocm() {
        assert_eq!(version_string(60_443_483), "6.4.43483");
        assert_eq!(version_string(70_051_831), "7.0.51831");
        assert_eq!(version_string(0), "unknown");
    }

    #[test]
    fn tables_list_their_symbols() {
        assert!(Hip::SYMBOLS.contains(&"hipModuleLaunchKernel"));
        assert!(Hip::SYMBOLS.contains(&"hipHostMalloc"));
        assert_eq!(Hiprtc::SYMBOLS.len(), 9);
        assert!(Hip::SYMBOLS.contains(&"hipPointerGetAttributes"));
        assert!(
            !Hip::SYMBOLS.contains(&"hipStreamGetDevice"),
            "optional: ROCm 5 lacks it"
        );
        assert_eq!(std::mem::size_of::<PointerAttributes>(), 32);
        // No struct-returning property query: only attributes.
        assert!(!Hip::SYMBOLS.iter().any(|s| s.contains("Properties")));
    }

    #[test]
    fn candidates_honour_rocm_path_and_end_with_sonames() {
        let c = runtime_candidates();
        assert!(c.iter().any(|s| s == "libamdhip64.so.6"));
        assert!(c.iter().any(|s| s == "libamdhip64.so.7"));
        assert!(c.last().is_some_and(|s| s.starts_with("/opt/rocm/lib/")));
    }
}
