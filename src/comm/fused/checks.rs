//! Every check of a fused call, before anything is queued, and the call it
//! becomes: the shape, the tensors its pattern takes, their memory, then
//! the planner's kernel family.

use super::Fusion;
use crate::algo::fused::{
    fused_ll_rows, fused_rows_per_chunk, fused_segment_rows, FusedCall, FusedForm, FusionPattern, MoeCall, SpOutput,
    FUSED_DTYPES, FUSED_MAX_HIDDEN, MOE_MAX_TOPK, PTR_ALLREDUCE_OUT, PTR_NORM_OUT, PTR_QUANT_OUT, PTR_RESIDUAL_IN,
    PTR_RESIDUAL_OUT, PTR_SCALE, PTR_SF_OUT, PTR_WEIGHT,
};
use crate::algo::layout::{push_oneshot_stride, push_twoshot_stride};
use crate::algo::nvfp4::NVFP4_BLOCK;
use crate::comm::call::Call;
use crate::comm::communicator::Communicator;
use crate::comm::tensor::Tensor;
use crate::device::{Device, MAX_RANKS};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::fused::{fused_kind, fused_sp_kind, FusedShape};

/// A tensor's role, for messages.
struct Role {
    what: &'static str,
    t: Tensor,
    output: bool,
}

impl Role {
    fn input(what: &'static str, t: Tensor) -> Role {
        Role { what, t, output: false }
    }

    fn output(what: &'static str, t: Tensor) -> Role {
        Role { what, t, output: true }
    }
}

/// The call's rows: `tokens` of `hidden` reduced, `n` elements in all; the
/// residual tensors hold `res_n` elements and the normed and quantized
/// outputs `out_tokens` rows (`out_n` elements), which the form decides.
struct Rows {
    tokens: usize,
    hidden: usize,
    n: usize,
    dtype: DType,
    res_n: usize,
    out_tokens: usize,
    out_n: usize,
}

/// Errors of one fused call, named by its entry point, form and pattern.
struct Errs {
    pattern: FusionPattern,
    form: FusedForm,
}

impl Errs {
    fn err(&self, m: String) -> Error {
        let form = match self.form.seq_parallel() {
            None => String::new(),
            Some(o) => format!(" {o}"),
        };
        Error::invalid(format!("{} ({}{form}): {m}", self.form.entry(), self.pattern))
    }

    /// `t` must be `count` x `dt`.
    fn expect(&self, what: &str, t: &Tensor, dt: DType, count: usize, rows: &Rows) -> Result<()> {
        if t.dtype() != dt || t.count() != count {
            return Err(self.err(format!(
                "{what} must be {count} x {dt} ({} x {} for rows), not {} x {}",
                count / rows.hidden.max(1),
                rows.hidden,
                t.count(),
                t.dtype()
            )));
        }
        Ok(())
    }

    /// `what` must not be given.
    fn unwanted(&self, what: &str, present: bool) -> Result<()> {
        if present {
            return Err(self.err(format!(
                "{what} was given, but pattern {} does not use it",
                self.pattern
            )));
        }
        Ok(())
    }
}

impl<D: Device> Communicator<D> {
    /// Every check of a fused call, before anything is queued: the call it
    /// becomes.
    pub(super) fn checked_fusion(&self, input: &Tensor, f: &Fusion, call: &Call<'_, D>) -> Result<FusedCall> {
        let e = Errs {
            pattern: f.pattern,
            form: f.form,
        };
        let rows = self.fused_rows(&e, input, f)?;
        let mut roles = vec![
            Role::input("input", *input),
            Role::input("residual_in", f.residual_in),
            Role::output("residual_out", f.residual_out),
        ];
        e.expect("residual_in", &f.residual_in, rows.dtype, rows.res_n, &rows)?;
        e.expect("residual_out", &f.residual_out, rows.dtype, rows.res_n, &rows)?;
        pattern_roles(&e, f, &rows, &mut roles)?;
        let moe = moe_roles(&e, f, input, &rows, &mut roles)?;
        self.check_fused_memory(&e, f, &roles, rows.n)?;

        let world = self.size();
        let slot_bytes = self.options().slot_bytes_for(self.device().facts().backend);
        let es = rows.dtype.size();
        let shape = FusedShape {
            dtype: rows.dtype,
            tokens: rows.tokens,
            hidden: rows.hidden,
            world,
            fits_two: fused_segment_rows(slot_bytes, world, rows.hidden, es) > 0,
            ll_rows: fused_ll_rows(slot_bytes, world, rows.hidden, es),
        };
        let asked = call.asked_algo()?;
        let kind = match f.form.seq_parallel() {
            None => fused_kind(asked, &shape),
            Some(out) => fused_sp_kind(asked, out, &shape),
        }
        .map_err(|err| match err {
            Error::InvalidArgument(m) => e.err(m),
            other => other,
        })?;
        crate::fc_log!(
            tracing::Level::DEBUG,
            "plan: {} {}{} {} x {} {} (world {world}) -> {}",
            f.form.entry(),
            if f.moe.is_some() { "moe_" } else { "" },
            f.pattern,
            rows.tokens,
            rows.hidden,
            rows.dtype,
            kind.name()
        );
        Ok(FusedCall {
            kind,
            pattern: f.pattern,
            dtype: rows.dtype,
            tokens: rows.tokens,
            hidden: rows.hidden,
            eps: if f.pattern.norms() { f.eps } else { 0.0 },
            input: input.ptr(),
            ptrs: pointers(f),
            moe,
            sf_layout: f.sf_layout,
        })
    }

