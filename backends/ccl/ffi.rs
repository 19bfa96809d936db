//! The slice of NCCL's C API (`nccl.h`) that ferrocomm calls, as a table of
//! function pointers resolved from a library loaded at run time. RCCL exports
//! the same names with the same signatures and the same enum values.
//!
//! C enums (`ncclResult_t`, `ncclDataType_t`, `ncclRedOp_t`) are passed and
//! returned as `c_int`, never as Rust enums, so an unexpected value from the
//! library cannot be undefined behaviour.

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::error::{Error, Result};

pub(super) type NcclResult = c_int;
/// `ncclComm_t`: an opaque pointer.
pub(super) type RawComm = *mut c_void;
/// `cudaStream_t` / `hipStream_t`.
pub(super) type RawStream = *mut c_void;

pub(super) const NCCL_SUCCESS: NcclResult = 0;
pub(super) const NCCL_IN_PROGRESS: NcclResult = 7;

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: 128 opaque bytes, passed by value to `ncclCommInitRank*`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct UniqueId {
    pub(super) internal: [u8; UNIQUE_ID_BYTES],
}

/// `NCCL_CONFIG_UNDEF_INT`.
const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_API_MAGIC`, the `magic` of `NCCL_CONFIG_INITIALIZER`.
const CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// The config layout below is NCCL 2.17's; newer libraries read `size` bytes
/// of it and default every later field (they check `version`).
const CONFIG_VERSION: c_uint = 2 * 10000 + 17 * 100;

/// The leading fields of `ncclConfig_t` (NCCL >= 2.17, RCCL likewise), which
/// every later version keeps in place.
#[repr(C)]
pub(super) struct Config {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking` set.
    pub(super) fn new(blocking: bool) -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: blocking as c_int,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
        }
    }
}

/// `ncclDataType_t` values (identical in NCCL and RCCL).
pub(super) mod dtype {
    use std::ffi::c_int;
    pub const INT8: c_int = 0;
    pub const UINT8: c_int = 1;
    pub const INT32: c_int = 2;
    pub const INT64: c_int = 4;
    pub const FLOAT16: c_int = 6;
    pub const FLOAT32: c_int = 7;
    pub const FLOAT64: c_int = 8;
    pub const BFLOAT16: c_int = 9;
    /// `ncclFloat8e4m3` and `ncclFloat8e5m2` (NCCL 2.24+; data movement only here).
    pub const FLOAT8E4M3: c_int = 10;
    pub const FLOAT8E5M2: c_int = 11;
}

/// `ncclRedOp_t` values. Note max = 2 and min = 3 (ferrocomm's order differs).
pub(super) mod redop {
    use std::ffi::c_int;
    pub const SUM: c_int = 0;
    pub const PROD: c_int = 1;
    pub const MAX: c_int = 2;
    pub const MIN: c_int = 3;
    pub const AVG: c_int = 4;
}

type FnGetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type FnGetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type FnCommInitRank = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
type FnCommInitRankConfig = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut Config) -> NcclResult;
type FnComm = unsafe extern "C" fn(RawComm) -> NcclResult;
type FnCommGetAsyncError = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
type FnGetErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type FnGetLastError = unsafe extern "C" fn(RawComm) -> *const c_char;
type FnAllReduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnBroadcast =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnReduceScatter =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnAllGather = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> NcclResult;
type FnSend = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnRecv = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnGroup = unsafe extern "C" fn() -> NcclResult;
type FnReduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnRedOpCreatePreMulSum = unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, c_int, RawComm) -> NcclResult;
type FnRedOpDestroy = unsafe extern "C" fn(c_int, RawComm) -> NcclResult;

/// `ncclScalarResidence_t`: where premul_sum's factor lives.
pub(super) const SCALAR_DEVICE: c_int = 0;
pub(super) const SCALAR_HOST_IMMEDIATE: c_int = 1;

