//! The bytes of an exported GPU buffer: one versioned header for every
//! vendor and handle kind, then the vendor's handle. They travel through the
//! store (a file descriptor, when there is one, travels beside them), so a
//! peer's bytes are checked before anything is mapped.
//!
//! ```text
//!  0  magic "FCGH"          4  format version (u32)
//!  8  vendor (u8)           9  kind (u8)           10  flags (u16)
//! 12  exporting device (u32)
//! 16  bytes the importer maps (u64)
//! 24  exporter's address of them (u64)
//! 32  exporting process id (16 random bytes)
//! 48  payload length (u32) 52  reserved
//! 56  payload: the vendor handle (64 bytes for IPC handles, none for fds)
//! ```
//!
//! The process id lets a handle that comes back to the process that made it
//! (ranks as threads) be served without the vendor's open call, which both
//! vendors refuse in the exporting process.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use crate::device::BackendKind;
use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"FCGH";
pub const FORMAT_VERSION: u32 = 2;
const HEADER_BYTES: usize = 56;
pub const NONCE_BYTES: usize = 16;
/// Bytes of a vendor IPC handle (`CUipcMemHandle`, `hipIpcMemHandle_t`).
pub const IPC_HANDLE_BYTES: usize = 64;
/// Refuse to map anything larger than this from a peer's handle.
pub const MAX_IMPORT_BYTES: u64 = 1 << 40;
/// Flag: one of the exporter's own allocations (not caller memory).
const FLAG_OWN: u16 = 1;

/// Which vendor mechanism a handle uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandleKind {
    /// A cuMem VMM allocation exported as a POSIX file descriptor.
    VmmFd,
    /// A legacy `cuIpcGetMemHandle` handle (cuMemAlloc / cudaMalloc memory).
    CudaIpc,
    /// A `hipIpcGetMemHandle` handle.
    HipIpc,
}

impl HandleKind {
    fn code(self) -> u8 {
        match self {
            HandleKind::VmmFd => 1,
            HandleKind::CudaIpc => 2,
            HandleKind::HipIpc => 3,
        }
    }

    fn from_code(c: u8) -> Option<HandleKind> {
        match c {
            1 => Some(HandleKind::VmmFd),
            2 => Some(HandleKind::CudaIpc),
            3 => Some(HandleKind::HipIpc),
            _ => None,
        }
    }

    /// Bytes of vendor handle that follow the header.
    fn payload_bytes(self) -> usize {
        match self {
            HandleKind::VmmFd => 0,
            HandleKind::CudaIpc | HandleKind::HipIpc => IPC_HANDLE_BYTES,
        }
    }

    /// Whether the handle is an address the vendor opens (so that a copy
    /// coming back to its own process is served by address instead).
    pub fn is_address_based(self) -> bool {
        !matches!(self, HandleKind::VmmFd)
    }
}

fn vendor_code(b: BackendKind) -> u8 {
    match b {
        BackendKind::Host => 0,
        BackendKind::Cuda => 1,
        BackendKind::Hip => 2,
    }
}

/// A handle's fields, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedHandle {
    pub vendor: BackendKind,
    pub kind: HandleKind,
    /// One of the exporter's own allocations (else memory its caller allocated).
    pub own: bool,
    pub exporter: u32,
    /// Bytes the importer maps.
    pub alloc_size: u64,
    /// The exporter's address of them.
    pub base: u64,
    pub nonce: [u8; NONCE_BYTES],
    pub payload: Vec<u8>,
}

impl ParsedHandle {
    /// Whether this process made the handle.
    pub fn is_from_this_process(&self) -> bool {
        self.nonce == process_nonce()
    }
}

/// A random id for this process, in every handle it exports.
pub fn process_nonce() -> [u8; NONCE_BYTES] {
    static NONCE: OnceLock<[u8; NONCE_BYTES]> = OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut out = [0u8; NONCE_BYTES];
        for (i, chunk) in out.chunks_mut(8).enumerate() {
            // RandomState is seeded from the OS's random source.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.write_usize(i);
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            chunk.copy_from_slice(&h.finish().to_le_bytes());
        }
        out
    })
}

/// The bytes of a handle made by this process.
pub fn encode(
    vendor: BackendKind,
    kind: HandleKind,
    own: bool,
    exporter: usize,
    base: u64,
    alloc_size: u64,
    payload: &[u8],
) -> Vec<u8> {
    debug_assert_eq!(payload.len(), kind.payload_bytes());
    let mut b = Vec::with_capacity(HEADER_BYTES + payload.len());
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.push(vendor_code(vendor));
    b.push(kind.code());
    b.extend_from_slice(&(if own { FLAG_OWN } else { 0 }).to_le_bytes());
    b.extend_from_slice(&(exporter as u32).to_le_bytes());
    b.extend_from_slice(&alloc_size.to_le_bytes());
    b.extend_from_slice(&base.to_le_bytes());
    b.extend_from_slice(&process_nonce());
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(payload);
    b
}

