//! The conformance suite on the HIP backend (ranks as threads, one device
//! each), plus unit-level checks of the backend. Tests that need a GPU print
//! why they skipped and pass, unless `FERROCOMM_REQUIRE_GPU=1`.
//!
//! On an AMD GPU machine run them one at a time, so that worlds do not share
//! devices: `cargo test --features rocm --test conformance_hip -- --test-threads=1`.
//!
//! Without a GPU, `loading_the_backend_here_gives_a_clean_error` checks the
//! error this machine gets: set `FERROCOMM_EXPECT_HIP=no-device` where
//! Debian's libamdhip64 is installed (ci/check-kernels-hip.sh does), or
//! `missing` where no HIP runtime is, to require that exact outcome.

#![cfg(feature = "rocm")]

use ferrocomm::backends::hip::{self, HipDevice};
use ferrocomm::device::{Device, DeviceBuffer, HostFlags, MemKind, ModuleSource};
use ferrocomm::testing::conformance::SuiteConfig;
use ferrocomm::Error;
use serial_test::serial;

/// Why `world` HIP ranks cannot run here, if they cannot.
fn skip_reason(world: usize) -> Option<String> {
    match hip::device_count() {
        Err(e) => return Some(format!("no usable HIP runtime: {e}")),
        Ok(n) if n < world => return Some(format!("{n} HIP device(s) visible, {world} needed")),
        Ok(_) => {}
    }
    hip::hiprtc_version()
        .err()
        .map(|e| format!("no hipRTC to compile kernels: {e}"))
}

/// The collectives module's HIP text; assembled from the files while
/// src/algo/kernels.rs does not carry it yet.
fn collectives() -> ModuleSource {
    let m = ferrocomm::algo::kernels::COLLECTIVES;
    if !m.hip.is_empty() {
        return m;
    }
    let text = format!(
        "{}\n{}",
        include_str!("../kernels-hip/prelude.hip.h"),
        include_str!("../kernels-cuda/collectives.cu")
    );
    ModuleSource {
        hip: Box::leak(text.into_boxed_str()),
        ..m
    }
}

/// hipRTC to compile with but no device needed, or why not. Fails instead of
/// skipping when `FERROCOMM_EXPECT_HIPRTC=1`.
fn need_hiprtc() -> Option<(i32, i32)> {
    match hip::hiprtc_version() {
        Ok((v, path)) => {
            println!("hipRTC {}.{} from {path}", v.0, v.1);
            Some(v)
        }
        Err(e) => {
            if std::env::var("FERROCOMM_EXPECT_HIPRTC").as_deref() == Ok("1") {
                panic!("FERROCOMM_EXPECT_HIPRTC=1 but hipRTC cannot be loaded: {e}");
            }
            eprintln!("SKIPPED: no hipRTC: {e}");
            None
        }
    }
}

