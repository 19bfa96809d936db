//! Compile check of every CUDA kernel module with NVRTC, with no GPU.
//!
//! For each module in `ferrocomm::algo::kernels::ALL_MODULES` the `.cuda`
//! text is compiled for `sm_80` and `sm_90`. Real SM targets run ptxas, so
//! the inline PTX is checked too (`compute_XX` would check nothing). Then the
//! cubins' symbol tables must export every name of
//! `ferrocomm::algo::kernels::all_kernel_names()`, and ptxas must report no
//! register spills (set `FERROCOMM_ALLOW_SPILLS=1` to only warn). Every text
//! is compiled with the ABI checks after it (`ferrocomm::device::abi`): a
//! `static_assert` of each field's offset and size in `FcParams`, `FcDevCtx`
//! and `FcEpArgs`, from the Rust structs.
//!
//! NVRTC is loaded at run time, from `FERROCOMM_NVRTC_LIB` (a path to
//! `libnvrtc.so.13`), else from the `nvidia-cuda-nvrtc` wheel that
//! `ci/check-kernels-cuda.sh` installs under `.ci-cache/`, else by the usual
//! sonames. It runs only when `FERROCOMM_REQUIRE_NVRTC=1` or
//! `FERROCOMM_NVRTC_LIB` asks for it (CI's kernel step does), and then fails
//! if none loads; a plain `cargo test` skips it and says so.
//!
//! Run it with `ci/check-kernels-cuda.sh`, or by hand:
//! `FERROCOMM_NVRTC_LIB=/path/libnvrtc.so.13 cargo test --test kernels_cuda_compile -- --nocapture`.

use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ferrocomm::algo::kernels::{all_kernel_names, ALL_MODULES};

#[path = "common/kernel_compile.rs"]
mod kernel_compile;
use kernel_compile::{with_abi_checks, DeviceApiSource, Failures, CUDA_PRELUDE, DEVICE_API_SOURCES, EP_KERNELS};

type NvrtcProgram = *mut c_void;
type NvrtcResult = c_int;
const NVRTC_SUCCESS: NvrtcResult = 0;

/// The few NVRTC entry points this test needs.
struct Nvrtc {
    /// Where it was loaded from (for messages).
    origin: String,
    version: (c_int, c_int),
    get_error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    create_program: unsafe extern "C" fn(
        *mut NvrtcProgram,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    compile_program: unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> NvrtcResult,
    destroy_program: unsafe extern "C" fn(*mut NvrtcProgram) -> NvrtcResult,
    get_program_log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    get_program_log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    get_cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    get_cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    // Keeps the function pointers above valid; dropped last.
    _libs: Vec<libloading::Library>,
}

// SAFETY: NVRTC's API is thread safe for distinct programs, and the struct only
// holds function pointers into libraries that stay loaded while it lives.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

fn env_flag(name: &str) -> bool {
    match std::env::var(name) {
        Ok(v) => {
            let v = v.trim().to_ascii_lowercase();
            !(v.is_empty() || v == "0" || v == "false" || v == "no")
        }
        Err(_) => false,
    }
}

/// Candidate NVRTC libraries, best first.
fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(p) = std::env::var("FERROCOMM_NVRTC_LIB") {
        if !p.trim().is_empty() {
            out.push(PathBuf::from(p.trim()));
            // An explicit choice is the only one tried.
            return out;
        }
    }
    // The wheel ci/check-kernels-cuda.sh installs: .ci-cache/nvrtc-venv/lib/python3.*/site-packages/nvidia/cu13/lib.
    let venv_lib = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci-cache/nvrtc-venv/lib");
    if let Ok(rd) = std::fs::read_dir(&venv_lib) {
        let mut found: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path().join("site-packages/nvidia/cu13/lib/libnvrtc.so.13"))
            .filter(|p| p.is_file())
            .collect();
        found.sort();
        out.extend(found);
    }
    // Its fallback when venv is unavailable: pip install --target .ci-cache/nvrtc-pip.
    let target_lib = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci-cache/nvrtc-pip/nvidia/cu13/lib/libnvrtc.so.13");
    if target_lib.is_file() {
        out.push(target_lib);
    }
    out.push(PathBuf::from("libnvrtc.so.13"));
    out.push(PathBuf::from("libnvrtc.so"));
    out
}

