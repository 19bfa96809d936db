//! The overlap operations (`ferrocomm::ChunkedAllGather`,
//! `ferrocomm::ChunkedReduceScatter`) as Python sees them:
//! `ChunkedAllGather(comm, output)` with `start`, `wait_chunk`, `wait_all`
//! and `free`; `ChunkedReduceScatter(comm, chunk_count, dtype)` with
//! `put_chunk`, `finish` and `free`. `ferrocomm.ops` builds the fused
//! GEMM operations on them.
//!
//! Every method queues on its `opts` stream and returns (no `Work`): the
//! operations are ordered by the caller's streams alone (see the Rust
//! docs). Tensors passed to `start`, `put_chunk` and `finish` are read or
//! written when the stream runs: the caller keeps them alive until then.
//! The object is locked only with the GIL released, as `PyWindow` is.

use std::sync::Mutex;

#[cfg(feature = "cuda")]
use ferrocomm::backends::cuda::CudaDevice;
#[cfg(feature = "rocm")]
use ferrocomm::backends::hip::HipDevice;
use ferrocomm::backends::host::HostDevice;
use ferrocomm::device::Device;
use ferrocomm::{Call, ChunkedAllGather, ChunkedReduceScatter, Communicator, DType, Error, ReduceOp, Tensor};
use pyo3::prelude::*;

use crate::args::{count_arg, rank_arg, CallOpts};
use crate::backend::AnyComm;
use crate::comm::PyComm;
use crate::dlpack::{Imported, Owner};
use crate::errors::{detached, run, to_pyerr};
use crate::export::ensure_open;
use crate::heap::PyHeapTensor;
use crate::work::lock;

enum AnyAg {
    Host(ChunkedAllGather<HostDevice>),
    #[cfg(feature = "cuda")]
    Cuda(ChunkedAllGather<CudaDevice>),
    #[cfg(feature = "rocm")]
    Hip(ChunkedAllGather<HipDevice>),
}

enum AnyRs {
    Host(ChunkedReduceScatter<HostDevice>),
    #[cfg(feature = "cuda")]
    Cuda(ChunkedReduceScatter<CudaDevice>),
    #[cfg(feature = "rocm")]
    Hip(ChunkedReduceScatter<HipDevice>),
}

/// Make `$kind::Variant(...)` from the communicator's backend.
macro_rules! make_any {
    ($comm:expr, $kind:ident, |$c:ident| $body:expr) => {
        match $comm {
            AnyComm::Host($c) => $body.map($kind::Host),
            #[cfg(feature = "cuda")]
            AnyComm::Cuda($c) => $body.map($kind::Cuda),
            #[cfg(feature = "rocm")]
            AnyComm::Hip($c) => $body.map($kind::Hip),
        }
    };
}

/// Run `$body` on the object with its communicator (the same backend:
/// the object was made on it).
macro_rules! with_pair {
    ($comm:expr, $obj:expr, $kind:ident, |$c:ident, $o:ident| $body:expr) => {
        match ($comm, $obj) {
            (AnyComm::Host($c), $kind::Host($o)) => $body,
            #[cfg(feature = "cuda")]
            (AnyComm::Cuda($c), $kind::Cuda($o)) => $body,
            #[cfg(feature = "rocm")]
            (AnyComm::Hip($c), $kind::Hip($o)) => $body,
            #[allow(unreachable_patterns)]
            _ => Err(Error::invalid(
                "an overlap object of one backend on a communicator of another",
            )),
        }
    };
}

/// Run `f` with the `Call` of `opts`: the caller's stream borrowed for it,
/// and the call's timeout.
fn with_call<D: Device, T>(
    c: &Communicator<D>,
    opts: &CallOpts,
    f: impl for<'s> FnOnce(&Call<'s, D>) -> ferrocomm::Result<T>,
) -> ferrocomm::Result<T> {
    let borrowed = match opts.stream {
        // SAFETY: `raw` is the caller's stream of this device (torch's
        // current stream or one it passed); the wrapper lives for this call
        // only and never destroys it.
        Some(raw) => Some(unsafe { c.device().borrow_stream(raw)? }),
        None => None,
    };
    let mut call = match &borrowed {
        Some(s) => Call::on(s),
        None => Call::new(),
    };
    if let Some(t) = opts.timeout {
        call = call.timeout(t);
    }
    f(&call)
}

/// A tensor argument (a heap tensor, or any DLPack / array-interface
/// object of the communicator's device), taken for a call on `opts`'
/// stream: a torch tensor on torch's current stream is read straight from
/// torch; others go through DLPack, which orders that stream after the
/// producer's.
fn import(
    parent: &Py<PyComm>,
    obj: &Bound<'_, PyAny>,
    writes: bool,
    what: &str,
    opts: &CallOpts,
) -> PyResult<Imported> {
    match obj.cast::<PyHeapTensor>() {
        Ok(h) => h.get().lend(obj),
        Err(_) => parent.get().batch(opts.clone()).import_checked(obj, writes, what),
    }
}

