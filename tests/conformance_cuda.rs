//! The conformance suite on the CUDA backend (ranks as threads, one device
//! each), plus unit-level checks of the backend. Tests that need a GPU print
//! why they skipped and pass, unless `FERROCOMM_REQUIRE_GPU=1`.
//!
//! On a GPU machine run them one at a time, so that worlds do not share
//! devices: `cargo test --features cuda --test conformance_cuda -- --test-threads=1`.

#![cfg(feature = "cuda")]

use ferrocomm::backends::cuda::{self, CudaDevice};
use ferrocomm::device::{Device, DeviceBuffer, HostFlags, MemKind, ModuleSource};
use ferrocomm::testing::conformance::SuiteConfig;
use ferrocomm::Error;
use serial_test::serial;

/// Why `world` CUDA ranks cannot run here, if they cannot.
fn skip_reason(world: usize) -> Option<String> {
    match cuda::device_count() {
        Err(e) => return Some(format!("no usable CUDA driver: {e}")),
        Ok(n) if n < world => return Some(format!("{n} CUDA device(s) visible, {world} needed")),
        Ok(_) => {}
    }
    cuda::nvrtc_version()
        .err()
        .map(|e| format!("no NVRTC to compile kernels: {e}"))
}

/// Like the conformance macro: skip with a printed reason, or fail when
/// `FERROCOMM_REQUIRE_GPU=1`.
fn need(world: usize) -> bool {
    match skip_reason(world) {
        None => true,
        Some(reason) => {
            if std::env::var("FERROCOMM_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("FERROCOMM_REQUIRE_GPU=1 but the CUDA tests cannot run: {reason}");
            }
            eprintln!("SKIPPED: {reason}");
            false
        }
    }
}

ferrocomm::conformance_tests!(
    cuda_threads,
    CudaDevice::new,
    skip_reason,
    SuiteConfig::default(),
    ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"
);

/// Runs everywhere: with no driver or no device, opening one is an error,
/// never a panic; with devices, an ordinal past the last one is an error.
#[test]
fn opening_a_missing_device_is_an_error() {
    match cuda::device_count() {
        Err(e) => {
            assert!(
                matches!(
                    e,
                    Error::LibraryMissing { .. } | Error::NoDevice { .. } | Error::Backend { .. }
                ),
                "{e}"
            );
            let r = CudaDevice::new(0);
            assert!(
                matches!(
                    r,
                    Err(Error::LibraryMissing { .. } | Error::NoDevice { .. } | Error::Backend { .. })
                ),
                "{:?}",
                r.err()
            );
        }
        Ok(n) => {
            let r = CudaDevice::new(n);
            assert!(matches!(r, Err(Error::NoDevice { .. })), "{:?}", r.err());
            if n == 0 {
                assert!(matches!(CudaDevice::new(0), Err(Error::NoDevice { .. })));
            }
        }
    }
}

#[test]
#[serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn facts_describe_the_device() {
    if !need(1) {
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    let f = dev.facts();
    assert!(f.arch.starts_with("sm_"), "{}", f.arch);
    assert_eq!(f.warp_size, 32);
    assert!(f.multiprocessors > 0 && f.total_memory > 0);
    assert!(!f.name.is_empty());
    let g = ferrocomm::algo::GridTable::new(f)
        .unwrap()
        .grid(ferrocomm::algo::kernels::KernelKind::TwoShot, 64 << 20);
    assert_eq!(g.block, cuda::BLOCK_THREADS);
    assert!(g.grid >= 1 && g.grid <= f.multiprocessors.min(128));
}

