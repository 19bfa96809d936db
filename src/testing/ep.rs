//! EP dispatch and combine in the conformance suite (every backend): every
//! rank regenerates every rank's inputs from seeds and checks its received
//! rows and its combined output bit for bit against `ep::reference`, over
//! bf16 and fp8 payloads (aligned and unaligned rows), token counts 0, 1,
//! odd and the maximum (different on each rank), random top-k ids with
//! repeated ranks, `-1` and out-of-range ids; then graph captures replayed
//! with new inputs, the alternation rule, every bad input as an error before
//! anything is queued, and (separately) a peer that never dispatches.

use std::time::Duration;

use half::bf16;

use super::check::Checker;
use super::conformance::{SuiteConfig, SuiteReport};
use crate::bootstrap::{store_barrier, Store};
use crate::comm::{Call, Communicator, Tensor};
use crate::device::{Device, DeviceBuffer};
use crate::dtype::DType;
use crate::ep::reference::{self, RankInput, Received};
use crate::ep::{DispatchOut, EpBuffer, EpConfig, EpPayload, SCALE_BLOCK};
use crate::error::{Error, Result};

/// SplitMix64: every rank draws the same numbers for the same seed.
struct Rng(u64);

impl Rng {
    fn new(parts: &[u64]) -> Rng {
        let mut r = Rng(0x9E37_79B9_7F4A_7C15);
        for &p in parts {
            r.0 ^= p;
            r.next();
        }
        r
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
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

/// Rank `rank`'s inputs for `seed`: random rows, top-k ids with `-1` (1 in
/// 8), out-of-range ids (1 in 16) and repeats, weights in [0, 1).
pub fn make_input(cfg: &EpConfig, seed: u64, rank: usize, num_tokens: usize) -> RankInput {
    let mut rng = Rng::new(&[seed, rank as u64, num_tokens as u64]);
    let n = num_tokens;
    let x = match cfg.payload {
        EpPayload::Bf16 => (0..n * cfg.hidden)
            .flat_map(|_| bf16::from_f32(rng.unit() * 8.0 - 4.0).to_bits().to_le_bytes())
            .collect(),
        EpPayload::Fp8 => (0..n * cfg.hidden).map(|_| rng.next() as u8).collect(),
    };
    let scales = (0..n * scale_cols(cfg)).map(|_| 0.5 + rng.unit() * 1.5).collect();
    let topk_idx = (0..n * cfg.topk)
        .map(|_| match rng.below(16) {
            0 | 1 => -1,
            2 => (cfg.num_experts as u64 + rng.below(3)) as i32,
            _ => rng.below(cfg.num_experts as u64) as i32,
        })
        .collect();
    let topk_weights = (0..n * cfg.topk).map(|_| rng.unit()).collect();
    RankInput {
        num_tokens,
        x,
        scales,
        topk_idx,
        topk_weights,
    }
}

/// Bits that turn any sum they enter into a NaN: expert_out rows that
/// combine must not read.
const POISON: u16 = 0x7FC1;

/// The test's "experts": bf16 rows computed from a received row (payload,
/// scales, local ids and weights), the same function on every backend.
/// Rows past each source's count are `POISON`.
pub fn expert_out(cfg: &EpConfig, world: usize, recv: &Received) -> Vec<u16> {
    let (max, h, k, sc) = (cfg.max_tokens_per_rank, cfg.hidden, cfg.topk, scale_cols(cfg));
    let rb = row_bytes(cfg);
    let mut out = vec![POISON; world * max * h];
    for (s, &count) in recv.counts.iter().enumerate() {
        for i in 0..count {
            let row = s * max + i;
            let (mut wsum, mut local) = (0f32, 0u32);
            for j in 0..k {
                if recv.topk_idx[row * k + j] >= 0 {
                    wsum += recv.topk_weights[row * k + j];
                    local += 1;
                }
            }
            let x = &recv.x[row * rb..(row + 1) * rb];
            for c in 0..h {
                let v = match cfg.payload {
                    EpPayload::Bf16 => bf16::from_bits(u16::from_le_bytes([x[2 * c], x[2 * c + 1]])).to_f32(),
                    EpPayload::Fp8 => (x[c] as i8) as f32 * recv.scales[row * sc + c / SCALE_BLOCK],
                };
                out[row * h + c] = bf16::from_f32(v * wsum + local as f32 * 0.125).to_bits();
            }
        }
    }
    out
}

fn u16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

fn words<const N: usize>(b: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    b.chunks_exact(N).map(|c| c.try_into().expect("N bytes"))
}

/// One case's device buffers (inputs at their maximum) and host scratch.
struct Bufs<D: Device> {
    x: D::Buffer,
    scales: D::Buffer,
    idx: D::Buffer,
    weights: D::Buffer,
    expert: D::Buffer,
    out: D::Buffer,
    scratch: D::Buffer,
}

impl<D: Device> Bufs<D> {
    fn new(comm: &Communicator<D>, cfg: &EpConfig) -> Result<Bufs<D>> {
        let (world, max, h) = (comm.size(), cfg.max_tokens_per_rank, cfg.hidden);
        let a = |b: usize| comm.alloc(b.max(16));
        Ok(Bufs {
            x: a(max * row_bytes(cfg))?,
            scales: a(max * scale_cols(cfg) * 4)?,
            idx: a(max * cfg.topk * 4)?,
            weights: a(max * cfg.topk * 4)?,
            // One element more: a round views them from an odd element.
            expert: a(world * max * h * 2 + 2)?,
            out: a(max * h * 2 + 2)?,
            scratch: a(world * max * h * 2)?,
        })
    }

    fn write_input(&self, comm: &Communicator<D>, input: &RankInput) -> Result<()> {
        comm.write(&self.x, 0, &input.x)?;
        comm.write(&self.scales, 0, &f32_bytes(&input.scales))?;
        comm.write(&self.idx, 0, &i32_bytes(&input.topk_idx))?;
        comm.write(&self.weights, 0, &f32_bytes(&input.topk_weights))
    }

    /// The input tensors, sized for the maximum (the call takes the first
    /// `num_tokens` rows).
    fn tensors(&self, cfg: &EpConfig) -> Result<(Tensor, Option<Tensor>, Tensor, Tensor)> {
        let max = cfg.max_tokens_per_rank;
        let x = match cfg.payload {
            EpPayload::Bf16 => Tensor::view(&self.x, DType::BF16, 0, max * cfg.hidden)?,
            EpPayload::Fp8 => Tensor::view(&self.x, DType::F8E4M3, 0, max * cfg.hidden)?,
        };
        let scales = match cfg.payload {
            EpPayload::Bf16 => None,
            EpPayload::Fp8 => Some(Tensor::view(&self.scales, DType::F32, 0, max * scale_cols(cfg))?),
        };
        Ok((
            x,
            scales,
            Tensor::view(&self.idx, DType::I32, 0, max * cfg.topk)?,
            Tensor::view(&self.weights, DType::F32, 0, max * cfg.topk)?,
        ))
    }

    /// The experts' output and the combine's output, from element `shift`
    /// of their buffers (1: only 2-byte aligned).
    fn expert_tensor(&self, comm: &Communicator<D>, cfg: &EpConfig, shift: usize) -> Result<Tensor> {
        Tensor::view(
            &self.expert,
            DType::BF16,
            2 * shift,
            comm.size() * cfg.max_tokens_per_rank * cfg.hidden,
        )
    }

    fn out_tensor(&self, cfg: &EpConfig, shift: usize) -> Result<Tensor> {
        Tensor::view(&self.out, DType::BF16, 2 * shift, cfg.max_tokens_per_rank * cfg.hidden)
    }

    /// `t`'s bytes, through the scratch buffer (heap views have no buffer
    /// of their own to read), after `stream`'s work.
    fn read(&self, comm: &Communicator<D>, t: &Tensor, stream: &D::Stream) -> Result<Vec<u8>> {
        let bytes = t.bytes()?;
        let dev = comm.device();
        dev.synchronize(stream)?;
        if bytes > 0 {
            dev.copy_device(self.scratch.ptr(), t.ptr(), bytes, comm.stream())?;
        }
        let mut v = vec![0u8; bytes];
        comm.read(&self.scratch, 0, &mut v)?;
        Ok(v)
    }

    /// What this rank received, as [`Received`], rows past the counts zeroed.
    fn received(
        &self,
        comm: &Communicator<D>,
        cfg: &EpConfig,
        o: &DispatchOut,
        stream: &D::Stream,
    ) -> Result<Received> {
        let (world, max, k) = (comm.size(), cfg.max_tokens_per_rank, cfg.topk);
        let (rb, sc) = (row_bytes(cfg), scale_cols(cfg));
        let counts: Vec<usize> = words::<4>(&self.read(comm, &o.recv_counts, stream)?)
            .map(|w| i32::from_le_bytes(w).clamp(0, max as i32) as usize)
            .collect();
        let mut r = Received {
            counts,
            x: self.read(comm, &o.recv_x, stream)?,
            scales: match &o.recv_scales {
                Some(t) => words::<4>(&self.read(comm, t, stream)?)
                    .map(f32::from_le_bytes)
                    .collect(),
                None => Vec::new(),
            },
            topk_idx: words::<4>(&self.read(comm, &o.recv_topk_idx, stream)?)
                .map(i32::from_le_bytes)
                .collect(),
            topk_weights: words::<4>(&self.read(comm, &o.recv_topk_weights, stream)?)
                .map(f32::from_le_bytes)
                .collect(),
            src_index: words::<4>(&self.read(comm, &o.recv_src_index, stream)?)
                .map(i32::from_le_bytes)
                .collect(),
        };
        // Rows past each count are stale on a device: compare them as zeros.
        for s in 0..world {
            for row in s * max + r.counts[s]..(s + 1) * max {
                r.x[row * rb..(row + 1) * rb].fill(0);
                r.scales[row * sc..(row + 1) * sc].fill(0.0);
                r.topk_idx[row * k..(row + 1) * k].fill(0);
                r.topk_weights[row * k..(row + 1) * k].fill(0.0);
                r.src_index[row] = 0;
            }
        }
        Ok(r)
    }
}

/// Compare what this rank received with the reference.
fn check_received(c: &mut Checker, case: &str, got: &Received, want: &Received) {
    c.check(&format!("{case}: counts"), got.counts == want.counts, || {
        format!("got {:?} want {:?}", got.counts, want.counts)
    });
    if got.counts != want.counts {
        return;
    }
    c.check_bytes(&format!("{case}: rows"), &got.x, &want.x);
    c.check_bytes(
        &format!("{case}: scales"),
        &f32_bytes(&got.scales),
        &f32_bytes(&want.scales),
    );
    c.check_bytes(
        &format!("{case}: top-k ids"),
        &i32_bytes(&got.topk_idx),
        &i32_bytes(&want.topk_idx),
    );
    c.check_bytes(
        &format!("{case}: top-k weights"),
        &f32_bytes(&got.topk_weights),
        &f32_bytes(&want.topk_weights),
    );
    c.check_bytes(
        &format!("{case}: source index"),
        &i32_bytes(&got.src_index),
        &i32_bytes(&want.src_index),
    );
}

/// The cases every world runs: unaligned bf16 rows (200 bytes), fp8 with two
/// scales a row, 16-byte-aligned bf16 rows with top-8, and 16-byte rows with
/// top-4 at up to 4200 tokens, so the GPU layout scans across warps (more
/// than 256 tokens) and in two chunks (more than 4096: the layout kernel),
/// and up to world 4 a GPU combine's sums take their units from the counter
/// (2048 tokens and more, `fc_ep_combine_ll_take`) on one rank while the
/// other's take fixed shares.
fn cases(world: usize) -> Vec<EpConfig> {
    vec![
        EpConfig {
            hidden: 100,
            max_tokens_per_rank: 24,
            num_experts: 3 * world,
            topk: 3,
            payload: EpPayload::Bf16,
        },
        EpConfig {
            hidden: 256,
            max_tokens_per_rank: 33,
            num_experts: 4 * world,
            topk: 6,
            payload: EpPayload::Fp8,
        },
        EpConfig {
            hidden: 512,
            max_tokens_per_rank: 64,
            num_experts: 8 * world,
            topk: 8,
            payload: EpPayload::Bf16,
        },
        EpConfig {
            hidden: 8,
            max_tokens_per_rank: 4200,
            num_experts: 4 * world,
            topk: 4,
            payload: EpPayload::Bf16,
        },
    ]
}

/// The token counts of round `round` on rank `rank`: 0, 1, odd, the maximum,
/// a different one on each rank.
fn tokens_for(cfg: &EpConfig, round: usize, rank: usize) -> usize {
    let max = cfg.max_tokens_per_rank;
    [0, 1, (max / 2) | 1, max][(round + rank) % 4]
}

/// One round of the suite: its name, the inputs' seed, the tokens each rank
/// sends, and the element this rank's expert output and combine output start
/// at (1: only 2-byte aligned).
struct Round<'a> {
    case: String,
    seed: u64,
    tokens: &'a dyn Fn(usize) -> usize,
    shift: usize,
}

/// One dispatch + combine of every rank's inputs for the round, eager, checked.
fn round_trip<D: Device>(
    comm: &Communicator<D>,
    c: &mut Checker,
    ep: &EpBuffer<D>,
    bufs: &Bufs<D>,
    round: Round<'_>,
) -> Result<()> {
    let Round {
        case,
        seed,
        tokens,
        shift,
    } = round;
    let (rank, world) = (comm.rank(), comm.size());
    let cfg = *ep.config();
    let inputs: Vec<RankInput> = (0..world).map(|r| make_input(&cfg, seed, r, tokens(r))).collect();
    bufs.write_input(comm, &inputs[rank])?;
    let (x, scales, idx, w) = bufs.tensors(&cfg)?;
    let call = Call::new();
    let (work, out) = ep.dispatch(x, scales, idx, w, tokens(rank), &call)?;
    work.wait(None)?;
    let got = bufs.received(comm, &cfg, &out, comm.stream())?;
    let want = reference::dispatch(&cfg, world, rank, &inputs);
    check_received(c, &format!("{case} dispatch"), &got, &want);
    // Experts on what arrived; the reference runs them on what should have.
    comm.write(&bufs.expert, 2 * shift, &u16_bytes(&expert_out(&cfg, world, &got)))?;
    let all_out: Vec<Vec<u16>> = (0..world)
        .map(|r| expert_out(&cfg, world, &reference::dispatch(&cfg, world, r, &inputs)))
        .collect();
    ep.combine(
        bufs.expert_tensor(comm, &cfg, shift)?,
        bufs.out_tensor(&cfg, shift)?,
        &call,
    )?
    .wait(None)?;
    let mut got_out = vec![0u8; tokens(rank) * cfg.hidden * 2];
    comm.read(&bufs.out, 2 * shift, &mut got_out)?;
    let want_out = reference::combine(&cfg, world, rank, &inputs, &all_out);
    c.check_bytes(&format!("{case} combine"), &got_out, &u16_bytes(&want_out));
    check_inbox_empty(c, ep, &format!("{case} combine"))
}

/// The inbox is all 0xff again after a combine (its Lamport packs were all
/// given back): else the next combine would take stale packs for rows.
fn check_inbox_empty<D: Device>(c: &mut Checker, ep: &EpBuffer<D>, case: &str) -> Result<()> {
    let stray = ep.inbox_stray_bytes()?;
    c.check(case, stray == 0, || {
        format!("{stray} inbox bytes left that are not 0xff")
    });
    Ok(())
}

/// Dispatch and combine captured as two graphs, replayed with new inputs
/// (and experts run on the host between them); then, for bf16, one graph
/// of dispatch, a copy of the received rows as the experts' output
/// (identity experts), and combine.
fn graphs<D: Device>(
    comm: &Communicator<D>,
    c: &mut Checker,
    ep: &EpBuffer<D>,
    bufs: &Bufs<D>,
    case: &str,
    cfg_suite: &SuiteConfig,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.size());
    let cfg = *ep.config();
    let dev = comm.device();
    let tokens = |r: usize| tokens_for(&cfg, 2, r).max(1);
    let (x, scales, idx, w) = bufs.tensors(&cfg)?;
    let (expert, out_t) = (bufs.expert_tensor(comm, &cfg, 0)?, bufs.out_tensor(&cfg, 0)?);
    // The eager rounds before loaded every EP kernel the captures launch.
    let stream = dev.create_stream()?;
    let on = Call::on(&stream);
    dev.begin_capture(&stream)?;
    let captured = ep.dispatch(x, scales, idx, w, tokens(rank), &on);
    let g_dispatch = dev.end_capture(&stream)?;
    let (_, recv) = captured?;
    dev.begin_capture(&stream)?;
    let captured = ep.combine(expert, out_t, &on);
    let g_combine = dev.end_capture(&stream)?;
    captured?;
    let replays = cfg_suite.graph_replays.clamp(1, 4);
    for replay in 0..replays {
        let seed = 0x6000 + replay as u64;
        let inputs: Vec<RankInput> = (0..world).map(|r| make_input(&cfg, seed, r, tokens(r))).collect();
        bufs.write_input(comm, &inputs[rank])?;
        dev.synchronize(comm.stream())?;
        dev.launch_graph(&g_dispatch, &stream)?;
        let got = bufs.received(comm, &cfg, &recv, &stream)?;
        let want = reference::dispatch(&cfg, world, rank, &inputs);
        check_received(c, &format!("{case} graph replay {replay} dispatch"), &got, &want);
        comm.write(&bufs.expert, 0, &u16_bytes(&expert_out(&cfg, world, &got)))?;
        dev.synchronize(comm.stream())?;
        dev.launch_graph(&g_combine, &stream)?;
        dev.synchronize(&stream)?;
        if let Some(e) = comm.inner.device_error() {
            return Err(e);
        }
        let all_out: Vec<Vec<u16>> = (0..world)
            .map(|r| expert_out(&cfg, world, &reference::dispatch(&cfg, world, r, &inputs)))
            .collect();
        let mut got_out = vec![0u8; tokens(rank) * cfg.hidden * 2];
        comm.read(&bufs.out, 0, &mut got_out)?;
        let want_out = reference::combine(&cfg, world, rank, &inputs, &all_out);
        c.check_bytes(
            &format!("{case} graph replay {replay} combine"),
            &got_out,
            &u16_bytes(&want_out),
        );
        check_inbox_empty(c, ep, &format!("{case} graph replay {replay}"))?;
    }
    drop((g_dispatch, g_combine));
    if cfg.payload != EpPayload::Bf16 {
        return Ok(());
    }
    let rows_bytes = world * cfg.max_tokens_per_rank * cfg.hidden * 2;
    dev.begin_capture(&stream)?;
    let captured = (|| {
        let (_, recv) = ep.dispatch(x, scales, idx, w, tokens(rank), &on)?;
        dev.copy_device(expert.ptr(), recv.recv_x.ptr(), rows_bytes, &stream)?;
        ep.combine(expert, out_t, &on)
    })();
    let g_all = dev.end_capture(&stream)?;
    captured?;
    for replay in 0..replays {
        let seed = 0x7000 + replay as u64;
        let inputs: Vec<RankInput> = (0..world).map(|r| make_input(&cfg, seed, r, tokens(r))).collect();
        bufs.write_input(comm, &inputs[rank])?;
        dev.synchronize(comm.stream())?;
        dev.launch_graph(&g_all, &stream)?;
        dev.synchronize(&stream)?;
        if let Some(e) = comm.inner.device_error() {
            return Err(e);
        }
        // Identity experts: each rank returns the rows it received.
        let all_out: Vec<Vec<u16>> = (0..world)
            .map(|r| {
                let recv = reference::dispatch(&cfg, world, r, &inputs);
                words::<2>(&recv.x).map(u16::from_le_bytes).collect()
            })
            .collect();
        let mut got_out = vec![0u8; tokens(rank) * cfg.hidden * 2];
        comm.read(&bufs.out, 0, &mut got_out)?;
        let want_out = reference::combine(&cfg, world, rank, &inputs, &all_out);
        c.check_bytes(
            &format!("{case} one-graph replay {replay}"),
            &got_out,
            &u16_bytes(&want_out),
        );
    }
    Ok(())
}

