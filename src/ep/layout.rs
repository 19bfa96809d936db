//! Where an EP buffer's regions sit inside its one symmetric heap allocation.
//!
//! Every rank allocates the same [`EpLayout::total`] bytes in the same order,
//! so each region has the same offset on every rank: a kernel names its own
//! address of a region and the device API adds the peer's base. Regions are
//! `REGION_ALIGN`-aligned, so 16-byte copies apply wherever the row sizes
//! allow them.
//!
//! ```text
//! flags         u64 [2 * MAX_RANKS + 3 + MAX_RANKS * MAX_BLOCKS]
//!                                             [r] plain combine flag of rank r, [8] this rank's
//!                                             epoch, [9 + s] recv_counts[s] as the last
//!                                             dispatch saw it, [17] plain combines so far (all
//!                                             local from 8 to 17), [18 + s * 128 + b] block b
//!                                             of source s's last dispatch (its epoch), [1042]
//!                                             (local) sum units the one-kernel combine took
//! recv_counts   i32 [MAX_RANKS]               rows received from each source
//! send_counts   i32 [MAX_RANKS]               (local) tokens this rank sends to each rank
//! recv_x        [world][max][row_bytes]       bf16 or fp8 rows, by source, in source order
//! recv_scales   f32 [world][max][hidden/128]  (fp8 only)
//! recv_idx      i32 [world][max][topk]        local expert ids, -1 for other ranks' experts
//! recv_weights  f32 [world][max][topk]        router weights, 0 where the id is -1
//! recv_src      i32 [world][max]              the token's index at its source
//! inbox         bf16 [world][max][hidden]     combine: rows sent back by each expert rank,
//!                                             at the token's own index, as Lamport packs
//!                                             (all 0xff between calls)
//! slots         i32 [max][MAX_RANKS]          (local) token t's row at rank r, -1: not sent
//! ```

use crate::algo::layout::MAX_BLOCKS;
use crate::device::MAX_RANKS;
use crate::error::{Error, Result};

use super::{EpConfig, EpPayload};

/// Alignment of every region inside the allocation.
pub(crate) const REGION_ALIGN: usize = 256;
/// Channels that share one fp8 scale.
pub const SCALE_BLOCK: usize = 128;

/// Flag words: rank `r`'s plain combine flag is `FLAG_COMBINE + r`.
pub(crate) const FLAG_COMBINE: usize = 0;
/// Flag words: this rank's dispatch count (its epoch), local.
pub(crate) const FLAG_EPOCH: usize = MAX_RANKS;
/// Flag words: `recv_counts[s]` as this rank's last dispatch saw it once
/// every source had signalled (`FLAG_SEEN + s`), local. The combine counts
/// rows from it, not from `recv_counts`, which the caller holds a view of.
pub(crate) const FLAG_SEEN: usize = FLAG_EPOCH + 1;
/// Flag words: this rank's plain (two-kernel) combines so far, local; the
/// target of their flag waits.
pub(crate) const FLAG_PLAIN: usize = FLAG_SEEN + MAX_RANKS;
/// Flag words: block `b` of source `s`'s last dispatch that landed here is
/// `FLAG_DISPATCH + s * MAX_BLOCKS + b`: a word a block, set, not one word a
/// source that every block adds to. Its value is that dispatch's epoch
/// shifted left by [`COUNT_BITS`]; block 0's also carries, in the low bits,
/// the rows the source sent this rank.
pub(crate) const FLAG_DISPATCH: usize = FLAG_PLAIN + 1;
/// Low bits of a dispatch flag word that hold a row count: rows a source
/// sends a rank stay below `2^COUNT_BITS` (the config's check), and epochs
/// below `2^44` (years of back-to-back dispatches).
pub(crate) const COUNT_BITS: u32 = 20;
/// Flag words: in its low 32 bits, the sum units this rank's one-kernel
/// combine has taken (from 2048 tokens a rank up to world 4, its summing
/// warps take units from this counter); local, zeroed by every dispatch.
pub(crate) const FLAG_TAKEN: usize = FLAG_DISPATCH + MAX_RANKS * MAX_BLOCKS;
/// Bytes of the flag words.
pub(crate) const FLAGS_BYTES: usize = 8 * (FLAG_TAKEN + 1);