/// NVRTC dlopens `libnvrtc-builtins.so.<ver>` by soname. Loading the one that
/// sits next to libnvrtc first, with RTLD_GLOBAL, satisfies that lookup
/// without LD_LIBRARY_PATH.
fn preload_builtins(nvrtc: &Path) -> Vec<libloading::Library> {
    let mut libs = Vec::new();
    let Some(dir) = nvrtc.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return libs;
    };
    let Ok(rd) = std::fs::read_dir(dir) else {
        return libs;
    };
    let mut builtins: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so"))
        })
        .collect();
    builtins.sort();
    for path in builtins {
        #[cfg(unix)]
        {
            use libloading::os::unix::{Library as UnixLibrary, RTLD_GLOBAL, RTLD_NOW};
            // SAFETY: loading NVIDIA's builtins library runs no initialisers with preconditions.
            if let Ok(lib) = unsafe { UnixLibrary::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) } {
                libs.push(lib.into());
            }
        }
        #[cfg(not(unix))]
        {
            // SAFETY: as above.
            if let Ok(lib) = unsafe { libloading::Library::new(&path) } {
                libs.push(lib);
            }
        }
    }
    libs
}

fn load_from(path: &Path) -> Result<Nvrtc, String> {
    let mut libs = preload_builtins(path);
    // SAFETY: libnvrtc has no initialisers with preconditions.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| format!("{}: {e}", path.display()))?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the type matches the documented NVRTC prototype of this symbol.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("{}: {}: {e}", path.display(), $name))?
        };
    }
    let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult = sym!("nvrtcVersion");
    let mut version = (0, 0);
    // SAFETY: two valid out-pointers.
    let rc = unsafe { version_fn(&mut version.0, &mut version.1) };
    if rc != NVRTC_SUCCESS {
        return Err(format!("{}: nvrtcVersion failed ({rc})", path.display()));
    }
    let nvrtc = Nvrtc {
        origin: path.display().to_string(),
        version,
        get_error_string: sym!("nvrtcGetErrorString"),
        create_program: sym!("nvrtcCreateProgram"),
        compile_program: sym!("nvrtcCompileProgram"),
        destroy_program: sym!("nvrtcDestroyProgram"),
        get_program_log_size: sym!("nvrtcGetProgramLogSize"),
        get_program_log: sym!("nvrtcGetProgramLog"),
        get_cubin_size: sym!("nvrtcGetCUBINSize"),
        get_cubin: sym!("nvrtcGetCUBIN"),
        _libs: {
            libs.push(lib);
            libs
        },
    };
    Ok(nvrtc)
}

/// NVRTC, or why it could not be loaded.
fn nvrtc() -> &'static Result<Nvrtc, String> {
    static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
    NVRTC.get_or_init(|| {
        let mut errors = Vec::new();
        for path in candidates() {
            match load_from(&path) {
                Ok(n) => return Ok(n),
                Err(e) => errors.push(e),
            }
        }
        Err(errors.join("; "))
    })
}

