//! Running a plan: the launches, copies and library calls one call queues
//! on its stream. What runs was decided by the planner (`crate::plan`);
//! the only choices made here are local ones that no peer sees: copies
//! through the staging buffer for this rank's misaligned or aliasing
//! operands, and where this rank's direct-kind blocks sit in its heap.

use super::Lists;
use crate::algo::kernels::{KernelKind, QUICK_REDUCE};
use crate::algo::CollectiveCall;
use crate::comm::submit::Submit;
use crate::comm::vendor::VendorOp;
use crate::device::{BackendKind, Device, DeviceBuffer, DevicePtr, PARAM_DIRECT_OK};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::plan::Kernel;

/// A device copy, skipped when source and destination are the same bytes.
pub(super) fn copy_if_apart<D: Device>(s: &Submit<'_, D>, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
    if dst == src || bytes == 0 {
        return Ok(());
    }
    s.inner.device.copy_device(dst, src, bytes, s.stream)
}

/// Enqueue one of ferrocomm's kernels (quick-reduce's module loaded on first use).
pub(super) fn enqueue<D: Device>(s: &mut Submit<'_, D>, c: &CollectiveCall) -> Result<()> {
    let inner = s.inner;
    if c.codec.is_some() && s.res.qr_module.is_none() {
        s.res.qr_module = Some(inner.device.load_module(&QUICK_REDUCE)?);
    }
    let module = match (&s.res.qr_module, c.codec) {
        (Some(m), Some(_)) => m,
        _ => &s.res.module,
    };
    let ws = s.workspace("this call")?;
    c.enqueue(
        &inner.device,
        module,
        &inner.names,
        &inner.grids,
        ws,
        &inner.flags,
        inner.rank,
        s.timeout,
        s.stream,
    )
}

/// An all-reduce kernel (`k`) of `count` x `dtype` from `input` into
/// `output`, through the staging buffer where the plan says this rank's
/// operands are misaligned (in place there).
#[allow(clippy::too_many_arguments)]
pub(super) fn all_reduce<D: Device>(
    s: &mut Submit<'_, D>,
    k: Kernel,
    op: ReduceOp,
    scalar: u64,
    flags: u32,
    count: usize,
    input: DevicePtr,
    output: DevicePtr,
) -> Result<()> {
    let bytes = count * k.elem.size();
    let through = k.staged.then_some(Staged {
        span: bytes,
        reads: true,
    });
    around_staging(s, through, input, output, bytes, |s, inp, out| {
        let mut c = CollectiveCall::new(k.kind, k.elem, op, count, inp, out);
        c.codec = k.codec;
        c.scalar = scalar;
        c.flags = flags;
        enqueue(s, &c)
    })
}

/// A launch on this rank's operands in place in the staging buffer.
struct Staged {
    /// Bytes of staging the launch touches (the payload, or padded).
    span: usize,
    /// Whether this rank's input is read (and so copied in first).
    reads: bool,
}

