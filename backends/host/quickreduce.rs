//! The host twin of `kernels-cuda/quickreduce.cu`: quick-reduce as
//! docs/quick-reduce.md lays it out (the same inboxes, runs, epochs and flags
//! as the GPU kernels, with a grid of one block), using `crate::codec` for
//! every block, so its bytes and its output are the reference.

use crate::algo::layout::{qr_chunking, qr_stride};
use crate::codec::{self, Codec, Half16, BLOCK};
use crate::device::{DevicePtr, KernelParams};

use super::kernels::{copy_bytes, Launch};

/// Read `n` elements at `ptr` (any alignment).
///
/// # Safety: `n` elements at `ptr` are live.
unsafe fn read_elems<S: Half16>(ptr: DevicePtr, n: usize) -> Vec<S> {
    let mut v = vec![S::from_bits(0); n];
    // SAFETY: the caller guarantees the source; the Vec holds n elements.
    unsafe { copy_bytes(DevicePtr(v.as_mut_ptr() as u64), ptr, n * 2) };
    v
}

/// Write `v` at `ptr` (any alignment).
///
/// # Safety: `v.len()` elements at `ptr` are live and writable.
unsafe fn write_elems<S: Half16>(ptr: DevicePtr, v: &[S]) {
    // SAFETY: the caller guarantees the destination.
    unsafe { copy_bytes(ptr, DevicePtr(v.as_ptr() as u64), v.len() * 2) };
}

/// A run in memory: codes of `blocks` blocks, then their scales.
#[derive(Clone, Copy)]
struct Run {
    at: DevicePtr,
    blocks: usize,
    codec: Codec,
}

impl Run {
    /// Encode `x` (up to 32 values; the rest are +0) as block `k`.
    ///
    /// # Safety: the run's memory is live and writable.
    unsafe fn put<S: Half16>(&self, k: usize, x: &[f32; BLOCK]) {
        let block = Encoded::of::<S>(self.codec, x);
        // SAFETY: forwarded from the caller.
        unsafe { self.put_encoded(k, &block) };
    }

    /// Store an encoded block as block `k`.
    ///
    /// # Safety: the run's memory is live and writable.
    unsafe fn put_encoded(&self, k: usize, block: &Encoded) {
        let (codes, scale) = (&block.codes, block.scale);
        // SAFETY: block k's code planes and scale lie inside the run.
        unsafe {
            for (run_at, block_at, len) in self.codec.code_ranges(self.blocks, k) {
                copy_bytes(
                    self.at.offset(run_at),
                    DevicePtr(codes[block_at..].as_ptr() as u64),
                    len,
                );
            }
            let s = scale.to_le_bytes();
            copy_bytes(
                self.at.offset(self.codec.scale_offset(self.blocks, k)),
                DevicePtr(s.as_ptr() as u64),
                2,
            );
        }
    }

    /// Load block `k`.
    ///
    /// # Safety: the run's memory is live.
    unsafe fn get(&self, k: usize) -> Encoded {
        let mut codes = [0u8; 32];
        let mut s = [0u8; 2];
        // SAFETY: block k's code planes and scale lie inside the run.
        unsafe {
            for (run_at, block_at, len) in self.codec.code_ranges(self.blocks, k) {
                copy_bytes(
                    DevicePtr(codes[block_at..].as_mut_ptr() as u64),
                    self.at.offset(run_at),
                    len,
                );
            }
            copy_bytes(
                DevicePtr(s.as_mut_ptr() as u64),
                self.at.offset(self.codec.scale_offset(self.blocks, k)),
                2,
            );
        }
        Encoded {
            codes,
            scale: u16::from_le_bytes(s),
        }
    }
}

/// One encoded block: its codes (the first `code_bytes`) and scale bits.
struct Encoded {
    codes: [u8; 32],
    scale: u16,
}

impl Encoded {
    fn of<S: Half16>(codec: Codec, x: &[f32; BLOCK]) -> Self {
        let mut codes = [0u8; 32];
        let scale = codec::encode_block::<S>(codec, x, &mut codes[..codec.code_bytes()]);
        Encoded { codes, scale }
    }

    /// Decoded values, in f32 (what the owner sums).
    fn values<S: Half16>(&self, codec: Codec) -> [f32; BLOCK] {
        let mut y = [0f32; BLOCK];
        codec::decode_block::<S>(codec, &self.codes[..codec.code_bytes()], self.scale, &mut y);
        y
    }

    /// Decoded values, rounded to `S` (what lands in the output).
    fn decode<S: Half16>(&self, codec: Codec) -> [S; BLOCK] {
        self.values::<S>(codec).map(S::from_f32)
    }
}

/// Widen up to 32 elements into a zero-padded block.
fn block_of<S: Half16>(x: &[S]) -> [f32; BLOCK] {
    let mut b = [0f32; BLOCK];
    for (o, v) in b.iter_mut().zip(x) {
        *o = v.to_f32();
    }
    b
}

