#!/usr/bin/env bash
# Build the Python wheel here (no CUDA or ROCm needed) for a GPU machine:
# abi3 (CPython 3.9+), manylinux_2_28 x86_64 (linked against glibc 2.28 through
# zig, so it installs on any distribution torch's wheels install on), every
# backend in it. The wheel lands in .carry/python/ (gitignored); on the GPU
# machine:
#   pip install .carry/python/ferrocomm-*.whl
#   FERROCOMM_REQUIRE_GPU=1 python -m pytest python/tests/test_gpu_torch.py -v
#   torchrun --nproc_per_node=2 python/bench/bench_torch.py
# (FERROCOMM_CACHE_DIR=$PWD/.carry/kcache reuses the kernels ci/pack-gpu.sh precompiled.)
# Environment knobs: PYTHON (default python3); COMPATIBILITY (default
# manylinux_2_28; "native" builds without zig for this machine's glibc).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=".ci-cache/py-venv"
COMPAT="${COMPATIBILITY:-manylinux_2_28}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-input --quiet "maturin==1.16.0"
rm -rf .carry/python && mkdir -p .carry/python
if [ "$COMPAT" = native ]; then
    (cd python && "../$VENV/bin/maturin" build --release --out ../.carry/python)
else
    "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input --quiet "ziglang==0.17.1" \
        || "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input --quiet ziglang
    (cd python && PATH="$PWD/../$VENV/bin:$PATH" "../$VENV/bin/maturin" build --release --zig \
        --compatibility "$COMPAT" --out ../.carry/python)
fi
ls -l .carry/python
