// What a model's step graph needs kept between steps, per layer, described without memory: the
// KV cache rows its attention ops append to (and later the recurrent state of linear-attention
// layers). Models declare it; runtime and the backends allocate it where placement puts it.
#pragma once

#include <cstdint>

namespace berth {

/// Per-layer KV cache row widths (floats per token) that a model's attention ops need: layer l's
/// K is [n_ctx, k_dim] and V is [n_ctx, v_dim], one row per position, dims contiguous.
struct KvLayer {
  int64_t k_dim = 0;  ///< n_head_kv * head_dim
  int64_t v_dim = 0;
};

}  // namespace berth
