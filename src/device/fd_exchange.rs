//! Passing file descriptors between the ranks of one job on one host.
//!
//! Shareable device memory is exported as a file descriptor (a memfd for the
//! host backend, a cuMem VMM POSIX fd for CUDA). A descriptor only means
//! something inside the process that holds it, so it cannot travel through the
//! store: it has to go over a Unix socket as `SCM_RIGHTS` ancillary data, and
//! only to peers that prove they belong to the job.
//!
//! How one exchange runs, on every rank at once:
//!
//! 1. Bind a listening socket in Linux's abstract namespace under a random name
//!    (abstract names vanish with the socket, so nothing is left to clean up on
//!    disk) and publish `{name, secret}` at `{key_prefix}/fdx/{rank}` in the
//!    store. The store is token-authenticated, so only job members can read the
//!    secret; presenting it proves membership.
//! 2. An acceptor thread takes connections until every peer has been served.
//!    For each one it checks `SO_PEERCRED` (same effective uid as us), reads the
//!    connector's rank and our secret, and answers with a `u32` count followed
//!    by our descriptors attached as `SCM_RIGHTS`. Anything wrong closes that
//!    connection without using up the slot of the rank it claimed.
//! 3. Meanwhile the calling thread visits every peer's record, connects
//!    (checking the listener's uid too, before handing it the secret), sends
//!    `(rank, secret)` and receives the peer's descriptors.
//!
//! Every wait is bounded by one deadline; on expiry the error names the ranks
//! we did not both receive from and serve. All descriptors are close-on-exec
//! and owned (`OwnedFd`) from the moment they exist, so error paths leak none.

use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::bootstrap::Store;
use crate::error::{Error, Result};

/// The most descriptors one rank may offer: the kernel's per-message limit
/// (`SCM_MAX_FD`). All of a rank's descriptors travel in a single message.
pub const MAX_FDS: usize = 253;

/// Abstract socket names are this prefix plus 16 random bytes in hex.
const NAME_PREFIX: &[u8] = b"ferrocomm-";
const NAME_RANDOM_BYTES: usize = 16;
const NAME_LEN: usize = NAME_PREFIX.len() + 2 * NAME_RANDOM_BYTES;
const SECRET_LEN: usize = 32;

/// Store record: magic, socket name, secret. Fixed size, no parsing freedom.
const RECORD_MAGIC: &[u8; 4] = b"FDX1";
const RECORD_LEN: usize = RECORD_MAGIC.len() + NAME_LEN + SECRET_LEN;

/// What a connector sends: its rank (`u32`, little endian), then the secret.
const HELLO_LEN: usize = 4 + SECRET_LEN;

/// How long one connector may take to say hello. A genuine peer writes its
/// hello right after connecting, so this only limits how long a stalled or
/// hostile connection can hold up the (serial) acceptor.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);

/// How often the acceptor wakes to see whether the exchange was abandoned.
const ACCEPT_SLICE: Duration = Duration::from_millis(50);

/// Bounds of the connector's back-off while peers are not ready yet.
const FIRST_BACKOFF: Duration = Duration::from_millis(1);
const MAX_BACKOFF: Duration = Duration::from_millis(50);

/// Every rank offers the same list of fds to every peer and receives each peer's list.
///
/// Returns `fds[peer]` (an empty `Vec` for our own rank). Blocks until every
/// peer has been served and heard from, or until `timeout`, when it returns
/// [`Error::Timeout`] listing the ranks not yet exchanged with.
///
/// `key_prefix` must be unique to this exchange (records are not versioned),
/// and the peers must run as the same user on the same host (Linux only: the
/// socket lives in the abstract namespace).
pub fn exchange_fds(
    store: &dyn Store,
    key_prefix: &str,
    rank: usize,
    world: usize,
    mine: &[BorrowedFd<'_>],
    timeout: Duration,
) -> Result<Vec<Vec<OwnedFd>>> {
    validate_args(rank, world, mine)?;
    if world == 1 {
        return Ok(vec![Vec::new()]);
    }
    let job = Job {
        store,
        key_prefix,
        rank,
        world,
        timeout,
        deadline: deadline_after(timeout),
    };

    let record = Record::generate()?;
    let listener =
        UnixListener::bind_addr(&record.address()?).map_err(|e| Error::io("binding the fd-exchange socket", e))?;
    // Nonblocking so that an accept after poll() cannot hang if the pending
    // connection went away in between.
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("setting the fd-exchange socket nonblocking", e))?;

    let key = record_key(key_prefix, rank);
    store.set(&key, &record.encode())?;
    let offer = Offer {
        rank,
        world,
        secret: &record.secret,
        fds: mine,
    };
    let outcome = run_both_sides(&job, listener, &offer);
    // Best effort: by now every peer we served has read the record, and the
    // listener it names is closed, so it is of no use to anyone. A failed
    // delete must not turn a successful exchange into an error.
    let _ = store.delete(&key);
    outcome
}

