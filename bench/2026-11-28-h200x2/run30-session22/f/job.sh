#!/usr/bin/env bash
# Session 22, call f (2x H200): the dispatch's metadata, dispatch alone
# (FC_DISPATCH_ONLY=1, diag2.patch; no output check): base (main's kernels)
# / nometa / nosc (no fp8 scales loaded or stored) / noidw (no ids, weights
# or index stored) / recA (the metadata as one 384-byte record, a/rec.patch's
# layout) / rot (a row's pieces rotated by row / (warps / pieces), so that a
# warp's units take every piece, the metadata's last piece included, in
# turn). Two rounds, rotated. Then the pair (checked), base / rot, two rounds.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
cp .carry/var/job.sh .carry/var/diag2.patch $OUT/
run() { local b=$1; shift; echo "== round $i $b" >> $OUT/ep.log; timeout 120 .carry/var/bench-$b --backend cuda --world 2 --ep --graph --iters 20 --warmup 5 "$@" >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2; do
  case $i in 2) o="rot recA noidw nosc nometa base";; *) o="base nometa nosc noidw recA rot";; esac
  for b in $o; do FC_DISPATCH_ONLY=1 run $b --tokens 128,1024,4096; done
done
for i in p1 p2; do
  case $i in p2) o="rot base";; *) o="base rot";; esac
  for b in $o; do run $b --tokens 128,512,1024,4096; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
