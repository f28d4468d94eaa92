// Device-side decoding of ggml's weight blocks, one 32-element group at a time.
//
// Every supported quantized type is, per group of 32 consecutive elements of a row (32 | the
// block size for all of them), two halves of 16 elements where element i of half h decodes to
//     sc[h] * q_i + m[h],   q_i a small integer in [-128, 127] (one byte each)
// - Q4_0: q = nibble, sc = d, m = -8d          - Q4_1: q = nibble, sc = d, m = m
// - Q5_0: q = 5 bits, sc = d, m = -16d         - Q5_1: q = 5 bits, sc = d, m = m
// - Q8_0: q = int8, sc = d, m = 0
// - Q2_K: q = 2 bits, per 16: sc = d*(s&15), m = -dmin*(s>>4)
// - Q3_K: q = 3 bits unsigned (low | high<<2), per 16: sc = d*(s6-32), m = -4*sc
// - Q4_K/Q5_K: q = 4/5 bits, per 32: sc = d*s6, m = -dmin*m6
// - Q6_K: q = 6 bits unsigned, per 16: sc = d*s8, m = -32*sc
// (layouts: cpu_kernels/include/berth/cpu_kernels/quants_ref.h). The q bytes come packed four
// per 32-bit word in element order, ready for __dp4a against int8 activations; the offset m is
// applied through the sum of the activations of each half.
//
// Exactness: sc * q is exact in f32 (an f16 times at most 14 bits of integers), so sc*q + m
// rounds once, as ggml's reference dequantizers do: group_value gives the reference's values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "berth/core/types.h"

namespace berth::gpu {

struct QGroup {
  uint32_t q[8];  // 32 bytes, element 4w + b in byte b of word w
  float sc0, sc1, m0, m1;
};

__device__ __forceinline__ float f16_at(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(p)));
}
// 32-bit word at a 2-byte aligned address.
__device__ __forceinline__ uint32_t ld32_a2(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
}
__device__ __forceinline__ uint32_t ld32_a4(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
// n words at a 16-byte aligned address (n a multiple of 4).
template <int N>
__device__ __forceinline__ void ld_words_a16(const uint8_t* p, uint32_t* w) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
    w[4 * i] = v.x;
    w[4 * i + 1] = v.y;
    w[4 * i + 2] = v.z;
    w[4 * i + 3] = v.w;
  }
}
// Bit i of the low nibble n moved to bit 0 of byte i.
__device__ __forceinline__ uint32_t spread4(uint32_t n) { return (n * 0x00204081u) & 0x01010101u; }

/// Block size (elements) of a supported type; 1 for float types.
constexpr int block_elems(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0:
      return 32;
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return 256;
    default:
      return 1;
  }
}
constexpr int block_nbytes(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0:
      return 18;
    case GgmlType::Q4_1:
      return 20;
    case GgmlType::Q5_0:
      return 22;
    case GgmlType::Q5_1:
      return 24;
    case GgmlType::Q8_0:
      return 34;
    case GgmlType::Q2_K:
      return 84;
    case GgmlType::Q3_K:
      return 110;
    case GgmlType::Q4_K:
      return 144;
    case GgmlType::Q5_K:
      return 176;
    case GgmlType::Q6_K:
      return 210;
    case GgmlType::F32:
      return 4;
    default:
      return 2;  // F16, BF16
  }
}