    /// The dtype, row width and rows of a fused call, and that a row fits
    /// one rank's share of the workspace.
    fn fused_rows(&self, e: &Errs, input: &Tensor, f: &Fusion) -> Result<Rows> {
        let dtype = input.dtype();
        if !FUSED_DTYPES.contains(&dtype) {
            return Err(e.err(format!("the input is {dtype}; fused epilogues take f16 or bf16")));
        }
        let hidden = f.hidden;
        if hidden == 0 || hidden % 8 != 0 {
            return Err(e.err(format!("hidden = {hidden} must be a positive multiple of 8")));
        }
        if f.pattern.nvfp4() && hidden % NVFP4_BLOCK != 0 {
            return Err(e.err(format!(
                "hidden = {hidden} must be a multiple of {NVFP4_BLOCK} for NVFP4 (one scale factor per {NVFP4_BLOCK} elements of a row)"
            )));
        }
        if hidden > FUSED_MAX_HIDDEN {
            return Err(e.err(format!("hidden = {hidden} is larger than {FUSED_MAX_HIDDEN}")));
        }
        if input.count() % hidden != 0 {
            return Err(e.err(format!(
                "the input{} has {} elements, not a whole number of rows of {hidden}",
                if f.moe.is_some() { " (the experts' output)" } else { "" },
                input.count()
            )));
        }
        // Rows of the call: the input's, or with a MoE prologue the
        // residual's (the input is then the experts' rows).
        let tokens = match f.moe {
            None => input.count() / hidden,
            Some(_) if f.residual_in.count() % hidden != 0 => {
                return Err(e.err(format!(
                    "residual_in has {} elements, not a whole number of rows of {hidden} \
                     (with a MoE prologue it gives the tokens)",
                    f.residual_in.count()
                )))
            }
            Some(_) => f.residual_in.count() / hidden,
        };
        let world = self.size();
        // The workspace's slots (what Workspace::create was given).
        let slot_bytes = self.options().slot_bytes_for(self.device().facts().backend);
        if let Some(out) = f.form.seq_parallel() {
            sp_rows(e, f, out, tokens, hidden, world)?;
            if tokens > 0 && fused_segment_rows(slot_bytes, world, hidden, dtype.size()) == 0 {
                return Err(e.err(format!(
                    "a row of {hidden} x {dtype} ({} bytes) does not fit one rank's two-shot inbox \
                     ({} bytes at world {world}); create the communicator with larger slot_bytes",
                    hidden * dtype.size(),
                    push_twoshot_stride(slot_bytes, world)
                )));
            }
        }
        if tokens > 0 && fused_rows_per_chunk(slot_bytes, world, hidden, dtype.size()) == 0 {
            return Err(e.err(format!(
                "a row of {hidden} x {dtype} ({} bytes) does not fit one rank's share of the workspace \
                 ({} bytes at world {world}); create the communicator with larger slot_bytes",
                hidden * dtype.size(),
                push_oneshot_stride(slot_bytes, world)
            )));
        }
        let out_tokens = f.form.output_rows(tokens, world);
        Ok(Rows {
            tokens,
            hidden,
            n: tokens * hidden,
            dtype,
            res_n: f.form.residual_rows(tokens, world) * hidden,
            out_tokens,
            out_n: out_tokens * hidden,
        })
    }

