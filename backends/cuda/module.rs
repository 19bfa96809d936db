//! Kernel modules: NVRTC compiles the embedded CUDA source to a CUBIN for the
//! device's exact arch (so the driver never JITs), the image is cached per
//! process and on disk, and each device context loads it with
//! `cuModuleLoadData`. Entry points are looked up lazily and cached by name.
//!
//! Caches:
//! - in memory: one image per (module, source, options, target, NVRTC
//!   version), shared by every communicator and thread rank of the process,
//!   so N ranks compile once;
//! - on disk: `$FERROCOMM_CACHE_DIR` (set it to `off` to disable), else
//!   `$XDG_CACHE_HOME/ferrocomm` or `~/.cache/ferrocomm`, files named by a
//!   128-bit hash of the same key. The directory must belong to us and not be
//!   writable by others, or it is not used (a writable kernel cache would be
//!   code injection). A cached image that fails to load is recompiled.

use crate::backends::kernel_cache::{cache_dir, cache_key, disk_read, disk_write, sanitize};
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc_sys;

use super::driver::{check, drop_check, error, nvrtc, nvrtc_describe, nvrtc_has, Context, NVRTC_OPTIONAL_SYMBOLS};
use super::BLOCK_THREADS;
use crate::device::ModuleSource;
use crate::error::{Error, Result};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What NVRTC is asked to produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Target {
    /// `sm_90` (CUBIN) or `compute_90` (PTX the driver JITs).
    pub(super) label: String,
    pub(super) cubin: bool,
}

/// Architectures this NVRTC can target, when it can say.
fn supported_archs() -> Option<Vec<i32>> {
    if !NVRTC_OPTIONAL_SYMBOLS.iter().all(|s| nvrtc_has(s)) {
        return None;
    }
    let mut n = 0;
    // SAFETY: valid out-pointer; the symbol exists (checked above).
    if unsafe { nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n) } != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || n <= 0 {
        return None;
    }
    let mut archs = vec![0i32; n as usize];
    // SAFETY: the buffer holds exactly the `n` entries NVRTC reported.
    if unsafe { nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) } != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return None;
    }
    Some(archs)
}

/// CUBIN for the device's own arch when NVRTC supports it; otherwise PTX for
/// the newest arch NVRTC knows that the device can run (the driver JITs it).
pub(super) fn choose_target(cc: (i32, i32), supported: Option<&[i32]>) -> Target {
    let want = cc.0 * 10 + cc.1;
    let cubin = Target {
        label: format!("sm_{want}"),
        cubin: true,
    };
    match supported {
        Some(list) if !list.contains(&want) => match list.iter().copied().filter(|&a| a <= want).max() {
            Some(best) => Target {
                label: format!("compute_{best}"),
                cubin: false,
            },
            None => cubin,
        },
        _ => cubin,
    }
}

/// NVRTC options for a target. The kernels are launched with at most
/// [`BLOCK_THREADS`] threads, which lets the compiler use more registers.
pub(super) fn compile_options(target: &Target) -> Vec<String> {
    vec![
        format!("--gpu-architecture={}", target.label),
        "--std=c++17".to_string(),
        format!("-DFC_MAX_BLOCK_THREADS={BLOCK_THREADS}"),
    ]
}

#[derive(Clone)]
struct Cached {
    bytes: Arc<[u8]>,
    from_disk: bool,
}

static IMAGES: OnceLock<Mutex<HashMap<String, Cached>>> = OnceLock::new();

