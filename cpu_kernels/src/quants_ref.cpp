// Scalar reference quantizers and dequantizers for ggml's block formats.
//
// Formats: ggml-common.h (block structs, mirrored in quants_ref.h). Formulas: the published
// behaviour of ggml-quants.c's dequantize_row_* and quantize_row_*_ref (round-to-nearest
// scalar quantizers for the legacy 32-element formats; for the K-quants a per-sub-block scale
// (and min) search followed by quantization of the sub-block scales against one f16
// super-block scale). This is an independent implementation of those algorithms.
//
// Blocks are read and written through memcpy so that callers may pass byte buffers of any
// alignment (the K-quant blocks of a GGUF tensor are only 2-byte aligned in general).
#include "berth/cpu_kernels/quants_ref.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "berth/core/error.h"
#include "berth/core/fp16.h"

namespace berth::ref {
namespace {

// Groups whose largest magnitude is below this are encoded as zeros (ggml's GROUP_MAX_EPS).
constexpr float kGroupMaxEps = 1e-15f;

// Rounds to the nearest integer, ties to even (ggml's nearest_int). Inputs are first clamped
// to +-2^22, far outside every quant range, so the conversion is always defined; NaN gives 0.
inline int nearest_int(float v) {
  if (!(v == v)) return 0;
  v = std::clamp(v, -4194303.0f, 4194303.0f);
  // Adding 1.5 * 2^23 leaves the rounded integer (offset by 2^22) in the low mantissa bits.
  const uint32_t bits = std::bit_cast<uint32_t>(v + 12582912.0f);
  return static_cast<int>(bits & 0x007fffffu) - 0x00400000;
}

// C's (int) cast (truncation toward zero) of v after clamping to [lo, hi]; NaN gives lo.
inline int trunc_clamped(float v, int lo, int hi) {
  if (!(v == v)) return lo;
  v = std::clamp(v, static_cast<float>(lo), static_cast<float>(hi));
  return static_cast<int>(v);
}

inline float h2f(uint16_t h) { return fp16_to_f32(h); }
inline uint16_t f2h(float f) { return f32_to_fp16(f); }

template <class Block>
Block load_block(const void* src, int64_t i) {
  Block b;
  std::memcpy(&b, static_cast<const uint8_t*>(src) + static_cast<size_t>(i) * sizeof(Block),
              sizeof(Block));
  return b;
}

template <class Block>
void store_block(void* dst, int64_t i, const Block& b) {
  std::memcpy(static_cast<uint8_t*>(dst) + static_cast<size_t>(i) * sizeof(Block), &b,
              sizeof(Block));
}

// Value with the largest magnitude (first one on ties) and that magnitude.
struct SignedMax {
  float value = 0.0f;
  float abs = 0.0f;
};
SignedMax signed_max(const float* x, int n) {
  SignedMax m;
  for (int i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > m.abs) {
      m.abs = a;
      m.value = x[i];
    }
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// Scale searches of the K-quants.
// ---------------------------------------------------------------------------------------------

// Symmetric search (ggml's make_qx_quants with rmse_type 1: weights x^2). Finds the scale s
// and levels L in [0, 2*nmax) such that x ~ s * (L - nmax), trying the 19 reciprocal scales
// -(nmax + 0.1 t) / max, t in -9..9, each refined by least squares, and keeping the one that
// most reduces the weighted squared error. Returns s; a group whose largest magnitude is below
// kGroupMaxEps gets s = 0 and all L = 0.
float symmetric_scale_search(int n, int nmax, const float* x, uint8_t* L) {
  const SignedMax mx = signed_max(x, n);
  if (mx.abs < kGroupMaxEps) {
    std::fill(L, L + n, uint8_t{0});
    return 0.0f;
  }
  // Sums of w*x*l and w*l^2 for the levels produced by reciprocal scale `inv`.
  auto sums = [&](float inv, float& sum_xl, float& sum_l2, bool write) {
    sum_xl = 0.0f;
    sum_l2 = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest_int(inv * x[i]), -nmax, nmax - 1);
      if (write) L[i] = static_cast<uint8_t>(l + nmax);
      const float w = x[i] * x[i];
      sum_xl += w * x[i] * static_cast<float>(l);
      sum_l2 += w * static_cast<float>(l * l);
    }
  };
  float sum_xl, sum_l2;
  sums(-static_cast<float>(nmax) / mx.value, sum_xl, sum_l2, true);
  float scale = sum_l2 != 0.0f ? sum_xl / sum_l2 : 0.0f;
  float best = scale * sum_xl;  // reduction of the weighted squared error
  for (int t = -9; t <= 9; ++t) {
    if (t == 0) continue;
    const float inv = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(t)) / mx.value;
    sums(inv, sum_xl, sum_l2, false);
    if (sum_l2 > 0.0f && sum_xl * sum_xl > best * sum_l2) {
      sums(inv, sum_xl, sum_l2, true);
      scale = sum_xl / sum_l2;
      best = scale * sum_xl;
    }
  }
  return scale;
}

