//! Launching ranks as threads (in-process store) for tests and the bench.

use std::sync::Arc;

use crate::bootstrap::{InProcStore, Store};
use crate::error::{Error, Result};

/// Run `f(rank, world, store)` on `world` threads sharing one in-process store;
/// returns each rank's result in rank order.
pub fn run_thread_ranks<T, F>(world: usize, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(usize, usize, Arc<dyn Store>) -> Result<T> + Sync,
{
    let store: Arc<dyn Store> = InProcStore::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let store = store.clone();
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || f(rank, world, store))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(Error::Aborted(format!("rank {rank} thread panicked")))),
                Err(e) => Err(Error::io(format!("spawning rank {rank}"), e)),
            })
            .collect()
    })
}
