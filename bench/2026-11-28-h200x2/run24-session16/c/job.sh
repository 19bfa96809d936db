#!/usr/bin/env bash
# Session 16 device job c: the one-kernel combine with 8 or 4 of a summing block's 16 warps summing from 1024 tokens (sw8, sw4) beside main (m);
# the dispatch alone (FC_DISPATCH_ONLY=1) on main and two diagnostic builds that skip work: no metadata puts (nometa), no local copy (nolocal).
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
for i in 1 2; do
  for b in bench-m bench-sw8 bench-sw4; do run full $b 128,1024,4096 X=1; done
  for b in bench-m bench-nometa bench-nolocal; do run donly $b 128,4096 FC_DISPATCH_ONLY=1; done
done
for n in full donly; do echo "== $n"; grep "==\| 128 \| 1024 \| 4096 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
