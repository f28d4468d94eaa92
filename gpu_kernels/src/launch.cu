// The PDL switch of launch.cuh.
#include <strings.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <utility>

#include "berth/gpu_kernels/kernels.h"
#include "launch.cuh"

namespace berth::gpu {
namespace {

// -1: not read yet; 0 off; 1 on.
std::atomic<int>& pdl_setting() {
  static std::atomic<int> v{-1};
  return v;
}

// Compute capability major of each device, read once (0: not read yet).
int device_major(int dev) {
  static std::atomic<int> major[64] = {};
  if (dev < 0 || dev >= 64) return 0;
  int m = major[dev].load(std::memory_order_relaxed);
  if (m == 0) {
    if (cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) m = -1;
    major[dev].store(m, std::memory_order_relaxed);
  }
  return m;
}

__global__ void probe_kernel() {}

}  // namespace

bool device_code_at_least(int major) {
  static std::atomic<int> state[64][16] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (major < 0 || major >= 16) return false;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  int st = state[dev][major].load(std::memory_order_relaxed);
  if (st == 0) {
    cudaFuncAttributes fa{};
    // ptxVersion is the virtual architecture the code was compiled for (__CUDA_ARCH__);
    // binaryVersion that of the code the driver loaded, which a PTX JIT sets to the device's.
    const bool ok = device_major(dev) >= major &&
                    cudaFuncGetAttributes(&fa, probe_kernel) == cudaSuccess &&
                    fa.ptxVersion >= 10 * major && fa.binaryVersion >= 10 * major;
    st = ok ? 1 : 2;
    state[dev][major].store(st, std::memory_order_relaxed);
  }
  return st == 1;
}

bool cluster_kernels_available() { return device_code_at_least(9); }

bool mma_kernels_available() { return device_code_at_least(8); }

void allow_dynamic_smem(const void* kernel, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> raised;  // (kernel, device) -> bytes
  int dev = 0;
  BERTH_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  size_t& have = raised[{kernel, dev}];
  if (have >= bytes) return;
  BERTH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  have = bytes;
}

namespace {

// Whether the variable `name` is set to one of `words` (case-insensitive).
bool env_is_one_of(const char* name, std::initializer_list<const char*> words) {
  const char* e = std::getenv(name);
  if (e)
    for (const char* w : words)
      if (strcasecmp(e, w) == 0) return true;
  return false;
}

}  // namespace

bool env_says_off(const char* name) { return env_is_one_of(name, {"0", "false", "off", "no"}); }

bool env_says_on(const char* name) { return env_is_one_of(name, {"1", "true", "on", "yes"}); }

void set_pdl(bool on) { pdl_setting().store(on ? 1 : 0); }

bool pdl_enabled() {
  int v = pdl_setting().load(std::memory_order_relaxed);
  if (v < 0) {
    v = env_says_off("BERTH_PDL") ? 0 : 1;
    int expected = -1;
    if (!pdl_setting().compare_exchange_strong(expected, v)) v = expected;
  }
  return v == 1;
}

bool pdl_active() {
  if (!pdl_enabled()) return false;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  return device_major(dev) >= 9;
}

}  // namespace berth::gpu
