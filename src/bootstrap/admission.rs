//! Admission for the TCP store: accepting connections and running their
//! handshakes, on one thread, without giving an unauthenticated peer a
//! thread or a slot meant for ranks.
//!
//! Policy, and why:
//!
//! * Connections still in the handshake sit in a pool of at most
//!   `max_pending_handshakes`, separate from the `max_connections`
//!   authenticated ones, so a flood of peers that never say hello cannot
//!   take the slots that ranks need.
//! * Each has `handshake_timeout` from accept to a complete hello.
//! * When the pool is full, the *oldest* pending handshake is dropped (it is
//!   told BUSY) to admit the newcomer. A real client sends its hello right
//!   after connecting, and a connection is read as soon as it is accepted, so
//!   it finishes long before `max_pending_handshakes` newer connections can
//!   push it out; refusing newcomers instead would let a flooder who holds the
//!   pool keep every real client out. At most a quarter of the pool is
//!   accepted per round, so a prompt client always gets a few rounds.
//! * Pending sockets are non-blocking and watched with `poll(2)`, so a flood
//!   costs a file descriptor and a few syscalls per connection, never a thread.

use std::collections::VecDeque;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::tcp::connections::{serve_authenticated, Refusal, Shared};
use super::tcp::protocol::{constant_time_eq, version_mismatch_reply, MAGIC, ST_BUSY, ST_DENIED, ST_TIMEOUT, VERSION};

/// Longest sleep in `poll`, so the loop notices the stop flag promptly.
const POLL_CAP: Duration = Duration::from_millis(20);
/// Pause after an accept error such as running out of descriptors, which
/// `poll` would otherwise report again at once.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(5);
/// Bytes drained from a socket before closing it, so the close sends FIN (and
/// the client reads our status byte) rather than a reset.
const DRAIN_MAX: usize = 72 * 1024;
/// Listen backlog asked for; Linux caps it at `net.core.somaxconn`.
const BACKLOG: libc::c_int = 4096;

/// Ask for a longer accept queue than std's default of 128, so a burst of
/// connections does not make the kernel drop a real client's SYN (which costs
/// it a one-second retransmit). Best effort: on failure the default stays.
pub(super) fn widen_backlog(listener: &TcpListener) {
    // SAFETY: the descriptor is a valid listening socket owned by `listener`
    // for the whole call; calling listen() again only updates the backlog.
    let _ = unsafe { libc::listen(listener.as_raw_fd(), BACKLOG) };
}

/// The fixed part of a hello: magic, version, token length.
const HEADER: usize = 4 + 1 + 2;

/// Incremental parser for the hello. It reads exactly the hello's bytes and
/// nothing more, so bytes after it stay in the socket for the request loop.
#[derive(Debug)]
pub(super) struct Hello {
    header: [u8; HEADER],
    have: usize,
    token: Vec<u8>,
}

/// What a read step of [`Hello`] found.
#[derive(Debug, PartialEq)]
pub(super) enum Step {
    /// Not all there yet; poll again.
    More,
    /// Complete: the client's version and token.
    Done { version: u8, token: Vec<u8> },
    /// Not a ferrocomm hello; close without a word.
    NotOurs,
    /// The peer closed or the socket failed.
    Gone,
}

impl Hello {
    pub(super) fn new() -> Self {
        Hello {
            header: [0; HEADER],
            have: 0,
            token: Vec::new(),
        }
    }

