//! NCCL and RCCL underneath: one table of NCCL-API entry points, loaded with
//! libloading at run time from `libnccl.so.2` or `librccl.so.1` (RCCL exports
//! NCCL's C API), or from `$FERROCOMM_NCCL_PATH`.
//!
//! # Not hanging, and not paying for it per call
//! [`CclComm::init`] bounds every wait by its `timeout`: the unique id comes
//! through the store with that timeout. By default the communicator is
//! *blocking* (every call returns once queued, with no polling, as
//! PyTorch's ProcessGroupNCCL uses it), and its init runs on a thread of its
//! own that the caller waits for up to the timeout: a peer that never
//! arrives gives the caller [`Error::Timeout`](crate::Error::Timeout)
//! while that thread stays behind in NCCL. With `FERROCOMM_NCCL_NONBLOCKING=1` (and NCCL >= 2.14)
//! the communicator is *non-blocking* instead: init and every call are
//! polled with `ncclCommGetAsyncError` until they settle (bounded by the
//! same timeout), which costs tens of microseconds per eager call.
//!
//! Deadlines of running collectives are the communicator's: a wait that
//! times out aborts this communicator (`ncclCommAbort`), which ends NCCL's
//! kernels that wait on a dead peer, as ProcessGroupNCCL's watchdog does.
//! Dropping a communicator finalizes it (non-blocking: bounded) and
//! destroys it, or aborts it when an error is pending.
//!
//! # Devices and threads
//! NCCL binds a communicator to the *current* device of the thread that
//! creates it: make the right device current first (for CUDA,
//! `CudaDevice::make_current`). Calls on one communicator are serialised by an
//! internal lock; a group (`group_start` .. `group_end`) must be issued from one
//! thread, as NCCL's group state is per thread.
//!
//! # Where things are
//! `library` loads the table; `codes` maps dtypes and ops to NCCL's values;
//! `init` creates a [`CclComm`] and `comm` holds it (calls, groups, abort,
//! drop); `collectives` is its data calls, and `premul` premul_sum's
//! per-call op. `ffi` is the C API itself, `current` the device handed to
//! the init thread.

mod codes;
mod collectives;
mod comm;
mod current;
mod ffi;
mod init;
mod library;
mod premul;

#[cfg(all(test, feature = "cuda"))]
mod gpu_tests;
#[cfg(test)]
mod tests;

pub use comm::CclComm;
pub use library::{CclFlavor, CclLibrary};
pub use premul::CclReduction;

use std::sync::{Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
