//! The data calls of a communicator: collectives, point-to-point and grouped
//! exchanges. Each public method checks its own arguments, then names one
//! [`Call`]; [`Call::enqueue`] is the one place that hands an entry point of
//! the table its arguments as `nccl.h` declares them.

use std::ffi::{c_int, c_void};

#[cfg(any(test, feature = "testing"))]
use super::codes::builtin_op;
use super::codes::nccl_dtype;
use super::comm::CclComm;
use super::ffi::{Api, NcclResult, RawComm, RawStream, NCCL_IN_PROGRESS, NCCL_SUCCESS};
use super::premul::CclReduction;
use crate::device::DevicePtr;
use crate::dtype::DType;
#[cfg(any(test, feature = "testing"))]
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};

/// What every data call takes besides its op and its root or peer.
#[derive(Clone, Copy)]
struct Args {
    send: DevicePtr,
    recv: DevicePtr,
    count: usize,
    dtype: DType,
    stream: u64,
}

impl Args {
    fn new(send: DevicePtr, recv: DevicePtr, count: usize, dtype: DType, stream: u64) -> Args {
        Args {
            send,
            recv,
            count,
            dtype,
            stream,
        }
    }

    /// A point-to-point call's one buffer: a send reads it, a receive writes it.
    fn one(buf: DevicePtr, count: usize, dtype: DType, stream: u64) -> Args {
        Args::new(buf, buf, count, dtype, stream)
    }
}

/// An entry point of the table that moves data, with the arguments that are
/// its own: an `ncclRedOp_t`, a root or a peer.
#[derive(Clone, Copy)]
enum Call {
    AllReduce(c_int),
    ReduceScatter(c_int),
    /// The op, then the root.
    Reduce(c_int, c_int),
    /// The root.
    Broadcast(c_int),
    AllGather,
    /// The peer.
    Send(c_int),
    /// The peer.
    Recv(c_int),
}

impl Call {
    /// Queue this call on `comm` and return NCCL's result, unsettled.
    ///
    /// # Safety
    /// `args` must keep the contract of the public method that made the call
    /// (see [`CclComm::all_reduce`]), and `comm` must be live.
    unsafe fn enqueue(self, api: &Api, args: &Args, comm: RawComm) -> NcclResult {
        let (send, recv) = (args.send.0 as *const c_void, args.recv.0 as *mut c_void);
        let (count, dtype, stream) = (args.count, nccl_dtype(args.dtype), args.stream as RawStream);
        // SAFETY: forwarded from the caller's contract; each entry point gets
        // the arguments of its prototype in nccl.h.
        unsafe {
            match self {
                Call::AllReduce(op) => (api.all_reduce)(send, recv, count, dtype, op, comm, stream),
                Call::ReduceScatter(op) => (api.reduce_scatter)(send, recv, count, dtype, op, comm, stream),
                Call::Reduce(op, root) => (api.reduce)(send, recv, count, dtype, op, root, comm, stream),
                Call::Broadcast(root) => (api.broadcast)(send, recv, count, dtype, root, comm, stream),
                Call::AllGather => (api.all_gather)(send, recv, count, dtype, comm, stream),
                Call::Send(peer) => (api.send)(send, count, dtype, peer, comm, stream),
                Call::Recv(peer) => (api.recv)(recv, count, dtype, peer, comm, stream),
            }
        }
    }
}

/// `call` with each peer that `list` names, in rank order, with its count
/// and buffer (`None`: nothing with that peer).
fn listed(
    list: &[Option<(usize, DevicePtr)>],
    call: fn(c_int) -> Call,
) -> impl Iterator<Item = (Call, usize, DevicePtr)> + '_ {
    let named = move |(peer, item): (usize, &Option<_>)| item.map(|(count, buf)| (call(peer as c_int), count, buf));
    list.iter().enumerate().filter_map(named)
}

impl CclComm {
    /// Queue `call` on the live communicator and settle its result.
    ///
    /// # Safety
    /// As [`Call::enqueue`], for `args`.
    unsafe fn run(&self, name: &'static str, call: Call, args: Args) -> Result<()> {
        let api = &self.lib.api;
        // SAFETY: forwarded from the caller's contract.
        self.call(name, |comm| unsafe { call.enqueue(api, &args, comm) })
    }

    /// [`CclComm::run`] for a call that reduces with `red`, whose op is
    /// made on the communicator (premul_sum: a dynamic op, destroyed once
    /// the call is queued).
    ///
    /// # Safety
    /// As [`Call::enqueue`], for `args` and a device factor's address.
    unsafe fn run_reduction(
        &self,
        name: &'static str,
        red: CclReduction,
        args: Args,
        call: impl FnOnce(c_int) -> Call,
    ) -> Result<()> {
        let api = &self.lib.api;
        self.call_with(name, |comm| {
            let (op, _dyn) = self.op_for(comm, red, args.dtype)?;
            // SAFETY: forwarded from the caller's contract.
            Ok(unsafe { call(op).enqueue(api, &args, comm) })
        })
    }

