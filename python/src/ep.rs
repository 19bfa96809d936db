//! Expert-parallel dispatch and combine (`ferrocomm::ep`) as Python sees
//! them: `Comm.ep_buffer` gives a [`PyEpBuffer`], whose `dispatch` and
//! `combine` take DLPack tensors and queue like collectives (a `Work` for
//! `async_op`, else waited where no stream orders them). What a dispatch
//! leaves on this rank lies in the buffer's own heap regions, at addresses
//! fixed for the buffer's life; `received` hands them out as [`PyEpTensor`]
//! views exporting DLPack.
//!
//! Lifetimes follow heap tensors (heap.rs): a DLPack view and queued work
//! each hold a loan on the buffer and on the communicator, so `free` and
//! `finalize` refuse while the regions are still read or written.
//!
//! NumPy has neither bfloat16 nor float8, so NumPy callers hold bf16 rows as
//! their bits in 16-bit integers and fp8 rows as bytes. DLPack cannot carry
//! 16-bit integers into ferrocomm (it has no such dtype), so the Python
//! layer (`ferrocomm/_ep.py`) views them as float16 and says so (`*_bits`):
//! only then is a float16 tensor taken as bf16, and a real float16 tensor is
//! still refused. fp8 rows are taken as uint8 too (torch's float8 tensors
//! arrive so anyway), and a view's `bits()` exports the bits back.

use std::sync::{Arc, Mutex};

use ferrocomm::ep::{EpBuffer, EpConfig, EpLayout, EpPayload};
use ferrocomm::{Communicator, DType, Tensor};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::args::{count_arg, invalid, CallOpts};
use crate::backend::{with_any, AnyComm, AnyEp, Backend};
use crate::comm::PyComm;
use crate::dlpack::Owner;
use crate::errors::{run, to_pyerr, Failure};
use crate::export::{self, ensure_open, gone, Counter, Exported, Loan};
use crate::heap::{comm_as, dl_device};
use crate::work::{lock, PyWork};

/// `Comm.ep_buffer`'s arguments as Python gave them (checked by [`PyEpBuffer::create`]).
pub struct EpShape<'a> {
    pub num_experts: i64,
    pub hidden: i64,
    pub max_tokens_per_rank: i64,
    pub topk: i64,
    pub dtype: &'a str,
}

fn payload_of(dtype: &str) -> PyResult<EpPayload> {
    let key = dtype.trim().to_ascii_lowercase();
    let parsed = match key.as_str() {
        "fp8" | "float8" => Ok(DType::F8E4M3),
        k => k.parse::<DType>(),
    };
    match parsed {
        Ok(DType::BF16) => Ok(EpPayload::Bf16),
        Ok(DType::F8E4M3) => Ok(EpPayload::Fp8),
        _ => Err(invalid(format!(
            "ep_buffer: dtype {dtype:?}: the dispatched rows are bfloat16 or float8_e4m3fn"
        ))),
    }
}

fn payload_dtype(p: EpPayload) -> DType {
    match p {
        EpPayload::Bf16 => DType::BF16,
        EpPayload::Fp8 => DType::F8E4M3,
    }
}

/// What a tensor argument must be: `dtype`, or `also` (the same bits as
/// the caller's framework holds them); rows of exactly `cols` elements, at
/// least `rows` of them. `shape` spells the shape for messages.
struct Want {
    dtype: DType,
    also: Option<DType>,
    cols: usize,
    rows: usize,
    shape: &'static str,
}