/// Bad inputs and the alternation rule: errors before anything is queued.
fn bad_inputs<D: Device>(comm: &Communicator<D>, c: &mut Checker, ep: &EpBuffer<D>, bufs: &Bufs<D>) -> Result<()> {
    let cfg = *ep.config();
    let (x, scales, idx, w) = bufs.tensors(&cfg)?;
    let (expert, out) = (bufs.expert_tensor(comm, &cfg, 0)?, bufs.out_tensor(&cfg, 0)?);
    let call = Call::new();
    let max = cfg.max_tokens_per_rank;
    let n = max.min(3);
    c.check_invalid("combine before dispatch", ep.combine(expert, out, &call), "no dispatch");
    c.check_invalid(
        "too many tokens",
        ep.dispatch(x, scales, idx, w, max + 1, &call),
        "exceed max_tokens_per_rank",
    );
    let x16 = x.reinterpret(DType::F16).or_else(|_| x.reinterpret(DType::U8))?;
    c.check_invalid("x of another dtype", ep.dispatch(x16, scales, idx, w, n, &call), "x is");
    c.check_invalid(
        "x too short",
        ep.dispatch(x.slice(0, (n - 1) * cfg.hidden)?, scales, idx, w, n, &call),
        "at least",
    );
    c.check_invalid(
        "x not whole rows",
        ep.dispatch(x.slice(0, n * cfg.hidden - 1)?, scales, idx, w, n, &call),
        "whole rows",
    );
    c.check_invalid(
        "topk_idx of another dtype",
        ep.dispatch(x, scales, idx.reinterpret(DType::F32)?, w, n, &call),
        "topk_idx is",
    );
    c.check_invalid(
        "topk_weights of another dtype",
        ep.dispatch(x, scales, idx, w.reinterpret(DType::I32)?, n, &call),
        "topk_weights is",
    );
    c.check_invalid(
        "topk_idx too short",
        ep.dispatch(x, scales, idx.slice(0, cfg.topk)?, w, n, &call),
        "at least",
    );
    match cfg.payload {
        EpPayload::Fp8 => c.check_invalid(
            "fp8 without scales",
            ep.dispatch(x, None, idx, w, n, &call),
            "need their scales",
        ),
        EpPayload::Bf16 => c.check_invalid(
            "bf16 with scales",
            ep.dispatch(x, Some(w), idx, w, n, &call),
            "take no scales",
        ),
    }
    // A good dispatch; a second one before the combine is refused.
    let inputs = make_input(&cfg, 0x5150, comm.rank(), n);
    bufs.write_input(comm, &inputs)?;
    ep.dispatch(x, scales, idx, w, n, &call)?;
    c.check_invalid(
        "dispatch twice",
        ep.dispatch(x, scales, idx, w, n, &call),
        "must alternate",
    );
    c.check_invalid(
        "expert_out of another dtype",
        ep.combine(expert.reinterpret(DType::F16)?, out, &call),
        "expert_out is",
    );
    c.check_invalid(
        "expert_out too short",
        ep.combine(expert.slice(0, cfg.hidden)?, out, &call),
        "at least",
    );
    c.check_invalid(
        "out too short",
        ep.combine(expert, out.slice(0, (n - 1) * cfg.hidden)?, &call),
        "at least",
    );
    let inside = unsafe_out(&ep.received()?.recv_x, n * cfg.hidden);
    c.check_invalid(
        "out inside the EP buffer",
        ep.combine(expert, inside, &call),
        "overlaps",
    );
    ep.combine(expert, out, &call)?.wait(None)?;
    Ok(())
}

