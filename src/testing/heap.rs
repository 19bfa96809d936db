//! The symmetric heap and windows in the conformance suite (every backend):
//! symmetric offsets and translation, the device API's context, window puts
//! with signals over several rounds (heap buffers and registered ones), a
//! captured put/signal/wait replayed with new data, every bad input as an
//! error before anything is queued, and a peer that never signals.

use std::time::Duration;

use super::check::Checker;
use super::conformance::{SuiteConfig, SuiteReport};
use crate::bootstrap::{store_barrier, Store};
use crate::comm::{Call, Communicator, Reduction, Tensor};
use crate::device::{Device, DeviceBuffer, DevicePtr};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::heap::{HEAP_ALIGN, HEAP_RESERVED};

/// Rank `r`'s element `i` in round `round`.
fn value(r: usize, round: usize, i: usize) -> i32 {
    (r as i32 + 1) * 1_000_000 + round as i32 * 10_000 + i as i32
}

fn to_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// Heap, translation, context and windows; every rank runs it in step.
pub fn run_heap_suite<D: Device>(comm: &Communicator<D>, store: &dyn Store, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut c = Checker::default();
    let barrier = |what: &str| store_barrier(store, &format!("fc/heap-suite/{what}"), rank, world, cfg.timeout);
    // Every kernel loaded first: ranks that share a GPU (threads, one
    // context) can otherwise deadlock, one rank's module load waiting behind
    // another's kernel that waits for it (heap_alloc's barrier is a kernel).
    comm.prepare()?;

    // Symmetric allocation and translation.
    let a = comm.heap_alloc(1000)?;
    let n = 257; // odd, not a multiple of 16 bytes
    let rounds = 3;
    let b = comm.heap_alloc(rounds * world * n * 4)?;
    c.check(
        "heap offsets",
        a.offset() >= HEAP_RESERVED && a.offset() % HEAP_ALIGN == 0 && b.offset() >= a.offset() + 1000,
        || format!("a at {}, b at {}", a.offset(), b.offset()),
    );
    let ctx = comm.device_ctx()?;
    c.check(
        "device ctx",
        ctx.rank as usize == rank
            && ctx.world as usize == world
            && ctx.heap[rank] == DevicePtr(a.ptr().0 - a.offset() as u64),
        || format!("{ctx:?}"),
    );
    for peer in 0..world {
        let t = comm.translate(b.ptr().offset(12), peer)?;
        c.check("translate", t == ctx.heap[peer].offset(b.offset() + 12), || {
            format!("peer {peer}: {t:?}")
        });
    }
    c.check_err(
        "translate outside the heap",
        comm.translate(DevicePtr(8), 0),
        "not in this rank's heap",
    );
    c.check_err(
        "translate to a rank outside",
        comm.translate(a.ptr(), world),
        "not in a world",
    );

    // A window over heap buffers: each round, every rank puts its values
    // into the next rank's buffer and signals it; each round has its own
    // region, so a late reader never sees the next round's data.
    let src_buf = comm.alloc(n * 4)?;
    let src = Tensor::view(&src_buf, DType::I32, 0, n)?;
    let mut win = comm.new_window()?;
    win.register(Tensor::of(&b, DType::I32))?;
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let call = Call::new();
    for round in 0..rounds {
        let mine: Vec<i32> = (0..n).map(|i| value(rank, round, i)).collect();
        comm.write(&src_buf, 0, &to_bytes(&mine))?;
        win.put(src, next, (round * world + rank) * n, &call)?;
        win.signal(next, &call)?;
        win.wait_signal(prev, &call)?.wait(None)?;
        let mut got = vec![0u8; n * 4];
        comm.heap_read(&b, (round * world + prev) * n * 4, &mut got)?;
        let want: Vec<i32> = (0..n).map(|i| value(prev, round, i)).collect();
        c.check_values(
            &format!("window round {round} from rank {prev}"),
            &from_bytes(&got),
            &want,
        );
    }
    let remote = win.map_remote(next)?;
    c.check(
        "map_remote",
        remote.ptr() == comm.translate(b.ptr(), next)? && remote.count() == rounds * world * n,
        || format!("{remote:?}"),
    );

    // Bad input: errors, nothing queued.
    c.check_err(
        "put past the end",
        win.put(src, next, rounds * world * n - 1, &call),
        "past the end",
    );
    c.check_err("put to a rank outside", win.put(src, world, 0, &call), "not in a world");
    let f32_src = src.reinterpret(DType::F32)?;
    c.check_err("put of another dtype", win.put(f32_src, next, 0, &call), "source is");
    c.check_err("register twice", win.register(src), "has a buffer");
    c.check_err("map_remote outside", win.map_remote(world), "not in a world");
    c.check_err("signal outside", win.signal(world, &call), "not in a world");

    // A captured put/signal/wait, replayed with new data: the signal counts
    // live on the device, so each replay waits for its own signal. Replays
    // write round 0's region again: nobody starts before everyone has read it.
    barrier("rounds")?;
    let dev = comm.device();
    let stream = dev.create_stream()?;
    dev.begin_capture(&stream)?;
    let captured = (|| {
        let on = Call::on(&stream);
        win.put(src, next, rank * n, &on)?;
        win.signal(next, &on)?;
        win.wait_signal(prev, &on)
    })();
    let graph = dev.end_capture(&stream)?;
    captured?;
    for replay in 0..cfg.graph_replays.clamp(1, 5) {
        let round = 100 + replay;
        let mine: Vec<i32> = (0..n).map(|i| value(rank, round, i)).collect();
        comm.write(&src_buf, 0, &to_bytes(&mine))?;
        dev.synchronize(comm.stream())?;
        dev.launch_graph(&graph, &stream)?;
        dev.synchronize(&stream)?;
        let mut got = vec![0u8; n * 4];
        comm.heap_read(&b, prev * n * 4, &mut got)?;
        let want: Vec<i32> = (0..n).map(|i| value(prev, round, i)).collect();
        c.check_values(
            &format!("graph replay {replay} from rank {prev}"),
            &from_bytes(&got),
            &want,
        );
        // Nobody overwrites a region before its reader has read it.
        barrier(&format!("replay{replay}"))?;
    }
    drop(graph);
    win.free()?;

    // A window over memory outside the heap: registered, same protocol.
    let plain = comm.alloc(world * n * 4)?;
    let mut reg = comm.new_window()?;
    reg.register(Tensor::of(&plain, DType::I32))?;
    let mine: Vec<i32> = (0..n).map(|i| value(rank, 7, i)).collect();
    comm.write(&src_buf, 0, &to_bytes(&mine))?;
    reg.put(src, next, rank * n, &call)?;
    reg.signal(next, &call)?;
    reg.wait_signal(prev, &call)?.wait(None)?;
    let mut got = vec![0u8; n * 4];
    comm.read(&plain, prev * n * 4, &mut got)?;
    let want: Vec<i32> = (0..n).map(|i| value(prev, 7, i)).collect();
    c.check_values("registered window", &from_bytes(&got), &want);
    barrier("registered")?;
    reg.free()?;

    // Buffers of different dtypes, or over the heap's sync area: errors on
    // every rank at register (puts are bounded in the peer's elements).
    let mut odd = comm.new_window()?;
    let mixed = if rank == 0 { src } else { src.reinterpret(DType::F32)? };
    c.check_err("register of different dtypes", odd.register(mixed), "dtype");
    // SAFETY: the first 64 bytes of this rank's heap (its sync area), only
    // handed to register, which must refuse them.
    let sync_area = unsafe { Tensor::from_raw(ctx.heap[rank].0, 64, DType::U8) };
    c.check_err("register over the sync area", odd.register(sync_area), "sync area");
    odd.free()?;

    heap_collectives(comm, &mut c, &barrier)?;

    // Out of heap: every rank gets the error, and the heap stays usable.
    c.check_err("heap exhausted", comm.heap_alloc(1 << 40), "out of memory");
    let (a_off, b_off) = (a.offset(), b.offset());
    comm.heap_write(&a, 0, &[0xAB; 1000])?;
    comm.heap_free(b)?;
    comm.heap_free(a)?;
    let again = comm.heap_alloc(1000)?;
    c.check("first fit after free", again.offset() == a_off && a_off < b_off, || {
        format!("{} after {a_off}", again.offset())
    });
    let mut reused = vec![1u8; 1000];
    comm.heap_read(&again, 0, &mut reused)?;
    c.check(
        "a reused range comes back zeroed",
        reused.iter().all(|&x| x == 0),
        || format!("{} nonzero bytes", reused.iter().filter(|&&x| x != 0).count()),
    );
    comm.heap_free(again)?;
    barrier("end")?;
    Ok(c.report)
}

