//! The NVFP4 output format of the fused epilogues (docs/protocol.md,
//! "NVFP4 outputs"): e2m1 values two per byte, one e4m3 scale factor per 16
//! contiguous elements of a row, and a global f32 scale. Here are the
//! format's definitions as the host twin (`backends/host/fused.rs`) and the
//! unfused reference (`testing::fused_nvfp4`) use them; `fu_nvfp4_*` in
//! `kernels-cuda/fused.cu` are their device twins, bit for bit.

use std::fmt;

use crate::codec::Fp8Flavor;

/// Elements that share one scale factor.
pub const NVFP4_BLOCK: usize = 16;
/// Largest magnitude of e2m1.
pub const E2M1_MAX: f32 = 6.0;
/// Rows of one swizzled scale-factor tile (TensorRT-LLM's 128x4 layout).
pub const SF_TILE_ROWS: usize = 128;
/// Scale-factor columns of one swizzled tile.
pub const SF_TILE_COLS: usize = 4;

/// Where the scale factors of an NVFP4 output go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SfLayout {
    /// FlashInfer's `SWIZZLED_128x4` (`FP4QuantizationSFLayout`): tiles of
    /// 128 rows x 4 scale factors, 512 bytes each, as Blackwell's
    /// block-scaled GEMMs read them; rows and columns padded to whole tiles.
    #[default]
    Swizzled128x4,
    /// Row-major `[tokens, hidden / 16]`.
    Linear,
}

impl SfLayout {
    /// Both layouts.
    pub const ALL: [SfLayout; 2] = [SfLayout::Swizzled128x4, SfLayout::Linear];

    /// The name in messages and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            SfLayout::Swizzled128x4 => "swizzled",
            SfLayout::Linear => "linear",
        }
    }

    /// The device-code constant (`FU_SF_*` in `fused.cu`).
    pub(crate) const fn code(self) -> u64 {
        match self {
            SfLayout::Swizzled128x4 => 0,
            SfLayout::Linear => 1,
        }
    }

    /// The layout of a device-code constant (anything else: swizzled, as
    /// the kernels read it).
    pub(crate) const fn from_code(code: u64) -> SfLayout {
        if code == 1 {
            SfLayout::Linear
        } else {
            SfLayout::Swizzled128x4
        }
    }

    /// Bytes of the scale factors of `tokens` rows of `hidden` elements
    /// (FlashInfer's `compute_fp4_swizzled_layout_sf_size` when swizzled:
    /// rows rounded up to 128, columns to 4).
    pub const fn sf_bytes(self, tokens: usize, hidden: usize) -> usize {
        let cols = hidden / NVFP4_BLOCK;
        match self {
            SfLayout::Swizzled128x4 => tokens.div_ceil(SF_TILE_ROWS) * SF_TILE_ROWS * cols.div_ceil(SF_TILE_COLS) * SF_TILE_COLS,
            SfLayout::Linear => tokens * cols,
        }
    }

    /// Byte offset of the scale factor of row `m`, block column `k`, in a
    /// tensor of `cols` scale factors a row. Swizzled: the tile `(m / 128,
    /// k / 4)`, tiles row-major with `ceil(cols / 4)` a tile row; inside a
    /// tile, `(m % 32) * 16 + ((m % 128) / 32) * 4 + k % 4`.
    pub const fn offset(self, m: usize, k: usize, cols: usize) -> usize {
        match self {
            SfLayout::Swizzled128x4 => {
                let tile = SF_TILE_ROWS * SF_TILE_COLS;
                (m / SF_TILE_ROWS) * cols.div_ceil(SF_TILE_COLS) * tile
                    + (k / SF_TILE_COLS) * tile
                    + (m % 32) * 16
                    + ((m % SF_TILE_ROWS) / 32) * 4
                    + k % SF_TILE_COLS
            }
            SfLayout::Linear => m * cols + k,
        }
    }
}

impl fmt::Display for SfLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// e2m1 code of `q` (sign in bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
/// at codes 0..=7): round to nearest, ties to the even code, saturate to
/// 6 (infinities too), the sign kept (zero included); NaN gives 0x7
/// (`cvt.rn.satfinite.e2m1x2.f32`'s positive maximum).
pub fn e2m1(q: f32) -> u8 {
    if q.is_nan() {
        return 0x7;
    }
    let a = q.abs();
    let mag = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    mag | if q.is_sign_negative() { 0x8 } else { 0 }
}

