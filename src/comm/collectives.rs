//! Every torchcomms collective, in Rust form: validation (before anything is
//! launched, so bad input changes nothing), then the route: ferrocomm's
//! kernels where it has them (all of them on the host backend, which is the
//! reference; on GPUs all-reduce, broadcast, and the exchange / reduce-to
//! kernels for all-gather, gather, scatter, all-to-all(-v), reduce-scatter and
//! reduce), NCCL/RCCL underneath otherwise. All-gather, reduce-scatter and
//! all-to-all without splits take the kind the dispatch table says
//! ([`coll_kind`]: LL, inbox or NCCL/RCCL, tuned at init); gather, scatter,
//! reduce and all-to-all with splits go as [`route::decide`] says.

use super::call::{Call, Factor, Reduction};
use super::communicator::{Communicator, Submit};
use super::route::{self, Coll, CollRoute, Route};
use super::tensor::Tensor;
use super::vendor::VendorOp;
use super::work::Work;
use crate::algo::kernels::{KernelKind, KERNEL_OPS, QR_DTYPES, QUICK_REDUCE};
use crate::algo::ll_max_block_bytes;
use crate::algo::{AlgoChoice, Algorithm, CollAlgo, Collective, CollectiveCall, DtypeClass};
use crate::device::{BackendKind, Device, DeviceBuffer, DevicePtr, MAX_RANKS, PARAM_DIRECT_OK, PARAM_SCALAR_IS_PTR};
use crate::dtype::{check_supported, DType, ReduceOp};
use crate::error::{Error, Result};
use crate::heap::Heap;

