//! `--ep`: time EP dispatch + combine (`ferrocomm::ep::EpBuffer`) per
//! `--tokens` per rank, bf16 and fp8 payloads, at `--hidden` (7168),
//! `--topk` (8) of `--experts` (256), the way the other rows are timed
//! (graph replays of back-to-back calls between device events, median over
//! iterations; `--eager-only` times eager launches), next to an all-to-all-v
//! pipeline carrying the same bytes through a vendor-routed communicator
//! (NCCL/RCCL where the build has it): one `all_to_all_v_single` for the
//! dispatch (rows, scales, top-k ids and weights, token index) and one for
//! the combine (bf16 rows back). The pipeline is given its splits on the
//! host and leaves out the permutes around it, so it is a lower bound of
//! what an all-to-all-based EP costs.
//!
//! Checks: bf16 rows run once more with identity experts (the received rows
//! copied back as the experts' output), and every token's output must be
//! its row summed over the ranks it went to (f32, rounded once), bit for
//! bit; fp8 rows check every received row and count against the sources'
//! inputs. On the host backend the defaults are tiny (a smoke test).
//!
//! Here: the table and the EP calls timed; `inputs` makes the shape and
//! the rows' inputs, `check` judges the outputs, `a2a` times the baseline.

mod a2a;
mod check;
mod inputs;

use std::sync::Arc;

use ferrocomm::bootstrap::Store;
use ferrocomm::device::{BackendKind, Device};
use ferrocomm::ep::{EpBuffer, EpConfig, EpPayload};
use ferrocomm::{Algorithm, Call, Communicator, DType, Error, Result, Tensor};

use crate::args::Args;
use crate::timing::{median, time_samples_prepared, RankFigures, OPS_PER_SAMPLE};
use inputs::{config, scale_cols, shape, Inputs, Shape};

pub use inputs::with_heap;

struct Row {
    payload: &'static str,
    tokens: usize,
    mode: &'static str,
    ep_us: f64,
    a2a_us: f64,
    cpu_us: f64,
    wrong: usize,
}

