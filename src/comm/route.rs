//! Which implementation runs a data-moving collective on a GPU: ferrocomm's
//! exchange / reduce-to kernels (`fc_exchange`, `fc_reduce_to_*`, the host
//! protocols of docs/protocol.md) or NCCL/RCCL underneath.
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

use crate::device::MAX_RANKS;
use crate::error::{Error, Result};

/// The route asked for (`FERROCOMM_COLL_ROUTE=auto|custom|vendor`,
/// [`CommOptions::coll_route`](super::CommOptions::coll_route)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollRoute {
    /// ferrocomm's kernels from [`CUSTOM_MIN_BLOCK_BYTES`], NCCL/RCCL below
    /// (and for reductions in deterministic mode, always the kernels).
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

/// The collectives that have both routes on GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Coll {
    AllGather,
    Gather,
    Scatter,
    AllToAll,
    ReduceScatter,
    Reduce,
}

impl Coll {
    /// Whether the collective reduces (NCCL/RCCL's result is then not
    /// bitwise the host reference's).
    fn reduces(self) -> bool {
        matches!(self, Coll::ReduceScatter | Coll::Reduce)
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

/// Smallest per-peer block (bytes) `auto` sends to ferrocomm's inbox kernels
/// when NCCL/RCCL is there and may take the call; smaller ones go to the
/// library, except blocks the LL kinds carry, which beat it
/// (`comm::collectives::ll_max_block_bytes`, applied by the caller).
///
/// Measured on 2x H200 (NV18), bf16, CUDA-graph replay, world 2,
/// `ferrocomm-bench --coll all --algo auto,nccl --graph` (bench/2026-11-23-h200x2/run8),
/// kernels / NCCL called directly, us, by the bench's size (all-gather's
/// output, reduce-scatter's input: two blocks; reduce's buffer: one block):
///
/// ```text
///            4K      64K     256K    512K    1M      4M      16M     64M
/// all-gather 6.6/5.5 8.2/6.5 8.4/7.1 8.6/8.1 9.4/10.7 14.3/25.5 35.5/44.9 120.5/122.8
/// red-scat.  6.5/5.5 7.9/6.3 8.2/6.9 8.3/7.8 8.7/9.9  13.6/23.5 34.8/50.9 117.8/163.3
/// reduce     6.0/4.8 7.1/5.3 7.3/6.3 7.7/7.8 8.6/10.7 17.3/22.0 51.4/56.1 193.7/195.5
/// ```
///
/// The kernels' push, flag and copy-out cost about 1 us more than NCCL's
/// small-message path, and win from a 512 KiB block on. Gather and scatter
/// run the same exchange and take the all-gather's threshold; worlds above 2
/// were not measured and take world 2's. All-to-alls have their own rule
/// ([`A2A_VENDOR_MIN_BLOCK_BYTES`]; with splits, no size: the kernels).
pub(crate) const CUSTOM_MIN_BLOCK_BYTES: usize = 512 << 10;

/// Smallest per-peer block (bytes) of an all-to-all without splits (the one
/// kind with an agreed block) that `auto` gives NCCL/RCCL: below it the
/// kernels are level or ahead, above it NCCL's copy is faster.
///
/// Measured on 2x H200 (NV18), bf16, graph replay, world 2, `ferrocomm-bench
/// --coll all --algo auto,nccl --graph` (bench/2026-11-23-h200x2/run14-session6,
/// `collbench_w2.log`), kernels (LL to 256 KiB a peer, then the inbox
/// exchange) / NCCL called directly, us, by the per-peer block:
///
/// ```text
/// 2K 1.77/3.20 (x2: 3.55/6.40 for the call)   32K 4.37/7.81   256K 5.80/9.63
/// 512K 9.43/12.55   4M 21.96/24.96   8M 37.14/37.51   16M 67.39/64.17   32M 123.27/110.72
/// ```
/// (whole calls, input of 2 blocks.)
pub(crate) const A2A_VENDOR_MIN_BLOCK_BYTES: usize = 16 << 20;

/// The route of one call of `coll` on a GPU communicator of `world` ranks.
///
/// - `block_bytes`: the per-peer block in bytes when every rank agrees on it
///   (all-gather's input, reduce-scatter's output, gather/scatter's block,
///   all of which every rank's validation pins, an all-to-all's without
///   splits); `None` for all-to-alls given splits (one rank's may be even
///   while another's are not): `auto` then takes the kernels, the one route
///   that needs no agreed size. All-to-alls take the kernels below
///   [`A2A_VENDOR_MIN_BLOCK_BYTES`], the library from there.
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
        CollRoute::Auto => match (coll, block_bytes) {
            (Coll::AllToAll, Some(b)) if b >= A2A_VENDOR_MIN_BLOCK_BYTES => Route::Vendor,
            (Coll::AllToAll, _) => Route::Custom,
            (_, Some(b)) if b < min => Route::Vendor,
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
        const ALL: [Coll; 6] = [AllGather, Gather, Scatter, AllToAll, ReduceScatter, Reduce];
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
                        let want = match (coll, bytes) {
                            (AllToAll, Some(b)) if b >= A2A_VENDOR_MIN_BLOCK_BYTES => Route::Vendor,
                            (AllToAll, _) => Route::Custom,
                            (_, Some(b)) if b < CUSTOM_MIN_BLOCK_BYTES && !(det && coll.reduces()) => Route::Vendor,
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
            if coll == AllToAll {
                // Small all-to-alls stay on the kernels, large ones go to the library.
                assert_eq!(at(Some(4095), false), Route::Custom);
                assert_eq!(at(Some(A2A_VENDOR_MIN_BLOCK_BYTES - 1), false), Route::Custom);
                assert_eq!(at(Some(A2A_VENDOR_MIN_BLOCK_BYTES), false), Route::Vendor);
                continue;
            }
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
