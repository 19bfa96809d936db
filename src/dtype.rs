//! Element types and reduction operators, and the rules every backend follows
//! when it reduces: accumulate in fp32 (i32 for i32) in rank order 0..n-1.

use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Element type of a collective's buffers.
///
/// Every collective moves every dtype. Reductions are defined for
/// [`DType::REDUCIBLE`] (see [`DType::supports`]): the new 8- and 64-bit
/// integer, f64 and FP8 types are for the data-moving collectives
/// (all-gather, all-to-all, broadcast, gather, scatter, send/recv).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DType {
    /// IEEE binary32.
    F32 = 0,
    /// IEEE binary16 (`half::f16`).
    F16 = 1,
    /// bfloat16 (`half::bf16`).
    BF16 = 2,
    /// 32-bit signed integer (reductions wrap).
    I32 = 3,
    /// 8-bit signed integer.
    I8 = 4,
    /// 8-bit unsigned integer.
    U8 = 5,
    /// 64-bit signed integer.
    I64 = 6,
    /// IEEE binary64.
    F64 = 7,
    /// FP8 e4m3 (OCP "fn" flavour on NVIDIA; the bits are only moved).
    F8E4M3 = 8,
    /// FP8 e5m2.
    F8E5M2 = 9,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I8,
        DType::U8,
        DType::I64,
        DType::F64,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// The dtype of a `#[repr(u32)]` code (as kernels receive it).
    pub fn from_code(code: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u32 == code)
    }

    /// The dtypes ferrocomm's kernels (and the host reference) reduce.
    pub const REDUCIBLE: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::I32];

    /// Bytes of one element.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The dtype's name as options, logs and `FromStr` spell it (`f32`,
    /// `bf16`, `f8e4m3`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I64 => "i64",
            DType::F64 => "f64",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// Whether the dtype is a floating-point type (FP8 included).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    /// Whether `op` is defined for this dtype: floats of
    /// [`DType::REDUCIBLE`] take sum, prod, min, max, avg and premul_sum;
    /// i32 takes sum, min, max and the bitwise ops. Integer prod and avg are
    /// left out: their overflow and rounding rules would be a promise nobody
    /// asked for. The other dtypes are not reduced.
    pub const fn supports(self, op: ReduceOp) -> bool {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => !op.is_bitwise(),
            DType::I32 => matches!(
                op,
                ReduceOp::Sum | ReduceOp::Min | ReduceOp::Max | ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor
            ),
            _ => false,
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
            "i8" | "int8" => Ok(DType::I8),
            "u8" | "uint8" => Ok(DType::U8),
            "i64" | "int64" | "long" => Ok(DType::I64),
            "f64" | "float64" | "double" => Ok(DType::F64),
            "f8e4m3" | "fp8e4m3" | "float8_e4m3fn" | "e4m3" => Ok(DType::F8E4M3),
            "f8e5m2" | "fp8e5m2" | "float8_e5m2" | "e5m2" => Ok(DType::F8E5M2),
            _ => Err(Error::invalid(format!(
                "unknown dtype {s:?} (expected f32, f16, bf16, i32, i8, u8, i64, f64, f8e4m3 or f8e5m2)"
            ))),
        }
    }
}

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ReduceOp {
    /// Sum.
    Sum = 0,
    /// Product (floats).
    Prod = 1,
    /// Minimum (a NaN loses to a number, as CUDA's `fminf`).
    Min = 2,
    /// Maximum (a NaN loses to a number, as CUDA's `fmaxf`).
    Max = 3,
    /// Sum divided by the number of ranks (floats).
    Avg = 4,
    /// Bitwise and (integers).
    BAnd = 5,
    /// Bitwise or (integers).
    BOr = 6,
    /// Bitwise exclusive or (integers).
    BXor = 7,
    /// Sum of every input multiplied by a factor first (floats). Outside the
    /// crate it cannot be named: a premul_sum is a
    /// [`Reduction::premul_sum`](crate::comm::Reduction::premul_sum) (or
    /// `premul_sum_device`), which carries its factor, so a call cannot
    /// forget it. [`crate::comm::Reduction::op`] reports it.
    #[non_exhaustive]
    PreMulSum = 8,
}

