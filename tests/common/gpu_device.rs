//! The GPU device tests, written once for every vendor: `gpu_device_tests!`
//! instantiates them for one [`Gpu`] (see `tests/conformance_cuda.rs` and
//! `tests/conformance_hip.rs`). Tests that need a GPU are `#[ignore]`d with
//! the reason; run with `--include-ignored` (`ci/gpu-cuda.sh`,
//! `ci/gpu-rocm.sh`) they print why they skip and pass, unless
//! `FERROCOMM_REQUIRE_GPU=1`, where a missing GPU fails them.
//!
//! Two tests run a copy of the test binary as a child process (a fresh
//! process for the cold start; another process to open a legacy IPC
//! handle): the child is the test named in `FERROCOMM_TEST_CHILD`.

#![allow(dead_code)]

use std::process::Command;
use std::time::Instant;

use ferrocomm::algo::kernels::{collective_kernel_names, COLLECTIVES};
use ferrocomm::device::{
    BackendKind, Device, DeviceBuffer, DevicePtr, ExportedHandle, HostFlags, KernelParams, LaunchConfig, MemKind,
    ModuleSource,
};
use ferrocomm::{Call, CommOptions, Communicator, DType, Error, ReduceOp, Tensor};

/// One vendor, as the tests see it.
pub struct Gpu<D: Device> {
    pub label: &'static str,
    pub backend: BackendKind,
    pub device_count: fn() -> ferrocomm::Result<usize>,
    /// Why kernels cannot be compiled here, if they cannot.
    pub compiler_missing: fn() -> Option<String>,
    pub open: fn(usize) -> ferrocomm::Result<D>,
    pub can_access_peer: fn(usize, usize) -> ferrocomm::Result<bool>,
    pub drop_errors: fn() -> u64,
    /// Whether the runtime can tell host memory and other devices' memory and
    /// streams apart (HIP before ROCm 6 cannot).
    pub strict: fn() -> bool,
    pub arch_prefixes: &'static [&'static str],
    pub warp_sizes: &'static [u32],
    /// Whether shareable buffers export as file descriptors.
    pub exports_fd: bool,
    pub block_threads: u32,
    /// A module holding its own entry point `fill`: `out[i] = 0xC0FFEE + i`
    /// with `out` = params word 9 and the count word 11.
    pub tiny: ModuleSource,
    /// A module that does not compile, with `this_is_not_defined` in its log.
    pub broken: ModuleSource,
    /// The body of the lazy test module: defines `TK(name)` (an entry point
    /// taking the 192-byte block) and `FILL(v)` (`out[i] = v + i`).
    pub lazy_body: &'static str,
}

/// Why `world` devices cannot run here, if they cannot.
pub fn skip_reason<D: Device>(g: &Gpu<D>, world: usize) -> Option<String> {
    match (g.device_count)() {
        Err(e) => return Some(format!("no usable {} runtime: {e}", g.label)),
        Ok(n) if n < world => return Some(format!("{n} {} device(s) visible, {world} needed", g.label)),
        Ok(_) => {}
    }
    (g.compiler_missing)()
}

