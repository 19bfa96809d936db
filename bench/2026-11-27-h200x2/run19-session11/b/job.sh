#!/usr/bin/env bash
# Session 11 device job b: EP tests (world 2) and the EP bench, twice.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt
B=".carry/bin/ferrocomm-bench --backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
(time timeout 240 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_3 --skip ep_world_4 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; tail -6 $OUT/ep_cuda.log
for i in 1 2; do timeout 150 $B > $OUT/epbench$i.log 2>&1; echo "rc=$?" >> $OUT/epbench$i.log; grep -v autotune $OUT/epbench$i.log; done
