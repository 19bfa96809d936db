//! The reduction rule of [`crate::dtype`] over whole tiles, for the host
//! kernels: each source tile is widened to the accumulator type (f32, or i32
//! for i32), combined in rank order, finished (avg) and narrowed once. The
//! loops run over plain slices with the operator fixed outside them, so the
//! compiler vectorizes them; the bits are exactly those of the per-element
//! rule (`Element::combine` and friends), which the tests below check.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::device::{DevicePtr, MAX_RANKS};
use crate::dtype::{Element, ReduceOp};

/// Elements per tile: the accumulator and one source tile stay in L1.
pub(super) const TILE: usize = 2048;

/// How the host kernels widen, combine and narrow one element type.
pub(super) trait Lanes: Element<Acc = <Self as Lanes>::A> {
    type A: Accumulate;
    /// An all-zero element (every element type here is plain bits).
    const ZERO: Self;
    /// `acc[i] = widen(src[i])`.
    fn widen(src: &[Self], acc: &mut [Self::A]);
    /// `dst[i] = narrow(acc[i])`, rounding as `Element::from_acc` does.
    fn narrow(acc: &[Self::A], dst: &mut [Self]);
}

/// Accumulator arithmetic over slices, one loop per operator.
pub(super) trait Accumulate: Copy + Default {
    /// `acc[i] = acc[i] (op) x[i]`.
    fn combine(op: ReduceOp, acc: &mut [Self], x: &[Self]);
    /// premul_sum's scaling of one widened source tile: `x[i] * factor`.
    fn premul(x: &mut [Self], factor: f32);
    /// The final step of avg: `acc[i] / world`.
    fn finish(op: ReduceOp, acc: &mut [Self], world: usize);
}

impl Accumulate for f32 {
    #[inline(always)]
    fn combine(op: ReduceOp, acc: &mut [f32], x: &[f32]) {
        let pairs = acc.iter_mut().zip(x);
        match op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum => pairs.for_each(|(a, x)| *a += *x),
            ReduceOp::Prod => pairs.for_each(|(a, x)| *a *= *x),
            // f32::min/max return the non-NaN operand, like CUDA's fminf/fmaxf.
            ReduceOp::Min => pairs.for_each(|(a, x)| *a = a.min(*x)),
            ReduceOp::Max => pairs.for_each(|(a, x)| *a = a.max(*x)),
            // Not defined for floats (DType::supports refuses them first).
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {}
        }
    }

    #[inline(always)]
    fn premul(x: &mut [f32], factor: f32) {
        x.iter_mut().for_each(|x| *x *= factor);
    }

    #[inline(always)]
    fn finish(op: ReduceOp, acc: &mut [f32], world: usize) {
        if op == ReduceOp::Avg {
            let w = world as f32;
            acc.iter_mut().for_each(|a| *a /= w);
        }
    }
}

impl Accumulate for i32 {
    #[inline(always)]
    fn combine(op: ReduceOp, acc: &mut [i32], x: &[i32]) {
        let pairs = acc.iter_mut().zip(x);
        match op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum => pairs.for_each(|(a, x)| *a = a.wrapping_add(*x)),
            ReduceOp::Prod => pairs.for_each(|(a, x)| *a = a.wrapping_mul(*x)),
            ReduceOp::Min => pairs.for_each(|(a, x)| *a = (*a).min(*x)),
            ReduceOp::Max => pairs.for_each(|(a, x)| *a = (*a).max(*x)),
            ReduceOp::BAnd => pairs.for_each(|(a, x)| *a &= *x),
            ReduceOp::BOr => pairs.for_each(|(a, x)| *a |= *x),
            ReduceOp::BXor => pairs.for_each(|(a, x)| *a ^= *x),
        }
    }

    #[inline(always)]
    fn premul(_x: &mut [i32], _factor: f32) {}

    #[inline(always)]
    fn finish(_op: ReduceOp, _acc: &mut [i32], _world: usize) {}
}

impl Lanes for f32 {
    type A = f32;
    const ZERO: f32 = 0.0;
    #[inline(always)]
    fn widen(src: &[f32], acc: &mut [f32]) {
        acc.copy_from_slice(src);
    }
    #[inline(always)]
    fn narrow(acc: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(acc);
    }
}

impl Lanes for i32 {
    type A = i32;
    const ZERO: i32 = 0;
    #[inline(always)]
    fn widen(src: &[i32], acc: &mut [i32]) {
        acc.copy_from_slice(src);
    }
    #[inline(always)]
    fn narrow(acc: &[i32], dst: &mut [i32]) {
        dst.copy_from_slice(acc);
    }
}

