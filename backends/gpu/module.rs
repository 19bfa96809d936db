//! Kernel modules, loaded lazily: [`GpuModule::load`] returns at once and
//! queues one compile unit per kernel on the process's pool, most likely
//! needed first; a worker compiles it (or reads it from the caches), loads
//! it into the context and resolves the entry point. A launch uses the
//! function if it is ready, else moves its kernel to the front of the queue
//! and waits (bounded by `FERROCOMM_COMPILE_TIMEOUT_SECONDS`, 300 s), so a
//! thread capturing a graph never compiles or loads anything itself.
//!
//! A module whose text holds its own entry points ([`ModuleSource::raw`]:
//! tests, user kernels) is one unit, compiled before `load` returns, so its
//! compile errors come back at once; its functions are looked up by name on
//! first use (or by [`GpuModule::prepare`]).
//!
//! A unit already loaded into a context (by another communicator on the same
//! device) is reused, not loaded again.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::compile::images::{self, ImageResult, Unit};
use super::compile::pool::Pool;
use super::compile::queue::{Lane, Priority};
use super::errors::clone_error;
use super::memory::bind_for_drop;
use super::vendor::{CompileTarget, RawFunction, RawModule, Vendor};
use crate::device::{BackendKind, ModuleSource};
use crate::error::{Error, Result};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long a launch (or `prepare`, per kernel) waits for a compile.
fn compile_timeout() -> Duration {
    let secs = std::env::var("FERROCOMM_COMPILE_TIMEOUT_SECONDS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(300.0);
    Duration::from_secs_f64(secs)
}

/// The order kernels are compiled in: the all-reduce and reduce-to kernels
/// of the common float sums first (what the first collectives use), then
/// broadcasts, the exchanges (inbox and LL) and the other sums (the direct reduce-to's float
/// sums among them: only heap inputs from `DIRECT_MIN_BLOCK_BYTES` a peer
/// take it), then the rest.
pub fn priority(kernel: &str) -> Priority {
    let float_sum = ["_bf16_sum", "_f16_sum", "_f32_sum"]
        .iter()
        .any(|s| kernel.ends_with(s))
        && !kernel.starts_with("fc_reduce_to_direct_");
    if kernel.contains("_broadcast_") || kernel == "fc_exchange" || kernel == "fc_exchange_ll" {
        1
    } else if float_sum {
        0
    } else if kernel.ends_with("_sum") {
        2
    } else {
        3
    }
}

/// A module image loaded into one context; unloaded when the last kernel
/// slot that uses it goes.
pub(super) struct Loaded<V: Vendor> {
    ctx: Arc<V::Context>,
    raw: RawModule,
    module: String,
    functions: Mutex<HashMap<String, RawFunction>>,
}

impl<V: Vendor> Loaded<V> {
    /// Load `image` into `ctx`, which the caller made current.
    fn load(ctx: Arc<V::Context>, module: &str, image: &[u8]) -> Result<Loaded<V>> {
        let raw = V::module_load(&ctx, image)?;
        Ok(Loaded {
            ctx,
            raw,
            module: module.to_string(),
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// The entry point `name`, looked up once (the context is current).
    fn function(&self, name: &str) -> Result<RawFunction> {
        let mut functions = lock(&self.functions);
        if let Some(f) = functions.get(name) {
            return Ok(*f);
        }
        let cname =
            CString::new(name).map_err(|_| Error::invalid(format!("kernel name {name:?} contains a NUL byte")))?;
        // SAFETY: a live module of `self.ctx`, which the caller made current.
        let f = unsafe { V::module_function(&self.ctx, self.raw, &cname) }?.ok_or_else(|| {
            Error::invalid(format!(
                "{} module {} has no kernel named {name}",
                V::LABEL,
                self.module
            ))
        })?;
        functions.insert(name.to_string(), f);
        Ok(f)
    }
}

impl<V: Vendor> Drop for Loaded<V> {
    fn drop(&mut self) {
        bind_for_drop::<V>(&self.ctx);
        // SAFETY: unloads the module loaded in `load`, once; owners drain the
        // streams that ran its kernels before dropping the last module handle.
        V::drop_errors().record(unsafe { V::module_unload(&self.ctx, self.raw) });
    }
}

type LoadedRegistry = HashMap<(BackendKind, u64, String), Weak<dyn Any + Send + Sync>>;

/// Units loaded per context, so that another module handle on the same
/// device reuses them.
fn loaded_registry() -> MutexGuard<'static, LoadedRegistry> {
    static LOADED: OnceLock<Mutex<LoadedRegistry>> = OnceLock::new();
    lock(LOADED.get_or_init(Default::default))
}

fn find_loaded<V: Vendor>(ctx: &V::Context, key: &str) -> Option<Arc<Loaded<V>>> {
    let weak = loaded_registry()
        .get(&(V::KIND, V::context_id(ctx), key.to_string()))
        .cloned()?;
    weak.upgrade()?.downcast::<Loaded<V>>().ok()
}

fn remember_loaded<V: Vendor>(ctx: &V::Context, key: &str, loaded: &Arc<Loaded<V>>) {
    let any: Arc<dyn Any + Send + Sync> = loaded.clone();
    let mut reg = loaded_registry();
    reg.retain(|_, w| w.strong_count() > 0);
    reg.insert((V::KIND, V::context_id(ctx), key.to_string()), Arc::downgrade(&any));
}

enum Slot<V: Vendor> {
    Pending,
    Ready(Arc<Loaded<V>>),
    Failed(Arc<Error>),
}

struct State<V: Vendor> {
    ctx: Arc<V::Context>,
    name: String,
    /// Distinguishes this module's pool tasks from other modules'.
    serial: u64,
    /// One unit per kernel, or one for a whole (raw) module.
    units: Vec<Arc<Unit>>,
    /// The kernel of each unit (`None` for a whole module).
    kernels: Vec<Option<String>>,
    index: HashMap<String, usize>,
    slots: Mutex<Vec<Slot<V>>>,
    changed: Condvar,
}

impl<V: Vendor> State<V> {
    fn load_key(&self, unit: usize) -> String {
        format!("load:{}:{unit}", self.serial)
    }

    fn finish(&self, unit: usize, result: Result<Arc<Loaded<V>>>) {
        lock(&self.slots)[unit] = match result {
            Ok(l) => Slot::Ready(l),
            Err(e) => Slot::Failed(Arc::new(e)),
        };
        self.changed.notify_all();
    }

    /// Load the image into this context, on a pool worker.
    fn install(&self, unit: usize, spec: &Unit, image: ImageResult) -> Result<Arc<Loaded<V>>> {
        let image = images::take(image)?;
        if let Some(l) = find_loaded::<V>(&self.ctx, &spec.key) {
            return Ok(l);
        }
        V::relax_thread_capture_mode();
        V::bind(&self.ctx)?;
        let loaded = match Loaded::<V>::load(self.ctx.clone(), &self.name, &image.bytes) {
            Ok(l) => l,
            Err(e) if image.from_disk => {
                crate::fc_log!(
                    tracing::Level::WARN,
                    "the cached image of {} failed to load ({e}); compiling it again",
                    spec.label
                );
                let fresh = images::take(images::recompile(spec))?;
                Loaded::load(self.ctx.clone(), &self.name, &fresh.bytes)?
            }
            Err(e) => return Err(e),
        };
        if let Some(kernel) = &self.kernels[unit] {
            loaded.function(kernel)?;
        }
        let loaded = Arc::new(loaded);
        remember_loaded::<V>(&self.ctx, &spec.key, &loaded);
        Ok(loaded)
    }

    /// Wait until unit `unit` is loaded, bumping its tasks to the front.
    fn wait(&self, unit: usize, timeout: Duration) -> Result<Arc<Loaded<V>>> {
        if let Some(r) = self.ready(unit) {
            return r;
        }
        let pool = Pool::global();
        // A module outliving every device still gets its kernels.
        pool.resume();
        pool.bump(&self.units[unit].compile_key());
        pool.bump(&self.load_key(unit));
        let deadline = Instant::now() + timeout;
        let mut slots = lock(&self.slots);
        loop {
            match &slots[unit] {
                Slot::Ready(l) => return Ok(l.clone()),
                Slot::Failed(e) => return Err(clone_error(e)),
                Slot::Pending => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: format!("kernel {} to compile and load", self.units[unit].label),
                    after: timeout,
                    missing: Vec::new(),
                });
            }
            slots = self
                .changed
                .wait_timeout(slots, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn ready(&self, unit: usize) -> Option<Result<Arc<Loaded<V>>>> {
        match &lock(&self.slots)[unit] {
            Slot::Ready(l) => Some(Ok(l.clone())),
            Slot::Failed(e) => Some(Err(clone_error(e))),
            Slot::Pending => None,
        }
    }

    fn unit_of(&self, kernel: &str) -> Result<usize> {
        if self.kernels.first().is_some_and(Option::is_none) {
            return Ok(0);
        }
        self.index.get(kernel).copied().ok_or_else(|| {
            Error::invalid(format!(
                "{} module {} has no kernel named {kernel}",
                V::LABEL,
                self.name
            ))
        })
    }
}

/// The compile units of `source` for `target`, in compile order: one per
/// kernel (most likely needed first), or one for a module whose text holds
/// its own entry points.
pub fn compile_units<V: Vendor>(
    source: &ModuleSource,
    target: &Arc<CompileTarget>,
) -> Result<Vec<(Option<String>, Arc<Unit>)>> {
    let lane = Lane {
        name: V::KIND.name(),
        limit: V::max_parallel_compiles(),
    };
    let body = images::body_key(source, V::KIND);
    let unit = |kernel: Option<&str>| -> Result<Arc<Unit>> {
        let u = Unit::new(V::KIND, source, &body, kernel, target.clone(), V::compile, lane)?;
        Ok(Arc::new(u))
    };
    let mut names = (source.kernels)();
    if names.is_empty() {
        return Ok(vec![(None, unit(None)?)]);
    }
    // Stable: within a priority, the module's own order.
    names.sort_by_key(|n| priority(n));
    names
        .into_iter()
        .map(|n| {
            let u = unit(Some(&n))?;
            Ok((Some(n), u))
        })
        .collect()
}

/// Fill the disk cache with every unit of `source` for `target`, on
/// `threads` threads of its own (precompiling for another machine).
#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
pub fn precompile<V: Vendor>(
    source: &ModuleSource,
    target: CompileTarget,
    threads: usize,
) -> Result<images::Precompiled> {
    if super::compile::disk::cache_dir().is_none() {
        return Err(Error::invalid(
            "precompiling needs a disk cache: set FERROCOMM_CACHE_DIR to a directory",
        ));
    }
    let units: Vec<Arc<Unit>> = compile_units::<V>(source, &Arc::new(target))?
        .into_iter()
        .map(|(_, u)| u)
        .collect();
    images::precompile(&units, threads)
}

/// A kernel module of one device: its kernels load in the background.
pub struct GpuModule<V: Vendor> {
    state: Arc<State<V>>,
}

impl<V: Vendor> GpuModule<V> {
    /// Queue every kernel of `source` for `ctx`'s device, most likely needed
    /// first; a module that holds its own entry points is compiled now.
    pub(super) fn load(ctx: Arc<V::Context>, source: &ModuleSource, target: Arc<CompileTarget>) -> Result<Self> {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let (kernels, units): (Vec<Option<String>>, Vec<Arc<Unit>>) =
            compile_units::<V>(source, &target)?.into_iter().unzip();
        let whole = kernels.first().is_some_and(Option::is_none);
        let index = kernels
            .iter()
            .enumerate()
            .filter_map(|(i, k)| Some((k.clone()?, i)))
            .collect();
        let slots = units
            .iter()
            .map(|u| match find_loaded::<V>(&ctx, &u.key) {
                Some(l) => Slot::Ready(l),
                None => Slot::Pending,
            })
            .collect();
        let state = Arc::new(State {
            ctx,
            name: source.name.to_string(),
            serial: SERIAL.fetch_add(1, Ordering::Relaxed),
            units,
            kernels,
            index,
            slots: Mutex::new(slots),
            changed: Condvar::new(),
        });
        for (i, unit) in state.units.iter().enumerate() {
            if state.ready(i).is_some() {
                continue;
            }
            let weak: Weak<State<V>> = Arc::downgrade(&state);
            let prio = state.kernels[i].as_deref().map_or(0, priority);
            images::request(
                unit.clone(),
                prio,
                state.load_key(i),
                Box::new(move |spec, image| {
                    // A module dropped meanwhile needs nothing loaded.
                    if let Some(state) = weak.upgrade() {
                        let r = state.install(i, spec, image);
                        state.finish(i, r);
                    }
                }),
            );
        }
        let module = GpuModule { state };
        if whole {
            module.state.wait(0, compile_timeout())?;
        }
        Ok(module)
    }

    pub(super) fn ctx(&self) -> &V::Context {
        &self.state.ctx
    }

    /// The entry point `kernel`, waiting for its compile if needed. The
    /// caller made the context current.
    pub(super) fn function(&self, kernel: &str) -> Result<RawFunction> {
        let unit = self.state.unit_of(kernel)?;
        self.state.wait(unit, compile_timeout())?.function(kernel)
    }

    /// Block until `kernels` (all, when empty) are loaded; the first error.
    /// The caller made the context current.
    pub(super) fn prepare(&self, kernels: &[&str]) -> Result<()> {
        let timeout = compile_timeout();
        if kernels.is_empty() {
            // In queue order, so each wait covers about one compile.
            for unit in 0..self.state.units.len() {
                self.state.wait(unit, timeout)?;
            }
            return Ok(());
        }
        let units = kernels
            .iter()
            .map(|k| self.state.unit_of(k))
            .collect::<Result<Vec<_>>>()?;
        let pool = Pool::global();
        for &u in &units {
            pool.bump(&self.state.units[u].compile_key());
            pool.bump(&self.state.load_key(u));
        }
        for (&u, k) in units.iter().zip(kernels) {
            // Whole modules look their functions up here, not at launch.
            self.state.wait(u, timeout)?.function(k)?;
        }
        Ok(())
    }

    /// Whether the module has a kernel named `name` that compiled and
    /// loaded (waits for it).
    pub fn has_kernel(&self, name: &str) -> bool {
        V::bind(&self.state.ctx).is_ok() && self.prepare(&[name]).is_ok()
    }

    /// How many of the module's kernels are loaded now.
    pub fn ready_count(&self) -> usize {
        lock(&self.state.slots)
            .iter()
            .filter(|s| matches!(s, Slot::Ready(_)))
            .count()
    }

    /// How many compile units the module has.
    pub fn unit_count(&self) -> usize {
        self.state.units.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_float_sums_come_first() {
        assert_eq!(priority("fc_oneshot_ll_bf16_sum"), 0);
        assert_eq!(priority("fc_twoshot_push_f32_sum"), 0);
        assert_eq!(priority("fc_broadcast_bf16_sum"), 1);
        assert_eq!(priority("fc_exchange"), 1);
        assert_eq!(priority("fc_exchange_ll"), 1);
        assert_eq!(priority("fc_reduce_to_ll_bf16_sum"), 0);
        assert_eq!(priority("fc_reduce_to_bf16_sum"), 0);
        assert_eq!(priority("fc_reduce_to_direct_bf16_sum"), 2);
        assert_eq!(priority("fc_oneshot_i32_sum"), 2);
        assert_eq!(priority("fc_oneshot_f32_max"), 3);
        assert_eq!(priority("fc_qr_int4_bf16"), 3);
        let mut names = crate::algo::kernels::collective_kernel_names();
        names.sort_by_key(|n| priority(n));
        let first: Vec<_> = names.iter().take_while(|n| priority(n) == 0).collect();
        assert_eq!(
            first.len(),
            21,
            "five all-reduce kinds, the reduce-to and its LL twin for three float dtypes: {first:?}"
        );
    }
}
