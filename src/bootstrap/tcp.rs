//! TCP store: a small authenticated key-value server run by rank 0, and the
//! client every rank uses.
//!
//! Wire protocol, version 2 (all integers little-endian, no self-describing
//! encoding):
//!
//! * handshake, client → server: `b"FCST"`, version `u8`, token length `u16`,
//!   token. The server compares the token in constant time and answers one
//!   status byte:
//!   - `OK`, then `max_key_bytes u32`, `max_value_bytes u32`,
//!     `idle_timeout_ms u64`, so the client can refuse oversize requests itself
//!     and retire pooled connections before the server idles them out;
//!   - `DENIED`: wrong token (saying so reveals nothing secret);
//!   - `BUSY`: the server holds `max_connections` authenticated connections, or
//!     dropped this handshake to make room for a newer one; retry later;
//!   - `TIMEOUT`: the hello did not arrive within `handshake_timeout`;
//!   - `ERROR` + length `u32` + UTF-8 message: e.g. a protocol version the
//!     server does not speak.
//!
//!   then closes the connection unless the status was `OK`. A hello with the
//!   wrong magic is closed without a word (it is not a ferrocomm client).
//! * request: op `u8`, key length `u32`, key (UTF-8), value length `u32`,
//!   value (empty except for SET), then for GET the wait in ms `u64`, for ADD
//!   the delta `i64`.
//! * response: status `u8`, then for `OK`: GET → length `u32` + value,
//!   ADD → `i64`, CHECK/DELETE → `u8` (0/1), SET → nothing; `TIMEOUT` → nothing;
//!   `ERROR` → length `u32` + UTF-8 message.
//!
//! A malformed frame (unknown op, a length over the caps, a non-UTF-8 key, a
//! frame not completed within `io_timeout`) closes that connection only.
//!
//! Connections still in the handshake live in a small pool of their own
//! (`max_pending_handshakes`, see [`super::admission`]) and cost no thread, so
//! a flood of connections that never authenticate cannot take the slots that
//! ranks need.

