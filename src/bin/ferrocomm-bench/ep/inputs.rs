//! The EP sweep's shape (the flags, or the defaults) and each row's
//! inputs: every token's top-k experts and row, hashed from (rank, token,
//! channel), so any rank can make any rank's for the splits and checks.

use ferrocomm::device::BackendKind;
use ferrocomm::ep::{EpConfig, EpLayout, EpPayload, SCALE_BLOCK};
use ferrocomm::{CommOptions, Result};

use crate::args::Args;

/// The sweep: `(tokens per rank, hidden, experts, topk)`.
pub struct Shape {
    pub tokens: Vec<usize>,
    pub hidden: usize,
    pub experts: usize,
    pub topk: usize,
}

/// The flags, or the defaults: DeepSeek-V3's shape on GPUs, tiny on the host.
pub fn shape(a: &Args, backend: BackendKind, world: usize) -> Shape {
    let host = backend == BackendKind::Host;
    let experts = a.experts.unwrap_or(if host { 8 * world } else { 256 });
    Shape {
        tokens: if a.tokens_given {
            a.tokens.clone()
        } else if host {
            vec![1, 8, 32]
        } else {
            vec![1, 8, 32, 128, 512, 1024, 4096]
        },
        hidden: if a.hidden_given {
            a.hidden
        } else if host {
            256
        } else {
            7168
        },
        experts,
        topk: a.topk.unwrap_or(8).min(experts),
    }
}

pub fn config(s: &Shape, tokens: usize, payload: EpPayload) -> EpConfig {
    EpConfig {
        hidden: s.hidden,
        max_tokens_per_rank: tokens,
        num_experts: s.experts,
        topk: s.topk,
        payload,
    }
}

/// The heap the sweep needs (its largest buffer, as one allocation), unless
/// `FERROCOMM_HEAP_BYTES` says otherwise.
pub fn with_heap(opts: CommOptions, a: &Args, backend: BackendKind, world: usize) -> Result<CommOptions> {
    if opts.heap_bytes.is_some() {
        return Ok(opts);
    }
    let s = shape(a, backend, world);
    let largest = s.tokens.iter().copied().max().unwrap_or(1);
    let total = EpLayout::new(&config(&s, largest, EpPayload::Bf16), world)?.total;
    Ok(opts.with_heap_bytes((total + (1 << 20)).next_multiple_of(4096)))
}

/// fp8 scales per row (one per [`SCALE_BLOCK`] channels; none for bf16).
pub fn scale_cols(cfg: &EpConfig) -> usize {
    if cfg.payload == EpPayload::Fp8 {
        cfg.hidden / SCALE_BLOCK
    } else {
        0
    }
}

/// Bytes of one dispatched row.
pub fn row_bytes(cfg: &EpConfig) -> usize {
    if cfg.payload == EpPayload::Fp8 {
        cfg.hidden
    } else {
        2 * cfg.hidden
    }
}

/// One row's inputs: every rank's top-k, this rank's dispatch inputs as bytes.
pub struct Inputs {
    /// Per rank, per token: its top-k experts (for the splits and the checks).
    pub ids: Vec<Vec<Vec<i32>>>,
    /// This rank's rows.
    pub x: Vec<u8>,
    /// fp8: the rows' f32 scales.
    pub scales: Vec<u8>,
    /// This rank's top-k ids (i32) and weights (f32).
    pub idx: Vec<u8>,
    pub weights: Vec<u8>,
}

impl Inputs {
    pub fn new(s: &Shape, cfg: &EpConfig, rank: usize, world: usize) -> Inputs {
        let (n, k) = (cfg.max_tokens_per_rank, cfg.topk);
        let ids: Vec<Vec<Vec<i32>>> = (0..world)
            .map(|r| (0..n).map(|t| experts_of(s, r, t)).collect())
            .collect();
        let idx = ids[rank].iter().flatten().flat_map(|e| e.to_le_bytes()).collect();
        Inputs {
            x: (0..n).flat_map(|t| x_bytes(cfg, rank, t)).collect(),
            scales: (0..n * scale_cols(cfg))
                .flat_map(|i| (1.0f32 + (i % 7) as f32 / 8.0).to_le_bytes())
                .collect(),
            idx,
            weights: (0..n * k).flat_map(|_| (1.0f32 / k as f32).to_le_bytes()).collect(),
            ids,
        }
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn h(rank: usize, t: usize, c: usize) -> u64 {
    mix(mix(mix(rank as u64) ^ t as u64) ^ c as u64)
}

/// bf16 element `c` of token `t` of rank `rank`: a multiple of 1/8 in [-4, 4).
fn bf16_value(rank: usize, t: usize, c: usize) -> f32 {
    ((h(rank, t, c) % 64) as f32 - 32.0) / 8.0
}

/// Token `t`'s top-k: distinct experts, uniform.
fn experts_of(s: &Shape, rank: usize, t: usize) -> Vec<i32> {
    let mut ids = Vec::with_capacity(s.topk);
    let mut k = 0;
    while ids.len() < s.topk {
        let e = (h(rank, t, 1_000_000 + k) % s.experts as u64) as i32;
        k += 1;
        if !ids.contains(&e) {
            ids.push(e);
        }
    }
    ids
}

/// Token `t`'s row on rank `rank`, as bytes of the payload.
pub fn x_bytes(cfg: &EpConfig, rank: usize, t: usize) -> Vec<u8> {
    match cfg.payload {
        EpPayload::Bf16 => (0..cfg.hidden)
            .flat_map(|c| half::bf16::from_f32(bf16_value(rank, t, c)).to_bits().to_le_bytes())
            .collect(),
        EpPayload::Fp8 => (0..cfg.hidden).map(|c| h(rank, t, c) as u8).collect(),
    }
}
