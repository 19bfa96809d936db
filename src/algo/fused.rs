//! Fused all-reduce epilogues (issue 12): all-reduce, residual add, RMSNorm
//! and quantization in one kernel, for the end of a tensor-parallel layer.
//!
//! This file holds the kernel side of it that is not the device code: the
//! patterns, entry-point names and definitions of the `fused` module
//! (`kernels-cuda/fused.cu`), how the fused arguments travel in
//! [`KernelParams`] (in its spare `per_peer` rows, so the 448-byte ABI is
//! unchanged), chunking by whole rows, and the launch. The math is defined
//! in docs/protocol.md ("Fused epilogues"); `backends/host/fused.rs` is the
//! host twin and `testing::fused` the unfused reference.

use std::fmt;
use std::time::Duration;

use super::grid::{GridTable, BLOCK_THREADS};
use super::kernels::KernelKind;
use super::nvfp4::SfLayout;
use super::layout::{lamport_stride, push_oneshot_stride, push_twoshot_stride, DATA_OFFSET, FLAGS_OFFSET, FP_OFFSET};
use super::workspace::Workspace;
use crate::device::{Device, DevicePtr, HostFlags, KernelParams, MAX_RANKS};
use crate::dtype::DType;
use crate::error::Result;

/// What follows the all-reduce (in the spirit of FlashInfer's
/// `AllReduceFusionPattern`). Every pattern adds the residual first:
/// `residual_out = round(ar + residual_in)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusionPattern {
    /// All-reduce + residual add: `residual_out` only.
    ResidualAdd,
    /// Then RMSNorm of `residual_out`'s rows times `weight`: `norm_out`.
    ResidualRmsNorm,
    /// Then RMSNorm, quantized to FP8 e4m3 (OCP "fn", max 448) with a
    /// per-tensor scale read from `scale` (one f32 in device memory):
    /// `quant_out` (and `norm_out` when given).
    ResidualRmsNormFp8,
    /// Then RMSNorm, FP8 e4m3 with a per-token scale computed from the row's
    /// absolute maximum and written to `scale` (one f32 per token).
    ResidualRmsNormFp8PerToken,
    /// Then RMSNorm, INT8 with a per-token scale (written to `scale`).
    ResidualRmsNormInt8PerToken,
    /// Then RMSNorm, NVFP4 (`crate::algo::nvfp4`): e2m1 values two per
    /// byte in `quant_out`, an e4m3 scale factor per 16 elements in
    /// `sf_out` (swizzled or linear), from the global scale read from
    /// `scale` (one f32 in device memory); `norm_out` when given.
    ResidualRmsNormNvfp4,
}

impl FusionPattern {
    /// Every pattern.
    pub const ALL: [FusionPattern; 6] = [
        FusionPattern::ResidualAdd,
        FusionPattern::ResidualRmsNorm,
        FusionPattern::ResidualRmsNormFp8,
        FusionPattern::ResidualRmsNormFp8PerToken,
        FusionPattern::ResidualRmsNormInt8PerToken,
        FusionPattern::ResidualRmsNormNvfp4,
    ];

    /// The short name used in kernel names and messages.
    pub const fn name(self) -> &'static str {
        match self {
            FusionPattern::ResidualAdd => "res",
            FusionPattern::ResidualRmsNorm => "rms",
            FusionPattern::ResidualRmsNormFp8 => "rms_fp8",
            FusionPattern::ResidualRmsNormFp8PerToken => "rms_fp8tok",
            FusionPattern::ResidualRmsNormInt8PerToken => "rms_i8tok",
            FusionPattern::ResidualRmsNormNvfp4 => "rms_nvfp4",
        }
    }

    /// The device-code constant (`FU_PAT_*` in `fused.cu`).
    pub(crate) const fn code(self) -> u32 {
        self as u32
    }

    /// Whether the pattern normalizes (needs `weight` and `eps`).
    pub const fn norms(self) -> bool {
        !matches!(self, FusionPattern::ResidualAdd)
    }

    /// Whether the pattern writes NVFP4 (packed values and scale factors,
    /// not one byte per element: [`FusionPattern::quant_dtype`] is `None`).
    pub const fn nvfp4(self) -> bool {
        matches!(self, FusionPattern::ResidualRmsNormNvfp4)
    }

    /// The quantized output's dtype, if the pattern quantizes to one byte
    /// per element.
    pub const fn quant_dtype(self) -> Option<DType> {
        match self {
            FusionPattern::ResidualRmsNormFp8 | FusionPattern::ResidualRmsNormFp8PerToken => Some(DType::F8E4M3),
            FusionPattern::ResidualRmsNormInt8PerToken => Some(DType::I8),
            _ => None,
        }
    }

    /// Whether the scale is computed per token (an output of `tokens` f32)
    /// rather than given (an input of one f32).
    pub const fn per_token(self) -> bool {
        matches!(
            self,
            FusionPattern::ResidualRmsNormFp8PerToken | FusionPattern::ResidualRmsNormInt8PerToken
        )
    }
}

