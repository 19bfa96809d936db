//! The communicator: one per group of ranks, generic over the device backend.
//! This file holds its life cycle (create, split, finalize, abort), its
//! resources and the submission path every collective goes through; the
//! collectives themselves are in `collectives.rs`, registration in
//! `registry.rs`.
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

use super::autotune::{self, TuneReport};
use super::call::Call;
use super::layered::{Levels, Shape};
use super::options::CommOptions;
use super::registry::Registry;
use super::tensor::Tensor;
use super::topology::Topology;
use super::vendor::Vendor;
use super::work::Work;
use crate::algo::kernels::{COLLECTIVES, QUICK_REDUCE};
use crate::algo::{GridTable, KernelNames, Workspace};
use crate::bootstrap::{store_all_gather, store_barrier, Store};
use crate::device::{
    BackendKind, Device, DeviceBuffer, DevicePtr, HostFlags, MemKind, ERR_CODE_ABORTED, ERR_CODE_MISMATCH,
    ERR_CODE_NONE, ERR_CODE_TIMEOUT, ERR_WORDS, MAX_RANKS,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::DispatchTable;

enum Phase {
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
struct LastStream<D: Device> {
    id: u64,
    event: Arc<D::Event>,
}

struct State<D: Device> {
    phase: Phase,
    res: Option<Resources<D>>,
    last: Option<LastStream<D>>,
}

pub(crate) struct Inner<D: Device> {
    // Declared first so it drops first: queued work is drained in Drop below.
    state: Mutex<State<D>>,
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
    prefix: String,
    pub(crate) store: Arc<dyn Store>,
    /// Splits, registrations and other collective setup steps of this
    /// communicator (every rank counts them alike): their store keys.
    serial: AtomicU64,
    /// This rank in the first communicator of its lineage (see `create`).
    root_rank: usize,
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

/// What the submission path hands a collective's enqueue step.
pub(crate) struct Submit<'a, D: Device> {
    pub(crate) inner: &'a Inner<D>,
    pub(crate) res: &'a mut Resources<D>,
    pub(crate) stream: &'a D::Stream,
    pub(crate) timeout: Duration,
    pub(crate) capturing: bool,
}

/// What the levels of a communicator that spans nodes are created from.
pub(crate) struct SubCommunicators<'a, D: Device> {
    device: &'a D,
    store: &'a Arc<dyn Store>,
    prefix: &'a str,
    opts: &'a CommOptions,
    root_rank: usize,
}

impl<D: Device> SubCommunicators<'_, D> {
    /// A communicator of `world` ranks under the key `suffix` (the same on
    /// every member), this rank being `rank` of it. Collective over them.
    pub(crate) fn create(
        &self,
        suffix: &str,
        rank: usize,
        world: usize,
        name: String,
        shape: Shape,
    ) -> Result<Communicator<D>> {
        let mut opts = self.opts.clone();
        opts.name = Some(name);
        Communicator::create(
            self.device.duplicate()?,
            self.store.clone(),
            format!("{}/{suffix}", self.prefix),
            rank,
            world,
            opts,
            self.root_rank,
            shape,
        )
    }
}

/// A group of ranks that run collectives together.
///
/// Every rank must issue the same collectives in the same order (see the
/// module docs for threads and streams). All methods take `&self`.
pub struct Communicator<D: Device> {
    pub(crate) inner: Arc<Inner<D>>,
}

