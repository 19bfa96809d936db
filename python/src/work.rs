//! `Work`: a queued collective as Python sees it, and the memory it uses.
//!
//! A collective reads and writes the caller's tensors after the call
//! returns (on the stream, or on the host backend's worker thread). The
//! tensors' owners ([`Owner`]) therefore stay with the work ([`Pending`])
//! until it has completed: in the `Work` while Python holds it, in the
//! communicator's list of outstanding work once Python dropped it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrocomm::Error;
use pyo3::prelude::*;

use crate::backend::{with_any, AnyComm, AnyWork};
use crate::dlpack::Owner;
use crate::errors::{detached, to_pyerr, Failure};

/// A queued collective and the owners of the memory it uses (`work` first:
/// fields drop in order, and the owners must go last).
pub struct Pending {
    /// `None` when the enqueue failed part way: the memory is then kept
    /// until the communicator goes, since no event says when it is free.
    pub work: Option<AnyWork>,
    pub owners: Vec<Owner>,
}

impl Pending {
    pub fn is_completed(&self) -> bool {
        match &self.work {
            Some(w) => with_any!(w, AnyWork, |w| w.is_completed()),
            None => false,
        }
    }
}

impl Pending {
    /// The error of completed work, if it failed (a peer that never came,
    /// a mismatch); ferrocomm aborts the communicator as it reports it.
    pub fn failure(&self) -> Option<Error> {
        let w = self.work.as_ref()?;
        with_any!(w, AnyWork, |w| w.wait(Some(Duration::ZERO))).err()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // The memory must outlive the collective that uses it. The wait is
        // bounded by the call's timeout (a dead peer aborts the work).
        if let Some(w) = &self.work {
            if !self.is_completed() {
                let _ = with_any!(w, AnyWork, |w| w.wait(None));
            }
        }
    }
}

/// Work whose `Work` object Python let go before it completed.
pub type Outstanding = Arc<Mutex<Vec<Pending>>>;

pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A collective queued with `async_op=True`.
#[pyclass(frozen, name = "Work", module = "ferrocomm._ferrocomm")]
pub struct PyWork {
    pending: Option<Pending>,
    comm: Arc<AnyComm>,
    outstanding: Outstanding,
    call_timeout: Duration,
    what: &'static str,
}

impl PyWork {
    pub fn new(
        pending: Pending,
        comm: Arc<AnyComm>,
        outstanding: Outstanding,
        call_timeout: Duration,
        what: &'static str,
    ) -> Self {
        PyWork {
            pending: Some(pending),
            comm,
            outstanding,
            call_timeout,
            what,
        }
    }
}

impl Drop for PyWork {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            if !p.is_completed() {
                lock(&self.outstanding).push(p);
            }
        }
    }
}

#[pymethods]
impl PyWork {
    /// Block until the collective has completed (its result is then in the
    /// output tensors). `timeout` (seconds or a `timedelta`): give up with `CommTimeout`
    /// after it and leave the communicator usable; `None` waits as long as
    /// the call's timeout (plus a grace period) and aborts the communicator
    /// if that passes. Interruptible with Ctrl-C.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let limit = timeout.map(crate::args::duration_of).transpose()?;
        if let Some(p) = &self.pending {
            if let Some(w) = &p.work {
                wait(py, w, &self.comm, limit, self.call_timeout, self.what)?;
            }
        }
        Ok(true)
    }

    /// Whether the collective has finished (successfully or not: `wait`
    /// says which). Work captured into a CUDA graph is complete at once.
    fn is_completed(&self) -> bool {
        self.pending.as_ref().is_none_or(Pending::is_completed)
    }

    /// The collective's name (`all_reduce`, ...).
    #[getter]
    fn name(&self) -> &'static str {
        self.what
    }

    fn __repr__(&self) -> String {
        format!("<ferrocomm.Work {} completed={}>", self.what, self.is_completed())
    }
}

/// Wait for `work` in short slices with the GIL released, checking for
/// signals between them (Ctrl-C ends a wait for a peer that never comes).
///
/// `limit` is the caller's; `None` means the call's timeout plus the grace
/// that `ferrocomm::Work::wait` gives kernels to report the missing ranks,
/// after which the communicator is aborted, as `Work::wait(None)` does.
pub fn wait(
    py: Python<'_>,
    work: &AnyWork,
    comm: &AnyComm,
    limit: Option<Duration>,
    call_timeout: Duration,
    what: &str,
) -> PyResult<()> {
    let grace = (call_timeout / 4).clamp(Duration::from_millis(500), Duration::from_secs(30));
    let total = limit.unwrap_or(call_timeout + grace);
    // Shorter than the call's timeout, so one slice running out never aborts.
    let slice = (call_timeout / 2).clamp(Duration::from_millis(1), Duration::from_millis(50));
    let start = Instant::now();
    loop {
        let step = total.saturating_sub(start.elapsed()).min(slice);
        match detached(py, || with_any!(work, AnyWork, |w| w.wait(Some(step)))) {
            Ok(()) => return Ok(()),
            Err(Failure::Rust(Error::Timeout { .. })) => {
                if with_any!(work, AnyWork, |w| w.is_completed()) {
                    // It ended (or failed) just now: its own answer.
                    return Ok(detached(py, || {
                        with_any!(work, AnyWork, |w| w.wait(Some(Duration::ZERO)))
                    })?);
                }
            }
            Err(f) => return Err(f.into()),
        }
        if start.elapsed() >= total {
            let err = Error::Timeout {
                what: format!("{what} to complete"),
                after: total,
                missing: Vec::new(),
            };
            if limit.is_none() {
                // As ferrocomm's own wait: past the call's timeout the
                // communicator is aborted, so nothing stays stuck on it.
                let _ = with_any!(comm, AnyComm, |c| c.abort());
            }
            return Err(to_pyerr(err));
        }
        py.check_signals()?;
    }
}
