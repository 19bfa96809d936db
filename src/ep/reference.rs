//! A pure-Rust reference of EP dispatch and combine over every rank's
//! inputs: what each rank must hold after a dispatch, and what its combine
//! must write, bit for bit. The conformance suite (`testing::ep`) checks
//! every backend against it; it shares no code with the kernels or their
//! host twins.

use half::bf16;

use super::{EpConfig, EpPayload, SCALE_BLOCK};

/// One rank's dispatch inputs, as host values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankInput {
    pub num_tokens: usize,
    /// `num_tokens` rows: bf16 (little-endian bits, `hidden * 2` bytes) or
    /// fp8 (`hidden` bytes).
    pub x: Vec<u8>,
    /// fp8: `num_tokens * hidden / 128` scales; empty for bf16.
    pub scales: Vec<f32>,
    /// `num_tokens * topk` expert ids.
    pub topk_idx: Vec<i32>,
    /// `num_tokens * topk` router weights.
    pub topk_weights: Vec<f32>,
}

/// The ranks a token with top-k `ids` goes to, one bit each: the owners of
/// its ids in `0..num_experts` (ids below 0 mean none; larger ones are ignored).
pub fn dest_ranks(cfg: &EpConfig, world: usize, ids: &[i32]) -> u32 {
    let per_rank = cfg.num_experts / world;
    ids.iter()
        .filter(|&&e| e >= 0 && (e as usize) < cfg.num_experts)
        .fold(0, |m, &e| m | 1 << (e as usize / per_rank))
}

/// What one rank holds after a dispatch, in the padded layout
/// (`[world source][max]` rows); rows past a source's count are zero here
/// (stale on a device).
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    pub counts: Vec<usize>,
    pub x: Vec<u8>,
    pub scales: Vec<f32>,
    pub topk_idx: Vec<i32>,
    pub topk_weights: Vec<f32>,
    pub src_index: Vec<i32>,
}

fn row_bytes(cfg: &EpConfig) -> usize {
    match cfg.payload {
        EpPayload::Bf16 => cfg.hidden * 2,
        EpPayload::Fp8 => cfg.hidden,
    }
}

fn scale_cols(cfg: &EpConfig) -> usize {
    match cfg.payload {
        EpPayload::Bf16 => 0,
        EpPayload::Fp8 => cfg.hidden / SCALE_BLOCK,
    }
}

/// What `rank` receives when every rank `s` dispatches `inputs[s]`.
pub fn dispatch(cfg: &EpConfig, world: usize, rank: usize, inputs: &[RankInput]) -> Received {
    let (max, k, rb, sc) = (cfg.max_tokens_per_rank, cfg.topk, row_bytes(cfg), scale_cols(cfg));
    let rows = world * max;
    let per_rank = cfg.num_experts / world;
    let mut r = Received {
        counts: vec![0; world],
        x: vec![0; rows * rb],
        scales: vec![0.0; rows * sc],
        topk_idx: vec![0; rows * k],
        topk_weights: vec![0.0; rows * k],
        src_index: vec![0; rows],
    };
    for (s, input) in inputs.iter().enumerate() {
        for t in 0..input.num_tokens {
            let ids = &input.topk_idx[t * k..(t + 1) * k];
            if dest_ranks(cfg, world, ids) & (1 << rank) == 0 {
                continue;
            }
            let row = s * max + r.counts[s];
            r.counts[s] += 1;
            r.x[row * rb..(row + 1) * rb].copy_from_slice(&input.x[t * rb..(t + 1) * rb]);
            r.scales[row * sc..(row + 1) * sc].copy_from_slice(&input.scales[t * sc..(t + 1) * sc]);
            for (j, &e) in ids.iter().enumerate() {
                let mine = e >= 0 && (e as usize) < cfg.num_experts && e as usize / per_rank == rank;
                r.topk_idx[row * k + j] = if mine {
                    (e as usize - rank * per_rank) as i32
                } else {
                    -1
                };
                r.topk_weights[row * k + j] = if mine { input.topk_weights[t * k + j] } else { 0.0 };
            }
            r.src_index[row] = t as i32;
        }
    }
    r
}

