//! The communicator: one per group of ranks, generic over the device backend.

use std::sync::{Arc, Mutex, MutexGuard};

use super::options::CommOptions;
use super::vendor::Vendor;
use super::work::Work;
use crate::algo::kernels::{KernelKind, COLLECTIVES, QR_DTYPES, QUICK_REDUCE};
use crate::algo::{AlgoChoice, Algorithm, CollectiveCall, DispatchTable, GridTable, KernelNames, Workspace};
use crate::bootstrap::{store_barrier, Store};
use crate::codec::Codec;
use crate::device::{
    Device, DeviceBuffer, HostFlags, MemKind, ERR_CODE_ABORTED, ERR_CODE_MISMATCH, ERR_CODE_NONE, ERR_CODE_TIMEOUT,
    ERR_WORDS, MAX_RANKS,
};
use crate::dtype::{check_supported, DType, ReduceOp};
use crate::error::{Error, Result};

enum Phase {
    Active,
    Aborted(String),
    Finalized,
}

/// What finalize releases.
struct Resources<D: Device> {
    ws: Workspace<D>,
    module: D::Module,
    /// Loaded at creation when the caller opted in to quick-reduce, else on
    /// the first quick-reduce call.
    qr_module: Option<D::Module>,
    scratch: D::Buffer,
    vendor: Vendor,
}

struct State<D: Device> {
    phase: Phase,
    res: Option<Resources<D>>,
}

pub(crate) struct Inner<D: Device> {
    // Declared first so it drops first: queued work is drained in Drop below.
    state: Mutex<State<D>>,
    pub(crate) device: D,
    pub(crate) stream: D::Stream,
    pub(crate) flags: D::Flags,
    rank: usize,
    world: usize,
    pub(crate) opts: CommOptions,
    table: DispatchTable,
    grids: GridTable,
    names: KernelNames,
    /// Whether the vendor library is loaded (fixed at creation).
    has_vendor: bool,
}

