//! Every torchcomms collective, in Rust form. Each reads the same way:
//! validate its arguments (before anything is launched, so bad input
//! changes nothing), ask the planner how it runs (`crate::plan`: one
//! decision, from what every rank shares), then submit that plan on the
//! call's stream (`run`).
//!
//! - `reductions`: all-reduce, reduce, reduce-scatter;
//! - `movers`: broadcast, all-gather, all-to-all(-v), gather, scatter;
//! - `p2p`: sends, receives, their batches, barrier;
//! - `run`: what a plan queues (launches, library calls, local staging).

mod movers;
mod p2p;
mod reductions;
mod run;

pub use p2p::P2p;

use super::call::{Factor, Reduction};
use super::communicator::Communicator;
use super::tensor::Tensor;
use crate::device::{BackendKind, Device, DevicePtr, MAX_RANKS, PARAM_SCALAR_IS_PTR};
use crate::dtype::{check_supported, DType, ReduceOp};
use crate::error::{Error, Result};
use crate::plan::{Algorithm, Collective, Facts, Plan, Request};

/// `per_peer` rows of the host protocols (`backends/host/collectives.rs`).
const SEND_COUNT: usize = 0;
const SEND_ADDR: usize = 1;
const RECV_COUNT: usize = 2;
const RECV_ADDR: usize = 3;

/// Per-peer send and receive lists of one exchange, one entry per rank (a
/// world above [`MAX_RANKS`] has them too: NCCL/RCCL carries it).
#[derive(Clone)]
struct Lists {
    sends: Vec<Option<(usize, DevicePtr)>>,
    recvs: Vec<Option<(usize, DevicePtr)>>,
}

impl Lists {
    fn new(world: usize) -> Self {
        Lists {
            sends: vec![None; world],
            recvs: vec![None; world],
        }
    }

    /// The host protocols' table: counts and addresses; `absent` marks a peer
    /// with nothing listed (0 for exchanges, u64::MAX for send/recv batches,
    /// where a message of 0 elements still counts).
    /// Only kernels read it, and they serve worlds up to [`MAX_RANKS`].
    fn table(&self, absent: u64) -> [[u64; MAX_RANKS]; 4] {
        let mut t = [[0u64; MAX_RANKS]; 4];
        for (q, (send, recv)) in self.sends.iter().zip(&self.recvs).enumerate().take(MAX_RANKS) {
            let (sc, sa) = send.map_or((absent, 0), |(c, p)| (c as u64, p.0));
            let (rc, ra) = recv.map_or((absent, 0), |(c, p)| (c as u64, p.0));
            t[SEND_COUNT][q] = sc;
            t[SEND_ADDR][q] = sa;
            t[RECV_COUNT][q] = rc;
            t[RECV_ADDR][q] = ra;
        }
        t
    }
}

impl<D: Device> Communicator<D> {
    // ------------------------------------------------------------ planning

    /// How a call of `coll` runs here: the planner over this
    /// communicator's facts. `count`: elements (all-reduce, broadcast,
    /// reduce) or the agreed per-peer block (0: none); `operands`: this
    /// rank's addresses the kernels load, for local staging.
    fn plan_call(
        &self,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        asked: Option<Algorithm>,
        operands: &[DevicePtr],
    ) -> Result<Plan> {
        let inner = &*self.inner;
        let (vendor, ll_room, heap) = self.with_resources(|res| {
            let room = res
                .ws
                .as_ref()
                .map_or(0, |ws| crate::algo::layout::ll_capacity(ws.slot_bytes(), inner.world));
            (res.vendor.available(), room, res.heap.is_some())
        })?;
        let table = super::communicator::read(&inner.table);
        let facts = Facts {
            backend: self.backend(),
            world: inner.world,
            kernels: inner.kernels,
            levels: inner.levels.as_ref().map(|l| l.uniform()),
            vendor,
            ll_room,
            heap,
            opts: &inner.opts,
            table: &table,
        };
        let request = Request {
            coll,
            dtype,
            op,
            count,
            asked,
            operands,
        };
        crate::plan::plan(&request, &facts)
    }

