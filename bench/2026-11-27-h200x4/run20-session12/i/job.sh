#!/usr/bin/env bash
# Session 12 device job i (4 GPUs): world 4, the committed kernels (2/8 of the combine's grid putting) against 1/8 (p1), twice each,
# and the phase stamps (trace2.patch) at world 4.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
run() { # name, binary, world, tokens
  local n=$1 b=$2 w=$3 t=$4
  timeout 200 .carry/bin/$b --backend cuda --world $w --ep --graph --iters 20 --warmup 5 --tokens $t > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run w4 ferrocomm-bench 4 128,512,1024,4096
run w4-p1 ferrocomm-bench-p1 4 128,512,1024,4096
run w4-again ferrocomm-bench 4 128,512,1024,4096
run w4-p1-again ferrocomm-bench-p1 4 128,512,1024,4096
run w4-trace ferrocomm-bench-trace 4 128,1024,4096
run w2-p1 ferrocomm-bench-p1 2 128,512,1024,4096
