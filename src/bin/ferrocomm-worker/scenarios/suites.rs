//! The scenarios that run a suite of `ferrocomm::testing` across the
//! processes: `conformance`, `fuzz`, `heap`, `ep`, `smoke`, `fused_nvfp4`, `fused_sp`,
//! `copy_route`, `overlap` and `replay`.

use std::time::{Duration, Instant};

use ferrocomm::bootstrap::Store;
use ferrocomm::device::{BackendKind, Device};
use ferrocomm::testing::conformance::{run_graph_replays, run_smoke, run_suite, SuiteConfig};
use ferrocomm::testing::copy_route::run_copy_route;
use ferrocomm::testing::ep::run_ep_suite;
use ferrocomm::testing::fused_nvfp4::run_fused_nvfp4;
use ferrocomm::testing::fused_sp::run_fused_sp;
use ferrocomm::testing::fuzz::{run_fuzz, FuzzConfig};
use ferrocomm::testing::heap::{run_heap_suite, run_user_allgather};
use ferrocomm::testing::overlap::run_overlap;
use ferrocomm::{Communicator, Error, Result};

use super::suite_result;
use crate::args::Args;

/// The timeout of the long suites: the flag's, at least a minute.
fn long_timeout(a: &Args) -> Duration {
    a.timeout.max(Duration::from_secs(60))
}

fn long_suite(a: &Args) -> SuiteConfig {
    SuiteConfig {
        timeout: long_timeout(a),
        ..SuiteConfig::default()
    }
}

/// `conformance`: the conformance suite, up to `--max-bytes`.
pub fn conformance<D: Device>(comm: &Communicator<D>, store: &dyn Store, a: &Args) -> Result<String> {
    let cfg = SuiteConfig {
        max_bytes: a.max_bytes,
        ..long_suite(a)
    };
    let report = run_suite(comm, store, &cfg)?;
    comm.finalize()?;
    if !report.is_ok() {
        return Err(Error::Aborted(format!(
            "conformance failures on rank {}: {:#?}",
            comm.rank(),
            report.failures
        )));
    }
    Ok(format!(
        "rank={} collectives={} elements={} on {}",
        comm.rank(),
        report.collectives,
        report.elements_checked,
        comm.topology().describe()
    ))
}

/// `fuzz`: the randomized differential fuzz of the public API
/// (`FERROCOMM_FUZZ_TRIALS`, default 300; `--max-bytes`, at most 4 MiB).
pub fn fuzz<D: Device>(comm: &Communicator<D>, store: &dyn Store, a: &Args) -> Result<String> {
    let mut cfg = FuzzConfig::from_env(300, a.max_bytes.min(4 << 20));
    cfg.timeout = long_timeout(a);
    let r = run_fuzz(comm, store, &cfg)?;
    comm.finalize()?;
    let rank = comm.rank();
    if !r.is_clean() || r.trials != cfg.trials {
        return Err(Error::Aborted(format!(
            "fuzz on rank {rank}: {} of {} trials, {} wrong, {} clobbered, {} disagreements, errors {:?}, \
             failures {:#?}",
            r.trials, cfg.trials, r.wrong, r.clobbered, r.disagreements, r.errors, r.failures
        )));
    }
    Ok(format!(
        "rank={rank} fuzz trials={} wrong=0 clobbered=0 disagreements=0 errors=0 refused={} \
         bytes_checked={} calls={:?}",
        r.trials,
        r.refused.len(),
        r.bytes_checked,
        r.calls
    ))
}

/// `heap`: the symmetric heap and windows across processes (fds, separate
/// address spaces), and on GPUs the user-style all-gather too.
pub fn heap<D: Device>(comm: &Communicator<D>, store: &dyn Store, a: &Args) -> Result<String> {
    let cfg = long_suite(a);
    let mut report = run_heap_suite(comm, store, &cfg)?;
    if comm.device().facts().backend != BackendKind::Host {
        let user = run_user_allgather(comm, store, &cfg)?;
        report.collectives += user.collectives;
        report.elements_checked += user.elements_checked;
        report.failures.extend(user.failures);
    }
    comm.finalize()?;
    suite_result(comm.rank(), "heap checks", report)
}