// Symmetric 3-bit search of Q3_K (ggml's make_q3_quants with do_rmse): start from
// round(-nmax * x / max) in [-nmax, nmax), then up to 5 sweeps of coordinate descent, each
// moving one level to the value that is optimal for the current least-squares scale when that
// raises sum_xl^2 / sum_l2 (weights x^2). L receives level + nmax in [0, 2*nmax). Returns the
// least-squares scale (0 for an all-zero group).
float q3_scale_search(int n, int nmax, const float* x, uint8_t* L) {
  const SignedMax mx = signed_max(x, n);
  if (mx.abs == 0.0f) {
    std::fill(L, L + n, uint8_t{0});
    return 0.0f;
  }
  const float inv = -static_cast<float>(nmax) / mx.value;
  int lev[kQK_K];
  float sum_xl = 0.0f, sum_l2 = 0.0f;
  for (int i = 0; i < n; ++i) {
    lev[i] = std::clamp(nearest_int(inv * x[i]), -nmax, nmax - 1);
    const float w = x[i] * x[i];
    sum_xl += w * x[i] * static_cast<float>(lev[i]);
    sum_l2 += w * static_cast<float>(lev[i] * lev[i]);
  }
  for (int sweep = 0; sweep < 5; ++sweep) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      float sxl = sum_xl - w * x[i] * static_cast<float>(lev[i]);
      if (sxl <= 0.0f) continue;
      float sl2 = sum_l2 - w * static_cast<float>(lev[i] * lev[i]);
      const int nl = std::clamp(nearest_int(x[i] * sl2 / sxl), -nmax, nmax - 1);
      if (nl == lev[i]) continue;
      sxl += w * x[i] * static_cast<float>(nl);
      sl2 += w * static_cast<float>(nl * nl);
      if (sl2 > 0.0f && sxl * sxl * sum_l2 > sum_xl * sum_xl * sl2) {
        lev[i] = nl;
        sum_xl = sxl;
        sum_l2 = sl2;
        ++changed;
      }
    }
    if (changed == 0) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(lev[i] + nmax);
  // sum_l2 underflows to 0 only for magnitudes near 1e-20 and below: encode such a group as 0.
  return sum_l2 > 0.0f ? sum_xl / sum_l2 : 0.0f;
}

// Asymmetric search of Q2_K/Q4_K/Q5_K (ggml's make_qkx2_quants): x ~ scale * L - mn with L in
// [0, nmax], mn >= 0. Starts from the min/max grid, then tries n_step + 1 reciprocal scales
// (nmax + rmin + rdelta * t) / (max - min); for each, fits scale and offset by weighted least
// squares (offset forced to <= 0 as a min, refitting the scale alone then) and keeps the one
// with the smallest weighted error, absolute (use_mad) or squared. Returns the scale and
// stores the (non-negative) min in *mn.
float asymmetric_scale_search(int n, int nmax, const float* x, const float* w, uint8_t* L,
                              float* mn, float rmin, float rdelta, int n_step, bool use_mad) {
  float lo = x[0], hi = x[0];
  float sum_w = w[0], sum_x = w[0] * x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (lo > 0.0f) lo = 0.0f;
  if (hi == lo) {
    std::fill(L, L + n, uint8_t{0});
    *mn = -lo;
    return 0.0f;
  }
  auto err = [use_mad](float d) { return use_mad ? std::fabs(d) : d * d; };
  float inv = static_cast<float>(nmax) / (hi - lo);
  float scale = 1.0f / inv;
  float best_error = 0.0f;
  for (int i = 0; i < n; ++i) {
    const int l = std::clamp(nearest_int(inv * (x[i] - lo)), 0, nmax);
    L[i] = static_cast<uint8_t>(l);
    best_error += w[i] * err(scale * static_cast<float>(l) + lo - x[i]);
  }
  uint8_t trial[kQK_K];
  for (int t = 0; t <= n_step; ++t) {
    inv = (rmin + rdelta * static_cast<float>(t) + static_cast<float>(nmax)) / (hi - lo);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest_int(inv * (x[i] - lo)), 0, nmax);
      trial[i] = static_cast<uint8_t>(l);
      const float fl = static_cast<float>(l);
      sum_l += w[i] * fl;
      sum_l2 += w[i] * fl * fl;
      sum_xl += w[i] * fl * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (!(det > 0.0f)) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (this_min > 0.0f) {
      this_min = 0.0f;
      this_scale = sum_xl / sum_l2;
    }
    float cur_error = 0.0f;
    for (int i = 0; i < n; ++i)
      cur_error += w[i] * err(this_scale * static_cast<float>(trial[i]) + this_min - x[i]);
    if (cur_error < best_error) {
      std::copy(trial, trial + n, L);
      best_error = cur_error;
      scale = this_scale;
      lo = this_min;
    }
  }
  *mn = -lo;
  return scale;
}

