#!/usr/bin/env bash
# Session 19, call b (4x H200; NOT RUN: refused, no 4-GPU machine was lent).
# .carry/bin is 632002d + llw.patch (ll_wait's polls issue every source's
# load before testing any). (1) the heap/EP steps
# of ci/gpu-cuda.sh at 4 GPUs (EP conformance at worlds 2-4 on the session-18
# kernels, memcheck, heapbench); (2) the EP bench at worlds 4 and 3; (3) the
# LL all-reduce and the all-to-all at worlds 4 and 3, head (var/bench-head,
# 632002d) beside llw; (4) at world 2 on GPUs 0,1: the pair beside nosum /
# nosum4 (nosum.patch: the combine's summing role skipped, FC_EP_PUT_EIGHTHS
# 2 / 4: a diagnostic of the put phase alone; its outputs are wrong on purpose).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1; cat $OUT/gpus.txt | head -4
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin heap > $OUT/heap-steps.log 2>&1; echo "rc=$?" >> $OUT/heap-steps.log; tail -14 $OUT/heap-steps.log
for w in 4 3; do for i in 1 2; do
  [ $w = 3 ] && [ $i = 2 ] && continue
  echo "== world $w round $i" >> $OUT/ep-w34.log
  timeout 150 .carry/bin/ferrocomm-bench --backend cuda --world $w --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096 >> $OUT/ep-w34.log 2>&1; echo "rc=$?" >> $OUT/ep-w34.log
done; done
grep "==\|graph\|rc=" $OUT/ep-w34.log
L="--backend cuda --coll all_reduce --algo oneshot-ll --graph-only --dtype bf16 --min-bytes 1K --max-bytes 512K --iters 20 --warmup 5"
X="--backend cuda --coll all_to_all --graph-only --dtype bf16 --min-bytes 1K --max-bytes 64K --iters 20 --warmup 5"
for i in 1 2; do for w in 4 3; do
  case $i in 2) B="llw head";; *) B="head llw";; esac
  for b in $B; do
    exe=.carry/bin/ferrocomm-bench; [ $b = head ] && exe=.carry/var/bench-head
    echo "== round $i world $w $b" >> $OUT/ll.log; timeout 100 $exe $L --world $w >> $OUT/ll.log 2>&1; echo "rc=$?" >> $OUT/ll.log
    echo "== round $i world $w $b" >> $OUT/a2a.log; timeout 100 $exe $X --world $w >> $OUT/a2a.log 2>&1; echo "rc=$?" >> $OUT/a2a.log
  done
done; done
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,4096"
for i in 1 2; do for b in head nosum nosum4; do
  echo "== round $i $b" >> $OUT/ep-diag.log; CUDA_VISIBLE_DEVICES=0,1 timeout 100 .carry/var/bench-$b $A >> $OUT/ep-diag.log 2>&1; echo "rc=$?" >> $OUT/ep-diag.log
done; done
grep "==\|graph" $OUT/ep-diag.log
