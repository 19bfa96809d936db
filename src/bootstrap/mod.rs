//! Bootstrap: how ranks find each other and swap small blobs (handles, ids)
//! before any device memory is shared.

mod admission;
mod collect;
mod env;
mod inproc;
mod private_file;
mod tcp;
mod torch_store;
mod torchrun;
mod wire;

pub use collect::{store_all_gather, store_barrier};
pub use env::{
    read_token_file, rendezvous, rendezvous_from_env, rendezvous_from_vars, EnvRendezvous, Launcher,
    DEFAULT_RENDEZVOUS_TIMEOUT,
};
pub use inproc::InProcStore;
pub use tcp::{TcpStore, TcpStoreConfig, TcpStoreServer};
pub use torch_store::TorchStoreClient;

use std::time::Duration;

use crate::error::Result;

/// A small key-value store shared by all ranks of a job.
pub trait Store: Send + Sync {
    /// Set `key` to `value`, replacing what it held.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Wait until `key` exists, then return its value. Errors with
    /// [`Error::Timeout`](crate::Error::Timeout) after `timeout`.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Atomically add `delta` to the integer at `key` (0 if absent); returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Whether `key` exists now.
    fn check(&self, key: &str) -> Result<bool>;
    /// Remove `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;
}
