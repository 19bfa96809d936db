//! The EP rows' baseline: an all-to-all-v pipeline carrying the same bytes
//! through the vendor-routed communicator. Per destination, the rows that
//! go there and their metadata (scales, top-k ids and weights, token
//! index), then the bf16 rows back; the splits are given on the host.

use ferrocomm::device::Device;
use ferrocomm::ep::reference::dest_ranks;
use ferrocomm::ep::EpConfig;
use ferrocomm::{Call, Communicator, DType, Result, Tensor};

use super::inputs::{row_bytes, scale_cols};
use super::ops_per_sample;
use crate::args::Args;
use crate::timing::time_samples_prepared;

/// The pipeline's byte splits, per peer.
struct Splits {
    /// Dispatch: rows and metadata sent, received.
    d_in: Vec<usize>,
    d_out: Vec<usize>,
    /// Combine: bf16 rows sent back, received back.
    c_in: Vec<usize>,
    c_out: Vec<usize>,
}

impl Splits {
    fn new(cfg: &EpConfig, ids: &[Vec<Vec<i32>>], rank: usize, world: usize) -> Splits {
        let meta = scale_cols(cfg) * 4 + cfg.topk * 8 + 4;
        let row = row_bytes(cfg) + meta;
        let counts = |src: usize, dst: usize| {
            ids[src]
                .iter()
                .filter(|t| dest_ranks(cfg, world, t) & (1 << dst) != 0)
                .count()
        };
        let send: Vec<usize> = (0..world).map(|r| counts(rank, r)).collect();
        let recv: Vec<usize> = (0..world).map(|r| counts(r, rank)).collect();
        let hd = cfg.hidden;
        Splits {
            d_in: send.iter().map(|c| c * row).collect(),
            d_out: recv.iter().map(|c| c * row).collect(),
            c_in: recv.iter().map(|c| c * hd * 2).collect(),
            c_out: send.iter().map(|c| c * hd * 2).collect(),
        }
    }
}

/// Device us per dispatch + combine of the pipeline on `vcomm`, a sample
/// each, timed on `stream`.
pub fn time_a2a<D: Device>(
    vcomm: &Communicator<D>,
    a: &Args,
    cfg: &EpConfig,
    ids: &[Vec<Vec<i32>>],
    mode: &'static str,
    stream: &D::Stream,
) -> Result<Vec<f64>> {
    let sp = Splits::new(cfg, ids, vcomm.rank(), vcomm.size());
    let sum = |v: &[usize]| v.iter().sum::<usize>();
    let lens = [sum(&sp.d_in), sum(&sp.d_out), sum(&sp.c_in), sum(&sp.c_out)];
    let bufs = lens
        .iter()
        .map(|&len| vcomm.alloc(len.max(16)))
        .collect::<Result<Vec<_>>>()?;
    let t = |i: usize| Tensor::view(&bufs[i], DType::U8, 0, lens[i]);
    let (d_in, d_out, c_in, c_out) = (t(0)?, t(1)?, t(2)?, t(3)?);
    let run = |_: usize| -> Result<()> {
        let on = Call::on(stream);
        vcomm.all_to_all_v_single(d_out, d_in, &sp.d_out, &sp.d_in, &on)?;
        vcomm
            .all_to_all_v_single(c_out, c_in, &sp.c_out, &sp.c_in, &on)
            .map(drop)
    };
    let ops = ops_per_sample(vcomm.device().facts().backend);
    let (times, _) = time_samples_prepared(vcomm, a, mode, stream, ops, false, run)?;
    Ok(times)
}
