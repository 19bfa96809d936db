//! Autotune at init: every rank of a new communicator times ferrocomm's
//! all-reduce algorithms at a fixed ladder of sizes, rank 0's timings pick
//! the fastest per size, and every rank adopts rank 0's choice (so all ranks
//! dispatch alike). The result is cached on disk under a key of what it
//! depends on (device, arch, world, topology, slot size, driver and library
//! versions), so later runs only read it.
//!
//! What is tuned: the all-reduce ladder of this communicator's world
//! (`DispatchTable::ladders`), measured with bf16 sums and applied to every
//! dtype by bytes (one dtype class today). The plan is fixed before it runs
//! (no rank may stop early on its own clock: the measurements are
//! collectives), and sized to take well under the 2 s budget on H200; the
//! report says how long it took.
//!
//! On by default on GPUs, off on the host backend (the reference, whose
//! tests create hundreds of communicators); `FERROCOMM_AUTOTUNE=0|1` or
//! [`CommOptions::with_autotune`] decide.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::call::Call;
use super::communicator::Communicator;
use super::tensor::Tensor;
use crate::algo::{AlgoChoice, Algorithm, Step};
use crate::bootstrap::store_all_gather;
use crate::device::{BackendKind, Device};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// Where a communicator's all-reduce ladder came from.
#[derive(Debug, Clone, PartialEq)]
pub enum TuneSource {
    /// Measured at init (rank 0's timings), taking this long.
    Measured(Duration),
    /// Read from the cache file of an earlier measurement (rank 0's).
    Cached(PathBuf),
}

/// What autotune chose, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneReport {
    pub source: TuneSource,
    /// The ladder in force: payloads up to `max_bytes` run `algo`.
    pub ladder: Vec<Step>,
    /// Rank 0's median microseconds per (bytes, algorithm) when measured.
    pub timings: Vec<(usize, Algorithm, f64)>,
}

/// The sizes timed and their candidates.
fn plan(backend: BackendKind) -> Vec<(usize, Vec<Algorithm>)> {
    use Algorithm::*;
    let sizes: Vec<usize> = match backend {
        // Host: memory-bound copies; the ladder's turn is below 1 MiB.
        BackendKind::Host => (12..=20).step_by(2).map(|s| 1usize << s).collect(),
        // GPUs: 1 KiB to 64 MiB, every 4x (the default ladder turns at
        // 128 KiB-4 MiB on H200).
        _ => (10..=26).step_by(2).map(|s| 1usize << s).collect(),
    };
    sizes
        .into_iter()
        .map(|b| {
            let mut c = vec![OneShot, TwoShot, OneShotPush, TwoShotPush];
            // LL carries 8 data bytes per 16-byte line: never a candidate
            // where bandwidth rules.
            if b <= 4 << 20 {
                c.push(OneShotLl);
            }
            (b, c)
        })
        .collect()
}

const WARMUP: usize = 2;
const ITERS: usize = 5;

/// Tune `comm`'s all-reduce ladder. Collective over `comm`.
pub(crate) fn tune<D: Device>(comm: &Communicator<D>) -> Result<TuneReport> {
    let started = Instant::now();
    let key = cache_key(comm);
    let file = crate::cache::cache_dir().map(|d| d.join("autotune").join(format!("{:016x}.txt", fnv64(&key))));
    // Rank 0 decides: its cached table, or measure now.
    let mine = match (comm.rank(), &file) {
        (0, Some(f)) => read_cached(f, &key).map(|l| format!("cached {}", encode(&l))),
        _ => None,
    }
    .unwrap_or_else(|| "measure".into());
    let decision = agree(comm, "decide", mine.as_bytes())?;
    if let Some(ladder) = decision.strip_prefix("cached ") {
        let ladder = decode(ladder)?;
        let path = file.unwrap_or_default();
        return Ok(TuneReport {
            source: TuneSource::Cached(path),
            ladder,
            timings: Vec::new(),
        });
    }
    let timings = measure(comm)?;
    let ladder = ladder_from(&timings);
    let chosen = agree(comm, "ladder", encode(&ladder).as_bytes())?;
    let ladder = decode(&chosen)?;
    if comm.rank() == 0 {
        if let Some(f) = &file {
            if let Err(e) = write_cached(f, &key, &ladder) {
                crate::fc_log!(
                    tracing::Level::WARN,
                    "autotune: could not cache the table at {}: {e}",
                    f.display()
                );
            }
        }
    }
    Ok(TuneReport {
        source: TuneSource::Measured(started.elapsed()),
        ladder,
        timings,
    })
}

