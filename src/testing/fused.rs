//! Fused all-reduce epilogues in the conformance suite (every backend): the
//! fused call's outputs must equal, bit for bit on every rank, a plain
//! unfused reference computed here step by step (all-reduce, residual add,
//! RMSNorm, quantization) in the fp32 order docs/protocol.md ("Fused
//! epilogues") defines; NaN/Inf/zero rows; graph replays; and every
//! validation error, raised before anything is launched.

use half::{bf16, f16};

use super::conformance::{context, Suite, POISON};
use super::data::{self, FromF64, Values};
use crate::algo::fused::{fp8_min_scale, int8_min_scale, FusedKind, FusionPattern, FP8_MAX, INT8_MAX};
use crate::algo::{AlgoChoice, Algorithm};
use crate::codec::{Fp8Flavor, Half16};
use crate::comm::{Call, Fusion, Tensor};
use crate::device::Device;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// What a fused call writes, as the unfused reference computes it.
#[derive(Debug, Clone)]
pub struct FusedExpect<S> {
    /// The all-reduce, rounded to the dtype.
    pub allreduce: Vec<S>,
    pub residual: Vec<S>,
    /// Norm patterns only.
    pub norm: Vec<S>,
    /// Quantizing patterns only: one byte per element (f8e4m3 or i8).
    pub quant: Vec<u8>,
    /// Per-token patterns only: one scale per row.
    pub scales: Vec<f32>,
}

/// Round to the dtype, nearest even; every NaN becomes the dtype's
/// canonical quiet NaN.
fn round<S: Half16>(x: f32) -> S {
    if x.is_nan() {
        S::from_bits(S::NAN_BITS)
    } else {
        S::from_f32(x)
    }
}

/// The stated order of the sum of squares of one row: 32 partials, pack `i`
/// (elements `8i..8i+8`, in order) added to partial `i % 32`, then the
/// butterfly `p[l] = p[l] + p[l ^ m]` for m = 16, 8, 4, 2, 1; the result is
/// `p[0]` (every partial is the same by then).
pub fn sum_of_squares(row: &[f32]) -> f32 {
    let mut p = [0f32; 32];
    for (i, pack) in row.chunks(8).enumerate() {
        for &x in pack {
            p[i % 32] += x * x;
        }
    }
    for m in [16, 8, 4, 2, 1] {
        let q = p;
        for l in 0..32 {
            p[l] = q[l] + q[l ^ m];
        }
    }
    p[0]
}

/// `rstd = 1 / sqrt(ss / hidden + eps)`, each step correctly rounded.
pub fn rstd(ss: f32, hidden: usize, eps: f32) -> f32 {
    1.0 / (ss / hidden as f32 + eps).sqrt()
}

/// FP8 e4m3fn of `v / scale` (nearest even, saturated to +-448, NaN 0x7f).
pub fn quant_fp8(v: f32, scale: f32) -> u8 {
    Fp8Flavor::E4m3Fn.encode(v / scale)
}

/// INT8 of `v / scale`: nearest even, clamped to +-127, NaN 0.
pub fn quant_int8(v: f32, scale: f32) -> u8 {
    let q = v / scale;
    if q.is_nan() {
        return 0;
    }
    (q.round_ties_even().clamp(-127.0, 127.0) as i8) as u8
}

