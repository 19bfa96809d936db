//! Cryptographically random bytes from the kernel, for socket names and
//! secrets.

use std::io::{self, Read};

use crate::error::{Error, Result};

/// Cryptographically random bytes from the kernel.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
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

fn getrandom(buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the pointer and length describe `buf`, which is live and
    // writable for the whole call; getrandom writes at most `buf.len()` bytes.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}