/// Rejects arguments that could not describe a valid exchange.
fn validate_args(rank: usize, world: usize, mine: &[BorrowedFd<'_>]) -> Result<()> {
    if world == 0 || rank >= world {
        return Err(Error::invalid(format!(
            "fd exchange: rank {rank} is not in a world of {world}"
        )));
    }
    // Ranks travel as u32 on the wire.
    if u32::try_from(world).is_err() {
        return Err(Error::invalid(format!(
            "fd exchange: world of {world} ranks is too large"
        )));
    }
    if mine.len() > MAX_FDS {
        return Err(Error::invalid(format!(
            "fd exchange: {} descriptors offered, at most {MAX_FDS} fit in one message",
            mine.len()
        )));
    }
    Ok(())
}

/// The parameters both sides of one exchange share.
struct Job<'a> {
    store: &'a dyn Store,
    key_prefix: &'a str,
    rank: usize,
    world: usize,
    timeout: Duration,
    deadline: Instant,
}

/// What our acceptor hands out, and to whom.
struct Offer<'a> {
    rank: usize,
    world: usize,
    secret: &'a [u8; SECRET_LEN],
    fds: &'a [BorrowedFd<'a>],
}

/// Runs the acceptor on a scoped thread and the connector on this one, then
/// folds both outcomes into one. A hard failure on either side stops the other
/// early instead of letting it wait out the deadline.
fn run_both_sides(job: &Job<'_>, listener: UnixListener, offer: &Offer<'_>) -> Result<Vec<Vec<OwnedFd>>> {
    let stop = AtomicBool::new(false);
    let (served, collected) = thread::scope(|scope| -> Result<_> {
        let stop = &stop;
        let deadline = job.deadline;
        let timeout = job.timeout;
        let acceptor = thread::Builder::new()
            .name("ferrocomm-fdx".into())
            .spawn_scoped(scope, move || {
                // The listener moves in and is closed as soon as serving ends,
                // so late or duplicate connectors are refused, not left hanging.
                let served = serve(listener, offer, deadline, timeout, stop);
                if served.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                served
            })
            .map_err(|e| Error::io("starting the fd-exchange acceptor thread", e))?;
        let collected = collect(job, stop);
        if collected.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        let served = acceptor.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        Ok((served, collected))
    })?;
    merge_outcomes(job, served, collected)
}

/// Combines the two sides. `Ok(None)` means "stopped because the other side
/// failed", so it never decides the result by itself.
fn merge_outcomes(
    job: &Job<'_>,
    served: Result<Option<()>>,
    collected: Result<Option<Vec<Vec<OwnedFd>>>>,
) -> Result<Vec<Vec<OwnedFd>>> {
    let (served, collected) = match (served, collected) {
        (Ok(Some(())), Ok(Some(fds))) => return Ok(fds),
        // A real failure explains the outcome better than a timeout does.
        (_, Err(e)) | (Err(e), _) if !is_timeout(&e) => return Err(e),
        other => other,
    };
    let mut what = Vec::new();
    let mut missing = Vec::new();
    for error in [collected.err(), served.err()].into_iter().flatten() {
        if let Error::Timeout {
            what: w, missing: m, ..
        } = error
        {
            what.push(w);
            missing.extend(m);
        }
    }
    if what.is_empty() {
        // Neither side failed, yet one stopped: only a bug gets here.
        return Err(Error::Aborted(format!(
            "fd exchange of rank {} stopped without an error",
            job.rank
        )));
    }
    missing.sort_unstable();
    missing.dedup();
    Err(Error::Timeout {
        what: what.join(" and "),
        after: job.timeout,
        missing,
    })
}

fn is_timeout(error: &Error) -> bool {
    matches!(error, Error::Timeout { .. })
}

// ---------------------------------------------------------------------------
// Acceptor side: serve our descriptors to every authenticated peer.
// ---------------------------------------------------------------------------

/// Accepts connections until every peer has been served, the deadline passes
/// (`Error::Timeout` naming the unserved ranks) or `stop` is raised (`Ok(None)`).
fn serve(
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

/// Compares two secrets in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Keep the optimiser from turning the fold into an early-exit compare.
    std::hint::black_box(diff) == 0
}

// ---------------------------------------------------------------------------
// Connector side: collect every peer's descriptors.
// ---------------------------------------------------------------------------

/// What one visit to a peer came to.
enum Attempt {
    Got(Vec<OwnedFd>),
    /// The peer has not published its record yet, or its listener is not there.
    NotYet,
}