/// NVRTC when asked for; `None` means "skip" (the reason is printed).
///
/// The compile of every kernel takes minutes on 2 cores, and CI runs it as
/// its own step (`ci/check-kernels-cuda.sh`, which sets
/// `FERROCOMM_REQUIRE_NVRTC=1`), so a plain `cargo test` skips it unless
/// `FERROCOMM_REQUIRE_NVRTC=1` or `FERROCOMM_NVRTC_LIB` asks for it.
fn nvrtc_or_skip() -> Option<&'static Nvrtc> {
    let asked =
        env_flag("FERROCOMM_REQUIRE_NVRTC") || std::env::var("FERROCOMM_NVRTC_LIB").is_ok_and(|v| !v.trim().is_empty());
    if !asked {
        println!(
            "SKIPPED: the NVRTC compile of every kernel runs in its own CI step; run ci/check-kernels-cuda.sh \
             or set FERROCOMM_REQUIRE_NVRTC=1"
        );
        return None;
    }
    match nvrtc() {
        Ok(n) => Some(n),
        Err(e) => {
            let required = env_flag("FERROCOMM_REQUIRE_NVRTC");
            if required {
                panic!(
                    "NVRTC is required here (FERROCOMM_REQUIRE_NVRTC is set) but could not be loaded: {e}. \
                     Run ci/check-kernels-cuda.sh, which installs it from PyPI (nvidia-cuda-nvrtc 13.x), \
                     or set FERROCOMM_NVRTC_LIB=/path/to/libnvrtc.so.13"
                );
            }
            println!("SKIPPED: NVRTC not found ({e}); set FERROCOMM_NVRTC_LIB or run ci/check-kernels-cuda.sh");
            None
        }
    }
}

struct Compiled {
    log: String,
    cubin: Vec<u8>,
}

impl Nvrtc {
    fn error_string(&self, rc: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.get_error_string)(rc) };
        if p.is_null() {
            format!("NVRTC error {rc}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    fn check(&self, rc: NvrtcResult, call: &str) -> Result<(), String> {
        if rc == NVRTC_SUCCESS {
            Ok(())
        } else {
            Err(format!("{call}: {}", self.error_string(rc)))
        }
    }

    /// Compiles `src` with `options`; returns the log and the cubin, or the
    /// log of the failure.
    fn compile(&self, src: &str, name: &str, options: &[String]) -> Result<Compiled, String> {
        let src_c = CString::new(src).map_err(|_| "source contains a NUL byte".to_string())?;
        let name_c = CString::new(name).unwrap();
        let opts_c: Vec<CString> = options.iter().map(|o| CString::new(o.as_str()).unwrap()).collect();
        let opt_ptrs: Vec<*const c_char> = opts_c.iter().map(|o| o.as_ptr()).collect();

        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: valid out-pointer and NUL-terminated strings; no headers.
        let rc = unsafe {
            (self.create_program)(
                &mut prog,
                src_c.as_ptr(),
                name_c.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        self.check(rc, "nvrtcCreateProgram")?;

        struct Guard<'a>(&'a Nvrtc, NvrtcProgram);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                // SAFETY: the program was created above and is destroyed once.
                unsafe { (self.0.destroy_program)(&mut self.1) };
            }
        }
        let guard = Guard(self, prog);

        // SAFETY: `opt_ptrs` points at live NUL-terminated strings.
        let compile_rc = unsafe { (self.compile_program)(guard.1, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };

        let mut log_size = 0usize;
        // SAFETY: valid program and out-pointer.
        self.check(
            unsafe { (self.get_program_log_size)(guard.1, &mut log_size) },
            "nvrtcGetProgramLogSize",
        )?;
        let mut log_buf = vec![0u8; log_size.max(1)];
        // SAFETY: the buffer holds log_size bytes, as NVRTC asked for.
        self.check(
            unsafe { (self.get_program_log)(guard.1, log_buf.as_mut_ptr().cast()) },
            "nvrtcGetProgramLog",
        )?;
        let log = String::from_utf8_lossy(&log_buf).trim_end_matches('\0').to_string();

        if compile_rc != NVRTC_SUCCESS {
            return Err(format!("nvrtcCompileProgram: {}\n{log}", self.error_string(compile_rc)));
        }

        let mut size = 0usize;
        // SAFETY: valid program and out-pointer.
        self.check(
            unsafe { (self.get_cubin_size)(guard.1, &mut size) },
            "nvrtcGetCUBINSize",
        )?;
        let mut cubin = vec![0u8; size];
        // SAFETY: the buffer holds `size` bytes.
        self.check(
            unsafe { (self.get_cubin)(guard.1, cubin.as_mut_ptr().cast()) },
            "nvrtcGetCUBIN",
        )?;
        if cubin.is_empty() {
            return Err("NVRTC returned an empty cubin".into());
        }
        Ok(Compiled { log, cubin })
    }
}

