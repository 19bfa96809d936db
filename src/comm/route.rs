//! Which implementation runs a data-moving collective on a GPU: ferrocomm's
//! exchange / reduce-to kernels (`fc_exchange`, `fc_reduce_to_*`, the host
//! protocols of docs/protocol.md) or NCCL/RCCL underneath.
//!
//! [`decide`] serves gather, scatter, reduce and all-to-all with splits. For
//! all-gather, reduce-scatter and all-to-all without splits the dispatch
//! table decides (`comm::collectives::coll_kind`: its default ladders are
//! the thresholds below, autotune replaces them), and the route asked for
//! still wins over it.
//!
//! The decision must come out the same on every rank (a group split between
//! the kernels and the library waits until its deadline), so it depends only
//! on what every rank shares: the collective, the world, the per-peer block
//! size where all ranks agree on one (`None` for all-to-alls, whose
//! per-rank sizes may differ), the route asked for
//! (`FERROCOMM_COLL_ROUTE`, which every rank must set alike, like every
//! `FERROCOMM_*` knob) and whether the library loaded (it loads on every rank
//! or the communicator fails at init).

use std::fmt;
use std::str::FromStr;

use crate::algo::CUSTOM_MIN_BLOCK_BYTES;
use crate::device::MAX_RANKS;
use crate::error::{Error, Result};

/// The route asked for (`FERROCOMM_COLL_ROUTE=auto|custom|vendor`,
/// [`CommOptions::coll_route`](super::CommOptions::coll_route)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollRoute {
    /// ferrocomm's kernels from [`CUSTOM_MIN_BLOCK_BYTES`], NCCL/RCCL below
    /// (and for reductions in deterministic mode, always the kernels); for
    /// all-gather, reduce-scatter and all-to-all without splits, the
    /// dispatch table's choice (tuned at init).
    #[default]
    Auto,
    /// ferrocomm's kernels whenever the world allows (2..=8 ranks).
    Custom,
    /// NCCL/RCCL whenever the build has it and it loaded.
    Vendor,
}

impl FromStr for CollRoute {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(CollRoute::Auto),
            "custom" | "ferrocomm" | "kernels" => Ok(CollRoute::Custom),
            "vendor" | "nccl" | "rccl" => Ok(CollRoute::Vendor),
            _ => Err(Error::invalid(format!(
                "FERROCOMM_COLL_ROUTE={s:?} is not one of auto, custom, vendor"
            ))),
        }
    }
}

impl fmt::Display for CollRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CollRoute::Auto => "auto",
            CollRoute::Custom => "custom",
            CollRoute::Vendor => "vendor",
        })
    }
}

/// The collectives that have both routes on GPUs and no tuned ladder
/// (all-gather, reduce-scatter and all-to-all go by the dispatch table:
/// `comm::collectives::coll_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Coll {
    Gather,
    Scatter,
    Reduce,
}

impl Coll {
    /// Whether the collective reduces (NCCL/RCCL's result is then not
    /// bitwise the host reference's).
    fn reduces(self) -> bool {
        matches!(self, Coll::Reduce)
    }
}

/// Where one call goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// ferrocomm's exchange / reduce-to kernel.
    Custom,
    /// NCCL/RCCL, or (world 1, world > 8) the path the collective had before
    /// these kernels existed.
    Vendor,
}

/// The route of one call of `coll` on a GPU communicator of `world` ranks.
///
/// - `block_bytes`: the per-peer block in bytes when every rank agrees on it
///   (gather/scatter's block, reduce's buffer, which every rank's
///   validation pins); `None`: no agreed size, and `auto` takes the
///   kernels, the one route that needs no agreed size.
/// - `vendor`: the build has NCCL/RCCL and the library loaded.
/// - `deterministic`: [`CommOptions::deterministic`](super::CommOptions::deterministic):
///   reductions then always take the kernels (NCCL's bits differ from the
///   reference), at the small-message cost measured above.
///
/// World 1 and worlds above [`MAX_RANKS`] keep their earlier paths
/// ([`Route::Vendor`]); otherwise the kernels are the only route without the
/// library, whatever was asked.
pub(crate) fn decide(
    asked: CollRoute,
    coll: Coll,
    block_bytes: Option<usize>,
    world: usize,
    vendor: bool,
    deterministic: bool,
) -> Route {
    decide_at(
        CUSTOM_MIN_BLOCK_BYTES,
        asked,
        coll,
        block_bytes,
        world,
        vendor,
        deterministic,
    )
}