/// A bf16 view of `n` elements starting at `t` (a region of the EP buffer).
fn unsafe_out(t: &Tensor, n: usize) -> Tensor {
    // SAFETY: only passed to a call that must refuse it before touching it.
    unsafe { Tensor::from_raw(t.ptr().0, n, DType::BF16) }
}

/// Config errors, checked on every rank alike.
fn bad_configs<D: Device>(comm: &Communicator<D>, c: &mut Checker) {
    let world = comm.size();
    let good = EpConfig {
        hidden: 256,
        max_tokens_per_rank: 8,
        num_experts: 2 * world,
        topk: 2,
        payload: EpPayload::Fp8,
    };
    let bad = [
        ("zero hidden", EpConfig { hidden: 0, ..good }, "must be positive"),
        (
            "zero tokens",
            EpConfig {
                max_tokens_per_rank: 0,
                ..good
            },
            "must be positive",
        ),
        (
            "topk above experts",
            EpConfig {
                topk: 2 * world + 1,
                ..good
            },
            "exceeds num_experts",
        ),
        (
            "experts not divisible",
            EpConfig {
                num_experts: 2 * world + 1,
                ..good
            },
            "not divisible",
        ),
        ("fp8 hidden", EpConfig { hidden: 200, ..good }, "not a multiple"),
        (
            "rows past a signal's count",
            EpConfig {
                max_tokens_per_rank: 1 << 20,
                ..good
            },
            "below 2^20",
        ),
    ];
    for (case, cfg, needle) in bad {
        c.check_invalid(case, EpBuffer::new(comm, cfg).map(drop), needle);
    }
    // The heap's own error, on every rank.
    let huge = EpConfig {
        hidden: 7168,
        max_tokens_per_rank: (1 << 20) - 1,
        ..good
    };
    c.check_invalid("heap too small", EpBuffer::new(comm, huge).map(drop), "out of memory");
}

