#!/usr/bin/env bash
# Session 15 device job l: e848ecd's bench (final, the kernels of main) beside 12bae9a's (base), two rounds each, world 2 (a last attempt at H200s).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && chmod 700 /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { # name, binary
  local n=$1 b=$2
  echo "== round $i" >> $OUT/$n.log
  timeout 100 .carry/bin/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log
}
for i in 1 2; do
  run base bench-base; run final ferrocomm-bench
done
for n in base final; do echo "== $n"; grep " 128 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
