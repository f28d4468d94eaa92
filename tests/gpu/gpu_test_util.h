// Helpers of the GPU kernel tests (test_gpu_ops.cpp, test_gpu_batch.cpp, test_gpu_gdn.cpp): the
// device check, CUDA error checks, a device array freed on scope exit, NMSE and bit equality of
// host results.
#pragma once

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "core/kernel_harness.h"

namespace berth::gpu_test {

inline bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

inline void ck(cudaError_t e, const char* what) {
  REQUIRE_MESSAGE(e == cudaSuccess, what << ": " << cudaGetErrorString(e));
}

/// A device array of `n` T (at least one allocated), freed on scope exit. up() waits for the
/// device before copying (no kernel still reads the old contents), down() waits for it before
/// reading, poison() sets every byte to 0xff (NaN floats, -1 ints) synchronously, so work on any
/// stream sees it.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    ck(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(1, n) * sizeof(T)), "cudaMalloc");
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { up(h); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void up(const std::vector<T>& h) {
    REQUIRE(h.size() <= n);
    ck(cudaDeviceSynchronize(), "sync before upload");
    ck(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> down() const {
    std::vector<T> h(n);
    ck(cudaDeviceSynchronize(), "kernel");
    ck(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return h;
  }
  void poison() {
    ck(cudaMemset(p, 0xff, n * sizeof(T)), "poison");
    ck(cudaDeviceSynchronize(), "poison");
  }
};

inline double nmse(const std::vector<float>& ref, const std::vector<float>& got) {
  REQUIRE(ref.size() == got.size());
  return test::nmse(ref.data(), got.data(), ref.size());
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace berth::gpu_test

#define REQUIRE_DEVICE()                          \
  REQUIRE_MESSAGE(berth::gpu_test::have_device(), \
                  "no CUDA device: test_gpu must run on a machine with a GPU")