/// The workspace's epoch, which every launch's flags advance: the direct
/// exchange takes one, its fallback one more than the exchange's chunks.
fn ws_epoch<D: Device>(comm: &Communicator<D>) -> Result<u32> {
    let dev = comm.device();
    let stream = comm.stream();
    dev.synchronize(stream)?;
    let mut word = [0u8; 4];
    comm.with_resources(|res| match &res.ws {
        Some(ws) => dev.copy_to_host(ws.own(), 0, &mut word, stream),
        None => Err(Error::invalid("no workspace")),
    })??;
    dev.synchronize(stream)?;
    Ok(u32::from_le_bytes(word))
}

/// Collectives on heap buffers. The exchange writes straight into the
/// receivers' heap blocks (`fc_exchange_direct`: on the host whenever there
/// is a heap, on GPUs from `DIRECT_MIN_BLOCK_BYTES` a peer), and every rank
/// falls back to the inbox exchange when one rank's blocks cannot be written
/// in place (one outside the heap, or an all-to-all in place). Which way a
/// call went shows in the epochs it took: one for the direct way, at least
/// two for the fallback. The kind is chosen from the sizes and the heap, not
/// from where the outputs lie, so a call that fell back with one rank's
/// output outside the heap proves its all-heap twin took the direct kernel.
fn heap_collectives<D: Device>(
    comm: &Communicator<D>,
    c: &mut Checker,
    barrier: &dyn Fn(&str) -> Result<()>,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.size());
    let gpu = comm.device().facts().backend != crate::device::BackendKind::Host;
    let call = Call::new();
    // Odd counts: not a multiple of 16 bytes. On GPUs one size each side of
    // the direct threshold, both above the size under which all-gather and
    // gather may go to NCCL (`route`), which takes no epochs.
    let direct_n =
        crate::plan::table::DIRECT_MIN_BLOCK_BYTES.max(crate::plan::table::DIRECT_MIN_REDUCE_TO_BYTES) / 4 + 5;
    let below = crate::plan::table::DIRECT_MIN_BLOCK_BYTES.min(crate::plan::table::DIRECT_MIN_REDUCE_TO_BYTES) / 2;
    let sizes: Vec<usize> = if gpu {
        vec![below / 4 + 3, direct_n]
    } else {
        vec![1, 257]
    };
    for (k, &n) in sizes.iter().enumerate() {
        let direct = !gpu || n == direct_n;
        let round = 30 + k;
        let inp = comm.heap_alloc(world * n * 4)?;
        let out = comm.heap_alloc(world * n * 4)?;
        let plain = comm.alloc(world * n * 4)?;
        let blocks: Vec<i32> = (0..world * n).map(|i| value(rank, round, i)).collect();
        let everyone = |part: &dyn Fn(usize, usize) -> i32| -> Vec<i32> {
            (0..world)
                .flat_map(|s| (0..n).map(move |i| (s, i)))
                .map(|(s, i)| part(s, i))
                .collect()
        };
        let read = |buf: &crate::heap::HeapBuffer| -> Result<Vec<i32>> {
            let mut got = vec![0u8; world * n * 4];
            comm.heap_read(buf, 0, &mut got)?;
            Ok(from_bytes(&got))
        };
        // An all-to-all without splits has an agreed block (`count /
        // world`), so it takes the direct exchange like the all-gather.
        let epochs = |taken: u32, fell_back: bool, case: &str, c: &mut Checker| {
            check_epochs(c, &format!("{case}: {n} elements"), taken, direct, fell_back);
        };

        // All-gather into the heap, then with rank 0's output outside it.
        comm.heap_write(&inp, 0, &to_bytes(&blocks))?;
        let input = Tensor::view(&inp, DType::I32, 0, n)?;
        for outside in [false, true] {
            comm.heap_write(&out, 0, &vec![0xEE; world * n * 4])?;
            let output = match outside && rank == 0 {
                true => Tensor::of(&plain, DType::I32),
                false => Tensor::of(&out, DType::I32),
            };
            let e0 = ws_epoch(comm)?;
            comm.all_gather_single(output, input, &call)?.wait(None)?;
            let taken = ws_epoch(comm)?.wrapping_sub(e0);
            let got = match outside && rank == 0 {
                true => {
                    let mut b = vec![0u8; world * n * 4];
                    comm.read(&plain, 0, &mut b)?;
                    from_bytes(&b)
                }
                false => read(&out)?,
            };
            let case = format!("heap all-gather (rank 0's output outside: {outside})");
            c.report.elements_checked += got.len();
            c.check_values(&case, &got, &everyone(&|s, i| value(s, round, i)));
            epochs(taken, outside, &case, c);
            barrier(&format!("ag{round}{outside}"))?;
        }

        // All-to-all heap to heap, then in place (falls back: a peer's
        // block would land where this rank still reads).
        let e0 = ws_epoch(comm)?;
        let (tin, tout) = (Tensor::of(&inp, DType::I32), Tensor::of(&out, DType::I32));
        comm.all_to_all_single(tout, tin, &call)?.wait(None)?;
        let taken = ws_epoch(comm)?.wrapping_sub(e0);
        let want = everyone(&|s, i| value(s, round, rank * n + i));
        let got = read(&out)?;
        c.report.elements_checked += got.len();
        c.check_values(&format!("heap all-to-all {n}"), &got, &want);
        epochs(taken, false, "heap all-to-all", c);
        barrier(&format!("a2a{round}"))?;
        let e0 = ws_epoch(comm)?;
        comm.all_to_all_single(tin, tin, &call)?.wait(None)?;
        let taken = ws_epoch(comm)?.wrapping_sub(e0);
        let got = read(&inp)?;
        c.report.elements_checked += got.len();
        c.check_values(&format!("heap all-to-all in place {n}"), &got, &want);
        epochs(taken, true, "heap all-to-all in place", c);
        barrier(&format!("a2a-in-place{round}"))?;

        // Gather to rank world - 1 into heap blocks.
        let root = world - 1;
        comm.heap_write(&inp, 0, &to_bytes(&blocks))?;
        let outs: Vec<Tensor> = match rank == root {
            true => (0..world)
                .map(|s| Tensor::view(&out, DType::I32, s * n * 4, n))
                .collect::<Result<_>>()?,
            false => Vec::new(),
        };
        let e0 = ws_epoch(comm)?;
        comm.gather(&outs, input, root, &call)?.wait(None)?;
        let taken = ws_epoch(comm)?.wrapping_sub(e0);
        if rank == root {
            let got = read(&out)?;
            c.report.elements_checked += got.len();
            c.check_values(&format!("heap gather {n}"), &got, &everyone(&|s, i| value(s, round, i)));
        }
        epochs(taken, false, "heap gather", c);
        barrier(&format!("gather{round}"))?;
        comm.heap_free(out)?;
        comm.heap_free(inp)?;
        heap_reductions(comm, c, barrier, n, direct, round)?;
    }
    Ok(())
}

