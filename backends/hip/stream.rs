//! HIP streams (non-blocking), events (timing enabled) and instantiated graphs.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::driver::{
    check, clear_last_error, drop_check, error, DeviceCtx, HipEvent as RawEvent, HipGraph as RawGraph, HipGraphExec,
    HipStream as RawStream, HIP_ERROR_ILLEGAL_STATE, HIP_ERROR_INVALID_HANDLE, HIP_ERROR_INVALID_VALUE,
    HIP_ERROR_NOT_READY, HIP_EVENT_DEFAULT, HIP_STREAM_CAPTURE_STATUS_NONE, HIP_STREAM_NON_BLOCKING, HIP_SUCCESS,
};
use crate::error::{Error, Result};

/// A `hipStreamNonBlocking` stream: it never synchronizes implicitly with the
/// null stream, so other code's null-stream work cannot stall it.
pub struct HipStream {
    pub(super) ctx: Arc<DeviceCtx>,
    pub(super) raw: RawStream,
    /// False for a caller's stream ([`HipStream::borrowed`]): never destroyed here.
    owned: bool,
}

// SAFETY: a hipStream_t is a runtime handle usable from any thread; the runtime
// serialises work submitted to one stream from several threads.
unsafe impl Send for HipStream {}
// SAFETY: as above; shared use only passes the handle to the runtime.
unsafe impl Sync for HipStream {}

impl HipStream {
    /// Create a stream on `ctx`'s device (which the caller made current).
    pub(super) fn new(ctx: Arc<DeviceCtx>) -> Result<HipStream> {
        let mut raw: RawStream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device is current.
        check("hipStreamCreateWithFlags", unsafe {
            (ctx.hip().stream_create_with_flags)(&mut raw, HIP_STREAM_NON_BLOCKING)
        })?;
        Ok(HipStream { ctx, raw, owned: true })
    }

    /// Wrap a stream the caller created (or `0`, the null stream); dropping
    /// the wrapper leaves it alone.
    ///
    /// # Safety
    /// `raw` is a live stream of `ctx`'s device, and it outlives the wrapper
    /// and the work queued through it.
    pub(super) unsafe fn borrowed(ctx: Arc<DeviceCtx>, raw: u64) -> HipStream {
        HipStream {
            ctx,
            raw: raw as usize as RawStream,
            owned: false,
        }
    }

    /// Whether the stream is in graph capture (active or invalidated).
    pub(super) fn capturing(&self) -> Result<bool> {
        let mut status: c_int = HIP_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: live stream, valid out-pointer.
        check("hipStreamIsCapturing", unsafe {
            (self.ctx.hip().stream_is_capturing)(self.raw, &mut status)
        })?;
        Ok(status != HIP_STREAM_CAPTURE_STATUS_NONE)
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
        // SAFETY: live stream.
        check("hipStreamSynchronize", unsafe {
            (self.ctx.hip().stream_synchronize)(self.raw)
        })
    }
}

impl Drop for HipStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        self.ctx.bind_for_drop();
        // SAFETY: destroys the stream created in `new`, once. Work still queued
        // completes first (the runtime waits for it).
        drop_check("hipStreamDestroy", unsafe { (self.ctx.hip().stream_destroy)(self.raw) });
    }
}

/// An event with timing enabled. It remembers whether it was ever recorded,
/// so that "never recorded" behaves the same on every ROCm version: complete
/// for `query`, an error for `elapsed_ms`.
pub struct HipEvent {
    pub(super) ctx: Arc<DeviceCtx>,
    pub(super) raw: RawEvent,
    recorded: AtomicBool,
}

// SAFETY: a hipEvent_t is a runtime handle usable from any thread.
unsafe impl Send for HipEvent {}
// SAFETY: as above.
unsafe impl Sync for HipEvent {}

impl HipEvent {
    pub(super) fn new(ctx: Arc<DeviceCtx>) -> Result<HipEvent> {
        let mut raw: RawEvent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device is current.
        check("hipEventCreateWithFlags", unsafe {
            (ctx.hip().event_create_with_flags)(&mut raw, HIP_EVENT_DEFAULT)
        })?;
        Ok(HipEvent {
            ctx,
            raw,
            recorded: AtomicBool::new(false),
        })
    }

    pub(super) fn record(&self, stream: &HipStream) -> Result<()> {
        // SAFETY: live event and stream of the same device.
        check("hipEventRecord", unsafe {
            (self.ctx.hip().event_record)(self.raw, stream.raw)
        })?;
        self.recorded.store(true, Ordering::Release);
        Ok(())
    }

