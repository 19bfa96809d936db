//! FP4 e2m1 (OCP MX): a sign bit, 2 exponent bits (bias 1) and 1 mantissa
//! bit; the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 are codes 0..7 and bit 3
//! is the sign. No Inf, no NaN, a signed zero.
//!
//! Encoding rounds to nearest, ties to the even code, saturates to +-6 (as
//! `cvt.rn.satfinite.e2m1x2.f32` does) and keeps the sign, zero included (as
//! e4m3fn does). Like `fp8.rs` it searches the magnitudes, so it is
//! obviously right; the device code reaches the same codes by arithmetic.

/// Largest magnitude.
pub(crate) const MAX: f32 = 6.0;

/// The magnitude of each code 0..7.
const MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Value of a 4-bit code (the high bits of `code` are ignored).
pub(crate) fn decode(code: u8) -> f32 {
    let mag = MAGNITUDES[(code & 7) as usize];
    if code & 8 != 0 {
        -mag
    } else {
        mag
    }
}

/// Round `v` (not NaN) to the nearest code, ties to even, saturating.
pub(crate) fn encode(v: f32) -> u8 {
    let a = v.abs();
    // First magnitude >= a.
    let hi = MAGNITUDES.partition_point(|&m| m < a);
    let code = if hi >= MAGNITUDES.len() {
        7 // saturate (satfinite)
    } else if hi == 0 || MAGNITUDES[hi] == a {
        hi
    } else {
        let (d_lo, d_hi) = (a - MAGNITUDES[hi - 1], MAGNITUDES[hi] - a);
        if d_lo < d_hi || (d_lo == d_hi && (hi - 1) % 2 == 0) {
            hi - 1
        } else {
            hi
        }
    };
    let sign = if v.is_sign_negative() { 8 } else { 0 };
    code as u8 | sign
}
