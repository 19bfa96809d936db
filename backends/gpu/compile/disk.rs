//! The on-disk kernel cache: one file per compile unit, named by a 128-bit
//! hash of (module, unit text, options, compiler version, arch), in a
//! directory the user owns and nobody else can write (a writable kernel
//! cache would be code injection), written atomically (temp file + rename).
//!
//! Every file starts with a header (magic, format, payload length, the key
//! it was written for, a hash of the payload), and the image itself must
//! look like its kind (ELF, NUL-terminated PTX). A file that is damaged,
//! truncated, written for another key, or not owned by us is ignored with a
//! warning and rebuilt, never loaded.

use std::path::Path;

use crate::backends::gpu::vendor::ImageKind;

const MAGIC: &[u8; 4] = b"FCKC";
const FORMAT_VERSION: u32 = 1;
const KEY_BYTES: usize = 32;
const HEADER_BYTES: usize = 4 + 4 + 8 + KEY_BYTES + 16;
/// Larger files are not read.
const MAX_CACHED_IMAGE: u64 = 256 << 20;

/// Two FNV-1a-64 passes with different offset bases, each part prefixed by
/// its length: a 128-bit key that is stable across Rust versions and runs.
fn fnv128(parts: &[&[u8]]) -> [u64; 2] {
    let mut h = [0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64];
    for part in parts {
        for hv in h.iter_mut() {
            for &b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
                *hv ^= b as u64;
                *hv = hv.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    h
}

/// The cache key of a unit: 32 hex digits.
pub fn cache_key(parts: &[&[u8]]) -> String {
    let h = fnv128(parts);
    format!("{:016x}{:016x}", h[0], h[1])
}

/// A file-name-safe form of `name` (at most 64 characters).
pub fn sanitize(name: &str) -> String {
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

pub use crate::cache::cache_dir;

/// True when `meta` belongs to us and nobody else can write it.
fn trusted(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    meta.uid() == me && meta.mode() & 0o022 == 0
}

fn warn_ignored(path: &Path, why: &str) {
    crate::fc_log!(
        tracing::Level::WARN,
        "kernel cache file {} {why}: ignoring it and compiling the kernel",
        path.display()
    );
}

/// The file's bytes with its header, for `key`.
fn framed(key: &str, image: &[u8]) -> Vec<u8> {
    let h = fnv128(&[image]);
    let mut out = Vec::with_capacity(HEADER_BYTES + image.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(image.len() as u64).to_le_bytes());
    let mut k = [b'0'; KEY_BYTES];
    let n = key.len().min(KEY_BYTES);
    k[..n].copy_from_slice(&key.as_bytes()[..n]);
    out.extend_from_slice(&k);
    out.extend_from_slice(&h[0].to_le_bytes());
    out.extend_from_slice(&h[1].to_le_bytes());
    out.extend_from_slice(image);
    out
}

/// The image inside `file`, or why it is not one for `key` of `kind`.
fn unframe(file: &[u8], key: &str, kind: ImageKind) -> Result<Vec<u8>, &'static str> {
    if file.len() < HEADER_BYTES || &file[..4] != MAGIC {
        return Err("has no ferrocomm cache header");
    }
    if file[4..8] != FORMAT_VERSION.to_le_bytes() {
        return Err("has another cache format version");
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&file[8..16]);
    if u64::from_le_bytes(len) != (file.len() - HEADER_BYTES) as u64 {
        return Err("is truncated or has trailing bytes");
    }
    if &file[16..16 + KEY_BYTES] != key.as_bytes() {
        return Err("was written for another kernel");
    }
    let image = &file[HEADER_BYTES..];
    let h = fnv128(&[image]);
    let mut want = [0u8; 16];
    want[..8].copy_from_slice(&h[0].to_le_bytes());
    want[8..].copy_from_slice(&h[1].to_le_bytes());
    if file[16 + KEY_BYTES..HEADER_BYTES] != want {
        return Err("is damaged (its hash does not match)");
    }
    if !kind.accepts(image) {
        return Err("does not hold an image of the expected kind");
    }
    Ok(image.to_vec())
}

/// The cached image for `key` in `dir/file`, or `None` (absent, or ignored
/// with a warning).
pub fn read(dir: &Path, file: &str, key: &str, kind: ImageKind) -> Option<Vec<u8>> {
    let path = dir.join(file);
    let meta = std::fs::symlink_metadata(&path).ok()?;
    let dir_ok = std::fs::metadata(dir).is_ok_and(|m| m.is_dir() && trusted(&m));
    if !dir_ok || !meta.is_file() || !trusted(&meta) {
        warn_ignored(&path, "is not a regular file in a directory only we own and can write");
        return None;
    }
    if meta.len() > MAX_CACHED_IMAGE {
        warn_ignored(&path, "is too large");
        return None;
    }
    let bytes = std::fs::read(&path).ok()?;
    match unframe(&bytes, key, kind) {
        Ok(image) => Some(image),
        Err(why) => {
            warn_ignored(&path, why);
            None
        }
    }
}

/// Store `image` for `key` as `dir/file`. Best effort: a cache that cannot
/// be written is simply not used.
pub fn write(dir: &Path, file: &str, key: &str, image: &[u8]) {
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
    let tid = format!("{:?}", std::thread::current().id());
    let tid: String = tid.chars().filter(char::is_ascii_digit).collect();
    let tmp = dir.join(format!("{file}.tmp-{}-{tid}-{nanos}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(&framed(key, image)));
    if written.is_err() || std::fs::rename(&tmp, dir.join(file)).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elf(n: usize) -> Vec<u8> {
        let mut b = b"\x7fELF".to_vec();
        b.extend((0..n).map(|i| (i * 7) as u8));
        b
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("ferrocomm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn cache_keys_separate_every_part() {
        let a = cache_key(&[b"m", b"src", b"opts", b"nvrtc 13.0"]);
        assert_eq!(a.len(), KEY_BYTES);
        assert_eq!(a, cache_key(&[b"m", b"src", b"opts", b"nvrtc 13.0"]));
        assert_ne!(a, cache_key(&[b"m", b"src", b"opts", b"nvrtc 13.1"]));
        assert_ne!(a, cache_key(&[b"ms", b"rc", b"opts", b"nvrtc 13.0"]));
    }

    #[test]
    fn file_names_are_sanitized() {
        assert_eq!(sanitize("../x y"), "___x_y");
        assert_eq!(sanitize(""), "module");
        assert_eq!(sanitize("gfx942:sramecc+"), "gfx942_sramecc_");
    }

    #[test]
    fn images_round_trip_and_damage_is_detected() {
        let dir = scratch("disk-cache-test");
        let key = cache_key(&[b"k"]);
        let image = elf(300);
        write(&dir, "a.cubin", &key, &image);
        assert_eq!(read(&dir, "a.cubin", &key, ImageKind::Elf).as_deref(), Some(&image[..]));
        let path = dir.join("a.cubin");
        let good = std::fs::read(&path).unwrap();

        // Each kind of damage is refused, and reads as absent.
        let other_key = cache_key(&[b"other"]);
        assert_eq!(read(&dir, "a.cubin", &other_key, ImageKind::Elf), None, "foreign key");
        assert_eq!(read(&dir, "a.cubin", &key, ImageKind::Ptx), None, "wrong image kind");
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("flipped byte", {
                let mut b = good.clone();
                let last = b.len() - 1;
                b[last] ^= 1;
                b
            }),
            ("truncated", good[..good.len() - 10].to_vec()),
            ("trailing bytes", [good.clone(), vec![0]].concat()),
            ("no header", image.clone()),
            ("empty", Vec::new()),
            ("other version", {
                let mut b = good.clone();
                b[4] = 9;
                b
            }),
        ];
        for (what, bytes) in cases {
            std::fs::write(&path, &bytes).unwrap();
            assert_eq!(read(&dir, "a.cubin", &key, ImageKind::Elf), None, "{what}");
        }
        // A framed file whose payload is not an image is refused too.
        std::fs::write(
            &path,
            framed(
                &key,
                b"not an elf at all, just text.......................................",
            ),
        )
        .unwrap();
        assert_eq!(read(&dir, "a.cubin", &key, ImageKind::Elf), None);
        // Rewriting repairs it.
        write(&dir, "a.cubin", &key, &image);
        assert!(read(&dir, "a.cubin", &key, ImageKind::Elf).is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn files_others_can_write_are_not_read() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("disk-cache-perm-test");
        let key = cache_key(&[b"k"]);
        write(&dir, "a.hsaco", &key, &elf(100));
        let path = dir.join("a.hsaco");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(read(&dir, "a.hsaco", &key, ImageKind::Elf), None, "world-writable file");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read(&dir, "a.hsaco", &key, ImageKind::Elf).is_some());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(
            read(&dir, "a.hsaco", &key, ImageKind::Elf),
            None,
            "world-writable directory"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
