//! The collectives that move data without reducing it: broadcast,
//! all-gather, all-to-all(-v), gather, scatter. Validate, plan, submit.

use super::run;
use super::Lists;
use crate::algo::kernels::KernelKind;
use crate::comm::call::Call;
use crate::comm::communicator::Communicator;
use crate::comm::tensor::Tensor;
use crate::comm::vendor::VendorOp;
use crate::comm::work::Work;
use crate::device::{Device, DevicePtr};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::plan::{Collective, Plan};

impl<D: Device> Communicator<D> {
    /// `root`'s `t` into `t` on every rank.
    pub fn broadcast(&self, t: Tensor, root: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.broadcast_into(t, t, root, call)
    }

    /// `root`'s `input` into `output` on every rank (`input` is only read on
    /// the root; the same count everywhere).
    pub fn broadcast_into(&self, input: Tensor, output: Tensor, root: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.check_rank("broadcast root", root)?;
        Self::same_dtype(&input, &output)?;
        if input.count() != output.count() {
            return Err(Error::invalid("broadcast: input and output differ in length"));
        }
        let bytes = self.checked("broadcast output", &output)?;
        let is_root = self.rank() == root;
        if is_root {
            self.checked("broadcast input", &input)?;
        }
        let (dtype, count) = (input.dtype(), input.count());
        // The addresses the kernel loads on this rank: the input on the root only.
        let operands = [output.ptr(), if is_root { input.ptr() } else { output.ptr() }];
        let asked = call.asked_coll_algo()?;
        let plan = self.plan_call(Collective::Broadcast, dtype, ReduceOp::Sum, count, asked, &operands)?;
        self.submit(call, "broadcast", |s| match plan {
            Plan::Nothing | Plan::Levels => Ok(()),
            Plan::Copy => run::copy_if_apart(s, output.ptr(), input.ptr(), bytes),
            Plan::Kernel(k) if k.kind == KernelKind::Broadcast => {
                run::broadcast(s, k, input.ptr(), output.ptr(), bytes, root)
            }
            Plan::Kernel(k) => {
                // The copy route, and the host's odd sizes: the root sends
                // to everyone. The copy route chunks by the count, which
                // every rank shares; the exchange kinds go by no block here.
                let mut l = Lists::new(s.inner.world);
                if s.inner.rank == root {
                    for q in 0..s.inner.world {
                        l.sends[q] = Some((count, input.ptr()));
                    }
                }
                l.recvs[root] = Some((count, output.ptr()));
                let agreed = if k.kind == KernelKind::Copy { count } else { 0 };
                run::exchange(s, k.kind, dtype, &l, agreed)
            }
            Plan::Vendor => {
                let op = VendorOp::Broadcast {
                    send: input.ptr(),
                    recv: output.ptr(),
                    count,
                    root,
                };
                run::run_vendor(s, dtype, op)
            }
        })
    }

    /// Every rank's `input` into `output`, in rank order (`output` holds
    /// `world` times `input`; `input` may be this rank's part of it).
    pub fn all_gather_single(&self, output: Tensor, input: Tensor, call: &Call<'_, D>) -> Result<Work<D>> {
        Self::same_dtype(&input, &output)?;
        let world = self.size();
        let n = input.count();
        if output.count() != n.saturating_mul(world) {
            return Err(Error::invalid(format!(
                "all_gather_single: output has {} elements, not world ({world}) x input ({n})",
                output.count()
            )));
        }
        let parts: Vec<Tensor> = (0..world).map(|r| output.slice(r * n, n)).collect::<Result<_>>()?;
        self.all_gather_impl(&parts, input, Some(output), call)
    }

    /// Every rank's `input` into `outputs[rank]` (one tensor per rank, each
    /// as long as `input`).
    pub fn all_gather(&self, outputs: &[Tensor], input: Tensor, call: &Call<'_, D>) -> Result<Work<D>> {
        self.all_gather_impl(outputs, input, None, call)
    }

    fn all_gather_impl(
        &self,
        outputs: &[Tensor],
        input: Tensor,
        whole: Option<Tensor>,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        let world = self.size();
        if outputs.len() != world {
            return Err(Error::invalid(format!(
                "all_gather: {} output tensors for a world of {world}",
                outputs.len()
            )));
        }
        // Outputs back to back are one output for NCCL/RCCL, if the input is
        // clear of it or is this rank's part (the library's in-place form).
        let me = self.rank();
        let whole =
            whole.or_else(|| Tensor::joined(outputs).filter(|w| !input.overlaps(w) || outputs.get(me) == Some(&input)));
        let n = input.count();
        self.checked("all_gather input", &input)?;
        self.checked_parts("all_gather", "output", outputs, &input, "input")?;
        let dtype = input.dtype();
        let asked = call.asked_coll_algo()?;
        let plan = self.plan_call(Collective::AllGather, dtype, ReduceOp::Sum, n, asked, &[])?;
        if let (Plan::Levels, Some(levels)) = (plan, &self.inner.levels) {
            return levels.all_gather(&self.inner.stream, outputs, input, call);
        }
        let outs: Vec<DevicePtr> = outputs.iter().map(Tensor::ptr).collect();
        self.submit(call, "all_gather", |s| match plan {
            Plan::Nothing | Plan::Levels => Ok(()),
            Plan::Copy => run::copy_if_apart(s, outs[0], input.ptr(), n * dtype.size()),
            Plan::Kernel(k) => {
                let mut l = Lists::new(s.inner.world);
                for (q, out) in outs.iter().enumerate() {
                    l.sends[q] = Some((n, input.ptr()));
                    l.recvs[q] = Some((n, *out));
                }
                run::exchange(s, k.kind, dtype, &l, n)
            }
            Plan::Vendor => vendor_all_gather(s, dtype, input, whole, &outs, n),
        })
    }

