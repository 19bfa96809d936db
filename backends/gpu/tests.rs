use super::fake::{log, Fake, COMPILE_TIME};
use super::*;
use crate::device::{check_range, KERNEL_PARAMS_BYTES};
use std::thread::ThreadId;

#[test]
fn params_block_is_the_abi_size() {
    assert_eq!(KERNEL_PARAMS_BYTES, 448);
    // Both preludes pin the same size.
    assert!(include_str!("../../kernels-cuda/prelude.cuh").contains("static_assert(sizeof(FcParams) == 448"));
    let prelude = include_str!("../../kernels-hip/prelude.hip.h");
    assert!(prelude.contains("static_assert(sizeof(FcParams) == 448"));
}

#[test]
fn range_checks_reject_overflow() {
    assert!(check_range("x", 10, 5, 5).is_ok());
    assert!(check_range("x", 10, 5, 6).is_err());
    assert!(check_range("x", 10, usize::MAX, 2).is_err());
}

fn test_kernels() -> Vec<String> {
    ["a", "b", "c", "d", "e", "broken"]
        .iter()
        .map(|k| format!("fc_t_{k}"))
        .collect()
}

fn test_entry(name: &str) -> Option<String> {
    let k = name.strip_prefix("fc_t_")?;
    Some(if k == "broken" {
        format!("FC_KERNEL({name}) {{ this_is_not_defined(); }}\n")
    } else {
        format!("FC_KERNEL({name}) {{ }}\n")
    })
}

/// A per-kernel module no other test compiled.
fn lazy_source(tag: &str) -> ModuleSource {
    let name: &'static str = Box::leak(format!("fake_{tag}_{:?}", Instant::now()).into_boxed_str());
    let body: &'static str = Box::leak(format!("// body of {name}\n").into_boxed_str());
    ModuleSource {
        name,
        cuda: "",
        hip: body,
        kernels: test_kernels,
        entry: test_entry,
    }
}

fn compiles_of(module: &str) -> Vec<(String, ThreadId)> {
    log()
        .compiles
        .iter()
        .filter(|(u, _)| u.starts_with(module))
        .cloned()
        .collect()
}

const CFG: LaunchConfig = LaunchConfig::new(1, 64);

