//! The tuned table: per world size, one ladder per (collective, dtype
//! class) for every collective with more than one way to run, and the
//! thresholds the planner's defaults use. The defaults below are what H200
//! measured; autotune at init (`comm/autotune.rs`) replaces the ladders of
//! the communicator's world. The planner (`plan::plan`) reads it; nothing
//! here decides a call.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use super::algorithm::{Algorithm, Collective};
use crate::device::BackendKind;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Dtypes by element size, which is what decides a reduction's cost: 1-2
/// byte elements (f16, bf16, fp8, i8, u8) are widened to f32 to be reduced
/// and move twice the elements per byte; 4-8 byte elements (f32, i32, f64,
/// i64) are reduced as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DtypeClass {
    /// 1- and 2-byte elements.
    Narrow,
    /// 4- and 8-byte elements.
    Wide,
}

impl DtypeClass {
    /// Both classes, in ladder order.
    pub const ALL: [DtypeClass; 2] = [DtypeClass::Narrow, DtypeClass::Wide];

    /// The class of `dtype`.
    pub const fn of(dtype: DType) -> Self {
        if dtype.size() <= 2 {
            DtypeClass::Narrow
        } else {
            DtypeClass::Wide
        }
    }

    /// Its name as the cache file spells it: `narrow` or `wide`.
    pub const fn name(self) -> &'static str {
        match self {
            DtypeClass::Narrow => "narrow",
            DtypeClass::Wide => "wide",
        }
    }

    /// The class's position in [`DtypeClass::ALL`] (and in the ladders).
    pub const fn index(self) -> usize {
        match self {
            DtypeClass::Narrow => 0,
            DtypeClass::Wide => 1,
        }
    }

    /// The dtype autotune measures the class with (what engines move most).
    pub const fn representative(self) -> DType {
        match self {
            DtypeClass::Narrow => DType::BF16,
            DtypeClass::Wide => DType::F32,
        }
    }
}

impl fmt::Display for DtypeClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DtypeClass {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DtypeClass::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| Error::invalid(format!("unknown dtype class {s:?} (expected narrow or wide)")))
    }
}

/// One step of a ladder: payloads up to `max_bytes` (inclusive) run `algo`,
/// unless an earlier step already took them. All-reduce ladders count the
/// payload, the others bytes per peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step<A = Algorithm> {
    /// The largest payload this step takes (`usize::MAX` on the last step).
    pub max_bytes: usize,
    /// What those payloads run.
    pub algo: A,
}

const fn step<A>(max_bytes: usize, algo: A) -> Step<A> {
    Step { max_bytes, algo }
}

/// The step of `ladder` that takes `bytes`: the first that reaches it.
pub fn step_for<A>(ladder: &[Step<A>], bytes: usize) -> Option<&Step<A>> {
    ladder.iter().find(|s| bytes <= s.max_bytes)
}

/// Whether `ladder` is well formed: increasing bounds, the last one unbounded.
pub(crate) fn well_formed<A>(ladder: &[Step<A>]) -> bool {
    ladder.last().map(|s| s.max_bytes) == Some(usize::MAX) && ladder.windows(2).all(|w| w[0].max_bytes < w[1].max_bytes)
}

/// The ladders of one world size: per collective, per dtype class (indexed
/// by [`DtypeClass::index`]). All-gather and all-to-all move bytes, so their
/// two classes hold the same ladder unless someone sets them apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ladders {
    /// By payload bytes.
    pub all_reduce: [Vec<Step>; 2],
    /// By bytes per peer (the input).
    pub all_gather: [Vec<Step>; 2],
    /// By bytes per peer (the output).
    pub reduce_scatter: [Vec<Step>; 2],
    /// Without splits, by bytes per peer (count / world).
    pub all_to_all: [Vec<Step>; 2],
}

impl Ladders {
    /// The all-reduce ladder of `class`.
    pub fn all_reduce(&self, class: DtypeClass) -> &[Step] {
        &self.all_reduce[class.index()]
    }

