//! hipRTC: one compile unit (the HIP prelude + the shared algorithm body +
//! entry points) to a code object for the device's exact gfx target.
//!
//! One compile at a time per process: hipRTC runs comgr, which keeps LLVM's
//! command-line options in process-global state, and ROCm 5's crashed on
//! concurrent compiles; no ROCm release documents hipRTC as thread-safe.
//! The pool's HIP lane therefore runs one compile at a time (loads go on in
//! parallel), and [`compile`] also takes a process-wide lock for callers
//! outside the pool.

use std::ffi::c_char;
use std::sync::Mutex;

use super::driver::{rtc, version_string, Rtc as RtcLib, HIPRTC_SUCCESS};
use super::table::HipCaps;
use super::Hip;
use crate::algo::BLOCK_THREADS;
use crate::backends::gpu::compile::CInputs;
use crate::backends::gpu::vendor::{CompileTarget, ImageKind, Rtc};
use crate::device::DeviceFacts;
use crate::error::Result;

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

/// The target for `arch` (no device needed).
pub(super) fn target_for(arch: &str, wallclock_khz: u32, runtime_version: i32) -> Result<CompileTarget> {
    let rtc = rtc()?;
    Ok(CompileTarget {
        arch: arch.to_string(),
        options: compile_options(arch, wallclock_khz),
        compiler: format!(
            "hiprtc {}.{} runtime {}",
            rtc.version.0,
            rtc.version.1,
            version_string(runtime_version)
        ),
        extension: "hsaco",
        image: ImageKind::Elf,
    })
}

/// A hipRTC program, destroyed on drop.
struct Program<'a> {
    rtc: &'a RtcLib,
    raw: super::driver::HiprtcProgram,
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: destroys the program created in `compile`, once.
        let _ = unsafe { (self.rtc.api.destroy_program)(&mut self.raw) };
    }
}

fn rtc_describe(rtc: &RtcLib, r: i32) -> String {
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

/// Compile `src` with hipRTC into a code object (an AMDGPU ELF).
pub(super) fn compile(target: &CompileTarget, unit: &str, src: &str) -> Result<Vec<u8>> {
    static COMPILING: Mutex<()> = Mutex::new(());
    let rtc = rtc()?;
    let _one_at_a_time = COMPILING.lock().unwrap_or_else(|e| e.into_inner());
    let fail = |log: String| target.error(unit, log);
    let inputs = CInputs::new(target, unit, "hip", src)?;
    let opt_ptrs = inputs.option_ptrs();

    let mut raw: super::driver::HiprtcProgram = std::ptr::null_mut();
    // SAFETY: NUL-terminated source and name that outlive the call; no headers.
    let r = unsafe {
        (rtc.api.create_program)(
            &mut raw,
            inputs.source.as_ptr(),
            inputs.name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != HIPRTC_SUCCESS {
        return Err(fail(format!("hiprtcCreateProgram: {}", rtc_describe(rtc, r))));
    }
    let prog = Program { rtc, raw };
    // SAFETY: live program; `opt_ptrs` points into `inputs`, alive for the call.
    let r = unsafe { (rtc.api.compile_program)(prog.raw, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    if r != HIPRTC_SUCCESS {
        let log = program_log(&prog);
        return Err(fail(format!(
            "{} (hipRTC {}.{} from {}; options: {})\n{log}",
            rtc_describe(rtc, r),
            rtc.version.0,
            rtc.version.1,
            rtc.path,
            target.options.join(" ")
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

impl Rtc for Hip {
    fn max_parallel_compiles() -> usize {
        1
    }

    fn compile_target(facts: &DeviceFacts, caps: &HipCaps) -> Result<CompileTarget> {
        target_for(&facts.arch, caps.wallclock_khz, caps.runtime_version)
    }

    fn compile(target: &CompileTarget, unit: &str, text: &str) -> Result<Vec<u8>> {
        compile(target, unit, text)
    }

    fn rtc_info() -> String {
        match rtc() {
            Ok(r) => format!("hipRTC {}.{} from {}", r.version.0, r.version.1, r.path),
            Err(e) => format!("no hipRTC ({e})"),
        }
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
}
