//! TCP store: a small authenticated key-value server run by rank 0, and the
//! client every rank uses.
//!
//! Wire protocol (all integers little-endian, no self-describing encoding):
//!
//! * handshake, client → server: `b"FCST"`, version `u8`, token length `u16`,
//!   token. The server compares the token in constant time and, on a mismatch,
//!   closes the connection without a word. On success it answers `OK`,
//!   `max_key_bytes u32`, `max_value_bytes u32`, `idle_timeout_ms u64`, so the
//!   client can refuse oversize requests itself instead of having its
//!   connection closed, and can retire pooled connections before the server
//!   idles them out.
//! * request: op `u8`, key length `u32`, key (UTF-8), value length `u32`,
//!   value (empty except for SET), then for GET the wait in ms `u64`, for ADD
//!   the delta `i64`.
//! * response: status `u8`, then for `OK`: GET → length `u32` + value,
//!   ADD → `i64`, CHECK/DELETE → `u8` (0/1), SET → nothing; `TIMEOUT` → nothing;
//!   `ERROR` → length `u32` + UTF-8 message.
//!
//! A malformed frame (unknown op, a length over the caps, a non-UTF-8 key, a
//! frame not completed within `io_timeout`) closes that connection only.

use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::inproc::{get_timeout, Limits, Lookup, Table};
use super::Store;
use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"FCST";
const VERSION: u8 = 1;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_DELETE: u8 = 5;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_ERROR: u8 = 2;

/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// Client-side slack on top of a request's own wait, so a dead server gives an
/// error instead of a hang while a slow but live one still answers.
const CLIENT_IO_MARGIN: Duration = Duration::from_secs(10);
/// Idle client connections kept for reuse; more are closed after use.
const CLIENT_POOL_MAX: usize = 4;

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
    /// Most connections served at once; more are closed on accept.
    pub max_connections: usize,
    /// Default for clients connecting to this server (used by rendezvous).
    pub connect_timeout: Duration,
    /// A connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// Time allowed for the handshake, and for the rest of a frame once its
    /// first byte arrived; defeats half-open and slow-drip connections.
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
        if self.io_timeout.is_zero() || self.idle_timeout.is_zero() {
            return Err(Error::invalid(
                "TcpStoreConfig io_timeout and idle_timeout must be non-zero",
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
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("io_timeout", &self.io_timeout)
            .finish()
    }
}

// ---------------------------------------------------------------------------
// Framing helpers shared by server and client.

/// Reads against one deadline for a whole frame, so a peer that drips a
/// byte at a time cannot stretch a per-read timeout forever.
struct Deadlined<'a> {
    stream: &'a mut TcpStream,
    deadline: Option<Instant>,
}

impl Deadlined<'_> {
    fn new(stream: &mut TcpStream, within: Duration) -> Deadlined<'_> {
        Deadlined {
            stream,
            deadline: Instant::now().checked_add(within),
        }
    }

    fn read_exact(&mut self, mut buf: &mut [u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let left = match self.deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ErrorKind::TimedOut.into());
                    }
                    Some(left)
                }
            };
            self.stream.set_read_timeout(left)?;
            match self.stream.read(buf) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn u8(&mut self) -> io::Result<u8> {
        let mut b = [0u8; 1];
        self.read_exact(&mut b)?;
        Ok(b[0])
    }

    fn u16(&mut self) -> io::Result<u16> {
        let mut b = [0u8; 2];
        self.read_exact(&mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    fn u32(&mut self) -> io::Result<u32> {
        let mut b = [0u8; 4];
        self.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn i64(&mut self) -> io::Result<i64> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(i64::from_le_bytes(b))
    }

    /// A `u32` length then that many bytes; the length is checked against
    /// `max` before allocating, so a forged length cannot exhaust memory.
    fn bytes(&mut self, max: usize) -> io::Result<Vec<u8>> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(invalid_data("length over the limit"));
        }
        let mut buf = vec![0u8; len];
        self.read_exact(&mut buf)?;
        Ok(buf)
    }
}

fn invalid_data(msg: &str) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, msg)
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // Callers check lengths against the caps (all far below u32::MAX) first.
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Equality whose running time does not depend on where the inputs differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    std::hint::black_box(diff) == 0
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a plain insert/remove/push; a panic in
    // one cannot leave the data inconsistent, so poisoning is ignored.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------
// Server.

/// State shared by the accept thread, the connection threads and `Drop`.
struct Shared {
    cfg: TcpStoreConfig,
    table: Table,
    stop: AtomicBool,
    conns: Mutex<Registry>,
}

