#!/usr/bin/env bash
# Session 18, call f: the heap step of ci/gpu-cuda.sh on the head's kernels
# (2186ba6) with the new ep_memcheck step (ferrocomm-worker's `ep` scenario,
# the EP suite with ranks as processes, each under compute-sanitizer memcheck).
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1 FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi -L > $OUT/gpus.txt
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
export FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
STEP_TIMEOUT=300 bash ci/gpu-cuda.sh .carry/bin heap > $OUT/steps.log 2>&1
echo "gpu-cuda.sh rc=$?" >> $OUT/steps.log
grep -v "NOT RUN" $OUT/summary.txt; tail -2 $OUT/steps.log
