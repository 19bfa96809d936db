//! Host twins of `kernels-cuda/ep.cu`, written against [`DevCtx`] as the
//! kernels are written against the device API. Each runs as the kernel's
//! only block (the host launches a grid of 1), on the rank's stream thread,
//! so a rank's epoch counts one signal per peer and call.

use half::bf16;

use super::layout::{COUNT_BITS, FLAG_COMBINE, FLAG_DISPATCH, FLAG_EPOCH, FLAG_PLAIN, FLAG_SEEN};
use super::{EpArgs, PAYLOAD_FP8};
use crate::algo::layout::MAX_BLOCKS;
use crate::backends::host::heap_kernels::args_of;
use crate::device::{DevicePtr, MAX_RANKS};
use crate::heap::Cmp;

/// A twin: gets the kernel's argument struct as bytes.
type Twin = unsafe fn(&[u8]);

/// `(name, twin)` of every kernel of the EP module.
pub const TWINS: [(&str, Twin); 7] = [
    ("fc_ep_layout", layout),
    ("fc_ep_dispatch", dispatch),
    ("fc_ep_dispatch_layout", dispatch_layout),
    ("fc_ep_combine_ll", combine_ll),
    // Only the order the sums take their units in differs.
    ("fc_ep_combine_ll_take", combine_ll),
    ("fc_ep_combine", combine),
    ("fc_ep_combine_reduce", combine_reduce),
];

/// Blocks of the host "grid": one.
const GRID: u64 = 1;

/// # Safety
/// `p` points to a readable `T` (any alignment).
unsafe fn load<T: Copy>(p: DevicePtr) -> T {
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::read_unaligned(p.0 as *const T) }
}

/// # Safety
/// `p` points to writable memory of this rank for a `T` (any alignment).
unsafe fn store<T: Copy>(p: DevicePtr, v: T) {
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::write_unaligned(p.0 as *mut T, v) }
}

fn flag(a: &EpArgs, word: usize) -> DevicePtr {
    a.flags.offset(8 * word)
}

/// The destination bit of one top-k id (the kernels' `dest_bit`): rank
/// `e / per_rank`; none for ids below 0 or at or past `num_experts`.
fn dest_bit(a: &EpArgs, e: i32) -> u32 {
    if e >= 0 && (e as u32) < a.num_experts {
        1 << (e as u32 / a.per_rank)
    } else {
        0
    }
}

/// The ranks token `t` goes to (one token of the kernels' `chunk_masks`).
///
/// # Safety
/// `a.topk_idx` holds `num_tokens * topk` i32.
unsafe fn dest_mask(a: &EpArgs, t: usize) -> u32 {
    let mut mask = 0;
    for k in 0..a.topk as usize {
        // SAFETY: inside the caller's topk_idx (t < num_tokens).
        let e: i32 = unsafe { load(a.topk_idx.offset(4 * (t * a.topk as usize + k))) };
        mask |= dest_bit(a, e);
    }
    mask
}

/// Bump the epoch; slot of each token at each rank, in token order; counts.
///
/// # Safety
/// `args` is an [`EpArgs`] whose pointers the host API checked: the heap
/// regions of a live EP buffer and the caller's tensors.
unsafe fn layout(args: &[u8]) {
    // SAFETY: forwarded from the caller.
    let a: EpArgs = unsafe { args_of(args) };
    let me = a.ctx.rank as usize;
    a.ctx.atomic_add(me, flag(&a, FLAG_EPOCH), 1);
    let mut counts = [0i32; MAX_RANKS];
    for t in 0..a.num_tokens as usize {
        // SAFETY: t < num_tokens.
        let mask = unsafe { dest_mask(&a, t) };
        for (r, count) in counts.iter_mut().enumerate() {
            let slot = if r < a.ctx.world as usize && mask & (1 << r) != 0 {
                *count += 1;
                *count - 1
            } else {
                -1
            };
            // SAFETY: slots holds [max][MAX_RANKS] i32 and t < num_tokens <= max.
            unsafe { store(a.slots.offset(4 * (t * MAX_RANKS + r)), slot) };
        }
    }
    for (r, &c) in counts.iter().enumerate() {
        // SAFETY: send_counts holds MAX_RANKS i32.
        unsafe { store(a.send_counts.offset(4 * r), c) };
    }
}

