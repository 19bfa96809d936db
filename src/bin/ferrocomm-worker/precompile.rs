//! `precompile-cuda`: compile the CUDA kernels for `--cc` into
//! `FERROCOMM_CACHE_DIR` with no GPU, one kernel per compile on every core.

#[cfg(feature = "cuda")]
use std::time::Instant;

#[cfg(not(feature = "cuda"))]
use ferrocomm::Error;
use ferrocomm::Result;

use crate::args::Args;

#[cfg(feature = "cuda")]
pub fn precompile_cuda(a: &Args) -> Result<String> {
    let (major, minor) = a.cc;
    // One kernel per compile, on every core: nothing else runs here.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let started = Instant::now();
    let (mut from_disk, mut compiled) = (0, 0);
    for module in ferrocomm::algo::kernels::ALL_MODULES {
        let t = Instant::now();
        let done = ferrocomm::backends::cuda::precompile_report(module, (major, minor), threads)?;
        println!(
            "{}: {} kernels compiled, {} already cached, {:.1} s",
            module.name,
            done.compiled,
            done.from_disk,
            t.elapsed().as_secs_f64()
        );
        from_disk += done.from_disk;
        compiled += done.compiled;
    }
    Ok(format!(
        "sm_{major}{minor}: {compiled} kernels compiled, {from_disk} already cached, on {threads} threads in {:.1} s",
        started.elapsed().as_secs_f64()
    ))
}

#[cfg(not(feature = "cuda"))]
pub fn precompile_cuda(_: &Args) -> Result<String> {
    Err(Error::NotCompiled {
        backend: "cuda",
        feature: "cuda",
    })
}
