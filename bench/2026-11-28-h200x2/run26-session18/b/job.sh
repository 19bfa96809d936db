#!/usr/bin/env bash
# Session 18 device job b: beside the head (e7ac9ef, hd): sm (as in a); sml: sm + the branchless
# expert-to-rank test (sml.patch); msk: sml + the layout's masks with no branch per token or id
# (msk.patch); cal: msk + the one-kernel combine's aligned body compiled apart (cal.patch).
# EP conformance at world 2 on cal; then dispatch + combine, five binaries, four rounds, order rotated.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1 FERROCOMM_TEST_FULL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt; cat $OUT/gpus.txt
timeout 200 .carry/var/ep_cuda-cal --include-ignored --test-threads=1 --skip ep_world_8 --skip ep_world_3 --skip ep_world_4 > $OUT/ep_cuda_cal.log 2>&1; echo "rc=$?" >> $OUT/ep_cuda_cal.log; grep "^test \|result" $OUT/ep_cuda_cal.log
A="--backend cuda --world 2 --ep --graph --iters 20 --warmup 5 --tokens 1,8,32,128,512,4096"
run() { local b=$1; echo "== round $i $b" >> $OUT/full.log; timeout 100 .carry/var/$b $A >> $OUT/full.log 2>&1; echo "rc=$?" >> $OUT/full.log; }
i=1; for b in bench-hd bench-sm bench-sml bench-msk bench-cal; do run $b; done
i=2; for b in bench-cal bench-msk bench-sml bench-sm bench-hd; do run $b; done
i=3; for b in bench-sml bench-cal bench-hd bench-msk bench-sm; do run $b; done
i=4; for b in bench-msk bench-hd bench-cal bench-sm bench-sml; do run $b; done
grep "==\| 128 \| 4096 \|rc=" $OUT/full.log | grep -v "rc=0"
