//! The overlap operations (`comm::overlap`) in the conformance suite: the
//! chunked all-gather and reduce-scatter bit for bit against plain
//! `all_gather_single` / `reduce_scatter_single` of the same data, over
//! several calls in a row with no host synchronization between them (the
//! "ready" counters must keep a peer from overwriting a chunk the consumer
//! still copies), the consumer on another stream than the puts, outputs in
//! the heap and registered, sum and avg; a graph of both captured once and
//! replayed with new data; and bad arguments as errors.

use std::time::Duration;

use half::{bf16, f16};

use super::check::Checker;
use super::conformance::{SuiteConfig, SuiteReport};
use super::data::{input_value, Values};
use crate::bootstrap::{store_barrier, Store};
use crate::comm::{Call, ChunkedAllGather, ChunkedReduceScatter, Communicator, Tensor};
use crate::device::{Device, DeviceBuffer};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// Calls in a row without a host synchronization.
const ROUNDS: usize = 3;

/// Random values of `dtype` (finite, roughly unit scale) for (rank, tag).
fn values(dtype: DType, seed: u64, rank: usize, tag: usize, n: usize) -> Vec<u8> {
    let v = |i: usize| input_value(seed ^ (tag as u64) << 20, rank, i, ReduceOp::Sum, Values::Random);
    (0..n)
        .flat_map(|i| match dtype {
            DType::F16 => f16::from_f64(v(i)).to_le_bytes().to_vec(),
            DType::BF16 => bf16::from_f64(v(i)).to_le_bytes().to_vec(),
            _ => (v(i) as f32).to_le_bytes().to_vec(),
        })
        .collect()
}

/// Every case of the chunked operations; every rank runs it in step.
pub fn run_overlap<D: Device>(comm: &Communicator<D>, store: &dyn Store, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut c = Checker::default();
    let barrier = |what: &str| store_barrier(store, &format!("fc/overlap-suite/{what}"), rank, world, cfg.timeout);
    // Every kernel loaded first: ranks sharing a GPU context could otherwise
    // wait for a module load behind a peer's spinning kernel.
    comm.prepare()?;
    for (k, (dtype, n, in_heap)) in [
        (DType::F32, 1, true),
        (DType::BF16, 1031, false),
        (DType::F16, 4099, true),
    ]
    .into_iter()
    .enumerate()
    {
        all_gather_rounds(comm, &mut c, cfg, dtype, n, in_heap, k)?;
        barrier(&format!("ag{k}"))?;
    }
    for (k, (dtype, n, op)) in [
        (DType::F32, 1, ReduceOp::Sum),
        (DType::BF16, 1031, ReduceOp::Sum),
        (DType::F16, 517, ReduceOp::Avg),
        (DType::F32, 4099, ReduceOp::Avg),
    ]
    .into_iter()
    .enumerate()
    {
        reduce_scatter_rounds(comm, &mut c, cfg, dtype, n, op, k)?;
        barrier(&format!("rs{k}"))?;
    }
    graph_replay(comm, &mut c, cfg)?;
    barrier("graph")?;
    bad_arguments(comm, &mut c)?;
    barrier("end")?;
    Ok(c.report)
}

