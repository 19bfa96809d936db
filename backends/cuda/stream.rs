//! CUDA streams (non-blocking), events (timing enabled) and instantiated graphs.

use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{check, drop_check, error, Context};
use crate::error::{Error, Result};

/// A `CU_STREAM_NON_BLOCKING` stream: it never synchronizes implicitly with
/// the legacy default stream, so other code's NULL-stream work cannot stall it.
pub struct CudaStream {
    pub(super) ctx: Arc<Context>,
    pub(super) raw: sys::CUstream,
    /// False for a caller's stream ([`CudaStream::borrowed`]): never destroyed here.
    owned: bool,
}

// SAFETY: a CUstream is a driver handle usable from any thread; the driver
// serialises work submitted to one stream from several threads.
unsafe impl Send for CudaStream {}
// SAFETY: as above; shared use only passes the handle to the driver.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// Create a stream in `ctx` (which the caller made current).
    pub(super) fn new(ctx: Arc<Context>) -> Result<CudaStream> {
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; the context is current.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut raw, flags) })?;
        Ok(CudaStream { ctx, raw, owned: true })
    }

    /// Wrap a stream the caller created (or `0`, the legacy default stream);
    /// dropping the wrapper leaves it alone.
    ///
    /// # Safety
    /// `raw` is a live stream of `ctx`'s device, and it outlives the wrapper
    /// and the work queued through it.
    pub(super) unsafe fn borrowed(ctx: Arc<Context>, raw: u64) -> CudaStream {
        CudaStream {
            ctx,
            raw: raw as usize as sys::CUstream,
            owned: false,
        }
    }

    /// Whether the stream is in graph capture (active or invalidated).
    pub(super) fn capturing(&self) -> Result<bool> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: live stream, valid out-pointer.
        check("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(self.raw, &mut status)
        })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
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
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.raw) })
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        self.ctx.bind_for_drop();
        // SAFETY: destroys the stream created in `new`, once. Work still queued
        // completes first (the driver defers the release).
        drop_check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(self.raw) });
    }
}

/// An event with timing enabled.
pub struct CudaEvent {
    pub(super) ctx: Arc<Context>,
    pub(super) raw: sys::CUevent,
}

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    pub(super) fn new(ctx: Arc<Context>) -> Result<CudaEvent> {
        let mut raw: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT as u32;
        // SAFETY: valid out-pointer; the context is current.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, flags) })?;
        Ok(CudaEvent { ctx, raw })
    }

    /// `Ok(true)` once the work before the last record has finished.
    pub(super) fn query(&self) -> Result<bool> {
        // SAFETY: live event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(error("cuEventQuery", other)),
        }
    }

    pub(super) fn elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: two live events of one context (checked by the caller).
        match unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.raw, end.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(ms),
            sys::CUresult::CUDA_ERROR_NOT_READY => Err(Error::invalid("elapsed_ms on an event that has not completed")),
            sys::CUresult::CUDA_ERROR_INVALID_HANDLE => Err(Error::invalid(
                "elapsed_ms on an event that was never recorded (or was recorded inside graph capture)",
            )),
            other => Err(error("cuEventElapsedTime", other)),
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        // SAFETY: destroys the event created in `new`, once.
        drop_check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(self.raw) });
    }
}

/// A captured graph and its executable instance.
pub struct CudaGraph {
    pub(super) ctx: Arc<Context>,
    graph: sys::CUgraph,
    pub(super) exec: sys::CUgraphExec,
}

// SAFETY: graph handles are driver objects usable from any thread; launches of
// one executable graph are serialised by the driver.
unsafe impl Send for CudaGraph {}
// SAFETY: as above.
unsafe impl Sync for CudaGraph {}

impl CudaGraph {
    /// End capture on `stream` and instantiate what it recorded.
    pub(super) fn end_capture(stream: &CudaStream) -> Result<CudaGraph> {
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: live stream, valid out-pointer.
        let r = unsafe { sys::cuStreamEndCapture(stream.raw, &mut graph) };
        if r != sys::CUresult::CUDA_SUCCESS {
            if !graph.is_null() {
                // SAFETY: a graph the driver handed us despite the error; destroyed once.
                drop_check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) });
            }
            return Err(match r {
                sys::CUresult::CUDA_ERROR_ILLEGAL_STATE => {
                    Error::invalid("end_capture on a stream that is not capturing")
                }
                other => error("cuStreamEndCapture", other),
            });
        }
        let mut g = CudaGraph {
            ctx: stream.ctx.clone(),
            graph,
            exec: std::ptr::null_mut(),
        };
        // SAFETY: `graph` is the live graph just captured; valid out-pointer.
        check("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut g.exec, graph, 0)
        })?;
        Ok(g)
    }

    pub(super) fn launch(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: live executable graph and stream of the same context.
        check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(self.exec, stream.raw) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        self.ctx.bind_for_drop();
        // SAFETY: each handle was created once in `end_capture` and is released
        // once here; the driver keeps a launched graph's resources until it completes.
        unsafe {
            if !self.exec.is_null() {
                drop_check("cuGraphExecDestroy", sys::cuGraphExecDestroy(self.exec));
            }
            if !self.graph.is_null() {
                drop_check("cuGraphDestroy", sys::cuGraphDestroy(self.graph));
            }
        }
    }
}