/// The EP suite; every rank runs it in step. A rank that fails says so on
/// stderr at once (the harness reports the first failing rank only, and a
/// rank that stops makes its peers time out).
pub fn run_ep_suite<D: Device>(comm: &Communicator<D>, store: &dyn Store, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let r = ep_suite(comm, store, cfg);
    if let Err(e) = &r {
        eprintln!("EP suite: rank {} of {} failed: {e}", comm.rank(), comm.size());
    }
    r
}

fn ep_suite<D: Device>(comm: &Communicator<D>, store: &dyn Store, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut c = Checker::default();
    // Every kernel compiled and loaded first: ranks that share a GPU share
    // its context, where a module load (a background compile finishing) may
    // wait for the running kernels, which may be one rank's EP kernel waiting
    // for another rank that is blocked behind that load.
    comm.prepare()?;
    bad_configs(comm, &mut c);
    for (k, ep_cfg) in cases(world).into_iter().enumerate() {
        let case = format!(
            "{:?} hidden {} max {} experts {} top-{}",
            ep_cfg.payload, ep_cfg.hidden, ep_cfg.max_tokens_per_rank, ep_cfg.num_experts, ep_cfg.topk
        );
        let ep = EpBuffer::new(comm, ep_cfg)?;
        let bufs = Bufs::new(comm, &ep_cfg)?;
        for round in 0..4 {
            let seed = cfg.seed ^ (k as u64) << 32 ^ round as u64;
            let tokens = |r| tokens_for(&ep_cfg, round, r);
            let case = format!("{case} round {round}");
            round_trip(
                comm,
                &mut c,
                &ep,
                &bufs,
                Round {
                    case,
                    seed,
                    tokens: &tokens,
                    shift: 0,
                },
            )?;
        }
        // Every rank sends nothing; then every rank sends its maximum; then
        // odd ranks combine from and into tensors at an odd element (only
        // 2-byte aligned), so ranks' pointers differ in alignment.
        let (none, full) = (|_| 0, |_| ep_cfg.max_tokens_per_rank);
        let rounds = [
            Round {
                case: format!("{case} all empty"),
                seed: 0x11,
                tokens: &none,
                shift: 0,
            },
            Round {
                case: format!("{case} all full"),
                seed: 0x12,
                tokens: &full,
                shift: 0,
            },
            Round {
                case: format!("{case} odd ranks unaligned"),
                seed: 0x13,
                tokens: &full,
                shift: rank % 2,
            },
        ];
        for round in rounds {
            round_trip(comm, &mut c, &ep, &bufs, round)?;
        }
        graphs(comm, &mut c, &ep, &bufs, &case, cfg)?;
        bad_inputs(comm, &mut c, &ep, &bufs)?;
        ep.free()?;
        store_barrier(store, &format!("fc/ep-suite/case{k}"), rank, world, cfg.timeout)?;
    }
    Ok(c.report)
}

