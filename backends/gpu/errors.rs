//! Errors the GPU layer keeps: release failures in `Drop` (counted and
//! logged once, never panicking) and results shared by several waiters (a
//! compile error every rank that wanted the kernel gets).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Release failures of one vendor, in this process.
#[derive(Debug, Default)]
pub struct DropErrors {
    count: AtomicU64,
    logged: AtomicBool,
}

impl DropErrors {
    pub const fn new() -> DropErrors {
        DropErrors {
            count: AtomicU64::new(0),
            logged: AtomicBool::new(false),
        }
    }

    /// Record a failed release: counted always, logged once per process.
    pub fn record(&self, result: Result<()>) {
        let Err(e) = result else {
            return;
        };
        self.count.fetch_add(1, Ordering::Relaxed);
        if !self.logged.swap(true, Ordering::Relaxed) {
            crate::fc_log!(
                tracing::Level::ERROR,
                "{e} while releasing a resource (later release errors are only counted)"
            );
        }
    }

    /// How many releases have failed.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// A copy of `e` for the second and later waiters of a shared result. The
/// variants a compile or a load can produce keep their kind; anything else
/// keeps its text.
pub fn clone_error(e: &Error) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(m.clone()),
        Error::NotCompiled { backend, feature } => Error::NotCompiled { backend, feature },
        Error::LibraryMissing { library, reason } => Error::LibraryMissing {
            library: library.clone(),
            reason: reason.clone(),
        },
        Error::NoDevice { backend, reason } => Error::NoDevice {
            backend,
            reason: reason.clone(),
        },
        Error::Backend { backend, call, message } => Error::Backend {
            backend,
            call,
            message: message.clone(),
        },
        Error::Compile { module, arch, log } => Error::Compile {
            module: module.clone(),
            arch: arch.clone(),
            log: log.clone(),
        },
        Error::Timeout { what, after, missing } => Error::Timeout {
            what: what.clone(),
            after: *after,
            missing: missing.clone(),
        },
        Error::Unsupported(m) => Error::Unsupported(m.clone()),
        Error::Io { context, source } => Error::Io {
            context: context.clone(),
            source: std::io::Error::new(source.kind(), source.to_string()),
        },
        other => Error::Aborted(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_errors_count_failures_only() {
        let d = DropErrors::new();
        d.record(Ok(()));
        assert_eq!(d.count(), 0);
        d.record(Err(Error::invalid("x")));
        d.record(Err(Error::invalid("y")));
        assert_eq!(d.count(), 2);
    }

    #[test]
    fn cloned_errors_keep_their_kind() {
        let e = Error::Compile {
            module: "m".into(),
            arch: "sm_90".into(),
            log: "boom".into(),
        };
        assert!(matches!(clone_error(&e), Error::Compile { ref log, .. } if log == "boom"));
        let e = Error::LibraryMissing {
            library: "libnvrtc.so.13".into(),
            reason: "absent".into(),
        };
        assert_eq!(clone_error(&e).to_string(), e.to_string());
        assert!(matches!(clone_error(&Error::Finalized), Error::Aborted(_)));
    }
}
