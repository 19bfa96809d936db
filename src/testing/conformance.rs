//! The conformance suite: one body of checks that every backend runs, from
//! every rank of a communicator. Instantiate it with [`conformance_tests!`](crate::conformance_tests)
//! or call [`run_suite`] from a worker process.
//!
//! What it checks (the correctness method of ARCHITECTURE.md): fresh inputs
//! from (seed, rank, index); outputs poisoned before each run; every element
//! compared bit for bit with the exact reference rule; float sums also
//! against fp64 with a stated bound; one-shot and two-shot bitwise equal;
//! outputs bitwise equal across ranks; in place and out of place; graph
//! replays with the input changed between replays. On a communicator that
//! spans (pseudo-)nodes the reference follows its two levels and the calls
//! it cannot run must be refused ([`Reference`]).

use std::time::Duration;

use half::{bf16, f16};

use super::data::{self, FromF64, Order, Values};
use crate::algo::kernels::KERNEL_OPS;
use crate::bootstrap::{store_all_gather, Store};
use crate::comm::{Call, CommOptions, Communicator, Tensor};
use crate::device::{Device, DeviceBuffer, MAX_RANKS};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::plan::{Algorithm, Collective};

/// Poison byte: 0x7F7F... is a huge finite number or NaN in every dtype and
/// never a valid result of the inputs used here.
pub(super) const POISON: u8 = 0x7F;

/// What the suite covers.
#[derive(Debug, Clone)]
pub struct SuiteConfig {
    pub seed: u64,
    /// Largest payload of the size sweep.
    pub max_bytes: usize,
    /// Extra random sizes (counts drawn from the seed, same on every rank).
    pub random_sizes: usize,
    /// Graph replays, each with fresh input.
    pub graph_replays: usize,
    /// Wait bound per collective.
    pub timeout: Duration,
    /// Largest world at which the host backend runs the volume cases: the
    /// size sweep's f32 all-reduce payloads of two and three chunks and
    /// `max_bytes`, and the quick-reduce, fused and MoE-finalize cases
    /// above [`VOLUME_ELEMS`] elements a rank. At a
    /// larger world they take the paths that the smaller cases there and
    /// the volume cases at smaller worlds take, at a CPU cost that grows as
    /// the square of the world (every rank computes the whole reference,
    /// and on the host reads every peer's input). GPU backends run them at
    /// every world.
    pub volume_world: usize,
    /// Workspace slot of the quick-reduce-over-chunks test
    /// ([`run_quick_reduce_chunked`]): its cases are 2.5 and 2 chunks, so
    /// their size, and cost, follow it.
    pub chunked_slot_bytes: usize,
}

/// Elements a rank above which a case is a volume case
/// ([`SuiteConfig::volume_world`]): the all-reduce matrix's largest count.
pub const VOLUME_ELEMS: usize = MATRIX_COUNTS[MATRIX_COUNTS.len() - 1];

impl Default for SuiteConfig {
    /// The lean suite, unless `FERROCOMM_TEST_FULL=1` asks for the full
    /// sweep (CI runs both). The lean one has every case of the full one,
    /// at smaller sizes or fewer worlds: payloads up to 24 MiB (one, two
    /// and three chunks), the volume cases at world 2 only on the host,
    /// quick-reduce over chunks of 64 KiB slots, and fewer random sizes
    /// and graph replays. The full sweep adds the 64 MiB payload, the
    /// volume cases at every world, 1 MiB slots for quick-reduce over
    /// chunks, 6 random sizes and 20 replays.
    fn default() -> Self {
        if full_sweep() {
            SuiteConfig {
                seed: 0x5eed,
                max_bytes: 64 << 20,
                random_sizes: 6,
                graph_replays: 20,
                timeout: Duration::from_secs(120),
                volume_world: usize::MAX,
                chunked_slot_bytes: 1 << 20,
            }
        } else {
            SuiteConfig {
                seed: 0x5eed,
                max_bytes: 24 << 20,
                random_sizes: 3,
                graph_replays: 4,
                timeout: Duration::from_secs(120),
                volume_world: 2,
                chunked_slot_bytes: 64 << 10,
            }
        }
    }
}

/// Whether `FERROCOMM_TEST_FULL=1` asks for the full sweep.
pub fn full_sweep() -> bool {
    std::env::var("FERROCOMM_TEST_FULL").as_deref() == Ok("1")
}

/// What one rank saw.
#[derive(Debug, Default)]
pub struct SuiteReport {
    pub collectives: usize,
    pub elements_checked: usize,
    pub failures: Vec<String>,
    /// Parts that could not run on this backend or machine, with the reason.
    pub skipped: Vec<String>,
}

impl SuiteReport {
    pub fn is_ok(&self) -> bool {
        self.failures.is_empty() && self.collectives > 0
    }
}

