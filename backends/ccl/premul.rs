//! Reductions as NCCL takes them, and premul_sum's dynamic op: created on
//! the communicator for one call, with the factor rounded as ferrocomm's own
//! kernels round it, and destroyed once that call is queued.

use std::ffi::{c_int, c_void};

use super::codes::{builtin_op, nccl_dtype};
use super::comm::CclComm;
use super::ffi::{self, RawComm, NCCL_SUCCESS};
use crate::device::DevicePtr;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// A reduction as NCCL takes it: a built-in op, or premul_sum with its factor.
#[derive(Debug, Clone, Copy)]
pub enum CclReduction {
    Op(ReduceOp),
    /// The factor as a host value (converted to the call's dtype).
    PreMulHost(f64),
    /// The address of the factor, one element of the call's dtype, in device memory.
    PreMulDevice(DevicePtr),
}

/// A dynamic premul_sum op, destroyed on drop.
pub(super) struct DynOp<'a> {
    comm: &'a CclComm,
    raw: RawComm,
    op: c_int,
}

impl Drop for DynOp<'_> {
    fn drop(&mut self) {
        if let Some(destroy) = self.comm.lib.api.red_op_destroy {
            // SAFETY: an op created on this communicator, destroyed once, after
            // the collective that uses it was queued (NCCL allows that).
            let _ = unsafe { destroy(self.op, self.raw) };
        }
    }
}

/// A host factor as bytes of `dtype` (what `ncclScalarHostImmediate` reads),
/// converted as the kernels take it: to f32 first (`KernelParams::scalar`),
/// then rounded to nearest even into a half type.
pub(super) fn factor_bytes(f: f64, dtype: DType) -> Result<[u8; 8]> {
    let mut out = [0u8; 8];
    let single = f as f32;
    match dtype {
        DType::F32 => out[..4].copy_from_slice(&single.to_le_bytes()),
        DType::F64 => out.copy_from_slice(&f.to_le_bytes()),
        DType::F16 => out[..2].copy_from_slice(&half::f16::from_f32(single).to_bits().to_le_bytes()),
        DType::BF16 => out[..2].copy_from_slice(&half::bf16::from_f32(single).to_bits().to_le_bytes()),
        other => return Err(Error::invalid(format!("premul_sum takes a float dtype, not {other}"))),
    }
    Ok(out)
}

impl CclComm {
    /// The op of a reduction, and for premul_sum the dynamic op that must
    /// outlive the call (destroyed when dropped, after the call is queued).
    pub(super) fn op_for<'a>(
        &'a self,
        comm: RawComm,
        red: CclReduction,
        dtype: DType,
    ) -> Result<(c_int, Option<DynOp<'a>>)> {
        let (factor, residence) = match red {
            CclReduction::Op(op) => return Ok((builtin_op(dtype, op)?, None)),
            CclReduction::PreMulHost(f) => (Some(factor_bytes(f, dtype)?), ffi::SCALAR_HOST_IMMEDIATE),
            CclReduction::PreMulDevice(_) => (None, ffi::SCALAR_DEVICE),
        };
        let create = self.lib.api.red_op_create_premul_sum.ok_or_else(|| {
            Error::Unsupported(format!(
                "{} {} has no ncclRedOpCreatePreMulSum (premul_sum needs NCCL 2.11+)",
                self.lib.flavor.name(),
                self.lib.version
            ))
        })?;
        let mut bytes = factor.unwrap_or([0; 8]);
        let scalar = match red {
            CclReduction::PreMulDevice(p) => p.0 as *mut c_void,
            _ => bytes.as_mut_ptr() as *mut c_void,
        };
        let mut op: c_int = 0;
        // SAFETY: valid out-pointer; `scalar` is a host value of `dtype` that
        // lives across the call (NCCL copies it for HostImmediate) or a device
        // address the caller keeps alive; live communicator.
        let r = unsafe { create(&mut op, scalar, nccl_dtype(dtype), residence, comm) };
        if r != NCCL_SUCCESS {
            return Err(self.lib.error("ncclRedOpCreatePreMulSum", r, comm));
        }
        Ok((
            op,
            Some(DynOp {
                comm: self,
                raw: comm,
                op,
            }),
        ))
    }
}
