#!/usr/bin/env bash
# Session 20, call a (2x H200): .carry/bin is df9022e + run27-session19/j/tk-final.patch
# (counter from 2048 tokens, 5/8 of the grid putting, whole-warp stores from 512
# tokens; the TAKE body compiled apart). (1) ci/gpu-cuda.sh's heap step (heap
# and window tests, EP conformance at world 2, heap and EP suites under
# compute-sanitizer memcheck, heapbench); (2) the EP bench beside the head
# (var/bench-head, df9022e), three rounds, order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin heap > $OUT/heap-steps.log 2>&1; echo "rc=$?" >> $OUT/heap-steps.log; tail -14 $OUT/heap-steps.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,32,128,256,512,1024,2048,4096"
run() { local b=$1 exe=$2; echo "== round $i $b" >> $OUT/ep.log; timeout 100 $exe $A >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  if [ $i = 2 ]; then run fin .carry/bin/ferrocomm-bench; run head .carry/var/bench-head
  else run head .carry/var/bench-head; run fin .carry/bin/ferrocomm-bench; fi
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
