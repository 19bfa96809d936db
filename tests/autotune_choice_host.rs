//! After autotune at init, dispatch runs what the table says, and explicit
//! choices still win over it: on the host backend, with the host launch
//! counter (`backends::host::launches`) showing which kernel a call took, as
//! `tests/ll_choice_host.rs` does. The table is either measured (the first
//! communicator of a cache directory) or injected (a cache file rewritten
//! with a chosen table, read by the next communicator); cache files of
//! another version, foreign or corrupt ones are measured over, never an
//! error.
//!
//! A test binary of its own: no other test's launches add to the
//! process-wide counts it compares, and its tests take one lock (they set
//! `FERROCOMM_CACHE_DIR` and compare counts).

use std::path::{Path, PathBuf};
use std::sync::{Barrier, Mutex};
use std::time::Duration;

use ferrocomm::algo::kernels::kernel_name;
use ferrocomm::backends::host::{launches, HostBuffer, HostDevice};
use ferrocomm::plan::step_for;
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::{
    Algorithm, Call, Collective, CommOptions, Communicator, DType, DtypeClass, ReduceOp, Result, Tensor, TuneReport,
    TuneSource,
};

static SERIAL: Mutex<()> = Mutex::new(());

const WORLD: usize = 2;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh cache directory for one test, set for the communicators it creates.
fn cache_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrocomm-autotune-choice-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Under `SERIAL`: no other thread of this binary reads the environment now.
    std::env::set_var("FERROCOMM_CACHE_DIR", &dir);
    dir
}

fn opts() -> CommOptions {
    CommOptions::default()
        .with_timeout(Duration::from_secs(60))
        .with_slot_bytes(1 << 20)
        .with_autotune(true)
}

/// Every kernel a call of this test can take.
fn kernels() -> Vec<String> {
    let mut k = vec![
        "fc_exchange".to_string(),
        "fc_exchange_ll".to_string(),
        "fc_exchange_direct".to_string(),
        "fc_copy_sync".to_string(),
    ];
    for dtype in [DType::BF16, DType::F32] {
        for kind in Algorithm::ALL_REDUCE_KERNELS.iter().filter_map(|a| a.all_reduce_kind()) {
            k.push(kernel_name(kind, dtype, ReduceOp::Sum));
        }
        for kind in ["reduce_to", "reduce_to_ll", "reduce_to_direct"] {
            k.push(format!("fc_{kind}_{}_sum", dtype.name()));
        }
    }
    k
}

/// Collective probes over the ranks of one test: which kernels a call
/// launched, counted between barriers so that the ranks' other calls
/// (autotune at init, earlier probes) do not count.
struct Probe {
    barrier: Barrier,
    names: Vec<String>,
    before: Mutex<Vec<u64>>,
    ran: Mutex<Vec<String>>,
}

impl Probe {
    fn new() -> Self {
        Probe {
            barrier: Barrier::new(WORLD),
            names: kernels(),
            before: Mutex::new(Vec::new()),
            ran: Mutex::new(Vec::new()),
        }
    }

    /// Run `call` on every rank; the kernels it launched (on any rank).
    fn kinds(&self, rank: usize, call: impl FnOnce() -> Result<()>) -> Result<Vec<String>> {
        self.barrier.wait();
        if rank == 0 {
            *self.before.lock().unwrap() = self.names.iter().map(|n| launches(n)).collect();
        }
        self.barrier.wait();
        call()?;
        self.barrier.wait();
        if rank == 0 {
            let before = self.before.lock().unwrap();
            *self.ran.lock().unwrap() = self
                .names
                .iter()
                .zip(before.iter())
                .filter(|(n, b)| launches(n) > **b)
                .map(|(n, _)| n.clone())
                .collect();
        }
        self.barrier.wait();
        Ok(self.ran.lock().unwrap().clone())
    }
}

/// One rank's buffers: `a` the all-reduce's and the others' outputs, `b`
/// their inputs (the largest call: a 1 MiB all-reduce).
struct Bufs {
    a: HostBuffer,
    b: HostBuffer,
}

fn bufs(comm: &Communicator<HostDevice>) -> Result<Bufs> {
    Ok(Bufs {
        a: comm.alloc(WORLD << 20)?,
        b: comm.alloc(WORLD << 20)?,
    })
}