/// Export on one device, import on another (or the same one when there is only
/// one), and move bytes both ways through the peer mapping.
#[test]
#[serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn export_import_round_trip() {
    if !need(1) {
        return;
    }
    let other = if cuda::device_count().unwrap() >= 2 { 1 } else { 0 };
    let a = CudaDevice::new(0).unwrap();
    let b = CudaDevice::new(other).unwrap();
    if other != 0 {
        assert!(
            cuda::can_access_peer(other, 0).unwrap(),
            "device {other} cannot reach device 0"
        );
    }
    let len = (3 << 20) + 5;
    let own = a.alloc(len, MemKind::Shareable).unwrap();
    let sa = a.create_stream().unwrap();
    let sb = b.create_stream().unwrap();

    // Shareable memory arrives zeroed.
    let mut back = vec![0xAAu8; len];
    a.copy_to_host(&own, 0, &mut back, &sa).unwrap();
    assert!(back.iter().all(|&x| x == 0), "a fresh shareable buffer is not zeroed");

    let pattern: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    a.copy_from_host(&own, 0, &pattern, &sa).unwrap();

    let handle = a.export(&own).unwrap();
    assert!(handle.fd.is_some());
    assert_eq!(handle.size, len);
    let peer = b.import(handle).unwrap();
    assert_eq!(peer.len(), len);

    // Read through the mapping on device b.
    let local = b.alloc(len, MemKind::Plain).unwrap();
    b.copy_device(local.ptr(), peer.ptr(), len, &sb).unwrap();
    let mut got = vec![0u8; len];
    b.copy_to_host(&local, 0, &mut got, &sb).unwrap();
    assert!(got == pattern, "bytes read through the peer mapping differ");

    // Write through the mapping from device b; device a sees it.
    b.memset(&local, 0, len, 0x5C, &sb).unwrap();
    b.copy_device(peer.ptr().offset(4096), local.ptr(), 8192, &sb).unwrap();
    b.synchronize(&sb).unwrap();
    a.copy_to_host(&own, 0, &mut got, &sa).unwrap();
    assert!(got[..4096] == pattern[..4096]);
    assert!(got[4096..4096 + 8192].iter().all(|&x| x == 0x5C));
    assert!(got[4096 + 8192..] == pattern[4096 + 8192..]);

    // Plain memory is not exportable; a forged handle is refused.
    let plain = a.alloc(64, MemKind::Plain).unwrap();
    assert!(matches!(a.export(&plain), Err(Error::InvalidArgument(_))));
    let forged = ferrocomm::device::ExportedHandle {
        bytes: vec![1, 2, 3],
        fd: None,
        size: 16,
    };
    assert!(matches!(b.import(forged), Err(Error::InvalidArgument(_))));
    drop(peer);
    assert_eq!(cuda::drop_error_count(), 0);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Exporting, importing and dropping many times leaks no descriptors and
/// releases everything without errors.
#[test]
#[serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn export_import_release_everything() {
    if !need(1) {
        return;
    }
    let other = if cuda::device_count().unwrap() >= 2 { 1 } else { 0 };
    let a = CudaDevice::new(0).unwrap();
    let b = CudaDevice::new(other).unwrap();
    // Warm up once so lazily opened driver descriptors are not counted.
    drop(
        b.import(a.export(&a.alloc(1 << 20, MemKind::Shareable).unwrap()).unwrap())
            .unwrap(),
    );
    drop((a.create_stream(), a.create_event(), a.alloc_host_flags(4)));
    let before = open_fds();
    for i in 0..200 {
        let own = a.alloc((i % 5 + 1) << 20, MemKind::Shareable).unwrap();
        let handle = a.export(&own).unwrap();
        let peer = b.import(handle).unwrap();
        drop(peer);
        drop(own);
        let _ = a.create_stream().unwrap();
        let _ = a.create_event().unwrap();
        let _ = a.alloc_host_flags(4).unwrap();
    }
    // A leak would add one descriptor per iteration; the slack absorbs sockets
    // that tests running in parallel open meanwhile.
    let after = open_fds();
    assert!(after < before + 100, "open descriptors grew from {before} to {after}");
    assert_eq!(cuda::drop_error_count(), 0);
}

#[test]
#[serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn events_time_work() {
    if !need(1) {
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    let s = dev.create_stream().unwrap();
    let (e0, e1) = (dev.create_event().unwrap(), dev.create_event().unwrap());
    let buf = dev.alloc(256 << 20, MemKind::Plain).unwrap();
    dev.record(&e0, &s).unwrap();
    for v in 0..8u8 {
        dev.memset(&buf, 0, buf.len(), v, &s).unwrap();
    }
    dev.record(&e1, &s).unwrap();
    dev.synchronize(&s).unwrap();
    assert!(dev.query(&e0).unwrap() && dev.query(&e1).unwrap());
    let ms = dev.elapsed_ms(&e0, &e1).unwrap();
    assert!(ms > 0.0 && ms < 10_000.0, "{ms} ms");

    // A stream waiting on an event of another stream.
    let s2 = dev.create_stream().unwrap();
    dev.wait_event(&s2, &e1).unwrap();
    dev.synchronize(&s2).unwrap();

    // Never recorded: complete by definition, but has no time.
    let fresh = dev.create_event().unwrap();
    assert!(dev.query(&fresh).unwrap());
    assert!(dev.elapsed_ms(&fresh, &e1).is_err());
}

#[test]
#[serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn graph_capture_and_replay_of_a_memset() {
    if !need(1) {
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    let s = dev.create_stream().unwrap();
    let len = 1 << 20;
    let buf = dev.alloc(len, MemKind::Plain).unwrap();
    assert!(!dev.is_capturing(&s).unwrap());
    dev.begin_capture(&s).unwrap();
    assert!(dev.is_capturing(&s).unwrap());
    assert!(dev.begin_capture(&s).is_err(), "a second begin_capture must fail");
    dev.memset(&buf, 4096, len - 4096, 0x5A, &s).unwrap();
    // Host copies and event records are refused while capturing, without
    // breaking the capture.
    assert!(dev.copy_from_host(&buf, 0, &[1, 2, 3], &s).is_err());
    let e = dev.create_event().unwrap();
    assert!(dev.record(&e, &s).is_err());
    let graph = dev.end_capture(&s).unwrap();
    assert!(!dev.is_capturing(&s).unwrap());

    let mut got = vec![0u8; len];
    dev.copy_to_host(&buf, 0, &mut got, &s).unwrap();
    assert!(got.iter().all(|&x| x == 0), "capture must not run the work");

    for _ in 0..3 {
        dev.launch_graph(&graph, &s).unwrap();
        dev.copy_to_host(&buf, 0, &mut got, &s).unwrap();
        assert!(got[..4096].iter().all(|&x| x == 0));
        assert!(got[4096..].iter().all(|&x| x == 0x5A));
        dev.memset(&buf, 0, len, 0, &s).unwrap();
    }
    assert!(matches!(dev.end_capture(&s), Err(Error::InvalidArgument(_))));
}

