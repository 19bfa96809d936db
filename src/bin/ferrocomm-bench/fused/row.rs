//! One fused row, and what every row of the table shares: its inputs, its
//! buffers, the fused call timed, and its outputs checked bit for bit
//! against the unfused reference.

use ferrocomm::algo::fused::FusionPattern;
use ferrocomm::codec::Half16;
use ferrocomm::device::{BackendKind, Device};
use ferrocomm::testing::data::{self, FromF64, Values};
use ferrocomm::testing::fused::{fused_reference, FusedExpect};
use ferrocomm::{Algorithm, Call, Communicator, DType, Fusion, ReduceOp, Result, SfLayout, Tensor};

use crate::args::Args;
use crate::colls::with_algo;
use crate::timing::{median, time_samples, OPS_PER_SAMPLE};

/// The static FP8 scale of `rms_fp8` rows.
pub const STATIC_SCALE: f32 = 0.01;

/// The global scale of `rms_nvfp4` rows (FlashInfer's `448 * 6 / amax` for
/// an amax of 8).
pub const NVFP4_GLOBAL_SCALE: f32 = 336.0;
/// The layout buffers are sized for: the swizzled one, whose padded tiles
/// take at least the linear layout's bytes, so either fits.
pub const NVFP4_LAYOUT: SfLayout = SfLayout::Swizzled128x4;

/// The scale a pattern's buffer 6 starts with (static FP8: the scale;
/// NVFP4: the global scale).
pub fn given_scale(pattern: FusionPattern) -> f32 {
    if pattern.nvfp4() {
        NVFP4_GLOBAL_SCALE
    } else {
        STATIC_SCALE
    }
}

/// Where NVFP4's scale factors start in buffer 5, after the codes.
pub fn sf_offset(n: usize) -> usize {
    (n / 2).next_multiple_of(16)
}

/// The RMSNorm's epsilon.
pub const EPS: f32 = 1e-6;

/// What a row times: its pattern and tokens (of `--hidden`), the algorithm
/// choice of the fused call, the mode.
#[derive(Clone, Copy)]
pub struct RowSpec<'a> {
    pub pattern: FusionPattern,
    pub tokens: usize,
    pub choice: Option<Algorithm>,
    pub mode: &'a str,
    /// Where NVFP4 rows write their scale factors (`--sf-layout`).
    pub sf_layout: SfLayout,
}

/// A row's figures: median us per call, median CPU us per call, wrong outputs.
pub struct Sample {
    pub time: f64,
    pub cpu: f64,
    pub wrong: usize,
}

impl Sample {
    pub fn new((mut times, mut cpu): (Vec<f64>, Vec<f64>), wrong: usize) -> Sample {
        Sample {
            time: median(&mut times),
            cpu: median(&mut cpu),
            wrong,
        }
    }
}

/// `k` Gaussian values of rank `r`'s stream `seed`.
pub fn random<S: FromF64>(r: usize, k: usize, seed: u64) -> Vec<S> {
    (0..k)
        .map(|i| S::from_f64(data::input_value(seed, r, i, ReduceOp::Sum, Values::Random)))
        .collect()
}

/// The epilogue's own inputs: the residual and the norm's weight.
pub struct Epilogue<S> {
    pub residual: Vec<S>,
    pub weight: Vec<S>,
}

impl<S: FromF64 + Half16> Epilogue<S> {
    pub fn random(tokens: usize, hidden: usize) -> Self {
        Epilogue {
            residual: random(0, tokens * hidden, 2),
            weight: random(0, hidden, 3),
        }
    }

    /// Bytes of the epilogue's buffers (1 to 6 of [`Buffers`]; 5 holds a
    /// byte an element, or NVFP4's codes and then its scale factors).
    pub fn sizes(tokens: usize, hidden: usize) -> [usize; 6] {
        let (n, es) = (tokens * hidden, <S as Half16>::DTYPE.size());
        let quant = n.max(sf_offset(n) + NVFP4_LAYOUT.sf_bytes(tokens, hidden));
        [n * es, n * es, hidden * es, n * es, quant, tokens.max(1) * 4]
    }

