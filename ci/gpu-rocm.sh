#!/usr/bin/env bash
# Run the ROCm GPU tests and the benchmark (ferrocomm against RCCL) on an AMD
# GPU machine (MI300X / MI325X / MI355X), writing logs under $OUT (or
# ./gpu-logs). The ROCm twin of ci/gpu-cuda.sh.
#
#   ci/gpu-rocm.sh [BIN_DIR] [STEPS...]
#   STEPS: tests process bench rccl_tests (default: all)
#
# BIN_DIR holds prebuilt binaries: conformance_hip (the test executable),
# ferrocomm-worker and ferrocomm-bench, built with `--features rocm,rccl`
# (and process_hip when that test exists). Without BIN_DIR, or when it lacks
# them, this script builds them here with cargo (`FEATURES`, default
# rocm,rccl) into target/release.
#
# Every test runs with FERROCOMM_REQUIRE_GPU=1, so a test that cannot reach
# its GPUs fails instead of skipping. Process runs launch one
# ferrocomm-worker per GPU with torchrun-style variables.
#
# Knobs: BENCH_DTYPES (bf16), BENCH_MAX (256M), RCCL_TESTS (a directory with
# rccl-tests' all_reduce_perf, for the RCCL-only baseline), FERROCOMM_HIP_ARCH
# (override the detected gfx target).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT="$PWD"
BIN_ARG="${1:-}"
shift || true
STEPS="${*:-tests process bench rccl_tests}"
LOG="${OUT:-$PWD/gpu-logs}"
mkdir -p "$LOG"
export FERROCOMM_REQUIRE_GPU=1
# RCCL on PCIe-only hosts needs fine-grained PCIe memory; harmless over XGMI.
export HSA_FORCE_FINE_GRAIN_PCIE="${HSA_FORCE_FINE_GRAIN_PCIE:-1}"
ROCM="${ROCM_PATH:-/opt/rocm}"
export PATH="$ROCM/bin:$PATH"
export LD_LIBRARY_PATH="$ROCM/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
failed=0

# ---- binaries ----
have_bins() { [ -x "$1/conformance_hip" ] && [ -x "$1/ferrocomm-worker" ] && [ -x "$1/ferrocomm-bench" ]; }
if [ -n "$BIN_ARG" ] && have_bins "$BIN_ARG"; then
    BIN="$(cd "$BIN_ARG" && pwd)"
else
    FEATURES="${FEATURES:-rocm,rccl}"
    BIN="$ROOT/target/release/gpu-rocm-bin"
    echo "=== building with --features $FEATURES into $BIN"
    mkdir -p "$BIN"
    cargo build --release --features "$FEATURES" --bins >"$LOG/build.log" 2>&1 || {
        echo "build failed, see $LOG/build.log"
        exit 1
    }
    # `cargo test --no-run` names each test executable on stderr.
    cargo test --release --features "$FEATURES" --no-run 2>&1 | tee -a "$LOG/build.log" |
        sed -n 's/.*Executable tests\/\([a-z_]*\)\.rs (\(.*\))$/\1 \2/p' |
        while read -r name exe; do
            case "$name" in conformance_hip | process_hip) cp "$exe" "$BIN/$name" ;; esac
        done
    cp target/release/ferrocomm-worker target/release/ferrocomm-bench "$BIN/"
    have_bins "$BIN" || {
        echo "could not find the test executables, see $LOG/build.log"
        exit 1
    }
fi
export FERROCOMM_WORKER_EXE="$BIN/ferrocomm-worker"

# ---- the machine ----
gpu_count() {
    local n=0 f
    for f in /sys/class/kfd/kfd/topology/nodes/*/properties; do
        [ -r "$f" ] || continue
        if awk '$1 == "gfx_target_version" && $2 != 0 { found = 1 } END { exit !found }' "$f"; then
            n=$((n + 1))
        fi
    done
    # HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES narrow what the runtime sees.
    local vis="${HIP_VISIBLE_DEVICES:-${ROCR_VISIBLE_DEVICES:-}}"
    if [ -n "$vis" ]; then
        n=$(echo "$vis" | tr ',' '\n' | grep -c .)
    fi
    echo "$n"
}
NGPU="$(gpu_count)"
{
    date -u
    (amd-smi static --asic --bus 2>/dev/null || rocm-smi --showproductname --showbus 2>/dev/null || true)
    (amd-smi topology 2>/dev/null || rocm-smi --showtopo 2>/dev/null || true)
    cat "$ROCM/.info/version" 2>/dev/null || true
    grep -h gfx_target_version /sys/class/kfd/kfd/topology/nodes/*/properties 2>/dev/null | sort | uniq -c
} >"$LOG/machine.txt" 2>&1
echo "GPUs: $NGPU" | tee "$LOG/summary.txt"

