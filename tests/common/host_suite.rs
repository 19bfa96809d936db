//! A suite of `ferrocomm::testing` (heap, EP) on the host backend, ranks as
//! threads: what `tests/heap_host.rs` and `tests/ep_host.rs` share.

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::bootstrap::Store;
use ferrocomm::testing::conformance::{run_thread_suite, SuiteConfig, SuiteReport};
use ferrocomm::Communicator;

/// `run_heap_suite`, `run_ep_timeout` and the like, on the host.
pub type Suite = fn(&Communicator<HostDevice>, &dyn Store, &SuiteConfig) -> ferrocomm::Result<SuiteReport>;

/// How one suite runs on the host.
pub struct HostSuite {
    /// Each rank's symmetric heap for the full suite.
    pub heap_bytes: usize,
    pub graph_replays: usize,
    /// Checks each rank must count in the full suite, so one that skipped
    /// its cases fails.
    pub min_collectives: usize,
}

impl HostSuite {
    fn cfg(&self) -> SuiteConfig {
        SuiteConfig {
            timeout: Duration::from_secs(60),
            graph_replays: self.graph_replays,
            ..SuiteConfig::default()
        }
    }

    /// The full suite on `world` ranks.
    pub fn run(&self, world: usize, suite: Suite) {
        self.run_on(world, self.heap_bytes, suite, self.min_collectives);
    }

    /// A suite's timeout case: two ranks, one of which never answers. It
    /// needs little heap and counts one check.
    pub fn run_timeout(&self, suite: Suite) {
        self.run_on(2, 1 << 20, suite, 1);
    }

    fn run_on(&self, world: usize, heap_bytes: usize, suite: Suite, min_collectives: usize) {
        run_thread_suite(
            "host",
            world,
            None,
            &HostDevice::new,
            |o| o.with_heap_bytes(heap_bytes),
            suite,
            &self.cfg(),
            min_collectives,
        );
    }
}
