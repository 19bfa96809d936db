//! The host backend's kernels: Rust twins of `kernels-cuda/collectives.cu`,
//! following `docs/protocol.md` step for step (epochs, flags, fingerprints,
//! deadlines) with a grid of one block. They are the reference: GPU kernels
//! must produce the same bits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use crate::algo::kernels::{all_kernel_names, kernel_name, KernelKind, COLLECTIVES};
use crate::algo::layout::{segment_elems, MAX_BLOCKS};
use crate::device::{DevicePtr, KernelParams, ERR_CODE_MISMATCH, ERR_CODE_TIMEOUT, MAX_RANKS};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};

/// A host entry point: the kernel family and the (dtype, op) its name fixes.
#[derive(Debug, Clone, Copy)]
pub(super) struct HostKernel {
    kind: KernelKind,
    dtype: DType,
    op: ReduceOp,
}

impl HostKernel {
    /// Run the kernel.
    ///
    /// # Safety
    /// `p` must describe live workspaces (own and peers', laid out as in
    /// `algo::layout`), live input/output ranges of `p.count` elements, and live
    /// error words, as the algorithm layer guarantees.
    pub(super) unsafe fn call(self, p: &KernelParams) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match self.dtype {
                DType::F32 => run::<f32>(self, p),
                DType::F16 => run::<f16>(self, p),
                DType::BF16 => run::<bf16>(self, p),
                DType::I32 => run::<i32>(self, p),
            }
        }
    }
}

/// Kernels of a module, by entry-point name.
pub(super) fn module_kernels(module: &str) -> Result<HashMap<String, HostKernel>> {
    if module != COLLECTIVES.name {
        return Err(Error::invalid(format!("the host backend has no module named {module}")));
    }
    let mut map = HashMap::new();
    for dtype in DType::ALL {
        for kind in [KernelKind::OneShot, KernelKind::TwoShot, KernelKind::Broadcast] {
            for op in ReduceOp::ALL {
                if dtype.supports(op) {
                    map.insert(kernel_name(kind, dtype, op), HostKernel { kind, dtype, op });
                }
            }
        }
    }
    debug_assert!(all_kernel_names().iter().all(|n| map.contains_key(n)));
    Ok(map)
}

// ---- raw access to the shared workspace (all unsafe, all tiny) ----

/// # Safety: `addr` is a live, 4-byte aligned u32 in shared memory.
unsafe fn atomic_u32<'a>(addr: DevicePtr) -> &'a AtomicU32 {
    // SAFETY: guaranteed by the caller; AtomicU32 has u32's layout.
    unsafe { &*(addr.0 as *const AtomicU32) }
}

/// # Safety: `addr` is a live, 8-byte aligned u64 in shared memory.
unsafe fn atomic_u64<'a>(addr: DevicePtr) -> &'a AtomicU64 {
    // SAFETY: guaranteed by the caller; AtomicU64 has u64's layout.
    unsafe { &*(addr.0 as *const AtomicU64) }
}

/// # Safety: `base + i*size_of::<T>()` is a live element.
unsafe fn load<T: Copy>(base: DevicePtr, i: usize) -> T {
    // SAFETY: guaranteed by the caller; user buffers need not be aligned.
    unsafe { (base.0 as *const T).add(i).read_unaligned() }
}

/// # Safety: `base + i*size_of::<T>()` is a live, writable element.
unsafe fn store<T: Copy>(base: DevicePtr, i: usize, v: T) {
    // SAFETY: guaranteed by the caller.
    unsafe { (base.0 as *mut T).add(i).write_unaligned(v) }
}

/// # Safety: both ranges are live; `dst` writable. Ranges may overlap (in place).
unsafe fn copy_elems<T>(dst: DevicePtr, src: DevicePtr, first: usize, n: usize) {
    let size = std::mem::size_of::<T>();
    // SAFETY: guaranteed by the caller.
    unsafe {
        std::ptr::copy(
            (src.0 as *const u8).add(first * size),
            (dst.0 as *mut u8).add(first * size),
            n * size,
        )
    }
}

/// One launch's view of the protocol state.
struct Launch<'a> {
    p: &'a KernelParams,
    epoch: u32,
    parity: usize,
    block: usize,
}

