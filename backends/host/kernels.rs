//! The host backend's kernels: Rust twins of `kernels-cuda/collectives.cu`,
//! following `docs/protocol.md` step for step (epochs, flags, fingerprints,
//! deadlines) with a grid of one block. They are the reference: GPU kernels
//! must produce the same bits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::collectives;
use super::copy;
use super::fused;
use super::futex;
use super::ll;
use super::quickreduce;
use super::reduce::{Lanes, Reduction, Tiles};
use crate::algo::kernels::{
    collective_kernel_names, kernel_name, qr_encode_name, quick_reduce_kernel_names, quick_reduce_name, KernelKind,
    COLLECTIVES, FUSED, KERNEL_OPS, QR_CODECS, QR_DTYPES, QUICK_REDUCE,
};
use crate::algo::layout::{
    aux_offset, ll_parity_bytes, ll_stride, push_oneshot_stride, push_twoshot_stride, segment_elems, AUX_FACTOR,
    AUX_OFFSET, FLAGS_BYTES, LL_FP_BYTES, MAX_BLOCKS,
};
use crate::codec::Codec;
use crate::device::{DevicePtr, KernelParams, ERR_CODE_MISMATCH, ERR_CODE_TIMEOUT, MAX_RANKS, PARAM_SCALAR_IS_PTR};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// A host entry point, as its name fixes it.
#[derive(Debug, Clone, Copy)]
pub(super) enum HostKernel {
    /// `fc_<kind>_<dtype>_<op>` of the collectives module.
    Collective {
        kind: KernelKind,
        dtype: DType,
        op: ReduceOp,
    },
    /// `fc_qr_<codec>_<dtype>`: the quick-reduce all-reduce.
    QuickReduce { codec: Codec, dtype: DType },
    /// `fc_qr_encode_<codec>_<dtype>`: the codec alone.
    QrEncode { codec: Codec, dtype: DType },
    /// `fc_exchange`: all-gather, gather, scatter, all-to-all(-v).
    Exchange,
    /// `fc_exchange_direct`: the exchange into receivers' heap blocks.
    ExchangeDirect,
    /// `fc_exchange_ll`: the exchange of small agreed blocks on LL lines.
    ExchangeLl,
    /// `fc_reduce_to_<dtype>_<op>`: reduce-scatter, reduce.
    ReduceTo { dtype: DType, op: ReduceOp },
    /// `fc_reduce_to_direct_<dtype>_<op>`: the reduce-to reading heap blocks in place.
    ReduceToDirect { dtype: DType, op: ReduceOp },
    /// `fc_reduce_to_ll_<dtype>_<op>`: the reduce-to of small agreed blocks on LL lines.
    ReduceToLl { dtype: DType, op: ReduceOp },
    /// `fc_sendrecv`: a batch of sends and receives (no epoch).
    SendRecv,
    /// `fc_copy_sync`: the copy route's handshake.
    CopySync,
    /// `fc_fused_<kind>_[moe_]<pattern>_<dtype>`: a fused all-reduce epilogue.
    Fused {
        kind: crate::algo::fused::FusedKind,
        input: crate::algo::fused::FusedInput,
        pattern: crate::algo::fused::FusionPattern,
        dtype: DType,
    },
}

