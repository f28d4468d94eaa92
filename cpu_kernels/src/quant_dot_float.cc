// Highway kernels of the float-weight dot tiles: F32, F16 and BF16 weights against F32
// activations (quant_dot.h). Scalar twin: quant_dot_float_ref.cpp (double accumulation).
//
// Weights are widened to f32 exactly (F16: PromoteTo from float16_t, vcvtph2ps on x86;
// BF16: PromoteTo from bfloat16_t, a 16-bit shift) and multiplied with the activations by FMA
// into two float vector accumulators per output (chunk 2c into the first, 2c + 1 into the
// second; a last odd chunk into the first). Elements after the last whole vector are summed in
// float in element order (fused multiply-add) and added after the lane sum of the accumulators.
// This order depends only on n and the target, never on the tile shape, so a matrix split into
// tiles in any way gives bit-identical outputs (quant_dot.h's determinism contract).
//
// GEMM reuse: tokens go in groups of up to four with separate accumulators; each weight
// vector is loaded and widened once per group and used for all of its tokens.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "quant_dot_float.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "berth/core/fp16.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/quant_dot.h"

HWY_BEFORE_NAMESPACE();
namespace berth::cpu::qfloat::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Loads N weights starting at element i as f32.
template <GgmlType T>
HWY_INLINE VF LoadW(const uint8_t* HWY_RESTRICT w, size_t i) {
  const DF df;
  if constexpr (T == GgmlType::F32) {
    return hn::LoadU(df, reinterpret_cast<const float*>(w) + i);
  } else if constexpr (T == GgmlType::F16) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(w) + i));
  } else {
    const hn::Rebind<hwy::bfloat16_t, DF> db;
    return hn::PromoteTo(df, hn::LoadU(db, reinterpret_cast<const hwy::bfloat16_t*>(w) + i));
  }
}

// Scalar weight element i as f32 (tail).
template <GgmlType T>
HWY_INLINE float WAt(const uint8_t* w, size_t i) {
  if constexpr (T == GgmlType::F32) {
    float v;
    std::memcpy(&v, w + 4 * i, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, w + 2 * i, 2);
    if constexpr (T == GgmlType::F16) return fp16_to_f32(h);
    return bf16_to_f32(h);
  }
}

// Chunk of N elements at i for the NT tokens: c_k += w * a[k][i..i+N).
template <int NT>
HWY_INLINE void Fma(const VF w, const float* const* a, size_t i, VF& c0, VF& c1, VF& c2, VF& c3) {
  const DF df;
  c0 = hn::MulAdd(w, hn::LoadU(df, a[0] + i), c0);
  if constexpr (NT > 1) c1 = hn::MulAdd(w, hn::LoadU(df, a[1] + i), c1);
  if constexpr (NT > 2) c2 = hn::MulAdd(w, hn::LoadU(df, a[2] + i), c2);
  if constexpr (NT > 3) c3 = hn::MulAdd(w, hn::LoadU(df, a[3] + i), c3);
}

// res[k] = sum_i w[i] * a[k][i] for k < NT. Accumulators are separate variables (e* for even
// chunks, o* for odd ones) because SVE vectors cannot form arrays.
template <GgmlType T, int NT>
HWY_NOINLINE void RowDot(const uint8_t* HWY_RESTRICT w, const float* const* a, size_t n,
                         float* res) {
  const DF df;
  const size_t N = hn::Lanes(df);
  VF e0 = hn::Zero(df), e1 = e0, e2 = e0, e3 = e0;
  VF o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    Fma<NT>(LoadW<T>(w, i), a, i, e0, e1, e2, e3);
    Fma<NT>(LoadW<T>(w, i + N), a, i + N, o0, o1, o2, o3);
  }
  if (i + N <= n) {
    Fma<NT>(LoadW<T>(w, i), a, i, e0, e1, e2, e3);
    i += N;
  }
  float tail[NT];
  for (int k = 0; k < NT; ++k) tail[k] = 0.0f;
  for (size_t j = i; j < n; ++j) {
    const float wj = WAt<T>(w, j);
    // std::fma: the same single rounding in every NT variant, whatever the compiler's
    // contraction or vectorization of this loop (GCC contracts C++ by default).
    for (int k = 0; k < NT; ++k) tail[k] = std::fma(wj, a[k][j], tail[k]);
  }
  res[0] = hn::GetLane(hn::SumOfLanes(df, hn::Add(e0, o0))) + tail[0];
  if constexpr (NT > 1) res[1] = hn::GetLane(hn::SumOfLanes(df, hn::Add(e1, o1))) + tail[1];
  if constexpr (NT > 2) res[2] = hn::GetLane(hn::SumOfLanes(df, hn::Add(e2, o2))) + tail[2];
  if constexpr (NT > 3) res[3] = hn::GetLane(hn::SumOfLanes(df, hn::Add(e3, o3))) + tail[3];
}

