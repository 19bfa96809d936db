//! Fused all-reduce epilogues in the conformance suite (every backend): the
//! fused call's outputs must equal, bit for bit on every rank, a plain
//! unfused reference computed here step by step (all-reduce, residual add,
//! RMSNorm, quantization) in the fp32 order docs/protocol.md ("Fused
//! epilogues") defines; NaN/Inf/zero rows; graph replays; and every
//! validation error, raised before anything is launched. The MoE-finalize
//! prologue likewise: each rank's rows finalized step by step from its
//! expert outputs ([`moe_finalize_reference`]), then the same reference.

use half::{bf16, f16};

use super::conformance::{context, Suite, POISON};
use super::data::{self, FromF64, Values};
use super::fused_nvfp4::{case_layout, nvfp4_reference, sf_in_layout, NVFP4_GLOBAL_SCALE};
use super::fused_sp::SpCase;
use crate::algo::fused::{fp8_min_scale, int8_min_scale, FusedKind, FusionPattern, FP8_MAX, INT8_MAX};
use crate::algo::nvfp4::SfLayout;
use crate::codec::{Fp8Flavor, Half16};
use crate::comm::{Call, Fusion, MoeFinalize, SpOutput, Tensor};
use crate::device::Device;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::plan::Algorithm;

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
    /// NVFP4 only: the scale factors, row-major (`quant` holds the packed
    /// codes, two a byte).
    pub sf: Vec<u8>,
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
/// hidden`), `scale` the static FP8 scale or NVFP4's global scale (ignored
/// by other patterns). Its order: the all-reduce, the residual add, RMSNorm
/// (rounded), then the quantization of the normed values as stored.
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
        sf: Vec::new(),
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
        // 5. NVFP4: `scale` is the global scale.
        FusionPattern::ResidualRmsNormNvfp4 => (out.quant, out.sf) = nvfp4_reference(&normed, scale),
        _ => {}
    }
    out
}

