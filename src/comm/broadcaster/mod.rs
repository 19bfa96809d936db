//! A metadata broadcaster: one writer rank sends byte messages (scheduler
//! outputs, pickled objects) to every other rank, in order, the way
//! engines broadcast per-step metadata from their driver rank (vLLM's
//! `MessageQueue`).
//!
//! Readers on the writer's node take messages from a lock-free ring in
//! shared memory (`ring.rs`: `slots` slots of `max_bytes`, per-slot
//! written flags and per-reader read flags); a message larger than a slot
//! leaves a marker in its slot and follows on a TCP connection from the
//! writer (`socket.rs`), and readers on other nodes take every message
//! there. Every reader holds such a connection, so a process that dies is
//! seen by its peer as a hang-up. `docs/protocol.md`, "Metadata
//! broadcaster", has the layout, the orderings and the failure rules.
//!
//! Failure rules: every wait has a deadline (a call's timeout, else the
//! communicator's). A writer blocked by readers that fall behind fails
//! with [`Error::Timeout`] naming them, having published nothing (a retry
//! may succeed); a reader that closed or died fails the writer at once,
//! naming it. A reader whose writer closed or died fails once it has read
//! every message published before. A receive that runs out of time keeps
//! what it had and may be retried. Any other failure (a message half sent,
//! a broken stream) makes the broadcaster refuse further calls.

mod connect;
mod ring;
mod setup;
mod socket;
mod wait;
mod wire;

use std::io;
use std::net::TcpStream;
use std::time::Duration;

use ring::{RingReader, RingWriter, KIND_INLINE};
use setup::{ReaderParts, Setup, WriterParts};
use socket::{send_frame, Incoming, RecvFailure, SendFailure};
pub use wait::Interrupt;
use wait::{never, Step, Waiter};

use super::communicator::Communicator;
use crate::device::Device;
use crate::error::{Error, Result};

/// Ring slots when not told otherwise (vLLM's queue uses 6 to 10 chunks).
pub const DEFAULT_SLOTS: usize = 8;
/// How long a waiting rank spins before it sleeps, when not told otherwise:
/// long enough to catch back-to-back messages without a futex wake-up.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);
/// Most slots a ring may have.
pub const MAX_SLOTS: usize = 1 << 16;
/// Most bytes the slots of one ring may take together.
pub const MAX_RING_BYTES: usize = 1 << 34;

/// How a broadcaster is made; every rank must pass the same.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BroadcasterOptions {
    /// Bytes of one ring slot: messages up to this size travel through
    /// shared memory to readers on the writer's node; larger ones through
    /// the socket. Not a limit on message size.
    pub max_bytes: usize,
    /// The rank that sends (default 0).
    pub writer: usize,
    /// Slots of the ring: how far the writer may run ahead of the slowest
    /// reader on its node (default 8).
    pub slots: usize,
    /// How long a waiting rank spins before sleeping (default
    /// 100 us); engines that keep a core per rank busy anyway
    /// may raise it for lower latency after idle periods.
    pub spin: Duration,
}

impl BroadcasterOptions {
    /// Slots of `max_bytes`, writer 0, the default slots and spin.
    pub fn new(max_bytes: usize) -> Self {
        BroadcasterOptions {
            max_bytes,
            writer: 0,
            slots: DEFAULT_SLOTS,
            spin: DEFAULT_SPIN,
        }
    }

    /// The rank that sends.
    pub fn with_writer(mut self, writer: usize) -> Self {
        self.writer = writer;
        self
    }

    /// How many slots the ring has.
    pub fn with_slots(mut self, slots: usize) -> Self {
        self.slots = slots;
        self
    }

    /// How long a waiting rank spins before it sleeps.
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    fn check(&self, world: usize) -> Result<()> {
        if self.writer >= world {
            return Err(Error::invalid(format!(
                "broadcaster writer {} is not a rank of a world of {world}",
                self.writer
            )));
        }
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(Error::invalid(format!(
                "broadcaster slots = {}: must be 1 to {MAX_SLOTS}",
                self.slots
            )));
        }
        if self
            .max_bytes
            .checked_mul(self.slots)
            .is_none_or(|b| b > MAX_RING_BYTES)
        {
            return Err(Error::invalid(format!(
                "broadcaster ring of {} slots of {} bytes: more than {MAX_RING_BYTES} bytes in all",
                self.slots, self.max_bytes
            )));
        }
        Ok(())
    }
}

