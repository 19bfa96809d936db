use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::sync::{Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::credentials::constant_time_eq;
use super::wire::{record_key, Record, NAME_PREFIX, RECORD_MAGIC, SECRET_LEN};
use super::{exchange_fds, MAX_FDS};
use crate::bootstrap::Store;
use crate::error::{Error, Result};

/// A minimal in-process store: a map and a condition variable.
#[derive(Default)]
struct TestStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl Store for TestStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.map.lock().unwrap().insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let map = self.map.lock().unwrap();
        let (map, _) = self
            .changed
            .wait_timeout_while(map, timeout, |m| !m.contains_key(key))
            .unwrap();
        map.get(key).cloned().ok_or_else(|| Error::Timeout {
            what: format!("store key {key}"),
            after: timeout,
            missing: Vec::new(),
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.map.lock().unwrap();
        let old = map
            .get(key)
            .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
            .unwrap_or(0);
        map.insert(key.to_owned(), (old + delta).to_string().into_bytes());
        self.changed.notify_all();
        Ok(old + delta)
    }

    fn check(&self, key: &str) -> Result<bool> {
        Ok(self.map.lock().unwrap().contains_key(key))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.map.lock().unwrap().remove(key).is_some())
    }
}

/// A close-on-exec memfd holding `content`.
fn memfd_with(content: &[u8]) -> OwnedFd {
    // SAFETY: the name is a NUL-terminated literal; memfd_create returns
    // a new descriptor that nobody else owns, or -1.
    let raw = unsafe { libc::memfd_create(c"ferrocomm-fdx-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: `raw` is a fresh, open descriptor owned by no one else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut file = File::from(fd);
    file.write_all(content).unwrap();
    file.into()
}

/// The whole content of a memfd, read with pread (the offset is shared
/// with the sender's descriptor, so never rely on it).
fn contents(fd: OwnedFd) -> Vec<u8> {
    let file = File::from(fd);
    let mut buf = vec![0u8; 256];
    let n = file.read_at(&mut buf, 0).unwrap();
    buf.truncate(n);
    buf
}

fn is_cloexec(fd: &OwnedFd) -> bool {
    // SAFETY: F_GETFD only reads the flags of an open (owned) descriptor.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
    assert!(flags >= 0);
    flags & libc::FD_CLOEXEC != 0
}

fn payload(rank: usize, index: usize) -> Vec<u8> {
    format!("rank {rank} buffer {index}").into_bytes()
}

/// One rank of a test exchange: offers `per_rank` memfds and checks that
/// each peer's arrive with the right contents.
fn run_rank(
    store: &TestStore,
    prefix: &str,
    rank: usize,
    world: usize,
    per_rank: usize,
    timeout: Duration,
) -> Result<()> {
    let mine: Vec<OwnedFd> = (0..per_rank).map(|i| memfd_with(&payload(rank, i))).collect();
    let borrowed: Vec<BorrowedFd<'_>> = mine.iter().map(AsFd::as_fd).collect();
    let got = exchange_fds(store, prefix, rank, world, &borrowed, timeout)?;
    assert_eq!(got.len(), world);
    for (peer, fds) in got.into_iter().enumerate() {
        if peer == rank {
            assert!(fds.is_empty(), "rank {rank} got fds from itself");
            continue;
        }
        assert_eq!(fds.len(), per_rank, "rank {rank} from {peer}");
        for (i, fd) in fds.into_iter().enumerate() {
            assert!(is_cloexec(&fd), "received fd must be close-on-exec");
            assert_eq!(contents(fd), payload(peer, i), "rank {rank} from {peer}");
        }
    }
    Ok(())
}

/// Runs `ranks` of a `world` on threads and returns each one's result.
fn run_ranks(store: &TestStore, prefix: &str, ranks: &[usize], world: usize, timeout: Duration) -> Vec<Result<()>> {
    thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&rank| s.spawn(move || run_rank(store, prefix, rank, world, 2, timeout)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
#[serial_test::serial]
fn four_ranks_exchange_memfds() {
    let store = TestStore::default();
    for result in run_ranks(&store, "four", &[0, 1, 2, 3], 4, Duration::from_secs(20)) {
        result.unwrap();
    }
    // Every rank cleaned up its record.
    assert!(store.map.lock().unwrap().is_empty());
}

/// Connects to rank 0's listener as `claimed_rank` with `secret` and
/// returns what came back before the server closed the connection.
fn rogue_attempt(store: &TestStore, prefix: &str, claimed_rank: u32, secret: &[u8]) -> Vec<u8> {
    let bytes = store.get(&record_key(prefix, 0), Duration::from_secs(10)).unwrap();
    let record = Record::decode(&bytes).unwrap();
    let mut stream = UnixStream::connect_addr(&record.address().unwrap()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(&claimed_rank.to_le_bytes()).unwrap();
    stream.write_all(secret).unwrap();
    let mut reply = Vec::new();
    // A rejected connection is closed: EOF (or a reset) and no data.
    let _ = stream.read_to_end(&mut reply);
    reply
}

#[test]
#[serial_test::serial]
fn rejects_unauthenticated_connectors() {
    let store = TestStore::default();
    thread::scope(|s| {
        let rank0 = s.spawn(|| run_rank(&store, "rogue", 0, 2, 2, Duration::from_secs(20)));
        // Wrong secret, claiming the real peer's rank.
        assert!(rogue_attempt(&store, "rogue", 1, &[0u8; SECRET_LEN]).is_empty());
        // The right secret (a job member) but ranks that cannot be served.
        let secret = Record::decode(&store.get("rogue/fdx/0", Duration::ZERO).unwrap())
            .unwrap()
            .secret;
        assert!(rogue_attempt(&store, "rogue", 7, &secret).is_empty());
        assert!(rogue_attempt(&store, "rogue", 0, &secret).is_empty());
        // The genuine rank 1 still gets its slot.
        let rank1 = s.spawn(|| run_rank(&store, "rogue", 1, 2, 2, Duration::from_secs(20)));
        rank0.join().unwrap().unwrap();
        rank1.join().unwrap().unwrap();
    });
}

#[test]
#[serial_test::serial]
fn absent_peer_times_out_naming_it() {
    let store = TestStore::default();
    let timeout = Duration::from_secs(1);
    let start = Instant::now();
    let results = run_ranks(&store, "absent", &[0, 1], 3, timeout);
    let elapsed = start.elapsed();
    for result in results {
        match result {
            Err(Error::Timeout { missing, after, .. }) => {
                assert_eq!(missing, vec![2]);
                assert_eq!(after, timeout);
            }
            other => panic!("expected a timeout naming rank 2, got {other:?}"),
        }
    }
    assert!(elapsed >= timeout, "returned early: {elapsed:?}");
    assert!(elapsed < timeout + Duration::from_millis(1500), "overran: {elapsed:?}");
}

#[test]
fn rejects_bad_arguments() {
    let store = TestStore::default();
    let t = Duration::from_secs(1);
    assert!(matches!(
        exchange_fds(&store, "bad", 2, 2, &[], t),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        exchange_fds(&store, "bad", 0, 0, &[], t),
        Err(Error::InvalidArgument(_))
    ));
    let fd = memfd_with(b"x");
    let many = vec![fd.as_fd(); MAX_FDS + 1];
    assert!(matches!(
        exchange_fds(&store, "bad", 0, 2, &many, t),
        Err(Error::InvalidArgument(_))
    ));
    // A world of one has nobody to exchange with.
    let alone = exchange_fds(&store, "alone", 0, 1, &[fd.as_fd()], t).unwrap();
    assert_eq!(alone.len(), 1);
    assert!(alone[0].is_empty());
}

#[test]
fn record_round_trips_and_rejects_garbage() {
    let record = Record::generate().unwrap();
    let bytes = record.encode();
    let back = Record::decode(&bytes).unwrap();
    assert_eq!(back.name, record.name);
    assert_eq!(back.secret, record.secret);
    assert!(record.name.starts_with(b"ferrocomm-"));
    // Two records never share a name or a secret.
    let other = Record::generate().unwrap();
    assert_ne!(other.name, record.name);
    assert_ne!(other.secret, record.secret);

    assert!(Record::decode(&bytes[1..]).is_none());
    let mut bad_magic = bytes.clone();
    bad_magic[0] ^= 1;
    assert!(Record::decode(&bad_magic).is_none());
    let mut bad_name = bytes;
    bad_name[RECORD_MAGIC.len() + NAME_PREFIX.len()] = b'/';
    assert!(Record::decode(&bad_name).is_none());
}

#[test]
fn constant_time_eq_compares() {
    assert!(constant_time_eq(b"abc", b"abc"));
    assert!(!constant_time_eq(b"abc", b"abd"));
    assert!(!constant_time_eq(b"abc", b"ab"));
}

const LEAK_CHILD_ENV: &str = "FERROCOMM_FDX_LEAK_CHILD";

fn open_fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Counting /proc/self/fd is only exact when nothing else in the process
/// opens files meanwhile, and the test harness runs other tests on other
/// threads. So [`no_fd_leak`] reruns this test alone in a child process;
/// run directly (without the variable), it does nothing.
#[test]
fn no_fd_leak_child() {
    if std::env::var_os(LEAK_CHILD_ENV).is_none() {
        return;
    }
    let before = open_fd_count();
    for round in 0..50 {
        let store = TestStore::default();
        let prefix = format!("leak{round}");
        for result in run_ranks(&store, &prefix, &[0, 1, 2], 3, Duration::from_secs(20)) {
            result.unwrap();
        }
    }
    // Error paths must not leak either: a few exchanges that time out.
    for round in 0..3 {
        let store = TestStore::default();
        let prefix = format!("leak-timeout{round}");
        for result in run_ranks(&store, &prefix, &[0, 1], 3, Duration::from_millis(300)) {
            assert!(matches!(result, Err(Error::Timeout { .. })));
        }
    }
    assert_eq!(open_fd_count(), before, "file descriptors leaked");
}

#[test]
#[serial_test::serial]
fn no_fd_leak() {
    let module = module_path!().split_once("::").map_or(module_path!(), |(_, rest)| rest);
    let name = format!("{module}::no_fd_leak_child");
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name.as_str(), "--exact", "--test-threads=1", "--nocapture"])
        .env(LEAK_CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "leak check failed:\n{stdout}\n{stderr}");
    // Make sure the filter matched and the child really ran the check.
    assert!(
        stdout.contains("1 passed"),
        "leak check did not run:\n{stdout}\n{stderr}"
    );
}
