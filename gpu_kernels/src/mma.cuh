// Warp-level tensor-core building blocks (compute capability >= 8.0; PTX ISA: ldmatrix,
// mma.sync m16n8k16, cp.async), shared by the attention and grouped-GEMM kernels. Callers check
// mma_kernels_available() (launch.cuh) before launching a kernel that uses them; compiled for an
// older architecture they are empty.
//
// Fragment layout of mma.m16n8k16 (f16 A row-major 16x16, B "col" 16x8, f32 C 16x8), lane =
// 4 * g + t: A regs {(g, 2t..2t+1), (g + 8, 2t..), (g, 8 + 2t..), (g + 8, 8 + 2t..)}; B regs
// {(k 2t..2t+1, n g), (k 8 + 2t.., n g)}; C {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}.
// ldmatrix.x4 loads four 8x8 f16 matrices whose row addresses come from lanes 0-7, 8-15, 16-23,
// 24-31; a lane receives row g, columns 2t..2t+1 of each (.trans: column g, rows 2t..2t+1).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace berth::gpu {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// ldmatrix.x4 (kTrans: .trans) from shared address a.
template <bool kTrans = false>
__device__ __forceinline__ void ldsm_x4(uint32_t a, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
#endif
}
// c += a b, m16n8k16, f16 x f16 -> f32 (PTX ISA, "Matrix Fragments for mma.m16n8k16").
__device__ __forceinline__ void mma_f16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// c += a b, m16n8k32, s8 x s8 -> s32 (PTX ISA, "Matrix Fragments for mma.m16n8k32"): A regs
// {(g, 4t..4t+3), (g + 8, 4t..), (g, 16 + 4t..), (g + 8, 16 + 4t..)}, B regs {(k 4t..4t+3, n g),
// (k 16 + 4t.., n g)}, C as m16n8k16's. The byte layout matches the f16 fragments' halves, so
// ldmatrix of int8 rows (16 bytes per 8x8 b16 matrix row) yields them.
__device__ __forceinline__ void mma_s8_k32(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// c += a b, m16n8k16, s8 x s8 -> s32: A regs {(g, 4t..4t+3), (g + 8, 4t..)}, B reg
// (k 4t..4t+3, n g).
__device__ __forceinline__ void mma_s8_k16(int* c, uint32_t a0, uint32_t a1, uint32_t b0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
#endif
}
// 16 bytes global -> shared, asynchronously; zeros when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}
__device__ __forceinline__ uint32_t pack_half2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  uint32_t w;
  memcpy(&w, &h, 4);
  return w;
}

}  // namespace berth::gpu
