//! In-process store for ranks that are threads of one process, and the
//! key-value table that the TCP store server shares with it.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

/// Default cap on a key's length in bytes.
pub(crate) const DEFAULT_MAX_KEY_BYTES: usize = 1024;
/// Default cap on a value's length in bytes.
pub(crate) const DEFAULT_MAX_VALUE_BYTES: usize = 4 << 20;
/// Default cap on the number of keys held at once.
pub(crate) const DEFAULT_MAX_KEYS: usize = 65536;

/// Caps that keep one misbehaving rank from exhausting the store's memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub max_key_bytes: usize,
    pub max_value_bytes: usize,
    pub max_keys: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_bytes: DEFAULT_MAX_KEY_BYTES,
            max_value_bytes: DEFAULT_MAX_VALUE_BYTES,
            max_keys: DEFAULT_MAX_KEYS,
        }
    }
}

/// What a blocking lookup ended with.
pub(crate) enum Lookup {
    Found(Vec<u8>),
    TimedOut,
}

struct State {
    map: HashMap<String, Vec<u8>>,
    /// Set when the owning server shuts down, so blocked waiters return.
    closed: bool,
}

/// The key-value table with its limits and a condvar for waiting readers.
pub(crate) struct Table {
    limits: Limits,
    state: Mutex<State>,
    changed: Condvar,
}

impl Table {
    pub(crate) fn new(limits: Limits) -> Self {
        Table {
            limits,
            state: Mutex::new(State {
                map: HashMap::new(),
                closed: false,
            }),
            changed: Condvar::new(),
        }
    }

    // A panic while holding the lock cannot leave the map half-updated (every
    // update is a single insert/remove), so a poisoned lock is still usable.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_key(&self, key: &str) -> Result<()> {
        if key.len() > self.limits.max_key_bytes {
            return Err(Error::invalid(format!(
                "store key of {} bytes exceeds the limit of {} bytes",
                key.len(),
                self.limits.max_key_bytes
            )));
        }
        Ok(())
    }

    fn check_value(&self, len: usize) -> Result<()> {
        if len > self.limits.max_value_bytes {
            return Err(Error::invalid(format!(
                "store value of {len} bytes exceeds the limit of {} bytes",
                self.limits.max_value_bytes
            )));
        }
        Ok(())
    }

    /// Insert or overwrite; refuses a new key once `max_keys` are held.
    fn insert(&self, state: &mut State, key: &str, value: Vec<u8>) -> Result<()> {
        if !state.map.contains_key(key) && state.map.len() >= self.limits.max_keys {
            return Err(Error::Store(format!(
                "store is full ({} keys); cannot add key '{key}'",
                self.limits.max_keys
            )));
        }
        state.map.insert(key.to_owned(), value);
        self.changed.notify_all();
        Ok(())
    }

    pub(crate) fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check_key(key)?;
        self.check_value(value.len())?;
        let mut state = self.lock();
        self.insert(&mut state, key, value.to_vec())
    }

    /// Wait up to `timeout` for `key`. Errors if the table is closed meanwhile.
    pub(crate) fn wait_get(&self, key: &str, timeout: Duration) -> Result<Lookup> {
        self.check_key(key)?;
        // A timeout too large to represent is as good as "forever".
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.lock();
        loop {
            if let Some(value) = state.map.get(key) {
                return Ok(Lookup::Found(value.clone()));
            }
            if state.closed {
                return Err(Error::Store("store is shutting down".into()));
            }
            state = match deadline {
                None => self.changed.wait(state).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(Lookup::TimedOut);
                    }
                    self.changed
                        .wait_timeout(state, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Counters are stored as decimal text so that `get` shows them readably.
    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.check_key(key)?;
        let mut state = self.lock();
        let current = match state.map.get(key) {
            None => 0,
            Some(bytes) => std::str::from_utf8(bytes)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| Error::Store(format!("key '{key}' does not hold an integer")))?,
        };
        let new = current
            .checked_add(delta)
            .ok_or_else(|| Error::Store(format!("adding {delta} to key '{key}' overflows")))?;
        self.insert(&mut state, key, new.to_string().into_bytes())?;
        Ok(new)
    }

    pub(crate) fn check(&self, key: &str) -> Result<bool> {
        self.check_key(key)?;
        Ok(self.lock().map.contains_key(key))
    }

    pub(crate) fn delete(&self, key: &str) -> Result<bool> {
        self.check_key(key)?;
        Ok(self.lock().map.remove(key).is_some())
    }

    /// Wake every waiter and make further waits fail (server shutdown).
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }
}

/// The timeout error every store returns from `get`.
pub(crate) fn get_timeout(key: &str, after: Duration) -> Error {
    Error::Timeout {
        what: format!("store key '{key}'"),
        after,
        missing: Vec::new(),
    }
}

/// A store shared by ranks that are threads of one process.
///
/// Same limits as the TCP store: keys up to 1 KiB, values up to 4 MiB,
/// at most 65536 keys.
pub struct InProcStore {
    table: Table,
}

impl InProcStore {
    /// A new empty store with the default limits, ready to clone into each rank.
    pub fn new() -> Arc<Self> {
        Arc::new(InProcStore {
            table: Table::new(Limits::default()),
        })
    }

    /// A new empty store with explicit limits.
    pub fn with_limits(max_key_bytes: usize, max_value_bytes: usize, max_keys: usize) -> Arc<Self> {
        Arc::new(InProcStore {
            table: Table::new(Limits {
                max_key_bytes,
                max_value_bytes,
                max_keys,
            }),
        })
    }
}

impl Store for InProcStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.table.set(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        match self.table.wait_get(key, timeout)? {
            Lookup::Found(value) => Ok(value),
            Lookup::TimedOut => Err(get_timeout(key, timeout)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.table.add(key, delta)
    }

    fn check(&self, key: &str) -> Result<bool> {
        self.table.check(key)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.table.delete(key)
    }
}