step() { # name, command...
    local name="$1"
    shift
    local t0=$SECONDS
    echo "=== $name: $*"
    "$@" >"$LOG/$name.log" 2>&1
    local rc=$?
    printf '%-30s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$LOG/summary.txt"
    grep -E "^test |test result|RESULT|SKIPPED|panicked|HIP backend|hipRTC" "$LOG/$name.log" | tail -15
    [ "$rc" = 0 ] || failed=1
}

# One ferrocomm-worker per GPU (rank r on GPU r), torchrun-style rendezvous.
# Usage: ranks WORLD VICTIM ARGS...; VICTIM is the rank expected to die by
# SIGKILL (kill scenario) or -1. Succeeds when every other rank prints
# "RESULT ok" and exits 0 within the time limit.
# shellcheck disable=SC2317 # called through step "$@"
ranks() {
    local world="$1" victim="$2"
    shift 2
    local port=$((20000 + RANDOM % 20000))
    local token
    token="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
    local dir
    dir="$(mktemp -d)"
    local pids=() r
    for ((r = 0; r < world; r++)); do
        MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" RANK="$r" LOCAL_RANK="$r" WORLD_SIZE="$world" \
            FERROCOMM_TOKEN="$token" timeout -k 10 900 "$BIN/ferrocomm-worker" "$@" >"$dir/$r.out" 2>"$dir/$r.err" &
        pids+=($!)
    done
    local ok=0 code
    for ((r = 0; r < world; r++)); do
        wait "${pids[$r]}"
        code=$?
        echo "--- rank $r exit $code"
        cat "$dir/$r.out"
        tail -5 "$dir/$r.err"
        if [ "$r" = "$victim" ]; then
            [ "$code" = 137 ] || [ "$code" -gt 128 ] || {
                echo "rank $r should have died by SIGKILL"
                ok=1
            }
        elif [ "$code" != 0 ] || ! grep -q "RESULT ok" "$dir/$r.out"; then
            ok=1
        fi
    done
    rm -rf "$dir"
    return "$ok"
}

if [[ " $STEPS " == *" tests "* ]]; then
    skip=()
    for w in 3 4 8; do # thread-rank worlds this machine cannot host, named in the log
        if [ "$NGPU" -lt "$w" ]; then
            echo "NOT RUN: conformance world_$w needs $w GPUs, this machine has $NGPU" | tee -a "$LOG/summary.txt"
            skip+=(--skip "world_$w")
        fi
    done
    step conformance_hip_threads "$BIN/conformance_hip" --include-ignored --test-threads=1 --nocapture "${skip[@]}"
fi

if [[ " $STEPS " == *" process "* ]]; then
    if [ -x "$BIN/process_hip" ]; then
        step process_hip "$BIN/process_hip" --include-ignored --test-threads=1
    fi
    for w in 2 4 8; do
        [ "$NGPU" -ge "$w" ] || continue
        step "process_conformance_w$w" ranks "$w" -1 conformance --backend hip --timeout-secs 60
        step "process_replay_w$w" ranks "$w" -1 replay --backend hip --replays 10000 --timeout-secs 60
    done
    if [ "$NGPU" -ge 2 ]; then
        step process_smoke_w2 ranks 2 -1 smoke --backend hip --timeout-secs 120
        step process_mismatch_w2 ranks 2 -1 mismatch --backend hip --timeout-secs 5
        step process_finalize_w2 ranks 2 -1 finalize --backend hip --timeout-secs 5
    fi
    if [ "$NGPU" -ge 4 ]; then
        step process_kill_w4 ranks 4 2 kill --backend hip --victim 2 --timeout-secs 5
        step process_stall_w4 ranks 4 -1 stall --backend hip --victim 1 --timeout-secs 5
    fi
fi

if [[ " $STEPS " == *" bench "* ]]; then
    for w in 2 4 8; do
        [ "$NGPU" -ge "$w" ] || continue
        step "bench_w$w" "$BIN/ferrocomm-bench" --backend hip --world "$w" --algo all --graph \
            --dtype "${BENCH_DTYPES:-bf16}" --min-bytes 1K --max-bytes "${BENCH_MAX:-256M}" \
            --iters 20 --warmup 5 --json "$LOG/bench_w$w.json"
        cp "$LOG/bench_w$w.log" "$LOG/bench_w$w.txt"
    done
fi

# RCCL alone, as rccl-tests measures it (the number RCCL users quote).
if [[ " $STEPS " == *" rccl_tests "* ]]; then
    ARP="${RCCL_TESTS:+$RCCL_TESTS/}all_reduce_perf"
    if command -v "$ARP" >/dev/null 2>&1; then
        for w in 2 4 8; do
            [ "$NGPU" -ge "$w" ] || continue
            step "rccl_tests_w$w" "$ARP" -b 1K -e "${BENCH_MAX:-256M}" -f 2 -g "$w" -d bfloat16 -w 5 -n 20 -G 20
        done
    else
        echo "NOT RUN: rccl-tests all_reduce_perf not found (set RCCL_TESTS)" | tee -a "$LOG/summary.txt"
    fi
fi

cat "$LOG/summary.txt"
exit "$failed"
