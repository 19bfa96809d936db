//! What an engine-style client of the public API found, each case as a
//! regression test on the host backend (ranks as threads): choices that
//! depended on one rank's own addresses, teardown with work still queued on
//! a caller's stream, errors that left a call running, mismatches seen by
//! one side only, autotune measured again at every creation, and a null
//! raw tensor.

use std::time::{Duration, Instant};

use ferrocomm::backends::host::HostDevice;
use ferrocomm::device::Device;
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{Call, CommOptions, Communicator, DType, Error, ReduceOp, Tensor, TuneSource};

fn comm(
    rank: usize,
    world: usize,
    store: std::sync::Arc<dyn ferrocomm::bootstrap::Store>,
    opts: CommOptions,
) -> ferrocomm::Result<Communicator<HostDevice>> {
    Communicator::new(HostDevice::new(rank)?, store, rank, world, opts)
}

fn opts() -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(20))
}

fn all_ok<T: std::fmt::Debug>(results: Vec<ferrocomm::Result<T>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank}: {e}")))
        .collect()
}

/// Broadcast of bf16 views whose byte offsets differ per rank: the kernel's
/// element width used to follow each rank's own alignment, so ranks
/// launched different kernels (a `Mismatch` on both, or wrong data).
#[test]
fn broadcast_with_offsets_that_differ_per_rank() {
    for (off0, off1) in [(0usize, 2usize), (0, 1), (0, 0), (2, 2), (0, 4), (3, 0), (1, 6)] {
        for count in [1usize, 8, 9, 4097] {
            let got = all_ok(run_thread_ranks(2, |rank, world, store| {
                let comm = comm(rank, world, store, opts())?;
                let off = if rank == 0 { off0 } else { off1 };
                let buf = comm.alloc(off + count * 2 + 16)?;
                let t = Tensor::view(&buf, DType::BF16, off, count)?;
                let mine: Vec<u8> = (0..count * 2).map(|i| (i * 7 + rank * 101 + 1) as u8).collect();
                comm.write(&buf, off, &mine)?;
                comm.broadcast(t, 0, &Call::new())?.wait(None)?;
                let mut out = vec![0u8; count * 2];
                comm.read(&buf, off, &mut out)?;
                comm.finalize()?;
                Ok(out)
            }));
            let want: Vec<u8> = (0..count * 2).map(|i| (i * 7 + 1) as u8).collect();
            for (rank, out) in got.iter().enumerate() {
                assert_eq!(out, &want, "offsets {off0}/{off1}, {count} elements: rank {rank}");
            }
        }
    }
}

/// The same with the `Work` dropped (torchcomms' `async_op=False`): the
/// output must still be written, and the next call must not fail.
#[test]
fn broadcast_with_dropped_work_and_offsets_that_differ() {
    let got = all_ok(run_thread_ranks(2, |rank, world, store| {
        let comm = comm(rank, world, store, opts())?;
        let off = if rank == 0 { 0 } else { 2 };
        let buf = comm.alloc(64)?;
        let t = Tensor::view(&buf, DType::BF16, off, 8)?;
        let mine: Vec<u8> = (0..16).map(|i| (i + 16 * rank + 1) as u8).collect();
        comm.write(&buf, off, &mine)?;
        drop(comm.broadcast(t, 0, &Call::new())?);
        let other = comm.alloc(64)?;
        comm.all_reduce(Tensor::of(&other, DType::F32), ReduceOp::Sum, &Call::new())?
            .wait(None)?;
        let mut out = vec![0u8; 16];
        comm.read(&buf, off, &mut out)?;
        comm.finalize()?;
        Ok(out)
    }));
    let want: Vec<u8> = (0..16).map(|i| (i + 1) as u8).collect();
    assert_eq!(got, vec![want.clone(), want]);
}

/// `finalize` with a large all-gather still queued on a caller's stream: it
/// used to release the workspace under it (SIGSEGV). The README's teardown
/// order (finalize, then memory and streams) must be safe.
#[test]
fn finalize_waits_for_calls_on_caller_streams() {
    all_ok(run_thread_ranks(2, |rank, world, store| {
        let comm = comm(rank, world, store, opts())?;
        let s = comm.device().create_stream()?;
        let per = 64 << 20;
        let out = comm.alloc(per * world)?;
        let inp = comm.alloc(per)?;
        let w = comm.all_gather_single(Tensor::of(&out, DType::U8), Tensor::of(&inp, DType::U8), &Call::on(&s))?;
        comm.finalize()?;
        assert!(w.is_completed(), "finalize returned with the call still running");
        drop(out);
        drop(inp);
        drop(s);
        Ok(())
    }));
}

/// An error from `Work::wait` (other than a timeout shorter than the
/// call's) means the call has stopped: nothing it queued still runs.
#[test]
fn a_failed_wait_means_the_call_has_stopped() {
    let res = run_thread_ranks(2, |rank, world, store| {
        let comm = comm(
            rank,
            world,
            store,
            CommOptions::default().with_timeout(Duration::from_millis(300)),
        )?;
        let buf = comm.alloc(1 << 20)?;
        let t = Tensor::of(&buf, DType::F32);
        if rank == 1 {
            // Never joins the second call.
            comm.all_reduce(t, ReduceOp::Sum, &Call::new())?.wait(None)?;
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(true);
        }
        comm.all_reduce(t, ReduceOp::Sum, &Call::new())?.wait(None)?;
        let w = comm.all_reduce(t, ReduceOp::Sum, &Call::new())?;
        let err = w.wait(None).expect_err("a peer that never arrived");
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        Ok(w.is_completed())
    });
    let done = all_ok(res);
    assert!(done[0], "wait returned an error while the call still ran");
}

