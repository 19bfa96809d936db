//! The metadata broadcaster's process scenarios (`tests/broadcaster_host.rs`
//! launches them):
//!
//! - `broadcaster`: slots of `--max-bytes`, 4 of them, writer `--writer`:
//!   messages of 0 B, 64 B, 4 KiB, a slot, a slot and one byte, 1 MiB, then
//!   200 more that wrap the ring many times, inline and through the socket;
//!   every reader checks every byte.
//! - `broadcaster-kill`: the victim (the writer or a reader) kills itself
//!   after 5 messages; the writer (or every reader) must get an error naming
//!   it within 2x the timeout.
//! - `broadcaster-stall`: reader `--victim` stops reading after 2 messages;
//!   the writer must get a timeout naming it within 2x the timeout.

use std::time::{Duration, Instant};

use ferrocomm::device::Device;
use ferrocomm::testing::broadcaster::step;
use ferrocomm::{BroadcasterOptions, Communicator, Error, Result};

/// What the scenarios take from the command line.
pub struct Params {
    /// Bytes of a ring slot.
    pub slot: usize,
    pub writer: usize,
    pub victim: usize,
    pub timeout: Duration,
}

/// Whether `scenario` is one of this module's.
pub fn handles(scenario: &str) -> bool {
    matches!(scenario, "broadcaster" | "broadcaster-kill" | "broadcaster-stall")
}

/// Run `scenario` (one that [`handles`] accepts); the line to print.
pub fn run<D: Device>(comm: &Communicator<D>, scenario: &str, p: &Params) -> Result<String> {
    match scenario {
        "broadcaster" => {
            let msg = every_size(comm, p)?;
            comm.finalize()?;
            Ok(msg)
        }
        _ => failure(comm, scenario == "broadcaster-kill", p),
    }
}

/// Every message size the `broadcaster` scenario sends, in order.
fn sizes(slot: usize) -> Vec<usize> {
    let mut sizes = vec![0, 64, 4096, slot, slot + 1, 1 << 20];
    // Wrap the ring of 4 slots many times, inline and through the socket.
    sizes.extend((0..200).map(|i| (i * 997) % (2 * slot + 3)));
    sizes
}

fn every_size<D: Device>(comm: &Communicator<D>, p: &Params) -> Result<String> {
    let opts = BroadcasterOptions::new(p.slot).with_slots(4).with_writer(p.writer);
    let mut bc = comm.broadcaster_with(&opts)?;
    let mut got = Vec::new();
    for (m, &len) in sizes(p.slot).iter().enumerate() {
        step(&mut bc, m, len, &mut got)?;
    }
    Ok(format!(
        "rank={} broadcaster writer={} messages={} ring={} on {}",
        comm.rank(),
        bc.writer(),
        bc.messages(),
        bc.uses_ring(),
        comm.topology().describe()
    ))
}

/// `broadcaster-kill` (`kill`) and `broadcaster-stall`. Ranks that are told
/// of the failure print it; the test checks who was named.
fn failure<D: Device>(comm: &Communicator<D>, kill: bool, p: &Params) -> Result<String> {
    let rank = comm.rank();
    let mut bc = comm.broadcaster_with(&BroadcasterOptions::new(256).with_slots(4))?;
    let mut last_ok = Instant::now();
    let mut got = Vec::new();
    let stop_at = if kill { 5 } else { 2 };
    for m in 0..100_000usize {
        if rank == p.victim && m == stop_at {
            if kill {
                // SAFETY: raising SIGKILL on ourselves; nothing runs after it.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            std::thread::sleep(p.timeout * 3);
            // The writer gave up on us meanwhile: drain what it sent.
            let drained = (0..).take_while(|_| bc.recv_into(&mut got, None).is_ok()).count();
            return Ok(format!("victim woke up and drained {drained} messages"));
        }
        match step(&mut bc, m, 100 + m % 300, &mut got) {
            Ok(()) => last_ok = Instant::now(),
            Err(e @ Error::Aborted(_)) => return Err(e),
            // A reader still waiting while the writer waits for the stalled
            // victim: its own receive times out; it waits on.
            Err(Error::Timeout { .. }) if !bc.is_writer() && !kill => continue,
            Err(e) => {
                let elapsed = last_ok.elapsed();
                if elapsed > p.timeout * 2 {
                    return Err(Error::Aborted(format!(
                        "the error came {elapsed:?} after the last message (> 2x {:?}): {e}",
                        p.timeout
                    )));
                }
                return Ok(format!("message={m} elapsed_ms={} error={e}", elapsed.as_millis()));
            }
        }
    }
    Err(Error::Aborted("no error in 100000 messages".into()))
}
