#!/usr/bin/env bash
# Session 19, call j (NOT RUN: too little device time was left to start a
# machine). Ready for the next session: var/*-fin built from 8d76a15 +
# tk-final.patch (call i's kernels with the take-mode body compiled apart:
# combine_ll<ALIGNED, TAKE>, the TAKE body out of line). EP conformance at
# world 2, then the EP bench beside the head (var/bench-head), two rounds.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
timeout 150 .carry/var/ep_cuda-fin --include-ignored --test-threads=1 --skip ep_world_3 --skip ep_world_4 --skip ep_world_8 > $OUT/ep_cuda.log 2>&1; echo "ep_cuda rc=$?" | tee -a $OUT/ep_cuda.log; grep "test result\|passed\|FAIL" $OUT/ep_cuda.log | tail -5
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,32,128,256,512,1024,2048,4096"
run() { local b=$1 exe=$2; echo "== round $i $b" >> $OUT/ep.log; timeout 60 $exe $A >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2; do
  if [ $i = 2 ]; then run fin .carry/var/bench-fin; run head .carry/var/bench-head
  else run head .carry/var/bench-head; run fin .carry/var/bench-fin; fi
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
