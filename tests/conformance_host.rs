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

/// Small agreed blocks take the LL kinds (`fc_exchange_ll`,
/// `fc_reduce_to_ll_*`), larger ones the inbox kinds, and both give the
/// reference's values; `coll_ll_bytes = 0` turns LL off. (The suite above
/// checks every size either way; this shows which protocol ran.)
#[test]
fn small_blocks_take_the_ll_kinds() {
    use ferrocomm::backends::host::launches;
    use ferrocomm::testing::data::{from_bytes, to_bytes};
    use ferrocomm::testing::harness::run_thread_ranks;
    use ferrocomm::{Call, CommOptions, Communicator, DType, ReduceOp, Tensor};

    // (per-peer elements, LL allowed): 1000 f32 is 4000 bytes (LL), 20_000
    // is 400 000 bytes (over world 2's 256 KiB threshold), 1000 with LL off.
    for (n, ll_on, want_ll) in [(1000usize, true, true), (100_000, true, false), (1000, false, false)] {
        let names = [
            "fc_exchange_ll",
            "fc_reduce_to_ll_f32_sum",
            "fc_exchange",
            "fc_reduce_to_f32_sum",
        ];
        let before: Vec<u64> = names.iter().map(|k| launches(k)).collect();
        let results = run_thread_ranks(2, |rank, world, store| {
            let mut opts = CommOptions::default();
            if !ll_on {
                opts = opts.with_coll_ll_bytes(0);
            }
            let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, opts)?;
            let call = Call::new();
            let value = |r: usize, i: usize| (r * 100_000 + i) as f32;
            let whole = comm.alloc(world * n * 4)?;
            let part = comm.alloc(n * 4)?;
            // All-gather: every rank's n values, in rank order.
            comm.write(
                &part,
                0,
                &to_bytes(&(0..n).map(|i| value(rank, i)).collect::<Vec<f32>>()),
            )?;
            comm.all_gather_single(Tensor::of(&whole, DType::F32), Tensor::of(&part, DType::F32), &call)?
                .wait(None)?;
            let mut b = vec![0u8; world * n * 4];
            comm.read(&whole, 0, &mut b)?;
            let got: Vec<f32> = from_bytes(&b);
            let want: Vec<f32> = (0..world).flat_map(|r| (0..n).map(move |i| value(r, i))).collect();
            assert_eq!(got, want, "all-gather n={n} ll={ll_on} rank {rank}");
            // Reduce-scatter: block r of every rank, summed (exact in f32).
            comm.write(
                &whole,
                0,
                &to_bytes(&(0..world * n).map(|i| value(rank, i)).collect::<Vec<f32>>()),
            )?;
            comm.reduce_scatter_single(
                Tensor::of(&part, DType::F32),
                Tensor::of(&whole, DType::F32),
                ReduceOp::Sum,
                &call,
            )?
            .wait(None)?;
            let mut b = vec![0u8; n * 4];
            comm.read(&part, 0, &mut b)?;
            let got: Vec<f32> = from_bytes(&b);
            let want: Vec<f32> = (0..n)
                .map(|i| (0..world).map(|r| value(r, rank * n + i)).sum())
                .collect();
            assert_eq!(got, want, "reduce-scatter n={n} ll={ll_on} rank {rank}");
            Ok(())
        });
        for r in results {
            r.expect("rank failed");
        }
        let grew: Vec<bool> = names.iter().zip(&before).map(|(k, b)| launches(k) > *b).collect();
        if want_ll {
            assert!(grew[0] && grew[1], "n={n}: the LL kinds did not run ({grew:?})");
        } else {
            assert!(
                grew[2] && grew[3],
                "n={n} ll={ll_on}: the inbox kinds did not run ({grew:?})"
            );
        }
    }
}
