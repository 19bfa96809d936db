//! Bootstrap store: TCP and in-process stores, the wire protocol's defences,
//! barrier/all-gather over a store, and rendezvous.
//!
//! Tests that start servers are `#[parallel]`; the one that counts the
//! process's store threads is `#[serial]`, so no other server runs meanwhile.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use ferrocomm::bootstrap::{
    read_token_file, rendezvous, store_all_gather, store_barrier, InProcStore, Store, TcpStore, TcpStoreConfig,
    TcpStoreServer,
};
use ferrocomm::Error;
use serial_test::{parallel, serial};

const TOKEN: &[u8] = b"0123456789abcdef-test-token";
const SECOND: Duration = Duration::from_secs(1);

fn config() -> TcpStoreConfig {
    TcpStoreConfig {
        io_timeout: Duration::from_millis(300),
        handshake_timeout: Duration::from_millis(300),
        ..TcpStoreConfig::new(TOKEN)
    }
}

fn start(cfg: TcpStoreConfig) -> TcpStoreServer {
    TcpStoreServer::start(cfg).expect("server starts")
}

fn client(server: &TcpStoreServer) -> TcpStore {
    TcpStore::connect(server.local_addr(), TOKEN, SECOND).expect("client connects")
}

/// A raw socket that has passed the handshake; its reply is checked.
fn raw_authed(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("raw connect");
    let mut hello = b"FCST\x02".to_vec();
    hello.extend_from_slice(&(TOKEN.len() as u16).to_le_bytes());
    hello.extend_from_slice(TOKEN);
    s.write_all(&hello).expect("send handshake");
    s.set_read_timeout(Some(2 * SECOND)).expect("set timeout");
    let mut ack = [0u8; 17]; // OK, max key u32, max value u32, idle ms u64
    s.read_exact(&mut ack).expect("handshake accepted");
    assert_eq!(ack[0], 0, "OK status");
    s
}

/// Assert the server closes `s` within `within`; returns how long it took.
fn assert_closed_within(s: &mut TcpStream, within: Duration) -> Duration {
    let start = Instant::now();
    s.set_read_timeout(Some(within)).expect("set timeout");
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return start.elapsed(),
            Ok(_) => continue, // e.g. an error reply before closing
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return start.elapsed(),
            Err(e) => panic!("connection still open after {:?}: {e}", start.elapsed()),
        }
    }
}

fn frame(op: u8, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut out = vec![op];
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
    out
}

fn assert_works(store: &dyn Store, key: &str) {
    store.set(key, b"alive").expect("set after the bad peer");
    assert_eq!(store.get(key, SECOND).expect("get"), b"alive");
}

// ---------------------------------------------------------------------------
// Basic operations.