    /// The ladder of `coll` and `class` (the data kinds by bytes per
    /// peer); empty for all-reduce, whose ladder is [`Ladders::all_reduce`],
    /// and for the collectives without one.
    pub fn coll(&self, coll: Collective, class: DtypeClass) -> &[Step] {
        let i = class.index();
        match coll {
            Collective::AllGather => &self.all_gather[i],
            Collective::ReduceScatter => &self.reduce_scatter[i],
            Collective::AllToAll => &self.all_to_all[i],
            _ => &[],
        }
    }

    /// [`Ladders::coll`], to replace (`None` where there is none).
    pub(crate) fn coll_mut(&mut self, coll: Collective, class: DtypeClass) -> Option<&mut Vec<Step>> {
        let i = class.index();
        match coll {
            Collective::AllGather => Some(&mut self.all_gather[i]),
            Collective::ReduceScatter => Some(&mut self.reduce_scatter[i]),
            Collective::AllToAll => Some(&mut self.all_to_all[i]),
            _ => None,
        }
    }

    /// The defaults of `world` ranks on `backend` (see [`DispatchTable::default_for`]).
    pub(crate) fn default_for(backend: BackendKind, world: usize) -> Self {
        let ar = default_all_reduce(backend, world);
        // The static rules that measured on 2x H200 (NV18): LL up to
        // `ll_max_block_bytes`, then NCCL/RCCL below `CUSTOM_MIN_BLOCK_BYTES`
        // where it may take the call, then the inbox kernels; all-to-alls
        // keep the kernels up to `A2A_VENDOR_MIN_BLOCK_BYTES`. A step whose
        // kind cannot run a call (no library, a deterministic reduction,
        // a block past the LL lines) hands it to the next step.
        let ll = ll_max_block_bytes(world);
        let data = vec![
            step(ll, Algorithm::Ll),
            step(CUSTOM_MIN_BLOCK_BYTES - 1, Algorithm::Vendor),
            step(usize::MAX, Algorithm::Inbox),
        ];
        let a2a = vec![
            step(ll, Algorithm::Ll),
            step(A2A_VENDOR_MIN_BLOCK_BYTES - 1, Algorithm::Inbox),
            step(usize::MAX, Algorithm::Vendor),
        ];
        Ladders {
            all_reduce: [ar.clone(), ar],
            all_gather: [data.clone(), data.clone()],
            reduce_scatter: [data.clone(), data],
            all_to_all: [a2a.clone(), a2a],
        }
    }

    /// Whether every ladder is well formed and the all-reduce ladders hold
    /// ferrocomm's kernels only.
    pub fn well_formed(&self) -> bool {
        DtypeClass::ALL.into_iter().all(|class| {
            let ar = self.all_reduce(class);
            well_formed(ar)
                && ar.iter().all(|s| Algorithm::ALL_REDUCE_KERNELS.contains(&s.algo))
                && Collective::TUNED[1..].iter().all(|&c| {
                    let ladder = self.coll(c, class);
                    well_formed(ladder) && ladder.iter().all(|s| Algorithm::DATA_KINDS.contains(&s.algo))
                })
        })
    }
}

/// Size thresholds per world size: an increasing ladder of steps per
/// collective and dtype class, the last step unbounded.
#[derive(Debug, Clone)]
pub struct DispatchTable {
    /// Indexed by world size (0 and 1 are unused: no kernel runs there).
    pub ladders: [Ladders; 9],
    /// Smallest payload handed to the vendor library when the caller allows
    /// non-deterministic results and the library is loaded.
    pub ccl_min_bytes: usize,
    /// Smallest payload quick-reduce takes, per world size, when the caller
    /// opted in (`CommOptions::quantization`) and the call is an f16/bf16 sum.
    pub qr_min_bytes: [usize; 9],
}

