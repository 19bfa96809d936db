#!/usr/bin/env bash
# Session 20, call h (4x H200): the take kernel at world 4. var/bench-main
# is main (world 4: fixed shares, one eighth of the grid putting from 512
# tokens); bench-t4e5 / -t4e2: take4.patch (fc_ep_combine_ll_take below
# world 8) with FC_EP_TAKE_EIGHTHS 5 / 2. World 4, two rounds, rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 4 --ep --graph --iters 20 --warmup 5 --tokens 2048,4096"
for i in 1 2; do
  case $i in 2) o="t4e2 t4e5 main";; *) o="main t4e5 t4e2";; esac
  for b in $o; do echo "== round $i $b" >> $OUT/ep.log; timeout 100 .carry/var/bench-$b $A >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