// ---------------------------------------------------------------------------
// Minimal ELF64 reader: the global function symbols of a cubin's .text.* sections.

fn rd_u16(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}
fn rd_u32(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}
fn rd_u64(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}
fn c_str_at(b: &[u8], o: usize) -> Option<&str> {
    let tail = b.get(o..)?;
    let end = tail.iter().position(|&c| c == 0)?;
    std::str::from_utf8(&tail[..end]).ok()
}

/// Kernel entry points in a cubin: GLOBAL FUNC symbols defined in `.text.*`.
fn cubin_entry_points(elf: &[u8]) -> Result<BTreeSet<String>, String> {
    let bad = || "cubin is not a little-endian ELF64 file this reader understands".to_string();
    if elf.get(0..4) != Some(b"\x7fELF".as_slice()) || elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err(bad());
    }
    let shoff = rd_u64(elf, 0x28).ok_or_else(bad)? as usize;
    let shentsize = rd_u16(elf, 0x3a).ok_or_else(bad)? as usize;
    let shnum = rd_u16(elf, 0x3c).ok_or_else(bad)? as usize;
    let shstrndx = rd_u16(elf, 0x3e).ok_or_else(bad)? as usize;
    if shentsize < 64 {
        return Err(bad());
    }
    struct Sh {
        name: u32,
        ty: u32,
        offset: usize,
        size: usize,
        link: usize,
        entsize: usize,
    }
    let mut shs = Vec::with_capacity(shnum);
    for i in 0..shnum {
        let o = shoff + i * shentsize;
        shs.push(Sh {
            name: rd_u32(elf, o).ok_or_else(bad)?,
            ty: rd_u32(elf, o + 4).ok_or_else(bad)?,
            offset: rd_u64(elf, o + 24).ok_or_else(bad)? as usize,
            size: rd_u64(elf, o + 32).ok_or_else(bad)? as usize,
            link: rd_u32(elf, o + 40).ok_or_else(bad)? as usize,
            entsize: rd_u64(elf, o + 56).ok_or_else(bad)? as usize,
        });
    }
    let shstr = shs.get(shstrndx).ok_or_else(bad)?.offset;
    let sec_name = |i: usize| -> Option<&str> { c_str_at(elf, shstr + shs.get(i)?.name as usize) };

    const SHT_SYMTAB: u32 = 2;
    const STT_FUNC: u8 = 2;
    const STB_GLOBAL: u8 = 1;
    let mut names = BTreeSet::new();
    for sh in shs.iter().filter(|s| s.ty == SHT_SYMTAB) {
        let strtab = shs.get(sh.link).ok_or_else(bad)?.offset;
        let entsize = if sh.entsize == 0 { 24 } else { sh.entsize };
        for k in 0..sh.size / entsize {
            let o = sh.offset + k * entsize;
            let st_name = rd_u32(elf, o).ok_or_else(bad)? as usize;
            let info = *elf.get(o + 4).ok_or_else(bad)?;
            let shndx = rd_u16(elf, o + 6).ok_or_else(bad)? as usize;
            if info & 0xf != STT_FUNC || info >> 4 != STB_GLOBAL {
                continue;
            }
            if !sec_name(shndx).is_some_and(|n| n.starts_with(".text.")) {
                continue;
            }
            if let Some(n) = c_str_at(elf, strtab + st_name) {
                names.insert(n.to_string());
            }
        }
    }
    Ok(names)
}

// ---------------------------------------------------------------------------
// ptxas -v resource report.

