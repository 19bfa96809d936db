//! Expert-parallel (MoE) dispatch and combine inside one node, on the
//! symmetric heap and the device API (DeepEP's intranode shape, with a fixed
//! maximum of tokens per rank so the calls can be captured into graphs).
//!
//! Experts are split evenly over ranks: expert `e` lives on rank
//! `e / (num_experts / world)`. [`EpBuffer::dispatch`] sends each token once
//! to every rank that owns at least one of its top-k experts; rank `r`
//! receives source `s`'s tokens in `s`'s order, at rows `s * max + i` for
//! `i < count[s]`, with the top-k ids rewritten to `r`'s local expert ids
//! (`-1` for other ranks' experts, whose weights read 0). The expert side
//! applies the router weights to its own experts' outputs and writes them in
//! the same padded layout; [`EpBuffer::combine`] sends each row back to its
//! source and sums a token's rows over the ranks it went to, in rank order,
//! in f32, rounded to bf16 once (deterministic, bitwise equal to the host
//! reference in `ep/reference.rs` for every finite input; on GPUs a NaN sums
//! to the one canonical NaN).
//!
//! Top-k ids below 0 mean "no expert"; ids at or past `num_experts` are
//! ignored (a token whose ids are all such goes nowhere and combines to 0).
//!
//! Dispatch and combine must alternate: a second dispatch before the
//! combine would let a source overwrite rows a receiver still reads, so the
//! buffer refuses it ([`crate::Error::InvalidArgument`]). The protocol is in
//! docs/protocol.md, "Expert-parallel dispatch and combine"; the regions in
//! [`EpLayout`]; the kernels in `kernels-cuda/ep.cu` and their host twins in
//! `twins`.

pub(crate) mod layout;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod reference;
pub(crate) mod twins;

use std::sync::Mutex;

use crate::algo::BLOCK_THREADS;
use crate::bootstrap::store_barrier;
use crate::comm::{Call, Communicator, Tensor, Work};
use crate::device::abi::{abi_struct, AbiStruct};
use crate::device::{BackendKind, Device, DeviceBuffer, DevicePtr, LaunchConfig, ModuleSource};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::heap::{DevCtx, HeapBuffer};

pub use layout::{EpLayout, SCALE_BLOCK};

/// The EP kernels' module (`kernels-cuda/ep.cu`).
pub(crate) const EP_MODULE_NAME: &str = "ep";

/// Prelude + device API + Lamport packs + the EP kernels, per vendor (the HIP text shares
/// the body, as every module does).
pub(crate) const EP_MODULE: ModuleSource = ModuleSource::raw(
    EP_MODULE_NAME,
    concat!(
        include_str!("../../kernels-cuda/prelude.cuh"),
        "\n",
        include_str!("../../kernels-cuda/device_api.cuh"),
        "\n",
        include_str!("../../kernels-cuda/lamport.cuh"),
        "\n",
        include_str!("../../kernels-cuda/ep.cu")
    ),
    concat!(
        include_str!("../../kernels-hip/prelude.hip.h"),
        "\n",
        include_str!("../../kernels-cuda/device_api.cuh"),
        "\n",
        include_str!("../../kernels-cuda/lamport.cuh"),
        "\n",
        include_str!("../../kernels-cuda/ep.cu")
    ),
);

/// Every kernel of [`EP_MODULE`].
pub(crate) const EP_KERNELS: [&str; 7] = [
    "fc_ep_layout",
    "fc_ep_dispatch",
    "fc_ep_dispatch_layout",
    "fc_ep_combine_ll",
    "fc_ep_combine_ll_take",
    "fc_ep_combine",
    "fc_ep_combine_reduce",
];

