//! Where autotune's tables are kept between runs: a private file per key
//! in the cache directory, or, with the directory off, this process's memory.

use std::path::PathBuf;

use crate::comm::communicator::Communicator;
use crate::device::Device;
use crate::plan::table::decode;
use crate::plan::table::encode;
use crate::plan::Ladders;

/// What a table depends on. The version tag changes whenever the table's
/// format or meaning does, so older files are not read (they are measured
/// over: a key that differs is no cache).
pub(super) fn cache_key<D: Device>(comm: &Communicator<D>) -> String {
    let inner = &*comm.inner;
    let f = inner.device.facts();
    format!(
        "ferrocomm {} autotune v2; deterministic {}; {} {} {} {} SMs; world {} on {}; slot {}; {}; NCCL/RCCL {}",
        env!("CARGO_PKG_VERSION"),
        u8::from(inner.opts.deterministic),
        f.backend.name(),
        f.name,
        f.arch,
        f.multiprocessors,
        inner.world,
        inner.topology.describe(),
        inner.opts.slot_bytes_for(f.backend),
        inner.device.versions(),
        comm.with_resources(|r| r.vendor.describe()).unwrap_or_default(),
    )
}

/// Tables measured in this process, by cache key, where the cache directory
/// is off (the file is the cache otherwise): a communicator created again,
/// or a sub-communicator of a shape measured before, adopts one without
/// measuring.
fn memo() -> &'static std::sync::Mutex<std::collections::HashMap<String, Ladders>> {
    static MEMO: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, Ladders>>> =
        std::sync::OnceLock::new();
    MEMO.get_or_init(Default::default)
}

pub(super) fn remembered(key: &str) -> Option<Ladders> {
    memo().lock().unwrap_or_else(|e| e.into_inner()).get(key).cloned()
}

pub(super) fn remember(key: &str, table: &Ladders) {
    memo()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key.to_string(), table.clone());
}

pub(super) fn fnv64(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The cached table, if the file is ours (owned by us, not writable by
/// group or others), for this key, and well formed. Anything else (another
/// version's file, a foreign or corrupt one) is no cache: measure again.
pub(super) fn read_cached(path: &PathBuf, key: &str) -> Option<Ladders> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o022 != 0 {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let (k, table) = text.split_once('\n')?;
    if k != key {
        return None;
    }
    match decode(table) {
        Ok(t) => Some(t),
        Err(e) => {
            crate::fc_log!(
                tracing::Level::WARN,
                "autotune: ignoring the cached table at {}: {e}",
                path.display()
            );
            None
        }
    }
}

pub(super) fn write_cached(path: &PathBuf, key: &str, table: &Ladders) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = path.parent().unwrap_or(path);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    writeln!(f, "{key}")?;
    writeln!(f, "{}", encode(table))?;
    drop(f);
    std::fs::rename(&tmp, path)
}