// 6-bit scale and min j (0..7) of Q4_K/Q5_K from the 12 packed bytes.
__device__ __forceinline__ void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
// Signed 6-bit scale s (0..15) of Q3_K, minus its bias.
__device__ __forceinline__ int q3k_scale(const uint8_t* sc, int s) {
  const int low4 = s < 8 ? (sc[s] & 0xF) : (sc[s - 8] >> 4);
  const int high2 = (sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
  return (low4 | (high2 << 4)) - 32;
}

/// Group g (elements 32g..32g+31) of the row starting at `row`, for a quantized type T.
template <GgmlType T>
__device__ __forceinline__ QGroup load_group(const uint8_t* row, int g) {
  QGroup r;
  if constexpr (T == GgmlType::Q4_0 || T == GgmlType::Q5_0) {
    const uint8_t* b = row + static_cast<size_t>(g) * block_nbytes(T);
    const float d = f16_at(b);
    const uint8_t* qs = b + (T == GgmlType::Q4_0 ? 2 : 6);
    uint32_t h = 0;
    if constexpr (T == GgmlType::Q5_0) h = ld32_a2(b + 2);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t v = ld32_a2(qs + 4 * w);
      r.q[w] = v & 0x0F0F0F0Fu;
      r.q[w + 4] = (v >> 4) & 0x0F0F0F0Fu;
      if constexpr (T == GgmlType::Q5_0) {
        r.q[w] |= spread4((h >> (4 * w)) & 0xF) << 4;
        r.q[w + 4] |= spread4((h >> (16 + 4 * w)) & 0xF) << 4;
      }
    }
    r.sc0 = r.sc1 = d;
    r.m0 = r.m1 = (T == GgmlType::Q4_0 ? -8.0f : -16.0f) * d;
  } else if constexpr (T == GgmlType::Q4_1 || T == GgmlType::Q5_1) {
    const uint8_t* b = row + static_cast<size_t>(g) * block_nbytes(T);
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint8_t* qs = b + (T == GgmlType::Q4_1 ? 4 : 8);
    uint32_t h = 0;
    if constexpr (T == GgmlType::Q5_1) h = ld32_a4(b + 4);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t v = ld32_a4(qs + 4 * w);
      r.q[w] = v & 0x0F0F0F0Fu;
      r.q[w + 4] = (v >> 4) & 0x0F0F0F0Fu;
      if constexpr (T == GgmlType::Q5_1) {
        r.q[w] |= spread4((h >> (4 * w)) & 0xF) << 4;
        r.q[w + 4] |= spread4((h >> (16 + 4 * w)) & 0xF) << 4;
      }
    }
    r.sc0 = r.sc1 = d;
    r.m0 = r.m1 = m;
  } else if constexpr (T == GgmlType::Q8_0) {
    const uint8_t* b = row + static_cast<size_t>(g) * 34;
    const float d = f16_at(b);
#pragma unroll
    for (int w = 0; w < 8; ++w) r.q[w] = ld32_a2(b + 2 + 4 * w);
    r.sc0 = r.sc1 = d;
    r.m0 = r.m1 = 0.0f;
  } else if constexpr (T == GgmlType::Q2_K) {
    const uint8_t* b = row + static_cast<size_t>(g >> 3) * 84;
    const int j = g & 7, h = j >> 2, k = j & 3;
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
#pragma unroll
    for (int w = 0; w < 8; ++w)
      r.q[w] = (ld32_a4(b + 16 + 32 * h + 4 * w) >> (2 * k)) & 0x03030303u;
    const int s0 = b[2 * j], s1 = b[2 * j + 1];
    r.sc0 = d * static_cast<float>(s0 & 0xF);
    r.sc1 = d * static_cast<float>(s1 & 0xF);
    r.m0 = -dmin * static_cast<float>(s0 >> 4);
    r.m1 = -dmin * static_cast<float>(s1 >> 4);
  } else if constexpr (T == GgmlType::Q3_K) {
    const uint8_t* b = row + static_cast<size_t>(g >> 3) * 110;
    const int j = g & 7, h = j >> 2, k = j & 3;
    const float d = f16_at(b + 108);
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      const uint32_t lo = (ld32_a2(b + 32 + 32 * h + 4 * w) >> (2 * k)) & 0x03030303u;
      const uint32_t hi = (ld32_a2(b + 4 * w) >> (4 * h + k)) & 0x01010101u;
      r.q[w] = lo | (hi << 2);
    }
    r.sc0 = d * static_cast<float>(q3k_scale(b + 96, 2 * j));
    r.sc1 = d * static_cast<float>(q3k_scale(b + 96, 2 * j + 1));
    r.m0 = -4.0f * r.sc0;
    r.m1 = -4.0f * r.sc1;
  } else if constexpr (T == GgmlType::Q4_K || T == GgmlType::Q5_K) {
    constexpr int kBytes = T == GgmlType::Q4_K ? 144 : 176;
    const uint8_t* b = row + static_cast<size_t>(g >> 3) * kBytes;
    const int j = g & 7, c = j >> 1, u = j & 1;
    const float d = f16_at(b), dmin = f16_at(b + 2);
    constexpr int kQs = T == GgmlType::Q4_K ? 16 : 48;
    uint32_t w8[8];
    ld_words_a16<8>(b + kQs + 32 * c, w8);
#pragma unroll
    for (int w = 0; w < 8; ++w) r.q[w] = (w8[w] >> (4 * u)) & 0x0F0F0F0Fu;
    if constexpr (T == GgmlType::Q5_K) {
      ld_words_a16<8>(b + 16, w8);
#pragma unroll
      for (int w = 0; w < 8; ++w) r.q[w] |= ((w8[w] >> j) & 0x01010101u) << 4;
    }
    int sc, mn;
    k_scale_min(b + 4, j, sc, mn);
    r.sc0 = r.sc1 = d * static_cast<float>(sc);
    r.m0 = r.m1 = -dmin * static_cast<float>(mn);
  } else if constexpr (T == GgmlType::Q6_K) {
    const uint8_t* b = row + static_cast<size_t>(g >> 3) * 210;
    const int j = g & 7, h = j >> 2, k = j & 3;
    const float d = f16_at(b + 208);
    const uint8_t* ql = b + 64 * h + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * h;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      const uint32_t lo = (ld32_a2(ql + 4 * w) >> (4 * (k >> 1))) & 0x0F0F0F0Fu;
      const uint32_t hi = (ld32_a2(qh + 4 * w) >> (2 * k)) & 0x03030303u;
      r.q[w] = lo | (hi << 4);
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    r.sc0 = d * static_cast<float>(sc[2 * j]);
    r.sc1 = d * static_cast<float>(sc[2 * j + 1]);
    r.m0 = -32.0f * r.sc0;
    r.m1 = -32.0f * r.sc1;
  }
  return r;
}