/// Blocks of the dispatch and combine kernels on GPUs
/// (`CommOptions::ep_blocks` overrides it), at most the GPU's
/// multiprocessors: the one-kernel combine's blocks wait for each other's
/// rows, so they must be resident together. Every rank must use the same
/// grid (a rank's dispatch waits for a flag word from every block of every
/// peer), so the ranks of one buffer need GPUs of one model.
///
/// Measured on 2x H200, `FERROCOMM_EP_BLOCKS=b ferrocomm-bench --ep --graph`
/// (the bench of BENCHMARKS.md, "EP dispatch + combine", on an earlier
/// build), dispatch + combine us at 4096 tokens a rank, bf16 / fp8: 8 blocks
/// 1655 / 1563, 32: 709 / 627, 64: 556 / 477, 128 (the most a launch
/// takes): 491 / 410; to 1024 tokens 64 and 128 are level, and the grid
/// changes nothing below 512 tokens.
pub(crate) const EP_GPU_BLOCKS: u32 = 128;
// A dispatch block has its own flag word, MAX_BLOCKS a source (layout.rs).
const _: () = assert!(EP_GPU_BLOCKS as usize <= crate::algo::layout::MAX_BLOCKS);

/// Tokens a rank from which, up to world [`TAKE_MAX_WORLD`], the one-kernel
/// combine's sums take their units from a counter (`fc_ep_combine_ll_take`,
/// see `combine_roles` in `kernels-cuda/ep.cu`). A dispatch + combine, bf16,
/// counter against none (the bench of BENCHMARKS.md, "EP dispatch +
/// combine"): 4096 tokens 340.0-340.2 against 346.5-347.1 us at world 2 (2x
/// H200), 826.7-827.4 against 841.1-844.5 at world 3 and 1330.6-1334.4
/// against 1387.9-1390.3 at world 4 (4x H200, a build whose combine still
/// put in rank order); 2048 tokens 2.5, 9 and 20 us faster. Below 2048 the
/// counter measured level or slower (2x H200).
const TAKE_TOKENS: usize = 2048;
/// The largest world that takes units: not measured above 4 (no 8-GPU
/// machine was lent).
const TAKE_MAX_WORLD: usize = 4;

/// Tokens a thread of the layout takes (`FC_EP_LAYOUT_RUN`): up to this
/// many a block thread, the dispatch kernel finds its own layout
/// (`fc_ep_dispatch_layout`, one launch); above, `fc_ep_layout` runs first.
const LAYOUT_RUN: usize = 8;

/// What the dispatched rows carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpPayload {
    /// bf16 rows (`x` is [`DType::BF16`]).
    Bf16,
    /// fp8 e4m3 rows, one byte per element passed through unchanged
    /// (`x` is [`DType::F8E4M3`]), with f32 scales, one per 128 channels.
    Fp8,
}

/// An EP buffer's shape. Every rank passes the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpConfig {
    /// Channels per token.
    pub hidden: usize,
    /// Most tokens a rank dispatches in one call (the receive regions hold
    /// this many rows per source); below 2^20, the row count a dispatch's
    /// signal carries.
    pub max_tokens_per_rank: usize,
    /// Experts over all ranks (a multiple of the world).
    pub num_experts: usize,
    /// Experts per token (columns of `topk_idx`).
    pub topk: usize,
    /// What the rows carry.
    pub payload: EpPayload,
}

impl EpConfig {
    fn check(&self, world: usize) -> Result<()> {
        let bad = |why: String| Err(Error::invalid(format!("EP config {self:?}: {why}")));
        if self.hidden == 0 || self.max_tokens_per_rank == 0 || self.num_experts == 0 || self.topk == 0 {
            return bad("hidden, max_tokens_per_rank, num_experts and topk must be positive".into());
        }
        if self.topk > self.num_experts {
            return bad(format!("topk {} exceeds num_experts {}", self.topk, self.num_experts));
        }
        if self.num_experts % world != 0 {
            return bad(format!(
                "num_experts {} is not divisible by the world {world}",
                self.num_experts
            ));
        }
        if self.payload == EpPayload::Fp8 && self.hidden % SCALE_BLOCK != 0 {
            return bad(format!(
                "fp8 rows carry one scale per {SCALE_BLOCK} channels: hidden {} is not a multiple",
                self.hidden
            ));
        }
        // A dispatch's signal carries its row count in COUNT_BITS bits.
        if self.max_tokens_per_rank >= 1 << layout::COUNT_BITS {
            return bad(format!("max_tokens_per_rank must stay below 2^{}", layout::COUNT_BITS));
        }
        // The kernels index rows and ids with 32-bit integers.
        let limit = i32::MAX as usize / 2;
        if self.hidden > limit || self.max_tokens_per_rank > limit || self.num_experts > limit || self.topk > limit {
            return bad("sizes must stay below 2^30".into());
        }
        Ok(())
    }
}

