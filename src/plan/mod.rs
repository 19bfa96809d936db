//! The planner: how one call runs, decided in one place.
//!
//! `plan` is a pure function of a `Request` (the collective, dtype, op,
//! count, the call's own choice and this rank's operand addresses) and the
//! communicator's `Facts` (backend, world, workspace, levels, library,
//! options, tuned table). It returns a `Plan`: nothing, a local copy,
//! NCCL/RCCL, the two levels across nodes, or one of ferrocomm's kernels,
//! possibly staged.
//!
//! What every rank must run alike (the route, the kernel kind, the element
//! it moves, chunking) comes only from what every rank shares: the call's
//! shape, its hints (every rank passes the same), the options (every rank
//! sets them alike), whether the library loaded (on every rank, or the
//! communicator failed at init) and the tuned table (rank 0's, adopted by
//! every rank). This rank's own addresses decide only local staging
//! (`Kernel::staged`): a choice every rank must share is never made from a
//! per-rank fact.
//!
//! Precedence, the first that applies:
//! 1. what the communicator's shape forces: the levels across nodes, no
//!    workspace (NCCL/RCCL), a world of one (a copy), an empty call;
//! 2. the call's choice (`Call::algo`, `Call::coll_algo`, their hints),
//!    where that way can run the call (all-reduce refuses one that cannot);
//! 3. the options: `FERROCOMM_ALGO`, `FERROCOMM_COLL_ROUTE`,
//!    `FERROCOMM_COLL_LL_BYTES`, `FERROCOMM_DIRECT_MIN_BYTES`,
//!    `FERROCOMM_QUICK_REDUCE`, deterministic;
//! 4. the tuned table's ladder (autotune at init; a step whose way cannot
//!    run the call hands it to the next);
//! 5. the defaults: the table's default ladders and thresholds
//!    (`table`), the inbox kinds, which run everything.

mod algorithm;
pub(crate) mod fused;
pub(crate) mod table;
#[cfg(test)]
mod tests;

pub use algorithm::{Algorithm, Collective};
pub(crate) use table::DispatchTable;
pub use table::{DtypeClass, Ladders, Step};
testing_pub! { use algorithm::parse_choice; }
testing_pub! { use table::step_for; }

use crate::algo::kernels::{KernelKind, KERNEL_OPS, QR_DTYPES};
use crate::codec::Codec;
use crate::comm::CommOptions;
use crate::device::{BackendKind, DevicePtr, MAX_RANKS};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use table::{ll_max_block_bytes, CUSTOM_MIN_BLOCK_BYTES, DIRECT_MIN_BLOCK_BYTES, DIRECT_MIN_REDUCE_TO_BYTES};

/// What every rank of a communicator shares, as the planner reads it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Facts<'a> {
    pub backend: BackendKind,
    pub world: usize,
    /// A workspace for ferrocomm's kernels (one node, at most
    /// [`MAX_RANKS`] ranks).
    pub kernels: bool,
    /// The two levels of a communicator that spans nodes: `Some(uniform)`,
    /// whether its nodes have equal sizes.
    pub levels: Option<bool>,
    /// NCCL/RCCL loaded.
    pub vendor: bool,
    /// The largest per-peer block (bytes) one source's LL lines carry (0
    /// without a workspace).
    pub ll_room: usize,
    /// A symmetric heap is reserved (the direct kinds' condition).
    pub heap: bool,
    pub opts: &'a CommOptions,
    pub table: &'a DispatchTable,
}

impl Facts<'_> {
    fn host(&self) -> bool {
        self.backend == BackendKind::Host
    }
}

/// One call, as the planner sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request<'a> {
    pub coll: Collective,
    pub dtype: DType,
    /// `Sum` for the collectives that only move data.
    pub op: ReduceOp,
    /// Elements: all-reduce's, broadcast's and reduce's count; for the
    /// others the per-peer block every rank agrees on, 0 where there is
    /// none (all-to-all with splits or of lists, sends and receives).
    pub count: usize,
    /// The call's own choice.
    pub asked: Option<Algorithm>,
    /// This rank's operands as the kernel would load them (all-reduce and
    /// broadcast): their alignment decides local staging only.
    pub operands: &'a [DevicePtr],
}

impl Request<'_> {
    fn bytes(&self) -> usize {
        self.count.saturating_mul(self.dtype.size())
    }
}