impl Lanes for f16 {
    type A = f32;
    const ZERO: f16 = f16::ZERO;
    // `half`'s slice conversions pick the same instructions (F16C where the
    // CPU has it) as its scalar ones, which `Element` uses: same bits.
    fn widen(src: &[f16], acc: &mut [f32]) {
        src.convert_to_f32_slice(acc);
    }
    fn narrow(acc: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(acc);
    }
}

/// `half::bf16::to_f32`, without branches (a NaN gets its quiet bit set).
#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    let b = b as u32;
    let quiet = if b & 0x7FFF > 0x7F80 { 0x40 } else { 0 };
    f32::from_bits((b | quiet) << 16)
}

/// `half::bf16::from_f32` (round to nearest even; a NaN keeps its high
/// mantissa bits and gets its quiet bit set), without branches.
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let x = x.to_bits();
    let truncated = x >> 16;
    let round_up = (x & 0x8000 != 0) && (x & 0x17FFF != 0);
    let rounded = truncated + round_up as u32;
    let nan = x & 0x7FFF_FFFF > 0x7F80_0000;
    (if nan { truncated | 0x40 } else { rounded }) as u16
}

impl Lanes for bf16 {
    type A = f32;
    const ZERO: bf16 = bf16::ZERO;
    #[inline(always)]
    fn widen(src: &[bf16], acc: &mut [f32]) {
        acc.iter_mut()
            .zip(src)
            .for_each(|(a, s)| *a = bf16_bits_to_f32(s.to_bits()));
    }
    #[inline(always)]
    fn narrow(acc: &[f32], dst: &mut [bf16]) {
        dst.iter_mut()
            .zip(acc)
            .for_each(|(d, a)| *d = bf16::from_bits(f32_to_bf16_bits(*a)));
    }
}

/// An operator with premul_sum's factor of every source rank (each rank
/// scales its own input by its own factor; 1.0 for every other op).
#[derive(Debug, Clone, Copy)]
pub(super) struct Reduction {
    pub(super) op: ReduceOp,
    pub(super) factors: [f32; MAX_RANKS],
}

impl From<ReduceOp> for Reduction {
    fn from(op: ReduceOp) -> Self {
        Reduction {
            op,
            factors: [1.0; MAX_RANKS],
        }
    }
}

/// Reusable tiles for one reduction.
pub(super) struct Tiles<T: Lanes> {
    acc: Vec<T::A>,
    wide: Vec<T::A>,
    elems: Vec<T>,
}

impl<T: Lanes> Tiles<T> {
    pub(super) fn new() -> Self {
        Tiles {
            acc: vec![T::A::default(); TILE],
            wide: vec![T::A::default(); TILE],
            elems: vec![T::ZERO; TILE],
        }
    }