    /// Block `q` of `input` to rank `q`, block `s` of `output` from rank `s`
    /// (equal blocks of `count / world`; in place allowed).
    pub fn all_to_all_single(&self, output: Tensor, input: Tensor, call: &Call<'_, D>) -> Result<Work<D>> {
        self.all_to_all_v_single(output, input, &[], &[], call)
    }

    /// All-to-all with split sizes per peer (in elements; zeros allowed;
    /// empty slices mean equal splits): `input_splits[q]` elements go to
    /// rank `q`, `output_splits[s]` come from rank `s`, blocks back to back.
    /// The splits must sum to the tensors' lengths; in place only with equal
    /// input and output splits.
    pub fn all_to_all_v_single(
        &self,
        output: Tensor,
        input: Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        Self::same_dtype(&input, &output)?;
        let world = self.size();
        let ins = splits(world, "input", input_splits, &input)?;
        let outs = splits(world, "output", output_splits, &output)?;
        if input.overlaps(&output) && (input != output || ins != outs) {
            return Err(Error::invalid(
                "all_to_all in place needs the same tensor and equal input and output splits",
            ));
        }
        let (ib, ob) = (blocks(&input, &ins)?, blocks(&output, &outs)?);
        // Without splits every rank's blocks are `count / world` (a rank's
        // own block pins its output to its input, and every rank's input to
        // what each peer expects), so the group shares a block size, which
        // the small-message LL exchange needs; the fingerprint checks it.
        // Splits given, even ones, promise nothing about the other ranks'.
        let agreed = if input_splits.is_empty() && output_splits.is_empty() {
            input.count() / world
        } else {
            0
        };
        self.all_to_all_impl(&ob, &ib, agreed, call)
    }

