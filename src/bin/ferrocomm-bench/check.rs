//! What a `--coll` row must output, and how its output is judged: exactly,
//! element by element against the expected bytes (small integers: every
//! algorithm's result is exact), or, with `--quantization`, on sampled
//! blocks against the algorithm's own reference, with the relative error
//! against an fp64 sum.

use ferrocomm::codec::{self, Half16};
use ferrocomm::device::Device;
use ferrocomm::testing::data::{self, Values};
use ferrocomm::{Algorithm, Communicator, DType, Error, ReduceOp, Result};

use crate::args::Args;
use crate::colls::{self, Coll};
use crate::measure::{Case, Subject};

/// Dispatch `$f::<T>(args)` on a runtime dtype.
macro_rules! with_dtype {
    ($dtype:expr, $($f:ident)::+($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $($f)::+::<f32>($($arg),*),
            DType::F16 => $($f)::+::<half::f16>($($arg),*),
            DType::BF16 => $($f)::+::<half::bf16>($($arg),*),
            DType::I32 => $($f)::+::<i32>($($arg),*),
            other => return Err(Error::invalid(format!("the all-reduce bench reduces f32, f16, bf16 or i32, not {other}"))),
        }
    };
}

/// A size's data, made once for all its rows: this rank's input, and the
/// exact expected output (empty where the output is `sampled`).
pub struct Expected {
    pub seed: u64,
    pub input: Vec<u8>,
    pub want: Vec<u8>,
    /// Gaussian inputs (`--quantization` all-reduce rows): the output is
    /// judged on sampled blocks, with a relative error.
    pub sampled: bool,
}

impl Expected {
    pub fn new(case: &Case, a: &Args, rank: usize, world: usize) -> Result<Expected> {
        let Case {
            coll,
            dtype,
            n_in,
            n_out,
            bytes,
        } = *case;
        let seed = bytes as u64 ^ coll as u64;
        let sampled = !a.quantization.is_empty() && coll == Coll::AllReduce;
        let (input, want) = if sampled {
            let values = Values::Random;
            let input = with_dtype!(dtype, input_bytes(seed, rank, n_in, a.op, values));
            (input, Vec::new())
        } else {
            with_dtype!(dtype, colls::data_for(coll, seed, rank, world, n_in, n_out, a.op))
        };
        Ok(Expected {
            seed,
            input,
            want,
            sampled,
        })
    }
}

/// A row's output judged: (#wrong, or `None` where it is not bitwise
/// comparable; the relative error, with sampled outputs).
pub fn judge<D: Device>(
    comm: &Communicator<D>,
    a: &Args,
    case: &Case,
    subject: Subject,
    expected: &Expected,
    got: &[u8],
) -> Result<(Option<usize>, Option<f64>)> {
    let dtype = case.dtype;
    match subject {
        Subject::Memcpy => {
            // The copy's output is its input.
            let input = &expected.input[..got.len().min(expected.input.len())];
            Ok((Some(count_wrong(got, input, dtype)), None))
        }
        Subject::Ferro(choice) if expected.sampled => {
            let algorithm = planned(comm, a, case, choice)?;
            let world = comm.size();
            let (wrong, relerr) = match dtype {
                DType::F16 => check_samples::<half::f16>(expected.seed, world, got, algorithm),
                _ => check_samples::<half::bf16>(expected.seed, world, got, algorithm),
            };
            Ok((wrong, Some(relerr)))
        }
        Subject::NcclDirect | Subject::Ferro(_) => Ok((Some(count_wrong(got, &expected.want, dtype)), None)),
    }
}