/// The scale factor of a block and the factor its values are multiplied by
/// (TensorRT-LLM's `cvt_warp_fp16_to_fp4`, every step correctly rounded
/// where it takes approximate reciprocals): `sf = e4m3(gs * (amax * (1 /
/// 6)))`, `out = f32(sf) != 0 ? 1 / (f32(sf) * (1 / gs)) : 0`.
pub fn block_scale(amax: f32, global_scale: f32) -> (u8, f32) {
    let sf = Fp8Flavor::E4m3Fn.encode(global_scale * (amax * (1.0f32 / E2M1_MAX)));
    let v = Fp8Flavor::E4m3Fn.decode(sf);
    let out = if v != 0.0 { 1.0 / (v * (1.0 / global_scale)) } else { 0.0 };
    (sf, out)
}

/// Quantize one block of 16 values (the normed values as stored, as f32):
/// `amax = fmax over |y| from 0` (a NaN loses), then [`block_scale`], then
/// `e2m1(y * out)`; element `2i` in the low nibble of byte `i`. Returns the
/// 8 packed bytes and the scale factor.
pub fn quantize_block(y: &[f32], global_scale: f32) -> ([u8; NVFP4_BLOCK / 2], u8) {
    debug_assert_eq!(y.len(), NVFP4_BLOCK);
    let amax = y.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (sf, out) = block_scale(amax, global_scale);
    let mut bytes = [0u8; NVFP4_BLOCK / 2];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = e2m1(y[2 * i] * out) | e2m1(y[2 * i + 1] * out) << 4;
    }
    (bytes, sf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_rounds_to_nearest_even_and_saturates() {
        let cases = [
            (0.0, 0),
            (0.25, 0),
            (0.26, 1),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.01, 7),
            (1e9, 7),
            (f32::INFINITY, 7),
            (-0.0, 8),
            (-1.5, 0xb),
            (f32::NEG_INFINITY, 0xf),
            (f32::NAN, 7),
        ];
        for (q, code) in cases {
            assert_eq!(e2m1(q), code, "{q}");
        }
    }

    #[test]
    fn swizzled_offsets_and_sizes() {
        let l = SfLayout::Swizzled128x4;
        // 130 rows of 48 elements: 3 columns padded to 4, 2 tiles of rows.
        assert_eq!(l.sf_bytes(130, 48), 256 * 4);
        assert_eq!(SfLayout::Linear.sf_bytes(130, 48), 390);
        assert_eq!(l.offset(0, 0, 3), 0);
        assert_eq!(l.offset(0, 3, 3), 3);
        assert_eq!(l.offset(1, 0, 3), 16);
        assert_eq!(l.offset(32, 0, 3), 4);
        assert_eq!(l.offset(127, 2, 3), 31 * 16 + 3 * 4 + 2);
        assert_eq!(l.offset(128, 0, 3), 512);
        // 8 columns: the second tile of a tile row follows the first.
        assert_eq!(l.offset(0, 4, 8), 512);
        assert_eq!(l.offset(129, 5, 8), 2 * 512 + 512 + 16 + 1);
        // Every offset of a shape is distinct and inside the padded size.
        let (rows, cols) = (300, 7);
        let mut seen = vec![false; l.sf_bytes(rows, cols * 16)];
        for m in 0..rows {
            for k in 0..cols {
                let o = l.offset(m, k, cols);
                assert!(!seen[o]);
                seen[o] = true;
            }
        }
    }

    #[test]
    fn a_block_quantizes_against_its_maximum() {
        let mut y = [0f32; 16];
        y[0] = 6.0;
        y[1] = -3.0;
        y[2] = 0.5;
        // gs 1: sf = e4m3(1.0) = 0x38, values divided by 1.
        let (bytes, sf) = quantize_block(&y, 1.0);
        assert_eq!(sf, 0x38);
        assert_eq!(bytes[0], 0x7 | 0xd << 4);
        assert_eq!(bytes[1], 0x1);
        // A zero block: sf 0, every value times 0.
        assert_eq!(quantize_block(&[0.0; 16], 448.0 * 6.0), ([0; 8], 0));
        // A NaN global scale: sf is the NaN code, values NaN -> 0x7.
        let (bytes, sf) = quantize_block(&y, f32::NAN);
        assert_eq!((bytes[0], sf), (0x77, 0x7f));
    }
}
