#!/usr/bin/env bash
# Session 22, call e (2x H200): where the dispatch's time goes, dispatch
# alone (FC_DISPATCH_ONLY=1, diag.patch: dispatches replayed back to back,
# beside NCCL's first all_to_all_v alone; no output check). base (main's
# kernels) / nometa (no metadata loads or stores) / nolocal (no rows to its
# own rank) / noremote (no rows to the peer) / skel (none of the three:
# layout, piece loads, flags). Two rounds, rotated; then base's pair.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FERROCOMM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
cp .carry/var/job.sh .carry/var/diag.patch $OUT/
run() { local b=$1; shift; echo "== round $i $b" >> $OUT/ep.log; timeout 120 .carry/var/bench-$b --backend cuda --world 2 --ep --graph --iters 20 --warmup 5 "$@" >> $OUT/ep.log 2>&1; echo "rc=$?" >> $OUT/ep.log; }
for i in 1 2; do
  case $i in 2) o="skel noremote nolocal nometa base";; *) o="base nometa nolocal noremote skel";; esac
  for b in $o; do FC_DISPATCH_ONLY=1 run $b --tokens 128,1024,4096; done
done
i=pair; run base --tokens 128,4096
grep "==\|graph\|rc=" $OUT/ep.log | grep -v "rc=0"