/// `t` (imported with `rows` rows along its first dimension) checked
/// against `want`, as `want.dtype`. `bits`: the Python layer viewed 16-bit
/// integers as float16, which messages must call what the caller passed.
fn checked(op: &str, what: &str, t: Tensor, rows: usize, bits: bool, want: &Want) -> PyResult<Tensor> {
    let name = |d: DType| export::dtype_name(d);
    if t.dtype() != want.dtype && Some(t.dtype()) != want.also {
        let given = if bits { "16-bit integers" } else { name(t.dtype()) };
        let hint = match (want.dtype, t.dtype()) {
            (DType::BF16, _) => " (NumPy, which has no bfloat16: their bits as uint16)",
            (DType::F8E4M3, _) => " (or their bytes as uint8)",
            (DType::I32, DType::I64) => " (DeepEP's int64 ids: convert them, e.g. topk_idx.int() or astype(np.int32))",
            _ => "",
        };
        return Err(invalid(format!(
            "{op}: {what} is {given}, want {}{hint}",
            name(want.dtype)
        )));
    }
    let count = t.count();
    if rows.checked_mul(want.cols) != Some(count) {
        let per_row = count.checked_div(rows).unwrap_or(0);
        return Err(invalid(format!(
            "{op}: {what} has {rows} rows of {per_row} elements ({count} in all), want rows of {} ({what} is {}; a \
             1-D array counts as rows of one element)",
            want.cols, want.shape
        )));
    }
    if rows < want.rows {
        return Err(invalid(format!(
            "{op}: {what} has {rows} rows, want at least {} ({what} is {})",
            want.rows, want.shape
        )));
    }
    t.reinterpret(want.dtype).map_err(to_pyerr)
}

/// An EP buffer (`Comm.ep_buffer`, the native part of `ferrocomm.EpBuffer`).
#[pyclass(frozen, name = "EpBuffer", module = "ferrocomm._ferrocomm")]
pub struct PyEpBuffer {
    parent: Py<PyComm>,
    comm: Arc<AnyComm>,
    /// The communicator's: closed at finalize.
    lender: Arc<Counter>,
    /// This buffer's: closed when freed.
    own: Arc<Counter>,
    /// Shared so that a call queues with no lock held while the GIL is
    /// released (another thread may take the GIL and then the lock).
    ep: Mutex<Option<Arc<AnyEp>>>,
    cfg: EpConfig,
    world: usize,
    layout: EpLayout,
    /// This rank's address of the buffer's heap allocation (its regions
    /// are at the layout's offsets from it).
    base: u64,
    device: (i32, i32),
}

/// The communicator the buffer was made on, with the buffer's device type.
fn ep_comm<'a, D: Backend>(_: &EpBuffer<D>, any: &'a AnyComm) -> Result<&'a Communicator<D>, Failure> {
    comm_as(any, "an EP buffer")
}

impl PyEpBuffer {
    /// Allocate the buffer (collective): see `EpBuffer::new`.
    pub fn create(
        py: Python<'_>,
        parent: Py<PyComm>,
        comm: &Arc<AnyComm>,
        lender: &Arc<Counter>,
        shape: EpShape<'_>,
    ) -> PyResult<PyEpBuffer> {
        let cfg = EpConfig {
            hidden: count_arg("ep_buffer: hidden", shape.hidden)?,
            max_tokens_per_rank: count_arg("ep_buffer: max_tokens_per_rank", shape.max_tokens_per_rank)?,
            num_experts: count_arg("ep_buffer: num_experts", shape.num_experts)?,
            topk: count_arg("ep_buffer: topk", shape.topk)?,
            payload: payload_of(shape.dtype)?,
        };
        ensure_open(lender, "ep_buffer")?;
        let any = &**comm;
        let (ep, world, layout, base, device) = run(py, || {
            with_any!(any, AnyComm, |c| {
                let b = EpBuffer::new(c, cfg)?;
                let layout = *b.layout();
                // The allocation's base, from a region at a known offset
                // (EpBuffer hands out its regions, not the allocation).
                let base = b.received()?.recv_counts.ptr().0 - layout.recv_counts as u64;
                Ok((Arc::new(Backend::wrap_ep(b)), c.size(), layout, base, dl_device(c)))
            })
        })?;
        Ok(PyEpBuffer {
            parent,
            comm: comm.clone(),
            lender: lender.clone(),
            own: Counter::new(),
            ep: Mutex::new(Some(ep)),
            cfg,
            world,
            layout,
            base,
            device,
        })
    }

    /// A hold on the buffer for queued work (so `free` waits for it to be
    /// let go), then the buffer itself; refused once freed or finalized.
    fn take(&self, slf: &Bound<'_, Self>, what: &str) -> PyResult<(Owner, Arc<AnyEp>)> {
        ensure_open(&self.lender, what)?;
        let loan = Loan::take(&[&self.own]).map_err(|why| gone(what, why))?;
        // The error (Python code) is made once the lock is let go.
        let ep = lock(&self.ep).clone();
        let ep = ep.ok_or_else(|| invalid(format!("{what}: the EP buffer was freed")))?;
        Ok((Owner::loaned(slf.clone().into_any().unbind(), loan), ep))
    }

