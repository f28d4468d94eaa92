// Scalar twin of the legacy 32-element dot products (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights
// against Q8_0 activations), used by ref::dot_tile and by the oracle tests of the Highway
// kernels in quant_dot_legacy.cc.
//
// Formula (the formats' decode rules in quants_ref.h, ggml-quants.c's reference dot products):
// for block b with weight quants q_j (already offset: Q4_0 q - 8, Q5_0 q - 16, Q8_0 as stored;
// Q4_1/Q5_1 the unsigned quant), weight scale d_w, weight min m (Q4_1/Q5_1 only), activation
// quants a_j and activation scale d_a:
//   isum_b = sum_j q_j * a_j                  (exact, int32)
//   asum_b = sum_j a_j                        (exact, int32; Q4_1/Q5_1 only)
//   block_b = (d_w * d_a) * float(isum_b) [+ (m * d_a) * float(asum_b)]
// and the result is the float sum of block_b in block order, starting from 0.
#include <fmt/format.h>

#include <cstring>

#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/cpu_kernels/quant_dot.h"
#include "berth/cpu_kernels/quants_ref.h"

namespace berth::ref::detail {
namespace {

inline uint32_t le32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

// Unpacks the 32 quants of one weight block into q (offset applied for the symmetric formats);
// returns d_w and, through m, the block minimum (0 for the symmetric formats).
float unpack_block(GgmlType t, const uint8_t* blk, int q[32], float& m) {
  uint16_t h;
  std::memcpy(&h, blk, 2);
  const float d = fp16_to_f32(h);
  m = 0.0f;
  switch (t) {
    case GgmlType::Q4_0: {
      const uint8_t* qs = blk + 2;
      for (int j = 0; j < 16; ++j) {
        q[j] = (qs[j] & 0xF) - 8;
        q[j + 16] = (qs[j] >> 4) - 8;
      }
      break;
    }
    case GgmlType::Q4_1: {
      std::memcpy(&h, blk + 2, 2);
      m = fp16_to_f32(h);
      const uint8_t* qs = blk + 4;
      for (int j = 0; j < 16; ++j) {
        q[j] = qs[j] & 0xF;
        q[j + 16] = qs[j] >> 4;
      }
      break;
    }
    case GgmlType::Q5_0:
    case GgmlType::Q5_1: {
      const bool has_min = t == GgmlType::Q5_1;
      if (has_min) {
        std::memcpy(&h, blk + 2, 2);
        m = fp16_to_f32(h);
      }
      const uint8_t* qh_p = blk + (has_min ? 4 : 2);
      const uint32_t qh = le32(qh_p);
      const uint8_t* qs = qh_p + 4;
      const int off = has_min ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        q[j] = ((qs[j] & 0xF) | static_cast<int>((qh >> j) & 1u) << 4) - off;
        q[j + 16] = ((qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1u) << 4) - off;
      }
      break;
    }
    case GgmlType::Q8_0: {
      const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
      for (int j = 0; j < 32; ++j) q[j] = qs[j];
      break;
    }
    default:
      throw Error(ErrorCategory::internal,
                  fmt::format("ref::dot_legacy: weight type {} is not a legacy 32-element type",
                              type_name(t)));
  }
  return d;
}

}  // namespace

/// One output of ref::dot_tile for a legacy weight type: weight row `w` (n elements of type t,
/// row_bytes(t, n) bytes) times activation row `act` (n elements of Q8_0). n must be a multiple
/// of 32 (else Error(invalid_argument)); a type outside Q4_0..Q8_0 gives Error(internal).
float dot_legacy(GgmlType t, const void* w, const void* act, int64_t n) {
  if (n < 0 || n % kQK8_0 != 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("ref::dot_legacy: row of {} elements is not a whole number of "
                            "32-element blocks ({})",
                            n, type_name(t)));
  const size_t wbytes = traits(t).block_bytes;
  const auto* wp = static_cast<const uint8_t*>(w);
  const auto* ap = static_cast<const uint8_t*>(act);
  const int64_t nb = n / kQK8_0;
  float sum = 0.0f;
  int q[32];
  for (int64_t b = 0; b < nb; ++b) {
    float m;
    const float dw = unpack_block(t, wp + static_cast<size_t>(b) * wbytes, q, m);
    BlockQ8_0 a;
    std::memcpy(&a, ap + static_cast<size_t>(b) * sizeof(BlockQ8_0), sizeof(a));
    const float da = fp16_to_f32(a.d);
    int32_t isum = 0, asum = 0;
    for (int j = 0; j < 32; ++j) {
      isum += q[j] * a.qs[j];
      asum += a.qs[j];
    }
    float block = (dw * da) * static_cast<float>(isum);
    if (t == GgmlType::Q4_1 || t == GgmlType::Q5_1) {
      const float mterm = (m * da) * static_cast<float>(asum);
      block = block + mterm;
    }
    sum = sum + block;
  }
  return sum;
}

}  // namespace berth::ref::detail
