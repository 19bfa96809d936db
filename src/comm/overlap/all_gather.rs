//! [`ChunkedAllGather`]: an all-gather whose chunks (one per rank) are
//! waited for one by one, on the consumer's stream.

use super::{all_ranks, check_tensor, missing, queue, stream_of, timeout_of, Signals};
use crate::comm::{Call, Communicator, Tensor, Window};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A chunked all-gather into a buffer every rank has mapped.
///
/// The output (`world` shards, shard `r` from rank `r`) is the caller's
/// memory, in the symmetric heap or registerable (see
/// [`Communicator::register`]); it is this object's window buffer. One call:
///
/// 1. [`ChunkedAllGather::start`] on a comm stream: this rank tells each
///    peer that its buffer is free ("ready"), copies its own shard into its
///    own slot and signals itself, then for each peer in staggered order
///    (`rank + 1, rank + 2, ...`) waits for the peer's "ready", puts the
///    shard into the peer's slot `rank` and signals the peer ("landed");
/// 2. [`ChunkedAllGather::wait_chunk`] for every chunk, once each, on any
///    stream (a consumer's): that stream waits until the chunk has landed.
///
/// The caller orders its streams: `start`'s stream after the work that
/// wrote the input and after every read of the previous call's output (the
/// "ready" signals promise the peers that those reads are done), and the
/// input is not overwritten before `start`'s stream has run. Every chunk of
/// a call is waited for before the next `start` (counts stay paired).
/// A graph may capture whole calls (start and every wait) and be replayed:
/// the counters live on the device and only grow.
pub struct ChunkedAllGather<D: Device> {
    comm: Communicator<D>,
    data: Option<Window<D>>,
    ready: Option<Window<D>>,
    landed: Signals,
    ready_sig: Signals,
    output: Tensor,
    shard: usize,
    /// Whether a call was started, and which of its chunks were waited.
    open: bool,
    waited: u64,
}

impl<D: Device> ChunkedAllGather<D> {
    /// A chunked all-gather into `output` (`world` shards of equal size, in
    /// rank order). Collective: every rank calls it, with outputs of the
    /// same count and dtype; it allocates two windows' signal words in the
    /// symmetric heap and maps (or registers) the outputs.
    pub fn new(comm: &Communicator<D>, output: Tensor) -> Result<Self> {
        let world = comm.size();
        if output.count() == 0 || output.count() % world != 0 {
            return Err(Error::invalid(format!(
                "chunked all-gather: the output has {} elements, not a positive multiple of the world ({world})",
                output.count()
            )));
        }
        let mut data = comm.new_window()?;
        let ready = match data.register(output).and_then(|()| comm.new_window()) {
            Ok(w) => w,
            Err(e) => {
                // Released on every rank alike: register and new_window fail on all of them.
                let _ = data.free();
                return Err(e);
            }
        };
        // Every rank's output must have this rank's size: slots are at
        // `rank * shard` in each.
        for p in 0..world {
            let peer = data.map_remote(p)?;
            if peer.count() != output.count() {
                let _ = ready.free();
                let _ = data.free();
                return Err(Error::Mismatch {
                    rank: comm.rank(),
                    peer: p,
                    detail: format!(
                        "chunked all-gather: this rank's output has {} elements, rank {p}'s {}",
                        output.count(),
                        peer.count()
                    ),
                });
            }
        }
        let ctx = comm.device_ctx()?;
        Ok(ChunkedAllGather {
            comm: Communicator {
                inner: comm.inner.clone(),
            },
            landed: Signals::of(&data, ctx)?,
            ready_sig: Signals::of(&ready, ctx)?,
            data: Some(data),
            ready: Some(ready),
            output,
            shard: output.count() / world,
            open: false,
            waited: 0,
        })
    }

    /// The gathered output (rank `r`'s shard at `r * shard_count()`).
    pub fn output(&self) -> Tensor {
        self.output
    }

    /// Elements of one shard (the input of [`ChunkedAllGather::start`]).
    pub fn shard_count(&self) -> usize {
        self.shard
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.output.dtype()
    }

