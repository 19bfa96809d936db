//! The ferrocomm store's wire protocol, version 2 (all integers little-endian,
//! no self-describing encoding):
//!
//! * handshake, client → server: `b"FCST"`, version `u8`, token length `u16`,
//!   token. The server compares the token in constant time and answers one
//!   status byte:
//!   - `OK`, then `max_key_bytes u32`, `max_value_bytes u32`,
//!     `idle_timeout_ms u64`, so the client can refuse oversize requests itself
//!     and retire pooled connections before the server idles them out;
//!   - `DENIED`: wrong token (saying so reveals nothing secret);
//!   - `BUSY`: the server holds `max_connections` authenticated connections, or
//!     dropped this handshake to make room for a newer one; retry later;
//!   - `TIMEOUT`: the hello did not arrive within `handshake_timeout`;
//!   - `ERROR` + length `u32` + UTF-8 message: e.g. a protocol version the
//!     server does not speak.
//!
//!   then closes the connection unless the status was `OK`. A hello with the
//!   wrong magic is closed without a word (it is not a ferrocomm client).
//! * request: op `u8`, key length `u32`, key (UTF-8), value length `u32`,
//!   value (empty except for SET), then for GET the wait in ms `u64`, for ADD
//!   the delta `i64`.
//! * response: status `u8`, then for `OK`: GET → length `u32` + value,
//!   ADD → `i64`, CHECK/DELETE → `u8` (0/1), SET → nothing; `TIMEOUT` → nothing;
//!   `ERROR` → length `u32` + UTF-8 message.
//!
//! A malformed frame (unknown op, a length over the caps, a non-UTF-8 key, a
//! frame not completed within `io_timeout`) closes that connection only.
//! The encoders below are the ones both sides share.

use std::time::Duration;

pub(in crate::bootstrap) const MAGIC: &[u8; 4] = b"FCST";
/// Version 2 added the BUSY and DENIED handshake answers.
pub(in crate::bootstrap) const VERSION: u8 = 2;

pub(super) const OP_SET: u8 = 1;
pub(super) const OP_GET: u8 = 2;
pub(super) const OP_ADD: u8 = 3;
pub(super) const OP_CHECK: u8 = 4;
pub(super) const OP_DELETE: u8 = 5;

pub(super) const ST_OK: u8 = 0;
/// A GET's wait ran out; in the handshake, the hello came too late.
pub(in crate::bootstrap) const ST_TIMEOUT: u8 = 1;
pub(super) const ST_ERROR: u8 = 2;
/// Handshake only: no room now, retry later.
pub(in crate::bootstrap) const ST_BUSY: u8 = 3;
/// Handshake only: the token does not match.
pub(in crate::bootstrap) const ST_DENIED: u8 = 4;

/// A `u32` length, then the bytes.
pub(super) fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // Callers check lengths against the caps (all far below u32::MAX) first.
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Equality whose running time does not depend on where the inputs differ.
pub(in crate::bootstrap) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    std::hint::black_box(diff) == 0
}

/// The handshake's `ERROR` answer to a client speaking another version.
pub(in crate::bootstrap) fn version_mismatch_reply(version: u8) -> Vec<u8> {
    let mut reply = vec![ST_ERROR];
    let msg = format!("protocol version {version} not supported; server speaks {VERSION}");
    put_bytes(&mut reply, msg.as_bytes());
    reply
}

/// A request up to its op's own tail: op, key, value.
pub(super) fn frame(op: u8, key: &str, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(17 + key.len() + value.len());
    out.push(op);
    put_bytes(&mut out, key.as_bytes());
    put_bytes(&mut out, value);
    out
}

/// A duration in whole milliseconds, as the wire carries it.
pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
