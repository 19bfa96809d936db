//! The sequence-parallel form of the fused epilogues in the conformance
//! suite (`Communicator::reduce_scatter_fused`): every pattern, both output
//! forms, both dtypes, NVFP4 in both scale-factor layouts, special values,
//! several workspace chunks, a graph replay and the validation errors. The
//! reference is the all-reduce form's unfused one ([`fused_reference`]) on
//! the same rows with the full residual (the ranks' shards concatenated):
//! docs/protocol.md, "Sequence-parallel form", states the two equal. Each
//! rank's shard outputs are compared with their rows of it, the gathered
//! outputs with all of it (and across ranks).

use half::{bf16, f16};

use super::conformance::{context, Suite, POISON};
use super::data::{self, FromF64, Values};
use super::fused::{fused_reference, special_value, FusedExpect, STATIC_SCALE};
use super::fused_nvfp4::{sf_in_layout, NVFP4_GLOBAL_SCALE};
use crate::algo::fused::{FusionPattern, SpOutput};
use crate::algo::nvfp4::{SfLayout, NVFP4_BLOCK};
use crate::codec::Half16;
use crate::comm::{Call, Fusion, MoeFinalize, Tensor};
use crate::device::Device;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::plan::Algorithm;

/// One sequence-parallel case: `shard` rows a rank (`tokens = shard *
/// world`).
#[derive(Clone, Copy)]
pub(super) struct SpCase {
    pub(super) out: SpOutput,
    pub(super) pattern: FusionPattern,
    pub(super) shard: usize,
    pub(super) hidden: usize,
    pub(super) eps: f32,
    pub(super) in_place: bool,
    pub(super) with_allreduce_out: bool,
    pub(super) with_norm_out: bool,
    pub(super) special: bool,
    pub(super) layout: SfLayout,
}

/// (rows a rank, hidden): one row to 64, hidden of 1 to 626 packs (an odd
/// count, below and above one 32-lane group's), and a wide row.
const SHAPES: [(usize, usize); 6] = [(1, 8), (3, 24), (5, 272), (17, 40), (2, 4096), (64, 5008)];

/// The rows of `v` (`width` a row) that shard `r` of `rows` rows owns.
fn rows_of<T: Clone>(v: &[T], r: usize, rows: usize, width: usize) -> Vec<T> {
    v[r * rows * width..(r + 1) * rows * width].to_vec()
}

/// The rows of an output of the reference (`width` a row) that rank `r`
/// writes: all of them gathered, its shard's otherwise.
fn out_rows<T: Clone>(v: &[T], gathered: bool, r: usize, shard: usize, width: usize) -> Vec<T> {
    if gathered {
        v.to_vec()
    } else {
        rows_of(v, r, shard, width)
    }
}