/// Four thread-ranks hammer one store: own keys, a shared counter, reads of
/// each other's keys (waiting for them), then check/delete.
fn exercise(store: Arc<dyn Store>) {
    let world = 4;
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let store = Arc::clone(&store);
            thread::spawn(move || {
                store.set(&format!("key{rank}"), &[rank as u8; 3]).expect("set");
                for _ in 0..50 {
                    store.add("counter", 1).expect("add");
                }
                for other in 0..world {
                    let v = store.get(&format!("key{other}"), 5 * SECOND).expect("get");
                    assert_eq!(v, vec![other as u8; 3]);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("rank thread");
    }
    assert_eq!(store.add("counter", 0).expect("add 0"), 200);
    assert_eq!(store.get("counter", SECOND).expect("get counter"), b"200");
    assert_eq!(store.add("counter", -201).expect("add negative"), -1);
    assert!(store.check("key0").expect("check"));
    assert!(store.delete("key0").expect("delete"));
    assert!(!store.delete("key0").expect("delete again"));
    assert!(!store.check("key0").expect("check after delete"));
    store.set("key1", b"overwritten").expect("overwrite");
    assert_eq!(store.get("key1", SECOND).expect("get"), b"overwritten");
    // A value that is not an integer cannot be added to.
    assert!(matches!(store.add("key1", 1), Err(Error::Store(_))));
}

#[test]
#[parallel]
fn tcp_operations_across_threads() {
    let server = start(config());
    exercise(Arc::new(client(&server)));
}

#[test]
#[parallel]
fn inproc_operations_across_threads() {
    exercise(InProcStore::new());
}

#[test]
#[parallel]
fn tcp_get_waits_for_a_later_set_even_on_a_shared_client() {
    let server = start(config());
    // One client shared by the waiter and the setter: the setter must not
    // be stuck behind the waiter's blocked request.
    let store = Arc::new(client(&server));
    let waiter = {
        let store = Arc::clone(&store);
        thread::spawn(move || store.get("late", 5 * SECOND))
    };
    thread::sleep(Duration::from_millis(100));
    store.set("late", b"here").expect("set while another thread waits");
    assert_eq!(waiter.join().expect("waiter").expect("get"), b"here");
}

fn assert_get_times_out(store: &dyn Store) {
    let start = Instant::now();
    let err = store
        .get("absent", Duration::from_millis(200))
        .expect_err("must time out");
    let took = start.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(took >= Duration::from_millis(190) && took < 2 * SECOND, "{took:?}");
}

#[test]
#[parallel]
fn get_wait_times_out() {
    let server = start(config());
    let tcp = client(&server);
    assert_get_times_out(&tcp);
    assert_works(&tcp, "after-timeout"); // the connection is still in step
    assert_get_times_out(&*InProcStore::new());
}

#[test]
#[parallel]
fn inproc_limits_are_enforced() {
    let store = InProcStore::with_limits(8, 16, 2);
    assert!(matches!(store.set("123456789", b""), Err(Error::InvalidArgument(_))));
    assert!(matches!(store.set("k", &[0; 17]), Err(Error::InvalidArgument(_))));
    store.set("a", b"1").expect("first key");
    store.set("b", b"1").expect("second key");
    assert!(matches!(store.set("c", b"1"), Err(Error::Store(_))));
}

// ---------------------------------------------------------------------------
// Authentication and malformed input.

#[test]
#[parallel]
fn wrong_token_is_rejected_and_server_keeps_serving() {
    let server = start(config());
    let err = TcpStore::connect(server.local_addr(), b"not-the-token", SECOND).expect_err("must be rejected");
    assert!(matches!(err, Error::Store(_)), "{err}");
    // Same length, one byte off.
    let mut near = TOKEN.to_vec();
    near[0] ^= 1;
    assert!(TcpStore::connect(server.local_addr(), &near, SECOND).is_err());
    assert_works(&client(&server), "after-bad-token");
}

/// xorshift64: deterministic "random" garbage without a dependency.
fn garbage(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
#[parallel]
fn malformed_frames_close_only_that_connection() {
    let server = start(config());
    let good = client(&server);
    let addr = server.local_addr();
    let too_long_key = u32::try_from(TcpStoreConfig::default().max_key_bytes + 1).expect("fits");
    let too_long_value = u32::try_from(TcpStoreConfig::default().max_value_bytes + 1).expect("fits");

    let mut oversize_key = vec![1u8];
    oversize_key.extend_from_slice(&too_long_key.to_le_bytes());
    let mut oversize_value = frame(1, b"k", b"");
    oversize_value.truncate(oversize_value.len() - 4);
    oversize_value.extend_from_slice(&too_long_value.to_le_bytes());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage 1", garbage(1, 64)),
        ("garbage 2", garbage(0xdead_beef, 200)),
        ("unknown op", frame(0xEE, b"k", b"")),
        ("oversize key length", oversize_key),
        ("oversize value length", oversize_value),
        ("non-UTF-8 key", frame(1, &[0xff, 0xfe], b"v")),
        ("value on a CHECK", frame(4, b"k", b"v")),
    ];
    for (what, bytes) in cases {
        let mut bad = raw_authed(addr);
        bad.write_all(&bytes).expect("send");
        // Closed at once, or at the latest when the frame's io_timeout ends.
        let took = assert_closed_within(&mut bad, 2 * SECOND);
        assert!(took < 2 * SECOND, "{what}: {took:?}");
        assert_works(&good, what);
    }

    // Garbage instead of a handshake is turned away too.
    let mut pre_auth = TcpStream::connect(addr).expect("connect");
    pre_auth.write_all(&garbage(7, 32)).expect("send");
    assert_closed_within(&mut pre_auth, 2 * SECOND);
    assert_works(&good, "after pre-auth garbage");
}

#[test]
#[parallel]
fn max_keys_is_enforced_with_an_error_reply() {
    let server = start(TcpStoreConfig {
        max_keys: 3,
        ..config()
    });
    let store = client(&server);
    for k in ["a", "b", "c"] {
        store.set(k, b"v").expect("within the limit");
    }
    let err = store.set("d", b"v").expect_err("over the limit");
    assert!(matches!(err, Error::Store(ref m) if m.contains("full")), "{err}");
    assert!(matches!(store.add("counter", 1), Err(Error::Store(_))));
    store.set("a", b"overwrite").expect("overwriting is not a new key");
    assert!(store.delete("b").expect("delete"));
    store.set("d", b"v").expect("room again after a delete");
    assert!(!store.check("b").expect("check"));
}

#[test]
#[parallel]
fn client_refuses_oversize_requests_before_sending() {
    let server = start(TcpStoreConfig {
        max_key_bytes: 8,
        max_value_bytes: 16,
        ..config()
    });
    let store = client(&server);
    assert!(matches!(store.set("123456789", b""), Err(Error::InvalidArgument(_))));
    assert!(matches!(store.set("k", &[0; 17]), Err(Error::InvalidArgument(_))));
    assert_works(&store, "k");
}

// ---------------------------------------------------------------------------
// What the handshake tells a client.

/// Read the server's answer to a handshake: the status byte, or None if the
/// connection closed without one.
fn handshake_status(s: &mut TcpStream) -> Option<u8> {
    s.set_read_timeout(Some(3 * SECOND)).expect("set timeout");
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(1) => Some(b[0]),
        _ => None,
    }
}

fn hello(version: u8, token: &[u8]) -> Vec<u8> {
    let mut h = b"FCST".to_vec();
    h.push(version);
    h.extend_from_slice(&(token.len() as u16).to_le_bytes());
    h.extend_from_slice(token);
    h
}

const ST_TIMEOUT: u8 = 1;
const ST_ERROR: u8 = 2;
const ST_BUSY: u8 = 3;
const ST_DENIED: u8 = 4;

#[test]
#[parallel]
fn handshake_errors_say_what_happened() {
    let server = start(TcpStoreConfig {
        max_connections: 1,
        ..config()
    });
    let addr = server.local_addr();

    // Wrong token: told at once, no retrying until the timeout.
    let start_at = Instant::now();
    let err = TcpStore::connect(addr, b"not-the-token", 5 * SECOND).expect_err("wrong token");
    assert!(err.to_string().contains("rejected our token"), "{err}");
    assert!(start_at.elapsed() < SECOND, "a wrong token is not retried");
    let mut raw = TcpStream::connect(addr).expect("connect");
    raw.write_all(&hello(2, b"nope")).expect("send");
    assert_eq!(handshake_status(&mut raw), Some(ST_DENIED));

    // Another protocol version: an ERROR naming both versions.
    let mut old = TcpStream::connect(addr).expect("connect");
    old.write_all(&hello(1, TOKEN)).expect("send");
    assert_eq!(handshake_status(&mut old), Some(ST_ERROR));
    let mut rest = Vec::new();
    let _ = old.read_to_end(&mut rest);
    let msg = String::from_utf8_lossy(&rest);
    assert!(msg.contains("version 1 not supported; server speaks 2"), "{msg}");

    // Full: the one authenticated slot is taken, so a second client is told
    // BUSY, retries until its connect timeout, then says the store is full.
    let first = client(&server);
    assert_works(&first, "first");
    let start_at = Instant::now();
    let err = TcpStore::connect(addr, TOKEN, Duration::from_millis(400)).expect_err("full");
    assert!(err.to_string().contains("is full"), "{err}");
    assert!(
        start_at.elapsed() >= Duration::from_millis(400),
        "{:?}",
        start_at.elapsed()
    );
    drop(first);
    // Once the slot frees up, a client gets in again.
    thread::sleep(Duration::from_millis(100));
    assert_works(
        &TcpStore::connect(addr, TOKEN, 2 * SECOND).expect("slot free again"),
        "second",
    );

    // Nothing listening: the error is about connecting, not about the token.
    let dead = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let err = TcpStore::connect(dead, TOKEN, Duration::from_millis(200)).expect_err("nobody there");
    assert!(
        matches!(err, Error::Io { ref context, ref source } if context.contains("connecting to the store")
            && source.kind() == ErrorKind::ConnectionRefused),
        "{err}"
    );
}

#[test]
#[parallel]
fn slow_handshakes_time_out_and_a_full_pool_drops_the_oldest() {
    let server = start(TcpStoreConfig {
        max_pending_handshakes: 2,
        handshake_timeout: 2 * SECOND,
        ..config()
    });
    let addr = server.local_addr();
    let mut oldest = TcpStream::connect(addr).expect("connect");
    thread::sleep(Duration::from_millis(50));
    let mut second = TcpStream::connect(addr).expect("connect");
    thread::sleep(Duration::from_millis(50));
    // A third pending handshake pushes out the oldest, which is told BUSY...
    let _third = TcpStream::connect(addr).expect("connect");
    assert_eq!(handshake_status(&mut oldest), Some(ST_BUSY));
    // ...and a prompt client still gets in, pushing out the next oldest.
    assert_works(&client(&server), "prompt client");
    assert_eq!(handshake_status(&mut second), Some(ST_BUSY));

    // A hello that never completes is told TIMEOUT after handshake_timeout.
    let quick = start(config()); // handshake_timeout 300 ms
    let mut silent = TcpStream::connect(quick.local_addr()).expect("connect");
    let start_at = Instant::now();
    assert_eq!(handshake_status(&mut silent), Some(ST_TIMEOUT));
    let took = start_at.elapsed();
    assert!(took >= Duration::from_millis(250) && took < 2 * SECOND, "{took:?}");
}

// ---------------------------------------------------------------------------
// Flood of connections that never authenticate.

/// Raise the soft open-files limit towards `want` (up to the hard limit);
/// returns the soft limit in force afterwards.
fn raise_fd_limit(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, exclusively borrowed rlimit for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    if lim.rlim_cur < want {
        let raised = libc::rlimit {
            rlim_cur: want.min(lim.rlim_max),
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit; lowering is impossible here
        // (only raised when below `want`, never above the hard limit).
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = raised.rlim_cur;
        }
    }
    lim.rlim_cur
}

/// What one flood connection sends after connecting.
#[derive(Clone, Copy)]
enum FloodKind {
    /// Connects and says nothing.
    Silent,
    /// Sends the magic only, then stalls.
    HalfHello,
    /// A complete hello with a wrong token (turned away, so it churns).
    WrongToken,
    /// Claims a 65535-byte token and sends 1000 bytes of it.
    Oversized,
}

impl FloodKind {
    fn payload(self) -> Vec<u8> {
        match self {
            FloodKind::Silent => Vec::new(),
            FloodKind::HalfHello => b"FCST".to_vec(),
            FloodKind::WrongToken => hello(2, b"0123456789abcdef-WRONG-token"),
            FloodKind::Oversized => {
                let mut h = b"FCST\x02".to_vec();
                h.extend_from_slice(&u16::MAX.to_le_bytes());
                h.extend_from_slice(&[b'x'; 1000]);
                h
            }
        }
    }
}

#[derive(Default)]
struct FloodStats {
    opened: AtomicUsize,
    connect_failures: AtomicUsize,
    answered: AtomicUsize,
    /// Flood connections open right now, over all threads, and the peak.
    open_now: AtomicUsize,
    open_peak: AtomicUsize,
}

impl FloodStats {
    fn opened_one(&self) {
        self.opened.fetch_add(1, Ordering::Relaxed);
        let now = self.open_now.fetch_add(1, Ordering::Relaxed) + 1;
        self.open_peak.fetch_max(now, Ordering::Relaxed);
    }
}

/// Keep `slots` flood connections open, reopening each as the server closes
/// it, until `stop`.
fn flood(addr: SocketAddr, slots: usize, first_kind: usize, stop: &AtomicBool, stats: &FloodStats) {
    let kinds = [
        FloodKind::Silent,
        FloodKind::HalfHello,
        FloodKind::WrongToken,
        FloodKind::Oversized,
    ];
    let mut conns: Vec<Option<TcpStream>> = (0..slots).map(|_| None).collect();
    let mut buf = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        for (i, slot) in conns.iter_mut().enumerate() {
            if let Some(s) = slot {
                match s.read(&mut buf) {
                    Err(e) if e.kind() == ErrorKind::WouldBlock => continue,
                    Ok(n) if n > 0 => {
                        stats.answered.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
                *slot = None;
                stats.open_now.fetch_sub(1, Ordering::Relaxed);
            }
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let kind = kinds[(first_kind + i) % kinds.len()];
            match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                Ok(mut s) => {
                    stats.opened_one();
                    let _ = s.write_all(&kind.payload());
                    let _ = s.set_nonblocking(true);
                    *slot = Some(s);
                }
                Err(_) => {
                    stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        thread::sleep(Duration::from_millis(2));
    }
}

/// ~1100 connections that never authenticate (silent, half a hello, wrong
/// token, oversized token), refilled as the server closes them, from three
/// threads; meanwhile a rank sets and gets every 250 ms, both on a pooled
/// client and on a freshly connected one, for three seconds (six with
/// `FERROCOMM_TEST_FULL=1`; either way the 1 s handshake timeout closes
/// flood connections several times over and the flood refills them): no
/// failures, and no operation slower than a second.
#[test]
#[serial]
fn store_keeps_serving_under_a_handshake_flood() {
    // Each flood connection holds two descriptors in this process (client
    // and server side); leave room for everything else.
    let fd_limit = raise_fd_limit(8192);
    let connections = 1100.min(usize::try_from(fd_limit.saturating_sub(300) / 2).unwrap_or(0));
    assert!(
        connections >= 300,
        "open-files limit {fd_limit} is too low for a meaningful flood"
    );
    let server = start(TcpStoreConfig {
        handshake_timeout: SECOND,
        ..TcpStoreConfig::new(TOKEN)
    });
    let addr = server.local_addr();
    let pooled = TcpStore::connect(addr, TOKEN, 5 * SECOND).expect("rank connects before the flood");

    let stop = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(FloodStats::default());
    let flooders = 3;
    let handles: Vec<_> = (0..flooders)
        .map(|t| {
            let (stop, stats) = (Arc::clone(&stop), Arc::clone(&stats));
            let slots = connections / flooders;
            thread::spawn(move || flood(addr, slots, t, &stop, &stats))
        })
        .collect();
    thread::sleep(Duration::from_millis(500)); // let the flood build up

    let secs = if ferrocomm::testing::conformance::full_sweep() {
        6
    } else {
        3
    };
    let mut failures = Vec::new();
    let mut ops = 0;
    let mut slowest = Duration::ZERO;
    let began = Instant::now();
    while began.elapsed() < secs * SECOND {
        let t0 = Instant::now();
        let key = format!("flood/{ops}");
        let fresh = TcpStore::connect(addr, TOKEN, 5 * SECOND).and_then(|fresh| {
            fresh.set(&key, b"fresh")?;
            fresh.get(&key, SECOND)
        });
        match fresh {
            Ok(v) if v == b"fresh" => {}
            other => failures.push(format!("fresh client, op {ops}: {other:?}")),
        }
        let on_pool = pooled.set(&key, b"pooled").and_then(|()| pooled.get(&key, SECOND));
        match on_pool {
            Ok(v) if v == b"pooled" => {}
            other => failures.push(format!("pooled client, op {ops}: {other:?}")),
        }
        slowest = slowest.max(t0.elapsed());
        ops += 1;
        thread::sleep(Duration::from_millis(250).saturating_sub(t0.elapsed()));
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().expect("flood thread");
    }
    let opened = stats.opened.load(Ordering::Relaxed);
    eprintln!(
        "flood: {connections} slots, peak {} open at once, {opened} opened in total, {} answered by the \
         server, {} connects failed; rank: {ops} rounds, slowest {slowest:?}, {} failures",
        stats.open_peak.load(Ordering::Relaxed),
        stats.answered.load(Ordering::Relaxed),
        stats.connect_failures.load(Ordering::Relaxed),
        failures.len()
    );
    assert!(failures.is_empty(), "{failures:#?}");
    // Rounds of 250 ms: at least five in six of them run (20 in 6 s).
    assert!(ops >= secs * 10 / 3, "only {ops} rounds in {secs} s");
    assert!(slowest < SECOND, "a round took {slowest:?}");
    // The flood was real: the slots were filled and refilled.
    assert!(opened >= connections, "only {opened} flood connections opened");
    drop(server);
}

// ---------------------------------------------------------------------------
// Timeouts on stalled peers.

#[test]
#[parallel]
fn half_open_frame_is_dropped_after_io_timeout() {
    let server = start(config()); // io_timeout 300 ms, idle_timeout 600 s
    let good = client(&server);
    let mut stalled = raw_authed(server.local_addr());
    stalled
        .write_all(&frame(1, b"key", b"value")[..6])
        .expect("half a frame");
    let took = assert_closed_within(&mut stalled, 3 * SECOND);
    assert!(took >= Duration::from_millis(250), "closed before io_timeout: {took:?}");
    assert_works(&good, "after-half-open");

    // A handshake that never completes is dropped after handshake_timeout.
    let mut half_hello = TcpStream::connect(server.local_addr()).expect("connect");
    half_hello.write_all(b"FCST").expect("send");
    let took = assert_closed_within(&mut half_hello, 3 * SECOND);
    assert!(took >= Duration::from_millis(250), "{took:?}");
}

#[test]
#[parallel]
fn idle_connection_is_closed_and_client_reconnects() {
    let server = start(TcpStoreConfig {
        idle_timeout: Duration::from_millis(400),
        ..config()
    });
    let store = client(&server);
    let mut idle = raw_authed(server.local_addr());
    let took = assert_closed_within(&mut idle, 3 * SECOND);
    assert!(took >= Duration::from_millis(350), "{took:?}");
    // The client's pooled connection was idled out too; it must notice and
    // use a fresh one instead of failing.
    thread::sleep(Duration::from_millis(500));
    assert_works(&store, "after-idle");
}

// ---------------------------------------------------------------------------
// Shutdown.

/// Threads whose name starts with the store's prefix (Linux: /proc).
fn store_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("ferrocomm-store"))
        .count()
}

#[test]
#[serial]
fn dropping_the_server_releases_port_threads_and_waiters() {
    let before = store_threads();
    let server = start(config());
    let addr = server.local_addr();
    let idle_client = client(&server);
    assert_works(&idle_client, "warm");
    let waiter = {
        let store = client(&server);
        thread::spawn(move || {
            let start = Instant::now();
            (store.get("never-set", 30 * SECOND), start.elapsed())
        })
    };
    let _half_open = raw_authed(addr);
    thread::sleep(Duration::from_millis(200));
    if cfg!(target_os = "linux") {
        assert!(store_threads() >= before + 4, "accept + 3 connection threads");
    }

    let start = Instant::now();
    drop(server);
    assert!(start.elapsed() < 2 * SECOND, "drop took {:?}", start.elapsed());
    assert_eq!(store_threads(), before, "every server thread joined");

    let (result, waited) = waiter.join().expect("waiter");
    assert!(result.is_err(), "a get on a dead server must fail");
    assert!(waited < 5 * SECOND, "the waiter hung for {waited:?}");
    assert!(idle_client.set("k", b"v").is_err());
    assert!(TcpStream::connect(addr).is_err(), "nothing listens any more");
    TcpListener::bind(addr).expect("the port is free again");
}

// ---------------------------------------------------------------------------
// Barrier and all-gather.

fn run_ranks<T: Send + 'static>(
    world: usize,
    store: Arc<dyn Store>,
    f: impl Fn(&dyn Store, usize) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, f) = (Arc::clone(&store), Arc::clone(&f));
            thread::spawn(move || f(&*store, rank))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

fn barrier_and_all_gather(store: Arc<dyn Store>) {
    let world = 4;
    let arrived = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&arrived);
    let gathered = run_ranks(world, Arc::clone(&store), move |store, rank| {
        let mut all = Vec::new();
        for round in 0..5 {
            counted.fetch_add(1, Ordering::SeqCst);
            store_barrier(store, &format!("t/barrier{round}"), rank, world, 5 * SECOND).expect("barrier");
            // Nobody leaves a barrier before everyone reached it.
            assert!(counted.load(Ordering::SeqCst) >= (round + 1) * world);
            let mine = format!("rank{rank}-round{round}").into_bytes();
            all.push(store_all_gather(store, &format!("t/ag{round}"), rank, world, &mine, 5 * SECOND).expect("ag"));
        }
        all
    });
    for per_rank in gathered {
        for (round, values) in per_rank.iter().enumerate() {
            let want: Vec<Vec<u8>> = (0..world)
                .map(|r| format!("rank{r}-round{round}").into_bytes())
                .collect();
            assert_eq!(values, &want);
        }
    }
    // The last rank out cleaned up, so repeated calls do not fill the store.
    for round in 0..5 {
        for suffix in ["0", "3", "arrived", "done", "left"] {
            assert!(!store.check(&format!("t/barrier{round}/{suffix}")).expect("check"));
        }
        assert!(!store.check(&format!("t/ag{round}/2")).expect("check"));
    }
}

