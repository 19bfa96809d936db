//! One sequence-parallel row (`--fused-sp`): `reduce_scatter_fused` timed
//! as the fused rows are, its outputs checked bit for bit against the
//! unfused reference of the all-reduce form on the same rows with the full
//! residual (the ranks' shards concatenated): this rank's rows of the
//! residual, every row (gathered) or this rank's (shard) of the rest.

use ferrocomm::codec::Half16;
use ferrocomm::device::Device;
use ferrocomm::testing::data::{self, FromF64};
use ferrocomm::testing::fused::FusedExpect;
use ferrocomm::{Call, Communicator, DType, Fusion, Result, SpOutput};

use super::row::{
    given_scale, ops_per_sample, random, sf_offset, Buffers, Epilogue, RowSpec, Sample, EPS, NVFP4_LAYOUT,
};
use crate::args::Args;
use crate::timing::time_samples;

/// Rows of an SP row's tensors: the call's, the shard's, the outputs'.
struct Rows {
    tokens: usize,
    shard: usize,
    out: usize,
    hidden: usize,
}

/// An SP row: every rank's Gaussian input, `tokens` rows of `--hidden`
/// (a multiple of the world size).
pub fn one<D: Device, S: FromF64 + Half16>(
    comm: &Communicator<D>,
    a: &Args,
    spec: &RowSpec<'_>,
    out: SpOutput,
) -> Result<Sample> {
    let (rank, world, hidden) = (comm.rank(), comm.size(), a.hidden);
    let (dtype, es) = (<S as Half16>::DTYPE, <S as Half16>::DTYPE.size());
    let shard = spec.tokens / world;
    let rows = Rows {
        tokens: spec.tokens,
        shard,
        out: if out == SpOutput::Gathered { spec.tokens } else { shard },
        hidden,
    };
    let (n, ns, no) = (rows.tokens * hidden, shard * hidden, rows.out * hidden);
    let inputs: Vec<Vec<S>> = (0..world).map(|r| random(r, n, 1)).collect();
    let epilogue = Epilogue::<S>::random(spec.tokens, hidden);
    let quant = no.max(sf_offset(no) + NVFP4_LAYOUT.sf_bytes(rows.out, hidden));
    let sizes = [
        n * es,
        ns * es,
        ns * es,
        hidden * es,
        no * es,
        quant,
        rows.out.max(1) * 4,
    ];
    let mine = &epilogue.residual[rank * ns..(rank + 1) * ns];
    let fill = vec![
        (0, data::to_bytes(&inputs[rank])),
        (1, data::to_bytes(mine)),
        (3, data::to_bytes(&epilogue.weight)),
        (6, given_scale(spec.pattern).to_le_bytes().to_vec()),
    ];
    let bufs = Buffers::new(comm, &sizes, &fill)?;
    let f = fusion(&bufs, spec, dtype, &rows)?.with_seq_parallel(out);
    let input = bufs.t(0, dtype, n)?;
    let stream = &bufs.stream;
    let run = || comm.reduce_scatter_fused(input, &f, &Call::on(stream)).map(|_| ());
    let ops = ops_per_sample(comm.device().facts().backend);
    let times = time_samples(comm, a, spec.mode, stream, ops, |_| run())?;
    let want = epilogue.want(spec.pattern, hidden, &inputs);
    Ok(Sample::new(times, wrong_bits(&bufs, spec, &rows, rank, &want)?))
}

/// The SP epilogue on buffers 1 to 6 (out of place).
fn fusion<D: Device>(bufs: &Buffers<'_, D>, spec: &RowSpec<'_>, dtype: DType, rows: &Rows) -> Result<Fusion> {
    let (pattern, hidden) = (spec.pattern, rows.hidden);
    let (ns, no) = (rows.shard * hidden, rows.out * hidden);
    let mut f = Fusion::new(pattern, hidden, bufs.t(1, dtype, ns)?, bufs.t(2, dtype, ns)?);
    if pattern.norms() {
        f = f
            .with_norm(bufs.t(3, dtype, hidden)?, EPS)
            .with_norm_out(bufs.t(4, dtype, no)?);
    }
    if let Some(qdt) = pattern.quant_dtype() {
        let scales = if pattern.per_token() { rows.out } else { 1 };
        f = f.with_quant(bufs.t(5, qdt, no)?, bufs.t(6, DType::F32, scales)?);
    }
    if pattern.nvfp4() {
        let sf = bufs.view(5, DType::U8, sf_offset(no), spec.sf_layout.sf_bytes(rows.out, hidden))?;
        f = f.with_nvfp4(
            bufs.t(5, DType::U8, no / 2)?,
            bufs.t(6, DType::F32, 1)?,
            sf,
            spec.sf_layout,
        );
    }
    Ok(f)
}

/// The outputs that are not the reference's rows, bit for bit.
fn wrong_bits<D: Device, S: Half16>(
    bufs: &Buffers<'_, D>,
    spec: &RowSpec<'_>,
    rows: &Rows,
    rank: usize,
    want: &FusedExpect<S>,
) -> Result<usize> {
    let (pattern, hidden) = (spec.pattern, rows.hidden);
    let es = <S as Half16>::DTYPE.size();
    // The first output row of this rank: 0 gathered, the shard's first else.
    let first = if rows.out == rows.tokens { 0 } else { rank * rows.shard };
    let (ns, no) = (rows.shard * hidden, rows.out * hidden);
    let shard_res = &want.residual[rank * ns..(rank + 1) * ns];
    let mut wrong = usize::from(bufs.read(2, ns * es)? != data::to_bytes(shard_res));
    if pattern.norms() {
        let norm = &want.norm[first * hidden..first * hidden + no];
        wrong += usize::from(bufs.read(4, no * es)? != data::to_bytes(norm));
    }
    if pattern.quant_dtype().is_some() {
        wrong += usize::from(bufs.read(5, no)? != want.quant[first * hidden..first * hidden + no]);
    }
    if pattern.per_token() {
        let scales = &want.scales[first..first + rows.out];
        wrong += usize::from(bufs.read(6, rows.out * 4)? != data::to_bytes(scales));
    }
    if pattern.nvfp4() {
        let got = bufs.read(5, sf_offset(no) + spec.sf_layout.sf_bytes(rows.out, hidden))?;
        let codes = &want.quant[first * hidden / 2..(first * hidden + no) / 2];
        wrong += usize::from(got[..no / 2] != *codes);
        // The scale factors the rows own (the swizzled padding is not written).
        let (sfs, cols) = (&got[sf_offset(no)..], hidden / 16);
        let sf_ok = (0..rows.out * cols)
            .all(|i| sfs[spec.sf_layout.offset(i / cols, i % cols, cols)] == want.sf[first * cols + i]);
        wrong += usize::from(!sf_ok);
    }
    Ok(wrong)
}
