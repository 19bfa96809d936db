//! ferrocomm errors as Python exceptions, and the one way Rust work is run
//! from Python: with the GIL released and panics caught (a panic must not
//! cross the FFI boundary, and must not take the interpreter down).
//!
//! The exception classes live in `ferrocomm/_errors.py`, so they can inherit
//! from Python's own (`InvalidArgument` is a `ValueError`, `CommTimeout` a
//! `TimeoutError`); each error carries the Rust error's text, its kind, and
//! the details the Rust error has (missing ranks, the mismatching peer).

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use ferrocomm::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

thread_local! {
    /// A Python exception raised inside a store callback (KeyboardInterrupt
    /// while waiting, an error of the store object): the Rust error it
    /// turned into is replaced by it when the call returns to Python.
    static PENDING: RefCell<Option<PyErr>> = const { RefCell::new(None) };
}

/// Remember `e` to be raised instead of the Rust error it causes.
pub fn stash(e: PyErr) {
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        if p.is_none() {
            *p = Some(e);
        }
    });
}

fn take_pending() -> Option<PyErr> {
    PENDING.with(|p| p.borrow_mut().take())
}

/// Why a Rust call failed.
pub enum Failure {
    Rust(Error),
    Panic(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Rust(e)
    }
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> PyErr {
        match f {
            Failure::Rust(e) => to_pyerr(e),
            Failure::Panic(msg) => make(
                "InternalError",
                &format!("ferrocomm bug: a panic in Rust: {msg}"),
                |_| Ok(()),
            ),
        }
    }
}

/// Run `f` with the GIL released, catching panics.
pub fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> ferrocomm::Result<T> + Send) -> Result<T, Failure> {
    take_pending();
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Failure::Rust(e)),
        Err(panic) => Err(Failure::Panic(panic_text(panic.as_ref()))),
    }
}

/// [`detached`], with the failure as a Python exception.
pub fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> ferrocomm::Result<T> + Send) -> PyResult<T> {
    detached(py, f).map_err(PyErr::from)
}

/// Run `f` on a thread of its own and wait for it with the GIL released,
/// checking for signals every 100 ms: communicator creation waits for every
/// rank (up to the rendezvous timeout), and Ctrl-C must end that wait. On a
/// signal the Python exception is raised at once; the creation goes on in
/// the background until its own timeout, and what it made is dropped.
pub fn run_interruptible<T: Send + 'static>(
    py: Python<'_>,
    f: impl FnOnce() -> ferrocomm::Result<T> + Send + 'static,
) -> PyResult<T> {
    use std::sync::mpsc::{channel, RecvTimeoutError};
    take_pending();
    let (tx, rx) = channel();
    std::thread::Builder::new()
        .name("ferrocomm-create".into())
        .spawn(move || {
            let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
        })
        .map_err(|e| to_pyerr(Error::io("starting the communicator creation thread", e)))?;
    let mut rx = Some(rx);
    loop {
        // The receiver travels into the detached closure and back (it is
        // Send, not Sync).
        let (got, back) = match rx.take() {
            Some(r) => py.detach(move || (r.recv_timeout(std::time::Duration::from_millis(100)), r)),
            None => return Err(Failure::Panic("creation receiver lost".into()).into()),
        };
        rx = Some(back);
        match got {
            Ok(Ok(Ok(v))) => return Ok(v),
            Ok(Ok(Err(e))) => return Err(to_pyerr(e)),
            Ok(Err(panic)) => return Err(Failure::Panic(panic_text(panic.as_ref())).into()),
            Err(RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(Failure::Panic("the creation thread ended without an answer".into()).into())
            }
        }
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// The exception class (in `ferrocomm._errors`) of a Rust error.
fn class_of(e: &Error) -> &'static str {
    match e {
        Error::InvalidArgument(_) => "InvalidArgument",
        Error::NotCompiled { .. } => "NotCompiled",
        Error::LibraryMissing { .. } => "LibraryMissing",
        Error::NoDevice { .. } => "NoDevice",
        Error::Backend { .. } => "BackendError",
        Error::Compile { .. } => "CompileError",
        Error::Timeout { .. } => "CommTimeout",
        Error::Mismatch { .. } => "Mismatch",
        Error::Aborted(_) => "Aborted",
        Error::Finalized => "Finalized",
        Error::Store(_) => "StoreError",
        Error::Io { .. } => "FerrocommOSError",
        Error::Unsupported(_) => "Unsupported",
        _ => "FerrocommError",
    }
}

/// The Python exception for a ferrocomm error (or the Python exception that
/// caused it, when a store callback raised one).
pub fn to_pyerr(e: Error) -> PyErr {
    if let Some(p) = take_pending() {
        return p;
    }
    let text = e.to_string();
    make(class_of(&e), &text, |inst| {
        match &e {
            Error::Timeout { after, missing, .. } => {
                inst.setattr("missing", missing.clone())?;
                inst.setattr("after", after.as_secs_f64())?;
            }
            Error::Mismatch { rank, peer, .. } => {
                inst.setattr("rank", *rank)?;
                inst.setattr("peer", *peer)?;
            }
            Error::LibraryMissing { library, .. } => inst.setattr("library", library.as_str())?,
            _ => {}
        }
        Ok(())
    })
}

/// Instantiate `ferrocomm._errors.<class>(text)` and let `fill` add details;
/// a RuntimeError with the text if the class cannot be had.
fn make(class: &str, text: &str, fill: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<()>) -> PyErr {
    Python::attach(|py| {
        let built = (|| -> PyResult<PyErr> {
            let cls = py.import("ferrocomm._errors")?.getattr(class)?;
            let inst = cls.call1(PyTuple::new(py, [text])?)?;
            fill(&inst)?;
            Ok(PyErr::from_value(inst))
        })();
        built.unwrap_or_else(|_| PyRuntimeError::new_err(format!("{class}: {text}")))
    })
}
