//! Who may take part: the kernel's record of the uid at the other end of a
//! socket, and comparing secrets without leaking where they differ.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Compares two secrets in time independent of where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Keep the optimiser from turning the fold into an early-exit compare.
    std::hint::black_box(diff) == 0
}

pub(super) fn effective_uid() -> libc::uid_t {
    // SAFETY: geteuid takes no arguments, touches no memory of ours and
    // cannot fail.
    unsafe { libc::geteuid() }
}

/// The uid of the process at the other end of a connected Unix socket, as the
/// kernel recorded it at connect/listen time (it cannot be forged).
pub(super) fn peer_uid(sock: BorrowedFd<'_>) -> io::Result<libc::uid_t> {
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
