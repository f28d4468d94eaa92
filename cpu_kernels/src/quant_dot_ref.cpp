// Scalar twins of quant_dot.h: the dispatcher; the per-family bodies live in
// quant_dot_legacy_ref.cpp, quant_dot_k_ref.cpp and quant_dot_float_ref.cpp.
#include <fmt/format.h>

#include <cstring>

#include "berth/core/error.h"
#include "berth/cpu_kernels/quant_dot.h"
#include "berth/cpu_kernels/quants_ref.h"

namespace berth::ref {
namespace detail {
// One output: the dot product of one weight row (n elements of type t) with one activation row.
float dot_legacy(GgmlType t, const void* w, const void* act, int64_t n);  // Q4_0..Q8_0 x Q8_0
float dot_k(GgmlType t, const void* w, const void* act, int64_t n);       // Q2_K..Q6_K x Q8_K
float dot_float(GgmlType t, const void* w, const float* act, int64_t n);  // F32/F16/BF16 x F32
}  // namespace detail

void quantize_activation(GgmlType t, const float* x, void* dst, int64_t n) {
  const GgmlType a = cpu::activation_type(t);
  if (a == GgmlType::F32) {
    std::memcpy(dst, x, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  quantize_row(a, x, dst, n);
}

void dot_tile(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
              int64_t n_tok, int64_t n, float* out, int64_t out_stride) {
  const GgmlType a = cpu::activation_type(t);
  const size_t wrb = row_bytes(t, n);
  for (int64_t r = 0; r < n_rows; ++r) {
    const void* wr = static_cast<const uint8_t*>(w) + static_cast<size_t>(r) * wrb;
    for (int64_t tk = 0; tk < n_tok; ++tk) {
      const void* ar = static_cast<const uint8_t*>(act) + static_cast<size_t>(tk) * act_stride;
      float v;
      if (a == GgmlType::Q8_0)
        v = detail::dot_legacy(t, wr, ar, n);
      else if (a == GgmlType::Q8_K)
        v = detail::dot_k(t, wr, ar, n);
      else
        v = detail::dot_float(t, wr, static_cast<const float*>(ar), n);
      out[tk * out_stride + r] = v;
    }
  }
}

}  // namespace berth::ref
