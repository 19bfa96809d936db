//! The host protocols of the collectives beyond all-reduce and broadcast
//! (docs/protocol.md, "Exchange", "Reduce-to", "Send and receive"):
//!
//! - **exchange**: every rank sends one block to some peers and receives one
//!   from some, with per-peer counts and addresses in `KernelParams::per_peer`.
//!   All-gather, gather, scatter and all-to-all(-v) are exchanges.
//! - **reduce-to**: every rank sends a block to some peers; each receiver
//!   reduces what it receives (its own block included) in rank order.
//!   Reduce-scatter and reduce are reduce-tos.
//! - **direct** twins of both (heap blocks, zero copy): the exchange writes
//!   into receivers' heap blocks, the reduce-to reads its sources' heap
//!   blocks, each after one flag round that every rank uses to agree on it
//!   (else both fall back to the inbox protocols).
//! - **send/receive**: a batch of sends and receives between pairs, over the
//!   pair mailboxes with per-pair chunk sequence numbers (no epochs: only
//!   two ranks take part).
//!
//! Exchange and reduce-to run in chunks of one inbox per source (slot A of
//! the parity region, `push_twoshot_stride` bytes a source), chunk `c` with
//! epoch `E + c`. Chunk 0 also carries, per source, the count it sends to
//! this rank (checked against what this rank expects: a disagreement is a
//! mismatch naming the peer, never wrong data) and its largest block (the
//! group agrees on the number of chunks from these).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::futex;
use super::kernels::{copy_bytes, Launch};
use super::reduce::{Lanes, Reduction, Tiles};
use crate::algo::layout::{
    p2p_half_bytes, p2p_offset, push_twoshot_stride, AUX_EXPECTS, AUX_LARGEST, AUX_NOT_DIRECT, AUX_PAIR_COUNT,
    AUX_RECV_AT, P2P_CONSUMED, P2P_CTRL_OFFSET, P2P_DELIVERED, P2P_HEADER, P2P_RECEIVED, P2P_SENT,
};
use crate::device::{DevicePtr, KernelParams, ERR_CODE_MISMATCH, ERR_CODE_TIMEOUT, MAX_RANKS, PARAM_DIRECT_OK};
use crate::dtype::DType;

/// `per_peer` rows: counts and addresses of what goes to, and comes from, each peer.
const SEND_COUNT: usize = 0;
const SEND_ADDR: usize = 1;
const RECV_COUNT: usize = 2;
const RECV_ADDR: usize = 3;

/// # Safety: `addr` is a live, aligned u32 in a mapped workspace.
unsafe fn word<'a>(addr: DevicePtr) -> &'a AtomicU32 {
    // SAFETY: guaranteed by the caller; AtomicU32 has u32's layout.
    unsafe { &*(addr.0 as *const AtomicU32) }
}

/// # Safety: `addr` is a live, aligned u64 in a mapped workspace.
unsafe fn dword<'a>(addr: DevicePtr) -> &'a AtomicU64 {
    // SAFETY: guaranteed by the caller; AtomicU64 has u64's layout.
    unsafe { &*(addr.0 as *const AtomicU64) }
}

/// Bytes per element of a launch's dtype (the data-moving protocols move
/// any dtype).
pub(super) fn elem_size(p: &KernelParams) -> usize {
    DType::from_code(p.dtype).map_or(1, DType::size)
}

/// Per-peer counts and addresses of a launch.
pub(super) struct Lists<'a>(pub(super) &'a KernelParams);

impl Lists<'_> {
    pub(super) fn send(&self, q: usize) -> (usize, DevicePtr) {
        (
            self.0.per_peer[SEND_COUNT][q] as usize,
            DevicePtr(self.0.per_peer[SEND_ADDR][q]),
        )
    }
    pub(super) fn recv(&self, s: usize) -> (usize, DevicePtr) {
        (
            self.0.per_peer[RECV_COUNT][s] as usize,
            DevicePtr(self.0.per_peer[RECV_ADDR][s]),
        )
    }
    /// The largest block this rank sends or receives.
    fn largest(&self, world: usize) -> usize {
        (0..world)
            .map(|q| self.send(q).0.max(self.recv(q).0))
            .max()
            .unwrap_or(0)
    }
}

