#include "berth/cpu_kernels/quant_dot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "berth/core/error.h"

namespace berth::cpu {

GgmlType activation_type(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0:
      return GgmlType::Q8_0;
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return GgmlType::Q8_K;
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      return GgmlType::F32;
    default:
      throw Error(ErrorCategory::unsupported,
                  fmt::format("no dot product for weights of type {}", type_name(t)));
  }
}

size_t activation_row_bytes(GgmlType t, int64_t n) { return row_bytes(activation_type(t), n); }

void quantize_activation(GgmlType t, const float* x, void* dst, int64_t n) {
  switch (activation_type(t)) {
    case GgmlType::Q8_0:
      detail::quantize_q8_0(x, dst, n);
      return;
    case GgmlType::Q8_K:
      detail::quantize_q8_K(x, dst, n);
      return;
    default:
      std::memcpy(dst, x, static_cast<size_t>(n) * sizeof(float));
      return;
  }
}

void dot_tile(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
              int64_t n_tok, int64_t n, float* out, int64_t out_stride) {
  switch (t) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0:
      detail::dot_tile_legacy(t, w, n_rows, act, act_stride, n_tok, n, out, out_stride);
      return;
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      detail::dot_tile_k(t, w, n_rows, act, act_stride, n_tok, n, out, out_stride);
      return;
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      detail::dot_tile_float(t, w, n_rows, act, act_stride, n_tok, n, out, out_stride);
      return;
    default:
      throw Error(ErrorCategory::unsupported,
                  fmt::format("no dot product for weights of type {}", type_name(t)));
  }
}

void gemm_rows(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
               int64_t n_tok, int64_t n, float* out, int64_t out_stride) {
  if (n_tok <= 1) {  // decode GEMV: stream the rows once, no tiling needed
    dot_tile(t, w, n_rows, act, act_stride, n_tok, n, out, out_stride);
    return;
  }
  const GgmlType at = activation_type(t);  // throws Error(unsupported) for other types
  if ((at == GgmlType::Q8_0 && detail::legacy_gemm_tiles_itself()) ||
      (at == GgmlType::Q8_K && detail::k_gemm_tiles_itself())) {
    // The kernel transposes its tokens into a per-thread scratch (about 300 bytes per token and
    // 256 elements): at most 512 tokens per call bound it (2.4 MiB for n = 4096).
    constexpr int64_t kSelfTokTile = 512;
    const auto* ab = static_cast<const uint8_t*>(act);
    for (int64_t t0 = 0; t0 < n_tok; t0 += kSelfTokTile)
      dot_tile(t, w, n_rows, ab + static_cast<size_t>(t0) * act_stride, act_stride,
               std::min(kSelfTokTile, n_tok - t0), n, out + t0 * out_stride, out_stride);
    return;
  }
  const size_t wrb = row_bytes(t, n);
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  // Row blocks of kGemmRowBlock rows (a multiple of kGemmRowTile): a token tile's activations
  // (64 rows of 4.6 KiB for n = 4096 Q4_K) stay in L2 while the block's rows go by, so they are
  // fetched from L3 once per kGemmRowBlock rows; the block's weights stay in L2 across the token
  // tiles. (16-row blocks re-fetched the activations 4x as often: 16 threads on the Xeon.)
  constexpr int64_t kGemmRowBlock = 4 * kGemmRowTile;
  for (int64_t r0 = 0; r0 < n_rows; r0 += kGemmRowBlock) {
    const int64_t nr = std::min(kGemmRowBlock, n_rows - r0);
    for (int64_t t0 = 0; t0 < n_tok; t0 += kGemmTokTile) {
      const int64_t nt = std::min(kGemmTokTile, n_tok - t0);
      dot_tile(t, wb + static_cast<size_t>(r0) * wrb, nr, ab + static_cast<size_t>(t0) * act_stride,
               act_stride, nt, n, out + t0 * out_stride + r0, out_stride);
    }
  }
}

}  // namespace berth::cpu
