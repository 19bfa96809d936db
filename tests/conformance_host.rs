//! The conformance suite on the host backend, ranks as threads at worlds 2,
//! 3, 4 and 8 (this file; as processes: `tests/process_host.rs`, through
//! `ferrocomm-worker`).
//!
//! The lean run (`cargo test`, `SuiteConfig::default()`) runs every case:
//! the volume cases (`SuiteConfig::volume_world`: f32 all-reduce payloads
//! of two and three 8 MiB chunks and 24 MiB, quick-reduce's largest count,
//! the largest fused and MoE-finalize shapes) at world 2 only, the rest at
//! every world, quick-reduce over chunks of 64 KiB slots, 3 random sizes
//! and 4 graph replays. The full sweep
//! (`FERROCOMM_TEST_FULL=1`, run by CI) adds the 64 MiB payload, the volume
//! cases at every world, 1 MiB slots for quick-reduce over chunks, 6 random
//! sizes and 20 replays.

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::conformance::SuiteConfig;

ferrocomm::conformance_tests!(
    host_threads,
    HostDevice::new,
    |_world: usize| None,
    SuiteConfig::default()
);