    /// All-reduce `count` elements from `send` into `recv` (may be equal) on `stream`.
    ///
    /// # Safety
    /// `send` and `recv` must be device addresses of this communicator's device
    /// holding `count` elements of `dtype`, kept alive until the stream has run
    /// the operation; `stream` must be a live stream of that device (or 0).
    #[allow(clippy::too_many_arguments)]
    #[cfg(any(test, feature = "testing"))]
    pub unsafe fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<()> {
        let op = builtin_op(dtype, op)?;
        let args = Args::new(send, recv, count, dtype, stream);
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.run("ncclAllReduce", Call::AllReduce(op), args) }
    }

    /// All-reduce with any reduction (premul_sum through a dynamic op).
    ///
    /// # Safety
    /// As [`CclComm::all_reduce`]; a device factor's address too.
    pub unsafe fn all_reduce_with(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        red: CclReduction,
        stream: u64,
    ) -> Result<()> {
        let args = Args::new(send, recv, count, dtype, stream);
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.run_reduction("ncclAllReduce", red, args, Call::AllReduce) }
    }

    /// Reduce `world * recv_count` elements of `send` across ranks; rank `r`
    /// receives block `r` (`recv_count` elements) in `recv`.
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`], with `send` holding `world * recv_count`
    /// elements and `recv` holding `recv_count`.
    #[allow(clippy::too_many_arguments)]
    #[cfg(any(test, feature = "testing"))]
    pub unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<()> {
        let op = builtin_op(dtype, op)?;
        let args = Args::new(send, recv, recv_count, dtype, stream);
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.run("ncclReduceScatter", Call::ReduceScatter(op), args) }
    }

    /// Reduce-scatter with any reduction.
    ///
    /// # Safety
    /// As [`CclComm::reduce_scatter`]; a device factor's address too.
    pub unsafe fn reduce_scatter_with(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        red: CclReduction,
        stream: u64,
    ) -> Result<()> {
        let args = Args::new(send, recv, recv_count, dtype, stream);
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.run_reduction("ncclReduceScatter", red, args, Call::ReduceScatter) }
    }

    /// Reduce `count` elements of every rank's `send` into `recv` on `root`.
    ///
    /// # Safety
    /// As [`CclComm::all_reduce`] (`recv` is only written on the root).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        red: CclReduction,
        root: usize,
        stream: u64,
    ) -> Result<()> {
        self.check_peer(root)?;
        let args = Args::new(send, recv, count, dtype, stream);
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.run_reduction("ncclReduce", red, args, |op| Call::Reduce(op, root as c_int)) }
    }

    /// Copy `count` elements of `send` on `root` into `recv` on every rank.
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`] (`send` is only read on the root).
    pub unsafe fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
        stream: u64,
    ) -> Result<()> {
        if root >= self.world {
            return Err(Error::invalid(format!(
                "broadcast root {root} is not in a world of {}",
                self.world
            )));
        }
        let args = Args::new(send, recv, count, dtype, stream);
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.run("ncclBroadcast", Call::Broadcast(root as c_int), args) }
    }

    /// Gather `send_count` elements from every rank into `recv`, in rank order.
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`], with `send` holding `send_count`
    /// elements and `recv` holding `world * send_count`.
    pub unsafe fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DType,
        stream: u64,
    ) -> Result<()> {
        let args = Args::new(send, recv, send_count, dtype, stream);
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.run("ncclAllGather", Call::AllGather, args) }
    }

    /// Send `count` elements to `peer` (pair with its `recv`, usually in a group).
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`], for `buf` alone.
    #[cfg(any(test, feature = "testing"))]
    pub unsafe fn send(&self, buf: DevicePtr, count: usize, dtype: DType, peer: usize, stream: u64) -> Result<()> {
        self.check_peer(peer)?;
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            self.run(
                "ncclSend",
                Call::Send(peer as c_int),
                Args::one(buf, count, dtype, stream),
            )
        }
    }

    /// Receive `count` elements from `peer`.
    ///
    /// # Safety
    /// As for [`CclComm::all_reduce`], for `buf` alone.
    #[cfg(any(test, feature = "testing"))]
    pub unsafe fn recv(&self, buf: DevicePtr, count: usize, dtype: DType, peer: usize, stream: u64) -> Result<()> {
        self.check_peer(peer)?;
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            self.run(
                "ncclRecv",
                Call::Recv(peer as c_int),
                Args::one(buf, count, dtype, stream),
            )
        }
    }

    /// Sends and receives with every listed peer as one group (`None`:
    /// nothing with that peer): all-to-all(-v), gather, scatter, batches of
    /// point-to-point calls. A group cannot deadlock on its own order.
    ///
    /// # Safety
    /// As [`CclComm::all_reduce`], for every listed (count, address).
    pub unsafe fn exchange(
        &self,
        sends: &[Option<(usize, DevicePtr)>],
        recvs: &[Option<(usize, DevicePtr)>],
        dtype: DType,
        stream: u64,
    ) -> Result<()> {
        // Lists may be longer than the world (fixed-size tables), never name
        // a rank past it.
        let beyond = |l: &[Option<(usize, DevicePtr)>]| l.iter().skip(self.world).any(Option::is_some);
        if beyond(sends) || beyond(recvs) {
            return Err(Error::invalid(format!("a peer past the world of {}", self.world)));
        }
        let api = &self.lib.api;
        self.call_with("ncclGroupEnd", |comm| {
            // SAFETY: no arguments; group state is per thread, and the
            // communicator lock keeps other threads' calls out of the group.
            let r = unsafe { (api.group_start)() };
            if r != NCCL_SUCCESS {
                return Ok(r);
            }
            let mut first_error = NCCL_SUCCESS;
            // Every send is queued before any receive.
            for (call, count, buf) in listed(sends, Call::Send).chain(listed(recvs, Call::Recv)) {
                let args = Args::one(buf, count, dtype, stream);
                // SAFETY: forwarded from the caller's contract.
                let r = unsafe { call.enqueue(api, &args, comm) };
                if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS && first_error == NCCL_SUCCESS {
                    first_error = r;
                }
            }
            // The group must end whatever happened inside it.
            // SAFETY: ends the group started above on this thread.
            let end = unsafe { (api.group_end)() };
            Ok(if first_error != NCCL_SUCCESS { first_error } else { end })
        })
    }
}
