#!/usr/bin/env bash
# Session 15 device job j: the final kernels (e848ecd) beside 12bae9a's (base), three rounds each, world 2 (an attempt at H200s).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { # name, binary
  local n=$1 b=$2
  echo "== round $i" >> $OUT/$n.log
  timeout 100 .carry/bin/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log
}
for i in 1 2 3; do
  run base bench-base; run final ferrocomm-bench
done
for n in base final; do echo "== $n"; grep " 128 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
