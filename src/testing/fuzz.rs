//! A randomized differential fuzz of the public API, as an engine calls it.
//!
//! Every rank draws the same sequence of calls from one seed: the
//! collective, dtype, op, counts, root, splits, in place or not, the values.
//! What an engine decides per rank, each rank draws for itself: where its
//! operands live (ferrocomm's memory, its own, the symmetric heap), at which
//! byte offset, list tensors back to back or apart, which stream, and whether
//! it keeps the `Work` or drops it. Every operand sits between guard bytes;
//! after the call every output byte is compared with the reference (the
//! reduction rule of `docs/protocol.md`, checked against fp64 for random
//! floats), every guard byte and every read-only input is checked
//! unchanged, and at the end the ranks compare their outputs' hashes.
//!
//! `FERROCOMM_FUZZ_TRIALS`, `FERROCOMM_FUZZ_SEED` and
//! `FERROCOMM_FUZZ_MAX_BYTES` change the run; a failure names its trial, so
//! `FERROCOMM_FUZZ_FIRST` (the first trial) replays it.

use std::collections::BTreeMap;
use std::time::Duration;

use half::{bf16, f16};

use super::data::{hash_bytes, input_value, sum_error_bound, to_bytes, FromF64, Order, Values};
use crate::bootstrap::{store_all_gather, Store};
use crate::comm::{Call, Communicator, Reduction, Tensor, Work};
use crate::device::{BackendKind, Device, DeviceBuffer, MemKind};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::heap::HeapBuffer;

/// What one run covers.
#[derive(Debug, Clone)]
pub struct FuzzConfig {
    pub seed: u64,
    /// Trials `first..first + trials`.
    pub first: usize,
    pub trials: usize,
    /// Largest payload of one rank's operand.
    pub max_bytes: usize,
    /// Wait bound per call.
    pub timeout: Duration,
}

impl FuzzConfig {
    /// `trials` trials of up to `max_bytes`, unless the environment says
    /// otherwise.
    pub fn from_env(trials: usize, max_bytes: usize) -> FuzzConfig {
        let num = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<u64>().ok());
        FuzzConfig {
            seed: num("FERROCOMM_FUZZ_SEED").unwrap_or(0xf022),
            first: num("FERROCOMM_FUZZ_FIRST").unwrap_or(0) as usize,
            trials: num("FERROCOMM_FUZZ_TRIALS").map_or(trials, |t| t as usize),
            max_bytes: num("FERROCOMM_FUZZ_MAX_BYTES").map_or(max_bytes, |b| b as usize),
            timeout: Duration::from_secs(60),
        }
    }
}

/// What one rank saw.
#[derive(Debug, Default)]
pub struct FuzzReport {
    pub trials: usize,
    /// Output elements whose bits differ from the reference.
    pub wrong: usize,
    /// Guard bytes, gap bytes and read-only input bytes that changed.
    pub clobbered: usize,
    /// Trials whose outputs (which every rank must agree on) hashed
    /// differently on another rank.
    pub disagreements: usize,
    /// Errors from calls that should have succeeded.
    pub errors: Vec<String>,
    /// Calls refused up front, alike on every rank, as `Unsupported` (a
    /// premul_sum all-reduce on a GPU without NCCL/RCCL, say): listed, not
    /// failures.
    pub refused: Vec<String>,
    /// The first few failures, each naming its trial.
    pub failures: Vec<String>,
    /// Calls made, per collective.
    pub calls: BTreeMap<&'static str, usize>,
    /// Bytes read back and compared (outputs, inputs and guards).
    pub bytes_checked: usize,
}

impl FuzzReport {
    /// No wrong output, nothing clobbered, every rank agreeing and no
    /// error, over at least one trial.
    pub fn is_clean(&self) -> bool {
        self.wrong == 0 && self.clobbered == 0 && self.disagreements == 0 && self.errors.is_empty() && self.trials > 0
    }

    fn fail(&mut self, what: String) {
        if self.failures.len() < 20 {
            self.failures.push(what);
        }
    }
}

