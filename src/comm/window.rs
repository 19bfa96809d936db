//! One-sided windows, torchcomms' `new_window` in Rust form: a buffer every
//! peer has mapped, stream-ordered puts into a peer's buffer, and signals
//! to say a put has landed.
//!
//! A window's signals live in the symmetric heap: `u64 [MAX_RANKS]` that
//! peers add to (`signal`), then `u64 [MAX_RANKS]` of this rank's own
//! counts of waits (`wait_signal`). Both are device-side counters that only
//! grow, so graph replays of a signal/wait pair need no host bookkeeping:
//! the n-th wait on a peer waits for its n-th signal.

use super::call::Call;
use super::communicator::Communicator;
use super::registry::Registration;
use super::tensor::Tensor;
use super::work::Work;
use crate::bootstrap::store_all_gather;
use crate::device::{Device, DeviceBuffer, DevicePtr, LaunchConfig, ModuleSource, MAX_RANKS};
use crate::error::{Error, Result};
use crate::heap::{Cmp, DevCtx, HeapBuffer};

/// The heap kernels' module of windows (`kernels-cuda/windows.cu`).
pub const WINDOWS_MODULE_NAME: &str = "windows";

pub(crate) const WINDOWS: ModuleSource = ModuleSource::raw(
    WINDOWS_MODULE_NAME,
    concat!(
        include_str!("../../kernels-cuda/prelude.cuh"),
        "\n",
        include_str!("../../kernels-cuda/device_api.cuh"),
        "\n",
        include_str!("../../kernels-cuda/windows.cu")
    ),
    concat!(
        include_str!("../../kernels-hip/prelude.hip.h"),
        "\n",
        include_str!("../../kernels-cuda/device_api.cuh"),
        "\n",
        include_str!("../../kernels-cuda/windows.cu")
    ),
);

/// Argument struct of `fc_win_signal` and `fc_win_wait` (`FcWinArgs`).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub(crate) struct WinArgs {
    ctx: DevCtx,
    /// This rank's signal words (heap, local address): `[0..MAX_RANKS)`
    /// signals from each rank, then `[MAX_RANKS..2*MAX_RANKS)` waits done on each.
    signals: DevicePtr,
    peer: u32,
    _pad: u32,
}

const _: () = assert!(std::mem::size_of::<WinArgs>() == 120);

impl WinArgs {
    /// The arguments of a signal to, or a wait on, `peer` over the signal
    /// words at `signals` (the overlap operations queue these kernels
    /// themselves, `super::overlap`).
    pub(crate) fn new(ctx: DevCtx, signals: DevicePtr, peer: usize) -> WinArgs {
        WinArgs {
            ctx,
            signals,
            peer: peer as u32,
            _pad: 0,
        }
    }
}

pub(crate) fn bytes_of(a: &WinArgs) -> &[u8] {
    // SAFETY: a #[repr(C)] struct of integers with no padding (asserted size);
    // the slice borrows it.
    unsafe { std::slice::from_raw_parts((a as *const WinArgs).cast::<u8>(), std::mem::size_of::<WinArgs>()) }
}

/// What a window's buffer is mapped through.
enum Mapped {
    /// Every rank's buffer is in the symmetric heap: nothing new is mapped.
    Heap,
    /// Some rank's is not: the buffers are registered (`Communicator::register`).
    Registered(Registration),
}

struct Buffer {
    local: Tensor,
    peer_ptrs: [DevicePtr; MAX_RANKS],
    peer_counts: [usize; MAX_RANKS],
    mapped: Mapped,
}

/// A window: see the module docs. Created by [`Communicator::new_window`].
pub struct Window<D: Device> {
    comm: Communicator<D>,
    signals: Option<HeapBuffer>,
    buffer: Option<Buffer>,
}

impl<D: Device> Communicator<D> {
    /// A window with no buffer yet (torchcomms' `new_window`). Collective:
    /// it takes its signal words from the symmetric heap.
    pub fn new_window(&self) -> Result<Window<D>> {
        // Loaded and made ready first (it is local), so that a failure leaves
        // no allocation on this rank alone, and so that no rank launches a
        // waiting kernel (after heap_alloc's exchange) while another still
        // loads the module: in a context shared by ranks, a module load
        // can wait behind a spinning kernel.
        self.with_resources(|res| {
            let m = super::heap::heap_module(res, &self.inner.device, &WINDOWS)?;
            self.inner.device.prepare(m, &[])
        })??;
        let signals = self.heap_alloc(2 * MAX_RANKS * 8)?;
        Ok(Window {
            comm: Communicator {
                inner: self.inner.clone(),
            },
            signals: Some(signals),
            buffer: None,
        })
    }
}