/// How a call on heap tensors went, from the epochs it took: one for the
/// direct way (or an inbox call of one chunk), at least two for a direct
/// kind that fell back to the inbox protocol.
fn check_epochs(c: &mut Checker, case: &str, taken: u32, direct: bool, fell_back: bool) {
    let ok = if direct && fell_back { taken >= 2 } else { taken == 1 };
    c.check(&format!("{case}: epochs taken"), ok, || {
        format!("{taken} epochs (direct kind: {direct}, fallback expected: {fell_back})")
    });
}

/// Reduce-scatter and reduce on heap inputs (`fc_reduce_to_direct_*`, taken
/// where the direct exchange is): each receiver reads every source's block
/// straight from that source's heap, and every rank falls back to the inbox
/// reduce-to when one rank's blocks to peers are not all in its heap (here:
/// rank 0's input outside it), or not aligned to its element (rank 0's
/// input 2 bytes off). Where the output lies does not matter (it is only
/// written by its own rank). Integer-valued i32 and f32 data, so the sums
/// are exact and checked against the sums themselves; premul_sum (f32) and
/// avg (bf16, as many bytes a block) on fractional data are checked bit for
/// bit against the same call on plain buffers, which takes the inbox
/// reduce-to.
fn heap_reductions<D: Device>(
    comm: &Communicator<D>,
    c: &mut Checker,
    barrier: &dyn Fn(&str) -> Result<()>,
    n: usize,
    direct: bool,
    round: usize,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.size());
    let call = Call::new();
    let inp = comm.heap_alloc(world * n * 4 + 16)?;
    let out = comm.heap_alloc(n * 4)?;
    let plain_in = comm.alloc(world * n * 4)?;
    let plain_out = comm.alloc(n * 4)?;
    // Rank s's element i of block q; i32 sums of up to 8 stay far from
    // overflow, f32 ones below 2^24 (exact).
    let int = |s: usize, q: usize, i: usize| value(s, round, q * n + i);
    let float = |s: usize, q: usize, i: usize| ((s + 1) * 1000 + (q * n + i) % 4096) as f32;
    let blocks = |f: &dyn Fn(usize, usize, usize) -> i32| -> Vec<i32> {
        (0..world * n).map(|j| f(rank, j / n, j % n)).collect()
    };
    let sums = |f: &dyn Fn(usize, usize, usize) -> i32, q: usize| -> Vec<i32> {
        (0..n)
            .map(|i| (0..world).fold(0i32, |a, s| a.wrapping_add(f(s, q, i))))
            .collect()
    };
    let float_bits = |s: usize, q: usize, i: usize| float(s, q, i).to_bits() as i32;
    let float_sums: Vec<i32> = (0..n)
        .map(|i| (0..world).map(|s| float(s, rank, i)).sum::<f32>().to_bits() as i32)
        .collect();
    let heap_read = |buf: &crate::heap::HeapBuffer, count: usize| -> Result<Vec<i32>> {
        let mut got = vec![0u8; count * 4];
        comm.heap_read(buf, 0, &mut got)?;
        Ok(from_bytes(&got))
    };
    let plain_read = |buf: &D::Buffer| -> Result<Vec<u8>> {
        let mut got = vec![0u8; n * 4];
        comm.read(buf, 0, &mut got)?;
        Ok(got)
    };
    let whole = |dtype: DType| Tensor::view(&inp, dtype, 0, world * n);
    let timed = |run: &dyn Fn() -> Result<()>| -> Result<u32> {
        let e0 = ws_epoch(comm)?;
        run()?;
        Ok(ws_epoch(comm)?.wrapping_sub(e0))
    };
    let done = |c: &mut Checker, case: &str, got: &[i32], want: &[i32], taken: u32, fell_back: bool| {
        c.report.elements_checked += got.len();
        c.check_values(&format!("{case} {n}"), got, want);
        check_epochs(c, &format!("{case} {n}"), taken, direct, fell_back);
    };

    // Heap input, heap output (i32).
    comm.heap_write(&inp, 0, &to_bytes(&blocks(&int)))?;
    let output = Tensor::view(&out, DType::I32, 0, n)?;
    let taken = timed(&|| {
        comm.reduce_scatter_single(output, whole(DType::I32)?, ReduceOp::Sum, &call)?
            .wait(None)
    })?;
    done(
        c,
        "heap reduce-scatter",
        &heap_read(&out, n)?,
        &sums(&int, rank),
        taken,
        false,
    );
    barrier(&format!("rs{round}"))?;

    // Heap input, output outside the heap (f32, exact sums).
    comm.heap_write(&inp, 0, &to_bytes(&blocks(&float_bits)))?;
    let output = Tensor::view(&plain_out, DType::F32, 0, n)?;
    let taken = timed(&|| {
        comm.reduce_scatter_single(output, whole(DType::F32)?, ReduceOp::Sum, &call)?
            .wait(None)
    })?;
    let got = from_bytes(&plain_read(&plain_out)?);
    done(
        c,
        "heap reduce-scatter f32 into plain memory",
        &got,
        &float_sums,
        taken,
        false,
    );
    barrier(&format!("rs-plain{round}"))?;

    // In place: the output is this rank's own block of the input, which no
    // peer reads; the other blocks are only read.
    let mine = blocks(&int);
    comm.heap_write(&inp, 0, &to_bytes(&mine))?;
    let output = Tensor::view(&inp, DType::I32, rank * n * 4, n)?;
    let taken = timed(&|| {
        comm.reduce_scatter_single(output, whole(DType::I32)?, ReduceOp::Sum, &call)?
            .wait(None)
    })?;
    let mut want = mine.clone();
    want[rank * n..(rank + 1) * n].copy_from_slice(&sums(&int, rank));
    done(
        c,
        "heap reduce-scatter in place",
        &heap_read(&inp, world * n)?,
        &want,
        taken,
        false,
    );
    barrier(&format!("rs-in-place{round}"))?;

    // Rank 0's input outside the heap: every rank falls back.
    comm.heap_write(&inp, 0, &to_bytes(&mine))?;
    comm.write(&plain_in, 0, &to_bytes(&mine))?;
    let input = match rank {
        0 => Tensor::of(&plain_in, DType::I32),
        _ => whole(DType::I32)?,
    };
    let output = Tensor::view(&out, DType::I32, 0, n)?;
    let taken = timed(&|| {
        comm.reduce_scatter_single(output, input, ReduceOp::Sum, &call)?
            .wait(None)
    })?;
    let case = "heap reduce-scatter, rank 0's input outside the heap";
    done(c, case, &heap_read(&out, n)?, &sums(&int, rank), taken, true);
    barrier(&format!("rs-fallback{round}"))?;

    // Rank 0's input in the heap but not aligned to its element: every rank
    // falls back (the inbox way realigns it).
    let skew = if rank == 0 { 2 } else { 0 };
    comm.heap_write(&inp, skew, &to_bytes(&mine))?;
    let input = Tensor::view(&inp, DType::I32, skew, world * n)?;
    let taken = timed(&|| {
        comm.reduce_scatter_single(output, input, ReduceOp::Sum, &call)?
            .wait(None)
    })?;
    let case = "heap reduce-scatter, rank 0's input not aligned to its element";
    done(c, case, &heap_read(&out, n)?, &sums(&int, rank), taken, true);
    barrier(&format!("rs-misaligned{round}"))?;
    comm.heap_write(&inp, 0, &to_bytes(&mine))?;

    // Reduce to the last rank, in place there; the others' tensors are only read.
    let root = world - 1;
    let t = Tensor::view(&inp, DType::I32, 0, n)?;
    let taken = timed(&|| comm.reduce(t, ReduceOp::Sum, root, &call)?.wait(None))?;
    let want = match rank == root {
        true => sums(&int, 0),
        false => mine[..n].to_vec(),
    };
    done(c, "heap reduce", &heap_read(&inp, n)?, &want, taken, false);
    barrier(&format!("reduce{round}"))?;

    // Fractional data, bit for bit against the same call on plain buffers.
    let frac = |j: usize| ((rank * 31 + j * 7) % 1000) as f32 / 7.0 + 0.1;
    let cases = [
        (
            "premul_sum f32",
            DType::F32,
            Reduction::premul_sum(0.5 + 0.25 * rank as f64),
        ),
        ("avg bf16", DType::BF16, Reduction::from(ReduceOp::Avg)),
    ];
    for (what, dtype, red) in cases {
        // As many bytes a block as the i32 cases (the direct kind is chosen by bytes).
        let m = n * 4 / dtype.size();
        let data: Vec<u8> = match dtype {
            DType::BF16 => (0..world * m)
                .flat_map(|j| half::bf16::from_f32(frac(j)).to_le_bytes())
                .collect(),
            _ => (0..world * m).flat_map(|j| frac(j).to_le_bytes()).collect(),
        };
        comm.heap_write(&inp, 0, &data)?;
        comm.write(&plain_in, 0, &data)?;
        let (heap_in, heap_o) = (
            Tensor::view(&inp, dtype, 0, world * m)?,
            Tensor::view(&out, dtype, 0, m)?,
        );
        let (plain, plain_o) = (
            Tensor::view(&plain_in, dtype, 0, world * m)?,
            Tensor::view(&plain_out, dtype, 0, m)?,
        );
        comm.reduce_scatter_single(plain_o, plain, red, &call)?.wait(None)?;
        let taken = timed(&|| comm.reduce_scatter_single(heap_o, heap_in, red, &call)?.wait(None))?;
        let mut got = vec![0u8; n * 4];
        comm.heap_read(&out, 0, &mut got)?;
        let case = format!("heap reduce-scatter {what} {m}, against plain buffers");
        c.report.elements_checked += m;
        c.check_bytes(&case, &got, &plain_read(&plain_out)?);
        check_epochs(c, &case, taken, direct, false);
        barrier(&format!("rs-{what}{round}"))?;
    }
    comm.heap_free(out)?;
    comm.heap_free(inp)
}

