#!/usr/bin/env bash
# Session 19, call a: the combine's polls at large batches. Beside the head
# (632002d): nap500 / nap2k (nap.patch, FC_EP_NAP 500 / 2000: __nanosleep
# between a unit's looks from 1024 tokens), one (one.patch, FC_EP_ONE 1024u:
# after a first look that missed, the warp waits on the unit's last pack
# alone, one line a warp, from 1024 tokens) and one0 (the same at every size).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,32,128,512,4096"
run() { local n=$1 b=$2; shift 2; echo "== round $i $b $*" >> $OUT/$n.log; env "$@" timeout 100 .carry/var/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; }
for i in 1 2 3; do
  case $i in 1) L="head nap500 nap2k one one0";; 2) L="one0 one nap2k nap500 head";; 3) L="nap500 one head one0 nap2k";; esac
  for b in $L; do run full bench-$b X=1; done
done
grep "==\| 128 \| 4096 \|rc=" $OUT/full.log | grep -v "rc=0"