use std::collections::HashMap;
use std::io::{self, ErrorKind, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::admission;
use super::inproc::{get_timeout, Limits, Lookup, Table};
use super::wire::{invalid_data, Deadlined};
use super::Store;
use crate::error::{Error, Result};

pub(super) const MAGIC: &[u8; 4] = b"FCST";
/// Version 2 added the BUSY and DENIED handshake answers.
pub(super) const VERSION: u8 = 2;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_DELETE: u8 = 5;

pub(super) const ST_OK: u8 = 0;
/// A GET's wait ran out; in the handshake, the hello came too late.
pub(super) const ST_TIMEOUT: u8 = 1;
pub(super) const ST_ERROR: u8 = 2;
/// Handshake only: no room now, retry later.
pub(super) const ST_BUSY: u8 = 3;
/// Handshake only: the token does not match.
pub(super) const ST_DENIED: u8 = 4;

/// Client-side slack on top of a request's own wait, so a dead server gives an
/// error instead of a hang while a slow but live one still answers.
const CLIENT_IO_MARGIN: Duration = Duration::from_secs(10);
/// Idle client connections kept for reuse; more are closed after use.
const CLIENT_POOL_MAX: usize = 4;
/// First pause between connection attempts, and the largest while nothing
/// listens yet (the server may take a while to come up).
const RETRY_FIRST: Duration = Duration::from_millis(10);
const RETRY_MAX: Duration = Duration::from_millis(500);
/// Largest pause after the server turned us away mid-handshake (BUSY, reset):
/// a live server admits a prompt client on one of the next tries, so waiting
/// long only adds latency.
const RETRY_MAX_LIVE: Duration = Duration::from_millis(50);

/// Settings for [`TcpStoreServer::start`].
#[derive(Clone)]
pub struct TcpStoreConfig {
    /// Address to listen on. Loopback unless the job spans hosts.
    pub bind_addr: IpAddr,
    /// Port to listen on; 0 picks a free one (see [`TcpStoreServer::local_addr`]).
    pub port: u16,
    /// Per-job secret every client must present. Must not be empty.
    pub token: Vec<u8>,
    /// Longest key accepted (default 1 KiB); a longer one closes the connection.
    pub max_key_bytes: usize,
    /// Longest value accepted (default 4 MiB); a longer one closes the connection.
    pub max_value_bytes: usize,
    /// Most keys held at once; a SET/ADD creating one more gets an error.
    pub max_keys: usize,
    /// Most authenticated connections served at once (default 1024); a client
    /// past it is answered BUSY. Handshakes in progress do not count.
    pub max_connections: usize,
    /// Most connections still in the handshake (default 64). When full, the
    /// oldest is dropped (answered BUSY) to admit the newcomer, so a flood of
    /// connections that never say hello cannot keep a prompt client out.
    pub max_pending_handshakes: usize,
    /// Time from accept to a complete hello (default 2 s). Clients send it at
    /// once, so only stalled or hostile peers hit this.
    pub handshake_timeout: Duration,
    /// Default for clients connecting to this server (used by rendezvous).
    pub connect_timeout: Duration,
    /// A connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// Time allowed for the rest of a frame once its first byte arrived;
    /// defeats half-open and slow-drip connections.
    pub io_timeout: Duration,
}

impl Default for TcpStoreConfig {
    fn default() -> Self {
        let limits = Limits::default();
        TcpStoreConfig {
            bind_addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            token: Vec::new(),
            max_key_bytes: limits.max_key_bytes,
            max_value_bytes: limits.max_value_bytes,
            max_keys: limits.max_keys,
            max_connections: 1024,
            max_pending_handshakes: 64,
            handshake_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(600),
            io_timeout: Duration::from_secs(10),
        }
    }
}

impl TcpStoreConfig {
    /// Defaults (loopback, ephemeral port) with the given token.
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        TcpStoreConfig {
            token: token.into(),
            ..Self::default()
        }
    }

    fn validate(&self) -> Result<()> {
        if self.token.is_empty() {
            return Err(Error::invalid(
                "TcpStoreConfig.token is empty: the store needs a per-job random token",
            ));
        }
        if self.token.len() > usize::from(u16::MAX) {
            return Err(Error::invalid("TcpStoreConfig.token is longer than 65535 bytes"));
        }
        if self.io_timeout.is_zero() || self.idle_timeout.is_zero() || self.handshake_timeout.is_zero() {
            return Err(Error::invalid(
                "TcpStoreConfig io_timeout, idle_timeout and handshake_timeout must be non-zero",
            ));
        }
        if self.max_connections == 0 || self.max_pending_handshakes == 0 {
            return Err(Error::invalid(
                "TcpStoreConfig max_connections and max_pending_handshakes must be at least 1",
            ));
        }
        Ok(())
    }
}

// Hand-written so the token never lands in a log.
impl std::fmt::Debug for TcpStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreConfig")
            .field("bind_addr", &self.bind_addr)
            .field("port", &self.port)
            .field("token", &"<redacted>")
            .field("max_key_bytes", &self.max_key_bytes)
            .field("max_value_bytes", &self.max_value_bytes)
            .field("max_keys", &self.max_keys)
            .field("max_connections", &self.max_connections)
            .field("max_pending_handshakes", &self.max_pending_handshakes)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("io_timeout", &self.io_timeout)
            .finish()
    }
}

// ---------------------------------------------------------------------------
// Framing helpers shared by server and client.

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // Callers check lengths against the caps (all far below u32::MAX) first.
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Equality whose running time does not depend on where the inputs differ.
pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    std::hint::black_box(diff) == 0
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a plain insert/remove/push; a panic in
    // one cannot leave the data inconsistent, so poisoning is ignored.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The handshake's `ERROR` answer to a client speaking another version.
pub(super) fn version_mismatch_reply(version: u8) -> Vec<u8> {
    let mut reply = vec![ST_ERROR];
    let msg = format!("protocol version {version} not supported; server speaks {VERSION}");
    put_bytes(&mut reply, msg.as_bytes());
    reply
}

// ---------------------------------------------------------------------------
// Server.

