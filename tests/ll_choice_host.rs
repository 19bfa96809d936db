//! Which protocol a collective took on the host backend: small agreed blocks
//! take the LL kinds (`fc_exchange_ll`, `fc_reduce_to_ll_*`), larger ones and
//! calls without an agreed block the inbox kinds, and every result is the
//! reference's. The conformance suite checks the values at every size either
//! way; this shows the choice. It is a test binary of its own so that no
//! other test's launches add to the process-wide counts it compares.

use ferrocomm::backends::host::{launches, HostBuffer, HostDevice};
use ferrocomm::testing::data::{from_bytes, to_bytes};
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{Call, CommOptions, Communicator, DType, ReduceOp, Result, Tensor};

const KINDS: [&str; 5] = [
    "fc_exchange_ll",
    "fc_reduce_to_ll_f32_sum",
    "fc_exchange",
    "fc_reduce_to_f32_sum",
    "fc_exchange_direct",
];

/// The kinds of [`KINDS`] that `f` launched, run on two thread ranks.
fn kinds_run<F>(ll_on: bool, f: F) -> Vec<&'static str>
where
    F: Fn(&Communicator<HostDevice>, usize, usize) -> Result<()> + Sync,
{
    let before: Vec<u64> = KINDS.iter().map(|k| launches(k)).collect();
    let results = run_thread_ranks(2, |rank, world, store| {
        let mut opts = CommOptions::default();
        if !ll_on {
            opts = opts.with_coll_ll_bytes(0);
        }
        let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, opts)?;
        f(&comm, rank, world)
    });
    for r in results {
        r.expect("rank failed");
    }
    KINDS
        .iter()
        .zip(&before)
        .filter(|(k, b)| launches(k) > **b)
        .map(|(k, _)| *k)
        .collect()
}

fn value(r: usize, i: usize) -> f32 {
    (r * 100_000 + i) as f32
}

fn write(comm: &Communicator<HostDevice>, t: &HostBuffer, v: &[f32]) -> Result<()> {
    comm.write(t, 0, &to_bytes(v))
}

fn read(comm: &Communicator<HostDevice>, t: &HostBuffer, n: usize) -> Result<Vec<f32>> {
    let mut b = vec![0u8; n * 4];
    comm.read(t, 0, &mut b)?;
    Ok(from_bytes(&b))
}

#[test]
fn small_blocks_take_the_ll_kinds() {
    // (per-peer f32 elements, LL allowed, LL expected): 1000 is 4000 bytes,
    // 100 000 is 400 000 bytes (over world 2's 256 KiB threshold).
    for (n, ll_on, want_ll) in [(1000usize, true, true), (100_000, true, false), (1000, false, false)] {
        let ex = if want_ll { "fc_exchange_ll" } else { "fc_exchange" };
        let red = if want_ll {
            "fc_reduce_to_ll_f32_sum"
        } else {
            "fc_reduce_to_f32_sum"
        };
        let case = format!("n={n} ll={ll_on}");

        // All-gather: every rank's n values, in rank order.
        let ran = kinds_run(ll_on, |comm, rank, world| {
            let (whole, part) = (comm.alloc(world * n * 4)?, comm.alloc(n * 4)?);
            write(comm, &part, &(0..n).map(|i| value(rank, i)).collect::<Vec<_>>())?;
            comm.all_gather_single(
                Tensor::of(&whole, DType::F32),
                Tensor::of(&part, DType::F32),
                &Call::new(),
            )?
            .wait(None)?;
            let want: Vec<f32> = (0..world).flat_map(|r| (0..n).map(move |i| value(r, i))).collect();
            assert_eq!(read(comm, &whole, world * n)?, want, "all-gather {case} rank {rank}");
            Ok(())
        });
        assert_eq!(ran, [ex], "all-gather {case}");

        // Reduce-scatter: block r of every rank, summed (exact in f32).
        let ran = kinds_run(ll_on, |comm, rank, world| {
            let (whole, part) = (comm.alloc(world * n * 4)?, comm.alloc(n * 4)?);
            write(
                comm,
                &whole,
                &(0..world * n).map(|i| value(rank, i)).collect::<Vec<_>>(),
            )?;
            let (out, inp) = (Tensor::of(&part, DType::F32), Tensor::of(&whole, DType::F32));
            comm.reduce_scatter_single(out, inp, ReduceOp::Sum, &Call::new())?
                .wait(None)?;
            let want: Vec<f32> = (0..n)
                .map(|i| (0..world).map(|r| value(r, rank * n + i)).sum())
                .collect();
            assert_eq!(read(comm, &part, n)?, want, "reduce-scatter {case} rank {rank}");
            Ok(())
        });
        assert_eq!(ran, [red], "reduce-scatter {case}");

        // All-to-all without splits (an agreed block of n) takes LL; the same
        // call with its even splits given has no agreed block: the inbox.
        for given in [false, true] {
            let ran = kinds_run(ll_on, |comm, rank, world| {
                let (inp, out) = (comm.alloc(world * n * 4)?, comm.alloc(world * n * 4)?);
                write(comm, &inp, &(0..world * n).map(|i| value(rank, i)).collect::<Vec<_>>())?;
                let splits = if given { vec![n; world] } else { vec![] };
                let (o, i) = (Tensor::of(&out, DType::F32), Tensor::of(&inp, DType::F32));
                comm.all_to_all_v_single(o, i, &splits, &splits, &Call::new())?
                    .wait(None)?;
                // Block s of the output is block `rank` of rank s's input.
                let want: Vec<f32> = (0..world)
                    .flat_map(|s| (0..n).map(move |i| value(s, rank * n + i)))
                    .collect();
                assert_eq!(
                    read(comm, &out, world * n)?,
                    want,
                    "all-to-all {case} splits {given} rank {rank}"
                );
                Ok(())
            });
            let want = if given { "fc_exchange" } else { ex };
            assert_eq!(ran, [want], "all-to-all {case} splits given {given}");
        }
    }
}
