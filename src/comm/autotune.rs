//! Autotune at init: every rank of a new communicator times the candidate
//! algorithms of each collective that has more than one, per (collective,
//! size, dtype class), at a plan fixed before it runs; rank 0's medians pick
//! the fastest per size, and every rank adopts rank 0's table (so all ranks
//! dispatch alike). The result is cached on disk under a key of what it
//! depends on (device, arch, world, topology, slot size, the deterministic
//! option, driver and library versions), so later runs only read it.
//!
//! What is tuned, for this communicator's world (`DispatchTable::ladders`):
//! - all-reduce: ferrocomm's five kernels by payload, per dtype class
//!   (measured with bf16 and f32 sums);
//! - all-gather, reduce-scatter and all-to-all without splits: LL, inbox
//!   or NCCL/RCCL (the data kinds of [`Algorithm`]) by bytes per peer. Reduce-scatter per dtype
//!   class (bf16 and f32 sums); all-gather and all-to-all move bytes
//!   whatever the dtype, so one measurement (bf16) serves both classes.
//!
//! A candidate is measured only where it can run and may be chosen: LL up to
//! what its lines carry (and not where bandwidth rules), NCCL/RCCL only where
//! the library loaded, and never for a reduce-scatter of a deterministic
//! communicator (its sums are not the reference's bits). Each candidate is
//! forced per call (`Call::algo`, `Call::coll_algo`); dispatch then reads
//! the table, and explicit choices still win over it (`Call`'s docs).
//!
//! The plan is fixed before it runs: every rank runs the same collectives
//! (they are collectives: no rank may stop early on its own clock), from
//! what all ranks share and rank 0's deterministic option. It is sized to
//! take well under the 2 s budget on 2x H200 ([`plan`] counts the ops); the
//! report says how long it took, and a run past the budget is logged.
//!
//! On by default on GPUs, off on the host backend (the reference, whose
//! tests create hundreds of communicators); `FERROCOMM_AUTOTUNE=0|1` or
//! [`CommOptions::with_autotune`](super::CommOptions::with_autotune) decide.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::call::Call;
use super::communicator::Communicator;
use super::tensor::Tensor;
use super::work::Work;
use crate::algo::kernels::{kernel_name, KernelKind};
use crate::algo::layout::ll_capacity;
use crate::bootstrap::store_all_gather;
use crate::device::{BackendKind, Device};
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};
use crate::plan::{step_for, well_formed, Algorithm, Collective, DtypeClass, Ladders, Step};

/// Where a communicator's dispatch table came from.
#[derive(Debug, Clone, PartialEq)]
pub enum TuneSource {
    /// Measured at init (rank 0's timings), taking this long.
    Measured(Duration),
    /// Read from the cache file of an earlier measurement (rank 0's).
    Cached(PathBuf),
    /// Adopted from an earlier communicator of the same shape in this
    /// process (rank 0's), the cache directory being off.
    Remembered,
}

/// One measurement: a rank's median of one candidate at one size.
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    pub collective: Collective,
    /// The class measured (all-gather and all-to-all: narrow, for both).
    pub class: DtypeClass,
    /// The payload for all-reduce, bytes per peer for the others.
    pub bytes: usize,
    /// The candidate's name ([`Algorithm::name`]).
    pub candidate: &'static str,
    pub median_us: f64,
}

/// What autotune chose, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneReport {
    pub source: TuneSource,
    /// The ladders in force for this communicator's world: per collective,
    /// per dtype class.
    pub table: Ladders,
    /// This rank's medians when measured (rank 0's chose the table; empty
    /// when read from the cache).
    pub timings: Vec<Timing>,
}

impl TuneReport {
    /// The table in force, one line per collective and dtype class (the
    /// cache file's format), for logs and benches.
    pub fn table_text(&self) -> String {
        encode(&self.table)
    }
}

/// One size of one collective and class, and the candidates timed there.
#[derive(Debug, Clone, PartialEq)]
struct Case {
    coll: Collective,
    class: DtypeClass,
    /// The payload (all-reduce) or bytes per peer.
    bytes: usize,
    candidates: Vec<Algorithm>,
}