/// Live connections, so shutdown can unblock their reads.
struct Registry {
    stopping: bool,
    next_id: u64,
    streams: HashMap<u64, TcpStream>,
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
        // Non-blocking accept lets the loop notice the stop flag promptly.
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
            .spawn(move || accept_loop(&for_thread, &listener))
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
            // Under the registry lock, so the accept thread cannot admit a
            // connection after this sweep.
            let mut reg = lock(&self.shared.conns);
            reg.stopping = true;
            for stream in reg.streams.values() {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        self.shared.table.close();
        if let Some(handle) = self.accept_thread.take() {
            // The accept thread joins the connection threads before it exits.
            let _ = handle.join();
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Some(worker) = admit(shared, stream) {
                    workers.push(worker);
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // WouldBlock: nothing pending. Anything else (e.g. out of fds):
            // back off instead of spinning; the peer will retry.
            Err(_) => thread::sleep(ACCEPT_POLL),
        }
        workers.retain(|w| !w.is_finished());
    }
    for worker in workers {
        let _ = worker.join();
    }
}

/// Register a new connection and start its thread, or close it when the
/// server is stopping or full.
fn admit(shared: &Arc<Shared>, stream: TcpStream) -> Option<JoinHandle<()>> {
    // Accepted sockets may inherit non-blocking mode on some platforms.
    stream.set_nonblocking(false).ok()?;
    stream.set_write_timeout(Some(shared.cfg.io_timeout)).ok()?;
    let _ = stream.set_nodelay(true);
    let watch = stream.try_clone().ok()?;
    let id = {
        let mut reg = lock(&shared.conns);
        if reg.stopping || reg.streams.len() >= shared.cfg.max_connections {
            return None;
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
    match spawned {
        Ok(handle) => Some(handle),
        Err(_) => {
            lock(&shared.conns).streams.remove(&id);
            None
        }
    }
}

/// Serve one client until it leaves, misbehaves, idles out or the server stops.
/// Every exit path simply drops (closes) the stream.
fn serve_connection(shared: &Shared, mut stream: TcpStream) {
    if !handshake(shared, &mut stream).unwrap_or(false) {
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

/// Check magic, version and token; answer with the limits. `Ok(false)` means
/// the client is turned away.
fn handshake(shared: &Shared, stream: &mut TcpStream) -> io::Result<bool> {
    let mut rd = Deadlined::new(stream, shared.cfg.io_timeout);
    let mut magic = [0u8; 4];
    rd.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Ok(false);
    }
    let version = rd.u8()?;
    let token_len = usize::from(rd.u16()?);
    let mut token = vec![0u8; token_len];
    rd.read_exact(&mut token)?;
    if version != VERSION {
        // Not secret, and it saves a confusing "wrong token" at upgrade time.
        let mut reply = vec![ST_ERROR];
        let msg = format!("protocol version {version} not supported; server speaks {VERSION}");
        put_bytes(&mut reply, msg.as_bytes());
        stream.write_all(&reply)?;
        return Ok(false);
    }
    if !constant_time_eq(&token, &shared.cfg.token) {
        return Ok(false);
    }
    let mut reply = vec![ST_OK];
    let cap = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    reply.extend_from_slice(&cap(shared.cfg.max_key_bytes).to_le_bytes());
    reply.extend_from_slice(&cap(shared.cfg.max_value_bytes).to_le_bytes());
    reply.extend_from_slice(&millis(shared.cfg.idle_timeout).to_le_bytes());
    stream.write_all(&reply)?;
    Ok(true)
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
fn open(addr: SocketAddr, token: &[u8], timeout: Duration) -> Result<(TcpStream, ServerInfo)> {
    let mut stream = connect_with_retry(addr, timeout)?;
    let ctx = || format!("store handshake with {addr}");
    stream
        .set_write_timeout(Some(CLIENT_IO_MARGIN))
        .map_err(|e| Error::io(ctx(), e))?;
    let _ = stream.set_nodelay(true);
    let mut hello = Vec::with_capacity(7 + token.len());
    hello.extend_from_slice(MAGIC);
    hello.push(VERSION);
    hello.extend_from_slice(&(token.len() as u16).to_le_bytes());
    hello.extend_from_slice(token);
    stream.write_all(&hello).map_err(|e| Error::io(ctx(), e))?;

    let mut rd = Deadlined::new(&mut stream, CLIENT_IO_MARGIN);
    let status = rd.u8().map_err(|e| match e.kind() {
        // The server turns a wrong token away by closing without a word.
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset => Error::Store(format!(
            "store at {addr} closed the connection during the handshake: wrong token?"
        )),
        _ => Error::io(ctx(), e),
    })?;
    match status {
        ST_OK => {}
        ST_ERROR => {
            let msg = rd.bytes(u16::MAX.into()).map_err(|e| Error::io(ctx(), e))?;
            return Err(Error::Store(String::from_utf8_lossy(&msg).into_owned()));
        }
        _ => return Err(Error::Store(format!("{}: unexpected reply {status}", ctx()))),
    }
    let mut info = || -> io::Result<ServerInfo> {
        Ok(ServerInfo {
            max_key_bytes: rd.u32()? as usize,
            max_value_bytes: rd.u32()? as usize,
            idle_timeout: Duration::from_millis(rd.u64()?),
        })
    };
    let info = info().map_err(|e| Error::io(ctx(), e))?;
    Ok((stream, info))
}

/// Connect, retrying refused/unreachable attempts until `timeout` passes.
fn connect_with_retry(addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let start = Instant::now();
    let mut backoff = Duration::from_millis(10);
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        // connect_timeout rejects a zero duration; always make one attempt.
        let attempt = left.clamp(Duration::from_millis(100), Duration::from_secs(5));
        match TcpStream::connect_timeout(&addr, attempt) {
            Ok(stream) => return Ok(stream),
            Err(e) if start.elapsed() >= timeout => {
                return Err(Error::io(
                    format!("connecting to the store at {addr} (gave up after {timeout:?})"),
                    e,
                ))
            }
            Err(_) => {
                thread::sleep(backoff.min(timeout.saturating_sub(start.elapsed())));
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }
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
