//! `--broadcaster`: the metadata broadcaster (`Communicator::broadcaster`),
//! rank 0 writing to every other rank, at 64 B, 4 KiB and 1 MiB, through
//! the shared-memory ring (slots of 1 MiB, so every size fits) and through
//! the socket alone (slots of 0 bytes, so every message takes it):
//!
//! - msgs/s: the writer sends a stream of messages back to back; from a
//!   barrier before the first to a barrier after every reader has the
//!   last, on the writer's clock;
//! - latency: one message at a time, each after a barrier, stamped with the
//!   writer's `CLOCK_MONOTONIC` 50 us after it (the readers are waiting in
//!   `recv` by then) and taken off every reader's on arrival (ranks share
//!   the clock on one host); p50 and p99 over every reader's samples.
//!
//! Every message is checked (its length and last byte) on every reader.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrocomm::bootstrap::{store_all_gather, Store};
use ferrocomm::device::Device;
use ferrocomm::{Broadcaster, BroadcasterOptions, Call, Communicator, Error, Result};

use crate::args::Args;

const SIZES: [usize; 3] = [64, 4 << 10, 1 << 20];

/// Slots of the ring rows: the largest size fits one.
const RING_SLOT: usize = 1 << 20;

/// Messages a throughput row sends: about 64 MiB, at least 200, at most 20000.
fn stream_len(bytes: usize) -> usize {
    ((64 << 20) / bytes).clamp(200, 20_000)
}

/// How long the writer waits after each latency barrier before it sends.
const WRITER_DELAY: Duration = Duration::from_micros(50);

/// Latency samples per row.
fn samples(bytes: usize) -> usize {
    if bytes >= 1 << 20 {
        200
    } else {
        2000
    }
}

/// Nanoseconds of `CLOCK_MONOTONIC`, the same clock in every process of a host.
fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec we own; CLOCK_MONOTONIC
    // always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn barrier<D: Device>(comm: &Communicator<D>) -> Result<()> {
    comm.barrier(&Call::new())?.wait(None)
}

/// A reader's check of message `m` of `bytes` bytes.
fn check(got: &[u8], m: usize, bytes: usize) -> Result<()> {
    if got.len() != bytes || got.last().is_some_and(|&b| b != m as u8) {
        return Err(Error::Aborted(format!(
            "broadcaster bench: message #{m} of {bytes} bytes arrived as {} bytes, ending {:?}",
            got.len(),
            got.last()
        )));
    }
    Ok(())
}

/// Message `m`: `bytes` bytes, the send time in the first 8 (when there is
/// room), the message number's low byte last.
fn stamp(msg: &mut [u8], m: usize) {
    if msg.len() >= 8 {
        msg[..8].copy_from_slice(&now_ns().to_le_bytes());
    }
    if let Some(last) = msg.last_mut() {
        *last = m as u8;
    }
}

/// Seconds the writer took to stream `n` messages to every reader.
fn stream<D: Device>(comm: &Communicator<D>, bc: &mut Broadcaster, bytes: usize, n: usize) -> Result<f64> {
    let mut msg = vec![0u8; bytes];
    let mut got = Vec::new();
    barrier(comm)?;
    let start = Instant::now();
    for m in 0..n {
        if bc.is_writer() {
            stamp(&mut msg, m);
            bc.send(&msg, None)?;
        } else {
            bc.recv_into(&mut got, None)?;
            check(&got, m, bytes)?;
        }
    }
    barrier(comm)?;
    Ok(start.elapsed().as_secs_f64())
}

/// This reader's one-way latencies in microseconds (none on the writer).
fn latencies<D: Device>(comm: &Communicator<D>, bc: &mut Broadcaster, bytes: usize, n: usize) -> Result<Vec<f64>> {
    let mut msg = vec![0u8; bytes.max(8)];
    let mut got = Vec::new();
    let mut out = Vec::with_capacity(n);
    for m in 0..n {
        barrier(comm)?;
        if bc.is_writer() {
            // Readers leave the barrier at their own pace: give them time
            // to be waiting in `recv`, as engine workers wait for the
            // driver's next step, so their wake-up is not what is timed.
            let t = Instant::now();
            while t.elapsed() < WRITER_DELAY {
                std::hint::spin_loop();
            }
            stamp(&mut msg, m);
            bc.send(&msg, None)?;
        } else {
            bc.recv_into(&mut got, None)?;
            let arrived = now_ns();
            check(&got, m, msg.len())?;
            let sent = u64::from_le_bytes(got[..8].try_into().unwrap_or_default());
            out.push(arrived.saturating_sub(sent) as f64 / 1e3);
        }
    }
    Ok(out)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n => sorted[((n - 1) as f64 * p).round() as usize],
    }
}

/// One row: the stream and the latency samples of `bytes` through a fresh
/// broadcaster with slots of `slot` bytes; rank 0 prints it.
fn row<D: Device>(comm: &Communicator<D>, store: &Arc<dyn Store>, path: &str, slot: usize, bytes: usize) -> Result<()> {
    let mut bc = comm.broadcaster_with(&BroadcasterOptions::new(slot))?;
    // Warm-up: the pages of the ring and the socket buffers.
    stream(comm, &mut bc, bytes, 20)?;
    let n = stream_len(bytes);
    let secs = stream(comm, &mut bc, bytes, n)?;
    let lat = latencies(comm, &mut bc, bytes, samples(bytes))?;
    let mine: Vec<u8> = lat.iter().flat_map(|v| v.to_le_bytes()).collect();
    let key = format!("bench/broadcaster/{path}/{bytes}");
    let all = store_all_gather(&**store, &key, comm.rank(), comm.size(), &mine, Duration::from_secs(60))?;
    if comm.rank() == 0 {
        let mut lat: Vec<f64> = all
            .iter()
            .flat_map(|v| {
                v.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()))
            })
            .collect();
        lat.sort_by(f64::total_cmp);
        let rate = n as f64 / secs;
        println!(
            "{path:>8} {bytes:>10} {:>8} {rate:>12.0} {:>10.1} {:>10.2} {:>10.2} {:>8}",
            bc.uses_ring(),
            rate * bytes as f64 / 1e6,
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            lat.len()
        );
    }
    Ok(())
}

/// `--broadcaster`: the table above, rank 0 the writer.
pub fn bench_broadcaster<D: Device>(comm: &Communicator<D>, store: &Arc<dyn Store>, _a: &Args) -> Result<()> {
    if comm.size() < 2 {
        return Err(Error::invalid("--broadcaster needs a world of at least 2"));
    }
    if comm.rank() == 0 {
        println!(
            "# broadcaster: rank 0 writes to {} readers, {}; ring rows: slots of {RING_SLOT} bytes, socket rows: \
             slots of 0 bytes",
            comm.size() - 1,
            comm.topology().describe()
        );
        println!(
            "# {:>6} {:>10} {:>8} {:>12} {:>10} {:>10} {:>10} {:>8}",
            "path", "bytes", "ring", "msgs/s", "MB/s", "p50_us", "p99_us", "samples"
        );
    }
    for (path, slot) in [("ring", RING_SLOT), ("socket", 0)] {
        for bytes in SIZES {
            row(comm, store, path, slot, bytes)?;
        }
    }
    Ok(())
}
