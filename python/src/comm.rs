//! `Comm`: the native communicator behind `ferrocomm.Communicator`. Every
//! collective of the Rust API, taking DLPack tensors; `ferrocomm/_comm.py`
//! adds the torchcomms spelling (defaults, `ReduceOp`, streams of torch
//! and CuPy) on top.
//!
//! A collective checks its own arguments and imports its tensors into a
//! [`Batch`] (DLPack, with the stream the collective will run on, so the
//! producer orders its pending work before it; each checked to be this
//! communicator's device); the rest is one path for every call, [`launch!`]:
//! the per-call options ([`CallOpts`]: async_op, timeout, hints, stream)
//! make the `ferrocomm::Call`, the collective is queued with the GIL
//! released, and [`PyComm::finish`] either hands back a `Work` (async_op)
//! or, for a call that has no caller stream to be ordered on (the host
//! backend; GPU calls without a stream), waits for it. The tensors' owners
//! stay with the work until it has completed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrocomm::bootstrap::{rendezvous_from_env, Store};
use ferrocomm::device::Device;
use ferrocomm::{
    CommOptions, Error, Fusion, FusionPattern, MoeFinalize, P2p, ReduceOp, Reduction, Registration, SfLayout, SpOutput,
    Tensor, MOE_MAX_TOPK,
};
use pyo3::prelude::*;
use pyo3::types::{PyFloat, PyInt};

use crate::args::{duration, invalid, CallOpts};
use crate::backend::{self, with_any, AnyComm, AnyWork, Backend};
use crate::broadcaster::PyBroadcaster;
use crate::dlpack::{self, Imported, Owner, KDL_CUDA, KDL_CUDA_MANAGED, KDL_ROCM};
use crate::ep::{EpShape, PyEpBuffer};
use crate::errors::{run, run_interruptible, to_pyerr, Failure};
use crate::export::Counter;
use crate::heap::{PyHeapTensor, PyWindow};
use crate::membership::{Member, Membership};
use crate::store::PyStore;
use crate::torch_tensor;
use crate::work::{lock, Outstanding, Pending, PyWork};

/// A fused pattern by name: FlashInfer-style long names or ferrocomm's
/// short ones.
fn fusion_pattern(name: &str) -> PyResult<FusionPattern> {
    let key = name.trim().to_ascii_lowercase().replace('-', "_");
    let p = match key.as_str() {
        "residual_add" | "res" => FusionPattern::ResidualAdd,
        "residual_rms_norm" | "rms" => FusionPattern::ResidualRmsNorm,
        "residual_rms_norm_fp8" | "residual_rms_norm_quant_fp8" | "rms_fp8" => FusionPattern::ResidualRmsNormFp8,
        "residual_rms_norm_fp8_per_token" | "rms_fp8tok" => FusionPattern::ResidualRmsNormFp8PerToken,
        "residual_rms_norm_int8_per_token" | "rms_i8tok" => FusionPattern::ResidualRmsNormInt8PerToken,
        "residual_rms_norm_nvfp4" | "residual_rms_norm_fp4_quant" | "rms_nvfp4" => FusionPattern::ResidualRmsNormNvfp4,
        _ => {
            return Err(invalid(format!(
                "unknown fusion pattern {name:?}: residual_add, residual_rms_norm, residual_rms_norm_fp8, \
                 residual_rms_norm_fp8_per_token, residual_rms_norm_int8_per_token or residual_rms_norm_nvfp4"
            )))
        }
    };
    Ok(p)
}

/// NVFP4's scale-factor layout by name (FlashInfer's `SWIZZLED_128x4` or
/// `LINEAR`).
fn sf_layout(name: &str) -> PyResult<SfLayout> {
    match name.trim().to_ascii_lowercase().replace('-', "_").as_str() {
        "swizzled" | "swizzled_128x4" | "128x4" => Ok(SfLayout::Swizzled128x4),
        "linear" => Ok(SfLayout::Linear),
        _ => Err(invalid(format!(
            "unknown scale-factor layout {name:?}: swizzled (128x4 tiles) or linear"
        ))),
    }
}

/// The sequence-parallel output form by name.
fn sp_output(name: &str) -> PyResult<SpOutput> {
    match name.trim().to_ascii_lowercase().as_str() {
        "gathered" | "gather" | "all" => Ok(SpOutput::Gathered),
        "shard" | "sharded" => Ok(SpOutput::Shard),
        _ => Err(invalid(format!(
            "unknown sequence-parallel output {name:?}: gathered (every row on every rank) or shard (this rank's rows)"
        ))),
    }
}

/// The epilogue arguments both fused entry points take.
struct Epilogue<'a, 'py> {
    residual_in: &'a Bound<'py, PyAny>,
    residual_out: &'a Bound<'py, PyAny>,
    weight: Option<&'a Bound<'py, PyAny>>,
    eps: f32,
    norm_out: Option<&'a Bound<'py, PyAny>>,
    quant_out: Option<&'a Bound<'py, PyAny>>,
    scale: Option<&'a Bound<'py, PyAny>>,
    allreduce_out: Option<&'a Bound<'py, PyAny>>,
    sf_out: Option<&'a Bound<'py, PyAny>>,
    layout: SfLayout,
}