/// `ROUNDS` chunked all-gathers: puts on one stream, the consumer on
/// another copying each chunk out as it lands (in reverse rank order), and
/// the next call started at once after an event on the consumer's stream.
fn all_gather_rounds<D: Device>(
    comm: &Communicator<D>,
    c: &mut Checker,
    cfg: &SuiteConfig,
    dtype: DType,
    n: usize,
    in_heap: bool,
    tag: usize,
) -> Result<()> {
    let (rank, world, size) = (comm.rank(), comm.size(), dtype.size());
    let dev = comm.device();
    let heap = if in_heap {
        Some(comm.heap_alloc(world * n * size)?)
    } else {
        None
    };
    let plain = comm.alloc(world * n * size)?;
    let output = match &heap {
        Some(h) => Tensor::of(h, dtype),
        None => Tensor::of(&plain, dtype),
    };
    let inputs = comm.alloc(ROUNDS * n * size)?;
    let copies = comm.alloc(ROUNDS * world * n * size)?;
    let mut want = Vec::new();
    for round in 0..ROUNDS {
        let mine = values(dtype, cfg.seed, rank, 100 * tag + round, n);
        comm.write(&inputs, round * n * size, &mine)?;
        want.push(
            (0..world)
                .flat_map(|s| values(dtype, cfg.seed, s, 100 * tag + round, n))
                .collect::<Vec<u8>>(),
        );
    }
    dev.synchronize(comm.stream())?;
    let mut ag = ChunkedAllGather::new(comm, output)?;
    let (puts, consumer) = (dev.create_stream()?, dev.create_stream()?);
    let done = dev.create_event()?;
    for round in 0..ROUNDS {
        ag.start(Tensor::view(&inputs, dtype, round * n * size, n)?, &Call::on(&puts))?;
        for s in (0..world).rev() {
            ag.wait_chunk(s, &Call::on(&consumer))?;
            let dst = copies.ptr().offset((round * world + s) * n * size);
            dev.copy_device(dst, output.ptr().offset(s * n * size), n * size, &consumer)?;
        }
        // The next call's puts (and "ready") come after these reads.
        dev.record(&done, &consumer)?;
        dev.wait_event(&puts, &done)?;
    }
    dev.synchronize(&consumer)?;
    dev.synchronize(&puts)?;
    for (round, want) in want.iter().enumerate() {
        let mut got = vec![0u8; world * n * size];
        comm.read(&copies, round * world * n * size, &mut got)?;
        let case = format!("chunked all-gather {dtype} n={n} heap={in_heap} round {round} rank {rank}");
        c.check_bytes(&case, &got, want);
    }
    // The plain collective of the last round's input gives the same bytes.
    let reference = comm.alloc(world * n * size)?;
    let last = Tensor::view(&inputs, dtype, (ROUNDS - 1) * n * size, n)?;
    comm.all_gather_single(Tensor::of(&reference, dtype), last, &Call::new())?
        .wait(Some(cfg.timeout))?;
    let (mut plain_out, mut chunked) = (vec![0u8; world * n * size], vec![0u8; world * n * size]);
    comm.read(&reference, 0, &mut plain_out)?;
    comm.read(&copies, (ROUNDS - 1) * world * n * size, &mut chunked)?;
    c.check_bytes(
        &format!("chunked all-gather {dtype} n={n} against all_gather_single"),
        &chunked,
        &plain_out,
    );
    ag.free()?;
    if let Some(h) = heap {
        comm.heap_free(h)?;
    }
    Ok(())
}

/// `ROUNDS` chunked reduce-scatters: partials put on one stream (own chunk
/// last), finished on another, each output against a plain
/// `reduce_scatter_single` of the same inputs.
fn reduce_scatter_rounds<D: Device>(
    comm: &Communicator<D>,
    c: &mut Checker,
    cfg: &SuiteConfig,
    dtype: DType,
    n: usize,
    op: ReduceOp,
    tag: usize,
) -> Result<()> {
    let (rank, world, size) = (comm.rank(), comm.size(), dtype.size());
    let dev = comm.device();
    let inputs = comm.alloc(ROUNDS * world * n * size)?;
    for round in 0..ROUNDS {
        let mine = values(dtype, cfg.seed, rank, 1000 + 100 * tag + round, world * n);
        comm.write(&inputs, round * world * n * size, &mine)?;
    }
    let outputs = comm.alloc(ROUNDS * n * size)?;
    let reference = comm.alloc(ROUNDS * n * size)?;
    for round in 0..ROUNDS {
        let inp = Tensor::view(&inputs, dtype, round * world * n * size, world * n)?;
        let out = Tensor::view(&reference, dtype, round * n * size, n)?;
        comm.reduce_scatter_single(out, inp, op, &Call::new())?
            .wait(Some(cfg.timeout))?;
    }
    dev.synchronize(comm.stream())?;
    let mut rs = ChunkedReduceScatter::new(comm, n, dtype)?;
    let (puts, consumer) = (dev.create_stream()?, dev.create_stream()?);
    for round in 0..ROUNDS {
        for i in 1..=world {
            let q = (rank + i) % world;
            let partial = Tensor::view(&inputs, dtype, (round * world + q) * n * size, n)?;
            rs.put_chunk(q, partial, &Call::on(&puts))?;
        }
        rs.finish(
            Tensor::view(&outputs, dtype, round * n * size, n)?,
            op,
            &Call::on(&consumer),
        )?;
    }
    dev.synchronize(&consumer)?;
    dev.synchronize(&puts)?;
    let (mut got, mut want) = (vec![0u8; ROUNDS * n * size], vec![0u8; ROUNDS * n * size]);
    comm.read(&outputs, 0, &mut got)?;
    comm.read(&reference, 0, &mut want)?;
    let case = format!("chunked reduce-scatter {dtype} {op} n={n} x {ROUNDS} rounds rank {rank}");
    c.check_bytes(&case, &got, &want);
    rs.free()
}

