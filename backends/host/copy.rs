//! The copy route's handshake, `fc_copy_sync` (docs/protocol.md, "Copy
//! route"): the twin of `kernels-cuda/collectives.cu`'s. The data moves by
//! the stream's own copies (`Device::copy_device`, this backend's stand-in
//! for the copy engines) between two launches of it; it moves none.

use super::kernels::Launch;

/// Phase `p.aux` of the handshake at the launch's epoch rounded up to even
/// (the route's copies always use parity region 0); phase 1 publishes it.
/// Returns the epoch to publish, as `kernels::launch` wants.
pub(super) fn copy_sync(l: &Launch) -> Option<u32> {
    let l = l.chunk((l.epoch & 1) as usize);
    let phase = l.p.aux as usize;
    l.arrive(phase);
    if !l.wait(phase) {
        return None;
    }
    (phase == 1).then_some(l.epoch)
}