impl<D: Device> Communicator<D> {
    /// A broadcaster from rank 0 with slots of `max_bytes`: see
    /// [`Communicator::broadcaster_with`].
    pub fn broadcaster(&self, max_bytes: usize) -> Result<Broadcaster> {
        self.broadcaster_with(&BroadcasterOptions::new(max_bytes))
    }

    /// A broadcaster: on the writer rank one that sends, on every other
    /// rank one that receives. Collective: every rank calls it, with the
    /// same options, in the same order relative to the communicator's
    /// other setup steps (splits, registrations). It lives on after the
    /// communicator is finalized; dropping it closes it.
    pub fn broadcaster_with(&self, opts: &BroadcasterOptions) -> Result<Broadcaster> {
        drop(self.lock_active()?);
        let inner = &*self.inner;
        // The key first, so that ranks stay in step even when the options
        // are refused (alike on every rank that passed the same).
        let key = inner.next_key("bcast");
        opts.check(inner.world)?;
        let name = format!("{}.{}", inner.name, key.rsplit('/').next().unwrap_or("bcast"));
        let setup = Setup {
            store: inner.store.as_ref(),
            key: &key,
            name: &name,
            rank: inner.rank,
            world: inner.world,
            topology: &inner.topology,
            timeout: inner.opts.timeout,
            opts,
        };
        let role = if inner.rank == opts.writer {
            Role::Writer(setup.create_writer()?)
        } else {
            let ReaderParts { ring, conn } = setup.create_reader()?;
            Role::Reader(ReaderSide {
                ring,
                conn,
                incoming: Incoming::default(),
            })
        };
        crate::fc_log!(
            tracing::Level::DEBUG,
            "broadcaster {name} ready on rank {}: {}",
            inner.rank,
            describe(&role)
        );
        Ok(Broadcaster {
            name,
            rank: inner.rank,
            world: inner.world,
            opts: opts.clone(),
            timeout: inner.opts.timeout,
            next: 0,
            broken: None,
            role,
        })
    }
}

fn describe(role: &Role) -> String {
    match role {
        Role::Writer(w) => {
            let ring: Vec<usize> = w
                .ranks
                .iter()
                .zip(&w.on_ring)
                .filter(|(_, &on)| on)
                .map(|(&r, _)| r)
                .collect();
            let socket: Vec<usize> = w
                .ranks
                .iter()
                .zip(&w.on_ring)
                .filter(|(_, &on)| !on)
                .map(|(&r, _)| r)
                .collect();
            format!("writer; ring readers {ring:?}, socket readers {socket:?}")
        }
        Role::Reader(r) if r.ring.is_some() => "reader on the ring".into(),
        Role::Reader(_) => "reader on the socket".into(),
    }
}

enum Role {
    Writer(WriterParts),
    Reader(ReaderSide),
}

struct ReaderSide {
    ring: Option<RingReader>,
    conn: TcpStream,
    /// A socket frame being received, kept across a receive that timed out.
    incoming: Incoming,
}

/// One rank's end of a metadata broadcaster: the writer's sends, a
/// reader's receives. Made by [`Communicator::broadcaster`]; dropping it
/// closes this rank's end (and frees the shared memory with the last
/// mapping).
pub struct Broadcaster {
    name: String,
    rank: usize,
    world: usize,
    opts: BroadcasterOptions,
    timeout: Duration,
    /// The number of the next message to send or receive.
    next: u64,
    /// Why the broadcaster refuses further calls, after a failure that left
    /// it out of step with its peers.
    broken: Option<String>,
    role: Role,
}

impl std::fmt::Debug for Broadcaster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broadcaster")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("writer", &self.opts.writer)
            .field("role", &describe(&self.role))
            .field("messages", &self.next)
            .field("broken", &self.broken)
            .finish()
    }
}

/// How a send or receive failed: `Retry` leaves the broadcaster usable.
enum Failure {
    Retry(Error),
    Fatal(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Fatal(e)
    }
}

fn gone(context: String, kind: io::ErrorKind, why: &str) -> Error {
    Error::io(context, io::Error::new(kind, why.to_string()))
}

impl Broadcaster {
    /// The broadcaster's name (its communicator's, and a serial).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The communicator's ranks.
    pub fn size(&self) -> usize {
        self.world
    }

