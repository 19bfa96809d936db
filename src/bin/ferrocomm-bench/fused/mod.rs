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
//! stream ([`unfused::UNFUSED_SOURCE`], user kernels). Its outputs are
//! checked within a tolerance (the vendor's all-reduce order is not
//! ferrocomm's).
//!
//! `--fused-sp gathered,shard` adds, per pattern and size, the
//! sequence-parallel rows (`sp_gather_<pattern>`, `sp_shard_<pattern>`:
//! `Communicator::reduce_scatter_fused`, the residual this rank's shard;
//! tokens a multiple of the world size), checked bit for bit against the
//! same unfused reference on the same rows.
//!
//! Here: the flags and the table; `row` times a fused row, `moe` a MoE
//! row, `unfused` the pipeline beside it, `sp` a sequence-parallel row.

mod moe;
mod row;
mod sp;
mod unfused;

use ferrocomm::algo::fused::FusionPattern;
use ferrocomm::codec::Half16;
use ferrocomm::device::{BackendKind, Device};
use ferrocomm::testing::data::FromF64;
use ferrocomm::{Communicator, DType, Error, Result, SpOutput};

use crate::args::Args;
use moe::MoeRow;
use row::{RowSpec, Sample};
use unfused::Unfused;

pub fn bench_fused<D: Device>(comm: &Communicator<D>, a: &Args, patterns: &[FusionPattern]) -> Result<()> {
    if comm.rank() == 0 {
        print_header(comm, a);
    }
    let table = Table {
        comm,
        a,
        unfused: unfused_pipeline(comm, a)?,
    };
    let mut wrong_total = 0;
    for &dtype in &a.dtypes {
        wrong_total += match dtype {
            DType::BF16 => table.dtype_rows::<half::bf16>(patterns)?,
            DType::F16 => table.dtype_rows::<half::f16>(patterns)?,
            _ => return Err(Error::invalid(format!("--fused takes f16 or bf16, not {dtype}"))),
        };
    }
    if wrong_total > 0 {
        return Err(Error::Aborted(format!("{wrong_total} wrong fused outputs")));
    }
    Ok(())
}

/// The unfused MoE pipeline's local steps, with `--fused-moe` on GPU
/// backends (they are user kernels).
fn unfused_pipeline<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<Option<Unfused<D>>> {
    if a.fused_moe.is_empty() {
        return Ok(None);
    }
    if comm.device().facts().backend == BackendKind::Host {
        if comm.rank() == 0 {
            println!("# no unfused MoE rows: their finalize and add + RMSNorm steps are GPU user kernels");
        }
        return Ok(None);
    }
    Unfused::load(comm).map(Some)
}

/// The rows of one rank, and what they run on.
struct Table<'c, D: Device> {
    comm: &'c Communicator<D>,
    a: &'c Args,
    unfused: Option<Unfused<D>>,
}

impl<D: Device> Table<'_, D> {
    /// Every row of one dtype; the wrong outputs of them all.
    fn dtype_rows<S: FromF64 + Half16>(&self, patterns: &[FusionPattern]) -> Result<usize> {
        let mut wrong = 0;
        for &pattern in patterns {
            for &tokens in &self.a.tokens {
                wrong += self.algo_rows::<S>(pattern, tokens)?;
                wrong += self.unfused_rows::<S>(pattern, tokens)?;
                wrong += self.sp_rows::<S>(pattern, tokens)?;
            }
        }
        Ok(wrong)
    }

    /// Per `--algo` and mode: the fused row, and its MoE rows beside it.
    fn algo_rows<S: FromF64 + Half16>(&self, pattern: FusionPattern, tokens: usize) -> Result<usize> {
        let (comm, a, dtype) = (self.comm, self.a, <S as Half16>::DTYPE);
        let mut wrong = 0;
        for algo in &a.algos {
            let choice = ferrocomm::plan::parse_choice(algo)?;
            for &mode in a.modes() {
                let spec = RowSpec {
                    pattern,
                    tokens,
                    choice,
                    mode,
                    sf_layout: a.sf_layout,
                };
                // A kind whose workspace cannot hold the call (the LL
                // one-shot's lines at many tokens) refuses it on every rank
                // alike: no row, said so.
                let sample = match row::one::<D, S>(comm, a, &spec) {
                    Err(Error::InvalidArgument(m)) if m.contains("not fit") => {
                        if comm.rank() == 0 {
                            println!("# {pattern} {dtype} {tokens} tokens --algo {algo}: refused ({m})");
                        }
                        break;
                    }
                    r => r?,
                };
                let mut lines = vec![Line::new(pattern.name().into(), dtype, algo, &spec, sample)];
                for &topk in &a.fused_moe {
                    let sample = moe::fused(a, &MoeRow::<D, S>::new(comm, a, spec, topk)?)?;
                    let name = format!("moe{topk}_{}", pattern.name());
                    lines.push(Line::new(name, dtype, algo, &spec, sample));
                }
                wrong += lines.iter().map(|l| l.sample.wrong).sum::<usize>();
                if comm.rank() == 0 {
                    lines.iter().for_each(|l| print_line(l, a.hidden));
                }
            }
        }
        Ok(wrong)
    }

    /// The unfused pipeline's rows beside the MoE rows of `res` and `rms`:
    /// it does not depend on `--algo`, so once per top-k and mode.
    fn unfused_rows<S: FromF64 + Half16>(&self, pattern: FusionPattern, tokens: usize) -> Result<usize> {
        let (comm, a, dtype) = (self.comm, self.a, <S as Half16>::DTYPE);
        let Some(u) = &self.unfused else { return Ok(0) };
        if pattern.quant_dtype().is_some() || pattern.nvfp4() {
            return Ok(0);
        }
        let mut wrong = 0;
        for &topk in &a.fused_moe {
            for &mode in a.modes() {
                let spec = RowSpec {
                    pattern,
                    tokens,
                    choice: None,
                    mode,
                    sf_layout: a.sf_layout,
                };
                let sample = u.time(a, &MoeRow::<D, S>::new(comm, a, spec, topk)?)?;
                wrong += sample.wrong;
                if comm.rank() == 0 {
                    let name = format!("unfused{topk}_{}", pattern.name());
                    print_line(&Line::new(name, dtype, u.ar_name, &spec, sample), a.hidden);
                }
            }
        }
        Ok(wrong)
    }
}

