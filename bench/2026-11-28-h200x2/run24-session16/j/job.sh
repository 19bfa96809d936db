#!/usr/bin/env bash
# Session 16 device job j: mu2 (the dispatch's metadata by groups of 4 tokens, every load of a group issued before its stores), EP conformance at world 2 on it;
# then dispatch + combine and the dispatch alone (FC_DISPATCH_ONLY=1) on mu2 (m2) beside the head's kernels (hd, 8e885ce), three rounds.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
timeout 200 .carry/bin/ep_cuda_m2 --include-ignored --test-threads=1 --skip ep_world_8 --skip ep_world_3 --skip ep_world_4 > $OUT/ep_cuda_m2.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda_m2.log; grep "^test \|result" $OUT/ep_cuda_m2.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { local n=$1 b=$2; shift 2; echo "== round $i $b $*" >> $OUT/$n.log; env "$@" timeout 100 .carry/bin/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; }
for i in 1 2 3; do
  for b in bench-hd bench-m2; do run full $b X=1; done
  for b in bench-hd bench-m2; do run donly $b FC_DISPATCH_ONLY=1; done
done
for n in full donly; do echo "== $n"; grep "==\| 128 \| 4096 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
