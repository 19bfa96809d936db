//! Reference quantization codecs for quick-reduce. They define the wire
//! format: a GPU kernel's encoded bytes must equal these bit for bit.
//!
//! # Wire format
//!
//! Data is cut into blocks of `BLOCK` = 32 elements (the last one padded
//! with zeros). A block's codes (`Codec::code_bytes`) are one or two
//! planes (`Codec::planes`): INT4, FP4, INT8 and FP8 one (16, 16, 32, 32 bytes),
//! INT6 two (16 bytes of low nibbles, 8 bytes of high 2-bit parts). A run of
//! `B` blocks stores each plane of every block in turn, then `B`
//! little-endian 16-bit scales:
//!
//! ```text
//! [plane 0 of block 0] ... [plane 0 of block B-1]([plane 1 of block 0] ... [plane 1 of block B-1])[scale 0] ... [scale B-1]
//! ```
//!
//! Planes and scales are apart so the lanes of a GPU warp, 8 elements each,
//! touch contiguous memory. The scale has the input's 16-bit type (f16 for
//! f16, bf16 for bf16), so every scale a block can need is representable.
//!
//! # Encoding one block (all arithmetic in f32, round to nearest even)
//!
//! 1. If any element is NaN or +-Inf, the scale is the canonical NaN of the
//!    scale type and every code is 0: the whole block decodes to NaN. (A
//!    non-finite value never turns silently into a finite one.)
//! 2. `absmax = max |x_i|`.
//! 3. Integer codecs with `q` in `[-2^(b-1), 2^(b-1)-1]`: with `mx = max x_i`,
//!    `mn = min x_i`, `scale = round16(absmax / -2^(b-1))` (negative, as in
//!    AITER), or `round16(absmax / 2^(b-1))` when `-mn > mx`. Either way the
//!    largest-magnitude element maps exactly to the most negative code and
//!    only elements of the opposite sign can clamp (by at most one step).
//!    FP8: `scale = round16(absmax / FP8_MAX)` (448 for e4m3fn, 240 for e4m3fnuz).
//!    FP4: `scale = round16(absmax / 6)` (e2m1's largest value), positive.
//! 4. `s = f32(scale)`, `inv = 1.0f / s` (an f32 division). If `inv` is not
//!    finite (`s == 0`, or `s` so tiny that `1/s` overflows) the scale is stored
//!    as `+0` and every code is 0: the block decodes to 0.
//!    Otherwise `v_i = x_i * inv`, and
//!    - integer: `q_i = clamp(rint(v_i), qmin, qmax)` in `b`-bit two's
//!      complement. INT4 and INT8 pack element `i` at bit `b*i` of the block's
//!      codes (little-endian). INT6 splits each code: the low 4 bits of
//!      element `i` at bit `4i` of the first 16 bytes, the high 2 bits at bit
//!      `2i` of the last 8 (so a GPU thread holding 8 elements reads one
//!      aligned word of each, as AITER's INT6 does);
//!    - FP8: `q_i = e4m3(v_i)` rounded to nearest even, saturating to +-max.
//!    - FP4: `q_i = e2m1(v_i)` rounded to nearest, ties to the even code,
//!      saturating to +-6, the sign kept (a negative that rounds to zero is
//!      code 8, -0); packed like INT4, element `i` at bit `4i`.
//! 5. Decoding: `x'_i = f32(q_i) * s` (FP8, FP4: the code's value times `s`).
//!
//! # Error bounds (per element, finite input)
//!
//! With `s` the exact scale of the element's block and `r` its 16-bit
//! rounding (`Codec::error_bound`, which the unit tests check):
//! - INT-b: `|x - x'| <= |r| + 2^(b-1) |s - r|`: one code step (the `-absmax`
//!   side clamps) plus what rounding the scale costs.
//! - FP8 e4m3: `|x - x'| <= 2^-4 |x| + |r| min_subnormal / 2 + max |s - r|`.
//! - FP4 e2m1: `|x - x'| <= max(|x| / 4, |r| / 4) + 6 |s - r|`: half a step of
//!   the grid (0.5 below 2, 1 below 4, 2 up to 6) plus saturation.
//!
//! A scale that underflows the 16-bit type (tiny blocks, f16) decodes its
//! block to 0, which the `|s - r|` term covers.