/// Rank 0 waits for a signal rank 1 never sends: the wait must end with a
/// timeout naming rank 1, within the call's bound plus grace.
pub fn run_heap_timeout<D: Device>(
    comm: &Communicator<D>,
    store: &dyn Store,
    cfg: &SuiteConfig,
) -> Result<SuiteReport> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut c = Checker::default();
    comm.prepare()?; // as in run_heap_suite
    let win = comm.new_window()?;
    if rank == 0 {
        let start = std::time::Instant::now();
        let r = win
            .wait_signal(1, &Call::new().timeout(Duration::from_millis(300)))
            .and_then(|w| w.wait(None));
        let named = matches!(&r, Err(Error::Timeout { missing, .. }) if missing == &vec![1]);
        c.check("a peer that never signals", named, || format!("{r:?}"));
        c.check("timeout bound", start.elapsed() < Duration::from_secs(10), || {
            format!("took {:?}", start.elapsed())
        });
    } else {
        c.report.collectives += 1;
    }
    store_barrier(store, "fc/heap-suite/timeout", rank, world, cfg.timeout)?;
    // Rank 0's communicator is aborted now; the window's words go with its heap.
    drop(win);
    Ok(c.report)
}

/// The user-style all-gather of `kernels-cuda/examples/user_allgather.cu`
/// (about 50 lines on the device API, compiled at run time), set up as a
/// user would: its heap buffers and its module. GPU backends only.
pub struct UserAllgather<D: Device> {
    module: crate::comm::UserModule<D>,
    /// `world * max_bytes` bytes: rank r's input lands at `r * bytes`.
    pub out: crate::heap::HeapBuffer,
    signal: crate::heap::HeapBuffer,
    epoch: crate::heap::HeapBuffer,
}