/// What a dispatch leaves on this rank: views into the buffer's heap
/// regions, valid until the next dispatch. Rows `s * max + i` for
/// `i < recv_counts[s]` hold source `s`'s tokens in its order; the rest are
/// stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchOut {
    /// `[world * max, hidden]`, bf16 or f8e4m3 as the payload.
    pub recv_x: Tensor,
    /// fp8 only: f32 `[world * max, hidden / 128]`.
    pub recv_scales: Option<Tensor>,
    /// i32 `[world * max, topk]`: this rank's local expert ids, -1 elsewhere.
    pub recv_topk_idx: Tensor,
    /// f32 `[world * max, topk]`: 0 where the id is -1.
    pub recv_topk_weights: Tensor,
    /// i32 `[world * max]`: each row's token index at its source.
    pub recv_src_index: Tensor,
    /// i32 `[world]` on the device: rows received from each source.
    pub recv_counts: Tensor,
}

/// Dispatch and combine alternate; the host keeps which comes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    Dispatched { num_tokens: usize },
}

/// The argument struct of `fc_ep_layout`, `fc_ep_dispatch` and
/// `fc_ep_combine` (`FcEpArgs` in kernels-cuda/ep.cu).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub(crate) struct EpArgs {
    pub ctx: DevCtx,
    pub x: DevicePtr,
    pub scales: DevicePtr,
    pub topk_idx: DevicePtr,
    pub topk_weights: DevicePtr,
    pub out: DevicePtr,
    pub recv_x: DevicePtr,
    pub recv_scales: DevicePtr,
    pub recv_idx: DevicePtr,
    pub recv_weights: DevicePtr,
    pub recv_src: DevicePtr,
    pub recv_counts: DevicePtr,
    pub inbox: DevicePtr,
    pub flags: DevicePtr,
    pub slots: DevicePtr,
    pub send_counts: DevicePtr,
    pub hidden: u32,
    pub max_tokens: u32,
    pub num_experts: u32,
    pub topk: u32,
    pub num_tokens: u32,
    pub payload: u32,
    pub row_bytes: u32,
    pub scale_cols: u32,
    pub rank_recip: u64,
    pub per_rank: u32,
    pub pad: u32,
}

/// Every field of `EpArgs` with its offset and size, which `struct
/// FcEpArgs` must match (see `device::abi`).
pub(crate) const EP_ARGS_ABI: AbiStruct = abi_struct!(EpArgs as "FcEpArgs" {
    ctx, x, scales, topk_idx, topk_weights, out, recv_x, recv_scales, recv_idx, recv_weights, recv_src,
    recv_counts, inbox, flags, slots, send_counts, hidden, max_tokens, num_experts, topk, num_tokens, payload,
    row_bytes, scale_cols, rank_recip, per_rank, pad,
});
const _: () = EP_ARGS_ABI.assert_packed();

/// `FC_EP_PAYLOAD_*`.
const PAYLOAD_BF16: u32 = 0;
const PAYLOAD_FP8: u32 = 1;

fn bytes_of(a: &EpArgs) -> &[u8] {
    // SAFETY: a #[repr(C)] struct of integers with no padding
    // (EP_ARGS_ABI.assert_packed()); the slice borrows it.
    unsafe { std::slice::from_raw_parts((a as *const EpArgs).cast::<u8>(), std::mem::size_of::<EpArgs>()) }
}

/// An EP buffer: see the module docs. Created by [`EpBuffer::new`].
pub struct EpBuffer<D: Device> {
    comm: Communicator<D>,
    cfg: EpConfig,
    layout: EpLayout,
    heap: Option<HeapBuffer>,
    phase: Mutex<Phase>,
}

