//! EP dispatch and combine on the host backend (the suite every backend
//! runs: `ferrocomm::testing::ep`), ranks as threads.

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::conformance::{run_thread_suite, SuiteConfig};
use ferrocomm::testing::ep::{run_ep_suite, run_ep_timeout};

fn cfg() -> SuiteConfig {
    SuiteConfig {
        timeout: Duration::from_secs(60),
        graph_replays: 3,
        ..SuiteConfig::default()
    }
}

fn run(world: usize) {
    run_thread_suite(
        "host",
        world,
        None,
        &HostDevice::new,
        |o| o.with_heap_bytes(8 << 20),
        |comm, store, cfg| run_ep_suite(comm, store, cfg),
        &cfg(),
        50,
    );
}

#[test]
fn ep_world_2() {
    run(2)
}

#[test]
fn ep_world_3() {
    run(3)
}

#[test]
fn ep_world_4() {
    run(4)
}

#[test]
fn ep_world_8() {
    run(8)
}

#[test]
fn a_peer_that_never_dispatches_is_named() {
    run_thread_suite(
        "host",
        2,
        None,
        &HostDevice::new,
        |o| o.with_heap_bytes(1 << 20),
        |comm, store, cfg| run_ep_timeout(comm, store, cfg),
        &cfg(),
        1,
    );
}
