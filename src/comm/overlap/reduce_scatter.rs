//! [`ChunkedReduceScatter`]: a reduce-scatter whose chunks (one per
//! destination rank) are sent one by one as their producers finish them.

use super::{all_ranks, check_tensor, missing, queue, reduce_bytes, reduce_config, stream_of, timeout_of};
use super::{ReduceArgs, Signals};
use crate::comm::window::WINDOWS;
use crate::comm::{Call, Communicator, Tensor, Window};
use crate::device::{Device, DeviceBuffer};
use crate::dtype::{check_supported, DType, ReduceOp};
use crate::error::{Error, Result};
use crate::heap::HeapBuffer;

/// A chunked reduce-scatter through an inbox in the symmetric heap.
///
/// Each rank's inbox holds `world` slots of one chunk; slot `r` receives
/// rank `r`'s partial for this rank's chunk. One call:
///
/// 1. [`ChunkedReduceScatter::put_chunk`] once for every rank `q` (itself
///    included, in any order, on any streams): after `q` has said its slot
///    is free ("ready"; this rank tells itself too, so a put on one stream
///    never overtakes the previous finish on another), the partial for `q`'s chunk is put into `q`'s
///    inbox slot `rank` and `q` is signalled ("landed");
/// 2. [`ChunkedReduceScatter::finish`] on the consumer's stream: waits for
///    every rank's partial, reduces the slots in rank order into the output
///    (f32 accumulation for f16/bf16, one rounding: the bits of a plain
///    `reduce_scatter`), then tells every rank (itself included) that its slot is free again.
///
/// The first call's "ready" is given when the object is created. A partial
/// must not be overwritten before its `put_chunk`'s stream has run. A graph
/// may capture whole calls (every put and the finish) and be replayed: the
/// counters live on the device and only grow.
pub struct ChunkedReduceScatter<D: Device> {
    comm: Communicator<D>,
    inbox: Option<Window<D>>,
    ready: Option<Window<D>>,
    heap: Option<HeapBuffer>,
    landed: Signals,
    ready_sig: Signals,
    inbox_t: Tensor,
    chunk: usize,
    /// The ranks this call's partials were put to.
    put: u64,
}

