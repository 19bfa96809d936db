//! The unfused MoE pipeline beside the fused MoE rows (GPU backends): a
//! finalize kernel, the all-reduce in place (NCCL/RCCL when loaded, else
//! ferrocomm's `auto`), then an add (+ RMSNorm) kernel; three launches on
//! one stream, outputs checked within [`close`].

use ferrocomm::algo::layout::MAX_BLOCKS;
use ferrocomm::codec::Half16;
use ferrocomm::device::Device;
use ferrocomm::{Algorithm, Call, Communicator, ReduceOp, Result, UserModule};

use super::moe::MoeRow;
use super::row::{ops_per_sample, Buffers, RowSpec, Sample, EPS};
use crate::args::Args;
use crate::colls::with_algo;
use crate::timing::time_samples;

/// The unfused MoE pipeline's local steps as GPU user kernels (the
/// communicator's prelude: vendor neutral), one entry point per dtype:
///
/// - `fcb_moe_finalize_<dtype>`: `x[t] = shared[t] + sum_k scale[t][k] *
///   expert[idx[t][k]]` per 8-element pack (the order of the fused
///   prologue; f32 weights), one thread per pack, grid-stride.
/// - `fcb_add_rms_norm_<dtype>`: one block per row (rows strided over the
///   grid), `residual_out =
///   round(ar + residual_in)`, then (`norm != 0`) `norm_out = round(x *
///   rstd * w)` with the sum of squares reduced by warp butterflies and a
///   shared-memory pass (as vLLM's `fused_add_rms_norm`; not the fused
///   kernel's lane order, so its bits may differ by an ulp).
pub const UNFUSED_SOURCE: &str = include_str!("../../../../kernels-cuda/examples/unfused_bench.cu");

/// Threads of the unfused kernels' blocks (a multiple of 64: every
/// vendor's warp; at most 1024, the shared partials' bound).
const UNFUSED_BLOCK: u32 = 256;

/// The unfused pipeline: the user module, and the all-reduce's algorithm
/// with its name in the algo column.
pub struct Unfused<D: Device> {
    module: UserModule<D>,
    pub ar_name: &'static str,
    ar_choice: Option<Algorithm>,
}

impl<D: Device> Unfused<D> {
    /// The kernels compiled, and the all-reduce: NCCL/RCCL when loaded.
    pub fn load(comm: &Communicator<D>) -> Result<Self> {
        let module = comm.load_user_module("fc_bench_unfused", UNFUSED_SOURCE)?;
        let (ar_name, ar_choice) = if comm.has_vendor_library() {
            ("nccl", Some(Algorithm::Vendor))
        } else {
            ("auto", None)
        };
        Ok(Unfused {
            module,
            ar_name,
            ar_choice,
        })
    }

    /// A MoE row through the pipeline, timed; the outputs of the last run
    /// within [`close`] of the fused call's.
    pub fn time<S: Half16>(&self, a: &Args, row: &MoeRow<'_, '_, D, S>) -> Result<Sample> {
        let MoeRow { spec, topk, bufs, want } = row;
        let (comm, stream) = (bufs.comm, &bufs.stream);
        let (dtype, hidden, tokens) = (<S as Half16>::DTYPE, a.hidden, spec.tokens);
        let n = tokens * hidden;
        let (fin, norm) = kernel_args(bufs, spec, *topk, hidden, dtype)?;
        // Both kernels stride over their work: a launch takes at most
        // MAX_BLOCKS blocks.
        let fin_grid = (n / 8).div_ceil(UNFUSED_BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
        let norm_grid = tokens.clamp(1, MAX_BLOCKS) as u32;
        let x = bufs.t(10, dtype, n)?;
        let suffix = dtype.name();
        let run = || -> Result<()> {
            let call = Call::on(stream);
            // SAFETY: `fin` and `norm` are the byte images of FcbFinalize and
            // FcbNorm (u64 words, then f32 and u32), and every address in them
            // is a live buffer of `bufs` of the size the kernels touch: `rows`
            // expert rows, `pairs` indices (all below `rows`) and weights,
            // `tokens` rows of the shared expert, x, the residuals and the
            // normed output, `hidden` weights.
            unsafe {
                let finalize = format!("fcb_moe_finalize_{suffix}");
                comm.launch_user(&self.module, &finalize, fin_grid, UNFUSED_BLOCK, &fin, &call)?;
            }
            comm.all_reduce(x, ReduceOp::Sum, &with_algo(Call::on(stream), self.ar_choice))?;
            // SAFETY: as above.
            unsafe {
                let add_norm = format!("fcb_add_rms_norm_{suffix}");
                comm.launch_user(&self.module, &add_norm, norm_grid, UNFUSED_BLOCK, &norm, &call)?;
            }
            Ok(())
        };
        let ops = ops_per_sample(comm.device().facts().backend);
        let times = time_samples(comm, a, spec.mode, stream, ops, |_| run())?;
        let es = dtype.size();
        let mut wrong = close(&bufs.read(2, n * es)?, &want.residual);
        if spec.pattern.norms() {
            wrong += close(&bufs.read(4, n * es)?, &want.norm);
        }
        Ok(Sample::new(times, wrong))
    }
}

/// The argument structs of the two kernels, as bytes: FcbFinalize (the
/// expert rows, indices, weights, shared expert, finalized rows; tokens,
/// hidden, topk, rows) and FcbNorm (the finalized rows, residual in and
/// out, weight, norm out; hidden; epsilon, whether to norm).
fn kernel_args<D: Device>(
    bufs: &Buffers<'_, D>,
    spec: &RowSpec<'_>,
    topk: usize,
    hidden: usize,
    dtype: ferrocomm::DType,
) -> Result<(Vec<u8>, Vec<u8>)> {
    let rows = spec.tokens * topk;
    let ptr = |k: usize| bufs.t(k, dtype, 1).map(|t| t.ptr().0);
    let sizes = [spec.tokens as u64, hidden as u64, topk as u64, rows as u64];
    let fin = arg_bytes(&[ptr(0)?, ptr(7)?, ptr(8)?, ptr(9)?, ptr(10)?], &sizes, &[]);
    let mut tail = EPS.to_le_bytes().to_vec();
    tail.extend_from_slice(&u32::from(spec.pattern.norms()).to_le_bytes());
    let norm = arg_bytes(
        &[ptr(10)?, ptr(1)?, ptr(2)?, ptr(3)?, ptr(4)?],
        &[hidden as u64, spec.tokens as u64],
        &tail,
    );
    Ok((fin, norm))
}

/// Little-endian bytes of a `#[repr(C)]`-like list of u64 words (addresses,
/// then sizes), then the tail bytes (the kernels' argument structs).
fn arg_bytes(addresses: &[u64], sizes: &[u64], tail: &[u8]) -> Vec<u8> {
    let mut b: Vec<u8> = addresses.iter().chain(sizes).flat_map(|w| w.to_le_bytes()).collect();
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
