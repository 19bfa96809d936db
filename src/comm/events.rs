//! Events recycled across calls. Every queued call records an event (its
//! `Work`, and the next call's wait when it runs on another stream);
//! creating one per call costs a driver call on the eager path. An event is
//! reused once nothing but the pool holds it: no `Work` waits on it and no
//! later call orders itself after it. Recording it again then affects no
//! one, since a stream that waited on it already took the earlier record.

use std::sync::Arc;

use crate::device::Device;
use crate::error::Result;

/// Events a communicator keeps for reuse (enough for every call a caller
/// keeps a `Work` of, in practice; beyond that, events are made per call).
const KEPT: usize = 64;

pub(crate) struct EventPool<D: Device> {
    events: Vec<Arc<D::Event>>,
}

impl<D: Device> Default for EventPool<D> {
    fn default() -> Self {
        EventPool { events: Vec::new() }
    }
}

impl<D: Device> EventPool<D> {
    /// An event no one else holds, or a new one. The pool is only used
    /// under the communicator's lock, so a count of one cannot grow
    /// meanwhile: clones of a pooled event are made only here.
    pub(crate) fn take(&mut self, device: &D) -> Result<Arc<D::Event>> {
        if let Some(e) = self.events.iter().find(|e| Arc::strong_count(e) == 1) {
            return Ok(e.clone());
        }
        let e = Arc::new(device.create_event()?);
        if self.events.len() < KEPT {
            self.events.push(e.clone());
        }
        Ok(e)
    }
}