__device__ __forceinline__ float to_f32(float v) { return v; }
template <class O>
__device__ __forceinline__ O from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

/// Element e (0..31) of a decoded group as float (sc*q + m, one rounding).
///
/// q reaches f32 without an integer-to-float conversion (a quarter-rate instruction, once per
/// weight in the prefill GEMMs' decoding): q + 128 (the byte with its top bit flipped) becomes the
/// low byte of the f32 pattern 0x4B0000xx, which is 2^23 + q + 128 exactly, and one subtraction
/// of 2^23 + 128 leaves q exactly. The value is the same as (float)q, bit for bit.
__device__ __forceinline__ float group_value(const QGroup& g, int e) {
  const uint32_t biased = g.q[e >> 2] ^ 0x80808080u;
  const float q =
      __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7440u | static_cast<uint32_t>(e & 3))) -
      8388736.0f;
  return e < 16 ? __fmaf_rn(g.sc0, q, g.m0) : __fmaf_rn(g.sc1, q, g.m1);
}

/// Element i of a float-type row (F32, F16, BF16) as f32.
template <GgmlType T>
__device__ __forceinline__ float float_elem(const uint8_t* row, int64_t i) {
  if constexpr (T == GgmlType::F32) {
    return reinterpret_cast<const float*>(row)[i];
  } else if constexpr (T == GgmlType::F16) {
    return __half2float(reinterpret_cast<const __half*>(row)[i]);
  } else {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[i]);
  }
}

constexpr bool is_float_type(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16;
}

}  // namespace berth::gpu