/// `UserAllgatherArgs` of the example kernel.
#[derive(Clone, Copy)]
#[repr(C)]
struct UserAllgatherArgs {
    ctx: crate::heap::DevCtx,
    input: u64,
    heap_out: u64,
    bytes_per_rank: u64,
    signal: u64,
    epoch_word: u64,
}

const _: () = assert!(std::mem::size_of::<UserAllgatherArgs>() == 144);

/// The example kernel's text.
pub const USER_ALLGATHER_SOURCE: &str = include_str!("../../kernels-cuda/examples/user_allgather.cu");

impl<D: Device> UserAllgather<D> {
    /// Collective: heap buffers for `max_bytes` per rank, and the module.
    pub fn new(comm: &Communicator<D>, max_bytes: usize) -> Result<Self> {
        let module = comm.load_user_module("user_allgather", USER_ALLGATHER_SOURCE)?;
        Ok(UserAllgather {
            module,
            out: comm.heap_alloc(comm.size() * max_bytes)?,
            signal: comm.heap_alloc(2 * crate::device::MAX_RANKS * 8)?,
            epoch: comm.heap_alloc(8)?,
        })
    }

    /// Gather `bytes` of `input` from every rank into [`UserAllgather::out`].
    pub fn launch(
        &self,
        comm: &Communicator<D>,
        input: Tensor,
        bytes: usize,
        grid: u32,
        call: &Call<'_, D>,
    ) -> Result<crate::comm::Work<D>> {
        if bytes * comm.size() > self.out.len() || input.bytes()? < bytes {
            return Err(Error::invalid("user all-gather: more bytes than its buffers hold"));
        }
        let args = UserAllgatherArgs {
            ctx: comm.device_ctx()?,
            input: input.ptr().0,
            heap_out: self.out.ptr().0,
            bytes_per_rank: bytes as u64,
            signal: self.signal.ptr().0,
            epoch_word: self.epoch.ptr().0,
        };
        // SAFETY: a #[repr(C)] struct of integers with no padding (asserted
        // size), viewed as its bytes for the launch.
        let bytes_of = unsafe {
            std::slice::from_raw_parts(
                (&args as *const UserAllgatherArgs).cast::<u8>(),
                std::mem::size_of_val(&args),
            )
        };
        // SAFETY: the struct is the kernel's `UserAllgatherArgs`; its
        // addresses are the caller's live input and this object's heap buffers.
        unsafe { comm.launch_user(&self.module, "user_allgather", grid, 256, bytes_of, call) }
    }