    /// Read what is available without blocking (`src` is non-blocking).
    pub(super) fn step(&mut self, src: &mut impl Read) -> Step {
        loop {
            let token_len = usize::from(u16::from_le_bytes([self.header[5], self.header[6]]));
            let buf: &mut [u8] = if self.have < HEADER {
                &mut self.header[self.have..]
            } else {
                if self.token.len() != token_len {
                    self.token.resize(token_len, 0);
                }
                let at = self.have - HEADER;
                if at == token_len {
                    return Step::Done {
                        version: self.header[4],
                        token: std::mem::take(&mut self.token),
                    };
                }
                &mut self.token[at..]
            };
            match src.read(buf) {
                Ok(0) => return Step::Gone,
                Ok(n) => {
                    self.have += n;
                    // Judge the magic as soon as it is in, so garbage is
                    // dropped without waiting for the rest.
                    if self.have >= MAGIC.len() && &self.header[..MAGIC.len()] != MAGIC {
                        return Step::NotOurs;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::More,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Step::Gone,
            }
        }
    }
}

struct Pending {
    stream: TcpStream,
    since: Instant,
    hello: Hello,
}

/// The admission thread: accept, run handshakes, hand authenticated
/// connections to their own threads; on stop, join those threads.
pub(super) fn run(shared: &Arc<Shared>, listener: &TcpListener) {
    let cfg = &shared.cfg;
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    let per_round = (cfg.max_pending_handshakes / 4).max(1);
    while !shared.stop.load(Ordering::SeqCst) {
        let wait = pending
            .front()
            .map_or(POLL_CAP, |p| {
                (p.since + cfg.handshake_timeout).saturating_duration_since(Instant::now())
            })
            .min(POLL_CAP);
        let Ok((listener_ready, ready)) = wait_readable(listener, &pending, wait) else {
            thread::sleep(ACCEPT_ERROR_PAUSE);
            continue;
        };

        // Handshakes that made progress; finished ones leave, order is kept.
        let mut still = VecDeque::with_capacity(pending.len());
        for (p, is_ready) in pending.drain(..).zip(ready) {
            let p = if is_ready {
                progress(shared, p, &mut workers)
            } else {
                Some(p)
            };
            still.extend(p);
        }
        pending = still;

        // Expire handshakes past their deadline (the deque is in accept order).
        let now = Instant::now();
        while pending.front().is_some_and(|p| now >= p.since + cfg.handshake_timeout) {
            if let Some(p) = pending.pop_front() {
                turn_away(p.stream, &[ST_TIMEOUT]);
            }
        }

        if listener_ready {
            accept_some(shared, listener, &mut pending, &mut workers, per_round);
        }
        workers.retain(|w| !w.is_finished());
    }
    drop(pending);
    for worker in workers {
        let _ = worker.join();
    }
}

/// Accept up to `limit` connections, making room by dropping the oldest
/// pending handshake, and read each at once in case its hello is already in.
fn accept_some(
    shared: &Arc<Shared>,
    listener: &TcpListener,
    pending: &mut VecDeque<Pending>,
    workers: &mut Vec<JoinHandle<()>>,
    limit: usize,
) {
    for _ in 0..limit {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            // E.g. out of descriptors: the peer stays queued and retries.
            Err(_) => {
                thread::sleep(ACCEPT_ERROR_PAUSE);
                return;
            }
        };
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        let _ = stream.set_nodelay(true);
        if pending.len() >= shared.cfg.max_pending_handshakes {
            if let Some(oldest) = pending.pop_front() {
                turn_away(oldest.stream, &[ST_BUSY]);
            }
        }
        let p = Pending {
            stream,
            since: Instant::now(),
            hello: Hello::new(),
        };
        pending.extend(progress(shared, p, workers));
    }
}

/// Read what the peer sent. Returns the connection while its handshake is
/// still pending; otherwise it has been handed on or closed.
fn progress(shared: &Arc<Shared>, mut p: Pending, workers: &mut Vec<JoinHandle<()>>) -> Option<Pending> {
    match p.hello.step(&mut p.stream) {
        Step::More => return Some(p),
        Step::NotOurs | Step::Gone => {}
        Step::Done { version, token } => {
            if version != VERSION {
                // Not secret, and it saves a confusing failure at upgrade time.
                turn_away(p.stream, &version_mismatch_reply(version));
            } else if !constant_time_eq(&token, &shared.cfg.token) {
                turn_away(p.stream, &[ST_DENIED]);
            } else {
                match serve_authenticated(shared, p.stream) {
                    Ok(worker) => workers.push(worker),
                    Err((Refusal::Full, Some(stream))) => turn_away(stream, &[ST_BUSY]),
                    Err(_) => {}
                }
            }
        }
    }
    None
}

/// Answer `status` without blocking (best effort), then close.
fn turn_away(mut stream: TcpStream, status: &[u8]) {
    let _ = stream.write(status);
    let _ = stream.shutdown(Shutdown::Write);
    // Unread input would make the close send a reset, which can destroy the
    // status byte before the client reads it.
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < DRAIN_MAX {
        match stream.read(&mut sink) {
            Ok(n) if n > 0 => drained += n,
            _ => break,
        }
    }
}

/// Wait until the listener or a pending socket is readable, or `wait` passes.
/// Returns the listener's readiness and each pending socket's, in order.
fn wait_readable(listener: &TcpListener, pending: &VecDeque<Pending>, wait: Duration) -> io::Result<(bool, Vec<bool>)> {
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(1 + pending.len());
    for fd in std::iter::once(listener.as_raw_fd()).chain(pending.iter().map(|p| p.stream.as_raw_fd())) {
        fds.push(libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
    }
    // Round up, so a deadline 0.3 ms away is not a busy loop of zero waits.
    let millis = libc::c_int::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX);
    // SAFETY: `fds` is an exclusively borrowed, initialised array of
    // `fds.len()` pollfd structs that outlives the call; the descriptors stay
    // open because `listener` and `pending` are borrowed for the call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == ErrorKind::Interrupted {
            return Ok((false, vec![false; pending.len()]));
        }
        return Err(e);
    }
    // Errors and hang-ups count as ready: the read that follows finds them.
    let ready = |f: &libc::pollfd| f.revents != 0;
    Ok((ready(&fds[0]), fds[1..].iter().map(ready).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Yields scripted chunks, then WouldBlock (or EOF when `eof`).
    struct Script {
        chunks: VecDeque<Vec<u8>>,
        eof: bool,
    }

    impl Read for Script {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let Some(chunk) = self.chunks.front_mut() else {
                return if self.eof {
                    Ok(0)
                } else {
                    Err(ErrorKind::WouldBlock.into())
                };
            };
            let n = chunk.len().min(buf.len());
            buf[..n].copy_from_slice(&chunk[..n]);
            chunk.drain(..n);
            if chunk.is_empty() {
                self.chunks.pop_front();
            }
            Ok(n)
        }
    }

    fn hello_bytes(version: u8, token: &[u8]) -> Vec<u8> {
        let mut h = MAGIC.to_vec();
        h.push(version);
        h.extend_from_slice(&(token.len() as u16).to_le_bytes());
        h.extend_from_slice(token);
        h
    }

    fn script(chunks: &[&[u8]], eof: bool) -> Script {
        Script {
            chunks: chunks.iter().map(|c| c.to_vec()).collect(),
            eof,
        }
    }

    #[test]
    fn hello_arrives_one_byte_at_a_time() {
        let bytes = hello_bytes(VERSION, b"tok");
        let mut hello = Hello::new();
        for (i, b) in bytes.iter().enumerate() {
            let step = hello.step(&mut script(&[std::slice::from_ref(b)], false));
            if i + 1 < bytes.len() {
                assert_eq!(step, Step::More, "byte {i}");
            } else {
                assert_eq!(
                    step,
                    Step::Done {
                        version: VERSION,
                        token: b"tok".to_vec()
                    }
                );
            }
        }
    }

    #[test]
    fn hello_does_not_read_past_its_end() {
        let mut bytes = hello_bytes(VERSION, b"t");
        bytes.extend_from_slice(b"NEXT");
        let mut src = script(&[&bytes], false);
        assert!(matches!(Hello::new().step(&mut src), Step::Done { .. }));
        let mut rest = Vec::new();
        let _ = src.read_to_end(&mut rest);
        assert_eq!(rest, b"NEXT");
    }

    #[test]
    fn bad_magic_and_early_close_are_judged_early() {
        assert_eq!(
            Hello::new().step(&mut script(&[b"GET / HTTP/1.1"], false)),
            Step::NotOurs
        );
        assert_eq!(Hello::new().step(&mut script(&[b"FC"], true)), Step::Gone);
        // An empty token parses; it is the token check that refuses it.
        assert_eq!(
            Hello::new().step(&mut script(&[&hello_bytes(9, b"")], false)),
            Step::Done {
                version: 9,
                token: Vec::new()
            }
        );
    }

    #[test]
    fn token_buffer_is_bounded_by_the_length_field() {
        let mut head = MAGIC.to_vec();
        head.push(VERSION);
        head.extend_from_slice(&u16::MAX.to_le_bytes());
        head.extend_from_slice(b"abc");
        let mut hello = Hello::new();
        assert_eq!(hello.step(&mut script(&[&head], false)), Step::More);
        // Bounded by the u16 length field: at most 64 KiB per handshake.
        assert_eq!(hello.token.len(), usize::from(u16::MAX));
    }
}