/// Visits the peers round-robin until each has given us its descriptors.
/// Round-robin rather than in order, so that one absent peer cannot keep us
/// from the others: the timeout then names exactly the peers that are missing.
fn collect(job: &Job<'_>, stop: &AtomicBool) -> Result<Option<Vec<Vec<OwnedFd>>>> {
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

// ---------------------------------------------------------------------------
// The record each rank publishes, and small helpers.
// ---------------------------------------------------------------------------

/// Where to find a rank's listener and the secret it expects.
struct Record {
    /// Abstract socket name, without the leading NUL.
    name: [u8; NAME_LEN],
    secret: [u8; SECRET_LEN],
}

impl Record {
    /// A fresh random name and secret.
    fn generate() -> Result<Self> {
        let mut name = [0u8; NAME_LEN];
        name[..NAME_PREFIX.len()].copy_from_slice(NAME_PREFIX);
        let random: [u8; NAME_RANDOM_BYTES] = random_bytes()?;
        for (pair, byte) in name[NAME_PREFIX.len()..].chunks_exact_mut(2).zip(random) {
            pair.copy_from_slice(&hex_pair(byte));
        }
        Ok(Record {
            name,
            secret: random_bytes()?,
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(RECORD_LEN);
        out.extend_from_slice(RECORD_MAGIC);
        out.extend_from_slice(&self.name);
        out.extend_from_slice(&self.secret);
        out
    }

    /// Parses a record, refusing anything but the exact layout `encode` writes.
    fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != RECORD_LEN {
            return None;
        }
        let (magic, rest) = bytes.split_at(RECORD_MAGIC.len());
        let (name, secret) = rest.split_at(NAME_LEN);
        let well_formed = magic == RECORD_MAGIC
            && name.starts_with(NAME_PREFIX)
            && name[NAME_PREFIX.len()..]
                .iter()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
        well_formed.then(|| Record {
            name: name.try_into().unwrap_or([0; NAME_LEN]),
            secret: secret.try_into().unwrap_or([0; SECRET_LEN]),
        })
    }

    /// The socket address in Linux's abstract namespace.
    fn address(&self) -> Result<SocketAddr> {
        SocketAddr::from_abstract_name(self.name).map_err(|e| Error::io("building the fd-exchange socket address", e))
    }
}

fn record_key(key_prefix: &str, rank: usize) -> String {
    format!("{key_prefix}/fdx/{rank}")
}

fn hex_pair(byte: u8) -> [u8; 2] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    [DIGITS[usize::from(byte >> 4)], DIGITS[usize::from(byte & 0xf)]]
}

/// The deadline `timeout` from now; a timeout too large to represent means
/// "practically never".
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Time left until `deadline`, or `None` once it has passed.
fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
}

/// Bounds every read and write on `stream` by `limit`.
fn bound_timeouts(stream: &UnixStream, limit: Duration) -> io::Result<()> {
    // std rejects a zero timeout; round up to the smallest useful one.
    let limit = limit.max(Duration::from_millis(1));
    stream.set_read_timeout(Some(limit))?;
    stream.set_write_timeout(Some(limit))
}

/// Cryptographically random bytes from the kernel.
fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut buf = [0u8; N];
    let mut filled = 0;
    while filled < N {
        match getrandom(&mut buf[filled..]) {
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // Kernels before 3.17 lack getrandom(2).
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => return urandom_bytes(),
            Err(e) => return Err(Error::io("getrandom", e)),
        }
    }
    Ok(buf)
}

fn urandom_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut buf = [0u8; N];
    // std opens files close-on-exec.
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(|e| Error::io("reading /dev/urandom", e))?;
    Ok(buf)
}

// ---------------------------------------------------------------------------
// Thin wrappers over libc. Raw pointers do not leave these functions.
// ---------------------------------------------------------------------------

fn getrandom(buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the pointer and length describe `buf`, which is live and
    // writable for the whole call; getrandom writes at most `buf.len()` bytes.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

fn effective_uid() -> libc::uid_t {
    // SAFETY: geteuid takes no arguments, touches no memory of ours and
    // cannot fail.
    unsafe { libc::geteuid() }
}

/// The uid of the process at the other end of a connected Unix socket, as the
/// kernel recorded it at connect/listen time (it cannot be forged).
fn peer_uid(sock: BorrowedFd<'_>) -> io::Result<libc::uid_t> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `sock` is an open descriptor (borrowed), `cred` is a live ucred
    // and `len` holds its exact size, so the kernel writes within it.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "short SO_PEERCRED answer"));
    }
    Ok(cred.uid)
}

