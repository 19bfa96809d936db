//! What autotune chose for a communicator, and how (`Communicator::autotune_report`).

use std::path::PathBuf;
use std::time::Duration;

use crate::plan::{Collective, DtypeClass, Ladders};

/// Where a communicator's dispatch table came from.
#[derive(Debug, Clone, PartialEq)]
pub enum TuneSource {
    /// Measured at init (rank 0's timings), taking this long.
    Measured(Duration),
    /// Read from the cache file of an earlier measurement (rank 0's).
    Cached(PathBuf),
    /// Adopted from an earlier communicator of the same shape in this
    /// process (rank 0's), the cache directory being off.
    Remembered,
}

/// One measurement: a rank's median of one candidate at one size.
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    /// The collective measured.
    pub collective: Collective,
    /// The class measured (all-gather and all-to-all: narrow, for both).
    pub class: DtypeClass,
    /// The payload for all-reduce, bytes per peer for the others.
    pub bytes: usize,
    /// The candidate's name ([`Algorithm::name`](crate::Algorithm::name)).
    pub candidate: &'static str,
    /// The median time of one call, in microseconds.
    pub median_us: f64,
}

/// What autotune chose, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneReport {
    /// Where the table came from.
    pub source: TuneSource,
    /// The ladders in force for this communicator's world: per collective,
    /// per dtype class.
    pub table: Ladders,
    /// This rank's medians when measured (rank 0's chose the table; empty
    /// when read from the cache).
    pub timings: Vec<Timing>,
}

impl TuneReport {
    /// The table in force, one line per collective and dtype class (the
    /// cache file's format), for logs and benches.
    pub fn table_text(&self) -> String {
        crate::plan::table::encode(&self.table)
    }
}