/// State shared by the admission thread, the connection threads and `Drop`.
pub(super) struct Shared {
    pub(super) cfg: TcpStoreConfig,
    table: Table,
    pub(super) stop: AtomicBool,
    conns: Mutex<Registry>,
}

/// Live authenticated connections, so shutdown can unblock their reads.
struct Registry {
    stopping: bool,
    next_id: u64,
    streams: HashMap<u64, TcpStream>,
}

/// Why an authenticated connection was not given a thread.
pub(super) enum Refusal {
    /// `max_connections` reached: tell the client to retry.
    Full,
    /// Shutting down, or the OS would not give us a thread or a handle.
    Gone,
}

/// The store server. Runs on background threads until dropped; dropping it
/// closes every connection and joins every thread.
pub struct TcpStoreServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    accept_thread: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Bind `cfg.bind_addr:cfg.port` and start serving.
    pub fn start(cfg: TcpStoreConfig) -> Result<TcpStoreServer> {
        cfg.validate()?;
        let at = SocketAddr::new(cfg.bind_addr, cfg.port);
        let listener = TcpListener::bind(at).map_err(|e| Error::io(format!("binding the store to {at}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the store's bound address", e))?;
        admission::widen_backlog(&listener);
        // Non-blocking accept: the admission loop polls the listener together
        // with the pending handshakes.
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the store listener non-blocking", e))?;
        let limits = Limits {
            max_key_bytes: cfg.max_key_bytes,
            max_value_bytes: cfg.max_value_bytes,
            max_keys: cfg.max_keys,
        };
        let shared = Arc::new(Shared {
            cfg,
            table: Table::new(limits),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Registry {
                stopping: false,
                next_id: 0,
                streams: HashMap::new(),
            }),
        });
        let for_thread = Arc::clone(&shared);
        let accept_thread = thread::Builder::new()
            .name("ferrocomm-store-accept".into())
            .spawn(move || admission::run(&for_thread, &listener))
            .map_err(|e| Error::io("spawning the store accept thread", e))?;
        Ok(TcpStoreServer {
            shared,
            local_addr,
            accept_thread: Some(accept_thread),
        })
    }

    /// The address the server listens on (with the real port when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// An address a client on this host can connect to: the bound one, with a
    /// wildcard bind mapped to loopback.
    pub fn connect_addr(&self) -> SocketAddr {
        let ip = match self.local_addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        SocketAddr::new(ip, self.local_addr.port())
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            // Under the registry lock, so the admission thread cannot admit a
            // connection after this sweep.
            let mut reg = lock(&self.shared.conns);
            reg.stopping = true;
            for stream in reg.streams.values() {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        self.shared.table.close();
        if let Some(handle) = self.accept_thread.take() {
            // The admission thread joins the connection threads before it exits.
            let _ = handle.join();
        }
    }
}

/// Give an authenticated connection its own thread, which first sends the
/// handshake's `OK` answer. On refusal the stream is handed back so the
/// caller can answer BUSY.
pub(super) fn serve_authenticated(
    shared: &Arc<Shared>,
    stream: TcpStream,
) -> std::result::Result<JoinHandle<()>, (Refusal, Option<TcpStream>)> {
    let Ok(watch) = stream.try_clone() else {
        return Err((Refusal::Gone, None));
    };
    let id = {
        let mut reg = lock(&shared.conns);
        if reg.stopping {
            return Err((Refusal::Gone, None));
        }
        if reg.streams.len() >= shared.cfg.max_connections {
            return Err((Refusal::Full, Some(stream)));
        }
        let id = reg.next_id;
        reg.next_id += 1;
        reg.streams.insert(id, watch);
        id
    };
    let for_thread = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name("ferrocomm-store-conn".into())
        .spawn(move || {
            serve_connection(&for_thread, stream);
            lock(&for_thread.conns).streams.remove(&id);
        });
    spawned.map_err(|_| {
        lock(&shared.conns).streams.remove(&id);
        (Refusal::Gone, None)
    })
}