/// One call of `coll` with `bytes` (all-reduce: payload; others: per peer)
/// of `dtype`, waited for.
fn run(
    comm: &Communicator<HostDevice>,
    b: &Bufs,
    coll: Collective,
    dtype: DType,
    bytes: usize,
    call: &Call<'_, HostDevice>,
) -> Result<()> {
    let n = bytes / dtype.size();
    let (ta, tb) = (Tensor::of(&b.a, dtype), Tensor::of(&b.b, dtype));
    let w = match coll {
        Collective::AllReduce => comm.all_reduce(ta.slice(0, n)?, ReduceOp::Sum, call)?,
        Collective::AllGather => comm.all_gather_single(ta.slice(0, n * WORLD)?, tb.slice(0, n)?, call)?,
        Collective::ReduceScatter => {
            comm.reduce_scatter_single(ta.slice(0, n)?, tb.slice(0, n * WORLD)?, ReduceOp::Sum, call)?
        }
        Collective::AllToAll => comm.all_to_all_single(ta.slice(0, n * WORLD)?, tb.slice(0, n * WORLD)?, call)?,
        other => panic!("no ladder for {other}"),
    };
    w.wait(None)
}

/// The kernel a table's choice launches.
fn ar_kernel(algo: Algorithm, dtype: DType) -> String {
    kernel_name(algo.all_reduce_kind().expect("a kernel"), dtype, ReduceOp::Sum)
}

fn coll_kernel(coll: Collective, kind: Algorithm, dtype: DType) -> String {
    match (coll, kind) {
        (Collective::ReduceScatter, Algorithm::Ll) => format!("fc_reduce_to_ll_{}_sum", dtype.name()),
        (Collective::ReduceScatter, _) => format!("fc_reduce_to_{}_sum", dtype.name()),
        (_, Algorithm::Ll) => "fc_exchange_ll".into(),
        // The copy route moves data with copies; its handshake is the kernel.
        (_, Algorithm::Copy) => "fc_copy_sync".into(),
        _ => "fc_exchange".into(),
    }
}

/// Run `f` on two thread ranks with `opts`, each with its communicator, its
/// buffers and the shared probe; every rank's report.
fn with_pair<F>(opts: CommOptions, f: F) -> Vec<Option<TuneReport>>
where
    F: Fn(&Communicator<HostDevice>, usize, &Bufs, &Probe) -> Result<()> + Sync,
{
    let probe = Probe::new();
    run_thread_ranks(WORLD, |rank, world, store| {
        let comm = Communicator::new(HostDevice::new(rank)?, store, rank, world, opts.clone())?;
        let b = bufs(&comm)?;
        f(&comm, rank, &b, &probe)?;
        let report = comm.autotune_report();
        comm.finalize()?;
        Ok(report)
    })
    .into_iter()
    .map(|r| r.expect("rank failed"))
    .collect()
}

/// The one cache file of `dir`.
fn cache_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir.join("autotune"))
        .expect("an autotune cache directory")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

