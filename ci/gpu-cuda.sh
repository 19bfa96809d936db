#!/usr/bin/env bash
# Run the CUDA GPU tests and the benchmark on a GPU machine from prebuilt
# binaries (see ci/pack-gpu.sh), writing logs under $OUT (or ./gpu-logs).
#
#   ci/gpu-cuda.sh [BIN_DIR] [STEPS...]
#   STEPS: tests coldstart torchrun layered example sanitizer bench collbench
#          fused heap epbench qrbench python torch broadcaster flashinfer baseline (default: all),
#          and autotune and shared (not
#          in the default: protocol checks for a machine of one GPU)
#
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends): it can take a
# shared host's GPUs down. Every test runs with FERROCOMM_REQUIRE_GPU=1, so a
# test that cannot reach its GPUs fails instead of skipping.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="$(cd "${1:-.carry/bin}" && pwd)"
shift || true
STEPS="${*:-tests coldstart torchrun layered example sanitizer bench collbench fused heap epbench qrbench python torch broadcaster flashinfer baseline}"
# Logs go to one folder; with $OUT set (the lent machines bring back a
# limited number of files) they are packed into $OUT/gpu-logs.tgz at the end,
# beside summary.txt, also when the job is stopped.
if [ -n "${OUT:-}" ]; then
    LOG=/tmp/ferrocomm-gpu-logs
    rm -rf "$LOG"
    pack_logs() {
        tar czf "$OUT/gpu-logs.tgz" -C "$LOG" . 2>/dev/null
        cp "$LOG/summary.txt" "$OUT/" 2>/dev/null
    }
    trap 'pack_logs; exit 143' TERM INT
    trap pack_logs EXIT
else
    LOG="$PWD/gpu-logs"