impl HostKernel {
    /// Run the kernel.
    ///
    /// # Safety
    /// `p` must describe live workspaces (own and peers', laid out as in
    /// `algo::layout`), live input/output ranges of `p.count` elements, and live
    /// error words, as the algorithm layer guarantees. (`QrEncode` touches only
    /// the input and an output of `encoded_bytes(count)`.)
    pub(super) unsafe fn call(self, p: &KernelParams) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match self {
                HostKernel::Collective { kind, dtype, op } => match dtype {
                    DType::F32 => launch(p, |l| run::<f32>(l, kind, op.into())),
                    DType::F16 => launch(p, |l| run::<f16>(l, kind, op.into())),
                    DType::BF16 => launch(p, |l| run::<bf16>(l, kind, op.into())),
                    DType::I32 => launch(p, |l| run::<i32>(l, kind, op.into())),
                    // `module_kernels` names reducible dtypes only.
                    _ => {}
                },
                HostKernel::QuickReduce { codec, dtype } => match dtype {
                    DType::BF16 => launch(p, |l| quickreduce::all_reduce::<bf16>(l, codec)),
                    _ => launch(p, |l| quickreduce::all_reduce::<f16>(l, codec)),
                },
                HostKernel::Exchange => launch(p, |l| collectives::exchange(l)),
                HostKernel::ExchangeDirect => launch(p, |l| collectives::exchange_direct(l)),
                HostKernel::ExchangeLl => launch(p, |l| ll::exchange_ll(l).then_some(l.epoch)),
                HostKernel::ReduceTo { dtype, op } => match dtype {
                    DType::F32 => launch(p, |l| collectives::reduce_to::<f32>(l, op.into())),
                    DType::F16 => launch(p, |l| collectives::reduce_to::<f16>(l, op.into())),
                    DType::BF16 => launch(p, |l| collectives::reduce_to::<bf16>(l, op.into())),
                    DType::I32 => launch(p, |l| collectives::reduce_to::<i32>(l, op.into())),
                    // `module_kernels` names reducible dtypes only.
                    _ => {}
                },
                HostKernel::ReduceToDirect { dtype, op } => match dtype {
                    DType::F32 => launch(p, |l| collectives::reduce_to_direct::<f32>(l, op.into())),
                    DType::F16 => launch(p, |l| collectives::reduce_to_direct::<f16>(l, op.into())),
                    DType::BF16 => launch(p, |l| collectives::reduce_to_direct::<bf16>(l, op.into())),
                    DType::I32 => launch(p, |l| collectives::reduce_to_direct::<i32>(l, op.into())),
                    // `module_kernels` names reducible dtypes only.
                    _ => {}
                },
                HostKernel::ReduceToLl { dtype, op } => {
                    let run = |l: &Launch| match dtype {
                        DType::F32 => ll::reduce_to_ll::<f32>(l, op.into()),
                        DType::F16 => ll::reduce_to_ll::<f16>(l, op.into()),
                        DType::BF16 => ll::reduce_to_ll::<bf16>(l, op.into()),
                        DType::I32 => ll::reduce_to_ll::<i32>(l, op.into()),
                        // `module_kernels` names reducible dtypes only.
                        _ => false,
                    };
                    launch(p, |l| run(l).then_some(l.epoch))
                }
                HostKernel::SendRecv => collectives::send_recv(p),
                HostKernel::CopySync => launch(p, copy::copy_sync),
                HostKernel::Fused {
                    kind,
                    input,
                    pattern,
                    dtype,
                } => launch(p, |l| fused::run(l, kind, input, pattern, dtype == DType::BF16)),
                HostKernel::QrEncode { codec, dtype } => match dtype {
                    DType::BF16 => quickreduce::encode_run::<bf16>(p, codec),
                    _ => quickreduce::encode_run::<f16>(p, codec),
                },
            }
        }
    }
}

/// This rank's premul_sum factor: `scalar` holds its f32 bits, or the
/// address of one element of the call's dtype (1.0 for other ops).
///
/// # Safety: with `PARAM_SCALAR_IS_PTR`, `scalar` is the address of a live element.
unsafe fn own_factor(p: &KernelParams) -> f32 {
    if p.op != ReduceOp::PreMulSum as u32 {
        return 1.0;
    }
    if p.flags & PARAM_SCALAR_IS_PTR == 0 {
        return f32::from_bits(p.scalar as u32);
    }
    let at = p.scalar as *const u8;
    // SAFETY: guaranteed by the caller (the communicator checked the factor
    // tensor: one element of the call's dtype on this device).
    unsafe {
        match DType::from_code(p.dtype) {
            Some(DType::F32) => (at as *const f32).read_unaligned(),
            Some(DType::F16) => (at as *const f16).read_unaligned().to_f32(),
            Some(DType::BF16) => (at as *const bf16).read_unaligned().to_f32(),
            _ => 1.0,
        }
    }
}

