//! Algorithms: the host-side halves of the protocols in `docs/protocol.md`
//! (workspace, epochs, chunking, the kernel launches). Which one a call
//! runs is the planner's (`crate::plan`).

pub mod fused;
mod grid;
pub mod kernels;
mod launch;
pub mod layout;
mod workspace;

pub use grid::{GridTable, BLOCK_THREADS};
pub use launch::{chunk_elems, fingerprint, whole_call, CollectiveCall, KernelNames};
pub(crate) use workspace::PeerMaps;
pub use workspace::Workspace;
