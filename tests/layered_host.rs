//! Communicators that span (pseudo-)nodes on the host backend: all-reduce,
//! all-gather and reduce-scatter in two levels (node, then between nodes),
//! worlds above 8, nodes of unequal sizes, and clear errors for what a
//! communicator without a workspace or NCCL cannot do.

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{Call, CommOptions, Communicator, DType, Error, ReduceOp, Tensor};

fn opts(local: usize) -> CommOptions {
    CommOptions::default()
        .with_timeout(Duration::from_secs(60))
        .with_slot_bytes(16 << 10)
        .with_local_size(local)
}

fn put_i32(
    comm: &Communicator<HostDevice>,
    v: &[i32],
) -> ferrocomm::Result<<HostDevice as ferrocomm::device::Device>::Buffer> {
    let buf = comm.alloc(v.len().max(1) * 4)?;
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    comm.write(&buf, 0, &bytes)?;
    Ok(buf)
}

fn get_i32(
    comm: &Communicator<HostDevice>,
    buf: &<HostDevice as ferrocomm::device::Device>::Buffer,
    n: usize,
) -> ferrocomm::Result<Vec<i32>> {
    let mut bytes = vec![0u8; n * 4];
    comm.read(buf, 0, &mut bytes)?;
    Ok(bytes
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

/// Rank `r`'s element `i`.
fn value(r: usize, i: usize) -> i32 {
    ((r + 1) * 1000 + i * 7 % 997) as i32
}

/// Every rank checks all-reduce (counts that split across the node's ranks
/// and counts that do not), all-gather and reduce-scatter against the exact
/// integer result, for pseudo-node layouts of equal and unequal sizes and a
/// world above 8.
#[test]
fn reduce_gather_and_scatter_in_two_levels() {
    for (world, local) in [(3, 1), (4, 2), (6, 3), (6, 4), (12, 4)] {
        let results = run_thread_ranks(world, |rank, world, store| {
            let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, opts(local))?;
            let t = comm.topology();
            assert_eq!(t.nodes, world.div_ceil(local), "world {world} local {local}");
            let call = Call::new();
            for n in [local * 5, 7, 1000] {
                let mine: Vec<i32> = (0..n).map(|i| value(rank, i)).collect();
                let buf = put_i32(&comm, &mine)?;
                let t = Tensor::of(&buf, DType::I32);
                comm.all_reduce(t, ReduceOp::Sum, &call)?.wait(None)?;
                let want: Vec<i32> = (0..n).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
                assert_eq!(
                    get_i32(&comm, &buf, n)?,
                    want,
                    "all_reduce world {world} local {local} n {n}"
                );
                // Out of place, max.
                let src = put_i32(&comm, &mine)?;
                let dst = comm.alloc(n * 4)?;
                comm.all_reduce_into(
                    Tensor::of(&src, DType::I32),
                    Tensor::of(&dst, DType::I32),
                    ReduceOp::Max,
                    &call,
                )?
                .wait(None)?;
                let want: Vec<i32> = (0..n).map(|i| (0..world).map(|r| value(r, i)).max().unwrap()).collect();
                assert_eq!(
                    get_i32(&comm, &dst, n)?,
                    want,
                    "all_reduce max world {world} local {local} n {n}"
                );
            }
            let n = 13;
            let mine: Vec<i32> = (0..n).map(|i| value(rank, i)).collect();
            let input = put_i32(&comm, &mine)?;
            let gathered = comm.alloc(world * n * 4)?;
            comm.all_gather_single(Tensor::of(&gathered, DType::I32), Tensor::of(&input, DType::I32), &call)?
                .wait(None)?;
            let want: Vec<i32> = (0..world).flat_map(|r| (0..n).map(move |i| value(r, i))).collect();
            assert_eq!(
                get_i32(&comm, &gathered, world * n)?,
                want,
                "all_gather world {world} local {local}"
            );
            let whole: Vec<i32> = (0..world * n).map(|i| value(rank, i)).collect();
            let input = put_i32(&comm, &whole)?;
            let out = comm.alloc(n * 4)?;
            comm.reduce_scatter_single(
                Tensor::of(&out, DType::I32),
                Tensor::of(&input, DType::I32),
                ReduceOp::Sum,
                &call,
            )?
            .wait(None)?;
            let want: Vec<i32> = (0..n)
                .map(|i| (0..world).map(|r| value(r, rank * n + i)).sum())
                .collect();
            assert_eq!(
                get_i32(&comm, &out, n)?,
                want,
                "reduce_scatter world {world} local {local}"
            );
            if world > 8 {
                // No workspace over 12 ranks and no NCCL on the host: a clear
                // error, nothing launched.
                let b = comm.broadcast(Tensor::of(&out, DType::I32), 0, &call);
                assert!(matches!(b, Err(Error::Unsupported(_))), "{:?}", b.err());
            }
            // A barrier runs on every layout (across nodes without a
            // workspace: through the levels).
            comm.barrier(&call)?.wait(None)?;
            comm.finalize()
        });
        for (r, res) in results.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("world {world} local {local} rank {r}: {e}"));
        }
    }
}

/// Floating point sums in two levels give every rank the same bits, and an
/// average becomes a premul_sum by 1/world and a sum.
#[test]
fn two_level_floats_agree_on_every_rank() {
    let (world, local) = (4, 2);
    let n = 4096;
    let results = run_thread_ranks(world, |rank, world, store| {
        let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, opts(local))?;
        let vals: Vec<f32> = (0..n)
            .map(|i| ((rank * 7919 + i * 104729) % 10007) as f32 / 977.0 - 5.0)
            .collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        let buf = comm.alloc(n * 4)?;
        comm.write(&buf, 0, &bytes)?;
        comm.all_reduce(Tensor::of(&buf, DType::F32), ReduceOp::Sum, &Call::new())?
            .wait(None)?;
        let mut sum = vec![0u8; n * 4];
        comm.read(&buf, 0, &mut sum)?;
        comm.write(&buf, 0, &bytes)?;
        comm.all_reduce(Tensor::of(&buf, DType::F32), ReduceOp::Avg, &Call::new())?
            .wait(None)?;
        let mut avg = vec![0u8; n * 4];
        comm.read(&buf, 0, &mut avg)?;
        comm.finalize()?;
        Ok((sum, avg))
    });
    let results: Vec<(Vec<u8>, Vec<u8>)> = results.into_iter().map(|r| r.unwrap()).collect();
    for r in &results[1..] {
        assert_eq!(r.0, results[0].0, "sum bits differ between ranks");
        assert_eq!(r.1, results[0].1, "average bits differ between ranks");
    }
    let f = |b: &[u8], i: usize| f32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().unwrap()) as f64;
    for i in 0..n {
        let exact: f64 = (0..world)
            .map(|r| ((r * 7919 + i * 104729) % 10007) as f32 as f64 / 977.0 - 5.0)
            .sum();
        assert!(
            (f(&results[0].0, i) - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
            "sum {i}"
        );
        assert!(
            (f(&results[0].1, i) - exact / world as f64).abs() <= 1e-4 * (1.0 + exact.abs()),
            "avg {i}"
        );
    }
}
