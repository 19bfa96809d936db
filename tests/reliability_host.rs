//! Reliability cases that run in one process on the host backend: resource
//! leaks over many create/destroy cycles, and argument errors with no side
//! effects. (Killed, stalled and mismatched ranks are in `process_host.rs`.)

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::device::{Device, DeviceBuffer};
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{Call, CommOptions, Communicator, DType, Error, P2p, ReduceOp, Reduction, Tensor};

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
            let t = Tensor::of(&buf, DType::F32);
            comm.all_reduce(t, ReduceOp::Sum, &Call::new())?.wait(None)?;
            comm.all_gather_single(t, t.slice(rank * 32, 32)?, &Call::new())?
                .wait(None)?;
            let reg = comm.register(t)?;
            comm.deregister(reg)?;
            comm.finalize()?;
        }
        Ok(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// All in one test, and serial with the others of this binary, so no other
/// test's fds or threads blur the counts (a parallel test closing a store
/// socket once made the count drop by one).
#[test]
#[serial_test::serial]
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
        let t = Tensor::of(&small, DType::F32);
        let i = t.reinterpret(DType::I32)?;
        let call = Call::new();
        // A raw tensor far past anything allocated: refused by size, not touched.
        // SAFETY: never dereferenced (every call below fails its checks first).
        let huge = unsafe { Tensor::from_raw(small.ptr().0, usize::MAX / 2, DType::F32) };
        let errs = [
            Tensor::view(&small, DType::F32, 0, 5).err(),
            Tensor::view(&small, DType::F32, 8, 4).err(),
            comm.all_reduce(i, ReduceOp::Prod, &call).err(),
            comm.all_reduce(t, ReduceOp::BXor, &call).err(),
            // premul_sum without its factor does not compile (ReduceOp's docs).
            comm.all_reduce(huge, ReduceOp::Sum, &call).err(),
            comm.all_reduce_into(t, t.slice(0, 3)?, ReduceOp::Sum, &call).err(),
            comm.all_reduce_into(t, i, ReduceOp::Sum, &call).err(),
            comm.broadcast(t, 7, &call).err(),
            comm.reduce(t, ReduceOp::Sum, 2, &call).err(),
            comm.all_gather_single(t, t.slice(0, 3)?, &call).err(),
            comm.all_gather(&[t], t, &call).err(),
            comm.reduce_scatter_single(t.slice(0, 3)?, t, ReduceOp::Sum, &call)
                .err(),
            comm.all_to_all_single(t.slice(0, 3)?, t.slice(0, 3)?, &call).err(),
            comm.all_to_all_v_single(t, t.slice(0, 2)?, &[2, 2], &[1, 2], &call)
                .err(),
            comm.all_to_all_v_single(t, t, &[1, 3], &[3, 1], &call).err(),
            comm.gather(&[t], t, 5, &call).err(),
            comm.scatter(t, &[t], 5, &call).err(),
            comm.send(t, 9, &call).err(),
            comm.batch_p2p(&[P2p::Send(t, rank)], &call).err(),
            comm.batch_p2p(&[P2p::Send(t, 1 - rank), P2p::Recv(i, 1 - rank)], &call)
                .err(),
            comm.all_reduce(t, Reduction::premul_sum_device(i.slice(0, 1)?), &call)
                .err(),
            comm.split(&[0, 0], None).err(),
            comm.split(&[0, 5], None).err(),
        ];
        for (k, e) in errs.iter().enumerate() {
            assert!(
                matches!(e, Some(Error::InvalidArgument(_))),
                "case {k}: expected InvalidArgument, got {e:?}"
            );
        }
        // The communicator is still usable: the bad calls launched nothing.
        comm.write(&small, 0, &[0u8; 16])?;
        comm.all_reduce(t, ReduceOp::Sum, &call)?.wait(None)?;
        comm.finalize()
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// `split`: each rank joins the group of its parity; the groups work on
/// their own, and a rank that names no group it belongs to gets `None`.
#[test]
#[serial_test::serial]
fn split_gives_working_sub_communicators() {
    let results = run_thread_ranks(4, |rank, world, store| {
        let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, CommOptions::default())?;
        let group: Vec<usize> = (0..world).filter(|r| r % 2 == rank % 2).collect();
        let sub = comm
            .split(&group, Some("parity"))?
            .expect("a member gets a communicator");
        assert_eq!((sub.size(), sub.rank(), sub.name()), (2, rank / 2, "parity"));
        let buf = sub.alloc(4)?;
        sub.write(&buf, 0, &(rank as i32 + 1).to_le_bytes())?;
        sub.all_reduce(Tensor::of(&buf, DType::I32), ReduceOp::Sum, &Call::new())?
            .wait(None)?;
        let mut got = [0u8; 4];
        sub.read(&buf, 0, &mut got)?;
        let want: i32 = group.iter().map(|&r| r as i32 + 1).sum();
        assert_eq!(i32::from_le_bytes(got), want);
        // Ranks 0 and 1 make a group; 2 and 3 are not in theirs.
        let pair = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
        let own = comm.split(&pair, None)?;
        assert!(own.is_some());
        let none = comm.split(if rank < 2 { &[2usize, 3][..] } else { &[0usize, 1][..] }, None)?;
        assert!(none.is_none(), "rank {rank} is not in the group it named");
        sub.finalize()?;
        comm.finalize()
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// Registration: every rank maps every peer's buffer; a peer's tensor can
/// be copied from directly.
#[test]
#[serial_test::serial]
fn registered_buffers_are_reachable_from_peers() {
    let results = run_thread_ranks(3, |rank, world, store| {
        let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, CommOptions::default())?;
        let mine = comm.alloc(4096)?;
        comm.write(&mine, 100, &[rank as u8 + 7; 64])?;
        // A view at an offset inside the allocation.
        let reg = comm.register(Tensor::view(&mine, DType::U8, 100, 64)?)?;
        comm.barrier(&Call::new())?.wait(None)?;
        let local = comm.alloc(64)?;
        for peer in 0..world {
            let theirs = comm.peer_tensor(&reg, peer)?;
            assert_eq!(theirs.count(), 64);
            comm.device()
                .copy_device(local.ptr(), theirs.ptr(), 64, comm.stream())?;
            let mut got = [0u8; 64];
            comm.read(&local, 0, &mut got)?;
            assert!(
                got.iter().all(|&b| b == peer as u8 + 7),
                "rank {rank} read {got:?} from {peer}"
            );
        }
        // Memory the backend did not allocate cannot be shared.
        let heap = [0u8; 64];
        // SAFETY: host memory of this process, only exported (which fails), never written.
        let raw = unsafe { Tensor::from_raw(heap.as_ptr() as u64, 64, DType::U8) };
        assert!(matches!(comm.register(raw), Err(Error::Unsupported(_))));
        comm.barrier(&Call::new())?.wait(None)?;
        comm.deregister(reg)?;
        comm.finalize()
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

#[test]
#[serial_test::serial]
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
    let qr = ferrocomm::Algorithm::QuickReduce(ferrocomm::codec::Codec::Int4);
    let e = comm
        .all_reduce(Tensor::of(&buf, DType::F32), ReduceOp::Sum, &Call::new().algo(qr))
        .err();
    assert!(matches!(e, Some(Error::Unsupported(_))), "{e:?}");
    comm.finalize().unwrap();
}