/// Chunk 0 of an exchange or reduce-to, after the flags (the aux words are
/// per block: a GPU block reads those of its own index, here block 0): whether every
/// source sends what this rank expects and expects what it sends (else a
/// mismatch, so both ends of a pair that disagree fail), and the group's
/// number of chunks (from the largest block anyone moves).
fn agree_on_chunks(l: &Launch, lists: &Lists, cap: usize) -> Option<usize> {
    let me = l.me();
    let mut largest = lists.largest(l.world());
    for s in (0..l.world()).filter(|&s| s != me) {
        // SAFETY: aux slots lie inside our own live workspace.
        let (pair, expects, theirs) = unsafe {
            (
                dword(l.aux_addr(me, AUX_PAIR_COUNT, s)).load(Ordering::Relaxed),
                dword(l.aux_addr(me, AUX_EXPECTS, s)).load(Ordering::Relaxed),
                dword(l.aux_addr(me, AUX_LARGEST, s)).load(Ordering::Relaxed),
            )
        };
        if pair != lists.recv(s).0 as u64 || expects != lists.send(s).0 as u64 {
            l.mismatch(s);
            return None;
        }
        largest = largest.max(theirs as usize);
    }
    if lists.send(me).0 != lists.recv(me).0 {
        l.mismatch(me);
        return None;
    }
    Some(largest.div_ceil(cap.max(1)).max(1))
}

/// Before chunk 0's arrive: tell every peer what we send it, what we expect
/// from it and our largest block.
fn announce(l: &Launch, lists: &Lists) {
    let me = l.me();
    let largest = lists.largest(l.world()) as u64;
    for q in (0..l.world()).filter(|&q| q != me) {
        // SAFETY: aux slots lie inside every mapped workspace; `arrive`'s
        // release store publishes them.
        unsafe {
            dword(l.aux_addr(q, AUX_PAIR_COUNT, me)).store(lists.send(q).0 as u64, Ordering::Relaxed);
            dword(l.aux_addr(q, AUX_EXPECTS, me)).store(lists.recv(q).0 as u64, Ordering::Relaxed);
            dword(l.aux_addr(q, AUX_LARGEST, me)).store(largest, Ordering::Relaxed);
        }
    }
}

/// Our inbox from `src` at `rank` (slot A of the parity region).
fn inbox(l: &Launch, rank: usize, src: usize) -> DevicePtr {
    l.region(rank)
        .offset(src * push_twoshot_stride(l.slot_bytes(), l.world()))
}

/// Elements `[first, first + len)` of a block of `count`, clipped.
fn piece(count: usize, first: usize, cap: usize) -> (usize, usize) {
    let a = first.min(count);
    (a, cap.min(count - a))
}

/// Push chunk `c` of every block we send to a peer into its inbox, then arrive.
///
/// # Safety: the send blocks are live for their counts.
unsafe fn push_chunk(l: &Launch, lists: &Lists, size: usize, cap: usize, c: usize) {
    let me = l.me();
    let world = l.world();
    // Staggered (peers after us first), as the GPU blocks would be.
    for k in 1..world {
        let q = (me + k) % world;
        let (count, addr) = lists.send(q);
        let (a, len) = piece(count, c * cap, cap);
        if len > 0 {
            // SAFETY: the chunk lies inside the send block and fits an inbox.
            unsafe { copy_bytes(inbox(l, q, me), addr.offset(a * size), len * size) };
        }
    }
}