impl Epilogue<'_, '_> {
    /// The fusion of `pattern`, its tensors imported into `batch` (`what`:
    /// the entry point, for messages).
    fn fusion(&self, batch: &mut Batch, pattern: FusionPattern, hidden: usize, what: &str) -> PyResult<Fusion> {
        let rin = batch.import(self.residual_in, false, &format!("{what} residual_in"))?;
        let rout = batch.import(self.residual_out, true, &format!("{what} residual_out"))?;
        let mut fusion = Fusion::new(pattern, hidden, rin, rout);
        if let Some(w) = self.weight {
            fusion = fusion.with_norm(batch.import(w, false, &format!("{what} weight"))?, self.eps);
        }
        if let Some(t) = self.norm_out {
            fusion = fusion.with_norm_out(batch.import(t, true, &format!("{what} norm_out"))?);
        }
        match (self.quant_out, self.scale) {
            (Some(q), Some(sc)) => {
                let q = batch.import(q, true, &format!("{what} quant_out"))?;
                let sc = batch.import(sc, true, &format!("{what} scale"))?;
                fusion = fusion.with_quant(q, sc);
            }
            (None, None) => {}
            _ => {
                return Err(invalid(format!(
                    "{what}: quant_out and scale go together (the scale is read for a per-tensor FP8 pattern, \
                     written for the per-token ones)"
                )))
            }
        }
        // NVFP4's scale factors (the core refuses them on other patterns).
        if let Some(t) = self.sf_out {
            fusion.sf_out = Some(batch.import(t, true, &format!("{what} sf_out"))?);
        }
        fusion.sf_layout = self.layout;
        if let Some(t) = self.allreduce_out {
            fusion = fusion.with_allreduce_out(batch.import(t, true, &format!("{what} allreduce_out"))?);
        }
        Ok(fusion)
    }
}

fn options(name: Option<String>, timeout: Option<f64>) -> PyResult<CommOptions> {
    let mut o = CommOptions::from_env().map_err(to_pyerr)?;
    if let Some(t) = timeout {
        o.timeout = duration(t)?;
    }
    o.name = name;
    Ok(o)
}

/// One call in the making: its per-call options, the tensors imported,
/// and their owners.
pub(crate) struct Batch {
    pub(crate) opts: CallOpts,
    accepts: fn(i32) -> bool,
    backend: &'static str,
    ordinal: usize,
    gpu: bool,
    /// The stream the call runs on (raw handle), for GPU memory.
    stream: Option<u64>,
    /// The `stream` argument `__dlpack__` gets for GPU memory.
    dl_stream: Option<i64>,
    owners: Vec<Owner>,
}

impl Batch {
    /// Import `obj` (see [`Batch::import_checked`]) and keep its owner with
    /// the call: the tensor and the length of its first dimension.
    pub(crate) fn import_full(
        &mut self,
        obj: &Bound<'_, PyAny>,
        writes: bool,
        what: &str,
    ) -> PyResult<(Tensor, usize)> {
        let imp = self.import_checked(obj, writes, what)?;
        let t = imp.tensor();
        let rows = imp.rows;
        self.owners.push(imp.owner);
        Ok((t, rows))
    }

    /// Import `obj` and check it is this communicator's memory; the owner
    /// is the caller's to keep. Heap tensors are taken as they are (held,
    /// not exported).
    pub(crate) fn import_checked(&mut self, obj: &Bound<'_, PyAny>, writes: bool, what: &str) -> PyResult<Imported> {
        let refuse = |m: String| Err(invalid(format!("{what}: {m}")));
        let fast = match self.stream {
            Some(s) => torch_tensor::import_current(obj, s)?,
            None => None,
        };
        let imp: Imported = match (fast, obj.cast::<PyHeapTensor>()) {
            (Some(imp), _) => imp,
            (None, Ok(h)) => h.get().lend(obj)?,
            (None, Err(_)) => self.import_dlpack(obj, what)?,
        };
        if !(self.accepts)(imp.device_type) {
            return refuse(format!(
                "its memory is on DLPack device type {} but this communicator runs on the {} backend (CPU arrays \
                 go to a host communicator, GPU tensors to a GPU one)",
                imp.device_type, self.backend
            ));
        }
        if self.gpu && imp.device_type != KDL_CUDA_MANAGED && imp.device_id as usize != self.ordinal {
            return refuse(format!(
                "it is on {} device {} but this communicator uses device {}",
                self.backend, imp.device_id, self.ordinal
            ));
        }
        if writes && imp.readonly {
            return refuse("it is read-only, and the collective writes into it".into());
        }
        Ok(imp)
    }

