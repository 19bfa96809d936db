#!/usr/bin/env bash
# Session 20, call c (2x H200): the take kernel's putting share. var/bench-t5
# is e6573f0 (5/8 of the grid put in fc_ep_combine_ll_take), bench-t6 / -t7
# the same with "#define FC_EP_TAKE_EIGHTHS 6u / 7u" on top of ep.cu. The EP
# bench, three rounds, the order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 512,2048,4096"
run() { local b=$1; echo "== round $i $b" >> $OUT/ep.log; timeout 100 .carry/var/bench-$b $A >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 1) o="t5 t6 t7";; 2) o="t6 t7 t5";; 3) o="t7 t5 t6";; esac
  for b in $o; do run $b; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
