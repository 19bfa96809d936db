#!/usr/bin/env bash
# Session 14 device job o: the final kernels (the counts from block 0's last warp, on 401278a): EP conformance at world 2 and the bench beside 401278a.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
timeout 200 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_8 --skip ep_world_3 --skip ep_world_4 > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; grep "^test \|result" $OUT/ep_cuda.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" timeout 150 .carry/bin/$b $A > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run final ferrocomm-bench X=1
run c401278a bench-401278a X=1
