//! DLPack production: memory ferrocomm owns (heap tensors, a peer's window
//! buffer as mapped here) handed to torch, NumPy, CuPy or JAX without a copy.
//!
//! [`capsule`] builds a `dltensor` (legacy `DLManagedTensor`) or, for a
//! consumer that asks for DLPack 1.x, a `dltensor_versioned` capsule. The
//! managed tensor carries a [`Loan`]: while any consumer holds the memory
//! (until it calls the deleter, or the unconsumed capsule is collected),
//! the heap tensor cannot be freed, the window buffer not deregistered and
//! the communicator not finalized; those calls raise instead of leaving the
//! consumer with unmapped memory.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use ferrocomm::{DType, Error};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::dlpack::{
    DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLPackVersion, DLTensor, KDL_BFLOAT, KDL_FLOAT,
    KDL_FLOAT8_E4M3FN, KDL_FLOAT8_E5M2, KDL_INT, KDL_UINT, LEGACY, VERSIONED,
};
use crate::work::lock;

// ------------------------------------------------------------ loans

/// How many holds on one thing (a communicator's memory, a heap tensor, a
/// window buffer) are out, and whether it is gone (then no new hold).
#[derive(Default)]
pub struct Counter(Mutex<CounterState>);

#[derive(Default)]
struct CounterState {
    live: usize,
    closed: Option<&'static str>,
}

impl Counter {
    pub fn new() -> Arc<Counter> {
        Arc::new(Counter::default())
    }

    /// Mark it gone (`why`: "freed", "finalized", ...) if nothing holds it;
    /// else the number of holds, and nothing changes.
    pub fn close(&self, why: &'static str) -> Result<(), usize> {
        let mut st = lock(&self.0);
        if st.live > 0 {
            return Err(st.live);
        }
        st.closed.get_or_insert(why);
        Ok(())
    }

    /// Why it is gone, if it is.
    pub fn closed(&self) -> Option<&'static str> {
        lock(&self.0).closed
    }
}

/// One hold on every counter it was taken on; let go when dropped.
pub struct Loan(Vec<Arc<Counter>>);

impl Loan {
    /// A hold on each of `counters` (all or none): `Err(why)` if one is gone.
    pub fn take(counters: &[&Arc<Counter>]) -> Result<Loan, &'static str> {
        let mut guards: Vec<_> = counters.iter().map(|c| lock(&c.0)).collect();
        if let Some(why) = guards.iter().find_map(|g| g.closed) {
            return Err(why);
        }
        for g in guards.iter_mut() {
            g.live += 1;
        }
        Ok(Loan(counters.iter().map(|c| Arc::clone(c)).collect()))
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        for c in &self.0 {
            let mut st = lock(&c.0);
            st.live = st.live.saturating_sub(1);
        }
    }
}

// ------------------------------------------------------------ capsules

/// What a capsule describes: contiguous (row-major) memory.
#[derive(Clone)]
pub struct Exported {
    pub ptr: u64,
    pub shape: Vec<i64>,
    pub dtype: DType,
    pub device: (i32, i32),
    /// Exported as unsigned integers of the element's width: NumPy has no
    /// bfloat16 or float8, and takes their bits so.
    pub bits: bool,
}

impl Exported {
    /// The name of the dtype a consumer sees (`bfloat16`, or `uint16` for its bits).
    pub fn dtype_name(&self) -> &'static str {
        match (self.bits, self.dtype.size()) {
            (false, _) => dtype_name(self.dtype),
            (true, 1) => "uint8",
            (true, 2) => "uint16",
            (true, 4) => "uint32",
            (true, _) => "uint64",
        }
    }
}

/// The DLPack dtype of a ferrocomm dtype.
fn dl_dtype(d: DType) -> DLDataType {
    let (code, bits) = match d {
        DType::F32 => (KDL_FLOAT, 32),
        DType::F16 => (KDL_FLOAT, 16),
        DType::F64 => (KDL_FLOAT, 64),
        DType::BF16 => (KDL_BFLOAT, 16),
        DType::I8 => (KDL_INT, 8),
        DType::I32 => (KDL_INT, 32),
        DType::I64 => (KDL_INT, 64),
        DType::U8 => (KDL_UINT, 8),
        DType::F8E4M3 => (KDL_FLOAT8_E4M3FN, 8),
        DType::F8E5M2 => (KDL_FLOAT8_E5M2, 8),
    };
    DLDataType { code, bits, lanes: 1 }
}

