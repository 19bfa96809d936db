//! The conformance suite's part for every collective beyond all-reduce:
//! premul_sum, broadcast of every dtype, reduce, all-gather, reduce-scatter,
//! all-to-all(-v), gather, scatter, sends and receives, and graph replays of
//! them. On the host backend (ferrocomm's own protocols) every result is
//! compared bit for bit with the reference. On GPUs these go to NCCL/RCCL,
//! whose reductions are compared bit for bit where the values make every
//! order exact, and against fp64 with a bound where they do not; without
//! NCCL/RCCL the suite records that it skipped them.

use half::{bf16, f16};

use super::conformance::{context, Suite, OFFSETS};
use super::data::{self, FromF64, Values};
use crate::algo::kernels::KERNEL_OPS;
use crate::comm::{Call, P2p, Reduction, Tensor};
use crate::device::{BackendKind, Device};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;

/// Bytes of `rank`'s block `tag` (any dtype: the collectives only move them).
pub(super) fn block_bytes(seed: u64, rank: usize, tag: u64, len: usize) -> Vec<u8> {
    (0..len.div_ceil(8))
        .flat_map(|i| data::draw(seed ^ tag.wrapping_mul(0x9e37_79b9), rank, i).to_le_bytes())
        .take(len)
        .collect()
}

/// Dtypes the data-moving cases cycle through (every element size).
const MOVED: [DType; 6] = [
    DType::F32,
    DType::BF16,
    DType::U8,
    DType::I64,
    DType::F8E4M3,
    DType::F64,
];

/// Dispatch `$f::<T>(args)` on a reducible dtype.
macro_rules! typed {
    ($dtype:expr, $self:ident . $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $self.$f::<f32>($($arg),*),
            DType::F16 => $self.$f::<f16>($($arg),*),
            DType::BF16 => $self.$f::<bf16>($($arg),*),
            _ => $self.$f::<i32>($($arg),*),
        }
    };
}