/// One side of a point-to-point batch ([`Communicator::batch_p2p`]).
#[derive(Debug, Clone, Copy)]
pub enum P2p {
    Send(Tensor, usize),
    Recv(Tensor, usize),
}

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
    // ---------------------------------------------------------------- checks

    fn backend(&self) -> BackendKind {
        self.inner.device.facts().backend
    }

    fn on_host(&self) -> bool {
        self.backend() == BackendKind::Host
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

    /// The algorithm a call asked for: the `algo` hint, else the communicator's.
    fn asked_algo(&self, call: &Call<'_, D>) -> Result<AlgoChoice> {
        Ok(call.asked_algo()?.unwrap_or(self.inner.opts.algo))
    }

    // ------------------------------------------------------------ all-reduce

    /// The algorithm dispatch picks for an all-reduce of `count` x `dtype`.
    pub fn choose(&self, algo: AlgoChoice, count: usize, dtype: DType, op: ReduceOp) -> Algorithm {
        let inner = &*self.inner;
        let ccl_allowed = inner.has_vendor && !inner.opts.deterministic;
        let quantize = inner
            .opts
            .quantization
            .codec(self.backend())
            .filter(|_| QR_DTYPES.contains(&dtype) && op == ReduceOp::Sum);
        let bytes = count.saturating_mul(dtype.size());
        if !inner.kernels {
            // No workspace (a communicator between nodes, or more ranks than
            // one node's kernels serve): NCCL/RCCL carries the call.
            return Algorithm::Ccl;
        }
        let class = DtypeClass::of(dtype);
        let mut chosen =
            super::communicator::read(&inner.table).choose(algo, bytes, inner.world, class, ccl_allowed, quantize);
        // The LL protocol has no room for per-rank factors: dispatch takes
        // the push one-shot instead (a fixed choice still gets the error).
        if chosen == Algorithm::OneShotLl && op == ReduceOp::PreMulSum && algo == AlgoChoice::Auto {
            chosen = Algorithm::OneShotPush;
        }
        crate::fc_log!(
            tracing::Level::DEBUG,
            "dispatch: all_reduce {count} x {dtype} {op} ({bytes} bytes, world {}, asked {algo:?}) -> {chosen}",
            inner.world
        );
        chosen
    }

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
        self.checked("all_reduce output", &output)?;
        let dtype = input.dtype();
        let (op, scalar, flags) = self.checked_reduction(&red, dtype)?;
        let algo = self.asked_algo(call)?;
        let algorithm = self.choose(algo, input.count(), dtype, op);
        let vendor = algorithm == Algorithm::Ccl || (!self.on_host() && !KERNEL_OPS.contains(&op));
        if let Some(codec) = algorithm.codec() {
            if !(QR_DTYPES.contains(&dtype) && op == ReduceOp::Sum) {
                return Err(Error::Unsupported(format!(
                    "{algorithm} reduces f16 or bf16 sums only, not {dtype} {op}"
                )));
            }
            let _ = codec;
        }
        if algorithm == Algorithm::OneShotLl && op == ReduceOp::PreMulSum {
            return Err(Error::Unsupported(
                "oneshot-ll carries no premul_sum factors; let dispatch choose".into(),
            ));
        }
        if let Some(levels) = &self.inner.levels {
            return levels.all_reduce(self.size(), &self.inner.stream, input, output, red, call);
        }
        let count = input.count();
        self.submit(call, "all_reduce", |s| {
            if count == 0 {
                return Ok(());
            }
            if s.inner.world == 1 && op != ReduceOp::PreMulSum {
                return copy_if_apart(s, output.ptr(), input.ptr(), count * dtype.size());
            }
            if vendor {
                let op = VendorOp::AllReduce {
                    send: input.ptr(),
                    recv: output.ptr(),
                    count,
                    red,
                };
                return run_vendor(s, dtype, op);
            }
            let Some(kind) = algorithm.kernel_kind() else {
                return Err(Error::Unsupported(format!("{algorithm} has no kernel")));
            };
            let bytes = count * dtype.size();
            // GPU kernels load whole elements: memory that is not aligned to
            // its element goes through the staging buffer (in place there).
            let staged = gpu_misaligned(s, &[input, output]);
            let (inp, out) = match staged {
                true => {
                    let at = stage(s, &[input.ptr()], bytes)?;
                    (at, at)
                }
                false => (input.ptr(), output.ptr()),
            };
            let mut c = CollectiveCall::new(kind, dtype, op, count, inp, out);
            c.codec = algorithm.codec();
            c.scalar = scalar;
            c.flags = flags;
            enqueue(s, &c)?;
            if staged {
                s.inner.device.copy_device(output.ptr(), out, bytes, s.stream)?;
            }
            Ok(())
        })
    }

    // ------------------------------------------------- broadcast and reduce

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
        if self.rank() == root {
            self.checked("broadcast input", &input)?;
        }
        let dtype = input.dtype();
        let count = input.count();
        let on_host = self.on_host();
        self.submit(call, "broadcast", |s| {
            if count == 0 {
                return Ok(());
            }
            if s.inner.world == 1 {
                return copy_if_apart(s, output.ptr(), input.ptr(), bytes);
            }
            // The broadcast kernel moves words of 4 or 2 bytes (any dtype:
            // the bits are not looked at). Every rank launches the same
            // kernel, so the word is chosen from what all of them share, the
            // payload's bytes; a rank whose own addresses are not aligned to
            // it stages them (a per-rank fact decides only local copies).
            let word = [4usize, 2].into_iter().find(|w| bytes % w == 0);
            let kernel = s.inner.kernels && (on_host || !s.res.vendor.available() || dtype.size() <= 4);
            let is_root = s.inner.rank == root;
            match word {
                Some(w) if kernel => {
                    let odd = |p: DevicePtr| p.0 % w as u64 != 0;
                    let staged = odd(output.ptr()) || (is_root && odd(input.ptr()));
                    let (inp, out) = match staged {
                        true => {
                            let at = staging_at(s, bytes)?;
                            if is_root {
                                s.inner.device.copy_device(at, input.ptr(), bytes, s.stream)?;
                            }
                            (at, at)
                        }
                        false => (input.ptr(), output.ptr()),
                    };
                    let kd = if w == 4 { DType::I32 } else { DType::F16 };
                    let mut c = CollectiveCall::new(KernelKind::Broadcast, kd, ReduceOp::Sum, bytes / w, inp, out);
                    c.root = root;
                    enqueue(s, &c)?;
                    if staged {
                        s.inner.device.copy_device(output.ptr(), out, bytes, s.stream)?;
                    }
                    Ok(())
                }
                None if !on_host && !s.res.vendor.available() => {
                    // No NCCL: through the staging buffer, 4-byte aligned.
                    let padded = bytes.next_multiple_of(4);
                    let at = staging_at(s, padded)?;
                    if is_root {
                        s.inner.device.copy_device(at, input.ptr(), bytes, s.stream)?;
                    }
                    let mut c =
                        CollectiveCall::new(KernelKind::Broadcast, DType::I32, ReduceOp::Sum, padded / 4, at, at);
                    c.root = root;
                    enqueue(s, &c)?;
                    s.inner.device.copy_device(output.ptr(), at, bytes, s.stream)
                }
                _ if on_host => {
                    // Odd byte counts: the root sends to everyone.
                    let mut l = Lists::new(s.inner.world);
                    if s.inner.rank == root {
                        for q in 0..s.inner.world {
                            l.sends[q] = Some((count, input.ptr()));
                        }
                    }
                    l.recvs[root] = Some((count, output.ptr()));
                    exchange(s, dtype, &l, 0, false)
                }
                _ => {
                    let op = VendorOp::Broadcast {
                        send: input.ptr(),
                        recv: output.ptr(),
                        count,
                        root,
                    };
                    run_vendor(s, dtype, op)
                }
            }
        })
    }

    /// Reduce every rank's `t` into `t` on `root` (in place there; the other
    /// ranks' `t` is only read).
    pub fn reduce(&self, t: Tensor, red: impl Into<Reduction>, root: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        let red = red.into();
        self.check_rank("reduce root", root)?;
        self.checked("reduce tensor", &t)?;
        let dtype = t.dtype();
        let (op, scalar, flags) = self.checked_reduction(&red, dtype)?;
        let count = t.count();
        let on_host = self.on_host();
        self.submit(call, "reduce", |s| {
            if count == 0 || (s.inner.world == 1 && op != ReduceOp::PreMulSum) {
                return Ok(());
            }
            if !on_host && reduction_route(s, Coll::Reduce, Some(count * dtype.size()), op) == Route::Vendor {
                let op = VendorOp::Reduce {
                    send: t.ptr(),
                    recv: t.ptr(),
                    count,
                    red,
                    root,
                };
                return run_vendor(s, dtype, op);
            }
            // Only the root receives (and writes `t`); the others only send.
            let mut l = Lists::new(s.inner.world);
            l.sends[root] = Some((count, t.ptr()));
            if s.inner.rank == root {
                for q in 0..s.inner.world {
                    l.recvs[q] = Some((count, t.ptr()));
                }
            }
            let ll = op != ReduceOp::PreMulSum && takes_ll(s, dtype, &l, count);
            reduce_to(s, dtype, op, scalar, flags, count, t.ptr(), &l, ll)
        })
    }

    // ------------------------------------------- all-gather, reduce-scatter

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
        for (r, o) in outputs.iter().enumerate() {
            Self::same_dtype(&input, o)?;
            if o.count() != n {
                return Err(Error::invalid(format!(
                    "all_gather: output {r} has {} elements, input {n}",
                    o.count()
                )));
            }
            self.checked("all_gather output", o)?;
        }
        let asked = call.asked_coll_algo()?;
        if let Some(levels) = self.inner.levels.as_ref().filter(|l| l.uniform()) {
            return levels.all_gather(&self.inner.stream, outputs, input, call);
        }
        let dtype = input.dtype();
        let outs: Vec<DevicePtr> = outputs.iter().map(Tensor::ptr).collect();
        let on_host = self.on_host();
        self.submit(call, "all_gather", |s| {
            let mut l = Lists::new(s.inner.world);
            for (q, out) in outs.iter().enumerate() {
                l.sends[q] = Some((n, input.ptr()));
                l.recvs[q] = Some((n, *out));
            }
            if on_host {
                let kind = coll_kind(s, Collective::AllGather, dtype, ReduceOp::Sum, &l, n, asked);
                return exchange(s, dtype, &l, n, kind == CollAlgo::Ll);
            }
            if n == 0 {
                return Ok(());
            }
            if world == 1 {
                return copy_if_apart(s, outs[0], input.ptr(), n * dtype.size());
            }
            let kind = coll_kind(s, Collective::AllGather, dtype, ReduceOp::Sum, &l, n, asked);
            if kind != CollAlgo::Vendor {
                return exchange(s, dtype, &l, n, kind == CollAlgo::Ll);
            }
            if let Some(out) = whole {
                let op = VendorOp::AllGather {
                    send: input.ptr(),
                    recv: out.ptr(),
                    count: n,
                };
                return run_vendor(s, dtype, op);
            }
            // Every rank calls the library's all-gather, whatever the layout
            // of its own outputs: outputs that are not back to back gather
            // into the staging buffer (the input first, aligned there) and
            // are copied out.
            let block = n * dtype.size();
            let first = block.next_multiple_of(256);
            let base = staging_at(s, first + block * world)?;
            s.inner.device.copy_device(base, input.ptr(), block, s.stream)?;
            let recv = base.offset(first);
            let op = VendorOp::AllGather {
                send: base,
                recv,
                count: n,
            };
            run_vendor(s, dtype, op)?;
            for (q, out) in outs.iter().enumerate() {
                s.inner
                    .device
                    .copy_device(*out, recv.offset(q * block), block, s.stream)?;
            }
            Ok(())
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
        for (r, i) in inputs.iter().enumerate() {
            Self::same_dtype(i, &output)?;
            if i.count() != n {
                return Err(Error::invalid(format!(
                    "reduce_scatter: input {r} has {} elements, output {n}",
                    i.count()
                )));
            }
            self.checked("reduce_scatter input", i)?;
        }
        let dtype = output.dtype();
        let (op, scalar, flags) = self.checked_reduction(&red, dtype)?;
        let asked = call.asked_coll_algo()?;
        if let Some(levels) = self.inner.levels.as_ref().filter(|l| l.uniform()) {
            return levels.reduce_scatter(world, &self.inner.stream, output, inputs, red, call);
        }
        let ins: Vec<DevicePtr> = inputs.iter().map(Tensor::ptr).collect();
        let on_host = self.on_host();
        self.submit(call, "reduce_scatter", |s| {
            let mut l = Lists::new(s.inner.world);
            for (q, inp) in ins.iter().enumerate() {
                l.sends[q] = Some((n, *inp));
                l.recvs[q] = Some((n, output.ptr()));
            }
            if on_host {
                let kind = coll_kind(s, Collective::ReduceScatter, dtype, op, &l, n, asked);
                return reduce_to(s, dtype, op, scalar, flags, n, output.ptr(), &l, kind == CollAlgo::Ll);
            }
            if n == 0 {
                return Ok(());
            }
            if world == 1 && op != ReduceOp::PreMulSum {
                return copy_if_apart(s, output.ptr(), ins[0], n * dtype.size());
            }
            let kind = coll_kind(s, Collective::ReduceScatter, dtype, op, &l, n, asked);
            if kind != CollAlgo::Vendor {
                // The kernel takes the list as it is (no contiguous input needed).
                return reduce_to(s, dtype, op, scalar, flags, n, output.ptr(), &l, kind == CollAlgo::Ll);
            }
            let send = match whole {
                Some(t) => t.ptr(),
                // NCCL reduces one contiguous input: stage the list there.
                // Room for the output after it, should run_vendor stage that.
                None => {
                    let block = n * dtype.size();
                    stage_padded(s, &ins, block, (ins.len() * block).next_multiple_of(256) + block)?
                }
            };
            let op = VendorOp::ReduceScatter {
                send,
                recv: output.ptr(),
                count: n,
                red,
            };
            run_vendor(s, dtype, op)
        })
    }

    // ------------------------------------------------------------ all-to-all

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
        let splits = |what: &str, given: &[usize], t: &Tensor| -> Result<Vec<usize>> {
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
        };
        let ins = splits("input", input_splits, &input)?;
        let outs = splits("output", output_splits, &output)?;
        if input.overlaps(&output) && (input != output || ins != outs) {
            return Err(Error::invalid(
                "all_to_all in place needs the same tensor and equal input and output splits",
            ));
        }
        let blocks = |t: &Tensor, s: &[usize]| -> Result<Vec<Tensor>> {
            let mut at = 0;
            s.iter()
                .map(|&n| {
                    let b = t.slice(at, n);
                    at += n;
                    b
                })
                .collect()
        };
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
        let asked = call.asked_coll_algo()?;
        self.submit(call, "all_to_all", |s| {
            // An agreed block goes to the table (LL for small ones, NCCL/RCCL
            // for large ones by default: `algo::dispatch::A2A_VENDOR_MIN_BLOCK_BYTES`)
            // and sizes the exchange's grid; without one the kernels run it
            // (or NCCL/RCCL when asked for).
            let kind = coll_kind(s, Collective::AllToAll, dtype, ReduceOp::Sum, &l, agreed, asked);
            match kind {
                CollAlgo::Vendor => vendor_exchange(s, dtype, l, me),
                k => exchange(s, dtype, &l, agreed, k == CollAlgo::Ll),
            }
        })
    }

    // -------------------------------------------------------- gather, scatter

    /// Every rank's `input` into `outputs[rank]` on `root` (elsewhere
    /// `outputs` may be empty).
    pub fn gather(&self, outputs: &[Tensor], input: Tensor, root: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.check_rank("gather root", root)?;
        self.checked("gather input", &input)?;
        let me = self.rank();
        let world = self.size();
        let n = input.count();
        let mut l = Lists::new(world);
        l.sends[root] = Some((n, input.ptr()));
        if me == root {
            if outputs.len() != world {
                return Err(Error::invalid(format!(
                    "gather: the root needs {world} output tensors, got {}",
                    outputs.len()
                )));
            }
            for (s, o) in outputs.iter().enumerate() {
                Self::same_dtype(&input, o)?;
                if o.count() != n {
                    return Err(Error::invalid(format!(
                        "gather: output {s} has {} elements, input {n}",
                        o.count()
                    )));
                }
                self.checked("gather output", o)?;
                l.recvs[s] = Some((n, o.ptr()));
            }
        }
        let (dtype, on_host) = (input.dtype(), self.on_host());
        self.submit(call, "gather", |s| {
            if on_host {
                return exchange(s, dtype, &l, n, takes_ll(s, dtype, &l, n));
            }
            match route_of(s, Coll::Gather, Some(n * dtype.size())) {
                Route::Custom => exchange(s, dtype, &l, n, takes_ll(s, dtype, &l, n)),
                Route::Vendor => vendor_exchange(s, dtype, l, me),
            }
        })
    }

    /// `inputs[rank]` of `root` into `output` on every rank (elsewhere
    /// `inputs` may be empty).
    pub fn scatter(&self, output: Tensor, inputs: &[Tensor], root: usize, call: &Call<'_, D>) -> Result<Work<D>> {
        self.check_rank("scatter root", root)?;
        self.checked("scatter output", &output)?;
        let me = self.rank();
        let world = self.size();
        let n = output.count();
        let mut l = Lists::new(world);
        l.recvs[root] = Some((n, output.ptr()));
        if me == root {
            if inputs.len() != world {
                return Err(Error::invalid(format!(
                    "scatter: the root needs {world} input tensors, got {}",
                    inputs.len()
                )));
            }
            for (q, i) in inputs.iter().enumerate() {
                Self::same_dtype(i, &output)?;
                if i.count() != n {
                    return Err(Error::invalid(format!(
                        "scatter: input {q} has {} elements, output {n}",
                        i.count()
                    )));
                }
                self.checked("scatter input", i)?;
                l.sends[q] = Some((n, i.ptr()));
            }
        }
        let (dtype, on_host) = (output.dtype(), self.on_host());
        self.submit(call, "scatter", |s| {
            if on_host {
                return exchange(s, dtype, &l, n, takes_ll(s, dtype, &l, n));
            }
            match route_of(s, Coll::Scatter, Some(n * dtype.size())) {
                Route::Custom => exchange(s, dtype, &l, n, takes_ll(s, dtype, &l, n)),
                Route::Vendor => vendor_exchange(s, dtype, l, me),
            }
        })
    }

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
        let on_host = self.on_host();
        let world = self.size();
        self.submit(call, "send/recv", |s| {
            for (a, b) in own_sends.iter().zip(&own_recvs) {
                copy_if_apart(s, b.ptr(), a.ptr(), a.count() * dtype.size())?;
            }
            for l in &rounds {
                if on_host {
                    let mut c = CollectiveCall::new(
                        KernelKind::SendRecv,
                        dtype,
                        ReduceOp::Sum,
                        0,
                        DevicePtr::NULL,
                        DevicePtr::NULL,
                    );
                    c.per_peer = l.table(u64::MAX);
                    enqueue(s, &c)?;
                } else {
                    run_vendor(
                        s,
                        dtype,
                        VendorOp::Exchange {
                            sends: &l.sends[..world],
                            recvs: &l.recvs[..world],
                        },
                    )?;
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
        if !self.inner.kernels {
            if let Some(levels) = &self.inner.levels {
                return levels.barrier(&self.inner.stream, call);
            }
        }
        self.submit(call, "barrier", |s| {
            if s.inner.world == 1 {
                return Ok(());
            }
            let ptr = s.res.scratch.ptr();
            if s.res.ws.is_none() {
                let op = VendorOp::AllReduce {
                    send: ptr,
                    recv: ptr,
                    count: 1,
                    red: ReduceOp::Sum.into(),
                };
                return run_vendor(s, DType::I32, op);
            }
            let c = CollectiveCall::new(KernelKind::OneShot, DType::I32, ReduceOp::Sum, 1, ptr, ptr);
            enqueue(s, &c)
        })
    }
}

fn op_tensor(o: &P2p) -> Tensor {
    match o {
        P2p::Send(t, _) | P2p::Recv(t, _) => *t,
    }
}

fn context(e: Error, what: &str) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{what}: {m}")),
        other => other,
    }
}

