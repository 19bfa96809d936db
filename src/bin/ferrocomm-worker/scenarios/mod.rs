//! The scenarios, each a function of its own, on a communicator made for
//! it: the test suites (`suites`), the failures a rank must survive as an
//! error (`faults`), the communicator's own life (`lifecycle`), and the
//! metadata broadcaster (`broadcaster`).

mod broadcaster;
mod faults;
mod lifecycle;
mod suites;

use std::sync::Arc;

use ferrocomm::bootstrap::Store;
use ferrocomm::device::Device;
use ferrocomm::testing::conformance::SuiteReport;
use ferrocomm::{CommOptions, Communicator, Error, Result};

use crate::args::Args;

pub use lifecycle::mark_start;

/// Run `a.scenario` on a communicator over `dev`; its `RESULT` message.
pub fn scenario<D: Device>(dev: D, store: Arc<dyn Store>, rank: usize, world: usize, a: &Args) -> Result<String> {
    let opts = options(a)?;
    let device_ready = lifecycle::since_start();
    let comm = Communicator::new(dev, store.clone(), rank, world, opts)?;
    let comm_ready = lifecycle::since_start();
    let store = store.as_ref();
    match a.scenario.as_str() {
        "coldstart" => lifecycle::coldstart(&comm, device_ready, comm_ready),
        "fuzz" => suites::fuzz(&comm, store, a),
        "conformance" => suites::conformance(&comm, store, a),
        "heap" => suites::heap(&comm, store, a),
        "ep" => suites::ep(&comm, store, a),
        "kill" => faults::kill(&comm, a),
        "stall" => faults::stall(&comm, a),
        "mismatch" => faults::mismatch(&comm, a),
        "finalize" => lifecycle::finalize(&comm),
        "replay" => suites::replay(&comm, a),
        "smoke" => suites::smoke(&comm, a),
        "fused_nvfp4" => suites::fused_nvfp4(&comm, a),
        "fused_sp" => suites::fused_sp(&comm, a),
        "copy_route" => suites::copy_route(&comm, a),
        "overlap" => suites::overlap(&comm, store, a),
        s if broadcaster::handles(s) => broadcaster::run(&comm, s, &broadcaster_params(a)),
        other => Err(Error::invalid(format!("unknown scenario {other:?}"))),
    }
}

/// The broadcaster scenarios' parameters from the flags.
fn broadcaster_params(a: &Args) -> broadcaster::Params {
    broadcaster::Params {
        slot: a.max_bytes,
        writer: a.writer,
        victim: a.victim,
        timeout: a.timeout,
    }
}

/// The communicator's options: the environment's, with the flags' timeout.
fn options(a: &Args) -> Result<CommOptions> {
    let opts = CommOptions::from_env()?.with_timeout(a.timeout);
    if a.scenario == "heap" || a.scenario == "ep" {
        // The heap suite checks the kinds the library picks (by the epochs
        // they take), which an autotune table an earlier bench cached on the
        // machine would override (as in tests/heap_cuda.rs); EP does not
        // use the table (as in tests/ep_cuda.rs).
        return Ok(opts.with_autotune(false));
    }
    Ok(opts)
}

/// The `RESULT` line of a suite (`what`: what it counts): its checks, or
/// every failure.
fn suite_result(rank: usize, what: &str, report: SuiteReport) -> Result<String> {
    if report.is_ok() {
        Ok(format!(
            "rank={rank} {what}={} elements={}",
            report.collectives, report.elements_checked
        ))
    } else {
        Err(Error::Aborted(format!(
            "{what}: failures on rank {rank}: {:#?}",
            report.failures
        )))
    }
}
