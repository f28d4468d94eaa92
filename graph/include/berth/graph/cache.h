// What a model's step graph needs kept between steps, per layer, described without memory: the
// KV cache rows its attention ops append to (and later the recurrent state of linear-attention
// layers: conv_dim / ssm_dim). Models declare it; runtime and the backends allocate it.
#pragma once

#include <cstdint>

namespace berth {

/// Per-layer KV cache row widths (floats per token) that a model's attention ops need: layer l's
/// K is [n_ctx, k_dim] and V is [n_ctx, v_dim], one row per position, dims contiguous.
///
/// A recurrent layer (a Gated DeltaNet: graph ops ssm_conv, gated_delta) has no K/V rows
/// (k_dim = v_dim = 0) but a fixed-size state per sequence, whatever the context: conv_dim f32
/// values of conv state ((kernel - 1) rows of the conv channels, channels contiguous) and ssm_dim
/// f32 values of delta-rule state (H_v heads of d_k x d_v, d_v contiguous).
struct KvLayer {
  int64_t k_dim = 0;  ///< n_head_kv * head_dim
  int64_t v_dim = 0;
  int64_t conv_dim = 0;  ///< recurrent layers: (ssm.conv_kernel - 1) * conv channels
  int64_t ssm_dim = 0;   ///< recurrent layers: H_v * d_k * d_v
  /// Whether the layer keeps a recurrent state (which cannot be cut back to an earlier
  /// position).
  bool recurrent() const { return conv_dim > 0 || ssm_dim > 0; }
};

}  // namespace berth