/// NumPy/torch's name of a dtype (`float32`, `bfloat16`, ...).
pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::F64 => "float64",
        DType::BF16 => "bfloat16",
        DType::I8 => "int8",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::U8 => "uint8",
        DType::F8E4M3 => "float8_e4m3fn",
        DType::F8E5M2 => "float8_e5m2",
    }
}

/// The managed tensor and everything it points at, in one allocation whose
/// address is the managed tensor's `manager_ctx`.
struct Holder<M> {
    managed: M,
    /// `shape` then `strides` (elements), `ndim` each.
    dims: Box<[i64]>,
    _loan: Loan,
}

fn dl_tensor(e: &Exported, dims: &[i64]) -> DLTensor {
    let ndim = e.shape.len();
    DLTensor {
        data: e.ptr as *mut c_void,
        device: DLDevice {
            device_type: e.device.0,
            device_id: e.device.1,
        },
        ndim: ndim as i32,
        dtype: if e.bits {
            DLDataType {
                code: KDL_UINT,
                bits: (8 * e.dtype.size()) as u8,
                lanes: 1,
            }
        } else {
            dl_dtype(e.dtype)
        },
        shape: dims.as_ptr(),
        strides: dims[ndim..].as_ptr(),
        byte_offset: 0,
    }
}

/// `shape` followed by its row-major strides.
fn dims_of(shape: &[i64]) -> Box<[i64]> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1].max(1));
    }
    shape.iter().copied().chain(strides).collect()
}

/// # Safety
/// `p` is a managed tensor made by [`capsule`], not deleted before.
unsafe extern "C" fn delete_legacy(p: *mut DLManagedTensor) {
    if p.is_null() {
        return;
    }
    // SAFETY: `manager_ctx` is the `Box<Holder<_>>` leaked in `capsule`; the
    // protocol calls the deleter once, so it is reclaimed once.
    drop(unsafe { Box::from_raw((*p).manager_ctx as *mut Holder<DLManagedTensor>) });
}

/// # Safety
/// As [`delete_legacy`], for the versioned struct.
unsafe extern "C" fn delete_versioned(p: *mut DLManagedTensorVersioned) {
    if p.is_null() {
        return;
    }
    // SAFETY: as in `delete_legacy`.
    drop(unsafe { Box::from_raw((*p).manager_ctx as *mut Holder<DLManagedTensorVersioned>) });
}

/// A capsule nobody consumed (still named `dltensor[_versioned]`) owns its
/// tensor: delete it. A consumed one was renamed, and is the consumer's.
///
/// # Safety
/// Called by CPython with a live capsule, GIL held.
unsafe extern "C" fn capsule_destructor(cap: *mut ffi::PyObject) {
    // SAFETY: `cap` is live; the validity checks look at its name before
    // the pointer is taken, and the pointers were made by `capsule`.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr()) as *mut DLManagedTensor;
            delete_legacy(p);
        } else if ffi::PyCapsule_IsValid(cap, VERSIONED.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(cap, VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
            delete_versioned(p);
        }
    }
}