impl<D: Device> Communicator<D> {
    /// Create a communicator. Collective: every rank of the group calls it with
    /// the same `world` and a shared `store`.
    pub fn new(device: D, store: Arc<dyn Store>, rank: usize, world: usize, opts: CommOptions) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!("rank {rank} is not in a world of {world}")));
        }
        // Each rank numbers its communicators; creating them in the same order
        // on every rank gives the group a shared key prefix.
        let serial = store.add(&format!("fc/ncomm/{rank}"), 1)?;
        Self::create(
            device,
            store,
            format!("fc/comm{serial}"),
            rank,
            world,
            opts,
            rank,
            Shape::Auto,
        )
    }

    /// Create a communicator whose store keys live under `prefix` (unique to
    /// the group, the same on every member); `root_rank` is this rank in the
    /// communicator the group was split from, first of all (pseudo-nodes
    /// are counted there).
    #[allow(clippy::too_many_arguments)]
    fn create(
        device: D,
        store: Arc<dyn Store>,
        prefix: String,
        rank: usize,
        world: usize,
        opts: CommOptions,
        root_rank: usize,
        shape: Shape,
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!("rank {rank} is not in a world of {world}")));
        }
        let on_host = device.facts().backend == BackendKind::Host;
        if on_host && world > MAX_RANKS && opts.local_size.is_none_or(|k| k > MAX_RANKS) {
            // Known before any rendezvous: the host backend has no NCCL, so
            // more than 8 ranks need pseudo-nodes of at most 8 for two levels.
            return Err(Error::Unsupported(format!(
                "world {world} on the host backend: its protocols serve up to {MAX_RANKS} ranks a node; set \
                 FERROCOMM_LOCAL_SIZE (CommOptions::with_local_size) to at most {MAX_RANKS} for two levels"
            )));
        }
        let started = std::time::Instant::now();
        let topology = Topology::gather(store.as_ref(), &prefix, rank, world, root_rank, &opts, opts.timeout)?;
        let spans = topology.nodes > 1 || world > MAX_RANKS;
        let layered = shape == Shape::Auto && spans;
        let kernels = match shape {
            Shape::VendorOnly => false,
            // The host protocols stand in for NCCL between pseudo-nodes of
            // one machine; GPUs never reach another node by IPC.
            Shape::Auto if layered => on_host && topology.pseudo && world <= MAX_RANKS,
            Shape::Auto | Shape::Flat => {
                if world > MAX_RANKS {
                    return Err(Error::Unsupported(format!(
                        "world {world}: ferrocomm's kernels serve up to {MAX_RANKS} ranks on one node"
                    )));
                }
                if topology.nodes > 1 && !topology.pseudo {
                    // Workspaces are mapped through this host's IPC; nothing
                    // may try to reach another host's memory that way.
                    return Err(Error::Unsupported(format!(
                        "this communicator spans {}: ferrocomm's kernels and host protocols reach one host; on \
                         GPUs a communicator spanning nodes uses NCCL/RCCL between them",
                        topology.describe()
                    )));
                }
                true
            }
        };
        let stream = device.create_stream()?;
        let flags = device.alloc_host_flags(ERR_WORDS)?;
        let module = device.load_module(&COLLECTIVES)?;
        // Opted-in communicators start quick-reduce's compile now, not on
        // the first large call.
        let qr_module = match opts.quantization.codec(device.facts().backend) {
            Some(_) => Some(device.load_module(&QUICK_REDUCE)?),
            None => None,
        };
        let ws = match kernels {
            true => Some(Workspace::create(
                &device,
                &stream,
                store.as_ref(),
                &prefix,
                rank,
                world,
                opts.slot_bytes_for(device.facts().backend),
                opts.timeout,
            )?),
            false => None,
        };
        let scratch = device.alloc(64, MemKind::Plain)?;
        let vendor = Vendor::init(&device, store.as_ref(), &prefix, rank, world, opts.timeout)?;
        if shape == Shape::VendorOnly && world > 1 && !vendor.available() {
            return Err(Error::Unsupported(format!(
                "a communicator between nodes ({}) needs NCCL/RCCL underneath, and it is not loaded (build with the \
                 nccl/rccl feature, install the library, and leave FERROCOMM_CCL unset)",
                topology.describe()
            )));
        }
        store_barrier(store.as_ref(), &format!("{prefix}/ready"), rank, world, opts.timeout)?;
        let levels = match layered {
            true => {
                let sub = SubCommunicators {
                    device: &device,
                    store: &store,
                    prefix: &prefix,
                    opts: &opts,
                    root_rank,
                };
                let inter = if on_host { Shape::Flat } else { Shape::VendorOnly };
                Levels::build(
                    &sub,
                    &topology,
                    &opts.name.clone().unwrap_or_else(|| prefix.replace('/', "-")),
                    inter,
                )?
            }
            false => None,
        };
        let table = DispatchTable::default_for(device.facts().backend);
        let grids = GridTable::new(device.facts())?;
        let has_vendor = vendor.available();
        let name = opts.name.clone().unwrap_or_else(|| prefix.replace('/', "-"));
        if crate::log::enabled(tracing::Level::INFO) {
            let f = device.facts();
            crate::fc_log!(
                tracing::Level::INFO,
                "communicator {name} ready in {:.2} s: rank {rank} of {world} on {} (local rank {} of {}), backend {} \
                 device {} ({}, {}, {} SMs/CUs), workspace {}, library underneath {}, runtime: {}",
                started.elapsed().as_secs_f64(),
                topology.describe(),
                topology.local_rank,
                topology.local_size,
                f.backend.name(),
                f.ordinal,
                f.name,
                f.arch,
                f.multiprocessors,
                match (&ws, &levels) {
                    (Some(ws), _) => format!("{} MiB ({} MiB slots)", ws.own().len() >> 20, ws.slot_bytes() >> 20),
                    (None, Some(_)) => "none (a node level and a between-nodes level)".into(),
                    (None, None) => "none (NCCL/RCCL only)".into(),
                },
                vendor.describe(),
                device.runtime_info()
            );
        }
        let comm = Communicator {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    phase: Phase::Active,
                    res: Some(Resources {
                        ws,
                        module,
                        qr_module,
                        fused_module: None,
                        scratch,
                        vendor,
                        registry: Registry::default(),
                        heap: None,
                        heap_modules: Vec::new(),
                        staging: None,
                        retired: Vec::new(),
                    }),
                    last: None,
                }),
                device,
                stream,
                flags,
                rank,
                world,
                opts,
                table: RwLock::new(table),
                tuned: Mutex::new(None),
                grids,
                names: KernelNames::new(),
                has_vendor,
                name,
                prefix,
                store,
                serial: AtomicU64::new(0),
                root_rank,
                topology,
                kernels,
                levels,
            }),
        };
        comm.preload_kernels(kernels)?;
        comm.autotune_at_init(kernels)?;
        Ok(comm)
    }

    /// Load every kernel now where [`CommOptions::preload_kernels`] says so,
    /// by default where a peer rank is a thread of this process.
    ///
    /// Ranks that share a process share the driver's module-loading lock.
    /// With kernels loaded lazily, one rank's load could wait on a peer's
    /// kernel that spins for this rank's launch: the thread-rank suite
    /// stalled that way on 4x H100 (BENCHMARKS.md, "Known problem: the thread-rank suite stalls": a fused
    /// kernel active on one GPU, the peer's thread and the compile pool
    /// inside the driver's lock), and CUDA's lazy-loading guide warns of it
    /// for kernels that must run concurrently. Loading everything before
    /// the first collective (autotune's included) leaves no load to race
    /// a spinning kernel. Ranks as processes keep the lazy loading. Local:
    /// each rank decides from the option and the topology it gathered.
    fn preload_kernels(&self, kernels: bool) -> Result<()> {
        let inner = &*self.inner;
        if !kernels || inner.world < 2 || inner.device.facts().backend == BackendKind::Host {
            return Ok(());
        }
        // Whether a peer is a thread of this process came with the topology.
        if !inner.opts.preload_kernels.unwrap_or(inner.topology.shares_process()) {
            return Ok(());
        }
        self.with_resources(|res| res.load_fused_module(&inner.device))??;
        self.prepare()
    }

    /// Autotune the dispatch table of this communicator's world
    /// (`autotune.rs`) where it is on and this communicator runs kernels
    /// between ranks. Collective.
    fn autotune_at_init(&self, kernels: bool) -> Result<()> {
        let inner = &*self.inner;
        let backend = inner.device.facts().backend;
        if !kernels || inner.world < 2 || !inner.opts.autotune_for(backend) {
            return Ok(());
        }
        let report = autotune::tune(self)?;
        crate::fc_log!(
            tracing::Level::INFO,
            "communicator {}: dispatch table ({:?}): {}",
            inner.name,
            report.source,
            autotune::encode(&report.table).replace('\n', "; ")
        );
        let mut table = inner.table.write().unwrap_or_else(|e| e.into_inner());
        table.ladders[inner.world.min(MAX_RANKS)] = report.table.clone();
        drop(table);
        *lock(&inner.tuned) = Some(report);
        Ok(())
    }

    /// What autotune chose at init (`None` where it did not run).
    pub fn autotune_report(&self) -> Option<TuneReport> {
        lock(&self.inner.tuned).clone()
    }

    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    pub fn size(&self) -> usize {
        self.inner.world
    }

    /// The communicator's name (`CommOptions::name`, or one derived from its
    /// creation order).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

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

    pub fn options(&self) -> &CommOptions {
        &self.inner.opts
    }

    /// Whether NCCL/RCCL is loaded underneath this communicator.
    pub fn has_vendor_library(&self) -> bool {
        self.inner.has_vendor
    }

    /// Run `f` on the NCCL/RCCL communicator underneath, if there is one
    /// (for side-by-side measurements of the library itself).
    #[cfg(any(feature = "nccl", feature = "rccl"))]
    #[doc(hidden)]
    pub fn with_ccl<R>(&self, f: impl FnOnce(&crate::backends::ccl::CclComm) -> R) -> Result<Option<R>> {
        self.with_resources(|res| res.vendor.ccl().map(f))
    }

    /// Allocate a (zeroed) device buffer that peers can map: zero-copy when
    /// registered ([`Communicator::register`]).
    pub fn alloc(&self, bytes: usize) -> Result<D::Buffer> {
        self.inner.device.alloc(bytes, MemKind::Shareable)
    }

    /// Copy host bytes into `buf` at `offset`: [`Communicator::copy_in`] on
    /// the communicator's stream.
    pub fn write(&self, buf: &D::Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.copy_in(Tensor::view(buf, DType::U8, offset, data.len())?, data, &Call::new())
    }

    /// Copy `buf[offset..]` into `out` once every earlier call has run:
    /// [`Communicator::copy_out`] on the communicator's stream.
    pub fn read(&self, buf: &D::Buffer, offset: usize, out: &mut [u8]) -> Result<()> {
        self.copy_out(out, Tensor::view(buf, DType::U8, offset, out.len())?, &Call::new())
    }

    /// Copy host bytes into `dst` (any memory a collective takes: a buffer,
    /// a view, a raw tensor, heap memory), as big as `src`. Stream-ordered
    /// on every backend, like a collective: queued on `call`'s stream (the
    /// communicator's by default) after every earlier call of this
    /// communicator, and every later call, on any stream, is queued after
    /// it. Returns once `src` may be reused.
    pub fn copy_in(&self, dst: Tensor, src: &[u8], call: &Call<'_, D>) -> Result<()> {
        self.checked_copy("copy_in", &dst, src.len())?;
        self.ordered(call, true, |stream| self.inner.device.upload(dst.ptr(), src, stream))
    }

    /// Copy `src` into host bytes `dst`, as big as it, once every earlier
    /// call of this communicator has run (on any stream) and everything
    /// queued before on `call`'s stream.
    pub fn copy_out(&self, dst: &mut [u8], src: Tensor, call: &Call<'_, D>) -> Result<()> {
        self.checked_copy("copy_out", &src, dst.len())?;
        // The download waits for its stream: nothing of it stays queued.
        self.ordered(call, false, |stream| self.inner.device.download(dst, src.ptr(), stream))
    }

    /// `copy` on `call`'s stream, ordered after this communicator's last
    /// call; with `later_wait`, later calls on other streams wait for it.
    /// Also on an aborted communicator (reading what it left is allowed).
    fn ordered(&self, call: &Call<'_, D>, later_wait: bool, copy: impl FnOnce(&D::Stream) -> Result<()>) -> Result<()> {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        if matches!(st.phase, Phase::Finalized) {
            return Err(Error::Finalized);
        }
        let stream = call.stream.unwrap_or(&inner.stream);
        let id = stream_id::<D>(&inner.device, stream);
        if let Some(last) = st.last.as_ref().filter(|l| l.id != id) {
            inner.device.wait_event(stream, &last.event)?;
        }
        copy(stream)?;
        if later_wait {
            let event = inner.device.create_event()?;
            inner.device.record(&event, stream)?;
            st.last = Some(LastStream {
                id,
                event: Arc::new(event),
            });
        }
        Ok(())
    }

    fn checked_copy(&self, what: &str, t: &Tensor, bytes: usize) -> Result<()> {
        let span = t.bytes()?;
        if span != bytes {
            return Err(Error::invalid(format!(
                "{what}: the tensor holds {span} bytes ({} x {}), the host side {bytes}",
                t.count(),
                t.dtype()
            )));
        }
        if bytes > 0 && t.ptr() == DevicePtr::NULL {
            return Err(Error::invalid(format!("{what}: a null address")));
        }
        if bytes > 0 {
            self.inner.device.check_memory(t.ptr(), bytes)?;
        }
        Ok(())
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

    /// A communicator of the ranks in `ranks` (ranks of this one, in the new
    /// rank order), named `name`. Collective over this communicator: every
    /// rank calls it, each with the list of the group it joins; a rank that
    /// is not in its list gets `None` (as torchcomms' split). The new
    /// communicator uses the same device and store, and NCCL/RCCL underneath
    /// when this one does.
    pub fn split(&self, ranks: &[usize], name: Option<&str>) -> Result<Option<Communicator<D>>> {
        drop(self.lock_active()?);
        let inner = &*self.inner;
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ranks.len() || ranks.iter().any(|&r| r >= inner.world) {
            return Err(Error::invalid(format!(
                "split ranks {ranks:?}: each must be a distinct rank of a world of {}",
                inner.world
            )));
        }
        // Every rank takes part in the agreement, members or not, so the
        // split counts stay in step across the group.
        let key = inner.next_key("split");
        let mine: Vec<u8> = ranks.iter().flat_map(|&r| (r as u32).to_le_bytes()).collect();
        let lists = store_all_gather(
            inner.store.as_ref(),
            &format!("{key}/lists"),
            inner.rank,
            inner.world,
            &mine,
            inner.opts.timeout,
        )?;
        let Some(new_rank) = ranks.iter().position(|&r| r == inner.rank) else {
            return Ok(None);
        };
        for &member in ranks {
            if lists[member] != mine {
                return Err(Error::Mismatch {
                    rank: inner.rank,
                    peer: member,
                    detail: format!("{key}: rank {member} asked for a different group than {ranks:?}"),
                });
            }
        }
        let group: String = ranks.iter().map(|r| format!("-{r}")).collect();
        let mut opts = inner.opts.clone();
        opts.name = Some(name.map_or_else(
            || format!("{}.{}", inner.name, key.rsplit('/').next().unwrap_or("split")),
            str::to_string,
        ));
        let device = inner.device.duplicate()?;
        Self::create(
            device,
            inner.store.clone(),
            format!("{key}/g{group}"),
            new_rank,
            ranks.len(),
            opts,
            inner.root_rank,
            Shape::Auto,
        )
        .map(Some)
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

    fn lock_active(&self) -> Result<MutexGuard<'_, State<D>>> {
        let st = lock(&self.inner.state);
        match &st.phase {
            Phase::Active => Ok(st),
            Phase::Aborted(why) => Err(Error::Aborted(why.clone())),
            Phase::Finalized => Err(Error::Finalized),
        }
    }

    /// The submission path of every collective: under the communicator's
    /// lock (so launch order is call order), on the call's stream, ordered
    /// after the previous call's stream, then a [`Work`] for it.
    pub(crate) fn submit(
        &self,
        call: &Call<'_, D>,
        what: &'static str,
        enqueue: impl FnOnce(&mut Submit<'_, D>) -> Result<()>,
    ) -> Result<Work<D>> {
        let inner = &*self.inner;
        let mut st = self.lock_active()?;
        if !inner.kernels && !inner.has_vendor && inner.world > 1 {
            return Err(Error::Unsupported(format!(
                "{what} on communicator {}: it spans {} with {} ranks, so it has no workspace for ferrocomm's \
                 kernels, and no NCCL/RCCL underneath (all_reduce, all_gather and reduce_scatter run in two levels \
                 when the nodes have equal sizes)",
                inner.name,
                inner.topology.describe(),
                inner.world
            )));
        }
        let stream = call.stream.unwrap_or(&inner.stream);
        let capturing = inner.device.is_capturing(stream)?;
        let id = stream_id::<D>(&inner.device, stream);
        let st = &mut *st;
        if !capturing {
            if let Some(last) = st.last.as_ref().filter(|l| l.id != id) {
                inner.device.wait_event(stream, &last.event)?;
            }
        }
        let res = st.res.as_mut().ok_or(Error::Finalized)?;
        let mut sub = Submit {
            inner,
            res,
            stream,
            timeout: inner.timeout_of(call),
            capturing,
        };
        enqueue(&mut sub)?;
        let work = Work::record(self.inner.clone(), stream, what, call.timeout, capturing)?;
        if let Some(event) = work.event() {
            // The next call on another stream waits for this one.
            st.last = Some(LastStream { id, event });
        }
        Ok(work)
    }
}

/// A stream's identity across wrappers: the vendor handle where there is one.
fn stream_id<D: Device>(dev: &D, stream: &D::Stream) -> u64 {
    dev.raw_stream(stream).unwrap_or(stream as *const D::Stream as u64)
}
