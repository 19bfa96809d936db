//! Kernel modules: hipRTC compiles the embedded HIP source (the HIP prelude +
//! the shared algorithm body, `ModuleSource::hip`) to a code object for the
//! device's exact arch (`--offload-arch=gfx942`), the image is cached per
//! process and on disk, and each device loads it with `hipModuleLoadData`.
//! Entry points are looked up lazily and cached by name.
//!
//! Caches (the same rules as the CUDA backend's):
//! - in memory: one image per (module, source, options, arch, hipRTC and
//!   runtime versions), shared by every communicator and thread rank of the
//!   process, so N ranks compile once;
//! - on disk: `$FERROCOMM_CACHE_DIR` (set it to `off` to disable), else
//!   `$XDG_CACHE_HOME/ferrocomm` or `~/.cache/ferrocomm`, files named by a
//!   128-bit hash of the same key. The directory must belong to us and not be
//!   writable by others, or it is not used (a writable kernel cache would be
//!   code injection). A cached image that fails to load is recompiled.

use crate::backends::kernel_cache::{cache_dir, cache_key, disk_read, disk_write, sanitize};
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::driver::{
    check, clear_last_error, drop_check, error, rtc, version_string, DeviceCtx, HipFunction, HipModule as RawModule,
    HiprtcProgram, Rtc, HIPRTC_SUCCESS, HIP_ERROR_INVALID_DEVICE_FUNCTION, HIP_ERROR_NOT_FOUND, HIP_SUCCESS,
};
use super::BLOCK_THREADS;
use crate::device::ModuleSource;
use crate::error::{Error, Result};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// hipRTC options for an arch. The kernels are launched with at most
/// [`BLOCK_THREADS`] threads (their flat work-group size bound, which lets the
/// compiler use more registers), and time their spin loops with a clock of
/// `wallclock_khz`. Contraction stays off (the prelude also pins it).
pub(super) fn compile_options(arch: &str, wallclock_khz: u32) -> Vec<String> {
    vec![
        format!("--offload-arch={arch}"),
        "-O3".to_string(),
        "-std=c++17".to_string(),
        "-ffp-contract=off".to_string(),
        format!("-DFC_MAX_BLOCK_THREADS={BLOCK_THREADS}"),
        format!("-DFC_WALLCLOCK_KHZ={wallclock_khz}"),
    ]
}

#[derive(Clone)]
struct Cached {
    bytes: Arc<[u8]>,
    from_disk: bool,
}

static IMAGES: OnceLock<Mutex<HashMap<String, Cached>>> = OnceLock::new();

/// The compiled image of `source` for `arch`. `fresh` skips both caches (used
/// when a cached image failed to load).
fn image(source: &ModuleSource, arch: &str, wallclock_khz: u32, runtime_version: i32, fresh: bool) -> Result<Cached> {
    if source.hip.is_empty() {
        return Err(Error::Unsupported(format!(
            "kernel module {} has no HIP source (ModuleSource::hip is empty)",
            source.name
        )));
    }
    let rtc = rtc()?;
    let options = compile_options(arch, wallclock_khz);
    let version = format!(
        "hiprtc {}.{} runtime {}",
        rtc.version.0,
        rtc.version.1,
        version_string(runtime_version)
    );
    let joined = options.join("\0");
    let text = source.full_text(crate::device::BackendKind::Hip);
    let key = cache_key(&[
        source.name.as_bytes(),
        text.as_bytes(),
        joined.as_bytes(),
        version.as_bytes(),
    ]);

    // Held across the compile: concurrent ranks wait for the first one's result.
    let mut images = lock(IMAGES.get_or_init(Default::default));
    if !fresh {
        if let Some(c) = images.get(&key) {
            return Ok(c.clone());
        }
    }
    let file = format!("{}-{}-{key}.hsaco", sanitize(source.name), sanitize(arch));
    let dir = cache_dir();
    if !fresh {
        if let Some(bytes) = dir.as_deref().and_then(|d| disk_read_elf(&d.join(&file))) {
            let c = Cached {
                bytes: bytes.into(),
                from_disk: true,
            };
            images.insert(key, c.clone());
            return Ok(c);
        }
    }
    let bytes = compile(rtc, source.name, &text, arch, &options)?;
    if let Some(d) = dir.as_deref() {
        disk_write(d, &file, &bytes);
    }
    let c = Cached {
        bytes: bytes.into(),
        from_disk: false,
    };
    images.insert(key, c.clone());
    Ok(c)
}

/// Compile `source` for `arch` with hipRTC, bypassing both caches. Needs the
/// HIP runtime library (for hipRTC) but no device.
pub(super) fn compile_fresh(source: &ModuleSource, arch: &str, wallclock_khz: u32) -> Result<Vec<u8>> {
    if source.hip.is_empty() {
        return Err(Error::Unsupported(format!(
            "kernel module {} has no HIP source (ModuleSource::hip is empty)",
            source.name
        )));
    }
    let rtc = rtc()?;
    compile(
        rtc,
        source.name,
        &source.full_text(crate::device::BackendKind::Hip),
        arch,
        &compile_options(arch, wallclock_khz),
    )
}

