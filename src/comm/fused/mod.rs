//! Fused all-reduce epilogues (issue 12): the end of every tensor-parallel
//! transformer layer, all-reduce, residual add, RMSNorm and often a
//! quantization, in one kernel ([`Communicator::all_reduce_fused`]).
//!
//! Shapes are `tokens x hidden`, row-major, f16 or bf16; sum only. The math
//! is fixed in fp32 (docs/protocol.md, "Fused epilogues"), so every backend
//! and every rank writes the same bits as the host reference.
//!
//! With [`Fusion::with_moe_finalize`] the call's input is a MoE layer's
//! expert outputs instead, and each token's row is first finalized from its
//! top-k expert rows ([`MoeFinalize`]), inside the same kernel.
//!
//! With [`Fusion::with_seq_parallel`] the call is the sequence-parallel
//! form instead ([`Communicator::reduce_scatter_fused`]): reduce-scatter of
//! the rows, the epilogue on each rank's own rows with its residual shard,
//! and the normed rows all-gathered or kept as the shard ([`SpOutput`]).

mod checks;

use super::call::Call;
use super::communicator::Communicator;
use super::tensor::Tensor;
use super::work::Work;
use crate::algo::fused::{FusedForm, FusionPattern, SpOutput};
use crate::algo::nvfp4::SfLayout;
use crate::device::Device;
use crate::error::{Error, Result};

/// The tensors and constants of a fused call besides its input (this rank's
/// partial sums, `tokens x hidden`). Build one with [`Fusion::new`] and the
/// `with_*` methods; what each pattern needs is checked by
/// [`Communicator::all_reduce_fused`] before anything is launched.
#[derive(Debug, Clone, Copy)]
pub struct Fusion {
    /// What runs after the all-reduce.
    pub pattern: FusionPattern,
    /// Elements of a row (the model's hidden size): a multiple of 8, at
    /// most [`FUSED_MAX_HIDDEN`](super::FUSED_MAX_HIDDEN).
    pub hidden: usize,
    /// The residual stream, `tokens x hidden` of the input's dtype (the
    /// sequence-parallel form: this rank's shard, `tokens / world` rows).
    pub residual_in: Tensor,
    /// `round(allreduce + residual_in)`; may be `residual_in` itself (in place).
    pub residual_out: Tensor,
    /// RMSNorm's weight, `hidden` elements of the input's dtype (norm patterns).
    pub weight: Option<Tensor>,
    /// RMSNorm's epsilon (finite, >= 0).
    pub eps: f32,
    /// The normed rows (required by `ResidualRmsNorm`, optional with a quantization).
    pub norm_out: Option<Tensor>,
    /// The quantized normed rows: `tokens x hidden` of f8e4m3 or i8; NVFP4:
    /// `tokens x hidden / 2` u8, two e2m1 values a byte.
    pub quant_out: Option<Tensor>,
    /// f32 scales: one (given, read on the device at run time) for
    /// `ResidualRmsNormFp8` and NVFP4 (its global scale), `tokens`
    /// (written) for the per-token patterns.
    pub scale: Option<Tensor>,
    /// NVFP4's e4m3 scale factors (f8e4m3 or u8), one per 16 elements of a
    /// row, [`SfLayout::sf_bytes`] of them in the layout `sf_layout`.
    pub sf_out: Option<Tensor>,
    /// Where NVFP4's scale factors go.
    pub sf_layout: SfLayout,
    /// The all-reduced rows before the residual add (optional; may be the
    /// input itself, except with a MoE prologue).
    pub allreduce_out: Option<Tensor>,
    /// The MoE-finalize prologue: the call's input is then the experts'
    /// output, and `tokens` comes from `residual_in`.
    pub moe: Option<MoeFinalize>,
    /// All-reduce (every tensor holds all `tokens` rows), or the
    /// sequence-parallel form ([`Fusion::with_seq_parallel`]), whose
    /// residual and `allreduce_out` hold this rank's `tokens / world` rows
    /// and whose normed and quantized outputs hold the rows its
    /// [`SpOutput`] says.
    pub form: FusedForm,
}

