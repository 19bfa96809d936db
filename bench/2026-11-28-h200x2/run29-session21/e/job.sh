#!/usr/bin/env bash
# Session 21, call e (4x H200): fin.patch (the combine's puts round the
# sources, rows past the fewest count tested; 2/8 putting at world 4, 3/8 in
# the take kernel). ep_cuda-fin at worlds 2-4; the EP bench at world 4 and 3,
# head (942acc8) / fin / t4 (fin, FC_EP_TAKE_EIGHTHS_WIDE 4) / drot
# (drot.patch: fin, the dispatch's destinations from the next rank, its own
# last).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
cp .carry/var/job-e.sh .carry/var/fin.patch .carry/var/drot.patch $OUT/
timeout 200 .carry/var/ep_cuda-fin --include-ignored --test-threads=1 --skip ep_world_8 > $OUT/ep_cuda-fin.log 2>&1; echo "ep_cuda-fin rc=$?" > $OUT/summary.txt
run() { local w=$1 b=$2; shift 2; echo "== w$w round $i $b" >> $OUT/ep.log; timeout 120 .carry/var/bench-$b --backend cuda --world $w --ep --graph --iters 20 --warmup 5 "$@" >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2; do
  case $i in 1) o="head fin t4 drot";; 2) o="drot t4 fin head";; esac
  for b in $o; do run 4 $b --tokens 128,512,1024,2048,4096; done
done
i=1; for b in head fin drot; do run 3 $b --experts 192 --tokens 1024,4096; done
cat $OUT/summary.txt; grep "test result\|FAIL" $OUT/ep_cuda-fin.log
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
