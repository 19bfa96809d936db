//! The symmetric heap and windows on the host backend (the suite every
//! backend runs: `ferrocomm::testing::heap`).

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::conformance::{run_thread_suite, SuiteConfig};
use ferrocomm::testing::heap::{run_heap_suite, run_heap_timeout};

fn cfg() -> SuiteConfig {
    SuiteConfig {
        timeout: Duration::from_secs(60),
        graph_replays: 4,
        ..SuiteConfig::default()
    }
}

fn run(world: usize) {
    run_thread_suite(
        "host",
        world,
        None,
        &HostDevice::new,
        |o| o.with_heap_bytes(4 << 20),
        |comm, store, cfg| run_heap_suite(comm, store, cfg),
        &cfg(),
        20,
    );
}

#[test]
fn heap_and_windows_world_2() {
    run(2)
}

#[test]
fn heap_and_windows_world_3() {
    run(3)
}

#[test]
fn heap_and_windows_world_8() {
    run(8)
}

#[test]
fn a_peer_that_never_signals_is_named() {
    run_thread_suite(
        "host",
        2,
        None,
        &HostDevice::new,
        |o| o.with_heap_bytes(1 << 20),
        |comm, store, cfg| run_heap_timeout(comm, store, cfg),
        &cfg(),
        1,
    );
}
