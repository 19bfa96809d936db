//! The copy route (docs/protocol.md, "Copy route"): all-gather, broadcast
//! and all-to-all moved by the copy engines, with no data-moving kernel.
//!
//! Each rank pushes its blocks into its peers' inboxes with
//! [`Device::copy_device`] (a peer's workspace is mapped here, so the copy
//! engine writes it over the link), and copies what landed in its own inboxes
//! into its receive blocks. Push rather than pull: a rank's copies then wait
//! only for its own stream, and its sends leave as soon as every peer has
//! entered the call. `fc_copy_sync`, one block that moves no data, is the
//! handshake around the copies, with the flags, fingerprints, deadlines and
//! abort of every other kind: phase 0 (every peer entered the call, with the
//! same call), then the pushes, then phase 1 (every peer's pushes landed).
//!
//! Copies take fixed addresses, recorded once (graph capture), while the
//! parity region a launch may write before its first wait follows the
//! device's epoch. So the inboxes are always parity region 0, and phase 1
//! ends each chunk at an even epoch (its phase-0 epoch rounded up; every
//! rank stores the same epochs, so every rank rounds alike): the next launch
//! starts at an odd epoch and writes only region 1 before its first wait,
//! which proves every rank has copied its inboxes out. Phase 0 keeps the
//! epoch every kind's first handshake has, so a crossed call meets it there
//! and is a mismatch.

use super::kernels::KernelKind;
use super::launch::{fingerprint, CollectiveCall};
use super::layout::DATA_OFFSET;
use super::workspace::Workspace;
use crate::device::{Device, DevicePtr, KernelParams, LaunchConfig, MAX_RANKS};
use crate::error::{Error, Result};

/// `KernelParams::aux` of the handshake: every peer entered the call.
pub const PHASE_ENTERED: u32 = 0;
/// `KernelParams::aux` of the handshake: every peer's pushes landed.
pub const PHASE_LANDED: u32 = 1;

/// Threads of the handshake's one block: one per rank, a whole warp.
const SYNC_THREADS: u32 = 32;
const _: () = assert!(MAX_RANKS <= SYNC_THREADS as usize);

/// Bytes of one source's inbox: parity region 0 (two slots) split over the
/// world, 64-byte aligned.
pub const fn inbox_stride(slot_bytes: usize, world: usize) -> usize {
    let world = if world == 0 { 1 } else { world };
    (2 * slot_bytes / world) & !63
}

/// One block of the call's lists: `(count, address)`, elements of the dtype.
#[derive(Clone, Copy)]
struct Block {
    count: usize,
    at: DevicePtr,
}

/// Row `count_row` and `count_row + 1` of the per-peer lists: counts and
/// addresses (rows 0-1 sends, rows 2-3 receives).
fn blocks(call: &CollectiveCall, count_row: usize, world: usize) -> Vec<Block> {
    (0..world)
        .map(|q| Block {
            count: call.per_peer[count_row][q] as usize,
            at: DevicePtr(call.per_peer[count_row + 1][q]),
        })
        .collect()
}

/// What one call's copies need besides the lists.
pub(super) struct Route<'a, D: Device> {
    pub dev: &'a D,
    pub module: &'a D::Module,
    pub name: &'a str,
    pub ws: &'a Workspace<D>,
    pub rank: usize,
    pub stream: &'a D::Stream,
    /// The parameter block every launch of the call shares.
    pub base: KernelParams,
}

impl<D: Device> Route<'_, D> {
    /// Queue the whole call: per chunk, phase 0, the pushes, phase 1 and the
    /// copies out of the inboxes; this rank's own block last. `call.count`
    /// is the block the group agrees on, which sets the chunks alike on every
    /// rank; a listed block larger than it is refused before anything runs.
    pub fn enqueue(&self, call: &CollectiveCall) -> Result<()> {
        let world = self.ws.world();
        let es = call.dtype.size();
        let (sends, recvs) = (blocks(call, 0, world), blocks(call, 2, world));
        let agreed = call.count;
        if let Some(b) = sends.iter().chain(&recvs).find(|b| b.count > agreed) {
            return Err(Error::invalid(format!(
                "the copy route moves blocks of the agreed {agreed} elements at most, not {}",
                b.count
            )));
        }
        let stride = inbox_stride(self.ws.slot_bytes(), world);
        let cap = stride / es;
        if cap == 0 {
            return Err(Error::invalid(format!(
                "the copy route's inboxes ({stride} bytes a source) hold no {es}-byte element"
            )));
        }
        let own = self.ws.peer_ptrs()[self.rank];
        let peers = self.ws.peer_ptrs();
        let inbox = |ws: DevicePtr, src: usize| ws.offset(DATA_OFFSET + src * stride);
        // Peers in an order staggered by rank, so no one link takes every
        // rank's first copy.
        let order: Vec<usize> = (1..world).map(|i| (self.rank + i) % world).collect();
        for chunk in 0..agreed.div_ceil(cap) {
            let first = chunk * cap;
            let piece = |b: &Block| (b.count > first).then(|| (b.count - first).min(cap) * es);
            self.sync(call, chunk, PHASE_ENTERED)?;
            for &q in &order {
                if let Some(bytes) = piece(&sends[q]) {
                    let src = sends[q].at.offset(first * es);
                    self.dev.copy_device(inbox(peers[q], self.rank), src, bytes, self.stream)?;
                }
            }
            self.sync(call, chunk, PHASE_LANDED)?;
            for &s in &order {
                if let Some(bytes) = piece(&recvs[s]) {
                    let dst = recvs[s].at.offset(first * es);
                    self.dev.copy_device(dst, inbox(own, s), bytes, self.stream)?;
                }
            }
        }
        // Last: a receive block may be a send block of another pair (in
        // place), and every push has been queued before this.
        let (send, recv) = (sends[self.rank], recvs[self.rank]);
        let bytes = send.count.min(recv.count) * es;
        if send.at != recv.at && bytes > 0 {
            self.dev.copy_device(recv.at, send.at, bytes, self.stream)?;
        }
        Ok(())
    }

    /// One handshake launch of chunk `chunk` at `phase`.
    fn sync(&self, call: &CollectiveCall, chunk: usize, phase: u32) -> Result<()> {
        debug_assert_eq!(call.kind, KernelKind::Copy);
        let params = KernelParams {
            count: call.count as u64,
            fingerprint: fingerprint(call, chunk),
            aux: phase,
            ..self.base
        };
        let config = LaunchConfig::new(1, SYNC_THREADS);
        self.dev.launch(self.module, self.name, config, &params, self.stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inboxes_split_parity_region_zero() {
        assert_eq!(inbox_stride(1 << 20, 2), 1 << 20);
        assert_eq!(inbox_stride(1 << 20, 3) % 64, 0);
        assert!(3 * inbox_stride(1 << 20, 3) <= 2 << 20);
        assert_eq!(inbox_stride(100, 0), 192);
    }
}
