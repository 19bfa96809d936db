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
//! `--quantization int4,int6,int8,fp8,fp4` adds a quick-reduce row per codec
//! (f16/bf16 sums) next to the `--algo` rows, feeds Gaussian data instead of
//! small integers, and prints each row's relative error against an fp64 sum
//! (`relerr`, over up to 4096 sampled blocks). Quick-reduce rows are checked
//! bit for bit against `codec::reference_all_reduce`, ferrocomm's other rows
//! against the exact rule, on the same samples; NCCL rows are not bitwise
//! comparable on such data (`#wrong` shows `-`).
//!
//! The modules: `args` (the flags), `timing` (how every row is timed),
//! the `--coll` rows (`sweep`, `measure`, `check`, `table`, over `colls`,
//! `operands` and `plot`), and the other tables: `fused`, `heap`, `ep`,
//! `broadcaster`.

mod args;
mod broadcaster;
mod check;
mod colls;
mod ep;
mod fused;
mod heap;
mod measure;
mod operands;
mod plot;
mod sweep;
mod table;
mod timing;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use ferrocomm::bootstrap::{Store, TcpStore};
use ferrocomm::device::{BackendKind, Device};
use ferrocomm::testing::launch::run_process_ranks_echo;
use ferrocomm::{CommOptions, Communicator, Error, Result};

use args::Args;

fn main() -> ExitCode {
    let result = args::parse_args().and_then(|a| {
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

/// One rank, launched by [`launch`]: join the store, open the backend's device.
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
        "cuda" => {
            let dev = ferrocomm::backends::cuda::CudaDevice::new(ferrocomm::testing::launch::cuda_index(rank)?)?;
            bench(dev, store, rank, a)
        }
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

/// The rank's communicator, and the table the flags ask for.
fn bench<D: Device>(dev: D, store: Arc<dyn Store>, rank: usize, a: &Args) -> Result<()> {
    let opts = options(a, dev.facts().backend)?;
    let comm = Communicator::new(dev, store.clone(), rank, a.world, opts)?;
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
    sweep::bench_colls(&comm, &store, a)
}

/// The communicator's options: the environment's, the flags' timeout, and
/// what the rows need at creation.
fn options(a: &Args, backend: BackendKind) -> Result<CommOptions> {
    let mut opts = CommOptions::from_env()?.with_timeout(a.timeout);
    if let Some(&q) = a.quantization.first() {
        // Compiles quick-reduce at creation, not inside the first capture.
        opts = opts.with_quantization(q);
    }
    if a.ep {
        // The heap holds the sweep's largest EP buffer.
        opts = ep::with_heap(opts, a, backend, a.world)?;
    }
    // The heap holds the heap rows' buffers (`--operands heap|both`).
    operands::with_heap(opts, a, backend, a.world)
}
