//! Which algorithm runs a given call.

use std::fmt;
use std::str::FromStr;

use crate::device::BackendKind;
use crate::error::{Error, Result};

/// An all-reduce algorithm ferrocomm can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Every rank reads every peer's staged input and reduces all of it.
    OneShot,
    /// Reduce-scatter then all-gather: each rank reduces 1/world of the data.
    TwoShot,
    /// The vendor library (NCCL/RCCL). Not bitwise equal to the custom paths.
    Ccl,
}

impl Algorithm {
    /// ferrocomm's own kernels: deterministic and bitwise equal to each other.
    pub const CUSTOM: [Algorithm; 2] = [Algorithm::OneShot, Algorithm::TwoShot];

    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::OneShot => "oneshot",
            Algorithm::TwoShot => "twoshot",
            Algorithm::Ccl => "ccl",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The caller's choice: let dispatch decide, or force one algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AlgoChoice {
    #[default]
    Auto,
    Fixed(Algorithm),
}

impl FromStr for AlgoChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "" | "auto" => Ok(AlgoChoice::Auto),
            "oneshot" => Ok(AlgoChoice::Fixed(Algorithm::OneShot)),
            "twoshot" => Ok(AlgoChoice::Fixed(Algorithm::TwoShot)),
            "ccl" | "nccl" | "rccl" => Ok(AlgoChoice::Fixed(Algorithm::Ccl)),
            _ => Err(Error::invalid(format!(
                "unknown algorithm {s:?} (expected auto, oneshot, twoshot or nccl)"
            ))),
        }
    }
}

/// Size thresholds per world size. One-shot moves (world-1)x the bytes of
/// two-shot but needs one synchronisation instead of two, so it wins small.
#[derive(Debug, Clone)]
pub struct DispatchTable {
    /// Largest payload (bytes) that runs one-shot, indexed by world size.
    pub oneshot_max_bytes: [usize; 9],
    /// Smallest payload handed to the vendor library when the caller allows
    /// non-deterministic results and the library is loaded.
    pub ccl_min_bytes: usize,
}

impl DispatchTable {
    /// Defaults per backend; autotune at init may replace them.
    pub fn default_for(backend: BackendKind) -> Self {
        let kib = 1024;
        let table = match backend {
            // The host backend's cost is memory bandwidth, not latency.
            BackendKind::Host => [
                0,
                0,
                256 * kib,
                128 * kib,
                128 * kib,
                64 * kib,
                64 * kib,
                64 * kib,
                64 * kib,
            ],
            BackendKind::Cuda | BackendKind::Hip => [
                0,
                0,
                512 * kib,
                256 * kib,
                256 * kib,
                256 * kib,
                256 * kib,
                256 * kib,
                256 * kib,
            ],
        };
        DispatchTable {
            oneshot_max_bytes: table,
            ccl_min_bytes: 64 << 20,
        }
    }

    /// `ccl_allowed`: the vendor library is loaded and the caller does not
    /// require deterministic results.
    pub fn choose(&self, choice: AlgoChoice, bytes: usize, world: usize, ccl_allowed: bool) -> Algorithm {
        match choice {
            AlgoChoice::Fixed(a) => a,
            AlgoChoice::Auto => {
                if ccl_allowed && bytes >= self.ccl_min_bytes {
                    Algorithm::Ccl
                } else if bytes <= self.oneshot_max_bytes[world.min(8)] {
                    Algorithm::OneShot
                } else {
                    Algorithm::TwoShot
                }
            }
        }
    }
}