impl<D: Device> EpBuffer<D> {
    /// Allocate the buffer's regions from the symmetric heap. Collective:
    /// every rank calls it with the same config, in the same order as its
    /// other heap allocations. Errors for a bad config, and the heap's own
    /// error when it is too small (raise `FERROCOMM_HEAP_BYTES`).
    pub fn new(comm: &Communicator<D>, cfg: EpConfig) -> Result<EpBuffer<D>> {
        let world = comm.size();
        cfg.check(world)?;
        let layout = EpLayout::new(&cfg, world)?;
        let heap = comm.heap_alloc(layout.total)?;
        let inner = &*comm.inner;
        let ready = (|| -> Result<()> {
            // Compiled, loaded and every function looked up now (with CUDA's
            // lazy loading a lookup loads the function), on every rank before
            // the barrier below: a first dispatch then never waits for a
            // compiler, a capture never holds a load, and no rank loads code
            // (which may wait for the context's running kernels) while a
            // peer's kernel in the same context spins waiting for it (ranks
            // sharing a GPU).
            comm.with_resources(|res| {
                let module = crate::comm::heap_module(res, &inner.device, &EP_MODULE)?;
                inner.device.prepare(module, &EP_KERNELS)
            })??;
            // A reused heap range holds its last user's bytes: the counters
            // start at zero and the inbox empty (Lamport packs, all 0xff), on
            // every rank, before any peer may signal or put.
            comm.heap_write(&heap, layout.flags, &[0u8; layout::FLAGS_BYTES])?;
            comm.heap_fill(&heap, layout.inbox, layout.inbox_bytes, 0xff)?;
            inner.device.synchronize(&inner.stream)?;
            let key = inner.next_key("ep");
            store_barrier(inner.store.as_ref(), &key, inner.rank, world, inner.opts.timeout)
        })();
        if let Err(e) = ready {
            let _ = comm.heap_free(heap);
            return Err(e);
        }
        Ok(EpBuffer {
            comm: Communicator {
                inner: comm.inner.clone(),
            },
            cfg,
            layout,
            heap: Some(heap),
            phase: Mutex::new(Phase::Idle),
        })
    }

    /// The shape the buffer was made for.
    pub fn config(&self) -> &EpConfig {
        &self.cfg
    }

    /// The regions' offsets inside the buffer's heap allocation.
    pub fn layout(&self) -> &EpLayout {
        &self.layout
    }

    /// Experts on each rank.
    pub fn experts_per_rank(&self) -> usize {
        self.cfg.num_experts / self.layout.world
    }

    fn heap(&self) -> Result<&HeapBuffer> {
        self.heap.as_ref().ok_or(Error::Finalized)
    }

    fn region(&self, offset: usize) -> Result<DevicePtr> {
        Ok(self.heap()?.ptr().offset(offset))
    }

    /// The receive regions as tensors (what [`EpBuffer::dispatch`] returns).
    pub fn received(&self) -> Result<DispatchOut> {
        let l = &self.layout;
        let rows = l.world * l.max_tokens;
        let view = |offset: usize, count: usize, dtype: DType| -> Result<Tensor> {
            // SAFETY: every view lies inside the buffer's heap allocation
            // (the layout's regions), which lives until `free`.
            Ok(unsafe { Tensor::from_raw(self.region(offset)?.0, count, dtype) })
        };
        let x_dtype = match self.cfg.payload {
            EpPayload::Bf16 => DType::BF16,
            EpPayload::Fp8 => DType::F8E4M3,
        };
        Ok(DispatchOut {
            recv_x: view(l.recv_x, rows * l.hidden, x_dtype)?,
            recv_scales: match self.cfg.payload {
                EpPayload::Bf16 => None,
                EpPayload::Fp8 => Some(view(l.recv_scales, rows * l.scale_cols, DType::F32)?),
            },
            recv_topk_idx: view(l.recv_idx, rows * l.topk, DType::I32)?,
            recv_topk_weights: view(l.recv_weights, rows * l.topk, DType::F32)?,
            recv_src_index: view(l.recv_src, rows, DType::I32)?,
            recv_counts: view(l.recv_counts, l.world, DType::I32)?,
        })
    }

