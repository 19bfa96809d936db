//! The failures a rank must see as an error, never as a hang or as data:
//! a peer killed (`kill`) or stalled (`stall`) mid-loop, and calls that do
//! not match across ranks (`mismatch`).

use std::time::Instant;

use ferrocomm::device::Device;
use ferrocomm::{Algorithm, Call, Communicator, DType, Error, P2p, ReduceOp, Result, Tensor, Work};

use crate::args::Args;

/// `kill`: the victim kills itself mid-loop; the others must get an error
/// within 2x the timeout.
pub fn kill<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<String> {
    expect_failure(comm, a, |i| {
        if comm.rank() == a.victim && i == 5 {
            // SAFETY: raising SIGKILL on ourselves; nothing runs after it.
            unsafe { libc::raise(libc::SIGKILL) };
        }
    })
}

/// `stall`: the victim sleeps past the timeout; the others must get a
/// timeout naming it.
pub fn stall<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<String> {
    let out = expect_failure(comm, a, |i| {
        if comm.rank() == a.victim && i == 3 {
            std::thread::sleep(a.timeout * 3);
        }
    });
    if comm.rank() == a.victim {
        return Ok("victim woke up".into());
    }
    let msg = out?;
    if !msg.contains(&format!("[{}]", a.victim)) {
        return Err(Error::Aborted(format!("timeout did not name rank {}: {msg}", a.victim)));
    }
    Ok(msg)
}

/// `mismatch`: rank 0 passes a different count (`--coll all_reduce`),
/// different all-to-all splits (`--coll all_to_all`: ranks 0 and 1 must both
/// see the mismatch), or calls all-reduce where the others call an
/// all-gather of the same bytes (`--coll crossed`, or `crossed_copy` with
/// the all-gather on the copy route: a mismatch, well before the timeout);
/// every rank must get an error.
pub fn mismatch<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<String> {
    let buf = comm.alloc(4 * (4096 * comm.size() + 16 * comm.size() + 64))?;
    let start = Instant::now();
    let work = mismatched_call(comm, &a.coll, Tensor::of(&buf, DType::F32))?;
    let error_in_time = |e: Error| Ok(format!("elapsed_ms={} error={e}", start.elapsed().as_millis()));
    match work.wait(None) {
        // All-to-all: the pair that disagrees (ranks 0 and 1) both
        // detect it; the other ranks' blocks agree.
        Ok(()) if a.coll == "all_to_all" && comm.rank() > 1 => Ok("completed: ranks 0 and 1 detect".into()),
        Ok(()) => Err(Error::Aborted("mismatched calls completed silently".into())),
        // Crossed protocols are a mismatch, seen before the deadline.
        Err(e @ Error::Timeout { .. }) if a.coll.starts_with("crossed") => Err(Error::Aborted(format!(
            "a different collective became a timeout, not a mismatch: {e}"
        ))),
        // A peer that saw the mismatch first aborted: this rank's error is
        // the abort, or the timeout, never data.
        Err(e @ (Error::Mismatch { .. } | Error::Timeout { .. } | Error::Aborted(_))) => error_in_time(e),
        Err(e) => Err(e),
    }
}

/// Rank 0's call, unlike the others' (see [`mismatch`]), on `whole`.
fn mismatched_call<D: Device>(comm: &Communicator<D>, coll: &str, whole: Tensor) -> Result<Work<D>> {
    let (rank, world) = (comm.rank(), comm.size());
    match coll {
        "all_to_all" => {
            // Rank 0 sends rank 1 one element more than rank 1 expects.
            let mut sends = vec![16usize; world];
            let recvs = vec![16usize; world];
            if rank == 0 {
                sends[1] = 17;
            }
            let inp = whole.slice(0, sends.iter().sum())?;
            let out = whole.slice(4096 * world, 16 * world)?;
            comm.all_to_all_v_single(out, inp, &recvs, &sends, &Call::new())
        }
        "crossed" | "crossed_copy" => {
            let n = 4096 * world;
            let gather = match coll {
                "crossed_copy" => Call::new().coll_algo(Algorithm::Copy),
                _ => Call::new(),
            };
            if rank == 0 {
                comm.all_reduce(whole.slice(0, n)?, ReduceOp::Sum, &Call::new())
            } else {
                let out = whole.slice(0, n)?;
                comm.all_gather_single(out, out.slice(rank * 4096, 4096)?, &gather)
            }
        }
        _ => {
            let count = if rank == 0 { 1000 } else { 4096 };
            comm.all_reduce(whole.slice(0, count)?, ReduceOp::Sum, &Call::new())
        }
    }
}

/// Run the collective until one fails; succeed iff the failure came within
/// 2x the timeout of the last good iteration.
fn expect_failure<D: Device>(comm: &Communicator<D>, a: &Args, mut before: impl FnMut(usize)) -> Result<String> {
    let n = 1 << 12;
    let buf = comm.alloc(n * 4 * (2 * comm.size() + 1))?;
    let mut last_ok = Instant::now();
    for i in 0..1000 {
        before(i);
        let res = one_call(comm, &a.coll, &buf, n).and_then(|w| w.wait(None));
        let Err(e) = res else {
            last_ok = Instant::now();
            continue;
        };
        let elapsed = last_ok.elapsed();
        if elapsed > a.timeout * 2 {
            return Err(Error::Aborted(format!(
                "error came after {elapsed:?} (> 2x {:?}): {e}",
                a.timeout
            )));
        }
        // The communicator must now refuse work instead of hanging.
        if one_call(comm, &a.coll, &buf, n).is_ok() {
            return Err(Error::Aborted(
                "communicator still accepted work after a fatal error".into(),
            ));
        }
        return Ok(format!(
            "{} iteration={i} elapsed_ms={} error={e}",
            a.coll,
            elapsed.as_millis()
        ));
    }
    Err(Error::Aborted("no error in 1000 iterations".into()))
}

/// One call of the collective `--coll` names, on `buf` (big enough for all);
/// `copy_<collective>` runs it on the copy route.
fn one_call<D: Device>(comm: &Communicator<D>, coll: &str, buf: &D::Buffer, n: usize) -> Result<Work<D>> {
    let world = comm.size();
    let rank = comm.rank();
    let t = Tensor::of(buf, DType::F32);
    let (call, coll) = match coll.strip_prefix("copy_") {
        Some(c) => (Call::new().coll_algo(Algorithm::Copy), c),
        None => (Call::new(), coll),
    };
    match coll {
        "all_gather" => comm.all_gather_single(t.slice(n, n * world)?, t.slice(0, n)?, &call),
        "reduce_scatter" => {
            comm.reduce_scatter_single(t.slice(n * world, n)?, t.slice(0, n * world)?, ReduceOp::Sum, &call)
        }
        "all_to_all" => comm.all_to_all_single(t.slice(n * world, n * world)?, t.slice(0, n * world)?, &call),
        "sendrecv" => comm.batch_p2p(
            &[
                P2p::Send(t.slice(0, n)?, (rank + 1) % world),
                P2p::Recv(t.slice(n, n)?, (rank + world - 1) % world),
            ],
            &call,
        ),
        "broadcast" => comm.broadcast(t.slice(0, n)?, 0, &call),
        "reduce" => comm.reduce(t.slice(0, n)?, ReduceOp::Sum, 0, &call),
        "all_reduce" => comm.all_reduce(t.slice(0, n)?, ReduceOp::Sum, &call),
        other => Err(Error::invalid(format!("unknown --coll {other}"))),
    }
}
