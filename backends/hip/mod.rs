//! The HIP (ROCm) backend. Built with `--features rocm`; it loads the HIP
//! runtime at run time, so it builds with no ROCm installed.
//!
//! Status: the device implementation lands with the ROCm issue; until then
//! opening a device reports that clearly instead of failing at build time.

use crate::error::{Error, Result};

/// A HIP device (not implemented yet).
pub struct HipDevice {
    _private: (),
}

impl HipDevice {
    /// Always an error for now: the HIP device implementation is not written yet.
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(Error::Unsupported(
            "the HIP backend is compiled in but its device implementation is not written yet".into(),
        ))
    }
}