impl fmt::Display for FusionPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The dtypes the fused kernels take (input, residuals, weight, normed output).
pub const FUSED_DTYPES: [DType; 2] = [DType::F16, DType::BF16];

/// Largest hidden size accepted. Nothing in the kernels depends on it (a
/// row is walked in 8-element packs by 32 lanes); it bounds the rows a
/// workspace chunk must hold whole.
pub const FUSED_MAX_HIDDEN: usize = 65536;

/// Largest magnitude of the FP8 e4m3fn format.
pub const FP8_MAX: f32 = 448.0;
/// Largest INT8 code used (symmetric: -127..=127).
pub const INT8_MAX: f32 = 127.0;
/// `scale = max(amax / QMAX, min_scale)`, `min_scale = 1 / (QMAX * 512)`
/// (vLLM's floor for dynamic scales; a zero row gets a tiny, finite scale).
/// These are the f32 values of the correctly rounded divisions.
pub fn fp8_min_scale() -> f32 {
    1.0 / (FP8_MAX * 512.0)
}
pub fn int8_min_scale() -> f32 {
    1.0 / (INT8_MAX * 512.0)
}

/// The fused kernel families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusedKind {
    /// Push each rank's rows into every rank's workspace (as the push
    /// one-shot all-reduce), then every rank reduces whole rows locally in
    /// rank order and applies the epilogue: one 32-lane group per row.
    OneShot,
    /// The one-shot's data flow on the LL all-reduce's lines (flag in the
    /// data): no flag round trip or grid barrier between the rows and the
    /// epilogue, which runs on the rows reduced into a local staging area.
    /// One epoch for the whole call: only for calls whose rows fit one
    /// source's LL lines ([`fused_ll_rows`]).
    OneShotLl,
    /// The push two-shot all-reduce by whole rows (reduce-scatter to the
    /// rows' owners, all-gather of the reduced rows into every rank's
    /// workspace), then every rank applies the epilogue to every row, with
    /// its own residual, weight and outputs: the one-shot's results with
    /// 2(n-1)/n of the input on the links instead of (n-1).
    TwoShot,
    /// The sequence-parallel form, gathered ([`SpOutput::Gathered`]): the
    /// two-shot's data flow with the shards as segments. Each rank reduces
    /// its own rows, adds its residual shard, pushes the new residual rows
    /// to every rank, and every rank normalizes (and quantizes) every row.
    SpGather,
    /// The sequence-parallel form, sharded ([`SpOutput::Shard`]): each rank
    /// reduces its own rows and applies the whole epilogue to them; one
    /// handshake a chunk, no all-gather.
    SpShard,
}

impl FusedKind {
    pub const ALL: [FusedKind; 5] = [
        FusedKind::OneShot,
        FusedKind::OneShotLl,
        FusedKind::TwoShot,
        FusedKind::SpGather,
        FusedKind::SpShard,
    ];

    /// The all-reduce kinds (what [`FusedForm::AllReduce`] runs).
    pub const ALL_REDUCE: [FusedKind; 3] = [FusedKind::OneShot, FusedKind::OneShotLl, FusedKind::TwoShot];

    pub const fn name(self) -> &'static str {
        match self {
            FusedKind::OneShot => "oneshot",
            FusedKind::OneShotLl => "oneshot_ll",
            FusedKind::TwoShot => "twoshot",
            FusedKind::SpGather => "sp_gather",
            FusedKind::SpShard => "sp_shard",
        }
    }

    /// Whether the kind is a sequence-parallel form (its input is always
    /// [`FusedInput::Rows`]).
    pub const fn seq_parallel(self) -> bool {
        matches!(self, FusedKind::SpGather | FusedKind::SpShard)
    }

    /// Whether the kernel takes `input` (SP kinds take no MoE prologue).
    pub const fn takes(self, input: FusedInput) -> bool {
        !self.seq_parallel() || matches!(input, FusedInput::Rows)
    }
}

