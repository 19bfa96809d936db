#!/usr/bin/env bash
# Session 11 device job j (4 GPUs): EP tests at worlds 2-4 and the EP bench at worlds 4 and 2, final kernels.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt
(time timeout 300 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; tail -5 $OUT/ep_cuda.log
A="--backend cuda --ep --graph --iters 20 --warmup 5"
for w in 4 2; do timeout 200 .carry/bin/ferrocomm-bench $A --world $w > $OUT/epbench_w$w.log 2>&1; echo "rc=$?" >> $OUT/epbench_w$w.log; echo "== world $w"; grep -v autotune $OUT/epbench_w$w.log | grep -v "^#"; done