/// `launch(input, output)` on this rank's operands, or, `through` the
/// staging buffer, on their copy there (in place), `bytes` of the result
/// copied back to `output` after it: a local choice no peer sees.
fn around_staging<D: Device>(
    s: &mut Submit<'_, D>,
    through: Option<Staged>,
    input: DevicePtr,
    output: DevicePtr,
    bytes: usize,
    launch: impl FnOnce(&mut Submit<'_, D>, DevicePtr, DevicePtr) -> Result<()>,
) -> Result<()> {
    let Some(st) = through else {
        return launch(s, input, output);
    };
    let at = staging_at(s, st.span)?;
    if st.reads {
        s.inner.device.copy_device(at, input, bytes, s.stream)?;
    }
    launch(s, at, at)?;
    s.inner.device.copy_device(output, at, bytes, s.stream)
}

/// The broadcast kernel on `bytes` as words of `k.elem`: staged where this
/// rank's addresses are not aligned to the word, padded (every rank) where
/// no word divides the payload. Only the root's input is read.
pub(super) fn broadcast<D: Device>(
    s: &mut Submit<'_, D>,
    k: Kernel,
    input: DevicePtr,
    output: DevicePtr,
    bytes: usize,
    root: usize,
) -> Result<()> {
    let w = k.elem.size();
    let span = bytes.next_multiple_of(w);
    let through = (k.staged || k.padded).then_some(Staged {
        span,
        reads: s.inner.rank == root,
    });
    around_staging(s, through, input, output, bytes, |s, inp, out| {
        let mut c = CollectiveCall::new(KernelKind::Broadcast, k.elem, ReduceOp::Sum, span / w, inp, out);
        c.root = root;
        enqueue(s, &c)
    })
}

/// The exchange protocol (all-gather, gather, scatter, all-to-all, the
/// host's broadcast of odd sizes): `fc_exchange`, its LL twin or its direct
/// twin, as `kind` says. `agreed`: the block (elements) every rank moves to
/// every peer when the group agrees on one, else 0; it joins the
/// fingerprint and sizes the GPU grid.
pub(super) fn exchange<D: Device>(
    s: &mut Submit<'_, D>,
    kind: KernelKind,
    dtype: DType,
    l: &Lists,
    agreed: usize,
) -> Result<()> {
    let l = unalias(s, dtype, l, None)?;
    let mut c = CollectiveCall::new(kind, dtype, ReduceOp::Sum, agreed, DevicePtr::NULL, DevicePtr::NULL);
    c.per_peer = l.table(0);
    if kind == KernelKind::ExchangeDirect {
        let heap = direct_heap(s)?;
        c.table = heap.peer_bases_table();
        c.flags |= if receives_in_place(heap, dtype, &l, s.inner.rank) {
            PARAM_DIRECT_OK
        } else {
            0
        };
    }
    enqueue(s, &c)
}

/// The reduce-to protocol (reduce-scatter, reduce): `fc_reduce_to_<dtype>_<op>`,
/// its LL twin or its direct twin, as `kind` says.
#[allow(clippy::too_many_arguments)]
pub(super) fn reduce_to<D: Device>(
    s: &mut Submit<'_, D>,
    kind: KernelKind,
    dtype: DType,
    op: ReduceOp,
    scalar: u64,
    flags: u32,
    n: usize,
    output: DevicePtr,
    l: &Lists,
) -> Result<()> {
    let receives = l.recvs.iter().any(|r| r.is_some_and(|(m, _)| m > 0));
    let out = receives.then_some((n, output));
    // After `unalias`, staged sends lie outside the heap, so a call that
    // needed staging takes the inbox way on every rank.
    let l = unalias(s, dtype, l, out)?;
    let mut c = CollectiveCall::new(kind, dtype, op, n, DevicePtr::NULL, output);
    c.per_peer = l.table(0);
    c.scalar = scalar;
    c.flags = flags;
    if kind == KernelKind::ReduceToDirect {
        let heap = direct_heap(s)?;
        c.table = heap.peer_bases_table();
        c.flags |= if sends_in_place(heap, dtype, &l, out, s.inner.rank) {
            PARAM_DIRECT_OK
        } else {
            0
        };
    }
    enqueue(s, &c)
}

/// The heap the direct kinds need (the planner picks them only with one).
fn direct_heap<'a, D: Device>(s: &'a Submit<'_, D>) -> Result<&'a Heap<D>> {
    s.res
        .heap
        .as_ref()
        .ok_or_else(|| Error::invalid("a direct kind was planned without a symmetric heap"))
}

/// Whether every block this rank receives from a peer can be written in
/// place by it: in its heap and clear of what it sends (the kernel falls
/// back on every rank if one rank's cannot).
fn receives_in_place<D: Device>(heap: &Heap<D>, dtype: DType, l: &Lists, me: usize) -> bool {
    let es = dtype.size() as u64;
    let span = |(n, p): (usize, DevicePtr)| (p.0, p.0 + n as u64 * es);
    l.recvs.iter().enumerate().all(|(r, recv)| match *recv {
        _ if r == me => true,
        None | Some((0, _)) => true,
        Some((n, p)) => {
            let (r0, r1) = span((n, p));
            heap.offset_of(p, n * dtype.size()).is_some()
                && !l.sends.iter().flatten().any(|&send| {
                    let (s0, s1) = span(send);
                    s0 < s1 && s0 < r1 && r0 < s1
                })
        }
    })
}

/// Whether every block this rank sends a peer can be read in place by it:
/// in its heap, clear of this rank's output (which it writes while peers
/// read), and aligned to its element, as are its own block and its output
/// (the direct kernel reads and writes them where they are; the inbox way
/// realigns them). Its own block may be its output (in place: each element
/// is read before the same thread writes it) or clear of it. The kernel
/// falls back on every rank if one rank's cannot.
fn sends_in_place<D: Device>(
    heap: &Heap<D>,
    dtype: DType,
    l: &Lists,
    output: Option<(usize, DevicePtr)>,
    me: usize,
) -> bool {
    let es = dtype.size() as u64;
    let span = |(n, p): (usize, DevicePtr)| (p.0, p.0 + n as u64 * es);
    let meet = |a: (usize, DevicePtr), b: (usize, DevicePtr)| {
        let ((a0, a1), (b0, b1)) = (span(a), span(b));
        a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
    };
    let aligned = |(n, p): (usize, DevicePtr)| n == 0 || p.0 % es == 0;
    let clear_of_output = |send: (usize, DevicePtr)| output.is_none_or(|out| !meet(send, out));
    output.is_none_or(aligned)
        && l.sends.iter().enumerate().all(|(q, send)| match *send {
            None | Some((0, _)) => true,
            Some(own) if q == me => aligned(own) && (output == Some(own) || clear_of_output(own)),
            Some((m, p)) => aligned((m, p)) && heap.offset_of(p, m * dtype.size()).is_some() && clear_of_output((m, p)),
        })
}

/// Send blocks a receive block (or the reduce-to's output) overlaps, other
/// than in the protocol's safe way, go through the staging buffer first.
///
/// The kernels overwrite piece `b` of chunk `c` of a receive block (or of the
/// output) only after block `b` pushed the same piece of the same pair's send
/// block, so a receive block that *is* its own pair's send block (all-to-all
/// in place with equal splits; an all-gather whose input is its own part; a
/// reduce-to whose output is its own send block) is safe. Any other overlap
/// (lists whose tensors alias another peer's) could be overwritten before it
/// is pushed: those sends are copied to the staging buffer first. Our own
/// receive block, when it is our own send block, is never written (the
/// kernel skips that copy). GPUs only: the host reference keeps reading the
/// caller's memory as it always did.
pub(super) fn unalias<D: Device>(
    s: &mut Submit<'_, D>,
    dtype: DType,
    l: &Lists,
    output: Option<(usize, DevicePtr)>,
) -> Result<Lists> {
    if s.inner.device.facts().backend == BackendKind::Host {
        return Ok(l.clone());
    }
    let es = dtype.size() as u64;
    let span = |(n, p): (usize, DevicePtr)| (p.0, p.0 + n as u64 * es);
    let meet = |a: (usize, DevicePtr), b: (usize, DevicePtr)| {
        let ((a0, a1), (b0, b1)) = (span(a), span(b));
        a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
    };
    let me = s.inner.rank;
    let aliased = l.sends.iter().enumerate().any(|(q, send)| {
        let Some(send) = *send else { return false };
        match output {
            // Reduce-to: the output is written, once, with every source's piece.
            Some(out) => meet(send, out) && !(q == me && send == out),
            None => l
                .recvs
                .iter()
                .enumerate()
                .filter(|&(r, _)| !(r == me && l.sends[me] == l.recvs[me]))
                .any(|(r, recv)| recv.is_some_and(|recv| meet(send, recv) && !(q == r && send == recv))),
        }
    });
    if !aliased {
        return Ok(l.clone());
    }
    let blocks: Vec<usize> = l.sends.iter().map(|e| e.map_or(0, |(n, _)| n * dtype.size())).collect();
    let mut at = Vec::with_capacity(blocks.len());
    let mut end = 0usize;
    for &b in &blocks {
        at.push(end);
        end = (end + b).next_multiple_of(256);
    }
    let base = staging_at(s, end.max(1))?;
    let mut staged = l.clone();
    for (q, e) in l.sends.iter().enumerate() {
        if let Some((n, from)) = *e {
            let to = base.offset(at[q]);
            s.inner.device.copy_device(to, from, n * dtype.size(), s.stream)?;
            staged.sends[q] = Some((n, to));
        }
    }
    Ok(staged)
}

/// An exchange through NCCL/RCCL: every block, our own among them, as one
/// group of sends and receives.
pub(super) fn vendor_exchange<D: Device>(s: &mut Submit<'_, D>, dtype: DType, mut l: Lists, me: usize) -> Result<()> {
    // This rank's own block stays in the library's group, which copies it
    // beside the peers' blocks: a copy of its own ahead of the group
    // serialised with it (2x H200, all-to-all of 16 MiB a peer: 72 us
    // against 64 us in the group). In place there is nothing to move.
    match (l.sends[me], l.recvs[me]) {
        (Some((_, from)), Some((_, to))) if from != to => {}
        _ => {
            l.sends[me] = None;
            l.recvs[me] = None;
        }
    }
    let world = s.inner.world;
    if (0..world).all(|q| l.sends[q].is_none() && l.recvs[q].is_none()) {
        return Ok(());
    }
    let (sends, recvs) = (&l.sends[..world], &l.recvs[..world]);
    // A receive that lands where a send still reads (all-to-all in place)
    // races inside the library's group: stage the sends first.
    let es = dtype.size() as u64;
    let span = |(n, p): (usize, DevicePtr)| (p.0, p.0 + n as u64 * es);
    let overlap = sends.iter().flatten().any(|&a| {
        let (a0, a1) = span(a);
        recvs.iter().flatten().any(|&b| {
            let (b0, b1) = span(b);
            a0 < b1 && b0 < a1
        })
    });
    run_vendor_staged(s, dtype, VendorOp::Exchange { sends, recvs }, overlap)
}

/// NCCL/RCCL for `op`, through the staging buffer when one of its GPU
/// addresses is not aligned to its element: NCCL's kernels load whole
/// elements and fault on such addresses (CUDA_ERROR_MISALIGNED_ADDRESS), so
/// the inputs are copied to aligned places, the library runs there, and the
/// outputs are copied back, all on the call's stream.
pub(super) fn run_vendor<D: Device>(s: &mut Submit<'_, D>, dtype: DType, op: VendorOp<'_>) -> Result<()> {
    run_vendor_staged(s, dtype, op, false)
}

/// [`run_vendor`], through the staging buffer also when `force` is set.
fn run_vendor_staged<D: Device>(s: &mut Submit<'_, D>, dtype: DType, mut op: VendorOp<'_>, force: bool) -> Result<()> {
    if s.capturing {
        s.res.vendor.note_capture();
    }
    let es = dtype.size();
    let odd = |p: DevicePtr| p.0 % es as u64 != 0;
    let (world, rank) = (s.inner.world, s.inner.rank);
    let host = s.inner.device.facts().backend == BackendKind::Host;
    let aligned = match &mut op {
        VendorOp::Exchange { sends, recvs } => sends.iter().chain(recvs.iter()).flatten().all(|(_, p)| !odd(*p)),
        single => single
            .buffers_mut()
            .is_some_and(|(send, recv)| !odd(*send) && !odd(*recv)),
    };
    if host || (aligned && !force) {
        return s.res.vendor.run(&s.inner.device, s.stream, dtype, op);
    }
    // Each block at its own 256-byte aligned place in the staging buffer.
    let place = |sizes: &[usize]| -> (Vec<usize>, usize) {
        let mut at = Vec::with_capacity(sizes.len());
        let mut end = 0usize;
        for &b in sizes {
            at.push(end);
            end = (end + b).next_multiple_of(256);
        }
        (at, end)
    };
    if let VendorOp::Exchange { sends, recvs } = op {
        let blocks: Vec<usize> = sends
            .iter()
            .chain(recvs.iter())
            .map(|e| e.map_or(0, |(n, _)| n * es))
            .collect();
        let (at, need) = place(&blocks);
        let base = staging_at(s, need)?;
        let moved = |list: &[Option<(usize, DevicePtr)>], first: usize| -> Vec<Option<(usize, DevicePtr)>> {
            list.iter()
                .enumerate()
                .map(|(q, e)| e.map(|(n, _)| (n, base.offset(at[first + q]))))
                .collect()
        };
        let (staged_sends, staged_recvs) = (moved(sends, 0), moved(recvs, sends.len()));
        for (e, st) in sends.iter().zip(&staged_sends) {
            if let (Some((n, from)), Some((_, to))) = (e, st) {
                s.inner.device.copy_device(*to, *from, n * es, s.stream)?;
            }
        }
        s.res.vendor.run(
            &s.inner.device,
            s.stream,
            dtype,
            VendorOp::Exchange {
                sends: &staged_sends,
                recvs: &staged_recvs,
            },
        )?;
        for (e, st) in recvs.iter().zip(&staged_recvs) {
            if let (Some((n, to)), Some((_, from))) = (e, st) {
                s.inner.device.copy_device(*to, *from, n * es, s.stream)?;
            }
        }
        return Ok(());
    }
    let (read, written) = op.extents(es, rank, world);
    let name = op.name();
    let Some((send, recv)) = op.buffers_mut() else {
        return Err(Error::Unsupported(format!(
            "{name}: no single input and output to stage"
        )));
    };
    let (orig_send, orig_recv) = (*send, *recv);
    // An input the caller already staged (a list reduce-scatter) stays where
    // it is; the output goes after it.
    let current = s.res.staging.as_ref().map(|b| (b.ptr(), b.len()));
    let in_staging = current
        .filter(|&(b, len)| orig_send.0 >= b.0 && orig_send.0 + read as u64 <= b.0 + len as u64)
        .map(|(b, _)| (orig_send.0 - b.0) as usize);
    let (at, need) = place(&[in_staging.map_or(read, |o| o + read), written]);
    if in_staging.is_some() && current.is_some_and(|(_, len)| len < need) {
        // Growing would drop the staged input: its stager reserves room.
        return Err(Error::Unsupported(format!(
            "{name}: the staging buffer holds the input and has no room for the output"
        )));
    }
    let base = staging_at(s, need)?;
    *send = base.offset(in_staging.unwrap_or(at[0]));
    *recv = base.offset(at[1]);
    if read > 0 && in_staging.is_none() {
        s.inner.device.copy_device(*send, orig_send, read, s.stream)?;
    }
    let staged_recv = *recv;
    s.res.vendor.run(&s.inner.device, s.stream, dtype, op)?;
    if written > 0 {
        s.inner.device.copy_device(orig_recv, staged_recv, written, s.stream)?;
    }
    Ok(())
}

/// Copy the blocks `srcs` (each `bytes`) back to back into the
/// communicator's staging buffer, at least `capacity` bytes (grown on
/// demand; not while capturing).
pub(super) fn stage_padded<D: Device>(
    s: &mut Submit<'_, D>,
    srcs: &[DevicePtr],
    bytes: usize,
    capacity: usize,
) -> Result<DevicePtr> {
    let base = staging_at(s, capacity.max(bytes * srcs.len()))?;
    for (k, src) in srcs.iter().enumerate() {
        s.inner
            .device
            .copy_device(base.offset(k * bytes), *src, bytes, s.stream)?;
    }
    Ok(base)
}

/// The communicator's staging buffer, at least `need` bytes (grown on
/// demand; not while capturing).
pub(super) fn staging_at<D: Device>(s: &mut Submit<'_, D>, need: usize) -> Result<DevicePtr> {
    let fits = s.res.staging.as_ref().is_some_and(|b| b.len() >= need);
    if !fits {
        if s.capturing {
            return Err(Error::Unsupported(
                "this call goes through the staging buffer on a GPU (a list reduce-scatter, or memory not \
                 aligned to its element), and the staging buffer cannot grow inside a graph capture: make one \
                 eager call of this size first, or pass aligned, contiguous tensors"
                    .into(),
            ));
        }
        // Powers of two, so that what is retired stays below what is in use.
        let grown = s
            .inner
            .device
            .alloc(need.next_power_of_two(), crate::device::MemKind::Plain)?;
        // Calls queued earlier, on this stream or another, may still read or
        // write the old one: it is freed with the communicator.
        if let Some(old) = s.res.staging.replace(grown) {
            s.res.retired.push(old);
        }
    }
    Ok(s.res.staging.as_ref().map_or(DevicePtr::NULL, |b| b.ptr()))
}