// 6-bit scale and min of sub-block j (0..7) of Q4_K/Q5_K's packed 12 bytes.
inline void unpack_scale_min_k4(int j, const uint8_t* q, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Inverse of unpack_scale_min_k4; `q` must start zeroed. sc, mn in [0, 63].
inline void pack_scale_min_k4(int j, int sc, int mn, uint8_t* q) {
  if (j < 4) {
    q[j] = static_cast<uint8_t>(q[j] | sc);
    q[j + 4] = static_cast<uint8_t>(q[j + 4] | mn);
  } else {
    q[j + 4] = static_cast<uint8_t>((sc & 0xF) | ((mn & 0xF) << 4));
    q[j - 4] = static_cast<uint8_t>(q[j - 4] | ((sc >> 4) << 6));
    q[j] = static_cast<uint8_t>(q[j] | ((mn >> 4) << 6));
  }
}

// Signed 6-bit scale of sub-block s (0..15) of Q3_K's packed 12 bytes, in [-32, 31].
inline int unpack_scale_q3(int s, const uint8_t* q) {
  const int low = s < 8 ? (q[s] & 0xF) : (q[s - 8] >> 4);
  const int high = (q[8 + s % 4] >> (2 * (s / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// ---------------------------------------------------------------------------------------------
// Legacy 32-element formats.
// ---------------------------------------------------------------------------------------------

void dequant_q4_0(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK4_0) {
    const auto b = load_block<BlockQ4_0>(src, i);
    const float d = h2f(b.d);
    for (int j = 0; j < kQK4_0 / 2; ++j) {
      y[j] = static_cast<float>((b.qs[j] & 0xF) - 8) * d;
      y[j + 16] = static_cast<float>((b.qs[j] >> 4) - 8) * d;
    }
  }
}

// The element of largest magnitude maps to -8: d = max / -8.
void quant_q4_0(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK4_0) {
    const SignedMax mx = signed_max(x, kQK4_0);
    const float d = mx.value / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    BlockQ4_0 b{};
    b.d = f2h(d);
    for (int j = 0; j < kQK4_0 / 2; ++j) {
      const int q0 = std::min(15, trunc_clamped(x[j] * id + 8.5f, 0, 16));
      const int q1 = std::min(15, trunc_clamped(x[j + 16] * id + 8.5f, 0, 16));
      b.qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
    store_block(dst, i, b);
  }
}

void dequant_q4_1(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK4_1) {
    const auto b = load_block<BlockQ4_1>(src, i);
    const float d = h2f(b.d), m = h2f(b.m);
    for (int j = 0; j < kQK4_1 / 2; ++j) {
      y[j] = static_cast<float>(b.qs[j] & 0xF) * d + m;
      y[j + 16] = static_cast<float>(b.qs[j] >> 4) * d + m;
    }
  }
}

// d = (max - min) / 15, m = min.
void quant_q4_1(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK4_1) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < kQK4_1; ++j) {
      lo = std::min(lo, x[j]);
      hi = std::max(hi, x[j]);
    }
    const float d = (hi - lo) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    BlockQ4_1 b{};
    b.d = f2h(d);
    b.m = f2h(lo);
    for (int j = 0; j < kQK4_1 / 2; ++j) {
      const int q0 = std::min(15, trunc_clamped((x[j] - lo) * id + 0.5f, 0, 16));
      const int q1 = std::min(15, trunc_clamped((x[j + 16] - lo) * id + 0.5f, 0, 16));
      b.qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
    store_block(dst, i, b);
  }
}

inline uint32_t load_le32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}
inline void store_le32(uint8_t* p, uint32_t v) {
  for (int k = 0; k < 4; ++k) p[k] = static_cast<uint8_t>(v >> (8 * k));
}

void dequant_q5_0(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK5_0) {
    const auto b = load_block<BlockQ5_0>(src, i);
    const float d = h2f(b.d);
    const uint32_t qh = load_le32(b.qh);
    for (int j = 0; j < kQK5_0 / 2; ++j) {
      const int q0 = (b.qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int q1 = (b.qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = static_cast<float>(q0 - 16) * d;
      y[j + 16] = static_cast<float>(q1 - 16) * d;
    }
  }
}

// The element of largest magnitude maps to -16: d = max / -16.
void quant_q5_0(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK5_0) {
    const SignedMax mx = signed_max(x, kQK5_0);
    const float d = mx.value / -16.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    BlockQ5_0 b{};
    b.d = f2h(d);
    uint32_t qh = 0;
    for (int j = 0; j < kQK5_0 / 2; ++j) {
      const int q0 = std::min(31, trunc_clamped(x[j] * id + 16.5f, 0, 32));
      const int q1 = std::min(31, trunc_clamped(x[j + 16] * id + 16.5f, 0, 32));
      b.qs[j] = static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
      qh |= static_cast<uint32_t>(q0 >> 4) << j;
      qh |= static_cast<uint32_t>(q1 >> 4) << (j + 16);
    }
    store_le32(b.qh, qh);
    store_block(dst, i, b);
  }
}

