//! EP dispatch and combine on the host backend (the suite every backend
//! runs: `ferrocomm::testing::ep`), ranks as threads.

#[path = "common/host_suite.rs"]
mod host_suite;

use ferrocomm::testing::ep::{run_ep_suite, run_ep_timeout};
use host_suite::HostSuite;

const EP: HostSuite = HostSuite {
    heap_bytes: 8 << 20,
    graph_replays: 3,
    min_collectives: 50,
};

#[test]
fn ep_world_2() {
    EP.run(2, run_ep_suite)
}

#[test]
fn ep_world_3() {
    EP.run(3, run_ep_suite)
}

#[test]
fn ep_world_4() {
    EP.run(4, run_ep_suite)
}

#[test]
fn ep_world_8() {
    EP.run(8, run_ep_suite)
}

#[test]
fn a_peer_that_never_dispatches_is_named() {
    EP.run_timeout(run_ep_timeout)
}