/// The exchange. Returns the last epoch, or `None` after a failure.
///
/// # Safety: see [`super::kernels::HostKernel::call`]; the per-peer blocks
/// are live for their counts.
pub(super) unsafe fn exchange(l: &Launch) -> Option<u32> {
    let lists = Lists(l.p);
    let me = l.me();
    let world = l.world();
    let size = elem_size(l.p);
    let cap = push_twoshot_stride(l.slot_bytes(), world) / size;
    let mut nchunk = 1;
    let mut c = 0;
    while c < nchunk {
        let lc = l.chunk(c);
        if c == 0 {
            announce(&lc, &lists);
        }
        // SAFETY: forwarded from the caller.
        unsafe { push_chunk(&lc, &lists, size, cap, c) };
        lc.arrive(0);
        if !lc.wait(0) {
            return None;
        }
        if c == 0 {
            nchunk = agree_on_chunks(&lc, &lists, cap)?;
            // Our own block goes straight across (once; same counts, checked).
            let ((n, from), (_, to)) = (lists.send(me), lists.recv(me));
            // SAFETY: both blocks hold `n` elements; equal addresses (in place) are fine.
            unsafe { copy_bytes(to, from, n * size) };
        }
        for s in (0..world).filter(|&s| s != me) {
            let (count, addr) = lists.recv(s);
            let (a, len) = piece(count, c * cap, cap);
            if len > 0 {
                // SAFETY: the chunk fits the receive block and our inbox.
                unsafe { copy_bytes(addr.offset(a * size), inbox(&lc, me, s), len * size) };
            }
        }
        c += 1;
    }
    Some(l.epoch.wrapping_add(nchunk as u32 - 1))
}

/// Rank `r`'s heap base as mapped here, from the direct kinds' table.
///
/// # Safety: `l.p.table` is the heap bases' table (`PARAM_DIRECT_OK` set),
/// which holds MAX_RANKS live u64s in our heap's sync area, written once
/// before any launch.
unsafe fn heap_base(l: &Launch, r: usize) -> u64 {
    // SAFETY: guaranteed by the caller.
    unsafe { (l.p.table.0 as *const u64).add(r).read() }
}

/// Phase 0 of the direct kinds: tell each peer q the count we send it, the
/// count we expect from it (aux word 1, unused by these kinds otherwise:
/// each side checks the other's before a byte moves) and `at(q)`, where the
/// pair's block in our heap sits ([`AUX_NOT_DIRECT`] when we cannot go
/// direct); arrive and wait; agree. `Some(true)`: every rank goes direct;
/// `Some(false)`: every rank falls back (each told every other, so all
/// decide alike); `None` after a timeout or a count mismatch on either side
/// of a pair (raised, naming the peer; nothing moved).
fn direct_phase0(l: &Launch, lists: &Lists, direct_ok: bool, at: impl Fn(usize) -> u64) -> Option<bool> {
    let (me, world) = (l.me(), l.world());
    for q in (0..world).filter(|&q| q != me) {
        // SAFETY: aux slots lie inside every mapped workspace; `arrive`'s
        // release store publishes them.
        unsafe {
            dword(l.aux_addr(q, AUX_PAIR_COUNT, me)).store(lists.send(q).0 as u64, Ordering::Relaxed);
            dword(l.aux_addr(q, AUX_LARGEST, me)).store(lists.recv(q).0 as u64, Ordering::Relaxed);
            dword(l.aux_addr(q, AUX_RECV_AT, me)).store(at(q), Ordering::Relaxed);
        }
    }
    l.arrive(0);
    if !l.wait(0) {
        return None;
    }
    let mut all_direct = direct_ok;
    for s in (0..world).filter(|&s| s != me) {
        // SAFETY: our own aux slots, published before the flags we waited for.
        let (pair, expects, at) = unsafe {
            (
                dword(l.aux_addr(me, AUX_PAIR_COUNT, s)).load(Ordering::Relaxed),
                dword(l.aux_addr(me, AUX_LARGEST, s)).load(Ordering::Relaxed),
                dword(l.aux_addr(me, AUX_RECV_AT, s)).load(Ordering::Relaxed),
            )
        };
        if pair != lists.recv(s).0 as u64 || expects != lists.send(s).0 as u64 {
            l.mismatch(s);
            return None;
        }
        all_direct &= at != AUX_NOT_DIRECT;
    }
    if lists.send(me).0 != lists.recv(me).0 {
        l.mismatch(me);
        return None;
    }
    Some(all_direct)
}

