//! The symmetric allocator: offsets into a heap, the same on every rank for
//! the same sequence of allocations and frees.
//!
//! Symmetry comes from determinism, not from talking: the allocator holds no
//! state but its free list, and first fit over a list kept sorted by offset
//! is a pure function of the call sequence. The communicator checks the
//! outcome across ranks at each allocation (`comm::heap`), so a rank that
//! took a different sequence gets an error, not a silently wrong peer address.

use crate::error::{Error, Result};

/// Every allocation starts on this boundary (16-byte vectors, and a cache
/// line pair, so two allocations never share a line peers write).
pub const HEAP_ALIGN: usize = 256;

/// A first-fit allocator over `[base, base + len)`.
#[derive(Debug)]
pub struct SymmetricAlloc {
    /// Free ranges `(offset, bytes)`, sorted by offset, never adjacent.
    free: Vec<(usize, usize)>,
    /// Live allocations `(offset, bytes)`, for `free` to check.
    live: Vec<(usize, usize)>,
    capacity: usize,
}

impl SymmetricAlloc {
    /// An allocator of the bytes `[base, base + len)` of a heap.
    pub fn new(base: usize, len: usize) -> SymmetricAlloc {
        let start = base.next_multiple_of(HEAP_ALIGN);
        let end = (base + len) & !(HEAP_ALIGN - 1);
        let free = if end > start {
            vec![(start, end - start)]
        } else {
            Vec::new()
        };
        SymmetricAlloc {
            free,
            live: Vec::new(),
            capacity: end.saturating_sub(start),
        }
    }

    /// The offset of a new allocation of `bytes` (rounded up to [`HEAP_ALIGN`]).
    pub fn alloc(&mut self, bytes: usize) -> Result<usize> {
        let want = bytes
            .max(1)
            .checked_next_multiple_of(HEAP_ALIGN)
            .ok_or_else(|| Error::invalid(format!("symmetric heap: an allocation of {bytes} bytes is too large")))?;
        let Some(i) = self.free.iter().position(|&(_, len)| len >= want) else {
            let largest = self.free.iter().map(|&(_, len)| len).max().unwrap_or(0);
            return Err(Error::invalid(format!(
                "symmetric heap is out of memory: {bytes} bytes asked, {} of {} bytes free (largest free range {largest}); \
                 raise FERROCOMM_HEAP_BYTES (CommOptions::heap_bytes) on every rank",
                self.free_bytes(),
                self.capacity
            )));
        };
        let (offset, len) = self.free[i];
        if len == want {
            self.free.remove(i);
        } else {
            self.free[i] = (offset + want, len - want);
        }
        self.live.push((offset, want));
        Ok(offset)
    }

    /// Return the allocation at `offset`; its range joins its free neighbours.
    pub fn free(&mut self, offset: usize) -> Result<()> {
        let Some(i) = self.live.iter().position(|&(o, _)| o == offset) else {
            return Err(Error::invalid(format!(
                "symmetric heap: offset {offset} is not a live allocation (freed twice, or not from this heap)"
            )));
        };
        let (_, len) = self.live.swap_remove(i);
        let at = self.free.partition_point(|&(o, _)| o < offset);
        self.free.insert(at, (offset, len));
        // Merge with the next range, then with the previous one.
        if at + 1 < self.free.len() && self.free[at].0 + self.free[at].1 == self.free[at + 1].0 {
            self.free[at].1 += self.free[at + 1].1;
            self.free.remove(at + 1);
        }
        if at > 0 && self.free[at - 1].0 + self.free[at - 1].1 == self.free[at].0 {
            self.free[at - 1].1 += self.free[at].1;
            self.free.remove(at);
        }
        Ok(())
    }

    /// Bytes not allocated.
    pub fn free_bytes(&self) -> usize {
        self.free.iter().map(|&(_, len)| len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_sequence_gives_the_same_offsets() {
        let run = || {
            let mut a = SymmetricAlloc::new(4096, 1 << 20);
            let x = a.alloc(1000).unwrap();
            let y = a.alloc(5000).unwrap();
            a.free(x).unwrap();
            let z = a.alloc(200).unwrap();
            (x, y, z)
        };
        assert_eq!(run(), run());
        let (x, y, z) = run();
        assert_eq!(x, 4096);
        assert_eq!(y, 4096 + 1024);
        assert_eq!(z, x, "first fit reuses the freed range");
    }

    #[test]
    fn frees_coalesce_and_exhaustion_is_an_error() {
        let mut a = SymmetricAlloc::new(0, 4 * HEAP_ALIGN);
        let offs: Vec<usize> = (0..4).map(|_| a.alloc(HEAP_ALIGN).unwrap()).collect();
        let err = a.alloc(1).unwrap_err().to_string();
        assert!(
            err.contains("out of memory") && err.contains("FERROCOMM_HEAP_BYTES"),
            "{err}"
        );
        for o in [offs[1], offs[3], offs[2], offs[0]] {
            a.free(o).unwrap();
        }
        assert_eq!(a.free_bytes(), 4 * HEAP_ALIGN);
        assert_eq!(a.alloc(4 * HEAP_ALIGN).unwrap(), 0, "the ranges merged back into one");
        assert!(a.free(12345).is_err());
        assert!(a.alloc(usize::MAX).is_err());
    }
}