/// A chunked all-gather into `output` (`world` shards in rank order, the
/// same size on every rank): collective to create and to free.
#[pyclass(frozen, name = "ChunkedAllGather", module = "ferrocomm._ferrocomm")]
pub struct PyChunkedAllGather {
    parent: Py<PyComm>,
    obj: Mutex<Option<AnyAg>>,
    /// Keeps the output (the window's buffer) alive; let go by `free`.
    output: Mutex<Option<Owner>>,
    shard: usize,
}

impl PyChunkedAllGather {
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&AnyComm, &mut AnyAg) -> ferrocomm::Result<T> + Send,
    ) -> PyResult<T> {
        with_live(py, &self.parent, &self.obj, "chunked all-gather", what, f)
    }
}

#[pymethods]
impl PyChunkedAllGather {
    #[new]
    fn new(py: Python<'_>, comm: Py<PyComm>, output: &Bound<'_, PyAny>) -> PyResult<Self> {
        let (any, lender) = comm.get().parts();
        ensure_open(lender, "chunked all-gather")?;
        let imp = import(&comm, output, true, "chunked all-gather output", &CallOpts::default())?;
        let t = imp.tensor();
        let any = &**any;
        let (obj, shard) = run(py, || {
            let o = make_any!(any, AnyAg, |c| ChunkedAllGather::new(c, t))?;
            let world = ferrocomm_world(any);
            Ok((o, t.count() / world.max(1)))
        })?;
        Ok(PyChunkedAllGather {
            parent: comm,
            obj: Mutex::new(Some(obj)),
            output: Mutex::new(Some(imp.owner)),
            shard,
        })
    }

    /// Elements of one shard (the input of `start`).
    #[getter]
    fn shard_count(&self) -> usize {
        self.shard
    }

    /// Queue one all-gather of `input` (one shard) on the `opts` stream:
    /// "ready" to every peer, the own shard copied and signalled, then a
    /// put and a "landed" signal per peer (after its "ready").
    #[pyo3(signature = (input, *, opts=CallOpts::default()))]
    fn start(&self, py: Python<'_>, input: &Bound<'_, PyAny>, opts: CallOpts) -> PyResult<()> {
        let imp = import(&self.parent, input, false, "chunked all-gather input", &opts)?;
        let t = imp.tensor();
        self.with(py, "start", |comm, o| {
            with_pair!(comm, o, AnyAg, |c, o| with_call(c, &opts, |call| o.start(t, call)))
        })
    }

    /// Make the `opts` stream wait until chunk `chunk` (rank `chunk`'s
    /// shard) has landed; once per chunk and call.
    #[pyo3(signature = (chunk, *, opts=CallOpts::default()))]
    fn wait_chunk(&self, py: Python<'_>, chunk: i64, opts: CallOpts) -> PyResult<()> {
        let world = self.parent.get().parts().0.as_ref();
        let chunk = rank_arg("chunked all-gather wait_chunk", chunk, ferrocomm_world(world))?;
        self.with(py, "wait_chunk", |comm, o| {
            with_pair!(comm, o, AnyAg, |c, o| with_call(c, &opts, |call| o
                .wait_chunk(chunk, call)))
        })
    }

    /// `wait_chunk` for every chunk not waited for yet in this call.
    #[pyo3(signature = (*, opts=CallOpts::default()))]
    fn wait_all(&self, py: Python<'_>, opts: CallOpts) -> PyResult<()> {
        self.with(py, "wait_all", |comm, o| {
            with_pair!(comm, o, AnyAg, |c, o| with_call(c, &opts, |call| o.wait_all(call)))
        })
    }

    /// Release the signal windows (collective, in the same order on every
    /// rank as other heap frees). Work on other streams, and graphs that
    /// captured this object's calls, must be finished first.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        let obj = &self.obj;
        let Some(o) = detached(py, || Ok(lock(obj).take())).map_err(PyErr::from)? else {
            return Err(to_pyerr(Error::invalid(
                "chunked all-gather free: it was freed already",
            )));
        };
        let freed = run(py, || match o {
            AnyAg::Host(o) => o.free(),
            #[cfg(feature = "cuda")]
            AnyAg::Cuda(o) => o.free(),
            #[cfg(feature = "rocm")]
            AnyAg::Hip(o) => o.free(),
        });
        // The output's hold (a heap tensor's loan) goes with the windows,
        // dropped with the lock let go (it may run Python code).
        let owner = lock(&self.output).take();
        drop(owner);
        freed
    }

    fn __repr__(&self) -> String {
        format!("<ferrocomm.ChunkedAllGather shard_count={}>", self.shard)
    }
}

