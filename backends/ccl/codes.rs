//! ferrocomm's dtypes and reduction ops as the values of NCCL's C enums.

use std::ffi::c_int;

use super::ffi;
use crate::dtype::{check_supported, DType, ReduceOp};
use crate::error::{Error, Result};

/// `ncclDataType_t` for a ferrocomm dtype.
pub(super) fn nccl_dtype(dtype: DType) -> c_int {
    match dtype {
        DType::F32 => ffi::dtype::FLOAT32,
        DType::F16 => ffi::dtype::FLOAT16,
        DType::BF16 => ffi::dtype::BFLOAT16,
        DType::I32 => ffi::dtype::INT32,
        DType::I8 => ffi::dtype::INT8,
        DType::U8 => ffi::dtype::UINT8,
        DType::I64 => ffi::dtype::INT64,
        DType::F64 => ffi::dtype::FLOAT64,
        DType::F8E4M3 => ffi::dtype::FLOAT8E4M3,
        DType::F8E5M2 => ffi::dtype::FLOAT8E5M2,
    }
}

/// `ncclRedOp_t` for a ferrocomm op (NCCL orders max before min). NCCL has
/// no bitwise ops, and premul_sum is a per-call op it must create.
pub(super) fn nccl_op(op: ReduceOp) -> Result<c_int> {
    Ok(match op {
        ReduceOp::Sum => ffi::redop::SUM,
        ReduceOp::Prod => ffi::redop::PROD,
        ReduceOp::Min => ffi::redop::MIN,
        ReduceOp::Max => ffi::redop::MAX,
        ReduceOp::Avg => ffi::redop::AVG,
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor | ReduceOp::PreMulSum => {
            return Err(Error::Unsupported(format!("NCCL/RCCL have no {op} reduction")))
        }
    })
}

/// The `ncclRedOp_t` of a built-in reduction over `dtype`, once ferrocomm
/// has checked that it reduces that dtype with that op at all.
pub(super) fn builtin_op(dtype: DType, op: ReduceOp) -> Result<c_int> {
    check_supported(dtype, op)?;
    nccl_op(op)
}
