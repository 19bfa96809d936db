#!/usr/bin/env bash
# Session 21, call b (4x H200): the one-kernel combine's puts interleaved
# over sources (rot.patch). ep_cuda-rot at worlds 2-4; then the EP bench at
# world 4 (tokens 128..4096), world 3 (192 experts) and world 2, head
# (942acc8) / rot / rotA (rot with FC_EP_PUT_EIGHTHS_WIDE 2 and
# FC_EP_TAKE_EIGHTHS_WIDE 3), the order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
cp .carry/var/job-b.sh .carry/var/rot.patch $OUT/
timeout 200 .carry/var/ep_cuda-rot --include-ignored --test-threads=1 --skip ep_world_8 > $OUT/ep_cuda-rot.log 2>&1; echo "ep_cuda-rot rc=$?" > $OUT/summary.txt
run() { local w=$1 b=$2; shift 2; echo "== w$w round $i $b" >> $OUT/ep.log; timeout 120 .carry/var/bench-$b --backend cuda --world $w --ep --graph --iters 20 --warmup 5 "$@" >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 1) o="head rot rotA";; 2) o="rot rotA head";; 3) o="rotA head rot";; esac
  for b in $o; do run 4 $b --tokens 128,512,1024,2048,4096; done
done
for i in 1 2; do
  case $i in 1) o="head rot rotA";; 2) o="rotA rot head";; esac
  for b in $o; do run 3 $b --experts 192 --tokens 128,1024,4096; done
done
for i in 1; do for b in head rot; do run 2 $b --tokens 128,4096; done; done
cat $OUT/summary.txt; grep "test result\|FAIL" $OUT/ep_cuda-rot.log
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
