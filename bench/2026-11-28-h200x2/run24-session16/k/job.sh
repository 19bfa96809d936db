#!/usr/bin/env bash
# Session 16 device job k: on 1169cdc (ferrocomm-worker departs from rank 0's store): the torchrun steps (the worker under unmodified torchrun,
# torch's TCPStore tests) and the heap/EP steps of ci/gpu-cuda.sh.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin "torchrun heap" > $OUT/steps.log 2>&1; echo "rc=$?" >> $OUT/steps.log; tail -25 $OUT/steps.log
