#!/usr/bin/env bash
# Session 11 device job c: the EP grid at small token counts.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
which nsys ncu > $OUT/tools.txt 2>&1; ls /usr/local/cuda/bin >> $OUT/tools.txt 2>&1
B=".carry/bin/ferrocomm-bench --backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,128,1024"
for b in 8 32 128; do FERROCOMM_EP_BLOCKS=$b timeout 120 $B > $OUT/epbench_blocks$b.log 2>&1; echo "rc=$?" >> $OUT/epbench_blocks$b.log; echo "== blocks $b"; grep -v autotune $OUT/epbench_blocks$b.log | grep -v "^#"; done
