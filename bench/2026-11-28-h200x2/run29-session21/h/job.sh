#!/usr/bin/env bash
# Session 21, call h (4x H200): the dispatch's destination order. main
# (536a0e2: from the next rank round, its own last) / own0 (own0.patch: its
# own first, then the next rank round). EP bench at worlds 2 and 4, three
# rounds, the order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
cp .carry/var/job.sh .carry/var/own0.patch $OUT/
run() { local w=$1 b=$2; shift 2; echo "== w$w round $i $b" >> $OUT/ep.log; timeout 100 .carry/var/bench-$b --backend cuda --world $w --ep --graph --iters 20 --warmup 5 "$@" >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 2) o="own0 main";; *) o="main own0";; esac
  for b in $o; do run 2 $b --tokens 128,512,2048,4096; done
  for b in $o; do run 4 $b --tokens 128,512,4096; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
