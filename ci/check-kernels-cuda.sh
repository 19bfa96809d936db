#!/usr/bin/env bash
# Compile-check every CUDA kernel with NVRTC 13.x, with no GPU and no CUDA
# toolkit: NVRTC comes from the PyPI wheel `nvidia-cuda-nvrtc` (which also
# ships libnvrtc-builtins), installed under .ci-cache/ (gitignored), then
# `cargo test --test kernels_cuda_compile` compiles every module for sm_80 and
# sm_90 (ptxas runs, so inline PTX is checked) and checks the entry points.
#
# Needs only python3 (3.8+) with pip, and cargo. Environment knobs:
#   FERROCOMM_NVRTC_PIP_SPEC  pip requirement (default nvidia-cuda-nvrtc==13.0.88)
#   PYTHON                    interpreter (default python3)
#   FERROCOMM_ALLOW_SPILLS=1  report register spills as warnings, not failures
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SPEC="${FERROCOMM_NVRTC_PIP_SPEC:-nvidia-cuda-nvrtc==13.0.88}"
PY="${PYTHON:-python3}"
CACHE="$ROOT/.ci-cache"
VENV="$CACHE/nvrtc-venv"
TARGET="$CACHE/nvrtc-pip"
STAMP_NAME=".ferrocomm-nvrtc-spec"
mkdir -p "$CACHE"

installed() { # $1: dir holding the stamp
    [ -f "$1/$STAMP_NAME" ] && [ "$(cat "$1/$STAMP_NAME")" = "$SPEC" ]
}

LIBROOT=""
if installed "$VENV"; then
    LIBROOT="$VENV"
elif installed "$TARGET"; then
    LIBROOT="$TARGET"
else
    # Prefer a venv; fall back to `pip install --target` where venv/ensurepip is missing.
    rm -rf "$VENV"
    if "$PY" -m venv "$VENV" >/dev/null 2>&1 && [ -x "$VENV/bin/python" ]; then
        echo "check-kernels-cuda: installing $SPEC into $VENV"
        "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input --quiet "$SPEC"
        echo "$SPEC" >"$VENV/$STAMP_NAME"
        LIBROOT="$VENV"
    else
        rm -rf "$VENV" "$TARGET"
        echo "check-kernels-cuda: no venv available; installing $SPEC into $TARGET"
        "$PY" -m pip install --disable-pip-version-check --no-input --quiet --target "$TARGET" "$SPEC"
        echo "$SPEC" >"$TARGET/$STAMP_NAME"
        LIBROOT="$TARGET"
    fi
fi

LIB="$(find "$LIBROOT" -name 'libnvrtc.so.13' -path '*nvidia*' 2>/dev/null | sort | head -n 1)"
if [ -z "$LIB" ]; then
    echo "check-kernels-cuda: libnvrtc.so.13 not found under $LIBROOT (is $SPEC a CUDA 13 wheel?)" >&2
    exit 1
fi
LIBDIR="$(dirname "$LIB")"
if ! ls "$LIBDIR"/libnvrtc-builtins.so.* >/dev/null 2>&1; then
    echo "check-kernels-cuda: libnvrtc-builtins.so.* missing next to $LIB" >&2
    exit 1
fi

export FERROCOMM_NVRTC_LIB="$LIB"
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FERROCOMM_REQUIRE_NVRTC=1
echo "check-kernels-cuda: FERROCOMM_NVRTC_LIB=$FERROCOMM_NVRTC_LIB"

cargo test --test kernels_cuda_compile -- --nocapture