template <GgmlType T>
void Tile(const void* w, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tok,
          int64_t n, float* out, int64_t out_stride) {
  const size_t wrb = static_cast<size_t>(n) * (T == GgmlType::F32 ? 4 : 2);
  const auto* wp = static_cast<const uint8_t*>(w);
  const auto* ap = static_cast<const uint8_t*>(act);
  for (int64_t t0 = 0; t0 < n_tok; t0 += 4) {
    const int nt = static_cast<int>(n_tok - t0 < 4 ? n_tok - t0 : 4);
    const float* a[4];
    for (int k = 0; k < nt; ++k)
      a[k] = reinterpret_cast<const float*>(ap + static_cast<size_t>(t0 + k) * act_stride);
    float* o = out + t0 * out_stride;
    for (int64_t r = 0; r < n_rows; ++r) {
      const uint8_t* wr = wp + static_cast<size_t>(r) * wrb;
      float res[4];
      switch (nt) {
        case 4:
          RowDot<T, 4>(wr, a, static_cast<size_t>(n), res);
          break;
        case 3:
          RowDot<T, 3>(wr, a, static_cast<size_t>(n), res);
          break;
        case 2:
          RowDot<T, 2>(wr, a, static_cast<size_t>(n), res);
          break;
        default:
          RowDot<T, 1>(wr, a, static_cast<size_t>(n), res);
          break;
      }
      for (int k = 0; k < nt; ++k) o[k * out_stride + r] = res[k];
    }
  }
}

void DotTileFloat(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
                  int64_t n_tok, int64_t n, float* out, int64_t out_stride) {
  switch (t) {
    case GgmlType::F32:
      return Tile<GgmlType::F32>(w, n_rows, act, act_stride, n_tok, n, out, out_stride);
    case GgmlType::F16:
      return Tile<GgmlType::F16>(w, n_rows, act, act_stride, n_tok, n, out, out_stride);
    default:
      return Tile<GgmlType::BF16>(w, n_rows, act, act_stride, n_tok, n, out, out_stride);
  }
}

}  // namespace berth::cpu::qfloat::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <fmt/format.h>

#include "berth/core/error.h"

namespace berth::cpu {
namespace qfloat {
HWY_EXPORT(DotTileFloat);
}  // namespace qfloat

namespace detail {

/// cpu::dot_tile for F32, F16 and BF16 weights against F32 activations (quant_dot.h shapes;
/// activation rows are n floats, act_stride bytes apart, 4-byte aligned; weight rows are
/// row_bytes(t, n) bytes apart, aligned to their element size).
/// Throws Error(invalid_argument) for a negative count, a null pointer needed for the work, an
/// act_stride smaller than 4n bytes or an out_stride < n_rows when n_tok > 1; Error(internal)
/// for another type.
void dot_tile_float(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
                    int64_t n_tok, int64_t n, float* out, int64_t out_stride) {
  if (t != GgmlType::F32 && t != GgmlType::F16 && t != GgmlType::BF16)
    throw Error(ErrorCategory::internal,
                fmt::format("dot_tile_float: {} is not f32, f16 or bf16", type_name(t)));
  if (n < 0 || n_rows < 0 || n_tok < 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("dot_tile({}): bad shape n={} n_rows={} n_tok={}", type_name(t), n,
                            n_rows, n_tok));
  if (n_rows == 0 || n_tok == 0) return;
  if (out == nullptr || (n > 0 && (w == nullptr || act == nullptr)))
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("dot_tile({}): null pointer for a {}x{} tile", type_name(t), n_rows, n_tok));
  if (n_tok > 1 && (act_stride < static_cast<size_t>(n) * sizeof(float) || out_stride < n_rows))
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("dot_tile({}): act_stride {} (row {} bytes) or out_stride {} "
                            "(n_rows {}) too small",
                            type_name(t), act_stride, static_cast<size_t>(n) * sizeof(float),
                            out_stride, n_rows));
  HWY_DYNAMIC_DISPATCH(qfloat::DotTileFloat)
  (t, w, n_rows, act, act_stride, n_tok, n, out, out_stride);
}

}  // namespace detail
}  // namespace berth::cpu
#endif  // HWY_ONCE