/// Where the sequence-parallel form's normed (and quantized) rows go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpOutput {
    /// Every rank gets the normed rows of all `tokens` (reduce-scatter,
    /// epilogue, all-gather).
    Gathered,
    /// Each rank keeps only its own `tokens / world` rows (no all-gather).
    Shard,
}

impl SpOutput {
    /// Both forms.
    pub const ALL: [SpOutput; 2] = [SpOutput::Gathered, SpOutput::Shard];

    /// The short name (`gathered`, `shard`).
    pub const fn name(self) -> &'static str {
        match self {
            SpOutput::Gathered => "gathered",
            SpOutput::Shard => "shard",
        }
    }

    /// The kernel family that computes it.
    pub const fn kind(self) -> FusedKind {
        match self {
            SpOutput::Gathered => FusedKind::SpGather,
            SpOutput::Shard => FusedKind::SpShard,
        }
    }
}

impl fmt::Display for SpOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The form of a fused call: what is reduced where, and which rows each
/// rank's tensors hold (docs/protocol.md, "Fused epilogues").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FusedForm {
    /// All-reduce: every tensor holds all `tokens` rows
    /// (`Communicator::all_reduce_fused`).
    #[default]
    AllReduce,
    /// Sequence parallel: reduce-scatter of `tokens` rows (`tokens % world
    /// == 0`), rank `r` owning rows `[r*S, (r+1)*S)`, `S = tokens / world`;
    /// the residual and `allreduce_out` hold the rank's `S` rows, the normed
    /// and quantized outputs as [`SpOutput`] says
    /// (`Communicator::reduce_scatter_fused`).
    SeqParallel(SpOutput),
}

impl FusedForm {
    /// The SP output form, if the form is sequence parallel.
    pub const fn seq_parallel(self) -> Option<SpOutput> {
        match self {
            FusedForm::AllReduce => None,
            FusedForm::SeqParallel(o) => Some(o),
        }
    }

    /// Rows of the residual tensors (and `allreduce_out`) of a call of
    /// `tokens` rows at `world` ranks.
    pub const fn residual_rows(self, tokens: usize, world: usize) -> usize {
        match self {
            FusedForm::AllReduce => tokens,
            FusedForm::SeqParallel(_) => tokens / world,
        }
    }

    /// Rows of the normed and quantized outputs (and per-token scales).
    pub const fn output_rows(self, tokens: usize, world: usize) -> usize {
        match self {
            FusedForm::AllReduce | FusedForm::SeqParallel(SpOutput::Gathered) => tokens,
            FusedForm::SeqParallel(SpOutput::Shard) => tokens / world,
        }
    }

    /// The entry point's name, for messages.
    pub const fn entry(self) -> &'static str {
        match self {
            FusedForm::AllReduce => "all_reduce_fused",
            FusedForm::SeqParallel(_) => "reduce_scatter_fused",
        }
    }
}

/// Payloads (tokens x hidden x element size, bytes) from which dispatch
/// takes the two-shot, at world 2 and at larger worlds.
//
// World 2, measured on 2x H200 (bf16, graph replay, us, push one-shot /
// two-shot, every pattern alike; the bench of BENCHMARKS.md, "Fused
// all-reduce + residual + RMSNorm, beside FlashInfer", whose world-2 table
// times the LL one-shot): 1 MiB (128 x 4096) rms 22.7 / 34.8, 16 MiB (2048 x
// 4096) rms 112.4 / 97.6; hidden 8192: 2 MiB (128 rows) one-shot ahead,
// 32 MiB two-shot ahead. The 4 MiB threshold sits between. World 4, 4x H100
// (rms, bf16, graph replay, us, push one-shot / two-shot; the same section,
// "World 4", `bench/fused-4x-h100-2026-11-27/`): 1 MiB 22.07 / 25.85 (128 x
// 4096), 21.49 / 34.96 (64 x 8192); 2 MiB 36.97 / 31.09 (256 x 4096),
// 35.89 / 39.63 (128 x 8192); 4 MiB 63.82 / 40.71, 67.81 / 48.44. A 1 MiB
// threshold (the all-reduce's crossover) would take the two-shot where it
// is up to 63% slower; 2 MiB is the split.
pub const FUSED_TWOSHOT_MIN_BYTES: [usize; 2] = [4 << 20, 2 << 20];