    /// `obj` through DLPack, exported for the call's stream where it is
    /// GPU memory.
    fn import_dlpack(&self, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Imported> {
        let dl = self.dl_stream;
        let gpu_memory = |t: i32| matches!(t, KDL_CUDA | KDL_ROCM | KDL_CUDA_MANAGED);
        // Before the export: a producer asked for our stream on another
        // device refuses with its own error (torch: BufferError).
        if let Ok((t, id)) = dlpack::device_of(obj) {
            if self.gpu && gpu_memory(t) && t != KDL_CUDA_MANAGED && id as usize != self.ordinal {
                return Err(invalid(format!(
                    "{what}: it is on {} device {id} but this communicator uses device {}",
                    self.backend, self.ordinal
                )));
            }
        }
        dlpack::import(obj, |t| if gpu_memory(t) { dl } else { None })
    }

    /// Keep `owner` with the call too (memory it uses that no argument names).
    pub(crate) fn hold(&mut self, owner: Owner) {
        self.owners.push(owner);
    }

    pub(crate) fn import(&mut self, obj: &Bound<'_, PyAny>, writes: bool, what: &str) -> PyResult<Tensor> {
        self.import_full(obj, writes, what).map(|(t, _)| t)
    }

    fn import_list(&mut self, list: &Bound<'_, PyAny>, writes: bool, what: &str) -> PyResult<Vec<Tensor>> {
        let mut out = Vec::new();
        for (i, item) in list.try_iter()?.enumerate() {
            out.push(self.import(&item?, writes, &format!("{what}[{i}]"))?);
        }
        Ok(out)
    }

    /// The reduction of `op` (a name: "sum", "premul_sum", ...), with
    /// premul_sum's factor: a number, or a one-element tensor read when the
    /// collective runs (so a CUDA graph replay sees its current value).
    fn reduction(&mut self, op: &str, factor: Option<&Bound<'_, PyAny>>) -> PyResult<Reduction> {
        let premul = matches!(
            op.to_ascii_lowercase().replace('-', "_").as_str(),
            "premul_sum" | "premulsum"
        );
        match (premul, factor) {
            (true, Some(f)) if f.is_instance_of::<PyFloat>() || f.is_instance_of::<PyInt>() => {
                Ok(Reduction::premul_sum(f.extract::<f64>()?))
            }
            (true, Some(f)) => Ok(Reduction::premul_sum_device(self.import(
                f,
                false,
                "premul_sum factor",
            )?)),
            (true, None) => Err(invalid("premul_sum needs a factor (a number or a one-element tensor)")),
            (false, None) => Ok(Reduction::Op(op.parse::<ReduceOp>().map_err(to_pyerr)?)),
            (false, Some(_)) => Err(invalid(format!("a factor goes with premul_sum, not with {op}"))),
        }
    }
}

/// The one path every collective ends in: queue `$body` (a call of the
/// Rust communicator `$c` with `$call`, the `&ferrocomm::Call` that the
/// batch's [`CallOpts`] make) on whichever backend this communicator has,
/// with the GIL released ([`CallOpts::enqueue`]), then finish the call
/// ([`PyComm::finish`]; `blocking`: wait even on a stream, as a barrier does).
macro_rules! launch {
    ($self:ident, $py:ident, $batch:ident, $what:literal, |$c:ident, $call:ident| $body:expr) => {
        launch!($self, $py, $batch, $what, false, |$c, $call| $body)
    };
    ($self:ident, $py:ident, $batch:ident, $what:literal, $blocking:expr, |$c:ident, $call:ident| $body:expr) => {{
        let opts = &$batch.opts;
        let res = with_any!(&*$self.comm, AnyComm, |$c| opts.enqueue($py, $c, |$call| $body));
        $self.finish($py, res, $batch, $what, $blocking)
    }};
}

/// A communicator (native part of `ferrocomm.Communicator`).
#[pyclass(frozen, name = "Comm", module = "ferrocomm._ferrocomm")]
pub struct PyComm {
    comm: Arc<AnyComm>,
    store: Arc<dyn Store>,
    /// The environment rendezvous this communicator (or the one it was made
    /// from: splits, the host sibling) came from; rank 0 hosts its store
    /// server until every rank has left it (`membership`).
    member: Option<Member>,
    outstanding: Outstanding,
    /// Holds on this communicator's heap and window memory handed out
    /// through DLPack: `finalize` refuses while any is out.
    lender: Arc<Counter>,
}

impl PyComm {
    fn new(comm: AnyComm, store: Arc<dyn Store>, membership: Option<&Arc<Membership>>) -> Self {
        PyComm {
            comm: Arc::new(comm),
            store,
            member: membership.map(Member::enter),
            outstanding: Arc::new(Mutex::new(Vec::new())),
            lender: Counter::new(),
        }
    }

    /// This communicator makes no more store requests.
    fn leave(&self) {
        if let Some(m) = &self.member {
            m.leave();
        }
    }

    fn derived(&self, comm: AnyComm) -> PyComm {
        PyComm::new(comm, self.store.clone(), self.member.as_ref().map(Member::membership))
    }

    /// Start a call with the per-call options `opts` (the calls that take
    /// none, such as `register`, pass the defaults).
    pub(crate) fn batch(&self, opts: CallOpts) -> Batch {
        let (accepts, backend, ordinal, own): (fn(i32) -> bool, _, _, _) = with_any!(&*self.comm, AnyComm, |c| (
            accepts_of(c),
            backend_of(c),
            c.device().facts().ordinal,
            c.device().raw_stream(c.stream())
        ));
        let gpu = backend != "host";
        // CUDA's legacy default stream is handle 0 to the driver but 1 in
        // DLPack (which reserves 0 as ambiguous there); HIP keeps 0.
        let raw = opts.stream.or(own);
        let dl_stream = raw.map(|r| if r == 0 && backend == "cuda" { 1 } else { r as i64 });
        Batch {
            opts,
            accepts,
            backend,
            ordinal,
            gpu,
            stream: if gpu { raw } else { None },
            dl_stream: if gpu { dl_stream } else { None },
            owners: Vec::new(),
        }
    }

    /// Let go of completed work now (what it holds may then be freed),
    /// raising the first failure among it, as the next call would.
    pub(crate) fn settle(&self) -> PyResult<()> {
        match self.prune() {
            Some(e) => Err(to_pyerr(e)),
            None => Ok(()),
        }
    }

    /// The communicator and its lender, for the objects made on it in
    /// other files (`overlap.rs`).
    pub(crate) fn parts(&self) -> (&Arc<AnyComm>, &Arc<Counter>) {
        (&self.comm, &self.lender)
    }

    fn call_timeout(&self, opts: &CallOpts) -> Duration {
        opts.timeout
            .unwrap_or_else(|| with_any!(&*self.comm, AnyComm, |c| c.options().timeout))
    }

    /// Let go of the memory of outstanding work that has completed, and
    /// return the first failure among it: stream-ordered work nobody waits
    /// on reports a dead peer or a mismatch at the next call, as NCCL's
    /// asynchronous errors do.
    fn prune(&self) -> Option<Error> {
        let done: Vec<Pending> = {
            let mut list = lock(&self.outstanding);
            let (done, left): (Vec<_>, Vec<_>) = list.drain(..).partition(Pending::is_completed);
            *list = left;
            done
        };
        done.iter().find_map(Pending::failure)
    }

