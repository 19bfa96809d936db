//! Which algorithm runs a given call.

use std::fmt;
use std::str::FromStr;

use super::kernels::KernelKind;
use crate::codec::{Codec, Fp8Flavor};
use crate::device::BackendKind;
use crate::error::{Error, Result};

/// An all-reduce algorithm ferrocomm can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Every rank reads every peer's staged input and reduces all of it.
    OneShot,
    /// Reduce-scatter then all-gather: each rank reduces 1/world of the data.
    TwoShot,
    /// One-shot, push: every rank writes its input into every peer's
    /// workspace, raises a flag, and reduces from local memory.
    OneShotPush,
    /// One-shot, LL (barrier-free, Lamport-style): the epoch travels inside
    /// every 8-byte unit of pushed data, so there is no flag, fence or barrier.
    OneShotLl,
    /// Two-shot, push: pieces pushed to their owners, reduced locally, results
    /// pushed back to every rank.
    TwoShotPush,
    /// The vendor library (NCCL/RCCL). Not bitwise equal to the custom paths.
    Ccl,
    /// Quick-reduce: two-shot push with payloads quantized by the codec
    /// (docs/quick-reduce.md). f16/bf16 sum only; its result is
    /// `codec::reference_all_reduce`, not the exact reduction rule.
    QuickReduce(Codec),
}

impl Algorithm {
    /// ferrocomm's own kernels: deterministic and bitwise equal to each other.
    pub const CUSTOM: [Algorithm; 5] = [
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::OneShotPush,
        Algorithm::OneShotLl,
        Algorithm::TwoShotPush,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::OneShot => "oneshot",
            Algorithm::TwoShot => "twoshot",
            Algorithm::OneShotPush => "oneshot-push",
            Algorithm::OneShotLl => "oneshot-ll",
            Algorithm::TwoShotPush => "twoshot-push",
            Algorithm::Ccl => "ccl",
            Algorithm::QuickReduce(Codec::Fp8(Fp8Flavor::E4m3Fn)) => "quick-reduce-fp8",
            Algorithm::QuickReduce(Codec::Fp8(Fp8Flavor::E4m3Fnuz)) => "quick-reduce-fp8fnuz",
            Algorithm::QuickReduce(Codec::Int8) => "quick-reduce-int8",
            Algorithm::QuickReduce(Codec::Int6) => "quick-reduce-int6",
            Algorithm::QuickReduce(Codec::Int4) => "quick-reduce-int4",
        }
    }

    /// The kernel family that runs it; `None` for the vendor library.
    pub const fn kernel_kind(self) -> Option<KernelKind> {
        match self {
            Algorithm::OneShot => Some(KernelKind::OneShot),
            Algorithm::TwoShot => Some(KernelKind::TwoShot),
            Algorithm::OneShotPush => Some(KernelKind::OneShotPush),
            Algorithm::OneShotLl => Some(KernelKind::OneShotLl),
            Algorithm::TwoShotPush => Some(KernelKind::TwoShotPush),
            Algorithm::Ccl => None,
            Algorithm::QuickReduce(_) => Some(KernelKind::QuickReduce),
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
        let key = s.to_ascii_lowercase().replace(['-', '_'], "");
        if let Some(codec) = key.strip_prefix("quickreduce").or_else(|| key.strip_prefix("qr")) {
            return Ok(AlgoChoice::Fixed(Algorithm::QuickReduce(codec.parse()?)));
        }
        match key.as_str() {
            "" | "auto" => Ok(AlgoChoice::Auto),
            "oneshot" | "oneshotpull" => Ok(AlgoChoice::Fixed(Algorithm::OneShot)),
            "twoshot" | "twoshotpull" => Ok(AlgoChoice::Fixed(Algorithm::TwoShot)),
            "oneshotpush" => Ok(AlgoChoice::Fixed(Algorithm::OneShotPush)),
            "oneshotll" | "oneshotlamport" => Ok(AlgoChoice::Fixed(Algorithm::OneShotLl)),
            "twoshotpush" => Ok(AlgoChoice::Fixed(Algorithm::TwoShotPush)),
            "ccl" | "nccl" | "rccl" => Ok(AlgoChoice::Fixed(Algorithm::Ccl)),
            _ => Err(Error::invalid(format!(
                "unknown algorithm {s:?} (expected auto, oneshot, twoshot, oneshot-push, oneshot-ll, \
                 twoshot-push, nccl or quick-reduce-<fp8|int8|int6|int4>)"
            ))),
        }
    }
}

/// One step of a dispatch ladder: payloads up to `max_bytes` (inclusive)
/// run `algo`, unless an earlier step already took them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub max_bytes: usize,
    pub algo: Algorithm,
}

