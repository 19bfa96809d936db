//! Files only this user can read, for the torchrun rendezvous on one host:
//! rank 0 writes its store's address (and, when the launcher gave none, a
//! token it generated) into a mode-0600 file in a mode-0700 directory it
//! owns, and publishes only the file's path in torch's store. The other
//! ranks accept the file only if it is a regular file owned by their own uid,
//! unreadable to others, in such a directory, and written for this very
//! rendezvous. Whoever can read or write torch's (unauthenticated) store
//! learns a path, not the token, and cannot forge a file we would accept.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// First line of a rendezvous file.
const HEADER: &str = "ferrocomm-rendezvous 1";
/// A rendezvous file holds three short lines; anything bigger is not one.
const MAX_FILE_BYTES: u64 = 4096;

/// What rank 0 hands the other local ranks.
#[derive(Debug, PartialEq)]
pub(crate) struct RendezvousInfo {
    /// The torch-store key the path was published under: ties the file to
    /// this job, attempt and rendezvous.
    pub key: String,
    /// Where rank 0's store listens.
    pub addr: SocketAddr,
    /// The token rank 0 generated, when the launcher provided none.
    pub token: Option<String>,
}

impl RendezvousInfo {
    fn render(&self) -> String {
        let mut out = format!("{HEADER}\nkey {}\naddr {}\n", self.key, self.addr);
        if let Some(token) = &self.token {
            out.push_str(&format!("token {token}\n"));
        }
        out
    }

    fn parse(text: &str, shown: &Path) -> Result<RendezvousInfo> {
        let bad = |why: &str| Error::invalid(format!("{} is not a ferrocomm rendezvous file: {why}", shown.display()));
        let mut lines = text.lines();
        if lines.next() != Some(HEADER) {
            return Err(bad("wrong first line"));
        }
        let (mut key, mut addr, mut token) = (None, None, None);
        for line in lines {
            let (name, value) = line.split_once(' ').ok_or_else(|| bad("a line without a value"))?;
            let slot = match name {
                "key" => &mut key,
                "addr" => &mut addr,
                "token" => &mut token,
                _ => return Err(bad("an unknown line")),
            };
            if slot.replace(value.to_string()).is_some() {
                return Err(bad("a repeated line"));
            }
        }
        let addr = addr
            .ok_or_else(|| bad("no address"))?
            .parse()
            .map_err(|_| bad("the address does not parse"))?;
        Ok(RendezvousInfo {
            key: key.ok_or_else(|| bad("no key"))?,
            addr,
            token,
        })
    }
}

/// A rendezvous file that is removed when this value is dropped.
#[derive(Debug)]
pub(crate) struct RendezvousFile {
    path: PathBuf,
}

impl RendezvousFile {
    /// Write `info` to a new file in `dir` (see [`private_dir`]).
    pub(crate) fn create(dir: &Path, info: &RendezvousInfo) -> Result<RendezvousFile> {
        let name = format!("rendezvous-{}-{}", std::process::id(), random_hex(8)?);
        let path = dir.join(name);
        let shown = path.display().to_string();
        // O_EXCL and O_NOFOLLOW: never write through something already there.
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| Error::io(format!("creating rendezvous file {shown}"), e))?;
        let guard = RendezvousFile { path };
        file.write_all(info.render().as_bytes())
            .map_err(|e| Error::io(format!("writing rendezvous file {shown}"), e))?;
        Ok(guard)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RendezvousFile {
    fn drop(&mut self) {
        // Best effort: a leftover file in a private directory holds nothing
        // another user can read.
        let _ = fs::remove_file(&self.path);
    }
}

/// Read a rendezvous file written for `key`, refusing anything another user
/// could have written or read.
pub(crate) fn read_rendezvous_file(path: &Path, key: &str) -> Result<RendezvousInfo> {
    let shown = path.display();
    let uid = effective_uid();
    let parent = path
        .parent()
        .ok_or_else(|| Error::invalid(format!("rendezvous file path {shown} has no directory")))?;
    check_private_dir(parent, uid)?;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            let hint = if e.kind() == ErrorKind::NotFound {
                " (are all ranks on one host? LOCAL_WORLD_SIZE == WORLD_SIZE says so; for a job across \
                 hosts set FERROCOMM_TOKEN)"
            } else {
                ""
            };
            Error::io(format!("opening rendezvous file {shown}{hint}"), e)
        })?;
    // Checked on the opened file, so it cannot be swapped after the check.
    let meta = file
        .metadata()
        .map_err(|e| Error::io(format!("reading metadata of rendezvous file {shown}"), e))?;
    if !meta.is_file() {
        return Err(Error::invalid(format!("rendezvous file {shown} is not a regular file")));
    }
    if meta.uid() != uid {
        return Err(Error::invalid(format!(
            "rendezvous file {shown} belongs to uid {}, not to this process's uid {uid}; refusing it",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(Error::invalid(format!(
            "rendezvous file {shown} has mode {:04o}, so other users can reach it; refusing it",
            meta.mode() & 0o777
        )));
    }
    let mut text = String::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| Error::io(format!("reading rendezvous file {shown}"), e))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(Error::invalid(format!("rendezvous file {shown} is too large")));
    }
    let info = RendezvousInfo::parse(&text, path)?;
    if info.key != key {
        return Err(Error::invalid(format!(
            "rendezvous file {shown} was written for '{}', not for this rendezvous ('{key}')",
            info.key
        )));
    }
    Ok(info)
}

