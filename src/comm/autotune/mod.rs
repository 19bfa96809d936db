//! Autotune at init: every rank of a new communicator times the candidate
//! algorithms of each collective that has more than one, per (collective,
//! size, dtype class), at a plan fixed before it runs; rank 0's medians pick
//! the fastest per size, and every rank adopts rank 0's table (so all ranks
//! dispatch alike). The result is cached on disk under a key of what it
//! depends on (device, arch, world, topology, slot size, the deterministic
//! option, driver and library versions), so later runs only read it.
//!
//! What is tuned, for this communicator's world (`DispatchTable::ladders`):
//! - all-reduce: ferrocomm's five kernels by payload, per dtype class
//!   (measured with bf16 and f32 sums);
//! - all-gather, reduce-scatter and all-to-all without splits: LL, inbox
//!   or NCCL/RCCL (the data kinds of [`Algorithm`]) by bytes per peer. Reduce-scatter per dtype
//!   class (bf16 and f32 sums); all-gather and all-to-all move bytes
//!   whatever the dtype, so one measurement (bf16) serves both classes.
//!
//! A candidate is measured only where it can run and may be chosen: LL up to
//! what its lines carry (and not where bandwidth rules), NCCL/RCCL only where
//! the library loaded, and never for a reduce-scatter of a deterministic
//! communicator (its sums are not the reference's bits). Each candidate is
//! forced per call (`Call::algo`, `Call::coll_algo`); dispatch then reads
//! the table, and explicit choices still win over it (`Call`'s docs).
//!
//! The plan is fixed before it runs: every rank runs the same collectives
//! (they are collectives: no rank may stop early on its own clock), from
//! what all ranks share and rank 0's deterministic option. It is sized to
//! take well under the 2 s budget on 2x H200 ([`plan`] counts the ops); the
//! report says how long it took, and a run past the budget is logged.
//!
//! On by default on GPUs, off on the host backend (the reference, whose
//! tests create hundreds of communicators); `FERROCOMM_AUTOTUNE=0|1` or
//! [`CommOptions::with_autotune`](super::CommOptions::with_autotune) decide.

mod cache;
mod measure;
#[cfg(test)]
mod tests;

use std::time::{Duration, Instant};

use super::communicator::Communicator;
use super::tuned::{Timing, TuneReport, TuneSource};
use crate::algo::layout::ll_capacity;
use crate::bootstrap::store_all_gather;
use crate::device::{BackendKind, Device};
use crate::error::{Error, Result};
use crate::plan::table::{decode, encode};
use crate::plan::Ladders;
use cache::{cache_key, fnv64, read_cached, remember, remembered, write_cached};
use measure::{measure, plan, table_from, PlanFacts};

/// The whole autotune budget at init (issue 15): logged when exceeded.
const BUDGET: Duration = Duration::from_secs(2);

/// Tune `comm`'s dispatch table. Collective over `comm`.
pub(crate) fn tune<D: Device>(comm: &Communicator<D>) -> Result<TuneReport> {
    let started = Instant::now();
    let inner = &*comm.inner;
    let key = cache_key(comm);
    let file = crate::cache::cache_dir().map(|d| d.join("autotune").join(format!("{:016x}.txt", fnv64(&key))));
    // Rank 0 decides: its cached table, or measure now (with its
    // deterministic option, so that every rank plans alike).
    let mine = match comm.rank() {
        0 => match &file {
            Some(f) => read_cached(f, &key),
            None => remembered(&key),
        }
        .map(|t| format!("cached\n{}", encode(&t))),
        _ => None,
    }
    .unwrap_or_else(|| format!("measure deterministic={}", u8::from(inner.opts.deterministic)));
    let decision = agree(comm, "decide", mine.as_bytes())?;
    if let Some(table) = decision.strip_prefix("cached\n") {
        return Ok(TuneReport {
            source: file.map_or(TuneSource::Remembered, TuneSource::Cached),
            table: decode(table)?,
            timings: Vec::new(),
        });
    }
    let deterministic = match decision.as_str() {
        "measure deterministic=1" => true,
        "measure deterministic=0" => false,
        other => return Err(Error::invalid(format!("autotune: rank 0 sent {other:?}"))),
    };
    let backend = inner.device.facts().backend;
    let (ll_room, vendor) = comm.with_resources(|r| {
        let room = r.ws.as_ref().map_or(0, |ws| ll_capacity(ws.slot_bytes(), inner.world));
        (room, r.vendor.available())
    })?;
    let facts = PlanFacts {
        backend,
        ll_room,
        vendor: vendor && backend != BackendKind::Host,
        deterministic,
    };
    let cases = plan(&facts);
    let measured = measure(comm, &cases)?;
    let world = inner.world.min(crate::device::MAX_RANKS);
    let defaults = Ladders::default_for(backend, world);
    let table = table_from(&measured, &defaults);
    let chosen = agree(comm, "table", encode(&table).as_bytes())?;
    let table = decode(&chosen)?;
    if file.is_none() {
        remember(&key, &table);
    }
    if comm.rank() == 0 {
        if let Some(f) = &file {
            if let Err(e) = write_cached(f, &key, &table) {
                crate::fc_log!(
                    tracing::Level::WARN,
                    "autotune: could not cache the table at {}: {e}",
                    f.display()
                );
            }
        }
    }
    let took = started.elapsed();
    if took > BUDGET {
        crate::fc_log!(
            tracing::Level::WARN,
            "autotune of communicator {} took {:.2} s, over its {} s budget ({} measurements)",
            inner.name,
            took.as_secs_f64(),
            BUDGET.as_secs(),
            measured.len()
        );
    }
    let timings = measured
        .into_iter()
        .map(|m| Timing {
            collective: m.coll,
            class: m.class,
            bytes: m.bytes,
            candidate: m.candidate.name(),
            median_us: m.us,
        })
        .collect();
    Ok(TuneReport {
        source: TuneSource::Measured(took),
        table,
        timings,
    })
}

/// Rank 0's `value`, as every rank receives it.
fn agree<D: Device>(comm: &Communicator<D>, what: &str, value: &[u8]) -> Result<String> {
    let inner = &*comm.inner;
    let key = inner.next_key(&format!("autotune-{what}"));
    let all = store_all_gather(
        inner.store.as_ref(),
        &key,
        inner.rank,
        inner.world,
        value,
        inner.opts.timeout,
    )?;
    String::from_utf8(all[0].clone()).map_err(|_| Error::invalid("autotune: rank 0 sent a table that is not text"))
}
