//! The communicator: one per group of ranks, generic over the device
//! backend. This file holds what it is (its state, resources, the levels of
//! one that spans nodes) and its end (finalize, abort); creation and
//! splitting are in `create.rs`, the submission path every call takes in
//! `submit.rs`, the collectives in `collectives/`, registration in
//! `register.rs`.
//!
//! # Ordering
//! Every rank must issue the same collectives in the same order. Calls from
//! several threads are serialised by one lock in the order they take it, so
//! threads of one rank that race make that rank's order, and a group whose
//! ranks disagree gets [`Error::Mismatch`] or a timeout naming the ranks,
//! never a deadlock or wrong data. Calls on different streams are ordered
//! too: when a call's stream differs from the previous call's, the new
//! stream first waits for the previous one (an event), because the kernels
//! of one communicator share its workspace and must run one after another.
//! Inside a graph capture that wait cannot be recorded, so a graph must
//! capture all of a communicator's calls on one stream.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard};
use std::time::Duration;

use super::call::Call;
use super::options::CommOptions;
use super::registry::Registry;
use super::topology::Topology;
use super::tuned::TuneReport;
use super::vendor::Vendor;
use crate::algo::{GridTable, KernelNames, Workspace};
use crate::bootstrap::Store;
use crate::device::{
    Device, HostFlags, MemKind, ERR_CODE_ABORTED, ERR_CODE_MISMATCH, ERR_CODE_NONE, ERR_CODE_TIMEOUT, MAX_RANKS,
};
use crate::error::{Error, Result};
use crate::plan::DispatchTable;

pub(crate) enum Phase {
    Active,
    Aborted(String),
    Finalized,
}

/// What finalize releases.
pub(crate) struct Resources<D: Device> {
    /// `None` in a communicator that spans nodes (or has more ranks than the
    /// kernels serve): NCCL/RCCL and its levels carry its calls.
    pub(crate) ws: Option<Workspace<D>>,
    pub(crate) module: D::Module,
    /// Loaded at creation when the caller opted in to quick-reduce, else on
    /// the first quick-reduce call.
    pub(crate) qr_module: Option<D::Module>,
    /// Fused all-reduce epilogues (`comm::fused`), loaded on the first fused call.
    pub(crate) fused_module: Option<D::Module>,
    pub(crate) scratch: D::Buffer,
    pub(crate) vendor: Vendor,
    pub(crate) registry: Registry<D>,
    /// The symmetric heap (`crate::heap`), reserved on first use.
    pub(crate) heap: Option<crate::heap::Heap<D>>,
    /// Modules of heap kernels (windows, EP), by name, loaded on first use.
    pub(crate) heap_modules: Vec<(&'static str, D::Module)>,
    /// Scratch for calls that realign or join their operands (grown on
    /// demand, see `collectives::staging_at`).
    pub(crate) staging: Option<D::Buffer>,
    /// Staging buffers outgrown while calls queued earlier may still use
    /// them: freed when the communicator is (after its calls have run).
    pub(crate) retired: Vec<D::Buffer>,
}

impl<D: Device> Resources<D> {
    /// Load the fused epilogues' module on first need (its kernels still
    /// compile lazily, unless prepared).
    pub(crate) fn load_fused_module(&mut self, device: &D) -> Result<()> {
        if self.fused_module.is_none() {
            self.fused_module = Some(device.load_module(&crate::algo::kernels::FUSED)?);
        }
        Ok(())
    }
}

/// The last stream a collective was queued on (its vendor handle, or the
/// wrapper's address for backends without one).
pub(crate) struct LastStream<D: Device> {
    pub(crate) id: u64,
    pub(crate) event: Arc<D::Event>,
}

pub(crate) struct State<D: Device> {
    pub(crate) phase: Phase,
    pub(crate) res: Option<Resources<D>>,
    pub(crate) last: Option<LastStream<D>>,
    /// Events for calls' `Work`s and cross-stream order, reused.
    pub(crate) events: super::events::EventPool<D>,
}

pub(crate) struct Inner<D: Device> {
    // Declared first so it drops first: queued work is drained in Drop below.
    pub(crate) state: Mutex<State<D>>,
    pub(crate) device: D,
    pub(crate) stream: D::Stream,
    pub(crate) flags: D::Flags,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) opts: CommOptions,
    /// Dispatch thresholds; autotune at init replaces the ladders of this world.
    pub(crate) table: RwLock<DispatchTable>,
    /// What autotune chose at init, if it ran.
    pub(crate) tuned: Mutex<Option<TuneReport>>,
    pub(crate) grids: GridTable,
    pub(crate) names: KernelNames,
    /// Whether the vendor library is loaded (fixed at creation).
    pub(crate) has_vendor: bool,
    pub(crate) name: String,
    pub(crate) prefix: String,
    pub(crate) store: Arc<dyn Store>,
    /// Splits, registrations and other collective setup steps of this
    /// communicator (every rank counts them alike): their store keys.
    pub(crate) serial: AtomicU64,
    /// This rank in the first communicator of its lineage (see `create`).
    pub(crate) root_rank: usize,
    pub(crate) topology: Topology,
    /// Whether this communicator has a workspace for ferrocomm's kernels.
    pub(crate) kernels: bool,
    /// The node level and the between-nodes level of a communicator that
    /// spans nodes (`layered.rs`).
    pub(crate) levels: Option<Levels<D>>,
}

