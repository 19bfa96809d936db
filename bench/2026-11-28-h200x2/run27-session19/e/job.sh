#!/usr/bin/env bash
# Session 19, call e (2x H200): beside the head (632002d): dyn4 / dyn5 (call
# d's dyn.patch, 64 / 80 putting blocks), dyn4dcl / dyn5dcl (dcl.patch, on
# dyn: the combine's sums no longer give the inbox back; the next dispatch
# writes 0xff over the rows the last combine filled, after its puts).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,512,1024,4096"
run() { local n=$1 b=$2; echo "== round $i $b" >> $OUT/$n.log; timeout 100 .carry/var/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; }
for i in 1 2 3; do
  case $i in 1) L="head dyn4 dyn5 dyn4dcl dyn5dcl";; 2) L="dyn5dcl dyn4dcl dyn5 dyn4 head";; 3) L="dyn4 head dyn5dcl dyn5 dyn4dcl";; esac
  for b in $L; do run full bench-$b; done
done
grep "==\| 128 \| 1024 \| 4096 \|rc=" $OUT/full.log | grep -v "rc=0"