/// What the plan depends on; the same on every rank (the deterministic
/// option is rank 0's).
#[derive(Debug, Clone, Copy)]
struct PlanFacts {
    backend: BackendKind,
    /// Largest block one source's LL lines carry ([`ll_capacity`]).
    ll_room: usize,
    /// NCCL/RCCL loaded (on every rank, or the communicator failed at init).
    vendor: bool,
    deterministic: bool,
}

/// LL carries 8 data bytes per 16-byte line: past 1 MiB a peer it never won
/// on H200 (2x: inbox level at 512 KiB; the LL all-reduce's ladder stops at
/// 256 KiB), so it is not timed where bandwidth rules.
const LL_COLL_MAX_BYTES: usize = 1 << 20;
/// The LL all-reduce likewise (its worst win was 256 KiB, at world 2).
const LL_AR_MAX_BYTES: usize = 4 << 20;

/// Calls in one captured graph: several where a call is short, so one
/// replay's launch is spread over them; one where the call itself takes
/// tens of microseconds or more.
fn graph_ops(bytes: usize) -> usize {
    if bytes <= 1 << 20 {
        4
    } else {
        1
    }
}

/// Untimed runs before, and timed runs of, each candidate at each size.
fn iterations(backend: BackendKind) -> (usize, usize) {
    match backend {
        // The reference, timed in CI on 2 cores: enough to rank, no more.
        BackendKind::Host => (1, 3),
        _ => (2, 5),
    }
}

/// The cases timed, in order (every rank builds the same list); a
/// measurement is one candidate at one case's size.
///
/// GPUs: all-reduce at 1, 4 and 16 KiB, every 2x from 64 KiB to 16 MiB
/// (the default ladder turns at 128 KiB-4 MiB on H200) and 64 MiB (13
/// sizes) x the five kernels (LL to 4 MiB) x two dtype classes: 124
/// measurements. All-gather, reduce-scatter and
/// all-to-all at 4 KiB-16 MiB a peer, every 4x (7 sizes) x LL (to 1 MiB a
/// peer, within the lines: 5 sizes at 32 MiB slots for worlds 2-8), inbox
/// and NCCL/RCCL (where it may run): all-gather 19, reduce-scatter 2 x 12
/// (2 x 19 when not deterministic), all-to-all 19. So 186 measurements
/// (200; 172 without NCCL/RCCL). Each is one eager call (it loads, and
/// connects NCCL on its first use, outside any capture), then a graph of
/// [`graph_ops`] calls captured and replayed 2 + 5 times (the 5 timed):
/// graph replay is how engines run small collectives, and eager timing
/// measured the CPU's launch instead (on 4x H100 at world 2 it picked the
/// push one-shot over LL at 8-16 KiB, 47-61% slower under replay). The
/// large sizes dominate (64 MiB all-reduce ~0.2-0.35 ms). Measured at init
/// on 4x H100 with the kernels from the disk cache: 0.48 s at world 2,
/// 1.64 s at world 4 (NCCL's first connections included).
///
/// Host: all-reduce at 4 KiB-1 MiB (5 sizes, every 4x) x 5 x 2 classes, and
/// the others at 4 KiB-256 KiB a peer (4 sizes) x LL (where it fits) and
/// inbox: at most 82 measurements of 1 + 3 runs.
fn plan(f: &PlanFacts) -> Vec<Case> {
    let host = f.backend == BackendKind::Host;
    let every_4x = |lo: u32, hi: u32| (lo..=hi).step_by(2).map(|s| 1usize << s).collect::<Vec<_>>();
    let (ar_sizes, coll_sizes) = match host {
        // Memory-bound copies; the all-reduce ladder turns below 1 MiB.
        true => (every_4x(12, 20), every_4x(12, 18)),
        // Every 2x from 64 KiB to 16 MiB, where the ladder turns (LL to
        // push to two-shot): at 4x steps a turn between two measured sizes
        // went to the larger size's winner (on 4x H100 the table ran
        // two-shot at 512 KiB, 13% slower than the static one-shot push).
        false => {
            let mut s = every_4x(10, 14);
            s.extend((16..=24).map(|s| 1usize << s));
            s.push(1 << 26);
            (s, every_4x(12, 24))
        }
    };
    let mut cases = Vec::new();
    for class in DtypeClass::ALL {
        for &bytes in &ar_sizes {
            let mut c: Vec<Algorithm> = [
                Algorithm::OneShot,
                Algorithm::TwoShot,
                Algorithm::OneShotPush,
                Algorithm::TwoShotPush,
            ]
            .to_vec();
            if bytes <= LL_AR_MAX_BYTES {
                c.push(Algorithm::OneShotLl);
            }
            cases.push(Case {
                coll: Collective::AllReduce,
                class,
                bytes,
                candidates: c,
            });
        }
    }
    for coll in [Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll] {
        let classes: &[DtypeClass] = match coll.reduces() {
            true => &DtypeClass::ALL,
            false => &[DtypeClass::Narrow],
        };
        for &class in classes {
            for &bytes in &coll_sizes {
                let mut c = Vec::new();
                if bytes <= f.ll_room.min(LL_COLL_MAX_BYTES) {
                    c.push(Algorithm::Ll);
                }
                c.push(Algorithm::Inbox);
                if f.vendor && !(coll == Collective::ReduceScatter && f.deterministic) {
                    c.push(Algorithm::Vendor);
                }
                cases.push(Case {
                    coll,
                    class,
                    bytes,
                    candidates: c,
                });
            }
        }
    }
    cases
}

