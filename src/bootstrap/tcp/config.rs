//! What a store server is started with: its address, token, limits and
//! timeouts, checked before anything binds.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use crate::bootstrap::inproc::Limits;
use crate::error::{Error, Result};

/// Settings for [`TcpStoreServer::start`](super::TcpStoreServer::start).
#[derive(Clone)]
pub struct TcpStoreConfig {
    /// Address to listen on. Loopback unless the job spans hosts.
    pub bind_addr: IpAddr,
    /// Port to listen on; 0 picks a free one (see
    /// [`TcpStoreServer::local_addr`](super::TcpStoreServer::local_addr)).
    pub port: u16,
    /// Per-job secret every client must present. Must not be empty.
    pub token: Vec<u8>,
    /// Longest key accepted (default 1 KiB); a longer one closes the connection.
    pub max_key_bytes: usize,
    /// Longest value accepted (default 4 MiB); a longer one closes the connection.
    pub max_value_bytes: usize,
    /// Most keys held at once; a SET/ADD creating one more gets an error.
    pub max_keys: usize,
    /// Most authenticated connections served at once (default 1024); a client
    /// past it is answered BUSY. Handshakes in progress do not count.
    pub max_connections: usize,
    /// Most connections still in the handshake (default 64). When full, the
    /// oldest is dropped (answered BUSY) to admit the newcomer, so a flood of
    /// connections that never say hello cannot keep a prompt client out.
    pub max_pending_handshakes: usize,
    /// Time from accept to a complete hello (default 2 s). Clients send it at
    /// once, so only stalled or hostile peers hit this.
    pub handshake_timeout: Duration,
    /// Default for clients connecting to this server (used by rendezvous).
    pub connect_timeout: Duration,
    /// A connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// Time allowed for the rest of a frame once its first byte arrived;
    /// defeats half-open and slow-drip connections.
    pub io_timeout: Duration,
}

impl Default for TcpStoreConfig {
    fn default() -> Self {
        let limits = Limits::default();
        TcpStoreConfig {
            bind_addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            token: Vec::new(),
            max_key_bytes: limits.max_key_bytes,
            max_value_bytes: limits.max_value_bytes,
            max_keys: limits.max_keys,
            max_connections: 1024,
            max_pending_handshakes: 64,
            handshake_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(600),
            io_timeout: Duration::from_secs(10),
        }
    }
}

impl TcpStoreConfig {
    /// Defaults (loopback, ephemeral port) with the given token.
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        TcpStoreConfig {
            token: token.into(),
            ..Self::default()
        }
    }

    pub(super) fn validate(&self) -> Result<()> {
        if self.token.is_empty() {
            return Err(Error::invalid(
                "TcpStoreConfig.token is empty: the store needs a per-job random token",
            ));
        }
        if self.token.len() > usize::from(u16::MAX) {
            return Err(Error::invalid("TcpStoreConfig.token is longer than 65535 bytes"));
        }
        if self.io_timeout.is_zero() || self.idle_timeout.is_zero() || self.handshake_timeout.is_zero() {
            return Err(Error::invalid(
                "TcpStoreConfig io_timeout, idle_timeout and handshake_timeout must be non-zero",
            ));
        }
        if self.max_connections == 0 || self.max_pending_handshakes == 0 {
            return Err(Error::invalid(
                "TcpStoreConfig max_connections and max_pending_handshakes must be at least 1",
            ));
        }
        Ok(())
    }
}

// Hand-written so the token never lands in a log.
impl std::fmt::Debug for TcpStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreConfig")
            .field("bind_addr", &self.bind_addr)
            .field("port", &self.port)
            .field("token", &"<redacted>")
            .field("max_key_bytes", &self.max_key_bytes)
            .field("max_value_bytes", &self.max_value_bytes)
            .field("max_keys", &self.max_keys)
            .field("max_connections", &self.max_connections)
            .field("max_pending_handshakes", &self.max_pending_handshakes)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("io_timeout", &self.io_timeout)
            .finish()
    }
}
