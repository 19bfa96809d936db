//! Why a vendor library could not be used: kept by the vendor folders'
//! once-per-process loaders, so every later call gets the same error.

use crate::error::Error;

/// A failed load or initialisation; `Clone` so the one-time check can be replayed.
#[derive(Debug, Clone)]
pub enum LoadFailure {
    /// The library (or a symbol it must export) is not there.
    Missing { library: String, reason: String },
    /// The library loaded and found no device.
    NoDevice(String),
    /// An initialisation call failed.
    Backend { call: &'static str, message: String },
}

impl LoadFailure {
    /// [`LoadFailure::Missing`]: `library` was not found (`searched` says
    /// where), with the candidates that were found but failed to load.
    pub fn missing(library: &str, searched: &str, failed: &[String]) -> LoadFailure {
        let mut reason = searched.to_string();
        if !failed.is_empty() {
            reason.push_str(&format!(" (failed: {})", failed.join("; ")));
        }
        LoadFailure::Missing {
            library: library.into(),
            reason,
        }
    }

    /// The error a caller of `backend` gets.
    pub fn to_error(&self, backend: &'static str) -> Error {
        match self {
            LoadFailure::Missing { library, reason } => Error::LibraryMissing {
                library: library.clone(),
                reason: reason.clone(),
            },
            LoadFailure::NoDevice(reason) => Error::NoDevice {
                backend,
                reason: reason.clone(),
            },
            LoadFailure::Backend { call, message } => Error::Backend {
                backend,
                call,
                message: message.clone(),
            },
        }
    }
}