/// Rank 0's `value`, as every rank receives it.
fn agree<D: Device>(comm: &Communicator<D>, what: &str, value: &[u8]) -> Result<String> {
    let inner = &*comm.inner;
    let key = inner.next_key(&format!("autotune-{what}"));
    let all = store_all_gather(
        inner.store.as_ref(),
        &key,
        inner.rank,
        inner.world,
        value,
        inner.opts.timeout,
    )?;
    String::from_utf8(all[0].clone()).map_err(|_| Error::invalid("autotune: rank 0 sent a table that is not text"))
}

/// Time every candidate of the plan; rank-local medians in microseconds.
fn measure<D: Device>(comm: &Communicator<D>) -> Result<Vec<(usize, Algorithm, f64)>> {
    let inner = &*comm.inner;
    let dev = &inner.device;
    let plan = plan(dev.facts().backend);
    let largest = plan.iter().map(|(b, _)| *b).max().unwrap_or(0);
    // The kernels first, so no measurement waits for a compile.
    let names: Vec<String> = Algorithm::CUSTOM
        .iter()
        .filter_map(|a| a.kernel_kind())
        .map(|k| crate::algo::kernels::kernel_name(k, DType::BF16, ReduceOp::Sum))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    comm.with_resources(|res| dev.prepare(&res.module, &names))??;
    let buf = comm.alloc(largest)?;
    let stream = comm.stream();
    let (start, end) = (dev.create_event()?, dev.create_event()?);
    let mut out = Vec::new();
    for (bytes, algos) in plan {
        let t = Tensor::of(&buf, DType::BF16).slice(0, bytes / 2)?;
        for algo in algos {
            let call = Call::on(stream).algo(AlgoChoice::Fixed(algo));
            for _ in 0..WARMUP {
                comm.all_reduce(t, ReduceOp::Sum, &call)?;
            }
            let mut samples = Vec::with_capacity(ITERS);
            for _ in 0..ITERS {
                dev.record(&start, stream)?;
                let w = comm.all_reduce(t, ReduceOp::Sum, &call)?;
                dev.record(&end, stream)?;
                w.wait(None)?;
                dev.synchronize(stream)?;
                samples.push(dev.elapsed_ms(&start, &end)? as f64 * 1000.0);
            }
            samples.sort_by(f64::total_cmp);
            out.push((bytes, algo, samples[samples.len() / 2]));
        }
    }
    Ok(out)
}

