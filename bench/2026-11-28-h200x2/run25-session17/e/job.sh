#!/usr/bin/env bash
# Session 17, call e: the Python package (e5920dc: atexit leaves the stores,
# then pauses the background compiles) on 2x H200: the torch GPU tests with
# an EMPTY kernel cache, so every rank process exits with compiles running.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi -L > $OUT/gpus.txt
site=/tmp/ferrocomm-site; rm -rf $site
python3 -m pip install -q --no-index --no-deps --target $site .carry/python/ferrocomm-*.whl > $OUT/install.log 2>&1
export PYTHONPATH=$site
cold=/tmp/fc-empty-cache; rm -rf $cold; mkdir -p $cold; chmod 700 $cold
export FERROCOMM_CACHE_DIR=$cold
start=$SECONDS
timeout 420 python3 -m pytest -x -v -rs python/tests/test_gpu_torch.py > $OUT/python_gpu_tests.log 2>&1
echo "pytest rc=$? in $((SECONDS-start)) s" | tee $OUT/summary.txt
grep -c "SIGSEGV\|Segmentation\|signal 11\|exitcode: -11" $OUT/python_gpu_tests.log | sed 's/^/crash lines: /' | tee -a $OUT/summary.txt
ls $cold | wc -l | sed 's/^/kernels cached: /' | tee -a $OUT/summary.txt
tail -15 $OUT/python_gpu_tests.log
