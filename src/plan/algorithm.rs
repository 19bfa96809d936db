//! The one vocabulary of how a call runs: [`Algorithm`], named the same in
//! Rust (`Call::algo`), Python (the `algo` / `coll_algo` hints), the
//! environment (`FERROCOMM_ALGO`, `FERROCOMM_COLL_ROUTE`), autotune's cache
//! and the bench's `algo` column; and [`Collective`], what a call is.

use std::fmt;
use std::str::FromStr;

use crate::algo::kernels::KernelKind;
use crate::codec::{Codec, Fp8Flavor};
use crate::error::{Error, Result};

/// One way a call can run.
///
/// All-reduce runs one of ferrocomm's all-reduce kernels or the vendor
/// library; the other collectives run the LL kinds, the inbox kinds or the
/// vendor library. [`Algorithm::Kernels`] asks for ferrocomm's kernels
/// without naming one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// All-reduce, pull: every rank reads every peer's staged input and
    /// reduces all of it.
    OneShot,
    /// All-reduce, pull: reduce-scatter then all-gather, each rank reducing
    /// 1/world of the data.
    TwoShot,
    /// All-reduce, push: every rank writes its input into every peer's
    /// workspace, raises a flag, and reduces from local memory.
    OneShotPush,
    /// All-reduce on LL lines (barrier-free, Lamport-style): the epoch
    /// travels inside every 8-byte unit of pushed data, so there is no
    /// flag, fence or barrier.
    OneShotLl,
    /// All-reduce, push: pieces pushed to their owners, reduced locally,
    /// results pushed back to every rank.
    TwoShotPush,
    /// Quick-reduce: the push two-shot with payloads quantized by the codec
    /// (docs/quick-reduce.md). f16/bf16 sums only; its result is
    /// `codec::reference_all_reduce`, not the exact reduction rule.
    QuickReduce(Codec),
    /// All-gather, reduce-scatter, all-to-all and the rest on LL lines
    /// (`fc_exchange_ll`, `fc_reduce_to_ll_*`): 8 data bytes per 16-byte
    /// line with the epoch in each, so no flag round trip. Small agreed
    /// blocks only: one launch, within one source's lines.
    Ll,
    /// The inbox kinds (`fc_exchange`, `fc_reduce_to_*`): pushed into the
    /// peers' inboxes, a flag, copied out (or their direct twins on heap
    /// operands). They run every call.
    Inbox,
    /// The copy route (all-gather, broadcast, all-to-all without splits):
    /// the copy engines push every block into the peers' inboxes, and a
    /// one-block handshake that moves no data orders the copies
    /// (`algo::copy`). No SM moves a byte. Taken only where a call or the
    /// tuned table asks for it.
    Copy,
    /// ferrocomm's kernels, whichever fits (`FERROCOMM_COLL_ROUTE=custom`).
    Kernels,
    /// NCCL/RCCL underneath, where the build has it and it loaded. Its
    /// sums are not bitwise the reference's.
    Vendor,
}

impl Algorithm {
    /// ferrocomm's all-reduce kernels: deterministic and bitwise equal to
    /// each other.
    pub const ALL_REDUCE_KERNELS: [Algorithm; 5] = [
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::OneShotPush,
        Algorithm::OneShotLl,
        Algorithm::TwoShotPush,
    ];

    /// What the collectives other than all-reduce run, as their ladders
    /// name them.
    pub const DATA_KINDS: [Algorithm; 4] = [Algorithm::Ll, Algorithm::Inbox, Algorithm::Copy, Algorithm::Vendor];

