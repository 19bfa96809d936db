//! `--fused`: time `Communicator::all_reduce_fused` (all-reduce + residual
//! add (+ RMSNorm (+ quantization))) per `--tokens` x `--hidden`, the way
//! the other rows are timed (device events around a sample of
//! back-to-back calls, or one replay of a graph holding them; median over
//! iterations). Every row's outputs are checked bit for bit against the
//! unfused reference (`ferrocomm::testing::fused`). Only the fused call's
//! time is measured: the anchors to compare with (NCCL all-reduce, then add
//! and RMSNorm unfused) come from the torch baseline.
//!
//! `--fused-moe K[,K..]` adds, per pattern and size, the MoE-finalize rows
//! (`moe<K>_<pattern>`: the fused call with the MoE prologue, top-K experts
//! of `tokens * K` permuted rows plus a shared expert, checked bit for bit)
//! and, on GPU backends for `res` and `rms`, the unfused pipeline beside
//! them (`unfused<K>_<pattern>`): a finalize kernel, the all-reduce (NCCL
//! when the vendor library is loaded, else ferrocomm's `auto`, named in the
//! algo column), then an add + RMSNorm kernel, three launches on one
//! stream ([`UNFUSED_SOURCE`], user kernels). Its outputs are checked
//! within a tolerance (the vendor's all-reduce order is not ferrocomm's).

use ferrocomm::algo::fused::FusionPattern;
use ferrocomm::codec::Half16;
use ferrocomm::device::{BackendKind, Device};
use ferrocomm::testing::data::{self, FromF64, Values};
use ferrocomm::testing::fused::{fused_reference, moe_finalize_reference, moe_permutation};
use ferrocomm::Algorithm;
use ferrocomm::{Call, Communicator, DType, Error, Fusion, MoeFinalize, ReduceOp, Result, Tensor, UserModule};

use super::{median, time_samples, Args, OPS_PER_SAMPLE};

/// `--fused` patterns: names as `FusionPattern::name`, or `all`.
pub fn parse_patterns(s: &str) -> Result<Vec<FusionPattern>> {
    if s == "all" {
        return Ok(FusionPattern::ALL.to_vec());
    }
    s.split(',')
        .map(|x| {
            FusionPattern::ALL
                .into_iter()
                .find(|p| p.name() == x.trim())
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "unknown --fused pattern {x:?} (res, rms, rms_fp8, rms_fp8tok, rms_i8tok, all)"
                    ))
                })
        })
        .collect()
}

/// `--fused-moe`: top-k values, each 1 to `MOE_MAX_TOPK`.
pub fn parse_topks(s: &str) -> Result<Vec<usize>> {
    let max = ferrocomm::algo::fused::MOE_MAX_TOPK;
    s.split(',')
        .map(|x| match x.trim().parse::<usize>() {
            Ok(k) if (1..=max).contains(&k) => Ok(k),
            _ => Err(Error::invalid(format!(
                "--fused-moe takes top-k values 1 to {max}, not {x:?}"
            ))),
        })
        .collect()
}

/// The static FP8 scale of `rms_fp8` rows.
const STATIC_SCALE: f32 = 0.01;

/// One printed row of the fused table.
struct Line<'a> {
    name: String,
    dtype: DType,
    tokens: usize,
    algo: &'a str,
    mode: &'a str,
    time: f64,
    cpu: f64,
    wrong: usize,
}

fn print_line(l: &Line<'_>, hidden: usize) {
    println!(
        "{:>16} {:>6} {:>7} {:>7} {:>14} {:>6} {:>10.2} {:>8.2} {:>7}",
        l.name,
        l.dtype.name(),
        l.tokens,
        hidden,
        l.algo,
        l.mode,
        l.time,
        l.cpu,
        l.wrong
    );
}