/// Serve one authenticated client until it leaves, misbehaves, idles out or
/// the server stops. Every exit path simply drops (closes) the stream.
fn serve_connection(shared: &Shared, mut stream: TcpStream) {
    // The admission loop left the socket non-blocking; from here on each
    // read and write is bounded by its own timeout instead.
    if stream.set_nonblocking(false).is_err()
        || stream.set_write_timeout(Some(shared.cfg.io_timeout)).is_err()
        || stream.write_all(&ok_reply(&shared.cfg)).is_err()
    {
        return;
    }
    while !shared.stop.load(Ordering::SeqCst) {
        let op = match Deadlined::new(&mut stream, shared.cfg.idle_timeout).u8() {
            Ok(op) => op,
            Err(_) => return,
        };
        let request = match read_request(shared, &mut stream, op) {
            Ok(request) => request,
            Err(_) => return,
        };
        let reply = execute(&shared.table, request);
        if stream.write_all(&reply).is_err() {
            return;
        }
    }
}

/// The handshake's `OK` answer: the limits the client must respect.
fn ok_reply(cfg: &TcpStoreConfig) -> Vec<u8> {
    let mut reply = vec![ST_OK];
    let cap = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    reply.extend_from_slice(&cap(cfg.max_key_bytes).to_le_bytes());
    reply.extend_from_slice(&cap(cfg.max_value_bytes).to_le_bytes());
    reply.extend_from_slice(&millis(cfg.idle_timeout).to_le_bytes());
    reply
}

enum Request {
    Set(String, Vec<u8>),
    Get(String, Duration),
    Add(String, i64),
    Check(String),
    Delete(String),
}

/// Read the rest of a request whose op byte has arrived; the whole frame must
/// arrive within `io_timeout`. Any error means the connection is closed.
fn read_request(shared: &Shared, stream: &mut TcpStream, op: u8) -> io::Result<Request> {
    if !(OP_SET..=OP_DELETE).contains(&op) {
        return Err(invalid_data("unknown op"));
    }
    let mut rd = Deadlined::new(stream, shared.cfg.io_timeout);
    let key = rd.bytes(shared.cfg.max_key_bytes)?;
    let key = String::from_utf8(key).map_err(|_| invalid_data("key is not UTF-8"))?;
    // Only SET carries a value; anything else sending one is malformed.
    let max_value = if op == OP_SET { shared.cfg.max_value_bytes } else { 0 };
    let value = rd.bytes(max_value)?;
    Ok(match op {
        OP_SET => Request::Set(key, value),
        OP_GET => Request::Get(key, Duration::from_millis(rd.u64()?)),
        OP_ADD => Request::Add(key, rd.i64()?),
        OP_CHECK => Request::Check(key),
        _ => Request::Delete(key),
    })
}

/// Run a request against the table and encode the response.
fn execute(table: &Table, request: Request) -> Vec<u8> {
    let mut out = vec![ST_OK];
    let result = match request {
        Request::Set(key, value) => table.set(&key, &value),
        Request::Get(key, wait) => match table.wait_get(&key, wait) {
            Ok(Lookup::Found(value)) => {
                put_bytes(&mut out, &value);
                Ok(())
            }
            Ok(Lookup::TimedOut) => return vec![ST_TIMEOUT],
            Err(e) => Err(e),
        },
        Request::Add(key, delta) => table.add(&key, delta).map(|n| out.extend_from_slice(&n.to_le_bytes())),
        Request::Check(key) => table.check(&key).map(|b| out.push(u8::from(b))),
        Request::Delete(key) => table.delete(&key).map(|b| out.push(u8::from(b))),
    };
    match result {
        Ok(()) => out,
        Err(e) => {
            let mut out = vec![ST_ERROR];
            let msg = match e {
                Error::Store(msg) => msg,
                other => other.to_string(),
            };
            put_bytes(&mut out, msg.as_bytes());
            out
        }
    }
}

// ---------------------------------------------------------------------------
// Client.

/// A client of [`TcpStoreServer`]. Safe to share between threads: each call
/// borrows a pooled connection (opening another when all are busy), so one
/// thread blocked in `get` does not stall the others.
pub struct TcpStore {
    addr: SocketAddr,
    token: Vec<u8>,
    /// Timeout for opening extra connections after the first one.
    reconnect_timeout: Duration,
    server: ServerInfo,
    /// Idle connections with the time each was last used.
    idle: Mutex<Vec<(TcpStream, Instant)>>,
}

