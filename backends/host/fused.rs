//! The host twin of `kernels-cuda/fused.cu`: the fused all-reduce epilogue
//! with the protocols of the push one-shot (chunks of whole rows, one epoch
//! each, a grid of one block), the LL one-shot (the LL units of `ll.rs`) and
//! the push two-shot, and per row exactly the GPU's
//! fp32 order (docs/protocol.md, "Fused epilogues"): 32 lane partials of the
//! sum of squares over 8-element packs, a fixed butterfly, correctly rounded
//! division and square root. With the MoE-finalize prologue, each row is
//! computed from the experts' output as it is staged ([`moe_row`], the
//! order of `fu_moe_pack`). The sequence-parallel form ([`seq_parallel`])
//! follows `fused_sp`: the two-shot's chunks with the shards as segments.

use half::{bf16, f16};

use super::kernels::{copy_bytes, Launch};
use super::ll;
use crate::algo::fused::{
    fp8_min_scale, int8_min_scale, FusedInput, FusedKind, FusionPattern, FP8_MAX, INT8_MAX, MOE_IDX, MOE_ROWS,
    MOE_SCALES, MOE_SCALE_F32, MOE_SHARED, MOE_TOPK, PTR_ALLREDUCE_OUT, PTR_NORM_OUT, PTR_QUANT_OUT, PTR_RESIDUAL_IN,
    PTR_RESIDUAL_OUT, PTR_SCALE, PTR_SF_OUT, PTR_WEIGHT, ROW_MOE, ROW_PTRS, ROW_SCALARS, SCALAR_EPS, SCALAR_HIDDEN,
    SCALAR_SF_LAYOUT, SCALAR_TOKENS,
};
use crate::algo::layout::{push_oneshot_stride, push_twoshot_stride};
use crate::algo::nvfp4::{quantize_block, SfLayout, NVFP4_BLOCK};
use crate::codec::{Fp8Flavor, Half16};
use crate::device::DevicePtr;

/// Lanes of the sum-of-squares partials (a GPU row group).
const LANES: usize = 32;

/// The one-shot fused kernel. Returns the last epoch (as `kernels::launch` wants).
///
/// # Safety
/// `l.p` describes live workspaces and live tensors of the shapes its
/// fused arguments give (the communicator validated them): the input,
/// residuals and normed output `tokens x hidden`, the weight `hidden`, the
/// quantized output `tokens x hidden` bytes (NVFP4: half that, and the
/// scale factors of the call's layout), the scale one or `tokens` f32;
/// with [`FusedInput::MoeFinalize`], the input is the experts' output of
/// `MOE_ROWS` rows and the MoE row of the params holds live index, scale
/// and (non-zero) shared-expert tensors of `tokens x topk` and `tokens x
/// hidden` elements.
pub(super) unsafe fn run(
    l: &Launch,
    kind: FusedKind,
    input: FusedInput,
    pattern: FusionPattern,
    bf: bool,
) -> Option<u32> {
    let moe = input == FusedInput::MoeFinalize;
    // SAFETY: forwarded from the caller.
    unsafe {
        match (kind, bf) {
            (FusedKind::OneShot, true) => oneshot::<bf16>(l, pattern, moe),
            (FusedKind::OneShot, false) => oneshot::<f16>(l, pattern, moe),
            (FusedKind::OneShotLl, true) => oneshot_ll::<bf16>(l, pattern, moe),
            (FusedKind::OneShotLl, false) => oneshot_ll::<f16>(l, pattern, moe),
            (FusedKind::TwoShot, true) => twoshot::<bf16>(l, pattern, moe),
            (FusedKind::TwoShot, false) => twoshot::<f16>(l, pattern, moe),
            (FusedKind::SpGather | FusedKind::SpShard, true) => seq_parallel::<bf16>(l, pattern, kind),
            (FusedKind::SpGather | FusedKind::SpShard, false) => seq_parallel::<f16>(l, pattern, kind),
        }
    }
}

