//! Sends and receives (one batch of them can never deadlock on its own
//! order) and the barrier. Validate, plan, submit.

use super::run;
use super::Lists;
use crate::algo::CollectiveCall;
use crate::comm::call::Call;
use crate::comm::communicator::Communicator;
use crate::comm::tensor::Tensor;
use crate::comm::vendor::VendorOp;
use crate::comm::work::Work;
use crate::device::{Device, DeviceBuffer, DevicePtr};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::plan::{Collective, Plan};

/// One side of a point-to-point batch ([`Communicator::batch_p2p`]).
#[derive(Debug, Clone, Copy)]
pub enum P2p {
    /// Send the tensor to the rank.
    Send(Tensor, usize),
    /// Receive the tensor from the rank.
    Recv(Tensor, usize),
}

fn op_tensor(o: &P2p) -> Tensor {
    match o {
        P2p::Send(t, _) | P2p::Recv(t, _) => *t,
    }
}

impl<D: Device> Communicator<D> {
    // --------------------------------------------------------- send, receive

    /// Send `t` to `peer` (matched, in order, by its [`Communicator::recv`]).
    pub fn send(&self, t: Tensor, peer: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.batch_p2p(&[P2p::Send(t, peer)], call)
    }

    /// Receive into `t` from `peer`.
    pub fn recv(&self, t: Tensor, peer: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.batch_p2p(&[P2p::Recv(t, peer)], call)
    }

    /// Sends and receives as one group: they all make progress together, so
    /// a batch cannot deadlock on its own order (a ring, a pairwise swap).
    /// Messages between two ranks are matched in the order they are issued;
    /// each receive must expect as many elements as its send carries.
    pub fn batch_p2p(&self, ops: &[P2p], call: &Call<'_, D>) -> Result<Work<D>> {
        let me = self.rank();
        let dtype = match ops.first() {
            Some(P2p::Send(t, _) | P2p::Recv(t, _)) => t.dtype(),
            None => DType::U8,
        };
        for op in ops {
            let (t, peer) = match op {
                P2p::Send(t, p) | P2p::Recv(t, p) => (t, *p),
            };
            self.check_rank("peer", peer)?;
            self.checked("send/recv tensor", t)?;
            if t.dtype() != dtype {
                return Err(Error::invalid("batch_p2p: every tensor must have one dtype"));
            }
        }
        // Messages to ourselves pair up in order and become copies.
        let own_sends: Vec<Tensor> = ops
            .iter()
            .filter(|o| matches!(o, P2p::Send(_, p) if *p == me))
            .map(op_tensor)
            .collect();
        let own_recvs: Vec<Tensor> = ops
            .iter()
            .filter(|o| matches!(o, P2p::Recv(_, p) if *p == me))
            .map(op_tensor)
            .collect();
        if own_sends.len() != own_recvs.len() || own_sends.iter().zip(&own_recvs).any(|(a, b)| a.count() != b.count()) {
            return Err(Error::invalid(
                "batch_p2p: sends to this rank itself must be matched by receives of the same length in the same batch",
            ));
        }
        // Rounds: the k-th message with a peer goes in round k, so one
        // launch carries at most one send and one receive per peer.
        let mut rounds: Vec<Lists> = Vec::new();
        let mut seen_send = vec![0usize; self.size()];
        let mut seen_recv = vec![0usize; self.size()];
        for op in ops {
            let (list_send, peer, t) = match op {
                P2p::Send(t, p) => (true, *p, t),
                P2p::Recv(t, p) => (false, *p, t),
            };
            if peer == me {
                continue;
            }
            let k = if list_send {
                &mut seen_send[peer]
            } else {
                &mut seen_recv[peer]
            };
            if rounds.len() <= *k {
                rounds.push(Lists::new(self.size()));
            }
            let slot = (t.count(), t.ptr());
            if list_send {
                rounds[*k].sends[peer] = Some(slot);
            } else {
                rounds[*k].recvs[peer] = Some(slot);
            }
            *k += 1;
        }
        let world = self.size();
        let plan = self.plan_call(Collective::SendRecv, dtype, ReduceOp::Sum, 0, None, &[])?;
        self.submit(call, "send/recv", |s| {
            for (a, b) in own_sends.iter().zip(&own_recvs) {
                run::copy_if_apart(s, b.ptr(), a.ptr(), a.count() * dtype.size())?;
            }
            for l in &rounds {
                match plan {
                    Plan::Kernel(k) => {
                        let mut c =
                            CollectiveCall::new(k.kind, dtype, ReduceOp::Sum, 0, DevicePtr::NULL, DevicePtr::NULL);
                        c.per_peer = l.table(u64::MAX);
                        run::enqueue(s, &c)?;
                    }
                    _ => run::run_vendor(
                        s,
                        dtype,
                        VendorOp::Exchange {
                            sends: &l.sends[..world],
                            recvs: &l.recvs[..world],
                        },
                    )?,
                }
            }
            Ok(())
        })
    }

    // ---------------------------------------------------------------- barrier

    /// Wait until every rank reaches the barrier (a one-element all-reduce
    /// on the communicator's scratch memory: the kernels', NCCL/RCCL's where
    /// there is no workspace, or the levels' across nodes).
    pub fn barrier(&self, call: &Call<'_, D>) -> Result<Work<D>> {
        let plan = self.plan_call(Collective::Barrier, DType::I32, ReduceOp::Sum, 1, None, &[])?;
        if let (Plan::Levels, Some(levels)) = (plan, &self.inner.levels) {
            return levels.barrier(&self.inner.stream, call);
        }
        self.submit(call, "barrier", |s| {
            let ptr = s.res.scratch.ptr();
            match plan {
                Plan::Kernel(k) => run::enqueue(s, &CollectiveCall::new(k.kind, k.elem, ReduceOp::Sum, 1, ptr, ptr)),
                Plan::Vendor => {
                    let op = VendorOp::AllReduce {
                        send: ptr,
                        recv: ptr,
                        count: 1,
                        red: ReduceOp::Sum.into(),
                    };
                    run::run_vendor(s, DType::I32, op)
                }
                Plan::Nothing | Plan::Copy | Plan::Levels => Ok(()),
            }
        })
    }
}