/// Resolved entry points. Optional ones are absent from older libraries.
pub(super) struct Api {
    pub(super) get_version: FnGetVersion,
    pub(super) get_unique_id: FnGetUniqueId,
    pub(super) comm_init_rank: FnCommInitRank,
    /// NCCL >= 2.14.
    pub(super) comm_init_rank_config: Option<FnCommInitRankConfig>,
    /// NCCL >= 2.14.
    pub(super) comm_finalize: Option<FnComm>,
    pub(super) comm_destroy: FnComm,
    pub(super) comm_abort: FnComm,
    pub(super) comm_get_async_error: FnCommGetAsyncError,
    pub(super) get_error_string: FnGetErrorString,
    /// NCCL >= 2.13.
    pub(super) get_last_error: Option<FnGetLastError>,
    pub(super) all_reduce: FnAllReduce,
    pub(super) broadcast: FnBroadcast,
    pub(super) reduce_scatter: FnReduceScatter,
    pub(super) all_gather: FnAllGather,
    pub(super) send: FnSend,
    pub(super) recv: FnRecv,
    pub(super) group_start: FnGroup,
    pub(super) group_end: FnGroup,
    pub(super) reduce: FnReduce,
    /// NCCL >= 2.11 (premul_sum).
    pub(super) red_op_create_premul_sum: Option<FnRedOpCreatePreMulSum>,
    pub(super) red_op_destroy: Option<FnRedOpDestroy>,
}

/// Copy a function pointer of type `T` out of `lib`.
///
/// # Safety
/// `T` must be the exact C signature of `name` in the loaded library.
unsafe fn sym<T: Copy>(lib: &libloading::Library, library: &str, name: &str) -> Result<T> {
    // SAFETY: forwarded from the caller (signature); the pointer is copied out
    // and stays valid as long as the library stays loaded (it never unloads).
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| Error::LibraryMissing {
            library: library.to_string(),
            reason: format!("it lacks {name}: {e}"),
        })
}

/// Like [`sym`], `None` when the symbol is absent.
///
/// # Safety
/// As for [`sym`].
unsafe fn sym_opt<T: Copy>(lib: &libloading::Library, name: &str) -> Option<T> {
    // SAFETY: forwarded from the caller.
    unsafe { lib.get::<T>(name.as_bytes()) }.ok().map(|s| *s)
}

impl Api {
    /// Resolve every entry point from `lib` (named `library` in errors).
    pub(super) fn resolve(lib: &libloading::Library, library: &str) -> Result<Api> {
        // SAFETY: each type alias above is the exact C prototype from nccl.h
        // (2.14 and later; RCCL exports the same).
        unsafe {
            Ok(Api {
                get_version: sym(lib, library, "ncclGetVersion")?,
                get_unique_id: sym(lib, library, "ncclGetUniqueId")?,
                comm_init_rank: sym(lib, library, "ncclCommInitRank")?,
                comm_init_rank_config: sym_opt(lib, "ncclCommInitRankConfig"),
                comm_finalize: sym_opt(lib, "ncclCommFinalize"),
                comm_destroy: sym(lib, library, "ncclCommDestroy")?,
                comm_abort: sym(lib, library, "ncclCommAbort")?,
                comm_get_async_error: sym(lib, library, "ncclCommGetAsyncError")?,
                get_error_string: sym(lib, library, "ncclGetErrorString")?,
                get_last_error: sym_opt(lib, "ncclGetLastError"),
                all_reduce: sym(lib, library, "ncclAllReduce")?,
                broadcast: sym(lib, library, "ncclBroadcast")?,
                reduce_scatter: sym(lib, library, "ncclReduceScatter")?,
                all_gather: sym(lib, library, "ncclAllGather")?,
                send: sym(lib, library, "ncclSend")?,
                recv: sym(lib, library, "ncclRecv")?,
                group_start: sym(lib, library, "ncclGroupStart")?,
                group_end: sym(lib, library, "ncclGroupEnd")?,
                reduce: sym(lib, library, "ncclReduce")?,
                red_op_create_premul_sum: sym_opt(lib, "ncclRedOpCreatePreMulSum"),
                red_op_destroy: sym_opt(lib, "ncclRedOpDestroy"),
            })
        }
    }
}

/// Symbolic name of an `ncclResult_t`.
pub(super) fn result_name(r: NcclResult) -> &'static str {
    match r {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "ncclResult(unknown)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_prefix_matches_nccl_2_17_layout() {
        // size_t size; uint magic; uint version; int blocking, cgaClusterSize,
        // minCTAs, maxCTAs; const char* netName; int splitShare (+ padding).
        assert_eq!(std::mem::offset_of!(Config, blocking), 16);
        assert_eq!(std::mem::offset_of!(Config, net_name), 32);
        assert_eq!(std::mem::offset_of!(Config, split_share), 40);
        assert_eq!(std::mem::size_of::<Config>(), 48);
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
        let c = Config::new(false);
        assert_eq!((c.magic, c.version, c.blocking), (0xcafebeef, 21700, 0));
    }
}
