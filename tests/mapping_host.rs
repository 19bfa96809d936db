//! Mappings on the host backend: `split_by` forms the tensor-, pipeline-,
//! data- and expert-parallel groups of a world, each rank getting its own.

use std::time::Duration;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{Call, CommOptions, Communicator, DType, Error, ReduceOp, Tensor};

/// `split_by` gives every rank the communicator of its own group along each
/// axis of a mapping (world 8 as tp 2 x pp 2 x dp 2), and a collective in
/// each group reduces exactly that group's ranks.
#[test]
fn split_by_mapping_forms_every_group() {
    use ferrocomm::{Axis, Mapping};
    let world = 8;
    let mapping = Mapping::new(world, 2, 1, 2).unwrap();
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(30))
        .with_slot_bytes(64 << 10);
    let results = run_thread_ranks(world, |rank, world, store| {
        let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, opts.clone())?;
        for axis in [Axis::Tp, Axis::Pp, Axis::Dp, Axis::Ep] {
            let group = mapping.group(axis, rank)?;
            let sub = comm.split_by(&mapping, axis)?;
            assert_eq!(sub.size(), group.len(), "{axis:?}");
            assert_eq!(
                group[sub.rank()],
                rank,
                "{axis:?}: group rank is the index in the group"
            );
            let buf = sub.alloc(4)?;
            sub.write(&buf, 0, &((rank + 1) as i32).to_le_bytes())?;
            sub.all_reduce(Tensor::of(&buf, DType::I32), ReduceOp::Sum, &Call::new())?
                .wait(None)?;
            let mut got = [0u8; 4];
            sub.read(&buf, 0, &mut got)?;
            let want: i32 = group.iter().map(|&r| r as i32 + 1).sum();
            assert_eq!(i32::from_le_bytes(got), want, "{axis:?} rank {rank} group {group:?}");
            sub.finalize()?;
        }
        // A mapping of another world is refused before any collective.
        let wrong = Mapping::new(4, 2, 1, 1)?;
        assert!(matches!(
            comm.split_by(&wrong, Axis::Tp),
            Err(Error::InvalidArgument(_))
        ));
        comm.finalize()
    });
    for r in results {
        r.unwrap();
    }
}

/// `FERROCOMM_LOCAL_SIZE` (here `with_local_size`) splits one host into
/// pseudo-nodes of consecutive ranks; a split keeps each rank on the node of
/// its rank in the parent.
#[test]
fn pseudo_nodes_give_every_rank_its_node_and_local_rank() {
    use ferrocomm::{Axis, Mapping};
    let world = 6;
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(30))
        .with_slot_bytes(64 << 10)
        .with_local_size(2);
    let results = run_thread_ranks(world, |rank, world, store| {
        let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, opts.clone())?;
        let t = comm.topology().clone();
        assert_eq!(
            (t.node, t.nodes, t.local_rank, t.local_size),
            (rank / 2, 3, rank % 2, 2)
        );
        assert!(t.pseudo);
        assert_eq!(t.describe(), "3 pseudo-nodes (2+2+2 ranks)");
        assert_eq!(t.ranks_on(1), [2, 3]);
        // Data parallel across the pseudo-nodes: one rank of each node.
        let dp = comm.split_by(&Mapping::new(world, 2, 1, 1)?, Axis::Dp)?;
        let d = dp.topology();
        assert_eq!(
            (d.node, d.nodes, d.local_size),
            (rank / 2, 3, 1),
            "rank {rank} in its dp group"
        );
        // Tensor parallel inside a pseudo-node.
        let tp = comm.split_by(&Mapping::new(world, 2, 1, 1)?, Axis::Tp)?;
        assert_eq!(tp.topology().nodes, 1);
        dp.finalize()?;
        tp.finalize()?;
        comm.finalize()
    });
    for r in results {
        r.unwrap();
    }
}

/// MixedComm's pairs on every layout of TP and DP over pseudo-nodes: TP
/// inside a node and DP across, both across (with TP innermost and nodes of
/// consecutive ranks, TP across and DP inside cannot happen), both inside.
#[test]
fn mixed_pairs_reduce_over_tp_and_gather_over_dp() {
    use ferrocomm::{Mapping, MixedComm, MixedMode};
    // (world, tp, local size, the mode it gives)
    for (world, tp, local, mode) in [
        (4, 2, 2, MixedMode::TpLocalDpInter),
        (4, 2, 1, MixedMode::Inter),
        (4, 2, 4, MixedMode::Local),
        (8, 4, 2, MixedMode::Inter),
    ] {
        let opts = CommOptions::default()
            .with_timeout(Duration::from_secs(30))
            .with_slot_bytes(16 << 10)
            .with_local_size(local);
        let results = run_thread_ranks(world, |rank, world, store| {
            let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, opts.clone())?;
            let mapping = Mapping::new(world, tp, 1, 1)?;
            let mixed = MixedComm::new(&comm, &mapping)?;
            let dp = world / tp;
            assert_eq!(mixed.mode(), mode, "world {world} tp {tp} local {local}");
            assert_eq!(mixed.valid_modes(), [mode]);
            let n = 9;
            let value = |r: usize, i: usize| (r * 100 + i) as i32;
            let write = |buf: &_, v: Vec<i32>| {
                let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                comm.write(buf, 0, &b)
            };
            let read = |buf: &_, len: usize| -> ferrocomm::Result<Vec<i32>> {
                let mut b = vec![0u8; len * 4];
                comm.read(buf, 0, &mut b)?;
                Ok(b.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect())
            };
            // The writes are ordered on the world communicator's stream: the
            // pairs run there too.
            let on: Call<HostDevice> = Call::on(comm.stream());
            // all_reduce_all_gather: block d = sum over TP group d's inputs.
            let input = comm.alloc(n * 4)?;
            write(&input, (0..n).map(|i| value(rank, i)).collect())?;
            let output = comm.alloc(dp * n * 4)?;
            mixed
                .all_reduce_all_gather(Tensor::of(&output, DType::I32), Tensor::of(&input, DType::I32), &on)?
                .wait(None)?;
            let want: Vec<i32> = (0..dp)
                .flat_map(|d| (0..n).map(move |i| (0..tp).map(|t| value(d * tp + t, i)).sum::<i32>()))
                .collect();
            assert_eq!(
                read(&output, dp * n)?,
                want,
                "all_reduce_all_gather world {world} tp {tp} local {local}"
            );
            // reduce_scatter_all_reduce: block (my dp rank) summed over every rank.
            let whole = comm.alloc(dp * n * 4)?;
            write(&whole, (0..dp * n).map(|i| value(rank, i)).collect())?;
            let out = comm.alloc(n * 4)?;
            mixed
                .reduce_scatter_all_reduce(Tensor::of(&out, DType::I32), Tensor::of(&whole, DType::I32), &on)?
                .wait(None)?;
            let d = rank / tp;
            let want: Vec<i32> = (0..n).map(|i| (0..world).map(|r| value(r, d * n + i)).sum()).collect();
            assert_eq!(
                read(&out, n)?,
                want,
                "reduce_scatter_all_reduce world {world} tp {tp} local {local}"
            );
            mixed.finalize()?;
            comm.finalize()
        });
        for (r, res) in results.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("world {world} tp {tp} local {local} rank {r}: {e}"));
        }
    }
}
