#!/usr/bin/env bash
# Session 21, call g (4x H200): main at 3355811 (as call f): ci/gpu-cuda.sh's
# heap step at 4 GPUs (EP conformance at worlds 2-4, windows at world 4,
# heap and EP memcheck, heapbench); the EP bench at worlds 4 and 3 (192
# experts), main against var/bench-head (942acc8), two rounds, rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
cp .carry/var/job.sh $OUT/
STEP_TIMEOUT=150 OUT= bash ci/gpu-cuda.sh .carry/bin heap > $OUT/heap-steps.log 2>&1; echo "rc=$?" >> $OUT/heap-steps.log
tar czf $OUT/heap-logs.tgz gpu-logs 2>/dev/null; rm -rf gpu-logs
export FERROCOMM_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
run() { local w=$1 b=$2 exe=.carry/bin/ferrocomm-bench; shift 2; [ $b = head ] && exe=.carry/var/bench-head; echo "== w$w round $i $b" >> $OUT/ep.log; timeout 120 $exe --backend cuda --world $w --ep --graph --iters 20 --warmup 5 "$@" >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2; do
  case $i in 2) o="main head";; *) o="head main";; esac
  for b in $o; do run 4 $b --tokens 1,32,128,512,1024,2048,4096; done
  for b in $o; do run 3 $b --experts 192 --tokens 128,1024,4096; done
done
grep "rc=\|NOT RUN" $OUT/heap-steps.log | tail -14
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