/// The whole autotune budget at init (issue 15): logged when exceeded.
const BUDGET: Duration = Duration::from_secs(2);

/// Tune `comm`'s dispatch table. Collective over `comm`.
pub(crate) fn tune<D: Device>(comm: &Communicator<D>) -> Result<TuneReport> {
    let started = Instant::now();
    let inner = &*comm.inner;
    let key = cache_key(comm);
    let file = crate::cache::cache_dir().map(|d| d.join("autotune").join(format!("{:016x}.txt", fnv64(&key))));
    // Rank 0 decides: its cached table, or measure now (with its
    // deterministic option, so that every rank plans alike).
    let mine = match comm.rank() {
        0 => match &file {
            Some(f) => read_cached(f, &key),
            None => remembered(&key),
        }
        .map(|t| format!("cached\n{}", encode(&t))),
        _ => None,
    }
    .unwrap_or_else(|| format!("measure deterministic={}", u8::from(inner.opts.deterministic)));
    let decision = agree(comm, "decide", mine.as_bytes())?;
    if let Some(table) = decision.strip_prefix("cached\n") {
        return Ok(TuneReport {
            source: file.map_or(TuneSource::Remembered, TuneSource::Cached),
            table: decode(table)?,
            timings: Vec::new(),
        });
    }
    let deterministic = match decision.as_str() {
        "measure deterministic=1" => true,
        "measure deterministic=0" => false,
        other => return Err(Error::invalid(format!("autotune: rank 0 sent {other:?}"))),
    };
    let backend = inner.device.facts().backend;
    let (ll_room, vendor) = comm.with_resources(|r| {
        let room = r.ws.as_ref().map_or(0, |ws| ll_capacity(ws.slot_bytes(), inner.world));
        (room, r.vendor.available())
    })?;
    let facts = PlanFacts {
        backend,
        ll_room,
        vendor: vendor && backend != BackendKind::Host,
        deterministic,
    };
    let cases = plan(&facts);
    let measured = measure(comm, &cases)?;
    let world = inner.world.min(crate::device::MAX_RANKS);
    let defaults = Ladders::default_for(backend, world);
    let table = table_from(&measured, &defaults);
    let chosen = agree(comm, "table", encode(&table).as_bytes())?;
    let table = decode(&chosen)?;
    if file.is_none() {
        remember(&key, &table);
    }
    if comm.rank() == 0 {
        if let Some(f) = &file {
            if let Err(e) = write_cached(f, &key, &table) {
                crate::fc_log!(
                    tracing::Level::WARN,
                    "autotune: could not cache the table at {}: {e}",
                    f.display()
                );
            }
        }
    }
    let took = started.elapsed();
    if took > BUDGET {
        crate::fc_log!(
            tracing::Level::WARN,
            "autotune of communicator {} took {:.2} s, over its {} s budget ({} measurements)",
            inner.name,
            took.as_secs_f64(),
            BUDGET.as_secs(),
            measured.len()
        );
    }
    let timings = measured
        .into_iter()
        .map(|m| Timing {
            collective: m.coll,
            class: m.class,
            bytes: m.bytes,
            candidate: m.candidate.name(),
            median_us: m.us,
        })
        .collect();
    Ok(TuneReport {
        source: TuneSource::Measured(took),
        table,
        timings,
    })
}

