//! The collectives the bench times (`--coll`), their sizes and bus
//! bandwidth as nccl-tests defines them, the expected output of each, and
//! one call of each through ferrocomm or straight through NCCL/RCCL.

use ferrocomm::device::Device;
#[cfg(any(feature = "nccl", feature = "rccl"))]
use ferrocomm::device::DevicePtr;
use ferrocomm::testing::data::{self, FromF64, Values};
#[cfg(any(feature = "nccl", feature = "rccl"))]
use ferrocomm::Error;
use ferrocomm::{Algorithm, Call, Collective, Communicator, DType, P2p, ReduceOp, Result, Tensor};

/// A collective the bench times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
    Reduce,
    SendRecv,
}

impl Coll {
    pub const ALL: [Coll; 7] = [
        Coll::AllReduce,
        Coll::AllGather,
        Coll::ReduceScatter,
        Coll::AllToAll,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::SendRecv,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::AllGather => "all_gather",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllToAll => "all_to_all",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::SendRecv => "sendrecv",
        }
    }

    /// nccl-tests' bus bandwidth factor: 2(n-1)/n for all-reduce, (n-1)/n
    /// for all-gather, reduce-scatter and all-to-all, 1 otherwise.
    pub fn busbw_factor(self, world: usize) -> f64 {
        let n = world as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }

    /// Whether the op column means anything.
    pub fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce)
    }

    /// Elements of this rank's input and output for a row of `bytes` (the
    /// size column: the output of all-gather, the input of reduce-scatter,
    /// each rank's buffer of all-to-all; nccl-tests' convention). `None`
    /// when `bytes` does not split into whole elements per rank.
    pub fn counts(self, bytes: usize, dtype: DType, world: usize) -> Option<(usize, usize)> {
        let n = bytes / dtype.size();
        match self {
            Coll::AllGather => (n % world == 0).then(|| (n / world, n)),
            Coll::ReduceScatter => (n % world == 0).then(|| (n, n / world)),
            Coll::AllToAll => (n % world == 0).then_some((n, n)),
            _ => Some((n, n)),
        }
    }
}

/// This rank's input and the expected output (bytes), from small integers
/// (exact in every dtype and order).
pub fn data_for<T: FromF64>(
    coll: Coll,
    seed: u64,
    rank: usize,
    world: usize,
    n_in: usize,
    n_out: usize,
    op: ReduceOp,
) -> (Vec<u8>, Vec<u8>) {
    let input = |r: usize, n: usize| data::to_bytes(&data::make_input::<T>(seed, r, 0, n, op, Values::Exact));
    let want = match coll {
        Coll::AllReduce => data::to_bytes(&data::reference::<T>(seed, world, 0, n_out, op, Values::Exact)),
        Coll::AllGather => (0..world).flat_map(|s| input(s, n_in)).collect(),
        Coll::ReduceScatter => data::to_bytes(&data::reference::<T>(
            seed,
            world,
            rank * n_out,
            n_out,
            op,
            Values::Exact,
        )),
        Coll::AllToAll => {
            let k = n_in / world * std::mem::size_of::<T>();
            (0..world)
                .flat_map(|s| input(s, n_in)[rank * k..(rank + 1) * k].to_vec())
                .collect()
        }
        Coll::Broadcast => input(0, n_in),
        Coll::Reduce if rank == 0 => data::to_bytes(&data::reference::<T>(seed, world, 0, n_out, op, Values::Exact)),
        // Non-roots keep their input.
        Coll::Reduce => input(rank, n_in),
        Coll::SendRecv => input((rank + world - 1) % world, n_in),
    };
    (input(rank, n_in), want)
}

/// One call of `coll` through ferrocomm. Broadcast and reduce are in
/// place on `output` (the caller copies the input there first); reduce and
/// broadcast use root 0; send/recv is a ring.
pub fn through_ferrocomm<D: Device>(
    comm: &Communicator<D>,
    call: &Call<'_, D>,
    coll: Coll,
    input: Tensor,
    output: Tensor,
    op: ReduceOp,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.size());
    match coll {
        Coll::AllReduce => comm.all_reduce_into(input, output, op, call),
        Coll::AllGather => comm.all_gather_single(output, input, call),
        Coll::ReduceScatter => comm.reduce_scatter_single(output, input, op, call),
        Coll::AllToAll => comm.all_to_all_single(output, input, call),
        Coll::Broadcast => comm.broadcast_into(input, output, 0, call),
        Coll::Reduce => comm.reduce(output, op, 0, call),
        Coll::SendRecv => comm.batch_p2p(
            &[
                P2p::Send(input, (rank + 1) % world),
                P2p::Recv(output, (rank + world - 1) % world),
            ],
            call,
        ),
    }
    .map(drop)
}

