//! One trial on one rank: lay out its operands between guards, make the
//! call the plan drew, and check every byte afterwards.

use std::time::Duration;

use half::{bf16, f16};

use super::draw::{Coll, Local, Op, Plan};
use super::memory::{guard_byte, Pools, Region};
use super::reference::{fp64_misses, input_bytes, reduced};
use super::FuzzReport;
use crate::comm::{Call, Communicator, P2p, Reduction, Tensor, Work};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::testing::data::{hash_bytes, Values};

/// One rank's view of a trial: where its operands are and what they hold.
pub(super) struct Trial<'a, D: Device> {
    pub(super) comm: &'a Communicator<D>,
    pub(super) plan: &'a Plan,
    pub(super) local: Local,
    pub(super) pools: &'a Pools<D>,
    pub(super) streams: &'a [D::Stream],
    /// Regions written before the call, with every byte as written.
    pub(super) regions: Vec<(Region, Vec<u8>)>,
    /// Output byte ranges (region index, first byte, bytes) and what they
    /// must hold.
    pub(super) expect: Vec<(usize, usize, Vec<u8>)>,
}

impl<'a, D: Device> Trial<'a, D> {
    pub(super) fn call(&self) -> Call<'a, D> {
        let mut call = match self.local.stream {
            0 => Call::new(),
            k => Call::on(&self.streams[k - 1]),
        };
        if let Some(v) = self.plan.coll_algo {
            call = call.hint("coll_algo", v);
        }
        call.timeout(Duration::from_secs(60))
    }

    /// Operand `slot` of `len` bytes: its region, filled with guards and
    /// `fill` (or poison when `fill` is `None`). Returns its index.
    fn operand(&mut self, slot: usize, len: usize, fill: Option<&[u8]>) -> Result<usize> {
        let r = self
            .pools
            .region(self.local.kinds[slot], slot, self.local.offsets[slot], len)?;
        let mut bytes: Vec<u8> = (0..r.whole).map(guard_byte).collect();
        match fill {
            Some(f) => bytes[r.data..r.data + len].copy_from_slice(f),
            None => bytes[r.data..r.data + len].fill(0x7F),
        }
        self.comm.copy_in(r.all(), &bytes, &self.call())?;
        self.regions.push((r, bytes));
        Ok(self.regions.len() - 1)
    }

    /// Expect `want` at byte `at` of region `idx`'s data.
    fn expect(&mut self, idx: usize, at: usize, want: Vec<u8>) {
        self.expect.push((idx, at, want));
    }

    /// `count` elements of the plan's dtype at byte `at` of region `idx`.
    fn tensor(&self, idx: usize, at: usize, count: usize) -> Tensor {
        self.regions[idx].0.tensor(self.plan.dtype, at, count)
    }

    /// A list of tensors of `counts` elements in one region, back to back
    /// or this rank's gap apart: (byte offset, tensor) each.
    fn list(&self, idx: usize, counts: &[usize]) -> Vec<(usize, Tensor)> {
        let es = self.plan.dtype.size();
        let mut at = 0;
        counts
            .iter()
            .map(|&c| {
                let t = (at, self.tensor(idx, at, c));
                at += c * es + self.local.gap;
                t
            })
            .collect()
    }

    /// A list operand in `slot`: `data`, cut into `counts`, laid out as
    /// [`Trial::list`] lays it (the gaps hold a guard pattern).
    fn list_input(&mut self, slot: usize, counts: &[usize], data: &[u8]) -> Result<Vec<Tensor>> {
        let es = self.plan.dtype.size();
        let len: usize = counts.iter().map(|c| c * es + self.local.gap).sum();
        let mut fill: Vec<u8> = (0..len).map(|k| guard_byte(k + 7)).collect();
        let (mut at, mut from) = (0, 0);
        for &c in counts {
            fill[at..at + c * es].copy_from_slice(&data[from..from + c * es]);
            at += c * es + self.local.gap;
            from += c * es;
        }
        let idx = self.operand(slot, len, Some(&fill))?;
        Ok(self.list(idx, counts).into_iter().map(|(_, t)| t).collect())
    }

    /// A list output in `slot` of `counts`, poisoned, each part expected to
    /// hold `want(part)`.
    fn list_output(&mut self, slot: usize, counts: &[usize], want: impl Fn(usize) -> Vec<u8>) -> Result<Vec<Tensor>> {
        let es = self.plan.dtype.size();
        let len: usize = counts.iter().map(|c| c * es + self.local.gap).sum();
        let idx = self.operand(slot, len, None)?;
        let parts = self.list(idx, counts);
        for (k, (at, _)) in parts.iter().enumerate() {
            self.expect(idx, *at, want(k));
        }
        Ok(parts.into_iter().map(|(_, t)| t).collect())
    }

    /// This rank's input of `count` elements in slot 0, and in place or in
    /// slot 1 the output, expected to hold `want`: (input, output).
    fn pair(&mut self, count: usize, in_place: bool, want: Vec<u8>) -> Result<(Tensor, Tensor)> {
        let rank = self.comm.rank();
        let bytes = count * self.plan.dtype.size();
        let i = self.operand(0, bytes, Some(&input_bytes(self.plan, rank, count)))?;
        let o = match in_place {
            true => i,
            false => self.operand(1, bytes, None)?,
        };
        self.expect(o, 0, want);
        Ok((self.tensor(i, 0, count), self.tensor(o, 0, count)))
    }
}

