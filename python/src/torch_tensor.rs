//! torch GPU tensors taken straight from torch, without DLPack, when the
//! call runs on torch's current stream on the tensor's device.
//!
//! torch's `__dlpack__` and `__dlpack_device__` are Python code: given a
//! stream, `__dlpack__` builds stream objects and orders torch's stream
//! before the consumer's, most of an eager call (`python/bench/profile_eager.py`;
//! BENCHMARKS.md, "Eager cost per call"). On torch's current stream there
//! is nothing to order: the call is queued behind the work that wrote the
//! tensor. So the address, length and dtype are read from the tensor's
//! C-implemented methods, and the tensor object keeps its memory alive
//! until the call has run (as DLPack's deleter would).
//!
//! Nothing is remembered between calls: a tensor freed and its address
//! reused by another tensor is read afresh (`test_freed_and_reused_address`
//! in `python/tests/test_torch_backend.py`). The tensor is let go once its
//! call has run, at the communicator's next call. Anything else — another
//! stream, a strided tensor, a subclass, a dtype without a mapping — goes
//! through DLPack. `FERROCOMM_PY_DLPACK=1` sends every tensor through it.

use std::sync::OnceLock;

use ferrocomm::DType;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::dlpack::{Imported, Owner, KDL_CUDA, KDL_ROCM};

/// What the fast path needs from torch, looked up once torch is imported.
struct Torch {
    tensor: Py<PyType>,
    /// `torch._C._cuda_getCurrentRawStream(device)`: the current stream's
    /// raw handle (0 for the legacy default stream).
    current_raw_stream: Py<PyAny>,
    dtypes: Vec<(Py<PyAny>, DType)>,
    /// The DLPack device type of torch's GPU tensors (ROCm builds of torch
    /// call their GPUs "cuda" too).
    device_type: i32,
}

/// torch's dtypes ferrocomm maps; 1-byte floats arrive as `uint8` views
/// (`_tensors.prepare`), booleans as bytes, as through DLPack.
const DTYPES: [(&str, DType); 9] = [
    ("float32", DType::F32),
    ("float16", DType::F16),
    ("bfloat16", DType::BF16),
    ("float64", DType::F64),
    ("int8", DType::I8),
    ("int32", DType::I32),
    ("int64", DType::I64),
    ("uint8", DType::U8),
    ("bool", DType::U8),
];

impl Torch {
    fn load(torch: &Bound<'_, PyModule>) -> PyResult<Torch> {
        let mut dtypes = Vec::new();
        for (name, dtype) in DTYPES {
            dtypes.push((torch.getattr(name)?.unbind(), dtype));
        }
        let hip = !torch.getattr("version")?.getattr("hip")?.is_none();
        Ok(Torch {
            tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            current_raw_stream: torch.getattr("_C")?.getattr("_cuda_getCurrentRawStream")?.unbind(),
            dtypes,
            device_type: if hip { KDL_ROCM } else { KDL_CUDA },
        })
    }
}

/// torch's pieces, once torch is imported (ferrocomm never imports it);
/// `None` before that, or where this torch lacks one of them.
fn torch(py: Python<'_>) -> Option<&'static Torch> {
    static TORCH: PyOnceLock<Option<Torch>> = PyOnceLock::new();
    if let Some(t) = TORCH.get(py) {
        return t.as_ref();
    }
    let sys = py.import("sys").ok()?;
    let torch = sys.getattr("modules").ok()?.get_item("torch").ok()?;
    let torch = torch.cast_into::<PyModule>().ok()?;
    TORCH.get_or_init(py, || Torch::load(&torch).ok()).as_ref()
}

fn dlpack_forced() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    *OFF.get_or_init(|| std::env::var("FERROCOMM_PY_DLPACK").is_ok_and(|v| v.trim() == "1"))
}

/// `obj` as a tensor, if it is a contiguous torch GPU tensor (exactly
/// `torch.Tensor`) and `stream` (a raw handle) is torch's current stream
/// on its device; `None` sends it through DLPack.
pub fn import_current(obj: &Bound<'_, PyAny>, stream: u64) -> PyResult<Option<Imported>> {
    let py = obj.py();
    if dlpack_forced() {
        return Ok(None);
    }
    let Some(torch) = torch(py) else {
        return Ok(None);
    };
    if !obj.get_type().is(torch.tensor.bind(py)) || !obj.getattr(intern!(py, "is_cuda"))?.extract::<bool>()? {
        return Ok(None);
    }
    let device: i32 = obj.call_method0(intern!(py, "get_device"))?.extract()?;
    if torch.current_raw_stream.call1(py, (device,))?.extract::<u64>(py)? != stream {
        return Ok(None);
    }
    if !obj.call_method0(intern!(py, "is_contiguous"))?.extract::<bool>()? {
        return Ok(None);
    }
    let dt = obj.getattr(intern!(py, "dtype"))?;
    let Some(&(_, dtype)) = torch.dtypes.iter().find(|(d, _)| d.bind(py).is(&dt)) else {
        return Ok(None);
    };
    let dims: usize = obj.call_method0(intern!(py, "dim"))?.extract()?;
    Ok(Some(Imported {
        ptr: obj.call_method0(intern!(py, "data_ptr"))?.extract()?,
        count: obj.call_method0(intern!(py, "numel"))?.extract()?,
        dtype,
        device_type: torch.device_type,
        device_id: device,
        readonly: false,
        rows: match dims {
            0 => 1,
            _ => obj.call_method1(intern!(py, "size"), (0,))?.extract()?,
        },
        owner: Owner::object(obj.clone().unbind()),
    }))
}
