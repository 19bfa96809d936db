//! What travels between ranks: the record each rank publishes in the store
//! (where its listener is and the secret it expects) and the hello a
//! connector sends on the socket.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr;

use super::random::random_bytes;
use crate::error::{Error, Result};

/// Abstract socket names are this prefix plus 16 random bytes in hex.
pub(super) const NAME_PREFIX: &[u8] = b"ferrocomm-";
const NAME_RANDOM_BYTES: usize = 16;
const NAME_LEN: usize = NAME_PREFIX.len() + 2 * NAME_RANDOM_BYTES;
pub(super) const SECRET_LEN: usize = 32;

/// Store record: magic, socket name, secret. Fixed size, no parsing freedom.
pub(super) const RECORD_MAGIC: &[u8; 4] = b"FDX1";
const RECORD_LEN: usize = RECORD_MAGIC.len() + NAME_LEN + SECRET_LEN;

/// What a connector sends: its rank (`u32`, little endian), then the secret.
pub(super) const HELLO_LEN: usize = 4 + SECRET_LEN;

/// Where to find a rank's listener and the secret it expects.
pub(super) struct Record {
    /// Abstract socket name, without the leading NUL.
    pub(super) name: [u8; NAME_LEN],
    pub(super) secret: [u8; SECRET_LEN],
}

impl Record {
    /// A fresh random name and secret.
    pub(super) fn generate() -> Result<Self> {
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

    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(RECORD_LEN);
        out.extend_from_slice(RECORD_MAGIC);
        out.extend_from_slice(&self.name);
        out.extend_from_slice(&self.secret);
        out
    }

    /// Parses a record, refusing anything but the exact layout `encode` writes.
    pub(super) fn decode(bytes: &[u8]) -> Option<Self> {
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
    pub(super) fn address(&self) -> Result<SocketAddr> {
        SocketAddr::from_abstract_name(self.name).map_err(|e| Error::io("building the fd-exchange socket address", e))
    }
}

pub(super) fn record_key(key_prefix: &str, rank: usize) -> String {
    format!("{key_prefix}/fdx/{rank}")
}

fn hex_pair(byte: u8) -> [u8; 2] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    [DIGITS[usize::from(byte >> 4)], DIGITS[usize::from(byte & 0xf)]]
}
