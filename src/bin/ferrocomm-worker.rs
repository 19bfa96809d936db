//! One rank of a multi-process test. Launched N times by the process-mode
//! tests (and by `ci/gpu-cuda.sh`) with `RANK`/`WORLD_SIZE` and either
//! `FERROCOMM_STORE_ADDR` (connect to a store the launcher hosts) or the
//! torchrun variables (`MASTER_ADDR`, `MASTER_PORT`, ...).
//!
//! Scenarios:
//! - `conformance`: the conformance suite; exit 0 iff it passed.
//! - `kill`: a collective (`--coll`, default all_reduce) in a loop; the
//!   victim kills itself mid-loop; the others must get an error within 2x
//!   the timeout.
//! - `stall`: the victim sleeps past the timeout; the others must get a
//!   timeout naming it.
//! - `mismatch`: rank 0 passes a different count (`--coll all_reduce`),
//!   different all-to-all splits (`--coll all_to_all`: ranks 0 and 1 must
//!   both see the mismatch), or calls all-reduce where the others call an
//!   all-gather of the same bytes (`--coll crossed`: a mismatch, well
//!   before the timeout); every rank must get an error.
//! - `finalize`: use after finalize, double finalize and abort return errors.
//! - `replay`: capture one all-reduce per algorithm into a graph and replay it
//!   `--replays` times, changing the input before every replay and checking
//!   every output.
//! - `smoke`: one small launch of every kernel family (for compute-sanitizer).
//! - `fused_nvfp4`: the fused NVFP4 cases alone (`ferrocomm::testing::fused_nvfp4`).
//! - `fused_sp`: the sequence-parallel fused cases alone (`ferrocomm::testing::fused_sp`).
//! - `copy_route`: the copy route's cases alone (`ferrocomm::testing::copy_route`).
//! - `overlap`: the chunked all-gather and reduce-scatter alone (`ferrocomm::testing::overlap`).
//! - `heap`: the symmetric heap and window suite (on GPUs also the
//!   user-style all-gather on the device API).
//! - `ep`: the EP dispatch and combine suite (`ferrocomm::testing::ep`).
//! - `fuzz`: the randomized differential fuzz of the public API
//!   (`ferrocomm::testing::fuzz`; `FERROCOMM_FUZZ_TRIALS`, default 300, and
//!   `--max-bytes`, capped at 4 MiB by default).
//! - `coldstart`: the time from process start to a communicator that has run
//!   its first all-reduce (point `FERROCOMM_CACHE_DIR` at an empty directory
//!   to measure a cold kernel cache), printed as `COLD START ...`.
//! - `broadcaster`, `broadcaster-kill`, `broadcaster-stall`: the metadata
//!   broadcaster (`--max-bytes`: its slot size; `--writer`: its writer,
//!   default 0); see `ferrocomm-worker/scenarios/broadcaster.rs`.
//! - `precompile-cuda`: compile the CUDA kernels for `--cc` (default 9.0) into
//!   `FERROCOMM_CACHE_DIR` with no GPU, one kernel per compile on every
//!   core, so a GPU machine skips NVRTC.
//!
//! Each prints one `RESULT ok ...` or `RESULT fail ...` line.
//!
//! The modules, in `ferrocomm-worker/`: `args` (the command line), `job`
//! (the store, rank and GPU), `scenarios` (a function per scenario) and
//! `precompile` (`precompile-cuda`).

#[path = "ferrocomm-worker/args.rs"]
mod args;
#[path = "ferrocomm-worker/job.rs"]
mod job;
#[path = "ferrocomm-worker/precompile.rs"]
mod precompile;
#[path = "ferrocomm-worker/scenarios/mod.rs"]
mod scenarios;

use std::process::ExitCode;
use std::sync::Arc;

use ferrocomm::bootstrap::Store;
use ferrocomm::{Error, Result};

use args::Args;
use scenarios::scenario;

fn main() -> ExitCode {
    match run() {
        Ok(msg) => {
            println!("RESULT ok {msg}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("RESULT fail {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<String> {
    scenarios::mark_start();
    let args = args::parse_args()?;
    if args.scenario == "precompile-cuda" {
        return precompile::precompile_cuda(&args);
    }
    let job = job::connect()?;
    let (store, rank, world, local) = (job.store.clone(), job.rank, job.world, job.local_rank);
    let outcome = run_scenario(&args, store, rank, world, local);
    // Rank 0 hosts the store under an environment rendezvous: it stays
    // until the others are done with it, whatever the scenario gave.
    let left = job.rdv.as_ref().map_or(Ok(()), |r| r.depart());
    let msg = outcome?;
    left.map(|()| msg)
}

/// The scenario on this rank's device of `--backend`.
fn run_scenario(args: &Args, store: Arc<dyn Store>, rank: usize, world: usize, local: usize) -> Result<String> {
    match args.backend.as_str() {
        "host" => scenario(
            ferrocomm::backends::host::HostDevice::new(local)?,
            store,
            rank,
            world,
            args,
        ),
        #[cfg(feature = "cuda")]
        "cuda" => scenario(
            ferrocomm::backends::cuda::CudaDevice::new(ferrocomm::testing::launch::cuda_index(local)?)?,
            store,
            rank,
            world,
            args,
        ),
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err(Error::NotCompiled {
            backend: "cuda",
            feature: "cuda",
        }),
        #[cfg(feature = "rocm")]
        "hip" | "rocm" => scenario(
            ferrocomm::backends::hip::HipDevice::new(local)?,
            store,
            rank,
            world,
            args,
        ),
        #[cfg(not(feature = "rocm"))]
        "hip" | "rocm" => Err(Error::NotCompiled {
            backend: "hip",
            feature: "rocm",
        }),
        other => Err(Error::invalid(format!("unknown backend {other:?}"))),
    }
}
