//! Creating a communicator: the topology, the workspace, the library
//! underneath, the two levels of one that spans nodes, the kernels to
//! preload and the autotuned table; and splitting one into sub-groups.
//! Collective: every rank of the group takes the same steps.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};

use super::autotune;
use super::communicator::{lock, Communicator, Inner, Levels, Phase, Resources, State};
use super::options::CommOptions;
use super::registry::Registry;
use super::topology::Topology;
use super::vendor::Vendor;
use crate::algo::kernels::{COLLECTIVES, QUICK_REDUCE};
use crate::algo::{GridTable, KernelNames, Workspace};
use crate::bootstrap::{store_all_gather, store_barrier, Store};
use crate::device::{BackendKind, Device, DeviceBuffer, MemKind, ERR_WORDS, MAX_RANKS};
use crate::error::{Error, Result};
use crate::plan::DispatchTable;

/// What a communicator is built as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// From its topology: one level on one node, two levels across nodes.
    Auto,
    /// One level: a workspace over every rank (one node, or pseudo-nodes
    /// standing in for NCCL on the host backend).
    Flat,
    /// NCCL/RCCL only, no workspace: the inter-node level on GPUs.
    VendorOnly,
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

    /// The two levels of a communicator that spans nodes, or none where a
    /// node has more ranks than the kernels serve (NCCL/RCCL then carries
    /// everything). Collective over the whole communicator: every rank
    /// creates its node's group, then its local rank's group.
    fn levels(&self, topology: &Topology, name: &str, inter_shape: Shape) -> Result<Option<Levels<D>>> {
        if topology.local_size > MAX_RANKS {
            // Too many ranks on one node for the kernels: NCCL/RCCL carries
            // everything.
            return Ok(None);
        }
        let node_ranks: Vec<Vec<usize>> = (0..topology.nodes).map(|m| topology.ranks_on(m)).collect();
        let j = topology.local_rank;
        let column: Vec<usize> = (0..topology.nodes).filter(|&m| node_ranks[m].len() > j).collect();
        let intra = self.create(
            &format!("intra{}", topology.node),
            topology.local_rank,
            topology.local_size,
            format!("{name}.intra{}", topology.node),
            Shape::Flat,
        )?;
        let inter = self.create(
            &format!("inter{j}"),
            column.iter().position(|&m| m == topology.node).unwrap_or(0),
            column.len(),
            format!("{name}.inter{j}"),
            inter_shape,
        )?;
        Ok(Some(Levels::new(intra, inter, topology)))
    }
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
        let on_host = device.facts().backend == BackendKind::Host;
        check_world(on_host, rank, world, &opts)?;
        let started = std::time::Instant::now();
        let topology = Topology::gather(store.as_ref(), &prefix, rank, world, root_rank, &opts, opts.timeout)?;
        let layered = shape == Shape::Auto && (topology.nodes > 1 || world > MAX_RANKS);
        let kernels = has_workspace(shape, layered, on_host, &topology, world)?;
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
        let name = opts.name.clone().unwrap_or_else(|| prefix.replace('/', "-"));
        let sub = SubCommunicators {
            device: &device,
            store: &store,
            prefix: &prefix,
            opts: &opts,
            root_rank,
        };
        let inter = if on_host { Shape::Flat } else { Shape::VendorOnly };
        let levels = if layered {
            sub.levels(&topology, &name, inter)?
        } else {
            None
        };
        let table = DispatchTable::default_for(device.facts().backend);
        let grids = GridTable::new(device.facts())?;
        let has_vendor = vendor.available();
        if crate::log::enabled(tracing::Level::INFO) {
            let workspace = workspace_text(ws.as_ref(), levels.is_some());
            log_ready(
                &name,
                started,
                rank,
                world,
                &topology,
                &device,
                &workspace,
                &vendor.describe(),
            );
        }
        let comm = Communicator {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    phase: Phase::Active,
                    events: Default::default(),
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
            crate::plan::table::encode(&report.table).replace('\n', "; ")
        );
        let mut table = inner.table.write().unwrap_or_else(|e| e.into_inner());
        table.ladders[inner.world.min(MAX_RANKS)] = report.table.clone();
        drop(table);
        *lock(&inner.tuned) = Some(report);
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
}

/// What can be refused before any rendezvous: a rank outside the world, and
/// a host world above [`MAX_RANKS`] without pseudo-nodes (the host backend
/// has no NCCL, so more than 8 ranks need pseudo-nodes of at most 8).
fn check_world(on_host: bool, rank: usize, world: usize, opts: &CommOptions) -> Result<()> {
    if world == 0 || rank >= world {
        return Err(Error::invalid(format!("rank {rank} is not in a world of {world}")));
    }
    if on_host && world > MAX_RANKS && opts.local_size.is_none_or(|k| k > MAX_RANKS) {
        return Err(Error::Unsupported(format!(
            "world {world} on the host backend: its protocols serve up to {MAX_RANKS} ranks a node; set \
             FERROCOMM_LOCAL_SIZE (CommOptions::with_local_size) to at most {MAX_RANKS} for two levels"
        )));
    }
    Ok(())
}

/// Whether a communicator of `shape` has a workspace for ferrocomm's
/// kernels. The host protocols stand in for NCCL between pseudo-nodes of
/// one machine; GPUs never reach another node by IPC.
fn has_workspace(shape: Shape, layered: bool, on_host: bool, topology: &Topology, world: usize) -> Result<bool> {
    match shape {
        Shape::VendorOnly => Ok(false),
        Shape::Auto if layered => Ok(on_host && topology.pseudo && world <= MAX_RANKS),
        Shape::Auto | Shape::Flat => {
            if world > MAX_RANKS {
                return Err(Error::Unsupported(format!(
                    "world {world}: ferrocomm's kernels serve up to {MAX_RANKS} ranks on one node"
                )));
            }
            if topology.nodes > 1 && !topology.pseudo {
                // Workspaces are mapped through this host's IPC; nothing may
                // try to reach another host's memory that way.
                return Err(Error::Unsupported(format!(
                    "this communicator spans {}: ferrocomm's kernels and host protocols reach one host; on GPUs a \
                     communicator spanning nodes uses NCCL/RCCL between them",
                    topology.describe()
                )));
            }
            Ok(true)
        }
    }
}

/// The communicator's init log line.
#[allow(clippy::too_many_arguments)]
fn log_ready<D: Device>(
    name: &str,
    started: std::time::Instant,
    rank: usize,
    world: usize,
    topology: &Topology,
    device: &D,
    workspace: &str,
    library: &str,
) {
    let f = device.facts();
    crate::fc_log!(
        tracing::Level::INFO,
        "communicator {name} ready in {:.2} s: rank {rank} of {world} on {} (local rank {} of {}), backend {} \
         device {} ({}, {}, {} SMs/CUs), workspace {workspace}, library underneath {library}, runtime: {}",
        started.elapsed().as_secs_f64(),
        topology.describe(),
        topology.local_rank,
        topology.local_size,
        f.backend.name(),
        f.ordinal,
        f.name,
        f.arch,
        f.multiprocessors,
        device.runtime_info()
    );
}

/// The workspace line of the ready log: its size, or why there is none.
fn workspace_text<D: Device>(ws: Option<&Workspace<D>>, has_levels: bool) -> String {
    match (ws, has_levels) {
        (Some(ws), _) => format!("{} MiB ({} MiB slots)", ws.own().len() >> 20, ws.slot_bytes() >> 20),
        (None, true) => "none (a node level and a between-nodes level)".into(),
        (None, false) => "none (NCCL/RCCL only)".into(),
    }
}