impl<D: Device> Window<D> {
    /// Make `t` this window's buffer (torchcomms' `tensor_register`).
    /// Collective; tensors may differ in size. Heap tensors on every rank
    /// cost nothing; otherwise the buffers are registered (mapped) here.
    pub fn register(&mut self, t: Tensor) -> Result<()> {
        if self.buffer.is_some() {
            return Err(Error::invalid(
                "window register: the window has a buffer; deregister it first",
            ));
        }
        let inner = &*self.comm.inner;
        let (rank, world) = (inner.rank, inner.world);
        let bytes = t.bytes()?;
        let offset = self
            .comm
            .with_resources(|res| res.heap.as_ref().and_then(|h| h.offset_of(t.ptr(), bytes.max(1))))?;
        // The heap's sync area is ferrocomm's: a window over it is refused
        // (on every rank, below, so nobody waits for this one).
        let in_sync_area = offset.is_some_and(|o| o < crate::heap::HEAP_RESERVED);
        let mut blob = vec![offset.is_some() as u8];
        blob.extend_from_slice(&(offset.unwrap_or(0) as u64).to_le_bytes());
        blob.extend_from_slice(&(t.count() as u64).to_le_bytes());
        blob.extend_from_slice(&(t.dtype() as u64).to_le_bytes());
        blob.extend_from_slice(&(in_sync_area as u64).to_le_bytes());
        let key = inner.next_key("win");
        let all = store_all_gather(inner.store.as_ref(), &key, rank, world, &blob, inner.opts.timeout)?;
        let word = |b: &[u8], i: usize| -> Result<u64> {
            b.get(1 + 8 * i..9 + 8 * i)
                .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                .ok_or_else(|| Error::Store("malformed window registration".into()))
        };
        let mut peer_counts = [0usize; MAX_RANKS];
        for (p, b) in all.iter().enumerate() {
            peer_counts[p] = word(b, 1)? as usize;
            if word(b, 3)? != 0 {
                return Err(Error::invalid(format!(
                    "window register: rank {p}'s tensor overlaps the heap's first {} bytes, ferrocomm's sync area",
                    crate::heap::HEAP_RESERVED
                )));
            }
            // Puts are bounded in the destination's elements, so every
            // rank's buffer must hold the same element type.
            if word(b, 2)? != t.dtype() as u64 {
                return Err(Error::Mismatch {
                    rank,
                    peer: p,
                    detail: format!(
                        "window register: this rank's buffer is {:?}, rank {p}'s another dtype (code {})",
                        t.dtype(),
                        word(b, 2)?
                    ),
                });
            }
        }
        let buffer = if all.iter().all(|b| b.first() == Some(&1)) {
            let bases = self.comm.device_ctx()?.heap;
            let mut peer_ptrs = [DevicePtr::NULL; MAX_RANKS];
            for (p, b) in all.iter().enumerate() {
                peer_ptrs[p] = bases[p].offset(word(b, 0)? as usize);
            }
            Buffer {
                local: t,
                peer_ptrs,
                peer_counts,
                mapped: Mapped::Heap,
            }
        } else {
            let reg = self.comm.register(t)?;
            let mut peer_ptrs = [DevicePtr::NULL; MAX_RANKS];
            for (p, ptr) in peer_ptrs.iter_mut().enumerate().take(world) {
                *ptr = self.comm.peer_tensor(&reg, p)?.ptr();
            }
            Buffer {
                local: t,
                peer_ptrs,
                peer_counts,
                mapped: Mapped::Registered(reg),
            }
        };
        self.buffer = Some(buffer);
        Ok(())
    }

    /// Drop the buffer (local): peers' mappings of registered buffers are
    /// released here. Queued puts into it must have completed.
    pub fn deregister(&mut self) -> Result<()> {
        let b = self
            .buffer
            .take()
            .ok_or_else(|| Error::invalid("window deregister: the window has no buffer"))?;
        match b.mapped {
            Mapped::Heap => Ok(()),
            Mapped::Registered(reg) => self.comm.deregister(reg),
        }
    }

    fn buffer(&self, what: &str) -> Result<&Buffer> {
        self.buffer
            .as_ref()
            .ok_or_else(|| Error::invalid(format!("window {what}: the window has no buffer (register one first)")))
    }

    fn check_rank(&self, what: &str, rank: usize) -> Result<()> {
        let world = self.comm.size();
        if rank >= world {
            return Err(Error::invalid(format!(
                "window {what}: rank {rank} is not in a world of {world}"
            )));
        }
        Ok(())
    }

    /// This rank's signal words (heap), for the kernels that the overlap
    /// operations queue outside the submission path (`super::overlap`).
    pub(crate) fn signal_words(&self) -> Result<DevicePtr> {
        Ok(self.signals.as_ref().ok_or(Error::Finalized)?.ptr())
    }

    /// This rank's registered buffer, if the window has one.
    pub fn buffer_tensor(&self) -> Option<Tensor> {
        self.buffer.as_ref().map(|b| b.local)
    }

    /// `rank`'s buffer as mapped here (torchcomms' `map_remote_tensor`):
    /// kernels of this device may load and store through it.
    pub fn map_remote(&self, rank: usize) -> Result<Tensor> {
        self.check_rank("map_remote", rank)?;
        let b = self.buffer("map_remote")?;
        // SAFETY: the mapping lives while the buffer is registered.
        Ok(unsafe { Tensor::from_raw(b.peer_ptrs[rank].0, b.peer_counts[rank], b.local.dtype()) })
    }

