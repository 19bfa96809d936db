//! Device code run on the CPU over an emulated device prelude (`ci/emu/`):
//! several ranks of several blocks of threads, against sequential
//! references.
//!
//! - `exchange_emu.cpp`: the exchange and reduce-to kernels
//!   (`kernels-cuda/collectives.cu`): calls of several chunks back to back,
//!   odd counts, unaligned and in-place buffers, premul_sum and a count
//!   mismatch; the direct exchange into per-rank heaps (all-to-all and
//!   all-gather lists, its fallback to the inbox exchange when one rank
//!   cannot take blocks in place, interleaved with inbox exchanges on the
//!   same blocks, each launch's output and epoch advance checked before the
//!   rank's next launch); the direct reduce-to from per-rank heaps
//!   (reduce-scatter and reduce, in place, aligned and not, premul_sum, its
//!   fallback, interleaved with inbox reduce-tos on the same inputs, inputs
//!   checked untouched, a count mismatch from either side); the LL twins
//!   (`fc::exchange_ll`, `fc::reduce_to_ll`: all-gather, gather, scatter,
//!   reduce-scatter and reduce, in place and not, worlds 2 to 8, runs of LL
//!   launches between inbox, direct and one-shot launches, each launch's
//!   whole buffer and epoch advance checked, fingerprint mismatches and a
//!   peer that never launches); blocks, inputs and outputs at byte offsets
//!   that are not a multiple of their element, where the host passes such
//!   tensors (the exchange and the reduce-to kinds).
//! - `device_api_emu.cpp`: the device API (`kernels-cuda/device_api.cuh`) and
//!   the example all-gather (`kernels-cuda/examples/user_allgather.cu`):
//!   repeated all-gathers, puts and gets at every granularity, signals,
//!   barriers, remote atomics, timeouts.
//! - `fused_emu.cpp`: the fused all-reduce epilogues (`kernels-cuda/fused.cu`:
//!   `fused_oneshot`, `fused_oneshot_ll`, `fused_twoshot`; every pattern, f16
//!   and bf16) at worlds 2 and 3: calls of many chunks (one-shot and
//!   two-shot, empty segments and short pieces included) back to back on
//!   one workspace across kinds, blocks of one row (the block walker) and of
//!   many (the group walker), in place, NaN, infinities, zero rows; every
//!   rank's residual_out, norm_out, allreduce_out, codes and per-token
//!   scales compared bit for bit with a reference written from
//!   docs/protocol.md ("Fused epilogues"), on rows built so that a sum of
//!   squares in another order changes the normed output; inputs, the bytes
//!   around every tensor, error words and epoch advances checked.
//!
//! The emulated prelude aborts on any access a GPU would fault on (`N`
//! bytes at an address not a multiple of `N`: element loads and stores,
//! 16-byte vectors, volatile and atomic words, LL units), printing a FAIL
//! line that names the access and its call site (and, in `exchange_emu.cpp`,
//! the launch).
//!
//! - `qr_codec_emu.cpp`: quick-reduce's codec kernel (`fc::qr_encode_run`
//!   of `kernels-cuda/quickreduce.cu`), every codec, f16 and bf16, on the
//!   conformance suite's special blocks (NaN, Inf, zero, equal, huge, tiny,
//!   -0, INT4 and FP4 rounding ties) and Gaussian data: the encoded bytes
//!   equal `codec::encode`'s, the host reference, bit for bit.
//!
//! Also, without running anything: the emulated prelude's `struct FcParams`
//! and the device API's `struct FcDevCtx`, compiled by the host compiler,
//! are laid out as their Rust sources (`ferrocomm::device::abi`: every
//! field's offset and size).
//!
//! Each emulation runs every case once a seed (the seed draws the random
//! counts, splits and data). The full sweep (`FERROCOMM_TEST_FULL=1`, run by
//! CI) runs two seeds at every world of each program (2, 3, 4 and, for the
//! LL exchanges, 8). The lean run (`cargo test`) runs one seed at worlds 2
//! and 3 only (`FC_EMU_MAX_WORLD=3`: the fused epilogues run only there
//! anyway); the threads of worlds 4 and 8 are most of the run time.
//!
//! Needs a C++20 compiler (`CXX`, default `g++`); skipped with a reason
//! without one, unless `FERROCOMM_REQUIRE_EMU=1`. `ci/check-kernels-emu.sh`
//! runs them too, and with `TSAN=1` under ThreadSanitizer.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferrocomm::algo::kernels::QR_CODECS;
use ferrocomm::codec::{self, Codec, Half16};
use ferrocomm::testing::data::FromF64;
use ferrocomm::testing::quick_reduce::qr_input_value;
use half::{bf16, f16};

