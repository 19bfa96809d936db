#!/usr/bin/env bash
# Session 20, call e (2x H200): main at eeb9c5f (.carry/bin from
# `PACK_PYTHON=0 bash ci/pack-gpu.sh`): ci/gpu-cuda.sh's tests (conformance
# as threads and as processes), heap (heap/window tests, EP conformance,
# heap and EP memcheck, heapbench) and epbench (EP dispatch + combine beside
# NCCL's all_to_all_v pipeline) steps.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin tests heap epbench > $OUT/steps.log 2>&1; echo "rc=$?" >> $OUT/steps.log
cat $OUT/summary.txt; tail -5 $OUT/steps.log
tar xzf $OUT/gpu-logs.tgz -O ./epbench_w2_blocks_default.log 2>/dev/null | grep "graph"
