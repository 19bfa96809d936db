//! Compiled images, once per process: every context (rank thread) that
//! wants the same compile unit shares one image, and two requests for one
//! key compile once. An image comes from the disk cache when a valid file
//! is there, else from the vendor's compiler (and is then written to disk).
//!
//! A request names what to do with the image (load it into a context); it
//! runs on a pool worker once the image exists: right after the compile for
//! the requests that were waiting for it, as a task of its own for later
//! ones.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use super::disk;
use super::pool::Pool;
use super::queue::{Lane, Priority};
use crate::backends::gpu::errors::clone_error;
use crate::backends::gpu::vendor::CompileTarget;
use crate::device::{BackendKind, ModuleSource};
use crate::error::{Error, Result};

/// Loads and lookups: cheap, any number at once.
pub const LOAD_LANE: Lane = Lane {
    name: "load",
    limit: usize::MAX,
};

/// One compile unit: a kernel (or a whole module whose text holds its own
/// entry points) for one target. Its text is built only when it is
/// compiled; the key hashes the module body once per module and the entry.
pub struct Unit {
    pub backend: BackendKind,
    /// Hash of (module, body, entry, options, compiler, arch).
    pub key: String,
    /// `collectives/fc_oneshot_ll_bf16_sum`, in errors and logs.
    pub label: String,
    source: ModuleSource,
    kernel: Option<String>,
    /// Its file in the disk cache.
    pub file: String,
    pub target: Arc<CompileTarget>,
    /// The vendor's compiler.
    pub compile: fn(&CompileTarget, &str, &str) -> Result<Vec<u8>>,
    pub lane: Lane,
}

impl Unit {
    /// The unit of `kernel` of `source` (the whole module for `None`);
    /// `body_key` is [`body_key`] of the source for this backend.
    pub fn new(
        backend: BackendKind,
        source: &ModuleSource,
        body_key: &str,
        kernel: Option<&str>,
        target: Arc<CompileTarget>,
        compile: fn(&CompileTarget, &str, &str) -> Result<Vec<u8>>,
        lane: Lane,
    ) -> Result<Unit> {
        let module = source.name;
        let entry = match kernel {
            Some(k) => (source.entry)(k)
                .ok_or_else(|| Error::invalid(format!("kernel module {module} has no kernel named {k}")))?,
            None => String::new(),
        };
        let options = target.options.join("\0");
        let key = disk::cache_key(&[
            module.as_bytes(),
            kernel.unwrap_or("").as_bytes(),
            body_key.as_bytes(),
            entry.as_bytes(),
            options.as_bytes(),
            target.compiler.as_bytes(),
            target.arch.as_bytes(),
        ]);
        let (label, stem) = match kernel {
            Some(k) => (
                format!("{module}/{k}"),
                format!("{}-{}", disk::sanitize(module), disk::sanitize(k)),
            ),
            None => (module.to_string(), disk::sanitize(module)),
        };
        let file = format!("{stem}-{}-{key}.{}", disk::sanitize(&target.arch), target.extension);
        Ok(Unit {
            backend,
            key,
            label,
            source: *source,
            kernel: kernel.map(str::to_string),
            file,
            target,
            compile,
            lane,
        })
    }

    /// The text to compile: the module body and this unit's entry point.
    pub fn text(&self) -> Result<String> {
        match &self.kernel {
            Some(k) => self.source.text(self.backend, &[k]),
            None => self.source.text(self.backend, &[]),
        }
    }

    /// The pool key of this unit's compile.
    pub fn compile_key(&self) -> String {
        format!("compile:{}", self.key)
    }
}

/// The part of every unit's key that stands for the module body (hashed
/// once per module, not once per kernel).
pub fn body_key(source: &ModuleSource, backend: BackendKind) -> String {
    disk::cache_key(&[source.name.as_bytes(), source.body(backend).as_bytes()])
}

/// A compiled image.
#[derive(Clone)]
pub struct Image {
    pub bytes: Arc<[u8]>,
    pub from_disk: bool,
}

pub type ImageResult = std::result::Result<Image, Arc<Error>>;

/// What to do with the image, on a pool worker.
pub type Subscriber = Box<dyn FnOnce(&Arc<Unit>, ImageResult) + Send>;

enum State {
    Pending(Vec<Subscriber>),
    Done(ImageResult),
}

fn images() -> MutexGuard<'static, HashMap<String, State>> {
    static IMAGES: OnceLock<Mutex<HashMap<String, State>>> = OnceLock::new();
    IMAGES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Where this process's images came from, per backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub from_disk: u64,
    pub compiled: u64,
    /// Requests served by an image already in memory.
    pub shared: u64,
}

static STATS: [[AtomicU64; 3]; 3] = [const { [const { AtomicU64::new(0) }; 3] }; 3];

