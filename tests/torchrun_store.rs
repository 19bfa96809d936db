//! Rendezvous under torchrun: ferrocomm finds its own store through the one
//! torchrun's agent runs on `MASTER_PORT`.
//!
//! Two kinds of torch store are used:
//!
//! * [`FakeTorchStore`], a FAKE written from our reading of torch's sources
//!   (`TCPStoreLibUvBackend.cpp`, and with `legacy` the older
//!   `TCPStoreBackend.cpp`). It runs everywhere, so CI exercises the whole
//!   torchrun code path; but it can only show that we agree with our own
//!   reading of torch.
//! * A REAL `torch.distributed.TCPStore`, started by `python3`, in the tests
//!   named `real_torch_*`. Without torch they print
//!   `SKIPPED: no torch here, real TCPStore test not run` and pass without
//!   claiming anything; with `FERROCOMM_REQUIRE_TORCH=1` they fail instead.
//!   `real_torchrun_*` also runs the unmodified worker binary under
//!   `python3 -m torch.distributed.run` (torchrun). To run them on a machine
//!   with torch:
//!   `FERROCOMM_REQUIRE_TORCH=1 cargo test --test torchrun_store real_torch -- --nocapture`,
//!   or from prebuilt binaries:
//!   `FERROCOMM_REQUIRE_TORCH=1 FERROCOMM_WORKER_EXE=bin/ferrocomm-worker bin/torchrun_store real_torch --nocapture`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ferrocomm::bootstrap::{rendezvous_from_vars, store_all_gather, EnvRendezvous, Launcher, Store, TorchStoreClient};
use ferrocomm::Error;

const SECOND: Duration = Duration::from_secs(1);

/// The worker binary: `FERROCOMM_WORKER_EXE` (prebuilt binaries carried to
/// another machine, as `ci/gpu-cuda.sh` does), else the one cargo built.
fn worker() -> PathBuf {
    std::env::var_os("FERROCOMM_WORKER_EXE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ferrocomm-worker")))
}

// ---------------------------------------------------------------------------
// The fake torch store.

const Q_VALIDATE: u8 = 0;
const Q_SET: u8 = 1;
const Q_GET: u8 = 3;
const Q_ADD: u8 = 4;
const Q_CHECK: u8 = 5;
const Q_WAIT: u8 = 6;
const Q_DELETE_KEY: u8 = 8;
const Q_CANCEL_WAIT: u8 = 12;
const Q_PING: u8 = 13;
const MAGIC: u32 = 0x3C85_F7CE;

type Table = Arc<(Mutex<HashMap<Vec<u8>, Vec<u8>>>, Condvar)>;

