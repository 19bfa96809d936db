#!/usr/bin/env bash
# Session 13 device job c: where the Lamport dispatch's time goes (phase stamps), and the combine without its fence (unsafe, timing only).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
run() { # name, binary, extra, env...
  local n=$1 b=$2 x=$3; shift 3
  env "$@" timeout 150 .carry/bin/$b $A $x > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run trace ferrocomm-bench-trace "--tokens 1,128,512" X=1
run nofence ferrocomm-bench-nofence "--tokens 1,128,512" X=1
run new ferrocomm-bench "--tokens 1,128,512" X=1
run flag ferrocomm-bench "--tokens 1,128,512" FERROCOMM_EP_LAMPORT_DISPATCH=0