/// splitmix64: small, and the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, trial: usize, stream: u64) -> Rng {
        Rng(seed ^ (trial as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ stream.wrapping_mul(0xd1b5_4a32_d192_ed03))
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coll {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    AllGatherList,
    ReduceScatter,
    ReduceScatterList,
    AllToAll,
    AllToAllV,
    AllToAllList,
    Gather,
    Scatter,
    SendRecv,
    Barrier,
}

impl Coll {
    const ALL: [Coll; 14] = [
        Coll::AllReduce,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::AllGather,
        Coll::AllGatherList,
        Coll::ReduceScatter,
        Coll::ReduceScatterList,
        Coll::AllToAll,
        Coll::AllToAllV,
        Coll::AllToAllList,
        Coll::Gather,
        Coll::Scatter,
        Coll::SendRecv,
        Coll::Barrier,
    ];

    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::AllGather => "all_gather_single",
            Coll::AllGatherList => "all_gather",
            Coll::ReduceScatter => "reduce_scatter_single",
            Coll::ReduceScatterList => "reduce_scatter",
            Coll::AllToAll => "all_to_all_single",
            Coll::AllToAllV => "all_to_all_v_single",
            Coll::AllToAllList => "all_to_all",
            Coll::Gather => "gather",
            Coll::Scatter => "scatter",
            Coll::SendRecv => "batch_p2p",
            Coll::Barrier => "barrier",
        }
    }

    fn reduces(self) -> bool {
        matches!(
            self,
            Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter | Coll::ReduceScatterList
        )
    }

    /// Whether every rank's output must be the same bytes.
    fn agreed_output(self) -> bool {
        matches!(
            self,
            Coll::AllReduce | Coll::Broadcast | Coll::AllGather | Coll::AllGatherList
        )
    }
}

/// The op of a reduction: an operator, or premul_sum with a factor per rank.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Plain(ReduceOp),
    PreMul,
}

/// What every rank draws alike for one trial.
#[derive(Debug, Clone)]
struct Plan {
    coll: Coll,
    dtype: DType,
    op: Op,
    values: Values,
    /// Elements of one block.
    n: usize,
    root: usize,
    in_place: bool,
    /// All-to-all-v and list all-to-all: elements rank `s` sends rank `d`.
    splits: Vec<Vec<usize>>,
    /// premul_sum: rank `r`'s factor.
    factors: Vec<f64>,
    /// A `coll_algo` hint, where one applies.
    coll_algo: Option<&'static str>,
    /// Seed of the values.
    data_seed: u64,
}

impl Plan {
    fn draw(cfg: &FuzzConfig, trial: usize, world: usize) -> Plan {
        let mut g = Rng::new(cfg.seed, trial, 0);
        let coll = g.pick(&Coll::ALL);
        let dtype = if coll.reduces() {
            g.pick(&DType::REDUCIBLE)
        } else {
            g.pick(&DType::ALL)
        };
        let ops: Vec<ReduceOp> = [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Avg,
            ReduceOp::BAnd,
            ReduceOp::BOr,
            ReduceOp::BXor,
        ]
        .into_iter()
        .filter(|&op| dtype.supports(op))
        .collect();
        let op = if !coll.reduces() {
            Op::Plain(ReduceOp::Sum)
        } else if dtype.is_float() && g.chance(15) {
            Op::PreMul
        } else {
            Op::Plain(g.pick(&ops))
        };
        let sums = matches!(op, Op::Plain(ReduceOp::Sum | ReduceOp::Avg) | Op::PreMul);
        let values = if coll.reduces() && dtype.is_float() && sums && g.chance(30) {
            Values::Random
        } else {
            Values::Exact
        };
        // Log-uniform bytes per block, within what every operand may hold.
        let blocks = match coll {
            Coll::AllGather | Coll::AllGatherList | Coll::ReduceScatter | Coll::ReduceScatterList => world,
            Coll::AllToAll | Coll::AllToAllV | Coll::AllToAllList | Coll::Gather | Coll::Scatter => world,
            _ => 1,
        };
        let most = (cfg.max_bytes / blocks / dtype.size()).max(1);
        let bits = usize::BITS - most.leading_zeros();
        let n = (1usize << g.below(bits as usize)).min(most);
        let n = (n + g.below(n)).clamp(1, most);
        let splits = (0..world)
            .map(|_| {
                (0..world)
                    .map(|_| if g.chance(10) { 0 } else { g.below(n + 1) })
                    .collect()
            })
            .collect();
        let factors = (0..world).map(|_| 2f64.powi(g.below(7) as i32 - 3)).collect();
        let coll_algo = match coll {
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll if g.chance(25) => {
                Some(g.pick(&["ll", "inbox", "auto"]))
            }
            _ => None,
        };
        Plan {
            coll,
            dtype,
            op,
            values,
            n,
            root: g.below(world),
            in_place: g.chance(40),
            splits,
            factors,
            coll_algo,
            data_seed: g.next(),
        }
    }

    fn reduce_op(&self) -> ReduceOp {
        match self.op {
            Op::Plain(op) => op,
            Op::PreMul => ReduceOp::PreMulSum,
        }
    }

    fn describe(&self, world: usize) -> String {
        format!(
            "{} {} x {} {:?} {:?} root {} {} at world {world}",
            self.coll.name(),
            self.n,
            self.dtype,
            self.op,
            self.values,
            self.root,
            if self.in_place { "in place" } else { "out of place" }
        )
    }
}

/// Where one rank's operand lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `comm.alloc`.
    Ferrocomm,
    /// Memory the engine allocated itself: the device's own allocator on
    /// GPUs, the process heap on the host.
    Caller,
    /// The symmetric heap.
    Heap,
}

