#!/usr/bin/env bash
# Session 11 device job h: EP tests (world 2), the EP bench (3/8 of the combine putting), 2/8, and 2 packs a summing lane.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
(time timeout 240 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_3 --skip ep_world_4 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; tail -5 $OUT/ep_cuda.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
for b in ferrocomm-bench ferrocomm-bench-p2 ferrocomm-bench-s2 ferrocomm-bench; do
  n=$b; [ -e $OUT/$b.log ] && n=$b-again
  timeout 150 .carry/bin/$b $A > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
done
