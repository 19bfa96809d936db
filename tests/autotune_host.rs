//! Autotune at init on the host backend: the first communicator measures
//! (every rank adopting rank 0's table: a ladder per collective and dtype
//! class) and caches the table; the next one reads it.

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{
    Algorithm, Call, Collective, CommOptions, Communicator, DType, DtypeClass, ReduceOp, Tensor, TuneSource,
};

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
            // Still an exact all-reduce after the table changed.
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
    let table = &first[0].table;
    println!("host autotune, world 2: {took:?}, table {table:?}");
    assert_eq!(*table, first[1].table, "ranks adopt rank 0's table");
    assert!(table.well_formed());
    for class in DtypeClass::ALL {
        assert_eq!(table.all_reduce(class).last().map(|s| s.max_bytes), Some(usize::MAX));
        for coll in [Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll] {
            // No NCCL/RCCL on the host: never its choice.
            assert!(table.coll(coll, class).iter().all(|s| s.algo != Algorithm::Vendor));
        }
    }
    // Every collective with a choice was timed, in both classes where the
    // dtype matters, every candidate at every size.
    let timings = &first[0].timings;
    for coll in Collective::TUNED {
        for class in DtypeClass::ALL {
            let n = timings
                .iter()
                .filter(|t| t.collective == coll && t.class == class)
                .count();
            let want = coll.reduces() || class == DtypeClass::Narrow;
            assert_eq!(n > 0, want, "{coll} {class}: {n} timings");
        }
    }
    assert!(timings.iter().all(|t| t.median_us.is_finite() && t.median_us >= 0.0));
    assert!(timings
        .iter()
        .any(|t| t.collective == Collective::AllGather && t.candidate == "ll"));
    assert!(timings
        .iter()
        .any(|t| t.collective == Collective::AllToAll && t.candidate == "inbox"));
    let second = run();
    for r in &second {
        assert!(matches!(r.source, TuneSource::Cached(_)), "{:?}", r.source);
        assert_eq!(r.table, first[0].table);
        assert!(r.timings.is_empty());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
