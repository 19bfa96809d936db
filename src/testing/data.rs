//! Inputs drawn from (seed, rank, index) and the exact reference: the
//! reduction rule of `docs/protocol.md` applied on the host.

use std::sync::{Arc, Mutex, OnceLock};

use half::{bf16, f16};

use crate::dtype::{DType, Element, ReduceOp};

/// What kind of values a case feeds in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// Small integers (sums exact in every dtype) or powers of two (products exact).
    Exact,
    /// Roughly Gaussian floats, so rounding and order matter.
    Random,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A uniform u64 for (seed, rank, index).
pub fn draw(seed: u64, rank: usize, index: usize) -> u64 {
    splitmix(seed ^ splitmix((rank as u64) << 40 ^ index as u64))
}

/// The input value of `rank` at `index`, as f64 (before conversion to the dtype).
pub fn input_value(seed: u64, rank: usize, index: usize, op: ReduceOp, values: Values) -> f64 {
    let r = draw(seed, rank, index);
    match (values, op) {
        (Values::Exact, ReduceOp::Prod) => {
            // +-2^k, k in -2..=2: any product of 8 stays exact.
            let k = (r % 5) as i32 - 2;
            let sign = if r & 0x100 != 0 { -1.0 } else { 1.0 };
            sign * 2f64.powi(k)
        }
        (Values::Exact, _) => (r % 17) as f64 - 8.0,
        (Values::Random, _) => {
            // Sum of four 16-bit uniforms from one draw: cheap, roughly
            // Gaussian, mean 0, variance 1.
            let u = |k: u32| ((r >> (16 * k)) & 0xffff) as f64 / 65536.0;
            (u(0) + u(1) + u(2) + u(3) - 2.0) * 3f64.sqrt()
        }
    }
}

/// Host element conversion from the generator's f64.
pub trait FromF64: Element + Default {
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}
impl FromF64 for f32 {
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl FromF64 for f16 {
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}
impl FromF64 for bf16 {
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}
impl FromF64 for i32 {
    fn from_f64(v: f64) -> Self {
        v.round() as i32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

/// `rank`'s input: `count` elements starting at global index `first`.
pub fn make_input<T: FromF64>(
    seed: u64,
    rank: usize,
    first: usize,
    count: usize,
    op: ReduceOp,
    values: Values,
) -> Vec<T> {
    (first..first + count)
        .map(|i| T::from_f64(input_value(seed, rank, i, op, values)))
        .collect()
}

/// The order a reduction combines the ranks' values in, which fixes its
/// bits (floats round differently in another order).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Order {
    /// One level over `world` ranks: widened, combined in rank order 0..world,
    /// finished (avg), narrowed once (docs/protocol.md's rule).
    Flat(usize),
    /// Two levels (`src/comm/layered.rs`), `nodes[m]` the ranks of node `m`
    /// in local-rank order. Each node combines its ranks in that order and
    /// stores the partial as the dtype (the node level's reduce-scatter or
    /// all-reduce writes it to memory); then the nodes' partials, widened
    /// again, are combined in node order and narrowed (the between-nodes
    /// all-reduce or reduce-scatter). Avg is premul_sum by `1/world` (as
    /// f32) in the node level and a sum between nodes; premul_sum's factors
    /// apply in the node level only.
    Levels(Vec<Vec<usize>>),
}

impl Order {
    /// The ranks it combines.
    pub fn world(&self) -> usize {
        match self {
            Order::Flat(world) => *world,
            Order::Levels(nodes) => nodes.iter().map(Vec::len).sum(),
        }
    }

    /// One element's result: `term(r)` is rank `r`'s value widened to the
    /// accumulator (and already scaled by its own factor for premul_sum).
    pub fn combine<T: FromF64>(&self, op: ReduceOp, term: impl Fn(usize) -> T::Acc) -> T {
        match self {
            Order::Flat(world) => {
                let acc = (1..*world).fold(term(0), |acc, r| T::combine(op, acc, term(r)));
                T::from_acc(T::finish(op, acc, *world))
            }
            Order::Levels(nodes) => {
                let (first, rest) = match op {
                    // The node level's premul_sum by 1/world: the factor as
                    // the kernels get it (f64, then f32).
                    ReduceOp::Avg => (ReduceOp::PreMulSum, ReduceOp::Sum),
                    ReduceOp::PreMulSum => (ReduceOp::PreMulSum, ReduceOp::Sum),
                    other => (other, other),
                };
                let factor = (1.0 / self.world() as f64) as f32;
                let scaled = |r: usize| match op {
                    ReduceOp::Avg => T::premul(term(r), factor),
                    _ => term(r),
                };
                let partial = |ranks: &Vec<usize>| -> T {
                    let acc = ranks[1..]
                        .iter()
                        .fold(scaled(ranks[0]), |acc, &r| T::combine(first, acc, scaled(r)));
                    T::from_acc(T::finish(first, acc, ranks.len()))
                };
                let acc = nodes[1..].iter().fold(partial(&nodes[0]).to_acc(), |acc, ranks| {
                    T::combine(rest, acc, partial(ranks).to_acc())
                });
                T::from_acc(T::finish(rest, acc, nodes.len()))
            }
        }
    }
}

/// The exact expected output: the rule applied in rank order 0..world-1.
pub fn reference<T: FromF64>(
    seed: u64,
    world: usize,
    first: usize,
    count: usize,
    op: ReduceOp,
    values: Values,
) -> Vec<T> {
    reference_in(&Order::Flat(world), seed, first, count, op, values)
}

/// The exact expected output of a reduction that combines in `order`.
///
/// Every rank of a test asks for the same reference, and it costs `world`
/// draws per element, so thread ranks of one process share it: the last few
/// references are kept (by their arguments) and handed out again.
pub fn reference_in<T: FromF64>(
    order: &Order,
    seed: u64,
    first: usize,
    count: usize,
    op: ReduceOp,
    values: Values,
) -> Vec<T> {
    type Key = (DType, u64, Order, usize, usize, ReduceOp, Values);
    type Cell = Arc<OnceLock<Vec<u8>>>;
    static CACHE: Mutex<Vec<(Key, Cell)>> = Mutex::new(Vec::new());
    const KEEP: usize = 4;
    let key: Key = (T::DTYPE, seed, order.clone(), first, count, op, values);
    let cell = {
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        match cache.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                let hit = cache.remove(i);
                let cell = hit.1.clone();
                cache.push(hit);
                cell
            }
            None => {
                let cell = Arc::new(OnceLock::new());
                cache.push((key, cell.clone()));
                if cache.len() > KEEP {
                    cache.remove(0);
                }
                cell
            }
        }
    };
    // Computed outside the cache lock, once: other ranks asking for the same
    // key wait on the cell, not on the whole cache.
    let bytes = cell.get_or_init(|| {
        let v: Vec<T> = (first..first + count)
            .map(|i| order.combine::<T>(op, |r| T::from_f64(input_value(seed, r, i, op, values)).to_acc()))
            .collect();
        to_bytes(&v)
    });
    from_bytes(bytes)
}

