//! The shared-memory ring between the writer and the readers on its node:
//! one memfd, created and sealed by the writer, passed to the readers over
//! the fd exchange, mapped by every party at its own address.
//!
//! Layout (offsets in bytes; `L` = 128, a cache line pair, so that words
//! written by different parties never share a line):
//!
//! ```text
//! 0        header line: magic "FCBRING1" u64, version u32, slots u32,
//!          readers u32, (pad), slot_bytes u64          written once, by the creator
//! L        doorbell u32, closed u32                    written by the writer
//! 2L       reads u32, readers_asleep u32               written by the readers
//! 3L       writer_asleep u32                           written by the writer
//! 4L       slot table: `slots` entries of L bytes:
//!            written u64 (message number + 1, 0 = never), len u64, kind u32
//! ...      reader blocks: `readers` blocks of round_up(8 (slots + 1), L):
//!            read[slot] u64 (message number + 1 last read there), closed u64
//! page     data: `slots` payloads of round_up(slot_bytes, L) bytes
//! ```
//!
//! Message `m` (numbered from 0) uses slot `m % slots`. Flags hold message
//! numbers, not booleans, so no flag is ever reset: a slot is *written*
//! for `m` when its `written` word is `m + 1`, and *free* for `m` when
//! every reader's `read` word of that slot is at least `m + 1 - slots`
//! (the message that used it a lap before has been read everywhere).
//!
//! Orderings: the writer copies the payload and stores `len` and `kind`,
//! then stores `written = m + 1` with Release; a reader loads `written`
//! with Acquire, so the payload is visible once it sees `m + 1`. A reader
//! copies the payload out, then stores its `read` word with Release; the
//! writer loads the `read` words with Acquire before it writes the slot
//! again, so no reader's copy overlaps the next write. The doorbell and
//! the sleep flags are SeqCst: see [`RingWriter::publish`] and
//! [`RingReader::sleep`] for why no wake-up is lost.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::backends::host::futex;
use crate::error::{Error, Result};

const MAGIC: u64 = u64::from_le_bytes(*b"FCBRING1");
const VERSION: u32 = 1;
const LINE: usize = 128;
const PAGE: usize = 4096;

const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_SLOTS: usize = 12;
const OFF_READERS: usize = 16;
const OFF_SLOT_BYTES: usize = 24;
const OFF_DOORBELL: usize = LINE;
const OFF_CLOSED: usize = LINE + 4;
const OFF_READS: usize = 2 * LINE;
const OFF_READERS_ASLEEP: usize = 2 * LINE + 4;
const OFF_WRITER_ASLEEP: usize = 3 * LINE;
const HEADER: usize = 4 * LINE;

/// A slot entry's words.
const SLOT_WRITTEN: usize = 0;
const SLOT_LEN: usize = 8;
const SLOT_KIND: usize = 16;

/// The payload is in the slot.
pub(super) const KIND_INLINE: u32 = 1;
/// The payload did not fit: it follows on the reader's socket.
pub(super) const KIND_SOCKET: u32 = 2;

/// The shape of a ring; both sides compute the layout from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) slots: usize,
    pub(super) slot_bytes: usize,
    pub(super) readers: usize,
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_next_multiple_of(to)
}

impl Geometry {
    fn slot_off(&self, slot: usize) -> usize {
        HEADER + slot * LINE
    }

    fn reader_stride(&self) -> usize {
        // `bytes()` checked that this does not overflow.
        (self.slots + 1).saturating_mul(8).next_multiple_of(LINE)
    }

    fn read_off(&self, reader: usize, slot: usize) -> usize {
        HEADER + self.slots * LINE + reader * self.reader_stride() + 8 * slot
    }

    fn reader_closed_off(&self, reader: usize) -> usize {
        self.read_off(reader, self.slots)
    }

    fn data_stride(&self) -> usize {
        self.slot_bytes.max(1).next_multiple_of(LINE)
    }

    fn data_off(&self, slot: usize) -> usize {
        let readers_end = HEADER + self.slots * LINE + self.readers * self.reader_stride();
        readers_end.next_multiple_of(PAGE) + slot * self.data_stride()
    }

    /// The mapping's size, or `None` if it overflows.
    pub(super) fn bytes(&self) -> Option<usize> {
        let stride = round_up((self.slots.checked_add(1)?).checked_mul(8)?, LINE)?;
        let readers_end = self
            .readers
            .checked_mul(stride)?
            .checked_add(self.slots.checked_mul(LINE)?)?
            .checked_add(HEADER)?;
        let data = round_up(self.slot_bytes.max(1), LINE)?.checked_mul(self.slots)?;
        round_up(readers_end, PAGE)?.checked_add(data)
    }
}

