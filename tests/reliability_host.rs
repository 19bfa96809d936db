//! Reliability cases that run in one process on the host backend: resource
//! leaks over many create/destroy cycles, and argument errors with no side
//! effects. (Killed, stalled and mismatched ranks are in `process_host.rs`.)

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{CommOptions, Communicator, DType, Error, ReduceOp};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn shared_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().filter(|l| l.contains("memfd:ferrocomm")).count())
        .unwrap_or(0)
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

fn cycle(world: usize, cycles: usize) {
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(30))
        .with_slot_bytes(64 << 10);
    let results = run_thread_ranks(world, |rank, world, store| {
        for _ in 0..cycles {
            let comm = Communicator::new(HostDevice::new(rank)?, store.clone(), rank, world, opts.clone())?;
            let buf = comm.alloc(256)?;
            comm.all_reduce_in_place(&buf, 64, DType::F32, ReduceOp::Sum)?
                .wait(None)?;
            comm.finalize()?;
        }
        Ok(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// All in one test so no other test's fds or threads blur the counts.
#[test]
fn create_destroy_cycles_leak_nothing() {
    cycle(2, 5); // warm up lazily created process state (the store's threads, etc.)
    let (fds, maps, tasks) = (open_fds(), shared_mappings(), threads());
    cycle(2, 200);
    assert_eq!(open_fds(), fds, "file descriptors leaked over 200 cycles");
    assert_eq!(shared_mappings(), maps, "shared mappings leaked over 200 cycles");
    assert_eq!(
        shared_mappings(),
        0,
        "mappings remain after every communicator was dropped"
    );
    assert_eq!(threads(), tasks, "threads leaked over 200 cycles");

    bad_arguments_are_rejected_without_side_effects();
}

fn bad_arguments_are_rejected_without_side_effects() {
    let results = run_thread_ranks(2, |rank, world, store| {
        let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, CommOptions::default())?;
        let small = comm.alloc(16)?;
        let errs = [
            comm.all_reduce_in_place(&small, 5, DType::F32, ReduceOp::Sum).err(),
            comm.all_reduce_in_place(&small, 4, DType::I32, ReduceOp::Prod).err(),
            comm.all_reduce_in_place(&small, usize::MAX, DType::F32, ReduceOp::Sum)
                .err(),
            comm.broadcast(&small, &small, 4, DType::F32, 7).err(),
        ];
        for e in &errs {
            assert!(
                matches!(e, Some(Error::InvalidArgument(_))),
                "expected InvalidArgument, got {e:?}"
            );
        }
        // The communicator is still usable: the bad calls launched nothing.
        comm.write(&small, 0, &[0u8; 16])?;
        comm.all_reduce_in_place(&small, 4, DType::F32, ReduceOp::Sum)?
            .wait(None)?;
        comm.finalize()
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

#[test]
fn world_too_large_or_bad_rank_is_an_error() {
    let store: std::sync::Arc<dyn ferrocomm::bootstrap::Store> = ferrocomm::bootstrap::InProcStore::new();
    let e = Communicator::new(HostDevice::new(0).unwrap(), store.clone(), 3, 2, CommOptions::default()).err();
    assert!(matches!(e, Some(Error::InvalidArgument(_))), "{e:?}");
    let e = Communicator::new(HostDevice::new(0).unwrap(), store.clone(), 0, 9, CommOptions::default()).err();
    assert!(matches!(e, Some(Error::Unsupported(_))), "{e:?}");
    // Quick-reduce: opting in works; a dtype it cannot carry is refused, not
    // silently run another way.
    let quantized = CommOptions::default().with_quantization(ferrocomm::codec::Quantization::Int4);
    let comm = Communicator::new(HostDevice::new(0).unwrap(), store, 0, 1, quantized).unwrap();
    let buf = comm.alloc(64).unwrap();
    let qr = ferrocomm::algo::AlgoChoice::Fixed(ferrocomm::algo::Algorithm::QuickReduce(ferrocomm::codec::Codec::Int4));
    let e = comm
        .all_reduce_with(qr, &buf, &buf, 16, DType::F32, ReduceOp::Sum)
        .err();
    assert!(matches!(e, Some(Error::Unsupported(_))), "{e:?}");
    comm.finalize().unwrap();
}
