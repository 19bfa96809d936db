//! `Broadcaster`: the metadata broadcaster (`ferrocomm::Broadcaster`) behind
//! `ferrocomm.Broadcaster` (`ferrocomm/_broadcaster.py` adds timeouts as
//! `timedelta` and any bytes-like payload). The writer rank sends bytes,
//! the others receive them, in order; pickling is the caller's.
//!
//! Sends and receives run with the GIL released, and look for Python
//! signals every few milliseconds while they wait (Ctrl-C ends a wait).
//! What never changes is kept beside the broadcaster, so that reading it
//! never waits for the lock a blocked receive holds (with the GIL held,
//! that would keep the receive from checking for signals).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrocomm::{Broadcaster, BroadcasterOptions, Error};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;

use crate::args::{duration, invalid};
use crate::backend::{with_any, AnyComm};
use crate::errors::{run, run_interruptible, stash};
use crate::work::lock;

/// A broadcaster (`Communicator.broadcaster`).
#[pyclass(frozen, name = "Broadcaster", module = "ferrocomm._ferrocomm")]
pub struct PyBroadcaster {
    /// `None` once closed.
    inner: Mutex<Option<Broadcaster>>,
    messages: AtomicU64,
    name: String,
    rank: usize,
    size: usize,
    writer: usize,
    max_bytes: usize,
    slots: usize,
    uses_ring: bool,
}

/// Make a broadcaster on `comm` (collective; waits up to the
/// communicator's timeout for every rank, interruptible).
pub fn create(
    py: Python<'_>,
    comm: &Arc<AnyComm>,
    max_bytes: i64,
    writer: i64,
    slots: Option<i64>,
) -> PyResult<PyBroadcaster> {
    let max_bytes =
        usize::try_from(max_bytes).map_err(|_| invalid(format!("broadcaster: max_bytes {max_bytes} is negative")))?;
    let writer = usize::try_from(writer).map_err(|_| invalid(format!("broadcaster: writer {writer} is negative")))?;
    let mut opts = BroadcasterOptions::new(max_bytes).with_writer(writer);
    if let Some(s) = slots {
        opts = opts.with_slots(usize::try_from(s).map_err(|_| invalid(format!("broadcaster: slots {s} is negative")))?);
    }
    let comm = comm.clone();
    let bc = run_interruptible(py, move || with_any!(&*comm, AnyComm, |c| c.broadcaster_with(&opts)))?;
    Ok(PyBroadcaster {
        messages: AtomicU64::new(0),
        name: bc.name().to_string(),
        rank: bc.rank(),
        size: bc.size(),
        writer: bc.writer(),
        max_bytes: bc.max_bytes(),
        slots: bc.slots(),
        uses_ring: bc.uses_ring(),
        inner: Mutex::new(Some(bc)),
    })
}

/// The interrupt hook of a wait: a pending Python signal (Ctrl-C) ends it,
/// and is what the call raises.
fn python_signals() -> ferrocomm::Result<()> {
    Python::attach(|py| py.check_signals()).map_err(|e| {
        stash(e);
        Error::Aborted("interrupted by a Python signal".into())
    })
}

fn timeout_arg(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    timeout.map(duration).transpose()
}

impl PyBroadcaster {
    /// Run `f` on the open broadcaster with the GIL released.
    fn with_open<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Broadcaster) -> ferrocomm::Result<T> + Send,
    ) -> PyResult<T> {
        let name = &self.name;
        let (inner, messages) = (&self.inner, &self.messages);
        run(py, || {
            let mut guard = lock(inner);
            let bc = guard
                .as_mut()
                .ok_or_else(|| Error::invalid(format!("broadcaster {name} is closed")))?;
            let out = f(bc);
            messages.store(bc.messages(), Ordering::Relaxed);
            out
        })
    }
}

#[pymethods]
impl PyBroadcaster {
    /// Send `data` (bytes or bytearray) to every reader; writer only.
    #[pyo3(signature = (data, timeout=None))]
    fn send(&self, py: Python<'_>, data: PyBackedBytes, timeout: Option<f64>) -> PyResult<()> {
        let timeout = timeout_arg(timeout)?;
        self.with_open(py, |bc| bc.send_interruptible(&data, timeout, &mut python_signals))
    }

    /// The next message, as bytes; readers only.
    #[pyo3(signature = (timeout=None))]
    fn recv<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyBytes>> {
        let timeout = timeout_arg(timeout)?;
        let got = self.with_open(py, |bc| {
            let mut out = Vec::new();
            bc.recv_interruptible(&mut out, timeout, &mut python_signals)?;
            Ok(out)
        })?;
        Ok(PyBytes::new(py, &got))
    }

    /// Close this rank's end (also when the object is collected): readers
    /// of a closed writer get what it sent, then an error; a writer with a
    /// closed reader gets an error naming it.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        run(py, || {
            drop(lock(inner).take());
            Ok(())
        })
    }

    #[getter]
    fn closed(&self) -> bool {
        // A receive in progress holds the lock: the broadcaster is open then.
        self.inner.try_lock().map(|g| g.is_none()).unwrap_or(false)
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// The rank that sends.
    #[getter]
    fn writer(&self) -> usize {
        self.writer
    }

    #[getter]
    fn is_writer(&self) -> bool {
        self.rank == self.writer
    }

    /// Bytes of a ring slot: larger messages go through the socket.
    #[getter]
    fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    #[getter]
    fn slots(&self) -> usize {
        self.slots
    }

    /// Messages sent (writer) or received (reader) so far.
    #[getter]
    fn messages(&self) -> u64 {
        self.messages.load(Ordering::Relaxed)
    }

    /// Whether this rank uses the shared-memory ring (the writer with
    /// readers on its node, or a reader on the writer's node).
    #[getter]
    fn uses_ring(&self) -> bool {
        self.uses_ring
    }

    fn __repr__(&self) -> String {
        let role = if self.rank == self.writer { "writer" } else { "reader" };
        format!(
            "<ferrocomm.Broadcaster {} rank {} of {} ({role}, writer {}), slots of {} bytes, ring {}>",
            self.name, self.rank, self.size, self.writer, self.max_bytes, self.uses_ring
        )
    }
}
