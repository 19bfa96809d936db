#!/usr/bin/env bash
# Session 14 device job n: on 401278a (final), the dispatch's counts go out from block 0's last warp (cwarp), and also every block's last warp loads the peer's count word before the layout (ctouch). cwarp.patch (FC_EP_CTOUCH 0 / 1).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" timeout 150 .carry/bin/$b $A > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run final ferrocomm-bench X=1
run cwarp bench-cwarp X=1
run ctouch bench-ctouch X=1
run cwarp-again bench-cwarp X=1
run ctouch-again bench-ctouch X=1
run final-again ferrocomm-bench X=1
