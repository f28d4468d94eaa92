// Scalar twins of the K-quant dot products (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K weights against Q8_K
// activations), written from the block layouts in quants_ref.h (ggml-common.h) and the way
// ggml-quants.c pairs them with Q8_K: per 256-element super-block, exact integer sums of
// quant products per sub-block, times the integer sub-block scales; the sub-block minimums
// (Q2_K, Q4_K, Q5_K) go through the Q8_K block's bsums (sums of 16 activation quants).
//
// Float part of one super-block b (dw, dminw: the weight block's f16 scales decoded; da: the
// Q8_K block's scale):
//   v_b = (dw * da) * float(sumi_b) - (dminw * da) * float(summ_b)
// with sumi_b = sum over sub-blocks s of sc_s * sum_{i in s} q_i * a_i (q_i the signed quant
// the format defines, sc_s its integer scale) and summ_b = sum_s mn_s * (sum_{i in s} a_i)
// (0 for Q3_K and Q6_K). The row result is sum_b v_b accumulated in float in block order.
#include <cstdint>
#include <cstring>
#include <string>

#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/cpu_kernels/quants_ref.h"

namespace berth::ref::detail {
namespace {

// One weight super-block in integer form: q[i] the signed quant of element i, sc[g] the
// integer scale of 16-element group g, mn[g] its integer min (0 where the format has none).
struct IntBlock {
  int q[kQK_K];
  int sc[kQK_K / 16];
  int mn[kQK_K / 16];
  float d = 0.0f;
  float dmin = 0.0f;
};

template <class B>
B load(const void* p, int64_t i) {
  B b;
  std::memcpy(&b, static_cast<const uint8_t*>(p) + static_cast<size_t>(i) * sizeof(B), sizeof(B));
  return b;
}

// The 6-bit scale and min of sub-block j of Q4_K/Q5_K (quants_ref.h, BlockQ4_K).
void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_q2_k(const void* w, int64_t ib, IntBlock& o) {
  const auto b = load<BlockQ2_K>(w, ib);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) o.q[128 * h + 32 * k + l] = (b.qs[32 * h + l] >> (2 * k)) & 3;
  for (int g = 0; g < 16; ++g) {
    o.sc[g] = b.scales[g] & 0xF;
    o.mn[g] = b.scales[g] >> 4;
  }
  o.d = fp16_to_f32(b.d);
  o.dmin = fp16_to_f32(b.dmin);
}

void decode_q3_k(const void* w, int64_t ib, IntBlock& o) {
  const auto b = load<BlockQ3_K>(w, ib);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const int low = (b.qs[32 * h + l] >> (2 * k)) & 3;
        const int high = (b.hmask[l] >> (4 * h + k)) & 1;
        o.q[128 * h + 32 * k + l] = low - (high ? 0 : 4);
      }
  for (int g = 0; g < 16; ++g) {
    const int low4 = g < 8 ? (b.scales[g] & 0xF) : (b.scales[g - 8] >> 4);
    const int high2 = (b.scales[8 + g % 4] >> (2 * (g / 4))) & 3;
    o.sc[g] = (low4 | (high2 << 4)) - 32;
    o.mn[g] = 0;
  }
  o.d = fp16_to_f32(b.d);
  o.dmin = 0.0f;
}

template <class B>
void scales_k4(const B& b, IntBlock& o) {
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(b.scales, j, sc, mn);
    o.sc[2 * j] = o.sc[2 * j + 1] = sc;
    o.mn[2 * j] = o.mn[2 * j + 1] = mn;
  }
  o.d = fp16_to_f32(b.d);
  o.dmin = fp16_to_f32(b.dmin);
}

void decode_q4_k(const void* w, int64_t ib, IntBlock& o) {
  const auto b = load<BlockQ4_K>(w, ib);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      o.q[64 * c + l] = b.qs[32 * c + l] & 0xF;
      o.q[64 * c + 32 + l] = b.qs[32 * c + l] >> 4;
    }
  scales_k4(b, o);
}

void decode_q5_k(const void* w, int64_t ib, IntBlock& o) {
  const auto b = load<BlockQ5_K>(w, ib);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      o.q[64 * c + l] = (b.qs[32 * c + l] & 0xF) | (((b.qh[l] >> (2 * c)) & 1) << 4);
      o.q[64 * c + 32 + l] = (b.qs[32 * c + l] >> 4) | (((b.qh[l] >> (2 * c + 1)) & 1) << 4);
    }
  scales_k4(b, o);
}

void decode_q6_k(const void* w, int64_t ib, IntBlock& o) {
  const auto b = load<BlockQ6_K>(w, ib);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const uint8_t ql = b.ql[64 * h + 32 * (k % 2) + l];
        const int low = k < 2 ? (ql & 0xF) : (ql >> 4);
        const int high = (b.qh[32 * h + l] >> (2 * k)) & 3;
        o.q[128 * h + 32 * k + l] = (low | (high << 4)) - 32;
      }
  for (int g = 0; g < 16; ++g) {
    o.sc[g] = b.scales[g];
    o.mn[g] = 0;
  }
  o.d = fp16_to_f32(b.d);
  o.dmin = 0.0f;
}

}  // namespace

/// One output of the K-quant dot product: weight row `w` (n elements of type t, n a multiple
/// of 256) against one Q8_K activation row `act`. Formula at the top of this file.
/// Throws Error(internal) for a type that is not a K-quant (the dispatcher never passes one).
float dot_k(GgmlType t, const void* w, const void* act, int64_t n) {
  void (*decode)(const void*, int64_t, IntBlock&) = nullptr;
  switch (t) {
    case GgmlType::Q2_K:
      decode = decode_q2_k;
      break;
    case GgmlType::Q3_K:
      decode = decode_q3_k;
      break;
    case GgmlType::Q4_K:
      decode = decode_q4_k;
      break;
    case GgmlType::Q5_K:
      decode = decode_q5_k;
      break;
    case GgmlType::Q6_K:
      decode = decode_q6_k;
      break;
    default:
      throw Error(ErrorCategory::internal, "ref::detail::dot_k: weight type " +
                                               std::string(type_name(t)) + " is not a K-quant");
  }
  const int64_t nb = n / kQK_K;
  float sum = 0.0f;
  IntBlock wb;
  for (int64_t ib = 0; ib < nb; ++ib) {
    decode(w, ib, wb);
    const auto a = load<BlockQ8_K>(act, ib);
    int32_t sumi = 0;  // |sumi| <= 256 * 63 * 128 * 128 < 2^31 (Q6_K bounds the others)
    int32_t summ = 0;
    for (int g = 0; g < kQK_K / 16; ++g) {
      int32_t s = 0;
      for (int l = 0; l < 16; ++l) s += wb.q[16 * g + l] * a.qs[16 * g + l];
      sumi += wb.sc[g] * s;
      summ += wb.mn[g] * a.bsums[g];
    }
    sum += (wb.d * a.d) * static_cast<float>(sumi) - (wb.dmin * a.d) * static_cast<float>(summ);
  }
  return sum;
}

}  // namespace berth::ref::detail
