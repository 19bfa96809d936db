//! The on-disk and naming half of the kernel caches shared by the CUDA and
//! HIP backends: compiled images keyed by a hash of (module, source, options,
//! compiler version), stored only in a directory the user owns and nobody
//! else can write, written atomically (temp file + rename).

use std::path::{Path, PathBuf};

/// Two FNV-1a-64 passes with different offset bases: a 128-bit cache key that
/// is stable across Rust versions and runs.
pub(super) fn cache_key(parts: &[&[u8]]) -> String {
    let mut h = [0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64];
    for part in parts {
        for hv in h.iter_mut() {
            for &b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
                *hv ^= b as u64;
                *hv = hv.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    format!("{:016x}{:016x}", h[0], h[1])
}

pub(super) fn sanitize(name: &str) -> String {
    let s: String = name
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "module".into()
    } else {
        s
    }
}

pub(super) const MAX_CACHED_IMAGE: u64 = 256 << 20;

pub(super) fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os("FERROCOMM_CACHE_DIR") {
        Some(v) => {
            let s = v.to_string_lossy();
            if s.is_empty() || ["off", "0", "none", "false"].contains(&s.to_ascii_lowercase().as_str()) {
                None
            } else {
                Some(PathBuf::from(v))
            }
        }
        None => std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME")
                    .filter(|v| !v.is_empty())
                    .map(|h| PathBuf::from(h).join(".cache"))
            })
            .map(|base| base.join("ferrocomm")),
    }
}

/// True when `meta` belongs to us and nobody else can write it.
fn trusted(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    meta.uid() == me && meta.mode() & 0o022 == 0
}

pub(super) fn disk_read(path: &Path) -> Option<Vec<u8>> {
    let dir_ok = path
        .parent()
        .and_then(|d| std::fs::metadata(d).ok())
        .is_some_and(|m| m.is_dir() && trusted(&m));
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !dir_ok || !meta.is_file() || !trusted(&meta) || meta.len() == 0 || meta.len() > MAX_CACHED_IMAGE {
        return None;
    }
    std::fs::read(path).ok()
}

/// Best effort: a cache that cannot be written is simply not used.
pub(super) fn disk_write(dir: &Path, file: &str, bytes: &[u8]) {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .is_err()
    {
        return;
    }
    if !std::fs::metadata(dir).is_ok_and(|m| m.is_dir() && trusted(&m)) {
        return;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!("{file}.tmp-{}-{nanos}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes));
    if written.is_err() || std::fs::rename(&tmp, dir.join(file)).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}
