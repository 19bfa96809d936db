//! Plain arguments from Python (ranks, counts, offsets, shapes), checked
//! the one way: a bad value is an `InvalidArgument` (a `ValueError`) naming
//! the call. They arrive as `i64` rather than `usize`, since PyO3 would
//! answer a negative `usize` with an `OverflowError` that names nothing.

use ferrocomm::Error;
use pyo3::prelude::*;

use crate::errors::to_pyerr;

/// An `InvalidArgument` (a `ValueError`) saying `msg`.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    to_pyerr(Error::InvalidArgument(msg.into()))
}

/// A count, size or offset: `what` names the call and the argument.
pub fn count_arg(what: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value).map_err(|_| invalid(format!("{what} {value} is negative")))
}

/// A rank of a world of `world` (negative ones are out of range too).
pub fn rank_arg(what: &str, rank: i64, world: usize) -> PyResult<usize> {
    usize::try_from(rank)
        .ok()
        .filter(|r| *r < world)
        .ok_or_else(|| invalid(format!("{what}: rank {rank} is not in a world of {world}")))
}

/// Elements of `shape`: refused if a dimension is negative or the product overflows.
pub fn element_count(what: &str, shape: &[i64]) -> PyResult<usize> {
    shape.iter().try_fold(1usize, |n, &d| {
        usize::try_from(d)
            .ok()
            .and_then(|d| n.checked_mul(d))
            .ok_or_else(|| invalid(format!("{what}: shape {shape:?} is negative or overflows")))
    })
}
