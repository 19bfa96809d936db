#!/usr/bin/env bash
# Session 11 device job d: EP phase stamps (an uncommitted trace build).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
B=".carry/bin/ferrocomm-bench --backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens ${TOKENS:-1,8,128,1024,4096}"
timeout 200 $B > $OUT/epbench_trace.log 2>&1; echo "rc=$?" >> $OUT/epbench_trace.log
grep -v autotune $OUT/epbench_trace.log | grep -v "^#"
