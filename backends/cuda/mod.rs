//! The CUDA backend: [`GpuDevice`] over the CUDA driver API, called through
//! cudarc's raw `sys` layer (loaded at run time), and NVRTC for kernels.
//!
//! This folder holds only what is CUDA's own: the function table and its
//! loading checks (`driver.rs`, `table.rs`), the IPC flavour (`ipc.rs`: cuMem
//! VMM allocations exported as POSIX fds, legacy cuIpc handles for caller
//! memory), NVRTC and its target choice (`rtc.rs`), and a bridge from
//! cudarc's safe types (`interop.rs`). Everything else (the device trait,
//! buffers, streams, events, graphs, lazy per-kernel modules) is
//! `backends::gpu`, shared with HIP.
//!
//! - **Context.** Each [`CudaDevice`] retains its device's primary context
//!   and makes it current (`cuCtxSetCurrent`) at the start of every method,
//!   so any thread may call it. Every resource holds the context alive.
//! - **Memory.** [`MemKind::Plain`](crate::device::MemKind::Plain) is
//!   `cuMemAlloc`; [`MemKind::Shareable`](crate::device::MemKind::Shareable)
//!   is a cuMem VMM allocation that peers map with access for their device.
//! - **Kernels** are compiled by NVRTC to a CUBIN for the exact arch, one
//!   kernel per compile, on a worker pool, and cached per process and on disk.
//!
//! Nothing here panics when libcuda, libnvrtc or a device is missing: the
//! libraries are probed before cudarc is called (cudarc panics on a missing
//! library or symbol), and the failure comes back as
//! [`Error::LibraryMissing`](crate::Error::LibraryMissing) or
//! [`Error::NoDevice`](crate::Error::NoDevice).
//!
//! Never uses NVLink multicast (no `cuMulticast*`).

mod driver;
mod interop;
mod ipc;
mod rtc;
mod table;

pub use interop::{cudarc_device_ptr, cudarc_stream};

#[cfg(any(test, feature = "testing"))]
use crate::backends::gpu::compile::images::Precompiled;
use crate::backends::gpu::vendor::Driver;
use crate::backends::gpu::GpuDevice;
#[cfg(any(test, feature = "testing"))]
use crate::device::ModuleSource;
use crate::error::Result;

/// Threads per block of every collective launch. The kernels are compiled with
/// `-DFC_MAX_BLOCK_THREADS` equal to this, so larger blocks are refused.
pub use crate::algo::BLOCK_THREADS;

/// The CUDA vendor table (a marker: the table is its trait impls).
pub struct Cuda;

impl crate::backends::gpu::vendor::sealed::Sealed for Cuda {}

crate::backends::gpu::vendor_aliases!(Cuda: CudaDevice, CudaBuffer, CudaPeerBuffer, CudaHostFlags, CudaStream, CudaEvent, CudaGraph, CudaModule);

/// Number of CUDA devices. `Ok(0)` when the driver loads but finds none;
/// [`Error::LibraryMissing`](crate::Error::LibraryMissing) when there is no usable libcuda.
pub fn device_count() -> Result<usize> {
    Cuda::device_count()
}

/// NVRTC's version `(major, minor)`, or [`Error::LibraryMissing`](crate::Error::LibraryMissing) when
/// `libnvrtc.so.13` cannot be found (see `FERROCOMM_NVRTC_LIB`).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    driver::nvrtc()
}

/// Whether device `a` can read and write device `b`'s memory directly
/// (NVLink or PCIe peer-to-peer). `true` when `a == b`.
pub fn can_access_peer(a: usize, b: usize) -> Result<bool> {
    Cuda::can_access_peer(a, b)
}

/// How many resource releases have failed in this process (each is logged
/// once, then counted).
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub fn drop_error_count() -> u64 {
    driver::DROP_ERRORS.count()
}

/// Compile every kernel of `source` for compute capability `cc` into the
/// disk cache (`FERROCOMM_CACHE_DIR`) without a device, one kernel per
/// compile on parallel threads, so a GPU machine skips NVRTC. Needs only
/// libnvrtc (see `FERROCOMM_NVRTC_LIB`).
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub fn precompile(source: &ModuleSource, cc: (i32, i32)) -> Result<()> {
    precompile_report(source, cc, std::thread::available_parallelism().map_or(1, |n| n.get())).map(|_| ())
}

/// [`precompile`] on `threads` threads, saying how many kernels were
/// already on disk and how many were compiled.
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub fn precompile_report(source: &ModuleSource, cc: (i32, i32), threads: usize) -> Result<Precompiled> {
    crate::backends::gpu::precompile::<Cuda>(source, rtc::target_for(cc)?, threads)
}

/// The stream's `CUstream` as an integer, for the NCCL layer's tests.
#[cfg(test)]
pub(crate) fn raw_stream(stream: &CudaStream) -> u64 {
    stream.raw_handle()
}

impl GpuDevice<Cuda> {
    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.extra().cc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    /// Without a driver (CI), opening a device is a clean error, never a panic.
    #[test]
    fn no_driver_or_no_device_is_a_clean_error() {
        match device_count() {
            Ok(n) => assert!(matches!(CudaDevice::new(n), Err(Error::NoDevice { .. }))),
            Err(e) => {
                assert!(matches!(e, Error::LibraryMissing { .. } | Error::Backend { .. }), "{e}");
                assert!(CudaDevice::new(0).is_err());
            }
        }
    }
}