impl ReduceOp {
    /// The operators a call names by themselves (every one but premul_sum,
    /// which comes with its factor as a [`crate::comm::Reduction`]).
    pub const OPERATORS: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// Every op code the kernels know: the operators, then premul_sum.
    pub(crate) const ALL: [ReduceOp; 9] = {
        let mut all = [ReduceOp::PreMulSum; 9];
        let mut i = 0;
        while i < Self::OPERATORS.len() {
            all[i] = Self::OPERATORS[i];
            i += 1;
        }
        all
    };

    /// Bitwise and, or, xor (integers only). NCCL/RCCL have none of them.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }

    /// The operator's name as options, logs and `FromStr` spell it (`sum`,
    /// `band`, `premul_sum`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
            ReduceOp::PreMulSum => "premul_sum",
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
        match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "prod" | "product" => Ok(ReduceOp::Prod),
            "min" => Ok(ReduceOp::Min),
            "max" => Ok(ReduceOp::Max),
            "avg" | "mean" => Ok(ReduceOp::Avg),
            "band" | "and" => Ok(ReduceOp::BAnd),
            "bor" | "or" => Ok(ReduceOp::BOr),
            "bxor" | "xor" => Ok(ReduceOp::BXor),
            "premul_sum" | "premulsum" => Err(Error::invalid(
                "premul_sum needs its factor: pass Reduction::premul_sum(f) or Reduction::premul_sum_device(t)",
            )),
            _ => Err(Error::invalid(format!(
                "unknown op {s:?} (expected sum, prod, min, max, avg, band, bor or bxor)"
            ))),
        }
    }
}

testing_pub! {
    /// A host-side element type. The accumulator rules here are the reference that
    /// every kernel (host, CUDA, HIP) must match bit for bit.
    #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
    pub trait Element: Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
        /// The element's [`DType`].
        const DTYPE: DType;
        /// Accumulator: f32 for floating types, i32 (wrapping) for i32.
        type Acc: Copy;
        /// The element widened to its accumulator.
        fn to_acc(self) -> Self::Acc;
        /// An accumulator rounded (once) back to the element.
        fn from_acc(acc: Self::Acc) -> Self;
        /// `acc = acc (op) x`, for sum/prod/min/max and the bitwise ops (avg and
        /// premul_sum accumulate as sum; premul_sum's inputs are scaled first,
        /// see [`Element::premul`]).
        fn combine(op: ReduceOp, acc: Self::Acc, x: Self::Acc) -> Self::Acc;
        /// premul_sum's scaling of one input: `x * factor` in the accumulator.
        fn premul(x: Self::Acc, factor: f32) -> Self::Acc;
        /// Final step for avg: divide by the world size.
        fn finish(op: ReduceOp, acc: Self::Acc, world: usize) -> Self::Acc;
        /// The element's bits, zero-extended (bitwise comparisons).
        fn to_bits_u64(self) -> u64;
    }
}

// The reference rules: only the conformance harness and the tests run them.
#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
#[inline(always)]
fn combine_f32(op: ReduceOp, acc: f32, x: f32) -> f32 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum => acc + x,
        ReduceOp::Prod => acc * x,
        // f32::min/max return the non-NaN operand, like CUDA's fminf/fmaxf.
        ReduceOp::Min => acc.min(x),
        ReduceOp::Max => acc.max(x),
        // Not defined for floats (DType::supports); the bits would be arbitrary.
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => acc,
    }
}

#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
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
            fn premul(x: f32, factor: f32) -> f32 {
                x * factor
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
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum => acc.wrapping_add(x),
            ReduceOp::Prod => acc.wrapping_mul(x),
            ReduceOp::Min => acc.min(x),
            ReduceOp::Max => acc.max(x),
            ReduceOp::BAnd => acc & x,
            ReduceOp::BOr => acc | x,
            ReduceOp::BXor => acc ^ x,
        }
    }
    #[inline(always)]
    fn premul(x: i32, _factor: f32) -> i32 {
        x
    }
    #[inline(always)]
    fn finish(_op: ReduceOp, acc: i32, _world: usize) -> i32 {
        acc
    }
    fn to_bits_u64(self) -> u64 {
        self as u32 as u64
    }
}

testing_pub! {
    /// Check that `op` is defined for `dtype`.
    pub fn check_supported(dtype: DType, op: ReduceOp) -> Result<()> {
        if dtype.supports(op) {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "op {op} is not supported for dtype {dtype} (f32, f16 and bf16 reduce with sum, prod, min, max, \
                 avg and premul_sum; i32 with sum, min, max, band, bor and bxor; other dtypes are only moved)"
            )))
        }
    }
}