/// What this rank draws for itself for one trial.
#[derive(Debug, Clone, Copy)]
struct Local {
    kinds: [Kind; 2],
    /// Byte offsets of the operands inside their regions.
    offsets: [usize; 2],
    /// Bytes between list tensors (0: back to back).
    gap: usize,
    /// 0: the communicator's stream; 1, 2: the caller's streams.
    stream: usize,
    drop_work: bool,
    /// premul_sum: the factor in device memory rather than a host value.
    device_factor: bool,
}

impl Local {
    fn draw(cfg: &FuzzConfig, trial: usize, rank: usize, dtype: DType, heap: bool) -> Local {
        let mut g = Rng::new(cfg.seed, trial, rank as u64 + 1);
        let es = dtype.size();
        let kinds = [Kind::Ferrocomm, Kind::Caller, Kind::Heap];
        let mut kind = || {
            let k = g.pick(&kinds);
            if k == Kind::Heap && !heap {
                Kind::Ferrocomm
            } else {
                k
            }
        };
        let kinds = [kind(), kind()];
        let offset = |g: &mut Rng| match g.below(4) {
            0 | 1 => 0,
            2 => g.below(16) * es,
            _ => g.below(64),
        };
        let offsets = [offset(&mut g), offset(&mut g)];
        let gap = match g.below(3) {
            0 => 0,
            1 => (1 + g.below(8)) * es,
            _ => 1 + g.below(40),
        };
        Local {
            kinds,
            offsets,
            gap,
            stream: g.below(3),
            drop_work: g.chance(25),
            device_factor: g.chance(50),
        }
    }
}

/// Guard bytes on each side of an operand.
const GUARD: usize = 64;

/// The guard pattern at byte `i` of a region.
fn guard_byte(i: usize) -> u8 {
    0xA5 ^ (i as u8).wrapping_mul(31)
}

/// One slot of memory of each kind, reused by every trial.
enum Mem<D: Device> {
    Buffer(D::Buffer),
    Heap(HeapBuffer),
    Host(Vec<u64>),
}

impl<D: Device> Mem<D> {
    fn base(&self) -> u64 {
        match self {
            Mem::Buffer(b) => b.ptr().0,
            Mem::Heap(h) => h.ptr().0,
            Mem::Host(v) => v.as_ptr() as u64,
        }
    }
}

/// The memory of one rank: per kind, two slots (input, output) and one for
/// a device factor.
struct Pools<D: Device> {
    slots: BTreeMap<(u8, usize), Mem<D>>,
    factor: D::Buffer,
    bytes: usize,
}

fn kind_code(k: Kind) -> u8 {
    match k {
        Kind::Ferrocomm => 0,
        Kind::Caller => 1,
        Kind::Heap => 2,
    }
}

impl<D: Device> Pools<D> {
    fn new(comm: &Communicator<D>, bytes: usize, heap: bool) -> Result<Pools<D>> {
        let mut slots = BTreeMap::new();
        let host = comm.device().facts().backend == BackendKind::Host;
        for slot in 0..2 {
            slots.insert((kind_code(Kind::Ferrocomm), slot), Mem::Buffer(comm.alloc(bytes)?));
            let caller = match host {
                true => Mem::Host(vec![0u64; bytes.div_ceil(8)]),
                false => Mem::Buffer(comm.device().alloc(bytes, MemKind::Plain)?),
            };
            slots.insert((kind_code(Kind::Caller), slot), caller);
            if heap {
                slots.insert((kind_code(Kind::Heap), slot), Mem::Heap(comm.heap_alloc(bytes)?));
            }
        }
        Ok(Pools {
            slots,
            factor: comm.alloc(64)?,
            bytes,
        })
    }

    /// A region of `len` bytes of `kind`'s slot, its first byte `offset`
    /// bytes after the front guard.
    fn region(&self, kind: Kind, slot: usize, offset: usize, len: usize) -> Result<Region> {
        let mem = &self.slots[&(kind_code(kind), slot)];
        let whole = GUARD + offset + len + GUARD;
        if whole > self.bytes {
            return Err(Error::invalid(format!(
                "fuzz: {whole} bytes do not fit a slot of {}",
                self.bytes
            )));
        }
        Ok(Region {
            start: mem.base(),
            data: GUARD + offset,
            whole,
        })
    }
}

/// An operand with its guards: its bytes from `data` on, inside
/// `start..start + whole`.
#[derive(Debug, Clone, Copy)]
struct Region {
    start: u64,
    data: usize,
    whole: usize,
}

impl Region {
    fn all(&self) -> Tensor {
        // SAFETY: inside a live slot of the pools, which outlive every call.
        unsafe { Tensor::from_raw(self.start, self.whole, DType::U8) }
    }

    fn tensor(&self, dtype: DType, first_byte: usize, count: usize) -> Tensor {
        // SAFETY: as `all`; callers stay inside the data bytes.
        unsafe { Tensor::from_raw(self.start + (self.data + first_byte) as u64, count, dtype) }
    }
}