/// Waits up to `timeout` for `fd` to become readable (for a listener: for a
/// pending connection). A signal counts as "not yet".
fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // Round up so that a sub-millisecond remainder still waits, not spins.
    let millis = timeout.as_micros().div_ceil(1000).max(1);
    let millis = libc::c_int::try_from(millis).unwrap_or(libc::c_int::MAX);
    // SAFETY: `pfd` is one live pollfd and we pass nfds = 1; the descriptor
    // is borrowed, so it stays open during the call.
    let rc = unsafe { libc::poll(&mut pfd, 1, millis) };
    match rc {
        0 => Ok(false),
        n if n > 0 => Ok(true),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}

/// Control-message space for `count` descriptors. `count` never exceeds
/// [`MAX_FDS`], so the byte count fits in a `c_uint` many times over.
fn cmsg_space(count: usize) -> usize {
    let payload = (count.min(MAX_FDS) * std::mem::size_of::<libc::c_int>()) as libc::c_uint;
    // SAFETY: CMSG_SPACE is pure arithmetic on its argument.
    unsafe { libc::CMSG_SPACE(payload) as usize }
}

/// A zeroed control buffer for `count` descriptors, aligned for `cmsghdr`
/// (whose strictest member is a `size_t`, hence `u64` elements).
fn control_buffer(count: usize) -> Vec<u64> {
    vec![0u64; cmsg_space(count).div_ceil(std::mem::size_of::<u64>())]
}

/// Sends all of `data`, with `fds` attached to its first byte, without raising
/// SIGPIPE if the peer has gone (the host program may not ignore it).
fn send_all(sock: BorrowedFd<'_>, mut data: &[u8], mut fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    while !data.is_empty() {
        match send_with_fds(sock, data, fds) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                data = &data[n..];
                // The descriptors went out with the first byte.
                fds = &[];
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One `sendmsg` of `data` with `fds` as `SCM_RIGHTS` (none if empty).
fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors for one message",
        ));
    }
    let mut iov = libc::iovec {
        // sendmsg only reads through this pointer; the `mut` is the C API's.
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut control = control_buffer(fds.len());
    // SAFETY: msghdr is a plain C struct for which all-zero bytes (null
    // pointers, zero lengths) are a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = cmsg_space(fds.len()) as _;
        let payload = (fds.len() * std::mem::size_of::<libc::c_int>()) as libc::c_uint;
        // SAFETY: msg_control points at `control`, which is aligned for
        // cmsghdr and CMSG_SPACE(payload) bytes long, so CMSG_FIRSTHDR returns
        // a non-null header inside it and CMSG_DATA has room for exactly
        // `fds.len()` ints after it. The writes are unaligned-safe.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as _;
            let slots = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                slots.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // SAFETY: `msg` points at `iov` (describing `data`) and `control`, both
    // live until the call returns; the descriptors are borrowed, hence open.
    // MSG_NOSIGNAL turns a vanished peer into EPIPE instead of SIGPIPE.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// What one `recvmsg` delivered.
struct Received {
    len: usize,
    fds: Vec<OwnedFd>,
    /// The kernel had more control data than fit (it closed the excess fds).
    truncated: bool,
}

/// One `recvmsg` into `buf`, accepting up to `max_fds` descriptors, which
/// arrive close-on-exec and are owned before this returns.
fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8], max_fds: usize) -> io::Result<Received> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = control_buffer(max_fds);
    // SAFETY: all-zero bytes are a valid msghdr (see `send_with_fds`).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = (control.len() * std::mem::size_of::<u64>()) as _;
    // SAFETY: `msg` points at `iov` (describing the writable `buf`) and at
    // `control`, whose length is msg_controllen; both outlive the call, and
    // the kernel writes only within them. The socket is borrowed, hence open.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    let len = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    Ok(Received {
        len,
        fds: take_fds(&msg),
        truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

/// Takes ownership of every descriptor in the `SCM_RIGHTS` messages of a
/// `msghdr` that a successful `recvmsg` just filled in.
fn take_fds(msg: &libc::msghdr) -> Vec<OwnedFd> {
    let mut fds = Vec::new();
    // SAFETY: after a successful recvmsg, msg_control/msg_controllen describe
    // the control bytes the kernel wrote into our aligned buffer, so
    // CMSG_FIRSTHDR/CMSG_NXTHDR only yield headers inside it, and each
    // SCM_RIGHTS payload holds cmsg_len - CMSG_LEN(0) bytes of descriptors
    // (the kernel shrinks cmsg_len on truncation). Those descriptors were just
    // installed in our table for us alone, so wrapping each in an OwnedFd
    // gives it exactly one owner.
    unsafe {
        let header_len = libc::CMSG_LEN(0) as usize;
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            let hdr = &*cmsg;
            if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
                let count = (hdr.cmsg_len as usize).saturating_sub(header_len) / std::mem::size_of::<libc::c_int>();
                let slots = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(slots.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    fds
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::fs::File;
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    use std::sync::{Condvar, Mutex};

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
}
