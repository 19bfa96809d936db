//! NVRTC: one compile unit to a CUBIN for the device's exact arch (so the
//! driver never JITs), or to PTX for the newest arch NVRTC knows when the
//! device is newer than NVRTC. NVRTC is thread-safe for distinct programs,
//! so units compile in parallel.

use std::ffi::c_char;

use cudarc::nvrtc::sys as nvrtc_sys;

use super::driver::{nvrtc, nvrtc_describe, nvrtc_has, NVRTC_OPTIONAL_SYMBOLS};
use super::table::Caps;
use super::Cuda;
use crate::algo::BLOCK_THREADS;
use crate::backends::gpu::compile::CInputs;
use crate::backends::gpu::vendor::{CompileTarget, ImageKind, Rtc};
use crate::device::DeviceFacts;
use crate::error::Result;

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

/// `sm_XX` (a CUBIN) for the device's own arch when NVRTC supports it;
/// otherwise `compute_XX` (PTX the driver JITs) for the newest arch NVRTC
/// knows that the device can run.
pub(super) fn choose_arch(cc: (i32, i32), supported: Option<&[i32]>) -> (String, bool) {
    let want = cc.0 * 10 + cc.1;
    match supported {
        Some(list) if !list.contains(&want) => match list.iter().copied().filter(|&a| a <= want).max() {
            Some(best) => (format!("compute_{best}"), false),
            None => (format!("sm_{want}"), true),
        },
        _ => (format!("sm_{want}"), true),
    }
}

/// The target for compute capability `cc` (no device needed). The kernels
/// are launched with at most [`BLOCK_THREADS`] threads, which lets the
/// compiler use more registers.
pub(super) fn target_for(cc: (i32, i32)) -> Result<CompileTarget> {
    let (major, minor) = nvrtc()?;
    let (arch, cubin) = choose_arch(cc, supported_archs().as_deref());
    Ok(CompileTarget {
        options: vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".to_string(),
            format!("-DFC_MAX_BLOCK_THREADS={BLOCK_THREADS}"),
        ],
        arch,
        compiler: format!("nvrtc {major}.{minor}"),
        extension: if cubin { "cubin" } else { "ptx" },
        image: if cubin { ImageKind::Elf } else { ImageKind::Ptx },
    })
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

/// One of NVRTC's "size, then bytes" outputs.
fn output(
    prog: &Program,
    what: &str,
    size_of: unsafe extern "C" fn(nvrtc_sys::nvrtcProgram, *mut usize) -> nvrtc_sys::nvrtcResult,
    get: unsafe extern "C" fn(nvrtc_sys::nvrtcProgram, *mut c_char) -> nvrtc_sys::nvrtcResult,
) -> std::result::Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: live, compiled program; valid out-pointer.
    let r = unsafe { size_of(prog.0, &mut size) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return Err(format!("{what} size: {}", nvrtc_describe(r)));
    }
    let mut buf = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes NVRTC reported.
    let r = unsafe { get(prog.0, buf.as_mut_ptr() as *mut c_char) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("{what}: {}", nvrtc_describe(r)));
    }
    Ok(buf)
}

/// The two output getters, as plain function pointers (cudarc's wrappers
/// are safe to take the address of: each checks its symbol once, and the
/// symbols were checked at load).
unsafe extern "C" fn cubin_size(p: nvrtc_sys::nvrtcProgram, s: *mut usize) -> nvrtc_sys::nvrtcResult {
    // SAFETY: forwarded unchanged from the caller.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(p, s) }
}
unsafe extern "C" fn cubin(p: nvrtc_sys::nvrtcProgram, b: *mut c_char) -> nvrtc_sys::nvrtcResult {
    // SAFETY: forwarded unchanged from the caller.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(p, b) }
}
unsafe extern "C" fn ptx_size(p: nvrtc_sys::nvrtcProgram, s: *mut usize) -> nvrtc_sys::nvrtcResult {
    // SAFETY: forwarded unchanged from the caller.
    unsafe { nvrtc_sys::nvrtcGetPTXSize(p, s) }
}
unsafe extern "C" fn ptx(p: nvrtc_sys::nvrtcProgram, b: *mut c_char) -> nvrtc_sys::nvrtcResult {
    // SAFETY: forwarded unchanged from the caller.
    unsafe { nvrtc_sys::nvrtcGetPTX(p, b) }
}

/// Compile `src` with NVRTC into a CUBIN (or NUL-terminated PTX).
pub(super) fn compile(target: &CompileTarget, unit: &str, src: &str) -> Result<Vec<u8>> {
    nvrtc()?;
    let fail = |log: String| target.error(unit, log);
    let inputs = CInputs::new(target, unit, "cu", src)?;
    let opt_ptrs = inputs.option_ptrs();

    let mut raw: nvrtc_sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NUL-terminated source and name that outlive the call; no headers.
    let r = unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            &mut raw,
            inputs.source.as_ptr(),
            inputs.name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail(format!("nvrtcCreateProgram: {}", nvrtc_describe(r))));
    }
    let prog = Program(raw);
    // SAFETY: live program; `opt_ptrs` points into `inputs`, alive for the call.
    let r = unsafe { nvrtc_sys::nvrtcCompileProgram(prog.0, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        let log = program_log(&prog);
        return Err(fail(format!(
            "{} (options: {})\n{log}",
            nvrtc_describe(r),
            target.options.join(" ")
        )));
    }
    if target.image == ImageKind::Elf {
        output(&prog, "nvrtcGetCUBIN", cubin_size, cubin).map_err(fail)
    } else {
        let mut buf = output(&prog, "nvrtcGetPTX", ptx_size, ptx).map_err(fail)?;
        if buf.last() != Some(&0) {
            buf.push(0);
        }
        Ok(buf)
    }
}

impl Rtc for Cuda {
    fn max_parallel_compiles() -> usize {
        usize::MAX
    }

    fn compile_target(_facts: &DeviceFacts, caps: &Caps) -> Result<CompileTarget> {
        target_for(caps.cc)
    }

    fn compile(target: &CompileTarget, unit: &str, text: &str) -> Result<Vec<u8>> {
        compile(target, unit, text)
    }

    fn rtc_info() -> String {
        match nvrtc() {
            Ok((major, minor)) => format!("NVRTC {major}.{minor}"),
            Err(e) => format!("no NVRTC ({e})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_prefers_cubin_for_the_exact_arch() {
        assert_eq!(choose_arch((9, 0), None), ("sm_90".into(), true));
        assert_eq!(choose_arch((9, 0), Some(&[75, 80, 86, 89, 90, 100])).0, "sm_90");
        // A device newer than NVRTC knows: PTX for the newest arch it knows.
        assert_eq!(
            choose_arch((12, 1), Some(&[80, 90, 100, 120])),
            ("compute_120".into(), false)
        );
        // Older than anything NVRTC supports: ask anyway, NVRTC reports it.
        assert!(choose_arch((6, 0), Some(&[75, 80])).1);
    }

    #[test]
    fn options_pin_arch_and_block_size() {
        // Without NVRTC here the target cannot be built; the options are
        // checked where it can.
        if let Ok(t) = target_for((9, 0)) {
            assert!(t.options.contains(&"--gpu-architecture=sm_90".to_string()));
            assert!(t.options.contains(&format!("-DFC_MAX_BLOCK_THREADS={BLOCK_THREADS}")));
            assert!(t.compiler.starts_with("nvrtc "));
        }
    }
}