/// This rank's reduction: its op, or premul_sum by its factor, as a host
/// value or one element in device memory.
fn reduction<D: Device>(t: &Trial<'_, D>) -> Result<Reduction> {
    let (p, comm) = (t.plan, t.comm);
    let f = p.factors[comm.rank()];
    Ok(match p.op {
        Op::Plain(op) => op.into(),
        Op::PreMul if t.local.device_factor => {
            let bytes = match p.dtype {
                DType::F32 => (f as f32).to_le_bytes().to_vec(),
                DType::F16 => f16::from_f64(f).to_le_bytes().to_vec(),
                _ => bf16::from_f64(f).to_le_bytes().to_vec(),
            };
            let ft = Tensor::view(&t.pools.factor, p.dtype, 0, 1)?;
            comm.copy_in(ft, &bytes, &t.call())?;
            Reduction::premul_sum_device(ft)
        }
        Op::PreMul => Reduction::premul_sum(f),
    })
}

/// Lay out this rank's operands, write them, and make the call.
pub(super) fn issue<D: Device>(t: &mut Trial<'_, D>) -> Result<Work<D>> {
    match t.plan.coll {
        Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter | Coll::ReduceScatterList => reduction_call(t),
        Coll::Broadcast | Coll::AllGather | Coll::AllGatherList => gathering_call(t),
        Coll::AllToAll | Coll::AllToAllV | Coll::AllToAllList => all_to_all_call(t),
        Coll::Gather | Coll::Scatter => rooted_call(t),
        Coll::SendRecv => {
            // A ring: to the next rank, from the one before.
            let (rank, world) = (t.comm.rank(), t.comm.size());
            let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
            let want = input_bytes(t.plan, prev, t.plan.n);
            let (a, b) = t.pair(t.plan.n, false, want)?;
            t.comm.batch_p2p(&[P2p::Send(a, next), P2p::Recv(b, prev)], &t.call())
        }
        Coll::Barrier => t.comm.barrier(&t.call()),
    }
}

/// All-reduce, reduce and reduce-scatter (single and list).
fn reduction_call<D: Device>(t: &mut Trial<'_, D>) -> Result<Work<D>> {
    let (p, comm) = (t.plan, t.comm);
    let (rank, world, n, es) = (comm.rank(), comm.size(), p.n, p.dtype.size());
    let red = reduction(t)?;
    let call = t.call();
    match p.coll {
        Coll::AllReduce => {
            let (a, b) = t.pair(n, p.in_place, reduced(p, world, 0, n))?;
            match p.in_place {
                true => comm.all_reduce(a, red, &call),
                false => comm.all_reduce_into(a, b, red, &call),
            }
        }
        Coll::Reduce => {
            // In place on the root; the others' tensor is only read.
            let i = t.operand(0, n * es, Some(&input_bytes(p, rank, n)))?;
            if rank == p.root {
                t.expect(i, 0, reduced(p, world, 0, n));
            }
            comm.reduce(t.tensor(i, 0, n), red, p.root, &call)
        }
        Coll::ReduceScatter => {
            let x = input_bytes(p, rank, world * n);
            let want = reduced(p, world, rank * n, n);
            let i = t.operand(0, world * n * es, Some(&x))?;
            let input = t.tensor(i, 0, world * n);
            let output = match p.in_place {
                true => {
                    t.expect(i, rank * n * es, want);
                    input.slice(rank * n, n)?
                }
                false => {
                    let o = t.operand(1, n * es, None)?;
                    t.expect(o, 0, want);
                    t.tensor(o, 0, n)
                }
            };
            comm.reduce_scatter_single(output, input, red, &call)
        }
        _ => {
            let ins = t.list_input(0, &vec![n; world], &input_bytes(p, rank, world * n))?;
            let o = t.operand(1, n * es, None)?;
            t.expect(o, 0, reduced(p, world, rank * n, n));
            comm.reduce_scatter(t.tensor(o, 0, n), &ins, red, &call)
        }
    }
}

