//! The metadata broadcaster's checked messages, shared by its thread tests
//! (`tests/broadcaster_host.rs`) and the worker's process scenarios.

use crate::comm::Broadcaster;
use crate::error::{Error, Result};

/// Message `m` of `len` bytes: every byte depends on both, so a message
/// delivered out of order or truncated is caught.
pub fn message(m: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(131) ^ m.wrapping_mul(7919)) as u8)
        .collect()
}

/// Send message `m` of `len` bytes (writer), or receive it into `got` and
/// check every byte (readers).
pub fn step(bc: &mut Broadcaster, m: usize, len: usize, got: &mut Vec<u8>) -> Result<()> {
    if bc.is_writer() {
        return bc.send(&message(m, len), None);
    }
    bc.recv_into(got, None)?;
    if *got != message(m, len) {
        return Err(Error::Aborted(format!(
            "rank {}: message #{m} ({len} bytes) arrived as {} different bytes",
            bc.rank(),
            got.len()
        )));
    }
    Ok(())
}
