//! Barrier and all-gather over a [`Store`], used during bootstrap before any
//! device transport exists.
//!
//! Each call works under a caller-supplied prefix that must be unique per call
//! (e.g. `"comm3/init/barrier7"`). Every rank publishes `{prefix}/{rank}`, so
//! on a timeout the ranks whose key is absent are the ones that never arrived.
//! The last rank to leave deletes the call's keys, so repeated calls do not
//! fill the store up to its key limit.

use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

fn rank_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/{rank}")
}

fn check_rank(rank: usize, world: usize) -> Result<()> {
    if world == 0 || rank >= world {
        return Err(Error::invalid(format!("rank {rank} is not in a world of {world}")));
    }
    Ok(())
}

/// Ranks among `candidates` whose key under `prefix` is absent.
fn absent(store: &dyn Store, prefix: &str, candidates: impl Iterator<Item = usize>) -> Result<Vec<usize>> {
    let mut missing = Vec::new();
    for r in candidates {
        if !store.check(&rank_key(prefix, r))? {
            missing.push(r);
        }
    }
    Ok(missing)
}

/// Turn a store `get` timeout into one naming the ranks that never arrived.
fn with_missing(
    err: Error,
    what: impl FnOnce() -> String,
    timeout: Duration,
    missing: impl FnOnce() -> Result<Vec<usize>>,
) -> Error {
    match err {
        Error::Timeout { .. } => match missing() {
            Ok(missing) => Error::Timeout {
                what: what(),
                after: timeout,
                missing,
            },
            Err(e) => e,
        },
        other => other,
    }
}

/// Count this rank out of a call; the last one out removes `keys`.
fn leave(store: &dyn Store, prefix: &str, world: usize, extra: &[&str]) -> Result<()> {
    let left_key = format!("{prefix}/left");
    if store.add(&left_key, 1)? == world as i64 {
        for r in 0..world {
            store.delete(&rank_key(prefix, r))?;
        }
        for key in extra {
            store.delete(&format!("{prefix}/{key}"))?;
        }
        store.delete(&left_key)?;
    }
    Ok(())
}

/// Leave a store that rank `host` keeps open: every other rank publishes
/// its key under `key_prefix` as its last request and returns (an error
/// there is ignored: the host may close the store as soon as it sees the
/// key, before the answer comes back); the host waits until every other
/// rank's key is there, for up to `wait`, else [`Error::Timeout`] naming
/// the ranks that never left.
pub(crate) fn store_depart(
    store: &dyn Store,
    key_prefix: &str,
    rank: usize,
    world: usize,
    host: usize,
    wait: Duration,
) -> Result<()> {
    check_rank(rank, world)?;
    if rank != host {
        let _ = store.set(&rank_key(key_prefix, rank), b"1");
        return Ok(());
    }
    let start = Instant::now();
    let mut pending: Vec<usize> = (0..world).filter(|&r| r != host).collect();
    loop {
        pending = absent(store, key_prefix, pending.into_iter())?;
        if pending.is_empty() {
            return Ok(());
        }
        if start.elapsed() >= wait {
            return Err(Error::Timeout {
                what: format!("every rank to leave the store ('{key_prefix}') before it closes"),
                after: wait,
                missing: pending,
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Block until all `world` ranks have called `store_barrier` with `key_prefix`.
///
/// On timeout returns [`Error::Timeout`] whose `missing` lists the ranks that
/// never arrived.
pub fn store_barrier(store: &dyn Store, key_prefix: &str, rank: usize, world: usize, timeout: Duration) -> Result<()> {
    check_rank(rank, world)?;
    store.set(&rank_key(key_prefix, rank), b"1")?;
    // A counter, not a poll of every rank's key, keeps the traffic O(world).
    let arrived = store.add(&format!("{key_prefix}/arrived"), 1)?;
    if arrived > world as i64 {
        return Err(Error::Store(format!(
            "more than {world} ranks arrived at barrier '{key_prefix}': duplicate rank or wrong world size?"
        )));
    }
    let done_key = format!("{key_prefix}/done");
    if arrived == world as i64 {
        store.set(&done_key, b"1")?;
    }
    store.get(&done_key, timeout).map_err(|e| {
        with_missing(
            e,
            || format!("barrier '{key_prefix}'"),
            timeout,
            || absent(store, key_prefix, 0..world),
        )
    })?;
    leave(store, key_prefix, world, &["arrived", "done"])
}

/// Every rank contributes `value`; returns all ranks' values in rank order.
///
/// On timeout returns [`Error::Timeout`] whose `missing` lists the ranks
/// whose value never arrived.
pub fn store_all_gather(
    store: &dyn Store,
    key_prefix: &str,
    rank: usize,
    world: usize,
    value: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    check_rank(rank, world)?;
    store.set(&rank_key(key_prefix, rank), value)?;
    let start = Instant::now();
    let mut values = Vec::with_capacity(world);
    for r in 0..world {
        let left = timeout.saturating_sub(start.elapsed());
        let v = store.get(&rank_key(key_prefix, r), left).map_err(|e| {
            with_missing(
                e,
                || format!("all-gather '{key_prefix}'"),
                timeout,
                || absent(store, key_prefix, r..world),
            )
        })?;
        values.push(v);
    }
    leave(store, key_prefix, world, &[])?;
    Ok(values)
}
