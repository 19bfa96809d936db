//! Algorithms: the host-side halves of the protocols in `docs/protocol.md`
//! (workspace, epochs, chunking, the kernel launches). Which one a call
//! runs is the planner's (`crate::plan`).

mod copy;
pub mod fused;
mod grid;
pub mod kernels;
mod launch;
pub mod layout;
pub mod nvfp4;
mod workspace;

pub use grid::{GridTable, BLOCK_THREADS};
#[cfg(any(test, feature = "testing"))]
pub(crate) use launch::chunk_elems;
pub(crate) use launch::{CollectiveCall, KernelNames};
pub(crate) use workspace::{PeerMaps, Workspace};