mod fp4;
mod fp8;

pub use fp8::Fp8Flavor;

use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};

testing_pub! {
    /// Elements per block.
    pub const BLOCK: usize = 32;
}

/// A quick-reduce codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// FP8 e4m3 codes of the given flavour (8 bits per element).
    Fp8(Fp8Flavor),
    /// 8-bit integer codes.
    Int8,
    /// 6-bit integer codes.
    Int6,
    /// 4-bit integer codes.
    Int4,
    /// FP4 e2m1 codes (4 bits per element).
    Fp4,
}

impl Codec {
    /// The codec's name as `FromStr` and the algorithm names spell it
    /// (`fp8`, `fp8fnuz`, `int8`, `int6`, `int4`, `fp4`).
    pub fn name(self) -> &'static str {
        match self {
            Codec::Fp8(Fp8Flavor::E4m3Fn) => "fp8",
            Codec::Fp8(Fp8Flavor::E4m3Fnuz) => "fp8fnuz",
            Codec::Int8 => "int8",
            Codec::Int6 => "int6",
            Codec::Int4 => "int4",
            Codec::Fp4 => "fp4",
        }
    }

    /// Bits per code.
    pub(crate) const fn bits(self) -> usize {
        match self {
            Codec::Fp8(_) | Codec::Int8 => 8,
            Codec::Int6 => 6,
            Codec::Int4 | Codec::Fp4 => 4,
        }
    }

    /// Bytes of one block's codes (a multiple of 8; 16 for INT4 and FP4).
    pub(crate) const fn code_bytes(self) -> usize {
        BLOCK * self.bits() / 8
    }

    /// Bytes that `elems` elements encode to.
    pub const fn encoded_bytes(self, elems: usize) -> usize {
        elems.div_ceil(BLOCK) * (self.code_bytes() + 2)
    }

    /// Bytes of each plane of a block's codes (they add up to `code_bytes`).
    pub(crate) const fn planes(self) -> &'static [usize] {
        match self {
            Codec::Int6 => &[16, 8],
            Codec::Int4 | Codec::Fp4 => &[16],
            Codec::Int8 | Codec::Fp8(_) => &[32],
        }
    }

    /// Where block `k`'s codes lie in a run of `blocks` blocks: for each
    /// plane, (offset in the run, offset in the block's codes, length).
    pub(crate) fn code_ranges(self, blocks: usize, k: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let (mut run_at, mut block_at) = (0, 0);
        self.planes().iter().map(move |&len| {
            let r = (run_at + k * len, block_at, len);
            run_at += blocks * len;
            block_at += len;
            r
        })
    }

    /// Offset of block `k`'s scale in a run of `blocks` blocks.
    pub(crate) const fn scale_offset(self, blocks: usize, k: usize) -> usize {
        blocks * self.code_bytes() + 2 * k
    }

    fn int_range(self) -> Option<(i32, i32)> {
        match self {
            Codec::Int8 => Some((-128, 127)),
            Codec::Int6 => Some((-32, 31)),
            Codec::Int4 => Some((-8, 7)),
            Codec::Fp8(_) | Codec::Fp4 => None,
        }
    }

    /// The exact (unrounded) scale of a block with largest magnitude `absmax`.
    fn exact_scale(self, absmax: f32) -> f32 {
        match (self, self.int_range()) {
            (_, Some((qmin, _))) => absmax / qmin as f32,
            (Codec::Fp8(f), None) => absmax / f.max(),
            (Codec::Fp4, None) => absmax / fp4::MAX,
            _ => unreachable!("every codec is integer, fp8 or fp4"),
        }
    }

    /// The per-element bound on `|x - decode(encode(x))|` for a block whose
    /// largest magnitude is `absmax` (finite input), with scale type `S`.
    ///
    /// With `s` the exact scale and `r` its 16-bit rounding: INT-b gives at
    /// most one code step `|r|` (the clamped `-absmax` side) plus
    /// `2^(b-1) |s - r|`; FP8 gives half an e4m3 ulp (`2^-4 |x|`), half a
    /// subnormal step (`|r| * min_subnormal / 2`) and `max * |s - r|` where
    /// saturation bites; FP4 half a grid step (at most `max(|x|, |r|) / 4`)
    /// and `6 |s - r|`. An `r` that underflows to 0 decodes the block to 0.
    #[cfg(test)]
    pub(crate) fn error_bound<S: Half16>(self, absmax: f32, x: f32) -> f32 {
        let s = self.exact_scale(absmax);
        let r = S::from_f32(s).to_f32();
        let slack = x.abs() * 2f32.powi(-20);
        if !(1.0 / r).is_finite() {
            return absmax + slack; // the block decodes to 0
        }
        match (self, self.int_range()) {
            (_, Some((qmin, _))) => r.abs() + -(qmin as f32) * (s - r).abs() + slack,
            (Codec::Fp8(f), None) => {
                x.abs() * 2f32.powi(-4) + r.abs() * f.min_subnormal() / 2.0 + f.max() * (s - r).abs() + slack
            }
            (Codec::Fp4, None) => x.abs().max(r.abs()) / 4.0 + fp4::MAX * (s - r).abs() + slack,
            _ => unreachable!("every codec is integer, fp8 or fp4"),
        }
    }
}