/// Rank 0 dispatches; rank 1 never does: rank 0's wait must end with a
/// timeout naming rank 1, within the call's bound plus grace.
pub fn run_ep_timeout<D: Device>(comm: &Communicator<D>, store: &dyn Store, cfg: &SuiteConfig) -> Result<SuiteReport> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut c = Checker::default();
    let ep_cfg = EpConfig {
        hidden: 128,
        max_tokens_per_rank: 4,
        num_experts: 2 * world,
        topk: 2,
        payload: EpPayload::Bf16,
    };
    let ep = EpBuffer::new(comm, ep_cfg)?;
    let bufs = Bufs::new(comm, &ep_cfg)?;
    if rank == 0 {
        bufs.write_input(comm, &make_input(&ep_cfg, 1, 0, 4))?;
        let (x, scales, idx, w) = bufs.tensors(&ep_cfg)?;
        let start = std::time::Instant::now();
        let r = ep
            .dispatch(x, scales, idx, w, 4, &Call::new().timeout(Duration::from_millis(300)))
            .and_then(|(work, _)| work.wait(None));
        let named = matches!(&r, Err(Error::Timeout { missing, .. }) if missing == &vec![1]);
        c.check("a peer that never dispatches", named, || format!("{r:?}"));
        c.check("timeout bound", start.elapsed() < Duration::from_secs(10), || {
            format!("took {:?}", start.elapsed())
        });
    } else {
        c.report.collectives += 1;
    }
    store_barrier(store, "fc/ep-suite/timeout", rank, world, cfg.timeout)?;
    // Rank 0's communicator is aborted now; the buffer goes with its heap.
    drop(ep);
    Ok(c.report)
}