void dequant_q5_1(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK5_1) {
    const auto b = load_block<BlockQ5_1>(src, i);
    const float d = h2f(b.d), m = h2f(b.m);
    const uint32_t qh = load_le32(b.qh);
    for (int j = 0; j < kQK5_1 / 2; ++j) {
      const int q0 = (b.qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int q1 = (b.qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = static_cast<float>(q0) * d + m;
      y[j + 16] = static_cast<float>(q1) * d + m;
    }
  }
}

// d = (max - min) / 31, m = min.
void quant_q5_1(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK5_1) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < kQK5_1; ++j) {
      lo = std::min(lo, x[j]);
      hi = std::max(hi, x[j]);
    }
    const float d = (hi - lo) / 31.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    BlockQ5_1 b{};
    b.d = f2h(d);
    b.m = f2h(lo);
    uint32_t qh = 0;
    for (int j = 0; j < kQK5_1 / 2; ++j) {
      const int q0 = std::min(31, trunc_clamped((x[j] - lo) * id + 0.5f, 0, 32));
      const int q1 = std::min(31, trunc_clamped((x[j + 16] - lo) * id + 0.5f, 0, 32));
      b.qs[j] = static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
      qh |= static_cast<uint32_t>(q0 >> 4) << j;
      qh |= static_cast<uint32_t>(q1 >> 4) << (j + 16);
    }
    store_le32(b.qh, qh);
    store_block(dst, i, b);
  }
}

void dequant_q8_0(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK8_0) {
    const auto b = load_block<BlockQ8_0>(src, i);
    const float d = h2f(b.d);
    for (int j = 0; j < kQK8_0; ++j) y[j] = static_cast<float>(b.qs[j]) * d;
  }
}

// d = amax / 127, quants rounded half away from zero (C's roundf).
void quant_q8_0(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK8_0) {
    const float amax = signed_max(x, kQK8_0).abs;
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    BlockQ8_0 b{};
    b.d = f2h(d);
    for (int j = 0; j < kQK8_0; ++j) {
      const float v = std::clamp(x[j] * id, -127.0f, 127.0f);
      b.qs[j] = static_cast<int8_t>(std::round(v == v ? v : 0.0f));
    }
    store_block(dst, i, b);
  }
}

// ---------------------------------------------------------------------------------------------
// K-quants (256-element super-blocks).
// ---------------------------------------------------------------------------------------------

void dequant_q2_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<BlockQ2_K>(src, i);
    const float d = h2f(b.d), dmin = h2f(b.dmin);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* q = b.qs + 32 * h;
      for (int k = 0; k < 4; ++k) {
        for (int half = 0; half < 2; ++half) {
          const uint8_t sc = b.scales[8 * h + 2 * k + half];
          const float dl = d * static_cast<float>(sc & 0xF);
          const float ml = dmin * static_cast<float>(sc >> 4);
          for (int l = 16 * half; l < 16 * half + 16; ++l)
            *y++ = dl * static_cast<float>((q[l] >> (2 * k)) & 3) - ml;
        }
      }
    }
  }
}

// Sub-blocks of 16: asymmetric search with 2-bit levels and absolute-error weights |x|, then
// scales and mins quantized to 4 bits against d = max_scale / 15, dmin = max_min / 15, and the
// levels recomputed against the quantized scale and min.
void quant_q2_k(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK_K) {
    uint8_t L[kQK_K];
    float scales[16], mins[16], w[16];
    float max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 16; ++j) {
      for (int l = 0; l < 16; ++l) w[l] = std::fabs(x[16 * j + l]);
      scales[j] = asymmetric_scale_search(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], -0.5f, 0.1f,
                                          15, true);
      max_scale = std::max(max_scale, scales[j]);
      max_min = std::max(max_min, mins[j]);
    }
    BlockQ2_K b{};
    if (max_scale > 0.0f) {
      const float iscale = 15.0f / max_scale;
      for (int j = 0; j < 16; ++j)
        b.scales[j] = static_cast<uint8_t>(std::clamp(nearest_int(iscale * scales[j]), 0, 15));
      b.d = f2h(max_scale / 15.0f);
    }
    if (max_min > 0.0f) {
      const float iscale = 15.0f / max_min;
      for (int j = 0; j < 16; ++j)
        b.scales[j] = static_cast<uint8_t>(b.scales[j] |
                                           (std::clamp(nearest_int(iscale * mins[j]), 0, 15) << 4));
      b.dmin = f2h(max_min / 15.0f);
    }
    for (int j = 0; j < 16; ++j) {
      const float d = h2f(b.d) * static_cast<float>(b.scales[j] & 0xF);
      if (d == 0.0f) continue;
      const float dm = h2f(b.dmin) * static_cast<float>(b.scales[j] >> 4);
      for (int l = 0; l < 16; ++l)
        L[16 * j + l] =
            static_cast<uint8_t>(std::clamp(nearest_int((x[16 * j + l] + dm) / d), 0, 3));
    }
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t* s = L + 128 * h + l;
        b.qs[32 * h + l] = static_cast<uint8_t>(s[0] | (s[32] << 2) | (s[64] << 4) | (s[96] << 6));
      }
    store_block(dst, i, b);
  }
}

