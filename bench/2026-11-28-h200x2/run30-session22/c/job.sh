#!/usr/bin/env bash
# Session 22, call c (2x H200): linkbw.cu, the peer-write rate of st.global,
# cp.async.bulk (TMA) and the copy engine, one way and both ways at once.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
D=bench/2026-11-28-h200x2/run30-session22/c
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
cp $D/job.sh $D/linkbw.cu $OUT/
nvcc -O3 -arch=sm_90 -o /tmp/linkbw $D/linkbw.cu > $OUT/build.log 2>&1 || { cat $OUT/build.log; exit 1; }
timeout 300 /tmp/linkbw 2>&1 | tee $OUT/linkbw.log