/// The direct exchange (`fc_exchange_direct`): phase 0 carries, to each
/// peer, what we send it and where its block to us lands in our heap (or
/// that we cannot take blocks in place); if every rank can, each writes its
/// blocks straight into the receivers' heaps, and phase 1 tells receivers
/// they have landed. Phase 0 also proves each receiver has entered the
/// launch, so nothing earlier on its stream still uses those blocks. If one
/// rank cannot, every rank sees it (each rank told everyone) and all run
/// the exchange from the next epoch. Returns the last epoch, or `None`.
///
/// # Safety: as [`exchange`]; with `PARAM_DIRECT_OK`, `p.table` holds
/// every rank's heap base as mapped here, and our receive blocks lie in our
/// heap.
pub(super) unsafe fn exchange_direct(l: &Launch) -> Option<u32> {
    let lists = Lists(l.p);
    let me = l.me();
    let world = l.world();
    let size = elem_size(l.p);
    let direct_ok = l.p.flags & PARAM_DIRECT_OK != 0 && l.p.table != DevicePtr::NULL;
    // Where each peer's block to us lands in our heap.
    let at = |q: usize| match (direct_ok, lists.recv(q)) {
        (false, _) => AUX_NOT_DIRECT,
        (true, (0, _)) => 0,
        // SAFETY: with PARAM_DIRECT_OK, `table` is the heap bases' table.
        (true, (_, to)) => to.0.wrapping_sub(unsafe { heap_base(l, me) }),
    };
    if !direct_phase0(l, &lists, direct_ok, at)? {
        // SAFETY: forwarded from the caller.
        return unsafe { exchange(&l.chunk(1)) };
    }
    for k in 1..world {
        let q = (me + k) % world;
        let (n, from) = lists.send(q);
        if n == 0 {
            continue;
        }
        // SAFETY: our own aux slot from q, read above.
        let at = unsafe { dword(l.aux_addr(me, AUX_RECV_AT, q)).load(Ordering::Relaxed) };
        // SAFETY: q's receive block from us lies in q's heap at `at` (q said
        // so), holds `n` elements (the counts agreed) and overlaps none q sends.
        unsafe { copy_bytes(DevicePtr(heap_base(l, q).wrapping_add(at)), from, n * size) };
    }
    let ((n, from), (_, to)) = (lists.send(me), lists.recv(me));
    // SAFETY: both blocks hold `n` elements; equal addresses (in place) are fine.
    unsafe { copy_bytes(to, from, n * size) };
    l.arrive(1);
    l.wait(1).then_some(l.epoch)
}

/// The reduce-to: chunks as the exchange's, then every receiver reduces
/// its sources in rank order (its own block from its send list) into
/// `p.output`. Returns the last epoch, or `None` after a failure.
///
/// # Safety: as [`exchange`]; `p.output` holds the receive count.
pub(super) unsafe fn reduce_to<T: Lanes>(l: &Launch, op: Reduction) -> Option<u32> {
    let lists = Lists(l.p);
    let me = l.me();
    let world = l.world();
    let size = std::mem::size_of::<T>();
    let cap = push_twoshot_stride(l.slot_bytes(), world) / size;
    let receives = (0..world).any(|s| lists.recv(s).0 > 0);
    let n = (0..world).map(|s| lists.recv(s).0).max().unwrap_or(0);
    let mut tiles = Tiles::<T>::new();
    let mut nchunk = 1;
    let mut c = 0;
    while c < nchunk {
        let lc = l.chunk(c);
        if c == 0 {
            announce(&lc, &lists);
        }
        // SAFETY: forwarded from the caller.
        unsafe { push_chunk(&lc, &lists, size, cap, c) };
        lc.arrive(0);
        if !lc.wait(0) {
            return None;
        }
        if c == 0 {
            nchunk = agree_on_chunks(&lc, &lists, cap)?;
        }
        let (a, len) = piece(n, c * cap, cap);
        if receives && len > 0 {
            let srcs: Vec<DevicePtr> = (0..world)
                .map(|s| match s == me {
                    true => lists.send(me).1.offset(a * size),
                    false => inbox(&lc, me, s),
                })
                .collect();
            // SAFETY: every source chunk holds `len` elements (counts agreed
            // in chunk 0), as does the output chunk; in place is tile-safe.
            unsafe { tiles.reduce(lc.reduction(op), world, &srcs, len, &[l.p.output.offset(a * size)]) };
        }
        c += 1;
    }
    Some(l.epoch.wrapping_add(nchunk as u32 - 1))
}

