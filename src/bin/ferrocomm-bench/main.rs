//! `ferrocomm-bench`: an nccl-tests-style collectives benchmark.
//!
//! Run without `RANK` set, it launches `--world` rank processes of itself
//! (hosting their store) and prints rank 0's table as it is measured. Each
//! rank times every collective of `--coll` (all-reduce by default) and
//! every algorithm of `--algo` side by side with NCCL/RCCL called directly
//! (`nccl-direct`, where built and present) and a device memcpy of the same
//! bytes: device events after warm-up, median over iterations, inputs
//! rotated across buffers so the cache does not flatter small sizes; eager
//! launches and, with `--graph`, graph replays. Every row is checked
//! exactly (#wrong). Sizes and bus bandwidth follow nccl-tests.
//!
//! `--operands heap|both` puts the `--coll` rows' buffers in the symmetric
//! heap (the direct kinds from `FERROCOMM_DIRECT_MIN_BYTES` a peer), or
//! times plain and heap rows in one run (`operands.rs`).
//!
//! `--quantization int4,int6,int8,fp8` adds a quick-reduce row per codec
//! (f16/bf16 sums) next to the `--algo` rows, feeds Gaussian data instead of
//! small integers, and prints each row's relative error against an fp64 sum
//! (`relerr`, over up to 4096 sampled blocks). Quick-reduce rows are checked
//! bit for bit against `codec::reference_all_reduce`, ferrocomm's other rows
//! against the exact rule, on the same samples; NCCL rows are not bitwise
//! comparable on such data (`#wrong` shows `-`).

mod broadcaster;
mod colls;
mod ep;
mod fused;
mod heap;
mod operands;
mod plot;

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrocomm::algo::kernels::QR_DTYPES;
use ferrocomm::bootstrap::{store_all_gather, Store, TcpStore};
use ferrocomm::codec::{self, Half16, Quantization};
use ferrocomm::device::{BackendKind, Device};
use ferrocomm::testing::data::{self, Values};
use ferrocomm::testing::launch::run_process_ranks_echo;
use ferrocomm::Algorithm;
use ferrocomm::{CommOptions, Communicator, DType, Error, ReduceOp, Result, Tensor};

/// Dispatch `$f::<T>(args)` on a runtime dtype.
macro_rules! with_dtype {
    ($dtype:expr, $($f:ident)::+($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $($f)::+::<f32>($($arg),*),
            DType::F16 => $($f)::+::<half::f16>($($arg),*),
            DType::BF16 => $($f)::+::<half::bf16>($($arg),*),
            DType::I32 => $($f)::+::<i32>($($arg),*),
            other => return Err(Error::invalid(format!("the all-reduce bench reduces f32, f16, bf16 or i32, not {other}"))),
        }
    };
}

const USAGE: &str =
    "usage: ferrocomm-bench [--backend host|cuda|hip] [--world N] [--coll all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|reduce|sendrecv|all]
                       [--dtype f32|f16|bf16|i32] [--op sum|prod|min|max|avg]
                       [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N] [--algo auto|oneshot|twoshot|oneshot-push|twoshot-push|oneshot-ll|nccl|all]
                       [--graph] [--graph-only] [--eager-only] [--json FILE] [--plot FILE.svg] [--timeout-secs S]
                       [--operands plain|heap|both]  (--coll rows' buffers: comm.alloc, the symmetric heap, or both
                        side by side; heap operands take the direct kinds from FERROCOMM_DIRECT_MIN_BYTES a peer)
                       [--quantization int4,int6,int8,fp8]
                       [--fused res,rms,rms_fp8,rms_fp8tok,rms_i8tok|all [--tokens 1,32,128,2048] [--hidden 4096]
                        [--fused-moe TOPK,..]]
                       [--heap]  (device put vs copy engine, user all-gather vs all_gather)
                       [--broadcaster]  (the metadata broadcaster: msgs/s and latency at 64 B, 4 KiB, 1 MiB)
                       [--ep [--tokens 1,8,32,128,512,1024,4096] [--hidden 7168] [--experts 256] [--topk 8] [--eager-only]]
sizes take K, M, G suffixes (powers of 1024); --iters and --warmup default to 20 and 5 on GPUs, 5 and 1 on the host";

