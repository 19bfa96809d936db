//! NCCL/RCCL underneath the communicator, when built (`nccl`/`rccl`
//! features), wanted (`FERROCOMM_CCL` is not `0`) and present on every rank.

use std::time::Duration;

use crate::bootstrap::Store;
use crate::device::{Device, DevicePtr};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

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

    pub(crate) fn available(&self) -> bool {
        #[cfg(any(feature = "nccl", feature = "rccl"))]
        return self.comm.is_some();
        #[cfg(not(any(feature = "nccl", feature = "rccl")))]
        false
    }

    /// Stream-ordered all-reduce through the vendor library.
    #[allow(clippy::too_many_arguments, unused_variables)]
    pub(crate) fn all_reduce<D: Device>(
        &self,
        dev: &D,
        stream: &D::Stream,
        input: DevicePtr,
        output: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        #[cfg(any(feature = "nccl", feature = "rccl"))]
        if let (Some(comm), Some(raw)) = (&self.comm, dev.raw_stream(stream)) {
            dev.bind_thread()?;
            // SAFETY: the communicator checked that `input` and `output` are
            // buffers of this device holding `count` elements, and callers keep
            // them alive until the stream has run the operation.
            return unsafe { comm.all_reduce(input, output, count, dtype, op, raw) };
        }
        Err(Error::Unsupported(
            "the NCCL/RCCL path is not available: build with --features nccl (or rccl), \
             install the library (or set FERROCOMM_NCCL_PATH) and leave FERROCOMM_CCL unset"
                .into(),
        ))
    }
}
