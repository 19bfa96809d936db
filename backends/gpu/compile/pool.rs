//! The process-wide pool of worker threads that compile kernels and load
//! them into device contexts, so that no caller's thread (one capturing a
//! graph, say) ever compiles or loads a module.
//!
//! Workers: `FERROCOMM_COMPILE_THREADS`, else `min(available_parallelism - 1,
//! 8)`, at least 1; started on the first task.
//!
//! A worker inside NVRTC, a module load or a module's release while the
//! vendor libraries' destructors run at process exit crashes the process (a
//! child process that exited with compiles queued segfaulted on CUDA 13).
//! So:
//! - when the process's last GPU device is dropped ([`DeviceInUse`]), the
//!   pool pauses: running tasks finish (the drop waits for them, a bounded
//!   time), queued ones wait for the next device or for a module that needs
//!   them;
//! - at process exit the pool stops taking tasks and waits (a bounded time)
//!   for the ones running; the exit hook is registered again after every
//!   task, but exit handlers that a compile still running registers come
//!   before it, so only the pause is safe for a process that exits with
//!   compiles running.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::queue::{Lane, Priority, TaskQueue};

/// Stack of each compile pool thread (see `Pool::start`).
const COMPILE_STACK_BYTES: usize = 64 << 20;

type Task = Box<dyn FnOnce() + Send>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Worker threads over one [`TaskQueue`].
pub struct Pool {
    queue: Mutex<TaskQueue<Task>>,
    ready: Condvar,
    workers: usize,
    started: AtomicUsize,
    /// Set at process exit: queued tasks are neither run nor dropped.
    closing: AtomicBool,
    /// Set while no GPU device is open: queued tasks wait (changed under
    /// the queue's lock).
    paused: AtomicBool,
    /// Tasks running now (changed under the queue's lock).
    running: AtomicUsize,
}

/// The longest process exit waits for running compiles.
const EXIT_WAIT: Duration = Duration::from_secs(20);

/// The process's pool, once a task was submitted.
static POOL: OnceLock<Pool> = OnceLock::new();

extern "C" fn quiesce_global_pool() {
    // Never starts the pool at exit (a pool of its own runs the tests' tasks).
    if let Some(pool) = POOL.get() {
        pool.quiesce(EXIT_WAIT);
    }
}

/// Register the exit hook (again): when the pool starts and after every
/// task.
///
/// Exit handlers run last-registered first, and the vendor compilers
/// register C++ destructors as they go: when they load, and for
/// function-local statics, on first use inside a compile. Those would run
/// before a hook registered earlier, under a worker still compiling. The
/// child of the cold-start test segfaulted at exit in every run that way
/// (2x H200: the main thread inside this hook, waiting, and a worker
/// faulting inside `nvrtcCompileProgram`): with a warm disk cache its
/// first task was a load from disk, after which the hook was armed for the
/// last time. Registering after every task puts the hook ahead of whatever
/// a finished task registered; each registration is one entry in libc's
/// list, and quiescing more than once is harmless.
fn arm_exit_hook() {
    // SAFETY: registers a plain `extern "C"` function with no arguments;
    // it only touches the 'static pool.
    unsafe { libc::atexit(quiesce_global_pool) };
}