impl<D: Device> Suite<'_, D> {
    fn host(&self) -> bool {
        self.comm.device().facts().backend == BackendKind::Host
    }

    /// Whether `what`, which GPUs still hand to NCCL/RCCL (send/recv, the
    /// all-reduce's premul_sum), runs here: always on the host; on GPUs if
    /// the library is loaded (else the skip is recorded). Everything else
    /// runs ferrocomm's kernels on GPUs without the library, so it always runs.
    fn vendor_runs(&mut self, what: &str) -> bool {
        if self.host() || self.comm.has_vendor_library() {
            return true;
        }
        let backend = self.comm.device().facts().backend.name();
        self.skip(format!(
            "{what}: goes to NCCL/RCCL on {backend}, which is not loaded here"
        ));
        false
    }

    /// The ops a reduction case covers: every op ferrocomm's kernels reduce by
    /// (ops NCCL/RCCL lack take the kernels, whatever the route), but the
    /// bitwise ones where the communicator refuses them (across nodes on
    /// GPUs; the all-reduce matrix checks that refusal).
    fn ops_for(&self, dtype: DType) -> Vec<ReduceOp> {
        KERNEL_OPS
            .into_iter()
            .filter(|&op| dtype.supports(op))
            .filter(|&op| !self.reference.bitwise_refused || !op.is_bitwise())
            .collect()
    }

    /// A reduction result: bit for bit where the route is ferrocomm's rule
    /// or every order is exact; against fp64 otherwise (`sums` gives the
    /// exact results and the sums of magnitudes, computed only then).
    #[allow(clippy::too_many_arguments)]
    fn check_reduced<T: FromF64>(
        &mut self,
        case: &str,
        got: &[u8],
        want: &[T],
        sums: impl FnOnce() -> (Vec<f64>, Vec<f64>),
        bitwise: bool,
        shared: bool,
    ) -> Result<()> {
        if bitwise || !T::DTYPE.is_float() {
            return if shared {
                self.check(case, got, want)
            } else {
                self.check_local(case, got, want)
            };
        }
        let (exact, abs) = sums();
        self.report.collectives += 1;
        self.report.elements_checked += want.len();
        let world = self.comm.size() as f64;
        let eps = match T::DTYPE {
            DType::F16 => 2f64.powi(-10),
            DType::BF16 => 2f64.powi(-7),
            _ => f32::EPSILON as f64,
        };
        let got: Vec<T> = data::from_bytes(got);
        for (i, g) in got.iter().enumerate() {
            // NCCL may accumulate in the element type and in any order.
            let bound = 2.0 * world * eps * abs[i] + eps * exact[i].abs() + f64::MIN_POSITIVE;
            let g = g.to_f64();
            if !((g - exact[i]).abs() <= bound || (g.is_nan() && exact[i].is_nan())) {
                self.fail(format!(
                    "{case}: element {i} = {g} is off {} by more than {bound}",
                    exact[i]
                ));
                break;
            }
        }
        Ok(())
    }

    /// Everything beyond all-reduce.
    pub(super) fn collectives(&mut self) -> Result<()> {
        if self.reference.levels_only {
            // Only the levels: all-gather and reduce-scatter (nodes of equal
            // sizes) run, the rest must be refused.
            self.refusals()?;
            if self.reference.gathers {
                self.all_gathers()?;
                self.reduce_scatters()?;
            }
            return Ok(());
        }
        self.broadcast_dtypes()?;
        self.reduces()?;
        self.all_gathers()?;
        self.reduce_scatters()?;
        self.all_to_alls()?;
        self.gathers_and_scatters()?;
        if self.vendor_runs("send/recv") {
            self.sends_and_receives()?;
        }
        Ok(())
    }

    /// A communicator with only its levels ([`Reference::levels_only`](super::conformance::Reference)):
    /// every entry point that needs a workspace over every rank or
    /// NCCL/RCCL is refused (`Error::Unsupported`), each a checked case.
    fn refusals(&mut self) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let n = 5;
        let one = self.view(0, 0, DType::F32, n, false)?;
        let whole = self.view(1, 0, DType::F32, n * world, false)?;
        let blocks: Vec<Tensor> = (0..world).map(|q| whole.slice(q * n, n)).collect::<Result<_>>()?;
        let counts = vec![n; world];
        let peer = (rank + 1) % world;
        let call = Call::new();
        let mut cases: Vec<(&str, Result<crate::comm::Work<D>>)> = vec![
            ("broadcast", comm.broadcast(one, 0, &call)),
            ("reduce", comm.reduce(one, ReduceOp::Sum, 0, &call)),
            ("all_to_all_single", comm.all_to_all_single(whole, whole, &call)),
            (
                "all_to_all_v_single",
                comm.all_to_all_v_single(whole, whole, &counts, &counts, &call),
            ),
            ("all_to_all", comm.all_to_all(&blocks, &blocks, &call)),
            ("gather", comm.gather(&blocks, one, 0, &call)),
            ("scatter", comm.scatter(one, &blocks, 0, &call)),
            ("send", comm.send(one, peer, &call)),
            ("recv", comm.recv(one, peer, &call)),
            (
                "batch_p2p",
                comm.batch_p2p(&[P2p::Send(one, peer), P2p::Recv(blocks[0], peer)], &call),
            ),
        ];
        if !self.reference.gathers {
            cases.push(("all_gather", comm.all_gather_single(whole, one, &call)));
            cases.push((
                "reduce_scatter",
                comm.reduce_scatter_single(one, whole, ReduceOp::Sum, &call),
            ));
        }
        for (what, result) in cases {
            self.refused(&format!("{what} rank={rank}"), result)?;
        }
        Ok(())
    }

    // ------------------------------------------------------------- premul

    /// premul_sum with a host factor and a device factor, every rank its own.
    pub(super) fn premul_sums(&mut self) -> Result<()> {
        if !self.host() && !self.vendor_runs("premul_sum") {
            return Ok(());
        }
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for count in [1usize, 1000, 70_001] {
                for device_factor in [false, true] {
                    typed!(dtype, self.premul_case(count, device_factor))?;
                }
            }
        }
        Ok(())
    }

    fn premul_case<T: FromF64>(&mut self, count: usize, device_factor: bool) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let dtype = T::DTYPE;
        let seed = self.cfg.seed ^ data::hash_bytes(format!("premul{dtype}{count}{device_factor}").as_bytes());
        // Rank r's factor; as the call's dtype when it lives on the device.
        let factor_of = |r: usize| -> f32 {
            let f = 0.5 + r as f64 * 0.75;
            if device_factor {
                T::from_f64(f).to_f64() as f32
            } else {
                f as f32
            }
        };
        let x = |r: usize, i: usize| T::from_f64(data::input_value(seed, r, i, ReduceOp::Sum, Values::Random));
        let order = &self.reference.all_reduce;
        let want: Vec<T> = (0..count)
            .map(|i| order.combine::<T>(ReduceOp::PreMulSum, |r| T::premul(x(r, i).to_acc(), factor_of(r))))
            .collect();
        let sums = || {
            let exact: Vec<f64> = (0..count)
                .map(|i| (0..world).map(|r| x(r, i).to_f64() * factor_of(r) as f64).sum())
                .collect();
            let abs: Vec<f64> = (0..count)
                .map(|i| (0..world).map(|r| (x(r, i).to_f64() * factor_of(r) as f64).abs()).sum())
                .collect();
            (exact, abs)
        };
        let red = if device_factor {
            self.put(2, 0, &data::to_bytes(&[T::from_f64(factor_of(rank) as f64)]))?;
            Reduction::premul_sum_device(self.view(2, 0, dtype, 1, false)?)
        } else {
            Reduction::premul_sum(factor_of(rank) as f64)
        };
        let input = data::to_bytes(&(0..count).map(|i| x(rank, i)).collect::<Vec<T>>());
        // Dispatch's choice (which must steer clear of LL), then on the host
        // every custom algorithm that carries factors.
        // Across nodes the levels run whatever is asked: dispatch's only.
        let algos: Vec<Option<crate::plan::Algorithm>> = if self.host() && !self.reference.two_levels() {
            std::iter::once(None)
                .chain(
                    crate::plan::Algorithm::ALL_REDUCE_KERNELS
                        .into_iter()
                        .filter(|a| *a != crate::plan::Algorithm::OneShotLl)
                        .map(Some),
                )
                .collect()
        } else {
            vec![None]
        };
        for algo in algos {
            let case = format!("premul_sum {dtype} count={count} device_factor={device_factor} {algo:?} rank={rank}");
            let out = self.view(1, 0, dtype, count, true)?;
            self.put(0, 0, &input)?;
            let inp = self.view(0, 0, dtype, count, false)?;
            let call = match algo {
                Some(a) => Call::new().algo(a),
                None => Call::new(),
            };
            comm.all_reduce_into(inp, out, red, &call)?
                .wait(Some(self.cfg.timeout))
                .map_err(|e| context(e, &case))?;
            let got = self.get(1, 0, count * dtype.size())?;
            let host = self.host();
            self.check_reduced(&case, &got, &want, sums, host, true)?;
        }
        Ok(())
    }

    // ---------------------------------------------------------- broadcast

    fn broadcast_dtypes(&mut self) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        for (k, dtype) in MOVED.into_iter().enumerate() {
            // Odd byte counts for 1-byte types; in place and not.
            for count in [1usize, 7, 4101] {
                let root = (k + count) % world;
                let in_place = count % 2 == 1 && k % 2 == 0;
                if !self.host() && dtype.size() > 4 && !comm.has_vendor_library() {
                    self.skip(format!(
                        "broadcast {dtype}: goes to NCCL/RCCL, which is not loaded here"
                    ));
                    continue;
                }
                let case = format!("broadcast {dtype} count={count} root={root} in_place={in_place} rank={rank}");
                let bytes = count * dtype.size();
                let src = block_bytes(self.cfg.seed, root, k as u64, bytes);
                let out_slot = if in_place { 0 } else { 1 };
                let out = self.view(out_slot, OFFSETS[1], dtype, count, true)?;
                if rank == root {
                    self.put(0, OFFSETS[1], &src)?;
                }
                let inp = self.view(0, OFFSETS[1], dtype, count, false)?;
                comm.broadcast_into(inp, out, root, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                let got = self.get(out_slot, OFFSETS[1], bytes)?;
                self.check_bytes(&case, &got, &src, true);
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------- reduce

    fn reduces(&mut self) -> Result<()> {
        let world = self.comm.size();
        for dtype in DType::REDUCIBLE {
            for op in self.ops_for(dtype) {
                // The multi-chunk count once per dtype (the op does not change
                // how the protocol moves data).
                let counts: &[usize] = if op == ReduceOp::Sum {
                    &[0, 5, 4099, 300_001]
                } else {
                    &[0, 5, 4099]
                };
                for (k, &count) in counts.iter().enumerate() {
                    let root = (k + op as usize) % world;
                    typed!(dtype, self.reduce_case(op, count, root))?;
                }
            }
        }
        Ok(())
    }

    fn reduce_case<T: FromF64>(&mut self, op: ReduceOp, count: usize, root: usize) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let dtype = T::DTYPE;
        let values = Values::Exact;
        let seed = self.cfg.seed ^ data::hash_bytes(format!("reduce{dtype}{op}{count}").as_bytes());
        let case = format!("reduce {dtype} {op} count={count} root={root} rank={rank}");
        let input = data::to_bytes(&data::make_input::<T>(seed, rank, 0, count, op, values));
        self.put(0, 0, &input)?;
        let t = self.view(0, 0, dtype, count, false)?;
        comm.reduce(t, op, root, &Call::new())?
            .wait(Some(self.cfg.timeout))
            .map_err(|e| context(e, &case))?;
        let got = self.get(0, 0, count * dtype.size())?;
        if rank == root {
            let want = data::reference::<T>(seed, world, 0, count, op, values);
            // Exact values make every order exact, except NCCL's avg (a
            // scaled sum).
            let bitwise = self.host() || op != ReduceOp::Avg;
            let sums = || fp64_sums::<T>(seed, world, 0, count, op, values);
            self.check_reduced(&case, &got, &want, sums, bitwise, false)?;
        } else {
            self.check_bytes(&format!("{case} (input kept)"), &got, &input, false);
        }
        Ok(())
    }

    // ----------------------------------------------------------- all-gather

    fn all_gathers(&mut self) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        for (k, dtype) in MOVED.into_iter().enumerate() {
            let counts: &[usize] = if k < 2 {
                &[0, 1, 7, 4099, 300_001]
            } else {
                &[0, 1, 7, 4099]
            };
            for (j, &n) in counts.iter().enumerate() {
                let in_place = (j + k) % 2 == 1;
                let list = j == 2 || j == 3 && k % 2 == 0;
                let size = dtype.size();
                let case = format!("all_gather {dtype} n={n} in_place={in_place} list={list} rank={rank}");
                let blocks: Vec<Vec<u8>> = (0..world)
                    .map(|s| block_bytes(self.cfg.seed, s, 100 + j as u64, n * size))
                    .collect();
                let want: Vec<u8> = blocks.concat();
                if list {
                    // One output tensor per rank, with gaps between them.
                    let stride = n * size + 64 + OFFSETS[1];
                    let outs: Vec<Tensor> = (0..world)
                        .map(|s| self.view(1, s * stride + OFFSETS[1], dtype, n, true))
                        .collect::<Result<_>>()?;
                    self.put(0, 0, &blocks[rank])?;
                    let inp = self.view(0, 0, dtype, n, false)?;
                    comm.all_gather(&outs, inp, &Call::new())?
                        .wait(Some(self.cfg.timeout))
                        .map_err(|e| context(e, &case))?;
                    let mut got = Vec::new();
                    for s in 0..world {
                        got.extend(self.get(1, s * stride + OFFSETS[1], n * size)?);
                    }
                    self.check_bytes(&case, &got, &want, true);
                    continue;
                }
                let out = self.view(1, OFFSETS[j % 2], dtype, n * world, true)?;
                let inp = if in_place {
                    self.put(1, OFFSETS[j % 2] + rank * n * size, &blocks[rank])?;
                    out.slice(rank * n, n)?
                } else {
                    self.put(0, 0, &blocks[rank])?;
                    self.view(0, 0, dtype, n, false)?
                };
                comm.all_gather_single(out, inp, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                let got = self.get(1, OFFSETS[j % 2], n * world * size)?;
                self.check_bytes(&case, &got, &want, true);
            }
        }
        Ok(())
    }

    /// One small call of every data-moving kernel family (all-gather,
    /// reduce-scatter, all-to-all, reduce, gather, scatter), each checked:
    /// the smoke run the sanitizers watch (`run_smoke`).
    pub(super) fn data_movers_smoke(&mut self) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let n = 4099;
        let size = DType::F32.size();
        // All-gather, out of place.
        let blocks: Vec<Vec<u8>> = (0..world)
            .map(|s| block_bytes(self.cfg.seed, s, 7001, n * size))
            .collect();
        let case = format!("smoke all_gather n={n} rank={rank}");
        self.put(0, 0, &blocks[rank])?;
        let inp = self.view(0, 0, DType::F32, n, false)?;
        let out = self.view(1, 0, DType::F32, n * world, true)?;
        comm.all_gather_single(out, inp, &Call::new())?
            .wait(Some(self.cfg.timeout))
            .map_err(|e| context(e, &case))?;
        let got = self.get(1, 0, n * world * size)?;
        self.check_bytes(&case, &got, &blocks.concat(), true);
        // All-to-all, equal blocks.
        let block = |s: usize, d: usize| block_bytes(self.cfg.seed, s, 7100 + d as u64, n * size);
        let case = format!("smoke all_to_all n={n} rank={rank}");
        let input: Vec<u8> = (0..world).flat_map(|d| block(rank, d)).collect();
        self.put(0, 0, &input)?;
        let inp = self.view(0, 0, DType::F32, n * world, false)?;
        let out = self.view(1, 0, DType::F32, n * world, true)?;
        comm.all_to_all_single(out, inp, &Call::new())?
            .wait(Some(self.cfg.timeout))
            .map_err(|e| context(e, &case))?;
        let want: Vec<u8> = (0..world).flat_map(|s| block(s, rank)).collect();
        let got = self.get(1, 0, n * world * size)?;
        self.check_bytes(&case, &got, &want, false);
        self.reduce_scatter_case::<f32>(ReduceOp::Sum, n, 0)?;
        self.reduce_case::<f32>(ReduceOp::Sum, n, 0)?;
        self.gathers_and_scatters()
    }

    // ------------------------------------------------------- reduce-scatter

    fn reduce_scatters(&mut self) -> Result<()> {
        for dtype in DType::REDUCIBLE {
            for op in self.ops_for(dtype) {
                let counts: &[usize] = if op == ReduceOp::Sum {
                    &[0, 1, 1000, 70_001]
                } else {
                    &[0, 1, 1000]
                };
                for (j, &n) in counts.iter().enumerate() {
                    let mode = (j + op as usize) % 3; // 0 out of place, 1 in place, 2 list
                    typed!(dtype, self.reduce_scatter_case(op, n, mode))?;
                }
            }
        }
        Ok(())
    }

    fn reduce_scatter_case<T: FromF64>(&mut self, op: ReduceOp, n: usize, mode: usize) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let dtype = T::DTYPE;
        let size = dtype.size();
        let values = if dtype.is_float() && op == ReduceOp::Sum {
            Values::Random
        } else {
            Values::Exact
        };
        let seed = self.cfg.seed ^ data::hash_bytes(format!("rs{dtype}{op}{n}").as_bytes());
        let case = format!("reduce_scatter {dtype} {op} {values:?} n={n} mode={mode} rank={rank}");
        let input = data::to_bytes(&data::make_input::<T>(seed, rank, 0, n * world, op, values));
        let order = &self.reference.reduce_scatter;
        let want = data::reference_in::<T>(order, seed, rank * n, n, op, values);
        let (slot, at) = match mode {
            1 => {
                self.put(0, 0, &input)?;
                let whole = self.view(0, 0, dtype, n * world, false)?;
                let out = whole.slice(rank * n, n)?;
                comm.reduce_scatter_single(out, whole, op, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                (0, rank * n * size)
            }
            2 => {
                let stride = n * size + 64;
                for q in 0..world {
                    self.put(0, q * stride + OFFSETS[1], &input[q * n * size..(q + 1) * n * size])?;
                }
                let ins: Vec<Tensor> = (0..world)
                    .map(|q| self.view(0, q * stride + OFFSETS[1], dtype, n, false))
                    .collect::<Result<_>>()?;
                let out = self.view(1, 0, dtype, n, true)?;
                comm.reduce_scatter(out, &ins, op, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                (1, 0)
            }
            _ => {
                self.put(0, 0, &input)?;
                let inp = self.view(0, 0, dtype, n * world, false)?;
                let out = self.view(1, OFFSETS[1], dtype, n, true)?;
                comm.reduce_scatter_single(out, inp, op, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                (1, OFFSETS[1])
            }
        };
        let got = self.get(slot, at, n * size)?;
        let bitwise = self.host() || (values == Values::Exact && op != ReduceOp::Avg);
        let sums = || fp64_sums::<T>(seed, world, rank * n, n, op, values);
        self.check_reduced(&case, &got, &want, sums, bitwise, false)
    }

    // ----------------------------------------------------------- all-to-all

    /// Elements rank `s` sends rank `d` in case `tag`: some zero, some not.
    fn split(&self, tag: u64, s: usize, d: usize, scale: usize) -> usize {
        let r = data::draw(self.cfg.seed ^ tag, s, d);
        if r % 5 == 0 {
            0
        } else {
            (r as usize >> 8) % (scale + 1)
        }
    }

    fn all_to_alls(&mut self) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        for (k, dtype) in [DType::F32, DType::BF16, DType::U8, DType::I64].into_iter().enumerate() {
            for (j, scale) in [3usize, 1000, 100_000].into_iter().enumerate() {
                let tag = (k * 10 + j) as u64;
                let size = dtype.size();
                let sends: Vec<usize> = (0..world).map(|d| self.split(tag, rank, d, scale)).collect();
                let recvs: Vec<usize> = (0..world).map(|s| self.split(tag, s, rank, scale)).collect();
                let block =
                    |s: usize, d: usize, n: usize| block_bytes(self.cfg.seed, s, 1000 * tag + d as u64, n * size);
                let input: Vec<u8> = (0..world).flat_map(|d| block(rank, d, sends[d])).collect();
                let want: Vec<u8> = (0..world).flat_map(|s| block(s, rank, recvs[s])).collect();
                let case = format!("all_to_all_v {dtype} scale={scale} sends={sends:?} recvs={recvs:?} rank={rank}");
                let (ni, no) = (sends.iter().sum::<usize>(), recvs.iter().sum::<usize>());
                self.put(0, OFFSETS[j % 2], &input)?;
                let inp = self.view(0, OFFSETS[j % 2], dtype, ni, false)?;
                let out = self.view(1, 0, dtype, no, true)?;
                comm.all_to_all_v_single(out, inp, &recvs, &sends, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                let got = self.get(1, 0, no * size)?;
                self.check_bytes(&case, &got, &want, false);
            }
            // Equal splits, in place.
            let n = 1 + 313 * k;
            let case = format!("all_to_all_single {dtype} in place n={n} rank={rank}");
            let block = |s: usize, d: usize| block_bytes(self.cfg.seed ^ 7, s, d as u64, n * dtype.size());
            let input: Vec<u8> = (0..world).flat_map(|d| block(rank, d)).collect();
            let want: Vec<u8> = (0..world).flat_map(|s| block(s, rank)).collect();
            self.put(0, 0, &input)?;
            let t = self.view(0, 0, dtype, n * world, false)?;
            comm.all_to_all_single(t, t, &Call::new())?
                .wait(Some(self.cfg.timeout))
                .map_err(|e| context(e, &case))?;
            let got = self.get(0, 0, n * world * dtype.size())?;
            self.check_bytes(&case, &got, &want, false);
        }
        // The list form, blocks of different lengths and gaps between them.
        let dtype = DType::F16;
        let n = |s: usize, d: usize| 1 + (s * 7 + d * 3) % 11;
        let case = format!("all_to_all list rank={rank}");
        let mut ins = Vec::new();
        let mut outs = Vec::new();
        let mut want = Vec::new();
        for q in 0..world {
            let bytes = block_bytes(self.cfg.seed, rank, 5000 + q as u64, n(rank, q) * 2);
            self.put(0, q * 128 + 1, &bytes)?;
            ins.push(self.view(0, q * 128 + 1, dtype, n(rank, q), false)?);
            outs.push(self.view(1, q * 128, dtype, n(q, rank), true)?);
            want.push(block_bytes(self.cfg.seed, q, 5000 + rank as u64, n(q, rank) * 2));
        }
        comm.all_to_all(&outs, &ins, &Call::new())?
            .wait(Some(self.cfg.timeout))
            .map_err(|e| context(e, &case))?;
        for (q, want) in want.iter().enumerate() {
            let got = self.get(1, q * 128, n(q, rank) * 2)?;
            self.check_bytes(&format!("{case} from {q}"), &got, want, false);
        }
        Ok(())
    }

    // ------------------------------------------------------ gather, scatter

    fn gathers_and_scatters(&mut self) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        for dtype in [DType::F32, DType::U8] {
            for (j, n) in [0usize, 3, 4099].into_iter().enumerate() {
                let root = (j + dtype as usize) % world;
                let size = dtype.size();
                let stride = n * size + 64;
                // gather
                let case = format!("gather {dtype} n={n} root={root} rank={rank}");
                let mine = block_bytes(self.cfg.seed, rank, 9000 + j as u64, n * size);
                self.put(0, 1, &mine)?;
                let inp = self.view(0, 1, dtype, n, false)?;
                let outs: Vec<Tensor> = if rank == root {
                    (0..world)
                        .map(|s| self.view(1, s * stride, dtype, n, true))
                        .collect::<Result<_>>()?
                } else {
                    Vec::new()
                };
                comm.gather(&outs, inp, root, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                if rank == root {
                    for s in 0..world {
                        let got = self.get(1, s * stride, n * size)?;
                        let want = block_bytes(self.cfg.seed, s, 9000 + j as u64, n * size);
                        self.check_bytes(&format!("{case} from {s}"), &got, &want, false);
                    }
                }
                // scatter
                let case = format!("scatter {dtype} n={n} root={root} rank={rank}");
                let ins: Vec<Tensor> = if rank == root {
                    (0..world)
                        .map(|d| {
                            let bytes = block_bytes(self.cfg.seed, d, 9100 + j as u64, n * size);
                            self.put(0, d * stride, &bytes)?;
                            self.view(0, d * stride, dtype, n, false)
                        })
                        .collect::<Result<_>>()?
                } else {
                    Vec::new()
                };
                let out = self.view(1, 3, dtype, n, true)?;
                comm.scatter(out, &ins, root, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                let got = self.get(1, 3, n * size)?;
                let want = block_bytes(self.cfg.seed, rank, 9100 + j as u64, n * size);
                self.check_bytes(&case, &got, &want, false);
            }
        }
        Ok(())
    }

    // ------------------------------------------------------ send, receive

    fn sends_and_receives(&mut self) -> Result<()> {
        let comm = self.comm;
        let (rank, world) = (comm.rank(), comm.size());
        let dtype = DType::F32;
        // A ring in one batch: send right, receive from the left. Sizes
        // from empty to several mailbox chunks.
        for (j, n) in [0usize, 1, 4099, 1 << 20].into_iter().enumerate() {
            let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
            let case = format!("send/recv ring n={n} rank={rank}");
            let mine = block_bytes(self.cfg.seed, rank, 20 + j as u64, n * 4);
            self.put(0, 0, &mine)?;
            let out = self.view(0, 0, dtype, n, false)?;
            let into = self.view(1, 1, dtype, n, true)?;
            comm.batch_p2p(&[P2p::Send(out, right), P2p::Recv(into, left)], &Call::new())?
                .wait(Some(self.cfg.timeout))
                .map_err(|e| context(e, &case))?;
            let got = self.get(1, 1, n * 4)?;
            let want = block_bytes(self.cfg.seed, left, 20 + j as u64, n * 4);
            self.check_bytes(&case, &got, &want, false);
        }
        // Pairs swap two messages each, in order, plus a message to itself.
        let partner = rank ^ 1;
        if partner < world {
            let case = format!("send/recv pair {rank}<->{partner}");
            let (a, b) = (
                block_bytes(self.cfg.seed, rank, 30, 1000 * 4),
                block_bytes(self.cfg.seed, rank, 31, 17 * 4),
            );
            self.put(0, 0, &a)?;
            self.put(0, 8192, &b)?;
            let self_msg = block_bytes(self.cfg.seed, rank, 32, 5 * 4);
            self.put(0, 16384, &self_msg)?;
            let ops = [
                P2p::Recv(self.view(1, 0, dtype, 1000, true)?, partner),
                P2p::Send(self.view(0, 0, dtype, 1000, false)?, partner),
                P2p::Send(self.view(0, 8192, dtype, 17, false)?, partner),
                P2p::Recv(self.view(1, 8192, dtype, 17, true)?, partner),
                P2p::Send(self.view(0, 16384, dtype, 5, false)?, rank),
                P2p::Recv(self.view(1, 16384, dtype, 5, true)?, rank),
            ];
            comm.batch_p2p(&ops, &Call::new())?
                .wait(Some(self.cfg.timeout))
                .map_err(|e| context(e, &case))?;
            let got_a = self.get(1, 0, 1000 * 4)?;
            let got_b = self.get(1, 8192, 17 * 4)?;
            let got_self = self.get(1, 16384, 5 * 4)?;
            self.check_bytes(&case, &got_a, &block_bytes(self.cfg.seed, partner, 30, 1000 * 4), false);
            self.check_bytes(&case, &got_b, &block_bytes(self.cfg.seed, partner, 31, 17 * 4), false);
            self.check_bytes(&format!("{case} to itself"), &got_self, &self_msg, false);
        }
        // Plain send and recv calls (not batched): rank 0 to the last rank.
        let last = world - 1;
        if world > 1 && (rank == 0 || rank == last) {
            let case = format!("send 0 -> {last} rank={rank}");
            let msg = block_bytes(self.cfg.seed, 0, 40, 3000 * 4);
            if rank == 0 {
                self.put(0, 0, &msg)?;
                let t = self.view(0, 0, dtype, 3000, false)?;
                comm.send(t, last, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
            } else {
                let t = self.view(1, 0, dtype, 3000, true)?;
                comm.recv(t, 0, &Call::new())?
                    .wait(Some(self.cfg.timeout))
                    .map_err(|e| context(e, &case))?;
                let got = self.get(1, 0, 3000 * 4)?;
                self.check_bytes(&case, &got, &msg, false);
            }
        }
        Ok(())
    }

    // -------------------------------------------------------- graph replays

    /// all-gather, reduce-scatter and all-to-all captured once and replayed
    /// with new input each time.
    pub(super) fn graph_replay_collectives(&mut self, stream: &D::Stream) -> Result<()> {
        if !self.reference.gathers {
            // (Refused collectives are checked as such by `refusals`.)
            return Ok(());
        }
        let comm = self.comm;
        let dev = comm.device();
        let (rank, world) = (comm.rank(), comm.size());
        let n = 777;
        let ag_in = self.view(0, 0, DType::BF16, n, false)?;
        let ag_out = self.view(1, 0, DType::BF16, n * world, false)?;
        let rs_in = self.view(2, 0, DType::F32, n * world, false)?;
        let rs_out = self.view(3, 0, DType::F32, n, false)?;
        let a2a_in = self.view(4, 0, DType::I32, n * world, false)?;
        let a2a_out = self.view(5, 0, DType::I32, n * world, false)?;
        let levels_only = self.reference.levels_only;
        dev.begin_capture(stream)?;
        let call = Call::on(stream);
        let captured = comm
            .all_gather_single(ag_out, ag_in, &call)
            .and_then(|_| comm.reduce_scatter_single(rs_out, rs_in, ReduceOp::Sum, &call));
        let a2a = captured
            .as_ref()
            .ok()
            .map(|_| comm.all_to_all_single(a2a_out, a2a_in, &call));
        let graph = dev.end_capture(stream)?;
        captured?;
        match a2a {
            // Refused inside the capture, before anything was queued: the
            // graph holds the other two.
            Some(refused) if levels_only => self.refused(&format!("all_to_all in a capture rank={rank}"), refused)?,
            Some(ran) => drop(ran?),
            None => {}
        }
        for replay in 0..self.cfg.graph_replays {
            let case = format!("graph replay {replay} of all_gather + reduce_scatter + all_to_all rank={rank}");
            let seed = self.cfg.seed ^ (replay as u64 + 1).wrapping_mul(0x5851_f42d);
            let ag_blocks: Vec<Vec<u8>> = (0..world).map(|s| block_bytes(seed, s, 1, n * 2)).collect();
            let rs_input = data::make_input::<f32>(seed, rank, 0, n * world, ReduceOp::Sum, Values::Exact);
            let a2a: Vec<Vec<u8>> = (0..world).map(|s| block_bytes(seed, s, 3, n * world * 4)).collect();
            for (slot, bytes) in [(0, &ag_blocks[rank]), (2, &data::to_bytes(&rs_input)), (4, &a2a[rank])] {
                let Some(Some(b)) = self.bufs_at(slot) else { continue };
                dev.copy_from_host(b, 0, bytes, stream)?;
            }
            dev.launch_graph(&graph, stream)?;
            dev.synchronize(stream).map_err(|e| context(e, &case))?;
            let got = self.get(1, 0, n * world * 2)?;
            self.check_bytes(&format!("{case}: all_gather"), &got, &ag_blocks.concat(), true);
            let got = self.get(3, 0, n * 4)?;
            let order = &self.reference.reduce_scatter;
            let want = data::reference_in::<f32>(order, seed, rank * n, n, ReduceOp::Sum, Values::Exact);
            self.check_local(&format!("{case}: reduce_scatter"), &got, &want)?;
            if levels_only {
                continue;
            }
            let got = self.get(5, 0, n * world * 4)?;
            let want: Vec<u8> = (0..world)
                .flat_map(|s| a2a[s][rank * n * 4..(rank + 1) * n * 4].to_vec())
                .collect();
            self.check_bytes(&format!("{case}: all_to_all"), &got, &want, false);
        }
        Ok(())
    }
}

/// The fp64 sums of a range (and of magnitudes), for bounded checks.
fn fp64_sums<T: FromF64>(
    seed: u64,
    world: usize,
    first: usize,
    count: usize,
    op: ReduceOp,
    values: Values,
) -> (Vec<f64>, Vec<f64>) {
    let x = |r: usize, i: usize| T::from_f64(data::input_value(seed, r, i, op, values)).to_f64();
    let exact = (first..first + count)
        .map(|i| {
            let xs = (0..world).map(|r| x(r, i));
            match op {
                ReduceOp::Prod => xs.product(),
                ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
                ReduceOp::Max => xs.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Avg => xs.sum::<f64>() / world as f64,
                _ => xs.sum(),
            }
        })
        .collect();
    let abs = (first..first + count)
        .map(|i| (0..world).map(|r| x(r, i).abs()).sum())
        .collect();
    (exact, abs)
}
