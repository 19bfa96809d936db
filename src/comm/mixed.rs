//! Tensor- and data-parallel pairs of collectives, as FlashInfer's
//! `MixedCommHandler` offers them: all-reduce over the tensor-parallel group
//! then all-gather over the data-parallel group (attention data parallel
//! ahead of a tensor-parallel MoE or MLP), and reduce-scatter over the
//! data-parallel group then all-reduce over the tensor-parallel group (the
//! way back).
//!
//! Each step runs on the communicator of its group, formed once by
//! [`Communicator::split_by`]. A group inside one node runs ferrocomm's
//! kernels; a group that spans nodes runs in two levels (`layered.rs`), so
//! every layout of TP and DP inside and across nodes works. Both steps of a
//! pair run on the call's stream, or the TP communicator's when it has
//! none (so data written on another communicator's stream needs that
//! stream passed). Which layout a
//! world has is [`MixedComm::mode`]; [`MixedComm::valid_modes`] and
//! [`MixedComm::valid_ops`] say what a topology allows.

use super::call::{Call, Reduction};
use super::communicator::Communicator;
use super::mapping::{Axis, Mapping};
use super::tensor::Tensor;
use super::work::Work;
use crate::device::Device;
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};

/// Where the tensor- and data-parallel groups sit relative to nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MixedMode {
    /// Both groups inside one node (or a one-node world).
    Local,
    /// TP inside a node, DP across nodes (FlashInfer's usual layout).
    TpLocalDpInter,
    /// TP across nodes (two levels), DP inside a node.
    TpInterDpLocal,
    /// Both groups span nodes.
    Inter,
}

/// The operations of [`MixedComm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MixedOp {
    /// [`MixedComm::all_reduce`].
    AllReduce,
    /// [`MixedComm::all_gather`].
    AllGather,
    /// [`MixedComm::reduce_scatter`].
    ReduceScatter,
    /// [`MixedComm::all_reduce_all_gather`].
    AllReduceAllGather,
    /// [`MixedComm::reduce_scatter_all_reduce`].
    ReduceScatterAllReduce,
}

impl MixedOp {
    /// Every operation.
    pub const ALL: [MixedOp; 5] = [
        MixedOp::AllReduce,
        MixedOp::AllGather,
        MixedOp::ReduceScatter,
        MixedOp::AllReduceAllGather,
        MixedOp::ReduceScatterAllReduce,
    ];
}

/// The tensor- and data-parallel communicators of one rank.
pub struct MixedComm<D: Device> {
    /// This rank's tensor-parallel group.
    pub tp: Communicator<D>,
    /// This rank's data-parallel group.
    pub dp: Communicator<D>,
    mode: MixedMode,
}

impl<D: Device> MixedComm<D> {
    /// Split `comm` by `mapping` into this rank's TP and DP groups.
    /// Collective over `comm`. Context and pipeline parallelism must be 1
    /// (the pairs have no meaning across pipeline stages).
    pub fn new(comm: &Communicator<D>, mapping: &Mapping) -> Result<MixedComm<D>> {
        if mapping.cp != 1 || mapping.pp != 1 {
            return Err(Error::invalid(format!(
                "MixedComm: the mapping {mapping:?} has cp or pp > 1; build it over one pipeline stage's \
                 communicator (split_by(.., Axis::Ep) gives it)"
            )));
        }
        let tp = comm.split_by(mapping, Axis::Tp)?;
        let dp = comm.split_by(mapping, Axis::Dp)?;
        let spans = |c: &Communicator<D>| c.topology().nodes > 1;
        let mode = match (spans(&tp), spans(&dp)) {
            (false, false) => MixedMode::Local,
            (false, true) => MixedMode::TpLocalDpInter,
            (true, false) => MixedMode::TpInterDpLocal,
            (true, true) => MixedMode::Inter,
        };
        Ok(MixedComm { tp, dp, mode })
    }

    /// Where this world's groups sit.
    pub fn mode(&self) -> MixedMode {
        self.mode
    }

    /// The modes this topology allows: the one its layout gives. (Every op
    /// runs in every mode; fused single-kernel modes are not built.)
    pub fn valid_modes(&self) -> Vec<MixedMode> {
        vec![self.mode]
    }

    /// The ops every mode runs.
    pub fn valid_ops(&self) -> Vec<MixedOp> {
        MixedOp::ALL.to_vec()
    }

    /// All-reduce over the TP group, in place.
    pub fn all_reduce(&self, t: Tensor, red: impl Into<Reduction>, call: &Call<'_, D>) -> Result<Work<D>> {
        self.tp.all_reduce(t, red, call)
    }

    /// All-gather over the DP group: `output` holds `dp` blocks of `input`'s length.
    pub fn all_gather(&self, output: Tensor, input: Tensor, call: &Call<'_, D>) -> Result<Work<D>> {
        self.dp.all_gather_single(output, input, call)
    }

    /// Reduce-scatter over the DP group: `input` holds `dp` blocks of `output`'s length.
    pub fn reduce_scatter(
        &self,
        output: Tensor,
        input: Tensor,
        red: impl Into<Reduction>,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        self.dp.reduce_scatter_single(output, input, red, call)
    }

    /// Sum `input` over the TP group, then gather the sums of the DP group:
    /// `output` (`dp` x `input`'s length) holds DP rank `d`'s sum in block `d`.
    pub fn all_reduce_all_gather(&self, output: Tensor, input: Tensor, call: &Call<'_, D>) -> Result<Work<D>> {
        let n = input.count();
        let blocks = self.dp.size();
        if output.count() != n.saturating_mul(blocks) || output.dtype() != input.dtype() {
            return Err(Error::invalid(format!(
                "all_reduce_all_gather: output is {} x {}, not dp ({blocks}) x input ({n} x {})",
                output.count(),
                output.dtype(),
                input.dtype()
            )));
        }
        let mine = output.slice(self.dp.rank() * n, n)?;
        let call = self.one_stream(call);
        self.tp.all_reduce_into(input, mine, ReduceOp::Sum, &call)?;
        Ok(self.dp.all_gather_single(output, mine, &call)?.with_parts(&[&self.tp]))
    }

    /// Reduce-scatter `input` (`dp` blocks of `output`'s length) over the DP
    /// group, then sum the result over the TP group into `output`.
    pub fn reduce_scatter_all_reduce(&self, output: Tensor, input: Tensor, call: &Call<'_, D>) -> Result<Work<D>> {
        let call = self.one_stream(call);
        self.dp.reduce_scatter_single(output, input, ReduceOp::Sum, &call)?;
        Ok(self
            .tp
            .all_reduce(output, ReduceOp::Sum, &call)?
            .with_parts(&[&self.dp]))
    }

    /// `call` on one stream for both steps (the caller's, else the TP
    /// communicator's): the second step reads what the first wrote.
    fn one_stream<'s>(&'s self, call: &Call<'s, D>) -> Call<'s, D> {
        let mut c = Call::on(call.stream.unwrap_or(self.tp.stream()));
        c.timeout = call.timeout;
        c.hints = call.hints.clone();
        c
    }

    /// Release both groups' communicators.
    pub fn finalize(&self) -> Result<()> {
        let a = self.tp.finalize();
        let b = self.dp.finalize();
        a.and(b)
    }
}
