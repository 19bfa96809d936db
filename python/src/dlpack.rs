//! DLPack consumption: any object with `__dlpack__` / `__dlpack_device__`
//! (torch, CuPy, JAX, NumPy >= 1.22) becomes a ferrocomm [`Tensor`] over the
//! producer's memory, used in place. Objects with only the NumPy array
//! interface (`__array_interface__`) are taken as CPU arrays.
//!
//! Ownership follows the DLPack protocol: the capsule is renamed
//! `used_dltensor` (or `used_dltensor_versioned`), after which the producer's
//! capsule destructor leaves the tensor alone and calling its deleter is ours
//! to do. [`Owner`] does it when dropped, which the communicator delays until
//! the collective that uses the memory has run.

use std::ffi::{c_void, CStr};
use std::ptr::NonNull;

use ferrocomm::{DType, Tensor};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use pyo3::{ffi, intern};

use crate::args::invalid;

// ------------------------------------------------------------ the C ABI

/// `DLDeviceType` values ferrocomm routes.
pub const KDL_CPU: i32 = 1;
pub const KDL_CUDA: i32 = 2;
pub const KDL_CUDA_HOST: i32 = 3;
pub const KDL_ROCM: i32 = 10;
pub const KDL_ROCM_HOST: i32 = 11;
pub const KDL_CUDA_MANAGED: i32 = 13;

/// `DLDataTypeCode` values ferrocomm maps (dlpack.h 1.1).
pub(crate) const KDL_INT: u8 = 0;
pub(crate) const KDL_UINT: u8 = 1;
pub(crate) const KDL_FLOAT: u8 = 2;
pub(crate) const KDL_BFLOAT: u8 = 4;
const KDL_BOOL: u8 = 6;
pub(crate) const KDL_FLOAT8_E4M3FN: u8 = 10;
const KDL_FLOAT8_E4M3FNUZ: u8 = 11;
pub(crate) const KDL_FLOAT8_E5M2: u8 = 12;
const KDL_FLOAT8_E5M2FNUZ: u8 = 13;

