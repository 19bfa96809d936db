use std::path::Path;

use super::codes::{nccl_dtype, nccl_op};
use super::premul::factor_bytes;
use super::{CclFlavor, CclLibrary};
use crate::dtype::{DType, ReduceOp};
use crate::error::Error;

#[test]
fn dtype_and_op_codes_match_nccl_h() {
    assert_eq!(nccl_dtype(DType::F32), 7);
    assert_eq!(nccl_dtype(DType::F16), 6);
    assert_eq!(nccl_dtype(DType::BF16), 9);
    assert_eq!(nccl_dtype(DType::I32), 2);
    assert_eq!(nccl_op(ReduceOp::Sum).ok(), Some(0));
    assert_eq!(nccl_op(ReduceOp::Prod).ok(), Some(1));
    assert_eq!(nccl_op(ReduceOp::Max).ok(), Some(2));
    assert_eq!(nccl_op(ReduceOp::Min).ok(), Some(3));
    assert_eq!(nccl_op(ReduceOp::Avg).ok(), Some(4));
}

/// The half-precision factor is the one nearest (ties to even) to the
/// f32 factor the kernels and the host reference scale by, found here
/// by search: every finite f16 for a few factors, and for bf16 the two
/// neighbours the f32's upper bits give, over many factors (half's
/// `bf16::from_f64` rounds about 1 in 20,000 of them otherwise).
#[test]
fn half_factors_round_like_the_kernels() {
    fn nearest(x: f32, candidates: impl Iterator<Item = u16>, to_f32: impl Fn(u16) -> f32) -> u16 {
        let mut best: Option<(f64, u16)> = None;
        for bits in candidates {
            let v = to_f32(bits);
            if !v.is_finite() {
                continue;
            }
            let d = (v as f64 - x as f64).abs();
            let better = match best {
                None => true,
                Some((bd, bb)) => d < bd || (d == bd && bits & 1 == 0 && bb & 1 == 1),
            };
            if better {
                best = Some((d, bits));
            }
        }
        best.map_or(0, |(_, b)| b)
    }
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for k in 0..60_000u64 {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        // Positive factors over many binades, with all 52 fraction bits.
        let f = f64::from_bits((state >> 12) | 0x3ff0_0000_0000_0000) * 2f64.powi((k % 30) as i32 - 15);
        let single = f as f32;
        let b = factor_bytes(f, DType::BF16).unwrap();
        let upper = (single.to_bits() >> 16) as u16;
        let want = nearest(single, [upper, upper + 1].into_iter(), |b| {
            half::bf16::from_bits(b).to_f32()
        });
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), want, "bf16 factor of {f:e}");
        if k < 40 {
            let h = factor_bytes(f, DType::F16).unwrap();
            let want = nearest(single, 0..=u16::MAX, |b| half::f16::from_bits(b).to_f32());
            assert_eq!(u16::from_le_bytes([h[0], h[1]]), want, "f16 factor of {f:e}");
        }
    }
}

#[test]
fn a_missing_library_is_an_error_not_a_panic() {
    let e = CclLibrary::load_path(CclFlavor::Nccl, Path::new("/nonexistent/ferrocomm/libnccl.so.2"));
    assert!(matches!(e, Err(Error::LibraryMissing { .. })), "{:?}", e.err());
    let e = CclLibrary::load_path(CclFlavor::Rccl, Path::new("librccl-does-not-exist.so.1"));
    assert!(matches!(e, Err(Error::LibraryMissing { .. })), "{:?}", e.err());
}

#[test]
fn a_library_without_the_api_is_refused() {
    // libc loads but exports no NCCL symbols.
    let e = CclLibrary::load_path(CclFlavor::Nccl, Path::new("libc.so.6"));
    match e {
        Err(Error::LibraryMissing { reason, .. }) => assert!(reason.contains("ncclGetVersion"), "{reason}"),
        other => panic!("expected LibraryMissing, got {:?}", other.err()),
    }
}
