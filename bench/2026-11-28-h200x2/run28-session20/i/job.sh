#!/usr/bin/env bash
# Session 20, call i (4x H200): EP conformance (ep_cuda, worlds 2-4) with
# take4b.patch: fc_ep_combine_ll_take up to world 4, 2 eighths of the grid
# putting at world 4 (FC_EP_TAKE_EIGHTHS_WIDE), 5 below.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
timeout 150 .carry/var/ep_cuda-t4 --include-ignored --test-threads=1 --skip ep_world_8 > $OUT/ep_cuda.log 2>&1; echo "ep_cuda rc=$?" | tee -a $OUT/ep_cuda.log; grep "^test \|test result" $OUT/ep_cuda.log