/// Byte offsets of the regions (see the module docs) and the sizes they derive from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpLayout {
    /// Ranks of the buffer.
    pub world: usize,
    /// Channels per token ([`EpConfig::hidden`]).
    pub hidden: usize,
    /// Rows per source ([`EpConfig::max_tokens_per_rank`]).
    pub max_tokens: usize,
    /// Experts per token ([`EpConfig::topk`]).
    pub topk: usize,
    /// Bytes of one dispatched row: `hidden * 2` (bf16) or `hidden` (fp8).
    pub row_bytes: usize,
    /// f32 scales per row: `hidden / 128` (fp8), else 0.
    pub scale_cols: usize,
    /// Offset of the flag words (the protocol's epochs, counts and signals).
    pub flags: usize,
    /// Offset of the rows received from each source (`i32 [MAX_RANKS]`).
    pub recv_counts: usize,
    /// Offset of the tokens this rank sends each rank (`i32 [MAX_RANKS]`, local).
    pub send_counts: usize,
    /// Offset of the received rows (`[world][max_tokens][row_bytes]`).
    pub recv_x: usize,
    /// Offset of the received fp8 scales (`f32 [world][max_tokens][scale_cols]`).
    pub recv_scales: usize,
    /// Offset of the received local expert ids (`i32 [world][max_tokens][topk]`).
    pub recv_idx: usize,
    /// Offset of the received router weights (`f32 [world][max_tokens][topk]`).
    pub recv_weights: usize,
    /// Offset of each received row's token index at its source (`i32 [world][max_tokens]`).
    pub recv_src: usize,
    /// Offset of the combine's inbox (`bf16 [world][max_tokens][hidden]`).
    pub inbox: usize,
    /// Bytes of the inbox region.
    pub inbox_bytes: usize,
    /// Offset of each token's row at each rank (`i32 [max_tokens][MAX_RANKS]`, local).
    pub slots: usize,
    /// Bytes of the whole allocation.
    pub total: usize,
}

fn too_large(cfg: &EpConfig, world: usize) -> Error {
    Error::invalid(format!(
        "EP buffer: {cfg:?} at world {world} needs more bytes than an address holds"
    ))
}

