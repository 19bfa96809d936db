#!/usr/bin/env bash
# Session 21, call a (2x H200): the dispatch's metadata by runs of 8 tokens
# (fc_ep_dispatch_grouped). ep_cuda-g1 (every batch grouped) and -g1024 (from
# 1024 tokens) at world 2; then the EP bench, head (942acc8) / g1024 / g1,
# three rounds, the order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
cp .carry/var/job-a.sh .carry/var/grouped.patch $OUT/
for v in g1 g1024; do
  timeout 150 .carry/var/ep_cuda-$v --include-ignored --test-threads=1 ep_world_2 > $OUT/ep_cuda-$v.log 2>&1; echo "ep_cuda-$v rc=$?" | tee -a $OUT/summary.txt
done
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,512,1024,2048,4096"
run() { local b=$1; echo "== round $i $b" >> $OUT/ep.log; timeout 100 .carry/var/bench-$b $A >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 1) o="head g1024 g1";; 2) o="g1024 g1 head";; 3) o="g1 head g1024";; esac
  for b in $o; do run $b; done
done
cat $OUT/summary.txt
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0" | head -120