/// Payloads (bytes in all) up to which dispatch takes the LL one-shot, at
/// world 2 and at larger worlds: what its Lamport area holds with the
/// default 32 MiB slots (calls it cannot hold take the push one-shot).
//
// Since the rows travel as they are (Lamport area), the LL one-shot is the
// fastest fused kind wherever it fits. rms, bf16, graph replay, us, LL /
// push one-shot / two-shot (BENCHMARKS.md, "Fused all-reduce + residual +
// RMSNorm, beside FlashInfer"). World 2 on 2x H100 (the bench of that
// section): 64 x 4096 (512 KiB) 7.50 / 10.35 / 16.28; 256 x 4096 (2 MiB)
// 13.78 / 23.84 / 20.65; 512 x 4096 (4 MiB) 24.81 / 35.67 / 32.62; 256 x
// 8192 (4 MiB) 23.30 / 40.41 / 31.33 (res alike: 19.65 / 28.32 / 24.26 at
// 512 x 4096). World 4 on 4x H100 (its "World 4" table and logs): 128 x
// 4096 (1 MiB) 16.22 / 22.07 / 25.85; 256 x 4096 (2 MiB) 27.65 / 36.97 /
// 31.09; 128 x 8192 (2 MiB) 27.18 / 35.89 / 39.63 (res at 2 MiB: 25.27 /
// 28.87 / 22.65 and 25.33 / 28.73 / 25.05, the only rows where LL is not
// first). Carried on LL lines (8 data bytes in 16), the one-shot lost to
// the others from 256 KiB at world 2.
pub const FUSED_LL_MAX_BYTES: [usize; 2] = [4 << 20, 2 << 20];

/// What a fused kernel all-reduces: each rank's rows as given, or rows it
/// first computes from MoE expert outputs (the MoE-finalize prologue).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusedInput {
    /// The input is `tokens x hidden`, all-reduced as it is.
    Rows,
    /// The input is the experts' permuted output rows; each token's row is
    /// the scaled sum of its top-k rows (plus the shared expert's), computed
    /// while the kernel stages it (docs/protocol.md, "MoE finalize").
    MoeFinalize,
}

impl FusedInput {
    pub const ALL: [FusedInput; 2] = [FusedInput::Rows, FusedInput::MoeFinalize];

    /// The part of the kernel name ("" or "moe_").
    pub const fn infix(self) -> &'static str {
        match self {
            FusedInput::Rows => "",
            FusedInput::MoeFinalize => "moe_",
        }
    }
}

/// `fc_fused_<kind>_[moe_]<pattern>_<dtype>`.
pub fn fused_kernel_name(kind: FusedKind, input: FusedInput, pattern: FusionPattern, dtype: DType) -> String {
    format!(
        "fc_fused_{}_{}{}_{}",
        kind.name(),
        input.infix(),
        pattern.name(),
        dtype.name()
    )
}

/// Every entry point of the `fused` module.
pub fn fused_kernel_names() -> Vec<String> {
    let mut names = Vec::new();
    for kind in FusedKind::ALL {
        for input in FusedInput::ALL.into_iter().filter(|&i| kind.takes(i)) {
            for pattern in FusionPattern::ALL {
                for dtype in FUSED_DTYPES {
                    names.push(fused_kernel_name(kind, input, pattern, dtype));
                }
            }
        }
    }
    names
}

/// The (kind, input, pattern, dtype) a fused entry-point name stands for.
pub fn parse_fused(name: &str) -> Option<(FusedKind, FusedInput, FusionPattern, DType)> {
    for kind in FusedKind::ALL {
        for input in FusedInput::ALL.into_iter().filter(|&i| kind.takes(i)) {
            for pattern in FusionPattern::ALL {
                for dtype in FUSED_DTYPES {
                    if fused_kernel_name(kind, input, pattern, dtype) == name {
                        return Some((kind, input, pattern, dtype));
                    }
                }
            }
        }
    }
    None
}

