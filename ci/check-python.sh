#!/usr/bin/env bash
# The Python package (python/): lint its Rust crate, build the wheel with
# maturin, install it into a venv and run its pytest suite on the CPU (host
# backend; the GPU tests skip, saying why). Needs python3 (3.9+) with venv or
# pip, and cargo. Environment knobs:
#   PYTHON                 interpreter (default python3)
#   FERROCOMM_PY_PIP_SPECS what to install from PyPI (default: pinned maturin, numpy, pytest)
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
CACHE=".ci-cache"
VENV="$CACHE/py-venv"
SPECS="${FERROCOMM_PY_PIP_SPECS:-maturin==1.16.0 numpy==2.4.6 pytest==9.2.0}"
mkdir -p "$CACHE"

echo "--- cargo fmt --check, clippy -D warnings (python/)"
cargo fmt --check --manifest-path python/Cargo.toml
cargo clippy --manifest-path python/Cargo.toml --all-targets -- -D warnings

echo "--- venv with $SPECS"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-input --quiet $SPECS

echo "--- maturin build --release (abi3 wheel, every backend)"
rm -rf "$CACHE/wheels"
(cd python && "../$VENV/bin/maturin" build --release --out "../$CACHE/wheels")
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-input --quiet --force-reinstall --no-deps \
    "$CACHE"/wheels/ferrocomm-*.whl

echo "--- the GPU benches and scripts compile (they run on the GPU machine only)"
"$VENV/bin/python" -c 'import ast, sys; [ast.parse(open(f).read(), f) for f in sys.argv[1:]]' \
    python/bench/*.py python/examples/*.py python/ferrocomm/*.py python/tests/*.py

echo "--- pytest python/tests (CPU: host backend at worlds 1, 2 and 3)"
# From the tests folder, so `import ferrocomm` finds the installed wheel,
# not the source folder without its native module.
(cd python/tests && "../../$VENV/bin/python" -m pytest -q -p no:cacheprovider .)

echo "--- pip install ./python into a fresh venv, then the README's CPU example (two ranks, host backend)"
FRESH="$PWD/$CACHE/py-fresh"
rm -rf "$FRESH"
"$PY" -m venv "$FRESH"
"$FRESH/bin/python" -m pip install --disable-pip-version-check --no-input --quiet numpy==2.4.6 ./python
(cd "$CACHE" && "$FRESH/bin/python" ../python/examples/host_allreduce.py)
