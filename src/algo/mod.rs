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

pub(crate) use dispatch::{ll_max_block_bytes, CUSTOM_MIN_BLOCK_BYTES};
pub use dispatch::{
    step_for, well_formed, AlgoChoice, Algorithm, CollAlgo, Collective, DispatchTable, DtypeClass, Ladders, Step,
};
pub use grid::{GridTable, BLOCK_THREADS};
pub use launch::{chunk_elems, fingerprint, whole_call, CollectiveCall, KernelNames};
pub(crate) use workspace::PeerMaps;
pub use workspace::Workspace;