/// Both operations on one stream captured into a graph (the host backend
/// captures one stream), replayed with new inputs: the counters only grow,
/// so each replay pairs its own signals and waits.
fn graph_replay<D: Device>(comm: &Communicator<D>, c: &mut Checker, cfg: &SuiteConfig) -> Result<()> {
    let (rank, world, dtype, n) = (comm.rank(), comm.size(), DType::BF16, 333);
    let size = dtype.size();
    let dev = comm.device();
    let gathered = comm.heap_alloc(world * n * size)?;
    let (input, partials, reduced, copy) = (
        comm.alloc(n * size)?,
        comm.alloc(world * n * size)?,
        comm.alloc(n * size)?,
        comm.alloc(world * n * size)?,
    );
    let mut ag = ChunkedAllGather::new(comm, Tensor::of(&gathered, dtype))?;
    let mut rs = ChunkedReduceScatter::new(comm, n, dtype)?;
    let stream = dev.create_stream()?;
    dev.begin_capture(&stream)?;
    let captured = (|| {
        let on = Call::on(&stream);
        ag.start(Tensor::of(&input, dtype), &on)?;
        ag.wait_all(&on)?;
        dev.copy_device(copy.ptr(), gathered.ptr(), world * n * size, &stream)?;
        for q in 0..world {
            rs.put_chunk(q, Tensor::view(&partials, dtype, q * n * size, n)?, &on)?;
        }
        rs.finish(Tensor::of(&reduced, dtype), ReduceOp::Sum, &on)
    })();
    let graph = dev.end_capture(&stream)?;
    captured?;
    let replays = cfg.graph_replays.clamp(1, 4);
    for replay in 0..replays {
        let tag = 5000 + replay;
        comm.write(&input, 0, &values(dtype, cfg.seed, rank, tag, n))?;
        comm.write(&partials, 0, &values(dtype, cfg.seed, rank, tag + 50, world * n))?;
        dev.synchronize(comm.stream())?;
        dev.launch_graph(&graph, &stream)?;
        dev.synchronize(&stream)?;
        let mut got = vec![0u8; world * n * size];
        comm.read(&copy, 0, &mut got)?;
        let want: Vec<u8> = (0..world).flat_map(|s| values(dtype, cfg.seed, s, tag, n)).collect();
        c.check_bytes(
            &format!("graph replay {replay}: chunked all-gather rank {rank}"),
            &got,
            &want,
        );
        // The plain reduce-scatter of the same partials.
        let reference = comm.alloc(n * size)?;
        comm.reduce_scatter_single(
            Tensor::of(&reference, dtype),
            Tensor::of(&partials, dtype),
            ReduceOp::Sum,
            &Call::new(),
        )?
        .wait(Some(cfg.timeout))?;
        let (mut got, mut want) = (vec![0u8; n * size], vec![0u8; n * size]);
        comm.read(&reduced, 0, &mut got)?;
        comm.read(&reference, 0, &mut want)?;
        c.check_bytes(
            &format!("graph replay {replay}: chunked reduce-scatter rank {rank}"),
            &got,
            &want,
        );
    }
    drop(graph);
    ag.free()?;
    rs.free()?;
    comm.heap_free(gathered)
}

