//! The system calls on the Unix socket: waiting for a connection, bounding
//! reads and writes, and sending and receiving descriptors as `SCM_RIGHTS`.
//! Thin wrappers over libc; raw pointers do not leave these functions.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// The most descriptors one rank may offer: the kernel's per-message limit
/// (`SCM_MAX_FD`). All of a rank's descriptors travel in a single message.
pub const MAX_FDS: usize = 253;

/// Bounds every read and write on `stream` by `limit`.
pub(super) fn bound_timeouts(stream: &UnixStream, limit: Duration) -> io::Result<()> {
    // std rejects a zero timeout; round up to the smallest useful one.
    let limit = limit.max(Duration::from_millis(1));
    stream.set_read_timeout(Some(limit))?;
    stream.set_write_timeout(Some(limit))
}

/// Waits up to `timeout` for `fd` to become readable (for a listener: for a
/// pending connection). A signal counts as "not yet".
pub(super) fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
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
pub(super) fn send_all(sock: BorrowedFd<'_>, mut data: &[u8], mut fds: &[BorrowedFd<'_>]) -> io::Result<()> {
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
pub(super) struct Received {
    pub(super) len: usize,
    pub(super) fds: Vec<OwnedFd>,
    /// The kernel had more control data than fit (it closed the excess fds).
    pub(super) truncated: bool,
}

/// One `recvmsg` into `buf`, accepting up to `max_fds` descriptors, which
/// arrive close-on-exec and are owned before this returns.
pub(super) fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8], max_fds: usize) -> io::Result<Received> {
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