/// The default all-reduce ladder of `world` ranks on `backend` (both dtype
/// classes: the measurements below are bf16).
fn default_all_reduce(backend: BackendKind, world: usize) -> Vec<Step> {
    const KIB: usize = 1024;
    const MIB: usize = 1024 * KIB;
    use Algorithm::*;
    match backend {
        // The host backend's cost is memory traffic (DRAM-bound copies and
        // reductions), not latency. On a 2-core VM (bf16 sum, processes,
        // `ferrocomm-bench --backend host --algo ...`, median us per op):
        //   w2  1M: oneshot 461, twoshot 426, twoshot-push 367
        //       4M: oneshot 2495, twoshot 2515, twoshot-push 1504
        //   w4  256K: oneshot 441, twoshot 273, twoshot-push 264
        //       4M: oneshot 8701, twoshot 4165, twoshot-push 4646
        // Below 64 KiB the rows are scheduling noise (4-8 threads on 2
        // cores); the one-shot is the simplest there. The push two-shot
        // stages only the segments peers reduce.
        BackendKind::Host => vec![step(64 * KIB, OneShot), step(usize::MAX, TwoShotPush)],
        // GPUs: measured on 4x H200 (NV18), bf16 sum, CUDA-graph replay,
        // median us per op (ferrocomm-bench --graph --iters 10 --warmup 3,
        // NCCL 2.x in the same run, NVLS off; 8 MiB slots):
        //
        //  w2       LL    push1  push2   pull1  pull2   NCCL
        //  1K      3.39   5.32   8.01    5.09   8.55    5.89
        //  64K     4.39   6.25   9.11    6.04  11.40    7.22
        //  256K    5.87   6.57   9.41    6.61  12.30    8.55
        //  512K    8.69   7.33   9.96    7.36  12.64   10.10
        //  1M     11.80   8.97  11.29    9.24  13.53   14.03
        //  4M     46.49  20.38  20.84   21.25  22.57   32.93
        //  8M     96.61  35.32  33.07   39.97  36.72   47.80
        //  16M   193.18  63.78  57.63   81.59  74.44   76.50
        //  256M       -  843.9  808.9  1300.1 1186.5   883.7
        //
        //  w4       LL    push1  push2   pull1  pull2   NCCL
        //  1K      3.40   6.33  10.78    5.17  11.56    9.17
        //  64K     5.63   7.54  11.19    6.41  13.77   10.83
        //  128K    6.68   7.59  11.37    7.19  13.99   11.11
        //  256K    8.96   8.52  11.60    8.71  14.44   11.39
        //  512K   14.39  11.20  12.40   12.20  15.10   14.16
        //  1M     28.74  16.24  14.17   17.21  16.89   17.87
        //  16M   463.43 165.92  86.62  188.66 113.60   97.92
        //  256M       - 2424.9 1204.9  3006.0 1810.0  1178.9
        //
        // (LL = OneShotLl, push1/push2 = OneShotPush/TwoShotPush,
        // pull1/pull2 = OneShot/TwoShot.) Worlds 3 and 5..8 were not
        // measured: 3 follows 4; 5..8 halve the one-shot ranges of 4
        // (one-shot traffic grows with world - 1).
        BackendKind::Cuda | BackendKind::Hip => match world {
            0..=2 => vec![
                step(256 * KIB, OneShotLl),
                step(4 * MIB, OneShotPush),
                step(usize::MAX, TwoShotPush),
            ],
            3 | 4 => vec![
                step(128 * KIB, OneShotLl),
                step(512 * KIB, OneShotPush),
                step(usize::MAX, TwoShotPush),
            ],
            _ => vec![
                step(64 * KIB, OneShotLl),
                step(256 * KIB, OneShotPush),
                step(usize::MAX, TwoShotPush),
            ],
        },
    }
}

/// Smallest per-peer block (bytes) `auto` sends to ferrocomm's inbox kernels
/// when NCCL/RCCL is there and may take the call; smaller ones go to the
/// library, except blocks the LL kinds carry, which beat it
/// ([`ll_max_block_bytes`]).
///
/// Measured on 2x H200 (NV18), bf16, CUDA-graph replay, world 2, with the
/// inbox kernels at every size (the bench and method of BENCHMARKS.md,
/// "All-gather, reduce-scatter, all-to-all"; the page's tables show `auto`,
/// which gives these sizes to the LL kinds), kernels / NCCL called directly,
/// us, by the bench's size (all-gather's output, reduce-scatter's input: two
/// blocks; reduce's buffer: one block):
///
/// ```text
///            4K      512K    1M
/// all-gather 6.6/5.5 8.6/8.1 9.4/10.7
/// red-scat.  6.5/5.5 8.3/7.8 8.7/9.9
/// reduce     6.0/4.8 7.7/7.8 8.6/10.7
/// ```
///
/// The kernels' push, flag and copy-out cost about 1 us more than NCCL's
/// small-message path, and win from a 512 KiB block on. Gather and scatter
/// run the same exchange and take the all-gather's threshold; worlds above 2
/// were not measured and take world 2's. All-to-alls have their own rule
/// ([`A2A_VENDOR_MIN_BLOCK_BYTES`]; with splits, no size: the kernels).
pub(crate) const CUSTOM_MIN_BLOCK_BYTES: usize = 512 << 10;