impl<D: Device> ChunkedReduceScatter<D> {
    /// A chunked reduce-scatter of chunks of `chunk` x `dtype` (the output
    /// of one rank). Collective: every rank calls it with the same shape;
    /// it allocates the inbox (`world * chunk` elements) and two windows'
    /// signal words in the symmetric heap, and gives the first call's
    /// "ready" to every peer.
    pub fn new(comm: &Communicator<D>, chunk: usize, dtype: DType) -> Result<Self> {
        let world = comm.size();
        if chunk == 0 {
            return Err(Error::invalid("chunked reduce-scatter: a chunk of 0 elements"));
        }
        if !dtype.is_float() && dtype != DType::I32 {
            return Err(Error::invalid(format!(
                "chunked reduce-scatter: dtype {dtype} is not reduced (f32, f16, bf16 or i32)"
            )));
        }
        let bytes = world
            .checked_mul(chunk)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| Error::invalid(format!("chunked reduce-scatter: {world} x {chunk} x {dtype} overflows")))?;
        // Loaded before the allocation's exchange, as Communicator::new_window
        // does: a rank loading a module could wait behind a peer's spinning kernel.
        comm.with_resources(|res| {
            let m = crate::comm::heap_module(res, &comm.inner.device, &WINDOWS)?;
            comm.inner.device.prepare(m, &[])
        })??;
        let heap = comm.heap_alloc(bytes)?;
        let inbox_t = Tensor::of(&heap, dtype);
        let windows = (|| {
            let mut inbox = comm.new_window()?;
            inbox.register(inbox_t)?;
            let ready = comm.new_window()?;
            Ok::<_, Error>((inbox, ready))
        })();
        let (inbox, ready) = match windows {
            Ok(w) => w,
            Err(e) => {
                let _ = comm.heap_free(heap);
                return Err(e);
            }
        };
        let ctx = comm.device_ctx()?;
        let rs = ChunkedReduceScatter {
            comm: Communicator {
                inner: comm.inner.clone(),
            },
            landed: Signals::of(&inbox, ctx)?,
            ready_sig: Signals::of(&ready, ctx)?,
            inbox: Some(inbox),
            ready: Some(ready),
            heap: Some(heap),
            inbox_t,
            chunk,
            put: 0,
        };
        // The first call's slots are free: every rank may write at once.
        let (stream, timeout) = (&comm.inner.stream, comm.inner.opts.timeout);
        queue(comm, "chunked reduce-scatter new", |res, dev| {
            for q in 0..world {
                rs.ready_sig.signal(res, dev, q, timeout, stream)?;
            }
            Ok(())
        })?;
        Ok(rs)
    }

    /// Elements of one chunk (one rank's output).
    pub fn chunk_count(&self) -> usize {
        self.chunk
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.inbox_t.dtype()
    }

    /// Put `partial` (this rank's partial for rank `dst`'s chunk) into
    /// `dst`'s inbox, on the call's stream, and signal `dst`. Once per rank
    /// and call; `dst` may be this rank.
    pub fn put_chunk(&mut self, dst: usize, partial: Tensor, call: &Call<'_, D>) -> Result<()> {
        let what = "chunked reduce-scatter put_chunk";
        let world = self.comm.size();
        if dst >= world {
            return Err(Error::invalid(format!(
                "{what}: rank {dst} is not in a world of {world}"
            )));
        }
        if self.put & (1 << dst) != 0 {
            return Err(Error::invalid(format!(
                "{what}: the partial for rank {dst} was put already in this call (finish it first)"
            )));
        }
        check_tensor(what, "the partial", &partial, self.dtype(), self.chunk)?;
        let bytes = partial.bytes()?;
        self.comm.inner.device.check_memory(partial.ptr(), bytes)?;
        let inbox = self.inbox.as_ref().ok_or(Error::Finalized)?;
        let rank = self.comm.rank();
        let dest = inbox.map_remote(dst)?.slice(rank * self.chunk, self.chunk)?;
        if partial.overlaps(&self.inbox_t) {
            return Err(Error::invalid(format!("{what}: the partial lies in the inbox")));
        }
        let (timeout, stream) = (timeout_of(&self.comm, call), stream_of(&self.comm, call));
        queue(&self.comm, what, |res, dev| {
            self.ready_sig.wait(res, dev, dst, timeout, stream)?;
            dev.copy_device(dest.ptr(), partial.ptr(), bytes, stream)?;
            self.landed.signal(res, dev, dst, timeout, stream)
        })?;
        self.put |= 1 << dst;
        Ok(())
    }

    /// Wait (on the call's stream) for every rank's partial of this rank's
    /// chunk, reduce them in rank order with `op` (sum or avg) into
    /// `output`, then tell the peers their slots are free. Every partial of
    /// this rank's call must have been put first.
    pub fn finish(&mut self, output: Tensor, op: ReduceOp, call: &Call<'_, D>) -> Result<()> {
        let what = "chunked reduce-scatter finish";
        let world = self.comm.size();
        if self.put != all_ranks(world) {
            return Err(Error::invalid(format!(
                "{what}: the partials for ranks {:?} were not put in this call",
                missing(self.put, world)
            )));
        }
        if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            return Err(Error::invalid(format!("{what}: op {op} (sum or avg)")));
        }
        check_supported(self.dtype(), op)?;
        check_tensor(what, "the output", &output, self.dtype(), self.chunk)?;
        self.comm.inner.device.check_memory(output.ptr(), output.bytes()?)?;
        if output.overlaps(&self.inbox_t) {
            return Err(Error::invalid(format!("{what}: the output lies in the inbox")));
        }
        let mut ctx = self.landed.ctx;
        ctx.timeout_ns = crate::heap::DevCtx::timeout_ns_of(timeout_of(&self.comm, call));
        let args = ReduceArgs {
            ctx,
            inbox: self.inbox_t.ptr(),
            out: output.ptr(),
            count: self.chunk as u64,
            world: world as u32,
            dtype: self.dtype() as u32,
            op: op as u32,
            _pad: 0,
        };
        let (timeout, stream) = (timeout_of(&self.comm, call), stream_of(&self.comm, call));
        queue(&self.comm, what, |res, dev| {
            for p in 0..world {
                self.landed.wait(res, dev, p, timeout, stream)?;
            }
            let module = crate::comm::heap_module(res, dev, &WINDOWS)?;
            dev.launch_raw(
                module,
                "fc_win_reduce",
                reduce_config(self.chunk),
                reduce_bytes(&args),
                stream,
            )?;
            for q in 0..world {
                self.ready_sig.signal(res, dev, q, timeout, stream)?;
            }
            Ok(())
        })?;
        self.put = 0;
        Ok(())
    }

    /// Release the windows and the inbox. Collective, in the same order on
    /// every rank, as [`Window::free`]: work queued on the communicator's
    /// stream is waited for here; work on other streams, and graphs that
    /// captured this object's calls, must be finished (graphs destroyed)
    /// by the caller first, on every rank.
    pub fn free(mut self) -> Result<()> {
        let ready = self.ready.take().map_or(Ok(()), Window::free);
        let inbox = self.inbox.take().map_or(Ok(()), Window::free);
        let heap = match self.heap.take() {
            Some(h) => self.comm.heap_free(h),
            None => Ok(()),
        };
        ready.and(inbox).and(heap)
    }
}

impl<D: Device> std::fmt::Debug for ChunkedReduceScatter<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkedReduceScatter")
            .field("chunk", &self.chunk)
            .field("dtype", &self.dtype())
            .field("inbox", &self.heap.as_ref().map(|h| h.len()))
            .finish()
    }
}