impl<D: Device> Table<'_, D> {
    /// The sequence-parallel rows of `--fused-sp`: one kernel family, so
    /// once per form and mode (not per `--algo`; the algo column says
    /// `sp`). Tokens that are not a multiple of the world size, and
    /// `res` gathered (nothing to gather), have no row.
    fn sp_rows<S: FromF64 + Half16>(&self, pattern: FusionPattern, tokens: usize) -> Result<usize> {
        let (comm, a, dtype) = (self.comm, self.a, <S as Half16>::DTYPE);
        let mut wrong = 0;
        for &out in &a.fused_sp {
            let name = format!("{}_{}", out.kind().name(), pattern.name());
            if tokens % comm.size() != 0 || (out == SpOutput::Gathered && !pattern.norms()) {
                if comm.rank() == 0 {
                    println!("# {name} {dtype} {tokens} tokens: no row (tokens % world, or nothing to gather)");
                }
                continue;
            }
            for &mode in a.modes() {
                let spec = RowSpec {
                    pattern,
                    tokens,
                    choice: None,
                    mode,
                    sf_layout: a.sf_layout,
                };
                let sample = sp::one::<D, S>(comm, a, &spec, out)?;
                wrong += sample.wrong;
                if comm.rank() == 0 {
                    print_line(&Line::new(name.clone(), dtype, "sp", &spec, sample), a.hidden);
                }
            }
        }
        Ok(wrong)
    }
}

fn print_header<D: Device>(comm: &Communicator<D>, a: &Args) {
    let backend = comm.device().facts().backend;
    println!(
        "# ferrocomm-bench fused backend={} world={} iters={} warmup={} nvfp4 scale factors {} ({})",
        a.backend,
        comm.size(),
        a.iters_for(backend),
        a.warmup_for(backend),
        a.sf_layout,
        comm.device().facts().name
    );
    println!(
        "{:>20} {:>6} {:>7} {:>7} {:>14} {:>6} {:>10} {:>8} {:>7}",
        "pattern", "dtype", "tokens", "hidden", "algo", "mode", "time_us", "cpu_us", "#wrong"
    );
}

/// One printed row of the fused table.
struct Line<'a> {
    name: String,
    dtype: DType,
    tokens: usize,
    algo: &'a str,
    mode: &'a str,
    sample: Sample,
}

impl<'a> Line<'a> {
    fn new(name: String, dtype: DType, algo: &'a str, spec: &RowSpec<'a>, sample: Sample) -> Self {
        Line {
            name,
            dtype,
            tokens: spec.tokens,
            algo,
            mode: spec.mode,
            sample,
        }
    }
}

fn print_line(l: &Line<'_>, hidden: usize) {
    println!(
        "{:>20} {:>6} {:>7} {:>7} {:>14} {:>6} {:>10.2} {:>8.2} {:>7}",
        l.name,
        l.dtype.name(),
        l.tokens,
        hidden,
        l.algo,
        l.mode,
        l.sample.time,
        l.sample.cpu,
        l.sample.wrong
    );
}
