//! The acceptor: serves our descriptors to every peer that proves it belongs
//! to the job, one connection at a time, until each peer has been served.

use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::credentials::{constant_time_eq, effective_uid, peer_uid};
use super::deadline::remaining;
use super::socket::{bound_timeouts, send_all, wait_readable};
use super::wire::{HELLO_LEN, SECRET_LEN};
use crate::error::{Error, Result};

/// How long one connector may take to say hello. A genuine peer writes its
/// hello right after connecting, so this only limits how long a stalled or
/// hostile connection can hold up the (serial) acceptor.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);

/// How often the acceptor wakes to see whether the exchange was abandoned.
const ACCEPT_SLICE: Duration = Duration::from_millis(50);

/// What our acceptor hands out, and to whom.
pub(super) struct Offer<'a> {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) secret: &'a [u8; SECRET_LEN],
    pub(super) fds: &'a [BorrowedFd<'a>],
}

/// Accepts connections until every peer has been served, the deadline passes
/// (`Error::Timeout` naming the unserved ranks) or `stop` is raised (`Ok(None)`).
pub(super) fn serve(
    listener: UnixListener,
    offer: &Offer<'_>,
    deadline: Instant,
    timeout: Duration,
    stop: &AtomicBool,
) -> Result<Option<()>> {
    let mut served = vec![false; offer.world];
    served[offer.rank] = true;
    let mut left = offer.world - 1;
    let mut rejections = Rejections::default();
    while left > 0 {
        if stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let Some(remaining) = remaining(deadline) else {
            return Err(Error::Timeout {
                what: format!("peers to collect rank {}'s fds{}", offer.rank, rejections.describe()),
                after: timeout,
                missing: unserved(&served),
            });
        };
        // Wake up now and then even when nobody connects, to notice `stop`.
        let ready = wait_readable(listener.as_fd(), remaining.min(ACCEPT_SLICE))
            .map_err(|e| Error::io("polling the fd-exchange socket", e))?;
        if !ready {
            continue;
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            // The connection may have gone between poll() and accept().
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                ) =>
            {
                continue
            }
            Err(e) => return Err(Error::io("accepting on the fd-exchange socket", e)),
        };
        // Dropping `stream` closes it whatever the verdict; a rejected
        // connection leaves the claimed rank's slot open for the real peer.
        match serve_one(&stream, offer, &served, deadline) {
            Ok(peer) => {
                served[peer] = true;
                left -= 1;
            }
            Err(reason) => rejections.record(reason),
        }
    }
    Ok(Some(()))
}

/// Authenticates one connection and, if it passes, sends it our descriptors.
/// Returns the peer's rank, or why the connection was refused.
fn serve_one(
    stream: &UnixStream,
    offer: &Offer<'_>,
    served: &[bool],
    deadline: Instant,
) -> std::result::Result<usize, String> {
    // Linux does not pass O_NONBLOCK from the listener to accepted sockets;
    // say so anyway, because the timeouts below rely on blocking I/O.
    stream
        .set_nonblocking(false)
        .map_err(|e| format!("cannot make the connection blocking: {e}"))?;
    // Check who is on the other end before reading a single byte from it.
    let uid = peer_uid(stream.as_fd()).map_err(|e| format!("no peer credentials: {e}"))?;
    if uid != effective_uid() {
        return Err(format!("connection from foreign uid {uid}"));
    }
    let limit = remaining(deadline).ok_or("deadline passed")?.min(HANDSHAKE_LIMIT);
    bound_timeouts(stream, limit).map_err(|e| format!("cannot set timeouts: {e}"))?;

    let mut hello = [0u8; HELLO_LEN];
    (&*stream)
        .read_exact(&mut hello)
        .map_err(|e| format!("no hello: {e}"))?;
    let (rank_bytes, secret) = hello.split_at(4);
    // Authenticate first, so that only job members learn anything about
    // which ranks are valid or already served.
    if !constant_time_eq(secret, offer.secret) {
        return Err("wrong secret".into());
    }
    let peer = u32::from_le_bytes(rank_bytes.try_into().unwrap_or_default()) as usize;
    if peer >= offer.world || peer == offer.rank {
        return Err(format!("rank {peer} out of range"));
    }
    if served[peer] {
        return Err(format!("rank {peer} already served"));
    }

    // `validate_args` capped the count at MAX_FDS, so it fits in a u32.
    let header = (offer.fds.len() as u32).to_le_bytes();
    send_all(stream.as_fd(), &header, offer.fds).map_err(|e| format!("sending fds to rank {peer} failed: {e}"))?;
    Ok(peer)
}

/// Why connections were refused, kept for the timeout message: when a peer
/// never arrives, a string of rejections usually says why.
#[derive(Default)]
struct Rejections {
    count: usize,
    last: Option<String>,
}

impl Rejections {
    fn record(&mut self, reason: String) {
        self.count += 1;
        self.last = Some(reason);
    }

    fn describe(&self) -> String {
        match &self.last {
            None => String::new(),
            Some(last) => format!(" ({} connection(s) rejected, last: {last})", self.count),
        }
    }
}

fn unserved(served: &[bool]) -> Vec<usize> {
    (0..served.len()).filter(|&r| !served[r]).collect()
}