/// What the suite expects of a communicator, picked from its topology by
/// [`Reference::of`]: the order each reduction combines the ranks in (its
/// bits), and what it refuses.
///
/// One node: every reduction in rank order. Across (pseudo-)nodes
/// (`src/comm/layered.rs`): all-reduce (premul_sum included) in two levels;
/// reduce-scatter in two levels when the nodes have equal sizes; the rest
/// over the whole group in rank order (the host's workspace over every rank,
/// or NCCL/RCCL), and where there is neither (the host backend above 8
/// ranks) everything but all-reduce, all-gather, reduce-scatter (equal
/// nodes) and barrier is refused with [`Error::Unsupported`], which the
/// suite checks. On GPUs across nodes the fused epilogues (no workspace over
/// every rank) and bitwise all-reduce and reduce-scatter (NCCL/RCCL between
/// the nodes has no bitwise ops) are refused too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// All-reduce and premul_sum.
    pub all_reduce: Order,
    /// Reduce-scatter.
    pub reduce_scatter: Order,
    /// Whether all-gather and reduce-scatter run (in two levels, or over
    /// the whole group).
    pub gathers: bool,
    /// Whether only the levels run: broadcast, reduce, all-to-all, gather,
    /// scatter, sends and receives and fused epilogues are refused.
    pub levels_only: bool,
    /// Whether all-reduce and reduce-scatter by bitwise ops are refused:
    /// across nodes on GPUs, where NCCL/RCCL (which has none) carries the
    /// between-nodes level.
    pub bitwise_refused: bool,
    /// Whether the fused epilogues are refused: they need a workspace over
    /// every rank, which only one node has (and the host's stand-in across
    /// pseudo-nodes, up to 8 ranks).
    pub fused_refused: bool,
    /// Whether the communicator spans (pseudo-)nodes: its all-reduce runs
    /// the levels (or, one rank a node, the between-nodes level alone) with
    /// exact sums, whatever algorithm is asked, quick-reduce included.
    pub spans_nodes: bool,
}

impl Reference {
    /// One level over `world` ranks: nothing refused.
    pub fn flat(world: usize) -> Reference {
        Reference {
            all_reduce: Order::Flat(world),
            reduce_scatter: Order::Flat(world),
            gathers: true,
            levels_only: false,
            bitwise_refused: false,
            fused_refused: false,
            spans_nodes: false,
        }
    }

    /// What `comm` computes, from its topology (the rule the communicator
    /// follows when it builds its levels).
    pub fn of<D: Device>(comm: &Communicator<D>) -> Reference {
        let t = comm.topology();
        let world = comm.size();
        let nodes: Vec<Vec<usize>> = (0..t.nodes).map(|m| t.ranks_on(m)).collect();
        if nodes.len() < 2 || nodes.iter().any(|r| r.len() > MAX_RANKS) {
            // One node, or nodes too large for the kernels: no levels.
            return Reference::flat(world);
        }
        let uniform = nodes.iter().all(|r| r.len() == nodes[0].len());
        let singles = nodes.iter().all(|r| r.len() == 1);
        // Nodes of one rank: the between-nodes level is the whole group.
        let levels = |two: bool| match two && !singles {
            true => Order::Levels(nodes.clone()),
            false => Order::Flat(world),
        };
        let host = comm.device().facts().backend == crate::device::BackendKind::Host;
        // A workspace over every rank (the host's stand-in for NCCL between
        // pseudo-nodes), or NCCL/RCCL, carries the rest.
        let workspace_everywhere = host && world <= MAX_RANKS;
        let whole_group = workspace_everywhere || comm.has_vendor_library();
        Reference {
            all_reduce: levels(true),
            reduce_scatter: levels(uniform),
            gathers: uniform || whole_group,
            levels_only: !whole_group,
            bitwise_refused: !host,
            fused_refused: !workspace_everywhere,
            spans_nodes: true,
        }
    }

    /// Whether all-reduce combines in two levels.
    pub fn two_levels(&self) -> bool {
        matches!(self.all_reduce, Order::Levels(_))
    }
}

/// Element counts every dtype and op is checked at: empty, tiny, odd, not a
/// multiple of 16 bytes, and around vector and segment boundaries.
const MATRIX_COUNTS: [usize; 10] = [0, 1, 2, 3, 7, 17, 255, 1000, 4099, 65_541];

/// Byte offsets of views into the suite's buffers: aligned, and misaligned
/// for every element size above one byte.
pub(super) const OFFSETS: [usize; 2] = [0, 3];

pub(super) struct Suite<'a, D: Device> {
    pub(super) comm: &'a Communicator<D>,
    pub(super) cfg: &'a SuiteConfig,
    /// The reference rule and the refusals this communicator's layout gives.
    pub(super) reference: Reference,
    pub(super) report: SuiteReport,
    /// Output hashes (of results every rank must agree on) in case order,
    /// compared across ranks at the end.
    hashes: Vec<u64>,
    /// Buffers reused by every case (views at offsets), grown on demand: a
    /// fresh allocation per case costs more than most cases.
    bufs: Vec<Option<D::Buffer>>,
}

