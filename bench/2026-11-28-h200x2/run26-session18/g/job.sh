#!/usr/bin/env bash
# Session 18, call g: the Python package built from fad4cb0 (ci/pack-python.sh;
# the head's EP kernels, ferrocomm::pause_compiles_for_exit at interpreter
# exit) on 2x H200: ci/gpu-cuda.sh's python step (the GPU tests, EP through
# torch included, and the Python benches).
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1 FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi -L > $OUT/gpus.txt
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
export FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
STEP_TIMEOUT=240 bash ci/gpu-cuda.sh .carry/bin python > $OUT/steps.log 2>&1
echo "gpu-cuda.sh rc=$?" >> $OUT/steps.log
grep -v "NOT RUN" $OUT/summary.txt; tail -2 $OUT/steps.log
