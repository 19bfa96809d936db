#!/usr/bin/env bash
# Session 16 device job a: on 5cf466a, EP conformance at world 2; the bench on main (m, which also times the dispatch alone under FC_DISPATCH_ONLY=1),
# the combine's putting warps with two units in flight (cdb, and cdb1 with one eighth of the grid putting), the dispatch's with two (ddb).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
N=$(nvidia-smi -L | wc -l)
SKIP="--skip ep_world_8"; [ "$N" -lt 4 ] && SKIP="$SKIP --skip ep_world_3 --skip ep_world_4"
timeout 200 .carry/bin/ep_cuda --include-ignored --test-threads=1 $SKIP > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; grep "^test \|result" $OUT/ep_cuda.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { # name, binary, env
  local n=$1 b=$2
  echo "== round $i" >> $OUT/$n.log
  env $3 timeout 100 .carry/bin/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log
}
for i in 1 2 3; do
  run m bench-m X=1; run cdb bench-cdb X=1; run cdb1 bench-cdb1 X=1; run ddb bench-ddb X=1
  run dm bench-m FC_DISPATCH_ONLY=1; run dddb bench-ddb FC_DISPATCH_ONLY=1
done
for n in m cdb cdb1 ddb dm dddb; do echo "== $n"; grep " 128 \| 4096 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
