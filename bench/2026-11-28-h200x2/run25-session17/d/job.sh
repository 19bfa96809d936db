#!/usr/bin/env bash
# Session 17, call d: the head (4e90a30: the pool pauses when the last
# device drops) on 2x H200: the cold-start test ten times, then the device,
# process, cold-start, torchrun and heap/EP steps.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1 FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi -L > $OUT/gpus.txt
mkdir -p /tmp/cs
for i in $(seq 1 10); do
  timeout 120 .carry/bin/conformance_cuda --include-ignored --test-threads=1 --exact cold_start > /tmp/cs/run_$i.log 2>&1
  echo "cold_start run $i rc=$? $(grep -c SIGSEGV /tmp/cs/run_$i.log) SIGSEGV lines" | tee -a $OUT/coldstart_runs.txt
done
tar czf $OUT/coldstart_runs.tgz -C /tmp/cs .
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
export FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
TORCH_STORE_TESTS=0 STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin tests coldstart torchrun heap > $OUT/steps.log 2>&1