/// How a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Nothing to run.
    Nothing,
    /// A world of one: the output is the input (copied where they differ).
    Copy,
    /// NCCL/RCCL underneath.
    Vendor,
    /// The two levels of a communicator across nodes.
    Levels,
    /// One of ferrocomm's kernels.
    Kernel(Kernel),
}

/// A launch of one of ferrocomm's kernel kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kernel {
    pub kind: KernelKind,
    pub codec: Option<Codec>,
    /// What it moves: the call's dtype, or broadcast's word.
    pub elem: DType,
    /// This rank's operands go through the staging buffer (copied in,
    /// aligned, and out): a local choice, made from this rank's addresses.
    pub staged: bool,
    /// The payload is padded to whole words in the staging buffer (a
    /// broadcast no word divides, without NCCL/RCCL): every rank alike.
    pub padded: bool,
}

impl Kernel {
    fn of(kind: KernelKind, elem: DType) -> Kernel {
        Kernel {
            kind,
            codec: None,
            elem,
            staged: false,
            padded: false,
        }
    }
}

impl Plan {
    /// The way it runs, in the one vocabulary (the bench's `algo` column):
    /// `None` for nothing, a copy and the levels.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn algorithm(&self) -> Option<Algorithm> {
        match self {
            Plan::Vendor => Some(Algorithm::Vendor),
            Plan::Kernel(k) => Some(match k.kind {
                KernelKind::OneShot => Algorithm::OneShot,
                KernelKind::TwoShot => Algorithm::TwoShot,
                KernelKind::OneShotPush => Algorithm::OneShotPush,
                KernelKind::OneShotLl => Algorithm::OneShotLl,
                KernelKind::TwoShotPush => Algorithm::TwoShotPush,
                KernelKind::QuickReduce => k.codec.map_or(Algorithm::Kernels, Algorithm::QuickReduce),
                KernelKind::ExchangeLl | KernelKind::ReduceToLl => Algorithm::Ll,
                KernelKind::Exchange
                | KernelKind::ExchangeDirect
                | KernelKind::ReduceTo
                | KernelKind::ReduceToDirect => Algorithm::Inbox,
                KernelKind::Broadcast | KernelKind::SendRecv => Algorithm::Kernels,
                KernelKind::Copy => Algorithm::Copy,
            }),
            Plan::Nothing | Plan::Copy | Plan::Levels => None,
        }
    }
}

/// How `r` runs on a communicator with `f`.
pub(crate) fn plan(r: &Request<'_>, f: &Facts<'_>) -> Result<Plan> {
    let p = match r.coll {
        Collective::AllReduce => all_reduce(r, f)?,
        Collective::Broadcast => broadcast(r, f),
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll | Collective::AllToAllV => tuned(r, f),
        Collective::Gather | Collective::Scatter | Collective::Reduce => routed(r, f),
        Collective::SendRecv if f.host() => Plan::Kernel(Kernel::of(KernelKind::SendRecv, r.dtype)),
        Collective::SendRecv => Plan::Vendor,
        Collective::Barrier => barrier(f),
    };
    crate::fc_log!(
        tracing::Level::DEBUG,
        "plan: {} {} x {} {} (world {}, asked {:?}) -> {p:?}",
        r.coll,
        r.count,
        r.dtype,
        r.op,
        f.world,
        r.asked
    );
    Ok(p)
}