    /// Bytes of the inbox that are not 0xff, read after the stream's work
    /// (the inbox is empty between calls: each combine gives back every pack
    /// it read). For the conformance suite.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn inbox_stray_bytes(&self) -> Result<usize> {
        let mut inbox = vec![0u8; self.layout.inbox_bytes];
        self.comm.heap_read(self.heap()?, self.layout.inbox, &mut inbox)?;
        Ok(inbox.iter().filter(|&&b| b != 0xff).count())
    }

    /// Send each of the first `num_tokens` tokens (rows of `x`, and for fp8
    /// rows of `scales`) to every rank that owns one of its experts
    /// (`topk_idx`, i32 `[num_tokens, topk]`, with `topk_weights`, f32).
    /// Collective: every rank dispatches, each with its own `num_tokens`
    /// (at most `max_tokens_per_rank`). Queued on the call's stream; the
    /// stream's next work sees every rank's rows, which hold until this
    /// rank's combine (once its rows have reached a peer, that peer's next
    /// dispatch may write them). Bad input is an
    /// [`Error::InvalidArgument`] before anything is queued; a peer that
    /// never dispatches makes [`Work::wait`] fail with a timeout naming it.
    pub fn dispatch(
        &self,
        x: Tensor,
        scales: Option<Tensor>,
        topk_idx: Tensor,
        topk_weights: Tensor,
        num_tokens: usize,
        call: &Call<'_, D>,
    ) -> Result<(Work<D>, DispatchOut)> {
        let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        if *phase != Phase::Idle {
            return Err(Error::invalid(
                "EP dispatch: the previous dispatch has not been combined; dispatch and combine must alternate",
            ));
        }
        let cfg = &self.cfg;
        if num_tokens > cfg.max_tokens_per_rank {
            return Err(Error::invalid(format!(
                "EP dispatch: {num_tokens} tokens exceed max_tokens_per_rank {}",
                cfg.max_tokens_per_rank
            )));
        }
        let (x_dtype, row_bytes) = match cfg.payload {
            EpPayload::Bf16 => (DType::BF16, cfg.hidden * 2),
            EpPayload::Fp8 => (DType::F8E4M3, cfg.hidden),
        };
        let dev = &self.comm.inner.device;
        let check = |what: &str, t: &Tensor, dtype: DType, cols: usize| -> Result<()> {
            rows_of("EP dispatch", what, t, dtype, cols, num_tokens)?;
            dev.check_memory(t.ptr(), num_tokens * cols * dtype.size())
        };
        check("x", &x, x_dtype, cfg.hidden)?;
        check("topk_idx", &topk_idx, DType::I32, cfg.topk)?;
        check("topk_weights", &topk_weights, DType::F32, cfg.topk)?;
        let scale_cols = self.layout.scale_cols;
        let scales_ptr = match (cfg.payload, scales) {
            (EpPayload::Fp8, Some(s)) => {
                check("scales", &s, DType::F32, scale_cols)?;
                s.ptr()
            }
            (EpPayload::Fp8, None) => {
                return Err(Error::invalid(
                    "EP dispatch: fp8 rows need their scales (f32, one per 128 channels)",
                ))
            }
            (EpPayload::Bf16, Some(_)) => {
                return Err(Error::invalid("EP dispatch: bf16 rows take no scales"));
            }
            (EpPayload::Bf16, None) => DevicePtr::NULL,
        };
        let mut args = self.args(call)?;
        args.x = x.ptr();
        args.scales = scales_ptr;
        args.topk_idx = topk_idx.ptr();
        args.topk_weights = topk_weights.ptr();
        args.num_tokens = num_tokens as u32;
        debug_assert_eq!(args.row_bytes as usize, row_bytes);
        let grid = self.grid();
        let one = LaunchConfig { grid: 1, ..grid };
        let own_layout = num_tokens <= LAYOUT_RUN * one.block as usize;
        let work = self.comm.submit(call, "ep dispatch", |s| {
            let module = crate::comm::heap_module(s.res, &s.inner.device, &EP_MODULE)?;
            let dev = &s.inner.device;
            if own_layout {
                return dev.launch_raw(module, "fc_ep_dispatch_layout", grid, bytes_of(&args), s.stream);
            }
            dev.launch_raw(module, "fc_ep_layout", one, bytes_of(&args), s.stream)?;
            dev.launch_raw(module, "fc_ep_dispatch", grid, bytes_of(&args), s.stream)
        })?;
        *phase = Phase::Dispatched { num_tokens };
        Ok((work, self.received()?))
    }

    /// Send every received row of `expert_out` (bf16 `[world * max, hidden]`,
    /// the padded layout of the dispatch's `recv_x`, router weights already
    /// applied) back to its source, and write into `out` (bf16
    /// `[num_tokens, hidden]`, the last dispatch's `num_tokens`) each token's
    /// sum over the ranks it was sent to: rank order, f32, rounded once.
    /// Collective; must follow a dispatch.
    pub fn combine(&self, expert_out: Tensor, out: Tensor, call: &Call<'_, D>) -> Result<Work<D>> {
        let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        let Phase::Dispatched { num_tokens } = *phase else {
            return Err(Error::invalid(
                "EP combine: no dispatch to combine; dispatch and combine must alternate",
            ));
        };
        let cfg = &self.cfg;
        let rows = self.layout.world * cfg.max_tokens_per_rank;
        let dev = &self.comm.inner.device;
        rows_of("EP combine", "expert_out", &expert_out, DType::BF16, cfg.hidden, rows)?;
        rows_of("EP combine", "out", &out, DType::BF16, cfg.hidden, num_tokens)?;
        // The kernel reads the inbox and the slots while it writes `out`.
        let heap = self.heap()?;
        let out_bytes = num_tokens * cfg.hidden * 2;
        let end = |p: DevicePtr, b: usize| p.0 + b as u64;
        if out_bytes > 0 && out.ptr().0 < end(heap.ptr(), heap.len()) && heap.ptr().0 < end(out.ptr(), out_bytes) {
            return Err(Error::invalid("EP combine: out overlaps the EP buffer's own regions"));
        }
        dev.check_memory(expert_out.ptr(), rows * cfg.hidden * 2)?;
        dev.check_memory(out.ptr(), out_bytes)?;
        let mut args = self.args(call)?;
        args.x = expert_out.ptr();
        args.out = out.ptr();
        args.num_tokens = num_tokens as u32;
        let grid = self.grid();
        // Lamport packs need whole 16-byte packs per row; else the plain
        // two-kernel combine. Never a rank's own pointers: every rank must
        // take the same kind (a one-kernel combine reads its inbox as packs).
        let packs = cfg.hidden % 8 == 0 && !self.comm.inner.opts.ep_plain_combine;
        // The counter's body is compiled aligned only, and needs a block
        // for each role. The choice is this rank's own (nothing counts its
        // summing warps), so it may follow its own token count.
        let aligned = (expert_out.ptr().0 | out.ptr().0) % 16 == 0;
        let take = aligned && self.layout.world <= TAKE_MAX_WORLD && num_tokens >= TAKE_TOKENS && grid.grid >= 2;
        let combine_ll = if take {
            "fc_ep_combine_ll_take"
        } else {
            "fc_ep_combine_ll"
        };
        let work = self.comm.submit(call, "ep combine", |s| {
            let module = crate::comm::heap_module(s.res, &s.inner.device, &EP_MODULE)?;
            let dev = &s.inner.device;
            if packs {
                return dev.launch_raw(module, combine_ll, grid, bytes_of(&args), s.stream);
            }
            dev.launch_raw(module, "fc_ep_combine", grid, bytes_of(&args), s.stream)?;
            dev.launch_raw(module, "fc_ep_combine_reduce", grid, bytes_of(&args), s.stream)
        })?;
        *phase = Phase::Idle;
        Ok(work)
    }

    /// Return the regions to the heap. Every rank frees its EP buffers in
    /// the same order as its other heap allocations, once no queued work
    /// uses them.
    pub fn free(mut self) -> Result<()> {
        match self.heap.take() {
            Some(h) => self.comm.heap_free(h),
            None => Ok(()),
        }
    }

    fn block(&self) -> u32 {
        match self.comm.inner.device.facts().backend {
            BackendKind::Host => 1,
            _ => BLOCK_THREADS,
        }
    }

    /// The dispatch / combine grid: the host twins run as one block. Every
    /// EP kernel waits for the stream's previous kernel first thing
    /// (`fc_grid_dep_wait`), so they ask to launch as its programmatic
    /// dependents (which the backend grants where the device takes them).
    fn grid(&self) -> LaunchConfig {
        let facts = self.comm.inner.device.facts();
        let grid = match facts.backend {
            BackendKind::Host => 1,
            _ => {
                let asked = self.comm.inner.opts.ep_blocks.unwrap_or(EP_GPU_BLOCKS);
                asked.min(facts.multiprocessors.max(1))
            }
        };
        LaunchConfig {
            dependent: self.comm.inner.opts.ep_dependent_launch,
            ..LaunchConfig::new(grid, self.block())
        }
    }

    /// The arguments every kernel shares: the context and the regions.
    fn args(&self, call: &Call<'_, D>) -> Result<EpArgs> {
        let mut ctx = self.comm.device_ctx()?;
        ctx.timeout_ns = DevCtx::timeout_ns_of(self.comm.inner.timeout_of(call));
        let l = &self.layout;
        let r = |o: usize| self.region(o);
        let per_rank = self.experts_per_rank();
        Ok(EpArgs {
            ctx,
            x: DevicePtr::NULL,
            scales: DevicePtr::NULL,
            topk_idx: DevicePtr::NULL,
            topk_weights: DevicePtr::NULL,
            out: DevicePtr::NULL,
            recv_x: r(l.recv_x)?,
            recv_scales: r(l.recv_scales)?,
            recv_idx: r(l.recv_idx)?,
            recv_weights: r(l.recv_weights)?,
            recv_src: r(l.recv_src)?,
            recv_counts: r(l.recv_counts)?,
            inbox: r(l.inbox)?,
            flags: r(l.flags)?,
            slots: r(l.slots)?,
            send_counts: r(l.send_counts)?,
            hidden: l.hidden as u32,
            max_tokens: l.max_tokens as u32,
            num_experts: self.cfg.num_experts as u32,
            topk: l.topk as u32,
            num_tokens: 0,
            payload: match self.cfg.payload {
                EpPayload::Bf16 => PAYLOAD_BF16,
                EpPayload::Fp8 => PAYLOAD_FP8,
            },
            row_bytes: l.row_bytes as u32,
            scale_cols: l.scale_cols as u32,
            rank_recip: rank_recip(per_rank),
            per_rank: per_rank as u32,
            pad: 0,
        })
    }
}

