//! One error type for the whole crate. Nothing in ferrocomm panics on a missing
//! library, a missing device or bad input: it returns one of these.

use std::time::Duration;

/// Result alias used throughout ferrocomm.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every failure ferrocomm reports, each with enough context to act on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller passed something ferrocomm cannot work with. Nothing was changed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The backend was not compiled into this build.
    #[error("the {backend} backend is not compiled in: rebuild with `--features {feature}`")]
    NotCompiled {
        /// The backend asked for (`cuda`, `hip`).
        backend: &'static str,
        /// The cargo feature that builds it in.
        feature: &'static str,
    },

    /// A shared library that a backend loads at run time could not be found or loaded.
    #[error("could not load {library}: {reason}")]
    LibraryMissing {
        /// The library's file name (`libcuda.so.1`, `libnccl.so.2`, ...).
        library: String,
        /// What the loader said.
        reason: String,
    },

    /// The backend's library loaded, but there is no usable device.
    #[error("no {backend} device: {reason}")]
    NoDevice {
        /// The backend (`cuda`, `hip`).
        backend: &'static str,
        /// Why: no devices, an ordinal past the last one, what the driver said.
        reason: String,
    },

    /// A call into a vendor library failed.
    #[error("{backend} call {call} failed: {message}")]
    Backend {
        /// The library (`cuda`, `hip`, `nccl`, `rccl`, ...).
        backend: &'static str,
        /// The function that failed.
        call: &'static str,
        /// The library's error code and text.
        message: String,
    },

    /// A kernel failed to compile at run time.
    #[error("compiling kernel module {module} for {arch} failed:\n{log}")]
    Compile {
        /// The kernel module's name.
        module: String,
        /// The target (`sm_90`, `gfx942`).
        arch: String,
        /// The compiler's log.
        log: String,
    },

    /// A wait ran past its deadline. `missing` lists the ranks that never arrived, when known.
    #[error("timed out after {after:?} waiting for {what}{}", fmt_missing(.missing))]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long the wait lasted.
        after: Duration,
        /// The ranks that never arrived (empty when unknown).
        missing: Vec<usize>,
    },

    /// Ranks called different collectives (count, dtype, op or algorithm differ).
    #[error("collective mismatch: rank {peer} issued a different collective than rank {rank} ({detail})")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The rank whose call differed.
        peer: usize,
        /// What differed, where it is known.
        detail: String,
    },

    /// The communicator hit an earlier fatal error and refuses further work.
    #[error("communicator aborted after an earlier error: {0}")]
    Aborted(String),

    /// The communicator was finalized; create a new one.
    #[error("communicator already finalized")]
    Finalized,

    /// Bootstrap store failure (connection, authentication, protocol, limits).
    #[error("store: {0}")]
    Store(String),

    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The operation exists in the API but this backend or configuration has no path for it.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

fn fmt_missing(missing: &[usize]) -> String {
    if missing.is_empty() {
        String::new()
    } else {
        format!("; ranks that never arrived: {missing:?}")
    }
}

impl Error {
    /// Wrap an `std::io::Error` with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// True for errors after which the communicator must not be used again.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. } | Error::Mismatch { .. } | Error::Aborted(_) | Error::Backend { .. }
        )
    }
}