/// A hipRTC program, destroyed on drop.
struct Program<'a> {
    rtc: &'a Rtc,
    raw: HiprtcProgram,
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: destroys the program created in `compile`, once.
        let _ = unsafe { (self.rtc.api.destroy_program)(&mut self.raw) };
    }
}

fn rtc_describe(rtc: &Rtc, r: i32) -> String {
    // SAFETY: returns a pointer to a static string (or null).
    let p = unsafe { (rtc.api.get_error_string)(r) };
    if p.is_null() {
        format!("hiprtcResult {r}")
    } else {
        // SAFETY: non-null, NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn program_log(prog: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: live program, valid out-pointer.
    if unsafe { (prog.rtc.api.get_program_log_size)(prog.raw, &mut size) } != HIPRTC_SUCCESS || size == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; size + 1];
    // SAFETY: the buffer holds the `size` bytes hipRTC reported, plus one.
    if unsafe { (prog.rtc.api.get_program_log)(prog.raw, buf.as_mut_ptr() as *mut c_char) } != HIPRTC_SUCCESS {
        return String::new();
    }
    String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .trim_end()
        .to_string()
}

/// Compile `src` with hipRTC into a code object (an AMDGPU ELF). One compile
/// at a time per process: some hipRTC/comgr versions are not thread-safe
/// (ROCm 5's crashes on concurrent compiles).
fn compile(rtc: &Rtc, name: &str, src: &str, arch: &str, options: &[String]) -> Result<Vec<u8>> {
    static COMPILING: Mutex<()> = Mutex::new(());
    let _one_at_a_time = lock(&COMPILING);
    let fail = |log: String| Error::Compile {
        module: name.to_string(),
        arch: arch.to_string(),
        log,
    };
    let csrc = CString::new(src).map_err(|_| fail("the source contains a NUL byte".into()))?;
    let cname = CString::new(format!("{}.hip", sanitize(name))).map_err(|_| fail("bad module name".into()))?;
    let copts: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| fail("an option contains a NUL byte".into()))?;
    let opt_ptrs: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();

    let mut raw: HiprtcProgram = std::ptr::null_mut();
    // SAFETY: NUL-terminated source and name that outlive the call; no headers.
    let r = unsafe {
        (rtc.api.create_program)(
            &mut raw,
            csrc.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != HIPRTC_SUCCESS {
        return Err(fail(format!("hiprtcCreateProgram: {}", rtc_describe(rtc, r))));
    }
    let prog = Program { rtc, raw };
    // SAFETY: live program; `opt_ptrs` points at `copts`, alive for the call.
    let r = unsafe { (rtc.api.compile_program)(prog.raw, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    if r != HIPRTC_SUCCESS {
        let log = program_log(&prog);
        return Err(fail(format!(
            "{} (hipRTC {}.{} from {}; options: {})\n{log}",
            rtc_describe(rtc, r),
            rtc.version.0,
            rtc.version.1,
            rtc.path,
            options.join(" ")
        )));
    }
    let mut size = 0usize;
    // SAFETY: live, compiled program; valid out-pointer.
    let r = unsafe { (rtc.api.get_code_size)(prog.raw, &mut size) };
    if r != HIPRTC_SUCCESS || size == 0 {
        return Err(fail(format!("hiprtcGetCodeSize: {}", rtc_describe(rtc, r))));
    }
    let mut buf = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes hipRTC reported.
    let r = unsafe { (rtc.api.get_code)(prog.raw, buf.as_mut_ptr() as *mut c_char) };
    if r != HIPRTC_SUCCESS {
        return Err(fail(format!("hiprtcGetCode: {}", rtc_describe(rtc, r))));
    }
    Ok(buf)
}

// ---- disk cache ----

/// Only ELF code objects are ever written; anything else is not loaded.
fn disk_read_elf(path: &Path) -> Option<Vec<u8>> {
    disk_read(path).filter(|b| b.starts_with(b"\x7fELF"))
}

// ---- loaded modules ----

#[derive(Clone, Copy)]
struct Function(HipFunction);

// SAFETY: a hipFunction_t is a runtime handle, valid while its module is loaded
// (the module owns the cache that holds it) and usable from any thread.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

/// A module loaded on one device, with its entry points cached.
pub struct HipModule {
    pub(super) ctx: Arc<DeviceCtx>,
    raw: RawModule,
    name: String,
    functions: Mutex<HashMap<String, Function>>,
}

// SAFETY: a hipModule_t is a runtime handle usable from any thread; the
// function cache is behind a mutex.
unsafe impl Send for HipModule {}
// SAFETY: as above.
unsafe impl Sync for HipModule {}

fn load_image(ctx: &DeviceCtx, bytes: &[u8]) -> Result<RawModule> {
    let mut raw: RawModule = std::ptr::null_mut();
    // SAFETY: `bytes` is a code object that outlives the call (the runtime
    // copies it); the caller made the device current.
    check("hipModuleLoadData", unsafe {
        (ctx.hip().module_load_data)(&mut raw, bytes.as_ptr() as *const c_void)
    })?;
    Ok(raw)
}

impl HipModule {
    /// Compile (or fetch) `source` for `arch` and load it on `ctx`'s device,
    /// which the caller made current.
    pub(super) fn load(
        ctx: Arc<DeviceCtx>,
        source: &ModuleSource,
        arch: &str,
        wallclock_khz: u32,
        runtime_version: i32,
    ) -> Result<HipModule> {
        let img = image(source, arch, wallclock_khz, runtime_version, false)?;
        let raw = match load_image(&ctx, &img.bytes) {
            Ok(raw) => raw,
            // A stale or damaged disk cache entry: compile afresh once.
            Err(_) if img.from_disk => {
                load_image(&ctx, &image(source, arch, wallclock_khz, runtime_version, true)?.bytes)?
            }
            Err(e) => return Err(e),
        };
        Ok(HipModule {
            ctx,
            raw,
            name: source.name.to_string(),
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// Whether the module exports a kernel named `name`.
    pub fn has_kernel(&self, name: &str) -> bool {
        self.ctx.bind().is_ok() && self.function(name).is_ok()
    }

    /// The entry point `name`, looked up once and cached.
    pub(super) fn function(&self, name: &str) -> Result<HipFunction> {
        let mut functions = lock(&self.functions);
        if let Some(f) = functions.get(name) {
            return Ok(f.0);
        }
        let cname =
            CString::new(name).map_err(|_| Error::invalid(format!("kernel name {name:?} contains a NUL byte")))?;
        let mut f: HipFunction = std::ptr::null_mut();
        // SAFETY: live module, NUL-terminated name, valid out-pointer.
        match unsafe { (self.ctx.hip().module_get_function)(&mut f, self.raw, cname.as_ptr()) } {
            HIP_SUCCESS if !f.is_null() => {}
            HIP_SUCCESS | HIP_ERROR_NOT_FOUND | HIP_ERROR_INVALID_DEVICE_FUNCTION => {
                clear_last_error();
                return Err(Error::invalid(format!(
                    "HIP module {} has no kernel named {name}",
                    self.name
                )));
            }
            other => return Err(error("hipModuleGetFunction", other)),
        }
        functions.insert(name.to_string(), Function(f));
        Ok(f)
    }
}

impl Drop for HipModule {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        // SAFETY: unloads the module loaded in `load`, once; owners drain the
        // streams that ran its kernels before dropping it.
        drop_check("hipModuleUnload", unsafe { (self.ctx.hip().module_unload)(self.raw) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_pin_arch_block_size_and_clock() {
        let o = compile_options("gfx942", 100_000);
        assert!(o.contains(&"--offload-arch=gfx942".to_string()));
        assert!(o.contains(&format!("-DFC_MAX_BLOCK_THREADS={BLOCK_THREADS}")));
        assert!(o.contains(&"-DFC_WALLCLOCK_KHZ=100000".to_string()));
        assert!(o.contains(&"-ffp-contract=off".to_string()));
        assert!(o.contains(&"-O3".to_string()) && o.contains(&"-std=c++17".to_string()));
    }

    #[test]
    fn cache_keys_separate_every_part() {
        let a = cache_key(&[b"m", b"src", b"opts", b"hiprtc 6.4"]);
        assert_eq!(a.len(), 32);
        assert_eq!(a, cache_key(&[b"m", b"src", b"opts", b"hiprtc 6.4"]));
        assert_ne!(a, cache_key(&[b"m", b"src", b"opts", b"hiprtc 7.0"]));
        assert_ne!(a, cache_key(&[b"ms", b"rc", b"opts", b"hiprtc 6.4"]));
    }

    #[test]
    fn file_names_are_sanitized() {
        assert_eq!(sanitize("../x y"), "___x_y");
        assert_eq!(sanitize(""), "module");
        assert_eq!(sanitize("gfx942:sramecc+"), "gfx942_sramecc_");
    }

    #[test]
    fn disk_cache_refuses_foreign_and_non_elf_files() {
        let dir = std::env::temp_dir().join(format!("ferrocomm-hip-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        disk_write(&dir, "a.hsaco", b"\x7fELF-code-object");
        assert_eq!(
            disk_read_elf(&dir.join("a.hsaco")).as_deref(),
            Some(&b"\x7fELF-code-object"[..])
        );
        disk_write(&dir, "b.hsaco", b"not an elf");
        assert_eq!(disk_read_elf(&dir.join("b.hsaco")), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
