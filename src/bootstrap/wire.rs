//! Deadline-bounded reads shared by the ferrocomm store protocol and the
//! torch store client.

use std::io::{self, ErrorKind, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Reads against one deadline for a whole frame, so a peer that drips a
/// byte at a time cannot stretch a per-read timeout forever.
pub(crate) struct Deadlined<'a> {
    stream: &'a mut TcpStream,
    deadline: Option<Instant>,
}

impl Deadlined<'_> {
    pub(crate) fn new(stream: &mut TcpStream, within: Duration) -> Deadlined<'_> {
        Deadlined {
            stream,
            deadline: Instant::now().checked_add(within),
        }
    }

    pub(crate) fn read_exact(&mut self, mut buf: &mut [u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let left = match self.deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ErrorKind::TimedOut.into());
                    }
                    Some(left)
                }
            };
            self.stream.set_read_timeout(left)?;
            match self.stream.read(buf) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Linux reports an expired SO_RCVTIMEO as WouldBlock.
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Err(ErrorKind::TimedOut.into()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    pub(crate) fn array<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.read_exact(&mut b)?;
        Ok(b)
    }

    pub(crate) fn u8(&mut self) -> io::Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    pub(crate) fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub(crate) fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub(crate) fn i64(&mut self) -> io::Result<i64> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// `len` bytes, refused before allocating when `len > max`, so a forged
    /// length cannot exhaust memory.
    pub(crate) fn bytes_of_len(&mut self, len: u64, max: usize) -> io::Result<Vec<u8>> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= max)
            .ok_or_else(|| invalid_data("length over the limit"))?;
        let mut buf = vec![0u8; len];
        self.read_exact(&mut buf)?;
        Ok(buf)
    }

    /// A little-endian `u32` length then that many bytes (ferrocomm framing).
    pub(crate) fn bytes(&mut self, max: usize) -> io::Result<Vec<u8>> {
        let len = self.u32()?;
        self.bytes_of_len(u64::from(len), max)
    }
}

pub(crate) fn invalid_data(msg: &str) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, msg)
}
