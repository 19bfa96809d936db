//! Serving authenticated connections: the state the server's threads share,
//! the registry of live connections (so shutdown can unblock them), a thread
//! for each connection, and the requests it carries against the table.

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use super::config::TcpStoreConfig;
use super::lock;
use super::protocol::{millis, put_bytes, OP_ADD, OP_CHECK, OP_DELETE, OP_GET, OP_SET, ST_ERROR, ST_OK, ST_TIMEOUT};
use crate::bootstrap::inproc::{Limits, Lookup, Table};
use crate::bootstrap::wire::{invalid_data, Deadlined};
use crate::error::Error;

/// State shared by the admission thread, the connection threads and `Drop`.
pub(in crate::bootstrap) struct Shared {
    pub(in crate::bootstrap) cfg: TcpStoreConfig,
    table: Table,
    pub(in crate::bootstrap) stop: AtomicBool,
    conns: Mutex<Registry>,
}

/// Live authenticated connections, so shutdown can unblock their reads.
struct Registry {
    stopping: bool,
    next_id: u64,
    streams: HashMap<u64, TcpStream>,
}

/// Why an authenticated connection was not given a thread.
pub(in crate::bootstrap) enum Refusal {
    /// `max_connections` reached: tell the client to retry.
    Full,
    /// Shutting down, or the OS would not give us a thread or a handle.
    Gone,
}

impl Shared {
    /// Nothing stored, nobody connected yet.
    pub(super) fn new(cfg: TcpStoreConfig) -> Shared {
        let limits = Limits {
            max_key_bytes: cfg.max_key_bytes,
            max_value_bytes: cfg.max_value_bytes,
            max_keys: cfg.max_keys,
        };
        Shared {
            cfg,
            table: Table::new(limits),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Registry {
                stopping: false,
                next_id: 0,
                streams: HashMap::new(),
            }),
        }
    }

    /// Stop serving: raise `stop`, unblock every connection's read and close
    /// the table, so every thread winds down (the caller then joins them).
    pub(super) fn shut_down(&self) {
        self.stop.store(true, Ordering::SeqCst);
        {
            // Under the registry lock, so the admission thread cannot admit a
            // connection after this sweep.
            let mut reg = lock(&self.conns);
            reg.stopping = true;
            for stream in reg.streams.values() {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        self.table.close();
    }
}

/// Give an authenticated connection its own thread, which first sends the
/// handshake's `OK` answer. On refusal the stream is handed back so the
/// caller can answer BUSY.
pub(in crate::bootstrap) fn serve_authenticated(
    shared: &Arc<Shared>,
    stream: TcpStream,
) -> std::result::Result<JoinHandle<()>, (Refusal, Option<TcpStream>)> {
    let Ok(watch) = stream.try_clone() else {
        return Err((Refusal::Gone, None));
    };
    let id = {
        let mut reg = lock(&shared.conns);
        if reg.stopping {
            return Err((Refusal::Gone, None));
        }
        if reg.streams.len() >= shared.cfg.max_connections {
            return Err((Refusal::Full, Some(stream)));
        }
        let id = reg.next_id;
        reg.next_id += 1;
        reg.streams.insert(id, watch);
        id
    };
    let for_thread = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name("ferrocomm-store-conn".into())
        .spawn(move || {
            serve_connection(&for_thread, stream);
            lock(&for_thread.conns).streams.remove(&id);
        });
    spawned.map_err(|_| {
        lock(&shared.conns).streams.remove(&id);
        (Refusal::Gone, None)
    })
}

/// Serve one authenticated client until it leaves, misbehaves, idles out or
/// the server stops. Every exit path simply drops (closes) the stream.
fn serve_connection(shared: &Shared, mut stream: TcpStream) {
    // The admission loop left the socket non-blocking; from here on each
    // read and write is bounded by its own timeout instead.
    if stream.set_nonblocking(false).is_err()
        || stream.set_write_timeout(Some(shared.cfg.io_timeout)).is_err()
        || stream.write_all(&ok_reply(&shared.cfg)).is_err()
    {
        return;
    }
    while !shared.stop.load(Ordering::SeqCst) {
        let op = match Deadlined::new(&mut stream, shared.cfg.idle_timeout).u8() {
            Ok(op) => op,
            Err(_) => return,
        };
        let request = match read_request(shared, &mut stream, op) {
            Ok(request) => request,
            Err(_) => return,
        };
        let reply = execute(&shared.table, request);
        if stream.write_all(&reply).is_err() {
            return;
        }
    }
}

/// The handshake's `OK` answer: the limits the client must respect.
fn ok_reply(cfg: &TcpStoreConfig) -> Vec<u8> {
    let mut reply = vec![ST_OK];
    let cap = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    reply.extend_from_slice(&cap(cfg.max_key_bytes).to_le_bytes());
    reply.extend_from_slice(&cap(cfg.max_value_bytes).to_le_bytes());
    reply.extend_from_slice(&millis(cfg.idle_timeout).to_le_bytes());
    reply
}

enum Request {
    Set(String, Vec<u8>),
    Get(String, Duration),
    Add(String, i64),
    Check(String),
    Delete(String),
}

/// Read the rest of a request whose op byte has arrived; the whole frame must
/// arrive within `io_timeout`. Any error means the connection is closed.
fn read_request(shared: &Shared, stream: &mut TcpStream, op: u8) -> io::Result<Request> {
    if !(OP_SET..=OP_DELETE).contains(&op) {
        return Err(invalid_data("unknown op"));
    }
    let mut rd = Deadlined::new(stream, shared.cfg.io_timeout);
    let key = rd.bytes(shared.cfg.max_key_bytes)?;
    let key = String::from_utf8(key).map_err(|_| invalid_data("key is not UTF-8"))?;
    // Only SET carries a value; anything else sending one is malformed.
    let max_value = if op == OP_SET { shared.cfg.max_value_bytes } else { 0 };
    let value = rd.bytes(max_value)?;
    Ok(match op {
        OP_SET => Request::Set(key, value),
        OP_GET => Request::Get(key, Duration::from_millis(rd.u64()?)),
        OP_ADD => Request::Add(key, rd.i64()?),
        OP_CHECK => Request::Check(key),
        _ => Request::Delete(key),
    })
}

/// Run a request against the table and encode the response.
fn execute(table: &Table, request: Request) -> Vec<u8> {
    let mut out = vec![ST_OK];
    let result = match request {
        Request::Set(key, value) => table.set(&key, &value),
        Request::Get(key, wait) => match table.wait_get(&key, wait) {
            Ok(Lookup::Found(value)) => {
                put_bytes(&mut out, &value);
                Ok(())
            }
            Ok(Lookup::TimedOut) => return vec![ST_TIMEOUT],
            Err(e) => Err(e),
        },
        Request::Add(key, delta) => table.add(&key, delta).map(|n| out.extend_from_slice(&n.to_le_bytes())),
        Request::Check(key) => table.check(&key).map(|b| out.push(u8::from(b))),
        Request::Delete(key) => table.delete(&key).map(|b| out.push(u8::from(b))),
    };
    match result {
        Ok(()) => out,
        Err(e) => {
            let mut out = vec![ST_ERROR];
            let msg = match e {
                Error::Store(msg) => msg,
                other => other.to_string(),
            };
            put_bytes(&mut out, msg.as_bytes());
            out
        }
    }
}