/// The unfused reference: `inputs[r]` is rank `r`'s input (`tokens x
/// hidden`), `scale` the static FP8 scale (ignored by other patterns).
pub fn fused_reference<S: Half16>(
    pattern: FusionPattern,
    hidden: usize,
    eps: f32,
    inputs: &[Vec<S>],
    residual: &[S],
    weight: &[S],
    scale: f32,
) -> FusedExpect<S> {
    let n = residual.len();
    let tokens = n / hidden;
    // 1. The all-reduce: fp32 sum in rank order, rounded.
    let allreduce: Vec<S> = (0..n)
        .map(|i| {
            let mut acc = inputs[0][i].to_f32();
            for x in &inputs[1..] {
                acc += x[i].to_f32();
            }
            round(acc)
        })
        .collect();
    // 2. The residual add.
    let res: Vec<S> = (0..n)
        .map(|i| round(allreduce[i].to_f32() + residual[i].to_f32()))
        .collect();
    let mut out = FusedExpect {
        allreduce,
        residual: res,
        norm: Vec::new(),
        quant: Vec::new(),
        scales: Vec::new(),
    };
    if !pattern.norms() {
        return out;
    }
    // 3. RMSNorm, row by row: (x * rstd) * w, rounded.
    let w: Vec<f32> = weight.iter().map(|w| w.to_f32()).collect();
    for t in 0..tokens {
        let row: Vec<f32> = out.residual[t * hidden..(t + 1) * hidden]
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let r = rstd(sum_of_squares(&row), hidden, eps);
        out.norm.extend(row.iter().zip(&w).map(|(x, w)| round::<S>(x * r * w)));
    }
    // 4. Quantization of the normed values (as stored).
    let normed: Vec<f32> = out.norm.iter().map(|y| y.to_f32()).collect();
    match pattern {
        FusionPattern::ResidualRmsNormFp8 => out.quant = normed.iter().map(|&y| quant_fp8(y, scale)).collect(),
        FusionPattern::ResidualRmsNormFp8PerToken | FusionPattern::ResidualRmsNormInt8PerToken => {
            let int8 = pattern == FusionPattern::ResidualRmsNormInt8PerToken;
            for row in normed.chunks(hidden) {
                // The absolute maximum ignores NaN (fmaxf), from 0.
                let amax = row.iter().fold(0f32, |m, y| m.max(y.abs()));
                let s = if int8 {
                    (amax / INT8_MAX).max(int8_min_scale())
                } else {
                    (amax / FP8_MAX).max(fp8_min_scale())
                };
                out.scales.push(s);
                out.quant.extend(
                    row.iter()
                        .map(|&y| if int8 { quant_int8(y, s) } else { quant_fp8(y, s) }),
                );
            }
        }
        _ => {}
    }
    out
}

/// (tokens, hidden) of the matrix: single tokens to thousands, hidden from
/// one pack to 16384, 5008 (not a multiple of 256 lanes' worth of packs).
const SHAPES: [(usize, usize); 10] = [
    (1, 8),
    (2, 24),
    (7, 4096),
    (32, 5008),
    (129, 24),
    (1024, 8),
    (2, 16384),
    (1, 16384),
    (129, 4096),
    (4096, 24),
];

/// The `algo` hint that asks for a fused kernel family.
pub fn kind_algo(kind: FusedKind) -> AlgoChoice {
    AlgoChoice::Fixed(match kind {
        FusedKind::OneShot => Algorithm::OneShotPush,
        FusedKind::TwoShot => Algorithm::TwoShotPush,
    })
}

/// The per-tensor FP8 scale the static pattern is given: small enough that
/// the largest normed values saturate.
const STATIC_SCALE: f32 = 0.009;

/// Special rows: row 1 has a NaN in rank 1's input, row 2 an infinity in
/// the residual, row 3 is all zeros (with eps = 0 its rstd is infinite),
/// row 4 overflows the dtype in the all-reduce.
fn special_value(row: usize, col: usize, rank: usize, residual: bool, dtype: DType) -> Option<f64> {
    let max = if dtype == DType::F16 { 65504.0 } else { 3.0e38 };
    match (row, col, residual) {
        (1, 3, false) if rank == 1 => Some(f64::NAN),
        (2, 5, true) => Some(f64::NEG_INFINITY),
        (3, _, _) => Some(0.0),
        (4, 0, false) => Some(max),
        _ => None,
    }
}

#[derive(Clone, Copy)]
struct Case {
    kind: FusedKind,
    pattern: FusionPattern,
    tokens: usize,
    hidden: usize,
    eps: f32,
    in_place: bool,
    with_allreduce_out: bool,
    with_norm_out: bool,
    special: bool,
}

