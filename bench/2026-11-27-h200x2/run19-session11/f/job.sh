#!/usr/bin/env bash
# Session 11 device job f: EP tests (world 2), the EP bench, and the phase-stamp build (block roles).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
(time timeout 240 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_3 --skip ep_world_4 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; tail -5 $OUT/ep_cuda.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
timeout 150 .carry/bin/ferrocomm-bench $A > $OUT/epbench.log 2>&1; echo "rc=$?" >> $OUT/epbench.log; grep -v autotune $OUT/epbench.log | grep -v "^#"
timeout 150 .carry/bin/ferrocomm-bench-trace $A --tokens 1,128,4096 > $OUT/epbench_trace.log 2>&1; echo "rc=$?" >> $OUT/epbench_trace.log; grep -v autotune $OUT/epbench_trace.log | grep -v "^#"
