//! Quick-reduce conformance, run by every backend from the conformance
//! suite: the all-reduce output must equal `codec::reference_all_reduce` bit
//! for bit (every codec, f16 and bf16, odd counts, in and out of place,
//! NaN/Inf/zero/equal/huge/tiny blocks, graph replays), the codec kernel's
//! encoded blocks must equal `codec::encode`'s bytes, and the error against
//! an fp64 sum must stay within the codec's bound.

use half::{bf16, f16};

use super::conformance::{context, Suite, POISON};
use super::data::{self, FromF64, Values};
use crate::algo::kernels::{qr_encode_name, QR_CODECS, QUICK_REDUCE};
use crate::algo::GridTable;
use crate::codec::{self, Codec, Fp8Flavor, Half16};
use crate::comm::{Call, Tensor};
use crate::device::{Device, DeviceBuffer, KernelParams};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::plan::Algorithm;

/// Element counts of the all-reduce matrix: sub-block, block edges, odd
/// counts, several blocks per GPU thread block, many thread blocks.
const QR_COUNTS: [usize; 8] = [1, 31, 33, 300, 1000, 4099, 65_541, 300_001];

/// Largest end-to-end relative L2 error allowed on Gaussian data (measured
/// at world 4 with the host reference: int4 0.121, int6 0.030, int8 0.008,
/// fp8 0.034, fp4 0.143; src/codec tests).
pub fn relative_error_bound(codec: Codec) -> f64 {
    match codec {
        Codec::Int4 => 0.16,
        Codec::Int6 => 0.045,
        Codec::Int8 => 0.012,
        Codec::Fp8(_) => 0.05,
        Codec::Fp4 => 0.19,
    }
}

/// Input of `rank` at element `i`: Gaussian, with special blocks early on
/// (when `special`): Inf and NaN blocks, a zero block, an all-equal block, a
/// block whose sum overflows the type, a tiny block (the scale underflows in
/// f16), negative zeros and tiny negatives, and exact rounding ties (of INT4
/// and of FP4).
pub fn qr_input_value(seed: u64, rank: usize, i: usize, special: bool, huge: f64) -> f64 {
    let gauss = data::input_value(seed, rank, i, ReduceOp::Sum, Values::Random);
    if !special {
        return gauss;
    }
    let alternate = if i % 2 == 0 { 1.0 } else { -1.0 };
    match (i / 32, i % 32) {
        (1, 8) if rank == 1 => f64::INFINITY,
        (2, 6) if rank == 0 => f64::NAN,
        (3, _) => 0.0,
        (4, _) => 3.0,
        (5, _) => huge * alternate,
        (6, k) => 1e-6 * (k as f64 - 16.0),
        (7, 0) => 1.0,
        (7, k) if k % 2 == 1 => -0.0,
        (7, _) => -1e-30,
        // absmax 8: scale -1 (INT4) and codes at half steps, which tie.
        (8, 0) => 8.0,
        (8, k) => (k as f64 - 16.0) + 0.5,
        // absmax 6: scale 1 (FP4) and the midpoints of the e2m1 grid, which tie.
        (9, 0) => 6.0,
        (9, k) => [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0][k % 7] * alternate,
        _ => gauss,
    }
}

/// The element type's largest value over the world size: summing it across
/// the ranks overflows.
fn huge_for(dtype: DType, world: usize) -> f64 {
    let max = match dtype {
        DType::F16 => 65504.0,
        _ => 3.389e38,
    };
    max / world as f64 * 1.5
}

fn inputs<S: FromF64>(seed: u64, world: usize, count: usize, special: bool) -> Vec<Vec<S>> {
    let huge = huge_for(S::DTYPE, world);
    (0..world)
        .map(|r| {
            (0..count)
                .map(|i| S::from_f64(qr_input_value(seed, r, i, special, huge)))
                .collect()
        })
        .collect()
}