/// Skip with a printed reason, or fail when `FERROCOMM_REQUIRE_GPU=1`.
pub fn need<D: Device>(g: &Gpu<D>, world: usize) -> bool {
    match skip_reason(g, world) {
        None => true,
        Some(reason) => {
            if std::env::var("FERROCOMM_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("FERROCOMM_REQUIRE_GPU=1 but the {} tests cannot run: {reason}", g.label);
            }
            eprintln!("SKIPPED: {reason}");
            false
        }
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn read_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Runs everywhere: with no runtime or no device, opening one is an error,
/// never a panic; with devices, an ordinal past the last one is an error.
pub fn opening_a_missing_device_is_an_error<D: Device>(g: &Gpu<D>) {
    match (g.device_count)() {
        Err(e) => {
            assert!(
                matches!(
                    e,
                    Error::LibraryMissing { .. } | Error::NoDevice { .. } | Error::Backend { .. }
                ),
                "{e}"
            );
            let r = (g.open)(0);
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
            let r = (g.open)(n);
            assert!(matches!(r, Err(Error::NoDevice { .. })), "{:?}", r.err());
        }
    }
}

pub fn facts_describe_the_device<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
    let f = dev.facts();
    assert_eq!(f.backend, g.backend);
    assert!(g.arch_prefixes.iter().any(|p| f.arch.starts_with(p)), "{}", f.arch);
    assert!(g.warp_sizes.contains(&f.warp_size), "{}", f.warp_size);
    assert!(f.multiprocessors > 0 && f.total_memory > 0);
    assert!(!f.name.is_empty());
    println!(
        "{} {} SMs/CUs={} warp={}",
        f.name, f.arch, f.multiprocessors, f.warp_size
    );
    println!("runtime: {}", dev.runtime_info());
    let grid = ferrocomm::algo::GridTable::new(f)
        .unwrap()
        .grid(ferrocomm::algo::kernels::KernelKind::TwoShot, 64 << 20);
    assert_eq!(grid.block, g.block_threads);
    assert!(grid.grid >= 1 && grid.grid <= f.multiprocessors.min(128));
}

/// Export on one device, import on another (or the same one when there is
/// only one), and move bytes both ways through the peer mapping.
pub fn export_import_round_trip<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let other = if (g.device_count)().unwrap() >= 2 { 1 } else { 0 };
    let a = (g.open)(0).unwrap();
    let b = (g.open)(other).unwrap();
    if other != 0 {
        assert!(
            (g.can_access_peer)(other, 0).unwrap(),
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

    let pattern = pattern(len);
    a.copy_from_host(&own, 0, &pattern, &sa).unwrap();

    let handle = a.export(&own).unwrap();
    assert_eq!(handle.fd.is_some(), g.exports_fd);
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

    // Plain memory is not exportable this way; a forged handle is refused.
    let plain = a.alloc(64, MemKind::Plain).unwrap();
    assert!(matches!(a.export(&plain), Err(Error::InvalidArgument(_))));
    let forged = ExportedHandle {
        bytes: vec![1, 2, 3],
        fd: None,
        size: 16,
    };
    assert!(matches!(b.import(forged), Err(Error::InvalidArgument(_))));
    drop(peer);
    assert_eq!((g.drop_errors)(), 0);
}

/// Exporting, importing and dropping many times leaks no descriptors and
/// releases everything without errors.
pub fn export_import_release_everything<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let other = if (g.device_count)().unwrap() >= 2 { 1 } else { 0 };
    let a = (g.open)(0).unwrap();
    let b = (g.open)(other).unwrap();
    // Warm up once so lazily opened driver descriptors are not counted.
    drop(
        b.import(a.export(&a.alloc(1 << 20, MemKind::Shareable).unwrap()).unwrap())
            .unwrap(),
    );
    drop((a.create_stream(), a.create_event(), a.alloc_host_flags(4)));
    let before = open_fds();
    for i in 0..200 {
        let own = a.alloc((i % 5 + 1) << 20, MemKind::Shareable).unwrap();
        let peer = b.import(a.export(&own).unwrap()).unwrap();
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
    assert_eq!((g.drop_errors)(), 0);
}

pub fn events_time_work<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
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
    assert!(dev.wait_event_for(&e1, std::time::Duration::from_millis(1)).unwrap());

    // A stream waiting on an event of another stream.
    let s2 = dev.create_stream().unwrap();
    dev.wait_event(&s2, &e1).unwrap();
    dev.synchronize(&s2).unwrap();

    // Never recorded: complete by definition, but has no time.
    let fresh = dev.create_event().unwrap();
    assert!(dev.query(&fresh).unwrap());
    assert!(dev.elapsed_ms(&fresh, &e1).is_err());
}

pub fn graph_capture_and_replay_of_a_memset<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
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

pub fn a_compile_error_is_reported_with_its_log<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
    match dev.load_module(&g.broken) {
        Err(Error::Compile { module, arch, log }) => {
            assert_eq!(module, g.broken.name);
            assert!(g.arch_prefixes.iter().any(|p| arch.starts_with(p)), "{arch}");
            assert!(log.contains("this_is_not_defined"), "{log}");
        }
        other => panic!("expected a compile error, got {:?}", other.err()),
    }
    let empty = ModuleSource::raw("ferrocomm_empty_test", "", "");
    assert!(matches!(dev.load_module(&empty), Err(Error::Unsupported(_))));
}