/// all-to-all-v where rank 1 expects one more element from rank 0 than
/// rank 0 sends: both sides must see `Mismatch`, not only the receiver.
#[test]
fn all_to_all_v_split_mismatch_is_seen_by_both_ranks() {
    let res = run_thread_ranks(2, |rank, world, store| {
        let comm = comm(rank, world, store, opts())?;
        let buf_in = comm.alloc(64)?;
        let buf_out = comm.alloc(64)?;
        // Rank 0 sends [2, 3], expects [2, 3]; rank 1 sends [3, 2] but
        // expects [4, 2] from rank 0 (one more than rank 0 sends it).
        let (ins, outs): (&[usize], &[usize]) = if rank == 0 {
            (&[2, 3], &[2, 2])
        } else {
            (&[2, 2], &[4, 2])
        };
        let (ni, no) = (ins.iter().sum(), outs.iter().sum());
        let i = Tensor::view(&buf_in, DType::F32, 0, ni)?;
        let o = Tensor::view(&buf_out, DType::F32, 0, no)?;
        comm.all_to_all_v_single(o, i, outs, ins, &Call::new())?.wait(None)
    });
    for (rank, r) in res.into_iter().enumerate() {
        assert!(matches!(r, Err(Error::Mismatch { .. })), "rank {rank}: {r:?}");
    }
}

/// All-reduce on one rank against an all-gather of the same bytes on the
/// other: a `Mismatch` on both, well before the timeout.
#[test]
fn different_collectives_are_a_mismatch_not_a_timeout() {
    for bytes in [256usize, 64 << 10, 1 << 20] {
        let start = Instant::now();
        let res = run_thread_ranks(2, |rank, world, store| {
            let comm = comm(
                rank,
                world,
                store,
                CommOptions::default().with_timeout(Duration::from_secs(10)),
            )?;
            let buf = comm.alloc(bytes)?;
            let t = Tensor::of(&buf, DType::F32);
            let w = if rank == 0 {
                comm.all_reduce(t, ReduceOp::Sum, &Call::new())?
            } else {
                comm.all_gather_single(t, t.slice(rank * t.count() / world, t.count() / world)?, &Call::new())?
            };
            w.wait(None)
        });
        let took = start.elapsed();
        for (rank, r) in res.into_iter().enumerate() {
            assert!(
                matches!(r, Err(Error::Mismatch { .. })),
                "{bytes} bytes, rank {rank}: {r:?}"
            );
        }
        assert!(took < Duration::from_secs(5), "{bytes} bytes: detected after {took:?}");
    }
}

/// A communicator created again with the same shape reads the table its
/// predecessor measured, and so does a sub-communicator of that shape: from
/// the cache file, or with the cache directory off from this process's
/// memory.
#[test]
#[serial_test::serial]
fn autotune_is_measured_once_per_shape() {
    let dir = std::env::temp_dir().join(format!("ferrocomm-autotune-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    autotune_once_per_shape(Some(&dir), |s| matches!(s, Some(TuneSource::Cached(_))));
    autotune_once_per_shape(None, |s| matches!(s, Some(TuneSource::Remembered)));
    let _ = std::fs::remove_dir_all(&dir);
}

fn autotune_once_per_shape(dir: Option<&std::path::Path>, reused: impl Fn(&Option<TuneSource>) -> bool) {
    match dir {
        Some(d) => std::env::set_var("FERROCOMM_CACHE_DIR", d),
        None => std::env::set_var("FERROCOMM_CACHE_DIR", "off"),
    }
    let sources = all_ok(run_thread_ranks(4, |rank, world, store| {
        let o = opts().with_autotune(true);
        let first = comm(rank, world, store.clone(), o.clone())?;
        let a = first.autotune_report().map(|r| r.source);
        let pair = first.split(&[0, 1], None)?;
        let b = pair.as_ref().and_then(|p| p.autotune_report()).map(|r| r.source);
        first.finalize()?;
        let again = comm(rank, world, store, o)?;
        let c = again.autotune_report().map(|r| r.source);
        let pair_again = again.split(&[0, 1], None)?;
        let d = pair_again.as_ref().and_then(|p| p.autotune_report()).map(|r| r.source);
        Ok((a, b, c, d))
    }));
    std::env::remove_var("FERROCOMM_CACHE_DIR");
    for (rank, (a, b, c, d)) in sources.into_iter().enumerate() {
        assert!(
            matches!(a, Some(TuneSource::Measured(_))),
            "{dir:?}, rank {rank}: first {a:?}"
        );
        assert!(reused(&c), "{dir:?}, rank {rank}: again {c:?}");
        if rank < 2 {
            assert!(
                matches!(b, Some(TuneSource::Measured(_))),
                "{dir:?}, rank {rank}: first pair {b:?}"
            );
            assert!(reused(&d), "{dir:?}, rank {rank}: pair again {d:?}");
        }
    }
}

/// A null raw tensor is refused, not dereferenced.
#[test]
fn a_null_raw_tensor_is_an_error() {
    let res = run_thread_ranks(2, |rank, world, store| {
        let comm = comm(rank, world, store, opts())?;
        // SAFETY: the call must refuse it before touching it.
        let t = unsafe { Tensor::from_raw(0, 16, DType::F32) };
        let e = comm.all_reduce(t, ReduceOp::Sum, &Call::new()).err();
        let buf = comm.alloc(64)?;
        // The communicator is still usable.
        comm.all_reduce(Tensor::of(&buf, DType::F32), ReduceOp::Sum, &Call::new())?
            .wait(None)?;
        Ok(e)
    });
    for (rank, e) in all_ok(res).into_iter().enumerate() {
        assert!(matches!(e, Some(Error::InvalidArgument(_))), "rank {rank}: {e:?}");
    }
}
