#!/usr/bin/env bash
# Session 16 device job i: the head (8e885ce) on four GPUs: EP conformance at worlds 2, 3 and 4, the heap/EP steps of ci/gpu-cuda.sh with the world-4 steps,
# and the EP bench at world 4, two rounds.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1; cat $OUT/gpus.txt
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin heap > $OUT/heap-steps.log 2>&1; echo "rc=$?" >> $OUT/heap-steps.log; tail -22 $OUT/heap-steps.log
A="--backend cuda --world 4 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
for i in 1 2; do echo "== round $i" >> $OUT/w4.log; timeout 150 .carry/bin/ferrocomm-bench $A >> $OUT/w4.log 2>&1; echo "rc=$?" >> $OUT/w4.log; done
grep "graph\|rc=" $OUT/w4.log