pub fn modules_compile_once_and_launch_checks_its_arguments<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
    let m = dev.load_module(&g.tiny).unwrap();
    let m2 = dev.load_module(&g.tiny).unwrap(); // from the process cache
    let s = dev.create_stream().unwrap();
    let n = 1000usize;
    let out = dev.alloc(n * 4, MemKind::Plain).unwrap();
    let params = KernelParams {
        output: out.ptr(),
        count: n as u64,
        ..Default::default()
    };
    let cfg = LaunchConfig::new(2, 512);
    dev.launch(&m2, "fill", cfg, &params, &s).unwrap();
    let mut got = vec![0u8; n * 4];
    dev.copy_to_host(&out, 0, &mut got, &s).unwrap();
    for (i, w) in read_words(&got).into_iter().enumerate() {
        assert_eq!(w, 0xC0FFEE + i as u32);
    }
    assert!(matches!(
        dev.launch(&m, "nope", cfg, &params, &s),
        Err(Error::InvalidArgument(_))
    ));
    let too_big = LaunchConfig::new(1, 1024);
    assert!(matches!(
        dev.launch(&m, "fill", too_big, &params, &s),
        Err(Error::InvalidArgument(_))
    ));
    let too_many = LaunchConfig::new(129, 512);
    assert!(matches!(
        dev.launch(&m, "fill", too_many, &params, &s),
        Err(Error::InvalidArgument(_))
    ));
}

pub fn host_flags_are_visible_to_both_sides<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
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

pub fn foreign_handles_are_refused<D: Device>(g: &Gpu<D>) {
    if !need(g, 2) {
        return;
    }
    let a = (g.open)(0).unwrap();
    let b = (g.open)(1).unwrap();
    let sb = b.create_stream().unwrap();
    let buf = a.alloc(64, MemKind::Plain).unwrap();
    assert!(matches!(a.memset(&buf, 0, 64, 0, &sb), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.memset(&buf, 0, 64, 0, &sb), Err(Error::InvalidArgument(_))));
    let ea = a.create_event().unwrap();
    assert!(matches!(b.query(&ea), Err(Error::InvalidArgument(_))));
}

/// The collectives module compiles for this device and exports every kernel
/// the algorithms launch (`prepare` waits for all of them).
pub fn the_collectives_module_loads_with_every_kernel<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
    let started = Instant::now();
    let m = dev.load_module(&COLLECTIVES).unwrap();
    let queued = started.elapsed();
    dev.prepare(&m, &[]).unwrap();
    println!(
        "collectives for {}: load_module returned in {:.3} s, every kernel ready after {:.1} s ({})",
        dev.facts().arch,
        queued.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        dev.runtime_info()
    );
    assert!(queued.as_secs_f64() < 2.0, "load_module must not wait for the compiler");
    assert!(matches!(
        dev.prepare(&m, &["fc_no_such_kernel"]),
        Err(Error::InvalidArgument(_))
    ));
    for name in collective_kernel_names() {
        dev.prepare(&m, &[&name]).unwrap();
    }
}

// ---- caller streams and memory ----

