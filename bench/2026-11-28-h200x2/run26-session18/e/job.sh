#!/usr/bin/env bash
# Session 18, call e: on the head (2186ba6): the dispatch alone beside the pair
# (dh = head + dispatch-only.patch, FC_DISPATCH_ONLY=1), and the combine's
# putting share at 24 / 40 / 48 of 128 blocks (p3 / p5 / p6: pN.patch, N/16;
# the head puts with 32) beside the head (dh without the variable).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,512,1024,4096"
run() { local n=$1 b=$2; shift 2; echo "== round $i $b $*" >> $OUT/$n.log; env "$@" timeout 100 .carry/var/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; }
for i in 1 2 3; do
  run donly bench-dh FC_DISPATCH_ONLY=1
  for b in bench-dh bench-p3 bench-p5 bench-p6; do run full $b X=1; done
done
for n in donly full; do echo "== $n"; grep "==\| 128 \| 4096 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
# The fused LL one-shot's first looks (fl = the head + fl.patch) beside the head,
# rows of 8192 (two packs a thread: the change) and 4096 (one pack: control).
F="--backend cuda --world 2 --fused res,rms --graph --algo oneshot-ll --tokens 1,8,32,128 --iters 20 --warmup 5"
runf() { echo "== round $i $1 hidden $2" >> $OUT/fused.log; timeout 100 .carry/var/$1 $F --hidden $2 >> $OUT/fused.log 2>&1; echo "rc=$?" >> $OUT/fused.log; }
for i in 1 2 3; do
  for h in 8192 4096; do runf bench-head $h; runf bench-fl $h; done
done
grep -v "^#" $OUT/fused.log | head -40
