// Scalar twin of the float-weight dot products (F32, F16, BF16 weights against F32
// activations), used by ref::dot_tile and by the oracle tests of quant_dot_float.cc.
//
// Each weight element is decoded exactly to f32 (fp16_to_f32 / bf16_to_f32 of berth/core/fp16.h,
// IEEE-754 binary16 and bfloat16), the product with the activation is formed and accumulated in
// double in element order, and the sum is rounded to float once at the end. Double accumulation
// makes this twin more accurate than any float SIMD order, so it is a fair oracle for them.
#include <fmt/format.h>

#include <cstring>

#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/cpu_kernels/quant_dot.h"

namespace berth::ref::detail {

/// One output of ref::dot_tile for a float weight type: sum_i W[i] * act[i] over n elements
/// (w: n elements of type t, act: n floats), accumulated in double. n < 0 gives
/// Error(invalid_argument); a type other than F32/F16/BF16 gives Error(internal).
float dot_float(GgmlType t, const void* w, const float* act, int64_t n) {
  if (n < 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("ref::dot_float: negative row length {} ({})", n, type_name(t)));
  const auto* p = static_cast<const uint8_t*>(w);
  double sum = 0.0;
  switch (t) {
    case GgmlType::F32:
      for (int64_t i = 0; i < n; ++i) {
        float v;
        std::memcpy(&v, p + 4 * i, 4);
        sum += static_cast<double>(v) * static_cast<double>(act[i]);
      }
      break;
    case GgmlType::F16:
    case GgmlType::BF16: {
      const bool is_f16 = t == GgmlType::F16;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        const float v = is_f16 ? fp16_to_f32(h) : bf16_to_f32(h);
        sum += static_cast<double>(v) * static_cast<double>(act[i]);
      }
      break;
    }
    default:
      throw Error(
          ErrorCategory::internal,
          fmt::format("ref::dot_float: weight type {} is not F32, F16 or BF16", type_name(t)));
  }
  return static_cast<float>(sum);
}

}  // namespace berth::ref::detail