    /// The rank that sends.
    pub fn writer(&self) -> usize {
        self.opts.writer
    }

    /// Whether this rank is the writer.
    pub fn is_writer(&self) -> bool {
        matches!(self.role, Role::Writer(_))
    }

    /// Bytes of one ring slot (messages above it take the socket).
    pub fn max_bytes(&self) -> usize {
        self.opts.max_bytes
    }

    /// Slots of the ring.
    pub fn slots(&self) -> usize {
        self.opts.slots
    }

    /// Messages sent (writer) or received (reader) so far.
    pub fn messages(&self) -> u64 {
        self.next
    }

    /// Whether this rank uses the shared-memory ring: a writer with readers
    /// on its node, or a reader on the writer's node.
    pub fn uses_ring(&self) -> bool {
        match &self.role {
            Role::Writer(w) => w.ring.is_some(),
            Role::Reader(r) => r.ring.is_some(),
        }
    }

    /// Send `data` to every reader (writer only). Returns once the ring
    /// holds it and the socket readers' kernels have taken it; waits at
    /// most `timeout` (default: the communicator's) for readers that fall
    /// behind. See the module docs for what a failure leaves.
    pub fn send(&mut self, data: &[u8], timeout: Option<Duration>) -> Result<()> {
        self.send_interruptible(data, timeout, &mut never)
    }

    /// [`Broadcaster::send`], running `interrupt` every few milliseconds
    /// while it waits; its error ends the wait (as a timeout would: before
    /// anything was published nothing is lost, after, the broadcaster is
    /// broken).
    pub fn send_interruptible(
        &mut self,
        data: &[u8],
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<()> {
        self.usable()?;
        let timeout = timeout.unwrap_or(self.timeout);
        let m = self.next;
        let Role::Writer(w) = &mut self.role else {
            return Err(Error::invalid(format!(
                "broadcaster {}: rank {} is a reader; only writer rank {} sends",
                self.name, self.rank, self.opts.writer
            )));
        };
        let mut waiter = Waiter::new(timeout, self.opts.spin, interrupt);
        let outcome = send_message(w, &self.name, self.opts.slots, m, data, &mut waiter, timeout);
        self.settle(outcome)
    }

    /// Receive the next message (readers only), waiting at most `timeout`
    /// (default: the communicator's).
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.recv_into(&mut out, timeout)?;
        Ok(out)
    }

    /// [`Broadcaster::recv`] into `out` (replacing its contents; a message
    /// from the ring reuses its allocation).
    pub fn recv_into(&mut self, out: &mut Vec<u8>, timeout: Option<Duration>) -> Result<()> {
        self.recv_interruptible(out, timeout, &mut never)
    }

    /// [`Broadcaster::recv_into`], running `interrupt` every few
    /// milliseconds while it waits; its error ends the wait, and a later
    /// receive takes up the same message.
    pub fn recv_interruptible(
        &mut self,
        out: &mut Vec<u8>,
        timeout: Option<Duration>,
        interrupt: Interrupt<'_>,
    ) -> Result<()> {
        self.usable()?;
        let timeout = timeout.unwrap_or(self.timeout);
        let m = self.next;
        let writer = self.opts.writer;
        let Role::Reader(r) = &mut self.role else {
            return Err(Error::invalid(format!(
                "broadcaster {}: rank {} is the writer; it sends, the other ranks receive",
                self.name, self.rank
            )));
        };
        let mut waiter = Waiter::new(timeout, self.opts.spin, interrupt);
        let ctx = RecvCtx {
            name: &self.name,
            writer,
            m,
            timeout,
        };
        let outcome = match &r.ring {
            Some(ring) => ctx.take_from_ring(ring, &mut r.conn, &mut r.incoming, out, &mut waiter),
            None => ctx.take_from_socket(&mut r.conn, &mut r.incoming, out, &mut waiter),
        };
        self.settle(outcome)
    }

    fn usable(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(Error::Aborted(format!(
                "broadcaster {} is out of step with its peers after an earlier failure: {why}",
                self.name
            ))),
            None => Ok(()),
        }
    }

    /// Count a message done, or record a failure that breaks the broadcaster.
    fn settle(&mut self, outcome: std::result::Result<(), Failure>) -> Result<()> {
        match outcome {
            Ok(()) => {
                self.next += 1;
                Ok(())
            }
            Err(Failure::Retry(e)) => Err(e),
            Err(Failure::Fatal(e)) => {
                self.broken = Some(e.to_string());
                Err(e)
            }
        }
    }
}