    /// What the epilogue's buffers start with: residual, weight, scale.
    pub fn fill(&self, pattern: FusionPattern) -> [(usize, Vec<u8>); 3] {
        [
            (1, data::to_bytes(&self.residual)),
            (3, data::to_bytes(&self.weight)),
            (6, given_scale(pattern).to_le_bytes().to_vec()),
        ]
    }

    /// The fused call's outputs when the ranks all-reduce `inputs`.
    pub fn want(&self, pattern: FusionPattern, hidden: usize, inputs: &[Vec<S>]) -> FusedExpect<S> {
        let scale = given_scale(pattern);
        fused_reference(pattern, hidden, EPS, inputs, &self.residual, &self.weight, scale)
    }
}

/// Calls per timed sample: one on the host.
pub fn ops_per_sample(backend: BackendKind) -> usize {
    match backend {
        BackendKind::Host => 1,
        _ => OPS_PER_SAMPLE,
    }
}

/// A row's device buffers, and the stream its calls run on. By index: 0
/// the all-reduce's input; the epilogue's 1 residual in, 2 residual out, 3
/// weight, 4 norm out, 5 quant out, 6 scale; MoE rows add 7 indices, 8
/// router weights, 9 the shared expert and 10 the finalized rows (unfused).
pub struct Buffers<'c, D: Device> {
    pub comm: &'c Communicator<D>,
    bufs: Vec<D::Buffer>,
    pub stream: D::Stream,
}

impl<'c, D: Device> Buffers<'c, D> {
    /// Buffers of `sizes` bytes (at least 16 each), `fill` written at their
    /// starts and waited for; a stream of their own.
    pub fn new(comm: &'c Communicator<D>, sizes: &[usize], fill: &[(usize, Vec<u8>)]) -> Result<Self> {
        let bufs = sizes
            .iter()
            .map(|&b| comm.alloc(b.max(16)))
            .collect::<Result<Vec<_>>>()?;
        for (k, bytes) in fill {
            comm.write(&bufs[*k], 0, bytes)?;
        }
        comm.device().synchronize(comm.stream())?;
        let stream = comm.device().create_stream()?;
        Ok(Buffers { comm, bufs, stream })
    }

    /// Buffer `k` as `count` elements of `dtype`.
    pub fn t(&self, k: usize, dtype: DType, count: usize) -> Result<Tensor> {
        Tensor::view(&self.bufs[k], dtype, 0, count)
    }

    /// `count` elements of `dtype` at byte `offset` of buffer `k`.
    pub fn view(&self, k: usize, dtype: DType, offset: usize, count: usize) -> Result<Tensor> {
        Tensor::view(&self.bufs[k], dtype, offset, count)
    }

    /// The first `len` bytes of buffer `k`, after what the stream ran.
    pub fn read(&self, k: usize, len: usize) -> Result<Vec<u8>> {
        let mut got = vec![0u8; len];
        self.comm
            .device()
            .copy_to_host(&self.bufs[k], 0, &mut got, &self.stream)?;
        Ok(got)
    }

    /// The fused call of `f` on `input` timed on the stream (device and CPU
    /// us per call, a sample each); the outputs then hold the last call's.
    pub fn time_fused(&self, a: &Args, spec: &RowSpec<'_>, input: Tensor, f: &Fusion) -> Result<(Vec<f64>, Vec<f64>)> {
        let (comm, stream) = (self.comm, &self.stream);
        let run = || {
            comm.all_reduce_fused(input, f, &with_algo(Call::on(stream), spec.choice))
                .map(|_| ())
        };
        let ops = ops_per_sample(comm.device().facts().backend);
        time_samples(comm, a, spec.mode, stream, ops, |_| run())
    }