/// The compiled image for `source` on a device of compute capability `cc`.
/// `fresh` skips both caches (used when a cached image failed to load).
fn image(source: &ModuleSource, cc: (i32, i32), fresh: bool) -> Result<Cached> {
    let (major, minor) = nvrtc()?;
    let supported = supported_archs();
    let target = choose_target(cc, supported.as_deref());
    let options = compile_options(&target);
    let version = format!("nvrtc {major}.{minor}");
    let joined = options.join("\0");
    let text = source.full_text(crate::device::BackendKind::Cuda);
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
    let file = format!(
        "{}-{}-{key}.{}",
        sanitize(source.name),
        target.label,
        if target.cubin { "cubin" } else { "ptx" }
    );
    let dir = cache_dir();
    if !fresh {
        if let Some(bytes) = dir.as_deref().and_then(|d| disk_read(&d.join(&file))) {
            let c = Cached {
                bytes: bytes.into(),
                from_disk: true,
            };
            images.insert(key, c.clone());
            return Ok(c);
        }
    }
    let bytes = compile(source.name, &text, &target, &options)?;
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

/// Compile `source` for compute capability `cc` into the disk cache
/// (`FERROCOMM_CACHE_DIR`) without a device, so a GPU machine can skip the
/// NVRTC compile. Needs only libnvrtc (see `FERROCOMM_NVRTC_PATH`).
pub fn precompile(source: &ModuleSource, cc: (i32, i32)) -> Result<()> {
    if cache_dir().is_none() {
        return Err(crate::error::Error::invalid(
            "precompiling needs a disk cache: set FERROCOMM_CACHE_DIR to a directory",
        ));
    }
    image(source, cc, false).map(|_| ())
}

/// An NVRTC program, destroyed on drop.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: destroys the program created in `compile`, once.
        let _ = unsafe { nvrtc_sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

fn program_log(prog: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: live program, valid out-pointer.
    if unsafe { nvrtc_sys::nvrtcGetProgramLogSize(prog.0, &mut size) } != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS
        || size == 0
    {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes NVRTC reported (NUL included).
    if unsafe { nvrtc_sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut c_char) }
        != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS
    {
        return String::new();
    }
    String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .trim_end()
        .to_string()
}

/// Compile `src` with NVRTC into a CUBIN (or NUL-terminated PTX).
fn compile(name: &str, src: &str, target: &Target, options: &[String]) -> Result<Vec<u8>> {
    let fail = |log: String| Error::Compile {
        module: name.to_string(),
        arch: target.label.clone(),
        log,
    };
    let csrc = CString::new(src).map_err(|_| fail("the source contains a NUL byte".into()))?;
    let cname = CString::new(format!("{}.cu", sanitize(name))).map_err(|_| fail("bad module name".into()))?;
    let copts: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| fail("an option contains a NUL byte".into()))?;
    let opt_ptrs: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();

    let mut raw: nvrtc_sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NUL-terminated source and name that outlive the call; no headers.
    let r = unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            &mut raw,
            csrc.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail(format!("nvrtcCreateProgram: {}", nvrtc_describe(r))));
    }
    let prog = Program(raw);
    // SAFETY: live program; `opt_ptrs` points at `copts`, alive for the call.
    let r = unsafe { nvrtc_sys::nvrtcCompileProgram(prog.0, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        let log = program_log(&prog);
        return Err(fail(format!(
            "{} (options: {})\n{log}",
            nvrtc_describe(r),
            options.join(" ")
        )));
    }
    let mut size = 0usize;
    let bytes = if target.cubin {
        // SAFETY: live, compiled program; valid out-pointer.
        let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) };
        if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return Err(fail(format!("nvrtcGetCUBINSize: {}", nvrtc_describe(r))));
        }
        let mut buf = vec![0u8; size];
        // SAFETY: the buffer holds the `size` bytes NVRTC reported.
        let r = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr() as *mut c_char) };
        if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(fail(format!("nvrtcGetCUBIN: {}", nvrtc_describe(r))));
        }
        buf
    } else {
        // SAFETY: live, compiled program; valid out-pointer.
        let r = unsafe { nvrtc_sys::nvrtcGetPTXSize(prog.0, &mut size) };
        if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return Err(fail(format!("nvrtcGetPTXSize: {}", nvrtc_describe(r))));
        }
        let mut buf = vec![0u8; size];
        // SAFETY: the buffer holds the `size` bytes NVRTC reported.
        let r = unsafe { nvrtc_sys::nvrtcGetPTX(prog.0, buf.as_mut_ptr() as *mut c_char) };
        if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(fail(format!("nvrtcGetPTX: {}", nvrtc_describe(r))));
        }
        if buf.last() != Some(&0) {
            buf.push(0);
        }
        buf
    };
    Ok(bytes)
}

// ---- disk cache ----

// ---- loaded modules ----

#[derive(Clone, Copy)]
struct Function(sys::CUfunction);

// SAFETY: a CUfunction is a driver handle, valid while its module is loaded
// (the module owns the cache that holds it) and usable from any thread.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

