//! Where a trial's operands live: per memory kind, slots reused by every
//! trial, and a region of guard bytes around each operand.

use std::collections::BTreeMap;

use super::draw::Kind;
use crate::comm::{Communicator, Tensor};
use crate::device::{BackendKind, Device, DeviceBuffer, MemKind};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::heap::HeapBuffer;

/// Guard bytes on each side of an operand.
pub(super) const GUARD: usize = 64;

/// The guard pattern at byte `i` of a region.
pub(super) fn guard_byte(i: usize) -> u8 {
    0xA5 ^ (i as u8).wrapping_mul(31)
}

/// One slot of memory of each kind, reused by every trial.
pub(super) enum Mem<D: Device> {
    Buffer(D::Buffer),
    Heap(HeapBuffer),
    Host(Vec<u64>),
}

impl<D: Device> Mem<D> {
    pub(super) fn base(&self) -> u64 {
        match self {
            Mem::Buffer(b) => b.ptr().0,
            Mem::Heap(h) => h.ptr().0,
            Mem::Host(v) => v.as_ptr() as u64,
        }
    }
}

/// The memory of one rank: per kind, two slots (input, output) and one for
/// a device factor.
pub(super) struct Pools<D: Device> {
    pub(super) slots: BTreeMap<(u8, usize), Mem<D>>,
    pub(super) factor: D::Buffer,
    pub(super) bytes: usize,
}

pub(super) fn kind_code(k: Kind) -> u8 {
    match k {
        Kind::Ferrocomm => 0,
        Kind::Caller => 1,
        Kind::Heap => 2,
    }
}

impl<D: Device> Pools<D> {
    pub(super) fn new(comm: &Communicator<D>, bytes: usize, heap: bool) -> Result<Pools<D>> {
        let mut slots = BTreeMap::new();
        let host = comm.device().facts().backend == BackendKind::Host;
        for slot in 0..2 {
            slots.insert((kind_code(Kind::Ferrocomm), slot), Mem::Buffer(comm.alloc(bytes)?));
            let caller = match host {
                true => Mem::Host(vec![0u64; bytes.div_ceil(8)]),
                false => Mem::Buffer(comm.device().alloc(bytes, MemKind::Plain)?),
            };
            slots.insert((kind_code(Kind::Caller), slot), caller);
            if heap {
                slots.insert((kind_code(Kind::Heap), slot), Mem::Heap(comm.heap_alloc(bytes)?));
            }
        }
        Ok(Pools {
            slots,
            factor: comm.alloc(64)?,
            bytes,
        })
    }

    /// A region of `len` bytes of `kind`'s slot, its first byte `offset`
    /// bytes after the front guard.
    pub(super) fn region(&self, kind: Kind, slot: usize, offset: usize, len: usize) -> Result<Region> {
        let mem = &self.slots[&(kind_code(kind), slot)];
        let whole = GUARD + offset + len + GUARD;
        if whole > self.bytes {
            return Err(Error::invalid(format!(
                "fuzz: {whole} bytes do not fit a slot of {}",
                self.bytes
            )));
        }
        Ok(Region {
            start: mem.base(),
            data: GUARD + offset,
            whole,
        })
    }
}

/// An operand with its guards: its bytes from `data` on, inside
/// `start..start + whole`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Region {
    pub(super) start: u64,
    pub(super) data: usize,
    pub(super) whole: usize,
}

impl Region {
    pub(super) fn all(&self) -> Tensor {
        // SAFETY: inside a live slot of the pools, which outlive every call.
        unsafe { Tensor::from_raw(self.start, self.whole, DType::U8) }
    }

    pub(super) fn tensor(&self, dtype: DType, first_byte: usize, count: usize) -> Tensor {
        // SAFETY: as `all`; callers stay inside the data bytes.
        unsafe { Tensor::from_raw(self.start + (self.data + first_byte) as u64, count, dtype) }
    }
}
