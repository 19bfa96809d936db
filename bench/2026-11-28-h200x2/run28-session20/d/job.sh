#!/usr/bin/env bash
# Session 20, call d (2x H200): the take kernel on every multiprocessor.
# var/bench-t5 is e6573f0 (128 blocks); bench-g132 / ep_cuda-g132 the same
# with g132.patch (fc_ep_combine_ll_take launched on all the GPU's
# multiprocessors, 132 on H200, when ep_blocks is not set; the dispatch
# keeps 128). EP conformance at world 2 on g132, then the EP bench, three
# rounds, the order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
timeout 150 .carry/var/ep_cuda-g132 --include-ignored --test-threads=1 --skip ep_world_3 --skip ep_world_4 --skip ep_world_8 > $OUT/ep_cuda.log 2>&1; echo "ep_cuda rc=$?" | tee -a $OUT/ep_cuda.log; grep "test result" $OUT/ep_cuda.log | tail -2
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 128,2048,4096"
run() { local b=$1; echo "== round $i $b" >> $OUT/ep.log; timeout 100 .carry/var/bench-$b $A >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 2) o="g132 t5";; *) o="t5 g132";; esac
  for b in $o; do run $b; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
