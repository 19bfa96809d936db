//! NVFP4 outputs of the fused epilogues in the conformance suite: the
//! unfused reference's last step (the normed rows, as stored, quantized
//! block by block), the scale factors laid out as the call asks, its cases
//! (both layouts, with and without `norm_out`, rows that do not fill a
//! swizzled tile, columns that do not fill one) and its validation errors.

use half::{bf16, f16};

use super::conformance::{Suite, POISON};
use super::fused::{kind_algo, Case};
use crate::algo::fused::{FusedKind, FusionPattern};
use crate::algo::nvfp4::{quantize_block, SfLayout, NVFP4_BLOCK};
use crate::comm::{Call, Fusion};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The global scale the NVFP4 cases are given: `448 * 6 / 8`, FlashInfer's
/// `FP8_MAX * FP4_MAX / amax` for rows whose values reach 8, so scale
/// factors span e4m3's range and the largest saturate.
pub const NVFP4_GLOBAL_SCALE: f32 = 336.0;

/// Step 5 of the unfused reference for NVFP4, on the normed values as
/// stored (`tokens x hidden`, f32): for each row, each block of 16 in
/// order, `amax = max |y|` (from 0, NaN ignored), `sf = e4m3(gs * (amax *
/// (1/6)))`, `out = f32(sf) != 0 ? 1 / (f32(sf) * (1 / gs)) : 0`, codes
/// `e2m1(y * out)` (docs/protocol.md, "NVFP4 outputs"). Returns the packed
/// codes (element `2i` in the low nibble of byte `i`) and the scale factors
/// row-major (`tokens x hidden / 16`).
pub fn nvfp4_reference(normed: &[f32], global_scale: f32) -> (Vec<u8>, Vec<u8>) {
    let mut codes = Vec::with_capacity(normed.len() / 2);
    let mut sfs = Vec::with_capacity(normed.len() / NVFP4_BLOCK);
    for block in normed.chunks(NVFP4_BLOCK) {
        let (bytes, sf) = quantize_block(block, global_scale);
        codes.extend_from_slice(&bytes);
        sfs.push(sf);
    }
    (codes, sfs)
}

/// The row-major scale factors as `layout` stores them, every byte no row
/// owns (the swizzled tiles' padding) left as `pad`.
pub fn sf_in_layout(linear: &[u8], tokens: usize, hidden: usize, layout: SfLayout, pad: u8) -> Vec<u8> {
    let cols = hidden / NVFP4_BLOCK;
    let mut out = vec![pad; layout.sf_bytes(tokens, hidden)];
    for m in 0..tokens {
        for k in 0..cols {
            out[layout.offset(m, k, cols)] = linear[m * cols + k];
        }
    }
    out
}

/// The layout a conformance case asks for (both appear in every matrix:
/// the bf16 and f16 runs of a case flip `in_place`).
pub(super) fn case_layout(c: &Case) -> SfLayout {
    if c.in_place {
        SfLayout::Swizzled128x4
    } else {
        SfLayout::Linear
    }
}

/// (tokens, hidden) of the NVFP4 cases beyond the fused matrix: rows below,
/// at and past a swizzled tile (1, 127, 128, 130, 257), scale-factor
/// columns that fill no tile (1, 3, 5) or several (256).
const SHAPES: [(usize, usize); 6] = [(1, 16), (127, 48), (128, 80), (130, 48), (257, 4096), (3, 16)];

/// Only NVFP4's fused cases (its matrix, special rows, validation), e.g.
/// for a quick run on one backend; the whole suite runs them too.
pub fn run_fused_nvfp4<D: Device>(
    comm: &crate::comm::Communicator<D>,
    cfg: &super::conformance::SuiteConfig,
) -> Result<super::conformance::SuiteReport> {
    let mut s = Suite::new(comm, cfg);
    s.fused_nvfp4()?;
    Ok(s.report)
}

