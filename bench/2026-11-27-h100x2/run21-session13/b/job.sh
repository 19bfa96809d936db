#!/usr/bin/env bash
# Session 13 device job b: the Lamport dispatch (rows as Lamport packs, tagged counts and row words, no flag round trip) against b40f1dc and against itself with FERROCOMM_EP_LAMPORT_DISPATCH=0.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
(time timeout 300 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_3 --skip ep_world_4 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; tail -8 $OUT/ep_cuda.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
run() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" timeout 150 .carry/bin/$b $A > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run prev ferrocomm-bench-prev X=1
run new ferrocomm-bench X=1
run flag ferrocomm-bench FERROCOMM_EP_LAMPORT_DISPATCH=0
run new-again ferrocomm-bench X=1
run prev-again ferrocomm-bench-prev X=1
