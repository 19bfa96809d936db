// ferrocomm device API for ROCm: the HIP prelude, then the device API body
// shared with CUDA, unchanged (see README.md in this directory and
// docs/device-api.md).
//
// At run time ferrocomm prepends the same text (prelude.hip.h + "\n" +
// kernels-cuda/device_api.cuh) to a user's kernel source; this file only
// serves standalone compiles, e.g. of the example all-gather:
//
//   clang++-19 -x hip --cuda-device-only --no-gpu-bundle-output -nogpuinc -nogpulib \
//       --offload-arch=gfx942 -O3 -std=c++17 -ffp-contract=off \
//       -DFC_MAX_BLOCK_THREADS=512 -include kernels-hip/device_api.hip \
//       -c kernels-cuda/examples/user_allgather.cu -o user_allgather-gfx942.hsaco
//
// The prelude defines FC_PRELUDE_INCLUDED, so the body's own
// `#include "prelude.cuh"` (for standalone CUDA compiles) is skipped.

#include "prelude.hip.h"
#include "../kernels-cuda/device_api.cuh"