impl<D: Device> Suite<'_, D> {
    /// The sequence-parallel matrix, special values, a graph replay and
    /// validation.
    pub(super) fn fused_sp(&mut self) -> Result<()> {
        let world = self.comm.size();
        for (k, &(shard, hidden)) in SHAPES.iter().enumerate() {
            if !self.runs_size(shard * world * hidden) {
                continue;
            }
            for (j, pattern) in FusionPattern::ALL.into_iter().enumerate() {
                for out in SpOutput::ALL {
                    let case = SpCase {
                        out,
                        pattern,
                        shard,
                        hidden,
                        eps: 1e-6,
                        in_place: (k + j) % 2 == 0,
                        with_allreduce_out: (k + j) % 3 == 0,
                        with_norm_out: pattern == FusionPattern::ResidualRmsNorm || (k + j) % 2 == 1,
                        special: false,
                        layout: if (k + j) % 2 == 0 {
                            SfLayout::Swizzled128x4
                        } else {
                            SfLayout::Linear
                        },
                    };
                    self.fused_sp_case::<bf16>(&case)?;
                    self.fused_sp_case::<f16>(&SpCase {
                        in_place: !case.in_place,
                        with_allreduce_out: !case.with_allreduce_out,
                        layout: match case.layout {
                            SfLayout::Linear => SfLayout::Swizzled128x4,
                            SfLayout::Swizzled128x4 => SfLayout::Linear,
                        },
                        ..case
                    })?;
                }
            }
        }
        // Special rows (global rows 1-4: NaN, infinity, zeros with eps 0,
        // overflow), spread over the shards.
        for pattern in FusionPattern::ALL {
            for out in SpOutput::ALL {
                let case = SpCase {
                    out,
                    pattern,
                    shard: 5usize.div_ceil(world).max(3),
                    hidden: 48,
                    eps: 0.0,
                    in_place: false,
                    with_allreduce_out: true,
                    with_norm_out: pattern.norms(),
                    special: true,
                    layout: SfLayout::Swizzled128x4,
                };
                self.fused_sp_case::<bf16>(&case)?;
                self.fused_sp_case::<f16>(&SpCase { eps: 1e-5, ..case })?;
            }
        }
        self.fused_sp_graph_replay()?;
        self.fused_sp_validation()
    }

    /// One sequence-parallel call, checked bit for bit on every rank.
    pub(super) fn fused_sp_case<S: FromF64 + Half16>(&mut self, c: &SpCase) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let dtype = <S as Half16>::DTYPE;
        let (shard, hidden, pattern) = (c.shard, c.hidden, c.pattern);
        // Gathered ResidualAdd has nothing to gather (its validation);
        // NVFP4 takes whole 16-element blocks.
        if (c.out == SpOutput::Gathered && !pattern.norms()) || (pattern.nvfp4() && hidden % NVFP4_BLOCK != 0) {
            return Ok(());
        }
        let tokens = shard * world;
        let n = tokens * hidden;
        let ns = shard * hidden;
        let rows = match c.out {
            SpOutput::Gathered => tokens,
            SpOutput::Shard => shard,
        };
        let name = format!(
            "fused sp {} {pattern} {dtype} {tokens}x{hidden} eps={} in_place={} ar_out={} norm_out={} special={}{} \
             world={world}",
            c.out,
            c.eps,
            c.in_place,
            c.with_allreduce_out,
            c.with_norm_out,
            c.special,
            if pattern.nvfp4() {
                format!(" sf={}", c.layout)
            } else {
                String::new()
            }
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
        // The residual stream of all tokens: rank r holds its rows.
        let residual: Vec<S> = (0..n).map(|i| value(usize::MAX, i, true)).collect();
        let weight: Vec<S> = (0..hidden)
            .map(|i| {
                <S as FromF64>::from_f64(1.0 + 0.25 * data::input_value(seed, 77, i, ReduceOp::Sum, Values::Random))
            })
            .collect();
        let scale = if pattern.nvfp4() {
            NVFP4_GLOBAL_SCALE
        } else {
            STATIC_SCALE
        };
        let want = fused_reference(pattern, hidden, c.eps, &inputs, &residual, &weight, scale);

        // Buffers as the all-reduce cases: 0 input, 1 residual in (shard),
        // 2 residual out, 3 weight, 4 norm out, 5 quant out, 6 scale, 7
        // all-reduce out (shard), 11 scale factors. Outputs poisoned.
        let es = dtype.size();
        self.put(0, 0, &data::to_bytes(&inputs[rank]))?;
        let input = self.view(0, 0, dtype, n, false)?;
        self.put(1, 0, &data::to_bytes(&rows_of(&residual, rank, shard, hidden)))?;
        self.put(3, 0, &data::to_bytes(&weight))?;
        let residual_in = self.view(1, 0, dtype, ns, false)?;
        let residual_out = if c.in_place {
            residual_in
        } else {
            self.view(2, 0, dtype, ns, true)?
        };
        let mut f = Fusion::new(pattern, hidden, residual_in, residual_out).with_seq_parallel(c.out);
        if pattern.norms() {
            f = f.with_norm(self.view(3, 0, dtype, hidden, false)?, c.eps);
            if c.with_norm_out {
                f = f.with_norm_out(self.view(4, 0, dtype, rows * hidden, true)?);
            }
        }
        if let Some(qdt) = pattern.quant_dtype() {
            let quant = self.view(5, 0, qdt, rows * hidden, true)?;
            let scale = if pattern.per_token() {
                self.view(6, 0, DType::F32, rows, true)?
            } else {
                self.put(6, 0, &STATIC_SCALE.to_le_bytes())?;
                self.view(6, 0, DType::F32, 1, false)?
            };
            f = f.with_quant(quant, scale);
        }
        if pattern.nvfp4() {
            f = self.nvfp4_outputs(f, rows, hidden, c.layout)?;
        }
        if c.with_allreduce_out {
            f = f.with_allreduce_out(self.view(7, 0, dtype, ns, true)?);
        }
        comm.reduce_scatter_fused(input, &f, &Call::new())?
            .wait(Some(self.cfg.timeout))
            .map_err(|e| context(e, &case))?;

        // This rank's rows of the residual stream, and the rows of the
        // outputs (all of them gathered, ours as a shard).
        let mine = |v: &[S]| rows_of(v, rank, shard, hidden);
        let got = self.get(if c.in_place { 1 } else { 2 }, 0, ns * es)?;
        self.check_local(&format!("{case} residual_out"), &got, &mine(&want.residual))?;
        if c.with_allreduce_out {
            let got = self.get(7, 0, ns * es)?;
            self.check_local(&format!("{case} allreduce_out"), &got, &mine(&want.allreduce))?;
        }
        self.check_sp_outputs(&case, c, &want, rows)
    }

    /// The normed and quantized outputs of an SP case: every row of the
    /// reference (gathered: the same on every rank), or this rank's.
    fn check_sp_outputs<S: FromF64 + Half16>(
        &mut self,
        case: &str,
        c: &SpCase,
        want: &FusedExpect<S>,
        rows: usize,
    ) -> Result<()> {
        let (pattern, hidden, shard) = (c.pattern, c.hidden, c.shard);
        let rank = self.comm.rank();
        let gathered = c.out == SpOutput::Gathered;
        if pattern.norms() && c.with_norm_out {
            let got = self.get(4, 0, rows * hidden * 2)?;
            let norm = out_rows(&want.norm, gathered, rank, shard, hidden);
            let what = format!("{case} norm_out");
            if gathered {
                self.check(&what, &got, &norm)?;
            } else {
                self.check_local(&what, &got, &norm)?;
            }
        }
        if pattern.quant_dtype().is_some() {
            let got = self.get(5, 0, rows * hidden)?;
            let quant = out_rows(&want.quant, gathered, rank, shard, hidden);
            self.check_bytes(&format!("{case} quant_out"), &got, &quant, gathered);
            if pattern.per_token() {
                let got = self.get(6, 0, rows * 4)?;
                let scales = out_rows(&want.scales, gathered, rank, shard, 1);
                let what = format!("{case} scale");
                if gathered {
                    self.check(&what, &got, &scales)?;
                } else {
                    self.check_local(&what, &got, &scales)?;
                }
            }
        }
        if pattern.nvfp4() {
            let codes = out_rows(&want.quant, gathered, rank, shard, hidden / 2);
            let got = self.get(5, 0, codes.len())?;
            self.check_bytes(&format!("{case} quant_out"), &got, &codes, gathered);
            let sfs = out_rows(&want.sf, gathered, rank, shard, hidden / NVFP4_BLOCK);
            let laid = sf_in_layout(&sfs, rows, hidden, c.layout, POISON);
            let got = self.get(11, 0, laid.len())?;
            self.check_bytes(&format!("{case} sf_out ({})", c.layout), &got, &laid, gathered);
        }
        Ok(())
    }

    /// Capture one call of each form (gathered static FP8, whose scale is
    /// read at run time; a per-token INT8 shard), then replay them with
    /// fresh input, residual, weight and scale each time.
    fn fused_sp_graph_replay(&mut self) -> Result<()> {
        let comm = self.comm;
        let dev = comm.device();
        let (rank, world) = (comm.rank(), comm.size());
        let (shard, hidden) = (5usize, 1024usize);
        let tokens = shard * world;
        let (n, ns) = (tokens * hidden, shard * hidden);
        let stream = dev.create_stream()?;
        let runs = [
            (FusionPattern::ResidualRmsNormFp8, SpOutput::Gathered),
            (FusionPattern::ResidualRmsNormInt8PerToken, SpOutput::Shard),
        ];
        for (pattern, out) in runs {
            let rows = if out == SpOutput::Gathered { tokens } else { shard };
            let qdt = pattern.quant_dtype().unwrap_or(DType::F8E4M3);
            let bufs = [
                n * 2,
                ns * 2,
                ns * 2,
                hidden * 2,
                rows * hidden * 2,
                rows * hidden,
                rows * 4,
            ]
            .into_iter()
            .map(|b| comm.alloc(b))
            .collect::<Result<Vec<_>>>()?;
            let t = |k: usize, dt: DType, count: usize| Tensor::view(&bufs[k], dt, 0, count);
            let scales = if pattern.per_token() { rows } else { 1 };
            let f = Fusion::new(pattern, hidden, t(1, DType::BF16, ns)?, t(2, DType::BF16, ns)?)
                .with_norm(t(3, DType::BF16, hidden)?, 1e-5)
                .with_norm_out(t(4, DType::BF16, rows * hidden)?)
                .with_quant(t(5, qdt, rows * hidden)?, t(6, DType::F32, scales)?)
                .with_seq_parallel(out);
            // The first call loads (GPUs: compiles) the module outside the capture.
            comm.reduce_scatter_fused(t(0, DType::BF16, n)?, &f, &Call::new())?
                .wait(Some(self.cfg.timeout))?;
            comm.prepare()?;
            dev.begin_capture(&stream)?;
            let captured = comm.reduce_scatter_fused(t(0, DType::BF16, n)?, &f, &Call::on(&stream));
            let graph = dev.end_capture(&stream)?;
            captured?;
            for replay in 0..self.cfg.graph_replays.min(4) {
                let case = format!("graph replay {replay} fused sp {out} {pattern} bf16 {tokens}x{hidden} rank={rank}");
                let seed = self.cfg.seed ^ ((replay as u64 + 1) * 49_979_687);
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
                dev.memset(&bufs[2], 0, ns * 2, POISON, &stream)?;
                dev.memset(&bufs[4], 0, rows * hidden * 2, POISON, &stream)?;
                dev.memset(&bufs[5], 0, rows * hidden, POISON, &stream)?;
                dev.copy_from_host(&bufs[0], 0, &data::to_bytes(&inputs[rank]), &stream)?;
                let res_shard = rows_of(&residual, rank, shard, hidden);
                dev.copy_from_host(&bufs[1], 0, &data::to_bytes(&res_shard), &stream)?;
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
                let res = read(2, ns * 2)?;
                self.check_local(
                    &format!("{case} residual_out"),
                    &res,
                    &rows_of(&want.residual, rank, shard, hidden),
                )?;
                let gathered = out == SpOutput::Gathered;
                let (norm, quant, sc) = (
                    read(4, rows * hidden * 2)?,
                    read(5, rows * hidden)?,
                    read(6, scales * 4)?,
                );
                let want_norm = out_rows(&want.norm, gathered, rank, shard, hidden);
                if gathered {
                    self.check(&format!("{case} norm_out"), &norm, &want_norm)?;
                } else {
                    self.check_local(&format!("{case} norm_out"), &norm, &want_norm)?;
                }
                let want_quant = out_rows(&want.quant, gathered, rank, shard, hidden);
                self.check_bytes(&format!("{case} quant_out"), &quant, &want_quant, gathered);
                if pattern.per_token() {
                    let want_sc = out_rows(&want.scales, gathered, rank, shard, 1);
                    self.check_local(&format!("{case} scale"), &sc, &want_sc)?;
                }
            }
        }
        Ok(())
    }

    /// The sequence-parallel form's validation errors: refused before
    /// anything is queued (the poisoned outputs stay poisoned).
    fn fused_sp_validation(&mut self) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let (shard, hidden) = (2usize, 64usize);
        let tokens = shard * world;
        let (n, ns) = (tokens * hidden, shard * hidden);
        let bf = DType::BF16;
        let input = self.view(0, 0, bf, n, false)?;
        // One row more than whole shards.
        let ragged = self.view(0, 0, bf, n + hidden, false)?;
        let res_in = self.view(1, 0, bf, ns, false)?;
        let res_full = self.view(1, 0, bf, n, false)?;
        let res_out = self.view(2, 0, bf, ns, true)?;
        let res_out_full = self.view(2, 0, bf, n, true)?;
        let weight = self.view(3, 0, bf, hidden, false)?;
        let norm_all = self.view(4, 0, bf, n, true)?;
        let norm_shard = self.view(4, 0, bf, ns, true)?;
        let q8 = self.view(5, 0, DType::F8E4M3, n, true)?;
        let scales_shard = self.view(6, 0, DType::F32, shard, true)?;
        let ar_out_full = self.view(7, 0, bf, n, true)?;
        let idx = self.view(8, 0, DType::I32, ns, false)?;
        let moe_scales = self.view(9, 0, DType::F32, ns, false)?;
        let gathered = |p: FusionPattern| {
            Fusion::new(p, hidden, res_in, res_out)
                .with_norm(weight, 1e-6)
                .with_seq_parallel(SpOutput::Gathered)
        };
        let shard_rms = |p: FusionPattern| {
            Fusion::new(p, hidden, res_in, res_out)
                .with_norm(weight, 1e-6)
                .with_seq_parallel(SpOutput::Shard)
        };
        use FusionPattern::*;
        let input_rows = self.view(0, 0, bf, ns, false)?;
        let mut cases: Vec<(&str, Tensor, Fusion, &str)> = vec![
            (
                "full residual_in",
                input,
                Fusion::new(ResidualRmsNorm, hidden, res_full, res_out)
                    .with_norm(weight, 1e-6)
                    .with_norm_out(norm_all)
                    .with_seq_parallel(SpOutput::Gathered),
                "residual_in must be",
            ),
            (
                "full residual_out",
                input,
                Fusion::new(ResidualAdd, hidden, res_in, res_out_full).with_seq_parallel(SpOutput::Shard),
                "residual_out must be",
            ),
            (
                "shard norm_out gathered",
                input,
                gathered(ResidualRmsNorm).with_norm_out(norm_shard),
                "norm_out must be",
            ),
            (
                "gathered norm_out on a shard",
                input,
                shard_rms(ResidualRmsNorm).with_norm_out(norm_all),
                "norm_out must be",
            ),
            (
                "per-token scales of the shard, gathered",
                input,
                gathered(ResidualRmsNormFp8PerToken).with_quant(q8, scales_shard),
                "scale must be",
            ),
            (
                "full allreduce_out",
                input,
                shard_rms(ResidualRmsNorm)
                    .with_norm_out(norm_shard)
                    .with_allreduce_out(ar_out_full),
                "allreduce_out must be",
            ),
            (
                "gathered residual add",
                input,
                Fusion::new(ResidualAdd, hidden, res_in, res_out).with_seq_parallel(SpOutput::Gathered),
                "no normed rows to gather",
            ),
            (
                "MoE prologue",
                input,
                shard_rms(ResidualRmsNorm)
                    .with_norm_out(norm_shard)
                    .with_moe_finalize(MoeFinalize::new(idx, moe_scales, 1)),
                "no MoE-finalize prologue",
            ),
            (
                "allreduce_out in the input",
                input,
                shard_rms(ResidualRmsNorm)
                    .with_norm_out(norm_shard)
                    .with_allreduce_out(input_rows),
                "overlaps input",
            ),
        ];
        if world > 1 {
            cases.push((
                "tokens not a multiple of world",
                ragged,
                gathered(ResidualRmsNorm).with_norm_out(norm_all),
                "not a multiple of the world size",
            ));
        }
        for (what, inp, f, want) in cases {
            let case = format!("fused sp validation: {what} rank={rank}");
            self.report.collectives += 1;
            match comm.reduce_scatter_fused(inp, &f, &Call::new()) {
                Err(Error::InvalidArgument(m)) if m.contains("reduce_scatter_fused") && m.contains(want) => {}
                Err(e) => self.fail(format!("{case}: wrong error {e}")),
                Ok(w) => {
                    w.wait(Some(self.cfg.timeout))?;
                    self.fail(format!("{case}: accepted"));
                }
            }
        }
        // Each entry point refuses the other's form, and the SP kernel is
        // no one-shot.
        let sp = shard_rms(ResidualRmsNorm).with_norm_out(norm_shard);
        let ar = Fusion::new(ResidualAdd, hidden, res_full, res_out_full);
        let refusals = [
            (
                "all_reduce_fused of an SP fusion",
                comm.all_reduce_fused(input, &sp, &Call::new()),
            ),
            (
                "reduce_scatter_fused of an all-reduce fusion",
                comm.reduce_scatter_fused(input, &ar, &Call::new()),
            ),
            (
                "a one-shot algo",
                comm.reduce_scatter_fused(input, &sp, &Call::new().algo(Algorithm::OneShotPush)),
            ),
        ];
        for (what, r) in refusals {
            let case = format!("fused sp validation: {what} rank={rank}");
            self.report.collectives += 1;
            match r {
                Err(Error::InvalidArgument(_) | Error::Unsupported(_)) => {}
                Err(e) => self.fail(format!("{case}: wrong error {e}")),
                Ok(w) => {
                    w.wait(Some(self.cfg.timeout))?;
                    self.fail(format!("{case}: accepted"));
                }
            }
        }
        // Nothing ran: the outputs are still poison.
        self.check_poisoned("fused sp validation", &[(2, n * 2), (4, n * 2), (5, n), (7, n * 2)])?;
        Ok(())
    }
}

