//! The HIP backend with one process per GPU (see `common/gpu_process.rs`).
#![cfg(feature = "rocm")]

#[path = "common/gpu_process.rs"]
mod gpu_process;

const GPU: gpu_process::Gpu = gpu_process::Gpu {
    backend: "hip",
    device_count: ferrocomm::backends::hip::device_count,
};

gpu_process_tests!(GPU);