    /// Every tensor of the call on this device, aligned as the kernels read
    /// it, and no output overlapping anything it may not replace.
    fn check_fused_memory(&self, e: &Errs, f: &Fusion, roles: &[Role], n: usize) -> Result<()> {
        for r in roles {
            let bytes = r.t.bytes()?;
            if bytes > 0 {
                self.inner
                    .device
                    .check_memory(r.t.ptr(), bytes)
                    .map_err(|err| e.err(format!("{}: {err}", r.what)))?;
            }
            // Rows move in 16-byte packs; the scale and the MoE index and
            // router weights are read an element at a time.
            let align = match r.what {
                "scale" | "sf_out" | "expanded_idx_to_permuted_idx" | "expert_scales" => r.t.dtype().size(),
                _ => 16,
            };
            if r.t.ptr().0 % align as u64 != 0 {
                return Err(e.err(format!(
                    "{} at {:#x} is not {align}-byte aligned ({})",
                    r.what,
                    r.t.ptr().0,
                    if align == 16 {
                        "the kernels move 16-byte packs"
                    } else {
                        "read an element at a time"
                    }
                )));
            }
        }
        let same = |a: &Tensor, b: &Tensor| a.ptr() == b.ptr() && a.count() == b.count();
        // With a MoE prologue the input (the experts' rows) is gathered
        // from anywhere while rows are written: nothing may replace it. In
        // the sequence-parallel form the input's rows go out chunk by chunk
        // while the shard's are written, and the shard is not the input's
        // shape: nothing may replace it either.
        let ar_in_place = f.moe.is_none() && f.form == FusedForm::AllReduce;
        let allowed = |out: &Role, other: &Role| {
            (out.what == "residual_out" && other.what == "residual_in" && same(&out.t, &other.t))
                || (out.what == "allreduce_out" && other.what == "input" && ar_in_place && same(&out.t, &other.t))
        };
        for (i, a) in roles.iter().enumerate() {
            for b in roles.iter().skip(i + 1) {
                if !(a.output || b.output) || n == 0 || !a.t.overlaps(&b.t) {
                    continue;
                }
                let (out, other) = if a.output { (a, b) } else { (b, a) };
                if !allowed(out, other) && !allowed(other, out) {
                    return Err(e.err(format!("{} overlaps {}", out.what, other.what)));
                }
            }
        }
        Ok(())
    }
}

/// The tensors the pattern takes (the norm's, the quantization's, the
/// all-reduce's own output), checked, and refused where it takes none.
fn pattern_roles(e: &Errs, f: &Fusion, rows: &Rows, roles: &mut Vec<Role>) -> Result<()> {
    let (n, dtype) = (rows.out_n, rows.dtype);
    if f.pattern.norms() {
        let Some(w) = f.weight else {
            return Err(e.err("RMSNorm needs a weight (Fusion::with_norm)".into()));
        };
        e.expect("weight", &w, dtype, rows.hidden, rows)?;
        if !(f.eps.is_finite() && f.eps >= 0.0) {
            return Err(e.err(format!("eps = {} must be finite and >= 0", f.eps)));
        }
        roles.push(Role::input("weight", w));
        match (f.norm_out, f.pattern) {
            (None, FusionPattern::ResidualRmsNorm) => {
                return Err(e.err("norm_out is required: it is the pattern's result".into()))
            }
            (None, _) => {}
            (Some(t), _) => {
                e.expect("norm_out", &t, dtype, n, rows)?;
                roles.push(Role::output("norm_out", t));
            }
        }
    } else {
        e.unwanted("weight", f.weight.is_some())?;
        e.unwanted("norm_out", f.norm_out.is_some())?;
    }
    if let Some(qdt) = f.pattern.quant_dtype() {
        let (Some(q), Some(s)) = (f.quant_out, f.scale) else {
            return Err(e.err("quant_out and scale are required (Fusion::with_quant)".into()));
        };
        e.expect("quant_out", &q, qdt, n, rows)?;
        let scales = if f.pattern.per_token() { rows.out_tokens } else { 1 };
        if s.dtype() != DType::F32 || s.count() != scales {
            return Err(e.err(format!(
                "scale must be {scales} x f32 ({}), not {} x {}",
                if f.pattern.per_token() {
                    "one per token, written"
                } else {
                    "the per-tensor scale, read"
                },
                s.count(),
                s.dtype()
            )));
        }
        roles.push(Role::output("quant_out", q));
        roles.push(Role {
            what: "scale",
            t: s,
            output: f.pattern.per_token(),
        });
    } else if f.pattern.nvfp4() {
        nvfp4_roles(e, f, rows, roles)?;
    } else {
        e.unwanted("quant_out", f.quant_out.is_some())?;
        e.unwanted("scale", f.scale.is_some())?;
    }
    if !f.pattern.nvfp4() {
        e.unwanted("sf_out", f.sf_out.is_some())?;
    }
    if let Some(t) = f.allreduce_out {
        e.expect("allreduce_out", &t, dtype, rows.res_n, rows)?;
        roles.push(Role::output("allreduce_out", t));
    }
    Ok(())
}

