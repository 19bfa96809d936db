//! What autotune times, how, and the table the timings pick.

use std::time::Instant;

use crate::algo::kernels::{kernel_name, KernelKind};
use crate::comm::call::Call;
use crate::comm::communicator::Communicator;
use crate::comm::tensor::Tensor;
use crate::comm::work::Work;
use crate::device::{BackendKind, Device};
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};
use crate::plan::{step_for, Algorithm, Collective, DtypeClass, Ladders, Step};

/// One size of one collective and class, and the candidates timed there.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Case {
    pub(super) coll: Collective,
    pub(super) class: DtypeClass,
    /// The payload (all-reduce) or bytes per peer.
    pub(super) bytes: usize,
    pub(super) candidates: Vec<Algorithm>,
}

/// What the plan depends on; the same on every rank (the deterministic
/// option is rank 0's).
#[derive(Debug, Clone, Copy)]
pub(super) struct PlanFacts {
    pub(super) backend: BackendKind,
    /// Largest block one source's LL lines carry ([`ll_capacity`]).
    pub(super) ll_room: usize,
    /// NCCL/RCCL loaded (on every rank, or the communicator failed at init).
    pub(super) vendor: bool,
    pub(super) deterministic: bool,
}

/// LL carries 8 data bytes per 16-byte line: past 1 MiB a peer it never won
/// on H200 (2x: inbox level at 512 KiB; the LL all-reduce's ladder stops at
/// 256 KiB), so it is not timed where bandwidth rules.
pub(super) const LL_COLL_MAX_BYTES: usize = 1 << 20;

/// The smallest block a peer the copy route is timed at (all-gather and
/// all-to-all; reduce-scatter has none). Not measured yet: below it the
/// route's two handshake launches and the copies' setup can only lose to
/// one kernel, and leaving those sizes out keeps autotune inside its budget.
pub(super) const COPY_MIN_CANDIDATE_BYTES: usize = 256 << 10;
/// The LL all-reduce likewise (its worst win was 256 KiB, at world 2).
pub(super) const LL_AR_MAX_BYTES: usize = 4 << 20;

/// Calls in one captured graph: several where a call is short, so one
/// replay's launch is spread over them; one where the call itself takes
/// tens of microseconds or more.
pub(super) fn graph_ops(bytes: usize) -> usize {
    if bytes <= 1 << 20 {
        4
    } else {
        1
    }
}

/// Untimed runs before, and timed runs of, each candidate at each size.
pub(super) fn iterations(backend: BackendKind) -> (usize, usize) {
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
/// (2 x 19 when not deterministic), all-to-all 19; and the copy route for
/// all-gather and all-to-all from [`COPY_MIN_CANDIDATE_BYTES`] (4 sizes
/// each). So 194 measurements (208; 180 without NCCL/RCCL). Each is one eager call (it loads, and
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
/// inbox, and the copy route at 256 KiB: at most 84 measurements of 1 + 3 runs.
pub(super) fn plan(f: &PlanFacts) -> Vec<Case> {
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
                if coll != Collective::ReduceScatter && bytes >= COPY_MIN_CANDIDATE_BYTES {
                    c.push(Algorithm::Copy);
                }
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

/// One rank-local median.
#[derive(Debug, Clone, Copy)]
pub(super) struct Measured {
    pub(super) coll: Collective,
    pub(super) class: DtypeClass,
    pub(super) bytes: usize,
    pub(super) candidate: Algorithm,
    pub(super) us: f64,
}

/// Every kernel the plan launches, so that no measurement waits for a
/// compile (they are the ones later calls need anyway).
pub(super) fn kernels_of(cases: &[Case]) -> Vec<String> {
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
                (_, Algorithm::Copy) => Some(KernelKind::Copy),
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
pub(super) fn measure<D: Device>(comm: &Communicator<D>, cases: &[Case]) -> Result<Vec<Measured>> {
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
pub(super) fn table_from(measured: &[Measured], defaults: &Ladders) -> Ladders {
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
pub(super) const TIE: f64 = 0.03;

/// The fastest candidate per size as a ladder: each measured size's winner
/// runs up to that size, the last one beyond it (`last` when nothing was
/// measured). `static_choice(b)` keeps its size unless beaten by [`TIE`].
pub(super) fn ladder_from<A: Copy + PartialEq>(
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
