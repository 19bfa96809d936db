#!/usr/bin/env bash
# Session 22, call b (4x H200): main (e2e13c1, .carry/bin from
# PACK_PYTHON=0 bash ci/pack-gpu.sh): ci/gpu-cuda.sh's heap step at 4 GPUs
# (EP conformance at worlds 2-4 with the take kernel's 5/8 share at every
# world, windows, heap and EP memcheck, heapbench). Then the EP bench:
# world 2, main / np (np.patch, diagnostic: the take kernel's polls look at
# a lane's last pending pack alone first), three rounds; world 3 (192
# experts), main (5/8 putting in the take kernel) / t4 / t6, two rounds.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi -L > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
cp .carry/var/job.sh .carry/var/np.patch $OUT/
STEP_TIMEOUT=150 OUT= bash ci/gpu-cuda.sh .carry/bin heap > $OUT/heap-steps.log 2>&1; echo "rc=$?" >> $OUT/heap-steps.log
tar czf $OUT/heap-logs.tgz gpu-logs 2>/dev/null; rm -rf gpu-logs
export FERROCOMM_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
run() { local w=$1 b=$2 exe=.carry/bin/ferrocomm-bench; shift 2; [ $b != main ] && exe=.carry/var/bench-$b; echo "== w$w round $i $b" >> $OUT/ep.log; timeout 120 $exe --backend cuda --world $w --ep --graph --iters 20 --warmup 5 "$@" >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2 3; do
  case $i in 2) o="np main";; *) o="main np";; esac
  for b in $o; do run 2 $b --tokens 2048,4096; done
done
for i in 1 2; do
  case $i in 2) o="t6 t4 main";; *) o="main t4 t6";; esac
  for b in $o; do run 3 $b --experts 192 --tokens 2048,4096; done
done
grep "rc=\|NOT RUN" $OUT/heap-steps.log | tail -14
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
