#!/usr/bin/env bash
# Build the CUDA binaries here (no CUDA needed) and copy what ci/gpu-cuda.sh
# runs into .carry/ (gitignored), ready to travel to a GPU machine: the bench
# and worker, every GPU test binary (conformance_* holds the device tests of
# tests/common/gpu_device.rs, including the borrow_stream, check_memory,
# export_range, lazy-compile and cold-start tests; process_* the multi-process
# scenarios; torchrun_store the tests against torch's real TCPStore), the
# engine example (examples/engine_cudarc.rs), the shared baseline scripts,
# the Python wheel (ci/pack-python.sh; PACK_PYTHON=0 skips it), and the sm_90
# kernels precompiled one file per kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
FEATURES="${FEATURES:-cuda,nccl}"
cargo build --release --features "$FEATURES" --bins
if [[ "$FEATURES" == *cuda* ]]; then
    cargo build --release --features "$FEATURES" --example engine_cudarc
fi
mkdir -p .carry/bin
cargo test --release --features "$FEATURES" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, shutil, sys
want = {"conformance_cuda", "process_cuda", "conformance_hip", "process_hip", "torchrun_store", "heap_cuda", "ep_cuda"}
packed = set()
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t.get("name") in want and "test" in t.get("kind", []):
        shutil.copy(m["executable"], ".carry/bin/" + t["name"])
        packed.add(t["name"])
        print("packed", t["name"])
# The CUDA build must carry both CUDA test binaries.
missing = {"conformance_cuda", "process_cuda", "heap_cuda"} - packed if "cuda" in sys.argv[1] else set()
if missing:
    sys.exit("pack-gpu: test binaries not built: " + ", ".join(sorted(missing)))
' "$FEATURES"
cp target/release/ferrocomm-bench target/release/ferrocomm-worker .carry/bin/
if [[ "$FEATURES" == *cuda* ]]; then
    cp target/release/examples/engine_cudarc .carry/bin/
fi
strip .carry/bin/* 2>/dev/null || true
# The GPU machine sees only this checkout, not ../shared.
for b in torch_allreduce_bench torch_collectives_bench; do
    if [ -f "../shared/baselines/$b.py" ]; then
        cp "../shared/baselines/$b.py" .carry/
    fi
done
if [ "${PACK_PYTHON:-1}" != 0 ]; then
    bash ci/pack-python.sh
    # pytest for the GPU machine, which cannot reach PyPI.
    rm -rf .carry/pywheels
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 -d .carry/pywheels pytest
fi
# Precompile the CUDA kernels for sm_90 (H100/H200) with the NVRTC wheel that
# ci/check-kernels-cuda.sh installs, so the GPU machine skips NVRTC.
# (A fresh checkout has no .ci-cache: find fails, which must not end the pack.)
NVRTC="$(find .ci-cache -name 'libnvrtc.so.13' 2>/dev/null | head -n 1 || true)"
if [[ "$FEATURES" == *cuda* ]] && [ -n "$NVRTC" ]; then
    NVRTC="$(readlink -f "$NVRTC")"
    rm -rf .carry/kcache && mkdir -p .carry/kcache && chmod 700 .carry/kcache
    # One kernel per compile on every core; the GPU machine loads each
    # kernel's file as it first needs it.
    LD_LIBRARY_PATH="$(dirname "$NVRTC")" FERROCOMM_NVRTC_LIB="$NVRTC" FERROCOMM_CACHE_DIR="$PWD/.carry/kcache" \
        target/release/ferrocomm-worker precompile-cuda --cc "${CUDA_CC:-9.0}"
else
    echo "no NVRTC wheel under .ci-cache (run ci/check-kernels-cuda.sh): the GPU machine will compile the kernels itself"
fi
du -sh .carry
