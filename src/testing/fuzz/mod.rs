//! A randomized differential fuzz of the public API, as an engine calls it.
//!
//! Every rank draws the same sequence of calls from one seed: the
//! collective, dtype, op, counts, root, splits, in place or not, the values.
//! What an engine decides per rank, each rank draws for itself: where its
//! operands live (ferrocomm's memory, its own, the symmetric heap), at which
//! byte offset, list tensors back to back or apart, which stream, and whether
//! it keeps the `Work` or drops it. Every operand sits between guard bytes;
//! after the call every output byte is compared with the reference (the
//! reduction rule of `docs/protocol.md`, checked against fp64 for random
//! floats), every guard byte and every read-only input is checked
//! unchanged, and at the end the ranks compare their outputs' hashes.
//!
//! `FERROCOMM_FUZZ_TRIALS`, `FERROCOMM_FUZZ_SEED` and
//! `FERROCOMM_FUZZ_MAX_BYTES` change the run; a failure names its trial, so
//! `FERROCOMM_FUZZ_FIRST` (the first trial) replays it.

mod draw;
mod memory;
mod reference;
mod trial;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::bootstrap::{store_all_gather, Store};
use crate::comm::Communicator;
use crate::device::Device;
use crate::error::{Error, Result};
use draw::{Local, Plan};
use memory::{Pools, GUARD};
use trial::{check, issue, Trial};

/// What one run covers.
#[derive(Debug, Clone)]
pub struct FuzzConfig {
    pub seed: u64,
    /// Trials `first..first + trials`.
    pub first: usize,
    pub trials: usize,
    /// Largest payload of one rank's operand.
    pub max_bytes: usize,
    /// Wait bound per call.
    pub timeout: Duration,
}

impl FuzzConfig {
    /// `trials` trials of up to `max_bytes`, unless the environment says
    /// otherwise.
    pub fn from_env(trials: usize, max_bytes: usize) -> FuzzConfig {
        let num = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<u64>().ok());
        FuzzConfig {
            seed: num("FERROCOMM_FUZZ_SEED").unwrap_or(0xf022),
            first: num("FERROCOMM_FUZZ_FIRST").unwrap_or(0) as usize,
            trials: num("FERROCOMM_FUZZ_TRIALS").map_or(trials, |t| t as usize),
            max_bytes: num("FERROCOMM_FUZZ_MAX_BYTES").map_or(max_bytes, |b| b as usize),
            timeout: Duration::from_secs(60),
        }
    }
}

/// What one rank saw.
#[derive(Debug, Default)]
pub struct FuzzReport {
    pub trials: usize,
    /// Output elements whose bits differ from the reference.
    pub wrong: usize,
    /// Guard bytes, gap bytes and read-only input bytes that changed.
    pub clobbered: usize,
    /// Trials whose outputs (which every rank must agree on) hashed
    /// differently on another rank.
    pub disagreements: usize,
    /// Errors from calls that should have succeeded.
    pub errors: Vec<String>,
    /// Calls refused up front, alike on every rank, as `Unsupported` (a
    /// premul_sum all-reduce on a GPU without NCCL/RCCL, say): listed, not
    /// failures.
    pub refused: Vec<String>,
    /// The first few failures, each naming its trial.
    pub failures: Vec<String>,
    /// Calls made, per collective.
    pub calls: BTreeMap<&'static str, usize>,
    /// Bytes read back and compared (outputs, inputs and guards).
    pub bytes_checked: usize,
}

impl FuzzReport {
    /// No wrong output, nothing clobbered, every rank agreeing and no
    /// error, over at least one trial.
    pub fn is_clean(&self) -> bool {
        self.wrong == 0 && self.clobbered == 0 && self.disagreements == 0 && self.errors.is_empty() && self.trials > 0
    }

    pub(super) fn fail(&mut self, what: String) {
        if self.failures.len() < 20 {
            self.failures.push(what);
        }
    }
}

/// Run the fuzz on this rank. Collective: every rank calls it with the same
/// config and store.
pub fn run_fuzz<D: Device>(comm: &Communicator<D>, store: &dyn Store, cfg: &FuzzConfig) -> Result<FuzzReport> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut report = FuzzReport::default();
    // Room for the largest operand (every one holds at most `max_bytes`),
    // with lists apart, an offset and guards.
    let slot = cfg.max_bytes + world * 128 + 4 * GUARD + 256;
    // The heap is collective: every rank tries it, and uses it only if
    // every rank got it.
    let heap_ok = comm.heap_alloc(64).map(drop);
    let all = store_all_gather(
        store,
        &format!("fuzz/{}/heap", comm.name()),
        rank,
        world,
        &[u8::from(heap_ok.is_ok())],
        cfg.timeout,
    )?;
    let heap = all.iter().all(|v| v.first() == Some(&1));
    let pools = Pools::new(comm, slot, heap)?;
    let streams = [comm.device().create_stream()?, comm.device().create_stream()?];
    let exact_random = !comm.has_vendor_library();
    let mut hashes = Vec::with_capacity(cfg.trials);
    for trial in cfg.first..cfg.first + cfg.trials {
        let plan = Plan::draw(cfg, trial, world);
        let local = Local::draw(cfg, trial, rank, plan.dtype, heap);
        let mut t = Trial {
            comm,
            plan: &plan,
            local,
            pools: &pools,
            streams: &streams,
            regions: Vec::new(),
            expect: Vec::new(),
        };
        *report.calls.entry(plan.coll.name()).or_default() += 1;
        let outcome = issue(&mut t).and_then(|work| match local.drop_work {
            false => work.wait(Some(cfg.timeout)),
            true => Ok(()),
        });
        if let Err(Error::Unsupported(why)) = &outcome {
            report
                .refused
                .push(format!("trial {trial} ({}): {why}", plan.describe(world)));
            report.trials += 1;
            hashes.push(0);
            continue;
        }
        if let Err(e) = outcome {
            let what = format!("rank {rank}, trial {trial} ({}): {e}", plan.describe(world));
            eprintln!("fuzz: {what}");
            report.errors.push(what);
            // A failed call may leave the communicator aborted: stop here.
            break;
        }
        let hash = check(&t, exact_random, trial, &mut report)?;
        hashes.push(hash);
        report.trials += 1;
    }
    // Every rank's outputs that must agree, trial by trial.
    let mine: Vec<u8> = hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
    let theirs = store_all_gather(
        store,
        &format!("fuzz/{}/hashes", comm.name()),
        rank,
        world,
        &mine,
        cfg.timeout,
    )?;
    for (peer, bytes) in theirs.iter().enumerate() {
        for (k, (a, b)) in mine.chunks_exact(8).zip(bytes.chunks_exact(8)).enumerate() {
            if a != b {
                report.disagreements += 1;
                report.fail(format!("trial {}: outputs differ from rank {peer}'s", cfg.first + k));
            }
        }
    }
    for s in &streams {
        comm.device().synchronize(s)?;
    }
    Ok(report)
}
