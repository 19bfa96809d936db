//! The worker's command line: a scenario, then its flags.

use std::time::Duration;

use ferrocomm::{Error, Result};

const USAGE: &str = "usage: ferrocomm-worker <scenario> [--backend B] [--victim R] [--timeout-secs S] [--max-bytes N] \
                     [--coll all_reduce|all_gather|reduce_scatter|all_to_all|sendrecv|broadcast|reduce] [--writer R]";

pub struct Args {
    pub scenario: String,
    pub backend: String,
    pub victim: usize,
    pub timeout: Duration,
    pub max_bytes: usize,
    pub replays: usize,
    /// Compute capability for `precompile-cuda`.
    pub cc: (i32, i32),
    /// The collective `kill`, `stall` and `mismatch` run.
    pub coll: String,
    /// The broadcaster scenarios' writer rank.
    pub writer: usize,
}

pub fn parse_args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let scenario = it.next().ok_or_else(|| Error::invalid(USAGE))?;
    let mut a = Args {
        scenario,
        backend: "host".into(),
        victim: 1,
        timeout: Duration::from_secs(3),
        max_bytes: 64 << 20,
        replays: 10_000,
        cc: (9, 0),
        coll: "all_reduce".into(),
        writer: 0,
    };
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| Error::invalid(format!("{flag} needs a value")))?;
        let bad = || Error::invalid(format!("bad value {value:?} for {flag}"));
        match flag.as_str() {
            "--backend" => a.backend = value.clone(),
            "--victim" => a.victim = value.parse().map_err(|_| bad())?,
            "--timeout-secs" => a.timeout = Duration::from_secs_f64(value.parse().map_err(|_| bad())?),
            "--max-bytes" => a.max_bytes = value.parse().map_err(|_| bad())?,
            "--replays" => a.replays = value.parse().map_err(|_| bad())?,
            "--coll" => a.coll = value.clone(),
            "--writer" => a.writer = value.parse().map_err(|_| bad())?,
            "--cc" => {
                let (major, minor) = value.split_once('.').ok_or_else(bad)?;
                a.cc = (major.parse().map_err(|_| bad())?, minor.parse().map_err(|_| bad())?);
            }
            _ => return Err(Error::invalid(format!("unknown flag {flag}"))),
        }
    }
    Ok(a)
}
