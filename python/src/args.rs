//! Arguments from Python, checked the one way: a bad value is an
//! `InvalidArgument` (a `ValueError`) naming the call.
//!
//! - Plain ones (ranks, counts, offsets, shapes) arrive as `i64` rather
//!   than `usize`, since PyO3 would answer a negative `usize` with an
//!   `OverflowError` that names nothing.
//! - Timeouts: seconds or a `timedelta`, positive.
//! - [`CallOpts`]: the per-call arguments every collective takes, parsed
//!   once and applied to the `ferrocomm::Call` in one place.

use std::collections::BTreeMap;
use std::time::Duration;

use ferrocomm::{Call, Communicator, Error, Work};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt};

use crate::backend::{AnyWork, Backend};
use crate::errors::{detached, to_pyerr, Failure};

/// An `InvalidArgument` (a `ValueError`) saying `msg`.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    to_pyerr(Error::InvalidArgument(msg.into()))
}

/// A count, size or offset: `what` names the call and the argument.
pub fn count_arg(what: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value).map_err(|_| invalid(format!("{what} {value} is negative")))
}

/// A rank of a world of `world` (negative ones are out of range too).
pub fn rank_arg(what: &str, rank: i64, world: usize) -> PyResult<usize> {
    usize::try_from(rank)
        .ok()
        .filter(|r| *r < world)
        .ok_or_else(|| invalid(format!("{what}: rank {rank} is not in a world of {world}")))
}

/// Elements of `shape`: refused if a dimension is negative or the product overflows.
pub fn element_count(what: &str, shape: &[i64]) -> PyResult<usize> {
    shape.iter().try_fold(1usize, |n, &d| {
        usize::try_from(d)
            .ok()
            .and_then(|d| n.checked_mul(d))
            .ok_or_else(|| invalid(format!("{what}: shape {shape:?} is negative or overflows")))
    })
}

/// Seconds from Python as a `Duration`: positive and finite.
pub fn duration(secs: f64) -> PyResult<Duration> {
    if secs.is_finite() && secs > 0.0 {
        Ok(Duration::from_secs_f64(secs))
    } else {
        Err(invalid(format!(
            "timeout {secs} s: expected a positive number of seconds"
        )))
    }
}

/// A timeout from Python: seconds (int or float) or a `datetime.timedelta`.
pub fn duration_of(obj: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let secs = if obj.hasattr("total_seconds")? {
        obj.call_method0("total_seconds")?.extract::<f64>()?
    } else if obj.is_instance_of::<PyFloat>() || (obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>()) {
        obj.extract::<f64>()?
    } else {
        return Err(invalid(format!(
            "timeout {obj}: expected seconds or a datetime.timedelta"
        )));
    };
    duration(secs)
}

/// The per-call arguments of every collective, window operation and EP
/// call: torchcomms' `async_op`, `timeout` and `hints`, and the caller's
/// stream. Python builds one per call (`ferrocomm._call.call_opts`) and
/// passes it as `opts=` (left out: the defaults); it is checked here, once
/// (`CallOpts(...)` in Python runs [`CallOpts::new`]), and applied in one
/// place: [`CallOpts::queue`] makes the `ferrocomm::Call` on the caller's
/// stream, and `PyComm::finish` turns `async_op` into a `Work`, a wait, or
/// memory kept until the work completes.
#[pyclass(frozen, from_py_object, name = "CallOpts", module = "ferrocomm._ferrocomm")]
#[derive(Clone, Default)]
pub struct CallOpts {
    /// Hand back a `Work` rather than waiting (where the call waits).
    pub async_op: bool,
    /// The call's own timeout; `None`: the communicator's.
    pub timeout: Option<Duration>,
    /// Per-call hints (`{"algo": "oneshot-ll"}`).
    hints: BTreeMap<String, String>,
    /// The caller's raw stream (`CUstream` / `hipStream_t`); `None`: the
    /// communicator's own.
    pub stream: Option<u64>,
}

#[pymethods]
impl CallOpts {
    /// `timeout` in seconds (Python's `seconds()` reads timedeltas),
    /// `stream` a raw handle (Python resolves stream objects and current
    /// streams).
    #[new]
    #[pyo3(signature = (*, async_op=false, timeout=None, hints=None, stream=None))]
    fn new(
        async_op: bool,
        timeout: Option<f64>,
        hints: Option<BTreeMap<String, String>>,
        stream: Option<u64>,
    ) -> PyResult<Self> {
        Ok(CallOpts {
            async_op,
            timeout: timeout.map(duration).transpose()?,
            hints: hints.unwrap_or_default(),
            stream,
        })
    }
}

impl CallOpts {
    /// Queue `f` on `c` with these options: the caller's stream borrowed
    /// for the call, the timeout and the hints set. The work, and whether
    /// the stream is capturing a graph. The GIL must be released (see
    /// [`CallOpts::enqueue`]).
    pub fn queue<D: Backend>(
        &self,
        c: &Communicator<D>,
        f: impl for<'s> FnOnce(&Call<'s, D>) -> ferrocomm::Result<Work<D>>,
    ) -> ferrocomm::Result<(AnyWork, bool)> {
        let borrowed = match self.stream {
            // SAFETY: `raw` is the caller's stream of this device (an int they
            // passed, or torch's/CuPy's current stream); the wrapper lives for
            // this call only and never destroys it, and the caller keeps the
            // stream alive while it has work.
            Some(raw) => Some(unsafe { c.device().borrow_stream(raw)? }),
            None => None,
        };
        let capturing = match &borrowed {
            Some(s) => c.device().is_capturing(s)?,
            None => false,
        };
        let mut call = match &borrowed {
            Some(s) => Call::on(s),
            None => Call::new(),
        };
        if let Some(t) = self.timeout {
            call = call.timeout(t);
        }
        for (k, v) in &self.hints {
            call = call.hint(k.as_str(), v.as_str());
        }
        let work = f(&call)?;
        Ok((D::wrap_work(work), capturing))
    }

    /// [`CallOpts::queue`] with the GIL released (and panics caught).
    pub fn enqueue<D: Backend>(
        &self,
        py: Python<'_>,
        c: &Communicator<D>,
        f: impl for<'s> FnOnce(&Call<'s, D>) -> ferrocomm::Result<Work<D>> + Send,
    ) -> Result<(AnyWork, bool), Failure> {
        detached(py, || self.queue(c, f))
    }
}
