//! The symmetric heap and one-sided windows, as Python sees them
//! (torchcomms' spelling): `Comm.heap_tensor` gives a [`PyHeapTensor`]
//! (its `bits()`, for NumPy, a [`PyHeapBits`]), `Comm.new_window` a
//! [`PyWindow`] with `tensor_register`, `put`,
//! `signal`, `wait_signal`, `map_remote_tensor` ([`PyRemoteTensor`]),
//! `tensor_deregister` and `free`.
//!
//! Lifetimes: memory handed out through DLPack holds a [`Loan`] (see
//! `export.rs`) on the communicator and on the object, so `free`,
//! `tensor_deregister`, `Window.free` and the communicator's `finalize`
//! refuse while a consumer still holds it. Ferrocomm's own uses of a heap
//! tensor (a window buffer, a put's source, a collective's tensor) hold the
//! heap tensor only: finalize drains them itself.

use std::sync::{Arc, Mutex};

use ferrocomm::device::DeviceBuffer;
use ferrocomm::heap::HeapBuffer;
use ferrocomm::{Communicator, DType, Error, Window};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::args::{count_arg, element_count, invalid, rank_arg, CallOpts};
use crate::backend::{with_any, AnyComm, AnyWindow, Backend};
use crate::comm::PyComm;
use crate::dlpack::{Imported, Owner, KDL_CPU};
use crate::errors::{detached, run, to_pyerr, Failure};
use crate::export::{self, ensure_open, gone, Counter, Exported, Loan};
use crate::work::{lock, PyWork};

/// The DLPack device of a communicator's memory (CPU memory is device 0).
pub(crate) fn dl_device<D: Backend>(c: &Communicator<D>) -> (i32, i32) {
    match D::DL_DEVICE {
        KDL_CPU => (KDL_CPU, 0),
        t => (t, c.device().facts().ordinal as i32),
    }
}

// ------------------------------------------------------------ heap tensors

/// A tensor in the communicator's symmetric heap (`Comm.heap_tensor`): at
/// the same offset on every rank, zeroed, exported through DLPack.
#[pyclass(frozen, name = "HeapTensor", module = "ferrocomm._ferrocomm")]
pub struct PyHeapTensor {
    comm: Arc<AnyComm>,
    /// The communicator's: closed at finalize.
    lender: Arc<Counter>,
    /// This tensor's: closed when freed.
    own: Arc<Counter>,
    buf: Mutex<Option<HeapBuffer>>,
    ptr: u64,
    offset: usize,
    shape: Vec<i64>,
    dtype: DType,
    device: (i32, i32),
}

impl PyHeapTensor {
    /// Allocate (collective): every rank the same shape and dtype, in the same order.
    pub fn alloc(
        py: Python<'_>,
        comm: &Arc<AnyComm>,
        lender: &Arc<Counter>,
        shape: Vec<i64>,
        dtype: &str,
    ) -> PyResult<PyHeapTensor> {
        let dtype: DType = dtype.parse().map_err(to_pyerr)?;
        let bytes = element_count("heap_tensor", &shape)?
            .checked_mul(dtype.size())
            .ok_or_else(|| invalid(format!("heap_tensor: shape {shape:?} overflows")))?;
        ensure_open(lender, "heap_tensor")?;
        let any = &**comm;
        let (buf, device) = run(py, || {
            with_any!(any, AnyComm, |c| c.heap_alloc(bytes).map(|b| (b, dl_device(c))))
        })?;
        Ok(PyHeapTensor {
            comm: comm.clone(),
            lender: lender.clone(),
            own: Counter::new(),
            ptr: buf.ptr().0,
            offset: buf.offset(),
            buf: Mutex::new(Some(buf)),
            shape,
            dtype,
            device,
        })
    }

    fn exported(&self) -> Exported {
        Exported {
            ptr: self.ptr,
            shape: self.shape.clone(),
            dtype: self.dtype,
            device: self.device,
            bits: false,
        }
    }

    /// The tensor for ferrocomm's own use (a collective, a put, a window):
    /// held so that `free` refuses until the use ends.
    pub fn lend(&self, obj: &Bound<'_, PyAny>) -> PyResult<Imported> {
        ensure_open(&self.lender, "heap tensor")?;
        let loan = Loan::take(&[&self.own]).map_err(|why| gone("heap tensor", why))?;
        Ok(Imported {
            ptr: self.ptr,
            count: element_count("heap tensor", &self.shape)?,
            dtype: self.dtype,
            device_type: self.device.0,
            device_id: self.device.1,
            readonly: false,
            rows: self.shape.first().map_or(1, |&d| d as usize),
            owner: Owner::loaned(obj.clone().unbind(), loan),
        })
    }

