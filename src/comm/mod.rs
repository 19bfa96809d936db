//! The public API: one [`Communicator`] per group of ranks; every collective
//! takes [`Tensor`]s (the caller's memory), a [`Call`] (stream, timeout,
//! hints) and returns a [`Work`] to wait on or poll.

mod autotune;
mod broadcaster;
mod call;
mod collectives;
mod communicator;
mod create;
mod events;
mod fused;
mod heap;
mod layered;
mod mapping;
mod mixed;
mod options;
mod overlap;
mod register;
mod registry;
mod submit;
mod tensor;
mod topology;
mod tuned;
mod user;
mod vendor;
mod window;
mod work;

pub use crate::algo::fused::{FusedForm, FusionPattern, SpOutput, FUSED_MAX_HIDDEN, MOE_MAX_TOPK};
pub use crate::algo::nvfp4::SfLayout;
pub use crate::plan::{Algorithm, Collective, DtypeClass, Ladders, Step};
pub use broadcaster::{Broadcaster, BroadcasterOptions, Interrupt};
pub use call::{Call, Factor, Reduction};
pub use collectives::P2p;
pub use communicator::Communicator;
pub use fused::{Fusion, MoeFinalize};
pub(crate) use heap::heap_module;
pub use mapping::{Axis, Coords, Mapping};
pub use mixed::{MixedComm, MixedMode, MixedOp};
pub use options::CommOptions;
pub use overlap::{ChunkedAllGather, ChunkedReduceScatter};
pub use registry::Registration;
pub use tensor::Tensor;
pub use topology::Topology;
pub use tuned::{Timing, TuneReport, TuneSource};
pub use user::UserModule;
pub use window::Window;
pub(crate) use window::{window_twins, WINDOWS_MODULE_NAME};
pub use work::Work;