/// The direct reduce-to (`fc_reduce_to_direct_<dtype>_<op>`, pull): phase 0
/// carries, to each peer, what we send it, what we expect from it, our
/// premul_sum factor (`arrive`) and where our block to it lies in our heap
/// (or that our blocks cannot be read in place). Passing the wait proves
/// every source has entered the launch, so its stream is done writing the
/// blocks it sends. If every rank's blocks can be read in place, each
/// receiver reduces straight from its sources' heaps (its own block from its
/// send list) with the inbox reduce-to's arithmetic, and phase 1 tells every
/// source its blocks have been read, so it may reuse them once its launch
/// ends. Otherwise every rank runs the reduce-to from the next epoch.
/// Returns the last epoch, or `None`.
///
/// # Safety: as [`reduce_to`]; with `PARAM_DIRECT_OK`, `p.table` holds
/// every rank's heap base as mapped here, and our blocks to peers lie in
/// our heap.
pub(super) unsafe fn reduce_to_direct<T: Lanes>(l: &Launch, op: Reduction) -> Option<u32> {
    let lists = Lists(l.p);
    let me = l.me();
    let world = l.world();
    let n = (0..world).map(|s| lists.recv(s).0).max().unwrap_or(0);
    // A receiver reads `n` elements of every source: with receive counts
    // that differ it would read past a shorter block, so it only takes the
    // inbox way, where it reads its own inboxes.
    let uniform = (0..world).all(|s| lists.recv(s).0 == n);
    let direct_ok = l.p.flags & PARAM_DIRECT_OK != 0 && l.p.table != DevicePtr::NULL && uniform;
    // Where our block to each peer sits in our heap (`arrive` adds our
    // premul_sum factor).
    let at = |q: usize| match (direct_ok, lists.send(q)) {
        (false, _) => AUX_NOT_DIRECT,
        (true, (0, _)) => 0,
        // SAFETY: with PARAM_DIRECT_OK, `table` is the heap bases' table.
        (true, (_, from)) => from.0.wrapping_sub(unsafe { heap_base(l, me) }),
    };
    if !direct_phase0(l, &lists, direct_ok, at)? {
        // SAFETY: forwarded from the caller.
        return unsafe { reduce_to::<T>(&l.chunk(1), op) };
    }
    if n > 0 {
        let srcs: Vec<DevicePtr> = (0..world)
            .map(|s| match s == me {
                true => lists.send(me).1,
                false => {
                    // SAFETY: our own aux slot from s, read above.
                    let at = unsafe { dword(l.aux_addr(me, AUX_RECV_AT, s)).load(Ordering::Relaxed) };
                    // SAFETY: every rank went direct, so `table` is the heap bases' table.
                    DevicePtr(unsafe { heap_base(l, s) }.wrapping_add(at))
                }
            })
            .collect();
        // SAFETY: source s's block to us lies in its heap at `at` (s said
        // so) and holds `n` elements (the counts agreed, all equal); s writes
        // nothing it sends until our phase-1 arrive, and our output overlaps
        // no block a peer reads (in place is tile-safe).
        unsafe { Tiles::<T>::new().reduce(l.reduction(op), world, &srcs, n, &[l.p.output]) };
    }
    l.arrive(1);
    l.wait(1).then_some(l.epoch)
}

/// One side of a send/receive batch: the next chunk of one message.
struct Transfer {
    peer: usize,
    addr: DevicePtr,
    bytes: usize,
    /// Bytes moved so far; a message of 0 bytes still moves one chunk (its
    /// header), so the receiver can check the length.
    done: usize,
    started: bool,
}

impl Transfer {
    fn finished(&self) -> bool {
        self.started && self.done >= self.bytes
    }
}

/// The pair mailboxes and counters of one rank's workspace.
struct Mailboxes<'a> {
    p: &'a KernelParams,
    half: usize,
}

