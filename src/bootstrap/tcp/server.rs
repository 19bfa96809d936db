//! The store server's lifecycle: bind, hand the listener to the admission
//! thread, and on drop stop every connection and join every thread.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use super::config::TcpStoreConfig;
use super::connections::Shared;
use crate::bootstrap::admission;
use crate::error::{Error, Result};

/// The store server. Runs on background threads until dropped; dropping it
/// closes every connection and joins every thread.
pub struct TcpStoreServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    accept_thread: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Bind `cfg.bind_addr:cfg.port` and start serving.
    pub fn start(cfg: TcpStoreConfig) -> Result<TcpStoreServer> {
        cfg.validate()?;
        let at = SocketAddr::new(cfg.bind_addr, cfg.port);
        let listener = TcpListener::bind(at).map_err(|e| Error::io(format!("binding the store to {at}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the store's bound address", e))?;
        admission::widen_backlog(&listener);
        // Non-blocking accept: the admission loop polls the listener together
        // with the pending handshakes.
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the store listener non-blocking", e))?;
        let shared = Arc::new(Shared::new(cfg));
        let for_thread = Arc::clone(&shared);
        let accept_thread = thread::Builder::new()
            .name("ferrocomm-store-accept".into())
            .spawn(move || admission::run(&for_thread, &listener))
            .map_err(|e| Error::io("spawning the store accept thread", e))?;
        Ok(TcpStoreServer {
            shared,
            local_addr,
            accept_thread: Some(accept_thread),
        })
    }

    /// The address the server listens on (with the real port when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// An address a client on this host can connect to: the bound one, with a
    /// wildcard bind mapped to loopback.
    pub fn connect_addr(&self) -> SocketAddr {
        let ip = match self.local_addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        SocketAddr::new(ip, self.local_addr.port())
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.shut_down();
        if let Some(handle) = self.accept_thread.take() {
            // The admission thread joins the connection threads before it exits.
            let _ = handle.join();
        }
    }
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}