/// A device copy, skipped when source and destination are the same bytes.
fn copy_if_apart<D: Device>(s: &Submit<'_, D>, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
    if dst == src || bytes == 0 {
        return Ok(());
    }
    s.inner.device.copy_device(dst, src, bytes, s.stream)
}

/// Enqueue one of ferrocomm's kernels (quick-reduce's module loaded on first use).
fn enqueue<D: Device>(s: &mut Submit<'_, D>, c: &CollectiveCall) -> Result<()> {
    let inner = s.inner;
    if c.codec.is_some() && s.res.qr_module.is_none() {
        s.res.qr_module = Some(inner.device.load_module(&QUICK_REDUCE)?);
    }
    let module = match (&s.res.qr_module, c.codec) {
        (Some(m), Some(_)) => m,
        _ => &s.res.module,
    };
    let Some(ws) = &s.res.ws else {
        return Err(Error::Unsupported(format!(
            "communicator {} has no workspace for ferrocomm's kernels (it spans {}, or has more ranks than one \
             node's kernels serve) and no NCCL/RCCL underneath for this call",
            inner.name,
            inner.topology.describe()
        )));
    };
    c.enqueue(
        &inner.device,
        module,
        &inner.names,
        &inner.grids,
        ws,
        &inner.flags,
        inner.rank,
        s.timeout,
        s.stream,
    )
}