impl std::str::FromStr for Codec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "fp8" | "e4m3" | "e4m3fn" => Ok(Codec::Fp8(Fp8Flavor::E4m3Fn)),
            "fp8fnuz" | "e4m3fnuz" => Ok(Codec::Fp8(Fp8Flavor::E4m3Fnuz)),
            "int8" => Ok(Codec::Int8),
            "int6" => Ok(Codec::Int6),
            "int4" => Ok(Codec::Int4),
            "fp4" | "e2m1" => Ok(Codec::Fp4),
            _ => Err(Error::invalid(format!(
                "unknown codec {s:?} (expected fp8, int8, int6, int4 or fp4)"
            ))),
        }
    }
}

/// The caller's quick-reduce choice (`CommOptions::quantization`,
/// `FERROCOMM_QUICK_REDUCE`). FP8 becomes the device's flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Quantization {
    /// No quick-reduce: all-reduce stays exact.
    #[default]
    None,
    /// FP8 e4m3 codes (the device's flavour).
    Fp8,
    /// 8-bit integer codes.
    Int8,
    /// 6-bit integer codes.
    Int6,
    /// 4-bit integer codes.
    Int4,
    /// FP4 e2m1 codes.
    Fp4,
}

impl Quantization {
    /// The codec for a backend: e4m3fnuz on AMD, e4m3fn elsewhere.
    pub fn codec(self, backend: crate::device::BackendKind) -> Option<Codec> {
        match self {
            Quantization::None => None,
            Quantization::Fp8 if backend == crate::device::BackendKind::Hip => Some(Codec::Fp8(Fp8Flavor::E4m3Fnuz)),
            Quantization::Fp8 => Some(Codec::Fp8(Fp8Flavor::E4m3Fn)),
            Quantization::Int8 => Some(Codec::Int8),
            Quantization::Int6 => Some(Codec::Int6),
            Quantization::Int4 => Some(Codec::Int4),
            Quantization::Fp4 => Some(Codec::Fp4),
        }
    }
}

impl std::str::FromStr for Quantization {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "none" | "off" | "0" => Ok(Quantization::None),
            "fp8" => Ok(Quantization::Fp8),
            "int8" => Ok(Quantization::Int8),
            "int6" => Ok(Quantization::Int6),
            "int4" => Ok(Quantization::Int4),
            "fp4" => Ok(Quantization::Fp4),
            _ => Err(Error::invalid(format!(
                "unknown quantization {s:?} (expected none, fp8, int8, int6, int4 or fp4)"
            ))),
        }
    }
}

testing_pub! {
    /// The 16-bit float types quick-reduce carries (input, output and scale).
    pub trait Half16: Copy + Send + Sync + 'static {
        /// The type's [`DType`].
        #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
        const DTYPE: DType;
        /// Widen to f32 (exact).
        fn to_f32(self) -> f32;
        /// Round an f32 to nearest even.
        fn from_f32(v: f32) -> Self;
        /// The type's bits.
        fn to_bits(self) -> u16;
        /// The value of bits `b`.
        fn from_bits(b: u16) -> Self;
        /// The canonical quiet NaN.
        const NAN_BITS: u16;
    }
}

impl Half16 for f16 {
    const DTYPE: DType = DType::F16;
    const NAN_BITS: u16 = 0x7E00;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_bits(self) -> u16 {
        f16::to_bits(self)
    }
    fn from_bits(b: u16) -> Self {
        f16::from_bits(b)
    }
}

