//! Per-call options ([`Call`]) and reductions with a factor ([`Reduction`]).

use std::collections::BTreeMap;
use std::time::Duration;

use super::tensor::Tensor;
use crate::device::Device;
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};
use crate::plan::{parse_choice, Algorithm};

/// Options of one collective call, as torchcomms has them: the stream it
/// runs on, a timeout, and hints.
///
/// - `stream`: the caller's stream ([`Device::borrow_stream`] wraps a raw
///   `CUstream`/`hipStream_t`); the communicator's own stream when unset.
/// - `timeout`: the bound on this call's waits (in kernels and in
///   [`super::Work::wait`]); the communicator's when unset.
/// - `hints`: string pairs. ferrocomm reads `algo` (an all-reduce's, as
///   `FERROCOMM_ALGO` takes it: `oneshot-ll`, `twoshot-push`, `vendor`,
///   ...) and `coll_algo` (the other collectives': `ll`, `inbox`, `kernels`,
///   `vendor` or `auto`; see [`Call::coll_algo`]), both names of one
///   [`Algorithm`]; other keys are ignored, so hints meant for other
///   backends do no harm. A value ferrocomm cannot read is an
///   `InvalidArgument` error before anything runs.
///
/// Precedence: what a call asks for wins over the communicator's options
/// (`FERROCOMM_ALGO`, `FERROCOMM_COLL_ROUTE`, `FERROCOMM_COLL_LL_BYTES`),
/// which win over the dispatch table (autotune's, or the defaults). Every
/// rank must pass the same choice, as every rank must call the same
/// collective.
pub struct Call<'s, D: Device> {
    pub(crate) stream: Option<&'s D::Stream>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) hints: BTreeMap<String, String>,
    algo: Option<Algorithm>,
    coll_algo: Option<Algorithm>,
}

impl<D: Device> Default for Call<'_, D> {
    fn default() -> Self {
        Call {
            stream: None,
            timeout: None,
            hints: BTreeMap::new(),
            algo: None,
            coll_algo: None,
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

    /// Run on `stream` instead of the communicator's own.
    pub fn stream(mut self, stream: &'s D::Stream) -> Self {
        self.stream = Some(stream);
        self
    }

    /// Bound every wait of this call on a peer by `timeout` instead of the
    /// communicator's (`CommOptions::timeout`).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Set hint `key` to `value` (`algo`, `coll_algo`: the same choices as
    /// [`Call::algo`] and [`Call::coll_algo`], by name; unknown keys are
    /// ignored).
    pub fn hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }

    /// Force the all-reduce's algorithm for this call (as the `algo`
    /// hint): one of its kernels, quick-reduce, [`Algorithm::Kernels`]
    /// (the planner's choice among the kernels) or [`Algorithm::Vendor`].
    /// One that cannot run the call is an error. Other collectives ignore it.
    pub fn algo(mut self, algo: Algorithm) -> Self {
        self.algo = Some(algo);
        self
    }

    /// Force how the collectives other than all-reduce and broadcast run
    /// (as the `coll_algo` hint): [`Algorithm::Ll`] (LL lines),
    /// [`Algorithm::Inbox`], [`Algorithm::Kernels`] (either) or
    /// [`Algorithm::Vendor`] (NCCL/RCCL). A kind that cannot run the call
    /// (LL for a block larger than its lines carry, or a premul_sum;
    /// NCCL/RCCL without the library, or for a bitwise op) leaves it to the
    /// options and the table. It wins over `FERROCOMM_COLL_ROUTE`,
    /// `FERROCOMM_COLL_LL_BYTES` and `deterministic` (NCCL's reduce-scatter
    /// is not bitwise the reference's). Heap operands that the direct kinds
    /// take (`CommOptions::direct_min_bytes`) go direct whichever of the
    /// kernels' kinds is chosen.
    pub fn coll_algo(mut self, algo: Algorithm) -> Self {
        self.coll_algo = Some(algo);
        self
    }

    /// The other collectives' way asked for: [`Call::coll_algo`], else the
    /// `coll_algo` hint (`auto`: none). One of another family is an error.
    pub(crate) fn asked_coll_algo(&self) -> Result<Option<Algorithm>> {
        let asked = match self.coll_algo {
            Some(a) => Some(a),
            None => self
                .hints
                .get("coll_algo")
                .map(|v| parse_choice(v))
                .transpose()?
                .flatten(),
        };
        match asked {
            Some(a) if !a.is_data() => Err(Error::invalid(format!(
                "coll_algo {a} is an all-reduce algorithm (expected ll, inbox, copy, kernels, vendor or auto)"
            ))),
            a => Ok(a),
        }
    }

    /// The all-reduce's algorithm asked for: [`Call::algo`], else the
    /// `algo` hint (`auto`: none). One of another family is an error.
    pub(crate) fn asked_algo(&self) -> Result<Option<Algorithm>> {
        let asked = match self.algo {
            Some(a) => Some(a),
            None => self.hints.get("algo").map(|v| parse_choice(v)).transpose()?.flatten(),
        };
        match asked {
            Some(a) if !a.is_all_reduce() => Err(Error::invalid(format!(
                "algo {a} is not an all-reduce algorithm (the other collectives take it as coll_algo)"
            ))),
            a => Ok(a),
        }
    }
}

