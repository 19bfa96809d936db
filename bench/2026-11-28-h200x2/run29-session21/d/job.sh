#!/usr/bin/env bash
# Session 21, call d (2x H200): the combine's puts round the sources at
# world 2 (where they have one source): head (942acc8) / rotB (call c) / rotC (rotC.patch: rows past the fewest of any source test their count)
#
#
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
cp .carry/var/job-d.sh .carry/var/rotC.patch $OUT/
run() { local b=$1; echo "== round $i $b" >> $OUT/ep.log; timeout 100 .carry/var/bench-$b --backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,512,2048,4096 >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 1) o="head rotB rotC";; 2) o="rotB rotC head";; 3) o="rotC head rotB";; esac
  for b in $o; do run $b; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