/// The C++ definition of one entry point of the `fused` module.
pub fn fused_entry(name: &str) -> Option<String> {
    let (kind, input, pattern, dtype) = parse_fused(name)?;
    let ty = match dtype {
        DType::F16 => "fc::TF16",
        DType::BF16 => "fc::TBF16",
        _ => return None,
    };
    let f = match kind {
        FusedKind::OneShot => "fused_oneshot",
        FusedKind::OneShotLl => "fused_oneshot_ll",
        FusedKind::TwoShot => "fused_twoshot",
        FusedKind::SpGather | FusedKind::SpShard => "fused_sp",
    };
    // The MoE prologue is the template's third argument (false by default);
    // the SP kernel's third argument is whether it gathers.
    let moe = match (kind, input) {
        (FusedKind::SpGather, _) => ", true",
        (FusedKind::SpShard, _) => ", false",
        (_, FusedInput::Rows) => "",
        (_, FusedInput::MoeFinalize) => ", true",
    };
    Some(format!(
        "FC_KERNEL({name}) {{ fc::{f}<{ty}, {}{moe}>(p); }}\n",
        pattern.code()
    ))
}

// ---------------------------------------------------------------- params

/// Where the fused arguments travel in [`KernelParams::per_peer`] (by
/// value, so graph replays see the captured call's): row [`ROW_PTRS`] holds
/// addresses (0 = absent), row [`ROW_SCALARS`] sizes and bits. `fused.cu`
/// has the same indices (`FU_*`).
pub const ROW_PTRS: usize = 0;
pub const PTR_RESIDUAL_IN: usize = 0;
pub const PTR_RESIDUAL_OUT: usize = 1;
pub const PTR_WEIGHT: usize = 2;
pub const PTR_NORM_OUT: usize = 3;
pub const PTR_QUANT_OUT: usize = 4;
pub const PTR_SCALE: usize = 5;
pub const PTR_ALLREDUCE_OUT: usize = 6;
/// NVFP4's scale factors (e4m3 bytes).
pub const PTR_SF_OUT: usize = 7;
pub const ROW_SCALARS: usize = 1;
/// Elements of a row.
pub const SCALAR_HIDDEN: usize = 0;
/// `eps`, as f32 bits.
pub const SCALAR_EPS: usize = 1;
/// Rows of the whole call (the scale index of a row is its global row).
pub const SCALAR_TOKENS: usize = 2;
/// NVFP4's scale-factor layout (`SfLayout::code`).
pub const SCALAR_SF_LAYOUT: usize = 3;
/// Row of the MoE-finalize prologue's arguments (absent: all 0).
pub const ROW_MOE: usize = 2;
/// `expanded_idx_to_permuted_idx` (i32, `tokens x topk`).
pub const MOE_IDX: usize = 0;
/// The router scales (`tokens x topk`, f32 or the call's dtype).
pub const MOE_SCALES: usize = 1;
/// The shared expert's output (`tokens x hidden`; 0 = none).
pub const MOE_SHARED: usize = 2;
/// `topk`.
pub const MOE_TOPK: usize = 3;
/// Rows of the experts' output (indices at or past it are skipped).
pub const MOE_ROWS: usize = 4;
/// 1: the scales are f32; 0: they are of the call's dtype.
pub const MOE_SCALE_F32: usize = 5;

/// Largest `topk` accepted. The kernels loop over it (nothing is sized by
/// it); it bounds a row's gathered reads to a sane multiple of its bytes.
pub const MOE_MAX_TOPK: usize = 32;

/// The MoE-finalize prologue of a fused call, as the kernels get it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeCall {
    pub topk: usize,
    /// Rows of the experts' output (the call's input).
    pub permuted_rows: usize,
    /// Whether the scales are f32 (else the call's dtype).
    pub scales_f32: bool,
    /// Addresses: `expanded_idx_to_permuted_idx`, the scales, the shared
    /// expert's output (0 = none).
    pub idx: u64,
    pub scales: u64,
    pub shared: u64,
}

/// One fused call, as every rank issues it.
#[derive(Debug, Clone, Copy)]
pub struct FusedCall {
    pub kind: FusedKind,
    pub pattern: FusionPattern,
    pub dtype: DType,
    pub tokens: usize,
    pub hidden: usize,
    pub eps: f32,
    pub input: DevicePtr,
    /// Addresses by `PTR_*` index (0 = absent).
    pub ptrs: [u64; MAX_RANKS],
    /// The MoE-finalize prologue (`input` is then the experts' output).
    pub moe: Option<MoeCall>,
    /// Where NVFP4's scale factors go (other patterns: unused).
    pub sf_layout: SfLayout,
}