/// The route of a GPU call of `coll` (see [`route::decide`]; the host
/// backend always runs the protocols).
fn route_of<D: Device>(s: &Submit<'_, D>, coll: Coll, block_bytes: Option<usize>) -> Route {
    let inner = s.inner;
    if !inner.kernels {
        // No workspace (a communicator between nodes, or more ranks than
        // one node's kernels serve): only NCCL/RCCL can carry it.
        return Route::Vendor;
    }
    let mut chosen = route::decide(
        inner.opts.coll_route,
        coll,
        block_bytes,
        inner.world,
        s.res.vendor.available(),
        inner.opts.deterministic,
    );
    // Blocks the LL kinds carry beat NCCL's small-message path (2x H200:
    // all-gather 512 B a peer 3.52 us against 5.18, 256 KiB 5.79 against
    // 8.00; `ll_max_block_bytes`), so `auto` keeps them on the kernels.
    if chosen == Route::Vendor
        && inner.opts.coll_route == CollRoute::Auto
        && (2..=MAX_RANKS).contains(&inner.world)
        && block_bytes.is_some_and(|b| b > 0 && b <= ll_limit(s))
    {
        chosen = Route::Custom;
    }
    crate::fc_log!(
        tracing::Level::DEBUG,
        "route: {coll:?} block {block_bytes:?} bytes, world {}, asked {} -> {chosen:?}",
        inner.world,
        inner.opts.coll_route
    );
    chosen
}

/// [`route_of`] for a reduction: ops NCCL/RCCL lack (the bitwise ones;
/// premul_sum they create per call) take the kernels where there are
/// kernels, whatever the route asked for.
fn reduction_route<D: Device>(s: &Submit<'_, D>, coll: Coll, block_bytes: Option<usize>, op: ReduceOp) -> Route {
    if s.inner.kernels && op.is_bitwise() {
        return Route::Custom;
    }
    route_of(s, coll, block_bytes)
}

/// The exchange protocol (all-gather, gather, scatter, all-to-all):
/// `fc_exchange`. `agreed`: the block (elements) every rank moves to every
/// peer when the group agrees on one, else 0; it joins the fingerprint and
/// sizes the GPU grid (a grid must be the same on every rank). `ll`: on LL
/// lines (`fc_exchange_ll`), decided alike on every rank by the caller
/// ([`coll_kind`] or [`takes_ll`]); heap operands the direct kind takes go
/// direct either way.
fn exchange<D: Device>(s: &mut Submit<'_, D>, dtype: DType, l: &Lists, agreed: usize, ll: bool) -> Result<()> {
    let l = unalias(s, dtype, l, None)?;
    let direct = direct_exchange(s, dtype, &l, agreed);
    let kind = match direct {
        Some(_) => KernelKind::ExchangeDirect,
        None if ll => KernelKind::ExchangeLl,
        None => KernelKind::Exchange,
    };
    let mut c = CollectiveCall::new(kind, dtype, ReduceOp::Sum, agreed, DevicePtr::NULL, DevicePtr::NULL);
    c.per_peer = l.table(0);
    if let Some((table, in_place)) = direct {
        c.table = table;
        c.flags |= if in_place { PARAM_DIRECT_OK } else { 0 };
    }
    enqueue(s, &c)
}

