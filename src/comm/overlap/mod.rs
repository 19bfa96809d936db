//! Communication overlapped with the GEMMs around it: a chunked all-gather
//! ([`ChunkedAllGather`]) and a chunked reduce-scatter
//! ([`ChunkedReduceScatter`]) that tell each chunk's arrival on the device,
//! so that a consumer waits per chunk on its own stream (a GEMM on chunk k
//! while chunk k+1 moves). Both are built on the one-sided windows
//! ([`super::Window`]): copy-engine puts into a peer's mapping, and
//! device-side counters that only grow (docs/protocol.md, "Overlap
//! operations").
//!
//! Two signal sets each, never one counter with two meanings (a wait on one
//! stream could take the signal meant for a wait on another):
//! - *landed* (the data window's own signals): after rank q's chunk has
//!   landed in rank p's buffer, q signals p; p's consumer waits for it;
//! - *ready* (a window with no buffer): p tells q that q may overwrite the
//!   slot q writes in p's buffer, because p has finished reading the
//!   previous call's chunk there; q's puts wait for it.
//!
//! Streams: these operations are ordered by the caller's streams alone.
//! They neither wait for the communicator's earlier calls nor make its
//! later calls wait for them (that ordering would serialize a consumer's
//! chunk waits behind every put). Their memory is their own: heap or
//! registered buffers, and signal words no other call touches. Each method
//! queues on its call's stream and returns; a peer that never signals makes
//! the waiting kernel give up after the timeout and fail the communicator
//! with an [`Error::Timeout`] naming it, which every later method of these
//! objects (and every `Work::wait` of the communicator) returns.

mod all_gather;
mod reduce_scatter;

pub use all_gather::ChunkedAllGather;
pub use reduce_scatter::ChunkedReduceScatter;

use std::time::Duration;

use super::call::Call;
use super::communicator::{Communicator, Resources};
use super::window::{bytes_of, WinArgs, Window, WINDOWS};
use crate::device::{Device, DevicePtr, LaunchConfig};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::heap::DevCtx;

/// Queue kernels and copies for an overlap operation: under the
/// communicator's lock (its resources hold the windows module), refused
/// once the communicator failed or was aborted (a kernel's timeout names
/// the peer that never signalled), and not ordered after its other calls.
fn queue<D: Device>(
    comm: &Communicator<D>,
    what: &str,
    enqueue: impl FnOnce(&mut Resources<D>, &D) -> Result<()>,
) -> Result<()> {
    let inner = &*comm.inner;
    // A kernel's failure (a peer that never signalled) aborts the
    // communicator, as `Work::wait` does, and is this call's error.
    if let Some(e) = inner.device_error() {
        inner.abort(&format!("{what}: {e}"));
        return Err(e);
    }
    let mut st = comm.lock_active()?;
    let res = st.res.as_mut().ok_or(Error::Finalized)?;
    enqueue(res, &inner.device)
}

/// A set of signal counters: a window's signal words, with the context its
/// kernels take.
struct Signals {
    words: DevicePtr,
    ctx: DevCtx,
}

impl Signals {
    fn of<D: Device>(win: &Window<D>, ctx: DevCtx) -> Result<Signals> {
        Ok(Signals {
            words: win.signal_words()?,
            ctx,
        })
    }

    fn launch<D: Device>(
        &self,
        res: &mut Resources<D>,
        dev: &D,
        kernel: &str,
        peer: usize,
        timeout: Duration,
        stream: &D::Stream,
    ) -> Result<()> {
        let mut ctx = self.ctx;
        ctx.timeout_ns = DevCtx::timeout_ns_of(timeout);
        let args = WinArgs::new(ctx, self.words, peer);
        let module = super::heap::heap_module(res, dev, &WINDOWS)?;
        dev.launch_raw(module, kernel, LaunchConfig::new(1, 32), bytes_of(&args), stream)
    }

    /// Add one to `peer`'s counter of this rank, after the stream's earlier work.
    fn signal<D: Device>(
        &self,
        res: &mut Resources<D>,
        dev: &D,
        peer: usize,
        t: Duration,
        s: &D::Stream,
    ) -> Result<()> {
        self.launch(res, dev, "fc_win_signal", peer, t, s)
    }

    /// Hold the stream until `peer` has signalled once more than the waits
    /// on it before (counted on the device).
    fn wait<D: Device>(&self, res: &mut Resources<D>, dev: &D, peer: usize, t: Duration, s: &D::Stream) -> Result<()> {
        self.launch(res, dev, "fc_win_wait", peer, t, s)
    }
}