/// A DLPack capsule of `e`, holding `loan` until the consumer lets go:
/// versioned (DLPack 1.1) when `versioned`, else legacy.
fn capsule<'py>(py: Python<'py>, e: &Exported, loan: Loan, versioned: bool) -> PyResult<Bound<'py, PyAny>> {
    let dims = dims_of(&e.shape);
    let (raw, name) = if versioned {
        let mut h = Box::new(Holder {
            managed: DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 1 },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned),
                flags: 0,
                dl_tensor: dl_tensor(e, &dims),
            },
            dims,
            _loan: loan,
        });
        // The boxed slice does not move with the box: its pointers stay valid.
        h.managed.dl_tensor = dl_tensor(e, &h.dims);
        let h = Box::into_raw(h);
        // SAFETY: `h` is the live allocation just leaked; `managed` is its field.
        unsafe {
            (*h).managed.manager_ctx = h.cast();
            (std::ptr::addr_of_mut!((*h).managed).cast::<c_void>(), VERSIONED)
        }
    } else {
        let mut h = Box::new(Holder {
            managed: DLManagedTensor {
                dl_tensor: dl_tensor(e, &dims),
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy),
            },
            dims,
            _loan: loan,
        });
        h.managed.dl_tensor = dl_tensor(e, &h.dims);
        let h = Box::into_raw(h);
        // SAFETY: as above.
        unsafe {
            (*h).managed.manager_ctx = h.cast();
            (std::ptr::addr_of_mut!((*h).managed).cast::<c_void>(), LEGACY)
        }
    };
    // SAFETY: `raw` points at a managed tensor made above; `name` is a
    // static C string; the destructor deletes the tensor unless consumed.
    let cap = unsafe { ffi::PyCapsule_New(raw, name.as_ptr(), Some(capsule_destructor)) };
    if cap.is_null() {
        // SAFETY: the capsule was not made, so the tensor is still ours.
        unsafe {
            if versioned {
                delete_versioned(raw.cast());
            } else {
                delete_legacy(raw.cast());
            }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `cap` is a new, non-null reference.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) })
}

/// The arguments of `__dlpack__` (the array API's), checked: whether the
/// consumer takes a versioned capsule. `stream` needs no ordering here:
/// ferrocomm has no pending work of its own on this memory (heap memory is
/// zeroed and synchronized at allocation; puts and signals are ordered by
/// the caller's `wait_signal`), so any stream the consumer names is fine.
fn dlpack_args(
    device: (i32, i32),
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<bool> {
    use pyo3::exceptions::PyBufferError;
    if copy == Some(true) {
        return Err(PyBufferError::new_err(
            "ferrocomm exports its memory in place: copy=True is not supported",
        ));
    }
    if let Some(d) = dl_device {
        if d != device {
            return Err(PyBufferError::new_err(format!(
                "the memory is on DLPack device {device:?}, not {d:?}"
            )));
        }
    }
    Ok(max_version.is_some_and(|(major, _)| major >= 1))
}

/// `__dlpack__` of memory ferrocomm exports (heap tensors and their bits,
/// peers' window buffers, EP buffer views), the one body of every
/// exporter's method: the arguments checked ([`dlpack_args`]; `stream` is
/// accepted and needs nothing, as said there), then a hold on each of
/// `holds` for the consumer (refused as [`gone`], naming `what`, once one
/// is closed), then the capsule of `e`.
#[allow(clippy::too_many_arguments)]
pub fn dlpack<'py>(
    py: Python<'py>,
    e: &Exported,
    holds: &[&Arc<Counter>],
    what: &str,
    stream: Option<&Bound<'py, PyAny>>,
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    let _ = stream;
    let versioned = dlpack_args(e.device, max_version, dl_device, copy)?;
    let loan = Loan::take(holds).map_err(|why| gone(what, why))?;
    capsule(py, e, loan, versioned)
}

/// Refused as [`gone`] once `c` is closed (what it counts holds on is gone).
pub fn ensure_open(c: &Counter, what: &str) -> PyResult<()> {
    match c.closed() {
        Some(why) => Err(gone(what, why)),
        None => Ok(()),
    }
}

/// The Python error for a hold refused because the memory is gone.
pub fn gone(what: &str, why: &'static str) -> PyErr {
    let e = match why {
        "finalized" => Error::Finalized,
        _ => Error::invalid(format!("{what}: it was {why}")),
    };
    crate::errors::to_pyerr(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_major_strides() {
        assert_eq!(&*dims_of(&[2, 3, 4]), &[2, 3, 4, 12, 4, 1]);
        assert_eq!(&*dims_of(&[]), &[] as &[i64]);
        assert_eq!(&*dims_of(&[0, 5]), &[0, 5, 5, 1]);
    }

    #[test]
    fn loans_block_close() {
        let a = Counter::new();
        let b = Counter::new();
        let l = Loan::take(&[&a, &b]).unwrap();
        assert_eq!(a.close("freed"), Err(1));
        drop(l);
        assert_eq!(a.close("freed"), Ok(()));
        assert_eq!(Loan::take(&[&b, &a]).err(), Some("freed"));
        assert!(b.close("x").is_ok());
    }
}
