#!/usr/bin/env bash
# Session 18, call d: the head (2186ba6: the EP kernels' compact fast path and
# grouped Lamport looks) on 2x H200: the device, process, cold-start, torchrun,
# heap/EP steps (EP conformance, memcheck, heapbench: device put against the
# copy engine) and the EP bench step; then three rounds of the EP bench on the
# head beside e7ac9ef (hd), order alternated.
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1 FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi -L > $OUT/gpus.txt
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
export FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
TORCH_STORE_TESTS=0 STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin tests coldstart torchrun heap epbench > $OUT/steps.log 2>&1
echo "gpu-cuda.sh rc=$?" >> $OUT/steps.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { echo "== round $i $1" >> $OUT/ab.log; timeout 100 $2 $A >> $OUT/ab.log 2>&1; echo "rc=$?" >> $OUT/ab.log; }
i=1; run head .carry/bin/ferrocomm-bench; run hd .carry/var/bench-hd
i=2; run hd .carry/var/bench-hd; run head .carry/bin/ferrocomm-bench
i=3; run head .carry/bin/ferrocomm-bench; run hd .carry/var/bench-hd
grep -v "NOT RUN" $OUT/summary.txt; tail -2 $OUT/steps.log
grep "==\| 128 \| 4096 " $OUT/ab.log