/// One rank's MoE-finalized rows (`tokens x hidden`, `tokens =
/// idx.len() / topk`), in the stated order (docs/protocol.md, "MoE
/// finalize"): per element, `acc = shared` (or +0), then for k in order
/// `acc = acc + scale * expert`, the product rounded before the add, a
/// permuted index outside the experts' rows skipping its term; rounded to
/// the dtype once. `scales` are the router weights as f32 (a 16-bit
/// dtype's converted exactly).
pub fn moe_finalize_reference<S: Half16>(
    hidden: usize,
    topk: usize,
    expert_out: &[S],
    idx: &[i32],
    scales: &[f32],
    shared: Option<&[S]>,
) -> Vec<S> {
    let tokens = idx.len() / topk;
    let rows = expert_out.len() / hidden;
    let mut out = Vec::with_capacity(tokens * hidden);
    for t in 0..tokens {
        for j in 0..hidden {
            let mut acc = shared.map_or(0.0, |s| s[t * hidden + j].to_f32());
            for k in 0..topk {
                let r = idx[t * topk + k];
                if r < 0 || r as usize >= rows {
                    continue;
                }
                let p = scales[t * topk + k] * expert_out[r as usize * hidden + j].to_f32();
                acc += p;
            }
            out.push(round(acc));
        }
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
pub fn kind_algo(kind: FusedKind) -> Algorithm {
    match kind {
        FusedKind::OneShot => Algorithm::OneShotPush,
        FusedKind::OneShotLl => Algorithm::OneShotLl,
        // The SP kinds share the two-shot's data flow (and accept its hint).
        FusedKind::TwoShot | FusedKind::SpGather | FusedKind::SpShard => Algorithm::TwoShotPush,
    }
}

/// NVFP4's graph replays: its global scale is read on the device when the
/// kernel runs, so each replay writes a new one (the LL one-shot writes the
/// swizzled layout, the two-shot the linear one).
pub(super) const NVFP4_GRAPH_RUNS: [(FusionPattern, FusedKind); 2] = [
    (FusionPattern::ResidualRmsNormNvfp4, FusedKind::OneShotLl),
    (FusionPattern::ResidualRmsNormNvfp4, FusedKind::TwoShot),
];

/// The per-tensor FP8 scale the static pattern is given: small enough that
/// the largest normed values saturate.
pub(super) const STATIC_SCALE: f32 = 0.009;

/// Special rows: row 1 has a NaN in rank 1's input, row 2 an infinity in
/// the residual, row 3 is all zeros (with eps = 0 its rstd is infinite),
/// row 4 overflows the dtype in the all-reduce.
pub(super) fn special_value(row: usize, col: usize, rank: usize, residual: bool, dtype: DType) -> Option<f64> {
    let max = if dtype == DType::F16 { 65504.0 } else { 3.0e38 };
    match (row, col, residual) {
        (1, 3, false) if rank == 1 => Some(f64::NAN),
        (2, 5, true) => Some(f64::NEG_INFINITY),
        (3, _, _) => Some(0.0),
        (4, 0, false) => Some(max),
        _ => None,
    }
}

/// The router weights of a MoE case, as the device gets them.
enum MoeScales<S> {
    F32(Vec<f32>),
    Dtype(Vec<S>),
}

/// A MoE case's tensors: every rank's experts' output and shared expert's
/// output (the partial sums of tensor parallelism differ by rank), and the
/// routing, the same on every rank.
struct MoeData<S> {
    topk: usize,
    experts: Vec<Vec<S>>,
    shared: Option<Vec<Vec<S>>>,
    idx: Vec<i32>,
    scales: MoeScales<S>,
}

impl<S: Half16> MoeData<S> {
    /// The router weights as the stated order uses them (exact conversion).
    fn scales_f32(&self) -> Vec<f32> {
        match &self.scales {
            MoeScales::F32(v) => v.clone(),
            MoeScales::Dtype(v) => v.iter().map(|s| s.to_f32()).collect(),
        }
    }
}

/// `pairs` distinct rows of `0..rows` in a random order (a Fisher-Yates
/// shuffle seeded by `seed`): an `expanded_idx_to_permuted_idx` as a MoE
/// router's sort makes it.
pub fn moe_permutation(seed: u64, rows: usize, pairs: usize) -> Vec<i32> {
    let mut perm: Vec<i32> = (0..rows as i32).collect();
    for i in (1..rows).rev() {
        let j = (data::draw(seed ^ 0x7065, 0, i) % (i as u64 + 1)) as usize;
        perm.swap(i, j);
    }
    perm.truncate(pairs);
    perm
}

/// Generate a MoE case: `tokens * topk + MOE_SPARE_ROWS` expert rows, the
/// expanded indices a random permutation of them (so some rows are never
/// read), router weights around 0 (either sign: the kernel does not care).
/// `special` (tokens >= 5): token 0's odd-k indices out of range (-1,
/// `rows`, i32::MAX, i32::MIN in turn; with top-1 its only index is -1),
/// token 1 a NaN in rank 1's first expert row, token 2 an infinite weight,
/// token 3 an infinity in rank 0's shared row (or first expert row), token
/// 4 a weight at the dtype's largest finite value, so its row overflows.
fn moe_data<S: FromF64 + Half16>(
    seed: u64,
    world: usize,
    tokens: usize,
    hidden: usize,
    m: MoeCase,
    special: bool,
) -> MoeData<S> {
    let topk = m.topk;
    let pairs = tokens * topk;
    let rows = pairs + MOE_SPARE_ROWS;
    let gen = |salt: u64, r: usize, len: usize| -> Vec<S> {
        (0..len)
            .map(|i| <S as FromF64>::from_f64(data::input_value(seed ^ salt, r, i, ReduceOp::Sum, Values::Random)))
            .collect()
    };
    let mut experts: Vec<Vec<S>> = (0..world).map(|r| gen(0x6578, r, rows * hidden)).collect();
    let mut shared: Option<Vec<Vec<S>>> = m
        .shared
        .then(|| (0..world).map(|r| gen(0x7368, r, tokens * hidden)).collect());
    let mut idx = moe_permutation(seed, rows, pairs);
    let mut scales: Vec<f64> = (0..pairs)
        .map(|i| 0.5 * data::input_value(seed ^ 0x7363, 0, i, ReduceOp::Sum, Values::Random))
        .collect();
    if special && tokens >= 5 {
        let outside = [-1, rows as i32, i32::MAX, i32::MIN];
        if topk == 1 {
            idx[0] = -1;
        }
        for k in (1..topk).step_by(2) {
            idx[k] = outside[(k / 2) % outside.len()];
        }
        let row_of = |t: usize| idx[t * topk] as usize * hidden;
        if world > 1 {
            let at = row_of(1) + 3;
            experts[1][at] = <S as FromF64>::from_f64(f64::NAN);
        }
        scales[2 * topk + topk - 1] = f64::INFINITY;
        match shared.as_mut() {
            Some(sh) => sh[0][3 * hidden + 5] = <S as FromF64>::from_f64(f64::NEG_INFINITY),
            None => {
                let at = row_of(3) + 5;
                experts[0][at] = <S as FromF64>::from_f64(f64::INFINITY);
            }
        }
        scales[4 * topk] = if <S as Half16>::DTYPE == DType::F16 {
            65504.0
        } else {
            3.0e38
        };
    }
    let scales = if m.scales_f32 {
        MoeScales::F32(scales.iter().map(|&v| v as f32).collect())
    } else {
        MoeScales::Dtype(scales.iter().map(|&v| <S as FromF64>::from_f64(v)).collect())
    };
    MoeData {
        topk,
        experts,
        shared,
        idx,
        scales,
    }
}

#[derive(Clone, Copy)]
pub(super) struct Case {
    pub(super) kind: FusedKind,
    pub(super) pattern: FusionPattern,
    pub(super) tokens: usize,
    pub(super) hidden: usize,
    pub(super) eps: f32,
    pub(super) in_place: bool,
    pub(super) with_allreduce_out: bool,
    pub(super) with_norm_out: bool,
    pub(super) special: bool,
    /// The MoE-finalize prologue, when the case has one.
    pub(super) moe: Option<MoeCase>,
}

/// A MoE-finalize case's routing.
#[derive(Clone, Copy)]
pub(super) struct MoeCase {
    topk: usize,
    shared: bool,
    /// Router weights in f32 (else in the call's dtype).
    scales_f32: bool,
}

/// (tokens, hidden) of the MoE matrix: one token to 300, odd ones; hidden
/// of 1, 3, 5, 33 and 129 packs (odd multiples of 8, below and above one
/// 32-lane group's packs).
const MOE_SHAPES: [(usize, usize); 5] = [(1, 8), (5, 24), (33, 264), (300, 40), (64, 1032)];

/// Top-k values of the MoE matrix.
const MOE_TOPK: [usize; 3] = [1, 2, 8];

/// Experts' rows beyond `tokens * topk` (rows no token routes to).
const MOE_SPARE_ROWS: usize = 3;

impl<D: Device> Suite<'_, D> {
    /// The fused matrix, special values, graph replays and validation.
    pub(super) fn fused(&mut self) -> Result<()> {
        for (k, &(tokens, hidden)) in SHAPES.iter().enumerate() {
            // The largest shapes are volume cases.
            if !self.runs_size(tokens * hidden) {
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
                    moe: None,
                };
                let flipped = Case {
                    in_place: !case.in_place,
                    with_allreduce_out: !case.with_allreduce_out,
                    ..case
                };
                for kind in FusedKind::ALL_REDUCE {
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
                    moe: None,
                };
                for kind in FusedKind::ALL_REDUCE {
                    self.fused_case::<bf16>(&Case { kind, ..case })?;
                    self.fused_case::<f16>(&Case { kind, ..case })?;
                }
            }
        }
        self.fused_graph_replay()?;
        self.fused_validation()?;
        self.fused_nvfp4()?;
        self.fused_sp()?;
        self.fused_moe()
    }

    /// The MoE-finalize matrix (every dtype, top-k 1, 2 and 8, with and
    /// without a shared expert, f32 and 16-bit router weights, both
    /// families, every pattern in turn), its special values, a graph
    /// replay and its validation errors.
    fn fused_moe(&mut self) -> Result<()> {
        for (k, &(tokens, hidden)) in MOE_SHAPES.iter().enumerate() {
            // The largest shape is a volume case.
            if !self.runs_size(tokens * hidden) {
                continue;
            }
            for (i, &topk) in MOE_TOPK.iter().enumerate() {
                for shared in [false, true] {
                    // Every pattern in turn, the optional outputs alternating.
                    let j = k + i + shared as usize;
                    let pattern = FusionPattern::ALL[j % FusionPattern::ALL.len()];
                    let case = Case {
                        kind: FusedKind::OneShot,
                        pattern,
                        tokens,
                        hidden,
                        eps: 1e-6,
                        in_place: j % 2 == 0,
                        with_allreduce_out: j % 3 == 0,
                        with_norm_out: pattern.norms() && (pattern == FusionPattern::ResidualRmsNorm || j % 2 == 1),
                        special: false,
                        moe: Some(MoeCase {
                            topk,
                            shared,
                            scales_f32: (k + i) % 2 == 0,
                        }),
                    };
                    let flipped = Case {
                        in_place: !case.in_place,
                        with_allreduce_out: !case.with_allreduce_out,
                        moe: case.moe.map(|m| MoeCase {
                            scales_f32: !m.scales_f32,
                            ..m
                        }),
                        ..case
                    };
                    for kind in FusedKind::ALL_REDUCE {
                        self.fused_case::<bf16>(&Case { kind, ..case })?;
                        self.fused_case::<f16>(&Case { kind, ..flipped })?;
                    }
                }
            }
        }
        for pattern in FusionPattern::ALL {
            for (tokens, hidden, topk, shared, eps) in
                [(7, 24, 2, true, 1e-5), (6, 264, 8, false, 1e-6), (5, 16, 1, true, 0.0)]
            {
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
                    moe: Some(MoeCase {
                        topk,
                        shared,
                        scales_f32: topk != 8,
                    }),
                };
                for kind in FusedKind::ALL_REDUCE {
                    self.fused_case::<bf16>(&Case { kind, ..case })?;
                    self.fused_case::<f16>(&Case { kind, ..case })?;
                }
            }
        }
        self.fused_moe_graph_replay()?;
        self.fused_moe_validation()
    }

    /// Buffers `(slot, bytes)` still hold only poison (a refused call wrote
    /// nothing).
    pub(super) fn check_poisoned(&mut self, what: &str, slots: &[(usize, usize)]) -> Result<()> {
        let rank = self.comm.rank();
        for &(slot, len) in slots {
            let got = self.get(slot, 0, len)?;
            self.check_bytes(
                &format!("{what}: slot {slot} untouched rank={rank}"),
                &got,
                &vec![POISON; len],
                true,
            );
        }
        Ok(())
    }

    /// One small, checked call of each fused kernel (every pattern, every
    /// kind, both sequence-parallel forms, bf16): the sanitizers' smoke run
    /// (`run_smoke`).
    pub(super) fn fused_smoke(&mut self) -> Result<()> {
        for pattern in FusionPattern::ALL {
            for kind in FusedKind::ALL_REDUCE {
                let case = Case {
                    kind,
                    pattern,
                    tokens: 7,
                    // NVFP4 takes whole 16-element blocks.
                    hidden: if pattern.nvfp4() { 272 } else { 264 },
                    eps: 1e-6,
                    in_place: false,
                    with_allreduce_out: true,
                    with_norm_out: pattern.norms(),
                    special: false,
                    moe: None,
                };
                self.fused_case::<bf16>(&case)?;
                if pattern == FusionPattern::ResidualRmsNorm {
                    let moe = Some(MoeCase {
                        topk: 8,
                        shared: true,
                        scales_f32: true,
                    });
                    self.fused_case::<bf16>(&Case { moe, ..case })?;
                }
            }
            for out in SpOutput::ALL {
                self.fused_sp_case::<bf16>(&SpCase {
                    out,
                    pattern,
                    shard: 3,
                    hidden: if pattern.nvfp4() { 272 } else { 264 },
                    eps: 1e-6,
                    in_place: false,
                    with_allreduce_out: true,
                    with_norm_out: pattern.norms(),
                    special: false,
                    layout: SfLayout::Swizzled128x4,
                })?;
            }
        }
        Ok(())
    }

    pub(super) fn fused_case<S: FromF64 + Half16>(&mut self, c: &Case) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let dtype = <S as Half16>::DTYPE;
        let (tokens, hidden, pattern) = (c.tokens, c.hidden, c.pattern);
        let n = tokens * hidden;
        // The LL one-shot carries a call in one epoch: larger ones are
        // refused (checked in `run_fused_chunked`), not run.
        let slot = comm.options().slot_bytes_for(comm.device().facts().backend);
        // NVFP4 takes whole 16-element blocks (other rows: its validation).
        if pattern.nvfp4() && hidden % 16 != 0 {
            return Ok(());
        }
        if c.kind == FusedKind::OneShotLl && tokens > crate::algo::fused::fused_ll_rows(slot, world, hidden, 2) {
            return Ok(());
        }
        let moe_name = c.moe.map_or(String::new(), |m| {
            format!(
                " moe topk={} shared={} scales={}",
                m.topk,
                m.shared,
                if m.scales_f32 { "f32" } else { dtype.name() }
            )
        });
        let name = format!(
            "fused {} {pattern} {dtype} {tokens}x{hidden} eps={} in_place={} ar_out={} norm_out={} special={}{moe_name} world={world}",
            c.kind.name(),
            c.eps,
            c.in_place,
            c.with_allreduce_out,
            c.with_norm_out,
            c.special
        );
        let layout = case_layout(c);
        let name = if pattern.nvfp4() {
            format!("{name} sf={layout}")
        } else {
            name
        };
        let case = format!("{name} rank={rank}");
        let seed = self.cfg.seed ^ data::hash_bytes(name.as_bytes());
        let value = |r: usize, i: usize, residual: bool| -> S {
            // With a MoE prologue the special values are in its routing
            // ([`moe_data`]); the residual keeps its own.
            let special = (c.special && (residual || c.moe.is_none()))
                .then(|| special_value(i / hidden, i % hidden, r, residual, dtype));
            let v = special
                .flatten()
                .unwrap_or_else(|| data::input_value(seed ^ residual as u64, r, i, ReduceOp::Sum, Values::Random));
            <S as FromF64>::from_f64(v)
        };
        // What each rank all-reduces, and (MoE) what it is computed from.
        let moe = c.moe.map(|m| moe_data::<S>(seed, world, tokens, hidden, m, c.special));
        let inputs: Vec<Vec<S>> = match &moe {
            None => (0..world)
                .map(|r| (0..n).map(|i| value(r, i, false)).collect())
                .collect(),
            Some(d) => (0..world)
                .map(|r| {
                    moe_finalize_reference(
                        hidden,
                        d.topk,
                        &d.experts[r],
                        &d.idx,
                        &d.scales_f32(),
                        d.shared.as_ref().map(|s| s[r].as_slice()),
                    )
                })
                .collect(),
        };
        // The residual stream and the weight are the same on every rank (as
        // in tensor parallelism), so every rank's outputs agree.
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

        // Buffers: 0 input, 1 residual in, 2 residual out, 3 weight, 4 norm
        // out, 5 quant out, 6 scale, 7 all-reduce out; MoE: 0 the experts'
        // output, 8 the permuted indices, 9 the router weights, 10 the
        // shared expert's output. Outputs poisoned.
        let es = dtype.size();
        let input = match &moe {
            None => {
                self.put(0, 0, &data::to_bytes(&inputs[rank]))?;
                self.view(0, 0, dtype, n, false)?
            }
            Some(d) => {
                self.put(0, 0, &data::to_bytes(&d.experts[rank]))?;
                self.view(0, 0, dtype, d.experts[rank].len(), false)?
            }
        };
        self.put(1, 0, &data::to_bytes(&residual))?;
        self.put(3, 0, &data::to_bytes(&weight))?;
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
        if pattern.nvfp4() {
            f = self.nvfp4_outputs(f, tokens, hidden, layout)?;
        }
        if c.with_allreduce_out {
            f = f.with_allreduce_out(self.view(7, 0, dtype, n, true)?);
        }
        if let Some(d) = &moe {
            self.put(8, 0, &data::to_bytes(&d.idx))?;
            let pairs = d.idx.len();
            let idx = self.view(8, 0, DType::I32, pairs, false)?;
            let scales = match &d.scales {
                MoeScales::F32(v) => {
                    self.put(9, 0, &data::to_bytes(v))?;
                    self.view(9, 0, DType::F32, pairs, false)?
                }
                MoeScales::Dtype(v) => {
                    self.put(9, 0, &data::to_bytes(v))?;
                    self.view(9, 0, dtype, pairs, false)?
                }
            };
            let mut m = MoeFinalize::new(idx, scales, d.topk);
            if let Some(sh) = &d.shared {
                self.put(10, 0, &data::to_bytes(&sh[rank]))?;
                m = m.with_shared_expert_output(self.view(10, 0, dtype, n, false)?);
            }
            f = f.with_moe_finalize(m);
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
        if pattern.nvfp4() {
            self.check_nvfp4(&case, &want.quant, &want.sf, tokens, hidden, layout)?;
        }
        Ok(())
    }

    /// Capture fused calls (per-token FP8 and INT8, static FP8) and replay
    /// them with fresh input, residual and (static) scale each time: the
    /// scale is read on the device at run time. NVFP4's replays are its
    /// cases' ([`NVFP4_GRAPH_RUNS`]).
    fn fused_graph_replay(&mut self) -> Result<()> {
        self.fused_graph_replay_of(&[
            (FusionPattern::ResidualRmsNormFp8PerToken, FusedKind::OneShot),
            (FusionPattern::ResidualRmsNormFp8, FusedKind::TwoShot),
            (FusionPattern::ResidualRmsNormFp8, FusedKind::OneShotLl),
            (FusionPattern::ResidualRmsNormInt8PerToken, FusedKind::TwoShot),
        ])
    }

    /// The graph replays of `runs` (see [`Suite::fused_graph_replay`]).
    pub(super) fn fused_graph_replay_of(&mut self, runs: &[(FusionPattern, FusedKind)]) -> Result<()> {
        let comm = self.comm;
        let dev = comm.device();
        let (rank, world) = (comm.rank(), comm.size());
        let (tokens, hidden) = (9, 1024);
        let n = tokens * hidden;
        let stream = dev.create_stream()?;
        for &(pattern, kind) in runs {
            let call = Call::new().algo(kind_algo(kind));
            let qdt = pattern.quant_dtype().unwrap_or(DType::F8E4M3);
            let layout = if kind == FusedKind::TwoShot {
                SfLayout::Linear
            } else {
                SfLayout::Swizzled128x4
            };
            let sf_bytes = layout.sf_bytes(tokens, hidden);
            let bufs = [n * 2, n * 2, n * 2, hidden * 2, n * 2, n, tokens * 4, sf_bytes]
                .into_iter()
                .map(|b| comm.alloc(b))
                .collect::<Result<Vec<_>>>()?;
            let t = |k: usize, dt: DType, count: usize| Tensor::view(&bufs[k], dt, 0, count);
            let scales = if pattern.per_token() { tokens } else { 1 };
            let f = Fusion::new(pattern, hidden, t(1, DType::BF16, n)?, t(2, DType::BF16, n)?)
                .with_norm(t(3, DType::BF16, hidden)?, 1e-5)
                .with_norm_out(t(4, DType::BF16, n)?);
            let quant_len = if pattern.nvfp4() { n / 2 } else { n };
            let f = if pattern.nvfp4() {
                f.with_nvfp4(
                    t(5, DType::U8, quant_len)?,
                    t(6, DType::F32, 1)?,
                    t(7, DType::F8E4M3, sf_bytes)?,
                    layout,
                )
            } else {
                f.with_quant(t(5, qdt, n)?, t(6, DType::F32, scales)?)
            };
            if pattern.nvfp4() {
                dev.copy_from_host(&bufs[6], 0, &NVFP4_GLOBAL_SCALE.to_le_bytes(), &stream)?;
            }
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
                let scale = if pattern.nvfp4() {
                    NVFP4_GLOBAL_SCALE / (replay + 1) as f32
                } else {
                    0.004 * (replay + 1) as f32
                };
                let want = fused_reference(pattern, hidden, 1e-5, &inputs, &residual, &weight, scale);
                dev.memset(&bufs[2], 0, n * 2, POISON, &stream)?;
                dev.memset(&bufs[4], 0, n * 2, POISON, &stream)?;
                dev.memset(&bufs[5], 0, n, POISON, &stream)?;
                dev.memset(&bufs[7], 0, sf_bytes, POISON, &stream)?;
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
                let (res, norm, quant) = (read(2, n * 2)?, read(4, n * 2)?, read(5, quant_len)?);
                let sc = read(6, scales * 4)?;
                self.check(&format!("{case} residual_out"), &res, &want.residual)?;
                self.check(&format!("{case} norm_out"), &norm, &want.norm)?;
                self.check_bytes(&format!("{case} quant_out"), &quant, &want.quant, true);
                if pattern.nvfp4() {
                    let sf_want = sf_in_layout(&want.sf, tokens, hidden, layout, POISON);
                    self.check_bytes(
                        &format!("{case} sf_out ({layout})"),
                        &read(7, sf_bytes)?,
                        &sf_want,
                        true,
                    );
                }
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
        let call = Call::new().algo(Algorithm::Vendor);
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
        self.check_poisoned("fused validation", &[(2, n * 2), (4, n * 2), (5, n), (7, n * 2)])?;
        Ok(())
    }
}

