//! The HIP backend: the conformance suite (ranks as threads, one device
//! each), the GPU device tests shared with CUDA (`common/gpu_device.rs`), and
//! what only HIP has: the hipRTC path checked without a GPU. Tests that need
//! a GPU are ignored by default; with `--include-ignored` they print why
//! they skip and pass, unless `FERROCOMM_REQUIRE_GPU=1`.
//!
//! On an AMD GPU machine run them one at a time, so that worlds do not share
//! devices: `cargo test --features rocm --test conformance_hip -- --include-ignored --test-threads=1`.
//!
//! Without a GPU, `loading_the_backend_here_gives_a_clean_error` checks the
//! error this machine gets: set `FERROCOMM_EXPECT_HIP=no-device` where
//! Debian's libamdhip64 is installed (ci/check-kernels-hip.sh does), or
//! `missing` where no HIP runtime is, to require that exact outcome.

#![cfg(feature = "rocm")]

#[path = "common/gpu_device.rs"]
mod gpu_device;

use ferrocomm::algo::kernels::COLLECTIVES;
use ferrocomm::backends::hip::{self, HipDevice};
use ferrocomm::device::{BackendKind, Device, ModuleSource};
use ferrocomm::testing::conformance::SuiteConfig;
use ferrocomm::Error;
use gpu_device::Gpu;

/// Whether the runtime is ROCm 6 or later (pointer attributes and stream
/// devices can be read).
fn rocm6() -> bool {
    matches!(hip::runtime_version(), Ok(((major, ..), _)) if major >= 6)
}

const GPU: Gpu<HipDevice> = Gpu {
    label: "HIP",
    backend: BackendKind::Hip,
    device_count: hip::device_count,
    compiler_missing: || {
        hip::hiprtc_version()
            .err()
            .map(|e| format!("no hipRTC to compile kernels: {e}"))
    },
    open: HipDevice::new,
    can_access_peer: hip::can_access_peer,
    drop_errors: hip::drop_error_count,
    strict: rocm6,
    arch_prefixes: &["gfx"],
    warp_sizes: &[32, 64],
    exports_fd: false,
    block_threads: hip::BLOCK_THREADS,
    // Builtins only, like the prelude: no dependence on hipRTC's headers.
    tiny: ModuleSource::raw(
        "ferrocomm_tiny_test",
        "",
        "struct P { unsigned long long w[24]; };\n\
         extern \"C\" __attribute__((global)) void fill(const P p) {\n\
           unsigned int* out = (unsigned int*)p.w[9];\n\
           unsigned int i = __builtin_amdgcn_workgroup_id_x() * __builtin_amdgcn_workgroup_size_x()\n\
                            + __builtin_amdgcn_workitem_id_x();\n\
           if (i < p.w[11]) out[i] = 0xC0FFEEu + i;\n\
         }\n",
    ),
    broken: ModuleSource::raw(
        "ferrocomm_broken_test",
        "",
        "extern \"C\" __attribute__((global)) void k() { this_is_not_defined(); }\n",
    ),
    lazy_body: "struct P { unsigned long long w[24]; };\n\
                #define TK(n) extern \"C\" __attribute__((global)) void n(const P p)\n\
                #define FILL(v) { unsigned int* out = (unsigned int*)p.w[9]; \\\n\
                  unsigned int i = __builtin_amdgcn_workgroup_id_x() * __builtin_amdgcn_workgroup_size_x() \\\n\
                    + __builtin_amdgcn_workitem_id_x(); \\\n\
                  if (i < p.w[11]) out[i] = (v) + i; }\n",
};

fn skip_reason(world: usize) -> Option<String> {
    gpu_device::skip_reason(&GPU, world)
}

ferrocomm::conformance_tests!(
    hip_threads,
    HipDevice::new,
    skip_reason,
    SuiteConfig::default(),
    ignore = "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored"
);

gpu_device_tests!(GPU, "needs ROCm GPUs: ci/gpu-rocm.sh runs it with --include-ignored");

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
    let code = match hip::compile_module(&COLLECTIVES, &arch) {
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

/// One compile unit (one kernel), as the lazy module loader builds them,
/// compiled by hipRTC without a device: the code object holds that kernel
/// and no other.
#[test]
fn hiprtc_compiles_one_kernel_unit_without_a_device() {
    if need_hiprtc().is_none() {
        return;
    }
    let arch = offline_arch();
    let started = std::time::Instant::now();
    let code = hip::compile_kernels(&COLLECTIVES, &arch, &["fc_oneshot_ll_bf16_sum"])
        .unwrap_or_else(|e| panic!("hipRTC failed to compile one kernel for {arch}: {e}"));
    println!(
        "hipRTC: fc_oneshot_ll_bf16_sum for {arch}: {} KiB in {:.1} s",
        code.len() / 1024,
        started.elapsed().as_secs_f64()
    );
    assert!(code.starts_with(b"\x7fELF"), "not an ELF code object");
    assert!(contains(&code, b"fc_oneshot_ll_bf16_sum.kd\0"));
    assert!(!contains(&code, b"fc_twoshot_f32_sum\0"), "only the asked kernel");
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
