#!/usr/bin/env bash
# Session 21, call i (4x H200): the take kernel's putting share at world 4,
# main (e2b57f9: 4/8) against t5 (FC_EP_TAKE_EIGHTHS_WIDE 5 on top of
# ep.cu), three rounds, the order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
cp .carry/var/job.sh $OUT/
run() { local b=$1; echo "== w4 round $i $b" >> $OUT/ep.log; timeout 100 .carry/var/bench-$b --backend cuda --world 4 --ep --graph --iters 20 --warmup 5 --tokens 2048,4096 >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 2) o="t5 main";; *) o="main t5";; esac
  for b in $o; do run $b; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
