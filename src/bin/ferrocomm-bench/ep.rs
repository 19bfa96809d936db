//! `--ep`: time EP dispatch + combine (`ferrocomm::ep::EpBuffer`) per
//! `--tokens` per rank, bf16 and fp8 payloads, at `--hidden` (7168),
//! `--topk` (8) of `--experts` (256), the way the other rows are timed
//! (graph replays of back-to-back calls between device events, median over
//! iterations; `--eager-only` times eager launches), next to an all-to-all-v
//! pipeline carrying the same bytes through a vendor-routed communicator
//! (NCCL/RCCL where the build has it): one `all_to_all_v_single` for the
//! dispatch (rows, scales, top-k ids and weights, token index) and one for
//! the combine (bf16 rows back). The pipeline is given its splits on the
//! host and leaves out the permutes around it, so it is a lower bound of
//! what an all-to-all-based EP costs.
//!
//! Checks: bf16 rows run once more with identity experts (the received rows
//! copied back as the experts' output), and every token's output must be
//! its row summed over the ranks it went to (f32, rounded once), bit for
//! bit; fp8 rows check every received row and count against the sources'
//! inputs. On the host backend the defaults are tiny (a smoke test).

use std::sync::Arc;

use ferrocomm::bootstrap::Store;
use ferrocomm::device::{BackendKind, Device, DeviceBuffer};
use ferrocomm::ep::reference::dest_ranks;
use ferrocomm::ep::{EpBuffer, EpConfig, EpLayout, EpPayload, SCALE_BLOCK};
use ferrocomm::{Algorithm, Call, CommOptions, Communicator, DType, Error, Result, Tensor};

use super::{median, time_samples_prepared, Args, OPS_PER_SAMPLE};

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

