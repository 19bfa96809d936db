//! One rank's communicator: the handle behind its lock, settling each call's
//! result (polled when non-blocking), groups, abort, and teardown on drop.
//! Creating one is [`super::init`]; its data calls are [`super::collectives`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ffi::{NcclResult, RawComm, NCCL_IN_PROGRESS, NCCL_SUCCESS};
use super::library::CclLibrary;
use super::lock;
use crate::error::{Error, Result};

struct Handle(RawComm);

// SAFETY: an ncclComm_t may be used from any thread as long as calls on it do
// not overlap; every use goes through the mutex in CclComm.
unsafe impl Send for Handle {}

/// One rank's NCCL/RCCL communicator.
pub struct CclComm {
    pub(super) lib: Arc<CclLibrary>,
    /// `None` after `abort`.
    comm: Mutex<Option<Handle>>,
    rank: usize,
    pub(super) world: usize,
    nonblocking: bool,
    timeout: Duration,
    /// Set once work of this communicator was captured into a CUDA/HIP
    /// graph: the library's destroy then waits for every such graph to be
    /// destroyed first, forever if the caller keeps one (seen on NCCL 2.28),
    /// so the communicator is aborted instead.
    captured: std::sync::atomic::AtomicBool,
}

impl CclComm {
    /// Own the communicator NCCL created at `raw` (null: there is none to
    /// own, as after an init that failed before making one).
    pub(super) fn adopt(
        lib: Arc<CclLibrary>,
        raw: RawComm,
        rank: usize,
        world: usize,
        nonblocking: bool,
        timeout: Duration,
    ) -> CclComm {
        CclComm {
            lib,
            comm: Mutex::new((!raw.is_null()).then_some(Handle(raw))),
            rank,
            world,
            nonblocking,
            timeout,
            captured: Default::default(),
        }
    }

    /// Note that work of this communicator went into a graph capture.
    pub fn note_capture(&self) {
        self.captured.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn rank(&self) -> usize {
        self.rank
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn world(&self) -> usize {
        self.world
    }

    pub fn library(&self) -> &Arc<CclLibrary> {
        &self.lib
    }

    /// Whether the communicator is non-blocking (`FERROCOMM_NCCL_NONBLOCKING=1`).
    #[cfg(any(test, feature = "testing"))]
    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking
    }

    /// Poll `ncclCommGetAsyncError` until `comm` leaves `ncclInProgress`.
    pub(super) fn wait_ready(&self, comm: RawComm, call: &'static str, r: NcclResult, deadline: Instant) -> Result<()> {
        if r == NCCL_SUCCESS {
            return Ok(());
        }
        if r != NCCL_IN_PROGRESS {
            return Err(self.lib.error(call, r, comm));
        }
        let mut spins = 0u32;
        loop {
            let mut state: NcclResult = NCCL_IN_PROGRESS;
            // SAFETY: live communicator, valid out-pointer.
            let q = unsafe { (self.lib.api.comm_get_async_error)(comm, &mut state) };
            if q != NCCL_SUCCESS {
                return Err(self.lib.error("ncclCommGetAsyncError", q, comm));
            }
            match state {
                NCCL_SUCCESS => return Ok(()),
                NCCL_IN_PROGRESS => {}
                other => return Err(self.lib.error(call, other, comm)),
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "{} {call} (rank {} of {})",
                        self.lib.flavor.name(),
                        self.rank,
                        self.world
                    ),
                    after: self.timeout,
                    missing: Vec::new(),
                });
            }
            // A non-blocking communicator answers most enqueues with
            // ncclInProgress for a few microseconds; sleeping here (the timer
            // slack alone is ~50 us) made eager NCCL calls cost ~100 us.
            spins += 1;
            if spins < 100_000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Run one NCCL call on the live communicator and settle its result.
    pub(super) fn call(&self, name: &'static str, f: impl FnOnce(RawComm) -> NcclResult) -> Result<()> {
        self.call_with(name, |comm| Ok(f(comm)))
    }

    /// [`CclComm::call`] for calls that may fail before reaching NCCL.
    /// Blocking communicators return once the call is queued: no polling.
    pub(super) fn call_with(&self, name: &'static str, f: impl FnOnce(RawComm) -> Result<NcclResult>) -> Result<()> {
        let guard = lock(&self.comm);
        let Some(Handle(comm)) = guard.as_ref() else {
            return Err(Error::Aborted(format!(
                "the {} communicator was aborted",
                self.lib.flavor.name()
            )));
        };
        let comm = *comm;
        let r = f(comm)?;
        if !self.nonblocking {
            return match r {
                NCCL_SUCCESS => Ok(()),
                other => Err(self.lib.error(name, other, comm)),
            };
        }
        self.wait_ready(comm, name, r, Instant::now() + self.timeout)
    }