impl<D: Device> Suite<'_, D> {
    /// The fused matrix, special values, graph replays and validation.
    pub(super) fn fused(&mut self) -> Result<()> {
        let world = self.comm.size();
        for (k, &(tokens, hidden)) in SHAPES.iter().enumerate() {
            // The largest shapes repeat the same paths at a host cost that
            // grows with the world: at 8 ranks only with the full sweep.
            if world > 4 && tokens * hidden > 200_000 && !super::conformance::full_sweep() {
                continue;
            }
            for (j, pattern) in FusionPattern::ALL.into_iter().enumerate() {
                let case = Case {
                    kind: FusedKind::OneShot,
                    pattern,
                    tokens,
                    hidden,
                    eps: 1e-6,
                    in_place: (k + j) % 2 == 0,
                    with_allreduce_out: (k + j) % 3 == 0,
                    with_norm_out: pattern == FusionPattern::ResidualRmsNorm || (k + j) % 2 == 1,
                    special: false,
                };
                let flipped = Case {
                    in_place: !case.in_place,
                    with_allreduce_out: !case.with_allreduce_out,
                    ..case
                };
                for kind in FusedKind::ALL {
                    self.fused_case::<bf16>(&Case { kind, ..case })?;
                    self.fused_case::<f16>(&Case { kind, ..flipped })?;
                }
            }
        }
        for pattern in FusionPattern::ALL {
            for (tokens, hidden, eps) in [(7, 24, 1e-5), (5, 4096, 0.0)] {
                let case = Case {
                    kind: FusedKind::OneShot,
                    pattern,
                    tokens,
                    hidden,
                    eps,
                    in_place: false,
                    with_allreduce_out: true,
                    with_norm_out: pattern.norms(),
                    special: true,
                };
                for kind in FusedKind::ALL {
                    self.fused_case::<bf16>(&Case { kind, ..case })?;
                    self.fused_case::<f16>(&Case { kind, ..case })?;
                }
            }
        }
        self.fused_graph_replay()?;
        self.fused_validation()
    }

    /// One small, checked call of each fused kernel (every pattern, both
    /// families, bf16): the sanitizers' smoke run (`run_smoke`).
    pub(super) fn fused_smoke(&mut self) -> Result<()> {
        for pattern in FusionPattern::ALL {
            for kind in FusedKind::ALL {
                let case = Case {
                    kind,
                    pattern,
                    tokens: 7,
                    hidden: 264,
                    eps: 1e-6,
                    in_place: false,
                    with_allreduce_out: true,
                    with_norm_out: pattern.norms(),
                    special: false,
                };
                self.fused_case::<bf16>(&case)?;
            }
        }
        Ok(())
    }

    fn fused_case<S: FromF64 + Half16>(&mut self, c: &Case) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let dtype = <S as Half16>::DTYPE;
        let (tokens, hidden, pattern) = (c.tokens, c.hidden, c.pattern);
        let n = tokens * hidden;
        let name = format!(
            "fused {} {pattern} {dtype} {tokens}x{hidden} eps={} in_place={} ar_out={} norm_out={} special={} world={world}",
            c.kind.name(),
            c.eps,
            c.in_place,
            c.with_allreduce_out,
            c.with_norm_out,
            c.special
        );
        let case = format!("{name} rank={rank}");
        let seed = self.cfg.seed ^ data::hash_bytes(name.as_bytes());
        let value = |r: usize, i: usize, residual: bool| -> S {
            let special = c
                .special
                .then(|| special_value(i / hidden, i % hidden, r, residual, dtype));
            let v = special
                .flatten()
                .unwrap_or_else(|| data::input_value(seed ^ residual as u64, r, i, ReduceOp::Sum, Values::Random));
            <S as FromF64>::from_f64(v)
        };
        let inputs: Vec<Vec<S>> = (0..world)
            .map(|r| (0..n).map(|i| value(r, i, false)).collect())
            .collect();
        // The residual stream and the weight are the same on every rank (as
        // in tensor parallelism), so every rank's outputs agree.
        let residual: Vec<S> = (0..n).map(|i| value(usize::MAX, i, true)).collect();
        let weight: Vec<S> = (0..hidden)
            .map(|i| {
                <S as FromF64>::from_f64(1.0 + 0.25 * data::input_value(seed, 77, i, ReduceOp::Sum, Values::Random))
            })
            .collect();
        let want = fused_reference(pattern, hidden, c.eps, &inputs, &residual, &weight, STATIC_SCALE);

        // Buffers: 0 input, 1 residual in, 2 residual out, 3 weight, 4 norm
        // out, 5 quant out, 6 scale, 7 all-reduce out. Outputs poisoned.
        let es = dtype.size();
        self.put(0, 0, &data::to_bytes(&inputs[rank]))?;
        self.put(1, 0, &data::to_bytes(&residual))?;
        self.put(3, 0, &data::to_bytes(&weight))?;
        let input = self.view(0, 0, dtype, n, false)?;
        let residual_in = self.view(1, 0, dtype, n, false)?;
        let residual_out = if c.in_place {
            residual_in
        } else {
            self.view(2, 0, dtype, n, true)?
        };
        let mut f = Fusion::new(pattern, hidden, residual_in, residual_out);
        if pattern.norms() {
            f = f.with_norm(self.view(3, 0, dtype, hidden, false)?, c.eps);
            if c.with_norm_out {
                f = f.with_norm_out(self.view(4, 0, dtype, n, true)?);
            }
        }
        if let Some(qdt) = pattern.quant_dtype() {
            let quant = self.view(5, 0, qdt, n, true)?;
            let scale = if pattern.per_token() {
                self.view(6, 0, DType::F32, tokens, true)?
            } else {
                self.put(6, 0, &STATIC_SCALE.to_le_bytes())?;
                self.view(6, 0, DType::F32, 1, false)?
            };
            f = f.with_quant(quant, scale);
        }
        if c.with_allreduce_out {
            f = f.with_allreduce_out(self.view(7, 0, dtype, n, true)?);
        }
        comm.all_reduce_fused(input, &f, &Call::new().algo(kind_algo(c.kind)))?
            .wait(Some(self.cfg.timeout))
            .map_err(|e| context(e, &case))?;

        let out_slot = if c.in_place { 1 } else { 2 };
        let got = self.get(out_slot, 0, n * es)?;
        self.check(&format!("{case} residual_out"), &got, &want.residual)?;
        if c.with_allreduce_out {
            let got = self.get(7, 0, n * es)?;
            self.check(&format!("{case} allreduce_out"), &got, &want.allreduce)?;
        }
        if pattern.norms() && c.with_norm_out {
            let got = self.get(4, 0, n * es)?;
            self.check(&format!("{case} norm_out"), &got, &want.norm)?;
        }
        if pattern.quant_dtype().is_some() {
            let got = self.get(5, 0, n)?;
            self.check_bytes(&format!("{case} quant_out"), &got, &want.quant, true);
            if pattern.per_token() {
                let got = self.get(6, 0, tokens * 4)?;
                self.check(&format!("{case} scale"), &got, &want.scales)?;
            }
        }
        Ok(())
    }

    /// Capture one fused call (per-token FP8, all outputs) and one static
    /// FP8 call, then replay them with fresh input, residual and (static)
    /// scale each time: the scale is read on the device at run time.
    fn fused_graph_replay(&mut self) -> Result<()> {
        let comm = self.comm;
        let dev = comm.device();
        let (rank, world) = (comm.rank(), comm.size());
        let (tokens, hidden) = (9, 1024);
        let n = tokens * hidden;
        let stream = dev.create_stream()?;
        let runs = [
            (FusionPattern::ResidualRmsNormFp8PerToken, FusedKind::OneShot),
            (FusionPattern::ResidualRmsNormFp8, FusedKind::TwoShot),
            (FusionPattern::ResidualRmsNormInt8PerToken, FusedKind::TwoShot),
        ];
        for (pattern, kind) in runs {
            let call = Call::new().algo(kind_algo(kind));
            let qdt = pattern.quant_dtype().unwrap_or(DType::F8E4M3);
            let bufs = [n * 2, n * 2, n * 2, hidden * 2, n * 2, n, tokens * 4]
                .into_iter()
                .map(|b| comm.alloc(b))
                .collect::<Result<Vec<_>>>()?;
            let t = |k: usize, dt: DType, count: usize| Tensor::view(&bufs[k], dt, 0, count);
            let scales = if pattern.per_token() { tokens } else { 1 };
            let f = Fusion::new(pattern, hidden, t(1, DType::BF16, n)?, t(2, DType::BF16, n)?)
                .with_norm(t(3, DType::BF16, hidden)?, 1e-5)
                .with_norm_out(t(4, DType::BF16, n)?)
                .with_quant(t(5, qdt, n)?, t(6, DType::F32, scales)?);
            // The first call loads (GPUs: compiles) the module outside the capture.
            comm.all_reduce_fused(t(0, DType::BF16, n)?, &f, &call)?
                .wait(Some(self.cfg.timeout))?;
            comm.prepare()?;
            dev.begin_capture(&stream)?;
            let captured = comm.all_reduce_fused(t(0, DType::BF16, n)?, &f, &Call::on(&stream).algo(kind_algo(kind)));
            let graph = dev.end_capture(&stream)?;
            captured?;
            for replay in 0..self.cfg.graph_replays.min(8) {
                let case = format!(
                    "graph replay {replay} fused {} {pattern} bf16 {tokens}x{hidden} rank={rank}",
                    kind.name()
                );
                let seed = self.cfg.seed ^ ((replay as u64 + 1) * 15_485_863);
                let gen = |r: usize, k: usize| -> Vec<bf16> {
                    (0..k)
                        .map(|i| bf16::from_f64(data::input_value(seed, r, i, ReduceOp::Sum, Values::Random)))
                        .collect()
                };
                let inputs: Vec<Vec<bf16>> = (0..world).map(|r| gen(r, n)).collect();
                let residual = gen(100, n);
                let weight = gen(101, hidden);
                let scale = 0.004 * (replay + 1) as f32;
                let want = fused_reference(pattern, hidden, 1e-5, &inputs, &residual, &weight, scale);
                dev.memset(&bufs[2], 0, n * 2, POISON, &stream)?;
                dev.memset(&bufs[4], 0, n * 2, POISON, &stream)?;
                dev.memset(&bufs[5], 0, n, POISON, &stream)?;
                dev.copy_from_host(&bufs[0], 0, &data::to_bytes(&inputs[rank]), &stream)?;
                dev.copy_from_host(&bufs[1], 0, &data::to_bytes(&residual), &stream)?;
                dev.copy_from_host(&bufs[3], 0, &data::to_bytes(&weight), &stream)?;
                if !pattern.per_token() {
                    dev.copy_from_host(&bufs[6], 0, &scale.to_le_bytes(), &stream)?;
                }
                dev.launch_graph(&graph, &stream)?;
                let read = |k: usize, len: usize| -> Result<Vec<u8>> {
                    let mut got = vec![0u8; len];
                    dev.copy_to_host(&bufs[k], 0, &mut got, &stream)
                        .map_err(|e| context(e, &case))?;
                    Ok(got)
                };
                let (res, norm, quant) = (read(2, n * 2)?, read(4, n * 2)?, read(5, n)?);
                let sc = read(6, scales * 4)?;
                self.check(&format!("{case} residual_out"), &res, &want.residual)?;
                self.check(&format!("{case} norm_out"), &norm, &want.norm)?;
                self.check_bytes(&format!("{case} quant_out"), &quant, &want.quant, true);
                if pattern.per_token() {
                    self.check(&format!("{case} scale"), &sc, &want.scales)?;
                }
            }
        }
        Ok(())
    }

    /// Every validation error: refused with `InvalidArgument` before
    /// anything is queued (the poisoned outputs stay poisoned), and the
    /// communicator keeps working (the cases after these run on it).
    fn fused_validation(&mut self) -> Result<()> {
        let comm = self.comm;
        let (tokens, hidden) = (4usize, 64usize);
        let n = tokens * hidden;
        let bf = DType::BF16;
        let input = self.view(0, 0, bf, n, false)?;
        let res_in = self.view(1, 0, bf, n, false)?;
        let res_out = self.view(2, 0, bf, n, true)?;
        let weight = self.view(3, 0, bf, hidden, false)?;
        let norm = self.view(4, 0, bf, n, true)?;
        let q8 = self.view(5, 0, DType::F8E4M3, n, true)?;
        let qi8 = self.view(5, 0, DType::I8, n, true)?;
        let scales = self.view(6, 0, DType::F32, tokens, true)?;
        let one_scale = self.view(6, 0, DType::F32, 1, false)?;
        let ar_out = self.view(7, 0, bf, n, true)?;
        let misaligned = self.view(2, 2, bf, n, true)?;
        let f32_input = self.view(0, 0, DType::F32, n, false)?;
        let short = self.view(2, 0, bf, n - hidden, true)?;
        let f16_res = self.view(1, 0, DType::F16, n, false)?;
        let rms = |f: Fusion| f.with_norm(weight, 1e-6);
        use FusionPattern::*;
        let base = |p: FusionPattern| Fusion::new(p, hidden, res_in, res_out);
        let cases: Vec<(&str, Tensor, Fusion)> = vec![
            ("f32 input", f32_input, base(ResidualAdd)),
            (
                "hidden not a multiple of 8",
                input,
                Fusion {
                    hidden: 12,
                    ..base(ResidualAdd)
                },
            ),
            (
                "hidden 0",
                input,
                Fusion {
                    hidden: 0,
                    ..base(ResidualAdd)
                },
            ),
            (
                "hidden too large",
                input,
                Fusion {
                    hidden: 1 << 17,
                    ..base(ResidualAdd)
                },
            ),
            (
                "rows not whole",
                input,
                Fusion {
                    hidden: 24,
                    ..base(ResidualAdd)
                },
            ),
            (
                "residual_out short",
                input,
                Fusion::new(ResidualAdd, hidden, res_in, short),
            ),
            (
                "residual_in dtype",
                input,
                Fusion::new(ResidualAdd, hidden, f16_res, res_out),
            ),
            ("no weight", input, base(ResidualRmsNorm).with_norm_out(norm)),
            ("no norm_out", input, rms(base(ResidualRmsNorm))),
            (
                "weight size",
                input,
                base(ResidualRmsNorm).with_norm(ar_out, 1e-6).with_norm_out(norm),
            ),
            (
                "eps NaN",
                input,
                base(ResidualRmsNorm).with_norm(weight, f32::NAN).with_norm_out(norm),
            ),
            (
                "eps negative",
                input,
                base(ResidualRmsNorm).with_norm(weight, -1.0).with_norm_out(norm),
            ),
            ("no quant_out", input, rms(base(ResidualRmsNormFp8PerToken))),
            (
                "quant dtype",
                input,
                rms(base(ResidualRmsNormFp8PerToken)).with_quant(qi8, scales),
            ),
            (
                "int8 dtype",
                input,
                rms(base(ResidualRmsNormInt8PerToken)).with_quant(q8, scales),
            ),
            (
                "per-token scales",
                input,
                rms(base(ResidualRmsNormFp8PerToken)).with_quant(q8, one_scale),
            ),
            (
                "static scale",
                input,
                rms(base(ResidualRmsNormFp8)).with_quant(q8, scales),
            ),
            ("weight on res", input, rms(base(ResidualAdd))),
            (
                "quant on rms",
                input,
                rms(base(ResidualRmsNorm)).with_norm_out(norm).with_quant(q8, scales),
            ),
            (
                "misaligned",
                input,
                Fusion::new(ResidualAdd, hidden, res_in, misaligned),
            ),
            (
                "norm_out = residual_out",
                input,
                rms(base(ResidualRmsNorm)).with_norm_out(res_out),
            ),
            (
                "allreduce_out = residual_in",
                input,
                base(ResidualAdd).with_allreduce_out(res_in),
            ),
            (
                "residual_out = input",
                input,
                Fusion::new(ResidualAdd, hidden, res_in, input),
            ),
        ];
        let rank = comm.rank();
        for (what, inp, f) in cases {
            let case = format!("fused validation: {what} rank={rank}");
            self.report.collectives += 1;
            match comm.all_reduce_fused(inp, &f, &Call::new()) {
                Err(Error::InvalidArgument(m)) if m.contains("all_reduce_fused") => {}
                Err(e) => self.fail(format!("{case}: wrong error {e}")),
                Ok(w) => {
                    w.wait(Some(self.cfg.timeout))?;
                    self.fail(format!("{case}: accepted"));
                }
            }
        }
        // An all-reduce algorithm that has no fused kernel.
        let f = Fusion::new(FusionPattern::ResidualAdd, hidden, res_in, res_out);
        let call = Call::new().algo(AlgoChoice::Fixed(Algorithm::Ccl));
        self.report.collectives += 1;
        match comm.all_reduce_fused(input, &f, &call) {
            Err(Error::Unsupported(_)) => {}
            Err(e) => self.fail(format!("fused validation: algo ccl rank={rank}: wrong error {e}")),
            Ok(w) => {
                w.wait(Some(self.cfg.timeout))?;
                self.fail(format!("fused validation: algo ccl rank={rank}: accepted"));
            }
        }
        // Nothing ran: the outputs are still poison.
        for (slot, len) in [(2, n * 2), (4, n * 2), (5, n), (7, n * 2)] {
            let got = self.get(slot, 0, len)?;
            self.check_bytes(
                &format!("fused validation: slot {slot} untouched rank={rank}"),
                &got,
                &vec![POISON; len],
                true,
            );
        }
        Ok(())
    }
}

