//! The fused all-reduce epilogues' kernel family: the call's `algo`, else
//! the measured thresholds, within what the workspace holds.

use super::Algorithm;
use crate::algo::fused::{FusedKind, SpOutput, FUSED_LL_MAX_BYTES, FUSED_LL_MAX_HIDDEN, FUSED_TWOSHOT_MIN_BYTES};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A fused call's shape, as the planner needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FusedShape {
    pub dtype: DType,
    pub tokens: usize,
    pub hidden: usize,
    pub world: usize,
    /// Whether a row fits one rank's two-shot inbox.
    pub fits_two: bool,
    /// Rows the LL one-shot carries (0: none).
    pub ll_rows: usize,
}

/// The kernel family of a fused call. The call's own `algo` picks it: the
/// LL one-shot for `oneshot-ll`, the push one-shot for the other one-shot
/// algorithms, the two-shot for a two-shot one (an algorithm whose family
/// cannot hold the rows is an error). Otherwise by bytes: the LL one-shot up
/// to [`FUSED_LL_MAX_BYTES`], the two-shot from [`FUSED_TWOSHOT_MIN_BYTES`]
/// where every rank owns a row, the push one-shot between and wherever the
/// rows do not fit the others. (Only the call's choice counts: a
/// communicator-wide `FERROCOMM_ALGO` such as `vendor` is about plain
/// all-reduces.) Errors are `InvalidArgument` without the call's prefix.
pub(crate) fn fused_kind(asked: Option<Algorithm>, s: &FusedShape) -> Result<FusedKind> {
    let (tokens, hidden, world, dtype) = (s.tokens, s.hidden, s.world, s.dtype);
    let fits_ll = tokens <= s.ll_rows;
    Ok(match asked {
        None | Some(Algorithm::Kernels) => match auto(tokens * hidden * dtype.size(), tokens, world) {
            FusedKind::TwoShot if !s.fits_two => FusedKind::OneShot,
            FusedKind::OneShotLl if !fits_ll => FusedKind::OneShot,
            k => k,
        },
        Some(Algorithm::OneShotLl) => {
            if hidden > FUSED_LL_MAX_HIDDEN {
                return Err(Error::invalid(format!(
                    "a row of {hidden} elements does not fit the LL one-shot (at most {FUSED_LL_MAX_HIDDEN}); \
                     use the push one-shot"
                )));
            }
            if !fits_ll {
                return Err(Error::invalid(format!(
                    "{tokens} rows of {hidden} x {dtype} do not fit one rank's LL lines at world {world} \
                     (at most {} rows); use the push one-shot or larger slot_bytes",
                    s.ll_rows
                )));
            }
            FusedKind::OneShotLl
        }
        Some(Algorithm::OneShot | Algorithm::OneShotPush) => FusedKind::OneShot,
        Some(Algorithm::TwoShot | Algorithm::TwoShotPush) => {
            if tokens > 0 && !s.fits_two {
                return Err(Error::invalid(format!(
                    "a row of {hidden} x {dtype} does not fit one rank's two-shot inbox at world {world}; \
                     use the one-shot or larger slot_bytes"
                )));
            }
            FusedKind::TwoShot
        }
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "all_reduce_fused runs ferrocomm's one-shot or two-shot kernels, not {other}"
            )))
        }
    })
}

/// The kernel family of a sequence-parallel fused call: the form's own
/// (one kernel each, the two-shot's data flow), which the call's `algo` may
/// only confirm (unset, `kernels`, or a two-shot); its rows must fit the
/// two-shot's inboxes. Errors are without the call's prefix.
pub(crate) fn fused_sp_kind(asked: Option<Algorithm>, out: SpOutput, s: &FusedShape) -> Result<FusedKind> {
    match asked {
        None | Some(Algorithm::Kernels | Algorithm::TwoShot | Algorithm::TwoShotPush) => {}
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "reduce_scatter_fused runs the sequence-parallel fused kernel (a two-shot), not {other}"
            )))
        }
    }
    if s.tokens > 0 && !s.fits_two {
        return Err(Error::invalid(format!(
            "a row of {} x {} does not fit one rank's two-shot inbox at world {}; create the communicator \
             with larger slot_bytes",
            s.hidden, s.dtype, s.world
        )));
    }
    Ok(out.kind())
}

/// The measured choice for `tokens` rows of `bytes` in all at `world`
/// ranks (BENCHMARKS.md, "Fused all-reduce + residual + RMSNorm, beside
/// FlashInfer").
fn auto(bytes: usize, tokens: usize, world: usize) -> FusedKind {
    let big = (world > 2) as usize;
    if world > 1 && bytes <= FUSED_LL_MAX_BYTES[big] {
        FusedKind::OneShotLl
    } else if world > 1 && tokens >= world && bytes >= FUSED_TWOSHOT_MIN_BYTES[big] {
        FusedKind::TwoShot
    } else {
        FusedKind::OneShot
    }
}
