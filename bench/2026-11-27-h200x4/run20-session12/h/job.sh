#!/usr/bin/env bash
# Session 12 device job h (4 GPUs): EP tests at worlds 2, 3 and 4 on the final kernels (2a30... see README);
# the EP bench at world 2 and world 4: final twice, prev (4d7d329) once, in one job.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m > $OUT/topo.txt 2>&1
(time timeout 300 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; grep -E "^test |test result|rc=" $OUT/ep_cuda.log
run() { # name, binary, world, env...
  local n=$1 b=$2 w=$3; shift 3
  env "$@" timeout 200 .carry/bin/$b --backend cuda --world $w --ep --graph --iters 20 --warmup 5 > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run w2-final ferrocomm-bench 2 X=1
run w2-prev ferrocomm-bench-prev 2 X=1
run w2-final-again ferrocomm-bench 2 X=1
run w4-final ferrocomm-bench 4 X=1
run w4-prev ferrocomm-bench-prev 4 X=1
run w4-final-again ferrocomm-bench 4 X=1