/// A module loaded into one device's context, with its entry points cached.
pub struct CudaModule {
    pub(super) ctx: Arc<Context>,
    raw: sys::CUmodule,
    name: String,
    functions: Mutex<HashMap<String, Function>>,
}

// SAFETY: a CUmodule is a driver handle usable from any thread; the function
// cache is behind a mutex.
unsafe impl Send for CudaModule {}
// SAFETY: as above.
unsafe impl Sync for CudaModule {}

fn load_image(bytes: &[u8]) -> Result<sys::CUmodule> {
    let mut raw: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `bytes` is a CUBIN or NUL-terminated PTX image that outlives the
    // call (the driver copies it); the caller made the context current.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut raw, bytes.as_ptr() as *const c_void)
    })?;
    Ok(raw)
}

impl CudaModule {
    /// Compile (or fetch) `source` for compute capability `cc` and load it into
    /// `ctx`, which the caller made current.
    pub(super) fn load(ctx: Arc<Context>, source: &ModuleSource, cc: (i32, i32)) -> Result<CudaModule> {
        let img = image(source, cc, false)?;
        let raw = match load_image(&img.bytes) {
            Ok(raw) => raw,
            // A stale or damaged disk cache entry: compile afresh once.
            Err(_) if img.from_disk => load_image(&image(source, cc, true)?.bytes)?,
            Err(e) => return Err(e),
        };
        Ok(CudaModule {
            ctx,
            raw,
            name: source.name.to_string(),
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// The entry point `name`, looked up once and cached.
    pub(super) fn function(&self, name: &str) -> Result<sys::CUfunction> {
        let mut functions = lock(&self.functions);
        if let Some(f) = functions.get(name) {
            return Ok(f.0);
        }
        let cname =
            CString::new(name).map_err(|_| Error::invalid(format!("kernel name {name:?} contains a NUL byte")))?;
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: live module, NUL-terminated name, valid out-pointer.
        match unsafe { sys::cuModuleGetFunction(&mut f, self.raw, cname.as_ptr()) } {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_NOT_FOUND => {
                return Err(Error::invalid(format!(
                    "CUDA module {} has no kernel named {name}",
                    self.name
                )));
            }
            other => return Err(error("cuModuleGetFunction", other)),
        }
        functions.insert(name.to_string(), Function(f));
        Ok(f)
    }
}

impl Drop for CudaModule {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        // SAFETY: unloads the module loaded in `load`, once; owners drain the
        // streams that ran its kernels before dropping it.
        drop_check("cuModuleUnload", unsafe { sys::cuModuleUnload(self.raw) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_prefers_cubin_for_the_exact_arch() {
        assert_eq!(
            choose_target((9, 0), None),
            Target {
                label: "sm_90".into(),
                cubin: true
            }
        );
        assert_eq!(choose_target((9, 0), Some(&[75, 80, 86, 89, 90, 100])).label, "sm_90");
        // A device newer than NVRTC knows: PTX for the newest arch it knows.
        let t = choose_target((12, 1), Some(&[80, 90, 100, 120]));
        assert_eq!(
            t,
            Target {
                label: "compute_120".into(),
                cubin: false
            }
        );
        // Older than anything NVRTC supports: ask anyway, NVRTC reports it.
        assert!(choose_target((6, 0), Some(&[75, 80])).cubin);
    }

    #[test]
    fn options_pin_arch_and_block_size() {
        let o = compile_options(&choose_target((9, 0), None));
        assert!(o.contains(&"--gpu-architecture=sm_90".to_string()));
        assert!(o.contains(&format!("-DFC_MAX_BLOCK_THREADS={BLOCK_THREADS}")));
    }

    #[test]
    fn cache_keys_separate_every_part() {
        let a = cache_key(&[b"m", b"src", b"opts", b"nvrtc 13.0"]);
        assert_eq!(a.len(), 32);
        assert_eq!(a, cache_key(&[b"m", b"src", b"opts", b"nvrtc 13.0"]));
        assert_ne!(a, cache_key(&[b"m", b"src", b"opts", b"nvrtc 13.1"]));
        assert_ne!(a, cache_key(&[b"ms", b"rc", b"opts", b"nvrtc 13.0"]));
    }

    #[test]
    fn file_names_are_sanitized() {
        assert_eq!(sanitize("../x y"), "___x_y");
        assert_eq!(sanitize(""), "module");
    }
}