/// Run the whole suite on this rank. Collective: every rank calls it with
/// the same config and store.
pub fn run_suite<D: Device>(comm: &Communicator<D>, store: &dyn Store, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    // FERROCOMM_SUITE_TIMES=1: rank 0 prints how long each part took.
    let timed = comm.rank() == 0 && std::env::var("FERROCOMM_SUITE_TIMES").as_deref() == Ok("1");
    let mut t = std::time::Instant::now();
    let mut lap = |what: &str| {
        if timed {
            eprintln!("suite part {what}: {:.2} s", t.elapsed().as_secs_f64());
            t = std::time::Instant::now();
        }
    };
    s.matrix()?;
    lap("all_reduce matrix");
    s.large()?;
    s.random_sizes()?;
    lap("all_reduce large and random sizes");
    s.premul_sums()?;
    s.broadcasts()?;
    lap("premul_sum and broadcast");
    s.collectives()?;
    lap("other collectives");
    s.graph_replay()?;
    lap("graph replays");
    s.quick_reduce()?;
    lap("quick-reduce");
    if s.reference.fused_refused {
        s.fused_refused()?;
    } else {
        s.fused()?;
    }
    lap("fused epilogues");
    comm.barrier(&Call::new())?.wait(Some(cfg.timeout))?;
    s.report.collectives += 1;
    s.compare_across_ranks(store)?;
    Ok(s.report)
}

/// The collectives beyond all-reduce and broadcast alone (all-gather,
/// reduce-scatter, all-to-all(-v), gather, scatter, reduce, send/receive):
/// the suite runs them with the small-message LL kinds in force, and again
/// with them off (`CommOptions::coll_ll_bytes = Some(0)`), so that the inbox
/// kinds meet small and odd counts and every op too.
pub fn run_collectives<D: Device>(comm: &Communicator<D>, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    s.collectives()?;
    // As the whole suite ends: `finalize` is local, so no rank may release
    // its workspace and NCCL/RCCL communicator while a peer's last call (a
    // send/recv here) may still use them. Without it, on 2x H200 the test
    // after `collectives_without_ll_world_2` hung.
    comm.barrier(&Call::new())?.wait(Some(cfg.timeout))?;
    s.report.collectives += 1;
    Ok(s.report)
}

/// One small launch of every kernel family and dtype (for sanitizers): the
/// all-reduce kinds, broadcast, the data movers, the fused epilogues, graph
/// replay, quick-reduce.
pub fn run_smoke<D: Device>(comm: &Communicator<D>, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    for dtype in DType::REDUCIBLE {
        for op in KERNEL_OPS.into_iter().filter(|&op| dtype.supports(op)) {
            s.all_reduce_case(dtype, op, Values::Exact, 4099, false, 0)?;
        }
    }
    s.broadcasts()?;
    s.data_movers_smoke()?;
    s.fused_smoke()?;
    s.graph_replay()?;
    for codec in crate::algo::kernels::QR_CODECS {
        s.qr_case::<bf16>(codec, 4099, false, true)?;
    }
    Ok(s.report)
}

/// Quick-reduce over several chunks, for a communicator created with small
/// slots and `quantization` set: every codec at 2.5 chunks (in place and
/// not), and dispatch picking quick-reduce for large f16/bf16 sums only (on
/// GPUs; the host never picks it by itself).
pub fn run_quick_reduce_chunked<D: Device>(comm: &Communicator<D>, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    let big = 64 << 20;
    let planned = |dtype| comm.planned_algorithm(Collective::AllReduce, big, dtype, ReduceOp::Sum, None);
    let auto = planned(DType::BF16)?;
    let host = comm.device().facts().backend == crate::device::BackendKind::Host;
    if auto.and_then(Algorithm::codec).is_none() && !host {
        s.fail(format!(
            "the planner picked {auto:?} for a 128 MiB bf16 sum with quantization on"
        ));
    }
    let plain = planned(DType::F32)?;
    if plain.and_then(Algorithm::codec).is_some() {
        s.fail(format!("the planner picked {plain:?} for an f32 sum"));
    }
    let slot = comm.options().slot_bytes_for(comm.device().facts().backend);
    for (k, codec) in crate::algo::kernels::QR_CODECS.into_iter().enumerate() {
        let chunk = crate::algo::chunk_elems(
            crate::algo::kernels::KernelKind::QuickReduce,
            Some(codec),
            slot,
            comm.size(),
            2,
            crate::algo::GridTable::new(comm.device().facts())?.qr_chunk_bytes(),
        );
        s.qr_case::<bf16>(codec, chunk * 5 / 2 + 7, k % 2 == 0, true)?;
        s.qr_case::<f16>(codec, chunk * 2, k % 2 == 1, false)?;
    }
    Ok(s.report)
}

/// Only the graph-replay check, `cfg.graph_replays` times per algorithm.
pub fn run_graph_replays<D: Device>(comm: &Communicator<D>, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    s.graph_replay()?;
    Ok(s.report)
}

impl<'a, D: Device> Suite<'a, D> {
    pub(super) fn new(comm: &'a Communicator<D>, cfg: &'a SuiteConfig) -> Self {
        Suite {
            comm,
            cfg,
            reference: Reference::of(comm),
            report: SuiteReport::default(),
            hashes: Vec::new(),
            bufs: Vec::new(),
        }
    }
}

