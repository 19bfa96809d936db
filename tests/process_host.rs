//! Ranks as separate processes on the host backend: the conformance suite and
//! the reliability cases (killed rank, stalled rank, mismatched counts, use
//! after finalize).
//!
//! What processes add to the thread suite (`tests/conformance_host.rs`) is
//! the same at every world: workspaces and heaps passed as fds and mapped
//! at other addresses, the TCP store. So the lean run (`cargo test`) runs
//! the whole suite as processes at world 3 and across pseudo-nodes (2 x 2),
//! with the lean suite's sizes and payloads up to 4 MiB, and at worlds 2, 4
//! and 8 the smoke run (one checked call of every kernel family); the full
//! sweep (`FERROCOMM_TEST_FULL=1`) runs the whole suite at every world,
//! with payloads up to 64 MiB.

use std::path::Path;
use std::time::Duration;

use ferrocomm::testing::conformance::full_sweep;
use ferrocomm::testing::launch::{assert_all_ok, assert_victim_killed, run_process_ranks, RankOutput};

const WORKER: &str = env!("CARGO_BIN_EXE_ferrocomm-worker");

fn run(args: &[&str], world: usize, timeout_secs: u64) -> Vec<RankOutput> {
    run_process_ranks(Path::new(WORKER), args, world, &[], Duration::from_secs(timeout_secs)).expect("launching ranks")
}

/// Worlds at which the lean run runs the whole suite as processes (see the
/// module comment); the full sweep runs it at every world.
const LEAN_SUITE_WORLDS: [usize; 1] = [3];

fn conformance(world: usize) {
    if full_sweep() || LEAN_SUITE_WORLDS.contains(&world) {
        conformance_with(world, &[]);
    } else {
        let outs = run(&["smoke", "--timeout-secs", "60"], world, 120);
        assert_all_ok(&outs);
    }
}

fn conformance_with(world: usize, envs: &[(&str, &str)]) -> Vec<RankOutput> {
    // Ranks as processes exercise what threads do not (fd passing, the TCP
    // store, separate address spaces); the large payloads are the thread
    // suite's, unless the full sweep is asked for.
    let max_bytes = if full_sweep() { "67108864" } else { "4194304" };
    let outs = run_process_ranks(
        Path::new(WORKER),
        &[
            "conformance",
            "--backend",
            "host",
            "--timeout-secs",
            "60",
            "--max-bytes",
            max_bytes,
        ],
        world,
        envs,
        Duration::from_secs(600),
    )
    .expect("launching ranks");
    assert_all_ok(&outs);
    outs
}

#[test]
fn conformance_processes_world_2() {
    conformance(2);
}
#[test]
fn conformance_processes_world_3() {
    conformance(3);
}
#[test]
fn conformance_processes_world_4() {
    conformance(4);
}
#[test]
fn conformance_processes_world_8() {
    conformance(8);
}
/// Two pseudo-nodes of two ranks (`FERROCOMM_LOCAL_SIZE=2`): two levels,
/// the host protocols between the nodes (`tests/conformance_layered_host.rs`
/// runs more layouts as threads).
#[test]
fn conformance_processes_world_4_as_2_nodes_of_2() {
    let outs = conformance_with(4, &[("FERROCOMM_LOCAL_SIZE", "2")]);
    for o in &outs {
        assert!(o.stdout.contains("2 pseudo-nodes"), "rank {}: {}", o.rank, o.stdout);
    }
}

#[test]
fn killed_rank_becomes_an_error_within_twice_the_timeout() {
    let outs = run(&["kill", "--victim", "2", "--timeout-secs", "2"], 4, 60);
    assert_victim_killed(&outs, 2);
}

/// A dead peer in any collective: every protocol's waits have deadlines.
/// The collectives run side by side (each job its own store and ranks):
/// their ranks mostly sleep on the dead peer's words until the deadline.
#[test]
fn killed_rank_in_every_collective_becomes_an_error() {
    // Sends and receives wait only on their own peers: at world 2 that is the victim.
    let jobs = [
        ("all_gather", 3),
        ("reduce_scatter", 3),
        ("all_to_all", 3),
        ("broadcast", 3),
        ("reduce", 3),
        ("sendrecv", 2),
        ("copy_all_gather", 3),
        ("copy_broadcast", 3),
        ("copy_all_to_all", 3),
    ];
    std::thread::scope(|s| {
        let runs: Vec<_> = jobs
            .map(|(coll, world)| {
                s.spawn(move || {
                    run(
                        &["kill", "--victim", "1", "--timeout-secs", "2", "--coll", coll],
                        world,
                        60,
                    )
                })
            })
            .into_iter()
            .collect();
        for run in runs {
            assert_victim_killed(&run.join().expect("a kill job panicked"), 1);
        }
    });
}

