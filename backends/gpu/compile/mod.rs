//! Kernels compiled lazily, in parallel, one kernel per compile unit: the
//! queue and the worker pool, the process's image cache (compile once per
//! process) and the disk cache (compile once per machine).

pub mod disk;
pub mod images;
pub mod pool;
pub mod queue;

use std::ffi::{c_char, CString};

use super::vendor::CompileTarget;
use crate::error::{Error, Result};

impl CompileTarget {
    /// [`Error::Compile`] for `unit` on this target.
    pub fn error(&self, unit: &str, log: String) -> Error {
        Error::Compile {
            module: unit.to_string(),
            arch: self.arch.clone(),
            log,
        }
    }
}

/// A compile's inputs as the C strings the run-time compilers take.
pub struct CInputs {
    pub source: CString,
    /// The program's name (`collectives_fc_oneshot_f32_sum.cu`), in the compiler's messages.
    pub name: CString,
    pub options: Vec<CString>,
}

impl CInputs {
    pub fn new(target: &CompileTarget, unit: &str, extension: &str, source: &str) -> Result<CInputs> {
        let fail = |why: &str| target.error(unit, why.to_string());
        Ok(CInputs {
            source: CString::new(source).map_err(|_| fail("the source contains a NUL byte"))?,
            name: CString::new(format!("{}.{extension}", disk::sanitize(unit))).map_err(|_| fail("bad unit name"))?,
            options: target
                .options
                .iter()
                .map(|o| CString::new(o.as_str()))
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| fail("an option contains a NUL byte"))?,
        })
    }

    /// Pointers to the options, valid while `self` lives.
    pub fn option_ptrs(&self) -> Vec<*const c_char> {
        self.options.iter().map(|o| o.as_ptr()).collect()
    }
}
