#!/usr/bin/env bash
# Session 14 device job m: phase stamps on 401278a with issue-time stamps (trace_fine3.py + trace3.patch): after the count store, after the first unit's slots, after its x loads are issued (block 0 thread 0, ns after fc_grid_dep_wait).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,32,128"
run() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" timeout 150 .carry/bin/$b $A > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run trace bench-trace3 X=1
run trace-again bench-trace3 X=1