#[test]
fn modules_load_in_the_background_and_a_captured_launch_waits() {
    let dev = GpuDevice::<Fake>::new(0).unwrap();
    let src = lazy_source("capture");
    let started = Instant::now();
    let m = dev.load_module(&src).unwrap();
    assert!(started.elapsed() < COMPILE_TIME, "load_module waited for a compile");
    assert_eq!(m.unit_count(), 6);
    assert!(m.ready_count() < m.unit_count());

    // The first launch of a kernel, inside a capture: it waits, then is queued.
    let s = dev.create_stream().unwrap();
    dev.begin_capture(&s).unwrap();
    dev.launch(&m, "fc_t_e", CFG, &KernelParams::default(), &s).unwrap();
    let broken = dev.launch(&m, "fc_t_broken", CFG, &KernelParams::default(), &s);
    assert!(
        matches!(&broken, Err(Error::Compile { module, log, .. })
            if module.ends_with("/fc_t_broken") && log.contains("this_is_not_defined")),
        "{broken:?}"
    );
    assert!(
        dev.is_capturing(&s).unwrap(),
        "a failed launch leaves the capture alone"
    );
    dev.end_capture(&s).unwrap();
    assert!(log().launches.contains(&"fc_t_e".to_string()));
    // Bumped: `e` was compiled before the kernels queued ahead of it
    // finished (at most the one compiling when the launch came).
    let order: Vec<String> = compiles_of(src.name).into_iter().map(|c| c.0).collect();
    let e = order.iter().position(|u| u.ends_with("fc_t_e")).unwrap();
    assert!(e <= 1, "fc_t_e compiled at position {e}: {order:?}");

    // Nothing was compiled or loaded on this thread.
    let me = std::thread::current().id();
    assert!(compiles_of(src.name).iter().all(|(_, t)| *t != me));
    assert!(!log().loads.contains(&me));

    dev.prepare(&m, &["fc_t_a", "fc_t_b"]).unwrap();
    assert!(matches!(dev.prepare(&m, &[]), Err(Error::Compile { .. })));
    assert!(matches!(dev.prepare(&m, &["fc_t_zz"]), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        dev.launch(&m, "fc_t_zz", CFG, &KernelParams::default(), &s),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.ready_count(), 5);
    assert_eq!(compiles_of(src.name).len(), 6, "each kernel compiled once");
    assert!(dev.runtime_info().contains("fakecc"));
}

#[test]
fn devices_share_compiles_and_reuse_loaded_kernels() {
    let src = lazy_source("shared");
    let (a, b) = (GpuDevice::<Fake>::new(0).unwrap(), GpuDevice::<Fake>::new(1).unwrap());
    let ma = a.load_module(&src).unwrap();
    let mb = b.load_module(&src).unwrap();
    a.prepare(&ma, &["fc_t_a", "fc_t_b", "fc_t_c", "fc_t_d", "fc_t_e"])
        .unwrap();
    b.prepare(&mb, &["fc_t_a", "fc_t_b", "fc_t_c", "fc_t_d", "fc_t_e"])
        .unwrap();
    let compiled: Vec<String> = compiles_of(src.name).into_iter().map(|c| c.0).collect();
    let unique: std::collections::HashSet<&String> = compiled.iter().collect();
    assert_eq!(
        unique.len(),
        compiled.len(),
        "two devices, one compile per kernel: {compiled:?}"
    );
    assert!(compiled.len() >= 5);
    // Another handle on a device that has the kernels loaded is ready at once.
    let again = a.load_module(&src).unwrap();
    assert_eq!(again.ready_count(), 5, "the five good kernels, reused");
    let s = a.create_stream().unwrap();
    a.launch(&again, "fc_t_c", CFG, &KernelParams::default(), &s).unwrap();
    // Another device's module is refused.
    assert!(matches!(
        a.launch(&mb, "fc_t_c", CFG, &KernelParams::default(), &s),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn a_whole_module_compiles_before_load_returns() {
    let dev = GpuDevice::<Fake>::new(0).unwrap();
    let good = ModuleSource::raw("fake_raw_good", "", "FC_KERNEL(fill) {}\n// raw");
    let m = dev.load_module(&good).unwrap();
    assert_eq!((m.unit_count(), m.ready_count()), (1, 1));
    assert!(m.has_kernel("fill") && !m.has_kernel("nope"));
    let broken = ModuleSource::raw("fake_raw_broken", "", "this_is_not_defined();");
    match dev.load_module(&broken) {
        Err(Error::Compile { module, arch, .. }) => {
            assert_eq!((module.as_str(), arch.as_str()), ("fake_raw_broken", "fake1"))
        }
        other => panic!("{:?}", other.err()),
    }
    let empty = ModuleSource::raw("fake_raw_empty", "x", "");
    assert!(matches!(dev.load_module(&empty), Err(Error::Unsupported(_))));
}

#[test]
fn caller_memory_is_checked_and_shared() {
    let (a, b) = (GpuDevice::<Fake>::new(0).unwrap(), GpuDevice::<Fake>::new(1).unwrap());
    let buf = a.alloc(1 << 20, MemKind::Plain).unwrap();
    a.check_memory(buf.ptr(), 1 << 20).unwrap();
    a.check_memory(buf.ptr().offset(10), (1 << 20) - 10).unwrap();
    a.check_memory(DevicePtr(3), 0).unwrap();
    let past = a.check_memory(buf.ptr(), (1 << 20) + 1);
    assert!(
        matches!(&past, Err(Error::InvalidArgument(m)) if m.contains("past the end")),
        "{past:?}"
    );
    let unknown = a.check_memory(DevicePtr(0x7), 4);
    assert!(
        matches!(&unknown, Err(Error::InvalidArgument(m)) if m.contains("not in any")),
        "{unknown:?}"
    );
    let theirs = b.alloc(64, MemKind::Plain).unwrap();
    let other = a.check_memory(theirs.ptr(), 64);
    assert!(
        matches!(&other, Err(Error::InvalidArgument(m)) if m.contains("device 1")),
        "{other:?}"
    );

    // Caller memory: exported at an offset, served by address in this process.
    let (h, offset) = a.export_range(buf.ptr().offset(4096), 100).unwrap();
    assert_eq!((offset, h.size), (4096, 1 << 20));
    let peer = b.import(h).unwrap();
    assert_eq!(peer.ptr(), buf.ptr());
    assert!(a.export_range(buf.ptr(), (1 << 20) + 1).is_err());
    assert!(a.export_range(DevicePtr(0x7), 4).is_err());

    // Own shareable buffers: the mapping keeps the allocation alive.
    let own = a.alloc(5000, MemKind::Shareable).unwrap();
    let h = a.export(&own).unwrap();
    assert_eq!(h.size, 5000);
    let bytes = h.bytes.clone();
    let p1 = b.import(h).unwrap();
    assert_eq!(p1.ptr(), own.ptr());
    drop(own);
    let again = ExportedHandle {
        bytes: bytes.clone(),
        fd: None,
        size: 5000,
    };
    let p2 = b.import(again).unwrap();
    drop((p1, p2));
    let gone = b.import(ExportedHandle {
        bytes,
        fd: None,
        size: 5000,
    });
    assert!(
        matches!(&gone, Err(Error::InvalidArgument(m)) if m.contains("gone")),
        "{:?}",
        gone.err()
    );
}

#[test]
fn borrowed_streams_are_checked_and_usable() {
    let dev = GpuDevice::<Fake>::new(0).unwrap();
    // SAFETY: the fake driver has no real streams to outlive.
    let s = unsafe { dev.borrow_stream(0x1234) }.unwrap();
    assert_eq!(dev.raw_stream(&s), Some(0x1234));
    dev.synchronize(&s).unwrap();
    // SAFETY: as above.
    assert!(matches!(
        unsafe { dev.borrow_stream(0xbad) },
        Err(Error::InvalidArgument(_))
    ));
    let e = dev.create_event().unwrap();
    assert!(dev.wait_event_for(&e, Duration::from_millis(1)).unwrap());
}

/// Ranks that are threads of one process load every kernel (the fused
/// module's too) before `Communicator::new` returns: no module load may
/// race a peer's spinning kernel (`Communicator::preload_kernels`).
#[test]
fn thread_ranks_load_every_kernel_at_creation() {
    use crate::comm::{CommOptions, Communicator};
    use crate::testing::harness::run_thread_ranks;

    let results = run_thread_ranks(2, |rank, world, store| -> Result<(usize, usize, usize, usize)> {
        let dev = GpuDevice::<Fake>::new(rank)?;
        let opts = CommOptions::default()
            .with_timeout(Duration::from_secs(120))
            .with_slot_bytes(64 << 10)
            .with_autotune(false);
        let comm = Communicator::new(dev, store, rank, world, opts)?;
        let counts = comm.with_resources(|r| {
            let fused = r
                .fused_module
                .as_ref()
                .map_or((0, 1), |m| (m.ready_count(), m.unit_count()));
            (r.module.ready_count(), r.module.unit_count(), fused.0, fused.1)
        })?;
        comm.finalize()?;
        Ok(counts)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (ready, units, fused_ready, fused_units) = r.unwrap();
        assert_eq!(ready, units, "rank {rank}: collectives module");
        assert_eq!(fused_ready, fused_units, "rank {rank}: fused module");
        assert!(units > 0 && fused_units > 1, "rank {rank}");
    }
}

/// The data-moving collectives on a GPU communicator without NCCL/RCCL
/// (this build): the exchange / reduce-to kernels, with the per-peer
/// lists, the agreed count and the output by value in the params.
#[test]
fn data_collectives_enqueue_the_exchange_kernels_with_their_lists() {
    use crate::comm::{Call, CommOptions, Communicator, Reduction, Tensor};
    use crate::dtype::{DType, ReduceOp};
    use crate::testing::harness::run_thread_ranks;

    /// The last launch of `name` by `rank` whose params satisfy `pred`.
    fn launched(name: &str, rank: usize, pred: impl Fn(&KernelParams) -> bool) -> (LaunchConfig, KernelParams) {
        log()
            .launched
            .iter()
            .rev()
            .find(|(n, _, p)| n == name && p.rank as usize == rank && pred(p))
            .map(|(_, c, p)| (*c, *p))
            .unwrap_or_else(|| panic!("rank {rank}: no launch of {name}"))
    }

    let results = run_thread_ranks(2, |rank, world, store| -> Result<()> {
        let dev = GpuDevice::<Fake>::new(rank)?;
        // Small slots: the fake's allocations are 4 MiB apart. LL off:
        // these blocks would take the LL kinds, and the lists checked
        // here are the inbox kinds' (the LL kinds get the same params).
        let opts = CommOptions::default()
            .with_timeout(Duration::from_secs(30))
            .with_slot_bytes(64 << 10)
            .with_coll_ll_bytes(0)
            // The fake compiles each kernel in 40 ms, one at a time, and
            // places allocations 4 MiB apart: autotune's buffers would
            // overlap.
            .with_preload_kernels(false)
            .with_autotune(false);
        let comm = Communicator::new(dev, store, rank, world, opts)?;
        assert!(!comm.has_vendor_library());
        let dev = comm.device();
        let (a, b) = (dev.alloc(4096, MemKind::Plain)?, dev.alloc(4096, MemKind::Plain)?);
        let (ta, tb) = (Tensor::of(&a, DType::F32), Tensor::of(&b, DType::F32));
        let call = Call::new();
        let at = |t: &Tensor, k: usize| t.ptr().0 + 4 * k as u64;

        // All-gather (single): 16 elements to and from every peer.
        comm.all_gather_single(tb.slice(0, 32)?, ta.slice(0, 16)?, &call)?
            .wait(None)?;
        let (cfg, p) = launched("fc_exchange", rank, |p| p.per_peer[1][0] == at(&ta, 0));
        assert_eq!((p.count, p.world, p.dtype), (16, 2, DType::F32 as u32));
        assert_eq!(p.per_peer[0][..2], [16, 16]);
        assert_eq!(p.per_peer[1][..2], [at(&ta, 0), at(&ta, 0)]);
        assert_eq!(p.per_peer[2][..2], [16, 16]);
        assert_eq!(p.per_peer[3][..2], [at(&tb, 0), at(&tb, 16)]);
        assert_eq!(cfg.grid, 1, "64-byte blocks take one GPU block");

        // All-to-all-v: no agreed count (0), whatever the splits.
        // Rank s sends 1 + s + 2d elements to rank d.
        let (ins, outs) = ([1 + rank, 3 + rank], [1 + 2 * rank, 2 + 2 * rank]);
        comm.all_to_all_v_single(
            tb.slice(100, outs[0] + outs[1])?,
            ta.slice(100, ins[0] + ins[1])?,
            &outs,
            &ins,
            &call,
        )?
        .wait(None)?;
        let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[1][0] == at(&ta, 100));
        assert_eq!(p.count, 0);
        assert_eq!(p.per_peer[0][..2], [ins[0] as u64, ins[1] as u64]);
        assert_eq!(p.per_peer[1][..2], [at(&ta, 100), at(&ta, 100 + ins[0])]);
        assert_eq!(p.per_peer[2][..2], [outs[0] as u64, outs[1] as u64]);
        assert_eq!(p.per_peer[3][..2], [at(&tb, 100), at(&tb, 100 + outs[0])]);

        // All-to-all in place, equal splits: the same tensor, no staging.
        let t = ta.slice(200, 8)?;
        comm.all_to_all_single(t, t, &call)?.wait(None)?;
        let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[1][0] == at(&ta, 200));
        assert_eq!(p.per_peer[1][..2], [at(&ta, 200), at(&ta, 204)]);
        assert_eq!(p.per_peer[3][..2], p.per_peer[1][..2]);

        // A list whose output aliases another peer's input: the sends are staged.
        let (i0, i1) = (ta.slice(300, 4)?, ta.slice(304, 4)?);
        comm.all_to_all(&[i1, tb.slice(300, 4)?], &[i0, i1], &call)?
            .wait(None)?;
        let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[3][0] == at(&ta, 304));
        assert!(p.per_peer[1][..2].iter().all(|&x| x < at(&ta, 0) || x >= at(&ta, 1024)));

        // Reduce-scatter (single): every peer's block of 16 into our 16.
        comm.reduce_scatter_single(tb.slice(400, 16)?, ta.slice(400, 32)?, ReduceOp::Sum, &call)?
            .wait(None)?;
        let (_, p) = launched("fc_reduce_to_f32_sum", rank, |p| p.output.0 == at(&tb, 400));
        assert_eq!(p.count, 16);
        assert_eq!(p.per_peer[0][..2], [16, 16]);
        assert_eq!(p.per_peer[1][..2], [at(&ta, 400), at(&ta, 416)]);
        assert_eq!(p.per_peer[2][..2], [16, 16]);

        // Reduce-scatter of a list: the kernel takes the list as it is (no staging).
        let (i0, i1) = (ta.slice(450, 5)?, ta.slice(460, 5)?);
        comm.reduce_scatter(tb.slice(450, 5)?, &[i0, i1], ReduceOp::Max, &call)?
            .wait(None)?;
        let (_, p) = launched("fc_reduce_to_f32_max", rank, |p| p.output.0 == at(&tb, 450));
        assert_eq!(p.per_peer[1][..2], [at(&ta, 450), at(&ta, 460)]);

        // Reduce to rank 1 with premul_sum: only the root receives.
        let t = ta.slice(500, 8)?;
        comm.reduce(t, Reduction::premul_sum(0.5), 1, &call)?.wait(None)?;
        let (_, p) = launched("fc_reduce_to_f32_premul_sum", rank, |p| p.output.0 == at(&ta, 500));
        assert_eq!(p.per_peer[0][..2], [0, 8]);
        assert_eq!(p.per_peer[1][1], at(&ta, 500));
        let expect = if rank == 1 { [8, 8] } else { [0, 0] };
        assert_eq!(p.per_peer[2][..2], expect);
        assert_eq!(p.scalar, 0.5f32.to_bits() as u64);

        // Gather to 0 and scatter from 0.
        let outs = [tb.slice(600, 4)?, tb.slice(604, 4)?];
        let gathered: &[Tensor] = if rank == 0 { &outs } else { &[] };
        comm.gather(gathered, ta.slice(600, 4)?, 0, &call)?.wait(None)?;
        let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[1][0] == at(&ta, 600));
        assert_eq!((p.count, p.per_peer[0][..2].to_vec()), (4, vec![4, 0]));
        let ins = [ta.slice(700, 4)?, ta.slice(704, 4)?];
        let scattered: &[Tensor] = if rank == 0 { &ins } else { &[] };
        comm.scatter(tb.slice(700, 4)?, scattered, 0, &call)?.wait(None)?;
        let (_, p) = launched("fc_exchange", rank, |p| p.per_peer[3][0] == at(&tb, 700));
        assert_eq!(p.per_peer[2][..2], [4, 0]);
        comm.finalize()
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}