    /// Return the heap buffers (every rank, in the same order).
    pub fn free(self, comm: &Communicator<D>) -> Result<()> {
        comm.heap_free(self.epoch)?;
        comm.heap_free(self.signal)?;
        comm.heap_free(self.out)
    }
}

/// The user-style all-gather against the exact result: sizes from one byte
/// to 1 MiB (odd ones too), grids of 1 to 16 blocks, back to back launches
/// and graph replays. GPU backends (the host has no compiler; the CPU
/// emulation in `ci/check-kernels-emu.sh` runs the same kernel in CI).
pub fn run_user_allgather<D: Device>(
    comm: &Communicator<D>,
    store: &dyn Store,
    cfg: &SuiteConfig,
) -> Result<SuiteReport> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut c = Checker::default();
    let max = 1 << 20;
    comm.prepare()?; // as in run_heap_suite
    let ag = UserAllgather::new(comm, max)?;
    let inp = comm.alloc(max)?;
    let pattern = |r: usize, round: usize, i: usize| ((r * 131 + round * 17 + i * 7) % 251) as u8;
    let call = Call::new();
    for (round, (bytes, grid)) in [(1usize, 1u32), (15, 2), (4096, 4), (100_003, 16), (max, 8), (max, 16)]
        .into_iter()
        .enumerate()
    {
        let mine: Vec<u8> = (0..bytes).map(|i| pattern(rank, round, i)).collect();
        comm.write(&inp, 0, &mine)?;
        let t = Tensor::view(&inp, DType::U8, 0, bytes)?;
        ag.launch(comm, t, bytes, grid, &call)?.wait(None)?;
        let mut got = vec![0u8; world * bytes];
        comm.heap_read(&ag.out, 0, &mut got)?;
        let want: Vec<u8> = (0..world)
            .flat_map(|r| (0..bytes).map(move |i| pattern(r, round, i)))
            .collect();
        let bad = got.iter().zip(&want).position(|(g, w)| g != w);
        c.report.elements_checked += want.len();
        c.check(&format!("user all-gather {bytes} B grid {grid}"), bad.is_none(), || {
            format!("byte {bad:?} differs")
        });
    }
    // Captured once, replayed with new input: the kernel's counters are on the device.
    let dev = comm.device();
    let stream = dev.create_stream()?;
    let bytes = 65_536;
    let t = Tensor::view(&inp, DType::U8, 0, bytes)?;
    comm.prepare()?;
    dev.begin_capture(&stream)?;
    let captured = ag.launch(comm, t, bytes, 4, &Call::on(&stream));
    let graph = dev.end_capture(&stream)?;
    captured?;
    for replay in 0..cfg.graph_replays.clamp(1, 10) {
        let round = 50 + replay;
        let mine: Vec<u8> = (0..bytes).map(|i| pattern(rank, round, i)).collect();
        comm.write(&inp, 0, &mine)?;
        dev.synchronize(comm.stream())?;
        dev.launch_graph(&graph, &stream)?;
        dev.synchronize(&stream)?;
        let mut got = vec![0u8; world * bytes];
        comm.heap_read(&ag.out, 0, &mut got)?;
        let want: Vec<u8> = (0..world)
            .flat_map(|r| (0..bytes).map(move |i| pattern(r, round, i)))
            .collect();
        c.report.elements_checked += want.len();
        c.check(&format!("user all-gather replay {replay}"), got == want, || {
            "bytes differ".into()
        });
        store_barrier(store, &format!("fc/user-ag/{replay}"), rank, world, cfg.timeout)?;
    }
    drop(graph);
    ag.free(comm)?;
    Ok(c.report)
}