impl<D: Device> Drop for Inner<D> {
    fn drop(&mut self) {
        // Kernels may still reference the workspace (on this stream or a
        // caller's); every wait in them has a deadline, so this returns.
        let last = lock(&self.state).last.take();
        if self.drain(last.as_ref()).is_err() {
            // Work that never stopped may still touch the workspace: leak it
            // rather than free memory in use.
            std::mem::forget(lock(&self.state).res.take());
        }
    }
}

pub(crate) fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<D: Device> Inner<D> {
    /// Wait until every call queued through this communicator has run: its
    /// own stream, and `last`, the last call queued on any stream (a call on
    /// another stream than the one before it waits for that one, so the last
    /// call's event covers every earlier call). Kernels wait at most the
    /// timeout for a peer; a communicator whose kernels failed is aborted so
    /// that queued ones exit at once. An error means work may still run.
    fn drain(&self, last: Option<&LastStream<D>>) -> Result<()> {
        let own = self.device.synchronize(&self.stream);
        let Some(last) = last else { return own };
        let bound = self.opts.timeout.saturating_mul(2) + Duration::from_secs(1);
        let start = std::time::Instant::now();
        loop {
            if self.device.wait_event_for(&last.event, Duration::from_millis(50))? {
                return own;
            }
            if self.device_error().is_some() && self.flags.load(0) != ERR_CODE_ABORTED {
                self.flags.store(0, ERR_CODE_ABORTED);
            }
            if start.elapsed() >= bound {
                return Err(Error::Timeout {
                    what: format!("the calls queued on communicator {} to finish", self.name),
                    after: bound,
                    missing: Vec::new(),
                });
            }
        }
    }

    /// The error kernels reported, if any.
    pub(crate) fn device_error(&self) -> Option<Error> {
        let code = self.flags.load(0);
        let epoch = self.flags.load(3);
        match code {
            ERR_CODE_NONE => None,
            ERR_CODE_TIMEOUT => {
                let mask = self.flags.load(1);
                let what = if epoch == crate::heap::ERR_EPOCH_DEVICE_API {
                    format!("peers in a device-API wait (signal or barrier) on rank {}", self.rank)
                } else {
                    format!("peers in collective launch #{epoch} on rank {}", self.rank)
                };
                Some(Error::Timeout {
                    what,
                    after: self.opts.timeout,
                    missing: (0..MAX_RANKS).filter(|r| mask & (1 << r) != 0).collect(),
                })
            }
            ERR_CODE_MISMATCH => Some(Error::Mismatch {
                rank: self.rank,
                peer: self.flags.load(2).saturating_sub(1) as usize,
                detail: format!(
                    "count, dtype, op, root, splits or algorithm differ at launch #{epoch} of communicator {}",
                    self.name
                ),
            }),
            ERR_CODE_ABORTED => Some(Error::Aborted("the communicator was aborted".into())),
            other => Some(Error::Aborted(format!("kernel reported unknown error code {other}"))),
        }
    }

    /// Mark the communicator unusable, make queued kernels exit at once, and
    /// abort the vendor communicator (its kernels may be waiting on a peer).
    pub(crate) fn abort(&self, reason: &str) {
        if self.flags.load(0) == ERR_CODE_NONE {
            self.flags.store(0, ERR_CODE_ABORTED);
        }
        let mut st = lock(&self.state);
        if matches!(st.phase, Phase::Active) {
            st.phase = Phase::Aborted(reason.to_string());
            crate::fc_log!(tracing::Level::WARN, "communicator {} aborted: {reason}", self.name);
        }
        if let Some(res) = st.res.as_ref() {
            res.vendor.abort();
        }
        drop(st);
        if let Some(levels) = &self.levels {
            levels.abort();
        }
    }

    /// A fresh store key prefix for a collective setup step (split,
    /// registration): the same on every rank that takes the steps in order.
    pub(crate) fn next_key(&self, what: &str) -> String {
        let n = self.serial.fetch_add(1, Ordering::Relaxed);
        format!("{}/{what}{n}", self.prefix)
    }

    /// The timeout of a call.
    pub(crate) fn timeout_of(&self, call: &Call<'_, D>) -> Duration {
        call.timeout.unwrap_or(self.opts.timeout)
    }
}

/// The two levels of a communicator that spans nodes (`layered.rs` runs
/// them).
pub(crate) struct Levels<D: Device> {
    pub(crate) intra: Communicator<D>,
    pub(crate) inter: Communicator<D>,
    /// `grid[m][j]`: the rank (in the whole communicator) of local rank `j`
    /// on node `m`, when every node has the same number of ranks.
    pub(crate) grid: Option<Vec<Vec<usize>>>,
    /// Whether every node has one rank: the between-nodes level is then the
    /// whole communicator and carries each call alone.
    pub(crate) singles: bool,
    /// Staging of the reduce-scatter's partial sums (grown outside captures).
    pub(crate) staging: Mutex<Option<D::Buffer>>,
}

