//! [`Tensor`]: the caller's memory as a collective sees it.

use crate::device::{DeviceBuffer, DevicePtr};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A typed range of device memory that a collective reads or writes: a
/// ferrocomm buffer, a view at any offset inside one, or memory from any
/// other allocator (a raw pointer, a cudarc slice, a framework's tensor).
/// Any alignment is allowed; misaligned memory takes a slower path.
///
/// A `Tensor` does not own or borrow the memory: the memory must stay
/// allocated until the stream has run every collective queued on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tensor {
    ptr: DevicePtr,
    count: usize,
    dtype: DType,
}

impl Tensor {
    /// The whole of `buf` as elements of `dtype` (a trailing partial element is left out).
    pub fn of<B: DeviceBuffer>(buf: &B, dtype: DType) -> Tensor {
        Tensor {
            ptr: buf.ptr(),
            count: buf.len() / dtype.size(),
            dtype,
        }
    }

    /// `count` elements of `dtype` at `byte_offset` inside `buf`.
    pub fn view<B: DeviceBuffer>(buf: &B, dtype: DType, byte_offset: usize, count: usize) -> Result<Tensor> {
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::invalid(format!("a view of {count} x {dtype} overflows")))?;
        crate::device::check_range("tensor view", buf.len(), byte_offset, bytes)?;
        Ok(Tensor {
            ptr: buf.ptr().offset(byte_offset),
            count,
            dtype,
        })
    }

    /// `count` elements of `dtype` at a raw device address (`CUdeviceptr`,
    /// `hipDeviceptr_t`, or a host address for the host backend).
    ///
    /// # Safety
    /// `ptr..ptr + count * dtype.size()` is memory of the device the tensor
    /// is used with, allocated until every collective that uses it has run.
    /// The communicator checks what the backend can check (device, extent),
    /// not more.
    pub unsafe fn from_raw(ptr: u64, count: usize, dtype: DType) -> Tensor {
        Tensor {
            ptr: DevicePtr(ptr),
            count,
            dtype,
        }
    }

    /// Elements `first..first + count` of this tensor.
    pub fn slice(&self, first: usize, count: usize) -> Result<Tensor> {
        match first.checked_add(count) {
            Some(end) if end <= self.count => Ok(Tensor {
                ptr: self.ptr.offset(first * self.dtype.size()),
                count,
                dtype: self.dtype,
            }),
            _ => Err(Error::invalid(format!(
                "slice {first}+{count} of a tensor of {} elements",
                self.count
            ))),
        }
    }

    /// The same memory as another dtype of the same element size (bits are
    /// not converted).
    pub fn reinterpret(&self, dtype: DType) -> Result<Tensor> {
        if dtype.size() != self.dtype.size() {
            return Err(Error::invalid(format!(
                "cannot view {} as {dtype}: element sizes differ",
                self.dtype
            )));
        }
        Ok(Tensor { dtype, ..*self })
    }

    /// The address of the first element.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The number of elements.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes spanned, or an error when `count * size` overflows.
    pub fn bytes(&self) -> Result<usize> {
        self.count
            .checked_mul(self.dtype.size())
            .ok_or_else(|| Error::invalid(format!("{} x {} overflows", self.count, self.dtype)))
    }

    /// The one tensor `parts` are, when they lie back to back in order with
    /// one dtype (a list call on slices of one buffer, as the levels of a
    /// communicator across nodes make): NCCL/RCCL then take it as it is
    /// instead of staging the list into one contiguous buffer.
    pub(crate) fn joined(parts: &[Tensor]) -> Option<Tensor> {
        let first = parts.first()?;
        let mut end = first.ptr.0;
        for p in parts {
            if p.dtype != first.dtype || p.ptr.0 != end {
                return None;
            }
            end = end.checked_add(p.bytes().ok()? as u64)?;
        }
        Some(Tensor {
            ptr: first.ptr,
            count: parts.iter().map(|p| p.count).sum(),
            dtype: first.dtype,
        })
    }

    /// Whether the two tensors' bytes overlap.
    pub(crate) fn overlaps(&self, other: &Tensor) -> bool {
        let (a0, b0) = (self.ptr.0, other.ptr.0);
        let a1 = a0.saturating_add((self.count * self.dtype.size()) as u64);
        let b1 = b0.saturating_add((other.count * other.dtype.size()) as u64);
        a0 < b1 && b0 < a1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joined_takes_back_to_back_parts_only() {
        // SAFETY: never dereferenced; only addresses are compared.
        let t = |p: u64, n: usize, d: DType| unsafe { Tensor::from_raw(p, n, d) };
        let whole = Tensor::joined(&[t(1000, 4, DType::F32), t(1016, 2, DType::F32)]).unwrap();
        assert_eq!(
            (whole.ptr(), whole.count(), whole.dtype()),
            (DevicePtr(1000), 6, DType::F32)
        );
        assert_eq!(Tensor::joined(&[t(1000, 4, DType::F32), t(1020, 2, DType::F32)]), None);
        assert_eq!(Tensor::joined(&[t(1016, 2, DType::F32), t(1000, 4, DType::F32)]), None);
        assert_eq!(Tensor::joined(&[t(1000, 4, DType::F32), t(1016, 8, DType::BF16)]), None);
        assert_eq!(Tensor::joined(&[]), None);
    }

    struct Fake(u64, usize);
    impl DeviceBuffer for Fake {
        fn ptr(&self) -> DevicePtr {
            DevicePtr(self.0)
        }
        fn len(&self) -> usize {
            self.1
        }
    }

    #[test]
    fn views_are_range_checked() {
        let b = Fake(0x1000, 64);
        assert_eq!(Tensor::of(&b, DType::F32).count(), 16);
        assert_eq!(Tensor::of(&b, DType::BF16).count(), 32);
        let v = Tensor::view(&b, DType::F16, 3, 30).unwrap();
        assert_eq!(v.ptr(), DevicePtr(0x1003));
        assert!(Tensor::view(&b, DType::F16, 6, 30).is_err());
        assert!(Tensor::view(&b, DType::F32, 0, usize::MAX).is_err());
        let s = v.slice(10, 5).unwrap();
        assert_eq!((s.ptr(), s.count()), (DevicePtr(0x1003 + 20), 5));
        assert!(v.slice(26, 5).is_err());
        assert!(v.reinterpret(DType::BF16).is_ok());
        assert!(v.reinterpret(DType::F32).is_err());
        assert!(v.overlaps(&s) && !Tensor::view(&b, DType::U8, 0, 3).unwrap().overlaps(&s));
    }
}
