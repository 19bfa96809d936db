//! The HIP (ROCm) backend: [`GpuDevice`] over the HIP runtime and hipRTC,
//! loaded at run time with libloading through a hand-written table of the
//! entry points it calls, so it builds with no ROCm installed and never
//! links libamdhip64.
//!
//! This folder holds only what is HIP's own: the function table and library
//! search (`driver.rs`, `table.rs`), the IPC flavour (`ipc.rs`: hipIpc
//! handles on uncached `hipExtMallocWithFlags` memory), hipRTC (`rtc.rs`),
//! and finding the gfx target without `hipDeviceProp_t` (`arch.rs`, from
//! the KFD topology). Everything else is `backends::gpu`, shared with CUDA.
//!
//! - **Device binding.** HIP keeps the current device per thread; every
//!   method of a [`HipDevice`] (and every resource's `Drop`) first makes its
//!   device current (`hipSetDevice`), so any thread may call it.
//! - **Memory.** [`MemKind::Plain`](crate::device::MemKind::Plain) is
//!   `hipMalloc`; [`MemKind::Shareable`](crate::device::MemKind::Shareable)
//!   is uncached memory in dedicated 2 MiB multiples, exported as hipIpc
//!   handles (no file descriptor).
//! - **Host flags** are `hipHostMalloc(MAPPED | PORTABLE | COHERENT)` words.
//! - **Kernels** are compiled by hipRTC for the device's gfx target
//!   (`FERROCOMM_HIP_ARCH` overrides), one kernel per compile, one compile at
//!   a time (see `rtc.rs`), and cached per process and on disk.
//! - **Caller memory** (`check_memory`) is checked with ROCm 6's
//!   `hipPointerGetAttributes`; older runtimes accept it unchecked.
//!
//! Nothing here panics when libamdhip64, hipRTC or a device is missing: the
//! failure comes back as [`Error::LibraryMissing`] or [`Error::NoDevice`].

mod arch;
mod driver;
mod ipc;
mod rtc;
mod table;

use crate::backends::gpu::vendor::Driver;
use crate::backends::gpu::GpuDevice;
#[cfg(any(test, feature = "testing"))]
use crate::device::{BackendKind, ModuleSource};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;

/// Threads per block of every collective launch. The kernels are compiled with
/// `-DFC_MAX_BLOCK_THREADS` equal to this, so larger blocks are refused.
pub use crate::algo::BLOCK_THREADS;

/// The HIP vendor table (a marker: the table is its trait impls).
pub struct Hip;

impl crate::backends::gpu::vendor::sealed::Sealed for Hip {}

crate::backends::gpu::vendor_aliases!(Hip: HipDevice, HipBuffer, HipPeerBuffer, HipHostFlags, HipStream, HipEvent, HipGraph, HipModule);

/// Number of HIP devices. `Ok(0)` when the runtime loads but finds none;
/// [`Error::LibraryMissing`] when there is no usable libamdhip64.
pub fn device_count() -> Result<usize> {
    Hip::device_count()
}

/// The HIP runtime's version as `(major, minor, patch)` and the file it was
/// loaded from, or [`Error::LibraryMissing`].
/// Needs no device.
pub fn runtime_version() -> Result<((i32, i32, i32), String)> {
    let rt = driver::library()?;
    let v = rt.version;
    Ok(((v / 10_000_000, (v / 100_000) % 100, v % 100_000), rt.path.clone()))
}

/// hipRTC's version `(major, minor)` and the file it was loaded from, or
/// [`Error::LibraryMissing`] when it cannot be found (see
/// `FERROCOMM_HIPRTC_LIB`). Needs no device.
pub fn hiprtc_version() -> Result<((i32, i32), String)> {
    driver::rtc().map(|r| (r.version, r.path.clone()))
}

/// Compile `source` (its `hip` text, every kernel in one unit) for `arch`
/// (e.g. `gfx942`) with hipRTC and return the code object, without a device
/// and without the kernel caches: for checking a ROCm installation or a
/// toolchain. Deadlines use the CDNA wall clock (100 MHz).
///
/// Errors: [`Error::LibraryMissing`] without libamdhip64 or hipRTC,
/// [`Error::Compile`] with hipRTC's log, [`Error::Unsupported`] for a module
/// with no HIP text.
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub fn compile_module(source: &ModuleSource, arch: &str) -> Result<Vec<u8>> {
    compile_units(source, arch, None)
}

/// Like [`compile_module`], but only the entry points `kernels` (one compile
/// unit, as the lazy module loader builds them).
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub fn compile_kernels(source: &ModuleSource, arch: &str, kernels: &[&str]) -> Result<Vec<u8>> {
    compile_units(source, arch, Some(kernels))
}

#[cfg(any(test, feature = "testing"))]
fn compile_units(source: &ModuleSource, arch: &str, kernels: Option<&[&str]>) -> Result<Vec<u8>> {
    if source.hip.is_empty() {
        return Err(crate::error::Error::Unsupported(format!(
            "kernel module {} has no HIP source (ModuleSource::hip is empty)",
            source.name
        )));
    }
    let rt = driver::library()?;
    let target = rtc::target_for(arch, table::DEFAULT_WALLCLOCK_KHZ, rt.version)?;
    let text = match kernels {
        Some(k) => source.text(BackendKind::Hip, k)?,
        None => source.full_text(BackendKind::Hip),
    };
    rtc::compile(&target, source.name, &text)
}

/// Whether device `a` can read and write device `b`'s memory directly (XGMI
/// or PCIe peer-to-peer). `true` when `a == b`.
pub fn can_access_peer(a: usize, b: usize) -> Result<bool> {
    Hip::can_access_peer(a, b)
}

/// How many resource releases have failed in this process (each is logged
/// once, then counted).
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub fn drop_error_count() -> u64 {
    driver::DROP_ERRORS.count()
}

impl GpuDevice<Hip> {
    /// HIP's compute capability `(major, minor)` (the gfx major and minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.extra().cc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    /// Without ROCm (CI), opening a device is a clean error, never a panic.
    #[test]
    fn no_runtime_or_no_device_is_a_clean_error() {
        match device_count() {
            Ok(0) => assert!(matches!(HipDevice::new(0), Err(Error::NoDevice { .. }))),
            Ok(n) => assert!(matches!(HipDevice::new(n), Err(Error::NoDevice { .. }))),
            Err(e) => {
                assert!(matches!(e, Error::LibraryMissing { .. } | Error::Backend { .. }), "{e}");
                assert!(HipDevice::new(0).is_err());
            }
        }
    }
}