    /// `inputs[q]` to rank `q`, `outputs[s]` from rank `s` (lists of one
    /// tensor per rank; lengths may differ per peer).
    pub fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor], call: &Call<'_, D>) -> Result<Work<D>> {
        let world = self.size();
        if outputs.len() != world || inputs.len() != world {
            return Err(Error::invalid(format!(
                "all_to_all: {} outputs and {} inputs for a world of {world}",
                outputs.len(),
                inputs.len()
            )));
        }
        self.all_to_all_impl(outputs, inputs, 0, call)
    }

    /// `agreed`: the per-peer block every rank shares, in elements (0: none).
    fn all_to_all_impl(
        &self,
        outputs: &[Tensor],
        inputs: &[Tensor],
        agreed: usize,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        let dtype = inputs.first().map_or(DType::U8, Tensor::dtype);
        for t in inputs.iter().chain(outputs) {
            if t.dtype() != dtype {
                return Err(Error::invalid("all_to_all: every tensor must have one dtype"));
            }
            self.checked("all_to_all tensor", t)?;
        }
        let me = self.rank();
        if inputs[me].count() != outputs[me].count() {
            return Err(Error::invalid(format!(
                "all_to_all: rank {me} sends itself {} elements but expects {}",
                inputs[me].count(),
                outputs[me].count()
            )));
        }
        let mut l = Lists::new(self.size());
        for q in 0..self.size() {
            l.sends[q] = Some((inputs[q].count(), inputs[q].ptr()));
            l.recvs[q] = Some((outputs[q].count(), outputs[q].ptr()));
        }
        let coll = match agreed {
            0 => Collective::AllToAllV,
            _ => Collective::AllToAll,
        };
        let asked = call.asked_coll_algo()?;
        let plan = self.plan_call(coll, dtype, ReduceOp::Sum, agreed, asked, &[])?;
        self.submit(call, "all_to_all", |s| match plan {
            Plan::Nothing | Plan::Copy | Plan::Levels => Ok(()),
            Plan::Vendor => run::vendor_exchange(s, dtype, l, me),
            Plan::Kernel(k) => run::exchange(s, k.kind, dtype, &l, agreed),
        })
    }

    /// Every rank's `input` into `outputs[rank]` on `root` (elsewhere
    /// `outputs` may be empty).
    pub fn gather(&self, outputs: &[Tensor], input: Tensor, root: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.check_rank("gather root", root)?;
        self.checked("gather input", &input)?;
        let (me, world, n) = (self.rank(), self.size(), input.count());
        let mut l = Lists::new(world);
        l.sends[root] = Some((n, input.ptr()));
        if me == root {
            if outputs.len() != world {
                return Err(Error::invalid(format!(
                    "gather: the root needs {world} output tensors, got {}",
                    outputs.len()
                )));
            }
            self.checked_parts("gather", "output", outputs, &input, "input")?;
            for (s, o) in outputs.iter().enumerate() {
                l.recvs[s] = Some((n, o.ptr()));
            }
        }
        self.rooted(Collective::Gather, input.dtype(), n, l, call)
    }

    /// `inputs[rank]` of `root` into `output` on every rank (elsewhere
    /// `inputs` may be empty).
    pub fn scatter(&self, output: Tensor, inputs: &[Tensor], root: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.check_rank("scatter root", root)?;
        self.checked("scatter output", &output)?;
        let (me, world, n) = (self.rank(), self.size(), output.count());
        let mut l = Lists::new(world);
        l.recvs[root] = Some((n, output.ptr()));
        if me == root {
            if inputs.len() != world {
                return Err(Error::invalid(format!(
                    "scatter: the root needs {world} input tensors, got {}",
                    inputs.len()
                )));
            }
            self.checked_parts("scatter", "input", inputs, &output, "output")?;
            for (q, i) in inputs.iter().enumerate() {
                l.sends[q] = Some((n, i.ptr()));
            }
        }
        self.rooted(Collective::Scatter, output.dtype(), n, l, call)
    }

    /// Gather's and scatter's common path: blocks of `n` to or from the
    /// root, as listed.
    fn rooted(&self, coll: Collective, dtype: DType, n: usize, l: Lists, call: &Call<'_, D>) -> Result<Work<D>> {
        let what = match coll {
            Collective::Gather => "gather",
            _ => "scatter",
        };
        let asked = call.asked_coll_algo()?;
        let plan = self.plan_call(coll, dtype, ReduceOp::Sum, n, asked, &[])?;
        let me = self.rank();
        self.submit(call, what, |s| match plan {
            Plan::Nothing | Plan::Copy | Plan::Levels => Ok(()),
            Plan::Vendor => run::vendor_exchange(s, dtype, l, me),
            Plan::Kernel(k) => run::exchange(s, k.kind, dtype, &l, n),
        })
    }
}

/// An all-gather through NCCL/RCCL: every rank calls the library's
/// all-gather, whatever the layout of its own outputs. Outputs that are not
/// back to back gather into the staging buffer (the input first, aligned
/// there) and are copied out.
fn vendor_all_gather<D: Device>(
    s: &mut crate::comm::submit::Submit<'_, D>,
    dtype: DType,
    input: Tensor,
    whole: Option<Tensor>,
    outs: &[DevicePtr],
    n: usize,
) -> Result<()> {
    if let Some(out) = whole {
        let op = VendorOp::AllGather {
            send: input.ptr(),
            recv: out.ptr(),
            count: n,
        };
        return run::run_vendor(s, dtype, op);
    }
    let block = n * dtype.size();
    let first = block.next_multiple_of(256);
    let base = run::staging_at(s, first + block * outs.len())?;
    s.inner.device.copy_device(base, input.ptr(), block, s.stream)?;
    let recv = base.offset(first);
    let op = VendorOp::AllGather {
        send: base,
        recv,
        count: n,
    };
    run::run_vendor(s, dtype, op)?;
    for (q, out) in outs.iter().enumerate() {
        s.inner
            .device
            .copy_device(*out, recv.offset(q * block), block, s.stream)?;
    }
    Ok(())
}

/// All-to-all's splits: as given, or `count / world` each when none are.
fn splits(world: usize, what: &str, given: &[usize], t: &Tensor) -> Result<Vec<usize>> {
    if given.is_empty() {
        if t.count() % world != 0 {
            return Err(Error::invalid(format!(
                "all_to_all: {what} of {} elements does not split evenly over {world} ranks",
                t.count()
            )));
        }
        return Ok(vec![t.count() / world; world]);
    }
    if given.len() != world {
        return Err(Error::invalid(format!(
            "all_to_all: {} {what} splits for a world of {world}",
            given.len()
        )));
    }
    let sum = given.iter().try_fold(0usize, |a, &b| a.checked_add(b));
    if sum != Some(t.count()) {
        return Err(Error::invalid(format!(
            "all_to_all: {what} splits {given:?} do not sum to its {} elements",
            t.count()
        )));
    }
    Ok(given.to_vec())
}

/// `t` cut into blocks of `sizes`, back to back.
fn blocks(t: &Tensor, sizes: &[usize]) -> Result<Vec<Tensor>> {
    let mut at = 0;
    sizes
        .iter()
        .map(|&n| {
            let b = t.slice(at, n);
            at += n;
            b
        })
        .collect()
}
