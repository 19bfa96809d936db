#!/usr/bin/env bash
# Session 17, call c: the head (2e14df0) on 2x H200: the thread-rank suite
# repeated (ci/gpu-hang-probe.sh, the stall of sessions 6-8), then the
# device, process, cold-start, torchrun and heap/EP steps.
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/ferrocomm-kcache && cp -r .carry/kcache/. /tmp/ferrocomm-kcache/ && chmod -R go-rwx /tmp/ferrocomm-kcache
export FERROCOMM_CACHE_DIR=/tmp/ferrocomm-kcache
nvidia-smi -L > $OUT/gpus.txt
P=/tmp/probe; rm -rf $P; mkdir -p $P
OUT=$P PER_RUN=100 bash ci/gpu-hang-probe.sh .carry/bin 230 > $OUT/probe.txt 2>&1
grep -h "test result" $P/probe_run*.log >> $OUT/probe.txt
tar czf $OUT/probe.tgz -C $P .
STEP_TIMEOUT=200 bash ci/gpu-cuda.sh .carry/bin tests coldstart torchrun heap > $OUT/steps.log 2>&1