/// The bytes of one rank's input for a trial: `count` elements of `dtype`.
fn input_bytes(p: &Plan, rank: usize, count: usize) -> Vec<u8> {
    match p.dtype {
        DType::F32 => to_bytes(&elements::<f32>(p, rank, count)),
        DType::F16 => to_bytes(&elements::<f16>(p, rank, count)),
        DType::BF16 => to_bytes(&elements::<bf16>(p, rank, count)),
        DType::I32 => to_bytes(&elements::<i32>(p, rank, count)),
        dtype => (0..count * dtype.size())
            .map(|i| super::data::draw(p.data_seed, rank, i) as u8)
            .collect(),
    }
}

fn elements<T: FromF64>(p: &Plan, rank: usize, count: usize) -> Vec<T> {
    (0..count)
        .map(|i| T::from_f64(input_value(p.data_seed, rank, i, p.reduce_op(), p.values)))
        .collect()
}

/// The reduction of element `i` of every rank's input, as bytes.
fn reduced(p: &Plan, world: usize, first: usize, count: usize) -> Vec<u8> {
    fn run<T: FromF64>(p: &Plan, world: usize, first: usize, count: usize) -> Vec<u8> {
        let order = Order::Flat(world);
        let x = |r: usize, i: usize| T::from_f64(input_value(p.data_seed, r, i, p.reduce_op(), p.values)).to_acc();
        let v: Vec<T> = (first..first + count)
            .map(|i| match p.op {
                Op::Plain(op) => order.combine::<T>(op, |r| x(r, i)),
                Op::PreMul => order.combine::<T>(ReduceOp::PreMulSum, |r| T::premul(x(r, i), p.factors[r] as f32)),
            })
            .collect();
        to_bytes(&v)
    }
    match p.dtype {
        DType::F32 => run::<f32>(p, world, first, count),
        DType::F16 => run::<f16>(p, world, first, count),
        DType::BF16 => run::<bf16>(p, world, first, count),
        _ => run::<i32>(p, world, first, count),
    }
}

/// Elements of `got` (output elements `first..`) further from the fp64 sum
/// than the rule's rounding allows (random float sums).
fn fp64_misses(p: &Plan, world: usize, first: usize, got: &[u8]) -> usize {
    let es = p.dtype.size();
    let value = |b: &[u8]| -> f64 {
        match p.dtype {
            DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
            DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
            _ => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        }
    };
    let x = |r: usize, i: usize| -> f64 {
        let v = input_value(p.data_seed, r, i, p.reduce_op(), p.values);
        match p.dtype {
            DType::F32 => v as f32 as f64,
            DType::F16 => f16::from_f64(v).to_f64(),
            _ => bf16::from_f64(v).to_f64(),
        }
    };
    got.chunks_exact(es)
        .enumerate()
        .filter(|(k, b)| {
            let i = first + k;
            let scale = |r: usize| match p.op {
                Op::PreMul => p.factors[r],
                Op::Plain(ReduceOp::Avg) => 1.0 / world as f64,
                Op::Plain(_) => 1.0,
            };
            let exact: f64 = (0..world).map(|r| x(r, i) * scale(r)).sum();
            let abs: f64 = (0..world).map(|r| (x(r, i) * scale(r)).abs()).sum();
            (value(b) - exact).abs() > 2.0 * sum_error_bound(p.dtype, world, abs, exact)
        })
        .count()
}

/// One rank's view of a trial: where its operands are and what they hold.
struct Trial<'a, D: Device> {
    comm: &'a Communicator<D>,
    plan: &'a Plan,
    local: Local,
    pools: &'a Pools<D>,
    streams: &'a [D::Stream],
    /// Regions written before the call, with what they must hold after it
    /// (`None` bytes: an output, checked against `expect`).
    regions: Vec<(Region, Vec<u8>)>,
    /// Output byte ranges (region index, first byte, bytes) and what they
    /// must hold.
    expect: Vec<(usize, usize, Vec<u8>)>,
}

