//! A ferrocomm [`Store`] over a Python store object: torch.distributed's
//! `Store` (TCPStore, FileStore, PrefixStore, ...) or anything with the same
//! methods (`set`, `get`, `add`, `check`, `delete_key`, `wait`). That is how
//! ferrocomm joins a job that already has a torch.distributed group, with
//! no second launcher and no second rendezvous.
//!
//! Every method attaches to the interpreter for the call; the communicator
//! calls them from threads that released the GIL. Waits are cut into short
//! slices so that Ctrl-C (a signal Python only sees between slices) stops a
//! rendezvous that waits for a rank that never comes.

use std::time::{Duration, Instant};

use ferrocomm::bootstrap::Store;
use ferrocomm::{Error, Result};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// The longest a single `wait` on the Python store lasts before the signal check.
const SLICE: Duration = Duration::from_millis(250);

pub struct PyStore {
    obj: Py<PyAny>,
}

impl PyStore {
    pub fn new(obj: Py<PyAny>) -> Self {
        PyStore { obj }
    }
}

/// A Python exception from the store: kept to be re-raised as itself, and
/// a Rust error for ferrocomm's own handling meanwhile.
fn failed(py: Python<'_>, what: &str, key: &str, e: PyErr) -> Error {
    let text = format!("{what}({key:?}) on the Python store failed: {e}");
    let _ = py;
    crate::errors::stash(e);
    Error::Store(text)
}

fn timedelta(py: Python<'_>, d: Duration) -> PyResult<Bound<'_, PyAny>> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("seconds", d.as_secs_f64())?;
    py.import("datetime")?.getattr("timedelta")?.call((), Some(&kwargs))
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        Python::attach(|py| {
            self.obj
                .call_method1(py, "set", (key, PyBytes::new(py, value)))
                .map(drop)
                .map_err(|e| failed(py, "set", key, e))
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let start = Instant::now();
        loop {
            let present = Python::attach(|py| -> Result<bool> {
                // Signals first: a wait that never ends must stay interruptible.
                py.check_signals().map_err(|e| failed(py, "get", key, e))?;
                let left = timeout.saturating_sub(start.elapsed());
                let keys = PyList::new(py, [key]).map_err(|e| failed(py, "get", key, e))?;
                let slice = timedelta(py, left.min(SLICE).max(Duration::from_millis(1)))
                    .map_err(|e| failed(py, "get", key, e))?;
                match self.obj.call_method1(py, "wait", (keys.clone(), slice)) {
                    Ok(_) => Ok(true),
                    // torch raises on a wait that times out; whether the key is
                    // there now tells a timeout from a broken store.
                    Err(e) => match self.obj.call_method1(py, "check", (keys,)) {
                        Ok(v) if v.extract::<bool>(py).unwrap_or(false) => Ok(true),
                        Ok(_) if is_timeout(py, &e) => Ok(false),
                        Ok(_) => Err(failed(py, "wait", key, e)),
                        Err(e2) => Err(failed(py, "check", key, e2)),
                    },
                }
            })?;
            if present {
                return Python::attach(|py| {
                    let v = self
                        .obj
                        .call_method1(py, "get", (key,))
                        .map_err(|e| failed(py, "get", key, e))?;
                    v.extract::<Vec<u8>>(py).map_err(|e| failed(py, "get", key, e))
                });
            }
            if start.elapsed() >= timeout {
                return Err(Error::Timeout {
                    what: format!("key {key:?} in the Python store"),
                    after: timeout,
                    missing: Vec::new(),
                });
            }
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        Python::attach(|py| {
            self.obj
                .call_method1(py, "add", (key, delta))
                .and_then(|v| v.extract::<i64>(py))
                .map_err(|e| failed(py, "add", key, e))
        })
    }

    fn check(&self, key: &str) -> Result<bool> {
        Python::attach(|py| {
            let keys = PyList::new(py, [key]).map_err(|e| failed(py, "check", key, e))?;
            self.obj
                .call_method1(py, "check", (keys,))
                .and_then(|v| v.extract::<bool>(py))
                .map_err(|e| failed(py, "check", key, e))
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Python::attach(|py| match self.obj.call_method1(py, "delete_key", (key,)) {
            Ok(v) => Ok(v.extract::<bool>(py).unwrap_or(true)),
            // Some stores cannot delete (torch's HashStore before 2.x, custom
            // ones); ferrocomm only deletes to tidy up, so that is no failure.
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyNotImplementedError>(py) => Ok(false),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => Ok(false),
            Err(e) => Err(failed(py, "delete_key", key, e)),
        })
    }
}

/// Whether a store's exception is its wait timing out (torch raises
/// `DistStoreError` / `RuntimeError` with "timeout" in the text, Python
/// stores a `TimeoutError`).
fn is_timeout(py: Python<'_>, e: &PyErr) -> bool {
    e.is_instance_of::<pyo3::exceptions::PyTimeoutError>(py)
        || e.to_string().to_lowercase().contains("timeout")
        || e.to_string().to_lowercase().contains("timed out")
}