#[test]
fn stalled_rank_is_named_in_the_timeout() {
    let outs = run(&["stall", "--victim", "1", "--timeout-secs", "1"], 3, 60);
    assert_all_ok(&outs);
    for o in outs.iter().filter(|o| o.rank != 1) {
        assert!(o.stdout.contains("timed out"), "rank {}: {}", o.rank, o.stdout);
    }
}

#[test]
fn mismatched_counts_are_an_error_not_garbage() {
    let outs = run(&["mismatch", "--timeout-secs", "2"], 3, 60);
    assert_all_ok(&outs);
}

#[test]
fn mismatched_all_to_all_splits_are_an_error_naming_the_peer() {
    let outs = run(&["mismatch", "--coll", "all_to_all", "--timeout-secs", "2"], 3, 60);
    assert_all_ok(&outs);
    // Ranks 0 and 1 disagree about what 0 sends 1: both see it, naming
    // each other.
    for (rank, peer) in [(0, 1), (1, 0)] {
        let out = &outs[rank].stdout;
        assert!(
            out.contains("collective mismatch") && out.contains(&format!("rank {peer}")),
            "rank {rank}: {out}"
        );
    }
}

#[test]
fn a_different_collective_is_a_mismatch_not_a_timeout() {
    let outs = run(&["mismatch", "--coll", "crossed", "--timeout-secs", "20"], 3, 60);
    assert_all_ok(&outs);
}

#[test]
fn a_different_collective_on_the_copy_route_is_a_mismatch() {
    let outs = run(&["mismatch", "--coll", "crossed_copy", "--timeout-secs", "20"], 3, 60);
    assert_all_ok(&outs);
}

#[test]
fn use_after_finalize_is_an_error() {
    let outs = run(&["finalize"], 2, 60);
    assert_all_ok(&outs);
}

/// The smoke run the GPU scripts put under compute-sanitizer (one small,
/// checked launch of every kernel family), here on the host's twins.
#[test]
fn smoke_of_every_kernel_family() {
    let outs = run(&["smoke", "--timeout-secs", "60"], 2, 120);
    assert_all_ok(&outs);
}

/// The symmetric heap and windows with ranks as processes: heaps exchanged
/// as fds, mapped at different addresses in each process.
#[test]
fn heap_and_windows_as_processes() {
    let outs = run(&["heap", "--backend", "host", "--timeout-secs", "60"], 3, 120);
    assert_all_ok(&outs);
}

/// EP dispatch and combine with ranks as processes (the scenario the GPU
/// script runs under compute-sanitizer): received rows land in peers' heaps
/// mapped at other addresses.
#[test]
fn ep_dispatch_and_combine_as_processes() {
    let outs = run(&["ep", "--backend", "host", "--timeout-secs", "60"], 3, 180);
    assert_all_ok(&outs);
}

/// `ferrocomm-bench --operands both`: the rows on plain buffers, then on
/// symmetric-heap buffers (the direct kinds from FERROCOMM_DIRECT_MIN_BYTES
/// a peer: here the reduce-to's blocks from 32 KiB; the host's exchanges
/// carry no agreed block and stay on the inbox way), every output checked
/// (the bench fails on a wrong element) and the pairs printed side by side.
#[test]
fn bench_plain_and_heap_operands() {
    let json = std::env::temp_dir().join(format!("ferrocomm-bench-operands-{}.json", std::process::id()));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrocomm-bench"))
        .args([
            "--backend",
            "host",
            "--world",
            "2",
            "--coll",
            "all_gather,reduce_scatter,reduce",
            "--operands",
            "both",
            "--graph",
            "--min-bytes",
            "4K",
            "--max-bytes",
            "256K",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--timeout-secs",
            "60",
            "--json",
        ])
        .arg(&json)
        .env("FERROCOMM_DIRECT_MIN_BYTES", "32768")
        .env_remove("RANK")
        .output()
        .expect("running ferrocomm-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("operands=plain,heap direct_min_bytes=32768"),
        "{stdout}"
    );
    assert!(stdout.contains("# plain vs heap operands"), "{stdout}");
    let report = std::fs::read_to_string(&json).expect("the bench's JSON");
    let _ = std::fs::remove_file(&json);
    let rows = report.matches("\"coll\":").count();
    let heap_rows = report.matches("\"operands\":\"heap\"").count();
    // 3 collectives x 7 sizes x 2 modes on the heap; plain adds memcpy.
    assert_eq!(heap_rows, 3 * 7 * 2, "{report}");
    assert!(rows > heap_rows, "{report}");
    assert_eq!(report.matches("\"wrong\":0").count(), rows, "{report}");
    assert!(report.contains("\"direct_min_bytes\":32768"), "{report}");
}
