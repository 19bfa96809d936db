//! The conformance suite on communicators that span pseudo-nodes
//! (`FERROCOMM_LOCAL_SIZE`, here `CommOptions::with_local_size`) on the host
//! backend, ranks as threads: worlds 4 = 2 x 2, 6 = 3 x 2 and 12 = 3 x 4,
//! and 3 = 2 + 1 (unequal nodes, a node of one rank). All-reduce and
//! reduce-scatter run in two levels (node kernels, the host protocols
//! standing in for NCCL between nodes) and are checked bit for bit against
//! the level-aware reference (`Reference::of`, `data::Order::Levels`); at
//! world 12 there is no workspace over every rank, so what needs one must be
//! refused, which the suite checks too. The process variant is in
//! `tests/process_host.rs`.
//!
//! The lean run (`cargo test`) runs the lean suite at each layout with 2
//! random sizes: all-reduce payloads of one chunk and of two (bf16, in
//! place) in two levels. Its volume cases (`SuiteConfig::volume_world`:
//! f32 payloads of two and three chunks and 24 MiB, the largest
//! quick-reduce, fused and MoE-finalize cases) run at world 2 only, so
//! here not at all (`tests/conformance_host.rs` runs them on one level).
//! The full sweep (`FERROCOMM_TEST_FULL=1`, run by CI) runs the whole
//! suite at each layout, payloads up to 64 MiB.

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::conformance::{full_sweep, run_suite, run_thread_suite, Reference, SuiteConfig};
use ferrocomm::testing::data::Order;

fn run(world: usize, local: usize) {
    // The lean suite (no volume cases at these worlds) with 2 random sizes,
    // unless the full sweep is asked for.
    let cfg = if full_sweep() {
        SuiteConfig::default()
    } else {
        SuiteConfig {
            random_sizes: 2,
            ..SuiteConfig::default()
        }
    };
    run_thread_suite(
        "host_layered",
        world,
        None,
        &HostDevice::new,
        |o| o.with_local_size(local),
        |comm, store, cfg| {
            // The suite must see the layout, or it checks the flat rule.
            let nodes: Vec<Vec<usize>> = (0..world.div_ceil(local))
                .map(|m| (m * local..world.min((m + 1) * local)).collect())
                .collect();
            let reference = Reference::of(comm);
            assert_eq!(
                reference.all_reduce,
                Order::Levels(nodes),
                "world {world} local {local}"
            );
            assert_eq!(reference.levels_only, world > 8, "world {world} local {local}");
            run_suite(comm, store, cfg)
        },
        &cfg,
        100,
    );
}

#[test]
fn world_4_as_2_nodes_of_2() {
    run(4, 2)
}

#[test]
fn world_6_as_3_nodes_of_2() {
    run(6, 2)
}

#[test]
fn world_12_as_3_nodes_of_4() {
    run(12, 4)
}

/// Unequal nodes: all-reduce in two levels through the nodes' first ranks,
/// reduce-scatter and all-gather over the whole group.
#[test]
fn world_3_as_nodes_of_2_and_1() {
    run(3, 2)
}