/// The gfx target to compile for without a device: `FERROCOMM_HIPRTC_TEST_ARCH`,
/// else gfx942 with ROCm 6+ and gfx90a with older runtimes (Debian's ROCm 5.2
/// hipRTC predates gfx942).
fn offline_arch() -> String {
    if let Ok(a) = std::env::var("FERROCOMM_HIPRTC_TEST_ARCH") {
        return a;
    }
    match hip::runtime_version() {
        Ok(((major, ..), _)) if major >= 6 => "gfx942".into(),
        _ => "gfx90a".into(),
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Like the conformance macro: skip with a printed reason, or fail when
/// `FERROCOMM_REQUIRE_GPU=1`.
fn need(world: usize) -> bool {
    match skip_reason(world) {
        None => true,
        Some(reason) => {
            if std::env::var("FERROCOMM_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("FERROCOMM_REQUIRE_GPU=1 but the HIP tests cannot run: {reason}");
            }
            eprintln!("SKIPPED: {reason}");
            false
        }
    }
}

ferrocomm::conformance_tests!(
    hip_threads,
    HipDevice::new,
    skip_reason,
    SuiteConfig::default(),
    ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"
);

/// Runs everywhere: with no runtime or no device, opening one is an error,
/// never a panic; with devices, an ordinal past the last one is an error.
#[test]
fn opening_a_missing_device_is_an_error() {
    match hip::device_count() {
        Err(e) => {
            assert!(
                matches!(
                    e,
                    Error::LibraryMissing { .. } | Error::NoDevice { .. } | Error::Backend { .. }
                ),
                "{e}"
            );
            let r = HipDevice::new(0);
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
            let r = HipDevice::new(n);
            assert!(matches!(r, Err(Error::NoDevice { .. })), "{:?}", r.err());
            if n == 0 {
                assert!(matches!(HipDevice::new(0), Err(Error::NoDevice { .. })));
            }
        }
    }
}

/// Loads the backend on this machine and reports what it found. With
/// `FERROCOMM_EXPECT_HIP` set, the outcome must be that one:
/// `no-device` (a HIP runtime loads and finds no GPU: Debian's libamdhip64 on
/// a CI machine), `missing` (no runtime), or `device` (a GPU is usable).
#[test]
fn loading_the_backend_here_gives_a_clean_error() {
    let count = hip::device_count();
    let opened = HipDevice::new(0);
    let outcome = match (&count, &opened) {
        (_, Ok(d)) => format!("device: {} ({})", d.facts().name, d.facts().arch),
        (Ok(0), Err(Error::NoDevice { reason, .. })) => format!("no-device: {reason}"),
        (Err(Error::LibraryMissing { library, reason }), Err(Error::LibraryMissing { .. })) => {
            format!("missing: {library}: {reason}")
        }
        (c, o) => panic!(
            "inconsistent outcome: device_count() = {c:?}, HipDevice::new(0) = {:?}",
            o.as_ref().err()
        ),
    };
    println!("HIP backend on this machine: {outcome}");
    if let Ok(((major, minor, patch), path)) = hip::runtime_version() {
        println!("HIP runtime {major}.{minor}.{patch} from {path}");
    }
    if let Ok(v) = std::env::var("FERROCOMM_EXPECT_HIP") {
        let want = v.trim();
        assert!(
            outcome.starts_with(&format!("{want}:")),
            "FERROCOMM_EXPECT_HIP={want} but the outcome was {outcome}"
        );
    }
    // Errors name what to fix.
    if let Err(e) = &opened {
        let text = e.to_string();
        assert!(text.contains("hip") || text.contains("libamdhip64"), "{text}");
    }
}

/// The run-time compile path with no GPU: hipRTC builds the collectives
/// module for a gfx target, and the code object holds every kernel and its
/// descriptor. Runs wherever a HIP runtime with hipRTC is installed (CI
/// installs Debian's libamdhip64-5, whose hipRTC is inside the runtime); it
/// takes a minute or two (`FERROCOMM_HIPRTC_OFFLINE=0` skips it).
#[test]
fn hiprtc_compiles_the_collectives_without_a_device() {
    if std::env::var("FERROCOMM_HIPRTC_OFFLINE").as_deref() == Ok("0") {
        eprintln!("SKIPPED: FERROCOMM_HIPRTC_OFFLINE=0");
        return;
    }
    if need_hiprtc().is_none() {
        return;
    }
    let arch = offline_arch();
    let started = std::time::Instant::now();
    let code = match hip::compile_module(&collectives(), &arch) {
        Ok(c) => c,
        Err(e) => panic!("hipRTC failed to compile the collectives for {arch}: {e}"),
    };
    println!(
        "hipRTC: collectives for {arch}: {} KiB in {:.1} s",
        code.len() / 1024,
        started.elapsed().as_secs_f64()
    );
    assert!(code.starts_with(b"\x7fELF"), "not an ELF code object");
    assert_eq!(u16::from_le_bytes([code[0x12], code[0x13]]), 224, "not an AMDGPU ELF");
    let missing: Vec<String> = ferrocomm::algo::kernels::collective_kernel_names()
        .into_iter()
        .filter(|n| !contains(&code, format!("{n}\0").as_bytes()) || !contains(&code, format!("{n}.kd\0").as_bytes()))
        .collect();
    assert!(missing.is_empty(), "kernels missing from the code object: {missing:?}");
}

/// A module that does not compile comes back as Error::Compile with hipRTC's
/// log, also without a device.
#[test]
fn hiprtc_reports_compile_errors_with_the_log() {
    if need_hiprtc().is_none() {
        return;
    }
    let arch = offline_arch();
    let broken = ModuleSource::raw(
        "ferrocomm_broken_offline",
        "",
        "extern \"C\" __attribute__((global)) void k() { this_is_not_defined(); }\n",
    );
    match hip::compile_module(&broken, &arch) {
        Err(Error::Compile { module, arch: a, log }) => {
            assert_eq!(module, "ferrocomm_broken_offline");
            assert_eq!(a, arch);
            assert!(log.contains("this_is_not_defined"), "{log}");
        }
        other => panic!("expected a compile error, got {:?}", other.map(|c| c.len())),
    }
    let empty = ModuleSource::raw("ferrocomm_empty_offline", "x", "");
    assert!(matches!(hip::compile_module(&empty, &arch), Err(Error::Unsupported(_))));
}

#[test]
#[serial]
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn facts_describe_the_device() {
    if !need(1) {
        return;
    }
    let dev = HipDevice::new(0).unwrap();
    let f = dev.facts();
    assert!(f.arch.starts_with("gfx"), "{}", f.arch);
    assert!(f.warp_size == 64 || f.warp_size == 32, "{}", f.warp_size);
    assert!(f.multiprocessors > 0 && f.total_memory > 0);
    assert!(dev.wallclock_khz() > 0);
    println!(
        "{} {} CUs={} wave={} clock={} kHz",
        f.name,
        f.arch,
        f.multiprocessors,
        f.warp_size,
        dev.wallclock_khz()
    );
    let g = ferrocomm::algo::GridTable::new(f)
        .unwrap()
        .grid(ferrocomm::algo::kernels::KernelKind::TwoShot, 64 << 20);
    assert_eq!(g.block, hip::BLOCK_THREADS);
    assert!(g.grid >= 1 && g.grid <= f.multiprocessors.min(128));
}

/// Export on one device, import on another (or the same one when there is only
/// one), and move bytes both ways through the peer mapping. In one process
/// the import takes the same-process path (HIP refuses to open its own IPC
/// handles); ferrocomm-worker runs exercise hipIpcOpenMemHandle.
#[test]
#[serial]
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn export_import_round_trip() {
    if !need(1) {
        return;
    }
    let other = if hip::device_count().unwrap() >= 2 { 1 } else { 0 };
    let a = HipDevice::new(0).unwrap();
    let b = HipDevice::new(other).unwrap();
    if other != 0 {
        assert!(
            hip::can_access_peer(other, 0).unwrap(),
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
    assert!(handle.fd.is_none(), "HIP handles travel as bytes only");
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
    // A handle of this process naming an address it never exported is refused.
    let mut h = a.export(&own).unwrap();
    let addr_at = 4 + 4 + 8 + 16 + 4 + 4;
    h.bytes[addr_at..addr_at + 8].copy_from_slice(&0x1234_0000u64.to_le_bytes());
    assert!(matches!(b.import(h), Err(Error::InvalidArgument(_))));
    drop(peer);
    assert_eq!(hip::drop_error_count(), 0);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Exporting, importing and dropping many times leaks no descriptors and
/// releases everything without errors.
#[test]
#[serial]
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn export_import_release_everything() {
    if !need(1) {
        return;
    }
    let other = if hip::device_count().unwrap() >= 2 { 1 } else { 0 };
    let a = HipDevice::new(0).unwrap();
    let b = HipDevice::new(other).unwrap();
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
    let after = open_fds();
    assert!(after < before + 100, "open descriptors grew from {before} to {after}");
    assert_eq!(hip::drop_error_count(), 0);
}

#[test]
#[serial]
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn events_time_work() {
    if !need(1) {
        return;
    }
    let dev = HipDevice::new(0).unwrap();
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
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn graph_capture_and_replay_of_a_memset() {
    if !need(1) {
        return;
    }
    let dev = HipDevice::new(0).unwrap();
    let s = dev.create_stream().unwrap();
    let len = 1 << 20;
    let buf = dev.alloc(len, MemKind::Plain).unwrap();
    assert!(!dev.is_capturing(&s).unwrap());
    dev.begin_capture(&s).unwrap();
    assert!(dev.is_capturing(&s).unwrap());
    assert!(dev.begin_capture(&s).is_err(), "a second begin_capture must fail");
    dev.memset(&buf, 4096, len - 4096, 0x5A, &s).unwrap();
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
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn a_compile_error_is_reported_with_its_log() {
    if !need(1) {
        return;
    }
    let dev = HipDevice::new(0).unwrap();
    let broken = ModuleSource::raw(
        "ferrocomm_broken_test",
        "",
        "extern \"C\" __attribute__((global)) void k() { this_is_not_defined(); }\n",
    );
    match dev.load_module(&broken) {
        Err(Error::Compile { module, arch, log }) => {
            assert_eq!(module, "ferrocomm_broken_test");
            assert!(arch.starts_with("gfx"), "{arch}");
            assert!(log.contains("this_is_not_defined"), "{log}");
        }
        other => panic!("expected a compile error, got {:?}", other.err()),
    }
    let empty = ModuleSource::raw("ferrocomm_empty_test", "x", "");
    assert!(matches!(dev.load_module(&empty), Err(Error::Unsupported(_))));
}

#[test]
#[serial]
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn modules_compile_once_and_launch_checks_its_arguments() {
    if !need(1) {
        return;
    }
    let dev = HipDevice::new(0).unwrap();
    // Builtins only, like the prelude: no dependence on hipRTC's headers.
    let src = ModuleSource::raw(
        "ferrocomm_tiny_test",
        "",
        "struct P { unsigned long long w[24]; };\n\
              extern \"C\" __attribute__((global)) void fill(const P p) {\n\
                unsigned int* out = (unsigned int*)p.w[9];\n\
                unsigned int i = __builtin_amdgcn_workgroup_id_x() * __builtin_amdgcn_workgroup_size_x()\n\
                                 + __builtin_amdgcn_workitem_id_x();\n\
                if (i < p.w[11]) out[i] = 0xC0FFEEu + i;\n\
              }\n",
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

/// The collectives module compiles with hipRTC for this device and exports
/// every kernel the algorithms launch.
#[test]
#[serial]
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn the_collectives_module_loads_with_every_kernel() {
    if !need(1) {
        return;
    }
    let dev = HipDevice::new(0).unwrap();
    let started = std::time::Instant::now();
    let m = dev.load_module(&collectives()).unwrap();
    println!(
        "collectives for {} in {:.1} s",
        dev.facts().arch,
        started.elapsed().as_secs_f64()
    );
    let missing: Vec<String> = ferrocomm::algo::kernels::collective_kernel_names()
        .into_iter()
        .filter(|n| !m.has_kernel(n))
        .collect();
    assert!(missing.is_empty(), "kernels missing from the hipRTC build: {missing:?}");
    assert!(!m.has_kernel("fc_no_such_kernel"));
}

#[test]
#[serial]
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn host_flags_are_visible_to_both_sides() {
    if !need(1) {
        return;
    }
    let dev = HipDevice::new(0).unwrap();
    let flags = dev.alloc_host_flags(4).unwrap();
    assert_ne!(flags.device_ptr().0, 0);
    assert_eq!((0..4).map(|i| flags.load(i)).collect::<Vec<_>>(), vec![0; 4]);
    flags.store(2, 7);
    assert_eq!(flags.load(2), 7);
    assert_eq!(flags.load(99), 0);

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
#[ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"]
fn foreign_handles_are_refused() {
    if !need(2) {
        return;
    }
    let a = HipDevice::new(0).unwrap();
    let b = HipDevice::new(1).unwrap();
    let sb = b.create_stream().unwrap();
    let buf = a.alloc(64, MemKind::Plain).unwrap();
    assert!(matches!(a.memset(&buf, 0, 64, 0, &sb), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.memset(&buf, 0, 64, 0, &sb), Err(Error::InvalidArgument(_))));
}
