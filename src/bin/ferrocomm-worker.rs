//! One rank of a multi-process test. Launched N times by the process-mode
//! tests (and by `ci/gpu-cuda.sh`) with `RANK`/`WORLD_SIZE` and either
//! `FERROCOMM_STORE_ADDR` (connect to a store the launcher hosts) or the
//! torchrun variables (`MASTER_ADDR`, `MASTER_PORT`, ...).
//!
//! Scenarios:
//! - `conformance`: the conformance suite; exit 0 iff it passed.
//! - `kill`: a collective (`--coll`, default all_reduce) in a loop; the
//!   victim kills itself mid-loop; the others must get an error within 2x
//!   the timeout.
//! - `stall`: the victim sleeps past the timeout; the others must get a
//!   timeout naming it.
//! - `mismatch`: rank 0 passes a different count (`--coll all_reduce`),
//!   different all-to-all splits (`--coll all_to_all`: ranks 0 and 1 must
//!   both see the mismatch), or calls all-reduce where the others call an
//!   all-gather of the same bytes (`--coll crossed`: a mismatch, well
//!   before the timeout); every rank must get an error.
//! - `finalize`: use after finalize, double finalize and abort return errors.
//! - `replay`: capture one all-reduce per algorithm into a graph and replay it
//!   `--replays` times, changing the input before every replay and checking
//!   every output.
//! - `smoke`: one small launch of every kernel family (for compute-sanitizer).
//! - `heap`: the symmetric heap and window suite (on GPUs also the
//!   user-style all-gather on the device API).
//! - `ep`: the EP dispatch and combine suite (`ferrocomm::testing::ep`).
//! - `fuzz`: the randomized differential fuzz of the public API
//!   (`ferrocomm::testing::fuzz`; `FERROCOMM_FUZZ_TRIALS`, default 300, and
//!   `--max-bytes`, capped at 4 MiB by default).
//! - `coldstart`: the time from process start to a communicator that has run
//!   its first all-reduce (point `FERROCOMM_CACHE_DIR` at an empty directory
//!   to measure a cold kernel cache), printed as `COLD START ...`.
//! - `broadcaster`, `broadcaster-kill`, `broadcaster-stall`: the metadata
//!   broadcaster (`--max-bytes`: its slot size; `--writer`: its writer,
//!   default 0); see `ferrocomm-worker/scenarios/broadcaster.rs`.
//! - `precompile-cuda`: compile the CUDA kernels for `--cc` (default 9.0) into
//!   `FERROCOMM_CACHE_DIR` with no GPU, one kernel per compile on every
//!   core, so a GPU machine skips NVRTC.
//!
//! Each prints one `RESULT ok ...` or `RESULT fail ...` line.

#[path = "ferrocomm-worker/scenarios/broadcaster.rs"]
mod broadcaster;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrocomm::bootstrap::{rendezvous_from_env, Store, TcpStore};
use ferrocomm::device::Device;
use ferrocomm::testing::conformance::{run_suite, SuiteConfig, SuiteReport};
use ferrocomm::{Call, CommOptions, Communicator, DType, Error, P2p, ReduceOp, Result, Tensor};

struct Args {
    scenario: String,
    backend: String,
    victim: usize,
    timeout: Duration,
    max_bytes: usize,
    replays: usize,
    /// Compute capability for `precompile-cuda`.
    cc: (i32, i32),
    /// The collective `kill`, `stall` and `mismatch` run.
    coll: String,
    /// The broadcaster scenarios' writer rank.
    writer: usize,
}

