#!/usr/bin/env bash
# Session 15 device job i: the final kernels (e848ecd) on 4 GPUs: EP conformance at worlds 2-4, the world-4 bench beside 12bae9a's kernels (base), the heap steps.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt
timeout 200 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_8 > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; grep "^test \|result" $OUT/ep_cuda.log
A="--backend cuda --world 4 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { # name, binary
  local n=$1 b=$2
  echo "== round $i" >> $OUT/$n.log
  timeout 100 .carry/bin/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log
}
for i in 1 2; do
  run base-w4 bench-base; run final-w4 ferrocomm-bench
done
for n in base-w4 final-w4; do echo "== $n"; grep "graph\|rc=" $OUT/$n.log | grep -v "rc=0"; done
STEP_TIMEOUT=150 timeout 240 bash ci/gpu-cuda.sh .carry/bin heap > $OUT/heap-steps.log 2>&1; echo "rc=$?" >> $OUT/heap-steps.log; tail -15 $OUT/heap-steps.log