pub fn bench_ep<D: Device>(comm: &Communicator<D>, store: &Arc<dyn Store>, a: &Args) -> Result<()> {
    let dev = comm.device();
    let (rank, world) = (comm.rank(), comm.size());
    let s = shape(a, dev.facts().backend, world);
    if s.tokens.contains(&0) {
        return Err(Error::invalid("--ep needs --tokens of at least 1"));
    }
    // The all-to-all pipeline's communicator: the vendor library where it loaded.
    let vopts = comm.options().clone().with_coll_route(Algorithm::Vendor);
    let vcomm = Communicator::new(dev.duplicate()?, store.clone(), rank, world, vopts)?;
    if rank == 0 {
        print_header(comm, &vcomm, a, &s);
    }
    let modes: &[&'static str] = if a.eager_only { &["eager"] } else { &["graph"] };
    let mut wrong_total = 0;
    let mut seq = 0;
    for payload in [EpPayload::Bf16, EpPayload::Fp8] {
        for &tokens in &s.tokens {
            for &mode in modes {
                let cfg = config(&s, tokens, payload);
                let row = one(comm, &vcomm, a, &s, &cfg, mode)?;
                seq += 1;
                let row = agree(store, seq, (rank, world), row, a)?;
                wrong_total += row.wrong;
                if rank == 0 {
                    print_row(&row);
                }
            }
        }
    }
    vcomm.finalize()?;
    comm.finalize()?;
    if wrong_total > 0 {
        return Err(Error::Aborted(format!("{wrong_total} wrong EP outputs")));
    }
    Ok(())
}

fn print_header<D: Device>(comm: &Communicator<D>, vcomm: &Communicator<D>, a: &Args, s: &Shape) {
    let facts = comm.device().facts();
    let a2a_name = if vcomm.has_vendor_library() {
        "vendor a2av"
    } else {
        "a2av (no vendor library: ferrocomm's)"
    };
    println!(
        "# ferrocomm-bench ep backend={} world={} hidden={} experts={} topk={} iters={} warmup={} ({}); \
         baseline: {a2a_name}, dispatch + combine",
        a.backend,
        comm.size(),
        s.hidden,
        s.experts,
        s.topk,
        a.iters_for(facts.backend),
        a.warmup_for(facts.backend),
        facts.name
    );
    println!(
        "{:>7} {:>7} {:>6} {:>10} {:>10} {:>9} {:>8} {:>7}",
        "payload", "tokens", "mode", "ep_us", "a2av_us", "a2av/ep", "cpu_us", "#wrong"
    );
}

fn print_row(row: &Row) {
    println!(
        "{:>7} {:>7} {:>6} {:>10.2} {:>10.2} {:>9.2} {:>8.2} {:>7}",
        row.payload,
        row.tokens,
        row.mode,
        row.ep_us,
        row.a2a_us,
        row.a2a_us / row.ep_us,
        row.cpu_us,
        row.wrong
    );
}

/// The slowest rank's times, every rank's wrong count.
fn agree(store: &Arc<dyn Store>, seq: usize, ranks: (usize, usize), row: Row, a: &Args) -> Result<Row> {
    let mine = [row.ep_us, row.a2a_us, row.cpu_us, row.wrong as f64];
    let all = RankFigures::gather(store, &format!("bench-ep/{seq}"), ranks, &mine, a.timeout)?;
    Ok(Row {
        ep_us: all.max(0),
        a2a_us: all.max(1),
        cpu_us: all.max(2),
        wrong: all.sum(3),
        ..row
    })
}

/// One row: EP dispatch + combine, then the all-to-all-v pipeline.
fn one<D: Device>(
    comm: &Communicator<D>,
    vcomm: &Communicator<D>,
    a: &Args,
    s: &Shape,
    cfg: &EpConfig,
    mode: &'static str,
) -> Result<Row> {
    let inputs = Inputs::new(s, cfg, comm.rank(), comm.size());
    let (mut times, mut cpu, wrong) = time_ep(comm, a, cfg, &inputs, mode)?;
    let a2a_stream = comm.device().create_stream()?;
    let mut a2a_times = a2a::time_a2a(vcomm, a, cfg, &inputs.ids, mode, &a2a_stream)?;
    Ok(Row {
        payload: if cfg.payload == EpPayload::Fp8 { "fp8" } else { "bf16" },
        tokens: cfg.max_tokens_per_rank,
        mode,
        ep_us: median(&mut times),
        a2a_us: median(&mut a2a_times),
        cpu_us: median(&mut cpu),
        wrong,
    })
}

/// EP rounds per timed sample (dispatch + combine): two on the host.
fn ops_per_sample(backend: BackendKind) -> usize {
    if backend == BackendKind::Host {
        2
    } else {
        OPS_PER_SAMPLE
    }
}

/// EP dispatch + combine timed (device and CPU us per round), then one
/// more round checked: (times, CPU times, wrong outputs).
fn time_ep<D: Device>(
    comm: &Communicator<D>,
    a: &Args,
    cfg: &EpConfig,
    inputs: &Inputs,
    mode: &'static str,
) -> Result<(Vec<f64>, Vec<f64>, usize)> {
    let dev = comm.device();
    let t = RowTensors::new(comm, cfg, inputs)?;
    let ep = EpBuffer::new(comm, *cfg)?;
    let stream = dev.create_stream()?;
    let run = |_: usize| -> Result<()> {
        let on = Call::on(&stream);
        ep.dispatch(t.x, t.scales, t.idx, t.weights, cfg.max_tokens_per_rank, &on)?;
        ep.combine(t.expert, t.out, &on).map(drop)
    };
    // The first call loads the EP kernels; `prepare` would also compile
    // every collective kernel, which these samples never launch.
    let ops = ops_per_sample(dev.facts().backend);
    let (times, cpu) = time_samples_prepared(comm, a, mode, &stream, ops, false, run)?;
    let round = check::Round {
        comm,
        ep: &ep,
        cfg,
        inputs,
        t: &t,
        stream: &stream,
    };
    let wrong = round.wrong()?;
    ep.free()?;
    Ok((times, cpu, wrong))
}

/// A row's buffers and its tensors over them: dispatch's inputs (rows,
/// fp8 scales, top-k ids and weights), the experts' output and the
/// combine's.
struct RowTensors<D: Device> {
    bufs: [D::Buffer; 6],
    x: Tensor,
    scales: Option<Tensor>,
    idx: Tensor,
    weights: Tensor,
    expert: Tensor,
    out: Tensor,
}

impl<D: Device> RowTensors<D> {
    /// Buffers for a row of `cfg`, this rank's inputs written and waited for.
    fn new(comm: &Communicator<D>, cfg: &EpConfig, inputs: &Inputs) -> Result<Self> {
        let (world, n, hd, k) = (comm.size(), cfg.max_tokens_per_rank, cfg.hidden, cfg.topk);
        let alloc = |b: usize| comm.alloc(b.max(16));
        let bufs = [
            alloc(inputs.x.len())?,
            alloc(inputs.scales.len())?,
            alloc(inputs.idx.len())?,
            alloc(inputs.weights.len())?,
            alloc(world * n * hd * 2)?,
            alloc(n * hd * 2)?,
        ];
        let written = [&inputs.x, &inputs.scales, &inputs.idx, &inputs.weights];
        for (buf, bytes) in bufs.iter().zip(written) {
            comm.write(buf, 0, bytes)?;
        }
        comm.device().synchronize(comm.stream())?;
        let x_dtype = if cfg.payload == EpPayload::Fp8 {
            DType::F8E4M3
        } else {
            DType::BF16
        };
        let cols = scale_cols(cfg);
        Ok(RowTensors {
            x: Tensor::view(&bufs[0], x_dtype, 0, n * hd)?,
            scales: (cols > 0)
                .then(|| Tensor::view(&bufs[1], DType::F32, 0, n * cols))
                .transpose()?,
            idx: Tensor::view(&bufs[2], DType::I32, 0, n * k)?,
            weights: Tensor::view(&bufs[3], DType::F32, 0, n * k)?,
            expert: Tensor::view(&bufs[4], DType::BF16, 0, world * n * hd)?,
            out: Tensor::view(&bufs[5], DType::BF16, 0, n * hd)?,
            bufs,
        })
    }

    /// The combine's output buffer.
    fn out_buf(&self) -> &D::Buffer {
        &self.bufs[5]
    }
}