/// The writer's send of message `m`.
fn send_message(
    w: &mut WriterParts,
    name: &str,
    slots: usize,
    m: u64,
    data: &[u8],
    waiter: &mut Waiter<'_>,
    timeout: Duration,
) -> std::result::Result<(), Failure> {
    let mut inline = true;
    if let Some(ring) = &w.ring {
        wait_for_slot(ring, w, name, slots, m, waiter, timeout)?;
        inline = data.len() <= ring.slot_bytes();
        ring.publish(m, data, inline);
    }
    // From here on the message is out on the ring: a failure leaves the
    // readers out of step, so it breaks the broadcaster.
    let targets: Vec<usize> = (0..w.conns.len()).filter(|&i| !w.on_ring[i] || !inline).collect();
    if targets.is_empty() {
        return Ok(());
    }
    let ranks: Vec<usize> = targets.iter().map(|&i| w.ranks[i]).collect();
    let mut streams: Vec<&mut TcpStream> = w
        .conns
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| targets.contains(i))
        .map(|(_, s)| s)
        .collect();
    let head = socket::header(m, data.len());
    send_frame(&mut streams, &head, data, waiter).map_err(|f| {
        Failure::Fatal(match f {
            SendFailure::Timeout(pending) => Error::Timeout {
                what: format!(
                    "{name}: reader ranks {:?} to take message #{m} ({} bytes) from the socket",
                    pending.iter().map(|&i| ranks[i]).collect::<Vec<_>>(),
                    data.len()
                ),
                after: timeout,
                missing: pending.iter().map(|&i| ranks[i]).collect(),
            },
            SendFailure::Gone(i, e) => Error::io(
                format!(
                    "{name}: sending message #{m} to reader rank {}, which closed its connection or died",
                    ranks[i]
                ),
                e,
            ),
            SendFailure::Other(e) => e,
        })
    })
}

/// Wait until every ring reader has read the message that used message
/// `m`'s slot a lap before.
fn wait_for_slot(
    ring: &RingWriter,
    w: &WriterParts,
    name: &str,
    slots: usize,
    m: u64,
    waiter: &mut Waiter<'_>,
    timeout: Duration,
) -> std::result::Result<(), Failure> {
    // Ring reader index -> its connection (readers on the ring, in rank order).
    let ring_conns: Vec<usize> = (0..w.conns.len()).filter(|&i| w.on_ring[i]).collect();
    let rank_of = |r: usize| w.ranks[ring_conns[r]];
    loop {
        // Loaded before the look at the flags: see `RingWriter::sleep`.
        let seen = ring.reads();
        let lagging = ring.lagging(m);
        if lagging.is_empty() {
            return Ok(());
        }
        if let Some(&r) = lagging.iter().find(|&&r| ring.reader_closed(r)) {
            return Err(Failure::Fatal(gone(
                format!("{name}: sending message #{m}"),
                io::ErrorKind::ConnectionAborted,
                &format!("reader rank {} closed its broadcaster with messages unread", rank_of(r)),
            )));
        }
        if waiter.expired() {
            let missing: Vec<usize> = lagging.iter().map(|&r| rank_of(r)).collect();
            return Err(Failure::Retry(Error::Timeout {
                what: format!(
                    "{name}: reader ranks {missing:?} to read message #{} (all {slots} ring slots are full; message \
                     #{m} was not sent)",
                    m - slots as u64
                ),
                after: timeout,
                missing,
            }));
        }
        match waiter.pause(|d| ring.sleep(seen, d)) {
            Ok(Step::Check) => {
                let streams: Vec<&TcpStream> = lagging.iter().map(|&r| &w.conns[ring_conns[r]]).collect();
                let hung = socket::hung_up(&streams).map_err(|e| Error::io(format!("{name}: polling readers"), e))?;
                if let Some(i) = hung.iter().position(|&h| h) {
                    return Err(Failure::Fatal(gone(
                        format!("{name}: sending message #{m}"),
                        io::ErrorKind::ConnectionReset,
                        &format!(
                            "reader rank {} closed its connection (its process died?)",
                            rank_of(lagging[i])
                        ),
                    )));
                }
            }
            Ok(Step::Again) => {}
            Err(e) => return Err(Failure::Retry(e)),
        }
    }
}

