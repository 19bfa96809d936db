#!/usr/bin/env bash
# Session 16 device job d: main (bench-m, no switch set) with the EP grid at 64 / 96 / 112 / 128 blocks (FERROCOMM_EP_BLOCKS), dispatch + combine up to 512 tokens, three rounds.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
run() { # name, binary, tokens, env...
  local n=$1 b=$2 t=$3; shift 3
  echo "== round $i $b $*" >> $OUT/$n.log
  env "$@" timeout 100 .carry/bin/$b $A --tokens $t >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log
}
for i in 1 2 3; do
  for g in 64 96 112 128; do run grid bench-m 1,8,32,128,512 FERROCOMM_EP_BLOCKS=$g; done
done
echo "== grid"; grep "==\| 32 \| 128 \|rc=" $OUT/grid.log | grep -v "rc=0"
