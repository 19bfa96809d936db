#!/usr/bin/env bash
# Session 13 device job f (4 GPUs): the final kernels (c37917d) at worlds 2-4, and the world-4 EP bench beside b40f1dc.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
(time timeout 300 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; grep -E "^test |test result|rc=" $OUT/ep_cuda.log
A="--backend cuda --world 4 --ep --graph --iters 20 --warmup 5"
run() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" timeout 200 .carry/bin/$b $A > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run w4-prev ferrocomm-bench-prev X=1
run w4-new ferrocomm-bench X=1
run w4-new-again ferrocomm-bench X=1
run w4-prev-again ferrocomm-bench-prev X=1
