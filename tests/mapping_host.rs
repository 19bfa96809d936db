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