/// Quick-reduce, chunk by chunk (chunk `c` with epoch `E + c`), the next
/// chunk's first stage overlapping this chunk's gather as on GPUs. Returns
/// the last epoch, or `None` after a failure.
///
/// # Safety: see `HostKernel::call`.
pub(super) unsafe fn all_reduce<S: Half16>(l: &Launch, codec: Codec) -> Option<u32> {
    let count = l.p.count as usize;
    let world = l.world();
    let me = l.me();
    let stride = qr_stride(l.slot_bytes(), world);
    // Codec blocks per segment, as the host side of the algorithm chose it.
    let capb = l.p.aux as usize;
    let (chunk, nchunk) = qr_chunking(count, world * BLOCK * capb, world);
    // (first element, elements, segment) of chunk c.
    let geometry = |c: usize| {
        let first = c * chunk;
        let n = chunk.min(count - first);
        (first, n, n.div_ceil(world).next_multiple_of(BLOCK))
    };
    let seg_range = |n: usize, seg: usize, r: usize| {
        let a = (r * seg).min(n);
        (a, (a + seg).min(n) - a)
    };
    let run = |rank: usize, l: &Launch, slot: usize, src: usize| Run {
        at: l.region(rank).offset(slot * l.slot_bytes() + src * stride),
        blocks: capb,
        codec,
    };
    // S1(c): our part of every segment d, encoded into inbox [me] of rank d.
    let stage1 = |c: usize| {
        let l = l.chunk(c);
        let (first, n, seg) = geometry(c);
        for k in 1..=world {
            let d = (me + k) % world;
            let (a, len) = seg_range(n, seg, d);
            // SAFETY: the input holds the chunk.
            let x = unsafe { read_elems::<S>(l.p.input.offset((first + a) * 2), len) };
            for (b, blk) in x.chunks(BLOCK).enumerate() {
                // SAFETY: a segment's blocks fit an inbox (capb blocks).
                unsafe { run(d, &l, 0, me).put::<S>(b, &block_of(blk)) };
            }
        }
        l.arrive(0);
    };
    stage1(0);
    for c in 0..nchunk {
        let l = l.chunk(c);
        let (first, n, seg) = geometry(c);
        let output = l.p.output.offset(first * 2);
        if !l.wait(0) {
            return None;
        }
        // S2: our segment: decode every inbox, sum in rank order, round, encode;
        // the decoded result to our output, the codes to every peer.
        let (a, len) = seg_range(n, seg, me);
        let mut out = Vec::with_capacity(len);
        for b in 0..len.div_ceil(BLOCK) {
            let valid = BLOCK.min(len - b * BLOCK);
            let mut acc = [0f32; BLOCK];
            for src in 0..world {
                // SAFETY: inbox [src] holds this segment's blocks.
                let y = unsafe { run(me, &l, 0, src).get(b) }.values::<S>(codec);
                for (a, y) in acc.iter_mut().zip(y) {
                    *a = if src == 0 { y } else { *a + y };
                }
            }
            let mut mid = [0f32; BLOCK];
            for (m, a) in mid.iter_mut().zip(acc).take(valid) {
                *m = S::from_f32(a).to_f32();
            }
            let block = Encoded::of::<S>(codec, &mid);
            for k in 1..world {
                // SAFETY: result slot [me] of every peer holds capb blocks.
                unsafe { run((me + k) % world, &l, 1, me).put_encoded(b, &block) };
            }
            out.extend_from_slice(&block.decode::<S>(codec)[..valid]);
        }
        // SAFETY: our segment lies inside the output chunk.
        unsafe { write_elems(output.offset(a * 2), &out) };
        l.arrive(1);
        if c + 1 < nchunk {
            stage1(c + 1);
        }
        if !l.wait(1) {
            return None;
        }
        // S3: every other segment, decoded from our result slot.
        for r in (0..world).filter(|&r| r != me) {
            let (a, len) = seg_range(n, seg, r);
            let mut out = Vec::with_capacity(len);
            for b in 0..len.div_ceil(BLOCK) {
                // SAFETY: result slot [r] holds segment r's blocks.
                let y = unsafe { run(me, &l, 1, r).get(b) }.decode::<S>(codec);
                out.extend_from_slice(&y[..BLOCK.min(len - b * BLOCK)]);
            }
            // SAFETY: segment r lies inside the output chunk.
            unsafe { write_elems(output.offset(a * 2), &out) };
        }
    }
    Some(l.epoch.wrapping_add(nchunk as u32 - 1))
}

/// `fc_qr_encode_*`: `p.count` elements of the input encoded into the output
/// as one run (`codec::encode`'s wire format).
///
/// # Safety: the input holds `p.count` elements and the output
/// `codec.encoded_bytes(p.count)` writable bytes.
pub(super) unsafe fn encode_run<S: Half16>(p: &KernelParams, codec: Codec) {
    let n = p.count as usize;
    // SAFETY: forwarded from the caller.
    let x = unsafe { read_elems::<S>(p.input, n) };
    let mut wire = vec![0u8; codec.encoded_bytes(n)];
    if codec::encode(codec, &x, &mut wire).is_ok() {
        // SAFETY: forwarded from the caller.
        unsafe { copy_bytes(p.output, DevicePtr(wire.as_ptr() as u64), wire.len()) };
    }
}