/// Smallest per-peer block (bytes) of an all-to-all without splits (the one
/// kind with an agreed block) that `auto` gives NCCL/RCCL: below it the
/// kernels are level or ahead, above it NCCL's copy is faster.
///
/// Measured on 2x H200 (NV18), bf16, graph replay, world 2, the kernels
/// forced at every size (LL to 256 KiB a peer, then the inbox exchange) /
/// NCCL called directly, us, whole calls (input of 2 blocks), by the
/// per-peer block (the bench and method of BENCHMARKS.md, "All-gather,
/// reduce-scatter, all-to-all", whose table shows `auto`, NCCL from 16 MiB):
///
/// ```text
/// 4M 21.96/24.96   8M 37.14/37.51   16M 67.39/64.17   32M 123.27/110.72
/// ```
pub(crate) const A2A_VENDOR_MIN_BLOCK_BYTES: usize = 16 << 20;

/// Largest agreed per-peer block (bytes) the exchange and the reduce-to
/// take their LL kinds at (`fc_exchange_ll`, `fc_reduce_to_ll_*`; 0: never),
/// unless `CommOptions::coll_ll_bytes` says otherwise; for all-gather,
/// reduce-scatter and all-to-all the first step of the default ladders,
/// which autotune replaces.
///
/// Measured on 2x H200 (NV18), bf16, graph replay, `ferrocomm-bench --coll
/// all_gather,reduce_scatter,reduce --algo auto,nccl --graph` with
/// `FERROCOMM_COLL_ROUTE=custom` and LL forced on or off (the method of
/// BENCHMARKS.md, "All-gather, reduce-scatter, all-to-all"), us, LL / inbox
/// kernels / NCCL called directly, by the per-peer block:
///
/// ```text
///             256K             512K
/// all-gather  5.79/8.63/8.00   8.88/9.39/10.60
/// red-scat.   6.09/8.22/7.87   9.10/8.67/10.01
/// reduce      6.11/7.69/7.92   8.52/8.64/10.87
/// ```
///
/// LL wins to 256 KiB a peer in every row (by more at smaller blocks); at
/// 512 KiB the inbox kinds catch up (reduce-scatter 8.67 against 9.10).
/// World 4, 4x H100 (graph replay, bf16, us, LL / inbox kernels at 128 KiB
/// and 256 KiB a peer: autotune's table against the static one, BENCHMARKS.md,
/// "Autotune at init"): all-gather 7.03 / 10.51, 9.13 / 12.88;
/// reduce-scatter 7.03 / 11.75, 9.27 / 12.02; all-to-all 7.02 / 13.42,
/// 9.16 / 13.69 (NCCL 9.4-13.6); autotune put the LL step at 256 KiB there
/// too.
/// World 3 sits between (not measured); above 4, 32 KiB (not measured).
pub(crate) fn ll_max_block_bytes(world: usize) -> usize {
    match world {
        0..=4 => 256 << 10,
        _ => 32 << 10,
    }
}

