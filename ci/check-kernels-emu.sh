#!/usr/bin/env bash
# Run device code on the CPU over an emulated prelude (ci/emu/emu_prelude.h:
# a std::thread per GPU thread), against sequential references, with no GPU
# and no toolkit: g++ or clang++ with C++20 only.
#  - exchange_emu.cpp: the exchange and reduce-to kernels, their direct
#    twins and their LL twins (fc_exchange_ll, fc_reduce_to_ll_*, between
#    one-shot LL all-reduces; kernels-cuda/collectives.cu), with buffers at
#    byte offsets not a multiple of their element where the host passes such
#    tensors (exchange and reduce-to);
#  - device_api_emu.cpp: the device API (kernels-cuda/device_api.cuh) and the
#    example all-gather (kernels-cuda/examples/user_allgather.cu);
#  - fused_emu.cpp: the fused all-reduce epilogues (kernels-cuda/fused.cu:
#    push one-shot, LL one-shot and two-shot, every pattern, f16 and bf16)
#    at worlds 2 and 3, calls of many chunks back to back on one workspace,
#    every output compared bit for bit with a reference written from
#    docs/protocol.md ("Fused epilogues"), with rows built so that a sum of
#    squares taken in another order changes the normed output.
# Every access of N bytes (element, 16-byte vector, volatile or atomic word,
# LL unit) at an address not a multiple of N, where a GPU faults, aborts with
# a FAIL line naming the access and its call site (and in exchange_emu the
# launch).
# With TSAN=1 also under ThreadSanitizer, which sees the protocols' ordering
# (block and warp barriers, release/acquire signals) as C++ happens-before,
# so a missing wait or a signal released too early shows up as a data race.
#  - qr_codec_emu.cpp: quick-reduce's codec kernel (every codec), only
#    compiled here: its inputs and the bytes it must produce come from the
#    Rust side (`cargo test --test kernels_emu`, against codec::encode).
# `cargo test --test kernels_emu` runs the same (without TSan), and also
# compiles the ABI checks of emu_prelude.h's FcParams and device_api.cuh's
# FcDevCtx against their Rust structs (src/device/abi.rs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CXX="${CXX:-g++}"
OUT="$(mktemp -d)"
# Every world of each program (the lean `cargo test` runs up to world 3).
unset FC_EMU_MAX_WORLD
trap 'rm -rf "$OUT"' EXIT
FLAGS=(-std=c++20 -O1 -g -ffp-contract=off -pthread -Wall -Wno-unused-function -Wno-unknown-pragmas)
for prog in exchange_emu device_api_emu fused_emu; do
    "$CXX" "${FLAGS[@]}" -o "$OUT/$prog" "$ROOT/ci/emu/$prog.cpp"
    for seed in 1 2 3; do "$OUT/$prog" "$seed"; done
done
"$CXX" "${FLAGS[@]}" -o "$OUT/qr_codec_emu" "$ROOT/ci/emu/qr_codec_emu.cpp"
if [ "${TSAN:-0}" = 1 ]; then
    for prog in exchange_emu device_api_emu fused_emu; do
        "$CXX" "${FLAGS[@]}" -Wno-tsan -fsanitize=thread -o "$OUT/$prog-tsan" "$ROOT/ci/emu/$prog.cpp"
        TSAN_OPTIONS=halt_on_error=1 "$OUT/$prog-tsan" 7
    done
fi
