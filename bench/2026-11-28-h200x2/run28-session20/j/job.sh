#!/usr/bin/env bash
# Session 20, call j (2x H200): the device put's grid in ferrocomm-bench
# --heap. var/bench-bN is main with blocks_for's cap (src/bin/ferrocomm-bench/
# heap.rs) at N blocks (32 on main: 256 KiB a block up to 32). Two rounds,
# rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
for i in 1 2; do
  case $i in 2) o="b128 b64 b32";; *) o="b32 b64 b128";; esac
  for b in $o; do echo "== round $i $b" >> $OUT/heap.log; timeout 60 .carry/var/bench-$b --backend cuda --world 2 --heap --graph --min-bytes 4M --max-bytes 256M --iters 20 --warmup 5 >> $OUT/heap.log 2>&1; echo "rc=$?" >> $OUT/heap.log; done
done
grep "==\|ce-copy\|device-put\|rc=" $OUT/heap.log | grep -v "rc=0"
