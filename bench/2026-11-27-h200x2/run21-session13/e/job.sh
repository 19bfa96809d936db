#!/usr/bin/env bash
# Session 13 device job e: the expert-rank reciprocal from the host (v1), and 32-bit unit divisions (v2, this build); against b40f1dc; the heap suite with autotune off.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
(time timeout 240 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_3 --skip ep_world_4 --skip ep_world_8) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; tail -4 $OUT/ep_cuda.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
run() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" timeout 150 .carry/bin/$b $A > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n"; grep -v autotune $OUT/$n.log | grep -v "^#"
}
run prev ferrocomm-bench-prev X=1
run v1 ferrocomm-bench-v1 X=1
run v2 ferrocomm-bench X=1
run v2-again ferrocomm-bench X=1
run v1-again ferrocomm-bench-v1 X=1
run prev-again ferrocomm-bench-prev X=1
# The heap suite after the benches' autotune tables are cached (job d's failure): autotune off now.
(timeout 200 .carry/bin/heap_cuda --include-ignored --test-threads=1 --skip world_4 --skip world_8) > $OUT/heap_cuda.log 2>&1; echo "rc=$?" >> $OUT/heap_cuda.log; grep -E "^test |test result" $OUT/heap_cuda.log