/// Bad shapes, dtypes, ranks and call orders: errors, nothing queued.
fn bad_arguments<D: Device>(comm: &Communicator<D>, c: &mut Checker) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.size());
    let buf = comm.alloc(64 * world * 4)?;
    let call = Call::new();
    let odd = Tensor::view(&buf, DType::F32, 0, world * 3 + 1)?;
    c.check_invalid(
        "all-gather output not a multiple",
        ChunkedAllGather::new(comm, odd),
        "multiple",
    );
    let out = Tensor::view(&buf, DType::F32, 0, world * 8)?;
    let mut ag = ChunkedAllGather::new(comm, out)?;
    let src = comm.alloc(64 * 4)?;
    let good = Tensor::view(&src, DType::F32, 0, 8)?;
    c.check_invalid("wait before start", ag.wait_chunk(0, &call), "no call was started");
    c.check_invalid(
        "start with a wrong count",
        ag.start(Tensor::view(&src, DType::F32, 0, 7)?, &call),
        "expected 8 x f32",
    );
    c.check_invalid(
        "start with a wrong dtype",
        ag.start(good.reinterpret(DType::I32)?, &call),
        "expected 8 x f32",
    );
    c.check_invalid(
        "start overlapping the output",
        ag.start(out.slice(1, 8)?, &call),
        "overlaps",
    );
    ag.start(good, &call)?;
    c.check_invalid("wait on a chunk outside", ag.wait_chunk(world, &call), "not a rank");
    ag.wait_chunk(rank, &call)?;
    c.check_invalid("a chunk waited twice", ag.wait_chunk(rank, &call), "waited for already");
    if world > 1 {
        c.check_invalid(
            "start before every chunk was waited",
            ag.start(good, &call),
            "never waited",
        );
    }
    ag.wait_all(&call)?;
    // In place: the own slot as the input.
    ag.start(out.slice(rank * 8, 8)?, &call)?;
    ag.wait_all(&call)?;
    comm.device().synchronize(comm.stream())?;
    ag.free()?;

    c.check_invalid(
        "reduce-scatter of 0 elements",
        ChunkedReduceScatter::new(comm, 0, DType::F32),
        "0 elements",
    );
    c.check_invalid(
        "reduce-scatter of u8",
        ChunkedReduceScatter::new(comm, 8, DType::U8),
        "not reduced",
    );
    let mut rs = ChunkedReduceScatter::new(comm, 8, DType::F32)?;
    c.check_invalid(
        "put to a rank outside",
        rs.put_chunk(world, good, &call),
        "not in a world",
    );
    c.check_invalid(
        "put of a wrong dtype",
        rs.put_chunk(rank, Tensor::view(&src, DType::BF16, 0, 8)?, &call),
        "expected 8 x f32",
    );
    c.check_invalid(
        "finish before the puts",
        rs.finish(good, ReduceOp::Sum, &call),
        "were not put",
    );
    for q in 0..world {
        rs.put_chunk(q, good, &call)?;
    }
    c.check_invalid("a partial put twice", rs.put_chunk(rank, good, &call), "put already");
    let out8 = Tensor::view(&src, DType::F32, 32 * 4, 8)?;
    c.check_invalid("finish with max", rs.finish(out8, ReduceOp::Max, &call), "sum or avg");
    c.check_invalid(
        "finish into a wrong count",
        rs.finish(out8.slice(0, 7)?, ReduceOp::Sum, &call),
        "expected 8 x f32",
    );
    rs.finish(out8, ReduceOp::Sum, &call)?;
    comm.device().synchronize(comm.stream())?;
    let mut got = vec![0u8; 32];
    comm.read(&src, 32 * 4, &mut got)?;
    let mut input = vec![0u8; 32];
    comm.read(&src, 0, &mut input)?;
    // Every rank put the same (zeroed) memory: the sum of zeros is zero bits.
    c.check_bytes("reduce-scatter of zeros", &got, &input);
    rs.free()?;
    let mut ints = ChunkedReduceScatter::new(comm, 8, DType::I32)?;
    for q in 0..world {
        ints.put_chunk(q, good.reinterpret(DType::I32)?, &call)?;
    }
    c.check_err(
        "i32 avg",
        ints.finish(out8.reinterpret(DType::I32)?, ReduceOp::Avg, &call),
        "not supported",
    );
    ints.finish(out8.reinterpret(DType::I32)?, ReduceOp::Sum, &call)?;
    comm.device().synchronize(comm.stream())?;
    ints.free()
}

/// A peer that never starts: rank 0's puts wait for its "ready" and its
/// consumer for its chunk, each kernel gives up after the call's timeout,
/// and the next method names the peer. Rank 0's communicator is aborted.
pub fn run_overlap_timeout<D: Device>(
    comm: &Communicator<D>,
    store: &dyn Store,
    cfg: &SuiteConfig,
) -> Result<SuiteReport> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut c = Checker::default();
    comm.prepare()?;
    let out = comm.heap_alloc(world * 8 * 4)?;
    let src = comm.alloc(8 * 4)?;
    let mut ag = ChunkedAllGather::new(comm, Tensor::of(&out, DType::F32))?;
    if rank == 0 {
        let start = std::time::Instant::now();
        let short = Call::new().timeout(Duration::from_millis(300));
        ag.start(Tensor::of(&src, DType::F32), &short)?;
        ag.wait_chunk(1, &short)?;
        comm.device().synchronize(comm.stream())?;
        let r = ag.wait_chunk(0, &short);
        let named = matches!(&r, Err(Error::Timeout { missing, .. }) if missing == &vec![1]);
        c.check("a peer that never starts is named", named, || format!("{r:?}"));
        c.check("timeout bound", start.elapsed() < Duration::from_secs(10), || {
            format!("took {:?}", start.elapsed())
        });
    } else {
        c.report.collectives += 1;
    }
    store_barrier(store, "fc/overlap-suite/timeout", rank, world, cfg.timeout)?;
    if rank == 0 {
        // The communicator is aborted: its heap goes with it.
        drop(ag);
    } else {
        ag.free()?;
        comm.heap_free(out)?;
    }
    Ok(c.report)
}