/// A shared mapping of the ring's memfd.
struct Shm {
    base: *mut u8,
    len: usize,
    fd: OwnedFd,
    geo: Geometry,
}

// SAFETY: the mapping is plain shared memory, valid from any thread; every
// word that parties write concurrently is accessed through atomics, and the
// payload bytes only under the flag protocol (module docs).
unsafe impl Send for Shm {}

impl Shm {
    fn map(fd: OwnedFd, geo: Geometry) -> Result<Shm> {
        let len = geo
            .bytes()
            .ok_or_else(|| Error::invalid(format!("broadcaster ring of {geo:?} is too large")))?;
        // SAFETY: a fresh shared mapping of `len` bytes of a descriptor we
        // own, at an address the kernel picks; the result is checked.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mapping the broadcaster ring ({len} bytes)"),
                io::Error::last_os_error(),
            ));
        }
        Ok(Shm {
            base: addr.cast(),
            len,
            fd,
            geo,
        })
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.len, "ring offset {off} out of bounds");
        // SAFETY: `off` is in bounds and 4-aligned (checked; the mapping is
        // page-aligned), the mapping lives as long as `self`, AtomicU32 has
        // u32's layout, and every party accesses this word atomically.
        unsafe { &*self.base.add(off).cast::<AtomicU32>() }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.len, "ring offset {off} out of bounds");
        // SAFETY: as in `u32_at`, with 8-byte alignment.
        unsafe { &*self.base.add(off).cast::<AtomicU64>() }
    }

    fn slot_of(&self, m: u64) -> usize {
        (m % self.geo.slots as u64) as usize
    }

    fn written(&self, slot: usize) -> &AtomicU64 {
        self.u64_at(self.geo.slot_off(slot) + SLOT_WRITTEN)
    }

    fn read_flag(&self, reader: usize, slot: usize) -> &AtomicU64 {
        self.u64_at(self.geo.read_off(reader, slot))
    }

    fn reader_closed(&self, reader: usize) -> &AtomicU64 {
        self.u64_at(self.geo.reader_closed_off(reader))
    }

    fn data(&self, slot: usize) -> *mut u8 {
        let off = self.geo.data_off(slot);
        assert!(off + self.geo.slot_bytes <= self.len, "ring slot {slot} out of bounds");
        // SAFETY: in bounds of the mapping (checked).
        unsafe { self.base.add(off) }
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the region `map` created; the references
        // handed out borrow `self`, so none outlives it. The memfd closes
        // with `fd`; the kernel frees the memory with the last mapping.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// The writer's side of the ring.
pub(super) struct RingWriter {
    shm: Shm,
}

impl RingWriter {
    /// A zeroed ring for `geo.readers` readers in a fresh memfd, sealed at
    /// its size so that no party can shrink it under another's mapping.
    pub(super) fn create(geo: Geometry) -> Result<RingWriter> {
        let len = geo
            .bytes()
            .ok_or_else(|| Error::invalid(format!("broadcaster ring of {geo:?} is too large")))?;
        // SAFETY: memfd_create with a static NUL-terminated name; checked below.
        let raw = unsafe {
            libc::memfd_create(
                c"ferrocomm-broadcaster".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(Error::io(
                "memfd_create for the broadcaster ring",
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::io(
                format!("sizing the broadcaster ring to {len} bytes"),
                io::Error::last_os_error(),
            ));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor we own, with an int argument.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(Error::io("sealing the broadcaster ring", io::Error::last_os_error()));
        }
        let shm = Shm::map(fd, geo)?;
        // A memfd starts zeroed: every flag says "never written, never read".
        shm.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
        shm.u32_at(OFF_SLOTS).store(geo.slots as u32, Ordering::Relaxed);
        shm.u32_at(OFF_READERS).store(geo.readers as u32, Ordering::Relaxed);
        shm.u64_at(OFF_SLOT_BYTES)
            .store(geo.slot_bytes as u64, Ordering::Relaxed);
        // Last, with Release: a reader that sees the magic sees the rest.
        shm.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok(RingWriter { shm })
    }

    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.shm.fd.as_fd()
    }

    pub(super) fn slot_bytes(&self) -> usize {
        self.shm.geo.slot_bytes
    }

    /// The readers (indices) that have not read the message that used the
    /// slot of message `m` one lap before; empty when the slot is free.
    pub(super) fn lagging(&self, m: u64) -> Vec<usize> {
        let slots = self.shm.geo.slots as u64;
        if m < slots {
            return Vec::new();
        }
        let need = m + 1 - slots;
        let slot = self.shm.slot_of(m);
        (0..self.shm.geo.readers)
            .filter(|&r| self.shm.read_flag(r, slot).load(Ordering::Acquire) < need)
            .collect()
    }

    /// Whether reader `r` has closed its side (dropped its broadcaster).
    pub(super) fn reader_closed(&self, r: usize) -> bool {
        self.shm.reader_closed(r).load(Ordering::Acquire) != 0
    }

    /// The readers' read counter, loaded before a look at the slot, for
    /// [`RingWriter::sleep`].
    pub(super) fn reads(&self) -> u32 {
        self.shm.u32_at(OFF_READS).load(Ordering::SeqCst)
    }

    /// Sleep for at most `d` unless a reader has read since `seen` was
    /// loaded. Readers bump `reads` (SeqCst) after each read and then load
    /// `writer_asleep` (SeqCst); the writer stores `writer_asleep` (SeqCst)
    /// before the futex compares `reads` with `seen`. Either the reader
    /// sees the flag and wakes the writer, or its bump comes first in the
    /// total order and the futex refuses to sleep.
    pub(super) fn sleep(&self, seen: u32, d: Duration) {
        let asleep = self.shm.u32_at(OFF_WRITER_ASLEEP);
        asleep.store(1, Ordering::SeqCst);
        futex::wait(self.shm.u32_at(OFF_READS), seen, d);
        asleep.store(0, Ordering::SeqCst);
    }

    /// Publish message `m`: its payload when it fits a slot (`inline`),
    /// else only its length (the payload goes through the socket). The
    /// slot must be free ([`RingWriter::lagging`] empty).
    pub(super) fn publish(&self, m: u64, payload: &[u8], inline: bool) {
        let shm = &self.shm;
        let slot = shm.slot_of(m);
        let entry = shm.geo.slot_off(slot);
        if inline {
            assert!(payload.len() <= shm.geo.slot_bytes, "inline payload larger than a slot");
            // SAFETY: the destination is this slot's data area, in bounds
            // and `slot_bytes` long (checked above); every reader has read
            // the slot's previous message (the caller checked with Acquire
            // loads), so no one reads it until `written` says `m + 1`.
            unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), shm.data(slot), payload.len()) };
        }
        shm.u64_at(entry + SLOT_LEN)
            .store(payload.len() as u64, Ordering::Relaxed);
        let kind = if inline { KIND_INLINE } else { KIND_SOCKET };
        shm.u32_at(entry + SLOT_KIND).store(kind, Ordering::Relaxed);
        // Release: the payload, `len` and `kind` are visible to a reader
        // that loads `m + 1` with Acquire.
        shm.written(slot).store(m + 1, Ordering::Release);
        self.ring_doorbell((m as u32).wrapping_add(1));
    }

    /// Readers that sleep wait on the doorbell. The store and the load of
    /// `readers_asleep` are SeqCst, as are the reader's increment of it and
    /// its load of the doorbell: either this load sees the sleeper and
    /// wakes it, or the sleeper's futex sees the new doorbell and returns.
    fn ring_doorbell(&self, value: u32) {
        let bell = self.shm.u32_at(OFF_DOORBELL);
        bell.store(value, Ordering::SeqCst);
        if self.shm.u32_at(OFF_READERS_ASLEEP).load(Ordering::SeqCst) != 0 {
            futex::wake_all(bell);
        }
    }
}

