//! # ferrocomm
//!
//! Fast collectives for GPUs (CUDA, ROCm) behind one vendor-neutral API, with a
//! CPU host backend that is always built, is the reference implementation, and
//! runs anywhere.
//!
//! Layers, top to bottom (each calls only the one below):
//! 1. [`comm`]: the [`Communicator`] and its [`Work`] handles;
//! 2. [`plan`]: how each call runs, decided in one place; `algo`: the
//!    host-side protocols (workspace, epochs, launches);
//! 3. [`device`]: the device trait; [`heap`]: the symmetric heap and the
//!    device API's context;
//! 4. [`backends`]: host, cuda, hip (and `ccl`, the NCCL/RCCL table);
//! 5. `kernels-cuda/`, `kernels-hip/`: device code, compiled at run time.
//!
//! ```no_run
//! use ferrocomm::{backends::host::HostDevice, bootstrap::rendezvous_from_env};
//! use ferrocomm::{Call, CommOptions, Communicator, DType, ReduceOp, Tensor};
//! # fn main() -> ferrocomm::Result<()> {
//! let rdv = rendezvous_from_env()?; // torchrun, or MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE
//! let device = HostDevice::new(rdv.local_rank)?;
//! let comm = Communicator::new(device, rdv.store.clone(), rdv.rank, rdv.world, CommOptions::from_env()?)?;
//! let buf = comm.alloc(1024 * 4)?;
//! let t = Tensor::of(&buf, DType::F32);
//! comm.all_reduce(t, ReduceOp::Sum, &Call::new())?.wait(None)?;
//! comm.finalize()?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

/// Declares a module, an item or a re-export `pub` with the `testing` feature
/// (hidden from the docs: for this repository's tests, bench and worker, not
/// an API) and `pub(crate)` without it: the crate's internals that those
/// reach into, at the paths they use. (Items only they use are
/// `#[cfg(any(test, feature = "testing"))]` instead.)
macro_rules! testing_pub {
    ($(#[$meta:meta])* mod $name:ident;) => {
        #[cfg(feature = "testing")]
        #[doc(hidden)]
        $(#[$meta])*
        pub mod $name;
        #[cfg(not(feature = "testing"))]
        $(#[$meta])*
        pub(crate) mod $name;
    };
    ($(#[$meta:meta])* use $($tree:tt)*) => {
        #[cfg(feature = "testing")]
        #[doc(hidden)]
        $(#[$meta])*
        pub use $($tree)*
        #[cfg(not(feature = "testing"))]
        #[allow(unused_imports)]
        $(#[$meta])*
        pub(crate) use $($tree)*
    };
    ($(#[$meta:meta])* pub $($item:tt)*) => {
        #[cfg(feature = "testing")]
        #[doc(hidden)]
        $(#[$meta])*
        pub $($item)*
        #[cfg(not(feature = "testing"))]
        $(#[$meta])*
        pub(crate) $($item)*
    };
}

testing_pub! { mod algo; }
#[path = "../backends/mod.rs"]
pub mod backends;
pub mod bootstrap;
pub(crate) mod cache;
pub mod codec;
pub mod comm;
pub mod device;
pub mod dtype;
pub mod ep;
pub mod error;
pub mod heap;
pub(crate) mod log;
pub mod plan;
/// The conformance harness: the suites, references and process launchers
/// that the tests, the bench and the worker run.
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;

pub use comm::{
    Algorithm, Axis, Broadcaster, BroadcasterOptions, Call, ChunkedAllGather, ChunkedReduceScatter, Collective,
    CommOptions, Communicator, DtypeClass, FusedForm, Fusion, FusionPattern, Ladders, Mapping, MixedComm, MixedMode,
    MixedOp, MoeFinalize, P2p, Reduction, Registration, SfLayout, SpOutput, Tensor, Timing, Topology, TuneReport,
    TuneSource, UserModule, Window, Work, FUSED_MAX_HIDDEN, MOE_MAX_TOPK,
};
pub use dtype::{DType, ReduceOp};
pub use error::{Error, Result};
pub(crate) use log::fc_log;

/// Stop the process's background kernel compiles and wait (at most 20 s)
/// for the ones running; returns how many still run.
///
/// Call it before `std::process::exit`, or before `main` returns while a
/// GPU device or a communicator on one is still alive (kept in a static,
/// or leaked): a compile still inside NVRTC or hipRTC while the vendor
/// libraries' exit handlers run can crash the process, and those handlers
/// run before any hook ferrocomm can register. Dropping the process's last
/// GPU device does the same by itself, and the Python package calls it at
/// interpreter exit. Queued compiles wait; a kernel that a later call needs
/// resumes them.
///
/// Without a GPU backend built there are no compiles: 0.
pub fn pause_compiles_for_exit() -> usize {
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    return backends::gpu::compile::pool::pause_for_exit();
    #[cfg(not(any(feature = "cuda", feature = "rocm")))]
    0
}