const fn step(max_bytes: usize, algo: Algorithm) -> Step {
    Step { max_bytes, algo }
}

/// Size thresholds per world size: an increasing ladder of steps, the last
/// one unbounded.
#[derive(Debug, Clone)]
pub struct DispatchTable {
    /// Indexed by world size (0 and 1 are unused: no kernel runs there).
    pub ladders: [Vec<Step>; 9],
    /// Smallest payload handed to the vendor library when the caller allows
    /// non-deterministic results and the library is loaded.
    pub ccl_min_bytes: usize,
    /// Smallest payload quick-reduce takes, per world size, when the caller
    /// opted in (`CommOptions::quantization`) and the call is an f16/bf16 sum.
    pub qr_min_bytes: [usize; 9],
}

impl DispatchTable {
    /// Defaults per backend; autotune at init may replace them.
    pub fn default_for(backend: BackendKind) -> Self {
        const KIB: usize = 1024;
        const MIB: usize = 1024 * KIB;
        use Algorithm::*;
        let ladders: [Vec<Step>; 9] = std::array::from_fn(|world| match backend {
            // The host backend's cost is memory traffic (DRAM-bound copies and
            // reductions), not latency. On a 2-core VM (bf16 sum, processes,
            // `ferrocomm-bench --backend host --algo ...`, median us per op):
            //   w2  1M: oneshot 461, twoshot 426, twoshot-push 367
            //       4M: oneshot 2495, twoshot 2515, twoshot-push 1504
            //   w4  256K: oneshot 441, twoshot 273, twoshot-push 264
            //       4M: oneshot 8701, twoshot 4165, twoshot-push 4646
            // Below 64 KiB the rows are scheduling noise (4-8 threads on 2
            // cores); the one-shot is the simplest there. The push two-shot
            // stages only the segments peers reduce.
            BackendKind::Host => vec![step(64 * KIB, OneShot), step(usize::MAX, TwoShotPush)],
            // GPUs: measured on 4x H200 (NV18), bf16 sum, CUDA-graph replay,
            // median us per op (ferrocomm-bench --graph --iters 10 --warmup 3,
            // NCCL 2.x in the same run, NVLS off; 8 MiB slots):
            //
            //  w2       LL    push1  push2   pull1  pull2   NCCL
            //  1K      3.39   5.32   8.01    5.09   8.55    5.89
            //  64K     4.39   6.25   9.11    6.04  11.40    7.22
            //  256K    5.87   6.57   9.41    6.61  12.30    8.55
            //  512K    8.69   7.33   9.96    7.36  12.64   10.10
            //  1M     11.80   8.97  11.29    9.24  13.53   14.03
            //  4M     46.49  20.38  20.84   21.25  22.57   32.93
            //  8M     96.61  35.32  33.07   39.97  36.72   47.80
            //  16M   193.18  63.78  57.63   81.59  74.44   76.50
            //  256M       -  843.9  808.9  1300.1 1186.5   883.7
            //
            //  w4       LL    push1  push2   pull1  pull2   NCCL
            //  1K      3.40   6.33  10.78    5.17  11.56    9.17
            //  64K     5.63   7.54  11.19    6.41  13.77   10.83
            //  128K    6.68   7.59  11.37    7.19  13.99   11.11
            //  256K    8.96   8.52  11.60    8.71  14.44   11.39
            //  512K   14.39  11.20  12.40   12.20  15.10   14.16
            //  1M     28.74  16.24  14.17   17.21  16.89   17.87
            //  16M   463.43 165.92  86.62  188.66 113.60   97.92
            //  256M       - 2424.9 1204.9  3006.0 1810.0  1178.9
            //
            // (LL = OneShotLl, push1/push2 = OneShotPush/TwoShotPush,
            // pull1/pull2 = OneShot/TwoShot.) Worlds 3 and 5..8 were not
            // measured: 3 follows 4; 5..8 halve the one-shot ranges of 4
            // (one-shot traffic grows with world - 1).
            BackendKind::Cuda | BackendKind::Hip => match world {
                0..=2 => vec![
                    step(256 * KIB, OneShotLl),
                    step(4 * MIB, OneShotPush),
                    step(usize::MAX, TwoShotPush),
                ],
                3 | 4 => vec![
                    step(128 * KIB, OneShotLl),
                    step(512 * KIB, OneShotPush),
                    step(usize::MAX, TwoShotPush),
                ],
                _ => vec![
                    step(64 * KIB, OneShotLl),
                    step(256 * KIB, OneShotPush),
                    step(usize::MAX, TwoShotPush),
                ],
            },
        });
        DispatchTable {
            ladders,
            // Never by default: on 4x H200 (BENCHMARKS.md run 2) two-shot push
            // matches or beats NCCL's busbw at every size up to 256 MiB, so
            // handing large payloads over would only cost determinism.
            // NCCL stays reachable with `algo = nccl`.
            ccl_min_bytes: usize::MAX,
            qr_min_bytes: std::array::from_fn(|_| match backend {
                // Never by default on the host: there quantizing costs far more
                // than the copies it saves (w4 bf16, 2 cores: 1 MiB two-shot
                // 3.4 ms, quick-reduce int4 44 ms). It stays reachable as
                // `algo = quick-reduce-<codec>`, the reference for GPUs.
                BackendKind::Host => usize::MAX,
                // From 4 MiB every codec matches or beats the push two-shot on
                // H200 (bf16, graph replay, us; BENCHMARKS.md):
                //   w4  2 MiB: two-shot 19.2, int4 21.0, int8 22.0
                //       4 MiB: two-shot 28.5, int4 25.0, int6 27.9, int8 27.6, fp8 28.8
                //   w2  2 MiB: two-shot 14.7, int4 16.2; 4 MiB: 20.9 vs int4 18.8, int8 19.8
                BackendKind::Cuda | BackendKind::Hip => 4 * MIB,
            }),
        }
    }