fn parse_args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let scenario = it.next().ok_or_else(|| {
        Error::invalid(
            "usage: ferrocomm-worker <scenario> [--backend B] [--victim R] [--timeout-secs S] [--max-bytes N] \
             [--coll all_reduce|all_gather|reduce_scatter|all_to_all|sendrecv|broadcast|reduce] [--writer R]",
        )
    })?;
    let mut a = Args {
        scenario,
        backend: "host".into(),
        victim: 1,
        timeout: Duration::from_secs(3),
        max_bytes: 64 << 20,
        replays: 10_000,
        cc: (9, 0),
        coll: "all_reduce".into(),
        writer: 0,
    };
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| Error::invalid(format!("{flag} needs a value")))?;
        let bad = || Error::invalid(format!("bad value {value:?} for {flag}"));
        match flag.as_str() {
            "--backend" => a.backend = value.clone(),
            "--victim" => a.victim = value.parse().map_err(|_| bad())?,
            "--timeout-secs" => a.timeout = Duration::from_secs_f64(value.parse().map_err(|_| bad())?),
            "--max-bytes" => a.max_bytes = value.parse().map_err(|_| bad())?,
            "--replays" => a.replays = value.parse().map_err(|_| bad())?,
            "--coll" => a.coll = value.clone(),
            "--writer" => a.writer = value.parse().map_err(|_| bad())?,
            "--cc" => {
                let (major, minor) = value.split_once('.').ok_or_else(bad)?;
                a.cc = (major.parse().map_err(|_| bad())?, minor.parse().map_err(|_| bad())?);
            }
            _ => return Err(Error::invalid(format!("unknown flag {flag}"))),
        }
    }
    Ok(a)
}

fn env_usize(name: &str) -> Result<usize> {
    let v = std::env::var(name).map_err(|_| Error::invalid(format!("{name} is not set")))?;
    v.parse()
        .map_err(|_| Error::invalid(format!("{name}={v:?} is not a number")))
}

/// This rank's place in the job.
struct Job {
    store: Arc<dyn Store>,
    rank: usize,
    world: usize,
    local_rank: usize,
    /// Keeps the store server alive when this rank hosts it (see `run`).
    rdv: Option<ferrocomm::bootstrap::EnvRendezvous>,
}

/// Join the job through a launcher-hosted store, or through torchrun variables.
fn connect() -> Result<Job> {
    if let Ok(addr) = std::env::var("FERROCOMM_STORE_ADDR") {
        let addr = addr
            .parse()
            .map_err(|_| Error::invalid(format!("FERROCOMM_STORE_ADDR={addr:?}")))?;
        let token = std::env::var("FERROCOMM_TOKEN").map_err(|_| Error::invalid("FERROCOMM_TOKEN is not set"))?;
        let store: Arc<dyn Store> = Arc::new(TcpStore::connect(addr, token.as_bytes(), Duration::from_secs(30))?);
        let rank = env_usize("RANK")?;
        return Ok(Job {
            store,
            rank,
            world: env_usize("WORLD_SIZE")?,
            local_rank: env_usize("LOCAL_RANK").unwrap_or(rank),
            rdv: None,
        });
    }
    let rdv = rendezvous_from_env()?;
    Ok(Job {
        store: rdv.store.clone(),
        rank: rdv.rank,
        world: rdv.world,
        local_rank: rdv.local_rank,
        rdv: Some(rdv),
    })
}

