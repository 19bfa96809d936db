//! The exchange and reduce-to kernels (`kernels-cuda/collectives.cu`) run on
//! the CPU over an emulated device prelude (`ci/emu/`): several ranks of
//! several blocks of threads, calls of several chunks back to back, odd
//! counts, unaligned and in-place buffers, premul_sum and a count mismatch,
//! against a sequential reference. Needs a C++20 compiler (`CXX`, default
//! `g++`); skipped with a reason without one, unless `FERROCOMM_REQUIRE_EMU=1`.
//! `ci/check-kernels-emu.sh` runs it too, and with `TSAN=1` under
//! ThreadSanitizer.

use std::path::Path;
use std::process::Command;

#[test]
fn exchange_and_reduce_to_kernels_run_on_the_cpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let require = std::env::var("FERROCOMM_REQUIRE_EMU").as_deref() == Ok("1");
    let out = std::env::temp_dir().join(format!("ferrocomm-kernels-emu-{}", std::process::id()));
    let compiled = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O1",
            "-ffp-contract=off",
            "-pthread",
            "-Wno-unknown-pragmas",
            "-o",
        ])
        .arg(&out)
        .arg(root.join("ci/emu/exchange_emu.cpp"))
        .output();
    let compiled = match compiled {
        Ok(o) if o.status.success() => o,
        Ok(o) if !require => {
            eprintln!(
                "SKIPPED: {cxx} could not compile the emulation (C++20 <barrier> needed):\n{}",
                String::from_utf8_lossy(&o.stderr)
            );
            return;
        }
        Err(e) if !require => {
            eprintln!("SKIPPED: no C++ compiler {cxx}: {e}");
            return;
        }
        Ok(o) => panic!("{cxx} failed:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => panic!("FERROCOMM_REQUIRE_EMU=1 but {cxx} cannot run: {e}"),
    };
    drop(compiled);
    for seed in ["1", "2"] {
        let run = Command::new(&out).arg(seed).output().expect("running the emulation");
        let text = String::from_utf8_lossy(&run.stdout);
        println!("seed {seed}:\n{text}");
        assert!(run.status.success() && text.contains("all ok"), "seed {seed}:\n{text}");
    }
    let _ = std::fs::remove_file(&out);
}