/// Put every token's row (scales, ids, weights, index) into each
/// destination's region for this source, the counts, signal, then wait for
/// every source of this epoch and keep its count (the combine's copy).
///
/// # Safety
/// As [`layout`].
unsafe fn dispatch(args: &[u8]) {
    // SAFETY: forwarded from the caller.
    let a: EpArgs = unsafe { args_of(args) };
    let (me, world) = (a.ctx.rank as usize, a.ctx.world as usize);
    let epoch = a.ctx.atomic_fetch(me, flag(&a, FLAG_EPOCH));
    let (k, rb) = (a.topk as usize, a.row_bytes as usize);
    let scale_bytes = 4 * a.scale_cols as usize;
    let mut ids = vec![0i32; k];
    let mut weights = vec![0u32; k];
    for t in 0..a.num_tokens as usize {
        for r in 0..world {
            // SAFETY: slots holds [max][MAX_RANKS] i32, written by layout.
            let slot: i32 = unsafe { load(a.slots.offset(4 * (t * MAX_RANKS + r))) };
            if slot < 0 {
                continue;
            }
            let row = me * a.max_tokens as usize + slot as usize;
            // SAFETY (every put below): the sources are the caller's rows
            // (t < num_tokens) or local vectors of the lengths given; the
            // destinations are rows of the receive regions (row < world * max).
            unsafe { a.ctx.put(r, a.recv_x.offset(row * rb), a.x.offset(t * rb), rb as u64) };
            if a.payload == PAYLOAD_FP8 {
                // SAFETY: as above.
                unsafe {
                    a.ctx.put(
                        r,
                        a.recv_scales.offset(row * scale_bytes),
                        a.scales.offset(t * scale_bytes),
                        scale_bytes as u64,
                    )
                };
            }
            for j in 0..k {
                // SAFETY: inside the caller's top-k tensors.
                let (e, w): (i32, u32) = unsafe {
                    (
                        load(a.topk_idx.offset(4 * (t * k + j))),
                        load(a.topk_weights.offset(4 * (t * k + j))),
                    )
                };
                let mine = dest_bit(&a, e) == 1 << r; // the layout's own test, as in the kernel
                ids[j] = if mine {
                    (e as u32 - r as u32 * a.per_rank) as i32
                } else {
                    -1
                };
                weights[j] = if mine { w } else { 0 };
            }
            let host = |v: *const u8| DevicePtr(v as u64);
            let src = t as i32;
            // SAFETY: as above.
            unsafe {
                a.ctx.put(
                    r,
                    a.recv_idx.offset(4 * row * k),
                    host(ids.as_ptr().cast()),
                    4 * k as u64,
                );
                a.ctx.put(
                    r,
                    a.recv_weights.offset(4 * row * k),
                    host(weights.as_ptr().cast()),
                    4 * k as u64,
                );
                a.ctx
                    .put(r, a.recv_src.offset(4 * row), host((&src as *const i32).cast()), 4);
            }
        }
    }
    // The one block's word (block 0) for this source, at every rank, with
    // the rows sent there.
    let mark = epoch << COUNT_BITS;
    for r in 0..world {
        // SAFETY: send_counts holds MAX_RANKS i32, written by layout.
        let sends: i32 = unsafe { load(a.send_counts.offset(4 * r)) };
        a.ctx
            .signal_set(r, flag(&a, FLAG_DISPATCH + me * MAX_BLOCKS), mark | sends.max(0) as u64);
    }
    for s in 0..world {
        // A deadline or a failed communicator: the error words say so; the
        // later waits give up at once, and the combine sends nothing back.
        let word = flag(&a, FLAG_DISPATCH + s * MAX_BLOCKS);
        let n = if a.ctx.wait_until(word, Cmp::Ge, mark, s) {
            // SAFETY: a flag word of this rank; its source writes it again
            // only after this rank's next combine (see the protocol).
            let seen: u64 = unsafe { load(word) };
            seen & ((1 << COUNT_BITS) - 1)
        } else {
            0
        };
        // SAFETY: recv_counts holds MAX_RANKS i32 and the flag words are
        // this rank's, which only its own stream writes.
        unsafe {
            store(a.recv_counts.offset(4 * s), n as i32);
            store(flag(&a, FLAG_SEEN + s), n);
        }
    }
}

