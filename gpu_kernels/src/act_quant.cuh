// 8-bit activation blocks of the decode GEMV (matmul.cu's quantize_act, and the attention decode
// kernel, which leaves them beside its f32 output for the output projection).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace berth::gpu {

// One warp quantizes one group of 32 activations; lane holds value v (lane i: element i). Writes
// q[lane] = round(v / d) clamped to [-127, 127], d = max |v| / 127, and *meta = (d, d * the sum
// of the quants of lanes 0-15, d * that of lanes 16-31, d * the sum of all 32): the weight offsets'
// terms (per half for the 32-element GEMV, per group for the K-quant one). Every lane of the warp
// must call it.
__device__ __forceinline__ void quantize_group(float v, int lane, int8_t* q, float4* meta) {
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = amax / 127.0f;
  int qi = d > 0.0f ? __float2int_rn(v / d) : 0;
  qi = max(-127, min(127, qi));
  q[lane] = static_cast<int8_t>(qi);
  int s = qi;
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const int s1 = __shfl_sync(0xffffffffu, s, 16);
  if (lane == 0)
    *meta = make_float4(d, d * static_cast<float>(s), d * static_cast<float>(s1),
                        d * static_cast<float>(s + s1));
}

}  // namespace berth::gpu