    pub(super) fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.world {
            return Err(Error::invalid(format!(
                "peer {peer} is not in a world of {}",
                self.world
            )));
        }
        Ok(())
    }

    /// Start a group on the calling thread (`ncclGroupStart`).
    #[cfg(any(test, feature = "testing"))]
    pub fn group_start(&self) -> Result<()> {
        // SAFETY: takes no arguments; group state is per thread.
        let r = unsafe { (self.lib.api.group_start)() };
        if r == NCCL_SUCCESS {
            Ok(())
        } else {
            Err(self.lib.error("ncclGroupStart", r, std::ptr::null_mut()))
        }
    }

    /// End the calling thread's group (`ncclGroupEnd`) and wait until this
    /// communicator has accepted it.
    #[cfg(any(test, feature = "testing"))]
    pub fn group_end(&self) -> Result<()> {
        let api = &self.lib.api;
        // SAFETY: takes no arguments; ends this thread's group.
        self.call("ncclGroupEnd", |_| unsafe { (api.group_end)() })
    }

    /// `Ok(())` while the communicator is healthy (or still settling);
    /// the pending asynchronous error otherwise.
    #[cfg(any(test, feature = "testing"))]
    pub fn async_error(&self) -> Result<()> {
        let guard = lock(&self.comm);
        let Some(Handle(comm)) = guard.as_ref() else {
            return Err(Error::Aborted(format!(
                "the {} communicator was aborted",
                self.lib.flavor.name()
            )));
        };
        let mut state: NcclResult = NCCL_SUCCESS;
        // SAFETY: live communicator, valid out-pointer.
        let q = unsafe { (self.lib.api.comm_get_async_error)(*comm, &mut state) };
        if q != NCCL_SUCCESS {
            return Err(self.lib.error("ncclCommGetAsyncError", q, *comm));
        }
        match state {
            NCCL_SUCCESS | NCCL_IN_PROGRESS => Ok(()),
            other => Err(self.lib.error("async error", other, *comm)),
        }
    }

    /// Abort: kernels of this communicator exit, its resources are freed, and
    /// later calls return [`Error::Aborted`] (a second abort too).
    pub fn abort(&self) -> Result<()> {
        let Some(Handle(comm)) = lock(&self.comm).take() else {
            return Err(Error::Aborted(format!(
                "the {} communicator was already aborted",
                self.lib.flavor.name()
            )));
        };
        // SAFETY: live communicator, released exactly once (taken out above).
        let r = unsafe { (self.lib.api.comm_abort)(comm) };
        if r == NCCL_SUCCESS || r == NCCL_IN_PROGRESS {
            Ok(())
        } else {
            Err(self.lib.error("ncclCommAbort", r, std::ptr::null_mut()))
        }
    }

    pub(super) fn abort_quietly(&self) {
        let _ = self.abort();
    }
}

impl Drop for CclComm {
    fn drop(&mut self) {
        let Some(Handle(comm)) = lock(&self.comm).take() else {
            return;
        };
        let api = &self.lib.api;
        let mut state: NcclResult = NCCL_SUCCESS;
        // SAFETY: live communicator, valid out-pointer.
        let q = unsafe { (api.comm_get_async_error)(comm, &mut state) };
        let healthy = q == NCCL_SUCCESS && (state == NCCL_SUCCESS || state == NCCL_IN_PROGRESS);
        let captured = self.captured.load(std::sync::atomic::Ordering::Relaxed);
        let finished = healthy
            && !captured
            && match (self.nonblocking, api.comm_finalize) {
                // Bounded: finalize flushes outstanding work asynchronously.
                (true, Some(finalize)) => {
                    // SAFETY: live communicator.
                    let r = unsafe { finalize(comm) };
                    self.wait_ready(comm, "ncclCommFinalize", r, Instant::now() + self.timeout)
                        .is_ok()
                }
                _ => true,
            };
        // SAFETY: live communicator, released exactly once (taken out above).
        let r = unsafe {
            if finished {
                (api.comm_destroy)(comm)
            } else {
                (api.comm_abort)(comm)
            }
        };
        if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
            // Nobody receives a Result from Drop: the one place this is told.
            crate::fc_log!(
                tracing::Level::ERROR,
                "{} {} failed while dropping a communicator: {}",
                self.lib.flavor.name(),
                if finished { "ncclCommDestroy" } else { "ncclCommAbort" },
                self.lib.result_string(r)
            );
        }
    }
}