/// Stage rows `[a, a + n)` (global) of the call's input into `dsts`: a
/// copy of the input's rows, or (MoE) each row computed once by
/// [`moe_row`] and written to every destination. Row `a + j` goes to
/// `dst + j * row_bytes`.
///
/// # Safety: see [`run`]; every destination holds `n` rows.
unsafe fn stage<T: Half16>(p: &crate::device::KernelParams, moe: bool, a: usize, n: usize, dsts: &[DevicePtr]) {
    let hidden = p.per_peer[ROW_SCALARS][SCALAR_HIDDEN] as usize;
    let row_bytes = hidden * 2;
    if !moe {
        for &d in dsts {
            // SAFETY: the input holds rows a..a+n; d holds n rows (caller).
            unsafe { copy_bytes(d, p.input.offset(a * row_bytes), n * row_bytes) };
        }
        return;
    }
    let mut row = vec![0u16; hidden];
    for j in 0..n {
        // SAFETY: row a + j is a token of the call (caller).
        unsafe { moe_row::<T>(p, a + j, &mut row) };
        for &d in dsts {
            // SAFETY: d holds n rows (caller); `row` is hidden u16s.
            unsafe { copy_bytes(d.offset(j * row_bytes), DevicePtr(row.as_ptr() as u64), row_bytes) };
        }
    }
}