#[derive(Default)]
struct Usage {
    kernels: usize,
    min_regs: u32,
    max_regs: u32,
    max_stack: u32,
    /// Kernels with spill stores or loads, and the bytes.
    spills: Vec<(String, u32, u32)>,
}

fn number_before(line: &str, what: &str) -> Option<u32> {
    let i = line.find(what)?;
    line[..i].split_whitespace().last()?.parse().ok()
}

fn ptxas_usage(log: &str) -> Usage {
    let mut u = Usage {
        min_regs: u32::MAX,
        ..Default::default()
    };
    let mut current = String::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().unwrap_or("").to_string();
            u.kernels += 1;
        }
        if let Some(r) = number_before(line, "registers") {
            u.min_regs = u.min_regs.min(r);
            u.max_regs = u.max_regs.max(r);
        }
        if let Some(s) = number_before(line, "bytes stack frame") {
            u.max_stack = u.max_stack.max(s);
        }
        let stores = number_before(line, "bytes spill stores").unwrap_or(0);
        let loads = number_before(line, "bytes spill loads").unwrap_or(0);
        if stores + loads > 0 {
            u.spills.push((current.clone(), stores, loads));
        }
    }
    if u.min_regs == u32::MAX {
        u.min_regs = 0;
    }
    u
}

// ---------------------------------------------------------------------------

/// Real SM targets, so ptxas runs and checks the inline PTX; `-v` for its
/// resource report.
fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--ptxas-options=-v".into(),
    ]
}

fn compile_all_for(arch: &str) {
    let Some(nvrtc) = nvrtc_or_skip() else { return };
    println!("NVRTC {}.{} from {}", nvrtc.version.0, nvrtc.version.1, nvrtc.origin);

    let options = compile_options(arch);
    let mut exported = BTreeSet::new();
    let mut failures = Failures::new(env_flag("FERROCOMM_ALLOW_SPILLS"));
    // A kernel edit recompiles one module in seconds where all take minutes
    // (`FERROCOMM_NVRTC_MODULES=fused`); the missing-entries check then
    // cannot hold and is skipped.
    let only: Option<Vec<String>> = std::env::var("FERROCOMM_NVRTC_MODULES")
        .ok()
        .map(|v| v.split(',').map(|m| m.trim().to_string()).collect());

    for module in ALL_MODULES {
        if only.as_ref().is_some_and(|o| !o.iter().any(|m| m == module.name)) {
            continue;
        }
        let started = std::time::Instant::now();
        let text = with_abi_checks(module.full_text(ferrocomm::device::BackendKind::Cuda));
        let compiled = match nvrtc.compile(&text, &format!("{}.cu", module.name), &options) {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("module {} for {arch} failed to compile:\n{e}", module.name));
                continue;
            }
        };
        let secs = started.elapsed().as_secs_f64();
        let entries = match cubin_entry_points(&compiled.cubin) {
            Ok(e) => e,
            Err(e) => {
                failures.push(format!("module {} for {arch}: {e}", module.name));
                continue;
            }
        };
        let usage = ptxas_usage(&compiled.log);
        println!(
            "{arch}: module {}: {} entry points, cubin {} KiB, {:.1} s; ptxas: {} kernels, {}..{} registers, \
             max stack frame {} B, {} with spills",
            module.name,
            entries.len(),
            compiled.cubin.len() / 1024,
            secs,
            usage.kernels,
            usage.min_regs,
            usage.max_regs,
            usage.max_stack,
            usage.spills.len(),
        );
        if std::env::var_os("FERROCOMM_NVRTC_LOG").is_some() {
            println!("{}", compiled.log);
        }
        for (k, s, l) in &usage.spills {
            failures.spill(format!("{arch}: kernel {k} spills ({s} B stores, {l} B loads)"));
        }
        exported.extend(entries);
    }

    if only.is_some() {
        failures.assert_none();
        return;
    }
    let expected: BTreeSet<String> = all_kernel_names().into_iter().collect();
    let missing: Vec<&String> = expected.difference(&exported).collect();
    let extra: Vec<&String> = exported.difference(&expected).collect();
    if !extra.is_empty() {
        println!("{arch}: note: entry points not in all_kernel_names(): {extra:?}");
    }
    if !missing.is_empty() {
        failures.push(format!(
            "{arch}: {} kernels missing from the cubins: {missing:?}",
            missing.len()
        ));
    }
    if failures.is_empty() {
        println!("{arch}: all {} expected kernels present", expected.len());
    }
    failures.assert_none();
}