pub fn bench_fused<D: Device>(comm: &Communicator<D>, a: &Args, patterns: &[FusionPattern]) -> Result<()> {
    let rank = comm.rank();
    if rank == 0 {
        println!(
            "# ferrocomm-bench fused backend={} world={} iters={} warmup={} ({})",
            a.backend,
            comm.size(),
            a.iters_for(comm.device().facts().backend),
            a.warmup_for(comm.device().facts().backend),
            comm.device().facts().name
        );
        println!(
            "{:>16} {:>6} {:>7} {:>7} {:>14} {:>6} {:>10} {:>8} {:>7}",
            "pattern", "dtype", "tokens", "hidden", "algo", "mode", "time_us", "cpu_us", "#wrong"
        );
    }
    let modes: &[&str] = match (a.eager, a.graph) {
        (true, true) => &["eager", "graph"],
        (false, true) => &["graph"],
        _ => &["eager"],
    };
    let mut wrong_total = 0;
    // The unfused MoE pipeline's local steps (GPU backends only).
    let unfused = if a.fused_moe.is_empty() {
        None
    } else {
        match comm.device().facts().backend {
            BackendKind::Host => {
                if rank == 0 {
                    println!("# no unfused MoE rows: their finalize and add + RMSNorm steps are GPU user kernels");
                }
                None
            }
            _ => Some(comm.load_user_module("fc_bench_unfused", UNFUSED_SOURCE)?),
        }
    };
    // The unfused pipeline's all-reduce: NCCL/RCCL when loaded.
    let (ar_name, ar_choice) = if comm.has_vendor_library() {
        ("nccl", Some(Algorithm::Vendor))
    } else {
        ("auto", None)
    };
    for &dtype in &a.dtypes {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(Error::invalid(format!("--fused takes f16 or bf16, not {dtype}")));
        }
        for &pattern in patterns {
            for &tokens in &a.tokens {
                for algo in &a.algos {
                    let choice = ferrocomm::plan::parse_choice(algo)?;
                    for &mode in modes {
                        let row = match dtype {
                            DType::BF16 => one::<D, half::bf16>(comm, a, pattern, tokens, choice, mode),
                            _ => one::<D, half::f16>(comm, a, pattern, tokens, choice, mode),
                        };
                        // A kind whose workspace cannot hold the call (the
                        // LL one-shot's lines at many tokens) refuses it on
                        // every rank alike: no row, said so.
                        let (time, cpu, wrong) = match row {
                            Err(Error::InvalidArgument(m)) if m.contains("not fit") => {
                                if rank == 0 {
                                    println!("# {pattern} {dtype} {tokens} tokens --algo {algo}: refused ({m})");
                                }
                                break;
                            }
                            r => r?,
                        };
                        wrong_total += wrong;
                        let mut lines = vec![Line {
                            name: pattern.name().into(),
                            dtype,
                            tokens,
                            algo,
                            mode,
                            time,
                            cpu,
                            wrong,
                        }];
                        for &topk in &a.fused_moe {
                            let (time, cpu, wrong) = match dtype {
                                DType::BF16 => {
                                    one_moe::<D, half::bf16>(comm, a, pattern, tokens, topk, choice, mode, None)?
                                }
                                _ => one_moe::<D, half::f16>(comm, a, pattern, tokens, topk, choice, mode, None)?,
                            };
                            wrong_total += wrong;
                            lines.push(Line {
                                name: format!("moe{topk}_{}", pattern.name()),
                                dtype,
                                tokens,
                                algo,
                                mode,
                                time,
                                cpu,
                                wrong,
                            });
                        }
                        if rank == 0 {
                            lines.iter().for_each(|l| print_line(l, a.hidden));
                        }
                    }
                }
                // The unfused pipeline does not depend on --algo: once per mode.
                let Some(module) = unfused.as_ref() else { continue };
                if pattern.quant_dtype().is_some() {
                    continue;
                }
                for &topk in &a.fused_moe {
                    for &mode in modes {
                        let u = Unfused { module, ar_choice };
                        let (time, cpu, wrong) = match dtype {
                            DType::BF16 => {
                                one_moe::<D, half::bf16>(comm, a, pattern, tokens, topk, None, mode, Some(u))?
                            }
                            _ => one_moe::<D, half::f16>(comm, a, pattern, tokens, topk, None, mode, Some(u))?,
                        };
                        wrong_total += wrong;
                        if rank == 0 {
                            print_line(
                                &Line {
                                    name: format!("unfused{topk}_{}", pattern.name()),
                                    dtype,
                                    tokens,
                                    algo: ar_name,
                                    mode,
                                    time,
                                    cpu,
                                    wrong,
                                },
                                a.hidden,
                            );
                        }
                    }
                }
            }
        }
    }
    if wrong_total > 0 {
        return Err(Error::Aborted(format!("{wrong_total} wrong fused outputs")));
    }
    Ok(())
}