/// Rank 0's `value`, as every rank receives it.
fn agree<D: Device>(comm: &Communicator<D>, what: &str, value: &[u8]) -> Result<String> {
    let inner = &*comm.inner;
    let key = inner.next_key(&format!("autotune-{what}"));
    let all = store_all_gather(
        inner.store.as_ref(),
        &key,
        inner.rank,
        inner.world,
        value,
        inner.opts.timeout,
    )?;
    String::from_utf8(all[0].clone()).map_err(|_| Error::invalid("autotune: rank 0 sent a table that is not text"))
}

/// One rank-local median.
#[derive(Debug, Clone, Copy)]
struct Measured {
    coll: Collective,
    class: DtypeClass,
    bytes: usize,
    candidate: Algorithm,
    us: f64,
}

/// Every kernel the plan launches, so that no measurement waits for a
/// compile (they are the ones later calls need anyway).
fn kernels_of(cases: &[Case]) -> Vec<String> {
    let mut names = Vec::new();
    let mut add = |n: String| {
        if !names.contains(&n) {
            names.push(n);
        }
    };
    for case in cases {
        let dtype = case.class.representative();
        for c in &case.candidates {
            let kind = match (case.coll, c) {
                (Collective::AllReduce, a) => a.all_reduce_kind(),
                (_, Algorithm::Vendor) => None,
                (Collective::ReduceScatter, Algorithm::Ll) => Some(KernelKind::ReduceToLl),
                (Collective::ReduceScatter, _) => Some(KernelKind::ReduceTo),
                (_, Algorithm::Ll) => Some(KernelKind::ExchangeLl),
                (_, _) => Some(KernelKind::Exchange),
            };
            if let Some(kind) = kind {
                add(kernel_name(kind, dtype, ReduceOp::Sum));
            }
        }
    }
    names
}

/// Time every candidate of the plan; rank-local medians in microseconds.
fn measure<D: Device>(comm: &Communicator<D>, cases: &[Case]) -> Result<Vec<Measured>> {
    let inner = &*comm.inner;
    let dev = &inner.device;
    let world = inner.world;
    let (warmup, iters) = iterations(dev.facts().backend);
    let prepare_started = Instant::now();
    let names = kernels_of(cases);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    comm.with_resources(|res| dev.prepare(&res.module, &names))??;
    let prepared = prepare_started.elapsed();
    // `a`: the all-reduce's buffer and the others' outputs; `b`: their inputs.
    let (mut a_len, mut b_len) = (0usize, 0usize);
    for c in cases {
        match c.coll {
            Collective::AllReduce => a_len = a_len.max(c.bytes),
            _ => {
                a_len = a_len.max(c.bytes * world);
                b_len = b_len.max(c.bytes * world);
            }
        }
    }
    let a = comm.alloc(a_len.max(1))?;
    let b = comm.alloc(b_len.max(1))?;
    let stream = comm.stream();
    let events: Vec<(D::Event, D::Event)> = (0..iters)
        .map(|_| Ok((dev.create_event()?, dev.create_event()?)))
        .collect::<Result<_>>()?;
    let run = |case: &Case, call: &Call<'_, D>| -> Result<Work<D>> {
        let dtype = case.class.representative();
        let n = case.bytes / dtype.size();
        let ta = Tensor::of(&a, dtype);
        let tb = Tensor::of(&b, dtype);
        match case.coll {
            Collective::AllReduce => comm.all_reduce(ta.slice(0, n)?, ReduceOp::Sum, call),
            Collective::AllGather => comm.all_gather_single(ta.slice(0, n * world)?, tb.slice(0, n)?, call),
            Collective::ReduceScatter => {
                comm.reduce_scatter_single(ta.slice(0, n)?, tb.slice(0, n * world)?, ReduceOp::Sum, call)
            }
            Collective::AllToAll => comm.all_to_all_single(ta.slice(0, n * world)?, tb.slice(0, n * world)?, call),
            other => Err(Error::invalid(format!("autotune has no ladder for {other}"))),
        }
    };
    let mut out = Vec::new();
    for case in cases {
        for &candidate in &case.candidates {
            let call = match candidate {
                algo if case.coll == Collective::AllReduce => Call::on(stream).algo(algo),
                kind => Call::on(stream).coll_algo(kind),
            };
            // One eager call loads what the candidate needs (and connects
            // NCCL) outside the capture; then a graph of `ops` calls.
            run(case, &call)?.wait(None)?;
            dev.synchronize(stream)?;
            let ops = graph_ops(case.bytes);
            dev.begin_capture(stream)?;
            let captured = (0..ops).try_for_each(|_| run(case, &call).map(drop));
            let graph = dev.end_capture(stream)?;
            captured?;
            for _ in 0..warmup {
                dev.launch_graph(&graph, stream)?;
            }
            for (start, end) in &events {
                dev.record(start, stream)?;
                dev.launch_graph(&graph, stream)?;
                dev.record(end, stream)?;
            }
            dev.synchronize(stream)?;
            let mut samples = events
                .iter()
                .map(|(start, end)| Ok(dev.elapsed_ms(start, end)? as f64 * 1000.0 / ops as f64))
                .collect::<Result<Vec<f64>>>()?;
            samples.sort_by(f64::total_cmp);
            out.push(Measured {
                coll: case.coll,
                class: case.class,
                bytes: case.bytes,
                candidate,
                us: samples[samples.len() / 2],
            });
        }
    }
    crate::fc_log!(
        tracing::Level::INFO,
        "autotune of communicator {}: {} kernels prepared in {:.3} s, {} measurements in {:.3} s",
        inner.name,
        names.len(),
        prepared.as_secs_f64(),
        out.len(),
        (prepare_started.elapsed() - prepared).as_secs_f64()
    );
    Ok(out)
}