#[test]
fn kernels_compile_sm_80() {
    compile_all_for("sm_80");
}

#[test]
fn kernels_compile_sm_90() {
    compile_all_for("sm_90");
}

#[test]
fn kernel_names_are_unique_and_well_formed() {
    let names = all_kernel_names();
    let set: BTreeSet<&String> = names.iter().collect();
    assert_eq!(set.len(), names.len(), "duplicate kernel names");
    for n in &names {
        assert!(
            n.starts_with("fc_") && n.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_'),
            "bad name {n}"
        );
    }
}

// ---------------------------------------------------------------------------
// The device API (kernels-cuda/device_api.cuh) and the kernels written on it.

/// EP's other kernels, one compile each as for `fc_ep_dispatch`. Only this
/// check looks for them; the HIP one looks for `fc_ep_dispatch` alone.
const EP_ENTRY_POINTS: [DeviceApiSource; 6] = [
    DeviceApiSource::new("ep_layout", EP_KERNELS, "fc_ep_layout"),
    DeviceApiSource::new("ep_dispatch_layout", EP_KERNELS, "fc_ep_dispatch_layout"),
    DeviceApiSource::new("ep_combine_ll", EP_KERNELS, "fc_ep_combine_ll"),
    DeviceApiSource::new("ep_combine_ll_take", EP_KERNELS, "fc_ep_combine_ll_take"),
    DeviceApiSource::new("ep_combine", EP_KERNELS, "fc_ep_combine"),
    DeviceApiSource::new("ep_combine_reduce", EP_KERNELS, "fc_ep_combine_reduce"),
];

/// Compiles every source on the device API for `arch`: each must compile,
/// export its entry point and not spill.
fn compile_device_api_for(arch: &str) {
    let Some(nvrtc) = nvrtc_or_skip() else { return };
    println!("NVRTC {}.{} from {}", nvrtc.version.0, nvrtc.version.1, nvrtc.origin);
    let options = compile_options(arch);
    let mut failures = Failures::new(env_flag("FERROCOMM_ALLOW_SPILLS"));
    for source in DEVICE_API_SOURCES.iter().chain(&EP_ENTRY_POINTS) {
        let (name, entry) = (format!("{}.cu", source.name), source.entry);
        let compiled = match nvrtc.compile(&with_abi_checks(source.text(CUDA_PRELUDE)), &name, &options) {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("{name} for {arch} failed to compile:\n{e}"));
                continue;
            }
        };
        match cubin_entry_points(&compiled.cubin) {
            Ok(e) if e.contains(entry) => {}
            Ok(e) => failures.push(format!("{name} for {arch}: no entry point {entry} (found {e:?})")),
            Err(e) => failures.push(format!("{name} for {arch}: {e}")),
        }
        let usage = ptxas_usage(&compiled.log);
        println!(
            "{arch}: {name}: {}..{} registers, max stack frame {} B, {} with spills",
            usage.min_regs,
            usage.max_regs,
            usage.max_stack,
            usage.spills.len()
        );
        for (k, s, l) in &usage.spills {
            failures.spill(format!("{arch}: kernel {k} spills ({s} B stores, {l} B loads)"));
        }
    }
    failures.assert_none();
}

#[test]
fn device_api_compiles_sm_80() {
    compile_device_api_for("sm_80");
}

#[test]
fn device_api_compiles_sm_90() {
    compile_device_api_for("sm_90");
}