/// One row: (median us per call, median CPU us per call, wrong outputs).
fn one<D: Device, S: FromF64 + Half16>(
    comm: &Communicator<D>,
    a: &Args,
    pattern: FusionPattern,
    tokens: usize,
    choice: Option<Algorithm>,
    mode: &str,
) -> Result<(f64, f64, usize)> {
    let dev = comm.device();
    let backend = dev.facts().backend;
    let (rank, world, hidden) = (comm.rank(), comm.size(), a.hidden);
    let dtype = <S as Half16>::DTYPE;
    let n = tokens * hidden;
    let gen = |r: usize, k: usize, seed: u64| -> Vec<S> {
        (0..k)
            .map(|i| <S as FromF64>::from_f64(data::input_value(seed, r, i, ReduceOp::Sum, Values::Random)))
            .collect()
    };
    let inputs: Vec<Vec<S>> = (0..world).map(|r| gen(r, n, 1)).collect();
    let residual = gen(0, n, 2);
    let weight = gen(0, hidden, 3);
    let es = dtype.size();
    let bufs = [n * es, n * es, n * es, hidden * es, n * es, n, tokens.max(1) * 4]
        .into_iter()
        .map(|b| comm.alloc(b.max(16)))
        .collect::<Result<Vec<_>>>()?;
    comm.write(&bufs[0], 0, &data::to_bytes(&inputs[rank]))?;
    comm.write(&bufs[1], 0, &data::to_bytes(&residual))?;
    comm.write(&bufs[3], 0, &data::to_bytes(&weight))?;
    comm.write(&bufs[6], 0, &STATIC_SCALE.to_le_bytes())?;
    dev.synchronize(comm.stream())?;
    let t = |k: usize, dt: DType, count: usize| Tensor::view(&bufs[k], dt, 0, count);
    // Out of place, so repeated calls see the same residual.
    let mut f = Fusion::new(pattern, hidden, t(1, dtype, n)?, t(2, dtype, n)?);
    if pattern.norms() {
        f = f.with_norm(t(3, dtype, hidden)?, 1e-6).with_norm_out(t(4, dtype, n)?);
    }
    if let Some(qdt) = pattern.quant_dtype() {
        let scales = if pattern.per_token() { tokens } else { 1 };
        f = f.with_quant(t(5, qdt, n)?, t(6, DType::F32, scales)?);
    }
    let input = t(0, dtype, n)?;
    let stream = dev.create_stream()?;
    let run = || {
        comm.all_reduce_fused(input, &f, &crate::colls::with_algo(Call::on(&stream), choice))
            .map(|_| ())
    };
    let ops = match backend {
        ferrocomm::device::BackendKind::Host => 1,
        _ => OPS_PER_SAMPLE,
    };
    let (mut times, mut cpu) = time_samples(comm, a, mode, &stream, ops, |_| run())?;

    // The outputs of the last call against the unfused reference.
    let want = fused_reference(pattern, hidden, 1e-6, &inputs, &residual, &weight, STATIC_SCALE);
    let read = |k: usize, len: usize| -> Result<Vec<u8>> {
        let mut got = vec![0u8; len];
        dev.copy_to_host(&bufs[k], 0, &mut got, &stream)?;
        Ok(got)
    };
    let mut wrong = usize::from(read(2, n * es)? != data::to_bytes(&want.residual));
    if pattern.norms() {
        wrong += usize::from(read(4, n * es)? != data::to_bytes(&want.norm));
    }
    if pattern.quant_dtype().is_some() {
        wrong += usize::from(read(5, n)? != want.quant);
    }
    if pattern.per_token() {
        wrong += usize::from(read(6, tokens * 4)? != data::to_bytes(&want.scales));
    }
    Ok((median(&mut times), median(&mut cpu), wrong))
}

/// The unfused MoE pipeline's local steps as GPU user kernels (the
/// communicator's prelude: vendor neutral), one entry point per dtype:
///
/// - `fcb_moe_finalize_<dtype>`: `x[t] = shared[t] + sum_k scale[t][k] *
///   expert[idx[t][k]]` per 8-element pack (the order of the fused
///   prologue; f32 weights), one thread per pack, grid-stride.
/// - `fcb_add_rms_norm_<dtype>`: one block per row, `residual_out =
///   round(ar + residual_in)`, then (`norm != 0`) `norm_out = round(x *
///   rstd * w)` with the sum of squares reduced by warp butterflies and a
///   shared-memory pass (as vLLM's `fused_add_rms_norm`; not the fused
///   kernel's lane order, so its bits may differ by an ulp).
pub const UNFUSED_SOURCE: &str = include_str!("../../../kernels-cuda/examples/unfused_bench.cu");

/// Threads of the unfused kernels' blocks (a multiple of 64: every
/// vendor's warp; at most 1024, the shared partials' bound).
const UNFUSED_BLOCK: u32 = 256;

/// The unfused pipeline of a MoE row: the user module and the all-reduce's
/// algorithm.
pub struct Unfused<'m, D: Device> {
    pub module: &'m UserModule<D>,
    pub ar_choice: Option<Algorithm>,
}