/// A borrowed stream is used like an owned one and never destroyed.
pub fn borrowed_streams_work_and_stay_the_callers<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
    let own = dev.create_stream().unwrap();
    let raw = dev.raw_stream(&own).expect("GPU streams have a raw handle");
    let buf = dev.alloc(4096, MemKind::Plain).unwrap();
    {
        // SAFETY: `own` outlives the borrowed wrapper and its work.
        let borrowed = unsafe { dev.borrow_stream(raw) }.unwrap();
        assert_eq!(dev.raw_stream(&borrowed), Some(raw));
        dev.memset(&buf, 0, 4096, 0x11, &borrowed).unwrap();
        let mut got = vec![0u8; 4096];
        dev.copy_to_host(&buf, 0, &mut got, &borrowed).unwrap();
        assert!(got.iter().all(|&x| x == 0x11));
    }
    // The caller's stream is still alive after the wrapper dropped.
    dev.memset(&buf, 0, 4096, 0x22, &own).unwrap();
    dev.synchronize(&own).unwrap();
    // The legacy default stream (what engines often run on) can be borrowed.
    // SAFETY: the default stream lives as long as the context.
    let default = unsafe { dev.borrow_stream(0) }.unwrap();
    let mut got = vec![0u8; 4096];
    dev.copy_to_host(&buf, 0, &mut got, &default).unwrap();
    assert!(got.iter().all(|&x| x == 0x22));
    drop(default);
    assert_eq!((g.drop_errors)(), 0);

    if (g.device_count)().unwrap() >= 2 {
        let other = (g.open)(1).unwrap();
        let theirs = other.create_stream().unwrap();
        let raw1 = other.raw_stream(&theirs).unwrap();
        // SAFETY: `theirs` outlives the attempt.
        match unsafe { dev.borrow_stream(raw1) } {
            Err(Error::InvalidArgument(m)) => println!("device 1's stream refused: {m}"),
            Ok(_) if !(g.strict)() => println!("this runtime cannot tell a stream's device; accepted"),
            other => panic!("device 1's stream borrowed by device 0: {:?}", other.err()),
        }
    }
}

/// check_memory refuses host memory, past-the-end ranges and another
/// device's memory, and accepts what kernels can use.
pub fn check_memory_refuses_what_kernels_cannot_use<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
    let len = 1 << 20;
    let plain = dev.alloc(len, MemKind::Plain).unwrap();
    let shared = dev.alloc(len, MemKind::Shareable).unwrap();
    for buf in [plain.ptr(), shared.ptr()] {
        dev.check_memory(buf, len).unwrap();
        dev.check_memory(buf.offset(100), len - 100).unwrap();
        dev.check_memory(DevicePtr(1), 0).unwrap(); // nothing to touch
    }
    if !(g.strict)() {
        println!("SKIPPED the refusals: this runtime cannot tell what memory an address is");
        return;
    }
    let past = dev.check_memory(plain.ptr(), len + (64 << 20));
    assert!(
        matches!(&past, Err(Error::InvalidArgument(m)) if m.contains("past the end")),
        "{past:?}"
    );
    let heap = vec![0u8; 4096];
    let host = dev.check_memory(DevicePtr(heap.as_ptr() as u64), heap.len());
    assert!(matches!(host, Err(Error::InvalidArgument(_))), "{host:?}");
    let flags = dev.alloc_host_flags(4).unwrap();
    let pinned = dev.check_memory(flags.device_ptr(), 16);
    assert!(
        matches!(&pinned, Err(Error::InvalidArgument(m)) if m.contains("host")),
        "{pinned:?}"
    );
    if (g.device_count)().unwrap() >= 2 {
        let other = (g.open)(1).unwrap();
        let theirs = other.alloc(4096, MemKind::Plain).unwrap();
        let r = dev.check_memory(theirs.ptr(), 4096);
        assert!(
            matches!(&r, Err(Error::InvalidArgument(m)) if m.contains("device 1")),
            "{r:?}"
        );
    }
}

