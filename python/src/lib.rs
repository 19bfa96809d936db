//! `ferrocomm._ferrocomm`: the native part of the `ferrocomm` Python package.
//!
//! - [`comm`]: the communicator (every collective of the Rust API);
//! - [`work`]: queued collectives and the memory they hold on to;
//! - [`dlpack`]: tensors from torch, CuPy, JAX and NumPy, used in place;
//! - [`export`]: ferrocomm's own memory handed out through DLPack;
//! - [`heap`]: symmetric-heap tensors and one-sided windows;
//! - [`ep`]: expert-parallel dispatch and combine buffers;
//! - [`overlap`]: the chunked all-gather and reduce-scatter (`ferrocomm.ops`);
//! - [`broadcaster`]: the metadata broadcaster (bytes from one rank to the others);
//! - [`store`]: a ferrocomm store over a Python (torch.distributed) store;
//! - [`membership`]: `init()`'s rendezvous, and leaving its store at exit;
//! - [`backend`]: host, CUDA and ROCm communicators behind one class;
//! - [`errors`]: Rust errors as Python exceptions, panics caught;
//! - [`args`]: arguments checked: ranks, counts, shapes, timeouts, and
//!   the per-call options every collective takes (`CallOpts`).
//!
//! The public API is the Python package (`python/ferrocomm`); this module is
//! its engine and is not meant to be imported by itself.

mod args;
mod backend;
mod broadcaster;
mod comm;
mod dlpack;
mod ep;
mod errors;
mod export;
mod heap;
mod membership;
mod overlap;
mod store;
mod torch_tensor;
mod work;

use pyo3::prelude::*;

#[pymodule]
fn _ferrocomm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<args::CallOpts>()?;
    m.add_class::<comm::PyComm>()?;
    m.add_class::<comm::PyRegistration>()?;
    m.add_class::<work::PyWork>()?;
    m.add_class::<heap::PyHeapTensor>()?;
    m.add_class::<heap::PyHeapBits>()?;
    m.add_class::<heap::PyWindow>()?;
    m.add_class::<heap::PyRemoteTensor>()?;
    m.add_class::<ep::PyEpBuffer>()?;
    m.add_class::<broadcaster::PyBroadcaster>()?;
    m.add_class::<ep::PyEpTensor>()?;
    m.add_class::<overlap::PyChunkedAllGather>()?;
    m.add_class::<overlap::PyChunkedReduceScatter>()?;
    m.add_function(wrap_pyfunction!(membership::leave_stores, m)?)?;
    m.add_function(wrap_pyfunction!(membership::pause_compiles, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BACKENDS", backend::compiled())?;
    m.add("LIBRARIES", backend::libraries())?;
    m.add("MOE_MAX_TOPK", ferrocomm::MOE_MAX_TOPK)?;
    Ok(())
}
