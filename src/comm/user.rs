//! User kernels written against the device API (`kernels-cuda/device_api.cuh`),
//! compiled at run time by NVRTC / hipRTC for the device's arch and
//! launched in stream order with the communicator's other work.
//!
//! ferrocomm prepends the vendor prelude and the device API to the user's
//! text, so a kernel compiles unchanged offline (`nvcc -I kernels-cuda`,
//! where its `#include "device_api.cuh"` finds the header) and here (where
//! that line is dropped: the run-time compilers get no include path).

use super::call::Call;
use super::communicator::Communicator;
use super::work::Work;
use crate::device::{BackendKind, Device, LaunchConfig, ModuleSource};
use crate::error::{Error, Result};

const CUDA_HEAD: &str = concat!(
    include_str!("../../kernels-cuda/prelude.cuh"),
    "\n",
    include_str!("../../kernels-cuda/device_api.cuh"),
    "\n"
);
const HIP_HEAD: &str = concat!(
    include_str!("../../kernels-hip/prelude.hip.h"),
    "\n",
    include_str!("../../kernels-cuda/device_api.cuh"),
    "\n"
);

/// A compiled user module: [`Communicator::load_user_module`].
pub struct UserModule<D: Device> {
    module: D::Module,
    name: &'static str,
}

/// The user's text with the includes ferrocomm supplies itself dropped.
fn strip_own_includes(text: &str) -> String {
    text.lines()
        .map(|l| {
            let t = l.trim_start();
            let own = t.starts_with("#include")
                && ["device_api.cuh", "prelude.cuh", "prelude.hip.h"]
                    .iter()
                    .any(|h| t.contains(&format!("{h}\"")) || t.contains(&format!("{h}>")));
            if own {
                "// (include supplied by ferrocomm)"
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

impl<D: Device> Communicator<D> {
    /// Compile `source` (CUDA C++ with `extern "C"` entry points that
    /// include `device_api.cuh`) for this device. Compile errors come back
    /// as [`Error::Compile`] with the compiler's log. The host backend has
    /// no compiler: [`Error::Unsupported`].
    ///
    /// Each call keeps its text for the life of the process (the module
    /// cache keys on it), so load a module once, not per launch.
    pub fn load_user_module(&self, name: &str, source: &str) -> Result<UserModule<D>> {
        let backend = self.inner.device.facts().backend;
        if backend == BackendKind::Host {
            return Err(Error::Unsupported(
                "user kernels need a GPU backend: the host backend runs Rust twins, not CUDA/HIP source".into(),
            ));
        }
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(Error::invalid(format!(
                "user module name {name:?}: use letters, digits and '_'"
            )));
        }
        let body = strip_own_includes(source);
        // ModuleSource holds 'static text (ferrocomm's own is embedded); a
        // user module is loaded once per process, so its text is kept.
        let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
        let name: &'static str = leak(format!("user_{name}"));
        let src = ModuleSource::raw(
            name,
            leak(format!("{CUDA_HEAD}{body}")),
            leak(format!("{HIP_HEAD}{body}")),
        );
        let module = self.inner.device.load_module(&src)?;
        self.inner.device.prepare(&module, &[])?;
        Ok(UserModule { module, name })
    }

    /// Launch `kernel` of `module` with `grid` x `block` threads; its one
    /// by-value parameter is the struct whose bytes are `args` (put a
    /// [`DevCtx`](crate::heap::DevCtx) from [`Communicator::device_ctx`] in
    /// it to reach the heap). Ordered on the call's stream after the
    /// communicator's earlier work, like a collective.
    ///
    /// # Safety
    /// `args` must be exactly what the kernel's parameter type expects, and
    /// every address in it valid for what the kernel does with it: the
    /// kernel runs arbitrary code on the device.
    pub unsafe fn launch_user(
        &self,
        module: &UserModule<D>,
        kernel: &str,
        grid: u32,
        block: u32,
        args: &[u8],
        call: &Call<'_, D>,
    ) -> Result<Work<D>> {
        if block % self.inner.device.facts().warp_size.max(1) != 0 {
            return Err(Error::invalid(format!(
                "launch of {}::{kernel}: block {block} is not a multiple of the warp size",
                module.name
            )));
        }
        let config = LaunchConfig::new(grid, block);
        self.submit(call, "user kernel", |s| {
            s.inner
                .device
                .launch_raw(&module.module, kernel, config, args, s.stream)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::strip_own_includes;

    #[test]
    fn own_includes_are_dropped_and_others_kept() {
        let t = "#include \"../device_api.cuh\"\n  #include <prelude.cuh>\n#include <cstdint>\nint x;";
        let s = strip_own_includes(t);
        assert!(!s.contains("device_api.cuh\"") && !s.contains("<prelude.cuh>"));
        assert!(s.contains("#include <cstdint>") && s.ends_with("int x;"));
    }
}
