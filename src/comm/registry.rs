//! Registered memory: caller buffers every peer has mapped, so a peer can
//! reach them directly (torchcomms' windows and zero-copy paths build on it).

use super::tensor::Tensor;
use crate::device::{Device, DevicePtr, MAX_RANKS};

/// A registered tensor: what [`Communicator::register`](super::Communicator::register)
/// returns. Collective to create; `Communicator::deregister` unmaps the
/// peers' buffers here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    pub(crate) id: u64,
    pub(crate) tensor: Tensor,
}

impl Registration {
    /// The local tensor that was registered.
    pub fn tensor(&self) -> Tensor {
        self.tensor
    }
}

pub(crate) struct Entry<D: Device> {
    pub(crate) id: u64,
    pub(crate) local: Tensor,
    /// Every rank's tensor as mapped here (`[rank]` is ours); the mappings
    /// own the peers' memory until deregistration.
    pub(crate) peer_ptrs: [DevicePtr; MAX_RANKS],
    pub(crate) peer_counts: [usize; MAX_RANKS],
    pub(crate) _mapped: Vec<D::PeerBuffer>,
}

/// This communicator's registrations.
pub(crate) struct Registry<D: Device> {
    pub(crate) entries: Vec<Entry<D>>,
    pub(crate) next: u64,
}

impl<D: Device> Default for Registry<D> {
    fn default() -> Self {
        Registry {
            entries: Vec::new(),
            next: 0,
        }
    }
}

impl<D: Device> Registry<D> {
    /// The registration holding all of `t`, with `t`'s offset in it.
    #[allow(dead_code)]
    pub(crate) fn find(&self, t: &Tensor) -> Option<(u64, usize)> {
        let (start, bytes) = (t.ptr().0, t.bytes().ok()? as u64);
        self.entries.iter().find_map(|e| {
            let (base, len) = (e.local.ptr().0, e.local.bytes().ok()? as u64);
            (start >= base && start + bytes <= base + len).then(|| (e.id, (start - base) as usize))
        })
    }
}