#[derive(Clone, Debug)]
struct Args {
    backend: String,
    world: usize,
    colls: Vec<colls::Coll>,
    dtypes: Vec<DType>,
    op: ReduceOp,
    min_bytes: usize,
    max_bytes: usize,
    /// `None`: the backend's default (see [`Args::iters_for`]).
    iters: Option<usize>,
    warmup: Option<usize>,
    algos: Vec<String>,
    graph: bool,
    eager: bool,
    json: Option<PathBuf>,
    plot: Option<PathBuf>,
    timeout: Duration,
    /// Quick-reduce codecs to add rows for (Gaussian data, relative error).
    quantization: Vec<Quantization>,
    /// `--fused`: time the fused all-reduce epilogues of these patterns
    /// (rows of `hidden`, `tokens` each) instead of the collectives.
    fused: Option<Vec<ferrocomm::FusionPattern>>,
    /// `--fused-moe`: top-k values of MoE-finalize rows (fused, and the
    /// unfused pipeline beside them) added to the fused table.
    fused_moe: Vec<usize>,
    tokens: Vec<usize>,
    hidden: usize,
    /// `--heap`: the symmetric heap's rows (`heap.rs`) instead of the collectives.
    heap: bool,
    /// `--broadcaster`: the metadata broadcaster's rows (`broadcaster.rs`).
    broadcaster: bool,
    /// `--operands`: where the `--coll` rows' buffers live (plain first).
    operands: Vec<operands::Operands>,
    /// `--ep`: time EP dispatch + combine against an all-to-all-v pipeline.
    ep: bool,
    /// Whether `--tokens` / `--hidden` were given (`--ep` has its own defaults).
    tokens_given: bool,
    hidden_given: bool,
    experts: Option<usize>,
    topk: Option<usize>,
    /// `--eager-only` was given (`--ep` replays graphs otherwise).
    eager_only: bool,
}

impl Args {
    /// Timed samples per row: fewer on the host, where a sample of a large
    /// size takes tens of milliseconds, so the default sweep stays short.
    fn iters_for(&self, backend: BackendKind) -> usize {
        self.iters.unwrap_or(if backend == BackendKind::Host { 5 } else { 20 })
    }

    fn warmup_for(&self, backend: BackendKind) -> usize {
        self.warmup.unwrap_or(if backend == BackendKind::Host { 1 } else { 5 })
    }
}

/// Collectives per timed sample: [`OPS_PER_SAMPLE`] on GPUs (the shape of
/// nccl-tests and the torch baseline); on the host as many as move about
/// 64 MiB, so a sample is long enough to time and short enough to sweep.
fn ops_per_sample(backend: BackendKind, bytes: usize) -> usize {
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
fn time_samples<D: Device>(
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
fn time_samples_prepared<D: Device>(
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

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1usize << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| Error::invalid(format!("bad size {s:?}")))
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        backend: "host".into(),
        world: 2,
        colls: vec![colls::Coll::AllReduce],
        dtypes: vec![DType::BF16],
        op: ReduceOp::Sum,
        min_bytes: 1 << 10,
        max_bytes: 64 << 20,
        iters: None,
        warmup: None,
        algos: vec!["auto".into()],
        graph: false,
        eager: true,
        json: None,
        plot: None,
        timeout: Duration::from_secs(60),
        quantization: Vec::new(),
        fused: None,
        heap: false,
        broadcaster: false,
        operands: vec![operands::Operands::Plain],
        fused_moe: Vec::new(),
        tokens: vec![1, 32, 128, 2048],
        hidden: 4096,
        ep: false,
        tokens_given: false,
        hidden_given: false,
        experts: None,
        topk: None,
        eager_only: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| Error::invalid(format!("{flag} needs a value\n{USAGE}")))
        };
        match flag.as_str() {
            "--backend" => a.backend = value()?,
            "--world" => a.world = value()?.parse().map_err(|_| Error::invalid("--world takes a number"))?,
            "--coll" => a.colls = colls::Coll::parse(&value()?)?,
            "--dtype" => a.dtypes = value()?.split(',').map(str::parse).collect::<Result<_>>()?,
            "--op" => a.op = value()?.parse()?,
            "--min-bytes" => a.min_bytes = parse_size(&value()?)?,
            "--max-bytes" => a.max_bytes = parse_size(&value()?)?,
            "--iters" => a.iters = Some(value()?.parse().map_err(|_| Error::invalid("--iters takes a number"))?),
            "--warmup" => {
                a.warmup = Some(
                    value()?
                        .parse()
                        .map_err(|_| Error::invalid("--warmup takes a number"))?,
                )
            }
            "--algo" => a.algos = value()?.split(',').map(String::from).collect(),
            "--graph" => a.graph = true,
            "--eager-only" => {
                a.graph = false;
                a.eager_only = true
            }
            "--graph-only" => {
                a.graph = true;
                a.eager = false
            }
            "--quantization" => {
                a.quantization = value()?
                    .split(',')
                    .map(str::parse)
                    .filter(|q| q.as_ref().map_or(true, |q| *q != Quantization::None))
                    .collect::<Result<_>>()?
            }
            "--fused" => a.fused = Some(fused::parse_patterns(&value()?)?),
            "--heap" => a.heap = true,
            "--broadcaster" => a.broadcaster = true,
            "--operands" => a.operands = operands::Operands::parse(&value()?)?,
            "--fused-moe" => a.fused_moe = fused::parse_topks(&value()?)?,
            "--ep" => a.ep = true,
            "--experts" => {
                a.experts = Some(
                    value()?
                        .parse()
                        .map_err(|_| Error::invalid("--experts takes a number"))?,
                )
            }
            "--topk" => a.topk = Some(value()?.parse().map_err(|_| Error::invalid("--topk takes a number"))?),
            "--tokens" => {
                a.tokens_given = true;
                a.tokens = value()?
                    .split(',')
                    .map(|t| t.trim().parse().map_err(|_| Error::invalid("--tokens takes numbers")))
                    .collect::<Result<_>>()?
            }
            "--hidden" => {
                a.hidden_given = true;
                a.hidden = value()?
                    .parse()
                    .map_err(|_| Error::invalid("--hidden takes a number"))?
            }
            "--json" => a.json = Some(PathBuf::from(value()?)),
            "--plot" => a.plot = Some(PathBuf::from(value()?)),
            "--timeout-secs" => {
                a.timeout = Duration::from_secs(
                    value()?
                        .parse()
                        .map_err(|_| Error::invalid("--timeout-secs takes a number"))?,
                )
            }
            "-h" | "--help" => return Err(Error::invalid(USAGE)),
            _ => return Err(Error::invalid(format!("unknown flag {flag}\n{USAGE}"))),
        }
    }
    if a.iters == Some(0) || a.world == 0 || a.min_bytes > a.max_bytes {
        return Err(Error::invalid(format!(
            "need --iters > 0, --world > 0 and --min-bytes <= --max-bytes\n{USAGE}"
        )));
    }
    if !a.quantization.is_empty() && (a.op != ReduceOp::Sum || a.dtypes.iter().any(|d| !QR_DTYPES.contains(d))) {
        return Err(Error::invalid("--quantization runs f16/bf16 sums only"));
    }
    if a.operands != [operands::Operands::Plain] && (a.fused.is_some() || !a.fused_moe.is_empty() || a.heap || a.ep) {
        return Err(Error::invalid(
            "--operands heap|both applies to the --coll rows, not to --fused, --fused-moe, --heap or --ep",
        ));
    }
    if !a.fused_moe.is_empty() && a.fused.is_none() {
        // MoE rows alone: the pattern of a MoE layer's end.
        a.fused = Some(vec![ferrocomm::FusionPattern::ResidualRmsNorm]);
    }
    if a.algos.iter().any(|x| x == "all") {
        a.algos = [
            "auto",
            "oneshot-ll",
            "oneshot-push",
            "twoshot-push",
            "oneshot",
            "twoshot",
            "nccl",
        ]
        .map(String::from)
        .to_vec();
    }
    Ok(a)
}