/// Native-endian bytes of a slice of elements.
pub fn to_bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    let n = std::mem::size_of_val(v);
    let mut out = vec![0u8; n];
    // SAFETY: copying the plain bytes of `Copy` elements into a buffer of equal size.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, out.as_mut_ptr(), n) };
    out
}

/// Elements from native-endian bytes (length must be a multiple of the size).
pub fn from_bytes<T: Copy + Default>(b: &[u8]) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    let mut out = vec![T::default(); b.len() / size];
    // SAFETY: `out` has room for exactly `b.len() / size` elements, and every bit
    // pattern is a valid f32/f16/bf16/i32.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), out.as_mut_ptr() as *mut u8, out.len() * size) };
    out
}

/// A 64-bit hash of a byte slice (FNV-1a over 8-byte words, the length
/// mixed in), for comparing outputs across ranks cheaply. Not for keys that
/// must be stable across versions.
pub fn hash_bytes(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ b.len() as u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap_or([0; 8]))).wrapping_mul(0x0100_0000_01b3);
    }
    for &x in words.remainder() {
        h = (h ^ x as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Elements whose bits differ from the reference.
pub fn count_wrong<T: Element>(got: &[T], want: &[T]) -> usize {
    got.iter()
        .zip(want)
        .filter(|(g, w)| g.to_bits_u64() != w.to_bits_u64())
        .count()
        + got.len().abs_diff(want.len())
}

/// For float sums: the largest |out - exact| allowed against an fp64 reference:
/// fp32 accumulation error plus one rounding to the output type.
pub fn sum_error_bound(dtype: DType, world: usize, abs_sum: f64, exact: f64) -> f64 {
    let out_eps = match dtype {
        DType::F32 => f32::EPSILON as f64,
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        // Only the float dtypes above are summed with rounding.
        _ => 0.0,
    };
    world as f64 * f32::EPSILON as f64 * abs_sum + out_eps * exact.abs() + f64::MIN_POSITIVE
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two levels round each node's partial to the dtype: bf16 values whose
    /// node sums round away what the flat sum keeps.
    #[test]
    fn levels_round_each_node() {
        let x = [1.0f32, 2f32.powi(-8), 2f32.powi(-8), 0.0];
        let term = |r: usize| bf16::from_f32(x[r]).to_f32();
        let flat: bf16 = Order::Flat(4).combine(ReduceOp::Sum, term);
        let levels: bf16 = Order::Levels(vec![vec![0, 1], vec![2, 3]]).combine(ReduceOp::Sum, term);
        // Flat: 1 + 2^-8 + 2^-8 = 1 + 2^-7, exact in bf16. Levels: node 0's
        // 1 + 2^-8 is a tie, rounded to 1; plus node 1's 2^-8 ties again.
        assert_eq!(flat.to_f32(), 1.0 + 2f32.powi(-7));
        assert_eq!(levels.to_f32(), 1.0);
        // Nodes in node order, each node's ranks in local order.
        let other: bf16 = Order::Levels(vec![vec![0, 3], vec![1, 2]]).combine(ReduceOp::Sum, term);
        assert_eq!(other.to_f32(), 1.0 + 2f32.powi(-7));
    }

    /// Avg is premul_sum by 1/world (as f32) in the node level, then a sum.
    #[test]
    fn levels_average_as_premul_then_sum() {
        let x = [0.1f32, 0.7, 1.3, -2.9, 5.5, 0.01];
        let nodes = Order::Levels(vec![vec![0, 1], vec![2, 3], vec![4, 5]]);
        let got: f32 = nodes.combine(ReduceOp::Avg, |r| x[r]);
        let f = (1.0 / 6.0f64) as f32;
        let want = (x[0] * f + x[1] * f) + (x[2] * f + x[3] * f) + (x[4] * f + x[5] * f);
        assert_eq!(got.to_bits(), want.to_bits());
        let flat: f32 = Order::Flat(6).combine(ReduceOp::Avg, |r| x[r]);
        assert_eq!(flat.to_bits(), (x.iter().fold(0.0f32, |a, b| a + b) / 6.0).to_bits());
        assert_eq!(nodes.world(), 6);
    }
}
