//! The communicator's own life: how long it takes to become ready from a
//! cold process (`coldstart`), and what it answers once finalized
//! (`finalize`).

use std::sync::OnceLock;
use std::time::Instant;

use ferrocomm::device::Device;
use ferrocomm::{Call, Communicator, DType, Error, ReduceOp, Result, Tensor};

/// When the process started (for `coldstart`).
static STARTED: OnceLock<Instant> = OnceLock::new();

/// The process starts now (the first thing `main` does).
pub fn mark_start() {
    STARTED.get_or_init(Instant::now);
}

/// Seconds since [`mark_start`].
pub fn since_start() -> f64 {
    STARTED.get().map_or(0.0, |t| t.elapsed().as_secs_f64())
}

/// `coldstart`: the time from process start to a communicator that has run
/// its first all-reduce, and to every kernel ready; `device_ready` and
/// `comm_ready` are when the device and the communicator were.
pub fn coldstart<D: Device>(comm: &Communicator<D>, device_ready: f64, comm_ready: f64) -> Result<String> {
    let buf = comm.alloc(1 << 20)?;
    comm.all_reduce(Tensor::of(&buf, DType::BF16), ReduceOp::Sum, &Call::new())?
        .wait(None)?;
    let first = since_start();
    // What the rest of the module costs, compiled in the background.
    comm.prepare()?;
    let all = since_start();
    comm.finalize()?;
    Ok(format!(
        "COLD START rank={}: device {device_ready:.2} s, communicator {comm_ready:.2} s, \
         first all_reduce done {first:.2} s after process start; every kernel ready at {all:.2} s",
        comm.rank()
    ))
}

/// `finalize`: use after finalize, double finalize and abort return errors.
pub fn finalize<D: Device>(comm: &Communicator<D>) -> Result<String> {
    let buf = comm.alloc(64)?;
    let t = Tensor::view(&buf, DType::F32, 0, 16)?;
    comm.all_reduce(t, ReduceOp::Sum, &Call::new())?.wait(None)?;
    comm.finalize()?;
    let after = comm.all_reduce(t, ReduceOp::Sum, &Call::new()).err();
    let twice = comm.finalize().err();
    let abort = comm.abort().err();
    match (after, twice, abort) {
        (Some(Error::Finalized), Some(Error::Finalized), Some(Error::Finalized)) => Ok("finalize errors ok".into()),
        other => Err(Error::Aborted(format!("unexpected results after finalize: {other:?}"))),
    }
}