/// All-reduce: the call's algorithm, else `FERROCOMM_ALGO`, else the
/// tuned ladder (quick-reduce first where opted in, NCCL/RCCL from the
/// table's threshold where allowed). A fixed algorithm that cannot run the
/// call is refused.
fn all_reduce(r: &Request<'_>, f: &Facts<'_>) -> Result<Plan> {
    if f.levels.is_some() {
        return Ok(Plan::Levels);
    }
    let asked = r.asked.or(f.opts.algo);
    if let Some(a) = asked.filter(|a| !a.is_all_reduce()) {
        return Err(Error::invalid(format!("{a} is not an all-reduce algorithm")));
    }
    let premul = r.op == ReduceOp::PreMulSum;
    let algo = match asked {
        // No workspace: NCCL/RCCL carries every call.
        _ if !f.kernels => Algorithm::Vendor,
        Some(a) if a != Algorithm::Kernels => a,
        kernels => auto_all_reduce(r, f, kernels.is_none()),
    };
    let qr_call = QR_DTYPES.contains(&r.dtype) && r.op == ReduceOp::Sum;
    if algo.codec().is_some() && !qr_call {
        return Err(Error::Unsupported(format!(
            "{algo} reduces f16 or bf16 sums only, not {} {}",
            r.dtype, r.op
        )));
    }
    if algo == Algorithm::OneShotLl && premul {
        return Err(Error::Unsupported(
            "oneshot-ll carries no premul_sum factors; let the planner choose".into(),
        ));
    }
    if r.count == 0 {
        return Ok(Plan::Nothing);
    }
    if f.world == 1 && !premul {
        return Ok(Plan::Copy);
    }
    // GPUs reduce KERNEL_OPS on the kernels; premul_sum goes to NCCL/RCCL.
    if algo == Algorithm::Vendor || (!f.host() && !KERNEL_OPS.contains(&r.op)) {
        return Ok(Plan::Vendor);
    }
    let Some(kind) = algo.all_reduce_kind() else {
        return Err(Error::Unsupported(format!("{algo} has no kernel")));
    };
    Ok(Plan::Kernel(Kernel {
        codec: algo.codec(),
        // GPU kernels load whole elements: memory not aligned to its
        // element goes through the staging buffer (the host copies bytes).
        staged: !f.host() && misaligned(r.operands, r.dtype.size()),
        ..Kernel::of(kind, r.dtype)
    }))
}

/// All-reduce's own choice: quick-reduce where opted in and large enough,
/// NCCL/RCCL from the table's threshold where allowed (`vendor_ok`: not
/// when the call asked for the kernels), else the ladder.
fn auto_all_reduce(r: &Request<'_>, f: &Facts<'_>, vendor_ok: bool) -> Algorithm {
    let w = f.world.min(MAX_RANKS);
    let bytes = r.bytes();
    let quantize = f
        .opts
        .quantization
        .codec(f.backend)
        .filter(|_| QR_DTYPES.contains(&r.dtype) && r.op == ReduceOp::Sum);
    if let Some(codec) = quantize.filter(|_| bytes >= f.table.qr_min_bytes[w]) {
        return Algorithm::QuickReduce(codec);
    }
    if vendor_ok && f.vendor && !f.opts.deterministic && bytes >= f.table.ccl_min_bytes {
        return Algorithm::Vendor;
    }
    let ladder = f.table.ladders[w].all_reduce(DtypeClass::of(r.dtype));
    match step_for(ladder, bytes).map_or(Algorithm::TwoShot, |s| s.algo) {
        // The LL protocol has no room for per-rank factors.
        Algorithm::OneShotLl if r.op == ReduceOp::PreMulSum => Algorithm::OneShotPush,
        a => a,
    }
}

/// Broadcast: the copy route where the call asks for it; else the kernel moves words of 4 or 2 bytes (any dtype: the bits
/// are not looked at), the word chosen from the payload's bytes, which
/// every rank shares. Without a word, NCCL/RCCL, or (without the library)
/// the payload padded to 4-byte words; the host backend's exchange takes
/// any size.
fn broadcast(r: &Request<'_>, f: &Facts<'_>) -> Plan {
    if r.count == 0 {
        return Plan::Nothing;
    }
    if f.world == 1 {
        return Plan::Copy;
    }
    if r.asked == Some(Algorithm::Copy) && copy_runs(r, f) {
        return Plan::Kernel(Kernel::of(KernelKind::Copy, r.dtype));
    }
    let bytes = r.bytes();
    let word = [4usize, 2].into_iter().find(|w| bytes % w == 0);
    let kernel = f.kernels && (f.host() || !f.vendor || r.dtype.size() <= 4);
    let word_dtype = |w: usize| if w == 4 { DType::I32 } else { DType::F16 };
    match word {
        Some(w) if kernel => Plan::Kernel(Kernel {
            staged: misaligned(r.operands, w),
            ..Kernel::of(KernelKind::Broadcast, word_dtype(w))
        }),
        None if !f.host() && !f.vendor => Plan::Kernel(Kernel {
            padded: true,
            ..Kernel::of(KernelKind::Broadcast, DType::I32)
        }),
        // The root sends to every rank; no block size the direct kinds go by.
        _ if f.host() => data_kernel(&Request { count: 0, ..*r }, f, false),
        _ => Plan::Vendor,
    }
}

