//! Element types and reduction operators, and the rules every backend follows
//! when it reduces: accumulate in fp32 (i32 for i32) in rank order 0..n-1.

use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Element type of a collective's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DType {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
    I32 = 3,
}

impl DType {
    pub const ALL: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::I32];

    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
        }
    }

    pub const fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }

    /// Whether `op` is defined for this dtype. Integer prod and avg are left out:
    /// their overflow and rounding rules would be a promise nobody asked for.
    pub const fn supports(self, op: ReduceOp) -> bool {
        match self {
            DType::I32 => matches!(op, ReduceOp::Sum | ReduceOp::Min | ReduceOp::Max),
            _ => true,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Ok(DType::F32),
            "f16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "i32" | "int32" | "int" => Ok(DType::I32),
            _ => Err(Error::invalid(format!(
                "unknown dtype {s:?} (expected f32, f16, bf16 or i32)"
            ))),
        }
    }
}

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ReduceOp {
    Sum = 0,
    Prod = 1,
    Min = 2,
    Max = 3,
    Avg = 4,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "prod" | "product" => Ok(ReduceOp::Prod),
            "min" => Ok(ReduceOp::Min),
            "max" => Ok(ReduceOp::Max),
            "avg" | "mean" => Ok(ReduceOp::Avg),
            _ => Err(Error::invalid(format!(
                "unknown op {s:?} (expected sum, prod, min, max or avg)"
            ))),
        }
    }
}

/// A host-side element type. The accumulator rules here are the reference that
/// every kernel (host, CUDA, HIP) must match bit for bit.
pub trait Element: Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    const DTYPE: DType;
    /// Accumulator: f32 for floating types, i32 (wrapping) for i32.
    type Acc: Copy;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(acc: Self::Acc) -> Self;
    /// `acc = acc (op) x`, for sum/prod/min/max (avg accumulates as sum).
    fn combine(op: ReduceOp, acc: Self::Acc, x: Self::Acc) -> Self::Acc;
    /// Final step for avg: divide by the world size.
    fn finish(op: ReduceOp, acc: Self::Acc, world: usize) -> Self::Acc;
    fn to_bits_u64(self) -> u64;
}

#[inline(always)]
fn combine_f32(op: ReduceOp, acc: f32, x: f32) -> f32 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc + x,
        ReduceOp::Prod => acc * x,
        // f32::min/max return the non-NaN operand, like CUDA's fminf/fmaxf.
        ReduceOp::Min => acc.min(x),
        ReduceOp::Max => acc.max(x),
    }
}

#[inline(always)]
fn finish_f32(op: ReduceOp, acc: f32, world: usize) -> f32 {
    if op == ReduceOp::Avg {
        acc / world as f32
    } else {
        acc
    }
}

macro_rules! float_element {
    ($t:ty, $dt:expr, $to:expr, $from:expr, $bits:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            type Acc = f32;
            #[inline(always)]
            fn to_acc(self) -> f32 {
                $to(self)
            }
            #[inline(always)]
            fn from_acc(acc: f32) -> Self {
                $from(acc)
            }
            #[inline(always)]
            fn combine(op: ReduceOp, acc: f32, x: f32) -> f32 {
                combine_f32(op, acc, x)
            }
            #[inline(always)]
            fn finish(op: ReduceOp, acc: f32, world: usize) -> f32 {
                finish_f32(op, acc, world)
            }
            fn to_bits_u64(self) -> u64 {
                $bits(self) as u64
            }
        }
    };
}

float_element!(f32, DType::F32, |x: f32| x, |a: f32| a, f32::to_bits);
float_element!(f16, DType::F16, f16::to_f32, f16::from_f32, f16::to_bits);
float_element!(bf16, DType::BF16, bf16::to_f32, bf16::from_f32, bf16::to_bits);

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    type Acc = i32;
    #[inline(always)]
    fn to_acc(self) -> i32 {
        self
    }
    #[inline(always)]
    fn from_acc(acc: i32) -> Self {
        acc
    }
    #[inline(always)]
    fn combine(op: ReduceOp, acc: i32, x: i32) -> i32 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(x),
            ReduceOp::Prod => acc.wrapping_mul(x),
            ReduceOp::Min => acc.min(x),
            ReduceOp::Max => acc.max(x),
        }
    }
    #[inline(always)]
    fn finish(_op: ReduceOp, acc: i32, _world: usize) -> i32 {
        acc
    }
    fn to_bits_u64(self) -> u64 {
        self as u32 as u64
    }
}

/// Check that `op` is defined for `dtype`.
pub fn check_supported(dtype: DType, op: ReduceOp) -> Result<()> {
    if dtype.supports(op) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "op {op} is not supported for dtype {dtype} (i32 supports sum, min, max)"
        )))
    }
}
