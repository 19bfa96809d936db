//! One `--coll` row measured: its buffers (plain or in the heap, inputs
//! rotated), its subject timed, and the output of one more run for the
//! checks.

use ferrocomm::device::Device;
#[cfg(not(any(feature = "nccl", feature = "rccl")))]
use ferrocomm::Error;
use ferrocomm::{Algorithm, Communicator, DType, Result};

use crate::args::Args;
use crate::colls::{self, Coll};
use crate::operands::{HeapOperands, RowBuffers};
use crate::table::Row;
use crate::timing::{median, ops_per_sample, rotation, time_samples};

/// What a row times.
#[derive(Clone, Copy)]
pub enum Subject {
    /// The collective through ferrocomm, with an algorithm choice (the
    /// all-reduce's; the planner's, `None`, for the others).
    Ferro(Option<Algorithm>),
    /// The collective straight through NCCL/RCCL on the same stream.
    NcclDirect,
    /// A device-to-device copy of the same bytes: the memory floor beside
    /// the collectives (a plain memcpy on the host).
    Memcpy,
}

/// One row's collective and sizes.
pub struct Case {
    pub coll: Coll,
    pub dtype: DType,
    pub n_in: usize,
    pub n_out: usize,
    pub bytes: usize,
}

/// One row's samples and the output of one more run. `heap`: the row's
/// buffers are views of these heap allocations (`--operands heap`), else
/// plain allocations of its own.
#[allow(clippy::too_many_arguments)]
pub fn measure<D: Device>(
    comm: &Communicator<D>,
    a: &Args,
    case: &Case,
    subject: Subject,
    mode: &'static str,
    input: &[u8],
    heap: Option<&HeapOperands>,
) -> Result<(Row, Vec<u8>)> {
    let dev = comm.device();
    let backend = dev.facts().backend;
    let (coll, dtype) = (case.coll, case.dtype);
    let (in_bytes, out_bytes) = (case.n_in * dtype.size(), case.n_out * dtype.size());
    let nbuf = rotation(in_bytes);
    let bufs = RowBuffers::new(comm, heap, nbuf, in_bytes, out_bytes)?;
    // The writes are ordered on the communicator's stream, and waited for:
    // the runs below go on another one.
    bufs.write_inputs(comm, nbuf, input)?;
    let stream = dev.create_stream()?;
    let t_in = |i: usize| bufs.input(i % nbuf, dtype, case.n_in);
    let t_out = bufs.output(dtype, case.n_out)?;
    let run = |i: usize| -> Result<()> {
        match subject {
            Subject::Ferro(choice) => {
                let call = colls::with_algo(ferrocomm::Call::<D>::on(&stream), choice);
                colls::through_ferrocomm(comm, &call, coll, t_in(i)?, t_out, a.op)
            }
            #[cfg(any(feature = "nccl", feature = "rccl"))]
            Subject::NcclDirect => colls::through_ccl(comm, &stream, coll, t_in(i)?, t_out, a.op),
            #[cfg(not(any(feature = "nccl", feature = "rccl")))]
            Subject::NcclDirect => Err(Error::Unsupported("built without NCCL/RCCL".into())),
            Subject::Memcpy => dev.copy_device(bufs.output_ptr(), bufs.input_ptr(i % nbuf), in_bytes, &stream),
        }
    };
    // A sample is a few back-to-back operations (eager launches, or one
    // replay of a graph holding them), timed by events and divided: the same
    // shape as nccl-tests and the torch baseline.
    let ops = ops_per_sample(backend, case.bytes);
    let (mut times, mut cpu) = time_samples(comm, a, mode, &stream, ops, run)?;
    // The output of one more run, from a poisoned buffer (or, for the
    // in-place reduce, from the input), for the checks.
    let check_len = if matches!(subject, Subject::Memcpy) {
        in_bytes
    } else {
        out_bytes
    };
    if colls::in_place(coll) && !matches!(subject, Subject::Memcpy) {
        bufs.write_output(comm, input)?;
    } else {
        bufs.poison_output(comm, check_len, &stream)?;
    }
    run(0)?;
    let mut got = vec![0u8; check_len];
    bufs.read_output(comm, &mut got, &stream)?;
    let row = Row {
        coll,
        bytes: case.bytes,
        count: case.n_in,
        dtype,
        op: a.op,
        algo: String::new(),
        mode,
        time_us: median(&mut times),
        cpu_us: median(&mut cpu),
        wrong: None,
        relerr: None,
        operands: bufs.operands(),
    };
    Ok((row, got))
}