impl<D: Device> Suite<'_, D> {
    /// Buffer `slot`, at least `bytes` long (grown, never shrunk).
    pub(super) fn buf(&mut self, slot: usize, bytes: usize) -> Result<&D::Buffer> {
        if self.bufs.len() <= slot {
            self.bufs.resize_with(slot + 1, || None);
        }
        let need = bytes.max(64);
        if self.bufs[slot].as_ref().is_none_or(|b| b.len() < need) {
            // Drop the old one first: its memory is reused.
            self.bufs[slot] = None;
            self.bufs[slot] = Some(self.comm.alloc(need.next_power_of_two())?);
        }
        Ok(self.bufs[slot].as_ref().expect("just allocated"))
    }

    pub(super) fn host_backend(&self) -> bool {
        self.comm.device().facts().backend == crate::device::BackendKind::Host
    }

    /// Whether this communicator runs the volume cases
    /// ([`SuiteConfig::volume_world`]).
    pub(super) fn volume(&self) -> bool {
        self.comm.size() <= self.cfg.volume_world || !self.host_backend()
    }

    /// Whether a case of `elems` elements a rank runs here: every case up
    /// to [`VOLUME_ELEMS`], the volume cases where [`Suite::volume`].
    pub(super) fn runs_size(&self, elems: usize) -> bool {
        elems <= VOLUME_ELEMS || self.volume()
    }

    /// Buffer `slot`, if it exists.
    pub(super) fn bufs_at(&self, slot: usize) -> Option<&Option<D::Buffer>> {
        self.bufs.get(slot)
    }

    /// A view of `count` x `dtype` at byte `offset` of buffer `slot`,
    /// poisoned first when `poison`.
    pub(super) fn view(
        &mut self,
        slot: usize,
        offset: usize,
        dtype: DType,
        count: usize,
        poison: bool,
    ) -> Result<Tensor> {
        let bytes = count * dtype.size();
        let comm = self.comm;
        let buf = self.buf(slot, offset + bytes)?;
        if poison && bytes > 0 {
            comm.device().memset(buf, offset, bytes, POISON, comm.stream())?;
        }
        Tensor::view(buf, dtype, offset, count)
    }

    /// Write host bytes at byte `offset` of buffer `slot`.
    pub(super) fn put(&mut self, slot: usize, offset: usize, data: &[u8]) -> Result<()> {
        let comm = self.comm;
        let buf = self.buf(slot, offset + data.len())?;
        comm.write(buf, offset, data)
    }

    /// Read `len` bytes at byte `offset` of buffer `slot` (after the stream).
    pub(super) fn get(&mut self, slot: usize, offset: usize, len: usize) -> Result<Vec<u8>> {
        let comm = self.comm;
        let buf = self.buf(slot, offset + len)?;
        let mut out = vec![0u8; len];
        comm.read(buf, offset, &mut out)?;
        Ok(out)
    }

    fn matrix(&mut self) -> Result<()> {
        for dtype in DType::REDUCIBLE {
            for op in KERNEL_OPS.into_iter().filter(|&op| dtype.supports(op)) {
                let value_kinds: &[Values] = if dtype.is_float() && op != ReduceOp::Prod {
                    &[Values::Exact, Values::Random]
                } else {
                    &[Values::Exact]
                };
                for &values in value_kinds {
                    for (k, count) in MATRIX_COUNTS.into_iter().enumerate() {
                        for in_place in [false, true] {
                            // Every other count also at a misaligned offset.
                            let offset = OFFSETS[(k + in_place as usize) % OFFSETS.len()];
                            self.all_reduce_case(dtype, op, values, count, in_place, offset)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn large(&mut self) -> Result<()> {
        // Odd byte counts: inside one 8 MiB slot (the host's default), two
        // chunks (bf16 in place, f32), three chunks (a parity reused inside
        // one launch), max_bytes. One chunk and two (bf16) at every world;
        // the rest are volume cases.
        let one = (1 << 20) + 6;
        if one <= self.cfg.max_bytes {
            self.all_reduce_case(DType::F32, ReduceOp::Sum, Values::Random, one / 4, false, 0)?;
        }
        self.all_reduce_case(DType::BF16, ReduceOp::Sum, Values::Random, ((9 << 20) + 2) / 2, true, 0)?;
        if self.volume() {
            let sizes = [(9 << 20) + 2, (21 << 20) + 2, self.cfg.max_bytes];
            for bytes in sizes.into_iter().filter(|&b| b <= self.cfg.max_bytes) {
                self.all_reduce_case(DType::F32, ReduceOp::Sum, Values::Random, bytes / 4, false, 0)?;
            }
        }
        Ok(())
    }

    fn random_sizes(&mut self) -> Result<()> {
        for i in 0..self.cfg.random_sizes {
            let r = data::draw(self.cfg.seed, usize::MAX, i);
            let dtype = DType::REDUCIBLE[(r % 4) as usize];
            let count = 1 + ((r >> 8) % (1 << 18)) as usize;
            let op = if dtype.is_float() { ReduceOp::Sum } else { ReduceOp::Max };
            self.all_reduce_case(
                dtype,
                op,
                Values::Random,
                count,
                r & (1 << 40) != 0,
                ((r >> 41) % 5) as usize,
            )?;
        }
        Ok(())
    }

    pub(super) fn all_reduce_case(
        &mut self,
        dtype: DType,
        op: ReduceOp,
        values: Values,
        count: usize,
        in_place: bool,
        offset: usize,
    ) -> Result<()> {
        if self.reference.bitwise_refused && op.is_bitwise() {
            let t = self.view(0, offset, dtype, count, false)?;
            let refused = self.comm.all_reduce(t, op, &Call::new());
            let case = format!("all_reduce {dtype} {op} count={count} rank={}", self.comm.rank());
            return self.refused(&case, refused);
        }
        match dtype {
            DType::F32 => self.all_reduce_typed::<f32>(op, values, count, in_place, offset),
            DType::F16 => self.all_reduce_typed::<f16>(op, values, count, in_place, offset),
            DType::BF16 => self.all_reduce_typed::<bf16>(op, values, count, in_place, offset),
            DType::I32 => self.all_reduce_typed::<i32>(op, values, count, in_place, offset),
            other => Err(Error::invalid(format!("{other} is not reduced"))),
        }
    }

    fn all_reduce_typed<T: FromF64>(
        &mut self,
        op: ReduceOp,
        values: Values,
        count: usize,
        in_place: bool,
        offset: usize,
    ) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let dtype = T::DTYPE;
        let bytes = count * dtype.size();
        let seed = self.cfg.seed ^ data::hash_bytes(format!("{dtype}{op}{values:?}{count}{in_place}").as_bytes());
        let input = data::to_bytes(&data::make_input::<T>(seed, rank, 0, count, op, values));
        let want = data::reference_in::<T>(&self.reference.all_reduce, seed, 0, count, op, values);
        let mut outputs = Vec::new();
        // The LL one-shot moves 4 data bytes in 8, one unit at a time on the
        // host: above a few MiB it only costs time, and its chunking is
        // already crossed at 1 MiB (a chunk is slot / 4 / world bytes).
        let host = self.host_backend();
        let mut algos: Vec<Algorithm> = Algorithm::ALL_REDUCE_KERNELS
            .into_iter()
            .filter(|&a| !(a == Algorithm::OneShotLl && bytes > (4 << 20) && host))
            .collect();
        if self.reference.two_levels() {
            // Across nodes the levels run whatever algorithm is asked: one
            // run a case, the fixed algorithm taking turns across cases.
            let turn = data::hash_bytes(format!("{count}{in_place}{offset}").as_bytes()) as usize;
            algos = vec![algos[turn % algos.len()]];
        }
        for algo in algos {
            let case = format!(
                "all_reduce {dtype} {op} {values:?} count={count} in_place={in_place} offset={offset} {algo} \
                 world={world} rank={rank}"
            );
            let out_slot = if in_place { 0 } else { 1 };
            let out = self.view(out_slot, offset, dtype, count, true)?;
            self.put(0, offset, &input)?;
            let inp = self.view(0, offset, dtype, count, false)?;
            comm.all_reduce_into(inp, out, op, &Call::new().algo(algo))?
                .wait(Some(self.cfg.timeout))
                .map_err(|e| context(e, &case))?;
            let got = self.get(out_slot, offset, bytes)?;
            self.check(&case, &got, &want)?;
            if dtype.is_float() && op == ReduceOp::Sum && values == Values::Random {
                self.check_fp64_bound::<T>(&case, seed, &got, op, values);
            }
            outputs.push(got);
        }
        if outputs.windows(2).any(|w| w[0] != w[1]) {
            self.fail(format!(
                "all_reduce {dtype} {op} count={count}: one-shot and two-shot differ bitwise"
            ));
        }
        Ok(())
    }

    /// Compare with the reference bit for bit; the output is one every rank
    /// must agree on (its hash is compared across ranks at the end).
    pub(super) fn check<T: FromF64>(&mut self, case: &str, got: &[u8], want: &[T]) -> Result<()> {
        self.hashes.push(data::hash_bytes(got));
        self.check_local(case, got, want)
    }

    /// Compare with the reference bit for bit (a result of this rank only).
    pub(super) fn check_local<T: FromF64>(&mut self, case: &str, got: &[u8], want: &[T]) -> Result<()> {
        let got_t: Vec<T> = data::from_bytes(got);
        let wrong = data::count_wrong(&got_t, want);
        self.report.collectives += 1;
        self.report.elements_checked += want.len();
        if wrong > 0 {
            let first = got_t
                .iter()
                .zip(want)
                .position(|(g, w)| g.to_bits_u64() != w.to_bits_u64());
            let detail = first.map(|i| format!("first at {i}: got {:?}, want {:?}", got_t[i], want[i]));
            self.fail(format!(
                "{case}: {wrong} wrong elements; {}",
                detail.unwrap_or_default()
            ));
        }
        Ok(())
    }

    /// Compare raw bytes (data-moving collectives, any dtype).
    pub(super) fn check_bytes(&mut self, case: &str, got: &[u8], want: &[u8], shared: bool) {
        if shared {
            self.hashes.push(data::hash_bytes(got));
        }
        self.report.collectives += 1;
        self.report.elements_checked += want.len();
        if got != want {
            let at = got
                .iter()
                .zip(want)
                .position(|(g, w)| g != w)
                .unwrap_or(got.len().min(want.len()));
            self.fail(format!(
                "{case}: bytes differ first at byte {at} of {} (got {:?}, want {:?})",
                want.len(),
                got.get(at),
                want.get(at)
            ));
        }
    }

    fn check_fp64_bound<T: FromF64>(&mut self, case: &str, seed: u64, got: &[u8], op: ReduceOp, values: Values) {
        let world = self.comm.size();
        let levels = self.reference.two_levels();
        let got: Vec<T> = data::from_bytes(got);
        // The bit-exact check already covers every element; the fp64 bound is
        // about the rule itself, so a few thousand samples suffice.
        let step = (got.len() / 4096).max(1);
        for (i, g) in got.iter().enumerate().step_by(step) {
            let xs = (0..world).map(|r| T::from_f64(data::input_value(seed, r, i, op, values)).to_f64());
            let (exact, abs) = xs.fold((0.0, 0.0), |(s, a), x| (s + x, a + f64::abs(x)));
            let mut bound = data::sum_error_bound(T::DTYPE, world, abs, exact);
            if levels {
                // Each node's partial is rounded to the dtype too.
                bound += data::sum_error_bound(T::DTYPE, 0, 0.0, abs);
            }
            if (g.to_f64() - exact).abs() > bound {
                self.fail(format!(
                    "{case}: element {i} = {g:?} is off the fp64 sum {exact} by more than {bound}"
                ));
                return;
            }
        }
    }

    fn broadcasts(&mut self) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        if self.reference.levels_only {
            let t = self.view(0, 0, DType::F32, 4099, false)?;
            let refused = comm.broadcast_into(t, t, world - 1, &Call::new());
            return self.refused(&format!("broadcast f32 rank={rank}"), refused);
        }
        for root in 0..world {
            for (k, count) in [1usize, 4099, 300_001].into_iter().enumerate() {
                let offset = OFFSETS[(root + k) % OFFSETS.len()];
                let case = format!("broadcast f32 count={count} root={root} offset={offset} rank={rank}");
                let src = data::make_input::<f32>(self.cfg.seed, root, 0, count, ReduceOp::Sum, Values::Random);
                let out = self.view(1, offset, DType::F32, count, true)?;
                if rank == root {
                    self.put(0, offset, &data::to_bytes(&src))?;
                }
                let inp = self.view(0, offset, DType::F32, count, false)?;
                comm.broadcast_into(inp, out, root, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                let got = self.get(1, offset, count * 4)?;
                self.check(&case, &got, &src)?;
            }
        }
        Ok(())
    }

    /// Capture one all-reduce on a fresh stream, then replay it with new input
    /// each time: epochs live in device memory, so replays stay valid.
    fn graph_replay(&mut self) -> Result<()> {
        let comm = self.comm;
        let dev = comm.device();
        let rank = comm.rank();
        let count = 3000;
        let inp = self.view(0, 0, DType::BF16, count, false)?;
        let out = self.view(1, 0, DType::BF16, count, false)?;
        let stream = dev.create_stream()?;
        for algo in Algorithm::ALL_REDUCE_KERNELS {
            dev.begin_capture(&stream)?;
            let captured = comm.all_reduce_into(inp, out, ReduceOp::Sum, &Call::on(&stream).algo(algo));
            let graph = dev.end_capture(&stream)?;
            captured?;
            for replay in 0..self.cfg.graph_replays {
                let case = format!("graph replay {replay} {algo} bf16 sum count={count} rank={rank}");
                let seed = self.cfg.seed ^ ((replay as u64 + 1) * 7919) ^ data::hash_bytes(algo.name().as_bytes());
                let input = data::make_input::<bf16>(seed, rank, 0, count, ReduceOp::Sum, Values::Random);
                let (Some(Some(ib)), Some(Some(ob))) = (self.bufs.first(), self.bufs.get(1)) else {
                    return Err(Error::invalid("graph replay buffers missing"));
                };
                dev.memset(ob, 0, count * 2, POISON, &stream)?;
                dev.copy_from_host(ib, 0, &data::to_bytes(&input), &stream)?;
                dev.launch_graph(&graph, &stream)?;
                let mut got = vec![0u8; count * 2];
                dev.copy_to_host(ob, 0, &mut got, &stream)
                    .map_err(|e| context(e, &case))?;
                let order = &self.reference.all_reduce;
                let want = data::reference_in::<bf16>(order, seed, 0, count, ReduceOp::Sum, Values::Random);
                self.check(&case, &got, &want)?;
            }
        }
        self.graph_replay_collectives(&stream)
    }

    fn compare_across_ranks(&mut self, store: &dyn Store) -> Result<()> {
        let (rank, world) = (self.comm.rank(), self.comm.size());
        let serial = store.add(&format!("fc/nsuite/{rank}"), 1)?;
        let mine: Vec<u8> = self.hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
        let all = store_all_gather(
            store,
            &format!("fc/suite{serial}/hashes"),
            rank,
            world,
            &mine,
            self.cfg.timeout,
        )?;
        for (peer, theirs) in all.iter().enumerate() {
            if theirs != &mine {
                self.fail(format!("rank {rank}: outputs differ bitwise from rank {peer}'s"));
            }
        }
        Ok(())
    }

    pub(super) fn fail(&mut self, msg: String) {
        if self.report.failures.len() < 50 {
            self.report.failures.push(msg);
        }
    }

    /// Record that a part of the suite did not run here, and why.
    pub(super) fn skip(&mut self, msg: String) {
        if !self.report.skipped.contains(&msg) {
            self.report.skipped.push(msg);
        }
    }

    /// A call this communicator must refuse ([`Reference::levels_only`]):
    /// `Error::Unsupported` before anything is queued, a checked case; it
    /// running, or another error, is a failure.
    pub(super) fn refused<W>(&mut self, case: &str, result: Result<W>) -> Result<()> {
        self.report.collectives += 1;
        match result {
            Err(Error::Unsupported(_)) => Ok(()),
            Err(e) => {
                self.fail(format!("{case}: refused with {e}, not as unsupported"));
                Ok(())
            }
            Ok(_) => {
                self.fail(format!(
                    "{case}: ran on a communicator with no workspace over every rank and no NCCL/RCCL"
                ));
                Ok(())
            }
        }
    }

    /// A fused all-reduce on a communicator across nodes: refused (the fused
    /// kernels need a workspace over every rank).
    fn fused_refused(&mut self) -> Result<()> {
        let (tokens, hidden) = (3, 64);
        let dtype = DType::BF16;
        let input = self.view(0, 0, dtype, tokens * hidden, false)?;
        let residual = self.view(1, 0, dtype, tokens * hidden, false)?;
        let fusion = crate::comm::Fusion::new(crate::comm::FusionPattern::ResidualAdd, hidden, residual, residual);
        let refused = self.comm.all_reduce_fused(input, &fusion, &Call::new());
        let case = format!("all_reduce_fused residual-add rank={}", self.comm.rank());
        self.refused(&case, refused)
    }
}

pub(super) fn context(e: Error, case: &str) -> Error {
    match e {
        Error::Timeout { what, after, missing } => Error::Timeout {
            what: format!("{what} ({case})"),
            after,
            missing,
        },
        other => other,
    }
}

/// Run `suite` on `world` thread ranks sharing an in-process store, each
/// with a communicator made by `make(rank)` and `opts` applied to the
/// defaults, and assert every rank passed with at least `min_collectives`.
/// `skip` (a reason) skips with a message, or fails when
/// `FERROCOMM_REQUIRE_GPU=1`. The body of [`conformance_tests!`](crate::conformance_tests).
#[allow(clippy::too_many_arguments)]
pub fn run_thread_suite<D: Device>(
    backend: &str,
    world: usize,
    skip: Option<String>,
    make: &(dyn Fn(usize) -> Result<D> + Sync),
    opts: impl Fn(CommOptions) -> CommOptions + Sync,
    suite: impl Fn(&Communicator<D>, &dyn Store, &SuiteConfig) -> Result<SuiteReport> + Sync,
    cfg: &SuiteConfig,
    min_collectives: usize,
) {
    if let Some(reason) = skip {
        if std::env::var("FERROCOMM_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("FERROCOMM_REQUIRE_GPU=1 but {backend} cannot run: {reason}");
        }
        eprintln!("SKIPPED {backend} world {world}: {reason}");
        return;
    }
    let results = super::harness::run_thread_ranks(world, |rank, world, store| {
        let dev = make(rank)?;
        let comm = Communicator::new(
            dev,
            store.clone(),
            rank,
            world,
            opts(CommOptions::default().with_timeout(cfg.timeout)),
        )?;
        let report = suite(&comm, store.as_ref(), cfg)?;
        comm.finalize()?;
        Ok(report)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let report = r.unwrap_or_else(|e| panic!("rank {rank} failed: {e}"));
        assert!(report.is_ok(), "rank {rank}: {:#?}", report.failures);
        assert!(
            report.collectives >= min_collectives,
            "rank {rank} ran only {} collectives",
            report.collectives
        );
    }
}

/// Instantiate the conformance tests for a backend: thread ranks at worlds
/// 2, 3, 4 and 8 sharing an in-process store. `$make` builds the device for a
/// rank: `|rank| -> Result<D>`; `$skip` returns `Some(reason)` to skip with
/// a printed reason (and fails instead when `FERROCOMM_REQUIRE_GPU=1`).
/// A trailing `ignore = "why"` marks the tests ignored (GPU backends: the
/// harness then says so, and GPU scripts run them with `--include-ignored`).
#[macro_export]
macro_rules! conformance_tests {
    ($backend:ident, $make:expr, $skip:expr, $cfg:expr) => {
        $crate::conformance_tests!(@tests $backend, $make, $skip, $cfg,);
    };
    ($backend:ident, $make:expr, $skip:expr, $cfg:expr, ignore = $why:literal) => {
        $crate::conformance_tests!(@tests $backend, $make, $skip, $cfg, #[ignore = $why]);
    };
    // One part of the suite on threads: `run_thread_suite` with the
    // backend's device, skip rule and config, at `world`, with `opts`
    // applied to the communicator options.
    (@part $backend:ident, $make:expr, $skip:expr, $cfg:expr, $world:expr, $opts:expr, $suite:expr, $min:expr) => {{
        let cfg: $crate::testing::conformance::SuiteConfig = $cfg;
        $crate::testing::conformance::run_thread_suite(
            stringify!($backend),
            $world,
            $skip($world),
            &$make,
            $opts,
            $suite,
            &cfg,
            $min,
        );
    }};
    (@tests $backend:ident, $make:expr, $skip:expr, $cfg:expr, $(#[$attr:meta])*) => {
        mod $backend {
            #[allow(unused_imports)]
            use super::*;

            fn run(world: usize) {
                $crate::conformance_tests!(
                    @part $backend, $make, $skip, $cfg,
                    world,
                    |o| o,
                    |comm, store, cfg| $crate::testing::conformance::run_suite(comm, store, cfg),
                    100
                );
            }

            /// Quick-reduce over several chunks (slots of
            /// `cfg.chunked_slot_bytes`), opted in.
            fn run_chunked(world: usize) {
                let cfg: $crate::testing::conformance::SuiteConfig = $cfg;
                let slot = cfg.chunked_slot_bytes;
                $crate::testing::conformance::run_thread_suite(
                    stringify!($backend),
                    world,
                    $skip(world),
                    &$make,
                    |o| o.with_slot_bytes(slot).with_quantization($crate::codec::Quantization::Int4),
                    |comm, _, cfg| $crate::testing::conformance::run_quick_reduce_chunked(comm, cfg),
                    &cfg,
                    1,
                );
            }

            #[test]
            $(#[$attr])*
            fn quick_reduce_chunked_world_2() {
                run_chunked(2)
            }
            #[test]
            $(#[$attr])*
            fn quick_reduce_chunked_world_4() {
                run_chunked(4)
            }

            /// Fused epilogues over several workspace chunks (128 KiB slots).
            fn run_fused_chunked(world: usize) {
                $crate::conformance_tests!(
                    @part $backend, $make, $skip, $cfg,
                    world,
                    |o| o.with_slot_bytes(128 << 10),
                    |comm, _, cfg| $crate::testing::fused::run_fused_chunked(comm, cfg),
                    1
                );
            }

            #[test]
            $(#[$attr])*
            fn fused_chunked_world_2() {
                run_fused_chunked(2)
            }
            #[test]
            $(#[$attr])*
            fn fused_chunked_world_3() {
                run_fused_chunked(3)
            }

            /// The copy route over several chunks of its inboxes (128 KiB
            /// slots), and captured into a graph.
            fn run_copy_route(world: usize) {
                $crate::conformance_tests!(
                    @part $backend, $make, $skip, $cfg,
                    world,
                    |o| o.with_slot_bytes(128 << 10),
                    |comm, _, cfg| $crate::testing::copy_route::run_copy_route(comm, cfg),
                    1
                );
            }

            #[test]
            $(#[$attr])*
            fn copy_route_world_2() {
                run_copy_route(2)
            }
            #[test]
            $(#[$attr])*
            fn copy_route_world_3() {
                run_copy_route(3)
            }

            /// The chunked all-gather and reduce-scatter (`comm::overlap`).
            fn run_overlap(world: usize) {
                $crate::conformance_tests!(
                    @part $backend, $make, $skip, $cfg,
                    world,
                    |o| o,
                    |comm, store, cfg| $crate::testing::overlap::run_overlap(comm, store, cfg),
                    1
                );
            }

            #[test]
            $(#[$attr])*
            fn overlap_world_2() {
                run_overlap(2)
            }
            #[test]
            $(#[$attr])*
            fn overlap_world_3() {
                run_overlap(3)
            }
            #[test]
            $(#[$attr])*
            fn overlap_timeout_world_2() {
                $crate::conformance_tests!(
                    @part $backend, $make, $skip, $cfg,
                    2,
                    |o| o,
                    |comm, store, cfg| $crate::testing::overlap::run_overlap_timeout(comm, store, cfg),
                    1
                );
            }

            /// NVFP4's fused cases alone (also part of the whole suite).
            fn run_fused_nvfp4(world: usize) {
                $crate::conformance_tests!(
                    @part $backend, $make, $skip, $cfg,
                    world,
                    |o| o,
                    |comm, _, cfg| $crate::testing::fused_nvfp4::run_fused_nvfp4(comm, cfg),
                    1
                );
            }

            #[test]
            $(#[$attr])*
            fn fused_nvfp4_world_2() {
                run_fused_nvfp4(2)
            }
            #[test]
            $(#[$attr])*
            fn fused_nvfp4_world_3() {
                run_fused_nvfp4(3)
            }

            /// The sequence-parallel fused form alone (also part of the whole suite).
            fn run_fused_sp(world: usize) {
                $crate::conformance_tests!(
                    @part $backend, $make, $skip, $cfg,
                    world,
                    |o| o,
                    |comm, _, cfg| $crate::testing::fused_sp::run_fused_sp(comm, cfg),
                    1
                );
            }

            #[test]
            $(#[$attr])*
            fn fused_sp_world_2() {
                run_fused_sp(2)
            }
            #[test]
            $(#[$attr])*
            fn fused_sp_world_3() {
                run_fused_sp(3)
            }

            #[test]
            $(#[$attr])*
            fn collectives_without_ll_world_2() {
                $crate::conformance_tests!(
                    @part $backend, $make, $skip, $cfg,
                    2,
                    |o| o.with_coll_ll_bytes(0),
                    |comm, _, cfg| $crate::testing::conformance::run_collectives(comm, cfg),
                    1
                );
            }

            #[test]
            $(#[$attr])*
            fn world_2() {
                run(2)
            }
            #[test]
            $(#[$attr])*
            fn world_3() {
                run(3)
            }
            #[test]
            $(#[$attr])*
            fn world_4() {
                run(4)
            }
            #[test]
            $(#[$attr])*
            fn world_8() {
                run(8)
            }
        }
    };
}