/// Check and split a handle's bytes. `size` is the length the peer
/// exported; `vendor` is the importing backend.
pub fn decode(b: &[u8], size: usize, vendor: BackendKind) -> Result<ParsedHandle> {
    let bad = |why: String| Error::invalid(format!("{} IPC handle: {why}", vendor.name()));
    if b.len() < HEADER_BYTES || &b[..4] != MAGIC {
        return Err(bad("not a ferrocomm GPU handle (wrong magic or too short)".into()));
    }
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let u64_at = |o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    };
    let version = u32_at(4);
    if version != FORMAT_VERSION {
        return Err(bad(format!("format version {version}, expected {FORMAT_VERSION}")));
    }
    if b[8] != vendor_code(vendor) {
        return Err(bad(format!(
            "made by another backend (vendor code {}, expected {})",
            b[8],
            vendor_code(vendor)
        )));
    }
    let kind = HandleKind::from_code(b[9]).ok_or_else(|| bad(format!("unknown handle kind {}", b[9])))?;
    let flags = u16::from_le_bytes([b[10], b[11]]);
    let payload_len = u32_at(48) as usize;
    if payload_len != kind.payload_bytes() || b.len() != HEADER_BYTES + payload_len {
        return Err(bad(format!(
            "{kind:?} handle of {} bytes with a payload of {payload_len}",
            b.len()
        )));
    }
    let alloc_size = u64_at(16);
    if alloc_size == 0 || alloc_size > MAX_IMPORT_BYTES || size as u64 > alloc_size {
        return Err(bad(format!(
            "allocation of {alloc_size} bytes cannot hold {size} bytes"
        )));
    }
    let mut nonce = [0u8; NONCE_BYTES];
    nonce.copy_from_slice(&b[32..32 + NONCE_BYTES]);
    Ok(ParsedHandle {
        vendor,
        kind,
        own: flags & FLAG_OWN != 0,
        exporter: u32_at(12),
        alloc_size,
        base: u64_at(24),
        nonce,
        payload: b[HEADER_BYTES..].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(kind: HandleKind) -> Vec<u8> {
        let payload: Vec<u8> = (0..kind.payload_bytes()).map(|i| i as u8).collect();
        encode(BackendKind::Hip, kind, true, 3, 0xdead_0000, 4 << 20, &payload)
    }

    #[test]
    fn handles_round_trip() {
        let b = sample(HandleKind::HipIpc);
        assert_eq!(b.len(), HEADER_BYTES + IPC_HANDLE_BYTES);
        let h = decode(&b, 1000, BackendKind::Hip).unwrap();
        assert_eq!(h.kind, HandleKind::HipIpc);
        assert!(h.own && h.is_from_this_process());
        assert_eq!((h.exporter, h.base, h.alloc_size), (3, 0xdead_0000, 4 << 20));
        assert_eq!(h.payload[63], 63);
        let fd = encode(BackendKind::Cuda, HandleKind::VmmFd, false, 0, 0x1000, 2 << 20, &[]);
        let h = decode(&fd, 2 << 20, BackendKind::Cuda).unwrap();
        assert_eq!(h.kind, HandleKind::VmmFd);
        assert!(!h.own && h.payload.is_empty());
        assert!(!HandleKind::VmmFd.is_address_based());
        assert!(HandleKind::CudaIpc.is_address_based());
    }

    #[test]
    fn bad_handles_are_refused() {
        let b = sample(HandleKind::HipIpc);
        assert!(
            decode(&b, (4 << 20) + 1, BackendKind::Hip).is_err(),
            "larger than the allocation"
        );
        assert!(decode(&b[..100], 10, BackendKind::Hip).is_err(), "truncated");
        assert!(decode(&b, 10, BackendKind::Cuda).is_err(), "another vendor's");
        let mut wrong = b.clone();
        wrong[0] = b'X';
        assert!(decode(&wrong, 10, BackendKind::Hip).is_err());
        let mut v1 = b.clone();
        v1[4] = 1;
        assert!(decode(&v1, 10, BackendKind::Hip)
            .unwrap_err()
            .to_string()
            .contains("version 1"));
        let mut kind = b.clone();
        kind[9] = 9;
        assert!(decode(&kind, 10, BackendKind::Hip).is_err());
        let mut fd_kind = b.clone();
        fd_kind[9] = 1; // a VMM fd handle carries no payload
        assert!(decode(&fd_kind, 10, BackendKind::Hip).is_err());
        let huge = encode(
            BackendKind::Hip,
            HandleKind::HipIpc,
            true,
            0,
            0,
            MAX_IMPORT_BYTES + 1,
            &[0; 64],
        );
        assert!(decode(&huge, 0, BackendKind::Hip).is_err());
        let empty = encode(BackendKind::Hip, HandleKind::HipIpc, true, 0, 0, 0, &[0; 64]);
        assert!(decode(&empty, 0, BackendKind::Hip).is_err());
        assert!(decode(&[1, 2, 3], 1, BackendKind::Cuda).is_err());
    }

    #[test]
    fn the_process_nonce_is_stable_and_not_trivial() {
        assert_eq!(process_nonce(), process_nonce());
        assert_ne!(process_nonce(), [0; NONCE_BYTES]);
    }
}