fi
mkdir -p "$LOG"
# No step may take the whole job: each is stopped after STEP_TIMEOUT seconds.
STEP_TIMEOUT="${STEP_TIMEOUT:-300}"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1 FERROCOMM_WORKER_EXE="$BIN/ferrocomm-worker"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="/usr/local/cuda/bin:$PATH"
NGPU="$(nvidia-smi -L 2>/dev/null | wc -l)"
# Kernels precompiled where the binaries were built (ci/pack-gpu.sh) spare
# every rank the NVRTC compile; the cache must be private to this user.
if [ -d .carry/kcache ] && [ -z "${FERROCOMM_CACHE_DIR:-}" ]; then
    export FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
    mkdir -p "$FERROCOMM_CACHE_DIR" && chmod 700 "$FERROCOMM_CACHE_DIR"
    cp .carry/kcache/* "$FERROCOMM_CACHE_DIR"/ 2>/dev/null && chmod 600 "$FERROCOMM_CACHE_DIR"/*
fi
failed=0

step() { # name, command...
    local name="$1"
    shift
    local t0=$SECONDS
    echo "=== $name: $*"
    timeout --kill-after=10 "$STEP_TIMEOUT" "$@" >"$LOG/$name.log" 2>&1
    local rc=$?
    [ "$rc" = 124 ] && echo "STOPPED after ${STEP_TIMEOUT}s (STEP_TIMEOUT)" >>"$LOG/$name.log"
    printf '%-28s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$LOG/summary.txt"
    grep -E "^test |test result|RESULT|SKIPPED|panicked" "$LOG/$name.log" | tail -15
    [ "$rc" = 0 ] || failed=1
}

# Worlds above the GPU count are named, not failed (issue 17).
not_run() { # what, world
    echo "NOT RUN: $1 needs $2 GPUs, this machine has $NGPU" | tee -a "$LOG/summary.txt"
}
# The worlds a family of benches runs at: 2, 4 and 8 (BENCH_WORLDS, e.g. "4"
# for a second job on a 4-GPU machine), as far as the GPUs go.
bench_worlds() { # what
    local w
    for w in ${BENCH_WORLDS:-2 4 8}; do
        if [ "$NGPU" -ge "$w" ]; then echo "$w"; else not_run "$1 world $w" "$w" >&2; fi
    done
}

{ date -u; nvidia-smi; nvidia-smi topo -m; } >"$LOG/machine.txt" 2>&1
echo "GPUs: $NGPU" | tee "$LOG/summary.txt"

if [[ " $STEPS " == *" tests "* ]]; then
    skip=()
    for w in 3 4 8; do # worlds this machine cannot host, named in the log
        if [ "$NGPU" -lt "$w" ]; then
            echo "NOT RUN: conformance world_$w needs $w GPUs, this machine has $NGPU" | tee -a "$LOG/summary.txt"
            skip+=(--skip "world_$w")
        fi
    done
    step conformance_cuda_threads "$BIN/conformance_cuda" --include-ignored --test-threads=1 "${skip[@]}"
    step process_cuda "$BIN/process_cuda" --include-ignored --test-threads=1 "${skip[@]}"
    # Every world 2..8 the machine can host, as processes under torchrun
    # (worlds 5-7 have no thread-suite test of their own).
    if command -v torchrun >/dev/null; then
        for w in 3 4 5 6 7 8; do
            if [ "$NGPU" -ge "$w" ]; then
                step "conformance_torchrun_w$w" torchrun --nproc_per_node="$w" --no-python "$BIN/ferrocomm-worker" \
                    conformance --backend cuda --timeout-secs 120
            else
                not_run "conformance (processes) world $w" "$w"
            fi
        done
    fi
fi

if [[ " $STEPS " == *" coldstart "* ]]; then
    # One fresh process with an empty kernel cache, then again with the cache
    # it filled (the test prints both); then two ranks under torchrun, each
    # with an empty cache of its own, to a first all-reduce.
    step coldstart_device "$BIN/conformance_cuda" --include-ignored --test-threads=1 --exact cold_start
    if command -v torchrun >/dev/null && [ "$NGPU" -ge 2 ]; then
        cold=/tmp/ferrocomm-cold-cache
        rm -rf "$cold" && mkdir -p "$cold" && chmod 700 "$cold"
        step coldstart_torchrun_empty env FERROCOMM_CACHE_DIR="$cold" torchrun --nproc_per_node=2 --no-python \
            "$BIN/ferrocomm-worker" coldstart --backend cuda
        step coldstart_torchrun_warm env FERROCOMM_CACHE_DIR="$cold" torchrun --nproc_per_node=2 --no-python \
            "$BIN/ferrocomm-worker" coldstart --backend cuda
    fi
    if command -v gdb >/dev/null; then
        # The cold-start child (compiles still queued at exit) under gdb: a
        # crash at exit leaves every thread's backtrace in the log.
        gcold=/tmp/ferrocomm-cold-gdb
        rm -rf "$gcold" && mkdir -p "$gcold" && chmod 700 "$gcold"
        step coldstart_child_gdb env FERROCOMM_TEST_CHILD=child_cold_start FERROCOMM_CACHE_DIR="$gcold" \
            gdb -batch -ex run -ex "thread apply all bt 12" --args "$BIN/conformance_cuda" child_cold_start --exact \
            --include-ignored --nocapture --test-threads=1
    fi
    grep -h "COLD START\|WARM START" "$LOG"/coldstart_*.log | tee -a "$LOG/summary.txt"
fi

if [[ " $STEPS " == *" torchrun "* ]] && command -v torchrun >/dev/null && [ "$NGPU" -ge 2 ]; then
    # Unmodified torchrun: its agent store holds MASTER_PORT; ferrocomm's
    # rendezvous finds it and starts its own store beside it.
    step torchrun_conformance torchrun --nproc_per_node=2 --no-python "$BIN/ferrocomm-worker" conformance --backend cuda --timeout-secs 120
    if [ -x "$BIN/torchrun_store" ] && [ "${TORCH_STORE_TESTS:-1}" != 0 ]; then
        step torch_tcpstore_client env FERROCOMM_REQUIRE_TORCH=1 "$BIN/torchrun_store" --include-ignored --test-threads=1
    fi
fi

if [[ " $STEPS " == *" layered "* ]] && command -v torchrun >/dev/null && [ "$NGPU" -ge 2 ]; then
    # Pseudo-nodes of one GPU each (FERROCOMM_LOCAL_SIZE=1): every
    # communicator spans nodes, so all-reduce, all-gather and reduce-scatter
    # run in two levels (NCCL between the "nodes") and the rest through
    # NCCL; the conformance suite checks them against its level-aware
    # reference (node partials, then nodes in order), and the bench checks
    # every result.
    step layered_conformance env FERROCOMM_LOCAL_SIZE=1 torchrun --nproc_per_node=2 --no-python \
        "$BIN/ferrocomm-worker" conformance --backend cuda --timeout-secs 120
    # 2 nodes x 2 GPUs: kernels inside a node, NCCL between them.
    if [ "$NGPU" -ge 4 ]; then
        step layered_conformance_w4_2nodes env FERROCOMM_LOCAL_SIZE=2 torchrun --nproc_per_node=4 --no-python \
            "$BIN/ferrocomm-worker" conformance --backend cuda --timeout-secs 120
    else
        not_run "conformance across 2 pseudo-nodes of 2 GPUs" 4
    fi
    step layered_bench env FERROCOMM_LOCAL_SIZE=1 "$BIN/ferrocomm-bench" --backend cuda --world 2 --coll all --algo auto \
        --dtype bf16 --min-bytes 4K --max-bytes 16M --iters 5 --warmup 2
    # 2 nodes x 1 GPU against flat NCCL over the same ranks, graph replay
    # (issue 15: all-reduce within 10% of flat NCCL from 1 MiB).
    [[ " ${BENCH_WORLDS:-2} " == *" 2 "* ]] && step layered_bench_w2_graph env FERROCOMM_LOCAL_SIZE=1 "$BIN/ferrocomm-bench" --backend cuda --world 2 \
        --coll all_reduce,all_gather,reduce_scatter --algo auto,nccl --graph --dtype bf16 \
        --min-bytes 1M --max-bytes "${LAYERED_MAX:-256M}" --iters 10 --warmup 3 --json "$LOG/layered_bench_w2_graph.json"
    # 2 nodes x 2 GPUs and 2 x 4, where the GPUs are there.
    for w in 4 8; do
        if [ "$NGPU" -ge "$w" ]; then
            step "layered_bench_w${w}_2nodes" env FERROCOMM_LOCAL_SIZE=$((w / 2)) "$BIN/ferrocomm-bench" --backend cuda \
                --world "$w" --coll all_reduce,all_gather,reduce_scatter --algo auto,nccl --graph --dtype bf16 \
                --min-bytes 1M --max-bytes 256M --iters 10 --warmup 3
        else
            not_run "hierarchical bench (2 pseudo-nodes) world $w" "$w"
        fi
    done
fi

if [[ " $STEPS " == *" example "* ]] && command -v torchrun >/dev/null && [ "$NGPU" -ge 2 ] && [ -x "$BIN/engine_cudarc" ]; then
    step example_engine_cudarc env FERROCOMM_DEBUG="${EXAMPLE_DEBUG:-info}" torchrun --nproc_per_node=2 --no-python "$BIN/engine_cudarc"
fi

if [[ " $STEPS " == *" sanitizer "* ]]; then
    for tool in memcheck racecheck; do
        wrapper="/tmp/ferrocomm-sanitize-$tool.sh"
        printf '#!/bin/sh\nexec compute-sanitizer --tool %s --error-exitcode 9 "%s" "$@"\n' "$tool" "$BIN/ferrocomm-worker" >"$wrapper"
        chmod +x "$wrapper"
        # FERROCOMM_CCL=0: the check is of ferrocomm's kernels; NCCL's own init
        # probes kernels for other archs and trips memcheck's API-error report.
        step "sanitizer_$tool" env FERROCOMM_CCL=0 FERROCOMM_WORKER_EXE="$wrapper" "$BIN/process_cuda" --include-ignored --test-threads=1 smoke
    done
fi

if [[ " $STEPS " == *" shared "* ]] && command -v torchrun >/dev/null; then
    # One GPU, two ranks as processes sharing it (FERROCOMM_TEST_SHARE_GPU;
    # NCCL refuses two ranks on one GPU, so FERROCOMM_CCL=0 and every
    # collective runs ferrocomm's kernels): the whole conformance suite, with
    # the small-message LL kinds in force and with them off, then the smoke
    # run of every kernel family under memcheck and racecheck, one sanitizer
    # per rank. Protocol checks on real GPU memory; no timing means anything.
    shared=(env FERROCOMM_TEST_SHARE_GPU=1 FERROCOMM_CCL=0)
    step shared_conformance "${shared[@]}" torchrun --nproc_per_node=2 --no-python "$BIN/ferrocomm-worker" \
        conformance --backend cuda --timeout-secs 120
    step shared_conformance_no_ll "${shared[@]}" FERROCOMM_COLL_LL_BYTES=0 torchrun --nproc_per_node=2 --no-python \
        "$BIN/ferrocomm-worker" conformance --backend cuda --timeout-secs 120
    # The fuzz of the public API (per-rank offsets, memory kinds, streams,
    # dropped works), FERROCOMM_FUZZ_TRIALS trials (300 by default).
    step shared_fuzz "${shared[@]}" torchrun --nproc_per_node=2 --no-python "$BIN/ferrocomm-worker" \
        fuzz --backend cuda --timeout-secs 60
    # The copy route (coll_algo copy): its cases and its graph replay,
    # bitwise, ranks as processes. Default slots: on a shared GPU every
    # handshake waits out a time slice (~2.2 ms), so 128 KiB slots' many
    # chunks outlast the step.
    step shared_copy_route "${shared[@]}" torchrun --nproc_per_node=2 --no-python \
        "$BIN/ferrocomm-worker" copy_route --backend cuda --timeout-secs 60
    # The sequence-parallel fused epilogue, bitwise against the host
    # reference: default slots, then 512 KiB slots so the largest cases run
    # over several chunks (smaller slots' many handshakes, each a time
    # slice on a shared GPU, outlast the step).
    step shared_fused_sp "${shared[@]}" torchrun --nproc_per_node=2 --no-python \
        "$BIN/ferrocomm-worker" fused_sp --backend cuda --timeout-secs 60
    step shared_fused_sp_chunked "${shared[@]}" FERROCOMM_SLOT_BYTES=524288 torchrun --nproc_per_node=2 \
        --no-python "$BIN/ferrocomm-worker" fused_sp --backend cuda --timeout-secs 60
    # The chunked all-gather and reduce-scatter (comm::overlap), bitwise.
    step shared_overlap "${shared[@]}" torchrun --nproc_per_node=2 --no-python \
        "$BIN/ferrocomm-worker" overlap --backend cuda --timeout-secs 60
    # A peer killed mid-loop of each copy-route collective: the survivor's
    # error names it within the deadline.
    step shared_copy_route_killed "${shared[@]}" "$BIN/process_cuda" --include-ignored --test-threads=1 \
        --exact killed_rank_in_the_copy_route_world_2
    # Mismatched calls: a different collective (LL against the flags, and
    # against the copy route's handshake) and all-to-all splits that
    # disagree, each a mismatch on both ranks.
    for coll in crossed crossed_copy all_to_all; do
        step "shared_mismatch_$coll" "${shared[@]}" torchrun --nproc_per_node=2 --no-python \
            "$BIN/ferrocomm-worker" mismatch --coll "$coll" --backend cuda --timeout-secs 20
    done
    # Autotune measures once per shape: a second communicator reads the
    # table the first cached (COLD START's "communicator" time).
    tuned="$(mktemp -d)"
    cp "${FERROCOMM_CACHE_DIR:-/nonexistent}"/* "$tuned"/ 2>/dev/null
    for k in first again; do
        step "shared_autotune_$k" "${shared[@]}" FERROCOMM_AUTOTUNE=1 FERROCOMM_CACHE_DIR="$tuned" torchrun \
            --nproc_per_node=2 --no-python "$BIN/ferrocomm-worker" coldstart --backend cuda --timeout-secs 60
    done
    # The fused epilogues' bench rows, MoE finalize among them, checked
    # against the host reference on GPU memory (#wrong; no timing meaning).
    step shared_fused_bench "${shared[@]}" "$BIN/ferrocomm-bench" --backend cuda --world 2 --fused all \
        --fused-moe 1,2,8 --fused-sp all --tokens 1,32,128 --hidden 4096 --iters 3 --warmup 1
    if command -v compute-sanitizer >/dev/null; then
        for tool in memcheck racecheck; do
            wrapper="/tmp/ferrocomm-sanitize-shared-$tool.sh"
            printf '#!/bin/sh\nexec compute-sanitizer --tool %s --error-exitcode 9 "%s" "$@"\n' "$tool" \
                "$BIN/ferrocomm-worker" >"$wrapper"
            chmod +x "$wrapper"
            step "shared_smoke_$tool" "${shared[@]}" torchrun --nproc_per_node=2 --no-python "$wrapper" smoke \
                --backend cuda --timeout-secs 300
        done
    fi
fi

if [[ " $STEPS " == *" bench "* ]]; then
    for w in $(bench_worlds bench); do
        step "bench_w$w" "$BIN/ferrocomm-bench" --backend cuda --world "$w" --algo "${BENCH_ALGOS:-all}" --graph \
            --dtype "${BENCH_DTYPES:-bf16}" --min-bytes 1K --max-bytes "${BENCH_MAX:-256M}" \
            --iters "${BENCH_ITERS:-20}" --warmup "${BENCH_WARMUP:-5}" --json "$LOG/bench_w$w.json"
        cp "$LOG/bench_w$w.log" "$LOG/bench_w$w.txt"
    done
fi

if [[ " $STEPS " == *" collbench "* ]]; then
    # Every collective: ferrocomm (its kernels, or NCCL underneath), NCCL
    # called directly on the same stream, and a memcpy, eager and graph.
    for w in $(bench_worlds collbench); do
        step "collbench_w$w" "$BIN/ferrocomm-bench" --backend cuda --world "$w" --coll all --algo auto,nccl --graph \
            --dtype bf16 --min-bytes 4K --max-bytes "${COLL_MAX:-64M}" \
            --iters "${BENCH_ITERS:-10}" --warmup "${BENCH_WARMUP:-3}" --json "$LOG/collbench_w$w.json"
    done
    # The copy route (copy engines, no SM) beside the kernels and NCCL, for
    # the table: the planner takes it only where asked or tuned.
    for w in $(bench_worlds collbench); do
        step "collbench_copy_w$w" "$BIN/ferrocomm-bench" --backend cuda --world "$w" \
            --coll all_gather,broadcast,all_to_all --algo auto,copy,nccl --graph \
            --dtype bf16 --min-bytes 4K --max-bytes "${COLL_MAX:-64M}" \
            --iters "${BENCH_ITERS:-10}" --warmup "${BENCH_WARMUP:-3}" --json "$LOG/collbench_copy_w$w.json"
    done
    # The direct kinds against the inbox way, for DIRECT_MIN_BLOCK_BYTES (4
    # MiB a peer, not measured): every row on plain buffers, then on heap
    # buffers, which FERROCOMM_DIRECT_MIN_BYTES=0 sends direct at every size
    # the kernels take (auto gives all-gather blocks under 512 KiB to NCCL,
    # plain or heap); the log ends with the pairs side by side.
    for w in $(bench_worlds collbench_direct); do
        step "collbench_direct_w$w" env FERROCOMM_DIRECT_MIN_BYTES=0 "$BIN/ferrocomm-bench" --backend cuda --world "$w" \
            --coll all_gather,reduce_scatter,reduce --operands both --algo auto,nccl --graph \
            --dtype bf16 --min-bytes 4K --max-bytes "${DIRECT_MAX:-256M}" \
            --iters "${BENCH_ITERS:-20}" --warmup "${BENCH_WARMUP:-5}" --json "$LOG/collbench_direct_w$w.json"
    done
    # The LL kinds (small agreed blocks: FERROCOMM_COLL_LL_BYTES, 256 KiB a
    # peer to world 4, 32 KiB above)
    # against the inbox kinds and NCCL, on the kernels at every size
    # (FERROCOMM_COLL_ROUTE=custom): once with LL in force, once with it off.
    for w in $(bench_worlds collbench_ll); do
        for ll in on off; do
            lloff=()
            [ "$ll" = off ] && lloff=(FERROCOMM_COLL_LL_BYTES=0)
            step "collbench_ll${ll}_w$w" env FERROCOMM_COLL_ROUTE=custom "${lloff[@]}" "$BIN/ferrocomm-bench" \
                --backend cuda --world "$w" --coll all_gather,reduce_scatter,reduce,all_to_all --algo auto,nccl --graph \
                --dtype bf16 --min-bytes 1K --max-bytes 1M \
                --iters "${BENCH_ITERS:-20}" --warmup "${BENCH_WARMUP:-5}" --json "$LOG/collbench_ll${ll}_w$w.json"
        done
    done
fi

if [[ " $STEPS " == *" fused "* ]]; then
    # The fused all-reduce epilogues per pattern and shape (outputs checked
    # bitwise against the unfused reference), eager and graph.
    for w in $(bench_worlds fused); do
        for h in 4096 8192; do
            step "fused_w${w}_h$h" "$BIN/ferrocomm-bench" --backend cuda --world "$w" --fused all --graph \
                --algo auto,oneshot-ll,oneshot-push,twoshot-push \
                --tokens 1,8,32,64,128,256,512,2048 --hidden "$h" --iters 20 --warmup 5 --json "$LOG/fused_w${w}_h$h.json"
        done
        # The sequence-parallel form (gathered and shard) beside the
        # all-reduce form of the same rows.
        step "fused_sp_w$w" "$BIN/ferrocomm-bench" --backend cuda --world "$w" --fused rms,rms_fp8tok,rms_nvfp4 \
            --fused-sp all --graph --tokens 128,512,2048,8192 --hidden 8192 --iters 20 --warmup 5 \
            --json "$LOG/fused_sp_w$w.json"
    done
fi

if [[ " $STEPS " == *" heap "* ]]; then
    # The symmetric heap, windows, the user-style all-gather on the device
    # API and EP dispatch/combine (conformance, then the benches). With one
    # GPU the ranks share it (FERROCOMM_TEST_SHARE_GPU): the protocols run,
    # the times mean nothing. NCCL refuses two ranks on one GPU ("Duplicate
    # GPU detected"), so shared ranks run without it (FERROCOMM_CCL=0); these
    # suites use ferrocomm's own kernels only.
    share=()
    [ "$NGPU" -ge 2 ] || share=(env FERROCOMM_TEST_SHARE_GPU=1 FERROCOMM_CCL=0)
    # One step per test, so that one hang cannot hide the others' results.
    # Ranks as threads need a GPU each: threads sharing one GPU share its
    # context and hung on the H100 (a kernel spinning for a peer that waits
    # behind it in the context); the processes below run the same suite.
    if [ "$NGPU" -ge 2 ]; then
        for t in heap_and_windows_world_2 heap_and_windows_world_4 a_peer_that_never_signals_is_named \
            user_allgather_on_the_device_api_world_2; do
            w="${t##*world_}"
            if [[ "$t" == *world_* ]] && [ "$NGPU" -lt "$w" ]; then
                not_run "$t" "$w"
                continue
            fi
            step "heap_cuda_$t" "$BIN/heap_cuda" --include-ignored --test-threads=1 --exact "$t" --nocapture
        done
    else
        not_run "heap suite with ranks as threads (one GPU a rank)" 2
    fi
    # Processes (fds, separate address spaces); shared, they time-slice the GPU.
    hprocs=$((NGPU >= 2 ? NGPU : 2))
    step heap_torchrun "${share[@]}" torchrun --nproc_per_node="$hprocs" --no-python "$BIN/ferrocomm-worker" heap \
        --backend cuda --timeout-secs 120
    # EP worlds above the GPU count are named, not failed (shared ranks run them all).
    epskip=()
    if [ "$NGPU" -ge 2 ]; then
        for w in 3 4 8; do
            if [ "$NGPU" -lt "$w" ]; then
                epskip+=(--skip "ep_world_$w")
                not_run "ep_cuda ep_world_$w" "$w"
            fi
        done
    fi
    [ -x "$BIN/ep_cuda" ] && step ep_cuda "${share[@]}" "$BIN/ep_cuda" --include-ignored --test-threads=1 "${epskip[@]}"
    if [ "${SANITIZE_HEAP:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
        # Every rank a process under its own sanitizer: memcheck serializes
        # the kernels of a process, so ranks as threads would wait on each
        # other's spinning kernels. FERROCOMM_CCL=0 as in the sanitizer step:
        # NCCL's init probes trip memcheck's API-error report.
        wrapper=/tmp/ferrocomm-sanitize-heap.sh
        printf '#!/bin/sh\nexec compute-sanitizer --tool memcheck --error-exitcode 9 "%s" "$@"\n' \
            "$BIN/ferrocomm-worker" >"$wrapper"
        chmod +x "$wrapper"
        step heap_memcheck env FERROCOMM_CCL=0 "${share[@]}" torchrun --nproc_per_node=2 --no-python "$wrapper" heap \
            --backend cuda --timeout-secs 300
        # The EP kernels under the same check: dispatch and combine, bf16 and
        # FP8, unaligned views and graph replays (tests/ep_cuda.rs's suite,
        # ranks as processes).
        step ep_memcheck env FERROCOMM_CCL=0 FERROCOMM_HEAP_BYTES=67108864 "${share[@]}" torchrun --nproc_per_node=2 \
            --no-python "$wrapper" ep --backend cuda --timeout-secs 300
    fi
    for w in $(bench_worlds heapbench); do
        step "heapbench_w$w" "$BIN/ferrocomm-bench" --backend cuda --world "$w" --heap --graph \
            --min-bytes 64K --max-bytes 256M --iters 20 --warmup 5
    done
fi

if [[ " $STEPS " == *" epbench "* ]]; then
    # EP dispatch + combine (hidden 7168, top-8 of 256 experts, bf16 and
    # fp8, 1-4096 tokens a rank; outputs checked) next to NCCL's
    # all_to_all_v carrying the same bytes (issue 13's table).
    # EP_BLOCKS="8 32 128": one row set per grid (FERROCOMM_EP_BLOCKS).
    for w in $(bench_worlds epbench); do
        for b in ${EP_BLOCKS:-default}; do
            blocks=()
            [ "$b" = default ] || blocks=(FERROCOMM_EP_BLOCKS="$b")
            step "epbench_w${w}_blocks_$b" env "${blocks[@]}" "$BIN/ferrocomm-bench" --backend cuda --world "$w" \
                --ep --graph --iters "${BENCH_ITERS:-20}" --warmup "${BENCH_WARMUP:-5}"
        done
    done
fi

if [[ " $STEPS " == *" autotune "* ]]; then
    # Autotune at init (issue 15): per world, a fresh measurement (the
    # bench prints the table and how long it took), then the same rows on
    # the static table (FERROCOMM_AUTOTUNE=0), bf16 and f32 (the two dtype
    # classes).
    for w in $(bench_worlds autotune); do
        rm -rf "${FERROCOMM_CACHE_DIR:-$HOME/.cache/ferrocomm}/autotune"
        for at in 1 0; do
            step "autotune${at}_w$w" env FERROCOMM_AUTOTUNE=$at FERROCOMM_DEBUG=info "$BIN/ferrocomm-bench" --backend cuda --world "$w" \
                --coll all_reduce,all_gather,reduce_scatter,all_to_all --algo auto --graph --dtype bf16,f32 \
                --min-bytes 1K --max-bytes "${AUTOTUNE_MAX:-64M}" --iters "${BENCH_ITERS:-10}" \
                --warmup "${BENCH_WARMUP:-3}" --json "$LOG/autotune${at}_w$w.json"
        done
    done
fi

if [[ " $STEPS " == *" qrbench "* ]]; then
    # Quick-reduce per codec next to ferrocomm's two-shot and NCCL, Gaussian
    # data, relative error per row (issue 5's table).
    for w in $(bench_worlds qrbench); do
        step "qrbench_w$w" "$BIN/ferrocomm-bench" --backend cuda --world "$w" --graph-only \
            --algo "${QR_ALGOS:-twoshot-push,nccl}" --quantization "${QR_CODECS:-int4,int6,int8,fp8,fp4}" \
            --dtype bf16 --min-bytes "${QR_MIN:-1M}" --max-bytes "${QR_MAX:-256M}" \
            --iters "${BENCH_ITERS:-20}" --warmup "${BENCH_WARMUP:-5}" --json "$LOG/qrbench_w$w.json"
        cp "$LOG/qrbench_w$w.log" "$LOG/qrbench_w$w.txt"
    done
fi

# The wheel ci/pack-python.sh built, installed beside the python that has
# torch (once, for the python and torch steps).
python_site() {
    [ -n "${PY_SITE:-}" ] && return 0
    PY_SITE=/tmp/ferrocomm-site
    rm -rf "$PY_SITE"
    python3 -m pip install -q --no-index --no-deps --target "$PY_SITE" .carry/python/ferrocomm-*.whl >"$LOG/python_install.log" 2>&1
    if ! python3 -c "import pytest" 2>/dev/null && [ -d .carry/pywheels ]; then
        python3 -m pip install -q --no-index --find-links .carry/pywheels --target "$PY_SITE" pytest >>"$LOG/python_install.log" 2>&1
    fi
    export PYTHONPATH="$PY_SITE${PYTHONPATH:+:$PYTHONPATH}"
}

if [[ " $STEPS " == *" torch "* ]] && ls .carry/python/ferrocomm-*.whl >/dev/null 2>&1; then
    # ferrocomm as a torch.distributed backend: every collective, DDP, FSDP2,
    # DTensor and a killed rank, on CPU tensors and CUDA tensors. On one GPU
    # the two ranks share it (FERROCOMM_CCL=0: NCCL refuses two ranks on one
    # GPU).
    python_site
    torch_env=(env FERROCOMM_REQUIRE_GPU=1)
    if [ "$NGPU" -lt 2 ]; then
        torch_env+=(FERROCOMM_TEST_SHARE_GPU=1 FERROCOMM_CCL=0)
    fi
    step torch_backend_tests "${torch_env[@]}" python3 -m pytest -v -rs python/tests/test_torch_backend.py
    step torch_ddp_example "${torch_env[@]}" torchrun --nproc_per_node=2 python/examples/torch_ddp.py
fi

if [[ " $STEPS " == *" broadcaster "* ]]; then
    # The metadata broadcaster on this host's CPUs (no GPU): ferrocomm's
    # bench, then from Python beside torch's broadcast_object_list on gloo.
    for w in 2 4; do
        step "broadcaster_bench_w$w" "$BIN/ferrocomm-bench" --backend host --world "$w" --broadcaster
    done
    if ls .carry/python/ferrocomm-*.whl >/dev/null 2>&1 && command -v torchrun >/dev/null; then
        python_site
        step broadcaster_python torchrun --nproc_per_node=2 python/bench/bench_broadcaster.py --no-nccl \
            --json "$LOG/broadcaster_python.json"
    fi
fi

if [[ " $STEPS " == *" python "* ]] && ls .carry/python/ferrocomm-*.whl >/dev/null 2>&1; then
    python_site
    if [ "$NGPU" -ge 2 ]; then
        step python_gpu_tests python3 -m pytest -x -v -rs python/tests/test_gpu_torch.py
        step python_bench torchrun --nproc_per_node=2 python/bench/bench_torch.py
        # Eager calls back to back: when the CPU cannot issue them as fast
        # as the GPU runs them, eager us/op minus graph us/op is the Python
        # + Rust cost of one call.
        step python_bench_fused torchrun --nproc_per_node=2 python/bench/bench_torch.py --collectives none \
            --min-bytes 4K --max-bytes 4K --fused --no-symm-mem
        step python_bench_eager torchrun --nproc_per_node=2 python/bench/bench_torch.py --collectives all_reduce \
            --min-bytes 4K --max-bytes 64K --eager --no-symm-mem --k 200
        # EP dispatch + combine per kernel (torch's profiler, CUPTI records).
        step python_profile_ep torchrun --nproc_per_node=2 python/bench/profile_ep.py
        # The overlap operations beside torch's fused ops and the unfused
        # pair, at the Llama-70B TP2 shapes.
        step python_bench_overlap torchrun --nproc_per_node=2 python/bench/bench_overlap.py
    else
        not_run "python GPU tests and benches (ranks on GPUs of their own)" 2
    fi
    # The overlap operations against torch's unfused ops (fp32, bf16, a
    # graph replay); on one GPU the two ranks share it.
    overlap_env=(env FERROCOMM_REQUIRE_GPU=1)
    if [ "$NGPU" -lt 2 ]; then
        overlap_env+=(FERROCOMM_TEST_SHARE_GPU=1 FERROCOMM_CCL=0)
    fi
    step python_overlap_tests "${overlap_env[@]}" python3 -m pytest -x -v -rs python/tests/test_overlap_torch.py
fi

if [[ " $STEPS " == *" flashinfer "* ]] && ls .whl/flashinfer_python-*.whl >/dev/null 2>&1 && [ "$NGPU" -ge 2 ]; then
    # FlashInfer's fused all-reduce + RMSNorm (issue 12's comparison), from
    # wheels carried in .whl/ (git-ignored; fetched where pip works with
    # `pip download --no-deps --only-binary=:all: --python-version 3.12
    # --platform manylinux_2_28_x86_64 -d .whl flashinfer-python==0.6.8
    # apache-tvm-ffi==0.1.10`); its kernels build with nvcc first (about 2 minutes on 2x
    # H200), then the bench beside torch's unfused rows, then ferrocomm's
    # fused rows in the same job (needs the ferrocomm wheel).
    fisite=/tmp/ferrocomm-fi-site
    rm -rf "$fisite"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$fisite" .whl/*.whl >"$LOG/flashinfer_install.log" 2>&1
    fipath="$fisite${PYTHONPATH:+:$PYTHONPATH}"
    step flashinfer_jit env PYTHONPATH="$fipath" python3 python/bench/bench_flashinfer_fusion.py --jit-only
    step flashinfer_bench env PYTHONPATH="$fipath" torchrun --nproc_per_node=2 python/bench/bench_flashinfer_fusion.py
    if [[ " $STEPS " != *" python "* ]] && ls .carry/python/ferrocomm-*.whl >/dev/null 2>&1; then
        site=/tmp/ferrocomm-site
        python3 -m pip install -q --no-index --no-deps --target "$site" .carry/python/ferrocomm-*.whl \
            >"$LOG/python_install.log" 2>&1
        step python_bench_fused env PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" torchrun --nproc_per_node=2 \
            python/bench/bench_torch.py --collectives none --min-bytes 4K --max-bytes 4K --fused --no-symm-mem
    fi
fi

if [[ " $STEPS " == *" baseline "* ]] && command -v torchrun >/dev/null; then
    # Every world from 2 to the GPU count (issue 17).
    for w in ${BENCH_WORLDS:-$(seq 2 "$NGPU")}; do
        [ "$NGPU" -ge "$w" ] || continue
        for b in torch_allreduce_bench torch_collectives_bench; do
            [ -f ".carry/$b.py" ] && step "${b}_w$w" torchrun --nproc_per_node="$w" ".carry/$b.py"
        done
    done
fi

cat "$LOG/summary.txt"
exit "$failed"
