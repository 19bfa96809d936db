#!/usr/bin/env bash
# Session 20, call g (4x H200): the take kernel at world 3. var/bench-main is
# main (eeb9c5f's kernels: fc_ep_combine_ll_take from 2048 tokens below
# world 4), var/bench-notake the same with TAKE_TOKENS = usize::MAX (fixed
# shares always). World 3, 192 experts (256 is not divisible by 3), two
# rounds, rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
A="--backend cuda --world 3 --experts 192 --ep --graph --iters 20 --warmup 5 --tokens 128,512,2048,4096"
for i in 1 2; do
  case $i in 2) o="notake main";; *) o="main notake";; esac
  for b in $o; do echo "== round $i $b" >> $OUT/ep.log; timeout 100 .carry/var/bench-$b $A >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