impl FusedCall {
    /// What the kernel all-reduces.
    pub fn input_kind(&self) -> FusedInput {
        if self.moe.is_some() {
            FusedInput::MoeFinalize
        } else {
            FusedInput::Rows
        }
    }
}

/// Whole rows one chunk of the one-shot holds: a push one-shot sub-buffer
/// (`(2 * slot_bytes / world) & ~63` bytes) over the row's bytes. 0 when a
/// row does not fit (validation refuses such calls).
pub fn fused_rows_per_chunk(slot_bytes: usize, world: usize, hidden: usize, elem: usize) -> usize {
    push_oneshot_stride(slot_bytes, world.max(1)) / (hidden * elem).max(1)
}

/// Packs (8 elements) of a row one GPU thread of the LL one-shot holds in
/// registers (`FU_LL_PACKS` in `fused.cu`).
pub const FUSED_LL_PACKS: usize = 2;

/// Largest hidden size the LL one-shot serves: a block's threads hold a
/// whole row, [`FUSED_LL_PACKS`] packs each (8192 at 512 threads; larger
/// rows take the push kinds).
pub const FUSED_LL_MAX_HIDDEN: usize = FUSED_LL_PACKS * 8 * BLOCK_THREADS as usize;

/// Rows the LL one-shot carries: the whole call must fit one source's part
/// of the Lamport area (`lamport_stride`), where the rows travel as they
/// are. 0 when a row does not fit, or is wider than [`FUSED_LL_MAX_HIDDEN`].
/// (The host twin moves them as LL lines, which hold at least as many.)
pub fn fused_ll_rows(slot_bytes: usize, world: usize, hidden: usize, elem: usize) -> usize {
    if hidden > FUSED_LL_MAX_HIDDEN {
        return 0;
    }
    lamport_stride(slot_bytes, world.max(1)) / (hidden * elem).max(1)
}

/// Whole rows of one segment of a two-shot chunk (a chunk is `world`
/// segments): a push two-shot inbox (`(slot_bytes / world) & ~63` bytes)
/// over the row's bytes. 0 when a row does not fit.
pub fn fused_segment_rows(slot_bytes: usize, world: usize, hidden: usize, elem: usize) -> usize {
    push_twoshot_stride(slot_bytes, world.max(1)) / (hidden * elem).max(1)
}