/// premul_sum's factor: a host value, or one element of the call's dtype in
/// device memory (read when the collective runs, so a graph replay sees its
/// current value).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Factor {
    /// A value known on the host when the call is made.
    Host(f64),
    /// One element of the call's dtype in device memory.
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
    /// An operator that needs nothing else.
    Op(ReduceOp),
    /// premul_sum, with its factor.
    PreMulSum(Factor),
}

impl From<ReduceOp> for Reduction {
    fn from(op: ReduceOp) -> Self {
        Reduction::Op(op)
    }
}

impl Reduction {
    /// premul_sum by a host factor. The operator cannot be named without
    /// its factor:
    ///
    /// ```compile_fail
    /// let forgot = ferrocomm::Reduction::from(ferrocomm::ReduceOp::PreMulSum);
    /// ```
    pub fn premul_sum(factor: f64) -> Self {
        Reduction::PreMulSum(Factor::Host(factor))
    }

    /// The factor is one element of the call's dtype at `factor`.
    pub fn premul_sum_device(factor: Tensor) -> Self {
        Reduction::PreMulSum(Factor::Device(factor))
    }

    /// The operator (`ReduceOp::PreMulSum` for a premul_sum).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::host::HostDevice;

    #[test]
    fn coll_algo_comes_from_the_call_or_the_hint() {
        let c = |hint: Option<&str>| {
            let call = Call::<HostDevice>::new();
            match hint {
                Some(v) => call.hint("coll_algo", v),
                None => call,
            }
        };
        assert_eq!(c(None).asked_coll_algo().unwrap(), None);
        assert_eq!(c(Some("auto")).asked_coll_algo().unwrap(), None);
        assert_eq!(c(Some("ll")).asked_coll_algo().unwrap(), Some(Algorithm::Ll));
        assert_eq!(c(Some(" Inbox")).asked_coll_algo().unwrap(), Some(Algorithm::Inbox));
        assert_eq!(c(Some("vendor")).asked_coll_algo().unwrap(), Some(Algorithm::Vendor));
        assert_eq!(c(Some("nccl")).asked_coll_algo().unwrap(), Some(Algorithm::Vendor));
        assert_eq!(c(Some("custom")).asked_coll_algo().unwrap(), Some(Algorithm::Kernels));
        for bad in ["fast", "oneshot"] {
            assert!(
                matches!(c(Some(bad)).asked_coll_algo(), Err(Error::InvalidArgument(_))),
                "{bad}"
            );
        }
        // The method wins over the hint.
        let call = c(Some("ll")).coll_algo(Algorithm::Vendor);
        assert_eq!(call.asked_coll_algo().unwrap(), Some(Algorithm::Vendor));
        // The all-reduce's hint takes its own family.
        let ar = |v: &str| Call::<HostDevice>::new().hint("algo", v).asked_algo();
        assert_eq!(ar("oneshot-ll").unwrap(), Some(Algorithm::OneShotLl));
        assert_eq!(ar("auto").unwrap(), None);
        assert!(matches!(ar("inbox"), Err(Error::InvalidArgument(_))));
    }
}
