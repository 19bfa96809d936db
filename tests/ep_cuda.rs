//! EP dispatch and combine on CUDA devices: the suite every backend runs
//! (`ferrocomm::testing::ep`), ranks as threads, one GPU each. Ignored by
//! default; `ci/gpu-cuda.sh` runs it with `--include-ignored`, and it prints
//! why it skips (fewer GPUs than ranks, no driver) unless
//! `FERROCOMM_REQUIRE_GPU=1`. With `FERROCOMM_TEST_SHARE_GPU=1` every rank
//! opens GPU `rank % count`, so one GPU runs the protocol (no performance
//! meaning). Ranks that share a GPU share its context, where loading code
//! may wait for running kernels (another rank's, waiting for this one): the
//! suite prepares every module first, and `EpBuffer::new` looks up every EP
//! function (which loads it under CUDA's lazy loading) before its barrier.
//! Autotune is off: EP does not use the dispatch table it measures.
//! Shared ranks need `FERROCOMM_CCL=0`: NCCL refuses two ranks on one GPU.

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

/// Most ranks that one GPU hosts in the sharing mode. Every rank's streams
/// then share the context's hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`,
/// 8 by default), so one rank's kernel can sit queued behind another rank's
/// kernel that spins waiting for it: 8 ranks on one H100 deadlocked until
/// the deadline, 2, 3 and 4 passed. Ranks on their own GPUs never share
/// a queue.
const MAX_SHARED_RANKS: usize = 4;

fn run(world: usize) {
    if shared() && cuda::device_count().is_ok_and(|n| n >= 1 && world.div_ceil(n) > MAX_SHARED_RANKS) {
        // Not a missing GPU (FERROCOMM_REQUIRE_GPU does not apply): the
        // sharing mode cannot host this many ranks a GPU.
        eprintln!("NOT RUN cuda world {world}: more than {MAX_SHARED_RANKS} ranks would share one GPU");
        return;
    }
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
