#!/usr/bin/env bash
# Session 22, call d (2x H200): linkmix.cu, the copy engine and a kernel's
# stores sharing the link, each GPU sending to the other at once.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
D=bench/2026-11-28-h200x2/run30-session22/d
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
cp $D/job.sh $D/linkmix.cu $OUT/
nvcc -O3 -arch=sm_90 -o /tmp/linkmix $D/linkmix.cu > $OUT/build.log 2>&1 || { cat $OUT/build.log; exit 1; }
timeout 300 /tmp/linkmix 2>&1 | tee $OUT/linkmix.log