    fn rows(&self) -> usize {
        self.world * self.cfg.max_tokens_per_rank
    }

    /// A view of the region at `offset`.
    fn view(&self, name: &'static str, offset: usize, shape: Vec<i64>, dtype: DType) -> PyEpTensor {
        PyEpTensor {
            lender: self.lender.clone(),
            own: self.own.clone(),
            name,
            exported: Exported {
                ptr: self.base + offset as u64,
                shape,
                dtype,
                device: self.device,
                bits: false,
            },
        }
    }

    /// The bf16 rows `combine` takes.
    fn bf16_rows(&self, rows: usize, bits: bool, shape: &'static str) -> Want {
        Want {
            dtype: DType::BF16,
            also: bits.then_some(DType::F16),
            cols: self.cfg.hidden,
            rows,
            shape,
        }
    }
}

#[pymethods]
impl PyEpBuffer {
    /// Send each of the first `num_tokens` rows of `x` (default: all of
    /// them) to every rank owning one of its experts (`topk_idx`, int32
    /// `[tokens, topk]`; `topk_weights`, float32). Collective; each rank
    /// its own number of tokens. The received rows are in `received()`.
    /// Returns the work (as collectives do) and the number of tokens.
    #[pyo3(signature = (x, topk_idx, topk_weights, scales=None, num_tokens=None, x_bits=false, *,
        opts=CallOpts::default()))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        scales: Option<&Bound<'_, PyAny>>,
        num_tokens: Option<i64>,
        x_bits: bool,
        opts: CallOpts,
    ) -> PyResult<(Option<PyWork>, usize)> {
        const OP: &str = "EP dispatch";
        let me = slf.get();
        let (hold, ep) = me.take(slf, OP)?;
        let cfg = me.cfg;
        let parent = me.parent.get();
        let mut batch = parent.batch(opts);
        let (xt, x_rows) = batch.import_full(x, false, "EP dispatch x")?;
        let n = match num_tokens {
            Some(n) => count_arg("EP dispatch: num_tokens", n)?,
            None => x_rows,
        };
        let payload = payload_dtype(cfg.payload);
        let x_want = Want {
            dtype: payload,
            also: match cfg.payload {
                EpPayload::Bf16 => x_bits.then_some(DType::F16),
                EpPayload::Fp8 => Some(DType::U8),
            },
            cols: cfg.hidden,
            rows: n,
            shape: "[num_tokens, hidden]",
        };
        let xt = checked(OP, "x", xt, x_rows, x_bits, &x_want)?;
        let per_token = |dtype: DType, cols: usize, shape: &'static str| Want {
            dtype,
            also: None,
            cols,
            rows: n,
            shape,
        };
        let (t, rows) = batch.import_full(topk_idx, false, "EP dispatch topk_idx")?;
        let idx = checked(
            OP,
            "topk_idx",
            t,
            rows,
            false,
            &per_token(DType::I32, cfg.topk, "[num_tokens, topk]"),
        )?;
        let (t, rows) = batch.import_full(topk_weights, false, "EP dispatch topk_weights")?;
        let weights = checked(
            OP,
            "topk_weights",
            t,
            rows,
            false,
            &per_token(DType::F32, cfg.topk, "[num_tokens, topk]"),
        )?;
        let scales = match (cfg.payload, scales) {
            (EpPayload::Fp8, Some(s)) => {
                let (t, rows) = batch.import_full(s, false, "EP dispatch scales")?;
                let want = per_token(DType::F32, me.layout.scale_cols, "[num_tokens, hidden / 128]");
                Some(checked(OP, "scales", t, rows, false, &want)?)
            }
            (EpPayload::Fp8, None) => {
                return Err(invalid(
                    "EP dispatch: float8 rows need their scales (float32 [num_tokens, hidden / 128])",
                ))
            }
            (EpPayload::Bf16, Some(_)) => {
                return Err(invalid("EP dispatch: bfloat16 rows take no scales"));
            }
            (EpPayload::Bf16, None) => None,
        };
        batch.hold(hold);
        let (any, o) = (&*me.comm, &batch.opts);
        let res = with_any!(&*ep, AnyEp, |e| match ep_comm(e, any) {
            Ok(c) => o.enqueue(py, c, |call| e
                .dispatch(xt, scales, idx, weights, n, call)
                .map(|(work, _)| work)),
            Err(f) => Err(f),
        });
        Ok((parent.finish(py, res, batch, "ep_dispatch", false)?, n))
    }

    /// Send every received row of `expert_out` (bf16 `[world *
    /// max_tokens_per_rank, hidden]`, the layout of `recv_x`, router weights
    /// applied) back to its source, and write into `out` (bf16
    /// `[num_tokens, hidden]`) each token's sum over the ranks it went to.
    /// Collective; follows a dispatch.
    #[pyo3(signature = (expert_out, out, expert_out_bits=false, out_bits=false, *, opts=CallOpts::default()))]
    fn combine(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        expert_out: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        expert_out_bits: bool,
        out_bits: bool,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "EP combine";
        let me = slf.get();
        let (hold, ep) = me.take(slf, OP)?;
        let parent = me.parent.get();
        let mut batch = parent.batch(opts);
        let (t, rows) = batch.import_full(expert_out, false, "EP combine expert_out")?;
        let want = me.bf16_rows(me.rows(), expert_out_bits, "[world * max_tokens_per_rank, hidden]");
        let expert = checked(OP, "expert_out", t, rows, expert_out_bits, &want)?;
        // How many rows `out` needs is the last dispatch's token count,
        // which the Rust buffer checks.
        let (t, rows) = batch.import_full(out, true, "EP combine out")?;
        let out = checked(
            OP,
            "out",
            t,
            rows,
            out_bits,
            &me.bf16_rows(0, out_bits, "[num_tokens, hidden]"),
        )?;
        batch.hold(hold);
        let (any, o) = (&*me.comm, &batch.opts);
        let res = with_any!(&*ep, AnyEp, |e| match ep_comm(e, any) {
            Ok(c) => o.enqueue(py, c, |call| e.combine(expert, out, call)),
            Err(f) => Err(f),
        });
        parent.finish(py, res, batch, "ep_combine", false)
    }

    /// The regions a dispatch fills, by name, as views exporting DLPack:
    /// recv_x, recv_scales (float8 buffers; else None), recv_topk_idx,
    /// recv_topk_weights, recv_src_index, recv_counts, send_counts.
    fn received<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        ensure_open(&self.lender, "EP received")?;
        ensure_open(&self.own, "EP received")?;
        let (l, rows, w) = (&self.layout, self.rows() as i64, self.world as i64);
        let (hidden, topk) = (self.cfg.hidden as i64, self.cfg.topk as i64);
        let d = PyDict::new(py);
        let payload = payload_dtype(self.cfg.payload);
        d.set_item("recv_x", self.view("recv_x", l.recv_x, vec![rows, hidden], payload))?;
        let scales = (self.cfg.payload == EpPayload::Fp8).then(|| {
            self.view(
                "recv_scales",
                l.recv_scales,
                vec![rows, l.scale_cols as i64],
                DType::F32,
            )
        });
        d.set_item("recv_scales", scales)?;
        d.set_item(
            "recv_topk_idx",
            self.view("recv_topk_idx", l.recv_idx, vec![rows, topk], DType::I32),
        )?;
        let weights = self.view("recv_topk_weights", l.recv_weights, vec![rows, topk], DType::F32);
        d.set_item("recv_topk_weights", weights)?;
        d.set_item(
            "recv_src_index",
            self.view("recv_src_index", l.recv_src, vec![rows], DType::I32),
        )?;
        d.set_item(
            "recv_counts",
            self.view("recv_counts", l.recv_counts, vec![w], DType::I32),
        )?;
        d.set_item(
            "send_counts",
            self.view("send_counts", l.send_counts, vec![w], DType::I32),
        )?;
        Ok(d)
    }

    #[getter]
    fn num_experts(&self) -> usize {
        self.cfg.num_experts
    }

    #[getter]
    fn hidden(&self) -> usize {
        self.cfg.hidden
    }

    #[getter]
    fn max_tokens_per_rank(&self) -> usize {
        self.cfg.max_tokens_per_rank
    }

    #[getter]
    fn topk(&self) -> usize {
        self.cfg.topk
    }

    /// The dispatched rows' dtype: `bfloat16` or `float8_e4m3fn`.
    #[getter]
    fn dtype(&self) -> &'static str {
        export::dtype_name(payload_dtype(self.cfg.payload))
    }

    /// Experts on each rank: expert `e` lives on rank `e // experts_per_rank`.
    #[getter]
    fn experts_per_rank(&self) -> usize {
        self.cfg.num_experts / self.world
    }

    /// The regions' byte offsets inside the buffer's heap allocation, and
    /// `total`, its size (`ferrocomm::ep::EpLayout`).
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let l = &self.layout;
        let d = PyDict::new(py);
        for (k, v) in [
            ("flags", l.flags),
            ("recv_counts", l.recv_counts),
            ("send_counts", l.send_counts),
            ("recv_x", l.recv_x),
            ("recv_scales", l.recv_scales),
            ("recv_topk_idx", l.recv_idx),
            ("recv_topk_weights", l.recv_weights),
            ("recv_src_index", l.recv_src),
            ("inbox", l.inbox),
            ("slots", l.slots),
            ("total", l.total),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Whether `free` ran (or the communicator was finalized).
    #[getter]
    fn freed(&self) -> bool {
        self.own.closed().is_some() || self.lender.closed().is_some()
    }

    /// Give the regions back to the heap. Collective in order: every rank
    /// frees its EP buffers, heap tensors and windows in the same order.
    /// Refused while DLPack views of the regions or queued work hold them.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        ensure_open(&self.own, "EP buffer free")?;
        // Completed work that nobody waited on still holds the buffer.
        self.parent.get().settle()?;
        self.own.close("freed").map_err(|n| {
            invalid(format!(
                "EP buffer free: it is still held {n} time(s) (NumPy arrays or torch tensors of what a dispatch \
                 received, Work objects of its dispatches and combines, queued work); let them go first"
            ))
        })?;
        let Some(ep) = lock(&self.ep).take() else {
            return Ok(());
        };
        // Every call took its loan before its share: with the loans all
        // returned, nobody else holds one.
        let ep = Arc::try_unwrap(ep).map_err(|_| Failure::Panic("an EP buffer shared past its loans".into()))?;
        run(py, || with_any!(ep, AnyEp, |e| e.free()))
    }

    fn __repr__(&self) -> String {
        let c = &self.cfg;
        format!(
            "<ferrocomm.EpBuffer world={} num_experts={} hidden={} max_tokens_per_rank={} topk={} dtype={}{}>",
            self.world,
            c.num_experts,
            c.hidden,
            c.max_tokens_per_rank,
            c.topk,
            self.dtype(),
            if self.freed() { " freed" } else { "" }
        )
    }
}

