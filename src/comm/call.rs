//! Per-call options ([`Call`]) and reductions with a factor ([`Reduction`]).

use std::collections::BTreeMap;
use std::time::Duration;

use super::tensor::Tensor;
use crate::algo::AlgoChoice;
use crate::device::Device;
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};

/// Options of one collective call, as torchcomms has them: the stream it
/// runs on, a timeout, and hints.
///
/// - `stream`: the caller's stream ([`Device::borrow_stream`] wraps a raw
///   `CUstream`/`hipStream_t`); the communicator's own stream when unset.
/// - `timeout`: the bound on this call's waits (in kernels and in
///   [`super::Work::wait`]); the communicator's when unset.
/// - `hints`: string pairs. ferrocomm reads `algo` (as `FERROCOMM_ALGO`
///   takes it: `oneshot-ll`, `twoshot-push`, `nccl`, ...); other keys are
///   ignored, so hints meant for other backends do no harm.
pub struct Call<'s, D: Device> {
    pub(crate) stream: Option<&'s D::Stream>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) hints: BTreeMap<String, String>,
    algo: Option<AlgoChoice>,
}

impl<D: Device> Default for Call<'_, D> {
    fn default() -> Self {
        Call {
            stream: None,
            timeout: None,
            hints: BTreeMap::new(),
            algo: None,
        }
    }
}

impl<'s, D: Device> Call<'s, D> {
    /// Defaults: the communicator's stream and timeout, no hints.
    pub fn new() -> Self {
        Self::default()
    }

    /// Run on `stream` (stream-ordered: it may be captured into a graph).
    pub fn on(stream: &'s D::Stream) -> Self {
        Call {
            stream: Some(stream),
            ..Self::default()
        }
    }

    pub fn stream(mut self, stream: &'s D::Stream) -> Self {
        self.stream = Some(stream);
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    pub fn hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }

    /// Force an algorithm for this call (an all-reduce's; as the `algo` hint).
    pub fn algo(mut self, algo: AlgoChoice) -> Self {
        self.algo = Some(algo);
        self
    }

    /// The algorithm asked for: [`Call::algo`], else the `algo` hint.
    pub(crate) fn asked_algo(&self) -> Result<Option<AlgoChoice>> {
        match self.algo {
            Some(a) => Ok(Some(a)),
            None => self.hints.get("algo").map(|a| a.parse()).transpose(),
        }
    }
}

/// premul_sum's factor: a host value, or one element of the call's dtype in
/// device memory (read when the collective runs, so a graph replay sees its
/// current value).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Factor {
    Host(f64),
    Device(Tensor),
}

/// A reduction: an operator, and for premul_sum its factor.
///
/// premul_sum's rule: every input element is multiplied by the factor (in
/// f32, the factor rounded to f32) before the f32 sum in rank order, and the
/// sum is rounded once to the dtype. It is reduced by the host reference and
/// by NCCL/RCCL on GPUs (whose bits may differ).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reduction {
    Op(ReduceOp),
    PreMulSum(Factor),
}

impl From<ReduceOp> for Reduction {
    fn from(op: ReduceOp) -> Self {
        Reduction::Op(op)
    }
}

impl Reduction {
    pub fn premul_sum(factor: f64) -> Self {
        Reduction::PreMulSum(Factor::Host(factor))
    }

    /// The factor is one element of the call's dtype at `factor`.
    pub fn premul_sum_device(factor: Tensor) -> Self {
        Reduction::PreMulSum(Factor::Device(factor))
    }

    pub fn op(&self) -> ReduceOp {
        match self {
            Reduction::Op(op) => *op,
            Reduction::PreMulSum(_) => ReduceOp::PreMulSum,
        }
    }

    /// The factor, checked: `ReduceOp::PreMulSum` alone has none.
    pub(crate) fn factor(&self) -> Result<Option<Factor>> {
        match self {
            Reduction::Op(ReduceOp::PreMulSum) => Err(Error::invalid(
                "premul_sum needs a factor: pass Reduction::premul_sum(f) or Reduction::premul_sum_device(t)",
            )),
            Reduction::Op(_) => Ok(None),
            Reduction::PreMulSum(f) => Ok(Some(*f)),
        }
    }
}
