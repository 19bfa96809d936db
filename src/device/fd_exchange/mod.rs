//! Passing file descriptors between the ranks of one job on one host.
//!
//! Shareable device memory is exported as a file descriptor (a memfd for the
//! host backend, a cuMem VMM POSIX fd for CUDA). A descriptor only means
//! something inside the process that holds it, so it cannot travel through the
//! store: it has to go over a Unix socket as `SCM_RIGHTS` ancillary data, and
//! only to peers that prove they belong to the job.
//!
//! How one exchange runs, on every rank at once:
//!
//! 1. Bind a listening socket in Linux's abstract namespace under a random name
//!    (abstract names vanish with the socket, so nothing is left to clean up on
//!    disk) and publish `{name, secret}` at `{key_prefix}/fdx/{rank}` in the
//!    store. The store is token-authenticated, so only job members can read the
//!    secret; presenting it proves membership.
//! 2. An acceptor thread takes connections until every peer has been served.
//!    For each one it checks `SO_PEERCRED` (same effective uid as us), reads the
//!    connector's rank and our secret, and answers with a `u32` count followed
//!    by our descriptors attached as `SCM_RIGHTS`. Anything wrong closes that
//!    connection without using up the slot of the rank it claimed.
//! 3. Meanwhile the calling thread visits every peer's record, connects
//!    (checking the listener's uid too, before handing it the secret), sends
//!    `(rank, secret)` and receives the peer's descriptors.
//!
//! Every wait is bounded by one deadline; on expiry the error names the ranks
//! we did not both receive from and serve. All descriptors are close-on-exec
//! and owned (`OwnedFd`) from the moment they exist, so error paths leak none.
//!
//! Where each part lives: `server` is the acceptor, `client` the connector,
//! `wire` the store record and the hello, `credentials` who may talk to
//! whom, `socket` the system calls that carry descriptors, `deadline` and
//! `random` what they share; this module runs both sides of one exchange and
//! folds their outcomes into one.

mod client;
mod credentials;
mod deadline;
mod random;
mod server;
mod socket;
mod wire;

#[cfg(test)]
mod tests;

pub use socket::MAX_FDS;
// The broadcaster's TCP handshake (`comm::broadcaster`) uses the same
// secrets and their comparison.
pub(crate) use credentials::constant_time_eq;
pub(crate) use random::random_bytes;

use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use client::{collect, Job};
use deadline::{deadline_after, is_timeout};
use server::{serve, Offer};
use wire::{record_key, Record};

use crate::bootstrap::Store;
use crate::error::{Error, Result};

/// Every rank offers the same list of fds to every peer and receives each peer's list.
///
/// Returns `fds[peer]` (an empty `Vec` for our own rank). Blocks until every
/// peer has been served and heard from, or until `timeout`, when it returns
/// [`Error::Timeout`] listing the ranks not yet exchanged with.
///
/// `key_prefix` must be unique to this exchange (records are not versioned),
/// and the peers must run as the same user on the same host (Linux only: the
/// socket lives in the abstract namespace).
pub fn exchange_fds(
    store: &dyn Store,
    key_prefix: &str,
    rank: usize,
    world: usize,
    mine: &[BorrowedFd<'_>],
    timeout: Duration,
) -> Result<Vec<Vec<OwnedFd>>> {
    validate_args(rank, world, mine)?;
    if world == 1 {
        return Ok(vec![Vec::new()]);
    }
    let job = Job {
        store,
        key_prefix,
        rank,
        world,
        timeout,
        deadline: deadline_after(timeout),
    };

    let record = Record::generate()?;
    let listener =
        UnixListener::bind_addr(&record.address()?).map_err(|e| Error::io("binding the fd-exchange socket", e))?;
    // Nonblocking so that an accept after poll() cannot hang if the pending
    // connection went away in between.
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("setting the fd-exchange socket nonblocking", e))?;

    let key = record_key(key_prefix, rank);
    store.set(&key, &record.encode())?;
    let offer = Offer {
        rank,
        world,
        secret: &record.secret,
        fds: mine,
    };
    let outcome = run_both_sides(&job, listener, &offer);
    // Best effort: by now every peer we served has read the record, and the
    // listener it names is closed, so it is of no use to anyone. A failed
    // delete must not turn a successful exchange into an error.
    let _ = store.delete(&key);
    outcome
}

/// Rejects arguments that could not describe a valid exchange.
fn validate_args(rank: usize, world: usize, mine: &[BorrowedFd<'_>]) -> Result<()> {
    if world == 0 || rank >= world {
        return Err(Error::invalid(format!(
            "fd exchange: rank {rank} is not in a world of {world}"
        )));
    }
    // Ranks travel as u32 on the wire.
    if u32::try_from(world).is_err() {
        return Err(Error::invalid(format!(
            "fd exchange: world of {world} ranks is too large"
        )));
    }
    if mine.len() > MAX_FDS {
        return Err(Error::invalid(format!(
            "fd exchange: {} descriptors offered, at most {MAX_FDS} fit in one message",
            mine.len()
        )));
    }
    Ok(())
}

/// Runs the acceptor on a scoped thread and the connector on this one, then
/// folds both outcomes into one. A hard failure on either side stops the other
/// early instead of letting it wait out the deadline.
fn run_both_sides(job: &Job<'_>, listener: UnixListener, offer: &Offer<'_>) -> Result<Vec<Vec<OwnedFd>>> {
    let stop = AtomicBool::new(false);
    let (served, collected) = thread::scope(|scope| -> Result<_> {
        let stop = &stop;
        let deadline = job.deadline;
        let timeout = job.timeout;
        let acceptor = thread::Builder::new()
            .name("ferrocomm-fdx".into())
            .spawn_scoped(scope, move || {
                // The listener moves in and is closed as soon as serving ends,
                // so late or duplicate connectors are refused, not left hanging.
                let served = serve(listener, offer, deadline, timeout, stop);
                if served.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                served
            })
            .map_err(|e| Error::io("starting the fd-exchange acceptor thread", e))?;
        let collected = collect(job, stop);
        if collected.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        let served = acceptor.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        Ok((served, collected))
    })?;
    merge_outcomes(job, served, collected)
}

/// Combines the two sides. `Ok(None)` means "stopped because the other side
/// failed", so it never decides the result by itself.
fn merge_outcomes(
    job: &Job<'_>,
    served: Result<Option<()>>,
    collected: Result<Option<Vec<Vec<OwnedFd>>>>,
) -> Result<Vec<Vec<OwnedFd>>> {
    let (served, collected) = match (served, collected) {
        (Ok(Some(())), Ok(Some(fds))) => return Ok(fds),
        // A real failure explains the outcome better than a timeout does.
        (_, Err(e)) | (Err(e), _) if !is_timeout(&e) => return Err(e),
        other => other,
    };
    let mut what = Vec::new();
    let mut missing = Vec::new();
    for error in [collected.err(), served.err()].into_iter().flatten() {
        if let Error::Timeout {
            what: w, missing: m, ..
        } = error
        {
            what.push(w);
            missing.extend(m);
        }
    }
    if what.is_empty() {
        // Neither side failed, yet one stopped: only a bug gets here.
        return Err(Error::Aborted(format!(
            "fd exchange of rank {} stopped without an error",
            job.rank
        )));
    }
    missing.sort_unstable();
    missing.dedup();
    Err(Error::Timeout {
        what: what.join(" and "),
        after: job.timeout,
        missing,
    })
}
