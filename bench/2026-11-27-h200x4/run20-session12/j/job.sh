#!/usr/bin/env bash
# Session 12 device job j (4 GPUs): EP tests at worlds 2, 3 and 4 on the final kernels (one eighth of the combine's
# grid putting from world 4 and 512 tokens); the EP bench at world 4 twice and world 2 once.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
(time timeout 300 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; grep -E "^test |test result|rc=" $OUT/ep_cuda.log
run() { # name, world
  local n=$1 w=$2
  timeout 200 .carry/bin/ferrocomm-bench --backend cuda --world $w --ep --graph --iters 20 --warmup 5 > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run w4-final 4
run w2-final 2
run w4-final-again 4