/// ‖out − exact‖ / ‖exact‖ over the finite elements, with `exact` the fp64
/// sum of the inputs.
pub fn relative_error<S: FromF64>(inputs: &[Vec<S>], out: &[S]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, o) in out.iter().enumerate() {
        let exact: f64 = inputs.iter().map(|x| x[i].to_f64()).sum();
        let got = o.to_f64();
        if exact.is_finite() && got.is_finite() {
            num += (got - exact).powi(2);
            den += exact.powi(2);
        }
    }
    if den == 0.0 {
        0.0
    } else {
        (num / den).sqrt()
    }
}

impl<D: Device> Suite<'_, D> {
    /// The all-reduce matrix, the codec kernel, and graph replays.
    pub(super) fn quick_reduce(&mut self) -> Result<()> {
        for codec in QR_CODECS {
            // The largest count (many GPU thread blocks) is a volume case.
            for (k, count) in QR_COUNTS.into_iter().enumerate() {
                if !self.runs_size(count) {
                    continue;
                }
                let in_place = k % 3 == 1;
                self.qr_case::<f16>(codec, count, in_place, count >= 300)?;
                self.qr_case::<bf16>(codec, count, !in_place, count >= 300)?;
            }
            self.qr_encode_case::<f16>(codec)?;
            self.qr_encode_case::<bf16>(codec)?;
        }
        self.qr_graph_replay(Codec::Int4)?;
        self.qr_graph_replay(Codec::Fp8(Fp8Flavor::E4m3Fn))?;
        Ok(())
    }

    /// One quick-reduce all-reduce, checked against the reference bit for
    /// bit and (Gaussian data) against fp64 within the codec's bound.
    pub(super) fn qr_case<S: FromF64 + Half16>(
        &mut self,
        codec: Codec,
        count: usize,
        in_place: bool,
        special: bool,
    ) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let dtype = <S as Half16>::DTYPE;
        let bytes = count * 2;
        let algo = Algorithm::QuickReduce(codec);
        let case =
            format!("{algo} {dtype} count={count} in_place={in_place} special={special} world={world} rank={rank}");
        let seed = self.cfg.seed ^ data::hash_bytes(case.split(" rank=").next().unwrap_or("").as_bytes());
        let xs = inputs::<S>(seed, world, count, special);
        let want = self.qr_reference(codec, &xs);

        let inp = comm.alloc(bytes.max(1))?;
        let out = if in_place {
            None
        } else {
            Some(comm.alloc(bytes.max(1))?)
        };
        let dst = out.as_ref().unwrap_or(&inp);
        comm.device().memset(dst, 0, bytes.max(1), POISON, comm.stream())?;
        comm.write(&inp, 0, &data::to_bytes(&xs[rank]))?;
        let call = Call::new().algo(algo);
        comm.all_reduce_into(
            Tensor::view(&inp, dtype, 0, count)?,
            Tensor::view(dst, dtype, 0, count)?,
            ReduceOp::Sum,
            &call,
        )?
        .wait(Some(self.cfg.timeout))
        .map_err(|e| context(e, &case))?;
        let mut got = vec![0u8; bytes];
        comm.read(dst, 0, &mut got)?;
        if self.reference.spans_nodes {
            // NCCL/RCCL's sums make NaNs of their own bits: any NaN where
            // the reference has one is the right answer.
            let mut vals: Vec<S> = data::from_bytes(&got);
            for (g, w) in vals.iter_mut().zip(&want) {
                if g.to_f64().is_nan() && w.to_f64().is_nan() {
                    *g = *w;
                }
            }
            got = data::to_bytes(&vals);
        }
        self.check(&case, &got, &want)?;
        if !special && count >= 4099 {
            let err = relative_error(&xs, &data::from_bytes::<S>(&got));
            if err > relative_error_bound(codec) {
                self.fail(format!(
                    "{case}: relative error {err:.4} above the bound {}",
                    relative_error_bound(codec)
                ));
            }
        }
        Ok(())
    }

    /// What a quick-reduce all-reduce of `xs` (every rank's input) gives:
    /// the codec's reference on one node; across nodes exact sums in the
    /// levels' order (one rank a node: NCCL/RCCL's, which at world 2 is the
    /// one sum), whatever algorithm is asked.
    fn qr_reference<S: FromF64 + Half16>(&self, codec: Codec, xs: &[Vec<S>]) -> Vec<S> {
        if self.reference.spans_nodes {
            let order = &self.reference.all_reduce;
            let count = xs.first().map_or(0, Vec::len);
            return (0..count)
                .map(|i| order.combine::<S>(ReduceOp::Sum, |r| xs[r][i].to_acc()))
                .collect();
        }
        let refs: Vec<&[S]> = xs.iter().map(|x| x.as_slice()).collect();
        codec::reference_all_reduce::<S>(codec, &refs)
    }

    /// The codec kernel alone: its encoded bytes equal `codec::encode`'s.
    fn qr_encode_case<S: FromF64 + Half16>(&mut self, codec: Codec) -> Result<()> {
        let comm = self.comm;
        let dev = comm.device();
        let dtype = <S as Half16>::DTYPE;
        let count = 1000; // 31 whole blocks and a partial one
        let case = format!("encode {} {dtype} count={count} rank={}", codec.name(), comm.rank());
        let x = inputs::<S>(self.cfg.seed ^ 0xc0de, 2, count, true).swap_remove(1);
        let mut want = vec![0u8; codec.encoded_bytes(count)];
        codec::encode(codec, &x, &mut want)?;

        let module = dev.load_module(&QUICK_REDUCE)?;
        let inp = comm.alloc(count * 2)?;
        let out = comm.alloc(want.len())?;
        dev.memset(&out, 0, want.len(), POISON, comm.stream())?;
        comm.write(&inp, 0, &data::to_bytes(&x))?;
        let params = KernelParams {
            input: inp.ptr(),
            output: out.ptr(),
            count: count as u64,
            ..KernelParams::default()
        };
        let grid = GridTable::new(dev.facts())?.grid(crate::algo::kernels::KernelKind::QuickReduce, count * 2);
        dev.launch(&module, &qr_encode_name(codec, dtype), grid, &params, comm.stream())?;
        let mut got = vec![0u8; want.len()];
        comm.read(&out, 0, &mut got)?;
        self.report.collectives += 1;
        if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
            self.fail(format!(
                "{case}: encoded bytes differ from codec::encode first at byte {at} (got {:#04x}, want {:#04x})",
                got[at], want[at]
            ));
        }
        Ok(())
    }

    /// Capture one quick-reduce and replay it with fresh input each time.
    fn qr_graph_replay(&mut self, codec: Codec) -> Result<()> {
        let comm = self.comm;
        let dev = comm.device();
        let (rank, world) = (comm.rank(), comm.size());
        let count = 70_001;
        let algo = Algorithm::QuickReduce(codec);
        let (inp, out) = (comm.alloc(count * 2)?, comm.alloc(count * 2)?);
        let stream = dev.create_stream()?;
        let (ti, to) = (
            Tensor::view(&inp, DType::BF16, 0, count)?,
            Tensor::view(&out, DType::BF16, 0, count)?,
        );
        // Load the module outside the capture (the first call loads it).
        comm.all_reduce_into(ti, to, ReduceOp::Sum, &Call::new().algo(algo))?
            .wait(Some(self.cfg.timeout))?;
        comm.prepare()?;
        dev.begin_capture(&stream)?;
        let captured = comm.all_reduce_into(ti, to, ReduceOp::Sum, &Call::on(&stream).algo(algo));
        let graph = dev.end_capture(&stream)?;
        captured?;
        for replay in 0..self.cfg.graph_replays.min(20) {
            let case = format!("graph replay {replay} {algo} bf16 count={count} rank={rank}");
            let seed = self.cfg.seed ^ ((replay as u64 + 1) * 104_729);
            let xs = inputs::<bf16>(seed, world, count, false);
            let want = self.qr_reference(codec, &xs);
            dev.memset(&out, 0, count * 2, POISON, &stream)?;
            dev.copy_from_host(&inp, 0, &data::to_bytes(&xs[rank]), &stream)?;
            dev.launch_graph(&graph, &stream)?;
            let mut got = vec![0u8; count * 2];
            dev.copy_to_host(&out, 0, &mut got, &stream)
                .map_err(|e| context(e, &case))?;
            self.check(&case, &got, &want)?;
        }
        Ok(())
    }
}
