//! Compile check of every HIP kernel module with clang, with no GPU and no
//! ROCm, plus an exhaustive host check of the HIP prelude's fp16/bf16
//! conversions.
//!
//! For each module in `ferrocomm::algo::kernels::ALL_MODULES` the `.hip` text
//! (the HIP prelude + the shared algorithm body) is written to a temporary
//! file and compiled to a code object with
//! `clang++ -x hip --cuda-device-only --no-gpu-bundle-output -nogpuinc -nogpulib
//! --offload-arch=ARCH -O3 -std=c++17 -ffp-contract=off -DFC_MAX_BLOCK_THREADS=512`
//! (what hipRTC gets at run time, minus the device libraries, which the
//! kernels do not use) for gfx942 (MI300) and, when a clang that knows it is
//! installed (clang 20+), gfx950 (MI350). The code objects' symbol tables must
//! hold every name of `ferrocomm::algo::kernels::all_kernel_names()` (the
//! kernel and its `.kd` descriptor), and no kernel may spill VGPRs or use
//! scratch (set `FERROCOMM_ALLOW_SPILLS=1` to only warn). Every text is
//! compiled with the ABI checks after it (`ferrocomm::device::abi`): a
//! `static_assert` of each field's offset and size in `FcParams`, `FcDevCtx`
//! and `FcEpArgs`, from the Rust structs.
//!
//! The compilers: `FERROCOMM_HIP_CLANG` (gfx942) and
//! `FERROCOMM_HIP_CLANG_GFX950`, else the first of `clang++-19`, `clang++-22`,
//! `clang++-21`, `clang++-20`, `clang++` (newest first for gfx950) that can
//! build for the arch. They run only when `FERROCOMM_REQUIRE_HIPCC=1` (CI's
//! kernel step sets it; then a missing clang fails) or `FERROCOMM_HIP_CLANG`
//! asks; a plain `cargo test` skips them and says so. gfx950 alone is skipped with a printed reason when no
//! installed clang supports it, unless `FERROCOMM_REQUIRE_GFX950=1`.
//!
//! Run it with `ci/check-kernels-hip.sh` (installs clang-19 and lld-19 on
//! Debian), or by hand: `cargo test --test kernels_hip_compile -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use ferrocomm::algo::kernels::{all_kernel_names, ALL_MODULES};
use ferrocomm::device::ModuleSource;

#[path = "common/kernel_compile.rs"]
mod kernel_compile;
use kernel_compile::{
    with_abi_checks, Failures, CUDA_PRELUDE, DEVICE_API, DEVICE_API_SOURCES, EP_KERNELS, PUT_BENCH, USER_ALLGATHER,
    WINDOWS,
};

const PRELUDE: &str = include_str!("../kernels-hip/prelude.hip.h");
const SHARED_BODY: &str = include_str!("../kernels-cuda/collectives.cu");
/// Every vendor-neutral file the modules are assembled from.
const SHARED_FILES: [(&str, &str); 10] = [
    ("kernels-cuda/lamport.cuh", include_str!("../kernels-cuda/lamport.cuh")),
    ("kernels-cuda/common.cuh", include_str!("../kernels-cuda/common.cuh")),
    ("kernels-cuda/collectives.cu", SHARED_BODY),
    (
        "kernels-cuda/quickreduce.cu",
        include_str!("../kernels-cuda/quickreduce.cu"),
    ),
    ("kernels-cuda/fused.cu", include_str!("../kernels-cuda/fused.cu")),
    ("kernels-cuda/device_api.cuh", DEVICE_API),
    ("kernels-cuda/examples/user_allgather.cu", USER_ALLGATHER),
    ("kernels-cuda/examples/put_bench.cu", PUT_BENCH),
    ("kernels-cuda/windows.cu", WINDOWS),
    ("kernels-cuda/ep.cu (with lamport.cuh)", EP_KERNELS),
];

/// Threads per block the backend compiles for (`ferrocomm::algo::BLOCK_THREADS`).
fn block_threads() -> u32 {
    ferrocomm::algo::BLOCK_THREADS
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

fn required() -> bool {
    env_flag("FERROCOMM_REQUIRE_HIPCC")
}

/// A private temporary directory per use (tests run in parallel threads).
fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrocomm-hip-compile-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating a temporary directory");
    dir
}

// ---------------------------------------------------------------------------
// Finding a clang that builds HIP device code for an arch.

