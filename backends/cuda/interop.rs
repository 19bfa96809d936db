//! A bridge from cudarc's safe types, for engines that hold their tensors
//! as cudarc slices: the raw device address to pass to ferrocomm's
//! caller-memory paths (`Device::check_memory`, `Device::export_range`, the
//! communicator's raw-pointer collectives), and the raw stream to pass to
//! `Device::borrow_stream`.
//!
//! ```no_run
//! # fn demo() -> ferrocomm::Result<()> {
//! use ferrocomm::backends::cuda::{cudarc_device_ptr, cudarc_stream, CudaDevice};
//! use ferrocomm::device::Device;
//! let ctx = cudarc::driver::CudaContext::new(0).unwrap();
//! let stream = ctx.default_stream();
//! let x = stream.alloc_zeros::<f32>(1024).unwrap();
//! let dev = CudaDevice::new(0)?;
//! // SAFETY: cudarc's stream outlives the wrapper and the work queued on it.
//! let s = unsafe { dev.borrow_stream(cudarc_stream(&stream)) }?;
//! let (ptr, count, guard) = cudarc_device_ptr(&x, &stream);
//! dev.check_memory(ptr, count * 4)?;
//! // ... queue the collective on `s` with `ptr` here ...
//! drop(guard); // only now: cudarc then orders its later writes after the collective
//! # drop(s); Ok(()) }
//! ```

use cudarc::driver::{CudaStream as CudarcStream, DevicePtr as CudarcDevicePtr, SyncOnDrop};

use crate::device::DevicePtr;

/// The device address and element count of a cudarc `CudaSlice<T>` or
/// `CudaView<T>`, and cudarc's guard for reading it on `stream`.
///
/// The guard must live until the collective that reads the memory is
/// queued on `stream`: when it drops, cudarc records the read on `stream`
/// (where cudarc manages synchronisation), so its later writes wait for the
/// collective. `stream` is the stream the collective runs on (cudarc first
/// makes it wait for earlier writes to the slice).
pub fn cudarc_device_ptr<'a, T, S>(slice: &'a S, stream: &'a CudarcStream) -> (DevicePtr, usize, SyncOnDrop<'a>)
where
    S: CudarcDevicePtr<T>,
{
    let (ptr, guard) = slice.device_ptr(stream);
    (DevicePtr(ptr), slice.len(), guard)
}

/// cudarc's stream as a raw `CUstream`, for `Device::borrow_stream`.
pub fn cudarc_stream(stream: &CudarcStream) -> u64 {
    stream.cu_stream() as usize as u64
}
