#!/usr/bin/env bash
# Session 18, call h: python/bench/profile_ep.py after its fix (the profiler
# started once on every rank before timing; kernel records' union and
# overlap, since dependent launches overlap them), with fad4cb0's wheel.
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi -L > $OUT/gpus.txt
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
export FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
site=/tmp/ferrocomm-site; rm -rf $site
python3 -m pip install -q --no-index --no-deps --target $site .carry/python/ferrocomm-*.whl
export PYTHONPATH=$site
timeout 200 torchrun --nproc_per_node=2 python/bench/profile_ep.py > $OUT/profile_ep.log 2>&1
echo "rc=$?" >> $OUT/profile_ep.log
grep -v "^W1128\|UserWarning\|_warn_once" $OUT/profile_ep.log
