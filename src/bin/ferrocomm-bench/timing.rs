//! How every row of the bench is timed: device events around a sample of
//! back-to-back calls (eager launches, or one replay of a graph holding
//! them), after warm-up; the median over samples; inputs rotated across
//! buffers so the cache does not flatter small sizes; and, across ranks,
//! the slowest rank's time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrocomm::bootstrap::{store_all_gather, Store};
use ferrocomm::device::{BackendKind, Device};
use ferrocomm::{Communicator, Result};

use crate::args::Args;

/// Collectives per timed sample.
pub const OPS_PER_SAMPLE: usize = 20;

/// Bytes of input rotated through per size, so repeated runs do not sit in
/// L2 (50 MiB on H100/H200).
const ROTATE_BYTES: usize = 128 << 20;

/// Inputs a row of `in_bytes` rotates through (at most [`ROTATE_BYTES`] in
/// all, 1 to 8).
pub fn rotation(in_bytes: usize) -> usize {
    (ROTATE_BYTES / in_bytes.max(1)).clamp(1, 8)
}

/// Collectives per timed sample: [`OPS_PER_SAMPLE`] on GPUs (the shape of
/// nccl-tests and the torch baseline); on the host as many as move about
/// 64 MiB, so a sample is long enough to time and short enough to sweep.
pub fn ops_per_sample(backend: BackendKind, bytes: usize) -> usize {
    match backend {
        BackendKind::Host => ((64usize << 20) / bytes.max(1)).clamp(1, OPS_PER_SAMPLE),
        _ => OPS_PER_SAMPLE,
    }
}

/// Time `run` (call `i` of a sample, queued on `stream`) as every bench row
/// does: one call first (it compiles or loads what it needs, outside any
/// capture), `comm.prepare()`, a graph of `ops` calls when `mode` is
/// "graph", warm-up samples, then `iters` samples of `ops` back-to-back
/// calls (or one replay), each between two events. Device and CPU
/// microseconds per call, one per sample.
pub fn time_samples<D: Device>(
    comm: &Communicator<D>,
    a: &Args,
    mode: &str,
    stream: &D::Stream,
    ops: usize,
    run: impl Fn(usize) -> Result<()>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    time_samples_prepared(comm, a, mode, stream, ops, true, run)
}

/// [`time_samples`]; `prepare: false` skips `comm.prepare()` (which
/// compiles every kernel of the communicator's modules) where the first
/// call already loaded every kernel the samples launch.
pub fn time_samples_prepared<D: Device>(
    comm: &Communicator<D>,
    a: &Args,
    mode: &str,
    stream: &D::Stream,
    ops: usize,
    prepare: bool,
    run: impl Fn(usize) -> Result<()>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let dev = comm.device();
    let backend = dev.facts().backend;
    run(0)?;
    dev.synchronize(stream)?;
    if prepare {
        comm.prepare()?;
    }
    let graph = if mode == "graph" {
        dev.begin_capture(stream)?;
        let captured = (0..ops).try_for_each(&run);
        let g = dev.end_capture(stream)?;
        captured?;
        Some(g)
    } else {
        None
    };
    let sample = || match &graph {
        Some(g) => dev.launch_graph(g, stream),
        None => (0..ops).try_for_each(&run),
    };
    for _ in 0..a.warmup_for(backend) {
        sample()?;
    }
    dev.synchronize(stream)?;
    let iters = a.iters_for(backend);
    let events: Vec<(D::Event, D::Event)> = (0..iters)
        .map(|_| Ok((dev.create_event()?, dev.create_event()?)))
        .collect::<Result<_>>()?;
    let mut cpu = Vec::with_capacity(iters);
    for (e0, e1) in &events {
        dev.record(e0, stream)?;
        let t = Instant::now();
        sample()?;
        cpu.push(t.elapsed().as_secs_f64() * 1e6 / ops as f64);
        dev.record(e1, stream)?;
    }
    dev.synchronize(stream)?;
    let times = events
        .iter()
        .map(|(e0, e1)| dev.elapsed_ms(e0, e1).map(|ms| ms as f64 * 1e3 / ops as f64))
        .collect::<Result<_>>()?;
    Ok((times, cpu))
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Every rank's figures of one row, gathered through the store: what the
/// ranks agree the row measured.
pub struct RankFigures(Vec<Vec<u8>>);

impl RankFigures {
    /// This rank's `figures`, exchanged under `key` for every rank's.
    pub fn gather(
        store: &Arc<dyn Store>,
        key: &str,
        (rank, world): (usize, usize),
        figures: &[f64],
        timeout: Duration,
    ) -> Result<RankFigures> {
        let mine: Vec<u8> = figures.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(RankFigures(store_all_gather(
            store.as_ref(),
            key,
            rank,
            world,
            &mine,
            timeout,
        )?))
    }

    fn field(b: &[u8], i: usize) -> f64 {
        f64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]))
    }

    /// Figure `i` of the slowest rank (the largest).
    pub fn max(&self, i: usize) -> f64 {
        self.0.iter().map(|b| Self::field(b, i)).fold(0.0, f64::max)
    }

    /// Figure `i` (a count) summed over the ranks.
    pub fn sum(&self, i: usize) -> usize {
        self.0.iter().map(|b| Self::field(b, i) as usize).sum()
    }
}