/// NVFP4's tensors: the packed values, the global scale (read) and the
/// scale factors of the call's layout.
fn nvfp4_roles(e: &Errs, f: &Fusion, rows: &Rows, roles: &mut Vec<Role>) -> Result<()> {
    let (Some(q), Some(s), Some(sf)) = (f.quant_out, f.scale, f.sf_out) else {
        return Err(e.err("quant_out, scale and sf_out are required (Fusion::with_nvfp4)".into()));
    };
    if q.dtype() != DType::U8 || q.count() != rows.out_n / 2 {
        return Err(e.err(format!(
            "quant_out must be {} x u8 (two e2m1 values a byte, {} x {} for rows), not {} x {}",
            rows.out_n / 2,
            rows.out_tokens,
            rows.hidden,
            q.count(),
            q.dtype()
        )));
    }
    if s.dtype() != DType::F32 || s.count() != 1 {
        return Err(e.err(format!(
            "scale must be 1 x f32 (the global scale, read), not {} x {}",
            s.count(),
            s.dtype()
        )));
    }
    let want = f.sf_layout.sf_bytes(rows.out_tokens, rows.hidden);
    if !matches!(sf.dtype(), DType::F8E4M3 | DType::U8) || sf.count() != want {
        return Err(e.err(format!(
            "sf_out must be {want} x f8e4m3 or u8 (the {} layout of {} x {} rows), not {} x {}",
            f.sf_layout,
            rows.out_tokens,
            rows.hidden / NVFP4_BLOCK,
            sf.count(),
            sf.dtype()
        )));
    }
    roles.push(Role::output("quant_out", q));
    roles.push(Role::input("scale", s));
    roles.push(Role::output("sf_out", sf));
    Ok(())
}

/// What the sequence-parallel form asks of a call's rows beyond the
/// all-reduce's: whole shards, no MoE prologue, and something to gather.
fn sp_rows(e: &Errs, f: &Fusion, out: SpOutput, tokens: usize, hidden: usize, world: usize) -> Result<()> {
    if f.moe.is_some() {
        return Err(e.err(
            "the sequence-parallel form takes no MoE-finalize prologue (finalize first, or use all_reduce_fused)"
                .into(),
        ));
    }
    if tokens % world != 0 {
        return Err(e.err(format!(
            "tokens = {tokens} (the input's rows of {hidden}) is not a multiple of the world size {world}: \
             every rank owns tokens / world rows"
        )));
    }
    if out == SpOutput::Gathered && !f.pattern.norms() {
        return Err(e.err(format!(
            "pattern {} has no normed rows to gather (its outputs are the residual shard); use SpOutput::Shard",
            f.pattern
        )));
    }
    Ok(())
}

/// The MoE-finalize prologue's tensors, checked, and what the kernel reads
/// of them.
fn moe_roles(e: &Errs, f: &Fusion, input: &Tensor, rows: &Rows, roles: &mut Vec<Role>) -> Result<Option<MoeCall>> {
    let Some(m) = &f.moe else { return Ok(None) };
    let (tokens, dtype) = (rows.tokens, rows.dtype);
    if m.topk == 0 || m.topk > MOE_MAX_TOPK {
        return Err(e.err(format!("topk = {} must be 1 to {MOE_MAX_TOPK}", m.topk)));
    }
    let pairs = tokens * m.topk;
    let idx = m.expanded_idx_to_permuted_idx;
    if idx.dtype() != DType::I32 || idx.count() != pairs {
        return Err(e.err(format!(
            "expanded_idx_to_permuted_idx must be {pairs} x i32 ({tokens} tokens x topk {}), not {} x {}",
            m.topk,
            idx.count(),
            idx.dtype()
        )));
    }
    let sc = m.expert_scales;
    if !(sc.dtype() == DType::F32 || sc.dtype() == dtype) || sc.count() != pairs {
        return Err(e.err(format!(
            "expert_scales must be {pairs} x f32 or {pairs} x {dtype} ({tokens} tokens x topk {}), not {} x {}",
            m.topk,
            sc.count(),
            sc.dtype()
        )));
    }
    roles.push(Role::input("expanded_idx_to_permuted_idx", idx));
    roles.push(Role::input("expert_scales", sc));
    if let Some(t) = m.shared_expert_output {
        e.expect("shared_expert_output", &t, dtype, rows.n, rows)?;
        roles.push(Role::input("shared_expert_output", t));
    }
    Ok(Some(MoeCall {
        topk: m.topk,
        permuted_rows: input.count() / rows.hidden,
        scales_f32: sc.dtype() == DType::F32,
        idx: idx.ptr().0,
        scales: sc.ptr().0,
        shared: m.shared_expert_output.map_or(0, |t| t.ptr().0),
    }))
}

/// The kernel's table of the call's tensors (0 for those the pattern does
/// not take).
fn pointers(f: &Fusion) -> [u64; MAX_RANKS] {
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
    if f.pattern.quant_dtype().is_some() || f.pattern.nvfp4() {
        set(PTR_QUANT_OUT, f.quant_out);
        set(PTR_SCALE, f.scale);
    }
    if f.pattern.nvfp4() {
        set(PTR_SF_OUT, f.sf_out);
    }
    set(PTR_ALLREDUCE_OUT, f.allreduce_out);
    ptrs
}
