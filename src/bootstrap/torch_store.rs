//! A client of torch's c10d `TCPStore` wire protocol, so that ferrocomm can
//! find its own store through the one torchrun's agent already runs on
//! `MASTER_PORT`. Rendezvous uses it for one key; ferrocomm's own traffic
//! never goes through torch's (unauthenticated) store.
//!
//! The protocol, as both of torch's servers speak it (the libuv one, default
//! since torch 2.4, and the legacy one behind `USE_LIBUV=0`), taken from
//! `torch/csrc/distributed/c10d/TCPStore{,Backend,LibUvBackend}.cpp`:
//!
//! * A request is a query-type byte then its arguments. Strings and byte
//!   vectors are a `u64` length then the bytes; numbers are raw. All
//!   integers are native-endian (torch `memcpy`s them), which on every host
//!   torch supports means little-endian.
//! * Query types used here: `VALIDATE`=0, `SET`=1, `GET`=3, `ADD`=4,
//!   `CHECK`=5, `WAIT`=6, `DELETE_KEY`=8, `CANCEL_WAIT`=12, `PING`=13.
//! * The first request on a connection must be `VALIDATE` with the `u32`
//!   magic `0x3C85F7CE`; it has no answer. Then `PING` with a `u32` nonce,
//!   answered with the same nonce: the connection is live and validated.
//! * `SET key value` has no answer; we send a `PING` right behind it, whose
//!   answer proves the server processed the `SET` (one connection is served
//!   in order).
//! * `GET key` answers a byte vector, but only for a key that exists: on a
//!   missing key the libuv server answers an empty vector and the legacy one
//!   closes the connection. So, like torch's own client, we first `WAIT`
//!   (a `u64` key count, then the keys), answered `STOP_WAITING`=0 once all
//!   exist. The server does not time a wait out: on our deadline we send
//!   `CANCEL_WAIT`, answered `WAIT_CANCELED`=1, possibly preceded by a
//!   `STOP_WAITING` that crossed it.
//! * `ADD key i64` answers the new `i64`; values are decimal text.
//!   `CHECK` (count + keys) answers `READY`=0 or `NOT_READY`=1. `DELETE_KEY`
//!   answers an 8-byte count.
//! * Errors are not reported in-band: a request the server cannot serve (a
//!   key over 8 KiB, a value over 8 MiB, `ADD` on a non-integer) makes it
//!   close the connection.
//! * torch's client prefixes every key with `/`; so do we, so that Python's
//!   `store.get(key)` sees the keys we write.
//!
//! Every read is bounded by a deadline, every length is checked against a
//! cap before anything is allocated, and a broken connection is dropped and
//! reopened (validated again) on the next call.

use std::io::{self, ErrorKind, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use super::inproc::get_timeout;
use super::wire::{invalid_data, Deadlined};
use super::Store;
use crate::error::{Error, Result};

const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

const Q_VALIDATE: u8 = 0;
const Q_SET: u8 = 1;
const Q_GET: u8 = 3;
const Q_ADD: u8 = 4;
const Q_CHECK: u8 = 5;
const Q_WAIT: u8 = 6;
const Q_DELETE_KEY: u8 = 8;
const Q_CANCEL_WAIT: u8 = 12;
const Q_PING: u8 = 13;

const CHECK_READY: u8 = 0;
const CHECK_NOT_READY: u8 = 1;
const WAIT_STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// torch's client puts this in front of every key.
const KEY_PREFIX: &str = "/";
/// The libuv server's limits (`MAX_STRING_LEN`, `MAX_PAYLOAD_LEN`); past
/// them it closes the connection, so we refuse such requests ourselves and
/// never accept a longer answer.
pub(crate) const MAX_KEY_BYTES: usize = 8 * 1024;
pub(crate) const MAX_VALUE_BYTES: usize = 8 << 20;

/// Longest wait for an answer that the server owes us at once.
const IO_TIMEOUT_MAX: Duration = Duration::from_secs(10);
const IO_TIMEOUT_MIN: Duration = Duration::from_secs(1);

/// A client of torch's `TCPStore` (see the module docs for the protocol).
///
/// One connection, one request at a time: a `get` that waits holds it, and
/// other threads queue behind. Meant for rendezvous, not for traffic.
pub struct TorchStoreClient {
    addrs: Vec<SocketAddr>,
    /// Bound on each answer the server owes at once, and on reconnecting.
    io_timeout: Duration,
    conn: Mutex<Option<Conn>>,
}

struct Conn {
    stream: TcpStream,
    addr: SocketAddr,
}

impl std::fmt::Debug for TorchStoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchStoreClient")
            .field("addrs", &self.addrs)
            .finish_non_exhaustive()
    }
}

