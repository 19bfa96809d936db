//! The connector: visits every peer's record, connects, proves membership
//! with the peer's secret and receives the peer's descriptors.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::credentials::{effective_uid, peer_uid};
use super::deadline::{is_timeout, remaining};
use super::socket::{bound_timeouts, recv_with_fds, send_all, MAX_FDS};
use super::wire::{record_key, Record, HELLO_LEN};
use crate::bootstrap::Store;
use crate::error::{Error, Result};

/// Bounds of the connector's back-off while peers are not ready yet.
const FIRST_BACKOFF: Duration = Duration::from_millis(1);
const MAX_BACKOFF: Duration = Duration::from_millis(50);

/// One exchange as the connector sees it; its deadline and timeout bound
/// the acceptor too.
pub(super) struct Job<'a> {
    pub(super) store: &'a dyn Store,
    pub(super) key_prefix: &'a str,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) timeout: Duration,
    pub(super) deadline: Instant,
}

/// What one visit to a peer came to.
enum Attempt {
    Got(Vec<OwnedFd>),
    /// The peer has not published its record yet, or its listener is not there.
    NotYet,
}

/// Visits the peers round-robin until each has given us its descriptors.
/// Round-robin rather than in order, so that one absent peer cannot keep us
/// from the others: the timeout then names exactly the peers that are missing.
pub(super) fn collect(job: &Job<'_>, stop: &AtomicBool) -> Result<Option<Vec<Vec<OwnedFd>>>> {
    let mut received: Vec<Vec<OwnedFd>> = (0..job.world).map(|_| Vec::new()).collect();
    // Start after our own rank so that not every rank queues at rank 0 first.
    let mut pending: Vec<usize> = (1..job.world).map(|i| (job.rank + i) % job.world).collect();
    let mut backoff = FIRST_BACKOFF;
    while !pending.is_empty() {
        if stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let Some(left) = remaining(job.deadline) else {
            return Err(collect_timeout(job, pending));
        };
        let before = pending.len();
        let mut i = 0;
        while i < pending.len() {
            let peer = pending[i];
            match fetch_from_peer(job, peer) {
                Ok(Attempt::Got(fds)) => {
                    received[peer] = fds;
                    pending.remove(i);
                }
                Ok(Attempt::NotYet) => i += 1,
                // A socket or store wait ran into the deadline.
                Err(e) if is_timeout(&e) => return Err(collect_timeout(job, pending)),
                Err(e) => return Err(e),
            }
        }
        if pending.len() == before {
            thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
    Ok(Some(received))
}

fn collect_timeout(job: &Job<'_>, mut pending: Vec<usize>) -> Error {
    pending.sort_unstable();
    Error::Timeout {
        what: format!("rank {} to receive fds from its peers", job.rank),
        after: job.timeout,
        missing: pending,
    }
}

/// One visit: read the peer's record, connect, authenticate, receive.
fn fetch_from_peer(job: &Job<'_>, peer: usize) -> Result<Attempt> {
    let key = record_key(job.key_prefix, peer);
    // check() first so that an absent peer costs one quick look, not a wait.
    if !job.store.check(&key)? {
        return Ok(Attempt::NotYet);
    }
    let left = remaining(job.deadline).ok_or_else(socket_timeout)?;
    let record = Record::decode(&job.store.get(&key, left)?)
        .ok_or_else(|| Error::Store(format!("malformed fd-exchange record at {key}")))?;

    let stream = match UnixStream::connect_addr(&record.address()?) {
        Ok(stream) => stream,
        // Nobody listens under that name (any more): the peer gave up or
        // failed. Keep trying until the deadline, which then names it.
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Ok(Attempt::NotYet),
        Err(e) => return Err(peer_error(peer, "connecting to", e)),
    };
    // Abstract names carry no permissions. Make sure the listener is ours
    // before handing it the secret or trusting the descriptors it sends.
    let uid = peer_uid(stream.as_fd()).map_err(|e| peer_error(peer, "checking", e))?;
    if uid != effective_uid() {
        return Err(Error::io(
            format!("fd socket of rank {peer}"),
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("the listener runs as uid {uid}, not as us"),
            ),
        ));
    }
    let left = remaining(job.deadline).ok_or_else(socket_timeout)?;
    bound_timeouts(&stream, left).map_err(|e| peer_error(peer, "setting timeouts for", e))?;

    let mut hello = [0u8; HELLO_LEN];
    // `validate_args` checked that every rank fits in a u32.
    hello[..4].copy_from_slice(&(job.rank as u32).to_le_bytes());
    hello[4..].copy_from_slice(&record.secret);
    send_all(stream.as_fd(), &hello, &[]).map_err(|e| peer_error(peer, "greeting", e))?;
    receive_fds(&stream, peer).map(Attempt::Got)
}

/// Reads the peer's `u32` count and the descriptors attached to it, and checks
/// that exactly that many arrived.
fn receive_fds(stream: &UnixStream, peer: usize) -> Result<Vec<OwnedFd>> {
    let mut header = [0u8; 4];
    let mut filled = 0;
    let mut fds = Vec::new();
    while filled < header.len() {
        let got = match recv_with_fds(stream.as_fd(), &mut header[filled..], MAX_FDS) {
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(peer_error(peer, "receiving fds from", e)),
        };
        // Owned before any check below can return: an error closes them.
        fds.extend(got.fds);
        if got.truncated {
            return Err(protocol_error(peer, "sent more descriptors than fit"));
        }
        if got.len == 0 {
            return Err(protocol_error(
                peer,
                "closed the connection (it rejected us or gave up)",
            ));
        }
        filled += got.len;
    }
    let announced = u32::from_le_bytes(header) as usize;
    if announced != fds.len() {
        return Err(protocol_error(
            peer,
            &format!("announced {announced} descriptors but sent {}", fds.len()),
        ));
    }
    Ok(fds)
}

/// Turns an I/O error talking to `peer` into ours. A socket timeout becomes
/// `Error::Timeout`; [`collect`] then fills in every rank still pending.
fn peer_error(peer: usize, doing: &str, e: io::Error) -> Error {
    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
        socket_timeout()
    } else {
        Error::io(format!("{doing} the fd socket of rank {peer}"), e)
    }
}

/// Placeholder timeout; [`collect`] replaces it with the full picture.
fn socket_timeout() -> Error {
    Error::Timeout {
        what: "an fd-exchange socket".into(),
        after: Duration::ZERO,
        missing: Vec::new(),
    }
}

fn protocol_error(peer: usize, what: &str) -> Error {
    Error::io(
        format!("fd exchange with rank {peer}"),
        io::Error::new(io::ErrorKind::InvalidData, format!("the peer {what}")),
    )
}
