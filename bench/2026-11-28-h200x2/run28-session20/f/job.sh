#!/usr/bin/env bash
# Session 20, call f (4x H200): main at eeb9c5f (.carry/bin as in call e).
# (1) ci/gpu-cuda.sh's heap step at 4 GPUs: EP conformance at worlds 2-4
# (world 3 runs fc_ep_combine_ll_take from 2048 tokens), heap/EP memcheck,
# heapbench; (2) the EP bench at worlds 3 and 4; (3) the LL all-reduce and
# the LL all-to-all at worlds 4 and 3, main beside var/bench-llhead (632002d's
# collectives.cu and common.cuh: the LL polls before 8d76a15), two rounds,
# rotated; (4) ci/gpu-cuda.sh's tests step (conformance at worlds 2-4, threads
# and processes).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1; head -4 $OUT/gpus.txt
STEP_TIMEOUT=150 OUT= bash ci/gpu-cuda.sh .carry/bin heap > $OUT/heap-steps.log 2>&1; echo "rc=$?" >> $OUT/heap-steps.log; grep "rc=\|NOT RUN" $OUT/heap-steps.log | tail -14
tar czf $OUT/heap-logs.tgz gpu-logs 2>/dev/null; rm -rf gpu-logs
for w in 3 4; do
  echo "== world $w" >> $OUT/ep-w34.log
  timeout 100 .carry/bin/ferrocomm-bench --backend cuda --world $w --ep --graph --iters 20 --warmup 5 --tokens 1,32,128,512,2048,4096 >> $OUT/ep-w34.log 2>&1; echo "rc=$?" >> $OUT/ep-w34.log
done
grep "==\|graph\|rc=" $OUT/ep-w34.log
L="--backend cuda --coll all_reduce --algo oneshot-ll --graph-only --dtype bf16 --min-bytes 1K --max-bytes 512K --iters 20 --warmup 5"
X="--backend cuda --coll all_to_all --graph-only --dtype bf16 --min-bytes 1K --max-bytes 64K --iters 20 --warmup 5"
for i in 1 2; do for w in 4 3; do
  case $i in 2) B="main llhead";; *) B="llhead main";; esac
  for b in $B; do
    exe=.carry/bin/ferrocomm-bench; [ $b = llhead ] && exe=.carry/var/bench-llhead
    echo "== round $i world $w $b" >> $OUT/ll.log; timeout 60 $exe $L --world $w >> $OUT/ll.log 2>&1; echo "rc=$?" >> $OUT/ll.log
    echo "== round $i world $w $b" >> $OUT/a2a.log; timeout 60 $exe $X --world $w >> $OUT/a2a.log 2>&1; echo "rc=$?" >> $OUT/a2a.log
  done
done; done
grep -c "rc=0" $OUT/ll.log $OUT/a2a.log
STEP_TIMEOUT=150 bash ci/gpu-cuda.sh .carry/bin tests > $OUT/tests-steps.log 2>&1; echo "rc=$?" >> $OUT/tests-steps.log; cat $OUT/summary.txt
