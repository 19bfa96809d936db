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

use super::call::Call;
use super::communicator::Communicator;
use super::tensor::Tensor;
use super::work::Work;
use crate::algo::fused::{
    choose_fused, fused_ll_rows, fused_rows_per_chunk, fused_segment_rows, FusedCall, FusedKind, FusionPattern,
    MoeCall, FUSED_DTYPES, FUSED_LL_MAX_HIDDEN, FUSED_MAX_HIDDEN, MOE_MAX_TOPK, PTR_ALLREDUCE_OUT, PTR_NORM_OUT,
    PTR_QUANT_OUT, PTR_RESIDUAL_IN, PTR_RESIDUAL_OUT, PTR_SCALE, PTR_WEIGHT,
};
use crate::algo::layout::push_oneshot_stride;
use crate::algo::{AlgoChoice, Algorithm};
use crate::device::{Device, MAX_RANKS};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The tensors and constants of a fused call besides its input (this rank's
/// partial sums, `tokens x hidden`). Build one with [`Fusion::new`] and the
/// `with_*` methods; what each pattern needs is checked by
/// [`Communicator::all_reduce_fused`] before anything is launched.
#[derive(Debug, Clone, Copy)]
pub struct Fusion {
    pub pattern: FusionPattern,
    /// Elements of a row (the model's hidden size): a multiple of 8, at
    /// most [`FUSED_MAX_HIDDEN`].
    pub hidden: usize,
    /// The residual stream, `tokens x hidden` of the input's dtype.
    pub residual_in: Tensor,
    /// `round(allreduce + residual_in)`; may be `residual_in` itself (in place).
    pub residual_out: Tensor,
    /// RMSNorm's weight, `hidden` elements of the input's dtype (norm patterns).
    pub weight: Option<Tensor>,
    /// RMSNorm's epsilon (finite, >= 0).
    pub eps: f32,
    /// The normed rows (required by `ResidualRmsNorm`, optional with a quantization).
    pub norm_out: Option<Tensor>,
    /// The quantized normed rows: `tokens x hidden` of f8e4m3 or i8.
    pub quant_out: Option<Tensor>,
    /// f32 scales: one (given, read on the device at run time) for
    /// `ResidualRmsNormFp8`, `tokens` (written) for the per-token patterns.
    pub scale: Option<Tensor>,
    /// The all-reduced rows before the residual add (optional; may be the
    /// input itself, except with a MoE prologue).
    pub allreduce_out: Option<Tensor>,
    /// The MoE-finalize prologue: the call's input is then the experts'
    /// output, and `tokens` comes from `residual_in`.
    pub moe: Option<MoeFinalize>,
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
    /// Experts per token, 1 to [`MOE_MAX_TOPK`].
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
            allreduce_out: None,
            moe: None,
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
}

/// A tensor's role, for messages.
struct Role {
    what: &'static str,
    t: Tensor,
    output: bool,
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
        let c = self.checked_fusion(&input, fusion, call)?;
        self.submit(call, "all_reduce_fused", |s| {
            if c.tokens == 0 {
                return Ok(());
            }
            let inner = s.inner;
            s.res.load_fused_module(&inner.device)?;
            let (Some(module), Some(ws)) = (s.res.fused_module.as_ref(), s.res.ws.as_ref()) else {
                return Err(Error::Unsupported(format!(
                    "all_reduce_fused on communicator {}: it spans {} and has no workspace for the fused kernels \
                     (run it on each node's communicator)",
                    inner.name,
                    inner.topology.describe()
                )));
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

    /// Every check of a fused call, before anything is queued: the call it
    /// becomes.
    fn checked_fusion(&self, input: &Tensor, f: &Fusion, call: &Call<'_, D>) -> Result<FusedCall> {
        let err = |m: String| Error::invalid(format!("all_reduce_fused ({}): {m}", f.pattern));
        let bad = |m: String| Err(err(m));
        let dtype = input.dtype();
        if !FUSED_DTYPES.contains(&dtype) {
            return bad(format!("the input is {dtype}; fused epilogues take f16 or bf16"));
        }
        let hidden = f.hidden;
        if hidden == 0 || hidden % 8 != 0 {
            return bad(format!("hidden = {hidden} must be a positive multiple of 8"));
        }
        if hidden > FUSED_MAX_HIDDEN {
            return bad(format!("hidden = {hidden} is larger than {FUSED_MAX_HIDDEN}"));
        }
        if input.count() % hidden != 0 {
            return bad(format!(
                "the input{} has {} elements, not a whole number of rows of {hidden}",
                if f.moe.is_some() { " (the experts' output)" } else { "" },
                input.count()
            ));
        }
        // Rows of the call: the input's, or with a MoE prologue the
        // residual's (the input is then the experts' rows).
        let tokens = match f.moe {
            None => input.count() / hidden,
            Some(_) => {
                if f.residual_in.count() % hidden != 0 {
                    return bad(format!(
                        "residual_in has {} elements, not a whole number of rows of {hidden} \
                         (with a MoE prologue it gives the tokens)",
                        f.residual_in.count()
                    ));
                }
                f.residual_in.count() / hidden
            }
        };
        let n = tokens * hidden;
        let world = self.size();
        // The workspace's slots (what Workspace::create was given).
        let slot_bytes = self.options().slot_bytes_for(self.device().facts().backend);
        let stride = push_oneshot_stride(slot_bytes, world);
        if tokens > 0 && fused_rows_per_chunk(slot_bytes, world, hidden, dtype.size()) == 0 {
            return bad(format!(
                "a row of {hidden} x {dtype} ({} bytes) does not fit one rank's share of the workspace \
                 ({stride} bytes at world {world}); create the communicator with larger slot_bytes",
                hidden * dtype.size()
            ));
        }

        // Which tensors the pattern takes, and their shapes.
        let mut roles = vec![
            Role {
                what: "input",
                t: *input,
                output: false,
            },
            Role {
                what: "residual_in",
                t: f.residual_in,
                output: false,
            },
            Role {
                what: "residual_out",
                t: f.residual_out,
                output: true,
            },
        ];
        let expect = |what: &str, t: &Tensor, dt: DType, count: usize| -> Result<()> {
            if t.dtype() != dt || t.count() != count {
                return Err(err(format!(
                    "{what} must be {count} x {dt} ({tokens} x {hidden} for rows), not {} x {}",
                    t.count(),
                    t.dtype()
                )));
            }
            Ok(())
        };
        expect("residual_in", &f.residual_in, dtype, n)?;
        expect("residual_out", &f.residual_out, dtype, n)?;
        let unwanted = |what: &str, present: bool| -> Result<()> {
            if present {
                return Err(err(format!(
                    "{what} was given, but pattern {} does not use it",
                    f.pattern
                )));
            }
            Ok(())
        };
        if f.pattern.norms() {
            let Some(w) = f.weight else {
                return bad("RMSNorm needs a weight (Fusion::with_norm)".into());
            };
            expect("weight", &w, dtype, hidden)?;
            if !(f.eps.is_finite() && f.eps >= 0.0) {
                return bad(format!("eps = {} must be finite and >= 0", f.eps));
            }
            roles.push(Role {
                what: "weight",
                t: w,
                output: false,
            });
            match (f.norm_out, f.pattern) {
                (None, FusionPattern::ResidualRmsNorm) => {
                    return bad("norm_out is required: it is the pattern's result".into())
                }
                (None, _) => {}
                (Some(t), _) => {
                    expect("norm_out", &t, dtype, n)?;
                    roles.push(Role {
                        what: "norm_out",
                        t,
                        output: true,
                    });
                }
            }
        } else {
            unwanted("weight", f.weight.is_some())?;
            unwanted("norm_out", f.norm_out.is_some())?;
        }
        if let Some(qdt) = f.pattern.quant_dtype() {
            let (Some(q), Some(s)) = (f.quant_out, f.scale) else {
                return bad("quant_out and scale are required (Fusion::with_quant)".into());
            };
            expect("quant_out", &q, qdt, n)?;
            let scales = if f.pattern.per_token() { tokens } else { 1 };
            if s.dtype() != DType::F32 || s.count() != scales {
                return bad(format!(
                    "scale must be {scales} x f32 ({}), not {} x {}",
                    if f.pattern.per_token() {
                        "one per token, written"
                    } else {
                        "the per-tensor scale, read"
                    },
                    s.count(),
                    s.dtype()
                ));
            }
            roles.push(Role {
                what: "quant_out",
                t: q,
                output: true,
            });
            roles.push(Role {
                what: "scale",
                t: s,
                output: f.pattern.per_token(),
            });
        } else {
            unwanted("quant_out", f.quant_out.is_some())?;
            unwanted("scale", f.scale.is_some())?;
        }
        if let Some(t) = f.allreduce_out {
            expect("allreduce_out", &t, dtype, n)?;
            roles.push(Role {
                what: "allreduce_out",
                t,
                output: true,
            });
        }
        let mut moe_call = None;
        if let Some(m) = &f.moe {
            if m.topk == 0 || m.topk > MOE_MAX_TOPK {
                return bad(format!("topk = {} must be 1 to {MOE_MAX_TOPK}", m.topk));
            }
            let pairs = tokens * m.topk;
            let idx = m.expanded_idx_to_permuted_idx;
            if idx.dtype() != DType::I32 || idx.count() != pairs {
                return bad(format!(
                    "expanded_idx_to_permuted_idx must be {pairs} x i32 ({tokens} tokens x topk {}), not {} x {}",
                    m.topk,
                    idx.count(),
                    idx.dtype()
                ));
            }
            let sc = m.expert_scales;
            if !(sc.dtype() == DType::F32 || sc.dtype() == dtype) || sc.count() != pairs {
                return bad(format!(
                    "expert_scales must be {pairs} x f32 or {pairs} x {dtype} ({tokens} tokens x topk {}), \
                     not {} x {}",
                    m.topk,
                    sc.count(),
                    sc.dtype()
                ));
            }
            if let Some(t) = m.shared_expert_output {
                expect("shared_expert_output", &t, dtype, n)?;
            }
            roles.push(Role {
                what: "expanded_idx_to_permuted_idx",
                t: idx,
                output: false,
            });
            roles.push(Role {
                what: "expert_scales",
                t: sc,
                output: false,
            });
            if let Some(t) = m.shared_expert_output {
                roles.push(Role {
                    what: "shared_expert_output",
                    t,
                    output: false,
                });
            }
            moe_call = Some(MoeCall {
                topk: m.topk,
                permuted_rows: input.count() / hidden,
                scales_f32: sc.dtype() == DType::F32,
                idx: idx.ptr().0,
                scales: sc.ptr().0,
                shared: m.shared_expert_output.map_or(0, |t| t.ptr().0),
            });
        }

        // Memory: on this device, aligned, and no output overlapping
        // anything it may not replace.
        for r in &roles {
            let bytes = r.t.bytes()?;
            if bytes > 0 {
                self.inner
                    .device
                    .check_memory(r.t.ptr(), bytes)
                    .map_err(|e| Error::invalid(format!("all_reduce_fused ({}): {}: {e}", f.pattern, r.what)))?;
            }
            // Rows move in 16-byte packs; the scale and the MoE index and
            // router weights are read an element at a time.
            let align = match r.what {
                "scale" | "expanded_idx_to_permuted_idx" | "expert_scales" => r.t.dtype().size(),
                _ => 16,
            };
            if r.t.ptr().0 % align as u64 != 0 {
                return bad(format!(
                    "{} at {:#x} is not {align}-byte aligned ({})",
                    r.what,
                    r.t.ptr().0,
                    if align == 16 {
                        "the kernels move 16-byte packs"
                    } else {
                        "read an element at a time"
                    }
                ));
            }
        }
        let same = |a: &Tensor, b: &Tensor| a.ptr() == b.ptr() && a.count() == b.count();
        // With a MoE prologue the input (the experts' rows) is gathered
        // from anywhere while rows are written: nothing may replace it.
        let allowed = |out: &Role, other: &Role| {
            (out.what == "residual_out" && other.what == "residual_in" && same(&out.t, &other.t))
                || (out.what == "allreduce_out" && other.what == "input" && f.moe.is_none() && same(&out.t, &other.t))
        };
        for (i, a) in roles.iter().enumerate() {
            for b in roles.iter().skip(i + 1) {
                if !(a.output || b.output) || n == 0 || !a.t.overlaps(&b.t) {
                    continue;
                }
                let (out, other) = if a.output { (a, b) } else { (b, a) };
                if !allowed(out, other) && !allowed(other, out) {
                    return bad(format!("{} overlaps {}", out.what, other.what));
                }
            }
        }

        let mut ptrs = [0u64; MAX_RANKS];
        ptrs[PTR_RESIDUAL_IN] = f.residual_in.ptr().0;
        ptrs[PTR_RESIDUAL_OUT] = f.residual_out.ptr().0;
        let mut set = |k: usize, t: Option<Tensor>| {
            if let Some(t) = t {
                ptrs[k] = t.ptr().0;
            }
        };
        if f.pattern.norms() {
            set(PTR_WEIGHT, f.weight);
            set(PTR_NORM_OUT, f.norm_out);
        }
        if f.pattern.quant_dtype().is_some() {
            set(PTR_QUANT_OUT, f.quant_out);
            set(PTR_SCALE, f.scale);
        }
        set(PTR_ALLREDUCE_OUT, f.allreduce_out);
        let bytes = n * dtype.size();
        // The call's `algo` hint picks the family: the LL one-shot for
        // oneshot-ll, the push one-shot for the other one-shot algorithms,
        // the two-shot for a two-shot one; auto lets dispatch choose by
        // bytes, falling back to the push one-shot where the rows do not
        // fit the chosen kind's workspace.
        // (Only the call's hint: a communicator-wide choice such as nccl
        // is about plain all-reduces.)
        let asked = call.asked_algo()?.unwrap_or(AlgoChoice::Auto);
        let fits_two = fused_segment_rows(slot_bytes, world, hidden, dtype.size()) > 0;
        let fits_ll = tokens <= fused_ll_rows(slot_bytes, world, hidden, dtype.size());
        let kind = match asked {
            AlgoChoice::Auto => match choose_fused(bytes, tokens, world) {
                FusedKind::TwoShot if !fits_two => FusedKind::OneShot,
                FusedKind::OneShotLl if !fits_ll => FusedKind::OneShot,
                k => k,
            },
            AlgoChoice::Fixed(Algorithm::OneShotLl) => {
                if hidden > FUSED_LL_MAX_HIDDEN {
                    return bad(format!(
                        "a row of {hidden} elements does not fit the LL one-shot (at most {FUSED_LL_MAX_HIDDEN}); \
                         use the push one-shot"
                    ));
                }
                if !fits_ll {
                    return bad(format!(
                        "{tokens} rows of {hidden} x {dtype} do not fit one rank's LL lines at world {world} \
                         (at most {} rows); use the push one-shot or larger slot_bytes",
                        fused_ll_rows(slot_bytes, world, hidden, dtype.size())
                    ));
                }
                FusedKind::OneShotLl
            }
            AlgoChoice::Fixed(Algorithm::OneShot | Algorithm::OneShotPush) => FusedKind::OneShot,
            AlgoChoice::Fixed(Algorithm::TwoShot | Algorithm::TwoShotPush) => {
                if tokens > 0 && !fits_two {
                    return bad(format!(
                        "a row of {hidden} x {dtype} does not fit one rank's two-shot inbox at world {world}; \
                         use the one-shot or larger slot_bytes"
                    ));
                }
                FusedKind::TwoShot
            }
            AlgoChoice::Fixed(other) => {
                return Err(Error::Unsupported(format!(
                    "all_reduce_fused runs ferrocomm's one-shot or two-shot kernels, not {other}"
                )))
            }
        };
        crate::fc_log!(
            tracing::Level::DEBUG,
            "dispatch: all_reduce_fused {}{} {tokens} x {hidden} {dtype} ({bytes} bytes, world {world}) -> {}",
            if f.moe.is_some() { "moe_" } else { "" },
            f.pattern,
            kind.name()
        );
        Ok(FusedCall {
            kind,
            pattern: f.pattern,
            dtype,
            tokens,
            hidden,
            eps: if f.pattern.norms() { f.eps } else { 0.0 },
            input: input.ptr(),
            ptrs,
            moe: moe_call,
        })
    }
}
