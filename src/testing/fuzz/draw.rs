//! What a trial is: the calls every rank draws alike ([`Plan`]) and what
//! each rank draws for itself ([`Local`]).

use crate::dtype::{DType, ReduceOp};
use crate::testing::data::Values;

use super::FuzzConfig;

/// splitmix64: small, and the same sequence everywhere.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64, trial: usize, stream: u64) -> Rng {
        Rng(seed ^ (trial as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ stream.wrapping_mul(0xd1b5_4a32_d192_ed03))
    }
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }
    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub(super) fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    pub(super) fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Coll {
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

    pub(super) fn name(self) -> &'static str {
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

    pub(super) fn reduces(self) -> bool {
        matches!(
            self,
            Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter | Coll::ReduceScatterList
        )
    }

    /// Whether every rank's output must be the same bytes.
    pub(super) fn agreed_output(self) -> bool {
        matches!(
            self,
            Coll::AllReduce | Coll::Broadcast | Coll::AllGather | Coll::AllGatherList
        )
    }
}

/// The op of a reduction: an operator, or premul_sum with a factor per rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Op {
    Plain(ReduceOp),
    PreMul,
}

/// What every rank draws alike for one trial.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) coll: Coll,
    pub(super) dtype: DType,
    pub(super) op: Op,
    pub(super) values: Values,
    /// Elements of one block.
    pub(super) n: usize,
    pub(super) root: usize,
    pub(super) in_place: bool,
    /// All-to-all-v and list all-to-all: elements rank `s` sends rank `d`.
    pub(super) splits: Vec<Vec<usize>>,
    /// premul_sum: rank `r`'s factor.
    pub(super) factors: Vec<f64>,
    /// A `coll_algo` hint, where one applies.
    pub(super) coll_algo: Option<&'static str>,
    /// Seed of the values.
    pub(super) data_seed: u64,
}

impl Plan {
    pub(super) fn draw(cfg: &FuzzConfig, trial: usize, world: usize) -> Plan {
        let mut g = Rng::new(cfg.seed, trial, 0);
        let coll = g.pick(&Coll::ALL);
        let dtype = if coll.reduces() {
            g.pick(&DType::REDUCIBLE)
        } else {
            g.pick(&DType::ALL)
        };
        let ops: Vec<ReduceOp> = ReduceOp::OPERATORS
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
            // `copy` on a reduce-scatter asks for a route it has not: the
            // planner passes the call on.
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll if g.chance(25) => {
                Some(g.pick(&["ll", "inbox", "copy", "auto"]))
            }
            Coll::AllGatherList | Coll::Broadcast if g.chance(25) => Some(g.pick(&["copy", "auto"])),
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

    pub(super) fn reduce_op(&self) -> ReduceOp {
        match self.op {
            Op::Plain(op) => op,
            Op::PreMul => ReduceOp::PreMulSum,
        }
    }

    pub(super) fn describe(&self, world: usize) -> String {
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
pub(super) enum Kind {
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
pub(super) struct Local {
    pub(super) kinds: [Kind; 2],
    /// Byte offsets of the operands inside their regions.
    pub(super) offsets: [usize; 2],
    /// Bytes between list tensors (0: back to back).
    pub(super) gap: usize,
    /// 0: the communicator's stream; 1, 2: the caller's streams.
    pub(super) stream: usize,
    pub(super) drop_work: bool,
    /// premul_sum: the factor in device memory rather than a host value.
    pub(super) device_factor: bool,
}

impl Local {
    pub(super) fn draw(cfg: &FuzzConfig, trial: usize, rank: usize, dtype: DType, heap: bool) -> Local {
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