    /// The way a call of `coll` with `count` elements (all-reduce,
    /// broadcast, reduce) or `count` a peer (the others) of `dtype` and
    /// `op` would run on this communicator, with `asked` as the call's
    /// choice: `None` where it runs nothing (an empty call, a world of one)
    /// or runs in two levels across nodes. For the bench's `algo` column and
    /// the conformance suite; hidden: an engine has no use for it.
    #[cfg(any(test, feature = "testing"))]
    #[doc(hidden)]
    pub fn planned_algorithm(
        &self,
        coll: Collective,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        asked: Option<Algorithm>,
    ) -> Result<Option<Algorithm>> {
        Ok(self.plan_call(coll, dtype, op, count, asked, &[])?.algorithm())
    }

    // -------------------------------------------------------------- checks

    fn backend(&self) -> BackendKind {
        self.inner.device.facts().backend
    }

    /// Bytes of `t`, checked against the device (before anything is queued).
    fn checked(&self, what: &str, t: &Tensor) -> Result<usize> {
        let bytes = t.bytes().map_err(|e| context(e, what))?;
        if bytes > 0 && t.ptr() == DevicePtr::NULL {
            return Err(Error::invalid(format!(
                "{what}: a null address for {} x {}",
                t.count(),
                t.dtype()
            )));
        }
        if bytes > 0 {
            self.inner
                .device
                .check_memory(t.ptr(), bytes)
                .map_err(|e| context(e, what))?;
        }
        Ok(bytes)
    }

    fn check_rank(&self, what: &str, r: usize) -> Result<()> {
        if r >= self.size() {
            return Err(Error::invalid(format!(
                "{what} {r} is not a rank of a world of {}",
                self.size()
            )));
        }
        Ok(())
    }

    /// Every tensor of a list (`part`s of `coll`) against `like` (the
    /// `other` side of the call): its dtype, its count, on this device.
    fn checked_parts(&self, coll: &str, part: &str, list: &[Tensor], like: &Tensor, other: &str) -> Result<()> {
        let n = like.count();
        for (r, t) in list.iter().enumerate() {
            match part {
                "input" => Self::same_dtype(t, like)?,
                _ => Self::same_dtype(like, t)?,
            }
            if t.count() != n {
                return Err(Error::invalid(format!(
                    "{coll}: {part} {r} has {} elements, {other} {n}",
                    t.count()
                )));
            }
            self.checked(&format!("{coll} {part}"), t)?;
        }
        Ok(())
    }

    fn same_dtype(a: &Tensor, b: &Tensor) -> Result<()> {
        if a.dtype() != b.dtype() {
            return Err(Error::invalid(format!(
                "input is {} but output is {}: a collective moves one dtype",
                a.dtype(),
                b.dtype()
            )));
        }
        Ok(())
    }

    /// The reduction's op and factor, checked against `dtype`.
    fn checked_reduction(&self, red: &Reduction, dtype: DType) -> Result<(ReduceOp, u64, u32)> {
        let op = red.op();
        check_supported(dtype, op)?;
        match red.factor()? {
            None => Ok((op, 0, 0)),
            Some(Factor::Host(f)) => Ok((op, (f as f32).to_bits() as u64, 0)),
            Some(Factor::Device(t)) => {
                if t.dtype() != dtype || t.count() == 0 {
                    return Err(Error::invalid(format!(
                        "premul_sum's device factor must be one {dtype} element, not {} x {}",
                        t.count(),
                        t.dtype()
                    )));
                }
                self.checked("premul_sum factor", &t)?;
                Ok((op, t.ptr().0, PARAM_SCALAR_IS_PTR))
            }
        }
    }
}

fn context(e: Error, what: &str) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{what}: {m}")),
        other => other,
    }
}
