//! Autotune at init on the host backend: the first communicator measures
//! (every rank adopting rank 0's ladder) and caches the table; the next one
//! reads it.

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{Call, CommOptions, Communicator, DType, ReduceOp, Tensor, TuneSource};

#[test]
fn autotune_measures_once_then_reads_its_cache() {
    let dir = std::env::temp_dir().join(format!("ferrocomm-autotune-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // This test binary has this one test: no other thread reads the
    // environment while it is written.
    std::env::set_var("FERROCOMM_CACHE_DIR", &dir);
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(60))
        .with_slot_bytes(1 << 20)
        .with_autotune(true);
    let run = || {
        run_thread_ranks(2, |rank, world, store| {
            let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, opts.clone())?;
            let report = comm.autotune_report().expect("autotune ran");
            // Still an exact all-reduce after the ladder changed.
            let buf = comm.alloc(4 * 1000)?;
            let v: Vec<u8> = (0..1000).flat_map(|i| ((i + rank) as i32).to_le_bytes()).collect();
            comm.write(&buf, 0, &v)?;
            comm.all_reduce(Tensor::of(&buf, DType::I32), ReduceOp::Sum, &Call::new())?
                .wait(None)?;
            let mut got = vec![0u8; 4000];
            comm.read(&buf, 0, &mut got)?;
            for i in 0..1000 {
                let x = i32::from_le_bytes(got[i * 4..i * 4 + 4].try_into().unwrap());
                assert_eq!(x, (2 * i + 1) as i32);
            }
            comm.finalize()?;
            Ok(report)
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let first = run();
    let TuneSource::Measured(took) = first[0].source.clone() else {
        panic!("first run did not measure: {:?}", first[0].source);
    };
    println!("host autotune, world 2: {took:?}, ladder {:?}", first[0].ladder);
    assert_eq!(first[0].ladder, first[1].ladder, "ranks adopt rank 0's ladder");
    assert_eq!(first[0].ladder.last().map(|s| s.max_bytes), Some(usize::MAX));
    assert!(!first[0].timings.is_empty());
    let second = run();
    for r in &second {
        assert!(matches!(r.source, TuneSource::Cached(_)), "{:?}", r.source);
        assert_eq!(r.ladder, first[0].ladder);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
