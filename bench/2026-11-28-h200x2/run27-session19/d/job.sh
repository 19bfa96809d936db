#!/usr/bin/env bash
# Session 19, call d (2x H200): the combine's roles again, after call c's
# diagnostic (the put phase alone is ~12 us faster at 4096 tokens with 64
# putting blocks than with 32). Beside the head (632002d): p4 (64 of 128
# blocks put, FC_EP_PUT_EIGHTHS 4u), dyn2 / dyn3 / dyn4 (dyn.patch: summing
# warps take units from a counter the dispatch zeroes, one ahead, and the
# putting blocks join the sums after their puts; 32 / 48 / 64 putting blocks).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,32,128,512,4096"
run() { local n=$1 b=$2; echo "== round $i $b" >> $OUT/$n.log; timeout 100 .carry/var/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; }
for i in 1 2 3; do
  case $i in 1) L="head p4 dyn2 dyn3 dyn4";; 2) L="dyn4 dyn3 dyn2 p4 head";; 3) L="dyn2 head dyn4 p4 dyn3";; esac
  for b in $L; do run full bench-$b; done
done
grep "==\| 128 \| 512 \| 4096 \|rc=" $OUT/full.log | grep -v "rc=0"