#[test]
#[parallel]
fn barrier_and_all_gather_over_tcp() {
    let server = start(config());
    barrier_and_all_gather(Arc::new(client(&server)));
}

#[test]
#[parallel]
fn barrier_and_all_gather_in_process() {
    barrier_and_all_gather(InProcStore::new());
}

#[test]
#[parallel]
fn collective_timeouts_name_the_missing_rank() {
    let server = start(config());
    let store: Arc<dyn Store> = Arc::new(client(&server));
    let short = Duration::from_millis(300);
    // Rank 3 of 4 never shows up.
    let results = run_ranks(3, Arc::clone(&store), move |store, rank| {
        let barrier = store_barrier(store, "t/late-barrier", rank, 4, short);
        let gather = store_all_gather(store, "t/late-ag", rank, 4, b"x", short);
        (barrier, gather)
    });
    for (barrier, gather) in results {
        match barrier {
            Err(Error::Timeout { missing, .. }) => assert_eq!(missing, vec![3]),
            other => panic!("barrier: expected a timeout, got {other:?}"),
        }
        match gather {
            Err(Error::Timeout { missing, .. }) => assert_eq!(missing, vec![3]),
            other => panic!("all-gather: expected a timeout, got {other:?}"),
        }
    }
    let err = store_barrier(&*store, "t/bad", 4, 4, short).expect_err("rank out of range");
    assert!(matches!(err, Error::InvalidArgument(_)));
}