/// `ceil(2^32 / per_rank)` (0 for 0): with it the kernels map an expert id
/// `e` to its rank `e / per_rank` by a multiply and one correction
/// (`ExpertRanks` in kernels-cuda/ep.cu), with no division on the device.
fn rank_recip(per_rank: usize) -> u64 {
    match per_rank as u64 {
        0 => 0,
        p => (1u64 << 32).div_ceil(p),
    }
}

/// An error unless `t` is `dtype` holding whole rows of `cols` elements, at
/// least `rows` of them.
fn rows_of(op: &str, what: &str, t: &Tensor, dtype: DType, cols: usize, rows: usize) -> Result<()> {
    if t.dtype() != dtype {
        return Err(Error::invalid(format!("{op}: {what} is {}, want {dtype}", t.dtype())));
    }
    if t.count() % cols != 0 || t.count() / cols < rows {
        return Err(Error::invalid(format!(
            "{op}: {what} has {} elements, want whole rows of {cols} and at least {rows} rows",
            t.count()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::rank_recip;

    /// The kernels' `dest_bit` rank, from the reciprocal: the multiply, then
    /// one step down where it overshot. Exact for the ids a rank range holds.
    #[test]
    fn the_reciprocal_maps_every_id_to_its_rank() {
        for per_rank in [1usize, 2, 3, 7, 32, 100, 255, 256, 1000, 65_537] {
            let recip = rank_recip(per_rank);
            for e in (0..per_rank as u64 * 9).chain([(1 << 31) - 1]) {
                let mut r = ((e * recip) >> 32) as u32;
                if r as u64 * per_rank as u64 > e {
                    r -= 1;
                }
                assert_eq!(r as u64, e / per_rank as u64, "id {e}, {per_rank} experts a rank");
            }
        }
        assert_eq!(rank_recip(0), 0);
    }
}
