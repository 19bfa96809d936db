#!/usr/bin/env bash
# Session 16 device job b: main's bench binary with a dispatch-only switch (bench-m): the dispatch alone at grids of 32/64/96/128 blocks,
# and dispatch + combine with the plain (two-kernel) combine, beside the default.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
run() { # name, binary, tokens, env...
  local n=$1 b=$2 t=$3; shift 3
  echo "== round $i $*" >> $OUT/$n.log
  env "$@" timeout 100 .carry/bin/$b $A --tokens $t >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log
}
for i in 1 2; do
  for g in 32 64 96 128; do run dgrid bench-m 128,512,4096 FC_DISPATCH_ONLY=1 FERROCOMM_EP_BLOCKS=$g; done
  run full bench-m 1,8,32,128,512,4096 X=1
  run plain bench-m 1,8,32,128,512,4096 FERROCOMM_EP_PLAIN_COMBINE=1
done
for n in dgrid full plain; do echo "== $n"; grep "==\| 128 \| 4096 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