impl<'a, D: Device> Trial<'a, D> {
    fn call(&self) -> Call<'a, D> {
        let mut call = match self.local.stream {
            0 => Call::new(),
            k => Call::on(&self.streams[k - 1]),
        };
        if let Some(v) = self.plan.coll_algo {
            call = call.hint("coll_algo", v);
        }
        call.timeout(Duration::from_secs(60))
    }

    /// Operand `slot` of `len` bytes: its region, filled with guards and
    /// `fill` (or poison when `fill` is `None`). Returns its index.
    fn operand(&mut self, slot: usize, len: usize, fill: Option<&[u8]>) -> Result<usize> {
        let r = self
            .pools
            .region(self.local.kinds[slot], slot, self.local.offsets[slot], len)?;
        let mut bytes: Vec<u8> = (0..r.whole).map(guard_byte).collect();
        match fill {
            Some(f) => bytes[r.data..r.data + len].copy_from_slice(f),
            None => bytes[r.data..r.data + len].fill(0x7F),
        }
        self.comm.copy_in(r.all(), &bytes, &self.call())?;
        self.regions.push((r, bytes));
        Ok(self.regions.len() - 1)
    }

    /// Expect `want` at byte `at` of region `idx`'s data.
    fn expect(&mut self, idx: usize, at: usize, want: Vec<u8>) {
        self.expect.push((idx, at, want));
    }

    /// `count` list tensors of `each` elements laid out in region `idx`,
    /// back to back or `gap` bytes apart.
    fn list(&self, idx: usize, counts: &[usize]) -> Vec<(usize, Tensor)> {
        let (r, es) = (self.regions[idx].0, self.plan.dtype.size());
        let mut at = 0;
        counts
            .iter()
            .map(|&c| {
                let t = (at, r.tensor(self.plan.dtype, at, c));
                at += c * es + self.local.gap;
                t
            })
            .collect()
    }

    fn list_bytes(&self, counts: &[usize]) -> usize {
        let es = self.plan.dtype.size();
        counts.iter().map(|c| c * es + self.local.gap).sum()
    }
}

/// Run the fuzz on this rank. Collective: every rank calls it with the same
/// config and store.
pub fn run_fuzz<D: Device>(comm: &Communicator<D>, store: &dyn Store, cfg: &FuzzConfig) -> Result<FuzzReport> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut report = FuzzReport::default();
    // Room for the largest operand (every one holds at most `max_bytes`),
    // with lists apart, an offset and guards.
    let slot = cfg.max_bytes + world * 128 + 4 * GUARD + 256;
    // The heap is collective: every rank tries it, and uses it only if
    // every rank got it.
    let heap_ok = comm.heap_alloc(64).map(drop);
    let all = store_all_gather(
        store,
        &format!("fuzz/{}/heap", comm.name()),
        rank,
        world,
        &[u8::from(heap_ok.is_ok())],
        cfg.timeout,
    )?;
    let heap = all.iter().all(|v| v.first() == Some(&1));
    let pools = Pools::new(comm, slot, heap)?;
    let streams = [comm.device().create_stream()?, comm.device().create_stream()?];
    let exact_random = !comm.has_vendor_library();
    let mut hashes = Vec::with_capacity(cfg.trials);
    for trial in cfg.first..cfg.first + cfg.trials {
        let plan = Plan::draw(cfg, trial, world);
        let local = Local::draw(cfg, trial, rank, plan.dtype, heap);
        let mut t = Trial {
            comm,
            plan: &plan,
            local,
            pools: &pools,
            streams: &streams,
            regions: Vec::new(),
            expect: Vec::new(),
        };
        *report.calls.entry(plan.coll.name()).or_default() += 1;
        let outcome = issue(&mut t, world).and_then(|work| match (work, local.drop_work) {
            (Some(w), false) => w.wait(Some(cfg.timeout)),
            _ => Ok(()),
        });
        if let Err(Error::Unsupported(why)) = &outcome {
            report
                .refused
                .push(format!("trial {trial} ({}): {why}", plan.describe(world)));
            report.trials += 1;
            hashes.push(0);
            continue;
        }
        if let Err(e) = outcome {
            let what = format!("rank {rank}, trial {trial} ({}): {e}", plan.describe(world));
            eprintln!("fuzz: {what}");
            report.errors.push(what);
            // A failed call may leave the communicator aborted: stop here.
            break;
        }
        let hash = check(&t, &plan, world, exact_random, trial, &mut report)?;
        hashes.push(hash);
        report.trials += 1;
    }
    // Every rank's outputs that must agree, trial by trial.
    let mine: Vec<u8> = hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
    let theirs = store_all_gather(
        store,
        &format!("fuzz/{}/hashes", comm.name()),
        rank,
        world,
        &mine,
        cfg.timeout,
    )?;
    for (peer, bytes) in theirs.iter().enumerate() {
        for (k, (a, b)) in mine.chunks_exact(8).zip(bytes.chunks_exact(8)).enumerate() {
            if a != b {
                report.disagreements += 1;
                report.fail(format!("trial {}: outputs differ from rank {peer}'s", cfg.first + k));
            }
        }
    }
    for s in &streams {
        comm.device().synchronize(s)?;
    }
    Ok(report)
}

/// This rank's reduction: its op, or premul_sum by its factor, as a host
/// value or one element in device memory.
fn reduction<D: Device>(t: &Trial<'_, D>) -> Result<Reduction> {
    let (p, comm) = (t.plan, t.comm);
    let f = p.factors[comm.rank()];
    Ok(match p.op {
        Op::Plain(op) => op.into(),
        Op::PreMul if t.local.device_factor => {
            let bytes = match p.dtype {
                DType::F32 => (f as f32).to_le_bytes().to_vec(),
                DType::F16 => f16::from_f64(f).to_le_bytes().to_vec(),
                _ => bf16::from_f64(f).to_le_bytes().to_vec(),
            };
            let ft = Tensor::view(&t.pools.factor, p.dtype, 0, 1)?;
            comm.copy_in(ft, &bytes, &t.call())?;
            Reduction::premul_sum_device(ft)
        }
        Op::PreMul => Reduction::premul_sum(f),
    })
}

