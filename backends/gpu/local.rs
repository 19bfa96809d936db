//! Handles that come back to the process that exported them (ranks as
//! threads). Neither vendor opens its own IPC handles, so an address-based
//! handle of this process is served here: from the registry of this
//! process's exported allocations (the mapping then keeps the allocation
//! alive, as an IPC mapping keeps its memory), or, for caller memory, by
//! address once the runtime confirms the allocation is still there. The
//! importing device gets peer access to the exporting one.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use super::handle::ParsedHandle;
use super::vendor::Driver;
use crate::device::{BackendKind, DevicePtr};
use crate::error::{Error, Result};

/// Something a local mapping keeps alive.
pub type Keep = Arc<dyn Any + Send + Sync>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Exported allocations by (backend, address): their size and a weak owner.
type Registry = HashMap<(BackendKind, u64), (u64, Weak<dyn Any + Send + Sync>)>;

fn exports() -> &'static Mutex<Registry> {
    static EXPORTS: OnceLock<Mutex<Registry>> = OnceLock::new();
    EXPORTS.get_or_init(Default::default)
}

/// Remember an exported allocation of this process: `size` bytes at `addr`.
pub fn register(backend: BackendKind, addr: DevicePtr, size: usize, alloc: Weak<dyn Any + Send + Sync>) {
    lock(exports()).insert((backend, addr.0), (size as u64, alloc));
}

/// Forget `addr` when its allocation is gone (called from its `Drop`).
pub fn forget_if_dead(backend: BackendKind, addr: DevicePtr) {
    let mut exports = lock(exports());
    if exports
        .get(&(backend, addr.0))
        .is_some_and(|(_, w)| w.strong_count() == 0)
    {
        exports.remove(&(backend, addr.0));
    }
}

/// The registered allocation of `size` bytes at `addr`, if it is still alive.
fn registered(backend: BackendKind, addr: u64, size: u64) -> Option<Keep> {
    // The lock is released before the upgraded Arc can be dropped by the
    // caller: dropping the last owner runs the allocation's Drop, which locks.
    let entry = lock(exports()).get(&(backend, addr)).cloned();
    entry.filter(|(s, _)| *s == size).and_then(|(_, w)| w.upgrade())
}

/// What a handle of this process maps to: the address, and the allocation
/// kept alive for our own buffers.
pub fn resolve<V: Driver>(ctx: &V::Context, h: &ParsedHandle) -> Result<(DevicePtr, Option<Keep>)> {
    let gone = || {
        Error::invalid(format!(
            "{} IPC handle names an allocation of this process that is gone or was never exported",
            V::LABEL
        ))
    };
    let keep = if h.own {
        Some(registered(V::KIND, h.base, h.alloc_size).ok_or_else(gone)?)
    } else {
        // Caller memory: the caller keeps it alive; check it is still the
        // allocation that was exported.
        match V::address_range(ctx, DevicePtr(h.base))? {
            Some((base, size)) if base.0 == h.base && size as u64 == h.alloc_size => None,
            _ => return Err(gone()),
        }
    };
    enable_peer_access::<V>(ctx, h.exporter as usize)?;
    Ok((DevicePtr(h.base), keep))
}

/// Let `ctx`'s device reach `peer`'s memory, once per pair and process.
pub fn enable_peer_access<V: Driver>(ctx: &V::Context, peer: usize) -> Result<()> {
    static ENABLED: OnceLock<Mutex<HashSet<(BackendKind, usize, usize)>>> = OnceLock::new();
    let me = V::ordinal(ctx);
    let key = (V::KIND, me, peer);
    let enabled = ENABLED.get_or_init(Default::default);
    if me == peer || lock(enabled).contains(&key) {
        return Ok(());
    }
    if !V::can_access_peer(me, peer)? {
        return Err(Error::Unsupported(format!(
            "{} device {me} cannot access device {peer}'s memory (no NVLink/XGMI or PCIe peer-to-peer path)",
            V::LABEL
        )));
    }
    V::enable_peer_access(ctx, peer)?;
    lock(enabled).insert(key);
    Ok(())
}