    /// After the collective was queued (or failed to be): a `Work` for
    /// `async_op`; else wait where the caller has no stream ordered after
    /// the collective (host backend, GPU calls without a stream, and
    /// `blocking` calls, barriers, unless the stream captures a graph), and
    /// keep the memory until the work completes either way.
    pub(crate) fn finish(
        &self,
        py: Python<'_>,
        res: Result<(AnyWork, bool), Failure>,
        batch: Batch,
        what: &'static str,
        blocking: bool,
    ) -> PyResult<Option<PyWork>> {
        let opts = &batch.opts;
        let (work, capturing) = match res {
            Ok(v) => v,
            Err(f) => {
                // Validation errors come before anything is queued; anything
                // else may have queued part of the call, whose memory must
                // then stay until the communicator goes.
                let validation = matches!(f, Failure::Rust(Error::InvalidArgument(_)));
                if !validation && !batch.owners.is_empty() {
                    lock(&self.outstanding).push(Pending {
                        work: None,
                        owners: batch.owners,
                    });
                }
                return Err(f.into());
            }
        };
        let pending = Pending {
            work: Some(work),
            owners: batch.owners,
        };
        // An event query while a stream captures a graph would invalidate
        // the capture (CUDA's global capture mode): tidy up only outside one.
        if !capturing {
            if let Some(e) = self.prune() {
                // An earlier call failed; this one was queued on an aborted
                // communicator (its kernels exit at once). Keep its memory.
                lock(&self.outstanding).push(pending);
                return Err(to_pyerr(e));
            }
        }
        let call_timeout = self.call_timeout(opts);
        if opts.async_op {
            return Ok(Some(PyWork::new(
                pending,
                self.comm.clone(),
                self.outstanding.clone(),
                call_timeout,
                what,
            )));
        }
        if (blocking && !capturing) || !batch.gpu || opts.stream.is_none() {
            if let Some(w) = &pending.work {
                if let Err(e) = crate::work::wait(py, w, &self.comm, None, call_timeout, what) {
                    if !pending.is_completed() {
                        lock(&self.outstanding).push(pending);
                    }
                    return Err(e);
                }
            }
            return Ok(None);
        }
        lock(&self.outstanding).push(pending);
        Ok(None)
    }
}

fn accepts_of<D: Backend>(_: &ferrocomm::Communicator<D>) -> fn(i32) -> bool {
    D::accepts
}

fn backend_of<D: Backend>(_: &ferrocomm::Communicator<D>) -> &'static str {
    D::NAME
}

#[pymethods]
impl PyComm {
    /// Rendezvous through the launcher's environment (torchrun, or
    /// MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE and FERROCOMM_TOKEN), then
    /// create the communicator on `device` (default: LOCAL_RANK).
    #[staticmethod]
    #[pyo3(signature = (backend, device=None, name=None, timeout=None))]
    fn from_env(
        py: Python<'_>,
        backend: &str,
        device: Option<usize>,
        name: Option<String>,
        timeout: Option<f64>,
    ) -> PyResult<PyComm> {
        let opts = options(name, timeout)?;
        let backend = backend.to_string();
        let wait = opts.timeout;
        let (comm, rdv) = run_interruptible(py, move || {
            let rdv = rendezvous_from_env()?;
            let ordinal = device.unwrap_or(rdv.local_rank);
            let comm = backend::create(&backend, ordinal, rdv.store.clone(), rdv.rank, rdv.world, opts)?;
            Ok((comm, rdv))
        })?;
        let membership = Membership::join(rdv, wait);
        Ok(PyComm::new(comm, membership.store(), Some(&membership)))
    }

