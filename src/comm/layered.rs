//! Communicators that span nodes, or more ranks than one node's kernels
//! serve: all-reduce, all-gather and reduce-scatter in two levels, the rest
//! through NCCL/RCCL over the whole group.
//!
//! A communicator whose ranks sit on several nodes (real hosts, or the
//! pseudo-nodes of `FERROCOMM_LOCAL_SIZE`) keeps two sub-communicators:
//! - `intra`: the ranks of its node (at most [`MAX_RANKS`]), with
//!   ferrocomm's kernels over a workspace that never leaves the node;
//! - `inter`: the ranks with its local rank, one per node, with NCCL/RCCL
//!   only (no workspace: nothing is reached by IPC across nodes). On the
//!   host backend, which has no NCCL, the host protocols stand in for it
//!   between pseudo-nodes of one machine.
//!
//! The algorithms, `L` ranks a node, `M` nodes:
//! - all-reduce of `n = L * c` elements: intra reduce-scatter into this
//!   rank's slice `c`, inter all-reduce of the slice, intra all-gather of the
//!   slices. Otherwise (nodes of unequal sizes, `n` not a multiple of `L`):
//!   intra all-reduce, all-reduce among the nodes' first ranks, intra
//!   broadcast from the first rank.
//! - all-gather: inter all-gather of the inputs of this local rank's column,
//!   then one intra all-gather per node (in place), so each block crosses
//!   between nodes once.
//! - reduce-scatter: one intra reduce-scatter per node into a staging
//!   buffer (the node's partial sums of every block of that node), then an
//!   inter reduce-scatter of the partials.
//!
//! Sums run in a fixed order, node by node: each node's ranks in local-rank
//! order, then the nodes in order. Every rank gets the same bits, but not
//! the bits of a one-level communicator (whose order is plain rank order).
//! Average becomes premul_sum by 1/world in the first level and a sum in the
//! second.

use std::sync::Mutex;

use super::call::{Call, Reduction};
use super::communicator::{lock, Communicator, Levels};
use super::tensor::Tensor;
use super::topology::Topology;
use super::work::Work;
use crate::device::{Device, DeviceBuffer};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

impl<D: Device> Levels<D> {
    /// The levels of a communicator whose ranks lie as `topology` says,
    /// from its node's communicator and its local rank's.
    pub(crate) fn new(intra: Communicator<D>, inter: Communicator<D>, topology: &Topology) -> Levels<D> {
        let node_ranks: Vec<Vec<usize>> = (0..topology.nodes).map(|m| topology.ranks_on(m)).collect();
        let uniform = node_ranks.iter().all(|r| r.len() == topology.local_size);
        let singles = node_ranks.iter().all(|r| r.len() == 1);
        Levels {
            intra,
            inter,
            singles,
            grid: uniform.then_some(node_ranks),
            staging: Mutex::new(None),
        }
    }

    /// Whether all-gather and reduce-scatter run in two levels (nodes of
    /// equal sizes); otherwise they go to NCCL/RCCL over the whole group.
    pub(crate) fn uniform(&self) -> bool {
        self.grid.is_some()
    }

    /// The ranks of every node, when the nodes have equal sizes (the
    /// callers route unequal ones to NCCL/RCCL before asking).
    fn uniform_grid(&self) -> Result<&Vec<Vec<usize>>> {
        self.grid
            .as_ref()
            .ok_or_else(|| Error::Unsupported("two levels need nodes of equal sizes".into()))
    }

    pub(crate) fn finalize(&self) {
        let _ = self.intra.finalize();
        let _ = self.inter.finalize();
    }

    pub(crate) fn abort(&self) {
        let _ = self.intra.abort();
        let _ = self.inter.abort();
    }

    /// The call's stream and timeout, for the levels' calls.
    fn sub_call<'s>(call: &Call<'s, D>, own: &'s D::Stream) -> Call<'s, D> {
        let mut c = Call::on(call.stream.unwrap_or(own));
        c.timeout = call.timeout;
        c
    }

    /// Refuse, before anything is queued, a reduction the between-nodes
    /// level cannot do: on GPUs that level is NCCL/RCCL alone, which has no
    /// bitwise ops (torch's NCCL backend refuses them too); the host's
    /// stand-in has them all.
    fn check_between_nodes(&self, what: &str, red: Reduction) -> Result<()> {
        match red {
            Reduction::Op(op) if !self.inter.inner.kernels && op.is_bitwise() => Err(Error::Unsupported(format!(
                "{what} by {op} across nodes: NCCL/RCCL, which carries the between-nodes level, has no bitwise \
                     reductions"
            ))),
            _ => Ok(()),
        }
    }

    /// The whole communicator's work: the last step's, answering for the
    /// failures of both levels.
    fn finish(&self, last: Work<D>) -> Work<D> {
        last.with_parts(&[&self.intra, &self.inter])
    }

