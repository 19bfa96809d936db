//! The copy route's handshake, `fc_copy_sync` (docs/protocol.md, "Copy
//! route"): the twin of `kernels-cuda/collectives.cu`'s. The data moves by
//! the stream's own copies (`Device::copy_device`, this backend's stand-in
//! for the copy engines) between two launches of it; it moves none.

use super::kernels::Launch;

/// Phase `p.aux` of the handshake: phase 0 at the launch's epoch `E` (where
/// every kind's first handshake meets a crossed call), phase 1 at `E`
/// rounded up to even, which it publishes (the route's inboxes are always
/// parity region 0, so the next launch must start at an odd epoch). Returns
/// the epoch to publish, as `kernels::launch` wants.
pub(super) fn copy_sync(l: &Launch) -> Option<u32> {
    let phase = l.p.aux as usize;
    let l = match phase {
        1 => l.chunk((l.epoch & 1) as usize),
        _ => *l,
    };
    l.arrive(phase);
    if !l.wait(phase) {
        return None;
    }
    (phase == 1).then_some(l.epoch)
}