/// 64-bit FNV-1a over what every rank must agree on.
pub fn fused_fingerprint(c: &FusedCall) -> u64 {
    let words = [
        0x000f_05ed_u64, // distinguishes fused launches from every CollectiveCall
        c.kind as u64,
        c.pattern as u64,
        c.dtype as u64,
        c.tokens as u64,
        c.hidden as u64,
        c.eps.to_bits() as u64,
        c.input_kind() as u64,
        c.moe.map_or(0, |m| m.topk as u64),
        c.sf_layout.code(),
    ];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl FusedCall {
    /// The parameter block of this call's one launch (it loops over chunks
    /// of whole rows itself, one epoch each, as the push one-shot does).
    pub fn params<D: Device>(
        &self,
        ws: &Workspace<D>,
        flags: &D::Flags,
        rank: usize,
        timeout: Duration,
    ) -> KernelParams {
        let mut per_peer = [[0u64; MAX_RANKS]; 4];
        per_peer[ROW_PTRS] = self.ptrs;
        per_peer[ROW_SCALARS][SCALAR_HIDDEN] = self.hidden as u64;
        per_peer[ROW_SCALARS][SCALAR_EPS] = self.eps.to_bits() as u64;
        per_peer[ROW_SCALARS][SCALAR_TOKENS] = self.tokens as u64;
        per_peer[ROW_SCALARS][SCALAR_SF_LAYOUT] = self.sf_layout.code();
        if let Some(m) = self.moe {
            let row = &mut per_peer[ROW_MOE];
            row[MOE_IDX] = m.idx;
            row[MOE_SCALES] = m.scales;
            row[MOE_SHARED] = m.shared;
            row[MOE_TOPK] = m.topk as u64;
            row[MOE_ROWS] = m.permuted_rows as u64;
            row[MOE_SCALE_F32] = m.scales_f32 as u64;
        }
        KernelParams {
            peer_ws: ws.peer_ptrs(),
            input: self.input,
            output: DevicePtr(self.ptrs[PTR_RESIDUAL_OUT]),
            error_flags: flags.device_ptr(),
            count: (self.tokens * self.hidden) as u64,
            fingerprint: fused_fingerprint(self),
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            fp_offset: FP_OFFSET as u64,
            flags_offset: FLAGS_OFFSET as u64,
            data_offset: DATA_OFFSET as u64,
            slot_bytes: ws.slot_bytes() as u64,
            rank: rank as u32,
            world: ws.world() as u32,
            dtype: self.dtype as u32,
            per_peer,
            ..KernelParams::default()
        }
    }

    /// Enqueue the call's one launch on `stream`. The grid is sized for one
    /// chunk's bytes by the push one-shot's rule, and never has more blocks
    /// than the chunk has rows (a block owns whole rows).
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue<D: Device>(
        &self,
        dev: &D,
        module: &D::Module,
        grids: &GridTable,
        ws: &Workspace<D>,
        flags: &D::Flags,
        rank: usize,
        timeout: Duration,
        stream: &D::Stream,
    ) -> Result<()> {
        let elem = self.dtype.size();
        let (slot, world) = (ws.slot_bytes(), ws.world());
        // Rows one block may own in a chunk: all of them (one-shot), or
        // those of one segment (two-shot, whose chunk is `world` segments:
        // sized by the chunk's bytes, as the push two-shot all-reduce).
        let (rows, segments, kind) = match self.kind {
            FusedKind::OneShot => (
                fused_rows_per_chunk(slot, world, self.hidden, elem).min(self.tokens),
                1,
                KernelKind::OneShotPush,
            ),
            // One chunk: every row (the host checked they fit the lines).
            FusedKind::OneShotLl => (self.tokens, 1, KernelKind::OneShotLl),
            FusedKind::TwoShot => (
                fused_segment_rows(slot, world, self.hidden, elem).min(self.tokens.div_ceil(world)),
                world,
                KernelKind::TwoShotPush,
            ),
            // The two-shot's rule, a shard a segment.
            FusedKind::SpGather | FusedKind::SpShard => (
                fused_segment_rows(slot, world, self.hidden, elem).min(self.tokens / world),
                world,
                KernelKind::TwoShotPush,
            ),
        };
        let rows = rows.max(1);
        let mut grid = grids.grid(kind, segments * rows * self.hidden * elem);
        grid.grid = match self.kind {
            // A block a row, on every multiprocessor: each block waits for
            // its rows' lines alone, so more blocks are more bytes in
            // flight (rms 128 x 4096 on 2x H200: 15.97 us at the LL
            // all-reduce's cap of 64 blocks, 13.14 at 128; the bench of
            // BENCHMARKS.md, "Fused all-reduce + residual + RMSNorm, beside
            // FlashInfer").
            FusedKind::OneShotLl => (rows as u32).min(grids.resident_blocks()),
            _ => grid.grid.min(rows as u32),
        }
        .max(1);
        let params = self.params(ws, flags, rank, timeout);
        let name = fused_kernel_name(self.kind, self.input_kind(), self.pattern, self.dtype);
        dev.launch(module, &name, grid, &params, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_entries_call_the_template() {
        let names = fused_kernel_names();
        // The SP kinds take no MoE prologue.
        let combos = FusedKind::ALL_REDUCE.len() * FusedInput::ALL.len() + 2;
        assert_eq!(names.len(), combos * FusionPattern::ALL.len() * FUSED_DTYPES.len());
        for n in &names {
            let e = fused_entry(n).unwrap();
            assert!(e.starts_with(&format!("FC_KERNEL({n}) ")), "{e}");
        }
        assert_eq!(
            fused_entry("fc_fused_oneshot_rms_fp8tok_bf16").unwrap(),
            "FC_KERNEL(fc_fused_oneshot_rms_fp8tok_bf16) { fc::fused_oneshot<fc::TBF16, 3>(p); }\n"
        );
        assert_eq!(
            fused_entry("fc_fused_twoshot_moe_rms_f16").unwrap(),
            "FC_KERNEL(fc_fused_twoshot_moe_rms_f16) { fc::fused_twoshot<fc::TF16, 1, true>(p); }\n"
        );
        assert_eq!(
            parse_fused("fc_fused_oneshot_moe_rms_fp8_bf16"),
            Some((
                FusedKind::OneShot,
                FusedInput::MoeFinalize,
                FusionPattern::ResidualRmsNormFp8,
                DType::BF16
            ))
        );
        assert!(fused_entry("fc_fused_oneshot_rms_f32").is_none());
        assert_eq!(
            fused_entry("fc_fused_sp_gather_rms_nvfp4_bf16").unwrap(),
            "FC_KERNEL(fc_fused_sp_gather_rms_nvfp4_bf16) { fc::fused_sp<fc::TBF16, 5, true>(p); }\n"
        );
        assert_eq!(
            fused_entry("fc_fused_sp_shard_res_f16").unwrap(),
            "FC_KERNEL(fc_fused_sp_shard_res_f16) { fc::fused_sp<fc::TF16, 0, false>(p); }\n"
        );
        assert!(parse_fused("fc_fused_sp_shard_moe_rms_f16").is_none());
    }

    /// `fu_div` of fused.cu (for a scale in [2^-30, 2^30]): the quotient
    /// from the correctly rounded reciprocal (Markstein) for |v| in
    /// [2^-50, 2^50], `v * rcp` outside.
    fn markstein(v: f32, s: f32) -> f32 {
        let r = 1.0f32 / s;
        let q = v * r;
        let a = v.abs();
        if !(a >= 2f32.powi(-50) && a <= 2f32.powi(50)) {
            return q;
        }
        (-q).mul_add(s, v).mul_add(r, q)
    }

    /// The quantized codes of a quotient (the host's `quantize` after the
    /// division): FP8 e4m3fn and INT8.
    fn codes(q: f32) -> (u8, u8) {
        let i8 = if q.is_nan() {
            0
        } else {
            q.round_ties_even().clamp(-INT8_MAX, INT8_MAX) as i8 as u8
        };
        (crate::codec::Fp8Flavor::E4m3Fn.encode(q), i8)
    }

    #[test]
    fn markstein_codes_are_the_division_s() {
        // In range the quotient is the division's, bit for bit: exponents
        // only shift the operands there, so every v mantissa in [1, 2)
        // against divisor mantissas (1, 1 + ulp, all ones, the tests'
        // scales, a spread) covers its rounding. Any v (random bits, every
        // magnitude, zeros, NaN, infinities) gives the division's codes.
        let mut divisors: Vec<f32> = vec![
            1.0,
            f32::from_bits(0x3f80_0001),
            f32::from_bits(0x3fff_ffff),
            1.5,
            0.009,
            fp8_min_scale(),
            int8_min_scale(),
            3.0e-3,
        ];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        divisors.extend((0..4).map(|_| f32::from_bits(0x3f80_0000 | (next() as u32 & 0x7f_ffff))));
        for &s in &divisors {
            for m in 0..1u32 << 23 {
                let v = f32::from_bits(0x3f80_0000 | m);
                assert_eq!(markstein(v, s).to_bits(), (v / s).to_bits(), "{v:e} / {s:e}");
            }
        }
        let specials = [0.0f32, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-45, -3e38];
        for k in 0..4_000_000u32 {
            let v = match k as usize {
                i if i < specials.len() => specials[i],
                _ => f32::from_bits(next() as u32),
            };
            // Scales over the whole fast range, 2^-30..2^30.
            let s = f32::from_bits((97 + (next() % 60) as u32) << 23 | (next() as u32 & 0x7f_ffff));
            assert_eq!(codes(markstein(v, s)), codes(v / s), "{v:e} / {s:e}");
        }
    }

    #[test]
    fn min_scales_are_the_rounded_quotients() {
        assert_eq!(fp8_min_scale(), 1.0f32 / 229_376.0);
        assert_eq!(int8_min_scale(), 1.0f32 / 65_024.0);
    }

    #[test]
    fn rows_per_chunk() {
        // 8 MiB slots, world 8: 2 MiB sub-buffers hold 64 rows of 16384 bf16.
        assert_eq!(fused_rows_per_chunk(8 << 20, 8, 16384, 2), 64);
        assert_eq!(fused_rows_per_chunk(1 << 16, 8, 16384, 2), 0);
        // 32 MiB slots, world 2: 8 MiB of lines a source carry 4 MiB of
        // data, 512 rows of 4096 bf16.
        assert_eq!(fused_ll_rows(32 << 20, 2, 4096, 2), 512);
        assert_eq!(fused_ll_rows(1 << 16, 8, 4096, 2), 0);
        assert_eq!(fused_ll_rows(32 << 20, 2, 8192, 2), 256);
        assert_eq!(fused_ll_rows(32 << 20, 2, 8200, 2), 0);
    }
}