impl Mailboxes<'_> {
    fn ws(&self, rank: usize) -> DevicePtr {
        self.p.peer_ws[rank]
    }
    fn ctrl(&self, rank: usize, off: usize, i: usize, width: usize) -> DevicePtr {
        self.ws(rank).offset(P2P_CTRL_OFFSET + off + i * width)
    }
    /// Mailbox half `h` of source `src` at `rank`.
    fn mailbox(&self, rank: usize, src: usize, h: usize) -> DevicePtr {
        self.ws(rank)
            .offset(p2p_offset(self.p.slot_bytes as usize) + (src * 2 + h) * self.half)
    }
    /// # Safety (all accessors): the workspaces in `p` are live and mapped.
    unsafe fn delivered(&self, rank: usize, src: usize) -> &AtomicU32 {
        // SAFETY: inside the control area of a live workspace.
        unsafe { word(self.ctrl(rank, P2P_DELIVERED, src, 4)) }
    }
    unsafe fn consumed(&self, rank: usize, dst: usize) -> &AtomicU32 {
        // SAFETY: as above.
        unsafe { word(self.ctrl(rank, P2P_CONSUMED, dst, 4)) }
    }
    unsafe fn header(&self, rank: usize, src: usize, h: usize) -> &AtomicU64 {
        // SAFETY: as above.
        unsafe { dword(self.ctrl(rank, P2P_HEADER, src * 2 + h, 8)) }
    }
    unsafe fn sent(&self, dst: usize) -> &AtomicU32 {
        // SAFETY: as above (our own workspace).
        unsafe { word(self.ctrl(self.p.rank as usize, P2P_SENT, dst, 4)) }
    }
    unsafe fn received(&self, src: usize) -> &AtomicU32 {
        // SAFETY: as above (our own workspace).
        unsafe { word(self.ctrl(self.p.rank as usize, P2P_RECEIVED, src, 4)) }
    }
}

/// Sequence numbers compare with wraparound.
fn reached(value: u32, target: u32) -> bool {
    value.wrapping_sub(target) as i32 >= 0
}

/// Try to move the next chunk of a send: a free mailbox half (its chunk two
/// back consumed), the data, the header, then the delivered count.
///
/// # Safety: `t.addr` holds `t.bytes`; the workspaces are live.
unsafe fn try_send(m: &Mailboxes, t: &mut Transfer) -> bool {
    let me = m.p.rank as usize;
    // SAFETY: forwarded from the caller.
    unsafe {
        let q = m.sent(t.peer).load(Ordering::Relaxed).wrapping_add(1);
        if !reached(m.consumed(me, t.peer).load(Ordering::Acquire), q.wrapping_sub(2)) {
            return false;
        }
        let h = (q & 1) as usize;
        let len = m.half.min(t.bytes - t.done);
        copy_bytes(m.mailbox(t.peer, me, h), t.addr.offset(t.done), len);
        m.header(t.peer, me, h).store(t.bytes as u64, Ordering::Relaxed);
        let flag = m.delivered(t.peer, me);
        flag.store(q, Ordering::Release);
        futex::wake_all(flag);
        m.sent(t.peer).store(q, Ordering::Relaxed);
        t.done += len;
        t.started = true;
    }
    true
}

/// Try to take the next chunk of a receive. `Err(())` on a length mismatch.
///
/// # Safety: `t.addr` holds `t.bytes`; the workspaces are live.
unsafe fn try_recv(m: &Mailboxes, t: &mut Transfer) -> Result<bool, ()> {
    let me = m.p.rank as usize;
    // SAFETY: forwarded from the caller.
    unsafe {
        let q = m.received(t.peer).load(Ordering::Relaxed).wrapping_add(1);
        if !reached(m.delivered(me, t.peer).load(Ordering::Acquire), q) {
            return Ok(false);
        }
        let h = (q & 1) as usize;
        if m.header(me, t.peer, h).load(Ordering::Relaxed) != t.bytes as u64 {
            return Err(());
        }
        let len = m.half.min(t.bytes - t.done);
        copy_bytes(t.addr.offset(t.done), m.mailbox(me, t.peer, h), len);
        let ack = m.consumed(t.peer, me);
        ack.store(q, Ordering::Release);
        futex::wake_all(ack);
        m.received(t.peer).store(q, Ordering::Relaxed);
        t.done += len;
        t.started = true;
    }
    Ok(true)
}