/// Send received rows back to their sources, signal, wait for every rank's
/// plain combine so far.
///
/// # Safety
/// As [`layout`].
unsafe fn combine(args: &[u8]) {
    // SAFETY: forwarded from the caller.
    let a: EpArgs = unsafe { args_of(args) };
    let (me, world) = (a.ctx.rank as usize, a.ctx.world as usize);
    let (max, h) = (a.max_tokens as usize, a.hidden as usize);
    let rb = 2 * h;
    let plain = a.ctx.atomic_add(me, flag(&a, FLAG_PLAIN), 1) + 1;
    for s in 0..world {
        // SAFETY: a flag word of this rank: the dispatch's copy of recv_counts.
        let n: u64 = unsafe { load(flag(&a, FLAG_SEEN + s)) };
        for i in 0..n as usize {
            let row = s * max + i;
            // SAFETY: recv_src holds world * max i32.
            let tok: i32 = unsafe { load(a.recv_src.offset(4 * row)) };
            if tok < 0 || tok as usize >= max {
                continue;
            }
            // SAFETY: expert_out holds world * max rows (checked by the host
            // API); the inbox row is inside the region.
            unsafe {
                a.ctx.put(
                    s,
                    a.inbox.offset((me * max + tok as usize) * rb),
                    a.x.offset(row * rb),
                    rb as u64,
                )
            };
        }
    }
    for r in 0..world {
        a.ctx.signal_add(r, flag(&a, FLAG_COMBINE + me), 1);
    }
    for r in 0..world {
        a.ctx.wait_until(flag(&a, FLAG_COMBINE + r), Cmp::Ge, plain * GRID, r);
    }
}

/// The dispatch that finds its own layout: the layout, then the dispatch.
///
/// # Safety
/// As [`layout`].
unsafe fn dispatch_layout(args: &[u8]) {
    // SAFETY: forwarded from the caller.
    unsafe {
        layout(args);
        dispatch(args);
    }
}

/// The one-kernel combine. On GPUs its rows travel as Lamport packs and a
/// token's row at this rank is read where it lies; the twin keeps the plain
/// combine's data flow (puts, the flag wait, then the sums), which gives the
/// same results and leaves the inbox as empty.
///
/// # Safety
/// As [`layout`].
unsafe fn combine_ll(args: &[u8]) {
    // SAFETY: forwarded from the caller.
    unsafe {
        combine(args);
        combine_reduce(args);
    }
}

/// Sum each token's rows from the inbox over the ranks it went to, in rank
/// order (after [`combine`] on the stream), and fill the rows read with 0xff
/// again (the inbox is empty between calls, as the kernels keep it).
///
/// # Safety
/// As [`layout`].
unsafe fn combine_reduce(args: &[u8]) {
    // SAFETY: forwarded from the caller.
    let a: EpArgs = unsafe { args_of(args) };
    let world = a.ctx.world as usize;
    let (max, h) = (a.max_tokens as usize, a.hidden as usize);
    let rb = 2 * h;
    let mut acc = vec![0f32; h];
    for t in 0..a.num_tokens as usize {
        let mut first = true;
        for r in 0..world {
            // SAFETY: slots holds [max][MAX_RANKS] i32, written by layout.
            let slot: i32 = unsafe { load(a.slots.offset(4 * (t * MAX_RANKS + r))) };
            if slot < 0 {
                continue;
            }
            let row = a.inbox.offset((r * max + t) * rb);
            for (c, v) in acc.iter_mut().enumerate() {
                // SAFETY: inside the inbox region, this rank's own.
                let x = unsafe {
                    let x = bf16::from_bits(load::<u16>(row.offset(2 * c))).to_f32();
                    store(row.offset(2 * c), u16::MAX);
                    x
                };
                *v = if first { x } else { *v + x };
            }
            first = false;
        }
        let out = a.out.offset(t * rb);
        for (c, v) in acc.iter().enumerate() {
            let bits = if first { 0 } else { bf16::from_f32(*v).to_bits() };
            // SAFETY: out holds num_tokens rows (checked by the host API).
            unsafe { store(out.offset(2 * c), bits) };
        }
    }
}
