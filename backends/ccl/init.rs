//! Creating a communicator: the unique id travels through the store, then
//! NCCL's init runs either blocking, on a thread of its own that the caller
//! waits for, or non-blocking and polled (see the module docs of [`super`]).

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::comm::CclComm;
use super::current::Current;
use super::ffi::{self, NcclResult, RawComm, UniqueId, NCCL_IN_PROGRESS, NCCL_SUCCESS, UNIQUE_ID_BYTES};
use super::library::CclLibrary;
use crate::bootstrap::Store;
use crate::error::{Error, Result};

impl CclComm {
    /// Create this rank's communicator. Collective: every rank calls it with
    /// the same `key_prefix` (unique per communicator) and `world`. Rank 0
    /// makes the unique id and publishes it at `{key_prefix}/ncclUniqueId`;
    /// the others wait for it up to `timeout`. Init itself is bounded by
    /// `timeout` when the library supports non-blocking init (see the module docs).
    ///
    /// The calling thread's current device is the one the communicator uses.
    pub fn init(
        lib: Arc<CclLibrary>,
        store: &dyn Store,
        key_prefix: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if world == 0 || rank >= world || world > c_int::MAX as usize {
            return Err(Error::invalid(format!(
                "{} communicator for rank {rank} of {world}",
                lib.flavor.name()
            )));
        }
        let start = Instant::now();
        let id = share_unique_id(&lib, store, key_prefix, rank, timeout)?;

        let nonblocking = lib.api.comm_init_rank_config.is_some()
            && std::env::var("FERROCOMM_NCCL_NONBLOCKING").is_ok_and(|v| v.trim() == "1");
        let deadline = start + timeout;
        if nonblocking {
            return nonblocking_init(lib, id, rank, world, timeout, deadline);
        }
        let raw = blocking_init(
            &lib,
            id,
            rank,
            world,
            deadline.saturating_duration_since(Instant::now()),
        )?;
        Ok(CclComm::adopt(lib, raw, rank, world, nonblocking, timeout))
    }
}

/// The communicator's unique id: rank 0 makes it and publishes it at
/// `{key_prefix}/ncclUniqueId`; the others wait for it up to `timeout`.
fn share_unique_id(
    lib: &CclLibrary,
    store: &dyn Store,
    key_prefix: &str,
    rank: usize,
    timeout: Duration,
) -> Result<UniqueId> {
    let key = format!("{key_prefix}/ncclUniqueId");
    let mut id = UniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    if rank == 0 {
        // SAFETY: valid out-pointer to a 128-byte ncclUniqueId.
        let r = unsafe { (lib.api.get_unique_id)(&mut id) };
        if r != NCCL_SUCCESS {
            return Err(lib.error("ncclGetUniqueId", r, std::ptr::null_mut()));
        }
        store.set(&key, &id.internal)?;
    } else {
        let bytes = store.get(&key, timeout)?;
        if bytes.len() != UNIQUE_ID_BYTES {
            return Err(Error::Store(format!(
                "{key} holds {} bytes, not a {UNIQUE_ID_BYTES}-byte unique id",
                bytes.len()
            )));
        }
        id.internal.copy_from_slice(&bytes);
    }
    Ok(id)
}

/// Create a non-blocking communicator and poll its init until it settles,
/// at most until `deadline`; one that fails is aborted.
fn nonblocking_init(
    lib: Arc<CclLibrary>,
    id: UniqueId,
    rank: usize,
    world: usize,
    timeout: Duration,
    deadline: Instant,
) -> Result<CclComm> {
    let mut raw: RawComm = std::ptr::null_mut();
    let mut config = ffi::Config::new(false);
    let init = lib
        .api
        .comm_init_rank_config
        .ok_or_else(|| Error::invalid("no ncclCommInitRankConfig"))?;
    // SAFETY: valid out-pointer, id by value, config points at a
    // live, NCCL_CONFIG_INITIALIZER-shaped struct for the call.
    let r = unsafe { init(&mut raw, world as c_int, id, rank as c_int, &mut config) };
    let comm = CclComm::adopt(lib, raw, rank, world, true, timeout);
    if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
        let err = comm.lib.error("ncclCommInitRank", r, raw);
        comm.abort_quietly();
        return Err(err);
    }
    if raw.is_null() {
        return Err(comm.lib.error("ncclCommInitRank", r, raw));
    }
    if let Err(e) = comm.wait_ready(raw, "ncclCommInitRank", r, deadline) {
        comm.abort_quietly();
        return Err(e);
    }
    Ok(comm)
}

/// A communicator pointer crossing from the init thread.
struct SendComm(RawComm);
// SAFETY: an ncclComm_t may be handed to another thread; it is used by one
// thread at a time (the caller, once init is done).
unsafe impl Send for SendComm {}

/// Create a blocking communicator on a thread of its own, with the caller's
/// current device, waiting for it at most `within`.
fn blocking_init(lib: &Arc<CclLibrary>, id: UniqueId, rank: usize, world: usize, within: Duration) -> Result<RawComm> {
    let current = Current::capture(lib.flavor);
    let (tx, rx) = std::sync::mpsc::channel::<(NcclResult, SendComm)>();
    let for_thread = lib.clone();
    std::thread::Builder::new()
        .name("ferrocomm-nccl-init".into())
        .spawn(move || {
            current.restore(for_thread.flavor);
            let mut raw: RawComm = std::ptr::null_mut();
            let r = match for_thread.api.comm_init_rank_config {
                Some(init) => {
                    let mut config = ffi::Config::new(true);
                    // SAFETY: valid out-pointer, id by value, config points at
                    // a live, NCCL_CONFIG_INITIALIZER-shaped struct for the call.
                    unsafe { init(&mut raw, world as c_int, id, rank as c_int, &mut config) }
                }
                // SAFETY: valid out-pointer, id by value.
                None => unsafe { (for_thread.api.comm_init_rank)(&mut raw, world as c_int, id, rank as c_int) },
            };
            // The caller may have given up (timeout); then the comm leaks, by design.
            let _ = tx.send((r, SendComm(raw)));
        })
        .map_err(|e| Error::io("spawning the NCCL init thread", e))?;
    match rx.recv_timeout(within) {
        Ok((r, SendComm(raw))) if r == NCCL_SUCCESS && !raw.is_null() => Ok(raw),
        Ok((r, SendComm(raw))) => {
            let err = lib.error("ncclCommInitRank", r, raw);
            if !raw.is_null() {
                // SAFETY: a communicator NCCL returned with an error; released once.
                let _ = unsafe { (lib.api.comm_abort)(raw) };
            }
            Err(err)
        }
        Err(_) => Err(Error::Timeout {
            what: format!(
                "{} communicator init of rank {rank} of {world} (a peer did not join)",
                lib.flavor.name()
            ),
            after: within,
            missing: Vec::new(),
        }),
    }
}
