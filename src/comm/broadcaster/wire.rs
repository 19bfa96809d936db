//! What travels during setup: the writer's record in the store (where its
//! listener is, the secret it expects, the ring's shape) and a reader's
//! hello on the socket. The store carries only these small records, never
//! messages.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub(super) const SECRET_LEN: usize = 32;
const RECORD_MAGIC: &[u8; 4] = b"FCBW";
const HELLO_MAGIC: &[u8; 4] = b"FCBH";
const VERSION: u8 = 1;
/// At most this many addresses are published (interfaces beyond are rare).
pub(super) const MAX_ADDRS: usize = 16;

/// What a reader sends first: magic, version, its rank (u32), the secret.
pub(super) const HELLO_LEN: usize = 4 + 1 + 4 + SECRET_LEN;
/// The writer's answer once every reader is connected.
pub(super) const READY: u8 = 0xB1;

/// The writer's record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Record {
    pub(super) writer: usize,
    pub(super) slots: usize,
    pub(super) slot_bytes: usize,
    pub(super) port: u16,
    pub(super) secret: [u8; SECRET_LEN],
    /// Where readers on other hosts may reach the listener (readers on the
    /// writer's host use loopback).
    pub(super) addrs: Vec<IpAddr>,
}

impl Record {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + 17 * self.addrs.len());
        out.extend_from_slice(RECORD_MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&(self.writer as u32).to_le_bytes());
        out.extend_from_slice(&(self.slots as u32).to_le_bytes());
        out.extend_from_slice(&(self.slot_bytes as u64).to_le_bytes());
        out.extend_from_slice(&self.port.to_le_bytes());
        out.extend_from_slice(&self.secret);
        let addrs = &self.addrs[..self.addrs.len().min(MAX_ADDRS)];
        out.push(addrs.len() as u8);
        for a in addrs {
            match a {
                IpAddr::V4(v4) => {
                    out.push(4);
                    out.extend_from_slice(&v4.octets());
                }
                IpAddr::V6(v6) => {
                    out.push(6);
                    out.extend_from_slice(&v6.octets());
                }
            }
        }
        out
    }

    /// Parse a record, refusing anything `encode` would not write.
    pub(super) fn decode(bytes: &[u8]) -> Option<Record> {
        let mut r = Cursor(bytes);
        if r.take(4)? != RECORD_MAGIC || r.u8()? != VERSION {
            return None;
        }
        let writer = r.u32()? as usize;
        let slots = r.u32()? as usize;
        let slot_bytes = usize::try_from(r.u64()?).ok()?;
        let port = u16::from_le_bytes(r.take(2)?.try_into().ok()?);
        let secret: [u8; SECRET_LEN] = r.take(SECRET_LEN)?.try_into().ok()?;
        let n = usize::from(r.u8()?);
        if n > MAX_ADDRS {
            return None;
        }
        let mut addrs = Vec::with_capacity(n);
        for _ in 0..n {
            addrs.push(match r.u8()? {
                4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(r.take(4)?).ok()?)),
                6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(r.take(16)?).ok()?)),
                _ => return None,
            });
        }
        if !r.0.is_empty() {
            return None;
        }
        Some(Record {
            writer,
            slots,
            slot_bytes,
            port,
            secret,
            addrs,
        })
    }
}

/// A reader's hello.
pub(super) fn hello(rank: usize, secret: &[u8; SECRET_LEN]) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..4].copy_from_slice(HELLO_MAGIC);
    h[4] = VERSION;
    h[5..9].copy_from_slice(&(rank as u32).to_le_bytes());
    h[9..].copy_from_slice(secret);
    h
}

/// The rank a hello claims and the secret it presents, if it is a hello
/// of this version at all.
pub(super) fn parse_hello(h: &[u8; HELLO_LEN]) -> Option<(usize, &[u8])> {
    if &h[..4] != HELLO_MAGIC || h[4] != VERSION {
        return None;
    }
    let rank = u32::from_le_bytes(h[5..9].try_into().ok()?) as usize;
    Some((rank, &h[9..]))
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let r = Record {
            writer: 3,
            slots: 8,
            slot_bytes: 4096,
            port: 40123,
            secret: [7; SECRET_LEN],
            addrs: vec!["10.1.2.3".parse().unwrap(), "fd00::1".parse().unwrap()],
        };
        let bytes = r.encode();
        assert_eq!(Record::decode(&bytes), Some(r.clone()));
        assert_eq!(Record::decode(&bytes[..bytes.len() - 1]), None);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Record::decode(&longer), None);
        let mut bad = bytes;
        bad[0] ^= 1;
        assert_eq!(Record::decode(&bad), None);
    }

    #[test]
    fn hellos_carry_rank_and_secret() {
        let h = hello(5, &[9; SECRET_LEN]);
        let (rank, secret) = parse_hello(&h).unwrap();
        assert_eq!(rank, 5);
        assert_eq!(secret, &[9; SECRET_LEN]);
        let mut bad = h;
        bad[4] = 99;
        assert!(parse_hello(&bad).is_none());
    }
}