    /// `ccl_allowed`: the vendor library is loaded and the caller does not
    /// require deterministic results.
    /// `quantize`: the caller opted in to quick-reduce with this codec and the
    /// call is one it can run (f16/bf16 sum).
    pub fn choose(
        &self,
        choice: AlgoChoice,
        bytes: usize,
        world: usize,
        ccl_allowed: bool,
        quantize: Option<Codec>,
    ) -> Algorithm {
        match choice {
            AlgoChoice::Fixed(a) => a,
            AlgoChoice::Auto => {
                if let Some(codec) = quantize.filter(|_| bytes >= self.qr_min_bytes[world.min(8)]) {
                    return Algorithm::QuickReduce(codec);
                }
                if ccl_allowed && bytes >= self.ccl_min_bytes {
                    return Algorithm::Ccl;
                }
                self.ladders[world.min(8)]
                    .iter()
                    .find(|s| bytes <= s.max_bytes)
                    .map_or(Algorithm::TwoShot, |s| s.algo)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for a in Algorithm::CUSTOM.into_iter().chain([Algorithm::Ccl]) {
            assert_eq!(a.name().parse::<AlgoChoice>().unwrap(), AlgoChoice::Fixed(a));
        }
        assert_eq!(
            "ONESHOT_PUSH".parse::<AlgoChoice>().unwrap(),
            AlgoChoice::Fixed(Algorithm::OneShotPush)
        );
        assert_eq!("auto".parse::<AlgoChoice>().unwrap(), AlgoChoice::Auto);
        assert!("threeshot".parse::<AlgoChoice>().is_err());
        for codec in crate::algo::kernels::QR_CODECS {
            let a = Algorithm::QuickReduce(codec);
            assert_eq!(a.name().parse::<AlgoChoice>().unwrap(), AlgoChoice::Fixed(a));
        }
        assert_eq!(
            "qr-int6".parse::<AlgoChoice>().unwrap(),
            AlgoChoice::Fixed(Algorithm::QuickReduce(Codec::Int6))
        );
        assert!("quick-reduce-int3".parse::<AlgoChoice>().is_err());
    }

    #[test]
    fn every_world_has_an_unbounded_last_step() {
        for backend in [BackendKind::Host, BackendKind::Cuda, BackendKind::Hip] {
            let t = DispatchTable::default_for(backend);
            for world in 2..=8 {
                let ladder = &t.ladders[world];
                assert_eq!(ladder.last().map(|s| s.max_bytes), Some(usize::MAX));
                assert!(ladder.windows(2).all(|w| w[0].max_bytes < w[1].max_bytes));
                assert!(ladder.iter().all(|s| Algorithm::CUSTOM.contains(&s.algo)));
                assert_ne!(
                    t.choose(AlgoChoice::Auto, usize::MAX, world, false, None),
                    Algorithm::Ccl
                );
                let qr = Algorithm::QuickReduce(Codec::Int4);
                if backend != BackendKind::Host {
                    assert_eq!(
                        t.choose(AlgoChoice::Auto, 256 << 20, world, false, Some(Codec::Int4)),
                        qr
                    );
                }
                assert_ne!(t.choose(AlgoChoice::Auto, 1024, world, false, Some(Codec::Int4)), qr);
                assert_ne!(t.choose(AlgoChoice::Auto, 256 << 20, world, false, None), qr);
            }
        }
    }
}