/// [`decide`] with `auto`'s threshold as an argument (tests).
fn decide_at(
    min: usize,
    asked: CollRoute,
    coll: Coll,
    block_bytes: Option<usize>,
    world: usize,
    vendor: bool,
    deterministic: bool,
) -> Route {
    if world <= 1 || world > MAX_RANKS {
        return Route::Vendor;
    }
    if !vendor {
        return Route::Custom;
    }
    match asked {
        CollRoute::Custom => Route::Custom,
        CollRoute::Vendor => Route::Vendor,
        CollRoute::Auto if deterministic && coll.reduces() => Route::Custom,
        CollRoute::Auto => match block_bytes {
            Some(b) if b < min => Route::Vendor,
            _ => Route::Custom,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_the_three_routes_and_names_the_variable_on_errors() {
        assert_eq!("auto".parse::<CollRoute>().unwrap(), CollRoute::Auto);
        assert_eq!(" Custom ".parse::<CollRoute>().unwrap(), CollRoute::Custom);
        assert_eq!("vendor".parse::<CollRoute>().unwrap(), CollRoute::Vendor);
        assert_eq!("nccl".parse::<CollRoute>().unwrap(), CollRoute::Vendor);
        let e = "fast".parse::<CollRoute>().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        let m = e.to_string();
        assert!(m.contains("FERROCOMM_COLL_ROUTE") && m.contains("\"fast\""), "{m}");
        assert_eq!(CollRoute::default(), CollRoute::Auto);
        for r in [CollRoute::Auto, CollRoute::Custom, CollRoute::Vendor] {
            assert_eq!(r.to_string().parse::<CollRoute>().unwrap(), r);
        }
    }

    #[test]
    fn decisions() {
        use Coll::*;
        const ALL: [Coll; 3] = [Gather, Scatter, Reduce];
        for coll in ALL {
            for world in 2..=MAX_RANKS {
                for bytes in [None, Some(0), Some(1), Some(1 << 20), Some(1 << 40)] {
                    for det in [false, true] {
                        // No library: the kernels, whatever was asked.
                        for asked in [CollRoute::Auto, CollRoute::Custom, CollRoute::Vendor] {
                            assert_eq!(decide(asked, coll, bytes, world, false, det), Route::Custom);
                        }
                        assert_eq!(decide(CollRoute::Custom, coll, bytes, world, true, det), Route::Custom);
                        assert_eq!(decide(CollRoute::Vendor, coll, bytes, world, true, det), Route::Vendor);
                        // Auto: the kernels from the measured block size, and
                        // without an agreed size, and for reductions that
                        // must be deterministic.
                        let want = match bytes {
                            Some(b) if b < CUSTOM_MIN_BLOCK_BYTES && !(det && coll.reduces()) => Route::Vendor,
                            _ => Route::Custom,
                        };
                        assert_eq!(decide(CollRoute::Auto, coll, bytes, world, true, det), want);
                    }
                }
            }
            // The threshold: smaller agreed blocks go to the library,
            // unknown sizes and deterministic reductions stay on the kernels.
            let at = |bytes, det| decide_at(4096, CollRoute::Auto, coll, bytes, 4, true, det);
            assert_eq!(at(Some(4096), false), Route::Custom);
            assert_eq!(at(Some(4095), false), Route::Vendor);
            assert_eq!(at(None, false), Route::Custom);
            let det = if coll.reduces() { Route::Custom } else { Route::Vendor };
            assert_eq!(at(Some(4095), true), det);
            // World 1 and worlds the kernels do not serve keep their paths.
            for world in [1, MAX_RANKS + 1, 64] {
                for vendor in [false, true] {
                    assert_eq!(
                        decide(CollRoute::Custom, coll, Some(4), world, vendor, true),
                        Route::Vendor
                    );
                }
            }
        }
    }
}
