#!/usr/bin/env bash
# Session 16 device job h: the dispatch's metadata by groups of tokens (mu: a warp per 4 tokens at top-8 stores their ids, weights, indices and fp8 scales
# in whole runs), EP conformance at world 2 on mu; then dispatch + combine and the dispatch alone (FC_DISPATCH_ONLY=1) on mu beside the head's kernels (hd, 8e885ce), three rounds.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
timeout 200 .carry/bin/ep_cuda_mu --include-ignored --test-threads=1 --skip ep_world_8 --skip ep_world_3 --skip ep_world_4 > $OUT/ep_cuda_mu.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda_mu.log; grep "^test \|result" $OUT/ep_cuda_mu.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { local n=$1 b=$2; shift 2; echo "== round $i $b $*" >> $OUT/$n.log; env "$@" timeout 100 .carry/bin/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; }
for i in 1 2 3; do
  for b in bench-hd bench-mu; do run full $b X=1; run donly $b FC_DISPATCH_ONLY=1; done
done
for n in full donly; do echo "== $n"; grep "==\| 128 \| 4096 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