    /// The epilogue of `pattern` on buffers 1 to 6, out of place (so
    /// repeated calls see the same residual).
    pub fn fusion(&self, spec: &RowSpec<'_>, dtype: DType, hidden: usize) -> Result<Fusion> {
        let (pattern, tokens) = (spec.pattern, spec.tokens);
        let n = tokens * hidden;
        let mut f = Fusion::new(pattern, hidden, self.t(1, dtype, n)?, self.t(2, dtype, n)?);
        if pattern.norms() {
            f = f
                .with_norm(self.t(3, dtype, hidden)?, EPS)
                .with_norm_out(self.t(4, dtype, n)?);
        }
        if let Some(qdt) = pattern.quant_dtype() {
            let scales = if pattern.per_token() { tokens } else { 1 };
            f = f.with_quant(self.t(5, qdt, n)?, self.t(6, DType::F32, scales)?);
        }
        if pattern.nvfp4() {
            let sf = spec.sf_layout.sf_bytes(tokens, hidden);
            let sf = Tensor::view(&self.bufs[5], DType::U8, sf_offset(n), sf)?;
            f = f.with_nvfp4(
                self.t(5, DType::U8, n / 2)?,
                self.t(6, DType::F32, 1)?,
                sf,
                spec.sf_layout,
            );
        }
        Ok(f)
    }

    /// The fused call's outputs (residual, norm, quantized values, scales)
    /// that are not `want`'s, bit for bit.
    pub fn wrong_bits<S: Half16>(&self, spec: &RowSpec<'_>, hidden: usize, want: &FusedExpect<S>) -> Result<usize> {
        let (pattern, tokens) = (spec.pattern, spec.tokens);
        let n = tokens * hidden;
        let es = <S as Half16>::DTYPE.size();
        let mut wrong = usize::from(self.read(2, n * es)? != data::to_bytes(&want.residual));
        if pattern.norms() {
            wrong += usize::from(self.read(4, n * es)? != data::to_bytes(&want.norm));
        }
        if pattern.quant_dtype().is_some() {
            wrong += usize::from(self.read(5, n)? != want.quant);
        }
        if pattern.per_token() {
            wrong += usize::from(self.read(6, tokens * 4)? != data::to_bytes(&want.scales));
        }
        if pattern.nvfp4() {
            let got = self.read(5, sf_offset(n) + spec.sf_layout.sf_bytes(tokens, hidden))?;
            wrong += usize::from(got[..n / 2] != want.quant[..]);
            // The scale factors rows own (the swizzled padding is not written).
            let (sfs, cols) = (&got[sf_offset(n)..], hidden / 16);
            let sf_ok = (0..tokens * cols).all(|i| sfs[spec.sf_layout.offset(i / cols, i % cols, cols)] == want.sf[i]);
            wrong += usize::from(!sf_ok);
        }
        Ok(wrong)
    }
}

/// A fused row: every rank's Gaussian input, `tokens` rows of `--hidden`.
pub fn one<D: Device, S: FromF64 + Half16>(comm: &Communicator<D>, a: &Args, spec: &RowSpec<'_>) -> Result<Sample> {
    let (rank, world, hidden) = (comm.rank(), comm.size(), a.hidden);
    let (dtype, n) = (<S as Half16>::DTYPE, spec.tokens * hidden);
    let inputs: Vec<Vec<S>> = (0..world).map(|r| random(r, n, 1)).collect();
    let epilogue = Epilogue::<S>::random(spec.tokens, hidden);
    let sizes: Vec<usize> = std::iter::once(n * dtype.size())
        .chain(Epilogue::<S>::sizes(spec.tokens, hidden))
        .collect();
    let mut fill = vec![(0, data::to_bytes(&inputs[rank]))];
    fill.extend(epilogue.fill(spec.pattern));
    let bufs = Buffers::new(comm, &sizes, &fill)?;
    let f = bufs.fusion(spec, dtype, hidden)?;
    let times = bufs.time_fused(a, spec, bufs.t(0, dtype, n)?, &f)?;
    // The outputs of the last call against the unfused reference.
    let want = epilogue.want(spec.pattern, hidden, &inputs);
    Ok(Sample::new(times, bufs.wrong_bits(spec, hidden, &want)?))
}