/// All-gather, reduce-scatter and all-to-all: the LL kinds, the inbox
/// kinds or NCCL/RCCL, by the call's choice, then the options, then the
/// tuned ladder for the collective, dtype class and bytes per peer (an
/// all-to-all with splits has no size: the inbox kinds).
fn tuned(r: &Request<'_>, f: &Facts<'_>) -> Plan {
    let reduces = r.coll == Collective::ReduceScatter;
    if f.levels == Some(true) && matches!(r.coll, Collective::AllGather | Collective::ReduceScatter) {
        return Plan::Levels;
    }
    let moves = matches!(r.coll, Collective::AllGather | Collective::ReduceScatter);
    if !f.host() && moves {
        if r.count == 0 {
            return Plan::Nothing;
        }
        if f.world == 1 && !(reduces && r.op == ReduceOp::PreMulSum) {
            return Plan::Copy;
        }
    }
    if !f.host() && (!f.kernels || f.world <= 1 || f.world > MAX_RANKS) {
        return Plan::Vendor;
    }
    let bytes = r.bytes();
    // The library where it can run the call and the call did not ask for
    // the kernels.
    let vendor = !f.host() && f.vendor && !(reduces && r.op.is_bitwise()) && r.asked != Some(Algorithm::Kernels);
    let ll = !(reduces && r.op == ReduceOp::PreMulSum) && ll_fits(r, f);
    let route = f.opts.coll_route;
    let ll_bytes = f.opts.coll_ll_bytes;
    let copy = copy_runs(r, f);
    let chosen = match r.asked {
        Some(Algorithm::Vendor) if vendor => Algorithm::Vendor,
        Some(Algorithm::Ll) if ll => Algorithm::Ll,
        Some(Algorithm::Inbox) => Algorithm::Inbox,
        Some(Algorithm::Copy) if copy => Algorithm::Copy,
        _ if route == Some(Algorithm::Vendor) && vendor => Algorithm::Vendor,
        _ if ll && ll_bytes.is_some_and(|max| bytes <= max) => Algorithm::Ll,
        _ if r.count == 0 => Algorithm::Inbox,
        _ => {
            // The table, a step whose way cannot run passing the call on:
            // NCCL/RCCL never for a deterministic reduce-scatter (its sums
            // are not the reference's bits), nor where the route or the call
            // asked for the kernels.
            let auto_vendor = vendor && route.is_none() && !(reduces && f.opts.deterministic);
            let runs = |a: Algorithm| match a {
                Algorithm::Ll => ll && ll_bytes.is_none(),
                Algorithm::Vendor => auto_vendor,
                Algorithm::Copy => copy,
                _ => true,
            };
            f.table.ladders[f.world.min(MAX_RANKS)]
                .coll(r.coll, DtypeClass::of(r.dtype))
                .iter()
                .filter(|s| bytes <= s.max_bytes)
                .map(|s| s.algo)
                .find(|&a| a == Algorithm::Inbox || runs(a))
                .unwrap_or(Algorithm::Inbox)
        }
    };
    match chosen {
        Algorithm::Vendor => Plan::Vendor,
        Algorithm::Copy => Plan::Kernel(Kernel::of(KernelKind::Copy, r.dtype)),
        a => data_kernel(r, f, a == Algorithm::Ll),
    }
}

/// Whether the copy route can run the call: all-gather, broadcast or
/// all-to-all without splits (a block every rank agrees on, which sets the
/// chunks alike everywhere), on a workspace of 2 to [`MAX_RANKS`] ranks.
/// Reduce-scatter has no copy route: its receivers must still reduce what
/// lands with a kernel, so the copies would only add a pass over the data.
fn copy_runs(r: &Request<'_>, f: &Facts<'_>) -> bool {
    let moves = matches!(
        r.coll,
        Collective::AllGather | Collective::AllToAll | Collective::Broadcast
    );
    moves && r.count > 0 && f.kernels && (2..=MAX_RANKS).contains(&f.world)
}