fn main() -> ExitCode {
    match run() {
        Ok(msg) => {
            println!("RESULT ok {msg}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("RESULT fail {e}");
            ExitCode::FAILURE
        }
    }
}

/// When the process started (for `coldstart`).
static STARTED: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn run() -> Result<String> {
    STARTED.get_or_init(Instant::now);
    let args = parse_args()?;
    if args.scenario == "precompile-cuda" {
        return precompile_cuda(&args);
    }
    let job = connect()?;
    let (store, rank, world, local) = (job.store.clone(), job.rank, job.world, job.local_rank);
    let outcome = run_scenario(&args, store, rank, world, local);
    // Rank 0 hosts the store under an environment rendezvous: it stays
    // until the others are done with it, whatever the scenario gave.
    let left = job.rdv.as_ref().map_or(Ok(()), |r| r.depart());
    let msg = outcome?;
    left.map(|()| msg)
}

fn run_scenario(args: &Args, store: Arc<dyn Store>, rank: usize, world: usize, local: usize) -> Result<String> {
    match args.backend.as_str() {
        "host" => scenario(
            ferrocomm::backends::host::HostDevice::new(local)?,
            store,
            rank,
            world,
            args,
        ),
        #[cfg(feature = "cuda")]
        "cuda" => scenario(
            ferrocomm::backends::cuda::CudaDevice::new(cuda_index(local)?)?,
            store,
            rank,
            world,
            args,
        ),
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err(Error::NotCompiled {
            backend: "cuda",
            feature: "cuda",
        }),
        #[cfg(feature = "rocm")]
        "hip" | "rocm" => scenario(
            ferrocomm::backends::hip::HipDevice::new(local)?,
            store,
            rank,
            world,
            args,
        ),
        #[cfg(not(feature = "rocm"))]
        "hip" | "rocm" => Err(Error::NotCompiled {
            backend: "hip",
            feature: "rocm",
        }),
        other => Err(Error::invalid(format!("unknown backend {other:?}"))),
    }
}

/// The GPU a rank opens: its local rank, or with `FERROCOMM_TEST_SHARE_GPU=1`
/// that modulo the GPUs there are, so that a one-GPU machine runs the
/// multi-process protocols (processes time-slice the GPU; no performance
/// meaning). Shared ranks need `FERROCOMM_CCL=0`: NCCL refuses two ranks on
/// one GPU.
#[cfg(feature = "cuda")]
fn cuda_index(local: usize) -> Result<usize> {
    if std::env::var("FERROCOMM_TEST_SHARE_GPU").as_deref() != Ok("1") {
        return Ok(local);
    }
    Ok(local % ferrocomm::backends::cuda::device_count()?.max(1))
}

/// The `RESULT` line of a suite (`what`: what it counts): its checks, or
/// every failure.
fn suite_result(rank: usize, what: &str, report: SuiteReport) -> Result<String> {
    if report.is_ok() {
        Ok(format!(
            "rank={rank} {what}={} elements={}",
            report.collectives, report.elements_checked
        ))
    } else {
        Err(Error::Aborted(format!(
            "{what}: failures on rank {rank}: {:#?}",
            report.failures
        )))
    }
}

fn scenario<D: Device>(dev: D, store: Arc<dyn Store>, rank: usize, world: usize, a: &Args) -> Result<String> {
    let mut opts = CommOptions::from_env()?.with_timeout(a.timeout);
    if a.scenario == "heap" || a.scenario == "ep" {
        // The heap suite checks the kinds the library picks (by the epochs
        // they take), which an autotune table an earlier bench cached on the
        // machine would override (as in tests/heap_cuda.rs); EP does not
        // use the table (as in tests/ep_cuda.rs).
        opts = opts.with_autotune(false);
    }
    let device_ready = STARTED.get().map_or(0.0, |t| t.elapsed().as_secs_f64());
    let comm = Communicator::new(dev, store.clone(), rank, world, opts)?;
    let comm_ready = STARTED.get().map_or(0.0, |t| t.elapsed().as_secs_f64());
    if a.scenario == "coldstart" {
        let buf = comm.alloc(1 << 20)?;
        comm.all_reduce(Tensor::of(&buf, DType::BF16), ReduceOp::Sum, &Call::new())?
            .wait(None)?;
        let first = STARTED.get().map_or(0.0, |t| t.elapsed().as_secs_f64());
        // What the rest of the module costs, compiled in the background.
        comm.prepare()?;
        let all = STARTED.get().map_or(0.0, |t| t.elapsed().as_secs_f64());
        comm.finalize()?;
        return Ok(format!(
            "COLD START rank={rank}: device {device_ready:.2} s, communicator {comm_ready:.2} s, \
             first all_reduce done {first:.2} s after process start; every kernel ready at {all:.2} s"
        ));
    }
    match a.scenario.as_str() {
        "fuzz" => {
            let mut cfg = ferrocomm::testing::fuzz::FuzzConfig::from_env(300, a.max_bytes.min(4 << 20));
            cfg.timeout = a.timeout.max(Duration::from_secs(60));
            let r = ferrocomm::testing::fuzz::run_fuzz(&comm, store.as_ref(), &cfg)?;
            comm.finalize()?;
            if r.is_clean() && r.trials == cfg.trials {
                Ok(format!(
                    "rank={rank} fuzz trials={} wrong=0 clobbered=0 disagreements=0 errors=0 refused={} \
                     bytes_checked={} calls={:?}",
                    r.trials,
                    r.refused.len(),
                    r.bytes_checked,
                    r.calls
                ))
            } else {
                Err(Error::Aborted(format!(
                    "fuzz on rank {rank}: {} of {} trials, {} wrong, {} clobbered, {} disagreements, errors {:?}, \
                     failures {:#?}",
                    r.trials, cfg.trials, r.wrong, r.clobbered, r.disagreements, r.errors, r.failures
                )))
            }
        }
        "conformance" => {
            let cfg = SuiteConfig {
                max_bytes: a.max_bytes,
                timeout: a.timeout.max(Duration::from_secs(60)),
                ..SuiteConfig::default()
            };
            let report = run_suite(&comm, store.as_ref(), &cfg)?;
            comm.finalize()?;
            if report.is_ok() {
                Ok(format!(
                    "rank={rank} collectives={} elements={} on {}",
                    report.collectives,
                    report.elements_checked,
                    comm.topology().describe()
                ))
            } else {
                Err(Error::Aborted(format!(
                    "conformance failures on rank {rank}: {:#?}",
                    report.failures
                )))
            }
        }
        "heap" => {
            // The symmetric heap and windows across processes (fds, separate
            // address spaces), and on GPUs the user-style all-gather too.
            let cfg = SuiteConfig {
                timeout: a.timeout.max(Duration::from_secs(60)),
                ..SuiteConfig::default()
            };
            let mut report = ferrocomm::testing::heap::run_heap_suite(&comm, store.as_ref(), &cfg)?;
            if comm.device().facts().backend != ferrocomm::device::BackendKind::Host {
                let user = ferrocomm::testing::heap::run_user_allgather(&comm, store.as_ref(), &cfg)?;
                report.collectives += user.collectives;
                report.elements_checked += user.elements_checked;
                report.failures.extend(user.failures);
            }
            comm.finalize()?;
            suite_result(rank, "heap checks", report)
        }
        "ep" => {
            // EP dispatch and combine across processes: tests/ep_cuda.rs's
            // suite, whose ranks there are threads; ci/gpu-cuda.sh runs it
            // under compute-sanitizer (ep_memcheck).
            let cfg = SuiteConfig {
                timeout: a.timeout.max(Duration::from_secs(60)),
                ..SuiteConfig::default()
            };
            let report = ferrocomm::testing::ep::run_ep_suite(&comm, store.as_ref(), &cfg)?;
            comm.finalize()?;
            suite_result(rank, "ep checks", report)
        }
        "kill" => expect_failure(&comm, a, |i| {
            if rank == a.victim && i == 5 {
                // SAFETY: raising SIGKILL on ourselves; nothing runs after it.
                unsafe { libc::raise(libc::SIGKILL) };
            }
        }),
        "stall" => {
            let out = expect_failure(&comm, a, |i| {
                if rank == a.victim && i == 3 {
                    std::thread::sleep(a.timeout * 3);
                }
            });
            if rank == a.victim {
                return Ok("victim woke up".into());
            }
            let msg = out?;
            if !msg.contains(&format!("[{}]", a.victim)) {
                return Err(Error::Aborted(format!("timeout did not name rank {}: {msg}", a.victim)));
            }
            Ok(msg)
        }
        "mismatch" => {
            let buf = comm.alloc(4 * (4096 * world + 16 * world + 64))?;
            let whole = Tensor::of(&buf, DType::F32);
            let start = Instant::now();
            let work = match a.coll.as_str() {
                "all_to_all" => {
                    // Rank 0 sends rank 1 one element more than rank 1 expects.
                    let mut sends = vec![16usize; world];
                    let recvs = vec![16usize; world];
                    if rank == 0 {
                        sends[1] = 17;
                    }
                    let inp = whole.slice(0, sends.iter().sum())?;
                    let out = whole.slice(4096 * world, 16 * world)?;
                    comm.all_to_all_v_single(out, inp, &recvs, &sends, &Call::new())?
                }
                "crossed" => {
                    let n = 4096 * world;
                    if rank == 0 {
                        comm.all_reduce(whole.slice(0, n)?, ReduceOp::Sum, &Call::new())?
                    } else {
                        let out = whole.slice(0, n)?;
                        comm.all_gather_single(out, out.slice(rank * 4096, 4096)?, &Call::new())?
                    }
                }
                _ => {
                    let count = if rank == 0 { 1000 } else { 4096 };
                    comm.all_reduce(whole.slice(0, count)?, ReduceOp::Sum, &Call::new())?
                }
            };
            match work.wait(None) {
                // All-to-all: the pair that disagrees (ranks 0 and 1) both
                // detect it; the other ranks' blocks agree.
                Ok(()) if a.coll == "all_to_all" && rank > 1 => Ok("completed: ranks 0 and 1 detect".into()),
                Ok(()) => Err(Error::Aborted("mismatched calls completed silently".into())),
                // Crossed protocols are a mismatch, seen before the deadline.
                Err(e @ Error::Timeout { .. }) if a.coll == "crossed" => Err(Error::Aborted(format!(
                    "a different collective became a timeout, not a mismatch: {e}"
                ))),
                Err(e @ (Error::Mismatch { .. } | Error::Timeout { .. })) => {
                    Ok(format!("elapsed_ms={} error={e}", start.elapsed().as_millis()))
                }
                // A peer that saw the mismatch first aborted: this rank's error
                // is the abort, or the timeout, never data.
                Err(e @ Error::Aborted(_)) => Ok(format!("elapsed_ms={} error={e}", start.elapsed().as_millis())),
                Err(e) => Err(e),
            }
        }
        "finalize" => {
            let buf = comm.alloc(64)?;
            let t = Tensor::view(&buf, DType::F32, 0, 16)?;
            comm.all_reduce(t, ReduceOp::Sum, &Call::new())?.wait(None)?;
            comm.finalize()?;
            let after = comm.all_reduce(t, ReduceOp::Sum, &Call::new()).err();
            let twice = comm.finalize().err();
            let abort = comm.abort().err();
            match (after, twice, abort) {
                (Some(Error::Finalized), Some(Error::Finalized), Some(Error::Finalized)) => {
                    Ok("finalize errors ok".into())
                }
                other => Err(Error::Aborted(format!("unexpected results after finalize: {other:?}"))),
            }
        }
        "replay" => replay(&comm, a),
        s if broadcaster::handles(s) => broadcaster::run(&comm, s, &broadcaster_params(a)),
        "smoke" => {
            let cfg = SuiteConfig {
                max_bytes: 1 << 20,
                random_sizes: 0,
                graph_replays: 1,
                timeout: a.timeout,
                ..SuiteConfig::default()
            };
            let report = ferrocomm::testing::conformance::run_smoke(&comm, &cfg)?;
            comm.finalize()?;
            suite_result(rank, "collectives", report)
        }
        other => Err(Error::invalid(format!("unknown scenario {other:?}"))),
    }
}

/// Graph replays with fresh input each time, every output checked.
fn replay<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<String> {
    let cfg = SuiteConfig {
        graph_replays: a.replays,
        timeout: a.timeout,
        ..SuiteConfig::default()
    };
    let start = Instant::now();
    let report = ferrocomm::testing::conformance::run_graph_replays(comm, &cfg)?;
    comm.finalize()?;
    let msg = suite_result(comm.rank(), "collectives", report)?;
    Ok(format!(
        "{msg} replays_per_algo={} secs={:.1}",
        a.replays,
        start.elapsed().as_secs_f64()
    ))
}

#[cfg(feature = "cuda")]
fn precompile_cuda(a: &Args) -> Result<String> {
    let (major, minor) = a.cc;
    // One kernel per compile, on every core: nothing else runs here.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let started = Instant::now();
    let (mut from_disk, mut compiled) = (0, 0);
    for module in ferrocomm::algo::kernels::ALL_MODULES {
        let t = Instant::now();
        let done = ferrocomm::backends::cuda::precompile_report(module, (major, minor), threads)?;
        println!(
            "{}: {} kernels compiled, {} already cached, {:.1} s",
            module.name,
            done.compiled,
            done.from_disk,
            t.elapsed().as_secs_f64()
        );
        from_disk += done.from_disk;
        compiled += done.compiled;
    }
    Ok(format!(
        "sm_{major}{minor}: {compiled} kernels compiled, {from_disk} already cached, on {threads} threads in {:.1} s",
        started.elapsed().as_secs_f64()
    ))
}

#[cfg(not(feature = "cuda"))]
fn precompile_cuda(_: &Args) -> Result<String> {
    Err(Error::NotCompiled {
        backend: "cuda",
        feature: "cuda",
    })
}

/// One call of the collective `--coll` names, on `buf` (big enough for all).
fn one_call<D: Device>(comm: &Communicator<D>, coll: &str, buf: &D::Buffer, n: usize) -> Result<ferrocomm::Work<D>> {
    let world = comm.size();
    let rank = comm.rank();
    let t = Tensor::of(buf, DType::F32);
    let call = Call::new();
    match coll {
        "all_gather" => comm.all_gather_single(t.slice(n, n * world)?, t.slice(0, n)?, &call),
        "reduce_scatter" => {
            comm.reduce_scatter_single(t.slice(n * world, n)?, t.slice(0, n * world)?, ReduceOp::Sum, &call)
        }
        "all_to_all" => comm.all_to_all_single(t.slice(n * world, n * world)?, t.slice(0, n * world)?, &call),
        "sendrecv" => comm.batch_p2p(
            &[
                P2p::Send(t.slice(0, n)?, (rank + 1) % world),
                P2p::Recv(t.slice(n, n)?, (rank + world - 1) % world),
            ],
            &call,
        ),
        "broadcast" => comm.broadcast(t.slice(0, n)?, 0, &call),
        "reduce" => comm.reduce(t.slice(0, n)?, ReduceOp::Sum, 0, &call),
        "all_reduce" => comm.all_reduce(t.slice(0, n)?, ReduceOp::Sum, &call),
        other => Err(Error::invalid(format!("unknown --coll {other}"))),
    }
}

/// Run the collective until one fails; succeed iff the failure came within
/// 2x the timeout of the last good iteration.
fn expect_failure<D: Device>(comm: &Communicator<D>, a: &Args, mut before: impl FnMut(usize)) -> Result<String> {
    let n = 1 << 12;
    let buf = comm.alloc(n * 4 * (2 * comm.size() + 1))?;
    let mut last_ok = Instant::now();
    for i in 0..1000 {
        before(i);
        let res = one_call(comm, &a.coll, &buf, n).and_then(|w| w.wait(None));
        match res {
            Ok(()) => last_ok = Instant::now(),
            Err(e) => {
                let elapsed = last_ok.elapsed();
                if elapsed > a.timeout * 2 {
                    return Err(Error::Aborted(format!(
                        "error came after {elapsed:?} (> 2x {:?}): {e}",
                        a.timeout
                    )));
                }
                // The communicator must now refuse work instead of hanging.
                if one_call(comm, &a.coll, &buf, n).is_ok() {
                    return Err(Error::Aborted(
                        "communicator still accepted work after a fatal error".into(),
                    ));
                }
                return Ok(format!(
                    "{} iteration={i} elapsed_ms={} error={e}",
                    a.coll,
                    elapsed.as_millis()
                ));
            }
        }
    }
    Err(Error::Aborted("no error in 1000 iterations".into()))
}

fn broadcaster_params(a: &Args) -> broadcaster::Params {
    broadcaster::Params {
        slot: a.max_bytes,
        writer: a.writer,
        victim: a.victim,
        timeout: a.timeout,
    }
}