/// The largest per-peer block (bytes) one source's LL lines carry: 8 data
/// bytes per 16-byte line, in a quarter of a slot over the world. What the
/// LL kinds can run at all, whatever a table or an option asks.
pub(crate) const fn ll_capacity(slot_bytes: usize, world: usize) -> usize {
    crate::algo::layout::ll_stride(slot_bytes, world) / 2
}

/// [`ll_capacity`] on this communicator; 0 without a workspace.
fn ll_room<D: Device>(s: &Submit<'_, D>) -> usize {
    s.res
        .ws
        .as_ref()
        .map_or(0, |ws| ll_capacity(ws.slot_bytes(), s.inner.world))
}

/// The largest per-peer block (bytes) gather, scatter, reduce and
/// all-to-all with splits take the LL kinds at on this communicator: the
/// option or the default ([`ll_max_block_bytes`]), within [`ll_room`].
fn ll_limit<D: Device>(s: &Submit<'_, D>) -> usize {
    let max = s
        .inner
        .opts
        .coll_ll_bytes
        .unwrap_or_else(|| ll_max_block_bytes(s.inner.world));
    max.min(ll_room(s))
}

/// Whether the LL kinds can carry a call: an agreed per-peer block
/// (`agreed` elements; the fingerprint checks it) within [`ll_room`], and
/// every non-empty block of this rank's lists being that block (so no
/// counts need agreeing in the kernel). Alike on every rank.
fn ll_fits<D: Device>(s: &Submit<'_, D>, dtype: DType, l: &Lists, agreed: usize) -> bool {
    agreed > 0
        && agreed.saturating_mul(dtype.size()) <= ll_room(s)
        && l.sends
            .iter()
            .chain(l.recvs.iter())
            .flatten()
            .all(|&(n, _)| n == 0 || n == agreed)
}

/// The kind a call of all-gather, reduce-scatter or all-to-all takes:
/// LL, inbox (or its direct twin, see [`exchange`]) or NCCL/RCCL. Decided
/// alike on every rank, from what all of them share: the call's choice
/// (every rank passes the same hints, as for `algo`), the options (every
/// rank sets them alike), the agreed per-peer block (`agreed` elements, 0
/// for an all-to-all given splits), whether the library loaded, and the
/// dispatch table (rank 0's autotune result, adopted by every rank).
///
/// Precedence, the first that applies:
/// 1. the call's [`Call::coll_algo`] or `coll_algo` hint, where that kind
///    can run the call (LL: the block fits the lines and the op is not
///    premul_sum; vendor: the library is there and the op is not bitwise);
///    it wins over the options, as the `algo` hint does over
///    `FERROCOMM_ALGO`, and over `deterministic`;
/// 2. `FERROCOMM_COLL_ROUTE=vendor`, where the library can run the call
///    (also over `deterministic`, as before the table); `custom` keeps the
///    library out of steps 3-4;
/// 3. `FERROCOMM_COLL_LL_BYTES`: LL up to it where the block fits; the
///    table never picks LL when it is set;
/// 4. the table's ladder for (collective, dtype class, world) by bytes per
///    peer, a step whose kind cannot run passing the call to the next:
///    NCCL/RCCL is never `auto`'s choice for a deterministic reduce-scatter
///    (its sums are not the reference's bits), nor without the library;
/// 5. the inbox kinds, which run everything (and all-to-alls with splits,
///    which have no size to look up).
///
/// GPU communicators without a workspace, or of one rank or more than the
/// kernels serve, keep NCCL/RCCL (as [`route::decide`]).
fn coll_kind<D: Device>(
    s: &Submit<'_, D>,
    coll: Collective,
    dtype: DType,
    op: ReduceOp,
    l: &Lists,
    agreed: usize,
    asked: Option<CollAlgo>,
) -> CollAlgo {
    let inner = s.inner;
    let world = inner.world;
    let host = inner.device.facts().backend == BackendKind::Host;
    if !host && (!inner.kernels || world <= 1 || world > MAX_RANKS) {
        return CollAlgo::Vendor;
    }
    let reduces = coll == Collective::ReduceScatter;
    let bytes = agreed.saturating_mul(dtype.size());
    let vendor = !host && s.res.vendor.available() && !(reduces && op.is_bitwise());
    let ll = !(reduces && op == ReduceOp::PreMulSum) && ll_fits(s, dtype, l, agreed);
    let (route, ll_bytes) = (inner.opts.coll_route, inner.opts.coll_ll_bytes);
    let chosen =
        match asked {
            Some(CollAlgo::Vendor) if vendor => CollAlgo::Vendor,
            Some(CollAlgo::Ll) if ll => CollAlgo::Ll,
            Some(CollAlgo::Inbox) => CollAlgo::Inbox,
            _ if route == CollRoute::Vendor && vendor => CollAlgo::Vendor,
            _ if ll && ll_bytes.is_some_and(|max| bytes <= max) => CollAlgo::Ll,
            _ if agreed == 0 => CollAlgo::Inbox,
            _ => {
                let auto_vendor = vendor && route == CollRoute::Auto && !(reduces && inner.opts.deterministic);
                super::communicator::read(&inner.table).choose_coll(coll, DtypeClass::of(dtype), bytes, world, |a| {
                    match a {
                        CollAlgo::Ll => ll && ll_bytes.is_none(),
                        CollAlgo::Vendor => auto_vendor,
                        CollAlgo::Inbox => true,
                    }
                })
            }
        };
    crate::fc_log!(
        tracing::Level::DEBUG,
        "dispatch: {coll} {agreed} x {dtype} a peer ({bytes} bytes, world {world}, asked {asked:?}, route {route}, \
         LL option {ll_bytes:?}) -> {chosen}"
    );
    chosen
}

/// Whether a gather, scatter or reduce (the collectives without a tuned
/// ladder) goes on LL lines, decided alike on every rank: [`ll_fits`] and
/// the block within [`ll_limit`].
fn takes_ll<D: Device>(s: &Submit<'_, D>, dtype: DType, l: &Lists, agreed: usize) -> bool {
    ll_fits(s, dtype, l, agreed) && agreed.saturating_mul(dtype.size()) <= ll_limit(s)
}