impl Launch<'_> {
    fn own_ws(&self) -> DevicePtr {
        self.p.peer_ws[self.p.rank as usize]
    }

    fn slot(&self, rank: usize, slot: usize) -> DevicePtr {
        self.p.peer_ws[rank].offset(self.p.data_offset as usize + slot * self.p.slot_bytes as usize)
    }

    fn err(&self, word: usize) -> &AtomicU32 {
        // SAFETY: error_flags points at ERR_WORDS live u32s (algorithm invariant).
        unsafe { atomic_u32(self.p.error_flags.offset(word * 4)) }
    }

    fn flag_addr(&self, ws: DevicePtr, phase: usize, src: usize) -> DevicePtr {
        ws.offset(self.p.flags_offset as usize + ((phase * MAX_BLOCKS + self.block) * MAX_RANKS + src) * 4)
    }

    fn fp_addr(&self, ws: DevicePtr, src: usize) -> DevicePtr {
        ws.offset(self.p.fp_offset as usize + ((self.parity * MAX_BLOCKS + self.block) * MAX_RANKS + src) * 8)
    }

    /// Tell every rank (ourselves included) that this block reached `phase`.
    fn arrive(&self, phase: usize) {
        let me = self.p.rank as usize;
        for q in 0..self.p.world as usize {
            let ws = self.p.peer_ws[q];
            // SAFETY: flag and fingerprint slots lie inside every mapped workspace.
            unsafe {
                if phase == 0 {
                    atomic_u64(self.fp_addr(ws, me)).store(self.p.fingerprint, Ordering::Relaxed);
                }
                // Release: our data writes (and the fingerprint) happen-before the flag.
                atomic_u32(self.flag_addr(ws, phase, me)).store(self.epoch, Ordering::Release);
            }
        }
    }

    /// Wait until every rank reached `phase`; false (with the error words set)
    /// on a deadline or a fingerprint mismatch.
    fn wait(&self, phase: usize) -> bool {
        let world = self.p.world as usize;
        let own = self.own_ws();
        let arrived = |s: usize| {
            // SAFETY: flag slot inside our own live workspace.
            let f = unsafe { atomic_u32(self.flag_addr(own, phase, s)) }.load(Ordering::Acquire);
            f.wrapping_sub(self.epoch) as i32 >= 0
        };
        let start = Instant::now();
        let limit = Duration::from_nanos(self.p.timeout_ns);
        let mut spins = 0u32;
        while !(0..world).all(arrived) {
            if start.elapsed() > limit {
                let missing = (0..world).filter(|&s| !arrived(s)).fold(0u32, |m, s| m | (1 << s));
                self.err(1).fetch_or(missing, Ordering::AcqRel);
                self.fail(ERR_CODE_TIMEOUT);
                return false;
            }
            backoff(&mut spins);
        }
        if phase == 0 {
            for s in 0..world {
                // SAFETY: fingerprint slot inside our own live workspace.
                let fp = unsafe { atomic_u64(self.fp_addr(own, s)) }.load(Ordering::Relaxed);
                if fp != self.p.fingerprint {
                    self.err(2).store(s as u32 + 1, Ordering::Release);
                    self.fail(ERR_CODE_MISMATCH);
                    return false;
                }
            }
        }
        true
    }

    fn fail(&self, code: u32) {
        if self
            .err(0)
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.err(3).store(self.epoch, Ordering::Release);
        }
    }
}

/// Spin briefly, then yield, then sleep: host ranks may outnumber cores.
fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        std::hint::spin_loop();
    } else if *spins < 256 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// # Safety: see [`HostKernel::call`].
unsafe fn run<T: Element>(k: HostKernel, p: &KernelParams) {
    let own = p.peer_ws[p.rank as usize];
    // SAFETY: control words sit at the start of our own workspace.
    let (epoch_word, done_word) = unsafe { (atomic_u32(own), atomic_u32(own.offset(4))) };
    let l = Launch {
        p,
        epoch: epoch_word.load(Ordering::Acquire).wrapping_add(1),
        parity: 0,
        block: 0,
    };
    let l = Launch {
        parity: (l.epoch & 1) as usize,
        ..l
    };
    // A communicator that already failed runs nothing more: no new waits.
    if l.err(0).load(Ordering::Acquire) != 0 {
        return;
    }
    // SAFETY: forwarded from the caller.
    let ok = unsafe {
        match k.kind {
            KernelKind::OneShot => oneshot::<T>(&l, k.op),
            KernelKind::TwoShot => twoshot::<T>(&l, k.op),
            KernelKind::Broadcast => broadcast::<T>(&l),
        }
    };
    // The last block to finish publishes the epoch (here the grid is one block).
    if ok && done_word.fetch_add(1, Ordering::AcqRel) + 1 == 1 {
        done_word.store(0, Ordering::Relaxed);
        epoch_word.store(l.epoch, Ordering::Release);
    }
}

