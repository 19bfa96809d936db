//! The communicator over whichever backend this process runs: Python sees
//! one class, Rust has one `Communicator<D>` per device type. `with_comm!`
//! runs the same generic code on whichever it is.

use std::sync::Arc;

use ferrocomm::backends::host::HostDevice;
use ferrocomm::bootstrap::{store_all_gather, Store};
use ferrocomm::device::Device;
use ferrocomm::ep::EpBuffer;
use ferrocomm::{CommOptions, Communicator, Error, Result, Window, Work};

#[cfg(feature = "cuda")]
use ferrocomm::backends::cuda::CudaDevice;
#[cfg(feature = "rocm")]
use ferrocomm::backends::hip::HipDevice;

use crate::dlpack::{KDL_CPU, KDL_CUDA_HOST, KDL_ROCM_HOST};

pub enum AnyComm {
    Host(Communicator<HostDevice>),
    #[cfg(feature = "cuda")]
    Cuda(Communicator<CudaDevice>),
    #[cfg(feature = "rocm")]
    Hip(Communicator<HipDevice>),
}

pub enum AnyWork {
    Host(Work<HostDevice>),
    #[cfg(feature = "cuda")]
    Cuda(Work<CudaDevice>),
    #[cfg(feature = "rocm")]
    Hip(Work<HipDevice>),
}

pub enum AnyWindow {
    Host(Window<HostDevice>),
    #[cfg(feature = "cuda")]
    Cuda(Window<CudaDevice>),
    #[cfg(feature = "rocm")]
    Hip(Window<HipDevice>),
}

pub enum AnyEp {
    Host(EpBuffer<HostDevice>),
    #[cfg(feature = "cuda")]
    Cuda(EpBuffer<CudaDevice>),
    #[cfg(feature = "rocm")]
    Hip(EpBuffer<HipDevice>),
}

/// Run `$body` with `$c` bound to the communicator inside an [`AnyComm`]
/// (or the work inside an [`AnyWork`]), whatever its device type.
macro_rules! with_any {
    ($any:expr, $kind:ident, |$c:ident| $body:expr) => {
        match $any {
            $crate::backend::$kind::Host($c) => $body,
            #[cfg(feature = "cuda")]
            $crate::backend::$kind::Cuda($c) => $body,
            #[cfg(feature = "rocm")]
            $crate::backend::$kind::Hip($c) => $body,
        }
    };
}
pub(crate) use with_any;

/// What each device type adds to the generic code.
pub trait Backend: Device {
    /// The name Python sees (`host`, `cuda`, `rocm`).
    const NAME: &'static str;
    fn wrap_work(w: Work<Self>) -> AnyWork;
    fn wrap_comm(c: Communicator<Self>) -> AnyComm;
    /// Whether DLPack memory of `device_type` is this backend's.
    fn accepts(device_type: i32) -> bool;
    /// The DLPack device type of this backend's memory (what it exports).
    const DL_DEVICE: i32;
    fn wrap_window(w: Window<Self>) -> AnyWindow;
    fn wrap_ep(b: EpBuffer<Self>) -> AnyEp;
    /// The communicator inside `c`, if it is this backend's.
    fn comm_of(c: &AnyComm) -> Option<&Communicator<Self>>;
}

