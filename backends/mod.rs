//! Backends, each implementing [`crate::device::Device`]. `host` is always
//! built. The GPU vendors share one implementation, `gpu::GpuDevice`, over
//! a table each vendor folder provides (`cuda`, `hip`); they are behind
//! features and load their vendor libraries at run time, so every feature
//! builds with no toolkit.

pub mod host;

#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod gpu;

#[cfg(feature = "cuda")]
pub mod cuda;

#[cfg(feature = "rocm")]
pub mod hip;

testing_pub! {
    #[cfg(any(feature = "nccl", feature = "rccl"))]
    mod ccl;
}