/// The table the timings pick: for each (collective, class) measured, the
/// fastest per size as a ladder; all-gather and all-to-all (measured in one
/// class) the same for both; anything not measured keeps `defaults`.
fn table_from(measured: &[Measured], defaults: &Ladders) -> Ladders {
    let mut table = defaults.clone();
    for class in DtypeClass::ALL {
        let rows: Vec<(usize, Algorithm, f64)> = measured
            .iter()
            .filter(|m| m.coll == Collective::AllReduce && m.class == class)
            .map(|m| (m.bytes, m.candidate, m.us))
            .collect();
        if !rows.is_empty() {
            let static_choice = |b: usize| step_for(defaults.all_reduce(class), b).map(|s| s.algo);
            table.all_reduce[class.index()] = ladder_from(&rows, Algorithm::TwoShotPush, static_choice);
        }
        for coll in [Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll] {
            let rows: Vec<(usize, Algorithm, f64)> = measured
                .iter()
                .filter(|m| m.coll == coll && (m.class == class || !coll.reduces()))
                .map(|m| (m.bytes, m.candidate, m.us))
                .collect();
            let static_choice = |b: usize| step_for(defaults.coll(coll, class), b).map(|s| s.algo);
            let tuned = ladder_from(&rows, Algorithm::Inbox, static_choice);
            if let (false, Some(ladder)) = (rows.is_empty(), table.coll_mut(coll, class)) {
                *ladder = tuned;
            }
        }
    }
    table
}

/// A candidate must beat the static table's choice by this fraction to
/// replace it: closer timings are noise (run to run, the same kernel moves
/// by 1-3% under graph replay), and a tie keeps what the static table was
/// measured to do.
const TIE: f64 = 0.03;