    pub(crate) fn all_reduce(
        &self,
        world: usize,
        own: &D::Stream,
        input: Tensor,
        output: Tensor,
        red: Reduction,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        self.check_between_nodes("all_reduce", red)?;
        let sc = Self::sub_call(call, own);
        if self.singles {
            // One rank a node: the between-nodes level is the whole call.
            // (Only when every node has one rank: a lone rank among larger
            // nodes runs the levels like the others, or its reduction would
            // differ from theirs in the between-nodes call.)
            return Ok(self.finish(self.inter.all_reduce_into(input, output, red, &sc)?));
        }
        let (first, rest) = split_reduction(red, world);
        let n = input.count();
        let l = self.intra.size();
        if self.uniform() && n % l == 0 && n > 0 {
            let c = n / l;
            let ins = (0..l).map(|i| input.slice(i * c, c)).collect::<Result<Vec<_>>>()?;
            let outs = (0..l).map(|i| output.slice(i * c, c)).collect::<Result<Vec<_>>>()?;
            let mine = outs[self.intra.rank()];
            self.intra.reduce_scatter(mine, &ins, first, &sc)?;
            self.inter.all_reduce(mine, rest, &sc)?;
            let last = self.intra.all_gather(&outs, mine, &sc)?;
            return Ok(self.finish(last));
        }
        self.intra.all_reduce_into(input, output, first, &sc)?;
        if self.intra.rank() == 0 {
            // Local rank 0's column holds every node: the nodes' first ranks.
            self.inter.all_reduce(output, rest, &sc)?;
        }
        let last = self.intra.broadcast(output, 0, &sc)?;
        Ok(self.finish(last))
    }

    /// A barrier in three steps: the node's, its first ranks' (local rank
    /// 0's column holds every node), the node's again (which the others
    /// leave only after their first rank left the second).
    pub(crate) fn barrier(&self, own: &D::Stream, call: &Call<'_, D>) -> Result<Work<D>> {
        let sc = Self::sub_call(call, own);
        if self.singles {
            return Ok(self.finish(self.inter.barrier(&sc)?));
        }
        self.intra.barrier(&sc)?;
        if self.intra.rank() == 0 {
            self.inter.barrier(&sc)?;
        }
        let last = self.intra.barrier(&sc)?;
        Ok(self.finish(last))
    }

    /// `outputs`: one per rank of the whole communicator.
    pub(crate) fn all_gather(
        &self,
        own: &D::Stream,
        outputs: &[Tensor],
        input: Tensor,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        let grid = self.uniform_grid()?;
        let sc = Self::sub_call(call, own);
        let j = self.intra.rank();
        let column: Vec<Tensor> = grid.iter().map(|ranks| outputs[ranks[j]]).collect();
        let mut last = self.inter.all_gather(&column, input, &sc)?;
        for ranks in grid.iter().filter(|r| r.len() > 1) {
            let node: Vec<Tensor> = ranks.iter().map(|&r| outputs[r]).collect();
            last = self.intra.all_gather(&node, node[j], &sc)?;
        }
        Ok(self.finish(last))
    }

    /// `inputs`: one per rank of the whole communicator.
    pub(crate) fn reduce_scatter(
        &self,
        world: usize,
        own: &D::Stream,
        output: Tensor,
        inputs: &[Tensor],
        red: Reduction,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        self.check_between_nodes("reduce_scatter", red)?;
        let grid = self.uniform_grid()?;
        let sc = Self::sub_call(call, own);
        if self.intra.size() == 1 {
            let column: Vec<Tensor> = grid.iter().map(|ranks| inputs[ranks[0]]).collect();
            return Ok(self.finish(self.inter.reduce_scatter(output, &column, red, &sc)?));
        }
        let (first, rest) = split_reduction(red, world);
        let n = output.count();
        let stage = self.staging(sc.stream.unwrap_or(own), grid.len() * n, output.dtype())?;
        let partials = (0..grid.len())
            .map(|m| stage.slice(m * n, n))
            .collect::<Result<Vec<_>>>()?;
        for (ranks, &partial) in grid.iter().zip(&partials) {
            let node: Vec<Tensor> = ranks.iter().map(|&r| inputs[r]).collect();
            self.intra.reduce_scatter(partial, &node, first, &sc)?;
        }
        let last = self.inter.reduce_scatter(output, &partials, rest, &sc)?;
        Ok(self.finish(last))
    }

    /// `count` elements of staging, grown (after the stream drains: queued
    /// work may still read the old buffer) when smaller. Growing inside a
    /// capture is refused: allocation and draining cannot be captured.
    fn staging(&self, stream: &D::Stream, count: usize, dtype: DType) -> Result<Tensor> {
        let bytes = (count * dtype.size()).max(dtype.size());
        let mut st = lock(&self.staging);
        if st.as_ref().is_none_or(|b| b.len() < bytes) {
            let dev = self.intra.device();
            if dev.is_capturing(stream)? {
                return Err(Error::invalid(format!(
                    "reduce_scatter across nodes needs {bytes} bytes of staging, more than it has: run the call \
                     once outside the graph before capturing it"
                )));
            }
            dev.synchronize(stream)?;
            *st = None;
            *st = Some(self.intra.alloc(bytes)?);
        }
        let buf = st.as_ref().ok_or_else(|| Error::invalid("staging buffer missing"))?;
        Tensor::of(buf, dtype).slice(0, count)
    }
}

/// The reductions of the first level and of the second. (Only float dtypes
/// average, so the premul_sum form always exists.)
fn split_reduction(red: Reduction, world: usize) -> (Reduction, Reduction) {
    match red {
        Reduction::Op(ReduceOp::Avg) => (Reduction::premul_sum(1.0 / world as f64), ReduceOp::Sum.into()),
        Reduction::PreMulSum(f) => (Reduction::PreMulSum(f), ReduceOp::Sum.into()),
        Reduction::Op(op) => (op.into(), op.into()),
    }
}
