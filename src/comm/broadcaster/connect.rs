//! Setting up the TCP connections: the writer listens, every reader
//! connects and proves it belongs to the job with the secret from the
//! writer's record (the store is token-authenticated, so only job members
//! read it); once every reader is in, the writer answers each with READY,
//! so that setup succeeds or fails on every rank alike.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::socket::poll;
use super::wait::Waiter;
use super::wire::{hello, parse_hello, Record, HELLO_LEN, MAX_ADDRS, READY, SECRET_LEN};
use crate::device::fd_exchange::constant_time_eq;
use crate::error::{Error, Result};

/// A handshake that has not sent its hello within this long is dropped.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Most handshakes in progress; the oldest gives way to a newcomer, so
/// connections that never say hello cannot lock readers out.
const MAX_PENDING: usize = 64;
/// Longest wait for one connection attempt; an address that does not
/// answer within it is retried after the others.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);

/// The writer's listener: loopback when every reader runs on this host,
/// every interface otherwise (IPv6 with IPv4 mapped where the host has
/// IPv6, else IPv4).
pub(super) fn listen(on_this_host_only: bool) -> Result<TcpListener> {
    let bound = if on_this_host_only {
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
    } else {
        TcpListener::bind((Ipv6Addr::UNSPECIFIED, 0)).or_else(|_| TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)))
    };
    let listener = bound.map_err(|e| Error::io("binding the broadcaster's listener", e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("making the broadcaster's listener nonblocking", e))?;
    Ok(listener)
}