impl<D: Device> Suite<'_, D> {
    /// NVFP4's outputs of a fused call (buffers 5: the codes, 6: the
    /// global scale, 11: the scale factors, poisoned).
    pub(super) fn nvfp4_outputs(
        &mut self,
        f: Fusion,
        tokens: usize,
        hidden: usize,
        layout: SfLayout,
    ) -> Result<Fusion> {
        let quant = self.view(5, 0, DType::U8, tokens * hidden / 2, true)?;
        self.put(6, 0, &NVFP4_GLOBAL_SCALE.to_le_bytes())?;
        let scale = self.view(6, 0, DType::F32, 1, false)?;
        let sf = self.view(11, 0, DType::F8E4M3, layout.sf_bytes(tokens, hidden), true)?;
        Ok(f.with_nvfp4(quant, scale, sf, layout))
    }

    /// Check NVFP4's outputs against the reference's codes and row-major
    /// scale factors; the swizzled padding must be untouched.
    pub(super) fn check_nvfp4(
        &mut self,
        case: &str,
        codes: &[u8],
        sfs: &[u8],
        tokens: usize,
        hidden: usize,
        layout: SfLayout,
    ) -> Result<()> {
        let got = self.get(5, 0, codes.len())?;
        self.check_bytes(&format!("{case} quant_out"), &got, codes, true);
        let want = sf_in_layout(sfs, tokens, hidden, layout, POISON);
        let got = self.get(11, 0, want.len())?;
        self.check_bytes(&format!("{case} sf_out ({layout})"), &got, &want, true);
        Ok(())
    }

    /// The NVFP4 cases beyond the fused matrix (every kind, both layouts,
    /// with and without `norm_out`, both dtypes) and its validation errors.
    pub(super) fn fused_nvfp4(&mut self) -> Result<()> {
        for (k, &(tokens, hidden)) in SHAPES.iter().enumerate() {
            if !self.runs_size(tokens * hidden) {
                continue;
            }
            for kind in FusedKind::ALL_REDUCE {
                for in_place in [false, true] {
                    let case = Case {
                        kind,
                        pattern: FusionPattern::ResidualRmsNormNvfp4,
                        tokens,
                        hidden,
                        eps: 1e-6,
                        in_place,
                        with_allreduce_out: k % 2 == 0,
                        with_norm_out: (k + in_place as usize) % 2 == 0,
                        special: false,
                        moe: None,
                    };
                    self.fused_case::<bf16>(&case)?;
                    self.fused_case::<f16>(&Case {
                        with_norm_out: !case.with_norm_out,
                        ..case
                    })?;
                }
            }
        }
        // Special rows (NaN, infinity, zeros with eps 0, overflow).
        for kind in FusedKind::ALL_REDUCE {
            let case = Case {
                kind,
                pattern: FusionPattern::ResidualRmsNormNvfp4,
                tokens: 9,
                hidden: 64,
                eps: 0.0,
                in_place: kind != FusedKind::TwoShot,
                with_allreduce_out: true,
                with_norm_out: true,
                special: true,
                moe: None,
            };
            self.fused_case::<bf16>(&case)?;
            self.fused_case::<f16>(&Case {
                in_place: !case.in_place,
                ..case
            })?;
        }
        self.fused_graph_replay_of(&super::fused::NVFP4_GRAPH_RUNS)?;
        self.fused_nvfp4_validation()
    }

    /// Every NVFP4 argument error, raised before anything is launched.
    fn fused_nvfp4_validation(&mut self) -> Result<()> {
        let comm = self.comm;
        let (tokens, hidden) = (3, 48);
        let n = tokens * hidden;
        // No view is poisoned: every call is refused before anything is
        // queued, and nothing may be left queued on buffers the suite frees.
        let bf = DType::BF16;
        let res_in = self.view(1, 0, bf, n, false)?;
        let res_out = self.view(2, 0, bf, n, false)?;
        let input = self.view(0, 0, bf, n, false)?;
        let weight = self.view(3, 0, bf, hidden, false)?;
        let quant = self.view(5, 0, DType::U8, n / 2, false)?;
        let quant_wide = self.view(5, 0, DType::U8, n, false)?;
        let q8 = self.view(5, 0, DType::F8E4M3, n, false)?;
        let gs = self.view(6, 0, DType::F32, 1, false)?;
        let scales = self.view(6, 0, DType::F32, tokens, false)?;
        let swz = SfLayout::Swizzled128x4;
        let sf = self.view(11, 0, DType::F8E4M3, swz.sf_bytes(tokens, hidden), false)?;
        let sf_linear = self.view(11, 0, DType::U8, SfLayout::Linear.sf_bytes(tokens, hidden), false)?;
        let sf_f16 = self.view(11, 0, DType::F16, swz.sf_bytes(tokens, hidden), false)?;
        let base = Fusion::new(FusionPattern::ResidualRmsNormNvfp4, hidden, res_in, res_out).with_norm(weight, 1e-6);
        let cases: Vec<(&str, Fusion, &str)> = vec![
            ("no sf_out", base.with_quant(quant, gs), "sf_out are required"),
            (
                "hidden not a multiple of 16",
                Fusion {
                    hidden: 24,
                    ..base.with_nvfp4(quant, gs, sf, swz)
                },
                "multiple of 16 for NVFP4",
            ),
            (
                "linear size for swizzled",
                base.with_nvfp4(quant, gs, sf_linear, swz),
                "sf_out must be 512",
            ),
            (
                "swizzled size for linear",
                base.with_nvfp4(quant, gs, sf, SfLayout::Linear),
                "sf_out must be 9",
            ),
            (
                "f16 scale factors",
                base.with_nvfp4(quant, gs, sf_f16, swz),
                "f8e4m3 or u8",
            ),
            (
                "quant_out one byte per element",
                base.with_nvfp4(quant_wide, gs, sf, swz),
                "two e2m1 values a byte",
            ),
            (
                "a scale per token",
                base.with_nvfp4(quant, scales, sf, swz),
                "the global scale",
            ),
            (
                "sf_out on FP8",
                Fusion {
                    pattern: FusionPattern::ResidualRmsNormFp8,
                    sf_out: Some(sf),
                    ..base.with_quant(q8, gs)
                },
                "does not use it",
            ),
        ];
        let rank = comm.rank();
        for (what, f, want) in cases {
            let case = format!("fused nvfp4 validation: {what} rank={rank}");
            self.report.collectives += 1;
            match comm.all_reduce_fused(input, &f, &Call::new().algo(kind_algo(FusedKind::OneShot))) {
                Err(Error::InvalidArgument(m)) if m.contains(want) => {}
                Err(e) => self.fail(format!("{case}: wrong error {e}")),
                Ok(w) => {
                    w.wait(Some(self.cfg.timeout))?;
                    self.fail(format!("{case}: accepted"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swizzled_padding_keeps_the_pad_byte() {
        let linear: Vec<u8> = (0..130 * 3).map(|i| i as u8).collect();
        let out = sf_in_layout(&linear, 130, 48, SfLayout::Swizzled128x4, 0xAA);
        assert_eq!(out.len(), 256 * 4);
        // Column 3 of every row and every row past 130 are padding.
        assert_eq!(out[3], 0xAA);
        assert_eq!(out[512 + 2 * 16], 0xAA);
        assert_eq!(out[512 + 16 + 2], linear[129 * 3 + 2]);
        assert_eq!(sf_in_layout(&linear, 130, 48, SfLayout::Linear, 0), linear);
    }

    #[test]
    fn reference_packs_low_nibble_first() {
        let mut y = vec![0f32; 32];
        y[0] = 6.0;
        y[17] = -6.0;
        let (codes, sfs) = nvfp4_reference(&y, 1.0);
        assert_eq!(codes[0], 0x07);
        assert_eq!(codes[8], 0xf0);
        assert_eq!(sfs, vec![0x38, 0x38]);
    }
}