/// Lay out this rank's operands, write them, and make the call.
fn issue<D: Device>(t: &mut Trial<'_, D>, world: usize) -> Result<Option<Work<D>>> {
    let (p, comm) = (t.plan, t.comm);
    let (rank, es, n, dtype) = (comm.rank(), p.dtype.size(), p.n, p.dtype);
    let call = t.call();
    let red = match p.coll.reduces() {
        true => reduction(t)?,
        false => ReduceOp::Sum.into(),
    };
    let work = match p.coll {
        Coll::AllReduce => {
            let x = input_bytes(p, rank, n);
            let want = reduced(p, world, 0, n);
            if p.in_place {
                let i = t.operand(0, n * es, Some(&x))?;
                t.expect(i, 0, want);
                let a = t.regions[i].0.tensor(dtype, 0, n);
                comm.all_reduce(a, red, &call)?
            } else {
                let i = t.operand(0, n * es, Some(&x))?;
                let o = t.operand(1, n * es, None)?;
                t.expect(o, 0, want);
                let (a, b) = (t.regions[i].0.tensor(dtype, 0, n), t.regions[o].0.tensor(dtype, 0, n));
                comm.all_reduce_into(a, b, red, &call)?
            }
        }
        Coll::Broadcast => {
            let x = input_bytes(p, rank, n);
            let want = input_bytes(p, p.root, n);
            if p.in_place {
                let i = t.operand(0, n * es, Some(&x))?;
                t.expect(i, 0, want);
                comm.broadcast(t.regions[i].0.tensor(dtype, 0, n), p.root, &call)?
            } else {
                let i = t.operand(0, n * es, Some(&x))?;
                let o = t.operand(1, n * es, None)?;
                t.expect(o, 0, want);
                let (a, b) = (t.regions[i].0.tensor(dtype, 0, n), t.regions[o].0.tensor(dtype, 0, n));
                comm.broadcast_into(a, b, p.root, &call)?
            }
        }
        Coll::Reduce => {
            let x = input_bytes(p, rank, n);
            let i = t.operand(0, n * es, Some(&x))?;
            if rank == p.root {
                t.expect(i, 0, reduced(p, world, 0, n));
            }
            comm.reduce(t.regions[i].0.tensor(dtype, 0, n), red, p.root, &call)?
        }
        Coll::AllGather => {
            let x = input_bytes(p, rank, n);
            let want: Vec<u8> = (0..world).flat_map(|q| input_bytes(p, q, n)).collect();
            if p.in_place {
                let mut fill = vec![0x7Fu8; world * n * es];
                fill[rank * n * es..(rank + 1) * n * es].copy_from_slice(&x);
                let o = t.operand(1, world * n * es, Some(&fill))?;
                t.expect(o, 0, want);
                let out = t.regions[o].0.tensor(dtype, 0, world * n);
                comm.all_gather_single(out, out.slice(rank * n, n)?, &call)?
            } else {
                let i = t.operand(0, n * es, Some(&x))?;
                let o = t.operand(1, world * n * es, None)?;
                t.expect(o, 0, want);
                let (a, b) = (
                    t.regions[i].0.tensor(dtype, 0, n),
                    t.regions[o].0.tensor(dtype, 0, world * n),
                );
                comm.all_gather_single(b, a, &call)?
            }
        }
        Coll::AllGatherList => {
            let x = input_bytes(p, rank, n);
            let i = t.operand(0, n * es, Some(&x))?;
            let counts = vec![n; world];
            let o = t.operand(1, t.list_bytes(&counts), None)?;
            let outs = t.list(o, &counts);
            for (q, (at, _)) in outs.iter().enumerate() {
                t.expect(o, *at, input_bytes(p, q, n));
            }
            let outs: Vec<Tensor> = outs.into_iter().map(|(_, t)| t).collect();
            comm.all_gather(&outs, t.regions[i].0.tensor(dtype, 0, n), &call)?
        }
        Coll::ReduceScatter => {
            let x = input_bytes(p, rank, world * n);
            let want = reduced(p, world, rank * n, n);
            let i = t.operand(0, world * n * es, Some(&x))?;
            let input = t.regions[i].0.tensor(dtype, 0, world * n);
            if p.in_place {
                t.expect(i, rank * n * es, want);
                comm.reduce_scatter_single(input.slice(rank * n, n)?, input, red, &call)?
            } else {
                let o = t.operand(1, n * es, None)?;
                t.expect(o, 0, want);
                comm.reduce_scatter_single(t.regions[o].0.tensor(dtype, 0, n), input, red, &call)?
            }
        }
        Coll::ReduceScatterList => {
            let x = input_bytes(p, rank, world * n);
            let counts = vec![n; world];
            let len = t.list_bytes(&counts);
            // The parts of the input, apart when this rank chose a gap.
            let mut fill: Vec<u8> = (0..len).map(|k| guard_byte(k + 7)).collect();
            let mut at = 0;
            for q in 0..world {
                fill[at..at + n * es].copy_from_slice(&x[q * n * es..(q + 1) * n * es]);
                at += n * es + t.local.gap;
            }
            let i = t.operand(0, len, Some(&fill))?;
            let ins: Vec<Tensor> = t.list(i, &counts).into_iter().map(|(_, t)| t).collect();
            let o = t.operand(1, n * es, None)?;
            t.expect(o, 0, reduced(p, world, rank * n, n));
            comm.reduce_scatter(t.regions[o].0.tensor(dtype, 0, n), &ins, red, &call)?
        }
        Coll::AllToAll => {
            let x = input_bytes(p, rank, world * n);
            let want: Vec<u8> = (0..world)
                .flat_map(|s| input_bytes(p, s, world * n)[rank * n * es..(rank + 1) * n * es].to_vec())
                .collect();
            let i = t.operand(0, world * n * es, Some(&x))?;
            let input = t.regions[i].0.tensor(dtype, 0, world * n);
            if p.in_place {
                t.expect(i, 0, want);
                comm.all_to_all_single(input, input, &call)?
            } else {
                let o = t.operand(1, world * n * es, None)?;
                t.expect(o, 0, want);
                comm.all_to_all_single(t.regions[o].0.tensor(dtype, 0, world * n), input, &call)?
            }
        }
        Coll::AllToAllV | Coll::AllToAllList => {
            let sends: Vec<usize> = p.splits[rank].clone();
            let recvs: Vec<usize> = (0..world).map(|s| p.splits[s][rank]).collect();
            let total_in: usize = sends.iter().sum();
            let total_out: usize = recvs.iter().sum();
            let x = input_bytes(p, rank, total_in);
            // What source s sends us: its block to us, after its blocks to
            // the ranks before us.
            let from = |s: usize| -> Vec<u8> {
                let before: usize = p.splits[s][..rank].iter().sum();
                input_bytes(p, s, before + recvs[s])[before * es..].to_vec()
            };
            if p.coll == Coll::AllToAllV {
                let i = t.operand(0, total_in * es, Some(&x))?;
                let o = t.operand(1, total_out * es, None)?;
                t.expect(o, 0, (0..world).flat_map(from).collect());
                let (a, b) = (
                    t.regions[i].0.tensor(dtype, 0, total_in),
                    t.regions[o].0.tensor(dtype, 0, total_out),
                );
                comm.all_to_all_v_single(b, a, &recvs, &sends, &call)?
            } else {
                let len = t.list_bytes(&sends);
                let mut fill: Vec<u8> = (0..len).map(|k| guard_byte(k + 3)).collect();
                let (mut at, mut from_x) = (0, 0);
                for &c in &sends {
                    fill[at..at + c * es].copy_from_slice(&x[from_x..from_x + c * es]);
                    at += c * es + t.local.gap;
                    from_x += c * es;
                }
                let i = t.operand(0, len, Some(&fill))?;
                let ins: Vec<Tensor> = t.list(i, &sends).into_iter().map(|(_, t)| t).collect();
                let o = t.operand(1, t.list_bytes(&recvs), None)?;
                let outs = t.list(o, &recvs);
                for (s, (at, _)) in outs.iter().enumerate() {
                    t.expect(o, *at, from(s));
                }
                let outs: Vec<Tensor> = outs.into_iter().map(|(_, t)| t).collect();
                comm.all_to_all(&outs, &ins, &call)?
            }
        }
        Coll::Gather => {
            let x = input_bytes(p, rank, n);
            let i = t.operand(0, n * es, Some(&x))?;
            let counts = vec![n; world];
            let outs: Vec<Tensor> = if rank == p.root {
                let o = t.operand(1, t.list_bytes(&counts), None)?;
                let outs = t.list(o, &counts);
                for (q, (at, _)) in outs.iter().enumerate() {
                    t.expect(o, *at, input_bytes(p, q, n));
                }
                outs.into_iter().map(|(_, t)| t).collect()
            } else {
                Vec::new()
            };
            comm.gather(&outs, t.regions[i].0.tensor(dtype, 0, n), p.root, &call)?
        }
        Coll::Scatter => {
            let counts = vec![n; world];
            let ins: Vec<Tensor> = if rank == p.root {
                let x = input_bytes(p, rank, world * n);
                let len = t.list_bytes(&counts);
                let mut fill: Vec<u8> = (0..len).map(|k| guard_byte(k + 5)).collect();
                let mut at = 0;
                for q in 0..world {
                    fill[at..at + n * es].copy_from_slice(&x[q * n * es..(q + 1) * n * es]);
                    at += n * es + t.local.gap;
                }
                let i = t.operand(0, len, Some(&fill))?;
                t.list(i, &counts).into_iter().map(|(_, t)| t).collect()
            } else {
                Vec::new()
            };
            let o = t.operand(1, n * es, None)?;
            let root_in = input_bytes(p, p.root, world * n);
            t.expect(o, 0, root_in[rank * n * es..(rank + 1) * n * es].to_vec());
            comm.scatter(t.regions[o].0.tensor(dtype, 0, n), &ins, p.root, &call)?
        }
        Coll::SendRecv => {
            // A ring: to the next rank, from the one before.
            let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
            let x = input_bytes(p, rank, n);
            let i = t.operand(0, n * es, Some(&x))?;
            let o = t.operand(1, n * es, None)?;
            t.expect(o, 0, input_bytes(p, prev, n));
            let ops = [
                crate::comm::P2p::Send(t.regions[i].0.tensor(dtype, 0, n), next),
                crate::comm::P2p::Recv(t.regions[o].0.tensor(dtype, 0, n), prev),
            ];
            comm.batch_p2p(&ops, &call)?
        }
        Coll::Barrier => comm.barrier(&call)?,
    };
    Ok(Some(work))
}

