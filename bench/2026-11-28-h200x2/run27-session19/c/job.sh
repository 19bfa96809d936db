#!/usr/bin/env bash
# Session 19, call c (2x H200; the 4-GPU call b was refused, no x4 lent):
# .carry/bin is 632002d + llw.patch (ll_wait's polls issue every source's
# load before testing any). (1) ci/gpu-cuda.sh's conformance steps on it;
# (2) the LL all-reduce and the all-to-all at world 2, head (var/bench-head,
# 632002d) beside llw (no change expected at world 2: one peer); (3) the EP
# pair beside nosum / nosum4 (nosum.patch: the combine's summing role skipped,
# FC_EP_PUT_EIGHTHS 2 / 4: the put phase alone; outputs wrong on purpose).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,4096"
for i in 1 2; do for b in head nosum nosum4; do
  echo "== round $i $b" >> $OUT/ep-diag.log; timeout 100 .carry/var/bench-$b $A >> $OUT/ep-diag.log 2>&1; echo "rc=$?" >> $OUT/ep-diag.log
done; done
grep "==\|graph" $OUT/ep-diag.log
L="--backend cuda --world 2 --coll all_reduce --algo oneshot-ll --graph-only --dtype bf16 --min-bytes 1K --max-bytes 512K --iters 20 --warmup 5"
for b in head llw; do
  exe=.carry/bin/ferrocomm-bench; [ $b = head ] && exe=.carry/var/bench-head
  echo "== $b" >> $OUT/ll.log; timeout 100 $exe $L >> $OUT/ll.log 2>&1; echo "rc=$?" >> $OUT/ll.log
done
grep -v "^#" $OUT/ll.log | head -30
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin tests > $OUT/tests-steps.log 2>&1; echo "rc=$?" >> $OUT/tests-steps.log; tail -12 $OUT/tests-steps.log
