//! The store client every rank uses: a small pool of authenticated
//! connections, one request and its response at a time on each.

use std::io::{self, ErrorKind, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::connect::{open, ServerInfo, CLIENT_IO_MARGIN};
use super::lock;
use super::protocol::{frame, millis, OP_ADD, OP_CHECK, OP_DELETE, OP_GET, OP_SET, ST_ERROR, ST_OK, ST_TIMEOUT};
use crate::bootstrap::inproc::get_timeout;
use crate::bootstrap::wire::{invalid_data, Deadlined};
use crate::bootstrap::Store;
use crate::error::{Error, Result};

/// Idle client connections kept for reuse; more are closed after use.
const CLIENT_POOL_MAX: usize = 4;

/// A client of [`TcpStoreServer`](super::TcpStoreServer). Safe to share between threads: each call
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