void dequant_q3_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<BlockQ3_K>(src, i);
    const float d = h2f(b.d);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* q = b.qs + 32 * h;
      for (int k = 0; k < 4; ++k) {
        const int hbit = 4 * h + k;
        for (int half = 0; half < 2; ++half) {
          const float dl = d * static_cast<float>(unpack_scale_q3(8 * h + 2 * k + half, b.scales));
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            const int lo = (q[l] >> (2 * k)) & 3;
            const int v = lo - (((b.hmask[l] >> hbit) & 1) ? 0 : 4);
            *y++ = dl * static_cast<float>(v);
          }
        }
      }
    }
  }
}

// Sub-blocks of 16: 3-bit symmetric search, the 16 scales quantized to signed 6 bits against
// d = max_scale / -32, then levels recomputed against the quantized scales.
void quant_q3_k(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK_K) {
    uint8_t L[kQK_K];
    float scales[16];
    float max_scale = 0.0f, amax = 0.0f;
    for (int j = 0; j < 16; ++j) {
      scales[j] = q3_scale_search(16, 4, x + 16 * j, L + 16 * j);
      const float a = std::fabs(scales[j]);
      if (a > amax) {
        amax = a;
        max_scale = scales[j];
      }
    }
    BlockQ3_K b{};
    if (max_scale != 0.0f) {
      const float iscale = -32.0f / max_scale;
      for (int j = 0; j < 16; ++j) {
        const int l = std::clamp(nearest_int(iscale * scales[j]), -32, 31) + 32;
        if (j < 8)
          b.scales[j] = static_cast<uint8_t>(l & 0xF);
        else
          b.scales[j - 8] = static_cast<uint8_t>(b.scales[j - 8] | ((l & 0xF) << 4));
        b.scales[8 + j % 4] =
            static_cast<uint8_t>(b.scales[8 + j % 4] | ((l >> 4) << (2 * (j / 4))));
      }
      b.d = f2h(1.0f / iscale);
    }
    for (int j = 0; j < 16; ++j) {
      const float d = h2f(b.d) * static_cast<float>(unpack_scale_q3(j, b.scales));
      if (d == 0.0f) continue;
      for (int l = 0; l < 16; ++l)
        L[16 * j + l] = static_cast<uint8_t>(std::clamp(nearest_int(x[16 * j + l] / d), -4, 3) + 4);
    }
    // Element e: high bit into hmask[e % 32] bit e / 32, low two bits into qs.
    for (int e = 0; e < kQK_K; ++e) {
      if (L[e] > 3) {
        b.hmask[e % 32] = static_cast<uint8_t>(b.hmask[e % 32] | (1u << (e / 32)));
        L[e] = static_cast<uint8_t>(L[e] - 4);
      }
    }
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t* s = L + 128 * h + l;
        b.qs[32 * h + l] = static_cast<uint8_t>(s[0] | (s[32] << 2) | (s[64] << 4) | (s[96] << 6));
      }
    store_block(dst, i, b);
  }
}

// Shared by Q4_K and Q5_K: decodes the 8 (scale, min) pairs into floats.
void k4_scales(uint16_t d16, uint16_t dmin16, const uint8_t* packed, float* d, float* m) {
  const float dd = h2f(d16), dm = h2f(dmin16);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    unpack_scale_min_k4(j, packed, &sc, &mn);
    d[j] = dd * static_cast<float>(sc);
    m[j] = dm * static_cast<float>(mn);
  }
}

void dequant_q4_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<BlockQ4_K>(src, i);
    float d[8], m[8];
    k4_scales(b.d, b.dmin, b.scales, d, m);
    for (int c = 0; c < 4; ++c) {
      const uint8_t* q = b.qs + 32 * c;
      for (int l = 0; l < 32; ++l) *y++ = d[2 * c] * static_cast<float>(q[l] & 0xF) - m[2 * c];
      for (int l = 0; l < 32; ++l)
        *y++ = d[2 * c + 1] * static_cast<float>(q[l] >> 4) - m[2 * c + 1];
    }
  }
}

