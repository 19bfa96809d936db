//! The CUDA backend: the conformance suite (ranks as threads, one device
//! each), the GPU device tests shared with HIP (`common/gpu_device.rs`), and
//! what only CUDA has (cudarc interop, stream-ordered pool memory). Tests
//! that need a GPU are ignored by default; with `--include-ignored` they
//! print why they skip and pass, unless `FERROCOMM_REQUIRE_GPU=1`.
//!
//! On a GPU machine run them one at a time, so that worlds do not share
//! devices: `cargo test --features cuda --test conformance_cuda -- --include-ignored --test-threads=1`.

#![cfg(feature = "cuda")]

#[path = "common/gpu_device.rs"]
mod gpu_device;

use ferrocomm::backends::cuda::{self, CudaDevice};
use ferrocomm::device::{BackendKind, Device, ModuleSource};
use ferrocomm::testing::conformance::SuiteConfig;
use ferrocomm::Error;
use gpu_device::Gpu;

const GPU: Gpu<CudaDevice> = Gpu {
    label: "CUDA",
    backend: BackendKind::Cuda,
    device_count: cuda::device_count,
    compiler_missing: || {
        cuda::nvrtc_version()
            .err()
            .map(|e| format!("no NVRTC to compile kernels: {e}"))
    },
    open: CudaDevice::new,
    can_access_peer: cuda::can_access_peer,
    drop_errors: cuda::drop_error_count,
    strict: || true,
    arch_prefixes: &["sm_", "compute_"],
    warp_sizes: &[32],
    exports_fd: true,
    block_threads: cuda::BLOCK_THREADS,
    tiny: ModuleSource::raw(
        "ferrocomm_tiny_test",
        "struct P { unsigned long long w[24]; };\n\
         extern \"C\" __global__ void fill(const P p) {\n\
           unsigned int* out = (unsigned int*)p.w[9];\n\
           unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n\
           if (i < p.w[11]) out[i] = 0xC0FFEEu + i;\n\
         }\n",
        "",
    ),
    broken: ModuleSource::raw(
        "ferrocomm_broken_test",
        "extern \"C\" __global__ void k() { this_is_not_defined(); }\n",
        "",
    ),
    lazy_body: "struct P { unsigned long long w[24]; };\n\
                #define TK(n) extern \"C\" __global__ void n(const P p)\n\
                #define FILL(v) { unsigned int* out = (unsigned int*)p.w[9]; \\\n\
                  unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; \\\n\
                  if (i < p.w[11]) out[i] = (v) + i; }\n",
};

fn skip_reason(world: usize) -> Option<String> {
    gpu_device::skip_reason(&GPU, world)
}

ferrocomm::conformance_tests!(
    cuda_threads,
    CudaDevice::new,
    skip_reason,
    SuiteConfig::default(),
    ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"
);

gpu_device_tests!(GPU, "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored");

/// cudarc's slices and streams go through the caller-memory paths; its
/// stream-ordered pool memory cannot be exported, and says why.
#[test]
#[serial_test::serial]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn cudarc_memory_and_streams() {
    if !gpu_device::need(&GPU, 1) {
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let x = stream.alloc_zeros::<f32>(4096).unwrap();
    // SAFETY: cudarc's stream outlives the wrapper and its work.
    let s = unsafe { dev.borrow_stream(cuda::cudarc_stream(&stream)) }.unwrap();
    let (ptr, count, guard) = cuda::cudarc_device_ptr(&x, &stream);
    assert_eq!(count, 4096);
    dev.check_memory(ptr, count * 4).unwrap();
    assert!(dev.check_memory(ptr, count * 4 + (64 << 20)).is_err());
    match dev.export_range(ptr, count * 4) {
        Err(Error::Unsupported(m)) => {
            assert!(m.contains("pool"), "{m}");
            println!("cudarc's memory is stream-ordered pool memory: {m}");
        }
        Ok((h, offset)) => println!(
            "cudarc allocated with cuMemAlloc here: exported, offset {offset}, {} handle bytes",
            h.bytes.len()
        ),
        Err(e) => panic!("unexpected export error: {e}"),
    }
    drop(guard);
    dev.synchronize(&s).unwrap();
}