/// The flags every emulation is compiled with.
const CXX_FLAGS: [&str; 5] = [
    "-std=c++20",
    "-O1",
    "-ffp-contract=off",
    "-pthread",
    "-Wno-unknown-pragmas",
];

/// What the emulated prelude needs of the compiler, and nothing of the
/// prelude itself.
const CXX20_PROBE: &str = r#"
#include <atomic>
#include <barrier>
#include <source_location>
int main() {
    unsigned long long w = 0;
    std::atomic_ref<unsigned long long>(w).store(1);
    std::barrier<> bar(1);
    bar.arrive_and_wait();
    _Float16 h = (_Float16)1.0f;
    return (int)(float)h - 1 + (int)(std::source_location::current().line() * 0);
}
"#;

/// Whether `cxx` has the C++20 the emulated prelude needs (`<barrier>`,
/// `std::atomic_ref`, `_Float16`, `<source_location>`): a compiler that has
/// not is a reason to skip; once it has, an emulation that does not compile
/// is a failure (a kernel source or a prelude that no compiler takes, or
/// whose ABI `static_assert`s fail, must not pass as skipped).
fn has_cxx20(cxx: &str, stem: &str) -> Result<(), String> {
    // Named per emulation: the tests run side by side in one process.
    let dir = std::env::temp_dir();
    let src = dir.join(format!("ferrocomm-{stem}-probe-{}.cpp", std::process::id()));
    let out = dir.join(format!("ferrocomm-{stem}-probe-{}", std::process::id()));
    std::fs::write(&src, CXX20_PROBE).map_err(|e| e.to_string())?;
    let probe = Command::new(cxx).args(CXX_FLAGS).arg("-o").arg(&out).arg(&src).output();
    let _ = std::fs::remove_file(&src);
    let _ = std::fs::remove_file(&out);
    match probe {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "{cxx} lacks the C++20 the emulated prelude needs (<barrier>, std::atomic_ref, _Float16):\n{}",
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Err(format!("no C++ compiler {cxx}: {e}")),
    }
}

/// The seeds each emulation runs with, and the largest world of their world
/// loops (`FC_EMU_MAX_WORLD`, none: every world); see the module comment.
fn seeds_and_max_world() -> (&'static [&'static str], Option<&'static str>) {
    if ferrocomm::testing::conformance::full_sweep() {
        (&["1", "2"], None)
    } else {
        (&["1"], Some("3"))
    }
}

/// Compiles `ci/emu/<source>`; `None` (skipped, with the reason printed)
/// without a C++20 compiler.
fn compile(source: &str) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let require = std::env::var("FERROCOMM_REQUIRE_EMU").as_deref() == Ok("1");
    let stem = source.trim_end_matches(".cpp");
    if let Err(why) = has_cxx20(&cxx, stem) {
        assert!(!require, "FERROCOMM_REQUIRE_EMU=1 but {why}");
        eprintln!("SKIPPED: {why}");
        return None;
    }
    let out = std::env::temp_dir().join(format!("ferrocomm-{stem}-{}", std::process::id()));
    let compiled = Command::new(&cxx)
        .args(CXX_FLAGS)
        .arg("-o")
        .arg(&out)
        .arg(root.join("ci/emu").join(source))
        .output()
        .unwrap_or_else(|e| panic!("{cxx} cannot run: {e}"));
    assert!(
        compiled.status.success(),
        "{cxx} failed on ci/emu/{source}:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    Some(out)
}

/// Compiles `ci/emu/<source>` and runs it once per seed; each run must print
/// "all ok".
fn run_emulation(source: &str) {
    let Some(out) = compile(source) else {
        return;
    };
    let (seeds, max_world) = seeds_and_max_world();
    for seed in seeds {
        let mut cmd = Command::new(&out);
        match max_world {
            Some(w) => cmd.env("FC_EMU_MAX_WORLD", w),
            None => cmd.env_remove("FC_EMU_MAX_WORLD"),
        };
        let run = cmd.arg(seed).output().expect("running the emulation");
        let text = String::from_utf8_lossy(&run.stdout);
        println!("{source} seed {seed}:\n{text}");
        assert!(
            run.status.success() && text.contains("all ok"),
            "{source} seed {seed}:\n{text}"
        );
    }
    let _ = std::fs::remove_file(&out);
}

#[test]
fn exchange_and_reduce_to_kernels_run_on_the_cpu() {
    run_emulation("exchange_emu.cpp");
}