/// The MoE-finalize prologue of a fused call (the arguments of
/// TensorRT-LLM's `moe_finalize_allreduce_fusion`). The call's input is
/// then the experts' output, `permuted_rows x hidden` (the FC2 rows in
/// expert order), and what each rank contributes to the all-reduce is, per
/// token `t` and element `j`, rounded to the dtype once:
///
/// `shared_expert_output[t][j] + sum over k in 0..topk, in k order, of
/// expert_scales[t][k] * input[expanded_idx_to_permuted_idx[t][k]][j]`
///
/// in f32 (docs/protocol.md, "MoE finalize"). The indices are device data,
/// read by the kernel: one outside `[0, permuted_rows)` skips its term (the
/// host twin does the same); nothing out of range is read.
#[derive(Debug, Clone, Copy)]
pub struct MoeFinalize {
    /// i32, `tokens x topk`: expanded index `t * topk + k` to a row of the
    /// experts' output.
    pub expanded_idx_to_permuted_idx: Tensor,
    /// The router's weights, `tokens x topk`, f32 or the input's dtype.
    pub expert_scales: Tensor,
    /// Experts per token, 1 to [`MOE_MAX_TOPK`](super::MOE_MAX_TOPK).
    pub topk: usize,
    /// The shared expert's output, `tokens x hidden` of the input's dtype
    /// (added first; optional).
    pub shared_expert_output: Option<Tensor>,
}

impl MoeFinalize {
    /// `topk` experts per token, routed by `expanded_idx_to_permuted_idx`
    /// and weighted by `expert_scales`.
    pub fn new(expanded_idx_to_permuted_idx: Tensor, expert_scales: Tensor, topk: usize) -> Self {
        MoeFinalize {
            expanded_idx_to_permuted_idx,
            expert_scales,
            topk,
            shared_expert_output: None,
        }
    }

    /// Add the shared expert's output.
    pub fn with_shared_expert_output(mut self, shared_expert_output: Tensor) -> Self {
        self.shared_expert_output = Some(shared_expert_output);
        self
    }
}

impl Fusion {
    /// A fusion of `pattern` over rows of `hidden` elements; add the
    /// tensors the pattern needs with the `with_*` methods.
    pub fn new(pattern: FusionPattern, hidden: usize, residual_in: Tensor, residual_out: Tensor) -> Self {
        Fusion {
            pattern,
            hidden,
            residual_in,
            residual_out,
            weight: None,
            eps: 1e-6,
            norm_out: None,
            quant_out: None,
            scale: None,
            sf_out: None,
            sf_layout: SfLayout::Swizzled128x4,
            allreduce_out: None,
            moe: None,
            form: FusedForm::AllReduce,
        }
    }

    /// RMSNorm's weight and epsilon.
    pub fn with_norm(mut self, weight: Tensor, eps: f32) -> Self {
        self.weight = Some(weight);
        self.eps = eps;
        self
    }

    /// Where the normed rows go.
    pub fn with_norm_out(mut self, norm_out: Tensor) -> Self {
        self.norm_out = Some(norm_out);
        self
    }

    /// The quantized output and its scale tensor (see [`Fusion::scale`]).
    pub fn with_quant(mut self, quant_out: Tensor, scale: Tensor) -> Self {
        self.quant_out = Some(quant_out);
        self.scale = Some(scale);
        self
    }

    /// NVFP4's outputs: the packed values, the global scale (one f32, read
    /// on the device at run time), the scale factors and their layout.
    pub fn with_nvfp4(mut self, quant_out: Tensor, global_scale: Tensor, sf_out: Tensor, layout: SfLayout) -> Self {
        self.quant_out = Some(quant_out);
        self.scale = Some(global_scale);
        self.sf_out = Some(sf_out);
        self.sf_layout = layout;
        self
    }

    /// Also write the all-reduced rows (before the residual add).
    pub fn with_allreduce_out(mut self, allreduce_out: Tensor) -> Self {
        self.allreduce_out = Some(allreduce_out);
        self
    }

    /// Finalize a MoE layer first: the call's input is the experts' output
    /// (see [`MoeFinalize`]).
    pub fn with_moe_finalize(mut self, moe: MoeFinalize) -> Self {
        self.moe = Some(moe);
        self
    }

