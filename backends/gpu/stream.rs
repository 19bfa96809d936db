//! Streams (non-blocking, or borrowed from the caller), events (timing
//! enabled) and instantiated graphs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::memory::bind_for_drop;
use super::vendor::{Driver, RawEvent, RawGraph, RawGraphExec, RawStream};
use crate::error::{Error, Result};

/// A non-blocking stream: it never synchronizes implicitly with the legacy
/// default stream, so other code's NULL-stream work cannot stall it. A
/// borrowed stream (the caller's) is used the same way and never destroyed.
pub struct GpuStream<V: Driver> {
    pub(super) ctx: Arc<V::Context>,
    pub(super) raw: RawStream,
    /// Whether this wrapper created the stream (and so destroys it).
    owned: bool,
}

impl<V: Driver> GpuStream<V> {
    /// Create a stream in `ctx` (which the caller made current).
    pub(super) fn new(ctx: Arc<V::Context>) -> Result<GpuStream<V>> {
        let raw = V::stream_create(&ctx)?;
        Ok(GpuStream { ctx, raw, owned: true })
    }

    /// Wrap a caller's stream of `ctx` (current), checked where the API can.
    ///
    /// # Safety
    /// `raw` is a live stream handle that outlives the wrapper and its work.
    pub(super) unsafe fn borrow(ctx: Arc<V::Context>, raw: RawStream) -> Result<GpuStream<V>> {
        // SAFETY: the caller guarantees a live stream handle.
        unsafe { V::stream_check_owner(&ctx, raw) }?;
        Ok(GpuStream { ctx, raw, owned: false })
    }

    /// The vendor's handle as an integer (`CUstream`, `hipStream_t`).
    pub fn raw_handle(&self) -> u64 {
        self.raw.0
    }

    /// Whether the stream is in graph capture (active or invalidated).
    pub(super) fn capturing(&self) -> Result<bool> {
        // SAFETY: live stream of this context (owned, or borrowed for our lifetime).
        unsafe { V::stream_is_capturing(&self.ctx, self.raw) }
    }

    /// Refuse an operation that graph capture would record wrongly or break.
    pub(super) fn refuse_in_capture(&self, what: &str) -> Result<()> {
        if self.capturing()? {
            return Err(Error::Unsupported(format!(
                "{what} on a stream that is capturing a graph"
            )));
        }
        Ok(())
    }

    pub(super) fn synchronize(&self) -> Result<()> {
        // SAFETY: live stream of this context.
        unsafe { V::stream_synchronize(&self.ctx, self.raw) }
    }
}

impl<V: Driver> Drop for GpuStream<V> {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        bind_for_drop::<V>(&self.ctx);
        // SAFETY: destroys the stream created in `new`, once. Work still queued
        // completes first (the driver defers the release).
        V::drop_errors().record(unsafe { V::stream_destroy(&self.ctx, self.raw) });
    }
}

/// An event with timing enabled. It remembers whether it was ever recorded,
/// so that "never recorded" behaves the same on every vendor and version:
/// complete for `query`, an error for `elapsed_ms`.
pub struct GpuEvent<V: Driver> {
    pub(super) ctx: Arc<V::Context>,
    pub(super) raw: RawEvent,
    recorded: AtomicBool,
}

impl<V: Driver> GpuEvent<V> {
    pub(super) fn new(ctx: Arc<V::Context>) -> Result<GpuEvent<V>> {
        let raw = V::event_create(&ctx)?;
        Ok(GpuEvent {
            ctx,
            raw,
            recorded: AtomicBool::new(false),
        })
    }

    pub(super) fn record(&self, stream: &GpuStream<V>) -> Result<()> {
        // SAFETY: live event and stream of the same context (checked by the caller).
        unsafe { V::event_record(&self.ctx, self.raw, stream.raw) }?;
        self.recorded.store(true, Ordering::Release);
        Ok(())
    }

    /// `Ok(true)` once the work before the last record has finished.
    pub(super) fn query(&self) -> Result<bool> {
        if !self.recorded.load(Ordering::Acquire) {
            return Ok(true);
        }
        // SAFETY: live, recorded event.
        unsafe { V::event_query(&self.ctx, self.raw) }
    }

    pub(super) fn elapsed_ms(start: &GpuEvent<V>, end: &GpuEvent<V>) -> Result<f32> {
        if !start.recorded.load(Ordering::Acquire) || !end.recorded.load(Ordering::Acquire) {
            return Err(Error::invalid(
                "elapsed_ms on an event that was never recorded (or was recorded inside graph capture)",
            ));
        }
        // SAFETY: two live, recorded events of one context (checked by the caller).
        unsafe { V::event_elapsed_ms(&start.ctx, start.raw, end.raw) }
    }
}

impl<V: Driver> Drop for GpuEvent<V> {
    fn drop(&mut self) {
        bind_for_drop::<V>(&self.ctx);
        // SAFETY: destroys the event created in `new`, once.
        V::drop_errors().record(unsafe { V::event_destroy(&self.ctx, self.raw) });
    }
}

/// A captured graph and its executable instance.
pub struct GpuGraph<V: Driver> {
    pub(super) ctx: Arc<V::Context>,
    graph: RawGraph,
    exec: RawGraphExec,
}

impl<V: Driver> GpuGraph<V> {
    /// End capture on `stream` and instantiate what it recorded.
    pub(super) fn end_capture(stream: &GpuStream<V>) -> Result<GpuGraph<V>> {
        // SAFETY: live stream of this context.
        let graph = unsafe { V::end_capture(&stream.ctx, stream.raw) }?;
        // Owned from here on, so an instantiation error below releases it.
        let mut g = GpuGraph {
            ctx: stream.ctx.clone(),
            graph,
            exec: RawGraphExec::NULL,
        };
        // SAFETY: the live graph just captured.
        g.exec = unsafe { V::graph_instantiate(&g.ctx, graph) }?;
        Ok(g)
    }

    pub(super) fn launch(&self, stream: &GpuStream<V>) -> Result<()> {
        // SAFETY: live executable graph and stream of the same context (checked by the caller).
        unsafe { V::graph_launch(&self.ctx, self.exec, stream.raw) }
    }
}

impl<V: Driver> Drop for GpuGraph<V> {
    fn drop(&mut self) {
        bind_for_drop::<V>(&self.ctx);
        // SAFETY: each handle was created once in `end_capture` and is released
        // once here; the driver keeps a launched graph's resources until it completes.
        unsafe {
            if !self.exec.is_null() {
                V::drop_errors().record(V::graph_exec_destroy(&self.ctx, self.exec));
            }
            if !self.graph.is_null() {
                V::drop_errors().record(V::graph_destroy(&self.ctx, self.graph));
            }
        }
    }
}
