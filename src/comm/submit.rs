//! The submission path every call takes: under the communicator's lock
//! (so launch order is call order), on the call's stream, ordered after the
//! previous call's stream; and host copies into and out of tensors, ordered
//! the same way.

use std::time::Duration;

use super::call::Call;
use super::communicator::{lock, Communicator, Inner, LastStream, Phase, Resources};
use super::tensor::Tensor;
use super::work::Work;
use crate::device::{Device, DevicePtr};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// What the submission path hands a collective's enqueue step.
pub(crate) struct Submit<'a, D: Device> {
    pub(crate) inner: &'a Inner<D>,
    pub(crate) res: &'a mut Resources<D>,
    pub(crate) stream: &'a D::Stream,
    pub(crate) timeout: Duration,
    pub(crate) capturing: bool,
}

impl<D: Device> Submit<'_, D> {
    /// The workspace ferrocomm's kernels run in; an error naming `what`
    /// where the communicator has none (it spans nodes, or has more ranks
    /// than one node's kernels serve).
    pub(crate) fn workspace(&self, what: &str) -> Result<&crate::algo::Workspace<D>> {
        self.res.ws.as_ref().ok_or_else(|| {
            Error::Unsupported(format!(
                "communicator {} has no workspace for ferrocomm's kernels (it spans {}, or has more ranks than \
                 one node's kernels serve) for {what}: run it on each node's communicator",
                self.inner.name,
                self.inner.topology.describe()
            ))
        })
    }
}

impl<D: Device> Communicator<D> {
    /// Copy host bytes into `buf` at `offset`: [`Communicator::copy_in`] on
    /// the communicator's stream.
    pub fn write(&self, buf: &D::Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.copy_in(Tensor::view(buf, DType::U8, offset, data.len())?, data, &Call::new())
    }

    /// Copy `buf[offset..]` into `out` once every earlier call has run:
    /// [`Communicator::copy_out`] on the communicator's stream.
    pub fn read(&self, buf: &D::Buffer, offset: usize, out: &mut [u8]) -> Result<()> {
        self.copy_out(out, Tensor::view(buf, DType::U8, offset, out.len())?, &Call::new())
    }

    /// Copy host bytes into `dst` (any memory a collective takes: a buffer,
    /// a view, a raw tensor, heap memory), as big as `src`. Stream-ordered
    /// on every backend, like a collective: queued on `call`'s stream (the
    /// communicator's by default) after every earlier call of this
    /// communicator, and every later call, on any stream, is queued after
    /// it. Returns once `src` may be reused.
    pub fn copy_in(&self, dst: Tensor, src: &[u8], call: &Call<'_, D>) -> Result<()> {
        self.checked_copy("copy_in", &dst, src.len())?;
        self.ordered(call, true, |stream| self.inner.device.upload(dst.ptr(), src, stream))
    }

    /// Copy `src` into host bytes `dst`, as big as it, once every earlier
    /// call of this communicator has run (on any stream) and everything
    /// queued before on `call`'s stream.
    pub fn copy_out(&self, dst: &mut [u8], src: Tensor, call: &Call<'_, D>) -> Result<()> {
        self.checked_copy("copy_out", &src, dst.len())?;
        // The download waits for its stream: nothing of it stays queued.
        self.ordered(call, false, |stream| self.inner.device.download(dst, src.ptr(), stream))
    }

    /// `copy` on `call`'s stream, ordered after this communicator's last
    /// call; with `later_wait`, later calls on other streams wait for it.
    /// Also on an aborted communicator (reading what it left is allowed).
    fn ordered(&self, call: &Call<'_, D>, later_wait: bool, copy: impl FnOnce(&D::Stream) -> Result<()>) -> Result<()> {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        if matches!(st.phase, Phase::Finalized) {
            return Err(Error::Finalized);
        }
        let stream = call.stream.unwrap_or(&inner.stream);
        let id = stream_id::<D>(&inner.device, stream);
        if let Some(last) = st.last.as_ref().filter(|l| l.id != id) {
            inner.device.wait_event(stream, &last.event)?;
        }
        copy(stream)?;
        if later_wait {
            let event = st.events.take(&inner.device)?;
            inner.device.record(&event, stream)?;
            st.last = Some(LastStream { id, event });
        }
        Ok(())
    }

    fn checked_copy(&self, what: &str, t: &Tensor, bytes: usize) -> Result<()> {
        let span = t.bytes()?;
        if span != bytes {
            return Err(Error::invalid(format!(
                "{what}: the tensor holds {span} bytes ({} x {}), the host side {bytes}",
                t.count(),
                t.dtype()
            )));
        }
        if bytes > 0 && t.ptr() == DevicePtr::NULL {
            return Err(Error::invalid(format!("{what}: a null address")));
        }
        if bytes > 0 {
            self.inner.device.check_memory(t.ptr(), bytes)?;
        }
        Ok(())
    }

    /// The submission path of every collective: under the communicator's
    /// lock (so launch order is call order), on the call's stream, ordered
    /// after the previous call's stream, then a [`Work`] for it.
    pub(crate) fn submit(
        &self,
        call: &Call<'_, D>,
        what: &'static str,
        enqueue: impl FnOnce(&mut Submit<'_, D>) -> Result<()>,
    ) -> Result<Work<D>> {
        let inner = &*self.inner;
        let mut st = self.lock_active()?;
        if !inner.kernels && !inner.has_vendor && inner.world > 1 {
            return Err(Error::Unsupported(format!(
                "{what} on communicator {}: it spans {} with {} ranks, so it has no workspace for ferrocomm's \
                 kernels, and no NCCL/RCCL underneath (all_reduce, all_gather and reduce_scatter run in two levels \
                 when the nodes have equal sizes)",
                inner.name,
                inner.topology.describe(),
                inner.world
            )));
        }
        let stream = call.stream.unwrap_or(&inner.stream);
        let capturing = inner.device.is_capturing(stream)?;
        let id = stream_id::<D>(&inner.device, stream);
        let st = &mut *st;
        if !capturing {
            if let Some(last) = st.last.as_ref().filter(|l| l.id != id) {
                inner.device.wait_event(stream, &last.event)?;
            }
        }
        let res = st.res.as_mut().ok_or(Error::Finalized)?;
        let mut sub = Submit {
            inner,
            res,
            stream,
            timeout: inner.timeout_of(call),
            capturing,
        };
        enqueue(&mut sub)?;
        // An event recorded into a graph could not be waited on from outside it.
        let event = match capturing {
            true => None,
            false => Some(st.events.take(&inner.device)?),
        };
        let work = Work::record(self.inner.clone(), stream, what, call.timeout, event)?;
        if let Some(event) = work.event() {
            // The next call on another stream waits for this one.
            st.last = Some(LastStream { id, event });
        }
        Ok(work)
    }
}

/// A stream's identity across wrappers: the vendor handle where there is one.
fn stream_id<D: Device>(dev: &D, stream: &D::Stream) -> u64 {
    dev.raw_stream(stream).unwrap_or(stream as *const D::Stream as u64)
}