fn config(s: &Shape, tokens: usize, payload: EpPayload) -> EpConfig {
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

fn x_bytes(cfg: &EpConfig, rank: usize, t: usize) -> Vec<u8> {
    match cfg.payload {
        EpPayload::Bf16 => (0..cfg.hidden)
            .flat_map(|c| half::bf16::from_f32(bf16_value(rank, t, c)).to_bits().to_le_bytes())
            .collect(),
        EpPayload::Fp8 => (0..cfg.hidden).map(|c| h(rank, t, c) as u8).collect(),
    }
}

struct Row {
    payload: &'static str,
    tokens: usize,
    mode: &'static str,
    ep_us: f64,
    a2a_us: f64,
    cpu_us: f64,
    wrong: usize,
}

pub fn bench_ep<D: Device>(comm: &Communicator<D>, store: &Arc<dyn Store>, a: &Args) -> Result<()> {
    let dev = comm.device();
    let backend = dev.facts().backend;
    let (rank, world) = (comm.rank(), comm.size());
    let s = shape(a, backend, world);
    if s.tokens.contains(&0) {
        return Err(Error::invalid("--ep needs --tokens of at least 1"));
    }
    // The all-to-all pipeline's communicator: the vendor library where it loaded.
    let vopts = comm.options().clone().with_coll_route(Algorithm::Vendor);
    let vcomm = Communicator::new(dev.duplicate()?, store.clone(), rank, world, vopts)?;
    let a2a_name = if vcomm.has_vendor_library() {
        "vendor a2av"
    } else {
        "a2av (no vendor library: ferrocomm's)"
    };
    let modes: &[&'static str] = if a.eager_only { &["eager"] } else { &["graph"] };
    if rank == 0 {
        println!(
            "# ferrocomm-bench ep backend={} world={world} hidden={} experts={} topk={} iters={} warmup={} ({}); \
             baseline: {a2a_name}, dispatch + combine",
            a.backend,
            s.hidden,
            s.experts,
            s.topk,
            a.iters_for(backend),
            a.warmup_for(backend),
            dev.facts().name
        );
        println!(
            "{:>7} {:>7} {:>6} {:>10} {:>10} {:>9} {:>8} {:>7}",
            "payload", "tokens", "mode", "ep_us", "a2av_us", "a2av/ep", "cpu_us", "#wrong"
        );
    }
    let mut wrong_total = 0;
    let mut seq = 0;
    for payload in [EpPayload::Bf16, EpPayload::Fp8] {
        for &tokens in &s.tokens {
            for &mode in modes {
                let cfg = config(&s, tokens, payload);
                let row = one(comm, &vcomm, a, &s, &cfg, mode)?;
                seq += 1;
                let row = agree(store, seq, rank, world, row, a)?;
                wrong_total += row.wrong;
                if rank == 0 {
                    println!(
                        "{:>7} {:>7} {:>6} {:>10.2} {:>10.2} {:>9.2} {:>8.2} {:>7}",
                        row.payload,
                        row.tokens,
                        row.mode,
                        row.ep_us,
                        row.a2a_us,
                        row.a2a_us / row.ep_us,
                        row.cpu_us,
                        row.wrong
                    );
                }
            }
        }
    }
    vcomm.finalize()?;
    comm.finalize()?;
    if wrong_total > 0 {
        return Err(Error::Aborted(format!("{wrong_total} wrong EP outputs")));
    }
    Ok(())
}

/// The slowest rank's times, every rank's wrong count.
fn agree(store: &Arc<dyn Store>, seq: usize, rank: usize, world: usize, row: Row, a: &Args) -> Result<Row> {
    let mine = [row.ep_us, row.a2a_us, row.cpu_us, row.wrong as f64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect::<Vec<u8>>();
    let all = ferrocomm::bootstrap::store_all_gather(
        store.as_ref(),
        &format!("bench-ep/{seq}"),
        rank,
        world,
        &mine,
        a.timeout,
    )?;
    let f = |b: &Vec<u8>, i: usize| f64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
    let max = |i: usize| all.iter().map(|b| f(b, i)).fold(0.0, f64::max);
    Ok(Row {
        ep_us: max(0),
        a2a_us: max(1),
        cpu_us: max(2),
        wrong: all.iter().map(|b| f(b, 3) as usize).sum(),
        ..row
    })
}

fn one<D: Device>(
    comm: &Communicator<D>,
    vcomm: &Communicator<D>,
    a: &Args,
    s: &Shape,
    cfg: &EpConfig,
    mode: &'static str,
) -> Result<Row> {
    let dev = comm.device();
    let backend = dev.facts().backend;
    let (rank, world) = (comm.rank(), comm.size());
    let (n, hd, k) = (cfg.max_tokens_per_rank, cfg.hidden, cfg.topk);
    let scale_cols = if cfg.payload == EpPayload::Fp8 {
        hd / SCALE_BLOCK
    } else {
        0
    };
    let row_bytes = if cfg.payload == EpPayload::Fp8 { hd } else { 2 * hd };
    let alloc = |b: usize| comm.alloc(b.max(16));

    // Inputs: every rank's top-k is regenerated here (for the splits and the
    // checks); rows only for this rank.
    let ids: Vec<Vec<Vec<i32>>> = (0..world)
        .map(|r| (0..n).map(|t| experts_of(s, r, t)).collect())
        .collect();
    let x: Vec<u8> = (0..n).flat_map(|t| x_bytes(cfg, rank, t)).collect();
    let scales: Vec<u8> = (0..n * scale_cols)
        .flat_map(|i| (1.0f32 + (i % 7) as f32 / 8.0).to_le_bytes())
        .collect();
    let idx: Vec<u8> = ids[rank].iter().flatten().flat_map(|e| e.to_le_bytes()).collect();
    let weights: Vec<u8> = (0..n * k).flat_map(|_| (1.0f32 / k as f32).to_le_bytes()).collect();
    let bufs = [
        alloc(x.len())?,
        alloc(scales.len())?,
        alloc(idx.len())?,
        alloc(weights.len())?,
        alloc(world * n * hd * 2)?,
        alloc(n * hd * 2)?,
    ];
    comm.write(&bufs[0], 0, &x)?;
    comm.write(&bufs[1], 0, &scales)?;
    comm.write(&bufs[2], 0, &idx)?;
    comm.write(&bufs[3], 0, &weights)?;
    dev.synchronize(comm.stream())?;
    let x_t = Tensor::view(
        &bufs[0],
        if cfg.payload == EpPayload::Fp8 {
            DType::F8E4M3
        } else {
            DType::BF16
        },
        0,
        n * hd,
    )?;
    let sc_t = (scale_cols > 0)
        .then(|| Tensor::view(&bufs[1], DType::F32, 0, n * scale_cols))
        .transpose()?;
    let idx_t = Tensor::view(&bufs[2], DType::I32, 0, n * k)?;
    let w_t = Tensor::view(&bufs[3], DType::F32, 0, n * k)?;
    let expert_t = Tensor::view(&bufs[4], DType::BF16, 0, world * n * hd)?;
    let out_t = Tensor::view(&bufs[5], DType::BF16, 0, n * hd)?;

    let ep = EpBuffer::new(comm, *cfg)?;
    let stream = dev.create_stream()?;
    let ops = if backend == BackendKind::Host {
        2
    } else {
        OPS_PER_SAMPLE
    };
    let run = |_: usize| -> Result<()> {
        let on = Call::on(&stream);
        ep.dispatch(x_t, sc_t, idx_t, w_t, n, &on)?;
        ep.combine(expert_t, out_t, &on).map(drop)
    };
    // The first call loads the EP kernels; `prepare` would also compile
    // every collective kernel, which these samples never launch.
    let (mut times, mut cpu) = time_samples_prepared(comm, a, mode, &stream, ops, false, run)?;

    // The check run.
    let wrong = check(
        comm,
        &ep,
        cfg,
        &ids,
        &x,
        (x_t, sc_t, idx_t, w_t),
        (expert_t, out_t),
        &bufs[5],
        &stream,
    )?;
    ep.free()?;

    // The all-to-all pipeline: per destination, the rows that go there and
    // their metadata (scales, top-k ids and weights, token index), then the
    // bf16 rows back.
    let meta = scale_cols * 4 + k * 8 + 4;
    let counts = |src: usize, dst: usize| {
        ids[src]
            .iter()
            .filter(|t| dest_ranks(cfg, world, t) & (1 << dst) != 0)
            .count()
    };
    let send: Vec<usize> = (0..world).map(|r| counts(rank, r)).collect();
    let recv: Vec<usize> = (0..world).map(|r| counts(r, rank)).collect();
    let d_in_split: Vec<usize> = send.iter().map(|c| c * (row_bytes + meta)).collect();
    let d_out_split: Vec<usize> = recv.iter().map(|c| c * (row_bytes + meta)).collect();
    let c_in_split: Vec<usize> = recv.iter().map(|c| c * hd * 2).collect();
    let c_out_split: Vec<usize> = send.iter().map(|c| c * hd * 2).collect();
    let sum = |v: &[usize]| v.iter().sum::<usize>();
    let abufs = [
        vcomm.alloc(sum(&d_in_split).max(16))?,
        vcomm.alloc(sum(&d_out_split).max(16))?,
        vcomm.alloc(sum(&c_in_split).max(16))?,
        vcomm.alloc(sum(&c_out_split).max(16))?,
    ];
    let t = |i: usize, len: usize| Tensor::view(&abufs[i], DType::U8, 0, len);
    let (d_in, d_out) = (t(0, sum(&d_in_split))?, t(1, sum(&d_out_split))?);
    let (c_in, c_out) = (t(2, sum(&c_in_split))?, t(3, sum(&c_out_split))?);
    let astream = dev.create_stream()?;
    let run_a2a = |_: usize| -> Result<()> {
        let on = Call::on(&astream);
        vcomm.all_to_all_v_single(d_out, d_in, &d_out_split, &d_in_split, &on)?;
        vcomm
            .all_to_all_v_single(c_out, c_in, &c_out_split, &c_in_split, &on)
            .map(drop)
    };
    let (mut a_times, _) = time_samples_prepared(vcomm, a, mode, &astream, ops, false, run_a2a)?;
    Ok(Row {
        payload: if cfg.payload == EpPayload::Fp8 { "fp8" } else { "bf16" },
        tokens: n,
        mode,
        ep_us: median(&mut times),
        a2a_us: median(&mut a_times),
        cpu_us: median(&mut cpu),
        wrong,
    })
}

type Inputs = (Tensor, Option<Tensor>, Tensor, Tensor);

/// Wrong outputs of one more eager round: bf16 with identity experts
/// (every output bit), fp8 the received rows and counts.
#[allow(clippy::too_many_arguments)]
fn check<D: Device>(
    comm: &Communicator<D>,
    ep: &EpBuffer<D>,
    cfg: &EpConfig,
    ids: &[Vec<Vec<i32>>],
    x: &[u8],
    (x_t, sc_t, idx_t, w_t): Inputs,
    (expert_t, out_t): (Tensor, Tensor),
    out_buf: &D::Buffer,
    stream: &D::Stream,
) -> Result<usize> {
    let dev = comm.device();
    let (rank, world) = (comm.rank(), comm.size());
    let (n, hd) = (cfg.max_tokens_per_rank, cfg.hidden);
    let on = Call::on(stream);
    let read = |t: &Tensor| -> Result<Vec<u8>> {
        let bytes = t.bytes()?;
        let tmp = comm.alloc(bytes.max(16))?;
        dev.copy_device(tmp.ptr(), t.ptr(), bytes, stream)?;
        let mut v = vec![0u8; bytes];
        dev.copy_to_host(&tmp, 0, &mut v, stream)?;
        Ok(v)
    };
    let (_, recv) = ep.dispatch(x_t, sc_t, idx_t, w_t, n, &on)?;
    let mut wrong = 0;
    if cfg.payload == EpPayload::Bf16 {
        dev.copy_device(expert_t.ptr(), recv.recv_x.ptr(), recv.recv_x.bytes()?, stream)?;
        dev.memset(out_buf, 0, n * hd * 2, 0x7F, stream)?;
        ep.combine(expert_t, out_t, &on)?;
        let mut got = vec![0u8; n * hd * 2];
        dev.copy_to_host(out_buf, 0, &mut got, stream)?;
        for t in 0..n {
            let copies = dest_ranks(cfg, world, &ids[rank][t]).count_ones();
            for c in 0..hd {
                let v = half::bf16::from_le_bytes([x[2 * (t * hd + c)], x[2 * (t * hd + c) + 1]]).to_f32();
                let mut acc = v;
                for _ in 1..copies {
                    acc += v;
                }
                let want = if copies == 0 {
                    0
                } else {
                    half::bf16::from_f32(acc).to_bits()
                };
                let g = u16::from_le_bytes([got[2 * (t * hd + c)], got[2 * (t * hd + c) + 1]]);
                wrong += usize::from(g != want);
            }
        }
        return Ok(wrong);
    }
    let counts = read(&recv.recv_counts)?;
    let rows = read(&recv.recv_x)?;
    let src = read(&recv.recv_src_index)?;
    let word = |b: &[u8], i: usize| i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap_or([0; 4]));
    // The combine keeps the buffer's alternation; its output is not checked here.
    ep.combine(expert_t, out_t, &on)?;
    dev.synchronize(stream)?;
    for (sr, src_ids) in ids.iter().enumerate() {
        let want: Vec<usize> = (0..n)
            .filter(|&t| dest_ranks(cfg, world, &src_ids[t]) & (1 << rank) != 0)
            .collect();
        if word(&counts, sr) != want.len() as i32 {
            wrong += want.len().max(1);
            continue;
        }
        for (i, &t) in want.iter().enumerate() {
            let row = sr * n + i;
            let ok = word(&src, row) == t as i32 && rows[row * hd..(row + 1) * hd] == x_bytes(cfg, sr, t)[..];
            wrong += usize::from(!ok);
        }
    }
    Ok(wrong)
}
