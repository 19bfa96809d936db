//! The NCCL-API library: which vendor serves it, loading it once per path,
//! and turning its result codes into ferrocomm errors.

use std::collections::HashMap;
use std::ffi::{c_int, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use super::ffi::{self, Api, NcclResult, RawComm, NCCL_SUCCESS};
use super::lock;
use crate::error::{Error, Result};

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
    pub(super) flavor: CclFlavor,
    path: PathBuf,
    pub(super) version: i32,
    pub(super) api: Api,
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
    #[cfg(any(test, feature = "testing"))]
    pub fn supports_nonblocking_init(&self) -> bool {
        self.api.comm_init_rank_config.is_some()
    }

    pub(super) fn result_string(&self, r: NcclResult) -> String {
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

    pub(super) fn error(&self, call: &'static str, r: NcclResult, comm: RawComm) -> Error {
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
