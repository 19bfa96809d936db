//! Handles to queued collectives.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::communicator::Inner;
use crate::device::Device;
use crate::error::{Error, Result};

/// A collective queued on a stream. Dropping it does not wait: the work
/// stays queued, stream-ordered (torchcomms' `async_op=False` is a dropped
/// `Work`).
pub struct Work<D: Device> {
    inner: Arc<Inner<D>>,
    /// `None` for a call captured into a graph: it runs at replay.
    event: Option<Arc<D::Event>>,
    what: &'static str,
    /// The call's own timeout, if it had one.
    timeout: Option<Duration>,
    /// The communicators of earlier steps of the same call (the levels of
    /// a communicator that spans nodes): their failures are this work's.
    parts: Vec<Arc<Inner<D>>>,
}

impl<D: Device> Work<D> {
    /// The work of a call just queued on `stream`: `event` (none for a call
    /// captured into a graph, which runs at replay) is recorded after it.
    pub(crate) fn record(
        inner: Arc<Inner<D>>,
        stream: &D::Stream,
        what: &'static str,
        timeout: Option<Duration>,
        event: Option<Arc<D::Event>>,
    ) -> Result<Self> {
        if let Some(e) = &event {
            inner.device.record(e, stream)?;
        }
        Ok(Work {
            inner,
            event,
            what,
            timeout,
            parts: Vec::new(),
        })
    }

    /// This work, answering also for failures in `comms`' kernels.
    pub(crate) fn with_parts(mut self, comms: &[&super::Communicator<D>]) -> Self {
        self.parts.extend(comms.iter().map(|c| c.inner.clone()));
        self
    }

    /// A failure the kernels of this call reported, and where.
    fn device_error(&self) -> Option<(Error, &Inner<D>)> {
        let after = self.timeout;
        std::iter::once(&self.inner).chain(&self.parts).find_map(|i| {
            i.device_error()
                .map(|e| match e {
                    // The kernels waited as long as this call asked.
                    Error::Timeout { what, missing, .. } if after.is_some() => Error::Timeout {
                        what,
                        after: after.unwrap_or_default(),
                        missing,
                    },
                    e => e,
                })
                .map(|e| (e, &**i))
        })
    }

    pub(crate) fn event(&self) -> Option<Arc<D::Event>> {
        self.event.clone()
    }

    /// What this work is (`"all_reduce"`, `"all_gather"`, ...).
    pub fn name(&self) -> &'static str {
        self.what
    }

    /// True once the collective has finished, successfully or not
    /// ([`Work::wait`] tells which). A captured call is complete at once:
    /// it runs when the graph is replayed.
    pub fn is_completed(&self) -> bool {
        let Some(event) = &self.event else {
            return true;
        };
        self.device_error().is_some() || self.inner.device.query(event).unwrap_or(true)
    }

    /// Wait for the collective. `None` waits as long as the call's timeout
    /// (or the communicator's), plus a grace period for the kernels' own
    /// deadline to report which ranks are missing.
    ///
    /// A kernel-reported failure (a peer that never arrived, a mismatched
    /// call) aborts the communicator, NCCL/RCCL underneath included. A
    /// timeout at least as long as the call's aborts it too (the vendor
    /// library's kernels cannot be stopped otherwise); a shorter one returns
    /// [`Error::Timeout`] and leaves it usable.
    ///
    /// What an error means for the caller's memory: after every error but
    /// one, the call has stopped (its kernels exited after the abort), so
    /// its buffers may be reused or freed. The exception is the
    /// [`Error::Timeout`] of a `timeout` shorter than the call's, which is a
    /// poll: the call still runs, [`Work::is_completed`] tells when it has
    /// stopped, and `wait(None)` waits for it. Where a device never stops a
    /// call after the abort (a vendor library that ignores it), `wait`
    /// returns [`Error::Aborted`] after twice the call's timeout, with the
    /// call still queued, and `is_completed` stays false.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let Some(event) = &self.event else {
            return Ok(());
        };
        let call_timeout = self.timeout.unwrap_or(self.inner.opts.timeout);
        let grace = (call_timeout / 4).clamp(Duration::from_millis(500), Duration::from_secs(30));
        let limit = timeout.unwrap_or(call_timeout + grace);
        let start = Instant::now();
        // Device errors are looked at between slices of waiting: a kernel that
        // failed may leave its event pending until its own deadline.
        let slice = Duration::from_millis(5);
        loop {
            if let Some((err, comm)) = self.device_error() {
                comm.abort(&err.to_string());
                return self.stopped(event, call_timeout, err);
            }
            let left = limit.saturating_sub(start.elapsed());
            if self.inner.device.wait_event_for(event, left.min(slice))? {
                // The kernels may have failed just before the event completed.
                if let Some((err, comm)) = self.device_error() {
                    comm.abort(&err.to_string());
                    return Err(err);
                }
                return Ok(());
            }
            if start.elapsed() >= limit {
                let err = Error::Timeout {
                    what: format!("{} on communicator {} to complete", self.what, self.inner.name),
                    after: limit,
                    missing: Vec::new(),
                };
                if limit < call_timeout {
                    return Err(err);
                }
                self.inner.abort(&err.to_string());
                return self.stopped(event, call_timeout, err);
            }
        }
    }

    /// `err`, once the call has stopped after the abort: queued kernels exit
    /// at their next look at the error word (at the latest at their own
    /// deadline, the call's timeout). [`Error::Aborted`] if it never stops.
    fn stopped(&self, event: &D::Event, call_timeout: Duration, err: Error) -> Result<()> {
        let bound = call_timeout.saturating_mul(2) + Duration::from_secs(1);
        match self.inner.device.wait_event_for(event, bound) {
            Ok(true) => Err(err),
            _ => Err(Error::Aborted(format!(
                "{err}; and the call was still queued {} s after the abort",
                bound.as_secs()
            ))),
        }
    }
}
