//! Creating a broadcaster, on every rank at once:
//!
//! 1. The writer binds a TCP listener, creates the ring (when ranks share
//!    its node) and publishes its record (port, addresses, a fresh secret,
//!    the ring's shape) in the store under the broadcaster's key.
//! 2. The ranks of the writer's node pass the ring's memfd over the fd
//!    exchange (`device::fd_exchange`): the writer offers it, its readers
//!    offer nothing.
//! 3. Every reader (ring readers too: their large messages and the
//!    writer's liveness go through it) connects, presents its rank and the
//!    secret, and waits; once all are in, the writer answers READY.
//!
//! Every step is bounded by one deadline (the communicator's timeout); a
//! rank that fails drops what it made, and its peers' waits fail too.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

use super::connect::{accept_readers, connect_writer, listen, reachable_addrs, send_ready};
use super::ring::{Geometry, RingReader, RingWriter};
use super::wait::{never, Waiter};
use super::wire::Record;
use super::BroadcasterOptions;
use crate::bootstrap::Store;
use crate::comm::Topology;
use crate::device::fd_exchange::{exchange_fds, random_bytes};
use crate::error::{Error, Result};

/// Who takes part, and how.
pub(super) struct Setup<'a> {
    pub(super) store: &'a dyn Store,
    pub(super) key: &'a str,
    pub(super) name: &'a str,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) topology: &'a Topology,
    pub(super) timeout: Duration,
    pub(super) opts: &'a BroadcasterOptions,
}

/// The writer's side once set up.
pub(super) struct WriterParts {
    pub(super) ring: Option<RingWriter>,
    /// Every reader's connection, in rank order, and its rank.
    pub(super) conns: Vec<TcpStream>,
    pub(super) ranks: Vec<usize>,
    /// Whether each reader (as in `conns`) reads the ring.
    pub(super) on_ring: Vec<bool>,
}

/// A reader's side once set up.
pub(super) struct ReaderParts {
    pub(super) ring: Option<RingReader>,
    pub(super) conn: TcpStream,
}

impl Setup<'_> {
    fn writer(&self) -> usize {
        self.opts.writer
    }

    fn record_key(&self) -> String {
        format!("{}/writer", self.key)
    }

    /// The ranks on the writer's node, the writer included, in rank order.
    fn ring_group(&self) -> Vec<usize> {
        let node = self.topology.node_of(self.writer()).unwrap_or(0);
        self.topology.ranks_on(node)
    }

    /// Whether every rank runs on this host (one node, or pseudo-nodes).
    fn one_host(&self) -> bool {
        self.topology.nodes == 1 || self.topology.pseudo
    }

    fn geometry(&self, readers: usize) -> Geometry {
        Geometry {
            slots: self.opts.slots,
            slot_bytes: self.opts.max_bytes,
            readers,
        }
    }

    pub(super) fn create_writer(&self) -> Result<WriterParts> {
        let writer = self.writer();
        let readers: Vec<usize> = (0..self.world).filter(|&r| r != writer).collect();
        let group = self.ring_group();
        let ring_readers = group.len().saturating_sub(1);
        if readers.is_empty() {
            return Ok(WriterParts {
                ring: None,
                conns: Vec::new(),
                ranks: Vec::new(),
                on_ring: Vec::new(),
            });
        }
        let listener = listen(self.one_host())?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::io(format!("{}: the listener's address", self.name), e))?
            .port();
        let ring = match ring_readers {
            0 => None,
            n => Some(RingWriter::create(self.geometry(n))?),
        };
        let record = Record {
            writer,
            slots: self.opts.slots,
            slot_bytes: self.opts.max_bytes,
            port,
            secret: random_bytes()?,
            addrs: if self.one_host() {
                Vec::new()
            } else {
                reachable_addrs(&listener)?
            },
        };
        let mut no_interrupt = never;
        let mut waiter = Waiter::new(self.timeout, self.opts.spin, &mut no_interrupt);
        self.store.set(&self.record_key(), &record.encode())?;
        let connected = (|| {
            if let Some(ring) = &ring {
                let me = group.iter().position(|&r| r == writer).unwrap_or(0);
                let key = format!("{}/ring", self.key);
                exchange_fds(self.store, &key, me, group.len(), &[ring.fd()], waiter.left())?;
            }
            let mut conns = accept_readers(
                &listener,
                &record.secret,
                &readers,
                self.name,
                &mut waiter,
                self.timeout,
            )?;
            send_ready(&mut conns, &readers, self.name)?;
            Ok(conns)
        })();
        // Every reader has read the record once all are connected; on
        // failure it is of no use either. Best effort: a failed delete
        // must not fail a good setup.
        let _ = self.store.delete(&self.record_key());
        let conns = connected?;
        let on_ring = readers.iter().map(|r| group.contains(r)).collect();
        Ok(WriterParts {
            ring,
            conns,
            ranks: readers,
            on_ring,
        })
    }

    pub(super) fn create_reader(&self) -> Result<ReaderParts> {
        let writer = self.writer();
        let mut no_interrupt = never;
        let mut waiter = Waiter::new(self.timeout, self.opts.spin, &mut no_interrupt);
        let key = self.record_key();
        let bytes = self.store.get(&key, self.timeout).map_err(|e| match e {
            Error::Timeout { after, .. } => Error::Timeout {
                what: format!("{}: writer rank {writer} to publish its address", self.name),
                after,
                missing: vec![writer],
            },
            other => other,
        })?;
        let record = Record::decode(&bytes)
            .ok_or_else(|| Error::Store(format!("{}: malformed writer record at {key}", self.name)))?;
        let theirs = (record.writer, record.slots, record.slot_bytes);
        let ours = (writer, self.opts.slots, self.opts.max_bytes);
        if theirs != ours {
            return Err(Error::Mismatch {
                rank: self.rank,
                peer: record.writer,
                detail: format!(
                    "{}: (writer, slots, max_bytes) is {theirs:?} on the writer, {ours:?} here (every rank must \
                     create the broadcaster alike)",
                    self.name
                ),
            });
        }
        let group = self.ring_group();
        let ring = match group.iter().position(|&r| r == self.rank) {
            Some(me) => {
                let key = format!("{}/ring", self.key);
                let no: [std::os::fd::BorrowedFd<'_>; 0] = [];
                let mut fds = exchange_fds(self.store, &key, me, group.len(), &no, waiter.left())?;
                let w = group.iter().position(|&r| r == writer).unwrap_or(0);
                let fd = fds.get_mut(w).and_then(|v| v.pop()).ok_or_else(|| {
                    Error::Store(format!("{}: writer rank {writer} passed no ring descriptor", self.name))
                })?;
                // Readers are numbered among the node's ranks without the writer.
                let index = group.iter().filter(|&&r| r != writer && r < self.rank).count();
                Some(RingReader::open(fd, self.geometry(group.len() - 1), index)?)
            }
            None => None,
        };
        let addrs: Vec<SocketAddr> = if ring.is_some() || self.one_host() {
            vec![
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), record.port),
                SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), record.port),
            ]
        } else {
            record
                .addrs
                .iter()
                .map(|&ip| SocketAddr::new(ip, record.port))
                .collect()
        };
        if addrs.is_empty() {
            return Err(Error::Unsupported(format!(
                "{}: writer rank {writer} has no network interface that ranks on other hosts could reach",
                self.name
            )));
        }
        let conn = connect_writer(&addrs, &record, self.rank, self.name, &mut waiter, self.timeout)?;
        Ok(ReaderParts { ring, conn })
    }
}
