//! Launch shapes per kernel family. The algorithm, not the backend, knows how
//! much work a block should take; the backend only supplies the SM count.

use super::kernels::KernelKind;
use super::layout::MAX_BLOCKS;
use crate::device::{BackendKind, DeviceFacts, LaunchConfig};
use crate::error::{Error, Result};

/// Threads per block on GPUs (the kernels are compiled for at most this many).
pub const BLOCK_THREADS: u32 = 512;

/// How one kernel family sizes its grid: one block up to `solo_bytes` of
/// payload, else about `bytes_per_block` a block, at most `max_blocks` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridRule {
    pub bytes_per_block: usize,
    pub max_blocks: u32,
    pub solo_bytes: usize,
}

/// Grid sizing for one device.
#[derive(Debug, Clone)]
pub struct GridTable {
    host: bool,
    /// Never more blocks than SMs: block `b` of one rank spins on block `b` of
    /// every peer, so all blocks of a launch must be resident at once.
    cap: u32,
    /// Indexed like [`KernelKind::ALL`].
    rules: [GridRule; KernelKind::ALL.len()],
    /// Quick-reduce's largest chunk, in encoded bytes of all its segments
    /// (`FERROCOMM_QUICK_REDUCE_CHUNK_BYTES`).
    qr_chunk_bytes: usize,
}

/// Quick-reduce's default largest chunk, encoded: 18 MiB, i.e. 64 MiB of
/// bf16 input in INT4, 34 MiB in INT8/FP8. On 2x H200 (bf16, graph replay)
/// capping the input at 16-32 MiB took INT8 from 341 to 306 us at 128 MiB,
/// while INT4 was best with 64 MiB chunks (573 vs 592 us at 256 MiB): what
/// matters is the encoded size, which must stay well inside the 50 MiB L2.
pub const QR_CHUNK_BYTES: usize = 18 << 20;

fn env_usize(name: &str, min: usize, max: usize) -> Result<Option<usize>> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= min && n <= max)
            .map(Some)
            .ok_or_else(|| Error::invalid(format!("{name}={v:?} must be {min}..={max}"))),
        Err(_) => Ok(None),
    }
}

/// The environment prefix of a kind's knobs: `FERROCOMM_<PREFIX>_MAX_BLOCKS`
/// and `FERROCOMM_<PREFIX>_BLOCK_BYTES`.
fn env_prefix(kind: KernelKind) -> &'static str {
    match kind {
        KernelKind::OneShot | KernelKind::Broadcast => "ONESHOT",
        KernelKind::TwoShot => "TWOSHOT",
        KernelKind::OneShotPush => "ONESHOT_PUSH",
        KernelKind::OneShotLl => "ONESHOT_LL",
        KernelKind::TwoShotPush => "TWOSHOT_PUSH",
        KernelKind::QuickReduce => "QUICK_REDUCE",
        KernelKind::Exchange | KernelKind::ExchangeDirect => "EXCHANGE",
        KernelKind::ReduceTo | KernelKind::ReduceToDirect => "REDUCE_TO",
        KernelKind::ExchangeLl | KernelKind::ReduceToLl => "COLL_LL",
        KernelKind::SendRecv => "SENDRECV",
        KernelKind::Copy => "COPY",
    }
}

/// Defaults measured on 4x H200 (see the numbers in `GridTable::new`).
fn default_rule(kind: KernelKind) -> GridRule {
    let (bytes_per_block, max_blocks, solo_bytes) = match kind {
        // Pull one-shot: ~4 KiB a block up to 64 blocks.
        KernelKind::OneShot | KernelKind::Broadcast => (4 << 10, 64, 0),
        // Pull two-shot: ~32 KiB a block up to 128.
        KernelKind::TwoShot => (32 << 10, 128, 0),
        // Push one-shot: 64 blocks of ~8 KiB; 128 blocks measured no better
        // where it is dispatched (w4 256 KiB 8.57 vs 8.54 us).
        KernelKind::OneShotPush => (8 << 10, 64, 0),
        // LL, w4 graph replay: 1 KiB blocks beat 4 KiB ones from 8 KiB up
        // (8 KiB 4.75 vs 5.08 us, 64 KiB 5.64 vs 5.91), but one block is best
        // up to 4 KiB (2 KiB: 4.04 us in one block, 4.59 in two).
        KernelKind::OneShotLl => (1 << 10, 64, 4 << 10),
        // The exchange and reduce-to on LL lines, by the per-peer block: as
        // the LL all-reduce, whose lines from each source they share (not
        // measured for these kernels yet, TODO(measure) on 2 GPUs).
        KernelKind::ExchangeLl | KernelKind::ReduceToLl => (1 << 10, 64, 4 << 10),
        // Push two-shot: ~16 KiB a block up to 128 (16 vs 32 KiB, graph
        // replay: w2 256 KiB 9.44 vs 10.43 us, 1 MiB 11.28 vs 11.47; w4 1 MiB
        // 14.12 vs 14.23; equal from 2 MiB up, where 128 blocks are reached).
        KernelKind::TwoShotPush => (16 << 10, 128, 0),
        // Quick-reduce: as the push two-shot (dispatch takes it from 4 MiB
        // up, where that means 128 blocks).
        KernelKind::QuickReduce => (16 << 10, 128, 0),
        // Exchange and reduce-to (GPU kernels since issue 11; send/recv has
        // none yet): as the push two-shot, by the per-peer block. Not
        // measured for these kernels yet (TODO(measure)); the grid must be
        // the same on every rank (`CollectiveCall::enqueue`).
        KernelKind::Exchange
        | KernelKind::ExchangeDirect
        | KernelKind::ReduceTo
        | KernelKind::ReduceToDirect
        | KernelKind::SendRecv => (16 << 10, 128, 0),
        // The copy route's handshake moves no data: one block whatever the
        // size (`algo::copy` launches it so, never through this table).
        KernelKind::Copy => (usize::MAX, 1, 0),
    };
    GridRule {
        bytes_per_block,
        max_blocks,
        solo_bytes,
    }
}