/// `DLPACK_FLAG_BITMASK_READ_ONLY`.
const FLAG_READ_ONLY: u64 = 1;

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct DLDevice {
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct DLDataType {
    pub(crate) code: u8,
    pub(crate) bits: u8,
    pub(crate) lanes: u16,
}

#[repr(C)]
pub(crate) struct DLTensor {
    pub(crate) data: *mut c_void,
    pub(crate) device: DLDevice,
    pub(crate) ndim: i32,
    pub(crate) dtype: DLDataType,
    pub(crate) shape: *const i64,
    pub(crate) strides: *const i64,
    pub(crate) byte_offset: u64,
}

#[repr(C)]
pub(crate) struct DLManagedTensor {
    pub(crate) dl_tensor: DLTensor,
    pub(crate) manager_ctx: *mut c_void,
    pub(crate) deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
pub(crate) struct DLPackVersion {
    pub(crate) major: u32,
    pub(crate) minor: u32,
}

#[repr(C)]
pub(crate) struct DLManagedTensorVersioned {
    pub(crate) version: DLPackVersion,
    pub(crate) manager_ctx: *mut c_void,
    pub(crate) deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub(crate) flags: u64,
    pub(crate) dl_tensor: DLTensor,
}

pub(crate) const LEGACY: &CStr = c"dltensor";
const LEGACY_USED: &CStr = c"used_dltensor";
pub(crate) const VERSIONED: &CStr = c"dltensor_versioned";
const VERSIONED_USED: &CStr = c"used_dltensor_versioned";

// ------------------------------------------------------------ ownership

/// What keeps an imported tensor's memory alive: a consumed DLPack tensor
/// (its deleter runs on drop) or the Python object itself.
pub struct Owner(Held);

enum Held {
    Legacy(NonNull<DLManagedTensor>),
    Versioned(NonNull<DLManagedTensorVersioned>),
    Object(#[allow(dead_code)] Py<PyAny>),
    /// Memory ferrocomm owns (a heap tensor), used by ferrocomm itself: the
    /// object, and a loan that keeps it from being freed meanwhile.
    Loaned(#[allow(dead_code)] Py<PyAny>, #[allow(dead_code)] crate::export::Loan),
}

impl Owner {
    /// The Python object itself (its memory lives as long as it does).
    pub fn object(obj: Py<PyAny>) -> Owner {
        Owner(Held::Object(obj))
    }

    /// Ferrocomm's own memory (`obj`), held by `loan` while it is used.
    pub fn loaned(obj: Py<PyAny>, loan: crate::export::Loan) -> Owner {
        Owner(Held::Loaned(obj, loan))
    }
}

// SAFETY: after the capsule was renamed, this value is the only owner of the
// managed tensor; DLPack lets its deleter run on any thread, and `drop` holds
// the GIL while it runs, for producers whose deleter touches Python objects.
unsafe impl Send for Owner {}
// SAFETY: shared references never touch the pointer; only `drop` does.
unsafe impl Sync for Owner {}

impl Drop for Owner {
    fn drop(&mut self) {
        match self.0 {
            Held::Legacy(p) => Python::attach(|_| {
                // SAFETY: we own `p` (the capsule was renamed "used") and call
                // its deleter once, as the protocol asks of the consumer.
                unsafe {
                    if let Some(del) = (*p.as_ptr()).deleter {
                        del(p.as_ptr());
                    }
                }
            }),
            Held::Versioned(p) => Python::attach(|_| {
                // SAFETY: as above, for the versioned struct.
                unsafe {
                    if let Some(del) = (*p.as_ptr()).deleter {
                        del(p.as_ptr());
                    }
                }
            }),
            Held::Object(_) | Held::Loaned(..) => {}
        }
    }
}

// ------------------------------------------------------------ import

/// A tensor taken from Python: where its elements are, and what keeps them alive.
pub struct Imported {
    pub ptr: u64,
    pub count: usize,
    pub dtype: DType,
    pub device_type: i32,
    pub device_id: i32,
    pub readonly: bool,
    /// Length of the first dimension (1 for a scalar): all-to-all split
    /// sizes count rows, as torch's do.
    pub rows: usize,
    pub owner: Owner,
}

impl Imported {
    pub fn tensor(&self) -> Tensor {
        // SAFETY: `ptr..ptr + count * size` is the producer's memory, kept
        // allocated by `owner`, which the communicator holds until every
        // collective using this tensor has run (see `comm.rs`).
        unsafe { Tensor::from_raw(self.ptr, self.count, self.dtype) }
    }
}

/// The `(device_type, device_id)` of an array-like: `__dlpack_device__`, or
/// CPU for an object with only the NumPy array interface.
pub fn device_of(obj: &Bound<'_, PyAny>) -> PyResult<(i32, i32)> {
    let py = obj.py();
    if let Ok(dev) = obj.getattr(intern!(py, "__dlpack_device__")) {
        return dev.call0()?.extract::<(i32, i32)>();
    }
    if obj.hasattr(intern!(py, "__array_interface__"))? {
        return Ok((KDL_CPU, 0));
    }
    Err(not_a_tensor(obj))
}

/// Import `obj`. `stream_for(device_type)` gives the `stream` argument for
/// `__dlpack__` (None for CPU memory): the producer orders its pending work
/// on the tensor before that stream, as the DLPack protocol specifies.
pub fn import(obj: &Bound<'_, PyAny>, stream_for: impl Fn(i32) -> Option<i64>) -> PyResult<Imported> {
    let py = obj.py();
    if !obj.hasattr(intern!(py, "__dlpack__"))? {
        if obj.hasattr(intern!(py, "__array_interface__"))? {
            return from_array_interface(obj);
        }
        return Err(not_a_tensor(obj));
    }
    let device = device_of(obj)?;
    let stream = stream_for(device.0);
    let kwargs = PyDict::new(py);
    if let Some(s) = stream {
        kwargs.set_item(intern!(py, "stream"), s)?;
    }
    kwargs.set_item(intern!(py, "max_version"), (1, 1))?;
    let capsule = match obj.call_method(intern!(py, "__dlpack__"), (), Some(&kwargs)) {
        Ok(c) => c,
        // Producers older than DLPack 1.0 take no `max_version`.
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            kwargs.del_item(intern!(py, "max_version"))?;
            obj.call_method(intern!(py, "__dlpack__"), (), Some(&kwargs))?
        }
        Err(e) => return Err(e),
    };
    consume(&capsule)
}

/// Take ownership of a DLPack capsule and read its tensor.
fn consume(capsule: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let raw = capsule.as_ptr();
    // SAFETY: `raw` is a live object (borrowed by `capsule`); the capsule
    // calls check the type and name before touching the pointer.
    unsafe {
        if ffi::PyCapsule_IsValid(raw, VERSIONED.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(raw, VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
            let p = NonNull::new(p).ok_or_else(|| invalid("a DLPack capsule holds a null tensor"))?;
            if ffi::PyCapsule_SetName(raw, VERSIONED_USED.as_ptr()) != 0 {
                return Err(PyErr::fetch(capsule.py()));
            }
            let owner = Owner(Held::Versioned(p));
            let m = &*p.as_ptr();
            if m.version.major != 1 {
                // Only the deleter may be touched in another major version;
                // dropping `owner` calls it.
                return Err(invalid(format!(
                    "DLPack {}.{} tensors are not understood (ferrocomm reads 1.x)",
                    m.version.major, m.version.minor
                )));
            }
            let readonly = m.flags & FLAG_READ_ONLY != 0;
            return describe(&m.dl_tensor, readonly, owner);
        }
        if ffi::PyCapsule_IsValid(raw, LEGACY.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(raw, LEGACY.as_ptr()) as *mut DLManagedTensor;
            let p = NonNull::new(p).ok_or_else(|| invalid("a DLPack capsule holds a null tensor"))?;
            if ffi::PyCapsule_SetName(raw, LEGACY_USED.as_ptr()) != 0 {
                return Err(PyErr::fetch(capsule.py()));
            }
            let owner = Owner(Held::Legacy(p));
            return describe(&(*p.as_ptr()).dl_tensor, false, owner);
        }
    }
    Err(invalid(
        "__dlpack__ returned something other than an unused \"dltensor\" capsule",
    ))
}

/// # Safety
/// `t` is the live `DLTensor` of a managed tensor that `owner` owns.
unsafe fn describe(t: &DLTensor, readonly: bool, owner: Owner) -> PyResult<Imported> {
    let dims: &[i64] = if t.ndim <= 0 || t.shape.is_null() {
        &[]
    } else {
        // SAFETY: DLPack: `shape` points at `ndim` elements while the tensor lives.
        unsafe { std::slice::from_raw_parts(t.shape, t.ndim as usize) }
    };
    if t.ndim < 0 || (t.ndim > 0 && t.shape.is_null()) {
        return Err(invalid(format!("a DLPack tensor with ndim {} and no shape", t.ndim)));
    }
    let strides: Option<&[i64]> = if t.strides.is_null() || t.ndim == 0 {
        None
    } else {
        // SAFETY: DLPack: non-null `strides` has `ndim` elements.
        Some(unsafe { std::slice::from_raw_parts(t.strides, t.ndim as usize) })
    };
    let dtype = dtype_of(t.dtype)?;
    let count = element_count(dims)?;
    if let Some(st) = strides {
        check_contiguous(dims, st, count)?;
    }
    let ptr = (t.data as u64)
        .checked_add(t.byte_offset)
        .ok_or_else(|| invalid("a DLPack tensor's data + byte_offset overflows"))?;
    Ok(Imported {
        ptr,
        count,
        dtype,
        device_type: t.device.device_type,
        device_id: t.device.device_id,
        readonly,
        rows: dims.first().map_or(1, |&d| d as usize),
        owner,
    })
}

fn element_count(dims: &[i64]) -> PyResult<usize> {
    dims.iter().try_fold(1usize, |n, &d| {
        usize::try_from(d)
            .ok()
            .and_then(|d| n.checked_mul(d))
            .ok_or_else(|| invalid(format!("tensor shape {dims:?} is negative or overflows")))
    })
}

/// Row-major contiguity; dimensions of length 1 may have any stride (torch
/// reports arbitrary strides there), and an empty tensor is contiguous.
fn check_contiguous(dims: &[i64], strides: &[i64], count: usize) -> PyResult<()> {
    if count == 0 {
        return Ok(());
    }
    let mut expected = 1i64;
    for (&d, &s) in dims.iter().zip(strides).rev() {
        if d != 1 && s != expected {
            return Err(invalid(format!(
                "tensor with shape {dims:?} and strides {strides:?} is not contiguous: collectives use the \
                 memory in place, so pass a contiguous tensor (e.g. torch's .contiguous())"
            )));
        }
        expected = expected.saturating_mul(d);
    }
    Ok(())
}

/// DLPack dtype to ferrocomm's. Booleans and the MI300 FP8 flavours (fnuz)
/// travel as bytes: their bits are only moved, and a reduction of them is
/// refused as one of u8.
fn dtype_of(d: DLDataType) -> PyResult<DType> {
    if d.lanes != 1 {
        return Err(invalid(format!(
            "vector dtypes (lanes = {}) are not supported",
            d.lanes
        )));
    }
    let t = match (d.code, d.bits) {
        (KDL_FLOAT, 32) => DType::F32,
        (KDL_FLOAT, 16) => DType::F16,
        (KDL_FLOAT, 64) => DType::F64,
        (KDL_BFLOAT, 16) => DType::BF16,
        (KDL_INT, 8) => DType::I8,
        (KDL_INT, 32) => DType::I32,
        (KDL_INT, 64) => DType::I64,
        (KDL_UINT, 8) | (KDL_BOOL, 8) => DType::U8,
        (KDL_FLOAT8_E4M3FN, 8) => DType::F8E4M3,
        (KDL_FLOAT8_E5M2, 8) => DType::F8E5M2,
        (KDL_FLOAT8_E4M3FNUZ, 8) | (KDL_FLOAT8_E5M2FNUZ, 8) => DType::U8,
        (code, bits) => {
            return Err(invalid(format!(
                "DLPack dtype (code {code}, {bits} bits) has no ferrocomm dtype: use float32, float16, bfloat16, \
                 float64, int8, int32, int64, uint8, bool, float8_e4m3fn or float8_e5m2"
            )))
        }
    };
    Ok(t)
}

/// A CPU array through `__array_interface__` (version 3): for NumPy
/// versions without DLPack, and array-likes that only speak that protocol.
fn from_array_interface(obj: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let py = obj.py();
    let ai = obj.getattr(intern!(py, "__array_interface__"))?;
    let ai = ai
        .cast::<PyDict>()
        .map_err(|_| invalid("__array_interface__ is not a dict"))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        ai.get_item(k)?
            .ok_or_else(|| invalid(format!("__array_interface__ has no {k:?}")))
    };
    let data = get("data")?;
    let data = data
        .cast::<PyTuple>()
        .map_err(|_| invalid("__array_interface__['data'] must be a (pointer, read_only) tuple"))?;
    let (ptr, readonly): (u64, bool) = data.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    let shape: Vec<i64> = get("shape")?.extract()?;
    let dtype = dtype_of_typestr(&typestr)?;
    let count = element_count(&shape)?;
    if let Some(strides) = ai.get_item("strides")?.filter(|s| !s.is_none()) {
        let bytes: Vec<i64> = strides.extract()?;
        let size = dtype.size() as i64;
        let elems: Vec<i64> = bytes
            .iter()
            .map(|b| if b % size == 0 { b / size } else { -1 })
            .collect();
        check_contiguous(&shape, &elems, count)?;
    }
    Ok(Imported {
        ptr,
        count,
        dtype,
        device_type: KDL_CPU,
        device_id: 0,
        readonly,
        rows: shape.first().map_or(1, |&d| d as usize),
        owner: Owner(Held::Object(obj.clone().unbind())),
    })
}

fn dtype_of_typestr(s: &str) -> PyResult<DType> {
    let native = if cfg!(target_endian = "little") { '<' } else { '>' };
    let mut chars = s.chars();
    let order = chars.next().unwrap_or('?');
    let rest: String = chars.collect();
    let single_byte = matches!(rest.as_str(), "i1" | "u1" | "b1");
    if !(order == native || order == '=' || (order == '|' && single_byte)) {
        return Err(invalid(format!(
            "array typestr {s:?}: only native byte order is supported"
        )));
    }
    Ok(match rest.as_str() {
        "f4" => DType::F32,
        "f2" => DType::F16,
        "f8" => DType::F64,
        "i1" => DType::I8,
        "i4" => DType::I32,
        "i8" => DType::I64,
        "u1" | "b1" => DType::U8,
        _ => return Err(invalid(format!("array typestr {s:?} has no ferrocomm dtype"))),
    })
}

fn not_a_tensor(obj: &Bound<'_, PyAny>) -> PyErr {
    let ty = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    invalid(format!(
        "expected a tensor or array with __dlpack__ (torch, CuPy, JAX, NumPy) or __array_interface__, got {ty}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguity_ignores_unit_dims() {
        assert!(check_contiguous(&[2, 3], &[3, 1], 6).is_ok());
        assert!(check_contiguous(&[2, 1, 3], &[3, 99, 1], 6).is_ok());
        assert!(check_contiguous(&[0, 3], &[7, 7], 0).is_ok());
    }
}
