//! Opening one authenticated connection to a store server: connect, say
//! hello with the token, read the server's limits; retried with backoff while
//! the server is not up yet or is turning clients away.

use std::io::{self, ErrorKind, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::protocol::{MAGIC, ST_BUSY, ST_DENIED, ST_ERROR, ST_OK, ST_TIMEOUT, VERSION};
use crate::bootstrap::wire::Deadlined;
use crate::error::{Error, Result};

/// Client-side slack on top of a request's own wait, so a dead server gives an
/// error instead of a hang while a slow but live one still answers.
pub(super) const CLIENT_IO_MARGIN: Duration = Duration::from_secs(10);
/// First pause between connection attempts, and the largest while nothing
/// listens yet (the server may take a while to come up).
const RETRY_FIRST: Duration = Duration::from_millis(10);
const RETRY_MAX: Duration = Duration::from_millis(500);
/// Largest pause after the server turned us away mid-handshake (BUSY, reset):
/// a live server admits a prompt client on one of the next tries, so waiting
/// long only adds latency.
const RETRY_MAX_LIVE: Duration = Duration::from_millis(50);

/// What the server announces in its handshake reply.
#[derive(Clone, Copy)]
pub(super) struct ServerInfo {
    pub(super) max_key_bytes: usize,
    pub(super) max_value_bytes: usize,
    pub(super) idle_timeout: Duration,
}

/// Open and authenticate one connection; returns it with the server's limits.
///
/// Refused connections, BUSY answers and handshakes cut short are retried
/// with backoff until `timeout` passes, since the server may not be up yet or
/// may be shedding a flood; the final error says which of these kept
/// happening. A wrong token or a protocol mismatch fails at once.
pub(super) fn open(addr: SocketAddr, token: &[u8], timeout: Duration) -> Result<(TcpStream, ServerInfo)> {
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