/// The MoE-finalized row of token `t` (bits of `T`), element by element as
/// `fu_moe_pack`: `acc = shared[t][j]` (or +0), then for k = 0..topk in
/// order, `acc = acc + scale[t][k] * expert_out[perm[t][k]][j]` (product
/// rounded, then the sum; Rust never contracts to an FMA), skipping a
/// permuted index outside `[0, MOE_ROWS)`; the row is `round(acc)`.
///
/// # Safety: see [`run`] (the MoE row of the params is live).
unsafe fn moe_row<T: Half16>(p: &crate::device::KernelParams, t: usize, out: &mut [u16]) {
    let m = p.per_peer[ROW_MOE];
    let hidden = out.len();
    let topk = m[MOE_TOPK] as usize;
    let rows = m[MOE_ROWS];
    let mut acc = vec![0f32; hidden];
    // SAFETY (every read below): the tensors hold token t's entries and
    // the expert rows below MOE_ROWS (caller).
    unsafe {
        if m[MOE_SHARED] != 0 {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = read::<T>(m[MOE_SHARED], t * hidden + j).to_f32();
            }
        }
        for k in 0..topk {
            let e = t * topk + k;
            let r = (m[MOE_IDX] as *const i32).add(e).read_unaligned();
            if r < 0 || r as u64 >= rows {
                continue;
            }
            let s = if m[MOE_SCALE_F32] != 0 {
                (m[MOE_SCALES] as *const f32).add(e).read_unaligned()
            } else {
                read::<T>(m[MOE_SCALES], e).to_f32()
            };
            let base = r as usize * hidden;
            for (j, a) in acc.iter_mut().enumerate() {
                *a += s * read::<T>(p.input.0, base + j).to_f32();
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = round::<T>(a).to_bits();
    }
}

/// # Safety: see [`run`].
unsafe fn oneshot<T: Half16>(l: &Launch, pattern: FusionPattern, moe: bool) -> Option<u32> {
    let p = l.p;
    let hidden = p.per_peer[ROW_SCALARS][SCALAR_HIDDEN] as usize;
    let tokens = p.per_peer[ROW_SCALARS][SCALAR_TOKENS] as usize;
    let me = l.me();
    let world = l.world();
    let row_bytes = hidden * 2;
    let stride = push_oneshot_stride(l.slot_bytes(), world);
    let cap = stride / row_bytes;
    if cap == 0 || tokens == 0 {
        // The communicator launches neither (it validates that a row fits).
        return None;
    }
    let nchunk = tokens.div_ceil(cap);
    for c in 0..nchunk {
        let l = l.chunk(c);
        let first = c * cap;
        let n = cap.min(tokens - first);
        // Staggered, as the GPU blocks are: peers first, ourselves last.
        let dsts: Vec<DevicePtr> = (1..=world)
            .map(|k| l.region((me + k) % world).offset(me * stride))
            .collect();
        // SAFETY: n rows fit a sub-buffer (n <= cap); rows first.. are the call's.
        unsafe { stage::<T>(p, moe, first, n, &dsts) };
        l.arrive(0);
        if !l.wait(0) {
            return None;
        }
        let region = l.region(me);
        for row in 0..n {
            let srcs: Vec<DevicePtr> = (0..world)
                .map(|s| region.offset(s * stride + row * row_bytes))
                .collect();
            // SAFETY: every source row lies in our region; the tensors hold row first + row.
            unsafe { epilogue_row::<T>(l.p, pattern, &srcs, first + row, hidden) };
        }
    }
    Some(l.epoch.wrapping_add(nchunk as u32 - 1))
}

/// One-shot, LL (as `fused_oneshot_ll`): our rows (staged once: a copy, or
/// the MoE rows) as LL units to every peer, the handshake, every peer's
/// rows pulled from our lines, then each row's epilogue over the sources in
/// rank order. One epoch for the whole call (the communicator checked that
/// the rows fit one source's part of the Lamport area, which LL lines of
/// the same slots also hold). The GPU kernel sends the rows as they are
/// through the Lamport area; the data flow and every result are the same.
/// Returns the epoch.
///
/// # Safety: see [`run`].
unsafe fn oneshot_ll<T: Half16>(l: &Launch, pattern: FusionPattern, moe: bool) -> Option<u32> {
    let p = l.p;
    let hidden = p.per_peer[ROW_SCALARS][SCALAR_HIDDEN] as usize;
    let tokens = p.per_peer[ROW_SCALARS][SCALAR_TOKENS] as usize;
    let (me, world) = (l.me(), l.world());
    let row_bytes = hidden * 2;
    if tokens == 0 {
        return None;
    }
    let mut mine = vec![0u8; tokens * row_bytes];
    // SAFETY: `mine` holds every row; the rows are the call's.
    unsafe { stage::<T>(p, moe, 0, tokens, &[DevicePtr(mine.as_mut_ptr() as u64)]) };
    for k in 1..world {
        ll::push(l, (me + k) % world, &mine);
    }
    if !ll::handshake(l) {
        return None;
    }
    let want: Vec<usize> = (0..world).map(|s| if s == me { 0 } else { mine.len() }).collect();
    let bufs = ll::pull(l, &want)?;
    let srcs = ll::sources(me, DevicePtr(mine.as_ptr() as u64), &bufs);
    for row in 0..tokens {
        let rows: Vec<DevicePtr> = srcs.iter().map(|s| s.offset(row * row_bytes)).collect();
        // SAFETY: every source holds every row; the tensors hold row `row`.
        unsafe { epilogue_row::<T>(p, pattern, &rows, row, hidden) };
    }
    Some(l.epoch)
}

/// Two-shot, push, by whole rows (as `fused_twoshot`): chunks of `world`
/// segments of at most one inbox of rows each; segment `d` of a chunk of
/// `n` rows is rows `[d*seg, min((d+1)*seg, n))`, `seg = ceil(n / world)`;
/// its row `j` sits at `(j - d*seg) * row_bytes` of inbox `[src]` of rank
/// `d`, and of every rank's result slot at `d * stride`. Per chunk `c`:
/// S1(c) our rows of segment `d` into rank `d`'s inbox `[rank]`, arrive 0;
/// W0(c); S2(c) reduce our segment from our inboxes into every rank's result
/// slot, arrive 1; S1(c + 1); W1(c); S3(c) the epilogue of every row from
/// our own result slot. Returns the last epoch.
///
/// # Safety: see [`run`].
unsafe fn twoshot<T: Half16>(l: &Launch, pattern: FusionPattern, moe: bool) -> Option<u32> {
    let p = l.p;
    let hidden = p.per_peer[ROW_SCALARS][SCALAR_HIDDEN] as usize;
    let tokens = p.per_peer[ROW_SCALARS][SCALAR_TOKENS] as usize;
    let me = l.me();
    let world = l.world();
    let row_bytes = hidden * 2;
    let stride = push_twoshot_stride(l.slot_bytes(), world);
    let cap = stride / row_bytes;
    if cap == 0 || tokens == 0 {
        return None;
    }
    let chunk = cap * world;
    let nchunk = tokens.div_ceil(chunk);
    // (first row, rows, segment rows) of chunk c.
    let geometry = |c: usize| {
        let first = c * chunk;
        let n = chunk.min(tokens - first);
        (first, n, n.div_ceil(world))
    };
    // (first row, rows) of segment d.
    let seg_rows = |n: usize, seg: usize, d: usize| {
        let a = (d * seg).min(n);
        (a, (a + seg).min(n) - a)
    };
    let stage1 = |c: usize| {
        let l = l.chunk(c);
        let (first, n, seg) = geometry(c);
        for k in 1..=world {
            let d = (me + k) % world;
            let (a, len) = seg_rows(n, seg, d);
            // SAFETY: a segment fits an inbox; rows first + a.. are the call's.
            unsafe { stage::<T>(p, moe, first + a, len, &[l.region(d).offset(me * stride)]) };
        }
        l.arrive(0);
    };
    stage1(0);
    for c in 0..nchunk {
        let l = l.chunk(c);
        let (first, n, seg) = geometry(c);
        let result = |r: usize| l.region(r).offset(l.slot_bytes());
        if !l.wait(0) {
            return None;
        }
        // S2: our segment, reduced in rank order, into every result slot.
        let (a, len) = seg_rows(n, seg, me);
        let inbox = l.region(me);
        for j in 0..len * hidden {
            // SAFETY: element j of the segment lies in every inbox and result slot.
            unsafe {
                let mut acc = read::<T>(inbox.0, j).to_f32();
                for s in 1..world {
                    acc += read::<T>(inbox.offset(s * stride).0, j).to_f32();
                }
                let v: T = round(acc);
                for q in 0..world {
                    write(result(q).offset(me * stride).0, j, v);
                }
            }
        }
        l.arrive(1);
        if c + 1 < nchunk {
            stage1(c + 1);
        }
        if !l.wait(1) {
            return None;
        }
        // S3: every row's epilogue from our own result slot (one source).
        for d in 0..world {
            let (a, len) = seg_rows(n, seg, d);
            for row in a..a + len {
                let src = result(me).offset(d * stride + (row - d * seg) * row_bytes);
                // SAFETY: the row lies in our result slot; the tensors hold row first + row.
                unsafe { epilogue_row::<T>(p, pattern, &[src], first + row, hidden) };
            }
        }
        let _ = a;
    }
    Some(l.epoch.wrapping_add(nchunk as u32 - 1))
}

/// The sequence-parallel form (as `fused_sp`): `S = tokens / world` rows a
/// rank, rank `d` owning rows `[d*S, (d+1)*S)`; chunk `c` holds shard rows
/// `[c*cap, c*cap + n)` of every shard (`cap` rows an inbox, the
/// two-shot's), row `d*S + c*cap + i` at `i * row_bytes` of rank `d`'s
/// inbox `[src]`, and of every rank's result slot at `d * stride`. Shard
/// form, per chunk: S1(c) our rows of every shard into its owner's inbox,
/// arrive 0; W0(c); the whole epilogue of our `n` rows from our inboxes
/// (sources in rank order) with our residual shard, outputs at the shard's
/// rows. Gathered form: S1(c), arrive 0; W0(c); S2(c) our rows reduced,
/// the residual add, `residual_out` (`allreduce_out`), the new residual
/// rows into every rank's result slot, arrive 1; W1(c); S3(c) the norm and
/// quantization of every chunk row from our own result slot, outputs at the
/// global rows; then S1(c + 1). Returns the last epoch.
///
/// # Safety: see [`run`] (the residual tensors and `allreduce_out` hold `S`
/// rows; the normed and quantized outputs `tokens` rows, gathered, or `S`).
unsafe fn seq_parallel<T: Half16>(l: &Launch, pattern: FusionPattern, kind: FusedKind) -> Option<u32> {
    let p = l.p;
    let hidden = p.per_peer[ROW_SCALARS][SCALAR_HIDDEN] as usize;
    let tokens = p.per_peer[ROW_SCALARS][SCALAR_TOKENS] as usize;
    let (me, world) = (l.me(), l.world());
    let row_bytes = hidden * 2;
    let stride = push_twoshot_stride(l.slot_bytes(), world);
    let cap = stride / row_bytes;
    let shard = tokens / world;
    if cap == 0 || shard == 0 {
        return None;
    }
    // ResidualAdd has nothing to gather (the communicator refuses it).
    let gather = kind == FusedKind::SpGather && pattern.norms();
    let nchunk = shard.div_ceil(cap);
    let rows = |c: usize| (c * cap, cap.min(shard - c * cap));
    let stage1 = |c: usize| {
        let l = l.chunk(c);
        let (first, n) = rows(c);
        for k in 1..=world {
            let d = (me + k) % world;
            // SAFETY: n rows fit an inbox; rows d*S + first.. are the call's.
            unsafe { stage::<T>(p, false, d * shard + first, n, &[l.region(d).offset(me * stride)]) };
        }
        l.arrive(0);
    };
    if gather {
        stage1(0);
    }
    for c in 0..nchunk {
        let l = l.chunk(c);
        let (first, n) = rows(c);
        if !gather {
            stage1(c);
        }
        if !l.wait(0) {
            return None;
        }
        let inbox = l.region(me);
        let srcs =
            |i: usize| -> Vec<DevicePtr> { (0..world).map(|s| inbox.offset(s * stride + i * row_bytes)).collect() };
        if !gather {
            for i in 0..n {
                // SAFETY: every source row lies in our inboxes; the shard's tensors hold row first + i.
                unsafe { epilogue_row::<T>(p, pattern, &srcs(i), first + i, hidden) };
            }
            continue;
        }
        // S2: our rows, the residual add, and the new residual rows to
        // every rank's result slot.
        let result = |r: usize| l.region(r).offset(l.slot_bytes());
        let res_out = p.per_peer[ROW_PTRS][PTR_RESIDUAL_OUT];
        for i in 0..n {
            // SAFETY: as above; ResidualAdd stops after residual_out.
            unsafe {
                epilogue_row::<T>(p, FusionPattern::ResidualAdd, &srcs(i), first + i, hidden);
                let row = DevicePtr(res_out).offset((first + i) * row_bytes);
                for q in 0..world {
                    copy_bytes(result(q).offset(me * stride + i * row_bytes), row, row_bytes);
                }
            }
        }
        l.arrive(1);
        if !l.wait(1) {
            return None;
        }
        // S3: every row of the chunk, normed from our result slot.
        for d in 0..world {
            for i in 0..n {
                let src = result(me).offset(d * stride + i * row_bytes);
                // SAFETY: the row lies in our result slot; the outputs hold `tokens` rows.
                unsafe { norm_row::<T>(p, pattern, src, d * shard + first + i, hidden) };
            }
        }
        if c + 1 < nchunk {
            stage1(c + 1);
        }
    }
    Some(l.epoch.wrapping_add(nchunk as u32 - 1))
}

/// Round to `T` (nearest even), NaN to the canonical NaN (as `fu_pack`).
fn round<T: Half16>(x: f32) -> T {
    if x.is_nan() {
        T::from_bits(T::NAN_BITS)
    } else {
        T::from_f32(x)
    }
}

/// Quantize one value: `v / scale` correctly rounded, then FP8 e4m3fn
/// (nearest even, saturated, NaN 0x7f) or INT8 (nearest even, clamped to
/// +-127, NaN 0).
fn quantize(pattern: FusionPattern, v: f32, scale: f32) -> u8 {
    let q = v / scale;
    match pattern {
        FusionPattern::ResidualRmsNormInt8PerToken => {
            if q.is_nan() {
                0
            } else {
                q.round_ties_even().clamp(-INT8_MAX, INT8_MAX) as i8 as u8
            }
        }
        _ => Fp8Flavor::E4m3Fn.encode(q),
    }
}

/// # Safety: raw reads and writes at the addresses the caller vouches for.
unsafe fn read<T: Half16>(at: u64, i: usize) -> T {
    // SAFETY: guaranteed by the caller.
    unsafe { T::from_bits((at as *const u16).add(i).read_unaligned()) }
}
unsafe fn write<T: Half16>(at: u64, i: usize, v: T) {
    // SAFETY: guaranteed by the caller.
    unsafe { (at as *mut u16).add(i).write_unaligned(v.to_bits()) }
}

/// The epilogue of global row `g`, whose sources (every rank's row, rank
/// order) are `srcs`.
///
/// # Safety: see [`oneshot`]; every `srcs` row holds `hidden` elements.
unsafe fn epilogue_row<T: Half16>(
    p: &crate::device::KernelParams,
    pattern: FusionPattern,
    srcs: &[DevicePtr],
    g: usize,
    hidden: usize,
) {
    let ptr = p.per_peer[ROW_PTRS];
    let base = g * hidden;
    // SAFETY (every access below): the tensors hold row g (caller).
    unsafe {
        // Pass 1: all-reduce (rank order), residual add.
        for j in 0..hidden {
            let mut a = read::<T>(srcs[0].0, j).to_f32();
            for s in &srcs[1..] {
                a += read::<T>(s.0, j).to_f32();
            }
            let ar: T = round(a);
            if ptr[PTR_ALLREDUCE_OUT] != 0 {
                write(ptr[PTR_ALLREDUCE_OUT], base + j, ar);
            }
            let res: T = round(ar.to_f32() + read::<T>(ptr[PTR_RESIDUAL_IN], base + j).to_f32());
            write(ptr[PTR_RESIDUAL_OUT], base + j, res);
        }
        if pattern.norms() {
            let row = DevicePtr(ptr[PTR_RESIDUAL_OUT]).offset(base * 2);
            norm_row::<T>(p, pattern, row, g, hidden);
        }
    }
}

/// RMSNorm and quantization of global row `g` (outputs at row `g`) from
/// its residual row at `res` (`residual_out`'s, or the sequence-parallel
/// form's gathered row): lane partials of the sum of squares, the
/// butterfly, the normed row and its quantization.
///
/// # Safety: see [`oneshot`]; `res` holds `hidden` elements.
unsafe fn norm_row<T: Half16>(
    p: &crate::device::KernelParams,
    pattern: FusionPattern,
    res: DevicePtr,
    g: usize,
    hidden: usize,
) {
    let ptr = p.per_peer[ROW_PTRS];
    let eps = f32::from_bits(p.per_peer[ROW_SCALARS][SCALAR_EPS] as u32);
    let base = g * hidden;
    // SAFETY (every access below): `res` and the outputs hold row g (caller).
    unsafe {
        let mut lanes = [0f32; LANES];
        for j in 0..hidden {
            // Pack j / 8 belongs to lane (j / 8) % 32, elements in order.
            let x = read::<T>(res.0, j).to_f32();
            let lane = &mut lanes[(j / 8) % LANES];
            *lane += x * x;
        }
        let ss = butterfly(lanes, |a, b| a + b);
        let rstd = 1.0f32 / ((ss / hidden as f32) + eps).sqrt();
        let normed = |j: usize| -> T {
            let x = read::<T>(res.0, j).to_f32();
            let w = read::<T>(ptr[PTR_WEIGHT], j).to_f32();
            round(x * rstd * w)
        };
        let quant = ptr[PTR_QUANT_OUT] as *mut u8;
        let scale_at = ptr[PTR_SCALE] as *mut f32;
        // Pass 2: the normed row, static quantization, the absolute maximum.
        let mut amax = 0f32;
        let static_scale = match pattern {
            FusionPattern::ResidualRmsNormFp8 | FusionPattern::ResidualRmsNormNvfp4 => scale_at.read_unaligned(),
            _ => 1.0,
        };
        let mut ys = Vec::new();
        for j in 0..hidden {
            let y = normed(j);
            if ptr[PTR_NORM_OUT] != 0 {
                write(ptr[PTR_NORM_OUT], base + j, y);
            }
            match pattern {
                FusionPattern::ResidualRmsNormFp8 => {
                    *quant.add(base + j) = quantize(pattern, y.to_f32(), static_scale);
                }
                FusionPattern::ResidualRmsNormNvfp4 => ys.push(y.to_f32()),
                // f32::max drops a NaN operand, as fmaxf does.
                _ => amax = amax.max(y.to_f32().abs()),
            }
        }
        if pattern.nvfp4() {
            nvfp4_row(p, &ys, g, static_scale);
            return;
        }
        if !pattern.per_token() {
            return;
        }
        // The GPU's lane maxima combine in any order to the same value.
        let (qmax, min_scale) = match pattern {
            FusionPattern::ResidualRmsNormInt8PerToken => (INT8_MAX, int8_min_scale()),
            _ => (FP8_MAX, fp8_min_scale()),
        };
        let scale = (amax / qmax).max(min_scale);
        scale_at.add(g).write_unaligned(scale);
        for j in 0..hidden {
            *quant.add(base + j) = quantize(pattern, normed(j).to_f32(), scale);
        }
    }
}

/// NVFP4 of row `g` from its normed values (as stored, f32), block by
/// block as `fu_nvfp4_store`: 8 bytes of codes at `g * hidden / 2 + 8k`,
/// the scale factor where the call's layout puts it.
///
/// # Safety: the quantized output and the scale factors hold row `g` (see [`run`]).
unsafe fn nvfp4_row(p: &crate::device::KernelParams, ys: &[f32], g: usize, global_scale: f32) {
    let ptr = p.per_peer[ROW_PTRS];
    let layout = SfLayout::from_code(p.per_peer[ROW_SCALARS][SCALAR_SF_LAYOUT]);
    let cols = ys.len() / NVFP4_BLOCK;
    let quant = ptr[PTR_QUANT_OUT] as *mut u8;
    let sf_out = ptr[PTR_SF_OUT] as *mut u8;
    for (k, block) in ys.chunks(NVFP4_BLOCK).enumerate() {
        let (bytes, sf) = quantize_block(block, global_scale);
        // SAFETY: both outputs hold row g's codes and scale factors (caller).
        unsafe {
            let at = quant.add(g * ys.len() / 2 + k * bytes.len());
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), at, bytes.len());
            sf_out.add(layout.offset(g, k, cols)).write(sf);
        }
    }
}

/// The 32-lane butterfly of the GPU group: lane `l` combines lane `l ^ m`
/// for m = 16, 8, 4, 2, 1; every lane ends with the same value.
fn butterfly(mut v: [f32; LANES], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut m = LANES / 2;
    while m >= 1 {
        let prev = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = f(prev[l], prev[l ^ m]);
        }
        m /= 2;
    }
    v[0]
}
