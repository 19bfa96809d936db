//! The LL protocols on the host (docs/protocol.md "One-shot, LL" and
//! "Exchange and reduce-to, LL"), one block: every 4 bytes of a block
//! (zero-padded to whole 8-byte lines) travel as one 8-byte unit
//! `{data, flag = E | 1}` into the sender's lines at the receiver; then the
//! fingerprint does, as one 16-byte record, to every peer. A receiver waits
//! for every peer's record, compares it, then takes every unit it expects,
//! clearing each (to 0) for the launch two later.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::collectives::{elem_size, Lists};
use super::futex;
use super::kernels::{atomic_u32, atomic_u64, copy_bytes, reduce_range, Launch};
use super::reduce::{Lanes, Reduction};
use crate::device::{DevicePtr, MAX_RANKS};

/// The flag half (high 32 bits, little-endian) of the LL unit at `unit`, as
/// a futex word. Only its address and a plain load are used: the unit itself
/// is written and read as one 8-byte atomic.
fn flag_word<'a>(unit: DevicePtr) -> &'a AtomicU32 {
    // SAFETY: LL units lie inside live, 8-byte aligned workspaces; the flag
    // half is the aligned u32 at offset 4.
    unsafe { atomic_u32(unit.offset(4)) }
}

fn unit_at<'a>(addr: DevicePtr) -> &'a AtomicU64 {
    // SAFETY: LL units lie inside every mapped workspace (8-byte aligned).
    unsafe { atomic_u64(addr) }
}

/// An LL unit: 4 data bytes (low half) and the launch's flag (high half).
fn unit(word: u32, flag: u32) -> u64 {
    ((flag as u64) << 32) | word as u64
}

/// `bytes` bytes at `addr`, zero-padded to whole 8-byte lines.
///
/// # Safety: `addr` holds `bytes` live bytes.
unsafe fn lines_of(addr: DevicePtr, bytes: usize) -> Vec<u8> {
    let mut v = vec![0u8; bytes.div_ceil(8) * 8];
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy_nonoverlapping(addr.0 as *const u8, v.as_mut_ptr(), bytes) };
    v
}

/// Store `data` (whole lines) as units into our lines at peer `q`.
pub(super) fn push(l: &Launch, q: usize, data: &[u8]) {
    let (lines, flag) = (l.ll_lines(q, l.me()), l.ll_flag());
    for (u, word) in data.chunks_exact(4).enumerate() {
        let w = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        unit_at(lines.offset(u * 8)).store(unit(w, flag), Ordering::Release);
    }
}

/// Send our record to every peer (after our data, so a reader that sees it
/// sees the data too), then wait for every peer's, clear and compare it.
/// False with the error words set on a deadline or a mismatch.
pub(super) fn handshake(l: &Launch) -> bool {
    let (world, me, flag, fp) = (l.world(), l.me(), l.ll_flag(), l.p.fingerprint);
    for k in 1..world {
        let rec = l.ll_fp_addr((me + k) % world, me);
        unit_at(rec.offset(8)).store(unit((fp >> 32) as u32, flag), Ordering::Release);
        unit_at(rec).store(unit(fp as u32, flag), Ordering::Release);
        futex::wake_all(flag_word(rec));
    }
    let mut fps = [fp; MAX_RANKS];
    // A reader sleeps on the flag half of a record's first unit, which its
    // writer stores last and wakes.
    let got = l.spin_all(
        |s| {
            if s == me {
                return true;
            }
            let rec = l.ll_fp_addr(me, s);
            let (lo, hi) = (
                unit_at(rec).load(Ordering::Acquire),
                unit_at(rec.offset(8)).load(Ordering::Acquire),
            );
            let ok = (lo >> 32) as u32 == flag && (hi >> 32) as u32 == flag;
            if ok {
                fps[s] = (lo & 0xffff_ffff) | (hi << 32);
                unit_at(rec).store(0, Ordering::Relaxed);
                unit_at(rec.offset(8)).store(0, Ordering::Relaxed);
            }
            ok
        },
        |s| flag_word(l.ll_fp_addr(me, s)),
    );
    if !got {
        return false;
    }
    if let Some(s) = (0..world).find(|&s| fps[s] != fp) {
        l.mismatch(s);
        return false;
    }
    true
}

/// Take `want[s]` bytes (whole lines) from every source's lines, clearing
/// each unit read; `None` after a deadline (error words set).
pub(super) fn pull(l: &Launch, want: &[usize]) -> Option<Vec<Vec<u8>>> {
    let (me, flag) = (l.me(), l.ll_flag());
    let words: Vec<usize> = want.iter().map(|&b| b.div_ceil(8) * 2).collect();
    let mut bufs: Vec<Vec<u8>> = want.iter().map(|&b| Vec::with_capacity(b.div_ceil(8) * 8)).collect();
    let mut next = vec![0usize; want.len()];
    let got = l.spin_all(
        |s| {
            let lines = l.ll_lines(me, s);
            while next[s] < words[s] {
                let u = unit_at(lines.offset(next[s] * 8));
                let v = u.load(Ordering::Acquire);
                if (v >> 32) as u32 != flag {
                    return false;
                }
                bufs[s].extend_from_slice(&(v as u32).to_le_bytes());
                u.store(0, Ordering::Relaxed);
                next[s] += 1;
            }
            true
        },
        // Units come before their writer's record, whose wake the handshake
        // already consumed: any word serves to sleep on.
        |s| flag_word(l.ll_fp_addr(me, s)),
    );
    got.then_some(bufs)
}