fn main() -> ExitCode {
    let result = parse_args().and_then(|a| {
        if std::env::var("RANK").is_ok() {
            rank_main(&a)
        } else {
            launch(&a)
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferrocomm-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Start one process per rank and relay rank 0's table.
fn launch(a: &Args) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("locating ferrocomm-bench", e))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let budget = a.timeout * 4 + Duration::from_secs(600);
    // Rank 0's rows come through as it prints them; it draws a progress line
    // on stderr only when ours is a terminal.
    let progress = if std::io::stderr().is_terminal() { "1" } else { "0" };
    let outs = run_process_ranks_echo(&exe, &args, a.world, &[("FERROCOMM_BENCH_PROGRESS", progress)], budget)?;
    let mut failed = Vec::new();
    for o in &outs {
        if o.code != Some(0) {
            failed.push(format!(
                "rank {} (exit {:?}, timed out {}): {}",
                o.rank,
                o.code,
                o.timed_out,
                o.stderr.trim()
            ));
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Error::Aborted(failed.join("\n")))
    }
}

fn rank_main(a: &Args) -> Result<()> {
    let addr = std::env::var("FERROCOMM_STORE_ADDR").map_err(|_| Error::invalid("FERROCOMM_STORE_ADDR is not set"))?;
    let token = std::env::var("FERROCOMM_TOKEN").map_err(|_| Error::invalid("FERROCOMM_TOKEN is not set"))?;
    let addr = addr
        .parse()
        .map_err(|_| Error::invalid(format!("FERROCOMM_STORE_ADDR={addr:?}")))?;
    let store: Arc<dyn Store> = Arc::new(TcpStore::connect(addr, token.as_bytes(), Duration::from_secs(30))?);
    let rank: usize = std::env::var("RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::invalid("RANK"))?;
    match a.backend.as_str() {
        "host" => bench(ferrocomm::backends::host::HostDevice::new(rank)?, store, rank, a),
        #[cfg(feature = "cuda")]
        "cuda" => bench(ferrocomm::backends::cuda::CudaDevice::new(rank)?, store, rank, a),
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err(Error::NotCompiled {
            backend: "cuda",
            feature: "cuda",
        }),
        #[cfg(feature = "rocm")]
        "hip" | "rocm" => bench(ferrocomm::backends::hip::HipDevice::new(rank)?, store, rank, a),
        #[cfg(not(feature = "rocm"))]
        "hip" | "rocm" => Err(Error::NotCompiled {
            backend: "hip",
            feature: "rocm",
        }),
        other => Err(Error::invalid(format!("unknown backend {other:?}"))),
    }
}

struct Row {
    coll: colls::Coll,
    bytes: usize,
    count: usize,
    dtype: DType,
    op: ReduceOp,
    algo: String,
    mode: &'static str,
    time_us: f64,
    cpu_us: f64,
    /// Elements that differ from the reference; `None`: not bitwise comparable.
    wrong: Option<usize>,
    /// ‖out − exact‖ / ‖exact‖ against an fp64 sum (with `--quantization`).
    relerr: Option<f64>,
    /// Where the row's buffers lived (`--operands`).
    operands: operands::Operands,
}

/// Bytes of input rotated through per size, so repeated runs do not sit in
/// L2 (50 MiB on H100/H200).
const ROTATE_BYTES: usize = 128 << 20;

/// Collectives per timed sample.
const OPS_PER_SAMPLE: usize = 20;

/// Inputs a row of `in_bytes` rotates through (at most [`ROTATE_BYTES`] in
/// all, 1 to 8).
fn rotation(in_bytes: usize) -> usize {
    (ROTATE_BYTES / in_bytes.max(1)).clamp(1, 8)
}

/// The `--coll` rows' sizes for `dtype`: powers of two from `--min-bytes`
/// (at least one element a rank) to `--max-bytes`.
fn sizes(a: &Args, dtype: DType, world: usize) -> impl Iterator<Item = usize> {
    let first = a.min_bytes.max(dtype.size() * world);
    let max = a.max_bytes;
    std::iter::successors(Some(first), |b| b.checked_mul(2)).take_while(move |&b| b <= max)
}

/// What a row times.
#[derive(Clone, Copy)]
enum Subject {
    /// The collective through ferrocomm, with an algorithm choice (the
    /// all-reduce's; the planner's, `None`, for the others).
    Ferro(Option<Algorithm>),
    /// The collective straight through NCCL/RCCL on the same stream.
    NcclDirect,
    /// A device-to-device copy of the same bytes: the memory floor beside
    /// the collectives (a plain memcpy on the host).
    Memcpy,
}

/// Rank 0's progress line on stderr (when the launcher's stderr is a terminal).
struct Progress {
    on: bool,
    done: usize,
    total: usize,
}

impl Progress {
    fn new(rank: usize, total: usize) -> Self {
        let on = rank == 0 && std::env::var("FERROCOMM_BENCH_PROGRESS").as_deref() == Ok("1");
        Progress { on, done: 0, total }
    }

    fn step(&mut self, what: &str) {
        self.done += 1;
        if self.on {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K[{}/{}] {what}", self.done, self.total);
            let _ = err.flush();
        }
    }

    fn finish(&self) {
        if self.on {
            eprint!("\r\x1b[2K");
        }
    }
}

fn bench<D: Device>(dev: D, store: Arc<dyn Store>, rank: usize, a: &Args) -> Result<()> {
    let world = a.world;
    let mut opts = CommOptions::from_env()?.with_timeout(a.timeout);
    if let Some(&q) = a.quantization.first() {
        // Compiles quick-reduce at creation, not inside the first capture.
        opts = opts.with_quantization(q);
    }
    let backend = dev.facts().backend;
    if a.ep {
        // The heap holds the sweep's largest EP buffer.
        opts = ep::with_heap(opts, a, backend, world)?;
    }
    // The heap holds the heap rows' buffers (`--operands heap|both`).
    opts = operands::with_heap(opts, a, backend, world)?;
    let comm = Communicator::new(dev, store.clone(), rank, world, opts)?;
    if let (0, Some(report)) = (rank, comm.autotune_report()) {
        // What dispatch reads for `auto` rows (FERROCOMM_AUTOTUNE=0: the
        // static table, nothing printed).
        println!("# autotune: {:?}", report.source);
        for line in report.table_text().lines() {
            println!("# autotune table: {line}");
        }
    }
    if a.ep {
        return ep::bench_ep(&comm, &store, a);
    }
    if let Some(patterns) = &a.fused {
        // --algo auto, oneshot-push or twoshot-push pick the fused family.
        return fused::bench_fused(&comm, a, patterns);
    }
    if a.broadcaster {
        return broadcaster::bench_broadcaster(&comm, &store, a);
    }
    if a.heap {
        return heap::bench_heap(&comm, a);
    }
    let quantized = !a.quantization.is_empty();
    let mut subjects: Vec<(String, Subject)> = Vec::new();
    for algo in &a.algos {
        let choice = algo_choice(algo).ok_or_else(|| Error::invalid(format!("unknown --algo {algo:?}")))?;
        if choice == Some(Algorithm::Vendor) {
            if !comm.has_vendor_library() {
                if rank == 0 {
                    println!("# no {algo} rows: the vendor library is not built in or not loaded");
                }
                continue;
            }
            // NCCL through ferrocomm, and NCCL called directly beside it.
            subjects.push((algo.clone(), Subject::Ferro(choice)));
            subjects.push(("nccl-direct".into(), Subject::NcclDirect));
            continue;
        }
        subjects.push((algo.clone(), Subject::Ferro(choice)));
    }
    for q in &a.quantization {
        if let Some(codec) = q.codec(backend) {
            let qr = Algorithm::QuickReduce(codec);
            subjects.push((qr.to_string(), Subject::Ferro(Some(qr))));
        }
    }
    subjects.push(("memcpy".into(), Subject::Memcpy));
    let modes: &[&'static str] = match (a.eager, a.graph) {
        (true, true) => &["eager", "graph"],
        (false, true) => &["graph"],
        _ => &["eager"],
    };
    let sizes = |dtype: DType| sizes(a, dtype, world);
    // Subjects a collective takes: the all-reduce's algorithms apply to it
    // alone; memcpy rows once per size.
    // With --operands both, the heap rows leave memcpy and nccl-direct
    // (ferrocomm's route plays no part in them) to the plain rows.
    let both = a.operands.len() > 1;
    let applies = |c: colls::Coll, s: &Subject, on: operands::Operands| match s {
        Subject::Ferro(choice) => colls::algo_applies(c, *choice),
        Subject::NcclDirect => !(both && on == operands::Operands::Heap),
        Subject::Memcpy => c == a.colls[0] && !(both && on == operands::Operands::Heap),
    };
    let rows_total: usize = a
        .operands
        .iter()
        .flat_map(|&on| a.colls.iter().map(move |&c| (on, c)))
        .map(|(on, c)| {
            let per_size = subjects.iter().filter(|(_, s)| applies(c, s, on)).count() * modes.len();
            a.dtypes.iter().map(|&d| sizes(d).count()).sum::<usize>() * per_size
        })
        .sum();
    let mut progress = Progress::new(rank, rows_total);
    let mut rows = Vec::new();
    let mut seq = 0usize;
    if rank == 0 {
        println!(
            "# ferrocomm-bench backend={} world={world} iters={} warmup={} operands={} direct_min_bytes={} ({})",
            a.backend,
            a.iters_for(backend),
            a.warmup_for(backend),
            a.operands.iter().map(|o| o.name()).collect::<Vec<_>>().join(","),
            direct_min_label(&comm),
            comm.device().facts().name
        );
        println!(
            "{:>14} {:>12} {:>12} {:>6} {:>5} {:>20} {:>8} {:>6} {:>10} {:>9} {:>9} {:>8} {:>7} {:>8}",
            "coll",
            "size",
            "count",
            "dtype",
            "op",
            "algo",
            "operands",
            "mode",
            "time_us",
            "algbw",
            "busbw",
            "cpu_us",
            "#wrong",
            "relerr"
        );
    }
    // Plain rows first; the heap is reserved when the heap rows start: a
    // communicator with a heap launches the direct kinds on plain buffers
    // too (to fall back), so plain rows after it would not time the inbox way.
    let mut heap_ops: Option<operands::HeapOperands> = None;
    for (on, coll) in a.operands.iter().flat_map(|&on| a.colls.iter().map(move |&c| (on, c))) {
        if on == operands::Operands::Heap && heap_ops.is_none() {
            heap_ops = Some(operands::HeapOperands::alloc(&comm, a)?);
        }
        for &dtype in &a.dtypes {
            if coll.reduces() {
                ferrocomm::dtype::check_supported(dtype, a.op)?;
            }
            for bytes in sizes(dtype) {
                let Some((n_in, n_out)) = coll.counts(bytes, dtype, world) else {
                    continue;
                };
                // Inputs and the exact expected output, made once per size.
                let seed = bytes as u64 ^ coll as u64;
                let (input, want) = if quantized && coll == colls::Coll::AllReduce {
                    let values = Values::Random;
                    (
                        with_dtype!(dtype, input_bytes(seed, rank, n_in, a.op, values)),
                        Vec::new(),
                    )
                } else {
                    with_dtype!(dtype, colls::data_for(coll, seed, rank, world, n_in, n_out, a.op))
                };
                for (name, subject) in &subjects {
                    if !applies(coll, subject, on) {
                        continue;
                    }
                    for &mode in modes {
                        seq += 1;
                        progress.step(&format!(
                            "{} {} {name} {} {mode}",
                            coll.name(),
                            plot::human_bytes(bytes as f64),
                            on.name()
                        ));
                        let case = Case {
                            coll,
                            dtype,
                            n_in,
                            n_out,
                            bytes,
                        };
                        let (mut row, got) = measure(&comm, a, &case, *subject, mode, &input, heap_ops.as_ref())?;
                        match *subject {
                            Subject::Memcpy => {
                                row.algo = name.clone();
                                row.wrong = Some(count_wrong(&got, &input[..got.len().min(input.len())], dtype));
                            }
                            Subject::NcclDirect => {
                                row.algo = name.clone();
                                row.wrong = Some(count_wrong(&got, &want, dtype));
                            }
                            Subject::Ferro(choice) => {
                                if quantized && coll == colls::Coll::AllReduce {
                                    let (planned, count) = coll.planned(n_in, world);
                                    let algorithm = comm.planned_algorithm(planned, count, dtype, a.op, choice)?;
                                    let (wrong, relerr) = match dtype {
                                        DType::F16 => check_samples::<half::f16>(seed, world, &got, algorithm),
                                        _ => check_samples::<half::bf16>(seed, world, &got, algorithm),
                                    };
                                    row.wrong = wrong;
                                    row.relerr = Some(relerr);
                                } else {
                                    row.wrong = Some(count_wrong(&got, &want, dtype));
                                }
                                // The one vocabulary: what auto took, named.
                                row.algo = match choice {
                                    None => {
                                        let (planned, count) = coll.planned(n_in, world);
                                        match comm.planned_algorithm(planned, count, dtype, a.op, None)? {
                                            Some(x) => format!("auto:{x}"),
                                            None => "auto".into(),
                                        }
                                    }
                                    Some(Algorithm::Vendor) => name.clone(),
                                    Some(x) => x.to_string(),
                                };
                            }
                        }
                        let row = agree(&store, seq, rank, world, row, a.timeout)?;
                        if rank == 0 {
                            progress.finish();
                            print_row(&row, world);
                        }
                        rows.push(row);
                    }
                }
            }
        }
    }
    if let Some(h) = heap_ops {
        comm.device().synchronize(comm.stream())?;
        h.free(&comm)?;
    }
    progress.finish();
    comm.finalize()?;
    if rank == 0 {
        if both {
            print_pairs(&rows);
        }
        if let Some(path) = &a.json {
            std::fs::write(path, to_json(&rows, a, comm.options().direct_min_bytes))
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        }
        if let Some(path) = &a.plot {
            let points: Vec<plot::Point> = rows
                .iter()
                .map(|r| plot::Point {
                    // "auto:oneshot" and "auto:twoshot-push" are one line, "auto".
                    series: format!(
                        "{}{}{} {}",
                        if a.colls.len() > 1 {
                            format!("{} ", r.coll.name())
                        } else {
                            String::new()
                        },
                        r.algo.split(':').next().unwrap_or(&r.algo),
                        match r.operands {
                            operands::Operands::Heap => "+heap",
                            operands::Operands::Plain => "",
                        },
                        r.mode
                    ),
                    bytes: r.bytes,
                    busbw: bandwidths(r, world).1,
                })
                .collect();
            let dtypes: Vec<&str> = a.dtypes.iter().map(|d| d.name()).collect();
            let names: Vec<&str> = a.colls.iter().map(|c| c.name()).collect();
            let title = format!(
                "{} {} {}, {} backend, world {world} ({})",
                names.join("/"),
                dtypes.join("/"),
                a.op,
                a.backend,
                comm.device().facts().name
            );
            plot::write_svg(path, &title, &points)?;
            println!("# plot written to {}", path.display());
        }
    }
    let wrong: usize = rows.iter().filter_map(|r| r.wrong).sum();
    if wrong > 0 {
        return Err(Error::Aborted(format!("{wrong} wrong elements in total")));
    }
    Ok(())
}

fn algo_choice(name: &str) -> Option<Option<Algorithm>> {
    ferrocomm::plan::parse_choice(name).ok()
}

/// One row's collective and sizes.
struct Case {
    coll: colls::Coll,
    dtype: DType,
    n_in: usize,
    n_out: usize,
    bytes: usize,
}

/// One row's samples and the output of one more run. `heap`: the row's
/// buffers are views of these heap allocations (`--operands heap`), else
/// plain allocations of its own.
#[allow(clippy::too_many_arguments)]
fn measure<D: Device>(
    comm: &Communicator<D>,
    a: &Args,
    case: &Case,
    subject: Subject,
    mode: &'static str,
    input: &[u8],
    heap: Option<&operands::HeapOperands>,
) -> Result<(Row, Vec<u8>)> {
    let dev = comm.device();
    let backend = dev.facts().backend;
    let (coll, dtype) = (case.coll, case.dtype);
    let (in_bytes, out_bytes) = (case.n_in * dtype.size(), case.n_out * dtype.size());
    let nbuf = rotation(in_bytes);
    let bufs = operands::RowBuffers::new(comm, heap, nbuf, in_bytes, out_bytes)?;
    // The writes are ordered on the communicator's stream, and waited for:
    // the runs below go on another one.
    bufs.write_inputs(comm, nbuf, input)?;
    let stream = dev.create_stream()?;
    let t_in = |i: usize| bufs.input(i % nbuf, dtype, case.n_in);
    let t_out = bufs.output(dtype, case.n_out)?;
    let run = |i: usize| -> Result<()> {
        match subject {
            Subject::Ferro(choice) => {
                let call = colls::with_algo(ferrocomm::Call::<D>::on(&stream), choice);
                colls::through_ferrocomm(comm, &call, coll, t_in(i)?, t_out, a.op)
            }
            Subject::NcclDirect => nccl_direct(comm, &stream, coll, t_in(i)?, t_out, a.op),
            Subject::Memcpy => dev.copy_device(bufs.output_ptr(), bufs.input_ptr(i % nbuf), in_bytes, &stream),
        }
    };
    // A sample is a few back-to-back operations (eager launches, or one
    // replay of a graph holding them), timed by events and divided: the same
    // shape as nccl-tests and the torch baseline.
    let ops = ops_per_sample(backend, case.bytes);
    let (mut times, mut cpu) = time_samples(comm, a, mode, &stream, ops, run)?;
    // The output of one more run, from a poisoned buffer (or, for the
    // in-place reduce, from the input), for the checks.
    let check_len = if matches!(subject, Subject::Memcpy) {
        in_bytes
    } else {
        out_bytes
    };
    if colls::in_place(coll) && !matches!(subject, Subject::Memcpy) {
        bufs.write_output(comm, input)?;
    } else {
        bufs.poison_output(comm, check_len, &stream)?;
    }
    run(0)?;
    let mut got = vec![0u8; check_len];
    bufs.read_output(comm, &mut got, &stream)?;
    let row = Row {
        coll,
        bytes: case.bytes,
        count: case.n_in,
        dtype,
        op: a.op,
        algo: String::new(),
        mode,
        time_us: median(&mut times),
        cpu_us: median(&mut cpu),
        wrong: None,
        relerr: None,
        operands: bufs.operands(),
    };
    Ok((row, got))
}

#[cfg(any(feature = "nccl", feature = "rccl"))]
fn nccl_direct<D: Device>(
    comm: &Communicator<D>,
    stream: &D::Stream,
    coll: colls::Coll,
    input: Tensor,
    output: Tensor,
    op: ReduceOp,
) -> Result<()> {
    colls::through_ccl(comm, stream, coll, input, output, op)
}

#[cfg(not(any(feature = "nccl", feature = "rccl")))]
fn nccl_direct<D: Device>(
    _: &Communicator<D>,
    _: &D::Stream,
    _: colls::Coll,
    _: Tensor,
    _: Tensor,
    _: ReduceOp,
) -> Result<()> {
    Err(Error::Unsupported("built without NCCL/RCCL".into()))
}

/// Elements whose bytes differ.
fn count_wrong(got: &[u8], want: &[u8], dtype: DType) -> usize {
    got.chunks(dtype.size())
        .zip(want.chunks(dtype.size()))
        .filter(|(g, w)| g != w)
        .count()
}

/// Blocks of 32 elements sampled from an output of `count`: up to 4096,
/// evenly spread, the last (maybe partial) one included.
fn sample_blocks(count: usize) -> Vec<usize> {
    let blocks = count.div_ceil(codec::BLOCK);
    let step = blocks.div_ceil(4096).max(1);
    let mut v: Vec<usize> = (0..blocks).step_by(step).collect();
    if v.last() != Some(&(blocks - 1)) {
        v.push(blocks - 1);
    }
    v
}

/// With Gaussian inputs: (#wrong on the sampled blocks against the
/// algorithm's own reference, or `None` for the vendor library; the relative
/// error against the fp64 sum on the same blocks).
fn check_samples<S: data::FromF64 + Half16>(
    seed: u64,
    world: usize,
    got: &[u8],
    algorithm: Option<Algorithm>,
) -> (Option<usize>, f64) {
    let got: Vec<S> = data::from_bytes(got);
    let count = got.len();
    let (mut wrong, mut num, mut den) = (0usize, 0.0f64, 0.0f64);
    let x = |r: usize, i: usize| S::from_f64(data::input_value(seed, r, i, ReduceOp::Sum, Values::Random));
    for k in sample_blocks(count) {
        let (lo, hi) = (k * codec::BLOCK, ((k + 1) * codec::BLOCK).min(count));
        let want: Vec<S> = match algorithm {
            Some(Algorithm::QuickReduce(c)) => {
                let ins: Vec<Vec<S>> = (0..world).map(|r| (lo..hi).map(|i| x(r, i)).collect()).collect();
                let refs: Vec<&[S]> = ins.iter().map(|v| v.as_slice()).collect();
                codec::reference_all_reduce::<S>(c, &refs)
            }
            _ => data::reference::<S>(seed, world, lo, hi - lo, ReduceOp::Sum, Values::Random),
        };
        wrong += got[lo..hi]
            .iter()
            .zip(&want)
            .filter(|(g, w)| Half16::to_bits(**g) != Half16::to_bits(**w))
            .count();
        for (i, g) in (lo..hi).zip(&got[lo..hi]) {
            let exact: f64 = (0..world).map(|r| x(r, i).to_f64()).sum();
            num += (g.to_f64() - exact).powi(2);
            den += exact.powi(2);
        }
    }
    let relerr = if den > 0.0 { (num / den).sqrt() } else { 0.0 };
    let comparable = algorithm != Some(Algorithm::Vendor);
    (comparable.then_some(wrong), relerr)
}

/// Bench inputs are small integers, so every algorithm's result is exact and
/// `#wrong` is a bitwise count against [`reference_bytes`].
fn input_bytes<T: data::FromF64>(seed: u64, rank: usize, count: usize, op: ReduceOp, values: Values) -> Vec<u8> {
    data::to_bytes(&data::make_input::<T>(seed, rank, 0, count, op, values))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Report the slowest rank's median time and the sum of wrong elements.
fn agree(store: &Arc<dyn Store>, seq: usize, rank: usize, world: usize, row: Row, timeout: Duration) -> Result<Row> {
    let mine = [row.time_us.to_le_bytes(), (row.wrong.unwrap_or(0) as f64).to_le_bytes()].concat();
    let all = store_all_gather(store.as_ref(), &format!("bench/{seq}"), rank, world, &mine, timeout)?;
    let field = |b: &Vec<u8>, i: usize| f64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    Ok(Row {
        time_us: all.iter().map(|b| field(b, 0)).fold(0.0, f64::max),
        wrong: row.wrong.map(|_| all.iter().map(|b| field(b, 1) as usize).sum()),
        ..row
    })
}

/// (algbw, busbw) in GB/s: busbw is nccl-tests' factor of the collective
/// (2(n-1)/n for all-reduce, ...); a memcpy moves its bytes once, so its
/// busbw is its algbw.
fn bandwidths(row: &Row, world: usize) -> (f64, f64) {
    let algbw = row.bytes as f64 / (row.time_us * 1e-6) / 1e9;
    let factor = if row.algo == "memcpy" {
        1.0
    } else {
        row.coll.busbw_factor(world)
    };
    (algbw, algbw * factor)
}

fn print_row(r: &Row, world: usize) {
    let (algbw, busbw) = bandwidths(r, world);
    let wrong = r.wrong.map_or("-".to_string(), |w| w.to_string());
    let relerr = r.relerr.map_or("-".to_string(), |e| format!("{e:.4}"));
    let op = if r.coll.reduces() { r.op.name() } else { "-" };
    println!(
        "{:>14} {:>12} {:>12} {:>6} {:>5} {:>20} {:>8} {:>6} {:>10.2} {:>9.2} {:>9.2} {:>8.2} {:>7} {:>8}",
        r.coll.name(),
        r.bytes,
        r.count,
        r.dtype,
        op,
        r.algo,
        r.operands.name(),
        r.mode,
        r.time_us,
        algbw,
        busbw,
        r.cpu_us,
        wrong,
        relerr
    );
}

/// `FERROCOMM_DIRECT_MIN_BYTES` as the header shows it.
fn direct_min_label<D: Device>(comm: &Communicator<D>) -> String {
    comm.options()
        .direct_min_bytes
        .map_or("default".to_string(), |n| n.to_string())
}

/// With `--operands both`: each heap row beside its plain twin (same
/// collective, size, dtype, algorithm and mode), slowest rank's median us.
fn print_pairs(rows: &[Row]) {
    let heap_rows = rows.iter().filter(|r| r.operands == operands::Operands::Heap);
    println!("# plain vs heap operands (the inbox way vs the direct kinds where they apply)");
    println!(
        "# {:>12} {:>12} {:>6} {:>20} {:>6} {:>10} {:>10} {:>11}",
        "coll", "size", "dtype", "algo", "mode", "plain_us", "heap_us", "plain/heap"
    );
    for h in heap_rows {
        let twin = rows.iter().find(|p| {
            p.operands == operands::Operands::Plain
                && p.coll == h.coll
                && p.bytes == h.bytes
                && p.dtype == h.dtype
                && p.algo == h.algo
                && p.mode == h.mode
        });
        if let Some(p) = twin {
            println!(
                "# {:>12} {:>12} {:>6} {:>20} {:>6} {:>10.2} {:>10.2} {:>11.3}",
                h.coll.name(),
                h.bytes,
                h.dtype,
                h.algo,
                h.mode,
                p.time_us,
                h.time_us,
                p.time_us / h.time_us
            );
        }
    }
}

fn to_json(rows: &[Row], a: &Args, direct_min: Option<usize>) -> String {
    let mut s = format!(
        "{{\"backend\":\"{}\",\"world\":{},\"iters\":{},\"operands\":\"{}\",\"direct_min_bytes\":{},\"rows\":[",
        a.backend,
        a.world,
        a.iters.map_or("\"default\"".to_string(), |i| i.to_string()),
        a.operands.iter().map(|o| o.name()).collect::<Vec<_>>().join(","),
        direct_min.map_or("null".to_string(), |n| n.to_string())
    );
    for (i, r) in rows.iter().enumerate() {
        let (algbw, busbw) = bandwidths(r, a.world);
        let _ = write!(
            s,
            "{}{{\"coll\":\"{}\",\"size\":{},\"count\":{},\"dtype\":\"{}\",\"op\":\"{}\",\"algo\":\"{}\",\"operands\":\"{}\",\"mode\":\"{}\",\"time_us\":{:.3},\"algbw\":{:.3},\"busbw\":{:.3},\"cpu_us\":{:.3},\"wrong\":{},\"relerr\":{}}}",
            if i == 0 { "" } else { "," },
            r.coll.name(),
            r.bytes,
            r.count,
            r.dtype,
            r.op,
            r.algo,
            r.operands.name(),
            r.mode,
            r.time_us,
            algbw,
            busbw,
            r.cpu_us,
            r.wrong.map_or("null".to_string(), |w| w.to_string()),
            r.relerr.map_or("null".to_string(), |e| format!("{e:.6}"))
        );
    }
    s.push_str("]}\n");
    s
}
