// The tolerances of the attention oracles of tests/gpu, with their reasons.
#pragma once

#include <cstdint>

#include "berth/gpu_kernels/kernels.h"

namespace berth::test {

// The f32 kernels keep scores and sums in f32 (dot products over head_dim, exp2f of log2-domain
// scores, P.V sums over up to a few thousand rows, split merging); the reference is double
// throughout on the same f16 K/V. A masking slip of one row moves the NMSE to ~1e-6 or more at
// these lengths.
constexpr double kTolAttention = 1e-9;

// The tensor-core prompt kernel rounds Q (with its scale) and each tile's P to f16 (relative
// error up to 2^-11 each, as FlashAttention's f16 kernels do); over the tests' scores (standard
// deviation about 2.25) that puts the NMSE near 1e-7..1e-6. A masking slip of one row at the
// tests' lengths (a few hundred positions) moves it past 1e-5, and rows that must not be read
// hold NaN.
constexpr double kTolAttentionMma = 2e-6;

/// Whether attention runs prompt rows of this head dim on the tensor-core kernel on the current
/// device (the tests' cache buffers come from cudaMalloc, 256-byte aligned).
inline bool prompt_on_mma(int32_t head_dim) {
  return gpu::detail::attention_prompt_on_mma(head_dim, true);
}

/// The tolerance of a call with (prompt_rows) or without prompt rows of this head dim.
inline double attention_tol(int32_t head_dim, bool prompt_rows) {
  return prompt_rows && prompt_on_mma(head_dim) ? kTolAttentionMma : kTolAttention;
}

}  // namespace berth::test
