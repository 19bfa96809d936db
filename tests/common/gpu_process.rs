//! One process per GPU, at worlds 2 and 4, for any GPU backend: the
//! conformance suite, 10,000 graph replays with changing input, a smoke run
//! of every kernel (for sanitizers) and a killed rank. Without enough GPUs
//! each test says so and passes only when `FERROCOMM_REQUIRE_GPU` is not `1`.
//! `FERROCOMM_WORKER_EXE` points at a prebuilt worker when the tests run on
//! another machine than the build.

use std::path::PathBuf;
use std::time::Duration;

use ferrocomm::testing::launch::{assert_all_ok, assert_victim_killed, run_process_ranks, RankOutput};

/// A GPU backend as the worker names it, and how to count its devices.
pub struct Gpu {
    pub backend: &'static str,
    pub device_count: fn() -> ferrocomm::Result<usize>,
}

fn worker() -> PathBuf {
    std::env::var_os("FERROCOMM_WORKER_EXE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ferrocomm-worker")))
}

fn run(args: &[&str], world: usize, timeout_secs: u64) -> Vec<RankOutput> {
    run_process_ranks(&worker(), args, world, &[], Duration::from_secs(timeout_secs)).expect("launching ranks")
}

impl Gpu {
    /// Some(reason) when this machine cannot run `world` ranks.
    fn skip(&self, world: usize) -> Option<String> {
        // Ranks sharing one GPU (FERROCOMM_TEST_SHARE_GPU=1, as the worker
        // honours it) need only one.
        let shared = std::env::var("FERROCOMM_TEST_SHARE_GPU").as_deref() == Ok("1");
        let reason = match (self.device_count)() {
            Ok(n) if n >= world || (shared && n >= 1) => return None,
            Ok(n) => format!("{n} {} devices, need {world}", self.backend),
            Err(e) => e.to_string(),
        };
        if std::env::var("FERROCOMM_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!(
                "FERROCOMM_REQUIRE_GPU=1 but the {} test cannot run: {reason}",
                self.backend
            );
        }
        eprintln!("SKIPPED (world {world}): {reason}");
        Some(reason)
    }

    /// `ferrocomm-worker <scenario> --backend <backend> <extra...>` on `world` ranks; all must pass.
    pub fn scenario(&self, scenario: &str, extra: &[&str], world: usize) {
        if self.skip(world).is_none() {
            let mut args = vec![scenario, "--backend", self.backend];
            args.extend_from_slice(extra);
            assert_all_ok(&run(&args, world, 900));
        }
    }

    /// Rank `victim` kills itself mid-loop of `coll` on ferrocomm's kernels
    /// (`FERROCOMM_COLL_ROUTE=custom`, so small blocks do not go to NCCL);
    /// the others must report it, naming it.
    pub fn killed_rank_in(&self, world: usize, victim: usize, coll: &str) {
        self.killed(world, victim, &["--coll", coll], &[("FERROCOMM_COLL_ROUTE", "custom")]);
    }

    /// Rank `victim` kills itself mid-loop; the others must report it.
    pub fn killed_rank(&self, world: usize, victim: usize) {
        self.killed(world, victim, &[], &[]);
    }

    fn killed(&self, world: usize, victim: usize, extra: &[&str], envs: &[(&str, &str)]) {
        if self.skip(world).is_none() {
            let victim_arg = victim.to_string();
            let mut args = vec![
                "kill",
                "--backend",
                self.backend,
                "--victim",
                &victim_arg,
                "--timeout-secs",
                "5",
            ];
            args.extend_from_slice(extra);
            let outs =
                run_process_ranks(&worker(), &args, world, envs, Duration::from_secs(120)).expect("launching ranks");
            assert_victim_killed(&outs, victim);
        }
    }
}

/// The test functions, for one `Gpu`. They are ignored unless asked for
/// (`--include-ignored`), so a machine without GPUs says it did not run them.
#[macro_export]
macro_rules! gpu_process_tests {
    ($gpu:expr) => {
        #[test]
        #[ignore = "needs GPUs: ci/gpu-cuda.sh or ci/gpu-rocm.sh runs it with --include-ignored"]
        fn conformance_world_2() {
            $gpu.scenario("conformance", &["--timeout-secs", "60"], 2);
        }

        #[test]
        #[ignore = "needs GPUs: ci/gpu-cuda.sh or ci/gpu-rocm.sh runs it with --include-ignored"]
        fn conformance_world_4() {
            $gpu.scenario("conformance", &["--timeout-secs", "60"], 4);
        }

        #[test]
        #[ignore = "needs GPUs: ci/gpu-cuda.sh or ci/gpu-rocm.sh runs it with --include-ignored"]
        fn graph_replays_world_2() {
            $gpu.scenario("replay", &["--replays", "10000", "--timeout-secs", "60"], 2);
        }

        #[test]
        #[ignore = "needs GPUs: ci/gpu-cuda.sh or ci/gpu-rocm.sh runs it with --include-ignored"]
        fn graph_replays_world_4() {
            $gpu.scenario("replay", &["--replays", "10000", "--timeout-secs", "60"], 4);
        }

        /// One small launch of every kernel; the GPU scripts run it under sanitizers.
        #[test]
        #[ignore = "needs GPUs: ci/gpu-cuda.sh or ci/gpu-rocm.sh runs it with --include-ignored"]
        fn smoke_world_2() {
            $gpu.scenario("smoke", &["--timeout-secs", "120"], 2);
        }

        /// The exchange and reduce-to kernels: a dead peer is an error
        /// naming it, within the deadline, for each of them.
        #[test]
        #[ignore = "needs GPUs: ci/gpu-cuda.sh or ci/gpu-rocm.sh runs it with --include-ignored"]
        fn killed_rank_in_the_exchange_kernels_world_2() {
            for coll in ["all_gather", "reduce_scatter", "all_to_all", "reduce"] {
                $gpu.killed_rank_in(2, 1, coll);
            }
        }

        /// The copy route (copy-engine copies between one-block handshakes):
        /// a dead peer is an error naming it, within the deadline.
        #[test]
        #[ignore = "needs GPUs: ci/gpu-cuda.sh or ci/gpu-rocm.sh runs it with --include-ignored"]
        fn killed_rank_in_the_copy_route_world_2() {
            for coll in ["copy_all_gather", "copy_broadcast", "copy_all_to_all"] {
                $gpu.killed_rank_in(2, 1, coll);
            }
        }

        #[test]
        #[ignore = "needs GPUs: ci/gpu-cuda.sh or ci/gpu-rocm.sh runs it with --include-ignored"]
        fn killed_rank_becomes_an_error_world_4() {
            $gpu.killed_rank(4, 2);
        }
    };
}
