#!/usr/bin/env bash
# Session 22, call g (2x H200): the fp8 dispatch's metadata, loads against
# stores, dispatch alone (FC_DISPATCH_ONLY=1, diag3.patch; no output check):
# base / nometa / constmeta (the metadata stored from constants, no loads) /
# loadonly (the metadata loaded and consumed, not stored) / pre1 (a warp
# loads its next unit's metadata while it stores this one). Two rounds,
# rotated. Then the pair (checked), base / pre1, two rounds.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
cp .carry/var/job.sh .carry/var/diag3.patch $OUT/
run() { local b=$1; shift; echo "== round $i $b" >> $OUT/ep.log; timeout 120 .carry/var/bench-$b --backend cuda --world 2 --ep --graph --iters 20 --warmup 5 "$@" >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2; do
  case $i in 2) o="pre1 loadonly constmeta nometa base";; *) o="base nometa constmeta loadonly pre1";; esac
  for b in $o; do FC_DISPATCH_ONLY=1 run $b --tokens 128,1024,4096; done
done
for i in p1 p2; do
  case $i in p2) o="pre1 base";; *) o="base pre1";; esac
  for b in $o; do run $b --tokens 128,512,1024,4096; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