impl<D: Device> Drop for Inner<D> {
    fn drop(&mut self) {
        // Kernels may still reference the workspace; every wait in them has a
        // deadline, so this returns.
        let _ = self.device.synchronize(&self.stream);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<D: Device> Inner<D> {
    /// The error kernels reported, if any.
    pub(crate) fn device_error(&self) -> Option<Error> {
        let code = self.flags.load(0);
        let epoch = self.flags.load(3);
        match code {
            ERR_CODE_NONE => None,
            ERR_CODE_TIMEOUT => {
                let mask = self.flags.load(1);
                Some(Error::Timeout {
                    what: format!("peers in collective launch #{epoch} on rank {}", self.rank),
                    after: self.opts.timeout,
                    missing: (0..MAX_RANKS).filter(|r| mask & (1 << r) != 0).collect(),
                })
            }
            ERR_CODE_MISMATCH => Some(Error::Mismatch {
                rank: self.rank,
                peer: self.flags.load(2).saturating_sub(1) as usize,
                detail: format!("count, dtype, op, root or algorithm differ at launch #{epoch}"),
            }),
            ERR_CODE_ABORTED => Some(Error::Aborted("the communicator was aborted".into())),
            other => Some(Error::Aborted(format!("kernel reported unknown error code {other}"))),
        }
    }

    /// Mark the communicator unusable and make queued kernels exit at once.
    pub(crate) fn abort(&self, reason: &str) {
        if self.flags.load(0) == ERR_CODE_NONE {
            self.flags.store(0, ERR_CODE_ABORTED);
        }
        let mut st = lock(&self.state);
        if matches!(st.phase, Phase::Active) {
            st.phase = Phase::Aborted(reason.to_string());
        }
    }
}

/// A group of ranks that run collectives together.
///
/// Every rank must issue the same collectives in the same order. All methods
/// take `&self`; calls from several threads are serialised in call order.
pub struct Communicator<D: Device> {
    inner: Arc<Inner<D>>,
}

impl<D: Device> Communicator<D> {
    /// Create a communicator. Collective: every rank of the group calls it with
    /// the same `world` and a shared `store`.
    pub fn new(device: D, store: Arc<dyn Store>, rank: usize, world: usize, opts: CommOptions) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!("rank {rank} is not in a world of {world}")));
        }
        if world > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "world {world}: ferrocomm's kernels serve up to {MAX_RANKS} ranks on one node"
            )));
        }
        // Each rank numbers its communicators; creating them in the same order
        // on every rank gives the group a shared key prefix.
        let serial = store.add(&format!("fc/ncomm/{rank}"), 1)?;
        let prefix = format!("fc/comm{serial}");
        let stream = device.create_stream()?;
        let flags = device.alloc_host_flags(ERR_WORDS)?;
        let module = device.load_module(&COLLECTIVES)?;
        // Opted-in communicators compile quick-reduce now, not on the first
        // large call (which may be inside a graph capture).
        let qr_module = match opts.quantization.codec(device.facts().backend) {
            Some(_) => Some(device.load_module(&QUICK_REDUCE)?),
            None => None,
        };
        let ws = Workspace::create(
            &device,
            store.as_ref(),
            &prefix,
            rank,
            world,
            opts.slot_bytes_for(device.facts().backend),
            opts.timeout,
        )?;
        let scratch = device.alloc(64, MemKind::Plain)?;
        let vendor = Vendor::init(&device, store.as_ref(), &prefix, rank, world, opts.timeout)?;
        store_barrier(store.as_ref(), &format!("{prefix}/ready"), rank, world, opts.timeout)?;
        let table = DispatchTable::default_for(device.facts().backend);
        let grids = GridTable::new(device.facts())?;
        let has_vendor = vendor.available();
        if crate::log::enabled(tracing::Level::INFO) {
            let f = device.facts();
            crate::fc_log!(
                tracing::Level::INFO,
                "communicator {prefix} ready: rank {rank} of {world}, backend {} device {} ({}, {}, {} SMs/CUs), \
                 workspace {} MiB ({} MiB slots), library underneath {}, runtime: {}",
                f.backend.name(),
                f.ordinal,
                f.name,
                f.arch,
                f.multiprocessors,
                ws.own().len() >> 20,
                ws.slot_bytes() >> 20,
                vendor.describe(),
                device.runtime_info()
            );
        }
        Ok(Communicator {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    phase: Phase::Active,
                    res: Some(Resources {
                        ws,
                        module,
                        qr_module,
                        scratch,
                        vendor,
                    }),
                }),
                device,
                stream,
                flags,
                rank,
                world,
                opts,
                table,
                grids,
                names: KernelNames::new(),
                has_vendor,
            }),
        })
    }

    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    pub fn size(&self) -> usize {
        self.inner.world
    }

    pub fn device(&self) -> &D {
        &self.inner.device
    }

    /// The communicator's own stream, where `all_reduce` and friends run.
    pub fn stream(&self) -> &D::Stream {
        &self.inner.stream
    }

    pub fn options(&self) -> &CommOptions {
        &self.inner.opts
    }

    /// Allocate a device buffer for use with this communicator.
    pub fn alloc(&self, bytes: usize) -> Result<D::Buffer> {
        self.inner.device.alloc(bytes, MemKind::Plain)
    }

    /// Copy host bytes into `buf` at `offset`, ordered on the communicator's stream.
    pub fn write(&self, buf: &D::Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.inner.device.copy_from_host(buf, offset, data, &self.inner.stream)
    }

    /// Wait for the communicator's stream, then copy `buf[offset..]` into `out`.
    pub fn read(&self, buf: &D::Buffer, offset: usize, out: &mut [u8]) -> Result<()> {
        self.inner.device.copy_to_host(buf, offset, out, &self.inner.stream)
    }

    /// The algorithm dispatch would pick for an all-reduce of `count` x `dtype`.
    pub fn choose(&self, algo: AlgoChoice, count: usize, dtype: DType, op: ReduceOp) -> Algorithm {
        let ccl_allowed = self.inner.has_vendor && !self.inner.opts.deterministic;
        let quantize = self
            .inner
            .opts
            .quantization
            .codec(self.inner.device.facts().backend)
            .filter(|_| quick_reduce_supports(dtype, op));
        let bytes = count.saturating_mul(dtype.size());
        let chosen = self
            .inner
            .table
            .choose(algo, bytes, self.inner.world, ccl_allowed, quantize);
        crate::fc_log!(
            tracing::Level::DEBUG,
            "dispatch: all_reduce {count} x {dtype} {op} ({bytes} bytes, world {}, asked {algo:?}) -> {chosen}",
            self.inner.world
        );
        chosen
    }

    /// Whether NCCL/RCCL is loaded underneath this communicator.
    pub fn has_vendor_library(&self) -> bool {
        self.inner.has_vendor
    }

    /// Out-of-place all-reduce of `count` elements on the communicator's stream.
    pub fn all_reduce(
        &self,
        input: &D::Buffer,
        output: &D::Buffer,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work<D>> {
        self.all_reduce_with(self.inner.opts.algo, input, output, count, dtype, op)
    }

    /// In-place all-reduce.
    pub fn all_reduce_in_place(&self, buf: &D::Buffer, count: usize, dtype: DType, op: ReduceOp) -> Result<Work<D>> {
        self.all_reduce(buf, buf, count, dtype, op)
    }

    /// All-reduce with an explicit algorithm choice.
    pub fn all_reduce_with(
        &self,
        algo: AlgoChoice,
        input: &D::Buffer,
        output: &D::Buffer,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work<D>> {
        self.all_reduce_on(&self.inner.stream, algo, input, output, count, dtype, op)?;
        Work::record(self.inner.clone(), "all_reduce")
    }

    /// Stream-ordered all-reduce on a caller's stream; may be captured into a
    /// graph. Completion is the caller's stream reaching this point.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_on(
        &self,
        stream: &D::Stream,
        algo: AlgoChoice,
        input: &D::Buffer,
        output: &D::Buffer,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        check_supported(dtype, op)?;
        // Saturating: an overflowing count is rejected by `submit`'s size check.
        let algorithm = self.choose(algo, count, dtype, op);
        let Some(kind) = algorithm.kernel_kind() else {
            return self.submit_vendor(stream, input, output, count, dtype, op);
        };
        let codec = algorithm.codec();
        if codec.is_some() && !quick_reduce_supports(dtype, op) {
            return Err(Error::Unsupported(format!(
                "{algorithm} reduces f16 or bf16 sums only, not {dtype} {op}"
            )));
        }
        self.submit(stream, kind, codec, input, output, count, dtype, op, 0)
    }

    /// Copy `count` elements of `input` on `root` into `output` on every rank.
    pub fn broadcast(
        &self,
        input: &D::Buffer,
        output: &D::Buffer,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<Work<D>> {
        if root >= self.inner.world {
            return Err(Error::invalid(format!(
                "broadcast root {root} is not in a world of {}",
                self.inner.world
            )));
        }
        self.submit(
            &self.inner.stream,
            KernelKind::Broadcast,
            None,
            input,
            output,
            count,
            dtype,
            ReduceOp::Sum,
            root,
        )?;
        Work::record(self.inner.clone(), "broadcast")
    }

    /// Wait until every rank reaches the barrier (a one-element all-reduce).
    pub fn barrier(&self) -> Result<Work<D>> {
        let st = self.lock_active()?;
        let scratch = &st.res.as_ref().ok_or(Error::Finalized)?.scratch;
        let ptr = scratch.ptr();
        drop(st);
        self.submit_ptrs(
            &self.inner.stream,
            KernelKind::OneShot,
            None,
            ptr,
            ptr,
            1,
            DType::I32,
            ReduceOp::Sum,
            0,
        )?;
        Work::record(self.inner.clone(), "barrier")
    }

    /// Drain queued work and release the workspace. Later calls return
    /// [`Error::Finalized`]; so does a second `finalize`.
    pub fn finalize(&self) -> Result<()> {
        let mut st = lock(&self.inner.state);
        if matches!(st.phase, Phase::Finalized) {
            return Err(Error::Finalized);
        }
        let drained = self.inner.device.synchronize(&self.inner.stream);
        st.res = None;
        st.phase = Phase::Finalized;
        drained
    }

    /// Make the communicator unusable now; queued kernels exit without waiting.
    pub fn abort(&self) -> Result<()> {
        if matches!(lock(&self.inner.state).phase, Phase::Finalized) {
            return Err(Error::Finalized);
        }
        self.inner.abort("aborted by the caller");
        Ok(())
    }

    fn lock_active(&self) -> Result<MutexGuard<'_, State<D>>> {
        let st = lock(&self.inner.state);
        match &st.phase {
            Phase::Active => Ok(st),
            Phase::Aborted(why) => Err(Error::Aborted(why.clone())),
            Phase::Finalized => Err(Error::Finalized),
        }
    }

    /// Hand an all-reduce to NCCL/RCCL, after the same argument checks.
    fn submit_vendor(
        &self,
        stream: &D::Stream,
        input: &D::Buffer,
        output: &D::Buffer,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let bytes = check_buffers(input, output, count, dtype)?;
        let st = self.lock_active()?;
        let res = st.res.as_ref().ok_or(Error::Finalized)?;
        if bytes == 0 {
            return Ok(());
        }
        res.vendor
            .all_reduce(&self.inner.device, stream, input.ptr(), output.ptr(), count, dtype, op)
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        stream: &D::Stream,
        kind: KernelKind,
        codec: Option<Codec>,
        input: &D::Buffer,
        output: &D::Buffer,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        check_buffers(input, output, count, dtype)?;
        self.submit_ptrs(stream, kind, codec, input.ptr(), output.ptr(), count, dtype, op, root)
    }

    #[allow(clippy::too_many_arguments)]
    fn submit_ptrs(
        &self,
        stream: &D::Stream,
        kind: KernelKind,
        codec: Option<Codec>,
        input: crate::device::DevicePtr,
        output: crate::device::DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        // Holding the lock while enqueuing keeps launch order equal to call order.
        let mut st = self.lock_active()?;
        let inner = &*self.inner;
        if codec.is_some() {
            let res = st.res.as_mut().ok_or(Error::Finalized)?;
            if res.qr_module.is_none() {
                res.qr_module = Some(inner.device.load_module(&QUICK_REDUCE)?);
            }
        }
        let res = st.res.as_ref().ok_or(Error::Finalized)?;
        let module = match (&res.qr_module, codec) {
            (Some(m), Some(_)) => m,
            _ => &res.module,
        };
        if count == 0 {
            return Ok(());
        }
        if inner.world == 1 {
            if input != output {
                inner.device.copy_device(output, input, count * dtype.size(), stream)?;
            }
            return Ok(());
        }
        let call = CollectiveCall {
            kind,
            dtype,
            op,
            count,
            root,
            input,
            output,
            codec,
        };
        call.enqueue(
            &inner.device,
            module,
            &inner.names,
            &inner.grids,
            &res.ws,
            &inner.flags,
            inner.rank,
            inner.opts.timeout,
            stream,
        )
    }
}

/// Whether quick-reduce can run an all-reduce of this dtype and op.
fn quick_reduce_supports(dtype: DType, op: ReduceOp) -> bool {
    QR_DTYPES.contains(&dtype) && op == ReduceOp::Sum
}

/// Bytes of `count` x `dtype`, if both buffers hold that many.
fn check_buffers<B: DeviceBuffer>(input: &B, output: &B, count: usize, dtype: DType) -> Result<usize> {
    let bytes = count
        .checked_mul(dtype.size())
        .ok_or_else(|| Error::invalid(format!("count {count} overflows")))?;
    for (what, len) in [("input", input.len()), ("output", output.len())] {
        if bytes > len {
            return Err(Error::invalid(format!(
                "{what} buffer holds {len} bytes, but {count} x {dtype} needs {bytes}"
            )));
        }
    }
    Ok(bytes)
}
