#!/usr/bin/env bash
# Session 15 device job a: the row count carried in block 0's dispatch flag word (cnt), plus relaxed polls and one fence (relaxed), plus naps in the combine's polls (nap), beside the session-14 head (base); EP conformance at world 2 on cnt; the cold-start child under gdb.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
date +%s > $OUT/t0
timeout 200 .carry/bin/ep_cuda --include-ignored --test-threads=1 --skip ep_world_8 --skip ep_world_3 --skip ep_world_4 > $OUT/ep_cuda.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda.log; grep "^test \|result" $OUT/ep_cuda.log
date +%s >> $OUT/t0
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { # name, binary
  local n=$1 b=$2; shift 2
  timeout 100 .carry/bin/$b $A > $OUT/$n.log 2>&1; echo "rc=$?" >> $OUT/$n.log; echo "== $n $(date +%s)"; grep -v autotune $OUT/$n.log | grep -v "^#" | grep " 1 \| 128 \|4096\|rc="
}
for i in 1 2; do
  run base$i bench-base; run cnt$i ferrocomm-bench; run relaxed$i bench-relaxed; run nap$i bench-nap
done
if command -v gdb >/dev/null; then
  g=/tmp/ferrocomm-cold-gdb; rm -rf $g && mkdir -p $g && chmod 700 $g
  FERROCOMM_TEST_CHILD=child_cold_start FERROCOMM_CACHE_DIR=$g timeout 90 gdb -batch -ex run -ex "thread apply all bt 12" --args .carry/bin/conformance_cuda child_cold_start --exact --include-ignored --nocapture --test-threads=1 > $OUT/coldstart_gdb.log 2>&1
  echo "gdb rc=$?"; grep -n "SIGSEGV\|signal\|exited" $OUT/coldstart_gdb.log | head
else
  echo "no gdb"
fi