    /// The sequence-parallel form ([`Communicator::reduce_scatter_fused`]):
    /// `residual_in`, `residual_out` and `allreduce_out` are this rank's
    /// shard (`tokens / world` rows), the normed and quantized outputs (and
    /// per-token scales) `tokens` rows ([`SpOutput::Gathered`]) or the
    /// shard's ([`SpOutput::Shard`]).
    pub fn with_seq_parallel(mut self, out: SpOutput) -> Self {
        self.form = FusedForm::SeqParallel(out);
        self
    }
}

impl<D: Device> Communicator<D> {
    /// All-reduce (sum) of `input` (`tokens x hidden`, f16 or bf16) fused
    /// with the epilogue `fusion` describes: residual add, then RMSNorm,
    /// then a quantization, as its pattern says. Collective: every rank
    /// calls it with the same pattern, shape, dtype and `eps`. Caller
    /// memory, the call's stream, graph-capturable. Every tensor must be
    /// 16-byte aligned (the scale: 4), and outputs may not overlap anything
    /// but what they may replace (`residual_out` = `residual_in`,
    /// `allreduce_out` = `input`). Results are bitwise those of the host
    /// reference (docs/protocol.md, "Fused epilogues") on every rank.
    ///
    /// With a MoE prologue ([`Fusion::with_moe_finalize`]), `input` is the
    /// experts' output (`permuted_rows x hidden`), `tokens` is
    /// `residual_in`'s rows, and no output may overlap any of the
    /// prologue's tensors (the kernel gathers expert rows from anywhere
    /// while other rows are written).
    pub fn all_reduce_fused(&self, input: Tensor, fusion: &Fusion, call: &Call<'_, D>) -> Result<Work<D>> {
        if fusion.form != FusedForm::AllReduce {
            return Err(Error::invalid(
                "all_reduce_fused: the fusion is sequence parallel (Fusion::with_seq_parallel); \
                 call reduce_scatter_fused",
            ));
        }
        self.run_fused(input, fusion, call)
    }

    /// The sequence-parallel fused epilogue ([`Fusion::with_seq_parallel`]),
    /// in one kernel: reduce-scatter (sum) of `input` (`tokens x hidden`
    /// partial sums on every rank, f16 or bf16, `tokens % world == 0`; rank
    /// `r` owns rows `[r*S, (r+1)*S)`, `S = tokens / world`), then on each
    /// owned row the residual add with this rank's shard of the residual
    /// stream (`residual_in`, `S x hidden`), RMSNorm and the quantization,
    /// as [`Communicator::all_reduce_fused`] computes them; then, for
    /// [`SpOutput::Gathered`], the normed (and quantized) rows of all
    /// `tokens` on every rank, and for [`SpOutput::Shard`] only this rank's
    /// `S` rows (no all-gather). Every value is bitwise the all-reduce
    /// form's on the same rows with the full residual (the ranks' shards
    /// concatenated): docs/protocol.md, "Sequence-parallel form".
    /// Collective; the rules of `all_reduce_fused` on memory, streams and
    /// graphs hold, except that no output may overlap the input. No MoE
    /// prologue.
    pub fn reduce_scatter_fused(&self, input: Tensor, fusion: &Fusion, call: &Call<'_, D>) -> Result<Work<D>> {
        if fusion.form.seq_parallel().is_none() {
            return Err(Error::invalid(
                "reduce_scatter_fused: the fusion is not sequence parallel; \
                 set its output form with Fusion::with_seq_parallel",
            ));
        }
        self.run_fused(input, fusion, call)
    }

    /// Check and enqueue either form (the fusion's form picks the kernel).
    fn run_fused(&self, input: Tensor, fusion: &Fusion, call: &Call<'_, D>) -> Result<Work<D>> {
        let c = self.checked_fusion(&input, fusion, call)?;
        let entry = fusion.form.entry();
        self.submit(call, entry, |s| {
            if c.tokens == 0 {
                return Ok(());
            }
            let inner = s.inner;
            s.res.load_fused_module(&inner.device)?;
            let ws = s.workspace(entry)?;
            let Some(module) = s.res.fused_module.as_ref() else {
                return Err(Error::invalid("the fused module did not load"));
            };
            c.enqueue(
                &inner.device,
                module,
                &inner.grids,
                ws,
                &inner.flags,
                inner.rank,
                s.timeout,
                s.stream,
            )
        })
    }
}