/// Only the sequence-parallel cases (matrix, special values, graph replay,
/// validation), e.g. for a quick run on one backend; the whole suite runs
/// them too.
pub fn run_fused_sp<D: Device>(
    comm: &crate::comm::Communicator<D>,
    cfg: &super::conformance::SuiteConfig,
) -> Result<super::conformance::SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    s.fused_sp()?;
    Ok(s.report)
}

/// SP cases over several workspace chunks, for a communicator made with
/// 128 KiB slots (`run_fused_chunked`): rows of 16384 come 2 an inbox at
/// world 2 and 1 at world 3, rows of 4096 8 and 5.
pub(super) fn sp_chunked<D: Device>(s: &mut Suite<'_, D>) -> Result<()> {
    for (k, pattern) in [
        FusionPattern::ResidualRmsNormFp8PerToken,
        FusionPattern::ResidualRmsNormInt8PerToken,
        FusionPattern::ResidualRmsNormNvfp4,
        FusionPattern::ResidualAdd,
    ]
    .into_iter()
    .enumerate()
    {
        for (j, (shard, hidden)) in [(5, 16384), (21, 4096)].into_iter().enumerate() {
            let case = SpCase {
                out: if (k + j) % 2 == 0 || !pattern.norms() {
                    SpOutput::Shard
                } else {
                    SpOutput::Gathered
                },
                pattern,
                shard,
                hidden,
                eps: 1e-6,
                in_place: j == 0,
                with_allreduce_out: true,
                with_norm_out: true,
                special: false,
                layout: if j == 0 {
                    SfLayout::Swizzled128x4
                } else {
                    SfLayout::Linear
                },
            };
            s.fused_sp_case::<bf16>(&case)?;
            let other = match case.out {
                SpOutput::Shard if pattern.norms() => SpOutput::Gathered,
                _ => SpOutput::Shard,
            };
            s.fused_sp_case::<f16>(&SpCase { out: other, ..case })?;
        }
    }
    Ok(())
}