/// Smallest agreed per-peer block (bytes) a GPU exchange (all-gather,
/// gather, scatter, all-to-all without splits) takes the direct way at when
/// the communicator has a symmetric heap; [`DIRECT_MIN_REDUCE_TO_BYTES`] for
/// the reduce-to. The host backend takes both whenever there is a heap (so
/// CI runs them at every size); all-to-all-v with splits has no agreed
/// block, and on GPUs stays on the inbox exchange.
///
/// Measured on 2x H200, bf16, graph replay, `FERROCOMM_DIRECT_MIN_BYTES=0
/// ferrocomm-bench --coll all_gather,reduce_scatter,reduce --operands both`
/// (the bench and method of BENCHMARKS.md, "All-gather, reduce-scatter,
/// all-to-all"; the page does not carry this sweep), us, plain operands (inbox
/// kinds, LL below 256 KiB) / heap operands (direct), by per-peer block:
///
/// ```text
///                 512K         1M           2M           4M           8M           16M          32M          128M
/// all-gather      9.41/9.34    10.93/10.91  14.24/14.07  21.13/20.10  35.33/32.53  65.17/57.66  120.06/109.96 444.82/416.51
/// reduce-scatter  8.65/10.44   9.96/11.91   13.63/15.28  20.56/21.71  34.88/34.33  65.90/60.32  116.65/110.60 413.25/410.23
/// reduce          (block = size)            8.65/11.67 at 1M, 51.10/54.00 at 16M, 95.62/99.57 at 32M, 193.50/190.85 at 64M
/// ```
///
/// The direct exchange saves the receiver's copy out of its inbox and is
/// level from 512 KiB, ahead from 2 MiB (up to 13% at 16 MiB); it costs one
/// more flag round trip, so it loses where LL carries the block.
pub(crate) const DIRECT_MIN_BLOCK_BYTES: usize = 1 << 20;

/// The direct reduce-to's threshold (see [`DIRECT_MIN_BLOCK_BYTES`]): it
/// pays a second flag round trip and reads peers' memory instead of local
/// inboxes, and wins for reduce-scatter from 8 MiB a peer (1.6% there, 9%
/// at 16 MiB). Reduce (only the root reads) takes the same threshold and
/// loses 4-10% between 8 and 32 MiB, winning ~1.5% from 64 MiB.
pub(crate) const DIRECT_MIN_REDUCE_TO_BYTES: usize = 8 << 20;

/// Whether a call takes a direct kind (`fc_exchange_direct`,
/// `fc_reduce_to_direct_*`), decided alike on every rank: from the agreed
/// per-peer block (`agreed` elements), the threshold
/// (`CommOptions::direct_min_bytes`, which every rank sets alike, else the
/// backend's default) and the heap, which every rank reserves together.
/// Then: the heap, whose bases' table the kernel gets.
fn direct_heap<'a, D: Device>(
    s: &'a Submit<'_, D>,
    dtype: DType,
    agreed: usize,
    gpu_min: usize,
) -> Option<&'a Heap<D>> {
    let bytes = agreed.saturating_mul(dtype.size());
    let sized = match (s.inner.opts.direct_min_bytes, s.inner.device.facts().backend) {
        (Some(min), _) => bytes >= min,
        (None, BackendKind::Host) => true,
        (None, _) => bytes >= gpu_min,
    };
    if !sized {
        return None;
    }
    s.res.heap.as_ref()
}

/// Whether an exchange goes the direct way (`fc_exchange_direct`; see
/// [`direct_heap`]). Then: the heap bases' table, and whether every block
/// this rank receives from a peer can be written in place (in its heap and
/// clear of what it sends; the kernel falls back on every rank if one rank's
/// cannot).
fn direct_exchange<D: Device>(s: &Submit<'_, D>, dtype: DType, l: &Lists, agreed: usize) -> Option<(DevicePtr, bool)> {
    let heap = direct_heap(s, dtype, agreed, DIRECT_MIN_BLOCK_BYTES)?;
    let es = dtype.size() as u64;
    let span = |(n, p): (usize, DevicePtr)| (p.0, p.0 + n as u64 * es);
    let me = s.inner.rank;
    let in_place = l.recvs.iter().enumerate().all(|(r, recv)| match *recv {
        _ if r == me => true,
        None | Some((0, _)) => true,
        Some((n, p)) => {
            let (r0, r1) = span((n, p));
            heap.offset_of(p, n * dtype.size()).is_some()
                && !l.sends.iter().flatten().any(|&send| {
                    let (s0, s1) = span(send);
                    s0 < s1 && s0 < r1 && r0 < s1
                })
        }
    });
    Some((heap.peer_bases_table(), in_place))
}

/// Whether a reduce-to goes the direct way (`fc_reduce_to_direct_*`; see
/// [`direct_heap`]). Then: the heap bases' table, and whether every block
/// this rank sends a peer can be read in place by it: in its heap, clear of
/// this rank's output (which it writes while peers read), and aligned to
/// its element, as are its own block and its output (the direct kernel
/// reads and writes them where they are; the inbox way realigns them). Its
/// own block may be its output (in place: each element is read before the
/// same thread writes it) or clear of it. The kernel falls back on every
/// rank if one rank's cannot.
fn direct_reduce_to<D: Device>(
    s: &Submit<'_, D>,
    dtype: DType,
    l: &Lists,
    n: usize,
    output: Option<(usize, DevicePtr)>,
) -> Option<(DevicePtr, bool)> {
    let heap = direct_heap(s, dtype, n, DIRECT_MIN_REDUCE_TO_BYTES)?;
    let es = dtype.size() as u64;
    let span = |(n, p): (usize, DevicePtr)| (p.0, p.0 + n as u64 * es);
    let meet = |a: (usize, DevicePtr), b: (usize, DevicePtr)| {
        let ((a0, a1), (b0, b1)) = (span(a), span(b));
        a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
    };
    let aligned = |(n, p): (usize, DevicePtr)| n == 0 || p.0 % es == 0;
    let clear_of_output = |send: (usize, DevicePtr)| output.is_none_or(|out| !meet(send, out));
    let me = s.inner.rank;
    let in_place = output.is_none_or(aligned)
        && l.sends.iter().enumerate().all(|(q, send)| match *send {
            None | Some((0, _)) => true,
            Some(own) if q == me => aligned(own) && (output == Some(own) || clear_of_output(own)),
            Some((m, p)) => aligned((m, p)) && heap.offset_of(p, m * dtype.size()).is_some() && clear_of_output((m, p)),
        });
    Some((heap.peer_bases_table(), in_place))
}

