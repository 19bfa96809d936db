//! What each rank's inputs hold, and what the outputs must: the reduction
//! rule of docs/protocol.md, and the fp64 sum for random floats.

use half::{bf16, f16};

use super::draw::{Op, Plan};
use crate::dtype::{DType, ReduceOp};
use crate::testing::data::{input_value, sum_error_bound, to_bytes, FromF64, Order};

/// The bytes of one rank's input for a trial: `count` elements of `dtype`.
pub(super) fn input_bytes(p: &Plan, rank: usize, count: usize) -> Vec<u8> {
    match p.dtype {
        DType::F32 => to_bytes(&elements::<f32>(p, rank, count)),
        DType::F16 => to_bytes(&elements::<f16>(p, rank, count)),
        DType::BF16 => to_bytes(&elements::<bf16>(p, rank, count)),
        DType::I32 => to_bytes(&elements::<i32>(p, rank, count)),
        dtype => (0..count * dtype.size())
            .map(|i| crate::testing::data::draw(p.data_seed, rank, i) as u8)
            .collect(),
    }
}

pub(super) fn elements<T: FromF64>(p: &Plan, rank: usize, count: usize) -> Vec<T> {
    (0..count)
        .map(|i| T::from_f64(input_value(p.data_seed, rank, i, p.reduce_op(), p.values)))
        .collect()
}

/// The reduction of element `i` of every rank's input, as bytes.
pub(super) fn reduced(p: &Plan, world: usize, first: usize, count: usize) -> Vec<u8> {
    pub(super) fn run<T: FromF64>(p: &Plan, world: usize, first: usize, count: usize) -> Vec<u8> {
        let order = Order::Flat(world);
        let x = |r: usize, i: usize| T::from_f64(input_value(p.data_seed, r, i, p.reduce_op(), p.values)).to_acc();
        let v: Vec<T> = (first..first + count)
            .map(|i| match p.op {
                Op::Plain(op) => order.combine::<T>(op, |r| x(r, i)),
                Op::PreMul => order.combine::<T>(ReduceOp::PreMulSum, |r| T::premul(x(r, i), p.factors[r] as f32)),
            })
            .collect();
        to_bytes(&v)
    }
    match p.dtype {
        DType::F32 => run::<f32>(p, world, first, count),
        DType::F16 => run::<f16>(p, world, first, count),
        DType::BF16 => run::<bf16>(p, world, first, count),
        _ => run::<i32>(p, world, first, count),
    }
}

/// Elements of `got` (output elements `first..`) further from the fp64 sum
/// than the rule's rounding allows (random float sums).
pub(super) fn fp64_misses(p: &Plan, world: usize, first: usize, got: &[u8]) -> usize {
    let es = p.dtype.size();
    let value = |b: &[u8]| -> f64 {
        match p.dtype {
            DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
            DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
            _ => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        }
    };
    let x = |r: usize, i: usize| -> f64 {
        let v = input_value(p.data_seed, r, i, p.reduce_op(), p.values);
        match p.dtype {
            DType::F32 => v as f32 as f64,
            DType::F16 => f16::from_f64(v).to_f64(),
            _ => bf16::from_f64(v).to_f64(),
        }
    };
    got.chunks_exact(es)
        .enumerate()
        .filter(|(k, b)| {
            let i = first + k;
            let scale = |r: usize| match p.op {
                Op::PreMul => p.factors[r],
                Op::Plain(ReduceOp::Avg) => 1.0 / world as f64,
                Op::Plain(_) => 1.0,
            };
            let exact: f64 = (0..world).map(|r| x(r, i) * scale(r)).sum();
            let abs: f64 = (0..world).map(|r| (x(r, i) * scale(r)).abs()).sum();
            (value(b) - exact).abs() > 2.0 * sum_error_bound(p.dtype, world, abs, exact)
        })
        .count()
}
