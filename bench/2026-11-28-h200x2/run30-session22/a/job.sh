#!/usr/bin/env bash
# Session 22, call a (2x H200): the dispatch's metadata as one record a row
# (diagnostic, rec.patch). main (e2e13c1) / recA (scales, ids, weights and
# index in one 384-byte record, one 16-byte store a lane) / recB (ids,
# weights and index in one 128-byte record, scales as now). The fp8 check
# reads recv_src_index, which the variants do not write: their fp8 "wrong"
# counts are expected. EP bench at world 2, three rounds, order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
cp .carry/var/job.sh .carry/var/rec.patch $OUT/
run() { local w=$1 b=$2; shift 2; echo "== w$w round $i $b" >> $OUT/ep.log; timeout 120 .carry/var/bench-$b --backend cuda --world $w --ep --graph --iters 20 --warmup 5 "$@" >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 1) o="main recA recB";; 2) o="recA recB main";; 3) o="recB main recA";; esac
  for b in $o; do run 2 $b --tokens 128,512,1024,4096; done
done
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