/// Little-endian bytes of a `#[repr(C)]`-like list of u64 words, then the
/// tail bytes (the kernels' argument structs).
fn arg_bytes(words: &[u64], tail: &[u8]) -> Vec<u8> {
    let mut b: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    b.extend_from_slice(tail);
    b
}

/// Whether `got` is within the unfused pipeline's tolerance of `want`:
/// equal bits, both NaN, or `|got - want| <= |want| / 32 + 2^-10` (a few
/// roundings of a 16-bit float apart).
fn close<S: Half16>(got: &[u8], want: &[S]) -> usize {
    got.chunks_exact(2)
        .zip(want)
        .filter(|(g, w)| {
            let g = S::from_bits(u16::from_le_bytes([g[0], g[1]])).to_f32();
            let w = w.to_f32();
            let ok = g.to_bits() == w.to_bits()
                || (g.is_nan() && w.is_nan())
                || (g - w).abs() <= w.abs() / 32.0 + 1.0 / 1024.0;
            !ok
        })
        .count()
}

/// One MoE row, top-`topk` over `tokens * topk` permuted rows plus a shared
/// expert, f32 router weights: the fused call (`unfused` = None, the
/// family from `choice`; outputs checked bit for bit) or the unfused
/// pipeline (three launches; outputs checked within [`close`]). (median us
/// per call, median CPU us per call, wrong outputs).
#[allow(clippy::too_many_arguments)]
pub fn one_moe<D: Device, S: FromF64 + Half16>(
    comm: &Communicator<D>,
    a: &Args,
    pattern: FusionPattern,
    tokens: usize,
    topk: usize,
    choice: Option<Algorithm>,
    mode: &str,
    unfused: Option<Unfused<'_, D>>,
) -> Result<(f64, f64, usize)> {
    let dev = comm.device();
    let backend = dev.facts().backend;
    let (rank, world, hidden) = (comm.rank(), comm.size(), a.hidden);
    let dtype = <S as Half16>::DTYPE;
    let n = tokens * hidden;
    let pairs = tokens * topk;
    let rows = pairs;
    let gen = |r: usize, k: usize, seed: u64| -> Vec<S> {
        (0..k)
            .map(|i| <S as FromF64>::from_f64(data::input_value(seed, r, i, ReduceOp::Sum, Values::Random)))
            .collect()
    };
    let experts: Vec<Vec<S>> = (0..world).map(|r| gen(r, rows * hidden, 11)).collect();
    let shared: Vec<Vec<S>> = (0..world).map(|r| gen(r, n, 12)).collect();
    let residual = gen(0, n, 2);
    let weight = gen(0, hidden, 3);
    let idx = moe_permutation(13, rows, pairs);
    let scales: Vec<f32> = (0..pairs)
        .map(|i| (0.5 * data::input_value(14, 0, i, ReduceOp::Sum, Values::Random)) as f32)
        .collect();
    let es = dtype.size();
    // Buffers: 0 experts' rows, 1 residual in, 2 residual out, 3 weight, 4
    // norm out, 5 quant out, 6 scale, 7 indices, 8 router weights, 9 shared
    // expert, 10 the finalized rows (unfused).
    let sizes = [
        rows * hidden * es,
        n * es,
        n * es,
        hidden * es,
        n * es,
        n,
        tokens.max(1) * 4,
        pairs * 4,
        pairs * 4,
        n * es,
        n * es,
    ];
    let bufs = sizes
        .into_iter()
        .map(|b| comm.alloc(b.max(16)))
        .collect::<Result<Vec<_>>>()?;
    comm.write(&bufs[0], 0, &data::to_bytes(&experts[rank]))?;
    comm.write(&bufs[1], 0, &data::to_bytes(&residual))?;
    comm.write(&bufs[3], 0, &data::to_bytes(&weight))?;
    comm.write(&bufs[6], 0, &STATIC_SCALE.to_le_bytes())?;
    comm.write(&bufs[7], 0, &data::to_bytes(&idx))?;
    comm.write(&bufs[8], 0, &data::to_bytes(&scales))?;
    comm.write(&bufs[9], 0, &data::to_bytes(&shared[rank]))?;
    dev.synchronize(comm.stream())?;
    let t = |k: usize, dt: DType, count: usize| Tensor::view(&bufs[k], dt, 0, count);
    let stream = dev.create_stream()?;
    let ops = match backend {
        BackendKind::Host => 1,
        _ => OPS_PER_SAMPLE,
    };
    let xs: Vec<Vec<S>> = (0..world)
        .map(|r| moe_finalize_reference(hidden, topk, &experts[r], &idx, &scales, Some(&shared[r])))
        .collect();
    let want = fused_reference(pattern, hidden, 1e-6, &xs, &residual, &weight, STATIC_SCALE);
    let read = |k: usize, len: usize| -> Result<Vec<u8>> {
        let mut got = vec![0u8; len];
        dev.copy_to_host(&bufs[k], 0, &mut got, &stream)?;
        Ok(got)
    };

    let Some(u) = unfused else {
        let mut f = Fusion::new(pattern, hidden, t(1, dtype, n)?, t(2, dtype, n)?);
        if pattern.norms() {
            f = f.with_norm(t(3, dtype, hidden)?, 1e-6).with_norm_out(t(4, dtype, n)?);
        }
        if let Some(qdt) = pattern.quant_dtype() {
            let scales = if pattern.per_token() { tokens } else { 1 };
            f = f.with_quant(t(5, qdt, n)?, t(6, DType::F32, scales)?);
        }
        let moe = MoeFinalize::new(t(7, DType::I32, pairs)?, t(8, DType::F32, pairs)?, topk)
            .with_shared_expert_output(t(9, dtype, n)?);
        let f = f.with_moe_finalize(moe);
        let input = t(0, dtype, rows * hidden)?;
        let run = || {
            comm.all_reduce_fused(input, &f, &crate::colls::with_algo(Call::on(&stream), choice))
                .map(|_| ())
        };
        let (mut times, mut cpu) = time_samples(comm, a, mode, &stream, ops, |_| run())?;
        let mut wrong = usize::from(read(2, n * es)? != data::to_bytes(&want.residual));
        if pattern.norms() {
            wrong += usize::from(read(4, n * es)? != data::to_bytes(&want.norm));
        }
        if pattern.quant_dtype().is_some() {
            wrong += usize::from(read(5, n)? != want.quant);
        }
        if pattern.per_token() {
            wrong += usize::from(read(6, tokens * 4)? != data::to_bytes(&want.scales));
        }
        return Ok((median(&mut times), median(&mut cpu), wrong));
    };

    // The unfused pipeline: finalize, all-reduce in place, add (+ RMSNorm).
    let suffix = dtype.name();
    let ptr = |k: usize| t(k, dtype, 1).map(|t| t.ptr().0);
    let fin = arg_bytes(
        &[
            ptr(0)?,
            ptr(7)?,
            ptr(8)?,
            ptr(9)?,
            ptr(10)?,
            tokens as u64,
            hidden as u64,
            topk as u64,
            rows as u64,
        ],
        &[],
    );
    let mut tail = 1e-6f32.to_le_bytes().to_vec();
    tail.extend_from_slice(&u32::from(pattern.norms()).to_le_bytes());
    let norm = arg_bytes(&[ptr(10)?, ptr(1)?, ptr(2)?, ptr(3)?, ptr(4)?, hidden as u64], &tail);
    let fin_grid = (n / 8).div_ceil(UNFUSED_BLOCK as usize).clamp(1, 1024) as u32;
    let x = t(10, dtype, n)?;
    let run = || -> Result<()> {
        let call = Call::on(&stream);
        // SAFETY: `fin` and `norm` are the byte images of FcbFinalize and
        // FcbNorm (u64 words, then f32 and u32), and every address in them
        // is a live buffer above of the size the kernels touch: `rows`
        // expert rows, `pairs` indices (all below `rows`) and weights,
        // `tokens` rows of the shared expert, x, the residuals and the
        // normed output, `hidden` weights.
        unsafe {
            comm.launch_user(
                u.module,
                &format!("fcb_moe_finalize_{suffix}"),
                fin_grid,
                UNFUSED_BLOCK,
                &fin,
                &call,
            )?;
        }
        comm.all_reduce(
            x,
            ReduceOp::Sum,
            &crate::colls::with_algo(Call::on(&stream), u.ar_choice),
        )?;
        // SAFETY: as above.
        unsafe {
            comm.launch_user(
                u.module,
                &format!("fcb_add_rms_norm_{suffix}"),
                tokens as u32,
                UNFUSED_BLOCK,
                &norm,
                &call,
            )?;
        }
        Ok(())
    };
    let (mut times, mut cpu) = time_samples(comm, a, mode, &stream, ops, |_| run())?;
    let mut wrong = close(&read(2, n * es)?, &want.residual);
    if pattern.norms() {
        wrong += close(&read(4, n * es)?, &want.norm);
    }
    Ok((median(&mut times), median(&mut cpu), wrong))
}