    /// Its name, as every interface spells it.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::OneShot => "oneshot",
            Algorithm::TwoShot => "twoshot",
            Algorithm::OneShotPush => "oneshot-push",
            Algorithm::OneShotLl => "oneshot-ll",
            Algorithm::TwoShotPush => "twoshot-push",
            Algorithm::QuickReduce(Codec::Fp8(Fp8Flavor::E4m3Fn)) => "quick-reduce-fp8",
            Algorithm::QuickReduce(Codec::Fp8(Fp8Flavor::E4m3Fnuz)) => "quick-reduce-fp8fnuz",
            Algorithm::QuickReduce(Codec::Int8) => "quick-reduce-int8",
            Algorithm::QuickReduce(Codec::Int6) => "quick-reduce-int6",
            Algorithm::QuickReduce(Codec::Int4) => "quick-reduce-int4",
            Algorithm::QuickReduce(Codec::Fp4) => "quick-reduce-fp4",
            Algorithm::Ll => "ll",
            Algorithm::Inbox => "inbox",
            Algorithm::Copy => "copy",
            Algorithm::Kernels => "kernels",
            Algorithm::Vendor => "vendor",
        }
    }

    /// Whether it is one of the all-reduce's ways (a kernel, quick-reduce,
    /// or the vendor library and "ferrocomm's kernels", which every
    /// collective has).
    pub const fn is_all_reduce(self) -> bool {
        !matches!(self, Algorithm::Ll | Algorithm::Inbox | Algorithm::Copy)
    }

    /// Whether the collectives other than all-reduce have it.
    pub const fn is_data(self) -> bool {
        matches!(
            self,
            Algorithm::Ll | Algorithm::Inbox | Algorithm::Copy | Algorithm::Kernels | Algorithm::Vendor
        )
    }

    testing_pub! {
        /// The all-reduce kernel family that runs it.
        pub const fn all_reduce_kind(self) -> Option<KernelKind> {
            match self {
                Algorithm::OneShot => Some(KernelKind::OneShot),
                Algorithm::TwoShot => Some(KernelKind::TwoShot),
                Algorithm::OneShotPush => Some(KernelKind::OneShotPush),
                Algorithm::OneShotLl => Some(KernelKind::OneShotLl),
                Algorithm::TwoShotPush => Some(KernelKind::TwoShotPush),
                Algorithm::QuickReduce(_) => Some(KernelKind::QuickReduce),
                _ => None,
            }
        }
    }

    /// The codec of a quick-reduce.
    pub const fn codec(self) -> Option<Codec> {
        match self {
            Algorithm::QuickReduce(c) => Some(c),
            _ => None,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = Error;

    /// Its name, in any case, with `-` and `_` alike; and the names the
    /// options used before there was one vocabulary: `nccl`, `rccl`, `ccl`
    /// (the vendor library), `custom`, `ferrocomm` (the kernels),
    /// `oneshot-pull`, `twoshot-pull`, `oneshot-lamport`, `qr-<codec>`.
    fn from_str(s: &str) -> Result<Self> {
        let key = s.trim().to_ascii_lowercase().replace(['-', '_'], "");
        if let Some(codec) = key.strip_prefix("quickreduce").or_else(|| key.strip_prefix("qr")) {
            return Ok(Algorithm::QuickReduce(codec.parse()?));
        }
        Ok(match key.as_str() {
            "oneshot" | "oneshotpull" => Algorithm::OneShot,
            "twoshot" | "twoshotpull" => Algorithm::TwoShot,
            "oneshotpush" => Algorithm::OneShotPush,
            "oneshotll" | "oneshotlamport" => Algorithm::OneShotLl,
            "twoshotpush" => Algorithm::TwoShotPush,
            "ll" => Algorithm::Ll,
            "inbox" => Algorithm::Inbox,
            "copy" | "copyengine" | "ce" => Algorithm::Copy,
            "kernels" | "custom" | "ferrocomm" => Algorithm::Kernels,
            "vendor" | "nccl" | "rccl" | "ccl" => Algorithm::Vendor,
            _ => {
                return Err(Error::invalid(format!(
                    "unknown algorithm {s:?} (expected auto, oneshot, twoshot, oneshot-push, oneshot-ll, \
                     twoshot-push, quick-reduce-<fp8|int8|int6|int4|fp4>, ll, inbox, copy, kernels or vendor)"
                )))
            }
        })
    }
}

/// An optional algorithm from text: `auto` or empty is `None` (the
/// planner's choice).
pub fn parse_choice(s: &str) -> Result<Option<Algorithm>> {
    match s.trim() {
        "" => Ok(None),
        v if v.eq_ignore_ascii_case("auto") => Ok(None),
        v => v.parse().map(Some),
    }
}

/// What a call is, as the planner and the tuned table name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Collective {
    /// All-reduce (and its fused and mixed forms).
    AllReduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-to-all without splits: every rank's blocks are `count / world`,
    /// a block the group agrees on.
    AllToAll,
    /// All-to-all with splits (or of lists): no block the group agrees on.
    AllToAllV,
    /// Broadcast from a root.
    Broadcast,
    /// Reduce to a root.
    Reduce,
    /// Gather to a root.
    Gather,
    /// Scatter from a root.
    Scatter,
    /// A batch of sends and receives.
    SendRecv,
    /// A barrier.
    Barrier,
}

impl Collective {
    /// The collectives with a ladder in the tuned table.
    pub const TUNED: [Collective; 4] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
    ];

    /// Its name, as the tuned table, the cache file and the bench spell it.
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
            Collective::AllToAllV => "all_to_all_v",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
            Collective::SendRecv => "send/recv",
            Collective::Barrier => "barrier",
        }
    }

    /// Whether it reduces: its cost depends on the dtype class, and the
    /// vendor library's bits differ from the reference's.
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        )
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Collective {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        [
            Collective::AllReduce,
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllToAll,
            Collective::AllToAllV,
            Collective::Broadcast,
            Collective::Reduce,
            Collective::Gather,
            Collective::Scatter,
            Collective::SendRecv,
            Collective::Barrier,
        ]
        .into_iter()
        .find(|c| c.name() == s)
        .ok_or_else(|| Error::invalid(format!("unknown collective {s:?}")))
    }
}
