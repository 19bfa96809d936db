#!/usr/bin/env bash
# Session 11 device job: EP tests and benches (low-latency mode).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt
STEPS="${STEPS:-test bench}"
B=".carry/bin/ferrocomm-bench --backend cuda --world 2 --ep --graph --iters 20 --warmup 5"
for step in $STEPS; do
case $step in
test) (time timeout 240 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_8 ${EPTEST_ARGS:-}) > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; tail -5 $OUT/ep_cuda.log;;
bench) timeout 150 $B > $OUT/epbench.log 2>&1; echo "rc=$?" >> $OUT/epbench.log; cat $OUT/epbench.log | grep -v autotune;;
normal) FERROCOMM_EP_LL_MAX_TOKENS=0 timeout 150 $B > $OUT/epbench_normal.log 2>&1; echo "rc=$?" >> $OUT/epbench_normal.log; grep -v autotune $OUT/epbench_normal.log;;
llbig) FERROCOMM_EP_LL_MAX_TOKENS=4096 timeout 150 $B --tokens 512,1024,2048,4096 > $OUT/epbench_llbig.log 2>&1; echo "rc=$?" >> $OUT/epbench_llbig.log; grep -v autotune $OUT/epbench_llbig.log;;
esac
done
