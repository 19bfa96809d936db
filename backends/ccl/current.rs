//! The calling thread's current device, carried to another thread.
//!
//! NCCL/RCCL bind a communicator to the device current on the thread that
//! creates it. Blocking init runs on a thread of its own (so a peer that
//! never arrives cannot hold the caller past its timeout), and that thread
//! must make the caller's device current first. The vendor runtime is
//! already loaded by then (the backend uses it), so this only looks up two
//! entry points of it.

use std::ffi::{c_int, c_void};

use super::library::CclFlavor;

/// What the creating thread had current.
#[derive(Clone, Copy, Debug)]
pub(super) enum Current {
    /// A `CUcontext`, as an integer.
    Cuda(usize),
    /// A HIP device ordinal.
    Hip(c_int),
    /// Nothing could be read: the new thread keeps its default device.
    Unknown,
}

type CuCtxGet = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type CuCtxSet = unsafe extern "C" fn(*mut c_void) -> c_int;
type HipGet = unsafe extern "C" fn(*mut c_int) -> c_int;
type HipSet = unsafe extern "C" fn(c_int) -> c_int;

fn runtime(flavor: CclFlavor) -> Option<libloading::Library> {
    let names: &[&str] = match flavor {
        CclFlavor::Nccl => &["libcuda.so.1", "libcuda.so"],
        CclFlavor::Rccl => &["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so"],
    };
    // SAFETY: the vendor runtime is already loaded by the backend; this takes
    // another handle to it (its initialisers have run).
    names.iter().find_map(|n| unsafe { libloading::Library::new(n) }.ok())
}

impl Current {
    /// The calling thread's current device.
    pub(super) fn capture(flavor: CclFlavor) -> Current {
        let Some(lib) = runtime(flavor) else {
            return Current::Unknown;
        };
        match flavor {
            CclFlavor::Nccl => {
                // SAFETY: the driver's documented prototype; the symbol is copied out.
                let Ok(get) = (unsafe { lib.get::<CuCtxGet>(b"cuCtxGetCurrent") }) else {
                    return Current::Unknown;
                };
                let mut ctx: *mut c_void = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                match unsafe { get(&mut ctx) } {
                    0 if !ctx.is_null() => Current::Cuda(ctx as usize),
                    _ => Current::Unknown,
                }
            }
            CclFlavor::Rccl => {
                // SAFETY: the runtime's documented prototype.
                let Ok(get) = (unsafe { lib.get::<HipGet>(b"hipGetDevice") }) else {
                    return Current::Unknown;
                };
                let mut dev: c_int = 0;
                // SAFETY: valid out-pointer.
                match unsafe { get(&mut dev) } {
                    0 => Current::Hip(dev),
                    _ => Current::Unknown,
                }
            }
        }
    }

    /// Make it current on the calling thread (best effort: NCCL reports a
    /// wrong device itself).
    pub(super) fn restore(self, flavor: CclFlavor) {
        let Some(lib) = runtime(flavor) else {
            return;
        };
        match self {
            Current::Cuda(ctx) => {
                // SAFETY: the driver's documented prototype.
                if let Ok(set) = unsafe { lib.get::<CuCtxSet>(b"cuCtxSetCurrent") } {
                    // SAFETY: a context the creating thread had current; the
                    // device backend keeps it retained for the communicator's life.
                    let _ = unsafe { set(ctx as *mut c_void) };
                }
            }
            Current::Hip(dev) => {
                // SAFETY: the runtime's documented prototype.
                if let Ok(set) = unsafe { lib.get::<HipSet>(b"hipSetDevice") } {
                    // SAFETY: plain integer argument.
                    let _ = unsafe { set(dev) };
                }
            }
            Current::Unknown => {}
        }
    }
}
