//! TCP store: a small authenticated key-value server run by rank 0, and the
//! client every rank uses. The wire format is [`protocol`]'s.
//!
//! On the server, [`super::admission`] takes each new connection through its
//! handshake; an authenticated one gets a thread of its own
//! ([`connections`]), and [`server`] starts and stops the whole. A client
//! ([`client`]) keeps a few connections, each opened by [`connect`].
//!
//! Connections still in the handshake live in a small pool of their own
//! (`max_pending_handshakes`, see [`super::admission`]) and cost no thread, so
//! a flood of connections that never authenticate cannot take the slots that
//! ranks need.

mod client;
mod config;
mod connect;
pub(super) mod connections;
pub(super) mod protocol;
mod server;

pub use client::TcpStore;
pub use config::TcpStoreConfig;
pub use server::TcpStoreServer;

use std::sync::{Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a plain insert/remove/push; a panic in
    // one cannot leave the data inconsistent, so poisoning is ignored.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