impl TorchStoreClient {
    /// Connect to a torch `TCPStore` at `addr`, validate and ping it,
    /// retrying refused connections until `timeout` passes.
    pub fn connect(addr: impl ToSocketAddrs, timeout: Duration) -> Result<TorchStoreClient> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::io("resolving the torch store's address", e))?
            .collect();
        if addrs.is_empty() {
            return Err(Error::invalid("the torch store's address resolves to nothing"));
        }
        let client = TorchStoreClient {
            addrs,
            io_timeout: timeout.clamp(IO_TIMEOUT_MIN, IO_TIMEOUT_MAX),
            conn: Mutex::new(None),
        };
        *client.lock() = Some(client.open(timeout)?);
        Ok(client)
    }

    /// Check the server still answers.
    pub fn ping(&self) -> Result<()> {
        self.call("PING", &[], Duration::ZERO, |_, _| Ok(()))
    }

    fn lock(&self) -> MutexGuard<'_, Option<Conn>> {
        // A panic mid-request leaves at worst a connection out of step, and
        // every error path drops the connection anyway.
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Open, VALIDATE and PING a connection to one of `addrs`, retrying
    /// until `timeout`.
    fn open(&self, timeout: Duration) -> Result<Conn> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(10);
        let mut last_err: Option<Error> = None;
        loop {
            for &addr in &self.addrs {
                let left = timeout.saturating_sub(start.elapsed());
                match self.open_one(addr, left) {
                    Ok(conn) => return Ok(conn),
                    // Something answered that is not a torch store: retrying
                    // will not change that.
                    Err(e @ Error::Store(_)) => return Err(e),
                    Err(e) => last_err = Some(e),
                }
            }
            if start.elapsed() >= timeout {
                let shown = self.addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ");
                let reason = last_err.map_or_else(|| "no attempt".to_string(), |e| e.to_string());
                return Err(Error::Timeout {
                    what: format!("torch's TCPStore at {shown} ({reason})"),
                    after: timeout,
                    missing: Vec::new(),
                });
            }
            thread::sleep(backoff.min(timeout.saturating_sub(start.elapsed())));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    fn open_one(&self, addr: SocketAddr, left: Duration) -> Result<Conn> {
        let attempt = left.clamp(Duration::from_millis(100), Duration::from_secs(5));
        let ctx = || format!("connecting to torch's TCPStore at {addr}");
        let mut stream = TcpStream::connect_timeout(&addr, attempt).map_err(|e| Error::io(ctx(), e))?;
        stream
            .set_write_timeout(Some(self.io_timeout))
            .map_err(|e| Error::io(ctx(), e))?;
        let _ = stream.set_nodelay(true);
        let nonce = next_nonce();
        let mut hello = validate_frame();
        hello.extend_from_slice(&ping_frame(nonce));
        stream.write_all(&hello).map_err(|e| Error::io(ctx(), e))?;
        let echoed = Deadlined::new(&mut stream, attempt.min(self.io_timeout))
            .array::<4>()
            .map_err(|e| match e.kind() {
                ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset => Error::Store(format!(
                    "{addr} closed the connection on torch's VALIDATE/PING: is it torch's TCPStore \
                     (torch 2.x, with PING support)?"
                )),
                _ => Error::io(format!("{} (waiting for the PING answer)", ctx()), e),
            })?;
        if u32::from_ne_bytes(echoed) != nonce {
            return Err(Error::Store(format!(
                "{addr} answered torch's PING with the wrong nonce: is it torch's TCPStore?"
            )));
        }
        Ok(Conn { stream, addr })
    }

    /// Run one exchange on the connection (reopened if needed): `talk` gets
    /// the stream and the reply budget. Any error drops the connection,
    /// which may be out of step.
    fn call<T>(
        &self,
        op: &str,
        frame: &[u8],
        wait: Duration,
        talk: impl FnOnce(&mut TcpStream, Duration) -> io::Result<T>,
    ) -> Result<T> {
        let mut guard = self.lock();
        let conn = match guard.take() {
            Some(conn) => conn,
            None => self.open(self.io_timeout)?,
        };
        let Conn { mut stream, addr } = conn;
        let budget = wait.saturating_add(self.io_timeout);
        let outcome = stream.write_all(frame).and_then(|()| talk(&mut stream, budget));
        match outcome {
            Ok(v) => {
                *guard = Some(Conn { stream, addr });
                Ok(v)
            }
            Err(e) => Err(request_error(addr, op, e)),
        }
    }

    fn check_key(key: &str) -> Result<String> {
        let full = format!("{KEY_PREFIX}{key}");
        if full.len() > MAX_KEY_BYTES {
            return Err(Error::invalid(format!(
                "torch store key of {} bytes exceeds torch's limit of {MAX_KEY_BYTES} bytes",
                full.len()
            )));
        }
        Ok(full)
    }
}