/// The row's algo column, in the one vocabulary: what `auto` took, named;
/// the subject's own name for memcpy and the vendor's rows.
pub fn algo_label<D: Device>(
    comm: &Communicator<D>,
    a: &Args,
    case: &Case,
    name: &str,
    subject: Subject,
) -> Result<String> {
    Ok(match subject {
        Subject::Ferro(None) => match planned(comm, a, case, None)? {
            Some(x) => format!("auto:{x}"),
            None => "auto".into(),
        },
        Subject::Ferro(Some(Algorithm::Vendor)) | Subject::NcclDirect | Subject::Memcpy => name.into(),
        Subject::Ferro(Some(x)) => x.to_string(),
    })
}

/// The algorithm the planner runs the row's collective with, for `choice`.
fn planned<D: Device>(
    comm: &Communicator<D>,
    a: &Args,
    case: &Case,
    choice: Option<Algorithm>,
) -> Result<Option<Algorithm>> {
    let (planned, count) = case.coll.planned(case.n_in, comm.size());
    comm.planned_algorithm(planned, count, case.dtype, a.op, choice)
}

/// Elements whose bytes differ.
fn count_wrong(got: &[u8], want: &[u8], dtype: DType) -> usize {
    got.chunks(dtype.size())
        .zip(want.chunks(dtype.size()))
        .filter(|(g, w)| g != w)
        .count()
}

/// Blocks of 32 elements sampled from an output of `count`: up to 4096,
/// evenly spread, the last (maybe partial) one included.
fn sample_blocks(count: usize) -> Vec<usize> {
    let blocks = count.div_ceil(codec::BLOCK);
    let step = blocks.div_ceil(4096).max(1);
    let mut v: Vec<usize> = (0..blocks).step_by(step).collect();
    if v.last() != Some(&(blocks - 1)) {
        v.push(blocks - 1);
    }
    v
}

/// With Gaussian inputs: (#wrong on the sampled blocks against the
/// algorithm's own reference, or `None` for the vendor library; the relative
/// error against the fp64 sum on the same blocks).
fn check_samples<S: data::FromF64 + Half16>(
    seed: u64,
    world: usize,
    got: &[u8],
    algorithm: Option<Algorithm>,
) -> (Option<usize>, f64) {
    let got: Vec<S> = data::from_bytes(got);
    let count = got.len();
    let (mut wrong, mut num, mut den) = (0usize, 0.0f64, 0.0f64);
    let x = |r: usize, i: usize| S::from_f64(data::input_value(seed, r, i, ReduceOp::Sum, Values::Random));
    for k in sample_blocks(count) {
        let (lo, hi) = (k * codec::BLOCK, ((k + 1) * codec::BLOCK).min(count));
        let want: Vec<S> = match algorithm {
            Some(Algorithm::QuickReduce(c)) => {
                let ins: Vec<Vec<S>> = (0..world).map(|r| (lo..hi).map(|i| x(r, i)).collect()).collect();
                let refs: Vec<&[S]> = ins.iter().map(|v| v.as_slice()).collect();
                codec::reference_all_reduce::<S>(c, &refs)
            }
            _ => data::reference::<S>(seed, world, lo, hi - lo, ReduceOp::Sum, Values::Random),
        };
        wrong += got[lo..hi]
            .iter()
            .zip(&want)
            .filter(|(g, w)| Half16::to_bits(**g) != Half16::to_bits(**w))
            .count();
        for (i, g) in (lo..hi).zip(&got[lo..hi]) {
            let exact: f64 = (0..world).map(|r| x(r, i).to_f64()).sum();
            num += (g.to_f64() - exact).powi(2);
            den += exact.powi(2);
        }
    }
    let relerr = if den > 0.0 { (num / den).sqrt() } else { 0.0 };
    let comparable = algorithm != Some(Algorithm::Vendor);
    (comparable.then_some(wrong), relerr)
}

/// Gaussian inputs (`--quantization`) as bytes.
fn input_bytes<T: data::FromF64>(seed: u64, rank: usize, count: usize, op: ReduceOp, values: Values) -> Vec<u8> {
    data::to_bytes(&data::make_input::<T>(seed, rank, 0, count, op, values))
}
