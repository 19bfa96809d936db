//! The HIP backend with one process per GPU, at worlds 2 and 4: the
//! conformance suite, 10,000 graph replays with changing input, and a killed
//! rank. Without enough GPUs each test says so and passes only when
//! `FERROCOMM_REQUIRE_GPU` is not `1`. `FERROCOMM_WORKER_EXE` points at a
//! prebuilt worker when the tests run on another machine than the build.
#![cfg(feature = "rocm")]

use std::path::PathBuf;
use std::time::Duration;

use ferrocomm::testing::launch::{assert_all_ok, assert_victim_killed, run_process_ranks, RankOutput};

fn worker() -> PathBuf {
    std::env::var_os("FERROCOMM_WORKER_EXE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ferrocomm-worker")))
}

/// Some(reason) when this machine cannot run `world` HIP ranks.
fn skip(world: usize) -> Option<String> {
    let reason = match ferrocomm::backends::hip::device_count() {
        Ok(n) if n >= world => return None,
        Ok(n) => format!("{n} HIP devices, need {world}"),
        Err(e) => e.to_string(),
    };
    if std::env::var("FERROCOMM_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("FERROCOMM_REQUIRE_GPU=1 but the HIP test cannot run: {reason}");
    }
    eprintln!("SKIPPED (world {world}): {reason}");
    Some(reason)
}

fn run(args: &[&str], world: usize, timeout_secs: u64) -> Vec<RankOutput> {
    run_process_ranks(&worker(), args, world, &[], Duration::from_secs(timeout_secs)).expect("launching ranks")
}

fn scenario(args: &[&str], world: usize) {
    if skip(world).is_none() {
        assert_all_ok(&run(args, world, 900));
    }
}

#[test]
fn conformance_world_2() {
    scenario(&["conformance", "--backend", "hip", "--timeout-secs", "60"], 2);
}

#[test]
fn conformance_world_4() {
    scenario(&["conformance", "--backend", "hip", "--timeout-secs", "60"], 4);
}

#[test]
fn graph_replays_world_2() {
    scenario(
        &[
            "replay",
            "--backend",
            "hip",
            "--replays",
            "10000",
            "--timeout-secs",
            "60",
        ],
        2,
    );
}

#[test]
fn graph_replays_world_4() {
    scenario(
        &[
            "replay",
            "--backend",
            "hip",
            "--replays",
            "10000",
            "--timeout-secs",
            "60",
        ],
        4,
    );
}

/// One small launch of every kernel; `ci/gpu-cuda.sh` runs it under compute-sanitizer (the ROCm twin runs it plainly).
#[test]
fn smoke_world_2() {
    scenario(&["smoke", "--backend", "hip", "--timeout-secs", "120"], 2);
}

#[test]
fn killed_rank_becomes_an_error_world_4() {
    if skip(4).is_some() {
        return;
    }
    let outs = run(
        &["kill", "--backend", "hip", "--victim", "2", "--timeout-secs", "5"],
        4,
        120,
    );
    assert_victim_killed(&outs, 2);
}
