#!/usr/bin/env bash
# Session 16 device job e: the dispatch's metadata (fp8 scales, top-k ids and weights, token index, slots) moved from a row's first piece's warp
# to its last piece's (lm; an fp8 row's last piece is half a piece): EP conformance at world 2 on lm, then dispatch + combine on lm beside main (m),
# and the dispatch alone (FC_DISPATCH_ONLY=1), three rounds each.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
timeout 200 .carry/bin/ep_cuda_lm --include-ignored --test-threads=1 --skip ep_world_8 --skip ep_world_3 --skip ep_world_4 > $OUT/ep_cuda_lm.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda_lm.log; grep "^test \|result" $OUT/ep_cuda_lm.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
run() { # name, binary, tokens, env...
  local n=$1 b=$2 t=$3; shift 3
  echo "== round $i $b $*" >> $OUT/$n.log
  env "$@" timeout 100 .carry/bin/$b $A --tokens $t >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log
}
for i in 1 2 3; do
  for b in bench-m bench-lm; do run full $b 1,8,32,128,512,4096 X=1; run donly $b 128,512,4096 FC_DISPATCH_ONLY=1; done
done
for n in full donly; do echo "== $n"; grep "==\| 128 \| 4096 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