    pub fn dims(&self) -> &[i64] {
        &self.shape
    }
}

#[pymethods]
impl PyHeapTensor {
    /// A DLPack capsule of the tensor (the array API's `__dlpack__`).
    #[pyo3(signature = (stream=None, *, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        export::dlpack(
            py,
            &self.exported(),
            &[&self.lender, &self.own],
            "heap tensor",
            stream,
            max_version,
            dl_device,
            copy,
        )
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        self.device
    }

    /// The same memory exported as unsigned integers of the element's
    /// width (bfloat16 as uint16, float8 as uint8): for NumPy, which has
    /// neither type. Its exports hold the tensor as the tensor's own do.
    fn bits(&self) -> PyHeapBits {
        PyHeapBits {
            lender: self.lender.clone(),
            own: self.own.clone(),
            exported: Exported {
                bits: true,
                ..self.exported()
            },
        }
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// NumPy's / torch's name of the dtype (`float32`, `bfloat16`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        export::dtype_name(self.dtype)
    }

    /// Byte offset from the heap's base: the same on every rank.
    #[getter]
    fn offset(&self) -> usize {
        self.offset
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.shape.iter().product::<i64>() as usize * self.dtype.size()
    }

    /// This rank's address of the tensor.
    fn data_ptr(&self) -> u64 {
        self.ptr
    }

    /// Whether `free` ran (or the communicator was finalized).
    #[getter]
    fn freed(&self) -> bool {
        self.own.closed().is_some() || self.lender.closed().is_some()
    }

    /// Give the memory back to the heap. Collective in order: every rank
    /// frees its heap tensors (and windows) in the same order, as it
    /// allocated them. Refused while a DLPack consumer (a NumPy array, a
    /// torch tensor), a window it is registered in, or queued work holds it.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(why) = self.own.closed() {
            return Err(gone("free", why));
        }
        if let Err(n) = self.own.close("freed") {
            return Err(invalid(format!(
                "free: the heap tensor is still held {n} time(s) (NumPy arrays or torch tensors made from it \
                 through DLPack, a window it is registered in, queued work); let them go first"
            )));
        }
        let buf = lock(&self.buf).take();
        let (Some(buf), any) = (buf, &*self.comm) else {
            return Ok(());
        };
        run(py, || with_any!(any, AnyComm, |c| c.heap_free(buf)))
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferrocomm.HeapTensor shape={:?} dtype={} offset={}{}>",
            self.shape,
            export::dtype_name(self.dtype),
            self.offset,
            if self.freed() { " freed" } else { "" }
        )
    }
}

/// A heap tensor's bits (`HeapTensor.bits()`), exporting DLPack in place.
#[pyclass(frozen, name = "HeapTensorBits", module = "ferrocomm._ferrocomm")]
pub struct PyHeapBits {
    lender: Arc<Counter>,
    own: Arc<Counter>,
    exported: Exported,
}

#[pymethods]
impl PyHeapBits {
    #[pyo3(signature = (stream=None, *, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        export::dlpack(
            py,
            &self.exported,
            &[&self.lender, &self.own],
            "heap tensor",
            stream,
            max_version,
            dl_device,
            copy,
        )
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        self.exported.device
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.exported.shape)
    }

    /// The unsigned integer type of the element's width (`uint16`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.exported.dtype_name()
    }

    /// This rank's address of the tensor.
    fn data_ptr(&self) -> u64 {
        self.exported.ptr
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferrocomm.HeapTensorBits of {} shape={:?} dtype={}>",
            export::dtype_name(self.exported.dtype),
            self.exported.shape,
            self.exported.dtype_name()
        )
    }
}

