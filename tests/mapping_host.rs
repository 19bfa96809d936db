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