/// Smallest agreed per-peer block (bytes) a GPU exchange (all-gather,
/// gather, scatter, all-to-all without splits) takes the direct way at when
/// the communicator has a symmetric heap; [`DIRECT_MIN_REDUCE_TO_BYTES`] for
/// the reduce-to. The host backend takes both whenever there is a heap (so
/// CI runs them at every size); all-to-all-v with splits has no agreed
/// block, and on GPUs stays on the inbox exchange.
///
/// Measured on 2x H200, bf16, graph replay, `FERROCOMM_DIRECT_MIN_BYTES=0
/// ferrocomm-bench --coll all_gather,reduce_scatter,reduce --operands both`
/// (the bench and method of BENCHMARKS.md, "All-gather, reduce-scatter,
/// all-to-all"; the page does not carry this sweep), us, plain operands
/// (inbox kinds, LL below 256 KiB) / heap operands (direct), by per-peer
/// block:
///
/// ```text
///                 512K         1M           2M           8M           16M
/// all-gather      9.41/9.34    10.93/10.91  14.24/14.07  35.33/32.53  65.17/57.66
/// reduce-scatter  8.65/10.44   9.96/11.91   13.63/15.28  34.88/34.33  65.90/60.32
/// ```
///
/// The direct exchange saves the receiver's copy out of its inbox and is
/// level from 512 KiB, ahead from 2 MiB (up to 13% at 16 MiB); it costs one
/// more flag round trip, so it loses where LL carries the block.
pub(crate) const DIRECT_MIN_BLOCK_BYTES: usize = 1 << 20;

/// The direct reduce-to's threshold (see [`DIRECT_MIN_BLOCK_BYTES`]): it
/// pays a second flag round trip and reads peers' memory instead of local
/// inboxes, and wins for reduce-scatter from 8 MiB a peer (1.6% there, 9%
/// at 16 MiB). Reduce (only the root reads) takes the same threshold and
/// loses 4-10% between 8 and 32 MiB, winning ~1.5% from 64 MiB.
pub(crate) const DIRECT_MIN_REDUCE_TO_BYTES: usize = 8 << 20;

impl DispatchTable {
    /// Defaults per backend; autotune at init may replace the ladders of a
    /// communicator's world.
    pub fn default_for(backend: BackendKind) -> Self {
        const MIB: usize = 1024 * 1024;
        let ladders: [Ladders; 9] = std::array::from_fn(|world| Ladders::default_for(backend, world));
        DispatchTable {
            ladders,
            // Never by default: on 4x H200 (BENCHMARKS.md, "All-reduce",
            // "World 4 (4x H200)") two-shot push matches or beats NCCL's
            // busbw at every size up to 256 MiB, so handing large payloads
            // over would only cost determinism.
            // NCCL stays reachable with `algo = vendor` (or `nccl`).
            ccl_min_bytes: usize::MAX,
            qr_min_bytes: std::array::from_fn(|_| match backend {
                // Never by default on the host: there quantizing costs far more
                // than the copies it saves (w4 bf16, 2 cores: 1 MiB two-shot
                // 3.4 ms, quick-reduce int4 44 ms). It stays reachable as
                // `algo = quick-reduce-<codec>`, the reference for GPUs.
                BackendKind::Host => usize::MAX,
                // From 4 MiB every codec matches or beats the push two-shot on
                // H200 (bf16, graph replay, us; BENCHMARKS.md, "Quick-reduce"):
                //   w4  2 MiB: two-shot 19.2, int4 21.0, int8 22.0
                //       4 MiB: two-shot 28.5, int4 25.0, int6 27.9, int8 27.6, fp8 28.8
                //   w2  2 MiB: two-shot 14.7, int4 16.2; 4 MiB: 20.9 vs int4 18.8, int8 19.8
                BackendKind::Cuda | BackendKind::Hip => 4 * MIB,
            }),
        }
    }
}