/// The device API's context (`FcDevCtx`, 104 bytes, native byte order) for
/// kernels of the caller's own.
pub fn device_ctx_bytes<'py>(py: Python<'py>, comm: &AnyComm) -> PyResult<Bound<'py, PyBytes>> {
    let ctx = run(py, || with_any!(comm, AnyComm, |c| c.device_ctx()))?;
    let mut out = Vec::with_capacity(ferrocomm::heap::DEV_CTX_BYTES);
    for p in ctx.heap {
        out.extend_from_slice(&p.0.to_ne_bytes());
    }
    for w in [ctx.heap_bytes, ctx.error_flags.0, ctx.timeout_ns, ctx.sync_offset] {
        out.extend_from_slice(&w.to_ne_bytes());
    }
    out.extend_from_slice(&ctx.rank.to_ne_bytes());
    out.extend_from_slice(&ctx.world.to_ne_bytes());
    debug_assert_eq!(out.len(), ferrocomm::heap::DEV_CTX_BYTES);
    Ok(PyBytes::new(py, &out))
}

// ------------------------------------------------------------ windows

/// The window's buffer: what keeps the local tensor alive, and the count of
/// peers' views (`map_remote_tensor`) handed out over it.
struct Buffer {
    _owner: Owner,
    views: Arc<Counter>,
    shape: Vec<i64>,
}

/// A one-sided window (`Comm.new_window`).
///
/// Two Python threads may call one window. A lock held while the GIL is
/// released deadlocks them: the other thread takes the GIL, then waits for
/// the lock while holding it, and the first never gets the GIL back to let
/// the lock go. So `win`, which window calls hold while they wait in Rust
/// (a collective registration, a free waiting for queued work), is taken
/// only with the GIL released ([`PyWindow::with_window`]); `buffer` is held
/// with the GIL, briefly, and never across a call that releases it or runs
/// Python code (errors are made and owners dropped after it is let go).
#[pyclass(frozen, name = "Window", module = "ferrocomm._ferrocomm")]
pub struct PyWindow {
    parent: Py<PyComm>,
    comm: Arc<AnyComm>,
    lender: Arc<Counter>,
    win: Mutex<Option<AnyWindow>>,
    buffer: Mutex<Option<Buffer>>,
}

fn comm_for<'a, D: Backend>(_: &Window<D>, any: &'a AnyComm) -> Result<&'a Communicator<D>, Failure> {
    comm_as(any, "a window")
}

/// The communicator inside `any` as backend `D`'s: `what` (a window, an EP
/// buffer) was made on it, so another backend is a bug.
pub(crate) fn comm_as<'a, D: Backend>(any: &'a AnyComm, what: &str) -> Result<&'a Communicator<D>, Failure> {
    D::comm_of(any).ok_or_else(|| Failure::Panic(format!("{what} of one backend on a communicator of another")))
}

impl PyWindow {
    pub fn create(py: Python<'_>, parent: Py<PyComm>, comm: &Arc<AnyComm>, lender: &Arc<Counter>) -> PyResult<Self> {
        ensure_open(lender, "new_window")?;
        let any = &**comm;
        let win = run(py, || {
            with_any!(any, AnyComm, |c| c.new_window().map(Backend::wrap_window))
        })?;
        Ok(PyWindow {
            parent,
            comm: comm.clone(),
            lender: lender.clone(),
            win: Mutex::new(Some(win)),
            buffer: Mutex::new(None),
        })
    }

    fn world(&self) -> usize {
        with_any!(&*self.comm, AnyComm, |c| c.size())
    }

    /// Run `f` on the window with the GIL released, the window locked
    /// inside that only (see [`PyWindow`]); refused once freed.
    fn with_window<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&mut AnyWindow) -> Result<T, Failure> + Send,
    ) -> Result<T, Failure> {
        let win = &self.win;
        detached(py, || {
            let mut guard = lock(win);
            Ok(match guard.as_mut() {
                Some(w) => f(w),
                None => Err(Error::invalid(format!("window {what}: the window was freed")).into()),
            })
        })?
    }

    /// Check the peer, queue one window operation with the per-call
    /// options and finish it as collectives are finished (a `Work` for
    /// `async_op`, else waited where no stream orders it).
    fn op(
        &self,
        py: Python<'_>,
        what: &'static str,
        src: Option<&Bound<'_, PyAny>>,
        rank: i64,
        offset: usize,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let rank = rank_arg(&format!("window {what}"), rank, self.world())?;
        let parent = self.parent.get();
        let mut batch = parent.batch(opts);
        let src = src.map(|t| batch.import(t, false, "window put tensor")).transpose()?;
        let (any, o) = (&*self.comm, &batch.opts);
        // A freed window is an InvalidArgument, which `finish` raises with
        // nothing kept, as any refusal before the queueing.
        let res = self.with_window(py, what, |w| {
            with_any!(w, AnyWindow, |w| {
                let c = comm_for(w, any)?;
                Ok(o.queue(c, |call| match (what, src) {
                    ("put", Some(t)) => w.put(t, rank, offset, call),
                    ("signal", _) => w.signal(rank, call),
                    _ => w.wait_signal(rank, call),
                })?)
            })
        });
        parent.finish(py, res, batch, what, false)
    }
}