/// Broadcast and all-gather (single and list).
fn gathering_call<D: Device>(t: &mut Trial<'_, D>) -> Result<Work<D>> {
    let (p, comm) = (t.plan, t.comm);
    let (rank, world, n, es) = (comm.rank(), comm.size(), p.n, p.dtype.size());
    let call = t.call();
    match p.coll {
        Coll::Broadcast => {
            let (a, b) = t.pair(n, p.in_place, input_bytes(p, p.root, n))?;
            match p.in_place {
                true => comm.broadcast(a, p.root, &call),
                false => comm.broadcast_into(a, b, p.root, &call),
            }
        }
        Coll::AllGather => {
            let x = input_bytes(p, rank, n);
            let want: Vec<u8> = (0..world).flat_map(|q| input_bytes(p, q, n)).collect();
            if p.in_place {
                let mut fill = vec![0x7Fu8; world * n * es];
                fill[rank * n * es..(rank + 1) * n * es].copy_from_slice(&x);
                let o = t.operand(1, world * n * es, Some(&fill))?;
                t.expect(o, 0, want);
                let out = t.tensor(o, 0, world * n);
                return comm.all_gather_single(out, out.slice(rank * n, n)?, &call);
            }
            let i = t.operand(0, n * es, Some(&x))?;
            let o = t.operand(1, world * n * es, None)?;
            t.expect(o, 0, want);
            comm.all_gather_single(t.tensor(o, 0, world * n), t.tensor(i, 0, n), &call)
        }
        _ => {
            let i = t.operand(0, n * es, Some(&input_bytes(p, rank, n)))?;
            let outs = t.list_output(1, &vec![n; world], |q| input_bytes(p, q, n))?;
            comm.all_gather(&outs, t.tensor(i, 0, n), &call)
        }
    }
}

/// All-to-all: equal blocks, splits, or lists of tensors.
fn all_to_all_call<D: Device>(t: &mut Trial<'_, D>) -> Result<Work<D>> {
    let (p, comm) = (t.plan, t.comm);
    let (rank, world, n, es) = (comm.rank(), comm.size(), p.n, p.dtype.size());
    let call = t.call();
    if p.coll == Coll::AllToAll {
        let x = input_bytes(p, rank, world * n);
        let want: Vec<u8> = (0..world)
            .flat_map(|s| input_bytes(p, s, world * n)[rank * n * es..(rank + 1) * n * es].to_vec())
            .collect();
        let i = t.operand(0, world * n * es, Some(&x))?;
        let input = t.tensor(i, 0, world * n);
        let output = match p.in_place {
            true => {
                t.expect(i, 0, want);
                input
            }
            false => {
                let o = t.operand(1, world * n * es, None)?;
                t.expect(o, 0, want);
                t.tensor(o, 0, world * n)
            }
        };
        return comm.all_to_all_single(output, input, &call);
    }
    let sends: Vec<usize> = p.splits[rank].clone();
    let recvs: Vec<usize> = (0..world).map(|s| p.splits[s][rank]).collect();
    let (total_in, total_out) = (sends.iter().sum::<usize>(), recvs.iter().sum::<usize>());
    let x = input_bytes(p, rank, total_in);
    // What source s sends us: its block to us, after its blocks to the
    // ranks before us.
    let from = |s: usize| -> Vec<u8> {
        let before: usize = p.splits[s][..rank].iter().sum();
        input_bytes(p, s, before + recvs[s])[before * es..].to_vec()
    };
    if p.coll == Coll::AllToAllV {
        let i = t.operand(0, total_in * es, Some(&x))?;
        let o = t.operand(1, total_out * es, None)?;
        t.expect(o, 0, (0..world).flat_map(from).collect());
        return comm.all_to_all_v_single(
            t.tensor(o, 0, total_out),
            t.tensor(i, 0, total_in),
            &recvs,
            &sends,
            &call,
        );
    }
    let ins = t.list_input(0, &sends, &x)?;
    let outs = t.list_output(1, &recvs, from)?;
    comm.all_to_all(&outs, &ins, &call)
}

