//! The environment rendezvous behind `ferrocomm.init()`'s communicators, and
//! leaving its store at the end.
//!
//! Rank 0 hosts the store server. A rank still talking to the store when
//! rank 0's process ends finds it closed (the last rank out of a store
//! barrier deletes its keys after the others have gone on), so each rank
//! departs (`EnvRendezvous::depart`) and rank 0 keeps the server until the
//! others have:
//! - a rank other than 0 departs as soon as its last communicator of the
//!   rendezvous (the first, its splits and siblings) is finalized or
//!   aborted: its last store request is behind it;
//! - every rank departs at interpreter exit ([`leave_stores`], registered
//!   with `atexit` by the package) if it has not yet; rank 0 waits there
//!   for the others, for at most the communicator's timeout.
//!
//! The same `atexit` handler then pauses the background kernel compiles
//! ([`pause_compiles`]).
//!
//! Rank 0 does not wait in `finalize`: a finalize that blocked on the other
//! ranks' finalizes would deadlock a program whose rank 0 waits for a
//! message those ranks send after theirs. The registry keeps every
//! rendezvous (and rank 0's server) alive until exit, so dropping the
//! communicators early does not close the store either.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrocomm::bootstrap::{EnvRendezvous, Store};
use pyo3::prelude::*;

use crate::errors::run_interruptible;

/// One `from_env` rendezvous and the communicators made on it.
pub(crate) struct Membership {
    rdv: EnvRendezvous,
    /// Communicators of this rendezvous neither finalized nor aborted.
    live: AtomicUsize,
    /// Rank 0's wait for the others at exit.
    wait: Duration,
}

/// Every rendezvous of this process, kept until exit.
static JOINED: Mutex<Vec<Arc<Membership>>> = Mutex::new(Vec::new());

fn joined() -> std::sync::MutexGuard<'static, Vec<Arc<Membership>>> {
    // A panic while holding it leaves a plain Vec: still usable.
    JOINED.lock().unwrap_or_else(|p| p.into_inner())
}

impl Membership {
    /// Register `rdv`; rank 0 waits for the others at exit for up to `wait`.
    pub(crate) fn join(rdv: EnvRendezvous, wait: Duration) -> Arc<Membership> {
        let m = Arc::new(Membership {
            rdv,
            live: AtomicUsize::new(0),
            wait,
        });
        joined().push(m.clone());
        m
    }

    pub(crate) fn store(&self) -> Arc<dyn Store> {
        self.rdv.store.clone()
    }
}

/// A communicator's place in its rendezvous: counted from creation until
/// [`Member::leave`].
pub(crate) struct Member {
    of: Arc<Membership>,
    counted: AtomicBool,
}

impl Member {
    pub(crate) fn enter(of: &Arc<Membership>) -> Member {
        of.live.fetch_add(1, Ordering::AcqRel);
        Member {
            of: of.clone(),
            counted: AtomicBool::new(true),
        }
    }

    pub(crate) fn membership(&self) -> &Arc<Membership> {
        &self.of
    }

    /// The communicator is finalized or aborted and makes no more store
    /// requests. The last of a rank's (other than 0) departs at once: one
    /// store write, which rank 0's exit waits for.
    pub(crate) fn leave(&self) {
        if !self.counted.swap(false, Ordering::AcqRel) {
            return;
        }
        if self.of.live.fetch_sub(1, Ordering::AcqRel) == 1 && self.of.rdv.rank != 0 {
            // Nothing to report: a rank other than 0 never waits, and a
            // store already gone means rank 0 left first.
            let _ = self.of.rdv.depart();
        }
    }
}

/// Pause the background kernel compiles (at interpreter exit, before C's
/// exit handlers): a compile still running while the vendor libraries'
/// destructors run crashes the process. Waits at most 20 s.
#[pyfunction]
pub(crate) fn pause_compiles(py: Python<'_>) {
    py.detach(ferrocomm::pause_compiles_for_exit);
}

/// Leave every rendezvous' store (at interpreter exit). Rank 0 waits here
/// for the other ranks to depart, for at most the communicator's timeout,
/// then closes the store; Ctrl-C ends the wait. Returns one line for each
/// store whose ranks did not all leave in time.
#[pyfunction]
pub(crate) fn leave_stores(py: Python<'_>) -> PyResult<Vec<String>> {
    let all: Vec<Arc<Membership>> = std::mem::take(&mut *joined());
    let mut late = Vec::new();
    for m in all {
        let rdv = m.clone();
        match run_interruptible(py, move || rdv.rdv.depart_within(rdv.wait)) {
            Ok(()) => {}
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) => return Err(e),
            Err(e) => late.push(e.value(py).to_string()),
        }
    }
    Ok(late)
}
