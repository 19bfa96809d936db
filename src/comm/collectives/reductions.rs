//! All-reduce, reduce and reduce-scatter: validate, plan, submit.

use super::run;
use super::Lists;
use crate::comm::call::{Call, Reduction};
use crate::comm::communicator::Communicator;
use crate::comm::tensor::Tensor;
use crate::comm::vendor::VendorOp;
use crate::comm::work::Work;
use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::plan::{Collective, Plan};

impl<D: Device> Communicator<D> {
    /// In-place all-reduce of `t`.
    pub fn all_reduce(&self, t: Tensor, red: impl Into<Reduction>, call: &Call<'_, D>) -> Result<Work<D>> {
        self.all_reduce_into(t, t, red, call)
    }

    /// Out-of-place all-reduce: `output` (as many elements as `input`, or
    /// `input` itself) receives the reduction of every rank's `input`.
    pub fn all_reduce_into(
        &self,
        input: Tensor,
        output: Tensor,
        red: impl Into<Reduction>,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        let red = red.into();
        Self::same_dtype(&input, &output)?;
        if input.count() != output.count() {
            return Err(Error::invalid(format!(
                "all_reduce: input has {} elements, output {}",
                input.count(),
                output.count()
            )));
        }
        self.checked("all_reduce input", &input)?;
        if output.ptr() != input.ptr() {
            // In place, the input's check covered it (same count and dtype).
            self.checked("all_reduce output", &output)?;
        }
        let (dtype, count) = (input.dtype(), input.count());
        let (op, scalar, flags) = self.checked_reduction(&red, dtype)?;
        let asked = call.asked_algo()?;
        let plan = self.plan_call(
            Collective::AllReduce,
            dtype,
            op,
            count,
            asked,
            &[input.ptr(), output.ptr()],
        )?;
        if let (Plan::Levels, Some(levels)) = (plan, &self.inner.levels) {
            return levels.all_reduce(self.size(), &self.inner.stream, input, output, red, call);
        }
        self.submit(call, "all_reduce", |s| match plan {
            Plan::Nothing | Plan::Levels => Ok(()),
            Plan::Copy => run::copy_if_apart(s, output.ptr(), input.ptr(), count * dtype.size()),
            Plan::Vendor => {
                let op = VendorOp::AllReduce {
                    send: input.ptr(),
                    recv: output.ptr(),
                    count,
                    red,
                };
                run::run_vendor(s, dtype, op)
            }
            Plan::Kernel(k) => run::all_reduce(s, k, op, scalar, flags, count, input.ptr(), output.ptr()),
        })
    }

    /// Reduce every rank's `t` into `t` on `root` (in place there; the other
    /// ranks' `t` is only read).
    pub fn reduce(&self, t: Tensor, red: impl Into<Reduction>, root: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        let red = red.into();
        self.check_rank("reduce root", root)?;
        self.checked("reduce tensor", &t)?;
        let (dtype, count) = (t.dtype(), t.count());
        let (op, scalar, flags) = self.checked_reduction(&red, dtype)?;
        let asked = call.asked_coll_algo()?;
        let plan = self.plan_call(Collective::Reduce, dtype, op, count, asked, &[])?;
        self.submit(call, "reduce", |s| match plan {
            Plan::Nothing | Plan::Copy | Plan::Levels => Ok(()),
            Plan::Vendor => {
                let op = VendorOp::Reduce {
                    send: t.ptr(),
                    recv: t.ptr(),
                    count,
                    red,
                    root,
                };
                run::run_vendor(s, dtype, op)
            }
            Plan::Kernel(k) => {
                // Only the root receives (and writes `t`); the others only send.
                let mut l = Lists::new(s.inner.world);
                l.sends[root] = Some((count, t.ptr()));
                if s.inner.rank == root {
                    for q in 0..s.inner.world {
                        l.recvs[q] = Some((count, t.ptr()));
                    }
                }
                run::reduce_to(s, k.kind, dtype, op, scalar, flags, count, t.ptr(), &l)
            }
        })
    }