// Q4_K (nmax 15) and Q5_K (nmax 31): sub-blocks of 32, asymmetric search with weights
// rms(x) + |x|, scales and mins quantized to 6 bits against d = max_scale / 63 and
// dmin = max_min / 63, then levels recomputed. Fills `packed` (12 bytes), *d16, *dmin16 and
// L (levels in [0, nmax]).
void quant_k4_common(const float* x, int nmax, float rmin, int n_step, uint8_t* packed,
                     uint16_t* d16, uint16_t* dmin16, uint8_t* L) {
  float scales[8], mins[8], w[32];
  float max_scale = 0.0f, max_min = 0.0f;
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0.0f;
    for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / 32.0f);
    for (int l = 0; l < 32; ++l) w[l] = av_x + std::fabs(xs[l]);
    scales[j] =
        asymmetric_scale_search(32, nmax, xs, w, L + 32 * j, &mins[j], rmin, 0.1f, n_step, false);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
  std::fill(packed, packed + kKScaleSize, uint8_t{0});
  for (int j = 0; j < 8; ++j) {
    const int ls = std::clamp(nearest_int(inv_scale * scales[j]), 0, 63);
    const int lm = std::clamp(nearest_int(inv_min * mins[j]), 0, 63);
    pack_scale_min_k4(j, ls, lm, packed);
  }
  *d16 = f2h(max_scale / 63.0f);
  *dmin16 = f2h(max_min / 63.0f);
  float d[8], m[8];
  k4_scales(*d16, *dmin16, packed, d, m);
  for (int j = 0; j < 8; ++j) {
    if (d[j] == 0.0f) continue;
    for (int l = 0; l < 32; ++l)
      L[32 * j + l] =
          static_cast<uint8_t>(std::clamp(nearest_int((x[32 * j + l] + m[j]) / d[j]), 0, nmax));
  }
}

void quant_q4_k_steps(const float* x, void* dst, int64_t nb, int n_step) {
  for (int64_t i = 0; i < nb; ++i, x += kQK_K) {
    BlockQ4_K b{};
    uint8_t L[kQK_K];
    quant_k4_common(x, 15, -1.0f, n_step, b.scales, &b.d, &b.dmin, L);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l)
        b.qs[32 * c + l] = static_cast<uint8_t>(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
    store_block(dst, i, b);
  }
}

void quant_q4_k(const float* x, void* dst, int64_t nb) { quant_q4_k_steps(x, dst, nb, 20); }

void dequant_q5_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<BlockQ5_K>(src, i);
    float d[8], m[8];
    k4_scales(b.d, b.dmin, b.scales, d, m);
    for (int c = 0; c < 4; ++c) {
      const uint8_t* q = b.qs + 32 * c;
      for (int u = 0; u < 2; ++u) {
        const int s = 2 * c + u;
        for (int l = 0; l < 32; ++l) {
          const int v = ((q[l] >> (4 * u)) & 0xF) | (((b.qh[l] >> s) & 1) << 4);
          *y++ = d[s] * static_cast<float>(v) - m[s];
        }
      }
    }
  }
}

void quant_q5_k(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK_K) {
    BlockQ5_K b{};
    uint8_t L[kQK_K];
    quant_k4_common(x, 31, -0.5f, 15, b.scales, &b.d, &b.dmin, L);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const int lo = L[64 * c + l], hi = L[64 * c + 32 + l];
        b.qs[32 * c + l] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
        b.qh[l] =
            static_cast<uint8_t>(b.qh[l] | ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
      }
    store_block(dst, i, b);
  }
}

void dequant_q6_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<BlockQ6_K>(src, i);
    const float d = h2f(b.d);
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 4; ++k) {
        const uint8_t* ql = b.ql + 64 * h + 32 * (k % 2);
        const uint8_t* qh = b.qh + 32 * h;
        for (int l = 0; l < 32; ++l) {
          const int lo = (ql[l] >> (4 * (k / 2))) & 0xF;
          const int hi = (qh[l] >> (2 * k)) & 3;
          const float dl = d * static_cast<float>(b.scales[8 * h + 2 * k + l / 16]);
          *y++ = dl * static_cast<float>((lo | (hi << 4)) - 32);
        }
      }
    }
  }
}

// Quantizes x to the levels L (in [0, 63], q + 32) of each sub-block of 16 against the block's
// decoded scales d * scales[j]; a sub-block whose decoded scale is 0 keeps its L.
void q6_k_levels(const float* x, const BlockQ6_K& b, uint8_t* L) {
  const float dd = h2f(b.d);
  for (int j = 0; j < 16; ++j) {
    const float d = dd * static_cast<float>(b.scales[j]);
    if (d == 0.0f) continue;
    for (int l = 0; l < 16; ++l)
      L[16 * j + l] =
          static_cast<uint8_t>(std::clamp(nearest_int(x[16 * j + l] / d), -32, 31) + 32);
  }
}