impl PyWindow {
    /// Mark the peers' views of the buffer gone (`why`), refused while any
    /// is held; nothing to do without a buffer. Whether there was one.
    fn close_views(&self, what: &str, why: &'static str) -> PyResult<bool> {
        // The error (Python code) is made once the lock is let go.
        let closed = lock(&self.buffer).as_ref().map(|b| b.views.close(why));
        match closed {
            Some(Err(n)) => Err(invalid(format!(
                "window {what}: {n} DLPack view(s) from map_remote_tensor are still held; let them go first"
            ))),
            other => Ok(other.is_some()),
        }
    }

    /// Let the buffer go: its owner is dropped (maybe Python code) with
    /// the lock let go.
    fn drop_buffer(&self) {
        let old = lock(&self.buffer).take();
        drop(old);
    }
}

#[pymethods]
impl PyWindow {
    /// Make `tensor` the window's buffer (collective; sizes may differ
    /// between ranks, dtypes may not). Heap tensors on every rank map
    /// nothing new; other tensors are registered with every peer (memory
    /// the backend can share: GPU allocations; on the host backend only
    /// heap tensors and ferrocomm's own allocations).
    fn tensor_register(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<()> {
        if lock(&self.buffer).is_some() {
            return Err(invalid(
                "window tensor_register: the window has a buffer; tensor_deregister it first",
            ));
        }
        let (imp, shape) = match tensor.cast::<PyHeapTensor>() {
            Ok(h) => (h.get().lend(tensor)?, h.get().dims().to_vec()),
            Err(_) => {
                let mut batch = self.parent.get().batch(CallOpts::default());
                let imp = batch.import_checked(tensor, true, "window tensor_register tensor")?;
                let shape = tensor
                    .getattr("shape")
                    .and_then(|s| s.extract::<Vec<i64>>())
                    .ok()
                    .filter(|s| s.iter().try_fold(1i64, |n, &d| n.checked_mul(d)) == Some(imp.count as i64))
                    .unwrap_or_else(|| vec![imp.count as i64]);
                (imp, shape)
            }
        };
        let t = imp.tensor();
        // A second registration racing this one on another thread is
        // refused by the window itself.
        self.with_window(py, "tensor_register", |w| {
            Ok(with_any!(w, AnyWindow, |w| w.register(t))?)
        })?;
        let old = lock(&self.buffer).replace(Buffer {
            _owner: imp.owner,
            views: Counter::new(),
            shape,
        });
        drop(old);
        Ok(())
    }

    /// Copy `tensor` into `dst_rank`'s buffer at element `target_offset`,
    /// ordered on the stream; follow it with `signal(dst_rank)`.
    #[pyo3(signature = (tensor, dst_rank, target_offset=0, *, opts=CallOpts::default()))]
    fn put(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        dst_rank: i64,
        target_offset: i64,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let offset = count_arg("window put: target_offset", target_offset)?;
        self.op(py, "put", Some(tensor), dst_rank, offset, opts)
    }

    /// Add one to `dst_rank`'s count of signals from this rank, after every
    /// earlier put of the stream.
    #[pyo3(signature = (dst_rank, *, opts=CallOpts::default()))]
    fn signal(&self, py: Python<'_>, dst_rank: i64, opts: CallOpts) -> PyResult<Option<PyWork>> {
        self.op(py, "signal", None, dst_rank, 0, opts)
    }

    /// Wait (stream-ordered) until `peer_rank` has signalled this rank once
    /// more than the waits before. A peer that never signals: `CommTimeout`
    /// naming it after the call's timeout, and the communicator is aborted.
    #[pyo3(signature = (peer_rank, *, opts=CallOpts::default()))]
    fn wait_signal(&self, py: Python<'_>, peer_rank: i64, opts: CallOpts) -> PyResult<Option<PyWork>> {
        self.op(py, "wait_signal", None, peer_rank, 0, opts)
    }

    /// `rank`'s buffer as mapped in this process, as an object that exports
    /// DLPack (NumPy on the host backend, torch on GPUs). Its shape is the
    /// local buffer's when the peer's has as many elements, else 1-D.
    fn map_remote_tensor(&self, py: Python<'_>, rank: i64) -> PyResult<PyRemoteTensor> {
        let rank = rank_arg("window map_remote_tensor", rank, self.world())?;
        let buffer = lock(&self.buffer).as_ref().map(|b| (b.views.clone(), b.shape.clone()));
        let Some((views, local_shape)) = buffer else {
            return Err(invalid(
                "window map_remote_tensor: the window has no buffer (tensor_register one first)",
            ));
        };
        let any = &*self.comm;
        let (t, device) = self.with_window(py, "map_remote_tensor", |w| {
            with_any!(w, AnyWindow, |w| {
                let dev = device_for(w, any);
                Ok(w.map_remote(rank).map(|t| (t, dev))?)
            })
        })?;
        let count = t.count();
        let shape = if local_shape.iter().product::<i64>() == count as i64 {
            local_shape
        } else {
            vec![count as i64]
        };
        Ok(PyRemoteTensor {
            lender: self.lender.clone(),
            views,
            rank,
            exported: Exported {
                ptr: t.ptr().0,
                shape,
                dtype: t.dtype(),
                device,
                bits: false,
            },
        })
    }

    /// Let the buffer go (local). Refused while views from
    /// `map_remote_tensor` are held. Puts queued into it must have completed.
    fn tensor_deregister(&self, py: Python<'_>) -> PyResult<()> {
        if !self.close_views("tensor_deregister", "deregistered")? {
            return Err(invalid("window tensor_deregister: the window has no buffer"));
        }
        let win = &self.win;
        run(py, || match lock(win).as_mut() {
            Some(w) => with_any!(w, AnyWindow, |w| w.deregister()),
            None => Ok(()),
        })?;
        self.drop_buffer();
        Ok(())
    }

    /// Release the window: its buffer and its signal words (heap memory,
    /// so every rank frees its windows and heap tensors in the same order).
    /// Work queued on the communicator's stream is waited for; work on
    /// other streams must have completed.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        self.close_views("free", "freed")?;
        let win = &self.win;
        let Some(w) = detached(py, || Ok(lock(win).take()))? else {
            return Err(invalid("window free: the window was freed already"));
        };
        let r = run(py, || with_any!(w, AnyWindow, |w| w.free()));
        self.drop_buffer();
        r
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let win = &self.win;
        // The window's own state, read under its lock: `self.buffer` is set
        // only after a registration returns and the GIL is back, so a repr
        // that got the lock first would report a registered window empty.
        let state = py.detach(|| match lock(win).as_ref() {
            None => "freed",
            Some(w) if with_any!(w, AnyWindow, |w| w.buffer_tensor().is_some()) => "registered",
            Some(_) => "empty",
        });
        format!("<ferrocomm.Window {state}>")
    }
}

