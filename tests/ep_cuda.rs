//! EP dispatch and combine on CUDA devices: the suite every backend runs
//! (`ferrocomm::testing::ep`), ranks as threads, one GPU each. Ignored by
//! default; `ci/gpu-cuda.sh` runs it with `--include-ignored`, and it prints
//! why it skips (fewer GPUs than ranks, no driver) unless
//! `FERROCOMM_REQUIRE_GPU=1`. With `FERROCOMM_TEST_SHARE_GPU=1` every rank
//! opens GPU `rank % count`, so one GPU runs the protocol (no performance
//! meaning). Ranks that share a GPU share its context, where loading a
//! module may wait for running kernels: the suite prepares every kernel
//! first, and such runs want `CUDA_MODULE_LOADING=EAGER` (with lazy loading
//! a function loads at its first launch, which can wait behind another
//! rank's kernel that is waiting for this one).
//! Autotune is off: EP does not use the all-reduce ladder it measures.

#![cfg(feature = "cuda")]

use std::time::Duration;

use ferrocomm::backends::cuda::{self, CudaDevice};
use ferrocomm::testing::conformance::{run_thread_suite, SuiteConfig};
use ferrocomm::testing::ep::{run_ep_suite, run_ep_timeout};

fn shared() -> bool {
    std::env::var("FERROCOMM_TEST_SHARE_GPU").as_deref() == Ok("1")
}

fn open(rank: usize) -> ferrocomm::Result<CudaDevice> {
    let n = cuda::device_count()?.max(1);
    CudaDevice::new(if shared() { rank % n } else { rank })
}

fn skip(world: usize) -> Option<String> {
    match cuda::device_count() {
        Ok(n) if n >= world => None,
        Ok(n) if n >= 1 && shared() => None,
        Ok(n) => Some(format!("{n} CUDA devices, world {world} needs {world}")),
        Err(e) => Some(format!("no CUDA: {e}")),
    }
}

fn cfg() -> SuiteConfig {
    SuiteConfig {
        timeout: Duration::from_secs(60),
        graph_replays: 4,
        ..SuiteConfig::default()
    }
}

fn run(world: usize) {
    run_thread_suite(
        "cuda",
        world,
        skip(world),
        &open,
        |o| o.with_heap_bytes(64 << 20).with_autotune(false),
        |comm, store, cfg| run_ep_suite(comm, store, cfg),
        &cfg(),
        50,
    );
}

#[test]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn ep_world_2() {
    run(2)
}

#[test]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn ep_world_3() {
    run(3)
}

#[test]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn ep_world_4() {
    run(4)
}

#[test]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn ep_world_8() {
    run(8)
}

#[test]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn a_peer_that_never_dispatches_is_named() {
    run_thread_suite(
        "cuda",
        2,
        skip(2),
        &open,
        |o| o.with_heap_bytes(16 << 20).with_autotune(false),
        |comm, store, cfg| run_ep_timeout(comm, store, cfg),
        &cfg(),
        1,
    );
}