    /// Create the communicator over a Python store object (a
    /// torch.distributed `Store`, or anything with its methods), as rank
    /// `rank` of `world_size`.
    #[staticmethod]
    #[pyo3(signature = (store, rank, world_size, backend, device, name=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn from_store(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        world_size: usize,
        backend: &str,
        device: usize,
        name: Option<String>,
        timeout: Option<f64>,
    ) -> PyResult<PyComm> {
        let opts = options(name, timeout)?;
        let store: Arc<dyn Store> = Arc::new(PyStore::new(store));
        let (s, backend) = (store.clone(), backend.to_string());
        let comm = run_interruptible(py, move || backend::create(&backend, device, s, rank, world_size, opts))?;
        Ok(PyComm::new(comm, store, None))
    }

    /// Another communicator of the same ranks over the same store, on
    /// `backend` (the host communicator a GPU one sends CPU arrays to).
    /// Collective.
    #[pyo3(signature = (backend, name=None))]
    fn sibling(&self, py: Python<'_>, backend: &str, name: Option<String>) -> PyResult<PyComm> {
        let (rank, world, ordinal, mut opts) = with_any!(&*self.comm, AnyComm, |c| (
            c.rank(),
            c.size(),
            c.device().facts().ordinal,
            c.options().clone()
        ));
        opts.name = name;
        let (store, backend) = (self.store.clone(), backend.to_string());
        let comm = run_interruptible(py, move || backend::create(&backend, ordinal, store, rank, world, opts))?;
        Ok(self.derived(comm))
    }

    #[getter]
    fn rank(&self) -> usize {
        with_any!(&*self.comm, AnyComm, |c| c.rank())
    }

    #[getter]
    fn size(&self) -> usize {
        with_any!(&*self.comm, AnyComm, |c| c.size())
    }

    #[getter]
    fn name(&self) -> String {
        with_any!(&*self.comm, AnyComm, |c| c.name().to_string())
    }

    /// `host`, `cuda` or `rocm`.
    #[getter]
    fn backend(&self) -> &'static str {
        with_any!(&*self.comm, AnyComm, |c| backend_of(c))
    }

    /// The device ordinal (the GPU index; a label on the host backend).
    #[getter]
    fn device(&self) -> usize {
        with_any!(&*self.comm, AnyComm, |c| c.device().facts().ordinal)
    }

    /// The communicator's default timeout, in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        with_any!(&*self.comm, AnyComm, |c| c.options().timeout.as_secs_f64())
    }

    /// Whether NCCL/RCCL runs underneath.
    #[getter]
    fn has_vendor_library(&self) -> bool {
        with_any!(&*self.comm, AnyComm, |c| c.has_vendor_library())
    }

    /// The raw handle of the communicator's own stream (0 on the host).
    #[getter]
    fn stream_handle(&self) -> u64 {
        with_any!(&*self.comm, AnyComm, |c| c.device().raw_stream(c.stream()).unwrap_or(0))
    }

    /// Compile and load every kernel later calls may need (do it before a
    /// CUDA graph capture, so the capture never waits for a compiler).
    fn prepare(&self, py: Python<'_>) -> PyResult<()> {
        let comm = &*self.comm;
        run(py, || with_any!(comm, AnyComm, |c| c.prepare()))
    }

    // ------------------------------------------------------------ collectives

    #[pyo3(signature = (tensor, op, factor=None, *, opts=CallOpts::default()))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        op: &str,
        factor: Option<&Bound<'_, PyAny>>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let t = batch.import(tensor, true, "all_reduce tensor")?;
        let red = batch.reduction(op, factor)?;
        launch!(self, py, batch, "all_reduce", |c, call| c.all_reduce(t, red, call))
    }

    /// Out of place: `output` (as long as `input`) receives the reduction
    /// of every rank's `input` (vLLM's custom all-reduce is out of place).
    #[pyo3(signature = (output, input, op, factor=None, *, opts=CallOpts::default()))]
    fn all_reduce_into(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        op: &str,
        factor: Option<&Bound<'_, PyAny>>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let out = batch.import(output, true, "all_reduce output")?;
        let inp = batch.import(input, false, "all_reduce input")?;
        let red = batch.reduction(op, factor)?;
        launch!(self, py, batch, "all_reduce", |c, call| c
            .all_reduce_into(inp, out, red, call))
    }

    /// All-reduce (sum) of `input` (tokens x `hidden`, f16/bf16) fused with
    /// a residual add, an RMSNorm and a quantized output, as `pattern`
    /// says (`Communicator::all_reduce_fused`; names in `fusion_pattern`).
    /// With `expanded_idx_to_permuted_idx`, `expert_scales` and `topk` (all
    /// three or none; `shared_expert_output` optional, only with them), the
    /// MoE-finalize prologue (`Fusion::with_moe_finalize`): `input` is then
    /// the experts' output (permuted_rows x `hidden`) and `residual_in`
    /// gives the tokens.
    #[pyo3(signature = (input, residual_in, residual_out, pattern, hidden, weight=None, eps=1e-6, norm_out=None,
        quant_out=None, scale=None, allreduce_out=None, expanded_idx_to_permuted_idx=None, expert_scales=None,
        topk=None, shared_expert_output=None, sf_out=None, sf_layout="swizzled", *, opts=CallOpts::default()))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_fused(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        residual_in: &Bound<'_, PyAny>,
        residual_out: &Bound<'_, PyAny>,
        pattern: &str,
        hidden: usize,
        weight: Option<&Bound<'_, PyAny>>,
        eps: f32,
        norm_out: Option<&Bound<'_, PyAny>>,
        quant_out: Option<&Bound<'_, PyAny>>,
        scale: Option<&Bound<'_, PyAny>>,
        allreduce_out: Option<&Bound<'_, PyAny>>,
        expanded_idx_to_permuted_idx: Option<&Bound<'_, PyAny>>,
        expert_scales: Option<&Bound<'_, PyAny>>,
        topk: Option<i64>,
        shared_expert_output: Option<&Bound<'_, PyAny>>,
        sf_out: Option<&Bound<'_, PyAny>>,
        sf_layout: &str,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let pattern = fusion_pattern(pattern)?;
        let layout = self::sf_layout(sf_layout)?;
        // The MoE prologue's arguments, checked before anything is
        // imported: all of the routing or none of it.
        let moe = match (expanded_idx_to_permuted_idx, expert_scales, topk) {
            (Some(idx), Some(sc), Some(k)) => {
                let k = usize::try_from(k).ok().filter(|k| (1..=MOE_MAX_TOPK).contains(k));
                let Some(k) = k else {
                    return Err(invalid(format!(
                        "all_reduce_fused: topk = {} must be 1 to {MOE_MAX_TOPK}",
                        topk.unwrap_or_default()
                    )));
                };
                Some((idx, sc, k))
            }
            (None, None, None) if shared_expert_output.is_none() => None,
            _ => {
                let given = |x: bool| if x { "given" } else { "missing" };
                return Err(invalid(format!(
                    "all_reduce_fused: the MoE-finalize prologue takes expanded_idx_to_permuted_idx, expert_scales \
                     and topk together (shared_expert_output only with them): expanded_idx_to_permuted_idx {}, \
                     expert_scales {}, topk {}, shared_expert_output {}",
                    given(expanded_idx_to_permuted_idx.is_some()),
                    given(expert_scales.is_some()),
                    given(topk.is_some()),
                    given(shared_expert_output.is_some()),
                )));
            }
        };
        let mut batch = self.batch(opts);
        let inp = batch.import(input, false, "all_reduce_fused input")?;
        let ep = Epilogue {
            residual_in,
            residual_out,
            weight,
            eps,
            norm_out,
            quant_out,
            scale,
            allreduce_out,
            sf_out,
            layout,
        };
        let mut fusion = ep.fusion(&mut batch, pattern, hidden, "all_reduce_fused")?;
        if let Some((idx, sc, k)) = moe {
            let idx = batch.import(idx, false, "all_reduce_fused expanded_idx_to_permuted_idx")?;
            let sc = batch.import(sc, false, "all_reduce_fused expert_scales")?;
            let mut m = MoeFinalize::new(idx, sc, k);
            if let Some(t) = shared_expert_output {
                m = m.with_shared_expert_output(batch.import(t, false, "all_reduce_fused shared_expert_output")?);
            }
            fusion = fusion.with_moe_finalize(m);
        }
        launch!(self, py, batch, "all_reduce_fused", |c, call| c
            .all_reduce_fused(inp, &fusion, call))
    }

    /// The sequence-parallel fused epilogue
    /// (`Communicator::reduce_scatter_fused`): reduce-scatter (sum) of
    /// `input` (tokens x `hidden`, tokens a multiple of the world size),
    /// the residual add with this rank's shard (`residual_in`, tokens /
    /// world rows), RMSNorm and the quantization as `pattern` says; the
    /// normed and quantized outputs hold every row (`output = "gathered"`)
    /// or this rank's (`"shard"`). `allreduce_out` is the shard's.
    #[pyo3(signature = (input, residual_in, residual_out, pattern, hidden, output, weight=None, eps=1e-6,
        norm_out=None, quant_out=None, scale=None, allreduce_out=None, sf_out=None, sf_layout="swizzled", *,
        opts=CallOpts::default()))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_fused(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        residual_in: &Bound<'_, PyAny>,
        residual_out: &Bound<'_, PyAny>,
        pattern: &str,
        hidden: usize,
        output: &str,
        weight: Option<&Bound<'_, PyAny>>,
        eps: f32,
        norm_out: Option<&Bound<'_, PyAny>>,
        quant_out: Option<&Bound<'_, PyAny>>,
        scale: Option<&Bound<'_, PyAny>>,
        allreduce_out: Option<&Bound<'_, PyAny>>,
        sf_out: Option<&Bound<'_, PyAny>>,
        sf_layout: &str,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let pattern = fusion_pattern(pattern)?;
        let layout = self::sf_layout(sf_layout)?;
        let out = sp_output(output)?;
        let mut batch = self.batch(opts);
        let inp = batch.import(input, false, "reduce_scatter_fused input")?;
        let ep = Epilogue {
            residual_in,
            residual_out,
            weight,
            eps,
            norm_out,
            quant_out,
            scale,
            allreduce_out,
            sf_out,
            layout,
        };
        let fusion = ep
            .fusion(&mut batch, pattern, hidden, "reduce_scatter_fused")?
            .with_seq_parallel(out);
        launch!(self, py, batch, "reduce_scatter_fused", |c, call| c
            .reduce_scatter_fused(inp, &fusion, call))
    }

    #[pyo3(signature = (tensor, root, *, opts=CallOpts::default()))]
    fn broadcast(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        root: usize,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let t = batch.import(tensor, true, "broadcast tensor")?;
        launch!(self, py, batch, "broadcast", |c, call| c.broadcast(t, root, call))
    }

    #[pyo3(signature = (tensor, root, op, factor=None, *, opts=CallOpts::default()))]
    fn reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        root: usize,
        op: &str,
        factor: Option<&Bound<'_, PyAny>>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let t = batch.import(tensor, true, "reduce tensor")?;
        let red = batch.reduction(op, factor)?;
        launch!(self, py, batch, "reduce", |c, call| c.reduce(t, red, root, call))
    }

    #[pyo3(signature = (tensor_list, tensor, *, opts=CallOpts::default()))]
    fn all_gather(
        &self,
        py: Python<'_>,
        tensor_list: &Bound<'_, PyAny>,
        tensor: &Bound<'_, PyAny>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let outs = batch.import_list(tensor_list, true, "all_gather tensor_list")?;
        let input = batch.import(tensor, false, "all_gather tensor")?;
        launch!(self, py, batch, "all_gather", |c, call| c
            .all_gather(&outs, input, call))
    }

    #[pyo3(signature = (output, input, *, opts=CallOpts::default()))]
    fn all_gather_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let out = batch.import(output, true, "all_gather_single output")?;
        let inp = batch.import(input, false, "all_gather_single input")?;
        launch!(self, py, batch, "all_gather", |c, call| c
            .all_gather_single(out, inp, call))
    }

    #[pyo3(signature = (output, input_list, op, factor=None, *, opts=CallOpts::default()))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input_list: &Bound<'_, PyAny>,
        op: &str,
        factor: Option<&Bound<'_, PyAny>>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let out = batch.import(output, true, "reduce_scatter output")?;
        let ins = batch.import_list(input_list, false, "reduce_scatter input_list")?;
        let red = batch.reduction(op, factor)?;
        launch!(self, py, batch, "reduce_scatter", |c, call| c
            .reduce_scatter(out, &ins, red, call))
    }

    #[pyo3(signature = (output, input, op, factor=None, *, opts=CallOpts::default()))]
    fn reduce_scatter_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        op: &str,
        factor: Option<&Bound<'_, PyAny>>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let out = batch.import(output, true, "reduce_scatter_single output")?;
        let inp = batch.import(input, false, "reduce_scatter_single input")?;
        let red = batch.reduction(op, factor)?;
        launch!(self, py, batch, "reduce_scatter", |c, call| c
            .reduce_scatter_single(out, inp, red, call))
    }

    #[pyo3(signature = (output_list, input_list, *, opts=CallOpts::default()))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        output_list: &Bound<'_, PyAny>,
        input_list: &Bound<'_, PyAny>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let outs = batch.import_list(output_list, true, "all_to_all output_list")?;
        let ins = batch.import_list(input_list, false, "all_to_all input_list")?;
        launch!(self, py, batch, "all_to_all", |c, call| c.all_to_all(&outs, &ins, call))
    }

    /// `output_split_sizes` / `input_split_sizes` count rows (slices along
    /// the first dimension), as torch's do; empty or None: equal splits,
    /// which every rank then shares, so small blocks take the LL kernel
    /// (every rank of one call must pass splits, or none).
    #[pyo3(signature = (output, input, output_split_sizes=None, input_split_sizes=None, *,
        opts=CallOpts::default()))]
    fn all_to_all_v_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        output_split_sizes: Option<Vec<usize>>,
        input_split_sizes: Option<Vec<usize>>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let (out, out_rows) = batch.import_full(output, true, "all_to_all output")?;
        let (inp, in_rows) = batch.import_full(input, false, "all_to_all input")?;
        let outs = rows_to_elements(output_split_sizes.unwrap_or_default(), &out, out_rows, "output")?;
        let ins = rows_to_elements(input_split_sizes.unwrap_or_default(), &inp, in_rows, "input")?;
        launch!(self, py, batch, "all_to_all", |c, call| c
            .all_to_all_v_single(out, inp, &outs, &ins, call))
    }

    #[pyo3(signature = (output, input, *, opts=CallOpts::default()))]
    fn all_to_all_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let out = batch.import(output, true, "all_to_all_single output")?;
        let inp = batch.import(input, false, "all_to_all_single input")?;
        launch!(self, py, batch, "all_to_all", |c, call| c
            .all_to_all_single(out, inp, call))
    }

    /// `output_list` matters on the root only (elsewhere it may be empty).
    #[pyo3(signature = (output_list, input, root, *, opts=CallOpts::default()))]
    fn gather(
        &self,
        py: Python<'_>,
        output_list: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        root: usize,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let outs = batch.import_list(output_list, true, "gather output_list")?;
        let inp = batch.import(input, false, "gather input")?;
        launch!(self, py, batch, "gather", |c, call| c.gather(&outs, inp, root, call))
    }

    /// `input_list` matters on the root only (elsewhere it may be empty).
    #[pyo3(signature = (output, input_list, root, *, opts=CallOpts::default()))]
    fn scatter(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input_list: &Bound<'_, PyAny>,
        root: usize,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let out = batch.import(output, true, "scatter output")?;
        let ins = batch.import_list(input_list, false, "scatter input_list")?;
        launch!(self, py, batch, "scatter", |c, call| c.scatter(out, &ins, root, call))
    }

    #[pyo3(signature = (tensor, dst, *, opts=CallOpts::default()))]
    fn send(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>, dst: usize, opts: CallOpts) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let t = batch.import(tensor, false, "send tensor")?;
        launch!(self, py, batch, "send", |c, call| c.send(t, dst, call))
    }

    #[pyo3(signature = (tensor, src, *, opts=CallOpts::default()))]
    fn recv(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>, src: usize, opts: CallOpts) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let t = batch.import(tensor, true, "recv tensor")?;
        launch!(self, py, batch, "recv", |c, call| c.recv(t, src, call))
    }

    /// Sends and receives as one group: `ops` is a list of
    /// `(is_send, tensor, peer)`.
    #[pyo3(signature = (ops, *, opts=CallOpts::default()))]
    fn batch_p2p(
        &self,
        py: Python<'_>,
        ops: Vec<(bool, Bound<'_, PyAny>, usize)>,
        opts: CallOpts,
    ) -> PyResult<Option<PyWork>> {
        let mut batch = self.batch(opts);
        let mut list = Vec::with_capacity(ops.len());
        for (i, (is_send, t, peer)) in ops.iter().enumerate() {
            let what = format!("batch_p2p op {i}");
            list.push(match is_send {
                true => P2p::Send(batch.import(t, false, &what)?, *peer),
                false => P2p::Recv(batch.import(t, true, &what)?, *peer),
            });
        }
        launch!(self, py, batch, "batch_p2p", |c, call| c.batch_p2p(&list, call))
    }

    /// Every rank waits for every other. Without `async_op` it blocks the
    /// calling thread (on GPUs too), as a barrier is expected to.
    #[pyo3(signature = (*, opts=CallOpts::default()))]
    fn barrier(&self, py: Python<'_>, opts: CallOpts) -> PyResult<Option<PyWork>> {
        let batch = self.batch(opts);
        launch!(self, py, batch, "barrier", true, |c, call| c.barrier(call))
    }

    // ------------------------------------------------------------ life cycle

    /// A communicator of `ranks` (ranks of this one, in the new order), or
    /// None on a rank not in the list. Collective over this communicator.
    #[pyo3(signature = (ranks, name=None))]
    fn split(&self, py: Python<'_>, ranks: Vec<usize>, name: Option<String>) -> PyResult<Option<PyComm>> {
        let comm = self.comm.clone();
        let made = run_interruptible(py, move || {
            with_any!(&*comm, AnyComm, |c| c
                .split(&ranks, name.as_deref())
                .map(|o| o.map(Backend::wrap_comm)))
        })?;
        Ok(made.map(|c| self.derived(c)))
    }

    /// Make the communicator unusable now: queued work exits without
    /// waiting for peers; later calls raise `Aborted`.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        let comm = &*self.comm;
        let r = run(py, || with_any!(comm, AnyComm, |c| c.abort()));
        self.leave();
        r
    }

    /// Drain queued work and release the workspace (the symmetric heap with
    /// it: heap tensors and windows not freed go here); later calls raise
    /// `Finalized`. Refused while DLPack views of heap or window memory
    /// (NumPy arrays, torch tensors) are held: they would outlive it.
    fn finalize(&self, py: Python<'_>) -> PyResult<()> {
        if let Err(n) = self.lender.close("finalized") {
            return Err(invalid(format!(
                "finalize: {n} DLPack view(s) of this communicator's heap tensors, windows or EP buffers (NumPy \
                 arrays, torch tensors, map_remote_tensor views, dispatch results) are still held; let them go first"
            )));
        }
        let comm = &*self.comm;
        let r = run(py, || with_any!(comm, AnyComm, |c| c.finalize()));
        // Finalize drained the stream: every outstanding work is complete
        // (its failures were the caller's to collect earlier).
        let _ = self.prune();
        // Done with the store whatever finalize returned: it is not retried.
        self.leave();
        r
    }

    /// Register `tensor` with every peer (collective): each rank maps the
    /// others' registered memory. Kept alive until `deregister`.
    fn register(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<PyRegistration> {
        let mut batch = self.batch(CallOpts::default());
        let t = batch.import(tensor, false, "register tensor")?;
        let comm = &*self.comm;
        let reg = run(py, || with_any!(comm, AnyComm, |c| c.register(t)))?;
        Ok(PyRegistration {
            reg,
            comm: self.comm.clone(),
            owners: Mutex::new(batch.owners),
        })
    }

    // ------------------------------------------------------------ heap, windows

    /// A tensor of `shape` and `dtype` (a name: float32, bfloat16, ...) in
    /// the symmetric heap: collective, every rank the same shape and dtype in
    /// the same order; the same offset on every rank; zeroed.
    fn heap_tensor(&self, py: Python<'_>, shape: Vec<i64>, dtype: &str) -> PyResult<PyHeapTensor> {
        PyHeapTensor::alloc(py, &self.comm, &self.lender, shape, dtype)
    }

    /// A one-sided window with no buffer yet (collective: its signal words
    /// come from the heap).
    fn new_window(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<PyWindow> {
        let me = slf.get();
        PyWindow::create(py, slf.clone().unbind(), &me.comm, &me.lender)
    }

    /// An expert-parallel dispatch/combine buffer on the heap (collective:
    /// every rank the same config, in the same order as its other heap
    /// allocations). `dtype`: the dispatched rows, bfloat16 or float8_e4m3fn.
    #[pyo3(signature = (num_experts, hidden, max_tokens_per_rank, topk, dtype="bfloat16"))]
    fn ep_buffer(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        num_experts: i64,
        hidden: i64,
        max_tokens_per_rank: i64,
        topk: i64,
        dtype: &str,
    ) -> PyResult<PyEpBuffer> {
        let me = slf.get();
        let shape = EpShape {
            num_experts,
            hidden,
            max_tokens_per_rank,
            topk,
            dtype,
        };
        PyEpBuffer::create(py, slf.clone().unbind(), &me.comm, &me.lender, shape)
    }

    /// A metadata broadcaster from `writer` to every other rank, with ring
    /// slots of `max_bytes` (collective: every rank the same arguments).
    #[pyo3(signature = (max_bytes, writer=0, slots=None))]
    fn broadcaster(&self, py: Python<'_>, max_bytes: i64, writer: i64, slots: Option<i64>) -> PyResult<PyBroadcaster> {
        crate::broadcaster::create(py, &self.comm, max_bytes, writer, slots)
    }

    /// The device API's context (`FcDevCtx`, 104 bytes) for kernels of your
    /// own; the heap must exist (after a first heap_tensor or new_window).
    fn device_ctx_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        crate::heap::device_ctx_bytes(py, &self.comm)
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferrocomm.Comm {} rank {} of {} on {}:{}>",
            self.name(),
            self.rank(),
            self.size(),
            self.backend(),
            self.device()
        )
    }
}