fn device_for<D: Backend>(_: &Window<D>, any: &AnyComm) -> (i32, i32) {
    match D::comm_of(any) {
        Some(c) => dl_device(c),
        None => (D::DL_DEVICE, 0),
    }
}

/// A peer's window buffer as mapped here (`Window.map_remote_tensor`).
#[pyclass(frozen, name = "RemoteTensor", module = "ferrocomm._ferrocomm")]
pub struct PyRemoteTensor {
    lender: Arc<Counter>,
    views: Arc<Counter>,
    rank: usize,
    exported: Exported,
}

#[pymethods]
impl PyRemoteTensor {
    #[pyo3(signature = (stream=None, *, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        export::dlpack(
            py,
            &self.exported,
            &[&self.lender, &self.views],
            "remote tensor",
            stream,
            max_version,
            dl_device,
            copy,
        )
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        self.exported.device
    }

    /// The rank whose buffer this is.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.exported.shape)
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        export::dtype_name(self.exported.dtype)
    }

    /// The peer's buffer's address in this process.
    fn data_ptr(&self) -> u64 {
        self.exported.ptr
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferrocomm.RemoteTensor of rank {} shape={:?} dtype={}>",
            self.rank,
            self.exported.shape,
            export::dtype_name(self.exported.dtype)
        )
    }
}
