//! The randomized differential fuzz of the public API (`testing::fuzz`) on
//! the host backend, ranks as threads: the same calls on every rank, with
//! per-rank offsets, memory kinds, streams and dropped `Work`s.
//!
//! `FERROCOMM_FUZZ_TRIALS=1000 cargo test --release --test fuzz_host` runs
//! more (CI runs a few hundred); `FERROCOMM_FUZZ_FIRST` and
//! `FERROCOMM_FUZZ_TRIALS=1` replay the trial a failure names.

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::fuzz::{run_fuzz, FuzzConfig};
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{CommOptions, Communicator};

fn fuzz(world: usize, trials: usize) {
    let cfg = FuzzConfig::from_env(trials, 1 << 20);
    // Small slots: calls of more than one chunk at these sizes.
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(30))
        .with_slot_bytes(256 << 10)
        .with_heap_bytes(16 << 20);
    let reports = run_thread_ranks(world, |rank, world, store| {
        let comm = Communicator::new(HostDevice::new(rank)?, store.clone(), rank, world, opts.clone())?;
        let report = run_fuzz(&comm, store.as_ref(), &cfg)?;
        comm.finalize()?;
        Ok(report)
    });
    let reports: Vec<_> = reports
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.map_err(|e| format!("world {world}, rank {rank}: {e}")))
        .collect();
    let errors: Vec<&String> = reports.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(errors.is_empty(), "{errors:#?}");
    for (rank, r) in reports.into_iter().enumerate() {
        let r = r.expect("checked above");
        assert!(
            r.is_clean(),
            "world {world}, rank {rank}: {} trials, {} wrong, {} clobbered, {} disagreements, errors {:?}, failures {:#?}",
            r.trials,
            r.wrong,
            r.clobbered,
            r.disagreements,
            r.errors,
            r.failures
        );
        assert_eq!(r.trials, cfg.trials, "world {world}, rank {rank}: not every trial ran");
        // The host backend runs every call.
        assert!(
            r.refused.is_empty(),
            "world {world}, rank {rank}: refused {:#?}",
            r.refused
        );
        if rank == 0 {
            eprintln!(
                "world {world}: {} trials, {} bytes checked: {:?}",
                r.trials, r.bytes_checked, r.calls
            );
        }
    }
}

#[test]
fn fuzz_world_2() {
    fuzz(2, 200);
}

#[test]
fn fuzz_world_3() {
    fuzz(3, 200);
}

#[test]
fn fuzz_world_4() {
    fuzz(4, 100);
}