/// Whether `clang` compiles and links a trivial kernel for `arch`; the error otherwise.
fn probe(clang: &str, arch: &str) -> Result<(), String> {
    let dir = scratch_dir(&format!("probe-{arch}"));
    let src = dir.join(format!("probe-{arch}.hip"));
    let out = dir.join(format!("probe-{arch}-{}.hsaco", clang.replace('/', "_")));
    std::fs::write(
        &src,
        "extern \"C\" __attribute__((global)) void fc_probe(unsigned* p) { p[0] = 1; }\n",
    )
    .map_err(|e| e.to_string())?;
    let o = Command::new(clang)
        .args([
            "-x",
            "hip",
            "--cuda-device-only",
            "--no-gpu-bundle-output",
            "-nogpuinc",
            "-nogpulib",
        ])
        .arg(format!("--offload-arch={arch}"))
        .arg("-c")
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .output()
        .map_err(|e| format!("{clang}: {e}"))?;
    let ok = o.status.success() && out.is_file();
    let _ = std::fs::remove_dir_all(&dir);
    if ok {
        Ok(())
    } else {
        let err = String::from_utf8_lossy(&o.stderr);
        Err(format!("{clang}: {}", err.lines().next().unwrap_or("failed").trim()))
    }
}

fn version(clang: &str) -> String {
    Command::new(clang)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).lines().next().map(str::to_string))
        .unwrap_or_default()
}

/// The clang to build `arch` with, or why there is none.
fn clang_for(arch: &str) -> Result<String, String> {
    static FOUND: OnceLock<std::sync::Mutex<BTreeMap<String, Result<String, String>>>> = OnceLock::new();
    let mut found = FOUND
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(r) = found.get(arch) {
        return r.clone();
    }
    let (var, defaults): (&str, &[&str]) = if arch == "gfx950" {
        (
            "FERROCOMM_HIP_CLANG_GFX950",
            &["clang++-22", "clang++-21", "clang++-20", "clang++", "clang++-19"],
        )
    } else {
        (
            "FERROCOMM_HIP_CLANG",
            &["clang++-19", "clang++-22", "clang++-21", "clang++-20", "clang++"],
        )
    };
    let mut candidates: Vec<String> = Vec::new();
    if let Ok(c) = std::env::var(var) {
        if !c.is_empty() {
            candidates.push(c);
        }
    }
    candidates.extend(defaults.iter().map(|s| s.to_string()));
    let mut errors = Vec::new();
    let mut result = Err(String::new());
    for c in candidates {
        match probe(&c, arch) {
            Ok(()) => {
                result = Ok(c);
                break;
            }
            Err(e) => errors.push(e),
        }
    }
    if result.is_err() {
        result = Err(errors.join("; "));
    }
    found.insert(arch.to_string(), result.clone());
    result
}

/// The clang for `arch`, or `None` to skip (the reason is printed). The
/// compiles take minutes on 2 cores and CI runs them as their own step
/// (`ci/check-kernels-hip.sh`, which sets `FERROCOMM_REQUIRE_HIPCC=1`), so a
/// plain `cargo test` skips them unless that or `FERROCOMM_HIP_CLANG` asks.
fn clang_or_skip(arch: &str, must: bool) -> Option<String> {
    if !required() && std::env::var("FERROCOMM_HIP_CLANG").is_err() {
        println!("SKIPPED {arch}: the HIP compile checks run in their own CI step; run ci/check-kernels-hip.sh");
        return None;
    }
    match clang_for(arch) {
        Ok(c) => Some(c),
        Err(e) => {
            if must {
                panic!(
                    "a clang that builds HIP for {arch} is required here (FERROCOMM_REQUIRE_HIPCC or \
                     FERROCOMM_REQUIRE_GFX950 is set) but none works: {e}. Run ci/check-kernels-hip.sh, which \
                     installs clang-19 and lld-19, or set FERROCOMM_HIP_CLANG"
                );
            }
            println!("SKIPPED {arch}: no clang that builds HIP for {arch} ({e})");
            None
        }
    }
}

// ---------------------------------------------------------------------------
// Module text.

/// The HIP text of `module`. A module whose `hip` field is still empty is
/// assembled the way src/algo/kernels.rs must (prelude + "\n" + body), so the
/// kernels are checked anyway; `every_module_has_hip_source` reports it.
fn hip_text(module: &ModuleSource) -> String {
    if !module.hip.is_empty() {
        return module.full_text(ferrocomm::device::BackendKind::Hip);
    }
    println!(
        "note: module {} has no HIP text yet; compiling kernels-hip/prelude.hip.h + kernels-cuda/collectives.cu",
        module.name
    );
    format!("{PRELUDE}\n{SHARED_BODY}")
}

// ---------------------------------------------------------------------------
// Minimal ELF64 reader: global symbols by name and type.

fn rd<const N: usize>(b: &[u8], o: usize) -> Option<[u8; N]> {
    b.get(o..o + N)?.try_into().ok()
}
fn rd_u16(b: &[u8], o: usize) -> Option<u16> {
    rd::<2>(b, o).map(u16::from_le_bytes)
}
fn rd_u32(b: &[u8], o: usize) -> Option<u32> {
    rd::<4>(b, o).map(u32::from_le_bytes)
}
fn rd_u64(b: &[u8], o: usize) -> Option<u64> {
    rd::<8>(b, o).map(u64::from_le_bytes)
}
fn c_str_at(b: &[u8], o: usize) -> Option<&str> {
    let tail = b.get(o..)?;
    let end = tail.iter().position(|&c| c == 0)?;
    std::str::from_utf8(&tail[..end]).ok()
}