/// Send blocks a receive block (or the reduce-to's output) overlaps, other
/// than in the protocol's safe way, go through the staging buffer first.
///
/// The kernels overwrite piece `b` of chunk `c` of a receive block (or of the
/// output) only after block `b` pushed the same piece of the same pair's send
/// block, so a receive block that *is* its own pair's send block (all-to-all
/// in place with equal splits; an all-gather whose input is its own part; a
/// reduce-to whose output is its own send block) is safe. Any other overlap
/// (lists whose tensors alias another peer's) could be overwritten before it
/// is pushed: those sends are copied to the staging buffer first. Our own
/// receive block, when it is our own send block, is never written (the
/// kernel skips that copy). GPUs only: the host reference keeps reading the
/// caller's memory as it always did.
fn unalias<D: Device>(
    s: &mut Submit<'_, D>,
    dtype: DType,
    l: &Lists,
    output: Option<(usize, DevicePtr)>,
) -> Result<Lists> {
    if s.inner.device.facts().backend == BackendKind::Host {
        return Ok(l.clone());
    }
    let es = dtype.size() as u64;
    let span = |(n, p): (usize, DevicePtr)| (p.0, p.0 + n as u64 * es);
    let meet = |a: (usize, DevicePtr), b: (usize, DevicePtr)| {
        let ((a0, a1), (b0, b1)) = (span(a), span(b));
        a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
    };
    let me = s.inner.rank;
    let aliased = l.sends.iter().enumerate().any(|(q, send)| {
        let Some(send) = *send else { return false };
        match output {
            // Reduce-to: the output is written, once, with every source's piece.
            Some(out) => meet(send, out) && !(q == me && send == out),
            None => l
                .recvs
                .iter()
                .enumerate()
                .filter(|&(r, _)| !(r == me && l.sends[me] == l.recvs[me]))
                .any(|(r, recv)| recv.is_some_and(|recv| meet(send, recv) && !(q == r && send == recv))),
        }
    });
    if !aliased {
        return Ok(l.clone());
    }
    let blocks: Vec<usize> = l.sends.iter().map(|e| e.map_or(0, |(n, _)| n * dtype.size())).collect();
    let mut at = Vec::with_capacity(blocks.len());
    let mut end = 0usize;
    for &b in &blocks {
        at.push(end);
        end = (end + b).next_multiple_of(256);
    }
    let base = staging_at(s, end.max(1))?;
    let mut staged = l.clone();
    for (q, e) in l.sends.iter().enumerate() {
        if let Some((n, from)) = *e {
            let to = base.offset(at[q]);
            s.inner.device.copy_device(to, from, n * dtype.size(), s.stream)?;
            staged.sends[q] = Some((n, to));
        }
    }
    Ok(staged)
}

/// The reduce-to protocol (reduce-scatter, reduce): `fc_reduce_to_<dtype>_<op>`,
/// or its direct twin on heap blocks, or (`ll`, decided alike on every rank
/// by the caller, never for premul_sum) its LL twin.
#[allow(clippy::too_many_arguments)]
fn reduce_to<D: Device>(
    s: &mut Submit<'_, D>,
    dtype: DType,
    op: ReduceOp,
    scalar: u64,
    flags: u32,
    n: usize,
    output: DevicePtr,
    l: &Lists,
    ll: bool,
) -> Result<()> {
    let receives = l.recvs.iter().any(|r| r.is_some_and(|(m, _)| m > 0));
    let out = receives.then_some((n, output));
    let l = unalias(s, dtype, l, out)?;
    // After `unalias`: staged sends lie outside the heap, so a call that
    // needed staging takes the inbox way on every rank.
    let direct = direct_reduce_to(s, dtype, &l, n, out);
    let kind = match direct {
        Some(_) => KernelKind::ReduceToDirect,
        None if ll => KernelKind::ReduceToLl,
        None => KernelKind::ReduceTo,
    };
    let mut c = CollectiveCall::new(kind, dtype, op, n, DevicePtr::NULL, output);
    c.per_peer = l.table(0);
    c.scalar = scalar;
    c.flags = flags;
    if let Some((table, in_place)) = direct {
        c.table = table;
        c.flags |= if in_place { PARAM_DIRECT_OK } else { 0 };
    }
    enqueue(s, &c)
}

/// An exchange through NCCL/RCCL: every block, our own among them, as one
/// group of sends and receives.
fn vendor_exchange<D: Device>(s: &mut Submit<'_, D>, dtype: DType, mut l: Lists, me: usize) -> Result<()> {
    // This rank's own block stays in the library's group, which copies it
    // beside the peers' blocks: a copy of its own ahead of the group
    // serialised with it (2x H200, all-to-all of 16 MiB a peer: 72 us
    // against 64 us in the group). In place there is nothing to move.
    match (l.sends[me], l.recvs[me]) {
        (Some((_, from)), Some((_, to))) if from != to => {}
        _ => {
            l.sends[me] = None;
            l.recvs[me] = None;
        }
    }
    let world = s.inner.world;
    if (0..world).all(|q| l.sends[q].is_none() && l.recvs[q].is_none()) {
        return Ok(());
    }
    let (sends, recvs) = (&l.sends[..world], &l.recvs[..world]);
    // A receive that lands where a send still reads (all-to-all in place)
    // races inside the library's group: stage the sends first.
    let es = dtype.size() as u64;
    let span = |(n, p): (usize, DevicePtr)| (p.0, p.0 + n as u64 * es);
    let overlap = sends.iter().flatten().any(|&a| {
        let (a0, a1) = span(a);
        recvs.iter().flatten().any(|&b| {
            let (b0, b1) = span(b);
            a0 < b1 && b0 < a1
        })
    });
    run_vendor_staged(s, dtype, VendorOp::Exchange { sends, recvs }, overlap)
}

/// NCCL/RCCL for `op`, through the staging buffer when one of its GPU
/// addresses is not aligned to its element: NCCL's kernels load whole
/// elements and fault on such addresses (CUDA_ERROR_MISALIGNED_ADDRESS), so
/// the inputs are copied to aligned places, the library runs there, and the
/// outputs are copied back, all on the call's stream.
fn run_vendor<D: Device>(s: &mut Submit<'_, D>, dtype: DType, op: VendorOp<'_>) -> Result<()> {
    run_vendor_staged(s, dtype, op, false)
}

