//! The public API: one [`Communicator`] per group of ranks; every collective
//! takes [`Tensor`]s (the caller's memory), a [`Call`] (stream, timeout,
//! hints) and returns a [`Work`] to wait on or poll.

mod call;
mod collectives;
mod communicator;
mod fused;
mod mapping;
mod options;
mod registry;
mod tensor;
mod topology;
mod vendor;
mod work;

pub use crate::algo::fused::FusionPattern;
pub use call::{Call, Factor, Reduction};
pub use collectives::P2p;
pub use communicator::Communicator;
pub use fused::Fusion;
pub use mapping::{Axis, Coords, Mapping};
pub use options::CommOptions;
pub use registry::Registration;
pub use tensor::Tensor;
pub use topology::Topology;
pub use work::Work;
