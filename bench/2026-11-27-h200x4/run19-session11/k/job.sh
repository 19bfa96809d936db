#!/usr/bin/env bash
# Session 11 device job k (4 GPUs): the combine's putting share at world 4.
# ferrocomm-bench: 2/8 (committed); -p1: 1/8 (committed code otherwise);
# -p3, -p5: 3/8 and 5/8 from call g's tree (the combine's wait moved into the next dispatch).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 4 --ep --graph --iters 20 --warmup 5 --tokens 128,512,1024,4096"
for b in ferrocomm-bench ferrocomm-bench-p1 ferrocomm-bench-p3 ferrocomm-bench-p5; do
  timeout 120 .carry/bin/$b $A > $OUT/$b.log 2>&1; echo "rc=$?" >> $OUT/$b.log; echo "== $b"; grep -v autotune $OUT/$b.log | grep -v "^#"
done
