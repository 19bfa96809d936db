#!/usr/bin/env bash
# Session 21, call c (2x H200): the combine's puts round the sources at
# world 2 (where they have one source): head (942acc8) / rot (call b's) /
# rotB (rotB.patch: every unit's loads before its count check; world 4 with
# 2/8 putting, 3/8 in the take kernel). ep_cuda-rotB at world 2 first.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
cp .carry/var/job-c.sh .carry/var/rotB.patch $OUT/
timeout 150 .carry/var/ep_cuda-rotB --include-ignored --test-threads=1 ep_world_2 a_peer > $OUT/ep_cuda-rotB.log 2>&1; echo "ep_cuda-rotB rc=$?" > $OUT/summary.txt
run() { local b=$1; echo "== round $i $b" >> $OUT/ep.log; timeout 100 .carry/var/bench-$b --backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,512,2048,4096 >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 1) o="head rot rotB";; 2) o="rot rotB head";; 3) o="rotB head rot";; esac
  for b in $o; do run $b; done
done
cat $OUT/summary.txt; grep "test result\|FAIL" $OUT/ep_cuda-rotB.log
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