/// Only the fused part of the suite (matrix, special values, graph
/// replays, validation), e.g. for a quick run on one backend.
pub fn run_fused<D: Device>(
    comm: &crate::comm::Communicator<D>,
    cfg: &super::conformance::SuiteConfig,
) -> Result<super::conformance::SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    s.fused()?;
    Ok(s.report)
}

/// A fused case over several workspace chunks, and the error for a row
/// larger than the workspace, for a communicator made with 128 KiB slots
/// (so that 16384-element rows come 2 a chunk at world 3).
pub fn run_fused_chunked<D: Device>(
    comm: &crate::comm::Communicator<D>,
    cfg: &super::conformance::SuiteConfig,
) -> Result<super::conformance::SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    for pattern in [
        FusionPattern::ResidualRmsNormFp8PerToken,
        FusionPattern::ResidualRmsNormInt8PerToken,
    ] {
        for (k, (tokens, hidden)) in [(7, 16384), (43, 4096)].into_iter().enumerate() {
            let case = Case {
                kind: FusedKind::ALL[k % 2],
                pattern,
                tokens,
                hidden,
                eps: 1e-6,
                in_place: tokens == 7,
                with_allreduce_out: true,
                with_norm_out: true,
                special: false,
            };
            s.fused_case::<bf16>(&case)?;
            s.fused_case::<f16>(&Case {
                kind: FusedKind::ALL[(k + 1) % 2],
                ..case
            })?;
        }
    }
    let big = 1 << 16;
    let slot = comm.options().slot_bytes_for(comm.device().facts().backend);
    for kind in FusedKind::ALL {
        let rows = match kind {
            FusedKind::OneShot => crate::algo::fused::fused_rows_per_chunk(slot, comm.size(), big, 2),
            FusedKind::TwoShot => crate::algo::fused::fused_segment_rows(slot, comm.size(), big, 2),
        };
        if rows > 0 {
            continue;
        }
        let input = s.view(0, 0, DType::BF16, big, false)?;
        let r = s.view(1, 0, DType::BF16, big, false)?;
        let f = Fusion::new(FusionPattern::ResidualAdd, big, r, r);
        s.report.collectives += 1;
        let what = format!("a row too large for the {} workspace", kind.name());
        match comm.all_reduce_fused(input, &f, &Call::new().algo(kind_algo(kind))) {
            Err(Error::InvalidArgument(m)) if m.contains("does not fit") => {}
            Err(e) => s.fail(format!("{what}: wrong error {e}")),
            Ok(w) => {
                w.wait(Some(cfg.timeout))?;
                s.fail(format!("{what}: accepted"));
            }
        }
    }
    Ok(s.report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_of_squares_follows_the_lane_order() {
        // 8 elements: lane 0 only, sequential.
        let row = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        assert_eq!(sum_of_squares(&row), 204.0);
        // A value that a different order would lose: 2^24 then 1s.
        let mut row = vec![0f32; 8 * 33];
        row[0] = 4096.0; // 2^24 in lane 0
        row[8 * 32] = 1.0; // pack 32: lane 0 again, after 2^24: lost
        row[8] = 1.0; // pack 1: lane 1, combined by the butterfly: lost too
        assert_eq!(sum_of_squares(&row), 16_777_216.0);
    }

    #[test]
    fn quantizers() {
        assert_eq!(quant_fp8(448.0 * 3.0, 1.0), 0x7e);
        assert_eq!(quant_fp8(-1e9, 1.0), 0xfe);
        assert_eq!(quant_fp8(f32::NAN, 1.0), 0x7f);
        assert_eq!(quant_fp8(1.0, 0.5), 0x40); // 2.0
        assert_eq!(quant_int8(2.5, 1.0), 2);
        assert_eq!(quant_int8(-3.5, 1.0), (-4i8) as u8);
        assert_eq!(quant_int8(1e9, 1.0), 127);
        assert_eq!(quant_int8(f32::NEG_INFINITY, 1.0), (-127i8) as u8);
        assert_eq!(quant_int8(f32::NAN, 1.0), 0);
    }

    #[test]
    fn reference_of_a_zero_row_with_zero_eps_is_nan_then_quantized() {
        let inputs = vec![vec![bf16::ZERO; 8], vec![bf16::ZERO; 8]];
        let w = vec![bf16::ONE; 8];
        let e = fused_reference(
            FusionPattern::ResidualRmsNormFp8PerToken,
            8,
            0.0,
            &inputs,
            &[bf16::ZERO; 8],
            &w,
            1.0,
        );
        assert!(e.norm.iter().all(|y| y.to_bits() == 0x7fc0));
        assert_eq!(e.scales, vec![fp8_min_scale()]);
        assert!(e.quant.iter().all(|&q| q == 0x7f));
    }
}
