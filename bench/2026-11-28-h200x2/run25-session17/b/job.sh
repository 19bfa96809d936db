#!/usr/bin/env bash
# Session 17, call b (a: the hook armed after each library load, still crashed): the cold-start child's segfault at exit, old (a3816bd)
# against new (the exit hook armed after every library load), then the
# device and process tests on the new binaries.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1 FERROCOMM_WORKER_EXE=$PWD/.carry/bin/ferrocomm-worker
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
mkdir -p $OUT/ab
nvidia-smi -L > $OUT/ab/gpus.txt
for i in 1 2 3 4; do
  for v in old new; do
    b=.carry/bin/conformance_cuda; [ $v = old ] && b=.carry/old/conformance_cuda
    timeout 120 $b --include-ignored --test-threads=1 --exact cold_start > $OUT/ab/${v}_$i.log 2>&1
    echo "$v run $i rc=$? $(grep -c 'SIGSEGV' $OUT/ab/${v}_$i.log) segv lines" | tee -a $OUT/ab/summary.txt
  done
done
# The warm child alone under cuda-gdb (new binary, with symbols), cache filled by one cold child.
g=/tmp/fc-cold-gdb; rm -rf $g; mkdir -p $g; chmod 700 $g
FERROCOMM_TEST_CHILD=child_cold_start FERROCOMM_CACHE_DIR=$g timeout 60 .carry/conformance_cuda.sym child_cold_start --exact --include-ignored --nocapture --test-threads=1 > $OUT/ab/gdb_fill.log 2>&1
echo "fill rc=$?" >> $OUT/ab/summary.txt
FERROCOMM_TEST_CHILD=child_cold_start FERROCOMM_CACHE_DIR=$g timeout 120 cuda-gdb -batch -ex run -ex "info threads" -ex "thread apply all bt 20" --args .carry/conformance_cuda.sym child_cold_start --exact --include-ignored --nocapture --test-threads=1 > $OUT/ab/gdb_warm.log 2>&1
echo "gdb rc=$?" >> $OUT/ab/summary.txt
tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $OUT/ab/*.log
