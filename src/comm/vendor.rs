//! NCCL/RCCL underneath the communicator, when built (`nccl`/`rccl`
//! features), wanted (`FERROCOMM_CCL` is not `0`) and present on every rank.
//! On GPUs it runs every collective ferrocomm has no kernel for.

use std::time::Duration;

use super::call::{Factor, Reduction};
use crate::bootstrap::Store;
use crate::device::{Device, DevicePtr};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// One collective, as the vendor library takes it.
#[cfg_attr(not(any(feature = "nccl", feature = "rccl")), allow(dead_code))]
pub(crate) enum VendorOp<'a> {
    AllReduce {
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        red: Reduction,
    },
    Broadcast {
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        root: usize,
    },
    Reduce {
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        red: Reduction,
        root: usize,
    },
    AllGather {
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
    },
    ReduceScatter {
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        red: Reduction,
    },
    /// Sends and receives per peer, as one group (`None`: nothing with that
    /// peer): all-to-all(-v), gather, scatter, list all-gathers, and batches
    /// of sends and receives.
    Exchange {
        sends: &'a [Option<(usize, DevicePtr)>],
        recvs: &'a [Option<(usize, DevicePtr)>],
    },
}

impl VendorOp<'_> {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            VendorOp::AllReduce { .. } => "all_reduce",
            VendorOp::Broadcast { .. } => "broadcast",
            VendorOp::Reduce { .. } => "reduce",
            VendorOp::AllGather { .. } => "all_gather",
            VendorOp::ReduceScatter { .. } => "reduce_scatter",
            VendorOp::Exchange { .. } => "send/recv group",
        }
    }

    /// The input and output address of a one-buffer op (not an exchange),
    /// to read or to move them (staging).
    pub(crate) fn buffers_mut(&mut self) -> Option<(&mut DevicePtr, &mut DevicePtr)> {
        match self {
            VendorOp::AllReduce { send, recv, .. }
            | VendorOp::Broadcast { send, recv, .. }
            | VendorOp::Reduce { send, recv, .. }
            | VendorOp::AllGather { send, recv, .. }
            | VendorOp::ReduceScatter { send, recv, .. } => Some((send, recv)),
            VendorOp::Exchange { .. } => None,
        }
    }

    /// Bytes a one-buffer op reads from its input and writes to its output
    /// on `rank` of `world`, for elements of `es` bytes (an exchange: 0, 0).
    pub(crate) fn extents(&self, es: usize, rank: usize, world: usize) -> (usize, usize) {
        match *self {
            VendorOp::AllReduce { count, .. } => (count * es, count * es),
            VendorOp::Broadcast { count, root, .. } => (if root == rank { count * es } else { 0 }, count * es),
            VendorOp::Reduce { count, root, .. } => (count * es, if root == rank { count * es } else { 0 }),
            VendorOp::AllGather { count, .. } => (count * es, count * world * es),
            VendorOp::ReduceScatter { count, .. } => (count * world * es, count * es),
            VendorOp::Exchange { .. } => (0, 0),
        }
    }
}

/// The vendor communicator, if this communicator has one.
pub(crate) struct Vendor {
    #[cfg(any(feature = "nccl", feature = "rccl"))]
    comm: Option<crate::backends::ccl::CclComm>,
}

impl Vendor {
    /// Collective: every rank calls it. The ranks first agree that all of them
    /// loaded the library, so none waits in an init the others skip.
    #[allow(unused_variables)]
    pub(crate) fn init<D: Device>(
        dev: &D,
        store: &dyn Store,
        key_prefix: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        #[cfg(any(feature = "nccl", feature = "rccl"))]
        {
            use crate::backends::ccl::{CclComm, CclFlavor, CclLibrary};
            use crate::bootstrap::store_all_gather;
            use crate::device::BackendKind;

            let flavor = match dev.facts().backend {
                BackendKind::Cuda if cfg!(feature = "nccl") => Some(CclFlavor::Nccl),
                BackendKind::Hip if cfg!(feature = "rccl") => Some(CclFlavor::Rccl),
                _ => None,
            };
            let wanted = std::env::var("FERROCOMM_CCL").map_or(true, |v| v.trim() != "0");
            let lib = match flavor.filter(|_| wanted && world > 1) {
                Some(f) => CclLibrary::load(f).ok(),
                None => None,
            };
            let votes = store_all_gather(
                store,
                &format!("{key_prefix}/ccl-ok"),
                rank,
                world,
                &[lib.is_some() as u8],
                timeout,
            )?;
            let comm = match lib {
                Some(lib) if votes.iter().all(|v| v.first() == Some(&1)) => {
                    dev.bind_thread()?;
                    Some(CclComm::init(
                        lib,
                        store,
                        &format!("{key_prefix}/ccl"),
                        rank,
                        world,
                        timeout,
                    )?)
                }
                _ => None,
            };
            Ok(Vendor { comm })
        }
        #[cfg(not(any(feature = "nccl", feature = "rccl")))]
        Ok(Vendor {})
    }