    /// Reduce every rank's `input` (`world` blocks of `output`'s length) and
    /// leave block `rank` of the result in `output`.
    pub fn reduce_scatter_single(
        &self,
        output: Tensor,
        input: Tensor,
        red: impl Into<Reduction>,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        Self::same_dtype(&input, &output)?;
        let world = self.size();
        let n = output.count();
        if input.count() != n.saturating_mul(world) {
            return Err(Error::invalid(format!(
                "reduce_scatter_single: input has {} elements, not world ({world}) x output ({n})",
                input.count()
            )));
        }
        let parts: Vec<Tensor> = (0..world).map(|r| input.slice(r * n, n)).collect::<Result<_>>()?;
        self.reduce_scatter_impl(output, &parts, Some(input), red.into(), call)
    }

    /// Reduce `inputs[r]` of every rank into `output` on rank `r` (one input
    /// tensor per rank, each as long as `output`).
    pub fn reduce_scatter(
        &self,
        output: Tensor,
        inputs: &[Tensor],
        red: impl Into<Reduction>,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        self.reduce_scatter_impl(output, inputs, None, red.into(), call)
    }

    fn reduce_scatter_impl(
        &self,
        output: Tensor,
        inputs: &[Tensor],
        whole: Option<Tensor>,
        red: Reduction,
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        let world = self.size();
        if inputs.len() != world {
            return Err(Error::invalid(format!(
                "reduce_scatter: {} input tensors for a world of {world}",
                inputs.len()
            )));
        }
        // Inputs back to back are one input for NCCL/RCCL, if the output is
        // clear of it or is this rank's part (the library's in-place form).
        let me = self.rank();
        let whole =
            whole.or_else(|| Tensor::joined(inputs).filter(|w| !output.overlaps(w) || inputs.get(me) == Some(&output)));
        let n = output.count();
        self.checked("reduce_scatter output", &output)?;
        self.checked_parts("reduce_scatter", "input", inputs, &output, "output")?;
        let dtype = output.dtype();
        let (op, scalar, flags) = self.checked_reduction(&red, dtype)?;
        let asked = call.asked_coll_algo()?;
        let plan = self.plan_call(Collective::ReduceScatter, dtype, op, n, asked, &[])?;
        if let (Plan::Levels, Some(levels)) = (plan, &self.inner.levels) {
            return levels.reduce_scatter(world, &self.inner.stream, output, inputs, red, call);
        }
        let ins: Vec<DevicePtr> = inputs.iter().map(Tensor::ptr).collect();
        self.submit(call, "reduce_scatter", |s| match plan {
            Plan::Nothing | Plan::Levels => Ok(()),
            Plan::Copy => run::copy_if_apart(s, output.ptr(), ins[0], n * dtype.size()),
            Plan::Kernel(k) => {
                // The kernel takes the list as it is (no contiguous input needed).
                let mut l = Lists::new(s.inner.world);
                for (q, inp) in ins.iter().enumerate() {
                    l.sends[q] = Some((n, *inp));
                    l.recvs[q] = Some((n, output.ptr()));
                }
                run::reduce_to(s, k.kind, dtype, op, scalar, flags, n, output.ptr(), &l)
            }
            Plan::Vendor => {
                let send = match whole {
                    Some(t) => t.ptr(),
                    // NCCL reduces one contiguous input: stage the list there.
                    // Room for the output after it, should run_vendor stage that.
                    None => {
                        let block = n * dtype.size();
                        run::stage_padded(s, &ins, block, (ins.len() * block).next_multiple_of(256) + block)?
                    }
                };
                let op = VendorOp::ReduceScatter {
                    send,
                    recv: output.ptr(),
                    count: n,
                    red,
                };
                run::run_vendor(s, dtype, op)
            }
        })
    }
}
