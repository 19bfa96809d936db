#!/usr/bin/env bash
# Session 19, call h (2x H200): call g's tk (.carry/bin) was 0.7 us slower at
# 128 tokens; tk2 (var/bench-tk2) makes a timeout warp-wide only when the
# warp takes units (the static path keeps per-lane stops, as on the head).
# Beside the head (var/bench-head), two rounds, order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,32,128,512,1024,4096"
run() { local b=$1 exe=$2; echo "== round $i $b" >> $OUT/ep.log; timeout 60 $exe $A >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2; do
  if [ $i = 2 ]; then run tk2 .carry/var/bench-tk2; run tk .carry/bin/ferrocomm-bench; run head .carry/var/bench-head
  else run head .carry/var/bench-head; run tk .carry/bin/ferrocomm-bench; run tk2 .carry/var/bench-tk2; fi
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0" | grep -v " 32 \| 1 "