impl Drop for RingWriter {
    fn drop(&mut self) {
        // Readers waiting for a message that will never come learn it now.
        self.shm.u32_at(OFF_CLOSED).store(1, Ordering::SeqCst);
        let bell = self.shm.u32_at(OFF_DOORBELL);
        bell.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(bell);
    }
}

/// What a reader found in a written slot.
#[derive(Clone, Copy, Debug)]
pub(super) struct Slot {
    pub(super) kind: u32,
    pub(super) len: usize,
}

/// A reader's side of the ring.
pub(super) struct RingReader {
    shm: Shm,
    me: usize,
}

impl RingReader {
    /// Map the writer's ring and check it has the shape the writer's
    /// record announced; `me` is this reader's index among the ring's
    /// readers.
    pub(super) fn open(fd: OwnedFd, geo: Geometry, me: usize) -> Result<RingReader> {
        let bad = |what: String| {
            Error::io(
                "opening the broadcaster ring",
                io::Error::new(io::ErrorKind::InvalidData, what),
            )
        };
        if me >= geo.readers {
            return Err(bad(format!("reader {me} of a ring of {} readers", geo.readers)));
        }
        // SAFETY: fstat fills a zeroed, live stat struct for an open fd.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::io("fstat of the broadcaster ring", io::Error::last_os_error()));
        }
        let need = geo.bytes().ok_or_else(|| bad(format!("{geo:?} overflows")))?;
        if (st.st_size as u64) < need as u64 {
            return Err(bad(format!(
                "the ring holds {} bytes, its shape {geo:?} needs {need}",
                st.st_size
            )));
        }
        let shm = Shm::map(fd, geo)?;
        let found = (
            shm.u64_at(OFF_MAGIC).load(Ordering::Acquire),
            shm.u32_at(OFF_VERSION).load(Ordering::Relaxed),
            shm.u32_at(OFF_SLOTS).load(Ordering::Relaxed) as usize,
            shm.u32_at(OFF_READERS).load(Ordering::Relaxed) as usize,
            shm.u64_at(OFF_SLOT_BYTES).load(Ordering::Relaxed) as usize,
        );
        if found != (MAGIC, VERSION, geo.slots, geo.readers, geo.slot_bytes) {
            return Err(bad(format!(
                "its header says version {}, {} slots of {} bytes, {} readers; expected version {VERSION}, {geo:?}",
                found.1, found.2, found.4, found.3
            )));
        }
        Ok(RingReader { shm, me })
    }

    /// The doorbell, loaded (SeqCst) before a look at the slot, for
    /// [`RingReader::sleep`].
    pub(super) fn doorbell(&self) -> u32 {
        self.shm.u32_at(OFF_DOORBELL).load(Ordering::SeqCst)
    }

    /// Whether the writer has closed its side.
    pub(super) fn writer_closed(&self) -> bool {
        self.shm.u32_at(OFF_CLOSED).load(Ordering::SeqCst) != 0
    }

    /// Message `m`'s slot, once written; `None` while it is not.
    pub(super) fn poll(&self, m: u64) -> Result<Option<Slot>> {
        let shm = &self.shm;
        let slot = shm.slot_of(m);
        let written = shm.written(slot).load(Ordering::Acquire);
        if written < m + 1 {
            return Ok(None);
        }
        let entry = shm.geo.slot_off(slot);
        let s = Slot {
            kind: shm.u32_at(entry + SLOT_KIND).load(Ordering::Relaxed),
            len: shm.u64_at(entry + SLOT_LEN).load(Ordering::Relaxed) as usize,
        };
        // The writer cannot lap a reader, and writes only these kinds and
        // lengths: anything else is a corrupted ring, never read from.
        let sane =
            written == m + 1 && (s.kind == KIND_SOCKET || (s.kind == KIND_INLINE && s.len <= shm.geo.slot_bytes));
        if !sane {
            return Err(Error::io(
                "reading the broadcaster ring",
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "slot {slot} holds message {} (kind {}, {} bytes) where message {m} was due",
                        written.wrapping_sub(1),
                        s.kind,
                        s.len
                    ),
                ),
            ));
        }
        Ok(Some(s))
    }

    /// Copy message `m`'s inline payload (`len` bytes, from [`poll`]) into `out`.
    ///
    /// [`poll`]: RingReader::poll
    pub(super) fn copy_out(&self, m: u64, len: usize, out: &mut Vec<u8>) {
        let slot = self.shm.slot_of(m);
        assert!(len <= self.shm.geo.slot_bytes, "inline length beyond a slot");
        out.clear();
        out.reserve(len);
        // SAFETY: the source is this slot's data area, `len <= slot_bytes`
        // bytes in bounds (checked); the writer finished writing it before
        // its Release store of `written`, which `poll` loaded with Acquire,
        // and does not write it again until this reader's read flag says
        // so. The destination has `len` bytes reserved, set as length after
        // the copy initialised them.
        unsafe {
            std::ptr::copy_nonoverlapping(self.shm.data(slot), out.as_mut_ptr(), len);
            out.set_len(len);
        }
    }

    /// Mark message `m` read: the writer may reuse its slot. See
    /// [`RingWriter::sleep`] for the wake-up.
    pub(super) fn release(&self, m: u64) {
        let shm = &self.shm;
        shm.read_flag(self.me, shm.slot_of(m)).store(m + 1, Ordering::Release);
        self.nudge_writer();
    }

    fn nudge_writer(&self) {
        let reads = self.shm.u32_at(OFF_READS);
        reads.fetch_add(1, Ordering::SeqCst);
        if self.shm.u32_at(OFF_WRITER_ASLEEP).load(Ordering::SeqCst) != 0 {
            futex::wake_all(reads);
        }
    }

    /// Sleep for at most `d` unless the doorbell has moved since `seen`
    /// (see [`RingWriter::publish`] for the pairing).
    pub(super) fn sleep(&self, seen: u32, d: Duration) {
        let asleep = self.shm.u32_at(OFF_READERS_ASLEEP);
        asleep.fetch_add(1, Ordering::SeqCst);
        futex::wait(self.shm.u32_at(OFF_DOORBELL), seen, d);
        asleep.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for RingReader {
    fn drop(&mut self) {
        // A writer waiting for this reader's slot learns at once.
        self.shm.reader_closed(self.me).store(1, Ordering::Release);
        self.nudge_writer();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(geo: Geometry) -> (RingWriter, Vec<RingReader>) {
        let w = RingWriter::create(geo).unwrap();
        let readers = (0..geo.readers)
            .map(|r| {
                let fd = w.fd().try_clone_to_owned().unwrap();
                RingReader::open(fd, geo, r).unwrap()
            })
            .collect();
        (w, readers)
    }

    #[test]
    fn layout_keeps_parties_off_each_others_lines() {
        let geo = Geometry {
            slots: 8,
            slot_bytes: 100,
            readers: 3,
        };
        assert_eq!(geo.slot_off(0), 512);
        assert_eq!(geo.read_off(0, 0), 512 + 8 * 128);
        // A reader's 9 words (72 bytes) take one line of its own...
        assert_eq!(geo.read_off(1, 0) - geo.read_off(0, 0), 128);
        // ...and 17 words (136 bytes) two.
        let wider = Geometry { slots: 16, ..geo };
        assert_eq!(wider.read_off(1, 0) - wider.read_off(0, 0), 256);
        assert_eq!(geo.data_off(0) % PAGE, 0);
        assert_eq!(geo.data_off(1) - geo.data_off(0), 128);
        assert_eq!(geo.bytes(), Some(geo.data_off(0) + 8 * 128));
        let huge = Geometry {
            slots: usize::MAX / 2,
            slot_bytes: usize::MAX / 2,
            readers: 2,
        };
        assert_eq!(huge.bytes(), None);
    }

    #[test]
    fn messages_go_round_and_slots_wait_for_every_reader() {
        let geo = Geometry {
            slots: 2,
            slot_bytes: 16,
            readers: 2,
        };
        let (w, readers) = pair(geo);
        assert!(w.lagging(0).is_empty() && w.lagging(1).is_empty());
        w.publish(0, b"zero", true);
        w.publish(1, b"a longer one: 17!", false);
        // Message 2 reuses slot 0: both readers must have read message 0.
        assert_eq!(w.lagging(2), [0, 1]);
        let mut out = Vec::new();
        for r in &readers {
            let s = r.poll(0).unwrap().unwrap();
            assert_eq!((s.kind, s.len), (KIND_INLINE, 4));
            r.copy_out(0, s.len, &mut out);
            assert_eq!(out, b"zero");
            assert!(r.poll(2).unwrap().is_none());
        }
        readers[1].release(0);
        assert_eq!(w.lagging(2), [0]);
        readers[0].release(0);
        assert!(w.lagging(2).is_empty());
        let s = readers[0].poll(1).unwrap().unwrap();
        assert_eq!((s.kind, s.len), (KIND_SOCKET, 17));
        w.publish(2, b"", true);
        assert_eq!(readers[0].poll(2).unwrap().unwrap().len, 0);
        assert!(!readers[0].writer_closed());
        drop(w);
        assert!(readers[0].writer_closed());
    }

    #[test]
    fn a_reader_that_drops_is_seen_closed() {
        let geo = Geometry {
            slots: 1,
            slot_bytes: 8,
            readers: 2,
        };
        let (w, mut readers) = pair(geo);
        assert!(!w.reader_closed(1));
        drop(readers.pop());
        assert!(w.reader_closed(1) && !w.reader_closed(0));
    }

    #[test]
    fn a_ring_of_another_shape_is_refused() {
        let geo = Geometry {
            slots: 4,
            slot_bytes: 64,
            readers: 1,
        };
        let w = RingWriter::create(geo).unwrap();
        let other = Geometry { slot_bytes: 32, ..geo };
        let fd = w.fd().try_clone_to_owned().unwrap();
        let e = RingReader::open(fd, other, 0).err().unwrap().to_string();
        assert!(e.contains("expected version"), "{e}");
        // The seals hold: nobody can shrink the ring under a mapping.
        // SAFETY: ftruncate on a descriptor we own; it must fail.
        let r = unsafe { libc::ftruncate(w.fd().as_raw_fd(), 0) };
        assert_ne!(r, 0);
    }
}
