//! Test support shared by the test suites, the worker binary and the bench:
//! deterministic inputs, the exact reference, rank harnesses, and the
//! conformance suite that every backend instantiates.

pub mod broadcaster;
mod check;
mod collectives;
pub mod conformance;
pub mod copy_route;
pub mod data;
pub mod ep;
pub mod fused;
pub mod fused_nvfp4;
pub mod fused_sp;
pub mod fuzz;
pub mod harness;
pub mod heap;
pub mod launch;
pub mod overlap;
pub mod quick_reduce;