/// Kernels of a module, by entry-point name.
pub(super) fn module_kernels(module: &str) -> Result<HashMap<String, HostKernel>> {
    let mut map = HashMap::new();
    if module == COLLECTIVES.name {
        // The GPU names, plus premul_sum, which the host reduces too.
        for dtype in DType::REDUCIBLE {
            for kind in KernelKind::COLLECTIVES {
                for op in ReduceOp::ALL.into_iter().filter(|&op| dtype.supports(op)) {
                    map.insert(kernel_name(kind, dtype, op), HostKernel::Collective { kind, dtype, op });
                }
            }
            for op in ReduceOp::ALL.into_iter().filter(|&op| dtype.supports(op)) {
                map.insert(
                    kernel_name(KernelKind::ReduceTo, dtype, op),
                    HostKernel::ReduceTo { dtype, op },
                );
                map.insert(
                    kernel_name(KernelKind::ReduceToDirect, dtype, op),
                    HostKernel::ReduceToDirect { dtype, op },
                );
            }
            for op in KERNEL_OPS.into_iter().filter(|&op| dtype.supports(op)) {
                map.insert(
                    kernel_name(KernelKind::ReduceToLl, dtype, op),
                    HostKernel::ReduceToLl { dtype, op },
                );
            }
        }
        let any = DType::F32;
        map.insert(
            kernel_name(KernelKind::Exchange, any, ReduceOp::Sum),
            HostKernel::Exchange,
        );
        map.insert(
            kernel_name(KernelKind::ExchangeDirect, any, ReduceOp::Sum),
            HostKernel::ExchangeDirect,
        );
        map.insert(
            kernel_name(KernelKind::ExchangeLl, any, ReduceOp::Sum),
            HostKernel::ExchangeLl,
        );
        map.insert(
            kernel_name(KernelKind::SendRecv, any, ReduceOp::Sum),
            HostKernel::SendRecv,
        );
        map.insert(kernel_name(KernelKind::Copy, any, ReduceOp::Sum), HostKernel::CopySync);
        debug_assert!(collective_kernel_names().iter().all(|n| map.contains_key(n)));
    } else if module == QUICK_REDUCE.name {
        for codec in QR_CODECS {
            for dtype in QR_DTYPES {
                map.insert(
                    quick_reduce_name(codec, dtype),
                    HostKernel::QuickReduce { codec, dtype },
                );
                map.insert(qr_encode_name(codec, dtype), HostKernel::QrEncode { codec, dtype });
            }
        }
        debug_assert!(quick_reduce_kernel_names().iter().all(|n| map.contains_key(n)));
    } else if module == FUSED.name {
        for name in crate::algo::fused::fused_kernel_names() {
            if let Some((kind, input, pattern, dtype)) = crate::algo::fused::parse_fused(&name) {
                map.insert(
                    name,
                    HostKernel::Fused {
                        kind,
                        input,
                        pattern,
                        dtype,
                    },
                );
            }
        }
    } else {
        return Err(Error::invalid(format!("the host backend has no module named {module}")));
    }
    Ok(map)
}

// ---- raw access to the shared workspace (all unsafe, all tiny) ----

/// # Safety: `addr` is a live, 4-byte aligned u32 in shared memory.
pub(super) unsafe fn atomic_u32<'a>(addr: DevicePtr) -> &'a AtomicU32 {
    // SAFETY: guaranteed by the caller; AtomicU32 has u32's layout.
    unsafe { &*(addr.0 as *const AtomicU32) }
}

/// # Safety: `addr` is a live, 8-byte aligned u64 in shared memory.
pub(super) unsafe fn atomic_u64<'a>(addr: DevicePtr) -> &'a AtomicU64 {
    // SAFETY: guaranteed by the caller; AtomicU64 has u64's layout.
    unsafe { &*(addr.0 as *const AtomicU64) }
}

/// # Safety: both ranges are live; `dst` writable. Ranges may overlap (in place).
unsafe fn copy_elems<T>(dst: DevicePtr, src: DevicePtr, first: usize, n: usize) {
    let size = std::mem::size_of::<T>();
    // SAFETY: guaranteed by the caller.
    unsafe { copy_bytes(dst.offset(first * size), src.offset(first * size), n * size) }
}

/// # Safety: both ranges of `bytes` are live; `dst` writable. They may overlap.
pub(super) unsafe fn copy_bytes(dst: DevicePtr, src: DevicePtr, bytes: usize) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, bytes) }
}

/// One launch's view of the protocol state (for the kinds that loop over
/// chunks: one chunk's, with that chunk's epoch).
#[derive(Clone, Copy)]
pub(super) struct Launch<'a> {
    pub(super) p: &'a KernelParams,
    pub(super) epoch: u32,
    parity: usize,
    block: usize,
    /// This rank's premul_sum factor (1.0 for other ops).
    factor: f32,
}