// ------------------------------------------------------------ views

/// A region of an EP buffer (`EpBuffer.received`), exporting DLPack in place.
#[pyclass(frozen, name = "EpTensor", module = "ferrocomm._ferrocomm")]
pub struct PyEpTensor {
    lender: Arc<Counter>,
    own: Arc<Counter>,
    name: &'static str,
    exported: Exported,
}

#[pymethods]
impl PyEpTensor {
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
            "EP buffer view",
            stream,
            max_version,
            dl_device,
            copy,
        )
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        self.exported.device
    }

    /// The same memory exported as unsigned integers of the element's
    /// width (bfloat16 as uint16, float8 as uint8): for NumPy, which has
    /// neither type.
    fn bits(&self) -> PyEpTensor {
        PyEpTensor {
            lender: self.lender.clone(),
            own: self.own.clone(),
            name: self.name,
            exported: Exported {
                bits: true,
                ..self.exported.clone()
            },
        }
    }

    /// The region's name (`recv_x`, `recv_counts`, ...).
    #[getter]
    fn name(&self) -> &'static str {
        self.name
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.exported.shape)
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        self.exported.dtype_name()
    }

    /// This rank's address of the region.
    fn data_ptr(&self) -> u64 {
        self.exported.ptr
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferrocomm.EpTensor {} shape={:?} dtype={}>",
            self.name,
            self.exported.shape,
            self.exported.dtype_name()
        )
    }
}