/// [`run_vendor`], through the staging buffer also when `force` is set.
fn run_vendor_staged<D: Device>(s: &mut Submit<'_, D>, dtype: DType, mut op: VendorOp<'_>, force: bool) -> Result<()> {
    if s.capturing {
        s.res.vendor.note_capture();
    }
    let es = dtype.size();
    let odd = |p: DevicePtr| p.0 % es as u64 != 0;
    let (world, rank) = (s.inner.world, s.inner.rank);
    let host = s.inner.device.facts().backend == BackendKind::Host;
    let aligned = match &mut op {
        VendorOp::Exchange { sends, recvs } => sends.iter().chain(recvs.iter()).flatten().all(|(_, p)| !odd(*p)),
        single => single
            .buffers_mut()
            .is_some_and(|(send, recv)| !odd(*send) && !odd(*recv)),
    };
    if host || (aligned && !force) {
        return s.res.vendor.run(&s.inner.device, s.stream, dtype, op);
    }
    // Each block at its own 256-byte aligned place in the staging buffer.
    let place = |sizes: &[usize]| -> (Vec<usize>, usize) {
        let mut at = Vec::with_capacity(sizes.len());
        let mut end = 0usize;
        for &b in sizes {
            at.push(end);
            end = (end + b).next_multiple_of(256);
        }
        (at, end)
    };
    if let VendorOp::Exchange { sends, recvs } = op {
        let blocks: Vec<usize> = sends
            .iter()
            .chain(recvs.iter())
            .map(|e| e.map_or(0, |(n, _)| n * es))
            .collect();
        let (at, need) = place(&blocks);
        let base = staging_at(s, need)?;
        let moved = |list: &[Option<(usize, DevicePtr)>], first: usize| -> Vec<Option<(usize, DevicePtr)>> {
            list.iter()
                .enumerate()
                .map(|(q, e)| e.map(|(n, _)| (n, base.offset(at[first + q]))))
                .collect()
        };
        let (staged_sends, staged_recvs) = (moved(sends, 0), moved(recvs, sends.len()));
        for (e, st) in sends.iter().zip(&staged_sends) {
            if let (Some((n, from)), Some((_, to))) = (e, st) {
                s.inner.device.copy_device(*to, *from, n * es, s.stream)?;
            }
        }
        s.res.vendor.run(
            &s.inner.device,
            s.stream,
            dtype,
            VendorOp::Exchange {
                sends: &staged_sends,
                recvs: &staged_recvs,
            },
        )?;
        for (e, st) in recvs.iter().zip(&staged_recvs) {
            if let (Some((n, to)), Some((_, from))) = (e, st) {
                s.inner.device.copy_device(*to, *from, n * es, s.stream)?;
            }
        }
        return Ok(());
    }
    let (read, written) = op.extents(es, rank, world);
    let name = op.name();
    let Some((send, recv)) = op.buffers_mut() else {
        return Err(Error::Unsupported(format!(
            "{name}: no single input and output to stage"
        )));
    };
    let (orig_send, orig_recv) = (*send, *recv);
    // An input the caller already staged (a list reduce-scatter) stays where
    // it is; the output goes after it.
    let current = s.res.staging.as_ref().map(|b| (b.ptr(), b.len()));
    let in_staging = current
        .filter(|&(b, len)| orig_send.0 >= b.0 && orig_send.0 + read as u64 <= b.0 + len as u64)
        .map(|(b, _)| (orig_send.0 - b.0) as usize);
    let (at, need) = place(&[in_staging.map_or(read, |o| o + read), written]);
    if in_staging.is_some() && current.is_some_and(|(_, len)| len < need) {
        // Growing would drop the staged input: its stager reserves room.
        return Err(Error::Unsupported(format!(
            "{name}: the staging buffer holds the input and has no room for the output"
        )));
    }
    let base = staging_at(s, need)?;
    *send = base.offset(in_staging.unwrap_or(at[0]));
    *recv = base.offset(at[1]);
    if read > 0 && in_staging.is_none() {
        s.inner.device.copy_device(*send, orig_send, read, s.stream)?;
    }
    let staged_recv = *recv;
    s.res.vendor.run(&s.inner.device, s.stream, dtype, op)?;
    if written > 0 {
        s.inner.device.copy_device(orig_recv, staged_recv, written, s.stream)?;
    }
    Ok(())
}

/// Whether a GPU kernel would see one of `tensors` misaligned for its
/// element (the host kernels copy bytes and take any alignment).
fn gpu_misaligned<D: Device>(s: &Submit<'_, D>, tensors: &[Tensor]) -> bool {
    s.inner.device.facts().backend != BackendKind::Host
        && tensors.iter().any(|t| t.ptr().0 % t.dtype().size() as u64 != 0)
}

/// Copy the blocks `srcs` (each `bytes`) back to back into the
/// communicator's staging buffer (grown on demand; not while capturing).
fn stage<D: Device>(s: &mut Submit<'_, D>, srcs: &[DevicePtr], bytes: usize) -> Result<DevicePtr> {
    stage_padded(s, srcs, bytes, bytes * srcs.len())
}

/// [`stage`], with a staging buffer of at least `capacity` bytes.
fn stage_padded<D: Device>(
    s: &mut Submit<'_, D>,
    srcs: &[DevicePtr],
    bytes: usize,
    capacity: usize,
) -> Result<DevicePtr> {
    let base = staging_at(s, capacity.max(bytes * srcs.len()))?;
    for (k, src) in srcs.iter().enumerate() {
        s.inner
            .device
            .copy_device(base.offset(k * bytes), *src, bytes, s.stream)?;
    }
    Ok(base)
}

/// The communicator's staging buffer, at least `need` bytes (grown on
/// demand; not while capturing).
fn staging_at<D: Device>(s: &mut Submit<'_, D>, need: usize) -> Result<DevicePtr> {
    let fits = s.res.staging.as_ref().is_some_and(|b| b.len() >= need);
    if !fits {
        if s.capturing {
            return Err(Error::Unsupported(
                "this call goes through the staging buffer on a GPU (a list reduce-scatter, or memory not \
                 aligned to its element), and the staging buffer cannot grow inside a graph capture: make one \
                 eager call of this size first, or pass aligned, contiguous tensors"
                    .into(),
            ));
        }
        // Powers of two, so that what is retired stays below what is in use.
        let grown = s
            .inner
            .device
            .alloc(need.next_power_of_two(), crate::device::MemKind::Plain)?;
        // Calls queued earlier, on this stream or another, may still read or
        // write the old one: it is freed with the communicator.
        if let Some(old) = s.res.staging.replace(grown) {
            s.res.retired.push(old);
        }
    }
    Ok(s.res.staging.as_ref().map_or(DevicePtr::NULL, |b| b.ptr()))
}
