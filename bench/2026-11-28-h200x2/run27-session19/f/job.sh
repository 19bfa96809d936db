#!/usr/bin/env bash
# Session 19, call f (2x H200): beside the head (632002d) and dyn5 (call d's
# dyn.patch, 80 putting blocks): tma (tma.patch, which holds dyn.patch: the
# combine's putting warps stage each 2 KiB piece in shared memory and send it
# with one cp.async.bulk; 32 putting blocks, static sums), tma1 (the same with
# 16 putting blocks), tmadyn4 (tma with dyn's counter and 64 putting blocks).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,512,4096"
run() { local n=$1 b=$2; echo "== round $i $b" >> $OUT/$n.log; timeout 60 .carry/var/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; }
for i in 1 2 3; do
  case $i in 1) L="head dyn5 tma tma1 tmadyn4";; 2) L="tmadyn4 tma1 tma dyn5 head";; 3) L="tma head tmadyn4 dyn5 tma1";; esac
  for b in $L; do run full bench-$b; done
done
grep "==\| 128 \| 4096 \|rc=" $OUT/full.log | grep -v "rc=0"