impl Launch<'_> {
    pub(super) fn me(&self) -> usize {
        self.p.rank as usize
    }

    pub(super) fn world(&self) -> usize {
        self.p.world as usize
    }

    fn own_ws(&self) -> DevicePtr {
        self.p.peer_ws[self.me()]
    }

    pub(super) fn slot_bytes(&self) -> usize {
        self.p.slot_bytes as usize
    }

    /// Rank `rank`'s parity region of this launch (two slots).
    pub(super) fn region(&self, rank: usize) -> DevicePtr {
        self.p.peer_ws[rank].offset(self.p.data_offset as usize + self.parity * 2 * self.slot_bytes())
    }

    /// Rank `rank`'s LL area (right after the four data slots).
    fn ll_base(&self, rank: usize) -> DevicePtr {
        self.p.peer_ws[rank].offset(self.p.data_offset as usize + 4 * self.slot_bytes())
    }

    /// Rank `rank`'s LL fingerprint record for `src` (this parity and block).
    pub(super) fn ll_fp_addr(&self, rank: usize, src: usize) -> DevicePtr {
        self.ll_base(rank)
            .offset(((self.parity * MAX_BLOCKS + self.block) * MAX_RANKS + src) * 16)
    }

    /// Rank `rank`'s LL lines from `src` (this parity).
    pub(super) fn ll_lines(&self, rank: usize, src: usize) -> DevicePtr {
        self.ll_base(rank).offset(
            LL_FP_BYTES
                + self.parity * ll_parity_bytes(self.slot_bytes())
                + src * ll_stride(self.slot_bytes(), self.world()),
        )
    }

    /// The flag word of every LL unit this launch writes: never 0 (the
    /// cleared state) and different for launches `E` and `E + 2`.
    pub(super) fn ll_flag(&self) -> u32 {
        self.epoch | 1
    }

    /// The view of chunk `c` of a launch whose first epoch is `self.epoch`.
    pub(super) fn chunk(&self, c: usize) -> Self {
        let epoch = self.epoch.wrapping_add(c as u32);
        Launch {
            epoch,
            parity: (epoch & 1) as usize,
            ..*self
        }
    }

    fn err(&self, word: usize) -> &AtomicU32 {
        // SAFETY: error_flags points at ERR_WORDS live u32s (algorithm invariant).
        unsafe { atomic_u32(self.p.error_flags.offset(word * 4)) }
    }

    fn flag_addr(&self, ws: DevicePtr, phase: usize, src: usize) -> DevicePtr {
        ws.offset(self.p.flags_offset as usize + ((phase * MAX_BLOCKS + self.block) * MAX_RANKS + src) * 4)
    }

    /// Rank `rank`'s aux word `k` (`layout::AUX_*`) from `src`, this parity
    /// and block: the aux area follows the flags (as the device code finds it).
    pub(super) fn aux_addr(&self, rank: usize, k: usize, src: usize) -> DevicePtr {
        let ws = self.p.peer_ws[rank];
        ws.offset(self.p.flags_offset as usize + FLAGS_BYTES + aux_offset(self.parity, self.block, k, src) - AUX_OFFSET)
    }

    /// premul_sum's factor of every source, as published at phase 0 (read
    /// after the wait): the reduction with them.
    pub(super) fn reduction(&self, op: Reduction) -> Reduction {
        if op.op != ReduceOp::PreMulSum {
            return op;
        }
        let mut factors = [1.0f32; MAX_RANKS];
        for (s, f) in factors.iter_mut().enumerate().take(self.world()) {
            // SAFETY: aux slots lie inside our own live workspace.
            *f = f32::from_bits(
                unsafe { atomic_u64(self.aux_addr(self.me(), AUX_FACTOR, s)) }.load(Ordering::Relaxed) as u32,
            );
        }
        Reduction { op: op.op, factors }
    }

    fn fp_addr(&self, ws: DevicePtr, src: usize) -> DevicePtr {
        ws.offset(self.p.fp_offset as usize + ((self.parity * MAX_BLOCKS + self.block) * MAX_RANKS + src) * 8)
    }

    /// Tell every rank (ourselves included) that this block reached `phase`.
    pub(super) fn arrive(&self, phase: usize) {
        let me = self.me();
        for q in 0..self.world() {
            let ws = self.p.peer_ws[q];
            // SAFETY: flag and fingerprint slots lie inside every mapped workspace.
            unsafe {
                if phase == 0 {
                    atomic_u64(self.fp_addr(ws, me)).store(self.p.fingerprint, Ordering::Relaxed);
                    if self.p.op == ReduceOp::PreMulSum as u32 {
                        // Every rank scales its own input: readers need each source's factor.
                        let at = self.aux_addr(q, AUX_FACTOR, me);
                        atomic_u64(at).store(self.factor.to_bits() as u64, Ordering::Relaxed);
                    }
                }
                // Release: our data writes (and the fingerprint) happen-before the flag.
                let flag = atomic_u32(self.flag_addr(ws, phase, me));
                flag.store(self.epoch, Ordering::Release);
                futex::wake_all(flag);
            }
        }
    }

    /// Wait until every rank reached `phase`; false (with the error words set)
    /// on a deadline or a fingerprint mismatch.
    pub(super) fn wait(&self, phase: usize) -> bool {
        let own = self.own_ws();
        // SAFETY: flag slots inside our own live workspace.
        let flag = |s: usize| unsafe { atomic_u32(self.flag_addr(own, phase, s)) };
        let arrived = |s: usize| flag(s).load(Ordering::Acquire).wrapping_sub(self.epoch) as i32 >= 0;
        if !self.spin_all(arrived, flag) {
            return false;
        }
        if phase == 0 {
            for s in 0..self.world() {
                // SAFETY: fingerprint slot inside our own live workspace.
                let fp = unsafe { atomic_u64(self.fp_addr(own, s)) }.load(Ordering::Relaxed);
                if fp != self.p.fingerprint {
                    self.mismatch(s);
                    return false;
                }
            }
        }
        true
    }

    /// Wait until `ready(s)` holds for every source `s`, each checked until it
    /// holds once; `word(s)` is the word a writer changes (and wakes) when
    /// `ready(s)` may have become true. Spins briefly, then sleeps on that
    /// word, so ranks that outnumber the cores do not burn them. On the
    /// deadline: the sources still missing go into `err[1]`, the code is set,
    /// and false is returned.
    pub(super) fn spin_all<'w>(
        &self,
        mut ready: impl FnMut(usize) -> bool,
        word: impl Fn(usize) -> &'w AtomicU32,
    ) -> bool {
        const SPINS: u32 = 200;
        let world = self.world();
        let mut done = vec![false; world];
        let start = Instant::now();
        let limit = Duration::from_nanos(self.p.timeout_ns);
        let mut spins = 0u32;
        loop {
            for (s, d) in done.iter_mut().enumerate() {
                if !*d {
                    *d = ready(s);
                }
            }
            let Some(waiting) = done.iter().position(|&d| !d) else {
                return true;
            };
            let elapsed = start.elapsed();
            if elapsed > limit {
                let missing = (0..world).filter(|&s| !done[s]).fold(0u32, |m, s| m | (1 << s));
                self.err(1).fetch_or(missing, Ordering::AcqRel);
                self.fail(ERR_CODE_TIMEOUT);
                return false;
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
                continue;
            }
            // A slow wait: the host aborted the communicator, or the source
            // started this epoch with another call (a mismatch, not a timeout).
            if self.err(0).load(Ordering::Acquire) != 0 {
                return false;
            }
            if self.crossed(waiting) {
                self.mismatch(waiting);
                return false;
            }
            // Read the word, then re-check: a store (and its wake) between the
            // check and the sleep changes the word, so the sleep returns at once.
            let w = word(waiting);
            let seen = w.load(Ordering::Acquire);
            if ready(waiting) {
                done[waiting] = true;
                continue;
            }
            futex::wait(w, seen, (limit - elapsed).min(Duration::from_millis(50)));
        }
    }

    /// Whether `src` started this epoch with a different call in the other
    /// protocol of a launch's first handshake: phase-0 flags where we await
    /// LL records, or an LL record where we await flags (its fingerprint
    /// differs from ours; a launch that uses both carries one fingerprint).
    fn crossed(&self, src: usize) -> bool {
        if src == self.me() {
            return false;
        }
        let own = self.own_ws();
        let fp = self.p.fingerprint;
        // SAFETY: flag, fingerprint and LL record slots lie inside our own
        // live workspace.
        unsafe {
            // Exactly this epoch: a source already past it (done with an LL
            // launch at this epoch, now in a flag launch at the next) left
            // another launch's fingerprint in this parity's slot.
            let flag = atomic_u32(self.flag_addr(own, 0, src)).load(Ordering::Acquire);
            if flag == self.epoch && atomic_u64(self.fp_addr(own, src)).load(Ordering::Relaxed) != fp {
                return true;
            }
            let rec = self.ll_fp_addr(self.me(), src);
            let (lo, hi) = (
                atomic_u64(rec).load(Ordering::Acquire),
                atomic_u64(rec.offset(8)).load(Ordering::Acquire),
            );
            let ll = self.ll_flag();
            (lo >> 32) as u32 == ll && (hi >> 32) as u32 == ll && ((lo & 0xffff_ffff) | (hi << 32)) != fp
        }
    }

    pub(super) fn mismatch(&self, src: usize) {
        let _ = self
            .err(2)
            .compare_exchange(0, src as u32 + 1, Ordering::AcqRel, Ordering::Acquire);
        self.fail(ERR_CODE_MISMATCH);
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

/// Run one launch's body with the epoch protocol around it: the body gets
/// the launch's view (epoch `E` = stored epoch + 1) and returns the last epoch
/// it used, or `None` after a failure (the epoch then stays unpublished).
///
/// # Safety: see [`HostKernel::call`].
pub(super) unsafe fn launch(p: &KernelParams, body: impl FnOnce(&Launch) -> Option<u32>) {
    let own = p.peer_ws[p.rank as usize];
    // SAFETY: control words sit at the start of our own workspace.
    let (epoch_word, done_word) = unsafe { (atomic_u32(own), atomic_u32(own.offset(4))) };
    let epoch = epoch_word.load(Ordering::Acquire).wrapping_add(1);
    let l = Launch {
        p,
        epoch,
        parity: (epoch & 1) as usize,
        block: 0,
        // SAFETY: forwarded from the caller.
        factor: unsafe { own_factor(p) },
    };
    // A communicator that already failed runs nothing more: no new waits.
    if l.err(0).load(Ordering::Acquire) != 0 {
        return;
    }
    // The last block to finish publishes the (last chunk's) epoch; here the
    // grid is one block.
    if let Some(epoch) = body(&l) {
        if done_word.fetch_add(1, Ordering::AcqRel) + 1 == 1 {
            done_word.store(0, Ordering::Relaxed);
            epoch_word.store(epoch, Ordering::Release);
        }
    }
}

/// The collectives module's kernels. Returns the last epoch, as [`launch`] wants.
///
/// # Safety: see [`HostKernel::call`].
unsafe fn run<T: Lanes>(l: &Launch, kind: KernelKind, op: Reduction) -> Option<u32> {
    // SAFETY: forwarded from the caller.
    unsafe {
        match kind {
            KernelKind::OneShot => oneshot::<T>(l, op).then_some(l.epoch),
            KernelKind::TwoShot => twoshot::<T>(l, op).then_some(l.epoch),
            KernelKind::Broadcast => broadcast::<T>(l).then_some(l.epoch),
            KernelKind::OneShotPush => oneshot_push::<T>(l, op),
            KernelKind::OneShotLl => ll::oneshot_ll::<T>(l, op).then_some(l.epoch),
            KernelKind::TwoShotPush => twoshot_push::<T>(l, op),
            // Not names of this dispatch (module_kernels maps them elsewhere).
            KernelKind::QuickReduce
            | KernelKind::Exchange
            | KernelKind::ExchangeDirect
            | KernelKind::ExchangeLl
            | KernelKind::ReduceTo
            | KernelKind::ReduceToDirect
            | KernelKind::ReduceToLl
            | KernelKind::SendRecv
            | KernelKind::Copy => None,
        }
    }
}

/// Reduce `n` elements: element `i` of rank `r` is element `i` of `srcs[r]`
/// (`srcs.len() == world`), reduced in rank order (docs/protocol.md), and
/// stored as element `i` of every `outs` buffer.
///
/// # Safety: every `srcs` range of `n` elements is live, every `outs` range
/// live and writable. An output may equal a source (in place).
pub(super) unsafe fn reduce_range<T: Lanes>(
    l: &Launch,
    op: Reduction,
    srcs: &[DevicePtr],
    n: usize,
    outs: &[DevicePtr],
) {
    debug_assert_eq!(srcs.len(), l.world());
    // SAFETY: forwarded from the caller.
    unsafe { Tiles::<T>::new().reduce(l.reduction(op), l.world(), srcs, n, outs) }
}

/// # Safety: see [`HostKernel::call`].
unsafe fn oneshot<T: Lanes>(l: &Launch, op: Reduction) -> bool {
    let n = l.p.count as usize;
    let me = l.me();
    // SAFETY: the input and slot each hold `count` elements.
    unsafe { copy_elems::<T>(l.region(me), l.p.input, 0, n) };
    l.arrive(0);
    if !l.wait(0) {
        return false;
    }
    let srcs: Vec<DevicePtr> = (0..l.world()).map(|r| l.region(r)).collect();
    // SAFETY: every slot and the output hold `count` elements.
    unsafe { reduce_range::<T>(l, op, &srcs, n, &[l.p.output]) };
    true
}

/// # Safety: see [`HostKernel::call`].
unsafe fn twoshot<T: Lanes>(l: &Launch, op: Reduction) -> bool {
    let n = l.p.count as usize;
    let world = l.world();
    let me = l.me();
    let size = std::mem::size_of::<T>();
    let seg = segment_elems(n, world);
    let seg_range = |r: usize| {
        let a = (r * seg).min(n);
        (a, (a + seg).min(n) - a)
    };
    let result = |r: usize| l.region(r).offset(l.slot_bytes());
    // Stage 0: with one block, block 0 owns every segment whole.
    // SAFETY: the input and slot each hold `count` elements.
    unsafe { copy_elems::<T>(l.region(me), l.p.input, 0, n) };
    l.arrive(0);
    if !l.wait(0) {
        return false;
    }
    // Stage 1: reduce our segment into the output and our result slot.
    let (a, len) = seg_range(me);
    let srcs: Vec<DevicePtr> = (0..world).map(|r| l.region(r).offset(a * size)).collect();
    let outs = [l.p.output.offset(a * size), result(me).offset(a * size)];
    // SAFETY: the segment lies inside every slot and the output.
    unsafe { reduce_range::<T>(l, op, &srcs, len, &outs) };
    l.arrive(1);
    if !l.wait(1) {
        return false;
    }
    // Stage 2: gather every other segment from its owner's result slot.
    for r in (0..world).filter(|&r| r != me) {
        let (a, len) = seg_range(r);
        // SAFETY: the segment lies inside the peer's result slot and our output.
        unsafe { copy_elems::<T>(l.p.output, result(r), a, len) };
    }
    true
}

/// # Safety: see [`HostKernel::call`].
unsafe fn broadcast<T: Lanes>(l: &Launch) -> bool {
    let n = l.p.count as usize;
    let root = l.p.root as usize;
    if l.me() == root {
        // SAFETY: the input and slot each hold `count` elements.
        unsafe { copy_elems::<T>(l.region(root), l.p.input, 0, n) };
    }
    l.arrive(0);
    if !l.wait(0) {
        return false;
    }
    // SAFETY: the root's slot and our output hold `count` elements.
    unsafe { copy_elems::<T>(l.p.output, l.region(root), 0, n) };
    true
}

/// Chunks of `cap` elements that one whole-call launch of `n` elements runs.
fn chunks(n: usize, cap: usize) -> usize {
    n.div_ceil(cap.max(1))
}

/// One-shot, push, over chunks of one sub-buffer each (chunk `c` with epoch
/// `E + c`): our input goes into sub-buffer `[rank]` of every rank's region;
/// after the flags, reduce from our own region. Returns the last epoch.
///
/// # Safety: see [`HostKernel::call`].
unsafe fn oneshot_push<T: Lanes>(l: &Launch, op: Reduction) -> Option<u32> {
    let count = l.p.count as usize;
    let me = l.me();
    let world = l.world();
    let size = std::mem::size_of::<T>();
    let stride = push_oneshot_stride(l.slot_bytes(), world);
    let cap = stride / size;
    let nchunk = chunks(count, cap);
    for c in 0..nchunk {
        let l = l.chunk(c);
        let first = c * cap;
        let n = cap.min(count - first);
        let input = l.p.input.offset(first * size);
        // Staggered, as the GPU blocks are: peers first, ourselves last.
        for k in 1..=world {
            let q = (me + k) % world;
            // SAFETY: n elements fit a sub-buffer.
            unsafe { copy_elems::<T>(l.region(q).offset(me * stride), input, 0, n) };
        }
        l.arrive(0);
        if !l.wait(0) {
            return None;
        }
        let srcs: Vec<DevicePtr> = (0..world).map(|s| l.region(me).offset(s * stride)).collect();
        // SAFETY: every sub-buffer and the output chunk hold `n` elements.
        unsafe { reduce_range::<T>(&l, op, &srcs, n, &[l.p.output.offset(first * size)]) };
    }
    Some(l.epoch.wrapping_add(nchunk as u32 - 1))
}

/// Two-shot, push, over chunks of `world` segments of one inbox each, the
/// next chunk's first stage overlapping the current chunk's gather (as on
/// GPUs). Segment `d` of a chunk of `n` elements is `[d*seg, (d+1)*seg)`,
/// `seg = segment_elems(n, world)`; its element `e` sits at offset
/// `(e - d*seg)*size` of inbox `[src]` (at `src * stride`) of rank `d`, and of
/// every rank's result slot at `d * stride`. Per chunk `c`:
/// S1(c) our segment `d` into rank `d`'s inbox `[rank]`, arrive 0;
/// W0(c); S2(c) reduce our segment from our inboxes into the output and every
/// peer's result slot, arrive 1; S1(c + 1); W1(c); S3(c) the other segments
/// from our result slot into the output. Returns the last epoch.
///
/// # Safety: see [`HostKernel::call`].
unsafe fn twoshot_push<T: Lanes>(l: &Launch, op: Reduction) -> Option<u32> {
    let count = l.p.count as usize;
    let world = l.world();
    let me = l.me();
    let size = std::mem::size_of::<T>();
    let stride = push_twoshot_stride(l.slot_bytes(), world);
    let chunk = world * (stride / size);
    let nchunk = chunks(count, chunk);
    // (first element, elements, segment) of chunk c.
    let geometry = |c: usize| {
        let first = c * chunk;
        let n = chunk.min(count - first);
        (first, n, segment_elems(n, world))
    };
    let seg_range = |n: usize, seg: usize, r: usize| {
        let a = (r * seg).min(n);
        (a, (a + seg).min(n) - a)
    };
    let stage1 = |c: usize| {
        let l = l.chunk(c);
        let (first, n, seg) = geometry(c);
        // Our own segment is not staged: only we read inbox [rank] of our
        // region, so S2 reads it straight from the input (host memory traffic
        // is the host backend's cost; peers cannot tell the difference).
        for k in 1..world {
            let d = (me + k) % world;
            let (a, len) = seg_range(n, seg, d);
            let src = l.p.input.offset((first + a) * size);
            // SAFETY: a segment fits an inbox; the input holds the chunk.
            unsafe { copy_bytes(l.region(d).offset(me * stride), src, len * size) };
        }
        l.arrive(0);
    };
    stage1(0);
    for c in 0..nchunk {
        let l = l.chunk(c);
        let (first, n, seg) = geometry(c);
        let output = l.p.output.offset(first * size);
        let result = |r: usize| l.region(r).offset(l.slot_bytes());
        if !l.wait(0) {
            return None;
        }
        // S2: our segment, from our inboxes, to our output and every peer.
        let (a, len) = seg_range(n, seg, me);
        let srcs: Vec<DevicePtr> = (0..world)
            .map(|s| match s == me {
                true => l.p.input.offset((first + a) * size),
                false => l.region(me).offset(s * stride),
            })
            .collect();
        let mut outs = vec![output.offset(a * size)];
        outs.extend((1..world).map(|k| result((me + k) % world).offset(me * stride)));
        // SAFETY: the segment lies inside every inbox, result slot and the output.
        unsafe { reduce_range::<T>(&l, op, &srcs, len, &outs) };
        l.arrive(1);
        if c + 1 < nchunk {
            stage1(c + 1);
        }
        if !l.wait(1) {
            return None;
        }
        // S3: the other segments, from our own result slot.
        for r in (0..world).filter(|&r| r != me) {
            let (a, len) = seg_range(n, seg, r);
            // SAFETY: the segment lies inside our result slot and our output.
            unsafe { copy_bytes(output.offset(a * size), result(me).offset(r * stride), len * size) };
        }
    }
    Some(l.epoch.wrapping_add(nchunk as u32 - 1))
}
