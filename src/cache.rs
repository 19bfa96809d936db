//! Where ferrocomm keeps what it learns between runs: compiled kernels
//! (`backends/gpu/compile/disk.rs`) and autotune tables (`comm/autotune.rs`).

use std::path::PathBuf;

/// `$FERROCOMM_CACHE_DIR` (`off`, `0`, `none`, `false` or empty disable the
/// cache), else `$XDG_CACHE_HOME/ferrocomm` or `~/.cache/ferrocomm`.
pub fn cache_dir() -> Option<PathBuf> {
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