/// The fastest algorithm per size as a ladder: each measured size's winner
/// runs up to that size, the last one beyond it.
fn ladder_from(timings: &[(usize, Algorithm, f64)]) -> Vec<Step> {
    let mut sizes: Vec<usize> = timings.iter().map(|t| t.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut ladder: Vec<Step> = Vec::new();
    for &b in &sizes {
        let best = timings
            .iter()
            .filter(|t| t.0 == b)
            .min_by(|x, y| x.2.total_cmp(&y.2))
            .map(|t| t.1)
            .unwrap_or(Algorithm::TwoShotPush);
        match ladder.last_mut() {
            Some(last) if last.algo == best => last.max_bytes = b,
            _ => ladder.push(Step {
                max_bytes: b,
                algo: best,
            }),
        }
    }
    match ladder.last_mut() {
        Some(last) => last.max_bytes = usize::MAX,
        None => ladder.push(Step {
            max_bytes: usize::MAX,
            algo: Algorithm::TwoShotPush,
        }),
    }
    ladder
}

/// `max_bytes:algo` pairs, comma separated (`max` for the last step).
fn encode(ladder: &[Step]) -> String {
    ladder
        .iter()
        .map(|s| match s.max_bytes {
            usize::MAX => format!("max:{}", s.algo),
            b => format!("{b}:{}", s.algo),
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn decode(s: &str) -> Result<Vec<Step>> {
    let bad = || Error::invalid(format!("autotune table {s:?} is not `bytes:algo,...,max:algo`"));
    let ladder = s
        .trim()
        .split(',')
        .map(|step| {
            let (b, a) = step.split_once(':').ok_or_else(bad)?;
            let max_bytes = match b {
                "max" => usize::MAX,
                b => b.parse().map_err(|_| bad())?,
            };
            match a.parse::<AlgoChoice>()? {
                AlgoChoice::Fixed(algo) if Algorithm::CUSTOM.contains(&algo) => Ok(Step { max_bytes, algo }),
                _ => Err(bad()),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let increasing = ladder.windows(2).all(|w| w[0].max_bytes < w[1].max_bytes);
    if ladder.last().map(|s| s.max_bytes) != Some(usize::MAX) || !increasing {
        return Err(bad());
    }
    Ok(ladder)
}

/// What a table depends on.
fn cache_key<D: Device>(comm: &Communicator<D>) -> String {
    let inner = &*comm.inner;
    let f = inner.device.facts();
    format!(
        "ferrocomm {} autotune v1; {} {} {} {} SMs; world {} on {}; slot {}; {}; NCCL/RCCL {}",
        env!("CARGO_PKG_VERSION"),
        f.backend.name(),
        f.name,
        f.arch,
        f.multiprocessors,
        inner.world,
        inner.topology.describe(),
        inner.opts.slot_bytes_for(f.backend),
        inner.device.runtime_info(),
        comm.with_resources(|r| r.vendor.describe()).unwrap_or_default(),
    )
}

fn fnv64(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The cached ladder, if the file is ours, for this key, and well formed.
fn read_cached(path: &PathBuf, key: &str) -> Option<Vec<Step>> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o022 != 0 {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let (k, ladder) = text.split_once('\n')?;
    (k == key).then(|| decode(ladder).ok()).flatten()
}

fn write_cached(path: &PathBuf, key: &str, ladder: &[Step]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = path.parent().unwrap_or(path);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    writeln!(f, "{key}")?;
    writeln!(f, "{}", encode(ladder))?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ladders_encode_and_decode() {
        let l = vec![
            Step {
                max_bytes: 4096,
                algo: Algorithm::OneShotLl,
            },
            Step {
                max_bytes: usize::MAX,
                algo: Algorithm::TwoShotPush,
            },
        ];
        assert_eq!(encode(&l), "4096:oneshot-ll,max:twoshot-push");
        assert_eq!(decode(&encode(&l)).unwrap(), l);
        assert!(decode("4096:oneshot").is_err(), "no unbounded last step");
        assert!(decode("max:nccl").is_err(), "only ferrocomm's kernels");
        assert!(decode("9:oneshot,4:twoshot,max:oneshot").is_err(), "not increasing");
    }

    #[test]
    fn the_fastest_per_size_makes_the_ladder() {
        use Algorithm::*;
        let t = [
            (1024, OneShotLl, 3.0),
            (1024, OneShotPush, 5.0),
            (4096, OneShotLl, 3.5),
            (4096, OneShotPush, 5.0),
            (16384, OneShotLl, 9.0),
            (16384, OneShotPush, 6.0),
            (65536, TwoShotPush, 7.0),
            (65536, OneShotPush, 8.0),
        ];
        let l = ladder_from(&t);
        assert_eq!(encode(&l), "4096:oneshot-ll,16384:oneshot-push,max:twoshot-push");
    }
}