#[test]
#[serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn a_compile_error_is_reported_with_its_log() {
    if !need(1) {
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    let broken = ModuleSource::raw(
        "ferrocomm_broken_test",
        "extern \"C\" __global__ void k() { this_is_not_defined(); }\n",
        "",
    );
    match dev.load_module(&broken) {
        Err(Error::Compile { module, arch, log }) => {
            assert_eq!(module, "ferrocomm_broken_test");
            assert!(arch.starts_with("sm_") || arch.starts_with("compute_"), "{arch}");
            assert!(log.contains("this_is_not_defined"), "{log}");
        }
        other => panic!("expected a compile error, got {:?}", other.err()),
    }
}

#[test]
#[serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn modules_compile_once_and_launch_checks_its_arguments() {
    if !need(1) {
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    let src = ModuleSource::raw(
        "ferrocomm_tiny_test",
        "struct P { unsigned long long w[24]; };\n\
               extern \"C\" __global__ void fill(const P p) {\n\
                 unsigned int* out = (unsigned int*)p.w[9];\n\
                 unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n\
                 if (i < p.w[11]) out[i] = 0xC0FFEEu + i;\n\
               }\n",
        "",
    );
    let m = dev.load_module(&src).unwrap();
    let m2 = dev.load_module(&src).unwrap(); // from the process cache
    let s = dev.create_stream().unwrap();
    let n = 1000usize;
    let out = dev.alloc(n * 4, MemKind::Plain).unwrap();
    let params = ferrocomm::device::KernelParams {
        output: out.ptr(),
        count: n as u64,
        ..Default::default()
    };
    let cfg = ferrocomm::device::LaunchConfig { grid: 2, block: 512 };
    dev.launch(&m2, "fill", cfg, &params, &s).unwrap();
    let mut got = vec![0u8; n * 4];
    dev.copy_to_host(&out, 0, &mut got, &s).unwrap();
    for (i, c) in got.chunks_exact(4).enumerate() {
        assert_eq!(u32::from_le_bytes([c[0], c[1], c[2], c[3]]), 0xC0FFEE + i as u32);
    }
    assert!(matches!(
        dev.launch(&m, "nope", cfg, &params, &s),
        Err(Error::InvalidArgument(_))
    ));
    let too_big = ferrocomm::device::LaunchConfig { grid: 1, block: 1024 };
    assert!(matches!(
        dev.launch(&m, "fill", too_big, &params, &s),
        Err(Error::InvalidArgument(_))
    ));
    let too_many = ferrocomm::device::LaunchConfig { grid: 129, block: 512 };
    assert!(matches!(
        dev.launch(&m, "fill", too_many, &params, &s),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn host_flags_are_visible_to_both_sides() {
    if !need(1) {
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    let flags = dev.alloc_host_flags(4).unwrap();
    assert_ne!(flags.device_ptr().0, 0);
    assert_eq!((0..4).map(|i| flags.load(i)).collect::<Vec<_>>(), vec![0; 4]);
    flags.store(2, 7);
    assert_eq!(flags.load(2), 7);
    assert_eq!(flags.load(99), 0); // out of range reads as 0, like the host backend

    // A device copy writes into the words; the host sees it.
    let s = dev.create_stream().unwrap();
    let src = dev.alloc(16, MemKind::Plain).unwrap();
    dev.copy_from_host(&src, 0, &[9, 0, 0, 0, 8, 0, 0, 0, 7, 0, 0, 0, 6, 0, 0, 0], &s)
        .unwrap();
    dev.copy_device(flags.device_ptr(), src.ptr(), 16, &s).unwrap();
    dev.synchronize(&s).unwrap();
    assert_eq!((0..4).map(|i| flags.load(i)).collect::<Vec<_>>(), vec![9, 8, 7, 6]);
}

#[test]
#[serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn foreign_handles_are_refused() {
    if !need(2) {
        return;
    }
    let a = CudaDevice::new(0).unwrap();
    let b = CudaDevice::new(1).unwrap();
    let sb = b.create_stream().unwrap();
    let buf = a.alloc(64, MemKind::Plain).unwrap();
    assert!(matches!(a.memset(&buf, 0, 64, 0, &sb), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.memset(&buf, 0, 64, 0, &sb), Err(Error::InvalidArgument(_))));
}