/// Split sizes in rows of a tensor's first dimension, as element counts.
fn rows_to_elements(rows: Vec<usize>, t: &Tensor, nrows: usize, what: &str) -> PyResult<Vec<usize>> {
    if rows.is_empty() {
        return Ok(rows);
    }
    let per_row = t.count().checked_div(nrows).unwrap_or(0);
    rows.iter()
        .map(|r| r.checked_mul(per_row))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| invalid(format!("all_to_all: {what} split sizes overflow")))
}

/// A registered tensor (`Comm.register`).
#[pyclass(frozen, name = "Registration", module = "ferrocomm._ferrocomm")]
pub struct PyRegistration {
    reg: Registration,
    comm: Arc<AnyComm>,
    owners: Mutex<Vec<Owner>>,
}

#[pymethods]
impl PyRegistration {
    /// Rank `rank`'s registered tensor as mapped in this process:
    /// `(address, element count, dtype name)`, for kernels of your own that
    /// load and store through it.
    fn peer_tensor(&self, py: Python<'_>, rank: usize) -> PyResult<(u64, usize, &'static str)> {
        let (comm, reg) = (&*self.comm, self.reg);
        let t = run(py, || with_any!(comm, AnyComm, |c| c.peer_tensor(&reg, rank)))?;
        Ok((t.ptr().0, t.count(), t.dtype().name()))
    }

    /// Unmap the peers' memory here and let the tensor go (local).
    fn deregister(&self, py: Python<'_>) -> PyResult<()> {
        let (comm, reg) = (&*self.comm, self.reg);
        run(py, || with_any!(comm, AnyComm, |c| c.deregister(reg)))?;
        // Dropped with the lock let go: an owner's drop may run Python code,
        // which may let another thread take the GIL and then wait for the lock.
        let owners = std::mem::take(&mut *lock(&self.owners));
        drop(owners);
        Ok(())
    }
}