    /// The library underneath, for the init log line.
    pub(crate) fn describe(&self) -> String {
        #[cfg(any(feature = "nccl", feature = "rccl"))]
        if let Some(comm) = &self.comm {
            let lib = comm.library();
            let v = lib.version();
            return format!(
                "{} {}.{}.{} ({})",
                lib.flavor().name(),
                v / 10000,
                (v / 100) % 100,
                v % 100,
                lib.path().display()
            );
        }
        "none".into()
    }

    /// Note that the library's work went into a graph capture (see
    /// `CclComm::note_capture`: such a communicator is aborted, not destroyed).
    pub(crate) fn note_capture(&self) {
        #[cfg(any(feature = "nccl", feature = "rccl"))]
        if let Some(comm) = &self.comm {
            comm.note_capture();
        }
    }

    pub(crate) fn available(&self) -> bool {
        #[cfg(any(feature = "nccl", feature = "rccl"))]
        return self.comm.is_some();
        #[cfg(not(any(feature = "nccl", feature = "rccl")))]
        false
    }

    /// The vendor communicator itself, for side-by-side measurements.
    #[cfg(all(any(feature = "nccl", feature = "rccl"), feature = "testing"))]
    pub(crate) fn ccl(&self) -> Option<&crate::backends::ccl::CclComm> {
        self.comm.as_ref()
    }

    /// Abort the vendor communicator, if any (its kernels may wait on a dead
    /// peer; nothing else stops them).
    pub(crate) fn abort(&self) {
        #[cfg(any(feature = "nccl", feature = "rccl"))]
        if let Some(comm) = &self.comm {
            let _ = comm.abort();
        }
    }

    /// Queue `op` on `stream` through the vendor library.
    ///
    /// The communicator checked every address and count against the call's
    /// tensors before this, and keeps them alive as its callers promise.
    #[allow(unused_variables)]
    pub(crate) fn run<D: Device>(&self, dev: &D, stream: &D::Stream, dtype: DType, op: VendorOp<'_>) -> Result<()> {
        #[cfg(any(feature = "nccl", feature = "rccl"))]
        if let (Some(comm), Some(raw)) = (&self.comm, dev.raw_stream(stream)) {
            dev.bind_thread()?;
            // SAFETY: the communicator checked that every address lies in a
            // tensor of this device holding the counts given, and callers keep
            // that memory alive until the stream has run the operation.
            return unsafe { run_ccl(comm, raw, dtype, op) };
        }
        Err(Error::Unsupported(format!(
            "{} on this backend goes to NCCL/RCCL, which is not available: build with --features nccl (or \
             rccl), install the library (or set FERROCOMM_NCCL_PATH) and leave FERROCOMM_CCL unset",
            op.name()
        )))
    }
}

/// The factor of a premul_sum, as NCCL's `ncclRedOpCreatePreMulSum` takes it.
#[cfg(any(feature = "nccl", feature = "rccl"))]
fn ccl_reduction(red: Reduction) -> Result<crate::backends::ccl::CclReduction> {
    use crate::backends::ccl::CclReduction;
    Ok(match red.factor()? {
        None => CclReduction::Op(red.op()),
        Some(Factor::Host(f)) => CclReduction::PreMulHost(f),
        Some(Factor::Device(t)) => CclReduction::PreMulDevice(t.ptr()),
    })
}

/// # Safety
/// As [`crate::backends::ccl::CclComm::all_reduce`] for every address of `op`.
#[cfg(any(feature = "nccl", feature = "rccl"))]
unsafe fn run_ccl(comm: &crate::backends::ccl::CclComm, raw: u64, dtype: DType, op: VendorOp<'_>) -> Result<()> {
    // SAFETY (every call below): forwarded from the caller.
    unsafe {
        match op {
            VendorOp::AllReduce { send, recv, count, red } => {
                comm.all_reduce_with(send, recv, count, dtype, ccl_reduction(red)?, raw)
            }
            VendorOp::Broadcast {
                send,
                recv,
                count,
                root,
            } => comm.broadcast(send, recv, count, dtype, root, raw),
            VendorOp::Reduce {
                send,
                recv,
                count,
                red,
                root,
            } => comm.reduce(send, recv, count, dtype, ccl_reduction(red)?, root, raw),
            VendorOp::AllGather { send, recv, count } => comm.all_gather(send, recv, count, dtype, raw),
            VendorOp::ReduceScatter { send, recv, count, red } => {
                comm.reduce_scatter_with(send, recv, count, dtype, ccl_reduction(red)?, raw)
            }
            VendorOp::Exchange { sends, recvs } => comm.exchange(sends, recvs, dtype, raw),
        }
    }
}

#[cfg(not(any(feature = "nccl", feature = "rccl")))]
#[allow(dead_code)]
fn unused(_: Factor) {}