/// A group of ranks that run collectives together.
///
/// Every rank must issue the same collectives in the same order (see the
/// module docs for threads and streams). All methods take `&self`.
pub struct Communicator<D: Device> {
    pub(crate) inner: Arc<Inner<D>>,
}

impl<D: Device> Communicator<D> {
    /// What autotune chose at init (`None` where it did not run).
    pub fn autotune_report(&self) -> Option<TuneReport> {
        lock(&self.inner.tuned).clone()
    }

    /// This rank's index in the communicator, `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// How many ranks the communicator has.
    pub fn size(&self) -> usize {
        self.inner.world
    }

    /// The communicator's name (`CommOptions::name`, or one derived from its
    /// creation order).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device the communicator runs on (for streams, events, copies and
    /// allocations of the caller's own).
    pub fn device(&self) -> &D {
        &self.inner.device
    }

    /// The communicator's own stream, where calls without a stream run.
    pub fn stream(&self) -> &D::Stream {
        &self.inner.stream
    }

    /// The nodes this communicator spans and this rank's place among them.
    pub fn topology(&self) -> &Topology {
        &self.inner.topology
    }

    /// The options the communicator was created with (after the
    /// environment's, for `CommOptions::from_env`).
    pub fn options(&self) -> &CommOptions {
        &self.inner.opts
    }

    /// Whether NCCL/RCCL is loaded underneath this communicator.
    pub fn has_vendor_library(&self) -> bool {
        self.inner.has_vendor
    }

    /// Run `f` on the NCCL/RCCL communicator underneath, if there is one
    /// (for side-by-side measurements of the library itself). Public only
    /// for the bench (another crate), behind `testing` and hidden: the
    /// NCCL/RCCL table is no part of the API.
    #[cfg(all(any(feature = "nccl", feature = "rccl"), feature = "testing"))]
    #[doc(hidden)]
    pub fn with_ccl<R>(&self, f: impl FnOnce(&crate::backends::ccl::CclComm) -> R) -> Result<Option<R>> {
        self.with_resources(|res| res.vendor.ccl().map(f))
    }

    /// Allocate a (zeroed) device buffer that peers can map: zero-copy when
    /// registered ([`Communicator::register`]).
    pub fn alloc(&self, bytes: usize) -> Result<D::Buffer> {
        self.inner.device.alloc(bytes, MemKind::Shareable)
    }

    /// Block until the kernels every later call may need are compiled and
    /// loaded (GPUs compile on first need, in the background; see
    /// [`Device::prepare`]). Call it before capturing a graph to keep a
    /// capture from waiting for a compile.
    pub fn prepare(&self) -> Result<()> {
        let st = self.lock_active()?;
        let res = st.res.as_ref().ok_or(Error::Finalized)?;
        self.inner.device.prepare(&res.module, &[])?;
        if let Some(qr) = &res.qr_module {
            self.inner.device.prepare(qr, &[])?;
        }
        if let Some(fused) = &res.fused_module {
            self.inner.device.prepare(fused, &[])?;
        }
        for (_, m) in &res.heap_modules {
            self.inner.device.prepare(m, &[])?;
        }
        Ok(())
    }

    /// Drain queued work and release the workspace. Later calls return
    /// [`Error::Finalized`]; so does a second `finalize`.
    pub fn finalize(&self) -> Result<()> {
        let mut st = lock(&self.inner.state);
        if matches!(st.phase, Phase::Finalized) {
            return Err(Error::Finalized);
        }
        let last = st.last.take();
        let drained = self.inner.drain(last.as_ref());
        if let Some(levels) = &self.inner.levels {
            levels.finalize();
        }
        match &drained {
            Ok(()) => st.res = None,
            // Calls that never stopped may still use the workspace and the
            // staging buffer: keep them allocated (leaked), never freed
            // under a running call.
            Err(_) => std::mem::forget(st.res.take()),
        }
        st.phase = Phase::Finalized;
        drained
    }

    /// Make the communicator unusable now: queued kernels exit without
    /// waiting, and NCCL/RCCL underneath is aborted (`ncclCommAbort`).
    pub fn abort(&self) -> Result<()> {
        if matches!(lock(&self.inner.state).phase, Phase::Finalized) {
            return Err(Error::Finalized);
        }
        self.inner.abort("aborted by the caller");
        Ok(())
    }

    /// Run `f` on the resources of an active communicator, under its lock.
    pub(crate) fn with_resources<R>(&self, f: impl FnOnce(&mut Resources<D>) -> R) -> Result<R> {
        let mut st = self.lock_active()?;
        let res = st.res.as_mut().ok_or(Error::Finalized)?;
        Ok(f(res))
    }

    pub(crate) fn lock_active(&self) -> Result<MutexGuard<'_, State<D>>> {
        let st = lock(&self.inner.state);
        match &st.phase {
            Phase::Active => Ok(st),
            Phase::Aborted(why) => Err(Error::Aborted(why.clone())),
            Phase::Finalized => Err(Error::Finalized),
        }
    }
}