/// Reduce `[first, first+n)` from every rank's `slot` into `out` (and `out2`).
///
/// # Safety: the range lies inside every rank's slot and inside `out`/`out2`.
unsafe fn reduce_range<T: Element>(
    l: &Launch,
    op: ReduceOp,
    slot: usize,
    first: usize,
    n: usize,
    out: DevicePtr,
    out2: Option<DevicePtr>,
) {
    const TILE: usize = 1024;
    let world = l.p.world as usize;
    let mut acc: Vec<T::Acc> = Vec::with_capacity(TILE.min(n));
    let mut start = first;
    while start < first + n {
        let len = TILE.min(first + n - start);
        let src0 = l.slot(0, slot);
        acc.clear();
        // SAFETY (all loads/stores below): guaranteed by the caller's range contract.
        acc.extend((start..start + len).map(|i| unsafe { load::<T>(src0, i) }.to_acc()));
        for r in 1..world {
            let src = l.slot(r, slot);
            for (j, a) in acc.iter_mut().enumerate() {
                *a = T::combine(op, *a, unsafe { load::<T>(src, start + j) }.to_acc());
            }
        }
        for (j, a) in acc.iter().enumerate() {
            let v = T::from_acc(T::finish(op, *a, world));
            unsafe { store(out, start + j, v) };
            if let Some(o2) = out2 {
                unsafe { store(o2, start + j, v) };
            }
        }
        start += len;
    }
}

/// # Safety: see [`HostKernel::call`].
unsafe fn oneshot<T: Element>(l: &Launch, op: ReduceOp) -> bool {
    let n = l.p.count as usize;
    let me = l.p.rank as usize;
    // SAFETY: the input and slot each hold `count` elements.
    unsafe { copy_elems::<T>(l.slot(me, l.parity), l.p.input, 0, n) };
    l.arrive(0);
    if !l.wait(0) {
        return false;
    }
    // SAFETY: every slot and the output hold `count` elements.
    unsafe { reduce_range::<T>(l, op, l.parity, 0, n, l.p.output, None) };
    true
}

/// # Safety: see [`HostKernel::call`].
unsafe fn twoshot<T: Element>(l: &Launch, op: ReduceOp) -> bool {
    let n = l.p.count as usize;
    let world = l.p.world as usize;
    let me = l.p.rank as usize;
    let seg = segment_elems(n, world);
    let seg_range = |r: usize| {
        let a = (r * seg).min(n);
        (a, (a + seg).min(n) - a)
    };
    // Stage 0: with one block, block 0 owns every segment whole.
    // SAFETY: the input and slot each hold `count` elements.
    unsafe { copy_elems::<T>(l.slot(me, l.parity), l.p.input, 0, n) };
    l.arrive(0);
    if !l.wait(0) {
        return false;
    }
    // Stage 1: reduce our segment into the output and our result slot.
    let (a, len) = seg_range(me);
    // SAFETY: the segment lies inside every slot and the output.
    unsafe { reduce_range::<T>(l, op, l.parity, a, len, l.p.output, Some(l.slot(me, 2 + l.parity))) };
    l.arrive(1);
    if !l.wait(1) {
        return false;
    }
    // Stage 2: gather every other segment from its owner's result slot.
    for r in (0..world).filter(|&r| r != me) {
        let (a, len) = seg_range(r);
        // SAFETY: the segment lies inside the peer's result slot and our output.
        unsafe { copy_elems::<T>(l.p.output, l.slot(r, 2 + l.parity), a, len) };
    }
    true
}

/// # Safety: see [`HostKernel::call`].
unsafe fn broadcast<T: Element>(l: &Launch) -> bool {
    let n = l.p.count as usize;
    let root = l.p.root as usize;
    if l.p.rank as usize == root {
        // SAFETY: the input and slot each hold `count` elements.
        unsafe { copy_elems::<T>(l.slot(root, l.parity), l.p.input, 0, n) };
    }
    l.arrive(0);
    if !l.wait(0) {
        return false;
    }
    // SAFETY: the root's slot and our output hold `count` elements.
    unsafe { copy_elems::<T>(l.p.output, l.slot(root, l.parity), 0, n) };
    true
}