impl<D: Device> Suite<'_, D> {
    /// Capture one MoE-finalize call per family (RMSNorm, top-4, shared
    /// expert, f32 weights), then replay it with fresh expert rows,
    /// routing, weights and residual each time: the prologue reads its
    /// indices and weights on the device at run time.
    fn fused_moe_graph_replay(&mut self) -> Result<()> {
        let comm = self.comm;
        let dev = comm.device();
        let (rank, world) = (comm.rank(), comm.size());
        let (tokens, hidden, topk) = (9usize, 1024usize, 4usize);
        let n = tokens * hidden;
        let pairs = tokens * topk;
        let rows = pairs + MOE_SPARE_ROWS;
        let stream = dev.create_stream()?;
        let routing = MoeCase {
            topk,
            shared: true,
            scales_f32: true,
        };
        for kind in FusedKind::ALL_REDUCE {
            let call = Call::new().algo(kind_algo(kind));
            let bufs = [
                rows * hidden * 2,
                n * 2,
                n * 2,
                hidden * 2,
                n * 2,
                pairs * 4,
                pairs * 4,
                n * 2,
            ]
            .into_iter()
            .map(|b| comm.alloc(b))
            .collect::<Result<Vec<_>>>()?;
            let t = |k: usize, dt: DType, count: usize| Tensor::view(&bufs[k], dt, 0, count);
            let bf = DType::BF16;
            let moe = MoeFinalize::new(t(5, DType::I32, pairs)?, t(6, DType::F32, pairs)?, topk)
                .with_shared_expert_output(t(7, bf, n)?);
            let f = Fusion::new(FusionPattern::ResidualRmsNorm, hidden, t(1, bf, n)?, t(2, bf, n)?)
                .with_norm(t(3, bf, hidden)?, 1e-5)
                .with_norm_out(t(4, bf, n)?)
                .with_moe_finalize(moe);
            let input = t(0, bf, rows * hidden)?;
            // The first call loads (GPUs: compiles) the kernel outside the capture.
            comm.all_reduce_fused(input, &f, &call)?.wait(Some(self.cfg.timeout))?;
            comm.prepare()?;
            dev.begin_capture(&stream)?;
            let captured = comm.all_reduce_fused(input, &f, &Call::on(&stream).algo(kind_algo(kind)));
            let graph = dev.end_capture(&stream)?;
            captured?;
            for replay in 0..self.cfg.graph_replays.min(4) {
                let case = format!(
                    "graph replay {replay} fused {} moe rms bf16 {tokens}x{hidden} topk={topk} rank={rank}",
                    kind.name()
                );
                let seed = self.cfg.seed ^ ((replay as u64 + 1) * 32_452_843);
                let d = moe_data::<bf16>(seed, world, tokens, hidden, routing, false);
                let gen = |r: usize, k: usize| -> Vec<bf16> {
                    (0..k)
                        .map(|i| bf16::from_f64(data::input_value(seed, r, i, ReduceOp::Sum, Values::Random)))
                        .collect()
                };
                let residual = gen(100, n);
                let weight = gen(101, hidden);
                let shared = d.shared.as_ref().map(|s| s[rank].clone()).unwrap_or_default();
                let xs: Vec<Vec<bf16>> = (0..world)
                    .map(|r| {
                        let sh = d.shared.as_ref().map(|s| s[r].as_slice());
                        moe_finalize_reference(hidden, topk, &d.experts[r], &d.idx, &d.scales_f32(), sh)
                    })
                    .collect();
                let want = fused_reference(
                    FusionPattern::ResidualRmsNorm,
                    hidden,
                    1e-5,
                    &xs,
                    &residual,
                    &weight,
                    1.0,
                );
                dev.memset(&bufs[2], 0, n * 2, POISON, &stream)?;
                dev.memset(&bufs[4], 0, n * 2, POISON, &stream)?;
                dev.copy_from_host(&bufs[0], 0, &data::to_bytes(&d.experts[rank]), &stream)?;
                dev.copy_from_host(&bufs[1], 0, &data::to_bytes(&residual), &stream)?;
                dev.copy_from_host(&bufs[3], 0, &data::to_bytes(&weight), &stream)?;
                dev.copy_from_host(&bufs[5], 0, &data::to_bytes(&d.idx), &stream)?;
                dev.copy_from_host(&bufs[6], 0, &data::to_bytes(&d.scales_f32()), &stream)?;
                dev.copy_from_host(&bufs[7], 0, &data::to_bytes(&shared), &stream)?;
                dev.launch_graph(&graph, &stream)?;
                let read = |k: usize, len: usize| -> Result<Vec<u8>> {
                    let mut got = vec![0u8; len];
                    dev.copy_to_host(&bufs[k], 0, &mut got, &stream)
                        .map_err(|e| context(e, &case))?;
                    Ok(got)
                };
                let (res, norm) = (read(2, n * 2)?, read(4, n * 2)?);
                self.check(&format!("{case} residual_out"), &res, &want.residual)?;
                self.check(&format!("{case} norm_out"), &norm, &want.norm)?;
            }
        }
        Ok(())
    }

    /// The MoE prologue's validation errors: refused with
    /// `InvalidArgument` before anything is queued, outputs untouched.
    fn fused_moe_validation(&mut self) -> Result<()> {
        let comm = self.comm;
        let (tokens, hidden, topk) = (4usize, 64usize, 2usize);
        let n = tokens * hidden;
        let pairs = tokens * topk;
        let rows = pairs + 1;
        let bf = DType::BF16;
        // Inputs written (the indices in range), outputs poisoned.
        self.put(8, 0, &data::to_bytes(&(0..pairs as i32).collect::<Vec<_>>()))?;
        self.put(9, 0, &data::to_bytes(&vec![0.5f32; pairs]))?;
        let experts = self.view(0, 0, bf, rows * hidden, false)?;
        let res_in = self.view(1, 0, bf, n, false)?;
        let res_out = self.view(2, 0, bf, n, true)?;
        let weight = self.view(3, 0, bf, hidden, false)?;
        let norm = self.view(4, 0, bf, n, true)?;
        self.view(7, 0, bf, n, true)?; // poisoned: checked untouched below
        let idx = self.view(8, 0, DType::I32, pairs, false)?;
        let scales = self.view(9, 0, DType::F32, pairs, false)?;
        let shared = self.view(10, 0, bf, n, false)?;
        let moe = MoeFinalize::new(idx, scales, topk);
        let rms = |m: MoeFinalize| {
            Fusion::new(FusionPattern::ResidualRmsNorm, hidden, res_in, res_out)
                .with_norm(weight, 1e-6)
                .with_norm_out(norm)
                .with_moe_finalize(m)
        };
        let f16_scales = self.view(9, 0, DType::F16, pairs, false)?;
        let idx_f32 = self.view(8, 0, DType::F32, pairs, false)?;
        let idx_short = self.view(8, 0, DType::I32, pairs - 1, false)?;
        let idx_misaligned = self.view(8, 2, DType::I32, pairs, false)?;
        let scales_long = self.view(9, 0, DType::F32, pairs + 1, false)?;
        let shared_f16 = self.view(10, 0, DType::F16, n, false)?;
        let shared_short = self.view(10, 0, bf, n - 8, false)?;
        let shared_misaligned = self.view(10, 8, bf, n, false)?;
        let experts_ragged = self.view(0, 0, bf, rows * hidden + 8, false)?;
        let res_ragged = self.view(1, 0, bf, n + 8, false)?;
        // An output over the router weights (slot 9) and over the experts (slot 0).
        let over_scales = self.view(9, 0, bf, n, true)?;
        let over_experts = self.view(0, 0, bf, n, true)?;
        let cases: Vec<(&str, Tensor, Fusion)> = vec![
            ("topk 0", experts, rms(MoeFinalize { topk: 0, ..moe })),
            (
                "topk too large",
                experts,
                rms(MoeFinalize {
                    topk: crate::algo::fused::MOE_MAX_TOPK + 1,
                    ..moe
                }),
            ),
            ("topk not the index's", experts, rms(MoeFinalize { topk: 3, ..moe })),
            (
                "index dtype",
                experts,
                rms(MoeFinalize {
                    expanded_idx_to_permuted_idx: idx_f32,
                    ..moe
                }),
            ),
            (
                "index short",
                experts,
                rms(MoeFinalize {
                    expanded_idx_to_permuted_idx: idx_short,
                    ..moe
                }),
            ),
            (
                "index misaligned",
                experts,
                rms(MoeFinalize {
                    expanded_idx_to_permuted_idx: idx_misaligned,
                    ..moe
                }),
            ),
            (
                "weights of another dtype",
                experts,
                rms(MoeFinalize {
                    expert_scales: f16_scales,
                    ..moe
                }),
            ),
            (
                "weights long",
                experts,
                rms(MoeFinalize {
                    expert_scales: scales_long,
                    ..moe
                }),
            ),
            ("shared dtype", experts, rms(moe.with_shared_expert_output(shared_f16))),
            (
                "shared short",
                experts,
                rms(moe.with_shared_expert_output(shared_short)),
            ),
            (
                "shared misaligned",
                experts,
                rms(moe.with_shared_expert_output(shared_misaligned)),
            ),
            ("experts' rows not whole", experts_ragged, rms(moe)),
            (
                "residual rows not whole",
                experts,
                Fusion::new(FusionPattern::ResidualAdd, hidden, res_ragged, res_ragged).with_moe_finalize(moe),
            ),
            (
                "allreduce_out = input",
                over_experts,
                Fusion::new(FusionPattern::ResidualAdd, hidden, res_in, res_out)
                    .with_allreduce_out(over_experts)
                    .with_moe_finalize(moe),
            ),
            (
                "residual_out over the weights",
                experts,
                Fusion::new(FusionPattern::ResidualAdd, hidden, res_in, over_scales).with_moe_finalize(moe),
            ),
            (
                "allreduce_out over the shared output",
                experts,
                Fusion::new(FusionPattern::ResidualAdd, hidden, res_in, res_out)
                    .with_allreduce_out(shared)
                    .with_moe_finalize(moe.with_shared_expert_output(shared)),
            ),
        ];
        let rank = comm.rank();
        for (what, inp, f) in cases {
            let case = format!("fused moe validation: {what} rank={rank}");
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
        // Nothing ran: the outputs are still poison.
        self.check_poisoned("fused moe validation", &[(2, n * 2), (4, n * 2), (7, n * 2)])?;
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

/// The kinds that cut a call into chunks of whole rows (the LL one-shot
/// carries a call in one epoch).
const CHUNKED: [FusedKind; 2] = [FusedKind::OneShot, FusedKind::TwoShot];

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
        FusionPattern::ResidualRmsNormNvfp4,
    ] {
        for (k, (tokens, hidden)) in [(7, 16384), (43, 4096)].into_iter().enumerate() {
            let case = Case {
                kind: CHUNKED[k % 2],
                pattern,
                tokens,
                hidden,
                eps: 1e-6,
                in_place: tokens == 7,
                with_allreduce_out: true,
                with_norm_out: true,
                special: false,
                moe: None,
            };
            s.fused_case::<bf16>(&case)?;
            s.fused_case::<f16>(&Case {
                kind: CHUNKED[(k + 1) % 2],
                ..case
            })?;
            // The MoE prologue over the same chunks (top-8, shared expert).
            let moe = Some(MoeCase {
                topk: 8,
                shared: true,
                scales_f32: k == 0,
            });
            s.fused_case::<bf16>(&Case {
                kind: CHUNKED[(k + 1) % 2],
                moe,
                ..case
            })?;
        }
    }
    // The sequence-parallel form over the same chunks.
    super::fused_sp::sp_chunked(&mut s)?;
    // Calls too large for a kind's workspace are refused: one row of
    // 65536 elements for the chunked kinds (when the slots are that small);
    // one row more than the lines hold, or a row wider than its threads
    // hold, for the LL one-shot.
    let slot = comm.options().slot_bytes_for(comm.device().facts().backend);
    let world = comm.size();
    let big = 1 << 16;
    let mut refused = vec![
        (
            FusedKind::OneShotLl,
            crate::algo::fused::fused_ll_rows(slot, world, 4096, 2) + 1,
            4096,
        ),
        (FusedKind::OneShotLl, 1, crate::algo::fused::FUSED_LL_MAX_HIDDEN + 8),
    ];
    if crate::algo::fused::fused_rows_per_chunk(slot, world, big, 2) == 0 {
        refused.push((FusedKind::OneShot, 1, big));
    }
    if crate::algo::fused::fused_segment_rows(slot, world, big, 2) == 0 {
        refused.push((FusedKind::TwoShot, 1, big));
    }
    for (kind, tokens, hidden) in refused {
        let n = tokens * hidden;
        let input = s.view(0, 0, DType::BF16, n, false)?;
        let r = s.view(1, 0, DType::BF16, n, false)?;
        let f = Fusion::new(FusionPattern::ResidualAdd, hidden, r, r);
        s.report.collectives += 1;
        let what = format!("{tokens} x {hidden}, too large for the {} workspace", kind.name());
        match comm.all_reduce_fused(input, &f, &Call::new().algo(kind_algo(kind))) {
            Err(Error::InvalidArgument(m)) if m.contains("not fit") => {}
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