impl EpLayout {
    /// The layout of `cfg` over `world` ranks (the config is checked by the caller).
    pub fn new(cfg: &EpConfig, world: usize) -> Result<EpLayout> {
        let err = || too_large(cfg, world);
        let row_bytes = match cfg.payload {
            EpPayload::Bf16 => cfg.hidden.checked_mul(2).ok_or_else(err)?,
            EpPayload::Fp8 => cfg.hidden,
        };
        let scale_cols = match cfg.payload {
            EpPayload::Bf16 => 0,
            EpPayload::Fp8 => cfg.hidden / SCALE_BLOCK,
        };
        let rows = world.checked_mul(cfg.max_tokens_per_rank).ok_or_else(err)?;
        let mut at = 0usize;
        let mut region = |bytes: Option<usize>| -> Result<usize> {
            let start = at;
            let bytes = bytes.ok_or_else(err)?;
            at = start
                .checked_add(bytes)
                .and_then(|e| e.checked_next_multiple_of(REGION_ALIGN))
                .ok_or_else(err)?;
            Ok(start)
        };
        let per_row = |b: usize| rows.checked_mul(b);
        let flags = region(Some(FLAGS_BYTES))?;
        let recv_counts = region(Some(4 * MAX_RANKS))?;
        let send_counts = region(Some(4 * MAX_RANKS))?;
        let recv_x = region(per_row(row_bytes))?;
        let recv_scales = region(per_row(scale_cols * 4))?;
        let recv_idx = region(cfg.topk.checked_mul(4).and_then(per_row))?;
        let recv_weights = region(cfg.topk.checked_mul(4).and_then(per_row))?;
        let recv_src = region(per_row(4))?;
        let inbox_bytes = cfg.hidden.checked_mul(2).and_then(per_row).ok_or_else(err)?;
        let inbox = region(Some(inbox_bytes))?;
        let slots = region(cfg.max_tokens_per_rank.checked_mul(4 * MAX_RANKS))?;
        Ok(EpLayout {
            world,
            hidden: cfg.hidden,
            max_tokens: cfg.max_tokens_per_rank,
            topk: cfg.topk,
            row_bytes,
            scale_cols,
            flags,
            recv_counts,
            send_counts,
            recv_x,
            recv_scales,
            recv_idx,
            recv_weights,
            recv_src,
            inbox,
            inbox_bytes,
            slots,
            total: at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels' flag-word indices are the ones this module gives.
    #[test]
    fn kernel_flag_words_match() {
        let src = include_str!("../../kernels-cuda/ep.cu");
        let define = |name: &str| {
            let line = src
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} is not defined in ep.cu"));
            line[format!("#define {name} ").len()..]
                .split("//")
                .next()
                .unwrap()
                .trim()
                .to_string()
        };
        assert_eq!(define("FC_EP_FLAG_COMBINE"), "0u");
        assert_eq!(define("FC_EP_FLAG_EPOCH"), "FC_MAX_RANKS");
        assert_eq!(define("FC_EP_FLAG_SEEN"), "(FC_MAX_RANKS + 1u)");
        assert_eq!(define("FC_EP_FLAG_PLAIN"), "(2u * FC_MAX_RANKS + 1u)");
        assert_eq!(define("FC_EP_FLAG_DISPATCH"), "(2u * FC_MAX_RANKS + 2u)");
        assert_eq!(define("FC_EP_MAX_GRID"), format!("{MAX_BLOCKS}u"));
        assert_eq!(
            define("FC_EP_FLAG_TAKEN"),
            "(FC_EP_FLAG_DISPATCH + FC_MAX_RANKS * FC_EP_MAX_GRID)"
        );
        assert_eq!(FLAG_TAKEN, FLAG_DISPATCH + MAX_RANKS * MAX_BLOCKS);
        assert_eq!(define("FC_EP_COUNT_BITS"), format!("{COUNT_BITS}u"));
        assert_eq!(
            (FLAG_COMBINE, FLAG_EPOCH, FLAG_SEEN, FLAG_PLAIN, FLAG_DISPATCH),
            (0, MAX_RANKS, MAX_RANKS + 1, 2 * MAX_RANKS + 1, 2 * MAX_RANKS + 2)
        );
    }

    #[test]
    fn regions_are_aligned_disjoint_and_in_order() {
        let cfg = EpConfig {
            hidden: 7168,
            max_tokens_per_rank: 4096,
            num_experts: 256,
            topk: 8,
            payload: EpPayload::Fp8,
        };
        let l = EpLayout::new(&cfg, 8).unwrap();
        let starts = [
            (l.flags, FLAGS_BYTES),
            (l.recv_counts, 32),
            (l.send_counts, 32),
            (l.recv_x, 8 * 4096 * 7168),
            (l.recv_scales, 8 * 4096 * 56 * 4),
            (l.recv_idx, 8 * 4096 * 8 * 4),
            (l.recv_weights, 8 * 4096 * 8 * 4),
            (l.recv_src, 8 * 4096 * 4),
            (l.inbox, 8 * 4096 * 7168 * 2),
            (l.slots, 4096 * 32),
        ];
        for w in starts.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?}");
        }
        assert!(starts.iter().all(|(s, _)| s % REGION_ALIGN == 0));
        assert_eq!(l.total % REGION_ALIGN, 0);
        assert!(l.total >= l.slots + 4096 * 32);
        assert_eq!((l.row_bytes, l.scale_cols), (7168, 56));
        let big = EpConfig {
            max_tokens_per_rank: usize::MAX / 2,
            ..cfg
        };
        assert!(EpLayout::new(&big, 8).is_err());
    }
}