// Packs the 256 levels L (in [0, 63]) into ql and qh of the ggml Q6_K layout (ggml-common.h
// block_q6_K; see BlockQ6_K): element 128*h + 32*k + l has its low nibble in ql[64*h +
// 32*(k % 2) + l] (low half for k < 2, high half for k >= 2) and its top two bits in
// qh[32*h + l] at bit 2k.
void q6_k_pack(const uint8_t* L, BlockQ6_K& b) {
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t* s = L + 128 * h + l;
      b.ql[64 * h + l] = static_cast<uint8_t>((s[0] & 0xF) | ((s[64] & 0xF) << 4));
      b.ql[64 * h + 32 + l] = static_cast<uint8_t>((s[32] & 0xF) | ((s[96] & 0xF) << 4));
      b.qh[32 * h + l] = static_cast<uint8_t>((s[0] >> 4) | ((s[32] >> 4) << 2) |
                                              ((s[64] >> 4) << 4) | ((s[96] >> 4) << 6));
    }
}

// Sub-blocks of 16: 6-bit symmetric search (weights x^2), the 16 scales quantized to int8
// against d = max_scale / -128, then levels recomputed.
void quant_q6_k(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK_K) {
    uint8_t L[kQK_K];
    float scales[16];
    float max_scale = 0.0f, max_abs = 0.0f;
    for (int j = 0; j < 16; ++j) {
      scales[j] = symmetric_scale_search(16, 32, x + 16 * j, L + 16 * j);
      const float a = std::fabs(scales[j]);
      if (a > max_abs) {
        max_abs = a;
        max_scale = scales[j];
      }
    }
    BlockQ6_K b{};
    if (max_abs < kGroupMaxEps) {
      store_block(dst, i, b);  // all zero: d = 0, every quant decodes to 0
      continue;
    }
    const float iscale = -128.0f / max_scale;
    b.d = f2h(1.0f / iscale);
    for (int j = 0; j < 16; ++j)
      b.scales[j] = static_cast<int8_t>(std::clamp(nearest_int(iscale * scales[j]), -128, 127));
    q6_k_levels(x, b, L);
    q6_k_pack(L, b);
    store_block(dst, i, b);
  }
}

// Q6_K without the scale search (ggml Q6_K layout as in quant_q6_k). Each sub-block of 16 takes
// the scale s_j = m_j / -32, m_j its element of largest magnitude (first on ties), so that
// element lands exactly on level -32 and every other one inside [-32, 32] (the top, +32, is
// clamped to 31). The int8 sub-block scales are round(s_j / d) against the f16 super-block
// scale d = max |s_j| / 127, so they lie in [-127, 127] (clamped to int8 should f16 rounding
// shrink d); the levels are then recomputed against the decoded d * scales[j]. One pass, no
// iteration: deterministic and several times faster than quant_q6_k.
void quant_q6_k_fast(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK_K) {
    float scales[16];
    float max_abs = 0.0f;
    for (int j = 0; j < 16; ++j) {
      scales[j] = signed_max(x + 16 * j, 16).value / -32.0f;
      max_abs = std::max(max_abs, std::fabs(scales[j]));
    }
    BlockQ6_K b{};
    if (!(max_abs >= kGroupMaxEps)) {  // all (near) zero, or NaN: d = 0 decodes to zeros
      store_block(dst, i, b);
      continue;
    }
    const float d = max_abs / 127.0f;
    b.d = f2h(d);
    const float id = 1.0f / h2f(b.d);
    for (int j = 0; j < 16; ++j)
      b.scales[j] = static_cast<int8_t>(std::clamp(nearest_int(id * scales[j]), -128, 127));
    uint8_t L[kQK_K];
    std::fill(L, L + kQK_K, uint8_t{32});  // q = 0 for sub-blocks whose scale is 0
    q6_k_levels(x, b, L);
    q6_k_pack(L, b);
    store_block(dst, i, b);
  }
}

void dequant_q8_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<BlockQ8_K>(src, i);
    for (int j = 0; j < kQK_K; ++j) *y++ = b.d * static_cast<float>(b.qs[j]);
  }
}

// The element of largest magnitude maps to -127 (d = max / -127), quants rounded to nearest
// even and capped at 127; bsums hold the sums of each 16 quants.
void quant_q8_k(const float* x, void* dst, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK_K) {
    BlockQ8_K b{};
    const SignedMax mx = signed_max(x, kQK_K);
    if (mx.abs != 0.0f) {
      const float iscale = -127.0f / mx.value;
      for (int j = 0; j < kQK_K; ++j)
        b.qs[j] = static_cast<int8_t>(std::clamp(nearest_int(iscale * x[j]), -128, 127));
      for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int l = 0; l < 16; ++l) sum += b.qs[16 * g + l];
        b.bsums[g] = static_cast<int16_t>(sum);
      }
      b.d = 1.0f / iscale;
    }
    store_block(dst, i, b);
  }
}

// ---------------------------------------------------------------------------------------------
// Plain types.
// ---------------------------------------------------------------------------------------------