// ---------------------------------------------------------------------------
// Rendezvous and the token file.

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[test]
#[parallel]
fn rendezvous_with_three_thread_ranks() {
    let world = 3;
    let port = free_port();
    let all_done = Arc::new(Barrier::new(world));
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let all_done = Arc::clone(&all_done);
            thread::spawn(move || {
                // Ranks 1 and 2 may come up before rank 0's server: they retry.
                let rdv = rendezvous("127.0.0.1", port, rank, world, rank + 10, TOKEN).expect("rendezvous");
                assert_eq!((rdv.rank, rdv.world, rdv.local_rank), (rank, world, rank + 10));
                assert_eq!(rdv.hosts_server(), rank == 0);
                let got = store_all_gather(&*rdv.store, "t/rdv", rank, world, &[rank as u8], 5 * SECOND)
                    .expect("all-gather over the rendezvous store");
                assert_eq!(got, vec![vec![0], vec![1], vec![2]]);
                // Rank 0 hosts the store: keep it until everyone is done.
                all_done.wait();
            })
        })
        .collect();
    for h in handles {
        h.join().expect("rank thread");
    }
}

/// Rank 0 hosts the store: `depart` keeps it until every other rank has
/// left, so a rank still at work with the store when rank 0 is done (here:
/// rank 2, which starts a store barrier's cleanup only after the others
/// have gone) finds it open. No thread barrier holds rank 0 back.
#[test]
#[parallel]
fn rank_zero_departs_after_the_others() {
    let world = 3;
    let port = free_port();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            thread::spawn(move || {
                let rdv = rendezvous("127.0.0.1", port, rank, world, rank, TOKEN).expect("rendezvous");
                store_barrier(&*rdv.store, "t/depart", rank, world, 5 * SECOND).expect("barrier");
                if rank == 2 {
                    // Still using the store well after rank 0 has finished.
                    thread::sleep(Duration::from_millis(300));
                    for i in 0..20 {
                        rdv.store
                            .set(&format!("t/late/{i}"), b"x")
                            .expect("rank 0's store is still open");
                    }
                }
                let start = Instant::now();
                rdv.depart().expect("depart");
                rdv.depart().expect("a second depart returns at once");
                (rank, start.elapsed())
            })
        })
        .collect();
    for h in handles {
        let (rank, waited) = h.join().expect("rank thread");
        if rank == 0 {
            assert!(waited >= Duration::from_millis(200), "rank 0 left after {waited:?}");
        }
    }
}

#[test]
#[parallel]
fn rendezvous_rejects_bad_arguments() {
    let port = free_port();
    assert!(matches!(
        rendezvous("127.0.0.1", port, 3, 3, 0, TOKEN),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        rendezvous("127.0.0.1", port, 0, 0, 0, TOKEN),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        rendezvous("127.0.0.1", port, 0, 1, 0, b""),
        Err(Error::InvalidArgument(_))
    ));
}

#[cfg(unix)]
#[test]
#[parallel]
fn token_file_must_not_be_readable_by_others() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("ferrocomm-token-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("token");
    std::fs::write(&path, b"s3cret-token\n").expect("write token");

    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod 644");
    let err = read_token_file(&path).expect_err("0644 must be refused");
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("chmod 600")),
        "{err}"
    );

    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod 600");
    assert_eq!(read_token_file(&path).expect("0600 is accepted"), b"s3cret-token");

    std::fs::write(&path, b"\n").expect("empty token");
    assert!(read_token_file(&path).is_err(), "an empty token is refused");
    assert!(read_token_file(&dir.join("absent")).is_err());
    std::fs::remove_dir_all(&dir).expect("clean up");
}
