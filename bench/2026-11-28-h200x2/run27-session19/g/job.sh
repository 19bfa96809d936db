#!/usr/bin/env bash
# Session 19, call g (2x H200): .carry/bin is 8d76a15 + tk.patch (from 2048
# tokens a rank below world 4, 5/8 of the combine's grid put and every
# summing warp takes its units from a counter the dispatch zeroes, the
# putting blocks joining after their puts). (1) ci/gpu-cuda.sh's heap step
# (heap and window tests, EP conformance at world 2, the heap and EP suites
# under compute-sanitizer memcheck, heapbench); (2) the EP bench beside the
# head's kernels (var/bench-head, 632002d), three rounds, order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin heap > $OUT/heap-steps.log 2>&1; echo "rc=$?" >> $OUT/heap-steps.log; tail -14 $OUT/heap-steps.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,32,128,512,1024,2048,4096"
run() { local b=$1 exe=$2; echo "== round $i $b" >> $OUT/ep.log; timeout 100 $exe $A >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  if [ $i = 2 ]; then run tk .carry/bin/ferrocomm-bench; run head .carry/var/bench-head
  else run head .carry/var/bench-head; run tk .carry/bin/ferrocomm-bench; fi
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