/// Every peer's non-empty send block of `lists` (elements of `es` bytes) on
/// its lines, then the handshake: whether every peer's record agreed.
///
/// # Safety: every send block holds its count of elements.
unsafe fn push_sends(l: &Launch, lists: &Lists, es: usize) -> bool {
    let (world, me) = (l.world(), l.me());
    for q in (1..world).map(|k| (me + k) % world) {
        let (n, from) = lists.send(q);
        if n > 0 {
            // SAFETY: the caller's promise.
            push(l, q, &unsafe { lines_of(from, n * es) });
        }
    }
    handshake(l)
}

/// The sources of a reduction in rank order: `own` for this rank, the
/// pulled buffer for every peer.
pub(super) fn sources(me: usize, own: DevicePtr, bufs: &[Vec<u8>]) -> Vec<DevicePtr> {
    (0..bufs.len())
        .map(|s| {
            if s == me {
                own
            } else {
                DevicePtr(bufs[s].as_ptr() as u64)
            }
        })
        .collect()
}

/// One-shot, LL all-reduce: our input to every peer; every peer's, reduced
/// with ours in rank order.
///
/// # Safety: see `HostKernel::call`.
pub(super) unsafe fn oneshot_ll<T: Lanes>(l: &Launch, op: Reduction) -> bool {
    let (world, me, n) = (l.world(), l.me(), l.p.count as usize);
    let bytes = n * std::mem::size_of::<T>();
    // SAFETY: the input holds `count` elements.
    let mine = unsafe { lines_of(l.p.input, bytes) };
    for k in 1..world {
        push(l, (me + k) % world, &mine);
    }
    if !handshake(l) {
        return false;
    }
    let want: Vec<usize> = (0..world).map(|s| if s == me { 0 } else { bytes }).collect();
    let Some(bufs) = pull(l, &want) else { return false };
    let srcs = sources(me, l.p.input, &bufs);
    // SAFETY: every source holds at least `count` elements (the buffers hold
    // whole lines), the output `count`; in place is fine (reduce_range tiles).
    unsafe { reduce_range::<T>(l, op, &srcs, n, &[l.p.output]) };
    true
}

/// Exchange, LL (all-gather, gather, scatter): every send block to its
/// receiver; every receive block from its source, ours straight across.
/// Every send block is read before any receive block is written, so any
/// aliasing between them is safe here.
///
/// # Safety: see `HostKernel::call`.
pub(super) unsafe fn exchange_ll(l: &Launch) -> bool {
    let (world, me, es, lists) = (l.world(), l.me(), elem_size(l.p), Lists(l.p));
    // SAFETY: a send block holds its count of elements.
    if !unsafe { push_sends(l, &lists, es) } {
        return false;
    }
    let want: Vec<usize> = (0..world)
        .map(|s| if s == me { 0 } else { lists.recv(s).0 * es })
        .collect();
    let Some(bufs) = pull(l, &want) else { return false };
    let ((n, from), (_, to)) = (lists.send(me), lists.recv(me));
    if n > 0 && from != to {
        // SAFETY: our own send and receive blocks hold `n` elements each.
        unsafe { copy_bytes(to, from, n * es) };
    }
    for s in (0..world).filter(|&s| s != me && want[s] > 0) {
        // SAFETY: the receive block holds `want[s]` bytes; the buffer at least as many.
        unsafe { copy_bytes(lists.recv(s).1, DevicePtr(bufs[s].as_ptr() as u64), want[s]) };
    }
    true
}

/// Reduce-to, LL (reduce-scatter, reduce): every send block to its
/// receiver; a receiver reduces every source's block with its own in rank
/// order.
///
/// # Safety: see `HostKernel::call`.
pub(super) unsafe fn reduce_to_ll<T: Lanes>(l: &Launch, op: Reduction) -> bool {
    let (world, me, lists) = (l.world(), l.me(), Lists(l.p));
    let size = std::mem::size_of::<T>();
    // SAFETY: a send block holds its count of elements.
    if !unsafe { push_sends(l, &lists, size) } {
        return false;
    }
    let n = lists.recv(me).0;
    if n == 0 {
        return true;
    }
    let want: Vec<usize> = (0..world).map(|s| if s == me { 0 } else { n * size }).collect();
    let Some(bufs) = pull(l, &want) else { return false };
    let srcs = sources(me, lists.send(me).1, &bufs);
    // SAFETY: our own block and every buffer hold `n` elements, the output
    // too; in place (output = own block) is fine (reduce_range tiles).
    unsafe { reduce_range::<T>(l, op, &srcs, n, &[l.p.output]) };
    true
}
