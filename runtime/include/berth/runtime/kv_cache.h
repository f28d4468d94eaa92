// The KV cache: per layer, the keys and values of every position processed so far.
#pragma once

#include <cstdint>
#include <vector>

#include "berth/models/model.h"

namespace berth {

/// Host KV cache in f32. Layer l holds K as [n_ctx, k_dim] and V as [n_ctx, v_dim], row-major
/// (one row per position, dims contiguous). Allocated once; n_ctx * sum(k_dim + v_dim) * 4 bytes.
/// Throws Error(out_of_memory) naming the MiB requested if the allocation fails, and
/// Error(invalid_argument) for n_ctx < 1.
class KvCache {
 public:
  KvCache(const std::vector<KvLayer>& layers, int64_t n_ctx);

  int64_t n_ctx() const { return n_ctx_; }
  int32_t n_layer() const { return static_cast<int32_t>(layers_.size()); }
  const KvLayer& layer(int32_t l) const { return layers_.at(static_cast<size_t>(l)); }
  float* k(int32_t l) { return k_[static_cast<size_t>(l)].data(); }
  float* v(int32_t l) { return v_[static_cast<size_t>(l)].data(); }
  /// Total bytes held.
  size_t bytes() const;

 private:
  std::vector<KvLayer> layers_;
  int64_t n_ctx_;
  std::vector<std::vector<float>> k_, v_;
};

}  // namespace berth