/// Whether a broadcast or reduce row must first copy the input into the
/// output (they run in place).
pub fn in_place(coll: Coll) -> bool {
    matches!(coll, Coll::Reduce)
}

/// The same collective straight through NCCL/RCCL, on the same stream: the
/// baseline ferrocomm's routing overhead is measured against.
#[cfg(any(feature = "nccl", feature = "rccl"))]
#[allow(clippy::too_many_arguments)]
pub fn through_ccl<D: Device>(
    comm: &Communicator<D>,
    stream: &D::Stream,
    coll: Coll,
    input: Tensor,
    output: Tensor,
    op: ReduceOp,
) -> Result<()> {
    use ferrocomm::backends::ccl::CclReduction;
    let raw = comm
        .device()
        .raw_stream(stream)
        .ok_or_else(|| Error::Unsupported("no vendor stream on this backend".into()))?;
    let (rank, world) = (comm.rank(), comm.size());
    let dtype = input.dtype();
    let (i, o) = (input.ptr(), output.ptr());
    let (n_in, n_out) = (input.count(), output.count());
    comm.with_ccl(|c| {
        // SAFETY: the bench's buffers hold these counts and outlive the
        // stream's work (it synchronises before dropping them).
        unsafe {
            match coll {
                Coll::AllReduce => c.all_reduce_with(i, o, n_in, dtype, CclReduction::Op(op), raw),
                Coll::AllGather => c.all_gather(i, o, n_in, dtype, raw),
                Coll::ReduceScatter => c.reduce_scatter_with(i, o, n_out, dtype, CclReduction::Op(op), raw),
                Coll::AllToAll => {
                    let k = n_in / world;
                    let size = dtype.size();
                    let sends: Vec<Option<(usize, DevicePtr)>> =
                        (0..world).map(|q| Some((k, i.offset(q * k * size)))).collect();
                    let recvs: Vec<Option<(usize, DevicePtr)>> =
                        (0..world).map(|q| Some((k, o.offset(q * k * size)))).collect();
                    c.exchange(&sends, &recvs, dtype, raw)
                }
                Coll::Broadcast => c.broadcast(i, o, n_in, dtype, 0, raw),
                Coll::Reduce => c.reduce(o, o, n_in, dtype, CclReduction::Op(op), 0, raw),
                Coll::SendRecv => {
                    let mut sends = vec![None; world];
                    let mut recvs = vec![None; world];
                    sends[(rank + 1) % world] = Some((n_in, i));
                    recvs[(rank + world - 1) % world] = Some((n_out, o));
                    c.exchange(&sends, &recvs, dtype, raw)
                }
            }
        }
    })?
    .ok_or_else(|| Error::Unsupported("NCCL/RCCL is not loaded".into()))?
}

/// `call`, with `choice` as its algorithm when one is given (a data kind
/// as the call's `coll_algo`).
pub fn with_algo<'s, D: Device>(call: Call<'s, D>, choice: Option<Algorithm>) -> Call<'s, D> {
    match choice {
        Some(a) if !a.is_all_reduce() => call.coll_algo(a),
        Some(a) => call.algo(a),
        None => call,
    }
}

/// The `--algo` names that apply to a collective: the all-reduce's
/// algorithms to it; `ll` and `inbox` to all-gather, reduce-scatter and
/// all-to-all, `copy` to all-gather, all-to-all and broadcast (where the
/// planner honours them); `auto` everywhere.
pub fn algo_applies(coll: Coll, choice: Option<Algorithm>) -> bool {
    let Some(a) = choice else { return true };
    match coll {
        Coll::AllReduce => a.is_all_reduce(),
        Coll::AllGather | Coll::AllToAll => matches!(a, Algorithm::Ll | Algorithm::Inbox | Algorithm::Copy),
        Coll::ReduceScatter => matches!(a, Algorithm::Ll | Algorithm::Inbox),
        Coll::Broadcast => a == Algorithm::Copy,
        Coll::Reduce | Coll::SendRecv => false,
    }
}

impl Coll {
    /// The planner's name of the collective, and the count it plans by
    /// (all-reduce, broadcast and reduce: the elements; the others: a
    /// peer's block).
    pub fn planned(self, n_in: usize, world: usize) -> (Collective, usize) {
        match self {
            Coll::AllReduce => (Collective::AllReduce, n_in),
            Coll::AllGather => (Collective::AllGather, n_in),
            Coll::ReduceScatter => (Collective::ReduceScatter, n_in / world),
            Coll::AllToAll => (Collective::AllToAll, n_in / world),
            Coll::Broadcast => (Collective::Broadcast, n_in),
            Coll::Reduce => (Collective::Reduce, n_in),
            Coll::SendRecv => (Collective::SendRecv, 0),
        }
    }
}
