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

namespace berth::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxCopies = 4;

struct Copies {
  HostCopy c[kMaxCopies];
  int n;
};

// Copies in 16-byte words where every pointer and size allows, else in 4-byte words.
__device__ __forceinline__ void copy_words(const HostCopy& c, bool volatile_src) {
  const bool wide =
      ((reinterpret_cast<uintptr_t>(c.dst) | reinterpret_cast<uintptr_t>(c.src) | c.bytes) & 15) ==
      0;
  if (wide) {
    auto* d = static_cast<uint4*>(c.dst);
    const auto* s = static_cast<const uint4*>(c.src);
    for (size_t i = threadIdx.x; i < c.bytes / 16; i += blockDim.x)
      d[i] = volatile_src ? __ldcv(s + i) : s[i];
  } else {
    auto* d = static_cast<uint32_t*>(c.dst);
    const auto* s = static_cast<const uint32_t*>(c.src);
    for (size_t i = threadIdx.x; i < c.bytes / 4; i += blockDim.x)
      d[i] = volatile_src ? __ldcv(reinterpret_cast<const unsigned int*>(s + i)) : s[i];
  }
}

__global__ void __launch_bounds__(kThreads)
    copy_out_kernel(Copies cp, uint32_t* flag, uint32_t value) {
  for (int j = 0; j < cp.n; ++j) copy_words(cp.c[j], false);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0)
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(*flag).store(value,
                                                                       cuda::memory_order_release);
}

__global__ void __launch_bounds__(kThreads)
    wait_in_kernel(const uint32_t* flag, uint32_t value, Copies cp) {
  if (threadIdx.x == 0) {
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system> f(*const_cast<uint32_t*>(flag));
    while (f.load(cuda::memory_order_acquire) < value) {
    }
  }
  __syncthreads();
  for (int j = 0; j < cp.n; ++j) copy_words(cp.c[j], true);
}

void bad_arg(const std::string& what) { throw Error(ErrorCategory::invalid_argument, what); }

Copies pack(const HostCopy* c, int n, const char* fn) {
  if (n < 0 || n > kMaxCopies)
    bad_arg(std::string(fn) + ": " + std::to_string(n) + " copies (at most " +
            std::to_string(kMaxCopies) + ")");
  Copies cp{};
  for (int i = 0; i < n; ++i) {
    if (c[i].bytes % 4 != 0)
      bad_arg(std::string(fn) + ": a copy of " + std::to_string(c[i].bytes) +
              " bytes is not whole 32-bit words");
    cp.c[i] = c[i];
  }
  cp.n = n;
  return cp;
}

}  // namespace

void copy_out_signal(const HostCopy* copies, int n, uint32_t* flag, uint32_t value,
                     cudaStream_t stream) {
  copy_out_kernel<<<1, kThreads, 0, stream>>>(pack(copies, n, "gpu::copy_out_signal"), flag, value);
  BERTH_LAUNCH_CHECK("copy_out_kernel");
}

void wait_copy_in(const uint32_t* flag, uint32_t value, const HostCopy* copies, int n,
                  cudaStream_t stream) {
  wait_in_kernel<<<1, kThreads, 0, stream>>>(flag, value, pack(copies, n, "gpu::wait_copy_in"));
  BERTH_LAUNCH_CHECK("wait_in_kernel");
}

}  // namespace berth::gpu
