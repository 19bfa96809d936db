#!/usr/bin/env bash
# Session 21, call f (2x H200): main at 3355811 (.carry/bin from
# `PACK_PYTHON=0 bash ci/pack-gpu.sh`): ci/gpu-cuda.sh's tests, heap and
# epbench steps; then the EP bench at world 2, main against var/bench-head
# (942acc8), three rounds, the order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
cp .carry/var/job.sh $OUT/
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin tests heap epbench > $OUT/steps.log 2>&1; echo "rc=$?" >> $OUT/steps.log
export FERROCOMM_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
run() { local b=$1 exe=.carry/bin/ferrocomm-bench; [ $b = head ] && exe=.carry/var/bench-head; echo "== round $i $b" >> $OUT/ep.log; timeout 100 $exe --backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,512,2048,4096 >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 2) o="main head";; *) o="head main";; esac
  for b in $o; do run $b; done
done
cat $OUT/summary.txt 2>/dev/null | tail -30; tail -3 $OUT/steps.log
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