    /// Copy `src` into `dst_rank`'s buffer at element `dst_offset`, ordered
    /// on the call's stream (a copy-engine copy into the peer's mapping).
    /// Follow it with [`Window::signal`] to tell the peer.
    pub fn put(&self, src: Tensor, dst_rank: usize, dst_offset: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.check_rank("put", dst_rank)?;
        let b = self.buffer("put")?;
        if src.dtype() != b.local.dtype() {
            return Err(Error::invalid(format!(
                "window put: source is {:?}, the window's buffer {:?}",
                src.dtype(),
                b.local.dtype()
            )));
        }
        let end = dst_offset.checked_add(src.count());
        if end.is_none_or(|e| e > b.peer_counts[dst_rank]) {
            return Err(Error::invalid(format!(
                "window put: elements {dst_offset}..{dst_offset}+{} are past the end of rank {dst_rank}'s buffer of {}",
                src.count(),
                b.peer_counts[dst_rank]
            )));
        }
        let bytes = src.bytes()?;
        self.comm.inner.device.check_memory(src.ptr(), bytes)?;
        let dst = b.peer_ptrs[dst_rank].offset(dst_offset * src.dtype().size());
        self.comm.submit(call, "window put", |s| {
            if bytes == 0 {
                return Ok(());
            }
            s.inner.device.copy_device(dst, src.ptr(), bytes, s.stream)
        })
    }

    /// Add one to `dst_rank`'s signal word for this rank, after every
    /// earlier put of the call's stream.
    pub fn signal(&self, dst_rank: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.check_rank("signal", dst_rank)?;
        self.launch("fc_win_signal", dst_rank, call)
    }

    /// Make the call's stream wait until `peer` has signalled this rank once
    /// more than the waits before (counted on the device). A peer that never
    /// signals: the communicator fails with a timeout naming it.
    pub fn wait_signal(&self, peer: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.check_rank("wait_signal", peer)?;
        self.launch("fc_win_wait", peer, call)
    }

    fn launch(&self, kernel: &'static str, peer: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        let signals = self.signals.as_ref().ok_or(Error::Finalized)?.ptr();
        let mut ctx = self.comm.device_ctx()?;
        ctx.timeout_ns = DevCtx::timeout_ns_of(self.comm.inner.timeout_of(call));
        let args = WinArgs {
            ctx,
            signals,
            peer: peer as u32,
            _pad: 0,
        };
        self.comm.submit(call, kernel, |s| {
            let module = super::heap::heap_module(s.res, &s.inner.device, &WINDOWS)?;
            let one = LaunchConfig::new(1, 32);
            s.inner
                .device
                .launch_raw(module, kernel, one, bytes_of(&args), s.stream)
        })
    }

    /// Release the window: its buffer (as [`Window::deregister`]) and its
    /// signal words. Every rank frees its windows in the same order (the heap
    /// is symmetric). Work queued on the communicator's stream is waited
    /// for here; work on other streams, and graphs that captured the
    /// window's calls, must be finished (graphs destroyed) by the caller:
    /// a replay after `free` would count signals in someone else's memory.
    pub fn free(mut self) -> Result<()> {
        self.comm.inner.device.synchronize(&self.comm.inner.stream)?;
        if self.buffer.is_some() {
            self.deregister()?;
        }
        match self.signals.take() {
            Some(sig) => self.comm.heap_free(sig),
            None => Ok(()),
        }
    }
}

/// Host twins of `kernels-cuda/windows.cu`, written against [`DevCtx`].
pub(crate) mod window_twins {
    use super::*;
    use crate::backends::host::heap_kernels::{args_of, RawKernel};

    /// `(name, twin)` of every kernel of the windows module.
    pub const TWINS: [(&str, RawKernel); 3] = [
        ("fc_win_signal", signal),
        ("fc_win_wait", wait),
        ("fc_win_reduce", crate::comm::overlap::reduce_twin),
    ];

    /// # Safety
    /// `args` is a [`WinArgs`] of live heap mappings and error words.
    unsafe fn signal(args: &[u8]) {
        // SAFETY: forwarded from the caller.
        let a: WinArgs = unsafe { args_of(args) };
        let me = a.ctx.rank as usize;
        a.ctx.signal_add(a.peer as usize, a.signals.offset(8 * me), 1);
    }

    /// # Safety
    /// As [`signal`].
    unsafe fn wait(args: &[u8]) {
        // SAFETY: forwarded from the caller.
        let a: WinArgs = unsafe { args_of(args) };
        let (me, peer) = (a.ctx.rank as usize, a.peer as usize);
        let waits = a.signals.offset(8 * (MAX_RANKS + peer));
        let expected = a.ctx.atomic_add(me, waits, 1) + 1;
        a.ctx.wait_until(a.signals.offset(8 * peer), Cmp::Ge, expected, peer);
    }
}
