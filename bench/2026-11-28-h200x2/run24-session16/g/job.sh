#!/usr/bin/env bash
# Session 16 device job g: the one-kernel combine's putting blocks at 40 (p5) and 48 (p6) of 128 (sixteenths) beside the head's 32 (8e885ce), three rounds.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,1024,4096"
run() { local n=$1 b=$2; echo "== round $i" >> $OUT/$n.log; timeout 100 .carry/bin/$b $A >> $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; }
for i in 1 2 3; do run head ferrocomm-bench; run p5 bench-p5; run p6 bench-p6; done
for n in head p5 p6; do echo "== $n"; grep " 128 \| 1024 \| 4096 \|rc=" $OUT/$n.log | grep -v "rc=0"; done
