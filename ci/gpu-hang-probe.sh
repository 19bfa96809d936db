#!/usr/bin/env bash
# Repeat the thread-rank CUDA suite (ranks as threads of one process) until
# it hangs or the time is up; on a hang, every thread's backtrace (gdb) and
# the debug log go to $OUT. For the intermittent hang after
# `collectives_without_ll_world_2` (BENCHMARKS.md, "Known problem: the
# thread-rank suite stalls").
#   ci/gpu-hang-probe.sh [BIN_DIR] [SECONDS] [FILTER...]
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="$(cd "${1:-.carry/bin}" && pwd)"
BUDGET="${2:-300}"
# Shift what was given of the two (a lone BIN_DIR must not become a filter).
shift $(($# < 2 ? $# : 2))
# An empty FILTER ("") is libtest's "every test"; none at all is the default.
FILTERS=("${@-cuda_threads::}")
OUTDIR="${OUT:-./gpu-logs}"
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERROCOMM_REQUIRE_GPU=1 FERROCOMM_WORKER_EXE="$BIN/ferrocomm-worker" RUST_BACKTRACE=1
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NGPU="$(nvidia-smi -L 2>/dev/null | wc -l)"
skip=()
for w in 3 4 8; do [ "$NGPU" -ge "$w" ] || skip+=(--skip "world_$w"); done
# A hang must outlast the suite's own deadlines (60 s) by a margin.
PER_RUN="${PER_RUN:-100}"
start=$SECONDS
i=0
while [ $((SECONDS - start + PER_RUN)) -le "$BUDGET" ]; do
    i=$((i + 1))
    log="$OUTDIR/probe_run$i.log"
    "$BIN/conformance_cuda" --include-ignored --test-threads=1 "${skip[@]}" "${FILTERS[@]}" >"$log" 2>&1 &
    pid=$!
    t0=$SECONDS
    while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "$PER_RUN" ]; do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "HANG in run $i after ${PER_RUN}s; last lines:"
        tail -5 "$log"
        # cuda-gdb (the toolkit's) also names the kernels still running.
        dbg="$(command -v gdb || command -v cuda-gdb || echo /usr/local/cuda/bin/cuda-gdb)"
        extra=()
        [[ "$dbg" == *cuda-gdb ]] && extra=(-ex "info cuda kernels")
        timeout 60 "$dbg" -p "$pid" -batch "${extra[@]}" -ex "info threads" -ex "thread apply all bt 25" \
            >"$OUTDIR/hang_backtrace.txt" 2>&1
        for t in /proc/"$pid"/task/*; do
            echo "$t $(cat "$t/comm") $(cat "$t/wchan" 2>/dev/null) $(cut -d' ' -f3 "$t/stat")"
        done >"$OUTDIR/hang_threads.txt" 2>&1
        gzip -c "$log" >"$OUTDIR/hang_log.txt.gz"
        nvidia-smi >"$OUTDIR/hang_nvidia_smi.txt" 2>&1
        kill -9 "$pid"
        exit 3
    fi
    wait "$pid"
    echo "run $i: rc=$? in $((SECONDS - t0))s: $(grep -E '^test result' "$log")"
    rm -f "$log"
done
echo "no hang in $i runs"