// Hand-written: the token must not be printed.
impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

/// What the server announces in its handshake reply.
#[derive(Clone, Copy)]
struct ServerInfo {
    max_key_bytes: usize,
    max_value_bytes: usize,
    idle_timeout: Duration,
}

/// What a request came back with, short of an error.
enum Reply<T> {
    Ok(T),
    TimedOut,
}

impl TcpStore {
    /// Connect and authenticate, retrying until `connect_timeout` since the
    /// server may not be up yet. A wrong token fails at once.
    pub fn connect(addr: SocketAddr, token: &[u8], connect_timeout: Duration) -> Result<TcpStore> {
        if token.is_empty() || token.len() > usize::from(u16::MAX) {
            return Err(Error::invalid("store token must be 1 to 65535 bytes long"));
        }
        let (stream, server) = open(addr, token, connect_timeout)?;
        Ok(TcpStore {
            addr,
            token: token.to_vec(),
            reconnect_timeout: connect_timeout.min(CLIENT_IO_MARGIN),
            server,
            idle: Mutex::new(vec![(stream, Instant::now())]),
        })
    }

    /// The server address this client talks to.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    fn check_key(&self, key: &str) -> Result<()> {
        if key.len() > self.server.max_key_bytes {
            return Err(Error::invalid(format!(
                "store key of {} bytes exceeds the server's limit of {} bytes",
                key.len(),
                self.server.max_key_bytes
            )));
        }
        Ok(())
    }

    /// A pooled connection the server has not yet idled out, or a new one.
    fn take_connection(&self) -> Result<TcpStream> {
        // Half the server's idle timeout leaves room for clock drift and
        // for a request already on its way.
        let fresh_for = self.server.idle_timeout / 2;
        let mut idle = lock(&self.idle);
        while let Some((stream, used)) = idle.pop() {
            if used.elapsed() < fresh_for {
                return Ok(stream);
            }
        }
        drop(idle);
        Ok(open(self.addr, &self.token, self.reconnect_timeout)?.0)
    }

    /// Send one request and read its response with `read_ok` (payload of an
    /// OK status). `wait` is how long the server may legitimately block.
    fn request<T>(
        &self,
        frame: &[u8],
        wait: Duration,
        read_ok: impl FnOnce(&mut Deadlined<'_>) -> io::Result<T>,
    ) -> Result<Reply<T>> {
        let mut stream = self.take_connection()?;
        let outcome = exchange(&mut stream, frame, wait, read_ok);
        // A connection that failed mid-frame is out of step: drop it, and
        // the next call opens a fresh one.
        if !matches!(outcome, Exchange::Broken(_)) {
            let mut idle = lock(&self.idle);
            if idle.len() < CLIENT_POOL_MAX {
                idle.push((stream, Instant::now()));
            }
        }
        match outcome {
            Exchange::Ok(v) => Ok(Reply::Ok(v)),
            Exchange::TimedOut => Ok(Reply::TimedOut),
            Exchange::Refused(msg) => Err(Error::Store(msg)),
            Exchange::Broken(e) if e.kind() == ErrorKind::UnexpectedEof => {
                Err(Error::Store(format!("store at {} closed the connection", self.addr)))
            }
            Exchange::Broken(e) => Err(Error::io(format!("store request to {}", self.addr), e)),
        }
    }
}

enum Exchange<T> {
    Ok(T),
    TimedOut,
    /// The server answered with an error; the connection is still good.
    Refused(String),
    Broken(io::Error),
}

