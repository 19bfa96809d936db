//! Launch shapes per kernel family. The algorithm, not the backend, knows how
//! much work a block should take; the backend only supplies the SM count.

use super::kernels::KernelKind;
use super::layout::MAX_BLOCKS;
use crate::device::{BackendKind, DeviceFacts, LaunchConfig};
use crate::error::{Error, Result};

/// Threads per block on GPUs (the kernels are compiled for at most this many).
pub const BLOCK_THREADS: u32 = 512;

/// Grid sizing for one device.
#[derive(Debug, Clone)]
pub struct GridTable {
    host: bool,
    /// Never more blocks than SMs: block `b` of one rank spins on block `b` of
    /// every peer, so all blocks of a launch must be resident at once.
    cap: u32,
    oneshot_bytes_per_block: usize,
    oneshot_max_blocks: u32,
    twoshot_bytes_per_block: usize,
    twoshot_max_blocks: u32,
}

fn env_blocks(name: &str) -> Result<Option<u32>> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&n| n >= 1 && n as usize <= MAX_BLOCKS)
            .map(Some)
            .ok_or_else(|| Error::invalid(format!("{name}={v:?} must be 1..={MAX_BLOCKS}"))),
        Err(_) => Ok(None),
    }
}

impl GridTable {
    /// Defaults measured on H200 (one-shot: ~4 KiB a block up to 64 blocks;
    /// two-shot: ~32 KiB a block up to 128), overridable with
    /// `FERROCOMM_ONESHOT_MAX_BLOCKS` / `FERROCOMM_TWOSHOT_MAX_BLOCKS`.
    pub fn new(facts: &DeviceFacts) -> Result<Self> {
        Ok(GridTable {
            host: facts.backend == BackendKind::Host,
            cap: (MAX_BLOCKS as u32).min(facts.multiprocessors).max(1),
            oneshot_bytes_per_block: 4 << 10,
            oneshot_max_blocks: env_blocks("FERROCOMM_ONESHOT_MAX_BLOCKS")?.unwrap_or(64),
            twoshot_bytes_per_block: 32 << 10,
            twoshot_max_blocks: env_blocks("FERROCOMM_TWOSHOT_MAX_BLOCKS")?.unwrap_or(128),
        })
    }

    pub fn grid(&self, kind: KernelKind, bytes: usize) -> LaunchConfig {
        if self.host {
            // A host kernel is one "block": the protocol with gridDim = 1.
            return LaunchConfig { grid: 1, block: 1 };
        }
        let (per_block, max) = match kind {
            KernelKind::OneShot | KernelKind::Broadcast => (self.oneshot_bytes_per_block, self.oneshot_max_blocks),
            KernelKind::TwoShot => (self.twoshot_bytes_per_block, self.twoshot_max_blocks),
        };
        let blocks = bytes.div_ceil(per_block).clamp(1, max.min(self.cap) as usize) as u32;
        LaunchConfig {
            grid: blocks,
            block: BLOCK_THREADS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(backend: BackendKind, sms: u32) -> DeviceFacts {
        DeviceFacts {
            backend,
            ordinal: 0,
            name: String::new(),
            arch: String::new(),
            multiprocessors: sms,
            warp_size: 32,
            total_memory: 0,
        }
    }

    #[test]
    fn grids_scale_with_bytes_and_stay_resident() {
        let t = GridTable::new(&facts(BackendKind::Cuda, 132)).unwrap();
        assert_eq!(t.grid(KernelKind::OneShot, 0).grid, 1);
        assert_eq!(t.grid(KernelKind::OneShot, 32 << 10).grid, 8);
        assert_eq!(t.grid(KernelKind::OneShot, 1 << 30).grid, 64);
        assert_eq!(t.grid(KernelKind::TwoShot, 1 << 30).grid, 128);
        let small = GridTable::new(&facts(BackendKind::Cuda, 78)).unwrap();
        assert_eq!(small.grid(KernelKind::TwoShot, 1 << 30).grid, 78);
        let host = GridTable::new(&facts(BackendKind::Host, 2)).unwrap();
        assert_eq!(
            host.grid(KernelKind::TwoShot, 1 << 30),
            LaunchConfig { grid: 1, block: 1 }
        );
    }
}