/// Gather and scatter, rooted at the plan's root.
fn rooted_call<D: Device>(t: &mut Trial<'_, D>) -> Result<Work<D>> {
    let (p, comm) = (t.plan, t.comm);
    let (rank, world, n, es) = (comm.rank(), comm.size(), p.n, p.dtype.size());
    let call = t.call();
    let counts = vec![n; world];
    if p.coll == Coll::Gather {
        let i = t.operand(0, n * es, Some(&input_bytes(p, rank, n)))?;
        let outs = match rank == p.root {
            true => t.list_output(1, &counts, |q| input_bytes(p, q, n))?,
            false => Vec::new(),
        };
        return comm.gather(&outs, t.tensor(i, 0, n), p.root, &call);
    }
    let ins = match rank == p.root {
        true => t.list_input(0, &counts, &input_bytes(p, rank, world * n))?,
        false => Vec::new(),
    };
    let o = t.operand(1, n * es, None)?;
    let root_in = input_bytes(p, p.root, world * n);
    t.expect(o, 0, root_in[rank * n * es..(rank + 1) * n * es].to_vec());
    comm.scatter(t.tensor(o, 0, n), &ins, p.root, &call)
}

/// Read every region back (after the call, on its stream) and compare.
/// Returns the hash of the outputs every rank must agree on.
pub(super) fn check<D: Device>(
    t: &Trial<'_, D>,
    exact_random: bool,
    trial: usize,
    report: &mut FuzzReport,
) -> Result<u64> {
    let (p, world) = (t.plan, t.comm.size());
    let es = p.dtype.size();
    let what = || format!("trial {trial} ({})", p.describe(world));
    // Every byte of every region as written, the expected outputs over it.
    let mut want_all: Vec<Vec<u8>> = t.regions.iter().map(|(_, b)| b.clone()).collect();
    let mut is_output: Vec<Vec<bool>> = t.regions.iter().map(|(r, _)| vec![false; r.whole]).collect();
    for (idx, at, want) in &t.expect {
        let from = t.regions[*idx].0.data + at;
        want_all[*idx][from..from + want.len()].copy_from_slice(want);
        is_output[*idx][from..from + want.len()].fill(true);
    }
    let random_sum = p.coll.reduces() && p.values == Values::Random;
    // The first output element's index in the reduction (fp64 checks).
    let first = match p.coll {
        Coll::ReduceScatter | Coll::ReduceScatterList => t.comm.rank() * p.n,
        _ => 0,
    };
    let mut agreed = Vec::new();
    for (idx, (r, _)) in t.regions.iter().enumerate() {
        let mut got = vec![0u8; r.whole];
        t.comm.copy_out(&mut got, r.all(), &t.call())?;
        report.bytes_checked += got.len();
        let clobbered = got
            .iter()
            .zip(&want_all[idx])
            .zip(&is_output[idx])
            .filter(|((g, w), out)| g != w && !**out)
            .count();
        if clobbered > 0 {
            report.clobbered += clobbered;
            report.fail(format!(
                "{}: {clobbered} guard or input bytes changed in operand {idx}",
                what()
            ));
        }
        for (_, at, want) in t.expect.iter().filter(|(i, _, _)| *i == idx) {
            let from = r.data + at;
            let got = &got[from..from + want.len()];
            if p.coll.agreed_output() {
                agreed.extend_from_slice(got);
            }
            // The rule's bits, except for random sums where NCCL may have
            // summed (its rounding differs): those take the fp64 bound
            // alone; the other random sums take it too.
            let bits_count = exact_random || !random_sum;
            let wrong = got.chunks(es).zip(want.chunks(es)).filter(|(g, w)| g != w).count();
            if bits_count && wrong > 0 {
                report.wrong += wrong;
                report.fail(format!("{}: {wrong} of {} elements wrong", what(), want.len() / es));
            } else if random_sum {
                let misses = fp64_misses(p, world, first, got);
                report.wrong += misses;
                if misses > 0 {
                    report.fail(format!("{}: {misses} elements off the fp64 sum", what()));
                }
            }
        }
    }
    Ok(hash_bytes(&agreed))
}
