// The hand-off's copies (handoff.cu, and moe_route's signalling variant in select.cu): up to
// kMaxCopies device <-> page-locked host copies of whole 32-bit words, done by one block.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cuda/atomic>
#include <string>

#include "berth/core/error.h"
#include "berth/gpu_kernels/kernels.h"

namespace berth::gpu {

constexpr int kMaxCopies = 4;

struct Copies {
  HostCopy c[kMaxCopies];
  int n;
};

// Copies in 16-byte words where every pointer and size allows, else in 4-byte words, by the
// threads of one block.
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

// The block's first thread spins until *flag >= value (a host thread's release store, acquired
// at system scope), then the block meets at a barrier. Every thread of the block must call it;
// data the host wrote before the flag is then read with ld.cv (never from a stale line).
__device__ __forceinline__ void wait_host_flag(const uint32_t* flag, uint32_t value) {
  if (threadIdx.x == 0) {
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system> f(*const_cast<uint32_t*>(flag));
    while (f.load(cuda::memory_order_acquire) < value) {
    }
  }
  __syncthreads();
}

// The block copies `cp` (device -> host), fences at system scope, meets at a barrier, and its
// first thread releases `value` to *flag (system scope): a host thread that acquires the flag
// sees the data. Every thread of the block must call it.
__device__ __forceinline__ void copy_out_and_signal(const Copies& cp, uint32_t* flag,
                                                    uint32_t value) {
  for (int j = 0; j < cp.n; ++j) copy_words(cp.c[j], false);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0)
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(*flag).store(value,
                                                                       cuda::memory_order_release);
}

// `copies` checked and packed for a kernel argument; `fn` names the caller in errors
// (Error(invalid_argument): more than kMaxCopies, or a size that is not whole words).
inline Copies pack_copies(const HostCopy* c, int n, const char* fn) {
  if (n < 0 || n > kMaxCopies)
    throw Error(ErrorCategory::invalid_argument, std::string(fn) + ": " + std::to_string(n) +
                                                     " copies (at most " +
                                                     std::to_string(kMaxCopies) + ")");
  Copies cp{};
  for (int i = 0; i < n; ++i) {
    if (c[i].bytes % 4 != 0)
      throw Error(ErrorCategory::invalid_argument, std::string(fn) + ": a copy of " +
                                                       std::to_string(c[i].bytes) +
                                                       " bytes is not whole 32-bit words");
    cp.c[i] = c[i];
  }
  cp.n = n;
  return cp;
}

}  // namespace berth::gpu
