//! Host twins of the heap kernels: the kernels that take their own argument
//! struct ([`Device::launch_raw`](crate::device::Device::launch_raw)) and are
//! written against the device API (`kernels-cuda/device_api.cuh`; here its
//! Rust twin, [`DevCtx`](crate::heap::DevCtx)), by module.

use std::collections::HashMap;

/// A twin: gets the argument struct's bytes, as the GPU kernel gets the struct.
///
/// # Safety
/// The bytes are the struct the kernel expects, built by the host API from
/// live buffers that it keeps alive until the stream drains.
pub(crate) type RawKernel = unsafe fn(&[u8]);

/// The twins of module `module`, or `None` when it is not a heap module.
pub(super) fn raw_kernels(module: &str) -> Option<HashMap<&'static str, RawKernel>> {
    let list: &[(&'static str, RawKernel)] = match module {
        m if m == crate::comm::WINDOWS_MODULE_NAME => &crate::comm::window_twins::TWINS,
        m if m == crate::ep::EP_MODULE_NAME => &crate::ep::twins::TWINS,
        _ => return None,
    };
    Some(list.iter().copied().collect())
}

/// Read a `#[repr(C)]` argument struct out of its bytes.
///
/// # Safety
/// `bytes` holds a valid `T` (every heap kernel's struct is plain integers).
pub(crate) unsafe fn args_of<T: Copy>(bytes: &[u8]) -> T {
    assert!(
        bytes.len() >= std::mem::size_of::<T>(),
        "heap kernel arguments too short"
    );
    // SAFETY: long enough (checked); unaligned read of a plain-integer struct.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
}