/// A batch of sends and receives (per-peer lists: send counts/addresses,
/// receive counts/addresses, in elements of the launch's dtype). Every transfer
/// makes progress in turn, so a batch whose sends and receives depend on
/// each other (a ring, a pairwise exchange) cannot deadlock.
///
/// # Safety: see [`super::kernels::HostKernel::call`]; the listed blocks are
/// live for their counts.
pub(super) unsafe fn send_recv(p: &KernelParams) {
    let err = |i: usize| {
        // SAFETY: error_flags points at ERR_WORDS live u32s.
        unsafe { word(p.error_flags.offset(i * 4)) }
    };
    if err(0).load(Ordering::Acquire) != 0 {
        return;
    }
    let size = elem_size(p);
    let world = p.world as usize;
    let me = p.rank as usize;
    let m = Mailboxes {
        p,
        half: p2p_half_bytes(p.slot_bytes as usize),
    };
    let transfer = |row_count: usize, row_addr: usize, q: usize| Transfer {
        peer: q,
        addr: DevicePtr(p.per_peer[row_addr][q]),
        bytes: p.per_peer[row_count][q] as usize * size,
        done: 0,
        started: false,
    };
    // A count of u64::MAX marks "no transfer with this peer".
    let listed = |row: usize, q: usize| p.per_peer[row][q] != u64::MAX && q != me && q < world;
    let mut sends: Vec<Transfer> = (0..MAX_RANKS)
        .filter(|&q| listed(SEND_COUNT, q))
        .map(|q| transfer(SEND_COUNT, SEND_ADDR, q))
        .collect();
    let mut recvs: Vec<Transfer> = (0..MAX_RANKS)
        .filter(|&q| listed(RECV_COUNT, q))
        .map(|q| transfer(RECV_COUNT, RECV_ADDR, q))
        .collect();
    let start = Instant::now();
    let limit = Duration::from_nanos(p.timeout_ns);
    let mut idle = 0u32;
    loop {
        let mut moved = false;
        for t in sends.iter_mut().filter(|t| !t.finished()) {
            // SAFETY: forwarded from the caller.
            moved |= unsafe { try_send(&m, t) };
        }
        for t in recvs.iter_mut().filter(|t| !t.finished()) {
            // SAFETY: forwarded from the caller.
            match unsafe { try_recv(&m, t) } {
                Ok(progress) => moved |= progress,
                Err(()) => {
                    let _ = err(2).compare_exchange(0, t.peer as u32 + 1, Ordering::AcqRel, Ordering::Acquire);
                    let _ = err(0).compare_exchange(0, ERR_CODE_MISMATCH, Ordering::AcqRel, Ordering::Acquire);
                    return;
                }
            }
        }
        let waiting: Vec<usize> = sends
            .iter()
            .chain(recvs.iter())
            .filter(|t| !t.finished())
            .map(|t| t.peer)
            .collect();
        if waiting.is_empty() {
            return;
        }
        if moved {
            idle = 0;
            continue;
        }
        if start.elapsed() > limit {
            let mask = waiting.iter().fold(0u32, |m, &q| m | (1 << q));
            err(1).fetch_or(mask, Ordering::AcqRel);
            let _ = err(0).compare_exchange(0, ERR_CODE_TIMEOUT, Ordering::AcqRel, Ordering::Acquire);
            return;
        }
        // Sleep on the word the first waiting transfer needs to change.
        idle += 1;
        if idle < 200 {
            std::hint::spin_loop();
            continue;
        }
        let (w, seen) = match recvs.iter().find(|t| !t.finished()) {
            // SAFETY: our own live workspace.
            Some(t) => unsafe {
                let w = m.delivered(me, t.peer);
                (w, w.load(Ordering::Acquire))
            },
            None => {
                let t = sends.iter().find(|t| !t.finished()).map_or(0, |t| t.peer);
                // SAFETY: our own live workspace.
                unsafe {
                    let w = m.consumed(me, t);
                    (w, w.load(Ordering::Acquire))
                }
            }
        };
        futex::wait(w, seen, Duration::from_millis(5));
    }
}
