#!/usr/bin/env bash
# Session 15 device job f: on 12ef687 (final), thread 0 of each block touches (a volatile load) the first word of topk_idx and x before the dispatch's dependent-launch wait (warm1), and also of expert_out and recv_src before the combine's (warm2). Three rounds each, appended to one log.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { # name, binary
  local n=$1 b=$2
  echo "== round $i" >> $OUT/$n.log
  timeout 100 .carry/bin/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log
}
for i in 1 2 3; do
  run final ferrocomm-bench; run warm1 bench-warm1; run warm2 bench-warm2
done
for n in final warm1 warm2; do echo "== $n"; grep " 128 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