/// FAKE torch `TCPStore` server (see the module docs). With `legacy`, a GET
/// on a missing key closes the connection, as the legacy server does; the
/// libuv one answers an empty value.
struct FakeTorchStore {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl FakeTorchStore {
    fn start(legacy: bool) -> FakeTorchStore {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake torch store");
        listener.set_nonblocking(true).expect("non-blocking");
        let addr = listener.local_addr().expect("addr");
        let stop = Arc::new(AtomicBool::new(false));
        let table: Table = Arc::default();
        let accept = {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((s, _)) => {
                            let (table, stop) = (Arc::clone(&table), Arc::clone(&stop));
                            thread::spawn(move || {
                                let _ = serve_fake(s, &table, legacy, &stop);
                            });
                        }
                        Err(_) => thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        FakeTorchStore {
            addr,
            stop,
            accept: Some(accept),
        }
    }
}

impl Drop for FakeTorchStore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

/// Reads that give up when the fake is stopped.
struct FakeConn<'a> {
    s: TcpStream,
    stop: &'a AtomicBool,
}

impl FakeConn<'_> {
    fn exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        let mut at = 0;
        while at < buf.len() {
            if self.stop.load(Ordering::Relaxed) {
                return Err(ErrorKind::Interrupted.into());
            }
            match self.s.read(&mut buf[at..]) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(n) => at += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn u8(&mut self) -> std::io::Result<u8> {
        let mut b = [0u8; 1];
        self.exact(&mut b)?;
        Ok(b[0])
    }

    fn u64(&mut self) -> std::io::Result<u64> {
        let mut b = [0u8; 8];
        self.exact(&mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// A length-prefixed string or vector, capped like torch's libuv server.
    fn bytes(&mut self, max: u64) -> std::io::Result<Vec<u8>> {
        let len = self.u64()?;
        if len > max {
            return Err(ErrorKind::InvalidData.into());
        }
        let mut b = vec![0u8; len as usize];
        self.exact(&mut b)?;
        Ok(b)
    }

    fn keys(&mut self) -> std::io::Result<Vec<Vec<u8>>> {
        let n = self.u64()?;
        if n > 128 * 1024 {
            return Err(ErrorKind::InvalidData.into());
        }
        (0..n).map(|_| self.bytes(8 * 1024)).collect()
    }

    fn vector(&mut self, v: &[u8]) -> std::io::Result<()> {
        self.s.write_all(&(v.len() as u64).to_ne_bytes())?;
        self.s.write_all(v)
    }
}

/// One connection of the fake; any error closes it, as torch does.
fn serve_fake(s: TcpStream, table: &Table, legacy: bool, stop: &AtomicBool) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_millis(50)))?;
    let mut c = FakeConn { s, stop };
    let (map, changed) = &**table;
    let lock = || map.lock().unwrap_or_else(|e| e.into_inner());
    // The first message must be VALIDATE with the magic.
    let mut magic = [0u8; 4];
    if c.u8()? != Q_VALIDATE {
        return Ok(());
    }
    c.exact(&mut magic)?;
    if u32::from_ne_bytes(magic) != MAGIC {
        return Ok(());
    }
    loop {
        match c.u8()? {
            Q_PING => {
                let mut nonce = [0u8; 4];
                c.exact(&mut nonce)?;
                c.s.write_all(&nonce)?;
            }
            Q_SET => {
                let key = c.bytes(8 * 1024)?;
                let value = c.bytes(8 << 20)?;
                lock().insert(key, value);
                changed.notify_all();
            }
            Q_GET => {
                let key = c.bytes(8 * 1024)?;
                let value = lock().get(&key).cloned();
                match value {
                    Some(v) => c.vector(&v)?,
                    None if legacy => return Ok(()),
                    None => c.vector(&[])?,
                }
            }
            Q_ADD => {
                let key = c.bytes(8 * 1024)?;
                let mut delta = [0u8; 8];
                c.exact(&mut delta)?;
                let new = {
                    let mut map = lock();
                    let old = match map.get(&key) {
                        None => 0,
                        Some(v) => match std::str::from_utf8(v).ok().and_then(|t| t.parse::<i64>().ok()) {
                            Some(n) => n,
                            None => return Ok(()), // torch's std::stoll throws: close
                        },
                    };
                    let new = old + i64::from_ne_bytes(delta);
                    map.insert(key, new.to_string().into_bytes());
                    new
                };
                changed.notify_all();
                c.s.write_all(&new.to_ne_bytes())?;
            }
            Q_CHECK => {
                let keys = c.keys()?;
                let all = {
                    let map = lock();
                    keys.iter().all(|k| map.contains_key(k))
                };
                c.s.write_all(&[if all { 0 } else { 1 }])?;
            }
            Q_WAIT => {
                let keys = c.keys()?;
                // Answer STOP_WAITING once all keys exist, unless a
                // CANCEL_WAIT comes first (answered WAIT_CANCELED).
                loop {
                    let all = {
                        let map = lock();
                        let all = keys.iter().all(|k| map.contains_key(k));
                        if !all {
                            let _ = changed.wait_timeout(map, Duration::from_millis(10));
                        }
                        all
                    };
                    if all {
                        c.s.write_all(&[0])?;
                        break;
                    }
                    c.s.set_nonblocking(true)?;
                    let mut peek = [0u8; 1];
                    let peeked = c.s.peek(&mut peek);
                    c.s.set_nonblocking(false)?;
                    match peeked {
                        Ok(0) => return Ok(()),
                        Ok(_) if peek[0] == Q_CANCEL_WAIT => {
                            c.u8()?;
                            c.s.write_all(&[1])?;
                            break;
                        }
                        Ok(_) => return Ok(()), // anything else mid-wait: close
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                    if stop.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                }
            }
            Q_CANCEL_WAIT => c.s.write_all(&[1])?,
            Q_DELETE_KEY => {
                let key = c.bytes(8 * 1024)?;
                let gone = u64::from(lock().remove(&key).is_some());
                c.s.write_all(&gone.to_ne_bytes())?;
            }
            _ => return Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------
// Shared checks, run against the fake and against real torch.

/// The client's operations, including a bounded wait and a request the
/// server refuses by closing the connection.
fn client_operations(addr: SocketAddr) {
    let store = TorchStoreClient::connect(addr, 5 * SECOND).expect("connect to the torch store");
    store.ping().expect("ping");
    store.set("t/key", b"value").expect("set");
    assert_eq!(store.get("t/key", SECOND).expect("get"), b"value");
    assert!(store.check("t/key").expect("check"));
    assert!(!store.check("t/absent").expect("check absent"));
    assert_eq!(store.add("t/counter", 5).expect("add"), 5);
    assert_eq!(store.add("t/counter", -2).expect("add"), 3);
    assert_eq!(store.get("t/counter", SECOND).expect("counter as text"), b"3");

    // A wait on a missing key ends in a timeout, and the connection stays
    // usable (the wait was cancelled cleanly).
    let start = Instant::now();
    let err = store
        .get("t/absent", Duration::from_millis(300))
        .expect_err("times out");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(290) && took < 3 * SECOND, "{took:?}");
    store.set("t/after-timeout", b"ok").expect("set after a timeout");

    // A get that waits for a key another client sets.
    let setter = {
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            let other = TorchStoreClient::connect(addr, 5 * SECOND).expect("second client");
            other.set("t/late", b"here").expect("late set");
        })
    };
    assert_eq!(store.get("t/late", 5 * SECOND).expect("waited get"), b"here");
    setter.join().expect("setter");

    // ADD on a non-integer: torch closes the connection; we say so, and the
    // next call reconnects.
    let err = store.add("t/key", 1).expect_err("not an integer");
    assert!(err.to_string().contains("closed the connection"), "{err}");
    assert!(store.delete("t/key").expect("delete after reconnecting"));
    assert!(!store.delete("t/key").expect("delete again"));
}

/// A scratch directory standing in for `$TMPDIR` (the rendezvous file's home).
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrocomm-torchrun-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Everything under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// torchrun's variables for one rank of a job whose agent store is at `master`.
fn torchrun_vars(
    master: SocketAddr,
    rank: usize,
    world: usize,
    local_world: usize,
    tmpdir: &Path,
) -> HashMap<String, String> {
    let local_rank = rank % local_world;
    [
        ("MASTER_ADDR", master.ip().to_string()),
        ("MASTER_PORT", master.port().to_string()),
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", local_world.to_string()),
        ("GROUP_RANK", (rank / local_world).to_string()),
        ("ROLE_RANK", rank.to_string()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        ("TORCHELASTIC_RUN_ID", "ferrocomm-test".to_string()),
        ("TORCHELASTIC_RESTART_COUNT", "0".to_string()),
        ("FERROCOMM_STORE_TIMEOUT_S", "20".to_string()),
        ("TMPDIR", tmpdir.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Run `world` ranks as threads with the given variables; each does an
/// all-gather over ferrocomm's store, and all stay alive until all are done.
fn thread_ranks(vars: Vec<HashMap<String, String>>) -> Vec<Result<EnvRendezvous, Error>> {
    let world = vars.len();
    let done = Arc::new(Barrier::new(world));
    let handles: Vec<_> = vars
        .into_iter()
        .enumerate()
        .map(|(rank, vars)| {
            let done = Arc::clone(&done);
            thread::spawn(move || {
                let rdv = rendezvous_from_vars(|name| vars.get(name).cloned());
                if let Ok(rdv) = &rdv {
                    let got = store_all_gather(&*rdv.store, "t/rdv", rank, world, &[rank as u8], 10 * SECOND)
                        .expect("all-gather over ferrocomm's store");
                    assert_eq!(got, (0..world).map(|r| vec![r as u8]).collect::<Vec<_>>());
                }
                // Rank 0 hosts the store: everyone finishes before it goes.
                done.wait();
                rdv
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

/// One host, no token: rank 0 generates one and hands it over in a private
/// file; torch's store holds only that file's path. A second rendezvous in
/// the same job does not pick up the first one's (now dead) store.
fn rendezvous_on_one_host(master: SocketAddr) {
    let world = 4;
    let tmp = scratch(&format!("one-host-{}", master.port()));
    for round in 1..=2 {
        let vars = (0..world)
            .map(|r| torchrun_vars(master, r, world, world, &tmp))
            .collect();
        let results = thread_ranks(vars);
        for (rank, rdv) in results.into_iter().enumerate() {
            let rdv = rdv.unwrap_or_else(|e| panic!("round {round}, rank {rank}: {e}"));
            assert_eq!((rdv.rank, rdv.world, rdv.local_world), (rank, world, Some(world)));
            assert_eq!(rdv.launcher, Launcher::Torchrun { agent_store: true });
            assert_eq!(rdv.hosts_server(), rank == 0);
        }
        // The rendezvous file was removed once every rank had read it.
        assert_eq!(files_under(&tmp), Vec::<PathBuf>::new(), "round {round}");
    }
    // What torch's store holds: a path in the private directory, no token.
    let torch = TorchStoreClient::connect(master, 5 * SECOND).expect("connect");
    for generation in 1..=2 {
        let key = format!("ferrocomm/ferrocomm-test/attempt_0/gen_{generation}/store");
        let published = String::from_utf8(torch.get(&key, SECOND).expect("published")).expect("text");
        assert!(published.starts_with("file /"), "{published}");
        assert!(
            published.contains(&format!("ferrocomm-{}", effective_uid_from_proc())),
            "{published}"
        );
        assert!(!published.contains("token"), "{published}");
    }
    assert_eq!(
        torch
            .get("ferrocomm/ferrocomm-test/attempt_0/rendezvous_count", SECOND)
            .expect("count"),
        b"8"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The uid, read from /proc so this test needs no unsafe code.
fn effective_uid_from_proc() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|uid| uid.parse().ok())
        .expect("effective uid")
}

/// Two "hosts" of two ranks: the token comes from FERROCOMM_TOKEN and the
/// address is published as `tcp ip:port`; without a token every rank fails
/// at once, naming FERROCOMM_TOKEN.
fn rendezvous_across_hosts(master: SocketAddr, restart: u32) {
    let world = 4;
    let tmp = scratch(&format!("hosts-{}-{restart}", master.port()));
    let vars_for = |token: bool| -> Vec<HashMap<String, String>> {
        (0..world)
            .map(|r| {
                let mut v = torchrun_vars(master, r, world, 2, &tmp);
                v.insert("TORCHELASTIC_RESTART_COUNT".into(), restart.to_string());
                // Loopback stands in for the cluster network here.
                v.insert("FERROCOMM_STORE_BIND".into(), "127.0.0.1".into());
                if token {
                    v.insert("FERROCOMM_TOKEN".into(), "multi-host-test-token".into());
                }
                v
            })
            .collect()
    };
    for rdv in thread_ranks(vars_for(true)) {
        let rdv = rdv.expect("rendezvous across hosts with a token");
        assert_eq!(rdv.local_world, Some(2));
    }
    let torch = TorchStoreClient::connect(master, 5 * SECOND).expect("connect");
    let key = format!("ferrocomm/ferrocomm-test/attempt_{restart}/gen_1/store");
    let published = String::from_utf8(torch.get(&key, SECOND).expect("published")).expect("text");
    assert!(published.starts_with("tcp 127.0.0.1:"), "{published}");

    let start = Instant::now();
    for rdv in thread_ranks(vars_for(false)) {
        let err = rdv.expect_err("no token across hosts");
        assert!(err.to_string().contains("FERROCOMM_TOKEN"), "{err}");
    }
    assert!(start.elapsed() < 5 * SECOND, "{:?}", start.elapsed());
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Rank 0 never comes: the others give up within the rendezvous timeout and
/// say what they waited for.
fn missing_rank_zero_is_bounded(master: SocketAddr) {
    let tmp = scratch(&format!("no-rank0-{}", master.port()));
    let mut vars = torchrun_vars(master, 1, 2, 2, &tmp);
    vars.insert("TORCHELASTIC_RUN_ID".into(), "no-rank-zero".into());
    vars.insert("FERROCOMM_STORE_TIMEOUT_S".into(), "1".into());
    let start = Instant::now();
    let err = rendezvous_from_vars(|name| vars.get(name).cloned()).expect_err("rank 0 is missing");
    let took = start.elapsed();
    match &err {
        Error::Timeout { what, missing, .. } => {
            assert!(what.contains("rank 0 to publish"), "{err}");
            assert_eq!(missing, &vec![0]);
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(took < 4 * SECOND, "{took:?}");
    let _ = std::fs::remove_dir_all(&tmp);
}

// ---------------------------------------------------------------------------
// Against the fake.

#[test]
fn fake_torch_store_client_operations() {
    for legacy in [false, true] {
        let fake = FakeTorchStore::start(legacy);
        client_operations(fake.addr);
    }
}

#[test]
fn fake_torch_store_rendezvous_on_one_host_without_a_token() {
    let fake = FakeTorchStore::start(false);
    rendezvous_on_one_host(fake.addr);
}

#[test]
fn fake_torch_store_rendezvous_across_hosts_needs_a_token() {
    let fake = FakeTorchStore::start(true);
    rendezvous_across_hosts(fake.addr, 3);
}

#[test]
fn fake_torch_store_missing_rank_zero_is_bounded() {
    let fake = FakeTorchStore::start(false);
    missing_rank_zero_is_bounded(fake.addr);
}

#[test]
fn unreachable_agent_store_is_an_error_naming_master_port() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let master = SocketAddr::from(([127, 0, 0, 1], port));
    let tmp = scratch("unreachable");
    let mut vars = torchrun_vars(master, 0, 2, 2, &tmp);
    vars.insert("FERROCOMM_STORE_TIMEOUT_S".into(), "1".into());
    let start = Instant::now();
    let err = rendezvous_from_vars(|name| vars.get(name).cloned()).expect_err("nothing listens");
    let msg = err.to_string();
    assert!(
        msg.contains("MASTER_ADDR:MASTER_PORT") && msg.contains(&port.to_string()),
        "{msg}"
    );
    assert!(start.elapsed() < 4 * SECOND, "{:?}", start.elapsed());
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The unmodified worker binary, as separate processes with torchrun's
/// variables and no token: with the full sweep it runs the host
/// conformance suite, in the lean run the smoke run (one checked call of
/// every kernel family). The suite as processes is `tests/process_host.rs`'s,
/// and the store operations it adds here (add, set, waiting get: the ranks
/// compare their results) `fake_torch_store_client_operations` checks
/// against this fake.
#[test]
fn fake_torch_store_worker_processes_run_the_host_suite() {
    let fake = FakeTorchStore::start(false);
    run_worker_processes(fake.addr, 3);
}

fn run_worker_processes(master: SocketAddr, world: usize) {
    let tmp = scratch(&format!("workers-{}", master.port()));
    let scenario = if ferrocomm::testing::conformance::full_sweep() {
        "conformance"
    } else {
        "smoke"
    };
    let children: Vec<(usize, Child)> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(worker());
            cmd.args([
                scenario,
                "--backend",
                "host",
                "--max-bytes",
                "65536",
                "--timeout-secs",
                "60",
            ])
            .env_remove("FERROCOMM_TOKEN")
            .env_remove("FERROCOMM_TOKEN_FILE")
            .env_remove("FERROCOMM_STORE_ADDR")
            .env_remove("XDG_RUNTIME_DIR")
            .envs(torchrun_vars(master, rank, world, world, &tmp))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            (rank, cmd.spawn().expect("spawn worker"))
        })
        .collect();
    for (rank, out) in wait_all(children, Duration::from_secs(300)) {
        assert!(
            out.contains("RESULT ok"),
            "rank {rank} did not pass under torchrun variables:\n{out}"
        );
    }
    assert_eq!(files_under(&tmp), Vec::<PathBuf>::new(), "rendezvous file left behind");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Wait for every child (killing all at `timeout`); returns each one's
/// stdout and stderr.
fn wait_all(children: Vec<(usize, Child)>, timeout: Duration) -> Vec<(usize, String)> {
    let deadline = Instant::now() + timeout;
    let mut outs = Vec::new();
    for (rank, mut child) in children {
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
            }
        }
        let mut text = String::new();
        if let Some(mut s) = child.stdout.take() {
            let _ = s.read_to_string(&mut text);
        }
        if let Some(mut s) = child.stderr.take() {
            let _ = s.read_to_string(&mut text);
        }
        outs.push((rank, text));
    }
    outs
}

// ---------------------------------------------------------------------------
// Against real torch (skipped without it).

/// Whether to run the real-torch tests: true with torch; without it, false
/// after saying so, or a failure under `FERROCOMM_REQUIRE_TORCH=1`.
fn have_torch() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import torch"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return true;
    }
    assert!(
        std::env::var("FERROCOMM_REQUIRE_TORCH").as_deref() != Ok("1"),
        "FERROCOMM_REQUIRE_TORCH=1, but `python3 -c 'import torch'` fails"
    );
    // Straight to stderr: the test harness captures print!/eprint! only.
    let _ = writeln!(std::io::stderr(), "SKIPPED: no torch here, real TCPStore test not run");
    false
}

/// A real `torch.distributed.TCPStore` server in a python3 child. It also
/// sets `from_python`, and answers `get KEY` lines on stdin with `VALUE
/// <hex>` read through torch's own client.
const TORCH_SERVER: &str = r#"
import datetime, sys
from torch.distributed import TCPStore
mode = sys.argv[1]
try:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60), use_libuv=(mode == "libuv"))
except Exception as e:
    print("UNSUPPORTED", repr(e), flush=True)
    sys.exit(0)
import torch
print("TORCH", torch.__version__, "libuv" if getattr(store, "libuvBackend", mode == "libuv") else "legacy", flush=True)
store.set("from_python", "hello from torch")
print("PORT", store.port, flush=True)
for line in sys.stdin:
    cmd, _, key = line.strip().partition(" ")
    if cmd == "get":
        try:
            print("VALUE", store.get(key).hex(), flush=True)
        except Exception as e:
            print("ERROR", repr(e), flush=True)
"#;

struct TorchServer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    addr: SocketAddr,
}

impl TorchServer {
    /// None when this torch lacks `mode` (e.g. no legacy server any more).
    fn start(mode: &str) -> Option<TorchServer> {
        let mut child = Command::new("python3")
            .args(["-c", TORCH_SERVER, mode])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn python3");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = TorchServer {
            child,
            stdin,
            lines,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        loop {
            let line = server.next_line();
            if let Some(port) = line.strip_prefix("PORT ") {
                server.addr.set_port(port.trim().parse().expect("port"));
                return Some(server);
            }
            if line.starts_with("UNSUPPORTED") {
                let _ = writeln!(std::io::stderr(), "torch store mode {mode} not available: {line}");
                return None;
            }
            let _ = writeln!(std::io::stderr(), "{line}");
        }
    }

    fn next_line(&self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(120))
            .expect("a line from the python torch store")
    }

    /// Read `key` through torch's own Python client.
    fn get_via_torch(&mut self, key: &str) -> Vec<u8> {
        writeln!(self.stdin, "get {key}").expect("ask python");
        let line = self.next_line();
        let hex = line
            .strip_prefix("VALUE ")
            .unwrap_or_else(|| panic!("python could not read {key}: {line}"));
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect()
    }
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Both of torch's servers, where this torch has them.
fn real_servers() -> Vec<(&'static str, TorchServer)> {
    ["libuv", "legacy"]
        .into_iter()
        .filter_map(|mode| TorchServer::start(mode).map(|s| (mode, s)))
        .collect()
}

#[test]
fn real_torch_store_speaks_our_protocol() {
    if !have_torch() {
        return;
    }
    let servers = real_servers();
    assert!(!servers.is_empty(), "no torch store could be started");
    for (mode, mut server) in servers {
        let _ = writeln!(std::io::stderr(), "real torch store ({mode}) at {}", server.addr);
        client_operations(server.addr);
        // Keys cross between torch's client and ours, both ways.
        let ours = TorchStoreClient::connect(server.addr, 5 * SECOND).expect("connect");
        assert_eq!(
            ours.get("from_python", SECOND).expect("python's key"),
            b"hello from torch"
        );
        ours.set("from_rust", b"hello from ferrocomm").expect("set");
        assert_eq!(server.get_via_torch("from_rust"), b"hello from ferrocomm");
    }
}

#[test]
fn real_torch_store_rendezvous() {
    if !have_torch() {
        return;
    }
    for (mode, server) in real_servers() {
        let _ = writeln!(std::io::stderr(), "rendezvous through a real torch store ({mode})");
        rendezvous_on_one_host(server.addr);
        rendezvous_across_hosts(server.addr, 5);
        missing_rank_zero_is_bounded(server.addr);
        run_worker_processes(server.addr, 2);
    }
}

/// The real thing: `torchrun --standalone --nproc_per_node=2 --no-python
/// ferrocomm-worker conformance ...`, unmodified, no token set.
#[test]
fn real_torchrun_launches_the_worker_unmodified() {
    if !have_torch() {
        return;
    }
    let tmp = scratch("torchrun");
    let child = Command::new("python3")
        .args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "--no-python",
        ])
        .arg(worker())
        .args([
            "conformance",
            "--backend",
            "host",
            "--max-bytes",
            "65536",
            "--timeout-secs",
            "60",
        ])
        .env_remove("FERROCOMM_TOKEN")
        .env_remove("FERROCOMM_TOKEN_FILE")
        .env_remove("FERROCOMM_STORE_ADDR")
        .env("TMPDIR", &tmp)
        .env("FERROCOMM_STORE_TIMEOUT_S", "60")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn torchrun");
    let (_, out) = wait_all(vec![(0, child)], Duration::from_secs(300)).remove(0);
    let _ = writeln!(std::io::stderr(), "{out}");
    assert_eq!(
        out.matches("RESULT ok").count(),
        2,
        "both ranks pass under torchrun:\n{out}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}