/// `ep`: EP dispatch and combine across processes: tests/ep_cuda.rs's
/// suite, whose ranks there are threads; ci/gpu-cuda.sh runs it under
/// compute-sanitizer (ep_memcheck).
pub fn ep<D: Device>(comm: &Communicator<D>, store: &dyn Store, a: &Args) -> Result<String> {
    let report = run_ep_suite(comm, store, &long_suite(a))?;
    comm.finalize()?;
    suite_result(comm.rank(), "ep checks", report)
}

/// The fused NVFP4 cases alone (`testing::fused_nvfp4`: both layouts,
/// every kind, special rows, validation): a quick check on a GPU.
pub fn fused_nvfp4<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<String> {
    let report = run_fused_nvfp4(comm, &quick_suite(a))?;
    comm.finalize()?;
    suite_result(comm.rank(), "fused NVFP4 checks", report)
}

/// The sequence-parallel fused form alone (`testing::fused_sp`:
/// `reduce_scatter_fused`, every pattern, gathered and shard, both dtypes,
/// NVFP4 in both layouts, special rows, a graph replay, validation), across
/// processes; `FERROCOMM_SLOT_BYTES=131072` runs its calls over several
/// chunks.
pub fn fused_sp<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<String> {
    let report = run_fused_sp(comm, &quick_suite(a))?;
    comm.finalize()?;
    suite_result(comm.rank(), "fused SP checks", report)
}

/// The copy route alone (`testing::copy_route`: every collective it takes,
/// in place and not, every broadcast root, its graph replay), across
/// processes, so ranks may share one GPU; `FERROCOMM_SLOT_BYTES=131072`
/// spreads its blocks over several chunks, as the thread suite does.
pub fn copy_route<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<String> {
    let report = run_copy_route(comm, &quick_suite(a))?;
    comm.finalize()?;
    suite_result(comm.rank(), "copy route checks", report)
}

/// The chunked all-gather and reduce-scatter alone (`testing::overlap`):
/// several calls in a row, consumers on other streams, a graph replay,
/// across processes, so ranks may share one GPU.
pub fn overlap<D: Device>(comm: &Communicator<D>, store: &dyn Store, a: &Args) -> Result<String> {
    let report = run_overlap(comm, store, &quick_suite(a))?;
    comm.finalize()?;
    suite_result(comm.rank(), "overlap checks", report)
}

fn quick_suite(a: &Args) -> SuiteConfig {
    SuiteConfig {
        timeout: a.timeout,
        ..SuiteConfig::default()
    }
}

/// `smoke`: one small launch of every kernel family (for compute-sanitizer).
pub fn smoke<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<String> {
    let cfg = SuiteConfig {
        max_bytes: 1 << 20,
        random_sizes: 0,
        graph_replays: 1,
        timeout: a.timeout,
        ..SuiteConfig::default()
    };
    let report = run_smoke(comm, &cfg)?;
    comm.finalize()?;
    suite_result(comm.rank(), "collectives", report)
}

/// `replay`: graph replays with fresh input each time, every output checked.
pub fn replay<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<String> {
    let cfg = SuiteConfig {
        graph_replays: a.replays,
        timeout: a.timeout,
        ..SuiteConfig::default()
    };
    let start = Instant::now();
    let report = run_graph_replays(comm, &cfg)?;
    comm.finalize()?;
    let msg = suite_result(comm.rank(), "collectives", report)?;
    Ok(format!(
        "{msg} replays_per_algo={} secs={:.1}",
        a.replays,
        start.elapsed().as_secs_f64()
    ))
}