void dequant_f32(const void* src, float* y, int64_t n) {
  std::memcpy(y, src, static_cast<size_t>(n) * sizeof(float));
}
void quant_f32(const float* x, void* dst, int64_t n) {
  std::memcpy(dst, x, static_cast<size_t>(n) * sizeof(float));
}
void dequant_f16(const void* src, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = h2f(load_block<uint16_t>(src, i));
}
void quant_f16(const float* x, void* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_block(dst, i, f2h(x[i]));
}
void dequant_bf16(const void* src, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(load_block<uint16_t>(src, i));
}
void quant_bf16(const float* x, void* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_block(dst, i, f32_to_bf16(x[i]));
}

using DequantFn = void (*)(const void*, float*, int64_t);
using QuantFn = void (*)(const float*, void*, int64_t);
struct Codec {
  DequantFn dequant;
  QuantFn quant;
};

// Validates the arguments and returns the codec of `type`; the count passed to the codec is
// n / block_size (blocks; elements for plain types).
Codec codec_for(GgmlType type, int64_t n, const void* a, const void* b, const char* what) {
  const TypeTraits& tr = traits(type);  // Error(internal) for a value that is no ggml type
  Codec c{nullptr, nullptr};
  switch (type) {
    case GgmlType::F32:
      c = {dequant_f32, quant_f32};
      break;
    case GgmlType::F16:
      c = {dequant_f16, quant_f16};
      break;
    case GgmlType::BF16:
      c = {dequant_bf16, quant_bf16};
      break;
    case GgmlType::Q4_0:
      c = {dequant_q4_0, quant_q4_0};
      break;
    case GgmlType::Q4_1:
      c = {dequant_q4_1, quant_q4_1};
      break;
    case GgmlType::Q5_0:
      c = {dequant_q5_0, quant_q5_0};
      break;
    case GgmlType::Q5_1:
      c = {dequant_q5_1, quant_q5_1};
      break;
    case GgmlType::Q8_0:
      c = {dequant_q8_0, quant_q8_0};
      break;
    case GgmlType::Q2_K:
      c = {dequant_q2_k, quant_q2_k};
      break;
    case GgmlType::Q3_K:
      c = {dequant_q3_k, quant_q3_k};
      break;
    case GgmlType::Q4_K:
      c = {dequant_q4_k, quant_q4_k};
      break;
    case GgmlType::Q5_K:
      c = {dequant_q5_k, quant_q5_k};
      break;
    case GgmlType::Q6_K:
      c = {dequant_q6_k, quant_q6_k};
      break;
    case GgmlType::Q8_K:
      c = {dequant_q8_k, quant_q8_k};
      break;
    default:
      break;
  }
  if (c.dequant == nullptr || !tr.computable)
    throw Error(ErrorCategory::unsupported,
                fmt::format("{}: tensor type {} has no reference codec", what, tr.name));
  if (n < 0 || n % tr.block_size != 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("{}: a row of {} elements is not a whole number of {} blocks of {}",
                            what, n, tr.name, tr.block_size));
  if (n > 0 && (a == nullptr || b == nullptr))
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("{}: null pointer for a row of {} {} elements", what, n, tr.name));
  return c;
}

}  // namespace

void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  const Codec c = codec_for(type, n, src, dst, "dequantize_row");
  if (n > 0) c.dequant(src, dst, n / traits(type).block_size);
}

void quantize_row(GgmlType type, const float* src, void* dst, int64_t n) {
  const Codec c = codec_for(type, n, src, dst, "quantize_row");
  if (n > 0) c.quant(src, dst, n / traits(type).block_size);
}

void quantize_row_fast(GgmlType type, const float* src, void* dst, int64_t n) {
  const Codec c = codec_for(type, n, src, dst, "quantize_row_fast");
  if (n == 0) return;
  if (type == GgmlType::Q4_K)
    quant_q4_k_steps(src, dst, n / kQK_K, -1);  // the min/max grid only
  else if (type == GgmlType::Q6_K)
    quant_q6_k_fast(src, dst, n / kQK_K);
  else
    c.quant(src, dst, n / traits(type).block_size);
}

void dequantize_rows(GgmlType type, const void* src, float* dst, int64_t n_rows,
                     int64_t n_per_row) {
  const Codec c = codec_for(type, n_per_row, src, dst, "dequantize_rows");
  if (n_rows < 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("dequantize_rows: negative row count {} of {} rows", n_rows,
                            traits(type).name));
  if (n_rows == 0 || n_per_row == 0) return;
  const size_t stride = row_bytes(type, n_per_row);
  const int64_t nb = n_per_row / traits(type).block_size;
  for (int64_t r = 0; r < n_rows; ++r)
    c.dequant(static_cast<const uint8_t*>(src) + static_cast<size_t>(r) * stride,
              dst + r * n_per_row, nb);
}

}  // namespace berth::ref
