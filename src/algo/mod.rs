//! Algorithms: the host-side halves of the protocols in `docs/protocol.md`
//! (workspace, epochs, chunking, which kernel to launch) and the dispatch
//! table that picks one per call.

mod dispatch;
pub mod fused;
mod grid;
pub mod kernels;
mod launch;
pub mod layout;
mod workspace;

pub use dispatch::{AlgoChoice, Algorithm, DispatchTable, Step};
pub use grid::{GridTable, BLOCK_THREADS};
pub use launch::{chunk_elems, fingerprint, whole_call, CollectiveCall, KernelNames};
pub(crate) use workspace::PeerMaps;
pub use workspace::Workspace;