/// Gather, scatter and reduce (no tuned ladder): the kernels or NCCL/RCCL by
/// the call's choice, then `FERROCOMM_COLL_ROUTE`, then the measured
/// threshold ([`CUSTOM_MIN_BLOCK_BYTES`]), except that blocks the LL kinds
/// carry stay on the kernels, and deterministic reductions and the bitwise
/// ops (which the library lacks) always do.
fn routed(r: &Request<'_>, f: &Facts<'_>) -> Plan {
    let reduce = r.coll == Collective::Reduce;
    let premul = r.op == ReduceOp::PreMulSum;
    if reduce && (r.count == 0 || (f.world == 1 && !premul)) {
        return Plan::Nothing;
    }
    let ll = !premul && ll_fits(r, f) && r.bytes() <= ll_limit(f);
    if f.host() {
        return data_kernel(r, f, ll);
    }
    if !f.kernels {
        return Plan::Vendor;
    }
    if reduce && r.op.is_bitwise() {
        return data_kernel(r, f, ll);
    }
    if f.world <= 1 || f.world > MAX_RANKS {
        return Plan::Vendor;
    }
    if !f.vendor {
        return data_kernel(r, f, ll);
    }
    let bytes = r.bytes();
    let vendor = match (r.asked, f.opts.coll_route) {
        (Some(Algorithm::Vendor), _) => true,
        (Some(_), _) => false,
        (None, Some(route)) => route == Algorithm::Vendor,
        // Auto: the library below the threshold, except what LL carries and
        // deterministic reductions.
        (None, None) => {
            !(f.opts.deterministic && reduce) && bytes < CUSTOM_MIN_BLOCK_BYTES && !(bytes > 0 && bytes <= ll_limit(f))
        }
    };
    match vendor {
        true => Plan::Vendor,
        false => data_kernel(r, f, ll),
    }
}

/// The exchange (all-gather, gather, scatter, all-to-all, broadcast on the
/// host) or the reduce-to (reduce-scatter, reduce): its direct twin where
/// the communicator has a heap and the agreed block reaches the threshold
/// (the kernel falls back on every rank when one rank's blocks are not all
/// in its heap), else its LL twin where `ll`, else the inbox kind.
fn data_kernel(r: &Request<'_>, f: &Facts<'_>, ll: bool) -> Plan {
    let reduces = matches!(r.coll, Collective::ReduceScatter | Collective::Reduce);
    let gpu_min = if reduces {
        DIRECT_MIN_REDUCE_TO_BYTES
    } else {
        DIRECT_MIN_BLOCK_BYTES
    };
    let sized = match (f.opts.direct_min_bytes, f.host()) {
        (Some(min), _) => r.bytes() >= min,
        (None, true) => true,
        (None, false) => r.bytes() >= gpu_min,
    };
    let kind = match (reduces, f.heap && sized, ll) {
        (false, true, _) => KernelKind::ExchangeDirect,
        (false, false, true) => KernelKind::ExchangeLl,
        (false, false, false) => KernelKind::Exchange,
        (true, true, _) => KernelKind::ReduceToDirect,
        (true, false, true) => KernelKind::ReduceToLl,
        (true, false, false) => KernelKind::ReduceTo,
    };
    Plan::Kernel(Kernel::of(kind, r.dtype))
}

/// A barrier: the levels' across nodes, else a one-element all-reduce on the
/// communicator's scratch (the kernels', or NCCL/RCCL's without a workspace).
fn barrier(f: &Facts<'_>) -> Plan {
    if !f.kernels && f.levels.is_some() {
        return Plan::Levels;
    }
    if f.world == 1 {
        return Plan::Nothing;
    }
    if !f.kernels {
        return Plan::Vendor;
    }
    Plan::Kernel(Kernel::of(KernelKind::OneShot, DType::I32))
}

/// Whether the LL kinds can carry the call: an agreed per-peer block within
/// one source's lines.
fn ll_fits(r: &Request<'_>, f: &Facts<'_>) -> bool {
    r.count > 0 && r.bytes() <= f.ll_room
}

/// The largest per-peer block gather, scatter and reduce take the LL kinds
/// at: `FERROCOMM_COLL_LL_BYTES`, else the measured default
/// ([`ll_max_block_bytes`]), within the lines.
fn ll_limit(f: &Facts<'_>) -> usize {
    f.opts
        .coll_ll_bytes
        .unwrap_or_else(|| ll_max_block_bytes(f.world))
        .min(f.ll_room)
}

/// Whether any of `operands` is not a multiple of `unit`.
fn misaligned(operands: &[DevicePtr], unit: usize) -> bool {
    operands.iter().any(|p| p.0 % unit as u64 != 0)
}
