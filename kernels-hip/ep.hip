// ferrocomm EP dispatch/combine kernels for ROCm: the HIP prelude, then the
// body shared with CUDA, unchanged (see README.md in this directory).
//
// At run time ferrocomm compiles the same text (src/ep/mod.rs, EP_MODULE:
// prelude.hip.h + kernels-cuda/device_api.cuh + kernels-cuda/lamport.cuh +
// kernels-cuda/ep.cu);
// this file only serves standalone compiles:
//
//   clang++-19 -x hip --cuda-device-only --no-gpu-bundle-output -nogpuinc -nogpulib \
//       --offload-arch=gfx942 -O3 -std=c++17 -ffp-contract=off \
//       -DFC_MAX_BLOCK_THREADS=512 -c kernels-hip/ep.hip -o ep-gfx942.hsaco
//
// ep.cu includes device_api.cuh and lamport.cuh (from kernels-cuda/) behind
// their include guards; the prelude defines FC_PRELUDE_INCLUDED, so the CUDA prelude is skipped.

#include "prelude.hip.h"
#include "../kernels-cuda/ep.cu"