/// export_range shares caller memory: a plain allocation (cuMemAlloc /
/// hipMalloc) and a shareable one, at an offset inside, imported on another
/// device (or the same) of this process.
pub fn export_range_shares_caller_memory<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let other = if (g.device_count)().unwrap() >= 2 { 1 } else { 0 };
    let a = (g.open)(0).unwrap();
    let b = (g.open)(other).unwrap();
    let (sa, sb) = (a.create_stream().unwrap(), b.create_stream().unwrap());
    let len = 3 << 20;
    let pattern = pattern(len);
    for kind in [MemKind::Plain, MemKind::Shareable] {
        let buf = a.alloc(len, kind).unwrap();
        a.copy_from_host(&buf, 0, &pattern, &sa).unwrap();
        let (handle, offset) = a.export_range(buf.ptr().offset(4096), 8192).unwrap();
        assert_eq!(offset, 4096, "{kind:?}: the offset of the range in its allocation");
        let peer = b.import(handle).unwrap();
        assert!(peer.len() >= offset + 8192);
        let local = b.alloc(8192, MemKind::Plain).unwrap();
        b.copy_device(local.ptr(), peer.ptr().offset(offset), 8192, &sb)
            .unwrap();
        let mut got = vec![0u8; 8192];
        b.copy_to_host(&local, 0, &mut got, &sb).unwrap();
        assert!(
            got == pattern[4096..4096 + 8192],
            "{kind:?}: bytes through the mapping differ"
        );
        drop(peer);
    }
    if (g.strict)() {
        let heap = vec![0u8; 4096];
        assert!(a.export_range(DevicePtr(heap.as_ptr() as u64), 4096).is_err());
    }
    assert_eq!((g.drop_errors)(), 0);
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}

/// Run this test binary's test `name` in a child process with `env`.
fn run_child(name: &str, env: &[(&str, String)]) -> std::process::Output {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env("FERROCOMM_TEST_CHILD", name);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("starting the child test process")
}

fn child_says(out: &std::process::Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(what),
        "child failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout
        .lines()
        .filter(|l| l.contains(what))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether this process is the child `name`.
fn is_child(name: &str) -> bool {
    std::env::var("FERROCOMM_TEST_CHILD").as_deref() == Ok(name)
}

/// A plain (cuMemAlloc / hipMalloc) range exported here is opened by another
/// process with the vendor's IPC open call.
pub fn export_range_across_processes<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
    let s = dev.create_stream().unwrap();
    let len = 2 << 20;
    let buf = dev.alloc(len, MemKind::Plain).unwrap();
    dev.copy_from_host(&buf, 0, &pattern(len), &s).unwrap();
    let (handle, offset) = dev.export_range(buf.ptr().offset(1000), 5000).unwrap();
    assert!(handle.fd.is_none(), "a plain range exports as an IPC handle");
    let importer = if (g.device_count)().unwrap() >= 2 { 1 } else { 0 };
    let out = run_child(
        "child_opens_an_exported_range",
        &[
            ("FERROCOMM_TEST_HANDLE", hex(&handle.bytes)),
            ("FERROCOMM_TEST_SIZE", handle.size.to_string()),
            ("FERROCOMM_TEST_OFFSET", offset.to_string()),
            ("FERROCOMM_TEST_DEVICE", importer.to_string()),
        ],
    );
    println!("{}", child_says(&out, "CHILD OK"));
    drop(buf);
}

/// The child of [`export_range_across_processes`].
pub fn child_opens_an_exported_range<D: Device>(g: &Gpu<D>) {
    if !is_child("child_opens_an_exported_range") {
        println!("runs as the child of export_range_across_processes");
        return;
    }
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let bytes = unhex(&env("FERROCOMM_TEST_HANDLE"));
    let size: usize = env("FERROCOMM_TEST_SIZE").parse().unwrap();
    let offset: usize = env("FERROCOMM_TEST_OFFSET").parse().unwrap();
    let dev = (g.open)(env("FERROCOMM_TEST_DEVICE").parse().unwrap()).unwrap();
    let peer = dev.import(ExportedHandle { bytes, fd: None, size }).unwrap();
    let s = dev.create_stream().unwrap();
    let local = dev.alloc(5000, MemKind::Plain).unwrap();
    dev.copy_device(local.ptr(), peer.ptr().offset(offset), 5000, &s)
        .unwrap();
    let mut got = vec![0u8; 5000];
    dev.copy_to_host(&local, 0, &mut got, &s).unwrap();
    assert!(got == pattern(size)[1000..6000], "bytes through the IPC mapping differ");
    drop(peer);
    assert_eq!((g.drop_errors)(), 0);
    println!("CHILD OK: another process opened the range and read it");
}