impl Half16 for bf16 {
    const DTYPE: DType = DType::BF16;
    const NAN_BITS: u16 = 0x7FC0;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_bits(self) -> u16 {
        bf16::to_bits(self)
    }
    fn from_bits(b: u16) -> Self {
        bf16::from_bits(b)
    }
}

/// Round half to even in f32 (what `rintf` / `cvt.rni` do).
fn rint(v: f32) -> f32 {
    v.round_ties_even()
}

/// Where code `i` of a block lives: (byte, bit shift, width) pieces, low bits first.
fn code_pieces(codec: Codec, i: usize) -> [(usize, u32, u32); 2] {
    match codec {
        Codec::Int6 => [(i / 2, 4 * (i as u32 % 2), 4), (16 + i / 4, 2 * (i as u32 % 4), 2)],
        Codec::Int4 | Codec::Fp4 => [(i / 2, 4 * (i as u32 % 2), 4), (0, 0, 0)],
        _ => [(i, 0, 8), (0, 0, 0)],
    }
}

/// Encode one block of up to 32 values (already widened to f32) with scale type `S`.
/// Returns the scale bits; `codes` receives `code_bytes` bytes.
pub(crate) fn encode_block<S: Half16>(codec: Codec, x: &[f32], codes: &mut [u8]) -> u16 {
    debug_assert!(x.len() <= BLOCK && codes.len() == codec.code_bytes());
    codes.fill(0);
    if x.iter().any(|v| !v.is_finite()) {
        return S::NAN_BITS;
    }
    let mx = x.iter().fold(f32::MIN, |m, &v| m.max(v));
    let mn = x.iter().fold(f32::MAX, |m, &v| m.min(v));
    let absmax = mx.max(-mn);
    // The largest-magnitude element maps exactly to the most negative code,
    // so only its opposite side can clamp: flip the scale's sign when that
    // element is negative.
    let flip = codec.int_range().is_some() && -mn > mx;
    let exact = codec.exact_scale(absmax);
    let scale = S::from_f32(if flip { -exact } else { exact });
    let s = scale.to_f32();
    let inv = 1.0f32 / s;
    if !inv.is_finite() {
        return 0; // +0: a zero scale, or one so tiny that 1/s overflows f32
    }
    match codec.int_range() {
        Some((qmin, qmax)) => {
            for (i, v) in x.iter().enumerate() {
                let q = (rint(v * inv) as i32).clamp(qmin, qmax) as u32;
                let mut low = 0;
                for (byte, shift, width) in code_pieces(codec, i).into_iter().filter(|p| p.2 > 0) {
                    codes[byte] |= (((q >> low) & ((1 << width) - 1)) << shift) as u8;
                    low += width;
                }
            }
        }
        None => match codec {
            Codec::Fp8(f) => {
                for (i, v) in x.iter().enumerate() {
                    codes[i] = f.encode(v * inv);
                }
            }
            _ => {
                for (i, v) in x.iter().enumerate() {
                    codes[i / 2] |= fp4::encode(v * inv) << (4 * (i % 2));
                }
            }
        },
    }
    scale.to_bits()
}

/// Decode one block into f32 (what quick-reduce accumulates).
pub(crate) fn decode_block<S: Half16>(codec: Codec, codes: &[u8], scale_bits: u16, out: &mut [f32]) {
    let s = S::from_bits(scale_bits).to_f32();
    if s.is_nan() {
        out.fill(f32::NAN);
        return;
    }
    match codec {
        Codec::Fp8(f) => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f.decode(codes[i]) * s;
            }
        }
        Codec::Fp4 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = fp4::decode(codes[i / 2] >> (4 * (i % 2))) * s;
            }
        }
        _ => {
            let bits = codec.bits() as u32;
            for (i, o) in out.iter_mut().enumerate() {
                let mut raw = 0u32;
                let mut low = 0;
                for (byte, shift, width) in code_pieces(codec, i).into_iter().filter(|p| p.2 > 0) {
                    raw |= ((codes[byte] as u32 >> shift) & ((1 << width) - 1)) << low;
                    low += width;
                }
                let q = ((raw << (32 - bits)) as i32) >> (32 - bits); // sign-extend
                *o = q as f32 * s;
            }
        }
    }
}

