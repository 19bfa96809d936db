#!/usr/bin/env bash
# Session 13 device job l: the worker's heap scenario with autotune off (6678b6d), run after an EP bench has cached an autotune table (job d's failure), then the heap steps of ci/gpu-cuda.sh.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
timeout 150 .carry/bin/ferrocomm-bench --backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,128,4096 > $OUT/ep-bench.log 2>&1; echo "rc=$?" >> $OUT/ep-bench.log
grep -v autotune $OUT/ep-bench.log | grep -v "^#"; ls /tmp/ferrocomm-kcache/autotune/ | head -3
unset FERROCOMM_CACHE_DIR
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin heap > $OUT/gpu-steps.txt 2>&1; echo "gpu-steps rc=$?" >> $OUT/gpu-steps.txt; grep -E "rc=|NOT RUN|test result" $OUT/gpu-steps.txt | head -30