impl GridTable {
    /// Defaults per kind (see [`default_rule`]), each overridable with
    /// `FERROCOMM_<KIND>_MAX_BLOCKS` (1..=128) and `FERROCOMM_<KIND>_BLOCK_BYTES`,
    /// `<KIND>` one of ONESHOT, TWOSHOT, ONESHOT_PUSH, ONESHOT_LL, TWOSHOT_PUSH,
    /// QUICK_REDUCE, EXCHANGE, REDUCE_TO, COLL_LL (every rank must set the same).
    pub fn new(facts: &DeviceFacts) -> Result<Self> {
        let mut rules = [default_rule(KernelKind::OneShot); KernelKind::ALL.len()];
        for (rule, kind) in rules.iter_mut().zip(KernelKind::ALL) {
            let prefix = env_prefix(kind);
            *rule = default_rule(kind);
            if let Some(n) = env_usize(&format!("FERROCOMM_{prefix}_MAX_BLOCKS"), 1, MAX_BLOCKS)? {
                rule.max_blocks = n as u32;
            }
            if let Some(n) = env_usize(&format!("FERROCOMM_{prefix}_BLOCK_BYTES"), 16, 1 << 30)? {
                rule.bytes_per_block = n;
            }
        }
        let qr_chunk_bytes =
            env_usize("FERROCOMM_QUICK_REDUCE_CHUNK_BYTES", 1 << 16, 1 << 40)?.unwrap_or(QR_CHUNK_BYTES);
        Ok(GridTable {
            host: facts.backend == BackendKind::Host,
            cap: (MAX_BLOCKS as u32).min(facts.multiprocessors).max(1),
            rules,
            qr_chunk_bytes,
        })
    }

    /// Blocks that stay resident together: one a multiprocessor, at most
    /// `MAX_BLOCKS` (1 on the host).
    pub fn resident_blocks(&self) -> u32 {
        if self.host {
            1
        } else {
            self.cap
        }
    }

    /// Quick-reduce's largest chunk, in encoded bytes.
    pub fn qr_chunk_bytes(&self) -> usize {
        self.qr_chunk_bytes
    }

    pub fn rule(&self, kind: KernelKind) -> GridRule {
        let i = KernelKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
        self.rules[i]
    }

    pub fn grid(&self, kind: KernelKind, bytes: usize) -> LaunchConfig {
        if self.host {
            // A host kernel is one "block": the protocol with gridDim = 1.
            return LaunchConfig::new(1, 1);
        }
        let rule = self.rule(kind);
        if bytes <= rule.solo_bytes {
            return LaunchConfig::new(1, BLOCK_THREADS);
        }
        let blocks = bytes
            .div_ceil(rule.bytes_per_block)
            .clamp(1, rule.max_blocks.min(self.cap) as usize) as u32;
        LaunchConfig::new(blocks, BLOCK_THREADS)
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
        for kind in KernelKind::ALL {
            assert!(t.grid(kind, 1 << 30).grid <= 128);
            assert_eq!(t.grid(kind, 1).grid, 1);
        }
        let small = GridTable::new(&facts(BackendKind::Cuda, 78)).unwrap();
        assert_eq!(small.grid(KernelKind::TwoShot, 1 << 30).grid, 78);
        let host = GridTable::new(&facts(BackendKind::Host, 2)).unwrap();
        assert_eq!(host.grid(KernelKind::TwoShot, 1 << 30), LaunchConfig::new(1, 1));
    }
}
