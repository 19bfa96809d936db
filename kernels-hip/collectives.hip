// ferrocomm collective kernels for ROCm: the HIP prelude, then the algorithm
// body shared with CUDA, unchanged (see README.md in this directory).
//
// The module hipRTC compiles at run time is the same text, assembled in
// src/algo/kernels.rs (ModuleSource::hip = prelude.hip.h + kernels-cuda/lamport.cuh + kernels-cuda/common.cuh +
// kernels-cuda/collectives.cu); this file only serves standalone compiles:
//
//   clang++-19 -x hip --cuda-device-only --no-gpu-bundle-output -nogpuinc -nogpulib \
//       --offload-arch=gfx942 -O3 -std=c++17 -ffp-contract=off \
//       -DFC_MAX_BLOCK_THREADS=512 -c kernels-hip/collectives.hip -o collectives-gfx942.hsaco
//
// The prelude defines FC_PRELUDE_INCLUDED, so the body's own
// `#include "prelude.cuh"` (for standalone CUDA compiles) is skipped.

#include "prelude.hip.h"
#include "../kernels-cuda/collectives.cu"