/// The directory for rendezvous files: `$XDG_RUNTIME_DIR/ferrocomm` when
/// that variable names an existing directory, else `$TMPDIR/ferrocomm-<uid>`
/// (`/tmp` without `TMPDIR`). Created with mode 0700; refused unless it is a
/// real directory (not a link) owned by us that no one else can enter.
pub(crate) fn private_dir(xdg_runtime_dir: Option<&str>, tmpdir: Option<&str>) -> Result<PathBuf> {
    let uid = effective_uid();
    let absolute = |v: Option<&str>| v.filter(|p| Path::new(p).is_absolute()).map(PathBuf::from);
    let fallback = absolute(tmpdir)
        .unwrap_or_else(|| PathBuf::from("/tmp"))
        .join(format!("ferrocomm-{uid}"));
    let dir = match absolute(xdg_runtime_dir) {
        Some(xdg) if xdg.is_dir() => xdg.join("ferrocomm"),
        _ => fallback,
    };
    match DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(format!("creating private directory {}", dir.display()), e)),
    }
    check_private_dir(&dir, uid)?;
    Ok(dir)
}

fn check_private_dir(dir: &Path, uid: u32) -> Result<()> {
    let shown = dir.display();
    // symlink_metadata: a link planted in our place is refused, not followed.
    let meta = fs::symlink_metadata(dir).map_err(|e| Error::io(format!("inspecting private directory {shown}"), e))?;
    let fix = "remove it, point XDG_RUNTIME_DIR or TMPDIR elsewhere, or set FERROCOMM_TOKEN";
    if !meta.file_type().is_dir() {
        return Err(Error::invalid(format!(
            "{shown} is not a directory (or is a symbolic link); {fix}"
        )));
    }
    if meta.uid() != uid {
        return Err(Error::invalid(format!(
            "private directory {shown} belongs to uid {}, not to us (uid {uid}); {fix}",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(Error::invalid(format!(
            "private directory {shown} has mode {:04o}, so other users can reach it; run `chmod 700 {shown}`",
            meta.mode() & 0o777
        )));
    }
    Ok(())
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A fresh random token: 32 bytes from the OS, as 64 hex digits.
pub(crate) fn random_token() -> Result<String> {
    random_hex(32)
}

fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    fill_random(&mut buf).map_err(|e| Error::io("reading random bytes from the OS", e))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is a valid, exclusively borrowed buffer of
        // `rest.len()` bytes for the whole call.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                ErrorKind::Interrupted => continue,
                // Kernels before 3.17 lack getrandom.
                _ if e.raw_os_error() == Some(libc::ENOSYS) => {
                    return File::open("/dev/urandom")?.read_exact(&mut buf[filled..]);
                }
                _ => return Err(e),
            }
        }
        filled += n.unsigned_abs();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A scratch directory of our own, standing in for the runtime dir.
    fn scratch(name: &str) -> PathBuf {
        let base = std::env::temp_dir().join(format!("ferrocomm-pf-test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(&base).expect("scratch dir");
        base
    }

    fn info(key: &str) -> RendezvousInfo {
        RendezvousInfo {
            key: key.into(),
            addr: "127.0.0.1:4242".parse().expect("addr"),
            token: Some("ab".repeat(32)),
        }
    }

    #[test]
    fn round_trip_and_removal_on_drop() {
        let base = scratch("roundtrip");
        let dir = private_dir(None, base.to_str()).expect("private dir");
        assert_eq!(fs::metadata(&dir).expect("meta").permissions().mode() & 0o777, 0o700);
        let file = RendezvousFile::create(&dir, &info("ferrocomm/run/attempt_0/gen_1/store")).expect("create");
        assert_eq!(
            fs::metadata(file.path()).expect("meta").permissions().mode() & 0o777,
            0o600
        );
        let read = read_rendezvous_file(file.path(), "ferrocomm/run/attempt_0/gen_1/store").expect("read");
        assert_eq!(read, info("ferrocomm/run/attempt_0/gen_1/store"));
        // Written for another rendezvous: refused.
        let err = read_rendezvous_file(file.path(), "ferrocomm/run/attempt_0/gen_2/store").expect_err("other key");
        assert!(err.to_string().contains("not for this rendezvous"), "{err}");
        let path = file.path().to_path_buf();
        drop(file);
        assert!(!path.exists(), "removed on drop");
        fs::remove_dir_all(&base).expect("clean up");
    }

    #[test]
    fn loose_modes_links_and_garbage_are_refused() {
        let base = scratch("refuse");
        let dir = private_dir(None, base.to_str()).expect("private dir");
        let file = RendezvousFile::create(&dir, &info("k")).expect("create");

        fs::set_permissions(file.path(), fs::Permissions::from_mode(0o644)).expect("chmod");
        let err = read_rendezvous_file(file.path(), "k").expect_err("0644");
        assert!(err.to_string().contains("mode 0644"), "{err}");
        fs::set_permissions(file.path(), fs::Permissions::from_mode(0o600)).expect("chmod");

        let link = dir.join("link");
        std::os::unix::fs::symlink(file.path(), &link).expect("symlink");
        assert!(read_rendezvous_file(&link, "k").is_err(), "a link is not followed");

        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).expect("chmod dir");
        let err = read_rendezvous_file(file.path(), "k").expect_err("open directory");
        assert!(err.to_string().contains("other users can reach it"), "{err}");
        assert!(
            private_dir(None, base.to_str()).is_err(),
            "a loose private dir is refused"
        );
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).expect("chmod dir");

        let junk = dir.join("junk");
        fs::write(&junk, "not a rendezvous file\n").expect("write");
        fs::set_permissions(&junk, fs::Permissions::from_mode(0o600)).expect("chmod");
        assert!(read_rendezvous_file(&junk, "k").is_err());
        drop(file);
        fs::remove_dir_all(&base).expect("clean up");
    }

    #[test]
    fn tokens_are_random_hex() {
        let (a, b) = (random_token().expect("token"), random_token().expect("token"));
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
