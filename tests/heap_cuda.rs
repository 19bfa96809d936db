//! The symmetric heap and windows on CUDA devices: the suite every backend
//! runs (`ferrocomm::testing::heap`), ranks as threads, one GPU each.
//! Ignored by default; `ci/gpu-cuda.sh` runs it with `--include-ignored`,
//! and it prints why it skips (fewer GPUs than ranks, no driver) unless
//! `FERROCOMM_REQUIRE_GPU=1`. With `FERROCOMM_TEST_SHARE_GPU=1` every rank
//! opens GPU `rank % count`, so a one-GPU machine runs the protocol (two
//! contexts' worth of streams on one device; no performance meaning).
//! Shared ranks need `FERROCOMM_CCL=0`: NCCL refuses two ranks on one GPU.

#![cfg(feature = "cuda")]

use std::time::Duration;

use ferrocomm::backends::cuda::{self, CudaDevice};
use ferrocomm::testing::conformance::{run_thread_suite, SuiteConfig};
use ferrocomm::testing::heap::{run_heap_suite, run_heap_timeout, run_user_allgather};

fn shared() -> bool {
    std::env::var("FERROCOMM_TEST_SHARE_GPU").as_deref() == Ok("1")
}

fn open(rank: usize) -> ferrocomm::Result<CudaDevice> {
    let n = cuda::device_count()?.max(1);
    CudaDevice::new(if shared() { rank % n } else { rank })
}

fn skip(world: usize) -> Option<String> {
    match cuda::device_count() {
        Ok(n) if n >= 1 && shared() => None,
        Ok(n) if n >= world => None,
        Ok(n) => Some(format!("{n} CUDA devices, world {world} needs {world}")),
        Err(e) => Some(format!("no CUDA: {e}")),
    }
}

fn cfg() -> SuiteConfig {
    SuiteConfig {
        timeout: Duration::from_secs(60),
        graph_replays: 5,
        ..SuiteConfig::default()
    }
}

fn run(world: usize) {
    run_thread_suite(
        "cuda",
        world,
        skip(world),
        &open,
        // Two heap buffers of `world` blocks just above the direct
        // reduce-to threshold (8 MiB), with room for the rest. Autotune off:
        // the suite checks the kinds the library picks (by the epochs they
        // take), which a table cached by an earlier bench on the machine
        // would override (such a table can route a large all-to-all to NCCL).
        |o| {
            o.with_heap_bytes(((world * 24) << 20).max(64 << 20))
                .with_autotune(false)
        },
        |comm, store, cfg| run_heap_suite(comm, store, cfg),
        &cfg(),
        20,
    );
}

#[test]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn heap_and_windows_world_2() {
    run(2)
}

#[test]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn heap_and_windows_world_4() {
    run(4)
}

#[test]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn a_peer_that_never_signals_is_named() {
    run_thread_suite(
        "cuda",
        2,
        skip(2),
        &open,
        |o| o.with_heap_bytes(16 << 20),
        |comm, store, cfg| run_heap_timeout(comm, store, cfg),
        &cfg(),
        1,
    );
}

/// The user-style all-gather on the device API, compiled at run time.
#[test]
#[ignore = "needs CUDA GPUs: ci/gpu-cuda.sh runs it with --include-ignored"]
fn user_allgather_on_the_device_api_world_2() {
    run_thread_suite(
        "cuda",
        2,
        skip(2),
        &open,
        |o| o.with_heap_bytes(64 << 20),
        |comm, store, cfg| run_user_allgather(comm, store, cfg),
        &cfg(),
        6,
    );
}
