//! Handles to queued collectives.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::communicator::Inner;
use crate::device::Device;
use crate::error::{Error, Result};

/// A collective queued on a communicator's stream.
pub struct Work<D: Device> {
    inner: Arc<Inner<D>>,
    event: D::Event,
    what: &'static str,
}

impl<D: Device> Work<D> {
    pub(crate) fn record(inner: Arc<Inner<D>>, what: &'static str) -> Result<Self> {
        let event = inner.device.create_event()?;
        inner.device.record(&event, &inner.stream)?;
        Ok(Work { inner, event, what })
    }

    /// True once the collective has finished, successfully or not
    /// ([`Work::wait`] tells which).
    pub fn is_completed(&self) -> bool {
        self.inner.device_error().is_some() || self.inner.device.query(&self.event).unwrap_or(true)
    }

    /// Wait for the collective. `None` waits as long as the communicator's
    /// timeout (plus a grace period for the kernels' own deadline to report
    /// which ranks are missing).
    ///
    /// A kernel-reported failure (a peer that never arrived, a mismatched
    /// call) aborts the communicator. A caller-chosen timeout shorter than the
    /// communicator's returns [`Error::Timeout`] and leaves it usable.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let comm_timeout = self.inner.opts.timeout;
        let grace = (comm_timeout / 4).clamp(Duration::from_millis(500), Duration::from_secs(30));
        let limit = timeout.unwrap_or(comm_timeout + grace);
        let start = Instant::now();
        // Device errors are looked at between slices of waiting: a kernel that
        // failed may leave its event pending until its own deadline.
        let slice = Duration::from_millis(5);
        loop {
            if let Some(err) = self.inner.device_error() {
                self.inner.abort(&err.to_string());
                return Err(err);
            }
            let left = limit.saturating_sub(start.elapsed());
            if self.inner.device.wait_event_for(&self.event, left.min(slice))? {
                // The kernels may have failed just before the event completed.
                if let Some(err) = self.inner.device_error() {
                    self.inner.abort(&err.to_string());
                    return Err(err);
                }
                return Ok(());
            }
            if start.elapsed() >= limit {
                let err = Error::Timeout {
                    what: format!("{} to complete", self.what),
                    after: limit,
                    missing: Vec::new(),
                };
                if limit >= comm_timeout {
                    self.inner.abort(&err.to_string());
                }
                return Err(err);
            }
        }
    }
}