// ---- lazy per-kernel compile ----

fn lazy_kernels() -> Vec<String> {
    ["a", "b", "c", "d", "e", "f", "broken"]
        .iter()
        .map(|k| format!("fc_lazy_{k}"))
        .collect()
}

fn lazy_entry(name: &str) -> Option<String> {
    let k = name.strip_prefix("fc_lazy_")?;
    if k == "broken" {
        return Some(format!("TK({name}) {{ this_is_not_defined(); }}\n"));
    }
    let v = k.bytes().next().filter(u8::is_ascii_lowercase)? - b'a';
    Some(format!("TK({name}) FILL({}u)\n", 1000 * (v as u32 + 1)))
}

/// A per-kernel module no other test compiled (its text carries a nonce).
pub fn lazy_module<D: Device>(g: &Gpu<D>) -> ModuleSource {
    let nonce = format!(
        "\n// test nonce {} {:?}\n",
        std::process::id(),
        std::time::SystemTime::now()
    );
    let body: &'static str = Box::leak(format!("{}{nonce}", g.lazy_body).into_boxed_str());
    let (cuda, hip) = match g.backend {
        BackendKind::Hip => ("", body),
        _ => (body, ""),
    };
    ModuleSource {
        name: "ferrocomm_lazy_test",
        cuda,
        hip,
        kernels: lazy_kernels,
        entry: lazy_entry,
    }
}

/// load_module returns before anything is compiled; the first launch of a
/// kernel inside a graph capture waits for it and is captured; a kernel that
/// does not compile fails its launch and `prepare` with the compiler's log.
pub fn first_launch_inside_a_capture_waits_for_its_kernel<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dev = (g.open)(0).unwrap();
    let started = Instant::now();
    let m = dev.load_module(&lazy_module(g)).unwrap();
    let queued = started.elapsed();
    let s = dev.create_stream().unwrap();
    let n = 777usize;
    let out = dev.alloc(n * 4, MemKind::Plain).unwrap();
    let params = KernelParams {
        output: out.ptr(),
        count: n as u64,
        ..Default::default()
    };
    let cfg = LaunchConfig::new(2, 512);
    dev.begin_capture(&s).unwrap();
    let launched = dev.launch(&m, "fc_lazy_e", cfg, &params, &s);
    let broken = dev.launch(&m, "fc_lazy_broken", cfg, &params, &s);
    let graph = dev.end_capture(&s).unwrap();
    launched.unwrap();
    assert!(
        matches!(&broken, Err(Error::Compile { log, .. }) if log.contains("this_is_not_defined")),
        "{broken:?}"
    );
    println!(
        "load_module returned in {:.3} s; the first launch (in a capture) after {:.2} s",
        queued.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let mut got = vec![0u8; n * 4];
    dev.copy_to_host(&out, 0, &mut got, &s).unwrap();
    assert!(got.iter().all(|&x| x == 0), "capture must not run the kernel");
    dev.launch_graph(&graph, &s).unwrap();
    dev.copy_to_host(&out, 0, &mut got, &s).unwrap();
    for (i, w) in read_words(&got).into_iter().enumerate() {
        assert_eq!(w, 5000 + i as u32);
    }
    dev.prepare(&m, &["fc_lazy_a", "fc_lazy_b"]).unwrap();
    assert!(matches!(dev.prepare(&m, &[]), Err(Error::Compile { .. })));
    assert!(matches!(
        dev.prepare(&m, &["fc_lazy_broken"]),
        Err(Error::Compile { .. })
    ));
    // A second module handle on the same device reuses what is loaded.
    let again = Instant::now();
    let m2 = dev.load_module(&COLLECTIVES).unwrap();
    drop(m2);
    assert!(again.elapsed().as_secs_f64() < 2.0);
}

// ---- cold start ----

