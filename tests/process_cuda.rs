//! The CUDA backend with one process per GPU (see `common/gpu_process.rs`).
#![cfg(feature = "cuda")]

#[path = "common/gpu_process.rs"]
mod gpu_process;

const GPU: gpu_process::Gpu = gpu_process::Gpu {
    backend: "cuda",
    device_count: ferrocomm::backends::cuda::device_count,
};

gpu_process_tests!(GPU);