fn exchange<T>(
    stream: &mut TcpStream,
    frame: &[u8],
    wait: Duration,
    read_ok: impl FnOnce(&mut Deadlined<'_>) -> io::Result<T>,
) -> Exchange<T> {
    let run = || -> io::Result<Exchange<T>> {
        stream.write_all(frame)?;
        let within = wait.checked_add(CLIENT_IO_MARGIN).unwrap_or(Duration::MAX);
        let mut rd = Deadlined::new(stream, within);
        Ok(match rd.u8()? {
            ST_OK => Exchange::Ok(read_ok(&mut rd)?),
            ST_TIMEOUT => Exchange::TimedOut,
            ST_ERROR => Exchange::Refused(String::from_utf8_lossy(&rd.bytes(u16::MAX.into())?).into_owned()),
            _ => return Err(invalid_data("unexpected response status")),
        })
    };
    run().unwrap_or_else(Exchange::Broken)
}

/// Open and authenticate one connection; returns it with the server's limits.
///
/// Refused connections, BUSY answers and handshakes cut short are retried
/// with backoff until `timeout` passes, since the server may not be up yet or
/// may be shedding a flood; the final error says which of these kept
/// happening. A wrong token or a protocol mismatch fails at once.
fn open(addr: SocketAddr, token: &[u8], timeout: Duration) -> Result<(TcpStream, ServerInfo)> {
    let start = Instant::now();
    let mut backoff = RETRY_FIRST;
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        let retry = match handshake_once(addr, token, left) {
            Ok(opened) => return Ok(opened),
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry(why)) => why,
        };
        if start.elapsed() >= timeout {
            return Err(retry.into_error(addr, timeout));
        }
        let cap = if matches!(retry, Transient::Connect(_)) {
            RETRY_MAX
        } else {
            RETRY_MAX_LIVE
        };
        backoff = backoff.min(cap);
        thread::sleep(backoff.min(timeout.saturating_sub(start.elapsed())));
        backoff = (backoff * 2).min(cap);
    }
}

/// How one connection attempt failed.
enum Attempt {
    /// Retrying cannot help (wrong token, protocol mismatch, garbage reply).
    Fatal(Error),
    Retry(Transient),
}

/// A failure that may clear up if the client tries again.
enum Transient {
    /// Nothing accepted the TCP connection (not up yet, or unreachable).
    Connect(io::Error),
    /// The server answered BUSY.
    Busy,
    /// The server said our hello came too late.
    HandshakeTimedOut,
    /// Closed or reset before any answer; the error says how.
    Closed(io::Error),
    /// No answer within our own deadline.
    NoAnswer(io::Error),
}

impl Transient {
    fn into_error(self, addr: SocketAddr, timeout: Duration) -> Error {
        match self {
            Transient::Connect(e) => Error::io(
                format!("connecting to the store at {addr} (gave up after {timeout:?})"),
                e,
            ),
            Transient::Busy => Error::Store(format!(
                "store at {addr} is full: it answered BUSY until the connect timeout ({timeout:?}) \
                 ran out (too many connections, or a flood of unauthenticated ones)"
            )),
            Transient::HandshakeTimedOut => Error::Store(format!(
                "store at {addr} timed out our handshake until the connect timeout ({timeout:?}) ran out"
            )),
            Transient::Closed(e) => Error::Store(format!(
                "store at {addr} closed the connection during the handshake without an answer \
                 ({e}; gave up after {timeout:?}): is it a ferrocomm store?"
            )),
            Transient::NoAnswer(e) => Error::io(
                format!("waiting for the store at {addr} to answer the handshake (gave up after {timeout:?})"),
                e,
            ),
        }
    }
}