const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;
const EM_AMDGPU: u16 = 224;

/// (name, symbol type) of every GLOBAL defined symbol of an AMDGPU ELF file.
fn global_symbols(elf: &[u8]) -> Result<BTreeSet<(String, u8)>, String> {
    let bad = || "not a little-endian ELF64 AMDGPU file this reader understands".to_string();
    if elf.get(0..4) != Some(b"\x7fELF".as_slice()) || elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err(bad());
    }
    if rd_u16(elf, 0x12) != Some(EM_AMDGPU) {
        return Err(format!(
            "ELF machine is {:?}, not AMDGPU ({EM_AMDGPU})",
            rd_u16(elf, 0x12)
        ));
    }
    let shoff = rd_u64(elf, 0x28).ok_or_else(bad)? as usize;
    let shentsize = rd_u16(elf, 0x3a).ok_or_else(bad)? as usize;
    let shnum = rd_u16(elf, 0x3c).ok_or_else(bad)? as usize;
    if shentsize < 64 {
        return Err(bad());
    }
    let sh = |i: usize, field: usize| -> Option<u64> {
        let o = shoff + i * shentsize;
        match field {
            4 | 40 => rd_u32(elf, o + field).map(u64::from),
            _ => rd_u64(elf, o + field),
        }
    };
    const SHT_SYMTAB: u64 = 2;
    const SHT_DYNSYM: u64 = 11;
    const STB_GLOBAL: u8 = 1;
    let mut out = BTreeSet::new();
    for i in 0..shnum {
        let ty = sh(i, 4).ok_or_else(bad)?;
        if ty != SHT_SYMTAB && ty != SHT_DYNSYM {
            continue;
        }
        let (off, size, link, ent) = (
            sh(i, 24).ok_or_else(bad)? as usize,
            sh(i, 32).ok_or_else(bad)? as usize,
            sh(i, 40).ok_or_else(bad)? as usize,
            sh(i, 56).ok_or_else(bad)? as usize,
        );
        let strtab = sh(link, 24).ok_or_else(bad)? as usize;
        let ent = if ent == 0 { 24 } else { ent };
        for k in 0..size / ent {
            let o = off + k * ent;
            let name = rd_u32(elf, o).ok_or_else(bad)? as usize;
            let info = *elf.get(o + 4).ok_or_else(bad)?;
            let shndx = rd_u16(elf, o + 6).ok_or_else(bad)?;
            if info >> 4 != STB_GLOBAL || shndx == 0 {
                continue;
            }
            if let Some(n) = c_str_at(elf, strtab + name) {
                out.insert((n.to_string(), info & 0xf));
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// -Rpass-analysis=kernel-resource-usage report.

#[derive(Default, Debug, Clone)]
struct Usage {
    vgprs: u32,
    agprs: u32,
    sgprs: u32,
    scratch: u32,
    occupancy: u32,
    vgpr_spill: u32,
    sgpr_spill: u32,
    lds: u32,
}

fn remark_value(line: &str, key: &str) -> Option<u32> {
    let rest = line.split(&format!("{key}: ")).nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

fn resource_usage(stderr: &str) -> BTreeMap<String, Usage> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in stderr.lines().filter(|l| l.contains("remark:")) {
        if let Some(rest) = line.split("Function Name: ").nth(1) {
            let name = rest.split_whitespace().next().unwrap_or("").to_string();
            out.insert(name.clone(), Usage::default());
            current = Some(name);
            continue;
        }
        let Some(u) = current.as_ref().and_then(|n| out.get_mut(n)) else {
            continue;
        };
        let mut total_sgprs = 0;
        let fields: [(&str, &mut u32); 9] = [
            ("VGPRs", &mut u.vgprs),
            ("TotalSGPRs", &mut total_sgprs), // clang 20+ spelling
            ("AGPRs", &mut u.agprs),
            ("SGPRs", &mut u.sgprs),
            ("ScratchSize [bytes/lane]", &mut u.scratch),
            ("Occupancy [waves/SIMD]", &mut u.occupancy),
            ("VGPRs Spill", &mut u.vgpr_spill),
            ("SGPRs Spill", &mut u.sgpr_spill),
            ("LDS Size [bytes/block]", &mut u.lds),
        ];
        for (key, slot) in fields {
            // "SGPRs: 73" must not match "SGPRs Spill: 0" and vice versa.
            let trimmed = line.split("remark: ").nth(1).unwrap_or("").trim_start();
            if trimmed.starts_with(&format!("{key}: ")) {
                if let Some(v) = remark_value(trimmed, key) {
                    *slot = v;
                }
            }
        }
        u.sgprs = u.sgprs.max(total_sgprs);
    }
    out
}

// ---------------------------------------------------------------------------

fn compile_options(arch: &str) -> Vec<String> {
    vec![
        "-x".into(),
        "hip".into(),
        "--cuda-device-only".into(),
        "--no-gpu-bundle-output".into(),
        "-nogpuinc".into(),
        "-nogpulib".into(),
        format!("--offload-arch={arch}"),
        "-O3".into(),
        "-std=c++17".into(),
        "-ffp-contract=off".into(),
        format!("-DFC_MAX_BLOCK_THREADS={}", block_threads()),
        "-Rpass-analysis=kernel-resource-usage".into(),
    ]
}

/// Kernels that clang puts a small array in scratch for, with no VGPR
/// spill: the two-shot NVFP4 epilogues (68 B a lane on gfx942 for f16, on
/// gfx950 with the MoE prologue). With no AMD GPU to time the cost, they
/// are accepted here, bounded, rather than the whole check loosened.
const KNOWN_SCRATCH: [&str; 2] = ["fc_fused_twoshot_rms_nvfp4_", "fc_fused_twoshot_moe_rms_nvfp4_"];
const KNOWN_SCRATCH_BYTES: u32 = 68;

fn known_scratch(kernel: &str) -> bool {
    KNOWN_SCRATCH.iter().any(|p| kernel.starts_with(p))
}

fn compile_all_for(arch: &str) {
    let must = if arch == "gfx950" {
        env_flag("FERROCOMM_REQUIRE_GFX950")
    } else {
        required()
    };
    let Some(clang) = clang_or_skip(arch, must) else { return };
    println!("{arch}: {} ({clang})", version(&clang));
    let dir = scratch_dir(arch);
    let mut exported: BTreeSet<(String, u8)> = BTreeSet::new();
    let mut failures = Failures::new(env_flag("FERROCOMM_ALLOW_SPILLS"));

    for module in ALL_MODULES {
        let src = dir.join(format!("{}-{arch}.hip", module.name));
        let out = dir.join(format!("{}-{arch}.hsaco", module.name));
        std::fs::write(&src, with_abi_checks(hip_text(module))).expect("writing the module text");
        let started = std::time::Instant::now();
        let o = Command::new(&clang)
            .args(compile_options(arch))
            .arg("-c")
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .output()
            .expect("running clang");
        let secs = started.elapsed().as_secs_f64();
        let stderr = String::from_utf8_lossy(&o.stderr).to_string();
        let diagnostics: Vec<&str> = stderr
            .lines()
            .filter(|l| (l.contains("warning:") || l.contains("error:")) && !l.contains("remark:"))
            .collect();
        if !o.status.success() {
            let log: Vec<&str> = stderr.lines().filter(|l| !l.contains("remark:")).collect();
            failures.push(format!(
                "module {} for {arch} failed to compile ({}):\n{}",
                module.name,
                o.status,
                log.join("\n")
            ));
            continue;
        }
        for d in &diagnostics {
            println!("{arch}: {d}");
        }
        let bytes = std::fs::read(&out).expect("reading the code object");
        let symbols = match global_symbols(&bytes) {
            Ok(s) => s,
            Err(e) => {
                failures.push(format!("module {} for {arch}: {e}", module.name));
                continue;
            }
        };
        let usage = resource_usage(&stderr);
        let kernels: Vec<&Usage> = usage.values().collect();
        let max = |f: fn(&Usage) -> u32| kernels.iter().map(|u| f(u)).max().unwrap_or(0);
        let min = |f: fn(&Usage) -> u32| kernels.iter().map(|u| f(u)).min().unwrap_or(0);
        println!(
            "{arch}: module {}: {} kernels, code object {} KiB, {secs:.1} s; VGPRs {}..{}, AGPRs max {}, \
             SGPRs max {}, occupancy {}..{} waves/SIMD, LDS max {} B, {} kernels with SGPR spills (to VGPR \
             lanes, no memory)",
            module.name,
            symbols.iter().filter(|(_, t)| *t == STT_FUNC).count(),
            bytes.len() / 1024,
            min(|u| u.vgprs),
            max(|u| u.vgprs),
            max(|u| u.agprs),
            max(|u| u.sgprs),
            min(|u| u.occupancy),
            max(|u| u.occupancy),
            max(|u| u.lds),
            kernels.iter().filter(|u| u.sgpr_spill > 0).count(),
        );
        if usage.is_empty() {
            println!("{arch}: note: clang printed no resource-usage remarks");
        }
        for (name, u) in &usage {
            if u.vgpr_spill == 0 && u.scratch > 0 && u.scratch <= KNOWN_SCRATCH_BYTES && known_scratch(name) {
                println!(
                    "{arch}: note: kernel {name} uses {} B of scratch per lane (known, see KNOWN_SCRATCH)",
                    u.scratch
                );
                continue;
            }
            if u.vgpr_spill > 0 || u.scratch > 0 {
                failures.spill(format!(
                    "{arch}: kernel {name} spills {} VGPRs / uses {} B of scratch per lane",
                    u.vgpr_spill, u.scratch
                ));
            }
        }
        exported.extend(symbols);
    }

    let expected: BTreeSet<String> = all_kernel_names().into_iter().collect();
    let funcs: BTreeSet<String> = exported
        .iter()
        .filter(|(_, t)| *t == STT_FUNC)
        .map(|(n, _)| n.clone())
        .collect();
    let descriptors: BTreeSet<String> = exported
        .iter()
        .filter(|(n, t)| *t == STT_OBJECT && n.ends_with(".kd"))
        .map(|(n, _)| n.trim_end_matches(".kd").to_string())
        .collect();
    let missing: Vec<&String> = expected.difference(&funcs).collect();
    let missing_kd: Vec<&String> = expected.difference(&descriptors).collect();
    let extra: Vec<&String> = funcs.difference(&expected).collect();
    if !extra.is_empty() {
        println!("{arch}: note: entry points not in all_kernel_names(): {extra:?}");
    }
    if !missing.is_empty() {
        failures.push(format!("{arch}: {} kernels missing: {missing:?}", missing.len()));
    }
    if !missing_kd.is_empty() {
        failures.push(format!(
            "{arch}: {} kernel descriptors (.kd) missing: {missing_kd:?}",
            missing_kd.len()
        ));
    }
    if failures.is_empty() {
        println!(
            "{arch}: all {} expected kernels present, each with its descriptor",
            expected.len()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    failures.assert_none();
}

#[test]
fn kernels_compile_gfx942() {
    compile_all_for("gfx942");
}

#[test]
fn kernels_compile_gfx950() {
    compile_all_for("gfx950");
}

// ---------------------------------------------------------------------------
// The device API (kernels-cuda/device_api.cuh) and the kernels written on it,
// with the HIP prelude.

/// Compiles every source on the device API for `arch`: each must compile,
/// export its kernel and descriptor, and not spill.
fn compile_device_api_for(arch: &str) {
    let must = if arch == "gfx950" {
        env_flag("FERROCOMM_REQUIRE_GFX950")
    } else {
        required()
    };
    let Some(clang) = clang_or_skip(arch, must) else { return };
    println!("{arch}: {} ({clang})", version(&clang));
    let dir = scratch_dir(&format!("devapi-{arch}"));
    let mut failures = Failures::new(env_flag("FERROCOMM_ALLOW_SPILLS"));
    for source in &DEVICE_API_SOURCES {
        let (name, entry) = (source.name, source.entry);
        let src = dir.join(format!("{name}-{arch}.hip"));
        let out = dir.join(format!("{name}-{arch}.hsaco"));
        std::fs::write(&src, with_abi_checks(source.text(PRELUDE))).expect("writing the source");
        let o = Command::new(&clang)
            .args(compile_options(arch))
            .arg("-c")
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .output()
            .expect("running clang");
        let stderr = String::from_utf8_lossy(&o.stderr).to_string();
        let diagnostics: Vec<&str> = stderr
            .lines()
            .filter(|l| (l.contains("warning:") || l.contains("error:")) && !l.contains("remark:"))
            .collect();
        if !o.status.success() {
            let log: Vec<&str> = stderr.lines().filter(|l| !l.contains("remark:")).collect();
            failures.push(format!("{name} for {arch} ({}):\n{}", o.status, log.join("\n")));
            continue;
        }
        for d in &diagnostics {
            println!("{arch}: {name}: {d}");
        }
        let bytes = std::fs::read(&out).expect("reading the code object");
        match global_symbols(&bytes) {
            Ok(s) => {
                if !s.contains(&(entry.to_string(), STT_FUNC)) || !s.contains(&(format!("{entry}.kd"), STT_OBJECT)) {
                    failures.push(format!("{name} for {arch}: {entry} or {entry}.kd missing"));
                }
            }
            Err(e) => failures.push(format!("{name} for {arch}: {e}")),
        }
        for (kernel, u) in resource_usage(&stderr) {
            println!(
                "{arch}: {name}: {kernel}: {} VGPRs, {} SGPRs, scratch {} B/lane, occupancy {} waves/SIMD",
                u.vgprs, u.sgprs, u.scratch, u.occupancy
            );
            if u.vgpr_spill > 0 || u.scratch > 0 {
                failures.spill(format!(
                    "{arch}: kernel {kernel} spills {} VGPRs / uses {} B of scratch per lane",
                    u.vgpr_spill, u.scratch
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    failures.assert_none();
}

#[test]
fn device_api_compiles_gfx942() {
    compile_device_api_for("gfx942");
}

#[test]
fn device_api_compiles_gfx950() {
    compile_device_api_for("gfx950");
}

/// Every module must carry its HIP text: the HIP prelude + "\n" + the body the
/// CUDA text uses (the body is shared, see kernels-hip/README.md).
#[test]
fn every_module_has_hip_source() {
    let mut problems = Vec::new();
    for m in ALL_MODULES {
        if m.hip.is_empty() {
            problems.push(format!(
                "module {} has an empty `hip` field; in src/algo/kernels.rs set \
                 hip: concat!(include_str!(\"../../kernels-hip/prelude.hip.h\"), \"\\n\", \
                 include_str!(\"../../kernels-cuda/collectives.cu\"))",
                m.name
            ));
            continue;
        }
        if !m.hip.starts_with(PRELUDE) {
            problems.push(format!(
                "module {}: the HIP text does not start with prelude.hip.h",
                m.name
            ));
        }
        // The body after the prelude must be the body after the CUDA prelude.
        let hip_body = m.hip.strip_prefix(PRELUDE).unwrap_or("");
        let cuda_body = m.cuda.strip_prefix(CUDA_PRELUDE).unwrap_or(m.cuda);
        if hip_body != cuda_body {
            problems.push(format!(
                "module {}: the HIP text's body differs from the CUDA text's body (they must be the same file)",
                m.name
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Names `#define`d or defined as functions, types or structs (at the start
/// of a line) in a prelude, with the `fc_`/`FC_` prefix.
fn prelude_names(src: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in src.lines() {
        let t = line.trim_start();
        let candidates: Vec<&str> = if let Some(rest) = t.strip_prefix("#define ") {
            vec![rest]
        } else if t.starts_with("FC_DEVICE ") || t.starts_with("struct ") || t.starts_with("typedef ") {
            // The name is the last identifier before '(' (functions), '{'/';' (types).
            let head = t.split(['(', '{', ';']).next().unwrap_or("");
            head.split_whitespace().last().into_iter().collect()
        } else {
            vec![]
        };
        for c in candidates {
            let name: String = c
                .trim_start_matches(['*', '&'])
                .chars()
                .take_while(|ch| ch.is_ascii_alphanumeric() || *ch == '_')
                .collect();
            if name.starts_with("fc_") || name.starts_with("FC_") {
                names.insert(name);
            }
        }
    }
    names
}

/// The HIP prelude supplies every primitive the CUDA prelude does, so the
/// shared body compiles on both (new primitives in prelude.cuh need HIP twins).
#[test]
fn hip_prelude_supplies_every_cuda_primitive() {
    let cuda = prelude_names(CUDA_PRELUDE);
    let hip = prelude_names(PRELUDE);
    assert!(cuda.len() > 40, "parsed only {} names from prelude.cuh", cuda.len());
    // Include guards differ on purpose only in name; the CUDA one is not needed.
    // FC_HW_* mark optional hardware paths (e.g. an FP8 conversion one
    // vendor's arch has); the body falls back to portable code without them.
    let missing: Vec<&String> = cuda.difference(&hip).filter(|n| !n.starts_with("FC_HW_")).collect();
    assert!(
        missing.is_empty(),
        "kernels-hip/prelude.hip.h lacks these names of kernels-cuda/prelude.cuh: {missing:?}"
    );
}

/// The shared body must stay vendor neutral: no inline asm and no CUDA-only
/// names, so it compiles against the HIP prelude.
#[test]
fn shared_body_is_vendor_neutral() {
    let forbidden = [
        "asm(",
        "asm volatile",
        "threadIdx",
        "blockIdx",
        "blockDim",
        "gridDim",
        "__syncthreads",
        "__shfl",
        "atomicAdd",
        "atomicCAS",
        "__ldcg",
        "__stcg",
        "warpSize",
        "__threadfence",
        "uint4",
    ];
    for (file, text) in SHARED_FILES {
        let code: String = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        let found: Vec<&&str> = forbidden.iter().filter(|f| code.contains(**f)).collect();
        assert!(
            found.is_empty(),
            "{file} uses vendor-specific names {found:?}: move them into the preludes"
        );
    }
}

// ---------------------------------------------------------------------------
// The prelude's conversions, compiled for the host and checked exhaustively.

type ConvF32 = unsafe extern "C" fn(u32, u32, *mut u16);
type ConvF16 = unsafe extern "C" fn(u32, u32, *mut u32);
type TicksToNs = unsafe extern "C" fn(u64) -> u64;

const HOST_WRAPPER: &str = r#"
extern "C" void fc_test_f32_to_f16(fc_u32 start, fc_u32 n, fc_u16* out) {
    for (fc_u32 i = 0; i < n; ++i) out[i] = fc_f32_to_f16(fc_u32_as_f32(start + i));
}
extern "C" void fc_test_f32_to_bf16(fc_u32 start, fc_u32 n, fc_u16* out) {
    for (fc_u32 i = 0; i < n; ++i) out[i] = fc_f32_to_bf16(fc_u32_as_f32(start + i));
}
extern "C" void fc_test_f16_to_f32(fc_u32 start, fc_u32 n, fc_u32* out) {
    for (fc_u32 i = 0; i < n; ++i) out[i] = fc_f32_as_u32(fc_f16_to_f32((fc_u16)(start + i)));
}
extern "C" void fc_test_bf16_to_f32(fc_u32 start, fc_u32 n, fc_u32* out) {
    for (fc_u32 i = 0; i < n; ++i) out[i] = fc_f32_as_u32(fc_bf16_to_f32((fc_u16)(start + i)));
}
extern "C" void fc_test_pack(fc_u32 start, fc_u32 n, fc_u32* out) {
    for (fc_u32 i = 0; i < n; ++i) {
        float lo, hi, blo, bhi;
        fc_unpack_f16x2(start + i, lo, hi);
        fc_unpack_bf16x2(start + i, blo, bhi);
        out[2 * i] = fc_pack_f16x2(lo, hi);
        out[2 * i + 1] = fc_pack_bf16x2(blo, bhi);
    }
}
extern "C" fc_u64 fc_test_ticks_to_ns(fc_u64 t) { return fc_ticks_to_ns(t); }
"#;

struct HostConv {
    _lib: libloading::Library,
    f32_to_f16: ConvF32,
    f32_to_bf16: ConvF32,
    f16_to_f32: ConvF16,
    bf16_to_f32: ConvF16,
    pack: ConvF16,
    ticks_to_ns: TicksToNs,
}

/// Build the prelude's arithmetic for the host (`FC_HIP_PRELUDE_HOST_TEST`)
/// into a shared library with `khz` as the wall-clock rate, and load it.
fn host_conv(khz: u32) -> Option<HostConv> {
    let clang = clang_or_skip("gfx942", required())?;
    let dir = scratch_dir(
        &format!("conv-{khz}-{:?}", std::thread::current().id()).replace(|c: char| !c.is_ascii_alphanumeric(), "_"),
    );
    let src = dir.join(format!("conv-{khz}.cpp"));
    let lib = dir.join(format!("libconv-{khz}.so"));
    std::fs::write(&src, format!("{PRELUDE}\n{HOST_WRAPPER}")).expect("writing the host test source");
    let o = Command::new(&clang)
        .args([
            "-x",
            "c++",
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-DFC_HIP_PRELUDE_HOST_TEST",
        ])
        .arg(format!("-DFC_WALLCLOCK_KHZ={khz}"))
        .arg(&src)
        .arg("-o")
        .arg(&lib)
        .output()
        .expect("running clang");
    assert!(
        o.status.success(),
        "the prelude does not build for the host in FC_HIP_PRELUDE_HOST_TEST mode:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // SAFETY: a library we just built from the prelude; its initialisers are trivial.
    let l = unsafe { libloading::Library::new(&lib) }.expect("loading the host test library");
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the wrapper above defines the symbol with this signature.
            *unsafe { l.get(concat!($name, "\0").as_bytes()) }.expect($name)
        };
    }
    let conv = HostConv {
        f32_to_f16: sym!("fc_test_f32_to_f16"),
        f32_to_bf16: sym!("fc_test_f32_to_bf16"),
        f16_to_f32: sym!("fc_test_f16_to_f32"),
        bf16_to_f32: sym!("fc_test_bf16_to_f32"),
        pack: sym!("fc_test_pack"),
        ticks_to_ns: sym!("fc_test_ticks_to_ns"),
        _lib: l,
    };
    // The library stays mapped after its file is gone.
    let _ = std::fs::remove_dir_all(&dir);
    Some(conv)
}

fn is_nan32(bits: u32) -> bool {
    bits & 0x7fff_ffff > 0x7f80_0000
}

/// Every f32 bit pattern narrowed to f16 and bf16 by the prelude equals the
/// `half` crate's round-to-nearest-even result (the host reference); NaNs stay
/// NaNs with their sign.
#[test]
fn prelude_narrowing_matches_the_host_reference_exhaustively() {
    let Some(conv) = host_conv(100_000) else { return };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(16) as u64;
    const CHUNK: u32 = 1 << 20;
    let chunks = (1u64 << 32) / CHUNK as u64;
    let conv = &conv;
    let mismatches: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut bad = Vec::new();
                    let mut h = vec![0u16; CHUNK as usize];
                    let mut b = vec![0u16; CHUNK as usize];
                    let mut c = t;
                    while c < chunks {
                        let start = (c * CHUNK as u64) as u32;
                        // SAFETY: both buffers hold CHUNK elements.
                        unsafe {
                            (conv.f32_to_f16)(start, CHUNK, h.as_mut_ptr());
                            (conv.f32_to_bf16)(start, CHUNK, b.as_mut_ptr());
                        }
                        for i in 0..CHUNK {
                            let bits = start.wrapping_add(i);
                            let f = f32::from_bits(bits);
                            let (gh, gb) = (h[i as usize], b[i as usize]);
                            let (wh, wb) = (half::f16::from_f32(f).to_bits(), half::bf16::from_f32(f).to_bits());
                            let ok_h = if is_nan32(bits) {
                                half::f16::from_bits(gh).is_nan() && gh >> 15 == wh >> 15
                            } else {
                                gh == wh
                            };
                            let ok_b = if is_nan32(bits) {
                                half::bf16::from_bits(gb).is_nan() && gb >> 15 == wb >> 15
                            } else {
                                gb == wb
                            };
                            if (!ok_h || !ok_b) && bad.len() < 8 {
                                bad.push(format!(
                                    "f32 {bits:#010x} ({f:e}): f16 {gh:#06x} want {wh:#06x}, bf16 {gb:#06x} want {wb:#06x}"
                                ));
                            }
                        }
                        c += threads;
                    }
                    bad
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert!(
        mismatches.is_empty(),
        "narrowing mismatches:\n{}",
        mismatches.join("\n")
    );
}

/// Widening every f16 and bf16 bit pattern is exact (NaNs stay NaNs), and
/// pack(unpack(w)) returns every non-NaN word unchanged.
#[test]
fn prelude_widening_and_packing_are_exact() {
    let Some(conv) = host_conv(100_000) else { return };
    let mut w16 = vec![0u32; 1 << 16];
    let mut wb = vec![0u32; 1 << 16];
    // SAFETY: both buffers hold 2^16 elements.
    unsafe {
        (conv.f16_to_f32)(0, 1 << 16, w16.as_mut_ptr());
        (conv.bf16_to_f32)(0, 1 << 16, wb.as_mut_ptr());
    }
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h).to_f32();
        let got = f32::from_bits(w16[h as usize]);
        if want.is_nan() {
            assert!(
                got.is_nan() && got.is_sign_negative() == want.is_sign_negative(),
                "f16 {h:#06x}"
            );
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "f16 {h:#06x}");
        }
        // bf16 widening is the shift CUDA does too; the `half` crate also
        // sets the quiet bit of a signalling NaN, so NaNs compare as NaNs.
        let want = half::bf16::from_bits(h).to_f32();
        let got = f32::from_bits(wb[h as usize]);
        if want.is_nan() {
            assert!(
                got.is_nan() && got.is_sign_negative() == want.is_sign_negative(),
                "bf16 {h:#06x}"
            );
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "bf16 {h:#06x}");
        }
    }
    // Packing: a sample of words across both halves (every high half with a
    // few low halves, and the reverse), non-NaN halves must round-trip.
    let mut words = Vec::new();
    for a in 0..=u16::MAX as u32 {
        for b in [0u32, 1, 0x3c00, 0x8001, 0x7bff, 0xfbff, 0x03ff, 0x0400] {
            words.push(a << 16 | b);
            words.push(b << 16 | a);
        }
    }
    let mut out = vec![0u32; 2];
    for &w in &words {
        // SAFETY: `out` holds two words.
        unsafe { (conv.pack)(w, 1, out.as_mut_ptr()) };
        let nan16 = |x: u32| x & 0x7c00 == 0x7c00 && x & 0x3ff != 0;
        let nanb = |x: u32| x & 0x7f80 == 0x7f80 && x & 0x7f != 0;
        let (lo, hi) = (w & 0xffff, w >> 16);
        if !nan16(lo) && !nan16(hi) {
            assert_eq!(out[0], w, "f16x2 {w:#010x}");
        }
        if !nanb(lo) && !nanb(hi) {
            assert_eq!(out[1], w, "bf16x2 {w:#010x}");
        }
    }
}

/// Wall-clock ticks convert to nanoseconds exactly, for the CDNA rate and for
/// a rate that does not divide 1 ms.
#[test]
fn prelude_tick_conversion_is_exact() {
    let Some(c100) = host_conv(100_000) else { return };
    // SAFETY: plain function of one integer.
    let f = |c: &HostConv, t: u64| unsafe { (c.ticks_to_ns)(t) };
    for t in [0u64, 1, 7, 100_000, 123_456_789, u64::MAX / 10] {
        assert_eq!(f(&c100, t), t * 10);
    }
    let Some(c27) = host_conv(27_000) else { return };
    for t in [0u64, 1, 26_999, 27_000, 1 << 40, u64::MAX / 2, u64::MAX] {
        let want = (t as u128 * 1_000_000 / 27_000) as u64;
        assert_eq!(f(&c27, t), want, "t = {t}");
    }
}
