//! Host streams (a worker thread running its queue in order), events (markers
//! in that queue) and graphs (a recorded queue that can be replayed).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Queued work. `Fn`, not `FnOnce`, so a captured graph can run it again.
pub(super) type Op = Arc<dyn Fn() + Send + Sync>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Ops run under catch_unwind, so a poisoned lock still holds consistent data.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct Progress {
    submitted: u64,
    completed: u64,
    panicked: bool,
}

struct Shared {
    progress: Mutex<Progress>,
    cv: Condvar,
}

/// An in-order queue of work run by one worker thread. Handles to one
/// queue (`HostStream::borrow`) share it; the last one to go closes it.
pub struct HostStream(Arc<Queue>);

pub struct Queue {
    tx: Mutex<Option<mpsc::Sender<Op>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
    capture: Mutex<Option<Vec<Op>>>,
}

/// Every live queue by its handle (`Device::raw_stream`), so that a handle
/// passed around as an integer can be borrowed again, as a vendor stream
/// can, without trusting it as a pointer.
fn queues() -> &'static Mutex<std::collections::HashMap<u64, std::sync::Weak<Queue>>> {
    static QUEUES: std::sync::OnceLock<Mutex<std::collections::HashMap<u64, std::sync::Weak<Queue>>>> =
        std::sync::OnceLock::new();
    QUEUES.get_or_init(Default::default)
}

impl std::ops::Deref for HostStream {
    type Target = Queue;
    fn deref(&self) -> &Queue {
        &self.0
    }
}

impl HostStream {
    pub(super) fn new() -> Result<HostStream> {
        let queue = Arc::new(Queue::new()?);
        lock(queues()).insert(Arc::as_ptr(&queue) as u64, Arc::downgrade(&queue));
        Ok(HostStream(queue))
    }

    /// This queue's handle: what [`HostStream::borrow`] takes back.
    pub(super) fn raw(&self) -> u64 {
        Arc::as_ptr(&self.0) as u64
    }

    /// Another handle to the live queue `raw`, or an error naming it.
    pub(super) fn borrow(raw: u64) -> Result<HostStream> {
        lock(queues())
            .get(&raw)
            .and_then(std::sync::Weak::upgrade)
            .map(HostStream)
            .ok_or_else(|| Error::invalid(format!("{raw:#x} is not a live host stream")))
    }
}

impl Queue {
    fn new() -> Result<Queue> {
        let (tx, rx) = mpsc::channel::<Op>();
        let shared = Arc::new(Shared {
            progress: Mutex::new(Progress::default()),
            cv: Condvar::new(),
        });
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("ferrocomm-host-stream".into())
            .spawn(move || {
                for op in rx {
                    let ok = catch_unwind(AssertUnwindSafe(|| op())).is_ok();
                    let mut p = lock(&worker_shared.progress);
                    p.completed += 1;
                    p.panicked |= !ok;
                    worker_shared.cv.notify_all();
                }
            })
            .map_err(|e| Error::io("spawning a host stream worker", e))?;
        Ok(Queue {
            tx: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
            shared,
            capture: Mutex::new(None),
        })
    }

    /// Queue `op`, or record it if the stream is capturing.
    pub(super) fn submit(&self, op: Op) -> Result<()> {
        if let Some(graph) = lock(&self.capture).as_mut() {
            graph.push(op);
            return Ok(());
        }
        self.enqueue(op)
    }

    fn enqueue(&self, op: Op) -> Result<()> {
        let tx = lock(&self.tx);
        let tx = tx.as_ref().ok_or_else(|| Error::invalid("host stream is closed"))?;
        lock(&self.shared.progress).submitted += 1;
        tx.send(op).map_err(|_| Error::invalid("host stream worker has exited"))
    }

    /// Wait for everything queued so far.
    pub(super) fn synchronize(&self) -> Result<()> {
        let mut p = lock(&self.shared.progress);
        let target = p.submitted;
        while p.completed < target {
            p = self.shared.cv.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        if p.panicked {
            return Err(Error::Backend {
                backend: "host",
                call: "stream op",
                message: "a queued operation panicked".into(),
            });
        }
        Ok(())
    }

    pub(super) fn record(&self, event: &HostEvent) -> Result<()> {
        if self.is_capturing() {
            return Err(Error::Unsupported("recording a host event inside graph capture".into()));
        }
        let target = {
            let mut e = lock(&event.0.state);
            e.target += 1;
            e.target
        };
        let ev = event.0.clone();
        self.enqueue(Arc::new(move || {
            let mut e = lock(&ev.state);
            if e.done < target {
                e.done = target;
                e.at = Some(Instant::now());
            }
            ev.cv.notify_all();
        }))
    }

    pub(super) fn wait_event(&self, event: &HostEvent) -> Result<()> {
        let target = lock(&event.0.state).target;
        let ev = event.0.clone();
        self.submit(Arc::new(move || {
            let mut e = lock(&ev.state);
            while e.done < target {
                e = ev.cv.wait(e).unwrap_or_else(|p| p.into_inner());
            }
        }))
    }

    pub(super) fn begin_capture(&self) -> Result<()> {
        let mut cap = lock(&self.capture);
        if cap.is_some() {
            return Err(Error::invalid("stream is already capturing"));
        }
        *cap = Some(Vec::new());
        Ok(())
    }

    pub(super) fn end_capture(&self) -> Result<HostGraph> {
        let ops = lock(&self.capture)
            .take()
            .ok_or_else(|| Error::invalid("end_capture on a stream that is not capturing"))?;
        Ok(HostGraph { ops })
    }

    pub(super) fn is_capturing(&self) -> bool {
        lock(&self.capture).is_some()
    }

    pub(super) fn launch_graph(&self, graph: &HostGraph) -> Result<()> {
        for op in &graph.ops {
            self.submit(op.clone())?;
        }
        Ok(())
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        lock(queues()).remove(&(self as *const Queue as u64));
        // Closing the channel lets the worker drain its queue and exit.
        lock(&self.tx).take();
        if let Some(worker) = lock(&self.worker).take() {
            let _ = worker.join();
        }
    }
}

#[derive(Default)]
struct EventState {
    target: u64,
    done: u64,
    at: Option<Instant>,
}

struct EventShared {
    state: Mutex<EventState>,
    cv: Condvar,
}

/// A marker in a stream's queue; done once the queue reaches it.
pub struct HostEvent(Arc<EventShared>);

impl HostEvent {
    pub(super) fn new() -> HostEvent {
        HostEvent(Arc::new(EventShared {
            state: Mutex::new(EventState::default()),
            cv: Condvar::new(),
        }))
    }

    pub(super) fn is_done(&self) -> bool {
        let e = lock(&self.0.state);
        e.done >= e.target
    }

    /// Block until the event is done or `timeout` passes; true when done.
    pub(super) fn wait_for(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut e = lock(&self.0.state);
        while e.done < e.target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            e = self.0.cv.wait_timeout(e, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }

    pub(super) fn elapsed_ms(start: &HostEvent, end: &HostEvent) -> Result<f32> {
        let (a, b) = (lock(&start.0.state).at, lock(&end.0.state).at);
        match (a, b, start.is_done() && end.is_done()) {
            (Some(a), Some(b), true) => Ok(b.saturating_duration_since(a).as_secs_f32() * 1e3),
            _ => Err(Error::invalid("elapsed_ms on an event that has not completed")),
        }
    }
}

/// Work recorded by graph capture.
pub struct HostGraph {
    ops: Vec<Op>,
}
