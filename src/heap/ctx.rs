//! The device API's context (`struct FcDevCtx` in `kernels-cuda/device_api.cuh`)
//! and its host twin: the same operations in Rust, which the host backend's
//! heap kernels (windows, EP dispatch/combine) are written against, as the GPU
//! kernels are written against the header. docs/device-api.md is the reference.
//!
//! The twin's operations dereference the context's addresses, so they are
//! crate-private: only host-backend kernels call them, on contexts the
//! communicator built from live heaps (`Communicator::device_ctx`).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{SYNC_BARRIER_ARRIVED, SYNC_BARRIER_COUNT};
use crate::device::abi::{abi_struct, AbiStruct};
use crate::device::{DevicePtr, ERR_CODE_NONE, ERR_CODE_TIMEOUT, MAX_RANKS};

/// Error word 3's value when a device-API wait (not a collective launch) timed out.
pub(crate) const ERR_EPOCH_DEVICE_API: u32 = u32::MAX;

/// The context every heap kernel gets by value. ABI twin of `FcDevCtx`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct DevCtx {
    /// Every rank's heap base as mapped in this process; `[rank]` is ours.
    pub heap: [DevicePtr; MAX_RANKS],
    /// Bytes of each rank's heap (the same on every rank).
    pub heap_bytes: u64,
    /// The communicator's host-mapped error words (`u32[ERR_WORDS]`).
    pub error_flags: DevicePtr,
    /// Bound of every wait.
    pub timeout_ns: u64,
    /// Offset in the heap of the sync area (barrier words).
    pub sync_offset: u64,
    /// This rank in the communicator.
    pub rank: u32,
    /// Ranks in the communicator.
    pub world: u32,
}

/// Size of the ABI struct.
pub const DEV_CTX_BYTES: usize = std::mem::size_of::<DevCtx>();

/// Every field of [`DevCtx`] with its offset and size, which `struct
/// FcDevCtx` must match (see `device::abi`).
pub(crate) const DEV_CTX_ABI: AbiStruct = abi_struct!(DevCtx as "FcDevCtx" {
    heap, heap_bytes, error_flags, timeout_ns, sync_offset, rank, world,
});
const _: () = DEV_CTX_ABI.assert_packed();

/// How [`DevCtx::wait_until`] compares a signal with its value (`FC_CMP_*`).
// The device API's whole set; the host twins wait with `Ge` alone.
#[allow(dead_code)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Cmp {
    Eq = 0,
    Ne = 1,
    Gt = 2,
    Ge = 3,
    Lt = 4,
    Le = 5,
}

impl Cmp {
    fn holds(self, x: u64, v: u64) -> bool {
        match self {
            Cmp::Eq => x == v,
            Cmp::Ne => x != v,
            Cmp::Gt => x > v,
            Cmp::Ge => x >= v,
            Cmp::Lt => x < v,
            Cmp::Le => x <= v,
        }
    }
}

impl DevCtx {
    /// `timeout` as [`DevCtx::timeout_ns`]. Saturating: a `Duration` can be
    /// longer than u64 nanoseconds (584 years), and such a bound must not wrap
    /// to a short one.
    pub(crate) fn timeout_ns_of(timeout: Duration) -> u64 {
        timeout.as_nanos().min(u64::MAX as u128) as u64
    }
}

// The twin offers the device API whole; each host kernel uses what it needs.
#[allow(dead_code)]
impl DevCtx {
    /// Whether `[p, p + bytes)` lies in this rank's heap.
    pub fn in_heap(&self, p: DevicePtr, bytes: u64) -> bool {
        let Some(base) = self.heap.get(self.rank as usize).map(|b| b.0) else {
            return false;
        };
        p.0 >= base && p.0.checked_add(bytes).is_some_and(|end| end <= base + self.heap_bytes)
    }

    /// `p`'s twin in `peer`'s heap, or `None` for a peer outside the world or
    /// a range outside the heap (the checks the header makes in debug builds).
    pub fn remote_ptr(&self, peer: usize, p: DevicePtr, bytes: u64) -> Option<DevicePtr> {
        if peer >= (self.world as usize).min(MAX_RANKS) || !self.in_heap(p, bytes) {
            return None;
        }
        Some(DevicePtr(p.0 - self.heap[self.rank as usize].0 + self.heap[peer].0))
    }

    /// The host twin works on process addresses; every one it touches went
    /// through [`DevCtx::remote_ptr`] or is the caller's.
    fn remote(&self, peer: usize, p: DevicePtr, bytes: u64) -> *mut u8 {
        match self.remote_ptr(peer, p, bytes) {
            Some(r) => r.0 as *mut u8,
            // The host API checks every address before a launch; a twin
            // that still gets a bad one has a bug, and a fault is the answer
            // that cannot corrupt a peer.
            None => panic!("device API: rank {peer} / {p:?}+{bytes} is outside the heap or the world"),
        }
    }