/// Time from opening devices to the first collective's result, in a fresh
/// process with an empty kernel cache, then again with the cache it filled.
pub fn cold_start<D: Device>(g: &Gpu<D>) {
    if !need(g, 1) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ferrocomm-cold-start-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
    }
    let env = [("FERROCOMM_CACHE_DIR", dir.display().to_string())];
    let cold = run_child("child_cold_start", &env);
    println!("{}", child_says(&cold, "COLD START"));
    let warm = run_child("child_cold_start", &env);
    println!(
        "{}",
        child_says(&warm, "COLD START").replace("COLD START", "WARM START (disk cache)")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The child of [`cold_start`]: one measurement in a fresh process.
pub fn child_cold_start<D: Device>(g: &Gpu<D>) {
    if !is_child("child_cold_start") {
        println!("runs as the child of cold_start");
        return;
    }
    let world = (g.device_count)().unwrap().min(2);
    let started = Instant::now();
    if world >= 2 {
        let results = ferrocomm::testing::harness::run_thread_ranks(world, |rank, world, store| {
            let dev = (g.open)(rank)?;
            // The lazy path ranks as processes take (threads of one
            // process preload every kernel by default).
            let opts = CommOptions::default().with_preload_kernels(false);
            let comm = Communicator::new(dev, store, rank, world, opts)?;
            let opened = started.elapsed();
            let count = 2048;
            let buf = comm.alloc(count * 2)?;
            comm.write(&buf, 0, &vec![0u8; count * 2])?;
            comm.all_reduce(Tensor::of(&buf, DType::BF16), ReduceOp::Sum, &Call::new())?
                .wait(None)?;
            let done = started.elapsed();
            let info = comm.device().runtime_info();
            comm.finalize()?;
            Ok((opened, done, info))
        });
        let (opened, done, info) = results.into_iter().map(|r| r.unwrap()).max_by_key(|r| r.1).unwrap();
        println!(
            "COLD START: first bf16 all-reduce (4 KiB) of a {world}-rank communicator done after {:.2} s \
             (devices + communicators ready after {:.2} s); {info}",
            done.as_secs_f64(),
            opened.as_secs_f64()
        );
    } else {
        let dev = (g.open)(0).unwrap();
        let m = dev.load_module(&COLLECTIVES).unwrap();
        let loaded = started.elapsed();
        dev.prepare(&m, &["fc_oneshot_ll_bf16_sum"]).unwrap();
        println!(
            "COLD START: one device (no second GPU for a communicator): open + load_module {:.3} s, \
             first kernel ready after {:.2} s; {}",
            loaded.as_secs_f64(),
            started.elapsed().as_secs_f64(),
            dev.runtime_info()
        );
    }
}

/// Instantiate every test above for one `Gpu` constant; `$why` is the
/// reason the GPU tests are ignored by default.
#[macro_export]
macro_rules! gpu_device_tests {
    ($gpu:expr, $why:literal) => {
        #[test]
        fn opening_a_missing_device_is_an_error() {
            gpu_device::opening_a_missing_device_is_an_error(&$gpu);
        }

        $crate::gpu_device_tests!(@ignored $gpu, $why,
            facts_describe_the_device,
            export_import_round_trip,
            export_import_release_everything,
            events_time_work,
            graph_capture_and_replay_of_a_memset,
            a_compile_error_is_reported_with_its_log,
            modules_compile_once_and_launch_checks_its_arguments,
            host_flags_are_visible_to_both_sides,
            foreign_handles_are_refused,
            the_collectives_module_loads_with_every_kernel,
            borrowed_streams_work_and_stay_the_callers,
            check_memory_refuses_what_kernels_cannot_use,
            export_range_shares_caller_memory,
            export_range_across_processes,
            child_opens_an_exported_range,
            first_launch_inside_a_capture_waits_for_its_kernel,
            cold_start,
            child_cold_start
        );
    };
    (@ignored $gpu:expr, $why:literal, $($name:ident),*) => {
        $(
            #[test]
            #[serial_test::serial]
            #[ignore = $why]
            fn $name() {
                gpu_device::$name(&$gpu);
            }
        )*
    };
}