/// The fastest candidate per size as a ladder: each measured size's winner
/// runs up to that size, the last one beyond it (`last` when nothing was
/// measured). `static_choice(b)` keeps its size unless beaten by [`TIE`].
fn ladder_from<A: Copy + PartialEq>(
    timings: &[(usize, A, f64)],
    last: A,
    static_choice: impl Fn(usize) -> Option<A>,
) -> Vec<Step<A>> {
    let mut sizes: Vec<usize> = timings.iter().map(|t| t.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut ladder: Vec<Step<A>> = Vec::new();
    for &b in &sizes {
        let at_b = || timings.iter().filter(|t| t.0 == b);
        let fastest = at_b().min_by(|x, y| x.2.total_cmp(&y.2));
        let kept = static_choice(b).and_then(|a| at_b().find(|t| t.1 == a));
        let best = match (fastest, kept) {
            (Some(f), Some(k)) if k.2 <= f.2 * (1.0 + TIE) => k.1,
            (Some(f), _) => f.1,
            (None, _) => last,
        };
        match ladder.last_mut() {
            Some(prev) if prev.algo == best => prev.max_bytes = b,
            _ => ladder.push(Step {
                max_bytes: b,
                algo: best,
            }),
        }
    }
    match ladder.last_mut() {
        Some(prev) => prev.max_bytes = usize::MAX,
        None => ladder.push(Step {
            max_bytes: usize::MAX,
            algo: last,
        }),
    }
    ladder
}

/// A ladder as `max_bytes:algo` pairs, comma separated (`max` for the last step).
fn encode_ladder<A: std::fmt::Display>(ladder: &[Step<A>]) -> String {
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

/// What a table depends on. The version tag changes whenever the table's
/// format or meaning does, so older files are not read (they are measured
/// over: a key that differs is no cache).
fn cache_key<D: Device>(comm: &Communicator<D>) -> String {
    let inner = &*comm.inner;
    let f = inner.device.facts();
    format!(
        "ferrocomm {} autotune v2; deterministic {}; {} {} {} {} SMs; world {} on {}; slot {}; {}; NCCL/RCCL {}",
        env!("CARGO_PKG_VERSION"),
        u8::from(inner.opts.deterministic),
        f.backend.name(),
        f.name,
        f.arch,
        f.multiprocessors,
        inner.world,
        inner.topology.describe(),
        inner.opts.slot_bytes_for(f.backend),
        inner.device.versions(),
        comm.with_resources(|r| r.vendor.describe()).unwrap_or_default(),
    )
}

/// Tables measured in this process, by cache key, where the cache directory
/// is off (the file is the cache otherwise): a communicator created again,
/// or a sub-communicator of a shape measured before, adopts one without
/// measuring.
fn memo() -> &'static std::sync::Mutex<std::collections::HashMap<String, Ladders>> {
    static MEMO: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, Ladders>>> =
        std::sync::OnceLock::new();
    MEMO.get_or_init(Default::default)
}

fn remembered(key: &str) -> Option<Ladders> {
    memo().lock().unwrap_or_else(|e| e.into_inner()).get(key).cloned()
}

fn remember(key: &str, table: &Ladders) {
    memo()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key.to_string(), table.clone());
}

