// Hopper's warpgroup tensor-core instructions (PTX ISA, "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate Instructions": wgmma.mma_async, its fences and shared memory matrix
// descriptors). They exist only in sm_90a code: a .cu file whose kernels use them is also
// compiled for sm_90a (gpu_kernels/CMakeLists.txt) and asks at run time, through
// sm90a_code_loaded<Tag>(), whether that is the code the driver loaded for the current device.
//
// Layout used here: both operands K-major without swizzle. A core matrix is 8 rows of 16 bytes
// (8 halves), 128 contiguous bytes; the descriptor's leading byte offset is the distance between
// core matrices adjacent along K, its stride byte offset the distance between core matrices
// adjacent along M (or N). The f32 accumulator of m64nNk16 gives warp w of the warpgroup rows
// 16w..16w+15, laid out per 8 columns j as mma.sync m16n8k16's C (d[4j..4j+3]); an A fragment in
// registers is laid out as mma.sync m16n8k16's A for the warp's 16 rows.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "check.cuh"

namespace berth::gpu {

// Writes 1 when compiled into sm_90a code, else 0. One instance per .cu file (Tag): each file's
// code is loaded on its own.
template <int Tag>
__global__ void sm90a_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

// Whether the code the driver loaded for the current device (of the .cu file that instantiates
// Tag) is sm_90a code. Asked once per device by a one-thread kernel and a synchronous copy:
// never call it while a stream captures.
template <int Tag>
bool sm90a_code_loaded() {
  static std::atomic<int> state[64] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  int st = state[dev].load(std::memory_order_relaxed);
  if (st == 0) {
    int* p = nullptr;
    int v = 0;
    BERTH_CUDA_CHECK(cudaMalloc(&p, sizeof(int)));
    sm90a_probe_kernel<Tag><<<1, 1>>>(p);
    const cudaError_t err = cudaMemcpy(&v, p, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(p);
    BERTH_CUDA_CHECK(err);
    st = v == 1 ? 1 : 2;
    state[dev].store(st, std::memory_order_relaxed);
  }
  return st == 1;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared memory matrix descriptor: start address, leading and stride byte offsets, no swizzle.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}
// d (64 x 64, f32) += A B^T, both from shared memory (K-major f16).
__device__ __forceinline__ void wg_ss_m64n64k16(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1));
}
// d (64 x 64, f32) += A B^T, A (this warp's 16 x 16 f16 slice) from registers, B from shared
// memory (K-major f16).
__device__ __forceinline__ void wg_rs_m64n64k16(float* d, const uint32_t* a, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, "
      "p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// Keeps the compiler from touching n accumulators while a wgmma may still write them.
template <int N>
__device__ __forceinline__ void wg_pin(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Orders this thread's earlier shared memory writes (st.shared, cp.async) before later reads by
// the async proxy (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#endif

}  // namespace berth::gpu