/// A ladder as `max_bytes:algo` pairs, comma separated (`max` for the last step).
pub(crate) fn encode_ladder<A: std::fmt::Display>(ladder: &[Step<A>]) -> String {
    ladder
        .iter()
        .map(|s| match s.max_bytes {
            usize::MAX => format!("max:{}", s.algo),
            b => format!("{b}:{}", s.algo),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The table as text, one line per collective and dtype class:
/// `<collective> <class> <max_bytes>:<algo>,...,max:<algo>`, e.g.
/// `all_reduce narrow 262144:oneshot-ll,4194304:oneshot-push,max:twoshot-push`
/// or `all_gather wide 262144:ll,524287:vendor,max:inbox`. All-reduce names
/// [`Algorithm`]s: ferrocomm's kernels for all-reduce, the data kinds for the others;
/// all-reduce counts the payload, the others bytes per peer.
pub(crate) fn encode(table: &Ladders) -> String {
    let mut lines = Vec::new();
    for coll in Collective::TUNED {
        for class in DtypeClass::ALL {
            let ladder = match coll {
                Collective::AllReduce => encode_ladder(table.all_reduce(class)),
                c => encode_ladder(table.coll(c, class)),
            };
            lines.push(format!("{coll} {class} {ladder}"));
        }
    }
    lines.join("\n")
}

/// One ladder of `algo`s parsed by `parse`.
fn decode_ladder<A>(s: &str, parse: impl Fn(&str) -> Result<A>) -> Result<Vec<Step<A>>> {
    let bad = || Error::invalid(format!("autotune ladder {s:?} is not `bytes:algo,...,max:algo`"));
    let ladder = s
        .split(',')
        .map(|step| {
            let (b, a) = step.split_once(':').ok_or_else(bad)?;
            let max_bytes = match b {
                "max" => usize::MAX,
                b => b.parse().map_err(|_| bad())?,
            };
            Ok(Step {
                max_bytes,
                algo: parse(a)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if !well_formed(&ladder) {
        return Err(bad());
    }
    Ok(ladder)
}

/// [`encode`]'s text back: every (collective, class) exactly once, every
/// ladder well formed, all-reduce on ferrocomm's kernels; anything else is
/// an error (a cached file that says it is read as no cache).
pub(crate) fn decode(s: &str) -> Result<Ladders> {
    let mut table = Ladders {
        all_reduce: [Vec::new(), Vec::new()],
        all_gather: [Vec::new(), Vec::new()],
        reduce_scatter: [Vec::new(), Vec::new()],
        all_to_all: [Vec::new(), Vec::new()],
    };
    let mut seen = HashSet::new();
    for line in s.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let bad = || {
            Error::invalid(format!(
                "autotune table line {line:?} is not `<collective> <class> <ladder>`"
            ))
        };
        let mut words = line.split_whitespace();
        let (Some(coll), Some(class), Some(ladder), None) = (words.next(), words.next(), words.next(), words.next())
        else {
            return Err(bad());
        };
        let (coll, class) = (coll.parse::<Collective>()?, class.parse::<DtypeClass>()?);
        if !Collective::TUNED.contains(&coll) {
            return Err(Error::invalid(format!("autotune table: {coll} has no ladder")));
        }
        if !seen.insert((coll, class)) {
            return Err(Error::invalid(format!("autotune table: {coll} {class} twice")));
        }
        match table.coll_mut(coll, class) {
            Some(slot) => {
                *slot = decode_ladder(ladder, |a| match a.parse::<Algorithm>()? {
                    algo if Algorithm::DATA_KINDS.contains(&algo) => Ok(algo),
                    other => Err(Error::invalid(format!("{other} in an autotune {coll} ladder"))),
                })?
            }
            None => {
                table.all_reduce[class.index()] = decode_ladder(ladder, |a| match a.parse::<Algorithm>()? {
                    algo if Algorithm::ALL_REDUCE_KERNELS.contains(&algo) => Ok(algo),
                    _ => Err(Error::invalid(format!(
                        "autotune table: all-reduce step {a:?} is not one of ferrocomm's kernels"
                    ))),
                })?
            }
        }
    }
    if seen.len() != Collective::TUNED.len() * DtypeClass::ALL.len() {
        return Err(Error::invalid(format!(
            "autotune table has {} of the {} ladders",
            seen.len(),
            Collective::TUNED.len() * DtypeClass::ALL.len()
        )));
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_world_has_an_unbounded_last_step() {
        for backend in [BackendKind::Host, BackendKind::Cuda, BackendKind::Hip] {
            let t = DispatchTable::default_for(backend);
            for world in 2..=8 {
                assert!(t.ladders[world].well_formed(), "{backend:?} world {world}");
            }
        }
    }

    #[test]
    fn dtype_classes_go_by_element_size() {
        for d in DType::ALL {
            let want = if d.size() <= 2 {
                DtypeClass::Narrow
            } else {
                DtypeClass::Wide
            };
            assert_eq!(DtypeClass::of(d), want, "{d}");
        }
        for c in DtypeClass::ALL {
            assert_eq!(DtypeClass::of(c.representative()), c);
            assert_eq!(DtypeClass::ALL[c.index()], c);
            assert_eq!(c.name().parse::<DtypeClass>().unwrap(), c);
        }
    }
}
