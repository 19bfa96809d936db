//! `--fused`: time `Communicator::all_reduce_fused` (all-reduce + residual
//! add (+ RMSNorm (+ quantization))) per `--tokens` x `--hidden`, the way
//! the other rows are timed (device events around a sample of
//! back-to-back calls, or one replay of a graph holding them; median over
//! iterations). Every row's outputs are checked bit for bit against the
//! unfused reference (`ferrocomm::testing::fused`). Only the fused call's
//! time is measured: the anchors to compare with (NCCL all-reduce, then add
//! and RMSNorm unfused) come from the torch baseline.

use ferrocomm::algo::fused::FusionPattern;
use ferrocomm::algo::AlgoChoice;
use ferrocomm::codec::Half16;
use ferrocomm::device::Device;
use ferrocomm::testing::data::{self, FromF64, Values};
use ferrocomm::testing::fused::fused_reference;
use ferrocomm::{Call, Communicator, DType, Error, Fusion, ReduceOp, Result, Tensor};

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

/// The static FP8 scale of `rms_fp8` rows.
const STATIC_SCALE: f32 = 0.01;

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
            "{:>12} {:>6} {:>7} {:>7} {:>14} {:>6} {:>10} {:>8} {:>7}",
            "pattern", "dtype", "tokens", "hidden", "algo", "mode", "time_us", "cpu_us", "#wrong"
        );
    }
    let modes: &[&str] = match (a.eager, a.graph) {
        (true, true) => &["eager", "graph"],
        (false, true) => &["graph"],
        _ => &["eager"],
    };
    let mut wrong_total = 0;
    for &dtype in &a.dtypes {
        for &pattern in patterns {
            for &tokens in &a.tokens {
                for algo in &a.algos {
                    let choice: AlgoChoice = algo.parse()?;
                    for &mode in modes {
                        let (time, cpu, wrong) = match dtype {
                            DType::BF16 => one::<D, half::bf16>(comm, a, pattern, tokens, choice, mode)?,
                            DType::F16 => one::<D, half::f16>(comm, a, pattern, tokens, choice, mode)?,
                            other => return Err(Error::invalid(format!("--fused takes f16 or bf16, not {other}"))),
                        };
                        wrong_total += wrong;
                        if rank == 0 {
                            println!(
                                "{:>12} {:>6} {:>7} {:>7} {:>14} {:>6} {:>10.2} {:>8.2} {:>7}",
                                pattern.name(),
                                dtype.name(),
                                tokens,
                                a.hidden,
                                algo,
                                mode,
                                time,
                                cpu,
                                wrong
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
    choice: AlgoChoice,
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
        comm.all_reduce_fused(input, &f, &Call::on(&stream).algo(choice))
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