    /// Queue one all-gather of `input` (one shard) on the call's stream; see
    /// the type's docs for the order of its steps and the caller's part. An
    /// `input` that is this rank's own slot of the output is not copied.
    pub fn start(&mut self, input: Tensor, call: &Call<'_, D>) -> Result<()> {
        let what = "chunked all-gather start";
        check_tensor(what, "the input", &input, self.dtype(), self.shard)?;
        let world = self.comm.size();
        if self.open && self.waited != all_ranks(world) {
            return Err(Error::invalid(format!(
                "{what}: chunks {:?} of the previous call were never waited for (wait_chunk or wait_all each \
                 chunk once per call)",
                missing(self.waited, world)
            )));
        }
        let bytes = input.bytes()?;
        self.comm.inner.device.check_memory(input.ptr(), bytes)?;
        let data = self.data.as_ref().ok_or(Error::Finalized)?;
        let (rank, shard) = (self.comm.rank(), self.shard);
        let own = self.output.slice(rank * shard, shard)?;
        // Overlapping the own slot other than exactly: the copy would be undefined.
        if input != own && input.overlaps(&self.output) {
            return Err(Error::invalid(format!(
                "{what}: the input overlaps the output other than as this rank's slot"
            )));
        }
        let dests = (0..world).map(|q| data.map_remote(q)).collect::<Result<Vec<_>>>()?;
        let (timeout, stream) = (timeout_of(&self.comm, call), stream_of(&self.comm, call));
        let size = input.dtype().size();
        queue(&self.comm, what, |res, dev| {
            for q in (0..world).filter(|&q| q != rank) {
                self.ready_sig.signal(res, dev, q, timeout, stream)?;
            }
            if input != own {
                dev.copy_device(own.ptr(), input.ptr(), bytes, stream)?;
            }
            self.landed.signal(res, dev, rank, timeout, stream)?;
            for i in 1..world {
                let q = (rank + i) % world;
                self.ready_sig.wait(res, dev, q, timeout, stream)?;
                dev.copy_device(dests[q].ptr().offset(rank * shard * size), input.ptr(), bytes, stream)?;
                self.landed.signal(res, dev, q, timeout, stream)?;
            }
            Ok(())
        })?;
        self.open = true;
        self.waited = 0;
        Ok(())
    }

    /// Make the call's stream wait until chunk `chunk` (rank `chunk`'s
    /// shard) of the current call has landed in this rank's output. Once
    /// per chunk and call, on any stream.
    pub fn wait_chunk(&mut self, chunk: usize, call: &Call<'_, D>) -> Result<()> {
        let what = "chunked all-gather wait_chunk";
        let world = self.comm.size();
        if chunk >= world {
            return Err(Error::invalid(format!(
                "{what}: chunk {chunk} is not a rank of a world of {world}"
            )));
        }
        if !self.open {
            return Err(Error::invalid(format!("{what}: no call was started")));
        }
        if self.waited & (1 << chunk) != 0 {
            return Err(Error::invalid(format!(
                "{what}: chunk {chunk} of this call was waited for already"
            )));
        }
        let (timeout, stream) = (timeout_of(&self.comm, call), stream_of(&self.comm, call));
        queue(&self.comm, what, |res, dev| {
            self.landed.wait(res, dev, chunk, timeout, stream)
        })?;
        self.waited |= 1 << chunk;
        Ok(())
    }

    /// [`ChunkedAllGather::wait_chunk`] for every chunk of the current call
    /// not waited for yet, in rank order.
    pub fn wait_all(&mut self, call: &Call<'_, D>) -> Result<()> {
        for chunk in missing(self.waited, self.comm.size()) {
            self.wait_chunk(chunk, call)?;
        }
        Ok(())
    }

    /// Release the windows (the output stays the caller's). Collective, in
    /// the same order on every rank, as [`Window::free`]: work queued on
    /// the communicator's stream is waited for here; work on other streams,
    /// and graphs that captured this object's calls, must be finished
    /// (graphs destroyed) by the caller first, on every rank.
    pub fn free(mut self) -> Result<()> {
        let ready = self.ready.take().map_or(Ok(()), Window::free);
        let data = self.data.take().map_or(Ok(()), Window::free);
        ready.and(data)
    }
}