    /// Copy `bytes` from local `src` to `dst`'s twin at `peer`.
    ///
    /// # Safety
    /// `src..src+bytes` is readable; `dst..dst+bytes` is a heap range.
    pub(crate) unsafe fn put(&self, peer: usize, dst: DevicePtr, src: DevicePtr, bytes: u64) {
        let to = self.remote(peer, dst, bytes);
        // SAFETY: both ranges are live for `bytes` (caller; remote() checked
        // the heap side); memmove because a rank may put onto itself.
        unsafe { std::ptr::copy(src.0 as *const u8, to, bytes as usize) }
    }

    /// Copy `bytes` from `src`'s twin at `peer` to local `dst`.
    ///
    /// # Safety
    /// `dst..dst+bytes` is writable; `src..src+bytes` is a heap range.
    pub(crate) unsafe fn get(&self, peer: usize, dst: DevicePtr, src: DevicePtr, bytes: u64) {
        let from = self.remote(peer, src, bytes);
        // SAFETY: as in `put`.
        unsafe { std::ptr::copy(from as *const u8, dst.0 as *mut u8, bytes as usize) }
    }

    fn word(&self, peer: usize, p: DevicePtr) -> &AtomicU64 {
        let at = self.remote(peer, p, 8);
        assert!(
            (at as usize) % 8 == 0,
            "device API: signal word {p:?} is not 8-byte aligned"
        );
        // SAFETY: an aligned u64 inside a live heap mapping (remote() checked
        // the range); peers touch it only atomically.
        unsafe { AtomicU64::from_ptr(at as *mut u64) }
    }

    /// Store `v` into `sig`'s twin at `peer`, after every earlier write of this thread.
    pub(crate) fn signal_set(&self, peer: usize, sig: DevicePtr, v: u64) {
        self.word(peer, sig).store(v, Ordering::Release);
    }

    /// Add `v` to `sig`'s twin at `peer`, after every earlier write of this thread.
    pub(crate) fn signal_add(&self, peer: usize, sig: DevicePtr, v: u64) {
        self.word(peer, sig).fetch_add(v, Ordering::AcqRel);
    }

    /// Remote fetch-and-add; the old value.
    pub(crate) fn atomic_add(&self, peer: usize, p: DevicePtr, v: u64) -> u64 {
        self.word(peer, p).fetch_add(v, Ordering::AcqRel)
    }

    /// Remote compare-and-swap; the old value.
    pub(crate) fn atomic_cas(&self, peer: usize, p: DevicePtr, cmp: u64, v: u64) -> u64 {
        match self
            .word(peer, p)
            .compare_exchange(cmp, v, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(old) | Err(old) => old,
        }
    }

    /// Acquire load of `p`'s twin at `peer`.
    pub(crate) fn atomic_fetch(&self, peer: usize, p: DevicePtr) -> u64 {
        self.word(peer, p).load(Ordering::Acquire)
    }

    fn error_word(&self, i: usize) -> &AtomicU32 {
        // SAFETY: the communicator's error words, live while it is (the
        // launcher holds it); kernels and the host touch them atomically.
        unsafe { AtomicU32::from_ptr((self.error_flags.0 as *mut u32).add(i)) }
    }

    /// Whether the communicator already failed (another wait timed out, a
    /// mismatch, an abort): waits then give up at once.
    pub(crate) fn failed(&self) -> bool {
        self.error_word(0).load(Ordering::Acquire) != ERR_CODE_NONE
    }