fn fnv64(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The cached table, if the file is ours (owned by us, not writable by
/// group or others), for this key, and well formed. Anything else (another
/// version's file, a foreign or corrupt one) is no cache: measure again.
fn read_cached(path: &PathBuf, key: &str) -> Option<Ladders> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o022 != 0 {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let (k, table) = text.split_once('\n')?;
    if k != key {
        return None;
    }
    match decode(table) {
        Ok(t) => Some(t),
        Err(e) => {
            crate::fc_log!(
                tracing::Level::WARN,
                "autotune: ignoring the cached table at {}: {e}",
                path.display()
            );
            None
        }
    }
}

fn write_cached(path: &PathBuf, key: &str, table: &Ladders) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = path.parent().unwrap_or(path);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    writeln!(f, "{key}")?;
    writeln!(f, "{}", encode(table))?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_facts(world: usize, vendor: bool, deterministic: bool) -> PlanFacts {
        PlanFacts {
            backend: BackendKind::Cuda,
            ll_room: ll_capacity(32 << 20, world),
            vendor,
            deterministic,
        }
    }

    #[test]
    fn tables_encode_and_decode() {
        for backend in [BackendKind::Host, BackendKind::Cuda] {
            for world in 2..=8 {
                let t = Ladders::default_for(backend, world);
                let text = encode(&t);
                assert_eq!(text.lines().count(), 8, "{text}");
                assert_eq!(decode(&text).unwrap(), t);
            }
        }
        let mut t = Ladders::default_for(BackendKind::Cuda, 2);
        t.all_reduce[1] = vec![Step {
            max_bytes: usize::MAX,
            algo: Algorithm::OneShot,
        }];
        t.reduce_scatter[0] = vec![
            Step {
                max_bytes: 4096,
                algo: Algorithm::Ll,
            },
            Step {
                max_bytes: usize::MAX,
                algo: Algorithm::Inbox,
            },
        ];
        let text = encode(&t);
        assert!(text.contains("all_reduce wide max:oneshot\n"), "{text}");
        assert!(text.contains("reduce_scatter narrow 4096:ll,max:inbox\n"), "{text}");
        assert!(
            text.contains("all_gather narrow 262144:ll,524287:vendor,max:inbox"),
            "{text}"
        );
        assert_eq!(decode(&text).unwrap(), t);
        // Blank lines and surrounding space are fine; order is free.
        let shuffled: Vec<&str> = text.lines().rev().collect();
        assert_eq!(decode(&format!("\n{}\n\n", shuffled.join("\n  \n"))).unwrap(), t);
    }

    #[test]
    fn bad_tables_are_errors() {
        let good = encode(&Ladders::default_for(BackendKind::Cuda, 4));
        let with = |from: &str, to: &str| {
            assert!(good.contains(from), "{from}");
            good.replacen(from, to, 1)
        };
        let cases = [
            // A ladder that is not unbounded, not increasing, or names an
            // algorithm its collective does not have.
            with("all_reduce narrow 131072:oneshot-ll", "all_reduce narrow 131072:nccl"),
            with(
                "all_reduce wide 131072:oneshot-ll,524288:oneshot-push,max:twoshot-push",
                "all_reduce wide 4096:oneshot",
            ),
            with(
                "all_gather narrow 262144:ll,524287:vendor",
                "all_gather narrow 524287:ll,262144:vendor",
            ),
            with("all_to_all wide 262144:ll", "all_to_all wide 65536:oneshot-ll"),
            with("reduce_scatter narrow 262144:ll", "reduce_scatter narrow 65536:fast"),
            // Unknown names, a ladder twice or missing, stray words.
            with("all_to_all wide", "all_to_all medium"),
            with("all_to_all wide", "all_to_all narrow"),
            with("reduce_scatter wide", "broadcast wide"),
            with("all_gather wide 262144:ll", "all_gather wide 262144:ll extra"),
            good.lines().skip(1).collect::<Vec<_>>().join("\n"),
            // A v1 file's ladder alone.
            "4096:oneshot-ll,max:twoshot-push".into(),
            String::new(),
        ];
        for (k, text) in cases.iter().enumerate() {
            assert!(decode(text).is_err(), "case {k}: {text}");
        }
    }

    #[test]
    fn the_fastest_per_size_makes_the_ladder() {
        use Algorithm::*;
        let t = [
            (1024, OneShotLl, 3.0),
            (1024, OneShotPush, 5.0),
            (4096, OneShotLl, 3.5),
            (4096, OneShotPush, 5.0),
            (16384, OneShotLl, 9.0),
            (16384, OneShotPush, 6.0),
            (65536, TwoShotPush, 7.0),
            (65536, OneShotPush, 8.0),
        ];
        let l = ladder_from(&t, TwoShotPush, |_| None);
        assert_eq!(encode_ladder(&l), "4096:oneshot-ll,16384:oneshot-push,max:twoshot-push");
        assert_eq!(
            encode_ladder(&ladder_from::<Algorithm>(&[], Algorithm::Inbox, |_| None)),
            "max:inbox"
        );
    }

    #[test]
    fn the_static_choice_keeps_its_size_unless_beaten_by_more_than_a_tie() {
        use Algorithm::*;
        let t = [
            (4096, OneShotLl, 3.0),
            (4096, OneShotPush, 3.05),
            (65536, OneShotLl, 5.0),
            (65536, OneShotPush, 6.0),
        ];
        // Push within 3% at 4 KiB stays; LL 17% faster at 64 KiB wins.
        let l = ladder_from(&t, TwoShotPush, |_| Some(OneShotPush));
        assert_eq!(encode_ladder(&l), "4096:oneshot-push,max:oneshot-ll");
        // A static choice that was not measured there keeps nothing.
        let l = ladder_from(&t, TwoShotPush, |_| Some(TwoShot));
        assert_eq!(encode_ladder(&l), "max:oneshot-ll");
    }

    #[test]
    fn timings_make_a_table_per_collective_and_class() {
        let m = |coll, class, bytes, candidate, us| Measured {
            coll,
            class,
            bytes,
            candidate,
            us,
        };
        use Collective::*;
        use DtypeClass::*;
        let measured = [
            m(AllReduce, Narrow, 4096, Algorithm::OneShotLl, 3.0),
            m(AllReduce, Narrow, 4096, Algorithm::OneShot, 4.0),
            m(AllReduce, Wide, 4096, Algorithm::OneShotLl, 5.0),
            m(AllReduce, Wide, 4096, Algorithm::OneShot, 4.0),
            m(AllGather, Narrow, 4096, Algorithm::Ll, 2.0),
            m(AllGather, Narrow, 4096, Algorithm::Vendor, 3.0),
            m(AllGather, Narrow, 1 << 20, Algorithm::Inbox, 9.0),
            m(AllGather, Narrow, 1 << 20, Algorithm::Vendor, 8.0),
            m(ReduceScatter, Narrow, 4096, Algorithm::Ll, 2.0),
            m(ReduceScatter, Narrow, 4096, Algorithm::Inbox, 3.0),
            m(ReduceScatter, Wide, 4096, Algorithm::Ll, 4.0),
            m(ReduceScatter, Wide, 4096, Algorithm::Inbox, 3.0),
        ];
        let defaults = Ladders::default_for(BackendKind::Cuda, 2);
        let t = table_from(&measured, &defaults);
        assert_eq!(encode_ladder(t.all_reduce(Narrow)), "max:oneshot-ll");
        assert_eq!(encode_ladder(t.all_reduce(Wide)), "max:oneshot");
        for class in DtypeClass::ALL {
            assert_eq!(encode_ladder(t.coll(AllGather, class)), "4096:ll,max:vendor");
            // Not measured: the defaults.
            assert_eq!(t.coll(AllToAll, class), defaults.coll(AllToAll, class));
        }
        assert_eq!(encode_ladder(t.coll(ReduceScatter, Narrow)), "max:ll");
        assert_eq!(encode_ladder(t.coll(ReduceScatter, Wide)), "max:inbox");
        assert!(t.well_formed());
    }

    #[test]
    fn the_plan_measures_only_what_can_run_and_fits_the_budget() {
        for world in 2..=8 {
            for vendor in [false, true] {
                for det in [false, true] {
                    let f = gpu_facts(world, vendor, det);
                    let cases = plan(&f);
                    for c in &cases {
                        for cand in &c.candidates {
                            match cand {
                                a if c.coll == Collective::AllReduce => {
                                    assert!(Algorithm::ALL_REDUCE_KERNELS.contains(a));
                                    assert!(*a != Algorithm::OneShotLl || c.bytes <= LL_AR_MAX_BYTES);
                                }
                                Algorithm::Ll => assert!(c.bytes <= f.ll_room, "{c:?}"),
                                Algorithm::Vendor => {
                                    assert!(vendor);
                                    assert!(!(det && c.coll == Collective::ReduceScatter), "{c:?}");
                                }
                                a => assert_eq!(*a, Algorithm::Inbox),
                            }
                        }
                    }
                    // The counts of the doc comment.
                    let n: usize = cases.iter().map(|c| c.candidates.len()).sum();
                    let want = match (vendor, det) {
                        (true, true) => 186,
                        (true, false) => 200,
                        (false, _) => 172,
                    };
                    assert_eq!(n, want, "world {world} vendor {vendor} det {det}");
                    let (warmup, iters) = iterations(BackendKind::Cuda);
                    let ops: usize = cases
                        .iter()
                        .map(|c| c.candidates.len() * (1 + graph_ops(c.bytes) * (warmup + iters)))
                        .sum();
                    assert!(ops <= 5000, "{ops} ops");
                }
            }
        }
        let host = PlanFacts {
            backend: BackendKind::Host,
            ll_room: ll_capacity(8 << 20, 2),
            vendor: false,
            deterministic: true,
        };
        let cases = plan(&host);
        assert_eq!(cases.len(), 5 * 2 + 4 * 4);
        let ops: usize = cases.iter().map(|c| c.candidates.len()).sum();
        assert_eq!(ops, 5 * 5 * 2 + 4 * 2 * 4);
        assert!(cases
            .iter()
            .flat_map(|c| &c.candidates)
            .all(|c| *c != Algorithm::Vendor));
    }

    #[test]
    fn every_planned_kernel_is_prepared() {
        let names = kernels_of(&plan(&gpu_facts(2, true, false)));
        for n in [
            "fc_oneshot_ll_bf16_sum",
            "fc_twoshot_push_f32_sum",
            "fc_exchange",
            "fc_exchange_ll",
            "fc_reduce_to_bf16_sum",
            "fc_reduce_to_ll_f32_sum",
        ] {
            assert!(names.iter().any(|x| x == n), "{n} not in {names:?}");
        }
        assert_eq!(names.len(), 5 * 2 + 2 + 2 * 2);
    }
}