    /// `Ok(true)` once the work before the last record has finished.
    pub(super) fn query(&self) -> Result<bool> {
        if !self.recorded.load(Ordering::Acquire) {
            return Ok(true);
        }
        // SAFETY: live event.
        match unsafe { (self.ctx.hip().event_query)(self.raw) } {
            HIP_SUCCESS => Ok(true),
            HIP_ERROR_NOT_READY => {
                clear_last_error();
                Ok(false)
            }
            other => Err(error("hipEventQuery", other)),
        }
    }

    pub(super) fn elapsed_ms(start: &HipEvent, end: &HipEvent) -> Result<f32> {
        if !start.recorded.load(Ordering::Acquire) || !end.recorded.load(Ordering::Acquire) {
            return Err(Error::invalid(
                "elapsed_ms on an event that was never recorded (or was recorded inside graph capture)",
            ));
        }
        let mut ms = 0f32;
        // SAFETY: two live events of one device (checked by the caller).
        match unsafe { (start.ctx.hip().event_elapsed_time)(&mut ms, start.raw, end.raw) } {
            HIP_SUCCESS => Ok(ms),
            HIP_ERROR_NOT_READY => {
                clear_last_error();
                Err(Error::invalid("elapsed_ms on an event that has not completed"))
            }
            HIP_ERROR_INVALID_HANDLE | HIP_ERROR_INVALID_VALUE => {
                clear_last_error();
                Err(Error::invalid("elapsed_ms on events the runtime cannot time"))
            }
            other => Err(error("hipEventElapsedTime", other)),
        }
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        // SAFETY: destroys the event created in `new`, once.
        drop_check("hipEventDestroy", unsafe { (self.ctx.hip().event_destroy)(self.raw) });
    }
}

/// A captured graph and its executable instance.
pub struct HipGraph {
    pub(super) ctx: Arc<DeviceCtx>,
    graph: RawGraph,
    exec: HipGraphExec,
}

// SAFETY: graph handles are runtime objects usable from any thread; launches of
// one executable graph are serialised by the runtime.
unsafe impl Send for HipGraph {}
// SAFETY: as above.
unsafe impl Sync for HipGraph {}

impl HipGraph {
    /// End capture on `stream` and instantiate what it recorded.
    pub(super) fn end_capture(stream: &HipStream) -> Result<HipGraph> {
        if !stream.capturing()? {
            return Err(Error::invalid("end_capture on a stream that is not capturing"));
        }
        let hip = stream.ctx.hip();
        let mut graph: RawGraph = std::ptr::null_mut();
        // SAFETY: live stream, valid out-pointer.
        let r = unsafe { (hip.stream_end_capture)(stream.raw, &mut graph) };
        if r != HIP_SUCCESS {
            if !graph.is_null() {
                // SAFETY: a graph the runtime handed us despite the error; destroyed once.
                drop_check("hipGraphDestroy", unsafe { (hip.graph_destroy)(graph) });
            }
            return Err(match r {
                HIP_ERROR_ILLEGAL_STATE => {
                    clear_last_error();
                    Error::invalid("end_capture on a stream that is not capturing")
                }
                other => error("hipStreamEndCapture", other),
            });
        }
        if graph.is_null() {
            return Err(Error::Backend {
                backend: super::driver::BACKEND,
                call: "hipStreamEndCapture",
                message: "returned no graph".into(),
            });
        }
        let mut g = HipGraph {
            ctx: stream.ctx.clone(),
            graph,
            exec: std::ptr::null_mut(),
        };
        // SAFETY: `graph` is the live graph just captured; valid out-pointer; no
        // error node or log buffer requested.
        check("hipGraphInstantiate", unsafe {
            (hip.graph_instantiate)(&mut g.exec, graph, std::ptr::null_mut(), std::ptr::null_mut(), 0)
        })?;
        Ok(g)
    }

    pub(super) fn launch(&self, stream: &HipStream) -> Result<()> {
        // SAFETY: live executable graph and stream of the same device.
        check("hipGraphLaunch", unsafe {
            (self.ctx.hip().graph_launch)(self.exec, stream.raw)
        })
    }
}

impl Drop for HipGraph {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        let hip = self.ctx.hip();
        // SAFETY: each handle was created once in `end_capture` and is released
        // once here; the runtime keeps a launched graph's resources until it completes.
        unsafe {
            if !self.exec.is_null() {
                drop_check("hipGraphExecDestroy", (hip.graph_exec_destroy)(self.exec));
            }
            if !self.graph.is_null() {
                drop_check("hipGraphDestroy", (hip.graph_destroy)(self.graph));
            }
        }
    }
}