fn request_error(addr: SocketAddr, op: &str, e: io::Error) -> Error {
    match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset => Error::Store(format!(
            "torch store at {addr} closed the connection during {op} (it does that to a request it \
             cannot serve, e.g. ADD on a key that does not hold an integer)"
        )),
        ErrorKind::InvalidData => Error::Store(format!("torch store at {addr} sent a malformed answer to {op}: {e}")),
        _ => Error::io(format!("torch store request {op} to {addr}"), e),
    }
}

/// Nonces only need to differ between PINGs of this process.
fn next_nonce() -> u32 {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    std::process::id().rotate_left(16) ^ COUNTER.fetch_add(1, Ordering::Relaxed)
}

// ---------------------------------------------------------------------------
// Framing.

fn put_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(&n.to_ne_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_u64(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn validate_frame() -> Vec<u8> {
    let mut out = vec![Q_VALIDATE];
    out.extend_from_slice(&VALIDATION_MAGIC.to_ne_bytes());
    out
}

fn ping_frame(nonce: u32) -> Vec<u8> {
    let mut out = vec![Q_PING];
    out.extend_from_slice(&nonce.to_ne_bytes());
    out
}

/// `SET` then a `PING` whose answer acknowledges it.
fn set_frame(key: &str, value: &[u8], nonce: u32) -> Vec<u8> {
    let mut out = vec![Q_SET];
    put_bytes(&mut out, key.as_bytes());
    put_bytes(&mut out, value);
    out.extend_from_slice(&ping_frame(nonce));
    out
}

fn key_frame(query: u8, key: &str) -> Vec<u8> {
    let mut out = vec![query];
    put_bytes(&mut out, key.as_bytes());
    out
}

/// `CHECK` and `WAIT` take a key count first; we always send one key.
fn keys_frame(query: u8, key: &str) -> Vec<u8> {
    let mut out = vec![query];
    put_u64(&mut out, 1);
    put_bytes(&mut out, key.as_bytes());
    out
}

fn add_frame(key: &str, delta: i64) -> Vec<u8> {
    let mut out = key_frame(Q_ADD, key);
    out.extend_from_slice(&delta.to_ne_bytes());
    out
}

fn read_vector(rd: &mut Deadlined<'_>) -> io::Result<Vec<u8>> {
    let len = u64::from_ne_bytes(rd.array()?);
    rd.bytes_of_len(len, MAX_VALUE_BYTES)
}

impl Store for TorchStoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = Self::check_key(key)?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(Error::invalid(format!(
                "torch store value of {} bytes exceeds torch's limit of {MAX_VALUE_BYTES} bytes",
                value.len()
            )));
        }
        let nonce = next_nonce();
        self.call("SET", &set_frame(&key, value, nonce), Duration::ZERO, |s, budget| {
            if u32::from_ne_bytes(Deadlined::new(s, budget).array()?) != nonce {
                return Err(invalid_data("PING after SET echoed another nonce"));
            }
            Ok(())
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let full = Self::check_key(key)?;
        let io_timeout = self.io_timeout;
        let found = self.call("WAIT/GET", &keys_frame(Q_WAIT, &full), timeout, |s, _| {
            if !wait_for_key(s, timeout, io_timeout)? {
                return Ok(None);
            }
            s.write_all(&key_frame(Q_GET, &full))?;
            read_vector(&mut Deadlined::new(s, io_timeout)).map(Some)
        })?;
        found.ok_or_else(|| get_timeout(key, timeout))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let key = Self::check_key(key)?;
        self.call("ADD", &add_frame(&key, delta), Duration::ZERO, |s, budget| {
            Ok(i64::from_ne_bytes(Deadlined::new(s, budget).array()?))
        })
    }

    fn check(&self, key: &str) -> Result<bool> {
        let key = Self::check_key(key)?;
        self.call(
            "CHECK",
            &keys_frame(Q_CHECK, &key),
            Duration::ZERO,
            |s, budget| match Deadlined::new(s, budget).u8()? {
                CHECK_READY => Ok(true),
                CHECK_NOT_READY => Ok(false),
                _ => Err(invalid_data("CHECK answer is neither READY nor NOT_READY")),
            },
        )
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let key = Self::check_key(key)?;
        self.call(
            "DELETE_KEY",
            &key_frame(Q_DELETE_KEY, &key),
            Duration::ZERO,
            |s, budget| Ok(u64::from_ne_bytes(Deadlined::new(s, budget).array()?) > 0),
        )
    }
}

/// After a `WAIT` was sent: true once the key exists, false if `timeout`
/// passed first (the wait is then cancelled, leaving the connection in step).
fn wait_for_key(s: &mut TcpStream, timeout: Duration, io_timeout: Duration) -> io::Result<bool> {
    match Deadlined::new(s, timeout).u8() {
        Ok(WAIT_STOP_WAITING) => return Ok(true),
        Ok(_) => return Err(invalid_data("WAIT answer is not STOP_WAITING")),
        Err(e) if e.kind() == ErrorKind::TimedOut => {}
        Err(e) => return Err(e),
    }
    s.write_all(&[Q_CANCEL_WAIT])?;
    let mut rd = Deadlined::new(s, io_timeout);
    match rd.u8()? {
        WAIT_CANCELED => Ok(false),
        // The key arrived as we cancelled: the cancel is still answered.
        WAIT_STOP_WAITING => match rd.u8()? {
            WAIT_CANCELED => Ok(true),
            _ => Err(invalid_data("CANCEL_WAIT answer is not WAIT_CANCELED")),
        },
        _ => Err(invalid_data("CANCEL_WAIT answer is not WAIT_CANCELED")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn ne64(n: u64) -> [u8; 8] {
        n.to_ne_bytes()
    }

    #[test]
    fn frames_match_torchs_layout() {
        assert_eq!(validate_frame(), [&[0u8][..], &0x3C85_F7CEu32.to_ne_bytes()].concat());
        assert_eq!(ping_frame(7), [&[13u8][..], &7u32.to_ne_bytes()].concat());
        let set = set_frame("/k", b"val", 9);
        let want = [
            &[1u8][..],
            &ne64(2),
            b"/k",
            &ne64(3),
            b"val",
            &[13],
            &9u32.to_ne_bytes(),
        ]
        .concat();
        assert_eq!(set, want);
        assert_eq!(key_frame(Q_GET, "/k"), [&[3u8][..], &ne64(2), b"/k"].concat());
        assert_eq!(
            keys_frame(Q_WAIT, "/k"),
            [&[6u8][..], &ne64(1), &ne64(2), b"/k"].concat()
        );
        assert_eq!(
            keys_frame(Q_CHECK, "/k"),
            [&[5u8][..], &ne64(1), &ne64(2), b"/k"].concat()
        );
        assert_eq!(
            add_frame("/k", -2),
            [&[4u8][..], &ne64(2), b"/k", &(-2i64).to_ne_bytes()].concat()
        );
        assert_eq!(key_frame(Q_DELETE_KEY, "/k"), [&[8u8][..], &ne64(2), b"/k"].concat());
    }

    /// A one-connection server: answers VALIDATE+PING, then runs `script`.
    fn scripted(script: impl FnOnce(&mut TcpStream) + Send + 'static) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut hello = [0u8; 10];
            s.read_exact(&mut hello).expect("validate + ping");
            assert_eq!(hello[0], Q_VALIDATE);
            assert_eq!(hello[5], Q_PING);
            s.write_all(&hello[6..10]).expect("echo nonce");
            script(&mut s);
            // Hold the connection until the client is done with it.
            let _ = s.read_to_end(&mut Vec::new());
        });
        addr
    }

    fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        s.read_exact(&mut b).expect("read request");
        b
    }

    #[test]
    fn an_absurd_length_is_an_error_not_an_allocation() {
        let addr = scripted(|s| {
            let _wait = read_n(s, 1 + 8 + 8 + 2);
            s.write_all(&[WAIT_STOP_WAITING]).expect("stop waiting");
            let _get = read_n(s, 1 + 8 + 2);
            s.write_all(&u64::MAX.to_ne_bytes()).expect("absurd length");
        });
        let client = TorchStoreClient::connect(addr, Duration::from_secs(2)).expect("connect");
        let err = client.get("k", Duration::from_secs(1)).expect_err("must fail");
        assert!(err.to_string().contains("malformed"), "{err}");
    }

    #[test]
    fn a_wait_past_its_deadline_is_cancelled() {
        let addr = scripted(|s| {
            let _wait = read_n(s, 1 + 8 + 8 + 2);
            // Say nothing until the client cancels.
            assert_eq!(read_n(s, 1), [Q_CANCEL_WAIT]);
            s.write_all(&[WAIT_CANCELED]).expect("canceled");
        });
        let client = TorchStoreClient::connect(addr, Duration::from_secs(2)).expect("connect");
        let start = Instant::now();
        let err = client.get("k", Duration::from_millis(200)).expect_err("times out");
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
    }

    #[test]
    fn a_key_arriving_during_the_cancel_is_still_read() {
        let addr = scripted(|s| {
            let _wait = read_n(s, 1 + 8 + 8 + 2);
            assert_eq!(read_n(s, 1), [Q_CANCEL_WAIT]);
            s.write_all(&[WAIT_STOP_WAITING, WAIT_CANCELED])
                .expect("crossed answers");
            let _get = read_n(s, 1 + 8 + 2);
            s.write_all(&[&ne64(2)[..], b"hi"].concat()).expect("value");
        });
        let client = TorchStoreClient::connect(addr, Duration::from_secs(2)).expect("connect");
        assert_eq!(client.get("k", Duration::from_millis(100)).expect("value"), b"hi");
    }

    #[test]
    fn a_closed_connection_is_explained() {
        let addr = scripted(|s| {
            let _add = read_n(s, 1 + 8 + 2 + 8);
            let _ = s.shutdown(std::net::Shutdown::Both);
        });
        let client = TorchStoreClient::connect(addr, Duration::from_secs(2)).expect("connect");
        let err = client.add("k", 1).expect_err("closed");
        assert!(err.to_string().contains("closed the connection during ADD"), "{err}");
    }

    #[test]
    fn a_server_that_never_answers_ping_is_bounded() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let holder = thread::spawn(move || {
            let held: Vec<_> = (0..4).filter_map(|_| listener.accept().ok()).collect();
            thread::sleep(Duration::from_secs(3));
            drop(held);
        });
        let start = Instant::now();
        let err = TorchStoreClient::connect(addr, Duration::from_millis(300)).expect_err("no PING answer");
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
        drop(holder);
    }

    #[test]
    fn a_wrong_nonce_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let _ = read_n(&mut s, 10);
            let _ = s.write_all(&[1, 2, 3, 4]);
            let _ = s.read_to_end(&mut Vec::new());
        });
        let err = TorchStoreClient::connect(addr, Duration::from_secs(2)).expect_err("bad nonce");
        assert!(err.to_string().contains("wrong nonce"), "{err}");
    }

    #[test]
    fn oversize_keys_and_values_are_refused_before_sending() {
        let addr = scripted(|_| {});
        let client = TorchStoreClient::connect(addr, Duration::from_secs(2)).expect("connect");
        let long = "k".repeat(MAX_KEY_BYTES);
        assert!(matches!(client.set(&long, b""), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            client.set("k", &vec![0; MAX_VALUE_BYTES + 1]),
            Err(Error::InvalidArgument(_))
        ));
    }
}