    /// Reduce `n` elements: element `i` of the result is the rank-order
    /// reduction of element `i` of every `srcs[r]`, stored as element `i` of
    /// every `outs` buffer. `world` divides for avg; `factor` scales every
    /// source first for premul_sum.
    ///
    /// # Safety
    /// Every `srcs` range of `n` elements is live, every `outs` range live and
    /// writable; any alignment. An output may equal a source (in place): each
    /// tile is read whole before it is written.
    pub(super) unsafe fn reduce(
        &mut self,
        red: Reduction,
        world: usize,
        srcs: &[DevicePtr],
        n: usize,
        outs: &[DevicePtr],
    ) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked); the rest is the caller's contract.
            return unsafe { self.reduce_avx2(red, world, srcs, n, outs) };
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.reduce_body(red, world, srcs, n, outs) }
    }

    /// The same loops compiled for AVX2 (the baseline x86-64 target has only
    /// SSE2). Only vector width changes: no fused multiply-add, same bits.
    ///
    /// # Safety
    /// As [`Tiles::reduce`], on a CPU with AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn reduce_avx2(&mut self, red: Reduction, world: usize, srcs: &[DevicePtr], n: usize, outs: &[DevicePtr]) {
        // SAFETY: forwarded from the caller.
        unsafe { self.reduce_body(red, world, srcs, n, outs) }
    }

    /// # Safety
    /// As [`Tiles::reduce`].
    #[inline(always)]
    unsafe fn reduce_body(&mut self, red: Reduction, world: usize, srcs: &[DevicePtr], n: usize, outs: &[DevicePtr]) {
        let (op, factors) = (red.op, red.factors);
        let size = std::mem::size_of::<T>();
        let mut start = 0;
        while start < n {
            let len = TILE.min(n - start);
            let (acc, wide, elems) = (&mut self.acc[..len], &mut self.wide[..len], &mut self.elems[..len]);
            for (r, src) in srcs.iter().enumerate() {
                // SAFETY: the caller guarantees `n` live elements at `src`; the
                // tile holds `len` of them (a byte copy: any alignment).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.offset(start * size).0 as *const u8,
                        elems.as_mut_ptr() as *mut u8,
                        len * size,
                    )
                };
                if r == 0 {
                    T::widen(elems, acc);
                    if op == ReduceOp::PreMulSum {
                        T::A::premul(acc, factors[r]);
                    }
                } else {
                    T::widen(elems, wide);
                    if op == ReduceOp::PreMulSum {
                        T::A::premul(wide, factors[r]);
                    }
                    T::A::combine(op, acc, wide);
                }
            }
            T::A::finish(op, acc, world);
            T::narrow(acc, elems);
            for out in outs {
                // SAFETY: the caller guarantees `n` live, writable elements at `out`.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        elems.as_ptr() as *const u8,
                        out.offset(start * size).0 as *mut u8,
                        len * size,
                    )
                };
            }
            start += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_conversions_match_half() {
        for b in 0..=u16::MAX {
            let want = bf16::from_bits(b).to_f32().to_bits();
            assert_eq!(bf16_bits_to_f32(b).to_bits(), want, "bits {b:#06x}");
        }
        // Every exponent and sign with many mantissas: the rounding bits, ties,
        // carries into the exponent, infinities and NaNs.
        let mut x: u32 = 0;
        loop {
            let f = f32::from_bits(x);
            assert_eq!(f32_to_bf16_bits(f), bf16::from_f32(f).to_bits(), "bits {x:#010x}");
            match x.checked_add(0x1_0001 + (x & 0xFF)) {
                Some(next) => x = next,
                None => break,
            }
        }
        for x in [
            0x7F80_0000u32,
            0x7F80_0001,
            0xFFC0_0000,
            0x7FFF_FFFF,
            0x3F80_8000,
            0x3F81_8000,
            0x7F7F_FFFF,
        ] {
            let f = f32::from_bits(x);
            assert_eq!(f32_to_bf16_bits(f), bf16::from_f32(f).to_bits(), "bits {x:#010x}");
        }
    }

    /// The tile loops against `Element`'s per-element rule, for every op.
    fn check<T: Lanes>(values: impl Fn(usize, usize) -> T) {
        let world = 3;
        let n = TILE + 77;
        let factors = [0.3f32, -1.5, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0];
        for op in ReduceOp::ALL.into_iter().filter(|&op| T::DTYPE.supports(op)) {
            let srcs: Vec<Vec<T>> = (0..world).map(|r| (0..n).map(|i| values(r, i)).collect()).collect();
            let x = |r: usize, i: usize| {
                let x = srcs[r][i].to_acc();
                if op == ReduceOp::PreMulSum {
                    T::premul(x, factors[r])
                } else {
                    x
                }
            };
            let want: Vec<T> = (0..n)
                .map(|i| {
                    let acc = (1..world).fold(x(0, i), |a, r| T::combine(op, a, x(r, i)));
                    T::from_acc(T::finish(op, acc, world))
                })
                .collect();
            let mut out = vec![T::ZERO; n + 1];
            let ptrs: Vec<DevicePtr> = srcs.iter().map(|s| DevicePtr(s.as_ptr() as u64)).collect();
            // An output at an odd address: the misaligned path.
            let out_at = DevicePtr(out.as_mut_ptr() as u64 + 1);
            // SAFETY: every source holds n elements; the output n + 1.
            unsafe { Tiles::<T>::new().reduce(Reduction { op, factors }, world, &ptrs, n, &[out_at]) };
            let mut got = vec![T::ZERO; n];
            // SAFETY: reading back the n elements written at out_at.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    out_at.0 as *const u8,
                    got.as_mut_ptr() as *mut u8,
                    n * std::mem::size_of::<T>(),
                )
            };
            for i in 0..n {
                assert_eq!(
                    got[i].to_bits_u64(),
                    want[i].to_bits_u64(),
                    "{} {op} element {i}",
                    T::DTYPE
                );
            }
        }
    }

    fn wild(r: usize, i: usize) -> f32 {
        let h = (r as u32).wrapping_mul(0x9E37_79B9) ^ (i as u32).wrapping_mul(0x85EB_CA6B);
        match i % 11 {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => -0.0,
            3 => f32::from_bits(h & 0x807F_FFFF), // subnormal
            _ => f32::from_bits(h % 0x4F00_0000) * if h & 1 == 0 { 1.0 } else { -1.0 },
        }
    }

    #[test]
    fn tiles_match_the_element_rule() {
        check::<f32>(wild);
        check::<f16>(|r, i| f16::from_f32(wild(r, i)));
        check::<bf16>(|r, i| bf16::from_f32(wild(r, i)));
        check::<i32>(|r, i| wild(r, i).to_bits() as i32);
    }
}
