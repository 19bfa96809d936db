#!/usr/bin/env bash
# Eager CPU cost per all-reduce call, the build before the eager-path work
# (.carry/before: its bench binary and wheel) against the current one
# (.carry/bin, .carry/python), in one job on one GPU, the order of the two
# builds rotated each round: from Rust (ferrocomm-bench cpu_us, world 1, and
# world 2 with the ranks sharing the GPU for the kernel route), and from
# Python beside torch's ProcessGroupNCCL (bench_torch.py --eager; the build
# before cannot open a torch.distributed group on ferrocomm under a bound
# device, so its rows through torch.distributed come from python_eager_w1.log).
#   bash bench/eager-1x-h200-2026-12-02/run.sh   (logs under $OUT)
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/eager-logs}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p "$FERROCOMM_CACHE_DIR" && chmod 700 "$FERROCOMM_CACHE_DIR"
cp .carry/kcache/* "$FERROCOMM_CACHE_DIR"/ 2>/dev/null && chmod 600 "$FERROCOMM_CACHE_DIR"/*
declare -A WHEEL=([before]=.carry/before [after]=.carry/python)
declare -A BENCH=([before]=.carry/before/ferrocomm-bench [after]=.carry/bin/ferrocomm-bench)
for b in before after; do
    python3 -m pip install -q --no-index --no-deps --target "/tmp/site-$b" "${WHEEL[$b]}"/ferrocomm-*.whl
done
sizes=(--min-bytes 1K --max-bytes 64M)
declare -A PG=([before]=--no-pg [after]=)
for round in 1 2; do
    order="before after"
    [ "$round" = 2 ] && order="after before"
    for b in $order; do
        echo "=== round $round, $b"
        PYTHONPATH="/tmp/site-$b" timeout 300 torchrun --nproc_per_node=1 python/bench/bench_torch.py \
            --collectives all_reduce --eager --k 200 --reps 10 --no-symm-mem ${PG[$b]} "${sizes[@]}" \
            --json "$OUT/python_${b}_r$round.json" >"$OUT/python_${b}_r$round.log" 2>&1
        timeout 120 "${BENCH[$b]}" --backend cuda --world 1 --coll all_reduce --eager-only "${sizes[@]}" \
            >"$OUT/rust_w1_${b}_r$round.txt" 2>&1
        FERROCOMM_TEST_SHARE_GPU=1 FERROCOMM_CCL=0 timeout 200 "${BENCH[$b]}" --backend cuda --world 2 \
            --coll all_reduce --eager-only "${sizes[@]}" >"$OUT/rust_w2_shared_${b}_r$round.txt" 2>&1
    done
done
PYTHONPATH=/tmp/site-after timeout 120 torchrun --nproc_per_node=1 python/bench/profile_eager.py \
    --sizes 1K,64M --cprofile >"$OUT/profile_after.txt" 2>&1
tar czf "$OUT/eager-logs.tgz" -C "$OUT" --exclude eager-logs.tgz . && find "$OUT" -type f ! -name eager-logs.tgz -delete