/// The timeout of a call of `comm`.
fn timeout_of<D: Device>(comm: &Communicator<D>, call: &Call<'_, D>) -> Duration {
    comm.inner.timeout_of(call)
}

/// The stream a call queues on.
fn stream_of<'a, D: Device>(comm: &'a Communicator<D>, call: &'a Call<'_, D>) -> &'a D::Stream {
    call.stream.unwrap_or(&comm.inner.stream)
}

/// Ranks `0..world` as a mask.
fn all_ranks(world: usize) -> u64 {
    (1u64 << world) - 1
}

/// The ranks of `mask`'s clear bits below `world`, for messages.
fn missing(mask: u64, world: usize) -> Vec<usize> {
    (0..world).filter(|r| mask & (1 << r) == 0).collect()
}

/// Argument struct of `fc_win_reduce` (`FcWinReduceArgs`).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct ReduceArgs {
    ctx: DevCtx,
    inbox: DevicePtr,
    out: DevicePtr,
    count: u64,
    world: u32,
    dtype: u32,
    op: u32,
    _pad: u32,
}

const _: () = assert!(std::mem::size_of::<ReduceArgs>() == 144);

fn reduce_bytes(a: &ReduceArgs) -> &[u8] {
    // SAFETY: a #[repr(C)] struct of integers with no padding (asserted size);
    // the slice borrows it.
    unsafe { std::slice::from_raw_parts((a as *const ReduceArgs).cast::<u8>(), std::mem::size_of::<ReduceArgs>()) }
}

/// The host twin of `fc_win_reduce`: the reference's rule
/// ([`Element::combine`] in rank order, [`Element::finish`], one rounding).
///
/// # Safety
/// `args` is a [`ReduceArgs`] of live memory: an inbox of `world` slots of
/// `count` elements and an output of `count`, of its dtype.
pub(crate) unsafe fn reduce_twin(args: &[u8]) {
    // SAFETY: forwarded from the caller.
    let a: ReduceArgs = unsafe { crate::backends::host::heap_kernels::args_of(args) };
    let op = if a.op == ReduceOp::Avg as u32 {
        ReduceOp::Avg
    } else {
        ReduceOp::Sum
    };
    // SAFETY (each arm): as the function's.
    match a.dtype {
        x if x == DType::F32 as u32 => unsafe { reduce_typed::<f32>(&a, op) },
        x if x == DType::F16 as u32 => unsafe { reduce_typed::<half::f16>(&a, op) },
        x if x == DType::BF16 as u32 => unsafe { reduce_typed::<half::bf16>(&a, op) },
        _ => unsafe { reduce_typed::<i32>(&a, op) },
    }
}

/// # Safety
/// As [`reduce_twin`], with `T` the inbox's element type.
unsafe fn reduce_typed<T: Element>(a: &ReduceArgs, op: ReduceOp) {
    let (n, world) = (a.count as usize, a.world as usize);
    // SAFETY: the inbox holds `world * n` elements of T (the caller's contract).
    let inbox = unsafe { std::slice::from_raw_parts(a.inbox.0 as *const T, world * n) };
    // SAFETY: the output holds `n` elements of T, apart from the inbox.
    let out = unsafe { std::slice::from_raw_parts_mut(a.out.0 as *mut T, n) };
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = inbox[i].to_acc();
        for r in 1..world {
            acc = T::combine(op, acc, inbox[r * n + i].to_acc());
        }
        *o = T::from_acc(T::finish(op, acc, world));
    }
}

/// Blocks of the reduction: enough for the memory system, at most the
/// launch limit; the host twin runs as one.
fn reduce_config(count: usize) -> LaunchConfig {
    let threads = crate::algo::BLOCK_THREADS;
    let grid = count
        .div_ceil(threads as usize * 4)
        .clamp(1, crate::algo::layout::MAX_BLOCKS);
    LaunchConfig::new(grid as u32, threads)
}

/// Check a tensor's dtype and count against what an operation was built for.
fn check_tensor(what: &str, name: &str, t: &super::Tensor, dtype: DType, count: usize) -> Result<()> {
    if t.dtype() != dtype || t.count() != count {
        return Err(Error::invalid(format!(
            "{what}: {name} is {} x {}, expected {count} x {dtype}",
            t.count(),
            t.dtype()
        )));
    }
    Ok(())
}
