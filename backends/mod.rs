//! Backends: one module per vendor, each implementing [`crate::device::Device`].
//! `host` is always built; the others are behind features and load their
//! vendor libraries at run time, so every feature builds with no toolkit.

pub mod host;

#[cfg(feature = "cuda")]
pub mod cuda;

#[cfg(feature = "rocm")]
pub mod hip;

#[cfg(any(feature = "nccl", feature = "rccl"))]
pub mod ccl;

#[cfg(any(feature = "cuda", feature = "rocm"))]
mod kernel_cache;
