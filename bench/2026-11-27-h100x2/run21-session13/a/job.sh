#!/usr/bin/env bash
# Session 13 device job a: the warp layout (dispatch slots by warp shuffles, no block scan) against b40f1dc.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
(time timeout 240 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_3 --skip ep_world_4 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; tail -5 $OUT/ep_cuda.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
run() { # name, binary, extra args
  local n=$1 b=$2 x=$3
  timeout 150 .carry/bin/$b $A $x > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run prev ferrocomm-bench-prev ""
run new ferrocomm-bench ""
run nowarp ferrocomm-bench-nowarp ""
run run2 ferrocomm-bench-run2 ""
run trace-new ferrocomm-bench-trace "--tokens 1,8,128,512"
run new-again ferrocomm-bench ""
run prev-again ferrocomm-bench-prev ""
