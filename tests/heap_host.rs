//! The symmetric heap and windows on the host backend (the suite every
//! backend runs: `ferrocomm::testing::heap`).

#[path = "common/host_suite.rs"]
mod host_suite;

use ferrocomm::testing::heap::{run_heap_suite, run_heap_timeout};
use host_suite::HostSuite;

const HEAP: HostSuite = HostSuite {
    heap_bytes: 4 << 20,
    graph_replays: 4,
    min_collectives: 20,
};

#[test]
fn heap_and_windows_world_2() {
    HEAP.run(2, run_heap_suite)
}

#[test]
fn heap_and_windows_world_3() {
    HEAP.run(3, run_heap_suite)
}

#[test]
fn heap_and_windows_world_8() {
    HEAP.run(8, run_heap_suite)
}

#[test]
fn a_peer_that_never_signals_is_named() {
    HEAP.run_timeout(run_heap_timeout)
}