/// Write `text` to `path` with `mode` (0600: as autotune writes its files).
fn write_mode(path: &Path, text: &str, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn source(reports: &[Option<TuneReport>]) -> TuneSource {
    let r = reports[0].as_ref().expect("autotune ran");
    let other = reports[1].as_ref().expect("autotune ran");
    assert_eq!(r.table, other.table, "ranks adopt rank 0's table");
    r.source.clone()
}

#[test]
fn a_measured_table_is_what_dispatch_runs() {
    let _g = serial();
    let dir = cache_dir("measured");
    let reports = with_pair(opts(), |comm, rank, b, probe| {
        let table = comm.autotune_report().expect("autotune ran").table;
        for class in DtypeClass::ALL {
            let dtype = class.representative();
            // At the sizes the host plan measures.
            for bytes in [4096usize, 16384, 65536, 262144, 1 << 20] {
                let want = step_for(table.all_reduce(class), bytes).unwrap().algo;
                let ran = probe.kinds(rank, || run(comm, b, Collective::AllReduce, dtype, bytes, &Call::new()))?;
                assert_eq!(ran, [ar_kernel(want, dtype)], "all-reduce {class} {bytes} B");
            }
            for coll in [Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll] {
                for bytes in [4096usize, 16384, 65536, 262144] {
                    let want = step_for(table.coll(coll, class), bytes).unwrap().algo;
                    let ran = probe.kinds(rank, || run(comm, b, coll, dtype, bytes, &Call::new()))?;
                    assert_eq!(ran, [coll_kernel(coll, want, dtype)], "{coll} {class} {bytes} B a peer");
                }
            }
        }
        Ok(())
    });
    assert!(matches!(source(&reports), TuneSource::Measured(_)));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The table injected into the cache: unlike the defaults wherever it can be.
const INJECTED: &str = "\
all_reduce narrow max:oneshot
all_reduce wide max:twoshot
all_gather narrow 8192:inbox,max:ll
all_gather wide 8192:inbox,max:ll
reduce_scatter narrow max:ll
reduce_scatter wide max:inbox
all_to_all narrow 8192:ll,max:inbox
all_to_all wide 8192:ll,max:inbox
";

#[test]
fn an_injected_table_is_what_dispatch_runs_and_explicit_choices_win() {
    let _g = serial();
    let dir = cache_dir("injected");
    // The first pair measures and caches; its file then gets our table.
    let first = with_pair(opts(), |_, _, _, _| Ok(()));
    assert!(matches!(source(&first), TuneSource::Measured(_)));
    let file = cache_file(&dir);
    let text = std::fs::read_to_string(&file).unwrap();
    let key = text.lines().next().unwrap();
    assert!(key.contains("autotune v2") && key.contains("deterministic 1"), "{key}");
    write_mode(&file, &format!("{key}\n{INJECTED}"), 0o600);

    use Collective::*;
    let (bf16, f32) = (DType::BF16, DType::F32);
    let reports = with_pair(opts(), |comm, rank, b, probe| {
        let kinds = |coll, dtype, bytes, call: &Call<'_, HostDevice>| {
            probe.kinds(rank, || run(comm, b, coll, dtype, bytes, call))
        };
        let plain = Call::new();
        // All-reduce per dtype class.
        assert_eq!(kinds(AllReduce, bf16, 4000, &plain)?, ["fc_oneshot_bf16_sum"]);
        assert_eq!(kinds(AllReduce, f32, 4000, &plain)?, ["fc_twoshot_f32_sum"]);
        // All-gather: the inbox for small blocks (the defaults take LL), LL
        // above; a block past what LL lines carry (128 KiB a peer at 1 MiB
        // slots) passes to the next step, here none: the inbox.
        assert_eq!(kinds(AllGather, f32, 4000, &plain)?, ["fc_exchange"]);
        assert_eq!(kinds(AllGather, f32, 64000, &plain)?, ["fc_exchange_ll"]);
        assert_eq!(kinds(AllGather, f32, 400_000, &plain)?, ["fc_exchange"]);
        // Reduce-scatter per dtype class.
        assert_eq!(kinds(ReduceScatter, bf16, 4000, &plain)?, ["fc_reduce_to_ll_bf16_sum"]);
        assert_eq!(kinds(ReduceScatter, f32, 4000, &plain)?, ["fc_reduce_to_f32_sum"]);
        // All-to-all: LL only for small blocks (the defaults go to 256 KiB).
        assert_eq!(kinds(AllToAll, f32, 4000, &plain)?, ["fc_exchange_ll"]);
        assert_eq!(kinds(AllToAll, f32, 64000, &plain)?, ["fc_exchange"]);

        // A call's choice wins over the table, the method and the hint alike,
        // where its kind can run the call.
        let ll_hint = Call::new().hint("coll_algo", "ll");
        assert_eq!(kinds(AllGather, f32, 4000, &ll_hint)?, ["fc_exchange_ll"]);
        assert_eq!(kinds(AllToAll, f32, 64000, &ll_hint)?, ["fc_exchange_ll"]);
        assert_eq!(kinds(ReduceScatter, f32, 4000, &ll_hint)?, ["fc_reduce_to_ll_f32_sum"]);
        assert_eq!(
            kinds(AllGather, f32, 400_000, &ll_hint)?,
            ["fc_exchange"],
            "LL cannot carry it"
        );
        let inbox = Call::new().coll_algo(Algorithm::Inbox);
        assert_eq!(kinds(ReduceScatter, bf16, 4000, &inbox)?, ["fc_reduce_to_bf16_sum"]);
        assert_eq!(kinds(AllGather, f32, 64000, &inbox)?, ["fc_exchange"]);
        // No NCCL/RCCL on the host: a vendor choice leaves it to the table.
        let vendor = Call::new().hint("coll_algo", "vendor");
        assert_eq!(kinds(AllGather, f32, 64000, &vendor)?, ["fc_exchange_ll"]);
        assert_eq!(
            kinds(AllGather, f32, 64000, &Call::new().hint("coll_algo", "auto"))?,
            ["fc_exchange_ll"]
        );
        // An unreadable hint is an error before anything runs, on every rank.
        assert!(run(comm, b, AllGather, f32, 4000, &Call::new().hint("coll_algo", "fast")).is_err());
        // All-reduce: `Call::algo` and the `algo` hint.
        let fixed = Call::new().algo(Algorithm::TwoShotPush);
        assert_eq!(kinds(AllReduce, bf16, 4000, &fixed)?, ["fc_twoshot_push_bf16_sum"]);
        let hinted = Call::new().hint("algo", "oneshot-ll");
        assert_eq!(kinds(AllReduce, f32, 4000, &hinted)?, ["fc_oneshot_ll_f32_sum"]);
        Ok(())
    });
    for r in &reports {
        let r = r.as_ref().unwrap();
        assert!(matches!(r.source, TuneSource::Cached(_)), "{:?}", r.source);
        assert!(r.timings.is_empty());
        assert_eq!(r.table.coll(AllGather, DtypeClass::Wide)[0].algo, Algorithm::Inbox);
    }

    // Options win over the table: FERROCOMM_COLL_LL_BYTES (0: no LL; a
    // threshold: LL up to it, whatever the table says) and FERROCOMM_ALGO.
    // The cache key does not hold them: the same injected table is read.
    let no_ll = opts().with_coll_ll_bytes(0);
    let reports = with_pair(no_ll, |comm, rank, b, probe| {
        let kinds = |coll, dtype, bytes| probe.kinds(rank, || run(comm, b, coll, dtype, bytes, &Call::new()));
        assert_eq!(kinds(ReduceScatter, bf16, 4000)?, ["fc_reduce_to_bf16_sum"]);
        assert_eq!(kinds(AllGather, f32, 64000)?, ["fc_exchange"]);
        assert_eq!(kinds(AllToAll, f32, 4000)?, ["fc_exchange"]);
        // The call still wins over the option.
        let ll = Call::new().coll_algo(Algorithm::Ll);
        assert_eq!(
            probe.kinds(rank, || run(comm, b, AllToAll, f32, 4000, &ll))?,
            ["fc_exchange_ll"]
        );
        Ok(())
    });
    assert!(matches!(source(&reports), TuneSource::Cached(_)));
    let ll_8k = opts().with_coll_ll_bytes(8192).with_algo(Algorithm::OneShotPush);
    with_pair(ll_8k, |comm, rank, b, probe| {
        let kinds = |coll, dtype, bytes| probe.kinds(rank, || run(comm, b, coll, dtype, bytes, &Call::new()));
        assert_eq!(kinds(AllGather, f32, 4000)?, ["fc_exchange_ll"], "the table says inbox");
        assert_eq!(kinds(AllGather, f32, 64000)?, ["fc_exchange"], "the table says LL");
        assert_eq!(kinds(ReduceScatter, f32, 4000)?, ["fc_reduce_to_ll_f32_sum"]);
        assert_eq!(kinds(AllReduce, bf16, 4000)?, ["fc_oneshot_push_bf16_sum"]);
        assert_eq!(kinds(AllReduce, f32, 4000)?, ["fc_oneshot_push_f32_sum"]);
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn old_foreign_and_corrupt_caches_are_measured_over() {
    let _g = serial();
    let dir = cache_dir("bad");
    let measured = |what: &str| {
        let r = with_pair(opts(), |_, _, _, _| Ok(()));
        assert!(
            matches!(source(&r), TuneSource::Measured(_)),
            "{what}: {:?}",
            source(&r)
        );
    };
    let cached = || {
        let r = with_pair(opts(), |_, _, _, _| Ok(()));
        assert!(matches!(source(&r), TuneSource::Cached(_)), "{:?}", source(&r));
    };
    measured("empty cache");
    let file = cache_file(&dir);
    let good = std::fs::read_to_string(&file).unwrap();
    let (key, table) = good.split_once('\n').unwrap();
    cached();
    // Corrupt: the key, then garbage, or a table missing a ladder.
    write_mode(&file, &format!("{key}\nall_reduce narrow 4096:oneshot\n"), 0o600);
    measured("garbage");
    let partial: String = table.lines().skip(1).map(|l| format!("{l}\n")).collect();
    write_mode(&file, &format!("{key}\n{partial}"), 0o600);
    measured("a ladder missing");
    // Another version's key (a v1 file had one ladder; its key said v1).
    write_mode(
        &file,
        &format!("{}\n{table}", key.replace("autotune v2", "autotune v1")),
        0o600,
    );
    measured("version 1");
    write_mode(
        &file,
        &format!("{}\n4096:oneshot-ll,max:twoshot-push\n", key.replace("v2", "v1")),
        0o600,
    );
    measured("version 1 format");
    // Foreign: writable by others (the owner check is the same test's).
    write_mode(&file, &good, 0o666);
    measured("world-writable");
    // Each re-measure rewrote the file, privately, and it reads again.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(cache_file(&dir)).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "{mode:o}");
    cached();
    // FERROCOMM_AUTOTUNE=0 (the option): no autotune, no report.
    let off = with_pair(opts().with_autotune(false), |_, _, _, _| Ok(()));
    assert!(off.iter().all(Option::is_none));
    let _ = std::fs::remove_dir_all(&dir);
}