testing_pub! {
    /// Encode a run of elements in the wire format (code planes, then scales).
    pub fn encode<S: Half16>(codec: Codec, input: &[S], out: &mut [u8]) -> Result<()> {
        let blocks = input.len().div_ceil(BLOCK);
        if out.len() != codec.encoded_bytes(input.len()) {
            return Err(Error::invalid(format!(
                "encoding {} elements with {} needs {} bytes, got {}",
                input.len(),
                codec.name(),
                codec.encoded_bytes(input.len()),
                out.len()
            )));
        }
        let mut x = [0f32; BLOCK];
        let mut codes = [0u8; 32];
        let codes = &mut codes[..codec.code_bytes()];
        for (b, chunk) in input.chunks(BLOCK).enumerate() {
            x.fill(0.0);
            for (xi, v) in x.iter_mut().zip(chunk) {
                *xi = v.to_f32();
            }
            let sb = encode_block::<S>(codec, &x, codes);
            for (run_at, block_at, len) in codec.code_ranges(blocks, b) {
                out[run_at..run_at + len].copy_from_slice(&codes[block_at..block_at + len]);
            }
            let at = codec.scale_offset(blocks, b);
            out[at..at + 2].copy_from_slice(&sb.to_le_bytes());
        }
        Ok(())
    }
}

/// Decode a run of `out.len()` elements (to f32) from the wire format.
#[cfg(test)]
pub(crate) fn decode<S: Half16>(codec: Codec, input: &[u8], out: &mut [f32]) -> Result<()> {
    let blocks = out.len().div_ceil(BLOCK);
    if input.len() != codec.encoded_bytes(out.len()) {
        return Err(Error::invalid(format!(
            "decoding {} elements with {} needs {} bytes, got {}",
            out.len(),
            codec.name(),
            codec.encoded_bytes(out.len()),
            input.len()
        )));
    }
    let mut codes = [0u8; 32];
    let codes = &mut codes[..codec.code_bytes()];
    for (b, chunk) in out.chunks_mut(BLOCK).enumerate() {
        for (run_at, block_at, len) in codec.code_ranges(blocks, b) {
            codes[block_at..block_at + len].copy_from_slice(&input[run_at..run_at + len]);
        }
        let at = codec.scale_offset(blocks, b);
        let sb = u16::from_le_bytes([input[at], input[at + 1]]);
        decode_block::<S>(codec, codes, sb, chunk);
    }
    Ok(())
}

#[cfg(test)]
mod tests;

/// The quick-reduce result, block by block, for inputs `inputs[rank]`: each
/// rank's block is quantized and decoded, summed in f32 in rank order,
/// rounded to `S`, quantized and decoded again, and rounded to `S`. Every
/// backend's quick-reduce must produce exactly this (blocks start at
/// multiples of [`BLOCK`], which the protocol's segments and chunks keep).
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub fn reference_all_reduce<S: Half16>(codec: Codec, inputs: &[&[S]]) -> Vec<S> {
    let n = inputs.first().map_or(0, |x| x.len());
    let mut out = Vec::with_capacity(n);
    let mut acc = [0f32; BLOCK];
    let mut dec = [0f32; BLOCK];
    let mut codes = vec![0u8; codec.code_bytes()];
    for start in (0..n).step_by(BLOCK) {
        let len = BLOCK.min(n - start);
        for (r, x) in inputs.iter().enumerate() {
            let mut blk = [0f32; BLOCK];
            for (b, v) in blk.iter_mut().zip(&x[start..start + len]) {
                *b = v.to_f32();
            }
            let sb = encode_block::<S>(codec, &blk, &mut codes);
            decode_block::<S>(codec, &codes, sb, &mut dec);
            for (a, d) in acc.iter_mut().zip(&dec) {
                *a = if r == 0 { *d } else { *a + *d };
            }
        }
        let mut mid = [0f32; BLOCK];
        for (m, a) in mid.iter_mut().zip(&acc).take(len) {
            *m = S::from_f32(*a).to_f32();
        }
        let sb = encode_block::<S>(codec, &mid, &mut codes);
        decode_block::<S>(codec, &codes, sb, &mut dec);
        out.extend(dec[..len].iter().map(|&d| S::from_f32(d)));
    }
    out
}