thread_local! {
    /// Whether this thread is one of the pool's workers.
    static ON_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// GPU devices open in this process (see [`DeviceInUse`]).
static DEVICES: Mutex<usize> = Mutex::new(0);

/// The longest the last device's drop waits for running compiles.
const LAST_DEVICE_WAIT: Duration = Duration::from_secs(20);

/// Held by every open GPU device. The first resumes the pool; dropping the
/// last pauses it and waits for the tasks running, so that a process that
/// exits after dropping its devices has no worker inside the vendor
/// libraries while their destructors run (the cold-start test's child still
/// crashed in 1 of 6 runs on 2x H200 with the exit hook alone).
/// The wait is at most one compile or load a worker; queued tasks stay
/// queued for the next device, or for a module that waits on them
/// ([`Pool::resume`]).
pub(crate) struct DeviceInUse(());

impl DeviceInUse {
    pub(crate) fn new() -> DeviceInUse {
        let mut n = lock(&DEVICES);
        *n += 1;
        if let Some(pool) = POOL.get() {
            pool.resume();
        }
        DeviceInUse(())
    }
}

impl Drop for DeviceInUse {
    fn drop(&mut self) {
        let mut n = lock(&DEVICES);
        *n = n.saturating_sub(1);
        if *n == 0 {
            if let Some(pool) = POOL.get() {
                // Under the count's lock: a device opened meanwhile resumes
                // the pool only after this pause.
                pool.pause(LAST_DEVICE_WAIT);
            }
        }
    }
}

/// Pause the process's compile pool, as the last device's drop does, and
/// wait (at most 20 s) for the tasks running: for an embedder's own exit
/// hook that runs before C's exit handlers (the Python package's
/// `atexit`), when devices may still be open. A module that waits on a
/// kernel later resumes the pool. Returns how many tasks still run.
pub fn pause_for_exit() -> usize {
    POOL.get().map_or(0, |pool| pool.pause(LAST_DEVICE_WAIT))
}

/// How many workers the process-wide pool runs.
pub fn worker_count() -> usize {
    if let Some(n) = std::env::var("FERROCOMM_COMPILE_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n.min(64);
    }
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    cores.saturating_sub(1).clamp(1, 8)
}

impl Pool {
    /// The process's pool.
    pub fn global() -> &'static Pool {
        static STARTED: OnceLock<()> = OnceLock::new();
        let pool = POOL.get_or_init(|| Pool::unstarted(worker_count()));
        STARTED.get_or_init(|| {
            pool.start("ferrocomm-compile");
            arm_exit_hook();
        });
        pool
    }

    fn unstarted(workers: usize) -> Pool {
        Pool {
            queue: Mutex::new(TaskQueue::default()),
            ready: Condvar::new(),
            workers,
            started: AtomicUsize::new(0),
            closing: AtomicBool::new(false),
            paused: AtomicBool::new(false),
            running: AtomicUsize::new(0),
        }
    }

    /// Start no queued task until [`Pool::resume`]; wait up to `limit` for
    /// the running ones (not on a worker, which would wait for itself).
    /// Returns how many still run after that.
    pub fn pause(&self, limit: Duration) -> usize {
        {
            let _q = lock(&self.queue);
            self.paused.store(true, Ordering::Release);
        }
        if ON_WORKER.with(|w| w.get()) {
            return self.running.load(Ordering::Acquire);
        }
        self.wait_idle(limit)
    }

    /// Run queued tasks again.
    pub fn resume(&self) {
        {
            let _q = lock(&self.queue);
            if !self.paused.swap(false, Ordering::AcqRel) {
                return;
            }
        }
        self.ready.notify_all();
    }

    fn wait_idle(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            let n = self.running.load(Ordering::Acquire);
            if n == 0 || Instant::now() >= deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Stop running queued tasks (leaked: the process is exiting) and wait
    /// up to `limit` for the running ones; returns how many still run after
    /// that.
    pub fn quiesce(&self, limit: Duration) -> usize {
        {
            let _q = lock(&self.queue);
            self.closing.store(true, Ordering::Release);
        }
        self.ready.notify_all();
        self.wait_idle(limit)
    }

    /// Start the workers; returns how many started. With none (the system
    /// refused every thread), tasks run on the thread that submits them.
    fn start(&'static self, name: &str) -> usize {
        let n = (0..self.workers)
            .filter(|i| {
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    // NVRTC and hipRTC compile on the calling thread, and
                    // their front ends recurse deeply on the larger
                    // kernels: a compile pool thread overflowed Rust's
                    // default 2 MiB (seen at process exit on an H100 run
                    // of the EP bench). Stacks are reserved, not touched.
                    .stack_size(COMPILE_STACK_BYTES)
                    .spawn(move || {
                        ON_WORKER.with(|w| w.set(true));
                        self.work()
                    })
                    .is_ok()
            })
            .count();
        self.started.store(n, Ordering::Release);
        n
    }

    /// Queue `task` under `key` (a key already queued is not queued twice).
    pub fn submit(&'static self, key: String, lane: Lane, priority: Priority, task: Task) {
        if self.closing.load(Ordering::Acquire) {
            return;
        }
        if self.started.load(Ordering::Acquire) == 0 {
            task();
            return;
        }
        if lock(&self.queue).push(key, lane, priority, task) {
            self.ready.notify_one();
        }
    }

    /// Give a queued `key` a better priority (no effect when it is not queued).
    pub fn raise(&self, key: &str, priority: Priority) {
        lock(&self.queue).raise(key, priority);
    }

    /// Run `key` next, ahead of tasks not bumped before it; false when it is
    /// not waiting (already running or finished).
    pub fn bump(&self, key: &str) -> bool {
        lock(&self.queue).bump(key)
    }

    fn work(&self) {
        loop {
            let (lane, task, run) = {
                let mut q = lock(&self.queue);
                loop {
                    // Paused: nothing starts (at exit, popping only forgets).
                    let hold = self.paused.load(Ordering::Acquire) && !self.closing.load(Ordering::Acquire);
                    if let Some((_, lane, task)) = if hold { None } else { q.pop() } {
                        let run = !self.closing.load(Ordering::Acquire);
                        if run {
                            self.running.fetch_add(1, Ordering::AcqRel);
                        }
                        break (lane, task, run);
                    }
                    q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            if run {
                // A panicking task must not take the worker with it; the
                // task's waiters time out with an error naming what never
                // finished.
                let _ = std::panic::catch_unwind(AssertUnwindSafe(task));
                arm_exit_hook();
            } else {
                // Not even dropped: a task's captures may hold the last
                // reference to a module or context, and releasing those
                // while the vendor libraries tear down at exit crashes.
                std::mem::forget(task);
            }
            let mut q = lock(&self.queue);
            q.done(lane);
            if run {
                self.running.fetch_sub(1, Ordering::AcqRel);
            }
            drop(q);
            // A task of a full lane may now run.
            self.ready.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    const LANE: Lane = Lane { name: "test", limit: 8 };

    #[test]
    fn one_worker_runs_bumped_tasks_first() {
        let pool: &'static Pool = Box::leak(Box::new(Pool::unstarted(1)));
        let (gate_tx, gate_rx) = mpsc::channel::<()>();
        let (tx, rx) = mpsc::channel::<&'static str>();
        assert_eq!(pool.start("ferrocomm-test-pool"), 1);
        // The first task holds the only worker until the others are queued.
        let t = tx.clone();
        pool.submit(
            "gate".into(),
            LANE,
            0,
            Box::new(move || {
                let _ = gate_rx.recv();
                let _ = t.send("gate");
            }),
        );
        std::thread::sleep(Duration::from_millis(50));
        for (i, k) in ["a", "b", "c"].into_iter().enumerate() {
            let t = tx.clone();
            pool.submit(
                k.into(),
                LANE,
                i as u32,
                Box::new(move || {
                    let _ = t.send(k);
                }),
            );
        }
        assert!(pool.bump("c"));
        assert!(!pool.bump("gate"), "a running task cannot be bumped");
        gate_tx.send(()).unwrap();
        let order: Vec<_> = (0..4)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(order, ["gate", "c", "a", "b"]);
    }

    #[test]
    fn a_panicking_task_does_not_stop_the_worker() {
        let pool: &'static Pool = Box::leak(Box::new(Pool::unstarted(1)));
        pool.start("ferrocomm-test-pool");
        let (tx, rx) = mpsc::channel();
        pool.submit("boom".into(), LANE, 0, Box::new(|| panic!("task panics on purpose")));
        pool.submit(
            "after".into(),
            LANE,
            1,
            Box::new(move || {
                let _ = tx.send(1);
            }),
        );
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(1));
    }

    /// A pool of one worker, busy with a task that sends "slow" after
    /// `ms` milliseconds; the channel's sender for more tasks.
    fn busy_pool(ms: u64) -> (&'static Pool, mpsc::Sender<&'static str>, mpsc::Receiver<&'static str>) {
        let pool: &'static Pool = Box::leak(Box::new(Pool::unstarted(1)));
        pool.start("ferrocomm-test-pool");
        let (tx, rx) = mpsc::channel();
        let t = tx.clone();
        pool.submit(
            "slow".into(),
            LANE,
            0,
            Box::new(move || {
                std::thread::sleep(Duration::from_millis(ms));
                let _ = t.send("slow");
            }),
        );
        (pool, tx, rx)
    }

    #[test]
    fn quiesce_waits_for_running_tasks_and_never_runs_queued_ones() {
        let (pool, tx, rx) = busy_pool(200);
        pool.submit(
            "queued".into(),
            LANE,
            1,
            Box::new(move || {
                let _ = tx.send("queued");
            }),
        );
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(pool.quiesce(Duration::from_secs(10)), 0);
        assert_eq!(
            rx.try_recv(),
            Ok("slow"),
            "the running task finished before quiesce returned"
        );
        // The queued task never runs (and, leaked, keeps its sender).
        assert_eq!(
            rx.recv_timeout(Duration::from_millis(500)),
            Err(mpsc::RecvTimeoutError::Timeout)
        );
    }

    #[test]
    fn pause_waits_for_running_tasks_and_holds_queued_ones_until_resume() {
        let (pool, tx, rx) = busy_pool(150);
        // Let the worker take it, then pause: the running task finishes first.
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(pool.pause(Duration::from_secs(5)), 0);
        assert_eq!(rx.try_recv(), Ok("slow"));
        pool.submit(
            "later".into(),
            LANE,
            0,
            Box::new(move || {
                let _ = tx.send("later");
            }),
        );
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "a paused pool ran a task"
        );
        pool.resume();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok("later"));
    }

    #[test]
    fn worker_count_is_bounded() {
        let n = worker_count();
        assert!((1..=64).contains(&n), "{n}");
    }
}