/// One receive's context.
struct RecvCtx<'a> {
    name: &'a str,
    writer: usize,
    m: u64,
    timeout: Duration,
}

impl RecvCtx<'_> {
    fn timed_out(&self) -> Failure {
        Failure::Retry(Error::Timeout {
            what: format!("{}: message #{} from writer rank {}", self.name, self.m, self.writer),
            after: self.timeout,
            missing: vec![self.writer],
        })
    }

    fn writer_gone(&self, why: &str) -> Failure {
        Failure::Fatal(gone(
            format!("{}: receiving message #{}", self.name, self.m),
            io::ErrorKind::ConnectionAborted,
            &format!("writer rank {} {why}", self.writer),
        ))
    }

    fn take_from_ring(
        &self,
        ring: &RingReader,
        conn: &mut TcpStream,
        incoming: &mut Incoming,
        out: &mut Vec<u8>,
        waiter: &mut Waiter<'_>,
    ) -> std::result::Result<(), Failure> {
        let m = self.m;
        let slot = loop {
            // Loaded before the look at the slot: see `RingReader::sleep`.
            let seen = ring.doorbell();
            if let Some(slot) = ring.poll(m)? {
                break slot;
            }
            // The writer published everything before it closed: a message
            // still missing now never comes.
            if ring.writer_closed() {
                match ring.poll(m)? {
                    Some(slot) => break slot,
                    None => return Err(self.writer_gone("closed the broadcaster")),
                }
            }
            if waiter.expired() {
                return Err(self.timed_out());
            }
            match waiter.pause(|d| ring.sleep(seen, d)) {
                Ok(Step::Check) => {
                    let hung = socket::writer_hung_up(conn)
                        .map_err(|e| Error::io(format!("{}: polling the writer", self.name), e))?;
                    if hung && ring.poll(m)?.is_none() {
                        return Err(self.writer_gone("closed its connection (its process died?)"));
                    }
                }
                Ok(Step::Again) => {}
                Err(e) => return Err(Failure::Retry(e)),
            }
        };
        if slot.kind == KIND_INLINE {
            ring.copy_out(m, slot.len, out);
        } else {
            let body = self.frame(conn, incoming, waiter)?;
            if body.len() != slot.len {
                return Err(Failure::Fatal(self.out_of_step(format!(
                    "the ring announced {} bytes, the socket brought {}",
                    slot.len,
                    body.len()
                ))));
            }
            *out = body;
        }
        ring.release(m);
        Ok(())
    }

    fn take_from_socket(
        &self,
        conn: &mut TcpStream,
        incoming: &mut Incoming,
        out: &mut Vec<u8>,
        waiter: &mut Waiter<'_>,
    ) -> std::result::Result<(), Failure> {
        *out = self.frame(conn, incoming, waiter)?;
        Ok(())
    }

    /// Message `m`'s frame from the socket.
    fn frame(
        &self,
        conn: &mut TcpStream,
        incoming: &mut Incoming,
        waiter: &mut Waiter<'_>,
    ) -> std::result::Result<Vec<u8>, Failure> {
        match incoming.recv(conn, waiter) {
            Ok((got, body)) if got == self.m => Ok(body),
            Ok((got, _)) => Err(Failure::Fatal(
                self.out_of_step(format!("the socket brought message #{got}")),
            )),
            Err(RecvFailure::Timeout) => Err(self.timed_out()),
            Err(RecvFailure::Closed(true)) => {
                Err(self.writer_gone("closed its connection (it closed the broadcaster or died)"))
            }
            Err(RecvFailure::Closed(false)) => {
                Err(self.writer_gone("closed its connection in the middle of the message (it died?)"))
            }
            Err(RecvFailure::Io(e)) => Err(Failure::Fatal(Error::io(
                format!(
                    "{}: receiving message #{} from writer rank {}",
                    self.name, self.m, self.writer
                ),
                e,
            ))),
            Err(RecvFailure::Other(e)) => Err(Failure::Retry(e)),
        }
    }

    fn out_of_step(&self, what: String) -> Error {
        gone(
            format!("{}: receiving message #{}", self.name, self.m),
            io::ErrorKind::InvalidData,
            &format!("out of step with writer rank {}: {what}", self.writer),
        )
    }
}
