//! The conformance suite on the host backend, ranks as threads (this file)
//! and as processes (`process_mode` below, through `ferrocomm-worker`).

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::conformance::SuiteConfig;

ferrocomm::conformance_tests!(
    host_threads,
    HostDevice::new,
    |_world: usize| None,
    SuiteConfig::default()
);
