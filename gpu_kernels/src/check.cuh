// Error checks shared by the kernel files: a failed CUDA call or launch becomes
// berth::Error(internal) naming the call (or kernel) and cudaGetErrorString.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "berth/core/error.h"

namespace berth::gpu {

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* what) {
  throw Error(ErrorCategory::internal, std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}

/// Checks the result of a CUDA runtime call.
#define BERTH_CUDA_CHECK(call)                                              \
  do {                                                                      \
    cudaError_t berth_e_ = (call);                                          \
    if (berth_e_ != cudaSuccess) ::berth::gpu::throw_cuda(berth_e_, #call); \
  } while (0)

/// Checks that the kernel just launched was accepted (bad configuration, no device).
#define BERTH_LAUNCH_CHECK(kernel_name)                                           \
  do {                                                                            \
    cudaError_t berth_e_ = cudaGetLastError();                                    \
    if (berth_e_ != cudaSuccess) ::berth::gpu::throw_cuda(berth_e_, kernel_name); \
  } while (0)

}  // namespace berth::gpu