/// This host's addresses that readers on other hosts may reach: every
/// interface that is up, not loopback, and not IPv6 link-local (which
/// needs a scope this record does not carry); IPv4 first. IPv6 ones only
/// when the listener is IPv6.
pub(super) fn reachable_addrs(listener: &TcpListener) -> Result<Vec<IpAddr>> {
    let v6 = listener.local_addr().is_ok_and(|a| a.is_ipv6());
    let mut ifs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifs` with a list we free below.
    if unsafe { libc::getifaddrs(&mut ifs) } != 0 {
        return Err(Error::io("listing this host's addresses", io::Error::last_os_error()));
    }
    let mut out = Vec::new();
    let mut cur = ifs;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive
        // until freeifaddrs; `ifa_addr` (when not null) points at a
        // sockaddr of the family it names, so the casts read within it.
        let addr = unsafe {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            let up = ifa.ifa_flags & libc::IFF_UP as libc::c_uint != 0;
            let lo = ifa.ifa_flags & libc::IFF_LOOPBACK as libc::c_uint != 0;
            if ifa.ifa_addr.is_null() || !up || lo {
                continue;
            }
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*ifa.ifa_addr.cast::<libc::sockaddr_in>();
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 if v6 => {
                    let sin6 = &*ifa.ifa_addr.cast::<libc::sockaddr_in6>();
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        let link_local = matches!(addr, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80);
        if !addr.is_loopback() && !link_local && !out.contains(&addr) {
            out.push(addr);
        }
    }
    // SAFETY: freeing the list getifaddrs allocated, once, after its last use.
    unsafe { libc::freeifaddrs(ifs) };
    out.sort_by_key(|a| a.is_ipv6());
    out.truncate(MAX_ADDRS);
    Ok(out)
}

/// A connection still in its handshake.
struct Handshake {
    stream: TcpStream,
    hello: [u8; HELLO_LEN],
    have: usize,
    since: Instant,
}

/// Accept until every rank of `readers` has connected and presented
/// `secret`; returns their connections (nonblocking, no delay), in the
/// order of `readers`. A connection with a wrong hello, a wrong secret, a
/// rank that is not an expected reader or has already connected is
/// closed without taking anyone's place.
pub(super) fn accept_readers(
    listener: &TcpListener,
    secret: &[u8; SECRET_LEN],
    readers: &[usize],
    what: &str,
    waiter: &mut Waiter<'_>,
    timeout: Duration,
) -> Result<Vec<TcpStream>> {
    let mut accepted: Vec<Option<TcpStream>> = readers.iter().map(|_| None).collect();
    let mut pending: Vec<Handshake> = Vec::new();
    let io_err = |doing: &str, e| Error::io(format!("{what}: {doing}"), e);
    loop {
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream
                        .set_nonblocking(true)
                        .map_err(|e| io_err("making a reader's connection nonblocking", e))?;
                    if pending.len() == MAX_PENDING {
                        pending.remove(0);
                    }
                    pending.push(Handshake {
                        stream,
                        hello: [0; HELLO_LEN],
                        have: 0,
                        since: Instant::now(),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // A connection reset before we took it is the peer's loss.
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
                Err(e) => return Err(io_err("accepting a reader's connection", e)),
            }
        }
        let mut i = 0;
        while i < pending.len() {
            let h = &mut pending[i];
            let keep = match h.stream.read(&mut h.hello[h.have..]) {
                Ok(0) => false,
                Ok(n) => {
                    h.have += n;
                    true
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => true,
                Err(_) => false,
            };
            if !keep || h.since.elapsed() > HELLO_TIMEOUT {
                pending.swap_remove(i);
                continue;
            }
            if h.have < HELLO_LEN {
                i += 1;
                continue;
            }
            let h = pending.swap_remove(i);
            let claimed = parse_hello(&h.hello).and_then(|(rank, presented)| {
                let slot = readers.iter().position(|&r| r == rank)?;
                (constant_time_eq(presented, secret) && accepted[slot].is_none()).then_some(slot)
            });
            if let Some(slot) = claimed {
                let _ = h.stream.set_nodelay(true);
                accepted[slot] = Some(h.stream);
            }
        }
        if accepted.iter().all(Option::is_some) {
            return Ok(accepted.into_iter().flatten().collect());
        }
        if waiter.expired() {
            return Err(Error::Timeout {
                what: format!("{what}: the readers to connect"),
                after: timeout,
                missing: (0..readers.len())
                    .filter(|&s| accepted[s].is_none())
                    .map(|s| readers[s])
                    .collect(),
            });
        }
        let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw())
            .chain(pending.iter().map(|h| h.stream.as_raw()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let mut polled = Ok(0);
        waiter.pause(|d| polled = poll(&mut fds, d))?;
        polled.map_err(|e| io_err("waiting for readers to connect", e))?;
    }
}

trait AsRaw {
    fn as_raw(&self) -> libc::c_int;
}

impl<T: std::os::fd::AsRawFd> AsRaw for T {
    fn as_raw(&self) -> libc::c_int {
        self.as_raw_fd()
    }
}

/// Tell every reader that all are in. The sockets are fresh, so one byte
/// always fits; a reader that is already gone fails here, by name.
pub(super) fn send_ready(streams: &mut [TcpStream], readers: &[usize], what: &str) -> Result<()> {
    for (stream, &rank) in streams.iter_mut().zip(readers) {
        loop {
            match stream.write(&[READY]) {
                Ok(1) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(_) => {
                    return Err(Error::io(
                        format!("{what}: telling reader rank {rank} to start"),
                        io::ErrorKind::WriteZero.into(),
                    ))
                }
                Err(e) => return Err(Error::io(format!("{what}: telling reader rank {rank} to start"), e)),
            }
        }
    }
    Ok(())
}

/// Connect to the writer at one of `addrs` (tried in turn until the
/// deadline), say hello, and wait for READY. Returns the connection,
/// nonblocking.
pub(super) fn connect_writer(
    addrs: &[SocketAddr],
    record: &Record,
    rank: usize,
    what: &str,
    waiter: &mut Waiter<'_>,
    timeout: Duration,
) -> Result<TcpStream> {
    let writer = record.writer;
    let timed_out = |doing: &str| Error::Timeout {
        what: format!("{what}: {doing}"),
        after: timeout,
        missing: vec![writer],
    };
    let mut last: Option<io::Error> = None;
    let mut attempt = 0usize;
    let mut stream = loop {
        if waiter.expired() {
            let doing = match &last {
                Some(e) => format!("connecting to writer rank {writer} at {addrs:?} (last error: {e})"),
                None => format!("connecting to writer rank {writer}"),
            };
            return Err(timed_out(&doing));
        }
        let addr = addrs[attempt % addrs.len()];
        attempt += 1;
        let limit = waiter.left().clamp(Duration::from_millis(1), CONNECT_ATTEMPT);
        match TcpStream::connect_timeout(&addr, limit) {
            Ok(s) => break s,
            Err(e) => last = Some(e),
        }
        if attempt % addrs.len() == 0 {
            // Every address failed: the writer may not listen yet.
            waiter.pause(|d| std::thread::sleep(d.min(Duration::from_millis(20))))?;
        }
    };
    let _ = stream.set_nodelay(true);
    let io_err = |doing: String, e| Error::io(format!("{what}: {doing} writer rank {writer}"), e);
    stream
        .set_write_timeout(Some(waiter.left().max(Duration::from_millis(1))))
        .map_err(|e| io_err("setting a write timeout toward".into(), e))?;
    stream
        .write_all(&hello(rank, &record.secret))
        .map_err(|e| io_err("greeting".into(), e))?;
    // The writer answers once every reader is in: up to the whole timeout.
    stream
        .set_read_timeout(Some(waiter.left().max(Duration::from_millis(1))))
        .map_err(|e| io_err("setting a read timeout toward".into(), e))?;
    let mut ready = [0u8; 1];
    match stream.read(&mut ready) {
        Ok(1) if ready[0] == READY => {}
        Ok(_) => {
            return Err(io_err(
                "setup: the connection closed before READY from".into(),
                io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "the writer refused this rank's hello or failed its setup (see its error)",
                ),
            ))
        }
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
            return Err(timed_out(&format!(
                "writer rank {writer} to see every reader connected"
            )))
        }
        Err(e) => return Err(io_err("setup: waiting for READY from".into(), e)),
    }
    stream
        .set_nonblocking(true)
        .map_err(|e| io_err("making nonblocking the connection to".into(), e))?;
    Ok(stream)
}