/// A chunked reduce-scatter of chunks of `chunk_count` x `dtype` through
/// an inbox in the symmetric heap: collective to create and to free.
#[pyclass(frozen, name = "ChunkedReduceScatter", module = "ferrocomm._ferrocomm")]
pub struct PyChunkedReduceScatter {
    parent: Py<PyComm>,
    obj: Mutex<Option<AnyRs>>,
    chunk: usize,
}

impl PyChunkedReduceScatter {
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&AnyComm, &mut AnyRs) -> ferrocomm::Result<T> + Send,
    ) -> PyResult<T> {
        with_live(py, &self.parent, &self.obj, "chunked reduce-scatter", what, f)
    }
}

/// Run `f` on the object in `slot` and its communicator, without the GIL;
/// an error naming `kind` and `what` once the object was freed.
fn with_live<O: Send, T: Send>(
    py: Python<'_>,
    parent: &Py<PyComm>,
    slot: &Mutex<Option<O>>,
    kind: &str,
    what: &str,
    f: impl FnOnce(&AnyComm, &mut O) -> ferrocomm::Result<T> + Send,
) -> PyResult<T> {
    let (comm, _) = parent.get().parts();
    let comm = &**comm;
    run(py, || match lock(slot).as_mut() {
        Some(o) => f(comm, o),
        None => Err(Error::invalid(format!("{kind} {what}: it was freed"))),
    })
}

#[pymethods]
impl PyChunkedReduceScatter {
    #[new]
    fn new(py: Python<'_>, comm: Py<PyComm>, chunk_count: i64, dtype: &str) -> PyResult<Self> {
        let chunk = count_arg("chunked reduce-scatter: chunk_count", chunk_count)?;
        let dtype: DType = dtype.parse().map_err(to_pyerr)?;
        let (any, lender) = comm.get().parts();
        ensure_open(lender, "chunked reduce-scatter")?;
        let any = &**any;
        let obj = run(py, || {
            make_any!(any, AnyRs, |c| ChunkedReduceScatter::new(c, chunk, dtype))
        })?;
        Ok(PyChunkedReduceScatter {
            parent: comm,
            obj: Mutex::new(Some(obj)),
            chunk,
        })
    }

    /// Elements of one chunk (one rank's output).
    #[getter]
    fn chunk_count(&self) -> usize {
        self.chunk
    }

    /// Put `partial` (this rank's partial for rank `dst`'s chunk) into
    /// `dst`'s inbox on the `opts` stream, after `dst`'s "ready", and
    /// signal it; once per rank and call.
    #[pyo3(signature = (dst, partial, *, opts=CallOpts::default()))]
    fn put_chunk(&self, py: Python<'_>, dst: i64, partial: &Bound<'_, PyAny>, opts: CallOpts) -> PyResult<()> {
        let world = ferrocomm_world(self.parent.get().parts().0.as_ref());
        let dst = rank_arg("chunked reduce-scatter put_chunk", dst, world)?;
        let imp = import(&self.parent, partial, false, "chunked reduce-scatter partial", &opts)?;
        let t = imp.tensor();
        self.with(py, "put_chunk", |comm, o| {
            with_pair!(comm, o, AnyRs, |c, o| with_call(c, &opts, |call| o
                .put_chunk(dst, t, call)))
        })
    }

    /// Wait for every rank's partial on the `opts` stream, reduce them in
    /// rank order (`op`: "sum" or "avg"; f32 accumulation) into `output`,
    /// then tell every rank its slot is free.
    #[pyo3(signature = (output, op="sum", *, opts=CallOpts::default()))]
    fn finish(&self, py: Python<'_>, output: &Bound<'_, PyAny>, op: &str, opts: CallOpts) -> PyResult<()> {
        let op: ReduceOp = op.parse().map_err(to_pyerr)?;
        let imp = import(&self.parent, output, true, "chunked reduce-scatter output", &opts)?;
        let t: Tensor = imp.tensor();
        self.with(py, "finish", |comm, o| {
            with_pair!(comm, o, AnyRs, |c, o| with_call(c, &opts, |call| o.finish(t, op, call)))
        })
    }

    /// Release the inbox and the signal windows (collective, in the same
    /// order on every rank as other heap frees). Work on other streams, and
    /// graphs that captured this object's calls, must be finished first.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        let obj = &self.obj;
        let Some(o) = detached(py, || Ok(lock(obj).take())).map_err(PyErr::from)? else {
            return Err(to_pyerr(Error::invalid(
                "chunked reduce-scatter free: it was freed already",
            )));
        };
        run(py, || match o {
            AnyRs::Host(o) => o.free(),
            #[cfg(feature = "cuda")]
            AnyRs::Cuda(o) => o.free(),
            #[cfg(feature = "rocm")]
            AnyRs::Hip(o) => o.free(),
        })
    }

    fn __repr__(&self) -> String {
        format!("<ferrocomm.ChunkedReduceScatter chunk_count={}>", self.chunk)
    }
}

fn ferrocomm_world(any: &AnyComm) -> usize {
    crate::backend::with_any!(any, AnyComm, |c| c.size())
}
