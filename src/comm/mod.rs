//! The public API: one [`Communicator`] per group of ranks; every collective
//! returns a [`Work`] to wait on or poll.

mod communicator;
mod options;
mod vendor;
mod work;

pub use communicator::Communicator;
pub use options::CommOptions;
pub use work::Work;