#[test]
fn device_api_and_user_allgather_run_on_the_cpu() {
    run_emulation("device_api_emu.cpp");
}

#[test]
fn fused_epilogue_kernels_run_on_the_cpu() {
    run_emulation("fused_emu.cpp");
}

#[test]
fn quick_reduce_codec_kernel_encodes_as_the_host_on_the_cpu() {
    let Some(exe) = compile("qr_codec_emu.cpp") else {
        return;
    };
    for codec in QR_CODECS {
        encode_on_the_cpu::<f16>(&exe, codec, 65504.0);
        encode_on_the_cpu::<bf16>(&exe, codec, 3.389e38);
    }
    let _ = std::fs::remove_file(&exe);
}

/// One run of `qr_codec_emu` (`max`: the type's largest value): rank 0's
/// and then rank 1's conformance inputs (their special blocks hold the NaN
/// and the Inf), 4099 elements, so the last block is partial.
fn encode_on_the_cpu<S: FromF64 + Half16>(exe: &Path, codec: Codec, max: f64) {
    let x: Vec<S> = (0..4099)
        .map(|i| {
            let (rank, at) = if i < 1024 { (0, i) } else { (1, i - 1024) };
            S::from_f64(qr_input_value(7, rank, at, true, max * 0.75))
        })
        .collect();
    let mut want = vec![0u8; codec.encoded_bytes(x.len())];
    codec::encode(codec, &x, &mut want).expect("the host encodes");
    let dtype = <S as Half16>::DTYPE;
    let tag = format!("{}-{dtype:?}-{}", codec.name(), std::process::id());
    let (input, output) = (
        std::env::temp_dir().join(format!("ferrocomm-qr-in-{tag}")),
        std::env::temp_dir().join(format!("ferrocomm-qr-out-{tag}")),
    );
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    std::fs::write(&input, bytes).expect("writing the input");
    let bf = if dtype == ferrocomm::dtype::DType::BF16 {
        "1"
    } else {
        "0"
    };
    let run = Command::new(exe)
        .args([codec.name(), bf])
        .arg(&input)
        .arg(&output)
        .output()
        .expect("running qr_codec_emu");
    let got = std::fs::read(&output).unwrap_or_default();
    let _ = std::fs::remove_file(&input);
    let _ = std::fs::remove_file(&output);
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success() && text.contains("all ok"), "{tag}:\n{text}");
    assert_eq!(got.len(), want.len(), "{tag}: encoded length");
    if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
        panic!(
            "{tag}: the device code's encoded bytes differ from codec::encode first at byte {at} \
             (got {:#04x}, want {:#04x})",
            got[at], want[at]
        );
    }
}

/// The emulated prelude and the device API, then the `static_assert`s of
/// every ABI struct they declare (`ferrocomm::device::abi`): a field of
/// `FcParams` in `ci/emu/emu_prelude.h` (or of `FcDevCtx`) whose offset or
/// size differs from the Rust struct's fails the compile, naming the field.
#[test]
fn emulated_structs_match_the_rust_abi() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let require = std::env::var("FERROCOMM_REQUIRE_EMU").as_deref() == Ok("1");
    if let Err(why) = has_cxx20(&cxx, "abi") {
        assert!(!require, "FERROCOMM_REQUIRE_EMU=1 but {why}");
        eprintln!("SKIPPED: {why}");
        return;
    }
    let headers = [
        root.join("ci/emu/emu_prelude.h"),
        root.join("kernels-cuda/device_api.cuh"),
    ];
    let mut declared = String::new();
    let mut text = String::new();
    for h in &headers {
        declared += &std::fs::read_to_string(h).expect("reading a header");
        text += &format!("#include \"{}\"\n", h.display());
    }
    let checks = ferrocomm::device::abi::c_checks_for(&declared);
    assert!(
        checks.contains("FcParams::per_peer") && checks.contains("FcDevCtx::heap"),
        "the ABI checks found no struct FcParams or FcDevCtx in {headers:?}"
    );
    text += &checks;
    let src = std::env::temp_dir().join(format!("ferrocomm-abi-{}.cpp", std::process::id()));
    std::fs::write(&src, text).expect("writing the ABI check");
    let compiled = Command::new(&cxx)
        .args(CXX_FLAGS)
        .arg("-fsyntax-only")
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("{cxx} cannot run: {e}"));
    let _ = std::fs::remove_file(&src);
    assert!(
        compiled.status.success(),
        "the emulator's C structs differ from their Rust sources ({cxx}):\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
}