impl Backend for HostDevice {
    const NAME: &'static str = "host";
    fn wrap_work(w: Work<Self>) -> AnyWork {
        AnyWork::Host(w)
    }
    fn wrap_comm(c: Communicator<Self>) -> AnyComm {
        AnyComm::Host(c)
    }
    const DL_DEVICE: i32 = KDL_CPU;
    fn wrap_window(w: Window<Self>) -> AnyWindow {
        AnyWindow::Host(w)
    }
    fn wrap_ep(b: EpBuffer<Self>) -> AnyEp {
        AnyEp::Host(b)
    }
    fn comm_of(c: &AnyComm) -> Option<&Communicator<Self>> {
        match c {
            AnyComm::Host(c) => Some(c),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    fn accepts(t: i32) -> bool {
        matches!(t, KDL_CPU | KDL_CUDA_HOST | KDL_ROCM_HOST)
    }
}

#[cfg(feature = "cuda")]
impl Backend for CudaDevice {
    const NAME: &'static str = "cuda";
    fn wrap_work(w: Work<Self>) -> AnyWork {
        AnyWork::Cuda(w)
    }
    fn wrap_comm(c: Communicator<Self>) -> AnyComm {
        AnyComm::Cuda(c)
    }
    const DL_DEVICE: i32 = crate::dlpack::KDL_CUDA;
    fn wrap_window(w: Window<Self>) -> AnyWindow {
        AnyWindow::Cuda(w)
    }
    fn wrap_ep(b: EpBuffer<Self>) -> AnyEp {
        AnyEp::Cuda(b)
    }
    fn comm_of(c: &AnyComm) -> Option<&Communicator<Self>> {
        match c {
            AnyComm::Cuda(c) => Some(c),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    fn accepts(t: i32) -> bool {
        matches!(t, crate::dlpack::KDL_CUDA | crate::dlpack::KDL_CUDA_MANAGED)
    }
}

#[cfg(feature = "rocm")]
impl Backend for HipDevice {
    const NAME: &'static str = "rocm";
    fn wrap_work(w: Work<Self>) -> AnyWork {
        AnyWork::Hip(w)
    }
    fn wrap_comm(c: Communicator<Self>) -> AnyComm {
        AnyComm::Hip(c)
    }
    const DL_DEVICE: i32 = crate::dlpack::KDL_ROCM;
    fn wrap_window(w: Window<Self>) -> AnyWindow {
        AnyWindow::Hip(w)
    }
    fn wrap_ep(b: EpBuffer<Self>) -> AnyEp {
        AnyEp::Hip(b)
    }
    fn comm_of(c: &AnyComm) -> Option<&Communicator<Self>> {
        match c {
            AnyComm::Hip(c) => Some(c),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    fn accepts(t: i32) -> bool {
        t == crate::dlpack::KDL_ROCM
    }
}

/// The backends compiled into this build.
pub fn compiled() -> Vec<&'static str> {
    let mut v = vec!["host"];
    if cfg!(feature = "cuda") {
        v.push("cuda");
    }
    if cfg!(feature = "rocm") {
        v.push("rocm");
    }
    v
}

/// Which features this build has underneath (`nccl`, `rccl`).
pub fn libraries() -> Vec<&'static str> {
    let mut v = Vec::new();
    if cfg!(feature = "nccl") {
        v.push("nccl");
    }
    if cfg!(feature = "rccl") {
        v.push("rccl");
    }
    v
}

/// A device that opened, before its communicator exists.
enum Opened {
    Host(HostDevice),
    #[cfg(feature = "cuda")]
    Cuda(CudaDevice),
    #[cfg(feature = "rocm")]
    Hip(HipDevice),
}

impl Opened {
    fn name(&self) -> &'static str {
        match self {
            Opened::Host(_) => "host",
            #[cfg(feature = "cuda")]
            Opened::Cuda(_) => "cuda",
            #[cfg(feature = "rocm")]
            Opened::Hip(_) => "rocm",
        }
    }
}

#[cfg(not(all(feature = "cuda", feature = "rocm")))]
fn not_compiled(backend: &'static str) -> Error {
    Error::NotCompiled {
        backend,
        feature: backend,
    }
}

fn open_cuda(ordinal: usize) -> Result<Opened> {
    #[cfg(feature = "cuda")]
    return CudaDevice::new(ordinal).map(Opened::Cuda);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(not_compiled("cuda"))
    }
}

fn open_rocm(ordinal: usize) -> Result<Opened> {
    #[cfg(feature = "rocm")]
    return HipDevice::new(ordinal).map(Opened::Hip);
    #[cfg(not(feature = "rocm"))]
    {
        let _ = ordinal;
        Err(not_compiled("rocm"))
    }
}

/// Open `backend`'s device `ordinal`. `auto` takes the first of CUDA, ROCm
/// and the host that has a library and a device here.
fn open(backend: &str, ordinal: usize) -> Result<Opened> {
    let absent = |e: &Error| {
        matches!(
            e,
            Error::LibraryMissing { .. } | Error::NoDevice { .. } | Error::NotCompiled { .. }
        )
    };
    match backend {
        "host" | "cpu" => Ok(Opened::Host(HostDevice::new(ordinal)?)),
        "cuda" => open_cuda(ordinal),
        "rocm" | "hip" => open_rocm(ordinal),
        "auto" => match open_cuda(ordinal) {
            Err(e) if absent(&e) => match open_rocm(ordinal) {
                Err(e) if absent(&e) => Ok(Opened::Host(HostDevice::new(ordinal)?)),
                other => other,
            },
            other => other,
        },
        other => Err(Error::invalid(format!(
            "backend {other:?}: expected \"auto\", \"host\", \"cuda\" or \"rocm\""
        ))),
    }
}

/// Create a communicator: open the device, check that every rank chose the
/// same backend (an `auto` that found a GPU on some ranks only would
/// otherwise pair a GPU workspace with a host one), then the collective
/// creation itself.
pub fn create(
    backend: &str,
    ordinal: usize,
    store: Arc<dyn Store>,
    rank: usize,
    world: usize,
    opts: CommOptions,
) -> Result<AnyComm> {
    if world == 0 || rank >= world {
        return Err(Error::invalid(format!("rank {rank} is not in a world of {world}")));
    }
    let opened = open(backend, ordinal);
    let mine: &[u8] = match &opened {
        Ok(d) => d.name().as_bytes(),
        Err(_) => b"!",
    };
    // Per-rank creation count, as the communicator itself numbers them, so
    // that every rank's n-th creation meets the others' n-th.
    let serial = store.add(&format!("fcpy/ncreate/{rank}"), 1)?;
    let key = format!("fcpy/create{serial}/backend");
    let all = store_all_gather(store.as_ref(), &key, rank, world, mine, opts.timeout)?;
    let dev = opened?;
    if let Some((peer, other)) = all.iter().enumerate().find(|(_, b)| b.as_slice() != mine) {
        let other = String::from_utf8_lossy(other);
        return Err(Error::Mismatch {
            rank,
            peer,
            detail: if other == "!" {
                format!("rank {peer} could not open a {backend} device (its own error says why)")
            } else {
                format!("this rank opened the {} backend, rank {peer} {other}", dev.name())
            },
        });
    }
    Ok(match dev {
        Opened::Host(d) => AnyComm::Host(Communicator::new(d, store, rank, world, opts)?),
        #[cfg(feature = "cuda")]
        Opened::Cuda(d) => AnyComm::Cuda(Communicator::new(d, store, rank, world, opts)?),
        #[cfg(feature = "rocm")]
        Opened::Hip(d) => AnyComm::Hip(Communicator::new(d, store, rank, world, opts)?),
    })
}
