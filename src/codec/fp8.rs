//! FP8 e4m3 in the two flavours quick-reduce meets: e4m3fn (NVIDIA, OCP: max
//! 448, NaN = 0x7F/0xFF, signed zero) and e4m3fnuz (MI300: max 240, bias 8,
//! NaN = 0x80, no negative zero).
//!
//! Encoding rounds to nearest, ties to the even code, and saturates to +-max
//! (`cvt.rn.satfinite.e4m3x2.f32` on Hopper). It is done by search over the
//! 127 positive codes, so it is obviously right rather than clever.

use std::sync::OnceLock;

/// Which e4m3 variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Flavor {
    /// OCP e4m3fn: bias 7, max 448, signed zero.
    E4m3Fn,
    /// e4m3fnuz: bias 8, max 240, 0x80 is NaN, no negative zero.
    E4m3Fnuz,
}

impl Fp8Flavor {
    /// Largest finite magnitude.
    pub(crate) fn max(self) -> f32 {
        match self {
            Fp8Flavor::E4m3Fn => 448.0,
            Fp8Flavor::E4m3Fnuz => 240.0,
        }
    }

    /// Smallest positive (subnormal) value.
    #[cfg(test)]
    pub(crate) fn min_subnormal(self) -> f32 {
        match self {
            Fp8Flavor::E4m3Fn => 2f32.powi(-9),
            Fp8Flavor::E4m3Fnuz => 2f32.powi(-10),
        }
    }

    fn bias(self) -> i32 {
        match self {
            Fp8Flavor::E4m3Fn => 7,
            Fp8Flavor::E4m3Fnuz => 8,
        }
    }

    /// Largest finite positive code.
    fn max_code(self) -> u8 {
        match self {
            Fp8Flavor::E4m3Fn => 0x7E,
            Fp8Flavor::E4m3Fnuz => 0x7F,
        }
    }

    /// Value of a code (NaN codes give NaN): [`Fp8Flavor::decode_exact`],
    /// looked up (the reference codecs decode every element of a test).
    pub(crate) fn decode(self, code: u8) -> f32 {
        static FN: OnceLock<[f32; 256]> = OnceLock::new();
        static FNUZ: OnceLock<[f32; 256]> = OnceLock::new();
        let cell = match self {
            Fp8Flavor::E4m3Fn => &FN,
            Fp8Flavor::E4m3Fnuz => &FNUZ,
        };
        cell.get_or_init(|| std::array::from_fn(|c| self.decode_exact(c as u8)))[code as usize]
    }

    /// Value of a code, from the format's definition.
    fn decode_exact(self, code: u8) -> f32 {
        let nan = match self {
            Fp8Flavor::E4m3Fn => code & 0x7F == 0x7F,
            Fp8Flavor::E4m3Fnuz => code == 0x80,
        };
        if nan {
            return f32::NAN;
        }
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let exp = ((code >> 3) & 0xF) as i32;
        let man = (code & 7) as f32;
        let mag = if exp == 0 {
            man * 2f32.powi(1 - self.bias() - 3)
        } else {
            (8.0 + man) * 2f32.powi(exp - self.bias() - 3)
        };
        sign * mag
    }

    /// The positive finite codes' values, ascending (index = code).
    fn table(self) -> &'static [f32] {
        static FN: OnceLock<Vec<f32>> = OnceLock::new();
        static FNUZ: OnceLock<Vec<f32>> = OnceLock::new();
        let cell = match self {
            Fp8Flavor::E4m3Fn => &FN,
            Fp8Flavor::E4m3Fnuz => &FNUZ,
        };
        cell.get_or_init(|| (0..=self.max_code()).map(|c| self.decode(c)).collect())
    }

    /// Round `v` to the nearest code (ties to even), saturating; NaN -> NaN code.
    pub(crate) fn encode(self, v: f32) -> u8 {
        if v.is_nan() {
            return match self {
                Fp8Flavor::E4m3Fn => 0x7F,
                Fp8Flavor::E4m3Fnuz => 0x80,
            };
        }
        let t = self.table();
        let a = v.abs();
        // First code whose value is >= a.
        let hi = t.partition_point(|&x| x < a);
        let code = if hi >= t.len() {
            self.max_code() // saturate (satfinite)
        } else if hi == 0 || t[hi] == a {
            hi as u8
        } else {
            let (lo_v, hi_v) = (t[hi - 1], t[hi]);
            let (d_lo, d_hi) = (a - lo_v, hi_v - a);
            if d_lo < d_hi || (d_lo == d_hi && (hi - 1) % 2 == 0) {
                (hi - 1) as u8
            } else {
                hi as u8
            }
        };
        let negative = v.is_sign_negative();
        match self {
            // fn keeps the sign, zero included (as the hardware conversion does).
            Fp8Flavor::E4m3Fn if negative => code | 0x80,
            // fnuz has no negative zero: 0x80 is NaN.
            Fp8Flavor::E4m3Fnuz if negative && code != 0 => code | 0x80,
            _ => code,
        }
    }
}