fn handshake_once(
    addr: SocketAddr,
    token: &[u8],
    left: Duration,
) -> std::result::Result<(TcpStream, ServerInfo), Attempt> {
    // connect_timeout rejects a zero duration; always make one real attempt.
    let attempt = left.clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut stream = TcpStream::connect_timeout(&addr, attempt).map_err(|e| Attempt::Retry(Transient::Connect(e)))?;
    let ctx = || format!("store handshake with {addr}");
    let fatal = |e: io::Error| Attempt::Fatal(Error::io(ctx(), e));
    stream.set_write_timeout(Some(CLIENT_IO_MARGIN)).map_err(fatal)?;
    let _ = stream.set_nodelay(true);
    let mut hello = Vec::with_capacity(7 + token.len());
    hello.extend_from_slice(MAGIC);
    hello.push(VERSION);
    hello.extend_from_slice(&(token.len() as u16).to_le_bytes());
    hello.extend_from_slice(token);
    stream
        .write_all(&hello)
        .map_err(|e| Attempt::Retry(Transient::Closed(e)))?;

    let mut rd = Deadlined::new(&mut stream, attempt.min(CLIENT_IO_MARGIN));
    let status = rd.u8().map_err(|e| match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => {
            Attempt::Retry(Transient::Closed(e))
        }
        ErrorKind::TimedOut => Attempt::Retry(Transient::NoAnswer(e)),
        _ => fatal(e),
    })?;
    match status {
        ST_OK => {}
        ST_BUSY => return Err(Attempt::Retry(Transient::Busy)),
        ST_TIMEOUT => return Err(Attempt::Retry(Transient::HandshakeTimedOut)),
        ST_DENIED => {
            return Err(Attempt::Fatal(Error::Store(format!(
                "store at {addr} rejected our token: this rank's FERROCOMM_TOKEN (or FERROCOMM_TOKEN_FILE) \
                 differs from the one the store was started with"
            ))))
        }
        ST_ERROR => {
            let msg = rd.bytes(u16::MAX.into()).map_err(fatal)?;
            return Err(Attempt::Fatal(Error::Store(format!(
                "store at {addr} refused the handshake: {}",
                String::from_utf8_lossy(&msg)
            ))));
        }
        _ => {
            return Err(Attempt::Fatal(Error::Store(format!(
                "{}: unexpected reply {status}",
                ctx()
            ))))
        }
    }
    let mut info = || -> io::Result<ServerInfo> {
        Ok(ServerInfo {
            max_key_bytes: rd.u32()? as usize,
            max_value_bytes: rd.u32()? as usize,
            idle_timeout: Duration::from_millis(rd.u64()?),
        })
    };
    let info = info().map_err(fatal)?;
    Ok((stream, info))
}

fn frame(op: u8, key: &str, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(17 + key.len() + value.len());
    out.push(op);
    put_bytes(&mut out, key.as_bytes());
    put_bytes(&mut out, value);
    out
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check_key(key)?;
        if value.len() > self.server.max_value_bytes {
            return Err(Error::invalid(format!(
                "store value of {} bytes exceeds the server's limit of {} bytes",
                value.len(),
                self.server.max_value_bytes
            )));
        }
        match self.request(&frame(OP_SET, key, value), Duration::ZERO, |_| Ok(()))? {
            Reply::Ok(()) => Ok(()),
            Reply::TimedOut => Err(Error::Store("unexpected timeout reply to SET".into())),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.check_key(key)?;
        let mut req = frame(OP_GET, key, &[]);
        req.extend_from_slice(&millis(timeout).to_le_bytes());
        let max_value = self.server.max_value_bytes;
        match self.request(&req, timeout, |rd| rd.bytes(max_value))? {
            Reply::Ok(value) => Ok(value),
            Reply::TimedOut => Err(get_timeout(key, timeout)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.check_key(key)?;
        let mut req = frame(OP_ADD, key, &[]);
        req.extend_from_slice(&delta.to_le_bytes());
        match self.request(&req, Duration::ZERO, |rd| rd.i64())? {
            Reply::Ok(n) => Ok(n),
            Reply::TimedOut => Err(Error::Store("unexpected timeout reply to ADD".into())),
        }
    }

    fn check(&self, key: &str) -> Result<bool> {
        self.check_key(key)?;
        match self.request(&frame(OP_CHECK, key, &[]), Duration::ZERO, |rd| rd.u8())? {
            Reply::Ok(b) => Ok(b != 0),
            Reply::TimedOut => Err(Error::Store("unexpected timeout reply to CHECK".into())),
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.check_key(key)?;
        match self.request(&frame(OP_DELETE, key, &[]), Duration::ZERO, |rd| rd.u8())? {
            Reply::Ok(b) => Ok(b != 0),
            Reply::TimedOut => Err(Error::Store("unexpected timeout reply to DELETE".into())),
        }
    }
}
