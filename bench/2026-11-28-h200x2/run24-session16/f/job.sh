#!/usr/bin/env bash
# Session 16 device job f: the committed head (8e885ce): the heap/EP steps of ci/gpu-cuda.sh (heap_cuda, heap_torchrun, ep_cuda, heap_memcheck, heapbench),
# then the EP bench on the head beside 5cf466a's kernels (bench-m), three rounds each, and the head's dispatch alone is not timed (packed bench has no switch).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin heap > $OUT/heap-steps.log 2>&1; echo "rc=$?" >> $OUT/heap-steps.log; tail -20 $OUT/heap-steps.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { local n=$1 b=$2; echo "== round $i" >> $OUT/$n.log; timeout 100 .carry/bin/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; }
for i in 1 2 3; do run head ferrocomm-bench; run base bench-m; done
for n in head base; do echo "== $n"; grep " 128 \| 4096 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
