//! A MoE row (`--fused-moe`): top-`topk` over `tokens * topk` permuted
//! expert rows plus a shared expert, f32 router weights, finalized and
//! all-reduced by the fused call's MoE prologue (outputs checked bit for
//! bit), or by the unfused pipeline (`unfused.rs`) on the same inputs.

use ferrocomm::codec::Half16;
use ferrocomm::device::Device;
use ferrocomm::testing::data::{self, FromF64, Values};
use ferrocomm::testing::fused::{moe_finalize_reference, moe_permutation, FusedExpect};
use ferrocomm::{Communicator, DType, MoeFinalize, ReduceOp, Result};

use super::row::{random, Buffers, Epilogue, RowSpec, Sample};
use crate::args::Args;

/// A MoE row's inputs (every rank's, for the reference).
struct MoeInputs<S> {
    topk: usize,
    /// Each rank's `tokens * topk` expert rows.
    experts: Vec<Vec<S>>,
    /// Each rank's shared expert's output, `tokens` rows.
    shared: Vec<Vec<S>>,
    /// The permutation: which expert row is each (token, k) pair's.
    idx: Vec<i32>,
    /// The router weights of the pairs.
    scales: Vec<f32>,
    epilogue: Epilogue<S>,
}

impl<S: FromF64 + Half16> MoeInputs<S> {
    fn random(world: usize, tokens: usize, hidden: usize, topk: usize) -> Self {
        let (n, pairs) = (tokens * hidden, tokens * topk);
        let rows = pairs;
        MoeInputs {
            topk,
            experts: (0..world).map(|r| random(r, rows * hidden, 11)).collect(),
            shared: (0..world).map(|r| random(r, n, 12)).collect(),
            idx: moe_permutation(13, rows, pairs),
            scales: (0..pairs)
                .map(|i| (0.5 * data::input_value(14, 0, i, ReduceOp::Sum, Values::Random)) as f32)
                .collect(),
            epilogue: Epilogue::random(tokens, hidden),
        }
    }

    /// This rank's buffers (see [`Buffers`]), written.
    fn buffers<'c, D: Device>(
        &self,
        comm: &'c Communicator<D>,
        pattern: ferrocomm::FusionPattern,
        tokens: usize,
        hidden: usize,
    ) -> Result<Buffers<'c, D>> {
        let rank = comm.rank();
        let es = <S as Half16>::DTYPE.size();
        let (n, pairs) = (tokens * hidden, tokens * self.topk);
        let sizes: Vec<usize> = std::iter::once(pairs * hidden * es)
            .chain(Epilogue::<S>::sizes(tokens, hidden))
            .chain([pairs * 4, pairs * 4, n * es, n * es])
            .collect();
        let mut fill = vec![(0, data::to_bytes(&self.experts[rank]))];
        fill.extend(self.epilogue.fill(pattern));
        fill.extend([
            (7, data::to_bytes(&self.idx)),
            (8, data::to_bytes(&self.scales)),
            (9, data::to_bytes(&self.shared[rank])),
        ]);
        Buffers::new(comm, &sizes, &fill)
    }

    /// The outputs of a MoE row: every rank's finalized rows, all-reduced,
    /// then the epilogue.
    fn want(&self, pattern: ferrocomm::FusionPattern, hidden: usize) -> FusedExpect<S> {
        let xs: Vec<Vec<S>> = (0..self.experts.len())
            .map(|r| {
                moe_finalize_reference(
                    hidden,
                    self.topk,
                    &self.experts[r],
                    &self.idx,
                    &self.scales,
                    Some(&self.shared[r]),
                )
            })
            .collect();
        self.epilogue.want(pattern, hidden, &xs)
    }
}

/// A MoE row set up on this rank: what it times, its top-k, its buffers
/// (written) and the outputs it must give.
pub struct MoeRow<'a, 'c, D: Device, S> {
    pub spec: RowSpec<'a>,
    pub topk: usize,
    pub bufs: Buffers<'c, D>,
    pub want: FusedExpect<S>,
}

impl<'a, 'c, D: Device, S: FromF64 + Half16> MoeRow<'a, 'c, D, S> {
    pub fn new(comm: &'c Communicator<D>, a: &Args, spec: RowSpec<'a>, topk: usize) -> Result<Self> {
        let inputs = MoeInputs::<S>::random(comm.size(), spec.tokens, a.hidden, topk);
        Ok(MoeRow {
            spec,
            topk,
            bufs: inputs.buffers(comm, spec.pattern, spec.tokens, a.hidden)?,
            want: inputs.want(spec.pattern, a.hidden),
        })
    }
}

/// A MoE row through the fused call with the MoE prologue (the family
/// from the spec's choice), its outputs checked bit for bit.
pub fn fused<D: Device, S: Half16>(a: &Args, row: &MoeRow<'_, '_, D, S>) -> Result<Sample> {
    let MoeRow { spec, topk, bufs, want } = row;
    let (dtype, hidden) = (<S as Half16>::DTYPE, a.hidden);
    let (n, pairs) = (spec.tokens * hidden, spec.tokens * topk);
    let moe = MoeFinalize::new(bufs.t(7, DType::I32, pairs)?, bufs.t(8, DType::F32, pairs)?, *topk)
        .with_shared_expert_output(bufs.t(9, dtype, n)?);
    let f = bufs.fusion(spec, dtype, hidden)?.with_moe_finalize(moe);
    let times = bufs.time_fused(a, spec, bufs.t(0, dtype, pairs * hidden)?, &f)?;
    Ok(Sample::new(times, bufs.wrong_bits(spec, hidden, want)?))
}
