#!/usr/bin/env bash
# Run the exchange and reduce-to kernels (kernels-cuda/collectives.cu) on the
# CPU over an emulated prelude (ci/emu/emu_prelude.h: a std::thread per GPU
# thread), against a sequential reference, with no GPU and no toolkit: g++ or
# clang++ with C++20 only. With TSAN=1 also under ThreadSanitizer, which sees
# the protocol's ordering (block barriers, release/acquire flags) as C++
# happens-before, so a missing wait shows up as a data race.
# `cargo test --test kernels_emu` runs the same (without TSan).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CXX="${CXX:-g++}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
FLAGS=(-std=c++20 -O1 -g -ffp-contract=off -pthread -Wall -Wno-unused-function -Wno-unknown-pragmas)
"$CXX" "${FLAGS[@]}" -o "$OUT/emu" "$ROOT/ci/emu/exchange_emu.cpp"
for seed in 1 2 3; do "$OUT/emu" "$seed"; done
if [ "${TSAN:-0}" = 1 ]; then
    "$CXX" "${FLAGS[@]}" -Wno-tsan -fsanitize=thread -o "$OUT/emu-tsan" "$ROOT/ci/emu/exchange_emu.cpp"
    TSAN_OPTIONS=halt_on_error=1 "$OUT/emu-tsan" 7
fi