/// What `rank`'s combine writes (bf16 bits, `num_tokens * hidden`) when
/// every rank `r` combines `expert_out[r]` (bf16 bits, the padded layout
/// `[world * max][hidden]`) after every rank `s` dispatched `inputs[s]`:
/// each token's rows from the ranks it went to, summed in rank order in f32
/// (the first term as it is), rounded to bf16 once; 0 for a token that went
/// nowhere.
pub fn combine(cfg: &EpConfig, world: usize, rank: usize, inputs: &[RankInput], expert_out: &[Vec<u16>]) -> Vec<u16> {
    let (max, k, h) = (cfg.max_tokens_per_rank, cfg.topk, cfg.hidden);
    let input = &inputs[rank];
    let mut sent = vec![0usize; world];
    let mut out = vec![0u16; input.num_tokens * h];
    for t in 0..input.num_tokens {
        let mask = dest_ranks(cfg, world, &input.topk_idx[t * k..(t + 1) * k]);
        let mut acc: Option<Vec<f32>> = None;
        for (r, slot) in sent.iter_mut().enumerate() {
            if mask & (1 << r) == 0 {
                continue;
            }
            let row = rank * max + *slot;
            *slot += 1;
            let vals = expert_out[r][row * h..(row + 1) * h]
                .iter()
                .map(|&b| bf16::from_bits(b).to_f32());
            acc = Some(match acc {
                None => vals.collect(),
                Some(a) => a.iter().zip(vals).map(|(x, y)| x + y).collect(),
            });
        }
        if let Some(a) = acc {
            for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(a) {
                *o = bf16::from_f32(v).to_bits();
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EpConfig {
        EpConfig {
            hidden: 2,
            max_tokens_per_rank: 4,
            num_experts: 4,
            topk: 2,
            payload: EpPayload::Bf16,
        }
    }

    #[test]
    fn tokens_go_once_to_each_owner_in_source_order() {
        let c = cfg();
        assert_eq!(dest_ranks(&c, 2, &[0, 1]), 0b01);
        assert_eq!(dest_ranks(&c, 2, &[3, 0]), 0b11);
        assert_eq!(dest_ranks(&c, 2, &[-1, 4]), 0);
        let bf = |v: f32| bf16::from_f32(v).to_bits().to_le_bytes();
        let rows = |vals: &[f32]| vals.iter().flat_map(|&v| bf(v)).collect::<Vec<u8>>();
        let a = RankInput {
            num_tokens: 3,
            x: rows(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            scales: vec![],
            topk_idx: vec![2, 3, 0, -1, 9, 1],
            topk_weights: vec![0.5, 0.25, 1.0, 7.0, 7.0, 2.0],
        };
        let b = RankInput::default();
        let got = dispatch(&c, 2, 1, &[a.clone(), b.clone()]);
        assert_eq!(got.counts, vec![1, 0]);
        assert_eq!(&got.x[..4], &rows(&[1.0, 2.0])[..]);
        assert_eq!(&got.topk_idx[..2], &[0, 1]);
        assert_eq!(&got.topk_weights[..2], &[0.5, 0.25]);
        let on0 = dispatch(&c, 2, 0, &[a.clone(), b.clone()]);
        assert_eq!(on0.counts, vec![2, 0]);
        assert_eq!(on0.src_index[..2], [1, 2]);
        assert_eq!(&on0.topk_idx[2..4], &[-1, 1]);
        assert_eq!(&on0.topk_weights[2..4], &[0.0, 2.0]);
        // Combine: rank 0 returns rows * 2, rank 1 rows * 10.
        let h = |v: f32| bf16::from_f32(v).to_bits();
        let mut e0 = vec![0u16; 16];
        e0[..4].copy_from_slice(&[h(30.0), h(40.0), h(50.0), h(60.0)]);
        let mut e1 = vec![0u16; 16];
        e1[..2].copy_from_slice(&[h(10.0), h(20.0)]);
        let out = combine(&c, 2, 0, &[a, b], &[e0, e1]);
        assert_eq!(out, vec![h(10.0), h(20.0), h(30.0), h(40.0), h(50.0), h(60.0)]);
    }
}