    /// Record a timeout waiting for the ranks in `missing` (a bit mask):
    /// the details first, then the code (as the GPU kernels do), so a host
    /// that sees the code sees which ranks. An earlier error keeps its own.
    pub(crate) fn report_timeout(&self, missing: u32) {
        if self.failed() {
            return;
        }
        self.error_word(1).fetch_or(missing, Ordering::AcqRel);
        self.error_word(3).store(ERR_EPOCH_DEVICE_API, Ordering::Release);
        let _ =
            self.error_word(0)
                .compare_exchange(ERR_CODE_NONE, ERR_CODE_TIMEOUT, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Wait until our `sig` compares to `v` as `cmp` says; `peer` is who is
    /// expected to signal. False at the deadline (the error words then name
    /// `peer`) or when the communicator failed.
    pub(crate) fn wait_until(&self, sig: DevicePtr, cmp: Cmp, v: u64, peer: usize) -> bool {
        let word = self.word(self.rank as usize, sig);
        let mut spin = Spin::new(self.timeout_ns);
        loop {
            if cmp.holds(word.load(Ordering::Acquire), v) {
                return true;
            }
            if self.failed() {
                return false;
            }
            if spin.expired() {
                self.report_timeout(1 << peer);
                return false;
            }
        }
    }

    /// A barrier over every rank: count this rank's barriers in the sync
    /// area, publish the count to every peer, and wait for theirs.
    pub(crate) fn barrier_all(&self) -> bool {
        let me = self.rank as usize;
        let sync = self.heap[me].offset(self.sync_offset as usize);
        let count = self.atomic_add(me, sync.offset(SYNC_BARRIER_COUNT), 1) + 1;
        for peer in 0..self.world as usize {
            self.signal_set(peer, sync.offset(SYNC_BARRIER_ARRIVED + 8 * me), count);
        }
        let mut spin = Spin::new(self.timeout_ns);
        loop {
            let missing = (0..self.world as usize)
                .filter(|&p| self.atomic_fetch(me, sync.offset(SYNC_BARRIER_ARRIVED + 8 * p)) < count)
                .fold(0u32, |m, p| m | 1 << p);
            if missing == 0 {
                return true;
            }
            if self.failed() {
                return false;
            }
            if spin.expired() {
                self.report_timeout(missing);
                return false;
            }
        }
    }
}

/// The host twin's spin: back to back first (peers usually answer within
/// microseconds), then yielding, then short sleeps; and the deadline.
struct Spin {
    start: Instant,
    limit: Duration,
    polls: u32,
}

impl Spin {
    fn new(timeout_ns: u64) -> Spin {
        Spin {
            start: Instant::now(),
            limit: Duration::from_nanos(timeout_ns),
            polls: 0,
        }
    }

    fn expired(&mut self) -> bool {
        self.polls = self.polls.saturating_add(1);
        match self.polls {
            0..=256 => std::hint::spin_loop(),
            257..=4096 => std::thread::yield_now(),
            _ => std::thread::sleep(Duration::from_micros(20)),
        }
        self.start.elapsed() >= self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two "ranks" in one process: heaps are plain memory, each rank's
    /// context maps both, as peers' heaps are mapped.
    fn ctxs(heaps: &mut [Vec<u64>; 2], errors: &mut [u32; 4]) -> [DevCtx; 2] {
        let bases = [
            DevicePtr(heaps[0].as_mut_ptr() as u64),
            DevicePtr(heaps[1].as_mut_ptr() as u64),
        ];
        let mut heap = [DevicePtr::NULL; MAX_RANKS];
        heap[..2].copy_from_slice(&bases);
        let (heap_bytes, error_flags) = ((heaps[0].len() * 8) as u64, DevicePtr(errors.as_mut_ptr() as u64));
        let ctx = |rank| DevCtx {
            heap,
            heap_bytes,
            error_flags,
            timeout_ns: 200_000_000,
            sync_offset: 0,
            rank,
            world: 2,
        };
        [ctx(0), ctx(1)]
    }

    #[test]
    fn a_timeout_past_u64_nanoseconds_saturates() {
        assert_eq!(DevCtx::timeout_ns_of(Duration::from_millis(1500)), 1_500_000_000);
        assert_eq!(DevCtx::timeout_ns_of(Duration::from_nanos(u64::MAX)), u64::MAX);
        assert_eq!(DevCtx::timeout_ns_of(Duration::MAX), u64::MAX);
    }

    #[test]
    fn the_host_twin_moves_data_signals_and_meets_at_barriers() {
        let mut heaps = [vec![0u64; 1024], vec![0u64; 1024]];
        let mut errors = [0u32; 4];
        let [c0, c1] = ctxs(&mut heaps, &mut errors);
        let at = |c: &DevCtx, off: usize| c.heap[c.rank as usize].offset(off);
        let src = [7u8; 40];
        // SAFETY: both ranges lie in the heaps above, alive for the test.
        unsafe { c0.put(1, at(&c0, 1024), DevicePtr(src.as_ptr() as u64), 40) };
        let mut back = [0u8; 40];
        // SAFETY: as above.
        unsafe { c1.get(1, DevicePtr(back.as_mut_ptr() as u64), at(&c1, 1024), 40) };
        assert_eq!(back, src);
        c0.signal_add(1, at(&c0, 256), 2);
        c0.signal_set(1, at(&c0, 264), 9);
        assert!(c1.wait_until(at(&c1, 256), Cmp::Eq, 2, 0) && c1.wait_until(at(&c1, 264), Cmp::Ge, 9, 0));
        assert_eq!(c1.atomic_cas(0, at(&c1, 512), 0, 5), 0);
        assert_eq!(c0.atomic_fetch(0, at(&c0, 512)), 5);
        std::thread::scope(|s| {
            let t = s.spawn(|| (0..3).all(|_| c1.barrier_all()));
            assert!((0..3).all(|_| c0.barrier_all()));
            assert!(t.join().unwrap());
        });
        assert!(!c0.failed());
        // Rank 1 never signals again: a timeout naming it.
        assert!(!c0.wait_until(at(&c0, 256), Cmp::Ge, 1, 1));
        let words: Vec<u32> = (0..4).map(|i| c0.error_word(i).load(Ordering::Acquire)).collect();
        assert_eq!(
            (words[0], words[1], words[3]),
            (ERR_CODE_TIMEOUT, 2, ERR_EPOCH_DEVICE_API)
        );
        assert_eq!(c0.remote_ptr(2, at(&c0, 0), 8), None, "a peer outside the world");
        assert_eq!(c0.remote_ptr(1, DevicePtr(8), 8), None, "an address outside the heap");
    }
}
