#!/usr/bin/env bash
# Session 14 device job a: dispatch loads each warp's first unit before its layout and each next one ahead (ahead1), first unit only (ahead0); combine loads its first unit before the row count. Against 072691d (base).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
timeout 300 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_8 --skip ep_world_3 --skip ep_world_4 > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; tail -4 $OUT/ep_cuda.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" timeout 150 .carry/bin/$b $A > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run base bench-base X=1
run ahead1 ferrocomm-bench X=1
run ahead0 bench-ahead0 X=1
run ahead1-again ferrocomm-bench X=1
run base-again bench-base X=1
