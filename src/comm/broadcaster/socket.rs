//! The broadcaster's TCP connections, writer to each reader: messages
//! that do not fit a ring slot, every message to readers on other nodes,
//! and (for every reader) the liveness of the other end: a process that
//! dies closes its sockets, which the peer sees as a hang-up.
//!
//! A message on a socket is a frame: its number (u64, little endian), its
//! length (u64), then its bytes. Sockets are nonblocking; waits are
//! `poll` calls bounded by the caller's [`Waiter`].

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

use super::wait::Waiter;
use crate::error::Error;

pub(super) const FRAME_HEADER: usize = 16;

/// A frame's header.
pub(super) fn header(m: u64, len: usize) -> [u8; FRAME_HEADER] {
    let mut h = [0u8; FRAME_HEADER];
    h[..8].copy_from_slice(&m.to_le_bytes());
    h[8..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// `poll` on `fds` for at most `timeout`; the number of ready ones (an
/// interrupted poll counts as none ready: callers look again).
pub(super) fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<usize> {
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a live, writable slice of pollfd and its length is
    // passed with it; poll writes only the `revents` fields.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(n as usize)
}

fn pollfd(stream: &impl AsRawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd: stream.as_raw_fd(),
        events,
        revents: 0,
    }
}

/// Whether the other end of each of `streams` has closed (or reset) the
/// connection, looked at without waiting. Only for connections on which
/// the other end sends nothing more (the writer's view of its readers;
/// a reader's view of the writer is [`Incoming`]'s EOF).
pub(super) fn hung_up(streams: &[&TcpStream]) -> io::Result<Vec<bool>> {
    let mut fds: Vec<libc::pollfd> = streams.iter().map(|s| pollfd(*s, libc::POLLRDHUP)).collect();
    poll(&mut fds, Duration::ZERO)?;
    let gone = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
    Ok(fds.iter().map(|f| f.revents & gone != 0).collect())
}

/// Whether the writer's end of a reader's connection has closed. Data may
/// still be queued before the close (frames the reader has yet to take),
/// so this only says that no more will come.
pub(super) fn writer_hung_up(stream: &TcpStream) -> io::Result<bool> {
    Ok(hung_up(&[stream])?[0])
}

/// `writev` with `MSG_NOSIGNAL`: a reader that died makes the write fail
/// with `EPIPE` instead of raising SIGPIPE, which kills processes that do
/// not ignore it (std's `write_vectored` is a plain `writev`; its `write`
/// already passes the flag).
fn send_vectored(stream: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: a zeroed msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec on Unix (documented by std);
    // sendmsg only reads through the pointer.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: `msg` points at `bufs.len()` live iovecs for the duration of
    // the call, on a socket descriptor `stream` owns.
    let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Why sending a frame to the readers failed.
pub(super) enum SendFailure {
    /// The deadline passed with these readers (indices into the targets)
    /// not having taken the whole frame.
    Timeout(Vec<usize>),
    /// This reader's connection failed: it closed it or its process died.
    Gone(usize, io::Error),
    /// The wait's interrupt hook, or `poll`, failed.
    Other(Error),
}

/// Send one frame (`head`, then `body`) to every stream of `targets` at
/// once: each write goes as far as that reader's socket buffer allows, so
/// a slow reader holds up only its own stream, and the deadline names the
/// readers that have not taken the frame.
pub(super) fn send_frame(
    targets: &mut [&mut TcpStream],
    head: &[u8; FRAME_HEADER],
    body: &[u8],
    waiter: &mut Waiter<'_>,
) -> std::result::Result<(), SendFailure> {
    let total = FRAME_HEADER + body.len();
    let mut sent = vec![0usize; targets.len()];
    loop {
        for (i, stream) in targets.iter_mut().enumerate() {
            while sent[i] < total {
                let off = sent[i];
                let wrote = if off < FRAME_HEADER {
                    send_vectored(stream, &[IoSlice::new(&head[off..]), IoSlice::new(body)])
                } else {
                    stream.write(&body[off - FRAME_HEADER..])
                };
                match wrote {
                    Ok(0) => return Err(SendFailure::Gone(i, io::ErrorKind::WriteZero.into())),
                    Ok(n) => sent[i] += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(SendFailure::Gone(i, e)),
                }
            }
        }
        let pending: Vec<usize> = (0..targets.len()).filter(|&i| sent[i] < total).collect();
        if pending.is_empty() {
            return Ok(());
        }
        if waiter.expired() {
            return Err(SendFailure::Timeout(pending));
        }
        let mut fds: Vec<libc::pollfd> = pending.iter().map(|&i| pollfd(&*targets[i], libc::POLLOUT)).collect();
        let mut polled = Ok(0);
        waiter
            .pause(|d| polled = poll(&mut fds, d))
            .map_err(SendFailure::Other)?;
        polled.map_err(|e| SendFailure::Other(Error::io("polling the broadcaster's reader sockets", e)))?;
    }
}

/// A frame being received, kept between calls so that a receive that runs
/// out of time can be taken up again where it stopped.
#[derive(Default)]
pub(super) struct Incoming {
    head: [u8; FRAME_HEADER],
    have: usize,
    body: Vec<u8>,
}

/// Why receiving a frame failed.
pub(super) enum RecvFailure {
    /// The deadline passed; the frame so far is kept.
    Timeout,
    /// The writer closed the connection (or its process died) at a frame
    /// boundary (`true`) or inside a frame (`false`).
    Closed(bool),
    /// Reading failed otherwise, or the frame's length cannot be held.
    Io(io::Error),
    /// The wait's interrupt hook, or `poll`, failed.
    Other(Error),
}

impl Incoming {
    /// Receive the rest of the current frame: its number, and its bytes.
    pub(super) fn recv(
        &mut self,
        stream: &mut TcpStream,
        waiter: &mut Waiter<'_>,
    ) -> std::result::Result<(u64, Vec<u8>), RecvFailure> {
        loop {
            match self.read_some(stream) {
                Ok(true) => {
                    let m = u64::from_le_bytes(self.head[..8].try_into().unwrap_or_default());
                    let body = std::mem::take(&mut self.body);
                    self.have = 0;
                    return Ok((m, body));
                }
                Ok(false) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(RecvFailure::Closed(self.have == 0)),
                Err(e) => return Err(RecvFailure::Io(e)),
            }
            if waiter.expired() {
                return Err(RecvFailure::Timeout);
            }
            let mut fds = [pollfd(&*stream, libc::POLLIN)];
            let mut polled = Ok(0);
            // A closed writer shows as EOF above: the liveness checks the
            // ring needs are not needed here.
            waiter
                .pause(|d| polled = poll(&mut fds, d))
                .map_err(RecvFailure::Other)?;
            polled.map_err(|e| RecvFailure::Other(Error::io("polling the broadcaster's socket", e)))?;
        }
    }

    /// Read what is there; `Ok(true)` once the frame is complete.
    fn read_some(&mut self, stream: &mut TcpStream) -> io::Result<bool> {
        loop {
            let n = if self.have < FRAME_HEADER {
                stream.read(&mut self.head[self.have..])
            } else {
                let off = self.have - FRAME_HEADER;
                if off == self.body.len() {
                    return Ok(true);
                }
                stream.read(&mut self.body[off..])
            };
            match n {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    self.have += n;
                    if self.have == FRAME_HEADER {
                        self.start_body()?;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The header is in: make room for the body it announces.
    fn start_body(&mut self) -> io::Result<()> {
        let len = u64::from_le_bytes(self.head[8..].try_into().unwrap_or_default());
        let len = usize::try_from(len).map_err(|_| io::Error::new(io::ErrorKind::OutOfMemory, "frame too long"))?;
        self.body = Vec::new();
        self.body.try_reserve_exact(len).map_err(|e| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("cannot hold a message of {len} bytes: {e}"),
            )
        })?;
        self.body.resize(len, 0);
        Ok(())
    }
}