/// Read every region back (after the call, on its stream) and compare.
/// Returns the hash of the outputs every rank must agree on.
fn check<D: Device>(
    t: &Trial<'_, D>,
    p: &Plan,
    world: usize,
    exact_random: bool,
    trial: usize,
    report: &mut FuzzReport,
) -> Result<u64> {
    let es = p.dtype.size();
    let mut agreed = Vec::new();
    let mut got_all = Vec::with_capacity(t.regions.len());
    for (r, _) in &t.regions {
        let mut got = vec![0u8; r.whole];
        t.comm.copy_out(&mut got, r.all(), &t.call())?;
        report.bytes_checked += got.len();
        got_all.push(got);
    }
    // What every byte of every region must hold: the bytes written, with
    // the expected outputs over them.
    let mut want_all: Vec<Vec<u8>> = t.regions.iter().map(|(_, b)| b.clone()).collect();
    let mut is_output: Vec<Vec<bool>> = t.regions.iter().map(|(r, _)| vec![false; r.whole]).collect();
    for (idx, at, want) in &t.expect {
        let r = t.regions[*idx].0;
        let from = r.data + at;
        want_all[*idx][from..from + want.len()].copy_from_slice(want);
        is_output[*idx][from..from + want.len()].fill(true);
    }
    let random_sum = p.coll.reduces() && p.values == Values::Random;
    for (idx, (got, want)) in got_all.iter().zip(&want_all).enumerate() {
        let clobbered = got
            .iter()
            .zip(want)
            .zip(&is_output[idx])
            .filter(|((g, w), out)| g != w && !**out)
            .count();
        if clobbered > 0 {
            report.clobbered += clobbered;
            report.fail(format!(
                "trial {trial} ({}): {clobbered} guard or input bytes changed in operand {idx}",
                p.describe(world)
            ));
        }
        // Elements, counted once, from the wrong bytes of each output range.
        for (i, at, want) in t.expect.iter().filter(|(i, _, _)| *i == idx) {
            let from = t.regions[*i].0.data + at;
            let got = &got[from..from + want.len()];
            if p.coll.agreed_output() {
                agreed.extend_from_slice(got);
            }
            let wrong_elems = got.chunks(es).zip(want.chunks(es)).filter(|(g, w)| g != w).count();
            if random_sum && !exact_random {
                // NCCL's sums may round otherwise: the fp64 bound only.
                let first = if matches!(p.coll, Coll::ReduceScatter | Coll::ReduceScatterList) {
                    t.comm.rank() * p.n
                } else {
                    0
                };
                let misses = fp64_misses(p, world, first, got);
                report.wrong += misses;
                if misses > 0 {
                    report.fail(format!(
                        "trial {trial} ({}): {misses} elements off the fp64 sum",
                        p.describe(world)
                    ));
                }
            } else if wrong_elems > 0 {
                report.wrong += wrong_elems;
                report.fail(format!(
                    "trial {trial} ({}): {wrong_elems} of {} elements wrong",
                    p.describe(world),
                    want.len() / es
                ));
            } else if random_sum {
                let first = if matches!(p.coll, Coll::ReduceScatter | Coll::ReduceScatterList) {
                    t.comm.rank() * p.n
                } else {
                    0
                };
                let misses = fp64_misses(p, world, first, got);
                report.wrong += misses;
                if misses > 0 {
                    report.fail(format!(
                        "trial {trial} ({}): the rule's bits, but {misses} elements off the fp64 sum",
                        p.describe(world)
                    ));
                }
            }
        }
    }
    Ok(hash_bytes(&agreed))
}