fn count(backend: BackendKind, what: usize) {
    STATS[backend as usize][what].fetch_add(1, Ordering::Relaxed);
}

pub fn stats(backend: BackendKind) -> Stats {
    let s = &STATS[backend as usize];
    Stats {
        from_disk: s[0].load(Ordering::Relaxed),
        compiled: s[1].load(Ordering::Relaxed),
        shared: s[2].load(Ordering::Relaxed),
    }
}

/// Ask for `unit`'s image; `then` runs on a worker once it exists (or
/// failed). `load_key` names that later task in the pool, so a waiting
/// launch can bump it.
pub fn request(unit: Arc<Unit>, priority: Priority, load_key: String, then: Subscriber) {
    let pool = Pool::global();
    let mut map = images();
    match map.get_mut(&unit.key) {
        Some(State::Done(result)) => {
            let result = result.clone();
            drop(map);
            count(unit.backend, 2);
            pool.submit(load_key, LOAD_LANE, priority, Box::new(move || then(&unit, result)));
        }
        Some(State::Pending(waiting)) => {
            waiting.push(then);
            drop(map);
            pool.raise(&unit.compile_key(), priority);
        }
        None => {
            map.insert(unit.key.clone(), State::Pending(vec![then]));
            drop(map);
            let key = unit.compile_key();
            let lane = unit.lane;
            pool.submit(key, lane, priority, Box::new(move || compile_and_hand_out(unit)));
        }
    }
}

/// The compile task: obtain the image, then run every request that waited.
fn compile_and_hand_out(unit: Arc<Unit>) {
    let result = obtain(&unit, false).map_err(Arc::new);
    let waiting = match images().insert(unit.key.clone(), State::Done(result.clone())) {
        Some(State::Pending(w)) => w,
        _ => Vec::new(),
    };
    for then in waiting {
        then(&unit, result.clone());
    }
}

/// Compile `unit` afresh (its cached image failed to load) and keep the
/// new image for later requests.
pub fn recompile(unit: &Unit) -> ImageResult {
    let result = obtain(unit, true).map_err(Arc::new);
    if result.is_ok() {
        images().insert(unit.key.clone(), State::Done(result.clone()));
    }
    result
}

/// The image from the disk cache (unless `fresh`), else compiled and
/// written there.
pub fn obtain(unit: &Unit, fresh: bool) -> Result<Image> {
    let dir = disk::cache_dir();
    if !fresh {
        if let Some(bytes) = dir
            .as_deref()
            .and_then(|d| disk::read(d, &unit.file, &unit.key, unit.target.image))
        {
            count(unit.backend, 0);
            return Ok(Image {
                bytes: bytes.into(),
                from_disk: true,
            });
        }
    }
    let started = Instant::now();
    let bytes = (unit.compile)(&unit.target, &unit.label, &unit.text()?)?;
    if !unit.target.image.accepts(&bytes) {
        return Err(Error::Compile {
            module: unit.label.clone(),
            arch: unit.target.arch.clone(),
            log: format!(
                "{} returned {} bytes that are not a {:?} image",
                unit.target.compiler,
                bytes.len(),
                unit.target.image
            ),
        });
    }
    count(unit.backend, 1);
    crate::fc_log!(
        tracing::Level::DEBUG,
        "compiled {} for {} in {} ms",
        unit.label,
        unit.target.arch,
        started.elapsed().as_millis()
    );
    if let Some(d) = dir.as_deref() {
        disk::write(d, &unit.file, &unit.key, &bytes);
    }
    Ok(Image {
        bytes: bytes.into(),
        from_disk: false,
    })
}

/// What [`precompile`] did.
#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Precompiled {
    /// Units already in the disk cache.
    pub from_disk: usize,
    /// Units compiled now (and written to the cache).
    pub compiled: usize,
}

/// Fill the disk cache with every unit, on `threads` threads of its own
/// (not the pool: there is nothing else to do). The first error is returned
/// after every unit was tried.
#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
pub fn precompile(units: &[Arc<Unit>], threads: usize) -> Result<Precompiled> {
    let next = AtomicU64::new(0);
    let done = Mutex::new((Precompiled::default(), None::<Error>));
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, units.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(unit) = units.get(i) else {
                    return;
                };
                let r = obtain(unit, false);
                let mut d = done.lock().unwrap_or_else(|e| e.into_inner());
                match r {
                    Ok(img) if img.from_disk => d.0.from_disk += 1,
                    Ok(_) => d.0.compiled += 1,
                    Err(e) => {
                        d.1.get_or_insert(e);
                    }
                }
            });
        }
    });
    let (counts, err) = done.into_inner().unwrap_or_else(|e| e.into_inner());
    match err {
        Some(e) => Err(e),
        None => Ok(counts),
    }
}

/// A shared result as the caller's own error.
pub fn take(result: ImageResult) -> Result<Image> {
    result.map_err(|e| clone_error(&e))
}
