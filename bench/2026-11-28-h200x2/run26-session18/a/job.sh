#!/usr/bin/env bash
# Session 18 device job a: the dispatch's code size and first loads, beside the head (e7ac9ef, hd).
# sm: the dispatch's slow-path copies out of line and its rank loop not unrolled (sm.patch);
# pre: sm + each warp's first row piece loaded while the layout runs (pre.patch);
# lay: pre + a branchless expert-to-rank test (lay.patch). EP conformance at world 2 on lay;
# then dispatch + combine, four binaries, three rounds, order rotated each round.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
timeout 200 .carry/var/ep_cuda-lay --include-ignored --test-threads=1 --skip ep_world_8 --skip ep_world_3 --skip ep_world_4 > $OUT/ep_cuda_lay.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda_lay.log; grep "^test \|result" $OUT/ep_cuda_lay.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { local b=$1; echo "== round $i $b" >> $OUT/full.log; timeout 100 .carry/var/$b $A >> $OUT/full.log 2>&1; echo "rc=$?" >> $OUT/full.log; }
i=1; for b in bench-hd bench-sm bench-pre bench-lay; do run $b; done
i=2; for b in bench-lay bench-pre bench-sm bench-hd; do run $b; done
i=3; for b in bench-pre bench-hd bench-lay bench-sm; do run $b; done
grep "==\| 128 \| 4096 \|rc=" $OUT/full.log | grep -v "rc=0"
