// Hand-off kernels of a hybrid step (flags in pinned host memory, see runtime/hybrid.h): the
// copies of a CPU segment's inputs to the host and its ready flag in one launch, and the wait
// for its done flag with the copies of its outputs back in another. They replace two to four
// copy-engine nodes and two stream memory operations per segment in a decode graph.
//
// Memory order: copy_out's threads store the data, fence at system scope, meet at a barrier,
// and one thread then releases the flag (system scope), so a host thread that acquires the flag
// sees the data. wait_in's first thread acquires the flag at system scope, the block meets at a
// barrier, and the data is read with ld.cv (never from a cache line fetched before the flag).
#include <cuda_runtime.h>

#include <cstdint>
#include <cuda/atomic>
#include <string>

#include "berth/gpu_kernels/kernels.h"
#include "check.cuh"
#include "handoff.cuh"
#include "launch.cuh"

namespace berth::gpu {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    copy_out_kernel(Copies cp, uint32_t* flag, uint32_t value) {
  pdl_enter();
  copy_out_and_signal(cp, flag, value);
}

__global__ void __launch_bounds__(kThreads)
    wait_in_kernel(const uint32_t* flag, uint32_t value, Copies cp) {
  pdl_enter();
  wait_host_flag(flag, value);
  for (int j = 0; j < cp.n; ++j) copy_words(cp.c[j], true);
}

}  // namespace

void copy_out_signal(const HostCopy* copies, int n, uint32_t* flag, uint32_t value,
                     cudaStream_t stream) {
  launch("copy_out_kernel", copy_out_kernel, 1, kThreads, 0, stream,
         pack_copies(copies, n, "gpu::copy_out_signal"), flag, value);
}

void wait_copy_in(const uint32_t* flag, uint32_t value, const HostCopy* copies, int n,
                  cudaStream_t stream) {
  launch("wait_in_kernel", wait_in_kernel, 1, kThreads, 0, stream, flag, value,
         pack_copies(copies, n, "gpu::wait_copy_in"));
}

}  // namespace berth::gpu
